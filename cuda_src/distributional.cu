// Distributional (C51) kernels: dueling combination and its backward, log-softmax over atoms,
// expected Q, double-DQN action choice, the dense triangular C51 projection, the C51 loss and
// gradient, and the CQL logit gradient (SPEC sections 3 and 4); and two fused kernels, each the
// composition of two of them in one launch (log_softmax_expected_q, c51_project_grad), built
// from the same device bodies so they are bitwise equal to the separate launches.
//
// The specification is foxhunt/reference/kernels/distributional.py: each kernel here has the
// reference function's name, formula, operation order and NaN/Inf contract. Shapes per branch:
// B samples, A actions, NA atoms, all row-major float32 (int32 actions).
//
// Conventions:
// - Parameters: inputs (reference order), then outputs, then sizes and configuration scalars.
// - Scalars the step reads from the ISV bus or may change between graph replays (gamma, alpha,
//   scale) are passed as pointers to one device float, so a captured graph sees their current
//   value; configuration (v_min, v_max, dz, sizes) is passed by value.
// - Built with -fmad=false (fast/_build.py): a * b + c is two roundings, as in NumPy.
// - Deterministic, no atomics: sums over actions run in action order (bitwise equal to the
//   reference); sums over atoms use a fixed per-lane order plus a fixed warp butterfly (the
//   reference uses NumPy's pairwise order: conformance compares them as reductions); the
//   projection's sum over source atoms runs in source order, like the reference's.
// - Index arithmetic is 32-bit: the launchers (fast/kernels/distributional.py) refuse arrays
//   of 2^30 elements or more.

#include "early_launch.cuh"  // fh_early_wait, fh_early_release
#include "distributional.cuh"  // kWarp, warp reductions, log_softmax_row, the kernel bodies
                       // (the projection's per-sample body: c51_project_sample)

// The row of this thread's warp in the warp-per-row kernels (grid-stride: add
// gridDim.x * (blockDim.x / kWarp) for the next).
static __device__ __forceinline__ int first_warp_row() {
    return blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp;
}

// --------------------------------------------------------------------------------------------
// Dueling combination: logits[b, a, j] = v[b, j] + (adv[b, a, j] - mean_a adv[b, :, j]).
// One thread per (b, j) cell (grid-stride); the mean is the action-order sum divided by A.
// --------------------------------------------------------------------------------------------
extern "C" __global__ void dueling_combine(const float* __restrict__ v,
                                           const float* __restrict__ adv,
                                           float* __restrict__ logits,
                                           int batch, int num_actions, int num_atoms) {
    dueling_combine_body(v, adv, logits, batch, num_actions, num_atoms);
}

// --------------------------------------------------------------------------------------------
// Backward of dueling_combine: dv[b, j] = sum_a dlogits[b, a, j] (action order);
// dadv[b, a, j] = dlogits[b, a, j] - dv[b, j] / A. One thread per (b, j) cell (grid-stride).
// --------------------------------------------------------------------------------------------
extern "C" __global__ void dueling_combine_backward(const float* __restrict__ dlogits,
                                                    float* __restrict__ dv,
                                                    float* __restrict__ dadv,
                                                    int batch, int num_actions, int num_atoms) {
    dueling_combine_backward_body(dlogits, dv, dadv, batch, num_actions, num_atoms);
}

// --------------------------------------------------------------------------------------------
// Log-softmax over the atoms of each row: logp_j = (x_j - m) - log(sum_k exp(x_k - m)),
// m = max_k x_k. One warp per row (rows = prod of the leading dimensions; grid-stride).
// NaN/+Inf anywhere or an all -Inf row gives a NaN row (through Inf - Inf or exp(NaN)).
// --------------------------------------------------------------------------------------------
extern "C" __global__ void log_softmax_atoms(const float* __restrict__ logits,
                                             float* __restrict__ logp,
                                             int rows, int num_atoms) {
    const int lane = threadIdx.x % kWarp;
    const int warp_stride = gridDim.x * (blockDim.x / kWarp);
    for (int row = first_warp_row(); row < rows; row += warp_stride) {
        log_softmax_row(logits + row * num_atoms, logp + row * num_atoms, nullptr, false,
                        num_atoms, lane);
    }
}

