/* Decode attention that reads the paged KV cache in place (no gather, no mask).
 *
 * One query token per sequence. The cache of one layer is addressed as
 *   K(b, t, h, :) = k_base + b * block_stride + (t * kv_heads + h) * head_dim
 * (V likewise from v_base): block b's tokens are contiguous [block_size, kv_heads, head_dim],
 * and consecutive blocks are block_stride elements apart (the packed page size).
 *
 * Work is split over (sequence, split of the context): each split walks its blocks through
 * the sequence's block table with a flash-style online softmax, chunk by chunk, each chunk's
 * rows serving every kv head in turn and each kv head's rows all the query heads of its group
 * at once (GQA: each K/V row is read once), and leaves a partial (max, sum, acc) per
 * (kv head, query head). A merge pass combines the splits of a (sequence, query head), with
 * the attention sink (gpt-oss) joining the denominator there. Consecutive rows of one sequence
 * at consecutive positions (a verified request's 1 + drafts rows) share each split's pass over
 * the keys on the AVX2 path (run_task), every row keeping the bits it has alone.
 *
 * Keys read for a sequence of length L: positions max(0, L - window) .. L - 1 (window 0 = all);
 * nothing else is read. Cache dtypes: 0 = float32, 1 = bfloat16 under a bf16 model (V weighted
 * by probabilities rounded to bf16, as torch's bf16 kernels do), 2 = bfloat16 under an fp32
 * model (--kv-cache-dtype bfloat16: rows widened, the math all fp32), 3 = float16 rows, 4 =
 * float8_e4m3fn rows, 5 = float8_e5m2 rows (fp32 math); q, out, sinks float32.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fp8.h"
#include "half_float.h"

#define MAX_GROUP 64
#define MAX_HEAD_DIM 256

/* Bytes of one cached value of a dtype code. */
static inline int kv_esize(int dtype) { return dtype == 0 ? 4 : dtype <= 3 ? 2 : 1; }

/* Row of head_dim values as float32 (narrower rows widened into buf). */
static inline const float *row_f32(const void *base, int64_t off, int dtype, int d, float *buf) {
    if (dtype == 0) return (const float *)base + off;
    const uint16_t *src = (const uint16_t *)base + off;
    const uint8_t *b8 = (const uint8_t *)base + off;
    if (dtype == 3) {
        for (int j = 0; j < d; j++) buf[j] = f16_to_f32(src[j]);
    } else if (dtype == 4) {
        for (int j = 0; j < d; j++) buf[j] = e4m3_to_f32(b8[j]);
    } else if (dtype == 5) {
        for (int j = 0; j < d; j++) buf[j] = e5m2_to_f32(b8[j]);
    } else {
#pragma omp simd
        for (int j = 0; j < d; j++) buf[j] = bf16_to_f32(src[j]);
    }
    return buf;
}

/* Round to the nearest bfloat16 (ties to even), kept as float: bf16 caches weight V by
 * probabilities rounded to bf16, as torch's flash kernels do, so outputs round alike. */
static inline float round_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&x, &u, sizeof x);
    return x;
}

static inline float dot(const float *a, const float *b, int d) {
    float s = 0.f;
#pragma omp simd reduction(+:s)
    for (int j = 0; j < d; j++) s += a[j] * b[j];
    return s;
}

/* A split's partials: per query head, acc[head_dim] then its max and sum. begin_partials
 * empties them (max -inf, sum 0), end_partials stores the max and sum after acc. */
static inline void begin_partials(float *m, float *l, float *part, int group, int head_dim) {
    for (int g = 0; g < group; g++) {
        m[g] = -INFINITY;
        l[g] = 0.f;
        memset(part + g * (head_dim + 2), 0, sizeof(float) * head_dim);
    }
}

static inline void end_partials(const float *m, const float *l, float *part, int group,
                                int head_dim) {
    for (int g = 0; g < group; g++) {
        part[g * (head_dim + 2) + head_dim] = m[g];
        part[g * (head_dim + 2) + head_dim + 1] = l[g];
    }
}

/* exp(x) for x <= 0 in a form the compiler vectorizes (libm's expf is scalar without
 * -ffast-math): x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-6 Taylor polynomial
 * (relative error ~1.2e-7, as fp32 rounding), times 2^n built in the exponent bits. */
static inline float exp_neg(float x) {
    x = x < -87.f ? -87.f : x;
    float t = x * 1.44269504f;
    float n = __builtin_floorf(t + 0.5f);
    float r = x - n * 0.693147181f;
    float p = 1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720))))));
    int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, sizeof scale);
    return p * scale;
}

