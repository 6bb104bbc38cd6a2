// The training step's own kernels (foxhunt.fast: graph1_plan, graph2_plan, step_program), twins
// of foxhunt.reference.kernels.step under the same names: the step's ISV-driven bounds
// (step_bounds), Mech 10's clamp with its bound read from the ISV and its BF16 mirror
// (clamp_finite_isv), every branch's double-DQN choice and gathers (double_dqn_gather_branches),
// the scalar targets (scalar_target_q_branches), the TD errors' branch mean (branch_mean), the
// trunk gradient's sum and masks (h2_grad_sum_mask; with the auxiliary heads' d h2 added,
// h2_grad_sum_aux_mask), the step scalars (loss_scalars, step_scalars) and the merge of
// multi-range sentinel slots (merge_piece_flags). They do what the
// reference Trainer / loss_and_grads compute between kernels, in the same float32 order.
//
// Why they exist: the two step graphs are captured once, so values that change on the device
// from step to step (ISV-driven bounds, norms, Adam's step counter) must be read through
// pointers inside the graph; a kernel whose other twin takes such a value by value
// (clamp_finite's bound) gets a pointer-reading variant here.
//
// Arithmetic: -fmad=false (fast/_build.py) plus explicit __fmul_rn/__fadd_rn/__fdiv_rn where
// the order matters; selects and comparisons exactly as the reference writes them.

#include "early_launch.cuh"  // fh_early_wait, fh_early_release
#include "reduce.cuh"  // grad_norm_final's summation tree (the total norm), block_sum_halving
#include "distributional.cuh"  // double_dqn_argmax (the double-DQN choice, shared)
#include "bf16_bits.cuh"  // f32_to_bf16_bits, bf16_pair_bits (dense.f32_to_bf16's bit formula)
#include "flat.cuh"  // the vector paths' loop bounds and alignment tests
#include "ha_common.cuh"  // ha_is_finite, ha_clamp_finite, ha_guarded_axpy (shared elements)

#define STEP_THREADS 256
// Blocks of STEP_THREADS per SM the grid-shared flat kernels keep (__launch_bounds__: at most 32
// registers): the full wave population_engine.shared_grid_x assumes (2048 threads per SM).
#define STEP_MIN_BLOCKS 8

#define STEP_FLAT_LOOP(i, n)                                                               \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n);          \
         i += (long long)gridDim.x * blockDim.x)

// The vector paths of clamp_finite_isv and h2_grad_sum_mask are flat.cuh's: 4 elements per
// thread where every pointer is 16-byte aligned (8 bytes for a BF16 output), else a 32-bit
// scalar grid-stride loop; for n >= 2^31 STEP_FLAT_LOOP. Each element gets the same operations
// on every path, so the bits depend on neither path nor launch shape.

// safety.isv_bound: multiplier * fmaxf(isv, 1) (the floor on the signal; NaN counts as 1).
static __device__ __forceinline__ float step_isv_bound(float multiplier, float isv_value) {
    return __fmul_rn(multiplier, fmaxf(isv_value, 1.0f));
}

// optim.clip_scale: n = sqrtf(fmaxf(norm_sq, 0)); max_norm / n if n > max_norm and n > 0, else 1.
static __device__ __forceinline__ float step_clip_scale(float norm_sq, float max_norm) {
    const float n = __fsqrt_rn(fmaxf(norm_sq, 0.0f));
    return (n > max_norm && n > 0.0f) ? __fdiv_rn(max_norm, n) : 1.0f;
}

// float32 sum of x[0..n) by the whole block (thread-strided partials, then block_sum_halving).
static __device__ __forceinline__ float step_block_total(const float* x, int n) {
    float acc = -0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        acc = __fadd_rn(acc, x[i]);
    }
    return __fadd_rn(block_sum_halving(acc), 0.0f);  // an empty sum reads +0.0
}

// ---------------------------------------------------------------------------------------------
// step_bounds (graph 1, first kernel), ONE block of STEP_THREADS threads. From the ISV at the
// start of the step (Trainer.step reads these before anything changes the bus):
//   weight_clamp = weight_clamp_mult * max(ISV[Q_ABS_REF], 1)                          (Mech 9)
//   clip_bound   = min(max_grad_norm, anchor_mult * max(ISV[GRAD_NORM_SLOW_EMA], 1))   (Mech 6)
//   thresholds[k] = mult[k] * e (power 1) or mult[k] * (e * e) (power 2), e = max(ISV[idx[k]], 1);
//                   0 where idx[k] < 0 (sentinels.sentinel_thresholds; 0 = non-finite test only)
//   *adam_t += 1                                            (Trainer.step: self.adam_t += 1)
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void step_bounds(const float* __restrict__ isv,
                                              long long* __restrict__ adam_t,
                                              float* __restrict__ weight_clamp,
                                              float* __restrict__ clip_bound,
                                              const float* __restrict__ thr_mult,
                                              const int* __restrict__ thr_isv_index,
                                              const int* __restrict__ thr_power,
                                              float* __restrict__ thresholds, int n_thresholds,
                                              int q_abs_ref_index, int slow_ema_index,
                                              float weight_clamp_mult, float max_grad_norm,
                                              float anchor_mult) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    for (int k = threadIdx.x; k < n_thresholds; k += blockDim.x) {
        const int index = thr_isv_index[k];
        float value = 0.0f;
        if (index >= 0) {
            const float e = fmaxf(isv[index], 1.0f);
            const float base = thr_power[k] == 2 ? __fmul_rn(e, e) : e;
            value = __fmul_rn(thr_mult[k], base);
        }
        thresholds[k] = value;
    }
    if (threadIdx.x == 0) {
        *weight_clamp = step_isv_bound(weight_clamp_mult, isv[q_abs_ref_index]);
        *clip_bound = fminf(max_grad_norm, step_isv_bound(anchor_mult, isv[slow_ema_index]));
        *adam_t = *adam_t + 1;
    }
}

