// Top-k selection of one decode step: the k best scores of each (row, head), best first, in one kernel.
// Twin: shadowkv_cache/ops/select_topk.py `select_topk_reference` (a stable descending sort, first k).
//
// What this replaces: torch.topk's kernels for each (row, head) of a layer's chunk scores. At batch 1 and 128K (8
// rows of 16K chunks) they were two block-per-row passes and a sort of the last: 2.3 ms of a 14.8 ms step on an H200
// machine (`decode_profile_128k_batch1`); at batch 32 four multi-block kernels and a sort, 3.2 ms of the step.
//
// Legend: R rows (batch x KV heads), N scores per row, k selected.
#include "common.cuh"

#define TOPK_THREADS 1024
#define TOPK_MAX_K 2048  // shared memory holds k candidates (key and index)

/// \brief The k best of one row, by the whole block (one block per row): a most-significant-digit radix select finds
///        the k-th largest key (four passes of 8-bit digits, each a shared histogram), then one pass in index order
///        gathers the keys above it and the first (by index) of those equal to it, and each candidate's rank among
///        the k gives its place in the output.
///
/// Output order is that of a stable descending sort: higher scores first, equal scores by ascending index. So the
/// selection never depends on the launch (no atomics decide which of equal scores are taken).
///
/// The row has at most ITEMS * TOPK_THREADS scores and each thread keeps its ITEMS keys in registers, read from memory
/// once (all loads in flight together). Longer rows take select_topk_split.cu's kernels.
template <int ITEMS>
__device__ __forceinline__ void select_topk_impl(const float* __restrict__ row, long long* __restrict__ dst, int N,
                                                 int k) {
    __shared__ unsigned hist[256];
    __shared__ unsigned cand_key[TOPK_MAX_K];
    __shared__ int cand_idx[TOPK_MAX_K];
    __shared__ int warp_counts[TOPK_THREADS / 32];
    __shared__ unsigned s_prefix;
    __shared__ int s_need, s_above;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int tiles = (N + TOPK_THREADS - 1) / TOPK_THREADS;  // element i = tile * TOPK_THREADS + tid
    unsigned held[ITEMS];
#pragma unroll
    for (int j = 0; j < ITEMS; ++j) {
        const int i = j * TOPK_THREADS + tid;
        held[j] = i < N ? order_key(row[i]) : 0u;
    }

    // Radix select. `prefix` holds the digits of the k-th largest key found so far (bits under `mask`), `need` its
    // rank among the keys that share them.
    unsigned prefix = 0, mask = 0;
    int need = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += TOPK_THREADS) hist[i] = 0;
        __syncthreads();
#pragma unroll
        for (int j = 0; j < ITEMS; ++j) {
            const int i = j * TOPK_THREADS + tid;
            const unsigned key = held[j];
            const bool counts = i < N && (key & mask) == prefix;
            const unsigned digit = counts ? (key >> shift) & 255u : 256u;
            // Scores cluster (probabilities share their top bits), so all lanes of a warp often hit one bin:
            // such a warp adds once. Otherwise each lane adds; `__match_any_sync` to add each bin's lanes once
            // was slower (35.8 against 32.8 us a layer at batch 1 on an H200 machine,
            // `selection_kernels_cuda_128k_vote`), as was peeling a warp's first three digits by ballots.
            const unsigned first = __shfl_sync(0xffffffffu, digit, 0);
            if (__all_sync(0xffffffffu, digit == first)) {
                if (lane == 0 && first < 256u) atomicAdd(&hist[first], 32u);
            } else if (counts) {
                atomicAdd(&hist[digit], 1u);
            }
        }
        __syncthreads();
        if (warp == 0) {
            // Lane l sums bins 255 - 8l down to 248 - 8l; an inclusive scan over lanes counts from the top bin.
            unsigned local[8], sum = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                local[j] = hist[255 - 8 * lane - j];
                sum += local[j];
            }
            unsigned incl = sum;
            for (int off = 1; off < 32; off <<= 1) {
                const unsigned up = __shfl_up_sync(0xffffffffu, incl, off);
                if (lane >= off) incl += up;
            }
            unsigned run = incl - sum;
            if (run < (unsigned)need && (unsigned)need <= incl) {  // exactly one lane
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    if (run + local[j] >= (unsigned)need) {
                        s_prefix = prefix | ((unsigned)(255 - 8 * lane - j) << shift);
                        s_need = need - (int)run;
                        break;
                    }
                    run += local[j];
                }
            }
        }
        __syncthreads();
        prefix = s_prefix;
        need = s_need;
        mask |= 255u << shift;
    }
    // `prefix` is now the k-th largest key; `need` (>= 1) of the keys equal to it are taken, the first by index.
    const unsigned kth = prefix;
    const int above = k - need;
    if (tid == 0) s_above = 0;
    __syncthreads();
    int equal_taken = 0;  // the same in every thread
    bool done = false;    // likewise
