// Top-k of long rows, each row split over many blocks: the k best scores of each row, best first.
// Twin: shadowkv_cache/ops/select_topk.py `select_topk_reference` (a stable descending sort, first k).
//
// What this replaces: torch.topk on YAKV's token scores (131,072 per KV head at 128K, k = 4096), whose multi-block
// radix select took 13.5 ms of a 93.6 ms step at batch 22 on an H200 machine (`yakv_profile_128k_batch22_imma`);
// select_topk.cu's block per row reads a long row at one multiprocessor's share of the bandwidth. Here every (row,
// part) is a block, so the grid fills the GPU at any batch:
//
// 1. `topk_digits`, one launch per digit: each block counts the digit of those of its part's keys that match the
//    digits found so far (a shared histogram) and adds the counts into the row's; the row's last block to finish
//    finds the bin that holds the k-th key and moves the row's state on.
// 2. `topk_collect`: every key at or above the k-th goes to the row's candidates (exactly k of them).
// 3. `topk_sort`: each row's candidates, sorted in shared memory (bitonic), give its indices best first.
//
// Keys are 64-bit and distinct: the score's order key above N - 1 - index, so equal scores order by ascending index
// and the k-th key is one key. Digits run from the top bit: three of the score (11, 11, 10 bits), then the index's
// bits. A row whose k-th bin holds exactly the keys it still needs is done: its remaining launches return at once
// (a row whose k-th score is not tied is done after the score's digits).
//
// Legend: R rows, N scores per row, k selected, P parts (blocks) per row.
#include "common.cuh"

#define SPLIT_THREADS 512
#define SPLIT_ITEMS 32  // a part is at most SPLIT_THREADS * SPLIT_ITEMS scores
#define SPLIT_BINS 2048  // 11-bit digits
#define SORT_THREADS 1024

typedef unsigned long long u64;

/// The row's state between launches, at the head of its workspace (zeroed before the first launch).
struct RowState {
    u64 prefix;  // the digits of the k-th key found so far (bits under `mask`)
    u64 mask;    // 0 before the first digit
    int need;    // the k-th key's rank among the keys that share `prefix`
    int done;    // the keys under `prefix` are exactly the `need` still needed
    int arrived; // blocks of this launch that have added their counts
    int taken;   // candidates written by topk_collect
};
#define WORK_WORDS (6 + SPLIT_BINS)  // int32 words per row: the state (24 bytes), then the histogram

__device__ __forceinline__ u64 row_key(const float* __restrict__ row, int i, int N) {
    return ((u64)order_key(row[i]) << 32) | (unsigned)(N - 1 - i);
}

/// \brief One digit of every row's radix select: this block's part of the row counted into the row's histogram; the
///        row's last block to arrive finds the bin of the k-th key and narrows the row's state to it.
/// \param scores      [R, N] fp32, row r at scores + r * row_stride (unit stride within a row)
/// \param work        [R, WORK_WORDS] int32, zeroed before the first digit's launch; in-out
/// \param N, k        scores per row, selected (1 <= k <= N)
/// \param part        scores per block, a multiple of SPLIT_THREADS up to SPLIT_THREADS * SPLIT_ITEMS
/// \param shift, bits this launch's digit: bits [shift, shift + bits) of the 64-bit key, bits <= 11
/// Launch: grid (P, R) with P = ceil(N / part), block SPLIT_THREADS.
extern "C" __global__ void __launch_bounds__(SPLIT_THREADS)
    topk_digits(const float* __restrict__ scores, long long row_stride, int* __restrict__ work, int N, int k,
                int part, int shift, int bits) {
    __shared__ unsigned hist[SPLIT_BINS];
    __shared__ int warp_sums[SPLIT_THREADS / 32];
    __shared__ bool last;
    RowState* st = reinterpret_cast<RowState*>(work + (long long)blockIdx.y * WORK_WORDS);
    unsigned* row_hist = reinterpret_cast<unsigned*>(work + (long long)blockIdx.y * WORK_WORDS + 6);
    if (st->done) return;  // the same for every block of the row
    const u64 prefix = st->prefix, mask = st->mask;
    const int tid = threadIdx.x, lane = tid & 31;
    const float* row = scores + (long long)blockIdx.y * row_stride;
    const unsigned digit_mask = (1u << bits) - 1u;

    for (int b = tid; b < SPLIT_BINS; b += SPLIT_THREADS) hist[b] = 0;
    __syncthreads();
    const int begin = blockIdx.x * part, end = min(begin + part, N);
    unsigned digits[SPLIT_ITEMS];
#pragma unroll
    for (int j = 0; j < SPLIT_ITEMS; ++j) {  // every load in flight before any is counted
        const int i = begin + j * SPLIT_THREADS + tid;
        const u64 key = i < end ? row_key(row, i, N) : 0ull;
        digits[j] = i < end && (key & mask) == prefix ? (unsigned)(key >> shift) & digit_mask : SPLIT_BINS;
    }
#pragma unroll
    for (int j = 0; j < SPLIT_ITEMS; ++j) {
        // A warp whose lanes share a digit (clustered scores, or no lane matching) adds once.
        const unsigned first = __shfl_sync(0xffffffffu, digits[j], 0);
        if (__all_sync(0xffffffffu, digits[j] == first)) {
            if (lane == 0 && first < SPLIT_BINS) atomicAdd(&hist[first], 32u);
        } else if (digits[j] < SPLIT_BINS) {
            atomicAdd(&hist[digits[j]], 1u);
        }
    }
    __syncthreads();
    for (int b = tid; b < SPLIT_BINS; b += SPLIT_THREADS)
        if (hist[b]) atomicAdd(&row_hist[b], hist[b]);
    __threadfence();  // this block's counts reach the row's histogram before its arrival is counted
    __syncthreads();
    if (tid == 0) last = atomicAdd(&st->arrived, 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (!last) return;

    // The row's last block: thread t holds bins 2047 - 4t down to 2044 - 4t (read and zeroed for the next digit), so
    // an inclusive scan over threads counts the keys from the top bin down.
    __threadfence();
    constexpr int PER = SPLIT_BINS / SPLIT_THREADS;
    unsigned count[PER], sum = 0;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        count[j] = atomicExch(&row_hist[SPLIT_BINS - 1 - PER * tid - j], 0u);
        sum += count[j];
    }
    unsigned incl = sum;
    for (int off = 1; off < 32; off <<= 1) {
        const unsigned up = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += up;
    }
    if (lane == 31) warp_sums[tid >> 5] = (int)incl;
    __syncthreads();
    for (int w = 0; w < (tid >> 5); ++w) incl += (unsigned)warp_sums[w];
    const unsigned need = mask == 0ull ? (unsigned)k : (unsigned)st->need;
    unsigned run = incl - sum;
    __syncthreads();  // every thread has read `need` before it is rewritten
    if (run < need && need <= incl) {  // exactly one thread
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            if (run + count[j] >= need) {
                const u64 bin = (u64)(SPLIT_BINS - 1 - PER * tid - j);
                st->prefix = prefix | (bin << shift);
                st->mask = mask | ((u64)digit_mask << shift);
                st->need = (int)(need - run);
                st->done = count[j] == need - run;
                break;
            }
            run += count[j];
        }
    }
    if (tid == 0) st->arrived = 0;
}

