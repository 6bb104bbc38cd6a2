// Prioritised-replay kernels (reference: foxhunt.reference.kernels.replay; SPEC 10):
// inclusive prefix sums of the priorities, proportional sampling by binary search, and the
// importance weights of the sampled batch. Deterministic, no atomics; everything stays on the
// device (the sampling total is read from the prefix array, not from the host).
#include "ha_common.cuh"
#include "reduce.cuh"  // block_reduce_down

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
// sample_proportional: out[k] = the first i with prefix[i] > u[k] * prefix[n_items - 1], by
// the reference's binary search (n_items - 1 when none exceeds the target: total 0, NaN target,
// u >= 1). Exact: same float32 target, same comparisons. One thread per uniform, any grid.
// ------------------------------------------------------------------------------------------

extern "C" __global__ void sample_proportional(const float* __restrict__ prefix, int n_items,
                                               const float* __restrict__ u,
                                               int* __restrict__ out, int n) {
    const float total = prefix[n_items - 1];
    for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < n; k += gridDim.x * blockDim.x) {
        const float target = u[k] * total;
        int lo = 0;
        int hi = n_items - 1;
        while (lo < hi) {
            const int mid = lo + (hi - lo) / 2;  // == (lo + hi) // 2, without int overflow
            if (prefix[mid] > target) {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        out[k] = lo;
    }
}

// ------------------------------------------------------------------------------------------
// importance_weights: w_k = powf(p_min / p_{idx[k]}, beta), p_min = fminf-reduce of the sampled
// priorities (NaN ignored; NaN only if all are NaN). ONE block (blockDim.x a multiple of 32):
// the minimum is exact, so it is order-independent; then one division and one powf per weight
// (powf is not correctly rounded: a few ULP, within the conformance tolerance). The caller
// guarantees 0 <= idx[k] < n_valid (the test entry checks, like the reference).
// ------------------------------------------------------------------------------------------

extern "C" __global__ void importance_weights(const float* __restrict__ priorities,
                                              const int* __restrict__ idx,
                                              float* __restrict__ w, int n, float beta) {
    float p_min = ha_nan();
    for (int k = threadIdx.x; k < n; k += blockDim.x) {
        p_min = fminf(p_min, priorities[idx[k]]);
    }
    p_min = block_reduce_down(p_min, HaFmin(), ha_nan());
    for (int k = threadIdx.x; k < n; k += blockDim.x) {
        w[k] = powf(p_min / priorities[idx[k]], beta);
    }
}
