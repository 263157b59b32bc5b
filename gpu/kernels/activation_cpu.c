/* SiLU-and-multiply on the CPU, one pass: out[t, j] = silu(x[t, j]) * x[t, i + j] for the fused gate/up projection's
   output x [T, 2i]. In bf16, silu's result is rounded to bf16 before the product, and the product rounded again, as
   torch's F.silu(gate) * up computes it in a bf16 model; silu itself is x / (1 + e^-x) in fp32 with the vector exp
   of cpu_vectors.h. How it is built and called: gpu/activation_cpu_kernel.py (its torch twin is
   TorchOps.silu_and_mul's plain-torch path). */
#include "cpu_vectors.h"

static inline vf silu(vf x) { return x / (1.0f + vexp(-x)); }
static inline float silu1(float x) {
    vf v = broadcast(x);
    return silu(v)[0];
}

/* out [rows, i] (contiguous) from x [rows, 2 * i] (rows x_stride apart); dtype 0 = fp32, 1 = bf16. Returns 0. */
int silu_and_mul_rows(int64_t dtype, const void *x, int64_t x_stride, int64_t rows, int64_t i, void *out) {
    const int64_t nv = i & ~(int64_t)(VL - 1);
    for (int64_t t = 0; t < rows; t++) {
        if (dtype == 0) {
            const float *g = (const float *)x + t * x_stride, *u = g + i;
            float *o = (float *)out + t * i;
            int64_t j = 0;
            for (; j < nv; j += VL) st_f32(o + j, silu(ld_f32(g + j)) * ld_f32(u + j));
            for (; j < i; j++) o[j] = silu1(g[j]) * u[j];
        } else {
            const uint16_t *g = (const uint16_t *)x + t * x_stride, *u = g + i;
            uint16_t *o = (uint16_t *)out + t * i;
            int64_t j = 0;
            for (; j < nv; j += VL) st_bf16(o + j, widen(narrow(silu(ld_bf16(g + j)))) * ld_bf16(u + j));
            for (; j < i; j++) o[j] = f_bf16(bf16_f(f_bf16(silu1(bf16_f(g[j])))) * bf16_f(u[j]));
        }
    }
    return 0;
}
