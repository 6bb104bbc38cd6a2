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
// against NumPy's float32 exp (a few ulp). The blend covers every element of dlogits (in place:
// the C51 gradient becomes the blended one), row by row: a group of G threads per row of
// dlogits (G = the smallest power of two >= num_atoms, at most 32; groups of a grid-stride loop
// over the rows) finds the row's branch, sample and action once and blends the row's atoms
// j = lane, lane + G, ...; block 0 also sums the loss (a block_sum of reduce.cuh: a fixed tree,
// no atomics). w == 0: dlogits is not touched. 32-bit indices: every array holds fewer than
// 2^30 elements (fast/kernels/_runtime.py MAX_ELEMENTS).

#include "reduce.cuh"  // block_sum, REDUCE_SUM_IDENTITY

// Threads per row of the blend at most (a warp): fast/kernels/warmup.py WARMUP_GROUP_MAX.
#define WARMUP_GROUP_MAX_SHIFT 5

// log2 of the blend's group size G: the smallest power of two >= num_atoms, at most 32
// (fast/kernels/warmup.py warmup_group).
static __device__ __forceinline__ unsigned int warmup_group_shift(int num_atoms) {
    unsigned int shift = 0;
    while (shift < WARMUP_GROUP_MAX_SHIFT && (1 << shift) < num_atoms) {
        ++shift;
    }
    return shift;
}

// One element of the blend: g (0 off the taken action) and (1 - w) * c + w * g.
static __device__ __forceinline__ float warmup_blend(float c, bool taken, float coef, float lp,
                                                     float zj, float e, float keep, float w) {
    float g = 0.0f;
    if (taken) {
        g = __fmul_rn(coef, __fmul_rn(expf(lp), __fsub_rn(zj, e)));
    }
    return __fadd_rn(__fmul_rn(keep, c), __fmul_rn(w, g));
}

// ---------------------------------------------------------------------------------------------
// mse_warmup, with scale = 1 / (batch * n_branches), E = q_taken[d, b], y = target_q[d, b]:
//   td = E - y;  *loss = (sum_{d, b} isw_b * (0.5 * (td * td))) * scale      (block 0)
//   w = fmaxf(0, 1 - isv[epoch_index] / warmup_epochs);  *weight = w          (block 0)
//   if w > 0, every element (d, b, a, j):
//     g = a == actions[d, b] ? ((isw_b * scale) * td) * (expf(logp_d[b, a, j]) * (z_j - E)) : 0
//     dlogits = (1 - w) * dlogits + w * g
// Row r = batch * action_offset[d] + b * n_d + a of dlogits; a thread's rows increase, so its
// branch d only moves forward (action_offset increases).
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
    const unsigned int nb = (unsigned int)batch;
    const unsigned int na_all = (unsigned int)num_atoms;
    const unsigned int rows = nb * (unsigned int)(action_offset[last] + n_actions[last]);
    const unsigned int shift = warmup_group_shift(num_atoms);
    const unsigned int group = 1u << shift;
    const unsigned int tid = blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned int groups = (gridDim.x * blockDim.x) >> shift;
    if ((tid >> shift) >= groups) {
        return;  // a partial last group (never planned): its rows are other groups'
    }
    const unsigned int lane = tid & (group - 1u);
    int d = 0;
    unsigned int d_start = nb * (unsigned int)action_offset[0];
    unsigned int d_end = last > 0 ? nb * (unsigned int)action_offset[1] : 0xffffffffu;
    unsigned int na = (unsigned int)n_actions[0];
    for (unsigned int row = tid >> shift; row < rows; row += groups) {
        while (row >= d_end) {  // d < last here (d_end is 2^32 - 1 at the last branch)
            ++d;
            d_start = nb * (unsigned int)action_offset[d];
            d_end = d < last ? nb * (unsigned int)action_offset[d + 1] : 0xffffffffu;
            na = (unsigned int)n_actions[d];
        }
        const unsigned int local = row - d_start;
        const unsigned int b = local / na;
        const unsigned int a = local - b * na;
        const unsigned int sample = (unsigned int)d * nb + b;
        const bool taken = (int)a == actions[sample];
        float e = 0.0f, coef = 0.0f;
        const float* lp = logp;
        if (taken) {
            e = q_taken[sample];
            const float td = __fsub_rn(e, target_q[sample]);
            coef = __fmul_rn(__fmul_rn(isw[b], scale), td);
            lp = logp + ((unsigned int)block_rows * (unsigned int)action_offset[d] + b * na + a)
                            * na_all;
        }
        float* out = dlogits + row * na_all;
        // Two atoms per pass where there are two: both loads issue before either store.
        unsigned int j = lane;
        for (; j + group < na_all; j += 2u * group) {
            const unsigned int j2 = j + group;
            const float c0 = out[j];
            const float c1 = out[j2];
            const float l0 = taken ? lp[j] : 0.0f;
            const float l1 = taken ? lp[j2] : 0.0f;
            out[j] = warmup_blend(c0, taken, coef, l0, taken ? z[j] : 0.0f, e, keep, w);
            out[j2] = warmup_blend(c1, taken, coef, l1, taken ? z[j2] : 0.0f, e, keep, w);
        }
        if (j < na_all) {
            out[j] = warmup_blend(out[j], taken, coef, taken ? lp[j] : 0.0f,
                                  taken ? z[j] : 0.0f, e, keep, w);
        }
    }
}
