// Early launch (programmatic dependent launch, sm_90 and newer). A kernel that the plan may
// launch early (fast/graph_lowering.EARLY_LAUNCH: the launch carries
// CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION) can be scheduled while the kernel
// before it on the stream still runs; its first statement is fh_early_wait(), which returns once
// every kernel it depends on has finished and its writes are visible, so nothing it reads or
// writes is touched before that. fh_early_release() at a kernel's start lets the kernel after it
// be scheduled at once (without it, only when every block has exited). Both are no-ops before
// sm_90 and when the launch did not ask for an early start.
#pragma once

__device__ __forceinline__ void fh_early_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void fh_early_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}
