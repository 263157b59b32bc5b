/* The decode tokens' multi-LoRA delta on the CPU, one call per fused module: y[t] += (x[t] A_s^T) B_s^T for each
   adapter token t of slot s, in one pass over each active slot's A and B rows (gather, shrink, expand and add;
   no intermediate tensors, no zero blocks). Plain C with GCC/Clang vector extensions: the compiler lowers the
   16-lane vectors to the CPU it is built on (-march=native: AVX-512, AVX2, NEON).
   Layouts, numerics and how it is built and called: gpu/lora_cpu_kernel.py (its torch twin is TorchLoraOps'
   grouped path). Returns 0. */
#include <stdint.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

#define MT 4 /* tokens multiplied together: one pass over a slot's A and B rows serves MT tokens */

static inline v16f ld_f32(const float *p) { v16f v; memcpy(&v, p, sizeof v); return v; }
static inline void st_f32(float *p, v16f v) { memcpy(p, &v, sizeof v); }
static inline v16f widen(v16h h) { v16u u = __builtin_convertvector(h, v16u) << 16; v16f f; memcpy(&f, &u, sizeof f); return f; }
static inline v16f ld_bf16(const uint16_t *p) { v16h h; memcpy(&h, p, sizeof h); return widen(h); }
/* fp32 -> bf16, round to nearest even; a NaN stays a (quiet) NaN */
static inline v16h narrow(v16f f) {
    v16u u; memcpy(&u, &f, sizeof u);
    v16u r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    v16u nan = (v16u)((u & 0x7fffffffu) > 0x7f800000u);
    return __builtin_convertvector((nan & ((u >> 16) | 0x40u)) | (~nan & r), v16h);
}
static inline float bf16_f(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline float hsum(v16f v) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

/* One element type T (float or bf16 bits): LDV / LD1 load 16 / 1 elements as fp32, ROUNDV / ROUND1 round fp32 to
   T and back (h and the delta are rounded to the model dtype, as the torch twin and PEFT do), ADDV / ADD1 add a
   delta to 16 / 1 elements of y in T.
   x [.., in] rows x_stride apart; a: slot s's A at a + s * a_slot_stride, [n_slices * rank, in] row-major; bt: slot
   s's B rank-major at bt + s * b_slot_stride, [rank, out_total] (row r of every slice side by side); y [.., out]
   rows y_stride apart. Group g: the tokens tokens[group_start[g] .. group_start[g + 1]) of slot group_slot[g].
   slot_ranks (or NULL): rows at or past a slot's rank are zero padding and skipped. scratch: MT * in + MT *
   n_slices * rank floats. */
#define LORA_GROUPED(NAME, T, LDV, LD1, ROUND1, ROUNDV, ADDV, ADD1)                                                   \
int NAME(const T *x, int64_t x_stride, int64_t in_features, const T *a, int64_t a_slot_stride, const T *bt,           \
         int64_t b_slot_stride, T *y, int64_t y_stride, int64_t out_total, int64_t n_slices,                          \
         const int64_t *slice_offsets, int64_t rank, const int32_t *slot_ranks, int64_t n_groups,                     \
         const int64_t *group_slot, const int64_t *group_start, const int64_t *tokens, float *scratch)                \
{                                                                                                                    \
    const int64_t nr = n_slices * rank, kv = in_features & ~(int64_t)15;                                             \
    float *xf = scratch, *h = scratch + MT * in_features;                                                            \
    for (int64_t g = 0; g < n_groups; g++) {                                                                         \
        const int64_t s = group_slot[g];                                                                             \
        int64_t rk = slot_ranks ? slot_ranks[s] : rank;                                                              \
        if (rk > rank) rk = rank;                                                                                    \
        const T *as = a + s * a_slot_stride, *bs = bt + s * b_slot_stride;                                          \
        for (int64_t c0 = group_start[g]; c0 < group_start[g + 1]; c0 += MT) {                                       \
            const int64_t m = group_start[g + 1] - c0 < MT ? group_start[g + 1] - c0 : MT;                           \
            int64_t tok[MT];                                                                                         \
            for (int t = 0; t < MT; t++) tok[t] = tokens[c0 + (t < m ? t : m - 1)];                                  \
            for (int t = 0; t < MT; t++)                                                                             \
                for (int64_t k = 0; k < in_features; k++) xf[t * in_features + k] = LD1(x + tok[t] * x_stride + k); \
            /* shrink: h[t][j] = x_t . A_s[j] over the slot's rank rows of each slice (the rest is zero padding) */ \
            for (int64_t sl = 0; sl < n_slices; sl++)                                                                \
                for (int64_t r = 0; r < rank; r++) {                                                                 \
                    const int64_t j = sl * rank + r;                                                                 \
                    if (r >= rk) {                                                                                   \
                        for (int t = 0; t < MT; t++) h[t * nr + j] = 0.0f;                                           \
                        continue;                                                                                    \
                    }                                                                                                \
                    const T *ar = as + j * in_features;                                                              \
                    v16f c0v = {0}, c1v = {0}, c2v = {0}, c3v = {0};                                                 \
                    for (int64_t k = 0; k < kv; k += 16) {                                                           \
                        const v16f av = LDV(ar + k);                                                                 \
                        c0v += ld_f32(xf + k) * av;                                                                  \
                        c1v += ld_f32(xf + in_features + k) * av;                                                    \
                        c2v += ld_f32(xf + 2 * in_features + k) * av;                                                \
                        c3v += ld_f32(xf + 3 * in_features + k) * av;                                                \
                    }                                                                                                \
                    float sum[MT] = {hsum(c0v), hsum(c1v), hsum(c2v), hsum(c3v)};                                    \
                    for (int64_t k = kv; k < in_features; k++) {                                                     \
                        const float av = LD1(ar + k);                                                                \
                        for (int t = 0; t < MT; t++) sum[t] += xf[t * in_features + k] * av;                         \
                    }                                                                                                \
                    for (int t = 0; t < MT; t++) h[t * nr + j] = ROUND1(sum[t]);                                     \
                }                                                                                                    \
            /* expand: y[t][o] += sum_r h[t][slice(o) * R + r] * Bt_s[r][o], each slice over its own columns */     \
            for (int64_t sl = 0; sl < n_slices; sl++) {                                                              \
                const int64_t lo = slice_offsets[sl], hi = slice_offsets[sl + 1];                                    \
                const float *h0 = h + sl * rank, *h1 = h0 + nr, *h2 = h1 + nr, *h3 = h2 + nr;                        \
                int64_t o = lo;                                                                                      \
                for (; o + 16 <= hi; o += 16) {                                                                      \
                    v16f d0 = {0}, d1 = {0}, d2 = {0}, d3 = {0};                                                     \
                    for (int64_t r = 0; r < rk; r++) {                                                               \
                        const v16f bv = LDV(bs + r * out_total + o);                                                 \
                        d0 += h0[r] * bv;                                                                            \
                        d1 += h1[r] * bv;                                                                            \
                        d2 += h2[r] * bv;                                                                            \
                        d3 += h3[r] * bv;                                                                            \
                    }                                                                                                \
                    const v16f d[MT] = {d0, d1, d2, d3};                                                             \
                    for (int t = 0; t < m; t++) ADDV(y + tok[t] * y_stride + o, ROUNDV(d[t]));                       \
                }                                                                                                    \
                for (; o < hi; o++)                                                                                  \
                    for (int t = 0; t < m; t++) {                                                                    \
                        float d = 0.0f;                                                                              \
                        for (int64_t r = 0; r < rk; r++) d += h[t * nr + sl * rank + r] * LD1(bs + r * out_total + o); \
                        ADD1(y + tok[t] * y_stride + o, ROUND1(d));                                                  \
                    }                                                                                                \
            }                                                                                                        \
        }                                                                                                            \
    }                                                                                                                \
    return 0;                                                                                                        \
}

static inline float ld1_f32(const float *p) { return *p; }
static inline float keep1(float v) { return v; }
static inline v16f keepv(v16f v) { return v; }
static inline void addv_f32(float *p, v16f d) { st_f32(p, ld_f32(p) + d); }
static inline void add1_f32(float *p, float d) { *p += d; }
LORA_GROUPED(lora_grouped_f32, float, ld_f32, ld1_f32, keep1, keepv, addv_f32, add1_f32)

static inline float ld1_bf16(const uint16_t *p) { return bf16_f(*p); }
static inline float round1_bf16(float v) { return bf16_f(f_bf16(v)); }
static inline v16f roundv_bf16(v16f v) { return widen(narrow(v)); }
/* y = bf16(y + delta): the delta already rounded to bf16, as a bf16 add of two bf16 tensors */
static inline void addv_bf16(uint16_t *p, v16f d) { v16h o = narrow(ld_bf16(p) + d); memcpy(p, &o, sizeof o); }
static inline void add1_bf16(uint16_t *p, float d) { *p = f_bf16(bf16_f(*p) + d); }
LORA_GROUPED(lora_grouped_bf16, uint16_t, ld_bf16, ld1_bf16, round1_bf16, roundv_bf16, addv_bf16, add1_bf16)
