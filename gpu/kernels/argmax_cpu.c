/* Greedy choice on the CPU: the first index of each row's largest fp32 value, as torch.argmax gives it (a NaN counts
   as larger than any number, so a row with a NaN gives its first NaN). torch's CPU argmax walks a row one element at
   a time (~630 us for 24 rows of 32,000 logits on the 2-core VM); this is a vector max, then a vector search for
   the first element equal to it. Called by gpu/argmax_cpu_kernel.py. */
#include "cpu_vectors.h"

static inline int any(vi m) {
    int32_t r = 0;
    for (int i = 0; i < VL; i++) r |= m[i];
    return r != 0;
}

static int64_t row_argmax(const float *p, int64_t n) {
    const int64_t nv = n & ~(int64_t)(VL - 1);
    float best = p[0];
    int nan = best != best;
    if (nv >= VL) {
        vf mx = ld_f32(p);
        vi seen_nan = (vi)(mx != mx);
        for (int64_t i = VL; i < nv; i += VL) {
            const vf v = ld_f32(p + i);
            const vi gt = (vi)(v > mx);
            seen_nan |= (vi)(v != v);
            mx = (vf)((gt & (vi)v) | (~gt & (vi)mx));
        }
        nan |= any(seen_nan);
        best = mx[0];
        for (int i = 1; i < VL; i++) best = mx[i] > best ? mx[i] : best;
    }
    for (int64_t i = nv; i < n; i++) {
        nan |= p[i] != p[i];
        best = p[i] > best ? p[i] : best;
    }
    if (nan) { /* the first NaN, as torch */
        for (int64_t i = 0; i < n; i++)
            if (p[i] != p[i]) return i;
    }
    const vf target = best - (vf){0}; /* broadcast */
    int64_t i = 0;
    for (; i < nv; i += VL)
        if (any((vi)(ld_f32(p + i) == target)))
            break;
    for (; i < n; i++)
        if (p[i] == best) return i;
    return 0; /* unreachable: best is an element of the row */
}

/* out[r] = argmax of row r of x [rows, cols] (rows row_stride floats apart). Returns 0. */
int argmax_rows_f32(const float *x, int64_t rows, int64_t cols, int64_t row_stride, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) out[r] = cols > 0 ? row_argmax(x + r * row_stride, cols) : 0;
    return 0;
}
