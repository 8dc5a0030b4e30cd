// HIGGS quantisation of head vectors at prefill (YAKV, design.md §4): for each vector, the sign flip and Walsh-Hadamard
// rotation, the norm, the scale to unit coordinate variance and, per sub-vector, the nearest of the 256 grid
// points. Twin: shadowkv_cache/ops/quantize_higgs.py (`quantize_vectors_reference`, i.e. `HiggsQuantizer.quantize`).
//
// Why a kernel: the twin materialises the rotated fp32 copy of every vector and a [N*M, 256] fp32 distance block
// that the argmin then reads back (1 KiB per sub-vector: 64 KiB per D = 128 vector at p = 2). Here each vector is
// read once and only its codes and norm are written; the distances live in registers.
//
// Legend: N vectors, D head dim (a power of two, <= 256), p grid dim, M = D/p sub-vectors, L lanes per
// sub-vector (32/M when M < 32, else 1).
//
// One warp per vector (a grid-stride loop, so each block loads the grid once for many vectors): the vector goes
// to the warp's row of shared memory, times the sign flips, then the butterflies of an unnormalised transform
// (pair (i, i + h) -> (a + b, a - b), h = 1, 2, ..., as warp_hadamard in common.cuh). The twin's orthonormal
// rotation is that divided by sqrt(D). Each sub-vector's search scans the grid from shared memory keeping the
// largest x.g - |g|^2/2 (the smallest |x - g|^2, as the twin's addmm + argmin); when M < 32 the L lanes of a
// sub-vector scan interleaved points (j = part, part + L, ...) and merge, so no lane idles and neighbouring lanes
// read neighbouring points. Ties go to the lower index, as argmin's first minimum.
//
// The search is the kernel's cost (M * 256 scores per vector against one read of D values), so it is built to
// issue few instructions per score: a point and its -|g|^2/2 sit in one padded record of float4s (one shared load
// for p = 2, broadcast to the warp), and when M > 32 each lane scores its S = M/32 sub-vectors against every point
// it loads. Each score is the same fma chain as before (-|g|^2/2, then x_c * g_c in order), so the codes do not
// depend on S.
#include "common.cuh"

#define QH_WARPS 8       // vectors in flight per block of 256 threads
#define QH_MAX_DIM 256   // the warp's shared row

// A point's record: its P coordinates, then -|g|^2/2, padded to whole float4s (4 floats at p = 2, 8 at 4, 12 at 8).
template <int P> struct PointRecord {
    static constexpr int kFloats = (P + 1 + 3) / 4 * 4;
    static constexpr int kQuads = kFloats / 4;
};

/// Scores of S sub-vectors (xs[k], lane's sub-vectors) against the points j = part, part + L, ... < 256; best[k] and
/// best_j[k] keep the first largest in that order.
template <int P, int S>
__device__ __forceinline__ void scan_points(const float4* records, const float (&xs)[S][P], int part, int L,
                                            float (&best)[S], int (&best_j)[S]) {
    constexpr int Q = PointRecord<P>::kQuads;
#pragma unroll
    for (int k = 0; k < S; ++k) {
        best[k] = NEG_INF;
        best_j[k] = 0;  // stays 0 only if every score is -inf or NaN
    }
    const int steps = 256 / L;
#pragma unroll 4
    for (int t = 0; t < steps; ++t) {
        const int j = part + t * L;
        float r[4 * Q];
#pragma unroll
        for (int q = 0; q < Q; ++q) {
            const float4 v = records[j * Q + q];
            r[4 * q] = v.x;
            r[4 * q + 1] = v.y;
            r[4 * q + 2] = v.z;
            r[4 * q + 3] = v.w;
        }
#pragma unroll
        for (int k = 0; k < S; ++k) {
            float e = r[P];
#pragma unroll
            for (int c = 0; c < P; ++c) e = fmaf(xs[k][c], r[c], e);
            if (e > best[k]) {  // strict: the first of equal scores in this lane's (increasing) order
                best[k] = e;
                best_j[k] = j;
            }
        }
    }
}

/// The search for one vector in the warp's row `v` (rotated, unnormalised): codes of its M sub-vectors, S per lane
/// (M = 32 * S when S > 1; M <= 32 with L = 32 / M lanes each when S == 1).
template <int P, int S>
__device__ __forceinline__ void search_vector(unsigned char* codes_row, const float* v, const float4* records, int M,
                                              int L, float inv_sqrt_d, float scale) {
    const int lane = threadIdx.x & 31, part = lane & (L - 1), first = lane / L, per_pass = 32 / L;
    float xs[S][P];
#pragma unroll
    for (int k = 0; k < S; ++k) {
        const int s = first + k * per_pass;
#pragma unroll
        for (int c = 0; c < P; ++c) xs[k][c] = s < M ? v[s * P + c] * inv_sqrt_d * scale : 0.f;
    }
    float best[S];
    int best_j[S];
    scan_points<P, S>(records, xs, part, L, best, best_j);
#pragma unroll
    for (int k = 0; k < S; ++k) {
        for (int off = 1; off < L; off <<= 1) {  // the L lanes of one sub-vector are consecutive
            const float other = __shfl_xor_sync(0xffffffffu, best[k], off);
            const int other_j = __shfl_xor_sync(0xffffffffu, best_j[k], off);
            if (other > best[k] || (other == best[k] && other_j < best_j[k])) {
                best[k] = other;
                best_j[k] = other_j;
            }
        }
        const int s = first + k * per_pass;
        if (part == 0 && s < M) codes_row[s] = (unsigned char)best_j[k];
    }
}

