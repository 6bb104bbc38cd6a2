// The environment's per-env device code (twin: foxhunt.reference.kernels.env, whose module
// docstring is the specification): the unrealised PnL, the state row written for the network,
// the drawn restart offset and one env's step. cuda_src/env.cu's kernels run these on one
// thread per env; a fused evaluation kernel (the network's forward and the walk in one launch)
// can call them unchanged, so both give the same bits.
//
// No __global__ functions here. Arithmetic is the reference's float32 order, spelled with the
// round-to-nearest intrinsics (no contraction into FMA whatever -fmad says); tanhf is CUDA's
// (2 ulp), against NumPy's float32 tanh in the reference: the only inexact values.
#pragma once

#include "distributional.cuh"  // double_dqn_argmax: env_choose's greedy action
#include "rng.cuh"             // rng_uniform: the drawn restart offsets

// The cost table's entries (reference COST_FIELDS, the ExecutionCosts fields in order).
#define ENV_COST_FEE 0
#define ENV_COST_PASSIVE_FEE 1
#define ENV_COST_HALF_SPREAD 2
#define ENV_COST_SLIPPAGE_COEF 3
#define ENV_COST_PATIENT_SLIPPAGE_SCALE 4

// market.state_features: F market features, then these, then zeros.
#define ENV_N_POSITION_FEATURES 3
#define ENV_PNL_SCALE 100.0f
#define ENV_TIME_IN_POSITION_SCALE 64.0f

// Branch values (reference env: ORDER_*, URGENCY_*) and each branch's default when a
// configuration has fewer branches (market order, now). Exposure = action - 1 (short, flat, long).
#define ENV_ORDER_MARKET 0
#define ENV_ORDER_LIMIT 1
#define ENV_ORDER_PASSIVE 2
#define ENV_URGENCY_NOW 0
#define ENV_URGENCY_PATIENT 1
#define ENV_DEFAULT_ORDER ENV_ORDER_MARKET
#define ENV_DEFAULT_URGENCY ENV_URGENCY_NOW

// One env's state (structure-of-arrays entries loaded into registers).
struct EnvLocal {
    int t;
    int steps;
    int time_in_position;
    float position;
    float entry_price;
};

// One step's per-env results besides the new state.
struct EnvOutcome {
    float reward;    // held * next_ret - cost (unscaled)
    float held;      // position held during the bar
    float cost;      // costs paid for the step
    float next_ret;  // (C' - P) / P
    bool live;       // false: the env was at its last bar (frozen)
    bool done;
};

static __device__ __forceinline__ EnvLocal env_load(const int* t, const int* steps,
                                                    const int* time_in_position,
                                                    const float* position,
                                                    const float* entry_price, int i) {
    EnvLocal s;
    s.t = t[i];
    s.steps = steps[i];
    s.time_in_position = time_in_position[i];
    s.position = position[i];
    s.entry_price = entry_price[i];
    return s;
}

static __device__ __forceinline__ void env_store(const EnvLocal& s, int* t, int* steps,
                                                 int* time_in_position, float* position,
                                                 float* entry_price, int i) {
    t[i] = s.t;
    steps[i] = s.steps;
    time_in_position[i] = s.time_in_position;
    position[i] = s.position;
    entry_price[i] = s.entry_price;
}

// position * ((c - e) / e), e = entry_price, or c itself when flat.
static __device__ __forceinline__ float env_unrealised_pnl(float close_t, float position,
                                                           float entry_price) {
    const float entry = (position != 0.0f) ? entry_price : close_t;
    return __fmul_rn(position, __fdiv_rn(__fsub_rn(close_t, entry), entry));
}

// The state row [features[t] (F), position, tanh(PNL_SCALE pnl), tanh(time / TIME_SCALE), 0...].
static __device__ __forceinline__ void env_write_state(float* row, const float* features,
                                                       int n_features, const float* close,
                                                       const EnvLocal& s, int state_dim) {
    const float* f = features + (long long)s.t * n_features;
    for (int j = 0; j < n_features; ++j) {
        row[j] = f[j];
    }
    const float pnl = env_unrealised_pnl(close[s.t], s.position, s.entry_price);
    row[n_features] = s.position;
    row[n_features + 1] = tanhf(__fmul_rn(pnl, ENV_PNL_SCALE));
    row[n_features + 2] =
        tanhf(__fdiv_rn(__int2float_rn(s.time_in_position), ENV_TIME_IN_POSITION_SCALE));
    for (int j = n_features + ENV_N_POSITION_FEATURES; j < state_dim; ++j) {
        row[j] = 0.0f;
    }
}

