// The IQN head's kernels (SPEC 4, second wave), twins of foxhunt.reference.kernels.iqn under the
// same names: quantile fractions and cosine features (iqn_tau_cos), the modulation
// e = h2 * phi (iqn_modulate), the quantile Huber loss and its gradient (iqn_quantile_huber) and
// the modulation's backward (iqn_modulate_backward). The head's GEMMs and bias/ReLU epilogues
// are the dense kernels' and cuBLAS's.
//
// Rows: m = b * n_quantiles + i (sample b, quantile fraction i). q / q_target are [rows, a_total]
// with branch d's actions at columns action_offset[d] .. action_offset[d] + n_actions[d].
// Arithmetic: -fmad=false (fast/_build.py) plus explicit __fmul_rn/__fadd_rn where the order
// matters, in the reference's order; the cosine in double, rounded once to float.

#include "early_launch.cuh"  // fh_early_wait, fh_early_release
#include "bf16_bits.cuh"  // f32_to_bf16_bits, bf16_quad_bits (the BF16 operand of the next GEMM)
#include "flat.cuh"  // fh_aligned
#include "cluster.cuh"    // FH_CLUSTER, fh_cluster_rank, fh_cluster_sync, fh_cluster_read
#include "distributional.cuh"  // effective_gamma (n-step targets, shared with the C51 kernels)
#include "reduce.cuh"     // block_sum_halving (the loss total: step.block_total's tree)
#include "rng.cuh"        // rng_uniform (the quantile fractions)

// Threads of iqn_quantile_huber's blocks (reference IQN_LOSS_THREADS): the loss total's tree.
#define IQN_LOSS_THREADS 256
// Shared floats of iqn_quantile_huber's rho tile (fast/kernels/iqn.py IQN_RHO_FLOATS).
#define IQN_RHO_FLOATS 8192
// Target values iqn_quantile_huber loads together (registers) before their uses, and terms its
// loss reads together from the cluster's blocks.
#define IQN_QT_BATCH 8
#define IQN_DSMEM_BATCH 4
#define IQN_PI 3.141592653589793  // numpy.pi, a double
#define IQN_F32_EXP_MASK 0x7f800000u

// 32-bit indices throughout: every array of these kernels holds fewer than 2^30 elements
// (fast/kernels/_runtime.py MAX_ELEMENTS), so an index plus a grid stride (at most
// IQN_MAX_BLOCKS * IQN_THREADS) never wraps.
#define IQN_GRID_LOOP(i, n)                                                                \
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < (n);                   \
         i += gridDim.x * blockDim.x)

static __device__ __forceinline__ bool iqn_is_finite(float x) {
    return (__float_as_uint(x) & IQN_F32_EXP_MASK) != IQN_F32_EXP_MASK;
}

// Features per thread and block iteration of iqn_tau_cos (fast/kernels/iqn.py IQN_COS_CHUNKS;
// the kernel spells its two features out), and the most features one block iteration may cover
// (its rows' draws fit the shared buffer).
#define IQN_COS_CHUNKS 2u
#define IQN_COS_SPAN 512u
// 2^52 as a double: (double)k == __hiloint2double(0x43300000, k) - 2^52 exactly for 0 <= k < 2^32
// (one double add instead of a 32 -> 64-bit conversion, the slowest kind of instruction).
#define IQN_TWO_52 4503599627370496.0
#define IQN_TWO_52_HI 0x43300000

// (row, column) of a flat index of a [rows, nc] array, advanced by a stride split as
// (step_q, step_r) = divmod(stride, nc) (no division per step).
static __device__ __forceinline__ void iqn_advance(unsigned int* m, unsigned int* k,
                                                   unsigned int step_q, unsigned int step_r,
                                                   unsigned int nc) {
    *m += step_q;
    *k += step_r;
    if (*k >= nc) {
        *k -= nc;
        *m += 1u;
    }
}

