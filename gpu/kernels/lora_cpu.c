/* A step's multi-LoRA delta on the CPU (decode tokens and prefill runs), one call per fused module:
   y[t] += (x[t] A_s^T) B_s^T for each adapter token t of slot s, in one pass over each active slot's A and B rows
   per MT tokens (gather, shrink, expand and add; no intermediate tensors, no zero blocks). Plain C with GCC/Clang
   vector extensions: the compiler lowers the vectors to the CPU it is built on (-march=native: AVX-512, AVX2,
   NEON). Layouts, numerics and how it is built and called: gpu/lora_cpu_kernel.py (its torch twin is
   TorchLoraOps' grouped path). Returns 0. */
#include "cpu_vectors.h"

#define MT 4 /* tokens multiplied together: one pass over a slot's A and B rows serves MT tokens */
/* Software prefetch distances, in elements: the adapter rows come from memory at every step (the base weights
   stream through the caches between two calls), and the expand walks 2 x rank B rows side by side, more streams
   than the hardware prefetchers follow. Measured on an AMD EPYC (AVX512-BF16), caches flushed before each step
   of 32 calls: the vdpbf16ps pass 2.75 ms without, 2.1-2.2 ms with (before the register blocks; the same with or
   without since). The portable pass prefetches with 8 lanes only: the bench model's fp32 decode step, 256 MB
   streamed through the caches before each, on an AVX-512 EPYC built for AVX2 3.7-3.8 ms with and 4.1-4.5 without;
   built for AVX-512, 3.2-4.3 ms with and 2.9-3.8 without (a prefetch per 64-byte load, beside the loads). */
#define PF_A 256
#define PF_B 128
#if VL == 8
#define PREFETCH(p) __builtin_prefetch(p)
#else
#define PREFETCH(p) ((void)0)
#endif

/* Register blocks of the portable pass: the shrink multiplies RB rows of A with the MT tokens at once (MT x RB
   sums), the expand OB vectors of B columns (MT x OB sums). Independent sums hide the FMA's latency and each load
   serves several products: with one row and one vector at a time (4 sums in a chain each) the pass ran at ~3.5
   products per cycle on an AVX2 EPYC. The blocks fill the 16 vector registers of AVX2 (32 with AVX-512). The
   order of each sum is the same as one row / one vector at a time: blocking changes no result. */
#if VL == 16
#define RB 4
#define OB 4
#else
#define RB 3
#define OB 3
#endif

/* Whether a block's MT x NB sums are summed across lanes together, by cpu_vectors.h's sums_of (MT x NB == VL): with
   one chain of VL - 1 scalar adds per sum, the reductions took about as long as the block's products. */
#define SUMS_AT_ONCE(NB) (MT * (NB) == VL)

/* h[t][j..j+NB) = x_t . A_s[j..j+NB) (NB rows of A, rows in_features apart from ar): VL-wide sums, then the
   scalar tail, then rounded to the model dtype */
#define SHRINK_ROWS(NB, LDV, LD1, ROUND1)                                                                            \
    do {                                                                                                             \
        vf c[MT][NB];                                                                                                \
        for (int t = 0; t < MT; t++)                                                                                 \
            for (int b = 0; b < NB; b++) c[t][b] = (vf){0};                                                          \
        for (int64_t k = 0; k < kv; k += VL) {                                                                       \
            vf av[NB];                                                                                               \
            for (int b = 0; b < NB; b++) {                                                                           \
                PREFETCH(ar + b * in_features + k + PF_A);                                                           \
                av[b] = LDV(ar + b * in_features + k);                                                               \
            }                                                                                                        \
            for (int t = 0; t < MT; t++) {                                                                           \
                const vf xv = ld_f32(xf + t * in_features + k);                                                      \
                for (int b = 0; b < NB; b++) c[t][b] += xv * av[b];                                                  \
            }                                                                                                        \
        }                                                                                                            \
        float sums[MT][NB]; /* each c[t][b] summed across its lanes: by one shuffle tree where MT x NB fills VL */   \
        if (SUMS_AT_ONCE(NB)) {                                                                                      \
            vf all = sums_of((const vf *)c);                                                                         \
            memcpy(sums, &all, sizeof sums);                                                                         \
        } else {                                                                                                     \
            for (int t = 0; t < MT; t++)                                                                             \
                for (int b = 0; b < NB; b++) sums[t][b] = hsum(c[t][b]);                                             \
        }                                                                                                            \
        for (int b = 0; b < NB; b++)                                                                                 \
            for (int t = 0; t < MT; t++) {                                                                           \
                float sum = sums[t][b];                                                                              \
                for (int64_t k = kv; k < in_features; k++) sum += xf[t * in_features + k] * LD1(ar + b * in_features + k); \
                h[t * nr + j + b] = ROUND1(sum);                                                                     \
            }                                                                                                        \
    } while (0)

