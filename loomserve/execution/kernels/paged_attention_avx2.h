/* The AVX2 + FMA decode path of paged_attention.c (included there, inside its
 * `#if defined(__AVX2__) && defined(__FMA__)`): one split of a sequence's context for one kv
 * head, in chunks of CHUNK keys. Uses paged_attention.c's scalar helpers (exp_neg, round_bf16,
 * bf16_to_f32, begin_partials, end_partials, MAX_GROUP) and paged_attention_rows.h's row
 * formats (ld8, widen_row, the pairs order), included before it. */
#include <immintrin.h>

/* [sum(a[0]), ..., sum(a[7])]: eight dot-product accumulators reduced at once. */
static inline __m256 hsum8x8(const __m256 *a) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline float hmax8(__m256 x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

static inline float hsum8(__m256 x) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    m = _mm_add_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

/* exp_neg on eight lanes. */
static inline __m256 exp_neg8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693147181f), x);
    __m256 p = _mm256_set1_ps(1.f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#define CHUNK 128
/* A chunk's K + V rows of one kv head, widened to fp32, in at most this many bytes: they are
 * read once per query head, so they should stay in L1 beside the rows prefetched ahead. */
#define CHUNK_BYTES 16384

/* Keys a chunk gathers before it may end (on a block's end): CHUNK_BYTES of rows, 16 to CHUNK. */
static inline int chunk_min_keys(int head_dim) {
    int n = CHUNK_BYTES / (8 * head_dim);
    return n < 16 ? 16 : n > CHUNK ? CHUNK : n;
}

/* Row offsets (in elements, to each token row's start) of keys [a, a + n), n <= CHUNK: walks
 * the table. */
static inline int chunk_rows(const int32_t *table, int64_t block_stride, int block_size,
                             int64_t row, int64_t a, int64_t k1, int min_keys, int64_t *off) {
    int n = 0;
    while (a < k1 && n < CHUNK) {
        int64_t blk = a / block_size, first = a % block_size, cnt = block_size - first;
        if (cnt > k1 - a) cnt = k1 - a;
        if (cnt > CHUNK - n) cnt = CHUNK - n;
        int64_t base = table[blk] * block_stride + first * row;
        for (int t = 0; t < cnt; t++) off[n + t] = base + t * row;
        n += (int)cnt;
        a += cnt;
        if (n >= min_keys) break;  /* end on a block's end: see split_attend_chunked */
    }
    return n;
}

/* The chunk's K and V rows of the kv head at hoff (elements into each row): where they lie
 * (fp32, or narrower rows ld8 reads in place: fmt != 0), else narrower rows widened into kw / vw. */
static inline __attribute__((always_inline)) void chunk_pointers(
        const void *kb, const void *vb, const int64_t *offs, int64_t hoff, int n, int head_dim,
        int dtype, int fmt, float *kw, float *vw, const float **kr, const float **vr) {
    const int es = kv_esize(dtype);
    for (int t = 0; t < n; t++) {
        const char *k = (const char *)kb + (offs[t] + hoff) * es;
        const char *v = (const char *)vb + (offs[t] + hoff) * es;
        if (dtype && !fmt) {
            float *kd = kw + t * head_dim, *vd = vw + t * head_dim;
            widen_row(k, kd, head_dim, dtype);
            widen_row(v, vd, head_dim, dtype);
            kr[t] = kd;
            vr[t] = vd;
        } else {
            kr[t] = (const float *)k;
            vr[t] = (const float *)v;
        }
    }
}

/* Software prefetch of a split's K and V rows a fixed distance ahead of its reads, issued a few
 * rows at a time between the chunk's arithmetic: the cursor stays `lead` rows past the rows being
 * read, pro rata through each chunk. Why spread out: a 4 KB block is one page and the hardware
 * prefetchers restart at every page, so a compute-heavy loop leaves the memory idle unless the
 * next pages are requested early; a burst of a whole chunk's lines at once fills the line-fill
 * buffers and stalls the current chunk's loads. Into L2 only for keys streaming from DRAM
 * (paged_attention.c's keys_from_dram, per step) under a light load of arithmetic (at most 4
 * query rows per kv head): L1's few fill buffers would cap the lines in flight; else into L1,
 * where the heavier arithmetic's loads find them. Measured on a 2-vCPU Intel Xeon VM, one 128K
 * sequence x 2 layers, 2 threads, each step after a 25 MB read (the LM head), old burst ->
 * cursor: 1 row per kv head 3.4 -> 2.7 ms (into L1: 3.1), 4 rows 3.6-4.1 -> 2.9-3.4, 8 rows
 * (AVX-512) 4.7 -> 4.1 (into L2: 4.8), 16 rows 5.9 -> 5.5 (into L2: 6.4); keys left in L3
 * between steps, 4 rows: 2.7 -> 2.4 (into L2: 2.6). always_inline matters: GCC treats a
 * function made only of prefetches as const and drops a late-inlined call (no prefetch). */
typedef struct {
    const char *kb, *vb;
    const int32_t *table;
    int64_t block_stride, row, hoff, j, end, blk;
    int block_size, first, bytes, esize, lead, hint;
} PfCursor;

/* Bytes of K + V rows (the part of each row a split reads) the cursor keeps in flight ahead of
 * the reads: into L1 less, so the prefetched lines and the chunk being read fit there together.
 * Into L2, 16 to 64 KB measured alike with rows back to back; when a task read one kv head's
 * strided rows (8 kv heads x head_dim 128: 512 B every 4 KB) 64 KB was 3-7% faster. */
#define LEAD_BYTES_L1 8192
#define LEAD_BYTES_L2 65536

static inline void pf_init(PfCursor *c, const void *kb, const void *vb, const int32_t *table,
                           int64_t block_stride, int block_size, int64_t row, int64_t hoff,
                           int64_t k0, int64_t k1, int width, int group, int esize) {
    c->kb = (const char *)kb, c->vb = (const char *)vb, c->table = table;
    c->block_stride = block_stride, c->block_size = block_size, c->row = row, c->hoff = hoff;
    c->j = k0, c->end = k1, c->blk = k0 / block_size, c->first = (int)(k0 % block_size);
    c->bytes = width * esize, c->esize = esize;  /* width: elements of each row read */
    c->hint = keys_from_dram && group <= 4;
    c->lead = (c->hint ? LEAD_BYTES_L2 : LEAD_BYTES_L1) / (2 * c->bytes);
    if (c->lead < 8) c->lead = 8;
}

/* Prefetch the rows before key t + lead (clipped to the split's end). */
static inline __attribute__((always_inline)) void pf_upto(PfCursor *c, int64_t t) {
    t += c->lead;
    if (t > c->end) t = c->end;
    for (; c->j < t; c->j++) {
        int64_t off = (c->table[c->blk] * c->block_stride + c->first * c->row + c->hoff) * c->esize;
        const char *k = c->kb + off, *v = c->vb + off;
        for (int o = -(int)((uintptr_t)k & 63); o < c->bytes; o += 64) {
            if (c->hint) {
                _mm_prefetch(k + o, _MM_HINT_T1);
                _mm_prefetch(v + o, _MM_HINT_T1);
            } else {
                _mm_prefetch(k + o, _MM_HINT_T0);
                _mm_prefetch(v + o, _MM_HINT_T0);
            }
        }
        if (++c->first == c->block_size) c->first = 0, c->blk++;
    }
}

/* Where a chunk's arithmetic advances the prefetch cursor: fine (fp32 rows, read-bound) every 8
 * keys of each head's scores and values, else (16-bit rows, arithmetic-bound: the calls cost
 * more than they gain) once per head's scores or pair's values. Cursor target: the chunk's
 * first key a + n x (steps taken / steps in the chunk). At 240K keys from DRAM (1 kv head x 32,
 * 4 rows, 2 threads, Intel VM): fp32 per head 6.18-6.82 -> every 8 keys 5.58-6.41 ms; bf16
 * 3.91 -> 4.06 (so not for 16-bit rows); SmolLM2's 3 x 64 at 64K and 128K in cache alike. */
typedef struct {
    PfCursor *c;
    int64_t a;
    int n, step, steps, fine;
} Pf;

static inline __attribute__((always_inline)) void pf_step(Pf *p, int fine) {
    if (p->fine == fine) pf_upto(p->c, p->a + (int64_t)p->n * ++p->step / p->steps);
}

/* The scores of one query head over a chunk's n keys (n8 = n rounded up to 8; rows past n
 * repeat row 0 and are masked to -inf): into s, returning their max. */
static inline __attribute__((always_inline)) float chunk_scores(
        const float *qg, const float *const *kr, int n, int n8, int head_dim, float scale,
        int fmt, float *s, Pf *pf) {
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int t0 = 0; t0 < n8; t0 += 8) {
        pf_step(pf, 1);
        __m256 dots[8];
        for (int t = 0; t < 8; t++) dots[t] = _mm256_setzero_ps();
        for (int j = 0; j < head_dim; j += 8) {
            __m256 qv = _mm256_loadu_ps(qg + j);
            for (int t = 0; t < 8; t++)
                dots[t] = _mm256_fmadd_ps(qv, ld8(kr[t0 + t], j, fmt), dots[t]);
        }
        __m256 live = _mm256_cmp_ps(lane, _mm256_set1_ps((float)(n - t0)), _CMP_LT_OQ);
        __m256 sc = _mm256_mul_ps(hsum8x8(dots), _mm256_set1_ps(scale));
        sc = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), sc, live);
        _mm256_storeu_ps(s + t0, sc);
        mx = _mm256_max_ps(mx, sc);
    }
    return hmax8(mx);
}

