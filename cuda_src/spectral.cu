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
// Every sum has a fixed order that depends only on (rows, cols, C), never on the block size,
// timing or pointer alignment (no atomics), so the bits are the same on every run. The norms'
// trees are those of a block of SPECTRAL_TREE_THREADS = 512 threads (the kernels' block size
// before they were made block-size independent, hence their bits), which a launched block of
// any power-of-two size from 32 to 512 reproduces: its warp w plays the virtual warps w,
// w + W, ... (W its warps), its thread t the virtual threads t, t + blockDim.x, ..., each
// virtual thread's partial kept in shared memory (vacc).
// - (W v)_i: lane l of the row's warp sums the columns l, l + 32, ... in order, then the warp
//   butterfly.
// - (W^T u)_j: each block sums its rows in order; the C block partials are added in rank order
//   by the block that owns column j (columns are dealt out per tile of SPECTRAL_COL_TILE).
// - ||W v||^2: virtual warp vw (< 16) sums s_i^2 over its rows i = r0 + vw, r0 + vw + 16, ...
//   in order (as its lane 0, the other lanes -0); ||W^T u||^2 and sigma: virtual thread t sums
//   over its owned columns o0 + t, o0 + t + 512, ... of each tile in order. Then block_sum's
//   tree of a 512-thread block over the virtual threads, then the C block sums in rank order
//   (every block adds them itself: all get the same value).
// Shared memory: besides a few small static arrays, the launch's dynamic shared memory (sized by
// the plans: spectral_shared_bytes in fast/kernels/spectral.py, which mirrors the layout below)
// holds, in floats, with q = ceil(min(cols, SPECTRAL_COL_TILE) / C) and per = ceil(rows / C):
//   [0, C q)                          recv: the W^T u partials (required: a launch with less
//                                     dynamic shared memory returns at once, writing nothing)
//   [U, U + per), U = up4(C q)        u of the block's rows between the phases, if it fits
//                                     (else u stays in global memory)
//   [V, V + cols), V = up4(U + per)   the old v, and
//   [X + m, X + m + per cols),        the block's rows of W (m = the slice's float offset from
//     X = up4(V + cols)               a 16-byte boundary, so that the copy and the rescale can
//                                     move float4s), if all of it fits: then W and v are read
//                                     from global memory once, by asynchronous copies (cp.async,
//                                     sm_80+) at the start, and phases 1, 2 and 4 read them from
//                                     shared memory; else they read global memory, as before.
// (up4: rounded up to a multiple of 4.) Cached or not, every value is the same and every sum
// has the same order: the bits depend neither on the dynamic shared memory's size nor on the
// block size.
// sigma = (W^T u) . v_new, the dot of the unnormalised column sums with the new v:
// mathematically u . (W v_new), without a third pass over W. NaN/Inf in W, u or v propagate
// through the sums as IEEE arithmetic does; a NaN sigma leaves W unchanged (sigma > sigma_max is
// false).
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

// Columns per tile of the W^T u partials. The column ownership (hence the bits of ||W^T u||
// and sigma) depends on it: keep it.
#define SPECTRAL_COL_TILE 4096
// Threads of the block whose reduction trees the kernels reproduce (module comment): the bits
// depend on it. A launched block has a power-of-two size from 32 to this (plan:
// SPECTRAL_THREADS in fast/kernels/spectral.py); any such size gives the same bits.
#define SPECTRAL_TREE_THREADS 512
#define SPECTRAL_TREE_WARPS (SPECTRAL_TREE_THREADS / REDUCE_WARP)
// Blocks of SPECTRAL_TREE_THREADS threads per SM the register budget is set for (launch bounds:
// at most 32 registers a thread), so that an SM holds 4 blocks of 512 threads (the plans'
// blocks) or up to 8 of 256 (registers; shared memory allows about 6 with the sm_90 plan's
// dynamic shared memory): with many matrices (a population) the launch is bound by how many
// clusters run at once.
#define SPECTRAL_MIN_BLOCKS 4
// Loads in flight together per thread: phase 1 (elements of one row, of two rows), phase 2
// (rows of a column). Only the loads are batched; every sum keeps its order.
#define SPECTRAL_ROW_BATCH 8
#define SPECTRAL_ROW_BATCH2 4
#define SPECTRAL_COL_BATCH 8
// float4s of W one thread rescales per round (loads in flight together; from shared memory when
// W is cached), and the scalar elements of the unaligned path.
#define SPECTRAL_SCALE_UNROLL4 4
#define SPECTRAL_SCALE_UNROLL 8

