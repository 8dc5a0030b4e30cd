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

// ---- Tensor cores: p = 4, one query token, sm_80 and later ----------------------------------------------------------
//
// Why: the kernel above reads its codes at ~150 GB/s on an H200 (benchmarks/results/scoring_cuda.md): each code is a
// 16-byte random read of shared memory, which conflicts on banks, then p*G fp32 multiply-adds. An fp16 tensor-core
// version (a 4-dim grid point per 8-byte table read, the query split into two fp16 halves, two MMAs per k-tile) was
// bound by issuing instructions (benchmarks/results/scoring_ncu_128k.md: 1.3 eligible warps, the issue slot busy 64%
// of cycles) and read codes at 16.5% of the copy bandwidth. Here each code is the int8 A operand of an m16n8k32
// integer MMA (32 dims of 16 tokens): one 4-byte read of a table in shared memory that holds a copy per lane (no bank
// conflicts) gives a code's four int8 coordinates, and the group's queries are the B operand. Per 16 tokens and 32
// dims a thread makes 4 table reads and, for G <= 4, 2 MMAs (for G > 4, 3).
//
// Exactness: the 4-D grid's points are multiples of 1/32 within +-127/32 (quant/higgs.py fits them on that lattice),
// so 32*g is an int8 exactly. Each query head is scaled by s = (2^23 - 2^16) / max|q| and rounded to an integer q24
// (2^-24 of its largest coordinate), written q24 = 2^16 hi + 2^8 mid + lo with int8 digits. The dots of the digits with
// the int8 points are exact in int32 and are combined in fp32 (one rounding): the logits differ from the twin's by
// the query's rounding and fp32 round-off, like the fp32 kernel's. G <= 4 puts head h's hi and mid digits in B columns
// 2h and 2h+1 of one MMA and its lo digit in column 2h of a second (odd columns zero), so lane tq of a quad holds all
// three digits of head tq for both of its tokens and finishes them alone: no exchange between lanes, one softmax
// state, three shuffles for a group's max (the layout before, hi digits in columns 0-3 and mid in 4-7, took 22 more
// instructions per group); G > 4 takes a MMA per digit.
//
// One pass over the codes (`code_states_mma`): per-tile softmax states, and each logit as an fp16 exponential relative
// to the max of its head over the 16 tokens an MMA covers, with that max in fp32. A second kernel (`code_scores_finish`)
// merges the tiles' states into each head's row state and turns the exponentials into scores, max over the group,
// reading 2Gp + Gp/4 bytes per token (Gp = G rounded up to even; pass 1 writes as many) where reading the codes again
// would be M + 3 (codes, norm, mask: 35 at D = 128).
//
// Precision: exp(l - group max) is in [0, 1]; stored times 2^15 it is a normal fp16 down to 2^-29 (~1.9e-9), so
// where it is at least that the score carries 2^-11 relative error (plus __expf's ~1e-5), and below it the score is
// within 2^-39 absolute of the twin's (the factor that scales it is at most 1). The states are summed from the fp32
// exponentials.
//
// Legend: CPT = M/4 codes per thread per token (4 threads per token), NK = CPT/2 k-tiles of 32 dims, gid = lane/4 (MMA
// row group; B column gid), tq = lane % 4.

#define MMA_THREADS 128  // threads per block, but D = 128's: MMA_WARPS_K8 warps
// The grid of D = 128 (CPT = 8), the most common head dim: blocks per SM that registers are budgeted for, and stages of
// the code ring. score_codes.py passes its own values.
#ifndef MMA_MIN_BLOCKS_K8
#define MMA_MIN_BLOCKS_K8 4
#endif
#ifndef MMA_DEPTH_K8
#define MMA_DEPTH_K8 3
#endif
#ifndef MMA_WARPS_K8
#define MMA_WARPS_K8 4  // 8 share one table among twice the warps (static shared memory then takes 2 stages at most)
#endif
#define MMA_TILE 2048   // tokens per block (score_codes.py's _MMA_TILE)
#define MMA_COPIES 32  // copies of the int8 grid in shared memory, one per lane: no bank conflicts
#define NOT_SELECTABLE 0x7e00  // a NaN fp16 pattern: no key norm is NaN, and cvt writes NaN as 0x7fff
#define Q24_MAX 8323072.f      // 2^23 - 2^16: the largest |q24|, whose three digits stay in int8
#define NEG_FLT_MAX (-3.40282347e38f)  // a finite floor for maxima: 2^(-inf - it) is 0 where 2^(-inf - -inf) is NaN

/// \brief Add a group of base-2 logits, given as their max `g` and the sum of 2^(logit - g), to a base-2 softmax
/// state; a group with nothing selectable (g = -inf) adds nothing.
__device__ __forceinline__ void add_group2(float& m, float& s, float g, float sum) {
    // Without branches (code_states_mma overlaps two groups' work only within one basic block): the new max's two
    // exponentials, taken against -FLT_MAX when both maxima are -inf (nothing added yet), so both are 0 and s stays 0.
    const float hi = fmaxf(m, g), his = fmaxf(hi, NEG_FLT_MAX);
    s = fmaf(s, exp2_ftz(m - his), sum * exp2_ftz(g - his));
    m = hi;
}

