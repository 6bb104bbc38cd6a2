// Prioritised-replay kernels (reference: foxhunt.reference.kernels.replay; SPEC 10):
// inclusive prefix sums of the priorities, proportional sampling by binary search, the
// importance weights of the sampled batch, and the device-resident ring (issue 20): adding
// transitions at the device cursor, sampling with the counter-based generator over the filled
// rows, gathering the sampled rows into the step's batch buffers and updating the priorities
// from the step's TD errors. Deterministic, no atomics; everything stays on the device (the
// sampling total, the ring's cursor and size and the cycle counter are read from device memory,
// not from the host).
#include "ha_common.cuh"
#include "reduce.cuh"  // block_reduce_down
#include "replay.cuh"  // proportional_search, importance_weights_block, nstep_emit
#include "rng.cuh"     // rng_uniform

// ------------------------------------------------------------------------------------------
// prefix_sum: s_i = p_0 + ... + p_i in float32, ONE block of SCAN_THREADS threads.
//
// The array is processed in tiles of SCAN_TILE = SCAN_THREADS * SCAN_ITEMS elements, in order.
// Within a tile, thread t owns the SCAN_ITEMS consecutive elements starting at t * SCAN_ITEMS
// (loaded coalesced through shared memory) and scans them sequentially: loc_k. Thread totals
// are scanned by a fixed Hillis-Steele tree in each warp (shuffles), warp totals by the same tree
// in warp 0, giving the thread's exclusive offset within the tile, off_t = warp_excl + lane_excl.
// Tiles are chained by a running carry, summed tile by tile. So, for element k of thread t:
//
//     s = fl( fl(carry + off_t) + loc_k ),   carry <- fl(carry + tile_total) after each tile.
//
// The reference sums sequentially (s_i = fl(s_{i-1} + p_i)); the association here differs, so
// the results differ by rounding (for non-negative priorities both are within gamma_i * s_i of
// the exact sum; this scan's own error grows like log(n), the sequential one like n), which the
// conformance reduction tolerance covers. The additive identity is -0.0 (x + -0.0 == x for every
// x), so the first prefix equals p_0 bit for bit and padding never changes a sum.
// NaN/Inf and overflow: the parallel path runs only while every element is "regular" (finite,
// |p| < 2^90: no association can overflow, see ha_common.cuh). As soon as a tile holds a NaN,
// an Inf or a huge value, the block stops and thread 0 redoes the whole scan sequentially, in
// the reference's order: then the result equals the reference's bit for bit, non-finite map
// included (a parallel association could overflow where the sequential sum does not, e.g.
// -Inf, FLT_MAX, FLT_MAX gives -Inf sequentially but NaN as -Inf + (FLT_MAX + FLT_MAX)).
// That slow path costs one thread's pass over n elements; it runs only on poisoned priorities.
// ------------------------------------------------------------------------------------------

#define SCAN_THREADS 1024
#define SCAN_WARPS (SCAN_THREADS / HA_WARP_SIZE)
#define SCAN_ITEMS 8
#define SCAN_TILE (SCAN_THREADS * SCAN_ITEMS)
// One pad word per 32: thread t reading element t * SCAN_ITEMS + k hits distinct banks.
#define SCAN_PAD(j) ((j) + ((j) >> 5))
#define SCAN_SMEM_WORDS (SCAN_TILE + SCAN_TILE / HA_WARP_SIZE)

// Inclusive Hillis-Steele scan over the 32 lanes of a warp (fixed tree).
static __device__ __forceinline__ float warp_inclusive_scan(float v, int lane) {
#pragma unroll
    for (int d = 1; d < HA_WARP_SIZE; d <<= 1) {
        const float left = __shfl_up_sync(HA_FULL_MASK, v, d);
        if (lane >= d) {
            v = left + v;
        }
    }
    return v;
}

// The exclusive prefix from an inclusive one, by shifting (never by subtracting).
static __device__ __forceinline__ float warp_exclusive_from_inclusive(float inclusive, int lane) {
    const float left = __shfl_up_sync(HA_FULL_MASK, inclusive, 1);
    return (lane == 0) ? -0.0f : left;
}