/* Online-softmax step of one head over a chunk: rescale acc to the new max, turn s into
 * probabilities (masked lanes 0), add their sum. */
static inline __attribute__((always_inline)) void chunk_softmax(
        float mb, float *m, float *l, float *acc, float *s, int n, int n8, int head_dim,
        int dtype) {
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    if (mb > *m) {
        float alpha = *m == -INFINITY ? 0.f : exp_neg(*m - mb);
        __m256 av = _mm256_set1_ps(alpha);
        *l *= alpha;
        for (int j = 0; j < head_dim; j += 8)
            _mm256_storeu_ps(acc + j, _mm256_mul_ps(_mm256_loadu_ps(acc + j), av));
        *m = mb;
    }
    __m256 mg = _mm256_set1_ps(*m), sum = _mm256_setzero_ps();
    for (int t0 = 0; t0 < n8; t0 += 8) {
        __m256 live = _mm256_cmp_ps(lane, _mm256_set1_ps((float)(n - t0)), _CMP_LT_OQ);
        __m256 p = _mm256_and_ps(exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(s + t0), mg)), live);
        _mm256_storeu_ps(s + t0, p);
        sum = _mm256_add_ps(sum, p);
    }
    *l += hsum8(sum);
    if (dtype == 1) {  /* probabilities rounded to bf16, as torch's bf16 kernels weight V */
        for (int t = 0; t < n; t++) s[t] = round_bf16(s[t]);
    }
}