/* y[t][o..o+NB*VL) += sum_r h[t][r] * Bt_s[r][o..o+NB*VL) for the slice's rk rank rows (hs[t]: token t's h of
   the slice), each delta rounded to the model dtype before it is added */
#define EXPAND_VECTORS(T, NB, LDV, ROUNDV, ADDV)                                                                     \
    do {                                                                                                             \
        vf d[MT][NB];                                                                                                \
        for (int t = 0; t < MT; t++)                                                                                 \
            for (int b = 0; b < NB; b++) d[t][b] = (vf){0};                                                          \
        for (int64_t r = 0; r < rk; r++) {                                                                           \
            const T *br = bs + r * out_total + o;                                                                    \
            PREFETCH(br + PF_B);                                                                                     \
            PREFETCH(br + PF_B + NB * VL - 1);                                                                       \
            vf bv[NB];                                                                                               \
            for (int b = 0; b < NB; b++) bv[b] = LDV(br + b * VL);                                                   \
            for (int t = 0; t < MT; t++) {                                                                           \
                const vf hv = broadcast(hs[t][r]);                                                                   \
                for (int b = 0; b < NB; b++) d[t][b] += hv * bv[b];                                                  \
            }                                                                                                        \
        }                                                                                                            \
        for (int t = 0; t < m; t++)                                                                                  \
            for (int b = 0; b < NB; b++) ADDV(y + tok[t] * y_stride + o + b * VL, ROUNDV(d[t][b]));                  \
    } while (0)

/* One pass of the portable kernel over up to MT tokens of one slot, for element type T (float or bf16 bits):
   LDV / LD1 load VL / 1 elements as fp32, ROUNDV / ROUND1 round fp32 to T and back (h and the delta are rounded
   to the model dtype, as the torch twin and PEFT do), ADDV / ADD1 add a delta to VL / 1 elements of y in T.
   scratch: MT * in + MT * n_slices * rank floats of this thread's own. */
