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
#include "common.cuh"

#define QH_WARPS 8       // vectors in flight per block of 256 threads
#define QH_MAX_DIM 256   // the warp's shared row

template <int P> __device__ __forceinline__ void load_point(const float* g, float (&out)[P]) {
    if constexpr (P == 2) {
        const float2 t = *reinterpret_cast<const float2*>(g);
        out[0] = t.x;
        out[1] = t.y;
    } else {
#pragma unroll
        for (int k = 0; k < P / 4; ++k) {
            const float4 t = reinterpret_cast<const float4*>(g)[k];
            out[4 * k] = t.x;
            out[4 * k + 1] = t.y;
            out[4 * k + 2] = t.z;
            out[4 * k + 3] = t.w;
        }
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
    __shared__ __align__(16) float points[256 * P];
    __shared__ float neg_half_sq[256];
    __shared__ float sign[QH_MAX_DIM];
    __shared__ float rows[QH_WARPS][QH_MAX_DIM];
    for (int i = threadIdx.x; i < 256 * P; i += blockDim.x) points[i] = grid[i];
    for (int i = threadIdx.x; i < D; i += blockDim.x) sign[i] = signs[i];
    __syncthreads();
    for (int j = threadIdx.x; j < 256; j += blockDim.x) {
        float sq = 0.f;
#pragma unroll
        for (int c = 0; c < P; ++c) sq = fmaf(points[j * P + c], points[j * P + c], sq);
        neg_half_sq[j] = -0.5f * sq;
    }
    __syncthreads();

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int M = D / P;
    const int L = M >= 32 ? 1 : 32 / M;  // M and 32 are powers of two: M * L == 32 when M < 32
    const int per_pass = 32 / L, part = lane & (L - 1);
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

        for (int s = lane / L; s < M; s += per_pass) {  // the same trip count on every lane (shuffles below)
            float xs[P];
#pragma unroll
            for (int c = 0; c < P; ++c) xs[c] = v[s * P + c] * inv_sqrt_d * scale;
            float best = NEG_INF;
            int best_j = 0;  // stays 0 only if every score is -inf or NaN
            for (int j = part; j < 256; j += L) {
                float g[P];
                load_point<P>(points + j * P, g);
                float e = neg_half_sq[j];
#pragma unroll
                for (int c = 0; c < P; ++c) e = fmaf(xs[c], g[c], e);
                if (e > best) {  // strict: the first of equal scores in this lane's (increasing) order
                    best = e;
                    best_j = j;
                }
            }
            for (int off = 1; off < L; off <<= 1) {  // the L lanes of one sub-vector are consecutive
                const float other = __shfl_xor_sync(0xffffffffu, best, off);
                const int other_j = __shfl_xor_sync(0xffffffffu, best_j, off);
                if (other > best || (other == best && other_j < best_j)) {
                    best = other;
                    best_j = other_j;
                }
            }
            if (part == 0) codes[n * M + s] = (unsigned char)best_j;
        }
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
