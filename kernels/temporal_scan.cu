// Temporal-cache scan (ShadowKV §3.3): which of this step's selected chunks are already held (hits), and
// where each miss goes. Twin: shadowkv_cache/ops/temporal_scan.py (the definition).
//
// Legend: B batch, Hkv KV heads, K slots (selected chunks per head).
#include "common.cuh"

/// \brief One block per (row, head): keep slots whose chunk is still wanted, give every newly wanted chunk
///        a freed slot, in place.
///
/// A slot is kept when its chunk is among this step's valid wanted chunks. The m-th newly wanted chunk (in
/// wanted order) goes to the m-th free slot (in slot order); remaining free slots become empty (-1).
/// Nothing is moved: held keys and values stay in their slots, so hits cost no copy.
///
/// \param ids     [B*Hkv, K] int64, in/out: chunk held by each slot, -1 = empty
/// \param wanted  [B*Hkv, K] int64: chunks selected this step
/// \param valid   [B*Hkv, K] bool: which entries of `wanted` count
/// \param miss    [B*Hkv, K] bool, out: the slot got a new chunk (its keys must be rebuilt, values fetched)
/// \param K       slots per head (at most 2048: shared memory holds 5 ints and 2 flags per slot)
/// Launch: grid B*Hkv, block 256 (a multiple of 32, at most 1024), dynamic shared memory 22*K bytes.
extern "C" __global__ void temporal_scan(long long* ids, const long long* wanted, const bool* valid, bool* miss,
                                         int K) {
    extern __shared__ int smem[];
    int* old_ids = smem;            // [K] chunk in each slot before this step
    int* want = old_ids + K;        // [K] wanted chunk, -1 when not valid
    int* free_rank = want + K;      // [K] rank of each free slot among free slots
    int* new_rank = free_rank + K;  // [K] rank of each new chunk among new chunks
    int* new_list = new_rank + K;   // [K] index j (into want) of the m-th new chunk
    unsigned char* is_free = reinterpret_cast<unsigned char*>(new_list + K);  // [K]
    unsigned char* is_new = is_free + K;                                      // [K]
    __shared__ int warp_sums[32];

    const size_t base = (size_t)blockIdx.x * K;
    for (int s = threadIdx.x; s < K; s += blockDim.x) {
        old_ids[s] = (int)ids[base + s];
        want[s] = valid[base + s] ? (int)wanted[base + s] : -1;
    }
    __syncthreads();
    for (int s = threadIdx.x; s < K; s += blockDim.x) {
        const int o = old_ids[s];
        bool keep = false;
        if (o >= 0)
            for (int j = 0; j < K && !keep; ++j) keep = want[j] == o;
        is_free[s] = !keep;
        free_rank[s] = !keep;
        const int w = want[s];
        bool fresh = w >= 0;
        for (int j = 0; j < K && fresh; ++j) fresh = old_ids[j] != w;
        is_new[s] = fresh;
        new_rank[s] = fresh;
    }
    __syncthreads();
    const int num_new = block_exclusive_scan(new_rank, K, warp_sums);
    block_exclusive_scan(free_rank, K, warp_sums);
    for (int j = threadIdx.x; j < K; j += blockDim.x)
        if (is_new[j]) new_list[new_rank[j]] = j;
    __syncthreads();
    for (int s = threadIdx.x; s < K; s += blockDim.x) {
        if (!is_free[s]) {
            miss[base + s] = false;
            continue;
        }
        const int r = free_rank[s];
        if (r < num_new) {
            ids[base + s] = (long long)want[new_list[r]];
            miss[base + s] = true;
        } else {
            ids[base + s] = -1;
            miss[base + s] = false;
        }
    }
}

// ---- Long rows (YAKV's selected tokens): membership by bitmaps ---------------------------------------------------------
//
// Why: the pairwise kernel above compares K^2 pairs, and above ~1K slots the step took the sorted scan (two sorts, two
// binary searches, two cumulative sums and a scatter in PyTorch: ~9 ms of a 105 ms YAKV step at 128K and batch 22 on an
// H200). The units a row selects are indices below `units` (YAKV: its tokens), so membership is one bit of a bitmap in
// shared memory: the wanted units' bitmap says which slots keep their unit, the held units' bitmap which wanted units are
// new, and two block-wide scans in slot and wanted order give each new unit its free slot, as the twin orders them.