#define LORA_PASS(NAME, T, LDV, LD1, ROUND1, ROUNDV, ADDV, ADD1)                                                     \
static void NAME(const T *x, int64_t x_stride, int64_t in_features, const T *as, const T *bs, T *y, int64_t y_stride, \
                 int64_t out_total, int64_t n_slices, const int64_t *slice_offsets, int64_t rank, int64_t rk,        \
                 const int64_t *tok, int64_t m, float *scratch)                                                      \
{                                                                                                                    \
    const int64_t nr = n_slices * rank, kv = in_features & ~(int64_t)(VL - 1);                                       \
    float *xf = scratch, *h = scratch + MT * in_features;                                                            \
    for (int t = 0; t < MT; t++) {                                                                                   \
        const T *xr = x + tok[t] * x_stride;                                                                         \
        float *xd = xf + t * in_features;                                                                            \
        int64_t k = 0;                                                                                               \
        for (; k < kv; k += VL) st_f32(xd + k, LDV(xr + k));                                                         \
        for (; k < in_features; k++) xd[k] = LD1(xr + k);                                                            \
    }                                                                                                                \
    /* shrink: h[t][j] = x_t . A_s[j] over the slot's rank rows of each slice (the rest is zero padding) */          \
    for (int64_t sl = 0; sl < n_slices; sl++) {                                                                      \
        int64_t r = 0;                                                                                               \
        for (; r + RB <= rk; r += RB) {                                                                              \
            const int64_t j = sl * rank + r;                                                                         \
            const T *ar = as + j * in_features;                                                                      \
            SHRINK_ROWS(RB, LDV, LD1, ROUND1);                                                                       \
        }                                                                                                            \
        for (; r < rk; r++) {                                                                                        \
            const int64_t j = sl * rank + r;                                                                         \
            const T *ar = as + j * in_features;                                                                      \
            SHRINK_ROWS(1, LDV, LD1, ROUND1);                                                                        \
        }                                                                                                            \
        for (; r < rank; r++)                                                                                        \
            for (int t = 0; t < MT; t++) h[t * nr + sl * rank + r] = 0.0f;                                           \
    }                                                                                                                \
    /* expand: y[t][o] += sum_r h[t][slice(o) * R + r] * Bt_s[r][o], each slice over its own columns */              \
    for (int64_t sl = 0; sl < n_slices; sl++) {                                                                      \
        const int64_t lo = slice_offsets[sl], hi = slice_offsets[sl + 1];                                            \
        const float *hs[MT];                                                                                         \
        for (int t = 0; t < MT; t++) hs[t] = h + t * nr + sl * rank;                                                 \
        int64_t o = lo;                                                                                              \
        for (; o + OB * VL <= hi; o += OB * VL) EXPAND_VECTORS(T, OB, LDV, ROUNDV, ADDV);                            \
        for (; o + VL <= hi; o += VL) EXPAND_VECTORS(T, 1, LDV, ROUNDV, ADDV);                                       \
        for (; o < hi; o++)                                                                                          \
            for (int t = 0; t < m; t++) {                                                                            \
                float d = 0.0f;                                                                                      \
                for (int64_t r = 0; r < rk; r++) d += hs[t][r] * LD1(bs + r * out_total + o);                        \
                ADD1(y + tok[t] * y_stride + o, ROUND1(d));                                                          \
            }                                                                                                        \
    }                                                                                                                \
}

static inline float keep1(float v) { return v; }
static inline vf keepv(vf v) { return v; }
static inline void addv_f32(float *p, vf d) { st_f32(p, ld_f32(p) + d); }
static inline void add1_f32(float *p, float d) { *p += d; }
LORA_PASS(pass_f32, float, ld_f32, ld1_f32, keep1, keepv, addv_f32, add1_f32)

static inline float round1_bf16(float v) { return bf16_f(f_bf16(v)); }
static inline vf roundv_bf16(vf v) { return widen(narrow(v)); }
/* y = bf16(y + delta): the delta already rounded to bf16, as a bf16 add of two bf16 tensors */
static inline void addv_bf16(uint16_t *p, vf d) { vh o = narrow(ld_bf16(p) + d); memcpy(p, &o, sizeof o); }
static inline void add1_bf16(uint16_t *p, float d) { *p = f_bf16(bf16_f(*p) + d); }

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
/* bf16 on a CPU with AVX512-BF16: vdpbf16ps multiplies pairs of bf16 and adds them to fp32 sums (as oneDNN's bf16
   products do). Register blocks as in the portable pass: the shrink runs four rank rows against the MT tokens at
   once (16 independent sums), the expand two 16-column blocks (8), every array indexed by constants so that the
   sums stay in registers; one sum per token before, a chain that waited on each vdpbf16ps. The bench model's 32
   decode calls of a mixed step: 0.9-1.2 ms with caches warm against 1.5; ~2.0 ms either way with the adapter rows
   coming from DRAM, as they do between two steps (bench/RESULTS.md, "The CPU LoRA kernel: register blocks for
   vdpbf16ps"). A block's 16 shrink sums are summed across lanes by one shuffle tree (sums_of) and rounded to bf16
   together, where the compiler has __builtin_shufflevector (GCC 12+, Clang): h may differ from a per-sum reduction
   by a rounding in the last place. The shrink reads x and A as stored, 32 elements a step (the tail masked); the
   expand multiplies h's bf16 pairs (h is rounded to bf16 first, so it is exact as bf16) by B's rank rows r and r + 1
   interleaved. The instruction treats subnormal inputs as zero: an x, A, h or B element under 2^-126 counts as
   zero. */
