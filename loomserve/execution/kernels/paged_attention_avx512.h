/* The AVX-512 decode path of paged_attention.c (included after the AVX2 header, whose chunking
 * it shares: chunk_rows, PfCursor, widen_row, CHUNK), for head_dim % 16 == 0.
 *
 * Every query head of a kv head's group rides in one vector. The group goes in batches of up
 * to 16 heads, each batch padded to gp = a power of two; a vector's 16 lanes are gp heads x
 * w = 16 / gp lanes, lane (g, j) = g * w + j.
 * - Scores: for each key, lane (g, j) accumulates q[g, i w + j] k[i w + j] over i (the key's w
 *   values broadcast to every head by one load), so 16 keys take 16 x head_dim / w FMAs; a
 *   transpose-add tree then folds each head's w partials: 16 keys -> 16 / w vectors whose lane
 *   (g, k) is head g's score of key b w + k (scale folded into the packed q).
 * - Online softmax on every head of the batch at once (max, rescale, exp, sum: 16 lanes wide).
 * - V: per key, each head's probability broadcast from memory into NH x NV accumulators.
 * Why: the AVX2 path scores one head at a time and folds 8 dot products per 8 keys with hadds;
 * here the fold is shared by the batch and the arithmetic is 16 lanes wide (twice the FMA
 * throughput where the core has two 512-bit FMA units, half the instructions where not).
 * Results equal the AVX2 path's to fp32 rounding (sums in a different order).
 */

/* exp_neg8 on sixteen lanes. */
static inline __m512 exp_neg16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147181f), x);
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* round_bf16 on sixteen lanes. */
static inline __m512 round_bf16x16(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd);
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
}

/* A key's w values at p in every head's lanes (one broadcast load). */
static inline __attribute__((always_inline)) __m512 bcast_w(const float *p, int w) {
    switch (w) {
    case 16: return _mm512_loadu_ps(p);
    case 8: return _mm512_broadcast_f32x8(_mm256_loadu_ps(p));
    case 4: return _mm512_broadcast_f32x4(_mm_loadu_ps(p));
    case 2: { double d; memcpy(&d, p, sizeof d); return _mm512_castpd_ps(_mm512_set1_pd(d)); }
    default: return _mm512_set1_ps(*p);
    }
}

/* One batch's constants: the packed, scaled queries (head_dim / w vectors), the fold's
 * permutations per stage, the xor permutations of the in-group max, lane -> j. */
typedef struct {
    __m512 *q;  /* nq vectors, in the caller's buffer */
    __m512i lo[4], hi[4], xr[4], lane_j;
    __m512 m, l;  /* running max (same in a head's w lanes) and per-lane sums */
    int w, nq, heads;
} Batch;

/* Vectors of packed queries a batch of `heads` (<= 16) query heads needs. */
static inline int batch_nq(int heads, int head_dim) {
    int gp = 1;
    while (gp < heads) gp *= 2;
    return head_dim / (16 / gp);
}

static void batch_init(Batch *b, __m512 *qbuf, const float *q, int heads, int head_dim,
                       float scale) {
    int gp = 1;
    while (gp < heads) gp *= 2;
    const int w = 16 / gp;
    b->q = qbuf, b->w = w, b->nq = head_dim / w, b->heads = heads;
    for (int i = 0; i < b->nq; i++) {
        float lanes[16];
        for (int L = 0; L < 16; L++)
            lanes[L] = L / w < heads ? q[(L / w) * head_dim + i * w + L % w] * scale : 0.f;
        b->q[i] = _mm512_loadu_ps(lanes);
    }
    int32_t lo[16], hi[16], xr[16], lj[16];
    int s = 0;
    for (int K = 1; K < w; K *= 2, s++) {  /* [K keys][P partials] -> [2K][P / 2] per head */
        const int P = w / K;
        for (int L = 0; L < 16; L++) {
            int g = L / w, k2 = (L % w) / (P / 2), p2 = (L % w) % (P / 2);
            lo[L] = g * w + (k2 % K) * P + p2 + (k2 >= K ? 16 : 0);
            hi[L] = lo[L] + P / 2;
            xr[L] = L ^ K;
        }
        b->lo[s] = _mm512_loadu_si512(lo), b->hi[s] = _mm512_loadu_si512(hi);
        b->xr[s] = _mm512_loadu_si512(xr);
    }
    for (int L = 0; L < 16; L++) lj[L] = L % w;
    b->lane_j = _mm512_loadu_si512(lj);
    b->m = _mm512_set1_ps(-INFINITY);
    b->l = _mm512_setzero_ps();
}

