// greedy_walk, greedy_walk_cluster: the greedy policy over a whole segment in ONE launch (issue
// 20, SPEC 10). Twin and specification of both: foxhunt.reference.kernels.walk.greedy_walk (its
// docstring states the float order). The two kernels run the same device functions on the same
// values (below), so their records are bitwise equal; they differ only in where the weights and
// activations live and in how many blocks share the work.
//
// Per bar k = 0 .. n_steps[0] - 1 (the env starts flat at bar start[0]):
//   x  = the env's state row (env.cuh's env_write_state: the observe of env_observe)
//   h1 = relu(x W_s1^T + b_s1); h2 = clamp_finite(relu(h1 W_s2^T + b_s2), bound)
//        bound = h2_clamp_mult * fmaxf(isv[isv_index], 1) (Mech 10, read once: the ISV does not
//        change during an evaluation)
//   hv = relu(h2 W_v1^T + b_v1); v = hv W_v2^T + b_v2; ha_d, adv_d likewise per branch d
//   logits = dueling combine; logp = log-softmax; q = expected Q (distributional.cuh's bodies)
//        on branch d's support z + d * z_stride: z_stride 0, one support z [num_atoms] for every
//        branch (the fixed [v_min, v_max]); z_stride = num_atoms, z [n_branches, num_atoms] row
//        d (the live per-branch support of adaptive_atoms, built from the ISV before the walk).
//        z_stride selects only the support a Q row reads: the float order and the bitwise
//        contracts below hold for either.
//   a_d = double_dqn_argmax(q_d) (lowest index on ties, NaN never wins: env_act with eps 0)
//   env_advance (env.cuh) with (a_0, a_1 or market, a_2 or now); row k of rec_reward, rec_held,
//   rec_cost and (when not null) rec_margin = min_d (best_d - second best_d) (NaN-free second
//   best; +Inf when a branch has no other non-NaN value or its best is NaN; a NaN gap, Inf - Inf,
//   counts as 0: an ambiguous bar).
// The four dense layers (s1; s2 with the clamp; the heads' hidden rows: value, then adv_h rows
// per branch; their outputs: v [NA], then branch d's adv [n_d, NA]) are walk_layer_of(0..3).
// After the last layer the first warps compute the Q rows while the block's last threads copy
// the next bar's market features into x (walk_features_row: every thread follows the bar index,
// which does not depend on the actions); after a __syncthreads warp 0 alone chooses the actions
// and runs env_advance (walk_advance), its lane 0 writes the record rows and the next state
// row's position features (the zeros after them are written once, with the first row).
//
// Dot products (every layer, one warp per output row; which warp, or which block, computes a
// row changes nothing): lane l sums its terms k = l, l + 32, ... in order from +0.0f, acc = acc
// + x_k * w_nk (__fmul_rn / __fadd_rn: no FMA contraction; the terms' loads are issued in groups
// of 8 and 4 before their adds, walk_terms, which keeps the order), then warp_sum_halving (xor
// butterfly 16, 8, 4, 2, 1: every lane ends with the same sum). A warp computes its rows r and
// r + W (W warps) together (walk_dot2: two independent chains, each that same sum). In bf16
// mode both operands are BF16 (x rounded RNE on read, as clamp_finite_isv / add_bias_relu_bf16
// round it; W read from the BF16 mirror params_bf16, the same offsets as params): their product
// is exact in f32. f32 mode: params, f32 products. Biases are f32 (params) in both modes.
//
// greedy_walk: ONE block of WALK_THREADS. Weights and biases are read from global memory (they
// stay in L2: the seed network's BF16 mirror is 0.6 MB); the activations live in the block's
// shared memory; __syncthreads between the layers.
//
// greedy_walk_cluster: ONE thread-block cluster of WALK_CLUSTER blocks (8, portable, on sm_90
// and newer; compiled in with __cluster_dims__, so cuLaunchKernel and graph capture need no
// launch attribute) of WALK_CLUSTER_THREADS threads. Block rank c owns rows [c q, min(n, (c + 1)
// q)), q = ceil(n / C), of every layer of n rows. Before the bar loop each block copies its rows
// of every weight matrix (the BF16 mirror in bf16 mode, stored as BF16; f32 params else) and
// their biases into its dynamic shared memory, once (the walk never changes them). A layer's row
// is computed by one warp of its owner from shared memory, and lanes 0..C-1 store the value into
// the layer's output vector in the shared memory of every block of the cluster (distributed
// shared memory: mapa + st.shared::cluster); one cluster barrier (arrive.release / wait.acquire)
// per layer then makes the whole vector visible in every block, so each bar costs four cluster
// barriers and every block reads only its own shared memory. The dueling / log-softmax / Q rows,
// the action and the env step run redundantly in every block (bitwise identical: same code,
// same inputs; in each block the env step is its warp 0's), and block 0 alone writes the
// record rows. Every layer has its own output
// vector, written only between the barriers before and after its layer and read only in the
// next phase (or, for the heads' outputs, by the block's own Q rows): a block that races ahead
// to bar k + 1 writes a layer's vector only after every block has passed the barrier that ends
// the phase reading it in bar k, so no double buffer is needed. Before sm_90 there are no
// clusters: C is 1, the "cluster" is the block and its barrier __syncthreads (the same code on
// one block, weights in its shared memory); the launch plan (fast/kernels/walk.py) picks
// greedy_walk there, and wherever the slices do not fit a block's shared memory.
//
// Parameter tensors are located by param_offsets (int32, reference walk.WALK_TENSORS order:
// WALK_* below, then WALK_PER_BRANCH entries per branch). Shapes (row-major [out, in]): W_s1
// [h1, state_dim], W_s2 [h2, h1], W_v1 [value_h, h2], W_v2 [num_atoms, value_h], W_d1 [adv_h,
// h2], W_d2 [n_d * num_atoms, adv_h]. Dynamic shared memory (the launcher's plan computes the
// same sizes): walk_acts (x, h1, h2, the heads' hidden rows, their outputs, q, two scratch rows
// of num_atoms per warp), and for the cluster kernel the block's bias slices (q floats per
// layer) and weight slices (walk_slice_cap elements per layer, BF16 or f32). start, n_steps are
// read through pointers (a captured graph serves every segment). Built with -fmad=false; no
// atomics: bitwise repeatable.

#include "bf16_bits.cuh"       // f32_to_bf16_bits: the activations' BF16 rounding
#include "distributional.cuh"  // double_dqn_argmax, dueling_mean, log_softmax_row, kWarp
#include "env.cuh"             // EnvLocal, env_fresh, env_write_state, env_advance

#define WALK_THREADS 1024
#define WALK_WARPS (WALK_THREADS / 32)
// The cluster kernel's blocks: one warp per row of the block's slice, so a layer's rows (the
// seed network: 32 to 64 per block) take one or two rounds per warp.
// (benches/walk_profile.py may build it with -DWALK_CLUSTER_THREADS=256 or 512 to time them;
// the launch plan, fast/kernels/walk.py CLUSTER_THREADS, is 1024.)
#ifndef WALK_CLUSTER_THREADS
#define WALK_CLUSTER_THREADS 1024
#endif
#define WALK_CLUSTER_WARPS (WALK_CLUSTER_THREADS / 32)

// Blocks per cluster from sm_90: 8 (the portable maximum; fast/kernels/walk.py
// WALK_CLUSTER_SM90). benches/walk_profile.py may build -DWALK_CLUSTER_SIZE=4 to time it.
#ifndef WALK_CLUSTER_SIZE
#define WALK_CLUSTER_SIZE 8
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define WALK_CLUSTER WALK_CLUSTER_SIZE
#else
#define WALK_CLUSTER 1
// No clusters before sm_90 (the attribute is an error there): the kernel keeps its
// __cluster_dims__ spelling (fast/cuda_parse.py reads it) and it expands to nothing.
#undef __cluster_dims__
#define __cluster_dims__(...)
#endif

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

// The dense layers: s1, s2 (+ clamp), the heads' hidden rows, their outputs.
#define WALK_LAYERS 4

// Opt-in phase profile (benches/walk_profile.py builds with -DWALK_PROFILE; the normal build
// compiles none of it). Thread 0 of block 0 adds the clock64() cycles of each phase of every
// bar into walk_profile[kernel * WALK_PROF_SLOTS + slot] (kernel 0 greedy_walk, 1 the cluster
// kernel): slots 0..3 layer l's rows, 4..7 the barrier after layer l, 8 the Q rows, 9 the
// barrier after them, 10 the action choice and env step, 11 the barrier after it, 12 the
// bar's top (prefetch), 13 the bars walked, 14 the setup before the bar loop. Thread 0 is in
// warp 0, which computes rows of every layer, Q row 0 and the env step: a barrier slot is its
// wait for the slowest warp (or block).
#define WALK_PROF_SLOTS 16
#ifdef WALK_PROFILE
extern "C" {  // its plain name is what benches/walk_profile.py asks cuModuleGetGlobal for
__device__ unsigned long long walk_profile[2 * WALK_PROF_SLOTS];
}
// 32-bit sums (registers: a bar is far below 2^32 / 10^4 cycles per phase). A WalkProf is
// passed by reference into the device functions that tick (walk_cluster_bar).
struct WalkProf {
    long long t;
    unsigned int slot[WALK_PROF_SLOTS];
};
static __device__ __forceinline__ WalkProf walk_prof_start() {
    WalkProf p = {};
    p.t = clock64();
    return p;
}
static __device__ __forceinline__ void walk_tick(WalkProf& p, int slot) {
    const long long now = clock64();
    p.slot[slot] += (unsigned int)(now - p.t);
    p.t = now;
}
#define WALK_PROF_DECL WalkProf prof = walk_prof_start()
#define WALK_PROF_STORE(kernel, on)                                                    \
    do {                                                                               \
        if (on) {                                                                      \
            for (int prof_i = 0; prof_i < WALK_PROF_SLOTS; ++prof_i) {                 \
                walk_profile[(kernel) * WALK_PROF_SLOTS + prof_i] = prof.slot[prof_i]; \
            }                                                                          \
        }                                                                              \
    } while (0)
