// One-token decode attention over the parts of a compressed layer's attended set (outliers, selected chunks, local
// window, the tokens after the prompt), read where they lie: no concatenated copy, no expanded mask, and every query
// head of a GQA group served by one read of its KV head. Split over the slots (flash-decoding): each block keeps an
// online softmax over its share, and a second kernel merges the shares by their log-sum-exp.
// Twin: shadowkv_cache/ops/attend_parts.py (`attend_parts_reference`: core/attention.py's concatenation, then grouped
// attention, the definition), which also dispatches.
//
// Legend: B batch, Hkv KV heads, G query heads per KV head, D head dim, N attended slots (all parts), S splits,
// TOK slots per tile, U 16-byte units per key or value vector.
#include "common.cuh"

#define MAX_PARTS 4
#define THREADS 128
#define WARPS (THREADS / 32)

/// One part: element (b, h, n, d) of the keys at k[b*kb + h*kh + n*kn + d] (`T` elements), the same for the values;
/// its validity (b, h, n) at valid[b*mb + h*mh + n*mn] (a stride is 0 where the part is shared, e.g. over rows).
struct Part {
    const void* k;
    const void* v;
    const bool* valid;
    long long kb, kh, kn, vb, vh, vn, mb, mh, mn;
    long long n;
};

struct Parts {
    Part p[MAX_PARTS];
    int count;
};

/// \brief A 16-byte unit of `T` elements, as floats.
template <typename T> struct Unit;
template <> struct Unit<float> {
    static constexpr int E = 4;
    static __device__ __forceinline__ void unpack(uint4 w, float (&f)[4]) {
        f[0] = __uint_as_float(w.x);
        f[1] = __uint_as_float(w.y);
        f[2] = __uint_as_float(w.z);
        f[3] = __uint_as_float(w.w);
    }
};
/// Both 16-bit types: element 2i of the unit is the low half of word i, element 2i + 1 the high half.
template <typename T> struct Unit16 {
    static constexpr int E = 8;
    static __device__ __forceinline__ void unpack(uint4 w, float (&f)[8]) {
        const unsigned int x[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            f[2 * i] = to_f32(T{(unsigned short)(x[i] & 0xffffu)});
            f[2 * i + 1] = to_f32(T{(unsigned short)(x[i] >> 16)});
        }
    }
};
template <> struct Unit<bf16> : Unit16<bf16> {};
template <> struct Unit<f16> : Unit16<f16> {};

/// \brief The part holding concatenated slot `n` of (row, head): its index (or -1) and the slot's element offsets of
/// keys and values and its validity. The loop is unrolled so that the parts are read from the parameter space.
__device__ __forceinline__ int locate(const Parts& parts, int row, int head, long long n, long long& k, long long& v,
                                      bool& valid) {
#pragma unroll
    for (int i = 0; i < MAX_PARTS; ++i) {
        if (i < parts.count) {
            const Part& p = parts.p[i];
            if (n < p.n) {
                k = row * p.kb + head * p.kh + n * p.kn;
                v = row * p.vb + head * p.vh + n * p.vn;
                valid = p.valid[row * p.mb + head * p.mh + n * p.mn];
                return i;
            }
            n -= p.n;
        }
    }
    return -1;
}

