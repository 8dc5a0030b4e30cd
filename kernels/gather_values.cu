// Zero-copy gather of missed value chunks (ShadowKV §3.3): each block reads one (row, head, chunk) block of
// the pinned host value store through its device-visible address (unified addressing) and writes it into
// the slot of the per-head value buffer. Twin: shadowkv_cache/ops/gather_values.py (the definition).
//
// Legend: B batch, Hkv KV heads, K slots, c chunk size, D head dim, C stored chunks.
#include "common.cuh"

/// \brief One block per (slot, head, row); blocks of slots that hit return at once.
///
/// \param values        [B, Hkv, K, c*D] elements of `chunk_bytes` bytes each slot, out (written where `miss`)
/// \param ids           [B, Hkv, K] int64: chunk held by each slot
/// \param miss          [B, Hkv, K] bool: slots to fetch
/// \param host          pinned host store [rows, Hkv, C, c, D], device-visible pointer; the block of
///                      (stored row r, head h, chunk ch) starts at r*row_stride + h*head_stride + ch*chunk_bytes
/// \param row_map       [B] int64: stored row behind each cache row
/// \param row_stride    bytes between stored rows
/// \param head_stride   bytes between heads of a stored row
/// \param chunk_bytes   bytes of one chunk (c*D elements); one chunk is contiguous in both layouts
/// \param vec16         1 when every address and `chunk_bytes` are multiples of 16 (16-byte copies)
/// Launch: grid (K, Hkv, B), block 128 threads.
extern "C" __global__ void __launch_bounds__(128)
    gather_values(unsigned char* values, const long long* ids, const bool* miss, const unsigned char* host,
                  const long long* row_map, long long row_stride, long long head_stride, int Hkv, int K,
                  int chunk_bytes, int vec16) {
    const int slot = blockIdx.x, head = blockIdx.y, row = blockIdx.z;
    const size_t sh = ((size_t)row * Hkv + head) * K + slot;
    if (!miss[sh]) return;
    const unsigned char* src = host + row_map[row] * row_stride + head * head_stride + ids[sh] * chunk_bytes;
    unsigned char* dst = values + sh * (size_t)chunk_bytes;
    if (vec16) {
        const uint4* s = reinterpret_cast<const uint4*>(src);
        uint4* d = reinterpret_cast<uint4*>(dst);
        const int n = chunk_bytes >> 4;
        for (int i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
    } else {
        for (int i = threadIdx.x; i < chunk_bytes; i += blockDim.x) dst[i] = src[i];
    }
}

// ---- quantised stores: decode while gathering ---------------------------------------------------------------
//
// The twin of the decoding is shadowkv_cache/value_codecs.py; the gather is the same as above.

/// \brief The float value of a float8 e4m3fn code (1 sign, 4 exponent bits with bias 7, 3 mantissa bits, no
/// infinities, S.1111.111 is NaN); exact, as PyTorch's conversion.
__device__ __forceinline__ float fp8_e4m3_to_f32(unsigned int code) {
    const unsigned int sign = (code & 0x80u) << 24, exp = (code >> 3) & 0xFu, man = code & 0x7u;
    if (exp == 0xFu && man == 0x7u) return __uint_as_float(0x7FC00000u);
    // Subnormal: man * 2^-9; normal: 2^(exp-7) * (1 + man/8), whose fp32 exponent field is exp - 7 + 127.
    const float mag = exp ? __uint_as_float(((exp + 120u) << 23) | (man << 20)) : (float)man * 0.001953125f;
    return __uint_as_float(__float_as_uint(mag) | sign);
}

/// \brief One block per (slot, head, row): the missed block's `c*D` fp8 codes times its `c` bf16 scales
/// (one per vector, read once into shared memory), rounded to `T`. Same arithmetic as
/// `Fp8Codec.decode`: fp32 product of the exact code and scale, then one rounding.
///
/// \param values        [B, Hkv, K, c, D] T, out (written where `miss`)
/// \param host          pinned fp8 codes [rows, Hkv, C, c, D]; block (r, h, ch) at r*row_stride +
///                      h*head_stride + ch*c*D bytes
/// \param scales        pinned bf16 scales [rows, Hkv, C, c]; block (r, h, ch) at r*scale_row_stride +
///                      h*scale_head_stride + ch*c*2 bytes
/// \param vec16         1 when D % 16 == 0 and the code block and output addresses are 16-byte aligned
/// Launch: grid (K, Hkv, B), block 128 threads, dynamic shared memory c*4 bytes.
template <typename T>
__device__ __forceinline__ void gather_values_fp8(T* values, const long long* ids, const bool* miss,
                                                  const unsigned char* host, const long long* row_map,
                                                  long long row_stride, long long head_stride, int Hkv, int K,
                                                  const unsigned char* scales, long long scale_row_stride,
                                                  long long scale_head_stride, int c, int D, int vec16) {
    extern __shared__ float scale[];  // [c]
    const int slot = blockIdx.x, head = blockIdx.y, row = blockIdx.z;
    const size_t sh = ((size_t)row * Hkv + head) * K + slot;
    if (!miss[sh]) return;
    const long long stored = row_map[row], chunk = ids[sh];
    const unsigned char* src = host + stored * row_stride + head * head_stride + chunk * (long long)c * D;
    const bf16* sc = reinterpret_cast<const bf16*>(scales + stored * scale_row_stride + head * scale_head_stride +
                                                   chunk * (long long)c * 2);
    for (int i = threadIdx.x; i < c; i += blockDim.x) scale[i] = to_f32(sc[i]);
    __syncthreads();
    T* dst = values + sh * (size_t)c * D;
    const int n = c * D;
    if (vec16) {
        constexpr int PER_STORE = 16 / sizeof(T);  // outputs per 16-byte store
        for (int g = threadIdx.x; g < (n >> 4); g += blockDim.x) {
            const uint4 word = reinterpret_cast<const uint4*>(src)[g];
            const unsigned int parts[4] = {word.x, word.y, word.z, word.w};
            const float s = scale[(g << 4) / D];
            __align__(16) T out[16];
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const unsigned int code = (parts[j >> 2] >> ((j & 3) * 8)) & 0xFFu;  // little-endian bytes
                out[j] = from_f32<T>(fp8_e4m3_to_f32(code) * s);
            }
            uint4* d = reinterpret_cast<uint4*>(dst + (g << 4));
#pragma unroll
            for (int j = 0; j < 16 / PER_STORE; ++j) d[j] = reinterpret_cast<const uint4*>(out)[j];
        }
    } else {
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            dst[i] = from_f32<T>(fp8_e4m3_to_f32(src[i]) * scale[i / D]);
        }
    }
}

