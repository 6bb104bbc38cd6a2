// Dense-layer kernels (reference: foxhunt.reference.kernels.dense): bias+ReLU epilogues, the
// ReLU backward mask, bias-gradient column sums, and the BF16 / TF32 roundings the GEMMs see.
//
// Layouts are row-major [M, N] float32 (uint16 for BF16 bit patterns). Every elementwise kernel
// is one correctly rounded operation or a select/bit manipulation per element, so it matches the
// NumPy reference bit for bit (built with -fmad=false; no intrinsics). Same-typed outputs may
// alias their input (in-place epilogues on the GEMM output): those pairs take no __restrict__.
//
// ReLU NaN contract (shared by add_bias_relu, add_bias_relu_bf16 and relu_mask): the activation
// is the select `t <= 0 ? 0 : t`, so a NaN pre-activation stays NaN for the sentinels; the
// backward is the matching select `h <= 0 ? 0 : dy`. Never fmaxf(t, 0), which maps NaN to 0.

#include "early_launch.cuh"  // fh_early_wait, fh_early_release
#include "ha_common.cuh"
#include "bf16_bits.cuh"  // f32_to_bf16_bits, bf16_quad_bits (shared with optim.cu)
#include "flat.cuh"       // the vector paths' loop bounds and alignment tests
#include "tf32_mma.cuh"   // GEMM_TF32_WARPS, gemm_tf32_bits, gemm_tf32_mma, gemm_tf32_stage

#define DENSE_F32_QUIET_BIT 0x00400000u
// TF32 keeps 10 explicit mantissa bits: the low 13 bits are dropped (ties away from zero).
#define DENSE_TF32_HALF_ULP 0x00001000u
#define DENSE_TF32_KEEP_MASK 0xffffe000u

// Grid-stride loop over a flat range of n elements (n may exceed 2^31).
#define DENSE_FLAT_LOOP(i, n)                                                              \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n);          \
         i += (long long)gridDim.x * blockDim.x)

static __device__ __forceinline__ float relu_select(float t) { return (t <= 0.0f) ? 0.0f : t; }

// ------------------------------------------------------------------------------------------
// Bias + ReLU epilogues. Grid: x covers columns (blockDim.x threads each), y strides rows, so
// a block reads one contiguous row segment and the column index needs no division.
// ------------------------------------------------------------------------------------------

// out[i, n] = relu(y[i, n] + b[n]);  y, out [M, N], b [N].
extern "C" __global__ void add_bias_relu(const float* y, const float* __restrict__ b, float* out,
                                         int rows, int cols) {
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= cols) {
        return;
    }
    const float bias = b[col];
    for (int row = blockIdx.y; row < rows; row += gridDim.y) {
        const long long i = (long long)row * cols + col;
        out[i] = relu_select(y[i] + bias);
    }
}

// add_bias_relu plus its BF16 copy (uint16 bit patterns) for the next BF16 GEMM.
extern "C" __global__ void add_bias_relu_bf16(const float* y, const float* __restrict__ b,
                                              float* out,
                                              unsigned short* __restrict__ out_bf16, int rows,
                                              int cols) {
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= cols) {
        return;
    }
    const float bias = b[col];
    for (int row = blockIdx.y; row < rows; row += gridDim.y) {
        const long long i = (long long)row * cols + col;
        const float h = relu_select(y[i] + bias);
        out[i] = h;
        out_bf16[i] = f32_to_bf16_bits(h);
    }
}

// ReLU backward from the post-ReLU activation: dx = h <= 0 ? 0 : dy (flat, n elements).
extern "C" __global__ void relu_mask(const float* dy, const float* h, float* dx, long long n) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    DENSE_FLAT_LOOP(i, n) { dx[i] = (h[i] <= 0.0f) ? 0.0f : dy[i]; }
}

