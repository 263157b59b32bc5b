// KV-cache write: copy each new token's keys and values into its paged-cache slot.
#include "common.cuh"

// key/value: [T, Hk, D] with row strides key_stride/value_stride (heads and elements contiguous);
// caches: [blocks, BS, Hk, D] contiguous, addressed as [blocks * BS, Hk * D] rows;
// slot_mapping: [T] (int64 or int32), slot = block * BS + offset; a negative slot skips the token
// (vLLM's padding convention). Grid-stride over tokens; any block size that is a multiple of 32.
template <typename T, typename I>
__global__ void write_kv_kernel(
    T* __restrict__ k_cache, T* __restrict__ v_cache, const T* __restrict__ key, long long key_stride,
    const T* __restrict__ value, long long value_stride, const I* __restrict__ slot_mapping, int num_tokens,
    int row_elems) {
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = row_elems % kVec == 0 && key_stride % kVec == 0 && value_stride % kVec == 0 &&
                     is_aligned(k_cache, 16) && is_aligned(v_cache, 16) && is_aligned(key, 16) &&
                     is_aligned(value, 16);
    for (int t = blockIdx.x; t < num_tokens; t += gridDim.x) {
        const long long slot = static_cast<long long>(slot_mapping[t]);
        if (slot < 0) continue;
        const T* ks = key + t * key_stride;
        const T* vs = value + t * value_stride;
        T* kd = k_cache + slot * row_elems;
        T* vd = v_cache + slot * row_elems;
        if (vec) {
            for (int i = threadIdx.x * kVec; i < row_elems; i += blockDim.x * kVec) {
                copy_pack<T, kVec>(kd + i, ks + i);
                copy_pack<T, kVec>(vd + i, vs + i);
            }
        } else {
            for (int i = threadIdx.x; i < row_elems; i += blockDim.x) {
                kd[i] = ks[i];
                vd[i] = vs[i];
            }
        }
    }
}
