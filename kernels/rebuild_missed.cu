// The missed slots' keys in one kernel (ShadowKV §3.3): rows of A times B on tensor cores, then RoPE at the chunk's
// true positions, written into the slots. Twin: shadowkv_cache/ops/rebuild_missed.py (the definition).
//
// Legend: B batch, Hkv KV heads, K slots, c chunk size, D head dim, Tc compressed tokens, R rank.
//
// rebuild_keys.cu's path multiplies every slot's rows of A by B (hits too: 60% of the work at h = 0.6), through a
// gathered copy of those rows and a copy of the products in HBM, then reads the products back for RoPE. At batch 32
// and 128K on an H200 machine the gather, the GEMM and the RoPE took 3.1, 3.8 and 5.5 ms of a 57.5 ms step's device
// time (`decode_profile_128k_batch32`). Here each block gathers the rows of A of its head's missed slots itself,
// multiplies them on tensor cores (m16n8k16, fp32 sums) by that head's B, staged once in shared memory, rounds the
// products to the keys' dtype (as the GEMM stored them) and applies RoPE from a per-warp tile: nothing but the keys
// is written.

#include "common.cuh"

#define REBUILD_THREADS 256
#define REBUILD_WARPS (REBUILD_THREADS / 32)
#define REBUILD_PAD 8  // elements added to each shared row: the fragment loads and stores hit distinct banks

/// \brief Shared memory of `rebuild_missed_*`: B of one head `[D][R16 + PAD]`, a `[16][max(R16, D) + PAD]` tile per
///        warp (its rows of A, then its products), the block's missed slots `[spb]`.
__host__ __device__ constexpr int rebuild_shared_bytes(int D, int R, int spb) {
    return 2 * D * (((R + 15) / 16) * 16 + REBUILD_PAD) +
           2 * REBUILD_WARPS * 16 * ((((R + 15) / 16) * 16 > D ? ((R + 15) / 16) * 16 : D) + REBUILD_PAD) + 4 * spb;
}

