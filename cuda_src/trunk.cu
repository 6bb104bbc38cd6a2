// The fully fused trunk forward on tensor cores (issue 26; reference:
// foxhunt.reference.kernels.trunk.trunk_forward_bf16, the composition of the four nodes it
// replaces: the cuBLASLt GEMM x @ W1^T + b1 with its ReLU(+aux) epilogue, f32_to_bf16(h1), the
// GEMM h1b @ W2^T + b2 with ReLU(+aux), and clamp_finite_isv (Mech 10)).
//
// ONE kernel, for `rows` rows of BF16 states xb [rows, SD] (uint16 bit patterns), W1 [H1, SD] and
// W2 [H2, H1] BF16 (the mirrors), b1 [H1] and b2 [H2] float32:
//   h1      = relu(xb @ W1^T + b1)                       [rows, H1] f32   (+ aux1, h1_bf16)
//   h1_bf16 = f32_to_bf16(h1)                            [rows, H1] BF16  (the next GEMM's A)
//   h2pre   = relu(h1_bf16 @ W2^T + b2)                  [rows, H2] f32   (+ aux2)
//   h2      = clamp_finite(h2pre, mult * fmaxf(isv[index], 1))   [rows, H2] f32 (+ h2_bf16)
// relu is the select `t <= 0 ? 0 : t` (a NaN pre-activation stays NaN); aux1 / aux2 are the
// ReLU bitmasks in cuBLASLt's RELU_AUX_BIAS format (fast/gemm.py): bit (j % 8) of byte j / 8 of
// a row is set where NOT (pre <= 0) (a NaN sets it), each row padded to a multiple of
// TRUNK_AUX_ALIGN bytes; this kernel writes the padding bytes as 0 (no reader looks at them).
// A null aux1 / aux2 pointer skips that mask (the target network's forward keeps none).
//
// Arithmetic: mma.sync.m16n8k16 BF16 x BF16 products with FP32 accumulation (fragments read
// from shared memory), the bias added with one f32 add, everything after it exactly as the
// reference twins (-fmad=false). The GEMM's accumulation ORDER is the tensor cores' own (k in
// chunks of 16, each chunk's 16 products summed inside the MMA), not cuBLASLt's and not
// NumPy's, so h1 / h2pre / h2 are not bitwise those of the four nodes: conformance judges them
// with the GEMM tolerance (kind "gemm", bf16, K of each layer); the BF16 copies and the aux
// bits are bitwise except where a value lies within that bound of a BF16 rounding midpoint or
// of 0 (conformance/specs/trunk.py). Deterministic: no atomics, a fixed order per element.
//
// NaN contract (the cuBLASLt path's): IEEE through the products and sums, so a NaN or Inf in
// row i of xb reaches row i of h1 / h2pre only (Inf * 0 and Inf - Inf give NaN); a NaN or Inf in
// W1 row j or b1[j] reaches column j of h1 in every row, hence every row of h2pre; a NaN in
// W2 row j or b2[j] column j of h2pre. NaN pre-activations stay NaN in h1 / h2pre and set their
// aux bits; h1_bf16 follows f32_to_bf16 (a NaN stays NaN, its payload is the GPU's: NaN
// payloads are no contract). The clamp's is clamp_finite_isv's: NaN and +/-Inf become +0.0,
// a NaN ISV value gives the bound `mult`.
//
// Layout of the work: a block owns TRUNK_BM rows (one m16 tile) and TRUNK_WARPS warps. Its xb
// tile and then its h1_bf16 tile stay in shared memory (h1 never round-trips through global
// memory between the layers; the h1 / h1_bf16 outputs are written for the backward). Each
// layer runs in passes of up to TRUNK_NCH output columns; warp w owns the n8 tiles
// w * TRUNK_NT .. w * TRUNK_NT + TRUNK_NT - 1 of a pass. W is streamed through shared memory in
// chunks of TRUNK_KC k-columns by cp.async, TRUNK_STAGES deep (fast/kernels/trunk.py's
// plan_trunk_forward_bf16 sizes the dynamic shared memory by the same formula as
// trunk_smem_layout below). Shared rows are padded by TRUNK_PAD bf16 (16 bytes) so the
// fragment loads hit 32 distinct banks. Requirements (the launcher checks the shapes): SD, H1,
// H2 multiples of 16 (the MMA's k and two n8 tiles); xb, W1, W2 16-byte aligned (cp.async), the
// f32 outputs 8-byte and the BF16 outputs 4-byte aligned (pairs are stored together).

