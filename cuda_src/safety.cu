// Safety kernels (reference: foxhunt.reference.kernels.safety; SPEC 5, 6): the finite clamp
// of Mech 9/10, the sentinel NaN checks, the max-abs diagnostic and the Mech 1 target-Q clip.
//
// No atomics anywhere. The sentinel checks only ever store the value 1 into a flag: several
// blocks may store it concurrently, which is a benign race with a deterministic result (flags
// are sticky: nothing here writes 0). Kernels whose output may alias their input (the in-place
// clamps the trainer runs on h2 and on targets) take no __restrict__ on that pair.
#include "ha_common.cuh"

// The floor of every ISV-driven bound: multiplier * fmaxf(isv, ISV_FLOOR) (SPEC 5).
#define ISV_FLOOR 1.0f

// Flat grid-stride loop over n elements (n may exceed 2^31).
#define SAFETY_FLAT_LOOP(i, n)                                                             \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n);          \
         i += (long long)gridDim.x * blockDim.x)

// np.clip's select order: NaN propagates (every comparison is false), -0.0 stays -0.0, and a
// bound of +Inf leaves every value unchanged.
static __device__ __forceinline__ float clip_symmetric(float x, float bound) {
    return (x > bound) ? bound : ((x < -bound) ? -bound : x);
}

// out = isfinite(x) ? clip(x, -m, m) : 0  (NaN and +/-Inf become +0.0), the sanitiser of
// Mech 9/10 and the auxiliary guards. Their bounds are ISV-driven, so the kernel forms
// m = multiplier * fmaxf(*signal, 1) on the device from a pointer to the ISV slot (as
// target_q_clip does; no host round trip inside a graph). A fixed bound m is multiplier = m with
// *signal = 1 (then m * 1 == m exactly, +Inf included): that is how the reference's
// clamp_finite(x, m) is run. m >= 0. out may alias x (in-place clamp).
extern "C" __global__ void clamp_finite(const float* x, float* out, long long n, float multiplier,
                                        const float* __restrict__ signal) {
    const float m = multiplier * fmaxf(*signal, ISV_FLOOR);
    SAFETY_FLAT_LOOP(i, n) {
        const float v = x[i];
        out[i] = ha_is_finite(v) ? clip_symmetric(v, m) : 0.0f;
    }
}

// Sticky sentinel check of one buffer: *flag = 1 if any element of x is NaN or +/-Inf; a set
// flag is never cleared. Any grid; each block stores 1 if it found a non-finite element.
extern "C" __global__ void nan_check(const float* __restrict__ x, long long n,
                                     int* __restrict__ flag) {
    bool found = false;
    SAFETY_FLAT_LOOP(i, n) { found |= !ha_is_finite(x[i]); }
    if (__syncthreads_or(found) && threadIdx.x == 0) {
        *flag = 1;
    }
}

// Every per-step sentinel slot in one launch. Slot k (blockIdx.x, grid-stride over slots)
// checks buffers[k] (lengths[k] floats; a null pointer is a deferred slot that never fires):
// it fires if an element is non-finite, or if thresholds[k] > 0 and some |x| >= thresholds[k]
// (for all-finite data that is max|x| >= threshold; a threshold that is 0, negative or NaN
// disables the magnitude test). gridDim.y blocks share one slot, each taking a stripe of it
// (1 = one block per slot); a block that fires stores flags[k] = 1 (sticky).
extern "C" __global__ void nan_check_fused(const unsigned long long* __restrict__ buffers,
                                           const long long* __restrict__ lengths,
                                           const float* __restrict__ thresholds,
                                           int* __restrict__ flags, int n_slots) {
    const long long stride = (long long)gridDim.y * blockDim.x;
    for (int slot = blockIdx.x; slot < n_slots; slot += gridDim.x) {  // block-uniform loop
        const float* x = reinterpret_cast<const float*>(buffers[slot]);
        const long long n = (x == nullptr) ? 0 : lengths[slot];
        const float threshold = thresholds[slot];
        const bool magnitude_test = threshold > 0.0f;  // false for NaN
        bool fires = false;
        for (long long i = (long long)blockIdx.y * blockDim.x + threadIdx.x; i < n; i += stride) {
            const float v = x[i];
            fires |= !ha_is_finite(v) || (magnitude_test && fabsf(v) >= threshold);
        }
        if (__syncthreads_or(fires) && threadIdx.x == 0) {
            flags[slot] = 1;
        }
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
    m = ha_block_reduce(m, HaFmax(), 0.0f);
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
    const float bound = k1 * fmaxf(*q_abs_ref, ISV_FLOOR);
    SAFETY_FLAT_LOOP(i, n) { out[i] = clip_symmetric(q[i], bound); }
}
