// ShadowKV's chunk scores from one query token's landmark logits (ShadowKV §3.2): per query head a softmax over
// the selectable chunks, then the max over the query heads of each GQA group, -inf where not selectable.
// Twin: shadowkv_cache/ops/landmark_scores.py (`landmark_scores_reference`, the PyTorch tail it replaces).
//
// The logits come straight from the landmark GEMM in whatever layout it wrote them (strides), so the tail reads them
// twice instead of a transposed copy, a mask, a conversion to fp32, a softmax, a max over the group and another mask.
// Two kernels, each over a grid of (split, KV head, row): `landmark_states` writes each split's softmax state (max,
// sum of exp) of every query head; `landmark_scores` merges a (row, head)'s split states and writes its split's
// scores. The splits keep the GPU full at any batch: one block per (row, head) left 8 blocks for a batch-1 step, and
// a block's one strided pass over its chunks kept too few loads in flight at batch 44 (~0.5 TB/s on an H200).
//
// Each thread reads LS_UNROLL chunks per round before it uses any of them. Where a chunk's G logits lie side by side
// (the GEMM's `[B, Hkv, C, G or padded]` output), each chunk is one 8- or 16-byte load (VB); otherwise G loads.
//
// Legend: B batch, Hkv KV heads, G query heads per KV head, C chunks, S splits.
#include "common.cuh"

#define LS_THREADS 256
#define LS_MAX_G 16

/// \brief `merge_state` (common.cuh) with the accurate exp: the scores are compared with PyTorch's softmax. A state
/// with max -inf has a sum of 0, or NaN where a NaN logit was its only other one: added, so that the NaN spreads.
__device__ __forceinline__ void merge_exact(float& m, float& s, float m2, float s2) {
    if (m2 == NEG_INF) {
        s += s2;
        return;
    }
    if (m == NEG_INF) {
        m = m2;
        s += s2;
        return;
    }
    const float hi = fmaxf(m, m2);
    s = s * expf(m - hi) + s2 * expf(m2 - hi);
    m = hi;
}

/// The logits of one chunk a thread holds: up to MAXG values (VB-byte vector loads hold VB / sizeof(T)).
template <typename T, int VB> struct ChunkLogits {
    static constexpr int MAXG = VB == 0 ? LS_MAX_G : VB / (int)sizeof(T);
    // Chunks per thread and round (`load_round`): 32 registers of logits at most.
    static constexpr int UNROLL = MAXG >= 16 ? 2 : 4;
};

/// \brief Chunk `c`'s first G logits as fp32 into x (`p` points at its query head 0, VB-aligned when VB > 0).
template <typename T, int VB, int MAXG>
__device__ __forceinline__ void load_chunk(float (&x)[MAXG], const T* p, long long lg, int G) {
    if constexpr (VB == 0) {
#pragma unroll
        for (int g = 0; g < MAXG; ++g) x[g] = g < G ? to_f32(p[g * lg]) : 0.f;
    } else if constexpr (VB == 16) {
        const uint4 v = *reinterpret_cast<const uint4*>(p);
        const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
        for (int g = 0; g < MAXG; ++g) x[g] = to_f32(e[g]);
    } else {
        const uint2 v = *reinterpret_cast<const uint2*>(p);
        const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
        for (int g = 0; g < MAXG; ++g) x[g] = to_f32(e[g]);
    }
}

/// \brief A thread's round: chunks base + u*LS_THREADS (u < U) below c1 into x, every load of the round before any
/// use and the mask's beside the logits'; ok[u] = the chunk exists and is selectable.
template <typename T, int VB, int MAXG, int U>
__device__ __forceinline__ void load_round(float (&x)[U][MAXG], bool (&ok)[U], const T* lgt, const bool* sel,
                                           int base, int c1, long long lc, long long lg, int G) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int c = base + u * LS_THREADS;
        ok[u] = c < c1;
        if (ok[u]) load_chunk<T, VB, MAXG>(x[u], lgt + c * lc, lg, G), ok[u] = sel[c];
    }
}

