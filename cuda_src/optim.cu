// Optimiser kernels (SPEC 4 steps 5, 6, 9): gradient norms, budget clip and SAXPYs, Adam,
// Polyak. Twins of foxhunt.reference.kernels.optim; each kernel's contract (formula, order of
// roundings, NaN rules) is the reference docstring of the same name.
//
// Scalars that change inside a captured step (a norm computed on the device, Adam's step
// counter, the safety-clip factor, the ISV-driven weight clamp) are read through device
// pointers, so a graph replays with the current values; configuration constants are passed by
// value. Elementwise kernels use grid-stride loops and give the same bits for any launch
// shape; reductions use the fixed trees of reduce.cuh (their bits depend on blockDim.x, which
// the launch plans in fast/kernels/optim.py fix).
#include "early_launch.cuh"  // fh_early_wait, fh_early_release
#include "reduce.cuh"
#include "bf16_bits.cuh"  // f32_to_bf16_bits, bf16_quad_bits (shared with dense.cu)
#include "flat.cuh"  // the Polyak update's vector path
#include "ha_common.cuh"  // nan_check_fires (polyak_update_mirror_check's sentinel test)

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

// Budget clip factor (reference clip_scale): n = sqrtf(fmaxf(norm_sq, 0)) (NaN -> 0);
// s = max_norm / n if n > max_norm and n > 0, else 1. Finite and in [0, 1] for max_norm >= 0.
__device__ __forceinline__ float hb_clip_scale(float norm_sq, float max_norm) {
    const float n = __fsqrt_rn(fmaxf(norm_sq, 0.0f));
    return (n > max_norm && n > 0.0f) ? __fdiv_rn(max_norm, n) : 1.0f;
}

// Budget tail element (clip_grad_inplace, then clipped_saxpy): c = base * s_base, then
// c + a * (inject * s_inject) where inject * s_inject is finite, else c. The very expressions of
// the two unfused kernels, so the fused kernel gives their bits.
__device__ __forceinline__ float hb_clip_saxpy(float base, float inject, float s_base, float a,
                                               float s_inject) {
    return ha_guarded_axpy(__fmul_rn(base, s_base), __fmul_rn(inject, s_inject), a);
}

// Polyak blend element: keep * target + tau * online (keep = 1 - tau; products rounded, then
// the sum).
__device__ __forceinline__ float hb_polyak(float keep, float target, float tau, float online) {
    return __fadd_rn(__fmul_rn(keep, target), __fmul_rn(tau, online));
}

// Grid-stride loop bounds: thread's first index and the stride.
__device__ __forceinline__ long long hb_first_index() {
    return (long long)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ long long hb_grid_stride() {
    return (long long)gridDim.x * blockDim.x;
}

// ---------------------------------------------------------------------------------------------
// Gradient norms
// ---------------------------------------------------------------------------------------------

// grad_norm_sq: out[0] = sum of x_i^2 over the finite x_i (float32). One block strides over the
// whole buffer (thread_partial, then block_sum). The trainer's large buffers use the
// two-phase pair below, which spreads the reads over many blocks.
// Launch: grid 1, block a multiple of 32 (plan_grad_norm_sq).
extern "C" __global__ void __launch_bounds__(REDUCE_MAX_THREADS)
grad_norm_sq(const float* __restrict__ x, long long n, float* __restrict__ out) {
    __shared__ float scratch[REDUCE_WARP + 1];
    const float partial = thread_partial(x, 0, n, FiniteSquare());
    const float total = block_sum(partial, scratch);
    if (threadIdx.x == 0) {
        out[0] = __fadd_rn(total, 0.0f);  // an empty sum (-0.0) reads +0.0, as in the reference
    }
}

// grad_norm_partial: partials[k] = sum of finite x_i^2 for i in [k*block_size, (k+1)*block_size)
// (clipped to n). Segment k is reduced with the fixed tree of thread_partial + block_sum
// (reduce.cuh): thread t's partial over the chunks of 4 consecutive elements t, t + T, ...
// (T = blockDim.x; chunk and element indices relative to the segment's start), accumulator j
// summing element j of its chunks in order, the last partial chunk going to thread chunks % T,
// the partial (a0 + a1) + (a2 + a3); then each warp's butterfly and warp 0's butterfly over the
// warp sums in warp order, padded with -0.0. Never NaN; +Inf only if a finite square overflowed.
// Grid-independent: block b reduces the segments b, b + gridDim.x, ... one after the other, each
// with the whole block and the tree above, so any gridDim.x >= 1 gives the same outputs (a
// population may then launch fewer blocks per member than the plan: fast/population_engine.py's
// GRID_SHARED_KERNELS).
// Throughput (populations launch N members' grids at once): a segment shorter than 2^31 (every
// segment of the plans; the 64-bit thread_partial otherwise) is read with 32-bit indices, four
// of a thread's chunks loaded before any is summed (gnp_thread_partial: thread_partial's sums in
// its order), and the block sum takes one barrier per segment (gnp_block_total: block_sum's tree;
// only thread 0 needs the total; two scratch rows used in turn).
// Launch: grid ceil(n / block_size) (at least 1; any grid >= 1 gives the same partials), block a
// multiple of 32 (plan_grad_norm_partial).

// Launch bounds of the segment kernels (grad_norm_partial, clip_saxpy_norm_partial[_wave]): their
// plans launch at most PARTIAL_MAX_THREADS = 256 threads per block (fast/kernels/optim.py), and
// the bound leaves registers for GNP_MIN_BLOCKS (32 per thread: a full SM) resp.
// HB_BUDGET_MIN_BLOCKS (48 per thread) such blocks per SM, without spills (sm_80, sm_90; plain
// and member builds).
#define HB_PARTIAL_MAX_THREADS 256
#define GNP_MIN_BLOCKS 8
#define HB_BUDGET_MIN_BLOCKS 5

// Segments of block_size elements covering n >= 0 elements: ceil(n / block_size), no overflow.
__device__ __forceinline__ long long hb_segments(long long n, long long block_size) {
    return n <= 0 ? 0 : (n - 1) / block_size + 1;
}

// One chunk's four finite squares into the accumulators (thread_partial_as's step).
__device__ __forceinline__ void gnp_add_chunk(float& a0, float& a1, float& a2, float& a3,
                                              float4 q) {
    const FiniteSquare sq;
    a0 = __fadd_rn(a0, sq(q.x));
    a1 = __fadd_rn(a1, sq(q.y));
    a2 = __fadd_rn(a2, sq(q.z));
    a3 = __fadd_rn(a3, sq(q.w));
}

// Chunk c of the range at `base` (4 consecutive floats), as a float4 where `aligned` (base is
// 16-byte aligned), element by element otherwise: the same four values.
__device__ __forceinline__ float4 gnp_chunk(const float* __restrict__ base, unsigned c,
                                            bool aligned) {
    if (aligned) {
        return reinterpret_cast<const float4*>(base)[c];
    }
    const float* q = base + 4 * c;
    return make_float4(q[0], q[1], q[2], q[3]);
}

// thread_partial(x, begin, begin + len, FiniteSquare()) for len < 2^31 with 32-bit indices: the
// same chunks to the same thread, summed in the same order (chunk c before c + T), the same
// tail, the same final (a0 + a1) + (a2 + a3). Only the loads move: a thread issues the loads of
// four of its chunks (c, c + T, c + 2T, c + 3T) before summing them in that order.
__device__ __forceinline__ float gnp_thread_partial(const float* __restrict__ base,
                                                    unsigned len) {
    const unsigned chunks = len / 4;
    const unsigned t = threadIdx.x, threads = blockDim.x;
    const bool aligned = (reinterpret_cast<unsigned long long>(base) & 15) == 0;
    float a0 = REDUCE_SUM_IDENTITY, a1 = REDUCE_SUM_IDENTITY;
    float a2 = REDUCE_SUM_IDENTITY, a3 = REDUCE_SUM_IDENTITY;
    unsigned c = t;
    // c + 3 T < chunks <= 2^29 and T <= 1024: no wrap-around.
    for (; c + 3 * threads < chunks; c += 4 * threads) {
        const float4 q0 = gnp_chunk(base, c, aligned);
        const float4 q1 = gnp_chunk(base, c + threads, aligned);
        const float4 q2 = gnp_chunk(base, c + 2 * threads, aligned);
        const float4 q3 = gnp_chunk(base, c + 3 * threads, aligned);
        gnp_add_chunk(a0, a1, a2, a3, q0);
        gnp_add_chunk(a0, a1, a2, a3, q1);
        gnp_add_chunk(a0, a1, a2, a3, q2);
        gnp_add_chunk(a0, a1, a2, a3, q3);
    }
    for (; c < chunks; c += threads) {  // at most three chunks left
        gnp_add_chunk(a0, a1, a2, a3, gnp_chunk(base, c, aligned));
    }
    const unsigned tail = 4 * chunks;  // 0 to 3 elements left, the next chunk in turn
    if (tail < len && t == chunks % threads) {
        const FiniteSquare sq;
        a0 = __fadd_rn(a0, sq(base[tail]));
        if (tail + 1 < len) {
            a1 = __fadd_rn(a1, sq(base[tail + 1]));
        }
        if (tail + 2 < len) {
            a2 = __fadd_rn(a2, sq(base[tail + 2]));
        }
    }
    return __fadd_rn(__fadd_rn(a0, a1), __fadd_rn(a2, a3));
}

// block_sum(v, scratch)'s value for thread 0 (other threads: unspecified): each warp's warp_sum,
// then warp 0's warp_sum over the warp sums in warp order padded with REDUCE_SUM_IDENTITY: the
// same tree, with one barrier (no broadcast). `scratch` holds REDUCE_WARP floats of shared
// memory. No leading barrier: a loop over segments passes two rows in turn (GNP_ROW), so the
// row written here was last read by warp 0 two calls ago, before the barrier of the previous
// call, which every warp has passed. Every thread of the block must call it; blockDim.x % 32 == 0.
__device__ __forceinline__ float gnp_block_total(float v, float* scratch) {
    const int lane = threadIdx.x % REDUCE_WARP;
    const int warp = threadIdx.x / REDUCE_WARP;
    const int warps = blockDim.x / REDUCE_WARP;
    v = warp_sum(v);
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    float s = REDUCE_SUM_IDENTITY;
    if (warp == 0) {
        s = lane < warps ? scratch[lane] : REDUCE_SUM_IDENTITY;
        s = warp_sum(s);
    }
    return s;
}

// The scratch row of a block's k-th segment (k = 0, 1, ...): the two rows in turn.
#define GNP_ROW(scratch, k) ((scratch)[(k) & 1])

extern "C" __global__ void __launch_bounds__(HB_PARTIAL_MAX_THREADS, GNP_MIN_BLOCKS)
grad_norm_partial(const float* __restrict__ x, long long n, long long block_size,
                  float* __restrict__ partials) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    fh_early_release();
    __shared__ float scratch[2][REDUCE_WARP];
    const long long segments = hb_segments(n, block_size);  // 0 for n == 0: nothing written
    unsigned k = 0;
    // Trip count and every branch: kernel arguments and blockIdx/gridDim only, uniform.
    for (long long seg = blockIdx.x; seg < segments; seg += gridDim.x, ++k) {
        const long long begin = seg * block_size;
        const long long end = min(begin + block_size, n);
        const float partial = (end - begin <= 0x7fffffffLL)
                                  ? gnp_thread_partial(x + begin, (unsigned)(end - begin))
                                  : thread_partial(x, begin, end, FiniteSquare());
        const float total = gnp_block_total(partial, GNP_ROW(scratch, k));
        if (threadIdx.x == 0) {
            partials[seg] = __fadd_rn(total, 0.0f);  // an all-skipped segment reads +0.0
        }
    }
}