// ---------------------------------------------------------------------------------------------
// tau[m] = rng_uniform(key, stream, *step, m); cosines[m, k] = (float)cos(pi * ((double)k * tau[m]))
// for m < rows, k < n_cos. The offset is the trainer's step count, read from device memory (the
// graph replays the same launch every step). Block-stride over spans of S = IQN_COS_CHUNKS * T
// consecutive features (T = blockDim.x): first the block draws each row the span touches ONCE
// (ten Philox rounds per row, not per feature; the thread of a row whose feature k == 0 lies in
// the span stores tau) into a shared buffer as an exact double (two buffers, alternating, so one
// barrier per span), then thread t computes features base + t and base + T + t, each feature's
// (row, k) carried from span to span by additions (no division per feature) and (double)k made
// exactly by a double add. The same operations per value whatever the grid, so the outputs do
// not depend on gridDim.x. A block of more than IQN_COS_SPAN / IQN_COS_CHUNKS threads (never
// planned) draws per feature.
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void iqn_tau_cos(const long long* __restrict__ step, unsigned int key_lo,
                                       unsigned int key_hi, unsigned int stream,
                                       float* __restrict__ tau, float* __restrict__ cosines,
                                       int rows, int n_cos) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    __shared__ double drawn[2][IQN_COS_SPAN];
    const unsigned long long offset = (unsigned long long)step[0];
    const unsigned int nc = (unsigned int)n_cos;
    const unsigned int n_rows = (unsigned int)rows;
    const unsigned int n = n_rows * nc;
    const unsigned int span = IQN_COS_CHUNKS * blockDim.x;
    if (span > IQN_COS_SPAN) {
        IQN_GRID_LOOP(idx, n) {
            const unsigned int m = idx / nc;
            const int k = (int)(idx - m * nc);
            const float t = rng_uniform(key_lo, key_hi, stream, offset, m);
            if (k == 0) {
                tau[m] = t;
            }
            cosines[idx] = (float)cos(IQN_PI * ((double)k * (double)t));
        }
        return;
    }
    // Rows a span of `span` features can touch: floor((span + nc - 2) / nc) + 1 <= span.
    const unsigned int span_rows = (span + nc - 2u) / nc + 1u;
    const unsigned int stride = gridDim.x * span;
    const unsigned int stride_q = stride / nc, stride_r = stride - stride_q * nc;
    unsigned int base = blockIdx.x * span;
    unsigned int rb = base / nc, kb = base - rb * nc;  // the span's first feature
    const unsigned int f0 = base + threadIdx.x, f1 = f0 + blockDim.x;
    unsigned int m0 = f0 / nc, k0 = f0 - m0 * nc;       // this thread's two features
    unsigned int m1 = f1 / nc, k1 = f1 - m1 * nc;
    for (unsigned int it = 0; base < n; ++it) {
        double* draws = drawn[it & 1u];
        const unsigned int here = min(span_rows, n_rows - rb);
        for (unsigned int r = threadIdx.x; r < here; r += blockDim.x) {
            const float t = rng_uniform(key_lo, key_hi, stream, offset, rb + r);
            draws[r] = (double)t;
            const unsigned int start = r * nc;  // row rb + r's first feature is base + start - kb
            if (start >= kb && start - kb < span) {
                tau[rb + r] = t;
            }
        }
        __syncthreads();  // also: every thread is past the span before last (its buffer's reader)
        if (base + threadIdx.x < n) {
            const double dk = __hiloint2double(IQN_TWO_52_HI, (int)k0) - IQN_TWO_52;
            cosines[base + threadIdx.x] = (float)cos(IQN_PI * (dk * draws[m0 - rb]));
        }
        if (base + blockDim.x + threadIdx.x < n) {
            const double dk = __hiloint2double(IQN_TWO_52_HI, (int)k1) - IQN_TWO_52;
            cosines[base + blockDim.x + threadIdx.x] = (float)cos(IQN_PI * (dk * draws[m1 - rb]));
        }
        base += stride;
        iqn_advance(&rb, &kb, stride_q, stride_r, nc);
        iqn_advance(&m0, &k0, stride_q, stride_r, nc);
        iqn_advance(&m1, &k1, stride_q, stride_r, nc);
    }
}

