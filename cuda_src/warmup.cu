// The MSE warm-up kernel (SPEC 4, second wave), twin of
// foxhunt.reference.kernels.warmup.mse_warmup: the expected-Q MSE against the Mech 1 clipped
// scalar target, its logit gradient at the taken action, and the blend with the C51 logit
// gradient by w = fmaxf(0, 1 - epoch / W), epoch = ISV[EPOCH_IDX] read on the device.
//
// Branch-packed arrays (foxhunt.reference.kernels.fused): branch d's [R, n_d, NA] block starts
// at row R * action_offset[d]; logp has R = block_rows (the online pass over [s; s2]; its first
// `batch` samples are read), dlogits R = batch. q_taken, target_q are [n_branches, batch].
//
// Arithmetic: -fmad=false plus __fadd_rn/__fmul_rn/__fdiv_rn in the reference's order; expf
// against NumPy's float32 exp (a few ulp). The blend covers every element of dlogits (in place:
// the C51 gradient becomes the blended one), sample by sample: a warp per sample s = (d, b)
// (the warps of a grid-stride loop over the n_branches * batch samples), whose n_d rows of
// dlogits are one contiguous span of n_d * NA elements. The warp reads the sample's action with
// the span (lanes over the span, WARMUP_SPAN_BATCH elements per lane in flight), blends every
// element off the taken row, then the taken row's NA atoms (lanes over the atoms; its logp row,
// z, the row's C51 gradient and the sample's E, y, isw_b in flight together). Each element gets
// exactly the expression it got before (warmup_blend with the same arguments), so the bits
// depend on neither the mapping nor gridDim.x (grid-independent: a population may share the
// grid). Block 0 also sums the loss (a block_sum of reduce.cuh: a fixed tree over blockDim.x
// threads, no atomics), so its warps take the grid's last share of samples (one fewer where
// they do not divide evenly). w == 0: dlogits is neither read nor written. 32-bit indices:
// every array holds fewer than 2^30 elements (fast/kernels/_runtime.py MAX_ELEMENTS).
// blockDim.x: a multiple of 32, at most WARMUP_THREADS (plan_mse_warmup launches 256 threads;
// __launch_bounds__ holds the kernel to 32 registers, so 8 such blocks fit an SM: the full
// wave a shared grid assumes).

#include "early_launch.cuh"  // fh_early_wait, fh_early_release
#include "reduce.cuh"  // block_sum, REDUCE_SUM_IDENTITY, REDUCE_WARP, REDUCE_FULL_MASK

// Threads per block (fast/kernels/warmup.py WARMUP_THREADS) and the blocks per SM they keep.
#define WARMUP_THREADS 256
#define WARMUP_MIN_BLOCKS 8
// Span elements per lane in flight per pass (a seed sample's 3 x 51 atoms: one pass).
#define WARMUP_SPAN_BATCH 5
// Taken-row atoms per lane in flight per pass (51 atoms: one pass).
#define WARMUP_ROW_BATCH 2
// Branches whose tables (n_actions, action_offset) the block keeps in shared memory.
#define WARMUP_TABLE 32

// One element of the blend: g (0 off the taken action) and (1 - w) * c + w * g.
static __device__ __forceinline__ float warmup_blend(float c, bool taken, float coef, float lp,
                                                     float zj, float e, float keep, float w) {
    float g = 0.0f;
    if (taken) {
        g = __fmul_rn(coef, __fmul_rn(expf(lp), __fsub_rn(zj, e)));
    }
    return __fadd_rn(__fmul_rn(keep, c), __fmul_rn(w, g));
}