// grad_norm_final: out[0] = sum_k partials[k], plain float32 sum (nothing skipped: a +Inf
// partial gives +Inf, a NaN would propagate). Empty gives 0.
// Launch: grid 1, block a multiple of 32 (plan_grad_norm_final).
extern "C" __global__ void __launch_bounds__(REDUCE_MAX_THREADS)
grad_norm_final(const float* __restrict__ partials, long long count, float* __restrict__ out) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    __shared__ float scratch[REDUCE_WARP + 1];
    const float partial = thread_partial(partials, 0, count, SumIdentity());
    const float total = block_sum(partial, scratch);
    if (threadIdx.x == 0) {
        out[0] = __fadd_rn(total, 0.0f);  // NumPy's sums start at +0.0: never -0.0
    }
}

// ---------------------------------------------------------------------------------------------
// Budget clip and SAXPYs
// ---------------------------------------------------------------------------------------------

// clip_grad_inplace: x_i *= s, s = clip_scale(*norm_sq, max_norm). Plain multiply: NaN stays
// NaN, +/-Inf stays +/-Inf for s > 0 and becomes NaN for s = 0.
extern "C" __global__ void clip_grad_inplace(float* __restrict__ x, long long n, float max_norm,
                                             const float* __restrict__ norm_sq) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    const float s = hb_clip_scale(*norm_sq, max_norm);
    for (long long i = hb_first_index(); i < n; i += hb_grid_stride()) {
        x[i] = __fmul_rn(x[i], s);
    }
}

// saxpy: y_i = y_i + a * x_i where x_i is finite; y_i kept bit for bit otherwise.
// Work per thread (the same operation per element on every path, so the bits depend on neither
// the path nor the launch shape: any gridDim.x >= 1 gives the same y): where y and x are 16-byte
// aligned and fh_flat_narrow(n) holds (grid-uniform tests), thread t updates the 4-element
// groups t, t + T, ... (T threads in the grid; 32-bit indices, one float4 load of each array and
// one float4 store of y per group) and the n % 4 tail elements one per thread (flat.cuh); a
// misaligned pointer takes a 32-bit scalar grid-stride loop, n >= 2^31 the 64-bit one.
// plan_saxpy launches one thread per 4 elements.
extern "C" __global__ void saxpy(float* __restrict__ y, const float* __restrict__ x, long long n,
                                 float a) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    if (!fh_flat_narrow(n)) {  // the 64-bit loop
        for (long long i = hb_first_index(); i < n; i += hb_grid_stride()) {
            y[i] = ha_guarded_axpy(y[i], x[i], a);
        }
        return;
    }
    const unsigned int m = (unsigned int)n, first = fh_flat_first(), stride = fh_flat_stride();
    if (fh_aligned(y, 16) && fh_aligned(x, 16)) {
        float4* __restrict__ y4 = reinterpret_cast<float4*>(y);
        const float4* __restrict__ x4 = reinterpret_cast<const float4*>(x);
        for (unsigned int g = first; g < m / 4; g += stride) {
            const float4 xv = x4[g];
            const float4 yv = y4[g];
            y4[g] = make_float4(ha_guarded_axpy(yv.x, xv.x, a), ha_guarded_axpy(yv.y, xv.y, a),
                                ha_guarded_axpy(yv.z, xv.z, a), ha_guarded_axpy(yv.w, xv.w, a));
        }
        // the tail: n % 4 elements, one per thread (a loop: any grid covers it)
        for (unsigned int i = fh_flat_tail(m, first); i < m; i += stride) {
            y[i] = ha_guarded_axpy(y[i], x[i], a);
        }
    } else {
        for (unsigned int i = first; i < m; i += stride) {
            y[i] = ha_guarded_axpy(y[i], x[i], a);
        }
    }
}

// clipped_saxpy: y_i = y_i + a * (x_i * s) where x_i * s is finite (s = clip_scale(*norm_sq,
// max_norm), finite in [0, 1], so that is where x_i is finite). x is not modified.
extern "C" __global__ void clipped_saxpy(float* __restrict__ y, const float* __restrict__ x,
                                         long long n, float a, float max_norm,
                                         const float* __restrict__ norm_sq) {
    const float s = hb_clip_scale(*norm_sq, max_norm);
    for (long long i = hb_first_index(); i < n; i += hb_grid_stride()) {
        y[i] = ha_guarded_axpy(y[i], __fmul_rn(x[i], s), a);
    }
}

