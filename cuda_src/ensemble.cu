// The ensemble-diversity kernel (SPEC 4, second wave), twin of
// foxhunt.reference.kernels.ensemble.ens_kl_grad: the KL diversity of head 0's logits (the value
// stream v) from the K - 1 frozen prior heads, and its gradient on v. The prior heads' forward
// passes and the backward of d_v are the existing GEMMs and dense kernels.
//
// Arithmetic: -fmad=false plus __fadd_rn/__fmul_rn/__fdiv_rn in the reference's order; expf/logf
// against NumPy's float32 functions (a few ulp). Every value is computed by the same operations
// in the same order whatever the launch (cluster size, tile), so the bits of d_v and kl never
// depend on it; the loss is a block_sum of reduce.cuh (a fixed tree of the block size).

#include "cluster.cuh"  // FH_CLUSTER, fh_cluster_rank, fh_cluster_sync
#include "reduce.cuh"   // block_sum, REDUCE_SUM_IDENTITY

#define ENS_NEG_INF __uint_as_float(0xff800000u)  // the identity of the fmaxf row max
// Shared floats of one block's tile (static: 45 KiB, under the 48 KiB default limit). A tile of
// S samples holds its R = S * (1 + n_priors) rows twice (p and log p) plus three row statistics:
// S = floor(ENS_SMEM_FLOATS / ((1 + n_priors) * (2 * num_atoms + 3))) (ensemble.py checks S >= 1).
#define ENS_SMEM_FLOATS 11520
// Elements of a tile one thread loads per round (loads in flight together).
#define ENS_LOAD_UNROLL 8

