// Shared device code of cuda_src/distributional.cu (per-branch kernels) and cuda_src/fused.cu
// (the same kernels run over every action branch, blockIdx.y = branch): warp reductions, the
// NaN-keeping max, one warp's log-softmax row (log_softmax_row), dueling_combine's mean, and
// the bodies of dueling_combine, its backward, cql_logit_grad and c51_loss written once, on the
// branch's pointers and sizes. The per-branch and fused kernels run these bodies unchanged, so
// they are bitwise equal on the same inputs.
//
// No __global__ functions here: kernels live in the .cu files under their reference names.
// Every helper is `static __device__ __forceinline__`, so each translation unit gets its own copy
// and nothing clashes. Operation order is that of the reference (see distributional.cu's header);
// built with -fmad=false (fast/_build.py).
#pragma once

#include "reduce.cuh"  // warp_sum_halving, warp_max_halving (this file's butterflies)

namespace {

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// cql_logit_grad (and its fused form): at most this many warps per block (one warp per
// sample).
constexpr int kCqlMaxWarps = 8;
// cql_logit_grad's register path: a sample of at most kCqlRegRows actions and at most
// kWarp * kCqlRegChunks atoms (the seed's 3 or 2 x 51) is held in registers (lane l: atoms
// l + 32 c, c < kCqlRegChunks).
constexpr int kCqlRegRows = 4;
constexpr int kCqlRegChunks = 2;

// c51_loss (and its fused form): one block per branch of at most kLossMaxThreads threads; each
// warp reduces kLossGroup samples at once, so their loads are in flight together (the loads of
// one sample do not wait for the previous sample's shuffles).
constexpr int kLossGroup = 8;
constexpr int kLossMaxThreads = 1024;

// The floors of effective_gamma's bases (seed 000's c51_loss_batched; issue 22). The reference
// names them DISCOUNT_FLOOR / GAMMA_FLOOR (foxhunt/reference/kernels/distributional.py; a test
// checks the two agree).
constexpr float kDiscountFloor = 1e-9f;
constexpr float kGammaFloor = 1e-6f;

}  // namespace

// The branch gamma an n-step transition's targets use (issue 22), shared by every target kernel
// (c51_project, c51_project_grad, scalar_target_q_branches, iqn_quantile_huber):
//   n_step_on == 0: gamma itself (discount is not read and may be null: today's floats);
//   else n_eff = logf(fminf(fmaxf(discount[b], kDiscountFloor), 1.0f)) / logf(gamma_ref),
//        gamma_eff = powf(fmaxf(gamma, kGammaFloor), n_eff),
// the reference's effective_gamma (np.log / np.power on float32: conformance bounds cover the
// logf / powf ulps). gamma_ref in (0, 1) (validated on the host). fmaxf takes the non-NaN
// operand, so a NaN discount or gamma is floored; the floors keep logf / powf finite for
// discount <= 0 and gamma <= 0; a discount above 1 (+Inf included) is clamped to 1 (n_eff = 0:
// powf at float32's overflow edge rounds differently from numpy); an infinite gamma reaches
// sample b's target only.
static __device__ __forceinline__ float effective_gamma(float gamma,
                                                        const float* __restrict__ discount, int b,
                                                        float gamma_ref, int n_step_on) {
    if (n_step_on == 0) {
        return gamma;
    }
    const float n_eff = __fdiv_rn(logf(fminf(fmaxf(discount[b], kDiscountFloor), 1.0f)),
                                  logf(gamma_ref));
    return powf(fmaxf(gamma, kGammaFloor), n_eff);
}

// Double-DQN action choice on one row of q (num_actions >= 1): argmax, lowest index on ties;
// scan in action order, replacing the incumbent when q[a] > best or the incumbent is NaN and q[a]
// is not (NaN never wins; an all-NaN row selects 0). Shared by double_dqn_select and the
// step's double_dqn_gather_branches.
static __device__ __forceinline__ int double_dqn_argmax(const float* __restrict__ row,
                                                        int num_actions) {
    float best = row[0];
    int best_index = 0;
    for (int a = 1; a < num_actions; ++a) {
        const float candidate = row[a];
        if (candidate > best || (isnan(best) && !isnan(candidate))) {
            best = candidate;
            best_index = a;
        }
    }
    return best_index;
}

// np.max's pairwise step: NaN wins (either operand).
static __device__ __forceinline__ float max_keep_nan(float best, float x) {
    if (isnan(best)) {
        return best;
    }
    return (isnan(x) || x > best) ? x : best;
}