// ------------------------------------------------------------------------------------------
// Bias gradient: db[n] = sum_i dy[i, n], float32, deterministic, no atomics.
//
// Block (C, G): threadIdx.x picks one of C <= 32 consecutive columns (a warp reads 32 / C row
// segments of 4 C contiguous bytes), threadIdx.y one of G contiguous row chunks of ceil(M / G)
// rows. Each thread sums its chunk sequentially, top to bottom; thread y == 0 then adds the G chunk sums in chunk
// order. So the sum is ((chunk_0 + chunk_1) + chunk_2) + ..., each chunk summed row by row:
// the reference's own order (rows in sequence) whenever M <= G (one row per chunk), a
// reassociation otherwise (conformance: reduction tolerance). Empty chunks contribute -0.0,
// the exact additive identity (x + -0.0 == x for every x, -0.0 and NaN included).
// A column holding a NaN, an Inf or a value >= 2^90 in magnitude is summed again by thread
// y == 0 sequentially, row by row, as the reference does: its non-finite result (and value) is
// then the reference's exactly, whatever overflow the chunked order would have met
// (ha_common.cuh, HA_SUM_SAFE_MAGNITUDE). A slow path for poisoned gradients only.
// ------------------------------------------------------------------------------------------

#define BIAS_GRAD_COLS 32
#define BIAS_GRAD_MAX_CHUNKS 32

// The combination step of a bias-gradient column (shared by bias_grad_reduce and
// relu_mask_bias_grad, so both give the same bits): `sums[c * stride]` and
// `irregular[c * stride]` are the column's `chunks` chunk sums and flags (chunk order), `column`
// points at the column's row-0 element of the summed matrix (row stride `cols`; read only for an
// irregular column, so it must then hold the final values). Returns ((chunk_0 + chunk_1) + ...),
// or the row-by-row sum of `column` when any chunk met an irregular term, or +0.0 if rows == 0.
static __device__ __forceinline__ float bias_grad_finish(const float* sums, const int* irregular,
                                                         int stride, int chunks,
                                                         const float* column, int rows,
                                                         int cols) {
    bool column_irregular = false;
    float total = sums[0];
    for (int c = 0; c < chunks; ++c) {
        column_irregular |= irregular[c * stride] != 0;
    }
    if (column_irregular) {  // rows >= 1 here; the reference's order, row by row
        total = column[0];
        for (int row = 1; row < rows; ++row) {
            total = total + column[(long long)row * cols];
        }
    } else {
        for (int c = 1; c < chunks; ++c) {
            total = total + sums[c * stride];
        }
    }
    return (rows > 0) ? total : 0.0f;  // an empty sum is +0.0, as in NumPy
}

// bias_grad_reduce's launch: block (C, G), C = blockDim.x <= BIAS_GRAD_COLS columns (the plan
// narrows it to the columns there are: 8 columns take 8 lanes, not 32) and G = blockDim.y <=
// BIAS_GRAD_MAX_CHUNKS row chunks; grid x covers the columns. The bits depend on G only.
// Throughput: each thread loads BIAS_GRAD_BATCH rows of its chunk (independent loads in flight)
// before it adds them in row order, so a chunk of up to 16 rows (the seed's 256 rows in 16
// chunks) is one round trip to memory, not one per row; rows are reached by pointer steps.
// __launch_bounds__(.., 2): at most 32 registers (no spills), 4 blocks of 512 threads per SM.
#define BIAS_GRAD_BATCH 16

extern "C" __global__ void __launch_bounds__(BIAS_GRAD_COLS * BIAS_GRAD_MAX_CHUNKS, 2)
bias_grad_reduce(const float* __restrict__ dy, float* __restrict__ db, int rows, int cols) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    __shared__ float chunk_sums[BIAS_GRAD_MAX_CHUNKS][BIAS_GRAD_COLS + 1];  // +1: no bank conflicts
    __shared__ int chunk_irregular[BIAS_GRAD_MAX_CHUNKS][BIAS_GRAD_COLS + 1];
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    const int chunks = blockDim.y;
    const int chunk_rows = (rows + chunks - 1) / chunks;
    const int first = threadIdx.y * chunk_rows;
    const int last = min(first + chunk_rows, rows);
    float acc = -0.0f;
    bool irregular = false;
    if (col < cols && first < last) {
        const float* p = dy + (long long)first * cols + col;  // row `base`'s element, stepped
        for (int base = first; base < last; base += BIAS_GRAD_BATCH) {
            const int count = min(BIAS_GRAD_BATCH, last - base);
            float v[BIAS_GRAD_BATCH];
#pragma unroll
            for (int k = 0; k < BIAS_GRAD_BATCH; ++k) {
                if (k < count) {
                    v[k] = p[(long long)k * cols];
                }
            }
#pragma unroll
            for (int k = 0; k < BIAS_GRAD_BATCH; ++k) {  // row order: acc + row base, base + 1, ...
                if (k < count) {
                    irregular |= !ha_is_regular_term(v[k]);
                    acc = acc + v[k];
                }
            }
            p += (long long)BIAS_GRAD_BATCH * cols;
        }
    }
    chunk_sums[threadIdx.y][threadIdx.x] = acc;
    chunk_irregular[threadIdx.y][threadIdx.x] = irregular;
    __syncthreads();
    if (threadIdx.y == 0 && col < cols) {
        db[col] = bias_grad_finish(&chunk_sums[0][threadIdx.x], &chunk_irregular[0][threadIdx.x],
                                   BIAS_GRAD_COLS + 1, chunks, dy + col, rows, cols);
    }
}

