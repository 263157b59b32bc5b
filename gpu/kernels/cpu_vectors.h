/* What the CPU kernels (the _cpu.c sources of gpu/kernels) share: vectors of the CPU's own width through
   GCC/Clang vector extensions, loads and stores that never assume alignment, bf16 <-> fp32, horizontal sums, and
   e^x. gpu/cpu_kernels.py builds each kernel with this header beside it (and keys its cache on the header too). */
#ifndef LORALEDGER_CPU_VECTORS_H
#define LORALEDGER_CPU_VECTORS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* VL lanes: 16 where the CPU has 512-bit vectors, else 8 (one AVX2 register, two NEON ones): 16-lane vectors on a
   256-bit CPU are split in pairs that the compiler spills to the stack, several times slower than torch */
#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
typedef float vf __attribute__((vector_size(4 * VL)));
typedef int32_t vi __attribute__((vector_size(4 * VL)));
typedef uint16_t vh __attribute__((vector_size(2 * VL)));
typedef uint32_t vu __attribute__((vector_size(4 * VL)));

static inline vf ld_f32(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void st_f32(float *p, vf v) { memcpy(p, &v, sizeof v); }
#if VL == 16
#include <immintrin.h>
/* one vpmovzxwd and a shift: GCC lowers the generic conversion below to two half-width ones joined by inserts */
static inline vf widen(vh h) {
    __m256i x; memcpy(&x, &h, sizeof x);
    const __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16);
    vf f; memcpy(&f, &u, sizeof f); return f;
}
#else
static inline vf widen(vh h) { vu u = __builtin_convertvector(h, vu) << 16; vf f; memcpy(&f, &u, sizeof f); return f; }
#endif
static inline vf ld_bf16(const uint16_t *p) { vh h; memcpy(&h, p, sizeof h); return widen(h); }
/* fp32 -> bf16, round to nearest even; a NaN stays a (quiet) NaN */
static inline vh narrow(vf f) {
    vu u; memcpy(&u, &f, sizeof u);
    vu r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u);
    return __builtin_convertvector((nan & ((u >> 16) | 0x40u)) | (~nan & r), vh);
}
static inline void st_bf16(uint16_t *p, vf v) { vh h = narrow(v); memcpy(p, &h, sizeof h); }
static inline float bf16_f(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
/* one element as fp32 / stored from fp32, for the scalar tails of kernels written once for both element types */
static inline float ld1_f32(const float *p) { return *p; }
static inline void st1_f32(float *p, float v) { *p = v; }
static inline float ld1_bf16(const uint16_t *p) { return bf16_f(*p); }
static inline void st1_bf16(uint16_t *p, float v) { *p = f_bf16(v); }
/* x in every lane: a splat, one vbroadcastss (`(vf){0} + x` is an add, which turns -0 into +0, and a loop over
   the lanes compiles to a chain of inserts) */
#if VL == 16
#define SPLAT(x) {x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}
#else
#define SPLAT(x) {x, x, x, x, x, x, x, x}
#endif
static inline vf broadcast(float x) { return (vf)SPLAT(x); }
static inline float hsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}
static inline float hmax(vf v) {
    float m = v[0];
    for (int i = 1; i < VL; i++) m = v[i] > m ? v[i] : m;
    return m;
}

/* e^x, VL lanes: Cody-Waite range reduction to r in [-ln2/2, ln2/2], a degree-6 polynomial (Cephes' expf
   coefficients; relative error ~1e-7), scaled by 2^n through the exponent bits, in two halves so that 2^n may reach
   2^128. Below -87.3 (where the result would be subnormal) and at -inf it is 0; above 88.72 (past FLT_MAX) and at
   +inf it is +inf; a NaN stays a NaN. */
static inline vf vexp(vf x) {
    const vi nan = x != x, tiny = x < -87.3f, huge = x > 88.72f;
    const vi clamp = tiny | huge | nan;
    x = (vf)(((vi)x & ~clamp) | ((vi)broadcast(0.0f) & clamp));
    const vf t = x * 1.44269504088896341f; /* n = round(x / ln2): truncate t -/+ 0.5 toward zero */
    const vf half = (vf)((vi)broadcast(0.5f) | ((vi)t & ((vi){0} + INT32_MIN))); /* 0.5 with t's sign */
    const vi n = __builtin_convertvector(t + half, vi);
    const vf nf = __builtin_convertvector(n, vf);
    const vf r = (x - nf * 0.693359375f) + nf * 2.12194440e-4f;
    vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const vi n1 = n >> 1, lo_bits = (n1 + 127) << 23, hi_bits = (n - n1 + 127) << 23;
    vf lo, hi; memcpy(&lo, &lo_bits, sizeof lo); memcpy(&hi, &hi_bits, sizeof hi);
    const vf y = p * lo * hi;
    const vi out = ((vi)y & ~clamp) | (huge & (vi)broadcast(INFINITY)) | (nan & (vi)broadcast(NAN));
    return (vf)out;
}

/* sums_of's shuffle tree needs __builtin_shufflevector (GCC 12+, Clang; HAVE_SUMS_OF); without it sums_of gives the
   same sums one lane at a time, and -DLORALEDGER_NO_SUMS_OF builds that fallback anywhere
   (tests/gpu/test_cpu_kernel_fallbacks.py) */
#if !defined(LORALEDGER_NO_SUMS_OF) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12))
#define HAVE_SUMS_OF 1
/* sums_of(c): lane r = the sum of c[r]'s lanes, for VL vectors at once: a tree of shuffles and adds (log2 VL levels,
   2 * (VL - 1) shuffles in all) instead of one chain of VL - 1 dependent scalar adds per vector, which took most
   of a decode step's attention. Each level adds neighbouring groups of lanes of two vectors and interleaves the
   results, so that after the last one lane r holds all of c[r]. */
#if VL == 16
#define LV1(a, b) (__builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +          \
                   __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31))
#define LV2(a, b) (__builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +          \
                   __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31))
#define LV3(a, b) (__builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +          \
                   __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31))
#define LV4(a, b) (__builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +             \
                   __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))
static inline vf sums_of(const vf *c) {
    vf a[8], b[4], e[2];
    for (int i = 0; i < 8; i++) a[i] = LV1(c[2 * i], c[2 * i + 1]);
    for (int i = 0; i < 4; i++) b[i] = LV2(a[2 * i], a[2 * i + 1]);
    for (int i = 0; i < 2; i++) e[i] = LV3(b[2 * i], b[2 * i + 1]);
    return LV4(e[0], e[1]);
}
#else
#define LV1(a, b) (__builtin_shufflevector(a, b, 0, 8, 2, 10, 4, 12, 6, 14) +                                        \
                   __builtin_shufflevector(a, b, 1, 9, 3, 11, 5, 13, 7, 15))
#define LV2(a, b) (__builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13) +                                         \
                   __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15))
#define LV3(a, b) (__builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +                                         \
                   __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15))
static inline vf sums_of(const vf *c) {
    vf a[4], b[2];
    for (int i = 0; i < 4; i++) a[i] = LV1(c[2 * i], c[2 * i + 1]);
    for (int i = 0; i < 2; i++) b[i] = LV2(a[2 * i], a[2 * i + 1]);
    return LV3(b[0], b[1]);
}
#endif

#else
/* compilers without __builtin_shufflevector: lane r = the sum of c[r]'s lanes, one chain of adds per vector */
static inline vf sums_of(const vf *c) {
    vf s;
    for (int i = 0; i < VL; i++) s[i] = hsum(c[i]);
    return s;
}
#endif /* HAVE_SUMS_OF */

#endif
