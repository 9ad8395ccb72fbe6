"""Triton kernels over the paged KV: keys are addressed one by one through the block table.

A key at position p of a sequence lies at page table[p // block_size], row p % block_size, so a
tile of BLOCK_N keys may span blocks of any size and nothing is gathered or masked densely.
All softmax state is fp32; products run in the cache dtype (IEEE fp32 products for fp32, so a
float32 run on a GPU matches the CPU to rounding). Invariants the callers keep: the last stride
of q and the caches is 1; table rows cover every position below each sequence's key count.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """IEEE: fp32 products (the operands upcast; exact for 16-bit ones). The backend asks for it
    in fp32 runs and under the interpreter, whose 16-bit dot is wrong (triton 3.9)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _widen_fp8(x, KV_FP8: tl.constexpr):
    """8-bit float codes (uint8) -> fp32, exactly, by bits (every GPU Triton targets, and the
    interpreter): e5m2 is a binary16's top byte; e4m3's sign, exponent and mantissa shifted into
    a binary16's places give 2^-8 of its value, subnormals included (kernels/fp8.h)."""
    h = x.to(tl.uint16) << 8
    if KV_FP8 == 1:
        h = ((h >> 1) & 0x3F80) | (h & 0x8000)
    f = h.to(tl.float16, bitcast=True).to(tl.float32)
    if KV_FP8 == 1:
        f = f * 256.0
    return f