// The budget tail (clip_saxpy_norm_partial, clip_saxpy_norm_partial_wave): out_i =
// hb_clip_saxpy(base_i, inject_i) (the wave kernel then injects its sources) and the
// finite-square partial of each block_size segment of out, in one pass over the segment.
//
// A segment's partial reproduces grad_norm_partial's tree term for term, on the values it
// stores: chunks of 4 consecutive elements (indices relative to the segment's start); thread t
// takes chunks t, t + T, ... (T = blockDim.x); accumulator j sums element j of its chunks in
// order; the last, partial chunk goes to thread chunks % T; the partial is (a0 + a1) + (a2 +
// a3); the block then sums with block_sum's tree (gnp_block_total). So, launched with
// grad_norm_partial's block size, the partials are grad_norm_partial(out)'s bit for bit, and out
// is clip_grad_inplace + clipped_saxpy's. A chunk is read and stored as float4s where the
// segment's base, inject and out starts are 16-byte aligned, element by element otherwise (the
// same values).
//
// Grid-independent: every block computes the source norms once (the same tree in every block:
// the same bits), then handles the segments b, b + gridDim.x, ... (b = blockIdx.x) one after the
// other, each with the whole block and the order above; so any gridDim.x >= 1 gives the same
// outputs (a population may launch fewer blocks per member than the plan: GRID_SHARED_KERNELS).
// Throughput (populations: fewer blocks per member, each with several segments): 32-bit indices;
// a thread loads Op::BATCH of its chunks (every array an element reads) before it computes any,
// and loads the first chunks of its next segment before the block sum of the current one, so
// those loads overlap the barrier; the block sum takes one barrier (gnp_block_total, two scratch
// rows in turn). Only loads move: every value is computed by the same operations in the same
// order. n or block_size of 2^31 or more (never planned) takes the 64-bit path
// (hb_budget_segments_wide: hb_clip_saxpy_thread_partial, the same order).
struct HbClipSaxpyOp {
    float s_base, a, s_inject;
    // The 64-bit path's element (its index unused).
    __device__ __forceinline__ float operator()(long long, float base, float inject) const {
        return hb_clip_saxpy(base, inject, s_base, a, s_inject);
    }
    // The segment path's interface (hb_budget_segments): what the op needs at a segment
    // (Local: nothing here), what a chunk reads besides base and inject (Extra: nothing), the
    // chunk of 4 elements at offset j of the segment starting at element `begin`, one element.
    static constexpr int BATCH = 2;  // chunks in flight per thread (HbBudgetBatch)
    struct Local {};
    struct Extra {};
    __device__ __forceinline__ Local local(unsigned, unsigned) const { return Local{}; }
    __device__ __forceinline__ Extra load(const Local&, unsigned, unsigned) const {
        return Extra{};
    }
    __device__ __forceinline__ float4 chunk(const Local&, unsigned, float4 b, float4 y,
                                            const Extra&) const {
        return make_float4(hb_clip_saxpy(b.x, y.x, s_base, a, s_inject),
                           hb_clip_saxpy(b.y, y.y, s_base, a, s_inject),
                           hb_clip_saxpy(b.z, y.z, s_base, a, s_inject),
                           hb_clip_saxpy(b.w, y.w, s_base, a, s_inject));
    }
    __device__ __forceinline__ float element(const Local&, unsigned, unsigned, float b,
                                             float y) const {
        return hb_clip_saxpy(b, y, s_base, a, s_inject);
    }
};

// The 64-bit path: the partial of segment [begin, end) in the order above, element op op(i,
// base_i, inject_i) (i: the element's index in the buffer).
template <class Op>
__device__ __forceinline__ float hb_clip_saxpy_thread_partial(
        const float* __restrict__ base, const float* __restrict__ inject, float* __restrict__ out,
        long long begin, long long end, const Op op) {
    const FiniteSquare sq;
    const float* b = base + begin;
    const float* y = inject + begin;
    float* o = out + begin;
    const long long len = end - begin;
    const long long chunks = len / 4;
    float a0 = REDUCE_SUM_IDENTITY, a1 = REDUCE_SUM_IDENTITY, a2 = REDUCE_SUM_IDENTITY, a3 = REDUCE_SUM_IDENTITY;
    const unsigned long long addresses = reinterpret_cast<unsigned long long>(b) |
                                         reinterpret_cast<unsigned long long>(y) |
                                         reinterpret_cast<unsigned long long>(o);
    if ((addresses & 15) == 0) {
        const float4* b4 = reinterpret_cast<const float4*>(b);
        const float4* y4 = reinterpret_cast<const float4*>(y);
        float4* o4 = reinterpret_cast<float4*>(o);
        for (long long c = threadIdx.x; c < chunks; c += blockDim.x) {
            const float4 qb = b4[c];
            const float4 qy = y4[c];
            float4 r;
            const long long i = begin + 4 * c;
            r.x = op(i, qb.x, qy.x);
            r.y = op(i + 1, qb.y, qy.y);
            r.z = op(i + 2, qb.z, qy.z);
            r.w = op(i + 3, qb.w, qy.w);
            o4[c] = r;
            a0 = __fadd_rn(a0, sq(r.x));
            a1 = __fadd_rn(a1, sq(r.y));
            a2 = __fadd_rn(a2, sq(r.z));
            a3 = __fadd_rn(a3, sq(r.w));
        }
    } else {
        for (long long c = threadIdx.x; c < chunks; c += blockDim.x) {
            const long long i = 4 * c;
            const float b0 = b[i], b1 = b[i + 1], b2 = b[i + 2], b3 = b[i + 3];
            const float y0 = y[i], y1 = y[i + 1], y2 = y[i + 2], y3 = y[i + 3];
            const long long g = begin + i;
            const float r0 = op(g, b0, y0), r1 = op(g + 1, b1, y1), r2 = op(g + 2, b2, y2),
                        r3 = op(g + 3, b3, y3);
            o[i] = r0;
            o[i + 1] = r1;
            o[i + 2] = r2;
            o[i + 3] = r3;
            a0 = __fadd_rn(a0, sq(r0));
            a1 = __fadd_rn(a1, sq(r1));
            a2 = __fadd_rn(a2, sq(r2));
            a3 = __fadd_rn(a3, sq(r3));
        }
    }
    const long long tail = 4 * chunks;  // 0 to 3 elements left, the next chunk in turn
    if (tail < len && threadIdx.x == chunks % blockDim.x) {
        for (long long i = tail; i < len; ++i) {
            const float r = op(begin + i, b[i], y[i]);
            o[i] = r;
            const float term = sq(r);
            if (i == tail) {
                a0 = __fadd_rn(a0, term);
            } else if (i == tail + 1) {
                a1 = __fadd_rn(a1, term);
            } else {
                a2 = __fadd_rn(a2, term);
            }
        }
    }
    return __fadd_rn(__fadd_rn(a0, a1), __fadd_rn(a2, a3));
}

// The segment path (n and block_size below 2^31: 32-bit indices). A segment: its start, its
// length, its whole chunks, whether base, inject and out are 16-byte aligned at its start
// (uniform across the block).
struct HbBudgetSeg {
    unsigned begin, len, chunks;
    bool aligned;
};

__device__ __forceinline__ HbBudgetSeg hb_budget_seg(const float* base, const float* inject,
                                                     const float* out, unsigned begin,
                                                     unsigned n, unsigned block_size) {
    HbBudgetSeg s;
    s.begin = begin;
    s.len = min(block_size, n - begin);
    s.chunks = s.len / 4;
    s.aligned = ((reinterpret_cast<unsigned long long>(base + begin) |
                  reinterpret_cast<unsigned long long>(inject + begin) |
                  reinterpret_cast<unsigned long long>(out + begin)) & 15) == 0;
    return s;
}

// A thread's chunks in flight: Op::BATCH of them, loaded before the first is computed.
template <class Op>
struct HbBudgetBatch {
    float4 b[Op::BATCH], y[Op::BATCH];
    typename Op::Extra x[Op::BATCH];
};

// Loads this thread's chunks c, c + T, ... of segment s (Op::BATCH of them, those below
// s.chunks).
template <class Op>
__device__ __forceinline__ void hb_budget_load(HbBudgetBatch<Op>& q, const float* base,
                                               const float* inject, const HbBudgetSeg& s,
                                               const Op& op, const typename Op::Local& l,
                                               unsigned c) {
    const unsigned threads = blockDim.x;
#pragma unroll
    for (int k = 0; k < Op::BATCH; ++k) {
        const unsigned ck = c + k * threads;
        if (ck < s.chunks) {
            q.b[k] = gnp_chunk(base + s.begin, ck, s.aligned);
            q.y[k] = gnp_chunk(inject + s.begin, ck, s.aligned);
            q.x[k] = op.load(l, s.begin, 4 * ck);
        }
    }
}

