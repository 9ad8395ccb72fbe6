"""The suffix drafter: its tree against brute force, its three sources, its bounds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from loomserve.config.speculative import SpeculativeConfig
from loomserve.engine.spec.drafter import DraftRequest
from loomserve.engine.spec.suffix import SuffixDrafter, common_prefix
from loomserve.engine.spec.suffix_tree import SuffixTree

# -- brute-force oracle ----------------------------------------------------------------------


def occurrences(seqs: list[list[int]], s: list[int]) -> int:
    n = len(s)
    return sum(1 for q in seqs for i in range(len(q) - n + 1) if q[i:i + n] == s)


def longest_occurring_suffix(seqs: list[list[int]], pattern: list[int]) -> int:
    for n in range(len(pattern), 0, -1):
        if occurrences(seqs, pattern[-n:]):
            return n
    return 0


def check_draft(seqs, depth, s, draft, score, cap, min_prob) -> None:
    """Each drafted token is a most frequent continuation; the score and the stop are
    Arctic's: prob *= count(s+t) / count(s), stop below min_prob, at cap or at depth."""
    prob, total, cur = 1.0, 0.0, list(s)
    for t in draft:
        assert len(cur) < depth
        counts = {u: occurrences(seqs, cur + [u]) for u in {x for q in seqs for x in q}}
        assert counts[t] == max(counts.values()) > 0
        prob *= counts[t] / occurrences(seqs, cur)
        assert prob >= min_prob
        total += prob
        cur.append(t)
    assert abs(total - score) < 1e-9
    if len(draft) < cap and len(cur) < depth:  # it stopped early: nothing good followed
        counts = [occurrences(seqs, cur + [u]) for u in {x for q in seqs for x in q}]
        assert max(counts) == 0 or prob * max(counts) / occurrences(seqs, cur) < min_prob