#else
struct WalkProf {};
static __device__ __forceinline__ void walk_tick(WalkProf&, int) {}
#define WALK_PROF_DECL WalkProf prof
#define WALK_PROF_STORE(kernel, on)
#endif
#define WALK_TICK(slot) walk_tick(prof, (slot))
#define WALK_PROF_TOP 12
#define WALK_PROF_BARS 13
#define WALK_PROF_SETUP 14
#define WALK_PROF_Q 8
#define WALK_PROF_Q_SYNC 9
#define WALK_PROF_ADVANCE 10
#define WALK_PROF_ADVANCE_SYNC 11
// A layer's epilogue on t = dot + b.
#define WALK_LINEAR 0
#define WALK_RELU 1
#define WALK_RELU_CLAMP 2

// The network's sizes and tables.
struct WalkNet {
    const int* off;  // param_offsets
    const int* n_actions;
    const int* action_offset;
    int sd, h1, h2, value_h, adv_h, na, nb;
    int z_stride;   // branch d's support: z + d * z_stride (0: one support for every branch)
    int hid_total;  // value_h + nb adv_h: the heads' hidden rows
    int out_total;  // na (1 + a_total): v, then every branch's adv
    int a_total;    // actions over the branches (q's length)
};

// The activations in shared memory (both kernels; the plan's walk_activation_floats).
struct WalkActs {
    float* x;
    float* h1;
    float* h2;
    float* hid;
    float* out;
    float* q;
    float* scratch;  // two rows of na per warp (logits, logp)
    float* end;      // the first float after them
};

// One layer: input and output vectors, rows, the fan in of rows [0, split) (k_lo) and of the
// rest (k_hi), the epilogue.
struct WalkLayer {
    const float* in;
    float* out;
    int rows;
    int split;
    int k_lo;
    int k_hi;
    int epilogue;
};

// Row r of a layer: its weights' and bias's offsets in params, and where its input starts in
// the layer's input vector.
struct WalkRow {
    int w;
    int b;
    int in;
};

// The weights a layer multiplies: f32, or BF16 (same offsets), in global or shared memory.
struct WalkWeights {
    const float* f32;
    const unsigned short* bf16;
    bool use_bf16;
    bool x_rounded;  // the activations are stored BF16-rounded already (greedy_walk_hold)
};

static __device__ __forceinline__ WalkNet walk_net(const int* param_offsets, int state_dim,
                                                   int h1, int h2, int value_h, int adv_h,
                                                   int num_atoms, int n_branches,
                                                   const int* n_actions,
                                                   const int* action_offset, int z_stride) {
    WalkNet n;
    n.off = param_offsets;
    n.n_actions = n_actions;
    n.action_offset = action_offset;
    n.sd = state_dim;
    n.h1 = h1;
    n.h2 = h2;
    n.value_h = value_h;
    n.adv_h = adv_h;
    n.na = num_atoms;
    n.nb = n_branches;
    n.z_stride = z_stride;
    n.a_total = action_offset[n_branches - 1] + n_actions[n_branches - 1];
    n.hid_total = value_h + n_branches * adv_h;
    n.out_total = num_atoms * (1 + n.a_total);
    return n;
}

static __device__ __forceinline__ WalkActs walk_acts(float* base, const WalkNet& n, int warps) {
    WalkActs a;
    a.x = base;
    a.h1 = a.x + n.sd;
    a.h2 = a.h1 + n.h1;
    a.hid = a.h2 + n.h2;
    a.out = a.hid + n.hid_total;
    a.q = a.out + n.out_total;
    a.scratch = a.q + n.a_total;
    a.end = a.scratch + 2 * warps * n.na;
    return a;
}

static __device__ __forceinline__ WalkLayer walk_layer_of(int l, const WalkNet& n,
                                                          const WalkActs& a) {
    WalkLayer L;
    if (l == 0) {
        L = {a.x, a.h1, n.h1, n.h1, n.sd, n.sd, WALK_RELU};
    } else if (l == 1) {
        L = {a.h1, a.h2, n.h2, n.h2, n.h1, n.h1, WALK_RELU_CLAMP};
    } else if (l == 2) {
        L = {a.h2, a.hid, n.hid_total, n.hid_total, n.h2, n.h2, WALK_RELU};
    } else {
        L = {a.hid, a.out, n.out_total, n.na, n.value_h, n.adv_h, WALK_LINEAR};
    }
    return L;
}

static __device__ __forceinline__ int walk_fan_in(const WalkLayer& L, int r) {
    return r < L.split ? L.k_lo : L.k_hi;
}

static __device__ __forceinline__ WalkRow walk_row(int l, int r, const WalkNet& n) {
    const int* off = n.off;
    if (l == 0) {
        return {off[WALK_W_S1] + r * n.sd, off[WALK_B_S1] + r, 0};
    }
    if (l == 1) {
        return {off[WALK_W_S2] + r * n.h1, off[WALK_B_S2] + r, 0};
    }
    if (l == 2) {  // rows [0, value_h) value, then adv_h rows per branch
        const int head = r < n.value_h ? -1 : (r - n.value_h) / n.adv_h;
        const int local = head < 0 ? r : r - n.value_h - head * n.adv_h;
        const int wi = head < 0 ? WALK_W_V1 : WALK_BRANCH_BASE + WALK_PER_BRANCH * head;
        return {off[wi] + local * n.h2, off[wi + 1] + local, 0};
    }
    // rows [0, NA) v from hv, then branch d's n_d NA rows from ha_d
    int head = -1;
    for (int d = 0; d < n.nb; ++d) {
        head = (r >= n.na * (1 + n.action_offset[d])) ? d : head;
    }
    const int local = head < 0 ? r : r - n.na * (1 + n.action_offset[head]);
    const int wi = head < 0 ? WALK_W_V2 : WALK_BRANCH_BASE + WALK_PER_BRANCH * head + 2;
    const int k_in = head < 0 ? n.value_h : n.adv_h;
    return {off[wi] + local * k_in, off[wi + 1] + local,
            head < 0 ? 0 : n.value_h + head * n.adv_h};
}

// The value a GEMM of this precision multiplies for activation x.
static __device__ __forceinline__ float walk_operand(float x, bool use_bf16) {
    return use_bf16 ? __uint_as_float(((unsigned int)f32_to_bf16_bits(x)) << BF16_SHIFT) : x;
}

static __device__ __forceinline__ float walk_weight(const WalkWeights& w, int i) {
    return w.use_bf16 ? __uint_as_float(((unsigned int)w.bf16[i]) << BF16_SHIFT) : w.f32[i];
}

// U consecutive terms of one lane (k = j, j + 32, ..., j + 32 (U - 1)): every load first (in
// flight together), then the adds in k order.
template <int U>
static __device__ __forceinline__ float walk_terms(float acc, const float* x,
                                                   const WalkWeights& w, int row, int j) {
    float xs[U];
    float ws[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        xs[u] = x[j + u * kWarp];
        ws[u] = walk_weight(w, row + j + u * kWarp);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
        acc = __fadd_rn(acc, __fmul_rn(walk_operand(xs[u], w.use_bf16 && !w.x_rounded), ws[u]));
    }
    return acc;
}

// One warp's dot product of x[0..k) with the weight row starting at `row` (header: lane-strided
// terms in order, then the xor butterfly). Every lane gets the sum.
static __device__ __forceinline__ float walk_dot(const float* x, const WalkWeights& w, int row,
                                                 int k, int lane) {
    float acc = 0.0f;
    int j = lane;
    for (; j + 7 * kWarp < k; j += 8 * kWarp) {
        acc = walk_terms<8>(acc, x, w, row, j);
    }
    if (j + 3 * kWarp < k) {
        acc = walk_terms<4>(acc, x, w, row, j);
        j += 4 * kWarp;
    }
    for (; j < k; j += kWarp) {
        acc = walk_terms<1>(acc, x, w, row, j);
    }
    return warp_sum_halving(acc);
}

// Two rows of one warp at once, each exactly walk_dot's sum (its lane's terms in k order from
// +0.0f, then the butterfly): the two chains are independent, so their loads, adds and shuffles
// interleave (one row's latency instead of two). Both rows have fan in k.
static __device__ __forceinline__ void walk_dot2(const float* x0, int row0, const float* x1,
                                                 int row1, const WalkWeights& w, int k, int lane,
                                                 float& dot0, float& dot1) {
    float acc0 = 0.0f;
    float acc1 = 0.0f;
    int j = lane;
    for (; j + 3 * kWarp < k; j += 4 * kWarp) {
        acc0 = walk_terms<4>(acc0, x0, w, row0, j);
        acc1 = walk_terms<4>(acc1, x1, w, row1, j);
    }
    for (; j < k; j += kWarp) {
        acc0 = walk_terms<1>(acc0, x0, w, row0, j);
        acc1 = walk_terms<1>(acc1, x1, w, row1, j);
    }
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset >>= 1) {  // warp_sum_halving, twice
        acc0 = __fadd_rn(acc0, __shfl_xor_sync(kFullMask, acc0, offset));
        acc1 = __fadd_rn(acc1, __shfl_xor_sync(kFullMask, acc1, offset));
    }
    dot0 = acc0;
    dot1 = acc1;
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

