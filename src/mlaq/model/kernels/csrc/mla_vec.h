/* Vectors of LANES float32 for mla_kernel.c: GCC vector types (one zmm with AVX-512, two ymm with AVX2,
 * four xmm with SSE), bf16 <-> float32, IEEE fused multiply-add, pairwise lane sums and exp. Every
 * function is plain IEEE float32 arithmetic in the order written (the file is built with
 * -ffp-contract=off), so any vector width gives the same bits. */
#ifndef MLAQ_MLA_VEC_H
#define MLAQ_MLA_VEC_H

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16 /* lanes of a vector; D and DV must be multiples (checked in Python) */

/* LANES floats as one value, kept in vector registers (one zmm with AVX-512, two ymm with AVX2). */
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef uint16_t vec_u16 __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint32_t vec_u32 __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef float half8 __attribute__((vector_size(8 * sizeof(float))));

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* LANES elements of a key row from `base` (bf16 or float32) as float32: bf16 widened in registers. */
static inline __attribute__((always_inline)) vec load_key(const void *base, int64_t i, int bf16) {
    if (bf16) {
        vec_u16 h;
        memcpy(&h, (const uint16_t *)base + i, sizeof h);
        vec_u32 w = __builtin_convertvector(h, vec_u32) << 16;
        return (vec)w;
    }
    vec v;
    memcpy(&v, (const float *)base + i, sizeof v);
    return v;
}

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, vec v) { memcpy(p, &v, sizeof v); }

static inline vec splat(float x) { return (vec){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

/* IEEE's fused multiply-add a * b + c, lane by lane: one rounding (the hardware instruction where the
 * build has one; fmaf() gives the same bits elsewhere). */
static inline vec vfma(vec a, vec b, vec c) {
#if defined(__AVX512F__)
    return (vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
    vec r;
    for (int l = 0; l < LANES; l++) r[l] = fmaf(a[l], b[l], c[l]);
    return r;
#endif
}

/* The lanes' sums of eight vectors at once, each pairwise: lane l + 8 onto lane l, then l + 4, l + 2,
 * l + 1 (each level pairs two vectors' halves into one vector: the same additions as folding each
 * vector alone, an eighth of the instructions). -> {sum(v[0]), ..., sum(v[7])}. */
static inline half8 fold8(const vec v[8]) {
    vec x[4], z[2];
    for (int i = 0; i < 4; i++) /* lanes 0-7: v[2i]'s l + (l + 8); lanes 8-15: v[2i+1]'s */
        x[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++) /* four lanes each of v[4i .. 4i+3]: l + (l + 4) */
        z[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    vec u = /* two lanes each of v[0 .. 7]: l + (l + 2) */
        __builtin_shufflevector(z[0], z[1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
        __builtin_shufflevector(z[0], z[1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(u, u, 0, 2, 4, 6, 8, 10, 12, 14) + /* l + (l + 1) */
           __builtin_shufflevector(u, u, 1, 3, 5, 7, 9, 11, 13, 15);
}

/* exp(x) for x <= 0 (scores minus their running maximum): Cephes' expf. x = n ln2 + r, |r| <= ln2/2,
 * exp(r) by its polynomial, times 2^n built in the exponent bits; 0 at and below -87.3 (also -inf); a NaN
 * (a NaN in the keys or queries) stays NaN, so it reaches the output as in torch's kernels. */
static inline float exp_f32(float x) {
    const float big = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer (nearest even) */
    if (x != x) return x;
    if (!(x > -87.3f)) return 0.0f;
    float n = (x * 1.44269504088896341f + big) - big;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r;
    p = p + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

#endif /* MLAQ_MLA_VEC_H */
