/* Decode attention on the CPU over the paged KV cache, read in place: for each sequence b and query head h (KV head
   g = h / (Hq / Hk)), out[b, h] = softmax(scale * q[b, h] . K[b, g, start:len]) V[b, g, start:len], the keys and
   values read block by block through the sequence's block table. One pass over each block serves every query head
   (a key row holds all KV heads side by side, so the reads stream); the softmax is the online one (a running maximum
   and sum, fp32), so nothing is gathered, padded or masked. Plain C with GCC (12 or later) / Clang vector extensions
   and __builtin_shufflevector (VL lanes, lowered to the CPU it is built on). The prefill of a short context runs
   here too, each query row a "sequence" over its own causal prefix (TorchOps.prefill_attention). Layouts, numerics
   and how it is built and called: gpu/attention_cpu_kernel.py (its torch twin: TorchOps.gathered_attention_decode). */
#include "cpu_vectors.h"

/* Every cache line of one block's K and V rows (`bytes` each), fetched ahead. A decode step reads a layer's cache
   after the rest of the step has streamed the weights through the caches, so its K and V come from DRAM, block by
   scattered block: with the hardware prefetcher alone, a call of 24 sequences x 88 keys took 295 us cold against 125
   hot. The kernel fetches the next block while it reads this one (the next sequence's first after a sequence's
   last), each query head issuing its share of the lines (a burst of all of them stalled on the miss buffers): 232-246
   us cold. */
static inline void fetch_block(const char *k, const char *v, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) {
        __builtin_prefetch(k + o);
        __builtin_prefetch(v + o);
    }
}

/* a where a > b, else b (a NaN in a gives b) */
static inline vf greater(vf a, vf b) {
    const vi m = a > b;
    return (vf)(((vi)a & m) | ((vi)b & ~m));
}
#if defined(HAVE_SUMS_OF)
/* the sum and the maximum of one vector's lanes, halving it log2 VL times (a chain of VL - 1 scalar operations
   otherwise); the maximum of lanes that hold a NaN is one of the others */
#if VL == 16
#define FOLD8(v) __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15)
#define FOLD4(v) __builtin_shufflevector(v, v, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7)
#define FOLD2(v) __builtin_shufflevector(v, v, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3)
#else
#define FOLD8(v) (v)
#define FOLD4(v) __builtin_shufflevector(v, v, 4, 5, 6, 7, 4, 5, 6, 7)
#define FOLD2(v) __builtin_shufflevector(v, v, 2, 3, 2, 3, 2, 3, 2, 3)
#endif
static inline float sum_of(vf v) {
#if VL == 16
    v += FOLD8(v);
#endif
    v += FOLD4(v);
    v += FOLD2(v);
    return v[0] + v[1];
}
static inline float max_of(vf v) {
    vf u;
#if VL == 16
    u = FOLD8(v);
    v = greater(u, v);
#endif
    u = FOLD4(v);
    v = greater(u, v);
    u = FOLD2(v);
    v = greater(u, v);
    return v[1] > v[0] ? v[1] : v[0];
}

#else
/* compilers without __builtin_shufflevector (GCC before 12): the same sums and maxima, one lane at a time (the
   maximum is only ever taken of lanes that hold no NaN); sums_of's fallback is cpu_vectors.h's */
static inline float sum_of(vf v) { return hsum(v); }
static inline float max_of(vf v) { return hmax(v); }
#endif

/* One sequence for element type T: LDV / LD1 load VL / 1 elements as fp32, ST1 stores one fp32 as T. q: its hq
   query rows (q_head apart); out: hq rows of d. Each cache block is read K then V (a key row holds every KV head side
   by side; a block's rows stay in L1 while each query head of a group reads them): a query head's scores for VL
   rows at a time, their dot products summed across lanes by sums_of; then each head's weighted sum of V, one
   vector of its output at a time held in a register across the block's rows. The query heads' running maxima,
   sums and outputs stay in scratch: 2 * hq * d + hq * bs16 + 2 * hq floats, bs16 = bs rounded up to 16. */
