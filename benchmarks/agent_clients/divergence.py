"""Where real agent clients' prompts stop extending their previous ones: `prompt_diff.scan` over
the recorded sessions (record_sessions.py), beside what the server said about the same requests.

A request's prompt, as scan compares it, is the API body's content in the order a prompt is
built: message 0 the tool schemas, message 1 the system prompt (Messages `system`, Responses
`instructions`; Chat Completions carry it among their messages, so there message 1 is the
first of them), then the API's messages (Messages, Chat Completions) or input items
(Responses). Requests are grouped by the session the server resolved for them (its request
log's session_id), so scan sees what the server's "previous request of the session" was.

Per client: the requests and turns, each divergence point (turn, request, kind, message index
and role, byte offset in that message's canonical JSON, excerpts of both sides), and the
server's view of the same requests: the uncached prompt tokens by cause (the usage's
`miss_causes`), the core's first differing token (`miss_detail.diverged`) and the front end's
text-side divergence (`prompt_divergence`, byte offset in the rendered prompt). Each request
the core charged `diverged` tokens to is listed (`server_points`) with the side that saw the
change: the client's request (scan), the rendered text only, or the tokens only.

    python benchmarks/agent_clients/divergence.py     # -> results/agent_divergence.json
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from common.paths import RESULTS_DIR  # noqa: E402
from common.results import write_json  # noqa: E402
from recordings import load  # noqa: E402

from loomserve.api.prompt_diff import scan  # noqa: E402

RESULT = "agent_divergence.json"
RECORDINGS = os.path.join(RESULTS_DIR, "agent_recordings")


def prompt_messages(path: str, body: dict) -> list:
    """The request's prompt as scan compares it: tools, system, then the conversation."""
    out = [{"role": "tools", "content": body.get("tools")}]
    if path == "/v1/messages":
        out.append({"role": "system", "content": body.get("system")})
        return out + list(body.get("messages") or [])
    if path == "/v1/responses":
        out.append({"role": "system", "content": body.get("instructions")})
        items = body.get("input")
        return out + (list(items) if isinstance(items, list)
                      else [{"role": "user", "content": items}])
    return out + list(body.get("messages") or [])


def session_of(rec: dict) -> str:
    """The session the server resolved (its request log), else none recorded."""
    return (rec.get("server") or {}).get("session_id") or ""


def scan_turns(records: list[dict]) -> list[dict]:
    return [{"session": session_of(r), "messages": prompt_messages(r["path"], r["body"])}
            for r in records]


def _role(message) -> str:
    if not isinstance(message, dict):
        return "?"
    return str(message.get("role") or message.get("type") or "?")


def analyse(path: str, server: str | None = None) -> dict:
    meta, records = load(path)
    turns = scan_turns(records)
    points = []
    for i, d in scan(turns):
        msgs = turns[i]["messages"]
        srv = records[i].get("server") or {}
        points.append({
            "request": i, "turn": records[i]["turn"], "kind": d.kind,
            "message_index": d.message_index,
            "message_role": _role(msgs[d.message_index]) if 0 <= d.message_index < len(msgs)
            else "-",
            "byte_offset": d.byte_offset, "previous": d.previous, "current": d.current,
            "server_miss_causes": (records[i].get("usage") or {}).get("miss_causes"),
            "server_diverged": (srv.get("miss_detail") or {}).get("diverged"),
            "server_text_divergence": srv.get("prompt_divergence")})
    client_found = {p["request"] for p in points}
    server_points = [_server_point(i, r, i in client_found, _previous(records, turns, i))
                     for i, r in enumerate(records)
                     if ((r.get("server") or {}).get("miss_causes") or {}).get("diverged")]
    for p in server_points:
        if server and p["seen_by"] == "tokens only" and p["in"] == "previous reply":
            p["reply_reencoded"] = reencoded(server, records, turns, p)
    causes: Counter = Counter()
    prompt = cached = 0
    for r in records:
        srv = r.get("server") or {}
        causes.update(srv.get("miss_causes") or {})
        prompt += srv.get("prompt_tokens") or 0
        cached += srv.get("cached_tokens") or 0
    return {
        "client": meta.get("client"), "version": meta.get("version"),
        "label": _label(path, meta),
        "recording": os.path.relpath(path, os.path.dirname(RESULTS_DIR)),
        "recording_bytes": os.path.getsize(path),
        "paths": sorted({r["path"] for r in records}),
        "turns": meta.get("turns"), "requests": len(records),
        "requests_per_turn": dict(Counter(str(r["turn"]) for r in records)),
        "sessions": len({t["session"] for t in turns if t["session"]}),
        "prompt_tokens": prompt, "cached_tokens": cached,
        "miss_causes": dict(causes), "diverged_tokens": causes.get("diverged", 0),
        "per_request": [_request_row(i, r, turns[i]) for i, r in enumerate(records)],
        "points": points, "server_points": server_points}


