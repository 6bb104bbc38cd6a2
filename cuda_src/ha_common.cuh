// Shared device helpers of cuda_src/dense.cu, safety.cu, replay.cu, optim.cu, step.cu and trunk.cu.
//
// No __global__ functions here: kernels live in the .cu files under their reference names.
// Every helper is `static __device__ __forceinline__` (or a template), so each translation unit
// gets its own copy and nothing clashes when several files include this header.
#pragma once

// A full warp takes part in every shuffle below.
#define HA_FULL_MASK 0xffffffffu
#define HA_WARP_SIZE 32

// IEEE binary32 exponent field: all ones means Inf or NaN.
#define HA_F32_EXP_MASK 0x7f800000u

// True for every finite float (subnormals and signed zeros included); false for NaN and +/-Inf.
// A bit test, so no compiler option can fold it away.
static __device__ __forceinline__ bool ha_is_finite(float x) {
    return (__float_as_uint(x) & HA_F32_EXP_MASK) != HA_F32_EXP_MASK;
}

// np.clip's select order: NaN propagates (every comparison is false), -0.0 stays -0.0, and a
// bound of +Inf leaves every value unchanged.
static __device__ __forceinline__ float ha_clip_symmetric(float x, float bound) {
    return (x > bound) ? bound : ((x < -bound) ? -bound : x);
}

// safety.cu's clamp_finite element: isfinite(v) ? clip(v, -m, m) : 0 (NaN and +/-Inf become +0.0).
static __device__ __forceinline__ float ha_clamp_finite(float v, float m) {
    return ha_is_finite(v) ? ha_clip_symmetric(v, m) : 0.0f;
}

// The backward through Mech 10's clamp and the trunk ReLU of one element of d h2 (step.cu's
// h2_grad_sum_mask family, trunk.cu's heads_dh2_tf32): the clamp passed the value through
// unchanged (h2 == pre) and the ReLU's pre-clamp activation is not <= 0; a NaN pre gives 0.
static __device__ __forceinline__ float ha_h2_mask(float sum, float h2, float pre) {
    const float passed = (h2 == pre) ? sum : 0.0f;
    return (pre <= 0.0f) ? 0.0f : passed;
}

// Guarded SAXPY element (optim.cu's saxpy and the budget kernels, step.cu's
// h2_grad_sum_aux_mask): y + a * x if x is finite, else y (product rounded, then the sum).
static __device__ __forceinline__ float ha_guarded_axpy(float y, float x, float a) {
    return isfinite(x) ? __fadd_rn(y, __fmul_rn(a, x)) : y;
}

// Whether x fires a sentinel slot's test (nan_check_fused; polyak_update_mirror_check in
// optim.cu): non-finite, or |x| >= threshold with the magnitude test on.
static __device__ __forceinline__ bool nan_check_fires(float x, bool magnitude_test,
                                                       float threshold) {
    return !ha_is_finite(x) || (magnitude_test && fabsf(x) >= threshold);
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