// ------------------------------------------------------------------------------------------
// relu_mask fused with bias_grad_reduce: dx = h <= 0 ? 0 : dy, db[n] = sum_i dx[i, n].
//
// Same bits as relu_mask then bias_grad_reduce launched with the same blockDim.y (row chunks):
// the same chunking (ceil(M / G) rows per chunk, G = blockDim.y <= 32), each chunk summed row by
// row from -0.0, chunk sums combined in chunk order, the same irregular-column re-sum
// (bias_grad_finish). Only the column block is narrower: RMBG_COLS = 8 columns per block (a
// warp covers 4 chunks x one 32-byte row segment each), so cols = 128 / 256 give 16 / 32 blocks.
// Each thread loads RMBG_BATCH rows of dy and h before it stores any dx (independent loads in
// flight; for M = 256, G = 16 one batch covers the whole chunk).
//
// Aliasing: dx may be dy itself (in place: each element is read, then written, by one thread,
// and the irregular re-sum reads dx after the barrier); h and db must not overlap dx or dy.
// ------------------------------------------------------------------------------------------

#define RMBG_COLS 8
#define RMBG_BATCH 16

extern "C" __global__ void relu_mask_bias_grad(const float* dy, const float* __restrict__ h,
                                               float* dx, float* __restrict__ db, int rows,
                                               int cols) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    __shared__ float chunk_sums[BIAS_GRAD_MAX_CHUNKS][RMBG_COLS];  // row stride 8: a warp's
    __shared__ int chunk_irregular[BIAS_GRAD_MAX_CHUNKS][RMBG_COLS];  // 32 slots are distinct
    const int col = blockIdx.x * RMBG_COLS + threadIdx.x;
    const int chunks = blockDim.y;
    const int chunk_rows = (rows + chunks - 1) / chunks;
    const int first = threadIdx.y * chunk_rows;
    const int last = min(first + chunk_rows, rows);
    float acc = -0.0f;
    bool irregular = false;
    if (col < cols) {
        for (int base = first; base < last; base += RMBG_BATCH) {
            float d[RMBG_BATCH];
            float a[RMBG_BATCH];
#pragma unroll
            for (int j = 0; j < RMBG_BATCH; ++j) {
                if (base + j < last) {
                    const long long i = (long long)(base + j) * cols + col;
                    d[j] = dy[i];
                    a[j] = h[i];
                }
            }
#pragma unroll
            for (int j = 0; j < RMBG_BATCH; ++j) {
                if (base + j < last) {
                    const float v = (a[j] <= 0.0f) ? 0.0f : d[j];  // relu_mask's select
                    dx[(long long)(base + j) * cols + col] = v;
                    irregular |= !ha_is_regular_term(v);
                    acc = acc + v;
                }
            }
        }
    }
    chunk_sums[threadIdx.y][threadIdx.x] = acc;
    chunk_irregular[threadIdx.y][threadIdx.x] = irregular;
    __syncthreads();  // also makes this block's dx stores visible to the irregular re-sum
    if (threadIdx.y == 0 && col < cols) {
        db[col] = bias_grad_finish(&chunk_sums[0][threadIdx.x], &chunk_irregular[0][threadIdx.x],
                                   RMBG_COLS, chunks, dx + col, rows, cols);
    }
}

