// ShadowKV's chunk scores from one query token's landmark logits (ShadowKV §3.2): per query head a softmax over
// the selectable chunks, then the max over the query heads of each GQA group, -inf where not selectable.
// Twin: shadowkv_cache/ops/landmark_scores.py (`landmark_scores_reference`, the PyTorch tail it replaces).
//
// The logits come straight from the landmark GEMM in whatever layout it wrote them (strides), so the tail is one
// kernel that reads them twice instead of a transposed copy, a mask, a conversion to fp32, a softmax, a max over
// the group and another mask.
//
// Legend: B batch, Hkv KV heads, G query heads per KV head, C chunks.
#include "common.cuh"

#define LS_THREADS 512
#define LS_MAX_G 16

/// \brief `merge_state` (common.cuh) with the accurate exp: the scores are compared with PyTorch's softmax, and each
/// head's state is merged over a warp's lanes (five rounds of shuffles), then over the block's warps.
__device__ __forceinline__ void merge_exact(float& m, float& s, float m2, float s2) {
    if (m2 == NEG_INF) return;
    if (m == NEG_INF) {
        m = m2;
        s = s2;
        return;
    }
    const float hi = fmaxf(m, m2);
    s = s * expf(m - hi) + s2 * expf(m2 - hi);
    m = hi;
}

/// \brief One block per (KV head, row): first the softmax state (max, sum of exp) of each query head over the
/// selectable chunks, then scores[c] = max_g exp(logit - M_g) / S_g where chunk c is selectable, -inf elsewhere
/// (every chunk of a head with nothing selectable).
///
/// \param scores      [B, Hkv, C] fp32, out (contiguous)
/// \param logits      element (b, h, g, c) at b*lb + h*lh + g*lg + c*lc, in T
/// \param selectable  element (b, h, c) at b*sb + h*sh + c (bool)
/// Launch: grid (Hkv, B), block LS_THREADS threads; G <= LS_MAX_G.
template <typename T>
__device__ __forceinline__ void landmark_scores(float* scores, const T* logits, const bool* selectable, long long lb,
                                                long long lh, long long lg, long long lc, long long sb, long long sh,
                                                int Hkv, int G, int C) {
    const int head = blockIdx.x, row = blockIdx.y;
    const T* lgt = logits + row * lb + head * lh;
    const bool* sel = selectable + row * sb + head * sh;
    float m[LS_MAX_G], s[LS_MAX_G];
#pragma unroll
    for (int g = 0; g < LS_MAX_G; ++g) m[g] = NEG_INF, s[g] = 0.f;
    for (int c = threadIdx.x; c < C; c += LS_THREADS) {
        if (!sel[c]) continue;
#pragma unroll
        for (int g = 0; g < LS_MAX_G; ++g) {
            if (g >= G) break;
            const float x = to_f32(lgt[g * lg + c * lc]);
            if (x > m[g]) {  // a new max rescales the sum (exp(-inf) = 0 for the first chunk)
                s[g] = s[g] * expf(m[g] - x) + 1.f;
                m[g] = x;
            } else if (x != NEG_INF) {  // -inf adds nothing (and -inf - -inf would be NaN)
                s[g] += expf(x - m[g]);
            }
        }
    }
    // The block's state of each query head: within each warp by shuffles, then across warps in shared memory.
    __shared__ float wm[LS_THREADS / 32][LS_MAX_G], ws[LS_THREADS / 32][LS_MAX_G];
    __shared__ float head_max[LS_MAX_G], head_sum[LS_MAX_G];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int g = 0; g < LS_MAX_G; ++g) {
        if (g >= G) break;
        for (int off = 16; off > 0; off >>= 1) {
            const float m2 = __shfl_xor_sync(0xffffffffu, m[g], off), s2 = __shfl_xor_sync(0xffffffffu, s[g], off);
            merge_exact(m[g], s[g], m2, s2);
        }
        if (lane == 0) wm[warp][g] = m[g], ws[warp][g] = s[g];
    }
    __syncthreads();
    if (threadIdx.x < G) {
        float mm = NEG_INF, ss = 0.f;
        for (int w = 0; w < LS_THREADS / 32; ++w) merge_exact(mm, ss, wm[w][threadIdx.x], ws[w][threadIdx.x]);
        head_max[threadIdx.x] = mm, head_sum[threadIdx.x] = ss;
    }
    __syncthreads();
    float* out = scores + ((long long)row * Hkv + head) * C;
    for (int c = threadIdx.x; c < C; c += LS_THREADS) {
        float best = NEG_INF;
        if (sel[c]) {
            for (int g = 0; g < G; ++g) {
                const float p = expf(to_f32(lgt[g * lg + c * lc]) - head_max[g]) / head_sum[g];
                best = (p > best || p != p) ? p : best;  // NaN wins, as in PyTorch's amax (fmaxf would drop it)
            }
        }
        out[c] = best;
    }
}

#define LANDMARK_SCORES(NAME, T)                                                                                   \
    extern "C" __global__ void __launch_bounds__(LS_THREADS)                                                      \
        NAME(float* scores, const T* logits, const bool* selectable, long long lb, long long lh, long long lg,     \
             long long lc, long long sb, long long sh, int Hkv, int G, int C) {                                    \
        landmark_scores<T>(scores, logits, selectable, lb, lh, lg, lc, sb, sh, Hkv, G, C);                         \
    }
LANDMARK_SCORES(landmark_scores_bf16, bf16)
LANDMARK_SCORES(landmark_scores_f16, f16)
LANDMARK_SCORES(landmark_scores_f32, float)
