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
// A null aux1 / aux2 pointer skips that mask (the training step passes null: nothing reads one).
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
// Layout of the work: a thread-block cluster (cluster.cuh: FH_CLUSTER blocks on sm_90 and newer,
// one block before) owns TRUNK_BM rows (TRUNK_MT m16 tiles; grid.y = ceil(rows / TRUNK_BM)); cluster
// block `rank` computes the output columns of its slice of each layer (trunk_slice: a multiple
// of 8 columns, ceil(width / (8 FH_CLUSTER)) n8 tiles; the last ranks' slices may be short or
// empty). Each block holds the rows' xb tile in shared memory and, after layer 1, the WHOLE
// h1_bf16 tile: every block stores its slice's BF16 pairs into the tile of every block of the
// cluster (distributed shared memory), then one cluster barrier, so layer 2's A operand never
// goes through global memory (h1 / h1_bf16 are still written for the backward). A block's W
// rows (its slice) are streamed through shared memory in chunks of TRUNK_KC k-columns by
// cp.async, TRUNK_STAGES deep, in passes of up to TRUNK_NCH columns; layer 2's first chunks
// are issued before the cluster barrier (they do not depend on h1). Warp w owns n8 tiles
// w * TRUNK_NT .. of a pass. fast/kernels/trunk.py's trunk_shared_bytes mirrors trunk_smem
// below. Shared rows are padded by TRUNK_PAD bf16 (16 bytes) so the fragment loads hit 32
// distinct banks. Requirements (the launcher checks the shapes): SD, H1, H2 multiples of 16
// (the MMA's k, two n8 tiles); xb, W1, W2 16-byte aligned (cp.async), the f32 outputs 8-byte
// and the BF16 outputs 4-byte aligned (pairs are stored together).

#include "early_launch.cuh"  // fh_early_wait, fh_early_release
#include "bf16_bits.cuh"  // f32_to_bf16_bits (dense.f32_to_bf16's bit formula)
#include "cluster.cuh"    // FH_CLUSTER, fh_cluster_rank, fh_cluster_sync, fh_cluster_map, ..._st_u32
#include "dueling.cuh"    // dueling_sample_regs (heads_out_dueling_bf16's dueling log-softmax)
#include "ha_common.cuh"  // ha_h2_mask (heads_dh2_tf32's masks: step.cu h2_grad_sum_mask's)
#include "tf32_mma.cuh"   // gemm_tf32_bits, gemm_tf32_mma (heads_dh2_tf32)

#define TRUNK_WARPS 4
#define TRUNK_THREADS (TRUNK_WARPS * 32)
#define TRUNK_MT 1
#define TRUNK_BM (16 * TRUNK_MT)
#define TRUNK_NT 2
#define TRUNK_NCH (TRUNK_WARPS * 8 * TRUNK_NT)
#define TRUNK_KC 64
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

// Wait until every copy this thread issued has landed.
static __device__ __forceinline__ void trunk_cp_wait_all() {
    asm volatile("cp.async.wait_all;" ::: "memory");
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

// Columns per cluster block of a layer `width` wide: ceil(width / (8 FH_CLUSTER)) n8 tiles.
static __device__ __forceinline__ int trunk_slice(int width) {
    return ((width + 8 * FH_CLUSTER - 1) / (8 * FH_CLUSTER)) * 8;
}

// Where a layer's results go. Layer 1: out = h1, bf16 = h1_bf16, tile = the shared h1_bf16 tile
// (written into every cluster block's copy), clamp off. Layer 2: out = h2pre, then the clamp
// into h2 / h2_bf16.
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

// W rows [n0, n0 + ncols) of a layer (a block's pass) and where they are staged.
struct TrunkW {
    const unsigned short* __restrict__ w;  // [n_total, k_total] BF16
    int k_total;
    int n0;
    int ncols;
    unsigned short* w_s;  // streamed: TRUNK_STAGES buffers of TRUNK_NCH x (TRUNK_KC + PAD);
                          // resident: one buffer of TRUNK_NCH x (k_total + PAD)
};

// Row r, 16-byte vector q of a tile `vecs` vectors wide, walked by the block's threads in
// steps of `threads` (the block's) vectors without a division per step (two once).
struct TrunkWalk {
    int r, q, dr, dq, vecs;
    __device__ __forceinline__ explicit TrunkWalk(int vecs_, int threads = TRUNK_THREADS)
        : vecs(vecs_) {
        r = threadIdx.x / vecs;
        q = threadIdx.x - r * vecs;
        dr = threads / vecs;
        dq = threads - dr * vecs;
    }
    __device__ __forceinline__ void next() {
        r += dr;
        q += dq;
        if (q >= vecs) {
            q -= vecs;
            ++r;
        }
    }
};

// Copy k-columns [k0, k0 + klen) of the pass's W rows to dst (row stride dst_stride), async.
static __device__ __forceinline__ void trunk_copy_w(const TrunkW& p, int k0, int klen,
                                                    unsigned short* dst, int dst_stride) {
    const unsigned short* src = p.w + (long long)p.n0 * p.k_total + k0;
    for (TrunkWalk it(klen / 8); it.r < p.ncols; it.next()) {
        trunk_cp16(dst + it.r * dst_stride + it.q * 8, src + (long long)it.r * p.k_total + it.q * 8);
    }
}

// Streamed: chunk c (k in [c * KC, c * KC + klen)) into staging buffer c % STAGES.
static __device__ __forceinline__ void trunk_stage(const TrunkW& p, int c) {
    const int k0 = c * TRUNK_KC;
    trunk_copy_w(p, k0, min(TRUNK_KC, p.k_total - k0),
                 p.w_s + (c % TRUNK_STAGES) * (TRUNK_NCH * (TRUNK_KC + TRUNK_PAD)),
                 TRUNK_KC + TRUNK_PAD);
}

// Streamed: the pipeline's prologue, chunks 0 .. STAGES - 2 of a pass, one commit group each
// (empty groups past the last chunk keep the wait counts uniform).
static __device__ __forceinline__ void trunk_prologue(const TrunkW& p) {
    const int n_chunks = (p.k_total + TRUNK_KC - 1) / TRUNK_KC;
    for (int c = 0; c < TRUNK_STAGES - 1; ++c) {
        if (c < n_chunks) {
            trunk_stage(p, c);
        }
        trunk_cp_commit();
    }
}

// acc[i][j] += A[m16 tile i, k0 .. k0 + 16 ksteps) @ W_s[n8 tile j rows, kw0 ..]^T for the
// block's m16 tiles i and the warp's n8 tiles j (tile = j * TRUNK_WARPS + warp, those below
// ncols). A: the shared [TRUNK_BM, *] tile (row stride a_stride).
static __device__ __forceinline__ void trunk_mma_span(float (*acc)[TRUNK_NT][4],
                                                      const unsigned short* a_s, int a_stride,
                                                      int k0, const unsigned short* ws,
                                                      int w_stride, int kw0, int ksteps,
                                                      int ncols) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;
    const int t4 = lane & 3;
    for (int ks = 0; ks < ksteps; ++ks) {
        const int k = k0 + ks * 16 + t4 * 2;
        unsigned int a[TRUNK_MT][4];
#pragma unroll
        for (int i = 0; i < TRUNK_MT; ++i) {
            const unsigned short* ai = a_s + (i * 16 + g) * a_stride + k;
            a[i][0] = trunk_ld32(ai);
            a[i][1] = trunk_ld32(ai + 8 * a_stride);
            a[i][2] = trunk_ld32(ai + 8);
            a[i][3] = trunk_ld32(ai + 8 * a_stride + 8);
        }
#pragma unroll
        for (int j = 0; j < TRUNK_NT; ++j) {
            const int tile = j * TRUNK_WARPS + warp;
            if (tile * 8 < ncols) {  // warp-uniform
                const unsigned short* b = ws + (tile * 8 + g) * w_stride + kw0 + ks * 16 + t4 * 2;
                const unsigned int b0 = trunk_ld32(b);
                const unsigned int b1 = trunk_ld32(b + 8);
#pragma unroll
                for (int i = 0; i < TRUNK_MT; ++i) {
                    trunk_mma(acc[i][j], a[i], b0, b1);
                }
            }
        }
    }
}

// The epilogue of a pass (columns n0 .. n0 + ncols of a layer n_total wide, the block's rows
// from row0): thread (g, t4) holds columns col, col + 1 of rows 16 i + g (acc[i][j][0..1]) and
// 16 i + g + 8 (acc[i][j][2..3]) of m16 tile i, n8 tile j. Adds the bias, applies the ReLU,
// writes the outputs of TrunkOut.
static __device__ __forceinline__ void trunk_epilogue(const float (*acc)[TRUNK_NT][4],
                                                      const float* __restrict__ bias, int n_total,
                                                      int n0, int ncols, int row0, int rows,
                                                      const TrunkOut& o) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;
    const int t4 = lane & 3;
    const int aux_bytes = trunk_aux_row_bytes(n_total);
    unsigned int peer_tile[FH_CLUSTER];  // layer 1: the h1 tile in each cluster block
    if (o.tile != nullptr) {
#pragma unroll
        for (int peer = 0; peer < FH_CLUSTER; ++peer) {
            peer_tile[peer] = fh_cluster_map(o.tile, peer);
        }
    }
