// The ensemble-diversity kernel (SPEC 4, second wave), twin of
// foxhunt.reference.kernels.ensemble.ens_kl_grad: the KL diversity of head 0's logits (the value
// stream v) from the K - 1 frozen prior heads, and its gradient on v. The prior heads' forward
// passes and the backward of d_v are the existing GEMMs and dense kernels.
//
// Arithmetic: -fmad=false plus __fadd_rn/__fmul_rn/__fdiv_rn in the reference's order; expf/logf
// against NumPy's float32 functions (a few ulp). Every value is computed by the same operations
// in the same order whatever the launch (cluster size, warps per block), so the bits of d_v and kl never
// depend on it; the loss is a block_sum of reduce.cuh (a fixed tree of the block size).

#include "early_launch.cuh"  // fh_early_wait, fh_early_release
#include "cluster.cuh"  // FH_CLUSTER, fh_cluster_rank, fh_cluster_sync
#include "reduce.cuh"   // block_sum, REDUCE_SUM_IDENTITY

#define ENS_NEG_INF __uint_as_float(0xff800000u)  // the identity of the fmaxf row max
// Shared floats of one block (static: 45 KiB, under the 48 KiB default limit), in slots of one
// sample each: its 1 + n_priors rows twice (p and log p) plus three row statistics, the rows at a
// stride of num_atoms rounded up to 4 floats and the slot to a multiple of 4 floats where that
// fits (else unpadded: floor(ENS_SMEM_FLOATS / ((1 + n_priors) * (2 * num_atoms + 3))) slots,
// which ensemble.py checks is >= 1).
#define ENS_SMEM_FLOATS 11520
// Elements of a sample one lane loads per round (loads in flight together).
#define ENS_LOAD_UNROLL 6

// Element e + 32 of a warp's row-major [heads, na] walk from element e's (h, j): step_h / step_j
// are 32 / na and 32 % na (no division per element).
static __device__ __forceinline__ void ens_advance(int* h, int* j, int step_h, int step_j,
                                                   int na) {
    *h += step_h;
    *j += step_j;
    if (*j >= na) {
        *j -= na;
        *h += 1;
    }
}

struct EnsMax {
    __device__ __forceinline__ float operator()(float acc, float x) const { return fmaxf(acc, x); }
};
struct EnsAdd {
    __device__ __forceinline__ float operator()(float acc, float x) const {
        return __fadd_rn(acc, x);
    }
};

