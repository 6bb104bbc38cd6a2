// Adam's and Polyak's per-element arithmetic, shared by optim.cu (adam_update, the Polyak
// kernels) and spectral.cu (adam_spectral_polyak), so the fused kernel gives the bits of the
// kernels it fuses by construction. Contracts: reference.kernels.optim.adam_update and
// polyak_update.
#pragma once

// 1 - beta^t with t rounded to float32 first (the reference's float(t)). The power is taken in
// double and rounded once to float32: the correctly rounded float32 power except in cases of
// probability ~2^-28 (CUDA's pow is within 2 double ulp). See fast/kernels/optim.py on how the
// reference's own float32 power is computed.
__device__ __forceinline__ float hb_bias_correction(float beta, long long step) {
    const float t = __ll2float_rn(step);
    const float power = __double2float_rn(pow((double)beta, (double)t));
    return __fsub_rn(1.0f, power);
}

// One step's Adam scalars: the bias corrections, the device-fed grad scale and weight clamp,
// and the configuration constants.
struct HbAdam {
    float bc1, bc2, scale, clamp;
    float lr, beta1, beta2, keep1, keep2, eps, weight_decay;
};

// One element of AdamW with the per-element guard and the Mech 9 clamp, in the reference's
// order:
//   g = grad * grad_scale;  if !isfinite(g): param, m, v unchanged (returns false)
//   m = beta1*m + (1-beta1)*g;  v = beta2*v + (1-beta2)*(g*g)
//   mhat = m / bc1;  vhat = v / bc2
//   param = param - lr * (mhat / (sqrtf(vhat) + eps) + weight_decay * param)
//   param = isfinite(param) ? clamp(param, -weight_clamp, weight_clamp) : 0
// Returns true with p, m, v updated.
__device__ __forceinline__ bool hb_adam_element(const HbAdam& s, float grad, float& p, float& m,
                                                float& v) {
    const float g = __fmul_rn(grad, s.scale);
    if (!isfinite(g)) {
        return false;  // gradient zeroed: param, m, v keep their bits
    }
    const float m_new = __fadd_rn(__fmul_rn(s.beta1, m), __fmul_rn(s.keep1, g));
    const float v_new = __fadd_rn(__fmul_rn(s.beta2, v), __fmul_rn(s.keep2, __fmul_rn(g, g)));
    const float mhat = __fdiv_rn(m_new, s.bc1);
    const float vhat = __fdiv_rn(v_new, s.bc2);
    const float step_dir = __fdiv_rn(mhat, __fadd_rn(__fsqrt_rn(vhat), s.eps));
    const float update = __fadd_rn(step_dir, __fmul_rn(s.weight_decay, p));
    const float p_new = __fsub_rn(p, __fmul_rn(s.lr, update));
    p = isfinite(p_new) ? fminf(fmaxf(p_new, -s.clamp), s.clamp) : 0.0f;
    m = m_new;
    v = v_new;
    return true;
}

// The per-step Adam scalars, by the calling block: thread 0 computes bc1, the first thread of
// the second warp bc2 (thread 0 too in a one-warp block), in parallel, and thread 0 reads the
// device scalars, into `shared` (4 floats); hb_adam_scalars reads them back after the caller's
// __syncthreads (which the caller may place after its first loads, to overlap them).
__device__ __forceinline__ void hb_adam_publish(float* shared, const long long* step, float beta1,
                                                float beta2, const float* grad_scale,
                                                const float* weight_clamp) {
    const int second = blockDim.x > 32 ? 32 : 0;
    if (threadIdx.x == 0) {
        shared[0] = hb_bias_correction(beta1, *step);
        shared[2] = *grad_scale;
        shared[3] = *weight_clamp;
    }
    if (threadIdx.x == second) {
        shared[1] = hb_bias_correction(beta2, *step);
    }
}

__device__ __forceinline__ HbAdam hb_adam_scalars(const float* shared, float lr, float beta1,
                                                  float beta2, float eps, float weight_decay) {
    return HbAdam{shared[0], shared[1], shared[2], shared[3], lr, beta1, beta2,
                  __fsub_rn(1.0f, beta1), __fsub_rn(1.0f, beta2), eps, weight_decay};
}

// Polyak blend element: keep * target + tau * online (keep = 1 - tau; products rounded, then
// the sum).
__device__ __forceinline__ float hb_polyak(float keep, float target, float tau, float online) {
    return __fadd_rn(__fmul_rn(keep, target), __fmul_rn(tau, online));
}
