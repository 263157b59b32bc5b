// Paged attention for decode: one query token per sequence attends to its context in the paged KV cache.
//
// A block serves one (sequence, KV head, pass of HP query heads, split of the context). GQA: the
// HP query heads of a KV head share every K/V row the block loads. Inside the block, "groups" of
// G lanes (G * EPL >= head_dim, each lane holding EPL consecutive elements) each take U tokens of
// a chunk of U * (groups per block) consecutive tokens. Decode attention is bound by reading the
// cache, so the loop is software-pipelined: the raw K/V rows of chunk c + 1 are requested before
// chunk c is used, 2 * U 16-byte loads per lane in flight, and the online softmax rescales once
// per chunk rather than once per token. Each group keeps its own flash-decoding state (running
// max m, sum l, unnormalised output acc), so the token loop has no block-wide synchronisation.
// Groups merge through shuffles, warps through shared memory. Long contexts are cut into splits
// (grid z); with more than one split the blocks write partial (m, l, acc) and
// paged_attention_reduce_kernel combines them.
//
// Scores are kept in the log2 domain (q is pre-multiplied by scale * log2(e)) so that every
// exponential is one exp2f. Softmax and accumulation are fp32.
#include "common.cuh"

constexpr int kAttnThreads = 128;
constexpr int kAttnWarps = kAttnThreads / 32;

// This lane's EPL elements [d0, d0 + EPL) of a head vector, zero past head_dim.
template <typename T, int EPL>
__device__ __forceinline__ void load_head_slice(const T* __restrict__ p, int d0, int head_dim, bool vec, float* out) {
    if (vec && d0 < head_dim) {
        load_floats<T, EPL>(p + d0, out);
    } else {
#pragma unroll
        for (int e = 0; e < EPL; ++e) out[e] = d0 + e < head_dim ? to_float(p[d0 + e]) : 0.0f;
    }
}

// A lane's EPL elements of one K or V row as loaded (not yet converted): whole 16-byte words, so
// that a row in flight costs sizeof(T) * EPL / 4 registers rather than EPL.
template <typename T, int EPL>
struct RowSlice {
    static constexpr int kWords = sizeof(T) * EPL / 16;
    static_assert(sizeof(T) * EPL % 16 == 0, "a lane's slice is whole 16-byte words");
    union {
        uint4 w[kWords];
        T v[EPL];
    } u;

    __device__ __forceinline__ void load(const T* __restrict__ p, int d0, int head_dim, bool vec) {
        if (vec && d0 < head_dim) {
#pragma unroll
            for (int i = 0; i < kWords; ++i) u.w[i] = reinterpret_cast<const uint4*>(p + d0)[i];
        } else {
#pragma unroll
            for (int e = 0; e < EPL; ++e) u.v[e] = d0 + e < head_dim ? p[d0 + e] : from_float<T>(0.0f);
        }
    }
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int i = 0; i < kWords; ++i) u.w[i] = uint4{0u, 0u, 0u, 0u};
    }
    __device__ __forceinline__ float at(int e) const { return to_float(u.v[e]); }
};