__device__ __forceinline__ void hb_store_chunk(float* o, unsigned c, bool aligned, float4 r) {
    if (aligned) {
        reinterpret_cast<float4*>(o)[c] = r;
    } else {
        float* p = o + 4 * c;
        p[0] = r.x;
        p[1] = r.y;
        p[2] = r.z;
        p[3] = r.w;
    }
}

// This thread's partial of segment s (the order above): q holds its first chunks, loaded by
// hb_budget_load(..., threadIdx.x); the later ones are loaded here.
template <class Op>
__device__ __forceinline__ float hb_budget_partial(HbBudgetBatch<Op>& q,
                                                   const float* __restrict__ base,
                                                   const float* __restrict__ inject,
                                                   float* __restrict__ out, const HbBudgetSeg& s,
                                                   const Op& op, const typename Op::Local& l) {
    const FiniteSquare sq;
    const unsigned threads = blockDim.x;
    float a0 = REDUCE_SUM_IDENTITY, a1 = REDUCE_SUM_IDENTITY;
    float a2 = REDUCE_SUM_IDENTITY, a3 = REDUCE_SUM_IDENTITY;
    // c < chunks < 2^29 and T <= 1024: no wrap-around.
    for (unsigned c = threadIdx.x; c < s.chunks;) {
#pragma unroll
        for (int k = 0; k < Op::BATCH; ++k) {
            const unsigned ck = c + k * threads;
            if (ck < s.chunks) {
                const float4 r = op.chunk(l, 4 * ck, q.b[k], q.y[k], q.x[k]);
                hb_store_chunk(out + s.begin, ck, s.aligned, r);
                a0 = __fadd_rn(a0, sq(r.x));
                a1 = __fadd_rn(a1, sq(r.y));
                a2 = __fadd_rn(a2, sq(r.z));
                a3 = __fadd_rn(a3, sq(r.w));
            }
        }
        c += Op::BATCH * threads;
        if (c < s.chunks) {
            hb_budget_load(q, base, inject, s, op, l, c);
        }
    }
    const unsigned tail = 4 * s.chunks;  // 0 to 3 elements left, the next chunk in turn
    if (tail < s.len && threadIdx.x == s.chunks % threads) {
        const float* b = base + s.begin;
        const float* y = inject + s.begin;
        float* o = out + s.begin;
        for (unsigned j = tail; j < s.len; ++j) {
            const float r = op.element(l, s.begin, j, b[j], y[j]);
            o[j] = r;
            const float term = sq(r);
            if (j == tail) {
                a0 = __fadd_rn(a0, term);
            } else if (j == tail + 1) {
                a1 = __fadd_rn(a1, term);
            } else {
                a2 = __fadd_rn(a2, term);
            }
        }
    }
    return __fadd_rn(__fadd_rn(a0, a1), __fadd_rn(a2, a3));
}

// The 64-bit path's segments (never inlined: it keeps its registers out of the segment path's
// count), from this block's first segment `seg` on.
template <class Op>
__device__ __noinline__ void hb_budget_segments_wide(const float* __restrict__ base,
                                                     const float* __restrict__ inject,
                                                     float* __restrict__ out,
                                                     float* __restrict__ partials, long long n,
                                                     long long block_size, long long segments,
                                                     const Op op, float (*scratch)[REDUCE_WARP]) {
    unsigned k = 0;
    for (long long seg = blockIdx.x; seg < segments; seg += gridDim.x, ++k) {
        const long long begin = seg * block_size;
        const long long end = min(begin + block_size, n);
        const float partial = hb_clip_saxpy_thread_partial(base, inject, out, begin, end, op);
        const float total = gnp_block_total(partial, GNP_ROW(scratch, k));
        if (threadIdx.x == 0) {
            partials[seg] = __fadd_rn(total, 0.0f);  // an all-skipped segment reads +0.0
        }
    }
}

// The segments of this block (blockIdx.x, + gridDim.x, ...): out's elements and partials[seg].
// `scratch`: two rows of REDUCE_WARP floats of shared memory (gnp_block_total, GNP_ROW). Every
// branch and trip count depends on kernel arguments and blockIdx/gridDim only: uniform.
template <class Op>
__device__ __forceinline__ void hb_budget_segments(const float* __restrict__ base,
                                                   const float* __restrict__ inject,
                                                   float* __restrict__ out,
                                                   float* __restrict__ partials, long long n,
                                                   long long block_size, const Op& op,
                                                   float (*scratch)[REDUCE_WARP]) {
    const long long segments = hb_segments(n, block_size);  // 0 for n == 0
    if (blockIdx.x >= segments) {
        return;
    }
    if (n > 0x7fffffffLL || block_size > 0x7fffffffLL) {
        hb_budget_segments_wide(base, inject, out, partials, n, block_size, segments, op, scratch);
        return;
    }
    // n < 2^31: segments, their starts and ends (<= n) and seg + gridDim.x fit in 32 bits.
    const unsigned seg_count = (unsigned)segments, n32 = (unsigned)n, bs32 = (unsigned)block_size;
    unsigned seg = blockIdx.x;
    HbBudgetSeg s = hb_budget_seg(base, inject, out, seg * bs32, n32, bs32);
    typename Op::Local l = op.local(s.begin, s.len);
    HbBudgetBatch<Op> q;
    hb_budget_load(q, base, inject, s, op, l, threadIdx.x);
    for (unsigned k = 0;; ++k) {
        const float partial = hb_budget_partial(q, base, inject, out, s, op, l);
        const unsigned next = seg + gridDim.x;
        if (next < seg_count) {  // the next segment's first chunks, in flight during the barrier
            s = hb_budget_seg(base, inject, out, next * bs32, n32, bs32);
            l = op.local(s.begin, s.len);
            hb_budget_load(q, base, inject, s, op, l, threadIdx.x);
        }
        const float total = gnp_block_total(partial, GNP_ROW(scratch, k));
        if (threadIdx.x == 0) {
            partials[seg] = __fadd_rn(total, 0.0f);  // an all-skipped segment reads +0.0
        }
        if (next >= seg_count) {
            break;
        }
        seg = next;
    }
}

// clip_saxpy_norm_partial: the two loss norms' phase 2, the budget tail and phase 1 of the
// total norm, in one launch:
//   base_norm_sq   = grad_norm_final(base_partials[0:count])
//   inject_norm_sq = grad_norm_final(inject_partials[0:count])
//   out = clipped_saxpy(clip_grad_inplace(base, base_max_norm, base_norm_sq), inject, a,
//                       inject_max_norm, inject_norm_sq)
//   partials[k] = the finite-square sum of out's segment k (grad_norm_partial)
// Every block computes both norms itself, once, with grad_norm_final's tree as launched with
// final_threads threads (block_sums_as, both at once; the launcher passes
// plan_grad_norm_final(count)'s block), so they are grad_norm_final's bits; block 0 writes them
// to base_norm_sq_out and inject_norm_sq_out (the step's readback needs them; also for n == 0,
// where there is no segment). Then the block's segments (hb_budget_segments). base, inject and
// the partials are read only; out is a separate buffer. Grid-independent: any gridDim.x >= 1
// gives the same outputs. Launch: grad_norm_partial's (plan_clip_saxpy_norm_partial): grid
// ceil(n / block_size) (at least 1), block a multiple of 32.
extern "C" __global__ void __launch_bounds__(HB_PARTIAL_MAX_THREADS, HB_BUDGET_MIN_BLOCKS)
clip_saxpy_norm_partial(const float* __restrict__ base, const float* __restrict__ inject,
                        long long n, float base_max_norm, const float* __restrict__ base_partials,
                        float a, float inject_max_norm,
                        const float* __restrict__ inject_partials, long long count,
                        long long final_threads, long long block_size, float* __restrict__ out,
                        float* __restrict__ partials, float* __restrict__ base_norm_sq_out,
                        float* __restrict__ inject_norm_sq_out) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    fh_early_release();
    __shared__ float scratch[2][REDUCE_WARP];
    __shared__ float norm_scratch[2][REDUCE_WARP + 1];
    // grad_norm_final's out[0] = __fadd_rn(total, 0.0f) (never -0.0), here for both norms,
    // summed together (block_sums_as: grad_norm_final's tree for each).
    const float* const sources[2] = {base_partials, inject_partials};
    float sums[2];
    block_sums_as(sources, 0, count, SumIdentity(), (int)final_threads, norm_scratch, sums);
    const float base_norm_sq = __fadd_rn(sums[0], 0.0f);
    const float inject_norm_sq = __fadd_rn(sums[1], 0.0f);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        base_norm_sq_out[0] = base_norm_sq;
        inject_norm_sq_out[0] = inject_norm_sq;
    }
    const HbClipSaxpyOp op{hb_clip_scale(base_norm_sq, base_max_norm), a,
                           hb_clip_scale(inject_norm_sq, inject_max_norm)};
    hb_budget_segments(base, inject, out, partials, n, block_size, op, scratch);
}

