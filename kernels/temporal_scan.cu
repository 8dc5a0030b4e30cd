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
