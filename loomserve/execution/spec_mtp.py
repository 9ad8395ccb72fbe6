"""MTP drafts (`"method": "mtp"`): the checkpoint's multi-token-prediction modules propose the
next step's drafts from this step's hidden states, in the execution plane after the target ran.

After each step, for every request, the first MTP module runs over the step's rows whose next
token is now known: a row at position p gets the target's final hidden state h_p (the model's
`last_hidden`: its output, after the final norm, in every family) and the token at p + 1,
which is the next row's token, or for the last accepted row the token just sampled (with
drafts: rows 0..a, the accepted drafts then the token sampled after them; rejected rows are not
run). Its K/V rows go to the module's own attention layer (MLA for DeepSeek-V3, sparse MLA for
DeepSeek-V3.2: a latent row and an indexer key, two groups' metadata; GQA for GLM-4.5, Qwen3-Next
and Qwen3.5) at the same positions and slots, so every position the
target has accepted also has its MTP row, computed from the accepted tokens: rejected drafts
leave nothing behind that the next steps do not overwrite, and a page holds the MTP row with the
target's (prefix hits, tiers, P/D move it).
A prefill chunk that does not end the prompt holds its last row back (its next token is the
next chunk's first) and runs it at the start of the next chunk's pass.

The last run row's logits give draft 1 (argmax: the drafts are a point mass, which the
rejection sampler's exactness assumes). Draft j + 1 (k > 1) runs module min(j, n - 1) as one
more decode row at the next position, fed draft j and its own previous output g, after the
module's final norm: the tensor its logits come from (one convention for the three families,
as vLLM and SGLang chain; vLLM reuses the last module alike). Its K/V goes to the request's
own slots past its accepted tokens, which the next steps overwrite, and the chain stops where
the request's blocks end. The drafts go back in ModelOutput.drafts as (number of tokens they
follow, ids); the core's MtpDrafter proposes them in the next step, through the same budget,
cuts and rollback as any drafter.

Tensor parallelism (every family's MTP layers, split as the target's layers: deepseek_mtp.py,
glm4_moe_mtp.py, qwen3_next_mtp.py, by parallel/tensor_parallel.py's extra-layer rules): every
rank runs the proposer after every step, since each MTP forward is collective; the worker ranks
(parallel/worker_proc.py), which never sample, get rank 0's emitted ids by one broadcast
(emitted_ids), and each draft is a vocabulary-split argmax that gives every rank the same id to
feed the next chained row. Only rank 0's drafts reach the core. Context parallelism is refused.

Caveat: a prefix hit reuses a block's MTP rows as an earlier request wrote them; the block's
last row was computed with that request's next token, which may differ (drafts, never outputs,
are affected).
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import torch

from loomserve.config import EngineConfig
from loomserve.execution.attention import build_metadata
from loomserve.execution.attention.metadata import to_device
from loomserve.execution.batch import ModelOutput, ScheduledSeq

# families whose config.json names MTP modules the drafter does not run, and why
# (docs/design/speculative.md, MTP drafts: Refused)
_NOT_BUILT = {
    "MiniMaxM2ForCausalLM": "the released MiniMax-M2 checkpoints name MTP modules in config.json "
                            "(num_mtp_modules) but carry no trained MTP weights",
}


@dataclasses.dataclass
class MtpRun:
    """One request's MTP rows this step: consecutive positions from start."""

    seq: ScheduledSeq
    start: int
    next_ids: list[int]  # the token at p + 1 for each row
    hidden: list[torch.Tensor]  # h_p of the rows: [rows, hidden] pieces, in order
    drafts_from: int | None  # the request's token count the drafts follow (None: no drafts)