// A layer's output value: t = dot + bias, then the layer's epilogue.
static __device__ __forceinline__ float walk_epilogue(float dot, float bias, int epilogue,
                                                      float bound) {
    const float t = __fadd_rn(dot, bias);
    if (epilogue == WALK_LINEAR) {
        return t;
    }
    const float r = walk_relu(t);
    return epilogue == WALK_RELU_CLAMP ? walk_clamp_finite(r, bound) : r;
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

// Dueling combine, log-softmax and expected Q of packed (branch, action) row r, by one warp
// (scratch: its two rows of na), the ops of dueling_log_softmax_q_branches (its lane only reads
// what it wrote), on the row's branch d's support z + d * n.z_stride; q[r] by lane 0.
static __device__ __forceinline__ void walk_q_row(const WalkNet& n, const WalkActs& a,
                                                  const float* z, int r, float* scratch,
                                                  int lane) {
    float* logits_s = scratch;
    float* logp_s = scratch + n.na;
    int d = 0;
    for (int e = 1; e < n.nb; ++e) {
        d = (r >= n.action_offset[e]) ? e : d;
    }
    const int n_d = n.n_actions[d];
    const int act = r - n.action_offset[d];
    const float* adv_d = a.out + n.na * (1 + n.action_offset[d]);
    for (int j = lane; j < n.na; j += kWarp) {
        const float mean = dueling_mean(adv_d, j, n_d, n.na);
        logits_s[j] = a.out[j] + (adv_d[act * n.na + j] - mean);
    }
    const float q = log_softmax_row(logits_s, logp_s, z + d * n.z_stride, true, n.na, lane);
    if (lane == 0) {
        a.q[r] = q;
    }
    __syncwarp();  // the warp's next row rewrites the scratch rows
}

// Every Q row of one state: one warp per row (walk_q_row).
static __device__ __forceinline__ void walk_q_rows(const WalkNet& n, const WalkActs& a,
                                                   const float* z, int warp, int warps,
                                                   int lane) {
    for (int r = warp; r < n.a_total; r += warps) {
        walk_q_row(n, a, z, r, a.scratch + 2 * warp * n.na, lane);
    }
}

// The first state row of env s (env_write_state's values): the market features of bar s.t one
// per thread, the position features and the zeros after them (env_write_state on the row's
// tail, no features) by the last. Later bars rewrite only the features (walk_features_row) and
// the position features (walk_advance): the zeros stay.
static __device__ __forceinline__ void walk_state_row(float* x, const float* features,
                                                      int n_features, const float* close,
                                                      const EnvLocal& s, int state_dim,
                                                      int threads) {
    const float* f = features + (long long)s.t * n_features;
    for (int j = threadIdx.x; j < n_features; j += threads) {
        x[j] = f[j];
    }
    if (threadIdx.x == threads - 1) {
        env_write_state(x + n_features, features, 0, close, s, state_dim - n_features);
    }
}

// env_advance's next bar (its t1 = live ? t + 1 : t, live = t < n_bars - 1): every thread
// follows the bar index (the prefetch and the next feature row need it); only warp 0 holds and
// advances the whole env state.
static __device__ __forceinline__ int walk_next_bar(int t, int n_bars) {
    return (t < n_bars - 1) ? t + 1 : t;
}

// The market features of bar t into x[0, n_features), by the block's LAST threads (thread
// threads - 1 - j copies feature j): they run while the first warps compute the Q rows, so the
// row's global loads are off the bar's critical path (walk_advance then writes only the three
// position features). x is read by layer 0 alone, which a barrier has closed in every warp.
static __device__ __forceinline__ void walk_features_row(float* x, const float* features,
                                                         int n_features, int t, int threads) {
    const float* f = features + (long long)t * n_features;
    for (int j = threads - 1 - (int)threadIdx.x; j < n_features; j += threads) {
        x[j] = f[j];
    }
}

// A real load of *p whose value is dropped: it brings the line into this SM's L1 (where
// prefetch.global.L1 is only a hint).
static __device__ __forceinline__ void walk_touch(const float* p) {
    asm volatile("{\n\t.reg .f32 v;\n\tld.global.f32 v, [%0];\n\t}" ::"l"(p));
}

// The prices of bar t that warp 0's env_advance reads after the Q rows (close, high, low[t]),
// loaded by the three threads before walk_features_row's (none when the block has too few),
// so that those reads hit L1 instead of waiting for L2 on the bar's critical path.
static __device__ __forceinline__ void walk_touch_prices(const float* close, const float* high,
                                                         const float* low, int n_features,
                                                         int t, int threads) {
    const int i = threads - 1 - (int)threadIdx.x - n_features;
    if (i == 0) {
        walk_touch(close + t);
    } else if (i == 1) {
        walk_touch(high + t);
    } else if (i == 2) {
        walk_touch(low + t);
    }
}

static __device__ __forceinline__ void walk_prefetch_l1(const void* p) {
    asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}

// What the end of bar t reads of the next bar (its prices, its feature row) into L1 while
// the layers run (a hint only: nothing depends on it).
static __device__ __forceinline__ void walk_prefetch_next(int t, const float* close,
                                                          const float* high, const float* low,
                                                          const float* features,
                                                          int n_features, int n_bars) {
    const int t1 = t + 1;
    if (t1 >= n_bars || n_features < 1) {
        return;
    }
    const int i = threadIdx.x;
    if (i == 0) {
        walk_prefetch_l1(close + t1);
    } else if (i == 1) {
        walk_prefetch_l1(high + t1);
    } else if (i == 2) {
        walk_prefetch_l1(low + t1);
    } else if ((i - 3) * kWarp < n_features + kWarp) {  // every line of the row, and its end
        walk_prefetch_l1(features + (long long)t1 * n_features + min((i - 3) * kWarp,
                                                                     n_features - 1));
    }
}

// The end of a bar, by warp 0 of the block alone (one warp instead of all: the other warps
// would only repeat it, and on 32 warps the repeats cost the schedulers' issue slots): lane d <
// nb chooses branch d's action (walk_choose), the lanes exchange them, every lane runs
// env_advance on its copy of s (the same values), the `writer` (lane 0 of the recording block's
// warp 0) writes the record rows and lane 0 the position features of the next state row (the
// market features are walk_features_row's). margin = min over d in branch order, as before.
static __device__ __forceinline__ void walk_advance(
    EnvLocal& s, const WalkNet& n, const float* q, bool writer, float* x,
    const float* __restrict__ close, const float* __restrict__ high,
    const float* __restrict__ low, const float* __restrict__ features, int n_features,
    const float* __restrict__ costs, int n_bars, float* __restrict__ rec_reward,
    float* __restrict__ rec_held, float* __restrict__ rec_cost, float* __restrict__ rec_margin,
    int record_len, int lane) {
    const float inf = __int_as_float(0x7f800000);
    int best = 0;
    float gap = inf;
    if (lane < n.nb) {
        best = walk_choose(q + n.action_offset[lane], n.n_actions[lane], &gap);
    }
    int act[3] = {0, ENV_DEFAULT_ORDER, ENV_DEFAULT_URGENCY};  // registers: constant indices
    float margin = inf;
#pragma unroll
    for (int d = 0; d < 3; ++d) {
        const int best_d = __shfl_sync(kFullMask, best, d);
        const float gap_d = __shfl_sync(kFullMask, gap, d);
        if (d < n.nb) {
            act[d] = best_d;
            margin = fminf(margin, gap_d);
        }
    }
    const int steps_before = s.steps;
    const EnvOutcome o = env_advance(s, act[0], act[1], act[2], close, high, low, costs, n_bars,
                                     0);
    if (writer && o.live && steps_before < record_len) {
        rec_reward[steps_before] = o.reward;
        rec_held[steps_before] = o.held;
        rec_cost[steps_before] = o.cost;
        if (rec_margin != nullptr) {
            rec_margin[steps_before] = margin;
        }
    }
    if (lane == 0 && x != nullptr) {  // (greedy_walk_hold builds its rows itself: null)
        env_write_state(x + n_features, features, 0, close, s, ENV_N_POSITION_FEATURES);
    }
}

extern "C" __global__ void __launch_bounds__(WALK_THREADS, 1)
greedy_walk(const float* __restrict__ params, const unsigned short* __restrict__ params_bf16,
            const int* __restrict__ param_offsets, int bf16, int state_dim, int h1, int h2,
            int value_h, int adv_h, int num_atoms, int n_branches,
            const int* __restrict__ n_actions, const int* __restrict__ action_offset,
            const float* __restrict__ z, int z_stride,
            const float* __restrict__ isv, int isv_index,
            float h2_clamp_mult, const float* __restrict__ close,
            const float* __restrict__ high, const float* __restrict__ low,
            const float* __restrict__ features, int n_features, const float* __restrict__ costs,
            int n_bars, const int* __restrict__ start, const int* __restrict__ n_steps,
            float* __restrict__ rec_reward, float* __restrict__ rec_held,
            float* __restrict__ rec_cost, float* __restrict__ rec_margin, int record_len) {
    extern __shared__ float walk_shared[];
    const int lane = threadIdx.x % kWarp;
    const int warp = threadIdx.x / kWarp;
    const WalkNet n = walk_net(param_offsets, state_dim, h1, h2, value_h, adv_h, num_atoms,
                               n_branches, n_actions, action_offset, z_stride);
    const WalkActs a = walk_acts(walk_shared, n, WALK_WARPS);
    const WalkWeights w = {params, params_bf16, bf16 != 0};
    const float bound = __fmul_rn(h2_clamp_mult, fmaxf(isv[isv_index], 1.0f));
    const int steps = n_steps[0];
    WALK_PROF_DECL;
    int t = start[0];           // every thread: the bar
    EnvLocal s = env_fresh(t);  // warp 0: the env (s.t == t)
    walk_state_row(a.x, features, n_features, close, s, state_dim, WALK_THREADS);
    WALK_TICK(WALK_PROF_SETUP);
    for (int k = 0; k < steps; ++k) {
        walk_prefetch_next(t, close, high, low, features, n_features, n_bars);
        WALK_TICK(WALK_PROF_TOP);
        __syncthreads();  // x holds bar k's state
        WALK_TICK(WALK_PROF_ADVANCE_SYNC);
#pragma unroll
        for (int l = 0; l < WALK_LAYERS; ++l) {
            const WalkLayer L = walk_layer_of(l, n, a);
            // The warp's rows two at once where their fan in agrees (as the cluster kernel's).
            for (int r = warp; r < L.rows; r += 2 * WALK_WARPS) {
                const int r2 = r + WALK_WARPS;
                const bool second = r2 < L.rows;
                const WalkRow row = walk_row(l, r, n);
                const WalkRow row2 = walk_row(l, second ? r2 : r, n);
                const int k_r = walk_fan_in(L, r);
                const int k_r2 = walk_fan_in(L, second ? r2 : r);
                float dot, dot2;
                if (second && k_r2 == k_r) {
                    walk_dot2(L.in + row.in, row.w, L.in + row2.in, row2.w, w, k_r, lane, dot,
                              dot2);
                } else {
                    dot = walk_dot(L.in + row.in, w, row.w, k_r, lane);
                    dot2 = second ? walk_dot(L.in + row2.in, w, row2.w, k_r2, lane) : 0.0f;
                }
                if (lane == 0) {
                    L.out[r] = walk_epilogue(dot, params[row.b], L.epilogue, bound);
                    if (second) {
                        L.out[r2] = walk_epilogue(dot2, params[row2.b], L.epilogue, bound);
                    }
                }
            }
            WALK_TICK(l);
            __syncthreads();
            WALK_TICK(WALK_LAYERS + l);
        }
        walk_q_rows(n, a, z, warp, WALK_WARPS, lane);
        t = walk_next_bar(t, n_bars);
        walk_features_row(a.x, features, n_features, t, WALK_THREADS);
        walk_touch_prices(close, high, low, n_features, t, WALK_THREADS);
        WALK_TICK(WALK_PROF_Q);
        __syncthreads();
        WALK_TICK(WALK_PROF_Q_SYNC);
        if (warp == 0) {
            walk_advance(s, n, a.q, threadIdx.x == 0, a.x, close, high, low, features,
                         n_features, costs, n_bars, rec_reward, rec_held, rec_cost, rec_margin,
                         record_len, lane);
        }
        WALK_TICK(WALK_PROF_ADVANCE);
    }
#ifdef WALK_PROFILE
    prof.slot[WALK_PROF_BARS] = (unsigned int)steps;
#endif
    WALK_PROF_STORE(0, threadIdx.x == 0);
}

// ------------------------------------------------------------------------------------------
// The cluster version (header)
// ------------------------------------------------------------------------------------------

// The cluster (PTX ISA 7.8, sm_90): this block's rank, the barrier (release/acquire: the shared
// and global writes before it are visible to every block of the cluster after it), and a store
// into the shared memory of block `rank` at this block's address `local` (distributed shared
// memory: the blocks share one layout).
struct WalkCluster {
    static __device__ __forceinline__ int rank() {
#if WALK_CLUSTER > 1
        unsigned int r;
        asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
        return (int)r;
#else
        return 0;
#endif
    }
    static __device__ __forceinline__ void sync() {
#if WALK_CLUSTER > 1
        asm volatile("barrier.cluster.arrive.release.aligned;\n\t"
                     "barrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
        __syncthreads();
#endif
    }
#if WALK_CLUSTER > 1 && defined(WALK_MBARRIER)
    // The opt-in exchange (-DWALK_MBARRIER; benches/walk_profile.py times it against the
    // barrier): a layer's values are sent with st.async, which counts their bytes on the
    // receiving block's mbarrier of that layer, and each block waits on its own mbarrier only
    // (no barrier across the cluster). The mbarrier of a layer completes one phase per bar (arrival
    // count 1: thread 0's arrive.expect_tx of the layer's rows * 4 bytes, made after it saw
    // the previous phase complete; bytes that come first leave tx-count negative, and the phase
    // still needs that arrival). Reuse is safe without a barrier: a block sends bar k + 1's
    // values of layer l only after every block's layer-0 rows of bar k + 1 (every rank owns
    // some: the kernel falls back to the barrier otherwise), i.e. after every block has
    // finished bar k (its reads of layer l's vector and its wait for that phase).
    static __device__ __forceinline__ unsigned int smem(const void* p) {
        return (unsigned int)__cvta_generic_to_shared(p);
    }
    static __device__ __forceinline__ void init(unsigned long long* bar) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem(bar)) : "memory");
    }
    static __device__ __forceinline__ void fence_init() {
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    static __device__ __forceinline__ void expect(unsigned long long* bar, int bytes) {
        asm volatile("{\n\t.reg .b64 state;\n\t"
                     "mbarrier.arrive.expect_tx.release.cluster.shared::cta.b64 state, [%0], %1;"
                     "\n\t}" ::"r"(smem(bar)), "r"(bytes) : "memory");
    }
    static __device__ __forceinline__ void wait(unsigned long long* bar, int parity) {
        unsigned int done = 0;
        while (!done) {
            asm volatile("{\n\t.reg .pred p;\n\t"
                         "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;"
                         "\n\tselp.b32 %0, 1, 0, p;\n\t}"
                         : "=r"(done) : "r"(smem(bar)), "r"(parity) : "memory");
        }
    }
    static __device__ __forceinline__ void send(float* local, float value, int rank,
                                                unsigned long long* bar) {
        unsigned int remote, remote_bar;
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                     : "=r"(remote) : "r"(smem(local)), "r"(rank));
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                     : "=r"(remote_bar) : "r"(smem(bar)), "r"(rank));
        asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
                     ::"r"(remote), "r"(__float_as_uint(value)), "r"(remote_bar) : "memory");
    }
