"""Prompt synthesis: fixed blocks per id, markers, scaling and the leading-token cap."""

from loomserve.bench.prompts import PrefixTracker, PromptBuilder, ids_to_text, token_id_range


def test_same_id_same_tokens_and_scope_changes_them():
    b = PromptBuilder(32000, 16)
    assert b.block("t1", 7).tolist() == PromptBuilder(32000, 16).block("t1", 7).tolist()
    assert b.block("t1", 7).tolist() != b.block("t2", 7).tolist()
    assert b.block("t1", 7).tolist() != b.block("t1", 8).tolist()
    assert len(b.block("t1", 7)) == 16
    lo, hi = token_id_range(32000)
    assert lo == 1000 and all(lo <= t < hi for t in b.block("t1", 7).tolist())


def test_small_vocab_range():
    lo, hi = token_id_range(512)
    assert 8 <= lo < hi == 512
    assert all(lo <= t < 512 for t in PromptBuilder(512, 64).block("s", 1).tolist())


def test_marker_at_start_differs_per_replay():
    b = PromptBuilder(32000, 4)
    p1 = b.build("s", "replay-1", [1, 2, 3], 192, 64)
    p2 = b.build("s", "replay-2", [1, 2, 3], 192, 64)
    m = b.marker_tokens
    assert p1.tokens[:m] == b.marker("replay-1").tolist()
    assert p1.tokens[:m] != p2.tokens[:m]
    assert p1.tokens[m:] == p2.tokens[m:]


def test_scaling_keeps_shared_prefix_lengths():
    b = PromptBuilder(32000, 4, marker_tokens=4)
    # 4 blocks of 64 -> 4 tokens each; `in` = 256 -> 16 tokens, marker included
    a = b.build("s", "r", [1, 2, 3, 4], 256, 64)
    c = b.build("s", "r", [1, 2, 5, 6], 256, 64)
    assert len(a) == len(c) == 16 and a.scaled_tokens == 16 and not a.truncated
    common = next(i for i, (x, y) in enumerate(zip(a.tokens, c.tokens)) if x != y)
    assert common == 4 + 2 * 4  # marker + blocks 1, 2
    # the blocks sit after the marker: cut at `in` tokens -> 3 blocks fit after the marker
    assert a.tokens[4:8] == b.block("s", 1).tolist()
    assert a.tokens[8:12] == b.block("s", 2).tolist()
    assert a.tokens[12:16] == b.block("s", 3).tolist()
    t = PrefixTracker()
    assert t.observe(a.segments) == 0
    assert t.observe(c.segments) == 4 + 2 * 4  # marker + the two shared blocks
    assert t.observe(a.segments) == 16         # seen in full


def test_cap_keeps_leading_tokens():
    b = PromptBuilder(32000, 8, marker_tokens=4)
    full = b.build("s", "r", range(10), 640, 64)
    cut = b.build("s", "r", range(10), 640, 64, max_prompt_tokens=30)
    assert len(full) == 80 and len(cut) == 30 and cut.truncated and cut.scaled_tokens == 80
    assert cut.tokens == full.tokens[:30]
    t = PrefixTracker()
    t.observe(cut.segments)
    assert t.observe(full.segments) == 30  # a partly seen block counts its seen tokens only


def test_short_id_list_is_padded_with_unshared_tokens():
    b = PromptBuilder(32000, 4, marker_tokens=4)
    p = b.build("s", "r", [1], 64 * 3, 64, pad_key="x")
    assert len(p) == 12
    t = PrefixTracker()
    t.observe(p.segments)
    q = b.build("s", "r", [1], 64 * 3, 64, pad_key="y")
    assert t.observe(q.segments) == 8 and q.tokens[8:] != p.tokens[8:]


def test_text_mode_one_word_per_id():
    text = ids_to_text([1000, 1001, 1002])
    assert len(text.split(" ")) == 3 and "  " not in text
