// Key rebuild for missed chunks (ShadowKV §3.3): rows of A times B, then RoPE at the chunk's true positions,
// written into the slot of the per-head key buffer. Twin: shadowkv_cache/ops/rebuild_keys.py (the definition).
//
// Legend: B batch, Hkv KV heads, K slots, c chunk size, D head dim, Tc compressed tokens, R rank.
#include "common.cuh"

/// \brief One block per (slot, head, row); blocks of slots that hit return at once (fixed-size launch, so
///        the host never learns how many chunks missed).
///
/// pre[t, d] = sum_r A[row, chunk*c + t, r] * B[row, r, head, d], rounded to T (as the twin's matmul in T);
/// then RoPE in the rotate-half form of Hugging Face models, with cos/sin computed here in fp32 from
/// `inv_freq` and the token's position and multiplied by `attention_scaling`:
///   out[d] = pre[d] * cos(p*f[d % D/2]) - pre[d + D/2] * sin(...)   for d <  D/2
///   out[d] = pre[d] * cos(p*f[d % D/2]) + pre[d - D/2] * sin(...)   for d >= D/2
///
/// \param keys       [B, Hkv, K, c, D] T, out: post-RoPE keys of each slot (written where `miss`)
/// \param ids        [B, Hkv, K] int64: chunk held by each slot
/// \param miss       [B, Hkv, K] bool: slots to rebuild
/// \param a          [B, Tc, R] T: left factor (U·Σ) of each row's pre-RoPE keys
/// \param b          [B, R, Hkv, D] T: right factor (Vᵀ) split per KV head
/// \param positions  [B, Tc] int64: RoPE position of each compressed token
/// \param inv_freq   [D/2] fp32: the model's rotary inverse frequencies (rope scaling already applied)
/// Launch: grid (K, Hkv, B), block 128 threads, dynamic shared memory 4*c*(R + D) bytes.
template <typename T>
__device__ __forceinline__ void rebuild_keys_impl(T* keys, const long long* ids, const bool* miss, const T* a,
                                                  const T* b, const long long* positions, const float* inv_freq,
                                                  float attention_scaling, int Hkv, int K, int c, int D, int Tc,
                                                  int R) {
    const int slot = blockIdx.x, head = blockIdx.y, row = blockIdx.z;
    const size_t sh = ((size_t)row * Hkv + head) * K + slot;
    if (!miss[sh]) return;
    const long long first = ids[sh] * c;  // first compressed token of the chunk

    extern __shared__ float smem[];
    float* a_tile = smem;        // [c, R]
    float* pre = smem + c * R;   // [c, D]
    const T* a_rows = a + ((size_t)row * Tc + first) * R;  // c consecutive rows of A
    for (int i = threadIdx.x; i < c * R; i += blockDim.x) a_tile[i] = to_f32(a_rows[i]);
    __syncthreads();

    const size_t b_row_stride = (size_t)Hkv * D;
    const T* b_head = b + (size_t)row * R * b_row_stride + (size_t)head * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        for (int t0 = 0; t0 < c; t0 += 8) {
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            for (int r = 0; r < R; ++r) {
                const float bv = to_f32(b_head[(size_t)r * b_row_stride + d]);
#pragma unroll
                for (int u = 0; u < 8; ++u)
                    if (t0 + u < c) acc[u] += a_tile[(t0 + u) * R + r] * bv;
            }
#pragma unroll
            for (int u = 0; u < 8; ++u)
                if (t0 + u < c) pre[(t0 + u) * D + d] = round_to<T>(acc[u]);
        }
    }
    __syncthreads();

    const int half = D / 2;
    T* out = keys + sh * (size_t)c * D;
    const long long* pos = positions + (size_t)row * Tc + first;
    for (int i = threadIdx.x; i < c * D; i += blockDim.x) {
        const int t = i / D, d = i - t * D;
        const float angle = (float)pos[t] * inv_freq[d < half ? d : d - half];
        float sn, cs;
        sincosf(angle, &sn, &cs);
        const float partner = d < half ? -pre[t * D + d + half] : pre[t * D + d - half];
        out[i] = from_f32<T>(pre[i] * (cs * attention_scaling) + partner * (sn * attention_scaling));
    }
}

#define REBUILD_KEYS(T, SUFFIX)                                                                                \
    extern "C" __global__ void __launch_bounds__(128) rebuild_keys_##SUFFIX(                                   \
        T* keys, const long long* ids, const bool* miss, const T* a, const T* b, const long long* positions,  \
        const float* inv_freq, float attention_scaling, int Hkv, int K, int c, int D, int Tc, int R) {        \
        rebuild_keys_impl<T>(keys, ids, miss, a, b, positions, inv_freq, attention_scaling, Hkv, K, c, D, Tc, \
                             R);                                                                              \
    }

REBUILD_KEYS(float, float32)
REBUILD_KEYS(bf16, bfloat16)
REBUILD_KEYS(f16, float16)
