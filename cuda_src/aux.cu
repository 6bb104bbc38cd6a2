// The auxiliary heads' kernels (SPEC 4, second wave), twins of foxhunt.reference.kernels.aux
// under the same names: the ELU hidden layer (add_bias_elu) and its backward (elu_backward), the
// next-bar regression's loss and gradient (aux_next_bar_loss_grad), the regime cross-entropy and
// its gradient (aux_regime_loss_grad), and the ISV 117 label-scale producer
// (isv_label_scale_update). The GEMMs between them are cuBLAS calls (foxhunt.fast.gemm).
//
// Arithmetic: -fmad=false (fast/_build.py) plus __fadd_rn/__fmul_rn/__fdiv_rn where the order
// matters, in the reference's order; expm1f/expf/logf against NumPy's float32 functions (a few
// ulp). The loss kernels are ONE block (their loss is a block_sum of reduce.cuh: a fixed tree,
// no atomics); the elementwise kernels are grid-stride loops.

#include "early_launch.cuh"  // fh_early_wait, fh_early_release
#include "reduce.cuh"   // block_sum (float and long long), REDUCE_SUM_IDENTITY
#include "isv_ema.cuh"  // hb_guarded_ema, hb_adaptive_rate

#define AUX_F32_EXP_MASK 0x7f800000u
#define AUX_NEG_INF __uint_as_float(0xff800000u)  // the identity of the fmaxf row max
#define AUX_QUIET_NAN __uint_as_float(0x7fffffffu)

#define AUX_FLAT_LOOP(i, n)                                                                \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n);          \
         i += (long long)gridDim.x * blockDim.x)

// One block's threads over the samples 0..batch (the one-block loss kernels).
#define AUX_SAMPLE_LOOP(b, batch) for (int b = threadIdx.x; b < (batch); b += blockDim.x)

static __device__ __forceinline__ bool aux_is_finite(float x) {
    return (__float_as_uint(x) & AUX_F32_EXP_MASK) != AUX_F32_EXP_MASK;
}

// The ELU (alpha = 1) of a pre-activation: t > 0 ? t : expm1f(t) (NaN fails t > 0 and stays NaN).
static __device__ __forceinline__ float aux_elu(float t) { return (t > 0.0f) ? t : expm1f(t); }

// ---------------------------------------------------------------------------------------------
// add_bias_elu: out[i, n] = elu(y[i, n] + b[n]); y, out [rows, cols] (out may alias y), b [cols].
// Grid as add_bias_relu's (dense.cu): x covers columns, y strides rows.
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void add_bias_elu(const float* y, const float* __restrict__ b, float* out,
                                        int rows, int cols) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= cols) {
        return;
    }
    const float bias = b[col];
    for (int row = blockIdx.y; row < rows; row += gridDim.y) {
        const long long i = (long long)row * cols + col;
        out[i] = aux_elu(__fadd_rn(y[i], bias));
    }
}

// ---------------------------------------------------------------------------------------------
// elu_backward from the ELU's output h: dx = h > 0 ? dy : dy * (h + 1) (flat, n elements; dx may
// alias dy). A NaN h makes dx NaN.
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void elu_backward(const float* dy, const float* __restrict__ h, float* dx,
                                        long long n) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    AUX_FLAT_LOOP(i, n) {
        const float hv = h[i];
        const float g = dy[i];
        dx[i] = (hv > 0.0f) ? g : __fmul_rn(g, __fadd_rn(hv, 1.0f));
    }
}

// ---------------------------------------------------------------------------------------------
// aux_next_bar_loss_grad, ONE block. With denom = fmaxf(isv[label_scale_index], scale_floor):
//   label_b = next_ret_b / denom; valid_b = isfinite(label_b); n = count(valid)
//   diff_b = pred_b - label_b
//   *loss = (sum_valid diff_b * diff_b) / n            (0 when n == 0)
//   d_pred_b = valid_b ? diff_b * ((2 * weight) / n) : 0       (the weighted loss's gradient)
// Each thread strides the samples twice (the count first, then the gradient), so d_pred needs
// no scratch; label and diff are recomputed identically in the second pass.
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(REDUCE_MAX_THREADS)
aux_next_bar_loss_grad(const float* __restrict__ pred, const float* __restrict__ next_ret,
                       const float* __restrict__ isv, float* __restrict__ d_pred,
                       float* __restrict__ loss, int batch, int label_scale_index,
                       float scale_floor, float weight) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    __shared__ float scratch[REDUCE_WARP + 1];
    __shared__ long long count_scratch[REDUCE_WARP + 1];
    const float denom = fmaxf(isv[label_scale_index], scale_floor);
    float acc = REDUCE_SUM_IDENTITY;
    long long count = 0;
    AUX_SAMPLE_LOOP(b, batch) {
        const float label = __fdiv_rn(next_ret[b], denom);
        if (aux_is_finite(label)) {
            const float diff = __fsub_rn(pred[b], label);
            acc = __fadd_rn(acc, __fmul_rn(diff, diff));
            ++count;
        }
    }
    const float total = block_sum(acc, scratch);
    const long long n = block_sum(count, count_scratch);
    const float n_f = __ll2float_rn(n);
    const float coef = n > 0 ? __fdiv_rn(__fmul_rn(2.0f, weight), n_f) : 0.0f;
    AUX_SAMPLE_LOOP(b, batch) {
        const float label = __fdiv_rn(next_ret[b], denom);
        d_pred[b] = aux_is_finite(label) ? __fmul_rn(__fsub_rn(pred[b], label), coef) : 0.0f;
    }
    if (threadIdx.x == 0) {
        *loss = n > 0 ? __fdiv_rn(__fadd_rn(total, 0.0f), n_f) : 0.0f;  // +0.0, never -0.0
    }
}