// ---------------------------------------------------------------------------------------------
// e[m, h] = h2[m / n_quantiles, h] * phi[m, h]; e_bf16 (skipped when null) its BF16 bits. A
// null e skips the float32 store too (a pass whose only reader is the BF16 GEMM).
// Vector path (hidden % 4 == 0, h2 / phi / e 16-byte and e_bf16 8-byte aligned): flat over the
// rows * hidden / 4 groups of four units, one float4 load of phi and of h2, one float4 store of
// e and one 8-byte store of the four BF16 patterns (unit h + c in bits 16c .. 16c + 15, little
// endian as the u16 array). Otherwise flat over the rows * hidden products. Each product is the
// same single rounded multiply either way.
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void iqn_modulate(const float* __restrict__ h2, const float* __restrict__ phi,
                                        float* __restrict__ e, unsigned short* __restrict__ e_bf16,
                                        int rows, int hidden, int n_quantiles) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    const unsigned int nq = (unsigned int)n_quantiles;
    if ((hidden & 3) == 0 && fh_aligned(h2, 16u) && fh_aligned(phi, 16u) &&
        fh_aligned(e, 16u) && fh_aligned(e_bf16, 8u)) {
        const unsigned int h4 = (unsigned int)hidden >> 2;
        const unsigned int n4 = (unsigned int)rows * h4;
        const float4* __restrict__ h2_4 = reinterpret_cast<const float4*>(h2);
        const float4* __restrict__ phi_4 = reinterpret_cast<const float4*>(phi);
        float4* __restrict__ e_4 = reinterpret_cast<float4*>(e);
        uint2* __restrict__ bf_4 = reinterpret_cast<uint2*>(e_bf16);
        IQN_GRID_LOOP(v, n4) {
            const unsigned int m = v / h4;
            const unsigned int c = v - m * h4;
            const float4 a = h2_4[(m / nq) * h4 + c];
            const float4 p = phi_4[v];
            float4 o;
            o.x = __fmul_rn(a.x, p.x);
            o.y = __fmul_rn(a.y, p.y);
            o.z = __fmul_rn(a.z, p.z);
            o.w = __fmul_rn(a.w, p.w);
            if (e != nullptr) {
                e_4[v] = o;
            }
            if (e_bf16 != nullptr) {
                bf_4[v] = bf16_quad_bits(o);
            }
        }
        return;
    }
    const unsigned int hd = (unsigned int)hidden;
    const unsigned int n = (unsigned int)rows * hd;
    IQN_GRID_LOOP(idx, n) {
        const unsigned int m = idx / hd;
        const unsigned int h = idx - m * hd;
        const float v = __fmul_rn(h2[(m / nq) * hd + h], phi[idx]);
        if (e != nullptr) {
            e[idx] = v;
        }
        if (e_bf16 != nullptr) {
            e_bf16[idx] = f32_to_bf16_bits(v);
        }
    }
}

// One unit of iqn_modulate_backward's quantile loop: d_h2's term (skipped when non-finite) and
// d_phi_pre.
static __device__ __forceinline__ float iqn_modulate_grad(float g, float p, float hv, float* acc) {
    const float t = __fmul_rn(g, p);
    if (iqn_is_finite(t)) {
        *acc = __fadd_rn(*acc, t);
    }
    return (p <= 0.0f) ? 0.0f : __fmul_rn(g, hv);
}

