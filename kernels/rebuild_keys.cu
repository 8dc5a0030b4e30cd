// Key rebuild for missed chunks (ShadowKV §3.3): rows of A times B, then RoPE at the chunk's true positions,
// written into the slot of the per-head key buffer. Twin: shadowkv_cache/ops/rebuild_keys.py (the definition).
//
// For keys that rebuild_missed.cu does not take (16-bit keys of head size 64, 128 or 256 do it all there, on tensor
// cores): the product A·B runs before this kernel as one batched GEMM over every slot (ops/rebuild_keys.py), and this
// kernel applies RoPE to the missed slots. A CUDA-core kernel that multiplied only the missed chunks ran at ~3 TFLOP/s
// (1.47 ms per layer at batch 32, 128K, h = 0.6 on an H200), the GEMM over all slots in tens of microseconds.
//
// Legend: B batch, Hkv KV heads, K slots, c chunk size, D head dim, Tc compressed tokens.
#include "common.cuh"

/// \brief One warp per slot, striding over the slots of every (row, head); slots that hit are skipped by their
///        warp (fixed-size launch, so the host never learns how many chunks missed). Each lane takes whole
///        rotation pairs: one sincos per (token, pair), both elements read and written by the same lane.
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
/// Why a warp per slot: one block per slot (65,536 blocks per layer at batch 32, 128K, 60% of them hits that
/// return at once) with one sincos per element took 5.5 ms of a 42 ms step on an H200 machine for ~1 GB of reads
/// and writes (`decode_profile_128k_batch32_int8`).
///
/// \param keys       [B, Hkv, K, c, D] T, out: post-RoPE keys of each slot (written where `miss`)
/// \param pre        [B, Hkv, K, c, D] T: pre-RoPE keys of each slot's chunk (A·B, rounded to T)
/// \param ids        [B, Hkv, K] int64: chunk held by each slot
/// \param miss       [B, Hkv, K] bool: slots to write
/// \param positions  [B, Tc] int64 with row stride `pos_row_stride` (0 when rows share one document)
/// \param inv_freq   [rotary_dim/2] fp32: the model's rotary inverse frequencies (rope scaling already applied)
/// \param rotary_dim the rotated dims (even, <= D)
/// \param interleaved 1: pairs (2i, 2i+1); 0: pairs (i, i + rotary_dim/2)
/// \param total      B * Hkv * K, the slots
/// Launch: grid (X), block ROPE_THREADS.
#define ROPE_THREADS 128
template <typename T>
__device__ __forceinline__ void rope_missed_impl(T* keys, const T* pre, const long long* ids, const bool* miss,
                                                 const long long* positions, long long pos_row_stride,
                                                 const float* inv_freq, float attention_scaling, int rotary_dim,
                                                 int interleaved, int Hkv, int K, int c, int D, long long total) {
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (ROPE_THREADS / 32);
    const int half = rotary_dim / 2;
    for (long long sh = (long long)blockIdx.x * (ROPE_THREADS / 32) + (threadIdx.x >> 5); sh < total; sh += warps) {
        if (!miss[sh]) continue;  // the same for the whole warp
        const long long row = sh / ((long long)Hkv * K);
        // The chunk's first compressed token; an empty slot reads chunk 0, as the twin does.
        const long long first = max(ids[sh], 0LL) * c;
        const T* src = pre + sh * (long long)c * D;
        T* out = keys + sh * (long long)c * D;
        const long long* pos = positions + row * pos_row_stride + first;
        for (int t = 0; t < c; ++t) {
            const T* x = src + (long long)t * D;
            T* y = out + (long long)t * D;
            const float p = (float)pos[t];
            for (int i = lane; i < half; i += 32) rope_pair(x, y, i, half, interleaved, p, inv_freq, attention_scaling);
            for (int d = rotary_dim + lane; d < D; d += 32) y[d] = x[d];  // past the rotated dims: as they are
        }
    }
}

#define ROPE_MISSED(T, SUFFIX)                                                                                \
    extern "C" __global__ void __launch_bounds__(ROPE_THREADS) rope_missed_##SUFFIX(                          \
        T* keys, const T* pre, const long long* ids, const bool* miss, const long long* positions,            \
        long long pos_row_stride, const float* inv_freq, float attention_scaling, int rotary_dim,             \
        int interleaved, int Hkv, int K, int c, int D, long long total) {                                     \
        rope_missed_impl<T>(keys, pre, ids, miss, positions, pos_row_stride, inv_freq, attention_scaling,     \
                            rotary_dim, interleaved, Hkv, K, c, D, total);                                    \
    }

ROPE_MISSED(float, float32)
ROPE_MISSED(bf16, bfloat16)
ROPE_MISSED(f16, float16)
