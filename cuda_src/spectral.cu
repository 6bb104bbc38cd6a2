// Spectral-norm kernels (SPEC 4 step 7): one power iteration and the sigma_max bound per weight
// matrix, one block per matrix. Twins of foxhunt.reference.kernels.spectral:
//
//     u = W v   / fmaxf(||W v||,   eps)
//     v = W^T u / fmaxf(||W^T u||, eps)
//     sigma = u . (W v)                      (with the new v; computed as (W^T u) . v_new)
//     if sigma > sigma_max: W = W * (sigma_max / sigma)
//
// Both kernels run the same device function, hb_spectral_norm_block, with the same block size
// (the launch plans in fast/kernels/spectral.py), so spectral_norm and batched_spectral_norm
// give bitwise identical results by construction (SPEC 7/8). Reductions are fixed trees: no
// atomics, the same bits on every run.
#include "hb_common.cuh"

// One matrix of a batched launch: W [rows, cols] row-major, u [rows], v [cols] (all updated in
// place). 32 bytes; fast/kernels/spectral.py builds the same layout (SPECTRAL_MATRIX_DTYPE).
struct SpectralMatrix {
    float* w;
    float* u;
    float* v;
    int rows;
    int cols;
};
static_assert(sizeof(SpectralMatrix) == 32, "descriptor layout shared with the Python side");

// Rows of W that one warp dots with v at the same time in phase 1 (independent loads in flight).
#define SPECTRAL_ROW_GROUP 4
// The most row slices that split the column sums of phase 2 (their partials are summed in
// shared memory, in slice order).
#define SPECTRAL_MAX_SLICES 32
// float4 chunks of W one thread rescales per round of phase 4 (loads in flight together).
#define SPECTRAL_SCALE_UNROLL 8

// Chunk c of a vector or matrix row: the 4 consecutive floats at p[4c .. 4c + 3], all in range.
// One float4 load where p is 16-byte aligned (`vec`), else four scalar loads: the same values,
// so the arithmetic and its bits do not depend on the alignment.
__device__ __forceinline__ float4 hb_chunk(const float* __restrict__ p, long long c, bool vec) {
    if (vec) {
        return reinterpret_cast<const float4*>(p)[c];
    }
    const float* q = p + 4 * c;
    return make_float4(q[0], q[1], q[2], q[3]);
}

// acc[k] += q[k] * x[k] for the 4 elements of a chunk (product rounded, then the sum).
__device__ __forceinline__ void hb_chunk_fma(float* acc, float4 q, float4 x) {
    acc[0] = __fadd_rn(acc[0], __fmul_rn(q.x, x.x));
    acc[1] = __fadd_rn(acc[1], __fmul_rn(q.y, x.y));
    acc[2] = __fadd_rn(acc[2], __fmul_rn(q.z, x.z));
    acc[3] = __fadd_rn(acc[3], __fmul_rn(q.w, x.w));
}

