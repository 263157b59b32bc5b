// Shared device helpers: element types, fp32 conversions, packed loads, warp and block reductions.
//
// NVRTC compiles these sources at run time, so nothing here may include a header: the 16-bit
// element types are our own structs with explicit conversions (no cuda_fp16.h / cuda_bf16.h,
// which CuPy wheels do not always ship). The loader in kernel_sources.py pastes this file in
// place of `#include "common.cuh"`, so NVRTC needs no include path either.
#ifndef LORALEDGER_COMMON_CUH
#define LORALEDGER_COMMON_CUH

struct __align__(2) bf16_t {
    unsigned short bits;
};

struct __align__(2) f16_t {
    unsigned short bits;
};

__device__ __forceinline__ float to_float(float v) { return v; }

__device__ __forceinline__ float to_float(bf16_t v) {
    return __uint_as_float(static_cast<unsigned int>(v.bits) << 16);
}

__device__ __forceinline__ float to_float(f16_t v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
    return f;
}

template <typename T>
__device__ __forceinline__ T from_float(float v);

template <>
__device__ __forceinline__ float from_float<float>(float v) {
    return v;
}

// Round to nearest even, as torch does; integer arithmetic so that it needs no sm_80 instruction.
template <>
__device__ __forceinline__ bf16_t from_float<bf16_t>(float v) {
    unsigned int u = __float_as_uint(v);
    bf16_t r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.bits = static_cast<unsigned short>((u >> 16) | 0x0040u);  // keep NaN a (quiet) NaN
    } else {
        u += 0x7fffu + ((u >> 16) & 1u);
        r.bits = static_cast<unsigned short>(u >> 16);
    }
    return r;
}

template <>
__device__ __forceinline__ f16_t from_float<f16_t>(float v) {
    f16_t r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(v));
    return r;
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// ---- packed loads: N elements in one 4/8/16-byte access, several 16-byte accesses beyond that ----

template <int BYTES>
struct RawWord;
template <>
struct RawWord<2> {
    using type = unsigned short;
};
template <>
struct RawWord<4> {
    using type = unsigned int;
};
template <>
struct RawWord<8> {
    using type = uint2;
};
template <>
struct RawWord<16> {
    using type = uint4;
};

template <typename T, int N>
union Pack {
    typename RawWord<sizeof(T) * N>::type raw;
    T v[N];
};

// Loads N consecutive elements as fp32; p must be aligned to min(16, N * sizeof(T)) bytes.
template <typename T, int N>
__device__ __forceinline__ void load_floats(const T* __restrict__ p, float* out) {
    if constexpr (sizeof(T) * N > 16) {
        constexpr int kChunk = 16 / sizeof(T);
        static_assert(N % kChunk == 0, "packs above 16 bytes must be whole 16-byte chunks");
#pragma unroll
        for (int c = 0; c < N / kChunk; ++c) load_floats<T, kChunk>(p + c * kChunk, out + c * kChunk);
    } else {
        Pack<T, N> pk;
        pk.raw = *reinterpret_cast<const typename RawWord<sizeof(T) * N>::type*>(p);
#pragma unroll
        for (int i = 0; i < N; ++i) out[i] = to_float(pk.v[i]);
    }
}

// Stores N consecutive elements converted from fp32; same alignment rule as load_floats.
template <typename T, int N>
__device__ __forceinline__ void store_floats(T* __restrict__ p, const float* in) {
    if constexpr (sizeof(T) * N > 16) {
        constexpr int kChunk = 16 / sizeof(T);
        static_assert(N % kChunk == 0, "packs above 16 bytes must be whole 16-byte chunks");
#pragma unroll
        for (int c = 0; c < N / kChunk; ++c) store_floats<T, kChunk>(p + c * kChunk, in + c * kChunk);
    } else {
        Pack<T, N> pk;
#pragma unroll
        for (int i = 0; i < N; ++i) pk.v[i] = from_float<T>(in[i]);
        *reinterpret_cast<typename RawWord<sizeof(T) * N>::type*>(p) = pk.raw;
    }
}

// Copies N elements without conversion (KV-cache writes).
template <typename T, int N>
__device__ __forceinline__ void copy_pack(T* __restrict__ dst, const T* __restrict__ src) {
    using Word = typename RawWord<sizeof(T) * N>::type;
    *reinterpret_cast<Word*>(dst) = *reinterpret_cast<const Word*>(src);
}

__device__ __forceinline__ bool is_aligned(const void* p, unsigned long long bytes) {
    return (reinterpret_cast<unsigned long long>(p) & (bytes - 1)) == 0;
}

// ---- reductions ----

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over aligned groups of `width` lanes (a power of two <= 32); every lane of a group gets it.
__device__ __forceinline__ float group_sum(float v, int width) {
    for (int o = width >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the block (blockDim.x a multiple of 32); every thread gets the total.
// scratch: >= 32 floats of shared memory; safe to call repeatedly with the same scratch.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int num_warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // the previous call's readers are done with scratch
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < num_warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

// ---- thread block clusters (sm_90) and a cache hint ----
// Only kernels that CudaOps launches on compute capability 9.0 or newer use these; compiled for an
// older target they trap. The CPU emulation (tests/gpu/cuda_emulation.h) defines its own versions,
// and its loader drops this block (inline PTX has no host meaning).
#ifndef LORALEDGER_HOST_EMULATION
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define LORALEDGER_CLUSTER(n)
#else
#define LORALEDGER_CLUSTER(n) __cluster_dims__(n, 1, 1)
#endif

// This block's rank in its cluster.
__device__ __forceinline__ unsigned cluster_rank() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
#else
    __trap();
    return 0;
#endif
}

// Barrier over every thread of the cluster; shared-memory writes before it are visible to the
// whole cluster after it.
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
    __trap();
#endif
}

// The address of the same shared-memory float in block `rank` of this cluster.
__device__ __forceinline__ const float* cluster_peer(const float* p, unsigned rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const float* r;
    asm volatile("mapa.u64 %0, %1, %2;" : "=l"(r) : "l"(p), "r"(rank));
    return r;
#else
    __trap();
    return p;
#endif
}

// Ask for the 128-byte line at p to be brought into L2 (no register waits for it).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
#endif  // LORALEDGER_HOST_EMULATION

#endif  // LORALEDGER_COMMON_CUH
