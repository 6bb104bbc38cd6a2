// The second-wave step plumbing (foxhunt.fast: graph1_plan, graph2_plan), twins of
// foxhunt.reference.kernels.wave under the same names: values the reference Trainer forms on
// the host between the second-wave sources' calls, kept on the device here because the step
// graphs are captured once (SPEC 9: no host round trip inside a step).
//
// step_count_advance   the trainer's step counter + 1 (the IQN quantile fractions' offset)
// source_norm_scalars  a budget source's norm before and after its clip, into the readback
// mse_loss_blend       the reported C51 loss blended with the MSE warm-up loss
//
// Each runs as one thread: a handful of scalars. Arithmetic: -fmad=false (fast/_build.py) plus
// explicit __fmul_rn/__fadd_rn/__fdiv_rn/__fsqrt_rn in the reference's order.
#include "early_launch.cuh"  // fh_early_wait, fh_early_release

// optim.clip_scale: n = sqrtf(fmaxf(norm_sq, 0)); max_norm / n if n > max_norm and n > 0, else 1.
static __device__ __forceinline__ float wave_clip_scale(float norm_sq, float max_norm) {
    const float n = __fsqrt_rn(fmaxf(norm_sq, 0.0f));
    return (n > max_norm && n > 0.0f) ? __fdiv_rn(max_norm, n) : 1.0f;
}

// step_count[0] += 1 (the count never gets near 2^63).
extern "C" __global__ void step_count_advance(long long* __restrict__ step_count) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        step_count[0] += 1;
    }
}

// readback[pre_index] = n = sqrtf(fmaxf(*norm_sq, 0)); readback[post_index] = s == 0 ? 0 : n * s
// with s = clip_scale(*norm_sq, budget): an overflowed (discarded) source reads 0, not Inf * 0.
extern "C" __global__ void source_norm_scalars(const float* __restrict__ norm_sq,
                                               float* __restrict__ readback, float budget,
                                               int pre_index, int post_index) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    if (blockIdx.x != 0 || threadIdx.x != 0) {
        return;
    }
    const float sq = *norm_sq;
    const float n = __fsqrt_rn(fmaxf(sq, 0.0f));
    const float s = wave_clip_scale(sq, budget);
    readback[pre_index] = n;
    readback[post_index] = s == 0.0f ? 0.0f : __fmul_rn(n, s);
}

// With w = readback[mse_weight_index] > 0: readback[c51_index] = (1 - w) * c51 + w * mse (each
// product and the sum rounded); w == 0 (or NaN) leaves the C51 loss untouched.
extern "C" __global__ void mse_loss_blend(float* __restrict__ readback, int c51_index,
                                          int mse_loss_index, int mse_weight_index) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    if (blockIdx.x != 0 || threadIdx.x != 0) {
        return;
    }
    const float w = readback[mse_weight_index];
    if (w > 0.0f) {
        readback[c51_index] = __fadd_rn(__fmul_rn(__fsub_rn(1.0f, w), readback[c51_index]),
                                        __fmul_rn(w, readback[mse_loss_index]));
    }
}