// ---------------------------------------------------------------------------------------------
// aux_regime_loss_grad, ONE block, one thread per sample (logits [batch, n_regimes] row-major):
//   m = fmaxf over the row (from -Inf); s = ((0 + e_0) + e_1) + ..., e_r = expf(l_r - m)
//   ce_b = logf(s) - (l_y - m), y = regime[b];   *loss = (sum_b ce_b) / batch
//   d_logits[b, r] = (e_r / s - (r == y ? 1 : 0)) * (weight / batch)  (the weighted loss's)
// s >= 1 for a finite row (the max contributes expf(0) = 1): no epsilon. A label outside
// [0, n_regimes) (the reference rejects it) is never read: its ce is NaN.
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(REDUCE_MAX_THREADS)
aux_regime_loss_grad(const float* __restrict__ logits, const int* __restrict__ regime,
                     float* __restrict__ d_logits, float* __restrict__ loss, int batch,
                     int n_regimes, float weight) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    __shared__ float scratch[REDUCE_WARP + 1];
    const float coef = __fdiv_rn(weight, (float)batch);
    float acc = REDUCE_SUM_IDENTITY;
    AUX_SAMPLE_LOOP(b, batch) {
        const float* row = logits + (long long)b * n_regimes;
        float m = AUX_NEG_INF;
        for (int r = 0; r < n_regimes; ++r) {
            m = fmaxf(m, row[r]);
        }
        float s = 0.0f;
        for (int r = 0; r < n_regimes; ++r) {
            s = __fadd_rn(s, expf(__fsub_rn(row[r], m)));
        }
        const int y = regime[b];
        const float shifted_y = (y >= 0 && y < n_regimes) ? __fsub_rn(row[y], m)
                                                          : AUX_QUIET_NAN;
        acc = __fadd_rn(acc, __fsub_rn(logf(s), shifted_y));
        float* out = d_logits + (long long)b * n_regimes;
        for (int r = 0; r < n_regimes; ++r) {
            const float p = __fdiv_rn(expf(__fsub_rn(row[r], m)), s);
            out[r] = __fmul_rn(__fsub_rn(p, r == y ? 1.0f : 0.0f), coef);
        }
    }
    const float total = block_sum(acc, scratch);
    if (threadIdx.x == 0) {
        *loss = __fdiv_rn(__fadd_rn(total, 0.0f), (float)batch);
    }
}

// ---------------------------------------------------------------------------------------------
// isv_label_scale_update, ONE block: ISV 117 (AUX_LABEL_SCALE_EMA, index `slot`) from the batch's
// next-bar returns, in place on the ISV vector (every other slot keeps its bits):
//   rms = sqrtf(fmaxf(sum r_i^2 / count, 0)) over the finite r_i (count == 0: unchanged)
//   alpha = hb_adaptive_rate(*sharpe, alpha_base, ...)    (*sharpe: the bus's Sharpe slot)
//   new = (isfinite(rms) && !(old > 0)) ? rms : hb_guarded_ema(old, rms, alpha)
// (the first batch replaces the cold start 0; a NaN slot is re-seeded).
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(REDUCE_MAX_THREADS)
isv_label_scale_update(float* __restrict__ isv, int slot, const float* __restrict__ next_ret,
                       long long n, const float* __restrict__ sharpe, float alpha_base,
                       float sharpe_clamp, float sharpe_gain) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    __shared__ float scratch[REDUCE_WARP + 1];
    __shared__ long long count_scratch[REDUCE_WARP + 1];
    float acc = REDUCE_SUM_IDENTITY;
    long long count = 0;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) {
        const float r = next_ret[i];
        if (aux_is_finite(r)) {
            acc = __fadd_rn(acc, __fmul_rn(r, r));
            ++count;
        }
    }
    const float total = block_sum(acc, scratch);
    const long long finite = block_sum(count, count_scratch);
    if (threadIdx.x != 0 || finite == 0) {
        return;
    }
    const float rms = __fsqrt_rn(fmaxf(__fdiv_rn(total, __ll2float_rn(finite)), 0.0f));
    const float old = isv[slot];
    const float alpha = hb_adaptive_rate(*sharpe, alpha_base, sharpe_clamp, sharpe_gain);
    isv[slot] = (aux_is_finite(rms) && !(old > 0.0f)) ? rms : hb_guarded_ema(old, rms, alpha);
}
