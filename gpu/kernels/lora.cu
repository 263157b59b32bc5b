// Batched multi-LoRA: shrink (h = x @ A^T) and expand (y += h @ B^T) for every token's adapter slot.
//
// Both kernels work on "tiles": runs of consecutive tokens that share one slot. BGMV (decode)
// is the case of one token per tile and needs no table: tile i is token i. SGMV (prefill) gets
// a tile table from lora_prepare (tile_starts, an indptr over tokens; tiles never cross a slot
// change and hold at most TOKS tokens), so that each A / B row loaded serves TOKS tokens.
// Slot -1 means no adapter: shrink writes zeros, expand leaves y alone. Accumulation is fp32.
//
// slot_ranks (optional, [S] int32): rows r >= slot_ranks[slot] of each rank block are known to be
// zero padding and are skipped (shrink writes 0 for them). Null: every slot uses the full R.
#include "common.cuh"

constexpr int kShrinkThreads = 128;
constexpr int kExpandThreads = 256;

__device__ __forceinline__ void tile_bounds(const int* __restrict__ tile_starts, int num_tokens, int& t0, int& count) {
    if (tile_starts == nullptr) {
        t0 = blockIdx.x;
        count = 1;
    } else {
        t0 = tile_starts[blockIdx.x];
        count = min(tile_starts[blockIdx.x + 1], num_tokens) - t0;
    }
}

// acc[j][r] += sum over this thread's K-range of A[row r] . x[token j], VEC elements at a time.
template <typename T, int TOKS, int ROWS, int VEC>
__device__ __forceinline__ void shrink_accumulate(
    float (&acc)[TOKS][ROWS], const T* __restrict__ x, long long x_stride, const T* const (&a_rows)[ROWS],
    const bool (&row_live)[ROWS], int t0, int count, int K) {
    const int num_vecs = K / VEC;
    // BGMV has few loads per iteration, so it unrolls 4x for more bytes in flight (2x measured 48 %
    // of copy bandwidth on an H100 for 64 tokens x 64 adapters at K = 4096); SGMV already
    // issues TOKS + ROWS loads per iteration and needs its registers for the accumulators.
#pragma unroll(TOKS == 1 ? 4 : 1)
    for (int v = threadIdx.x; v < num_vecs; v += kShrinkThreads) {
        const int k = v * VEC;
        float xv[TOKS][VEC];
#pragma unroll
        for (int j = 0; j < TOKS; ++j) {
            if (j < count) {
                load_floats<T, VEC>(x + (t0 + j) * x_stride + k, xv[j]);
            } else {
#pragma unroll
                for (int e = 0; e < VEC; ++e) xv[j][e] = 0.0f;
            }
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            if (!row_live[r]) continue;
            float av[VEC];
            load_floats<T, VEC>(a_rows[r] + k, av);
#pragma unroll
            for (int j = 0; j < TOKS; ++j) {
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[j][r] = fmaf(av[e], xv[j][e], acc[j][r]);
            }
        }
    }
}

// h[t, n] = sum_k A[slot, n, k] * x[t, k] for the ROWS rows n0.. of grid column blockIdx.y.
// x: [T, K] with row stride x_stride; a: [S, N, K] contiguous; h: [T, N] contiguous.
// Grid: (num_tiles, ceil(N / ROWS)); block: kShrinkThreads.
template <typename T, int TOKS, int ROWS>
__global__ void __launch_bounds__(kShrinkThreads) lora_shrink_kernel(
    T* __restrict__ h, const T* __restrict__ x, long long x_stride, const T* __restrict__ a,
    const int* __restrict__ token_slots, const int* __restrict__ tile_starts, const int* __restrict__ slot_ranks,
    int num_tokens, int K, int N, int R) {
    constexpr int kVec = 16 / sizeof(T);
    constexpr int kWarps = kShrinkThreads / 32;
    __shared__ float partial[kWarps][TOKS * ROWS];

    int t0, count;
    tile_bounds(tile_starts, num_tokens, t0, count);
    if (count <= 0) return;
    const int slot = token_slots[t0];
    const int n0 = blockIdx.y * ROWS;
    const int rank = (slot >= 0 && slot_ranks != nullptr) ? slot_ranks[slot] : R;

    const T* a_rows[ROWS];
    bool row_live[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int n = n0 + r;
        row_live[r] = slot >= 0 && n < N && (n % R) < rank;
        a_rows[r] = row_live[r] ? a + (static_cast<long long>(slot) * N + n) * K : a;
    }

    float acc[TOKS][ROWS];
#pragma unroll
    for (int j = 0; j < TOKS; ++j)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[j][r] = 0.0f;

    if (slot >= 0) {
        // One pointer test per block: every row start is aligned when x, a, K and the stride are.
        const bool vec = K % kVec == 0 && x_stride % kVec == 0 && is_aligned(x, 16) && is_aligned(a, 16);
        if (vec) {
            shrink_accumulate<T, TOKS, ROWS, kVec>(acc, x, x_stride, a_rows, row_live, t0, count, K);
        } else {
            shrink_accumulate<T, TOKS, ROWS, 1>(acc, x, x_stride, a_rows, row_live, t0, count, K);
        }
    }

    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
#pragma unroll
    for (int j = 0; j < TOKS; ++j) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float s = warp_sum(acc[j][r]);
            if (lane == 0) partial[warp][j * ROWS + r] = s;
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < TOKS * ROWS; i += kShrinkThreads) {
        const int j = i / ROWS;
        const int n = n0 + i % ROWS;
        if (j >= count || n >= N) continue;
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) s += partial[w][i];
        h[static_cast<long long>(t0 + j) * N + n] = from_float<T>(s);
    }
}