// ---------------------------------------------------------------------------------------------
// mse_warmup, with scale = 1 / (batch * n_branches), E = q_taken[d, b], y = target_q[d, b]:
//   td = E - y;  *loss = (sum_{d, b} isw_b * (0.5 * (td * td))) * scale      (block 0)
//   w = fmaxf(0, 1 - isv[epoch_index] / warmup_epochs);  *weight = w          (block 0)
//   if w > 0, every element (d, b, a, j):
//     g = a == actions[d, b] ? ((isw_b * scale) * td) * (expf(logp_d[b, a, j]) * (z_j - E)) : 0
//     dlogits = (1 - w) * dlogits + w * g
// Sample s = d * batch + b owns rows batch * action_offset[d] + b * n_d + a, a < n_d, of
// dlogits: span elements i = a * NA + j. An action outside [0, n_d) takes no row (every
// element gets g = 0, as before).
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(WARMUP_THREADS, WARMUP_MIN_BLOCKS)
mse_warmup(const float* __restrict__ logp, const int* __restrict__ actions,
           const float* __restrict__ q_taken, const float* __restrict__ target_q,
           const float* __restrict__ isw, const float* __restrict__ z, float* dlogits,
           const float* __restrict__ isv, int epoch_index, int warmup_epochs,
           const int* __restrict__ n_actions, const int* __restrict__ action_offset,
           float* __restrict__ loss, float* __restrict__ weight, int n_branches, int batch,
           int block_rows, int num_atoms) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    // The branch tables in shared memory (n_branches <= WARMUP_TABLE), loaded beside the ISV.
    __shared__ int table_na[WARMUP_TABLE], table_off[WARMUP_TABLE];
    __shared__ float shared_scale;  // for the taken rows: read there, not held in a register
    const bool tables_shared = n_branches <= WARMUP_TABLE;
    if (tables_shared && (int)threadIdx.x < n_branches) {
        table_na[threadIdx.x] = n_actions[threadIdx.x];
        table_off[threadIdx.x] = action_offset[threadIdx.x];
    }
    const float scale = __fdiv_rn(1.0f, (float)(batch * n_branches));
    if (threadIdx.x == 0) {
        shared_scale = scale;
    }
    const float w = fmaxf(0.0f, __fsub_rn(1.0f, __fdiv_rn(isv[epoch_index], (float)warmup_epochs)));
    if (blockIdx.x == 0) {
        __shared__ float scratch[REDUCE_WARP + 1];
        float acc = REDUCE_SUM_IDENTITY;
        const int n_rows = n_branches * batch;
        for (int i = threadIdx.x; i < n_rows; i += blockDim.x) {
            const float td = __fsub_rn(q_taken[i], target_q[i]);
            acc = __fadd_rn(acc, __fmul_rn(isw[i % batch], __fmul_rn(0.5f, __fmul_rn(td, td))));
        }
        const float total = block_sum(acc, scratch);
        if (threadIdx.x == 0) {
            *loss = __fmul_rn(__fadd_rn(total, 0.0f), scale);  // +0.0, never -0.0
            *weight = w;
        }
    }
    const unsigned int warps = blockDim.x / REDUCE_WARP;
    const unsigned int warp = threadIdx.x / REDUCE_WARP;
    if (!(w > 0.0f)) {
        return;
    }
    __syncthreads();  // the tables and the scale (w is block-uniform: every thread is here)
    if (warp >= warps) {
        return;  // a partial last warp (never planned)
    }
    const unsigned int lane = threadIdx.x & (REDUCE_WARP - 1);
    const float keep = __fsub_rn(1.0f, w);
    const unsigned int nb = (unsigned int)batch;
    const unsigned int na_all = (unsigned int)num_atoms;
    const unsigned int samples = nb * (unsigned int)n_branches;
    // Block 0 (which summed the loss) takes the grid's last share of samples.
    const unsigned int share = blockIdx.x == 0 ? gridDim.x - 1u : blockIdx.x - 1u;
    const unsigned int stride = gridDim.x * warps;
    for (unsigned int s = share * warps + warp; s < samples; s += stride) {  // warp-uniform
        const unsigned int d = s / nb;
        const unsigned int b = s - d * nb;
        unsigned int na, off;
        if (tables_shared) {
            na = (unsigned int)table_na[d];
            off = (unsigned int)table_off[d];
        } else {
            na = (unsigned int)n_actions[d];
            off = (unsigned int)action_offset[d];
        }
        const int t = actions[s];  // in flight with the span's loads
        float* out = dlogits + (nb * off + b * na) * na_all;
        const unsigned int span = na * na_all;
        const bool has_taken = (unsigned int)t < na;
        const unsigned int t0 = has_taken ? (unsigned int)t * na_all : span;  // taken row's first
        // Every element off the taken row (i - t0 >= na_all, unsigned): keep * c + w * 0.
        for (unsigned int base = lane; base < span; base += WARMUP_SPAN_BATCH * REDUCE_WARP) {
            float* p = out + base;  // element base + 32 k at p[32 k]: one address, immediates
            const unsigned int left = span - base;      // k * 32 < left: inside the span
            const unsigned int skip = t0 - base;        // k * 32 - skip < na_all: the taken row
            float c[WARMUP_SPAN_BATCH];
#pragma unroll
            for (int k = 0; k < WARMUP_SPAN_BATCH; ++k) {
                if (k * REDUCE_WARP < left) {
                    c[k] = p[k * REDUCE_WARP];
                }
            }
#pragma unroll
            for (int k = 0; k < WARMUP_SPAN_BATCH; ++k) {
                if (k * REDUCE_WARP < left && (unsigned int)(k * REDUCE_WARP) - skip >= na_all) {
                    p[k * REDUCE_WARP] =
                        warmup_blend(c[k], false, 0.0f, 0.0f, 0.0f, 0.0f, keep, w);
                }
            }
        }
        if (!has_taken) {
            continue;
        }
        // The taken row: atoms j = lane, lane + 32, ... (elements t0 + j of the span). Its
        // scalars load with its first atoms (one round trip after the action's).
        const float e = q_taken[s];
        const float coef = __fmul_rn(__fmul_rn(isw[b], shared_scale), __fsub_rn(e, target_q[s]));
        const float* lp =
            logp + ((unsigned int)block_rows * off + b * na + (unsigned int)t) * na_all;
        float* row = out + t0;
        for (unsigned int base = lane; base < na_all; base += WARMUP_ROW_BATCH * REDUCE_WARP) {
            const unsigned int left = na_all - base;
            float c[WARMUP_ROW_BATCH], l[WARMUP_ROW_BATCH], zj[WARMUP_ROW_BATCH];
#pragma unroll
            for (int k = 0; k < WARMUP_ROW_BATCH; ++k) {
                if (k * REDUCE_WARP < left) {
                    c[k] = row[base + k * REDUCE_WARP];
                    l[k] = lp[base + k * REDUCE_WARP];
                    zj[k] = z[base + k * REDUCE_WARP];
                }
            }
#pragma unroll
            for (int k = 0; k < WARMUP_ROW_BATCH; ++k) {
                if (k * REDUCE_WARP < left) {
                    row[base + k * REDUCE_WARP] = warmup_blend(c[k], true, coef, l[k], zj[k], e,
                                                               keep, w);
                }
            }
        }
    }
}
