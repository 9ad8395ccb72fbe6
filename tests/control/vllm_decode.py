"""Decode captured KV event frames with vLLM's own classes; run by the vLLM PEER python.

Usage: <peer python> tests/control/vllm_decode.py FRAMES.json   (or "-": the JSON on stdin, read
after vLLM is imported, so a caller can start the slow import before it has the frames)
FRAMES.json: {"frames": [[topic_b64, seq_b64, payload_b64], ...]} as a subscriber captured them.
Prints one JSON document: [{"seq", "ts", "data_parallel_rank", "events": [...]}, ...], each
event {"type": its vLLM class name, "module": where the class lives, fields...} with hashes in
hex. batch_json() is shared with the test, which renders loomserve's own decode the same way.
"""

from __future__ import annotations

import base64
import json
import sys


def _hex(h):
    return h.hex() if isinstance(h, bytes) else h


def event_json(e) -> dict:
    d = {"type": type(e).__name__}
    for f in e.__struct_fields__:
        v = getattr(e, f)
        if f == "block_hashes":
            v = [_hex(h) for h in v]
        elif f == "parent_block_hash":
            v = _hex(v)
        d[f] = v
    return d


def batch_json(seq: int, batch) -> dict:
    return {"seq": seq, "ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank,
            "events": [event_json(e) for e in batch.events]}


def main(path: str) -> None:
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch  # the peer's vLLM, never loomserve's

    dec = msgspec.msgpack.Decoder(KVEventBatch)
    if path == "-":
        frames = json.load(sys.stdin)["frames"]
    else:
        with open(path) as f:
            frames = json.load(f)["frames"]
    out = []
    for topic, seq, payload in frames:
        batch = dec.decode(base64.b64decode(payload))
        doc = batch_json(int.from_bytes(base64.b64decode(seq), "big", signed=True), batch)
        doc["topic"] = base64.b64decode(topic).decode()
        doc["modules"] = sorted({type(e).__module__ for e in batch.events})
        out.append(doc)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1])
