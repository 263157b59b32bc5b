/* Residual add + RMSNorm on the CPU, one pass per row: r = x + residual (in the model dtype, as torch adds two
   tensors of it), out = (r * rsqrt(mean(r^2) + eps)) * w, the norm in fp32 and rounded to the model dtype once.
   torch runs the same as seven or eight whole-tensor ops (the add, the fp32 copy, the square, the mean, rsqrt and two
   products, the cast back), each with its own pass over memory and its own dispatch; at a decode step's 24 rows
   those fixed costs are most of the time. How it is built and called: gpu/rms_norm_cpu_kernel.py (its torch twin
   is TorchOps.rms_norm's plain-torch path). */
#include "cpu_vectors.h"

/* One row for element type T: LDV / LD1 load VL / 1 elements as fp32, STV / ST1 store fp32 as T. The sum of squares
   runs in VL partial sums, then across them. */
#define NORM_ROW(NAME, T, LDV, LD1, STV, ST1)                                                                         \
static void NAME(const T *x, const T *res, const T *w, int64_t n, float eps, T *out, T *res_out)                   \
{                                                                                                                    \
    const int64_t nv = n & ~(int64_t)(VL - 1);                                                                       \
    const T *r = x;                                                                                                  \
    if (res) { /* r = T(x + res), written to res_out: the residual stream the next layer reads */                   \
        int64_t k = 0;                                                                                               \
        for (; k < nv; k += VL) STV(res_out + k, LDV(x + k) + LDV(res + k));                                          \
        for (; k < n; k++) ST1(res_out + k, LD1(x + k) + LD1(res + k));                                              \
        r = res_out;                                                                                                 \
    }                                                                                                                \
    vf acc = {0};                                                                                                    \
    int64_t k = 0;                                                                                                   \
    for (; k < nv; k += VL) {                                                                                        \
        const vf v = LDV(r + k);                                                                                     \
        acc += v * v;                                                                                                \
    }                                                                                                                \
    float ss = hsum(acc);                                                                                            \
    for (; k < n; k++) ss += LD1(r + k) * LD1(r + k);                                                                \
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);                                                             \
    for (k = 0; k < nv; k += VL) STV(out + k, (LDV(r + k) * inv) * LDV(w + k));                                      \
    for (; k < n; k++) ST1(out + k, (LD1(r + k) * inv) * LD1(w + k));                                                \
}

NORM_ROW(norm_f32, float, ld_f32, ld1_f32, st_f32, st1_f32)
NORM_ROW(norm_bf16, uint16_t, ld_bf16, ld1_bf16, st_bf16, st1_bf16)

/* out [rows, n] (contiguous) = RMSNorm of x [rows, n] (rows x_stride apart) plus residual (rows res_stride apart;
   NULL: none), weight w [n]; with a residual, r = x + residual is written to res_out [rows, n] (contiguous). dtype 0 =
   fp32, 1 = bf16, for x, residual, w, out and res_out alike. Returns 0. */
int rms_norm_rows(int64_t dtype, const void *x, int64_t x_stride, const void *res, int64_t res_stride, const void *w,
                  int64_t rows, int64_t n, float eps, void *out, void *res_out) {
    for (int64_t i = 0; i < rows; i++) {
        if (dtype == 0)
            norm_f32((const float *)x + i * x_stride, res ? (const float *)res + i * res_stride : 0, (const float *)w,
                     n, eps, (float *)out + i * n, res ? (float *)res_out + i * n : 0);
        else
            norm_bf16((const uint16_t *)x + i * x_stride, res ? (const uint16_t *)res + i * res_stride : 0,
                      (const uint16_t *)w, n, eps, (uint16_t *)out + i * n, res ? (uint16_t *)res_out + i * n : 0);
    }
    return 0;
}