/* Scores of 16 keys (rows kr[0..16)) for the batch: 16 / w vectors into s. */
static inline __attribute__((always_inline)) void scores16(const Batch *b, const float *const *kr,
                                                          int w, __m512 *s) {
    __m512 acc[16];
    for (int t = 0; t < 16; t++) acc[t] = _mm512_setzero_ps();
    for (int i = 0; i < b->nq; i++) {
        const __m512 qv = b->q[i];
        for (int t = 0; t < 16; t++) acc[t] = _mm512_fmadd_ps(qv, bcast_w(kr[t] + i * w, w), acc[t]);
    }
    int cnt = 16;
    for (int st = 0; (1 << st) < w; st++, cnt /= 2)
        for (int p = 0; p < cnt / 2; p++)
            acc[p] = _mm512_add_ps(_mm512_permutex2var_ps(acc[2 * p], b->lo[st], acc[2 * p + 1]),
                                   _mm512_permutex2var_ps(acc[2 * p], b->hi[st], acc[2 * p + 1]));
    for (int v = 0; v < cnt; v++) s[v] = acc[v];
}

/* o[g] = acc[g] * alpha[g] + sum_t p(g, t) V[t] for heads g0 .. g0 + NH, NV vectors of V from
 * jb; p(g, t) at p[(t / w) * 16 + g * w + t % w]. */
#define ZVACC(NH, NV)                                                                         \
    static inline __attribute__((always_inline)) void zvacc_##NH##_##NV(                      \
            const float *const *vr, const float *p, int n, int w, int g0, float *acc,          \
            int astride, int jb, const float *alpha) {                                        \
        __m512 o[NH][NV];                                                                      \
        for (int g = 0; g < NH; g++) {                                                         \
            __m512 a = _mm512_set1_ps(alpha[((g0 + g) * w) & 15]);  /* < 16: heads x w <= 16 */ \
            for (int v = 0; v < NV; v++)                                                       \
                o[g][v] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * astride + jb + 16 * v), a);  \
        }                                                                                      \
        for (int t = 0; t < n; t++) {                                                          \
            __m512 x[NV];                                                                      \
            for (int v = 0; v < NV; v++) x[v] = _mm512_loadu_ps(vr[t] + jb + 16 * v);          \
            const float *pt = p + (t / w) * 16 + t % w + g0 * w;                               \
            for (int g = 0; g < NH; g++) {                                                     \
                __m512 bc = _mm512_set1_ps(pt[g * w]);                                         \
                for (int v = 0; v < NV; v++) o[g][v] = _mm512_fmadd_ps(bc, x[v], o[g][v]);     \
            }                                                                                  \
        }                                                                                      \
        for (int g = 0; g < NH; g++)                                                           \
            for (int v = 0; v < NV; v++) _mm512_storeu_ps(acc + g * astride + jb + 16 * v, o[g][v]); \
    }
ZVACC(1, 1) ZVACC(1, 2) ZVACC(1, 4) ZVACC(2, 1) ZVACC(2, 2) ZVACC(2, 4)
ZVACC(3, 1) ZVACC(3, 2) ZVACC(3, 4) ZVACC(4, 1) ZVACC(4, 2) ZVACC(4, 4)

#define ZV_CASE(NH)                                                                           \
    case NH:                                                                                   \
        if (nv == 4) zvacc_##NH##_4(vr, p, n, w, g, a, astride, jb, alpha);                   \
        else if (nv == 2) zvacc_##NH##_2(vr, p, n, w, g, a, astride, jb, alpha);              \
        else zvacc_##NH##_1(vr, p, n, w, g, a, astride, jb, alpha);                           \
        break;

