"""The KV pool's two layouts (execution/kv_pool.py): which one a cache gets, and that a page
means the same bytes in both (a page stored from one loads into the other), through the tiers'
page copies and a real host tier."""

from __future__ import annotations

import torch

from loomserve.execution.kv_buffer import KVPool, layer_major_fits
from loomserve.kv.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    LinearStateSpec,
    SlidingWindowSpec,
)
from loomserve.kv.tiers.base import copy_page, cpu_row
from loomserve.kv.tiers.host import HostTier

FULL = FullAttentionSpec(4, 2, 8, torch.float32)
SHAPE = (2, 4, 2, 8)  # [K/V, block_size, kv_heads, head_dim]


def _config(*groups: KVCacheGroup, blocks: int = 6) -> KVCacheConfig:
    return KVCacheConfig(blocks, groups)


def _fill(pool: KVPool, kc: KVCacheConfig, seed: int) -> list[torch.Tensor]:
    """Random K/V through every layer's view; returns the views."""
    g = torch.Generator().manual_seed(seed)
    views = []
    per = kc.groups[0].spec.bytes_per_block_per_layer()
    for slot in range(len(kc.groups[0].layer_ids)):
        v = pool.layer_view(slot, per, 0, torch.float32, SHAPE)
        v.copy_(torch.randn(v.shape, generator=g))
        views.append(v)
    return views


def test_layout_choice():
    assert layer_major_fits(_config(KVCacheGroup(FULL, (0, 1, 2))))
    swa = SlidingWindowSpec(4, 2, 8, torch.float32, sliding_window=16)
    assert layer_major_fits(_config(KVCacheGroup(FULL, (0, 2)), KVCacheGroup(swa, (1, 3))))
    assert not layer_major_fits(_config(KVCacheGroup(FULL, (0, 2, 4)), KVCacheGroup(swa, (1, 3))))
    state = LinearStateSpec(4, state_shapes=((2, 8),))
    assert not layer_major_fits(_config(KVCacheGroup(FULL, (0,)), KVCacheGroup(state, (1,))))
    kc = _config(KVCacheGroup(FULL, (0, 1)))
    lm, bm = KVPool.allocate(kc, torch.device("cpu")), KVPool.allocate(kc, torch.device("cpu"), False)
    assert lm.layer_major and lm.pages.shape == (6, 2, kc.page_bytes // 2)
    assert not bm.layer_major and bm.pages.shape == (6, kc.page_bytes)
    assert lm.page_bytes == bm.page_bytes == kc.page_bytes


def test_layer_major_views_are_sequential_per_layer():
    """One layer's K and V of consecutive blocks lie one after another (what decode reads)."""
    kc = _config(KVCacheGroup(FULL, (0, 1)))
    pool = KVPool.allocate(kc, torch.device("cpu"))
    per = kc.groups[0].spec.bytes_per_block_per_layer()
    kv = pool.layer_view(1, per, 0, torch.float32, SHAPE)
    assert kv.is_contiguous() and kv.data_ptr() == pool.storage.data_ptr() + kc.num_blocks * per
    assert pool.storage.data_ptr() % 4096 == 0  # no row load splits a line; a 4 KB block is a page
    assert not pool.storage.any()


def test_pages_mean_the_same_bytes_in_both_layouts():
    kc = _config(KVCacheGroup(FULL, (0, 1, 2)))
    cpu = torch.device("cpu")
    lm, bm = KVPool.allocate(kc, cpu), KVPool.allocate(kc, cpu, False)
    want = _fill(lm, kc, 0)
    for b in range(kc.num_blocks):  # layer-major page -> block-major page, as a tier copy
        copy_page(bm.pages[b], lm.pages[b])
    got = [bm.layer_view(s, kc.groups[0].spec.bytes_per_block_per_layer(), 0, torch.float32, SHAPE)
           for s in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    back = KVPool.allocate(kc, cpu)
    for b in range(kc.num_blocks):  # and back into a fresh layer-major pool
        copy_page(back.pages[b], bm.pages[b])
    assert torch.equal(back.storage, lm.storage)
    assert torch.equal(cpu_row(lm.pages, 2), bm.pages[2])


def test_zero_clears_whole_pages_only_where_asked():
    kc = _config(KVCacheGroup(FULL, (0, 1)))
    pool = KVPool.allocate(kc, torch.device("cpu"))
    views = _fill(pool, kc, 1)
    pool.zero(torch.tensor([1, 4]), kc.page_bytes)
    for v in views:
        assert not v[1].any() and not v[4].any() and v[0].abs().sum() > 0 and v[5].abs().sum() > 0


def test_host_tier_round_trips_layer_major_pages():
    """A real host tier stores layer-major pages and loads them back, into either layout."""
    kc = _config(KVCacheGroup(FULL, (0, 1)))
    cpu = torch.device("cpu")
    src = KVPool.allocate(kc, cpu)
    want = _fill(src, kc, 2)
    tier = HostTier(8 * kc.page_bytes, kc.page_bytes, pin_memory=False)
    keys = [b"k%d" % i for i in range(kc.num_blocks)]
    assert all(tier.put(keys, src.pages, list(range(kc.num_blocks))))
    for layer_major in (True, False):
        dst = KVPool.allocate(kc, cpu, layer_major)
        rows = list(reversed(range(kc.num_blocks)))  # block b's page lands in row n-1-b
        assert all(tier.get_into(keys, dst.pages, rows))
        per = kc.groups[0].spec.bytes_per_block_per_layer()
        for s, w in enumerate(want):
            got = dst.layer_view(s, per, 0, torch.float32, SHAPE)
            assert torch.equal(got.flip(0), w)
