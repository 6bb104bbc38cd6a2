// Spectral-norm kernels (SPEC 4 step 7): one power iteration and the sigma_max bound per weight
// matrix, one block per matrix. Twins of foxhunt.reference.kernels.spectral:
//
//     u = W v   / fmaxf(||W v||,   eps)
//     v = W^T u / fmaxf(||W^T u||, eps)
//     sigma = u . (W v)                      (with the new v)
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

// Dot product of row i of W with x, summed by one warp: lane l takes the columns l, l + 32, ...
// (products rounded, summed in column order), then the warp's butterfly. Every lane returns it.
__device__ __forceinline__ float hb_row_dot(const float* w, long long row_start, int cols,
                                            const float* x, int lane) {
    float acc = HB_SUM_IDENTITY;
    for (int j = lane; j < cols; j += HB_WARP) {
        acc = __fadd_rn(acc, __fmul_rn(w[row_start + j], x[j]));
    }
    return hb_warp_sum(acc);
}

// One power iteration and the bound on one matrix, by the whole calling block. u, v and w are
// updated in place: the old u is never read (PyTorch's order), the old v only in phase 1.
// Requires blockDim.x % 32 == 0 and every thread of the block to call it. Writes *sigma_out.
// Not inlined: both kernels call the one compiled body, so their arithmetic is the same code.
__device__ __noinline__ void hb_spectral_norm_block(float* w, float* u, float* v, int rows, int cols,
                                       float sigma_max, float eps, float* sigma_out) {
    __shared__ float scratch[HB_WARP + 1];
    const int lane = threadIdx.x % HB_WARP;
    const int warp = threadIdx.x / HB_WARP;
    const int warps = blockDim.x / HB_WARP;

    // Phase 1: u = W v (one warp per row, rows dealt round-robin), and ||W v||^2 (each warp's
    // rows in order, then the block tree over warps).
    float sq = HB_SUM_IDENTITY;
    for (int i = warp; i < rows; i += warps) {
        const float s = hb_row_dot(w, (long long)i * cols, cols, v, lane);
        if (lane == 0) {
            u[i] = s;
        }
        sq = __fadd_rn(sq, __fmul_rn(s, s));
    }
    const float u_denom = fmaxf(__fsqrt_rn(hb_block_sum(lane == 0 ? sq : HB_SUM_IDENTITY, scratch)),
                                eps);
    for (int i = threadIdx.x; i < rows; i += blockDim.x) {
        u[i] = __fdiv_rn(u[i], u_denom);
    }
    __syncthreads();

    // Phase 2: v = W^T u, one thread per column summing the rows in order (the reference's
    // row-by-row order), and ||W^T u||^2 (each thread's columns in order, then the block tree).
    sq = HB_SUM_IDENTITY;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        float acc = HB_SUM_IDENTITY;
        for (int i = 0; i < rows; ++i) {
            acc = __fadd_rn(acc, __fmul_rn(w[(long long)i * cols + j], u[i]));
        }
        v[j] = acc;
        sq = __fadd_rn(sq, __fmul_rn(acc, acc));
    }
    const float v_denom = fmaxf(__fsqrt_rn(hb_block_sum(sq, scratch)), eps);
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        v[j] = __fdiv_rn(v[j], v_denom);  // this thread's own columns from phase 2
    }
    __syncthreads();

    // Phase 3: sigma = u . (W v) with the new v (rows as in phase 1).
    float dot = HB_SUM_IDENTITY;
    for (int i = warp; i < rows; i += warps) {
        const float s = hb_row_dot(w, (long long)i * cols, cols, v, lane);
        dot = __fadd_rn(dot, __fmul_rn(u[i], s));
    }
    const float sigma = hb_block_sum(lane == 0 ? dot : HB_SUM_IDENTITY, scratch);

    // Phase 4: the bound. A NaN sigma compares false: W is left unchanged. hb_block_sum ended
    // with a barrier, so every read of W above is done.
    if (sigma > sigma_max) {
        const float scale = __fdiv_rn(sigma_max, sigma);
        const long long size = (long long)rows * cols;
        for (long long k = threadIdx.x; k < size; k += blockDim.x) {
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