// clip_saxpy_norm_partial_wave (twin: foxhunt.reference.kernels.wave, which states the
// contract): clip_saxpy_norm_partial with the second-wave sources injected in the same pass,
// so graph 1 ends with one budget launch, not one per source. Per element, in this order:
//   r = clip_saxpy_norm_partial's out_i                 (c51 clip, CQL clipped SAXPY)
//   r = guarded_axpy(r, iqn_i * s_iqn, iqn_a)           for i < iqn_n   (IQN, trunk range)
//   r = guarded_axpy(r, ens_i * s_ens, ens_a)           for i < ens_n   (ensemble, value range)
// with s_src = clip_scale(grad_norm_final(src_partials[0:count]), src_max_norm); partials[k]
// are out's finite-square segment sums (grad_norm_partial). Each norm is grad_norm_final's tree
// with final_threads threads, computed once per block; block 0 writes them. A source whose
// partials pointer is null is off: its n must be 0, its norm is neither read nor written (its
// pointers may be null). Grid-independent as clip_saxpy_norm_partial: any gridDim.x >= 1 gives
// the same outputs.
//
// The sources' reads on the segment path: a chunk's 4 elements j .. j + 3 of a source (p + begin:
// the segment's start) as one float4 where they all lie in its range (the segment's first len
// elements) and are 16-byte aligned, element by element otherwise, none past the range (the
// values are only used inside it; a source that is off has len 0: p is never read).
__device__ __forceinline__ float4 hb_range_quad(const float* p, unsigned begin, unsigned j,
                                                unsigned len) {
    if (j + 4 <= len) {
        const float* q = p + begin + j;
        if (fh_aligned(q, 16)) {
            return *reinterpret_cast<const float4*>(q);
        }
        return make_float4(q[0], q[1], q[2], q[3]);
    }
    float4 r = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (j < len) {
        const float* q = p + begin + j;
        r.x = q[0];
        if (j + 1 < len) {
            r.y = q[1];
        }
        if (j + 2 < len) {
            r.z = q[2];
        }
    }
    return r;
}

// Elements of a source's range [0, src_n) inside the segment [begin, begin + len).
__device__ __forceinline__ unsigned hb_range_in(long long src_n, unsigned begin, unsigned len) {
    return src_n <= (long long)begin ? 0u : (unsigned)min(src_n - (long long)begin, (long long)len);
}

struct HbWaveBudgetOp {
    HbClipSaxpyOp core;
    const float* iqn;
    long long iqn_n;
    float iqn_a, s_iqn;
    const float* ens;
    long long ens_n;
    float ens_a, s_ens;
    // The 64-bit path's element i.
    __device__ __forceinline__ float operator()(long long i, float base, float inject) const {
        float r = core(i, base, inject);
        if (i < iqn_n) {
            r = ha_guarded_axpy(r, __fmul_rn(iqn[i], s_iqn), iqn_a);
        }
        if (i < ens_n) {
            r = ha_guarded_axpy(r, __fmul_rn(ens[i], s_ens), ens_a);
        }
        return r;
    }
    // The segment path (HbClipSaxpyOp's interface). Local: the sources' ranges in the segment
    // (offset j is in iqn's range iff j < iqn_len, i.e. begin + j < iqn_n); Extra: a chunk's
    // 4 elements of each source.
    static constexpr int BATCH = 1;  // chunks in flight per thread (4 arrays each)
    struct Local {
        unsigned iqn_len, ens_len;
    };
    struct Extra {
        float4 q, e;
    };
    __device__ __forceinline__ Local local(unsigned begin, unsigned len) const {
        return Local{hb_range_in(iqn_n, begin, len), hb_range_in(ens_n, begin, len)};
    }
    __device__ __forceinline__ Extra load(const Local& l, unsigned begin, unsigned j) const {
        return Extra{hb_range_quad(iqn, begin, j, l.iqn_len),
                     hb_range_quad(ens, begin, j, l.ens_len)};
    }
    // The two injections of element j after the core's r (operator()'s order).
    __device__ __forceinline__ float sources(const Local& l, unsigned j, float r, float q,
                                             float e) const {
        if (j < l.iqn_len) {
            r = ha_guarded_axpy(r, __fmul_rn(q, s_iqn), iqn_a);
        }
        if (j < l.ens_len) {
            r = ha_guarded_axpy(r, __fmul_rn(e, s_ens), ens_a);
        }
        return r;
    }
    __device__ __forceinline__ float4 chunk(const Local& l, unsigned j, float4 b, float4 y,
                                            const Extra& x) const {
        const float4 r = core.chunk(HbClipSaxpyOp::Local{}, j, b, y, HbClipSaxpyOp::Extra{});
        return make_float4(sources(l, j, r.x, x.q.x, x.e.x), sources(l, j + 1, r.y, x.q.y, x.e.y),
                           sources(l, j + 2, r.z, x.q.z, x.e.z),
                           sources(l, j + 3, r.w, x.q.w, x.e.w));
    }
    __device__ __forceinline__ float element(const Local& l, unsigned begin, unsigned j,
                                             float b, float y) const {
        const float r = core.element(HbClipSaxpyOp::Local{}, begin, j, b, y);
        return sources(l, j, r, j < l.iqn_len ? iqn[begin + j] : 0.0f,
                       j < l.ens_len ? ens[begin + j] : 0.0f);
    }
};

// Launch: clip_saxpy_norm_partial's (plan_clip_saxpy_norm_partial_wave).
extern "C" __global__ void __launch_bounds__(HB_PARTIAL_MAX_THREADS, HB_BUDGET_MIN_BLOCKS)
clip_saxpy_norm_partial_wave(const float* __restrict__ base, const float* __restrict__ inject,
                             long long n, float base_max_norm,
                             const float* __restrict__ base_partials, float a,
                             float inject_max_norm, const float* __restrict__ inject_partials,
                             const float* __restrict__ iqn, long long iqn_n, float iqn_a,
                             float iqn_max_norm, const float* __restrict__ iqn_partials,
                             const float* __restrict__ ens, long long ens_n, float ens_a,
                             float ens_max_norm, const float* __restrict__ ens_partials,
                             long long count, long long final_threads, long long block_size,
                             float* __restrict__ out, float* __restrict__ partials,
                             float* __restrict__ base_norm_sq_out,
                             float* __restrict__ inject_norm_sq_out,
                             float* __restrict__ iqn_norm_sq_out,
                             float* __restrict__ ens_norm_sq_out) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    fh_early_release();
    __shared__ float scratch[2][REDUCE_WARP];
    __shared__ float norm_scratch[4][REDUCE_WARP + 1];
    // Each source's squared norm, grad_norm_final's tree and + 0.0f, all four summed together
    // (block_sums_as); 0 for a source that is off (null partials: uniform across the block).
    const float* const sources[4] = {base_partials, inject_partials, iqn_partials, ens_partials};
    float sums[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    block_sums_as(sources, 0, count, SumIdentity(), (int)final_threads, norm_scratch, sums);
    const float base_norm_sq = base_partials == nullptr ? 0.0f : __fadd_rn(sums[0], 0.0f);
    const float inject_norm_sq = inject_partials == nullptr ? 0.0f : __fadd_rn(sums[1], 0.0f);
    const float iqn_norm_sq = iqn_partials == nullptr ? 0.0f : __fadd_rn(sums[2], 0.0f);
    const float ens_norm_sq = ens_partials == nullptr ? 0.0f : __fadd_rn(sums[3], 0.0f);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        base_norm_sq_out[0] = base_norm_sq;
        inject_norm_sq_out[0] = inject_norm_sq;
        if (iqn_partials != nullptr) {
            iqn_norm_sq_out[0] = iqn_norm_sq;
        }
        if (ens_partials != nullptr) {
            ens_norm_sq_out[0] = ens_norm_sq;
        }
    }
    const HbWaveBudgetOp op{
        {hb_clip_scale(base_norm_sq, base_max_norm), a,
         hb_clip_scale(inject_norm_sq, inject_max_norm)},
        iqn, iqn_partials == nullptr ? 0 : iqn_n, iqn_a, hb_clip_scale(iqn_norm_sq, iqn_max_norm),
        ens, ens_partials == nullptr ? 0 : ens_n, ens_a, hb_clip_scale(ens_norm_sq, ens_max_norm)};
    hb_budget_segments(base, inject, out, partials, n, block_size, op, scratch);
}