/* y[0..16) = bf16(y + bf16(d)) where mask says (as addv_bf16); nothing where it is 0 */
static inline void add_delta_bf16(uint16_t *y, __mmask16 mask, __m512 d) {
    const __m256i yb = _mm256_maskz_loadu_epi16(mask, y);
    vf dv;
    vh yh;
    memcpy(&dv, &d, sizeof dv);
    memcpy(&yh, &yb, sizeof yh);
    const vh out = narrow(widen(yh) + roundv_bf16(dv));
    __m256i ob;
    memcpy(&ob, &out, sizeof ob);
    _mm256_mask_storeu_epi16(y, mask, ob);
}

static void pass_bf16(const uint16_t *x, int64_t x_stride, int64_t in_features, const uint16_t *as, const uint16_t *bs,
                      uint16_t *y, int64_t y_stride, int64_t out_total, int64_t n_slices, const int64_t *slice_offsets,
                      int64_t rank, int64_t rk, const int64_t *tok, int64_t m, float *scratch)
{
    const int64_t pairs = (rank + 1) / 2, np = n_slices * pairs;
    uint32_t *hp = (uint32_t *)scratch; /* MT * np: each token's h as bf16 pairs (r, r + 1) per slice */
    const __m512i interleave = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                                39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const uint16_t *xr[MT];
    for (int t = 0; t < MT; t++) xr[t] = x + tok[t] * x_stride;
    /* shrink: four rank rows at a time (two pairs), MT x 4 independent sums sharing each load of x and of A */
    for (int64_t sl = 0; sl < n_slices; sl++)
        for (int64_t r0 = 0; r0 < rk; r0 += 4) {
            const int64_t rows = rk - r0 < 4 ? rk - r0 : 4; /* rows past rk are padding: their h is 0 */
            /* a row past rk reads the last real one (no branch in the loop) and its sum is dropped below */
            const uint16_t *a0 = as + (sl * rank + r0) * in_features, *a1 = a0 + (rows > 1 ? in_features : 0),
                           *a2 = a0 + (rows > 2 ? 2 : rows - 1) * in_features,
                           *a3 = a0 + (rows > 3 ? 3 : rows - 1) * in_features;
            __m512 c[MT][4];
#pragma GCC unroll 4
            for (int t = 0; t < MT; t++) c[t][0] = c[t][1] = c[t][2] = c[t][3] = _mm512_setzero_ps();
            for (int64_t k = 0; k < in_features; k += 32) {
                const __mmask32 mask = in_features - k >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << (in_features - k)) - 1);
                __builtin_prefetch(a0 + k + PF_A);
                __builtin_prefetch(a1 + k + PF_A);
                __builtin_prefetch(a2 + k + PF_A);
                __builtin_prefetch(a3 + k + PF_A);
                const __m512bh v0 = (__m512bh)_mm512_maskz_loadu_epi16(mask, a0 + k),
                               v1 = (__m512bh)_mm512_maskz_loadu_epi16(mask, a1 + k),
                               v2 = (__m512bh)_mm512_maskz_loadu_epi16(mask, a2 + k),
                               v3 = (__m512bh)_mm512_maskz_loadu_epi16(mask, a3 + k);
#pragma GCC unroll 4
                for (int t = 0; t < MT; t++) {
                    const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, xr[t] + k);
                    c[t][0] = _mm512_dpbf16_ps(c[t][0], xv, v0);
                    c[t][1] = _mm512_dpbf16_ps(c[t][1], xv, v1);
                    c[t][2] = _mm512_dpbf16_ps(c[t][2], xv, v2);
                    c[t][3] = _mm512_dpbf16_ps(c[t][3], xv, v3);
                }
            }