// sum_j exp(logp_row[j]) * z[j] by one warp (all lanes get the result). Shared by expected_q and
// cql_logit_grad, so the CQL penalty sees exactly the Q that expected_q computes.
static __device__ __forceinline__ float warp_expected_q(const float* __restrict__ logp_row,
                                                        const float* __restrict__ z,
                                                        int num_atoms, int lane) {
    float acc = 0.0f;
    for (int j = lane; j < num_atoms; j += kWarp) {
        acc = acc + expf(logp_row[j]) * z[j];
    }
    return warp_sum_halving(acc);
}

// -Inf as a float (the log-softmax max's start).
static __device__ __forceinline__ float negative_infinity() {
    return __int_as_float(0xff800000);
}

// log_softmax_atoms on one row x [NA] by one warp, written to out [NA] (x in global or shared
// memory; lane l reads only x[l + 32 k]). With `with_q` (warp-uniform), also returns
// expected_q of the written row, sum_j exp(out[j]) * z[j], accumulated exactly as
// warp_expected_q does (lane j's terms in j order from +0.0, then the butterfly) on
// the values just written, so it equals an expected_q launch on `out` bit for bit; 0.0f else.
static __device__ __forceinline__ float log_softmax_row(const float* __restrict__ x,
                                                        float* __restrict__ out,
                                                        const float* __restrict__ z,
                                                        bool with_q, int num_atoms, int lane) {
    float m = negative_infinity();
    for (int j = lane; j < num_atoms; j += kWarp) {
        m = fmaxf(m, x[j]);
    }
    m = warp_max_halving(m);
    float sum = 0.0f;
    for (int j = lane; j < num_atoms; j += kWarp) {
        sum = sum + expf(x[j] - m);
    }
    const float log_sum = logf(warp_sum_halving(sum));
    float q = 0.0f;
    for (int j = lane; j < num_atoms; j += kWarp) {
        const float value = (x[j] - m) - log_sum;
        out[j] = value;
        if (with_q) {
            q = q + expf(value) * z[j];
        }
    }
    return with_q ? warp_sum_halving(q) : 0.0f;
}

// sum_a x[base + a * num_atoms] over the actions, in action order (the reference's order).
static __device__ __forceinline__ float action_sum(const float* __restrict__ x, int base,
                                                   int num_actions, int num_atoms) {
    float sum = x[base];
    for (int a = 1; a < num_actions; ++a) {
        sum = sum + x[base + a * num_atoms];
    }
    return sum;
}

// dueling_combine's mean over the actions of cell (b, j): the action-order sum / A.
static __device__ __forceinline__ float dueling_mean(const float* __restrict__ adv, int base,
                                                     int num_actions, int num_atoms) {
    return action_sum(adv, base, num_actions, num_atoms) / static_cast<float>(num_actions);
}

// The flat index of element (b, 0, j) of a [B, A, NA] block, for the (b, j) cell
// cell = b * NA + j of its [B, NA] plane.
static __device__ __forceinline__ int cell_base(int cell, int num_actions, int num_atoms) {
    const int b = cell / num_atoms;
    const int j = cell - b * num_atoms;
    return b * num_actions * num_atoms + j;
}

// dueling_combine on one [B, A, NA] block: logits[b, a, j] = v[b, j] + (adv[b, a, j] - mean),
// mean = (action-order sum) / A. One thread per (b, j) cell, grid-stride over blockIdx.x.
static __device__ __forceinline__ void dueling_combine_body(const float* __restrict__ v,
                                                            const float* __restrict__ adv,
                                                            float* __restrict__ logits,
                                                            int batch, int num_actions,
                                                            int num_atoms) {
    const int cells = batch * num_atoms;
    const int stride = gridDim.x * blockDim.x;
    for (int cell = blockIdx.x * blockDim.x + threadIdx.x; cell < cells; cell += stride) {
        const int base = cell_base(cell, num_actions, num_atoms);
        const float mean = dueling_mean(adv, base, num_actions, num_atoms);
        const float value = v[cell];
        for (int a = 0; a < num_actions; ++a) {
            const int k = base + a * num_atoms;
            logits[k] = value + (adv[k] - mean);
        }
    }
}

// dueling_combine_backward on the (b, j) cell at `base` (cell_base) of one [B, A, NA] block:
// writes dadv[b, a, j] = dlogits[b, a, j] - dv / A for every action and returns
// dv = sum_a dlogits[b, a, j] (action order). Shared by the per-branch and fused kernels.
static __device__ __forceinline__ float dueling_backward_cell(const float* __restrict__ dlogits,
                                                              float* __restrict__ dadv, int base,
                                                              int num_actions, int num_atoms) {
    const float sum = action_sum(dlogits, base, num_actions, num_atoms);
    const float mean = sum / static_cast<float>(num_actions);
    for (int a = 0; a < num_actions; ++a) {
        const int k = base + a * num_atoms;
        dadv[k] = dlogits[k] - mean;
    }
    return sum;
}

