"""The paged model against transformers (fp32) on the tiny fixtures: every way a step can be cut
(whole prefill, decode, chunked prefill, mixed prefill+decode batches, prefix hits) must give the
logits HF gives for the same position of the full sequence."""

from __future__ import annotations

import torch

from tests.execution.models.conftest import Blocks, logits_of, ref_logits, seq

ATOL = 1e-4


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 400, (n,), generator=g).tolist()


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=1e-4)


def test_prefill_then_decode(tiny):
    runner, ref = tiny
    blocks = Blocks(runner.block_size)
    full = _tokens(29, 0)
    want = ref_logits(ref, full)
    prompt, table = full[:23], []
    got = logits_of(runner, [seq("a", prompt, 0, blocks.cover(table, 23))])
    _close(got["a"], want[22])
    for pos in range(23, 29):  # teacher-forced decode steps, crossing block boundaries
        got = logits_of(runner, [seq("a", [full[pos]], pos, blocks.cover(table, pos + 1))])
        _close(got["a"], want[pos])


def test_chunked_prefill(tiny):
    runner, ref = tiny
    blocks = Blocks(runner.block_size)
    full = _tokens(30, 1)
    want = ref_logits(ref, full)
    table, start = [], 0
    for size in (11, 9, 10):  # chunk edges inside blocks, not on them
        end = start + size
        got = logits_of(runner, [seq("a", full[start:end], start, blocks.cover(table, end))])
        _close(got["a"], want[end - 1])
        start = end


def test_mixed_prefill_and_decode_batch(tiny):
    runner, ref = tiny
    blocks = Blocks(runner.block_size)
    a, b, c = _tokens(20, 2), _tokens(21, 3), _tokens(12, 4)
    wa, wb, wc = ref_logits(ref, a), ref_logits(ref, b), ref_logits(ref, c)
    ta, tb, tc = [], [], []
    # Step 1: two fresh prefills of different lengths in one pass.
    got = logits_of(runner, [seq("b", b[:17], 0, blocks.cover(tb, 17)),
                             seq("c", c[:9], 0, blocks.cover(tc, 9))])
    _close(got["b"], wb[16])
    _close(got["c"], wc[8])
    # Steps 2-3: A prefills in two chunks (no token due after the first) while B and C decode.
    for step, (lo, hi) in enumerate([(0, 12), (12, 20)]):
        pb, pc = 17 + step, 9 + step
        got = logits_of(runner, [
            seq("b", [b[pb]], pb, blocks.cover(tb, pb + 1)),
            seq("a", a[lo:hi], lo, blocks.cover(ta, hi), sample=hi == 20),
            seq("c", [c[pc]], pc, blocks.cover(tc, pc + 1)),
        ])
        _close(got["b"], wb[pb])
        _close(got["c"], wc[pc])
        assert ("a" in got) == (hi == 20)
    _close(got["a"], wa[19])
    # Step 4: all three decode together, padded to B's length.
    got = logits_of(runner, [seq("a", [a[19]], 20, blocks.cover(ta, 21)), seq("b", [b[19]], 19, blocks.cover(tb, 20)),
                             seq("c", [c[11]], 11, blocks.cover(tc, 12))])
    a_next = ref_logits(ref, a + [a[19]])
    _close(got["a"], a_next[20])
    _close(got["b"], wb[19])
    _close(got["c"], wc[11])


def test_prefix_hit_reuses_blocks(tiny):
    runner, ref = tiny
    bs = runner.block_size
    blocks = Blocks(bs)
    prefix = _tokens(4 * bs, 5)
    first, second = prefix + _tokens(5, 6), prefix + _tokens(7, 7)
    t1 = []
    logits_of(runner, [seq("one", first, 0, blocks.cover(t1, len(first)))])
    # The second request hits the first's full prefix blocks and computes only its own suffix.
    hit = len(prefix)
    t2 = blocks.cover(t1[:hit // bs], len(second))
    want = ref_logits(ref, second + [9])
    got = logits_of(runner, [seq("two", second[hit:], hit, t2)])
    _close(got["two"], want[len(second) - 1])
    got = logits_of(runner, [seq("two", [9], len(second), blocks.cover(t2, len(second) + 1))])
    _close(got["two"], want[len(second)])


def test_execute_greedy_matches_hf_generate(tiny):
    runner, ref = tiny
    from loomserve.execution.batch import ModelInput

    blocks = Blocks(runner.block_size)
    prompt, table, out = _tokens(10, 8), [], []
    s = seq("g", prompt, 0, blocks.cover(table, 10))
    for _ in range(8):
        tok = runner.execute(ModelInput([s])).sampled["g"]
        out.append(tok)
        s = seq("g", [tok], s.start_pos + len(s.token_ids), table)
        blocks.cover(table, s.start_pos + 1)
    with torch.no_grad():
        hf = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, 10:].tolist()
    assert out == hf
