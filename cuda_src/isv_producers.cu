// ISV producer kernels of issue 19 (SPEC 7; seed 002): twins of
// foxhunt.reference.kernels.isv_producers, bit for bit. The *_update / *_ramp kernels work in
// place on the ISV vector and write only the slots they produce; isv_signal_build writes the
// signals[num_signals] vector that isv_signal_update (isv.cu) blends.
//
// Slot indices, percentiles and constants are kernel arguments taken from the registry
// (foxhunt.reference.isv) and the reference module by the launchers, so each is defined once.
// Every reduction has one fixed order shared with the reference (lane_sum: lane t adds
// elements t, t + lanes, ... in turn, then thread 0 adds the lane partials in lane order), one
// block, no atomics; products and sums are rounded one at a time (__fmul_rn / __fadd_rn).
#include "early_launch.cuh"  // fh_early_wait, fh_early_release
#include "isv_ema.cuh"  // hb_guarded_ema, hb_adaptive_rate

// Lanes of the fixed-order means: the launchers run exactly this many threads
// (reference LANES); a block of another size does nothing.
#define ISVP_LANES 32
// Threads of the exact-selection percentile kernel (a multiple of 32, at most this).
#define ISVP_SELECT_THREADS 1024

// Every lane of a warp: the 32 lane partials (acc, cnt) added in lane order (shuffles) into
// (*sum, *count): the second half of the reference's lane_sum.
__device__ __forceinline__ void isvp_warp_combine(float acc, int cnt, float* sum, int* count) {
    float total = 0.0f;
    int c = 0;
    for (int k = 0; k < ISVP_LANES; ++k) {
        total = __fadd_rn(total, __shfl_sync(0xffffffffu, acc, k));
        c += __shfl_sync(0xffffffffu, cnt, k);
    }
    *sum = total;
    *count = c;
}

// A fixed-order finite sum of n elements get(i) by one whole warp: lane t adds elements t,
// t + 32, ... (the finite ones) and counts them, then isvp_warp_combine: the reference's
// lane_sum order. Every lane gets (*sum, *count).
template <typename Get>
__device__ void isvp_warp_lane_sum(Get get, long long n, float* sum, int* count) {
    float acc = 0.0f;
    int cnt = 0;
    for (long long i = threadIdx.x % 32; i < n; i += ISVP_LANES) {
        const float x = get(i);
        if (isfinite(x)) {
            acc = __fadd_rn(acc, x);
            ++cnt;
        }
    }
    isvp_warp_combine(acc, cnt, sum, count);
}

__device__ __forceinline__ float isvp_mean_of(float sum, int count) {
    return count > 0 ? __fdiv_rn(sum, (float)count) : __int_as_float(0x7fc00000);
}

// The finite mean of n elements get(i) in the reference's lane order (NaN when none is
// finite), by one whole warp; every lane gets it.
template <typename Get>
__device__ float isvp_lane_mean(Get get, long long n) {
    float sum;
    int count;
    isvp_warp_lane_sum(get, n, &sum, &count);
    return isvp_mean_of(sum, count);
}

// Per-sample Var_p[z] of sample i = d * B + b (reference distribution_variance).
__device__ __forceinline__ float isvp_variance(const float* p, const float* z, long long i,
                                               int B, int na) {
    const float* pi = p + i * na;
    const float* zd = z + (i / B) * na;
    float mean = 0.0f, ez2 = 0.0f;
    for (int j = 0; j < na; ++j) {
        const float pz = __fmul_rn(pi[j], zd[j]);
        mean = __fadd_rn(mean, pz);
        ez2 = __fadd_rn(ez2, __fmul_rn(pz, zd[j]));
    }
    const float v = __fsub_rn(ez2, __fmul_rn(mean, mean));
    return isfinite(v) ? fmaxf(v, 0.0f) : __int_as_float(0x7fc00000);
}

