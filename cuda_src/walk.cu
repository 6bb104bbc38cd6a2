// greedy_walk: the greedy policy over a whole segment in ONE launch (issue 20, SPEC 10), one
// thread block of WALK_THREADS threads walking bar by bar. Twin and specification:
// foxhunt.reference.kernels.walk.greedy_walk (its docstring states the float order).
//
// Per bar k = 0 .. n_steps[0] - 1 (the env starts flat at bar start[0]):
//   x  = env_write_state (env.cuh: the state row of the env, the observe of env_observe)
//   h1 = relu(x W_s1^T + b_s1); h2 = clamp_finite(relu(h1 W_s2^T + b_s2), bound)
//        bound = h2_clamp_mult * fmaxf(isv[isv_index], 1) (Mech 10, read once: the ISV does not
//        change during an evaluation)
//   hv = relu(h2 W_v1^T + b_v1); v = hv W_v2^T + b_v2; ha_d, adv_d likewise per branch d
//   logits = dueling combine; logp = log-softmax; q = expected Q (distributional.cuh's bodies)
//   a_d = double_dqn_argmax(q_d) (lowest index on ties, NaN never wins: env_act with eps 0)
//   env_advance (env.cuh) with (a_0, a_1 or market, a_2 or now); row k of rec_reward, rec_held,
//   rec_cost and (when not null) rec_margin = min_d (best_d - second best_d) (NaN-free second
//   best; +Inf when a branch has no other non-NaN value or its best is NaN; a NaN gap, Inf - Inf,
//   counts as 0: an ambiguous bar).
// Block-wide barriers between the layers; thread 0 holds the env state in registers and does
// the action choice, the step and the next state row.
//
// Dot products (every layer, one warp per output row n, rows n = warp, warp + WARPS, ...): lane
// l sums its terms k = l, l + 32, ... in order from +0.0f, acc = acc + x_k * w_nk (__fmul_rn /
// __fadd_rn: no FMA contraction), then warp_sum_halving (xor butterfly 16, 8, 4, 2, 1). In bf16
// mode both operands are BF16 (x rounded RNE on read, as clamp_finite_isv / add_bias_relu_bf16
// round it; W read from the BF16 mirror params_bf16, the same offsets as params): their product
// is exact in f32. f32 mode: params, f32 products. Biases are f32 (params) in both modes.
//
// Weights and biases are read from global memory (they stay in L2: the seed network's BF16
// mirror is 0.6 MB); the activations live in shared memory. The thread-block-cluster version
// that follows changes only where the weights and activations live: the layers' output rows
// are split across the cluster's CTAs, each CTA copying its slice of every weight matrix into
// its shared memory once (before the bar loop; the walk never changes them); a layer's output
// rows are written to the owning CTA's shared memory and every CTA reads the whole activation
// vector through distributed shared memory (cluster.map_shared_rank) after a cluster barrier
// (cluster.sync() replaces __syncthreads between layers); the env step and the action choice
// stay on CTA 0, which broadcasts the next state row. The dot products keep this file's order
// (one warp per output row), so the twin and its conformance bounds are unchanged.
//
// Parameter tensors are located by param_offsets (int32, reference walk.WALK_TENSORS order:
// WALK_* below, then WALK_PER_BRANCH entries per branch). Shapes (row-major [out, in]): W_s1
// [h1, state_dim], W_s2 [h2, h1], W_v1 [value_h, h2], W_v2 [num_atoms, value_h], W_d1 [adv_h,
// h2], W_d2 [n_d * num_atoms, adv_h]. Dynamic shared memory: walk_shared_floats() floats (the
// launcher's plan computes the same count). start, n_steps are read through pointers (a captured
// graph serves every segment). Built with -fmad=false; no atomics: bitwise repeatable.

#include "bf16_bits.cuh"       // f32_to_bf16_bits: the activations' BF16 rounding
#include "distributional.cuh"  // double_dqn_argmax, dueling_mean, log_softmax_row, kWarp
#include "env.cuh"             // EnvLocal, env_fresh, env_write_state, env_advance

#define WALK_THREADS 1024
#define WALK_WARPS (WALK_THREADS / 32)

// param_offsets entries (reference walk.WALK_TENSORS): the trunk and value head, then per
// branch d at WALK_BRANCH_BASE + WALK_PER_BRANCH * d: W_d1, b_d1, W_d2, b_d2.
#define WALK_W_S1 0
#define WALK_B_S1 1
#define WALK_W_S2 2
#define WALK_B_S2 3
#define WALK_W_V1 4
#define WALK_B_V1 5
#define WALK_W_V2 6
#define WALK_B_V2 7
#define WALK_BRANCH_BASE 8
#define WALK_PER_BRANCH 4

// The weights a layer multiplies: f32 params, or the BF16 mirror (same offsets).
struct WalkWeights {
    const float* f32;
    const unsigned short* bf16;
    bool use_bf16;
};