sequences = st.lists(st.lists(st.integers(0, 3), max_size=30), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(seqs=sequences, depth=st.integers(1, 6), chunk=st.integers(1, 7))
def test_counts_match_brute_force(seqs, depth, chunk):
    tree = SuffixTree(depth)
    for i in range(0, max(len(q) for q in seqs), chunk):  # interleave the sequences
        for sid, q in enumerate(seqs):
            tree.extend(sid, q[i:i + chunk])
    for q in seqs:
        for i in range(len(q)):
            for j in range(i + 1, min(len(q), i + depth) + 1):
                assert tree.count(q[i:j]) == occurrences(seqs, q[i:j])
    for s in ([0, 1], [3, 3, 3], [2, 0, 1, 2], [1] * depth):
        assert tree.count(s[:depth]) == occurrences(seqs, s[:depth])  # exact up to depth
    assert tree.num_tokens == sum(map(len, seqs))
    assert tree.num_nodes <= 2 * tree.num_tokens + 1


@settings(max_examples=60, deadline=None)
@given(seqs=sequences, pattern=st.lists(st.integers(0, 3), min_size=1, max_size=8),
       depth=st.integers(2, 8), cap=st.integers(1, 6),
       min_prob=st.sampled_from([0.0, 0.1, 0.5]))
def test_longest_match_and_draft_match_brute_force(seqs, pattern, depth, cap, min_prob):
    tree = SuffixTree(depth)
    for sid, q in enumerate(seqs):
        tree.extend(sid, q)
    pattern = pattern[-depth:]
    n = SuffixDrafter._longest_match(tree, pattern)
    assert n == longest_occurring_suffix(seqs, pattern)
    for m in range(1, n + 1):
        node, idx = tree.match(pattern, len(pattern) - m)
        draft, score = tree.draft(node, idx, min(cap, depth - m), min_prob)
        check_draft(seqs, depth, pattern[-m:], draft, score, min(cap, depth - m), min_prob)


def test_common_prefix():
    a = list(range(5000))
    for cut in (0, 1, 255, 256, 257, 3000, 4999):
        b = a[:cut] + [-1] + a[cut + 1:]
        assert common_prefix(a, b) == cut
    assert common_prefix(a, a) == 5000
    assert common_prefix(a, a[:10]) == 10
    assert common_prefix(a, a, limit=7) == 7


# -- the drafter -----------------------------------------------------------------------------

PHRASE = list(range(100, 140))  # 40 tokens that only the session's first prompt holds


def run(drafter: SuffixDrafter, rid: str, session: str | None, prompt: list[int],
        output: list[int], k: int = 8) -> list[list[int]]:
    """Feed a request token by token as the engine would; the drafts of each step."""
    tokens = list(prompt)
    req = DraftRequest(rid, session, tokens, len(prompt))
    drafts = []
    for t in output:
        drafts.append(drafter.propose(req, k))
        tokens.append(t)
    drafter.on_finished(req)
    return drafts


def filler(seed: int, n: int) -> list[int]:
    return [1000 + seed * 1000 + i for i in range(n)]  # never repeats, across seeds either


def test_session_tree_survives_turns_and_is_dropped():
    for scoped in (True, False):
        d = SuffixDrafter({"suffix_session_scope": scoped})
        run(d, "t1", "s", filler(1, 50) + PHRASE + filler(2, 50), filler(3, 5))
        # Turn 2 starts the phrase; its own prompt holds only that start.
        drafts = run(d, "t2", "s", filler(4, 30) + PHRASE[:10], PHRASE[10:30])
        if scoped:
            assert drafts[0] == PHRASE[10:18]
            assert sum(len(x) for x in drafts) >= 8
        else:  # a per-request tree (and the outputs-only global tree) knows nothing of it
            assert drafts == [[]] * len(drafts)
    d = SuffixDrafter({})
    run(d, "t1", "s", filler(1, 50) + PHRASE, filler(3, 5))
    d.drop_session("s")
    assert run(d, "t3", "s", filler(5, 30) + PHRASE[:10], PHRASE[10:12]) == [[], []]


def test_resent_prefix_is_not_ingested_twice():
    d = SuffixDrafter({"suffix_ingest_tokens_per_step": 1 << 20})
    p1 = filler(1, 300)
    run(d, "t1", "s", p1, filler(2, 20))
    tree = d._sessions["s"].tree
    before = tree.num_tokens
    assert before == 320
    p2 = p1 + filler(2, 20) + filler(3, 30)  # the agent resends everything, then adds
    run(d, "t2", "s", p2, filler(4, 10))
    assert tree.num_tokens - before == 30 + 10 + d.max_depth - 1


def test_global_tree_is_bounded_and_lru():
    d = SuffixDrafter({"suffix_decoding_max_cached_requests": 4, "suffix_session_scope": False})
    outs = [filler(10 + i, 30) for i in range(10)]
    for i, out in enumerate(outs):
        run(d, f"r{i}", None, filler(40 + i, 5), out)
    trees = [t for t in (d._global, d._global_old) if t is not None]
    assert sum(len(t._seqs) for t in trees) <= 4
    # A recent output is drafted from (its start is in the new prompt); an old one is gone.
    assert run(d, "new", None, filler(60, 5) + outs[9][:10], outs[9][10:12])[0] == outs[9][10:18]
    assert run(d, "old", None, filler(61, 5) + outs[0][:10], outs[0][10:12]) == [[], []]
    d = SuffixDrafter({"suffix_global_max_tokens": 100, "suffix_session_scope": False})
    for i in range(10):
        run(d, f"r{i}", None, filler(40 + i, 5), filler(10 + i, 80))
    assert d._global.num_tokens + d._global_old.num_tokens <= 100


def test_session_trees_are_bounded():
    d = SuffixDrafter({"suffix_session_max_tokens": 1000})
    for i in range(10):
        run(d, f"r{i}", f"s{i}", filler(i, 300), filler(20 + i, 10))
    assert sum(s.tree.num_tokens for s in d._sessions.values()) <= 1000
    assert "s9" in d._sessions and "s0" not in d._sessions
    run(d, "big", "huge", filler(50, 1200), filler(51, 5))  # alone over the budget: not kept
    assert "huge" not in d._sessions


def test_draft_length_follows_match_length():
    # The continuation after [7, 8] is long, but only two tokens of context match it.
    prompt = [7, 8] + PHRASE + filler(1, 20) + [6, 7, 8]
    for factor, want in ((1.0, 2), (2.0, 4), (0.5, 1)):
        d = SuffixDrafter({"suffix_decoding_max_spec_factor": factor})
        assert d.propose(DraftRequest("r", None, list(prompt), len(prompt)), 8) == PHRASE[:want]
    # suffix_min_score drops drafts expected to yield too little (this one scores 1.0).
    d = SuffixDrafter({"suffix_min_score": 1.0})
    assert d.propose(DraftRequest("r", None, list(prompt), len(prompt)), 8) == []
    # A longer match earns the full k.
    prompt = filler(2, 5) + PHRASE + filler(1, 20) + PHRASE[:12]
    d = SuffixDrafter({})
    assert d.propose(DraftRequest("r", None, list(prompt), len(prompt)), 8) == PHRASE[12:20]


def test_min_token_prob_stops_at_an_unlikely_branch():
    # After [5, 1, 2] come 3 (four times) and 4 (once); after [5, 1, 2, 3] always 9 9.
    prompt = [5, 1, 2, 3, 9, 9] * 4 + [5, 1, 2, 4, 0] + filler(1, 5) + [5, 1, 2]
    req = DraftRequest("r", None, list(prompt), len(prompt))
    assert SuffixDrafter({}).propose(req, 3)[:3] == [3, 9, 9]
    # The live sequence's own [5, 1, 2] counts too: P(3 | 5 1 2) = 4 / 6.
    d = SuffixDrafter({"suffix_decoding_min_token_prob": 0.7})
    assert d.propose(DraftRequest("r", None, list(prompt), len(prompt)), 3) == []


def test_no_draft_when_nothing_repeats():
    d = SuffixDrafter({})
    assert all(x == [] for x in run(d, "c", "s", filler(1, 200), filler(2, 200)))


def test_options_come_from_speculative_config():
    cfg = SpeculativeConfig.parse({"method": "suffix", "num_speculative_tokens": 8,
                                   "suffix_decoding_max_tree_depth": 16,
                                   "suffix_session_scope": False})
    d = SuffixDrafter(cfg)
    assert (d.max_depth, d.session_scope, d.min_prob) == (16, False, 0.1)
    bad = SpeculativeConfig.parse({"method": "suffix", "num_speculative_tokens": 8,
                                   "suffix_sesion_scope": False})
    try:
        SuffixDrafter(bad)
    except ValueError as e:
        assert "suffix_sesion_scope" in str(e)
    else:
        raise AssertionError("a mistyped key was accepted")


# -- in the engine ---------------------------------------------------------------------------

def _generate(llm, prompts: list[list[int]], session: str | None, tag: str) -> list[list[int]]:
    """LLM.generate with a session id (the core's own request path)."""
    from loomserve import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        rid = f"{tag}-{i}"
        out[rid] = []
        llm.core.add(llm.inputs.make_core_request(rid, p, sp, session_id=session))
    while llm.core.has_work():
        for o in llm.core.step():
            out[o.request_id] += o.new_token_ids
    return list(out.values())


def test_engine_greedy_identical_and_session_state_follows_the_session():
    import os

    import pytest

    from loomserve import LLM

    path = os.path.join(os.path.dirname(__file__), "..", "fixtures", "tiny-llama")
    if not os.path.isdir(path):
        pytest.skip("tests/fixtures/tiny-llama is missing")
    base = list(range(20, 52))
    turn1 = [base * 3, [7, 8, 9, 10, 11] * 8 + base[:9]]
    kw = {"dtype": "float32", "kv_cache_memory": "4MiB"}
    plain = LLM(path, **kw)
    ref1 = _generate(plain, turn1, None, "a")
    turn2 = [p + o + base[:12] for p, o in zip(turn1, ref1)]  # the agent resends, then adds
    ref2 = _generate(plain, turn2, None, "b")
    plain.close()
    llm = LLM(path, speculative_config={"method": "suffix", "num_speculative_tokens": 4}, **kw)
    assert _generate(llm, turn1, "s", "a") == ref1
    assert _generate(llm, turn2, "s", "b") == ref2
    stats = llm.core.stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    drafter = llm.core.spec.drafter
    assert not drafter._live and "s" in drafter._sessions  # requests gone, session kept
    llm.core.end_session("s")
    assert "s" not in drafter._sessions
    llm.close()


def test_a_session_learns_turns_it_never_drafted_for():
    d = SuffixDrafter({})
    req = DraftRequest("t1", "s", filler(1, 50) + PHRASE, 90)
    d.on_finished(req)  # the engine never asked for drafts (e.g. a large batch)
    assert run(d, "t2", "s", filler(4, 30) + PHRASE[:10], PHRASE[10:12])[0] == PHRASE[10:18]


def test_a_session_tree_expires_with_the_session_pin():
    """The session's KV pin runs out (TTL): its suffix tree goes with it (retention.on_drop)."""
    import os
    import time

    from loomserve import LLM

    path = os.path.join(os.path.dirname(__file__), "..", "fixtures", "tiny-llama")
    llm = LLM(path, dtype="float32", kv_cache_memory="4MiB", session_pin_ttl=0.3,
              session_pin_budget="2MiB",
              speculative_config={"method": "suffix", "num_speculative_tokens": 4})
    try:
        _generate(llm, [list(range(20, 60)) * 2], "s", "a")
        drafter = llm.core.spec.drafter
        assert "s" in drafter._sessions and llm.core.kv.pins.blocks("s")
        time.sleep(0.4)
        llm.core.kv.pins.expire()
        assert not llm.core.kv.pins.blocks("s") and "s" not in drafter._sessions
    finally:
        llm.close()