#pragma unroll
    for (int i = 0; i < TRUNK_MT; ++i) {
#pragma unroll
        for (int j = 0; j < TRUNK_NT; ++j) {
            const int tile = j * TRUNK_WARPS + warp;
            if (tile * 8 >= ncols) {  // warp-uniform
                continue;
            }
            const int col = n0 + tile * 8 + t4 * 2;
            const float bias0 = bias[col];
            const float bias1 = bias[col + 1];
            unsigned int bits[2];
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = i * 16 + g + half * 8;
                const int row = row0 + r;
                const float p0 = __fadd_rn(acc[i][j][2 * half], bias0);
                const float p1 = __fadd_rn(acc[i][j][2 * half + 1], bias1);
                const float v0 = (p0 <= 0.0f) ? 0.0f : p0;
                const float v1 = (p1 <= 0.0f) ? 0.0f : p1;
                bits[half] = ((p0 <= 0.0f) ? 0u : 1u) | ((p1 <= 0.0f) ? 0u : 2u);
                const unsigned int pair = (unsigned int)f32_to_bf16_bits(v0)
                                          | ((unsigned int)f32_to_bf16_bits(v1) << 16);
                if (o.tile != nullptr) {  // layer 1: the next layer's A, in every cluster block
                    const unsigned int at = 2u * (unsigned int)(r * o.tile_stride + col);  // bytes
#pragma unroll
                    for (int peer = 0; peer < FH_CLUSTER; ++peer) {
                        fh_cluster_st_u32(peer_tile[peer] + at, pair);
                    }
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
                // The 4 lanes of row g hold its 8 columns of this tile: OR their bit pairs into one
                // byte (bit b = column tile * 8 + b, little bit order).
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    unsigned int byte = bits[half] << (t4 * 2);
                    byte |= __shfl_xor_sync(0xffffffffu, byte, 1);
                    byte |= __shfl_xor_sync(0xffffffffu, byte, 2);
                    const int row = row0 + i * 16 + g + half * 8;
                    if (t4 == 0 && row < rows) {
                        o.aux[(long long)row * aux_bytes + (n0 + tile * 8) / 8] = (unsigned char)byte;
                    }
                }
            }
        }
    }
}

// The rows' bitmask padding bytes (written as 0 by cluster block 0, whose slice starts at 0).
static __device__ __forceinline__ void trunk_aux_padding(unsigned char* aux, int n_total,
                                                         int row0, int rows) {
    const int aux_bytes = trunk_aux_row_bytes(n_total);
    const int pad = aux_bytes - n_total / 8;
    for (int v = threadIdx.x; v < TRUNK_BM * pad; v += TRUNK_THREADS) {
        const int row = row0 + v / pad;
        if (row < rows) {
            aux[(long long)row * aux_bytes + n_total / 8 + v % pad] = 0;
        }
    }
}

static __device__ __forceinline__ void trunk_zero(float (*acc)[TRUNK_NT][4]) {
#pragma unroll
    for (int i = 0; i < TRUNK_MT; ++i) {
#pragma unroll
        for (int j = 0; j < TRUNK_NT; ++j) {
            acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;
        }
    }
}

// Streamed: the block's slice [n_begin, n_end) of one dense layer for its TRUNK_BM rows:
//   pre = A @ W^T + bias, A the shared tile a_s [TRUNK_BM, k_total] (row stride a_stride),
//   W [n_total, k_total] global BF16, in passes of TRUNK_NCH columns, W through w_s in chunks.
//   `primed`: the first pass's prologue was already issued (its copy groups are the oldest
//   pending ones). Called by every thread of the block (it synchronises).
static __device__ void trunk_layer_streamed(const unsigned short* a_s, int a_stride, int k_total,
                                            const unsigned short* __restrict__ w,
                                            const float* __restrict__ bias, int n_total,
                                            int n_begin, int n_end, unsigned short* w_s,
                                            bool primed, int row0, int rows, const TrunkOut& o) {
    const int w_stride = TRUNK_KC + TRUNK_PAD;
    const int n_chunks = (k_total + TRUNK_KC - 1) / TRUNK_KC;
    for (int n0 = n_begin; n0 < n_end; n0 += TRUNK_NCH) {
        const TrunkW p = {w, k_total, n0, min(TRUNK_NCH, n_end - n0), w_s};
        if (!(primed && n0 == n_begin)) {
            trunk_prologue(p);
        }
        float acc[TRUNK_MT][TRUNK_NT][4];
        trunk_zero(acc);
        for (int c = 0; c < n_chunks; ++c) {
            trunk_cp_wait_stage();
            __syncthreads();  // chunk c is in; every warp is done with chunk c - 1's buffer
            if (c + TRUNK_STAGES - 1 < n_chunks) {
                trunk_stage(p, c + TRUNK_STAGES - 1);  // into chunk c - 1's buffer
            }
            trunk_cp_commit();
            const int k0 = c * TRUNK_KC;
            trunk_mma_span(acc, a_s, a_stride, k0, w_s + (c % TRUNK_STAGES) * (TRUNK_NCH * w_stride),
                           w_stride, 0, min(TRUNK_KC, k_total - k0) / 16, p.ncols);
        }
        __syncthreads();  // the staging buffers are free for the next pass / layer
        trunk_epilogue(acc, bias, n_total, n0, p.ncols, row0, rows, o);
    }
}

// ---------------------------------------------------------------------------------------------
// trunk_forward_bf16: grid (FH_CLUSTER, ceil(rows / TRUNK_BM)) blocks of TRUNK_THREADS threads,
// clusters of FH_CLUSTER x 1. Resident when every block's slice of both layers is at most
// TRUNK_NCH columns (trunk_slice): the slices of W1 and W2 are copied whole at the start
// (beside the xb tile), dynamic shared memory (bf16 elements) TRUNK_BM * (sd + PAD)
// + TRUNK_BM * (h1_width + PAD) + s1 * (sd + PAD) + s2 * (h1_width + PAD) (s1, s2 the slices);
// else streamed: TRUNK_BM * (sd + PAD) + TRUNK_BM * (h1_width + PAD)
// + TRUNK_STAGES * TRUNK_NCH * (TRUNK_KC + PAD). Times 2 bytes (fast/kernels/trunk.py).
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(TRUNK_THREADS) __cluster_dims__(FH_CLUSTER, 1, 1)
trunk_forward_bf16(
    const unsigned short* __restrict__ xb, const unsigned short* __restrict__ w1,
    const float* __restrict__ b1, const unsigned short* __restrict__ w2,
    const float* __restrict__ b2, float* __restrict__ h1, unsigned char* __restrict__ aux1,
    unsigned short* __restrict__ h1_bf16, float* __restrict__ h2pre,
    unsigned char* __restrict__ aux2, float* __restrict__ h2,
    unsigned short* __restrict__ h2_bf16, int rows, int sd, int h1_width, int h2_width,
    const float* __restrict__ isv, int index, float mult) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    extern __shared__ __align__(16) unsigned short trunk_smem[];
    const int xs_stride = sd + TRUNK_PAD;
    const int hs_stride = h1_width + TRUNK_PAD;
    unsigned short* xs = trunk_smem;
    unsigned short* hs = xs + TRUNK_BM * xs_stride;
    unsigned short* w_s = hs + TRUNK_BM * hs_stride;
    const int row0 = blockIdx.y * TRUNK_BM;
    const int rank = fh_cluster_rank();
    const int s1 = trunk_slice(h1_width);
    const int s2 = trunk_slice(h2_width);
    const int n1_begin = min(h1_width, rank * s1);
    const int n1_end = min(h1_width, n1_begin + s1);
    const int n2_begin = min(h2_width, rank * s2);
    const int n2_end = min(h2_width, n2_begin + s2);
    const bool resident = s1 <= TRUNK_NCH && s2 <= TRUNK_NCH;

    // The block's xb tile (rows past `rows` read as +0.0: their results are never stored).
    for (TrunkWalk it(sd / 8); it.r < TRUNK_BM; it.next()) {
        unsigned short* dst = xs + it.r * xs_stride + it.q * 8;
        if (row0 + it.r < rows) {
            trunk_cp16(dst, xb + (long long)(row0 + it.r) * sd + it.q * 8);
        } else {
            *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
        }
    }
    const TrunkOut first = {h1, aux1, h1_bf16, hs, hs_stride, nullptr, nullptr, 0.0f};
    const float bound = __fmul_rn(mult, fmaxf(isv[index], 1.0f));  // safety.isv_bound
    const TrunkOut second = {h2pre, aux2, nullptr, nullptr, 0, h2, h2_bf16, bound};

    if (resident) {
        // Both slices whole: group 1 = xb tile + W1 slice, group 2 = W2 slice.
        unsigned short* w1_s = w_s;
        unsigned short* w2_s = w1_s + s1 * xs_stride;
        const TrunkW p1 = {w1, sd, n1_begin, n1_end - n1_begin, w1_s};
        const TrunkW p2 = {w2, h1_width, n2_begin, n2_end - n2_begin, w2_s};
        trunk_copy_w(p1, 0, sd, w1_s, xs_stride);
        trunk_cp_commit();
        trunk_copy_w(p2, 0, h1_width, w2_s, hs_stride);
        trunk_cp_commit();
        asm volatile("cp.async.wait_group 1;" ::: "memory");
        __syncthreads();
        float acc[TRUNK_MT][TRUNK_NT][4];
        trunk_zero(acc);
        trunk_mma_span(acc, xs, xs_stride, 0, w1_s, xs_stride, 0, sd / 16, p1.ncols);
        trunk_epilogue(acc, b1, h1_width, n1_begin, p1.ncols, row0, rows, first);
        asm volatile("cp.async.wait_group 0;" ::: "memory");
        fh_cluster_sync();  // every block's h1_bf16 slice is in every tile; W2's slice is in
        trunk_zero(acc);
        trunk_mma_span(acc, hs, hs_stride, 0, w2_s, hs_stride, 0, h1_width / 16, p2.ncols);
        trunk_epilogue(acc, b2, h2_width, n2_begin, p2.ncols, row0, rows, second);
    } else {
        trunk_cp_commit();  // the xb tile completes before the first W chunk's group
        trunk_layer_streamed(xs, xs_stride, sd, w1, b1, h1_width, n1_begin, n1_end, w_s, false,
                             row0, rows, first);
        // Layer 2's first W chunks (the staging buffers are free: the layer ends synchronised),
        // then the cluster barrier: every block's h1_bf16 slice is in every block's tile.
        const bool primed = n2_begin < n2_end;
        if (primed) {
            const TrunkW p2 = {w2, h1_width, n2_begin, min(TRUNK_NCH, n2_end - n2_begin), w_s};
            trunk_prologue(p2);
        }
        fh_cluster_sync();
        trunk_layer_streamed(hs, hs_stride, h1_width, w2, b2, h2_width, n2_begin, n2_end, w_s,
                             primed, row0, rows, second);
        trunk_cp_wait_all();  // a block of empty slices issued xb
    }
    if (rank == 0) {
        if (aux1 != nullptr) {
            trunk_aux_padding(aux1, h1_width, row0, rows);
        }
        if (aux2 != nullptr) {
            trunk_aux_padding(aux2, h2_width, row0, rows);
        }
    }
}

