// Zero-copy gather and dequantisation of the tokens a YAKV decode step selected (design.md §4): each warp reads a few
// (row, head, token) records straight from the pinned host store through its device-visible address and writes
// each token's key and value in the KV dtype. The ids stay on the device, so the step never waits for the host.
// With a `fetch` mask it refreshes held slots in place (YAKV's token reuse): only flagged slots are read and
// written, so only the tokens missed since the previous step cross PCIe. Tokens below N' are read from the store's
// device mirror instead (a copy of each row's first N' records in GPU memory): the same bytes at HBM speed.
// Twin: shadowkv_cache/ops/gather_dequant.py (`gather_dequant_reference`, `gather_dequant_missed_reference`).
//
// Legend: B batch, Hkv KV heads, K selected tokens per head, N stored tokens, D head dim, p grid dim,
// M = D/p sub-vectors, E = 2*M + 4 record bytes, EPL coordinates per lane (D = 32*EPL, or D lanes of 1).
//
// A record is [key norm fp16 | value norm fp16 | key codes (M) | value codes (M)]. Decoding, as
// `gather_values_higgs4`: grid points, the inverse rotation as an unnormalised Walsh-Hadamard transform (here
// across the warp's registers), times norm / D (the grid's unit scale and the orthonormal Hadamard, 1/sqrt(D)
// each) and the sign flip of each coordinate.
#include "common.cuh"

#define GD_WARPS 8                               // warps per block of 256 threads
#ifndef GD_RECORDS
#define GD_RECORDS 1                             // consecutive slots per warp (ops/gather_dequant.py RECORDS_PER_WARP)
#endif
#define GD_MAX_WORDS 65                          // (D + 4) / 4 at D = 256, p = 2: the largest record

