// The conformance kernel of the counter-based generator (cuda_src/rng.cuh), twin of
// foxhunt.reference.kernels.rng.philox_uniform: the kernels that draw (iqn_tau_cos, and issue
// 20's exploration and replay sampling) call rng_uniform inline; this one writes a stream's
// draws to memory so that the arithmetic is compared with the reference bit for bit.

#include "rng.cuh"

// out[i] = rng_uniform(key, stream, offset, i) for i < n; key = key_hi:key_lo,
// offset = offset_hi:offset_lo. Flat grid-stride.
extern "C" __global__ void philox_uniform(float* __restrict__ out, int n, unsigned int key_lo,
                                          unsigned int key_hi, unsigned int stream,
                                          unsigned int offset_lo, unsigned int offset_hi) {
    const unsigned long long offset = ((unsigned long long)offset_hi << 32) | offset_lo;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        out[i] = rng_uniform(key_lo, key_hi, stream, offset, (unsigned int)i);
    }
}
