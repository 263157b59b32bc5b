// CPU emulation of the CUDA execution model, so that the kernels' logic is tested without a GPU.
//
// Clusters of blocks run one after another (a kernel without clusters: clusters of one block); each
// CUDA thread of a cluster is a fiber (ucontext) on one OS thread, and __syncthreads, warp shuffles
// and cluster barriers are cooperative barriers released once every live thread of the block / warp /
// cluster waits there. A barrier that can never be released (a divergent __syncthreads or shuffle, a
// bug on a real GPU too) aborts with a message. Each block of a cluster has its own dynamic shared
// memory, NaN-filled at the start; static __shared__ arrays are one copy per kernel, which is right
// only for kernels without clusters (cluster kernels use dynamic shared memory alone). Built with
// -fsanitize=alignment, a vector load on a misaligned address aborts as it would fault on a GPU.
// Not emulated: memory ordering between threads other than what the barriers give.
#include <ucontext.h>

#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned x, y;
};

inline dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace emu {
enum Wait { kRunning, kBlock, kWarp, kCluster, kDone };
struct Fiber {
    ucontext_t ctx;
    std::vector<char> stack;
    Wait wait = kRunning;
    unsigned long shuffles = 0;
};
inline ucontext_t scheduler;
inline std::vector<Fiber> fibers;  // cluster_size * block_size, block-major
inline std::vector<float> shfl;
inline std::vector<std::vector<unsigned char>> smem;  // per block of the cluster
inline unsigned block_size = 1, cluster_size = 1, cluster_first_x = 0;
inline unsigned current = 0;  // the running fiber
inline void (*body)() = nullptr;

inline unsigned rank_of(unsigned fiber) { return fiber / block_size; }
inline unsigned char* block_smem() { return smem[rank_of(current)].data(); }

inline void yield(Wait why) {
    Fiber& f = fibers[current];
    f.wait = why;
    swapcontext(&f.ctx, &scheduler);
}
inline void trampoline() {
    body();
    yield(kDone);
}
// Releases the fibers [first, first + count) waiting for `why` once every one of them waits there or
// is done; a warp barrier with an exited lane aborts (a full-warp shuffle on a GPU would hang).
inline bool release(unsigned first, unsigned count, Wait why) {
    bool any = false, all = true;
    for (unsigned t = first; t < first + count; ++t) {
        any |= fibers[t].wait == why;
        all &= fibers[t].wait == why || fibers[t].wait == kDone;
    }
    if (!any || !all) return false;
    if (why == kWarp) {
        for (unsigned t = first; t < first + count; ++t) {
            if (fibers[t].wait == kDone) {
                std::fprintf(stderr, "emulated kernel: full-warp shuffle after lane %u exited\n", t % block_size);
                std::abort();
            }
        }
    }
    for (unsigned t = first; t < first + count; ++t)
        if (fibers[t].wait == why) fibers[t].wait = kRunning;
    return true;
}
// Runs the cluster's fibers until all are done, releasing barriers once every live participant waits.
inline void run_cluster() {
    for (;;) {
        bool progressed = false;
        for (unsigned t = 0; t < fibers.size(); ++t) {
            if (fibers[t].wait != kRunning) continue;
            current = t;
            threadIdx = dim3{t % block_size, 0, 0};
            blockIdx.x = cluster_first_x + rank_of(t);
            swapcontext(&scheduler, &fibers[t].ctx);
            progressed = true;
        }
        bool all_done = true;
        for (auto& f : fibers) all_done &= f.wait == kDone;
        if (all_done) return;
        for (unsigned w = 0; w * 32 < fibers.size(); ++w) progressed |= release(w * 32, 32, kWarp);
        for (unsigned b = 0; b < cluster_size; ++b) progressed |= release(b * block_size, block_size, kBlock);
        progressed |= release(0, static_cast<unsigned>(fibers.size()), kCluster);
        if (!progressed) {
            std::fprintf(stderr, "emulated kernel deadlocked in cluster at block (%u, %u, %u): divergent barrier or shuffle\n",
                         cluster_first_x, blockIdx.y, blockIdx.z);
            std::abort();
        }
    }
}
}  // namespace emu