// ---------------------------------------------------------------------------------------------
// Mech 10 on the device bound: out = clamp_finite(x, mult * max(isv[index], 1)) (safety.clamp_finite
// with the bound read from the ISV slot H_S2_RMS_EMA inside the graph), and, when out_bf16 is not
// null, its BF16 copy (dense.f32_to_bf16) for the next BF16 GEMM. out may alias x (each element,
// or 4-element group, is read, then written, by one thread). Flat, 4 elements per thread where x
// and out are 16-byte and out_bf16 8-byte aligned (flat.cuh; plan_clamp_finite_isv).
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void clamp_finite_isv(const float* x, float* out,
                                          unsigned short* __restrict__ out_bf16, long long n,
                                          const float* __restrict__ isv, int index, float mult) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    const float bound = step_isv_bound(mult, isv[index]);
    if (!fh_flat_narrow(n)) {
        STEP_FLAT_LOOP(i, n) {
            const float c = ha_clamp_finite(x[i], bound);
            out[i] = c;
            if (out_bf16 != nullptr) {
                out_bf16[i] = f32_to_bf16_bits(c);
            }
        }
        return;
    }
    const unsigned int m = (unsigned int)n, first = fh_flat_first(), stride = fh_flat_stride();
    // A null out_bf16 passes its test (address 0).
    if (fh_aligned(x, 16) && fh_aligned(out, 16) && fh_aligned(out_bf16, 8)) {
        const float4* x4 = reinterpret_cast<const float4*>(x);
        float4* out4 = reinterpret_cast<float4*>(out);
        uint2* bf4 = reinterpret_cast<uint2*>(out_bf16);
        for (unsigned int g = first; g < m / 4; g += stride) {
            const float4 v = x4[g];
            const float4 c = make_float4(ha_clamp_finite(v.x, bound),
                                         ha_clamp_finite(v.y, bound),
                                         ha_clamp_finite(v.z, bound),
                                         ha_clamp_finite(v.w, bound));
            out4[g] = c;
            if (out_bf16 != nullptr) {
                bf4[g] = bf16_quad_bits(c);
            }
        }
        for (unsigned int i = fh_flat_tail(m, first); i < m; i += stride) {  // n % 4 left
            const float c = ha_clamp_finite(x[i], bound);
            out[i] = c;
            if (out_bf16 != nullptr) {
                out_bf16[i] = f32_to_bf16_bits(c);
            }
        }
    } else {
        for (unsigned int i = first; i < m; i += stride) {
            const float c = ha_clamp_finite(x[i], bound);
            out[i] = c;
            if (out_bf16 != nullptr) {
                out_bf16[i] = f32_to_bf16_bits(c);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Double-DQN choices and the gathers of loss_and_grads, every branch in one launch. Per branch d
// (n_actions[d] actions, action_offset[d] = sum of n_actions[e] for e < d):
//   a_star[d, b]    = double_dqn_select(q_online[d][batch + b, :])      (online(s2)'s Q rows)
//   p_next[d, b, j] = expf(logp_target[d][b, a_star[d, b], j])     (np.exp of the target's logp)
//   q_taken[d, b]   = q_online[d][b, actions[d, b]]        (expected_q(online.logp)[rows, a])
// logp_target[d] is [batch, A_d, NA] at element offset batch * NA * action_offset[d];
// q_online[d] is [q_rows, A_d] at offset q_rows * action_offset[d] (rows 0..batch online(s),
// batch..2 batch online(s2)); a_star and actions are [n_branches, batch]; p_next [n_branches,
// batch, NA]; q_taken [n_branches, batch]. The choice is double_dqn_select's own scan
// (double_dqn_argmax).
// Mapping: DDQN_ROW_THREADS consecutive threads of the grid per row (d, b) (grid-stride over the
// rows): each computes the row's indices (one 32-bit division) and its choice (a few compares;
// the group's loads of the Q row coincide), then gathers its atoms j = sub, sub + 16, ...
// (loads in flight together); sub 0 writes a_star, the group's last thread q_taken. A grid of
// fewer than DDQN_ROW_THREADS threads takes whole rows per thread. Every output element gets the
// same expression as before on any grid (expf of the same element; the same selected index), so
// the bits depend on neither the launch shape nor the mapping. 32-bit indices: every buffer
// holds fewer than 2^31 elements (MAX_ELEMENTS).
// ---------------------------------------------------------------------------------------------
#define DDQN_ROW_THREADS 16

extern "C" __global__ void double_dqn_gather_branches(const float* __restrict__ logp_target,
                                                    int* __restrict__ a_star,
                                                    const float* __restrict__ q_online,
                                                    const int* __restrict__ actions,
                                                    const int* __restrict__ n_actions,
                                                    const int* __restrict__ action_offset,
                                                    float* __restrict__ p_next,
                                                    float* __restrict__ q_taken,
                                                    int n_branches, int batch, int num_atoms,
                                                    int q_rows) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    const unsigned int threads = gridDim.x * blockDim.x;
    const unsigned int t = blockIdx.x * blockDim.x + threadIdx.x;
    // Threads per row: grid-uniform (the launch shape only).
    const unsigned int per_row = threads >= DDQN_ROW_THREADS ? DDQN_ROW_THREADS : 1u;
    const unsigned int groups = threads / per_row;
    const unsigned int sub = t % per_row;
    const unsigned int rows = (unsigned int)n_branches * (unsigned int)batch;
    for (unsigned int row = t / per_row; row < rows && t < groups * per_row; row += groups) {
        const int d = (int)(row / (unsigned int)batch);
        const int b = (int)(row - (unsigned int)d * (unsigned int)batch);
        const int na = n_actions[d];
        const int offset = action_offset[d];
        const float* q_d = q_online + q_rows * offset;
        const int a = double_dqn_argmax(q_d + (batch + b) * na, na);
        if (sub == 0 && num_atoms > 0) {
            a_star[row] = a;
        }
        if (sub == per_row - 1) {
            q_taken[row] = q_d[b * na + actions[row]];
        }
        const float* src = logp_target + (batch * offset + b * na + a) * num_atoms;
        float* dst = p_next + row * (unsigned int)num_atoms;
#pragma unroll 4  // the row's loads in flight together; each element on its own
        for (int j = (int)sub; j < num_atoms; j += (int)per_row) {
            dst[j] = expf(src[j]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The C51 chain's front in one launch: double_dqn_gather_branches, then per branch d
// c51_project_grad on its gathered p_next[d], then dueling_combine_backward_sum_branches on the
// logit gradients (the reference twin, foxhunt.reference.kernels.step, composes exactly these):
//   a_star[d, b], p_next[d, b, :], q_taken[d, b]   double_dqn_gather_branches' (above);
//   m[d, b, :], dlogits[d][b, :, :]                c51_project_grad(p_next[d], r, done, gamma[d],
//                                                  z, logp[d][0..batch], actions[d], isw, scale)
//                                                  (effective_gamma with the n-step arguments);
//   dv [batch, NA], dadv[d][b, :, :]               dueling_combine_backward_sum_branches(dlogits).
// logp[d] is online [s; s2]'s [q_rows, A_d, NA] block at element offset q_rows * NA *
// action_offset[d] (its rows 0..batch are read), dlogits[d] / dadv[d] the [batch, A_d, NA] block
// at batch * NA * action_offset[d]; m and p_next are [n_branches, batch, NA]; gamma [n_branches].
// Mapping: one block per sample b (grid-stride over blockIdx.x), blockDim (T, n_branches): the
// threads of threadIdx.y = d run branch d as c51_project_grad's block of T threads runs a sample
// (T whole warps, at most kProjectMaxThreads; thread x owns atoms x, x + T, ...), each group with
// its own two tiles of T floats of dynamic shared memory, then T floats per branch for the
// dueling sums (3 * T * n_branches floats in all). The projection's staging barrier is
// block-wide, so a sample is "windowed" (c51_project_sample) only when every branch's is: either
// path gives the same bits. Two paths (block-uniform):
// - one tile (NA <= T, the seed's shapes): thread x of group d keeps p_next[d, b, x] and its
//   taken gradient in registers (c51_project_tile), writes them, then computes the dueling
//   backward's branch-d terms of cell (b, x) from them (the values dueling_backward_cell would
//   load: the taken row's gradient, +0.0 in every other row), stages its branch sum in shared
//   memory; after a barrier group 0 adds the branch sums in branch order from +0.0 into dv[b, x];
// - several tiles: group d gathers p_next[d, b, :] into memory (each thread reads back only what
//   it wrote) and runs c51_project_sample; after a barrier (the sample's dlogits are written by
//   this block) the block's threads run the dueling backward's cells (b, j), j = thread, thread +
//   T * n_branches, ..., with dueling_backward_cell's ops per branch and the branch sum from
//   +0.0 (the sum kernel's ops), reading dlogits back.
// Every output element gets the expression of the kernel it comes from, so the outputs are
// bitwise those of the three launches. NaN/Inf: theirs. 32-bit indices (MAX_ELEMENTS).
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(1024) c51_gather_project_dueling_branches(
    const float* __restrict__ logp_target, const float* __restrict__ q_online,
    const int* __restrict__ actions, const int* __restrict__ n_actions,
    const int* __restrict__ action_offset, const float* __restrict__ logp,
    const float* __restrict__ r, const float* __restrict__ done, const float* __restrict__ gamma,
    const float* __restrict__ z, const float* __restrict__ isw, const float* __restrict__ scale,
    const float* __restrict__ discount, int* __restrict__ a_star, float* __restrict__ p_next,
    float* __restrict__ q_taken, float* __restrict__ m, float* __restrict__ dlogits,
    float* __restrict__ dv, float* __restrict__ dadv, int n_branches, int batch, int num_atoms,
    int q_rows, float v_min, float v_max, float dz, float gamma_ref, int n_step_on) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    extern __shared__ float c51_tiles[];
    const int d = threadIdx.y;
    const int tile = blockDim.x;
    float* tile_target = c51_tiles + 2 * tile * d;
    float* tile_p = tile_target + tile;
    const int na = n_actions[d];
    const int offset = action_offset[d];
    const int row_len = na * num_atoms;
    const float* q_d = q_online + q_rows * offset;
    const float* logp_target_d = logp_target + batch * offset * num_atoms;
    const float* logp_d = logp + q_rows * offset * num_atoms;
    float* dlogits_d = dlogits + batch * offset * num_atoms;
    const float gamma_d = gamma[d];
    const float grad_scale = scale[0];
    const int block_threads = tile * blockDim.y;
    const int flat = threadIdx.y * tile + threadIdx.x;
    float* sums = c51_tiles + 2 * tile * blockDim.y;  // one-tile path: [n_branches, tile]
    const bool one_tile = num_atoms <= tile;  // block-uniform
    float z_i = 0.0f, z_next = 0.0f;  // the one-tile path's atom (every sample's)
    if (one_tile) {
        c51_z_pair(z, num_atoms, z_i, z_next);
    }
    for (int b = blockIdx.x; b < batch; b += gridDim.x) {
        const int row = d * batch + b;
        // The sample's loads that do not wait for the double-DQN choice, issued first.
        const int action = actions[row];
        const float r_b = r[b];
        const float done_b = done[b];
        const float isw_b = isw[b];
        // double_dqn_gather_branches' row (d, b)
        const int a = double_dqn_argmax(q_d + (batch + b) * na, na);
        if (threadIdx.x == 0) {
            if (num_atoms > 0) {
                a_star[row] = a;
            }
            q_taken[row] = q_d[b * na + action];
        }
        const float* src = logp_target_d + (b * na + a) * num_atoms;
        float* p_row = p_next + row * num_atoms;
        // c51_project_grad_body's sample b of branch d
        const bool taken = action >= 0 && action < na;
        const int taken_lo = taken ? action * num_atoms : row_len;
        const int taken_hi = taken ? taken_lo + num_atoms : row_len;
        float* sample_dlogits = dlogits_d + b * row_len;
        for (int k = threadIdx.x; k < row_len; k += tile) {
            if (k < taken_lo || k >= taken_hi) {
                sample_dlogits[k] = 0.0f;
            }
        }
        const float gamma_b = effective_gamma(gamma_d, discount, b, gamma_ref, n_step_on);
        const float step_discount = __fmul_rn(gamma_b, __fsub_rn(1.0f, done_b));
        const float grad_weight = isw_b * grad_scale;
        if (one_tile) {
            // c51_project_sample's one-tile path with p_i and the gradient kept in registers;
            // the dueling backward's branch terms from them (the rows not taken hold +0.0).
            const int i = threadIdx.x;
            const bool own = i < num_atoms;
            const float p_i = own ? expf(src[i]) : 0.0f;
            const float p_taken = (taken && own) ? expf(logp_d[b * row_len + taken_lo + i]) : 0.0f;
            const float m_i = c51_project_tile(p_i, r_b, step_discount, z_i, z_next, num_atoms,
                                               v_min, v_max, dz, tile_target, tile_p);
            if (own) {
                p_row[i] = p_i;
                m[row * num_atoms + i] = m_i;
                const float grad = grad_weight * (p_taken - m_i);
                if (taken) {
                    sample_dlogits[taken_lo + i] = grad;
                }
                float sum = (taken && action == 0) ? grad : 0.0f;  // x[a] of dueling_backward_cell
                for (int k = 1; k < na; ++k) {
                    sum = sum + ((taken && action == k) ? grad : 0.0f);
                }
                const float mean = sum / static_cast<float>(na);
                float* dadv_cell = dadv + batch * offset * num_atoms + b * row_len + i;
                for (int k = 0; k < na; ++k) {
                    dadv_cell[k * num_atoms] = ((taken && action == k) ? grad : 0.0f) - mean;
                }
                sums[tile * d + i] = sum;
            }
            __syncthreads();  // every branch's sum of sample b is staged
            if (d == 0 && own) {
                float acc = 0.0f;
                for (int e = 0; e < n_branches; ++e) {
                    acc = __fadd_rn(acc, sums[tile * e + i]);
                }
                dv[b * num_atoms + i] = acc;
            }
            continue;  // sums is rewritten only after the next sample's staging barriers
        }
        for (int j = threadIdx.x; j < num_atoms; j += tile) {
            p_row[j] = expf(src[j]);  // read back below by this thread only
        }
        c51_project_sample(p_row, r_b, step_discount, z, m + row * num_atoms,
                           logp_d + b * row_len + taken_lo, grad_weight,
                           taken ? sample_dlogits + taken_lo : nullptr, num_atoms, v_min, v_max,
                           dz, tile_target, tile_p);
        __syncthreads();  // sample b's dlogits are written (global memory, this block)
        // dueling_combine_backward_sum_branches' cells (b, j): per branch e dueling_backward_cell's
        // ops (the action-order sum from x[0], / n_e, x - mean), the branch sum from +0.0. The
        // reads go through dlogits itself (written above by this block: coherent plain loads).
        for (int j = flat; j < num_atoms; j += block_threads) {
            float acc = 0.0f;
            for (int e = 0; e < n_branches; ++e) {
                const int ne = n_actions[e];
                const int cell = batch * action_offset[e] * num_atoms + b * ne * num_atoms + j;
                const float* x = dlogits + cell;
                float* y = dadv + cell;
                float sum = x[0];
                for (int k = 1; k < ne; ++k) {
                    sum = sum + x[k * num_atoms];
                }
                const float mean = sum / static_cast<float>(ne);
                for (int k = 0; k < ne; ++k) {
                    y[k * num_atoms] = x[k * num_atoms] - mean;
                }
                acc = __fadd_rn(acc, sum);
            }
            dv[b * num_atoms + j] = acc;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Scalar targets of loss_and_grads (before Mech 1, which target_q_clip applies in place next):
//   target_q[d, b] = r[b] + (g * (1 - done[b])) * e,  e = sum_j p_next[d, b, j] * z[j]
// (the reference's `r + gamma * (1 - done) * (p_next @ z)`, left to right; the dot in atom
// order, from +0), g = effective_gamma(gamma[d], discount, b, gamma_ref, n_step_on) (n-step
// transitions; gamma[d] when n_step_on == 0: discount not read).
// Mapping: STQ_GROUP = 16 lanes per row (d, b), the 2 groups of a warp on 2 consecutive rows (a
// warp-uniform grid-stride loop over the rows, 2 per warp per step). Lane sub of a group loads
// the row's atoms j = sub, sub + 16, ... (STQ_BATCH per lane in flight, with the row's r, done,
// gamma and discount: 16 lanes read 64 contiguous bytes) and forms p * z; then every lane of
// the group adds the products in atom order, j = 0, 1, ... (product j from lane j % 16 by a
// width-16 shuffle): the same products and the same sequential sum as one thread's loop, so the
// bits depend on neither the mapping nor the grid (grid-independent), but a row's loads are one
// round trip per 16 * STQ_BATCH atoms (the seed's 51: one), not one per 8 atoms of one thread.
// Lane 0 of the group writes the target. blockDim.x: a multiple of 32 (a partial last warp
// does nothing); __launch_bounds__: 32 registers, no spills (plain and member builds).
// 32-bit indices (MAX_ELEMENTS).
// ---------------------------------------------------------------------------------------------
#define STQ_GROUP 16
#define STQ_BATCH 4

extern "C" __global__ void __launch_bounds__(STEP_THREADS, STEP_MIN_BLOCKS)
scalar_target_q_branches(const float* __restrict__ p_next, const float* __restrict__ z,
                         const float* __restrict__ r, const float* __restrict__ done,
                         const float* __restrict__ gamma, const float* __restrict__ discount,
                         float* __restrict__ target_q, int n_branches, int batch, int num_atoms,
                         float gamma_ref, int n_step_on) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    const unsigned int warps = blockDim.x / 32u;
    const unsigned int warp = threadIdx.x / 32u;
    if (warp >= warps) {
        return;  // a partial last warp (never planned)
    }
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int sub = lane & (STQ_GROUP - 1u);
    const unsigned int rows_per_warp = 32u / STQ_GROUP;  // 2
    const unsigned int n = (unsigned int)n_branches * (unsigned int)batch;
    const unsigned int na = (unsigned int)num_atoms;
    const unsigned int stride = gridDim.x * warps * rows_per_warp;
    for (unsigned int first = (blockIdx.x * warps + warp) * rows_per_warp; first < n;
         first += stride) {  // warp-uniform: the shuffles see every lane
        const unsigned int i = first + lane / STQ_GROUP;
        const bool valid = i < n;
        const unsigned int d = valid ? i / (unsigned int)batch : 0u;
        const unsigned int b = valid ? i - d * (unsigned int)batch : 0u;
        // The row's scalars (its group's lanes read the same addresses), in flight with its atoms.
        float r_b = 0.0f, done_b = 0.0f, gamma_d = 0.0f, discount_b = 0.0f;
        if (valid) {
            r_b = r[b];
            done_b = done[b];
            gamma_d = gamma[d];
            if (n_step_on != 0) {
                discount_b = discount[b];  // effective_gamma's read (null when n_step_on == 0)
            }
        }
        const float* p = p_next + i * na;
        float e = 0.0f;
        for (unsigned int base = 0; base < na; base += STQ_GROUP * STQ_BATCH) {  // warp-uniform
            const unsigned int left = na - base;
            float prod[STQ_BATCH], zk[STQ_BATCH];
#pragma unroll
            for (int k = 0; k < STQ_BATCH; ++k) {  // every load first, then the products
                const unsigned int j = k * STQ_GROUP + sub;  // relative to base
                prod[k] = 0.0f;
                zk[k] = 0.0f;
                if (valid && j < left) {
                    prod[k] = p[base + j];
                    zk[k] = z[base + j];
                }
            }
#pragma unroll
            for (int k = 0; k < STQ_BATCH; ++k) {
                prod[k] = __fmul_rn(prod[k], zk[k]);  // p * z (0 * 0 off the row: never added)
            }
#pragma unroll
            for (int k = 0; k < STQ_BATCH; ++k) {
                if ((unsigned int)(k * STQ_GROUP) >= left) {
                    break;  // warp-uniform
                }
#pragma unroll
                for (int q = 0; q < STQ_GROUP; ++q) {
                    const float v = __shfl_sync(0xffffffffu, prod[k], q, STQ_GROUP);
                    if ((unsigned int)(k * STQ_GROUP + q) < left) {  // warp-uniform
                        e = __fadd_rn(e, v);
                    }
                }
            }
        }
        if (valid && sub == 0) {
            const float gamma_b = effective_gamma(gamma_d, &discount_b, 0, gamma_ref, n_step_on);
            const float step_discount = __fmul_rn(gamma_b, __fsub_rn(1.0f, done_b));
            target_q[i] = __fadd_rn(r_b, __fmul_rn(step_discount, e));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Sum over branches: out[i] = ((0 + parts[0][i] / divisor) + parts[1][i] / divisor) + ...
// (the reference's `td = td + ce / nb` from zeros, divisor = n_branches; a divisor of 1 is
// exact, x / 1 == x). parts[d] at d * part_stride. Flat.
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void branch_mean(const float* __restrict__ parts,
                                           float* __restrict__ out, long long n, int n_branches,
                                           long long part_stride, float divisor) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    STEP_FLAT_LOOP(i, n) {
        float acc = 0.0f;
        for (int d = 0; d < n_branches; ++d) {
            acc = __fadd_rn(acc, __fdiv_rn(parts[d * part_stride + i], divisor));
        }
        out[i] = acc;
    }
}

// ---------------------------------------------------------------------------------------------
// Backward through Mech 10's clamp and the trunk ReLU (network.backward), after summing the
// heads' parts of dh2 in the reference's order (`dh2 = dh2 + part` from zeros):
//   sum = ((0 + parts[0][i]) + parts[1][i]) + ...   (parts[k] at k * part_stride)
//   dh2_out[i] = sum                      (the trunk gradient the sentinel slot 33 checks)
//   passed = (h2 == h2_pre) ? sum : 0     (the clamp passed the value through unchanged)
//   out = (h2_pre <= 0) ? 0 : passed      (dense.relu_mask with the pre-clamp activation)
// Flat, [B, SH2]; 4 elements per thread (each summed on its own, parts in order k = 0, 1, ...
// from +0) where parts, h2, h2_pre, dh2_out and out are 16-byte aligned and part_stride is a
// multiple of 4 (or n_parts <= 1), else one (flat.cuh; plan_h2_grad_sum_mask). A single part
// (the trunk's IQN and ensemble copies, the sum after the auxiliary SAXPY) has its own loop
// with its three loads in flight together. Grid-stride, elementwise: the bits depend on no
// launch dimension.
// __launch_bounds__(.., STEP_MIN_BLOCKS): 32 registers, so 8 blocks of 256 threads fit an SM
// (with 40 registers only 6 did, and a population's shared grid of one full wave then ran a
// second, partial wave).
// ---------------------------------------------------------------------------------------------
// One element: parts[k * part_stride + i] summed for k = 0 .. n_parts - 1 (p = parts + i).
static __device__ __forceinline__ float step_parts_sum(const float* __restrict__ p, int n_parts,
                                                      long long part_stride) {
    float sum = 0.0f;
#pragma unroll 4  // loads in flight together; the sum stays in part order
    for (int k = 0; k < n_parts; ++k) {
        sum = __fadd_rn(sum, p[k * part_stride]);
    }
    return sum;
}

// Four elements' sums at once: p[k * stride4] (float4 groups) summed for k = 0 .. n_parts - 1,
// each element on its own from +0, parts in order (the vector paths' step_parts_sum).
static __device__ __forceinline__ float4 step_parts_sum4(const float4* __restrict__ p, int n_parts,
                                                        unsigned int stride4) {
    float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 4  // loads in flight together; each element's sum stays in part order
    for (int k = 0; k < n_parts; ++k) {
        const float4 v = *p;
        p += stride4;
        sum.x = __fadd_rn(sum.x, v.x);
        sum.y = __fadd_rn(sum.y, v.y);
        sum.z = __fadd_rn(sum.z, v.z);
        sum.w = __fadd_rn(sum.w, v.w);
    }
    return sum;
}

extern "C" __global__ void __launch_bounds__(STEP_THREADS, STEP_MIN_BLOCKS)
h2_grad_sum_mask(const float* __restrict__ parts, int n_parts, long long part_stride,
                                             const float* __restrict__ h2,
                                             const float* __restrict__ h2_pre,
                                             float* __restrict__ dh2_out,
                                             float* __restrict__ out, long long n) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    if (!fh_flat_narrow(n)) {
        STEP_FLAT_LOOP(i, n) {
            const float sum = step_parts_sum(parts + i, n_parts, part_stride);
            dh2_out[i] = sum;
            out[i] = ha_h2_mask(sum, h2[i], h2_pre[i]);
        }
        return;
    }
    const unsigned int m = (unsigned int)n, first = fh_flat_first(), stride = fh_flat_stride();
    if (fh_aligned(parts, 16) && (n_parts <= 1 || (part_stride & 3) == 0) &&
        fh_aligned(h2, 16) && fh_aligned(h2_pre, 16) && fh_aligned(dh2_out, 16) &&
        fh_aligned(out, 16)) {
        const float4* __restrict__ parts4 = reinterpret_cast<const float4*>(parts);
        const float4* __restrict__ h2_4 = reinterpret_cast<const float4*>(h2);
        const float4* __restrict__ pre4 = reinterpret_cast<const float4*>(h2_pre);
        float4* __restrict__ dh2_4 = reinterpret_cast<float4*>(dh2_out);
        float4* __restrict__ out4 = reinterpret_cast<float4*>(out);
        if (n_parts == 1) {  // the trunk's copies: the part, h2 and h2_pre in flight together
            for (unsigned int g = first; g < m / 4; g += stride) {
                const float4 v = parts4[g];
                const float4 h = h2_4[g];
                const float4 pre = pre4[g];
                const float4 sum = make_float4(__fadd_rn(0.0f, v.x), __fadd_rn(0.0f, v.y),
                                               __fadd_rn(0.0f, v.z), __fadd_rn(0.0f, v.w));
                dh2_4[g] = sum;
                out4[g] = make_float4(ha_h2_mask(sum.x, h.x, pre.x),
                                      ha_h2_mask(sum.y, h.y, pre.y),
                                      ha_h2_mask(sum.z, h.z, pre.z),
                                      ha_h2_mask(sum.w, h.w, pre.w));
            }
        } else {
            // The parts first (unrolled: loads in flight together), then h2 and h2_pre: within
            // 32 registers without spills (the parts' addresses step by a 32-bit stride).
            const unsigned int stride4 = (unsigned int)(part_stride / 4);  // exact here
            for (unsigned int g = first; g < m / 4; g += stride) {
                const float4 sum = step_parts_sum4(parts4 + g, n_parts, stride4);
                const float4 h = h2_4[g];
                const float4 pre = pre4[g];
                dh2_4[g] = sum;
                out4[g] = make_float4(ha_h2_mask(sum.x, h.x, pre.x),
                                      ha_h2_mask(sum.y, h.y, pre.y),
                                      ha_h2_mask(sum.z, h.z, pre.z),
                                      ha_h2_mask(sum.w, h.w, pre.w));
            }
        }
        for (unsigned int i = fh_flat_tail(m, first); i < m; i += stride) {  // n % 4 left
            const float sum = step_parts_sum(parts + i, n_parts, part_stride);
            dh2_out[i] = sum;
            out[i] = ha_h2_mask(sum, h2[i], h2_pre[i]);
        }
    } else {
        for (unsigned int i = first; i < m; i += stride) {
            const float sum = step_parts_sum(parts + i, n_parts, part_stride);
            dh2_out[i] = sum;
            out[i] = ha_h2_mask(sum, h2[i], h2_pre[i]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The C51 trunk gradient with the auxiliary heads on, in one launch: the six launches the step
// ran for it fused (h2_grad_sum_mask of the heads' parts, on the trunk and again beside it for
// slot 33; the two auxiliary heads' guarded sum, clamp_finite with a bound of +Inf then saxpy;
// the saxpy of that sum into the heads' sum; h2_grad_sum_mask of the one part the result is).
// The reference twin,
// foxhunt.reference.kernels.step.h2_grad_sum_aux_mask, is their composition:
//   main = ((0 + parts[0][i]) + parts[1][i]) + ...        dh2_main[i] = main   (slot 33's)
//   a    = aux_b ? add(isfinite(aux_a[i]) ? aux_a[i] : 0, aux_b[i]) : aux_a[i]
//   y    = add(main, a)                                   dh2[i] = y           (slot 34's)
//   out[i] = ha_h2_mask(0 + y, h2[i], h2_pre[i])        (the masks of the one part y)
// add(y, x) = ha_guarded_axpy(y, x, 1), optim.cu's saxpy element with a = 1; clamp_finite with a
// bound of +Inf is its finite map alone. aux_b null: one auxiliary head (its d h2 is added as it
// is). NaN contract: the composition's: a NaN part reaches dh2_main, dh2 and (unless masked)
// out; a non-finite auxiliary value never reaches dh2; a NaN h2_pre masks to 0.
// Flat, [B, SH2]; 4 elements per thread where every pointer is 16-byte aligned and part_stride a
// multiple of 4 (or n_parts <= 1), else one (flat.cuh; plan_h2_grad_sum_aux_mask); every path
// gives each element the same operations, so the bits depend on neither path nor launch shape.
// No minimum of blocks per SM in __launch_bounds__: ten pointers and a float4 sum do not fit 32
// registers (a single trainer's kernel, not in population_engine.GRID_SHARED_KERNELS).
// ---------------------------------------------------------------------------------------------
// y = add(main, a) of one element (b read only with two heads).
static __device__ __forceinline__ float step_aux_sum(float main, float a, float b, bool two) {
    const float total = two ? ha_guarded_axpy(ha_is_finite(a) ? a : 0.0f, b, 1.0f) : a;
    return ha_guarded_axpy(main, total, 1.0f);
}

// One element on the scalar paths (Index: the 64-bit loop's or the 32-bit one's).
template <typename Index>
static __device__ __forceinline__ void step_aux_mask_one(
    Index i, const float* __restrict__ parts, int n_parts, long long part_stride,
    const float* __restrict__ aux_a, const float* __restrict__ aux_b,
    const float* __restrict__ h2, const float* __restrict__ h2_pre,
    float* __restrict__ dh2_main, float* __restrict__ dh2, float* __restrict__ out) {
    const bool two = aux_b != nullptr;
    const float main = step_parts_sum(parts + i, n_parts, part_stride);
    dh2_main[i] = main;
    const float y = step_aux_sum(main, aux_a[i], two ? aux_b[i] : 0.0f, two);
    dh2[i] = y;
    out[i] = ha_h2_mask(__fadd_rn(0.0f, y), h2[i], h2_pre[i]);
}

extern "C" __global__ void __launch_bounds__(STEP_THREADS)
h2_grad_sum_aux_mask(const float* __restrict__ parts, int n_parts, long long part_stride,
                     const float* __restrict__ aux_a, const float* __restrict__ aux_b,
                     const float* __restrict__ h2, const float* __restrict__ h2_pre,
                     float* __restrict__ dh2_main, float* __restrict__ dh2,
                     float* __restrict__ out, long long n) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    if (!fh_flat_narrow(n)) {
        STEP_FLAT_LOOP(i, n) {
            step_aux_mask_one(i, parts, n_parts, part_stride, aux_a, aux_b, h2, h2_pre, dh2_main,
                              dh2, out);
        }
        return;
    }
    const unsigned int m = (unsigned int)n, first = fh_flat_first(), stride = fh_flat_stride();
    if (fh_aligned(parts, 16) && (n_parts <= 1 || (part_stride & 3) == 0) &&
        fh_aligned(aux_a, 16) && fh_aligned(aux_b, 16) && fh_aligned(h2, 16) &&
        fh_aligned(h2_pre, 16) && fh_aligned(dh2_main, 16) && fh_aligned(dh2, 16) &&
        fh_aligned(out, 16)) {
        const bool two = aux_b != nullptr;
        const unsigned int stride4 = (unsigned int)(part_stride / 4);  // exact here
        const float4* __restrict__ parts4 = reinterpret_cast<const float4*>(parts);
        const float4* __restrict__ a4 = reinterpret_cast<const float4*>(aux_a);
        const float4* __restrict__ b4 = reinterpret_cast<const float4*>(aux_b);
        const float4* __restrict__ h2_4 = reinterpret_cast<const float4*>(h2);
        const float4* __restrict__ pre4 = reinterpret_cast<const float4*>(h2_pre);
        for (unsigned int g = first; g < m / 4; g += stride) {
            const float4 main = step_parts_sum4(parts4 + g, n_parts, stride4);
            reinterpret_cast<float4*>(dh2_main)[g] = main;
            const float4 a = a4[g];
            const float4 b = two ? b4[g] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            const float4 y = make_float4(step_aux_sum(main.x, a.x, b.x, two),
                                         step_aux_sum(main.y, a.y, b.y, two),
                                         step_aux_sum(main.z, a.z, b.z, two),
                                         step_aux_sum(main.w, a.w, b.w, two));
            reinterpret_cast<float4*>(dh2)[g] = y;
            const float4 h = h2_4[g];
            const float4 pre = pre4[g];
            reinterpret_cast<float4*>(out)[g] =
                make_float4(ha_h2_mask(__fadd_rn(0.0f, y.x), h.x, pre.x),
                            ha_h2_mask(__fadd_rn(0.0f, y.y), h.y, pre.y),
                            ha_h2_mask(__fadd_rn(0.0f, y.z), h.z, pre.z),
                            ha_h2_mask(__fadd_rn(0.0f, y.w), h.w, pre.w));
        }
        for (unsigned int i = fh_flat_tail(m, first); i < m; i += stride) {  // n % 4 left
            step_aux_mask_one(i, parts, n_parts, part_stride, aux_a, aux_b, h2, h2_pre, dh2_main,
                              dh2, out);
        }
    } else {
        for (unsigned int i = first; i < m; i += stride) {
            step_aux_mask_one(i, parts, n_parts, part_stride, aux_a, aux_b, h2, h2_pre, dh2_main,
                              dh2, out);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// An auxiliary trunk's guarded d h2 and its masks in one launch (the IQN and ensemble trunks:
// fast.wave_plan's _guard, clamp_finite with the ISV-driven guard bound, then h2_grad_sum_mask
// of the one part it wrote). The reference twin, foxhunt.reference.kernels.step.h2_guard_mask,
// is their composition:
//   m = multiplier * fmaxf(*signal, 1)                 (clamp_finite's bound, step_isv_bound)
//   g = isfinite(x[i]) ? clip(x[i], -m, m) : 0         (safety.cu's clamp_finite element)
//   dh2_out[i] = 0 + g;  out[i] = ha_h2_mask(0 + g, h2[i], h2_pre[i])
// NaN contract: the composition's: a non-finite x gives 0 in dh2_out (and out); a NaN h2_pre
// masks to 0; the bound as clamp_finite's (a NaN signal counts as 1, +Inf clamps nothing).
// Flat, [B, SH2]; 4 elements per thread where every pointer is 16-byte aligned, else one
// (flat.cuh; plan_h2_guard_mask); the same operations per element on every path.
// ---------------------------------------------------------------------------------------------
// One element on the scalar paths (Index: the 64-bit loop's or the 32-bit one's).
template <typename Index>
static __device__ __forceinline__ void step_guard_mask_one(
    Index i, const float* __restrict__ x, const float* __restrict__ h2,
    const float* __restrict__ h2_pre, float m, float* __restrict__ dh2_out,
    float* __restrict__ out) {
    const float s = __fadd_rn(0.0f, ha_clamp_finite(x[i], m));
    dh2_out[i] = s;
    out[i] = ha_h2_mask(s, h2[i], h2_pre[i]);
}

static __device__ __forceinline__ void step_guard_mask4(float4 x, float4 h, float4 pre, float m,
                                                        float4* __restrict__ dh2,
                                                        float4* __restrict__ out) {
    const float4 s = make_float4(__fadd_rn(0.0f, ha_clamp_finite(x.x, m)),
                                 __fadd_rn(0.0f, ha_clamp_finite(x.y, m)),
                                 __fadd_rn(0.0f, ha_clamp_finite(x.z, m)),
                                 __fadd_rn(0.0f, ha_clamp_finite(x.w, m)));
    *dh2 = s;
    *out = make_float4(ha_h2_mask(s.x, h.x, pre.x), ha_h2_mask(s.y, h.y, pre.y),
                       ha_h2_mask(s.z, h.z, pre.z), ha_h2_mask(s.w, h.w, pre.w));
}

extern "C" __global__ void __launch_bounds__(STEP_THREADS, STEP_MIN_BLOCKS)
h2_guard_mask(const float* __restrict__ x, const float* __restrict__ h2,
              const float* __restrict__ h2_pre, float* __restrict__ dh2_out,
              float* __restrict__ out, long long n, float multiplier,
              const float* __restrict__ signal) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    const float m = step_isv_bound(multiplier, *signal);
    if (!fh_flat_narrow(n)) {
        STEP_FLAT_LOOP(i, n) {
            step_guard_mask_one(i, x, h2, h2_pre, m, dh2_out, out);
        }
        return;
    }
    const unsigned int count = (unsigned int)n, first = fh_flat_first(), stride = fh_flat_stride();
    if (fh_aligned(x, 16) && fh_aligned(h2, 16) && fh_aligned(h2_pre, 16) &&
        fh_aligned(dh2_out, 16) && fh_aligned(out, 16)) {
        const float4* __restrict__ x4 = reinterpret_cast<const float4*>(x);
        const float4* __restrict__ h2_4 = reinterpret_cast<const float4*>(h2);
        const float4* __restrict__ pre4 = reinterpret_cast<const float4*>(h2_pre);
        for (unsigned int g = first; g < count / 4; g += stride) {  // three loads in flight
            step_guard_mask4(x4[g], h2_4[g], pre4[g], m, reinterpret_cast<float4*>(dh2_out) + g,
                             reinterpret_cast<float4*>(out) + g);
        }
        for (unsigned int i = fh_flat_tail(count, first); i < count; i += stride) {
            step_guard_mask_one(i, x, h2, h2_pre, m, dh2_out, out);
        }
    } else {
        for (unsigned int i = first; i < count; i += stride) {
            step_guard_mask_one(i, x, h2, h2_pre, m, dh2_out, out);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Step scalars, in two kernels so that the block reductions are off the critical path. In the
// reference's float32 order (trainer.py, step.py, budgets.py):
//   c51_loss = ((0 + c51_total[0]) + c51_total[1]) + ...
//   cql_loss = ((0 + (alpha * mean(terms[0])) / nb) + (alpha * mean(terms[1])) / nb) + ...
//   loss = c51_loss + cql_loss
//   c51_pre = sqrtf(max(c51_sq, 0)), c51_post = c51_pre * clip_scale(c51_sq, budget_c51); cql alike
//   grad_norm = sqrtf(max(total_sq, 0)); safety_scale = clip_scale(total_sq, clip_bound)
//   fired = grad_norm > clip_bound
//   mean_q = sum(q_taken) / count, mean_target_q = sum(target_q) / count
//   ISV[slow] = isfinite(grad_norm) ? (1 - a) * slow + a * grad_norm : slow  (budgets.slow_ema_update)
// readback[] receives (loss, c51_loss, cql_loss, grad_norm, c51_pre, c51_post, cql_pre, cql_post,
// clip_bound, fired, mean_q, mean_target_q) in that order (foxhunt.reference.backend.READBACK_FIELDS).
//
// loss_scalars (ONE block of STEP_THREADS threads; as soon as the losses, CQL terms and
// scalar targets exist) writes readback[1], [2], [10], [11]; step_scalars (beside graph 2's Adam,
// adam_update_norm, which computes safety_scale itself with the same bits; at graph 1's end where
// an injected source is on: fast/graph2_plan.py scalars_beside_adam) first sums
// the total norm's phase-1 partials into *total_sq exactly as grad_norm_final does (same code,
// launched with grad_norm_final's block size, so the same bits), then one thread reads
// readback[1] and [2] and writes the rest.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void loss_scalars_body(const float* __restrict__ c51_total,
                                                  const float* __restrict__ terms,
                                                  const float* __restrict__ q_taken,
                                                  const float* __restrict__ target_q,
                                                  float* __restrict__ readback, int n_branches,
                                                  int batch, float alpha) {
    float cql = 0.0f;
    for (int d = 0; d < n_branches; ++d) {
        const float sum = step_block_total(terms + (long long)d * batch, batch);
        const float mean = __fdiv_rn(sum, (float)batch);
        cql = __fadd_rn(cql, __fdiv_rn(__fmul_rn(alpha, mean), (float)n_branches));
    }
    const int count = n_branches * batch;
    const float mean_q = __fdiv_rn(step_block_total(q_taken, count), (float)count);
    const float mean_target_q = __fdiv_rn(step_block_total(target_q, count), (float)count);
    if (threadIdx.x != 0) {
        return;
    }
    float c51 = 0.0f;
    for (int d = 0; d < n_branches; ++d) {
        c51 = __fadd_rn(c51, c51_total[d]);
    }
    readback[1] = c51;
    readback[2] = cql;
    readback[10] = mean_q;
    readback[11] = mean_target_q;
}

extern "C" __global__ void __launch_bounds__(STEP_THREADS)
loss_scalars(const float* __restrict__ c51_total, const float* __restrict__ terms,
                  const float* __restrict__ q_taken, const float* __restrict__ target_q,
                  float* __restrict__ readback, int n_branches, int batch, float alpha) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    loss_scalars_body(c51_total, terms, q_taken, target_q, readback, n_branches, batch, alpha);
}

// loss_scalars_ptr: loss_scalars with the CQL coefficient read from device memory (*alpha,
// the CQL-alpha ramp's ISV slot copied at graph 1's start), so no host value enters the step.
extern "C" __global__ void __launch_bounds__(STEP_THREADS)
loss_scalars_ptr(const float* __restrict__ c51_total, const float* __restrict__ terms,
                 const float* __restrict__ q_taken, const float* __restrict__ target_q,
                 float* __restrict__ readback, int n_branches, int batch,
                 const float* __restrict__ alpha) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    loss_scalars_body(c51_total, terms, q_taken, target_q, readback, n_branches, batch, *alpha);
}

extern "C" __global__ void step_scalars(const float* __restrict__ total_partials,
                                             long long n_partials, float* __restrict__ total_sq,
                                             const float* __restrict__ c51_sq,
                                             const float* __restrict__ cql_sq,
                                             const float* __restrict__ clip_bound,
                                             float* __restrict__ isv,
                                             float* __restrict__ safety_scale,
                                             float* __restrict__ readback, float budget_c51,
                                             float budget_cql, int slow_ema_index,
                                             float slow_alpha) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    fh_early_release();
    __shared__ float scratch[REDUCE_WARP + 1];
    // Thread 0 reads its scalars before the reduction, so their loads overlap it.
    float c51 = 0.0f, cql = 0.0f, bound = 0.0f, loss_c51 = 0.0f, loss_cql = 0.0f, slow = 0.0f;
    const bool writer = blockIdx.x == 0 && threadIdx.x == 0;
    if (writer) {
        c51 = *c51_sq;
        cql = *cql_sq;
        bound = *clip_bound;
        loss_c51 = readback[1];
        loss_cql = readback[2];
        slow = isv[slow_ema_index];
    }
    const float partial = thread_partial(total_partials, 0, n_partials, SumIdentity());
    const float sum = block_sum(partial, scratch);
    if (!writer) {
        return;
    }
    const float sq = __fadd_rn(sum, 0.0f);  // NumPy's sums start at +0.0: never -0.0
    *total_sq = sq;
    const float n_c51 = __fsqrt_rn(fmaxf(c51, 0.0f));
    const float n_cql = __fsqrt_rn(fmaxf(cql, 0.0f));
    const float grad_norm = __fsqrt_rn(fmaxf(sq, 0.0f));
    *safety_scale = step_clip_scale(sq, bound);
    readback[0] = __fadd_rn(loss_c51, loss_cql);
    readback[3] = grad_norm;
    readback[4] = n_c51;
    readback[5] = __fmul_rn(n_c51, step_clip_scale(c51, budget_c51));
    readback[6] = n_cql;
    readback[7] = __fmul_rn(n_cql, step_clip_scale(cql, budget_cql));
    readback[8] = bound;
    readback[9] = grad_norm > bound ? 1.0f : 0.0f;
    if (ha_is_finite(grad_norm)) {
        isv[slow_ema_index] = __fadd_rn(__fmul_rn(__fsub_rn(1.0f, slow_alpha), slow),
                                        __fmul_rn(slow_alpha, grad_norm));
    }
}

// ---------------------------------------------------------------------------------------------
// Sentinel pieces: a slot whose buffer is not one contiguous range (e.g. online(s)'s advantage
// logits of every branch) is checked as several entries of nan_check_fused's descriptor arrays;
// entries past the slot table (index >= n_slots) are the extra pieces, and this ORs each one's
// flag into its slot's flag: flags[piece_slot[k]] |= flags[n_slots + k]. One thread per piece.
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void merge_piece_flags(int* __restrict__ flags,
                                            const int* __restrict__ piece_slot, int n_slots,
                                            int n_pieces) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    for (int k = threadIdx.x; k < n_pieces; k += blockDim.x) {
        if (flags[n_slots + k] != 0) {
            flags[piece_slot[k]] = 1;
        }
    }
}
