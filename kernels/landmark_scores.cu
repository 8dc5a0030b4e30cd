// Landmark scores of one decode step (ShadowKV §3.2): for each KV head, the softmax over chunks of the query
// heads' logits against the landmarks, max over the query heads of the group (GQA).
// Twin: shadowkv_cache/policies/landmark_topk.py (`LandmarkTopK.score`, the definition).
//
// Why a kernel: the landmarks are the largest tensor a decode step reads (C*Hkv*D per row and layer, 32 MiB
// at 128K for Llama-3.1-8B). A batched GEMM with G = 4 output rows reads them at ~1.7 TB/s on an H200, and the
// masked softmax, sum and max then pass over [B, Hkv, G, C] fp32 logits about eight times. Here one pass
// streams the landmarks once, writes the logits with per-tile maxima and sums, and a second pass normalises.
//
// Legend: B batch, Hkv KV heads, G query heads per KV head (1..8), C chunks, D head dim, N tiles of chunks.
#include "common.cuh"

#define LS_THREADS 256
#define LS_PER_THREAD 16  // head-dim elements each thread of a chunk's team reads

/// \brief 16 consecutive elements as fp32, with 16-byte loads (the address is 32-byte aligned: D % 16 == 0).
__device__ __forceinline__ void load16(const bf16* p, float* out) {
    const uint4* v = reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const uint4 w = v[k];
        const unsigned int words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            out[k * 8 + 2 * j] = __uint_as_float(words[j] << 16);
            out[k * 8 + 2 * j + 1] = __uint_as_float(words[j] & 0xffff0000u);
        }
    }
}
__device__ __forceinline__ void load16(const f16* p, float* out) {
    const uint4* v = reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const uint4 w = v[k];
        const unsigned int words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            out[k * 8 + 2 * j] = to_f32(f16{(unsigned short)(words[j] & 0xffffu)});
            out[k * 8 + 2 * j + 1] = to_f32(f16{(unsigned short)(words[j] >> 16)});
        }
    }
}
__device__ __forceinline__ void load16(const float* p, float* out) {
    const float4* v = reinterpret_cast<const float4*>(p);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float4 w = v[k];
        out[4 * k] = w.x; out[4 * k + 1] = w.y; out[4 * k + 2] = w.z; out[4 * k + 3] = w.w;
    }
}

/// \brief Pass 1. One block per (tile of chunks, KV head, row); a team of D/16 threads per chunk.
///
/// \param logits    [B, Hkv, G, C] fp32, out: scaling * q_g . L_c, -inf where not selectable
/// \param part_max  [B, Hkv, G, N] fp32, out: max of each tile's logits
/// \param part_sum  [B, Hkv, G, N] fp32, out: sum of exp(logit - part_max) over each tile
/// \param query     [B, Hkv*G, D] T (one query token), contiguous
/// \param landmarks T, row r, head h, chunk c at r*lm_row_stride + (h*C + c)*D (row stride 0: a shared document)
/// \param selectable [B, Hkv, C] bool with row stride `sel_row_stride` (0 when rows share one document)
/// Launch: grid (N, Hkv, B), block 256 threads, `tile` chunks per block.
template <typename T, int G>
__device__ __forceinline__ void landmark_logits_impl(float* logits, float* part_max, float* part_sum,
                                                     const T* query, const T* landmarks, long long lm_row_stride,
                                                     const bool* selectable, long long sel_row_stride, float scaling,
                                                     int Hkv, int C, int D, int tile) {
    const int head = blockIdx.y, row = blockIdx.z, n_tiles = gridDim.x;
    const int team = D / LS_PER_THREAD;  // threads per chunk: a power of two dividing 32
    const int lane_in_team = threadIdx.x % team, team_id = threadIdx.x / team, teams = LS_THREADS / team;
    const int c0 = blockIdx.x * tile, c1 = min(C, c0 + tile);

    // This thread's slice of every query head of the group, scaled, in registers.
    float q[G][LS_PER_THREAD];
    const T* qh = query + ((size_t)row * Hkv * G + (size_t)head * G) * D + lane_in_team * LS_PER_THREAD;
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
        for (int i = 0; i < LS_PER_THREAD; ++i) q[g][i] = to_f32(qh[(size_t)g * D + i]) * scaling;

    float m[G], s[G];
#pragma unroll
    for (int g = 0; g < G; ++g) { m[g] = NEG_INF; s[g] = 0.f; }

    const T* lm_head = landmarks + (size_t)row * lm_row_stride + (size_t)head * C * D;
    const bool* sel = selectable + (size_t)row * sel_row_stride + (size_t)head * C;
    float* out = logits + ((size_t)row * Hkv + head) * (size_t)G * C;
    // Uniform trip count per warp: the team shuffles below need every lane of the warp.
    for (int base = c0; base < c1; base += teams) {
        const int c = base + team_id;
        const bool in = c < c1;
        float lv[LS_PER_THREAD];
        if (in) {
            load16(lm_head + (size_t)c * D + lane_in_team * LS_PER_THREAD, lv);
        } else {
#pragma unroll
            for (int i = 0; i < LS_PER_THREAD; ++i) lv[i] = 0.f;
        }
        const bool ok = in && sel[c];
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float dot = 0.f;
#pragma unroll
            for (int i = 0; i < LS_PER_THREAD; ++i) dot += q[g][i] * lv[i];
            for (int off = team / 2; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off, team);
            if (in && lane_in_team == 0) {
                const float logit = ok ? dot : NEG_INF;
                out[(size_t)g * C + c] = logit;
                merge_state(m[g], s[g], logit, 1.f);
            }
        }
    }

    // Block-wide merge of the per-team states (lane 0 of each team holds them).
    __shared__ float sm[G][LS_THREADS], ss[G][LS_THREADS];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        sm[g][threadIdx.x] = lane_in_team == 0 ? m[g] : NEG_INF;
        ss[g][threadIdx.x] = lane_in_team == 0 ? s[g] : 0.f;
    }
    __syncthreads();
    for (int stride = LS_THREADS / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float mm = sm[g][threadIdx.x], s2 = ss[g][threadIdx.x];
                merge_state(mm, s2, sm[g][threadIdx.x + stride], ss[g][threadIdx.x + stride]);
                sm[g][threadIdx.x] = mm;
                ss[g][threadIdx.x] = s2;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x < G) {
        const size_t p = (((size_t)row * Hkv + head) * G + threadIdx.x) * n_tiles + blockIdx.x;
        part_max[p] = sm[threadIdx.x][0];
        part_sum[p] = ss[threadIdx.x][0];
    }
}