extern "C" __global__ void __launch_bounds__(SCAN_THREADS)
prefix_sum(const float* __restrict__ p, float* __restrict__ s, long long n) {
    __shared__ float tile[SCAN_SMEM_WORDS];
    __shared__ float warp_offsets[SCAN_WARPS];
    __shared__ float tile_total;
    const int tid = threadIdx.x;
    const int lane = tid % HA_WARP_SIZE;
    const int warp = tid / HA_WARP_SIZE;
    float carry = -0.0f;     // identical in every thread
    bool irregular = false;  // identical in every thread

    for (long long start = 0; start < n; start += SCAN_TILE) {
        bool tile_irregular = false;
#pragma unroll
        for (int k = 0; k < SCAN_ITEMS; ++k) {
            const int j = k * SCAN_THREADS + tid;
            const float v = (start + j < n) ? p[start + j] : -0.0f;
            tile_irregular |= !ha_is_regular_term(v);
            tile[SCAN_PAD(j)] = v;
        }
        if (__syncthreads_or(tile_irregular)) {  // block-uniform: every thread leaves together
            irregular = true;
            break;
        }

        float local[SCAN_ITEMS];
        local[0] = tile[SCAN_PAD(tid * SCAN_ITEMS)];
#pragma unroll
        for (int k = 1; k < SCAN_ITEMS; ++k) {
            local[k] = local[k - 1] + tile[SCAN_PAD(tid * SCAN_ITEMS + k)];
        }

        const float incl = warp_inclusive_scan(local[SCAN_ITEMS - 1], lane);
        const float lane_excl = warp_exclusive_from_inclusive(incl, lane);
        if (lane == HA_WARP_SIZE - 1) {
            warp_offsets[warp] = incl;  // the warp's total, for now
        }
        __syncthreads();
        if (warp == 0) {  // SCAN_WARPS == 32: every lane holds one warp total
            const float warp_incl = warp_inclusive_scan(warp_offsets[lane], lane);
            warp_offsets[lane] = warp_exclusive_from_inclusive(warp_incl, lane);
            if (lane == HA_WARP_SIZE - 1) {
                tile_total = warp_incl;
            }
        }
        __syncthreads();

        const float base = carry + (warp_offsets[warp] + lane_excl);
#pragma unroll
        for (int k = 0; k < SCAN_ITEMS; ++k) {
            tile[SCAN_PAD(tid * SCAN_ITEMS + k)] = base + local[k];
        }
        carry = carry + tile_total;
        __syncthreads();
#pragma unroll
        for (int k = 0; k < SCAN_ITEMS; ++k) {
            const int j = k * SCAN_THREADS + tid;
            if (start + j < n) {
                s[start + j] = tile[SCAN_PAD(j)];
            }
        }
        __syncthreads();  // the next tile overwrites tile, warp_offsets and tile_total
    }

    // Poisoned input: the reference's sequential order, s_0 = p_0, s_i = fl(s_{i-1} + p_i).
    // Every parallel store of earlier tiles happened before the barrier that detected it.
    if (irregular && tid == 0) {
        float acc = p[0];
        s[0] = acc;
        for (long long i = 1; i < n; ++i) {
            acc = acc + p[i];
            s[i] = acc;
        }
    }
}

// ------------------------------------------------------------------------------------------
// The collection cycle's prefix sum over the whole ring (issue 20): two kernels, many blocks,
// instead of prefix_sum's one block walking every tile in turn.
//
// scan_tiles (one block per tile of RING_SCAN_TILE = RING_SCAN_THREADS * RING_SCAN_ITEMS
// elements; grid = ceil(n / RING_SCAN_TILE)): the tile's own inclusive scan l_i, in
// prefix_sum's tile order (thread t owns RING_SCAN_ITEMS consecutive elements, summed
// sequentially: loc_k; thread totals by the warp's Hillis-Steele tree; warp totals by the same
// tree in warp 0; l = fl( fl(warp_excl + lane_excl) + loc_k ); missing elements read as -0.0),
// written to s; and the tile's total T_b = l at the tile's last element, written to
// block_sums[b] by the thread that computed it (so T_b IS that element's l, bit for bit).
// scan_offsets (same grid): off_b = fl(...fl(fl(-0.0 + T_0) + T_1)... + T_{b-1}), summed
// sequentially by thread 0 of block b (b adds; every block forms the same sequence), then
// s_i <- fl(off_b + l_i) in place (block 0: off = -0.0, s unchanged).
// Why T_b is the tile's last l: the last sum of tile b is then fl(off_b + T_b) = off_{b+1}, so
// with non-negative priorities no sum decreases across a tile boundary (within a tile, as in
// prefix_sum, a thread's first sum can round below the previous thread's last by an ulp).
// Reference twins: foxhunt.reference.kernels.replay.scan_tiles / scan_offsets follow this order
// float for float (bit-exact, NaN/Inf included; no atomics, no fallback path). A NaN at i makes
// every s_j, j >= i, NaN; +Inf gives +Inf (NaN together with a -Inf); finite overflow follows
// this association (it can differ from the sequential prefix_sum's).
// ------------------------------------------------------------------------------------------