@triton.jit
def _load_kv(q_ptr, k_ptr, v_ptr, row, pos, valid, block_size, kvh, d, dmask,
             sk_b, sk_o, sk_h, sv_b, sv_o, sv_h, KV_FP8: tl.constexpr):
    """K and V rows [len(pos), HD_PAD] of key positions `pos`, found through a table row, in
    the queries' dtype (a narrower --kv-cache-dtype is widened here; KV_FP8 1 / 2: the caches
    are uint8 views of float8_e4m3fn / float8_e5m2 pages)."""
    blk = tl.load(row + pos // block_size, mask=valid, other=0).to(tl.int64)
    off = pos % block_size
    mask = valid[:, None] & dmask[None, :]
    k = tl.load(k_ptr + blk[:, None] * sk_b + off[:, None] * sk_o + kvh * sk_h + d[None, :],
                mask=mask, other=0.0)
    v = tl.load(v_ptr + blk[:, None] * sv_b + off[:, None] * sv_o + kvh * sv_h + d[None, :],
                mask=mask, other=0.0)
    if KV_FP8 != 0:
        k, v = _widen_fp8(k, KV_FP8), _widen_fp8(v, KV_FP8)
    return k.to(q_ptr.dtype.element_ty), v.to(q_ptr.dtype.element_ty)


@triton.jit
def _fold(q, k, v, allowed, m, l, acc, scale, IEEE: tl.constexpr):
    """One tile of keys folded into each query row's running (max, sum, acc). A row that has
    seen no key yet keeps max -inf and adds nothing (exp(-inf - 0) = 0, no NaN)."""
    s = tl.where(allowed, _dot(q, tl.trans(k), IEEE) * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
    return m_new, l, acc


@triton.jit
def decode_split(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, part_acc, part_ml,
                 sq_t, sq_h, sk_b, sk_o, sk_h, sv_b, sv_o, sv_h, s_tab,
                 scale, window, block_size, n_split,
                 GROUP: tl.constexpr, G_PAD: tl.constexpr, HD: tl.constexpr,
                 HD_PAD: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr,
                 HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr, KV_FP8: tl.constexpr):
    """Program (decode, kv head, split): the group's query heads as rows over one split of the
    visible keys. Each decode splits its own keys, from its key count on the device: into at
    most n_split runs of whole BLOCK_N tiles, none under MIN_SPLIT keys (so no argument
    depends on the context and a captured CUDA graph replays at any length). Writes the
    unnormalized acc and (max, sum) per row; an empty split writes (-inf, 0)."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lens_ptr + seq)
    if HAS_WINDOW:
        lo = tl.maximum(length - window, 0)
    else:
        lo = length * 0
    visible = length - lo
    splits = tl.maximum(tl.minimum(n_split, (visible + MIN_SPLIT - 1) // MIN_SPLIT), 1)
    per = ((visible + splits - 1) // splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = lo + split * per
    end = tl.minimum(start + per, length)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, HD_PAD)
    gmask = g < GROUP
    dmask = d < HD
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + seq * sq_t + heads[:, None] * sq_h + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, HD_PAD], tl.float32)
    row = table_ptr + seq.to(tl.int64) * s_tab
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        k, v = _load_kv(q_ptr, k_ptr, v_ptr, row, pos, valid, block_size, kvh, d, dmask,
                        sk_b, sk_o, sk_h, sv_b, sv_o, sv_h, KV_FP8)
        m, l, acc = _fold(q, k, v, valid[None, :], m, l, acc, scale, IEEE)
    base = (seq * (tl.num_programs(1) * GROUP) + heads) * n_split + split
    tl.store(part_acc + base[:, None] * HD_PAD + d[None, :], acc, mask=gmask[:, None])
    tl.store(part_ml + base * 2, m, mask=gmask)
    tl.store(part_ml + base * 2 + 1, l, mask=gmask)


@triton.jit
def decode_merge(part_acc, part_ml, sink_ptr, o_ptr, so_t, so_h, n_split, heads_total,
                 HD: tl.constexpr, HD_PAD: tl.constexpr, HAS_SINK: tl.constexpr):
    """Program (decode, head): merge the splits' partials exactly (log-sum-exp), the sink
    (gpt-oss) joining the denominator only. A row that saw no key writes zeros."""
    seq = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, HD_PAD)
    if HAS_SINK:  # the sink as the initial state: max = sink, sum = 1
        big = tl.load(sink_ptr + h).to(tl.float32)
        total = big * 0.0 + 1.0
    else:
        big = tl.full([], float("-inf"), tl.float32)
        total = tl.full([], 0.0, tl.float32)
    out = tl.zeros([HD_PAD], tl.float32)
    base = (seq * heads_total + h) * n_split
    for s in range(0, n_split):
        m_s = tl.load(part_ml + (base + s) * 2)
        l_s = tl.load(part_ml + (base + s) * 2 + 1)
        acc_s = tl.load(part_acc + (base + s) * HD_PAD + d)
        seen = l_s > 0  # an empty split (max -inf) changes nothing
        new = tl.where(seen, tl.maximum(big, m_s), big)
        a = tl.where(seen, tl.exp(big - new), 1.0)
        b = tl.where(seen, tl.exp(m_s - new), 0.0)
        out = out * a + acc_s * b
        total = total * a + l_s * b
        big = new
    res = tl.where(total > 0, out / tl.where(total > 0, total, 1.0), 0.0)
    tl.store(o_ptr + seq * so_t + h * so_h + d, res.to(o_ptr.dtype.element_ty), mask=d < HD)


@triton.jit
def prefill_split(q_ptr, k_ptr, v_ptr, o_ptr, table_ptr, tiles_ptr, sink_ptr, part_acc, part_ml,
                  sq_t, sq_h, so_t, so_h, sk_b, sk_o, sk_h, sv_b, sv_o, sv_h, s_tab,
                  scale, window, block_size, first_row, n_split, heads_total,
                  GROUP: tl.constexpr, G_PAD: tl.constexpr, HD: tl.constexpr,
                  HD_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, SINK_INIT: tl.constexpr, SPLIT: tl.constexpr,
                  IEEE: tl.constexpr, KV_FP8: tl.constexpr):
    """Program (query tile, kv head, split): tile = (first row, tokens, first position,
    chunk); its rows are the tile's tokens x the kv head's query heads (token r // G_PAD,
    head r % G_PAD), so each K/V tile is loaded once for the whole GQA group. Keys (the cached
    context and the chunk's own, already written to the pages) from the first any row sees to
    the tile's last position, split n_split ways, causal and windowed per row. SPLIT: partials
    (acc, max, sum) per (row - first_row, head, split) for decode_merge; else the normalized
    output, the sink as the initial state (SINK_INIT; with SPLIT the merge adds it)."""
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row0 = tl.load(tiles_ptr + t * 4)
    tokens = tl.load(tiles_ptr + t * 4 + 1)
    pos0 = tl.load(tiles_ptr + t * 4 + 2)
    chunk = tl.load(tiles_ptr + t * 4 + 3)
    r = tl.arange(0, BLOCK_M)
    tok = r // G_PAD
    j = r % G_PAD
    rmask = (tok < tokens) & (j < GROUP)
    d = tl.arange(0, HD_PAD)
    dmask = d < HD
    qpos = pos0 + tok
    q_rows = (row0 + tok).to(tl.int64)
    heads = kvh * GROUP + j
    q = tl.load(q_ptr + q_rows[:, None] * sq_t + heads[:, None] * sq_h + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    if SINK_INIT:  # the sink as the initial state: max = sink, sum = 1
        m = tl.load(sink_ptr + heads, mask=rmask, other=0.0).to(tl.float32)
        l = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HD_PAD], tl.float32)
    hi = pos0 + tokens
    if HAS_WINDOW:
        lo = tl.maximum(pos0 - window + 1, 0)
    else:
        lo = pos0 * 0
    per = ((hi - lo + n_split - 1) // n_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = lo + split * per
    end = tl.minimum(start + per, hi)
    row = table_ptr + chunk.to(tl.int64) * s_tab
    for n0 in range(start, end, BLOCK_N):
        kpos = n0 + tl.arange(0, BLOCK_N)
        kvalid = kpos < end
        k, v = _load_kv(q_ptr, k_ptr, v_ptr, row, kpos, kvalid, block_size, kvh, d, dmask,
                        sk_b, sk_o, sk_h, sv_b, sv_o, sv_h, KV_FP8)
        allowed = kvalid[None, :] & (kpos[None, :] <= qpos[:, None])
        if HAS_WINDOW:
            allowed = allowed & (kpos[None, :] > qpos[:, None] - window)
        m, l, acc = _fold(q, k, v, allowed, m, l, acc, scale, IEEE)
    if SPLIT:
        base = ((q_rows - first_row) * heads_total + heads) * n_split + split
        tl.store(part_acc + base[:, None] * HD_PAD + d[None, :], acc, mask=rmask[:, None])
        tl.store(part_ml + base * 2, m, mask=rmask)
        tl.store(part_ml + base * 2 + 1, l, mask=rmask)
    else:
        res = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(o_ptr + q_rows[:, None] * so_t + heads[:, None] * so_h + d[None, :],
                 res.to(o_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


@triton.jit
def sparse_mla_decode(q_ptr, c_ptr, slot_ptr, part_acc, part_ml,
                      sq_d, sq_h, sc_b, sc_o, s_slot, scale, block_size, k_total, heads, n_split,
                      RANK: tl.constexpr, RANK_PAD: tl.constexpr, ROPE: tl.constexpr,
                      ROPE_PAD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                      IEEE: tl.constexpr):
    """DeepSeek sparse attention, absorbed decode (layers/sparse_mla.py). Program (decode, head
    tile, split): queries [q_lat | q_pe] (rank + rope wide) of BLOCK_H heads over one split of
    the decode's k selected latent rows, each read in place from the pages by its pool slot
    (block = slot // block_size, row = slot % block_size; slot -1: not a key). Only selected
    rows are touched, so the cost is k's, not the context's. Writes the unnormalized acc
    [rank] and (max, sum) per head and split; an empty split writes (-inf, 0)."""
    dec = tl.program_id(0)
    tile = tl.program_id(1)
    split = tl.program_id(2)
    h = tile * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < heads
    r = tl.arange(0, RANK_PAD)
    e = tl.arange(0, ROPE_PAD)
    rmask = r < RANK
    emask = e < ROPE
    qrow = q_ptr + dec.to(tl.int64) * sq_d + h[:, None] * sq_h
    q_lat = tl.load(qrow + r[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0)
    q_pe = tl.load(qrow + RANK + e[None, :], mask=hmask[:, None] & emask[None, :], other=0.0)
    per = ((k_total + n_split - 1) // n_split + BLOCK_K - 1) // BLOCK_K * BLOCK_K
    start = split * per
    end = tl.minimum(start + per, k_total)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, RANK_PAD], tl.float32)
    for j0 in range(start, end, BLOCK_K):
        j = j0 + tl.arange(0, BLOCK_K)
        slot = tl.load(slot_ptr + dec.to(tl.int64) * s_slot + j, mask=j < end, other=-1)
        ok = slot >= 0
        slot = tl.where(ok, slot, 0).to(tl.int64)
        row = c_ptr + (slot // block_size) * sc_b + (slot % block_size) * sc_o
        ckv = tl.load(row[:, None] + r[None, :], mask=ok[:, None] & rmask[None, :], other=0.0)
        kpe = tl.load(row[:, None] + RANK + e[None, :], mask=ok[:, None] & emask[None, :],
                      other=0.0)
        ckv, kpe = ckv.to(q_ptr.dtype.element_ty), kpe.to(q_ptr.dtype.element_ty)
        s = _dot(q_lat, tl.trans(ckv), IEEE) + _dot(q_pe, tl.trans(kpe), IEEE)
        s = tl.where(ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(ckv.dtype), ckv, IEEE)
        m = m_new
    base = (dec.to(tl.int64) * n_split + split) * heads + h
    tl.store(part_acc + base[:, None] * RANK_PAD + r[None, :], acc, mask=hmask[:, None])
    tl.store(part_ml + base * 2, m, mask=hmask)
    tl.store(part_ml + base * 2 + 1, l, mask=hmask)
