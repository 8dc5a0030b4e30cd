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
// Why: the kernel above reads its codes at ~150 GB/s on an H200 (under 4% of HBM bandwidth;
// benchmarks/results/scoring_cuda.md): each code is a 16-byte random read of shared memory, which conflicts on
// banks, then p*G fp32 multiply-adds. Here each code is dequantised into the A operand of an m16n8k16 MMA (16 tokens
// x 16 dims) with one conflict-free 8-byte read, and the tensor cores multiply by the group's queries (B: 16 dims x 8
// query heads). D dims of a token are its M = D/4 codes: the MMA's k index only has to pair key and query dims the
// same way, so thread `tq` of a quad takes codes tq*KT .. tq*KT + KT-1 of its two tokens (one load each) and
// k-slots (2tq, 2tq+1, 2tq+8, 2tq+9) of k-tile kt hold the 4 dims of code tq*KT + kt.
//
// Exactness: 4-D grid points are fp16 values (quant/higgs.py rounds them), so the A operand is exact; each query is
// scaled by a power of two into fp16's range and split into hi + lo fp16 parts (two MMAs), so the products carry
// ~2^-22 relative error and the fp32 sums differ from the twin's only in order, as the fp32 kernel's do.
//
// One pass over the codes (`code_states_mma`): per-tile softmax states, and each logit as an fp16 exponential relative
// to the max of its head over the 16 tokens an MMA covers, with that max in fp32. A second kernel (`code_scores_finish`)
// merges the tiles' states into each head's row state and turns the exponentials into scores, max over the group,
// reading 2Gp + Gp/4 bytes per token (Gp = G rounded up to even; pass 1 writes as many) where reading the codes again
// would be M + 3 (codes, norm, mask: 35 at D = 128) and redo every lookup and MMA (which, not bytes, held the earlier
// second pass to the first pass's time).
//
// Precision: exp(l - group max) is in [0, 1]; stored times 2^15 it is a normal fp16 down to 2^-29 (~1.9e-9), so
// where it is at least that the score carries 2^-11 relative error (plus __expf's ~1e-5), and below it the score is
// within 2^-39 absolute of the twin's (the factor that scales it is at most 1). The states are summed from the fp32
// exponentials.
//
// Legend: KT = M/4 k-tiles of 16 dims, gid = lane/4 (MMA row group; B column = query head gid), tq = lane % 4.

#define MMA_THREADS 128
// The grid of D = 128 (KT = 8), the most common head dim: blocks per SM that registers are budgeted for, and stages of
// the code ring (shared memory sets the blocks too: 4 at 5 stages, 5 at 4). score_codes.py passes its own values.
#ifndef MMA_MIN_BLOCKS_K8
#define MMA_MIN_BLOCKS_K8 4
#endif
#ifndef MMA_DEPTH_K8
#define MMA_DEPTH_K8 5
#endif
#define MMA_TILE 2048   // tokens per block (score_codes.py's _MMA_TILE)
#define MMA_COPIES 16  // copies of the grid in shared memory, one per lane of a half-warp: no bank conflicts
#define NOT_SELECTABLE 0x7e00  // a NaN fp16 pattern: no key norm is NaN

/// \brief Add a group of logits, given as their max `g` and the sum of exp(logit - g), to a softmax state; a group
/// with nothing selectable (g = -inf) adds nothing.
__device__ __forceinline__ void add_group(float& m, float& s, float g, float sum) {
    if (g == NEG_INF) return;
    if (g > m) {
        s = s * __expf(m - g) + sum;  // m = -inf at first: s = 0
        m = g;
    } else {
        s += sum * __expf(g - m);
    }
}

/// \brief The KT code bytes of one token at `p` (shared memory, KT-byte aligned) as KT/4 words.
template <int KT> __device__ __forceinline__ void load_words(const unsigned char* p, unsigned (&w)[KT / 4]) {
    if constexpr (KT == 4) {
        w[0] = *reinterpret_cast<const unsigned*>(p);
    } else if constexpr (KT == 8) {
        const uint2 v = *reinterpret_cast<const uint2*>(p);
        w[0] = v.x; w[1] = v.y;
    } else {
        const uint4 v = *reinterpret_cast<const uint4*>(p);
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    }
}

