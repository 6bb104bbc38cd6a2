// Counter-based random numbers: Philox4x32-10 (Random123's constants), the twin of
// foxhunt.reference.kernels.rng, bit for bit. Device helpers only (no kernels): any .cu file
// that draws random numbers includes this header; cuda_src/rng.cu holds the conformance kernel.
//
// The word packing is written once, in reference/kernels/rng.py, and mirrored here:
//   ctr = [index, stream, offset_lo, offset_hi], key = [key_lo, key_hi] (the run's seed)
//   rng_uniform(key_lo, key_hi, stream, offset, index) = rng_u32_to_uniform(philox(ctr, key).x)
// Integer arithmetic (uint32, wrapping) and one exact int -> float conversion: no rounding, so
// no compiler option can change a bit.
#pragma once

#define RNG_PHILOX_M0 0xD2511F53u
#define RNG_PHILOX_M1 0xCD9E8D57u
#define RNG_PHILOX_W0 0x9E3779B9u
#define RNG_PHILOX_W1 0xBB67AE85u
#define RNG_PHILOX_ROUNDS 10
// u32_to_uniform: k = u >> 9 (23 bits), draw = (2k + 1) * 2^-24, exact in float32, in (0, 1).
#define RNG_UNIFORM_SHIFT 9
#define RNG_UNIFORM_SCALE 0x1p-24f

// One Philox4x32 round: hi/lo of M0 * c0 and M1 * c2, then the Feistel-like permutation.
static __device__ __forceinline__ uint4 rng_philox_round(uint4 c, uint2 k) {
    const unsigned int hi0 = __umulhi(RNG_PHILOX_M0, c.x);
    const unsigned int lo0 = RNG_PHILOX_M0 * c.x;
    const unsigned int hi1 = __umulhi(RNG_PHILOX_M1, c.z);
    const unsigned int lo1 = RNG_PHILOX_M1 * c.z;
    return make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
}

// Philox4x32-10: the first round with the key as given, each later one after a Weyl bump.
static __device__ __forceinline__ uint4 rng_philox4x32(uint4 ctr, uint2 key) {
    ctr = rng_philox_round(ctr, key);
#pragma unroll
    for (int r = 1; r < RNG_PHILOX_ROUNDS; ++r) {
        key.x += RNG_PHILOX_W0;
        key.y += RNG_PHILOX_W1;
        ctr = rng_philox_round(ctr, key);
    }
    return ctr;
}

// rng.u32_to_uniform: ((u >> 9) + 0.5) * 2^-23 as float32(2 (u >> 9) + 1) * 2^-24 (both exact).
static __device__ __forceinline__ float rng_u32_to_uniform(unsigned int u) {
    const unsigned int odd = ((u >> RNG_UNIFORM_SHIFT) << 1) | 1u;
    return __fmul_rn(__uint2float_rn(odd), RNG_UNIFORM_SCALE);
}

// rng.uniform(key, stream, offset, index) with key = key_hi << 32 | key_lo.
static __device__ __forceinline__ float rng_uniform(unsigned int key_lo, unsigned int key_hi,
                                                    unsigned int stream,
                                                    unsigned long long offset,
                                                    unsigned int index) {
    const uint4 ctr = make_uint4(index, stream, (unsigned int)(offset & 0xffffffffull),
                                 (unsigned int)(offset >> 32));
    return rng_u32_to_uniform(rng_philox4x32(ctr, make_uint2(key_lo, key_hi)).x);
}
