// Warp and block reductions of every kernel, in one place (no __global__ functions here).
//
// Deterministic: every reduction has a fixed tree that depends only on the launch shape
// (blockDim.x) and the data length, never on timing: no atomics. Sums are spelled with the
// round-to-nearest intrinsics (__fadd_rn, __fmul_rn), which the compiler never contracts into
// an FMA or reorders, so the kernels round exactly where the reference does, independently of
// the -fmad setting.
//
// The summation order: warp_sum (an xor butterfly over offsets 1, 2, 4, 8, 16: neighbours
// first, like NumPy's pairwise sums), block_sum (each warp's butterfly, then warp 0 over the
// warp sums in warp order), thread_partial / block_sums_as (each thread's share of a long range).
// Kernels written before this header with other trees keep them bit for bit as named variants:
// warp_sum_halving / block_sum_halving (xor butterfly over offsets 16, 8, 4, 2, 1: the
// distributional kernels and the step kernels), warp_max_halving (fmaxf, the same butterfly),
// and warp_reduce_down / block_reduce_down (shfl_down tree, lane 0 first: the fmin/fmax
// reductions of replay.cu and safety.cu).
#pragma once

// Width of a warp; block sizes of every kernel using these helpers are multiples of it.
#define REDUCE_WARP 32
#define REDUCE_FULL_MASK 0xffffffffu
// Largest block of threads (CUDA limit): a block has at most REDUCE_WARP warps.
#define REDUCE_MAX_THREADS 1024

// The additive identity of IEEE float addition: -0.0f + x == x for every x (+0.0f included),
// so padding a reduction with it changes no bit of the result.
#define REDUCE_SUM_IDENTITY (-0.0f)

// Sum over the 32 lanes of a warp with an xor butterfly, offsets 1, 2, 4, 8, 16: a pairwise
// tree over consecutive lanes, ((v0 + v1) + (v2 + v3)) + ... (neighbours first, like NumPy's
// pairwise sums; it also keeps a sum of up to three values sequential). Every lane ends with the
// same value (float addition is commutative). All 32 lanes must be active.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 1; offset < REDUCE_WARP; offset <<= 1) {
        v = __fadd_rn(v, __shfl_xor_sync(REDUCE_FULL_MASK, v, offset));
    }
    return v;
}

__device__ __forceinline__ long long warp_sum(long long v) {
#pragma unroll
    for (int offset = 1; offset < REDUCE_WARP; offset <<= 1) {
        v += __shfl_xor_sync(REDUCE_FULL_MASK, v, offset);
    }
    return v;
}

// Sum of one value per thread over the whole block; every thread gets the result.
// Tree: each warp's butterfly, then warp 0 sums the per-warp results (in warp order, padded
// with the identity) with the same butterfly: a pairwise tree over consecutive threads.
// Requires blockDim.x % 32 == 0 and every thread of the block to call it (it synchronises).
// `scratch` holds REDUCE_WARP + 1 elements of shared memory; consecutive calls may share it (the
// leading barrier protects the previous result).
template <typename T>
__device__ __forceinline__ T block_sum(T v, T identity, T* scratch) {
    const int lane = threadIdx.x % REDUCE_WARP;
    const int warp = threadIdx.x / REDUCE_WARP;
    const int warps = blockDim.x / REDUCE_WARP;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    if (warp == 0) {
        T s = lane < warps ? scratch[lane] : identity;
        s = warp_sum(s);
        if (lane == 0) {
            scratch[REDUCE_WARP] = s;
        }
    }
    __syncthreads();
    return scratch[REDUCE_WARP];
}

__device__ __forceinline__ float block_sum(float v, float* scratch) {
    return block_sum<float>(v, REDUCE_SUM_IDENTITY, scratch);
}

__device__ __forceinline__ long long block_sum(long long v, long long* scratch) {
    return block_sum<long long>(v, 0LL, scratch);
}

// Identity map: the plain (unguarded) sums (grad_norm_final's phase 2 and its replays).
struct SumIdentity {
    __device__ __forceinline__ float operator()(float x) const { return x; }
};

// x * x if x is finite, else the identity (the finite-square rule of the gradient norms).
struct FiniteSquare {
    __device__ __forceinline__ float operator()(float x) const {
        return isfinite(x) ? __fmul_rn(x, x) : REDUCE_SUM_IDENTITY;
    }
};

