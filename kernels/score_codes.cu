// Token logits of one YAKV decode step from the ~2-bit device codes of every key (design.md §4): for each KV head and
// each query head of its group, scaling * q . k_hat over all tokens, with per-tile softmax states. The second
// pass (softmax over tokens, max over the group) is softmax_group_max.cu's `softmax_group_max`, launched on
// these logits. Twin: shadowkv_cache/ops/score_codes.py (`code_scores_reference`, i.e. `QuantizedKeyTopK.score`).
//
// Why a kernel: the codes are the largest tensor a YAKV step reads (N*Hkv*M bytes per row and layer: 32 MiB at
// 128K for Llama-3.1-8B at ~2 bits); the twin gathers a [N, M, G] block of table entries, then passes over the
// [B, Hkv, G, N] logits several times (scale, mask, softmax, sum, max). Here the codes are read once and the
// logits written once.
//
// Why no lookup table: a table of the group's queries, [G, M, 256] fp32, is 128 KiB at G = 4, D = 128, p = 4
// (256 KiB at p = 2): over the shared memory of a block that leaves room for others, and its random lookups
// conflict on banks G times per code. Instead the grid (256 points, <= 8 KiB) sits in shared memory and each
// thread keeps its slice of the rotated queries in registers: per code one grid point is read and p*G
// multiply-adds give the same dot products the table would hold (q_sub . grid[code]), summed over sub-vectors.
//
// Legend: B batch, Hkv KV heads, G query heads per KV head (1..8), N tokens, D head dim, p grid dim,
// M = D/p codes per token, CPT codes per thread, team = M/CPT threads per token, NT tiles of tokens.
#include "common.cuh"

#define SC_THREADS 256

/// \brief Codes each thread reads per token: at most 64 query registers (G*CPT*p), at most 16 (one 16-byte
/// load). The dispatch in score_codes.py computes the same number.
template <int P, int G> struct CodesPerThread {
    static constexpr int budget = 64 / (G * P);
    static constexpr int value = budget >= 16 ? 16 : budget >= 8 ? 8 : budget >= 4 ? 4 : budget >= 2 ? 2 : 1;
};

template <int N> __device__ __forceinline__ void load_codes(const unsigned char* p, unsigned char (&out)[N]) {
    if constexpr (N == 16) {
        *reinterpret_cast<uint4*>(out) = __ldg(reinterpret_cast<const uint4*>(p));
    } else if constexpr (N == 8) {
        *reinterpret_cast<uint2*>(out) = __ldg(reinterpret_cast<const uint2*>(p));
    } else if constexpr (N == 4) {
        *reinterpret_cast<unsigned int*>(out) = __ldg(reinterpret_cast<const unsigned int*>(p));
    } else if constexpr (N == 2) {
        *reinterpret_cast<unsigned short*>(out) = __ldg(reinterpret_cast<const unsigned short*>(p));
    } else {
        out[0] = __ldg(p);
    }
}