// RING_SCAN_THREADS, RING_SCAN_ITEMS, RING_SCAN_TILE: replay.cuh (replay_batch reads the tiles).

extern "C" __global__ void __launch_bounds__(RING_SCAN_THREADS)
scan_tiles(const float* __restrict__ p, float* __restrict__ s, float* __restrict__ block_sums,
           long long n) {
    __shared__ float tile[SCAN_PAD(RING_SCAN_TILE)];
    __shared__ float warp_offsets[HA_WARP_SIZE];
    const int tid = threadIdx.x;
    const int lane = tid % HA_WARP_SIZE;
    const int warp = tid / HA_WARP_SIZE;
    const long long start = (long long)blockIdx.x * RING_SCAN_TILE;
#pragma unroll
    for (int k = 0; k < RING_SCAN_ITEMS; ++k) {  // coalesced loads through shared memory
        const int j = k * RING_SCAN_THREADS + tid;
        tile[SCAN_PAD(j)] = (start + j < n) ? p[start + j] : -0.0f;
    }
    __syncthreads();
    float local[RING_SCAN_ITEMS];
    local[0] = tile[SCAN_PAD(tid * RING_SCAN_ITEMS)];
#pragma unroll
    for (int k = 1; k < RING_SCAN_ITEMS; ++k) {
        local[k] = local[k - 1] + tile[SCAN_PAD(tid * RING_SCAN_ITEMS + k)];
    }
    const float incl = warp_inclusive_scan(local[RING_SCAN_ITEMS - 1], lane);
    const float lane_excl = warp_exclusive_from_inclusive(incl, lane);
    if (lane == HA_WARP_SIZE - 1) {
        warp_offsets[warp] = incl;  // the warp's total, for now
    }
    __syncthreads();
    if (warp == 0) {  // lanes past the last warp scan -0.0: the tree of the first lanes is unchanged
        const float total = (lane < RING_SCAN_WARPS) ? warp_offsets[lane] : -0.0f;
        const float warp_incl = warp_inclusive_scan(total, lane);
        const float warp_excl = warp_exclusive_from_inclusive(warp_incl, lane);  // every lane shuffles
        if (lane < RING_SCAN_WARPS) {
            warp_offsets[lane] = warp_excl;
        }
    }
    __syncthreads();
    const float base = warp_offsets[warp] + lane_excl;
    const long long last = min(start + RING_SCAN_TILE, n) - 1;
#pragma unroll
    for (int k = 0; k < RING_SCAN_ITEMS; ++k) {
        const float v = base + local[k];
        tile[SCAN_PAD(tid * RING_SCAN_ITEMS + k)] = v;
        if (start + tid * RING_SCAN_ITEMS + k == last) {
            block_sums[blockIdx.x] = v;
        }
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < RING_SCAN_ITEMS; ++k) {
        const int j = k * RING_SCAN_THREADS + tid;
        if (start + j < n) {
            s[start + j] = tile[SCAN_PAD(j)];
        }
    }
}

extern "C" __global__ void __launch_bounds__(RING_SCAN_THREADS)
scan_offsets(float* __restrict__ s, const float* __restrict__ block_sums, long long n) {
    __shared__ float offset;
    if (threadIdx.x == 0) {
        float acc = -0.0f;
        for (unsigned b = 0; b < blockIdx.x; ++b) {
            acc = acc + block_sums[b];
        }
        offset = acc;
    }
    __syncthreads();
    const float off = offset;
    const long long start = (long long)blockIdx.x * RING_SCAN_TILE;
#pragma unroll
    for (int k = 0; k < RING_SCAN_ITEMS; ++k) {
        const long long i = start + k * RING_SCAN_THREADS + threadIdx.x;
        if (i < n) {
            s[i] = off + s[i];
        }
    }
}