#endif
    static __device__ __forceinline__ void store(float* local, float value, int rank) {
#if WALK_CLUSTER > 1
        const unsigned int addr = (unsigned int)__cvta_generic_to_shared(local);
        unsigned int remote;
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                     : "=r"(remote) : "r"(addr), "r"(rank));
        asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(value) : "memory");
#else
        *local = value;
#endif
    }
};

// The layer exchange of the cluster kernel: `put` a row's value into block `rank`, then
// `layer_done` once the block's rows of layer l are sent (bar k). The barrier (store + sync)
// unless the opt-in mbarrier exchange (-DWALK_MBARRIER) is built and `mbar` holds.
#if WALK_CLUSTER > 1 && defined(WALK_MBARRIER)
#define WALK_USE_MBARRIER 1
#else
#define WALK_USE_MBARRIER 0
#endif
static __device__ __forceinline__ void walk_put(float* local, float value, int rank,
                                                unsigned long long* bar, bool mbar) {
#if WALK_USE_MBARRIER
    if (mbar) {
        WalkCluster::send(local, value, rank, bar);
        return;
    }
#endif
    WalkCluster::store(local, value, rank);
}

static __device__ __forceinline__ void walk_layer_done(unsigned long long* bar, int k, int steps,
                                                       int rows, bool mbar) {
#if WALK_USE_MBARRIER
    if (mbar) {
        WalkCluster::wait(bar, k & 1);
        if (threadIdx.x == 0 && k + 1 < steps) {
            WalkCluster::expect(bar, 4 * rows);  // bar k + 1's phase
        }
        return;
    }
#endif
    WalkCluster::sync();  // the layer's whole output vector is in every block
}

// Rows [r0, r1) of n that block `rank` owns: q = ceil(n / C) rows each, in rank order.
static __device__ __forceinline__ void walk_owned(int n_rows, int rank, int& r0, int& r1) {
    const int q = (n_rows + WALK_CLUSTER - 1) / WALK_CLUSTER;
    r0 = min(n_rows, rank * q);
    r1 = min(n_rows, r0 + q);
}

// Weight elements of rows [r0, r) of layer L (row r's offset in its owner's slice).
static __device__ __forceinline__ int walk_slice_offset(const WalkLayer& L, int r0, int r) {
    const int lo = min(r, L.split) - min(r0, L.split);
    return lo * L.k_lo + (r - r0 - lo) * L.k_hi;
}

// Weight elements every block reserves for layer L: the largest slice of any rank.
static __device__ __forceinline__ int walk_slice_cap(const WalkLayer& L) {
    int cap = 0;
    for (int c = 0; c < WALK_CLUSTER; ++c) {
        int r0, r1;
        walk_owned(L.rows, c, r0, r1);
        cap = max(cap, walk_slice_offset(L, r0, r1));
    }
    return cap;
}

// The block's slices of every layer (rows [r0, r1) of layer l; weights from w_base[l], biases
// from b_base[l] in bias_s) and the weights' view: walk_cluster_load fills them.
struct WalkSlices {
    int r0[WALK_LAYERS];
    int r1[WALK_LAYERS];
    int w_base[WALK_LAYERS];
    int b_base[WALK_LAYERS];
    const float* bias_s;
    WalkWeights w;
};

// The block's rows of every layer (the BF16 mirror's in bf16 mode, stored as BF16; f32 params
// else) and their biases, copied into its dynamic shared memory from `base` (after the
// activations), once.
static __device__ __forceinline__ WalkSlices walk_cluster_load(
    const WalkNet& n, const WalkActs& a, float* base, int rank, const float* __restrict__ params,
    const unsigned short* __restrict__ params_bf16, bool use_bf16, int warp, int lane) {
    WalkSlices sl;
    int w_total = 0;
    int b_total = 0;
#pragma unroll
    for (int l = 0; l < WALK_LAYERS; ++l) {
        const WalkLayer L = walk_layer_of(l, n, a);
        walk_owned(L.rows, rank, sl.r0[l], sl.r1[l]);
        sl.w_base[l] = w_total;
        sl.b_base[l] = b_total;
        w_total += walk_slice_cap(L);
        b_total += (L.rows + WALK_CLUSTER - 1) / WALK_CLUSTER;
    }
    float* bias_s = base;  // (a: the layers' shapes only)
    float* w_f32 = bias_s + b_total;
    unsigned short* w_bf16 = reinterpret_cast<unsigned short*>(w_f32);
    sl.bias_s = bias_s;
    sl.w = {w_f32, w_bf16, use_bf16};
#pragma unroll
    for (int l = 0; l < WALK_LAYERS; ++l) {
        const WalkLayer L = walk_layer_of(l, n, a);
        for (int r = sl.r0[l] + warp; r < sl.r1[l]; r += WALK_CLUSTER_WARPS) {
            const WalkRow row = walk_row(l, r, n);
            const int dst = sl.w_base[l] + walk_slice_offset(L, sl.r0[l], r);
            const int k = walk_fan_in(L, r);
            for (int j = lane; j < k; j += kWarp) {
                if (use_bf16) {
                    w_bf16[dst + j] = params_bf16[row.w + j];
                } else {
                    w_f32[dst + j] = params[row.w + j];
                }
            }
            if (lane == 0) {
                bias_s[sl.b_base[l] + r - sl.r0[l]] = params[row.b];
            }
        }
    }
    return sl;
}