#include "bf16_bits.cuh"  // f32_to_bf16_bits (dense.f32_to_bf16's bit formula)

#define TRUNK_WARPS 8
#define TRUNK_THREADS (TRUNK_WARPS * 32)
#define TRUNK_BM 16
#define TRUNK_NT 4
#define TRUNK_NCH (TRUNK_WARPS * 8 * TRUNK_NT)
#define TRUNK_KC 32
#define TRUNK_STAGES 3
#define TRUNK_PAD 8
#define TRUNK_AUX_ALIGN 16
#define TRUNK_F32_EXP_MASK 0x7f800000u

static __device__ __forceinline__ unsigned int trunk_smem_addr(const void* p) {
    unsigned int addr;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(addr) : "l"(p));
    return addr;
}

// 16 bytes global -> shared, asynchronously (L2 only: W is read once per block).
static __device__ __forceinline__ void trunk_cp16(void* smem, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                 :: "r"(trunk_smem_addr(smem)), "l"(gmem) : "memory");
}

static __device__ __forceinline__ void trunk_cp_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// Wait until at most TRUNK_STAGES - 2 of this thread's copy groups are pending.
static __device__ __forceinline__ void trunk_cp_wait_stage() {
    asm volatile("cp.async.wait_group %0;" :: "n"(TRUNK_STAGES - 2) : "memory");
}

