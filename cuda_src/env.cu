// The environment on the device (twin: foxhunt.reference.kernels.env, same names; SPEC 10):
// env_reset, env_observe, env_step (N parallel walks, one thread per env), env_act (epsilon-
// greedy actions from the forward's branch-packed expected Q) and eval_metrics (a walk's
// segment metrics in float64, one block).
//
// Graph-friendly: every value that changes between replays of a captured graph is read through
// a pointer (the env state, the exploration rate eps, the collector's cycle counter: int64,
// cycle[0] is the draws' offset, as replay_sample reads it); the seed (the Philox key, two
// words), the stream ids (rng.STREAMS, passed in: the ids live there only) and the shapes are
// launch constants. No atomics; every output is
// written by one thread, so results are bitwise repeatable.

#include "env.cuh"  // env_step_one, env_choose (and distributional.cuh's double_dqn_argmax)

#define ENV_THREADS 128
#define EVAL_THREADS 256
#define EVAL_WARPS (EVAL_THREADS / 32)
#define EVAL_TILE 2048

// eval_metrics' outputs (reference EVAL_FIELDS = metrics.METRIC_NAMES, in order).
#define EVAL_SHARPE 0
#define EVAL_TOTAL_RETURN 1
#define EVAL_MAX_DRAWDOWN 2
#define EVAL_TURNOVER 3
#define EVAL_COSTS 4

// float64 +Inf and quiet NaN, as bit patterns (no header needed).
#define EVAL_INF __longlong_as_double(0x7ff0000000000000LL)
#define EVAL_NAN __longlong_as_double(0x7ff8000000000000LL)

#define ENV_FLAT_LOOP(i, n) \
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += gridDim.x * blockDim.x)

// ---------------------------------------------------------------------------------------------
// env_reset: every env starts flat at t = start[i] or, with start == nullptr, at the drawn
// offset env_draw_start(key, start_stream, cycle[0], i, min_start, last_start). One thread per env.
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void env_reset(const int* __restrict__ start, int n_envs, int min_start,
                                     int last_start, unsigned int key_lo, unsigned int key_hi,
                                     unsigned int start_stream,
                                     const long long* __restrict__ cycle,
                                     int* __restrict__ t, int* __restrict__ steps,
                                     int* __restrict__ time_in_position,
                                     float* __restrict__ position,
                                     float* __restrict__ entry_price) {
    ENV_FLAT_LOOP(i, n_envs) {
        const int t0 = (start != nullptr)
                           ? start[i]
                           : env_draw_start(key_lo, key_hi, start_stream,
                                            (unsigned long long)cycle[0], i, min_start,
                                            last_start);
        env_store(env_fresh(t0), t, steps, time_in_position, position, entry_price, i);
    }
}

// ---------------------------------------------------------------------------------------------
// env_observe: states[i, :] = the state row of env i (env_write_state). One thread per env.
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void env_observe(const float* __restrict__ features, int n_features,
                                       const float* __restrict__ close,
                                       const int* __restrict__ t,
                                       const float* __restrict__ position,
                                       const float* __restrict__ entry_price,
                                       const int* __restrict__ time_in_position, int n_envs,
                                       float* __restrict__ states, int state_dim) {
    ENV_FLAT_LOOP(i, n_envs) {
        EnvLocal s;
        s.t = t[i];
        s.position = position[i];
        s.entry_price = entry_price[i];
        s.time_in_position = time_in_position[i];
        env_write_state(states + (long long)i * state_dim, features, n_features, close, s,
                        state_dim);
    }
}