// One bar of the cluster walk (header): the four layers (each block its rows, sent to every
// block, one exchange per layer), the Q rows, the next bar's feature row, and warp 0's action
// choice and env step (walk_advance; `writer` writes the record rows). Bar k of `steps` (the
// opt-in mbarrier exchange's phase). Returns the next bar index t. The caller's __syncthreads
// then makes x hold the next state row.
static __device__ __forceinline__ int walk_cluster_bar(
    EnvLocal& s, int t, int k, int steps, const WalkNet& n, const WalkActs& a,
    const WalkSlices& sl, float bound, const float* __restrict__ z, bool writer,
    const float* __restrict__ close, const float* __restrict__ high,
    const float* __restrict__ low, const float* __restrict__ features, int n_features,
    const float* __restrict__ costs, int n_bars, float* __restrict__ rec_reward,
    float* __restrict__ rec_held, float* __restrict__ rec_cost, float* __restrict__ rec_margin,
    int record_len, unsigned long long* walk_full, bool mbar, int warp, int lane,
    WalkProf& prof) {
#pragma unroll
    for (int l = 0; l < WALK_LAYERS; ++l) {
        const WalkLayer L = walk_layer_of(l, n, a);
        // The warp's rows r, r + W, r + 2W, ... (W warps), two at once where their fan in
        // agrees (walk_dot2), else one by one (walk_dot): the same sums either way.
        for (int r = sl.r0[l] + warp; r < sl.r1[l]; r += 2 * WALK_CLUSTER_WARPS) {
            const int r2 = r + WALK_CLUSTER_WARPS;
            const bool second = r2 < sl.r1[l];
            const int rb = second ? r2 : r;  // (r itself when there is no second row)
            const float* x = L.in + walk_row(l, r, n).in;
            const float* x2 = L.in + walk_row(l, rb, n).in;
            const int w_r = sl.w_base[l] + walk_slice_offset(L, sl.r0[l], r);
            const int w_r2 = sl.w_base[l] + walk_slice_offset(L, sl.r0[l], rb);
            const int k_r = walk_fan_in(L, r);
            const int k_r2 = walk_fan_in(L, rb);
            float dot, dot2;
            if (second && k_r2 == k_r) {
                walk_dot2(x, w_r, x2, w_r2, sl.w, k_r, lane, dot, dot2);
            } else {
                dot = walk_dot(x, sl.w, w_r, k_r, lane);
                dot2 = second ? walk_dot(x2, sl.w, w_r2, k_r2, lane) : 0.0f;
            }
            const float value = walk_epilogue(dot, sl.bias_s[sl.b_base[l] + r - sl.r0[l]],
                                              L.epilogue, bound);
            if (lane < WALK_CLUSTER) {  // every lane holds the value: lane c sends it to c
                walk_put(&L.out[r], value, lane, walk_full + l, mbar);
            }
            if (second) {
                const float value2 = walk_epilogue(dot2, sl.bias_s[sl.b_base[l] + r2 - sl.r0[l]],
                                                   L.epilogue, bound);
                if (lane < WALK_CLUSTER) {
                    walk_put(&L.out[r2], value2, lane, walk_full + l, mbar);
                }
            }
        }
        WALK_TICK(l);
        walk_layer_done(walk_full + l, k, steps, L.rows, mbar);
        WALK_TICK(WALK_LAYERS + l);
    }
    walk_q_rows(n, a, z, warp, WALK_CLUSTER_WARPS, lane);
    t = walk_next_bar(t, n_bars);
    walk_features_row(a.x, features, n_features, t, WALK_CLUSTER_THREADS);
    walk_touch_prices(close, high, low, n_features, t, WALK_CLUSTER_THREADS);
    WALK_TICK(WALK_PROF_Q);
    __syncthreads();
    WALK_TICK(WALK_PROF_Q_SYNC);
    if (warp == 0) {
        walk_advance(s, n, a.q, writer, a.x, close, high, low, features, n_features, costs,
                     n_bars, rec_reward, rec_held, rec_cost, rec_margin, record_len, lane);
    }
    return t;
}

extern "C" __global__ void __cluster_dims__(WALK_CLUSTER, 1, 1)
__launch_bounds__(WALK_CLUSTER_THREADS, 1)
greedy_walk_cluster(const float* __restrict__ params,
                    const unsigned short* __restrict__ params_bf16,
                    const int* __restrict__ param_offsets, int bf16, int state_dim, int h1,
                    int h2, int value_h, int adv_h, int num_atoms, int n_branches,
                    const int* __restrict__ n_actions, const int* __restrict__ action_offset,
                    const float* __restrict__ z, int z_stride,
                    const float* __restrict__ isv, int isv_index,
                    float h2_clamp_mult, const float* __restrict__ close,
                    const float* __restrict__ high, const float* __restrict__ low,
                    const float* __restrict__ features, int n_features,
                    const float* __restrict__ costs, int n_bars, const int* __restrict__ start,
                    const int* __restrict__ n_steps, float* __restrict__ rec_reward,
                    float* __restrict__ rec_held, float* __restrict__ rec_cost,
                    float* __restrict__ rec_margin, int record_len) {
    extern __shared__ float walk_shared[];
    const int lane = threadIdx.x % kWarp;
    const int warp = threadIdx.x / kWarp;
    const int rank = WalkCluster::rank();
    const WalkNet n = walk_net(param_offsets, state_dim, h1, h2, value_h, adv_h, num_atoms,
                               n_branches, n_actions, action_offset, z_stride);
    const WalkActs a = walk_acts(walk_shared, n, WALK_CLUSTER_WARPS);
    WALK_PROF_DECL;
    const WalkSlices sl = walk_cluster_load(n, a, a.end, rank, params, params_bf16, bf16 != 0,
                                            warp, lane);
    const float bound = __fmul_rn(h2_clamp_mult, fmaxf(isv[isv_index], 1.0f));
    const int steps = n_steps[0];
    // The exchange's mbarriers (WALK_USE_MBARRIER only; `mbar`: every rank owns layer-0 rows).
#if WALK_USE_MBARRIER
    __shared__ unsigned long long walk_full[WALK_LAYERS];
    int last0, last1;
    walk_owned(n.h1, WALK_CLUSTER - 1, last0, last1);
    const bool mbar = last1 > last0;
    if (mbar && threadIdx.x == 0) {
        for (int l = 0; l < WALK_LAYERS; ++l) {
            WalkCluster::init(&walk_full[l]);
        }
        WalkCluster::fence_init();
        for (int l = 0; l < WALK_LAYERS; ++l) {
            WalkCluster::expect(&walk_full[l], 4 * walk_layer_of(l, n, a).rows);  // bar 0
        }
    }
#else
    unsigned long long* walk_full = nullptr;
    const bool mbar = false;
#endif
    int t = start[0];           // every thread of every block: the bar
    EnvLocal s = env_fresh(t);  // warp 0 of every block: the env (s.t == t)
    walk_state_row(a.x, features, n_features, close, s, state_dim, WALK_CLUSTER_THREADS);
    // Every block has started (its shared memory may be written by the others) and holds its
    // slices and the first state row.
    WalkCluster::sync();
    WALK_TICK(WALK_PROF_SETUP);
    for (int k = 0; k < steps; ++k) {
        walk_prefetch_next(t, close, high, low, features, n_features, n_bars);
        WALK_TICK(WALK_PROF_TOP);
        t = walk_cluster_bar(s, t, k, steps, n, a, sl, bound, z, rank == 0 && threadIdx.x == 0,
                             close, high, low, features, n_features, costs, n_bars, rec_reward,
                             rec_held, rec_cost, rec_margin, record_len, walk_full, mbar, warp,
                             lane, prof);
        WALK_TICK(WALK_PROF_ADVANCE);
        __syncthreads();  // x holds bar k + 1's state
        WALK_TICK(WALK_PROF_ADVANCE_SYNC);
    }
#if WALK_USE_MBARRIER
    WalkCluster::sync();  // no block leaves while another may still send to it
#endif
#ifdef WALK_PROFILE
    prof.slot[WALK_PROF_BARS] = (unsigned int)steps;
#endif
    WALK_PROF_STORE(1, rank == 0 && threadIdx.x == 0);
}

// ------------------------------------------------------------------------------------------
// greedy_walk_hold: the cluster walk, many steps a pass where the policy holds its position
// ------------------------------------------------------------------------------------------
// Twin: foxhunt.reference.kernels.walk.greedy_walk (bitwise: greedy_walk_cluster's records).
// While the greedy exposure equals the position held, nothing trades and the env's next state
// is known without the network: t + 1, the same position and entry price, time in position + 1
// (0 when flat). So from the state at step k a pass builds the state rows of the next w steps
// as if the position were held (walk_hold_rows: env_write_state's values), runs the network
// on all w rows at once (each dense row of each input summed as walk_dot sums it, so each
// input's Q is greedy_walk_cluster's bit for bit), and finds the first step m whose greedy
// exposure (double_dqn_argmax of branch 0's Q) is not the hold (exposure = position + 1).
// Steps k .. k + m - 1 are then the sequential walk's steps (lane j of warp 0 runs
// env_advance on step k + j's own state: no trade, the same bits as the one-by-one walk),
// step k + m takes the full greedy action of its row (walk_advance), and the next pass starts
// at k + m + 1 (k + w when every step held). The pass's rows adapt (the same in every block:
// they follow m): w doubles after a pass in which every step held, up to hold_rows, and is
// m + 1 after one that traded at its step m (a pass costs about a fixed part plus a part per
// row). Q rows: branch 0's for the w inputs first; the other branches' only for step m, and
// for every held step when rec_margin is recorded (its gaps need them).
// Shared memory: the hold_rows inputs' activations (walk_acts without scratch), the warps'
// scratch rows, the block's weight slices (walk_cluster_load). In bf16 the inputs of layers
// 0..3 are stored BF16-rounded (the state rows, h1, h2 and the heads' hidden rows: what the
// next layer's dot would round them to; the heads' outputs stay f32 for the Q rows), and the
// dots skip the rounding (WalkWeights::x_rounded): the same products. Every block runs the
// same passes on the same values; block 0 writes the records. hold_rows <= WALK_HOLD_MAX (the
// plan, fast/kernels/walk.py plan_greedy_walk_hold, picks the most that fit).
#define WALK_HOLD_MAX 16

// The state row of input j < w: the env of step k + j if the position were held since step
// k (bar t + j, time in position + j when not flat): market features, then env_write_state's
// tail; BF16-rounded in bf16 mode. Every thread of the block takes a share.
static __device__ __forceinline__ void walk_hold_rows(float* base, int stride, int w,
                                                      const float* features, int n_features,
                                                      const float* close, const EnvLocal& s,
                                                      int state_dim, int n_bars, bool round) {
    for (int i = threadIdx.x; i < w * n_features; i += blockDim.x) {
        const int j = i / n_features;
        const int f = i - j * n_features;
        const int t = min(s.t + j, n_bars - 1);
        base[j * stride + f] = walk_operand(features[(long long)t * n_features + f], round);
    }
    for (int j = threadIdx.x; j < w; j += blockDim.x) {
        EnvLocal h = s;
        h.t = min(s.t + j, n_bars - 1);
        h.time_in_position = s.position != 0.0f ? s.time_in_position + j : 0;
        float* tail = base + j * stride + n_features;
        env_write_state(tail, features, 0, close, h, state_dim - n_features);
        for (int c = 0; c < ENV_N_POSITION_FEATURES; ++c) {
            tail[c] = walk_operand(tail[c], round);
        }
    }
}

// Step k + j's env state when the position is held from the pass's state s.
static __device__ __forceinline__ EnvLocal walk_held(const EnvLocal& s, int j) {
    EnvLocal h = s;
    h.t = s.t + j;
    h.steps = s.steps + j;
    h.time_in_position = s.position != 0.0f ? s.time_in_position + j : 0;
    return h;
}

