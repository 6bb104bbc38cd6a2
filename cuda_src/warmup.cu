// The MSE warm-up kernel (SPEC 4, second wave), twin of
// foxhunt.reference.kernels.warmup.mse_warmup: the expected-Q MSE against the Mech 1 clipped
// scalar target, its logit gradient at the taken action, and the blend with the C51 logit
// gradient by w = fmaxf(0, 1 - epoch / W), epoch = ISV[EPOCH_IDX] read on the device.
//
// Branch-packed arrays (foxhunt.reference.kernels.fused): branch d's [R, n_d, NA] block starts
// at row R * action_offset[d]; logp has R = block_rows (the online pass over [s; s2]; its first
// `batch` samples are read), dlogits R = batch. q_taken, target_q are [n_branches, batch].
//
// Arithmetic: -fmad=false plus __fadd_rn/__fmul_rn/__fdiv_rn in the reference's order; expf
// against NumPy's float32 exp (a few ulp). The blend is a grid-stride loop over every element of
// dlogits (in place: the C51 gradient becomes the blended one); block 0 also sums the loss (a
// block_sum of reduce.cuh: a fixed tree, no atomics). w == 0: dlogits is not touched.

#include "reduce.cuh"  // block_sum, REDUCE_SUM_IDENTITY

#define WARMUP_FLAT_LOOP(i, n)                                                             \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n);          \
         i += (long long)gridDim.x * blockDim.x)

// ---------------------------------------------------------------------------------------------
// mse_warmup, with scale = 1 / (batch * n_branches), E = q_taken[d, b], y = target_q[d, b]:
//   td = E - y;  *loss = (sum_{d, b} isw_b * (0.5 * (td * td))) * scale      (block 0)
//   w = fmaxf(0, 1 - isv[epoch_index] / warmup_epochs);  *weight = w          (block 0)
//   if w > 0, every element (d, b, a, j):
//     g = a == actions[d, b] ? ((isw_b * scale) * td) * (expf(logp_d[b, a, j]) * (z_j - E)) : 0
//     dlogits = (1 - w) * dlogits + w * g
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(REDUCE_MAX_THREADS)
mse_warmup(const float* __restrict__ logp, const int* __restrict__ actions,
           const float* __restrict__ q_taken, const float* __restrict__ target_q,
           const float* __restrict__ isw, const float* __restrict__ z, float* dlogits,
           const float* __restrict__ isv, int epoch_index, int warmup_epochs,
           const int* __restrict__ n_actions, const int* __restrict__ action_offset,
           float* __restrict__ loss, float* __restrict__ weight, int n_branches, int batch,
           int block_rows, int num_atoms) {
    const float scale = __fdiv_rn(1.0f, (float)(batch * n_branches));
    const float w = fmaxf(0.0f, __fsub_rn(1.0f, __fdiv_rn(isv[epoch_index], (float)warmup_epochs)));
    if (blockIdx.x == 0) {
        __shared__ float scratch[REDUCE_WARP + 1];
        float acc = REDUCE_SUM_IDENTITY;
        const int n_rows = n_branches * batch;
        for (int i = threadIdx.x; i < n_rows; i += blockDim.x) {
            const float td = __fsub_rn(q_taken[i], target_q[i]);
            acc = __fadd_rn(acc, __fmul_rn(isw[i % batch], __fmul_rn(0.5f, __fmul_rn(td, td))));
        }
        const float total = block_sum(acc, scratch);
        if (threadIdx.x == 0) {
            *loss = __fmul_rn(__fadd_rn(total, 0.0f), scale);  // +0.0, never -0.0
            *weight = w;
        }
    }
    if (!(w > 0.0f)) {
        return;
    }
    const float keep = __fsub_rn(1.0f, w);
    const int last = n_branches - 1;
    const long long n = (long long)batch * (action_offset[last] + n_actions[last]) * num_atoms;
    WARMUP_FLAT_LOOP(i, n) {
        const int j = (int)(i % num_atoms);
        const long long row = i / num_atoms;
        int d = 0;
        while (d < last && row >= (long long)batch * action_offset[d + 1]) {
            ++d;
        }
        const int na = n_actions[d];
        const long long local = row - (long long)batch * action_offset[d];
        const int b = (int)(local / na);
        const int a = (int)(local % na);
        const int sample = d * batch + b;
        float g = 0.0f;
        if (a == actions[sample]) {
            const float e = q_taken[sample];
            const float td = __fsub_rn(e, target_q[sample]);
            const float coef = __fmul_rn(__fmul_rn(isw[b], scale), td);
            const long long src = ((long long)block_rows * action_offset[d] + (long long)b * na + a)
                                  * num_atoms + j;
            g = __fmul_rn(coef, __fmul_rn(expf(logp[src]), __fsub_rn(z[j], e)));
        }
        dlogits[i] = __fadd_rn(__fmul_rn(keep, dlogits[i]), __fmul_rn(w, g));
    }
}