def _label(path: str, meta: dict) -> str:
    """"codex-cli 0.171.0", "opencode 1.18.33 (context8k)": the version, the client's name
    where the version lacks it, the recording's variant."""
    name = os.path.splitext(os.path.basename(path))[0]
    client, _, variant = name.partition("-")
    version = str(meta.get("version") or "?")
    label = version if client.lower() in version.lower() else f"{client} {version}"
    return f"{label} ({variant})" if variant else label


def _previous(records: list[dict], turns: list[dict], i: int) -> dict:
    """The server's record of the session's request before request i ({} if none)."""
    j = max((k for k in range(i) if turns[k]["session"] == turns[i]["session"]), default=None)
    return (records[j].get("server") or {}) if j is not None else {}


def _server_point(i: int, r: dict, client_changed: bool, prev: dict) -> dict:
    """A request the core charged `diverged` tokens to: where its first differing token lies
    (`in` the previous request's prompt, or in the reply that request generated) and which
    side saw the change: the client's request (scan), the rendered text (the front end), or
    the tokens only (the text extends the previous prompt, its tokens do not: in the reply,
    the client's copy of it re-encodes to other tokens than those generated)."""
    srv = r["server"]
    text = srv.get("prompt_divergence")
    token = ((srv.get("miss_detail") or {}).get("diverged") or {}).get("token")
    where = ("previous reply" if token is not None and prev.get("prompt_tokens") is not None
             and token >= prev["prompt_tokens"] else "previous prompt")
    seen = ("client" if client_changed and where == "previous prompt" else "text" if text
            else "tokens only")
    return {"request": i, "turn": r["turn"], "diverged_tokens": srv["miss_causes"]["diverged"],
            "token": token, "prompt_tokens": srv.get("prompt_tokens"),
            "previous_prompt_tokens": prev.get("prompt_tokens"), "in": where,
            "text_divergence": text, "seen_by": seen}


def _request_row(i: int, r: dict, turn: dict) -> dict:
    srv = r.get("server") or {}
    return {"request": i, "turn": r["turn"], "session": turn["session"][-12:],
            "messages": len(turn["messages"]), "prompt_tokens": srv.get("prompt_tokens"),
            "cached_tokens": srv.get("cached_tokens"), "miss_causes": srv.get("miss_causes"),
            "output_tokens": srv.get("output_tokens")}


def _text_of(message) -> str:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return content
    return "".join(b.get("text", "") for b in content or [] if isinstance(b, dict))


def reencoded(server: str, records: list[dict], turns: list[dict], point: dict) -> dict | None:
    """For a `tokens only` point past the previous request's prompt (in the reply it
    generated): the reply as the client sent it back, re-encoded by the server's tokenizer
    (/tokenize), around the first differing token. The generated tokens were other ids for
    the same text."""
    import httpx

    i = point["request"]
    j = max(k for k in range(i) if turns[k]["session"] == turns[i]["session"])
    prev = records[j]["server"]
    at = point["token"] - prev["prompt_tokens"]
    replies = [m for m in turns[i]["messages"][len(turns[j]["messages"]):]
               if _role(m) == "assistant"]
    if not replies:
        return None
    ids = httpx.post(f"{server}/tokenize", json={"prompt": _text_of(replies[0]),
                                                 "add_special_tokens": False}).json()["tokens"]
    window = [[t, httpx.post(f"{server}/detokenize", json={"tokens": [t]}).json()["prompt"]]
              for t in ids[max(0, at - 3):at + 2]]
    return {"reply_token": at, "reply_tokens_reencoded": len(ids),
            "reply_tokens_generated": prev.get("output_tokens"), "window_from": max(0, at - 3),
            "window": window}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recordings", default=RECORDINGS)
    ap.add_argument("--out", default=RESULT)
    ap.add_argument("--server", default=None,
                    help="a loomserve serving the recorded model: its /tokenize re-encodes the "
                         "replies at token-only divergences")
    args = ap.parse_args()
    clients = [analyse(p, args.server)
               for p in sorted(glob.glob(os.path.join(args.recordings, "*.jsonl")))]
    for c in clients:
        print(f"{c['label']}: {c['requests']} requests, "
              f"{len(c['points'])} divergence points, diverged {c['diverged_tokens']} tokens, "
              f"causes {c['miss_causes']}")
        for p in c["server_points"]:
            print(f"  server: request {p['request']} (turn {p['turn']}): {p['diverged_tokens']} "
                  f"diverged tokens from token {p['token']} of {p['prompt_tokens']} (in the "
                  f"{p['in']}), seen by {p['seen_by']}; {p.get('reply_reencoded') or ''}")
        for p in c["points"]:
            print(f"  request {p['request']} (turn {p['turn']}): {p['kind']} message "
                  f"{p['message_index']} ({p['message_role']}) at byte {p['byte_offset']}: "
                  f"{p['previous']!r} -> {p['current']!r}")
    print("wrote", write_json(args.out, {"recordings": os.path.relpath(args.recordings,
                                                                       RESULTS_DIR),
                                         "clients": clients}))


if __name__ == "__main__":
    main()
