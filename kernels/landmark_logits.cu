// ShadowKV's landmark logits of a one-token step on tensor cores: from int8 landmarks (one fp32 scale per landmark),
// the scoring GEMM at half the bytes of 16-bit landmarks, which are the largest tensor a step reads at long context
// (32 MiB per row and layer in bf16 at 128K on the Llama-3.1-8B shape); and from 16-bit landmarks, in place of a
// cuBLAS GEMM whose small-batch launch came with a memset node and ~14 us of idle device per layer (the query rows
// padded to 8 for its alignment, a fill and a copy before it: ~35 us a layer at batch 1 for 8 us of reads).
// Twin: shadowkv_cache/ops/landmark_logits.py (`landmark_logits_int8_reference`: the dequantised landmarks times the
// queries in fp32, rounded to the query's dtype; `landmark_logits_native_reference`: the same without codes), which
// also dispatches.
//
// Tensor cores: each warp takes 16 landmarks at a time as the A operand of m16n8k16 MMAs (16 landmarks x 16 dims)
// against the group's queries (B: 16 dims x 8 query heads, zeros beyond G). The MMA's k index only has to pair
// landmark and query dims the same way, so lane `tq` of a quad reads dims tq*D/4 .. tq*D/4 + D/4 - 1 of its two
// landmarks (16-byte loads) and k-slots (2tq, 2tq+1, 2tq+8, 2tq+9) of k-step kt hold dims tq*D/4 + 4kt .. + 3.
//
// Exactness (int8): int8 codes are fp16 integers, made from the bytes with one permute and one fp16 subtraction per
// pair (0x64XX is the fp16 1024 + XX); each query head is scaled by a power of two into fp16's range, where a bf16 or
// fp16 query is exact. The products are exact in fp32 and the sums differ from the twin's only in order. The scale of
// each landmark and the power of two are applied to the fp32 sum. (16-bit): landmarks and queries of one dtype are
// the MMA's operands as they are (bf16 or fp16 MMAs), products exact in fp32, sums in another order than the twin's.
//
// Legend: B batch, Hkv KV heads, G query heads per KV head, D head dim, C landmarks (chunks), gid = lane/4 (MMA row
// group; B column = query head gid), tq = lane % 4.
#include "common.cuh"

#define LL_THREADS 128
#define LL_LOADS 16  // 16-byte loads in flight per lane: a batch of 16-landmark tiles, 256 bytes per lane

/// \brief Four int8 values of `w` (little-endian) as fp16 pairs: `lo` = (byte 0, byte 1), `hi` = (byte 2, byte 3).
__device__ __forceinline__ void int8x4_to_f16x2(unsigned w, unsigned& lo, unsigned& hi) {
    const unsigned u = w ^ 0x80808080u;  // each byte + 128, unsigned
    const unsigned magic = 0x64646464u, bias = 0x64806480u;  // fp16 1024 in the high byte; 1152 = 1024 + 128
    asm("prmt.b32 %0, %1, %2, 0x4140;" : "=r"(lo) : "r"(u), "r"(magic));
    asm("prmt.b32 %0, %1, %2, 0x4342;" : "=r"(hi) : "r"(u), "r"(magic));
    asm("sub.f16x2 %0, %0, %1;" : "+r"(lo) : "r"(bias));
    asm("sub.f16x2 %0, %0, %1;" : "+r"(hi) : "r"(bias));
}