// y[t, c] += sum_{r < rank} h[t, m*R + r] * B[slot, c, r] for the columns c of slice m = blockIdx.z.
// h: [T, n_slices*R] contiguous; b: [S, out_total, R] contiguous; y: [T, out_total] with row stride
// y_stride; slice_offsets: [n_slices + 1] int32 on the device.
// Grid: (num_tiles, ceil(widest slice / kExpandThreads), n_slices); block: kExpandThreads;
// dynamic shared memory: TOKS * R floats.
template <typename T, int TOKS>
__global__ void lora_expand_kernel(
    T* __restrict__ y, long long y_stride, const T* __restrict__ h, const T* __restrict__ b,
    const int* __restrict__ token_slots, const int* __restrict__ tile_starts, const int* __restrict__ slot_ranks,
    const int* __restrict__ slice_offsets, int num_tokens, int n_slices, int R, int out_total) {
    constexpr int kVec = 16 / sizeof(T);
    extern __shared__ float h_tile[];  // [TOKS][R]: the tile's rank-R slice-m activations

    int t0, count;
    tile_bounds(tile_starts, num_tokens, t0, count);
    if (count <= 0) return;
    const int slot = token_slots[t0];
    if (slot < 0) return;  // whole tile is base-model tokens
    const int m = blockIdx.z;
    const int rank = slot_ranks != nullptr ? min(slot_ranks[slot], R) : R;
    const int hcols = n_slices * R;

    for (int i = threadIdx.x; i < TOKS * R; i += kExpandThreads) {
        const int j = i / R;
        const int r = i % R;
        h_tile[i] = j < count ? to_float(h[static_cast<long long>(t0 + j) * hcols + m * R + r]) : 0.0f;
    }
    __syncthreads();

    const int col = slice_offsets[m] + blockIdx.y * kExpandThreads + threadIdx.x;
    if (col >= slice_offsets[m + 1] || col >= out_total) return;

    const T* b_row = b + (static_cast<long long>(slot) * out_total + col) * R;
    float acc[TOKS];
#pragma unroll
    for (int j = 0; j < TOKS; ++j) acc[j] = 0.0f;

    if (R % kVec == 0 && is_aligned(b, 16)) {
        // rank may stop inside a pack: the lanes past it are masked, the pack itself is in bounds (R)
#pragma unroll 4
        for (int r0 = 0; r0 < rank; r0 += kVec) {
            float bv[kVec];
            load_floats<T, kVec>(b_row + r0, bv);
#pragma unroll
            for (int e = 0; e < kVec; ++e) {
                if (r0 + e >= rank) bv[e] = 0.0f;
#pragma unroll
                for (int j = 0; j < TOKS; ++j) acc[j] = fmaf(bv[e], h_tile[j * R + r0 + e], acc[j]);
            }
        }
    } else {
        for (int r = 0; r < rank; ++r) {
            const float bv = to_float(b_row[r]);
#pragma unroll
            for (int j = 0; j < TOKS; ++j) acc[j] = fmaf(bv, h_tile[j * R + r], acc[j]);
        }
    }

#pragma unroll
    for (int j = 0; j < TOKS; ++j) {
        if (j < count) {
            T* out = y + static_cast<long long>(t0 + j) * y_stride + col;
            *out = from_float<T>(to_float(*out) + acc[j]);
        }
    }
}