// =============================================================================================
// The heads' fused forward on tensor cores (issue 26; reference:
// foxhunt.reference.kernels.trunk.heads_forward_bf16, the composition of the nodes it replaces
// in the BF16 step's forward: every head's first-layer GEMM h2_bf16 @ W1_h^T + b1_h with its
// RELU_BIAS epilogue, f32_to_bf16 of the heads' hidden buffer, every head's second-layer GEMM
// hid_bf16_h @ W2_h^T + b2_h with its BIAS epilogue). For `rows` rows of BF16 h2 [rows, H2] and
// `n_heads` heads (head 0 the value head, heads 1.. the advantage branches):
//   hid_h      = relu(h2b @ W1_h^T + b1_h)          [rows, hidden_h] f32
//   hid_bf16_h = f32_to_bf16(hid_h)                 [rows, hidden_h] BF16
//   out_h      = hid_bf16_h @ W2_h^T + b2_h         [rows, out_h]    f32 (head 0: v, else adv)
// relu is the select `t <= 0 ? 0 : t` (a NaN pre-activation stays NaN), the bias adds one f32
// add after the product, as the cuBLASLt epilogues. Weights come from the BF16 mirror and biases
// from the f32 parameters at the element offsets of `table` ([n_heads, HEADS_FIELDS] int32: hidden_h,
// out_h, then the offsets of W1_h, b1_h, W2_h, b2_h in `mirror` / `params`, which point at the
// parameter set's first element). Outputs in the step's packed layouts: hid / hid_bf16 hold head
// h's [rows, hidden_h] block at an offset aligned to `hid_align` elements after head h - 1's
// (fast/step_layout.py's Packed); v is head 0's [rows, out_0]; adv holds head h >= 1's
// [rows, out_h] right after head h - 1's (unaligned).
//
// Arithmetic and NaN contract: trunk_forward_bf16's (mma.sync m16n8k16, FP32 accumulation in
// the tensor cores' order, here in four partial sums over interleaved k16 steps added at the
// end: heads_tile_mma; hid and the outputs are within the GEMM bound of the twin's, not
// bitwise; -fmad=false after the product). A NaN or Inf in row i of h2b reaches row i of every
// output only; in W1_h row j or b1_h[j] column j of hid_h in every row, hence every output column
// of head h; in W2_h row o or b2_h[o] column o of out_h.
//
// Layout of the work: a cluster of FH_CLUSTER blocks of HEADS_WARPS warps per TRUNK_BM rows
// (cluster.cuh; grid.y = ceil(rows / TRUNK_BM)). Layer 1 is one layer over the heads' hidden
// columns side by side (HT = sum hidden_h; every hidden_h a multiple of 16, so an n8 tile lies in
// one head); cluster block `rank` computes its trunk_slice(HT) columns, warp w the n8 tile w of
// them, and stores their BF16 copy into the hid tile of every cluster block (distributed shared
// memory). Layer 2's columns are each head's out_h padded to a multiple of 8 ("virtual"
// columns, VT = sum ceil(out_h / 8) * 8), so an n8 tile again lies in one head; its k runs over
// that head's hidden columns of the tile only. The block's W1 rows are copied whole at the
// start, beside the h2 tile; once every warp's layer-1 products are done, the block's W2 rows
// are copied into their place (in flight during layer 1's epilogue and the cluster barrier; a
// padding row of W2 is zero and its column never stored). One slice per layer, at most
// 8 HEADS_WARPS columns: the launcher refuses wider layers (HT or VT above 8 HEADS_WARPS
// FH_CLUSTER). Dynamic shared memory (bf16 elements): TRUNK_BM * (H2 + PAD) + TRUNK_BM * (HT +
// PAD) + max(s1 * (H2 + PAD), s2 * (Hmax + PAD)), Hmax the widest hidden_h (fast/kernels/
// trunk.py heads_shared_bytes). Requirements (the launcher checks): H2 and every hidden_h
// multiples of 16, n_heads <= HEADS_MAX, every W1_h / W2_h offset a multiple of 8 elements and
// h2b 16-byte aligned (cp.async), hid_align even. No remote access follows the cluster barrier,
// so a block may exit without a second one.
// =============================================================================================
#define HEADS_MAX 8
#define HEADS_FIELDS 6
#define HEADS_WARPS 8
#define HEADS_THREADS (HEADS_WARPS * 32)

struct HeadsTable {
    int hidden[HEADS_MAX], out[HEADS_MAX], w1[HEADS_MAX], b1[HEADS_MAX], w2[HEADS_MAX],
        b2[HEADS_MAX];
    int hcum[HEADS_MAX + 1];   // first hidden column of head h (concatenated)
    int vcum[HEADS_MAX + 1];   // first virtual output column of head h
    int hid_off[HEADS_MAX];    // head h's block in hid / hid_bf16
    int out_off[HEADS_MAX];    // head h's block in v (h = 0) or adv
    int hmax;
};

static __device__ __forceinline__ int heads_of(const int* cum, int n, int col) {
    int h = 0;
    while (h + 1 < n && col >= cum[h + 1]) {
        ++h;
    }
    return h;
}

// x rounded up to a multiple of a (x >= 0, a >= 1; unsigned division: fewer instructions than
// a signed one).
static __device__ __forceinline__ int heads_round_up(int x, int a) {
    return (int)((((unsigned int)x + (unsigned int)a - 1u) / (unsigned int)a) * (unsigned int)a);
}

// Head h's blocks in the packed buffers: hid_off, its hidden block's offset in hid / hid_bf16
// (the heads' blocks one after another, each starting at a multiple of hid_align), and out_off,
// its output block's offset in v (h = 0: 0) or adv (the branch heads' blocks one after another,
// unpadded). `raw` is the table (HEADS_FIELDS ints a head: hidden, out, w1, b1, w2, b2), in
// shared or global memory (heads_out_dueling_bf16 reads it from global memory in every thread:
// the loads of heads before h are independent, so they are in flight together).
static __device__ __forceinline__ void heads_block_offsets(const int* raw, int h, int rows,
                                                           int hid_align, int& hid_off,
                                                           int& out_off) {
    int hid_end = 0;
    int adv_end = 0;
#pragma unroll
    for (int k = 0; k < HEADS_MAX; ++k) {
        if (k < h) {
            hid_end = heads_round_up(hid_end, hid_align) + rows * raw[k * HEADS_FIELDS];
            adv_end += k == 0 ? 0 : rows * raw[k * HEADS_FIELDS + 1];
        }
    }
    hid_off = heads_round_up(hid_end, hid_align);
    out_off = h == 0 ? 0 : adv_end;
}

// The derived fields of `t` from the raw table `raw` (read into shared memory by the block's
// threads at once; thread 0 fills `t`: a second fill measured 0.7 us a launch on the H200,
// session 27).
static __device__ void heads_fill_table(HeadsTable& t, const int* raw, int n_heads, int rows,
                                        int hid_align) {
    t.hcum[0] = 0;
    t.vcum[0] = 0;
    t.hmax = 0;
    for (int h = 0; h < n_heads; ++h) {
        const int* e = raw + h * HEADS_FIELDS;
        t.hidden[h] = e[0];
        t.out[h] = e[1];
        t.w1[h] = e[2];
        t.b1[h] = e[3];
        t.w2[h] = e[4];
        t.b2[h] = e[5];
        t.hcum[h + 1] = t.hcum[h] + t.hidden[h];
        t.vcum[h + 1] = t.vcum[h] + ((t.out[h] + 7) / 8) * 8;
        t.hmax = max(t.hmax, t.hidden[h]);
        heads_block_offsets(raw, h, rows, hid_align, t.hid_off[h], t.out_off[h]);
    }
}