#if HAVE_SUMS_OF
            /* the 16 sums across lanes at once (lane 4t + i: token t, row i), rounded to bf16 together: as uint32
               lanes they are the (row 0, row 1) and (row 2, row 3) pairs of each token. Constant indexes only: the
               sums stay in registers through the loop above */
            vf cs[16];
#pragma GCC unroll 4
            for (int t = 0; t < MT; t++) {
                cs[4 * t] = (vf)c[t][0];
                cs[4 * t + 1] = (vf)c[t][1];
                cs[4 * t + 2] = (vf)c[t][2];
                cs[4 * t + 3] = (vf)c[t][3];
            }
            const vi lane = {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3};
            const vf sums = (vf)((vi)sums_of(cs) & (lane < (vi){0} + (int32_t)rows)); /* rows past rk: 0 */
            const vh hb = narrow(sums);
            uint32_t hw[8];
            memcpy(hw, &hb, sizeof hw);
#pragma GCC unroll 4
            for (int t = 0; t < MT; t++) {
                hp[t * np + sl * pairs + r0 / 2] = hw[2 * t];
                if (r0 + 2 < 2 * pairs) hp[t * np + sl * pairs + r0 / 2 + 1] = hw[2 * t + 1];
            }
#else
            /* constant indexes only: the sums stay in registers through the loop above */
#pragma GCC unroll 4
            for (int t = 0; t < MT; t++) {
                const uint32_t h0 = f_bf16(_mm512_reduce_add_ps(c[t][0])),
                               h1 = rows > 1 ? f_bf16(_mm512_reduce_add_ps(c[t][1])) : 0,
                               h2 = rows > 2 ? f_bf16(_mm512_reduce_add_ps(c[t][2])) : 0,
                               h3 = rows > 3 ? f_bf16(_mm512_reduce_add_ps(c[t][3])) : 0;
                hp[t * np + sl * pairs + r0 / 2] = h0 | (h1 << 16);
                if (r0 + 2 < 2 * pairs) hp[t * np + sl * pairs + r0 / 2 + 1] = h2 | (h3 << 16);
            }
#endif
        }
    /* expand, straight into y: two 16-column blocks at a time, MT x 2 independent sums sharing each h broadcast */
    for (int64_t sl = 0; sl < n_slices; sl++) {
        const int64_t lo = slice_offsets[sl], hi = slice_offsets[sl + 1];
        const uint32_t *h0 = hp + sl * pairs;
        for (int64_t o = lo; o < hi; o += 32) {
            __mmask16 mask[2];
            for (int q = 0; q < 2; q++) {
                const int64_t left = hi - o - 16 * q;
                mask[q] = left >= 16 ? (__mmask16)0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
            }
            __m512 d[MT][2];
#pragma GCC unroll 4
            for (int t = 0; t < MT; t++) d[t][0] = d[t][1] = _mm512_setzero_ps();
            for (int64_t p = 0; 2 * p < rk; p++) {
                const uint16_t *b0r = bs + 2 * p * out_total + o, *b1r = b0r + out_total;
                __builtin_prefetch(b0r + PF_B);
                __builtin_prefetch(b1r + PF_B);
                __m512bh bv[2];
                for (int q = 0; q < 2; q++) {
                    const __m256i b0 = _mm256_maskz_loadu_epi16(mask[q], b0r + 16 * q);
                    const __m256i b1 = 2 * p + 1 < rk ? _mm256_maskz_loadu_epi16(mask[q], b1r + 16 * q)
                                                       : _mm256_setzero_si256();
                    bv[q] = (__m512bh)_mm512_permutex2var_epi16(_mm512_castsi256_si512(b0), interleave,
                                                                _mm512_castsi256_si512(b1));
                }
#pragma GCC unroll 4
                for (int t = 0; t < MT; t++) {
                    const __m512bh hv = (__m512bh)_mm512_set1_epi32((int)h0[t * np + p]);
                    d[t][0] = _mm512_dpbf16_ps(d[t][0], hv, bv[0]);
                    d[t][1] = _mm512_dpbf16_ps(d[t][1], hv, bv[1]);
                }
            }
#pragma GCC unroll 4
            for (int t = 0; t < MT; t++) /* constant indexes into d: its sums stay in registers */
                if (t < m) {
                    add_delta_bf16(y + tok[t] * y_stride + o, mask[0], d[t][0]);
                    add_delta_bf16(y + tok[t] * y_stride + o + 16, mask[1], d[t][1]);
                }
        }
    }
}
#else
LORA_PASS(pass_bf16, uint16_t, ld_bf16, ld1_bf16, round1_bf16, roundv_bf16, addv_bf16, add1_bf16)
#endif