/* One split, portable: keys [k0, k1) of one sequence for one kv head, one key at a time.
 * Writes group partials of (head_dim + 2) floats each: acc[head_dim], max, sum. */
static void split_attend_head(const float *q, const void *k_base, const void *v_base,
                              int64_t block_stride, int block_size, int kv_heads, int head_dim,
                              int group, const int32_t *table, int64_t k0, int64_t k1, int h,
                              float scale, int dtype, float *part) {
    float m[MAX_GROUP], l[MAX_GROUP], kbuf[MAX_HEAD_DIM], vbuf[MAX_HEAD_DIM];
    const int64_t row = (int64_t)kv_heads * head_dim;
    begin_partials(m, l, part, group, head_dim);
    for (int64_t a = k0; a < k1; a++) {
        int64_t off = table[a / block_size] * block_stride + (a % block_size) * row
                      + (int64_t)h * head_dim;
        const float *k = row_f32(k_base, off, dtype, head_dim, kbuf);
        const float *v = row_f32(v_base, off, dtype, head_dim, vbuf);
        for (int g = 0; g < group; g++) {
            float s = dot(q + g * head_dim, k, head_dim) * scale, *acc = part + g * (head_dim + 2);
            if (s > m[g]) {  /* rescale what came before to the new max */
                float alpha = m[g] == -INFINITY ? 0.f : exp_neg(m[g] - s);
                l[g] *= alpha;
#pragma omp simd
                for (int j = 0; j < head_dim; j++) acc[j] *= alpha;
                m[g] = s;
            }
            float p = exp_neg(s - m[g]);
            l[g] += p;
            p = dtype == 1 ? round_bf16(p) : p;
#pragma omp simd
            for (int j = 0; j < head_dim; j++) acc[j] += p * v[j];
        }
    }
    end_partials(m, l, part, group, head_dim);
}

/* The same split for every kv head (kv head h's partials at part + h * hstride). */
static void split_attend(const float *q, const void *k_base, const void *v_base,
                         int64_t block_stride, int block_size, int kv_heads, int head_dim,
                         int group, const int32_t *table, int64_t k0, int64_t k1, float scale,
                         int dtype, float *part, int64_t hstride) {
    for (int h = 0; h < kv_heads; h++)
        split_attend_head(q + (int64_t)h * group * head_dim, k_base, v_base, block_stride,
                          block_size, kv_heads, head_dim, group, table, k0, k1, h, scale, dtype,
                          part + h * hstride);
}

/* Whether this step's keys stream from DRAM (1) or stay in the last-level cache between steps
 * (0): set per step by the caller (attention/cpu_backend.py), it decides where a split's
 * software prefetches put the rows ahead of its reads (see PfCursor). Speed only, never results. */
static int keys_from_dram = 0;

void paged_decode_set_prefetch(int from_dram) { keys_from_dram = from_dram; }

#if defined(__AVX2__) && defined(__FMA__)
#include "paged_attention_rows.h"
#include "paged_attention_avx2.h"
#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include "paged_attention_avx512.h"
#define PATH_MAX_ISA 2
#else
#define PATH_MAX_ISA 1
#endif
#else
#define PATH_MAX_ISA 0
#endif

/* The widest path decodes may take: 2 AVX-512, 1 AVX2, 0 portable (tests lower it to check
 * every path on one host). */
static int isa_cap = 2;

void paged_decode_set_isa(int cap) { isa_cap = cap; }

/* The path a split of this shape takes on this build: 2, 1 or 0 as above. AVX-512 only for
 * groups of more than 4 query rows per kv head (GQA groups, or a short chunk's tokens x group):
 * there the arithmetic per key read sets the speed, and it ran 1.3-1.5x the AVX2 path (128K keys,
 * head_dim 32, groups 8 / 16 / 32, Intel Xeon VM with AMX, 2 threads); at 4 and below the read
 * does, and it ran 4-8% slower (2 layers x 128K keys from L3; the 512-bit units' warm-up). */
int paged_decode_path(int head_dim, int group) {
    int path = PATH_MAX_ISA < isa_cap ? PATH_MAX_ISA : isa_cap;
    if (path == 2 && (head_dim % 16 || group <= 4)) path = 1;
    if (path == 1 && head_dim % 8) path = 0;
    return path;
}

/* One decode call's arguments, shared by its tasks. */
typedef struct {
    const float *q;
    const void *k_base, *v_base;
    int64_t block_stride;
    int block_size, kv_heads, head_dim, heads, group, window, max_splits, split_tokens, dtype;
    const int32_t *const *tables;
    const int32_t *seq_lens;
    const float *sinks;
    float scale;
    float *out, *scratch;
} Decode;

