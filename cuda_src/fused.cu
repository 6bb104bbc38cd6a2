// Fused kernels: one launch over every action branch (blockIdx.y = branch d), each the per-branch
// kernel of distributional.cu applied to branch d's block of a branch-packed buffer.
//
// The specification is foxhunt/reference/kernels/fused.py (the composition of the per-branch
// reference kernels): same formulas, operation order and NaN/Inf contracts as the per-branch
// kernels (bitwise equal to them on the same inputs: the bodies below are theirs, with the
// branch's pointers and sizes taken from the tables).
//
// Branch-packed layout: branch d's [R, n_d, NA] block starts at row R * action_offset[d] of a
// [R * A_total, NA] buffer (n_actions[d] = n_d; tables are int32 device arrays of D entries).
// gridDim.y = D. Parameters: inputs (tables among them), outputs, sizes. Built with
// -fmad=false; no atomics; 32-bit index arithmetic (the launchers bound the sizes).

namespace {

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kCqlMaxWarps = 8;

}  // namespace

static __device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset >>= 1) {
        x = x + __shfl_xor_sync(kFullMask, x, offset);
    }
    return x;
}

// np.max's pairwise step: NaN wins (either operand).
static __device__ __forceinline__ float max_keep_nan(float best, float x) {
    if (isnan(best)) {
        return best;
    }
    return (isnan(x) || x > best) ? x : best;
}

// sum_j exp(logp_row[j]) * z[j] by one warp (as distributional.cu's warp_expected_q).
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
// dueling_combine per branch: logits_d[b, a, j] = v[b, j] + (adv_d[b, a, j] - mean_a adv_d[b, :, j]).
// v [B, NA] is shared; adv and logits are branch-packed with R = B. One thread per (b, j) cell.
// --------------------------------------------------------------------------------------------
extern "C" __global__ void dueling_combine_branches(const float* __restrict__ v,
                                                    const float* __restrict__ adv,
                                                    const int* __restrict__ n_actions,
                                                    const int* __restrict__ action_offset,
                                                    float* __restrict__ logits,
                                                    int batch, int num_atoms) {
    const int d = blockIdx.y;
    const int num_actions = n_actions[d];
    const int block_start = batch * action_offset[d] * num_atoms;
    const float* a_d = adv + block_start;
    float* out_d = logits + block_start;
    const int cells = batch * num_atoms;
    const int stride = gridDim.x * blockDim.x;
    for (int cell = blockIdx.x * blockDim.x + threadIdx.x; cell < cells; cell += stride) {
        const int b = cell / num_atoms;
        const int j = cell - b * num_atoms;
        const int base = b * num_actions * num_atoms + j;
        float sum = a_d[base];
        for (int a = 1; a < num_actions; ++a) {
            sum = sum + a_d[base + a * num_atoms];
        }
        const float mean = sum / static_cast<float>(num_actions);
        const float value = v[cell];
        for (int a = 0; a < num_actions; ++a) {
            const int k = base + a * num_atoms;
            out_d[k] = value + (a_d[k] - mean);
        }
    }
}

// --------------------------------------------------------------------------------------------
// dueling_combine_backward per branch: dv[d, b, j] = sum_a dlogits_d[b, a, j] (action order);
// dadv_d = dlogits_d - dv[d] / n_d. dlogits and dadv branch-packed (R = B), dv [D, B, NA].
// --------------------------------------------------------------------------------------------
extern "C" __global__ void dueling_combine_backward_branches(const float* __restrict__ dlogits,
                                                             const int* __restrict__ n_actions,
                                                             const int* __restrict__ action_offset,
                                                             float* __restrict__ dv,
                                                             float* __restrict__ dadv,
                                                             int batch, int num_atoms) {
    const int d = blockIdx.y;
    const int num_actions = n_actions[d];
    const int block_start = batch * action_offset[d] * num_atoms;
    const float* dl_d = dlogits + block_start;
    float* dadv_d = dadv + block_start;
    float* dv_d = dv + d * batch * num_atoms;
    const int cells = batch * num_atoms;
    const int stride = gridDim.x * blockDim.x;
    for (int cell = blockIdx.x * blockDim.x + threadIdx.x; cell < cells; cell += stride) {
        const int b = cell / num_atoms;
        const int j = cell - b * num_atoms;
        const int base = b * num_actions * num_atoms + j;
        float sum = dl_d[base];
        for (int a = 1; a < num_actions; ++a) {
            sum = sum + dl_d[base + a * num_atoms];
        }
        dv_d[cell] = sum;
        const float mean = sum / static_cast<float>(num_actions);
        for (int a = 0; a < num_actions; ++a) {
            const int k = base + a * num_atoms;
            dadv_d[k] = dl_d[k] - mean;
        }
    }
}