// c[0..3] += A (16x16, row) @ B (16x8, col); BF16 operands, FP32 accumulation.
static __device__ __forceinline__ void trunk_mma(float* c, const unsigned int* a,
                                                 unsigned int b0, unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

static __device__ __forceinline__ unsigned int trunk_ld32(const unsigned short* p) {
    return *reinterpret_cast<const unsigned int*>(p);
}

static __device__ __forceinline__ bool trunk_is_finite(float x) {
    return (__float_as_uint(x) & TRUNK_F32_EXP_MASK) != TRUNK_F32_EXP_MASK;
}

// clamp_finite_isv's element rule: NaN/Inf -> +0.0, finite values clamped to [-bound, bound].
static __device__ __forceinline__ float trunk_clamp(float v, float bound) {
    return trunk_is_finite(v) ? ((v > bound) ? bound : ((v < -bound) ? -bound : v)) : 0.0f;
}

// Bytes of one aux row for `cols` columns (GemmSpec.aux_ld / 8).
static __device__ __forceinline__ int trunk_aux_row_bytes(int cols) {
    return ((cols / 8 + TRUNK_AUX_ALIGN - 1) / TRUNK_AUX_ALIGN) * TRUNK_AUX_ALIGN;
}

// Where a layer's results go. Layer 1: out = h1, bf16 = h1_bf16 (+ the block's h1 tile in
// shared memory, hs), clamp off. Layer 2: out = h2pre, then the clamp into h2 / h2_bf16.
struct TrunkOut {
    float* out;
    unsigned char* aux;
    unsigned short* bf16;        // layer 1: h1_bf16
    unsigned short* tile;        // layer 1: the shared h1_bf16 tile (row stride tile_stride)
    int tile_stride;
    float* clamped;              // layer 2: h2
    unsigned short* clamped_bf16;  // layer 2: h2_bf16
    float bound;
};

// One dense layer for the block's TRUNK_BM rows starting at row0:
//   pre = A @ W^T + bias, A the shared tile a_s [TRUNK_BM, k_total] (row stride a_stride),
//   W [n_total, k_total] global BF16; the epilogue writes relu(pre), its aux bits and BF16 copy
//   or its clamp (TrunkOut). w_s: TRUNK_STAGES staging buffers of w_rows x (TRUNK_KC + TRUNK_PAD).
// Called by every thread of the block (it synchronises).
static __device__ void trunk_layer(const unsigned short* a_s, int a_stride, int k_total,
                                   const unsigned short* __restrict__ w,
                                   const float* __restrict__ bias, int n_total,
                                   unsigned short* w_s, int w_rows, int row0, int rows,
                                   const TrunkOut& o) {
    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int g = lane >> 2;  // the fragment's row (and row + 8) / the B fragment's column
    const int t4 = lane & 3;  // the fragment's k pair / the C fragment's column pair
    const int w_stride = TRUNK_KC + TRUNK_PAD;
    const int stage_elems = w_rows * w_stride;
    const int n_chunks = (k_total + TRUNK_KC - 1) / TRUNK_KC;
    const int aux_bytes = trunk_aux_row_bytes(n_total);

    for (int n0 = 0; n0 < n_total; n0 += TRUNK_NCH) {
        const int ncols = min(TRUNK_NCH, n_total - n0);
        // Stage chunk c (k in [c * KC, c * KC + klen)) of W's rows n0 .. n0 + ncols.
        auto stage = [&](int c) {
            const int k0 = c * TRUNK_KC;
            const int vecs = min(TRUNK_KC, k_total - k0) / 8;  // 16-byte vectors per row
            unsigned short* dst = w_s + (c % TRUNK_STAGES) * stage_elems;
            for (int v = tid; v < ncols * vecs; v += TRUNK_THREADS) {
                const int r = v / vecs;
                const int q = v - r * vecs;
                trunk_cp16(dst + r * w_stride + q * 8,
                           w + (long long)(n0 + r) * k_total + k0 + q * 8);
            }
        };
        for (int c = 0; c < TRUNK_STAGES - 1; ++c) {
            if (c < n_chunks) {
                stage(c);
            }
            trunk_cp_commit();
        }
        float acc[TRUNK_NT][4];
#pragma unroll
        for (int j = 0; j < TRUNK_NT; ++j) {
            acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
        }
        for (int c = 0; c < n_chunks; ++c) {
            trunk_cp_wait_stage();
            __syncthreads();  // chunk c is in; every warp is done with chunk c - 1's buffer
            if (c + TRUNK_STAGES - 1 < n_chunks) {
                stage(c + TRUNK_STAGES - 1);  // into chunk c - 1's buffer
            }
            trunk_cp_commit();
            const unsigned short* ws = w_s + (c % TRUNK_STAGES) * stage_elems;
            const int k0 = c * TRUNK_KC;
            const int ksteps = min(TRUNK_KC, k_total - k0) / 16;
            for (int ks = 0; ks < ksteps; ++ks) {
                const int k = k0 + ks * 16 + t4 * 2;
                unsigned int a[4];
                a[0] = trunk_ld32(a_s + g * a_stride + k);
                a[1] = trunk_ld32(a_s + (g + 8) * a_stride + k);
                a[2] = trunk_ld32(a_s + g * a_stride + k + 8);
                a[3] = trunk_ld32(a_s + (g + 8) * a_stride + k + 8);
#pragma unroll
                for (int j = 0; j < TRUNK_NT; ++j) {
                    const int tile = warp * TRUNK_NT + j;
                    if (tile * 8 < ncols) {  // warp-uniform
                        const unsigned short* b = ws + (tile * 8 + g) * w_stride + ks * 16 + t4 * 2;
                        trunk_mma(acc[j], a, trunk_ld32(b), trunk_ld32(b + 8));
                    }
                }
            }
        }
        __syncthreads();  // the staging buffers are free for the next pass / layer

        // Epilogue: thread (g, t4) holds columns col, col + 1 of rows g (acc[j][0..1]) and
        // g + 8 (acc[j][2..3]) of tile j.
#pragma unroll
        for (int j = 0; j < TRUNK_NT; ++j) {
            const int tile = warp * TRUNK_NT + j;
            if (tile * 8 >= ncols) {  // warp-uniform
                continue;
            }
            const int col = n0 + tile * 8 + t4 * 2;
            const float bias0 = bias[col];
            const float bias1 = bias[col + 1];
            unsigned int bits[2];
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = g + half * 8;
                const int row = row0 + r;
                const float p0 = __fadd_rn(acc[j][2 * half], bias0);
                const float p1 = __fadd_rn(acc[j][2 * half + 1], bias1);
                const float v0 = (p0 <= 0.0f) ? 0.0f : p0;
                const float v1 = (p1 <= 0.0f) ? 0.0f : p1;
                bits[half] = ((p0 <= 0.0f) ? 0u : 1u) | ((p1 <= 0.0f) ? 0u : 2u);
                const unsigned int pair = (unsigned int)f32_to_bf16_bits(v0)
                                          | ((unsigned int)f32_to_bf16_bits(v1) << 16);
                if (o.tile != nullptr) {  // layer 1: the next layer's A, every row of the tile
                    *reinterpret_cast<unsigned int*>(o.tile + r * o.tile_stride + col) = pair;
                }
                if (row < rows) {
                    const long long at = (long long)row * n_total + col;
                    *reinterpret_cast<float2*>(o.out + at) = make_float2(v0, v1);
                    if (o.bf16 != nullptr) {
                        *reinterpret_cast<unsigned int*>(o.bf16 + at) = pair;
                    }
                    if (o.clamped != nullptr) {
                        const float c0 = trunk_clamp(v0, o.bound);
                        const float c1 = trunk_clamp(v1, o.bound);
                        *reinterpret_cast<float2*>(o.clamped + at) = make_float2(c0, c1);
                        *reinterpret_cast<unsigned int*>(o.clamped_bf16 + at) =
                            (unsigned int)f32_to_bf16_bits(c0)
                            | ((unsigned int)f32_to_bf16_bits(c1) << 16);
                    }
                }
            }
            if (o.aux != nullptr) {
                // The 4 lanes of row g hold its 8 columns of this tile: OR their bit pairs into
                // one byte (bit b = column tile * 8 + b, little bit order).
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    unsigned int byte = bits[half] << (t4 * 2);
                    byte |= __shfl_xor_sync(0xffffffffu, byte, 1);
                    byte |= __shfl_xor_sync(0xffffffffu, byte, 2);
                    const int row = row0 + g + half * 8;
                    if (t4 == 0 && row < rows) {
                        o.aux[(long long)row * aux_bytes + (n0 + tile * 8) / 8] =
                            (unsigned char)byte;
                    }
                }
            }
        }
    }
    if (o.aux != nullptr) {  // the rows' padding bytes
        const int pad = aux_bytes - n_total / 8;
        for (int v = threadIdx.x; v < TRUNK_BM * pad; v += TRUNK_THREADS) {
            const int row = row0 + v / pad;
            if (row < rows) {
                o.aux[(long long)row * aux_bytes + n_total / 8 + v % pad] = 0;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// trunk_forward_bf16: grid ceil(rows / TRUNK_BM) blocks of TRUNK_THREADS threads; dynamic shared
// memory (bf16 elements) TRUNK_BM * (sd + PAD) + TRUNK_BM * (h1_width + PAD)
// + TRUNK_STAGES * min(TRUNK_NCH, max(h1_width, h2_width)) * (TRUNK_KC + PAD), times 2 bytes.
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(TRUNK_THREADS) trunk_forward_bf16(
    const unsigned short* __restrict__ xb, const unsigned short* __restrict__ w1,
    const float* __restrict__ b1, const unsigned short* __restrict__ w2,
    const float* __restrict__ b2, float* __restrict__ h1, unsigned char* __restrict__ aux1,
    unsigned short* __restrict__ h1_bf16, float* __restrict__ h2pre,
    unsigned char* __restrict__ aux2, float* __restrict__ h2,
    unsigned short* __restrict__ h2_bf16, int rows, int sd, int h1_width, int h2_width,
    const float* __restrict__ isv, int index, float mult) {
    extern __shared__ __align__(16) unsigned short trunk_smem[];
    const int xs_stride = sd + TRUNK_PAD;
    const int hs_stride = h1_width + TRUNK_PAD;
    unsigned short* xs = trunk_smem;
    unsigned short* hs = xs + TRUNK_BM * xs_stride;
    unsigned short* w_s = hs + TRUNK_BM * hs_stride;
    const int w_rows = min(TRUNK_NCH, max(h1_width, h2_width));
    const int row0 = blockIdx.x * TRUNK_BM;

    // The block's xb tile (rows past `rows` read as +0.0: their results are never stored).
    const int vecs = sd / 8;
    for (int v = threadIdx.x; v < TRUNK_BM * vecs; v += TRUNK_THREADS) {
        const int r = v / vecs;
        const int q = v - r * vecs;
        unsigned short* dst = xs + r * xs_stride + q * 8;
        if (row0 + r < rows) {
            trunk_cp16(dst, xb + (long long)(row0 + r) * sd + q * 8);
        } else {
            *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
        }
    }
    trunk_cp_commit();  // completes before the first W chunk's group (groups finish in order)

    const TrunkOut first = {h1, aux1, h1_bf16, hs, hs_stride, nullptr, nullptr, 0.0f};
    trunk_layer(xs, xs_stride, sd, w1, b1, h1_width, w_s, w_rows, row0, rows, first);
    __syncthreads();  // the h1_bf16 tile is complete

    const float bound = __fmul_rn(mult, fmaxf(isv[index], 1.0f));  // safety.isv_bound
    const TrunkOut second = {h2pre, aux2, nullptr, nullptr, 0, h2, h2_bf16, bound};
    trunk_layer(hs, hs_stride, h1_width, w2, b2, h2_width, w_s, w_rows, row0, rows, second);
}