// ---------------------------------------------------------------------------------------------
// Adam
// ---------------------------------------------------------------------------------------------

// 1 - beta^t with t rounded to float32 first (the reference's float(t)). The power is taken in
// double and rounded once to float32: the correctly rounded float32 power except in cases of
// probability ~2^-28 (CUDA's pow is within 2 double ulp). See fast/kernels/optim.py on how the
// reference's own float32 power is computed.
__device__ __forceinline__ float hb_bias_correction(float beta, long long step) {
    const float t = __ll2float_rn(step);
    const float power = __double2float_rn(pow((double)beta, (double)t));
    return __fsub_rn(1.0f, power);
}

// adam_update: AdamW with the per-element guard and the Mech 9 clamp, in the reference's order:
//   g = grad * grad_scale;  if !isfinite(g): param, m, v unchanged
//   m = beta1*m + (1-beta1)*g;  v = beta2*v + (1-beta2)*(g*g)
//   mhat = m / bc1;  vhat = v / bc2;  bc_k = 1 - beta_k^t
//   param = param - lr * (mhat / (sqrtf(vhat) + eps) + weight_decay * param)
//   param = isfinite(param) ? clamp(param, -weight_clamp, weight_clamp) : 0
// Device scalars: *step (int64, >= 1), *grad_scale, *weight_clamp (> 0, +inf allowed).
//
// Latency, not bandwidth, bounds this kernel in the step (one pass over ~0.3M elements): each
// thread takes ADAM_UNROLL elements per grid-stride round (i, i + stride, ...), issues their
// loads together, and loads its first round BEFORE the barrier that publishes the per-step
// scalars, so those loads overlap the two double pows (thread 0 computes bc1, the first thread
// of the second warp bc2, in parallel). plan_adam_update sizes the grid to one round where it
// can. The arithmetic per element is the same whatever the grid: the bits do not depend on it.
#define ADAM_UNROLL 2
// adam_update_norm's launch bound: plan_adam_update launches ELEMENTWISE_THREADS = 256 threads
// a block (fast/kernels/optim.py). Unbounded, ptxas gave it 52 registers (sm_90), 4 blocks an
// SM: the seed's 568 blocks in two waves, 6.5 us a node (adam_update 4.4). 5 blocks: 48, one
// wave, 4.7 us (H200, session 29); no spills in the plain builds (sm_80, sm_90), 4 bytes in the
// member builds (6 blocks, 40 registers, spilled 48 bytes there).
#define ADAM_MAX_THREADS 256
#define ADAM_NORM_MIN_BLOCKS 5

struct AdamLoad {
    float g[ADAM_UNROLL], p[ADAM_UNROLL], m[ADAM_UNROLL], v[ADAM_UNROLL];
};

__device__ __forceinline__ void hb_adam_load(AdamLoad& x, const float* __restrict__ param,
                                             const float* __restrict__ grad,
                                             const float* __restrict__ m,
                                             const float* __restrict__ v, long long first,
                                             long long stride, long long n) {
#pragma unroll
    for (int k = 0; k < ADAM_UNROLL; ++k) {
        const long long i = first + k * stride;
        if (i < n) {
            x.g[k] = grad[i];
            x.p[k] = param[i];
            x.m[k] = m[i];
            x.v[k] = v[i];
        } else {
            x.g[k] = x.p[k] = x.m[k] = x.v[k] = 0.0f;  // never stored
        }
    }
}

// Adam's element loop from the first round's loads `x` (hb_adam_load at `first`): every round's
// elements, then the next round's loads. The arithmetic of adam_update's comment.
__device__ __forceinline__ void hb_adam_rounds(AdamLoad& x, float* __restrict__ param,
                                               const float* __restrict__ grad,
                                               float* __restrict__ m, float* __restrict__ v,
                                               long long n, long long first, long long stride,
                                               float lr, float beta1, float beta2, float eps,
                                               float weight_decay, float bc1, float bc2,
                                               float scale, float clamp) {
    const float keep1 = __fsub_rn(1.0f, beta1);
    const float keep2 = __fsub_rn(1.0f, beta2);
    while (first < n) {
#pragma unroll
        for (int k = 0; k < ADAM_UNROLL; ++k) {
            const long long i = first + k * stride;
            const float g = __fmul_rn(x.g[k], scale);
            if (i >= n || !isfinite(g)) {
                continue;  // past the end; or gradient zeroed: param, m, v keep their bits
            }
            const float p = x.p[k];
            const float m_new = __fadd_rn(__fmul_rn(beta1, x.m[k]), __fmul_rn(keep1, g));
            const float v_new = __fadd_rn(__fmul_rn(beta2, x.v[k]),
                                          __fmul_rn(keep2, __fmul_rn(g, g)));
            const float mhat = __fdiv_rn(m_new, bc1);
            const float vhat = __fdiv_rn(v_new, bc2);
            const float step_dir = __fdiv_rn(mhat, __fadd_rn(__fsqrt_rn(vhat), eps));
            const float update = __fadd_rn(step_dir, __fmul_rn(weight_decay, p));
            const float p_new = __fsub_rn(p, __fmul_rn(lr, update));
            param[i] = isfinite(p_new) ? fminf(fmaxf(p_new, -clamp), clamp) : 0.0f;
            m[i] = m_new;
            v[i] = v_new;
        }
        first += ADAM_UNROLL * stride;
        hb_adam_load(x, param, grad, m, v, first, stride, n);
    }
}

// A block's per-step scalars into shared[0..3]: the bias corrections bc1, bc2 (thread 0 and the
// first thread of the second warp: the two double pows in parallel), *third (the gradient scale
// or the clip bound) and *weight_clamp; the caller's next barrier publishes them.
__device__ __forceinline__ void hb_adam_scalars(float* shared, float beta1, float beta2,
                                                const long long* __restrict__ step,
                                                const float* __restrict__ third,
                                                const float* __restrict__ weight_clamp) {
    const int second = blockDim.x > REDUCE_WARP ? REDUCE_WARP : 0;  // thread of bc2 (0: thread 0 too)
    if (threadIdx.x == 0) {
        shared[0] = hb_bias_correction(beta1, *step);
        shared[2] = *third;
        shared[3] = *weight_clamp;
    }
    if (threadIdx.x == second) {
        shared[1] = hb_bias_correction(beta2, *step);
    }
}

extern "C" __global__ void adam_update(float* __restrict__ param, const float* __restrict__ grad,
                                       float* __restrict__ m, float* __restrict__ v, long long n,
                                       const long long* __restrict__ step, float lr, float beta1,
                                       float beta2, float eps, float weight_decay,
                                       const float* __restrict__ grad_scale,
                                       const float* __restrict__ weight_clamp) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    fh_early_release();
    __shared__ float shared[4];  // bc1, bc2, grad_scale, weight_clamp
    hb_adam_scalars(shared, beta1, beta2, step, grad_scale, weight_clamp);
    const long long stride = hb_grid_stride();
    const long long first = hb_first_index();
    AdamLoad x;
    hb_adam_load(x, param, grad, m, v, first, stride, n);
    __syncthreads();
    hb_adam_rounds(x, param, grad, m, v, n, first, stride, lr, beta1, beta2, eps, weight_decay,
                   shared[0], shared[1], shared[2], shared[3]);
}