/* acc_g += sum_t s_g[t] V[t] for NH heads (NH x NV accumulators in registers, NV vectors of a
 * 64-lane block from jb): the heads share each V row's loads, and NH x NV independent FMA
 * chains hide the FMA latency (one head of 32 lanes alone is 4 chains: latency-bound). */
#define VACC(NH, NV)                                                                          \
    static inline __attribute__((always_inline)) void vacc_##NH##_##NV(                       \
            const float *const *vr, const float *s, int cs, int n, float *acc, int astride,   \
            int jb, int fmt, Pf *pf) {                                                         \
        __m256 o[NH][NV];                                                                      \
        for (int g = 0; g < NH; g++)                                                           \
            for (int v = 0; v < NV; v++) o[g][v] = _mm256_loadu_ps(acc + g * astride + jb + 8 * v); \
        for (int t = 0; t < n; t++) {                                                          \
            if ((t & 7) == 0) pf_step(pf, 1);                                                  \
            __m256 x[NV];                                                                      \
            for (int v = 0; v < NV; v++) x[v] = ld8(vr[t], jb + 8 * v, fmt);                  \
            for (int g = 0; g < NH; g++) {                                                     \
                __m256 b = _mm256_set1_ps(s[g * cs + t]);                                      \
                for (int v = 0; v < NV; v++) o[g][v] = _mm256_fmadd_ps(b, x[v], o[g][v]);      \
            }                                                                                  \
        }                                                                                      \
        for (int g = 0; g < NH; g++)                                                           \
            for (int v = 0; v < NV; v++) _mm256_storeu_ps(acc + g * astride + jb + 8 * v, o[g][v]); \
    }