/// \brief The missed slots among slots [s*spb, (s+1)*spb) of (row, head) bh, by one block (s = blockIdx.y). Its rows
///        of A are the missed slots' tokens in slot order, `c` per slot; each warp takes 16 of them at a time (one
///        m16n8k16 row tile) against all D columns.
///
/// Every global read is issued before its first use (B and each tile of A are copied to shared memory by all lanes
/// at once, 16 bytes a load where aligned; each tile's chunk ids and positions by one lane per row): a block has only
/// a few missed slots at batch 1, so the latency of dependent reads, not bandwidth, would set its time.
///
/// \param keys      [B, Hkv, K, c, D] T, out: written at the missed slots
/// \param a         [B, Tc, R] T: row r at a + r*a_row, token t at + t*a_tok (unit stride over R; a_row 0: shared)
/// \param bmat      [B, R, Hkv, D] T: at bmat + row*b_row + k*b_rank + head*b_head (unit stride over D)
/// \param ids, miss, positions, pos_row_stride, inv_freq, attention_scaling, rotary_dim, interleaved: as rope_missed in
///                  rebuild_keys.cu
/// \param R         rank (any; the k loop pads it to a multiple of 16 with zeros)
/// \param spb       slots per block (the grid's y dimension covers K)
/// \param vec       bit 0: rows of A, bit 1: rows of B, bit 2: rows of keys start 16-byte aligned and hold whole
///                  16-byte groups
template <typename T, int D>
__device__ __forceinline__ void rebuild_missed_head(int bh, T* keys, const T* a, long long a_row, long long a_tok,
                                                    const T* bmat, long long b_row, long long b_rank, long long b_head,
                                                    const long long* ids, const bool* miss, const long long* positions,
                                                    long long pos_row_stride, const float* inv_freq,
                                                    float attention_scaling, int rotary_dim, int interleaved, int Hkv,
                                                    int K, int c, int R, int spb, int vec) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int R16 = ((R + 15) / 16) * 16, ldb = R16 + REBUILD_PAD, lda = R16 + REBUILD_PAD, ldt = D + REBUILD_PAD;
    const int tile_elems = 16 * ((R16 > D ? R16 : D) + REBUILD_PAD);
    T* bs = reinterpret_cast<T*>(smem_raw);  // [D][ldb]: B transposed, k contiguous (the MMA's column operand)
    T* tiles = bs + D * ldb;                  // [warps][tile_elems]
    int* list = reinterpret_cast<int*>(tiles + REBUILD_WARPS * tile_elems);  // [spb]
    __shared__ int warp_counts[REBUILD_WARPS];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int head = bh % Hkv;
    const long long row = bh / Hkv, slot0 = (long long)bh * K;
    const int s_begin = blockIdx.y * spb, s_end = min(K, s_begin + spb);

    // The missed slots of this block's range, in slot order.
    int count = 0;  // the same in every thread
    for (int base = s_begin; base < s_end; base += REBUILD_THREADS) {
        const int s = base + threadIdx.x;
        const bool m = s < s_end && miss[slot0 + s];
        const unsigned ballot = __ballot_sync(0xffffffffu, m);
        if (lane == 0) warp_counts[warp] = __popc(ballot);
        __syncthreads();
        int before = 0, total = 0;
#pragma unroll
        for (int w = 0; w < REBUILD_WARPS; ++w) {
            before += w < warp ? warp_counts[w] : 0;
            total += warp_counts[w];
        }
        if (m) list[count + before + __popc(ballot & ((1u << lane) - 1u))] = s;
        count += total;
        __syncthreads();
    }
    if (count == 0) return;

    // B of this head, transposed into shared memory.
    const T* b_of_head = bmat + row * b_row + (long long)head * b_head;
    if (vec & 2) {
        for (int e = threadIdx.x; e < R16 * (D / 8); e += REBUILD_THREADS) {
            const int k = e / (D / 8), n = (e - k * (D / 8)) * 8;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (k < R) v = *reinterpret_cast<const uint4*>(b_of_head + (long long)k * b_rank + n);
            const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int q = 0; q < 8; ++q) bs[(n + q) * ldb + k].x = (unsigned short)(w[q >> 1] >> (16 * (q & 1)));
        }
    } else {
        for (int e = threadIdx.x; e < R16 * D; e += REBUILD_THREADS) {
            const int k = e / D, n = e - k * D;
            T v;
            v.x = 0;
            if (k < R) v = b_of_head[(long long)k * b_rank + n];
            bs[n * ldb + k] = v;
        }
    }
    __syncthreads();

    const int g = lane >> 2, tig = lane & 3, rows = count * c;
    const T* a_of_row = a + row * a_row;
    T* tile = tiles + warp * tile_elems;
    const int half = rotary_dim / 2;
    for (int first = warp * 16; first < rows; first += REBUILD_WARPS * 16) {
        // Lane i < 16 looks up row `first + i` of the tile: its token's row of A, its output row and position.
        long long a_off = 0, out_off = 0;
        float pos = 0.0f;
        bool valid = false;
        if (lane < 16 && first + lane < rows) {
            const int r = first + lane, j = r / c, token = r - j * c;
            const long long slot = slot0 + list[j];
            const long long at_token = max(ids[slot], 0LL) * c + token;
            a_off = at_token * a_tok;
            out_off = (slot * c + token) * (long long)D;
            pos = (float)positions[row * pos_row_stride + at_token];
            valid = true;
        }
        // The tile's rows of A into shared memory (zeros past the rank and past the last row).
        if (vec & 1) {
            const int groups = R16 / 8;
            for (int e = lane; e < 16 * groups; e += 32) {
                const int i = e / groups, k = (e - i * groups) * 8;
                const long long off = __shfl_sync(0xffffffffu, a_off, i);  // every lane takes part
                const bool ok = __shfl_sync(0xffffffffu, valid, i) && k < R;
                uint4 v = make_uint4(0u, 0u, 0u, 0u);
                if (ok) v = *reinterpret_cast<const uint4*>(a_of_row + off + k);
                *reinterpret_cast<uint4*>(tile + i * lda + k) = v;
            }
        } else {
            for (int e = lane; e < 16 * R16; e += 32) {
                const int i = e / R16, k = e - i * R16;
                const long long off = __shfl_sync(0xffffffffu, a_off, i);
                const bool ok = __shfl_sync(0xffffffffu, valid, i) && k < R;
                T v;
                v.x = 0;
                if (ok) v = a_of_row[off + k];
                tile[i * lda + k] = v;
            }
        }
        __syncwarp();
        float acc[D / 8][4];
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
        const T* arow = tile + g * lda + tig * 2;
        const T* bcol = bs + g * ldb + tig * 2;
        for (int k0 = 0; k0 < R16; k0 += 16) {
            // a0: (g, k), a1: (g + 8, k), a2: (g, k + 8), a3: (g + 8, k + 8)
            const unsigned af[4] = {*reinterpret_cast<const unsigned*>(arow + k0),
                                    *reinterpret_cast<const unsigned*>(arow + 8 * lda + k0),
                                    *reinterpret_cast<const unsigned*>(arow + k0 + 8),
                                    *reinterpret_cast<const unsigned*>(arow + 8 * lda + k0 + 8)};
#pragma unroll
            for (int nt = 0; nt < D / 8; ++nt) {
                const unsigned b0 = *reinterpret_cast<const unsigned*>(bcol + nt * 8 * ldb + k0);
                const unsigned b1 = *reinterpret_cast<const unsigned*>(bcol + nt * 8 * ldb + k0 + 8);
                mma_m16n8k16_of(T{}, acc[nt], af, b0, b1);
            }
        }
        __syncwarp();  // the tile's rows of A are read: it now takes the products
        // The products rounded to T (what the GEMM stored).
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                T* at = tile + (g + 8 * h) * ldt + nt * 8 + tig * 2;
                at[0] = from_f32<T>(acc[nt][2 * h]);
                at[1] = from_f32<T>(acc[nt][2 * h + 1]);
            }
        }
        __syncwarp();
        // RoPE in place, as rebuild_keys.cu's rope_missed computes it. Lane l rotates row l % 16, pairs l / 16,
        // l / 16 + 2, ...: the few pairs whose angle takes sincosf's slow path (the highest frequencies at large
        // positions) fall on every lane once, instead of on the same lanes for each of the 16 rows.
        {
            const float p = __shfl_sync(0xffffffffu, pos, lane & 15);
            T* x = tile + (lane & 15) * ldt;
            for (int i = lane >> 4; i < half; i += 2)
                rope_pair(x, x, i, half, interleaved, p, inv_freq, attention_scaling);
        }
        __syncwarp();
        // The tile's rows to their slots (dims past the rotated ones as the products left them).
        const int tile_rows = min(16, rows - first);
        if (vec & 4) {
            for (int e = lane; e < 16 * (D / 8); e += 32) {
                const int t = e / (D / 8), d = (e - t * (D / 8)) * 8;
                const long long out_row = __shfl_sync(0xffffffffu, out_off, t);
                if (t < tile_rows)
                    *reinterpret_cast<uint4*>(keys + out_row + d) = *reinterpret_cast<const uint4*>(tile + t * ldt + d);
            }
        } else {
            for (int e = lane; e < 16 * D; e += 32) {
                const int t = e / D, d = e - t * D;
                const long long out_row = __shfl_sync(0xffffffffu, out_off, t);
                if (t < tile_rows) keys[out_row + d] = tile[t * ldt + d];
            }
        }
        __syncwarp();  // the tile is rewritten by the next row tile
    }
}