/// \brief Copy N bytes from global to shared memory asynchronously (zeros when `!valid`; `src` must still point
/// into the tensor).
template <int N> __device__ __forceinline__ void cp_async(void* dst, const void* src, bool valid) {
#if __CUDA_ARCH__ >= 800
    unsigned addr;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(addr) : "l"(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(addr), "l"(src), "n"(N), "r"(valid ? N : 0));
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

/// \brief The pass over the codes. One block per (tile of tokens, KV head, row), 4 warps; each warp takes 16 tokens
/// (one MMA group) at a time.
///
/// \param part_max, part_sum  [B, Hkv, G, NT] fp32, out: each tile's max and sum of exp(logit - max) per query head
/// \param exps      [B, Hkv, N, Gp] fp16 (Gp = G rounded up to even, as pairs of fp16 in 32-bit words), out:
///                  2^15 * exp(logit - group max), 0 where not selectable; entries g >= G hold anything
/// \param gmaxes    [B, Hkv, NG, Gp] fp32 (NG = ceil(N / 16)), out: the max logit of each group of 16 tokens per
///                  query head, -inf where none is selectable; entries g >= G hold anything
/// \param query     [B, Hkv, G, D] fp32 rotated queries (one query token), contiguous
/// \param codes     uint8 [B, Hkv, N, M], M = 4*KT, as code_logits_impl's (KT-byte aligned)
/// \param norms, selectable, grid, scaling, sqrt_d  as code_logits_impl's
/// Launch: grid (NT, Hkv, B), block 128 threads, MMA_TILE tokens per block.
template <int KT>
__device__ __forceinline__ void code_states_mma_impl(float* part_max, float* part_sum, unsigned* exps, float* gmaxes,
                                                     const float* query, const unsigned char* codes,
                                                     long long codes_row_stride, const f16* norms,
                                                     long long norms_row_stride, const bool* selectable,
                                                     long long sel_row_stride, long long sel_head_stride,
                                                     const float* grid, float scaling, float sqrt_d, int Hkv, int G,
                                                     int N) {
    constexpr int M = 4 * KT, D = 4 * M, W = KT / 4, STRIDE = MMA_THREADS / 32 * 16;
    // Stages of the code ring; under 48 KiB of static shared memory in all.
    constexpr int DEPTH = KT == 16 ? 2 : KT == 8 ? MMA_DEPTH_K8 : 5;
    __shared__ uint2 table[256 * MMA_COPIES];
    __shared__ unsigned short norm_bits[MMA_TILE];
    __shared__ __align__(16) unsigned char stage[MMA_THREADS / 32][DEPTH][16 * M];
    __shared__ float wm[MMA_THREADS / 32][8], ws[MMA_THREADS / 32][8];
    const int head = blockIdx.y, row = blockIdx.z, n_tiles = gridDim.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gid = lane >> 2, tq = lane & 3;
    const int copy = lane & (MMA_COPIES - 1);
    const int pairs = (G + 1) / 2, groups = (N + 15) / 16;  // Gp / 2 words per token; NG
    const size_t rh = (size_t)row * Hkv + head;

    for (int i = threadIdx.x; i < 256 * MMA_COPIES; i += MMA_THREADS) {
        const float4 pt = reinterpret_cast<const float4*>(grid)[i / MMA_COPIES];
        table[i] = make_uint2(pack_f16x2(pt.x, pt.y), pack_f16x2(pt.z, pt.w));
    }
    // The tile's norms (fp16 bits; a NaN pattern marks tokens not selectable), read once per block, so the token loop
    // waits on no global load but the codes'.
    const int n0 = blockIdx.x * MMA_TILE, n1 = min(N, n0 + MMA_TILE);
    {
        const f16* norm_head = norms + row * norms_row_stride + (size_t)head * N;
        const bool* sel = selectable + row * sel_row_stride + head * sel_head_stride;
#pragma unroll 4
        for (int n = n0 + threadIdx.x; n < n1; n += MMA_THREADS)
            norm_bits[n - n0] = sel[n] ? norm_head[n].x : NOT_SELECTABLE;
    }

    // B fragments: column gid = query head gid of the group (zeros beyond G), dims 4c..4c+3 of code c = tq*KT + kt.
    float qv[KT][4];
    float qmax = 0.f;
    const float* qrow = query + (rh * G + gid) * D;
#pragma unroll
    for (int kt = 0; kt < KT; ++kt)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            qv[kt][j] = gid < G ? qrow[4 * (tq * KT + kt) + j] : 0.f;
            qmax = fmaxf(qmax, fabsf(qv[kt][j]));
        }
    qmax = fmaxf(qmax, __shfl_xor_sync(0xffffffffu, qmax, 1));
    qmax = fmaxf(qmax, __shfl_xor_sync(0xffffffffu, qmax, 2));
    // Scale the head by 2^k so that its largest coordinate is in [2^13, 2^14): inside fp16's range, lo parts normal.
    const int k = qmax > 0.f ? max(-126, min(126, 13 - (((__float_as_int(qmax) >> 23) & 0xff) - 127))) : 0;
    unsigned bhi[KT][2], blo[KT][2];
#pragma unroll
    for (int kt = 0; kt < KT; ++kt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float x0 = qv[kt][2 * h] * pow2(k), x1 = qv[kt][2 * h + 1] * pow2(k);
            const unsigned short h0 = f16_bits(x0), h1 = f16_bits(x1);
            bhi[kt][h] = (unsigned)h0 | ((unsigned)h1 << 16);
            blo[kt][h] = pack_f16x2(x0 - f16_value(h0), x1 - f16_value(h1));
        }
    // Output columns 2tq and 2tq+1 are query heads whose scales lanes 8tq and 8tq+4 hold.
    const int col0 = 2 * tq, col1 = 2 * tq + 1;
    const bool writes = col0 < G;  // this lane's pair of columns is stored (the second may be padding)
    const float down0 = pow2(-__shfl_sync(0xffffffffu, k, 4 * col0));
    const float down1 = pow2(-__shfl_sync(0xffffffffu, k, 4 * col1));
    __syncthreads();

    const unsigned char* code_head = codes + row * codes_row_stride + (size_t)head * N * M + tq * KT;
    const unsigned char* entries = reinterpret_cast<const unsigned char*>(table + copy);  // entry v at v << 7 bytes
    unsigned char* ring_a = &stage[warp][0][gid * M + tq * KT];
    unsigned char* ring_b = &stage[warp][0][(gid + 8) * M + tq * KT];
    unsigned* exps_head = exps + rh * N * pairs + tq;
    float* gmax_head = gmaxes + rh * groups * (2 * pairs) + col0;
    const float unit = 1.f / sqrt_d;

    // Codes stream through a ring of DEPTH stages per warp (cp.async): DEPTH - 1 groups of 16 tokens are in flight
    // while one is scored, which hides HBM latency that one prefetched group cannot. Each thread reads back only the
    // bytes it copied itself, so no barrier is needed.
    const int first = n0 + warp * 16;
    const int iters = first < n1 ? (n1 - first + STRIDE - 1) / STRIDE : 0;
    auto issue = [&](int i) {  // this warp's i-th group into slot i % DEPTH; past the end, a zero-filled no-op
        const int slot = (i % DEPTH) * 16 * M, na = first + i * STRIDE + gid, nb = na + 8;
        cp_async<KT>(ring_a + slot, code_head + (size_t)min(na, n1 - 1) * M, na < n1);
        cp_async<KT>(ring_b + slot, code_head + (size_t)min(nb, n1 - 1) * M, nb < n1);
        cp_async_commit();
    };
    float m0 = NEG_INF, s0 = 0.f, m1 = NEG_INF, s1 = 0.f;  // this tile's states of columns col0, col1
#pragma unroll
    for (int i = 0; i < DEPTH - 1; ++i) issue(i);
    for (int it = 0; it < iters; ++it) {
        issue(it + DEPTH - 1);
        cp_async_wait<DEPTH - 1>();
        const int base = first + it * STRIDE, na = base + gid, nb = na + 8;
        unsigned wa[W], wb[W];
        load_words<KT>(ring_a + (it % DEPTH) * 16 * M, wa);
        load_words<KT>(ring_b + (it % DEPTH) * 16 * M, wb);
        const bool in_a = na < n1, in_b = nb < n1;
        const unsigned short ha = in_a ? norm_bits[na - n0] : NOT_SELECTABLE;
        const unsigned short hb = in_b ? norm_bits[nb - n0] : NOT_SELECTABLE;
        const bool ok_a = ha != NOT_SELECTABLE, ok_b = hb != NOT_SELECTABLE;
        const float scale_a = f16_value(ha) * unit, scale_b = f16_value(hb) * unit;

        // Four accumulators (hi/lo parts x even/odd k-tiles): four short dependency chains of MMAs, not one.
        float acc[4][4] = {};
#pragma unroll
        for (int kt = 0; kt < KT; ++kt) {
            const int shift = 8 * (kt & 3);
            const uint2 ea = *reinterpret_cast<const uint2*>(entries + (((wa[kt >> 2] >> shift) & 0xffu) << 7));
            const uint2 eb = *reinterpret_cast<const uint2*>(entries + (((wb[kt >> 2] >> shift) & 0xffu) << 7));
            const unsigned a[4] = {ea.x, eb.x, ea.y, eb.y};
            mma_m16n8k16(acc[kt & 1], a, bhi[kt][0], bhi[kt][1]);
            mma_m16n8k16(acc[2 + (kt & 1)], a, blo[kt][0], blo[kt][1]);
        }
        float c[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) c[i] = (acc[0][i] + acc[1][i]) + (acc[2][i] + acc[3][i]);
        // c: (token na, col0), (na, col1), (nb, col0), (nb, col1)
        const float la0 = ok_a ? c[0] * down0 * scale_a * scaling : NEG_INF;
        const float la1 = ok_a ? c[1] * down1 * scale_a * scaling : NEG_INF;
        const float lb0 = ok_b ? c[2] * down0 * scale_b * scaling : NEG_INF;
        const float lb1 = ok_b ? c[3] * down1 * scale_b * scaling : NEG_INF;
        // Each column's max over the group's 16 tokens: over the 8 row groups (lane bits 2..4) of the quad lane.
        float g0 = fmaxf(la0, lb0), g1 = fmaxf(la1, lb1);
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) {
            g0 = fmaxf(g0, __shfl_xor_sync(0xffffffffu, g0, off));
            g1 = fmaxf(g1, __shfl_xor_sync(0xffffffffu, g1, off));
        }
        // exp(-inf - g) is 0 for a finite g; a group with nothing selectable has g = -inf and stores zeros.
        const float ea0 = g0 == NEG_INF ? 0.f : __expf(la0 - g0), eb0 = g0 == NEG_INF ? 0.f : __expf(lb0 - g0);
        const float ea1 = g1 == NEG_INF ? 0.f : __expf(la1 - g1), eb1 = g1 == NEG_INF ? 0.f : __expf(lb1 - g1);
        if (writes) {
            constexpr float UP = 32768.f;  // 2^15, undone by code_scores_finish
            if (in_a) exps_head[(size_t)na * pairs] = pack_f16x2(ea0 * UP, ea1 * UP);
            if (in_b) exps_head[(size_t)nb * pairs] = pack_f16x2(eb0 * UP, eb1 * UP);
            if (gid == 0) *reinterpret_cast<float2*>(gmax_head + (size_t)(base >> 4) * (2 * pairs)) = make_float2(g0, g1);
        }
        add_group(m0, s0, g0, ea0 + eb0);
        add_group(m1, s1, g1, ea1 + eb1);
    }
    cp_async_wait<0>();

    // The quad's columns over the warp's 8 row groups, then over the block's warps.
    for (int off = 4; off < 32; off <<= 1) {
        merge_state(m0, s0, __shfl_xor_sync(0xffffffffu, m0, off), __shfl_xor_sync(0xffffffffu, s0, off));
        merge_state(m1, s1, __shfl_xor_sync(0xffffffffu, m1, off), __shfl_xor_sync(0xffffffffu, s1, off));
    }
    if (gid == 0) {
        wm[warp][col0] = m0; ws[warp][col0] = s0;
        wm[warp][col1] = m1; ws[warp][col1] = s1;
    }
    __syncthreads();
    if (threadIdx.x < G) {
        float mm = NEG_INF, ss = 0.f;
#pragma unroll
        for (int w = 0; w < MMA_THREADS / 32; ++w) merge_state(mm, ss, wm[w][threadIdx.x], ws[w][threadIdx.x]);
        const size_t p = (rh * G + threadIdx.x) * n_tiles + blockIdx.x;
        part_max[p] = mm;
        part_sum[p] = ss;
    }
}

