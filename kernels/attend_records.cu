// One-token decode attention over YAKV's selected tokens, read in place from the device mirror of their ~4-bit records
// (design.md §4): when a store mirrors every token, a step fetches nothing and holds nothing. A key's logit is taken
// where its record lives, in the rotated domain: with k = s ⊙ H(g_k) · n_k / D (H the unnormalised Walsh-Hadamard
// transform, g_k the grid points of the key's codes, s the signs, n_k its norm), q·k = n_k / D · H(s ⊙ q)·g_k, so the
// query is rotated once per block and each code costs one table read and p multiply-adds per query head. The values'
// weighted sum is taken over grid points too and rotated back once per block: Σ_t w_t v_t = s ⊙ H(Σ_t w_t n_t g_t) / D.
// The block writes split shares in attend_parts.cu's layout (shares [0, gridDim.x) of each (row, head)), which
// attend_merge merges with the other parts' shares.
// Twin: shadowkv_cache/ops/attend_records.py (`attend_records_reference`: the records dequantised as gather_dequant
// does, then attend_parts' definition).
//
// Legend: B batch, Hkv KV heads, G query heads per KV head, D head dim, p grid dim (PG), M = D/p codes per vector,
// E = 2*M + 4 record bytes, K selected slots per head, S shares per (row, head) in all, TOK slots per tile.
#include "common.cuh"

#define THREADS 128
#define WARPS (THREADS / 32)
#define TOK 64
#define SLOT_THREADS (THREADS / TOK)  // threads per slot for its logit

/// \brief Grid point `code`'s PG coordinates from the table in shared memory, in as few loads as its size allows.
template <int PG>
__device__ __forceinline__ void grid_point(const float* tab, int code, float (&x)[PG]) {
    if constexpr (PG % 4 == 0) {
#pragma unroll
        for (int i = 0; i < PG / 4; ++i) {
            const float4 w = reinterpret_cast<const float4*>(tab + code * PG)[i];
            x[4 * i] = w.x;
            x[4 * i + 1] = w.y;
            x[4 * i + 2] = w.z;
            x[4 * i + 3] = w.w;
        }
    } else if constexpr (PG == 2) {
        const float2 w = reinterpret_cast<const float2*>(tab)[code];
        x[0] = w.x;
        x[1] = w.y;
    } else {
#pragma unroll
        for (int i = 0; i < PG; ++i) x[i] = tab[code * PG + i];
    }
}

/// \brief The unnormalised Walsh-Hadamard transform of each of the G vectors `x[g*D .. g*D + D)` in shared memory,
/// in place, by the block (butterflies on pairs (a, a + h), natural order: the transform of common.cuh's
/// warp_hadamard); every stage ends in a block barrier.
template <int G, int D>
__device__ __forceinline__ void block_hadamard(float* x) {
    for (int h = 1; h < D; h <<= 1) {
        for (int i = threadIdx.x; i < G * D / 2; i += THREADS) {
            const int g = i / (D / 2), j = i - g * (D / 2);
            const int a = g * D + (j / h) * 2 * h + (j % h);
            const float u = x[a], v = x[a + h];
            x[a] = u + v;
            x[a + h] = u - v;
        }
        __syncthreads();
    }
}