/// \brief Logits of one (row, KV head)'s group of queries against its int8 landmarks; block `x` of the grid takes
/// batches x, x + gridDim.x, ... of 4 * TILES * 16 landmarks.
///
/// \param out     logit (b, h, g, c) at out[b*ob + h*oh + g*og + c*oc], written (`T`)
/// \param q       query (b, h, g, d) at q[b*qb + h*qh + g*qg + d] (`T`, the attention's scaling applied)
/// \param codes   int8 landmark (b, h, c, d) at codes[b*cb + h*ch + c*cc + d], 16-byte aligned rows (cb = 0: every
///                row's document is one copy)
/// \param scales  fp32 scale (b, h, c) at scales[b*sb + h*sh + c]: landmark = codes * scale
/// Launch: grid (X, Hkv, B), block LL_THREADS; sm_80+.
template <typename T, int D>
__device__ __forceinline__ void landmark_logits_impl(T* out, long long ob, long long oh, long long og, long long oc,
                                                     const T* q, long long qb, long long qh, long long qg,
                                                     const signed char* codes, long long cb, long long ch,
                                                     long long cc, const float* scales, long long sb, long long sh,
                                                     int G, long long C) {
    constexpr int DL = D / 4;           // dims (bytes) of a landmark per lane
    constexpr int W = DL / 16;          // 16-byte words per lane and landmark
    constexpr int KT = D / 16;          // MMA k-steps
    constexpr int TILES = LL_LOADS / (2 * W);  // 16-landmark tiles per warp and batch
    static_assert(DL % 16 == 0 && TILES >= 1, "D a multiple of 64, at most 256");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gid = lane >> 2, tq = lane & 3;
    const long long head = blockIdx.y, row = blockIdx.z;

    // B fragments: column gid = query head gid (zeros beyond G), dims tq*DL + 4kt .. + 3 of k-step kt.
    float qv[DL];
    float qmax = 0.f;
    const T* qrow = q + row * qb + head * qh + (long long)gid * qg + tq * DL;
#pragma unroll
    for (int j = 0; j < DL; ++j) {
        qv[j] = gid < G ? to_f32(qrow[j]) : 0.f;
        qmax = fmaxf(qmax, fabsf(qv[j]));
    }
    qmax = fmaxf(qmax, __shfl_xor_sync(0xffffffffu, qmax, 1));
    qmax = fmaxf(qmax, __shfl_xor_sync(0xffffffffu, qmax, 2));
    // Scale the head by 2^k so that its largest coordinate is in [2^13, 2^14): inside fp16's range, and a bf16 or
    // fp16 query stays exact (its smallest coordinates that matter are far above fp16's subnormals).
    const int k = qmax > 0.f ? max(-126, min(126, 13 - (((__float_as_int(qmax) >> 23) & 0xff) - 127))) : 0;
    unsigned b[KT][2];
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
        b[kt][0] = pack_f16x2(qv[4 * kt] * pow2(k), qv[4 * kt + 1] * pow2(k));
        b[kt][1] = pack_f16x2(qv[4 * kt + 2] * pow2(k), qv[4 * kt + 3] * pow2(k));
    }
    // Output columns 2tq and 2tq + 1 are query heads whose powers of two lanes 8tq and 8tq + 4 hold.
    const int col0 = 2 * tq, col1 = 2 * tq + 1;
    const float down0 = pow2(-__shfl_sync(0xffffffffu, k, 4 * col0));
    const float down1 = pow2(-__shfl_sync(0xffffffffu, k, 4 * col1));

    const signed char* base = codes + row * cb + head * ch + tq * DL;
    const float* scale_row = scales + row * sb + head * sh;
    T* out_row = out + row * ob + head * oh;
    const long long per_block = (LL_THREADS / 32) * TILES * 16;
    for (long long start = blockIdx.x * per_block; start < C; start += (long long)gridDim.x * per_block) {
        const long long first = start + (long long)warp * TILES * 16;
        // Loads first: every word of the batch in flight, then the MMAs.
        uint4 words[TILES][2][W];
        float scale[TILES][2];
#pragma unroll
        for (int t = 0; t < TILES; ++t)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const long long c = first + 16 * t + gid + 8 * h;
                const bool in = c < C;
                const uint4* p = reinterpret_cast<const uint4*>(base + (in ? c : 0) * cc);
#pragma unroll
                for (int w = 0; w < W; ++w) words[t][h][w] = in ? p[w] : make_uint4(0, 0, 0, 0);
                scale[t][h] = in ? scale_row[c] : 0.f;
            }