// dueling_combine_backward on one [B, A, NA] block: dv[b, j] = sum_a dlogits[b, a, j] (action
// order); dadv[b, a, j] = dlogits[b, a, j] - dv[b, j] / A. One thread per (b, j) cell.
static __device__ __forceinline__ void dueling_combine_backward_body(
    const float* __restrict__ dlogits, float* __restrict__ dv, float* __restrict__ dadv,
    int batch, int num_actions, int num_atoms) {
    const int cells = batch * num_atoms;
    const int stride = gridDim.x * blockDim.x;
    for (int cell = blockIdx.x * blockDim.x + threadIdx.x; cell < cells; cell += stride) {
        const int base = cell_base(cell, num_actions, num_atoms);
        dv[cell] = dueling_backward_cell(dlogits, dadv, base, num_actions, num_atoms);
    }
}

// kRows rows' per-lane sums acc[r] reduced by the warp butterfly; lane 0 stores row r's sum to
// out[r] (the Q rows of cql_q_rows and of both dueling paths in fused.cu).
template <int kRows>
static __device__ __forceinline__ void warp_store_row_sums(float (&acc)[kRows],
                                                           float* __restrict__ out, int lane) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        acc[r] = warp_sum_halving(acc[r]);
    }
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            out[r] = acc[r];
        }
    }
}

// cql_logit_grad: the Q of kRows consecutive rows of one sample by one warp (all 32 lanes), each
// warp_expected_q's (lane l: its atoms j = l + 32 k in j order from +0.0, then the butterfly),
// the rows' loads and butterflies interleaved; lane 0 writes them to q_out[0..kRows).
template <int kRows>
static __device__ __forceinline__ void cql_q_rows(const float* __restrict__ logp_rows,
                                                  const float* __restrict__ z,
                                                  float* __restrict__ q_out, int num_atoms,
                                                  int lane) {
    float acc[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        acc[r] = 0.0f;
    }
#pragma unroll 1
    for (int j = lane; j < num_atoms; j += kWarp) {
        const float z_j = z[j];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            acc[r] = acc[r] + expf(logp_rows[r * num_atoms + j]) * z_j;
        }
    }
    warp_store_row_sums<kRows>(acc, q_out, lane);
}

// cql_logit_grad: the gradient rows a0..a0+kRows-1 of one sample by one warp: row a's
// dQ = dq_scale * (expf(q[a] - q_max) / sum - 1[a = action]) (phase 2's e, recomputed from the
// same operands), then dlogits_rows[r * NA + j] = dQ * (expf(logp) * (z_j - q[a])), lane l its
// atoms j = l + 32 k; the rows' loads interleaved.
template <int kRows>
static __device__ __forceinline__ void cql_grad_rows(const float* __restrict__ logp_rows,
                                                     const float* __restrict__ z,
                                                     const float* __restrict__ q, int a0,
                                                     int action, float q_max, float sum,
                                                     float dq_scale,
                                                     float* __restrict__ dlogits_rows,
                                                     int num_atoms, int lane) {
    float q_a[kRows];
    float dq[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        q_a[r] = q[a0 + r];
        const float e = expf(q_a[r] - q_max);
        const float one_hot = (a0 + r == action) ? 1.0f : 0.0f;
        dq[r] = dq_scale * (e / sum - one_hot);
    }
#pragma unroll 1
    for (int j = lane; j < num_atoms; j += kWarp) {
        const float z_j = z[j];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            const int k = r * num_atoms + j;
            dlogits_rows[k] = dq[r] * (expf(logp_rows[k]) * (z_j - q_a[r]));
        }
    }
}