// adam_update_norm: adam_update with its gradient scale computed from the total norm's phase-1
// partials instead of read from memory (the reference twin composes exactly these):
//   total_sq = grad_norm_final(total_partials[0:n_partials]) + 0.0   (never -0.0)
//   grad_scale = clip_scale(total_sq, *clip_bound)                    (Mech 6, step_scalars')
//   adam_update(param, grad, m, v, ..., grad_scale, weight_clamp)
// Every block sums the partials itself with grad_norm_final's tree as launched with
// final_threads threads (block_sums_as; the launcher passes plan_grad_norm_final(n_partials)'s
// block), so grad_scale is step_scalars' safety_scale bit for bit and Adam need not wait for
// step_scalars, which then runs beside it (fast/graph2_plan.py). The block's first round of
// Adam's loads is issued before the sum, so they overlap it. NaN/Inf: a NaN total_sq gives
// clip_scale 1 (as step_scalars); adam_update's guard otherwise. Grid-independent as adam_update.
extern "C" __global__ void __launch_bounds__(ADAM_MAX_THREADS, ADAM_NORM_MIN_BLOCKS)
adam_update_norm(float* __restrict__ param,
                                            const float* __restrict__ grad,
                                            float* __restrict__ m, float* __restrict__ v,
                                            long long n, const long long* __restrict__ step,
                                            float lr, float beta1, float beta2, float eps,
                                            float weight_decay,
                                            const float* __restrict__ total_partials,
                                            long long n_partials, long long final_threads,
                                            const float* __restrict__ clip_bound,
                                            const float* __restrict__ weight_clamp) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    fh_early_release();
    __shared__ float shared[4];  // bc1, bc2, clip_bound, weight_clamp
    __shared__ float norm_scratch[1][REDUCE_WARP + 1];
    hb_adam_scalars(shared, beta1, beta2, step, clip_bound, weight_clamp);
    const long long stride = hb_grid_stride();
    const long long first = hb_first_index();
    AdamLoad x;
    hb_adam_load(x, param, grad, m, v, first, stride, n);
    const float* const sources[1] = {total_partials};
    float sums[1];
    // Its barriers also publish the shared scalars above.
    block_sums_as(sources, 0, n_partials, SumIdentity(), (int)final_threads, norm_scratch, sums);
    const float scale = hb_clip_scale(__fadd_rn(sums[0], 0.0f), shared[2]);
    hb_adam_rounds(x, param, grad, m, v, n, first, stride, lr, beta1, beta2, eps, weight_decay,
                   shared[0], shared[1], scale, shared[3]);
}

// ---------------------------------------------------------------------------------------------
// Target network
// ---------------------------------------------------------------------------------------------

// polyak_update: target = (1 - tau) * target + tau * online (two products rounded, then the
// sum; 1 - tau rounded once). NaN/Inf propagate.
extern "C" __global__ void polyak_update(float* __restrict__ target,
                                         const float* __restrict__ online, long long n, float tau) {
    const float keep = __fsub_rn(1.0f, tau);
    for (long long i = hb_first_index(); i < n; i += hb_grid_stride()) {
        target[i] = hb_polyak(keep, target[i], tau, online[i]);
    }
}

// polyak_update_mirror: polyak_update, then the BF16 mirrors (f32_to_bf16's bit rounding) of
// the online parameters and of the NEW target: target_i = (1 - tau) * target_i + tau *
// online_i; online_bf16_i = bf16(online_i); target_bf16_i = bf16(target_i). NaN/Inf propagate
// through the blend; the mirrors keep a NaN's sign and high payload (quiet bit set).
//
// Work per thread (the same operations per element on every path, so the bits depend on neither
// the path nor the launch shape): where target and online are 16-byte and the two mirrors 8-byte
// aligned, 0 <= n < 2^31 and the grid has at most 2^21 blocks (grid-uniform tests), thread t
// updates the 4-element groups t, t + T, ... (T threads in the grid; 32-bit indices, one float4
// access per float32 array, one 8-byte store of 4 patterns per mirror) and threads
// 0 .. n % 4 - 1 one tail element each; a misaligned pointer takes a 32-bit scalar grid-stride
// loop, n >= 2^31 the 64-bit one. plan_polyak_update_mirror launches one thread per 4 elements.
// What polyak_update_mirror_check adds to each element (one(p, x): the element at p) and to
// each 4-element group (quad(p, v): the elements p[0..3]): its sentinel test. PolyakNoCheck:
// none (polyak_update_mirror).
struct PolyakNoCheck {
    __device__ __forceinline__ void one(const float*, float) {}
    __device__ __forceinline__ void quad(const float*, float4) {}
};

template <class Check>
__device__ __forceinline__ void hb_polyak_mirror_one(float* __restrict__ target,
                                                     const float* __restrict__ online,
                                                     unsigned short* __restrict__ online_bf16,
                                                     unsigned short* __restrict__ target_bf16,
                                                     float keep, float tau, long long i,
                                                     Check& check) {
    const float o = online[i];
    const float t = hb_polyak(keep, target[i], tau, o);
    target[i] = t;
    online_bf16[i] = f32_to_bf16_bits(o);
    target_bf16[i] = f32_to_bf16_bits(t);
    check.one(online + i, o);
    check.one(target + i, t);
}

// One 4-element group g of the vector path from its loads o (online) and old (target).
template <class Check>
__device__ __forceinline__ void hb_polyak_mirror_quad(float* __restrict__ target,
                                                      const float* __restrict__ online,
                                                      unsigned short* __restrict__ online_bf16,
                                                      unsigned short* __restrict__ target_bf16,
                                                      float keep, float tau, unsigned int g,
                                                      float4 o, float4 old, Check& check) {
    const float4 t = make_float4(hb_polyak(keep, old.x, tau, o.x), hb_polyak(keep, old.y, tau, o.y),
                                 hb_polyak(keep, old.z, tau, o.z), hb_polyak(keep, old.w, tau, o.w));
    reinterpret_cast<float4*>(target)[g] = t;
    reinterpret_cast<uint2*>(online_bf16)[g] = bf16_quad_bits(o);
    reinterpret_cast<uint2*>(target_bf16)[g] = bf16_quad_bits(t);
    check.quad(online + 4 * (long long)g, o);
    check.quad(target + 4 * (long long)g, t);
}

// Whether the vector path applies (grid-uniform): 0 <= n < 2^31, a grid of at most 2^21
// blocks, target and online 16-byte and the mirrors 8-byte aligned.
__device__ __forceinline__ bool hb_polyak_vector(const float* target, const float* online,
                                                 long long n, const unsigned short* online_bf16,
                                                 const unsigned short* target_bf16) {
    return fh_flat_narrow(n) && fh_aligned(target, 16) && fh_aligned(online, 16) &&
           fh_aligned(online_bf16, 8) && fh_aligned(target_bf16, 8);
}

// The update over the thread's elements; with `preloaded`, its first group's loads o0 / old0
// were issued by the caller (polyak_update_mirror_check issues them before reading its table).
template <class Check>
__device__ __forceinline__ void polyak_update_mirror_body(
    float* __restrict__ target, const float* __restrict__ online, long long n, float tau,
    unsigned short* __restrict__ online_bf16, unsigned short* __restrict__ target_bf16,
    Check& check, bool preloaded = false, float4 o0 = float4(), float4 old0 = float4()) {
    const float keep = __fsub_rn(1.0f, tau);
    if (!fh_flat_narrow(n)) {  // the 64-bit loop
        for (long long i = hb_first_index(); i < n; i += hb_grid_stride()) {
            hb_polyak_mirror_one(target, online, online_bf16, target_bf16, keep, tau, i, check);
        }
        return;
    }
    const unsigned int m = (unsigned int)n, first = fh_flat_first(), stride = fh_flat_stride();
    if (hb_polyak_vector(target, online, n, online_bf16, target_bf16)) {
        const float4* __restrict__ target4 = reinterpret_cast<const float4*>(target);
        const float4* __restrict__ online4 = reinterpret_cast<const float4*>(online);
        unsigned int g = first;
        if (preloaded && g < m / 4) {
            hb_polyak_mirror_quad(target, online, online_bf16, target_bf16, keep, tau, g, o0,
                                  old0, check);
            g += stride;
        }
        for (; g < m / 4; g += stride) {
            hb_polyak_mirror_quad(target, online, online_bf16, target_bf16, keep, tau, g,
                                  online4[g], target4[g], check);
        }
        // the tail: n % 4 elements, one per thread (a loop: any grid covers it)
        for (unsigned int i = fh_flat_tail(m, first); i < m; i += stride) {
            hb_polyak_mirror_one(target, online, online_bf16, target_bf16, keep, tau, i, check);
        }
    } else {
        for (unsigned int i = first; i < m; i += stride) {
            hb_polyak_mirror_one(target, online, online_bf16, target_bf16, keep, tau, i, check);
        }
    }
}