// ---------------------------------------------------------------------------------------------
// Backward of e = h2 * phi and phi = relu(phi_pre), one thread per (b, h) (vector path: per
// (b, four units h .. h + 3), hidden % 4 == 0 and every pointer 16-byte aligned: float4 loads and
// stores, each unit's own accumulator):
//   d_h2[b, h]         = sum over i of de[m, h] * phi[m, h] (m = b N + i, i in order, from +0),
//                        a non-finite term skipped (the seeds' isfinite guard)
//   d_phi_pre[m, h]    = phi[m, h] <= 0 ? 0 : de[m, h] * h2[b, h]
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void iqn_modulate_backward(const float* __restrict__ de,
                                                 const float* __restrict__ h2,
                                                 const float* __restrict__ phi,
                                                 float* __restrict__ d_h2,
                                                 float* __restrict__ d_phi_pre, int batch,
                                                 int hidden, int n_quantiles) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    const unsigned int nq = (unsigned int)n_quantiles;
    if ((hidden & 3) == 0 && fh_aligned(de, 16u) && fh_aligned(h2, 16u) &&
        fh_aligned(phi, 16u) && fh_aligned(d_h2, 16u) && fh_aligned(d_phi_pre, 16u)) {
        const unsigned int h4 = (unsigned int)hidden >> 2;
        const unsigned int n4 = (unsigned int)batch * h4;
        const float4* __restrict__ de_4 = reinterpret_cast<const float4*>(de);
        const float4* __restrict__ h2_4 = reinterpret_cast<const float4*>(h2);
        const float4* __restrict__ phi_4 = reinterpret_cast<const float4*>(phi);
        float4* __restrict__ d_h2_4 = reinterpret_cast<float4*>(d_h2);
        float4* __restrict__ d_phi_4 = reinterpret_cast<float4*>(d_phi_pre);
        IQN_GRID_LOOP(v, n4) {
            const unsigned int b = v / h4;
            const unsigned int c = v - b * h4;
            const float4 hv = h2_4[v];
            float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            unsigned int at = b * nq * h4 + c;
            for (unsigned int i = 0; i < nq; ++i, at += h4) {
                const float4 g = de_4[at];
                const float4 p = phi_4[at];
                float4 out;
                out.x = iqn_modulate_grad(g.x, p.x, hv.x, &acc.x);
                out.y = iqn_modulate_grad(g.y, p.y, hv.y, &acc.y);
                out.z = iqn_modulate_grad(g.z, p.z, hv.z, &acc.z);
                out.w = iqn_modulate_grad(g.w, p.w, hv.w, &acc.w);
                d_phi_4[at] = out;
            }
            d_h2_4[v] = acc;
        }
        return;
    }
    const unsigned int hd = (unsigned int)hidden;
    const unsigned int n = (unsigned int)batch * hd;
    IQN_GRID_LOOP(idx, n) {
        const unsigned int b = idx / hd;
        const unsigned int h = idx - b * hd;
        const float hv = h2[idx];
        float acc = 0.0f;
        unsigned int at = b * nq * hd + h;
        for (unsigned int i = 0; i < nq; ++i, at += hd) {
            d_phi_pre[at] = iqn_modulate_grad(de[at], phi[at], hv, &acc);
        }
        d_h2[idx] = acc;
    }
}