#define ATTN_SEQ(NAME, T, LDV, LD1, ST1)                                                                              \
static void NAME(const T *q, int64_t q_head, const T *kc, const T *vc, int64_t bs, int64_t hk, int64_t d,            \
                 const int32_t *table, int64_t start, int64_t len, int64_t hq, float scale, float softcap, T *out,    \
                 float *scratch, int64_t next_block)                                                                 \
{                                                                                                                    \
    const int64_t dv = d & ~(int64_t)(VL - 1), bs16 = (bs + 15) & ~(int64_t)15, row = hk * d, group = hq / hk;       \
    const int64_t block_bytes = bs * row * (int64_t)sizeof(T), share = (block_bytes / 64 + hq - 1) / hq * 64;        \
    float *qf = scratch, *acc = qf + hq * d, *sc = acc + hq * d, *m = sc + hq * bs16, *l = m + hq;                   \
    const float pre = softcap > 0.0f ? scale / softcap : scale;                                                      \
    for (int64_t h = 0; h < hq; h++) {                                                                               \
        for (int64_t k = 0; k < d; k++) qf[h * d + k] = LD1(q + h * q_head + k) * pre;                               \
        for (int64_t k = 0; k < d; k++) acc[h * d + k] = 0.0f;                                                       \
        m[h] = -INFINITY;                                                                                            \
        l[h] = 0.0f;                                                                                                 \
    }                                                                                                                \
    for (int64_t blk = start / bs; blk * bs < len; blk++) {                                                          \
        const int64_t j0 = start > blk * bs ? start - blk * bs : 0, j1 = len - blk * bs < bs ? len - blk * bs : bs;  \
        const T *kb = kc + (int64_t)table[blk] * bs * row, *vb = vc + (int64_t)table[blk] * bs * row;                \
        /* the next block of this sequence, or after its last the next sequence's first (next_block; -1: none) */  \
        const int64_t ahead = (blk + 1) * bs < len ? (int64_t)table[blk + 1] : next_block;                           \
        const char *kn = ahead >= 0 ? (const char *)(kc + ahead * bs * row) : 0;                                     \
        const char *vn = ahead >= 0 ? (const char *)(vc + ahead * bs * row) : 0;                                     \
        for (int64_t h = 0; h < hq; h++) {                                                                           \
            for (int64_t o = h * share; kn && o < (h + 1) * share && o < block_bytes; o += 64) /* next K: a share */ \
                __builtin_prefetch(kn + o);                                                                          \
            const float *qh = qf + h * d;                                                                            \
            const T *kg = kb + (h / group) * d;                                                                      \
            float *sh = sc + h * bs16;                                                                               \
            for (int64_t jj = 0; jj < bs16; jj += VL) {                                                              \
                if (jj >= j1 || jj + VL <= j0) { /* no row of this group counts */                                   \
                    st_f32(sh + jj, broadcast(-INFINITY));                                                           \
                    continue;                                                                                        \
                }                                                                                                    \
                const T *kr[VL]; /* a row outside [j0, j1) reads row j0 (in the block) and is masked below */        \
                vf c[VL];                                                                                            \
                for (int r = 0; r < VL; r++) {                                                                       \
                    const int64_t j = jj + r;                                                                        \
                    kr[r] = kg + (j >= j0 && j < j1 ? j : j0) * row;                                                 \
                    c[r] = broadcast(0.0f);                                                                          \
                }                                                                                                    \
                for (int64_t k = 0; k < dv; k += VL) {                                                               \
                    const vf qv = ld_f32(qh + k);                                                                    \
                    for (int r = 0; r < VL; r++) c[r] += qv * LDV(kr[r] + k);                                        \
                }                                                                                                    \
                vf s = sums_of(c);                                                                                   \
                for (int64_t k = dv; k < d; k++)                                                                     \
                    for (int r = 0; r < VL; r++) s[r] += qh[k] * LD1(kr[r] + k);                                     \
                if (softcap > 0.0f)                                                                                  \
                    for (int r = 0; r < VL; r++) s[r] = softcap * tanhf(s[r]);                                       \
                if (jj < j0 || jj + VL > j1)                                                                         \
                    for (int r = 0; r < VL; r++)                                                                     \
                        if (jj + r < j0 || jj + r >= j1) s[r] = -INFINITY;                                           \
                st_f32(sh + jj, s);                                                                                  \
            }                                                                                                        \
        }                                                                                                            \
        for (int64_t h = 0; h < hq; h++) {                                                                           \
            for (int64_t o = h * share; vn && o < (h + 1) * share && o < block_bytes; o += 64) /* next V: a share */ \
                __builtin_prefetch(vn + o);                                                                          \
            float *sh = sc + h * bs16, bm = -INFINITY;                                                               \
            vf vm = broadcast(-INFINITY);                                                                            \
            for (int64_t j = 0; j < bs16; j += VL) {                                                                 \
                const vf v = ld_f32(sh + j);                                                                         \
                vm = greater(v, vm); /* a NaN score is skipped here; the softmax below keeps it */                    \
            }                                                                                                        \
            bm = max_of(vm);                                                                                         \
            if (bm == -INFINITY) {                                                                                   \
                int nan = 0;                                                                                         \
                for (int64_t j = j0; j < j1; j++) nan |= sh[j] != sh[j];                                             \
                if (!nan) { /* every score -inf: no key of this block counts, it adds nothing */                    \
                    for (int64_t j = 0; j < bs16; j++) sh[j] = 0.0f;                                                 \
                    continue;                                                                                        \
                }                                                                                                    \
            }                                                                                                        \
            if (bm > m[h]) {                                                                                         \
                const float alpha = expf(m[h] - bm);                                                                 \
                l[h] *= alpha;                                                                                       \
                for (int64_t k = 0; k < d; k++) acc[h * d + k] *= alpha;                                             \
                m[h] = bm;                                                                                           \
            }                                                                                                        \
            vf sum = broadcast(0.0f);                                                                                \
            for (int64_t j = 0; j < bs16; j += VL) {                                                                 \
                const vf p = vexp(ld_f32(sh + j) - m[h]);                                                          \
                st_f32(sh + j, p);                                                                                   \
                sum += p;                                                                                            \
            }                                                                                                        \
            l[h] += sum_of(sum);                                                                                     \
        }                                                                                                            \
        for (int64_t h = 0; h < hq; h++) {                                                                           \
            const T *vg = vb + (h / group) * d;                                                                      \
            const float *ph = sc + h * bs16;                                                                         \
            float *ah = acc + h * d;                                                                                 \
            int64_t k = 0;                                                                                           \
            if (h % group + 1 < group && d % (4 * VL) == 0) { /* two heads of one KV head: one V load, 8 sums */  \
                const float *pi = ph + bs16;                                                                         \
                float *ai = ah + d;                                                                                  \
                for (; k + 4 * VL <= dv; k += 4 * VL) {                                                              \
                    vf a0 = ld_f32(ah + k), a1 = ld_f32(ah + k + VL), a2 = ld_f32(ah + k + 2 * VL),                 \
                       a3 = ld_f32(ah + k + 3 * VL), b0 = ld_f32(ai + k), b1 = ld_f32(ai + k + VL),                 \
                       b2 = ld_f32(ai + k + 2 * VL), b3 = ld_f32(ai + k + 3 * VL);                                   \
                    for (int64_t j = j0; j < j1; j++) {                                                              \
                        const T *vr = vg + j * row + k;                                                              \
                        const vf p = broadcast(ph[j]), p2 = broadcast(pi[j]);                                        \
                        const vf v0 = LDV(vr), v1 = LDV(vr + VL), v2 = LDV(vr + 2 * VL), v3 = LDV(vr + 3 * VL);     \
                        a0 += p * v0;                                                                                \
                        a1 += p * v1;                                                                                \
                        a2 += p * v2;                                                                                \
                        a3 += p * v3;                                                                                \
                        b0 += p2 * v0;                                                                               \
                        b1 += p2 * v1;                                                                               \
                        b2 += p2 * v2;                                                                               \
                        b3 += p2 * v3;                                                                               \
                    }                                                                                                \
                    st_f32(ah + k, a0);                                                                              \
                    st_f32(ah + k + VL, a1);                                                                         \
                    st_f32(ah + k + 2 * VL, a2);                                                                     \
                    st_f32(ah + k + 3 * VL, a3);                                                                     \
                    st_f32(ai + k, b0);                                                                              \
                    st_f32(ai + k + VL, b1);                                                                         \
                    st_f32(ai + k + 2 * VL, b2);                                                                     \
                    st_f32(ai + k + 3 * VL, b3);                                                                     \
                }                                                                                                    \
                h++; /* both heads done */                                                                           \
                continue;                                                                                            \
            }                                                                                                        \
            for (; k + 4 * VL <= dv; k += 4 * VL) { /* four independent sums: one chain would wait on each add */   \
                vf a0 = ld_f32(ah + k), a1 = ld_f32(ah + k + VL), a2 = ld_f32(ah + k + 2 * VL),                     \
                   a3 = ld_f32(ah + k + 3 * VL);                                                                     \
                for (int64_t j = j0; j < j1; j++) {                                                                  \
                    const T *vr = vg + j * row + k;                                                                  \
                    const vf p = broadcast(ph[j]);                                                                   \
                    a0 += p * LDV(vr);                                                                               \
                    a1 += p * LDV(vr + VL);                                                                          \
                    a2 += p * LDV(vr + 2 * VL);                                                                      \
                    a3 += p * LDV(vr + 3 * VL);                                                                      \
                }                                                                                                    \
                st_f32(ah + k, a0);                                                                                  \
                st_f32(ah + k + VL, a1);                                                                             \
                st_f32(ah + k + 2 * VL, a2);                                                                         \
                st_f32(ah + k + 3 * VL, a3);                                                                         \
            }                                                                                                        \
            for (; k < dv; k += VL) {                                                                                \
                vf a = ld_f32(ah + k);                                                                               \
                for (int64_t j = j0; j < j1; j++) a += ph[j] * LDV(vg + j * row + k);                                \
                st_f32(ah + k, a);                                                                                   \
            }                                                                                                        \
            for (k = dv; k < d; k++) {                                                                               \
                float a = ah[k];                                                                                     \
                for (int64_t j = j0; j < j1; j++) a += ph[j] * LD1(vg + j * row + k);                                \
                ah[k] = a;                                                                                           \
            }                                                                                                        \
        }                                                                                                            \
    }                                                                                                                \
    for (int64_t h = 0; h < hq; h++) {                                                                               \
        const float inv = 1.0f / l[h];                                                                               \
        for (int64_t k = 0; k < d; k++) ST1(out + h * d + k, acc[h * d + k] * inv);                                  \
    }                                                                                                                \
}