/// \brief Each warp takes GD_RECORDS consecutive slots: it issues the loads of every record it fetches before it
/// decodes the first, then writes each token's key and value.
///
/// \param keys, values  [B, Hkv, K, D] T, out
/// \param ids           [B, Hkv, K] int64 token of each slot (< N where `fetch` is 1; read for every slot)
/// \param fetch         [B, Hkv, K] bool slots to fetch, or null for all of them
/// \param host          pinned records [R, Hkv, N, E], device-visible pointer; record (r, h, t) at
///                      r*row_stride + h*head_stride + t*E bytes
/// \param mirror        [R, Hkv, N', E] device copy of the records of tokens < N' (null when N' = 0); record
///                      (r, h, t) at r*mirror_row_stride + h*mirror_head_stride + t*E bytes
/// \param row_map       [B] int64 stored row behind each cache row
/// \param total         B*Hkv*K
/// \param vec4          1 when `host`, `mirror`, their strides and E are multiples of 4 (4-byte loads)
/// \param grid          [256, p] float32 grid points; \param signs [D] float32 (+-1), on the device
/// Launch: grid ceil(total / (8 * GD_RECORDS)), block 256 threads.
template <typename T, int EPL>
__device__ __forceinline__ void gather_dequant_impl(T* keys, T* values, const long long* ids, const bool* fetch,
                                                    const unsigned char* host, const unsigned char* mirror,
                                                    long long mirrored, long long mirror_row_stride,
                                                    long long mirror_head_stride, const long long* row_map,
                                                    long long row_stride, long long head_stride, int Hkv, int K,
                                                    long long total, int D, int p, int E, int vec4,
                                                    const float* grid, const float* signs) {
    constexpr int NW = (GD_MAX_WORDS + 31) / 32;  // words per lane of the largest record
    __shared__ unsigned int rec[GD_WARPS][GD_MAX_WORDS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long first = ((long long)blockIdx.x * GD_WARPS + warp) * GD_RECORDS;
    const int n = E >> 2;
    // Every load of every record the warp fetches is issued before any is used: one memory round trip per warp and
    // GD_RECORDS records (ops/gather_dequant.py RECORDS_PER_WARP says what more than one did).
    const unsigned char* src[GD_RECORDS];
    bool live[GD_RECORDS];
    unsigned w[GD_RECORDS][NW];
#pragma unroll
    for (int r = 0; r < GD_RECORDS; ++r) {
        // The slot's flag, id and stored row are read together, in bounds (the last slot stands in past the end) and
        // whatever the flag says, so the record's loads wait on one round trip before them, not two: reading the id
        // only behind the flag made the flag, the id and the record three round trips one after another. An id where
        // the flag is 0 is only added to a pointer that is not read.
        const long long slot = first + r, at = slot < total ? slot : total - 1;
        const long long row = at / ((long long)Hkv * K), head = (at / K) % Hkv;
        const long long token = ids[at], stored = row_map[row];
        live[r] = slot < total && (fetch == nullptr || fetch[at]);  // uniform over the warp
        src[r] = token < mirrored ? mirror + stored * mirror_row_stride + head * mirror_head_stride + token * E
                                  : host + stored * row_stride + head * head_stride + token * (long long)E;
#pragma unroll
        for (int i = 0; i < NW; ++i)
            w[r][i] = live[r] && vec4 && lane + 32 * i < n ? reinterpret_cast<const unsigned int*>(src[r])[lane + 32 * i]
                                                           : 0u;
    }

    const int lanes = D < 32 ? D : 32, m = D / p;
    const unsigned char* bytes = reinterpret_cast<const unsigned char*>(rec[warp]);
#pragma unroll
    for (int r = 0; r < GD_RECORDS; ++r) {
        if (!live[r]) continue;  // a held token (its key and value are already in place) or past the end
        __syncwarp();  // the previous record's bytes are read by every lane
        if (vec4) {
#pragma unroll
            for (int i = 0; i < NW; ++i)
                if (lane + 32 * i < n) rec[warp][lane + 32 * i] = w[r][i];
        } else {
            for (int b = lane; b < E; b += 32) reinterpret_cast<unsigned char*>(rec[warp])[b] = src[r][b];
        }
        __syncwarp();
        float k[EPL], v[EPL];
#pragma unroll
        for (int j = 0; j < EPL; ++j) {
            const int c = lane * EPL + j;
            if (lane < lanes) {
                const int sub = c / p, comp = c - sub * p;
                k[j] = __ldg(grid + bytes[4 + sub] * p + comp);
                v[j] = __ldg(grid + bytes[4 + m + sub] * p + comp);
            } else {
                k[j] = v[j] = 0.f;
            }
        }
        warp_hadamard<EPL>(k, lanes);
        warp_hadamard<EPL>(v, lanes);
        if (lane < lanes) {
            const float k_scale = to_f32(f16{(unsigned short)(rec[warp][0] & 0xffffu)}) / (float)D;
            const float v_scale = to_f32(f16{(unsigned short)(rec[warp][0] >> 16)}) / (float)D;
            const long long slot = first + r;
            T* kd = keys + slot * D + lane * EPL;
            T* vd = values + slot * D + lane * EPL;
#pragma unroll
            for (int j = 0; j < EPL; ++j) {
                const float s = __ldg(signs + lane * EPL + j);
                kd[j] = from_f32<T>(k[j] * k_scale * s);
                vd[j] = from_f32<T>(v[j] * v_scale * s);
            }
        }
    }
}

#define GATHER_DEQUANT(T, SUFFIX, EPL)                                                                            \
    extern "C" __global__ void __launch_bounds__(256) gather_dequant_##SUFFIX##_e##EPL(                          \
        T* keys, T* values, const long long* ids, const bool* fetch, const unsigned char* host,                  \
        const unsigned char* mirror, long long mirrored, long long mirror_row_stride,                            \
        long long mirror_head_stride, const long long* row_map, long long row_stride, long long head_stride,      \
        int Hkv, int K, long long total, int D, int p, int E, int vec4, const float* grid, const float* signs) { \
        gather_dequant_impl<T, EPL>(keys, values, ids, fetch, host, mirror, mirrored, mirror_row_stride,          \
                                    mirror_head_stride, row_map, row_stride, head_stride, Hkv, K, total, D, p, E, \
                                    vec4, grid, signs);                                                          \
    }
#define GATHER_DEQUANT_ALL(T, SUFFIX)                                                                             \
    GATHER_DEQUANT(T, SUFFIX, 1) GATHER_DEQUANT(T, SUFFIX, 2) GATHER_DEQUANT(T, SUFFIX, 4)                       \
    GATHER_DEQUANT(T, SUFFIX, 8)

GATHER_DEQUANT_ALL(float, float32)
GATHER_DEQUANT_ALL(bf16, bfloat16)
GATHER_DEQUANT_ALL(f16, float16)