#define GATHER_FP8(NAME, T)                                                                                        \
    extern "C" __global__ void __launch_bounds__(128)                                                             \
        NAME(T* values, const long long* ids, const bool* miss, const unsigned char* host, const long long* row_map, \
             long long row_stride, long long head_stride, int Hkv, int K, const unsigned char* scales,             \
             long long scale_row_stride, long long scale_head_stride, int c, int D, int vec16) {                   \
        gather_values_fp8<T>(values, ids, miss, host, row_map, row_stride, head_stride, Hkv, K, scales,            \
                             scale_row_stride, scale_head_stride, c, D, vec16);                                    \
    }
GATHER_FP8(gather_values_fp8_bf16, bf16)
GATHER_FP8(gather_values_fp8_f16, f16)
GATHER_FP8(gather_values_fp8_f32, float)

/// \brief One block per (slot, head, row): the missed block's `c` HIGGS vectors (`D/2` uint8 codes each, one
/// per pair of rotated coordinates, and an fp16 norm) decoded into `T`. Same arithmetic as
/// `Higgs4Codec.decode` (`HiggsQuantizer.dequantize`) up to the order of the sums: grid points, the inverse
/// rotation as a fast Walsh-Hadamard transform in shared memory (unnormalised butterflies, natural order), then
/// times `norm / D` (the two 1/sqrt(D) factors: the grid's unit scale and the orthonormal Hadamard) and the
/// sign of each coordinate.
///
/// \param host          pinned uint8 codes [rows, Hkv, C, c, D/2]; block (r, h, ch) at r*row_stride +
///                      h*head_stride + ch*c*D/2 bytes
/// \param scales        pinned fp16 norms [rows, Hkv, C, c]; block (r, h, ch) at r*scale_row_stride +
///                      h*scale_head_stride + ch*c*2 bytes
/// \param grid          [256, 2] float32 on the device: the grid points
/// \param signs         [D] float32 on the device: the rotation's sign flips (+-1)
/// \param vec16         1 when the code block addresses are 16-byte aligned and D/2 % 16 == 0
/// Launch: grid (K, Hkv, B), block 128 threads, dynamic shared memory (c*D + c)*4 bytes; D a power of two.
template <typename T>
__device__ __forceinline__ void gather_values_higgs4(T* values, const long long* ids, const bool* miss,
                                                     const unsigned char* host, const long long* row_map,
                                                     long long row_stride, long long head_stride, int Hkv, int K,
                                                     const unsigned char* scales, long long scale_row_stride,
                                                     long long scale_head_stride, int c, int D, int vec16,
                                                     const float* grid, const float* signs) {
    extern __shared__ float smem[];  // [c*D] coordinates, then [c] norms
    float* norm = smem + c * D;
    const int slot = blockIdx.x, head = blockIdx.y, row = blockIdx.z;
    const size_t sh = ((size_t)row * Hkv + head) * K + slot;
    if (!miss[sh]) return;
    const long long stored = row_map[row], chunk = ids[sh];
    const int codes_per_chunk = c * (D >> 1);
    const unsigned char* src = host + stored * row_stride + head * head_stride + chunk * (long long)codes_per_chunk;
    const f16* sc = reinterpret_cast<const f16*>(scales + stored * scale_row_stride + head * scale_head_stride +
                                                  chunk * (long long)c * 2);
    for (int i = threadIdx.x; i < c; i += blockDim.x) norm[i] = to_f32(sc[i]);
    const float2* points = reinterpret_cast<const float2*>(grid);
    if (vec16) {  // 16 codes per 16-byte load over PCIe
        for (int g = threadIdx.x; g < (codes_per_chunk >> 4); g += blockDim.x) {
            const uint4 word = reinterpret_cast<const uint4*>(src)[g];
            const unsigned int parts[4] = {word.x, word.y, word.z, word.w};
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const float2 p = points[(parts[j >> 2] >> ((j & 3) * 8)) & 0xFFu];
                smem[2 * ((g << 4) + j)] = p.x;
                smem[2 * ((g << 4) + j) + 1] = p.y;
            }
        }
    } else {
        for (int i = threadIdx.x; i < codes_per_chunk; i += blockDim.x) {
            const float2 p = points[src[i]];
            smem[2 * i] = p.x;
            smem[2 * i + 1] = p.y;
        }
    }
    __syncthreads();
    // Walsh-Hadamard transform of each of the c vectors: pairs (i, i + h) within blocks of 2h.
    const int pairs = c * (D >> 1);
    for (int h = 1; h < D; h <<= 1) {
        for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
            const int vec = p / (D >> 1), q = p % (D >> 1);
            const int i = vec * D + (q / h) * 2 * h + (q % h);
            const float a = smem[i], b = smem[i + h];
            smem[i] = a + b;
            smem[i + h] = a - b;
        }
        __syncthreads();
    }
    T* dst = values + sh * (size_t)c * D;
    for (int i = threadIdx.x; i < c * D; i += blockDim.x) {
        const int d = i % D;
        dst[i] = from_f32<T>(smem[i] * (norm[i / D] / (float)D) * signs[d]);
    }
}

#define GATHER_HIGGS4(NAME, T)                                                                                     \
    extern "C" __global__ void __launch_bounds__(128)                                                             \
        NAME(T* values, const long long* ids, const bool* miss, const unsigned char* host, const long long* row_map, \
             long long row_stride, long long head_stride, int Hkv, int K, const unsigned char* scales,             \
             long long scale_row_stride, long long scale_head_stride, int c, int D, int vec16, const float* grid,  \
             const float* signs) {                                                                                 \
        gather_values_higgs4<T>(values, ids, miss, host, row_map, row_stride, head_stride, Hkv, K, scales,         \
                                scale_row_stride, scale_head_stride, c, D, vec16, grid, signs);                    \
    }
GATHER_HIGGS4(gather_values_higgs4_bf16, bf16)
GATHER_HIGGS4(gather_values_higgs4_f16, f16)
GATHER_HIGGS4(gather_values_higgs4_f32, float)
