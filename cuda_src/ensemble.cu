// The ensemble-diversity kernel (SPEC 4, second wave), twin of
// foxhunt.reference.kernels.ensemble.ens_kl_grad: the KL diversity of head 0's logits (the value
// stream v) from the K - 1 frozen prior heads, and its gradient on v. The prior heads' forward
// passes and the backward of d_v are the existing GEMMs and dense kernels.
//
// Arithmetic: -fmad=false plus __fadd_rn/__fmul_rn/__fdiv_rn in the reference's order; expf/logf
// against NumPy's float32 functions (a few ulp). ONE block, one thread per sample; the loss is a
// block_sum of reduce.cuh (a fixed tree, no atomics).

#include "reduce.cuh"  // block_sum, REDUCE_SUM_IDENTITY

#define ENS_NEG_INF __uint_as_float(0xff800000u)  // the identity of the fmaxf row max

// Max-shifted softmax statistics of one row (the reference's softmax_shifted and the divisor
// floor of _softmax_log): m = fmaxf over the row (from -Inf), s = ((0 + e_0) + e_1) + ...,
// e_j = expf(x_j - m); returns the divisor sg = s < eps ? eps : s (a NaN sum stays NaN).
static __device__ __forceinline__ float ens_softmax_divisor(const float* __restrict__ row, int n,
                                                           float eps, float* m_out) {
    float m = ENS_NEG_INF;
    for (int j = 0; j < n; ++j) {
        m = fmaxf(m, row[j]);
    }
    float s = 0.0f;
    for (int j = 0; j < n; ++j) {
        s = __fadd_rn(s, expf(__fsub_rn(row[j], m)));
    }
    *m_out = m;
    return s < eps ? eps : s;
}

// ---------------------------------------------------------------------------------------------
// ens_kl_grad: v [batch, num_atoms] (head 0's logits), priors [n_priors, batch, num_atoms]
// (the prior heads' logits, head k at k - 1), per sample b, with scale = 1 / (batch * n_priors):
//   p = expf(x - m) / sg, log p = (x - m) - logf(sg)              (every row of v and priors)
//   KL_k = ((0 + p_k[0] * (log p_k[0] - log p_0[0])) + ...)        (atom order)
//   kl[b] = (0 + KL_1) + KL_2 + ...                                (head order)
//   d_v[b, j] = scale * ((0 + (p_1[j] - p_0[j])) + (p_2[j] - p_0[j]) + ...)
//   *loss = -(scale * sum_b kl[b])
// d_v's row is its own accumulator (written once per head, then scaled); p_0 is recomputed for
// every head (the same bits each time).
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(REDUCE_MAX_THREADS)
ens_kl_grad(const float* __restrict__ v, const float* __restrict__ priors,
            float* __restrict__ d_v, float* __restrict__ kl, float* __restrict__ loss, int batch,
            int num_atoms, int n_priors, float eps) {
    __shared__ float scratch[REDUCE_WARP + 1];
    const float scale = __fdiv_rn(1.0f, (float)(batch * n_priors));
    float acc = REDUCE_SUM_IDENTITY;
    for (int b = threadIdx.x; b < batch; b += blockDim.x) {
        const float* row0 = v + (long long)b * num_atoms;
        float* drow = d_v + (long long)b * num_atoms;
        float m0;
        const float sg0 = ens_softmax_divisor(row0, num_atoms, eps, &m0);
        const float ls0 = logf(sg0);
        for (int j = 0; j < num_atoms; ++j) {
            drow[j] = 0.0f;
        }
        float kl_b = 0.0f;
        for (int k = 0; k < n_priors; ++k) {
            const float* rowk = priors + ((long long)k * batch + b) * num_atoms;
            float mk;
            const float sgk = ens_softmax_divisor(rowk, num_atoms, eps, &mk);
            const float lsk = logf(sgk);
            float kl_k = 0.0f;
            for (int j = 0; j < num_atoms; ++j) {
                const float sh0 = __fsub_rn(row0[j], m0);
                const float p0 = __fdiv_rn(expf(sh0), sg0);
                const float lp0 = __fsub_rn(sh0, ls0);
                const float shk = __fsub_rn(rowk[j], mk);
                const float pk = __fdiv_rn(expf(shk), sgk);
                const float lpk = __fsub_rn(shk, lsk);
                kl_k = __fadd_rn(kl_k, __fmul_rn(pk, __fsub_rn(lpk, lp0)));
                drow[j] = __fadd_rn(drow[j], __fsub_rn(pk, p0));
            }
            kl_b = __fadd_rn(kl_b, kl_k);
        }
        for (int j = 0; j < num_atoms; ++j) {
            drow[j] = __fmul_rn(scale, drow[j]);
        }
        kl[b] = kl_b;
        acc = __fadd_rn(acc, kl_b);
    }
    const float total = block_sum(acc, scratch);
    if (threadIdx.x == 0) {
        *loss = -__fmul_rn(scale, __fadd_rn(total, 0.0f));
    }
}