// ------------------------------------------------------------------------------------------
// sample_proportional: out[k] = the first i with prefix[i] > u[k] * prefix[n_items - 1], by
// the reference's binary search (n_items - 1 when none exceeds the target: total 0, NaN target,
// u >= 1). Exact: same float32 target, same comparisons. One thread per uniform, any grid.
// ------------------------------------------------------------------------------------------

extern "C" __global__ void sample_proportional(const float* __restrict__ prefix, int n_items,
                                               const float* __restrict__ u,
                                               int* __restrict__ out, int n) {
    const float total = prefix[n_items - 1];
    for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < n; k += gridDim.x * blockDim.x) {
        out[k] = proportional_search(prefix, n_items, u[k] * total);
    }
}

// ------------------------------------------------------------------------------------------
// importance_weights: w_k = powf(p_min / p_{idx[k]}, beta), p_min = fminf-reduce of the sampled
// priorities (NaN ignored; NaN only if all are NaN). ONE block (blockDim.x a multiple of 32):
// the minimum is exact, so it is order-independent; then one division and one powf per weight
// (powf is not correctly rounded: a few ULP, within the conformance tolerance). The caller
// guarantees 0 <= idx[k] < n_valid <= n_items (the test entry checks, like the reference);
// n_items is the length of priorities (what a launch record's region is checked against).
// ------------------------------------------------------------------------------------------

extern "C" __global__ void importance_weights(const float* __restrict__ priorities, int n_items,
                                              const int* __restrict__ idx,
                                              float* __restrict__ w, int n, float beta) {
    importance_weights_block(priorities, idx, w, n, beta);
}

// ------------------------------------------------------------------------------------------
// The device-resident ring. Its arrays: ring_s, ring_s2 [capacity, state_dim], ring_a
// [capacity, n_branches] (int), ring_r, ring_done, ring_next_ret [capacity], ring_regime
// [capacity] (int), ring_discount [capacity] (the n-step transition's gamma_ref^k), priority [capacity] (already raised to alpha; zero beyond the filled rows),
// ring_pos [2] = (cursor, size) (int), max_priority [1] (the running maximum).
// ------------------------------------------------------------------------------------------

// replay_add: the first m of the n given transitions, m = n or, where n_valid is not null,
// m = n_valid[0] (0 <= m <= n: nstep_window's count, read on the device): transition k < m goes
// to row (cursor + k) % capacity of every ring array with priority max_priority[0]; then
// cursor <- (cursor + m) % capacity and size <- min(size + m, capacity). ONE block (any
// multiple of 32 threads): every thread reads (cursor, size) first, and thread 0 writes them
// back after the barrier that ends the copies. Exact (copies).
extern "C" __global__ void replay_add(const float* __restrict__ s, const int* __restrict__ a,
                                      const float* __restrict__ r, const float* __restrict__ s2,
                                      const float* __restrict__ done,
                                      const float* __restrict__ next_ret,
                                      const int* __restrict__ regime,
                                      const float* __restrict__ discount,
                                      const int* __restrict__ n_valid, int n_given, int state_dim,
                                      int n_branches, float* __restrict__ ring_s,
                                      int* __restrict__ ring_a, float* __restrict__ ring_r,
                                      float* __restrict__ ring_s2, float* __restrict__ ring_done,
                                      float* __restrict__ ring_next_ret,
                                      int* __restrict__ ring_regime,
                                      float* __restrict__ ring_discount,
                                      float* __restrict__ priority, int* __restrict__ ring_pos,
                                      const float* __restrict__ max_priority, int capacity) {
    const int cursor = ring_pos[0];
    const int size = ring_pos[1];
    const float p = max_priority[0];
    const int n = n_valid != nullptr ? min(max(n_valid[0], 0), n_given) : n_given;
    const long long n_state = (long long)n * state_dim;
    for (long long e = threadIdx.x; e < n_state; e += blockDim.x) {
        const long long k = e / state_dim;
        const long long dst = ((cursor + k) % capacity) * state_dim + e % state_dim;
        ring_s[dst] = s[e];
        ring_s2[dst] = s2[e];
    }
    for (int e = threadIdx.x; e < n * n_branches; e += blockDim.x) {
        const int k = e / n_branches;
        ring_a[(long long)((cursor + k) % capacity) * n_branches + e % n_branches] = a[e];
    }
    for (int k = threadIdx.x; k < n; k += blockDim.x) {
        const int row = (cursor + k) % capacity;
        ring_r[row] = r[k];
        ring_done[row] = done[k];
        ring_next_ret[row] = next_ret[k];
        ring_regime[row] = regime[k];
        ring_discount[row] = discount[k];
        priority[row] = p;
    }
    __syncthreads();  // every thread has read (cursor, size)
    if (threadIdx.x == 0) {
        ring_pos[0] = (cursor + n) % capacity;
        ring_pos[1] = min(size + n, capacity);
    }
}