/* Every head of the batch: acc rescaled by alpha, plus the chunk's probabilities times V. */
static inline __attribute__((always_inline)) void zvalues(
        const float *const *vr, const float *p, int n, int w, int heads, int head_dim,
        float *acc, int astride, const float *alpha) {
    const int nvec = head_dim / 16;
    for (int g = 0; g < heads; g += 4) {
        float *a = acc + g * astride;
        const int nh = heads - g < 4 ? heads - g : 4;
        for (int v0 = 0; v0 < nvec;) {  /* 4, 2 or 1 vectors of V at a time */
            const int nv = nvec - v0 >= 4 ? 4 : nvec - v0 >= 2 ? 2 : 1, jb = 16 * v0;
            switch (nh) { ZV_CASE(1) ZV_CASE(2) ZV_CASE(3) ZV_CASE(4) }
            v0 += nv;
        }
    }
}

/* One chunk of n keys for one batch: scores, the online-softmax step, V. kr holds n rows
 * padded to a multiple of 16 (the padding's lanes are masked). The prefetch cursor moves up to
 * key pf_mid before V. */
static inline __attribute__((always_inline)) void zchunk(
        Batch *b, const float *const *kr, const float *const *vr, int n, int w, int dtype,
        float *acc, int astride, int head_dim, PfCursor *pc, int64_t pf_mid) {
    __m512 s[CHUNK];
    const int per = 16 / w, nvec = (n + 15) / 16 * per, tail = n % 16 ? nvec - per : nvec;
    for (int v = 0; v < nvec; v += per) scores16(b, kr + v * w, w, s + v);
    __mmask16 live[16];
    for (int v = tail; v < nvec; v++) {  /* lanes of keys >= n: -inf, later probability 0 */
        __m512i key = _mm512_add_epi32(_mm512_set1_epi32(v * w), b->lane_j);
        live[v - tail] = _mm512_cmp_epi32_mask(key, _mm512_set1_epi32(n), _MM_CMPINT_LT);
        s[v] = _mm512_mask_blend_ps(live[v - tail], _mm512_set1_ps(-INFINITY), s[v]);
    }
    __m512 mx = s[0];
    for (int v = 1; v < nvec; v++) mx = _mm512_max_ps(mx, s[v]);
    for (int st = 0; (1 << st) < w; st++) mx = _mm512_max_ps(mx, _mm512_permutexvar_ps(b->xr[st], mx));
    const __m512 m = _mm512_max_ps(b->m, mx);
    const __m512 alpha = exp_neg16(_mm512_sub_ps(b->m, m));  /* ~0 on the first chunk: acc, l are 0 */
    __m512 l = _mm512_mul_ps(b->l, alpha);
    for (int v = 0; v < nvec; v++) {
        __m512 pv = exp_neg16(_mm512_sub_ps(s[v], m));
        if (v >= tail) pv = _mm512_maskz_mov_ps(live[v - tail], pv);
        l = _mm512_add_ps(l, pv);
        s[v] = dtype == 1 ? round_bf16x16(pv) : pv;  /* bf16 model: V weighted as torch's bf16 kernels do */
    }
    b->m = m, b->l = l;
    float al[16];
    _mm512_storeu_ps(al, alpha);
    pf_upto(pc, pf_mid);
    zvalues(vr, (const float *)s, n, w, b->heads, head_dim, acc, astride, al);
}

#define ZCHUNK_CASE(W)                                                                        \
    case W:                                                                                    \
        zchunk(b, kr, vr, n, W, dtype, acc, stride, head_dim, &pc,                             \
               a + (int64_t)n * (2 * slot + 2) / (2 * slots));                                 \
        break;

/* Packed-query bytes one pass over a split may hold (the kv heads of a task go in passes of as
 * many as fit: a stack buffer, not one per head). */
#define QBUF_BYTES 65536

/* A pass's batches: kv heads [h0, h0 + nkv), nb batches each (packed queries into qbuf), their
 * accumulators zeroed. */
static void pass_begin(Batch *batches, __m512 *qbuf, const float *q, float *part, int64_t hstride,
                       int h0, int nkv, int nb, int group, int head_dim, float scale) {
    for (int hh = 0; hh < nkv; hh++) {
        const float *qh = q + (int64_t)(h0 + hh) * group * head_dim;
        float *ph = part + (h0 + hh) * hstride;
        for (int i = 0; i < nb; i++) {
            const int heads = group - 16 * i < 16 ? group - 16 * i : 16;
            batch_init(&batches[hh * nb + i], qbuf, qh + 16 * i * head_dim, heads, head_dim, scale);
            qbuf += batches[hh * nb + i].nq;
        }
        for (int g = 0; g < group; g++) memset(ph + g * (head_dim + 2), 0, sizeof(float) * head_dim);
    }
}

