// The collection cycle's fused kernels (issue 20; twins: foxhunt.reference.kernels.collect,
// each the composition of the reference kernels it fuses; SPEC 9-11). They shorten the cycle's
// chain of dependent graph nodes, the cycle being launch/latency bound:
//
// - collect_transition: env_act + env_step (auto-reset, no records) + nstep_window +
//   replay_add of the transitions it emits + the post-reset states copied into obs, in ONE
//   block (one thread per env for the act and the step; the n-step prefix over the envs by
//   thread 0, as nstep_window does it);
// - replay_batch: scan_offsets + replay_sample + importance_weights + replay_gather, each block
//   forming the tile offsets and drawing the whole batch itself (no grid-wide barrier), block 0
//   writing idx and the weights.
//
// Every piece is the device function the unfused kernel runs (env.cuh: env_choose,
// env_step_one; replay.cuh: proportional_search, importance_weights_block, nstep_emit), so the
// fused results are the unfused kernels' bits. No atomics.

#include "env.cuh"     // env_choose, env_step_one (and distributional.cuh's double_dqn_argmax)
#include "replay.cuh"  // proportional_search, importance_weights_block, nstep_emit
#include "rng.cuh"     // rng_uniform

// ---------------------------------------------------------------------------------------------
// collect_transition: one collection step of n_envs walks into the ring. ONE block (a multiple
// of 32 threads), dynamic shared memory (2 n_envs + 1) ints. In order:
//  1. per env i (a thread each): actions[i, d] = env_choose(q, ..., eps[0], cycle[0], i, d) for
//     every branch d (env_act), then env_step_one (env_step with record_len 0 and auto_reset 1):
//     the state arrays in place, r, done, s2 (before any reset), obs_next (after any reset),
//     next_ret, regime_out; len0[i] = win_len[i];
//  2. barrier; (cursor, size) = ring_pos, p = max_priority[0] read by every thread; thread 0
//     forms each env's first output row (nstep_window's prefix, in env order) and the total m;
//  3. barrier; nstep_emit(obs, actions, r, done, s2, next_ret, regime_out, windows) with its
//     output row k sent to ring row (cursor + k) % capacity (replay_add's rows), and
//     priority[(cursor + k) % capacity] = p for k < m;
//  4. barrier (every reader of obs and ring_pos is done); obs <- obs_next; thread 0 writes
//     ring_pos = ((cursor + m) % capacity, min(size + m, capacity)).
// That is env_act, env_step, nstep_window (out_* = the ring rows), replay_add(n_valid = m) and
// the copy obs <- obs_next, bit for bit. Exact but for env_step's tanh columns (CUDA tanhf).
// ---------------------------------------------------------------------------------------------
// __launch_bounds__(1024, 1): the plan launches up to COLLECT_MAX_THREADS = 1024 threads (one
// block); without the bound ptxas may use more than 64 registers a thread and the launch fails
// with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES (seen on the H200).
extern "C" __global__ void __launch_bounds__(1024, 1) collect_transition(
    const float* __restrict__ q, const int* __restrict__ n_actions,
    const int* __restrict__ action_offset, int n_branches, const float* __restrict__ eps,
    unsigned int key_lo, unsigned int key_hi, unsigned int explore_stream,
    unsigned int action_stream, unsigned int start_stream, const long long* __restrict__ cycle,
    const float* __restrict__ close, const float* __restrict__ high,
    const float* __restrict__ low, const float* __restrict__ features, int n_features,
    const int* __restrict__ regime, const float* __restrict__ costs, int n_bars, int min_start,
    int last_start, int episode_len, float reward_scale, int state_dim, int* t, int* steps,
    int* time_in_position, float* position, float* entry_price, int n_envs, float* obs,
    int* actions, float* r, float* done, float* s2, float* obs_next, float* next_ret,
    int* regime_out, int n_step, float gamma_ref, float* win_s, int* win_a, float* win_r,
    float* win_next_ret, int* win_regime, int* win_len, float* ring_s, int* ring_a,
    float* ring_r, float* ring_s2, float* ring_done, float* ring_next_ret, int* ring_regime,
    float* ring_discount, float* priority, int* ring_pos, const float* __restrict__ max_priority,
    int capacity) {
    extern __shared__ int collect_shared[];
    int* len0 = collect_shared;             // [n_envs] the windows' lengths before the step
    int* row0 = collect_shared + n_envs;    // [n_envs] each env's first output row
    int* total = collect_shared + 2 * n_envs;  // [1] the transitions emitted
    const unsigned long long c = (unsigned long long)cycle[0];
    const float explore = eps[0];
    const EnvTables m = {close,       high,       low,          features,  n_features,
                         regime,      costs,      n_bars,       min_start, last_start,
                         episode_len, 1,          reward_scale, state_dim};
    for (int i = threadIdx.x; i < n_envs; i += blockDim.x) {
        int* a = actions + (long long)i * n_branches;
        for (int d = 0; d < n_branches; ++d) {
            a[d] = env_choose(q, n_actions, action_offset, n_branches, n_envs, explore, key_lo,
                              key_hi, explore_stream, action_stream, c, i, d);
        }
        env_step_one(m, i, n_envs, a, n_branches, t, steps, time_in_position, position,
                     entry_price, nullptr, nullptr, nullptr, 0, key_lo, key_hi, start_stream, c,
                     r, done, s2, obs_next, next_ret, regime_out);
        len0[i] = win_len[i];
    }
    __syncthreads();
    const int cursor = ring_pos[0];
    const int size = ring_pos[1];
    const float p = max_priority[0];
    if (threadIdx.x == 0) {
        int row = 0;
        for (int e = 0; e < n_envs; ++e) {
            row0[e] = row;
            row += nstep_count(len0[e], done[e], n_step);
        }
        total[0] = row;
    }
    __syncthreads();
    const int emitted = total[0];
    nstep_emit(obs, actions, r, done, s2, next_ret, regime_out, n_envs, state_dim, n_branches,
               n_step, gamma_ref, win_s, win_a, win_r, win_next_ret, win_regime, win_len, len0,
               row0, NStepRows{cursor, capacity}, ring_s, ring_a, ring_r, ring_s2, ring_done,
               ring_next_ret, ring_regime, ring_discount);
    for (int k = threadIdx.x; k < emitted; k += blockDim.x) {
        priority[((long long)cursor + k) % capacity] = p;
    }
    __syncthreads();  // nstep_emit's window updates read obs; every thread read ring_pos
    for (long long x = threadIdx.x; x < (long long)n_envs * state_dim; x += blockDim.x) {
        obs[x] = obs_next[x];
    }
    if (threadIdx.x == 0) {
        ring_pos[0] = (int)(((long long)cursor + emitted) % capacity);
        ring_pos[1] = min(size + emitted, capacity);
    }
}