// Restart offset of env i: min_start + min(floor(u * span), span - 1), span = last_start -
// min_start + 1, u = uniform(key, start_stream, cycle, i) (float32 product, truncated);
// start_stream is rng.STREAMS["episode_start"] (passed in: the ids live in rng.py only).
static __device__ __forceinline__ int env_draw_start(unsigned int key_lo, unsigned int key_hi,
                                                     unsigned int start_stream,
                                                     unsigned long long cycle, int i,
                                                     int min_start, int last_start) {
    const int span = last_start - min_start + 1;
    const float u = rng_uniform(key_lo, key_hi, start_stream, cycle, (unsigned int)i);
    const int k = __float2int_rz(__fmul_rn(u, __int2float_rn(span)));
    return min_start + min(k, span - 1);
}

// A fresh episode at bar t: flat, nothing held.
static __device__ __forceinline__ EnvLocal env_fresh(int t) {
    EnvLocal s;
    s.t = t;
    s.steps = 0;
    s.time_in_position = 0;
    s.position = 0.0f;
    s.entry_price = 0.0f;
    return s;
}

// One env's step (reference env_step's formula block), in place on s. Actions: exposure,
// order type, urgency (order/urgency given by the caller, defaults for missing branches).
static __device__ __forceinline__ EnvOutcome env_advance(EnvLocal& s, int exposure, int order,
                                                         int urgency, const float* close,
                                                         const float* high, const float* low,
                                                         const float* costs, int n_bars,
                                                         int episode_len) {
    const float fee = costs[ENV_COST_FEE];
    const float passive_fee = costs[ENV_COST_PASSIVE_FEE];
    const float half_spread = costs[ENV_COST_HALF_SPREAD];
    const float slip = costs[ENV_COST_SLIPPAGE_COEF];
    const float patient = costs[ENV_COST_PATIENT_SLIPPAGE_SCALE];
    EnvOutcome o;
    o.live = s.t < n_bars - 1;
    const int t1 = o.live ? s.t + 1 : s.t;
    const float price = close[s.t];
    const float next_close = close[t1];
    const float next_high = high[t1];
    const float next_low = low[t1];

    const float target = __int2float_rn(exposure - 1);
    const float delta = __fsub_rn(target, s.position);
    const float size = fabsf(delta);
    const bool trading = o.live && delta != 0.0f;
    const bool buy = delta > 0.0f;
    const bool is_market = order == ENV_ORDER_MARKET;
    const bool is_limit = order == ENV_ORDER_LIMIT;
    const bool is_passive = order == ENV_ORDER_PASSIVE;
    const bool limit_fill = buy ? (next_low < price) : (next_high > price);
    const bool passive_fill = buy ? (next_low < __fmul_rn(price, __fsub_rn(1.0f, half_spread)))
                                  : (next_high > __fmul_rn(price, __fadd_rn(1.0f, half_spread)));
    const bool filled =
        trading && (is_market || (is_limit && limit_fill) || (is_passive && passive_fill));
    const bool fallback = trading && !filled && urgency == ENV_URGENCY_NOW;

    const float range_t = __fdiv_rn(__fsub_rn(high[s.t], low[s.t]), close[s.t]);
    const float range_t1 = __fdiv_rn(__fsub_rn(next_high, next_low), next_close);
    const float urgency_scale = (urgency == ENV_URGENCY_PATIENT) ? patient : 1.0f;
    const float base = __fadd_rn(fee, half_spread);
    const float market_unit = __fadd_rn(base, __fmul_rn(__fmul_rn(slip, urgency_scale), range_t));
    const float fill_unit = is_market ? market_unit : (is_limit ? fee : passive_fee);
    const float fallback_unit = __fadd_rn(base, __fmul_rn(slip, range_t1));
    o.cost = __fadd_rn(filled ? __fmul_rn(size, fill_unit) : 0.0f,
                       fallback ? __fmul_rn(size, fallback_unit) : 0.0f);
    o.held = filled ? target : s.position;
    o.next_ret = o.live ? __fdiv_rn(__fsub_rn(next_close, price), price) : 0.0f;
    o.reward = o.live ? __fsub_rn(__fmul_rn(o.held, o.next_ret), o.cost) : 0.0f;

    const int held_on = (s.position != 0.0f) ? s.time_in_position + 1 : 0;
    s.time_in_position = filled ? (target != 0.0f ? 1 : 0)
                                : (fallback ? 0 : (o.live ? held_on : s.time_in_position));
    s.entry_price = filled ? price : (fallback ? next_close : s.entry_price);
    s.position = (filled || fallback) ? target : s.position;
    s.t = t1;
    s.steps = o.live ? s.steps + 1 : s.steps;
    o.done = !o.live || s.t >= n_bars - 1 || (episode_len > 0 && s.steps >= episode_len);
    return o;
}

