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

#include "early_launch.cuh"  // fh_early_wait, fh_early_release
#include "distributional.cuh"  // the per-branch kernels' bodies, run here on branch d's block
#include "dueling.cuh"  // dueling_sample_regs (the register path), kDuelingRegRows, kDuelingRegChunks

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
// One warp per sample b of branch d (grid-stride over the batch; what a warp computes does not
// depend on which warp or block runs the sample, so the outputs are the same for any grid and
// any block of whole warps up to kDuelingMaxWarps). Two paths, chosen per branch (uniform):
// - registers (1 <= n_d <= kDuelingRegRows and num_atoms <= 32 * kDuelingRegChunks, the seed's
//   shapes): the warp loads the sample's every adv and v value at once (one memory round trip
//   per sample instead of one per phase and atom chunk), then runs the operations below on
//   registers (dueling_sample_regs);
// - shared memory (otherwise): lane l first computes the cell means of its atoms j = l + 32 k
//   once (dueling_mean: the action-order sum / n_d, into the warp's `means` row of shared
//   memory), then the warp runs the n_d rows of the sample in groups of up to kDuelingRowGroup
//   rows (dueling_row_group). Lane l reads back only the shared entries it wrote, so no barrier
//   is needed.
// In both, each row's ops are those of dueling_combine then log_softmax_row (the rows of a
// sample interleaved for latency): every value is bitwise that of dueling_combine_branches
// followed by log_softmax_expected_q. NaN/Inf: those of the two kernels (the max skips NaN via
// fmaxf; a NaN or +Inf value, or an all -Inf row, makes the row's logp NaN). with_q (0 or 1) is
// uniform; with with_q = 0, z and q are not read or written (may be null). Dynamic shared
// memory (the shared path's; the plan always gives it): (blockDim.x / 32) * (1 +
// kDuelingRowGroup) * num_atoms floats.
// --------------------------------------------------------------------------------------------
namespace {
// dueling_log_softmax_q_branches: at most this many rows of a sample are staged at once
// (fast/kernels/fused.py DUELING_ROW_GROUP: the plan's shared memory).
constexpr int kDuelingRowGroup = 4;
// dueling_log_softmax_q_branches' launch bound: at most kDuelingMaxWarps warps per block
// (fast/kernels/fused.py DUELING_WARPS, the plan's most), and registers for kDuelingMinBlocks
// such blocks per SM: 48 on sm_80 / sm_90 (72 unbounded: 7 blocks); the member build spills
// 4-12 bytes there (the sample loop's counters, once per sample).
constexpr int kDuelingMaxWarps = 4;
constexpr int kDuelingMinBlocks = 10;
}  // namespace

// kRows consecutive rows of one sample by one warp (all 32 lanes, warp-uniform arguments):
// adv_rows, logits_rows, logp_rows are the first row's [NA] (row r at + r * num_atoms), q_rows
// its q (row r at + r), means the sample's cell means, v_b its value row, rows_s the warp's
// kRows staged rows (shared). Row r's operations are, in order, those of dueling_combine_body
// (value = v + (adv - mean)) and of log_softmax_row on the staged row (lane l: its atoms
// j = l + 32 k in j order, the max from -Inf, the exp sum from +0.0, Q's terms from +0.0, each
// reduced by the same butterfly), so each row is bitwise that of log_softmax_row: only the
// independent rows' instructions are interleaved (the max folded into the staging loop reads
// the value it stages).
template <int kRows>
static __device__ __forceinline__ void dueling_row_group(
    const float* __restrict__ v_b, const float* __restrict__ adv_rows,
    const float* __restrict__ means, float* __restrict__ rows_s, const float* __restrict__ z,
    float* __restrict__ logits_rows, float* __restrict__ logp_rows, float* __restrict__ q_rows,
    bool with_q, int num_atoms, int lane) {
    float m[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        m[r] = negative_infinity();
    }
#pragma unroll 1
    for (int j = lane; j < num_atoms; j += kWarp) {
        const float v_j = v_b[j];
        const float mean = means[j];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            const int k = r * num_atoms + j;
            const float value = v_j + (adv_rows[k] - mean);
            rows_s[k] = value;
            logits_rows[k] = value;
            m[r] = fmaxf(m[r], value);
        }
    }
    float sum[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        m[r] = warp_max_halving(m[r]);
        sum[r] = 0.0f;
    }
#pragma unroll 1
    for (int j = lane; j < num_atoms; j += kWarp) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            sum[r] = sum[r] + expf(rows_s[r * num_atoms + j] - m[r]);
        }
    }
    float log_sum[kRows];
    float q[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        log_sum[r] = logf(warp_sum_halving(sum[r]));
        q[r] = 0.0f;
    }