/// \brief Pass 2. One block per (tile of 1024 chunks, KV head, row): scores[c] = max_g exp(logit - M_g) / S_g,
/// with (M_g, S_g) merged from the tiles' partial states; 0 where a row's head has nothing selectable.
///
/// \param scores    [B, Hkv, C] fp32, out
/// Launch: grid (ceil(C / 1024), Hkv, B), block 256 threads.
extern "C" __global__ void __launch_bounds__(LS_THREADS)
    landmark_softmax_max(float* scores, const float* logits, const float* part_max, const float* part_sum, int Hkv,
                         int G, int C, int n_tiles) {
    const int head = blockIdx.y, row = blockIdx.z;
    const size_t rh = (size_t)row * Hkv + head;
    __shared__ float gm[32], gs[32];
    if (threadIdx.x < G) {
        float mm = NEG_INF, s2 = 0.f;
        const size_t p = (rh * G + threadIdx.x) * n_tiles;
        for (int t = 0; t < n_tiles; ++t) merge_state(mm, s2, part_max[p + t], part_sum[p + t]);
        gm[threadIdx.x] = mm;
        gs[threadIdx.x] = s2;
    }
    __syncthreads();
    const float* lg = logits + rh * (size_t)G * C;
    const int end = min(C, (blockIdx.x + 1) * 1024);
    for (int c = blockIdx.x * 1024 + threadIdx.x; c < end; c += LS_THREADS) {
        float best = 0.f;
        for (int g = 0; g < G; ++g)
            if (gm[g] != NEG_INF) best = fmaxf(best, __expf(lg[(size_t)g * C + c] - gm[g]) / gs[g]);
        scores[rh * C + c] = best;
    }
}

#define LANDMARK_LOGITS(T, SUFFIX, G)                                                                            \
    extern "C" __global__ void __launch_bounds__(LS_THREADS) landmark_logits_##SUFFIX##_g##G(                   \
        float* logits, float* part_max, float* part_sum, const T* query, const T* landmarks,                    \
        long long lm_row_stride, const bool* selectable, long long sel_row_stride, float scaling, int Hkv,      \
        int C, int D, int tile) {                                                                               \
        landmark_logits_impl<T, G>(logits, part_max, part_sum, query, landmarks, lm_row_stride, selectable,     \
                                   sel_row_stride, scaling, Hkv, C, D, tile);                                   \
    }
#define LANDMARK_LOGITS_ALL_G(T, SUFFIX)                                                                         \
    LANDMARK_LOGITS(T, SUFFIX, 1) LANDMARK_LOGITS(T, SUFFIX, 2) LANDMARK_LOGITS(T, SUFFIX, 3)                    \
    LANDMARK_LOGITS(T, SUFFIX, 4) LANDMARK_LOGITS(T, SUFFIX, 5) LANDMARK_LOGITS(T, SUFFIX, 6)                    \
    LANDMARK_LOGITS(T, SUFFIX, 7) LANDMARK_LOGITS(T, SUFFIX, 8)

LANDMARK_LOGITS_ALL_G(float, float32)
LANDMARK_LOGITS_ALL_G(bf16, bfloat16)
LANDMARK_LOGITS_ALL_G(f16, float16)