/// \brief The keys at or above each row's k-th (exactly k), in no particular order.
/// \param cand  [R, k] u64, out: the keys of each row's k best scores, in no particular order
/// Launch: as topk_digits (after the last digit: every row is done).
extern "C" __global__ void __launch_bounds__(SPLIT_THREADS)
    topk_collect(const float* __restrict__ scores, long long row_stride, int* __restrict__ work,
                 u64* __restrict__ cand, int N, int k, int part) {
    RowState* st = reinterpret_cast<RowState*>(work + (long long)blockIdx.y * WORK_WORDS);
    const u64 prefix = st->prefix, mask = st->mask;
    const int tid = threadIdx.x, lane = tid & 31;
    const float* row = scores + (long long)blockIdx.y * row_stride;
    u64* out = cand + (long long)blockIdx.y * k;
    const int begin = blockIdx.x * part, end = min(begin + part, N);
    u64 keys[SPLIT_ITEMS];
#pragma unroll
    for (int j = 0; j < SPLIT_ITEMS; ++j) {
        const int i = begin + j * SPLIT_THREADS + tid;
        keys[j] = i < end ? row_key(row, i, N) : 0ull;
    }
#pragma unroll
    for (int j = 0; j < SPLIT_ITEMS; ++j) {
        const int i = begin + j * SPLIT_THREADS + tid;
        // At or above the k-th key in its decided digits: above it, or among the keys that share them (all taken).
        const bool take = i < end && (keys[j] & mask) >= prefix;
        const unsigned ballot = __ballot_sync(0xffffffffu, take);
        if (!ballot) continue;  // uniform
        int base = 0;
        if (lane == 0) base = atomicAdd(&st->taken, __popc(ballot));
        base = __shfl_sync(0xffffffffu, base, 0);
        const int at = base + __popc(ballot & ((1u << lane) - 1u));
        if (take && at < k) out[at] = keys[j];  // exactly k are taken; the bound keeps a broken state in bounds
    }
}

/// \brief Each row's k candidates sorted best first (bitonic, in shared memory), written as indices.
/// \param out    [R, k] int64, out: indices of each row's k best scores, best first (equal scores by index)
/// \param width  k rounded up to a power of two (the sort's width); dynamic shared memory width * 8 bytes
/// Launch: grid R, block SORT_THREADS.
extern "C" __global__ void __launch_bounds__(SORT_THREADS)
    topk_sort(const u64* __restrict__ cand, long long* __restrict__ out, int N, int k, int width) {
    extern __shared__ u64 keys[];
    const u64* src = cand + (long long)blockIdx.x * k;
    for (int i = threadIdx.x; i < width; i += SORT_THREADS) keys[i] = i < k ? src[i] : 0ull;  // 0: below every key
    // Bitonic sort, descending: pairs (lo, lo + stride) within each run of `size`, runs alternating direction.
    for (int size = 2; size <= width; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            __syncthreads();
            for (int t = threadIdx.x; t < width / 2; t += SORT_THREADS) {
                const int lo = 2 * t - (t & (stride - 1)), hi = lo + stride;
                const bool descending = (lo & size) == 0;
                const u64 a = keys[lo], b = keys[hi];
                if ((a < b) == descending) {
                    keys[lo] = b;
                    keys[hi] = a;
                }
            }
        }
    }
    __syncthreads();
    long long* dst = out + (long long)blockIdx.x * k;
    for (int i = threadIdx.x; i < k; i += SORT_THREADS) dst[i] = (long long)(N - 1) - (long long)(unsigned)keys[i];
}