// cql_logit_grad's register path: one sample of kRows (= A, 1 <= A <= kCqlRegRows) rows by one
// warp (all 32 lanes), num_atoms <= kWarp * kCqlRegChunks. Every logp value of the sample is
// loaded at once (lane l: atoms j = l + 32 c of every row; one memory round trip), and
// e = expf(logp) once per element (the shared path computes the same expf of the same float in
// phases 1 and 3). Then the shared path's operations in its order: row a's Q is warp_expected_q's
// (lane l's terms e * z_j in j order from +0.0, then warp_sum_halving, whose result every lane
// holds: so Q stays in registers, with no shared row and no __syncwarp), the action-order max
// (max_keep_nan) and exp sum, terms (lane 0), and dlogits = dQ * (e * (z_j - Q[a])) with
// dQ = dq_scale * (expf(Q[a] - mQ) / sum - 1[a = action]). z_lane: z[j] of the lane's atoms
// (0.0f past the support), read once per warp. action in [0, A) (the launchers check it).
template <int kRows>
static __device__ __forceinline__ void cql_sample_regs(const float* __restrict__ sample_logp,
                                                       const float (&z_lane)[kCqlRegChunks],
                                                       int action, float dq_scale,
                                                       float* __restrict__ sample_dlogits,
                                                       float* __restrict__ term, int num_atoms,
                                                       int lane) {
    constexpr int kC = kCqlRegChunks;
    float e[kRows][kC];
#pragma unroll
    for (int c = 0; c < kC; ++c) {
        const int j = lane + c * kWarp;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            e[r][c] = j < num_atoms ? sample_logp[r * num_atoms + j] : 0.0f;
        }
    }
    float q[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        q[r] = 0.0f;
#pragma unroll
        for (int c = 0; c < kC; ++c) {
            const bool own = lane + c * kWarp < num_atoms;
            e[r][c] = expf(e[r][c]);
            const float term_q = e[r][c] * z_lane[c];
            q[r] = own ? q[r] + term_q : q[r];
        }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        q[r] = warp_sum_halving(q[r]);
    }
    float q_max = q[0];
#pragma unroll
    for (int a = 1; a < kRows; ++a) {
        q_max = max_keep_nan(q_max, q[a]);
    }
    float sum = expf(q[0] - q_max);
#pragma unroll
    for (int a = 1; a < kRows; ++a) {
        sum = sum + expf(q[a] - q_max);
    }
    float q_action = q[0];
#pragma unroll
    for (int a = 1; a < kRows; ++a) {
        q_action = a == action ? q[a] : q_action;
    }
    if (lane == 0) {
        term[0] = (q_max + logf(sum)) - q_action;
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        const float e_q = expf(q[r] - q_max);
        const float one_hot = (r == action) ? 1.0f : 0.0f;
        const float dq = dq_scale * (e_q / sum - one_hot);
#pragma unroll
        for (int c = 0; c < kC; ++c) {
            const int j = lane + c * kWarp;
            if (j < num_atoms) {
                sample_dlogits[r * num_atoms + j] = dq * (e[r][c] * (z_lane[c] - q[r]));
            }
        }
    }
}