/// \brief Shares of the attention of one (split, KV head, row): the group's `G` queries over slots
/// [split*span, min((split+1)*span, N)) of the concatenated parts, TOK slots per tile.
///
/// Each tile issues all its loads first (every thread its share of `P` key units of one slot, and `VS` value units of
/// the slots it weighs), so that a block keeps many loads in flight; keys never pass through shared memory.
///
/// \param q          query element (b, h*G + g, d) at q[b*qb + (h*G + g)*qh + d]
/// \param parts      the parts, in the twin's order of concatenation
/// \param scaling    the attention's scale (logits = q·k * scaling)
/// \param softcap    logits become softcap*tanh(logits/softcap) when > 0 (before the mask, as the models do)
/// \param total      N, the parts' slots together
/// \param span       slots per split, a multiple of TOK
/// \param first_share, shares  this block writes share first_share + split of the S = `shares` of its (row, head)
///                   (other kernels may write the others: attend_records.cu)
/// \param part_acc   [B, Hkv, S, G, D] fp32 out: sum over the split's valid slots of exp(logit - m) * v
/// \param part_ml    [B, Hkv, S, G, 2] fp32 out: (m, l) = (max logit, sum of exp(logit - m)); m = -inf when none
/// Launch: grid (S, Hkv, B), block THREADS. Every key and value vector 16-byte aligned.
template <typename T, int G, int D>
__device__ __forceinline__ void attend_split_impl(const T* q, long long qb, long long qh, const Parts& parts,
                                                  float scaling, float softcap, long long total, long long span,
                                                  int first_share, int shares, float* part_acc, float* part_ml) {
    constexpr int E = Unit<T>::E, U = D / E;  // elements per unit, units per vector
    static_assert(D % E == 0 && U >= 2 && U <= 32 && (U & (U - 1)) == 0, "a vector of 2 to 32 16-byte units");
    constexpr int TOK = U <= 16 ? 64 : 32;  // slots per tile
    constexpr int P = THREADS / TOK;        // threads per slot for its logits (adjacent lanes)
    constexpr int UH = U / P;               // key units per thread
    constexpr int R = 32 / U;               // slots per warp step when weighing values (lane -> slot rr, unit u)
    constexpr int VS = TOK / (WARPS * R);   // value units per lane and tile
    __shared__ __align__(16) float qs[G * D];
    __shared__ float ps[G * TOK];  // logits, then weights
    __shared__ float st[3 * G];    // [G] m, [G] l, [G] rescale
    __shared__ int ok[TOK];
    __shared__ float red[WARPS * G * D];

    const int split = blockIdx.x, head = blockIdx.y, row = blockIdx.z;
    const int Hkv = gridDim.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int slot = tid / P, share_of_slot = tid - slot * P;
    const int rr = lane / U, u = lane - rr * U;
    const T* keys[MAX_PARTS];
    const T* values[MAX_PARTS];
#pragma unroll
    for (int i = 0; i < MAX_PARTS; ++i) {
        keys[i] = static_cast<const T*>(parts.p[i].k);
        values[i] = static_cast<const T*>(parts.p[i].v);
    }

    for (int i = tid; i < G * D; i += THREADS) {
        const int g = i / D, d = i - g * D;
        qs[i] = to_f32(q[row * qb + (long long)(head * G + g) * qh + d]);
    }
    if (tid < G) {
        st[tid] = NEG_INF;
        st[G + tid] = 0.f;
    }
    float acc[G][E];
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
        for (int e = 0; e < E; ++e) acc[g][e] = 0.f;
    __syncthreads();

    const long long begin = (long long)split * span, end = min(begin + span, total);
    for (long long t0 = begin; t0 < end; t0 += TOK) {
        // Loads: key units of this thread's slot, value units of the slots this lane weighs.
        uint4 kreg[UH];
        bool valid = false;
        {
            long long k = 0, v = 0;
            const int at = t0 + slot < end ? locate(parts, row, head, t0 + slot, k, v, valid) : -1;
            const T* base = nullptr;
#pragma unroll
            for (int i = 0; i < MAX_PARTS; ++i)
                if (at == i) base = keys[i] + k;
#pragma unroll
            for (int j = 0; j < UH; ++j)
                kreg[j] = base ? reinterpret_cast<const uint4*>(base)[P * j + share_of_slot] : make_uint4(0, 0, 0, 0);
        }
        uint4 vreg[VS];
#pragma unroll
        for (int j = 0; j < VS; ++j) {
            const long long n = t0 + warp * R + rr + j * WARPS * R;
            long long k = 0, v = 0;
            bool unused;
            const int at = n < end ? locate(parts, row, head, n, k, v, unused) : -1;
            const T* base = nullptr;
#pragma unroll
            for (int i = 0; i < MAX_PARTS; ++i)
                if (at == i) base = values[i] + v;
            vreg[j] = base ? reinterpret_cast<const uint4*>(base)[u] : make_uint4(0, 0, 0, 0);
        }
        // Logits: the P threads of a slot each take every P-th unit, then sum across their lanes.
        float dot[G];
#pragma unroll
        for (int g = 0; g < G; ++g) dot[g] = 0.f;
#pragma unroll
        for (int j = 0; j < UH; ++j) {
            float kf[E];
            Unit<T>::unpack(kreg[j], kf);
            const int c = P * j + share_of_slot;
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const float4* qv = reinterpret_cast<const float4*>(qs + g * D + c * E);
#pragma unroll
                for (int e4 = 0; e4 < E / 4; ++e4) {
                    const float4 w = qv[e4];
                    dot[g] = fmaf(w.x, kf[4 * e4], dot[g]);
                    dot[g] = fmaf(w.y, kf[4 * e4 + 1], dot[g]);
                    dot[g] = fmaf(w.z, kf[4 * e4 + 2], dot[g]);
                    dot[g] = fmaf(w.w, kf[4 * e4 + 3], dot[g]);
                }
            }
        }
#pragma unroll
        for (int off = 1; off < P; off <<= 1)
#pragma unroll
            for (int g = 0; g < G; ++g) dot[g] += __shfl_xor_sync(0xffffffffu, dot[g], off);
        __syncthreads();  // the previous tile's weights and rescales are read
        if (share_of_slot == 0) {
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float s = dot[g] * scaling;
                if (softcap > 0.f) s = softcap * tanhf(s / softcap);
                ps[g * TOK + slot] = valid ? s : NEG_INF;
            }
            ok[slot] = valid;
        }
        __syncthreads();
        // Online softmax: one warp per query head.
        online_softmax_tile<G, TOK, WARPS>(ps, st, lane, warp);
        __syncthreads();
        // Weighted values.
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float alpha = st[2 * G + g];
#pragma unroll
            for (int e = 0; e < E; ++e) acc[g][e] *= alpha;
        }