/// \brief Shares of the attention of one (split, KV head, row): the group's G queries over selected slots
/// [split*span, min((split+1)*span, K)), TOK slots per tile.
///
/// \param q          query element (b, h*G + g, d) at q[b*qb + (h*G + g)*qh + d]
/// \param ids        [B, Hkv, K] int64 token of each slot (read for every slot; its record only where `valid`)
/// \param valid      [B, Hkv, K] bool
/// \param mirror     record (r, h, t) of the device mirror at r*row_stride + h*head_stride + t*E bytes, every stride
///                   and the base a multiple of 4 bytes; it holds every token an id names
/// \param row_map    [B] int64 stored row behind each cache row
/// \param grid       [256, PG] float32 grid points; \param signs [D] float32 (+-1)
/// \param scaling    the attention's scale; \param softcap as attend_split (0: none)
/// \param shares     S: shares per (row, head) in `part_acc` and `part_ml` (this kernel writes the first gridDim.x)
/// \param part_acc   [B, Hkv, S, G, D] fp32 out: sum over the split's valid slots of exp(logit - m) * v
/// \param part_ml    [B, Hkv, S, G, 2] fp32 out: (max logit, sum of exp(logit - max)); max = -inf when none
/// Launch: grid (splits, Hkv, B), block THREADS.
template <typename T, int G, int D, int PG>
__device__ __forceinline__ void attend_records_impl(const T* q, long long qb, long long qh, const long long* ids,
                                                    const bool* valid, long long K, const unsigned char* mirror,
                                                    long long row_stride, long long head_stride,
                                                    const long long* row_map, const float* grid, const float* signs,
                                                    float scaling, float softcap, long long span, int shares,
                                                    float* part_acc, float* part_ml) {
    constexpr int M = D / PG;                  // codes per vector
    constexpr int E = 2 * M + 4;               // record bytes
    constexpr int KC = M / SLOT_THREADS;       // key codes per thread
    constexpr int KW = KC / 4;                 // their 4-byte words
    constexpr int U = M / 4;                   // a value's code words: lane -> (slot rr, word u)
    constexpr int R = 32 / U;                  // slots per warp step when weighing values
    constexpr int VS = TOK / (WARPS * R);      // value words per lane and tile
    constexpr int C = 4 * PG;                  // rotated coordinates per value word
    // The two threads of a slot read the query's coordinates KC codes apart, which would fall in one bank: the
    // second half sits QPAD floats further on.
    constexpr int QPAD = 4;
    static_assert(D % PG == 0 && KC % 4 == 0 && U >= 1 && U <= 32 && 32 % U == 0 && VS >= 1, "unsupported shape");
    static_assert(4 * (M * G * PG + QPAD + 256 * PG + G * TOK + 2 * TOK + 3 * G + WARPS * G * D) + 48 <= 48 * 1024,
                  "static shared memory over 48 KB (48 bytes for the arrays' alignment)");
    __shared__ __align__(16) float qs[M * G * PG + QPAD];  // the rotated, scaled query: code c's PG coordinates per
                                                           // head, the second half of the codes QPAD floats on
    __shared__ __align__(16) float tab[256 * PG];
    __shared__ float ps[G * TOK];                   // logits, then weights
    __shared__ float vn[TOK];                       // the tile's value norms
    __shared__ float st[3 * G];                     // [G] m, [G] l, [G] rescale
    __shared__ int ok[TOK];
    __shared__ __align__(16) float red[WARPS * G * D];  // the query's rotation, then the warps' sums

    const int split = blockIdx.x, head = blockIdx.y, row = blockIdx.z, Hkv = gridDim.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int slot = tid / SLOT_THREADS, part = tid - slot * SLOT_THREADS;
    const int rr = lane / U, u = lane - rr * U;
    const long long rh = (long long)row * Hkv + head;
    const long long* slot_ids = ids + rh * K;
    const bool* slot_valid = valid + rh * K;
    const unsigned char* records = mirror + row_map[row] * row_stride + head * head_stride;

    // The query, signed, rotated (butterflies over shared memory), scaled by scaling / D, laid out per code.
    for (int i = tid; i < G * D; i += THREADS) {
        const int g = i / D, d = i - g * D;
        red[i] = to_f32(q[row * qb + (long long)(head * G + g) * qh + d]) * signs[d];
    }
    for (int i = tid; i < 256 * PG; i += THREADS) tab[i] = grid[i];
    if (tid < G) {
        st[tid] = NEG_INF;
        st[G + tid] = 0.f;
    }
    __syncthreads();
    block_hadamard<G, D>(red);
    static_assert(SLOT_THREADS == 2, "the query's halves are one per thread of a slot");
    const float* my_qs = qs + part * (KC * G * PG + QPAD);  // this thread's codes' coordinates
    const float qscale = scaling / (float)D;
    for (int i = tid; i < G * D; i += THREADS) {
        const int g = i / D, d = i - g * D, c = d / PG, j = d - c * PG;
        qs[(c * G + g) * PG + j + (c >= KC ? QPAD : 0)] = red[i] * qscale;
    }
    float acc[G][C];
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
        for (int e = 0; e < C; ++e) acc[g][e] = 0.f;
    __syncthreads();

    const long long begin = (long long)split * span, end = min(begin + span, K);
    for (long long t0 = begin; t0 < end; t0 += TOK) {
        // Loads: the norms and this thread's key codes of its slot, the value words of the slots this lane weighs.
        // A slot's id is read with its flag, whatever the flag (an invalid slot's id, maybe -1, is only added to a
        // pointer that is not read), so the record waits on one round trip before it, not two.
        const long long n = t0 + slot;
        const bool in = n < end;
        const long long id = in ? slot_ids[n] : 0;
        const bool live = in && slot_valid[n];
        unsigned norms = 0, kw[KW];
        {
            const unsigned* rec = reinterpret_cast<const unsigned*>(records + id * E);
            if (live) norms = rec[0];
#pragma unroll
            for (int i = 0; i < KW; ++i) kw[i] = live ? rec[1 + part * KW + i] : 0u;
        }
        unsigned vw[VS];
#pragma unroll
        for (int j = 0; j < VS; ++j) {
            const long long m = t0 + warp * R + rr + j * WARPS * R;
            const bool vin = m < end;
            const long long vid = vin ? slot_ids[m] : 0;
            const bool lv = vin && slot_valid[m];
            const unsigned* rec = reinterpret_cast<const unsigned*>(records + vid * E);
            vw[j] = lv ? rec[1 + M / 4 + u] : 0u;
        }
        // Logits: each of a slot's threads takes KC consecutive codes, then they sum across their lanes.
        float dot[G * PG];
#pragma unroll
        for (int i = 0; i < G * PG; ++i) dot[i] = 0.f;
#pragma unroll
        for (int i = 0; i < KW; ++i) {
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                const int c = 4 * i + b;  // of this thread's codes
                float x[PG];
                grid_point<PG>(tab, (kw[i] >> (8 * b)) & 0xff, x);
#pragma unroll
                for (int j = 0; j < PG; ++j)
#pragma unroll
                    for (int g = 0; g < G; ++g)  // dot[g*PG + j] collects coordinate j; the PG sums join below
                        dot[g * PG + j] = fmaf(my_qs[(c * G + g) * PG + j], x[j], dot[g * PG + j]);
            }
        }
        float logit[G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
            logit[g] = 0.f;
#pragma unroll
            for (int j = 0; j < PG; ++j) logit[g] += dot[g * PG + j];
        }
#pragma unroll
        for (int off = 1; off < SLOT_THREADS; off <<= 1)
#pragma unroll
            for (int g = 0; g < G; ++g) logit[g] += __shfl_xor_sync(0xffffffffu, logit[g], off);
        __syncthreads();  // the previous tile's weights, norms and rescales are read
        if (part == 0) {
            const float key_norm = to_f32(f16{(unsigned short)(norms & 0xffffu)});
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float s = logit[g] * key_norm;
                if (softcap > 0.f) s = softcap * tanhf(s / softcap);
                ps[g * TOK + slot] = live ? s : NEG_INF;
            }
            vn[slot] = to_f32(f16{(unsigned short)(norms >> 16)});
            ok[slot] = live;
        }
        __syncthreads();
        // Online softmax: one warp per query head.
        online_softmax_tile<G, TOK, WARPS>(ps, st, lane, warp);
        __syncthreads();
        // Weighted values, in the rotated domain: grid points times weight times norm.
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float alpha = st[2 * G + g];
#pragma unroll
            for (int e = 0; e < C; ++e) acc[g][e] *= alpha;
        }