// One k16 step of a warp's m16 x n8 tile: c += A[:, 16 ks ..] @ B[16 ks .., :] (the lane's
// fragment pointers a (row g, k pair t4 of the tile; row stride a_stride) and b (its W row)).
static __device__ __forceinline__ void heads_kstep(float* c, const unsigned short* a, int a_stride,
                                                   const unsigned short* b, int ks) {
    const unsigned short* ai = a + ks * 16;
    unsigned int f[4];
    f[0] = trunk_ld32(ai);
    f[1] = trunk_ld32(ai + 8 * a_stride);
    f[2] = trunk_ld32(ai + 8);
    f[3] = trunk_ld32(ai + 8 * a_stride + 8);
    trunk_mma(c, f, trunk_ld32(b + ks * 16), trunk_ld32(b + ks * 16 + 8));
}

// acc = the warp's m16 x n8 tile over `ksteps` k16 steps, in four independent accumulations
// (steps 4i + p into part p; a remainder into part 0) summed as (p0 + p1) + (p2 + p3): four
// chains of dependent MMAs instead of one. Measured on the H200 (session 27) it made no
// difference (the kernel's node took 12.8 / 10.4 us before and 13.3 / 10.4 us after, 512 / 256
// rows): the variant that suggested it doubled the k loop with a `%` by a runtime count, whose
// division was probably the cost it measured.
static __device__ __forceinline__ void heads_tile_mma(float* acc, const unsigned short* a,
                                                      int a_stride, const unsigned short* b,
                                                      int ksteps) {
    float part[4][4];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        part[p][0] = part[p][1] = part[p][2] = part[p][3] = 0.0f;
    }
    int ks = 0;
    for (; ks + 4 <= ksteps; ks += 4) {
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            heads_kstep(part[p], a, a_stride, b, ks + p);
        }
    }
    for (; ks < ksteps; ++ks) {
        heads_kstep(part[0], a, a_stride, b, ks);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        acc[e] = __fadd_rn(__fadd_rn(part[0][e], part[1][e]), __fadd_rn(part[2][e], part[3][e]));
    }
}

extern "C" __global__ void __launch_bounds__(HEADS_THREADS) __cluster_dims__(FH_CLUSTER, 1, 1)
heads_forward_bf16(const unsigned short* __restrict__ h2b,
                   const unsigned short* __restrict__ mirror, const float* __restrict__ params,
                   const int* __restrict__ table, float* __restrict__ hid,
                   unsigned short* __restrict__ hid_bf16, float* __restrict__ v,
                   float* __restrict__ adv, int rows, int h2_width, int n_heads, int hid_align) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    extern __shared__ __align__(16) unsigned short trunk_smem[];
    __shared__ int raw[HEADS_MAX * HEADS_FIELDS];
    __shared__ HeadsTable t;  // static shared memory, beside the dynamic
    const int row0 = blockIdx.y * TRUNK_BM;
    const int xs_stride = h2_width + TRUNK_PAD;
    unsigned short* xs = trunk_smem;
    // The h2 tile first (rows past `rows` read as +0.0; it needs no table), then the table.
    for (TrunkWalk it(h2_width / 8, HEADS_THREADS); it.r < TRUNK_BM; it.next()) {
        unsigned short* dst = xs + it.r * xs_stride + it.q * 8;
        if (row0 + it.r < rows) {
            trunk_cp16(dst, h2b + (long long)(row0 + it.r) * h2_width + it.q * 8);
        } else {
            *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
        }
    }
    for (int i = threadIdx.x; i < n_heads * HEADS_FIELDS; i += HEADS_THREADS) {
        raw[i] = table[i];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        heads_fill_table(t, raw, n_heads, rows, hid_align);
    }
    __syncthreads();
    const int ht = t.hcum[n_heads];
    const int vt = t.vcum[n_heads];
    const int hs_stride = ht + TRUNK_PAD;
    const int w2_stride = t.hmax + TRUNK_PAD;
    const int s1 = trunk_slice(ht);
    const int s2 = trunk_slice(vt);
    unsigned short* hs = xs + TRUNK_BM * xs_stride;
    unsigned short* w_s = hs + TRUNK_BM * hs_stride;  // W1's rows, then W2's
    const int rank = fh_cluster_rank();
    const int n1_begin = min(ht, rank * s1);
    const int n1_cols = min(ht, n1_begin + s1) - n1_begin;
    const int n2_begin = min(vt, rank * s2);
    const int n2_cols = min(vt, n2_begin + s2) - n2_begin;

    // Group 1: the h2 tile (issued above) and the block's W1 rows.
    for (TrunkWalk it(h2_width / 8, HEADS_THREADS); it.r < n1_cols; it.next()) {
        const int col = n1_begin + it.r;
        const int h = heads_of(t.hcum, n_heads, col);
        trunk_cp16(w_s + it.r * xs_stride + it.q * 8,
                   mirror + t.w1[h] + (long long)(col - t.hcum[h]) * h2_width + it.q * 8);
    }
    trunk_cp_commit();
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();

    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;  // warp w owns n8 tile w of each layer's slice
    const int g = lane >> 2;
    const int t4 = lane & 3;
    const bool tile1 = warp * 8 < n1_cols;  // warp-uniform
    const bool tile2 = warp * 8 < n2_cols;
    // Layer 1: the warp's hidden tile.
    float acc[4];
    if (tile1) {
        heads_tile_mma(acc, xs + g * xs_stride + t4 * 2, xs_stride,
                       w_s + (warp * 8 + g) * xs_stride + t4 * 2, h2_width / 16);
    }
    __syncthreads();  // every warp is done with W1's rows: W2's go in their place
    // Group 2: the block's W2 rows (virtual columns; a padding row is zero), in flight during
    // layer 1's epilogue and the cluster barrier.
    for (TrunkWalk it(t.hmax / 8, HEADS_THREADS); it.r < n2_cols; it.next()) {
        const int vcol = n2_begin + it.r;
        const int h = heads_of(t.vcum, n_heads, vcol);
        const int o = vcol - t.vcum[h];
        unsigned short* dst = w_s + it.r * w2_stride + it.q * 8;
        if (it.q * 8 < t.hidden[h]) {
            if (o < t.out[h]) {
                trunk_cp16(dst, mirror + t.w2[h] + (long long)o * t.hidden[h] + it.q * 8);
            } else {
                *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
            }
        }
    }
    trunk_cp_commit();
    // Layer 1's epilogue: ReLU, hid / hid_bf16 and the BF16 pairs into every cluster block's tile.
    if (tile1) {
        const int col = n1_begin + warp * 8 + t4 * 2;  // concatenated hidden column
        const int h = heads_of(t.hcum, n_heads, col);
        const int lc = col - t.hcum[h];
        const float bias0 = params[t.b1[h] + lc];
        const float bias1 = params[t.b1[h] + lc + 1];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = g + half * 8;
            const int row = row0 + r;
            const float p0 = __fadd_rn(acc[2 * half], bias0);
            const float p1 = __fadd_rn(acc[2 * half + 1], bias1);
            const float v0 = (p0 <= 0.0f) ? 0.0f : p0;
            const float v1 = (p1 <= 0.0f) ? 0.0f : p1;
            const unsigned int pair = (unsigned int)f32_to_bf16_bits(v0)
                                      | ((unsigned int)f32_to_bf16_bits(v1) << 16);
            const unsigned int at = 2u * (unsigned int)(r * hs_stride + col);  // bytes
#pragma unroll
            for (int peer = 0; peer < FH_CLUSTER; ++peer) {
                fh_cluster_st_u32(fh_cluster_map(hs, peer) + at, pair);
            }
            if (row < rows) {
                const long long o = t.hid_off[h] + (long long)row * t.hidden[h] + lc;
                *reinterpret_cast<float2*>(hid + o) = make_float2(v0, v1);
                *reinterpret_cast<unsigned int*>(hid_bf16 + o) = pair;
            }
        }
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    fh_cluster_sync();  // every block's hid_bf16 columns are in every tile; W2's rows are in

    // Layer 2: the warp's tile of virtual columns over its head's hidden columns of the tile.
    if (tile2) {
        const int vcol0 = n2_begin + warp * 8;
        const int h = heads_of(t.vcum, n_heads, vcol0);
        const int k0 = t.hcum[h];
        heads_tile_mma(acc, hs + g * hs_stride + k0 + t4 * 2, hs_stride,
                       w_s + (warp * 8 + g) * w2_stride + t4 * 2, t.hidden[h] / 16);
        float* dst = h == 0 ? v : adv;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int o = vcol0 + t4 * 2 + e - t.vcum[h];
            if (o < t.out[h]) {
                const float bias = params[t.b2[h] + o];
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int row = row0 + g + half * 8;
                    if (row < rows) {
                        dst[t.out_off[h] + (long long)row * t.out[h] + o] =
                            __fadd_rn(acc[2 * half + e], bias);
                    }
                }
            }
        }
    }
}