// env_act's choice for env i and branch d (env.cu's env_act and the collector's fused
// collect_transition share it, so both give the same bits). q is branch-packed: branch d's
// [n_envs, n_actions[d]] block at element n_envs * action_offset[d]. Greedy = double_dqn_argmax
// of the row (distributional.cuh, included by the caller), unless uniform(key, explore_stream,
// c, 2 nb i + 2 d) < eps: then min(floor(uniform(key, action_stream, c, nb i + d) * n_d), n_d - 1).
static __device__ __forceinline__ int env_choose(const float* q, const int* n_actions,
                                                 const int* action_offset, int n_branches,
                                                 int n_envs, float eps, unsigned int key_lo,
                                                 unsigned int key_hi, unsigned int explore_stream,
                                                 unsigned int action_stream,
                                                 unsigned long long c, int i, int d) {
    const int n_d = n_actions[d];
    const float* row = q + (long long)n_envs * action_offset[d] + (long long)i * n_d;
    const unsigned int nb = (unsigned int)n_branches;
    const float u_explore = rng_uniform(key_lo, key_hi, explore_stream, c, 2u * nb * i + 2u * d);
    if (u_explore < eps) {
        const float u = rng_uniform(key_lo, key_hi, action_stream, c, nb * i + d);
        return min(__float2int_rz(__fmul_rn(u, __int2float_rn(n_d))), n_d - 1);
    }
    return double_dqn_argmax(row, n_d);
}

// The market tables and walk constants of env_step (one struct: env.cu's env_step and the
// collector's collect_transition pass the same values to env_step_one).
struct EnvTables {
    const float* close;
    const float* high;
    const float* low;
    const float* features;
    int n_features;
    const int* regime;
    const float* costs;
    int n_bars;
    int min_start;
    int last_start;
    int episode_len;
    int auto_reset;
    float reward_scale;
    int state_dim;
};

// One env's step as env_step specifies it (env.cu), for env i with actions a[0..n_branches):
// the state arrays in place, s2 row (skipped when s2 == nullptr), the records while
// steps < record_len, the auto-reset draw, the obs row (after any reset; written last, so s2
// and obs may be one buffer), r (times reward_scale), done, next_ret, regime_out.
static __device__ __forceinline__ void env_step_one(
    const EnvTables& m, int i, int n_envs, const int* a, int n_branches, int* t, int* steps,
    int* time_in_position, float* position, float* entry_price, float* rec_reward,
    float* rec_held, float* rec_cost, int record_len, unsigned int key_lo, unsigned int key_hi,
    unsigned int start_stream, unsigned long long c, float* r, float* done, float* s2,
    float* obs, float* next_ret, int* regime_out) {
    EnvLocal s = env_load(t, steps, time_in_position, position, entry_price, i);
    const int bar = s.t;
    const int steps_before = s.steps;
    const int order = n_branches > 1 ? a[1] : ENV_DEFAULT_ORDER;
    const int urgency = n_branches > 2 ? a[2] : ENV_DEFAULT_URGENCY;
    const EnvOutcome o = env_advance(s, a[0], order, urgency, m.close, m.high, m.low, m.costs,
                                     m.n_bars, m.episode_len);
    if (s2 != nullptr) {
        env_write_state(s2 + (long long)i * m.state_dim, m.features, m.n_features, m.close, s,
                        m.state_dim);
    }
    if (o.live && steps_before < record_len) {
        const long long k = (long long)steps_before * n_envs + i;
        rec_reward[k] = o.reward;
        rec_held[k] = o.held;
        rec_cost[k] = o.cost;
    }
    if (o.done && m.auto_reset != 0) {
        s = env_fresh(env_draw_start(key_lo, key_hi, start_stream, c, i, m.min_start,
                                     m.last_start));
    }
    env_write_state(obs + (long long)i * m.state_dim, m.features, m.n_features, m.close, s,
                    m.state_dim);
    env_store(s, t, steps, time_in_position, position, entry_price, i);
    r[i] = __fmul_rn(o.reward, m.reward_scale);
    done[i] = o.done ? 1.0f : 0.0f;
    next_ret[i] = o.next_ret;
    regime_out[i] = m.regime[bar];
}