static inline int64_t first_key(const Decode *d, int64_t len) {
    return (d->window > 0 && len > d->window) ? len - d->window : 0;
}

/* Keys per split of one row: split_tokens at least, and at most ROW_SPLITS splits. A function
 * of the row's own key count only, never of the batch or the threads, so a row's rounding is
 * the same in every batch (batch invariance: a verified draft row, or a request beside other
 * traffic, gives the logits it gives alone). attention/cpu_backend.py computes the same. */
#define ROW_SPLITS 16
static inline int64_t row_split(const Decode *d, int64_t len) {
    int64_t span = len - first_key(d, len);
    int64_t per = (span + ROW_SPLITS - 1) / ROW_SPLITS;
    return per > d->split_tokens ? per : d->split_tokens;
}

/* Rows a task may share: a verified request's 1 + drafts rows (speculative decoding). */
#define MAX_RUN 16

/* Whether such rows share a task (1) or run one task each (0: tests and benchmarks compare
 * the two; results are the same bits either way). */
static int share_runs = 1;

void paged_decode_set_runs(int on) { share_runs = on; }

/* Whether row i continues row i - 1's run: the same sequence one position on (the same
 * blocks, one more key) with the same split of its context, so the two rows' splits and
 * chunks start at the same keys (row_split, chunk_rows) and a task can read each K/V row once
 * for both. Only the length and the split decide the arithmetic, so results do not change. */
static int continues_run(const Decode *d, int i) {
    int64_t len = d->seq_lens[i], prev = d->seq_lens[i - 1];
    if (len != prev + 1 || first_key(d, len) != first_key(d, prev)
        || row_split(d, len) != row_split(d, prev))
        return 0;
    if (d->tables[i] == d->tables[i - 1]) return 1;
    int64_t blocks = (len + d->block_size - 1) / d->block_size;
    return memcmp(d->tables[i], d->tables[i - 1], sizeof(int32_t) * (size_t)blocks) == 0;
}

/* Task t = (run of rows, split) over every kv head; a split past a row's end does nothing for
 * it. A run is a single row, or consecutive rows of one sequence at consecutive positions (a
 * verified request's draft rows), which the AVX2 path serves in one pass over the keys: each
 * K/V row is read once for all of them (each row's arithmetic is what it is alone). Why every
 * kv head in one task: a block's rows are [token, kv head, head_dim], so one kv
 * head's rows lie kv_heads x head_dim apart; a task per kv head read 1 / kv_heads of each row
 * and skipped the rest (each row its own stream for the prefetchers). Covering every kv head,
 * a task reads its rows front to back. Partials stay per (seq, kv head, split). */
static void run_task(const Decode *d, const int32_t *runs, int64_t t) {
    int sp = (int)(t % d->max_splits);
    int64_t run = t / d->max_splits;
    int i0 = runs[run], nrows = runs[run + 1] - i0;
    const int64_t pstride = (int64_t)d->group * (d->head_dim + 2);
    const int64_t hstride = d->max_splits * pstride;  /* between one kv head's partials and the next's */
    const int64_t rstride = d->kv_heads * hstride;    /* between one row's partials and the next's */
    const int64_t qstride = (int64_t)d->heads * d->head_dim;
    const int path = paged_decode_path(d->head_dim, d->group);
    (void)path;
#if PATH_MAX_ISA >= 1
    if (path == 1) {
        int64_t len0 = d->seq_lens[i0], split = row_split(d, len0), k1s[MAX_RUN];
        int64_t k0 = first_key(d, len0) + (int64_t)sp * split;
        if (k0 >= d->seq_lens[i0 + nrows - 1]) return;
        for (int r = 0; r < nrows; r++) {
            int64_t e = k0 + split, len = d->seq_lens[i0 + r];
            k1s[r] = e < len ? e : len;  /* <= k0: the row has no keys in this split */
        }
        split_attend_avx2_any(d->q + i0 * qstride, d->k_base, d->v_base, d->block_stride,
                              d->block_size, d->kv_heads, d->head_dim, d->group, d->tables[i0], k0,
                              nrows, k1s, qstride, rstride, d->scale, d->dtype,
                              d->scratch + i0 * rstride + sp * pstride, hstride);
        return;
    }
#endif
    for (int i = i0; i < i0 + nrows; i++) {  /* the other paths: row by row */
        int64_t len = d->seq_lens[i];
        const int64_t split = row_split(d, len);
        int64_t k0 = first_key(d, len) + (int64_t)sp * split;
        if (k0 >= len) continue;
        int64_t k1 = k0 + split < len ? k0 + split : len;
        const float *qi = d->q + i * qstride;
        float *part = d->scratch + i * rstride + sp * pstride;
#if PATH_MAX_ISA == 2
        if (path == 2) {
            split_attend_avx512(qi, d->k_base, d->v_base, d->block_stride, d->block_size,
                                d->kv_heads, d->head_dim, d->group, d->tables[i], k0, k1, d->scale,
                                d->dtype, part, hstride);
            continue;
        }
#endif
        split_attend(qi, d->k_base, d->v_base, d->block_stride, d->block_size, d->kv_heads,
                     d->head_dim, d->group, d->tables[i], k0, k1, d->scale, d->dtype, part,
                     hstride);
    }
}