VACC(1, 8) VACC(2, 4) VACC(1, 4) VACC(1, 2) VACC(1, 1) VACC(2, 2) VACC(2, 1)

/* V accumulation of heads [g0, g0 + nh) over one chunk, nh 1 or 2. */
static inline __attribute__((always_inline)) void chunk_values(
        const float *const *vr, const float *s, int n, float *acc, int astride, int head_dim,
        int nh, int fmt, Pf *pf) {
    for (int jb = 0; jb < head_dim; jb += 64) {
        int nv = (head_dim - jb) / 8 < 8 ? (head_dim - jb) / 8 : 8;
        if (nh == 2 && nv == 4) vacc_2_4(vr, s, CHUNK, n, acc, astride, jb, fmt, pf);
        else if (nh == 2 && nv == 2) vacc_2_2(vr, s, CHUNK, n, acc, astride, jb, fmt, pf);
        else if (nh == 2 && nv == 1) vacc_2_1(vr, s, CHUNK, n, acc, astride, jb, fmt, pf);
        else for (int g = 0; g < nh; g++) {
            float *a = acc + g * astride;
            const float *sg = s + g * CHUNK;
            switch (nv) {
            case 8: vacc_1_8(vr, sg, CHUNK, n, a, astride, jb, fmt, pf); break;
            case 4: vacc_1_4(vr, sg, CHUNK, n, a, astride, jb, fmt, pf); break;
            case 2: vacc_1_2(vr, sg, CHUNK, n, a, astride, jb, fmt, pf); break;
            default:
                for (int v = 0; v < nv; v++) {  /* 3, 5, 6, 7 vectors: one at a time */
                    __m256 o = _mm256_loadu_ps(a + jb + 8 * v);
                    for (int t = 0; t < n; t++) {
                        if (v == 0 && (t & 7) == 0) pf_step(pf, 1);
                        o = _mm256_fmadd_ps(_mm256_set1_ps(sg[t]), ld8(vr[t], jb + 8 * v, fmt), o);
                    }
                    _mm256_storeu_ps(a + jb + 8 * v, o);
                }
            }
        }
    }
}

/* The split for every kv head (kv head h's partials at part + h * hstride), in chunks of whole
 * blocks, each chunk ending on the first block end at or past chunk_min_keys (at most CHUNK
 * keys). Per chunk, kv head by kv head (so the split reads its rows front to back, each row
 * whole; one task per kv head read 1 / kv_heads of every row and skipped the rest: 3 kv heads
 * x head_dim 64, 2 layers x 32K keys, 4.79 -> 2.78 ms; 8 x 128, 49.1 -> 28.8): the head's
 * query rows' scores and softmax step
 * (K rows read from L1 after the first head), then V accumulated for two heads at a time
 * where head_dim <= 64 (shared V loads). fp32 rows are read where they lie, bf16 rows widened
 * once per chunk. Chunk size: each chunk pays a fixed cost (row pointers, per head a max, a
 * rescale, the accumulators loaded and stored), so chunks are as large as L1 allows. Before the
 * prefetch cursor, chunks of several blocks (K of each, then V of each) interleaved streams the
 * hardware prefetchers follow badly (1.5-2x slower at 128K on the Zen 4 VM, session 18), so a
 * chunk was one block; with the cursor, on the Intel VM (2 layers x 128K, one kv head, head_dim
 * 32, from DRAM): 16 keys 3.4-4.3 ms, 64 keys 3.0-3.5 (all in L1: 2.5 -> 2.0); head_dim 64 at
 * 32 keys 6.45 vs 9.71; 3 kv heads x head_dim 64 (rows strided) at 64 keys 8% slower than 16,
 * at 32 keys faster. */
