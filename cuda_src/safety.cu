// Safety kernels (reference: foxhunt.reference.kernels.safety; SPEC 5, 6): the finite clamp
// of Mech 9/10, the sentinel NaN checks, the max-abs diagnostic and the Mech 1 target-Q clip.
//
// No atomics anywhere. The sentinel checks only ever store the value 1 into a flag: several
// blocks may store it concurrently, which is a benign race with a deterministic result (flags
// are sticky: nothing here writes 0). Kernels whose output may alias their input (the in-place
// clamps the trainer runs on h2 and on targets) take no __restrict__ on that pair.
#include "early_launch.cuh"  // fh_early_wait, fh_early_release
#include "flat.cuh"  // the vector paths of clamp_finite and nan_check
#include "ha_common.cuh"
#include "reduce.cuh"  // block_reduce_down

// The floor of every ISV-driven bound: multiplier * fmaxf(isv, ISV_FLOOR) (SPEC 5).
#define ISV_FLOOR 1.0f

// Flat grid-stride loop over n elements (n may exceed 2^31).
#define SAFETY_FLAT_LOOP(i, n)                                                             \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n);          \
         i += (long long)gridDim.x * blockDim.x)

// out = isfinite(x) ? clip(x, -m, m) : 0  (NaN and +/-Inf become +0.0), the sanitiser of
// Mech 9/10 and the auxiliary guards. Their bounds are ISV-driven, so the kernel forms
// m = multiplier * fmaxf(*signal, 1) on the device from a pointer to the ISV slot (as
// target_q_clip does; no host round trip inside a graph). A fixed bound m is multiplier = m with
// *signal = 1 (then m * 1 == m exactly, +Inf included): that is how the reference's
// clamp_finite(x, m) is run. m >= 0. out may alias x (in-place clamp: every element, or 4-element
// group, is read and then written by one thread).
//
// Work per thread (the same formula per element on every path, so the bits depend on neither the
// path nor the launch shape): where x and out are 16-byte aligned and n < 2^31 with at most 2^21
// blocks (grid-uniform tests), thread t clamps the float4 groups t, t + T, ... (T threads in the
// grid; 32-bit indices) and threads 0 .. n % 4 - 1 one tail element each; a misaligned pointer
// takes a 32-bit scalar grid-stride loop; n >= 2^31 the 64-bit one. plan_clamp_finite launches
// one thread per 4 elements.
extern "C" __global__ void clamp_finite(const float* x, float* out, long long n, float multiplier,
                                        const float* __restrict__ signal) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    const float m = multiplier * fmaxf(*signal, ISV_FLOOR);
    if (!fh_flat_narrow(n)) {  // 64-bit loop
        SAFETY_FLAT_LOOP(i, n) { out[i] = ha_clamp_finite(x[i], m); }
        return;
    }
    const unsigned int count = (unsigned int)n;
    const unsigned int first = fh_flat_first(), stride = fh_flat_stride();
    if (fh_aligned(x, 16) && fh_aligned(out, 16)) {
        const float4* x4 = reinterpret_cast<const float4*>(x);
        float4* out4 = reinterpret_cast<float4*>(out);
        for (unsigned int g = first; g < count / 4; g += stride) {
            const float4 v = x4[g];
            out4[g] = make_float4(ha_clamp_finite(v.x, m), ha_clamp_finite(v.y, m),
                                  ha_clamp_finite(v.z, m), ha_clamp_finite(v.w, m));
        }
        // the tail: n % 4 elements, one per thread (a loop: any grid covers it)
        for (unsigned int i = fh_flat_tail(count, first); i < count; i += stride) {
            out[i] = ha_clamp_finite(x[i], m);
        }
    } else {
        for (unsigned int i = first; i < count; i += stride) {
            out[i] = ha_clamp_finite(x[i], m);
        }
    }
}