// isv_signal_build: signals[0..num_signals) from the step's buffers (reference docstring).
// q_taken [nb, B], td [B], r [B], p_next [nb, B, na], z [nb, na]; *grad_norm, *loss device
// scalars; q_ema_slots[n_q_ema] the exposure Q-mean EMA slots; sig_* the signal indices.
// Every sum is in the reference's order; the work is spread over the block:
//   - the variance mean: in chunks of blockDim samples, thread t computes sample (chunk + t)'s
//     variance into shared memory, then warp 0's lane l adds the chunk's samples l, l + 32, ...
//     in turn (blockDim is a multiple of 32, so lane l sees exactly its lane_sum elements, in
//     order), and finally the 32 lane partials in lane order;
//   - the atom utilisation: thread k walks (branch, atom) pair k's batch in order;
//   - the means of q_taken[0], td and r: one warp each (the block's last warps).
// Launch: grid 1, block a multiple of 32 in [32, ISVP_SELECT_THREADS]
// (fast/kernels/isv_producers.plan_isv_signal_build); another block does nothing.
extern "C" __global__ void __launch_bounds__(ISVP_SELECT_THREADS)
isv_signal_build(const float* __restrict__ isv, const float* __restrict__ q_taken,
                 const float* __restrict__ td, const float* __restrict__ r,
                 const float* __restrict__ p_next, const float* __restrict__ z,
                 const float* __restrict__ grad_norm, const float* __restrict__ loss,
                 float* __restrict__ signals, int num_signals, int nb, int B, int na,
                 const int* __restrict__ q_ema_slots, int n_q_ema, float q_drift_floor,
                 float atom_util_fraction, int sig_q_drift, int sig_grad_norm, int sig_td,
                 int sig_var, int sig_var_vel, int sig_reward, int sig_util, int sig_loss,
                 int sig_health) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    const int nt = blockDim.x, t = threadIdx.x, warp = t / 32, nw = nt / 32;
    if (nt % 32 != 0 || nt > ISVP_SELECT_THREADS) {
        return;
    }
    __shared__ float s_var[ISVP_SELECT_THREADS];
    __shared__ float s_mean_sum[3];
    __shared__ int s_mean_cnt[3];
    __shared__ int s_used[ISVP_SELECT_THREADS / 32];
    // Variance: warp 0's lanes carry the lane partials across the chunks.
    const long long n_var = (long long)nb * B;
    float var_acc = 0.0f;
    int var_cnt = 0;
    for (long long base = 0; base < n_var; base += nt) {
        if (base + t < n_var) {
            s_var[t] = isvp_variance(p_next, z, base + t, B, na);
        }
        __syncthreads();
        if (warp == 0) {
            for (int k = t; k < nt && base + k < n_var; k += ISVP_LANES) {
                const float x = s_var[k];
                if (isfinite(x)) {
                    var_acc = __fadd_rn(var_acc, x);
                    ++var_cnt;
                }
            }
        }
        __syncthreads();
    }
    float var_sum = 0.0f;
    int var_count = 0;
    if (warp == 0) {
        isvp_warp_combine(var_acc, var_cnt, &var_sum, &var_count);
    }
    // Atom utilisation: each (branch, atom) pair's finite batch mean, added in batch order.
    const float threshold = __fdiv_rn(atom_util_fraction, (float)na);
    int used = 0;
    for (int k = t; k < nb * na; k += nt) {
        const int d = k / na, j = k % na;
        float acc = 0.0f;
        int cnt = 0;
        for (int b = 0; b < B; ++b) {
            const float x = p_next[((long long)d * B + b) * na + j];
            if (isfinite(x)) {
                acc = __fadd_rn(acc, x);
                ++cnt;
            }
        }
        if (cnt > 0 && __fdiv_rn(acc, (float)cnt) >= threshold) {
            ++used;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        used += __shfl_xor_sync(0xffffffffu, used, o);
    }
    if (t % 32 == 0) {
        s_used[warp] = used;
    }
    // The three batch means, one warp each (warps nw-1, nw-2, nw-3; fewer warps take turns).
    for (int m = 0; m < 3; ++m) {
        if (warp != (nw - 1 - m % nw + nw) % nw) {
            continue;
        }
        const float* src = m == 0 ? q_taken : (m == 1 ? td : r);
        float sum;
        int cnt;
        isvp_warp_lane_sum([&](long long i) { return src[i]; }, B, &sum, &cnt);
        if (t % 32 == 0) {
            s_mean_sum[m] = sum;
            s_mean_cnt[m] = cnt;
        }
    }
    __syncthreads();
    if (t != 0) {
        return;
    }
    int used_total = 0;
    for (int k = 0; k < nw; ++k) {
        used_total += s_used[k];
    }
    const float q_mean = isvp_mean_of(s_mean_sum[0], s_mean_cnt[0]);
    const float td_mean = isvp_mean_of(s_mean_sum[1], s_mean_cnt[1]);
    const float r_mean = isvp_mean_of(s_mean_sum[2], s_mean_cnt[2]);
    const float var = isvp_mean_of(var_sum, var_count);
    float q_ema = 0.0f;
    for (int k = 0; k < n_q_ema; ++k) {
        q_ema = __fadd_rn(q_ema, isv[q_ema_slots[k]]);
    }
    q_ema = __fdiv_rn(q_ema, (float)n_q_ema);
    const float drift = __fdiv_rn(__fsub_rn(q_mean, q_ema), fmaxf(fabsf(q_ema), q_drift_floor));
    const float util = __fdiv_rn((float)used_total, (float)(nb * na));
    for (int k = 0; k < num_signals; ++k) {
        signals[k] = 0.0f;  // the reserved signals (8-11) stay 0
    }
    signals[sig_q_drift] = drift;
    signals[sig_grad_norm] = *grad_norm;
    signals[sig_td] = td_mean;
    signals[sig_var] = var;
    signals[sig_var_vel] = __fsub_rn(var, isv[sig_var]);
    signals[sig_reward] = r_mean;
    signals[sig_util] = util;
    signals[sig_loss] = *loss;
    signals[sig_health] = __fdiv_rn(util, __fadd_rn(1.0f, fabsf(drift)));
}