// nstep_window (issue 22): one environment step of every env into its n-step window and the
// finished transitions out (reference: kernels/replay.py nstep_window, whose docstring is the
// contract). Env e's window holds L0 = win_len[e] < n_step pending steps (slot 0 the oldest);
// this step is entry L0, L = L0 + 1; count_e = L if done[e] != 0, else 1 if L == n_step, else
// 0. Entry j (k = L - j steps): r = rw_j + g_1 rw_{j+1} + ... + g_{k-1} rw_{j+k-1} summed in
// that order, discount = g_k (g_1 = gamma_ref, g_{i+1} = g_i * gamma_ref; every product and sum
// rounded on its own: __fmul_rn/__fadd_rn, no FMA), s2 and done this step's; rows env by env
// from sum_{e'<e} count_e', n_out[0] the total; later rows untouched.
// ONE block (any multiple of 32 threads), dynamic shared memory 2 * n_envs ints: the old
// window lengths and the row offsets are read and scanned first (thread 0, in env order), the
// outputs written after that barrier, the windows updated after the next (the shift reads the
// slots the outputs read). Exact (copies; the float sums follow the reference's order).
extern "C" __global__ void nstep_window(
    const float* __restrict__ obs, const int* __restrict__ actions, const float* __restrict__ r,
    const float* __restrict__ done, const float* __restrict__ s2,
    const float* __restrict__ next_ret, const int* __restrict__ regime, int n_envs,
    int state_dim, int n_branches, int n_step, float gamma_ref, float* __restrict__ win_s,
    int* __restrict__ win_a, float* __restrict__ win_r, float* __restrict__ win_next_ret,
    int* __restrict__ win_regime, int* __restrict__ win_len, float* __restrict__ out_s,
    int* __restrict__ out_a, float* __restrict__ out_r, float* __restrict__ out_s2,
    float* __restrict__ out_done, float* __restrict__ out_next_ret,
    int* __restrict__ out_regime, float* __restrict__ out_discount, int* __restrict__ n_out) {
    extern __shared__ int nstep_shared[];
    int* len0 = nstep_shared;           // [n_envs] the windows' lengths before the step
    int* row0 = nstep_shared + n_envs;  // [n_envs] each env's first output row
    for (int e = threadIdx.x; e < n_envs; e += blockDim.x) {
        len0[e] = win_len[e];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int row = 0;
        for (int e = 0; e < n_envs; ++e) {
            row0[e] = row;
            row += nstep_count(len0[e], done[e], n_step);
        }
        n_out[0] = row;
    }
    __syncthreads();
    nstep_emit(obs, actions, r, done, s2, next_ret, regime, n_envs, state_dim, n_branches,
               n_step, gamma_ref, win_s, win_a, win_r, win_next_ret, win_regime, win_len, len0,
               row0, NStepRows{0, 0}, out_s, out_a, out_r, out_s2, out_done, out_next_ret,
               out_regime, out_discount);
}

