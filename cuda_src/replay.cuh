// Device code shared by the replay kernels (cuda_src/replay.cu) and the collector's fused
// kernels (cuda_src/collect.cu; twins: foxhunt.reference.kernels.replay and .collect): the
// proportional search, the importance weights of a sampled batch and the n-step window step.
// No __global__ functions here; every function is the one its kernels' comments specify, so a
// fused kernel and the kernels it fuses give the same bits.
#pragma once

#include "ha_common.cuh"
#include "reduce.cuh"  // block_reduce_down

// The first i in [0, n_items) with at(i) > target; n_items - 1 when there is none (at(i): the
// inclusive prefix sum at i, read from memory or formed on the fly: replay_batch).
template <typename Prefix>
static __device__ __forceinline__ int proportional_search_at(const Prefix& at, int n_items,
                                                             float target) {
    int lo = 0;
    int hi = n_items - 1;
    while (lo < hi) {
        const int mid = lo + (hi - lo) / 2;  // == (lo + hi) // 2, without int overflow
        if (at(mid) > target) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    return lo;
}

struct PrefixArray {
    const float* __restrict__ prefix;
    __device__ __forceinline__ float operator()(int i) const { return prefix[i]; }
};

// The first i in [0, n_items) with prefix[i] > target; n_items - 1 when there is none.
static __device__ __forceinline__ int proportional_search(const float* __restrict__ prefix,
                                                          int n_items, float target) {
    return proportional_search_at(PrefixArray{prefix}, n_items, target);
}

// The ring scan's tiles (replay.cu: scan_tiles / scan_offsets; replay_batch applies the
// offsets on the fly).
#define RING_SCAN_THREADS 256
#define RING_SCAN_WARPS (RING_SCAN_THREADS / HA_WARP_SIZE)
#define RING_SCAN_ITEMS 4
#define RING_SCAN_TILE (RING_SCAN_THREADS * RING_SCAN_ITEMS)

// importance_weights' body (ONE block, every thread calls it): w_k = powf(p_min / p_{idx[k]},
// beta), p_min = fminf-reduce of the sampled priorities (NaN ignored; NaN only if all are NaN).
static __device__ __forceinline__ void importance_weights_block(
    const float* __restrict__ priorities, const int* __restrict__ idx, float* __restrict__ w,
    int n, float beta) {
    float p_min = ha_nan();
    for (int k = threadIdx.x; k < n; k += blockDim.x) {
        p_min = fminf(p_min, priorities[idx[k]]);
    }
    p_min = block_reduce_down(p_min, HaFmin(), ha_nan());
    for (int k = threadIdx.x; k < n; k += blockDim.x) {
        w[k] = powf(p_min / priorities[idx[k]], beta);
    }
}

// replay_gather's body (also replay_batch's, collect.cu): the rows idx[0..n) of the ring in the
// step's batch layout (x [2n, state_dim]: s rows then s2 rows; a [n_branches, n] transposed; r,
// done [n]; next_ret, regime, discount [n] where not null). Grid-stride over the elements of
// every grid that runs it; copies only (exact).
static __device__ __forceinline__ void replay_gather_rows(
    const int* __restrict__ idx, int n, int state_dim, int n_branches,
    const float* __restrict__ ring_s, const int* __restrict__ ring_a,
    const float* __restrict__ ring_r, const float* __restrict__ ring_s2,
    const float* __restrict__ ring_done, const float* __restrict__ ring_next_ret,
    const int* __restrict__ ring_regime, const float* __restrict__ ring_discount,
    float* __restrict__ x, int* __restrict__ a, float* __restrict__ r, float* __restrict__ done,
    float* __restrict__ next_ret, int* __restrict__ regime, float* __restrict__ discount) {
    const long long n_state = (long long)n * state_dim;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (long long e = first; e < n_state; e += stride) {
        const long long src = (long long)idx[e / state_dim] * state_dim + e % state_dim;
        x[e] = ring_s[src];
        x[n_state + e] = ring_s2[src];
    }
    for (long long e = first; e < (long long)n * n_branches; e += stride) {
        const int d = (int)(e / n);
        a[e] = ring_a[(long long)idx[e % n] * n_branches + d];
    }
    for (long long k = first; k < n; k += stride) {
        const int row = idx[k];
        r[k] = ring_r[row];
        done[k] = ring_done[row];
        if (next_ret != nullptr) {
            next_ret[k] = ring_next_ret[row];
        }
        if (regime != nullptr) {
            regime[k] = ring_regime[row];
        }
        if (discount != nullptr) {
            discount[k] = ring_discount[row];
        }
    }
}

// nstep_window's transitions of one env step (replay.cu's comment is the contract).
__device__ __forceinline__ int nstep_count(int len0, float done, int n_step) {
    const int L = len0 + 1;
    return done != 0.0f ? L : (L == n_step ? 1 : 0);
}

// Where output row k goes: row k itself (capacity 0: nstep_window's out_* arrays) or ring row
// (base + k) % capacity (collect_transition: the ring at its cursor, like replay_add).
struct NStepRows {
    long long base;
    long long capacity;
    __device__ __forceinline__ long long at(long long k) const {
        return capacity > 0 ? (base + k) % capacity : k;
    }
};

// nstep_window after its prefix (ONE block, every thread calls it; len0 / row0 hold the old
// window lengths and each env's first output row, visible to every thread): the outputs to the
// rows that rows.at maps them to, a barrier (every output read its window slots), then the
// windows emptied (episode ended), shifted a slot (the oldest left) or appended to. Sums in
// the reference's order, every product and sum rounded on its own (no FMA). The step's inputs
// (obs ... regime) carry no __restrict__: collect_transition writes them earlier in the same
// launch, so they must not be read through the non-coherent read-only path.
static __device__ __forceinline__ void nstep_emit(
    const float* obs, const int* actions, const float* r, const float* done, const float* s2,
    const float* next_ret, const int* regime, int n_envs,
    int state_dim, int n_branches, int n_step, float gamma_ref, float* __restrict__ win_s,
    int* __restrict__ win_a, float* __restrict__ win_r, float* __restrict__ win_next_ret,
    int* __restrict__ win_regime, int* __restrict__ win_len, const int* len0, const int* row0,
    NStepRows rows, float* __restrict__ out_s, int* __restrict__ out_a,
    float* __restrict__ out_r, float* __restrict__ out_s2, float* __restrict__ out_done,
    float* __restrict__ out_next_ret, int* __restrict__ out_regime,
    float* __restrict__ out_discount) {
    const int n = n_step;
    // the outputs
    for (int x = threadIdx.x; x < n_envs * state_dim; x += blockDim.x) {
        const int e = x / state_dim, f = x % state_dim, L0 = len0[e];
        const int count = nstep_count(L0, done[e], n);
        for (int j = 0; j < count; ++j) {
            const long long row = row0[e] + j;
            out_s[rows.at(row) * state_dim + f] =
                j < L0 ? win_s[((long long)e * n + j) * state_dim + f] : obs[x];
            out_s2[rows.at(row) * state_dim + f] = s2[x];
        }
    }
    for (int x = threadIdx.x; x < n_envs * n_branches; x += blockDim.x) {
        const int e = x / n_branches, d = x % n_branches, L0 = len0[e];
        const int count = nstep_count(L0, done[e], n);
        for (int j = 0; j < count; ++j) {
            out_a[rows.at(row0[e] + j) * n_branches + d] =
                j < L0 ? win_a[((long long)e * n + j) * n_branches + d] : actions[x];
        }
    }
    for (int e = threadIdx.x; e < n_envs; e += blockDim.x) {
        const int L0 = len0[e];
        const int count = nstep_count(L0, done[e], n);
        for (int j = 0; j < count; ++j) {
            const long long row = rows.at(row0[e] + j);
            const int k = L0 + 1 - j;
            float acc = j < L0 ? win_r[e * n + j] : r[e];
            float gk = gamma_ref;
            for (int i = 1; i < k; ++i) {
                const float rw = j + i < L0 ? win_r[e * n + j + i] : r[e];
                acc = __fadd_rn(acc, __fmul_rn(gk, rw));
                gk = __fmul_rn(gk, gamma_ref);
            }
            out_r[row] = acc;
            out_discount[row] = gk;
            out_done[row] = done[e];
            out_next_ret[row] = j < L0 ? win_next_ret[e * n + j] : next_ret[e];
            out_regime[row] = j < L0 ? win_regime[e * n + j] : regime[e];
        }
    }
    __syncthreads();  // every output read its window slots
    // the windows: emptied (episode ended), shifted a slot (the oldest left) or appended to
    for (int x = threadIdx.x; x < n_envs * state_dim; x += blockDim.x) {
        const int e = x / state_dim, f = x % state_dim, L0 = len0[e];
        if (done[e] != 0.0f) continue;
        float* w = win_s + (long long)e * n * state_dim + f;
        if (L0 + 1 == n) {
            for (int i = 0; i < L0; ++i) {
                w[(long long)i * state_dim] = i + 1 < L0 ? w[(long long)(i + 1) * state_dim] : obs[x];
            }
        } else {
            w[(long long)L0 * state_dim] = obs[x];
        }
    }
    for (int x = threadIdx.x; x < n_envs * n_branches; x += blockDim.x) {
        const int e = x / n_branches, d = x % n_branches, L0 = len0[e];
        if (done[e] != 0.0f) continue;
        int* w = win_a + (long long)e * n * n_branches + d;
        if (L0 + 1 == n) {
            for (int i = 0; i < L0; ++i) {
                w[i * n_branches] = i + 1 < L0 ? w[(i + 1) * n_branches] : actions[x];
            }
        } else {
            w[L0 * n_branches] = actions[x];
        }
    }
    for (int e = threadIdx.x; e < n_envs; e += blockDim.x) {
        const int L0 = len0[e];
        float* wr = win_r + e * n;
        float* wn = win_next_ret + e * n;
        int* wg = win_regime + e * n;
        if (done[e] != 0.0f) {
            win_len[e] = 0;
        } else if (L0 + 1 == n) {
            for (int i = 0; i < L0; ++i) {
                const bool old = i + 1 < L0;
                wr[i] = old ? wr[i + 1] : r[e];
                wn[i] = old ? wn[i + 1] : next_ret[e];
                wg[i] = old ? wg[i + 1] : regime[e];
            }
            win_len[e] = L0;
        } else {
            wr[L0] = r[e];
            wn[L0] = next_ret[e];
            wg[L0] = regime[e];
            win_len[e] = L0 + 1;
        }
    }
}

