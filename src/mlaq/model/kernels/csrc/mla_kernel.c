/* MLA's attention on a CPU, in C: one pass over each row's keys (decode over the latent cache, and
 * causal prefill over decompressed keys).
 *
 * Built and loaded by mlaq/model/mla_kernel.py (read that first). For each batch row b and each folded
 * query row r (= head h * T + token i), over the row's K keys (each D wide) and values (each DV wide;
 * decode: the keys' first DV = L columns):
 *
 *     s[r,k] = dot(q[r], key[k]) * scale        (float32; -inf where the mask hides key k, or, causal,
 *                                                where k > K - T + i: token i sees keys up to its own)
 *     o[r]   = sum_k exp(s[r,k] - m) * value[k]  /  sum_k exp(s[r,k] - m),   m = max_k s[r,k]
 *
 * with FlashAttention's online softmax over blocks of BLOCK keys (a block that raises the running
 * maximum rescales what was summed so far), probabilities kept in float32. The arithmetic is exactly
 * the float32 operations written below, in the order written: built with -ffp-contract=off and without
 * -ffast-math, the compiler vectorizes but never reorders a sum or fuses a multiply-add it was not
 * told to, so the result is the same bits on every x86-64 CPU, at every vector width and thread count
 * (one thread computes a batch row, or a fixed piece of its keys: see attend()). Specifically:
 * - a dot product is LANES interleaved chains of fused multiply-adds (lane l takes elements l, l+LANES,
 *   ...), then the lanes summed pairwise (fold8());
 * - exp is exp_f32() (Cephes' expf, ~1 ulp);
 * - a value sum runs over keys in order, one fused multiply-add per key and column (blocks no query
 *   row of a group sees are skipped: adding their zero probabilities would change no bit);
 * - a decode batch of fewer than SPLIT_BELOW rows attends each row's keys in pieces, merged in order
 *   (merge()); the pieces depend on the batch size and K only;
 * - bf16 operands are widened exactly; a bf16 output is rounded to nearest even once, at the end. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "mla_vec.h"

#define BLOCK 64 /* keys per online-softmax block */
#define ROWS 4   /* query rows computed together (the batch row's rows are padded to a multiple) */
#define CHUNK 64 /* query rows that go over all the keys before the next rows do (a multiple of ROWS) */
#define SEGMENT 256    /* batches below SPLIT_BELOW rows attend each row's keys in pieces of ~this many, */
#define SPLIT_BELOW 4  /* merged in order: the pieces run in parallel (a batch of 1 has one row to give) */

/* s[r][u] = dot(q[r], key u) for ROWS query rows (float32, stride d) and two keys: 2 x ROWS independent
 * chains (the FMA latency hidden), each key chunk loaded and widened once. */
static inline __attribute__((always_inline)) void dots(const float *q, const void *k0, const void *k1,
                                                       int bf16, int64_t d, float s[ROWS][2]) {
    vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
    for (int64_t i = 0; i < d; i += LANES) {
        vec x = load_key(k0, i, bf16), y = load_key(k1, i, bf16);
        vec q0 = load(q + i), q1 = load(q + d + i), q2 = load(q + 2 * d + i), q3 = load(q + 3 * d + i);
        a0 = vfma(q0, x, a0), b0 = vfma(q0, y, b0), a1 = vfma(q1, x, a1), b1 = vfma(q1, y, b1);
        a2 = vfma(q2, x, a2), b2 = vfma(q2, y, b2), a3 = vfma(q3, x, a3), b3 = vfma(q3, y, b3);
    }
    const vec all[8] = {a0, a1, a2, a3, b0, b1, b2, b3};
    half8 sums = fold8(all);
    for (int r = 0; r < ROWS; r++) s[r][0] = sums[r], s[r][1] = sums[ROWS + r];
}

/* o[r][:dv] += sum over the block's keys j, in order, of p[r][j] * value j, for ROWS rows (stride dv)
 * whose probabilities are p[r * BLOCK + j]: LANES columns of all rows in registers across the block. */
