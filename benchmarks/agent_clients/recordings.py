"""Compact recordings of agent-client sessions: the request sequence `prompt_diff.scan` needs,
with the server's view of each request.

A recording is JSON lines. The first is the session's metadata ({"meta": {...}}: client,
version, server command, turns). Then, in order, `{"blob": h, "value": v}` lines (a large value,
stored once: h is the first 16 hex digits of the SHA-256 of its canonical JSON) and request
lines: {"seq", "turn", "path", "status", "headers" (only those that name the client or the
session), "output_capped" (the proxy's cap on the output tokens, where it lowered the
client's), "body" (the request body whole, its `tools`, `system`, `instructions` and each
large message replaced by {"$blob": h}), "usage" (the response's), "server" (the request log line:
request_id, prompt/cached tokens, miss_causes, miss_detail, prompt_divergence)}. `load`
restores each body exactly, so byte offsets found in it are the client's.

Invariant: load(compact(x)) bodies == the bodies the client sent.
"""

from __future__ import annotations

import hashlib
import json
import subprocess

API_PATHS = ("/v1/messages", "/v1/responses", "/v1/chat/completions")
KEEP_HEADERS = ("user-agent", "anthropic-version", "anthropic-beta", "x-app", "x-session-id",
                "session-id", "session_id", "x-claude-code-session-id", "conversation_id",
                "originator", "version", "x-stainless-lang", "x-stainless-package-version",
                "thread-id", "x-codex-window-id", "x-codex-turn-metadata", "x-client-request-id",
                "x-session-affinity")
BLOB_FIELDS = ("tools", "system", "instructions")
BLOB_MIN = 1024  # characters of canonical JSON from which a message is stored once


def canon(value) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _blob(value, blobs: dict, out: list) -> dict:
    text = canon(value)
    h = hashlib.sha256(text.encode()).hexdigest()[:16]
    if h not in blobs:
        blobs[h] = value
        out.append({"blob": h, "value": value})
    return {"$blob": h}


def compact_body(body: dict, blobs: dict, out: list) -> dict:
    """The body with its large parts replaced by blob references (new blobs appended to out)."""
    body = dict(body)
    for key in BLOB_FIELDS:
        if body.get(key):
            body[key] = _blob(body[key], blobs, out)
    for key in ("messages", "input"):
        if isinstance(body.get(key), list):
            body[key] = [_blob(m, blobs, out) if len(canon(m)) >= BLOB_MIN else m
                         for m in body[key]]
    return body


def _expand(value, blobs: dict):
    if isinstance(value, dict) and set(value) == {"$blob"}:
        return blobs[value["$blob"]]
    return value


def load(path: str) -> tuple[dict, list[dict]]:
    """(metadata, request records with their bodies restored)."""
    meta, blobs, records = {}, {}, []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if "meta" in rec:
                meta = rec["meta"]
            elif "blob" in rec:
                blobs[rec["blob"]] = rec["value"]
            else:
                body = {k: _expand(v, blobs) for k, v in rec["body"].items()}
                for key in ("messages", "input"):
                    if isinstance(body.get(key), list):
                        body[key] = [_expand(m, blobs) for m in body[key]]
                records.append({**rec, "body": body})
    return meta, records


def server_lines(server_log: str) -> dict[str, dict]:
    """request id -> the server's request-log fields (the finished line and the debug miss
    line merged)."""
    out: dict[str, dict] = {}
    with open(server_log, errors="replace") as f:
        for line in f:
            if not line.startswith("{"):
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            rid = rec.get("request_id")
            if rec.get("logger") != "loomserve.requests" or not rid:
                continue
            keep = {k: rec[k] for k in ("session_id", "prompt_tokens", "cached_tokens",
                                        "output_tokens", "miss_causes", "miss_detail",
                                        "prompt_divergence") if k in rec}
            out.setdefault(rid, {"request_id": rid}).update(keep)
    return out


def compact_session(proxy_log: str, server_log: str, client: str, meta: dict, path: str) -> str:
    """Write the recording of `client`'s requests (proxy labels client/turn) to path."""
    with open(proxy_log) as f:
        entries = [json.loads(line) for line in f]
    ends = {e["stream_end_of"]: e for e in entries if "stream_end_of" in e}
    server = server_lines(server_log)
    blobs: dict = {}
    lines: list = [{"meta": meta}]
    for n, e in enumerate(entries, 1):
        label = str(e.get("client", ""))
        if (not label.startswith(client + "/") or e.get("method") != "POST"
                or e.get("path") not in API_PATHS or not isinstance(e.get("request"), dict)):
            continue
        end = ends.get(n, {})
        rid = end.get("response_id") or e.get("response_id")
        headers = {k: v for k, v in e.get("headers", {}).items() if k.lower() in KEEP_HEADERS}
        body = compact_body(e["request"], blobs, lines)
        lines.append({"seq": n, "turn": int(label.split("/")[1]), "path": e["path"],
                      "status": e["status"], "headers": headers, "body": body,
                      "output_capped": e.get("output_capped"),
                      "usage": end.get("usage") or e.get("usage"),
                      "server": server.get(rid) if rid else None})
    with open(path, "w") as f:
        for rec in lines:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return path


def client_version(bin_dir: str, name: str) -> str:
    out = subprocess.run([f"{bin_dir}/{name}", "--version"], capture_output=True, text=True,
                         timeout=60)
    return (out.stdout or out.stderr).strip().splitlines()[0]
