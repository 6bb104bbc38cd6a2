// dueling_log_softmax_q_branches' register path (cuda_src/fused.cu), shared with the fused
// heads' output kernel (cuda_src/trunk.cu heads_out_dueling_bf16), which runs it on rows it
// computed into shared memory: one warp, all n_d rows of one sample, the operations of
// dueling_combine then log_softmax_row (distributional.cuh), so both kernels give the same bits
// on the same v / adv values. Every helper is `static __device__ __forceinline__`: each
// translation unit gets its own copy.
#pragma once

#include "distributional.cuh"  // kWarp, warp_max_halving, warp_sum_halving, warp_store_row_sums

namespace {
// A branch of at most kDuelingRegRows actions with at most kWarp * kDuelingRegChunks atoms (the
// seed's (3, 3, 2) x 51) keeps a sample's rows in registers (lane l: atoms l + 32 c, c <
// kDuelingRegChunks).
constexpr int kDuelingRegRows = 4;
constexpr int kDuelingRegChunks = 2;
}  // namespace

// The register path: all kRows (= n_d, 1 <= kRows <= kDuelingRegRows) rows of one sample by one
// warp (all 32 lanes), num_atoms <= kWarp * kDuelingRegChunks. Lane l owns atoms j = l + 32 c
// (c < kDuelingRegChunks, those below num_atoms) of every row. Every adv and v value of the
// sample is loaded up front (one round trip: the loads are independent), then the operations of
// the shared-memory path run on the registers in its order: the cell mean of atom j is
// dueling_mean's (x[0] + x[1] + ... in action order, / n_d as a float), each value
// v_j + (adv - mean) (written to logits), then per row log_softmax_row's (the max from -Inf over
// the lane's atoms in j order, warp_max_halving; the exp sum from +0.0, warp_sum_halving, logf;
// logp = (value - m) - log_sum; Q's terms expf(logp) * z_j from +0.0, warp_sum_halving), the
// rows' instructions interleaved. The values are those the other path stages in (and reads back
// from) shared memory, so every output is bitwise the same. z_lane holds z[j] of the lane's atoms
// (read once per warp; unused without with_q).
template <int kRows>
static __device__ __forceinline__ void dueling_sample_regs(
    const float* __restrict__ v_b, const float* __restrict__ adv_b,
    const float (&z_lane)[kDuelingRegChunks], float* __restrict__ logits_b,
    float* __restrict__ logp_b, float* __restrict__ q_b, bool with_q, int num_atoms, int lane) {
    constexpr int kC = kDuelingRegChunks;
    float x[kRows][kC];
    float v_j[kC];
#pragma unroll
    for (int c = 0; c < kC; ++c) {
        const int j = lane + c * kWarp;
        v_j[c] = 0.0f;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            x[r][c] = 0.0f;
        }
        if (j < num_atoms) {
            v_j[c] = v_b[j];
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
                x[r][c] = adv_b[r * num_atoms + j];
            }
        }
    }
    // dueling_combine: the cell means, then the values (in place), written to logits.
#pragma unroll
    for (int c = 0; c < kC; ++c) {
        const int j = lane + c * kWarp;
        if (j < num_atoms) {
            float sum = x[0][c];
#pragma unroll
            for (int r = 1; r < kRows; ++r) {
                sum = sum + x[r][c];
            }
            const float mean = sum / static_cast<float>(kRows);
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
                x[r][c] = v_j[c] + (x[r][c] - mean);
                logits_b[r * num_atoms + j] = x[r][c];
            }
        }
    }
    // log_softmax_row per row. An atom past num_atoms (x = 0.0f, finite) leaves the lane's
    // max and sums as they are (selects, not branches: its terms are computed and dropped).
    float m[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        m[r] = negative_infinity();
#pragma unroll
        for (int c = 0; c < kC; ++c) {
            const bool own = lane + c * kWarp < num_atoms;
            m[r] = own ? fmaxf(m[r], x[r][c]) : m[r];
        }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        m[r] = warp_max_halving(m[r]);
    }
    float log_sum[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        float sum = 0.0f;
#pragma unroll
        for (int c = 0; c < kC; ++c) {
            const bool own = lane + c * kWarp < num_atoms;
            const float term = expf(x[r][c] - m[r]);
            sum = own ? sum + term : sum;
        }
        log_sum[r] = sum;
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        log_sum[r] = logf(warp_sum_halving(log_sum[r]));
    }
    float q[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        q[r] = 0.0f;
#pragma unroll
        for (int c = 0; c < kC; ++c) {
            const int j = lane + c * kWarp;
            const bool own = j < num_atoms;
            const float value = (x[r][c] - m[r]) - log_sum[r];
            if (own) {
                logp_b[r * num_atoms + j] = value;
            }
            if (with_q) {
                const float term = expf(value) * z_lane[c];
                q[r] = own ? q[r] + term : q[r];
            }
        }
    }
    if (with_q) {
        warp_store_row_sums<kRows>(q, q_b, lane);
    }
}

// z[j] of the lane's atoms j = lane + 32 c (c < kDuelingRegChunks) for dueling_sample_regs: 0 past
// num_atoms or without `want` (then z is not read).
static __device__ __forceinline__ void dueling_z_lane(float (&z_lane)[kDuelingRegChunks],
                                                      const float* __restrict__ z, bool want,
                                                      int num_atoms, int lane) {
#pragma unroll
    for (int c = 0; c < kDuelingRegChunks; ++c) {
        const int j = lane + c * kWarp;
        z_lane[c] = (want && j < num_atoms) ? z[j] : 0.0f;
    }
}

// dueling_sample_regs<n_d> for a branch's runtime n_d (1 <= n_d <= kDuelingRegRows: the callers
// take this path only then).
static __device__ __forceinline__ void dueling_sample_regs_n(
    int num_actions, const float* __restrict__ v_b, const float* __restrict__ adv_b,
    const float (&z_lane)[kDuelingRegChunks], float* __restrict__ logits_b,
    float* __restrict__ logp_b, float* __restrict__ q_b, bool with_q, int num_atoms, int lane) {
    switch (num_actions) {
        case 1:
            dueling_sample_regs<1>(v_b, adv_b, z_lane, logits_b, logp_b, q_b, with_q, num_atoms,
                                   lane);
            break;
        case 2:
            dueling_sample_regs<2>(v_b, adv_b, z_lane, logits_b, logp_b, q_b, with_q, num_atoms,
                                   lane);
            break;
        case 3:
            dueling_sample_regs<3>(v_b, adv_b, z_lane, logits_b, logp_b, q_b, with_q, num_atoms,
                                   lane);
            break;
        default:
            dueling_sample_regs<4>(v_b, adv_b, z_lane, logits_b, logp_b, q_b, with_q, num_atoms,
                                   lane);
            break;
    }
}
