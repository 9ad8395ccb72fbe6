"""Gated DeltaNet and Mamba2 kernels and state plumbing, plus `Harness`, the small stand-in for the
runner that the hybrid-model tests use: one packed pool of uniform pages, per-layer views into it,
AttentionMetadata from attention.build_metadata and a StateBatch per step, built the way the
runner does (decode rows first; state pages copied/zeroed whole before the step)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from loomserve.execution.layers.attention import build_metadata
from loomserve.execution.layers.gated_deltanet import (
    causal_conv,
    chunk_gated_delta_rule,
    l2norm,
    recurrent_gated_delta_step,
    segments,
)
from loomserve.execution.layers.mamba2 import ssd_chunked, ssd_step
from loomserve.execution.layers.state import StateBatch, StateSeq
from loomserve.kv.spec import FullAttentionSpec, LinearStateSpec
from tests.execution.models.conftest import FIXTURES

# --- harness ---------------------------------------------------------------------------------------

def load_fixture(name: str, model_cls, config_cls):
    from loomserve.execution.models.loading.checkpoint import iter_safetensors

    with open(FIXTURES / name / "config.json") as f:
        cfg = config_cls.from_hf(json.load(f))
    with torch.device("meta"):
        model = model_cls(cfg)
    model = model.to_empty(device="cpu")
    model.load_weights(iter_safetensors(str(FIXTURES / name)))
    model.init_rotary(cfg.max_position_embeddings, torch.device("cpu"), torch.float32)
    return model.eval().requires_grad_(False)


@dataclass
class Req:
    tokens: list[int]
    table: list[int] = field(default_factory=list)  # attention blocks
    state_page: int = -1
    done: int = 0  # tokens computed


@dataclass
class Chunk:
    req: Req
    n: int
    saves: list[tuple[int, int]] = field(default_factory=list)
    init_from: int | None = None


class Harness:
    def __init__(self, model, block_size: int = 4, num_blocks: int = 96) -> None:
        from loomserve.execution.models.qwen3_next import layer_groups

        self.model, self.block_size = model, block_size
        specs = model.kv_cache_specs(block_size, torch.float32)
        self.groups = layer_groups(specs)
        self.group_spec = {g: s for g, s in zip(self.groups, specs) if s is not None}
        members = {g: [i for i, x in enumerate(self.groups) if x == g] for g in self.group_spec}
        page_bytes = max(s.bytes_per_block_per_layer() * len(members[g]) for g, s in self.group_spec.items())
        self.buf = torch.zeros(num_blocks, page_bytes // 4, dtype=torch.float32)
        self.next_block = 0
        layers = model.model.layers
        for g, spec in self.group_spec.items():
            for slot, i in enumerate(members[g]):
                base = slot * spec.bytes_per_block_per_layer() // 4
                if isinstance(spec, FullAttentionSpec):
                    shape = (block_size, spec.num_kv_heads, spec.head_dim)
                    size = math.prod(shape)
                    attn = _attn_module(layers[i])
                    attn.k_cache = self._view(base, shape)
                    attn.v_cache = self._view(base + size, shape)
                else:
                    views, off = [], base
                    for shape in spec.state_shapes:
                        views.append(self._view(off, shape))
                        off += math.prod(shape)
                    _state_module(layers[i]).state_cache = tuple(views)
        self.attn_groups = [g for g, s in self.group_spec.items() if isinstance(s, FullAttentionSpec)]
        self.state_groups = [g for g, s in self.group_spec.items() if isinstance(s, LinearStateSpec)]

    def _view(self, off: int, shape) -> torch.Tensor:
        return self.buf[:, off:off + math.prod(shape)].view(self.buf.shape[0], *shape)

    def alloc(self) -> int:
        self.next_block += 1
        return self.next_block - 1

    def new(self, tokens: list[int]) -> Req:
        return Req(list(tokens), state_page=self.alloc())

    @torch.inference_mode()
    def step(self, chunks: list[Chunk]) -> list[torch.Tensor]:
        """One forward; returns the logits of each chunk's last token, in the order given."""
        order = [c for c in chunks if c.n == 1] + [c for c in chunks if c.n > 1]
        ids, decodes, prefills, seqs, last = [], [], [], [], {}
        for c in order:
            r, start = c.req, c.req.done
            while len(r.table) * self.block_size < start + c.n:
                r.table.append(self.alloc())
            if c.init_from is not None:
                self.buf[r.state_page] = self.buf[c.init_from]
            elif start == 0:
                self.buf[r.state_page].zero_()
            seqs.append(StateSeq(len(ids), len(ids) + c.n, start, r.state_page, list(c.saves)))
            ids.extend(r.tokens[start:start + c.n])
            last[id(c)] = len(ids) - 1
            (decodes.append((start, r.table)) if c.n == 1 else prefills.append((start, c.n, r.table)))
        meta, positions = build_metadata(decodes, prefills, self.block_size, torch.device("cpu"))
        sb = StateBatch(seqs)
        hidden = self.model(torch.tensor(ids), positions, {g: meta for g in self.attn_groups},
                            {g: sb for g in self.state_groups})
        for c in order:
            c.req.done += c.n
        rows = torch.tensor([last[id(c)] for c in chunks])
        return list(self.model.compute_logits(hidden[rows]).float())

    def state_page(self, page: int) -> torch.Tensor:
        return self.buf[page].clone()