// The value a GEMM of this precision multiplies for activation x.
static __device__ __forceinline__ float walk_operand(float x, bool use_bf16) {
    return use_bf16 ? __uint_as_float(((unsigned int)f32_to_bf16_bits(x)) << BF16_SHIFT) : x;
}

static __device__ __forceinline__ float walk_weight(const WalkWeights& w, int i) {
    return w.use_bf16 ? __uint_as_float(((unsigned int)w.bf16[i]) << BF16_SHIFT) : w.f32[i];
}

// One warp's dot product of x[0..k) (shared memory) with the weight row starting at `row`
// (header: lane-strided terms in order, then the xor butterfly). Every lane gets the sum.
static __device__ __forceinline__ float walk_dot(const float* x, const WalkWeights& w, int row,
                                                 int k, int lane) {
    float acc = 0.0f;
    for (int j = lane; j < k; j += kWarp) {
        acc = __fadd_rn(acc, __fmul_rn(walk_operand(x[j], w.use_bf16), walk_weight(w, row + j)));
    }
    return warp_sum_halving(acc);
}

// dense.add_bias_relu's select: t <= 0 ? 0 : t (NaN stays NaN).
static __device__ __forceinline__ float walk_relu(float t) {
    return (t <= 0.0f) ? 0.0f : t;
}

// safety.clamp_finite: isfinite(v) ? clamp(v, -bound, bound) : 0.
static __device__ __forceinline__ float walk_clamp_finite(float v, float bound) {
    if (!isfinite(v)) {
        return 0.0f;
    }
    return (v > bound) ? bound : ((v < -bound) ? -bound : v);
}

// One dense layer's rows [0, n) by the block's warps: out[r] = x W^T + b (relu: then the select).
static __device__ __forceinline__ void walk_layer(const float* x, int k, float* out, int n,
                                                  const WalkWeights& w, int w_offset,
                                                  const float* bias, bool relu, int warp,
                                                  int lane) {
    for (int r = warp; r < n; r += WALK_WARPS) {
        const float dot = walk_dot(x, w, w_offset + r * k, k, lane);
        if (lane == 0) {
            const float t = __fadd_rn(dot, bias[r]);
            out[r] = relu ? walk_relu(t) : t;
        }
    }
}

// The greedy choice of one branch's q row and its gap to the second best (header).
static __device__ __forceinline__ int walk_choose(const float* row, int n_d, float* gap) {
    const int best_index = double_dqn_argmax(row, n_d);
    const float best = row[best_index];
    bool any = false;
    float second = 0.0f;
    for (int a = 0; a < n_d; ++a) {
        const float c = row[a];
        if (a != best_index && !isnan(c) && (!any || c > second)) {
            second = c;
            any = true;
        }
    }
    const float inf = __int_as_float(0x7f800000);
    float g = (isnan(best) || !any) ? inf : __fsub_rn(best, second);
    *gap = isnan(g) ? 0.0f : g;
    return best_index;
}

