"""Sliding-window models against transformers (fp32) on the tiny fixtures: Mistral (every layer
slides), Gemma 3 and gpt-oss (sliding and full layers alternate, so two KV groups). Windows are
32 tokens and sequences run well past them, through every way a step can be cut; blocks wholly
before the window are replaced by a NaN-filled page, as if the KV manager had freed them and
the pool had handed them to another group, and the logits must not notice."""

from __future__ import annotations

import pytest
import torch

from loomserve.execution.batch import ModelInput, ScheduledSeq
from loomserve.kv.spec import SlidingWindowSpec
from tests.execution.models.conftest import FIXTURES, GREEDY, logits_of, ref_logits, tiny_runner

MODELS = ["tiny-mistral-swa", "tiny-gemma3", "tiny-gpt-oss"]
WINDOW = 32
ATOL = 1e-4


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    from transformers import AutoModelForCausalLM

    name = request.param
    ref = AutoModelForCausalLM.from_pretrained(str(FIXTURES / name), dtype=torch.float32).eval()
    return tiny_runner(name), ref


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 400, (n,), generator=g).tolist()


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=1e-4)


class Tables:
    """Per-group block tables of one request, drawing fresh ids from a shared counter (a block
    belongs to one group at a time). `poison` points the sliding groups' out-of-window entries
    at a page of NaN bytes."""

    next_id = 1  # block 0 stays the NaN page

    def __init__(self, runner) -> None:
        self.runner = runner
        self.groups = runner.kv_cache_config.groups
        self.ids: list[list[int]] = [[] for _ in self.groups]

    def cover(self, n: int) -> list[list[int]]:
        bs = self.runner.block_size
        for t in self.ids:
            while len(t) * bs < n:
                t.append(Tables.next_id)
                # Cycle through the pool: a test needs far fewer blocks than it holds.
                Tables.next_id = Tables.next_id % (self.runner.kv_cache_config.num_blocks - 1) + 1
        return self.ids

    def poison(self, pos: int) -> None:
        """The KV manager's view after computing up to `pos`: blocks wholly before the window of
        the next query are gone."""
        self.runner.kv_buffer[0].fill_(0xFF)  # NaN in fp32
        bs = self.runner.block_size
        for g, t in zip(self.groups, self.ids):
            if isinstance(g.spec, SlidingWindowSpec):
                first = max(0, pos - g.spec.sliding_window + 1) // bs
                t[:first] = [0] * first


def _seq(rid: str, tokens: list[int], start: int, tables: list[list[int]], sample: bool = True) -> ScheduledSeq:
    return ScheduledSeq(rid, list(tokens), start, tables, sample, GREEDY)


def test_groups_and_specs(model):
    runner, ref = model
    groups = runner.kv_cache_config.groups
    kinds = sorted({g.spec.kind for g in groups})
    assert kinds == (["sliding_window"] if "mistral" in runner.model_name else ["full_attention", "sliding_window"])
    sliding = [g for g in groups if g.spec.kind == "sliding_window"]
    assert all(g.spec.sliding_window == WINDOW for g in sliding)
    types = ref.config.layer_types if hasattr(ref.config, "layer_types") and ref.config.layer_types else None
    if types:  # the sliding layers, possibly split into equal-page groups
        assert sorted(i for g in sliding for i in g.layer_ids) == \
            [i for i, t in enumerate(types) if t == "sliding_attention"]


def test_long_prefill_then_decode_past_window(model):
    runner, ref = model
    full = _tokens(90, 0)
    want = ref_logits(ref, full)
    t = Tables(runner)
    got = logits_of(runner, [_seq("a", full[:70], 0, t.cover(70))])  # one chunk > 2 windows
    _close(got["a"], want[69])
    for pos in range(70, 90):
        t.poison(pos)
        got = logits_of(runner, [_seq("a", [full[pos]], pos, t.cover(pos + 1))])
        _close(got["a"], want[pos])


def test_chunked_prefill_across_window(model):
    runner, ref = model
    full = _tokens(100, 1)
    want = ref_logits(ref, full)
    t, start = Tables(runner), 0
    for size in (13, 30, 37, 20):  # chunk edges inside blocks, chunks shorter and longer than W
        end = start + size
        t.poison(start)
        got = logits_of(runner, [_seq("a", full[start:end], start, t.cover(end))])
        _close(got["a"], want[end - 1])
        start = end