static inline __attribute__((always_inline)) void split_attend_chunked(
        const float *q, const void *kb, const void *vb, int64_t block_stride, int block_size,
        int kv_heads, int head_dim, int group, const int32_t *table, int64_t k0, int nrows,
        const int64_t *k1s, int64_t qstride, int64_t rstride, float scale, int dtype, int fmt,
        float *part, int64_t hstride) {
    const int nq = group * kv_heads;
    float m[nq * nrows], l[nq * nrows];
    float sbuf[8 * CHUNK];  /* the scores of up to 8 heads at a time */
    const int widen = dtype && !fmt, pairs = fmt == FMT_BF16_PAIRS;  /* widen: narrow rows, no ld8 */
    float kw[widen ? CHUNK * head_dim : 1], vw[widen ? CHUNK * head_dim : 1];
    float qp[pairs ? nq * nrows * head_dim : 1];  /* the queries in pairs order */
    int64_t offs[CHUNK];
    const float *kr[CHUNK], *vr[CHUNK];
    const int stride = head_dim + 2;
    const int64_t row = (int64_t)kv_heads * head_dim;
    const int nh = head_dim <= 64 ? 2 : 1, min_keys = chunk_min_keys(head_dim);
    const int fine = dtype == 0, vcalls = (group + nh - 1) / nh * (fine ? (head_dim + 63) / 64 : 1);
    int64_t k1 = k0;  /* the longest row's end: the chunks walk to it */
    for (int r = 0; r < nrows; r++) k1 = k1s[r] > k1 ? k1s[r] : k1;
    PfCursor pc;
    pf_init(&pc, kb, vb, table, block_stride, block_size, row, 0, k0, k1, (int)row, group * nrows,
            kv_esize(dtype));
    pf_upto(&pc, k0);
    for (int r = 0; r < nrows; r++)
        for (int h = 0; h < kv_heads; h++)
            begin_partials(m + r * nq + h * group, l + r * nq + h * group,
                           part + r * rstride + h * hstride, group, head_dim);
    if (pairs) {
        for (int r = 0; r < nrows; r++)
            for (int i = 0; i < nq; i++)
                to_pairs(q + r * qstride + i * head_dim, qp + (r * nq + i) * head_dim, head_dim);
        q = qp;
        qstride = (int64_t)nq * head_dim;
    }
    for (int64_t a = k0; a < k1;) {
        int n = chunk_rows(table, block_stride, block_size, row, a, k1, min_keys, offs);
        const int n8 = (n + 7) & ~7;
        Pf pf = {&pc, a, n, 0, nrows * kv_heads * (group + vcalls) * (fine ? n8 / 8 : 1), fine};
        for (int h = 0; h < kv_heads; h++) {  /* the chunk's rows, one kv head after another */
            chunk_pointers(kb, vb, offs, (int64_t)h * head_dim, n, head_dim, dtype, fmt, kw, vw,
                           kr, vr);
            for (int t = n; t < n8; t++) kr[t] = kr[0];  /* lanes past n: computed, then masked */
            for (int r = 0; r < nrows; r++) {
                /* Row r's keys of this chunk: a prefix (its end k1s[r] may fall inside), exactly
                 * the chunk it reads alone (the walk is the same up to its end), so its
                 * arithmetic is its own whatever rows share the call. */
                const int nr = k1s[r] - a < n ? (int)(k1s[r] - a) : n, nr8 = (nr + 7) & ~7;
                if (nr <= 0) continue;
                const float *qh = q + r * qstride + (int64_t)h * group * head_dim;
                float *ph = part + r * rstride + h * hstride;
                float *mh = m + r * nq + h * group, *lh = l + r * nq + h * group;
                for (int g0 = 0; g0 < group; g0 += 8) {  /* heads in batches of 8 (sbuf rows) */
                    int gb = group - g0 < 8 ? group - g0 : 8;
                    for (int g = 0; g < gb; g++) {
                        pf_step(&pf, 0);
                        float *s = sbuf + g * CHUNK;
                        float mb = chunk_scores(qh + (g0 + g) * head_dim, kr, nr, nr8, head_dim,
                                                scale, fmt, s, &pf);
                        chunk_softmax(mb, mh + g0 + g, lh + g0 + g, ph + (g0 + g) * stride, s, nr,
                                      nr8, head_dim, dtype);
                    }
                    for (int g = 0; g < gb; g += nh) {
                        pf_step(&pf, 0);
                        chunk_values(vr, sbuf + g * CHUNK, nr, ph + (g0 + g) * stride, stride,
                                     head_dim, gb - g < nh ? 1 : nh, fmt, &pf);
                    }
                }
            }
        }
        a += n;
    }
    for (int r = 0; r < nrows; r++)
        for (int h = 0; h < kv_heads; h++) {
            float *ph = part + r * rstride + h * hstride;
            for (int g = 0; pairs && g < group; g++) from_pairs(ph + g * stride, head_dim);
            end_partials(m + r * nq + h * group, l + r * nq + h * group, ph, group, head_dim);
        }
}