ATTN_SEQ(attend_f32, float, ld_f32, ld1_f32, st1_f32)
ATTN_SEQ(attend_bf16, uint16_t, ld_bf16, ld1_bf16, st1_bf16)

/* the first position a sequence of `len` tokens attends to: its sliding window's start (window <= 0: none) */
static inline int64_t window_start(int64_t len, int64_t window) {
    return window > 0 && len > window ? len - window : 0;
}

/* Whether every block the batch reads is in [0, num_blocks) and every length in [1, max_blocks * bs]: the kernel
   reads nothing outside the cache. Returns 0 when they are, else the first sequence that is not, plus one. */
static int64_t check(const int32_t *tables, int64_t table_stride, int64_t max_blocks, const int32_t *lens,
                     int64_t batch, int64_t bs, int64_t num_blocks, int64_t window) {
    for (int64_t b = 0; b < batch; b++) {
        const int64_t len = lens[b];
        if (len < 1 || len > max_blocks * bs) return b + 1;
        for (int64_t blk = window_start(len, window) / bs; blk * bs < len; blk++) {
            const int32_t id = tables[b * table_stride + blk];
            if (id < 0 || id >= num_blocks) return b + 1;
        }
    }
    return 0;
}

/* the first cache block sequence b reads (its window's start) */
static int64_t first_block(const int32_t *tables, const int32_t *lens, int64_t b, int64_t table_stride, int64_t bs,
                           int64_t window) {
    return tables[b * table_stride + window_start(lens[b], window) / bs];
}

