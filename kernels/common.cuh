// Shared helpers for the shadowkv_cache kernels (compiled by NVRTC, so no CUDA headers are included).
//
// Element types travel as 16-bit patterns: `bf16` and `f16` wrap an unsigned short and convert through PTX,
// so the kernels need neither cuda_bf16.h nor cuda_fp16.h (NVRTC has no include path to them).
#pragma once

struct __align__(2) bf16 { unsigned short x; };
struct __align__(2) f16 { unsigned short x; };

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(bf16 v) { return __uint_as_float(((unsigned int)v.x) << 16); }
__device__ __forceinline__ float to_f32(f16 v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.x));
    return f;
}

template <typename T> __device__ __forceinline__ T from_f32(float f);
template <> __device__ __forceinline__ float from_f32<float>(float f) { return f; }
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float f) {
    bf16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.x) : "f"(f));
    return r;
}
template <> __device__ __forceinline__ f16 from_f32<f16>(float f) {
    f16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.x) : "f"(f));
    return r;
}

/// \brief Round `f` to the precision of `T` and back (what a PyTorch op in dtype `T` would store).
template <typename T> __device__ __forceinline__ float round_to(float f) { return to_f32(from_f32<T>(f)); }

/// \brief Exclusive prefix sum of `data[0:n]` in shared memory, in place, by the whole block.
/// \param data  [n] int, shared memory
/// \param warp_sums  [32] int, shared memory scratch
/// \return the total, to every thread
__device__ __forceinline__ int block_exclusive_scan(int* data, int n, int* warp_sums) {
    const int tid = threadIdx.x, threads = blockDim.x;
    const int per = (n + threads - 1) / threads;
    const int begin = min(tid * per, n), end = min(begin + per, n);
    int local = 0;
    for (int i = begin; i < end; ++i) local += data[i];
    // Inclusive scan of the per-thread sums: within each warp, then across warps.
    const int lane = tid & 31, warp = tid >> 5;
    int incl = local;
    for (int off = 1; off < 32; off <<= 1) {
        int up = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += up;
    }
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        const int num_warps = (threads + 31) >> 5;
        int w = lane < num_warps ? warp_sums[lane] : 0;
        for (int off = 1; off < 32; off <<= 1) {
            int up = __shfl_up_sync(0xffffffffu, w, off);
            if (lane >= off) w += up;
        }
        if (lane < num_warps) warp_sums[lane] = w;  // inclusive per warp
    }
    __syncthreads();
    int running = incl - local + (warp > 0 ? warp_sums[warp - 1] : 0);
    for (int i = begin; i < end; ++i) {
        int v = data[i];
        data[i] = running;
        running += v;
    }
    const int total = warp_sums[((threads + 31) >> 5) - 1];
    __syncthreads();
    return total;
}

// ---- fp16 tensor-core operands (score_codes.cu, landmark_logits.cu) ---------------------------------------------

__device__ __forceinline__ unsigned short f16_bits(float f) {
    unsigned short r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}
__device__ __forceinline__ float f16_value(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

/// \brief Two fp16 values in one register, `lo` in the low half (the MMA operands' element order).
__device__ __forceinline__ unsigned pack_f16x2(float lo, float hi) {
    return (unsigned)f16_bits(lo) | ((unsigned)f16_bits(hi) << 16);
}

/// \brief c += a . b over one m16n8k16 tile (fp16 operands, fp32 accumulators).
__device__ __forceinline__ void mma_m16n8k16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();  // the ops send only sm_80+ here
#endif
}

/// \brief c += a . b over one m16n8k16 tile of bf16 operands (fp32 accumulators).
__device__ __forceinline__ void mma_m16n8k16_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();  // the ops send only sm_80+ here
#endif
}

/// \brief The m16n8k16 MMA of a 16-bit element type's operands: bf16 or fp16.
__device__ __forceinline__ void mma_m16n8k16_of(bf16, float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    mma_m16n8k16_bf16(c, a, b0, b1);
}
__device__ __forceinline__ void mma_m16n8k16_of(f16, float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    mma_m16n8k16(c, a, b0, b1);
}