/* Each head's max and sum after its accumulator, as split_attend_chunked leaves them. */
static void pass_end(const Batch *batches, float *part, int64_t hstride, int h0, int nkv, int nb,
                     int head_dim) {
    const int stride = head_dim + 2;
    for (int hh = 0; hh < nkv; hh++)
        for (int i = 0; i < nb; i++) {
            const Batch *b = &batches[hh * nb + i];
            float m[16], l[16], *ph = part + (h0 + hh) * hstride;
            _mm512_storeu_ps(m, b->m);
            _mm512_storeu_ps(l, b->l);
            for (int g = 0; g < b->heads; g++) {
                float sum = 0.f;
                for (int j = 0; j < b->w; j++) sum += l[g * b->w + j];
                ph[(16 * i + g) * stride + head_dim] = m[g * b->w];
                ph[(16 * i + g) * stride + head_dim + 1] = sum;
            }
        }
}

/* One split (keys [k0, k1) of every kv head) on the AVX-512 path; partials as
 * split_attend_chunked's (kv head h's at part + h * hstride). The kv heads go in passes of
 * as many as QBUF_BYTES of packed queries allow; within a pass, each chunk of rows serves every
 * head of the pass before the next chunk, so the pass reads its rows front to back. */
static void split_attend_avx512(const float *q, const void *kb, const void *vb,
                                int64_t block_stride, int block_size, int kv_heads, int head_dim,
                                int group, const int32_t *table, int64_t k0, int64_t k1,
                                float scale, int dtype, float *part, int64_t hstride) {
    const int nb = (group + 15) / 16, stride = head_dim + 2;
    int nq_head = 0;  /* packed-query vectors of one kv head's batches */
    for (int i = 0; i < nb; i++) nq_head += batch_nq(group - 16 * i < 16 ? group - 16 * i : 16, head_dim);
    int per_pass = QBUF_BYTES / (nq_head * 64);
    per_pass = per_pass < 1 ? 1 : per_pass > kv_heads ? kv_heads : per_pass;
    __m512 qbuf[per_pass * nq_head];
    Batch batches[per_pass * nb];
    float kw[dtype ? CHUNK * head_dim : 1], vw[dtype ? CHUNK * head_dim : 1];  /* narrow rows only */
    int64_t offs[CHUNK];
    const float *kr[CHUNK + 16], *vr[CHUNK];
    const int64_t row = (int64_t)kv_heads * head_dim;
    const int min_keys = chunk_min_keys(head_dim);
    for (int h0 = 0; h0 < kv_heads; h0 += per_pass) {
        const int nkv = kv_heads - h0 < per_pass ? kv_heads - h0 : per_pass;
        const int slots = nkv * nb;  /* batches per chunk, each with two prefetch slots */
        pass_begin(batches, qbuf, q, part, hstride, h0, nkv, nb, group, head_dim, scale);
        PfCursor pc;  /* two slots per batch: before its scores and before its V */
        pf_init(&pc, kb, vb, table, block_stride, block_size, row, (int64_t)h0 * head_dim, k0, k1,
                nkv * head_dim, group, kv_esize(dtype));
        pf_upto(&pc, k0);
        for (int64_t a = k0; a < k1;) {
            int n = chunk_rows(table, block_stride, block_size, row, a, k1, min_keys, offs);
            int slot = 0;
            for (int hh = 0; hh < nkv; hh++) {
                chunk_pointers(kb, vb, offs, (int64_t)(h0 + hh) * head_dim, n, head_dim, dtype,
                               0, kw, vw, kr, vr);
                for (int t = n; t < (n + 15) / 16 * 16; t++) kr[t] = kr[0];
                for (int i = 0; i < nb; i++, slot++) {
                    pf_upto(&pc, a + (int64_t)n * (2 * slot + 1) / (2 * slots));
                    Batch *b = &batches[hh * nb + i];
                    float *acc = part + (h0 + hh) * hstride + 16 * i * stride;
                    switch (b->w) { ZCHUNK_CASE(1) ZCHUNK_CASE(2) ZCHUNK_CASE(4) ZCHUNK_CASE(8) ZCHUNK_CASE(16) }
                }
            }
            a += n;
        }
        pass_end(batches, part, hstride, h0, nkv, nb, head_dim);
    }
}