// --------------------------------------------------------------------------------------------
// Expected Q: q[r] = sum_j exp(logp[r, j]) * z[j] for every (b, a) row r. One warp per row.
// --------------------------------------------------------------------------------------------
extern "C" __global__ void expected_q(const float* __restrict__ logp,
                                      const float* __restrict__ z,
                                      float* __restrict__ q,
                                      int rows, int num_atoms) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    const int lane = threadIdx.x % kWarp;
    const int warp_stride = gridDim.x * (blockDim.x / kWarp);
    for (int row = first_warp_row(); row < rows; row += warp_stride) {
        const float value = warp_expected_q(logp + row * num_atoms, z, num_atoms, lane);
        if (lane == 0) {
            q[row] = value;
        }
    }
}

// --------------------------------------------------------------------------------------------
// log_softmax_atoms then expected_q on its first q_rows rows, in one launch:
//   logp[r, :] = log_softmax(logits[r, :]) for r < rows; q[r] = sum_j exp(logp[r, j]) * z[j]
//   for r < q_rows (<= rows). One warp per row (grid-stride), as both kernels; the warp sums Q
// from the logp values it has just written (log_softmax_row), in expected_q's order.
// --------------------------------------------------------------------------------------------
extern "C" __global__ void log_softmax_expected_q(const float* __restrict__ logits,
                                                  const float* __restrict__ z,
                                                  float* __restrict__ logp,
                                                  float* __restrict__ q,
                                                  int rows, int q_rows, int num_atoms) {
    const int lane = threadIdx.x % kWarp;
    const int warp_stride = gridDim.x * (blockDim.x / kWarp);
    for (int row = first_warp_row(); row < rows; row += warp_stride) {
        const bool with_q = row < q_rows;
        const float value = log_softmax_row(logits + row * num_atoms, logp + row * num_atoms, z,
                                            with_q, num_atoms, lane);
        if (with_q && lane == 0) {
            q[row] = value;
        }
    }
}

// --------------------------------------------------------------------------------------------
// Double-DQN action choice: a*[b] = argmax_a q[b, a], lowest index on ties; scan in action
// order, replacing the incumbent when q[a] > best or the incumbent is NaN and q[a] is not
// (NaN never wins; an all-NaN row selects 0). One thread per sample (grid-stride). Exact.
// --------------------------------------------------------------------------------------------
extern "C" __global__ void double_dqn_select(const float* __restrict__ q,
                                             int* __restrict__ best_action,
                                             int batch, int num_actions) {
    const int stride = gridDim.x * blockDim.x;
    for (int b = blockIdx.x * blockDim.x + threadIdx.x; b < batch; b += stride) {
        best_action[b] = double_dqn_argmax(q + b * num_actions, num_actions);
    }
}


// --------------------------------------------------------------------------------------------
// C51 projection, dense triangular form:
//   g = gamma_b * (1 - done_b), gamma_b = effective_gamma(gamma[0], discount, b, gamma_ref,
//   n_step_on) (n-step transitions; gamma[0] itself when n_step_on == 0: discount not read);
//   Tz_j = clip(r_b + g * z_j, v_min, v_max)  (NaN kept);
//   m[b, i] = sum_j p_next[b, j] * clip(1 - |Tz_j - z_i| / dz, 0, 1)    (NaN kept),
// every operation rounded to float32 in that order (__fmul_rn/__fadd_rn: never fused), the sum
// over j in source order starting from +0.0 (as NumPy's reduction; bitwise equal to it).
// One block per sample (grid-stride over samples); thread i owns target atom i (looping when
// NA > blockDim); Tz_j and p_j are staged in shared memory, one tile of blockDim atoms at a time
// (c51_project_sample). With one tile (NA <= blockDim) and a windowed sample (finite inputs,
// Tz nondecreasing in j, dz > 0 finite), thread i adds only the terms with |Tz_j - z_i| < dz:
// every other term is p_j * (+0.0), an exact no-op on the sum, so m is bitwise the full sum.
// blockDim.x must be at most kProjectMaxThreads.
// --------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(kProjectMaxThreads)
c51_project(const float* __restrict__ p_next, const float* __restrict__ r,
            const float* __restrict__ done, const float* __restrict__ gamma,
            const float* __restrict__ z, const float* __restrict__ discount,
            float* __restrict__ m, int batch, int num_atoms, float v_min, float v_max, float dz,
            float gamma_ref, int n_step_on) {
    __shared__ float tile_target[kProjectMaxThreads];
    __shared__ float tile_p[kProjectMaxThreads];
    for (int b = blockIdx.x; b < batch; b += gridDim.x) {
        const float gamma_b = effective_gamma(gamma[0], discount, b, gamma_ref, n_step_on);
        const float step_discount = __fmul_rn(gamma_b, __fsub_rn(1.0f, done[b]));
        c51_project_sample(p_next + b * num_atoms, r[b], step_discount, z, m + b * num_atoms,
                           nullptr, 0.0f, nullptr, num_atoms, v_min, v_max, dz, tile_target,
                           tile_p);
    }
}

