// Top-k of long rows, each row split over many blocks: the k best scores of each row, best first.
// Twin: shadowkv_cache/ops/select_topk.py `select_topk_reference` (a stable descending sort, first k).
//
// What this replaces: torch.topk on YAKV's token scores (131,072 per KV head at 128K, k = 4096), whose multi-block
// radix select took 13.5 ms of a 93.6 ms step at batch 22 on an H200 machine (`yakv_profile_128k_batch22_imma`);
// select_topk.cu's block per row reads a long row at one multiprocessor's share of the bandwidth. A radix select
// with one launch per digit read the whole row six times and lost to torch.topk at 176 rows (a run not kept). Here each row is read twice, by blocks of (row, part) that fill the GPU at any batch, and what is left fits
// one block's shared memory: 293 against torch.topk's 443 us at 176 rows (`selection_kernels_cuda_128k_split`).
//
// 1. `topk_histogram`: every block counts the top 12 bits of its part's keys and adds them into its row's histogram;
//    the row's last block to finish finds the bin of the k-th key, the keys above it and the keys in it.
// 2. `topk_filter`: the keys above the bin go to the row's candidates (fewer than k), the keys in it to the row's
//    bin buffer (a typical row's bin holds a small share of N: an eighth of a binade of scores).
// 3. `topk_finish`, a block per row: a radix select of the rest of the bits among the bin's keys in shared memory
//    adds the k-th and the keys above it to the candidates, which are sorted (bitonic; the strides below 64 in a
//    warp's registers) into indices. A bin of more keys than the buffer holds (heavy ties: masked rows) is read from
//    the row itself by the block, once per digit: slower, the same result.
//
// Keys are 64-bit and distinct: the score's order key above N - 1 - index, so equal scores order by ascending index
// and the k-th key is one key.
//
// Legend: R rows, N scores per row, k selected, P parts (blocks) per row, C the bin buffer's keys per row.
#include "common.cuh"

#define SPLIT_THREADS 512
#define SPLIT_ITEMS 32     // a part is at most SPLIT_THREADS * SPLIT_ITEMS scores
#define TOP_SHIFT 52       // the first digit: the key's top 12 bits (the order key's sign, exponent, 3 mantissa bits)
#define TOP_BINS 4096
#define FINISH_THREADS 1024
#define FILTER_ITEMS 8  // topk_filter's part: SPLIT_THREADS * FILTER_ITEMS scores, several blocks per SM
#define FINISH_BINS 2048   // the finish's digits: 11 bits

typedef unsigned long long u64;

/// A row's state between the launches, at the head of its workspace (zeroed before the first launch).
struct RowState {
    int bin;      // the top digit of the k-th key
    int above;    // keys of a higher top digit (fewer than k)
    int in_bin;   // keys of the k-th key's top digit
    int arrived;  // blocks of topk_histogram that have added their counts
    int taken;    // keys above the bin written by topk_filter (8-byte aligned: one 64-bit atomic with binned)
    int binned;   // keys of the bin written by topk_filter
    int unused[2];
};
#define STATE_WORDS 8
static_assert(sizeof(RowState) == STATE_WORDS * sizeof(int), "the histogram follows the state");
#define WORK_WORDS (STATE_WORDS + TOP_BINS)  // int32 words per row

__device__ __forceinline__ u64 row_key(const float* __restrict__ row, int i, int N) {
    return ((u64)order_key(row[i]) << 32) | (unsigned)(N - 1 - i);
}

/// \brief The bin holding the need-th largest key, by the whole block: thread t holds the counts of bins
///        BINS - 1 - PER t - j (j < PER), so an inclusive scan over threads counts the keys from the top bin down.
///        The one thread whose bins hold it writes the bin, the keys above it and the bin's count. The caller
///        synchronises before reading them.
template <int PER, int THREADS>
__device__ __forceinline__ void find_bin(const unsigned (&count)[PER], unsigned need, int* warp_sums, int* bin_out,
                                         unsigned* above_out, unsigned* count_out) {
    const int tid = threadIdx.x, lane = tid & 31;
    unsigned sum = 0;
#pragma unroll
    for (int j = 0; j < PER; ++j) sum += count[j];
    unsigned incl = sum;
    for (int off = 1; off < 32; off <<= 1) {
        const unsigned up = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += up;
    }
    if (lane == 31) warp_sums[tid >> 5] = (int)incl;
    __syncthreads();
    for (int w = 0; w < (tid >> 5); ++w) incl += (unsigned)warp_sums[w];
    unsigned run = incl - sum;
    if (run < need && need <= incl) {  // exactly one thread
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            if (run + count[j] >= need) {
                *bin_out = PER * THREADS - 1 - PER * tid - j;
                *above_out = run;
                *count_out = count[j];
                break;
            }
            run += count[j];
        }
    }
}