/// \brief Codes and norm of each of N vectors: one warp per vector, a grid-stride loop over vectors.
///
/// \param codes   [N, M] uint8, out: index of each sub-vector's nearest grid point
/// \param norms   [N] fp16, out: Euclidean norm of each rotated (= original) vector
/// \param x       input T; vector n starts at element (n / inner) * outer_stride + (n % inner) * inner_stride,
///                its D coordinates contiguous
/// \param grid    [256, P] fp32 grid points; \param signs [D] fp32 (+-1) sign flip of the rotation
/// \param inv_sqrt_d, sqrt_d  1/sqrt(D) (the twin's Hadamard entries) and sqrt(D) (its scale numerator), fp32
/// Launch: any number of blocks (the wrapper takes enough to fill the GPU), block 256 threads.
template <typename T, int P>
__device__ __forceinline__ void quantize_higgs_impl(unsigned char* codes, f16* norms, const T* x,
                                                    long long n_vectors, long long inner, long long outer_stride,
                                                    long long inner_stride, int D, const float* grid,
                                                    const float* signs, float inv_sqrt_d, float sqrt_d) {
    constexpr int R = PointRecord<P>::kFloats;
    __shared__ __align__(16) float records[256 * R];
    __shared__ float sign[QH_MAX_DIM];
    __shared__ float rows[QH_WARPS][QH_MAX_DIM];
    for (int i = threadIdx.x; i < 256 * R; i += blockDim.x) {
        const int j = i / R, c = i % R;
        records[i] = c < P ? grid[j * P + c] : 0.f;
    }
    for (int i = threadIdx.x; i < D; i += blockDim.x) sign[i] = signs[i];
    __syncthreads();
    for (int j = threadIdx.x; j < 256; j += blockDim.x) {
        float sq = 0.f;
#pragma unroll
        for (int c = 0; c < P; ++c) sq = fmaf(records[j * R + c], records[j * R + c], sq);
        records[j * R + P] = -0.5f * sq;
    }
    __syncthreads();
    const float4* quads = reinterpret_cast<const float4*>(records);

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int M = D / P;
    const int L = M >= 32 ? 1 : 32 / M;  // M and 32 are powers of two: M * L == 32 when M < 32
    float* v = rows[warp];
    for (long long n = (long long)blockIdx.x * QH_WARPS + warp; n < n_vectors; n += (long long)gridDim.x * QH_WARPS) {
        const T* src = x + (n / inner) * outer_stride + (n % inner) * inner_stride;
        for (int i = lane; i < D; i += 32) v[i] = to_f32(src[i]) * sign[i];
        __syncwarp();
        for (int h = 1; h < D; h <<= 1) {
            for (int b = lane; b < (D >> 1); b += 32) {
                const int i = ((b & ~(h - 1)) << 1) | (b & (h - 1));
                const float a = v[i], c = v[i + h];
                v[i] = a + c;
                v[i + h] = a - c;
            }
            __syncwarp();
        }
        float sq = 0.f;
        for (int i = lane; i < D; i += 32) {
            const float r = v[i] * inv_sqrt_d;
            sq = fmaf(r, r, sq);
        }
#pragma unroll
        for (int off = 16; off; off >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, off);
        const float norm = sqrtf(sq);
        // A zero vector scales to zero, so every sub-vector takes the point nearest the origin; its zero norm
        // makes it dequantise to zero whatever the codes.
        const float scale = sqrt_d / fmaxf(norm, 1.17549435e-38f);  // the twin's clamp to float32 tiny
        if (lane == 0) norms[n] = from_f32<f16>(norm);
        unsigned char* row = codes + n * M;
        if (M > 64)
            search_vector<P, 4>(row, v, quads, M, L, inv_sqrt_d, scale);
        else if (M > 32)
            search_vector<P, 2>(row, v, quads, M, L, inv_sqrt_d, scale);
        else
            search_vector<P, 1>(row, v, quads, M, L, inv_sqrt_d, scale);
        __syncwarp();  // every lane has read the row before the next vector overwrites it
    }
}

#define QUANTIZE_HIGGS(T, SUFFIX, P)                                                                              \
    extern "C" __global__ void __launch_bounds__(256) quantize_higgs_##SUFFIX##_p##P(                            \
        unsigned char* codes, f16* norms, const T* x, long long n_vectors, long long inner,                     \
        long long outer_stride, long long inner_stride, int D, const float* grid, const float* signs,           \
        float inv_sqrt_d, float sqrt_d) {                                                                        \
        quantize_higgs_impl<T, P>(codes, norms, x, n_vectors, inner, outer_stride, inner_stride, D, grid, signs, \
                                  inv_sqrt_d, sqrt_d);                                                           \
    }
#define QUANTIZE_HIGGS_ALL(T, SUFFIX) \
    QUANTIZE_HIGGS(T, SUFFIX, 2) QUANTIZE_HIGGS(T, SUFFIX, 4) QUANTIZE_HIGGS(T, SUFFIX, 8)

QUANTIZE_HIGGS_ALL(float, float32)
QUANTIZE_HIGGS_ALL(bf16, bfloat16)
QUANTIZE_HIGGS_ALL(f16, float16)
