// Early launch (programmatic dependent launch, sm_90 and newer). A kernel whose first statement
// is fh_early_wait() is launched early by the plans (fast/graph_lowering.EARLY_LAUNCH, read from
// the sources: every kernel of the step; the launch carries
// CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION): it can be scheduled while the kernel
// before it on the stream still runs, and fh_early_wait() returns once every kernel it depends
// on has finished and its writes are visible, so nothing it reads or writes is touched before
// that. fh_early_release() at a kernel's start lets the kernel after it be scheduled at once
// (without it, only when every block has exited); only the step's tail kernels call it (the
// whole step releasing measured no faster: README, "Early launches for the whole step"). Both are
// no-ops before sm_90 and when the launch did not ask for an early start.
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
