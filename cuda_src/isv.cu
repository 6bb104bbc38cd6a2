// ISV producer kernels (SPEC 7): guarded EMA updates of bus slots, in place on the ISV vector.
// Twins of foxhunt.reference.kernels.isv; only the produced slots are written, every other slot
// keeps its bits (the fingerprint slots included).
//
// Slot indices, the signal count and the adaptive-rate constants are kernel arguments taken
// from the ISV registry (foxhunt.reference.isv) by the launchers, so they are defined once.
// Reductions are one block with the fixed trees of reduce.cuh: no atomics.
#include "early_launch.cuh"  // fh_early_wait, fh_early_release
#include "reduce.cuh"
#include "isv_ema.cuh"  // hb_guarded_ema, hb_adaptive_rate (shared with aux.cu)

// isv_signal_update: isv[i] = ema(isv[i], signals[i], alpha) for i < num_signals, with the
// adaptive rate alpha = alpha_base * (1 + gain * |clamp(sharpe, -clamp, clamp)|), NaN Sharpe
// counted as 0 (isv.adaptive_ema_rate). *sharpe is read on the device; in the trainer it may
// point into isv itself (the Sharpe slot, which this kernel does not write). Launch: grid 1,
// block >= num_signals (plan_isv_signal_update).
extern "C" __global__ void isv_signal_update(float* __restrict__ isv,
                                             const float* __restrict__ signals, int num_signals,
                                             const float* __restrict__ sharpe, float alpha_base,
                                             float sharpe_clamp, float sharpe_gain) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    const int i = threadIdx.x;
    if (i >= num_signals) {
        return;
    }
    const float alpha = hb_adaptive_rate(*sharpe, alpha_base, sharpe_clamp, sharpe_gain);
    isv[i] = hb_guarded_ema(isv[i], signals[i], alpha);
}

// |x| (or x * x with `square`) if x is finite, else the identity; counts the finite terms.
template <bool square>
struct HbFiniteTerm {
    long long count = 0;
    __device__ __forceinline__ float operator()(float x) {
        if (!isfinite(x)) {
            return REDUCE_SUM_IDENTITY;
        }
        ++count;
        return square ? __fmul_rn(x, x) : fabsf(x);
    }
};

// Shared body of the two mean-based producers: the block's sum of the finite terms and their
// count, then thread 0 blends value(sum, count) into isv[slot], unless no term was finite
// (count == 0: the slot keeps its bits; value is not used).
template <bool square, typename Value>
__device__ __forceinline__ void hb_finite_mean_ema(float* isv, int slot, const float* x,
                                                   long long n, float alpha, Value value) {
    __shared__ float scratch[REDUCE_WARP + 1];
    __shared__ long long count_scratch[REDUCE_WARP + 1];
    HbFiniteTerm<square> term;
    const float total = block_sum(thread_partial(x, 0, n, term), scratch);
    const long long count = block_sum(term.count, count_scratch);
    if (threadIdx.x == 0 && count > 0) {
        isv[slot] = hb_guarded_ema(isv[slot], value(total, __ll2float_rn(count)), alpha);
    }
}

struct HbMean {
    __device__ __forceinline__ float operator()(float total, float count) const {
        return __fdiv_rn(total, count);
    }
};

struct HbRootMean {
    __device__ __forceinline__ float operator()(float total, float count) const {
        return __fsqrt_rn(fmaxf(__fdiv_rn(total, count), 0.0f));
    }
};

// isv_q_abs_ref_update: isv[slot] = ema(isv[slot], mean |q_i| over the finite q_i, alpha);
// mean = sum / float(count). No finite q (or an empty q): unchanged; an overflowing sum gives a
// non-finite mean, which the EMA guard ignores. Launch: grid 1, block a multiple of 32.
extern "C" __global__ void __launch_bounds__(REDUCE_MAX_THREADS)
isv_q_abs_ref_update(float* __restrict__ isv, int slot, const float* __restrict__ q, long long n,
                     float alpha) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    hb_finite_mean_ema<false>(isv, slot, q, n, alpha, HbMean());
}

// isv_h2_rms_update: isv[slot] = ema(isv[slot], rms, alpha), rms = sqrtf(fmaxf(sum h_i^2 /
// float(count), 0)) over the finite h_i. No finite h: unchanged; overflowing squares give a
// non-finite rms, which the EMA guard ignores. Launch: grid 1, block a multiple of 32.
extern "C" __global__ void __launch_bounds__(REDUCE_MAX_THREADS)
isv_h2_rms_update(float* __restrict__ isv, int slot, const float* __restrict__ h2, long long n,
                  float alpha) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    hb_finite_mean_ema<true>(isv, slot, h2, n, alpha, HbRootMean());
}