// q: [B, Hq, D] with row stride q_stride (heads and elements contiguous); caches: [blocks, BS, Hk, D]
// contiguous; block_tables: [B, max_blocks] int32 with row stride bt_stride; seq_lens: [B] int32.
// out: [B, Hq, D] contiguous (written when num_splits == 1); part_acc: [B, Hq, num_splits, D],
// part_ml: [B, Hq, num_splits, 2] (written when num_splits > 1).
// Grid: (Hk * passes, B, num_splits); block: kAttnThreads; dynamic shared memory:
// kAttnWarps * HP * (2 + G * EPL) floats.
template <typename T, int HP, int EPL, int U>
__global__ void __launch_bounds__(kAttnThreads) paged_attention_decode_kernel(
    T* __restrict__ out, float* __restrict__ part_acc, float* __restrict__ part_ml, const T* __restrict__ q,
    long long q_stride, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
    const int* __restrict__ block_tables, long long bt_stride, const int* __restrict__ seq_lens, int num_heads,
    int num_kv_heads, int head_dim, int log2_block_size, int log2_group, int window, int num_splits, int split_len,
    float scale_log2) {
    extern __shared__ float smem[];
    const int D = head_dim;
    const int qpk = num_heads / num_kv_heads;
    const int num_passes = (qpk + HP - 1) / HP;
    const int kv_head = blockIdx.x / num_passes;
    const int pass = blockIdx.x - kv_head * num_passes;
    const int b = blockIdx.y;
    const int split = blockIdx.z;
    const int head0 = kv_head * qpk + pass * HP;
    const int heads_here = min(HP, qpk - pass * HP);

    const int seq_len = seq_lens[b];
    const int ctx_start = window > 0 ? max(0, seq_len - window) : 0;
    const int p_begin = ctx_start + split * split_len;
    const int p_end = min(seq_len, p_begin + split_len);
    if (p_begin >= p_end) {
        if (num_splits == 1) {  // an empty context still defines the output (zeros)
            for (int i = threadIdx.x; i < heads_here * D; i += kAttnThreads) {
                out[(static_cast<long long>(b) * num_heads + head0) * D + i] = from_float<T>(0.0f);
            }
        }
        return;  // with several splits the reduce kernel counts only the non-empty ones
    }

    const int G = 1 << log2_group;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int d0 = (lane & (G - 1)) * EPL;
    const int num_groups = kAttnThreads >> log2_group;
    const int group = threadIdx.x >> log2_group;
    const bool vec = D % EPL == 0 && q_stride % EPL == 0 && is_aligned(q, 16) && is_aligned(k_cache, 16) &&
                     is_aligned(v_cache, 16);

    float qf[HP][EPL];
#pragma unroll
    for (int hh = 0; hh < HP; ++hh) {
        if (hh < heads_here) {
            load_head_slice<T, EPL>(q + b * q_stride + static_cast<long long>(head0 + hh) * D, d0, D, vec, qf[hh]);
#pragma unroll
            for (int e = 0; e < EPL; ++e) qf[hh][e] *= scale_log2;
        } else {
#pragma unroll
            for (int e = 0; e < EPL; ++e) qf[hh][e] = 0.0f;
        }
    }

    float m[HP], l[HP], acc[HP][EPL];
#pragma unroll
    for (int hh = 0; hh < HP; ++hh) {
        m[hh] = neg_inf();
        l[hh] = 0.0f;
#pragma unroll
        for (int e = 0; e < EPL; ++e) acc[hh][e] = 0.0f;
    }

    const int* table = block_tables + b * bt_stride;
    const int block_mask = (1 << log2_block_size) - 1;
    const long long row_elems = static_cast<long long>(num_kv_heads) * D;
    const int chunk = U * num_groups;
    // Token of (this group, u) in the chunk starting at `base`: base + u * num_groups + group.
    auto load_chunk = [&](int base, RowSlice<T, EPL>(&k)[U], RowSlice<T, EPL>(&v)[U]) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int p = base + u * num_groups + group;
            if (p < p_end) {
                const long long slot =
                    (static_cast<long long>(table[p >> log2_block_size]) << log2_block_size) + (p & block_mask);
                const long long off = slot * row_elems + static_cast<long long>(kv_head) * D;
                k[u].load(k_cache + off, d0, D, vec);
                v[u].load(v_cache + off, d0, D, vec);
            } else {
                k[u].zero();
                v[u].zero();
            }
        }
    };

    RowSlice<T, EPL> kc[U], vc[U], kn[U], vn[U];
    load_chunk(p_begin, kc, vc);
    // The trip count is block-uniform (the group shuffles need every lane): a group past the end idles.
    for (int base = p_begin; base < p_end; base += chunk) {
        if (base + chunk < p_end) load_chunk(base + chunk, kn, vn);
        float s[HP][U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float kf[EPL];
#pragma unroll
            for (int e = 0; e < EPL; ++e) kf[e] = kc[u].at(e);
#pragma unroll
            for (int hh = 0; hh < HP; ++hh) {
                float dot = 0.0f;
#pragma unroll
                for (int e = 0; e < EPL; ++e) dot = fmaf(qf[hh][e], kf[e], dot);
                s[hh][u] = dot;
            }
        }
#pragma unroll
        for (int hh = 0; hh < HP; ++hh)
#pragma unroll
            for (int u = 0; u < U; ++u) s[hh][u] = group_sum(s[hh][u], G);
        bool live[U];
#pragma unroll
        for (int u = 0; u < U; ++u) live[u] = base + u * num_groups + group < p_end;
#pragma unroll
        for (int hh = 0; hh < HP; ++hh) {
            float m_new = m[hh];
#pragma unroll
            for (int u = 0; u < U; ++u) m_new = live[u] ? fmaxf(m_new, s[hh][u]) : m_new;
            if (m_new == neg_inf()) continue;  // this group has seen no token yet
            const float alpha = exp2f(m[hh] - m_new);  // 0 while m is still -inf
            float lsum = l[hh] * alpha;
#pragma unroll
            for (int e = 0; e < EPL; ++e) acc[hh][e] *= alpha;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const float pr = live[u] ? exp2f(s[hh][u] - m_new) : 0.0f;
                lsum += pr;
#pragma unroll
                for (int e = 0; e < EPL; ++e) acc[hh][e] = fmaf(pr, vc[u].at(e), acc[hh][e]);
            }
            l[hh] = lsum;
            m[hh] = m_new;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            kc[u] = kn[u];
            vc[u] = vn[u];
        }
    }

    // Merge the groups of a warp: lanes o apart (o >= G) hold the same elements of different groups.
    for (int o = G; o < 32; o <<= 1) {
#pragma unroll
        for (int hh = 0; hh < HP; ++hh) {
            const float om = __shfl_xor_sync(0xffffffffu, m[hh], o);
            const float ol = __shfl_xor_sync(0xffffffffu, l[hh], o);
            const float mn = fmaxf(m[hh], om);
            const bool empty = mn == neg_inf();  // both sides saw no token
            const float a1 = empty ? 0.0f : exp2f(m[hh] - mn);
            const float a2 = empty ? 0.0f : exp2f(om - mn);
            l[hh] = l[hh] * a1 + ol * a2;
#pragma unroll
            for (int e = 0; e < EPL; ++e) {
                const float oa = __shfl_xor_sync(0xffffffffu, acc[hh][e], o);
                acc[hh][e] = acc[hh][e] * a1 + oa * a2;
            }
            m[hh] = mn;
        }
    }

    // Merge the warps through shared memory.
    const int dpad = G * EPL;
    float* s_m = smem;                     // [warps][HP]
    float* s_l = s_m + kAttnWarps * HP;    // [warps][HP]
    float* s_acc = s_l + kAttnWarps * HP;  // [warps][HP][dpad]
    if (lane < G) {
#pragma unroll
        for (int hh = 0; hh < HP; ++hh) {
            if (lane == 0) {
                s_m[warp * HP + hh] = m[hh];
                s_l[warp * HP + hh] = l[hh];
            }
#pragma unroll
            for (int e = 0; e < EPL; ++e) s_acc[(warp * HP + hh) * dpad + d0 + e] = acc[hh][e];
        }
    }
    __syncthreads();

    for (int i = threadIdx.x; i < heads_here * D; i += kAttnThreads) {
        const int hh = i / D;
        const int d = i - hh * D;
        float mx = neg_inf();
#pragma unroll
        for (int w = 0; w < kAttnWarps; ++w) mx = fmaxf(mx, s_m[w * HP + hh]);
        float lsum = 0.0f, a = 0.0f;
#pragma unroll
        for (int w = 0; w < kAttnWarps; ++w) {
            const float mw = s_m[w * HP + hh];
            if (mw == neg_inf()) continue;
            const float f = exp2f(mw - mx);
            lsum = fmaf(s_l[w * HP + hh], f, lsum);
            a = fmaf(s_acc[(w * HP + hh) * dpad + d], f, a);
        }
        const long long row = static_cast<long long>(b) * num_heads + head0 + hh;
        if (num_splits == 1) {
            out[row * D + d] = from_float<T>(lsum > 0.0f ? a / lsum : 0.0f);
        } else {
            const long long part = row * num_splits + split;
            part_acc[part * D + d] = a;  // relative to exp2(mx), like lsum
            if (d == 0) {
                part_ml[part * 2] = mx;
                part_ml[part * 2 + 1] = lsum;
            }
        }
    }
}

