// Zero-copy gather of missed value chunks (ShadowKV §3.3): each block reads one (row, head, chunk) block of
// the pinned host value store through its device-visible address (unified addressing) and writes it into
// the slot of the per-head value buffer. Twin: shadowkv_cache/ops/gather_values.py (the definition).
//
// Legend: B batch, Hkv KV heads, K slots, c chunk size, D head dim, C stored chunks.
#include "common.cuh"

/// \brief Blocks stride over the slots (`total` = B*Hkv*K of them, in [B, Hkv, K] order); slots that hit are
/// skipped. The grid is kept small (a share of the SMs, ops/gather_values.py) so that the fetch, bound by PCIe,
/// runs beside the key rebuild on the other SMs instead of queueing every slot's block ahead of it.
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
/// \param total         B*Hkv*K
/// Launch: grid (any, 1, 1), block 128 threads.
extern "C" __global__ void __launch_bounds__(128)
    gather_values(unsigned char* values, const long long* ids, const bool* miss, const unsigned char* host,
                  const long long* row_map, long long row_stride, long long head_stride, int Hkv, int K,
                  int chunk_bytes, int vec16, long long total) {
    for (long long sh = blockIdx.x; sh < total; sh += gridDim.x) {
        if (!miss[sh]) continue;
        const long long row = sh / ((long long)Hkv * K);
        const int head = (int)((sh / K) % Hkv);
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

/// \brief Blocks stride over the slots as `gather_values` does: each missed block's `c*D` fp8 codes times its
/// `c` bf16 scales (one per vector, read once into shared memory), rounded to `T`. Same arithmetic as
/// `Fp8Codec.decode`: fp32 product of the exact code and scale, then one rounding.
///
/// \param values        [B, Hkv, K, c, D] T, out (written where `miss`)
/// \param host          pinned fp8 codes [rows, Hkv, C, c, D]; block (r, h, ch) at r*row_stride +
///                      h*head_stride + ch*c*D bytes
/// \param scales        pinned bf16 scales [rows, Hkv, C, c]; block (r, h, ch) at r*scale_row_stride +
///                      h*scale_head_stride + ch*c*2 bytes
/// \param vec16         1 when D % 16 == 0 and the code block and output addresses are 16-byte aligned
/// \param total         B*Hkv*K
/// Launch: grid (any, 1, 1), block 128 threads, dynamic shared memory c*4 bytes.
template <typename T>
__device__ __forceinline__ void gather_values_fp8(T* values, const long long* ids, const bool* miss,
                                                  const unsigned char* host, const long long* row_map,
                                                  long long row_stride, long long head_stride, int Hkv, int K,
                                                  const unsigned char* scales, long long scale_row_stride,
                                                  long long scale_head_stride, int c, int D, int vec16,
                                                  long long total) {
    extern __shared__ float scale[];  // [c]
    for (long long sh = blockIdx.x; sh < total; sh += gridDim.x) {
        if (!miss[sh]) continue;  // the same for the whole block, so the barriers below are reached by all
        const long long row = sh / ((long long)Hkv * K);
        const int head = (int)((sh / K) % Hkv);
        const long long stored = row_map[row], chunk = ids[sh];
        const unsigned char* src = host + stored * row_stride + head * head_stride + chunk * (long long)c * D;
        const bf16* sc = reinterpret_cast<const bf16*>(scales + stored * scale_row_stride +
                                                       head * scale_head_stride + chunk * (long long)c * 2);
        __syncthreads();  // the previous slot's readers of `scale` are done
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
}

#define GATHER_FP8(NAME, T)                                                                                        \
    extern "C" __global__ void __launch_bounds__(128)                                                             \
        NAME(T* values, const long long* ids, const bool* miss, const unsigned char* host, const long long* row_map, \
             long long row_stride, long long head_stride, int Hkv, int K, const unsigned char* scales,             \
             long long scale_row_stride, long long scale_head_stride, int c, int D, int vec16, long long total) {  \
        gather_values_fp8<T>(values, ids, miss, host, row_map, row_stride, head_stride, Hkv, K, scales,            \
                             scale_row_stride, scale_head_stride, c, D, vec16, total);                             \
    }
GATHER_FP8(gather_values_fp8_bf16, bf16)
GATHER_FP8(gather_values_fp8_f16, f16)
GATHER_FP8(gather_values_fp8_f32, float)

/// \brief Blocks stride over the slots as `gather_values` does: each missed block's `c` HIGGS vectors (`D/2`
/// uint8 codes each, one per pair of rotated coordinates, and an fp16 norm) decoded into `T`. Same arithmetic as
/// `Higgs4Codec.decode` (`HiggsQuantizer.dequantize`) up to the order of the sums: grid points, the inverse
/// rotation as a fast Walsh-Hadamard transform in shared memory (unnormalised butterflies, natural order), then
/// times `norm / D` (the two 1/sqrt(D) factors: the grid's unit scale and the orthonormal Hadamard) and the
/// sign of each coordinate. The general form; `gather_values_higgs4_warp` serves the usual head sizes.
///
/// \param host          pinned uint8 codes [rows, Hkv, C, c, D/2]; block (r, h, ch) at r*row_stride +
///                      h*head_stride + ch*c*D/2 bytes
/// \param scales        pinned fp16 norms [rows, Hkv, C, c]; block (r, h, ch) at r*scale_row_stride +
///                      h*scale_head_stride + ch*c*2 bytes
/// \param grid          [256, 2] float32 on the device: the grid points
/// \param signs         [D] float32 on the device: the rotation's sign flips (+-1)
/// \param vec16         1 when the code block addresses and the code bytes of a chunk (c*D/2) are multiples of 16
/// \param total         B*Hkv*K
/// Launch: grid (any, 1, 1), block 128 threads, dynamic shared memory (c*D + c)*4 bytes; D a power of two.
template <typename T>
__device__ __forceinline__ void gather_values_higgs4(T* values, const long long* ids, const bool* miss,
                                                     const unsigned char* host, const long long* row_map,
                                                     long long row_stride, long long head_stride, int Hkv, int K,
                                                     const unsigned char* scales, long long scale_row_stride,
                                                     long long scale_head_stride, int c, int D, int vec16,
                                                     const float* grid, const float* signs, long long total) {
    extern __shared__ float smem[];  // [c*D] coordinates, then [c] norms
    float* norm = smem + c * D;
    const float2* points = reinterpret_cast<const float2*>(grid);
    const int codes_per_chunk = c * (D >> 1);
    for (long long sh = blockIdx.x; sh < total; sh += gridDim.x) {
        if (!miss[sh]) continue;  // the same for the whole block, so the barriers below are reached by all
        const long long row = sh / ((long long)Hkv * K);
        const int head = (int)((sh / K) % Hkv);
        const long long stored = row_map[row], chunk = ids[sh];
        const unsigned char* src =
            host + stored * row_stride + head * head_stride + chunk * (long long)codes_per_chunk;
        const f16* sc = reinterpret_cast<const f16*>(scales + stored * scale_row_stride + head * scale_head_stride +
                                                      chunk * (long long)c * 2);
        __syncthreads();  // the previous slot's readers of `smem` are done
        for (int i = threadIdx.x; i < c; i += blockDim.x) norm[i] = to_f32(sc[i]);
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
}

#define GATHER_HIGGS4(NAME, T)                                                                                     \
    extern "C" __global__ void __launch_bounds__(128)                                                             \
        NAME(T* values, const long long* ids, const bool* miss, const unsigned char* host, const long long* row_map, \
             long long row_stride, long long head_stride, int Hkv, int K, const unsigned char* scales,             \
             long long scale_row_stride, long long scale_head_stride, int c, int D, int vec16, const float* grid,  \
             const float* signs, long long total) {                                                                \
        gather_values_higgs4<T>(values, ids, miss, host, row_map, row_stride, head_stride, Hkv, K, scales,         \
                                scale_row_stride, scale_head_stride, c, D, vec16, grid, signs, total);             \
    }
GATHER_HIGGS4(gather_values_higgs4_bf16, bf16)
GATHER_HIGGS4(gather_values_higgs4_f16, f16)
GATHER_HIGGS4(gather_values_higgs4_f32, float)

// ---- higgs4, one warp per slot -------------------------------------------------------------------------------
//
// A lane owns 16 codes (one 16-byte load): 32 consecutive coordinates of one vector, so the first five
// butterfly stages (distances 1..16) stay in its registers and the rest (32..D/2) pair lanes by shuffles
// (`warp_hadamard`, common.cuh). No shared memory, no barriers; each warp loads its next missed slot before
// decoding the current one, so that two PCIe reads per warp are in flight.
//
// The scan for a warp's next missed slot reads one flag at a time. Reading 32 flags at once (a ballot) made the fetch
// slower where it matters: 671 against 712.6 tok/s at 128K, batch 44, with 90 GiB of per-row host values on an H200
// machine (docs/results.md, "Landmark scores at any batch"). The reads are bound on the host side, and issuing them
// sooner only queued more of them.

constexpr int HIGGS_WARP_LOADS = 2;  // 16-byte loads per lane and slot at most: c*D/32 <= 64

struct HiggsSlot {
    uint4 words[HIGGS_WARP_LOADS];
    float norm[HIGGS_WARP_LOADS];
};

/// \brief Read slot `sh`'s codes and norms (lane's share) from host memory.
__device__ __forceinline__ void higgs_load(HiggsSlot& s, long long sh, const long long* ids, const unsigned char* host,
                                           const long long* row_map, long long row_stride, long long head_stride,
                                           int Hkv, int K, const unsigned char* scales, long long scale_row_stride,
                                           long long scale_head_stride, int c, int D, int lane) {
    const long long row = sh / ((long long)Hkv * K);
    const int head = (int)((sh / K) % Hkv);
    const long long stored = row_map[row], chunk = ids[sh];
    const int loads = (c * D) >> 5, per_vec = D >> 5;  // 16-byte loads per slot and per vector
    const uint4* src = reinterpret_cast<const uint4*>(host + stored * row_stride + head * head_stride +
                                                      chunk * (long long)(c * (D >> 1)));
    const f16* sc = reinterpret_cast<const f16*>(scales + stored * scale_row_stride + head * scale_head_stride +
                                                  chunk * (long long)c * 2);
#pragma unroll
    for (int it = 0; it < HIGGS_WARP_LOADS; ++it) {
        const int g = lane + 32 * it;
        if (g < loads) {
            s.words[it] = src[g];
            s.norm[it] = to_f32(sc[g / per_vec]);
        } else {  // decoded as zeros by lanes without a vector (they still join the shuffles)
            s.words[it] = make_uint4(0u, 0u, 0u, 0u);
            s.norm[it] = 0.f;
        }
    }
}

/// \brief Decode the lane's share of slot `sh` (loaded by `higgs_load`) and write it.
template <typename T>
__device__ __forceinline__ void higgs_decode(const HiggsSlot& s, long long sh, T* values, int c, int D,
                                             const float2* points, unsigned int sign_bits, int lane) {
    const int loads = (c * D) >> 5, per_vec = D >> 5;
#pragma unroll
    for (int it = 0; it < HIGGS_WARP_LOADS; ++it) {
        if (32 * it >= loads) break;  // the same for the whole warp, so every lane reaches the shuffles below
        const int g = lane + 32 * it;
        const bool active = g < loads;
        const unsigned int parts[4] = {s.words[it].x, s.words[it].y, s.words[it].z, s.words[it].w};
        float x[32];
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const float2 p = active ? points[(parts[j >> 2] >> ((j & 3) * 8)) & 0xFFu] : make_float2(0.f, 0.f);
            x[2 * j] = p.x;
            x[2 * j + 1] = p.y;
        }
        // The butterflies of the block kernel, in the same order: a vector spans `per_vec` aligned lanes.
        warp_hadamard<32>(x, per_vec);
        if (!active) continue;
        const float scale = s.norm[it] / (float)D;
        __align__(16) T out[32];
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            const float v = x[i] * scale;
            out[i] = from_f32<T>((sign_bits >> i) & 1u ? -v : v);  // times a sign of +-1, exactly
        }
        // Vector g / per_vec, coordinates 32 * (g % per_vec) onwards.
        uint4* dst = reinterpret_cast<uint4*>(values + sh * (long long)c * D + (long long)(g / per_vec) * D +
                                              32 * (g % per_vec));
#pragma unroll
        for (int j = 0; j < 32 * (int)sizeof(T) / 16; ++j) dst[j] = reinterpret_cast<const uint4*>(out)[j];
    }
}

/// \brief Warps stride over the slots; what `gather_values_higgs4` computes, for D a power of two in [32, 1024]
/// and c*D/32 <= 64, 16-byte aligned code blocks and output slots.
/// Launch: grid (any, 1, 1), block of whole warps (at most 8), no shared memory.
template <typename T>
__device__ __forceinline__ void gather_values_higgs4_warp(T* values, const long long* ids, const bool* miss,
                                                          const unsigned char* host, const long long* row_map,
                                                          long long row_stride, long long head_stride, int Hkv,
                                                          int K, const unsigned char* scales,
                                                          long long scale_row_stride, long long scale_head_stride,
                                                          int c, int D, const float* grid, const float* signs,
                                                          long long total) {
    if (D < 32 || D > 1024 || ((c * D) >> 5) > 32 * HIGGS_WARP_LOADS) return;  // served by the block kernel
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    long long sh = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    // The lane's 32 coordinates are the same in every vector it decodes: 32 * (lane % (D/32)) onwards.
    unsigned int sign_bits = 0;
    const int first = 32 * (lane % (D >> 5));
    for (int i = 0; i < 32; ++i) sign_bits |= (signs[first + i] < 0.f ? 1u : 0u) << i;
    const float2* points = reinterpret_cast<const float2*>(grid);
    while (sh < total && !miss[sh]) sh += warps;
    HiggsSlot cur = {}, next = {};
    if (sh < total) {
        higgs_load(cur, sh, ids, host, row_map, row_stride, head_stride, Hkv, K, scales, scale_row_stride,
                   scale_head_stride, c, D, lane);
    }
    while (sh < total) {
        long long after = sh + warps;
        while (after < total && !miss[after]) after += warps;
        if (after < total) {
            higgs_load(next, after, ids, host, row_map, row_stride, head_stride, Hkv, K, scales, scale_row_stride,
                       scale_head_stride, c, D, lane);
        }
        higgs_decode<T>(cur, sh, values, c, D, points, sign_bits, lane);
        cur = next;
        sh = after;
    }
}

#define GATHER_HIGGS4_WARP(NAME, T)                                                                                \
    extern "C" __global__ void __launch_bounds__(256)                                                             \
        NAME(T* values, const long long* ids, const bool* miss, const unsigned char* host, const long long* row_map, \
             long long row_stride, long long head_stride, int Hkv, int K, const unsigned char* scales,             \
             long long scale_row_stride, long long scale_head_stride, int c, int D, const float* grid,             \
             const float* signs, long long total) {                                                                \
        gather_values_higgs4_warp<T>(values, ids, miss, host, row_map, row_stride, head_stride, Hkv, K, scales,    \
                                     scale_row_stride, scale_head_stride, c, D, grid, signs, total);               \
    }
GATHER_HIGGS4_WARP(gather_values_higgs4_warp_bf16, bf16)
GATHER_HIGGS4_WARP(gather_values_higgs4_warp_f16, f16)
GATHER_HIGGS4_WARP(gather_values_higgs4_warp_f32, float)