def _attn_module(layer):
    for name in ("self_attn", "mixer"):
        m = getattr(layer, name, None)
        if m is not None and hasattr(m, "k_cache"):
            return m
    raise AttributeError("no attention module")


def _state_module(layer):
    for name in ("linear_attn", "mixer"):
        m = getattr(layer, name, None)
        if m is not None and hasattr(m, "state_cache"):
            return m
    raise AttributeError("no state module")


# --- kernels ---------------------------------------------------------------------------------------

def test_chunked_gated_delta_rule_matches_recurrence_and_hf():
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    g = torch.Generator().manual_seed(0)
    n, h, dk, dv = 150, 4, 16, 8  # three chunks, the last one partial
    q, k = torch.randn(n, h, dk, generator=g), torch.randn(n, h, dk, generator=g)
    v = torch.randn(n, h, dv, generator=g)
    gl, beta = -3 * torch.rand(n, h, generator=g), torch.rand(n, h, generator=g)
    s0 = torch.randn(h, dk, dv, generator=g)
    qn, kn = l2norm(q) * dk ** -0.5, l2norm(k)
    o, s = chunk_gated_delta_rule(qn, kn, v, gl, beta, s0)
    ref, ref_s = torch_chunk_gated_delta_rule(q[None], k[None], v[None], gl[None], beta[None], initial_state=s0[None],
                                              output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o, ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, ref_s[0], atol=1e-5, rtol=1e-5)
    st, outs = s0[None], []
    for t in range(n):
        ot, st = recurrent_gated_delta_step(qn[t:t + 1], kn[t:t + 1], v[t:t + 1], gl[t:t + 1], beta[t:t + 1], st)
        outs.append(ot)
    torch.testing.assert_close(torch.cat(outs), o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st[0], s, atol=1e-5, rtol=1e-5)


def test_ssd_chunked_matches_recurrence_and_hf():
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan

    g = torch.Generator().manual_seed(1)
    n, h, p, ns, groups = 150, 4, 8, 16, 2
    x, raw = torch.randn(n, h, p, generator=g), torch.randn(n, h, generator=g)
    bias, a = torch.rand(h, generator=g), -3 * torch.rand(h, generator=g)
    b, c = torch.randn(n, groups, ns, generator=g), torch.randn(n, groups, ns, generator=g)
    s0 = torch.randn(h, p, ns, generator=g)
    ref, ref_s = mamba2_chunk_scan(x[None], raw[None], a, b[None], c[None], chunk_size=32, dt_bias=bias,
                                   initial_states=s0[None], dt_softplus=True, return_final_states=True)
    dt = F.softplus(raw + bias)
    be, ce = b.repeat_interleave(2, 1), c.repeat_interleave(2, 1)
    y, s = ssd_chunked(x, dt, a, be, ce, s0)
    scale = ref.abs().max()
    torch.testing.assert_close(y / scale, ref[0] / scale, atol=2e-6, rtol=0)
    torch.testing.assert_close(s, ref_s[0], atol=1e-5, rtol=1e-5)
    st, outs = s0[None], []
    for t in range(n):
        o, st = ssd_step(x[t:t + 1], dt[t:t + 1], a, be[t:t + 1], ce[t:t + 1], st)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs) / scale, y / scale, atol=2e-6, rtol=0)
    torch.testing.assert_close(st[0], s, atol=1e-5, rtol=1e-5)