// Per-thread partial of sum_{begin <= i < end} f(x[i]) for thread `thread` of a block of
// `threads` threads striding over [begin, end) (thread_partial's tree for any thread of any
// block size: block_sums_as uses it to replay a block of another size).
// The range is cut into chunks of 4 consecutive elements; thread t takes chunks t, t + T, ...
// (T = threads) and accumulator j sums element j of each of its chunks in order; the last,
// partial chunk goes to the thread whose turn it is. The partial is (a0 + a1) + (a2 + a3).
// The chunks are read as float4 where the range starts 16-byte aligned and element by element
// otherwise: the same sums in the same order, so the bits depend only on T and the range.
// `f` may keep state (e.g. a count of the terms it kept); each element is passed to it once.
template <typename F>
__device__ __forceinline__ float thread_partial_as(const float* x, long long begin,
                                                      long long end, F&& f, long long thread,
                                                      long long threads) {
    const float* base = x + begin;
    const long long len = end - begin;
    const long long chunks = len / 4;
    float a0 = REDUCE_SUM_IDENTITY, a1 = REDUCE_SUM_IDENTITY;
    float a2 = REDUCE_SUM_IDENTITY, a3 = REDUCE_SUM_IDENTITY;
    if ((reinterpret_cast<unsigned long long>(base) & 15) == 0) {
        const float4* base4 = reinterpret_cast<const float4*>(base);
#pragma unroll 4
        for (long long c = thread; c < chunks; c += threads) {
            const float4 q = base4[c];
            a0 = __fadd_rn(a0, f(q.x));
            a1 = __fadd_rn(a1, f(q.y));
            a2 = __fadd_rn(a2, f(q.z));
            a3 = __fadd_rn(a3, f(q.w));
        }
    } else {
#pragma unroll 4
        for (long long c = thread; c < chunks; c += threads) {
            const float* q = base + 4 * c;
            const float q0 = q[0], q1 = q[1], q2 = q[2], q3 = q[3];
            a0 = __fadd_rn(a0, f(q0));
            a1 = __fadd_rn(a1, f(q1));
            a2 = __fadd_rn(a2, f(q2));
            a3 = __fadd_rn(a3, f(q3));
        }
    }
    const long long tail = 4 * chunks;  // 0 to 3 elements left, the next chunk in turn
    if (tail < len && thread == chunks % threads) {
        a0 = __fadd_rn(a0, f(base[tail]));
        if (tail + 1 < len) {
            a1 = __fadd_rn(a1, f(base[tail + 1]));
        }
        if (tail + 2 < len) {
            a2 = __fadd_rn(a2, f(base[tail + 2]));
        }
    }
    return __fadd_rn(__fadd_rn(a0, a1), __fadd_rn(a2, a3));
}

// Per-thread partial of sum_{begin <= i < end} f(x[i]) for the calling block striding over
// [begin, end): thread_partial_as for this thread of this block (tree described there).
template <typename F>
__device__ __forceinline__ float thread_partial(const float* x, long long begin, long long end,
                                                   F&& f) {
    return thread_partial_as(x, begin, end, f, (long long)threadIdx.x,
                                (long long)blockDim.x);
}