/// \brief Exclusive rank of this thread's `flag` among the block's threads (in thread order), and the block's count;
/// every thread of the block calls it. `warp_counts` is [32] shared scratch.
__device__ __forceinline__ int block_rank(bool flag, int* warp_counts, int& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    const unsigned ballot = __ballot_sync(0xffffffffu, flag);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int before = 0;
    total = 0;
    for (int w = 0; w < warps; ++w) {
        const int c = warp_counts[w];
        before += w < warp ? c : 0;
        total += c;
    }
    __syncthreads();  // warp_counts is reused by the next call
    return before + __popc(ballot & ((1u << lane) - 1u));
}

/// \brief `temporal_scan` for rows of many slots whose units are below `units`: one block per (row, head), the wanted
///        and held units as bitmaps in shared memory; in place, as the pairwise kernel.
///
/// \param ids, wanted, valid, miss  as `temporal_scan`'s (ids and valid wanted entries in [0, units))
/// \param fresh   [B*Hkv, K] int32 scratch: the new units of each row, in wanted order
/// \param counts  [2] int64, in/out, or null: the misses are added to counts[0] and the launch to counts[1] (a
///                temporal cache's hit counters, kept without a reduction and two additions per layer and step)
/// \param K       slots per head; \param units  the units ids index (ShadowKV: the prompt's chunks; YAKV: its tokens)
/// Launch: grid B*Hkv, block 1024, dynamic shared memory 8 * ceil(units / 32) bytes (two bitmaps).
extern "C" __global__ void __launch_bounds__(1024) temporal_scan_bitmap(long long* ids, const long long* wanted,
                                                                       const bool* valid, bool* miss, int* fresh,
                                                                       unsigned long long* counts, int K,
                                                                       int units) {
    extern __shared__ unsigned bits[];
    __shared__ int warp_counts[32];
    const int words = (units + 31) >> 5;
    unsigned* want_bits = bits;         // [words] units wanted this step (valid entries)
    unsigned* held_bits = bits + words;  // [words] units held before this step
    const size_t base = (size_t)blockIdx.x * K;
    for (int i = threadIdx.x; i < 2 * words; i += blockDim.x) bits[i] = 0u;
    __syncthreads();
    for (int s = threadIdx.x; s < K; s += blockDim.x) {
        if (valid[base + s]) {
            const int w = (int)wanted[base + s];
            atomicOr(&want_bits[w >> 5], 1u << (w & 31));
        }
        const long long o = ids[base + s];
        if (o >= 0) atomicOr(&held_bits[o >> 5], 1u << (o & 31));
    }
    __syncthreads();
    // The new units (wanted, not held) in wanted order, into `fresh`.
    int num_new = 0;
    for (int s0 = 0; s0 < K; s0 += blockDim.x) {
        const int s = s0 + threadIdx.x;
        int w = -1;
        bool is_new = false;
        if (s < K && valid[base + s]) {
            w = (int)wanted[base + s];
            is_new = !((held_bits[w >> 5] >> (w & 31)) & 1u);
        }
        int count;
        const int rank = block_rank(is_new, warp_counts, count);
        if (is_new) fresh[base + num_new + rank] = w;
        num_new += count;
    }
    __syncthreads();  // `fresh` is read below by other threads of the block
    // Each free slot (its unit not wanted again, or empty) in slot order takes the next new unit, or becomes empty.
    int taken = 0;
    for (int s0 = 0; s0 < K; s0 += blockDim.x) {
        const int s = s0 + threadIdx.x;
        bool is_free = false;
        if (s < K) {
            const long long o = ids[base + s];
            is_free = !(o >= 0 && ((want_bits[o >> 5] >> (o & 31)) & 1u));
        }
        int count;
        const int rank = block_rank(is_free, warp_counts, count);
        if (s < K) {
            const int r = taken + rank;
            const bool takes = is_free && r < num_new;
            if (is_free) ids[base + s] = takes ? (long long)fresh[base + r] : -1LL;
            miss[base + s] = takes;
        }
        taken += count;
    }
    if (counts != nullptr && threadIdx.x == 0) {
        atomicAdd(counts, (unsigned long long)min(num_new, taken));  // the slots that took a new unit
        if (blockIdx.x == 0) atomicAdd(counts + 1, 1ull);
    }
}
