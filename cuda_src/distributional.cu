// Distributional (C51) kernels: dueling combination and its backward, log-softmax over atoms,
// expected Q, double-DQN action choice, the dense triangular C51 projection, the C51 loss and
// gradient, and the CQL logit gradient (SPEC sections 3 and 4).
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

namespace {

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// c51_loss: one block; each warp reduces kLossGroup samples at once, so their loads are in
// flight together (the loads of one sample do not wait for the previous sample's shuffles).
constexpr int kLossGroup = 8;
constexpr int kLossMaxThreads = 1024;

// cql_logit_grad: at most this many warps per block (one warp per (sample, action) row).
constexpr int kCqlMaxWarps = 8;

// c51_project: source atoms are staged through shared memory in tiles of the block size.
constexpr int kProjectMaxThreads = 256;

}  // namespace

// Sum over the 32 lanes; every lane gets the same value (a + b == b + a in IEEE arithmetic, so
// the partner lanes of the butterfly compute identical sums).
static __device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset >>= 1) {
        x = x + __shfl_xor_sync(kFullMask, x, offset);
    }
    return x;
}

// fmaxf over the 32 lanes (skips NaN; log_softmax_atoms' contract allows it: a NaN entry still
// reaches the sum through expf(NaN - m)).
static __device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset >>= 1) {
        x = fmaxf(x, __shfl_xor_sync(kFullMask, x, offset));
    }
    return x;
}

static __device__ __forceinline__ float negative_infinity() {
    return __int_as_float(0xff800000);
}

// np.minimum(np.maximum(t, lo), hi): a NaN t stays NaN (a bare fminf(fmaxf()) would map it to lo).
static __device__ __forceinline__ float clip_keep_nan(float t, float lo, float hi) {
    return isnan(t) ? t : fminf(fmaxf(t, lo), hi);
}

// np.max's pairwise step: NaN wins (either operand).
static __device__ __forceinline__ float max_keep_nan(float best, float x) {
    if (isnan(best)) {
        return best;
    }
    return (isnan(x) || x > best) ? x : best;
}

// sum_j exp(logp_row[j]) * z[j] by one warp (all lanes get the result). Shared by expected_q and
// cql_logit_grad, so the CQL penalty sees exactly the Q that expected_q computes.
static __device__ __forceinline__ float warp_expected_q(const float* __restrict__ logp_row,
                                                        const float* __restrict__ z,
                                                        int num_atoms, int lane) {
    float acc = 0.0f;
    for (int j = lane; j < num_atoms; j += kWarp) {
        acc = acc + expf(logp_row[j]) * z[j];
    }
    return warp_sum(acc);
}

// --------------------------------------------------------------------------------------------
// Dueling combination: logits[b, a, j] = v[b, j] + (adv[b, a, j] - mean_a adv[b, :, j]).
// One thread per (b, j) cell (grid-stride); the mean is the action-order sum divided by A.
// --------------------------------------------------------------------------------------------
extern "C" __global__ void dueling_combine(const float* __restrict__ v,
                                           const float* __restrict__ adv,
                                           float* __restrict__ logits,
                                           int batch, int num_actions, int num_atoms) {
    const int cells = batch * num_atoms;
    const int stride = gridDim.x * blockDim.x;
    for (int cell = blockIdx.x * blockDim.x + threadIdx.x; cell < cells; cell += stride) {
        const int b = cell / num_atoms;
        const int j = cell - b * num_atoms;
        const int base = b * num_actions * num_atoms + j;
        float sum = adv[base];
        for (int a = 1; a < num_actions; ++a) {
            sum = sum + adv[base + a * num_atoms];
        }
        const float mean = sum / static_cast<float>(num_actions);
        const float value = v[cell];
        for (int a = 0; a < num_actions; ++a) {
            const int k = base + a * num_atoms;
            logits[k] = value + (adv[k] - mean);
        }
    }
}

// --------------------------------------------------------------------------------------------
// Backward of dueling_combine: dv[b, j] = sum_a dlogits[b, a, j] (action order);
// dadv[b, a, j] = dlogits[b, a, j] - dv[b, j] / A. One thread per (b, j) cell (grid-stride).
// --------------------------------------------------------------------------------------------
extern "C" __global__ void dueling_combine_backward(const float* __restrict__ dlogits,
                                                    float* __restrict__ dv,
                                                    float* __restrict__ dadv,
                                                    int batch, int num_actions, int num_atoms) {
    const int cells = batch * num_atoms;
    const int stride = gridDim.x * blockDim.x;
    for (int cell = blockIdx.x * blockDim.x + threadIdx.x; cell < cells; cell += stride) {
        const int b = cell / num_atoms;
        const int j = cell - b * num_atoms;
        const int base = b * num_actions * num_atoms + j;
        float sum = dlogits[base];
        for (int a = 1; a < num_actions; ++a) {
            sum = sum + dlogits[base + a * num_atoms];
        }
        dv[cell] = sum;
        const float mean = sum / static_cast<float>(num_actions);
        for (int a = 0; a < num_actions; ++a) {
            const int k = base + a * num_atoms;
            dadv[k] = dlogits[k] - mean;
        }
    }
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
    const int warps_per_block = blockDim.x / kWarp;
    const int warp_stride = gridDim.x * warps_per_block;
    for (int row = blockIdx.x * warps_per_block + threadIdx.x / kWarp; row < rows;
         row += warp_stride) {
        const float* x = logits + row * num_atoms;
        float m = negative_infinity();
        for (int j = lane; j < num_atoms; j += kWarp) {
            m = fmaxf(m, x[j]);
        }
        m = warp_max(m);
        float sum = 0.0f;
        for (int j = lane; j < num_atoms; j += kWarp) {
            sum = sum + expf(x[j] - m);
        }
        const float log_sum = logf(warp_sum(sum));
        float* out = logp + row * num_atoms;
        for (int j = lane; j < num_atoms; j += kWarp) {
            out[j] = (x[j] - m) - log_sum;
        }
    }
}

