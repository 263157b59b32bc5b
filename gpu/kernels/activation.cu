// SwiGLU activation: out = silu(x[:, :I]) * x[:, I:], computed in fp32.
#include "common.cuh"

__device__ __forceinline__ float silu_mul(float gate, float up) { return gate / (1.0f + expf(-gate)) * up; }

// x: [T, 2I] with row stride x_stride (elements contiguous); out: [T, I] contiguous.
// Grid-stride over T * I elements (packs of 16 bytes where alignment allows).
template <typename T>
__global__ void silu_and_mul_kernel(T* __restrict__ out, const T* __restrict__ x, long long x_stride, int num_tokens,
                                    int I) {
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = I % kVec == 0 && x_stride % kVec == 0 && is_aligned(out, 16) && is_aligned(x, 16);
    const int step = vec ? kVec : 1;
    const long long per_row = I / step;
    const long long total = per_row * num_tokens;
    for (long long item = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; item < total;
         item += static_cast<long long>(gridDim.x) * blockDim.x) {
        const long long t = item / per_row;
        const int c = static_cast<int>(item - t * per_row) * step;
        const T* gate = x + t * x_stride + c;
        T* o = out + t * I + c;
        if (vec) {
            float g[kVec], u[kVec];
            load_floats<T, kVec>(gate, g);
            load_floats<T, kVec>(gate + I, u);
#pragma unroll
            for (int e = 0; e < kVec; ++e) g[e] = silu_mul(g[e], u[e]);
            store_floats<T, kVec>(o, g);
        } else {
            *o = from_float<T>(silu_mul(to_float(gate[0]), to_float(gate[I])));
        }
    }
}