// ---------------------------------------------------------------------------------------------
// env_step: one step of every env (env_advance), in place on the state arrays. Per env i:
//   r[i] = reward * reward_scale, done[i] = 1.0f / 0.0f, next_ret[i], regime_out[i] = regime[t],
//   s2[i, :] = the state after the step (skipped when s2 == nullptr),
//   rec_*[steps * n_envs + i] = reward, held, cost while steps (before the step) < record_len
//     (skipped when record_len == 0; the greedy walk records every bar this way),
//   then, if done and auto_reset, a fresh episode at env_draw_start(key, start_stream,
//   cycle[0], i, min_start, last_start), and
//   obs[i, :] = the state after any reset. s2 and obs may be one buffer (obs is written last).
// actions [n_envs, n_branches] row-major; order and urgency default when n_branches < 3.
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(ENV_THREADS)
env_step(const float* __restrict__ close, const float* __restrict__ high,
         const float* __restrict__ low, const float* __restrict__ features, int n_features,
         const int* __restrict__ regime, int* __restrict__ t, int* __restrict__ steps,
         int* __restrict__ time_in_position, float* __restrict__ position,
         float* __restrict__ entry_price, int n_envs, const int* __restrict__ actions,
         int n_branches, float* __restrict__ rec_reward, float* __restrict__ rec_held,
         float* __restrict__ rec_cost, int record_len, const float* __restrict__ costs,
         int n_bars, int min_start, int last_start, int episode_len, int auto_reset,
         float reward_scale, int state_dim, unsigned int key_lo, unsigned int key_hi,
         unsigned int start_stream, const long long* __restrict__ cycle, float* __restrict__ r,
         float* __restrict__ done, float* s2, float* obs, float* __restrict__ next_ret,
         int* __restrict__ regime_out) {
    const EnvTables m = {close,     high,      low,         features, n_features,
                         regime,    costs,     n_bars,      min_start, last_start,
                         episode_len, auto_reset, reward_scale, state_dim};
    ENV_FLAT_LOOP(i, n_envs) {
        env_step_one(m, i, n_envs, actions + (long long)i * n_branches, n_branches, t, steps,
                     time_in_position, position, entry_price, rec_reward, rec_held, rec_cost,
                     record_len, key_lo, key_hi, start_stream, (unsigned long long)cycle[0], r,
                     done, s2, obs, next_ret, regime_out);
    }
}

// ---------------------------------------------------------------------------------------------
// env_act: actions[i, d] for env i and branch d (one thread each). q is branch-packed like the
// forward's expected-Q output: branch d's [n_envs, n_actions[d]] block at element
// n_envs * action_offset[d]. Greedy = double_dqn_argmax of the row, unless
// uniform(key, explore_stream, cycle[0], 2 nb i + 2 d) < eps[0]: then min(floor(uniform(key,
// action_stream, cycle[0], nb i + d) * n_d), n_d - 1) (rng.STREAMS "explore" and
// "explore_action").
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void env_act(const float* __restrict__ q, const int* __restrict__ n_actions,
                                   const int* __restrict__ action_offset, int n_branches,
                                   int n_envs, const float* __restrict__ eps,
                                   unsigned int key_lo, unsigned int key_hi,
                                   unsigned int explore_stream, unsigned int action_stream,
                                   const long long* __restrict__ cycle,
                                   int* __restrict__ actions) {
    ENV_FLAT_LOOP(k, n_envs * n_branches) {
        const int i = k / n_branches;
        actions[k] = env_choose(q, n_actions, action_offset, n_branches, n_envs, eps[0], key_lo,
                                key_hi, explore_stream, action_stream,
                                (unsigned long long)cycle[0], i, k - i * n_branches);
    }
}

// ---------------------------------------------------------------------------------------------
// eval_metrics: the walk's metrics (metrics.segment_metrics in float64), ONE block of
// EVAL_THREADS threads, out[EVAL_*] rounded to float32 once.
//   Sums (mean of r, sum of (r - mean)^2, turnover sum |p_k - p_{k-1}| with p_{-1} = 0, costs):
//   each thread's strided terms in order, then a fixed tree over the block (float64).
//   Equity: thread 0 runs the reference's sequential scan over tiles of r staged in shared
//   memory: E <- E * (1 + r_k), peak <- max(peak, E), dd <- max(dd, 1 - E / peak) (NaN sticks,
//   like np.max), from E = peak = 1, dd = 0: total return E - 1 and max drawdown are the
//   reference's float64 values bit for bit.
//   Sharpe = mean / sqrt(sum (r - mean)^2 / (n - 1)) * sqrt(bars_per_year); 0 when n < 2, all r
//   equal or the deviation is 0. NaN contract: the reference's (non-finite r: Sharpe, total
//   return, drawdown NaN; r <= -1: total return, drawdown NaN; non-finite p / c: turnover /
//   costs NaN).
// ---------------------------------------------------------------------------------------------

// op over one value per thread of the block (blockDim.x a multiple of 32, at most EVAL_THREADS):
// each warp's xor butterfly, then thread 0 over the warps in order. Every thread gets the result.
template <typename Op>
static __device__ __forceinline__ double eval_block_reduce(double v, Op op, double* scratch) {
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
    }
    __syncthreads();  // scratch may still hold the previous reduction's result
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double acc = scratch[0];
        for (int w = 1; w < (int)(blockDim.x / 32); ++w) {
            acc = op(acc, scratch[w]);
        }
        scratch[EVAL_WARPS] = acc;
    }
    __syncthreads();
    return scratch[EVAL_WARPS];
}