// One power iteration and the bound on one matrix, by the whole calling block. u, v and w are
// updated in place: the old u is never read (PyTorch's order), the old v only in phase 1.
// Requires blockDim.x % 32 == 0 and every thread of the block to call it. Writes *sigma_out.
// Not inlined: both kernels call the one compiled body, so their arithmetic is the same code.
//
// Every sum has a fixed order that depends only on (rows, cols, blockDim.x), never on the
// alignment of the pointers (float4 loads where aligned, scalar loads otherwise, same sums):
// columns are cut into chunks of 4 (the last one partial when cols % 4 != 0).
// - W v, row i: lane l of the row's warp keeps 4 accumulators (element k of its chunks
//   l, l + 32, ... in order; the partial chunk goes to the lane whose turn it is), combined as
//   (a0 + a1) + (a2 + a3), then the warp butterfly.
// - W^T u, column j: slice p of P sums rows p, p + P, ... in order; the P slice partials are
//   summed in slice order.
// - ||W v||^2, ||W^T u||^2, sigma: per-thread sums in a fixed order, then the block tree.
// sigma = (W^T u) . v_new, the dot of phase 2's unnormalised column sums with the new v:
// mathematically u . (W v_new), without a third pass over W.
__device__ __noinline__ void hb_spectral_norm_block(float* __restrict__ w, float* __restrict__ u,
                                                    float* __restrict__ v, int rows, int cols,
                                                    float sigma_max, float eps,
                                                    float* __restrict__ sigma_out) {
    __shared__ float scratch[HB_WARP + 1];
    __shared__ float partial[4 * HB_MAX_THREADS];  // phase 2: slices x columns
    const int lane = threadIdx.x % HB_WARP;
    const int warp = threadIdx.x / HB_WARP;
    const int warps = blockDim.x / HB_WARP;
    const int full = cols / 4;                   // full chunks of a row
    const int rest = cols - 4 * full;            // 0 to 3 columns of the partial chunk
    const int chunks = full + (rest > 0 ? 1 : 0);
    const bool w_vec = rest == 0 && (reinterpret_cast<unsigned long long>(w) & 15) == 0;
    const bool v_vec = (reinterpret_cast<unsigned long long>(v) & 15) == 0;

    // Phase 1: s = W v, SPECTRAL_ROW_GROUP rows per warp at a time (warp `warp` takes rows
    // warp, warp + warps, ...), s_i into u[i]; ||s||^2 over each warp's rows in order, then
    // the block tree.
    float sq = HB_SUM_IDENTITY;
    for (int base = warp; base < rows; base += SPECTRAL_ROW_GROUP * warps) {
        float acc[SPECTRAL_ROW_GROUP][4];
#pragma unroll
        for (int r = 0; r < SPECTRAL_ROW_GROUP; ++r) {
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                acc[r][k] = HB_SUM_IDENTITY;
            }
        }
#pragma unroll 2
        for (int c = lane; c < full; c += HB_WARP) {
            const float4 x = hb_chunk(v, c, v_vec);
#pragma unroll
            for (int r = 0; r < SPECTRAL_ROW_GROUP; ++r) {
                const int i = base + r * warps;
                if (i < rows) {
                    hb_chunk_fma(acc[r], hb_chunk(w + (long long)i * cols, c, w_vec), x);
                }
            }
        }
        if (rest > 0 && lane == full % HB_WARP) {  // the partial chunk, scalar
#pragma unroll
            for (int r = 0; r < SPECTRAL_ROW_GROUP; ++r) {
                const int i = base + r * warps;
                if (i < rows) {
                    const float* row = w + (long long)i * cols + 4 * full;
#pragma unroll
                    for (int k = 0; k < 3; ++k) {  // constant indices: acc stays in registers
                        if (k < rest) {
                            acc[r][k] = __fadd_rn(acc[r][k], __fmul_rn(row[k], v[4 * full + k]));
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < SPECTRAL_ROW_GROUP; ++r) {
            const int i = base + r * warps;  // warp-uniform
            if (i < rows) {
                const float s = hb_warp_sum(__fadd_rn(__fadd_rn(acc[r][0], acc[r][1]),
                                                      __fadd_rn(acc[r][2], acc[r][3])));
                if (lane == 0) {
                    u[i] = s;
                }
                sq = __fadd_rn(sq, __fmul_rn(s, s));
            }
        }
    }
    const float u_denom = fmaxf(__fsqrt_rn(hb_block_sum(lane == 0 ? sq : HB_SUM_IDENTITY, scratch)),
                                eps);
    for (int i = threadIdx.x; i < rows; i += blockDim.x) {
        u[i] = __fdiv_rn(u[i], u_denom);
    }
    __syncthreads();

    // Phase 2: x = W^T u. Threads form `slices` row slices of `width` threads; thread c of
    // slice p sums chunks c, c + width, ... of the rows p, p + slices, ... (4 column sums per
    // chunk, rows in order). One slice: the sums are final and go to v; several: to
    // `partial`, then summed in slice order. Only the v written here is read back below, by
    // the thread that wrote it, so no barrier is needed between the two.
    const int width = min(chunks, (int)blockDim.x);
    const int slices = max(1, min(min((int)blockDim.x / width, rows), SPECTRAL_MAX_SLICES));
    const int p = threadIdx.x / width;
    if (p < slices) {
        for (int c = threadIdx.x % width; c < chunks; c += width) {
            float acc[4] = {HB_SUM_IDENTITY, HB_SUM_IDENTITY, HB_SUM_IDENTITY, HB_SUM_IDENTITY};
            if (c < full) {
#pragma unroll 8
                for (int i = p; i < rows; i += slices) {
                    const float ui = u[i];
                    hb_chunk_fma(acc, hb_chunk(w + (long long)i * cols, c, w_vec),
                                 make_float4(ui, ui, ui, ui));
                }
            } else {  // the partial chunk
                for (int i = p; i < rows; i += slices) {
                    const float* row = w + (long long)i * cols + 4 * full;
#pragma unroll
                    for (int k = 0; k < 3; ++k) {
                        if (k < rest) {
                            acc[k] = __fadd_rn(acc[k], __fmul_rn(row[k], u[i]));
                        }
                    }
                }
            }
            float* dst = slices == 1 ? v : partial + p * cols;
            const int n = c < full ? 4 : rest;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                if (k < n) {
                    dst[4 * c + k] = acc[k];
                }
            }
        }
    }
    if (slices > 1) {
        __syncthreads();
        for (int j = threadIdx.x; j < cols; j += blockDim.x) {
            float x = partial[j];
            for (int q = 1; q < slices; ++q) {
                x = __fadd_rn(x, partial[q * cols + j]);
            }
            v[j] = x;
        }
    }
    // Each thread now owns the columns j it summed last: (slices == 1) the columns of its
    // chunks, else j = threadIdx.x, + blockDim.x, ...
    sq = HB_SUM_IDENTITY;
    if (slices == 1) {
        for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
            const int n = c < full ? 4 : rest;
            for (int k = 0; k < n; ++k) {
                const float x = v[4 * c + k];
                sq = __fadd_rn(sq, __fmul_rn(x, x));
            }
        }
    } else {
        for (int j = threadIdx.x; j < cols; j += blockDim.x) {
            const float x = v[j];
            sq = __fadd_rn(sq, __fmul_rn(x, x));
        }
    }
    const float v_denom = fmaxf(__fsqrt_rn(hb_block_sum(sq, scratch)), eps);

    // Phase 3: v = x / ||x|| on the same columns, and sigma = x . v (mathematically
    // u . (W v_new)), per thread in column order, then the block tree.
    float dot = HB_SUM_IDENTITY;
    if (slices == 1) {
        for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
            const int n = c < full ? 4 : rest;
            for (int k = 0; k < n; ++k) {
                const float x = v[4 * c + k];
                const float vn = __fdiv_rn(x, v_denom);
                v[4 * c + k] = vn;
                dot = __fadd_rn(dot, __fmul_rn(x, vn));
            }
        }
    } else {
        for (int j = threadIdx.x; j < cols; j += blockDim.x) {
            const float x = v[j];
            const float vn = __fdiv_rn(x, v_denom);
            v[j] = vn;
            dot = __fadd_rn(dot, __fmul_rn(x, vn));
        }
    }
    const float sigma = hb_block_sum(dot, scratch);

    // Phase 4: the bound. A NaN sigma compares false: W is left unchanged. hb_block_sum ended
    // with a barrier, so every read of W above is done. Elementwise: float4 where aligned.
    if (sigma > sigma_max) {
        const float scale = __fdiv_rn(sigma_max, sigma);
        const long long size = (long long)rows * cols;
        long long k0 = 0;
        if ((reinterpret_cast<unsigned long long>(w) & 15) == 0) {
            float4* w4 = reinterpret_cast<float4*>(w);
            const long long n4 = size / 4;
            // SPECTRAL_SCALE_UNROLL float4 loads in flight per thread, then their stores.
            for (long long base = threadIdx.x; base < n4;
                 base += SPECTRAL_SCALE_UNROLL * blockDim.x) {
                float4 q[SPECTRAL_SCALE_UNROLL];
#pragma unroll
                for (int j = 0; j < SPECTRAL_SCALE_UNROLL; ++j) {
                    const long long k = base + (long long)j * blockDim.x;
                    if (k < n4) {
                        q[j] = w4[k];
                    }
                }
#pragma unroll
                for (int j = 0; j < SPECTRAL_SCALE_UNROLL; ++j) {
                    const long long k = base + (long long)j * blockDim.x;
                    if (k < n4) {
                        q[j].x = __fmul_rn(q[j].x, scale);
                        q[j].y = __fmul_rn(q[j].y, scale);
                        q[j].z = __fmul_rn(q[j].z, scale);
                        q[j].w = __fmul_rn(q[j].w, scale);
                        w4[k] = q[j];
                    }
                }
            }
            k0 = 4 * n4;
        }
        for (long long k = k0 + threadIdx.x; k < size; k += blockDim.x) {
            w[k] = __fmul_rn(w[k], scale);
        }
    }
    if (threadIdx.x == 0) {
        *sigma_out = sigma;
    }
}

// spectral_norm: one matrix, grid 1, block SPECTRAL_THREADS (plan_spectral_norm).
extern "C" __global__ void __launch_bounds__(HB_MAX_THREADS)
spectral_norm(float* w, float* u, float* v, int rows, int cols, float sigma_max, float eps,
              float* sigma_out) {
    hb_spectral_norm_block(w, u, v, rows, cols, sigma_max, eps, sigma_out);
}

// batched_spectral_norm: matrix k of the descriptor array by block k; sigmas[k] its estimate.
// Grid count, block SPECTRAL_THREADS (plan_batched_spectral_norm).
extern "C" __global__ void __launch_bounds__(HB_MAX_THREADS)
batched_spectral_norm(const SpectralMatrix* __restrict__ mats, int count, float sigma_max,
                      float eps, float* __restrict__ sigmas) {
    const int k = blockIdx.x;
    if (k >= count) {
        return;  // uniform across the block
    }
    const SpectralMatrix mat = mats[k];
    hb_spectral_norm_block(mat.w, mat.u, mat.v, mat.rows, mat.cols, sigma_max, eps, &sigmas[k]);
}