// ---------------------------------------------------------------------------------------------
// ens_kl_grad: v [batch, num_atoms] (head 0's logits), priors [n_priors, batch, num_atoms]
// (the prior heads' logits, head k at k - 1), per sample b, with scale = 1 / (batch * n_priors):
//   m = fmaxf over the row (from -Inf); s = ((0 + e_0) + e_1) + ..., e_j = expf(x_j - m);
//   sg = s < eps ? eps : s (a NaN sum stays NaN)                 (every row of v and priors)
//   p = expf(x - m) / sg, log p = (x - m) - logf(sg)
//   KL_k = ((0 + p_k[0] * (log p_k[0] - log p_0[0])) + ...)        (atom order)
//   kl[b] = (0 + KL_1) + KL_2 + ...                                (head order)
//   d_v[b, j] = scale * ((0 + (p_1[j] - p_0[j])) + (p_2[j] - p_0[j]) + ...)
//   *loss = -(scale * (block_sum(acc) + 0)), thread t's acc = (-0 + kl[t]) + kl[t + T] + ...
//
// ONE cluster of FH_CLUSTER blocks (8 on sm_90, else 1) of T threads. Block rank r owns the
// samples [r Q, (r + 1) Q), Q = ceil(batch / FH_CLUSTER), in tiles of S samples staged in shared
// memory: the rows are read coalesced (several loads in flight per thread); one thread per row
// makes its max, one per element e_j, one per row the sum s (and sg, logf(sg)), one per element
// p and log p, one per (sample, atom) d_v and the KL terms, one per (prior, sample) KL_k, one per
// sample kl. After the cluster barrier (kl's global writes visible), block 0 makes the loss.
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(REDUCE_MAX_THREADS) __cluster_dims__(FH_CLUSTER, 1, 1)
ens_kl_grad(const float* __restrict__ v, const float* __restrict__ priors,
            float* __restrict__ d_v, float* __restrict__ kl, float* __restrict__ loss, int batch,
            int num_atoms, int n_priors, float eps) {
    __shared__ float smem[ENS_SMEM_FLOATS];
    __shared__ float scratch[REDUCE_WARP + 1];
    const float scale = __fdiv_rn(1.0f, (float)(batch * n_priors));
    const int heads = 1 + n_priors;
    const int tile = ENS_SMEM_FLOATS / (heads * (2 * num_atoms + 3));
    const int per_block = (batch + FH_CLUSTER - 1) / FH_CLUSTER;
    const int first = min(batch, fh_cluster_rank() * per_block);
    const int last = min(batch, first + per_block);
    for (int b0 = first; b0 < last; b0 += tile) {
        const int S = min(tile, last - b0);
        const int R = S * heads;  // row r = h * S + s: head h (0 = v, k = prior k) of sample b0 + s
        float* P = smem;                    // [R, num_atoms]: p
        float* L = P + R * num_atoms;       // [R, num_atoms]: the logits, then log p
        float* row_m = L + R * num_atoms;   // [R]
        float* row_sg = row_m + R;          // [R]
        float* row_ls = row_sg + R;         // [R]
        const int n = R * num_atoms;
        // ENS_LOAD_UNROLL global loads in flight per thread before their shared stores (one
        // load per store would wait out a load's latency per element).
        for (int e0 = threadIdx.x; e0 < n; e0 += ENS_LOAD_UNROLL * blockDim.x) {
            float x[ENS_LOAD_UNROLL];
#pragma unroll
            for (int u = 0; u < ENS_LOAD_UNROLL; ++u) {
                const int e = e0 + u * blockDim.x;
                if (e < n) {
                    const int r = e / num_atoms, j = e - r * num_atoms;
                    const int h = r / S, s = r - h * S;
                    const float* src = h == 0 ? v : priors + (long long)(h - 1) * batch * num_atoms;
                    x[u] = src[(long long)(b0 + s) * num_atoms + j];
                }
            }
#pragma unroll
            for (int u = 0; u < ENS_LOAD_UNROLL; ++u) {
                const int e = e0 + u * blockDim.x;
                if (e < n) {
                    L[e] = x[u];
                }
            }
        }
        __syncthreads();
        // Only the sums run serially (their order is the contract); their terms are made one
        // thread per element, so no thread waits out an expf or a division per atom.
        for (int r = threadIdx.x; r < R; r += blockDim.x) {
            const float* row = L + r * num_atoms;
            float m = ENS_NEG_INF;
#pragma unroll 4
            for (int j = 0; j < num_atoms; ++j) {
                m = fmaxf(m, row[j]);
            }
            row_m[r] = m;
        }
        __syncthreads();
        for (int e = threadIdx.x; e < n; e += blockDim.x) {
            P[e] = expf(__fsub_rn(L[e], row_m[e / num_atoms]));  // e_j, then p below
        }
        __syncthreads();
        for (int r = threadIdx.x; r < R; r += blockDim.x) {
            const float* ex = P + r * num_atoms;
            float s = 0.0f;
#pragma unroll 4
            for (int j = 0; j < num_atoms; ++j) {
                s = __fadd_rn(s, ex[j]);
            }
            const float sg = s < eps ? eps : s;
            row_sg[r] = sg;
            row_ls[r] = logf(sg);
        }
        __syncthreads();
        for (int e = threadIdx.x; e < n; e += blockDim.x) {
            const int r = e / num_atoms;
            P[e] = __fdiv_rn(P[e], row_sg[r]);
            L[e] = __fsub_rn(__fsub_rn(L[e], row_m[r]), row_ls[r]);
        }
        __syncthreads();
        // d_v and the KL terms: element (s, j) of head 0 against (k S + s, j); the term
        // overwrites prior k's log p (read once, here).
        for (int e = threadIdx.x; e < S * num_atoms; e += blockDim.x) {
            const float p0 = P[e], lp0 = L[e];
            float d = 0.0f;
            for (int k = 1; k < heads; ++k) {
                const int ek = k * S * num_atoms + e;
                const float pk = P[ek];
                L[ek] = __fmul_rn(pk, __fsub_rn(L[ek], lp0));
                d = __fadd_rn(d, __fsub_rn(pk, p0));
            }
            d_v[(long long)b0 * num_atoms + e] = __fmul_rn(scale, d);
        }
        __syncthreads();
        // KL_k, one thread per (prior k, sample s), into row_m[k S + s] (free since the terms),
        // then kl[b] one thread per sample, in head order.
        for (int q = threadIdx.x; q < n_priors * S; q += blockDim.x) {
            const float* terms = L + (S + q) * num_atoms;
            float kl_k = 0.0f;
#pragma unroll 4
            for (int j = 0; j < num_atoms; ++j) {
                kl_k = __fadd_rn(kl_k, terms[j]);
            }
            row_m[S + q] = kl_k;
        }
        __syncthreads();
        for (int s = threadIdx.x; s < S; s += blockDim.x) {
            float kl_b = 0.0f;
            for (int k = 1; k < heads; ++k) {
                kl_b = __fadd_rn(kl_b, row_m[k * S + s]);
            }
            kl[b0 + s] = kl_b;
        }
        __syncthreads();  // the next tile reuses smem
    }
    fh_cluster_sync();
    if (fh_cluster_rank() != 0) {
        return;
    }
    float acc = REDUCE_SUM_IDENTITY;
    for (int b = threadIdx.x; b < batch; b += blockDim.x) {
        acc = __fadd_rn(acc, kl[b]);
    }
    const float total = block_sum(acc, scratch);
    if (threadIdx.x == 0) {
        *loss = -__fmul_rn(scale, __fadd_rn(total, 0.0f));
    }
}
