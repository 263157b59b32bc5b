/* Greedy choice on the CPU: the first index of each row's largest fp32 value, as torch.argmax gives it (a NaN counts
   as larger than any number, so a row with a NaN gives its first NaN). torch's CPU argmax walks a row one element at
   a time (~630 us for 24 rows of 32,000 logits on the 2-core VM); this is a 16-lane max, then a 16-lane search for
   the first element equal to it. Called by gpu/argmax_cpu_kernel.py. */
#include <stdint.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline v16f load(const float *p) { v16f v; memcpy(&v, p, sizeof v); return v; }
static inline int any(v16i m) {
    int32_t r = 0;
    for (int i = 0; i < 16; i++) r |= m[i];
    return r != 0;
}

static int64_t row_argmax(const float *p, int64_t n) {
    const int64_t nv = n & ~(int64_t)15;
    float best = p[0];
    int nan = best != best;
    if (nv >= 16) {
        v16f mx = load(p);
        v16i seen_nan = (v16i)(mx != mx);
        for (int64_t i = 16; i < nv; i += 16) {
            const v16f v = load(p + i);
            const v16i gt = (v16i)(v > mx);
            seen_nan |= (v16i)(v != v);
            mx = (v16f)((gt & (v16i)v) | (~gt & (v16i)mx));
        }
        nan |= any(seen_nan);
        best = mx[0];
        for (int i = 1; i < 16; i++) best = mx[i] > best ? mx[i] : best;
    }
    for (int64_t i = nv; i < n; i++) {
        nan |= p[i] != p[i];
        best = p[i] > best ? p[i] : best;
    }
    if (nan) { /* the first NaN, as torch */
        for (int64_t i = 0; i < n; i++)
            if (p[i] != p[i]) return i;
    }
    const v16f target = best - (v16f){0}; /* broadcast */
    int64_t i = 0;
    for (; i < nv; i += 16)
        if (any((v16i)(load(p + i) == target)))
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