/// \brief c += a . b over one m16n8k32 tile of int8 operands (int32 accumulators, exact). Fragments (PTX ISA, "mma
/// .m16n8k32"): a0/a1 rows gid/gid+8 at k = 4tq..4tq+3, a2/a3 the same rows at k = 16+4tq..; b0 k = 4tq..4tq+3 and
/// b1 k = 16+4tq.. of column gid; c0,c1 row gid, columns 2tq, 2tq+1; c2,c3 row gid+8 (gid = lane/4, tq = lane%4).
__device__ __forceinline__ void imma_m16n8k32(int (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();  // the ops send only sm_80+ here
#endif
}

/// \brief 2^k as float32, exactly, for k in [-126, 127].
__device__ __forceinline__ float pow2(int k) { return __int_as_float((127 + k) << 23); }

// ---- softmax states (score_codes.cu, softmax_group_max.cu) ------------------------------------------------------

#define NEG_INF __int_as_float(0xff800000u)

/// \brief 2^x, flushed to 0 below 2^-126 (one MUFU.EX2; -inf gives 0).
__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/// \brief Online (max, sum of exp) of two partial softmax states. `BASE2`: states of base-2 logits (l = logit *
/// log2 e; sums of 2^(l - max)), merged with one `ex2` per term instead of `__expf`'s multiply and range handling.
template <bool BASE2 = false>
__device__ __forceinline__ void merge_state(float& m, float& s, float m2, float s2) {
    if (m2 == NEG_INF) return;
    if (m == NEG_INF) { m = m2; s = s2; return; }
    const float hi = fmaxf(m, m2);
    if constexpr (BASE2) {
        s = s * exp2_ftz(m - hi) + s2 * exp2_ftz(m2 - hi);
    } else {
        s = s * __expf(m - hi) + s2 * __expf(m2 - hi);
    }
    m = hi;
}

// ---- RoPE of one rotation pair (rebuild_keys.cu, rebuild_missed.cu) -------------------------------------------------

/// \brief Rotate pair `i` of one head row `x` at position `p` into `y` (which may be `x`), as `rope_reference` in
/// ops/key_rope.py defines it: cos/sin in fp32 of `p * inv_freq[i]`, times `attention_scaling`, one rounding to T.
/// Rotate-half pairs dims (i, i + half); `interleaved` pairs (2i, 2i + 1).
template <typename T>
__device__ __forceinline__ void rope_pair(const T* x, T* y, int i, int half, int interleaved, float p,
                                          const float* inv_freq, float attention_scaling) {
    const int d0 = interleaved ? 2 * i : i, d1 = interleaved ? 2 * i + 1 : i + half;
    float sn, cs;
    sincosf(p * inv_freq[i], &sn, &cs);
    const float x0 = to_f32(x[d0]), x1 = to_f32(x[d1]);
    const float c_ = cs * attention_scaling, s_ = sn * attention_scaling;
    // Spelled out: the fused multiply-add takes the element's own term, as the twin's rounding expects and as the
    // compiler chose for the element-wise kernel the first of these kernels replaced.
    y[d0] = from_f32<T>(__fmaf_rn(x0, c_, __fmul_rn(-x1, s_)));
    y[d1] = from_f32<T>(__fmaf_rn(x1, c_, __fmul_rn(x0, s_)));
}

// ---- Walsh-Hadamard transform across a warp (gather_dequant.cu, gather_values.cu) ----------------------------------

/// \brief Unnormalised Walsh-Hadamard transform (natural order) of vectors of `lanes * EPL` coordinates, each held
/// by `lanes` aligned lanes of the warp (`lanes` a power of two): lane `l` holds coordinates `(l % lanes) * EPL` to
/// `(l % lanes) * EPL + EPL - 1` of its vector in `x`, so a warp transforms 32 / `lanes` vectors at once. Every lane
/// must call (lanes without a vector hold anything). The butterflies are those of gather_values.cu's shared-memory
/// transform, pair (i, i + h) -> (a + b, a - b), so both give the same bits.
template <int EPL>
__device__ __forceinline__ void warp_hadamard(float (&x)[EPL], int lanes) {
#pragma unroll
    for (int h = 1; h < EPL; h <<= 1) {
#pragma unroll
        for (int j = 0; j < EPL; ++j) {
            if (j & h) continue;
            const float a = x[j], b = x[j + h];
            x[j] = a + b;
            x[j + h] = a - b;
        }
    }
    const int lane = threadIdx.x & 31;
    for (int mask = 1; mask < lanes; mask <<= 1) {  // coordinate distance h = mask * EPL
#pragma unroll
        for (int j = 0; j < EPL; ++j) {
            const float other = __shfl_xor_sync(0xffffffffu, x[j], mask);
            x[j] = (lane & mask) ? other - x[j] : x[j] + other;
        }
    }
}

/// \brief One tile of an online softmax over `TILE` slots for `G` query heads, one warp per head (the split attention
/// kernels, attend_parts.cu and attend_records.cu): `ps[g*TILE + slot]` holds the tile's logits (-inf where a slot
/// is not attended) and becomes their weights exp(logit - m); `st` holds [G] running max m, [G] running sum l and
/// [G] the factor alpha by which the previous tiles' sums and weighted values are rescaled. `lane` and `warp` are the
/// caller's (taken from it, the records kernel keeps 80 registers; recomputed here, 96). The caller synchronises the
/// block before (the logits written) and after (the weights read).
template <int G, int TILE, int WARP_COUNT>
__device__ __forceinline__ void online_softmax_tile(float* ps, float* st, int lane, int warp) {
    constexpr int PER = TILE / 32;  // slots per lane
    for (int g = warp; g < G; g += WARP_COUNT) {
        float x[PER];
        float mt = NEG_INF;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            x[i] = ps[g * TILE + lane + 32 * i];
            mt = fmaxf(mt, x[i]);
        }
        for (int off = 16; off; off >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, off));
        const float m_old = st[g], m_new = fmaxf(m_old, mt);
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const float p = x[i] == NEG_INF ? 0.f : expf(x[i] - m_new);
            ps[g * TILE + lane + 32 * i] = p;
            sum += p;
        }
        for (int off = 16; off; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        if (lane == 0) {
            const float alpha = m_old == NEG_INF ? 0.f : expf(m_old - m_new);
            st[g] = m_new;
            st[G + g] = st[G + g] * alpha + sum;
            st[2 * G + g] = alpha;
        }
    }
}

/// \brief A float's bits as an unsigned key in the order of a descending sort: larger floats give larger keys,
///        -0.0 equals +0.0, and every NaN is above +inf (where torch.sort puts NaN).
__device__ __forceinline__ unsigned order_key(float f) {
    if (f != f) return 0xffffffffu;
    const unsigned u = f == 0.0f ? 0u : __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