// Combines the splits of paged_attention_decode_kernel into out [B, Hq, D].
// Grid: (Hq, B); block: kAttnThreads; dynamic shared memory: num_splits floats.
template <typename T>
__global__ void __launch_bounds__(kAttnThreads) paged_attention_reduce_kernel(
    T* __restrict__ out, const float* __restrict__ part_acc, const float* __restrict__ part_ml,
    const int* __restrict__ seq_lens, int num_heads, int head_dim, int window, int num_splits, int split_len) {
    extern __shared__ float weight[];  // [num_splits]
    const int head = blockIdx.x;
    const int b = blockIdx.y;
    const int seq_len = seq_lens[b];
    const int ctx = window > 0 ? min(seq_len, window) : seq_len;
    const int live = ctx > 0 ? min(num_splits, (ctx + split_len - 1) / split_len) : 0;
    const long long row = static_cast<long long>(b) * num_heads + head;
    const float* ml = part_ml + row * num_splits * 2;
    const float* acc = part_acc + row * num_splits * head_dim;

    // Every thread scans the (few) split maxima itself: cheaper than a block reduction.
    float mx = neg_inf();
    for (int s = 0; s < live; ++s) mx = fmaxf(mx, ml[2 * s]);
    float lsum = 0.0f;
    for (int s = 0; s < live; ++s) lsum = fmaf(ml[2 * s + 1], exp2f(ml[2 * s] - mx), lsum);
    for (int s = threadIdx.x; s < live; s += kAttnThreads) weight[s] = exp2f(ml[2 * s] - mx) / lsum;
    __syncthreads();

    for (int d = threadIdx.x; d < head_dim; d += kAttnThreads) {
        float a = 0.0f;
        for (int s = 0; s < live; ++s) a = fmaf(weight[s], acc[s * head_dim + d], a);
        out[row * head_dim + d] = from_float<T>(a);
    }
}