// ------------------------------------------------------------------------------------------
// Casts (flat, n elements): exact bit manipulations.
//
// f32_to_bf16 and bf16_to_f32 move 4 elements per thread where every pointer is aligned for it
// (the float32 side to 16 bytes, the BF16 side to 8) and fh_flat_narrow(n) holds: thread t takes
// the 4-element groups t, t + T, ... (T threads in the grid; one 16-byte access of float32 and
// one 8-byte access of 4 BF16 patterns per group), then threads 0 .. n % 4 - 1 take one tail
// element each. Otherwise (a misaligned pointer) a 32-bit scalar grid-stride loop, or the 64-bit
// one for n >= 2^31. Each element gets the same bit formula on every path, so the bits depend
// neither on the path nor on the launch shape (plan_f32_to_bf16: one thread per 4 elements).
// ------------------------------------------------------------------------------------------

// float32 -> BF16 bit patterns, RNE; NaN: (u >> 16) | 0x0040 (sign and high payload kept).
extern "C" __global__ void f32_to_bf16(const float* __restrict__ x,
                                       unsigned short* __restrict__ out, long long n) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    if (!fh_flat_narrow(n)) {
        DENSE_FLAT_LOOP(i, n) { out[i] = f32_to_bf16_bits(x[i]); }
        return;
    }
    const unsigned int m = (unsigned int)n, first = fh_flat_first(), stride = fh_flat_stride();
    if (fh_aligned(x, 16) && fh_aligned(out, 8)) {
        const float4* __restrict__ x4 = reinterpret_cast<const float4*>(x);
        uint2* __restrict__ out4 = reinterpret_cast<uint2*>(out);
        for (unsigned int g = first; g < m / 4; g += stride) {
            const float4 v = x4[g];
            out4[g] = bf16_quad_bits(v);
        }
        // the tail: n % 4 elements, one per thread (a loop: any grid covers it)
        for (unsigned int i = fh_flat_tail(m, first); i < m; i += stride) {
            out[i] = f32_to_bf16_bits(x[i]);
        }
    } else {
        for (unsigned int i = first; i < m; i += stride) {
            out[i] = f32_to_bf16_bits(x[i]);
        }
    }
}

// BF16 bit patterns -> float32, exact: the pattern becomes the high half.
static __device__ __forceinline__ float dense_bf16_to_f32(unsigned short u) {
    return __uint_as_float((unsigned int)u << BF16_SHIFT);
}

extern "C" __global__ void bf16_to_f32(const unsigned short* __restrict__ u,
                                       float* __restrict__ out, long long n) {
    if (!fh_flat_narrow(n)) {
        DENSE_FLAT_LOOP(i, n) { out[i] = dense_bf16_to_f32(u[i]); }
        return;
    }
    const unsigned int m = (unsigned int)n, first = fh_flat_first(), stride = fh_flat_stride();
    if (fh_aligned(u, 8) && fh_aligned(out, 16)) {
        const uint2* __restrict__ u4 = reinterpret_cast<const uint2*>(u);
        float4* __restrict__ out4 = reinterpret_cast<float4*>(out);
        for (unsigned int g = first; g < m / 4; g += stride) {
            const uint2 w = u4[g];  // w.x: patterns 4g (low half), 4g + 1; w.y: 4g + 2, 4g + 3
            out4[g] = make_float4(
                dense_bf16_to_f32((unsigned short)(w.x & 0xffffu)),
                dense_bf16_to_f32((unsigned short)(w.x >> BF16_SHIFT)),
                dense_bf16_to_f32((unsigned short)(w.y & 0xffffu)),
                dense_bf16_to_f32((unsigned short)(w.y >> BF16_SHIFT)));
        }
        // the tail: n % 4 elements, one per thread (a loop: any grid covers it)
        for (unsigned int i = fh_flat_tail(m, first); i < m; i += stride) {
            out[i] = dense_bf16_to_f32(u[i]);
        }
    } else {
        for (unsigned int i = first; i < m; i += stride) {
            out[i] = dense_bf16_to_f32(u[i]);
        }
    }
}