// acc = op(...op(op(init, row[0]), row[1])..., row[na - 1]): the serial row reductions in atom
// order. With `vec` (row 16-byte aligned) four atoms per shared load (the same op order).
template <typename Op>
static __device__ __forceinline__ float ens_row_chain(const float* row, int na, bool vec,
                                                      float init, Op op) {
    float acc = init;
    int a = 0;
    if (vec) {
        const float4* row4 = reinterpret_cast<const float4*>(row);
#pragma unroll 4
        for (; a + 4 <= na; a += 4) {
            const float4 x = row4[a >> 2];
            acc = op(acc, x.x);
            acc = op(acc, x.y);
            acc = op(acc, x.z);
            acc = op(acc, x.w);
        }
    }
#pragma unroll 4
    for (; a < na; ++a) {
        acc = op(acc, row[a]);
    }
    return acc;
}

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
// samples [r Q, (r + 1) Q), Q = ceil(batch / FH_CLUSTER), ONE WARP PER SAMPLE: warp w of the
// first W = min(T / 32, ENS_SMEM_FLOATS / ((1 + n_priors) (2 num_atoms + 3))) takes the
// samples r Q + w, r Q + w + W, ... in its own shared-memory slot (ENS_SMEM_FLOATS; W counts the
// slots of the layout used), synchronising with __syncwarp only: the lanes read the rows
// coalesced (ENS_LOAD_UNROLL loads in flight per lane) and make every elementwise value (e_j, p,
// log p, the KL terms, d_v) one lane per element; only the reductions in the contract's order run
// serially, lane h making row h's max and sum, lane k - 1 KL_k (ens_row_chain: float4 shared
// loads on padded rows), lane 0 kl[b]. After the cluster barrier (kl's global writes visible),
// block 0 makes the loss.
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(REDUCE_MAX_THREADS) __cluster_dims__(FH_CLUSTER, 1, 1)
ens_kl_grad(const float* __restrict__ v, const float* __restrict__ priors,
            float* __restrict__ d_v, float* __restrict__ kl, float* __restrict__ loss, int batch,
            int num_atoms, int n_priors, float eps) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    __shared__ __align__(16) float smem[ENS_SMEM_FLOATS];
    __shared__ float scratch[REDUCE_WARP + 1];
    const float scale = __fdiv_rn(1.0f, (float)(batch * n_priors));
    const int heads = 1 + n_priors;
    const int na = num_atoms;
    const int n = heads * na;  // a sample's elements: e = h * na + j, head h (0 = v), atom j
    // Rows at a stride of na rounded up to 4 floats and slots of a multiple of 4 floats (the
    // serial row reductions then read float4) where that fits, else at stride na.
    const int na4 = (na + 3) & ~3;
    const int padded = (heads * (2 * na4 + 3) + 3) & ~3;
    const bool vec = padded <= ENS_SMEM_FLOATS;
    const int stride = vec ? na4 : na;  // element (h, j) of a slot's array at h * stride + j
    const int per_sample = vec ? padded : heads * (2 * na + 3);
    const int warps = (int)(blockDim.x / REDUCE_WARP);
    const int fit = ENS_SMEM_FLOATS / per_sample;
    const int slots = warps < fit ? warps : fit;
    const int per_block = (batch + FH_CLUSTER - 1) / FH_CLUSTER;
    const int first = min(batch, fh_cluster_rank() * per_block);
    const int last = min(batch, first + per_block);
    const int warp = (int)(threadIdx.x / REDUCE_WARP);
    const int lane = (int)(threadIdx.x % REDUCE_WARP);
    if (warp < slots) {
        float* P = smem + warp * per_sample;  // [heads, stride]: e_j, then p
        float* L = P + heads * stride;        // [heads, stride]: the logits, log p, KL terms
        float* row_m = L + heads * stride;    // [heads]: the row max, then KL_k at k
        float* row_sg = row_m + heads;        // [heads]
        float* row_ls = row_sg + heads;       // [heads]
        // (h, j) of element `lane`, and the step of 32 elements: no division per element.
        const int lane_h = lane / na, lane_j = lane - lane_h * na;
        const int step_h = REDUCE_WARP / na, step_j = REDUCE_WARP - step_h * na;
        const int prior_stride = batch * na;  // head h >= 1 at (h - 1) * prior_stride
        // The padded layout's float4 groups (a row's na4 / 4), walked like the elements.
        const int groups_row = stride >> 2, groups = heads * groups_row;
        const int lane_gh = vec ? lane / groups_row : 0, lane_gc = lane - lane_gh * groups_row;
        const int gstep_h = vec ? REDUCE_WARP / groups_row : 0;
        const int gstep_c = REDUCE_WARP - gstep_h * groups_row;
        const int pads = stride - na;  // per row: zeroed for each sample, so never NaN or Inf
        for (int b = first + warp; b < last; b += slots) {
            const float* v_row = v + b * na;
            const float* p_row = priors + b * na;
            int h = lane_h, j = lane_j;
            for (int e0 = lane; e0 < n; e0 += ENS_LOAD_UNROLL * REDUCE_WARP) {
                float x[ENS_LOAD_UNROLL];
                int hh = h, jj = j;
                int at[ENS_LOAD_UNROLL];  // the elements' places in the slot
#pragma unroll
                for (int u = 0; u < ENS_LOAD_UNROLL; ++u) {
                    if (e0 + u * REDUCE_WARP < n) {
                        const float* src = hh == 0 ? v_row : p_row + (hh - 1) * prior_stride;
                        x[u] = src[jj];
                    }
                    at[u] = hh * stride + jj;
                    ens_advance(&hh, &jj, step_h, step_j, na);
                }
#pragma unroll
                for (int u = 0; u < ENS_LOAD_UNROLL; ++u) {
                    if (e0 + u * REDUCE_WARP < n) {
                        L[at[u]] = x[u];
                    }
                }
                h = hh;
                j = jj;
            }
            for (int z = lane; z < heads * pads; z += REDUCE_WARP) {
                const int r = z / pads;
                L[r * stride + na + (z - r * pads)] = 0.0f;
            }
            __syncwarp();
            for (int r = lane; r < heads; r += REDUCE_WARP) {
                row_m[r] = ens_row_chain(L + r * stride, na, vec, ENS_NEG_INF, EnsMax());
            }
            __syncwarp();
            if (vec) {  // four atoms of one row per lane and step (the pads too: unread)
                float4* P4 = reinterpret_cast<float4*>(P);
                const float4* L4 = reinterpret_cast<const float4*>(L);
                int gh = lane_gh, gc = lane_gc;
                for (int g = lane; g < groups; g += REDUCE_WARP) {
                    const float m = row_m[gh];
                    const float4 x = L4[g];
                    float4 ex;
                    ex.x = expf(__fsub_rn(x.x, m));
                    ex.y = expf(__fsub_rn(x.y, m));
                    ex.z = expf(__fsub_rn(x.z, m));
                    ex.w = expf(__fsub_rn(x.w, m));
                    P4[g] = ex;
                    ens_advance(&gh, &gc, gstep_h, gstep_c, groups_row);
                }
            } else {
                h = lane_h;
                j = lane_j;
#pragma unroll 1
                for (int e = lane; e < n; e += REDUCE_WARP) {
                    const int at = h * stride + j;
                    P[at] = expf(__fsub_rn(L[at], row_m[h]));  // e_j, then p below
                    ens_advance(&h, &j, step_h, step_j, na);
                }
            }
            __syncwarp();
            for (int r = lane; r < heads; r += REDUCE_WARP) {
                const float s = ens_row_chain(P + r * stride, na, vec, 0.0f, EnsAdd());
                const float sg = s < eps ? eps : s;
                row_sg[r] = sg;
                row_ls[r] = logf(sg);
            }
            __syncwarp();
            if (vec) {
                float4* P4 = reinterpret_cast<float4*>(P);
                float4* L4 = reinterpret_cast<float4*>(L);
                int gh = lane_gh, gc = lane_gc;
                for (int g = lane; g < groups; g += REDUCE_WARP) {
                    const float m = row_m[gh], sg = row_sg[gh], ls = row_ls[gh];
                    float4 p = P4[g], x = L4[g];
                    p.x = __fdiv_rn(p.x, sg);
                    p.y = __fdiv_rn(p.y, sg);
                    p.z = __fdiv_rn(p.z, sg);
                    p.w = __fdiv_rn(p.w, sg);
                    x.x = __fsub_rn(__fsub_rn(x.x, m), ls);
                    x.y = __fsub_rn(__fsub_rn(x.y, m), ls);
                    x.z = __fsub_rn(__fsub_rn(x.z, m), ls);
                    x.w = __fsub_rn(__fsub_rn(x.w, m), ls);
                    P4[g] = p;
                    L4[g] = x;
                    ens_advance(&gh, &gc, gstep_h, gstep_c, groups_row);
                }
            } else {
                h = lane_h;
                j = lane_j;
#pragma unroll 1
                for (int e = lane; e < n; e += REDUCE_WARP) {
                    const int at = h * stride + j;
                    P[at] = __fdiv_rn(P[at], row_sg[h]);
                    L[at] = __fsub_rn(__fsub_rn(L[at], row_m[h]), row_ls[h]);
                    ens_advance(&h, &j, step_h, step_j, na);
                }
            }
            __syncwarp();
            // d_v and the KL terms: atom a of head 0 against (k, a); the term overwrites prior
            // k's log p (read once, here).
            for (int a = lane; a < na; a += REDUCE_WARP) {
                const float p0 = P[a], lp0 = L[a];
                float d = 0.0f;
                for (int k = 1; k < heads; ++k) {
                    const int ek = k * stride + a;
                    const float pk = P[ek];
                    L[ek] = __fmul_rn(pk, __fsub_rn(L[ek], lp0));
                    d = __fadd_rn(d, __fsub_rn(pk, p0));
                }
                d_v[b * na + a] = __fmul_rn(scale, d);
            }
            __syncwarp();
            // KL_k, lane k - 1 into row_m[k] (free since the terms), then kl[b] in head order.
            for (int q = lane; q < n_priors; q += REDUCE_WARP) {
                row_m[1 + q] = ens_row_chain(L + (1 + q) * stride, na, vec, 0.0f, EnsAdd());
            }
            __syncwarp();
            if (lane == 0) {
                float kl_b = 0.0f;
                for (int k = 1; k < heads; ++k) {
                    kl_b = __fadd_rn(kl_b, row_m[k]);
                }
                kl[b] = kl_b;
            }
            __syncwarp();  // the next sample reuses the slot
        }
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