/* Copies of split_attend_chunked with head_dim a constant, so its loops unroll fully, and the
 * row format (ld8's) a constant, so the loads carry no branch. Widened per chunk (format 0):
 * fp16 rows without F16C, and 8-bit rows: their convert (4-5 ops per 8 values) would repeat
 * for every query head of the group; once per chunk, in process at 64K (tiny model, 4 rows per
 * kv head): e4m3 2.67 -> 2.23 ms a step, e5m2 2.35 -> 2.10 (bf16 in pairs: 1.98-2.01). */
#ifdef __F16C__
#define F16_FMT FMT_F16
#else
#define F16_FMT FMT_F32
#endif
#define CHUNKED(D)                                                                            \
    static void split_attend_chunked_##D(const float *q, const void *kb, const void *vb,      \
                                         int64_t bstride, int bsize, int kvh, int group,       \
                                         const int32_t *table, int64_t k0, int nrows,          \
                                         const int64_t *k1s, int64_t qs, int64_t rs,           \
                                         float scale, int dtype, float *part, int64_t hs) {    \
        switch (dtype) {                                                                       \
        case 0: split_attend_chunked(q, kb, vb, bstride, bsize, kvh, D, group, table, k0,      \
                                     nrows, k1s, qs, rs, scale, 0, FMT_F32, part, hs); return; \
        case 3: split_attend_chunked(q, kb, vb, bstride, bsize, kvh, D, group, table, k0,      \
                                     nrows, k1s, qs, rs, scale, 3, F16_FMT, part, hs); return; \
        case 4: case 5:                                                                        \
            split_attend_chunked(q, kb, vb, bstride, bsize, kvh, D, group, table, k0, nrows,   \
                                 k1s, qs, rs, scale, dtype, FMT_F32, part, hs); return;        \
        default: split_attend_chunked(q, kb, vb, bstride, bsize, kvh, D, group, table, k0,     \
                                      nrows, k1s, qs, rs, scale, dtype, FMT_BF16_PAIRS, part,  \
                                      hs);                                                     \
        }                                                                                      \
    }
CHUNKED(32) CHUNKED(64) CHUNKED(128)

/* One split of nrows rows of one sequence (consecutive positions, one block table): row r's
 * queries at q + r * qs, its keys [k0, k1s[r]), its partials at part + r * rs. Each K/V row is
 * read once for all of them; nrows 1 is a plain decode row. */
static void split_attend_avx2_any(const float *q, const void *kb, const void *vb, int64_t bstride,
                                  int bsize, int kvh, int head_dim, int group,
                                  const int32_t *table, int64_t k0, int nrows, const int64_t *k1s,
                                  int64_t qs, int64_t rs, float scale, int dtype, float *part,
                                  int64_t hs) {
    switch (head_dim) {
    case 32: split_attend_chunked_32(q, kb, vb, bstride, bsize, kvh, group, table, k0, nrows, k1s, qs, rs, scale, dtype, part, hs); return;
    case 64: split_attend_chunked_64(q, kb, vb, bstride, bsize, kvh, group, table, k0, nrows, k1s, qs, rs, scale, dtype, part, hs); return;
    case 128: split_attend_chunked_128(q, kb, vb, bstride, bsize, kvh, group, table, k0, nrows, k1s, qs, rs, scale, dtype, part, hs); return;
    default: split_attend_chunked(q, kb, vb, bstride, bsize, kvh, head_dim, group, table, k0, nrows, k1s, qs, rs, scale, dtype, 0, part, hs);
    }
}