// replay_sample: idx[k] = proportional_search(prefix, m, u_k * prefix[m - 1]) with
// m = max(min(size, capacity), 1) (the filled rows; prefix holds capacity sums) and u_k = rng_uniform(key, stream, cycle[0], k), stream
// the replay_sample id of reference/kernels/rng.py (passed in: the ids live there only).
// cycle: the collector's counter (a non-negative int64 on the device, the draws' u64 offset).
// Exact. One thread per sample, any grid.
extern "C" __global__ void replay_sample(const float* __restrict__ prefix, int capacity,
                                         const int* __restrict__ ring_pos, unsigned key_lo,
                                         unsigned key_hi, unsigned stream,
                                         const long long* __restrict__ cycle,
                                         int* __restrict__ idx, int n) {
    const int n_items = max(min(ring_pos[1], capacity), 1);
    const float total = prefix[n_items - 1];
    const unsigned long long offset = (unsigned long long)cycle[0];
    for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < n; k += gridDim.x * blockDim.x) {
        const float u = rng_uniform(key_lo, key_hi, stream, offset, (unsigned)k);
        idx[k] = proportional_search(prefix, n_items, u * total);
    }
}

// replay_gather: the sampled rows in the step's batch layout: x [2n, state_dim] (s rows, then
// s2 rows), a [n_branches, n] (transposed), r, done [n], and, where not null, next_ret,
// regime and discount [n]. The ring has capacity rows and 0 <= idx < capacity (replay_sample's rows; the
// reference raises otherwise). Exact (copies). Grid-stride over the state elements, any grid.
extern "C" __global__ void replay_gather(const int* __restrict__ idx, int n, int capacity,
                                         int state_dim, int n_branches,
                                         const float* __restrict__ ring_s,
                                         const int* __restrict__ ring_a,
                                         const float* __restrict__ ring_r,
                                         const float* __restrict__ ring_s2,
                                         const float* __restrict__ ring_done,
                                         const float* __restrict__ ring_next_ret,
                                         const int* __restrict__ ring_regime,
                                         const float* __restrict__ ring_discount,
                                         float* __restrict__ x, int* __restrict__ a,
                                         float* __restrict__ r, float* __restrict__ done,
                                         float* __restrict__ next_ret, int* __restrict__ regime,
                                         float* __restrict__ discount) {
    replay_gather_rows(idx, n, state_dim, n_branches, ring_s, ring_a, ring_r, ring_s2, ring_done,
                       ring_next_ret, ring_regime, ring_discount, x, a, r, done, next_ret, regime,
                       discount);
}

// replay_update_priorities: p_k = powf(fabsf(td_k) + eps, alpha) for a finite td_k, else m0 =
// max_priority[0] at entry; priority[idx_k] = p_k from the LAST k that names each row (a thread
// skips k when a later sample names the same row: no race, the reference's order);
// max_priority = fmaxf-reduce(m0, p_0, ..., p_{n-1}). ONE block (a multiple of 32 threads):
// every thread reads m0 before the reduction's barriers, thread 0 writes the new maximum after
// them. priority has capacity rows and 0 <= idx < capacity (the reference raises otherwise).
// powf is not correctly rounded (a few ulp against NumPy's). Where cycle is not null, thread 0
// also advances it (cycle_advance fused: the collector's cycle ends with this kernel; null in
// the test entry).
extern "C" __global__ void replay_update_priorities(const float* __restrict__ td,
                                                    const int* __restrict__ idx, int n,
                                                    float* __restrict__ priority, int capacity,
                                                    float* __restrict__ max_priority,
                                                    float alpha, float eps,
                                                    long long* __restrict__ cycle) {
    const float m0 = max_priority[0];
    float top = m0;
    for (int k = threadIdx.x; k < n; k += blockDim.x) {
        const float t = td[k];
        const float p = ha_is_finite(t) ? powf(__fadd_rn(fabsf(t), eps), alpha) : m0;
        top = fmaxf(top, p);
        const int row = idx[k];
        bool last = true;
        for (int j = k + 1; j < n && last; ++j) {
            last = idx[j] != row;
        }
        if (last) {
            priority[row] = p;
        }
    }
    top = block_reduce_down(top, HaFmax(), ha_nan());
    if (threadIdx.x == 0) {
        max_priority[0] = top;
        if (cycle != nullptr) {
            cycle[0] = cycle[0] + 1;
        }
    }
}

// cycle_advance: cycle[0] += 1, the collector's counter at the end of each collection cycle
// (every kernel of the cycle read the old value before it). One thread.
extern "C" __global__ void cycle_advance(long long* __restrict__ cycle) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        cycle[0] = cycle[0] + 1;
    }
}