/// \brief Stores that a predicate guards without a branch (a branch would end the basic block that code_states_mma's
/// scheduler interleaves two groups in).
__device__ __forceinline__ void store_if(unsigned* p, unsigned v, bool pred) {
    asm volatile("{ .reg .pred q; setp.ne.u32 q, %2, 0; @q st.global.u32 [%0], %1; }" ::"l"(p), "r"(v),
                 "r"((unsigned)pred));
}
__device__ __forceinline__ void store_if(float* p, float x, bool pred) {
    asm volatile("{ .reg .pred q; setp.ne.u32 q, %2, 0; @q st.global.f32 [%0], %1; }" ::"l"(p), "f"(x),
                 "r"((unsigned)pred));
}
__device__ __forceinline__ void store_if(float* p, float x, float y, bool pred) {
    asm volatile("{ .reg .pred q; setp.ne.u32 q, %3, 0; @q st.global.v2.f32 [%0], {%1, %2}; }" ::"l"(p), "f"(x),
                 "f"(y), "r"((unsigned)pred));
}

/// \brief The CPT code bytes of one token at `p` (shared memory, CPT-byte aligned) as CPT/4 words.
template <int CPT> __device__ __forceinline__ void load_words(const unsigned char* p, unsigned (&w)[CPT / 4]) {
    if constexpr (CPT == 4) {
        w[0] = *reinterpret_cast<const unsigned*>(p);
    } else if constexpr (CPT == 8) {
        const uint2 v = *reinterpret_cast<const uint2*>(p);
        w[0] = v.x; w[1] = v.y;
    } else {
        const uint4 v = *reinterpret_cast<const uint4*>(p);
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    }
}

/// \brief The shared-window address of `p` (a pointer into shared memory), and a 32-bit read there.
__device__ __forceinline__ unsigned shared_address(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ unsigned load_shared(unsigned addr) {
    unsigned v;
    asm("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr));
    return v;
}

/// \brief Copy BYTES (4, 8, 16 or 32: two 16-byte copies) from global memory to shared-window address `dst`
/// asynchronously; when `!valid` it writes zeros and reads nothing (a source size of 0), so `src` may then point past
/// the tensor.
template <int BYTES> __device__ __forceinline__ void cp_async_to(unsigned dst, const void* src, bool valid) {
#if __CUDA_ARCH__ >= 800
    constexpr int N = BYTES < 16 ? BYTES : 16;
#pragma unroll
    for (int i = 0; i < BYTES / N; ++i)
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(dst + i * N),
                     "l"(static_cast<const char*>(src) + i * N), "n"(N), "r"(valid ? N : 0));
#else
    __trap();
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;");
#endif
}
template <int PENDING> __device__ __forceinline__ void cp_async_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
#endif
}

/// \brief The int8 digit `d` (0: hi, 1: mid, 2: lo) of q24 = 2^16 hi + 2^8 mid + lo, each in [-128, 127].
__device__ __forceinline__ int q24_digit(int q24, int d) {
    const int lo = ((q24 + 128) & 255) - 128;
    const int t = (q24 - lo) >> 8;
    const int mid = ((t + 128) & 255) - 128;
    return d == 2 ? lo : d == 1 ? mid : (t - mid) >> 8;
}

/// \brief Four int8 values (the low byte of each) packed little-endian into one MMA operand word.
__device__ __forceinline__ unsigned pack_s8x4(int x0, int x1, int x2, int x3) {
    return (unsigned)(x0 & 255) | ((unsigned)(x1 & 255) << 8) | ((unsigned)(x2 & 255) << 16) | ((unsigned)x3 << 24);
}