#pragma unroll 1
    for (int j = lane; j < num_atoms; j += kWarp) {
        const float z_j = with_q ? z[j] : 0.0f;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            const int k = r * num_atoms + j;
            const float value = (rows_s[k] - m[r]) - log_sum[r];
            logp_rows[k] = value;
            if (with_q) {
                q[r] = q[r] + expf(value) * z_j;
            }
        }
    }
    if (with_q) {
        warp_store_row_sums<kRows>(q, q_rows, lane);
    }
}


extern "C" __global__ void __launch_bounds__(kDuelingMaxWarps * kWarp, kDuelingMinBlocks)
dueling_log_softmax_q_branches(const float* __restrict__ v, const float* __restrict__ adv,
                               const float* __restrict__ z, const int* __restrict__ n_actions,
                               const int* __restrict__ action_offset, float* __restrict__ logits,
                               float* __restrict__ logp, float* __restrict__ q, int batch,
                               int num_atoms, int with_q) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    extern __shared__ float dueling_rows[];  // [blockDim.x / 32, 1 + kDuelingRowGroup, NA]
    const int d = blockIdx.y;
    const int num_actions = n_actions[d];
    const int first_row = batch * action_offset[d];  // branch d's first packed row
    const int lane = threadIdx.x % kWarp;
    const int warp = threadIdx.x / kWarp;
    const int warps = blockDim.x / kWarp;
    const bool want_q = with_q != 0;
    float* means = dueling_rows + warp * (1 + kDuelingRowGroup) * num_atoms;
    float* rows_s = means + num_atoms;
    // The register path (block-uniform: the branch's n_d and num_atoms).
    const bool in_regs = num_actions >= 1 && num_actions <= kDuelingRegRows &&
                         num_atoms <= kWarp * kDuelingRegChunks;
    float z_lane[kDuelingRegChunks];
    dueling_z_lane(z_lane, z, in_regs && want_q, num_atoms, lane);
    for (int b = blockIdx.x * warps + warp; b < batch; b += gridDim.x * warps) {
        const int row0 = first_row + b * num_actions;  // the sample's first packed row
        const float* adv_b = adv + row0 * num_atoms;
        const float* v_b = v + b * num_atoms;
        if (in_regs) {
            const int offset = row0 * num_atoms;
            float* q_b = want_q ? q + row0 : nullptr;  // not dereferenced without want_q
            dueling_sample_regs_n(num_actions, v_b, adv_b, z_lane, logits + offset,
                                  logp + offset, q_b, want_q, num_atoms, lane);
            continue;
        }
        for (int j = lane; j < num_atoms; j += kWarp) {
            means[j] = dueling_mean(adv_b, j, num_actions, num_atoms);
        }
        for (int a = 0; a < num_actions;) {
            const int row = row0 + a;
            const int left = num_actions - a;
            const int offset = row * num_atoms;
            float* q_row = want_q ? q + row : nullptr;  // not dereferenced without want_q
            if (left >= 4) {
                dueling_row_group<4>(v_b, adv + offset, means, rows_s, z, logits + offset,
                                     logp + offset, q_row, want_q, num_atoms, lane);
                a += 4;
            } else if (left == 3) {
                dueling_row_group<3>(v_b, adv + offset, means, rows_s, z, logits + offset,
                                     logp + offset, q_row, want_q, num_atoms, lane);
                a += 3;
            } else if (left == 2) {
                dueling_row_group<2>(v_b, adv + offset, means, rows_s, z, logits + offset,
                                     logp + offset, q_row, want_q, num_atoms, lane);
                a += 2;
            } else {
                dueling_row_group<1>(v_b, adv + offset, means, rows_s, z, logits + offset,
                                     logp + offset, q_row, want_q, num_atoms, lane);
                a += 1;
            }
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
// Throughput: with at most DUEL_SUM_MAX_BRANCHES branches of at most DUEL_SUM_MAX_ACTIONS
// actions (the seed's (3, 3, 2); a grid-uniform test on the tables), the tables are read once
// per thread and a cell's every dlogits value is loaded (all in flight together) before the
// same operations run on them in the same order (dueling_sum_cell_regs); otherwise the loop
// above as written (dueling_backward_cell per branch). __launch_bounds__(1024) holds the
// register path to 64 registers (80 unbounded): 8 blocks of 128 threads per SM, no spills.
// --------------------------------------------------------------------------------------------
#define DUEL_SUM_MAX_BRANCHES 4
#define DUEL_SUM_MAX_ACTIONS 4

// One cell (b, j) of the register path: dueling_backward_cell's ops per branch (the action-order
// sum from x[0], the division by n_d, dadv = x - mean per action) and the branch-order sum of
// the dv_d from +0.0 (__fadd_rn), on the values loaded up front. start[d] = batch *
// action_offset[d] * num_atoms; 1 <= nd[d] <= DUEL_SUM_MAX_ACTIONS for d < n_branches.
static __device__ __forceinline__ float dueling_sum_cell_regs(
    const float* __restrict__ dlogits, float* __restrict__ dadv,
    const int (&nd)[DUEL_SUM_MAX_BRANCHES], const int (&start)[DUEL_SUM_MAX_BRANCHES],
    int n_branches, int b, int j, int num_atoms) {
    float x[DUEL_SUM_MAX_BRANCHES][DUEL_SUM_MAX_ACTIONS];
    int k0[DUEL_SUM_MAX_BRANCHES];  // element (b, 0, j) of branch d's block
#pragma unroll
    for (int d = 0; d < DUEL_SUM_MAX_BRANCHES; ++d) {
        k0[d] = start[d] + b * nd[d] * num_atoms + j;
#pragma unroll
        for (int a = 0; a < DUEL_SUM_MAX_ACTIONS; ++a) {
            x[d][a] = 0.0f;
            if (d < n_branches && a < nd[d]) {
                x[d][a] = dlogits[k0[d] + a * num_atoms];
            }
        }
    }
    float acc = 0.0f;
#pragma unroll
    for (int d = 0; d < DUEL_SUM_MAX_BRANCHES; ++d) {
        if (d < n_branches) {
            float sum = x[d][0];  // action_sum: x[base], then + x[base + a * NA] in order
#pragma unroll
            for (int a = 1; a < DUEL_SUM_MAX_ACTIONS; ++a) {
                if (a < nd[d]) {
                    sum = sum + x[d][a];
                }
            }
            const float mean = sum / static_cast<float>(nd[d]);
#pragma unroll
            for (int a = 0; a < DUEL_SUM_MAX_ACTIONS; ++a) {
                if (a < nd[d]) {
                    dadv[k0[d] + a * num_atoms] = x[d][a] - mean;
                }
            }
            acc = __fadd_rn(acc, sum);
        }
    }
    return acc;
}

extern "C" __global__ void __launch_bounds__(1024)  // at most 64 registers: no spills
dueling_combine_backward_sum_branches(
    const float* __restrict__ dlogits, const int* __restrict__ n_actions,
    const int* __restrict__ action_offset, float* __restrict__ dv, float* __restrict__ dadv,
    int batch, int num_atoms, int n_branches) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    const int cells = batch * num_atoms;
    const int stride = gridDim.x * blockDim.x;
    const int first = blockIdx.x * blockDim.x + threadIdx.x;
    // The register path's tables (grid-uniform: every thread reads the same entries).
    int nd[DUEL_SUM_MAX_BRANCHES], start[DUEL_SUM_MAX_BRANCHES];
    bool small = n_branches <= DUEL_SUM_MAX_BRANCHES;
#pragma unroll
    for (int d = 0; d < DUEL_SUM_MAX_BRANCHES; ++d) {
        nd[d] = 1;
        start[d] = 0;
        if (small && d < n_branches) {
            nd[d] = n_actions[d];
            start[d] = batch * action_offset[d] * num_atoms;
            small = small && nd[d] >= 1 && nd[d] <= DUEL_SUM_MAX_ACTIONS;
        }
    }
    if (small) {
        for (int cell = first; cell < cells; cell += stride) {
            const int b = cell / num_atoms;
            const int j = cell - b * num_atoms;
            dv[cell] = dueling_sum_cell_regs(dlogits, dadv, nd, start, n_branches, b, j,
                                             num_atoms);
        }
        return;
    }
    for (int cell = first; cell < cells; cell += stride) {
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
// cql_logit_grad's (cql_logit_grad_body in distributional.cuh: one warp per sample); its
// results do not depend on blockDim, so one block size serves every branch. Dynamic shared
// memory: (blockDim / 32) * max_d n_d floats.
// --------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(kCqlMaxWarps * kWarp)
cql_logit_grad_branches(const float* __restrict__ logp, const int* __restrict__ actions,
                        const float* __restrict__ z, const float* __restrict__ alpha,
                        const float* __restrict__ scale, const int* __restrict__ n_actions,
                        const int* __restrict__ action_offset, float* __restrict__ dlogits,
                        float* __restrict__ terms, int batch, int block_rows, int num_atoms) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
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
    fh_early_wait();  // early_launch.cuh: before anything is read or written
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
