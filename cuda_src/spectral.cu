// Spectral-norm kernels (SPEC 4 step 7): one power iteration and the sigma_max bound per weight
// matrix. Twins of foxhunt.reference.kernels.spectral:
//
//     u = W v   / fmaxf(||W v||,   eps)
//     v = W^T u / fmaxf(||W^T u||, eps)
//     sigma = u . (W v)                      (with the new v; computed as (W^T u) . v_new)
//     if sigma > sigma_max: W = W * (sigma_max / sigma)
//
// One matrix per thread-block cluster of SPECTRAL_CLUSTER blocks: 8 on sm_90 and newer, whose
// blocks exchange their partial sums through distributed shared memory, 1 before sm_90 (then
// the "cluster" is the block and its barrier __syncthreads). Block rank r of the cluster takes
// the rows [r R, (r + 1) R), R = ceil(rows / C): W v on them, their part of the column sums of
// W^T u, and their rescale (a block only ever reads and writes its own rows of W, so the
// blocks meet only at the cluster barriers). Both kernels run the same device function with the
// same cluster and block size (the launch plans in fast/kernels/spectral.py), so spectral_norm
// and batched_spectral_norm are bitwise identical by construction (SPEC 7/8).
//
// Every sum has a fixed order that depends only on (rows, cols, blockDim.x, C), never on
// timing or pointer alignment (no atomics), so the bits are the same on every run:
// - (W v)_i: lane l of the row's warp sums the columns l, l + 32, ... in order, then the warp
//   butterfly.
// - (W^T u)_j: each block sums its rows in order; the C block partials are added in rank order
//   by the block that owns column j (columns are dealt out per tile of SPECTRAL_COL_TILE).
// - ||W v||^2, ||W^T u||^2, sigma: per-thread sums in a fixed order, the block tree, then the C
//   block sums in rank order (every block adds them itself: all get the same value).
// sigma = (W^T u) . v_new, the dot of the unnormalised column sums with the new v:
// mathematically u . (W v_new), without a third pass over W.
#include "early_launch.cuh"  // fh_early_wait, fh_early_release
#include "reduce.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define SPECTRAL_CLUSTER 8
#else
#define SPECTRAL_CLUSTER 1
// No clusters before sm_90 (the attribute is an error there): the kernels below keep their
// __cluster_dims__ spelling (conformance/cuda_parse.py reads it) and it expands to nothing.
#undef __cluster_dims__
#define __cluster_dims__(...)
#endif

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

// Columns per tile of the W^T u partials (one float each in shared memory).
#define SPECTRAL_COL_TILE 4096
// Elements of W one thread rescales per round (loads in flight together).
#define SPECTRAL_SCALE_UNROLL 8

// The cluster (PTX ISA 7.8, sm_90): rank of this block, barrier (release/acquire: the shared
// and global writes before it are visible to every block of the cluster after it), and a
// float of another block's shared memory (distributed shared memory).
struct SpectralCluster {
    static __device__ __forceinline__ int rank() {
#if SPECTRAL_CLUSTER > 1
        unsigned int r;
        asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
        return (int)r;
#else
        return 0;
#endif
    }
    static __device__ __forceinline__ void sync() {
#if SPECTRAL_CLUSTER > 1
        asm volatile("barrier.cluster.arrive.release.aligned;\n\t"
                     "barrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
        __syncthreads();
#endif
    }
    static __device__ __forceinline__ float read(float* local, int block_rank) {
#if SPECTRAL_CLUSTER > 1
        const unsigned int addr = (unsigned int)__cvta_generic_to_shared(local);
        unsigned int remote;
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                     : "=r"(remote) : "r"(addr), "r"(block_rank));
        float x;
        asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(x) : "r"(remote) : "memory");
        return x;
#else
        return *local;
#endif
    }
};

// The cluster's sum of one value per block: the block publishes `mine` in its shared `slot`,
// and after the cluster barrier every block adds the C slots in rank order (the same value in
// all of them), broadcast to its threads through `total`. A slot is written once per call site:
// the next barrier (the last one is at the end of the kernel) keeps it alive for the readers.
__device__ __forceinline__ float spectral_cluster_sum(float mine, float* slot, float* total) {
    if (threadIdx.x == 0) {
        *slot = mine;
    }
    SpectralCluster::sync();
    if (threadIdx.x == 0) {
        float s = SpectralCluster::read(slot, 0);
        for (int r = 1; r < SPECTRAL_CLUSTER; ++r) {
            s = __fadd_rn(s, SpectralCluster::read(slot, r));
        }
        *total = s;
    }
    __syncthreads();
    return *total;
}