// float32 -> TF32 (as float32 with the low 13 bits 0), ties away from zero, like
// cvt.rna.tf32.f32 on finite values; Inf unchanged; NaN keeps sign and high payload, quiet bit
// set. Written with bit operations so the NaN rule is the reference's, whatever the PTX does.
extern "C" __global__ void tf32_round(const float* x, float* out, long long n) {
    DENSE_FLAT_LOOP(i, n) {
        const unsigned int u = __float_as_uint(x[i]);
        unsigned int bits;
        if ((u & HA_F32_EXP_MASK) != HA_F32_EXP_MASK) {  // finite: a carry rounds into the exponent
            bits = (u + DENSE_TF32_HALF_ULP) & DENSE_TF32_KEEP_MASK;
        } else if ((u & BF16_F32_SIGN_CLEAR) > HA_F32_EXP_MASK) {
            bits = (u & DENSE_TF32_KEEP_MASK) | DENSE_F32_QUIET_BIT;
        } else {
            bits = u;  // +/-Inf
        }
        out[i] = __uint_as_float(bits);
    }
}

// ------------------------------------------------------------------------------------------
// TF32 GEMM of the backward passes, with the ReLU mask as an optional epilogue:
//
//     c = op(a) @ b                       op(a) = a [m, k] or, trans_a, a^T with a [k, m]
//     c = (h <= 0) ? 0 : c                with h [m, n] (relu_mask's select), when h != null
//
// b [k, n], c and h [m, n]; all row-major float32 and contiguous. Operands are rounded as
// cvt.rna.tf32.f32 does (the reference's tf32_round) and multiplied by mma.sync m16n8k8 .tf32
// with FP32 accumulation. Reference: foxhunt.reference.kernels.dense.gemm_tf32 (gemm(mode=
// "tf32") then relu_mask); conformance: the GEMM policy in TF32, the masked elements bit for bit.
//
// Built for the step's narrow, short GEMMs (m and n in the hundreds, k <= 256), which the
// per-SM L2 bandwidth bounds: a block computes a tile_m x tile_n tile of c (16 x 16, 16 x 32 or
// 32 x 32) with GEMM_TF32_WARPS warps that split k: warp w stages its own k range of op(a)'s
// tile_m rows and of b's tile_n columns in shared memory (16-byte cp.async where the rows are
// 16-byte aligned, 4-byte otherwise; zeros past m, n and k) and multiplies it with no barrier
// before its MMAs; the warps' partial tiles are then added in warp order (a fixed order: the bits
// depend only on k, not on the tile or the grid) and the mask and the store follow. Grid
// (ceil(n / tile_n), ceil(m / tile_m)), GEMM_TF32_WARPS * 32 threads, gemm_tf32_shared_bytes
// (fast/kernels/dense.py) of dynamic shared memory: per warp kw (tile_n + 8) floats of b and
// tile_m (kw + 4) (or kw (tile_m + 8), trans_a) of a, kw = 8 ceil(ceil(k / 8) /
// GEMM_TF32_WARPS), then the partial tiles; the paddings make the fragment reads conflict-free.
//
// NaN/Inf contract: IEEE through the products and sums (a NaN or Inf operand reaches its row
// and column of c; Inf * 0 is NaN); the rounding keeps NaN and Inf; the mask is relu_mask's, so a
// NaN h passes c and h <= 0 gives +0 whatever c is.
// ------------------------------------------------------------------------------------------

