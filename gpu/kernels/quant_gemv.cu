// Weight-only quantized projections (W4A16, W8A16): a decode GEMV that reads the packed weights once,
// and a dequantize-to-activation-dtype kernel for prefill (cuBLAS then multiplies).
#include "common.cuh"

// The device layout (loraledger/quantization/device_layout.py), per projection of N outputs x K inputs:
//   qweight: unsigned [N, K * BITS / 32], row n holds input columns 0..K-1 of output n, element j of a
//            32-bit word at bits BITS * j (lowest first), values unsigned in [0, 2^BITS);
//   scales:  S [N, K / group_size];  zeros: S [N, K / group_size] or null (then every zero is `zero`);
//   offsets: S [N, K / group_size] or null (then 0).  S: fp16, bf16, or fp32 where no 16-bit float is exact.
//   W[n, k] = (q[n, k] - zero[n, g]) * scale[n, g] + offset[n, g],  g = k / group_size.
// group_size is a multiple of one 16-byte load's elements (32 at 4 bits, 16 at 8 bits), so that a load
// never straddles two groups.
constexpr int kQuantThreads = 128;  // four warps
constexpr int kQuantRows = 2;       // output rows per warp at a time: each activation load serves both
constexpr int kQuantUnroll = 2;     // 16-byte words per row each lane has in flight (with the rows: 4 loads)
constexpr int kDequantThreads = 256;

// 2^23 as float bits: (bits | q) read as a float is 2^23 + q exactly, for any q < 2^23 (no int-to-float).
constexpr unsigned kMagicBits = 0x4B000000u;
constexpr float kMagic = 8388608.0f;