// What one pass and the loops around it share: the network, the block's slices, the inputs'
// layout (stride floats each, w_max of them from `acts`), the scratch rows, the tables.
struct WalkHold {
    WalkNet n;
    WalkActs a0;  // input 0 (and the layers' shapes)
    float* acts;
    int stride;
    int w_max;
    float* scratch;
    WalkSlices sl;
    float bound;
    const float* z;
    bool use_bf16;
    const float* close;
    const float* high;
    const float* low;
    const float* features;
    int n_features;
    const float* costs;
    int n_bars;
    int state_dim;
};

// The block's part of a WalkHold: its slices loaded after the inputs and the scratch rows.
static __device__ __forceinline__ WalkHold walk_hold_setup(
    const float* __restrict__ params, const unsigned short* __restrict__ params_bf16,
    const int* __restrict__ param_offsets, int bf16, int state_dim, int h1, int h2, int value_h,
    int adv_h, int num_atoms, int n_branches, const int* __restrict__ n_actions,
    const int* __restrict__ action_offset, const float* __restrict__ z, int z_stride,
    const float* __restrict__ isv, int isv_index, float h2_clamp_mult,
    const float* __restrict__ close, const float* __restrict__ high,
    const float* __restrict__ low, const float* __restrict__ features, int n_features,
    const float* __restrict__ costs, int n_bars, int hold_rows, float* shared, int rank,
    int warp, int lane) {
    WalkHold c;
    c.n = walk_net(param_offsets, state_dim, h1, h2, value_h, adv_h, num_atoms, n_branches,
                   n_actions, action_offset, z_stride);
    c.a0 = walk_acts(shared, c.n, 0);
    c.acts = shared;
    c.stride = (int)(c.a0.end - shared);
    c.w_max = max(1, min(hold_rows, WALK_HOLD_MAX));
    c.scratch = shared + c.w_max * c.stride;
    c.use_bf16 = bf16 != 0;
    c.sl = walk_cluster_load(c.n, c.a0, c.scratch + 2 * WALK_CLUSTER_WARPS * c.n.na, rank,
                             params, params_bf16, c.use_bf16, warp, lane);
    c.sl.w.x_rounded = true;  // (walk_operand is the identity in f32 mode anyway)
    c.bound = __fmul_rn(h2_clamp_mult, fmaxf(isv[isv_index], 1.0f));
    c.z = z;
    c.close = close;
    c.high = high;
    c.low = low;
    c.features = features;
    c.n_features = n_features;
    c.costs = costs;
    c.n_bars = n_bars;
    c.state_dim = state_dim;
    return c;
}

static __device__ __forceinline__ const float* walk_hold_q(const WalkHold& c, int j) {
    return walk_acts(c.acts + j * c.stride, c.n, 0).q;
}

// One pass (header): the network on w rows held from s (cnt of them real steps); returns m,
// the first row whose greedy exposure is not the hold (cnt when all hold), in every thread.
// Afterwards the Q rows of branch 0 of every input, and of every branch for rows [first, m]
// (first = 0 with margins, else m; row m only when m < cnt) are in shared memory. `m_slot`: a
// __shared__ int of the block.
static __device__ __forceinline__ int walk_hold_pass(const WalkHold& c, const EnvLocal& s, int w,
                                                     int cnt, bool margins, int* m_slot,
                                                     int warp, int lane) {
    const WalkNet& n = c.n;
    walk_hold_rows(c.acts, c.stride, w, c.features, c.n_features, c.close, s, c.state_dim,
                   c.n_bars, c.use_bf16);
    __syncthreads();
#pragma unroll
    for (int l = 0; l < WALK_LAYERS; ++l) {
        const WalkLayer L = walk_layer_of(l, n, c.a0);
        const int out_off = (int)(L.out - c.acts);
        const int in_off = (int)(L.in - c.acts);
        const bool round_out = c.use_bf16 && l + 1 < WALK_LAYERS;  // the next layer's input
        for (int r = c.sl.r0[l] + warp; r < c.sl.r1[l]; r += WALK_CLUSTER_WARPS) {
            const int x_off = in_off + walk_row(l, r, n).in;
            const int w_r = c.sl.w_base[l] + walk_slice_offset(L, c.sl.r0[l], r);
            const int k_r = walk_fan_in(L, r);
            const float bias = c.sl.bias_s[c.sl.b_base[l] + r - c.sl.r0[l]];
            for (int j = 0; j < w; j += 2) {  // inputs j, j + 1: two chains, one row
                const int j2 = min(j + 1, w - 1);
                float dot, dot2;
                walk_dot2(c.acts + j * c.stride + x_off, w_r, c.acts + j2 * c.stride + x_off,
                          w_r, c.sl.w, k_r, lane, dot, dot2);
                const float v = walk_operand(walk_epilogue(dot, bias, L.epilogue, c.bound),
                                             round_out);
                const float v2 = walk_operand(walk_epilogue(dot2, bias, L.epilogue, c.bound),
                                              round_out);
                if (lane < WALK_CLUSTER) {
                    WalkCluster::store(c.acts + j * c.stride + out_off + r, v, lane);
                    if (j2 != j) {
                        WalkCluster::store(c.acts + j2 * c.stride + out_off + r, v2, lane);
                    }
                }
            }
        }
        WalkCluster::sync();
    }
    const int n0 = n.n_actions[0];
    for (int i = warp; i < w * n0; i += WALK_CLUSTER_WARPS) {  // branch 0 of every input
        const int j = i / n0;
        walk_q_row(n, walk_acts(c.acts + j * c.stride, n, 0), c.z, i - j * n0,
                   c.scratch + 2 * warp * n.na, lane);
    }
    __syncthreads();
    if (warp == 0) {
        const int hold = __float2int_rn(s.position) + 1;
        const bool holds = lane < cnt && double_dqn_argmax(walk_hold_q(c, min(lane, w - 1)),
                                                           n0) == hold;
        const unsigned int breaks = __ballot_sync(kFullMask, lane < cnt && !holds);
        if (lane == 0) {
            *m_slot = breaks ? __ffs(breaks) - 1 : cnt;
        }
    }
    __syncthreads();
    const int m = *m_slot;
    const int first = margins ? 0 : m;
    const int last = m < cnt ? m : m - 1;
    const int others = n.a_total - n0;
    for (int i = warp; i < (last - first + 1) * others; i += WALK_CLUSTER_WARPS) {
        const int j = first + i / others;
        walk_q_row(n, walk_acts(c.acts + j * c.stride, n, 0), c.z, n0 + i % others,
                   c.scratch + 2 * warp * n.na, lane);
    }
    __syncthreads();
    return m;
}

// The full greedy choice of one Q row (one thread): walk_advance's actions and margin (branch
// order), defaults for the branches that do not exist.
static __device__ __forceinline__ void walk_choose_all(const WalkNet& n, const float* q,
                                                       int* act, float* margin) {
    act[0] = 0;
    act[1] = ENV_DEFAULT_ORDER;
    act[2] = ENV_DEFAULT_URGENCY;
    float mg = __int_as_float(0x7f800000);
    for (int d = 0; d < n.nb; ++d) {
        float gap;
        act[d] = walk_choose(q + n.action_offset[d], n.n_actions[d], &gap);
        mg = fminf(mg, gap);
    }
    *margin = mg;
}

// The held steps of a pass (warp 0; lane j < m): step s.steps + j as the walk runs it (its
// own state, env_advance: nothing trades; the other branches' choices matter only for the
// margin, computed when recorded). `writer`: this block records.
static __device__ __forceinline__ void walk_hold_records(
    const WalkHold& c, const EnvLocal& s, int m, bool writer, float* __restrict__ rec_reward,
    float* __restrict__ rec_held, float* __restrict__ rec_cost, float* __restrict__ rec_margin,
    int record_len, int lane) {
    if (lane >= m) {
        return;
    }
    EnvLocal h = walk_held(s, lane);
    int act[3] = {__float2int_rn(s.position) + 1, ENV_DEFAULT_ORDER, ENV_DEFAULT_URGENCY};
    float margin = 0.0f;
    if (rec_margin != nullptr) {
        walk_choose_all(c.n, walk_hold_q(c, lane), act, &margin);
    }
    const int k = h.steps;
    const EnvOutcome o = env_advance(h, act[0], act[1], act[2], c.close, c.high, c.low, c.costs,
                                     c.n_bars, 0);
    if (writer && o.live && k < record_len) {
        rec_reward[k] = o.reward;
        rec_held[k] = o.held;
        rec_cost[k] = o.cost;
        if (rec_margin != nullptr) {
            rec_margin[k] = margin;
        }
    }
}

// The walk from s to step `steps`, one pass after another with adaptive rows (header); every
// block of the cluster; `writer`: this block records. `next`: 5 __shared__ ints, `m_slot` one.
static __device__ __forceinline__ void walk_hold_loop(
    const WalkHold& c, EnvLocal s, int steps, bool writer, float* __restrict__ rec_reward,
    float* __restrict__ rec_held, float* __restrict__ rec_cost, float* __restrict__ rec_margin,
    int record_len, int* next_slot, int* m_slot, int warp, int lane) {
    int w = 1;
    while (s.steps < steps) {
        const int cnt = min(w, steps - s.steps);
        const int m = walk_hold_pass(c, s, w, cnt, rec_margin != nullptr, m_slot, warp, lane);
        if (warp == 0) {
            walk_hold_records(c, s, m, writer, rec_reward, rec_held, rec_cost, rec_margin,
                              record_len, lane);
            EnvLocal next = walk_held(s, m);
            if (m < cnt) {  // step s.steps + m: the full greedy action of its row
                walk_advance(next, c.n, walk_hold_q(c, m), writer && lane == 0, nullptr,
                             c.close, c.high, c.low, c.features, c.n_features, c.costs,
                             c.n_bars, rec_reward, rec_held, rec_cost, rec_margin, record_len,
                             lane);
            }
            if (lane == 0) {
                next_slot[0] = next.t;
                next_slot[1] = next.steps;
                next_slot[2] = next.time_in_position;
                next_slot[3] = __float_as_int(next.position);
                next_slot[4] = __float_as_int(next.entry_price);
            }
        }
        __syncthreads();
        s.t = next_slot[0];
        s.steps = next_slot[1];
        s.time_in_position = next_slot[2];
        s.position = __int_as_float(next_slot[3]);
        s.entry_price = __int_as_float(next_slot[4]);
        w = m < cnt ? min(c.w_max, m + 1) : min(c.w_max, 2 * w);
        // (next_slot and m_slot are written again only after the next pass's barriers; the
        // state rows are block-local and read by layer 0 alone; a block racing ahead sends
        // only layer-0 values, into h1, which the others finished reading before their last
        // sync.)
    }
}