// The cluster (PTX ISA 7.8, sm_90): rank of this block, barrier (release/acquire: the shared
// and global writes before it are visible to every block of the cluster after it), and a store
// of a float into another block's shared memory (distributed shared memory). The blocks only
// ever store into each other's shared memory, each after the first barrier (started(): every
// block of the cluster is running), and read their own; no block touches another's after the
// last barrier, so none has to wait for the others before it exits.
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
    // The first barrier, split: arrive() at the kernel's start (no memory ordering), started()
    // before the first store into another block (it returns once every block has arrived).
    static __device__ __forceinline__ void arrive() {
#if SPECTRAL_CLUSTER > 1
        asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
    }
    static __device__ __forceinline__ void started() {
#if SPECTRAL_CLUSTER > 1
        asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
#endif
    }
    // *local of block `block_rank` (local: the same variable of this block) = x.
    static __device__ __forceinline__ void write(float* local, int block_rank, float x) {
#if SPECTRAL_CLUSTER > 1
        const unsigned int addr = (unsigned int)__cvta_generic_to_shared(local);
        unsigned int remote;
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                     : "=r"(remote) : "r"(addr), "r"(block_rank));
        asm volatile("st.shared::cluster.f32 [%0], %1;" :: "r"(remote), "f"(x) : "memory");
#else
        *local = x;
#endif
    }
};

// The dynamic shared memory of the launch, in bytes.
__device__ __forceinline__ unsigned int spectral_dynamic_bytes() {
    unsigned int n;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
    return n;
}

// n rounded up to a multiple of 4 (floats: 16 bytes).
__device__ __forceinline__ int spectral_up4(int n) {
    return (n + 3) & ~3;
}

// Asynchronous copies from global to shared memory (cp.async, PTX ISA 7.0, sm_80+): 16 bytes
// (both addresses 16-byte aligned; bypasses L1) or one float. spectral_copy_wait() returns once
// the calling thread's copies have landed (a __syncthreads after it publishes them to the block).
__device__ __forceinline__ void spectral_copy16(float* dst, const float* src) {
    const unsigned int addr = (unsigned int)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(addr), "l"(src) : "memory");
}
__device__ __forceinline__ void spectral_copy4(float* dst, const float* src) {
    const unsigned int addr = (unsigned int)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(addr), "l"(src) : "memory");
}
__device__ __forceinline__ void spectral_copy_wait() {
    asm volatile("cp.async.wait_all;" ::: "memory");
}

// The cluster's sum of the block's virtual-thread values vacc[0 .. SPECTRAL_TREE_THREADS): the
// block's sum with block_sum's tree for a block of SPECTRAL_TREE_THREADS threads (each virtual
// warp's butterfly, then warp 0's butterfly over the virtual warp sums in order, padded with the
// identity), stored into slot[rank] of every block of the cluster; after the cluster barrier
// every thread adds its block's slot[0 .. C) in rank order (the same value in all of them).
// The calling block has a power-of-two number of warps up to SPECTRAL_TREE_WARPS. Each call
// site has its own `slot` array (written once). vacc may be rewritten once it returns.
__device__ __forceinline__ float spectral_tree_cluster_sum(const float* vacc, float* scratch,
                                                           float* slot, int rank) {
    const int lane = threadIdx.x % REDUCE_WARP;
    const int warp = threadIdx.x / REDUCE_WARP;
    const int warps = blockDim.x / REDUCE_WARP;
    __syncthreads();  // vacc is complete; the previous user of scratch has read it
    for (int vw = warp; vw < SPECTRAL_TREE_WARPS; vw += warps) {
        const float s = warp_sum(vacc[vw * REDUCE_WARP + lane]);
        if (lane == 0) {
            scratch[vw] = s;
        }
    }
    __syncthreads();
    if (warp == 0) {
        float s = lane < SPECTRAL_TREE_WARPS ? scratch[lane] : REDUCE_SUM_IDENTITY;
        s = warp_sum(s);
        if (lane < SPECTRAL_CLUSTER) {
            SpectralCluster::write(&slot[rank], lane, s);
        }
    }
    SpectralCluster::sync();
    float s = slot[0];
    for (int r = 1; r < SPECTRAL_CLUSTER; ++r) {
        s = __fadd_rn(s, slot[r]);
    }
    return s;
}

