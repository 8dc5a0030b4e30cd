// Zero-copy gather of missed value chunks (ShadowKV §3.3): each block reads one (row, head, chunk) block of
// the pinned host value store through its device-visible address (unified addressing) and writes it into
// the slot of the per-head value buffer. Twin: shadowkv_cache/ops/gather_values.py (the definition).
//
// Legend: B batch, Hkv KV heads, K slots, c chunk size, D head dim, C stored chunks.

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
