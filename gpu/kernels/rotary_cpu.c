/* Rotary position embedding on the CPU, one pass, in place (NeoX halves, as Llama's): for each token t at position p
   and each head, x1 = x[:half], x2 = x[half:], c = cos[p], s = sin[p]:
   x[:half] = x1 c - x2 s, x[half:] = x2 c + x1 s, in fp32 and rounded once to the model dtype. Each product is
   rounded before the sum (no fused multiply-add), as torch's four whole-tensor products and two sums round them,
   so the result equals the torch twin's (TorchOps.rotary_embedding's plain-torch path) bit for bit. How it is
   built and called: gpu/rotary_cpu_kernel.py. */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#include "cpu_vectors.h"

/* One rotation, the products each rounded before their sum: lo = x1 c - x2 s, hi = x2 c + x1 s (VL lanes, or one) */
static inline void turn(vf x1, vf x2, vf c, vf s, vf *lo, vf *hi)
{
    const vf p = x1 * c, q = x2 * s, r = x2 * c, u = x1 * s;
    *lo = p - q;
    *hi = r + u;
}
static inline void turn1(float x1, float x2, float c, float s, float *lo, float *hi)
{
    const float p = x1 * c, q = x2 * s, r = x2 * c, u = x1 * s;
    *lo = p - q;
    *hi = r + u;
}

/* x [tokens, heads, 2 * half] (tokens x_stride_t apart, heads x_stride_h apart, unit element stride); positions
   [tokens] int64; cos_sin [n_positions, 2 * half] fp32 (cos, then sin); dtype 0 = fp32, 1 = bf16. Returns 0, or -1
   before writing anything where a position is outside 0..n_positions-1. */
int rotary_rows(int64_t dtype, void *x, int64_t x_stride_t, int64_t x_stride_h, int64_t tokens, int64_t heads,
                int64_t half, const int64_t *positions, const float *cos_sin, int64_t n_positions)
{
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= n_positions) return -1;
    const int64_t nv = half & ~(int64_t)(VL - 1);
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_sin + positions[t] * 2 * half, *s = c + half;
        for (int64_t h = 0; h < heads; h++) {
            const int64_t at = t * x_stride_t + h * x_stride_h;
            int64_t i = 0;
            vf lo, hi;
            float lo1, hi1;
            if (dtype == 0) {
                float *a = (float *)x + at, *b = a + half;
                for (; i < nv; i += VL) {
                    turn(ld_f32(a + i), ld_f32(b + i), ld_f32(c + i), ld_f32(s + i), &lo, &hi);
                    st_f32(a + i, lo);
                    st_f32(b + i, hi);
                }
                for (; i < half; i++) turn1(a[i], b[i], c[i], s[i], &a[i], &b[i]);
            } else {
                uint16_t *a = (uint16_t *)x + at, *b = a + half;
                for (; i < nv; i += VL) {
                    turn(ld_bf16(a + i), ld_bf16(b + i), ld_f32(c + i), ld_f32(s + i), &lo, &hi);
                    st_bf16(a + i, lo);
                    st_bf16(b + i, hi);
                }
                for (; i < half; i++) {
                    turn1(bf16_f(a[i]), bf16_f(b[i]), c[i], s[i], &lo1, &hi1);
                    a[i] = f_bf16(lo1);
                    b[i] = f_bf16(hi1);
                }
            }
        }
    }
    return 0;
}