// =============================================================================================
// A pass's heads from their hidden values to the dueling log-softmax in ONE launch (issue 26:
// the heads' forward with the dueling combination and log-softmax; reference:
// foxhunt.reference.kernels.trunk.heads_out_dueling_bf16, the composition of the nodes it
// replaces: f32_to_bf16 of the hidden values, every head's second-layer GEMM
// hid_bf16 @ W2^T + b2 (cuBLASLt, BIAS epilogue) and dueling_log_softmax_q_branches):
//   hid_bf16 = f32_to_bf16(hid)                                  (every head's block)
//   out_h    = hid_bf16[h] @ W2_h^T + b2_h       (h = 0: v [rows, NA]; h = d + 1: branch d's
//                                                 advantages [rows, n_d NA] of adv)
//   logits, logp, q = dueling_log_softmax_q_branches(v, adv, z, n_actions, with_q)
// on the step's packed buffers (heads_forward_bf16's table and layout: head h's hid block at
// hid_off[h], W2_h / b2_h at the table's offsets in mirror / params). Block (x, d) owns rows
// TRUNK_BM x .. and branch d: it converts the rows' value-head and head-(d + 1) hidden values to
// BF16 tiles in shared memory (and writes their hid_bf16; the value head's by branch 0's blocks
// only), computes the value head's and head d + 1's outputs into shared memory (n8 tiles; warp
// w the tiles w, w + HOD_WARPS, ..., its B fragments read from the mirror HOD_KSTEPS k16 steps
// at a time for all its tiles, the first HOD_KSTEPS before the hidden values are read, so both
// loads are in flight together; every thread reads the two heads' table fields itself, with no
// shared table and no barrier before the loads), writes v (branch 0's blocks) and adv, and
// after a barrier runs dueling_log_softmax_q_branches' register path (dueling.cuh) on the
// shared rows, a warp a sample. Every block recomputes the value head for its rows (the same
// code on the same data: the same bits). The dueling outputs are therefore bitwise those of
// dueling_log_softmax_q_branches on this kernel's v and adv; v and adv are GEMMs in the tensor
// cores' accumulation order (k in chunks of 16, in k order, the bias added last with one f32
// add): conformance judges them with the GEMM tolerance. NaN contract: the nodes' (IEEE
// through the products: a NaN or Inf in row i of hid reaches row i of its head's outputs; in
// W2_h row j or b2_h[j] column j of that head's output in every row; f32_to_bf16 keeps NaN;
// then dueling_log_softmax_q_branches' contract). Requirements (the launcher checks):
// n_heads - 1 branches, every hidden width a multiple of 16, out[0] == num_atoms, out[d + 1] ==
// n_actions[d] num_atoms with 1 <= n_actions[d] <= kDuelingRegRows and num_atoms <= kWarp
// kDuelingRegChunks, ceil(out[0] / 8) + ceil(out[d + 1] / 8) <= HOD_WARPS HOD_TILES n8 tiles,
// W2 offsets even, hid_align a multiple of 4 (float4 loads). Dynamic shared memory (bytes):
// 2 TRUNK_BM (hidden[0] + hidden[h] + 2 TRUNK_PAD) + 4 TRUNK_BM (out[0] + out[h]) for the widest
// branch head h (fast/kernels/trunk.py hod_shared_bytes).
// =============================================================================================
#define HOD_WARPS 16
#define HOD_THREADS (HOD_WARPS * 32)
#define HOD_TILES 2
#define HOD_KSTEPS 8
#define HOD_LOADS 4

// The lane's B fragments of k16 steps k0 .. k0 + HOD_KSTEPS - 1 of its tiles (0 past a tile's
// steps).
static __device__ __forceinline__ void hod_load_b(unsigned int (&b)[HOD_TILES][HOD_KSTEPS][2],
                                                  const unsigned short* const (&b_row)[HOD_TILES],
                                                  const int (&steps)[HOD_TILES], int k0) {
#pragma unroll
    for (int i = 0; i < HOD_TILES; ++i) {
#pragma unroll
        for (int j = 0; j < HOD_KSTEPS; ++j) {
            const int ks = k0 + j;
            const bool live = ks < steps[i];
            b[i][j][0] = live ? trunk_ld32(b_row[i] + ks * 16) : 0u;
            b[i][j][1] = live ? trunk_ld32(b_row[i] + ks * 16 + 8) : 0u;
        }
    }
}

// The end of heads_out_dueling_bf16 / _f32: + b2 into the shared output tiles, v (branch 0's
// blocks: `store`) and adv (`adv_d`: branch d's block), for the warp's tiles with k steps
// (`steps[i]` > 0; lane (g, t4) holds rows g, g + 8 and columns 2 t4, 2 t4 + 1 of tile i, the
// mma's C fragment; TILES tiles a warp, WARPS warps a block); a barrier; then
// dueling_log_softmax_q_branches' register path on the block's shared rows, a warp a sample.
template <int TILES, int WARPS>
static __device__ __forceinline__ void hod_finish(
    const float (&acc)[TILES][4], const float (&bias)[TILES][2],
    const int (&steps)[TILES], const int (&side)[TILES], const int (&n0)[TILES], int g,
    int t4, int warp, int lane, int d, int row0, int rows, int out0, int out1, float* v,
    float* adv_d, float* o_tile0, float* o_tile1, const float (&z_lane)[kDuelingRegChunks], int na,
    int first_row, float* logits, float* logp, float* q, bool want_q, int num_atoms) {
    // Epilogue: + b2, into the shared output tiles, v (branch 0's blocks) and adv.
#pragma unroll
    for (int i = 0; i < TILES; ++i) {
        if (steps[i] == 0) {
            continue;
        }
        const int s = side[i];
        const int width = s == 0 ? out0 : out1;
        float* dst = s == 0 ? v : adv_d;
        float* out_tile = s == 0 ? o_tile0 : o_tile1;
        const bool store = s == 1 || d == 0;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int o = n0[i] + t4 * 2 + e;
            if (o < width) {
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int r = g + half * 8;
                    const float value = __fadd_rn(acc[i][2 * half + e], bias[i][e]);
                    out_tile[r * width + o] = value;
                    if (store && row0 + r < rows) {
                        dst[(long long)(row0 + r) * width + o] = value;
                    }
                }
            }
        }
    }
    __syncthreads();  // the block's rows of v and branch d's advantages are in shared memory

    // dueling_log_softmax_q_branches' register path on them, a warp a sample.
    for (int r = warp; r < TRUNK_BM && row0 + r < rows; r += WARPS) {
        const int row = first_row + (row0 + r) * na;  // the sample's first packed row
        const int offset = row * num_atoms;
        float* q_b = want_q ? q + row : nullptr;  // not dereferenced without want_q
        const float* v_b = o_tile0 + r * num_atoms;
        const float* adv_b = o_tile1 + r * out1;
        dueling_sample_regs_n(na, v_b, adv_b, z_lane, logits + offset, logp + offset, q_b, want_q,
                              num_atoms, lane);
    }
}

extern "C" __global__ void __launch_bounds__(HOD_THREADS)
heads_out_dueling_bf16(const float* __restrict__ hid, const unsigned short* __restrict__ mirror,
                       const float* __restrict__ params, const int* __restrict__ table,
                       const float* __restrict__ z, const int* __restrict__ n_actions,
                       const int* __restrict__ action_offset, unsigned short* __restrict__ hid_bf16,
                       float* __restrict__ v, float* __restrict__ adv, float* __restrict__ logits,
                       float* __restrict__ logp, float* __restrict__ q, int rows, int n_heads,
                       int hid_align, int num_atoms, int with_q) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    extern __shared__ __align__(16) unsigned short hod_smem[];
    const int d = blockIdx.y;  // branch d: head d + 1
    const int hb = d + 1;
    const int row0 = blockIdx.x * TRUNK_BM;
    // The two heads' fields, read by every thread from the table (a plan constant: broadcast
    // loads, no barrier; side s = 0 the value head, s = 1 head hb, chosen by selects: no indexed
    // arrays). The value head's blocks start at 0 in hid and v (heads_block_offsets' rule).
    const int* __restrict__ e1 = table + hb * HEADS_FIELDS;
    const int hidden0 = table[0], hidden1 = e1[0];
    const int out0 = table[1], out1 = e1[1];
    const int w2_0 = table[4], w2_1 = e1[4];
    const int b2_0 = table[5], b2_1 = e1[5];
    int hid_off1, out_off1;
    heads_block_offsets(table, hb, rows, hid_align, hid_off1, out_off1);
    // Shared memory: the BF16 A tiles of head 0 and head hb, then their f32 output tiles.
    const int a_stride0 = hidden0 + TRUNK_PAD;
    const int a_stride1 = hidden1 + TRUNK_PAD;
    unsigned short* a_tile0 = hod_smem;
    unsigned short* a_tile1 = a_tile0 + TRUNK_BM * a_stride0;
    float* o_tile0 = reinterpret_cast<float*>(a_tile1 + TRUNK_BM * a_stride1);
    float* o_tile1 = o_tile0 + TRUNK_BM * out0;

    // The dueling's branch table and z of the lane's atoms (read now, in flight with the rest).
    const int na = n_actions[d];
    const int first_row = rows * action_offset[d];  // branch d's first packed row
    const int lane = threadIdx.x & 31;
    const bool want_q = with_q != 0;
    float z_lane[kDuelingRegChunks];
    dueling_z_lane(z_lane, z, want_q, num_atoms, lane);

    // The second layers' operands: warp w's n8 tiles w + HOD_WARPS i (the value head's first);
    // their first HOD_KSTEPS k16 steps of B fragments (W2 rows, from the mirror) and the lane's
    // b2 values are loaded now, in flight with the hidden values' loads below.
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;
    const int t4 = lane & 3;
    const int tiles0 = (out0 + 7) / 8;
    const int tiles = tiles0 + (out1 + 7) / 8;
    float acc[HOD_TILES][4];
    float bias[HOD_TILES][2];  // b2 of the lane's two output columns
    const unsigned short* a_frag[HOD_TILES];
    const unsigned short* b_row[HOD_TILES];
    int stride[HOD_TILES], steps[HOD_TILES], side[HOD_TILES], n0[HOD_TILES];
    int k_steps = 0;