// --------------------------------------------------------------------------------------------
// c51_project then c51_grad on its m, in one launch:
//   m[b, :] = c51_project(p_next, r, done, gamma, z, discount, gamma_ref, n_step_on)[b, :];
//   dlogits[b, a_b, j] = (isw[b] * scale) * (exp(logp[b, a_b, j]) - m[b, j]); +0.0 elsewhere.
// One block per sample (grid-stride over samples), as c51_project (same plan, same body:
// c51_project_sample). The block first writes the +0.0 rows of the actions not taken (c51_grad
// writes every element of a sample whose action is out of [0, A) as +0.0: so does this), then
// projects; thread i writes m[b, i] and the taken row's element i from its own register, so no
// block-wide barrier or re-read of m is needed between the two. Bitwise equal to c51_project
// followed by c51_grad. blockDim.x must be at most kProjectMaxThreads.
// --------------------------------------------------------------------------------------------
// The body of c51_project_grad and c51_project_grad_live (one block's samples), with the
// support's clip range and spacing given as values.
static __device__ __forceinline__ void c51_project_grad_body(
    const float* __restrict__ p_next, const float* __restrict__ r,
    const float* __restrict__ done, const float* __restrict__ gamma,
    const float* __restrict__ z, const float* __restrict__ logp,
    const int* __restrict__ actions, const float* __restrict__ isw,
    const float* __restrict__ scale, const float* __restrict__ discount,
    float* __restrict__ m, float* __restrict__ dlogits, int batch, int num_actions,
    int num_atoms, float v_min, float v_max, float dz, float gamma_ref, int n_step_on,
    float* tile_target, float* tile_p) {
    const int row_len = num_actions * num_atoms;
    for (int b = blockIdx.x; b < batch; b += gridDim.x) {
        const int action = actions[b];
        const bool taken = action >= 0 && action < num_actions;
        const int taken_lo = taken ? action * num_atoms : row_len;  // the taken row's elements
        const int taken_hi = taken ? taken_lo + num_atoms : row_len;
        float* sample_dlogits = dlogits + b * row_len;
        for (int k = threadIdx.x; k < row_len; k += blockDim.x) {
            if (k < taken_lo || k >= taken_hi) {
                sample_dlogits[k] = 0.0f;
            }
        }
        const float gamma_b = effective_gamma(gamma[0], discount, b, gamma_ref, n_step_on);
        const float step_discount = __fmul_rn(gamma_b, __fsub_rn(1.0f, done[b]));
        const float grad_weight = isw[b] * scale[0];
        c51_project_sample(p_next + b * num_atoms, r[b], step_discount, z, m + b * num_atoms,
                           logp + b * row_len + taken_lo, grad_weight,
                           taken ? sample_dlogits + taken_lo : nullptr, num_atoms, v_min, v_max,
                           dz, tile_target, tile_p);
    }
}

extern "C" __global__ void __launch_bounds__(kProjectMaxThreads)
c51_project_grad(const float* __restrict__ p_next, const float* __restrict__ r,
                 const float* __restrict__ done, const float* __restrict__ gamma,
                 const float* __restrict__ z, const float* __restrict__ logp,
                 const int* __restrict__ actions, const float* __restrict__ isw,
                 const float* __restrict__ scale, const float* __restrict__ discount,
                 float* __restrict__ m, float* __restrict__ dlogits, int batch, int num_actions,
                 int num_atoms, float v_min, float v_max, float dz, float gamma_ref,
                 int n_step_on) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    __shared__ float tile_target[kProjectMaxThreads];
    __shared__ float tile_p[kProjectMaxThreads];
    c51_project_grad_body(p_next, r, done, gamma, z, logp, actions, isw, scale, discount, m,
                          dlogits, batch, num_actions, num_atoms, v_min, v_max, dz, gamma_ref,
                          n_step_on, tile_target, tile_p);
}