extern "C" __global__ void __cluster_dims__(WALK_CLUSTER, 1, 1)
__launch_bounds__(WALK_CLUSTER_THREADS, 1)
greedy_walk_hold(const float* __restrict__ params, const unsigned short* __restrict__ params_bf16,
                 const int* __restrict__ param_offsets, int bf16, int state_dim, int h1, int h2,
                 int value_h, int adv_h, int num_atoms, int n_branches,
                 const int* __restrict__ n_actions, const int* __restrict__ action_offset,
                 const float* __restrict__ z, int z_stride,
                 const float* __restrict__ isv, int isv_index,
                 float h2_clamp_mult, const float* __restrict__ close,
                 const float* __restrict__ high, const float* __restrict__ low,
                 const float* __restrict__ features, int n_features,
                 const float* __restrict__ costs, int n_bars, const int* __restrict__ start,
                 const int* __restrict__ n_steps, int hold_rows, float* __restrict__ rec_reward,
                 float* __restrict__ rec_held, float* __restrict__ rec_cost,
                 float* __restrict__ rec_margin, int record_len) {
    extern __shared__ float walk_shared[];
    __shared__ int walk_slots[6];  // the next state (5), m
    const int lane = threadIdx.x % kWarp;
    const int warp = threadIdx.x / kWarp;
    const int rank = WalkCluster::rank();
    const WalkHold c = walk_hold_setup(params, params_bf16, param_offsets, bf16, state_dim, h1,
                                       h2, value_h, adv_h, num_atoms, n_branches, n_actions,
                                       action_offset, z, z_stride, isv, isv_index,
                                       h2_clamp_mult, close, high, low, features, n_features,
                                       costs, n_bars, hold_rows, walk_shared, rank, warp,
                                       lane);
    WalkCluster::sync();  // every block has started and holds its slices
    walk_hold_loop(c, env_fresh(start[0]), n_steps[0], rank == 0, rec_reward, rec_held, rec_cost,
                   rec_margin, record_len, walk_slots, walk_slots + 5, warp, lane);
}

// ------------------------------------------------------------------------------------------
// greedy_walk_spans: hold passes over the remaining steps on many clusters at once
// ------------------------------------------------------------------------------------------
// Twin of one launch: foxhunt.reference.kernels.walk_spans.greedy_walk_spans_pass (its
// docstring is the specification); launches 0 .. n_passes together: greedy_walk's records
// (bitwise greedy_walk_cluster's). Launch p (grid n_chunks clusters; the tail, p == n_passes,
// needs cluster 0 only):
//   1. the base state S: flat at step 0 (p = 0), else the previous launch committed
//      (walk_span_commit): from its base state[prev] and the first break over its clusters
//      (min of brk[prev][g][0]), every step up to the break held, the break's step walked with
//      the action that cluster stored (its record written here), S the state after it (every
//      thread computes S alike; cluster 0's thread 0 writes the record and state[cur]);
//   2. p < n_passes: cluster g checks its span of the remaining steps (ceil(rem / n_chunks)
//      each) under "held from S" with hold passes of hold_rows rows (walk_hold_pass), writes
//      the held steps' records and stops at its first break: brk[cur][g] = (step from S, the
//      row's full greedy action, its margin's bits), or NONE when its whole span held;
//   3. p == n_passes: cluster 0 walks from S to the end (walk_hold_loop).
// The evaluator (fast/eval_plan.py fused_ops) launches passes 0 .. n_passes - 1 only, then
// greedy_walk_round's rounds with this walk's buffers as their span base in place of the tail
// (a policy that trades every few bars leaves the tail nearly every step: the rounds walk them
// in parallel chunks); the tail serves the span walk on its own (its test entry).
// Records of a cluster's held steps past the global break are wrong, and rewritten: every
// step is written last by the launch whose checked prefix holds it (or by a commit or the
// tail), and no later launch starts before it. One agent that buys and holds: the first launch
// checks every step, 16 clusters at once. state int32 [2, 5] (t, steps, time in position, the
// position's and the entry price's bits) and brk int32 [2, n_chunks, 5] by launch parity.
#define WALK_SPAN_NONE 2147483647

static __device__ __forceinline__ EnvLocal walk_load_state(const int* p) {
    EnvLocal s;
    s.t = p[0];
    s.steps = p[1];
    s.time_in_position = p[2];
    s.position = __int_as_float(p[3]);
    s.entry_price = __int_as_float(p[4]);
    return s;
}

// Step 1's commit of a launch's outcome (header; twin: reference walk_spans._commit): from the
// base state[src] and the first break over brk[src]'s n_chunks clusters (the first cluster with
// the minimum), every step up to the break held, the break's step walked with the action that
// cluster stored; returns the state after it (the base held to `steps` without a break; the
// base itself when it is already there). Every thread computes it alike; `writer` writes the
// break step's record row. greedy_walk_spans' launches p > 0 commit launch p - 1 (src = prev),
// greedy_walk_round its span base (src = (span_passes - 1) & 1).
static __device__ __forceinline__ EnvLocal walk_span_commit(
    const int* __restrict__ state, const int* __restrict__ brk, int n_chunks, int src, int steps,
    const float* __restrict__ close, const float* __restrict__ high,
    const float* __restrict__ low, const float* __restrict__ costs, int n_bars, bool writer,
    float* __restrict__ rec_reward, float* __restrict__ rec_held, float* __restrict__ rec_cost,
    float* __restrict__ rec_margin, int record_len) {
    const EnvLocal sp = walk_load_state(state + 5 * src);
    if (sp.steps >= steps) {
        return sp;
    }
    const int* b = brk + 5 * src * n_chunks;
    int m = WALK_SPAN_NONE;
    int gs = 0;
    for (int e = 0; e < n_chunks; ++e) {
        if (b[5 * e] < m) {
            m = b[5 * e];
            gs = e;
        }
    }
    const int rem = steps - sp.steps;
    EnvLocal s = walk_held(sp, min(m, rem));
    if (m < rem) {  // the break's step, with the action its cluster stored
        const int* a = b + 5 * gs;
        const int k = s.steps;
        const EnvOutcome o = env_advance(s, a[1], a[2], a[3], close, high, low, costs, n_bars, 0);
        if (writer && o.live && k < record_len) {
            rec_reward[k] = o.reward;
            rec_held[k] = o.held;
            rec_cost[k] = o.cost;
            if (rec_margin != nullptr) {
                rec_margin[k] = __int_as_float(a[4]);
            }
        }
    }
    return s;
}

extern "C" __global__ void __cluster_dims__(WALK_CLUSTER, 1, 1)
__launch_bounds__(WALK_CLUSTER_THREADS, 1)
greedy_walk_spans(const float* __restrict__ params,
                  const unsigned short* __restrict__ params_bf16,
                  const int* __restrict__ param_offsets, int bf16, int state_dim, int h1, int h2,
                  int value_h, int adv_h, int num_atoms, int n_branches,
                  const int* __restrict__ n_actions, const int* __restrict__ action_offset,
                  const float* __restrict__ z, int z_stride,
                  const float* __restrict__ isv, int isv_index,
                  float h2_clamp_mult, const float* __restrict__ close,
                  const float* __restrict__ high, const float* __restrict__ low,
                  const float* __restrict__ features, int n_features,
                  const float* __restrict__ costs, int n_bars, const int* __restrict__ start,
                  const int* __restrict__ n_steps, int n_chunks, int n_passes, int pass_index,
                  int hold_rows, int* __restrict__ state, int* __restrict__ brk,
                  float* __restrict__ rec_reward, float* __restrict__ rec_held,
                  float* __restrict__ rec_cost, float* __restrict__ rec_margin, int record_len) {
    extern __shared__ float walk_shared[];
    __shared__ int walk_slots[6];  // the next state (5), m
    const int lane = threadIdx.x % kWarp;
    const int warp = threadIdx.x / kWarp;
    const int rank = WalkCluster::rank();
    const int g = blockIdx.x / WALK_CLUSTER;
    const int cur = pass_index & 1;
    const int prev = 1 - cur;
    const int steps = n_steps[0];
    const bool leader = g == 0 && rank == 0 && threadIdx.x == 0;
    // 1. The base state (every thread alike).
    const EnvLocal s = pass_index > 0
        ? walk_span_commit(state, brk, n_chunks, prev, steps, close, high, low, costs, n_bars,
                           leader, rec_reward, rec_held, rec_cost, rec_margin, record_len)
        : env_fresh(start[0]);
    if (leader) {
        int* out = state + 5 * cur;
        out[0] = s.t;
        out[1] = s.steps;
        out[2] = s.time_in_position;
        out[3] = __float_as_int(s.position);
        out[4] = __float_as_int(s.entry_price);
    }
    const int rem = steps - s.steps;
    int* mine = brk + 5 * (cur * n_chunks + g);
    int j0 = 0;
    int len = 0;
    if (pass_index < n_passes) {
        const int span = rem > 0 ? (rem + n_chunks - 1) / n_chunks : 0;
        j0 = g * span;
        len = min(span, rem - j0);
        if (len <= 0 || g >= n_chunks) {
            if (rank == 0 && threadIdx.x == 0 && g < n_chunks) {
                mine[0] = WALK_SPAN_NONE;
                mine[1] = mine[2] = mine[3] = mine[4] = 0;
            }
            return;  // (every block of the cluster alike)
        }
    } else if (g != 0 || rem <= 0) {
        return;  // the tail: cluster 0 alone
    }
    const WalkHold c = walk_hold_setup(params, params_bf16, param_offsets, bf16, state_dim, h1,
                                       h2, value_h, adv_h, num_atoms, n_branches, n_actions,
                                       action_offset, z, z_stride, isv, isv_index,
                                       h2_clamp_mult, close, high, low, features, n_features,
                                       costs, n_bars, hold_rows, walk_shared, rank, warp,
                                       lane);
    WalkCluster::sync();  // every block has started and holds its slices
    if (pass_index == n_passes) {  // 3. the tail
        walk_hold_loop(c, s, steps, rank == 0, rec_reward, rec_held, rec_cost, rec_margin,
                       record_len, walk_slots, walk_slots + 5, warp, lane);
        return;
    }
    // 2. The span, held from s: passes of w_max rows until the first break.
    EnvLocal base = walk_held(s, j0);
    const bool margins = rec_margin != nullptr;
    for (int done = 0; done < len;) {
        const int cnt = min(c.w_max, len - done);
        const int m = walk_hold_pass(c, base, c.w_max, cnt, margins, walk_slots + 5, warp, lane);
        if (warp == 0) {
            walk_hold_records(c, base, m, rank == 0, rec_reward, rec_held, rec_cost, rec_margin,
                              record_len, lane);
        }
        if (m < cnt) {
            if (rank == 0 && threadIdx.x == 0) {
                int act[3];
                float margin;
                walk_choose_all(c.n, walk_hold_q(c, m), act, &margin);
                mine[0] = j0 + done + m;
                mine[1] = act[0];
                mine[2] = act[1];
                mine[3] = act[2];
                mine[4] = __float_as_int(margin);
            }
            return;
        }
        base = walk_held(base, cnt);
        done += cnt;
        __syncthreads();  // (warp 0's records read the Q rows the next pass rewrites)
    }
    if (rank == 0 && threadIdx.x == 0) {
        mine[0] = WALK_SPAN_NONE;
        mine[1] = mine[2] = mine[3] = mine[4] = 0;
    }
}