#pragma unroll
    for (int i = 0; i < HOD_TILES; ++i) {
        const int tile = warp + HOD_WARPS * i;
        const int s = tile < tiles0 ? 0 : 1;
        const int hidden = s == 0 ? hidden0 : hidden1;
        const int width = s == 0 ? out0 : out1;
        side[i] = s;
        n0[i] = (s == 0 ? tile : tile - tiles0) * 8;
        stride[i] = s == 0 ? a_stride0 : a_stride1;
        steps[i] = tile < tiles ? hidden / 16 : 0;
        k_steps = max(k_steps, steps[i]);
        a_frag[i] = (s == 0 ? a_tile0 : a_tile1) + g * stride[i] + t4 * 2;
        // The lane's B column (a W2 row); a padding column past `width` reads the last row (its
        // C column is never stored).
        const int o = min(n0[i] + g, width - 1);
        b_row[i] = mirror + (s == 0 ? w2_0 : w2_1) + (long long)o * hidden + t4 * 2;
        acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int oc = n0[i] + t4 * 2 + e;
            bias[i][e] = (tile < tiles && oc < width) ? params[(s == 0 ? b2_0 : b2_1) + oc] : 0.0f;
        }
    }
    unsigned int b[HOD_TILES][HOD_KSTEPS][2];
    hod_load_b(b, b_row, steps, 0);

    // The hidden values to BF16 (rows past `rows` as +0.0): warp w the tile's row w (TRUNK_BM
    // == HOD_WARPS), lane l its quads l, l + 32, ... of the row's quads0 + quads1 (the value
    // head's, then head hb's), HOD_LOADS loads in flight a lane.
    static_assert(TRUNK_BM == HOD_WARPS, "heads_out_dueling_bf16: warp w converts tile row w");
    const int quads0 = hidden0 / 4;
    const int n_quads = quads0 + hidden1 / 4;
    const int row = row0 + warp;
    const bool row_live = row < rows;
    for (int c0 = lane; c0 < n_quads; c0 += 32 * HOD_LOADS) {
        float4 x[HOD_LOADS];
        long long at[HOD_LOADS];
#pragma unroll
        for (int u = 0; u < HOD_LOADS; ++u) {
            const int c = c0 + u * 32;
            const bool s1 = c >= quads0;
            at[u] = s1 ? hid_off1 + (long long)row * hidden1 + (c - quads0) * 4
                       : (long long)row * hidden0 + c * 4;
            x[u] = (row_live && c < n_quads) ? *reinterpret_cast<const float4*>(hid + at[u])
                                             : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int u = 0; u < HOD_LOADS; ++u) {
            const int c = c0 + u * 32;
            if (c >= n_quads) {
                break;
            }
            const bool s1 = c >= quads0;
            const uint2 pair = make_uint2(
                (unsigned int)f32_to_bf16_bits(x[u].x) | ((unsigned int)f32_to_bf16_bits(x[u].y) << 16),
                (unsigned int)f32_to_bf16_bits(x[u].z) | ((unsigned int)f32_to_bf16_bits(x[u].w) << 16));
            unsigned short* tile = s1 ? a_tile1 + warp * a_stride1 + (c - quads0) * 4
                                      : a_tile0 + warp * a_stride0 + c * 4;
            *reinterpret_cast<uint2*>(tile) = pair;
            if (row_live && (s1 || d == 0)) {  // head 0's hid_bf16: branch 0's blocks
                *reinterpret_cast<uint2*>(hid_bf16 + at[u]) = pair;
            }
        }
    }
    __syncthreads();

    // The second layers, HOD_KSTEPS k16 steps of B fragments at a time (the first loaded above).
    for (int k0 = 0; k0 < k_steps; k0 += HOD_KSTEPS) {
        if (k0 > 0) {
            hod_load_b(b, b_row, steps, k0);
        }
#pragma unroll
        for (int j = 0; j < HOD_KSTEPS; ++j) {
#pragma unroll
            for (int i = 0; i < HOD_TILES; ++i) {
                const int ks = k0 + j;
                if (ks < steps[i]) {
                    const unsigned short* ai = a_frag[i] + ks * 16;
                    unsigned int f[4];
                    f[0] = trunk_ld32(ai);
                    f[1] = trunk_ld32(ai + 8 * stride[i]);
                    f[2] = trunk_ld32(ai + 8);
                    f[3] = trunk_ld32(ai + 8 * stride[i] + 8);
                    trunk_mma(acc[i], f, b[i][j][0], b[i][j][1]);
                }
            }
        }
    }
    hod_finish<HOD_TILES, HOD_WARPS>(acc, bias, steps, side, n0, g, t4, warp, lane, d, row0, rows,
                                     out0, out1, v, adv + out_off1, o_tile0, o_tile1, z_lane, na,
                                     first_row, logits, logp, q, want_q, num_atoms);
}

// =============================================================================================
// heads_out_dueling_bf16's f32 twin, for the f32 step (issue 26: the heads' forward with the
// dueling combination and log-softmax, f32 mode's exact-f32 path; reference:
// foxhunt.reference.kernels.trunk.heads_out_dueling_f32, the composition of the nodes it
// replaces: every head's second-layer GEMM hid @ W2^T + b2 (cuBLASLt f32, BIAS epilogue) and
// dueling_log_softmax_q_branches):
//   out_h    = hid[h] @ W2_h^T + b2_h        (h = 0: v [rows, NA]; h = d + 1: branch d's
//                                             advantages [rows, n_d NA] of adv)
//   logits, logp, q = dueling_log_softmax_q_branches(v, adv, z, n_actions, with_q)
// Block (x, d) owns rows TRUNK_BM x .. and branch d as heads_out_dueling_bf16's, with HODF_WARPS
// warps of HODF_TILES n8 tiles each (one: twice the bf16 kernel's warps to hide the shared
// loads' latency, and no warp with two tiles while others have one). It copies the rows'
// value-head and head-(d + 1) hidden values and both heads' whole W2 into f32 tiles in shared
// memory with asynchronous 16-byte copies (cp.async, all in flight at once: one round trip to
// L2; rows past `rows` as +0.0), every tile row padded by HODF_PAD floats (a row stride of 16 m
// + 4 floats: the lanes' float4 reads of 8 hidden rows, or of the 4 W2 rows of a quad's
// columns, hit distinct banks). Warp w then computes n8 tile w of the two heads' outputs (the
// value head's tiles first), lane (g, t4) rows g and g + 8, columns 2 t4 and 2 t4 + 1 of the
// tile (the mma's C fragment: the epilogue and the dueling are heads_out_dueling_bf16's), each
// output one chain of fmaf in k order on the CUDA cores (exact f32 products, f32 sums; both
// operands from shared memory), the bias added last with one f32 add. The dueling outputs are
// therefore bitwise those of dueling_log_softmax_q_branches on this kernel's v and adv; v and
// adv are f32 GEMMs in another summation order than cuBLASLt's: conformance judges them with the
// GEMM tolerance. NaN contract: the nodes' (IEEE through the products: a NaN or Inf in row i of
// hid reaches row i of its head's outputs; in W2_h row j or b2_h[j] column j of that head's
// output in every row; then dueling_log_softmax_q_branches' contract). Requirements (the
// launcher checks): heads_out_dueling_bf16's, with ceil(out[0] / 8) + ceil(out[d + 1] / 8) <=
// HODF_WARPS HODF_TILES, and the W2 offsets multiples of 4 (16-byte copies). Dynamic shared
// memory (bytes): 4 (TRUNK_BM + out[0]) (hidden[0] + HODF_PAD) + 4 (TRUNK_BM + out[h])
// (hidden[h] + HODF_PAD) + 4 TRUNK_BM (out[0] + out[h]) for the branch head h that needs the
// most, opted in above 48 KiB (fast/kernels/trunk.py hod_shared_bytes; 137,664 bytes at the
// seed shapes).
// =============================================================================================
#define HODF_PAD 4
#define HODF_WARPS 32
#define HODF_THREADS (HODF_WARPS * 32)
#define HODF_TILES 1

