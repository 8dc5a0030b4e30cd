// Key rebuild for missed chunks (ShadowKV §3.3): rows of A times B, then RoPE at the chunk's true positions,
// written into the slot of the per-head key buffer. Twin: shadowkv_cache/ops/rebuild_keys.py (the definition).
//
// Legend: B batch, Hkv KV heads, K slots, c chunk size, D head dim, Tc compressed tokens, R rank.
#include "common.cuh"

/// \brief One block per (group of slots, head, row). A block whose slots all hit returns at once (fixed-size
///        launch, so the host never learns how many chunks missed); otherwise it stages the head's slice of B
///        in shared memory once and rebuilds each missed slot of its group from it.
///
/// pre[t, d] = sum_r A[row, chunk*c + t, r] * B[row, r, head, d], rounded to T (as the twin's matmul in T);
/// then RoPE in the rotate-half form of Hugging Face models, with cos/sin computed here in fp32 from
/// `inv_freq` and the token's position and multiplied by `attention_scaling`:
///   out[d] = pre[d] * cos(p*f[d % D/2]) - pre[d + D/2] * sin(...)   for d <  D/2
///   out[d] = pre[d] * cos(p*f[d % D/2]) + pre[d - D/2] * sin(...)   for d >= D/2
///
/// Why this shape: one block per slot re-read the head's B slice (R x D, 40 KiB at R=160, D=128) from L2 for
/// every missed chunk and waited on that load in its inner loop; staged once per group, the inner loop reads
/// only shared memory (B, and A four ranks at a time).
///
/// \param keys       [B, Hkv, K, c, D] T, out: post-RoPE keys of each slot (written where `miss`)
/// \param ids        [B, Hkv, K] int64: chunk held by each slot
/// \param miss       [B, Hkv, K] bool: slots to rebuild
/// \param a          [B, Tc, R] T: left factor (U·Σ) of each row's pre-RoPE keys
/// \param b          [B, R, Hkv, D] T: right factor (Vᵀ) split per KV head
/// \param positions  [B, Tc] int64: RoPE position of each compressed token
/// \param inv_freq   [D/2] fp32: the model's rotary inverse frequencies (rope scaling already applied)
/// \param group      slots per block
/// Launch: grid (ceil(K / group), Hkv, B), block 128 threads, dynamic shared memory
///         4*c*R4 + 4*c*D + sizeof(T)*R4*D bytes with R4 = R rounded up to a multiple of 4.
template <typename T>
__device__ __forceinline__ void rebuild_keys_impl(T* keys, const long long* ids, const bool* miss, const T* a,
                                                  const T* b, const long long* positions, const float* inv_freq,
                                                  float attention_scaling, int Hkv, int K, int c, int D, int Tc,
                                                  int R, int group) {
    const int head = blockIdx.y, row = blockIdx.z;
    const int s0 = blockIdx.x * group, s1 = min(K, s0 + group);
    const size_t base = ((size_t)row * Hkv + head) * K;

    __shared__ int any_miss;
    if (threadIdx.x == 0) any_miss = 0;
    __syncthreads();
    for (int s = s0 + threadIdx.x; s < s1; s += blockDim.x)
        if (miss[base + s]) any_miss = 1;
    __syncthreads();
    if (!any_miss) return;

    const int R4 = (R + 3) & ~3;
    extern __shared__ __align__(16) float smem[];
    float* a_tile = smem;              // [c, R4] fp32, zero past R
    float* pre = a_tile + c * R4;      // [c, D] fp32
    T* b_tile = (T*)(pre + c * D);     // [R4, D] T, zero past R
    const size_t b_row_stride = (size_t)Hkv * D;
    const T* b_head = b + (size_t)row * R * b_row_stride + (size_t)head * D;
    for (int i = threadIdx.x; i < R4 * D; i += blockDim.x) {
        const int r = i / D, d = i - r * D;
        b_tile[i] = r < R ? b_head[(size_t)r * b_row_stride + d] : from_f32<T>(0.f);
    }

    const int half = D / 2;
    for (int s = s0; s < s1; ++s) {
        if (!miss[base + s]) continue;  // the same for every thread of the block
        const size_t sh = base + s;
        const long long first = ids[sh] * c;  // first compressed token of the chunk
        __syncthreads();  // the previous slot is done with a_tile and pre (and b_tile is staged)
        const T* a_rows = a + ((size_t)row * Tc + first) * R;  // c consecutive rows of A
        for (int i = threadIdx.x; i < c * R4; i += blockDim.x) {
            const int t = i / R4, r = i - t * R4;
            a_tile[i] = r < R ? to_f32(a_rows[(size_t)t * R + r]) : 0.f;
        }
        __syncthreads();

        for (int d = threadIdx.x; d < D; d += blockDim.x) {
            for (int t0 = 0; t0 < c; t0 += 8) {
                float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
                for (int r = 0; r < R4; r += 4) {
                    const float b0 = to_f32(b_tile[(r + 0) * D + d]), b1 = to_f32(b_tile[(r + 1) * D + d]);
                    const float b2 = to_f32(b_tile[(r + 2) * D + d]), b3 = to_f32(b_tile[(r + 3) * D + d]);
#pragma unroll
                    for (int u = 0; u < 8; ++u) {
                        if (t0 + u < c) {
                            const float4 av = *reinterpret_cast<const float4*>(a_tile + (t0 + u) * R4 + r);
                            acc[u] += av.x * b0 + av.y * b1 + av.z * b2 + av.w * b3;
                        }
                    }
                }
#pragma unroll
                for (int u = 0; u < 8; ++u)
                    if (t0 + u < c) pre[(t0 + u) * D + d] = round_to<T>(acc[u]);
            }
        }
        __syncthreads();

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
}

#define REBUILD_KEYS(T, SUFFIX)                                                                                \
    extern "C" __global__ void __launch_bounds__(128) rebuild_keys_##SUFFIX(                                   \
        T* keys, const long long* ids, const bool* miss, const T* a, const T* b, const long long* positions,  \
        const float* inv_freq, float attention_scaling, int Hkv, int K, int c, int D, int Tc, int R,          \
        int group) {                                                                                           \
        rebuild_keys_impl<T>(keys, ids, miss, a, b, positions, inv_freq, attention_scaling, Hkv, K, c, D, Tc, \
                             R, group);                                                                       \
    }

REBUILD_KEYS(float, float32)
REBUILD_KEYS(bf16, bfloat16)
REBUILD_KEYS(f16, float16)