static inline __attribute__((always_inline)) void accumulate(float *o, const float *p, const char *values,
                                                             int64_t row_bytes, int bf16, int64_t nk,
                                                             int64_t dv) {
    for (int64_t c = 0; c < dv; c += LANES) {
        vec a0 = load(o + c), a1 = load(o + dv + c), a2 = load(o + 2 * dv + c), a3 = load(o + 3 * dv + c);
        for (int64_t j = 0; j < nk; j++) {
            vec v = load_key(values + j * row_bytes, c, bf16);
            a0 = vfma(splat(p[j]), v, a0), a1 = vfma(splat(p[BLOCK + j]), v, a1);
            a2 = vfma(splat(p[2 * BLOCK + j]), v, a2), a3 = vfma(splat(p[3 * BLOCK + j]), v, a3);
        }
        store(o + c, a0), store(o + dv + c, a1), store(o + 2 * dv + c, a2), store(o + 3 * dv + c, a3);
    }
}

/* One block of nk keys for ROWS query rows: p[r][j] = exp(s[r][j] - new maximum) (0 where masked), each
 * row's running maximum and sum updated, o[r] rescaled by exp(old maximum - new maximum). `visible`:
 * the mask rows (t of them, mask_stride apart, offset to the block) or NULL; row r uses mask row r % t;
 * `causal`: row r sees keys up to nk_total - t + r % t. `next`: the next block's first key (prefetched
 * into L2 while this one computes) or NULL. */
static inline __attribute__((always_inline)) void block_softmax(
    const float *q, const char *keys, int64_t row_bytes, int bf16, const uint8_t *visible, int64_t mask_stride,
    int causal, int64_t r0, int64_t t, int64_t first, int64_t nk, int64_t nk_total, int64_t d, int64_t dv, float scale,
    float *o, float *p, float *run_max, float *run_sum, const char *next) {
    float s[ROWS][2];
    for (int64_t j = 0; j < nk; j += 2) {
        if (next)
            for (int64_t b = 0; b < 2 * row_bytes; b += 64) __builtin_prefetch(next + j * row_bytes + b, 0, 2);
        const char *k1 = keys + (j + 1 < nk ? j + 1 : j) * row_bytes; /* an odd last key done twice */
        dots(q, keys + j * row_bytes, k1, bf16, d, s);
        for (int r = 0; r < ROWS; r++)
            for (int64_t u = 0; u < 2 && j + u < nk; u++) p[r * BLOCK + j + u] = s[r][u] * scale;
    }
    for (int r = 0; r < ROWS; r++) {
        float *pr = p + r * BLOCK, block_max = -INFINITY;
        const uint8_t *shown = visible ? visible + ((r0 + r) % t) * mask_stride : NULL;
        int64_t last = causal ? nk_total - t + (r0 + r) % t - first : nk; /* the last key it sees, in block */
        for (int64_t j = 0; j < nk; j++) {
            if ((shown && !shown[j]) || j > last) pr[j] = -INFINITY;
            block_max = pr[j] > block_max ? pr[j] : block_max;
        }
        float m = run_max[r0 + r], new_max = block_max > m ? block_max : m;
        if (new_max == -INFINITY) { /* nothing visible yet: nothing to add */
            for (int64_t j = 0; j < nk; j++) pr[j] = 0.0f;
            continue;
        }
        float alpha = exp_f32(m - new_max); /* 0 on the first visible block, 1 if the maximum stays */
        if (alpha != 1.0f)
            for (int64_t c = 0; c < dv; c++) o[r * dv + c] *= alpha;
        float sum = run_sum[r0 + r] * alpha;
        for (int64_t j = 0; j < nk; j++) pr[j] = exp_f32(pr[j] - new_max);
        for (int64_t j = 0; j < nk; j++) sum += pr[j];
        run_max[r0 + r] = new_max, run_sum[r0 + r] = sum;
    }
}

/* The largest token index (r % t) among rows r0 .. r0 + ROWS - 1. */
static inline int64_t last_token(int64_t r0, int64_t t) {
    int64_t m = 0;
    for (int64_t r = r0; r < r0 + ROWS; r++) m = r % t > m ? r % t : m;
    return m;
}

/* One batch row's queries over nk_total keys: q (rows, d) float32, rows a multiple of ROWS (padding rows
 * zero), keys (nk_total, d) rows of key_bytes each, values rows of value_bytes each, mask rows (t of them,
 * mask_stride apart) or NULL -> o (rows, dv) float32 unnormalized, each row's maximum and sum. nk_there:
 * keys in memory from the first on (the next segment's are prefetched too). */
