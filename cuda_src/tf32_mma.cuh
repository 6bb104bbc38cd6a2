// TF32 tensor-core helpers of the backward GEMMs (cuda_src/dense.cu: gemm_tf32, gemm_f32; the
// rounding and the MMA also of cuda_src/trunk.cu's heads_dh2_tf32): the TF32 rounding, one
// m16n8k8 MMA, and one warp's cp.async staging of a tile of a row-major matrix.
//
// Every helper is `static __device__ __forceinline__`, so each translation unit gets its own
// copy and nothing clashes when several files include this header.
#pragma once

// gemm_tf32's warps per block (they split k) and the rows of an MMA fragment.
#define GEMM_TF32_WARPS 8
#define GEMM_TF32_ROWS 16

static __device__ __forceinline__ unsigned int gemm_tf32_bits(float x) {
    unsigned int r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

static __device__ __forceinline__ void gemm_tf32_mma(float* c, unsigned a0, unsigned a1,
                                                     unsigned a2, unsigned a3, unsigned b0,
                                                     unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One warp stages rows [r0, r0 + nr) x columns [c0, c0 + nc) (nc a multiple of 4) of the
// row-major [rows, cols] matrix g into s (row stride ss): zeros outside the matrix.
static __device__ __forceinline__ void gemm_tf32_stage(float* s, int ss, const float* g, int rows,
                                                       int cols, int r0, int nr, int c0, int nc,
                                                       int lane) {
    const bool vec = ((cols & 3) == 0) && ((reinterpret_cast<size_t>(g) & 15) == 0);
    const int quads = nc >> 2;
    for (int i = lane; i < nr * quads; i += 32) {
        const int r = i / quads, cc = (i - r * quads) * 4;
        const int gr = r0 + r, gc = c0 + cc;
        float* d = s + r * ss + cc;
        const float* src = g + (long long)gr * cols + gc;
        if (vec && gr < rows && gc + 3 < cols) {
            const unsigned sa = (unsigned)__cvta_generic_to_shared(d);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sa), "l"(src) : "memory");
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (gr < rows && gc + j < cols) {
                    const unsigned sa = (unsigned)__cvta_generic_to_shared(d + j);
                    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(sa), "l"(src + j)
                                 : "memory");
                } else {
                    d[j] = 0.0f;
                }
            }
        }
    }
}