// --------------------------------------------------------------------------------------------
// cql_logit_grad per branch on samples 0..B of branch d's block of logp (R = block_rows >= B
// samples per block): dlogits (branch-packed, R = B) and terms [D, B]. The body is
// distributional.cu's cql_logit_grad (tiles of S_d = max(1, warps / n_d) samples, one warp per
// (sample, action) row); its results do not depend on blockDim, so one block size serves every
// branch. Dynamic shared memory: max over branches of (2 * S_d * n_d + 2 * S_d) floats.
// --------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(kCqlMaxWarps * kWarp)
cql_logit_grad_branches(const float* __restrict__ logp, const int* __restrict__ actions,
                        const float* __restrict__ z, const float* __restrict__ alpha,
                        const float* __restrict__ scale, const int* __restrict__ n_actions,
                        const int* __restrict__ action_offset, float* __restrict__ dlogits,
                        float* __restrict__ terms, int batch, int block_rows, int num_atoms) {
    extern __shared__ float cql_shared[];
    const int d = blockIdx.y;
    const int num_actions = n_actions[d];
    const float* logp_d = logp + block_rows * action_offset[d] * num_atoms;
    float* dlogits_d = dlogits + batch * action_offset[d] * num_atoms;
    const int* actions_d = actions + d * batch;
    float* terms_d = terms + d * batch;
    const int lane = threadIdx.x % kWarp;
    const int warp = threadIdx.x / kWarp;
    const int warps = blockDim.x / kWarp;
    const int tile_samples = max(1, warps / num_actions);
    float* q_tile = cql_shared;                              // [S * A]
    float* e_tile = q_tile + tile_samples * num_actions;     // [S * A]
    float* qmax_tile = e_tile + tile_samples * num_actions;  // [S]
    float* sum_tile = qmax_tile + tile_samples;              // [S]
    const float dq_scale = alpha[0] * scale[0];
    const int row_len = num_actions * num_atoms;

    for (int b0 = blockIdx.x * tile_samples; b0 < batch; b0 += gridDim.x * tile_samples) {
        const int samples = min(tile_samples, batch - b0);
        const int rows = samples * num_actions;
        const float* tile_logp = logp_d + b0 * row_len;

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
            terms_d[b0 + s] = (q_max + logf(sum)) - q[actions_d[b0 + s]];
        }
        __syncthreads();

        float* tile_dlogits = dlogits_d + b0 * row_len;
        const int elements = rows * num_atoms;
        for (int k = threadIdx.x; k < elements; k += blockDim.x) {
            const int row = k / num_atoms;
            const int j = k - row * num_atoms;
            const int s = row / num_actions;
            const int a = row - s * num_actions;
            const float q = q_tile[row];
            const float one_hot = (a == actions_d[b0 + s]) ? 1.0f : 0.0f;
            const float dq = dq_scale * (e_tile[row] / sum_tile[s] - one_hot);
            tile_dlogits[k] = dq * (expf(tile_logp[k]) * (z[j] - q));
        }
        __syncthreads();  // the next tile overwrites the shared arrays
    }
}
