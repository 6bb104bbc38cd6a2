// Shared device helpers of optim.cu, spectral.cu and isv.cu (helper HB).
//
// Deterministic reductions: every sum has a fixed tree that depends only on the launch shape
// (blockDim.x) and the data length, never on timing: no atomics. Arithmetic is spelled with
// the round-to-nearest intrinsics (__fadd_rn, __fmul_rn, __fdiv_rn), which the compiler never
// contracts into an FMA or reorders, so the kernels round exactly where the reference does,
// independently of the -fmad setting.
#pragma once

// Width of a warp; block sizes of every kernel using these helpers are multiples of it.
#define HB_WARP 32
// Largest block of threads (CUDA limit): a block has at most HB_WARP warps.
#define HB_MAX_THREADS 1024

// The additive identity of IEEE float addition: -0.0f + x == x for every x (+0.0f included),
// so padding a reduction with it changes no bit of the result.
#define HB_SUM_IDENTITY (-0.0f)

// Sum over the 32 lanes of a warp with an xor butterfly, offsets 1, 2, 4, 8, 16: a pairwise
// tree over consecutive lanes, ((v0 + v1) + (v2 + v3)) + ... (neighbours first, like NumPy's
// pairwise sums; it also keeps a sum of up to three values sequential). Every lane ends with the
// same value (float addition is commutative). All 32 lanes must be active.
__device__ __forceinline__ float hb_warp_sum(float v) {
#pragma unroll
    for (int offset = 1; offset < HB_WARP; offset <<= 1) {
        v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, offset));
    }
    return v;
}

__device__ __forceinline__ long long hb_warp_sum(long long v) {
#pragma unroll
    for (int offset = 1; offset < HB_WARP; offset <<= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}

// Sum of one value per thread over the whole block; every thread gets the result.
// Tree: each warp's butterfly, then warp 0 sums the per-warp results (in warp order, padded
// with the identity) with the same butterfly: a pairwise tree over consecutive threads.
// Requires blockDim.x % 32 == 0 and every thread of the block to call it (it synchronises).
// `scratch` holds HB_WARP + 1 elements of shared memory; consecutive calls may share it (the
// leading barrier protects the previous result).
template <typename T>
__device__ __forceinline__ T hb_block_sum(T v, T identity, T* scratch) {
    const int lane = threadIdx.x % HB_WARP;
    const int warp = threadIdx.x / HB_WARP;
    const int warps = blockDim.x / HB_WARP;
    v = hb_warp_sum(v);
    __syncthreads();
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    if (warp == 0) {
        T s = lane < warps ? scratch[lane] : identity;
        s = hb_warp_sum(s);
        if (lane == 0) {
            scratch[HB_WARP] = s;
        }
    }
    __syncthreads();
    return scratch[HB_WARP];
}

__device__ __forceinline__ float hb_block_sum(float v, float* scratch) {
    return hb_block_sum<float>(v, HB_SUM_IDENTITY, scratch);
}

__device__ __forceinline__ long long hb_block_sum(long long v, long long* scratch) {
    return hb_block_sum<long long>(v, 0LL, scratch);
}

// Identity map: the plain (unguarded) sums (grad_norm_final's phase 2 and its replays).
struct HbIdentity {
    __device__ __forceinline__ float operator()(float x) const { return x; }
};

// x * x if x is finite, else the identity (the finite-square rule of the gradient norms).
struct HbFiniteSquare {
    __device__ __forceinline__ float operator()(float x) const {
        return isfinite(x) ? __fmul_rn(x, x) : HB_SUM_IDENTITY;
    }
};

// Per-thread partial of sum_{begin <= i < end} f(x[i]) for thread `thread` of a block of
// `threads` threads striding over [begin, end) (hb_thread_partial's tree for any thread of any
// block size: hb_block_sum_as uses it to replay a block of another size).
// The range is cut into chunks of 4 consecutive elements; thread t takes chunks t, t + T, ...
// (T = threads) and accumulator j sums element j of each of its chunks in order; the last,
// partial chunk goes to the thread whose turn it is. The partial is (a0 + a1) + (a2 + a3).
// The chunks are read as float4 where the range starts 16-byte aligned and element by element
// otherwise: the same sums in the same order, so the bits depend only on T and the range.
// `f` may keep state (e.g. a count of the terms it kept); each element is passed to it once.
template <typename F>
__device__ __forceinline__ float hb_thread_partial_as(const float* x, long long begin,
                                                      long long end, F&& f, long long thread,
                                                      long long threads) {
    const float* base = x + begin;
    const long long len = end - begin;
    const long long chunks = len / 4;
    float a0 = HB_SUM_IDENTITY, a1 = HB_SUM_IDENTITY, a2 = HB_SUM_IDENTITY, a3 = HB_SUM_IDENTITY;
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
// [begin, end): hb_thread_partial_as for this thread of this block (tree described there).
template <typename F>
__device__ __forceinline__ float hb_thread_partial(const float* x, long long begin, long long end,
                                                   F&& f) {
    return hb_thread_partial_as(x, begin, end, f, (long long)threadIdx.x,
                                (long long)blockDim.x);
}

// sum_{begin <= i < end} f(x[i]) with the bits a block of `threads` threads gets from
// hb_thread_partial + hb_block_sum (e.g. grad_norm_final's launch), computed by the calling
// block, of any size: its warp w plays the virtual warps w, w + W, w + 2W, ... (W = the calling
// block's warps; a virtual warp's lanes are the real warp's lanes, so the butterflies are the
// same), writes each virtual warp's sum to scratch, and warp 0 sums the `threads` / 32 of them
// padded with the identity, as hb_block_sum's warp 0 does. Every thread gets the result.
// Requires threads % 32 == 0, 32 <= threads <= HB_MAX_THREADS, blockDim.x % 32 == 0, every
// thread of the block to call it (it synchronises; the trip counts are warp-uniform) and f to
// be stateless (a virtual thread's elements go to one real thread, but several virtual threads
// may share it). `scratch` holds HB_WARP + 1 elements of shared memory, as hb_block_sum's.
template <typename F>
__device__ __forceinline__ float hb_block_sum_as(const float* x, long long begin, long long end,
                                                 F f, int threads, float* scratch) {
    const int lane = threadIdx.x % HB_WARP;
    const int warp = threadIdx.x / HB_WARP;
    const int warps = blockDim.x / HB_WARP;
    const int virtual_warps = threads / HB_WARP;
    __syncthreads();  // the previous user of scratch has read its result
    for (int vw = warp; vw < virtual_warps; vw += warps) {
        const float v = hb_warp_sum(
            hb_thread_partial_as(x, begin, end, f, (long long)(vw * HB_WARP + lane), threads));
        if (lane == 0) {
            scratch[vw] = v;
        }
    }
    __syncthreads();
    if (warp == 0) {
        float s = lane < virtual_warps ? scratch[lane] : HB_SUM_IDENTITY;
        s = hb_warp_sum(s);
        if (lane == 0) {
            scratch[HB_WARP] = s;
        }
    }
    __syncthreads();
    return scratch[HB_WARP];
}
