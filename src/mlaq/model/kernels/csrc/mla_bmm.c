/* MLA's two absorbed BMMs in the `bf16` scheme's exact arithmetic (mlaq.bmm.base.Bf16Reference), in C.
 *
 * Built with mla_kernel.c into one library by mlaq/model/mla_kernel.py (read that first). Per head n and
 * query row r (batch row b, token i), with bf16 operands widened exactly:
 *
 *     y[r, m] = bf16( f32( sum_k x[r, k] * w[n, k, m] ) )      the sum in float64, k = 0, 1, ..., K-1
 *
 * Products of two bf16 values have at most 16 significant bits, so each is exact in float64 (a fused
 * multiply-add gives the same bits as a multiply then an add); the float64 sum of K <= 4096 of them is
 * exact but for terms more than ~2^25 below the largest, far beneath an fp32 rounding step. The result is
 * rounded once to fp32, then to bf16, as the scheme's `torch.bmm(x.double(), w.double()).float()` then
 * `.to(bfloat16)`: the same bits but when the float64 sum lies within 2^-53 relative of an fp32 rounding
 * boundary (tests compare with the scheme). Weights are read as the scheme stores them, (N, K, M) bf16: 4x
 * fewer bytes than the float64 copy the torch emulation multiplies.
 *
 *     mla_absorb_bf16: BMM #1 and the fold of the heads into the query axis (mla_flash.flash_queries):
 *         q (B, T, N, P+R) -> out (B, N*T, L+R), out[b, n*T+i] = [q_nope W_UK[n] | q_pe]
 *     mla_up_bf16: BMM #2 on the attention's output (mla_flash.flash_output):
 *         o (B, N*T, L) -> out (B, T, N, V), out[b, i, n] = o[b, n*T+i] W_UV^T[n]
 *
 * Work items (head, group of up to GROUP query rows) run in parallel; each row's sum is one thread's, in
 * the order above, whatever the thread count. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "mla_vec.h"

#define GROUP 4 /* query rows that share one pass over a head's weight */
#define COLS 32 /* output columns per register block: 4 vectors of 8 doubles */

typedef double vd __attribute__((vector_size(8 * sizeof(double))));
typedef uint16_t u16x8 __attribute__((vector_size(8 * sizeof(uint16_t))));
typedef uint32_t u32x8 __attribute__((vector_size(8 * sizeof(uint32_t))));

static inline vd splat_d(double x) { return (vd){x, x, x, x, x, x, x, x}; }

#if defined(__AVX512F__)
/* 16 bf16 values widened exactly to two vectors of 8 doubles (bf16 = the top half of a float32). */
static inline void widen16(const uint16_t *w, vd *lo, vd *hi) {
    __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)w)), 16);
    __m512d halves = _mm512_castsi512_pd(u);
    *lo = (vd)_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_castpd512_pd256(halves)));
    *hi = (vd)_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(halves, 1)));
}

/* a * b + c: the product of two widened bf16 values is exact, so fused or not gives the same bits. */
static inline vd fma_d(vd a, vd b, vd c) { return (vd)_mm512_fmadd_pd((__m512d)a, (__m512d)b, (__m512d)c); }
#else
static inline vd widen8(const uint16_t *w) {
    u16x8 h;
    memcpy(&h, w, sizeof h);
    u32x8 u = __builtin_convertvector(h, u32x8) << 16;
    half8 f;
    memcpy(&f, &u, sizeof f);
    return __builtin_convertvector(f, vd);
}

static inline void widen16(const uint16_t *w, vd *lo, vd *hi) {
    *lo = widen8(w);
    *hi = widen8(w + 8);
}

static inline vd fma_d(vd a, vd b, vd c) { return a * b + c; }
#endif

/* Columns m0 .. m0+COLS-1 of y[g] = rounded sum_k x[g * xs + k] * w[k, m], g < rows, w (K, M) row-major:
 * the sums of rows x COLS outputs held in registers while k runs, each weight element widened once for all
 * rows. `rows` is a constant at each call site (see rows_times_weight), so the loops over it unroll. (The
 * weight packed in (K, COLS) panels read front to back instead was measured no faster at these sizes.) */
static inline __attribute__((always_inline)) void column_block(const uint16_t *x, int64_t xs, int rows,
                                                               const uint16_t *w, int64_t k_dim, int64_t m_dim,
                                                               int64_t m0, uint16_t *y, int64_t ys) {
    vd acc[GROUP][COLS / 8];
    for (int g = 0; g < rows; g++)
        for (int j = 0; j < COLS / 8; j++) acc[g][j] = (vd){0};
    for (int64_t k = 0; k < k_dim; k++) {
        vd wv[COLS / 8];
        for (int j = 0; j < COLS / 8; j += 2) widen16(w + k * m_dim + m0 + 8 * j, &wv[j], &wv[j + 1]);
        for (int g = 0; g < rows; g++) {
            vd xg = splat_d((double)bf16_to_f32(x[g * xs + k]));
            for (int j = 0; j < COLS / 8; j++) acc[g][j] = fma_d(xg, wv[j], acc[g][j]);
        }
    }
    for (int g = 0; g < rows; g++)
        for (int j = 0; j < COLS / 8; j++)
            for (int e = 0; e < 8; e++) y[g * ys + m0 + 8 * j + e] = f32_to_bf16((float)acc[g][j][e]);
}