/* Row r = (seq, query head): combine its splits, the sink joining the denominator. */
static void merge_row(const Decode *d, int64_t r) {
    const int hd = d->head_dim, pstride = d->group * (hd + 2);
    int i = (int)(r / d->heads), hq = (int)(r % d->heads);
    int h = hq / d->group, g = hq % d->group;
    int64_t len = d->seq_lens[i];
    const int64_t split = row_split(d, len);
    int nsplit = (int)((len - first_key(d, len) + split - 1) / split);
    const float *first = d->scratch + ((int64_t)(i * d->kv_heads + h) * d->max_splits) * pstride
                         + g * (hd + 2);
    float mx = d->sinks ? d->sinks[hq] : -INFINITY;
    for (int sp = 0; sp < nsplit; sp++) {
        float ms = first[(int64_t)sp * pstride + hd];
        if (ms > mx) mx = ms;
    }
    float denom = d->sinks ? expf(d->sinks[hq] - mx) : 0.f;
    float *o = d->out + r * hd;
    memset(o, 0, sizeof(float) * hd);
    for (int sp = 0; sp < nsplit; sp++) {
        const float *p = first + (int64_t)sp * pstride;
        float w = expf(p[hd] - mx);
        denom += p[hd + 1] * w;
#pragma omp simd
        for (int j = 0; j < hd; j++) o[j] += p[j] * w;
    }
    float inv = 1.f / denom;
#pragma omp simd
    for (int j = 0; j < hd; j++) o[j] *= inv;
}

/* Returns 0, or -1 when a size exceeds the kernel's fixed limits (the caller falls back).
 * nthreads 1 runs without an OpenMP region (a team costs microseconds: a short decode's
 * whole work); otherwise one region, tasks then merges, for one fork and join per call. */
int paged_decode(const float *q, const void *k_base, const void *v_base, int64_t block_stride,
                 int block_size, int kv_heads, int head_dim, int heads, int num_seqs,
                 const int32_t *const *tables, const int32_t *seq_lens, int window,
                 const float *sinks, float scale, float *out, float *scratch, int max_splits,
                 int split_tokens, int dtype, int nthreads) {
    const int group = heads / kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || group * kv_heads != heads || dtype < 0
        || dtype > 5)
        return -1;
    const Decode d = {q, k_base, v_base, block_stride, block_size, kv_heads, head_dim, heads,
                      group, window, max_splits, split_tokens, dtype, tables, seq_lens, sinks,
                      scale, out, scratch};
    int32_t small[65], *runs = num_seqs < 64 ? small : malloc(sizeof(int32_t) * (size_t)(num_seqs + 1));
    if (!runs) return -1;
    /* bf16 rows keep a run's queries in pairs order on the task's stack: at most 64 KB of them */
    int max_run = dtype == 1 || dtype == 2 ? 16384 / (heads * head_dim) : MAX_RUN, nruns = 0;
    max_run = max_run < 1 ? 1 : max_run > MAX_RUN ? MAX_RUN : max_run;
    for (int i = 0; i < num_seqs; i++)
        if (i == 0 || !share_runs || i - runs[nruns - 1] >= max_run || !continues_run(&d, i))
            runs[nruns++] = i;
    runs[nruns] = num_seqs;
    const int64_t tasks = (int64_t)nruns * max_splits;
    const int64_t rows = (int64_t)num_seqs * heads;
    if (nthreads <= 1) {
        for (int64_t t = 0; t < tasks; t++) run_task(&d, runs, t);
        for (int64_t r = 0; r < rows; r++) merge_row(&d, r);
    } else {
#pragma omp parallel num_threads(nthreads)
        {
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < tasks; t++) run_task(&d, runs, t);
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++) merge_row(&d, r);
        }
    }
    if (runs != small) free(runs);
    return 0;
}