extern "C" __global__ void polyak_update_mirror(float* __restrict__ target,
                                                const float* __restrict__ online, long long n,
                                                float tau, unsigned short* __restrict__ online_bf16,
                                                unsigned short* __restrict__ target_bf16) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    fh_early_release();
    PolyakNoCheck none;
    polyak_update_mirror_body(target, online, n, tau, online_bf16, target_bf16, none);
}

// polyak_update_mirror_check: polyak_update_mirror, then nan_check_fused over the sentinel
// entries of the (buffers, lengths, thresholds) tables that are active (a non-null address and
// lengths[k] > 0), in the same pass: entry k fires if one of its elements, as it stands after
// the update (online unchanged, target NEW), is non-finite, or if thresholds[k] > 0 and |x| >=
// thresholds[k]; a firing entry's flags[k] becomes 1 (sticky; nothing else is written to flags).
// Graph 2 checks params and target after Polyak this way (the entries of desc_lens_post), so
// that check is not a node of its own at the end of the step's longest chain.
// Contract (checked by the launchers): at most POLYAK_CHECK_MAX active entries, each lying
// wholly inside [online, online + n) or [target, target + n) (an element elsewhere is not read);
// blockDim.x a multiple of 32. Every block loads the tables (a thread an entry) while its
// threads' first loads of online and target are in flight, and keeps the active entries in
// shared memory in table order; each thread ORs its elements' results into one bit per entry
// (a group of 4 inside an entry tested at once); a warp OR and a shared atomicOr per warp give
// the block's, and its first threads store the flags. A flag is an OR over the elements, so it
// depends on neither the grid nor the path (plan_polyak_update_mirror's launch). NaN/Inf: as
// polyak_update_mirror for the values; the checks see them.
#define POLYAK_CHECK_MAX 32

struct PolyakCheck {
    const unsigned long long* begin;  // shared: the active entries' byte ranges [begin, end)
    const unsigned long long* end;
    const float* threshold;
    int count;
    unsigned int fired;  // bit e: active entry e fired in one of this thread's elements

    __device__ __forceinline__ void one(const float* p, float x) {
        const unsigned long long a = reinterpret_cast<unsigned long long>(p);
        for (int e = 0; e < count; ++e) {
            const float thr = threshold[e];
            if (a >= begin[e] && a < end[e] && nan_check_fires(x, thr > 0.0f, thr)) {
                fired |= 1u << e;
            }
        }
    }
    __device__ __forceinline__ void quad(const float* p, float4 v) {
        const unsigned long long a = reinterpret_cast<unsigned long long>(p);
        for (int e = 0; e < count; ++e) {
            const unsigned long long b = begin[e], z = end[e];
            if (a + 16ull <= b || a >= z) {
                continue;  // the group lies outside entry e
            }
            if (a >= b && a + 16ull <= z) {  // wholly inside
                const float thr = threshold[e];
                const bool mag = thr > 0.0f;
                if (nan_check_fires(v.x, mag, thr) || nan_check_fires(v.y, mag, thr) ||
                    nan_check_fires(v.z, mag, thr) || nan_check_fires(v.w, mag, thr)) {
                    fired |= 1u << e;
                }
            } else {  // an entry's end cuts the group: element by element
                const float thr = threshold[e];
                const bool mag = thr > 0.0f;
                const float x[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const unsigned long long aj = a + 4ull * j;
                    if (aj >= b && aj < z && nan_check_fires(x[j], mag, thr)) {
                        fired |= 1u << e;
                    }
                }
            }
        }
    }
};

extern "C" __global__ void polyak_update_mirror_check(
    float* __restrict__ target, const float* __restrict__ online, long long n, float tau,
    unsigned short* __restrict__ online_bf16, unsigned short* __restrict__ target_bf16,
    const unsigned long long* __restrict__ buffers, const long long* __restrict__ lengths,
    const float* __restrict__ thresholds, int* __restrict__ flags, int n_entries) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    fh_early_release();
    __shared__ unsigned long long begin[POLYAK_CHECK_MAX], end[POLYAK_CHECK_MAX];
    __shared__ float threshold[POLYAK_CHECK_MAX];
    __shared__ int entry[POLYAK_CHECK_MAX];
    __shared__ int warp_active[32];
    __shared__ unsigned int block_fired;
    // The thread's first group's loads (vector path), in flight while the tables are read.
    const bool vector = hb_polyak_vector(target, online, n, online_bf16, target_bf16);
    const unsigned int first = fh_flat_first();
    const bool preloaded = vector && first < (unsigned long long)n / 4;
    float4 o0 = float4(), old0 = float4();
    if (preloaded) {
        o0 = reinterpret_cast<const float4*>(online)[first];
        old0 = reinterpret_cast<const float4*>(target)[first];
    }
    // The active entries in table order: a thread an entry, a ballot per warp, the warps'
    // counts through shared memory.
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    if (threadIdx.x == 0) {
        block_fired = 0u;
    }
    int found = 0;  // active entries in the tiles before this one
    for (int base = 0; base < n_entries; base += blockDim.x) {  // block-uniform loop
        const int k = base + threadIdx.x;
        const unsigned long long address = k < n_entries ? buffers[k] : 0ull;
        const long long length = k < n_entries ? lengths[k] : 0;
        const bool active = address != 0ull && length > 0;
        const unsigned int ballot = __ballot_sync(HA_FULL_MASK, active);
        if (lane == 0) {
            warp_active[warp] = __popc(ballot);
        }
        __syncthreads();
        int before = found, total = 0;
        for (int w = 0; w < warps; ++w) {
            before += w < warp ? warp_active[w] : 0;
            total += warp_active[w];
        }
        const int e = before + __popc(ballot & ((1u << lane) - 1u));
        if (active && e < POLYAK_CHECK_MAX) {
            begin[e] = address;
            end[e] = address + 4ull * (unsigned long long)length;
            threshold[e] = thresholds[k];
            entry[e] = k;
        }
        found += total;
        __syncthreads();  // warp_active is rewritten by the next tile; the table is complete
    }
    PolyakCheck check{begin, end, threshold, min(found, POLYAK_CHECK_MAX), 0u};
    polyak_update_mirror_body(target, online, n, tau, online_bf16, target_bf16, check, preloaded,
                              o0, old0);
    const unsigned int warp_fired = __reduce_or_sync(HA_FULL_MASK, check.fired);
    if (lane == 0 && warp_fired != 0u) {
        atomicOr(&block_fired, warp_fired);
    }
    __syncthreads();
    if (threadIdx.x < check.count && (block_fired >> threadIdx.x) & 1u) {
        flags[entry[threadIdx.x]] = 1;
    }
}

// polyak_update_mirror_ptr: polyak_update_mirror with tau read from device memory (*tau, the
// adaptive tau's ISV slot copied at graph 1's start), so no host value enters the step.
extern "C" __global__ void polyak_update_mirror_ptr(float* __restrict__ target,
                                                    const float* __restrict__ online, long long n,
                                                    const float* __restrict__ tau,
                                                    unsigned short* __restrict__ online_bf16,
                                                    unsigned short* __restrict__ target_bf16) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    fh_early_release();
    PolyakNoCheck none;
    polyak_update_mirror_body(target, online, n, *tau, online_bf16, target_bf16, none);
}
