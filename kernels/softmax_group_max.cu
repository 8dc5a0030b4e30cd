// Second pass of a per-token (or per-chunk) selection score: softmax over the units of each query head from
// fp32 logits and per-tile softmax states written by a first pass (kernels/score_codes.cu), then the max over
// the query heads of each GQA group. Twin: shadowkv_cache/ops/score_codes.py (`attention_scores`, the softmax /
// GQA-max tail of `code_scores_reference`).
//
// Legend: B batch, Hkv KV heads, G query heads per KV head, C units (tokens or chunks), N tiles of the first pass.
#include "common.cuh"

#define SGM_THREADS 256

/// \brief One block per (tile of 1024 units, KV head, row): scores[c] = max_g exp(logit - M_g) / S_g, with
/// (M_g, S_g) merged from the tiles' partial states; 0 where a row's head has nothing selectable.
///
/// \param scores    [B, Hkv, C] fp32, out
/// \param logits    [B, Hkv, G, C] fp32, -inf where a unit is not selectable
/// \param part_max, part_sum  [B, Hkv, G, N] fp32: each tile's max and sum of exp(logit - max)
/// Launch: grid (ceil(C / 1024), Hkv, B), block 256 threads.
extern "C" __global__ void __launch_bounds__(SGM_THREADS)
    softmax_group_max(float* scores, const float* logits, const float* part_max, const float* part_sum, int Hkv,
                         int G, int C, int n_tiles) {
    const int head = blockIdx.y, row = blockIdx.z;
    const size_t rh = (size_t)row * Hkv + head;
    __shared__ float gm[32], gs[32];
    if (threadIdx.x < G) {
        float mm = NEG_INF, s2 = 0.f;
        const size_t p = (rh * G + threadIdx.x) * n_tiles;
        for (int t = 0; t < n_tiles; ++t) merge_state(mm, s2, part_max[p + t], part_sum[p + t]);
        gm[threadIdx.x] = mm;
        gs[threadIdx.x] = s2;
    }
    __syncthreads();
    const float* lg = logits + rh * (size_t)G * C;
    const int end = min(C, (blockIdx.x + 1) * 1024);
    for (int c = blockIdx.x * 1024 + threadIdx.x; c < end; c += SGM_THREADS) {
        float best = 0.f;
        for (int g = 0; g < G; ++g)
            if (gm[g] != NEG_INF) best = fmaxf(best, __expf(lg[(size_t)g * C + c] - gm[g]) / gs[g]);
        scores[rh * C + c] = best;
    }
}