// Sticky sentinel check of one buffer: *flag = 1 if any element of x is NaN or +/-Inf; a set
// flag is never cleared. Any grid (an OR over the elements does not depend on which thread
// reads which); each block stores 1 if it found a non-finite element. Where x is 16-byte aligned
// and fh_flat_narrow(n) holds, thread t reads the float4 groups t, t + T, ... and one tail
// element (flat.cuh; 32-bit indices); otherwise the scalar grid-stride loop. plan_nan_check
// launches one thread per 4 elements.
extern "C" __global__ void nan_check(const float* __restrict__ x, long long n,
                                     int* __restrict__ flag) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    bool found = false;
    if (fh_flat_narrow(n) && fh_aligned(x, 16)) {
        const unsigned int count = (unsigned int)n;
        const unsigned int first = fh_flat_first(), stride = fh_flat_stride();
        const float4* x4 = reinterpret_cast<const float4*>(x);
        for (unsigned int g = first; g < count / 4; g += stride) {
            const float4 v = x4[g];
            found |= !(ha_is_finite(v.x) && ha_is_finite(v.y) && ha_is_finite(v.z) &&
                       ha_is_finite(v.w));
        }
        for (unsigned int i = fh_flat_tail(count, first); i < count; i += stride) {
            found |= !ha_is_finite(x[i]);
        }
    } else {
        SAFETY_FLAT_LOOP(i, n) { found |= !ha_is_finite(x[i]); }
    }
    if (__syncthreads_or(found) && threadIdx.x == 0) {
        *flag = 1;
    }
}

// Every per-step sentinel slot in one launch. Slot k checks buffers[k] (lengths[k] floats; a null
// pointer is a deferred slot that never fires): it fires if an element is non-finite, or if
// thresholds[k] > 0 and some |x| >= thresholds[k] (for all-finite data that is max|x| >=
// threshold; a threshold that is 0, negative or NaN disables the magnitude test); a block that
// finds such an element stores flags[k] = 1 (sticky).
//
// Work distribution (latency, not bandwidth, bounds this kernel: ~1.5M floats in ~70 slots of
// very different lengths): every slot is cut into chunks of NAN_CHECK_PER_THREAD * blockDim.x
// elements, the chunks of all slots are numbered in slot order, and block b takes chunks b,
// b + gridDim.x, ... (any grid covers everything; plan_nan_check_fused sizes it to one chunk
// per block). The blocks read the lengths a tile of blockDim.x slots at a time and number the
// chunks with a block-wide inclusive scan in shared memory; each thread then issues its loads of
// a chunk independently (unrolled), so they are in flight together: NAN_CHECK_VEC float4s
// (float4 t + k * blockDim.x of the chunk) where the buffer is 16-byte aligned and the chunk
// lies wholly inside it, else NAN_CHECK_PER_THREAD floats (element t + k * blockDim.x). A flag is
// an OR over the elements, so it does not depend on which thread reads which element.
// blockDim.x must be a power of two from 32 to NAN_CHECK_MAX_THREADS (whole warps: the scan
// shuffles).
#define NAN_CHECK_PER_THREAD 16
#define NAN_CHECK_VEC (NAN_CHECK_PER_THREAD / 4)
#define NAN_CHECK_MAX_THREADS 1024

