// Shared device helpers of cuda_src/dense.cu, safety.cu and replay.cu.
//
// No __global__ functions here: kernels live in the .cu files under their reference names.
// Every helper is `static __device__ __forceinline__` (or a template), so each translation unit
// gets its own copy and nothing clashes when several files include this header.
#pragma once

// A full warp takes part in every shuffle below.
#define HA_FULL_MASK 0xffffffffu
#define HA_WARP_SIZE 32
#define HA_MAX_WARPS 32  // 1024 threads: the largest block

// IEEE binary32 exponent field: all ones means Inf or NaN.
#define HA_F32_EXP_MASK 0x7f800000u

// True for every finite float (subnormals and signed zeros included); false for NaN and +/-Inf.
// A bit test, so no compiler option can fold it away.
static __device__ __forceinline__ bool ha_is_finite(float x) {
    return (__float_as_uint(x) & HA_F32_EXP_MASK) != HA_F32_EXP_MASK;
}

// Sums of fewer than 2^31 float32 terms, all of magnitude below 2^90, cannot overflow in any
// association these kernels use: the sum of magnitudes stays below 2^121, and each rounding errs
// by at most the smaller operand (and by a factor 1 + 2^-24), so no partial sum gets near 2^128.
// The reductions that must reproduce the reference's sequential non-finite map exactly
// (prefix_sum, bias_grad_reduce) take their parallel path only for such "regular" terms and redo
// the sum sequentially, in the reference's order, otherwise: a slow path for poisoned data only
// (a parallel association can overflow where the sequential sum does not, e.g. FLT_MAX + FLT_MAX
// after a -Inf, giving NaN instead of -Inf).
#define HA_SUM_SAFE_MAGNITUDE 0x1p90f

// Finite and small enough that no partial sum can overflow (see HA_SUM_SAFE_MAGNITUDE).
static __device__ __forceinline__ bool ha_is_regular_term(float x) {
    return ha_is_finite(x) && fabsf(x) < HA_SUM_SAFE_MAGNITUDE;
}

// The quiet NaN used as the identity of an fminf/fmaxf reduction that must return NaN only
// when every element is NaN (fminf(NaN, x) = x).
static __device__ __forceinline__ float ha_nan() { return __uint_as_float(0x7fffffffu); }

struct HaFmin {
    __device__ __forceinline__ float operator()(float a, float b) const { return fminf(a, b); }
};
struct HaFmax {
    __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// Tree reduction of one value per lane; lane 0 gets the result (fixed shape: deterministic).
template <class Op>
static __device__ __forceinline__ float ha_warp_reduce(float v, Op op) {
    for (int offset = HA_WARP_SIZE / 2; offset > 0; offset >>= 1) {
        v = op(v, __shfl_down_sync(HA_FULL_MASK, v, offset));
    }
    return v;
}

// Block-wide reduction of one value per thread; every thread gets the result. blockDim.x must
// be a multiple of 32 (at most 1024); `identity` fills the lanes of the second stage that have
// no warp. Two __syncthreads: safe to call repeatedly in a loop.
template <class Op>
static __device__ __forceinline__ float ha_block_reduce(float v, Op op, float identity) {
    __shared__ float warp_values[HA_MAX_WARPS];
    __shared__ float result;
    const int lane = threadIdx.x % HA_WARP_SIZE;
    const int warp = threadIdx.x / HA_WARP_SIZE;
    const int n_warps = blockDim.x / HA_WARP_SIZE;
    v = ha_warp_reduce(v, op);
    if (lane == 0) {
        warp_values[warp] = v;
    }
    __syncthreads();
    if (warp == 0) {
        v = ha_warp_reduce(lane < n_warps ? warp_values[lane] : identity, op);
        if (lane == 0) {
            result = v;
        }
    }
    __syncthreads();
    return result;
}