def make_proposer(config: EngineConfig, model, folder: str) -> "MtpProposer | None":
    """The MTP proposer when --speculative-config asks for method mtp (loading the modules into
    `model`); None otherwise. Refuses models and modes it does not support, naming why."""
    spec = config.speculative.speculative_config
    if spec is None or spec.method != "mtp":
        return None
    from loomserve.execution.models import deepseek_mtp, glm4_moe_mtp, qwen3_next_mtp
    from loomserve.execution.models.deepseek_v3 import DeepseekV3ForCausalLM
    from loomserve.execution.models.deepseek_v32 import DeepseekV32ForCausalLM
    from loomserve.execution.models.glm4_moe import Glm4MoeForCausalLM
    from loomserve.execution.models.qwen3_5 import Qwen3_5ForCausalLM, text_config
    from loomserve.execution.models.qwen3_next import Qwen3NextForCausalLM
    from loomserve.execution.parallel.state import get_dcp, get_pcp

    # each family's loader returns model.mtp, whose layers are called (model, ids, positions,
    # h, meta) -> g (normed) and have .logits(model, g); while it is set, forward keeps its
    # output (after the final norm) in model.last_hidden
    loaders = {DeepseekV3ForCausalLM: deepseek_mtp.load_mtp,
               DeepseekV32ForCausalLM: deepseek_mtp.load_mtp,  # its layers' block: V3.2's
               Glm4MoeForCausalLM: glm4_moe_mtp.load_mtp,
               Qwen3NextForCausalLM: qwen3_next_mtp.load_mtp,
               Qwen3_5ForCausalLM: qwen3_next_mtp.load_mtp}  # Qwen3-Next's layer, dense or MoE
    load_mtp = loaders.get(type(model))
    if load_mtp is None:
        why = _NOT_BUILT.get(type(model).__name__)
        raise ValueError(f"--speculative-config: method 'mtp' runs the MTP layers of "
                         f"{', '.join(c.__name__ for c in loaders)}; "
                         f"{type(model).__name__} is not supported" + (f": {why}" if why else ""))
    with open(os.path.join(folder, "config.json")) as f:
        d, key = json.load(f), "num_nextn_predict_layers"
    if type(model) is Qwen3_5ForCausalLM:  # the released ones: under text_config
        d, key = text_config(d), "mtp_num_hidden_layers"
    num_nextn = int(d.get(key) or 0)
    if type(model) is Qwen3NextForCausalLM and num_nextn < 1:
        num_nextn = 1  # its config.json names no count: one layer, as it ships (vLLM's default)
    if num_nextn < 1:
        raise ValueError(f"--speculative-config: method 'mtp' needs a checkpoint with MTP "
                         f"layers; its config.json has no {key} >= 1")
    if get_dcp() is not None or get_pcp() is not None:  # TP runs: see TP in the docstring
        raise ValueError("--speculative-config: method 'mtp' does not run under context "
                         "parallelism (DCP / PCP) yet")
    if config.model.cuda_graphs:
        raise ValueError("--speculative-config: method 'mtp' does not run under --cuda-graphs")
    pc = config.parallel
    if pc.enable_expert_parallel and pc.data_parallel_size > 1:
        # the DP lockstep's dummy MoE steps would run the MTP layer's experts on some ranks
        # only, so its all-to-all would wait for ranks that never join
        raise ValueError("--speculative-config: method 'mtp' does not run with expert "
                         "parallelism over data-parallel ranks yet")
    model.mtp = load_mtp(model, folder, num_nextn, config.model.torch_dtype,
                         config.model.torch_device)
    return MtpProposer(spec.num_speculative_tokens)