/* y[g, :M] = rounded sum_k x[g * x_stride + k] * w[k, m] for g < rows (<= GROUP), w one head's (K, M)
 * weight; M a multiple of COLS (checked in Python). */
static void rows_times_weight(const uint16_t *x, int64_t x_stride, int64_t rows, const uint16_t *w, int64_t k_dim,
                              int64_t m_dim, uint16_t *y, int64_t y_stride) {
    for (int64_t m0 = 0; m0 < m_dim; m0 += COLS) {
        switch (rows) { /* a constant row count per branch: the accumulators stay in registers */
        case 1: column_block(x, x_stride, 1, w, k_dim, m_dim, m0, y, y_stride); break;
        case 2: column_block(x, x_stride, 2, w, k_dim, m_dim, m0, y, y_stride); break;
        case 3: column_block(x, x_stride, 3, w, k_dim, m_dim, m0, y, y_stride); break;
        default: column_block(x, x_stride, 4, w, k_dim, m_dim, m0, y, y_stride); break;
        }
    }
}

/* One BMM over query rows r = b*T + i of every head: work item (head n, rows r0 .. r0+GROUP-1), in parallel.
 * A row's input (its first k_dim values) is gathered from `src`, multiplied by head n's weight, and
 * written to `dst`; rows sit in two layouts, flat (B, T, N, .) and folded (B, N*T, .), row b*N*T + n*T + i:
 *   to_latent (BMM #1): src flat (width = P+R: [q_nope | q_pe]) -> dst folded [y | q_pe] (m_dim + R wide);
 *   else (BMM #2): src folded (width >= L) -> dst flat (m_dim wide).
 * Returns 0, or -1 when scratch could not be allocated. */
static int absorbed_bmm(int to_latent, const uint16_t *src, int64_t width, const uint16_t *w, int64_t batch,
                        int64_t t, int64_t heads, int64_t k_dim, int64_t m_dim, uint16_t *dst) {
    int64_t groups = (batch * t + GROUP - 1) / GROUP, rope = width - k_dim;
    int failed = 0;
#pragma omp parallel for schedule(static) if (heads * groups > 1)
    for (int64_t item = 0; item < heads * groups; item++) {
        int64_t n = item / groups, r0 = item % groups * GROUP;
        int64_t rows = batch * t - r0 < GROUP ? batch * t - r0 : GROUP;
        uint16_t *x = malloc((size_t)(GROUP * (k_dim + m_dim)) * sizeof(uint16_t)), *y = x + GROUP * k_dim;
        if (!x) {
            failed = 1;
            continue;
        }
        for (int64_t g = 0; g < rows; g++) {
            int64_t b = (r0 + g) / t, i = (r0 + g) % t, flat = (r0 + g) * heads + n;
            int64_t folded = b * heads * t + n * t + i;
            memcpy(x + g * k_dim, src + (to_latent ? flat : folded) * width, (size_t)k_dim * sizeof(uint16_t));
        }
        rows_times_weight(x, k_dim, rows, w + n * k_dim * m_dim, k_dim, m_dim, y, m_dim);
        for (int64_t g = 0; g < rows; g++) {
            int64_t b = (r0 + g) / t, i = (r0 + g) % t, flat = (r0 + g) * heads + n;
            int64_t folded = b * heads * t + n * t + i;
            if (to_latent) { /* [y | q_pe] */
                uint16_t *row = dst + folded * (m_dim + rope);
                memcpy(row, y + g * m_dim, (size_t)m_dim * sizeof(uint16_t));
                memcpy(row + m_dim, src + flat * width + k_dim, (size_t)rope * sizeof(uint16_t));
            } else {
                memcpy(dst + flat * m_dim, y + g * m_dim, (size_t)m_dim * sizeof(uint16_t));
            }
        }
        free(x);
    }
    return failed ? -1 : 0;
}

/* BMM #1: q (B, T, N, P+R) rows contiguous, w_uk (N, P, L) -> out (B, N*T, L+R) = [q W_UK | q_pe]. */
int mla_absorb_bf16(const uint16_t *q, const uint16_t *w_uk, int64_t batch, int64_t t, int64_t heads, int64_t p,
                    int64_t r, int64_t l, uint16_t *out) {
    return absorbed_bmm(1, q, p + r, w_uk, batch, t, heads, p, l, out);
}

/* BMM #2: o (B, N*T, o_width) whose first L columns are the attention's output, w_uv (N, L, V) ->
 * out (B, T, N, V). */
int mla_up_bf16(const uint16_t *o, int64_t o_width, const uint16_t *w_uv, int64_t batch, int64_t t,
                int64_t heads, int64_t l, int64_t v, uint16_t *out) {
    return absorbed_bmm(0, o, o_width, w_uv, batch, t, heads, l, v, out);
}