// x: [num_tokens, K] contiguous, 16-byte aligned rows; out: [num_tokens, N] contiguous.
// Grid: (row blocks, ceil(num_tokens / TOKENS)); each block computes TOKENS tokens of its rows, so the
// weights are read once per TOKENS tokens. Each warp takes kQuantRows rows; each lane reads whole 16-byte
// words of them (coalesced: a warp reads 512 consecutive bytes of a row per load), keeps fp32 partial
// sums per row and token, and the warp reduces them.
template <typename T, typename S, int BITS, int TOKENS>
__global__ void __launch_bounds__(kQuantThreads) quant_gemv_kernel(
    T* __restrict__ out, const T* __restrict__ x, const unsigned* __restrict__ qweight,
    const S* __restrict__ scales, const S* __restrict__ zeros, const S* __restrict__ offsets, float zero,
    int num_tokens, int N, int K, int group_size) {
    constexpr int kPerWord = 32 / BITS;
    constexpr int kPerVec = 4 * kPerWord;
    constexpr unsigned kMask = (1u << BITS) - 1u;
    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    const int vecs = K / kPerVec;
    const int groups = K / group_size;
    const int t0 = blockIdx.y * TOKENS;
    const int tokens = min(TOKENS, num_tokens - t0);
    const bool has_offsets = offsets != nullptr;
    const T* xt = x + static_cast<long long>(t0) * K;

    for (int row0 = (blockIdx.x * warps + (threadIdx.x >> 5)) * kQuantRows; row0 < N;
         row0 += gridDim.x * warps * kQuantRows) {
        const int rows = min(kQuantRows, N - row0);
        float acc[kQuantRows][TOKENS];
#pragma unroll
        for (int r = 0; r < kQuantRows; ++r)
#pragma unroll
            for (int t = 0; t < TOKENS; ++t) acc[r][t] = 0.0f;
        for (int v0 = lane; v0 < vecs; v0 += 32 * kQuantUnroll) {
            uint4 raw[kQuantRows][kQuantUnroll];
#pragma unroll
            for (int r = 0; r < kQuantRows; ++r) {
                const uint4* wrow =
                    reinterpret_cast<const uint4*>(qweight + static_cast<long long>(row0 + r) * (K / kPerWord));
#pragma unroll
                for (int u = 0; u < kQuantUnroll; ++u)
                    if (r < rows && v0 + 32 * u < vecs) raw[r][u] = wrow[v0 + 32 * u];  // all issued before use
            }
#pragma unroll
            for (int u = 0; u < kQuantUnroll; ++u) {
                const int v = v0 + 32 * u;
                if (v >= vecs) break;
                const int k0 = v * kPerVec;
                float s[kQuantRows], bias[kQuantRows], m[kQuantRows];
#pragma unroll
                for (int r = 0; r < kQuantRows; ++r) {
                    const long long gi = static_cast<long long>(min(row0 + r, N - 1)) * groups + k0 / group_size;
                    s[r] = to_float(scales[gi]);
                    bias[r] = kMagic + (zeros != nullptr ? to_float(zeros[gi]) : zero);
                    m[r] = has_offsets ? to_float(offsets[gi]) : 0.0f;
                }
#pragma unroll
                for (int w = 0; w < 4; ++w) {
                    float q[kQuantRows][kPerWord];  // q - zero, exact
#pragma unroll
                    for (int r = 0; r < kQuantRows; ++r) {
                        const unsigned word = r >= rows ? 0u
                                              : w == 0  ? raw[r][u].x
                                              : w == 1  ? raw[r][u].y
                                              : w == 2  ? raw[r][u].z
                                                        : raw[r][u].w;
#pragma unroll
                        for (int j = 0; j < kPerWord; ++j)
                            q[r][j] = __uint_as_float(kMagicBits | ((word >> (BITS * j)) & kMask)) - bias[r];
                    }
#pragma unroll
                    for (int t = 0; t < TOKENS; ++t) {
                        if (t < tokens) {
                            float xv[kPerWord];
                            load_floats<T, kPerWord>(xt + static_cast<long long>(t) * K + k0 + w * kPerWord, xv);
                            float xsum = 0.0f;
                            if (has_offsets) {
#pragma unroll
                                for (int j = 0; j < kPerWord; ++j) xsum += xv[j];
                            }
#pragma unroll
                            for (int r = 0; r < kQuantRows; ++r) {
                                float dot = 0.0f;
#pragma unroll
                                for (int j = 0; j < kPerWord; ++j) dot = fmaf(q[r][j], xv[j], dot);
                                acc[r][t] = fmaf(dot, s[r], acc[r][t]);
                                if (has_offsets) acc[r][t] = fmaf(xsum, m[r], acc[r][t]);
                            }
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < kQuantRows; ++r)
#pragma unroll
            for (int t = 0; t < TOKENS; ++t) {
                const float total = warp_sum(acc[r][t]);
                if (lane == 0 && r < rows && t < tokens)
                    out[static_cast<long long>(t0 + t) * N + row0 + r] = from_float<T>(total);
            }
    }
}

// out: T [N, K] contiguous, the dequantized weight (fp32 arithmetic, rounded once to T). One thread per
// 16-byte word of qweight, grid-stride.
template <typename S, int BITS, typename T>
__global__ void __launch_bounds__(kDequantThreads) quant_dequantize_kernel(
    T* __restrict__ out, const unsigned* __restrict__ qweight, const S* __restrict__ scales,
    const S* __restrict__ zeros, const S* __restrict__ offsets, float zero, int N, int K, int group_size) {
    constexpr int kPerWord = 32 / BITS;
    constexpr int kPerVec = 4 * kPerWord;
    constexpr unsigned kMask = (1u << BITS) - 1u;
    const int vecs = K / kPerVec;
    const int groups = K / group_size;
    const long long total = static_cast<long long>(N) * vecs;
    const uint4* words4 = reinterpret_cast<const uint4*>(qweight);
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
         i += static_cast<long long>(gridDim.x) * blockDim.x) {
        const long long row = i / vecs;
        const int k0 = static_cast<int>(i - row * vecs) * kPerVec;
        const long long gi = row * groups + k0 / group_size;
        const float s = to_float(scales[gi]);
        const float bias = kMagic + (zeros != nullptr ? to_float(zeros[gi]) : zero);
        const float m = offsets != nullptr ? to_float(offsets[gi]) : 0.0f;
        const uint4 raw = words4[i];
        const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
        float w[kPerVec];
#pragma unroll
        for (int c = 0; c < 4; ++c)
#pragma unroll
            for (int j = 0; j < kPerWord; ++j)
                w[c * kPerWord + j] =
                    fmaf(__uint_as_float(kMagicBits | ((words[c] >> (BITS * j)) & kMask)) - bias, s, m);
        store_floats<T, kPerVec>(out + row * K + k0, w);
    }
}