extern "C" __global__ void nan_check_fused(const unsigned long long* __restrict__ buffers,
                                           const long long* __restrict__ lengths,
                                           const float* __restrict__ thresholds,
                                           int* __restrict__ flags, int n_slots) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    fh_early_release();
    __shared__ long long chunk_end[NAN_CHECK_MAX_THREADS];  // inclusive scan of chunk counts
    __shared__ long long warp_end[NAN_CHECK_MAX_THREADS / 32];  // the warps' inclusive totals
    const long long chunk = (long long)NAN_CHECK_PER_THREAD * blockDim.x;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    long long tile_first = 0;  // number of the first chunk of the current tile of slots
    for (int tile = 0; tile < n_slots; tile += blockDim.x) {  // block-uniform loop
        const int own = tile + threadIdx.x;
        long long count = 0;
        if (own < n_slots && buffers[own] != 0ull) {
            count = (lengths[own] + chunk - 1) / chunk;  // lengths >= 0 (validated on the host)
        }
        // Inclusive scan of count over the block: each warp's shuffle scan, then warp 0 scans the
        // warps' totals (two barriers; the integer sums are exact, so any order gives the same).
        for (int offset = 1; offset < 32; offset <<= 1) {
            const long long add = __shfl_up_sync(0xffffffffu, count, offset);
            count += lane >= offset ? add : 0;
        }
        if (lane == 31) {
            warp_end[warp] = count;
        }
        __syncthreads();
        if (warp == 0) {
            const int warps = blockDim.x / 32;
            long long total = lane < warps ? warp_end[lane] : 0;
            for (int offset = 1; offset < 32; offset <<= 1) {
                const long long add = __shfl_up_sync(0xffffffffu, total, offset);
                total += lane >= offset ? add : 0;
            }
            if (lane < warps) {
                warp_end[lane] = total;
            }
        }
        __syncthreads();
        chunk_end[threadIdx.x] = count + (warp ? warp_end[warp - 1] : 0);
        __syncthreads();
        const int tile_slots = min((int)blockDim.x, n_slots - tile);
        const long long tile_chunks = chunk_end[tile_slots - 1];
        // This block's first chunk number >= tile_first (chunk numbers b mod gridDim.x).
        long long w = tile_first + ((long long)blockIdx.x - tile_first % gridDim.x + gridDim.x) %
                                       gridDim.x;
        // The slot of the block's first chunk: the first entry with chunk_end > its number (a
        // binary search; the later chunks' slots by the linear search below, resumed).
        int slot_in_tile = 0;
        for (int hi = tile_slots - 1; slot_in_tile < hi;) {
            const int mid = (slot_in_tile + hi) / 2;
            if (chunk_end[mid] <= w - tile_first) {
                slot_in_tile = mid + 1;
            } else {
                hi = mid;
            }
        }
        for (; w < tile_first + tile_chunks; w += gridDim.x) {  // block-uniform loop
            const long long local = w - tile_first;
            while (chunk_end[slot_in_tile] <= local) {  // w only grows: the search resumes
                ++slot_in_tile;
            }
            const int slot = tile + slot_in_tile;
            const long long first_of_slot = slot_in_tile ? chunk_end[slot_in_tile - 1] : 0;
            const float* x = reinterpret_cast<const float*>(buffers[slot]);
            const long long n = lengths[slot];
            const long long first = (local - first_of_slot) * chunk;  // the chunk's first element
            const float threshold = thresholds[slot];
            const bool magnitude_test = threshold > 0.0f;  // false for NaN
            bool fires = false;
            if ((reinterpret_cast<unsigned long long>(x) & 15ull) == 0 && first + chunk <= n) {
                // block-uniform: a whole chunk of an aligned buffer, as float4s
                const float4* x4 = reinterpret_cast<const float4*>(x + first);
                float4 v[NAN_CHECK_VEC];
#pragma unroll
                for (int k = 0; k < NAN_CHECK_VEC; ++k) {
                    v[k] = x4[threadIdx.x + k * blockDim.x];
                }
#pragma unroll
                for (int k = 0; k < NAN_CHECK_VEC; ++k) {
                    fires |= nan_check_fires(v[k].x, magnitude_test, threshold) ||
                             nan_check_fires(v[k].y, magnitude_test, threshold) ||
                             nan_check_fires(v[k].z, magnitude_test, threshold) ||
                             nan_check_fires(v[k].w, magnitude_test, threshold);
                }
            } else {
                const long long begin = first + threadIdx.x;
                float v[NAN_CHECK_PER_THREAD];
#pragma unroll
                for (int k = 0; k < NAN_CHECK_PER_THREAD; ++k) {
                    const long long i = begin + (long long)k * blockDim.x;
                    v[k] = i < n ? x[i] : 0.0f;
                }
#pragma unroll
                for (int k = 0; k < NAN_CHECK_PER_THREAD; ++k) {
                    fires |= nan_check_fires(v[k], magnitude_test, threshold);
                }
            }
            if (__syncthreads_or(fires) && threadIdx.x == 0) {
                flags[slot] = 1;
            }
        }
        tile_first += tile_chunks;
        __syncthreads();  // chunk_end is rewritten by the next tile
    }
}

// *out = max_i |x_i| as an fmaxf reduction starting at 0: NaN ignored, +/-Inf give +Inf, empty
// or all-NaN x gives 0. ONE block (blockDim.x a multiple of 32): a fixed tree, no atomics, no
// second kernel; max is exact, so the result equals the reference's bit for bit.
extern "C" __global__ void max_abs(const float* __restrict__ x, long long n,
                                   float* __restrict__ out) {
    float m = 0.0f;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) {
        m = fmaxf(m, fabsf(x[i]));
    }
    m = block_reduce_down(m, HaFmax(), 0.0f);
    if (threadIdx.x == 0) {
        *out = m;
    }
}

// Mech 1: out = clip(q, -b, b), b = k1 * fmaxf(*q_abs_ref, 1) (the floor is on the signal;
// NaN q_abs_ref gives b = k1, +Inf gives no clip). q_abs_ref points at the ISV slot
// Q_ABS_REF, read on the device (no host round trip). A NaN q stays NaN; +/-Inf become +/-b.
// out may alias q.
extern "C" __global__ void target_q_clip(const float* q, float* out, long long n, float k1,
                                         const float* __restrict__ q_abs_ref) {
    fh_early_wait();  // early_launch.cuh: before anything is read or written
    const float bound = k1 * fmaxf(*q_abs_ref, ISV_FLOOR);
    SAFETY_FLAT_LOOP(i, n) { out[i] = ha_clip_symmetric(q[i], bound); }
}