// The columns [o0, o1) of a tile of `width` columns that block `rank` owns (q of them at most).
__device__ __forceinline__ void spectral_owned(int width, int rank, int& o0, int& o1, int& q) {
    q = (width + SPECTRAL_CLUSTER - 1) / SPECTRAL_CLUSTER;
    o0 = min(width, rank * q);
    o1 = min(width, o0 + q);
}

// sum_{k < n} col[k * cols] * uk[k], in order from -0 (a column of the block's rows times u).
// SPECTRAL_COL_BATCH loads of W in flight together (the sum's order is unchanged).
__device__ __forceinline__ float spectral_column_sum(const float* col, int cols, int n,
                                                     const float* uk) {
    const long long stride = cols;
    float acc = REDUCE_SUM_IDENTITY;
    int k = 0;
#pragma unroll 1
    for (; k + SPECTRAL_COL_BATCH <= n; k += SPECTRAL_COL_BATCH) {
        float a[SPECTRAL_COL_BATCH];
#pragma unroll
        for (int m = 0; m < SPECTRAL_COL_BATCH; ++m) {
            a[m] = col[m * stride];
        }
        col += SPECTRAL_COL_BATCH * stride;
#pragma unroll
        for (int m = 0; m < SPECTRAL_COL_BATCH; ++m) {
            acc = __fadd_rn(acc, __fmul_rn(a[m], uk[k + m]));
        }
    }
#pragma unroll 1
    for (; k < n; ++k) {
        acc = __fadd_rn(acc, __fmul_rn(*col, uk[k]));
        col += stride;
    }
    return acc;
}

