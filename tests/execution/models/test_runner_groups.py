"""The runner's KV groups: grouping and order, the packed page layout shared by several groups,
state directives applied to whole pages of the real buffer, and pages full of garbage (NaN
bytes, as left by another group) that must not leak into a hybrid model's logits."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from loomserve.execution.batch import ModelInput, ScheduledSeq, StateDirective
from loomserve.execution.models.registry import resolve
from loomserve.kv.planning import group_layers
from loomserve.kv.spec import FullAttentionSpec, LinearStateSpec, SlidingWindowSpec
from tests.execution.models.conftest import FIXTURES, GREEDY, ref_logits, tiny_runner

F32 = torch.float32


def test_group_layers_orders_full_sliding_state():
    full = FullAttentionSpec(4, 2, 16, F32)
    swa = SlidingWindowSpec(4, 2, 16, F32, sliding_window=8)
    swa2 = SlidingWindowSpec(4, 2, 16, F32, sliding_window=16)
    state = LinearStateSpec(4, state_shapes=((3, 5), (2, 4, 4)))
    groups = group_layers([state, swa2, None, swa, full, state, swa, full])
    # swa2 has one layer, so the other attention groups split into one-layer groups too.
    assert [(g.spec, g.layer_ids) for g in groups] == [
        (full, (4,)), (full, (7,)), (swa2, (1,)), (swa, (3,)), (swa, (6,)), (state, (0, 5))]
    assert groups[-1].bytes_per_block() == 2 * (15 + 32) * 4


def test_group_layers_splits_attention_groups_to_equal_pages():
    full = FullAttentionSpec(4, 2, 16, F32)
    swa = SlidingWindowSpec(4, 2, 16, F32, sliding_window=8)
    gemma = [swa] * 5 + [full] + [swa] * 5 + [full]  # 5:1, as Gemma 3
    groups = group_layers(gemma)
    assert [g.layer_ids for g in groups] == [(5, 11), (0, 1), (2, 3), (4, 6), (7, 8), (9, 10)]
    assert len({g.bytes_per_block() for g in groups}) == 1  # no page is partly empty
    assert group_layers([full] * 4)[0].layer_ids == (0, 1, 2, 3)  # one attention group: as is
    state = LinearStateSpec(4, state_shapes=((3, 5),))
    assert [g.layer_ids for g in group_layers([state, state, state, full])] == [(3,), (0, 1, 2)]


def test_registry_resolves_architectures():
    cls, cfg = resolve({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 64,
                        "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
                        "vocab_size": 100, "sliding_window": 8})
    assert cls.__name__ == "LlamaForCausalLM" and cfg.sliding_window == 8
    cls, _ = resolve({"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2,
                      "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100,
                      "hidden_activation": "gelu_pytorch_tanh"})
    assert cls.__name__ == "Gemma3ForCausalLM"
    with pytest.raises(ValueError, match="unsupported architecture"):
        resolve({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})


def test_groups_share_one_packed_pool():
    r = tiny_runner("tiny-gemma3")  # layers: sliding, full, sliding
    kc = r.kv_cache_config
    full, swa_a, swa_b = kc.groups  # the sliding pair splits to match the one full layer
    assert (full.layer_ids, swa_a.layer_ids, swa_b.layer_ids) == ((1,), (0,), (2,))
    assert r.model.groups == [1, 0, 2]
    per_layer = 2 * 4 * 2 * 16 * 4  # K and V of one layer per block
    assert kc.page_bytes == per_layer and all(g.bytes_per_block() == per_layer for g in kc.groups)
    base = r.kv_buffer.data_ptr()
    layers = r.model.model.layers
    # Every group's page starts at byte 0 of the block's page.
    for layer in layers:
        assert layer.self_attn.k_cache[5].data_ptr() - base == 5 * kc.page_bytes
        assert layer.self_attn.v_cache[5].data_ptr() - base == 5 * kc.page_bytes + per_layer // 2
    assert not r.zero_new_blocks  # every page holds K/V of the model dtype: no garbage to clear


def test_state_directives_copy_and_zero_whole_pages():
    r = tiny_runner("tiny-gemma3")
    buf, page = r.kv_buffer, r.kv_cache_config.page_bytes
    buf[3] = torch.arange(page, dtype=torch.int64).remainder(251).to(torch.uint8)
    buf[7].fill_(9)
    buf[8].fill_(9)
    seqs = [ScheduledSeq("a", [1], 5, [[]], True, GREEDY, states={1: StateDirective(7, init_from=3)}),
            ScheduledSeq("b", [1, 2], 0, [[]], True, GREEDY, states={0: StateDirective(8, zero_init=True)}),
            ScheduledSeq("c", [1], 9, [[]], True, GREEDY, states={1: StateDirective(4)})]
    r._apply_state_directives(seqs)
    assert torch.equal(buf[7], buf[3])  # the whole page, every layer of the group
    gb = r.group_bytes[0]
    assert not buf[8, :gb].any() and (buf[8, gb:] == 9).all()  # only group 0's region
    with pytest.raises(ValueError, match="no state directive"):
        r._state_batch(seqs, 1)  # b has none for group 1
    sb = r._state_batch([seqs[0], seqs[2]], 1)
    assert [(x.start, x.end, x.start_pos, x.running_block) for x in sb.seqs] == [(0, 1, 5, 7), (1, 2, 9, 4)]


needs_hybrid = pytest.mark.skipif(importlib.util.find_spec("loomserve.execution.models.qwen3_next") is None
                                  or not (FIXTURES / "tiny-qwen3-next").is_dir(),
                                  reason="the Qwen3-Next model (linear-state layers) is not here")


@needs_hybrid
def test_hybrid_runner_layout_and_garbage_pages():
    from transformers import AutoModelForCausalLM

    r = tiny_runner("tiny-qwen3-next")
    kc = r.kv_cache_config
    kinds = [g.spec.kind for g in kc.groups]
    assert kinds == ["full_attention", "linear_state"] and r.state_groups == [1] and r.zero_new_blocks
    state = kc.groups[1]
    assert kc.page_bytes == max(g.bytes_per_block() for g in kc.groups)
    layer = r.model.model.layers[state.layer_ids[1]].linear_attn
    first = layer.state_cache[0]
    assert first[2].data_ptr() - r.kv_buffer.data_ptr() == 2 * kc.page_bytes + state.spec.bytes_per_block_per_layer()
    assert [tuple(v.shape[1:]) for v in layer.state_cache] == list(state.spec.state_shapes)
    # Every page full of 0xFF bytes (NaN as fp32): fresh attention blocks must be cleared and
    # the state zeroed, or NaN reaches the logits through masked positions or the recurrence.
    r.kv_buffer.fill_(0xFF)
    ref = AutoModelForCausalLM.from_pretrained(str(FIXTURES / "tiny-qwen3-next"), dtype=F32).eval()
    tokens = torch.randint(3, 400, (11,), generator=torch.Generator().manual_seed(0)).tolist()
    want = ref_logits(ref, tokens)
    table, running = [10, 11, 12], 20
    s = ScheduledSeq("h", tokens[:10], 0, [table, []], True, GREEDY,
                     states={1: StateDirective(running, zero_init=True, saves=[(8, 21)])})
    due, logits = r.compute_logits(ModelInput([s]))
    torch.testing.assert_close(logits[0], want[9], atol=1e-4, rtol=1e-4)
    s = ScheduledSeq("h", tokens[10:], 10, [table, []], True, GREEDY, states={1: StateDirective(running)})
    due, logits = r.compute_logits(ModelInput([s]))
    torch.testing.assert_close(logits[0], want[10], atol=1e-4, rtol=1e-4)
    # A second request resumes from the checkpoint taken after 8 tokens (a prefix hit).
    s = ScheduledSeq("k", tokens[8:], 8, [table[:2] + [13], []], True, GREEDY,
                     states={1: StateDirective(22, init_from=21)})
    due, logits = r.compute_logits(ModelInput([s]))
    torch.testing.assert_close(logits[0], want[10], atol=1e-4, rtol=1e-4)