#define CODE_MMA(KT, MIN_BLOCKS)                                                                                   \
    extern "C" __global__ void __launch_bounds__(MMA_THREADS, MIN_BLOCKS) code_states_mma_k##KT(                              \
        float* part_max, float* part_sum, unsigned* exps, float* gmaxes, const float* query,                      \
        const unsigned char* codes, long long codes_row_stride, const f16* norms, long long norms_row_stride,    \
        const bool* selectable, long long sel_row_stride, long long sel_head_stride, const float* grid,          \
        float scaling, float sqrt_d, int Hkv, int G, int N) {                                                    \
        code_states_mma_impl<KT>(part_max, part_sum, exps, gmaxes, query, codes, codes_row_stride, norms,        \
                                 norms_row_stride, selectable, sel_row_stride, sel_head_stride, grid, scaling,   \
                                 sqrt_d, Hkv, G, N);                                                             \
    }

CODE_MMA(4, 1)                  // D = 64: ~90 registers, so 5 blocks per SM whatever the bound
CODE_MMA(8, MMA_MIN_BLOCKS_K8)  // D = 128
CODE_MMA(16, 1)                 // D = 256: ~150 registers, 3 blocks per SM

#define FINISH_THREADS 256
#define FINISH_TILE 2048  // tokens per block (score_codes.py's _FINISH_TILE); a multiple of 16