template <int MT, int TN>
static __device__ __forceinline__ void gemm_tf32_tile(const float* a, const float* b, float* c,
                                                      const float* h, int m, int n, int k,
                                                      int trans_a) {
    constexpr int BM = GEMM_TF32_ROWS * MT, W = GEMM_TF32_WARPS, NT = TN / 8;
    extern __shared__ float4 gemm_tf32_smem4[];
    float* smem = reinterpret_cast<float*>(gemm_tf32_smem4);
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * TN;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int steps = (k + 7) >> 3;
    const int per = (steps + W - 1) / W;  // k steps of 8 per warp (the last warps may have fewer)
    const int kw = per * 8;
    const int first = min(steps, w * per), kn = (min(steps, first + per) - first) * 8;
    const int bss = TN + 8, ass = trans_a ? BM + 8 : kw + 4;
    const int warp_floats = kw * bss + (trans_a ? kw * ass : BM * ass);
    float* bs = smem + w * warp_floats;
    float* as = bs + kw * bss;
    float* partial = smem + W * warp_floats;  // [W][MT * NT * 4][32]
    if (kn > 0) {
        gemm_tf32_stage(bs, bss, b, k, n, first * 8, kn, n0, TN, lane);
        if (trans_a) gemm_tf32_stage(as, ass, a, k, m, first * 8, kn, m0, BM, lane);
        else gemm_tf32_stage(as, ass, a, m, k, m0, BM, first * 8, kn, lane);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncwarp();
    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;
    for (int kb = 0; kb < kn; kb += 8) {
        unsigned fa[MT][4];
#pragma unroll
        for (int i = 0; i < MT; ++i) {
            const int r = 16 * i + g;
            if (trans_a) {
                fa[i][0] = gemm_tf32_bits(as[(kb + t) * ass + r]);
                fa[i][1] = gemm_tf32_bits(as[(kb + t) * ass + r + 8]);
                fa[i][2] = gemm_tf32_bits(as[(kb + t + 4) * ass + r]);
                fa[i][3] = gemm_tf32_bits(as[(kb + t + 4) * ass + r + 8]);
            } else {
                fa[i][0] = gemm_tf32_bits(as[r * ass + kb + t]);
                fa[i][1] = gemm_tf32_bits(as[(r + 8) * ass + kb + t]);
                fa[i][2] = gemm_tf32_bits(as[r * ass + kb + t + 4]);
                fa[i][3] = gemm_tf32_bits(as[(r + 8) * ass + kb + t + 4]);
            }
        }
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const unsigned b0 = gemm_tf32_bits(bs[(kb + t) * bss + 8 * j + g]);
            const unsigned b1 = gemm_tf32_bits(bs[(kb + t + 4) * bss + 8 * j + g]);
#pragma unroll
            for (int i = 0; i < MT; ++i)
                gemm_tf32_mma(acc[i][j], fa[i][0], fa[i][1], fa[i][2], fa[i][3], b0, b1);
        }
    }
    constexpr int TILE = MT * NT * 128;  // the tile's outputs, 16 * MT * TN
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                partial[w * TILE + ((i * NT + j) * 4 + e) * 32 + lane] = acc[i][j][e];
    __syncthreads();
    // Element (i, j, e, l) of the tile (fragment (i, j)'s accumulator e of lane l): the warps'
    // partial sums added in warp order, then the mask and the store.
    for (int o = threadIdx.x; o < TILE; o += W * 32) {
        const int f = o >> 7, i = f / NT, j = f - i * NT, e = (o >> 5) & 3, l = o & 31;
        float v = partial[o];
        for (int q = 1; q < W; ++q) v += partial[q * TILE + o];
        const int row = m0 + 16 * i + (l >> 2) + (e >> 1) * 8;
        const int col = n0 + 8 * j + 2 * (l & 3) + (e & 1);
        if (row < m && col < n) {
            const long long x = (long long)row * n + col;
            if (h != nullptr) v = (h[x] <= 0.0f) ? 0.0f : v;  // relu_mask's select
            c[x] = v;
        }
    }
}