// cql_logit_grad on one branch: logp [B, A, NA] (samples 0..batch), actions [B], terms [B],
// dlogits [B, A, NA]. One warp per sample (grid-stride over the batch, blockIdx.x * warps +
// warp), no block barrier: phase 1, the warp computes the Q of the sample's A rows
// (warp_expected_q's sums; cql_q_rows, up to 4 rows at once) into its `q` row of shared memory;
// phase 2, every lane does the action-order max and exp sum (the same operations, so the same
// values, in every lane) and lane 0 writes terms; phase 3, each row's dQ once (e = exp(Q - mQ)
// recomputed from the same operands), then the row's elements, lane l its atoms l + 32 k
// (coalesced; cql_grad_rows, up to 4 rows at once). `shared` holds (blockDim / 32) * A floats.
// With 1 <= A <= kCqlRegRows and NA <= 32 * kCqlRegChunks (the seed's shapes), the same
// operations run on registers instead (cql_sample_regs: one load round trip per sample, no
// shared row; `shared` unused). What a warp writes depends on neither the grid nor the block's
// warps: the outputs are the same for any launch of whole warps.
static __device__ __forceinline__ void cql_logit_grad_body(
    const float* __restrict__ logp, const int* __restrict__ actions, const float* __restrict__ z,
    const float* __restrict__ alpha, const float* __restrict__ scale,
    float* __restrict__ dlogits, float* __restrict__ terms, int batch, int num_actions,
    int num_atoms, float* shared) {
    const int lane = threadIdx.x % kWarp;
    const int warp = threadIdx.x / kWarp;
    const int warps = blockDim.x / kWarp;
    float* q = shared + warp * num_actions;  // the warp's [A]
    const float dq_scale = alpha[0] * scale[0];
    const int row_len = num_actions * num_atoms;

    // The register path (warp-uniform: A and NA are the launch's or the branch's).
    if (num_actions >= 1 && num_actions <= kCqlRegRows && num_atoms <= kWarp * kCqlRegChunks) {
        float z_lane[kCqlRegChunks];
#pragma unroll
        for (int c = 0; c < kCqlRegChunks; ++c) {
            const int j = lane + c * kWarp;
            z_lane[c] = j < num_atoms ? z[j] : 0.0f;
        }
        for (int b = blockIdx.x * warps + warp; b < batch; b += gridDim.x * warps) {
            const float* sample_logp = logp + b * row_len;
            float* sample_dlogits = dlogits + b * row_len;
            const int action = actions[b];
            switch (num_actions) {
                case 1:
                    cql_sample_regs<1>(sample_logp, z_lane, action, dq_scale, sample_dlogits,
                                       terms + b, num_atoms, lane);
                    break;
                case 2:
                    cql_sample_regs<2>(sample_logp, z_lane, action, dq_scale, sample_dlogits,
                                       terms + b, num_atoms, lane);
                    break;
                case 3:
                    cql_sample_regs<3>(sample_logp, z_lane, action, dq_scale, sample_dlogits,
                                       terms + b, num_atoms, lane);
                    break;
                default:
                    cql_sample_regs<4>(sample_logp, z_lane, action, dq_scale, sample_dlogits,
                                       terms + b, num_atoms, lane);
                    break;
            }
        }
        return;
    }

    for (int b = blockIdx.x * warps + warp; b < batch; b += gridDim.x * warps) {
        const float* sample_logp = logp + b * row_len;
        for (int a = 0; a < num_actions;) {
            const float* rows = sample_logp + a * num_atoms;
            const int left = num_actions - a;
            if (left >= 4) {
                cql_q_rows<4>(rows, z, q + a, num_atoms, lane);
                a += 4;
            } else if (left == 3) {
                cql_q_rows<3>(rows, z, q + a, num_atoms, lane);
                a += 3;
            } else if (left == 2) {
                cql_q_rows<2>(rows, z, q + a, num_atoms, lane);
                a += 2;
            } else {
                cql_q_rows<1>(rows, z, q + a, num_atoms, lane);
                a += 1;
            }
        }
        __syncwarp();  // lane 0's Q are read by every lane

        float q_max = q[0];
        for (int a = 1; a < num_actions; ++a) {
            q_max = max_keep_nan(q_max, q[a]);
        }
        float sum = expf(q[0] - q_max);
        for (int a = 1; a < num_actions; ++a) {
            sum = sum + expf(q[a] - q_max);
        }
        const int action = actions[b];
        if (lane == 0) {
            terms[b] = (q_max + logf(sum)) - q[action];
        }

        float* sample_dlogits = dlogits + b * row_len;
        for (int a = 0; a < num_actions;) {
            const int offset = a * num_atoms;
            const int left = num_actions - a;
            if (left >= 4) {
                cql_grad_rows<4>(sample_logp + offset, z, q, a, action, q_max, sum, dq_scale,
                                 sample_dlogits + offset, num_atoms, lane);
                a += 4;
            } else if (left == 3) {
                cql_grad_rows<3>(sample_logp + offset, z, q, a, action, q_max, sum, dq_scale,
                                 sample_dlogits + offset, num_atoms, lane);
                a += 3;
            } else if (left == 2) {
                cql_grad_rows<2>(sample_logp + offset, z, q, a, action, q_max, sum, dq_scale,
                                 sample_dlogits + offset, num_atoms, lane);
                a += 2;
            } else {
                cql_grad_rows<1>(sample_logp + offset, z, q, a, action, q_max, sum, dq_scale,
                                 sample_dlogits + offset, num_atoms, lane);
                a += 1;
            }
        }
        __syncwarp();  // every lane has read q before the warp's next sample rewrites it
    }
}

// The end of one c51_loss sample group (both of c51_loss_body's paths): each sample's atom sum
// by the warp butterfly, ce[b] = -sum written by lane 0, and acc + isw * ce (in sample order)
// returned; samples past the batch are skipped.
static __device__ __forceinline__ float c51_loss_group_finish(float (&sum)[kLossGroup],
                                                             const float (&weight)[kLossGroup],
                                                             int b0, int batch, int lane,
                                                             float* __restrict__ ce, float acc) {
#pragma unroll
    for (int g = 0; g < kLossGroup; ++g) {
        sum[g] = warp_sum_halving(sum[g]);
    }
#pragma unroll
    for (int g = 0; g < kLossGroup; ++g) {
        const int b = b0 + g;
        if (b < batch) {
            const float ce_b = -sum[g];
            if (lane == 0) {
                ce[b] = ce_b;
            }
            acc = acc + weight[g] * ce_b;
        }
    }
    return acc;
}