#pragma unroll
        for (int j = 0; j < VS; ++j) {
            const int r = warp * R + rr + j * WARPS * R;
            if (!ok[r]) continue;  // also past the split's end
            float vf[E];
            Unit<T>::unpack(vreg[j], vf);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const float p = ps[g * TOK + r];
#pragma unroll
                for (int e = 0; e < E; ++e) acc[g][e] = fmaf(p, vf[e], acc[g][e]);
            }
        }
    }
    // Sum the lanes of one unit (slots rr = 0..R-1), then the warps.
#pragma unroll
    for (int off = U; off < 32; off <<= 1)
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
            for (int e = 0; e < E; ++e) acc[g][e] += __shfl_down_sync(0xffffffffu, acc[g][e], off);
    if (lane < U) {
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
            for (int e = 0; e < E; ++e) red[(warp * G + g) * D + lane * E + e] = acc[g][e];
    }
    __syncthreads();
    const long long share = ((long long)row * Hkv + head) * shares + first_share + split;
    for (int i = tid; i < G * D; i += THREADS) {
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) sum += red[w * G * D + i];
        part_acc[share * G * D + i] = sum;
    }
    if (tid < G) {
        part_ml[(share * G + tid) * 2] = st[tid];
        part_ml[(share * G + tid) * 2 + 1] = st[G + tid];
    }
}

/// \brief The output of one (query head, row): the splits' shares merged by their log-sum-exp, with the model's
/// attention sink (a logit that joins the denominator and attends to nothing) when `sinks` is given.
///
/// \param sinks      [Hkv*G] fp32, or null
/// \param out        [B, Hkv*G, D] (the `[B, 1, Hq, D]` output), written
/// Launch: grid (Hkv*G, B), block THREADS, dynamic shared memory S*4 bytes. A head with no valid slot gets zeros.
template <typename T>
__device__ __forceinline__ void attend_merge_impl(const float* part_acc, const float* part_ml, const float* sinks, T* out,
                                             int G, int D, int S) {
    extern __shared__ float weight[];  // [S]
    __shared__ float denom;
    const int hq = blockIdx.x, row = blockIdx.y, Hq = gridDim.x;
    const int head = hq / G, g = hq - head * G, Hkv = Hq / G;
    const long long first = ((long long)row * Hkv + head) * S;  // share (row, head, split 0)
    if (threadIdx.x == 0) {
        float m = sinks ? sinks[hq] : NEG_INF;
        for (int s = 0; s < S; ++s) m = fmaxf(m, part_ml[((first + s) * G + g) * 2]);
        float l = (sinks && m != NEG_INF) ? expf(sinks[hq] - m) : 0.f;
        for (int s = 0; s < S; ++s) {
            const float ms = part_ml[((first + s) * G + g) * 2];
            const float w = ms == NEG_INF ? 0.f : expf(ms - m);
            weight[s] = w;
            l += w * part_ml[((first + s) * G + g) * 2 + 1];
        }
        denom = l;
    }
    __syncthreads();
    const float inv = denom > 0.f ? 1.f / denom : 0.f;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float o = 0.f;
        for (int s = 0; s < S; ++s) o = fmaf(weight[s], part_acc[((first + s) * G + g) * D + d], o);
        out[((long long)row * Hq + hq) * D + d] = from_f32<T>(o * inv);
    }
}

// One specialisation per compiled module: the loader passes ATTEND_T (bf16, f16 or float), ATTEND_G and ATTEND_D
// (ops/attend_parts.py), so a model compiles only its own shape.
#ifndef ATTEND_T
#define ATTEND_T bf16
#define ATTEND_G 4
#define ATTEND_D 128
#endif
// The split kernel's blocks per SM that its registers must allow (ops/attend_parts.py `MIN_BLOCKS`); 0 leaves the
// compiler's own choice (an explicit 1 is not the same: it lets the compiler take up to 255 registers).
#ifndef ATTEND_MIN_BLOCKS
#define ATTEND_MIN_BLOCKS 0
#endif
#if ATTEND_MIN_BLOCKS > 0
#define ATTEND_SPLIT_BOUNDS __launch_bounds__(THREADS, ATTEND_MIN_BLOCKS)
#else
#define ATTEND_SPLIT_BOUNDS __launch_bounds__(THREADS)
#endif

extern "C" __global__ void ATTEND_SPLIT_BOUNDS
    attend_split(const ATTEND_T* q, long long qb, long long qh, Parts parts, float scaling, float softcap,
                 long long total, long long span, int first_share, int shares, float* part_acc, float* part_ml) {
    attend_split_impl<ATTEND_T, ATTEND_G, ATTEND_D>(q, qb, qh, parts, scaling, softcap, total, span, first_share,
                                                    shares, part_acc, part_ml);
}

extern "C" __global__ void __launch_bounds__(THREADS)
    attend_merge(const float* part_acc, const float* part_ml, const float* sinks, ATTEND_T* out, int S) {
    attend_merge_impl<ATTEND_T>(part_acc, part_ml, sinks, out, ATTEND_G, ATTEND_D, S);
}
