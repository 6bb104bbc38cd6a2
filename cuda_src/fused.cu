// Fused kernels: one launch over every action branch (blockIdx.y = branch d), each the per-branch
// kernel of distributional.cu applied to branch d's block of a branch-packed buffer
// (dueling_log_softmax_q_branches: two of them, dueling_combine then log_softmax_expected_q).
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
// dueling_combine_branches then log_softmax_expected_q on its rows, in one launch (one forward
// pass: the online pass with Q, the target pass without):
//   logits[r, j] = v[b, j] + (adv[r, j] - mean_a adv_d[b, :, j])   (dueling_combine_body's ops);
//   logp[r, :] = log_softmax(logits[r, :]); q[r] = sum_j exp(logp[r, j]) * z[j] if with_q,
// for every packed row r = batch * action_offset[d] + b * n_d + a of branch d (blockIdx.y = d).
// One warp per row (grid-stride over branch d's batch * n_d rows): lane l computes the logits
// of atoms j = l + 32 k as dueling_combine does (dueling_mean: the action-order sum / n_d,
// then v + (adv - mean)), writes them to `logits` and to its warp's row of shared memory, then
// the warp runs log_softmax_row (log_softmax_expected_q's body) on that shared row: every
// value is bitwise that of dueling_combine_branches followed by log_softmax_expected_q. Lane l
// reads back only the entries it wrote, so no barrier is needed. with_q (0 or 1) is uniform;
// with with_q = 0, z and q are not read or written (may be null). Dynamic shared memory:
// (blockDim.x / 32) * num_atoms floats.
// --------------------------------------------------------------------------------------------
extern "C" __global__ void dueling_log_softmax_q_branches(const float* __restrict__ v,
                                                          const float* __restrict__ adv,
                                                          const float* __restrict__ z,
                                                          const int* __restrict__ n_actions,
                                                          const int* __restrict__ action_offset,
                                                          float* __restrict__ logits,
                                                          float* __restrict__ logp,
                                                          float* __restrict__ q, int batch,
                                                          int num_atoms, int with_q) {
    extern __shared__ float dueling_rows[];  // [blockDim.x / 32, num_atoms]
    const int d = blockIdx.y;
    const int num_actions = n_actions[d];
    const int first_row = batch * action_offset[d];  // branch d's first packed row
    const int lane = threadIdx.x % kWarp;
    const int warp = threadIdx.x / kWarp;
    const int warps = blockDim.x / kWarp;
    const bool want_q = with_q != 0;
    float* row_values = dueling_rows + warp * num_atoms;
    const float* adv_d = adv + first_row * num_atoms;
    const int rows = batch * num_actions;
    for (int r = blockIdx.x * warps + warp; r < rows; r += gridDim.x * warps) {
        const int b = r / num_actions;
        const int a = r - b * num_actions;
        const int row = first_row + r;
        float* logits_row = logits + row * num_atoms;
        for (int j = lane; j < num_atoms; j += kWarp) {
            const int base = b * num_actions * num_atoms + j;  // cell_base of cell (b, j)
            const float mean = dueling_mean(adv_d, base, num_actions, num_atoms);
            const float value = v[b * num_atoms + j] + (adv_d[base + a * num_atoms] - mean);
            row_values[j] = value;
            logits_row[j] = value;
        }
        const float row_q = log_softmax_row(row_values, logp + row * num_atoms, z, want_q,
                                            num_atoms, lane);
        if (want_q && lane == 0) {
            q[row] = row_q;
        }
    }
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
// dueling_combine_backward_branches with dv summed over the branches (the network backward's
// dv = dv + dv_d from zeros), in one launch: for every (b, j) cell, in branch order d = 0..D-1,
//   dv_d = sum_a dlogits_d[b, a, j] (action order), dadv_d[b, a, j] = dlogits_d[b, a, j] - dv_d / n_d
// (dueling_backward_cell, the per-branch body's ops), acc = acc + dv_d from acc = +0.0f;
// dv[b, j] = acc. Bitwise dueling_combine_backward_branches followed by branch_mean with
// divisor 1 (x / 1 is exact). dlogits and dadv branch-packed (R = B), dv [B, NA]. One thread per
// cell looping over the branches (gridDim.y = 1), grid-stride over blockIdx.x; no atomics.
// --------------------------------------------------------------------------------------------
extern "C" __global__ void dueling_combine_backward_sum_branches(
    const float* __restrict__ dlogits, const int* __restrict__ n_actions,
    const int* __restrict__ action_offset, float* __restrict__ dv, float* __restrict__ dadv,
    int batch, int num_atoms, int n_branches) {
    const int cells = batch * num_atoms;
    const int stride = gridDim.x * blockDim.x;
    for (int cell = blockIdx.x * blockDim.x + threadIdx.x; cell < cells; cell += stride) {
        float acc = 0.0f;
        for (int d = 0; d < n_branches; ++d) {
            const int num_actions = n_actions[d];
            const int block_start = batch * action_offset[d] * num_atoms;
            const int base = cell_base(cell, num_actions, num_atoms);
            acc = __fadd_rn(acc, dueling_backward_cell(dlogits + block_start, dadv + block_start,
                                                       base, num_actions, num_atoms));
        }
        dv[cell] = acc;
    }
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