// q_stats_update: isv[action_slots[a]] = ema(finite mean of q[:, a]) for a < n_actions and
// isv[abs_slot] = ema(finite mean of |q|), q [B, n_actions], adaptive rate from
// isv[sharpe_slot]. Launch: grid 1, block ISVP_LANES.
extern "C" __global__ void __launch_bounds__(ISVP_LANES)
q_stats_update(float* __restrict__ isv, const float* __restrict__ q, int B, int n_actions,
               const int* __restrict__ action_slots, int abs_slot, int sharpe_slot,
               float alpha_base, float sharpe_clamp, float sharpe_gain) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    if (blockDim.x != ISVP_LANES) {
        return;
    }
    const float alpha = hb_adaptive_rate(isv[sharpe_slot], alpha_base, sharpe_clamp,
                                         sharpe_gain);
    for (int a = 0; a < n_actions; ++a) {
        const float mean = isvp_lane_mean([&](long long i) { return q[i * n_actions + a]; }, B);
        if (threadIdx.x == 0) {
            isv[action_slots[a]] = hb_guarded_ema(isv[action_slots[a]], mean, alpha);
        }
    }
    const float mean_abs = isvp_lane_mean([&](long long i) { return fabsf(q[i]); },
                                          (long long)B * n_actions);
    if (threadIdx.x == 0) {
        isv[abs_slot] = hb_guarded_ema(isv[abs_slot], mean_abs, alpha);
    }
}

// q_quantile_update: exact order statistics of ranks (pct * (c - 1)) / 100 (pct = lo_pct,
// hi_pct) among the c finite q (-0 counted as +0), blended into isv[lo_slot] / isv[hi_slot].
// The rank-k value is unique whatever the ties, so two exact methods give the same bits:
//   sorted: with P * 4 bytes of dynamic shared memory (P the power of two >= max(n, 32), the
//     plan's fast/kernels/isv_producers.plan_q_quantile_update), the n values, each + 0.0f
//     (-0 -> +0) and every non-finite one as +Inf (after every finite value), padded with +Inf
//     to P, are bitonic-sorted in shared memory; the rank-k value is sorted[k] (k < c);
//   counted (no such shared memory: large n): element i is the rank-k value if less(i) <= k <
//     less(i) + equal(i), the lowest such index taken (a block min, no atomics).
// Launch: grid 1, block a multiple of 32 (at most ISVP_SELECT_THREADS).
static __device__ __forceinline__ unsigned int isvp_dynamic_smem_bytes() {
    unsigned int bytes;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
    return bytes;
}

static __device__ __forceinline__ long long isvp_warp_sum(long long v) {
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, o);
    }
    return v;
}

static __device__ __forceinline__ long long isvp_warp_min(long long v) {
    for (int o = 16; o > 0; o >>= 1) {
        const long long w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w < v ? w : v;
    }
    return v;
}

