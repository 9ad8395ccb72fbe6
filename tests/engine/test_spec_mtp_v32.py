"""MTP drafts (`"method": "mtp"`) on tiny-deepseek-v32, whose checkpoint carries one MTP layer at
model.layers.2: a DeepSeek-V3.2 decoder layer (sparse MLA with a lightning indexer of its own,
index_topk 8 below the prompts' lengths) inside DeepSeek's NextN parts (deepseek_mtp.py), its
latent rows and indexer keys in two KV groups (deepseek_v32.py), the proposer building both
groups' metadata (spec_mtp.py).

Oracles: the MTP layer's logits against DeepSeek's formula in plain torch around transformers'
DeepseekV32 decoder layer (tests/fixtures/build_mla_fixture.py: mtp_reference; the reference
model loads the layer as layer 2), fed transformers' final hidden states after the norm, for
every row of a prompt and its chained drafts 2 and 3; the same on a variant whose MTP key lands
in a spare column of the model's last key entry (3 layers, 2 keys per entry); greedy outputs
against the same engine without speculation, cold and warm (prefix hits), chunked, every draft 1
equal to the reference's argmax over the final sequence, no block or per-request state left.
The fixture's MTP head was fitted to the target's greedy continuations of MTP_PROMPTS
(build_dsa_fixture.py: add_fitted_mtp).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from loomserve.execution.batch import ModelInput, ScheduledSeq
from loomserve.execution.spec_mtp import MtpRun
from tests.engine.test_spec_decode import fixture, make
from tests.engine.test_spec_mtp import (
    GREEDY,
    MTP,
    PROMPTS,
    assert_clean_mtp,
    check_chained_drafts,
    check_greedy_and_first_drafts,
    load_builder,
    mtp_runner,
)
from tests.execution.models.conftest import GREEDY as SAMPLE_GREEDY

NAME = "tiny-deepseek-v32"
# 20 tokens: rows past index_topk (8) attend to the 8 keys their indexer picks
TOKENS = [5, 17, 301, 42, 42, 9, 128, 77, 3, 250, 64, 11, 400, 7, 7, 88, 123, 19, 260, 31]


@pytest.fixture(scope="module")
def builder():
    return load_builder()


def _seq(r, tokens: list[int], n: int) -> ScheduledSeq:
    """A prefill of `tokens` with blocks for n tokens in every KV group (fresh ids)."""
    per = -(-n // r.block_size)
    groups = len(r.kv_cache_config.groups)
    tables = [list(range(g * per + 1, (g + 1) * per + 1)) for g in range(groups)]
    return ScheduledSeq("r", list(tokens), 0, tables, True, SAMPLE_GREEDY, 0)


def _check_logits(r, folder: str, ref, b) -> None:
    """Draft 1, every row's MTP logits and g, and chained drafts 2 and 3 against the
    reference around transformers' V3.2 decoder layer."""
    n = len(TOKENS) + 4
    out = r.execute(ModelInput([_seq(r, TOKENS, n)]))
    sampled = out.sampled["r"]
    want, g = b.mtp_reference(folder, TOKENS, sampled, ref=ref)
    follows, drafts = out.drafts["r"]
    assert follows == len(TOKENS) + 1 and len(drafts) == 3
    assert drafts[0] == int(want[-1].argmax())
    s = _seq(r, TOKENS, n)  # the step's target hidden states again, same blocks
    r.compute_logits(ModelInput([s]))
    hidden, r.model.last_hidden = r.model.last_hidden, None
    h = r.mtp.run_module(r, 0, [MtpRun(s, 0, TOKENS[1:] + [sampled], [hidden], None)])
    got = r.model.mtp.layers[0].logits(r.model, h).float()
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(h, g, atol=2e-4, rtol=2e-4)
    check_chained_drafts(lambda t, nxt, chained: b.mtp_reference(folder, t, nxt, ref=ref,
                                                                 chained=chained),
                         r, s, TOKENS, sampled, drafts, g, h)


