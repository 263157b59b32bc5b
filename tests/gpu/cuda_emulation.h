// CPU emulation of the CUDA execution model, so that the kernels' logic is tested without a GPU.
//
// Blocks run one after another; each CUDA thread of a block is a fiber (ucontext) on one OS thread,
// and __syncthreads / warp shuffles are cooperative barriers released once every live thread of the
// block / warp waits there. A barrier that can never be released (a divergent __syncthreads or
// shuffle, a bug on a real GPU too) aborts with a message. Shared memory starts NaN-filled. Built
// with -fsanitize=alignment, a vector load on a misaligned address aborts as it would fault on a GPU.
// Not emulated: memory ordering between threads (blocks never communicate in these kernels).
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
enum Wait { kRunning, kBlock, kWarp, kDone };
struct Fiber {
    ucontext_t ctx;
    std::vector<char> stack;
    Wait wait = kRunning;
    unsigned long shuffles = 0;
};
inline ucontext_t scheduler;
inline std::vector<Fiber> fibers;
inline std::vector<float> shfl;
inline std::vector<unsigned char> smem;
inline void (*body)() = nullptr;

inline void yield(Wait why) {
    Fiber& f = fibers[threadIdx.x];
    f.wait = why;
    swapcontext(&f.ctx, &scheduler);
}
inline void trampoline() {
    body();
    yield(kDone);
}
// Runs the block's fibers until all are done, releasing barriers once every live participant waits.
inline void run_block() {
    for (;;) {
        bool progressed = false;
        for (unsigned t = 0; t < fibers.size(); ++t) {
            if (fibers[t].wait != kRunning) continue;
            threadIdx = dim3{t, 0, 0};
            swapcontext(&scheduler, &fibers[t].ctx);
            progressed = true;
        }
        bool all_done = true, all_block = true;
        for (auto& f : fibers) {
            all_done &= f.wait == kDone;
            all_block &= f.wait == kBlock || f.wait == kDone;
        }
        if (all_done) return;
        for (unsigned w = 0; w * 32 < fibers.size(); ++w) {
            bool any = false, all = true;
            for (unsigned t = w * 32; t < w * 32 + 32; ++t) {
                any |= fibers[t].wait == kWarp;
                all &= fibers[t].wait == kWarp || fibers[t].wait == kDone;
            }
            if (any && all) {
                for (unsigned t = w * 32; t < w * 32 + 32; ++t) {
                    if (fibers[t].wait == kDone) {
                        std::fprintf(stderr, "emulated kernel: full-warp shuffle after lane %u exited\n", t);
                        std::abort();
                    }
                }
                for (unsigned t = w * 32; t < w * 32 + 32; ++t)
                    if (fibers[t].wait == kWarp) fibers[t].wait = kRunning;
                progressed = true;
            }
        }
        if (all_block) {
            for (auto& f : fibers)
                if (f.wait == kBlock) f.wait = kRunning;
            progressed = true;
        }
        if (!progressed) {
            std::fprintf(stderr, "emulated kernel deadlocked in block (%u, %u, %u): divergent barrier or shuffle\n",
                         blockIdx.x, blockIdx.y, blockIdx.z);
            std::abort();
        }
    }
}
}  // namespace emu

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
    const unsigned lane = threadIdx.x % 32, base = threadIdx.x - lane;
    float* buf = emu::shfl.data() + (emu::fibers[threadIdx.x].shuffles++ & 1) * emu::fibers.size();
    buf[threadIdx.x] = v;
    emu::yield(emu::kWarp);
    return buf[base + (lane ^ static_cast<unsigned>(o))];
}

template <typename... P, size_t... I>
void emu_call(void (*fn)(P...), void** args, std::index_sequence<I...>) {
    fn(*reinterpret_cast<std::remove_cv_t<std::remove_reference_t<P>>*>(args[I])...);
}

template <typename... P>
void emu_launch(void (*fn)(P...), dim3 grid, dim3 block, size_t smem_bytes, void** args) {
    static void (*kernel)(P...);
    static void** kernel_args;
    kernel = fn;
    kernel_args = args;
    emu::body = [] { emu_call(kernel, kernel_args, std::index_sequence_for<P...>{}); };
    gridDim = grid;
    blockDim = block;
    if (emu::fibers.size() != block.x) {
        emu::fibers.assign(block.x, emu::Fiber{});
        for (auto& f : emu::fibers) f.stack.resize(64 * 1024);
    }
    emu::shfl.assign(2 * block.x, 0.0f);
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                blockIdx = dim3{x, y, z};
                emu::smem.assign(smem_bytes, 0xff);  // NaN-filled: reading shared memory nobody wrote shows
                for (auto& f : emu::fibers) {
                    f.wait = emu::kRunning;
                    f.shuffles = 0;
                    getcontext(&f.ctx);
                    f.ctx.uc_stack.ss_sp = f.stack.data();
                    f.ctx.uc_stack.ss_size = f.stack.size();
                    f.ctx.uc_link = nullptr;
                    makecontext(&f.ctx, emu::trampoline, 0);
                }
                emu::run_block();
            }
}
