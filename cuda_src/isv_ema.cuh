// The ISV bus's EMA rules (SPEC 7), shared by the producer kernels of cuda_src/isv.cu and
// cuda_src/aux.cu. Twins of foxhunt.reference.kernels.isv._ema and
// foxhunt.reference.isv.adaptive_ema_rate. No __global__ functions here.
#pragma once

// The guarded float32 EMA of the reference (_ema): new = (1 - alpha) * old + alpha * x, each
// product and the sum rounded; a non-finite x keeps old, a non-finite old takes x, an
// overflowing blend keeps old.
static __device__ __forceinline__ float hb_guarded_ema(float old, float x, float alpha) {
    const float keep = __fsub_rn(1.0f, alpha);
    const float blended = __fadd_rn(__fmul_rn(keep, old), __fmul_rn(alpha, x));
    if (!isfinite(x)) {
        return old;
    }
    if (!isfinite(old)) {
        return x;
    }
    return isfinite(blended) ? blended : old;
}

// The adaptive rate alpha = alpha_base * (1 + gain * |clamp(sharpe, -clamp, clamp)|), a NaN
// Sharpe counted as 0 (isv.adaptive_ema_rate; a bare fminf(fmaxf(NaN, -c), c) would give -c).
static __device__ __forceinline__ float hb_adaptive_rate(float sharpe, float alpha_base,
                                                         float sharpe_clamp, float sharpe_gain) {
    const float s = isnan(sharpe) ? 0.0f : sharpe;
    const float clamped = fminf(fmaxf(s, -sharpe_clamp), sharpe_clamp);
    const float gain = __fadd_rn(1.0f, __fmul_rn(sharpe_gain, fabsf(clamped)));
    return __fmul_rn(alpha_base, gain);
}