/// \brief The chunks [c0, c1) of split `blockIdx.x` (of S) of a row-head's C chunks.
__device__ __forceinline__ void split_range(int C, int S, int& c0, int& c1) {
    const int per = (C + S - 1) / S;
    c0 = min(C, (int)blockIdx.x * per);
    c1 = min(C, c0 + per);
}

/// \brief Each split's softmax state of each query head over its selectable chunks.
///
/// \param states      [B, Hkv, S, G] float2 (max, sum of exp relative to it), out; (-inf, 0) where none is selectable
/// \param logits      element (b, h, g, c) at b*lb + h*lh + g*lg + c*lc, in T
/// \param selectable  element (b, h, c) at b*sb + h*sh + c (bool)
/// Launch: grid (S, Hkv, B), block LS_THREADS threads; G <= LS_MAX_G, and G <= VB / sizeof(T) when VB > 0.
template <typename T, int VB>
__device__ __forceinline__ void landmark_states(float2* states, const T* logits, const bool* selectable, long long lb,
                                                long long lh, long long lg, long long lc, long long sb, long long sh,
                                                int Hkv, int G, int C, int S) {
    constexpr int MAXG = ChunkLogits<T, VB>::MAXG, U = ChunkLogits<T, VB>::UNROLL;
    const int head = blockIdx.y, row = blockIdx.z;
    const T* lgt = logits + row * lb + head * lh;
    const bool* sel = selectable + row * sb + head * sh;
    int c0, c1;
    split_range(C, S, c0, c1);
    float m[MAXG], s[MAXG];
#pragma unroll
    for (int g = 0; g < MAXG; ++g) m[g] = NEG_INF, s[g] = 0.f;
    for (int base = c0 + threadIdx.x; base < c1; base += LS_THREADS * U) {
        float x[U][MAXG];
        bool ok[U];
        load_round<T, VB, MAXG, U>(x, ok, lgt, sel, base, c1, lc, lg, G);
        // The round's max first, then its exps side by side: one rescale per round, not a chain of U.
#pragma unroll
        for (int g = 0; g < MAXG; ++g) {
            if (g >= G) break;
            float top = m[g];
#pragma unroll
            for (int u = 0; u < U; ++u) top = ok[u] && x[u][g] > top ? x[u][g] : top;  // NaN never becomes the max
            // exp(-inf) = 0 for the first chunk; with no max yet (-inf - -inf would be NaN) only a NaN adds anything.
            float sum = top == NEG_INF ? s[g] : s[g] * expf(m[g] - top);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (ok[u] && x[u][g] != NEG_INF) sum += expf(x[u][g] - top);  // -inf adds nothing; NaN spreads
            }
            m[g] = top, s[g] = sum;
        }
    }
    // The block's state of each query head: within each warp by shuffles, then across warps in shared memory.
    __shared__ float wm[LS_THREADS / 32][LS_MAX_G], ws[LS_THREADS / 32][LS_MAX_G];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int g = 0; g < MAXG; ++g) {
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
        states[(((long long)row * Hkv + head) * S + blockIdx.x) * G + threadIdx.x] = make_float2(mm, ss);
    }
}