def test_mtp_logits_equal_the_plain_torch_reference(builder):
    """The MTP layer's latent rows in a latent group of their own (not the first attention
    group, which the other families' MTP layers share), its key in a third key column (one
    key entry more: 2 layers fill the model's); logits of every row, sparse (the MTP layer's
    top-8 selection changes them), and chained drafts equal the reference's."""
    folder = fixture(NAME)
    r = mtp_runner(folder)
    assert type(r.model.mtp.layers[0].block.self_attn).__name__ == "SparseLatentAttention"
    assert [(type(g.spec).__name__, g.layer_ids) for g in r.kv_cache_config.groups] == [
        ("MLAAttentionSpec", (0, 1)), ("MLAAttentionSpec", (2,)), ("IndexerKeySpec", (3, 4))]
    assert r.model.mtp_kv_groups(0) == (1, 2) and r.attn_groups[0] == 0
    ref = builder.reference_model(folder)
    _check_logits(r, folder, ref, builder)
    sparse, _ = builder.mtp_reference(folder, TOKENS, ref=ref)
    indexer = ref[0].model.layers[2].self_attn.indexer
    indexer.index_topk = 10_000  # the MTP layer attends to every key
    try:
        dense, _ = builder.mtp_reference(folder, TOKENS, ref=ref)
    finally:
        indexer.index_topk = 8
    assert torch.equal(sparse[:8], dense[:8]) and (sparse[8:] - dense[8:]).abs().max() > 0.05


def test_mtp_key_in_a_spare_column_of_the_last_key_entry(tmp_path, builder):
    """A 3-layer variant (layer 2 a copy of layer 1, the MTP layer moved to layer 3): 3 keys in
    2 entries of 2 leave a column spare, which the MTP layer's key takes (no entry more); the
    target's greedy outputs are unchanged by the MTP writes beside its layer 2 keys, and the
    MTP logits equal the reference's."""
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "three"
    shutil.copytree(fixture(NAME), dst)
    w = load_file(dst / "model.safetensors")
    mtp = {k: v for k, v in w.items() if k.startswith("model.layers.2.")}
    w = {k: v for k, v in w.items() if k not in mtp}
    w.update({k.replace("model.layers.1.", "model.layers.2."): v.clone()
              for k, v in w.items() if k.startswith("model.layers.1.")})
    w.update({k.replace("model.layers.2.", "model.layers.3."): v for k, v in mtp.items()})
    save_file(w, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(num_hidden_layers=3, layer_types=cfg["layer_types"] + ["indexed_attention"],
               mlp_layer_types=cfg["mlp_layer_types"] + ["sparse"])
    (dst / "config.json").write_text(json.dumps(cfg))
    r = mtp_runner(str(dst))
    assert [type(s).__name__ for s in r.layer_specs].count("IndexerKeySpec") == 2
    assert r.model.keys_per_entry == 2 and r.model.mtp_kv_groups(0)[1] == r.model.groups[-1]
    mtp_keys = r.model.mtp.layers[0].block.self_attn.indexer.key_cache
    layer2_keys = r.model.model.layers[2].self_attn.indexer.key_cache
    assert mtp_keys.data_ptr() - layer2_keys.data_ptr() == 16 * 4  # the next 16 fp32 columns
    _check_logits(r, str(dst), builder.reference_model(str(dst)), builder)
    plain = make(str(dst), None)
    want = [o.token_ids for o in plain.generate(PROMPTS[:2], GREEDY)]
    llm = make(str(dst), MTP, max_num_batched_tokens=32)
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY)] == want
    assert llm.core.spec.stats.num_draft_tokens > llm.core.spec.stats.num_drafts
    assert_clean_mtp(llm)


def test_greedy_identical_with_mtp_drafts_cold_and_warm_and_leak_free(builder):
    """Exact greedy outputs, drafts accepted and rejected, every draft 1 of the first prompt
    equal to the reference's argmax over its final sequence (the MTP layer's latent rows and
    indexer keys stay those of the accepted tokens through chunked prefill, rejections,
    rollback and prefix hits)."""
    folder = fixture(NAME)
    ref = builder.reference_model(folder)
    check_greedy_and_first_drafts(
        NAME, PROMPTS, GREEDY,
        lambda t, nxt: builder.mtp_reference(folder, t, nxt, ref=ref)[0])