#pragma unroll
        for (int j = 0; j < VS; ++j) {
            const int r = warp * R + rr + j * WARPS * R;
            if (!ok[r]) continue;  // also past the split's end
            const float norm = vn[r];
            float pw[G];
#pragma unroll
            for (int g = 0; g < G; ++g) pw[g] = ps[g * TOK + r] * norm;
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                float x[PG];
                grid_point<PG>(tab, (vw[j] >> (8 * b)) & 0xff, x);
#pragma unroll
                for (int jj = 0; jj < PG; ++jj) {
#pragma unroll
                    for (int g = 0; g < G; ++g) acc[g][b * PG + jj] = fmaf(pw[g], x[jj], acc[g][b * PG + jj]);
                }
            }
        }
    }
    // Sum the lanes of one word (slots rr = 0..R-1), then the warps, then rotate back: coordinate u*C + e is code
    // 4u + e / PG's coordinate e % PG, the order the rotation's butterflies take.
#pragma unroll
    for (int off = U; off < 32; off <<= 1)
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
            for (int e = 0; e < C; ++e) acc[g][e] += __shfl_down_sync(0xffffffffu, acc[g][e], off);
    __syncthreads();  // the query's rotation is done with red
    if (lane < U) {
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
            for (int e = 0; e < C; ++e) red[(warp * G + g) * D + lane * C + e] = acc[g][e];
    }
    __syncthreads();
    for (int i = tid; i < G * D; i += THREADS) {
        float sum = 0.f;
#pragma unroll
        for (int w = 1; w < WARPS; ++w) sum += red[w * G * D + i];
        red[i] += sum;  // each i by one thread: warp 0's slot becomes the total
    }
    __syncthreads();
    block_hadamard<G, D>(red);
    const long long share = rh * shares + split;
    for (int i = tid; i < G * D; i += THREADS) part_acc[share * G * D + i] = red[i] * signs[i % D] / (float)D;
    if (tid < G) {
        part_ml[(share * G + tid) * 2] = st[tid];
        part_ml[(share * G + tid) * 2 + 1] = st[G + tid];
    }
}

// One specialisation per compiled module: ops/attend_records.py passes ATTEND_T (bf16, f16 or float), ATTEND_G,
// ATTEND_D and RECORDS_PG (the host grid's dimension), so a model compiles only its own shape.
#ifndef ATTEND_T
#define ATTEND_T bf16
#define ATTEND_G 4
#define ATTEND_D 128
#define RECORDS_PG 2
#endif

extern "C" __global__ void __launch_bounds__(THREADS)
    attend_records(const ATTEND_T* q, long long qb, long long qh, const long long* ids, const bool* valid, long long K,
                   const unsigned char* mirror, long long row_stride, long long head_stride, const long long* row_map,
                   const float* grid, const float* signs, float scaling, float softcap, long long span, int shares,
                   float* part_acc, float* part_ml) {
    attend_records_impl<ATTEND_T, ATTEND_G, ATTEND_D, RECORDS_PG>(q, qb, qh, ids, valid, K, mirror, row_stride,
                                                                  head_stride, row_map, grid, signs, scaling, softcap,
                                                                  span, shares, part_acc, part_ml);
}