def test_segments_cut_at_saves():
    s = StateSeq(10, 30, 4, 0, saves=[(16, 7), (8, 5), (24, 9), (24, 3)])
    assert segments(s) == [(0, 4, [5]), (4, 12, [7]), (12, 20, [3, 9])]
    assert segments(StateSeq(0, 8, 0, 0, saves=[(8, 2)])) == [(0, 8, [2])]
    assert segments(StateSeq(0, 5, 3, 0)) == [(0, 5, [])]


def test_causal_conv_carries_window_and_saves():
    g = torch.Generator().manual_seed(2)
    ch, kern, n = 6, 4, 11
    x, w, b = torch.randn(n, ch, generator=g), torch.randn(ch, kern, generator=g), torch.randn(ch, generator=g)
    want = F.silu(F.conv1d(x.t()[None], w[:, None], b, padding=kern - 1, groups=ch)[0, :, :n]).t()
    cache = torch.zeros(8, ch, kern - 1)
    # 7 tokens as a prefill with a save after 4, then 4 single-token decode steps.
    first = StateSeq(0, 7, 0, 1, saves=[(4, 2)])
    out = causal_conv(x[:7], cache, w, b, [], [first])
    torch.testing.assert_close(out, want[:7])
    torch.testing.assert_close(cache[2], x[1:4].t())
    for t in range(7, n):
        d = StateSeq(0, 1, t, 1)
        out = causal_conv(x[t:t + 1], cache, w, b, [d], [])
        torch.testing.assert_close(out, want[t:t + 1])


# --- scenarios shared by the hybrid-model tests (tests/execution/models/test_*_vs_hf.py) ----------------------

ATOL = 1e-4


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(ref, toks: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([toks])).logits[0].float()


def close(got: torch.Tensor, want: torch.Tensor, atol: float = ATOL) -> None:
    torch.testing.assert_close(got, want, atol=atol, rtol=1e-4)


def scenario_prefill_then_decode(model, ref) -> None:
    h, full = Harness(model), tokens(29, 0)
    want = hf_logits(ref, full)
    r = h.new(full)
    close(h.step([Chunk(r, 23)])[0], want[22])
    for pos in range(23, 29):  # decode steps crossing block boundaries
        close(h.step([Chunk(r, 1)])[0], want[pos])


def scenario_chunked_prefill(model, ref) -> None:
    """150 tokens in one step (chunks of 64 and a partial one), and in three steps whose edges fall
    inside blocks and inside 64-token chunks, the state carried in the running page."""
    h, full = Harness(model, num_blocks=128), tokens(150, 1)
    want = hf_logits(ref, full)
    close(h.step([Chunk(h.new(full), 150)])[0], want[149])
    r, end = h.new(full), 0
    for n in (57, 50, 43):
        end += n
        close(h.step([Chunk(r, n)])[0], want[end - 1])


def scenario_mixed_batch(model, ref) -> None:
    h = Harness(model)
    a, b, c = tokens(20, 2), tokens(21, 3), tokens(12, 4)
    wa, wb, wc = hf_logits(ref, a), hf_logits(ref, b), hf_logits(ref, c)
    ra, rb, rc = h.new(a), h.new(b), h.new(c)
    got = h.step([Chunk(rb, 17), Chunk(rc, 9)])
    close(got[0], wb[16])
    close(got[1], wc[8])
    got = h.step([Chunk(ra, 11), Chunk(rb, 1), Chunk(rc, 1)])  # a prefills while b and c decode
    close(got[0], wa[10])
    close(got[1], wb[17])
    close(got[2], wc[9])
    got = h.step([Chunk(rb, 1), Chunk(ra, 9), Chunk(rc, 1)])
    close(got[0], wb[18])
    close(got[1], wa[19])
    close(got[2], wc[10])