// Rows [0, n) of a [n, width] f32 matrix at src (rows `width` floats apart) into a shared tile
// of row stride width + HODF_PAD, 16 bytes a copy: warp w the rows w, w + HODF_WARPS, .., lane l
// the row's quads l, l + 32, .. (no division); rows live_rows .. n - 1 of the tile become +0.0
// (plain stores) instead of copies.
static __device__ __forceinline__ void hodf_copy_rows(float* tile, const float* src, int n,
                                                      int live_rows, int width) {
    const int quads = width / 4;
    const int stride = width + HODF_PAD;
    const int lane = threadIdx.x & 31;
    for (int r = threadIdx.x >> 5; r < n; r += HODF_WARPS) {
        for (int q = lane; q < quads; q += 32) {
            float* dst = tile + r * stride + q * 4;
            if (r < live_rows) {
                trunk_cp16(dst, src + (long long)r * width + q * 4);
            } else {
                *reinterpret_cast<float4*>(dst) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(HODF_THREADS)
heads_out_dueling_f32(const float* __restrict__ hid, const float* __restrict__ params,
                      const int* __restrict__ table, const float* __restrict__ z,
                      const int* __restrict__ n_actions, const int* __restrict__ action_offset,
                      float* __restrict__ v, float* __restrict__ adv, float* __restrict__ logits,
                      float* __restrict__ logp, float* __restrict__ q, int rows, int n_heads,
                      int hid_align, int num_atoms, int with_q) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    extern __shared__ __align__(16) float hodf_smem[];
    const int d = blockIdx.y;  // branch d: head d + 1
    const int hb = d + 1;
    const int row0 = blockIdx.x * TRUNK_BM;
    // The two heads' fields (heads_out_dueling_bf16's reads).
    const int* __restrict__ e1 = table + hb * HEADS_FIELDS;
    const int hidden0 = table[0], hidden1 = e1[0];
    const int out0 = table[1], out1 = e1[1];
    const int w2_0 = table[4], w2_1 = e1[4];
    const int b2_0 = table[5], b2_1 = e1[5];
    int hid_off1, out_off1;
    heads_block_offsets(table, hb, rows, hid_align, hid_off1, out_off1);
    // Shared memory: the hidden tiles of head 0 and head hb, their W2 tiles, then their f32
    // output tiles; head s's rows hidden_s + HODF_PAD floats apart.
    const int stride0 = hidden0 + HODF_PAD;
    const int stride1 = hidden1 + HODF_PAD;
    float* a_tile0 = hodf_smem;
    float* a_tile1 = a_tile0 + TRUNK_BM * stride0;
    float* w_tile0 = a_tile1 + TRUNK_BM * stride1;
    float* w_tile1 = w_tile0 + out0 * stride0;
    float* o_tile0 = w_tile1 + out1 * stride1;
    float* o_tile1 = o_tile0 + TRUNK_BM * out0;

    // Every operand into shared memory, all copies in flight together.
    const int live = min(TRUNK_BM, rows - row0);
    hodf_copy_rows(w_tile0, params + w2_0, out0, out0, hidden0);
    hodf_copy_rows(w_tile1, params + w2_1, out1, out1, hidden1);
    hodf_copy_rows(a_tile0, hid + (long long)row0 * hidden0, TRUNK_BM, live, hidden0);
    hodf_copy_rows(a_tile1, hid + hid_off1 + (long long)row0 * hidden1, TRUNK_BM, live, hidden1);
    trunk_cp_commit();

    // In flight with the copies: the dueling's branch table and z of the lane's atoms, the
    // warp's tiles and the lane's b2 values.
    const int na = n_actions[d];
    const int first_row = rows * action_offset[d];  // branch d's first packed row
    const int lane = threadIdx.x & 31;
    const bool want_q = with_q != 0;
    float z_lane[kDuelingRegChunks];
    dueling_z_lane(z_lane, z, want_q, num_atoms, lane);

    // The second layers' operands: warp w's n8 tiles w + HODF_WARPS i (the value head's first).
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;
    const int t4 = lane & 3;
    const int tiles0 = (out0 + 7) / 8;
    const int tiles = tiles0 + (out1 + 7) / 8;
    float acc[HODF_TILES][4];
    float bias[HODF_TILES][2];  // b2 of the lane's two output columns
    const float* a_row[HODF_TILES];
    const float* w_row[HODF_TILES][2];
    int stride[HODF_TILES], quads[HODF_TILES], side[HODF_TILES], n0[HODF_TILES];
    int k_quads = 0;
#pragma unroll
    for (int i = 0; i < HODF_TILES; ++i) {
        const int tile = warp + HODF_WARPS * i;
        const int s = tile < tiles0 ? 0 : 1;
        const int hidden = s == 0 ? hidden0 : hidden1;
        const int width = s == 0 ? out0 : out1;
        side[i] = s;
        n0[i] = (s == 0 ? tile : tile - tiles0) * 8;
        stride[i] = s == 0 ? stride0 : stride1;
        quads[i] = tile < tiles ? hidden / 4 : 0;
        k_quads = max(k_quads, quads[i]);
        a_row[i] = (s == 0 ? a_tile0 : a_tile1) + g * stride[i];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            // A padding column past `width` reads the last row (its output is never stored).
            const int o = min(n0[i] + t4 * 2 + e, width - 1);
            w_row[i][e] = (s == 0 ? w_tile0 : w_tile1) + o * stride[i];
            const int oc = n0[i] + t4 * 2 + e;
            bias[i][e] = (tile < tiles && oc < width) ? params[(s == 0 ? b2_0 : b2_1) + oc] : 0.0f;
        }
        acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    }
    trunk_cp_wait_all();
    __syncthreads();

    // acc[2 half + e] += A[g + 8 half][k] W2[n0 + 2 t4 + e][k], k in order, one fmaf each, a
    // quad (4 k) of both operands a float4 read.
#pragma unroll 2
    for (int kq = 0; kq < k_quads; ++kq) {
#pragma unroll
        for (int i = 0; i < HODF_TILES; ++i) {
            if (kq < quads[i]) {
                const float4 a0 = *reinterpret_cast<const float4*>(a_row[i] + kq * 4);
                const float* a8 = a_row[i] + 8 * stride[i];  // row g + 8
                const float4 a1 = *reinterpret_cast<const float4*>(a8 + kq * 4);
                const float4 b0 = *reinterpret_cast<const float4*>(w_row[i][0] + kq * 4);
                const float4 b1 = *reinterpret_cast<const float4*>(w_row[i][1] + kq * 4);
                const float av[2][4] = {{a0.x, a0.y, a0.z, a0.w}, {a1.x, a1.y, a1.z, a1.w}};
                const float bv[2][4] = {{b0.x, b0.y, b0.z, b0.w}, {b1.x, b1.y, b1.z, b1.w}};
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            float& c = acc[i][2 * half + e];
                            c = fmaf(av[half][kk], bv[e][kk], c);
                        }
                    }
                }
            }
        }
    }
    hod_finish<HODF_TILES, HODF_WARPS>(acc, bias, quads, side, n0, g, t4, warp, lane, d, row0, rows,
                                       out0, out1, v, adv + out_off1, o_tile0, o_tile1, z_lane, na,
                                       first_row, logits, logp, q, want_q, num_atoms);
}

// =============================================================================================
// heads_dh2_tf32: the heads' input gradients into the trunk, summed, and the trunk's masks, in
// ONE launch (issue 26; SPEC 11's concatenated head first layers in the backward: one product of
// k = sum(hidden) with every head's W1 read where it lies). Reference:
// foxhunt.reference.kernels.trunk.heads_dh2_tf32, the composition of the nodes it replaces:
//   part_h  = dhid_h @ W1_h                       per head h ([rows, hidden_h] @ [hidden_h, H2];
//                                                  gemm(mode="tf32"), the step's TF32 GEMM)
//   dh2_out = ((0 + part_1) + part_2) + ... + part_0   the reference's order: the branch heads
//                                                  1 .. n_heads - 1, then the value head 0
//   out     = ha_h2_mask(dh2_out, h2, h2_pre)      (step.h2_grad_sum_mask: Mech 10's clamp and
//                                                  the trunk ReLU)
// dhid: the heads' [rows, hidden_h] blocks packed as hid (heads_block_offsets with hid_align);
// W1_h [hidden_h, H2] float32 at params + table[h].w1; h2, h2_pre, dh2_out and out [rows, H2].
//
// Work: a thread-block cluster (cluster.cuh: FH_CLUSTER blocks) owns a HDH_BM x HDH_BN tile of
// both outputs; grid (ceil(H2 / HDH_BN) FH_CLUSTER, ceil(rows / HDH_BM)), HDH_THREADS threads.
// With clusters each head gets bph = FH_CLUSTER / n_heads blocks (cluster rank r: head r / bph,
// slice r % bph; ranks past n_heads bph idle), which split the head's k range in multiples of 8.
// A block walks its range in chunks of HDH_KC: its threads stage the chunk's HDH_BM rows of dhid_h
// and its rows of W1_h's HDH_BN columns in shared memory (cp.async, 16 bytes where aligned; zeros
// past the matrices and past the block's range), then its 8 warps (4 x 2: 16 rows x 32 columns
// each) multiply them (mma.sync m16n8k8, cvt.rna TF32 operands = tf32_round, f32 accumulation).
// Its partial tile goes to its shared memory (over the staging buffers); after a cluster
// barrier, block r reduces rows r, r + FH_CLUSTER, .. of the cluster's tile: a head's part is its
// blocks' partial sums added in slice order (distributed shared memory), the parts are added in
// the reference's order from +0, then the mask and both stores; a second cluster barrier keeps
// every block's partials alive until they are read. Without clusters (before sm_90) the one block
// takes the heads in the reference's order, each head's part in registers added to the running
// sum. The bits depend on the heads' widths, n_heads and FH_CLUSTER only, not on the grid.
// Dynamic shared memory (floats): HDH_KC (HDH_BM + 4) + HDH_KC (HDH_BN + 8), at least HDH_BM
// HDH_BN (fast/kernels/trunk.py heads_dh2_shared_bytes; the paddings make the fragment reads
// conflict-free).
//
// NaN/Inf contract (the nodes'): IEEE through the products and sums: a NaN or Inf in row i of
// dhid_h reaches row i of dh2_out, one in row k of W1_h (a column c) column c of every row (Inf *
// 0 is NaN); the TF32 rounding keeps NaN and Inf; the mask is h2_grad_sum_mask's (a NaN h2_pre
// or h2_pre <= 0 gives +0 whatever the sum; h2 != h2_pre gives +0). Requirements (the launcher
// checks): 1 <= n_heads <= HEADS_MAX (= FH_CLUSTER on sm_90), positive widths.
// =============================================================================================
#define HDH_BM 64
#define HDH_BN 64
#define HDH_KC 64
#define HDH_WARPS 8
#define HDH_THREADS (HDH_WARPS * 32)
#define HDH_ASS (HDH_KC + 4)
#define HDH_BSS (HDH_BN + 8)