/* out [batch, hq, d] = decode attention of q [batch, hq, d] (rows q_stride apart, heads q_head apart) over the
   caches [num_blocks, bs, hk, d] (contiguous), for dtype 0 = fp32, 1 = bf16 (q, caches and out alike). window <= 0:
   no sliding window; softcap <= 0: none. scratch: 2 * hq * d + hq * bs16 + 2 * hq floats (bs16: bs rounded up to 16). Returns 0, or (before
   reading any cache row) the first sequence whose table or length is out of range, plus one. */
int64_t paged_decode_attention(int64_t dtype, const void *q, int64_t q_stride, int64_t q_head, const void *k_cache,
                               const void *v_cache, int64_t num_blocks, int64_t bs, int64_t hk, int64_t d,
                               const int32_t *tables, int64_t table_stride, int64_t max_blocks, const int32_t *lens,
                               int64_t batch, int64_t hq, float scale, int64_t window, float softcap, void *out,
                               float *scratch) {
    const int64_t bad = check(tables, table_stride, max_blocks, lens, batch, bs, num_blocks, window);
    if (bad) return bad;
    if (hq <= 0 || hk <= 0 || d <= 0) return 0; /* nothing to compute (the wrapper does not send these) */
    const int64_t bytes = bs * hk * d * (dtype == 0 ? 4 : 2); /* one block of K (or V) */
    if (batch > 0) {
        const int64_t first = first_block(tables, lens, 0, table_stride, bs, window);
        fetch_block((const char *)k_cache + first * bytes, (const char *)v_cache + first * bytes, bytes);
    }
    for (int64_t b = 0; b < batch; b++) {
        const int64_t len = lens[b], start = window_start(len, window);
        const int32_t *table = tables + b * table_stride;
        const int64_t next = b + 1 < batch ? first_block(tables, lens, b + 1, table_stride, bs, window) : -1;
        if (dtype == 0)
            attend_f32((const float *)q + b * q_stride, q_head, (const float *)k_cache, (const float *)v_cache, bs, hk,
                       d, table, start, len, hq, scale, softcap, (float *)out + b * hq * d, scratch, next);
        else
            attend_bf16((const uint16_t *)q + b * q_stride, q_head, (const uint16_t *)k_cache,
                        (const uint16_t *)v_cache, bs, hk, d, table, start, len, hq, scale, softcap,
                        (uint16_t *)out + b * hq * d, scratch, next);
    }
    return 0;
}