/// \brief The pass over the codes. One block per (tile of tokens, KV head, row), 4 warps; each warp takes 16 tokens
/// (one MMA group) at a time. `PACKED`: G <= 4 (two MMAs per k-tile), else G <= 8 (three). Logits are kept in base 2
/// (l = logit * log2 e), so each exponential is one `ex2`.
///
/// \param part_max, part_sum  [B, Hkv, G, NT] fp32, out: each tile's max l and 2^15 * its sum of 2^(l - max) per
///                  query head
/// \param exps      [B, Hkv, N, Gp] fp16 (Gp = G rounded up to even, as pairs of fp16 in 32-bit words), out:
///                  2^15 * 2^(l - group max); for a token that is not selectable, the pattern NOT_SELECTABLE in the
///                  low half of its first word and 0 elsewhere; entries g >= G hold anything
/// \param gmaxes    [B, Hkv, NG, Gp] fp32 (NG = ceil(N / 16)), out: the max l of each group of 16 tokens per query
///                  head, -inf where none is selectable; entries g >= G hold anything
/// \param query     [B, Hkv, G, D] fp32 rotated queries (one query token), contiguous
/// \param codes     uint8 [B, Hkv, N, M], M = 4*CPT, as code_logits_impl's (CPT-byte aligned)
/// \param norms, selectable, scaling, sqrt_d  as code_logits_impl's
/// \param points8   [256] uint32: grid point j as 4 int8 (32 * its coordinates, coordinate i in byte i)
/// Launch: grid (P, 1, 1) for P <= B * Hkv * NT blocks (score_codes.py: the blocks that fit at once), block
/// 32 * warps threads; each block takes a contiguous share of the B * Hkv * NT tiles of MMA_TILE tokens.
template <int CPT, bool PACKED>
__device__ __forceinline__ void code_states_mma_impl(float* part_max, float* part_sum, unsigned* exps, float* gmaxes,
                                                     const float* query, const unsigned char* codes,
                                                     long long codes_row_stride, const f16* norms,
                                                     long long norms_row_stride, const bool* selectable,
                                                     long long sel_row_stride, long long sel_head_stride,
                                                     const unsigned* points8, float scaling, float sqrt_d, int B,
                                                     int Hkv, int G, int N) {
    constexpr int THREADS = CPT == 8 ? 32 * MMA_WARPS_K8 : MMA_THREADS;
    constexpr int M = 4 * CPT, D = 4 * M, W = CPT / 4, NK = CPT / 2, STRIDE = THREADS / 32 * 16;
    constexpr int PARTS = PACKED ? 2 : 3;  // MMAs per k-tile
    // Stages of the code ring; under 48 KiB of static shared memory in all (the table takes 32 KiB).
    constexpr int DEPTH = CPT == 16 ? 2 : CPT == 8 ? MMA_DEPTH_K8 : 5;
    static_assert(DEPTH >= 2, "a slot is refilled only after the group in it was read");
    __shared__ __align__(16) unsigned table[256 * MMA_COPIES];
    // A tile's norms, tokens i and i + 8 of each 16-token group side by side (one 32-bit read gives a lane both).
    __shared__ __align__(4) unsigned short norm_bits[MMA_TILE];
    __shared__ __align__(16) unsigned char stage[THREADS / 32][DEPTH][16 * M];
    __shared__ float wm[THREADS / 32][8], ws[THREADS / 32][8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gid = lane >> 2, tq = lane & 3;
    const int pairs = (G + 1) / 2, groups = (N + 15) / 16;  // Gp / 2 words per token; NG

    // Every block fills its table before its first group: all of a thread's loads are issued at once (one round trip),
    // and 16-byte stores of 4 copies (8 lanes write one entry's 128 bytes, so a store has no bank conflicts).
    static_assert(256 * MMA_COPIES / 4 % THREADS == 0, "whole rounds of table stores");
#pragma unroll
    for (int j = 0; j < 256 * MMA_COPIES / 4 / THREADS; ++j) {
        const int i = threadIdx.x + j * THREADS;
        const unsigned v = __ldg(points8 + i / (MMA_COPIES / 4));
        reinterpret_cast<uint4*>(table)[i] = make_uint4(v, v, v, v);
    }
    // This lane's output columns: PACKED, head tq, whose exponentials it stores in the word of heads col0 and col1
    // (with lane tq^1), and whose scale lanes 8*tq.. hold; else heads col0 and col1, whose scales lanes 4*col0 and
    // 4*col1 hold.
    const int col0 = PACKED ? tq & 2 : 2 * tq, col1 = col0 + 1;
    const bool writes = col0 < G;  // this lane stores a pair of heads (the second may be padding)
    // Entry v of this lane's copy of the table is 128 bytes (one word per lane) after entry v - 1, at shared address
    // tab + 128 v. The 128 is read from blockDim so that each address is one IMAD, which issues to the FMA pipe: a
    // constant 128 made it a shift-and-add (LEA) on the integer pipe, which takes a warp's instruction every second
    // cycle and was this loop's bound (PRMT, selects, compares: about half of its instructions).
    const unsigned tab = shared_address(table + (lane & (MMA_COPIES - 1)));
    const unsigned entry = blockDim.x / THREADS * (4 * MMA_COPIES);
    const unsigned norms_at = shared_address(norm_bits) + 4 * gid;  // the pair of tokens gid, gid + 8 of group 0
    // Per-lane constants of the logits, in base 2: 2^l = e^logit; 1 / sqrt(D) of the norms' scale joins them.
    constexpr float LOG2E = 1.4426950408889634f;
    const float unit = 1.f / sqrt_d;

    // The grid is sized to the blocks that fit on the GPU at once, and each block takes a contiguous share of the
    // (row, head, tile) space: it fills its table once, and makes its query's fragments once per (row, head), where a
    // block per tile spent about a tenth of its instructions on both, before its first group.
    const int n_tiles = (N + MMA_TILE - 1) / MMA_TILE, total = B * Hkv * n_tiles;
    const int share = total / gridDim.x, rest = total % gridDim.x;
    const int t_begin = blockIdx.x * share + min((int)blockIdx.x, rest);
    const int t_end = t_begin + share + ((int)blockIdx.x < rest);
    unsigned bq[PARTS][CPT];
    float k0 = 0.f, k1 = 0.f;
    int made_for = -1;  // the (row, head) whose query bq, k0 and k1 hold
    for (int t = t_begin; t < t_end; ++t) {
    const int rh_index = t / n_tiles, tile = t - rh_index * n_tiles;
    const int row = rh_index / Hkv, head = rh_index - row * Hkv;
    const size_t rh = rh_index;
    __syncthreads();  // the previous tile's readers of norm_bits, wm and ws are done
    // The tile's norms (fp16 bits; a NaN pattern marks tokens not selectable, and the tokens past the end of a tile's
    // last group), read once per block, so the token loop waits on no global load but the codes'.
    const int n0 = tile * MMA_TILE, n1 = min(N, n0 + MMA_TILE), n16 = min(n0 + MMA_TILE, (n1 + 15) & ~15);
    {
        // Every load first, each in bounds (token n1 - 1 stands in past the end), then the stores: one round trip per
        // tile. Loads behind each token's tests waited out a round trip each, and held most of the pass's
        // long-scoreboard stalls (Nsight Compute on an H100 machine, 128K, batch 22).
        constexpr int PER = MMA_TILE / THREADS;
        static_assert(MMA_TILE % THREADS == 0, "whole rounds of norms per tile");
        const f16* norm_head = norms + row * norms_row_stride + (size_t)head * N;
        const bool* sel = selectable + row * sel_row_stride + head * sel_head_stride;
        bool ok[PER];
        unsigned short bits[PER];
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int n = min(n0 + (int)threadIdx.x + j * THREADS, n1 - 1);
            ok[j] = sel[n];
            bits[j] = norm_head[n].x;
        }
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int i = threadIdx.x + j * THREADS;
            if (n0 + i < n16)
                norm_bits[(i & ~15) | (i & 7) << 1 | (i >> 3 & 1)] = n0 + i < n1 && ok[j] ? bits[j] : NOT_SELECTABLE;
        }
    }

    // B fragments: column gid of MMA `part` is digit `digit` of query head `hq` (zeros beyond G, and PACKED in the odd
    // columns of the lo digits' MMA); word j holds dims 4c..4c+3 of code c = tq*CPT + j, and k-tile t takes words 2t
    // (b0) and 2t+1 (b1).
    if (rh_index != made_for) {  // uniform over the block
    made_for = rh_index;
    const int hq = PACKED ? gid >> 1 : gid;
    float qv[CPT][4];
    float qmax = 0.f, qsum = 0.f;
    const float* qrow = query + (rh * G + hq) * D;
#pragma unroll
    for (int j = 0; j < CPT; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            qv[j][i] = hq < G ? qrow[4 * (tq * CPT + j) + i] : 0.f;
            qmax = fmaxf(qmax, fabsf(qv[j][i]));
            qsum += fabsf(qv[j][i]);
        }
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) {  // over the quad: the head's D dims
        qmax = fmaxf(qmax, __shfl_xor_sync(0xffffffffu, qmax, off));
        qsum += __shfl_xor_sync(0xffffffffu, qsum, off);
    }
    // A query with a NaN or an infinity scores NaN, as the twin's would (fmaxf drops NaN, the sum keeps it).
    const bool finite = qsum - qsum == 0.f;
    const float s = qmax > 0.f && finite ? Q24_MAX / qmax : 0.f;
    // logit = combined digit dots * down * norm / sqrt(D) * scaling; 1/32 undoes the grid's int8 scale.
    const float down = !finite ? __int_as_float(0x7fc00000) : qmax > 0.f ? qmax / Q24_MAX * 0.03125f : 0.f;
#pragma unroll
    for (int j = 0; j < CPT; ++j) {
        int q24[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) q24[i] = __float2int_rn(qv[j][i] * s);
#pragma unroll
        for (int part = 0; part < PARTS; ++part) {
            const int digit = PACKED ? (part == 1 ? 2 : gid & 1) : part;
            bq[part][j] = PACKED && part == 1 && (gid & 1)
                              ? 0u
                              : pack_s8x4(q24_digit(q24[0], digit), q24_digit(q24[1], digit),
                                          q24_digit(q24[2], digit), q24_digit(q24[3], digit));
        }
    }
    k0 = __shfl_sync(0xffffffffu, down, PACKED ? 8 * tq : 4 * col0) * scaling * LOG2E * unit;
    k1 = __shfl_sync(0xffffffffu, down, 4 * col1) * scaling * LOG2E * unit;
    }
    __syncthreads();  // the table (first tile) and the tile's norms are in place

    // Codes stream through a ring of DEPTH stages per warp (cp.async): DEPTH - 1 groups of 16 tokens are in flight
    // while one is scored, which hides HBM latency that one prefetched group cannot. A group's 16 * M bytes are
    // contiguous in memory and in its slot, so lane l copies bytes 2 * CPT * l onwards (part of token l / 2: one
    // 16-byte copy and one bounds test at D = 128, where a lane's own two tokens took two of each); lanes then read
    // what others copied, hence the warp barrier in `score`. Pointers move on by a constant each group (no 64-bit
    // index products in the loop).
    const int first = n0 + warp * 16;
    const int iters = first < n1 ? (n1 - first + STRIDE - 1) / STRIDE : 0;
    const unsigned char* code_head = codes + row * codes_row_stride + (size_t)head * N * M;
    const unsigned char* src = code_head + (size_t)first * M + 2 * CPT * lane;  // this lane's bytes of the next group
    // The ring's slots as byte offsets; with a power-of-two depth the next slot is one add and one mask.
    constexpr int SLOT = 16 * M;
    auto next_slot = [](int off) {
        if constexpr ((DEPTH & (DEPTH - 1)) == 0) return (off + SLOT) & (DEPTH * SLOT - 1);
        else return off == (DEPTH - 1) * SLOT ? 0 : off + SLOT;
    };
    int next = first + (lane >> 1), slot_in = 0, slot_out = 0;  // the token this lane copies part of next
    const unsigned char* ring_a = &stage[warp][0][gid * M + tq * CPT];  // what this lane reads: token na's codes
    const unsigned ring_copy = shared_address(&stage[warp][0][2 * CPT * lane]);
    auto issue = [&]() {  // the next group into slot `slot_in`; past the end, a zero fill that reads nothing
        cp_async_to<2 * CPT>(ring_copy + slot_in, src, next < n1);
        cp_async_commit();
        next += STRIDE;
        src += (size_t)STRIDE * M;
        slot_in = next_slot(slot_in);
    };
    unsigned* out_a = exps + rh * N * pairs + (size_t)(first + gid) * pairs + (col0 >> 1);  // token na's word
    float* out_g = gmaxes + rh * groups * (2 * pairs) + (size_t)(first >> 4) * (2 * pairs) + col0;
    const int out_step = STRIDE * pairs, gmax_step = STRIDE / 16 * (2 * pairs);
    float m0 = NEG_INF, s0 = 0.f, m1 = NEG_INF, s1 = 0.f;  // this tile's base-2 states of col0, col1 (PACKED: head tq in m0, s0)

    // One group of 16 tokens: its MMAs (`score`), then its logits, maxima, exponentials and states (`finish`). The loop
    // finishes group i - 1 after scoring group i: the two chains do not depend on each other, so the scheduler
    // overlaps the previous group's shuffles and exponentials with this group's table reads and MMAs (one group per
    // iteration left the issue slot idle on their latencies). `finish` has no branches for the same reason: its
    // stores are predicated and add_group2 selects.
    struct Group {
        int acc[PARTS][4];
        float scale_a, scale_b;  // the norms of tokens na and nb
        bool ok_a, ok_b, in_a, in_b;
    };
    int na = first + gid;
    auto score = [&](Group& gr) {
        // This group's copies are done (DEPTH - 2 newer ones may not be) and, past the barrier, visible to the whole
        // warp; every lane has read the previous group, whose slot the issue below refills.
        cp_async_wait<DEPTH - 2>();
        __syncwarp();
        const int nb = na + 8;
        unsigned wa[W], wb[W];
        load_words<CPT>(ring_a + slot_out, wa);
        load_words<CPT>(ring_a + slot_out + 8 * M, wb);
        slot_out = next_slot(slot_out);
        issue();
        {
            // Tokens na and nb in one read, without a bounds test: a scored group starts before n1, and the rest of
            // its last 16 tokens are marked not selectable.
            gr.in_a = na < n1;
            gr.in_b = nb < n1;
            const unsigned both = load_shared(norms_at + (((na - n0) >> 4) << 5));
            const unsigned short ha = both & 0xffff, hb = both >> 16;
            gr.ok_a = ha != NOT_SELECTABLE;
            gr.ok_b = hb != NOT_SELECTABLE;
            gr.scale_a = f16_value(ha);
            gr.scale_b = f16_value(hb);
        }
        na += STRIDE;
#pragma unroll
        for (int part = 0; part < PARTS; ++part)
#pragma unroll
            for (int i = 0; i < 4; ++i) gr.acc[part][i] = 0;
#pragma unroll
        for (int t = 0; t < NK; ++t) {
            // Codes 2t and 2t+1 of this thread's CPT: bytes 2(t%2) and 2(t%2)+1 of word t/2, each moved to bits 0-7.
            const unsigned xa = wa[t >> 1], xb = wb[t >> 1];
            const unsigned sel0 = 0x4440 | (2 * (t & 1)), sel1 = 0x4440 | (2 * (t & 1) + 1);
            const unsigned a[4] = {load_shared(__byte_perm(xa, 0, sel0) * entry + tab),
                                   load_shared(__byte_perm(xb, 0, sel0) * entry + tab),
                                   load_shared(__byte_perm(xa, 0, sel1) * entry + tab),
                                   load_shared(__byte_perm(xb, 0, sel1) * entry + tab)};
#pragma unroll
            for (int part = 0; part < PARTS; ++part)
                imma_m16n8k32(gr.acc[part], a, bq[part][2 * t], bq[part][2 * t + 1]);
        }
    };
    // Exponentials are stored as 2^15 * 2^(l - group max) (fp16 keeps small ones normal), which 2^(l - (max - 15))
    // gives without a multiply; the tile sums are of these scaled values too, so code_scores_finish's ratio of the two
    // needs no unscaling.
    constexpr float UP_LOG2 = 15.f;
    const unsigned marked = col0 == 0 ? NOT_SELECTABLE : 0u;  // the first word's low half marks the token
    auto finish = [&](const Group& gr) {
        const int(&acc)[PARTS][4] = gr.acc;
        if constexpr (PACKED) {
            // acc[0] holds the hi and mid digits' dots of head tq (tokens na, na, nb, nb), acc[1][0] and acc[1][2]
            // its lo digit's. mid * 2^8 + lo is exact in int32 (|mid dot| < 2^22); the hi digit joins it in one fp32
            // rounding. Computed for every token, then selected (a conditional expression here became a branch).
            const float ra = fmaf((float)acc[0][0], 65536.f, (float)(acc[0][1] * 256 + acc[1][0])) * k0 * gr.scale_a;
            const float rb = fmaf((float)acc[0][2], 65536.f, (float)(acc[0][3] * 256 + acc[1][2])) * k0 * gr.scale_b;
            const float la = gr.ok_a ? ra : NEG_INF, lb = gr.ok_b ? rb : NEG_INF;
            // Head tq's max over the group's 16 tokens: over the 8 row groups (lane bits 2..4).
            float g = fmaxf(la, lb);
#pragma unroll
            for (int off = 4; off < 32; off <<= 1) g = fmaxf(g, __shfl_xor_sync(0xffffffffu, g, off));
            // 2^(-inf - g) is 0 for a finite g; a group with nothing selectable has g = -inf and stores zeros, which
            // -inf - (-FLT_MAX) gives without a test.
            const float gs = fmaxf(g, NEG_FLT_MAX) - UP_LOG2;
            const float ea = exp2_ftz(la - gs), eb = exp2_ftz(lb - gs);
            // A token's word holds heads col0 and col1: lanes tq and tq^1 swap one exponential, so the even lane
            // stores token na's word and the odd lane token nb's.
            const bool even = (tq & 1) == 0;
            const float got = __shfl_xor_sync(0xffffffffu, even ? eb : ea, 1);
            const unsigned word = pack_f16x2(even ? ea : got, even ? got : eb);
            const bool ok = even ? gr.ok_a : gr.ok_b;
            store_if(out_a + (even ? 0 : 8 * pairs), ok ? word : marked, writes && (even ? gr.in_a : gr.in_b));
            store_if(out_g + (tq & 1), g, writes && gid == 0);
            add_group2(m0, s0, g, ea + eb);
        } else {
            float c[4];  // (token na, col0), (na, col1), (nb, col0), (nb, col1)
#pragma unroll
            for (int i = 0; i < 4; ++i) c[i] = fmaf((float)acc[0][i], 65536.f, (float)(acc[1][i] * 256 + acc[PARTS - 1][i]));
            const float la0 = gr.ok_a ? c[0] * k0 * gr.scale_a : NEG_INF, la1 = gr.ok_a ? c[1] * k1 * gr.scale_a : NEG_INF;
            const float lb0 = gr.ok_b ? c[2] * k0 * gr.scale_b : NEG_INF, lb1 = gr.ok_b ? c[3] * k1 * gr.scale_b : NEG_INF;
            // Each column's max over the group's 16 tokens: over the 8 row groups (lane bits 2..4) of the quad lane.
            float g0 = fmaxf(la0, lb0), g1 = fmaxf(la1, lb1);
#pragma unroll
            for (int off = 4; off < 32; off <<= 1) {
                g0 = fmaxf(g0, __shfl_xor_sync(0xffffffffu, g0, off));
                g1 = fmaxf(g1, __shfl_xor_sync(0xffffffffu, g1, off));
            }
            const float gs0 = fmaxf(g0, NEG_FLT_MAX) - UP_LOG2, gs1 = fmaxf(g1, NEG_FLT_MAX) - UP_LOG2;  // as above
            const float ea0 = exp2_ftz(la0 - gs0), eb0 = exp2_ftz(lb0 - gs0);
            const float ea1 = exp2_ftz(la1 - gs1), eb1 = exp2_ftz(lb1 - gs1);
            store_if(out_a, gr.ok_a ? pack_f16x2(ea0, ea1) : marked, writes && gr.in_a);
            store_if(out_a + 8 * pairs, gr.ok_b ? pack_f16x2(eb0, eb1) : marked, writes && gr.in_b);
            store_if(out_g, g0, g1, writes && gid == 0);
            add_group2(m0, s0, g0, ea0 + eb0);
            add_group2(m1, s1, g1, ea1 + eb1);
        }
        out_a += out_step;
        out_g += gmax_step;
    };