// --------------------------------------------------------------------------------------------
// Expected Q: q[r] = sum_j exp(logp[r, j]) * z[j] for every (b, a) row r. One warp per row.
// --------------------------------------------------------------------------------------------
extern "C" __global__ void expected_q(const float* __restrict__ logp,
                                      const float* __restrict__ z,
                                      float* __restrict__ q,
                                      int rows, int num_atoms) {
    const int lane = threadIdx.x % kWarp;
    const int warps_per_block = blockDim.x / kWarp;
    const int warp_stride = gridDim.x * warps_per_block;
    for (int row = blockIdx.x * warps_per_block + threadIdx.x / kWarp; row < rows;
         row += warp_stride) {
        const float value = warp_expected_q(logp + row * num_atoms, z, num_atoms, lane);
        if (lane == 0) {
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
        const float* row = q + b * num_actions;
        float best = row[0];
        int best_index = 0;
        for (int a = 1; a < num_actions; ++a) {
            const float candidate = row[a];
            if (candidate > best || (isnan(best) && !isnan(candidate))) {
                best = candidate;
                best_index = a;
            }
        }
        best_action[b] = best_index;
    }
}

// --------------------------------------------------------------------------------------------
// C51 projection, dense triangular form:
//   g = gamma * (1 - done_b); Tz_j = clip(r_b + g * z_j, v_min, v_max)  (NaN kept);
//   m[b, i] = sum_j p_next[b, j] * clip(1 - |Tz_j - z_i| / dz, 0, 1)    (NaN kept),
// every operation rounded to float32 in that order (__fmul_rn/__fadd_rn: never fused), the sum
// over j in source order starting from +0.0 (as NumPy's reduction; bitwise equal to it).
// One block per sample (grid-stride over samples); thread i owns target atom i (looping when
// NA > blockDim); Tz_j and p_j are staged in shared memory, one tile of blockDim atoms at a time.
// blockDim.x must be at most kProjectMaxThreads.
// --------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(kProjectMaxThreads)
c51_project(const float* __restrict__ p_next, const float* __restrict__ r,
            const float* __restrict__ done, const float* __restrict__ gamma,
            const float* __restrict__ z, float* __restrict__ m,
            int batch, int num_atoms, float v_min, float v_max, float dz) {
    __shared__ float tile_target[kProjectMaxThreads];
    __shared__ float tile_p[kProjectMaxThreads];
    const int tile = blockDim.x;
    for (int b = blockIdx.x; b < batch; b += gridDim.x) {
        const float discount = __fmul_rn(gamma[0], __fsub_rn(1.0f, done[b]));
        const float reward = r[b];
        const float* p = p_next + b * num_atoms;
        for (int i0 = 0; i0 < num_atoms; i0 += tile) {
            const int i = i0 + threadIdx.x;
            const float z_i = i < num_atoms ? z[i] : 0.0f;
            float acc = 0.0f;
            for (int j0 = 0; j0 < num_atoms; j0 += tile) {
                const int j = j0 + threadIdx.x;
                if (j < num_atoms) {
                    tile_target[threadIdx.x] =
                        clip_keep_nan(__fadd_rn(reward, __fmul_rn(discount, z[j])), v_min, v_max);
                    tile_p[threadIdx.x] = p[j];
                }
                __syncthreads();
                const int count = min(tile, num_atoms - j0);
                if (i < num_atoms) {
                    for (int k = 0; k < count; ++k) {
                        const float distance = fabsf(__fsub_rn(tile_target[k], z_i));
                        const float weight =
                            clip_keep_nan(__fsub_rn(1.0f, __fdiv_rn(distance, dz)), 0.0f, 1.0f);
                        acc = __fadd_rn(acc, __fmul_rn(tile_p[k], weight));
                    }
                }
                __syncthreads();  // the tile is overwritten next
            }
            if (i < num_atoms) {
                m[b * num_atoms + i] = acc;
            }
        }
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
    const int lane = threadIdx.x % kWarp;
    const int warp = threadIdx.x / kWarp;
    const int warps = blockDim.x / kWarp;
    float acc = 0.0f;
    for (int b0 = warp * kLossGroup; b0 < batch; b0 += warps * kLossGroup) {
        int row_offset[kLossGroup];
        float weight[kLossGroup];
        float sum[kLossGroup];
#pragma unroll
        for (int g = 0; g < kLossGroup; ++g) {
            const int b = b0 + g;
            const bool valid = b < batch;
            row_offset[g] = valid ? (b * num_actions + actions[b]) * num_atoms : 0;
            weight[g] = valid ? isw[b] : 0.0f;
            sum[g] = 0.0f;
        }
        for (int j = lane; j < num_atoms; j += kWarp) {
#pragma unroll
            for (int g = 0; g < kLossGroup; ++g) {
                const int b = b0 + g;
                if (b < batch) {
                    sum[g] = sum[g] + m[b * num_atoms + j] * logp[row_offset[g] + j];
                }
            }
        }
#pragma unroll
        for (int g = 0; g < kLossGroup; ++g) {
            sum[g] = warp_sum(sum[g]);
        }
#pragma unroll
        for (int g = 0; g < kLossGroup; ++g) {
            const int b = b0 + g;
            if (b < batch) {
                const float ce_b = -sum[g];
                if (lane == 0) {
                    ce[b] = ce_b;
                }
                acc = acc + weight[g] * ce_b;
            }
        }
    }
    if (lane == 0) {
        warp_partial[warp] = acc;
    }
    __syncthreads();
    if (warp == 0) {
        const float partial = lane < warps ? warp_partial[lane] : 0.0f;
        const float sum_all = warp_sum(partial);
        if (lane == 0) {
            total[0] = scale[0] * sum_all;
        }
    }
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
// Tiles of S = max(1, (blockDim / 32) / A) samples per block (grid-stride over tiles):
// phase 1, one warp per (sample, action) row computes Q into shared memory; phase 2, one thread
// per sample does the action-order max/sum and writes terms; phase 3, the tile's dlogits
// elements, flat and coalesced. Dynamic shared memory: (2 * S * A + 2 * S) floats (the plan's
// formula; fast/kernels/distributional.py).
// --------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(kCqlMaxWarps * kWarp)
cql_logit_grad(const float* __restrict__ logp, const int* __restrict__ actions,
               const float* __restrict__ z, const float* __restrict__ alpha,
               const float* __restrict__ scale, float* __restrict__ dlogits,
               float* __restrict__ terms, int batch, int num_actions, int num_atoms) {
    extern __shared__ float cql_shared[];
    const int lane = threadIdx.x % kWarp;
    const int warp = threadIdx.x / kWarp;
    const int warps = blockDim.x / kWarp;
    const int tile_samples = max(1, warps / num_actions);
    float* q_tile = cql_shared;                          // [S * A]
    float* e_tile = q_tile + tile_samples * num_actions;  // [S * A]
    float* qmax_tile = e_tile + tile_samples * num_actions;  // [S]
    float* sum_tile = qmax_tile + tile_samples;           // [S]
    const float dq_scale = alpha[0] * scale[0];
    const int row_len = num_actions * num_atoms;

    for (int b0 = blockIdx.x * tile_samples; b0 < batch; b0 += gridDim.x * tile_samples) {
        const int samples = min(tile_samples, batch - b0);
        const int rows = samples * num_actions;
        const float* tile_logp = logp + b0 * row_len;

        for (int row = warp; row < rows; row += warps) {
            const float q = warp_expected_q(tile_logp + row * num_atoms, z, num_atoms, lane);
            if (lane == 0) {
                q_tile[row] = q;
            }
        }
        __syncthreads();

        for (int s = threadIdx.x; s < samples; s += blockDim.x) {
            const float* q = q_tile + s * num_actions;
            float* e = e_tile + s * num_actions;
            float q_max = q[0];
            for (int a = 1; a < num_actions; ++a) {
                q_max = max_keep_nan(q_max, q[a]);
            }
            e[0] = expf(q[0] - q_max);
            float sum = e[0];
            for (int a = 1; a < num_actions; ++a) {
                e[a] = expf(q[a] - q_max);
                sum = sum + e[a];
            }
            qmax_tile[s] = q_max;
            sum_tile[s] = sum;
            terms[b0 + s] = (q_max + logf(sum)) - q[actions[b0 + s]];
        }
        __syncthreads();

        float* tile_dlogits = dlogits + b0 * row_len;
        const int elements = rows * num_atoms;
        for (int k = threadIdx.x; k < elements; k += blockDim.x) {
            const int row = k / num_atoms;
            const int j = k - row * num_atoms;
            const int s = row / num_actions;
            const int a = row - s * num_actions;
            const float q = q_tile[row];
            const float one_hot = (a == actions[b0 + s]) ? 1.0f : 0.0f;
            const float dq = dq_scale * (e_tile[row] / sum_tile[s] - one_hot);
            tile_dlogits[k] = dq * (expf(tile_logp[k]) * (z[j] - q));
        }
        __syncthreads();  // the next tile overwrites the shared arrays
    }
}