def scenario_saves_and_prefix_hit(model, ref) -> None:
    """A prefill saves its state at 8, 16 and 24 tokens; each save equals the state of a fresh
    sequence run to that point; B reuses A's first 16 tokens (state from the save page, attention
    blocks from A's table) and gets HF's logits for its own continuation."""
    h = Harness(model, num_blocks=128)
    a = tokens(26, 5)
    b = a[:16] + tokens(14, 6)
    wb = hf_logits(ref, b)
    saves = {n: h.alloc() for n in (8, 16, 24)}
    ra = h.new(a)
    h.step([Chunk(ra, 26, saves=[(n, p) for n, p in saves.items()])])
    for n, page in saves.items():
        fresh = h.new(a[:n])
        h.step([Chunk(fresh, n)])
        torch.testing.assert_close(h.state_page(page), h.state_page(fresh.state_page), atol=1e-5, rtol=1e-5)
    rb = h.new(b)
    rb.table, rb.done = list(ra.table[:4]), 16
    close(h.step([Chunk(rb, 14, init_from=saves[16])])[0], wb[29])
    # A save taken by a decode step (the state after token 16 of a fresh 15-token prefill).
    rc = h.new(b[:17])
    h.step([Chunk(rc, 15)])
    page = h.alloc()
    close(h.step([Chunk(rc, 1, saves=[(16, page)])])[0], wb[15])
    torch.testing.assert_close(h.state_page(page), h.state_page(saves[16]), atol=1e-5, rtol=1e-5)


class RunnerSeqs:
    """Builds ScheduledSeqs for a hybrid ModelRunner the way the scheduler does: a block table per
    KV group (attention groups grow per block, a state group holds its running page) and a
    StateDirective per state group."""

    def __init__(self, runner) -> None:
        self.runner, self.next = runner, 0
        self.groups = runner.kv_cache_config.groups

    def alloc(self) -> int:
        self.next += 1
        return self.next - 1

    def new(self) -> list[list[int]]:
        return [[] if g not in self.runner.state_groups else [self.alloc()] for g in range(len(self.groups))]

    def seq(self, rid: str, tables: list[list[int]], toks: list[int], start: int, zero: bool = False,
            init_from: int | None = None, saves: list[tuple[int, int]] = ()):
        from loomserve.execution.batch import StateDirective
        from tests.execution.models.conftest import seq

        bs = self.runner.block_size
        for g in self.runner.attn_groups:
            while len(tables[g]) * bs < start + len(toks):
                tables[g].append(self.alloc())
        s = seq(rid, toks, start, tables[0])
        s.block_ids = tables
        s.states = {g: StateDirective(tables[g][0], init_from=init_from, zero_init=zero, saves=list(saves))
                    for g in self.runner.state_groups}
        return s


def scenario_runner(name: str, ref) -> None:
    """Through loomserve.execution.model_runner.ModelRunner: a prefill taking checkpoints, a second request
    hitting A's prefix (state from the checkpoint page, A's attention blocks), then both decoding
    in one batch."""
    from tests.execution.models.conftest import logits_of, tiny_runner

    runner = tiny_runner(name)
    rs = RunnerSeqs(runner)
    a = tokens(26, 7)
    b = a[:16] + tokens(14, 8)
    wa, wb = hf_logits(ref, a + [9, 10]), hf_logits(ref, b + [11, 12])
    ta, tb = rs.new(), rs.new()
    saves = [(n, rs.alloc()) for n in (8, 16, 24)]
    got = logits_of(runner, [rs.seq("a", ta, a, 0, zero=True, saves=saves)])
    close(got["a"], wa[25])
    for g in runner.attn_groups:
        tb[g] = list(ta[g][:16 // runner.block_size])
    got = logits_of(runner, [rs.seq("b", tb, b[16:], 16, init_from=saves[1][1])])
    close(got["b"], wb[29])
    for i, (x, y) in enumerate(((9, 11), (10, 12))):
        got = logits_of(runner, [rs.seq("a", ta, [x], 26 + i), rs.seq("b", tb, [y], 30 + i)])
        close(got["a"], wa[26 + i])
        close(got["b"], wb[30 + i])
