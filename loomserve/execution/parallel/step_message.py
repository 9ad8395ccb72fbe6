"""The step message: what a worker rank needs of a step's ModelInput, sent once per step.

Compact by construction: msgpack of array-like structs (no field names), only the fields a
non-driver rank uses (it runs the forward pass; rank 0 alone samples, so sampling parameters,
histories and grammar bitmasks stay on rank 0), and block tables as diffs. A request's block
table for a KV group only grows while its list object lives (the scheduler's invariant, see
batch.ScheduledSeq); the driver sends the ids appended since the last step, or the whole list
with its `reset` bit when the list object changed (a preempted and readmitted request) or the
worker cannot have it. Driver (BlockSyncSender) and worker (BlockSyncReceiver) apply the same
forgetting rule to the same message sequence, so they always know the same requests.
"""

from __future__ import annotations

import msgspec
import torch
import torch.distributed as dist

from loomserve.execution.batch import ModelInput, ScheduledSeq
from loomserve.kv.directives import StateDirective


class SeqStep(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    token_ids: list[int]
    start_pos: int
    sample: bool
    reset: int  # bit g set: blocks[g] is group g's whole table, not an append
    blocks: list[list[int]]  # per KV group: ids to append (or the whole table, see reset)
    # linear/SSM-state groups only (hybrid models): per group [g, running_block, init_from
    # (-1: none), zero_init, n0, page0, n1, page1, ...] (StateDirective, flattened)
    states: list[list[int]] = []
    num_draft: int = 0  # speculative decoding: every rank computes the drafts' logits rows


class StepMessage(msgspec.Struct, array_like=True, gc=False):
    seqs: list[SeqStep]
    finished: list[str]
    shutdown: bool = False


def _forget(known: dict, finished: list[str], current: list[str]) -> None:
    """The rule both sides apply before a step's seqs: drop finished requests, and bound what
    aborted requests leave behind (the runner's own BlockTables rule)."""
    for rid in finished:
        known.pop(rid, None)
    if len(known) > 4 * max(64, len(current)):
        keep = set(current)
        for rid in [r for r in known if r not in keep]:
            del known[rid]


class BlockSyncSender:
    """Driver side: ModelInput -> StepMessage, remembering what each worker already holds."""

    def __init__(self) -> None:
        self.sent: dict[str, list[tuple[list[int], int]]] = {}  # rid -> per group (list, length)

    def message(self, inp: ModelInput) -> StepMessage:
        seqs = inp.seqs
        _forget(self.sent, inp.finished_request_ids, [s.request_id for s in seqs])
        return StepMessage([self._seq(s) for s in seqs], list(inp.finished_request_ids))

    def _seq(self, s: ScheduledSeq) -> SeqStep:
        # ~1.5 us a seq on the 2-core host: ~50 us for a 32-stream decode step
        prev = self.sent.get(s.request_id)
        reset, blocks, now = 0, [], []
        for g, ids in enumerate(s.block_ids):
            # Slices end at n: under --async-scheduling the core thread appends the next
            # step's blocks to these lists while this step's message is encoded.
            n = len(ids)
            if prev is not None and g < len(prev):
                src, had = prev[g]
                if src is ids and had <= n:
                    blocks.append(ids[had:n])
                    now.append((ids, n))
                    continue
            reset |= 1 << g
            blocks.append(ids[:n])
            now.append((ids, n))
        self.sent[s.request_id] = now
        if s.states or s.num_draft:
            return SeqStep(s.request_id, s.token_ids, s.start_pos, s.sample, reset, blocks,
                           [_flat_state(g, d) for g, d in s.states.items()], s.num_draft)
        return SeqStep(s.request_id, s.token_ids, s.start_pos, s.sample, reset, blocks)


class BlockSyncReceiver:
    """Worker side: StepMessage -> ModelInput with block lists of its own that only grow
    (so the runner's incremental BlockTables see stable list objects)."""

    def __init__(self) -> None:
        self.tables: dict[str, list[list[int]]] = {}

    def model_input(self, msg: StepMessage) -> ModelInput:
        _forget(self.tables, msg.finished, [s.request_id for s in msg.seqs])
        return ModelInput([self._seq(s) for s in msg.seqs], msg.finished)

    def _seq(self, s: SeqStep) -> ScheduledSeq:
        have = self.tables.get(s.request_id)
        out = []
        for g, ids in enumerate(s.blocks):
            if s.reset >> g & 1 or have is None or g >= len(have):
                out.append(list(ids))
            else:
                have[g].extend(ids)
                out.append(have[g])
        self.tables[s.request_id] = out
        seq = ScheduledSeq(s.request_id, s.token_ids, s.start_pos, out, s.sample, None,
                           num_draft=s.num_draft)
        if s.states:
            seq.states = dict(_state_of(f) for f in s.states)
        return seq


def _flat_state(g: int, d: StateDirective) -> list[int]:
    out = [g, d.running_block, -1 if d.init_from is None else d.init_from, int(d.zero_init)]
    for n, page in d.saves:
        out += (n, page)
    return out


def _state_of(f: list[int]) -> tuple[int, StateDirective]:
    saves = [(f[i], f[i + 1]) for i in range(4, len(f), 2)]
    return f[0], StateDirective(f[1], None if f[2] < 0 else f[2], bool(f[3]), saves)


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(StepMessage)


def encode(msg: StepMessage) -> bytes:
    return _ENCODER.encode(msg)


def decode(data) -> StepMessage:
    return _DECODER.decode(data)


FIRST_BYTES = 4096  # one broadcast carries a step message up to this size (a decode step's)
_LEN = 8


def broadcast_step(payload: bytes | None, group) -> StepMessage | None:
    """Rank 0 passes the encoded message and gets None; the other ranks pass None and get it.
    One gloo broadcast of FIRST_BYTES (an 8-byte length, then the message's start); a second
    one only for the rest of a larger message (a prefill's token ids)."""
    head = torch.zeros(FIRST_BYTES, dtype=torch.uint8)
    if payload is not None:
        n = len(payload)
        head[:_LEN] = torch.tensor([n], dtype=torch.int64).view(torch.uint8)
        first = min(n, FIRST_BYTES - _LEN)
        head[_LEN:_LEN + first] = torch.frombuffer(bytearray(payload[:first]), dtype=torch.uint8)
    dist.broadcast(head, src=0, group=group)
    n = int(head[:_LEN].view(torch.int64).item())
    rest = n - (FIRST_BYTES - _LEN)
    if rest > 0:
        tail = (torch.frombuffer(bytearray(payload[FIRST_BYTES - _LEN:]), dtype=torch.uint8)
                if payload is not None else torch.empty(rest, dtype=torch.uint8))
        dist.broadcast(tail, src=0, group=group)
    if payload is not None:
        return None
    body = head[_LEN:_LEN + n].numpy().tobytes()
    return decode(body + tail.numpy().tobytes() if rest > 0 else body)
