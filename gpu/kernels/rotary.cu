// Rotary position embedding (NeoX / HF Llama "rotate_half" layout), applied to q and k in place.
#include "common.cuh"

// q: [T, Hq, D], k: [T, Hk, D], each with a row stride (heads and elements contiguous);
// positions: [T] (int64 or int32); cos_sin: [max_positions, D] fp32, cos in the first D/2
// columns, sin in the last D/2. x = cat(x1*c - x2*s, x2*c + x1*s) with x1, x2 the two halves.
// A position outside [0, max_positions) leaves its token unrotated rather than reading out of
// bounds (the engine never produces one: max_model_len <= max_positions).
// One block per token (grid-stride), threads over (head, pair).
template <typename T, typename I>
__global__ void rotary_embedding_kernel(
    T* __restrict__ q, long long q_stride, T* __restrict__ k, long long k_stride, const I* __restrict__ positions,
    const float* __restrict__ cos_sin, int num_tokens, int num_q_heads, int num_k_heads, int head_dim,
    long long max_positions) {
    const int half = head_dim / 2;
    const int pairs = (num_q_heads + num_k_heads) * half;
    for (int t = blockIdx.x; t < num_tokens; t += gridDim.x) {
        const long long pos = static_cast<long long>(positions[t]);
        if (pos < 0 || pos >= max_positions) continue;
        const float* cs = cos_sin + pos * head_dim;
        for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
            const int head = i / half;
            const int j = i - head * half;
            T* x = head < num_q_heads ? q + t * q_stride + head * head_dim
                                      : k + t * k_stride + (head - num_q_heads) * head_dim;
            const float c = cs[j];
            const float s = cs[half + j];
            const float x1 = to_float(x[j]);
            const float x2 = to_float(x[half + j]);
            x[j] = from_float<T>(x1 * c - x2 * s);
            x[half + j] = from_float<T>(x2 * c + x1 * s);
        }
    }
}
