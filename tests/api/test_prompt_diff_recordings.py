"""The diverged detector (loomserve.api.prompt_diff.scan) on real agent-client sessions: the
committed recordings of Claude Code, Codex and opencode (benchmarks/agent_clients/
record_sessions.py, 3 turns each against the built-in model) still parse, and scan finds the
divergence points documented in docs/design/miss-causes.md, at the same request, message and
byte; the server's own attribution recorded beside each request agrees with where they are."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from benchmarks.agent_clients.divergence import RECORDINGS, analyse, scan_turns
from benchmarks.agent_clients.recordings import canon, load
from loomserve.api.prompt_diff import scan

# client -> [(request index, kind, message index, byte offset)], as the design page explains
EXPECTED = {
    # Claude Code, resumed with --continue, drops the "Output token limit hit" user messages it
    # had added between the replies it cut (its moved cache_control markers are no edit)
    "claude": [(7, "edited", 5, 12), (11, "edited", 10, 12)],
    # Codex only appends (its instructions, tools and earlier items never change)
    "codex": [],
    # opencode at an 8K context: a title request, then agent requests alternating with
    # context-summary requests, all under one x-session-id (different tools: message 0)
    "opencode-context8k": [(i, "edited", 0, 11) for i in range(1, 7)],
    # opencode: its title request, then the agent's under the same session; then appends
    "opencode": [(1, "edited", 0, 11)],
}


# client -> [(request index, tokens the core charged to `diverged`, who saw it)]
SERVER = {
    "claude": [(4, 144, "tokens only"), (5, 224, "tokens only"), (6, 128, "tokens only"),
               (7, 800, "client"), (8, 176, "tokens only"), (9, 192, "tokens only"),
               (10, 224, "tokens only"), (11, 896, "client"), (12, 240, "tokens only"),
               (13, 240, "tokens only"), (14, 224, "tokens only")],
    "codex": [(2, 240, "tokens only")],
    "opencode-context8k": [(1, 592, "client"), (2, 736, "client"), (4, 1056, "client"),
                           (6, 1040, "client")],
    "opencode": [(1, 592, "client"), (2, 32, "tokens only"), (3, 176, "tokens only")],
}


def recording(client: str) -> str:
    return os.path.join(RECORDINGS, f"{client}.jsonl")


@pytest.mark.parametrize("client", sorted(EXPECTED))
def test_recording_is_whole_and_small(client):
    """Each blob is the value its hash names (load restores the bodies the client sent), and
    every request has the server's record and the client's metadata."""
    path = recording(client)
    assert os.path.getsize(path) < 1 << 20
    with open(path) as f:
        lines = [json.loads(line) for line in f]
    for rec in lines:
        if "blob" in rec:
            assert hashlib.sha256(canon(rec["value"]).encode()).hexdigest()[:16] == rec["blob"]
    meta, records = load(path)
    assert client.startswith(meta["client"]) and meta["version"]
    assert {r["turn"] for r in records} == {t["turn"] for t in meta["turns"]}
    for r in records:
        srv = r["server"]
        if srv is None:  # no byte came back: the client dropped it (Claude Code's retries),
            # or a stopped session's last request
            assert r["usage"] is None
            continue
        assert srv["prompt_tokens"] - srv["cached_tokens"] == sum(srv["miss_causes"].values())


@pytest.mark.parametrize("client", sorted(EXPECTED))
def test_scan_finds_the_documented_divergences(client):
    _, records = load(recording(client))
    found = [(i, d.kind, d.message_index, d.byte_offset) for i, d in scan(scan_turns(records))]
    assert found == EXPECTED[client]


@pytest.mark.parametrize("client", sorted(EXPECTED))
def test_server_view_beside_the_client_one(client):
    """The requests the core charged `diverged` tokens to, and which side saw the change: the
    client's request (scan), or the tokens only (the text extends: a reply re-encoded)."""
    got = [(p["request"], p["diverged_tokens"], p["seen_by"])
           for p in analyse(recording(client))["server_points"]]
    assert got == SERVER[client]


def test_a_moved_cache_breakpoint_is_no_edit():
    """Claude Code puts its cache_control marker on the newest message each request: the
    message that lost it renders the same, so it is not reported; a changed text still is."""
    def user(text, mark=False):
        block = {"type": "text", "text": text}
        return {"role": "user", "content": [block | ({"cache_control": {"type": "ephemeral"}}
                                                     if mark else {})]}
    first = [user("Read greet.py", mark=True)]
    then = [user("Read greet.py"), {"role": "assistant", "content": "ok"}, user("next", True)]
    edited = [user("Read main.py"), *then[1:]]
    assert scan([{"session": "s", "messages": first}, {"session": "s", "messages": then}]) == []
    found = scan([{"session": "s", "messages": first}, {"session": "s", "messages": edited}])
    assert [(i, d.kind, d.message_index) for i, d in found] == [(1, "edited", 0)]
