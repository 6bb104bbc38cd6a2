// Build and launch self-test kernels for foxhunt.fast (tests/test_fast_gpu.py).
//
// Infrastructure only: the file name starts with '_', so the kernel registry skips it, and the
// kernel names start with "selftest_", so they can never pair with a reference kernel.
#include <cuda_bf16.h>

// y[i] = a * x[i] + y[i], rounded twice (product, then sum). Built with -fmad=false, so the
// compiler must not contract this into one FMA: the test compares it bit for bit with NumPy.
extern "C" __global__ void selftest_axpy(float* __restrict__ y, const float* __restrict__ x,
                                         float a, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        y[i] = a * x[i] + y[i];
    }
}

// Round float32 to BF16 bit patterns with the toolkit intrinsic (round to nearest even): checks
// that <cuda_bf16.h> is found and that the result matches the reference rounding for non-NaN x.
extern "C" __global__ void selftest_bf16_round(unsigned short* __restrict__ out,
                                               const float* __restrict__ x, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = __bfloat16_as_ushort(__float2bfloat16_rn(x[i]));
    }
}

// One thread writes a float and an int64 through device pointers (mapped pinned memory in the
// readback test); also exercises 8-byte scalar parameters.
extern "C" __global__ void selftest_write_scalars(float* __restrict__ value_out,
                                                  long long* __restrict__ count_out,
                                                  float value, long long count) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        *value_out = value;
        *count_out = count;
    }
}