// The columns [o0, o1) of a tile of `width` columns that block `rank` owns.
__device__ __forceinline__ void spectral_owned(int width, int rank, int& o0, int& o1) {
    const int q = (width + SPECTRAL_CLUSTER - 1) / SPECTRAL_CLUSTER;
    o0 = min(width, rank * q);
    o1 = min(width, o0 + q);
}

// One power iteration and the bound on one matrix, by the calling cluster (every thread of its
// SPECTRAL_CLUSTER blocks calls it; blockDim.x % 32 == 0). u, v and w are updated in place: the
// old u is never read (PyTorch's order), the old v only in phase 1. Block rank 0 writes
// *sigma_out. Not inlined: both kernels call the one compiled body.
__device__ __noinline__ void hb_spectral_norm_cluster(float* __restrict__ w, float* __restrict__ u,
                                                      float* __restrict__ v, int rows, int cols,
                                                      float sigma_max, float eps,
                                                      float* __restrict__ sigma_out) {
    __shared__ float scratch[REDUCE_WARP + 1];
    __shared__ float slots[3];  // this block's ||W v||^2, ||W^T u||^2 and sigma partials
    __shared__ float total;
    __shared__ float partial[SPECTRAL_COL_TILE];  // this block's column sums of one tile
    const int rank = SpectralCluster::rank();
    const int lane = threadIdx.x % REDUCE_WARP;
    const int warp = threadIdx.x / REDUCE_WARP;
    const int warps = blockDim.x / REDUCE_WARP;
    const int per = (rows + SPECTRAL_CLUSTER - 1) / SPECTRAL_CLUSTER;
    const int r0 = min(rows, rank * per);
    const int r1 = min(rows, r0 + per);

    // Phase 1: s_i = (W v)_i for the block's rows (warp `warp` takes rows r0 + warp,
    // + warps, ...), into u[i]; lane 0 sums its rows' s_i^2 in order.
    float sq = REDUCE_SUM_IDENTITY;
    for (int i = r0 + warp; i < r1; i += warps) {
        const float* row = w + (long long)i * cols;
        float acc = REDUCE_SUM_IDENTITY;
#pragma unroll 8
        for (int j = lane; j < cols; j += REDUCE_WARP) {
            acc = __fadd_rn(acc, __fmul_rn(row[j], v[j]));
        }
        const float s = warp_sum(acc);
        if (lane == 0) {
            u[i] = s;
            sq = __fadd_rn(sq, __fmul_rn(s, s));
        }
    }
    // The cluster barrier inside also orders every block's phase-1 reads of the old v before
    // any block writes the new v below.
    const float u_sq = spectral_cluster_sum(
        block_sum(lane == 0 ? sq : REDUCE_SUM_IDENTITY, scratch), &slots[0], &total);
    const float u_denom = fmaxf(__fsqrt_rn(u_sq), eps);
    for (int i = r0 + threadIdx.x; i < r1; i += blockDim.x) {
        u[i] = __fdiv_rn(u[i], u_denom);
    }
    __syncthreads();

    // Phase 2: x = W^T u, one tile of columns at a time: thread t sums the tile's columns t,
    // t + blockDim.x, ... over the block's rows in order into `partial`; after the barrier the
    // owner of each column adds the C partials in rank order and stores x_j in v[j]; a second
    // barrier lets the next tile reuse `partial`. Each thread sums its owned x_j^2 in order.
    float sqx = REDUCE_SUM_IDENTITY;
    for (int c0 = 0; c0 < cols; c0 += SPECTRAL_COL_TILE) {
        const int width = min(SPECTRAL_COL_TILE, cols - c0);
        for (int j = threadIdx.x; j < width; j += blockDim.x) {
            const float* col = w + c0 + j;
            float acc = REDUCE_SUM_IDENTITY;
#pragma unroll 8
            for (int i = r0; i < r1; ++i) {
                acc = __fadd_rn(acc, __fmul_rn(col[(long long)i * cols], u[i]));
            }
            partial[j] = acc;
        }
        SpectralCluster::sync();
        int o0, o1;
        spectral_owned(width, rank, o0, o1);
        for (int j = o0 + threadIdx.x; j < o1; j += blockDim.x) {
            float x = SpectralCluster::read(&partial[j], 0);
            for (int r = 1; r < SPECTRAL_CLUSTER; ++r) {
                x = __fadd_rn(x, SpectralCluster::read(&partial[j], r));
            }
            v[c0 + j] = x;
            sqx = __fadd_rn(sqx, __fmul_rn(x, x));
        }
        SpectralCluster::sync();
    }
    const float v_sq = spectral_cluster_sum(block_sum(sqx, scratch), &slots[1], &total);
    const float v_denom = fmaxf(__fsqrt_rn(v_sq), eps);

    // Phase 3: v = x / ||x|| on the owned columns (the same threads and order as phase 2), and
    // sigma = x . v_new (mathematically u . (W v_new)).
    float dot = REDUCE_SUM_IDENTITY;
    for (int c0 = 0; c0 < cols; c0 += SPECTRAL_COL_TILE) {
        int o0, o1;
        spectral_owned(min(SPECTRAL_COL_TILE, cols - c0), rank, o0, o1);
        for (int j = o0 + threadIdx.x; j < o1; j += blockDim.x) {
            const float x = v[c0 + j];
            const float vn = __fdiv_rn(x, v_denom);
            v[c0 + j] = vn;
            dot = __fadd_rn(dot, __fmul_rn(x, vn));
        }
    }
    const float sigma = spectral_cluster_sum(block_sum(dot, scratch), &slots[2], &total);

    // Phase 4: the bound, on the block's rows. A NaN sigma compares false: W is left unchanged.
    if (sigma > sigma_max) {
        const float scale = __fdiv_rn(sigma_max, sigma);
        float* mine = w + (long long)r0 * cols;
        const long long size = (long long)(r1 - r0) * cols;
        for (long long base = threadIdx.x; base < size;
             base += (long long)SPECTRAL_SCALE_UNROLL * blockDim.x) {
            float x[SPECTRAL_SCALE_UNROLL];
#pragma unroll
            for (int k = 0; k < SPECTRAL_SCALE_UNROLL; ++k) {
                const long long e = base + (long long)k * blockDim.x;
                x[k] = e < size ? mine[e] : 0.0f;
            }
#pragma unroll
            for (int k = 0; k < SPECTRAL_SCALE_UNROLL; ++k) {
                const long long e = base + (long long)k * blockDim.x;
                if (e < size) {
                    mine[e] = __fmul_rn(x[k], scale);
                }
            }
        }
    }
    if (rank == 0 && threadIdx.x == 0) {
        *sigma_out = sigma;
    }
    // No block leaves while another may still read its shared slots.
    SpectralCluster::sync();
}