// ---------------------------------------------------------------------------------------------
// replay_batch: the step's batch from the ring, straight from the ring scan's tiles (scan_tiles'
// s and block_sums: scan_offsets fused in, applied where the search reads). Any grid of blocks of
// a multiple of 32 threads, dynamic shared memory n ints + ceil(capacity / RING_SCAN_TILE)
// floats. Every block forms the tile offsets off_b = fl(...fl(fl(-0.0 + T_0) + T_1)... +
// T_{b-1}) (thread 0, in tile order: scan_offsets' sums) and draws all n rows into shared
// memory: rows[k] = proportional_search over prefix(i) = fl(off_{i / RING_SCAN_TILE} + s[i]) (the
// value scan_offsets stores) with m = max(min(size, capacity), 1) and target u_k * prefix(m - 1),
// u_k = rng_uniform(key, stream, cycle[0], k) (replay_sample); block 0 writes idx[k] = rows[k]
// and, after the barrier, the weights importance_weights_block(priority, rows, w, n, beta)
// (importance_weights); then the blocks gather the rows grid-stride into x [2n, state_dim] (s
// rows, then s2 rows), a [n_branches, n] (transposed), r, done [n] and, where not null,
// next_ret, regime and discount [n] (replay_gather). Exact but for the weights' powf.
// ---------------------------------------------------------------------------------------------
struct TilePrefix {
    const float* __restrict__ s;
    const float* offsets;  // shared memory
    __device__ __forceinline__ float operator()(int i) const {
        return offsets[i / RING_SCAN_TILE] + s[i];
    }
};

extern "C" __global__ void replay_batch(
    const float* __restrict__ s, const float* __restrict__ block_sums, int capacity,
    const int* __restrict__ ring_pos, unsigned int key_lo, unsigned int key_hi,
    unsigned int stream, const long long* __restrict__ cycle, int n,
    const float* __restrict__ priority, float beta, int state_dim, int n_branches,
    const float* __restrict__ ring_s, const int* __restrict__ ring_a,
    const float* __restrict__ ring_r, const float* __restrict__ ring_s2,
    const float* __restrict__ ring_done, const float* __restrict__ ring_next_ret,
    const int* __restrict__ ring_regime, const float* __restrict__ ring_discount,
    int* __restrict__ idx, float* __restrict__ w, float* __restrict__ x, int* __restrict__ a,
    float* __restrict__ r, float* __restrict__ done, float* __restrict__ next_ret,
    int* __restrict__ regime, float* __restrict__ discount) {
    extern __shared__ int batch_shared[];
    int* batch_rows = batch_shared;                                // [n]
    float* offsets = reinterpret_cast<float*>(batch_shared + n);  // [n_tiles]
    const int n_tiles = (capacity + RING_SCAN_TILE - 1) / RING_SCAN_TILE;
    for (int b = threadIdx.x; b < n_tiles; b += blockDim.x) {
        offsets[b] = block_sums[b];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float acc = -0.0f;
        for (int b = 0; b < n_tiles; ++b) {
            const float total = offsets[b];
            offsets[b] = acc;
            acc = acc + total;
        }
    }
    __syncthreads();
    const TilePrefix prefix{s, offsets};
    const int n_items = max(min(ring_pos[1], capacity), 1);
    const float total = prefix(n_items - 1);
    const unsigned long long offset = (unsigned long long)cycle[0];
    for (int k = threadIdx.x; k < n; k += blockDim.x) {
        const float u = rng_uniform(key_lo, key_hi, stream, offset, (unsigned)k);
        const int row = proportional_search_at(prefix, n_items, u * total);
        batch_rows[k] = row;
        if (blockIdx.x == 0) {
            idx[k] = row;
        }
    }
    __syncthreads();
    if (blockIdx.x == 0) {  // block-uniform: the whole block takes part in the reduction
        importance_weights_block(priority, batch_rows, w, n, beta);
    }
    replay_gather_rows(batch_rows, n, state_dim, n_branches, ring_s, ring_a, ring_r, ring_s2,
                       ring_done, ring_next_ret, ring_regime, ring_discount, x, a, r, done,
                       next_ret, regime, discount);
}