// ------------------------------------------------------------------------------------------
// greedy_walk_round: the walk in parallel chunks (speculation, then repair), ONE round per launch
// ------------------------------------------------------------------------------------------
// Twin: foxhunt.reference.kernels.walk_rounds.greedy_walk_round (its docstring is the
// specification). The base S and its step k_S: flat at step 0 when span_state is null; else
// the span walk's commit of its launch span_passes - 1 (walk_span_commit of span_state[src],
// span_brk[src] over span_chunks clusters, src = (span_passes - 1) & 1: what greedy_walk_spans'
// launch pass_index == n_passes computes in its step 1; every thread alike, every round; round
// 0's cluster 0 thread 0 writes the break step's record row). The steps [k_S, steps) (steps =
// min(n_steps, record_len)) are split into n_chunks chunks of L = ceil((steps - k_S) /
// n_chunks) steps; chunk g (steps [k_S + g L, min(k_S + (g + 1) L, steps))) is walked by
// cluster g (blocks [g C, (g + 1) C)) with greedy_walk_cluster's bar (walk_cluster_bar: the
// same values, so the same bits). An env state is compared by its key (walk_key: time in
// position, position, and the entry price only when the position is not flat: flat, it changes
// nothing that follows), as int32 bit patterns. trace [record_len, 3]: the key at the start of
// each step of the chunk's last run (rows are the segment's steps); ends [2, n_chunks, 3]: the
// key after each chunk's last step, as of the rounds of parity 0 and 1.
//   round 0: chunk 0 from S (exact), every other chunk from flat (its guess), writing trace,
//   the records and ends[0][g];
//   round r > 0 (p = r & 1, q = 1 - p): chunk 0 copies ends[q][0] to ends[p][0] (it started
//   from the true state: exact since round 0); chunk g > 0 takes in = ends[q][g - 1]; if in
//   equals trace[k0] its last run stands (ends[p][g] = ends[q][g]); else it walks again from
//   in and stops at the first later step k whose key equals trace[k] (its last run from there
//   stands: the walk is deterministic), else ends[p][g] = the key after its last step.
// The walk stops at record_len steps (trace has record_len rows; greedy_walk_cluster records no
// row past it either). After round r chunks 0..r are exact, so n_chunks rounds give
// greedy_walk_cluster's records bit for bit (with a span base: greedy_walk_spans' launches 0 ..
// span_passes - 1, then these rounds); a round in which no chunk walks changes nothing, and
// when the spans walked every step (k_S == steps) the rounds write only round 0's commit row.
// The evaluator launches n_chunks rounds after the span launches (fast/eval_plan.py fused_ops):
// a trading policy converges in two (round 1 reruns each chunk until it merges), the later
// rounds only compare keys.
// Every block of a cluster reads the same keys and runs the same env (warp 0), so all decide
// alike (no extra barrier); block 0's thread 0 writes trace and ends. A key of step k + 1 is read
// at the top of bar k, before block 0 can rewrite it at the top of bar k + 1 (the layer barriers
// of bar k lie between). NaN positions or prices would make keys that never match: the chunks
// then just walk to their ends (still exact).

// The key of an env state (header).
static __device__ __forceinline__ int3 walk_key(const EnvLocal& s) {
    return make_int3(s.time_in_position, __float_as_int(s.position),
                     s.position != 0.0f ? __float_as_int(s.entry_price) : 0);
}

static __device__ __forceinline__ int3 walk_load_key(const int* p) {
    return make_int3(p[0], p[1], p[2]);
}

static __device__ __forceinline__ void walk_store_key(int* p, int3 key) {
    p[0] = key.x;
    p[1] = key.y;
    p[2] = key.z;
}

static __device__ __forceinline__ bool walk_same_key(int3 a, int3 b) {
    return a.x == b.x && a.y == b.y && a.z == b.z;
}

extern "C" __global__ void __cluster_dims__(WALK_CLUSTER, 1, 1)
__launch_bounds__(WALK_CLUSTER_THREADS, 1)
greedy_walk_round(const float* __restrict__ params,
                  const unsigned short* __restrict__ params_bf16,
                  const int* __restrict__ param_offsets, int bf16, int state_dim, int h1, int h2,
                  int value_h, int adv_h, int num_atoms, int n_branches,
                  const int* __restrict__ n_actions, const int* __restrict__ action_offset,
                  const float* __restrict__ z, int z_stride,
                  const float* __restrict__ isv, int isv_index,
                  float h2_clamp_mult, const float* __restrict__ close,
                  const float* __restrict__ high, const float* __restrict__ low,
                  const float* __restrict__ features, int n_features,
                  const float* __restrict__ costs, int n_bars, const int* __restrict__ start,
                  const int* __restrict__ n_steps, int n_chunks, int round, int span_chunks,
                  int span_passes, const int* __restrict__ span_state,
                  const int* __restrict__ span_brk, int* __restrict__ trace,
                  int* __restrict__ ends,
                  float* __restrict__ rec_reward, float* __restrict__ rec_held,
                  float* __restrict__ rec_cost, float* __restrict__ rec_margin, int record_len) {
    extern __shared__ float walk_shared[];
    __shared__ int walk_merged;
    const int lane = threadIdx.x % kWarp;
    const int warp = threadIdx.x / kWarp;
    const int rank = WalkCluster::rank();
    const int g = blockIdx.x / WALK_CLUSTER;  // the cluster: its chunk
    const bool leader = rank == 0 && threadIdx.x == 0;
    // The base (every thread alike; round 0's cluster 0 leader writes the commit's row).
    const EnvLocal base = span_state != nullptr
        ? walk_span_commit(span_state, span_brk, span_chunks, (span_passes - 1) & 1, n_steps[0],
                           close, high, low, costs, n_bars, round == 0 && g == 0 && leader,
                           rec_reward, rec_held, rec_cost, rec_margin, record_len)
        : env_fresh(start[0]);
    const int steps = min(n_steps[0], record_len);  // trace has record_len rows
    const int rem = steps - base.steps;
    const int len = (rem + n_chunks - 1) / n_chunks;
    const int k0 = base.steps + g * len;
    const int k1 = min(k0 + len, steps);
    if (g >= n_chunks || rem <= 0 || k0 >= k1) {
        return;  // an empty chunk (every block of the cluster alike)
    }
    const int p = round & 1;
    int* end_now = ends + 3 * (p * n_chunks + g);
    const int* end_before = ends + 3 * ((1 - p) * n_chunks + g);
    EnvLocal s = base;  // chunk 0's start (its steps are k0)
    if (g > 0) {  // the guess: flat at step k0
        s = env_fresh(start[0] + k0);
        s.steps = k0;
    }
    if (round > 0) {
        const int3 in = g > 0 ? walk_load_key(end_before - 3) : make_int3(0, 0, 0);
        if (g == 0 || walk_same_key(in, walk_load_key(trace + 3 * k0))) {
            if (leader) {  // the chunk's last run stands
                walk_store_key(end_now, walk_load_key(end_before));
            }
            return;
        }
        s.time_in_position = in.x;
        s.position = __int_as_float(in.y);
        s.entry_price = __int_as_float(in.z);
    }
    const WalkNet n = walk_net(param_offsets, state_dim, h1, h2, value_h, adv_h, num_atoms,
                               n_branches, n_actions, action_offset, z_stride);
    const WalkActs a = walk_acts(walk_shared, n, WALK_CLUSTER_WARPS);
    const WalkSlices sl = walk_cluster_load(n, a, a.end, rank, params, params_bf16, bf16 != 0,
                                            warp, lane);
    const float bound = __fmul_rn(h2_clamp_mult, fmaxf(isv[isv_index], 1.0f));
    WALK_PROF_DECL;  // (not stored: walk_profile times the other two kernels)
    int t = s.t;
    walk_state_row(a.x, features, n_features, close, s, state_dim, WALK_CLUSTER_THREADS);
    // Every block has started, holds its slices and the first state row, and has read
    // trace[k0] (block 0 rewrites it below).
    WalkCluster::sync();
    bool merged = false;
    for (int k = k0; k < k1; ++k) {
        walk_prefetch_next(t, close, high, low, features, n_features, n_bars);
        int3 before = make_int3(0, 0, 0);  // trace[k + 1] of the last run (rounds > 0)
        if (warp == 0) {
            if (leader) {
                walk_store_key(trace + 3 * k, walk_key(s));
            }
            if (round > 0 && k + 1 < k1) {
                before = walk_load_key(trace + 3 * (k + 1));
            }
        }
        t = walk_cluster_bar(s, t, k, steps, n, a, sl, bound, z, leader, close, high, low,
                             features, n_features, costs, n_bars, rec_reward, rec_held, rec_cost,
                             rec_margin, record_len, nullptr, false, warp, lane, prof);
        if (threadIdx.x == 0) {
            walk_merged = round > 0 && k + 1 < k1 && walk_same_key(walk_key(s), before);
        }
        __syncthreads();  // x holds bar k + 1's state; walk_merged is the block's decision
        if (walk_merged) {
            merged = true;
            break;
        }
    }
    if (leader) {
        walk_store_key(end_now, merged ? walk_load_key(end_before) : walk_key(s));
    }
}