// ---------------------------------------------------------------------------------------------
// Quantile Huber loss (kappa = 1) and dq over the (d, b) pairs p = d * batch + b:
//   bound = k1 * max(isv[q_abs_ref_index], 1)                                      (Mech 1)
//   y[d, b, j] = clip(r[b] + (g * (1 - done[b])) * q_target[b N + j, off_d + a_star[d, b]]),
//           g = effective_gamma(gamma[d], discount, b, gamma_ref, n_step_on) (gamma[d] when
//           n_step_on == 0: discount not read)
//   u = y[d, b, j] - q[b N + i, off_d + actions[d, b]];  w = |tau[b N + i] - (u < 0 ? 1 : 0)|
//   rho = w * huber(u);  l = sum of rho (i outer, j inner, from 0);  g_i = sum_j w * clip(u, -1, 1)
//   dq[b N + i, off_d + a] = a == actions[d, b] ? -(c_b * g_i) : 0,  c_b = isw[b] * scale,
//   scale = 1 / (batch * n_branches * N)
//   *loss = block total of the terms c_b * l (thread t of IQN_LOSS_THREADS adds the terms t,
//           t + IQN_LOSS_THREADS, ... from -0, then block_sum_halving, then + 0: step.block_total)
// The clips are comparisons, so NaN stays NaN (sentinel 28 watches dq).
//
// ONE cluster of FH_CLUSTER blocks (8 on sm_90, else 1) of IQN_LOSS_THREADS threads. Block rank
// r owns the pairs [r Q, (r + 1) Q), Q = ceil(pairs / FH_CLUSTER), in tiles of T = max(1,
// IQN_RHO_FLOATS / N^2) pairs: one thread per (pair, i) computes y (each recomputes the pair's
// N targets, their q_target values loaded IQN_QT_BATCH at a time before their uses; the i = 0
// thread stores them), g_i, its row of dq and its N values of rho (shared memory); then one
// thread per pair adds its rho in (i, j) order into its term (shared memory, kept to the end).
// After the cluster barrier block 0 reads the terms (distributed shared memory, IQN_DSMEM_BATCH
// reads in flight per thread) in the one-block order above; a last barrier keeps every block's
// terms alive until then. Every value is made by the same operations in the same order on any
// cluster size. 32-bit indices (every array holds fewer than 2^30 elements).
// Dynamic shared memory: (Q + T N^2) floats (fast/kernels/iqn.py plan_iqn_quantile_huber).
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(IQN_LOSS_THREADS) __cluster_dims__(FH_CLUSTER, 1, 1)
iqn_quantile_huber(const float* __restrict__ q, const float* __restrict__ q_target,
                   const float* __restrict__ tau, const int* __restrict__ actions,
                   const int* __restrict__ a_star, const float* __restrict__ r,
                   const float* __restrict__ done, const float* __restrict__ gamma,
                   const float* __restrict__ isw, const float* __restrict__ isv,
                   int q_abs_ref_index, float k1, const int* __restrict__ n_actions,
                   const int* __restrict__ action_offset, const float* __restrict__ discount,
                   float* __restrict__ y, float* __restrict__ dq, float* __restrict__ loss,
                   int n_branches, int batch, int n_quantiles, int a_total, float gamma_ref,
                   int n_step_on) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    extern __shared__ float iqn_smem[];
    const int N = n_quantiles;
    const float bound = __fmul_rn(k1, fmaxf(isv[q_abs_ref_index], 1.0f));
    const float scale = __fdiv_rn(1.0f, (float)(batch * n_branches * N));
    const int pairs = n_branches * batch;
    const int per_block = (pairs + FH_CLUSTER - 1) / FH_CLUSTER;
    const int rank = fh_cluster_rank();
    const int first = min(pairs, rank * per_block);
    const int last = min(pairs, first + per_block);
    const int tile = max(1, IQN_RHO_FLOATS / (N * N));
    float* terms = iqn_smem;             // [per_block]: pair first + k at k
    float* rho = iqn_smem + per_block;   // [tile, N, N]
    for (int p0 = first; p0 < last; p0 += tile) {
        const int S = min(tile, last - p0);
        for (int unit = threadIdx.x; unit < S * N; unit += blockDim.x) {
            const int pl = unit / N, i = unit - pl * N;
            const int p = p0 + pl;
            const int d = p / batch;
            const int b = p - d * batch;
            const int off = action_offset[d];
            const int na = n_actions[d];
            const int taken = actions[p];
            const int chosen = a_star[p];
            const float coef = __fmul_rn(isw[b], scale);
            const float gamma_b = effective_gamma(gamma[d], discount, b, gamma_ref, n_step_on);
            const float step_discount = __fmul_rn(gamma_b, __fsub_rn(1.0f, done[b]));
            const float rb = r[b];
            const int row = (b * N + i) * a_total;
            const float qi = q[row + off + taken];
            const float ti = tau[b * N + i];
            // Target j's value at qt_col[j * a_total]; IQN_QT_BATCH of them loaded together.
            const float* qt_col = q_target + b * N * a_total + off + chosen;
            float* rho_i = rho + (pl * N + i) * N;
            float g = 0.0f;
            for (int j0 = 0; j0 < N; j0 += IQN_QT_BATCH) {
                float qt[IQN_QT_BATCH];
#pragma unroll
                for (int u = 0; u < IQN_QT_BATCH; ++u) {
                    if (j0 + u < N) {
                        qt[u] = qt_col[(j0 + u) * a_total];
                    }
                }
#pragma unroll
                for (int u = 0; u < IQN_QT_BATCH; ++u) {
                    const int j = j0 + u;
                    if (j < N) {
                        const float c = __fadd_rn(rb, __fmul_rn(step_discount, qt[u]));
                        const float yj = c > bound ? bound : (c < -bound ? -bound : c);
                        if (i == 0) {
                            y[p * N + j] = yj;
                        }
                        const float u_j = __fsub_rn(yj, qi);
                        const float w = fabsf(__fsub_rn(ti, u_j < 0.0f ? 1.0f : 0.0f));
                        const float au = fabsf(u_j);
                        const float huber = au <= 1.0f ? __fmul_rn(0.5f, __fmul_rn(u_j, u_j))
                                                       : __fsub_rn(au, 0.5f);
                        rho_i[j] = __fmul_rn(w, huber);
                        const float clipped = u_j > 1.0f ? 1.0f : (u_j < -1.0f ? -1.0f : u_j);
                        g = __fadd_rn(g, __fmul_rn(w, clipped));
                    }
                }
            }
            const float grad = -__fmul_rn(coef, g);
            for (int a = 0; a < na; ++a) {
                dq[row + off + a] = a == taken ? grad : 0.0f;
            }
        }
        __syncthreads();
        for (int pl = threadIdx.x; pl < S; pl += blockDim.x) {
            const int b = (p0 + pl) % batch;
            const float coef = __fmul_rn(isw[b], scale);  // loaded before the sum's chain
            const float* rho_p = rho + pl * N * N;
            float lsum = 0.0f;
            for (int k = 0; k < N * N; ++k) {
                lsum = __fadd_rn(lsum, rho_p[k]);
            }
            terms[p0 + pl - first] = __fmul_rn(coef, lsum);
        }
        __syncthreads();  // the next tile reuses rho
    }
    fh_cluster_sync();
    if (rank == 0) {
        // Thread t adds the terms t, t + T, ... in order; IQN_DSMEM_BATCH of them are read
        // (distributed shared memory) before their adds, so the reads overlap.
        float partial = REDUCE_SUM_IDENTITY;
        for (int p = threadIdx.x; p < pairs; p += IQN_DSMEM_BATCH * blockDim.x) {
            float t[IQN_DSMEM_BATCH];
#pragma unroll
            for (int u = 0; u < IQN_DSMEM_BATCH; ++u) {
                const int pu = p + u * (int)blockDim.x;
                if (pu < pairs) {
                    const int owner = pu / per_block;
                    t[u] = fh_cluster_read(terms + (pu - owner * per_block), owner);
                }
            }
#pragma unroll
            for (int u = 0; u < IQN_DSMEM_BATCH; ++u) {
                if (p + u * (int)blockDim.x < pairs) {
                    partial = __fadd_rn(partial, t[u]);
                }
            }
        }
        const float total = block_sum_halving(partial);
        if (threadIdx.x == 0) {
            *loss = __fadd_rn(total, 0.0f);  // an empty sum reads +0.0
        }
    }
    fh_cluster_sync();  // the terms stay alive until block 0 has read them
}
