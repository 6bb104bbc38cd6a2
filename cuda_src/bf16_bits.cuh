// BF16 rounding on the bit pattern, and the packing of 2 or 4 patterns for one store, shared by
// every kernel that writes BF16 (dense.cu's casts, step.cu's clamp, iqn.cu, optim.cu's Polyak
// update + BF16 mirror, trunk.cu, walk.cu). Reference: foxhunt.reference.kernels.dense
// .f32_to_bf16 (the formula and the NaN rule are spelled out there).
#pragma once

#define BF16_F32_SIGN_CLEAR 0x7fffffffu
#define BF16_F32_EXP_MASK 0x7f800000u
// BF16 = the high 16 bits of a binary32; RNE adds 0x7FFF plus the lowest kept bit.
#define BF16_SHIFT 16
#define BF16_HALF_ULP_MINUS_ONE 0x7fffu
#define BF16_QUIET_BIT 0x0040u

// BF16 round-to-nearest-even on the bit pattern, with the reference's NaN rule: a NaN keeps its
// sign and high payload and gets the quiet bit (NOT __float2bfloat16_rn's canonical NaN).
static __device__ __forceinline__ unsigned short f32_to_bf16_bits(float x) {
    const unsigned int u = __float_as_uint(x);
    if ((u & BF16_F32_SIGN_CLEAR) > BF16_F32_EXP_MASK) {
        return (unsigned short)((u >> BF16_SHIFT) | BF16_QUIET_BIT);
    }
    // No uint32 wrap for non-NaN patterns: the largest, -Inf 0xFF800000, stays below 2^32.
    const unsigned int lowest_kept_bit = (u >> BF16_SHIFT) & 1u;
    const unsigned int rounded = u + BF16_HALF_ULP_MINUS_ONE + lowest_kept_bit;
    return (unsigned short)(rounded >> BF16_SHIFT);
}

// Two BF16 patterns in one little-endian word (lo at the lower address), and four in two words
// (v.x at the lowest): one 4- or 8-byte store of consecutive BF16 elements.
static __device__ __forceinline__ unsigned int bf16_pair_bits(float lo, float hi) {
    return (unsigned int)f32_to_bf16_bits(lo) | ((unsigned int)f32_to_bf16_bits(hi) << BF16_SHIFT);
}
static __device__ __forceinline__ uint2 bf16_quad_bits(float4 v) {
    return make_uint2(bf16_pair_bits(v.x, v.y), bf16_pair_bits(v.z, v.w));
}