#pragma unroll
    for (int j = 0; j < ITEMS; ++j) {
        if (done || j >= tiles) break;  // uniform
        const int i = j * TOPK_THREADS + tid;
        const unsigned key = held[j];
        if (i < N && key > kth) {
            const int at = atomicAdd(&s_above, 1);
            cand_key[at] = key;
            cand_idx[at] = i;
        }
        const bool equal = i < N && key == kth;
        const unsigned ballot = __ballot_sync(0xffffffffu, equal);
        if (lane == 0) warp_counts[warp] = __popc(ballot);
        __syncthreads();
        const int found_above = s_above;  // final for this tile: the next tile's atomics follow the sync below
        // Equal keys before this warp's in the tile: a scan over the warps' counts, lane w holding warp w's.
        const int mine = lane < TOPK_THREADS / 32 ? warp_counts[lane] : 0;
        int incl = mine;
        for (int off = 1; off < 32; off <<= 1) {
            const int up = __shfl_up_sync(0xffffffffu, incl, off);
            if (lane >= off) incl += up;
        }
        const int before = __shfl_sync(0xffffffffu, incl - mine, warp);
        const int tile_total = __shfl_sync(0xffffffffu, incl, 31);
        if (equal) {
            const int r = equal_taken + before + __popc(ballot & ((1u << lane) - 1u));
            if (r < need) {
                cand_key[above + r] = key;
                cand_idx[above + r] = i;
            }
        }
        equal_taken += tile_total;
        __syncthreads();  // warp_counts is rewritten next tile
        done = equal_taken >= need && found_above == above;  // every candidate is in
    }
    __syncthreads();
    // Rank of each candidate among the k: higher keys first, equal keys (only the k-th's) by index.
    for (int c = tid; c < k; c += TOPK_THREADS) {
        const unsigned key = cand_key[c];
        const int idx = cand_idx[c];
        int rank = 0;
        for (int j = 0; j < k; ++j) {
            const unsigned other = cand_key[j];
            rank += other > key || (other == key && cand_idx[j] < idx);
        }
        dst[rank] = idx;
    }
}

/// \param scores      [R, N] fp32, row r at scores + r * row_stride (unit stride within a row)
/// \param out         [R, k] int64, out: indices of the k best scores of each row, best first
/// \param N           scores per row, at most TOPK_REG_ITEMS * TOPK_THREADS
/// \param k           1 <= k <= min(N, TOPK_MAX_K)
/// Launch: grid R, block TOPK_THREADS.
#define TOPK_REG_ITEMS 16
extern "C" __global__ void __launch_bounds__(TOPK_THREADS) select_topk_regs(const float* __restrict__ scores,
                                                                            long long row_stride,
                                                                            long long* __restrict__ out, int N,
                                                                            int k) {
    select_topk_impl<TOPK_REG_ITEMS>(scores + (long long)blockIdx.x * row_stride, out + (long long)blockIdx.x * k, N,
                                     k);
}