#pragma unroll
    for (int i = 0; i < DEPTH - 1; ++i) issue();
    if (iters > 0) {
        // Two groups per iteration, their roles swapped in the second half, so no group is copied from one to the
        // other (the copy of prev = cur took ~17 of 214 instructions per group at D = 128, G = 4).
        Group ga, gb;
        score(ga);
        int it = 1;
        for (; it + 1 < iters; it += 2) {
            score(gb);
            finish(ga);
            score(ga);
            finish(gb);
        }
        if (it < iters) {
            score(gb);
            finish(ga);
            finish(gb);
        } else {
            finish(ga);
        }
    }
    cp_async_wait<0>();

    // The quad's columns over the warp's 8 row groups, then over the block's warps. PACKED, lane tq holds head tq's
    // state alone.
    for (int off = 4; off < 32; off <<= 1) {
        merge_state<true>(m0, s0, __shfl_xor_sync(0xffffffffu, m0, off), __shfl_xor_sync(0xffffffffu, s0, off));
        if constexpr (!PACKED)
            merge_state<true>(m1, s1, __shfl_xor_sync(0xffffffffu, m1, off), __shfl_xor_sync(0xffffffffu, s1, off));
    }
    if (gid == 0) {
        if constexpr (PACKED) {
            wm[warp][tq] = m0; ws[warp][tq] = s0;
        } else {
            wm[warp][col0] = m0; ws[warp][col0] = s0;
            wm[warp][col1] = m1; ws[warp][col1] = s1;
        }
    }
    __syncthreads();
    if (threadIdx.x < G) {
        float mm = NEG_INF, ss = 0.f;
#pragma unroll
        for (int w = 0; w < THREADS / 32; ++w) merge_state<true>(mm, ss, wm[w][threadIdx.x], ws[w][threadIdx.x]);
        const size_t p = (rh * G + threadIdx.x) * n_tiles + tile;
        part_max[p] = mm;
        part_sum[p] = ss;
    }
    }
}