// --------------------------------------------------------------------------------------------
// c51_project_grad on a live support (DQNConfig.adaptive_atoms): the same body, with the clip
// range and spacing read from bounds = (v_min, v_max, dz), three device floats (one branch's
// row of live_support_build's bounds), and z that branch's row of its z. Bitwise equal to
// c51_project_grad with those values.
// --------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(kProjectMaxThreads)
c51_project_grad_live(const float* __restrict__ p_next, const float* __restrict__ r,
                      const float* __restrict__ done, const float* __restrict__ gamma,
                      const float* __restrict__ z, const float* __restrict__ bounds,
                      const float* __restrict__ logp, const int* __restrict__ actions,
                      const float* __restrict__ isw, const float* __restrict__ scale,
                      const float* __restrict__ discount, float* __restrict__ m,
                      float* __restrict__ dlogits, int batch, int num_actions, int num_atoms,
                      float gamma_ref, int n_step_on) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    __shared__ float tile_target[kProjectMaxThreads];
    __shared__ float tile_p[kProjectMaxThreads];
    c51_project_grad_body(p_next, r, done, gamma, z, logp, actions, isw, scale, discount, m,
                          dlogits, batch, num_actions, num_atoms, bounds[0], bounds[1],
                          bounds[2], gamma_ref, n_step_on, tile_target, tile_p);
}

// --------------------------------------------------------------------------------------------
// The live per-branch support (DQNConfig.adaptive_atoms; foxhunt/reference/kernels/
// live_support.py states the formula, the Mech 2 bound and the floor). Branch d = blockIdx.x
// reads the seed member members[d] of its centre / half-width slots:
//   bound = atom_growth_mult * fmaxf(isv[q_abs_ref_slot], 1); floor = bound * 2^-10;
//   h = fminf(fmaxf(isv[half_base + m], floor), bound); room = bound - h;
//   c = isv[centre_base + m] (NaN -> 0), fminf(fmaxf(c, -room), room);
//   z[d, j] = c + h * t_j, t_j = (2 j - (NA - 1)) / (NA - 1);
//   bounds[d] = (z[d, 0], z[d, NA-1], (z[d, NA-1] - z[d, 0]) / (NA - 1)).
// Every thread computes the scalars (a few flops); thread i writes atoms i, i + blockDim, ...;
// thread 0 writes the bounds from the end atoms' own formula (t = -1 and 1 exactly).
// --------------------------------------------------------------------------------------------
extern "C" __global__ void live_support_build(const float* __restrict__ isv,
                                              const int* __restrict__ members,
                                              float* __restrict__ z, float* __restrict__ bounds,
                                              int n_branches, int num_atoms, int q_abs_ref_slot,
                                              int centre_base, int half_base,
                                              float atom_growth_mult) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    const int d = blockIdx.x;
    if (d >= n_branches) {
        return;
    }
    const int member = members[d];
    const float bound = __fmul_rn(atom_growth_mult, fmaxf(isv[q_abs_ref_slot], 1.0f));
    const float floor_h = __fmul_rn(bound, 0.0009765625f);  // 2^-10
    const float half = fminf(fmaxf(isv[half_base + member], floor_h), bound);
    const float room = __fsub_rn(bound, half);
    float centre = isv[centre_base + member];
    centre = isnan(centre) ? 0.0f : centre;
    centre = fminf(fmaxf(centre, -room), room);
    const float span = (float)(num_atoms - 1);
    for (int j = threadIdx.x; j < num_atoms; j += blockDim.x) {
        const float t = __fdiv_rn((float)(2 * j - (num_atoms - 1)), span);
        z[d * num_atoms + j] = __fadd_rn(centre, __fmul_rn(half, t));
    }
    if (threadIdx.x == 0) {
        const float lo = __fadd_rn(centre, __fmul_rn(half, -1.0f));
        const float hi = __fadd_rn(centre, __fmul_rn(half, 1.0f));
        bounds[3 * d] = lo;
        bounds[3 * d + 1] = hi;
        bounds[3 * d + 2] = __fdiv_rn(__fsub_rn(hi, lo), span);
    }
}