struct EvalAdd {
    __device__ __forceinline__ double operator()(double a, double b) const {
        return __dadd_rn(a, b);
    }
};
struct EvalMin {
    __device__ __forceinline__ double operator()(double a, double b) const { return fmin(a, b); }
};
struct EvalMax {
    __device__ __forceinline__ double operator()(double a, double b) const { return fmax(a, b); }
};

// np.max's rule: NaN wins and sticks.
static __device__ __forceinline__ double eval_max_keep_nan(double best, double x) {
    if (isnan(best)) {
        return best;
    }
    return (isnan(x) || x > best) ? x : best;
}

extern "C" __global__ void __launch_bounds__(EVAL_THREADS)
eval_metrics(const float* __restrict__ rewards, const float* __restrict__ positions,
             const float* __restrict__ costs, int n, double bars_per_year,
             float* __restrict__ out) {
    __shared__ float tile[EVAL_TILE];
    __shared__ double scratch[EVAL_WARPS + 1];
    double sum_r = 0.0, sum_turnover = 0.0, sum_costs = 0.0;
    double min_r = EVAL_INF, max_r = -EVAL_INF;
    int bad_r = 0, wiped = 0, bad_p = 0, bad_c = 0;
    double equity = 1.0, peak = 1.0, drawdown = 0.0;  // thread 0's sequential scan

    for (int base = 0; base < n; base += EVAL_TILE) {
        const int m = min(EVAL_TILE, n - base);
        for (int k = threadIdx.x; k < m; k += blockDim.x) {
            const int i = base + k;
            const float rf = rewards[i];
            tile[k] = rf;
            const double rv = (double)rf;
            bad_r |= !isfinite(rf);
            wiped |= rv <= -1.0;
            sum_r = __dadd_rn(sum_r, rv);
            min_r = fmin(min_r, rv);
            max_r = fmax(max_r, rv);
            const float pf = positions[i];
            const float prev = i > 0 ? positions[i - 1] : 0.0f;
            bad_p |= !isfinite(pf);
            sum_turnover = __dadd_rn(sum_turnover, fabs(__dsub_rn((double)pf, (double)prev)));
            const float cf = costs[i];
            bad_c |= !isfinite(cf);
            sum_costs = __dadd_rn(sum_costs, (double)cf);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int k = 0; k < m; ++k) {
                equity = __dmul_rn(equity, __dadd_rn(1.0, (double)tile[k]));
                peak = fmax(peak, equity);
                drawdown = eval_max_keep_nan(drawdown, __dsub_rn(1.0, __ddiv_rn(equity, peak)));
            }
        }
        __syncthreads();  // the next tile overwrites tile
    }
    bad_r = __syncthreads_or(bad_r);
    wiped = __syncthreads_or(wiped);
    bad_p = __syncthreads_or(bad_p);
    bad_c = __syncthreads_or(bad_c);
    sum_r = eval_block_reduce(sum_r, EvalAdd(), scratch);
    min_r = eval_block_reduce(min_r, EvalMin(), scratch);
    max_r = eval_block_reduce(max_r, EvalMax(), scratch);
    sum_turnover = eval_block_reduce(sum_turnover, EvalAdd(), scratch);
    sum_costs = eval_block_reduce(sum_costs, EvalAdd(), scratch);
    const double mean = n > 0 ? __ddiv_rn(sum_r, (double)n) : 0.0;
    double dev = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const double x = __dsub_rn((double)rewards[i], mean);
        dev = __dadd_rn(dev, __dmul_rn(x, x));
    }
    dev = eval_block_reduce(dev, EvalAdd(), scratch);

    if (threadIdx.x == 0) {
        const double nan = EVAL_NAN;
        double sharpe = 0.0;
        if (n >= 2 && min_r != max_r) {
            const double std = __dsqrt_rn(__ddiv_rn(dev, (double)(n - 1)));
            if (std != 0.0) {
                sharpe = __dmul_rn(__ddiv_rn(mean, std), __dsqrt_rn(bars_per_year));
            }
        }
        const bool solvent = !bad_r && !wiped;
        out[EVAL_SHARPE] = __double2float_rn(bad_r ? nan : sharpe);
        out[EVAL_TOTAL_RETURN] = __double2float_rn(solvent ? __dsub_rn(equity, 1.0) : nan);
        out[EVAL_MAX_DRAWDOWN] = __double2float_rn(solvent ? drawdown : nan);
        out[EVAL_TURNOVER] = __double2float_rn(bad_p ? nan : sum_turnover);
        out[EVAL_COSTS] = __double2float_rn(bad_c ? nan : sum_costs);
    }
}