#pragma unroll
        for (int t = 0; t < TILES; ++t) {
            float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int kt = 0; kt < KT; ++kt) {
                const uint4& w0 = words[t][0][kt / 4];
                const uint4& w1 = words[t][1][kt / 4];
                const unsigned x0 = (kt & 3) == 0 ? w0.x : (kt & 3) == 1 ? w0.y : (kt & 3) == 2 ? w0.z : w0.w;
                const unsigned x1 = (kt & 3) == 0 ? w1.x : (kt & 3) == 1 ? w1.y : (kt & 3) == 2 ? w1.z : w1.w;
                unsigned a[4];  // (row gid, k 2tq..), (row gid + 8, k 2tq..), (row gid, k 2tq+8..), (row gid + 8, ..)
                int8x4_to_f16x2(x0, a[0], a[2]);
                int8x4_to_f16x2(x1, a[1], a[3]);
                mma_m16n8k16(acc, a, b[kt][0], b[kt][1]);
            }
            // c0, c1: landmark gid, heads col0, col1; c2, c3: landmark gid + 8.
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const long long c = first + 16 * t + gid + 8 * h;
                if (c >= C) continue;
                if (col0 < G) out_row[col0 * og + c * oc] = from_f32<T>(acc[2 * h] * scale[t][h] * down0);
                if (col1 < G) out_row[col1 * og + c * oc] = from_f32<T>(acc[2 * h + 1] * scale[t][h] * down1);
            }
        }
    }
}

/// \brief Logits of one (row, KV head)'s group of queries against its 16-bit landmarks (the queries' dtype `T`);
/// block `x` of the grid takes batches x, x + gridDim.x, ... of 4 * TILES * 16 landmarks.
///
/// \param out  logit (b, h, g, c) at out[b*ob + h*oh + g*og + c*oc], written (`T`)
/// \param q    query (b, h, g, d) at q[b*qb + h*qh + g*qg + d] (`T`, the attention's scaling applied)
/// \param lm   landmark (b, h, c, d) at lm[b*lb + h*lh + c*lc + d] (`T`), 16-byte aligned rows (lb = 0: every row's
///             document is one copy)
/// Launch: grid (X, Hkv, B), block LL_THREADS; sm_80+.
template <typename T, int D>
__device__ __forceinline__ void landmark_logits_16_impl(T* out, long long ob, long long oh, long long og, long long oc,
                                                        const T* q, long long qb, long long qh, long long qg,
                                                        const T* lm, long long lb, long long lh, long long lc, int G,
                                                        long long C) {
    constexpr int DL = D / 4;                  // dims of a landmark per lane
    constexpr int W = DL * 2 / 16;             // 16-byte words per lane and landmark
    constexpr int KT = D / 16;                 // MMA k-steps (two per word: 4 dims each)
    constexpr int TILES = LL_LOADS / (2 * W);  // 16-landmark tiles per warp and batch
    static_assert(DL % 8 == 0 && TILES >= 1, "D a multiple of 32, at most 256");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gid = lane >> 2, tq = lane & 3;
    const long long head = blockIdx.y, row = blockIdx.z;

    // B fragments: column gid = query head gid (zeros beyond G), dims tq*DL + 4kt .. + 3 of k-step kt, as they lie.
    unsigned b[KT][2];
    const unsigned short* qrow = reinterpret_cast<const unsigned short*>(q + row * qb + head * qh + (long long)gid * qg)
                                 + tq * DL;
#pragma unroll
    for (int kt = 0; kt < KT; ++kt)
#pragma unroll
        for (int p = 0; p < 2; ++p)
            b[kt][p] = gid < G ? (unsigned)qrow[4 * kt + 2 * p] | ((unsigned)qrow[4 * kt + 2 * p + 1] << 16) : 0u;
    const int col0 = 2 * tq, col1 = 2 * tq + 1;

    const T* base = lm + row * lb + head * lh + tq * DL;
    T* out_row = out + row * ob + head * oh;
    const long long per_block = (LL_THREADS / 32) * TILES * 16;
    for (long long start = blockIdx.x * per_block; start < C; start += (long long)gridDim.x * per_block) {
        const long long first = start + (long long)warp * TILES * 16;
        // Loads first: every word of the batch in flight, then the MMAs.
        uint4 words[TILES][2][W];
#pragma unroll
        for (int t = 0; t < TILES; ++t)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const long long c = first + 16 * t + gid + 8 * h;
                const bool in = c < C;
                const uint4* p = reinterpret_cast<const uint4*>(base + (in ? c : 0) * lc);
#pragma unroll
                for (int w = 0; w < W; ++w) words[t][h][w] = in ? p[w] : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
        for (int t = 0; t < TILES; ++t) {
            float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int kt = 0; kt < KT; ++kt) {
                // k-step kt: dims 4kt .. 4kt + 3 of the lane's range, half of word kt / 2.
                const uint4& w0 = words[t][0][kt / 2];
                const uint4& w1 = words[t][1][kt / 2];
                const bool second = kt & 1;
                // (row gid, k 2tq..), (row gid + 8, k 2tq..), (row gid, k 2tq+8..), (row gid + 8, k 2tq+8..)
                const unsigned a[4] = {second ? w0.z : w0.x, second ? w1.z : w1.x, second ? w0.w : w0.y,
                                       second ? w1.w : w1.y};
                mma_m16n8k16_of(T{}, acc, a, b[kt][0], b[kt][1]);
            }
            // c0, c1: landmark gid, heads col0, col1; c2, c3: landmark gid + 8.
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const long long c = first + 16 * t + gid + 8 * h;
                if (c >= C) continue;
                if (col0 < G) out_row[col0 * og + c * oc] = from_f32<T>(acc[2 * h]);
                if (col1 < G) out_row[col1 * og + c * oc] = from_f32<T>(acc[2 * h + 1]);
            }
        }
    }
}