#define CODE_MMA(CPT, G_MAX, PACKED, THREADS, MIN_BLOCKS)                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) code_states_mma_k##CPT##_g##G_MAX(          \
        float* part_max, float* part_sum, unsigned* exps, float* gmaxes, const float* query,                      \
        const unsigned char* codes, long long codes_row_stride, const f16* norms, long long norms_row_stride,    \
        const bool* selectable, long long sel_row_stride, long long sel_head_stride, const unsigned* points8,    \
        float scaling, float sqrt_d, int B, int Hkv, int G, int N) {                                             \
        code_states_mma_impl<CPT, PACKED>(part_max, part_sum, exps, gmaxes, query, codes, codes_row_stride,      \
                                          norms, norms_row_stride, selectable, sel_row_stride, sel_head_stride,  \
                                          points8, scaling, sqrt_d, B, Hkv, G, N);                               \
    }

// Kernel names: k<CPT> (D = 16 * CPT), g<largest G> (4: two MMAs per k-tile, 8: three).
CODE_MMA(4, 4, true, MMA_THREADS, 1)
CODE_MMA(4, 8, false, MMA_THREADS, 1)
CODE_MMA(8, 4, true, 32 * MMA_WARPS_K8, MMA_MIN_BLOCKS_K8)  // D = 128
CODE_MMA(8, 8, false, 32 * MMA_WARPS_K8, MMA_MIN_BLOCKS_K8)
CODE_MMA(16, 4, true, MMA_THREADS, 1)
CODE_MMA(16, 8, false, MMA_THREADS, 1)