// c51_loss on one branch, by the whole (single) block: logp [B, A, NA] (samples 0..batch; the
// caller points at the branch's block), actions [B], m [B, NA], isw [B], ce [B], total [1]:
// ce[b] = -sum_j m[b, j] * logp[b, a_b, j]; total = scale * sum_b (isw[b] * ce[b]).
// Warp w takes samples in groups of kLossGroup (w * kLossGroup + k * warps * kLossGroup + g),
// each sample's atoms as a per-lane sum plus the warp butterfly; lane 0's accumulator sums
// isw * ce over its samples in that order; the block then sums the per-warp partials with one
// more butterfly (missing warps count +0.0). The order is fixed by blockDim, so the total is
// deterministic. `warp_partial` is shared memory of kLossMaxThreads / kWarp floats. For
// NA <= 2 * kWarp (the seed's) a group's loads are issued together (m with the actions, then
// every taken logp value of both atom chunks): the same operations in the same order.
static __device__ __forceinline__ void c51_loss_body(
    const float* __restrict__ logp, const int* __restrict__ actions,
    const float* __restrict__ m, const float* __restrict__ isw,
    const float* __restrict__ scale, float* __restrict__ ce, float* __restrict__ total,
    int batch, int num_actions, int num_atoms, float* warp_partial) {
    const int lane = threadIdx.x % kWarp;
    const int warp = threadIdx.x / kWarp;
    const int warps = blockDim.x / kWarp;
    float acc = 0.0f;
    // num_atoms <= 2 * kWarp (the seed's 51): the group's atoms in two chunks held at once, the
    // m values loaded with the actions and weights (they do not depend on them), then every
    // taken logp value: two memory round trips per group instead of one per chunk after the
    // actions'.
    // The same operations in the same order as the loop below (lane l: sum = (+0.0 +
    // m * logp at j = l) + m * logp at j = l + 32, atoms past num_atoms skipped).
    for (int b0 = warp * kLossGroup; b0 < batch && num_atoms <= 2 * kWarp;
         b0 += warps * kLossGroup) {
        // Lane g < kLossGroup loads sample b0 + g's action and weight (one coalesced load
        // each), handed to every lane by a shuffle (the same bits).
        const bool lane_valid = lane < kLossGroup && b0 + lane < batch;
        const int lane_action = lane_valid ? actions[b0 + lane] : 0;
        const float lane_isw = lane_valid ? isw[b0 + lane] : 0.0f;
        float weight[kLossGroup];
        float m_j[kLossGroup][2];
        float logp_j[kLossGroup][2];
        int row_offset[kLossGroup];
#pragma unroll
        for (int g = 0; g < kLossGroup; ++g) {
            const int b = b0 + g;
            const bool valid = b < batch;
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int j = lane + c * kWarp;
                m_j[g][c] = (valid && j < num_atoms) ? m[b * num_atoms + j] : 0.0f;
            }
        }
#pragma unroll
        for (int g = 0; g < kLossGroup; ++g) {
            const int b = b0 + g;
            const bool valid = b < batch;
            const int action = __shfl_sync(kFullMask, lane_action, g);
            const float weight_g = __shfl_sync(kFullMask, lane_isw, g);
            weight[g] = valid ? weight_g : 0.0f;
            row_offset[g] = valid ? (b * num_actions + action) * num_atoms : 0;
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int j = lane + c * kWarp;
                logp_j[g][c] = (valid && j < num_atoms) ? logp[row_offset[g] + j] : 0.0f;
            }
        }
        float sum[kLossGroup];
#pragma unroll
        for (int g = 0; g < kLossGroup; ++g) {
            sum[g] = 0.0f;
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const float term = m_j[g][c] * logp_j[g][c];
                sum[g] = (lane + c * kWarp < num_atoms) ? sum[g] + term : sum[g];
            }
        }
        acc = c51_loss_group_finish(sum, weight, b0, batch, lane, ce, acc);
    }
    for (int b0 = warp * kLossGroup; b0 < batch && num_atoms > 2 * kWarp;
         b0 += warps * kLossGroup) {
        int row_offset[kLossGroup];
        float weight[kLossGroup];
        float sum[kLossGroup];
#pragma unroll
        for (int g = 0; g < kLossGroup; ++g) {
            const int b = b0 + g;
            const bool valid = b < batch;
            row_offset[g] = valid ? (b * num_actions + actions[b]) * num_atoms : 0;
            weight[g] = valid ? isw[b] : 0.0f;
            sum[g] = 0.0f;
        }
        for (int j = lane; j < num_atoms; j += kWarp) {
#pragma unroll
            for (int g = 0; g < kLossGroup; ++g) {
                const int b = b0 + g;
                if (b < batch) {
                    sum[g] = sum[g] + m[b * num_atoms + j] * logp[row_offset[g] + j];
                }
            }
        }
        acc = c51_loss_group_finish(sum, weight, b0, batch, lane, ce, acc);
    }
    if (lane == 0) {
        warp_partial[warp] = acc;
    }
    __syncthreads();
    if (warp == 0) {
        const float partial = lane < warps ? warp_partial[lane] : 0.0f;
        const float sum_all = warp_sum_halving(partial);
        if (lane == 0) {
            total[0] = scale[0] * sum_all;
        }
    }
}