static inline __attribute__((always_inline)) void attend_row(
    const float *q, const char *keys, int64_t key_bytes, const char *values, int64_t value_bytes, int bf16,
    const uint8_t *mask, int64_t mask_stride, int causal, int64_t rows, int64_t t, int64_t nk_total,
    int64_t nk_there, int64_t d, int64_t dv, float scale, float *o, float *p, float *run_max, float *run_sum) {
    for (int64_t r = 0; r < rows; r++) run_max[r] = -INFINITY, run_sum[r] = 0.0f;
    memset(o, 0, (size_t)(rows * dv) * sizeof(float));
    for (int64_t c0 = 0; c0 < rows; c0 += CHUNK) { /* CHUNK rows' q and o stay in L2 over all the keys */
        int64_t c1 = c0 + CHUNK < rows ? c0 + CHUNK : rows;
        for (int64_t first = 0; first < nk_total; first += BLOCK) {
            int64_t nk = nk_total - first < BLOCK ? nk_total - first : BLOCK;
            const char *block = keys + first * key_bytes;
            const char *next = first + BLOCK < nk_there ? block + BLOCK * key_bytes : NULL; /* also past it */
            const uint8_t *visible = mask ? mask + first : NULL;
            for (int64_t r0 = c0; r0 < c1; r0 += ROWS) {
                if (causal && first > nk_total - t + last_token(r0, t)) continue; /* no row of it sees it */
                block_softmax(q + r0 * d, block, key_bytes, bf16, visible, mask_stride, causal, r0, t, first, nk,
                              nk_total, d, dv, scale, o + r0 * dv, p, run_max, run_sum, r0 == c0 ? next : NULL);
                accumulate(o + r0 * dv, p, values + first * value_bytes, value_bytes, bf16, nk, dv);
            }
        }
    }
}

/* Batch row b's result o (rows, dv) float32 into out (B, rows, dv), bf16 (rounded) or float32. */
static void write_row(void *out, int64_t b, int64_t rows, int64_t dv, const float *o, int bf16) {
    if (bf16)
        for (int64_t i = 0; i < rows * dv; i++) ((uint16_t *)out)[b * rows * dv + i] = f32_to_bf16(o[i]);
    else
        memcpy((float *)out + b * rows * dv, o, (size_t)(rows * dv) * sizeof(float));
}

/* Segments of one batch row merged in order: o = sum_s o_s exp(m_s - m) / sum_s l_s exp(m_s - m), m the
 * largest m_s (each segment's o_s unnormalized, m_s its maximum, l_s its sum; rows x (dv + 2) floats each). */
static void merge(const float *parts, int64_t segs, int64_t rows, int64_t dv, float *o) {
    for (int64_t r = 0; r < rows; r++) {
        float m = -INFINITY, sum = 0.0f;
        for (int64_t s = 0; s < segs; s++) {
            float ms = parts[s * rows * (dv + 2) + rows * dv + r];
            m = ms > m ? ms : m;
        }
        for (int64_t c = 0; c < dv; c++) o[r * dv + c] = 0.0f;
        for (int64_t s = 0; s < segs; s++) {
            const float *part = parts + s * rows * (dv + 2);
            float w = exp_f32(part[rows * dv + r] - m); /* 0 for a segment the row saw nothing of */
            sum += part[rows * dv + rows + r] * w;
            for (int64_t c = 0; c < dv; c++) o[r * dv + c] += part[r * dv + c] * w;
        }
        for (int64_t c = 0; c < dv; c++) o[r * dv + c] = o[r * dv + c] / sum; /* all masked: 0 / 0 = NaN */
    }
}

/* q (B, heads*t, d); keys of batch row b at keys + b * key_stride elements ((nk, d) rows, contiguous);
 * its values at values + b * value_stride ((nk, dv) rows, value_row elements apart); mask (B, t, nk) or
 * NULL; out (B, heads*t, dv); all bf16 or all float32. Returns 0, or -1 when a scratch buffer could not
 * be allocated. A decode batch of fewer than SPLIT_BELOW rows splits each row's keys into an even number
 * of equal segments of about SEGMENT keys (set by the batch size and K alone, never by the thread count:
 * the bits do not depend on it), computed in parallel and merged in order. Batch rows x segments run in
 * parallel (OpenMP) when there is work enough. A causal prefill has rows enough: one segment. */
