/* Decode attention on the CPU over the paged KV cache, read in place: for each sequence b and query head h (KV head
   g = h / (Hq / Hk)), out[b, h] = softmax(scale * q[b, h] . K[b, g, start:len]) V[b, g, start:len], the keys and
   values read block by block through the sequence's block table. One pass over each block serves every query head
   (a key row holds all KV heads side by side, so the reads stream); the softmax is the online one (a running maximum
   and sum, fp32), so nothing is gathered, padded or masked. Plain C with GCC/Clang vector extensions (VL lanes, lowered to the CPU it is built on).
   Layouts, numerics and how it is built and called: gpu/attention_cpu_kernel.py (its torch twin is
   TorchOps.gathered_attention_decode). */
#include "cpu_vectors.h"

/* cache lines of the next block's K and V fetched ahead while this block is read */
#define PF_LINES 16

/* One sequence for element type T: LDV / LD1 load 16 / 1 elements as fp32, ST1 stores one fp32 as T. q: its hq
   query rows (q_head apart); out: hq rows of d. Each cache block is read front to back, K then V (a key row holds
   every KV head side by side), so the reads stream; the query heads' running maxima, sums and outputs stay in
   scratch: 2 * hq * d + hq * bs16 + 2 * hq floats, bs16 = bs rounded up to 16. */
#define ATTN_SEQ(NAME, T, LDV, LD1, ST1)                                                                              \
static void NAME(const T *q, int64_t q_head, const T *kc, const T *vc, int64_t bs, int64_t hk, int64_t d,            \
                 const int32_t *table, int64_t start, int64_t len, int64_t hq, float scale, float softcap, T *out,    \
                 float *scratch)                                                                                     \
{                                                                                                                    \
    const int64_t dv = d & ~(int64_t)(VL - 1), bs16 = (bs + 15) & ~(int64_t)15, row = hk * d, group = hq / hk;             \
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
        if ((blk + 1) * bs < len) {                                                                                  \
            const T *kn = kc + (int64_t)table[blk + 1] * bs * row, *vn = vc + (int64_t)table[blk + 1] * bs * row;    \
            for (int64_t o = 0; o < PF_LINES; o++) {                                                                 \
                __builtin_prefetch((const char *)kn + 64 * o);                                                       \
                __builtin_prefetch((const char *)vn + 64 * o);                                                       \
            }                                                                                                        \
        }                                                                                                            \
        for (int64_t h = 0; h < hq; h++)                                                                             \
            for (int64_t j = 0; j < bs16; j++) sc[h * bs16 + j] = -INFINITY;                                         \
        for (int64_t j = j0; j < j1; j++) {                                                                          \
            const T *kr = kb + j * row;                                                                              \
            for (int64_t h = 0; h < hq; h++) {                                                                       \
                const float *qh = qf + h * d;                                                                        \
                const T *kh = kr + (h / group) * d;                                                                  \
                vf c = {0};                                                                                        \
                for (int64_t k = 0; k < dv; k += VL) c += ld_f32(qh + k) * LDV(kh + k);                              \
                float s = hsum(c);                                                                                   \
                for (int64_t k = dv; k < d; k++) s += qh[k] * LD1(kh + k);                                           \
                sc[h * bs16 + j] = softcap > 0.0f ? softcap * tanhf(s) : s;                                          \
            }                                                                                                        \
        }                                                                                                            \
        for (int64_t h = 0; h < hq; h++) {                                                                           \
            float *sh = sc + h * bs16, bm = -INFINITY;                                                               \
            for (int64_t j = 0; j < bs16; j += VL) {                                                                 \
                const float vm = hmax(ld_f32(sh + j));                                                               \
                bm = vm > bm ? vm : bm;                                                                              \
            }                                                                                                        \
            int nan = 0; /* the maximum skips a NaN score; the softmax must not */                                  \
            for (int64_t j = j0; j < j1; j++) nan |= sh[j] != sh[j];                                                 \
            if (bm == -INFINITY && !nan) { /* every score -inf: no key of this block counts, it adds nothing */     \
                for (int64_t j = 0; j < bs16; j++) sh[j] = 0.0f;                                                     \
                continue;                                                                                            \
            }                                                                                                        \
            if (bm > m[h]) {                                                                                         \
                const float alpha = expf(m[h] - bm);                                                                 \
                l[h] *= alpha;                                                                                       \
                for (int64_t k = 0; k < d; k++) acc[h * d + k] *= alpha;                                             \
                m[h] = bm;                                                                                           \
            }                                                                                                        \
            float sum = 0.0f;                                                                                        \
            for (int64_t j = 0; j < bs16; j += VL) {                                                                 \
                const vf p = vexp(ld_f32(sh + j) - m[h]);                                                          \
                st_f32(sh + j, p);                                                                                   \
                sum += hsum(p);                                                                                      \
            }                                                                                                        \
            l[h] += sum;                                                                                             \
        }                                                                                                            \
        for (int64_t j = j0; j < j1; j++) {                                                                          \
            const T *vr = vb + j * row;                                                                              \
            for (int64_t h = 0; h < hq; h++) {                                                                       \
                const T *vh = vr + (h / group) * d;                                                                  \
                float *ah = acc + h * d;                                                                             \
                const float p = sc[h * bs16 + j];                                                                    \
                for (int64_t k = 0; k < dv; k += VL) st_f32(ah + k, ld_f32(ah + k) + p * LDV(vh + k));               \
                for (int64_t k = dv; k < d; k++) ah[k] += p * LD1(vh + k);                                           \
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

/* Whether every block the batch reads is in [0, num_blocks) and every length in [1, max_blocks * bs]: the kernel
   reads nothing outside the cache. Returns 0 when they are, else the first sequence that is not, plus one. */
static int64_t check(const int32_t *tables, int64_t table_stride, int64_t max_blocks, const int32_t *lens,
                     int64_t batch, int64_t bs, int64_t num_blocks, int64_t window) {
    for (int64_t b = 0; b < batch; b++) {
        const int64_t len = lens[b];
        if (len < 1 || len > max_blocks * bs) return b + 1;
        const int64_t start = window > 0 && len > window ? len - window : 0;
        for (int64_t blk = start / bs; blk * bs < len; blk++) {
            const int32_t id = tables[b * table_stride + blk];
            if (id < 0 || id >= num_blocks) return b + 1;
        }
    }
    return 0;
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
    for (int64_t b = 0; b < batch; b++) {
        const int64_t len = lens[b], start = window > 0 && len > window ? len - window : 0;
        const int32_t *table = tables + b * table_stride;
        if (dtype == 0)
            attend_f32((const float *)q + b * q_stride, q_head, (const float *)k_cache, (const float *)v_cache, bs, hk,
                       d, table, start, len, hq, scale, softcap, (float *)out + b * hq * d, scratch);
        else
            attend_bf16((const uint16_t *)q + b * q_stride, q_head, (const uint16_t *)k_cache,
                        (const uint16_t *)v_cache, bs, hk, d, table, start, len, hq, scale, softcap,
                        (uint16_t *)out + b * hq * d, scratch);
    }
    return 0;
}
