// The vector paths of the flat (elementwise, grid-stride) kernels, written once: the 32-bit loop
// bounds, the thread's first index and the grid's stride, the tail of n % 4 elements, and pointer
// alignment (dense.cu, step.cu, iqn.cu, optim.cu's Polyak update and saxpy, safety.cu's
// clamp_finite and nan_check).
//
// A flat kernel's vector path: thread t takes the 4-element groups t, t + T, ... (T threads in
// the grid; float4 accesses) and the n % 4 elements past the last group one per thread
// (fh_flat_tail, strided like the groups, so any grid covers them). It is valid where
// fh_flat_narrow(n) holds: 0 <= n < 2^31 and at most 2^21 blocks of at most 1024 threads, so an
// index plus the stride stays below 2^32. Every test reads kernel arguments and the launch shape
// only: grid-uniform, so the paths never diverge within a block.
#pragma once

static __device__ __forceinline__ bool fh_flat_narrow(long long n) {
    return (unsigned long long)n <= 0x7fffffffull && gridDim.x <= (1u << 21);
}
static __device__ __forceinline__ unsigned int fh_flat_first() {
    return blockIdx.x * blockDim.x + threadIdx.x;
}
static __device__ __forceinline__ unsigned int fh_flat_stride() { return gridDim.x * blockDim.x; }
// This thread's first tail element (>= n: none).
static __device__ __forceinline__ unsigned int fh_flat_tail(unsigned int n, unsigned int first) {
    return (n & ~3u) + first;
}
// Whether p is a multiple of `bytes` (a power of two): 16 for a float4, 8 for 4 BF16 patterns;
// null counts as aligned.
static __device__ __forceinline__ bool fh_aligned(const void* p, unsigned int bytes) {
    return (reinterpret_cast<unsigned long long>(p) & (unsigned long long)(bytes - 1u)) == 0ull;
}
