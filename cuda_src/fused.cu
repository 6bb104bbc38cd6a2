// Fused kernels: one launch over every action branch (blockIdx.y = branch d), each the per-branch
// kernel of distributional.cu applied to branch d's block of a branch-packed buffer.
//
// The specification is foxhunt/reference/kernels/fused.py (the composition of the per-branch
// reference kernels): same formulas, operation order and NaN/Inf contracts as the per-branch
// kernels (bitwise equal to them on the same inputs: both run the same bodies from
// distributional.cuh, here with the branch's pointers and sizes taken from the tables).
//
// Branch-packed layout: branch d's [R, n_d, NA] block starts at row R * action_offset[d] of a
// [R * A_total, NA] buffer (n_actions[d] = n_d; tables are int32 device arrays of D entries).
// gridDim.y = D. Parameters: inputs (tables among them), outputs, sizes. Built with
// -fmad=false; no atomics; 32-bit index arithmetic (the launchers bound the sizes).

#include "distributional.cuh"  // the per-branch kernels' bodies, run here on branch d's block

// --------------------------------------------------------------------------------------------
// dueling_combine per branch: logits_d[b, a, j] = v[b, j] + (adv_d[b, a, j] - mean_a adv_d[b, :, j]).
// v [B, NA] is shared; adv and logits are branch-packed with R = B. One thread per (b, j) cell.
// --------------------------------------------------------------------------------------------
extern "C" __global__ void dueling_combine_branches(const float* __restrict__ v,
                                                    const float* __restrict__ adv,
                                                    const int* __restrict__ n_actions,
                                                    const int* __restrict__ action_offset,
                                                    float* __restrict__ logits,
                                                    int batch, int num_atoms) {
    const int d = blockIdx.y;
    const int num_actions = n_actions[d];
    const int block_start = batch * action_offset[d] * num_atoms;
    dueling_combine_body(v, adv + block_start, logits + block_start, batch, num_actions, num_atoms);
}

// --------------------------------------------------------------------------------------------
// dueling_combine_backward per branch: dv[d, b, j] = sum_a dlogits_d[b, a, j] (action order);
// dadv_d = dlogits_d - dv[d] / n_d. dlogits and dadv branch-packed (R = B), dv [D, B, NA].
// --------------------------------------------------------------------------------------------
extern "C" __global__ void dueling_combine_backward_branches(const float* __restrict__ dlogits,
                                                             const int* __restrict__ n_actions,
                                                             const int* __restrict__ action_offset,
                                                             float* __restrict__ dv,
                                                             float* __restrict__ dadv,
                                                             int batch, int num_atoms) {
    const int d = blockIdx.y;
    const int num_actions = n_actions[d];
    const int block_start = batch * action_offset[d] * num_atoms;
    dueling_combine_backward_body(dlogits + block_start, dv + d * batch * num_atoms,
                                  dadv + block_start, batch, num_actions, num_atoms);
}

// --------------------------------------------------------------------------------------------
// cql_logit_grad per branch on samples 0..B of branch d's block of logp (R = block_rows >= B
// samples per block): dlogits (branch-packed, R = B) and terms [D, B]. The body is
// cql_logit_grad's (cql_logit_grad_body in distributional.cuh: tiles of S_d = max(1, warps / n_d)
// samples, one warp per (sample, action) row); its results do not depend on blockDim, so one
// block size serves every branch. Dynamic shared memory: max over branches of
// (2 * S_d * n_d + 2 * S_d) floats.
// --------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(kCqlMaxWarps * kWarp)
cql_logit_grad_branches(const float* __restrict__ logp, const int* __restrict__ actions,
                        const float* __restrict__ z, const float* __restrict__ alpha,
                        const float* __restrict__ scale, const int* __restrict__ n_actions,
                        const int* __restrict__ action_offset, float* __restrict__ dlogits,
                        float* __restrict__ terms, int batch, int block_rows, int num_atoms) {
    extern __shared__ float cql_shared[];
    const int d = blockIdx.y;
    const int num_actions = n_actions[d];
    const float* logp_d = logp + block_rows * action_offset[d] * num_atoms;
    float* dlogits_d = dlogits + batch * action_offset[d] * num_atoms;
    cql_logit_grad_body(logp_d, actions + d * batch, z, alpha, scale, dlogits_d, terms + d * batch,
                        batch, num_actions, num_atoms, cql_shared);
}

// --------------------------------------------------------------------------------------------
// c51_loss per branch on samples 0..B of branch d's block of logp (R = block_rows >= B samples
// per block): ce[d, b] = -sum_j m[d, b, j] * logp_d[b, a_{d,b}, j];
// total[d] = scale * sum_b (isw[b] * ce[d, b]). Grid (1, D): block d runs c51_loss's body
// (c51_loss_body in distributional.cuh) on branch d's pointers, so ce[d] and total[d] are
// bitwise those of a c51_loss launch on branch d with the same blockDim. actions [D, B] int32,
// m [D, B, NA], isw [B] and scale (one device float) shared, ce [D, B], total [D].
// --------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(kLossMaxThreads)
c51_loss_branches(const float* __restrict__ logp, const int* __restrict__ actions,
                  const float* __restrict__ m, const float* __restrict__ isw,
                  const float* __restrict__ scale, const int* __restrict__ n_actions,
                  const int* __restrict__ action_offset, float* __restrict__ ce,
                  float* __restrict__ total, int batch, int block_rows, int num_atoms) {
    __shared__ float warp_partial[kLossMaxThreads / kWarp];
    if (blockIdx.x != 0) {
        return;  // launched with grid (1, D); another block in x would race on total[d]
    }
    const int d = blockIdx.y;
    const int num_actions = n_actions[d];
    const float* logp_d = logp + block_rows * action_offset[d] * num_atoms;
    c51_loss_body(logp_d, actions + d * batch, m + d * batch * num_atoms, isw, scale,
                  ce + d * batch, total + d, batch, num_actions, num_atoms, warp_partial);
}