/// \brief Grid (min(B*Hkv, cap), splits): block (x, s) rebuilds the slot range s of (row, head)s x, x + gridDim.x, ...
///        (`rebuild_missed_head`). The grid is capped at the blocks that are resident at once: a longer grid kept
///        its last blocks queued, and the value fetch launched beside it on another stream waited behind them (~110
///        µs a layer at batch 44, 128K, on an H200 machine) before its first block could start.
/// Launch: grid (min(BH, cap), ceil(K / spb)), block REBUILD_THREADS, dynamic shared memory rebuild_shared_bytes(D, R,
///         spb); BH = B*Hkv.
#define REBUILD_MISSED(T, SUFFIX, D)                                                                            \
    extern "C" __global__ void __launch_bounds__(REBUILD_THREADS) rebuild_missed_##SUFFIX##_d##D(               \
        T* keys, const T* a, long long a_row, long long a_tok, const T* bmat, long long b_row, long long b_rank, \
        long long b_head, const long long* ids, const bool* miss, const long long* positions,                   \
        long long pos_row_stride, const float* inv_freq, float attention_scaling, int rotary_dim,               \
        int interleaved, int Hkv, int K, int c, int R, int spb, int vec, int BH) {                              \
        for (int bh = blockIdx.x; bh < BH; bh += gridDim.x) {                                                   \
            __syncthreads(); /* the shared memory of the block's previous (row, head) is read by every warp */ \
            rebuild_missed_head<T, D>(bh, keys, a, a_row, a_tok, bmat, b_row, b_rank, b_head, ids, miss,       \
                                      positions, pos_row_stride, inv_freq, attention_scaling, rotary_dim,        \
                                      interleaved, Hkv, K, c, R, spb, vec);                                    \
        }                                                                                                       \
    }

REBUILD_MISSED(bf16, bfloat16, 64)
REBUILD_MISSED(bf16, bfloat16, 128)
REBUILD_MISSED(bf16, bfloat16, 256)
REBUILD_MISSED(f16, float16, 64)
REBUILD_MISSED(f16, float16, 128)
REBUILD_MISSED(f16, float16, 256)