/// \brief scores[c] = max_g exp(logit - M_g) / S_g over a split's chunks where chunk c is selectable, -inf elsewhere
/// (every chunk of a head with nothing selectable); (M_g, S_g) merged from the row-head's split states.
///
/// \param scores  [B, Hkv, C] fp32, out (contiguous)
/// \param states  [B, Hkv, S, G] float2, from `landmark_states`
/// Launch: as `landmark_states`.
template <typename T, int VB>
__device__ __forceinline__ void landmark_scores(float* scores, const float2* states, const T* logits,
                                                const bool* selectable, long long lb, long long lh, long long lg,
                                                long long lc, long long sb, long long sh, int Hkv, int G, int C,
                                                int S) {
    constexpr int MAXG = ChunkLogits<T, VB>::MAXG, U = ChunkLogits<T, VB>::UNROLL;
    const int head = blockIdx.y, row = blockIdx.z;
    const T* lgt = logits + row * lb + head * lh;
    const bool* sel = selectable + row * sb + head * sh;
    __shared__ float head_max[LS_MAX_G], head_sum[LS_MAX_G];
    if (threadIdx.x < G) {  // in split order, the same sum in every block of the row-head
        const float2* st = states + ((long long)row * Hkv + head) * S * G + threadIdx.x;
        float mm = NEG_INF, ss = 0.f;
        for (int k = 0; k < S; ++k) merge_exact(mm, ss, st[k * G].x, st[k * G].y);
        head_max[threadIdx.x] = mm, head_sum[threadIdx.x] = ss;
    }
    __syncthreads();
    float hm[MAXG], hs[MAXG];
#pragma unroll
    for (int g = 0; g < MAXG; ++g) hm[g] = g < G ? head_max[g] : 0.f, hs[g] = g < G ? head_sum[g] : 1.f;
    int c0, c1;
    split_range(C, S, c0, c1);
    float* out = scores + ((long long)row * Hkv + head) * C;
    for (int base = c0 + threadIdx.x; base < c1; base += LS_THREADS * U) {
        float x[U][MAXG];
        bool ok[U];
        load_round<T, VB, MAXG, U>(x, ok, lgt, sel, base, c1, lc, lg, G);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = base + u * LS_THREADS;
            if (c >= c1) break;
            float best = NEG_INF;
            if (ok[u]) {
#pragma unroll
                for (int g = 0; g < MAXG; ++g) {
                    if (g >= G) break;
                    // A query head whose selectable logits are all -inf weighs nothing (-inf - -inf would be NaN),
                    // unless a NaN is among them (its sum is NaN then).
                    const float p = hm[g] == NEG_INF ? hs[g] * 0.f : expf(x[u][g] - hm[g]) / hs[g];
                    best = (p > best || p != p) ? p : best;  // NaN wins, as in PyTorch's amax (fmaxf would drop it)
                }
            }
            out[c] = best;
        }
    }
}

#define LANDMARK_SCORES(SUFFIX, T, VB)                                                                             \
    extern "C" __global__ void __launch_bounds__(LS_THREADS)                                                      \
        landmark_states_##SUFFIX(float2* states, const T* logits, const bool* selectable, long long lb,           \
                                 long long lh, long long lg, long long lc, long long sb, long long sh, int Hkv,    \
                                 int G, int C, int S) {                                                            \
        landmark_states<T, VB>(states, logits, selectable, lb, lh, lg, lc, sb, sh, Hkv, G, C, S);                  \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(LS_THREADS)                                                      \
        landmark_scores_##SUFFIX(float* scores, const float2* states, const T* logits, const bool* selectable,    \
                                 long long lb, long long lh, long long lg, long long lc, long long sb,             \
                                 long long sh, int Hkv, int G, int C, int S) {                                     \
        landmark_scores<T, VB>(scores, states, logits, selectable, lb, lh, lg, lc, sb, sh, Hkv, G, C, S);          \
    }
LANDMARK_SCORES(bf16, bf16, 0)
LANDMARK_SCORES(bf16_v8, bf16, 8)
LANDMARK_SCORES(bf16_v16, bf16, 16)
LANDMARK_SCORES(f16, f16, 0)
LANDMARK_SCORES(f16_v8, f16, 8)
LANDMARK_SCORES(f16_v16, f16, 16)
LANDMARK_SCORES(f32, float, 0)
LANDMARK_SCORES(f32_v8, float, 8)
LANDMARK_SCORES(f32_v16, float, 16)
