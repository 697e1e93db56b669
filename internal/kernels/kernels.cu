// Kernels used by cuvmm to fill, verify and read memory. Compiled to PTX (kernels.ptx, embedded in the
// Go package) with `make ptx` where nvcc exists; the simulated driver implements the same functions in
// Go (driver/sim/kernels.go). Every parameter is 64-bit so the Go side can pass them uniformly.
//
// The pattern: the 64-bit word with global index w (byte offset 8*w from the start of the buffer the
// caller describes) holds pattern(w, seed) = ((w + 1) * 0x9E3779B97F4A7C15) ^ seed. The multiplier is
// odd, so distinct words get distinct values and zeroed memory never matches.

typedef unsigned long long u64;

__device__ __forceinline__ u64 cuvmm_pattern(u64 w, u64 seed) {
    return ((w + 1ull) * 0x9E3779B97F4A7C15ull) ^ seed;
}

// Writes pattern(first_word + i, seed) into words [0, nwords) of ptr.
extern "C" __global__ void cuvmm_fill(u64 ptr, u64 nwords, u64 first_word, u64 seed) {
    u64 *p = (u64 *)ptr;
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < nwords; i += stride) {
        p[i] = cuvmm_pattern(first_word + i, seed);
    }
}

// Counts the words of ptr that differ from the pattern and adds the count to *counter (a u64 in
// device memory).
extern "C" __global__ void cuvmm_verify(u64 ptr, u64 nwords, u64 first_word, u64 seed, u64 counter) {
    const u64 *p = (const u64 *)ptr;
    u64 stride = (u64)gridDim.x * blockDim.x;
    unsigned int bad = 0;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < nwords; i += stride) {
        if (p[i] != cuvmm_pattern(first_word + i, seed)) bad++;
    }
    // One atomic per warp that saw a mismatch.
    for (int off = 16; off > 0; off /= 2) bad += __shfl_down_sync(0xffffffffu, bad, off);
    if ((threadIdx.x & 31) == 0 && bad != 0) atomicAdd((u64 *)counter, (u64)bad);
}

// Reads nwords 64-bit words (nwords even, ptr 16-byte aligned) with 16-byte loads and folds them, so
// the loads cannot be removed; the fold is written to *sink only in the impossible case that it equals
// a marker. Used to measure read bandwidth.
extern "C" __global__ void cuvmm_read(u64 ptr, u64 nwords, u64 sink) {
    const ulonglong2 *p = (const ulonglong2 *)ptr;
    u64 n = nwords / 2;
    u64 stride = (u64)gridDim.x * blockDim.x;
    u64 acc = 0;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        ulonglong2 a = __ldcs(p + i), b = __ldcs(p + i + stride), c = __ldcs(p + i + 2 * stride), d = __ldcs(p + i + 3 * stride);
        acc ^= a.x ^ a.y ^ b.x ^ b.y ^ c.x ^ c.y ^ d.x ^ d.y;
    }
    for (; i < n; i += stride) {
        ulonglong2 a = __ldcs(p + i);
        acc ^= a.x ^ a.y;
    }
    if (acc == 0x0123456789abcdefull) *(u64 *)sink = acc;
}