#define FINISH_THREADS 256
#define FINISH_TILE 2048  // tokens per block (score_codes.py's _FINISH_TILE); a multiple of 16

/// \brief The PAIRS words of one token's exponentials at `p` (PAIRS-word aligned), as one load where a vector fits.
template <int PAIRS> __device__ __forceinline__ void load_pairs(const unsigned* p, unsigned (&w)[PAIRS]) {
    if constexpr (PAIRS == 4) {
        const uint4 v = *reinterpret_cast<const uint4*>(p);
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    } else if constexpr (PAIRS == 2) {
        const uint2 v = *reinterpret_cast<const uint2*>(p);
        w[0] = v.x; w[1] = v.y;
    } else {
#pragma unroll
        for (int i = 0; i < PAIRS; ++i) w[i] = p[i];
    }
}

/// \brief The scores from `code_states_mma`'s outputs: each query head's row state merged from the tiles', then
/// max over the group of exp(logit - row max) / row sum = exps * 2^(group max - row max) / row sum (in base 2, as
/// code_states_mma keeps them; its exponentials and tile sums both carry a factor 2^15, which the ratio cancels).
///
/// Every thread issues all its loads before it uses any: each reads in bounds (the tile's last token stands in past
/// its end) and without a branch. A load per token behind a bounds test waited out one round trip per token
/// (Nsight Compute on an H100 machine, 128K, batch 22: the first use of each load held 26% of the stall samples).
///
/// \param scores    [B, Hkv, N] fp32, out: `fill` where not selectable
/// \param exps, gmaxes  [B, Hkv, N, Gp] fp16 and [B, Hkv, NG, Gp] fp32, as code_states_mma writes them
///                  (PAIRS = Gp / 2 words per token)
/// \param part_max, part_sum  [B, Hkv, G, NT] fp32, as code_states_mma writes them
/// \param fill      the score of a token that is not selectable (0, or -inf for a top-k that must never take it)
/// Launch: grid (ceil(N / FINISH_TILE), Hkv, B), block FINISH_THREADS threads.
template <int PAIRS>
__device__ __forceinline__ void code_scores_finish_impl(float* scores, const unsigned* exps, const float* gmaxes,
                                                        const float* part_max, const float* part_sum, int Hkv,
                                                        int G, int N, int n_tiles, float fill) {
    constexpr int PER = FINISH_TILE / FINISH_THREADS;        // tokens per thread
    constexpr int FACTORS = FINISH_TILE / 16 * 8 / FINISH_THREADS;  // group maxima per thread, at most
    __shared__ float gm[8], rs[8], factor[FINISH_TILE / 16][8];
    const int head = blockIdx.y, row = blockIdx.z, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int groups = (N + 15) / 16;
    const size_t rh = (size_t)row * Hkv + head;
    const int n0 = blockIdx.x * FINISH_TILE, n1 = min(N, n0 + FINISH_TILE), grp0 = n0 >> 4;
    const int count = (n1 - n0 + 15) >> 4;
    // The tile's exponentials and group maxima, in flight while the row states are merged.
    const unsigned* exps_row = exps + rh * N * PAIRS;
    unsigned w[PER][PAIRS];
#pragma unroll
    for (int u = 0; u < PER; ++u)
        load_pairs<PAIRS>(exps_row + (size_t)min(n0 + (int)threadIdx.x + u * FINISH_THREADS, n1 - 1) * PAIRS, w[u]);
    const float* gmax_row = gmaxes + rh * groups * (2 * PAIRS);
    float x[FACTORS];
#pragma unroll
    for (int f = 0; f < FACTORS; ++f) {
        const int i = min((int)threadIdx.x + f * FINISH_THREADS, count * G - 1), j = i / G;
        x[f] = gmax_row[(size_t)(grp0 + j) * (2 * PAIRS) + (i - j * G)];
    }
    // Warp g merges query head g's tile states, its lanes a tile each.
    for (int g = warp; g < G; g += FINISH_THREADS / 32) {
        float mm = NEG_INF, ss = 0.f;
        const size_t p = (rh * G + g) * n_tiles;
        for (int t = lane; t < n_tiles; t += 32) merge_state<true>(mm, ss, part_max[p + t], part_sum[p + t]);
        for (int off = 16; off > 0; off >>= 1)
            merge_state<true>(mm, ss, __shfl_xor_sync(0xffffffffu, mm, off), __shfl_xor_sync(0xffffffffu, ss, off));
        if (lane == 0) { gm[g] = mm; rs[g] = 1.f / ss; }
    }
    __syncthreads();
#pragma unroll
    for (int f = 0; f < FACTORS; ++f) {
        const int i = threadIdx.x + f * FINISH_THREADS, j = i / G, g = i - j * G;
        if (i < count * G)
            factor[j][g] = x[f] == NEG_INF || gm[g] == NEG_INF ? 0.f : exp2_ftz(x[f] - gm[g]) * rs[g];
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < PER; ++u) {
        const int n = n0 + threadIdx.x + u * FINISH_THREADS;
        if (n >= n1) continue;
        const float* f = factor[(n - n0) >> 4];
        float best = 0.f;
#pragma unroll
        for (int p = 0; p < PAIRS; ++p) {
            best = fmaxf(best, f16_value(w[u][p] & 0xffffu) * f[2 * p]);
            if (2 * p + 1 < G) best = fmaxf(best, f16_value(w[u][p] >> 16) * f[2 * p + 1]);
        }
        scores[rh * N + n] = (w[u][0] & 0xffffu) == NOT_SELECTABLE ? fill : best;
    }
}

#define CODE_FINISH(PAIRS)                                                                                         \
    extern "C" __global__ void __launch_bounds__(FINISH_THREADS) code_scores_finish_p##PAIRS(                       \
        float* scores, const unsigned* exps, const float* gmaxes, const float* part_max, const float* part_sum,    \
        int Hkv, int G, int N, int n_tiles, float fill) {                                                          \
        code_scores_finish_impl<PAIRS>(scores, exps, gmaxes, part_max, part_sum, Hkv, G, N, n_tiles, fill);        \
    }

// Kernel names: p<Gp / 2>, the words of exponentials per token (G = 1-2, 3-4, 5-6, 7-8).
CODE_FINISH(1)
CODE_FINISH(2)
CODE_FINISH(3)
CODE_FINISH(4)