// Ascending bitonic sort of s[0, P) (P a power of two; no NaN) by the whole block.
static __device__ void isvp_bitonic_sort(float* s, int P) {
    for (int k = 2; k <= P; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < P; i += blockDim.x) {
                const int ixj = i ^ j;
                if (ixj > i) {
                    const float a = s[i], b = s[ixj];
                    if ((a > b) == ((i & k) == 0)) {
                        s[i] = b;
                        s[ixj] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
}

extern "C" __global__ void __launch_bounds__(ISVP_SELECT_THREADS)
q_quantile_update(float* __restrict__ isv, const float* __restrict__ q, long long n,
                  int lo_slot, int hi_slot, int lo_pct, int hi_pct, int sharpe_slot,
                  float alpha_base, float sharpe_clamp, float sharpe_gain) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    extern __shared__ float isvp_sorted[];
    __shared__ long long s_a[ISVP_SELECT_THREADS / 32];
    __shared__ long long s_b[ISVP_SELECT_THREADS / 32];
    const int t = threadIdx.x, nt = blockDim.x, lane = t % 32, warp = t / 32, nw = nt / 32;
    const float inf = __int_as_float(0x7f800000);
    long long P = 32;
    while (P < n) {
        P <<= 1;
    }
    const bool sorted = (unsigned long long)P * sizeof(float) <= isvp_dynamic_smem_bytes();
    long long cnt = 0;
    for (long long i = t; i < (sorted ? P : n); i += nt) {
        const float x = i < n ? q[i] : inf;
        const bool finite = isfinite(x);
        cnt += i < n && finite ? 1 : 0;
        if (sorted) {
            isvp_sorted[i] = finite ? __fadd_rn(x, 0.0f) : inf;
        }
    }
    cnt = isvp_warp_sum(cnt);
    if (lane == 0) {
        s_a[warp] = cnt;
    }
    __syncthreads();
    long long c = 0;
    for (int k = 0; k < nw; ++k) {
        c += s_a[k];
    }
    if (c == 0) {
        return;  // nothing finite: both slots keep their bits (every thread alike)
    }
    const long long k_lo = ((long long)lo_pct * (c - 1)) / 100;
    const long long k_hi = ((long long)hi_pct * (c - 1)) / 100;
    float v_lo, v_hi;
    if (sorted) {
        isvp_bitonic_sort(isvp_sorted, (int)P);  // (its first barrier also ends the reads of s_a)
        if (t != 0) {
            return;
        }
        v_lo = isvp_sorted[k_lo];
        v_hi = isvp_sorted[k_hi];
    } else {
        long long best_lo = n, best_hi = n;
        for (long long i = t; i < n; i += nt) {
            const float xi = q[i];
            if (!isfinite(xi)) {
                continue;
            }
            const float v = __fadd_rn(xi, 0.0f);
            long long less = 0, equal = 0;
            for (long long j = 0; j < n; ++j) {
                const float xj = q[j];
                if (isfinite(xj)) {
                    less += xj < v ? 1 : 0;
                    equal += xj == v ? 1 : 0;
                }
            }
            if (less <= k_lo && k_lo < less + equal && i < best_lo) {
                best_lo = i;
            }
            if (less <= k_hi && k_hi < less + equal && i < best_hi) {
                best_hi = i;
            }
        }
        best_lo = isvp_warp_min(best_lo);
        best_hi = isvp_warp_min(best_hi);
        __syncthreads();  // every thread has read the count partials in s_a
        if (lane == 0) {
            s_a[warp] = best_lo;
            s_b[warp] = best_hi;
        }
        __syncthreads();
        if (t != 0) {
            return;
        }
        for (int k = 1; k < nw; ++k) {
            best_lo = s_a[k] < best_lo ? s_a[k] : best_lo;
            best_hi = s_b[k] < best_hi ? s_b[k] : best_hi;
        }
        v_lo = __fadd_rn(q[best_lo], 0.0f);
        v_hi = __fadd_rn(q[best_hi], 0.0f);
    }
    const float alpha = hb_adaptive_rate(isv[sharpe_slot], alpha_base, sharpe_clamp,
                                         sharpe_gain);
    isv[lo_slot] = hb_guarded_ema(isv[lo_slot], v_lo, alpha);
    isv[hi_slot] = hb_guarded_ema(isv[hi_slot], v_hi, alpha);
}

// adaptive_support_update: per member m < n_members, centre / half-width (slots
// centre_base + m, half_base + m) from the percentile EMAs (p05_base + m, p95_base + m),
// bounded by Mech 2: bound = atom_growth_mult * fmaxf(isv[q_abs_ref_slot], 1). A non-finite
// percentile keeps the member's slots. Launch: grid 1, block >= n_members.
extern "C" __global__ void adaptive_support_update(float* __restrict__ isv, int n_members,
                                                   int p05_base, int p95_base, int centre_base,
                                                   int half_base, int q_abs_ref_slot,
                                                   float atom_growth_mult, float headroom,
                                                   float half_floor) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    const int m = threadIdx.x;
    if (m >= n_members) {
        return;
    }
    const float lo = isv[p05_base + m], hi = isv[p95_base + m];
    if (!isfinite(lo) || !isfinite(hi)) {
        return;
    }
    const float bound = __fmul_rn(atom_growth_mult, fmaxf(isv[q_abs_ref_slot], 1.0f));
    const float centre = __fmul_rn(0.5f, __fadd_rn(lo, hi));
    float half = fmaxf(__fmul_rn(headroom, __fmul_rn(0.5f, fabsf(__fsub_rn(hi, lo)))),
                       half_floor);
    half = fminf(half, bound);
    const float room = __fsub_rn(bound, half);
    isv[centre_base + m] = fminf(fmaxf(centre, -room), room);
    isv[half_base + m] = half;
}

// fminf(fmaxf(epoch / horizon, 0), 1): a NaN ratio counts as 0.
__device__ __forceinline__ float isvp_progress(float epoch, float horizon) {
    return fminf(fmaxf(__fdiv_rn(epoch, horizon), 0.0f), 1.0f);
}

// per_branch_gamma_update: isv[gamma_base_slot + k] = base[k] + (top[k] - base[k]) * p,
// p = progress(isv[epoch_slot], fmaxf(isv[total_slot] - 1, 1)), k < n_members.
// Launch: grid 1, block >= n_members.
extern "C" __global__ void per_branch_gamma_update(float* __restrict__ isv,
                                                   const float* __restrict__ gamma_base,
                                                   const float* __restrict__ gamma_max,
                                                   int n_members, int gamma_slot,
                                                   int epoch_slot, int total_slot) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    const int k = threadIdx.x;
    if (k >= n_members) {
        return;
    }
    const float p = isvp_progress(isv[epoch_slot], fmaxf(__fsub_rn(isv[total_slot], 1.0f), 1.0f));
    isv[gamma_slot + k] = __fadd_rn(gamma_base[k],
                                    __fmul_rn(__fsub_rn(gamma_max[k], gamma_base[k]), p));
}

