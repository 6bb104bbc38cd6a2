// A thread-block cluster of FH_CLUSTER blocks for kernels that spread one block's work over a
// cluster (sm_90 and newer: 8 blocks, the portable size; before sm_90 there are no clusters and
// the "cluster" is the one block). Include it, spell the kernel's attribute
// __cluster_dims__(FH_CLUSTER, 1, 1) (it expands to nothing before sm_90) and launch
// FH_CLUSTER blocks (fast/kernels/_runtime.cluster_blocks gives the same number per arch).
#pragma once

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define FH_CLUSTER 8
#else
#define FH_CLUSTER 1
#undef __cluster_dims__
#define __cluster_dims__(...)
#endif

// Rank of this block in its cluster (0 without clusters).
__device__ __forceinline__ int fh_cluster_rank() {
#if FH_CLUSTER > 1
    unsigned int r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return (int)r;
#else
    return 0;
#endif
}

// Barrier of every thread of the cluster, release/acquire: the shared and global writes before
// it are visible to every block of the cluster after it (__syncthreads without clusters).
__device__ __forceinline__ void fh_cluster_sync() {
#if FH_CLUSTER > 1
    asm volatile("barrier.cluster.arrive.release.aligned;\n\t"
                 "barrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
    __syncthreads();
#endif
}

// The float at `local` (a __shared__ address of this kernel) in the shared memory of cluster
// block `rank` (distributed shared memory; this block's own value without clusters). The
// owner must not exit before the reader is done: end the kernel with another fh_cluster_sync.
__device__ __forceinline__ float fh_cluster_read(const float* local, int rank) {
#if FH_CLUSTER > 1
    const unsigned int addr = (unsigned int)__cvta_generic_to_shared(local);
    unsigned int remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
    float x;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(x) : "r"(remote) : "memory");
    return x;
#else
    (void)rank;
    return *local;
#endif
}

// The address of `local` (a __shared__ address of this kernel) in the shared memory of cluster
// block `rank`, for fh_cluster_st_u32 (this block's own shared address without clusters); byte
// offsets may be added to it within the same shared array.
__device__ __forceinline__ unsigned int fh_cluster_map(const void* local, int rank) {
    const unsigned int addr = (unsigned int)__cvta_generic_to_shared(local);
#if FH_CLUSTER > 1
    unsigned int remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
    return remote;
#else
    (void)rank;
    return addr;
#endif
}

// Store the 32-bit `v` at `addr` (from fh_cluster_map); visible to the block owning it after the
// next fh_cluster_sync.
__device__ __forceinline__ void fh_cluster_st_u32(unsigned int addr, unsigned int v) {
#if FH_CLUSTER > 1
    asm volatile("st.shared::cluster.u32 [%0], %1;" :: "r"(addr), "r"(v) : "memory");
#else
    asm volatile("st.shared.u32 [%0], %1;" :: "r"(addr), "r"(v) : "memory");
#endif
}
