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
#define LS_PER_THREAD 8  // head-dim elements each thread of a chunk's team reads (one 16-byte load in 16-bit types)

/// \brief 8 elements of T held as raw 16-byte words (one for 16-bit types, two for fp32), converted to fp32 when
/// used: a thread keeps several chunks' loads in flight without holding them as floats.
template <typename T> struct Raw8 { uint4 w[sizeof(T) / 2]; };

template <typename T> __device__ __forceinline__ Raw8<T> load8(const T* p) {
    Raw8<T> r;
    const uint4* v = reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int k = 0; k < (int)(sizeof(T) / 2); ++k) r.w[k] = v[k];
    return r;
}
template <typename T> __device__ __forceinline__ Raw8<T> zero8() {
    Raw8<T> r;
#pragma unroll
    for (int k = 0; k < (int)(sizeof(T) / 2); ++k) r.w[k] = make_uint4(0u, 0u, 0u, 0u);
    return r;
}
__device__ __forceinline__ void to_f32x8(const Raw8<bf16>& r, float* out) {
    const unsigned int words[4] = {r.w[0].x, r.w[0].y, r.w[0].z, r.w[0].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        out[2 * j] = __uint_as_float(words[j] << 16);
        out[2 * j + 1] = __uint_as_float(words[j] & 0xffff0000u);
    }
}
__device__ __forceinline__ void to_f32x8(const Raw8<f16>& r, float* out) {
    const unsigned int words[4] = {r.w[0].x, r.w[0].y, r.w[0].z, r.w[0].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        out[2 * j] = to_f32(f16{(unsigned short)(words[j] & 0xffffu)});
        out[2 * j + 1] = to_f32(f16{(unsigned short)(words[j] >> 16)});
    }
}
__device__ __forceinline__ void to_f32x8(const Raw8<float>& r, float* out) {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        out[4 * k] = __uint_as_float(r.w[k].x);
        out[4 * k + 1] = __uint_as_float(r.w[k].y);
        out[4 * k + 2] = __uint_as_float(r.w[k].z);
        out[4 * k + 3] = __uint_as_float(r.w[k].w);
    }
}

/// \brief Pass 1. One block per (tile of chunks, KV head, row); a team of D/8 threads per chunk.
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
    const int team = D / LS_PER_THREAD;  // threads per chunk: a power of two dividing 32 (D = 64: 8, 128: 16)
    const int lane_in_team = threadIdx.x % team, team_id = threadIdx.x / team, teams = LS_THREADS / team;
    const int c0 = blockIdx.x * tile, c1 = min(C, c0 + tile);

    // This thread's slice of every query head of the group, scaled, in registers.
    float q[G][LS_PER_THREAD];
    const T* qh = query + ((size_t)row * Hkv * G + (size_t)head * G) * D + lane_in_team * LS_PER_THREAD;
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
        for (int i = 0; i < LS_PER_THREAD; ++i) q[g][i] = to_f32(qh[(size_t)g * D + i]) * scaling;

    const T* lm_head = landmarks + (size_t)row * lm_row_stride + (size_t)head * C * D;
    const bool* sel = selectable + (size_t)row * sel_row_stride + (size_t)head * C;
    float* out = logits + ((size_t)row * Hkv + head) * (size_t)G * C;
    // Eight chunks' loads (four in fp32) in flight per thread, issued before any arithmetic, and no exponentials
    // in this loop: it streams the landmarks and keeps only the running max. (Holding them as floats, or the
    // query in 16 registers per head, cost occupancy and halved the bandwidth on an H200.)
    constexpr int U = 16 / (int)sizeof(T) >= 8 ? 8 : 4;
    float mx[G];
#pragma unroll
    for (int g = 0; g < G; ++g) mx[g] = NEG_INF;
    // Uniform trip count per warp: the team shuffles below need every lane of the warp.
    for (int base = c0; base < c1; base += teams * U) {
        Raw8<T> raw[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = base + u * teams + team_id;
            raw[u] = c < c1 ? load8(lm_head + (size_t)c * D + lane_in_team * LS_PER_THREAD) : zero8<T>();
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = base + u * teams + team_id;
            const bool in = c < c1;
            const bool ok = in && sel[c];
            float lv[LS_PER_THREAD];
            to_f32x8(raw[u], lv);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float dot = 0.f;
#pragma unroll
                for (int i = 0; i < LS_PER_THREAD; ++i) dot += q[g][i] * lv[i];
                for (int off = team / 2; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off, team);
                if (in && lane_in_team == 0) {
                    const float logit = ok ? dot : NEG_INF;
                    out[(size_t)g * C + c] = logit;
                    mx[g] = fmaxf(mx[g], logit);
                }
            }
        }
    }

    // The tile's max per query head, then its sum of exp(logit - max) from the logits just written (this block's
    // own writes, visible after the barrier, read back from L1/L2).
    __shared__ float red[G][LS_THREADS];
    __shared__ float tile_max[G];
#pragma unroll
    for (int g = 0; g < G; ++g) red[g][threadIdx.x] = mx[g];
    __syncthreads();
    for (int stride = LS_THREADS / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
#pragma unroll
            for (int g = 0; g < G; ++g) red[g][threadIdx.x] = fmaxf(red[g][threadIdx.x], red[g][threadIdx.x + stride]);
        }
        __syncthreads();
    }
    if (threadIdx.x < G) tile_max[threadIdx.x] = red[threadIdx.x][0];
    __syncthreads();
    float sum[G];
#pragma unroll
    for (int g = 0; g < G; ++g) sum[g] = 0.f;
    for (int c = c0 + threadIdx.x; c < c1; c += LS_THREADS) {
#pragma unroll
        for (int g = 0; g < G; ++g)
            if (tile_max[g] != NEG_INF) sum[g] += __expf(out[(size_t)g * C + c] - tile_max[g]);
    }
#pragma unroll
    for (int g = 0; g < G; ++g) red[g][threadIdx.x] = sum[g];
    __syncthreads();
    for (int stride = LS_THREADS / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
#pragma unroll
            for (int g = 0; g < G; ++g) red[g][threadIdx.x] += red[g][threadIdx.x + stride];
        }
        __syncthreads();
    }
    if (threadIdx.x < G) {
        const size_t p = (((size_t)row * Hkv + head) * G + threadIdx.x) * n_tiles + blockIdx.x;
        part_max[p] = tile_max[threadIdx.x];
        part_sum[p] = red[threadIdx.x][0];
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