// cql_alpha_ramp: isv[cql_slot] = ema(isv[cql_slot], cql_alpha * (1 - f), alpha), f =
// fminf(fmaxf(isv[eps_slot], 0), 1); a non-finite epsilon keeps the slot. Launch: grid 1,
// block 1 (or more: thread 0 works).
extern "C" __global__ void cql_alpha_ramp(float* __restrict__ isv, float cql_alpha, int cql_slot,
                                          int eps_slot, int sharpe_slot, float alpha_base,
                                          float sharpe_clamp, float sharpe_gain) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    if (threadIdx.x != 0) {
        return;
    }
    const float eps = isv[eps_slot];
    float target = __int_as_float(0x7fc00000);
    if (isfinite(eps)) {
        target = __fmul_rn(cql_alpha, __fsub_rn(1.0f, fminf(fmaxf(eps, 0.0f), 1.0f)));
    }
    const float alpha = hb_adaptive_rate(isv[sharpe_slot], alpha_base, sharpe_clamp,
                                         sharpe_gain);
    isv[cql_slot] = hb_guarded_ema(isv[cql_slot], target, alpha);
}

// epsilon_tau_update: isv[eps_slot] = fminf(schedule[0] * (2 - h), schedule[1]) (the loop's
// epsilon of this epoch and its cap), isv[tau_slot] = tau * (floor + (1 - floor) * h), h the
// clamped health (non-finite: 1). Launch: grid 1, block 1 (or more: thread 0 works).
extern "C" __global__ void epsilon_tau_update(float* __restrict__ isv,
                                              const float* __restrict__ schedule, float tau,
                                              float tau_health_floor, int eps_slot,
                                              int tau_slot, int health_slot) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    if (threadIdx.x != 0) {
        return;
    }
    const float raw_h = isv[health_slot];
    const float h = isfinite(raw_h) ? fminf(fmaxf(raw_h, 0.0f), 1.0f) : 1.0f;
    isv[eps_slot] = fminf(__fmul_rn(schedule[0], __fsub_rn(2.0f, h)), schedule[1]);
    isv[tau_slot] = __fmul_rn(tau, __fadd_rn(tau_health_floor,
                                             __fmul_rn(__fsub_rn(1.0f, tau_health_floor), h)));
}