/// \brief Pass 1. One block per (tile of tokens, KV head, row); a team of M/CPT threads per token.
///
/// \param logits    [B, Hkv, G, N] fp32, out: scaling * norm/sqrt(D) * sum_m q_m . grid[code_m]; -inf where
///                  not selectable
/// \param part_max  [B, Hkv, G, NT] fp32, out: max of each tile's logits
/// \param part_sum  [B, Hkv, G, NT] fp32, out: sum of exp(logit - part_max) over each tile
/// \param query     [B, Hkv, G, D] fp32 rotated queries (one query token), contiguous
/// \param codes     uint8 [B, Hkv, N, M]: row r, head h, token n at r*codes_row_stride + (h*N + n)*M (row
///                  stride 0: a shared document); 16-byte aligned where CPT = 16, and so on
/// \param norms     fp16 [B, Hkv, N]: row r at r*norms_row_stride elements, head stride N
/// \param selectable bool [B, Hkv, N] with strides (sel_row_stride, sel_head_stride, 1)
/// \param grid      [256, P] fp32 grid points
/// \param sqrt_d    sqrt(D) as float32 (the twin divides the norm by it)
/// Launch: grid (NT, Hkv, B), block 256 threads, `tile` tokens per block.
template <int P, int G>
__device__ __forceinline__ void code_logits_impl(float* logits, float* part_max, float* part_sum, const float* query,
                                                 const unsigned char* codes, long long codes_row_stride,
                                                 const f16* norms, long long norms_row_stride,
                                                 const bool* selectable, long long sel_row_stride,
                                                 long long sel_head_stride, const float* grid, float scaling,
                                                 float sqrt_d, int Hkv, int N, int M, int tile) {
    constexpr int CPT = CodesPerThread<P, G>::value;
    __shared__ __align__(16) float points[256 * P];
    const int head = blockIdx.y, row = blockIdx.z, n_tiles = gridDim.x;
    const int D = M * P, team = M / CPT;  // a power of two dividing 32
    const int lane_in_team = threadIdx.x % team, team_id = threadIdx.x / team, teams = SC_THREADS / team;
    const int n0 = blockIdx.x * tile, n1 = min(N, n0 + tile);

    for (int i = threadIdx.x; i < 256 * P; i += SC_THREADS) points[i] = grid[i];
    // This thread's CPT sub-vectors of every query head of the group, in registers.
    float q[G][CPT * P];
    const float* qh = query + ((size_t)row * Hkv + head) * G * D + lane_in_team * CPT * P;
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
        for (int i = 0; i < CPT * P; ++i) q[g][i] = qh[(size_t)g * D + i];
    __syncthreads();

    float m[G], s[G];
#pragma unroll
    for (int g = 0; g < G; ++g) { m[g] = NEG_INF; s[g] = 0.f; }

    const unsigned char* code_head = codes + row * codes_row_stride + (size_t)head * N * M + lane_in_team * CPT;
    const f16* norm_head = norms + row * norms_row_stride + (size_t)head * N;
    const bool* sel = selectable + row * sel_row_stride + head * sel_head_stride;
    float* out = logits + ((size_t)row * Hkv + head) * (size_t)G * N;
    // Uniform trip count per warp: the team shuffles below need every lane of the warp.
    for (int base = n0; base < n1; base += teams) {
        const int n = base + team_id;
        const bool in = n < n1;
        float acc[G];
#pragma unroll
        for (int g = 0; g < G; ++g) acc[g] = 0.f;
        if (in) {
            unsigned char c[CPT];
            load_codes<CPT>(code_head + (size_t)n * M, c);
#pragma unroll
            for (int j = 0; j < CPT; ++j) {
                float pt[P];
                if constexpr (P == 2) {
                    const float2 v = reinterpret_cast<const float2*>(points)[c[j]];
                    pt[0] = v.x; pt[1] = v.y;
                } else {
#pragma unroll
                    for (int k = 0; k < P / 4; ++k) {
                        const float4 v = reinterpret_cast<const float4*>(points)[c[j] * (P / 4) + k];
                        pt[4 * k] = v.x; pt[4 * k + 1] = v.y; pt[4 * k + 2] = v.z; pt[4 * k + 3] = v.w;
                    }
                }
#pragma unroll
                for (int g = 0; g < G; ++g)
#pragma unroll
                    for (int k = 0; k < P; ++k) acc[g] = fmaf(q[g][j * P + k], pt[k], acc[g]);
            }
        }
        const bool ok = in && sel[n];
        const float scale = in ? to_f32(norm_head[n]) / sqrt_d : 0.f;
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float dot = acc[g];
            for (int off = team / 2; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off, team);
            if (in && lane_in_team == 0) {
                const float logit = ok ? dot * scale * scaling : NEG_INF;
                out[(size_t)g * N + n] = logit;
                merge_state(m[g], s[g], logit, 1.f);
            }
        }
    }

    // Block-wide merge of the per-team states (lane 0 of each team holds them), as in the first pass of a softmax over tiles.
    __shared__ float sm[G][SC_THREADS], ss[G][SC_THREADS];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        sm[g][threadIdx.x] = lane_in_team == 0 ? m[g] : NEG_INF;
        ss[g][threadIdx.x] = lane_in_team == 0 ? s[g] : 0.f;
    }
    __syncthreads();
    for (int stride = SC_THREADS / 2; stride > 0; stride >>= 1) {
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

#define CODE_LOGITS(P, G)                                                                                         \
    extern "C" __global__ void __launch_bounds__(SC_THREADS) code_logits_p##P##_g##G(                            \
        float* logits, float* part_max, float* part_sum, const float* query, const unsigned char* codes,         \
        long long codes_row_stride, const f16* norms, long long norms_row_stride, const bool* selectable,        \
        long long sel_row_stride, long long sel_head_stride, const float* grid, float scaling, float sqrt_d,     \
        int Hkv, int N, int M, int tile) {                                                                       \
        code_logits_impl<P, G>(logits, part_max, part_sum, query, codes, codes_row_stride, norms,                \
                               norms_row_stride, selectable, sel_row_stride, sel_head_stride, grid, scaling,     \
                               sqrt_d, Hkv, N, M, tile);                                                         \
    }
#define CODE_LOGITS_ALL_G(P)                                                                                      \
    CODE_LOGITS(P, 1) CODE_LOGITS(P, 2) CODE_LOGITS(P, 3) CODE_LOGITS(P, 4) CODE_LOGITS(P, 5) CODE_LOGITS(P, 6)  \
    CODE_LOGITS(P, 7) CODE_LOGITS(P, 8)

CODE_LOGITS_ALL_G(2)
CODE_LOGITS_ALL_G(4)
CODE_LOGITS_ALL_G(8)