// The thread block cluster helpers of common.cuh (whose PTX versions the loader drops).
#define LORALEDGER_CLUSTER(n)
inline unsigned cluster_rank() { return emu::rank_of(emu::current); }
inline void cluster_sync() { emu::yield(emu::kCluster); }
inline const float* cluster_peer(const float* p, unsigned rank) {
    const unsigned char* own = emu::block_smem();
    const auto offset = reinterpret_cast<const unsigned char*>(p) - own;
    if (offset < 0 || static_cast<size_t>(offset) >= emu::smem[emu::rank_of(emu::current)].size() || rank >= emu::cluster_size) {
        std::fprintf(stderr, "emulated kernel: cluster_peer of an address outside the block's dynamic shared memory\n");
        std::abort();
    }
    return reinterpret_cast<const float*>(emu::smem[rank].data() + offset);
}
inline void prefetch_l2(const void*) {}

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static  // blocks run one at a time, so one static copy is the block's shared memory

inline float __uint_as_float(unsigned u) { return std::bit_cast<float>(u); }
inline unsigned __float_as_uint(float f) { return std::bit_cast<unsigned>(f); }
inline float __int_as_float(int i) { return std::bit_cast<float>(i); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
template <class A, class B>
inline auto min(A a, B b) { return a < b ? a : b; }
template <class A, class B>
inline auto max(A a, B b) { return a < b ? b : a; }
inline float emu_h2f(unsigned short bits) { return static_cast<float>(std::bit_cast<_Float16>(bits)); }
inline unsigned short emu_f2h(float v) { return std::bit_cast<unsigned short>(static_cast<_Float16>(v)); }

inline void __syncthreads() { emu::yield(emu::kBlock); }
// Two slot buffers alternate between consecutive shuffles: a lane that runs ahead writes the other
// buffer, and cannot come back to this one before every lane has passed the next shuffle's barrier.
inline float __shfl_xor_sync(unsigned, float v, int o) {
    const unsigned me = emu::current, lane = me % 32, base = me - lane;
    float* buf = emu::shfl.data() + (emu::fibers[me].shuffles++ & 1) * emu::fibers.size();
    buf[me] = v;
    emu::yield(emu::kWarp);
    return buf[base + (lane ^ static_cast<unsigned>(o))];
}

template <typename... P, size_t... I>
void emu_call(void (*fn)(P...), void** args, std::index_sequence<I...>) {
    fn(*reinterpret_cast<std::remove_cv_t<std::remove_reference_t<P>>*>(args[I])...);
}

template <typename... P>
void emu_launch(void (*fn)(P...), dim3 grid, dim3 block, size_t smem_bytes, void** args, unsigned cluster) {
    static void (*kernel)(P...);
    static void** kernel_args;
    kernel = fn;
    kernel_args = args;
    emu::body = [] { emu_call(kernel, kernel_args, std::index_sequence_for<P...>{}); };
    gridDim = grid;
    blockDim = block;
    if (block.x % 32 != 0 && cluster > 1) {
        std::fprintf(stderr, "emulated kernel: cluster blocks must be whole warps\n");
        std::abort();
    }
    if (cluster == 0 || grid.x % cluster != 0) {
        std::fprintf(stderr, "emulated kernel: grid.x %u is not a multiple of the cluster size %u\n", grid.x, cluster);
        std::abort();
    }
    emu::block_size = block.x;
    emu::cluster_size = cluster;
    const size_t threads = static_cast<size_t>(block.x) * cluster;
    if (emu::fibers.size() != threads) {
        emu::fibers.assign(threads, emu::Fiber{});
        for (auto& f : emu::fibers) f.stack.resize(64 * 1024);
    }
    emu::shfl.assign(2 * threads, 0.0f);
    emu::smem.resize(cluster);
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; x += cluster) {
                blockIdx = dim3{x, y, z};
                emu::cluster_first_x = x;
                for (auto& m : emu::smem) m.assign(smem_bytes, 0xff);  // NaN-filled: reading shared memory nobody wrote shows
                for (auto& f : emu::fibers) {
                    f.wait = emu::kRunning;
                    f.shuffles = 0;
                    getcontext(&f.ctx);
                    f.ctx.uc_stack.ss_sp = f.stack.data();
                    f.ctx.uc_stack.ss_size = f.stack.size();
                    f.ctx.uc_link = nullptr;
                    makecontext(&f.ctx, emu::trampoline, 0);
                }
                emu::run_cluster();
            }
}