def test_mixed_batch_and_prefix_hit(model):
    runner, ref = model
    bs = runner.block_size
    a, b = _tokens(75, 2), _tokens(50, 3)
    wa, wb = ref_logits(ref, a), ref_logits(ref, b)
    ta, tb = Tables(runner), Tables(runner)
    got = logits_of(runner, [_seq("a", a[:60], 0, ta.cover(60)), _seq("b", b[:9], 0, tb.cover(9))])
    _close(got["a"], wa[59])
    _close(got["b"], wb[8])
    # Out-of-window blocks A drops below stay cached in the pool (freed, still hashed).
    a_cached = [list(t) for t in ta.ids]
    # A decodes past its window while B prefills in chunks, one crossing B's first window.
    for step, (lo, hi) in enumerate([(9, 30), (30, 50)]):
        pa = 60 + step
        ta.poison(pa)
        tb.poison(lo)
        got = logits_of(runner, [_seq("b", b[lo:hi], lo, tb.cover(hi), sample=hi == 50),
                                 _seq("a", [a[pa]], pa, ta.cover(pa + 1))])
        _close(got["a"], wa[pa])
    _close(got["b"], wb[49])
    # C shares A's first 48 tokens (12 whole blocks, past the window): it hits A's cached blocks
    # in every group and computes only its suffix, batched with A and B decoding.
    hit = 48
    c = a[:hit] + _tokens(10, 4)
    wc = ref_logits(ref, c)
    tc = Tables(runner)
    tc.ids = [t[:hit // bs] for t in a_cached]
    tc.poison(hit)
    ta.poison(62)
    tb.poison(50)
    got = logits_of(runner, [_seq("a", [a[62]], 62, ta.cover(63)), _seq("c", c[hit:], hit, tc.cover(len(c))),
                             _seq("b", [7], 50, tb.cover(51))])
    _close(got["a"], wa[62])
    _close(got["c"], wc[-1])
    _close(got["b"], ref_logits(ref, b + [7])[50])


def test_execute_greedy_matches_hf_generate(model):
    runner, ref = model
    prompt, out = _tokens(40, 5), []
    t = Tables(runner)
    s = _seq("g", prompt, 0, t.cover(40))
    for _ in range(8):
        tok = runner.execute(ModelInput([s])).sampled["g"]
        out.append(tok)
        pos = s.start_pos + len(s.token_ids)
        s = _seq("g", [tok], pos, t.cover(pos + 1))
    with torch.no_grad():
        hf = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, 40:].tolist()
    assert out == hf


@pytest.mark.parametrize("backend", ["torch", "cpu_paged"])
@pytest.mark.parametrize("name", MODELS)
def test_bfloat16_matches_hf_bfloat16(name, backend):
    """bf16 rounding points (Gemma's embed scale and fp32 (1 + w) norms) as transformers has them;
    gpt-oss keeps its norms and sinks in fp32 where transformers does not, so it is held to the
    fp32 reference instead. The torch backend runs transformers' own SDPA and must match it (to
    the linears' summation order); the in-place backend accumulates in fp32 where SDPA's bf16
    math path rounds scores and probabilities (the decode kernel, the windowed prefill's merged
    tiles), so it is held to the fp32 model instead: no further from it than transformers' bf16
    is (plus bf16's rounding of the logits)."""
    from transformers import AutoModelForCausalLM

    runner = tiny_runner(name, dtype="bfloat16", attention_backend=backend)
    assert runner.attention.name == backend
    ref_dtype, tol = (torch.float32, 0.03) if name == "tiny-gpt-oss" else (torch.bfloat16, 0.01)
    ref = AutoModelForCausalLM.from_pretrained(str(FIXTURES / name), dtype=ref_dtype).eval()
    full = _tokens(51, 6)
    want = ref_logits(ref, full)
    t = Tables(runner)
    truth = None
    if backend != "torch" and ref_dtype != torch.float32:
        fp32 = AutoModelForCausalLM.from_pretrained(str(FIXTURES / name), dtype=torch.float32).eval()
        truth = ref_logits(fp32, full).float()
    got = logits_of(runner, [_seq("a", full[:50], 0, t.cover(50))])
    if truth is None:
        torch.testing.assert_close(got["a"], want[49], atol=tol, rtol=tol)
    else:  # the windowed prefill tiles merge their partials in fp32, as the decode kernel does
        _no_further_from_fp32(got["a"], want[49], truth[49])
    got = logits_of(runner, [_seq("a", full[50:], 50, t.cover(51))])
    if truth is None:
        # The linears' fp32 sums (layers/dense.py's kernel vs torch's bf16 GEMM) add in another
        # order: a logit may land two bf16 ulps (2^-6 relative) away after rounding.
        torch.testing.assert_close(got["a"], want[50], atol=tol, rtol=max(tol, 2 ** -6))
    else:
        _no_further_from_fp32(got["a"], want[50], truth[50])


def _no_further_from_fp32(ours, theirs, truth):
    """bf16 logits ours no further from the fp32 model's than transformers' bf16 ones are
    (plus bf16's rounding of the logits), and close to them."""
    d_ours, d_theirs = (ours.float() - truth).abs().max(), (theirs.float() - truth).abs().max()
    assert d_ours <= d_theirs + 0.01, (d_ours, d_theirs)
    torch.testing.assert_close(ours, theirs, atol=0.05, rtol=0.05)