// One kernel per query dtype and head size (D = 64, 128, 256).
#define LANDMARK_LOGITS(NAME, T, D)                                                                                \
    extern "C" __global__ void __launch_bounds__(LL_THREADS)                                                       \
        NAME(T* out, long long ob, long long oh, long long og, long long oc, const T* q, long long qb,            \
             long long qh, long long qg, const signed char* codes, long long cb, long long ch, long long cc,         \
             const float* scales, long long sb, long long sh, int G, long long C) {                                 \
        landmark_logits_impl<T, D>(out, ob, oh, og, oc, q, qb, qh, qg, codes, cb, ch, cc, scales, sb, sh, G, C);    \
    }
LANDMARK_LOGITS(landmark_logits_int8_bf16_d64, bf16, 64)
LANDMARK_LOGITS(landmark_logits_int8_bf16_d128, bf16, 128)
LANDMARK_LOGITS(landmark_logits_int8_bf16_d256, bf16, 256)
LANDMARK_LOGITS(landmark_logits_int8_f16_d64, f16, 64)
LANDMARK_LOGITS(landmark_logits_int8_f16_d128, f16, 128)
LANDMARK_LOGITS(landmark_logits_int8_f16_d256, f16, 256)

// 16-bit landmarks of the queries' dtype, per head size (D = 64, 128, 256).
#define LANDMARK_LOGITS_16(NAME, T, D)                                                                             \
    extern "C" __global__ void __launch_bounds__(LL_THREADS)                                                       \
        NAME(T* out, long long ob, long long oh, long long og, long long oc, const T* q, long long qb,            \
             long long qh, long long qg, const T* lm, long long lb, long long lh, long long lc, int G, long long C) { \
        landmark_logits_16_impl<T, D>(out, ob, oh, og, oc, q, qb, qh, qg, lm, lb, lh, lc, G, C);                  \
    }
LANDMARK_LOGITS_16(landmark_logits_native_bf16_d64, bf16, 64)
LANDMARK_LOGITS_16(landmark_logits_native_bf16_d128, bf16, 128)
LANDMARK_LOGITS_16(landmark_logits_native_bf16_d256, bf16, 256)
LANDMARK_LOGITS_16(landmark_logits_native_f16_d64, f16, 64)
LANDMARK_LOGITS_16(landmark_logits_native_f16_d128, f16, 128)
LANDMARK_LOGITS_16(landmark_logits_native_f16_d256, f16, 256)