// The block stages rows [r0, r0 + NR) x columns [c0, c0 + 4 Q) of the row-major matrix g (row
// stride ld) into s (row stride ss): element (r, c) is copied where r < r_end and c < c_end, else
// +0.0 is stored. Thread i takes the flattened quads i, i + HDH_THREADS, .. (a row's Q quads
// consecutive; Q a compile-time power of two, so no division). A quad's copy is
// tf32_mma.cuh's gemm_tf32_stage's, written out again: a helper shared with it changed
// gemm_tf32's code under NVRTC 13.0 (session 45), and such folds of the backward GEMM kernels
// measured slower (session 35).
template <int NR, int Q>
static __device__ __forceinline__ void hdh_stage(float* s, int ss, const float* g, long long ld,
                                                 int r0, int r_end, int c0, int c_end, bool vec) {
#pragma unroll
    for (int i = threadIdx.x; i < NR * Q; i += HDH_THREADS) {
        const int r = i / Q, cc = (i - r * Q) * 4;
        const int gr = r0 + r, gc = c0 + cc;
        float* d = s + r * ss + cc;
        const float* src = g + (long long)gr * ld + gc;
        if (vec && gr < r_end && gc + 3 < c_end) {
            const unsigned sa = (unsigned)__cvta_generic_to_shared(d);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sa), "l"(src) : "memory");
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (gr < r_end && gc + j < c_end) {
                    const unsigned sa = (unsigned)__cvta_generic_to_shared(d + j);
                    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(sa), "l"(src + j)
                                 : "memory");
                } else {
                    d[j] = 0.0f;
                }
            }
        }
    }
}

// acc += this block's share of head `head`: k range [first, last) of dhid_h [rows, k] @ W1_h
// [k, n] for the tile at (m0, n0), in chunks of HDH_KC (a block barrier around each chunk).
static __device__ __forceinline__ void hdh_accumulate(float (&acc)[4][4], float* smem,
                                                      const float* a, const float* w1, int k,
                                                      int first, int last, int rows, int n,
                                                      int m0, int n0) {
    float* as = smem;
    float* bs = smem + HDH_BM * HDH_ASS;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wr = (w >> 1) * 16, wc = (w & 1) * 32;  // the warp's 16 rows x 32 columns
    const int k_end = min(k, last);
    const bool a_vec = ((k & 3) == 0) && ((reinterpret_cast<size_t>(a) & 15) == 0);
    const bool b_vec = ((n & 3) == 0) && ((reinterpret_cast<size_t>(w1) & 15) == 0);
    for (int kc = first; kc < last; kc += HDH_KC) {
        __syncthreads();  // the previous chunk's (or the previous head's) fragments are read
        hdh_stage<HDH_BM, HDH_KC / 4>(as, HDH_ASS, a, k, m0, rows, kc, k_end, a_vec);
        hdh_stage<HDH_KC, HDH_BN / 4>(bs, HDH_BSS, w1, n, kc, k_end, n0, n, b_vec);
        trunk_cp_commit();
        asm volatile("cp.async.wait_group 0;" ::: "memory");
        __syncthreads();
        const int kn = min(HDH_KC, last - kc);
        for (int kb = 0; kb < kn; kb += 8) {
            const int r = wr + g;
            const unsigned a0 = gemm_tf32_bits(as[r * HDH_ASS + kb + t]);
            const unsigned a1 = gemm_tf32_bits(as[(r + 8) * HDH_ASS + kb + t]);
            const unsigned a2 = gemm_tf32_bits(as[r * HDH_ASS + kb + t + 4]);
            const unsigned a3 = gemm_tf32_bits(as[(r + 8) * HDH_ASS + kb + t + 4]);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const unsigned b0 = gemm_tf32_bits(bs[(kb + t) * HDH_BSS + wc + 8 * j + g]);
                const unsigned b1 = gemm_tf32_bits(bs[(kb + t + 4) * HDH_BSS + wc + 8 * j + g]);
                gemm_tf32_mma(acc[j], a0, a1, a2, a3, b0, b1);
            }
        }
    }
}

// Head h's k range [first, last) for slice `slice` of `slices` (multiples of 8, as gemm_tf32's
// warps split k) and its operands.
static __device__ __forceinline__ void hdh_head(const int* table, const float* dhid,
                                                const float* params, int h, int slice, int slices,
                                                int rows, int hid_align, const float*& a,
                                                const float*& w1, int& k, int& first, int& last) {
    k = table[h * HEADS_FIELDS];
    w1 = params + table[h * HEADS_FIELDS + 2];
    int hid_off, out_off;
    heads_block_offsets(table, h, rows, hid_align, hid_off, out_off);
    a = dhid + hid_off;
    const int steps = (k + 7) >> 3;
    const int per = (steps + slices - 1) / slices;
    first = min(steps, slice * per) * 8;
    last = min(steps * 8, first + per * 8);
}

extern "C" __global__ void __launch_bounds__(HDH_THREADS) __cluster_dims__(FH_CLUSTER, 1, 1)
heads_dh2_tf32(const float* __restrict__ dhid, const float* __restrict__ params,
               const int* __restrict__ table, const float* __restrict__ h2,
               const float* __restrict__ h2_pre, float* __restrict__ dh2_out,
               float* __restrict__ out, int rows, int h2_width, int n_heads, int hid_align) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    extern __shared__ float4 heads_dh2_smem4[];
    float* smem = reinterpret_cast<float*>(heads_dh2_smem4);
    const int rank = fh_cluster_rank();
    const int m0 = blockIdx.y * HDH_BM, n0 = (blockIdx.x / FH_CLUSTER) * HDH_BN;
    const int n = h2_width;
    float acc[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    int bph = FH_CLUSTER / n_heads;  // blocks a head (0 without clusters: one block, every head)
    if (bph > 0) {
        const int head = rank / bph;
        if (head < n_heads) {
            const float *a, *w1;
            int k, first, last;
            hdh_head(table, dhid, params, head, rank - head * bph, bph, rows, hid_align, a, w1, k,
                     first, last);
            hdh_accumulate(acc, smem, a, w1, k, first, last, rows, n, m0, n0);
        }
    } else {  // one block: the heads in the reference's order, the parts summed in registers
        bph = 1;
        float total[4][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) total[j][0] = total[j][1] = total[j][2] = total[j][3] = 0.0f;
        for (int s = 1; s <= n_heads; ++s) {
            const float *a, *w1;
            int k, first, last;
            hdh_head(table, dhid, params, s == n_heads ? 0 : s, 0, 1, rows, hid_align, a, w1, k,
                     first, last);
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
            hdh_accumulate(acc, smem, a, w1, k, first, last, rows, n, m0, n0);
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) total[j][e] = total[j][e] + acc[j][e];
        }
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[j][e] = total[j][e];
        n_heads = 1;  // the one partial tile is the sum
    }
    __syncthreads();  // every staged fragment read: the partial tile goes over the staging
    {
        const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
        const int wr = (w >> 1) * 16, wc = (w & 1) * 32;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float* p = smem + (wr + g) * HDH_BN + wc + 8 * j + 2 * t;
            p[0] = acc[j][0];
            p[1] = acc[j][1];
            p[8 * HDH_BN] = acc[j][2];
            p[8 * HDH_BN + 1] = acc[j][3];
        }
    }
    fh_cluster_sync();  // every block's partial tile written
    // Block `rank` reduces the tile's rows rank, rank + FH_CLUSTER, ...
    for (int o = threadIdx.x; o < (HDH_BM / FH_CLUSTER) * HDH_BN; o += HDH_THREADS) {
        const int tr = (o / HDH_BN) * FH_CLUSTER + rank, tc = o % HDH_BN;
        const float* local = smem + tr * HDH_BN + tc;
        float sum = 0.0f;
        for (int s = 1; s <= n_heads; ++s) {
            const int first_block = (s == n_heads ? 0 : s) * bph;
            float part = fh_cluster_read(local, first_block);
            for (int q = 1; q < bph; ++q) part += fh_cluster_read(local, first_block + q);
            sum = sum + part;
        }
        const int row = m0 + tr, col = n0 + tc;
        if (row < rows && col < n) {
            const long long x = (long long)row * n + col;
            dh2_out[x] = sum;
            out[x] = ha_h2_mask(sum, h2[x], h2_pre[x]);
        }
    }
    fh_cluster_sync();  // no block exits while another may still read its partial tile
}