/* The exported entry points: every (slot group, MT tokens) pass, on the calling thread. One thread on purpose:
   a pass is tens of microseconds, and on a shared machine a second thread's barrier waits until that thread is
   scheduled again (measured with OpenMP on the 2-core VM, the bench model's 32 calls of a decode step: 1.8 ms at
   best on 2 threads against 2.4 on 1, and a median of 62 ms on 2 while another process held one core).
   x [.., in] rows x_stride apart; a: slot s's A at a + s * a_slot_stride, [n_slices * rank, in] row-major; bt: slot
   s's B rank-major at bt + s * b_slot_stride, [rank, out_total] (row r of every slice side by side); y [.., out]
   rows y_stride apart. Group g: the tokens tokens[group_start[g] .. group_start[g + 1]) of slot group_slot[g].
   slot_ranks (or NULL): rows at or past a slot's rank are zero padding and skipped. */
#define LORA_GROUPED(NAME, T, PASS)                                                                                  \
int NAME(const T *x, int64_t x_stride, int64_t in_features, const T *a, int64_t a_slot_stride, const T *bt,          \
         int64_t b_slot_stride, T *y, int64_t y_stride, int64_t out_total, int64_t n_slices,                         \
         const int64_t *slice_offsets, int64_t rank, const int32_t *slot_ranks, int64_t n_groups,                    \
         const int64_t *group_slot, const int64_t *group_start, const int64_t *tokens, float *scratch)               \
{                                                                                                                    \
    for (int64_t g = 0; g < n_groups; g++) {                                                                         \
        const int64_t s = group_slot[g];                                                                             \
        const int64_t rk = slot_ranks && slot_ranks[s] < rank ? slot_ranks[s] : rank;                                \
        for (int64_t c0 = group_start[g]; c0 < group_start[g + 1]; c0 += MT) {                                       \
            const int64_t m = group_start[g + 1] - c0 < MT ? group_start[g + 1] - c0 : MT;                           \
            int64_t tok[MT];                                                                                         \
            for (int t = 0; t < MT; t++) tok[t] = tokens[c0 + (t < m ? t : m - 1)];                                  \
            PASS(x, x_stride, in_features, a + s * a_slot_stride, bt + s * b_slot_stride, y, y_stride, out_total,    \
                 n_slices, slice_offsets, rank, rk, tok, m, scratch);                                                \
        }                                                                                                            \
    }                                                                                                                \
    return 0;                                                                                                        \
}

LORA_GROUPED(lora_grouped_f32, float, pass_f32)
LORA_GROUPED(lora_grouped_bf16, uint16_t, pass_bf16)

/* What this build multiplies with, for the caller's choice of which prefill runs it takes (gpu/lora_cpu_kernel.py):
   the lanes of its fp32 vectors, and whether its bf16 products are vdpbf16ps (1) or fp32 vectors (0). */
int lora_vector_lanes(void) { return VL; }
int lora_bf16_dot(void)
{
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    return 1;
#else
    return 0;
#endif
}
