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

// ---- fused BGMV for decode on sm_90: shrink and expand in one launch, one cluster per token ----

constexpr int kFusedThreads = 128;
constexpr int kFusedCluster = 8;
constexpr int kFusedRows = 4;  // rows of A a warp reduces at once: kFusedRows * 2 loads in flight per lane

// partial[n] = sum over this block's K-slice of A[n, k] * xs[k], for every row n < N of the slot's A.
// a_rows: the slot's A at column k0 (row n at a_rows + n * K); xs: the slice of x, fp32, in shared memory.
template <typename T, int VEC>
__device__ __forceinline__ void fused_shrink(
    float* partial, const float* xs, const T* __restrict__ a_rows, long long K, int N, int R, int rank, int k_len) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    constexpr int kWarps = kFusedThreads / 32;
    const int num_vecs = k_len / VEC;  // k_len is a multiple of VEC on the packed path
    for (int n0 = warp * kFusedRows; n0 < N; n0 += kWarps * kFusedRows) {
        float acc[kFusedRows];
        bool live[kFusedRows];
        const T* row[kFusedRows];
#pragma unroll
        for (int r = 0; r < kFusedRows; ++r) {
            const int n = n0 + r;
            acc[r] = 0.0f;
            live[r] = n < N && n % R < rank;
            row[r] = a_rows + (live[r] ? n * K : 0);
        }
#pragma unroll 2
        for (int v = lane; v < num_vecs; v += 32) {
            float xv[VEC];
#pragma unroll
            for (int e = 0; e < VEC; ++e) xv[e] = xs[v * VEC + e];
#pragma unroll
            for (int r = 0; r < kFusedRows; ++r) {
                if (!live[r]) continue;
                float av[VEC];
                load_floats<T, VEC>(row[r] + v * VEC, av);
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[r] = fmaf(av[e], xv[e], acc[r]);
            }
        }
#pragma unroll
        for (int r = 0; r < kFusedRows; ++r) {
            const float s = warp_sum(acc[r]);
            if (lane == 0 && n0 + r < N) partial[n0 + r] = s;
        }
    }
}

// y[c] += sum_{r < rank} h[m * R + r] * B[c, r] for this block's columns c (slice m holds c).
template <typename T, int VEC>
__device__ __forceinline__ void fused_expand(
    T* __restrict__ y_row, const float* h, const T* __restrict__ b_slot, const int* __restrict__ slice_offsets,
    int n_slices, int R, int rank, int c0, int c_len) {
#pragma unroll 2
    for (int j = threadIdx.x; j < c_len; j += kFusedThreads) {
        const int col = c0 + j;
        int m = 0;
        while (m + 1 < n_slices && col >= slice_offsets[m + 1]) ++m;
        const float* hm = h + m * R;
        const T* b_row = b_slot + static_cast<long long>(col) * R;
        float acc = 0.0f;
        for (int r0 = 0; r0 < rank; r0 += VEC) {
            float bv[VEC];
            load_floats<T, VEC>(b_row + r0, bv);
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc = r0 + e < rank ? fmaf(bv[e], hm[r0 + e], acc) : acc;
        }
        y_row[col] = from_float<T>(to_float(y_row[col]) + acc);
    }
}

// y[t] += B[slot] @ (A[slot] @ x[t]) for one token per cluster of kFusedCluster blocks: block c
// shrinks the c-th slice of the K inputs into a partial h, the cluster adds the partials up through
// distributed shared memory, and block c expands into the c-th slice of the output columns. The
// token's whole A and B are in flight at once over 8 SMs (its B rows and y are requested into L2
// before the shrink), where the two-kernel path pays a second launch and a pass through h.
// h stays fp32 between the two halves.
// x: [T, K] with row stride x_stride; a: [S, N, K] (N = n_slices * R); b: [S, out_total, R];
// y: [T, out_total] with row stride y_stride; slice_offsets: [n_slices + 1] int32 on the device;
// slot_ranks as for lora_shrink_kernel. packed: bit 0, A rows are read in 16-byte packs (K and
// k_slice multiples of 16 / sizeof(T), a aligned); bit 1, B rows too (R a multiple, b aligned).
// Grid: (T * kFusedCluster); block: kFusedThreads; dynamic shared memory: (k_slice + 2 * N) floats.
template <typename T>
__global__ void LORALEDGER_CLUSTER(kFusedCluster) __launch_bounds__(kFusedThreads) lora_bgmv_fused_kernel(
    T* __restrict__ y, long long y_stride, const T* __restrict__ x, long long x_stride, const T* __restrict__ a,
    const T* __restrict__ b, const int* __restrict__ token_slots, const int* __restrict__ slot_ranks,
    const int* __restrict__ slice_offsets, int K, int N, int R, int n_slices, int out_total, int k_slice,
    int col_slice, int packed) {
    extern __shared__ float fused_smem[];
    float* xs = fused_smem;         // [k_slice]: this block's slice of x
    float* partial = xs + k_slice;  // [N]: its share of h, read by the whole cluster
    float* h = partial + N;         // [N]: the token's h
    constexpr int kVec = 16 / sizeof(T);
    const int c = static_cast<int>(cluster_rank());
    const int t = blockIdx.x / kFusedCluster;
    const int slot = token_slots[t];
    if (slot < 0) return;  // the cluster serves one token: all of its blocks leave together
    const int rank = slot_ranks != nullptr ? min(slot_ranks[slot], R) : R;
    const int k0 = c * k_slice;
    const int k_len = max(0, min(K, k0 + k_slice) - k0);
    const int c0 = c * col_slice;
    const int c_len = max(0, min(out_total, c0 + col_slice) - c0);
    const T* b_slot = b + static_cast<long long>(slot) * out_total * R;
    T* y_row = y + static_cast<long long>(t) * y_stride;

    const char* b_bytes = reinterpret_cast<const char*>(b_slot + static_cast<long long>(c0) * R);
    for (long long off = threadIdx.x * 128LL; off < static_cast<long long>(c_len) * R * sizeof(T);
         off += kFusedThreads * 128LL) {
        prefetch_l2(b_bytes + off);
    }
    for (int off = threadIdx.x * 128; off < c_len * static_cast<int>(sizeof(T)); off += kFusedThreads * 128) {
        prefetch_l2(reinterpret_cast<const char*>(y_row + c0) + off);
    }

    const T* x_row = x + static_cast<long long>(t) * x_stride + k0;
    for (int i = threadIdx.x; i < k_len; i += kFusedThreads) xs[i] = to_float(x_row[i]);
    __syncthreads();
    const T* a_rows = a + static_cast<long long>(slot) * N * K + k0;
    if (packed & 1) {
        fused_shrink<T, kVec>(partial, xs, a_rows, K, N, R, rank, k_len);
    } else {
        fused_shrink<T, 1>(partial, xs, a_rows, K, N, R, rank, k_len);
    }

    cluster_sync();
    for (int n = threadIdx.x; n < N; n += kFusedThreads) {
        float s = 0.0f;
#pragma unroll
        for (int r = 0; r < kFusedCluster; ++r) s += cluster_peer(partial, r)[n];
        h[n] = s;
    }
    cluster_sync();  // every peer has read this block's partials (it may exit), and h is visible here

    if (packed & 2) {
        fused_expand<T, kVec>(y_row, h, b_slot, slice_offsets, n_slices, R, rank, c0, c_len);
    } else {
        fused_expand<T, 1>(y_row, h, b_slot, slice_offsets, n_slices, R, rank, c0, c_len);
    }
}