/// \brief The top digits of every row's keys: this block's part counted into the row's histogram; the row's last
///        block to arrive finds the k-th key's bin.
/// \param scores      [R, N] fp32, row r at scores + r * row_stride (unit stride within a row)
/// \param work        [R, WORK_WORDS] int32, zeroed; out: each row's state
/// \param N, k        scores per row, selected (1 <= k <= N)
/// \param part        scores per block, a multiple of SPLIT_THREADS up to SPLIT_THREADS * SPLIT_ITEMS
/// Launch: grid (P, R) with P = ceil(N / part), block SPLIT_THREADS.
extern "C" __global__ void __launch_bounds__(SPLIT_THREADS)
    topk_histogram(const float* __restrict__ scores, long long row_stride, int* __restrict__ work, int N, int k,
                   int part) {
    __shared__ unsigned hist[TOP_BINS];
    __shared__ int warp_sums[SPLIT_THREADS / 32];
    __shared__ bool last;
    RowState* st = reinterpret_cast<RowState*>(work + (long long)blockIdx.y * WORK_WORDS);
    unsigned* row_hist = reinterpret_cast<unsigned*>(work + (long long)blockIdx.y * WORK_WORDS + STATE_WORDS);
    const int tid = threadIdx.x, lane = tid & 31;
    const float* row = scores + (long long)blockIdx.y * row_stride;

    for (int b = tid; b < TOP_BINS; b += SPLIT_THREADS) hist[b] = 0;
    __syncthreads();
    const int begin = blockIdx.x * part, end = min(begin + part, N);
    // Every load in flight before any is counted: each reads in bounds (a part's last score stands in past its end),
    // without a branch. A load under `i < end` sat in a basic block of its own, and the 32 round trips ran one after
    // another (Nsight Compute on an H100 machine: each load's first use stalled, DRAM at 26% of peak).
    float values[SPLIT_ITEMS];
#pragma unroll
    for (int j = 0; j < SPLIT_ITEMS; ++j) values[j] = row[min(begin + j * SPLIT_THREADS + tid, end - 1)];
    unsigned digits[SPLIT_ITEMS];
#pragma unroll
    for (int j = 0; j < SPLIT_ITEMS; ++j)
        digits[j] = begin + j * SPLIT_THREADS + tid < end ? order_key(values[j]) >> (TOP_SHIFT - 32) : TOP_BINS;
#pragma unroll
    for (int j = 0; j < SPLIT_ITEMS; ++j) {
        // A warp whose lanes share a digit (clustered scores, or a part's tail) adds once. The shared atomics are
        // not what bounds this kernel (a finer first digit for probabilities, which spreads them over 8x the bins,
        // changed nothing: docs/results.md); adding each digit once with its lanes' count (__match_any_sync) was
        // over twice as slow at 176 rows on an H200 machine (exploratory timings, not kept).
        const unsigned first = __shfl_sync(0xffffffffu, digits[j], 0);
        if (__all_sync(0xffffffffu, digits[j] == first)) {
            if (lane == 0 && first < TOP_BINS) atomicAdd(&hist[first], 32u);
        } else if (digits[j] < TOP_BINS) {
            atomicAdd(&hist[digits[j]], 1u);
        }
    }
    __syncthreads();
    for (int b = tid; b < TOP_BINS; b += SPLIT_THREADS)
        if (hist[b]) atomicAdd(&row_hist[b], hist[b]);
    __threadfence();  // this block's counts reach the row's histogram before its arrival is counted
    __syncthreads();
    if (tid == 0) last = atomicAdd(&st->arrived, 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (!last) return;

    __threadfence();
    constexpr int PER = TOP_BINS / SPLIT_THREADS;
    unsigned count[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) count[j] = __ldcg(&row_hist[TOP_BINS - 1 - PER * tid - j]);  // L2: other blocks'
    find_bin<PER, SPLIT_THREADS>(count, (unsigned)k, warp_sums, &st->bin, reinterpret_cast<unsigned*>(&st->above),
                                 reinterpret_cast<unsigned*>(&st->in_bin));
}

/// 0: not taken, 1: above the k-th key's bin (a candidate), 2: in the bin (to the bin buffer, when it fits).
__device__ __forceinline__ int take_kind(unsigned order, bool valid, unsigned bin, bool buffered) {
    const unsigned digit = order >> (TOP_SHIFT - 32);
    if (!valid) return 0;
    return digit > bin ? 1 : (buffered && digit == bin ? 2 : 0);
}

/// \brief The keys above each row's k-th key's bin to its candidates, and the bin's keys to its bin buffer when they
///        fit (in no particular order).
///
/// Each block takes its places with one atomic (the block's two counts in one 64-bit word, summed over its warps'
/// ballots): an atomic per warp and item on the row's counter serialised on that address (the collect kernel of the
/// digit-per-launch version took about 40% of its time that way). Parts are small (8 scores per thread) so that
/// several blocks share an SM and one's loads overlap another's counting: parts of 32 per thread needed 128
/// registers, one block per SM, and took about twice as long (exploratory timings on an H200 machine, not kept).
/// \param cand    [R, k] u64, out: the first `above` of each row
/// \param binbuf  [R, C] u64, out: the first `in_bin` of each row, when in_bin <= C
/// Launch: grid (ceil(N / (SPLIT_THREADS * FILTER_ITEMS)), R), block SPLIT_THREADS.
extern "C" __global__ void __launch_bounds__(SPLIT_THREADS, 3)
    topk_filter(const float* __restrict__ scores, long long row_stride, int* __restrict__ work, u64* __restrict__ cand,
                u64* __restrict__ binbuf, int N, int k, int C) {
    __shared__ u64 warp_counts[SPLIT_THREADS / 32];  // a warp's (in the bin) << 32 | (above), then its offsets
    RowState* st = reinterpret_cast<RowState*>(work + (long long)blockIdx.y * WORK_WORDS);
    const unsigned bin = (unsigned)st->bin;
    const bool buffered = st->in_bin <= C;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float* row = scores + (long long)blockIdx.y * row_stride;
    const int begin = blockIdx.x * (SPLIT_THREADS * FILTER_ITEMS);
    // The keys' score halves (the index half follows from the position); loads in bounds and without branches, all
    // in flight at once, as topk_histogram's.
    float values[FILTER_ITEMS];
#pragma unroll
    for (int j = 0; j < FILTER_ITEMS; ++j) values[j] = row[min(begin + j * SPLIT_THREADS + tid, N - 1)];
    unsigned orders[FILTER_ITEMS];
#pragma unroll
    for (int j = 0; j < FILTER_ITEMS; ++j) orders[j] = begin + j * SPLIT_THREADS + tid < N ? order_key(values[j]) : 0u;
    unsigned n_above = 0, n_in = 0;  // this warp's, the same in every lane
#pragma unroll
    for (int j = 0; j < FILTER_ITEMS; ++j) {
        const int c = take_kind(orders[j], begin + j * SPLIT_THREADS + tid < N, bin, buffered);
        n_above += __popc(__ballot_sync(0xffffffffu, c == 1));
        n_in += __popc(__ballot_sync(0xffffffffu, c == 2));
    }
    if (lane == 0) warp_counts[warp] = ((u64)n_in << 32) | n_above;
    __syncthreads();
    if (warp == 0) {  // exclusive scan of the warps' counts, then the block's places in the row's outputs
        const u64 mine = lane < SPLIT_THREADS / 32 ? warp_counts[lane] : 0ull;
        u64 incl = mine;
        for (int off = 1; off < 32; off <<= 1) {
            const u64 up = __shfl_up_sync(0xffffffffu, incl, off);
            if (lane >= off) incl += up;
        }
        const u64 total = __shfl_sync(0xffffffffu, incl, 31);
        u64 base = 0;
        // taken and binned are adjacent (taken low): one atomic for both; taken < k never carries into binned.
        if (lane == 0 && total) base = atomicAdd(reinterpret_cast<u64*>(&st->taken), total);
        base = __shfl_sync(0xffffffffu, base, 0);
        if (lane < SPLIT_THREADS / 32) warp_counts[lane] = base + incl - mine;
    }
    __syncthreads();
    int at_above = (int)(unsigned)warp_counts[warp], at_in = (int)(warp_counts[warp] >> 32);
    u64* row_cand = cand + (long long)blockIdx.y * k;
    u64* row_bin = binbuf + (long long)blockIdx.y * C;
    const unsigned below = (1u << lane) - 1u;
#pragma unroll
    for (int j = 0; j < FILTER_ITEMS; ++j) {
        const int i = begin + j * SPLIT_THREADS + tid;
        const int c = take_kind(orders[j], i < N, bin, buffered);
        const unsigned up = __ballot_sync(0xffffffffu, c == 1), in = __ballot_sync(0xffffffffu, c == 2);
        const u64 key = ((u64)orders[j] << 32) | (unsigned)(N - 1 - i);
        // The bounds keep a broken state in bounds.
        if (c == 1 && at_above + __popc(up & below) < k) row_cand[at_above + __popc(up & below)] = key;
        if (c == 2 && at_in + __popc(in & below) < C) row_bin[at_in + __popc(in & below)] = key;
        at_above += __popc(up);
        at_in += __popc(in);
    }
}

/// \brief The bitonic steps of strides `top` down to 1 (top <= 32) of runs of `size` on the 64 keys from `base`, held
///        by one warp: lane l holds the keys at base + l (a) and base + 32 + l (b). A pair's lower position keeps the
///        larger key where its run descends ((position & size) == 0), the smaller where it ascends.
__device__ __forceinline__ void warp_bitonic(u64& a, u64& b, int base, int size, int top, int lane) {
    const bool a_descends = ((base + lane) & size) == 0, b_descends = ((base + 32 + lane) & size) == 0;
    if (top == 32 && (a < b) == a_descends) {  // a and b are the pair: the same run, a the lower position
        const u64 t = a;
        a = b;
        b = t;
    }
    for (int stride = min(top, 16); stride > 0; stride >>= 1) {
        const u64 pa = __shfl_xor_sync(0xffffffffu, a, stride), pb = __shfl_xor_sync(0xffffffffu, b, stride);
        const bool lower = (lane & stride) == 0;
        a = (lower == a_descends) == (a > pa) ? a : pa;
        b = (lower == b_descends) == (b > pb) ? b : pb;
    }
}

/// \brief Each row's k best, best first: the radix select of the k-th key among its bin's keys, then the bitonic
///        sort of the k candidates, written as indices.
/// \param out    [R, k] int64, out: indices of each row's k best scores, best first (equal scores by index)
/// \param width  k rounded up to a power of two, at least 64 (the sort's width: a warp's 64 keys at a time)
/// Dynamic shared memory (width + C) * 8 bytes. Launch: grid R, block FINISH_THREADS.
extern "C" __global__ void __launch_bounds__(FINISH_THREADS)
    topk_finish(const float* __restrict__ scores, long long row_stride, const int* __restrict__ work,
                const u64* __restrict__ cand, const u64* __restrict__ binbuf, long long* __restrict__ out, int N,
                int k, int C, int width) {
    extern __shared__ u64 smem[];
    u64* keys = smem;              // [width]: the candidates, sorted
    u64* bin_keys = smem + width;  // [C]: the bin's keys, when buffered
    __shared__ unsigned hist[FINISH_BINS];
    __shared__ int warp_sums[FINISH_THREADS / 32];
    __shared__ int s_bin, s_taken;
    __shared__ unsigned s_above, s_count;
    const int tid = threadIdx.x;
    const RowState* st = reinterpret_cast<const RowState*>(work + (long long)blockIdx.x * WORK_WORDS);
    const int above = st->above, in_bin = st->in_bin;
    const u64 top = (u64)st->bin;
    const bool buffered = in_bin <= C;
    const float* row = scores + (long long)blockIdx.x * row_stride;
    const int count = buffered ? in_bin : N;  // the keys each digit reads: the buffer's, or the row's
    for (int i = tid; i < above; i += FINISH_THREADS) keys[i] = cand[(long long)blockIdx.x * k + i];
    if (buffered)
        for (int i = tid; i < in_bin; i += FINISH_THREADS) bin_keys[i] = binbuf[(long long)blockIdx.x * C + i];
    if (tid == 0) s_taken = 0;
    __syncthreads();

    // The digits below the top one: the score's 20 (11, 9), then the index's low bit_length(N - 1), 11 at a time.
    u64 prefix = top << TOP_SHIFT, mask = 0xfffull << TOP_SHIFT;
    unsigned need = (unsigned)(k - above);
    bool done = (unsigned)in_bin == need;
    int shift = 41, bits = 11, low = max(1, 32 - __clz(N - 1));
    while (!done && bits > 0) {
        for (int b = tid; b < FINISH_BINS; b += FINISH_THREADS) hist[b] = 0;
        __syncthreads();
        const unsigned digit_mask = (1u << bits) - 1u;
        for (int i = tid; i < count; i += FINISH_THREADS) {
            const u64 key = buffered ? bin_keys[i] : row_key(row, i, N);
            if ((key & mask) == prefix) atomicAdd(&hist[(unsigned)(key >> shift) & digit_mask], 1u);
        }
        __syncthreads();
        constexpr int PER = FINISH_BINS / FINISH_THREADS;
        unsigned counts[PER];
#pragma unroll
        for (int j = 0; j < PER; ++j) counts[j] = hist[FINISH_BINS - 1 - PER * tid - j];
        find_bin<PER, FINISH_THREADS>(counts, need, warp_sums, &s_bin, &s_above, &s_count);
        __syncthreads();
        prefix |= (u64)s_bin << shift;
        mask |= (u64)digit_mask << shift;
        need -= s_above;
        done = s_count == need;
        // The next digit: the score's last 9 bits, then the index's from the top.
        if (shift == 41) {
            shift = 32;
            bits = 9;
        } else {
            bits = min(11, low);
            low -= bits;
            shift = low;
        }
    }
    // The bin's keys at or above the k-th in the decided digits: exactly k - above of them.
    for (int i = tid; i < count; i += FINISH_THREADS) {
        const u64 key = buffered ? bin_keys[i] : row_key(row, i, N);
        if ((key >> TOP_SHIFT) == top && (key & mask) >= prefix) {
            const int at = above + atomicAdd(&s_taken, 1);
            if (at < k) keys[at] = key;
        }
    }
    __syncthreads();
    for (int i = k + tid; i < width; i += FINISH_THREADS) keys[i] = 0ull;  // 0: below every key
    // Bitonic sort, descending: pairs (lo, lo + stride) within each run of `size`, runs alternating direction. The
    // strides below 64 stay within a warp's 64 keys: they run in registers between one load and one store (all of
    // sizes 2 to 64 at once, then the last six strides of each larger size), and only the strides of 64 and up pass
    // through shared memory, each behind a barrier: 21 of the 78 passes at width 4096.
    const int warp = tid >> 5, lane = tid & 31;
    __syncthreads();
    for (int base = warp * 64; base < width; base += FINISH_THREADS * 2) {
        u64 a = keys[base + lane], b = keys[base + 32 + lane];
        for (int size = 2; size <= 64; size <<= 1) warp_bitonic(a, b, base, size, size >> 1, lane);
        keys[base + lane] = a;
        keys[base + 32 + lane] = b;
    }
    for (int size = 128; size <= width; size <<= 1) {
        for (int stride = size >> 1; stride >= 64; stride >>= 1) {
            __syncthreads();
            for (int t = tid; t < width / 2; t += FINISH_THREADS) {
                const int lo = 2 * t - (t & (stride - 1)), hi = lo + stride;
                const bool descending = (lo & size) == 0;
                const u64 a = keys[lo], b = keys[hi];
                if ((a < b) == descending) {
                    keys[lo] = b;
                    keys[hi] = a;
                }
            }
        }
        __syncthreads();
        for (int base = warp * 64; base < width; base += FINISH_THREADS * 2) {
            u64 a = keys[base + lane], b = keys[base + 32 + lane];
            warp_bitonic(a, b, base, size, 32, lane);
            keys[base + lane] = a;
            keys[base + 32 + lane] = b;
        }
    }
    __syncthreads();
    long long* dst = out + (long long)blockIdx.x * k;
    for (int i = tid; i < k; i += FINISH_THREADS) dst[i] = (long long)(N - 1) - (long long)(unsigned)keys[i];
}
