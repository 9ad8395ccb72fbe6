/* Grouped MoE experts: one call runs every routed expert of a MoE layer over its rows.
 *
 * The caller sorts the layer's (token, slot) pairs by expert once: x holds one fp32 row per
 * pair, expert e's rows are [offs[e], offs[e + 1]). Per expert, with its weights W1 and W2
 * [H, I] (fp32, dtype 0, or bf16, dtype 1, widened exactly), act 0 (SwiGLU, W1 [2I, H]: gate
 * rows, then up rows) or act 1 (relu^2, W1 [I, H]):
 *   a = silu(x W1[:I]^T) * (x W1[I:]^T)  or  relu(x W1^T)^2      [rows, I]
 *   y = a W2^T                                                   [rows, H]
 * and each token's output is the sum over its slots of weight * y[pair] (fp32, slot order;
 * a pair with pos -1, routed to another rank's expert, adds nothing).
 *
 * The products reuse dense.c's row kernels (included: each 8-row weight tile streams from
 * memory once and serves all of the expert's rows from L1, 4 rows at a time). OpenMP splits
 * each phase into items (expert, weight-row tile) in expert order, scheduled statically: each
 * thread reads one contiguous run of weight tiles, and only the experts with rows are read at
 * all. Gate and up rows of the same intermediate columns share an item, so the activation runs
 * in it (no pass over a [pairs, 2I] buffer). No allocation: the caller passes a [pairs, I]
 * scratch and y. With nthreads 1 the OpenMP regions run serially.
 */
#include <math.h>

#include "half_float.h"  /* dense.c's own include, named here so it joins the build's key */
#include "dense.c"

#define GATE_TILE 32  /* intermediate columns per item: 2 x 32 weight rows (gate and up) */
#define DOWN_TILE 64  /* output columns per item of the down product */
#define ROW_CHUNK 64  /* input rows per pass over a gate item's weights (buf on the stack) */

/* Intermediate columns [j0, j0 + w) of expert rows xe [M, H] into a (row stride I): gate and
 * up rows of W1 (we) into buf [ROW_CHUNK, 2 * GATE_TILE], then SiLU(gate) * up; or (relu^2)
 * the up rows alone, then relu(up)^2. */
static void up_item(const float *xe, int64_t M, int64_t H, int64_t I, const char *we,
                    int dtype, int act, int64_t j0, float *a, float *buf) {
    const int64_t w = I - j0 < GATE_TILE ? I - j0 : GATE_TILE, rb = H * (dtype ? 2 : 4);
    for (int64_t r = 0; r < M; r += ROW_CHUNK) {
        const int64_t m1 = M - r < ROW_CHUNK ? M - r : ROW_CHUNK;
        rows(xe + r * H, m1, H, we + j0 * rb, dtype, 0, w, buf, 2 * GATE_TILE);
        if (act == 0)
            rows(xe + r * H, m1, H, we + (I + j0) * rb, dtype, 0, w, buf + GATE_TILE,
                 2 * GATE_TILE);
        for (int64_t m = 0; m < m1; m++) {
            const float *g = buf + m * 2 * GATE_TILE, *u = g + GATE_TILE;
            float *o = a + (r + m) * I + j0;
            if (act == 0)
                for (int64_t j = 0; j < w; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
            else
                for (int64_t j = 0; j < w; j++) o[j] = g[j] > 0.f ? g[j] * g[j] : 0.f;
        }
    }
}

/* out[T, H] = per token, sum over its k slots of wts * y[pos] (pos -1: nothing). */
static void combine(const float *y, const int64_t *pos, const float *wts, int64_t T, int64_t k,
                    int64_t H, float *out, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && T > 1)
    for (int64_t t = 0; t < T; t++) {
        float *o = out + t * H;
        memset(o, 0, H * sizeof(float));
        for (int64_t s = 0; s < k; s++) {
            const int64_t p = pos[t * k + s];
            if (p < 0) continue;
            const float w = wts[t * k + s], *yp = y + p * H;
            for (int64_t h = 0; h < H; h++) o[h] += w * yp[h];
        }
    }
}

/* x [P, H] fp32 rows sorted by expert, offs [E + 1]; w1 [E, 2I, H] (act 0) or [E, I, H]
 * (act 1), w2 [E, H, I]; scratch a [P, I] and y [P, H] fp32; pos / wts [T, k] (each slot's row
 * in x, or -1, and its weight); out [T, H] fp32. */
void grouped_experts(const float *x, const int64_t *offs, int64_t E, int64_t H, int64_t I,
                     const void *w1, const void *w2, int dtype, int act, float *a, float *y,
                     const int64_t *pos, const float *wts, int64_t T, int64_t k, float *out,
                     int nthreads) {
    const int64_t bytes = dtype ? 2 : 4;
    const int64_t gt = (I + GATE_TILE - 1) / GATE_TILE, dt = (H + DOWN_TILE - 1) / DOWN_TILE;
    int64_t active[E > 0 ? E : 1], n = 0;  /* experts with rows, ascending */
    for (int64_t e = 0; e < E; e++)
        if (offs[e + 1] > offs[e]) active[n++] = e;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        float buf[ROW_CHUNK * 2 * GATE_TILE];
#pragma omp for schedule(static)
        for (int64_t it = 0; it < n * gt; it++) {  /* items (expert, column tile) */
            const int64_t e = active[it / gt], r0 = offs[e];
            up_item(x + r0 * H, offs[e + 1] - r0, H, I,
                    (const char *)w1 + e * (act == 0 ? 2 : 1) * I * H * bytes, dtype, act,
                    it % gt * GATE_TILE, a + r0 * I, buf);
        }
#pragma omp for schedule(static)
        for (int64_t it = 0; it < n * dt; it++) {
            const int64_t e = active[it / dt], r0 = offs[e], n0 = it % dt * DOWN_TILE;
            const int64_t n1 = n0 + DOWN_TILE < H ? n0 + DOWN_TILE : H;
            rows(a + r0 * I, offs[e + 1] - r0, I, (const char *)w2 + e * H * I * bytes, dtype,
                 n0, n1, y + r0 * H, H);
        }
    }
    combine(y, pos, wts, T, k, H, out, nthreads);
}