// --------------------------------------------------------------------------------------------
// C51 loss at the taken actions: ce[b] = -sum_j m[b, j] * logp[b, a_b, j];
// total = scale * sum_b (isw[b] * ce[b]).
// ONE block (grid = 1): warp w takes samples in groups of kLossGroup (w * kLossGroup + k *
// warps * kLossGroup + g), each sample's atoms as a per-lane sum plus the warp butterfly; lane 0
// accumulates isw * ce over its samples in that order; the block then sums the per-warp
// partials with one more butterfly (missing warps count +0.0). The order is fixed by blockDim,
// so the total is deterministic.
// --------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(kLossMaxThreads)
c51_loss(const float* __restrict__ logp, const int* __restrict__ actions,
         const float* __restrict__ m, const float* __restrict__ isw,
         const float* __restrict__ scale, float* __restrict__ ce, float* __restrict__ total,
         int batch, int num_actions, int num_atoms) {
    __shared__ float warp_partial[kLossMaxThreads / kWarp];
    if (blockIdx.x != 0) {
        return;  // launched with grid = 1; any other block would race on `total`
    }
    c51_loss_body(logp, actions, m, isw, scale, ce, total, batch, num_actions, num_atoms,
                  warp_partial);
}

// --------------------------------------------------------------------------------------------
// C51 gradient w.r.t. the logits: dlogits[b, a_b, j] = (isw[b] * scale) * (exp(logp[b, a_b, j])
// - m[b, j]); exactly +0.0 at every other action. One thread per element (grid-stride).
// --------------------------------------------------------------------------------------------
extern "C" __global__ void c51_grad(const float* __restrict__ logp,
                                    const int* __restrict__ actions,
                                    const float* __restrict__ m,
                                    const float* __restrict__ isw,
                                    const float* __restrict__ scale,
                                    float* __restrict__ dlogits,
                                    int batch, int num_actions, int num_atoms) {
    const int n = batch * num_actions * num_atoms;
    const int stride = gridDim.x * blockDim.x;
    const float s = scale[0];
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += stride) {
        const int row = e / num_atoms;
        const int j = e - row * num_atoms;
        const int b = row / num_actions;
        const int a = row - b * num_actions;
        float grad = 0.0f;
        if (a == actions[b]) {
            const float weight = isw[b] * s;
            grad = weight * (expf(logp[e]) - m[b * num_atoms + j]);
        }
        dlogits[e] = grad;
    }
}

// --------------------------------------------------------------------------------------------
// CQL penalty per sample and its logit gradient, one branch:
//   Q = expected_q(logp, z); mQ_b = max_a Q (NaN wins); e = exp(Q - mQ); s_b = sum_a e (action
//   order); terms_b = (mQ_b + log s_b) - Q[b, a_b];
//   dQ[b, a] = (alpha * scale) * (e[b, a] / s_b - 1[a = a_b]);
//   dlogits[b, a, j] = dQ[b, a] * (exp(logp[b, a, j]) * (z_j - Q[b, a])).
// One warp per sample (grid-stride over the batch; cql_logit_grad_body): the Q of its A rows
// into the warp's row of shared memory, the action-order max/sum in every lane, terms, then its
// rows' dlogits (coalesced); no block barrier. Dynamic shared memory: (blockDim / 32) * A
// floats (the plan's formula; fast/kernels/distributional.py).
// --------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(kCqlMaxWarps * kWarp)
cql_logit_grad(const float* __restrict__ logp, const int* __restrict__ actions,
               const float* __restrict__ z, const float* __restrict__ alpha,
               const float* __restrict__ scale, float* __restrict__ dlogits,
               float* __restrict__ terms, int batch, int num_actions, int num_atoms) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    extern __shared__ float cql_shared[];
    cql_logit_grad_body(logp, actions, z, alpha, scale, dlogits, terms, batch, num_actions,
                        num_atoms, cql_shared);
}