// sum_{begin <= i < end} f(x[k][i]) for K ranges at once (k < K), each with the bits a block of
// `threads` threads gets from thread_partial + block_sum (e.g. grad_norm_final's launch),
// computed by the calling block, of any size: its warp w plays the virtual warps w, w + W,
// w + 2W, ... (W = the calling block's warps; a virtual warp's lanes are the real warp's lanes,
// so the butterflies are the same). Each virtual thread makes its K partials back to back
// (thread_partial_as; their loads in flight together), each virtual warp stores its K warp sums,
// and after one barrier warp k (warps loop over the k when K > W) sums range k's `threads` / 32
// warp sums padded with the identity, as block_sum's warp 0 does; out[k] gets the result in
// every thread. A null x[k] (uniform across the block) is skipped and leaves out[k] unwritten.
// Requires threads % 32 == 0, 32 <= threads <= REDUCE_MAX_THREADS, blockDim.x % 32 == 0, every
// thread of the block to call it (it synchronises twice; the trip counts are warp-uniform) and
// f to be stateless (a virtual thread's elements go to one real thread, but several virtual
// threads may share it). `scratch` holds K * (REDUCE_WARP + 1) elements of shared memory.
template <int K, typename F>
__device__ __forceinline__ void block_sums_as(const float* const (&x)[K], long long begin,
                                              long long end, F f, int threads,
                                              float (*scratch)[REDUCE_WARP + 1],
                                              float (&out)[K]) {
    const int lane = threadIdx.x % REDUCE_WARP;
    const int warp = threadIdx.x / REDUCE_WARP;
    const int warps = blockDim.x / REDUCE_WARP;
    const int virtual_warps = threads / REDUCE_WARP;
    __syncthreads();  // the previous user of scratch has read its result
    for (int vw = warp; vw < virtual_warps; vw += warps) {
        float v[K];
#pragma unroll
        for (int k = 0; k < K; ++k) {
            v[k] = x[k] == nullptr ? REDUCE_SUM_IDENTITY
                                   : thread_partial_as(x[k], begin, end, f,
                                                       (long long)(vw * REDUCE_WARP + lane),
                                                       threads);
        }
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if (x[k] != nullptr) {
                v[k] = warp_sum(v[k]);
                if (lane == 0) {
                    scratch[k][vw] = v[k];
                }
            }
        }
    }
    __syncthreads();
    for (int k = warp; k < K; k += warps) {
        if (x[k] != nullptr) {
            float s = lane < virtual_warps ? scratch[k][lane] : REDUCE_SUM_IDENTITY;
            s = warp_sum(s);
            if (lane == 0) {
                scratch[k][REDUCE_WARP] = s;
            }
        }
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < K; ++k) {
        if (x[k] != nullptr) {
            out[k] = scratch[k][REDUCE_WARP];
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Variants kept bit for bit by the kernels that use them
// ---------------------------------------------------------------------------------------------

// Sum over the 32 lanes with an xor butterfly over offsets 16, 8, 4, 2, 1 (halving); every lane
// gets the same value (a + b == b + a in IEEE arithmetic). All 32 lanes must be active.
static __device__ __forceinline__ float warp_sum_halving(float v) {
#pragma unroll
    for (int offset = REDUCE_WARP / 2; offset > 0; offset >>= 1) {
        v = __fadd_rn(v, __shfl_xor_sync(REDUCE_FULL_MASK, v, offset));
    }
    return v;
}

// fmaxf over the 32 lanes, the same butterfly (fmaxf skips NaN).
static __device__ __forceinline__ float warp_max_halving(float v) {
#pragma unroll
    for (int offset = REDUCE_WARP / 2; offset > 0; offset >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(REDUCE_FULL_MASK, v, offset));
    }
    return v;
}

// Sum of one value per thread over the block with warp_sum_halving: each warp's butterfly, then
// warp 0 over the warp sums in warp order (padded with the identity -0.0). Every thread gets the
// result; every thread of the block must call it (it synchronises; safe in a loop).
static __device__ __forceinline__ float block_sum_halving(float v) {
    __shared__ float warp_sums[REDUCE_WARP];
    __shared__ float result;
    v = warp_sum_halving(v);
    __syncthreads();
    if (threadIdx.x % REDUCE_WARP == 0) {
        warp_sums[threadIdx.x / REDUCE_WARP] = v;
    }
    __syncthreads();
    if (threadIdx.x < REDUCE_WARP) {
        float s = threadIdx.x < blockDim.x / REDUCE_WARP ? warp_sums[threadIdx.x] : REDUCE_SUM_IDENTITY;
        s = warp_sum_halving(s);
        if (threadIdx.x == 0) {
            result = s;
        }
    }
    __syncthreads();
    return result;
}

// Tree reduction of one value per lane with shfl_down over offsets 16, 8, 4, 2, 1; lane 0 gets
// the result (fixed shape: deterministic).
template <class Op>
static __device__ __forceinline__ float warp_reduce_down(float v, Op op) {
    for (int offset = REDUCE_WARP / 2; offset > 0; offset >>= 1) {
        v = op(v, __shfl_down_sync(REDUCE_FULL_MASK, v, offset));
    }
    return v;
}

// Block-wide warp_reduce_down of one value per thread; every thread gets the result. blockDim.x
// must be a multiple of 32 (at most 1024); `identity` fills the lanes of the second stage that
// have no warp. Two __syncthreads: safe to call repeatedly in a loop.
template <class Op>
static __device__ __forceinline__ float block_reduce_down(float v, Op op, float identity) {
    __shared__ float warp_values[REDUCE_WARP];
    __shared__ float result;
    const int lane = threadIdx.x % REDUCE_WARP;
    const int warp = threadIdx.x / REDUCE_WARP;
    const int n_warps = blockDim.x / REDUCE_WARP;
    v = warp_reduce_down(v, op);
    if (lane == 0) {
        warp_values[warp] = v;
    }
    __syncthreads();
    if (warp == 0) {
        v = warp_reduce_down(lane < n_warps ? warp_values[lane] : identity, op);
        if (lane == 0) {
            result = v;
        }
    }
    __syncthreads();
    return result;
}