// The exact-f32 twin of gemm_tf32_tile (gemm_f32): the same staging, k split and warp-order sum,
// the products on the CUDA cores: lane l keeps the rows 8 i + l / 4 (i < MT 2) and the columns
// 4 j + l % 4 (j < TN / 4) of the tile, one fmaf per product in k order (so its reads of a are
// broadcasts within a row group and its reads of b hit distinct banks).
// Kept apart from gemm_tf32_tile on purpose (session 35, NVIDIA H200, NVRTC 13.0): folds of the
// two tiles and their dispatch into one template measured slower. A staging helper returning a
// struct: the core bf16 step 2-3 us slower. If-constexpr in one tile, with and without the
// statements in these tiles' order (the former gave the same PTX as these under NVRTC 13.5):
// every gemm_tf32 node of the step 0.2-0.3 us slower (26 nodes: 109.1 against 102.4 us) and
// every gemm_f32 node 0.13-0.25 us, reproducibly (critical_path.py --measure's node times).
template <int MT, int TN>
static __device__ __forceinline__ void gemm_f32_tile(const float* a, const float* b, float* c,
                                                     const float* h, int m, int n, int k,
                                                     int trans_a) {
    constexpr int BM = GEMM_TF32_ROWS * MT, W = GEMM_TF32_WARPS, RI = BM / 8, CJ = TN / 4;
    extern __shared__ float4 gemm_tf32_smem4[];
    float* smem = reinterpret_cast<float*>(gemm_tf32_smem4);
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * TN;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, rg = lane >> 2, cg = lane & 3;
    const int steps = (k + 7) >> 3;
    const int per = (steps + W - 1) / W;
    const int kw = per * 8;
    const int first = min(steps, w * per), kn = (min(steps, first + per) - first) * 8;
    const int bss = TN + 8, ass = trans_a ? BM + 8 : kw + 4;
    const int warp_floats = kw * bss + (trans_a ? kw * ass : BM * ass);
    float* bs = smem + w * warp_floats;
    float* as = bs + kw * bss;
    float* partial = smem + W * warp_floats;  // [W][BM][TN]
    if (kn > 0) {
        gemm_tf32_stage(bs, bss, b, k, n, first * 8, kn, n0, TN, lane);
        if (trans_a) gemm_tf32_stage(as, ass, a, k, m, first * 8, kn, m0, BM, lane);
        else gemm_tf32_stage(as, ass, a, m, k, m0, BM, first * 8, kn, lane);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncwarp();
    float acc[RI][CJ];
#pragma unroll
    for (int i = 0; i < RI; ++i)
#pragma unroll
        for (int j = 0; j < CJ; ++j) acc[i][j] = 0.0f;
    for (int kk = 0; kk < kn; ++kk) {
        float av[RI], bv[CJ];
#pragma unroll
        for (int i = 0; i < RI; ++i)
            av[i] = trans_a ? as[kk * ass + 8 * i + rg] : as[(8 * i + rg) * ass + kk];
#pragma unroll
        for (int j = 0; j < CJ; ++j) bv[j] = bs[kk * bss + 4 * j + cg];
#pragma unroll
        for (int i = 0; i < RI; ++i)
#pragma unroll
            for (int j = 0; j < CJ; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
#pragma unroll
    for (int i = 0; i < RI; ++i)
#pragma unroll
        for (int j = 0; j < CJ; ++j) partial[w * BM * TN + (8 * i + rg) * TN + 4 * j + cg] = acc[i][j];
    __syncthreads();
    for (int o = threadIdx.x; o < BM * TN; o += W * 32) {
        float v = partial[o];
        for (int q = 1; q < W; ++q) v += partial[q * BM * TN + o];
        const int row = m0 + o / TN, col = n0 + o % TN;
        if (row < m && col < n) {
            const long long x = (long long)row * n + col;
            if (h != nullptr) v = (h[x] <= 0.0f) ? 0.0f : v;  // relu_mask's select
            c[x] = v;
        }
    }
}

extern "C" __global__ void __launch_bounds__(GEMM_TF32_WARPS * 32)
gemm_tf32(const float* a, const float* b, float* c, const float* h, int m, int n, int k,
          int trans_a, int tile_m, int tile_n) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    if (tile_m == 16 && tile_n == 16) {
        gemm_tf32_tile<1, 16>(a, b, c, h, m, n, k, trans_a);
    } else if (tile_m == 16) {
        gemm_tf32_tile<1, 32>(a, b, c, h, m, n, k, trans_a);
    } else {
        gemm_tf32_tile<2, 32>(a, b, c, h, m, n, k, trans_a);
    }
}

// gemm_tf32's exact-f32 twin for the f32 precision's backward: c = op(a) @ b with f32 products
// (fmaf, k in order within a warp's range, the warps' partial sums in warp order), masked by h as
// gemm_tf32. Same arguments, grid, block and shared memory as gemm_tf32 (gemm_f32_tile's comment).
// Reference: foxhunt.reference.kernels.dense.gemm_f32 (gemm(mode="f32") then relu_mask);
// conformance: the GEMM policy in f32, the masked elements bit for bit. NaN/Inf: IEEE (fmaf), then
// relu_mask's select.
extern "C" __global__ void __launch_bounds__(GEMM_TF32_WARPS * 32)
gemm_f32(const float* a, const float* b, float* c, const float* h, int m, int n, int k,
         int trans_a, int tile_m, int tile_n) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    if (tile_m == 16 && tile_n == 16) {
        gemm_f32_tile<1, 16>(a, b, c, h, m, n, k, trans_a);
    } else if (tile_m == 16) {
        gemm_f32_tile<1, 32>(a, b, c, h, m, n, k, trans_a);
    } else {
        gemm_f32_tile<2, 32>(a, b, c, h, m, n, k, trans_a);
    }
}