static inline __attribute__((always_inline)) int attend(const void *q, const void *keys, int64_t key_stride,
                                                        const void *values, int64_t value_stride,
                                                        int64_t value_row, const uint8_t *mask, int causal,
                                                        int64_t batch, int64_t heads, int64_t t, int64_t nk,
                                                        int64_t d, int64_t dv, float scale, void *out,
                                                        int bf16) {
    int64_t rows = heads * t, padded = (rows + ROWS - 1) / ROWS * ROWS;
    int64_t size = bf16 ? 2 : 4, segs = 1, seg_len = nk;
    if (!causal && batch < SPLIT_BELOW && nk > SEGMENT) { /* an even number of equal pieces of ~SEGMENT keys */
        segs = 2 * ((nk + 2 * SEGMENT - 1) / (2 * SEGMENT));
        seg_len = (nk + segs - 1) / segs;
    }
    int64_t part = padded * (dv + 2); /* one segment's o, maxima and sums */
    float *parts = segs > 1 ? malloc((size_t)(batch * segs * part) * sizeof(float)) : NULL;
    int failed = segs > 1 && !parts;
#pragma omp parallel for schedule(static) if (batch * segs > 1 && batch * rows * nk * d > (1 << 18))
    for (int64_t item = 0; item < (failed ? 0 : batch * segs); item++) {
        int64_t b = item / segs, first = item % segs * seg_len;
        int64_t nk_seg = nk - first < seg_len ? nk - first : seg_len;
        float *qf = calloc((size_t)(padded * d + padded * dv + ROWS * BLOCK + 2 * padded), sizeof(float));
        if (!qf) {
            failed = 1;
            continue;
        }
        float *o = qf + padded * d, *p = o + padded * dv, *run_max = p + ROWS * BLOCK;
        float *run_sum = run_max + padded;
        for (int64_t i = 0; i < rows * d; i++)
            qf[i] = bf16 ? bf16_to_f32(((const uint16_t *)q)[b * rows * d + i]) : ((const float *)q)[b * rows * d + i];
        const char *row_keys = (const char *)keys + (b * key_stride + first * d) * size;
        const char *row_values = (const char *)values + (b * value_stride + first * value_row) * size;
        const uint8_t *row_mask = mask ? mask + b * t * nk + first : NULL;
        attend_row(qf, row_keys, d * size, row_values, value_row * size, bf16, row_mask, nk, causal, padded, t,
                   nk_seg, nk - first, d, dv, scale, o, p, run_max, run_sum);
        if (segs > 1) { /* kept for the merge */
            memcpy(parts + item * part, o, (size_t)(padded * dv) * sizeof(float));
            memcpy(parts + item * part + padded * dv, run_max, (size_t)padded * sizeof(float));
            memcpy(parts + item * part + padded * dv + padded, run_sum, (size_t)padded * sizeof(float));
        } else {
            for (int64_t i = 0; i < rows * dv; i++) o[i] = o[i] / run_sum[i / dv]; /* all masked: NaN */
            write_row(out, b, rows, dv, o, bf16);
        }
        free(qf);
    }
    if (segs > 1 && !failed) {
#pragma omp parallel for schedule(static) if (batch > 1)
        for (int64_t b = 0; b < batch; b++) {
            float *o = malloc((size_t)(padded * dv) * sizeof(float));
            if (!o) {
                failed = 1;
                continue;
            }
            merge(parts + b * segs * part, segs, padded, dv, o);
            write_row(out, b, rows, dv, o, bf16);
            free(o);
        }
    }
    free(parts);
    return failed ? -1 : 0;
}

int mla_attend_bf16(const uint16_t *q, const uint16_t *keys, int64_t key_stride, const uint16_t *values,
                    int64_t value_stride, int64_t value_row, const uint8_t *mask, int causal, int64_t batch,
                    int64_t heads, int64_t t, int64_t nk, int64_t d, int64_t dv, float scale, uint16_t *out) {
    return attend(q, keys, key_stride, values, value_stride, value_row, mask, causal, batch, heads, t, nk, d, dv,
                  scale, out, 1);
}

int mla_attend_f32(const float *q, const float *keys, int64_t key_stride, const float *values,
                   int64_t value_stride, int64_t value_row, const uint8_t *mask, int causal, int64_t batch,
                   int64_t heads, int64_t t, int64_t nk, int64_t d, int64_t dv, float scale, float *out) {
    return attend(q, keys, key_stride, values, value_stride, value_row, mask, causal, batch, heads, t, nk, d, dv,
                  scale, out, 0);
}