// c51_project's shared pieces (the per-sample projection used by c51_project, c51_project_grad
// and step.cu's c51_gather_project_dueling_branches).
namespace {

// c51_project: source atoms are staged through shared memory in tiles of the block size.
constexpr int kProjectMaxThreads = 256;

}  // namespace

// np.minimum(np.maximum(t, lo), hi): a NaN t stays NaN (a bare fminf(fmaxf()) would map it to lo).
static __device__ __forceinline__ float clip_keep_nan(float t, float lo, float hi) {
    return isnan(t) ? t : fminf(fmaxf(t, lo), hi);
}

// The projection's target atom Tz_j = clip(r + g * z_j, v_min, v_max) (NaN kept).
static __device__ __forceinline__ float c51_target_atom(float reward, float discount, float z_j,
                                                        float v_min, float v_max) {
    return clip_keep_nan(__fadd_rn(reward, __fmul_rn(discount, z_j)), v_min, v_max);
}

// m_i's term of source atom k: p_k * clip(1 - |Tz_k - z_i| / dz, 0, 1) (NaN kept).
static __device__ __forceinline__ float c51_project_term(float target_k, float p_k, float z_i,
                                                         float dz) {
    const float distance = fabsf(__fsub_rn(target_k, z_i));
    const float weight = clip_keep_nan(__fsub_rn(1.0f, __fdiv_rn(distance, dz)), 0.0f, 1.0f);
    return __fmul_rn(p_k, weight);
}

// c51_project_sample's one-tile path (num_atoms <= blockDim.x, every thread of the block):
// thread i = threadIdx.x owns target atom i and gives p_i = p[i] (any value where i >=
// num_atoms); returns m_i (+0.0 where i >= num_atoms); ends with a barrier (the tiles are free
// again). The block checks, with the staging barrier (__syncthreads_or), that the sample is
// "windowed": dz > 0 finite, every z_j and p_j finite, every Tz_j not NaN and Tz nondecreasing
// in j. Then s_k = Tz_k - z_i (rounded) is nondecreasing in k, so the k with |s_k| < dz form one
// run, found by a binary search for the first s_k > -dz; thread i adds the terms of that run
// only, in source order. Every other term is an exact no-op: |s_k| >= dz gives |s_k| / dz >= 1
// after rounding, so the weight is +-0.0 and p_k * weight = +-0.0 (p_k finite), and acc +
// (+-0.0) == acc bit for bit (acc starts at +0.0 and can never become -0.0). So m_i is bitwise
// the full sum's. A sample that is not windowed (a NaN or infinite input, a decreasing Tz) runs
// the full sum over every k. (A block running several samples side by side, as step.cu's
// c51_gather_project_dueling_branches does, ORs their checks: either path gives the same bits.)
// The caller gives z_i = z[i] and z_next = z[i + 1] of its atom (c51_z_pair; any value where
// not read), loaded before the sample's other loads wait.
static __device__ __forceinline__ float c51_project_tile(
    float p_i, float reward, float discount, float z_i, float z_next, int num_atoms,
    float v_min, float v_max, float dz, float* tile_target, float* tile_p) {
    const int i = threadIdx.x;
    const bool own = i < num_atoms;
    int bad = 0;
    if (own) {
        const float target_i = c51_target_atom(reward, discount, z_i, v_min, v_max);
        tile_target[i] = target_i;
        tile_p[i] = p_i;
        bad = isnan(target_i) || !isfinite(p_i) || !isfinite(z_i);
        if (i + 1 < num_atoms) {  // Tz_{i+1} by its own formula (thread i+1 stages it)
            bad |= !(target_i <= c51_target_atom(reward, discount, z_next, v_min, v_max));
        }
    }
    const bool windowed = !__syncthreads_or(bad) && dz > 0.0f && isfinite(dz);
    float acc = 0.0f;
    if (own) {
        if (windowed) {
            const float below = -dz;
            int lo = 0;
            int hi = num_atoms;
            while (lo < hi) {  // the first k with s_k > -dz (num_atoms if none)
                const int mid = (lo + hi) >> 1;
                if (__fsub_rn(tile_target[mid], z_i) > below) {
                    hi = mid;
                } else {
                    lo = mid + 1;
                }
            }
            for (int k = lo; k < num_atoms; ++k) {
                if (!(fabsf(__fsub_rn(tile_target[k], z_i)) < dz)) {
                    break;  // s_k >= dz: so is every later s_k
                }
                acc = __fadd_rn(acc, c51_project_term(tile_target[k], tile_p[k], z_i, dz));
            }
        } else {
            for (int k = 0; k < num_atoms; ++k) {
                acc = __fadd_rn(acc, c51_project_term(tile_target[k], tile_p[k], z_i, dz));
            }
        }
    }
    __syncthreads();  // the tile is overwritten by the next sample
    return acc;
}