// spectral_norm: one matrix, grid SPECTRAL_CLUSTER (one cluster), block SPECTRAL_THREADS
// (plan_spectral_norm).
extern "C" __global__ void __cluster_dims__(SPECTRAL_CLUSTER, 1, 1) __launch_bounds__(REDUCE_MAX_THREADS)
spectral_norm(float* w, float* u, float* v, int rows, int cols, float sigma_max, float eps,
              float* sigma_out) {
    hb_spectral_norm_cluster(w, u, v, rows, cols, sigma_max, eps, sigma_out);
}

// batched_spectral_norm: matrix k of the descriptor array by cluster k (blocks
// k C .. k C + C - 1); sigmas[k] its estimate. Grid count * SPECTRAL_CLUSTER, block
// SPECTRAL_THREADS (plan_batched_spectral_norm).
extern "C" __global__ void __cluster_dims__(SPECTRAL_CLUSTER, 1, 1) __launch_bounds__(REDUCE_MAX_THREADS)
batched_spectral_norm(const SpectralMatrix* __restrict__ mats, int count, float sigma_max,
                      float eps, float* __restrict__ sigmas) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    fh_early_release();
    const int k = blockIdx.x / SPECTRAL_CLUSTER;
    if (k >= count) {
        return;  // uniform across the cluster
    }
    const SpectralMatrix mat = mats[k];
    hb_spectral_norm_cluster(mat.w, mat.u, mat.v, mat.rows, mat.cols, sigma_max, eps,
                             &sigmas[k]);
}
