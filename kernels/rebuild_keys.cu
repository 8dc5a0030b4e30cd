// Key rebuild for missed chunks (ShadowKV §3.3): rows of A times B, then RoPE at the chunk's true positions,
// written into the slot of the per-head key buffer. Twin: shadowkv_cache/ops/rebuild_keys.py (the definition).
//
// The product A·B runs before this kernel as one batched tensor-core GEMM over every slot (ops/rebuild_keys.py):
// a CUDA-core kernel that multiplied only the missed chunks ran at ~3 TFLOP/s (1.47 ms per layer at batch 32,
// 128K, h = 0.6 on an H200), the GEMM over all slots in tens of microseconds. This kernel applies RoPE to the
// missed slots and writes them; hits are left as they are.
//
// Legend: B batch, Hkv KV heads, K slots, c chunk size, D head dim, Tc compressed tokens.
#include "common.cuh"

/// \brief One block per (slot, head, row); blocks of slots that hit return at once (fixed-size launch, so
///        the host never learns how many chunks missed).
///
/// RoPE on the first `rotary_dim` = r dims of each head (the rest pass through: partial rotary), with cos/sin
/// computed here in fp32 from `inv_freq` and the token's position and multiplied by `attention_scaling`. In the
/// rotate-half form of most Hugging Face models (`interleaved` = 0), dim d < r/2 pairs with d + r/2:
///   out[d] = pre[d] * cos(p*f[d % r/2]) - pre[d + r/2] * sin(...)   for d <  r/2
///   out[d] = pre[d] * cos(p*f[d % r/2]) + pre[d - r/2] * sin(...)   for r/2 <= d < r
/// In the interleaved form (GLM, Cohere; `interleaved` = 1), dim 2i pairs with 2i + 1:
///   out[2i]     = pre[2i]     * cos(p*f[i]) - pre[2i + 1] * sin(...)
///   out[2i + 1] = pre[2i + 1] * cos(p*f[i]) + pre[2i]     * sin(...)
/// `rotary_dim` = 0 is a layer without RoPE (a copy). Twin: `rope_reference` in ops/rebuild_keys.py.
///
/// \param keys       [B, Hkv, K, c, D] T, out: post-RoPE keys of each slot (written where `miss`)
/// \param pre        [B, Hkv, K, c, D] T: pre-RoPE keys of each slot's chunk (A·B, rounded to T)
/// \param ids        [B, Hkv, K] int64: chunk held by each slot
/// \param miss       [B, Hkv, K] bool: slots to write
/// \param positions  [B, Tc] int64 with row stride `pos_row_stride` (0 when rows share one document)
/// \param inv_freq   [rotary_dim/2] fp32: the model's rotary inverse frequencies (rope scaling already applied)
/// \param rotary_dim the rotated dims (even, <= D)
/// \param interleaved 1: pairs (2i, 2i+1); 0: pairs (i, i + rotary_dim/2)
/// Launch: grid (K, Hkv, B), block 128 threads.
template <typename T>
__device__ __forceinline__ void rope_missed_impl(T* keys, const T* pre, const long long* ids, const bool* miss,
                                                 const long long* positions, long long pos_row_stride,
                                                 const float* inv_freq, float attention_scaling, int rotary_dim,
                                                 int interleaved, int Hkv, int K, int c, int D) {
    const int slot = blockIdx.x, head = blockIdx.y, row = blockIdx.z;
    const size_t sh = ((size_t)row * Hkv + head) * K + slot;
    if (!miss[sh]) return;
    const long long first = ids[sh] * c;  // first compressed token of the chunk
    const int half = rotary_dim / 2;
    const T* src = pre + sh * (size_t)c * D;
    T* out = keys + sh * (size_t)c * D;
    const long long* pos = positions + (size_t)row * pos_row_stride + first;
    for (int i = threadIdx.x; i < c * D; i += blockDim.x) {
        const int t = i / D, d = i - t * D;
        if (d >= rotary_dim) {  // past the rotated dims: RoPE leaves them as they are
            out[i] = src[i];
            continue;
        }
        // The frequency of d's pair, d's partner in it, and whether the partner enters with a minus sign.
        const bool first_of_pair = interleaved ? (d & 1) == 0 : d < half;
        const int freq = interleaved ? d >> 1 : (d < half ? d : d - half);
        const int other = interleaved ? d ^ 1 : (d < half ? d + half : d - half);
        const float angle = (float)pos[t] * inv_freq[freq];
        float sn, cs;
        sincosf(angle, &sn, &cs);
        const float partner = first_of_pair ? -to_f32(src[t * D + other]) : to_f32(src[t * D + other]);
        out[i] = from_f32<T>(to_f32(src[i]) * (cs * attention_scaling) + partner * (sn * attention_scaling));
    }
}

#define ROPE_MISSED(T, SUFFIX)                                                                                \
    extern "C" __global__ void __launch_bounds__(128) rope_missed_##SUFFIX(                                   \
        T* keys, const T* pre, const long long* ids, const bool* miss, const long long* positions,            \
        long long pos_row_stride, const float* inv_freq, float attention_scaling, int rotary_dim,             \
        int interleaved, int Hkv, int K, int c, int D) {                                                      \
        rope_missed_impl<T>(keys, pre, ids, miss, positions, pos_row_stride, inv_freq, attention_scaling,     \
                            rotary_dim, interleaved, Hkv, K, c, D);                                           \
    }

ROPE_MISSED(float, float32)
ROPE_MISSED(bf16, bfloat16)
ROPE_MISSED(f16, float16)