extern "C" __global__ void __launch_bounds__(WALK_THREADS)
greedy_walk(const float* __restrict__ params, const unsigned short* __restrict__ params_bf16,
            const int* __restrict__ param_offsets, int bf16, int state_dim, int h1, int h2,
            int value_h, int adv_h, int num_atoms, int n_branches,
            const int* __restrict__ n_actions, const int* __restrict__ action_offset,
            const float* __restrict__ z, const float* __restrict__ isv, int isv_index,
            float h2_clamp_mult, const float* __restrict__ close,
            const float* __restrict__ high, const float* __restrict__ low,
            const float* __restrict__ features, int n_features, const float* __restrict__ costs,
            int n_bars, const int* __restrict__ start, const int* __restrict__ n_steps,
            float* __restrict__ rec_reward, float* __restrict__ rec_held,
            float* __restrict__ rec_cost, float* __restrict__ rec_margin, int record_len) {
    extern __shared__ float walk_shared[];
    const int lane = threadIdx.x % kWarp;
    const int warp = threadIdx.x / kWarp;
    const int nb = n_branches;
    const int a_total = action_offset[nb - 1] + n_actions[nb - 1];
    const int hid_total = value_h + nb * adv_h;
    const int out_total = num_atoms * (1 + a_total);
    // Shared layout (walk_shared_floats): x, h1, h2, the heads' hidden rows (value, then
    // branch d at value_h + d adv_h), their outputs (v [NA], then branch d's adv [n_d, NA] at
    // NA (1 + action_offset[d])), q (branch-packed [a_total]), two scratch rows per warp.
    float* x_s = walk_shared;
    float* h1_s = x_s + state_dim;
    float* h2_s = h1_s + h1;
    float* hid_s = h2_s + h2;
    float* out_s = hid_s + hid_total;
    float* q_s = out_s + out_total;
    float* logits_s = q_s + a_total + 2 * warp * num_atoms;
    float* logp_s = logits_s + num_atoms;

    const WalkWeights w = {params, params_bf16, bf16 != 0};
    const int* off = param_offsets;
    const float bound = __fmul_rn(h2_clamp_mult, fmaxf(isv[isv_index], 1.0f));
    const int steps = n_steps[0];
    EnvLocal s = env_fresh(start[0]);  // live in thread 0 only
    if (threadIdx.x == 0) {
        env_write_state(x_s, features, n_features, close, s, state_dim);
    }
    for (int k = 0; k < steps; ++k) {
        __syncthreads();  // x_s holds bar k's state
        walk_layer(x_s, state_dim, h1_s, h1, w, off[WALK_W_S1], params + off[WALK_B_S1], true,
                   warp, lane);
        __syncthreads();
        walk_layer(h1_s, h1, h2_s, h2, w, off[WALK_W_S2], params + off[WALK_B_S2], true, warp,
                   lane);
        __syncthreads();
        for (int i = threadIdx.x; i < h2; i += WALK_THREADS) {
            h2_s[i] = walk_clamp_finite(h2_s[i], bound);
        }
        __syncthreads();
        // The heads' first layers: rows [0, value_h) value, then adv_h rows per branch.
        for (int r = warp; r < hid_total; r += WALK_WARPS) {
            const int head = r < value_h ? -1 : (r - value_h) / adv_h;
            const int local = head < 0 ? r : r - value_h - head * adv_h;
            const int wi = head < 0 ? WALK_W_V1 : WALK_BRANCH_BASE + WALK_PER_BRANCH * head;
            const float dot = walk_dot(h2_s, w, off[wi] + local * h2, h2, lane);
            if (lane == 0) {
                hid_s[r] = walk_relu(__fadd_rn(dot, params[off[wi + 1] + local]));
            }
        }
        __syncthreads();
        // Their second layers: rows [0, NA) v from hv, then branch d's n_d NA rows from ha_d.
        for (int r = warp; r < out_total; r += WALK_WARPS) {
            int head = -1;
            for (int d = 0; d < nb; ++d) {
                head = (r >= num_atoms * (1 + action_offset[d])) ? d : head;
            }
            const int local = head < 0 ? r : r - num_atoms * (1 + action_offset[head]);
            const int wi = head < 0 ? WALK_W_V2 : WALK_BRANCH_BASE + WALK_PER_BRANCH * head + 2;
            const int k_in = head < 0 ? value_h : adv_h;
            const float* in = head < 0 ? hid_s : hid_s + value_h + head * adv_h;
            const float dot = walk_dot(in, w, off[wi] + local * k_in, k_in, lane);
            if (lane == 0) {
                out_s[r] = __fadd_rn(dot, params[off[wi + 1] + local]);
            }
        }
        __syncthreads();
        // Dueling combine, log-softmax and expected Q: one warp per packed (branch, action) row,
        // the ops of dueling_log_softmax_q_branches (its lane only reads what it wrote).
        for (int r = warp; r < a_total; r += WALK_WARPS) {
            int d = 0;
            for (int e = 1; e < nb; ++e) {
                d = (r >= action_offset[e]) ? e : d;
            }
            const int n_d = n_actions[d];
            const int a = r - action_offset[d];
            const float* adv_d = out_s + num_atoms * (1 + action_offset[d]);
            for (int j = lane; j < num_atoms; j += kWarp) {
                const float mean = dueling_mean(adv_d, j, n_d, num_atoms);
                logits_s[j] = out_s[j] + (adv_d[a * num_atoms + j] - mean);
            }
            const float q = log_softmax_row(logits_s, logp_s, z, true, num_atoms, lane);
            if (lane == 0) {
                q_s[r] = q;
            }
            __syncwarp();  // the next row of this warp rewrites the scratch rows
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int act[3] = {0, ENV_DEFAULT_ORDER, ENV_DEFAULT_URGENCY};
            float margin = __int_as_float(0x7f800000);
            for (int d = 0; d < nb; ++d) {
                float gap;
                const int choice = walk_choose(q_s + action_offset[d], n_actions[d], &gap);
                if (d < 3) {
                    act[d] = choice;
                }
                margin = fminf(margin, gap);
            }
            const int steps_before = s.steps;
            const EnvOutcome o = env_advance(s, act[0], act[1], act[2], close, high, low, costs,
                                             n_bars, 0);
            if (o.live && steps_before < record_len) {
                rec_reward[steps_before] = o.reward;
                rec_held[steps_before] = o.held;
                rec_cost[steps_before] = o.cost;
                if (rec_margin != nullptr) {
                    rec_margin[steps_before] = margin;
                }
            }
            env_write_state(x_s, features, n_features, close, s, state_dim);
        }
    }
}