// c51_project_tile's z values of thread i = threadIdx.x: z[i] and z[i + 1] (+0.0 past num_atoms:
// not read there).
static __device__ __forceinline__ void c51_z_pair(const float* __restrict__ z, int num_atoms,
                                                  float& z_i, float& z_next) {
    const int i = threadIdx.x;
    z_i = i < num_atoms ? z[i] : 0.0f;
    z_next = i + 1 < num_atoms ? z[i + 1] : 0.0f;
}

// c51_project's work on one sample b (all threads of the block): p = p_next[b], m_row = m[b].
// Thread i owns target atom i (i = i0 + threadIdx.x for each tile i0 of blockDim atoms); source
// atoms j are staged through shared memory (tile_target, tile_p: blockDim floats each), one tile
// at a time; the sum over j runs in source order from +0.0.
// With dlogits_taken != nullptr (block-uniform), thread i also writes c51_grad's element of the
// taken row, dlogits_taken[i] = grad_weight * (expf(logp_taken[i]) - m[b, i]), from the value of
// m[b, i] it has just computed (c51_grad's operations; it reads m[b, i] from memory, the same
// float); its logp load is issued before the projection's loop so that it overlaps it.
//
// One tile (NA <= blockDim, every plan of NA <= 256): c51_project_tile.
static __device__ __forceinline__ void c51_project_sample(
    const float* __restrict__ p, float reward, float discount, const float* __restrict__ z,
    float* __restrict__ m_row, const float* __restrict__ logp_taken, float grad_weight,
    float* __restrict__ dlogits_taken, int num_atoms, float v_min, float v_max, float dz,
    float* tile_target, float* tile_p) {
    const int tile = blockDim.x;
    if (num_atoms <= tile) {
        const int i = threadIdx.x;
        const bool own = i < num_atoms;
        const float p_taken = (dlogits_taken != nullptr && own) ? expf(logp_taken[i]) : 0.0f;
        float z_i, z_next;
        c51_z_pair(z, num_atoms, z_i, z_next);
        const float acc = c51_project_tile(own ? p[i] : 0.0f, reward, discount, z_i, z_next,
                                           num_atoms, v_min, v_max, dz, tile_target, tile_p);
        if (own) {
            m_row[i] = acc;
            if (dlogits_taken != nullptr) {
                dlogits_taken[i] = grad_weight * (p_taken - acc);
            }
        }
        return;
    }
    for (int i0 = 0; i0 < num_atoms; i0 += tile) {
        const int i = i0 + threadIdx.x;
        const float z_i = i < num_atoms ? z[i] : 0.0f;
        const float p_taken =
            (dlogits_taken != nullptr && i < num_atoms) ? expf(logp_taken[i]) : 0.0f;
        float acc = 0.0f;
        for (int j0 = 0; j0 < num_atoms; j0 += tile) {
            const int j = j0 + threadIdx.x;
            if (j < num_atoms) {
                tile_target[threadIdx.x] = c51_target_atom(reward, discount, z[j], v_min, v_max);
                tile_p[threadIdx.x] = p[j];
            }
            __syncthreads();
            const int count = min(tile, num_atoms - j0);
            if (i < num_atoms) {
                for (int k = 0; k < count; ++k) {
                    acc = __fadd_rn(acc, c51_project_term(tile_target[k], tile_p[k], z_i, dz));
                }
            }
            __syncthreads();  // the tile is overwritten next
        }
        if (i < num_atoms) {
            m_row[i] = acc;
            if (dlogits_taken != nullptr) {
                dlogits_taken[i] = grad_weight * (p_taken - acc);
            }
        }
    }
}