class MtpProposer:
    def __init__(self, k: int) -> None:
        self.k = k
        # request id -> (position, h) of a prefill chunk's last row, run with the next chunk
        self._held: dict[str, tuple[int, torch.Tensor]] = {}

    @torch.inference_mode()
    def propose(self, runner, seqs: list[ScheduledSeq], out: ModelOutput | None,
                finished: list[str]) -> dict[str, tuple[int, list[int]]]:
        """Drafts per request after a step whose rows were `seqs` (in row order) and whose
        result is `out` (None on a tensor-parallel rank other than 0, which gets rank 0's ids):
        {request id: (tokens they follow, draft ids)}, the same on every rank."""
        for rid in finished:
            self._held.pop(rid, None)
        model = runner.model
        hidden, model.last_hidden = model.last_hidden, None
        if hidden is None or hidden.shape[0] != sum(len(s.token_ids) for s in seqs):
            return {}  # no forward ran for these seqs (an empty step)
        runs = self._runs(seqs, hidden, emitted_ids(seqs, out, runner.tp, runner.device))
        if not runs:
            return {}
        h = self.run_module(runner, 0, runs)  # its K/V rows go to the cache whatever follows
        due = [i for i, r in enumerate(runs) if r.drafts_from is not None]
        if not due:
            return {}
        ends = np.cumsum([len(r.next_ids) for r in runs]) - 1
        h = h[torch.as_tensor(ends[due], device=h.device)]
        live = [runs[i] for i in due]
        drafts: dict[str, list[int]] = {r.seq.request_id: [] for r in live}
        pos = [r.start + len(r.next_ids) - 1 for r in live]  # each live run's last position
        layers = model.mtp.layers
        for j in range(self.k):
            # `greedy`: the logits' argmax, under TP the same ids on every rank (each feeds
            # them to the next chained row) without gathering the logits
            ids = layers[min(j, len(layers) - 1)].greedy(model, h).tolist()
            for r, t in zip(live, ids):
                drafts[r.seq.request_id].append(t)
            keep = [n for n, r in enumerate(live) if self._has_slot(runner, r.seq, pos[n] + 1)]
            if j + 1 == self.k or not keep:
                break
            # draft j + 2: one more decode row at the next position, fed draft j + 1
            live, h, pos = [live[n] for n in keep], h[keep], [pos[n] + 1 for n in keep]
            chain = [MtpRun(r.seq, p, [ids[n]], [], None) for n, r, p in zip(keep, live, pos)]
            h = self.run_module(runner, min(j + 1, len(layers) - 1), chain, h)
        return {r.seq.request_id: (r.drafts_from, drafts[r.seq.request_id])
                for r in runs if r.drafts_from is not None}

    def _runs(self, seqs: list[ScheduledSeq], hidden: torch.Tensor,
              done: dict[str, list[int]]) -> list[MtpRun]:
        """Each request's rows whose next token is known (a row held back from its previous
        chunk first), holding back a chunk's last row when the prompt goes on."""
        runs, row = [], 0
        for s in seqs:
            n, rid = len(s.token_ids), s.request_id
            rows = hidden[row:row + n]
            row += n
            start, nxt, parts = s.start_pos, [], []
            held = self._held.pop(rid, None)
            if held is not None and held[0] == s.start_pos - 1:
                start, nxt, parts = held[0], [s.token_ids[0]], [held[1]]
            emitted = done.get(rid, [])
            if s.num_draft:  # rows 0..a: the accepted drafts, then the token after them
                m, after = len(emitted), list(emitted)
            elif emitted:
                m, after = n, list(s.token_ids[1:]) + emitted
            else:  # a chunk short of the prompt's end: its last row waits for the next chunk
                m, after = n - 1, list(s.token_ids[1:])
                self._held[rid] = (s.start_pos + n - 1, rows[n - 1:].clone())
            if m:
                parts.append(rows[:m])
                nxt += after
            if nxt:  # drafts follow the request's tokens: up to the last row's next one
                runs.append(MtpRun(s, start, nxt, parts,
                                   start + len(nxt) + 1 if emitted else None))
        return runs

    def run_module(self, runner, index: int, runs: list[MtpRun],
                   previous: torch.Tensor | None = None) -> torch.Tensor:
        """MTP module `index` over the runs' rows (one-row runs as decodes, then the others as
        chunks over the cached prefix); returns its hidden states in the runs' row order.
        previous: h_p per row in that order (default: the runs' own)."""
        tables = runner.block_tables
        sizes = [len(r.next_ids) for r in runs]
        one = [i for i, n in enumerate(sizes) if n == 1]
        many = [i for i, n in enumerate(sizes) if n > 1]
        order = one + many  # the metadata's row order: decodes first
        metas = []
        for g in _mtp_groups(runner, index):
            meta, positions = build_metadata(
                [(runs[i].start, tables.get(runs[i].seq.request_id, g, runs[i].seq.block_ids[g]))
                 for i in one],
                [(runs[i].start, sizes[i], tables.get(runs[i].seq.request_id, g,
                                                      runs[i].seq.block_ids[g])) for i in many],
                runner.block_size, runner.device, runner.dtype, runner.attention,
                workspace=runner.workspace)
            metas.append(meta)
        meta = metas[0] if len(metas) == 1 else tuple(metas)
        first = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        gather = np.concatenate([np.arange(first[i], first[i] + sizes[i]) for i in order])
        ids = to_device(np.array([t for i in order for t in runs[i].next_ids], dtype=np.int64),
                        runner.device)
        if previous is None:
            previous = torch.cat([p for r in runs for p in r.hidden])
        index_t = torch.as_tensor(gather, device=previous.device)
        model = runner.model
        h = model.mtp.layers[index](model, ids, positions, previous[index_t], meta)
        return h[torch.as_tensor(np.argsort(gather), device=h.device)]

    @staticmethod
    def _has_slot(runner, s: ScheduledSeq, position: int) -> bool:
        g = runner.attn_groups[0]
        return (position < runner.max_model_len
                and position // runner.block_size < len(s.block_ids[g]))


def _mtp_groups(runner, index: int) -> list[int]:
    """The KV groups MTP module `index`'s attention reads: the model's first attention group,
    which holds every MTP layer but DeepSeek-V3.2's; V3.2's layer reads two (its latent rows'
    and its indexer keys' group: DeepseekV32ForCausalLM.mtp_kv_groups), passed as a pair."""
    own = getattr(runner.model, "mtp_kv_groups", None)
    return [runner.attn_groups[0]] if own is None else list(own(index))


def emitted_ids(seqs: list[ScheduledSeq], out: ModelOutput | None, tp,
                device: torch.device) -> dict[str, list[int]]:
    """The ids each seq due a token got this step: a decode's sampled token; with drafts, the
    accepted drafts then the token after them. Under tensor parallelism only rank 0 samples:
    its ids go to every rank (one broadcast of 1 + num_draft slots per due seq, -1 unused), so
    all ranks run the same MTP rows."""
    due = [s for s in seqs if s.sample]
    got = {} if out is None else {
        s.request_id: ((out.verified.get(s.request_id) or []) if s.num_draft else
                       [out.sampled[s.request_id]] if s.request_id in out.sampled else [])
        for s in due}
    if tp is None or not due:
        return got
    slots = np.full(sum(1 + s.num_draft for s in due), -1, dtype=np.int64)
    at = np.cumsum([0] + [1 + s.num_draft for s in due])
    for s, a in zip(due, at):
        ids = got.get(s.request_id, [])
        slots[a:a + len(ids)] = ids
    slots = tp.broadcast(torch.from_numpy(slots).to(device)).cpu().numpy()
    return {s.request_id: [int(t) for t in slots[a:a + 1 + s.num_draft] if t >= 0]
            for s, a in zip(due, at)}