// One power iteration and the bound on one matrix, by the calling cluster (every thread of its
// SPECTRAL_CLUSTER blocks calls it; blockDim.x a power of two from 32 to SPECTRAL_TREE_THREADS
// and the dynamic shared memory at least the recv buffer (module comment), else it returns at
// once, uniformly, writing nothing). u, v and w are updated in place: the old u is never read
// (PyTorch's order), the old v only in phase 1. Block rank 0 writes *sigma_out. Not inlined:
// both kernels call the one compiled body.
__device__ __noinline__ void hb_spectral_norm_cluster(float* __restrict__ w, float* __restrict__ u,
                                                      float* __restrict__ v, int rows, int cols,
                                                      float sigma_max, float eps,
                                                      float* __restrict__ sigma_out) {
    __shared__ float scratch[REDUCE_WARP + 1];
    __shared__ float slots[3][SPECTRAL_CLUSTER];  // the blocks' ||W v||^2, ||W^T u||^2, sigma
    __shared__ float vacc[SPECTRAL_TREE_THREADS];  // the virtual threads' partials of a norm
    // The module comment's layout. recv[r * qs + j - o0]: block r's column sum of owned column
    // j of the current tile (stored there by block r); once a one-tile matrix's x_j is summed,
    // recv[j - o0] holds x_j, then v_j.
    extern __shared__ __align__(16) float spectral_dyn[];
    float* const recv = spectral_dyn;
    const int threads = blockDim.x;
    const int per = (rows + SPECTRAL_CLUSTER - 1) / SPECTRAL_CLUSTER;
    const int qs = (min(cols, SPECTRAL_COL_TILE) + SPECTRAL_CLUSTER - 1) / SPECTRAL_CLUSTER;
    const int dyn = (int)(spectral_dynamic_bytes() / sizeof(float));
    if (threads < REDUCE_WARP || threads > SPECTRAL_TREE_THREADS || (threads & (threads - 1)) ||
        dyn < SPECTRAL_CLUSTER * qs) {
        return;  // uniform: not a block size whose virtual warps map onto its warps, or no recv
    }
    SpectralCluster::arrive();
    const int rank = SpectralCluster::rank();
    const int lane = threadIdx.x % REDUCE_WARP;
    const int warp = threadIdx.x / REDUCE_WARP;
    const int warps = threads / REDUCE_WARP;  // divides SPECTRAL_TREE_WARPS
    const int r0 = min(rows, rank * per);
    const int r1 = min(rows, r0 + per);
    const int nr = r1 - r0;
    const int u_at = spectral_up4(SPECTRAL_CLUSTER * qs);
    const int v_at = spectral_up4(u_at + per);
    const int w_at = spectral_up4(v_at + cols);
    // Uniform across the cluster (the same rows, cols and launch).
    const bool u_cached = u_at + per <= dyn;
    const bool w_cached = (long long)w_at + 3 + (long long)per * cols <= dyn;
    float* const ucache = spectral_dyn + u_at;  // u[r0 + k] (when u_cached)
    // The block's rows of W (row r0 first, rows cols apart) and the old v, from where the phases
    // read them: shared memory when cached (below), else global memory. int offsets: a matrix
    // has fewer than 2^30 elements, as every array of the fast kernels.
    float* const mine = w + (long long)r0 * cols;
    const float* wsrc = mine;
    const float* vsrc = v;
    if (w_cached) {
        float* const vc = spectral_dyn + v_at;
        for (int j = threadIdx.x; j < cols; j += threads) {
            spectral_copy4(vc + j, v + j);
        }
        // wc[e] = mine[e]: the h head elements one by one, up to mine's next 16-byte boundary
        // (wc + h is 16-byte aligned too), then float4s, then the 0 to 3 elements left.
        const int m = (int)((reinterpret_cast<unsigned long long>(mine) >> 2) & 3);
        float* const wc = spectral_dyn + w_at + m;
        const int size = nr * cols;
        const int h = min(size, (4 - m) & 3);
        const int n4 = (size - h) >> 2;
        if ((int)threadIdx.x < h) {
            spectral_copy4(wc + threadIdx.x, mine + threadIdx.x);
        }
        for (int k = threadIdx.x; k < n4; k += threads) {
            spectral_copy16(wc + h + 4 * k, mine + h + 4 * k);
        }
        const int e = h + 4 * n4 + threadIdx.x;
        if (e < size) {
            spectral_copy4(wc + e, mine + e);
        }
        wsrc = wc;
        vsrc = vc;
    }
    // Virtual thread t (of SPECTRAL_TREE_THREADS) is real thread t % threads: thread t
    // initialises (and below only ever updates) the entries t, t + threads, ...
    for (int t = threadIdx.x; t < SPECTRAL_TREE_THREADS; t += threads) {
        vacc[t] = REDUCE_SUM_IDENTITY;
    }
    if (w_cached) {
        spectral_copy_wait();
        __syncthreads();  // every thread's copies are visible to the block
    }

    // Phase 1: s_i = (W v)_i for the block's rows; row i belongs to virtual warp
    // (i - r0) % SPECTRAL_TREE_WARPS, played by warp (i - r0) % warps, which takes its rows in
    // increasing order (two at a time, i and i + warps: their loads in flight together). The
    // virtual warp's lane 0 sums its rows' s_i^2 in order, in vacc (its other lanes stay -0, as
    // block_sum's input lane == 0 ? sq : -0). s_i goes to ucache (or u[i]).
    for (int i = r0 + warp; i < r1; i += 2 * warps) {
        const int i2 = i + warps;
        const bool two = i2 < r1;  // warp-uniform
        const float* row = wsrc + (i - r0) * cols;
        float acc = REDUCE_SUM_IDENTITY;
        float acc2 = REDUCE_SUM_IDENTITY;
        int j = lane;
        if (two) {
            const float* row2 = row + warps * cols;
#pragma unroll 1
            for (; j + (SPECTRAL_ROW_BATCH2 - 1) * REDUCE_WARP < cols;
                 j += SPECTRAL_ROW_BATCH2 * REDUCE_WARP) {
                float a[SPECTRAL_ROW_BATCH2], b[SPECTRAL_ROW_BATCH2], x[SPECTRAL_ROW_BATCH2];
#pragma unroll
                for (int m = 0; m < SPECTRAL_ROW_BATCH2; ++m) {
                    a[m] = row[j + m * REDUCE_WARP];
                    b[m] = row2[j + m * REDUCE_WARP];
                    x[m] = vsrc[j + m * REDUCE_WARP];
                }
#pragma unroll
                for (int m = 0; m < SPECTRAL_ROW_BATCH2; ++m) {
                    acc = __fadd_rn(acc, __fmul_rn(a[m], x[m]));
                    acc2 = __fadd_rn(acc2, __fmul_rn(b[m], x[m]));
                }
            }
            for (; j < cols; j += REDUCE_WARP) {
                const float x = vsrc[j];
                acc = __fadd_rn(acc, __fmul_rn(row[j], x));
                acc2 = __fadd_rn(acc2, __fmul_rn(row2[j], x));
            }
        } else {
#pragma unroll 1
            for (; j + (SPECTRAL_ROW_BATCH - 1) * REDUCE_WARP < cols;
                 j += SPECTRAL_ROW_BATCH * REDUCE_WARP) {
                float a[SPECTRAL_ROW_BATCH], x[SPECTRAL_ROW_BATCH];
#pragma unroll
                for (int m = 0; m < SPECTRAL_ROW_BATCH; ++m) {
                    a[m] = row[j + m * REDUCE_WARP];
                    x[m] = vsrc[j + m * REDUCE_WARP];
                }
#pragma unroll
                for (int m = 0; m < SPECTRAL_ROW_BATCH; ++m) {
                    acc = __fadd_rn(acc, __fmul_rn(a[m], x[m]));
                }
            }
            for (; j < cols; j += REDUCE_WARP) {
                acc = __fadd_rn(acc, __fmul_rn(row[j], vsrc[j]));
            }
        }
        const float s = warp_sum(acc);
        if (lane == 0) {
            if (u_cached) {
                ucache[i - r0] = s;
            } else {
                u[i] = s;
            }
            float* sq = &vacc[((i - r0) % SPECTRAL_TREE_WARPS) * REDUCE_WARP];
            *sq = __fadd_rn(*sq, __fmul_rn(s, s));
        }
        if (two) {
            const float s2 = warp_sum(acc2);
            if (lane == 0) {
                if (u_cached) {
                    ucache[i2 - r0] = s2;
                } else {
                    u[i2] = s2;
                }
                float* sq = &vacc[((i2 - r0) % SPECTRAL_TREE_WARPS) * REDUCE_WARP];
                *sq = __fadd_rn(*sq, __fmul_rn(s2, s2));
            }
        }
    }
    // Every block of the cluster runs before this block stores into their shared memory. The
    // cluster barrier inside the sum orders every block's phase-1 reads of the old v before any
    // block writes the new v below.
    SpectralCluster::started();
    const float u_sq = spectral_tree_cluster_sum(vacc, scratch, slots[0], rank);
    const float u_denom = fmaxf(__fsqrt_rn(u_sq), eps);
    for (int k = threadIdx.x; k < nr; k += threads) {
        if (u_cached) {
            ucache[k] = __fdiv_rn(ucache[k], u_denom);  // to u after the last barrier
        } else {
            u[r0 + k] = __fdiv_rn(u[r0 + k], u_denom);
        }
    }
    for (int t = threadIdx.x; t < SPECTRAL_TREE_THREADS; t += threads) {
        vacc[t] = REDUCE_SUM_IDENTITY;  // read by the sum above, which has returned
    }
    __syncthreads();

    // Phase 2: x = W^T u, one tile of columns at a time: a thread sums a column j of the tile
    // over the block's rows in order and stores the sum into recv[rank qs + j - o0] of the block
    // that owns j; after the barrier the owner adds the C sums in rank order (x_j: kept in
    // recv[j - o0] for phase 3 when the matrix is one tile, else stored in v[j]); a second
    // barrier (none after the last tile) lets the next tile reuse recv. Virtual thread t sums its
    // owned x_j^2 in order (vacc).
    const bool one_tile = cols <= SPECTRAL_COL_TILE;
    for (int c0 = 0; c0 < cols; c0 += SPECTRAL_COL_TILE) {
        const int width = min(SPECTRAL_COL_TILE, cols - c0);
        int o0, o1, q;
        spectral_owned(width, rank, o0, o1, q);
        for (int j = threadIdx.x; j < width; j += threads) {
            const float* col = wsrc + c0 + j;
            // u[r0 + k] from shared memory, else from global memory (the same values).
            const float acc = u_cached ? spectral_column_sum(col, cols, nr, ucache)
                                       : spectral_column_sum(col, cols, nr, u + r0);
            const int owner = j / q;
            SpectralCluster::write(&recv[rank * qs + j - owner * q], owner, acc);
        }
        SpectralCluster::sync();
        const int nv = min(SPECTRAL_TREE_THREADS, o1 - o0);
        for (int t = threadIdx.x; t < nv; t += threads) {
            float sqx = vacc[t];
            for (int jj = t; jj < o1 - o0; jj += SPECTRAL_TREE_THREADS) {
                float x = recv[jj];
                for (int r = 1; r < SPECTRAL_CLUSTER; ++r) {
                    x = __fadd_rn(x, recv[r * qs + jj]);
                }
                if (one_tile) {
                    recv[jj] = x;
                } else {
                    v[c0 + o0 + jj] = x;
                }
                sqx = __fadd_rn(sqx, __fmul_rn(x, x));
            }
            vacc[t] = sqx;
        }
        if (c0 + SPECTRAL_COL_TILE < cols) {
            SpectralCluster::sync();
        }
    }
    const float v_sq = spectral_tree_cluster_sum(vacc, scratch, slots[1], rank);
    const float v_denom = fmaxf(__fsqrt_rn(v_sq), eps);

    // Phase 3: v = x / ||x|| on the owned columns (the same virtual threads and order as phase
    // 2), and sigma = x . v_new (mathematically u . (W v_new)). A one-tile matrix keeps v_new in
    // recv[0, q) until after the last barrier.
    for (int t = threadIdx.x; t < SPECTRAL_TREE_THREADS; t += threads) {
        vacc[t] = REDUCE_SUM_IDENTITY;
    }
    for (int c0 = 0; c0 < cols; c0 += SPECTRAL_COL_TILE) {
        int o0, o1, q;
        spectral_owned(min(SPECTRAL_COL_TILE, cols - c0), rank, o0, o1, q);
        const int nv = min(SPECTRAL_TREE_THREADS, o1 - o0);
        for (int t = threadIdx.x; t < nv; t += threads) {
            float dot = vacc[t];
            for (int jj = t; jj < o1 - o0; jj += SPECTRAL_TREE_THREADS) {
                const float x = one_tile ? recv[jj] : v[c0 + o0 + jj];
                const float vn = __fdiv_rn(x, v_denom);
                if (one_tile) {
                    recv[jj] = vn;
                } else {
                    v[c0 + o0 + jj] = vn;
                }
                dot = __fadd_rn(dot, __fmul_rn(x, vn));
            }
            vacc[t] = dot;
        }
    }
    const float sigma = spectral_tree_cluster_sum(vacc, scratch, slots[2], rank);
    // Nothing touches another block's shared memory from here on (no barrier needed before the
    // blocks exit). The new u and (one-tile) v leave shared memory now.
    if (u_cached) {
        for (int k = threadIdx.x; k < nr; k += threads) {
            u[r0 + k] = ucache[k];
        }
    }
    if (one_tile) {
        int o0, o1, q;
        spectral_owned(cols, rank, o0, o1, q);
        for (int jj = threadIdx.x; jj < o1 - o0; jj += threads) {
            v[o0 + jj] = recv[jj];
        }
    }

    // Phase 4: the bound, on the block's rows (elementwise, read from wsrc: the cached copy or
    // W itself; float4s where the rows start 16-byte aligned, then wsrc is too: the same
    // products). A NaN sigma compares false: W is left unchanged.
    if (sigma > sigma_max) {
        const float scale = __fdiv_rn(sigma_max, sigma);
        const int size = nr * cols;
        if ((reinterpret_cast<unsigned long long>(mine) & 15) == 0) {
            float4* mine4 = reinterpret_cast<float4*>(mine);
            const float4* src4 = reinterpret_cast<const float4*>(wsrc);
            const int n4 = size / 4;
            for (int base = threadIdx.x; base < n4; base += SPECTRAL_SCALE_UNROLL4 * threads) {
                float4 x[SPECTRAL_SCALE_UNROLL4];
#pragma unroll
                for (int k = 0; k < SPECTRAL_SCALE_UNROLL4; ++k) {
                    const int e = base + k * threads;
                    x[k] = e < n4 ? src4[e] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                }
#pragma unroll
                for (int k = 0; k < SPECTRAL_SCALE_UNROLL4; ++k) {
                    const int e = base + k * threads;
                    if (e < n4) {
                        mine4[e] = make_float4(__fmul_rn(x[k].x, scale), __fmul_rn(x[k].y, scale),
                                               __fmul_rn(x[k].z, scale), __fmul_rn(x[k].w, scale));
                    }
                }
            }
            const int e = 4 * n4 + threadIdx.x;  // the 0 to 3 elements left
            if (e < size) {
                mine[e] = __fmul_rn(wsrc[e], scale);
            }
        } else {
            for (int base = threadIdx.x; base < size; base += SPECTRAL_SCALE_UNROLL * threads) {
                float x[SPECTRAL_SCALE_UNROLL];
#pragma unroll
                for (int k = 0; k < SPECTRAL_SCALE_UNROLL; ++k) {
                    const int e = base + k * threads;
                    x[k] = e < size ? wsrc[e] : 0.0f;
                }
#pragma unroll
                for (int k = 0; k < SPECTRAL_SCALE_UNROLL; ++k) {
                    const int e = base + k * threads;
                    if (e < size) {
                        mine[e] = __fmul_rn(x[k], scale);
                    }
                }
            }
        }
    }
    if (rank == 0 && threadIdx.x == 0) {
        *sigma_out = sigma;
    }
}

// spectral_norm: one matrix, grid SPECTRAL_CLUSTER (one cluster), block SPECTRAL_THREADS
// (plan_spectral_norm).
extern "C" __global__ void __cluster_dims__(SPECTRAL_CLUSTER, 1, 1)
__launch_bounds__(SPECTRAL_TREE_THREADS, SPECTRAL_MIN_BLOCKS)
spectral_norm(float* w, float* u, float* v, int rows, int cols, float sigma_max, float eps,
              float* sigma_out) {
    hb_spectral_norm_cluster(w, u, v, rows, cols, sigma_max, eps, sigma_out);
}

// batched_spectral_norm: matrix k of the descriptor array by cluster k (blocks
// k C .. k C + C - 1); sigmas[k] its estimate. Grid count * SPECTRAL_CLUSTER, block
// SPECTRAL_THREADS (plan_batched_spectral_norm).
extern "C" __global__ void __cluster_dims__(SPECTRAL_CLUSTER, 1, 1)
__launch_bounds__(SPECTRAL_TREE_THREADS, SPECTRAL_MIN_BLOCKS)
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