/// \brief The scores from `code_states_mma`'s outputs: each query head's row state merged from the tiles', then
/// max over the group of exp(logit - row max) / row sum = exps * 2^-15 * exp(group max - row max) / row sum.
///
/// \param scores    [B, Hkv, N] fp32, out: 0 where not selectable or where the head has nothing selectable
/// \param exps, gmaxes  [B, Hkv, N, Gp] fp16 and [B, Hkv, NG, Gp] fp32, as code_states_mma writes them
/// \param part_max, part_sum  [B, Hkv, G, NT] fp32, as code_states_mma writes them
/// Launch: grid (ceil(N / FINISH_TILE), Hkv, B), block FINISH_THREADS threads.
extern "C" __global__ void __launch_bounds__(FINISH_THREADS) code_scores_finish(
    float* scores, const unsigned* exps, const float* gmaxes, const float* part_max, const float* part_sum, int Hkv,
    int G, int N, int n_tiles) {
    __shared__ float gm[8], rs[8], factor[FINISH_TILE / 16][8];
    const int head = blockIdx.y, row = blockIdx.z, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int pairs = (G + 1) / 2, groups = (N + 15) / 16;
    const size_t rh = (size_t)row * Hkv + head;
    // Warp g merges query head g's tile states, its lanes a tile each.
    for (int g = warp; g < G; g += FINISH_THREADS / 32) {
        float mm = NEG_INF, ss = 0.f;
        const size_t p = (rh * G + g) * n_tiles;
        for (int t = lane; t < n_tiles; t += 32) merge_state(mm, ss, part_max[p + t], part_sum[p + t]);
        for (int off = 16; off > 0; off >>= 1)
            merge_state(mm, ss, __shfl_xor_sync(0xffffffffu, mm, off), __shfl_xor_sync(0xffffffffu, ss, off));
        if (lane == 0) { gm[g] = mm; rs[g] = 1.f / ss; }
    }
    __syncthreads();
    const int n0 = blockIdx.x * FINISH_TILE, n1 = min(N, n0 + FINISH_TILE), grp0 = n0 >> 4;
    const int count = (n1 - n0 + 15) >> 4;
    const float* gmax_row = gmaxes + rh * groups * (2 * pairs);
    for (int i = threadIdx.x; i < count * G; i += FINISH_THREADS) {
        const int j = i / G, g = i - j * G;
        const float x = gmax_row[(size_t)(grp0 + j) * (2 * pairs) + g];
        factor[j][g] = x == NEG_INF || gm[g] == NEG_INF ? 0.f : __expf(x - gm[g]) * rs[g] * (1.f / 32768.f);
    }
    __syncthreads();
    const unsigned* exps_row = exps + rh * N * pairs;
    for (int n = n0 + threadIdx.x; n < n1; n += FINISH_THREADS) {
        const float* f = factor[(n - n0) >> 4];
        float best = 0.f;
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            if (p >= pairs) break;
            const unsigned w = exps_row[(size_t)n * pairs + p];
            best = fmaxf(best, f16_value(w & 0xffffu) * f[2 * p]);
            if (2 * p + 1 < G) best = fmaxf(best, f16_value(w >> 16) * f[2 * p + 1]);
        }
        scores[rh * N + n] = best;
    }
}
