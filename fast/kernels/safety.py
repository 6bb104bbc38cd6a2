"""Fast-path launchers of the safety kernels (``cuda_src/safety.cu``; reference:
``foxhunt.reference.kernels.safety``).

Each public function has the reference's name and signature, validates with the reference's
``validate_<name>`` (or check; same ``ValueError``), runs the CUDA kernel once and returns the
reference's structure and dtypes. ``plan_<name>(...)`` gives ``(grid, block, shared_mem)``.
Kernel parameters (C order):

- ``clamp_finite(x, out, n, multiplier, signal)``: flat grid-stride; the bound is formed on the
  device, ``m = multiplier * fmaxf(*signal, 1)`` (``signal`` points at the ISV slot that drives
  it, e.g. ``H_S2_RMS_EMA`` for Mech 10); a fixed bound ``m`` is ``multiplier = m`` with
  ``*signal = 1``, which is how the test entry runs ``clamp_finite(x, m)``. ``out`` may alias
  ``x`` (Mech 9/10 in place). 4 elements per thread where ``x`` and ``out`` are 16-byte
  aligned (a scalar loop otherwise): :func:`plan_clamp_finite` launches a quarter of the threads.
- ``nan_check(x, n, flag)``: any grid; stores 1 into ``*flag`` if ``x`` holds a non-finite value.
- ``nan_check_fused(buffers, lengths, thresholds, flags, n_slots)``: device arrays of
  ``n_slots`` buffer addresses (uint64, 0 = deferred slot), element counts (int64) and
  thresholds (float32); ``flags`` int32[n_slots] updated in place (sticky). One launch for
  all slots, as SPEC 6 asks, but not one block per slot: the slots are cut into chunks of
  ``FUSED_THREADS * FUSED_PER_THREAD`` elements and the blocks stride over the chunks of all
  slots (:func:`plan_nan_check_fused`: a block per chunk). One block per slot left the long
  slots (parameters, Adam moments: 290k floats) to a handful of blocks and made the check
  after the optimiser the slowest node of graph 2 (18.7 us of kernel time under Nsight Compute
  on the H200, 2 launches per step).
- ``max_abs(x, n, out)``: ONE block; ``out`` a single float32.
- ``target_q_clip(q, out, n, k1, q_abs_ref)``: the same form, bound ``k1 * fmaxf(*q_abs_ref,
  1)`` with ``q_abs_ref`` a device pointer to the ISV slot ``Q_ABS_REF``; ``out`` may alias ``q``.

Numerics: all five are exact (selects, comparisons, fmaxf): bitwise equal to the reference.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from foxhunt.fast.kernels._runtime import (
    FLAT_VEC_WIDTH,
    In,
    InOut,
    Out,
    blocks,
    launch,
    plan_flat,
    runtime,
)
from foxhunt.reference.kernels.argcheck import check_f32_array
from foxhunt.reference.kernels.safety import (
    ISV_FLOOR,
    validate_clamp_finite,
    validate_nan_check,
    validate_nan_check_fused,
    validate_target_q_clip,
)

F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)

#: Threads of the single-block reduction (max_abs).
REDUCE_THREADS = 1024
#: nan_check_fused: threads per block (a power of two, at most 1024), the elements each thread
#: checks per chunk (NAN_CHECK_PER_THREAD in safety.cu), and the most blocks of one launch.
FUSED_THREADS = 512
FUSED_PER_THREAD = 16
FUSED_MAX_BLOCKS = 4096

Plan = tuple  # (grid, block, shared_mem)


# --------------------------------------------------------------------------------------------
# Launch plans
# --------------------------------------------------------------------------------------------


def plan_clamp_finite(n: int) -> Plan:
    """``plan_flat`` over the ``ceil(n / 4)`` groups of 4 elements: one thread per float4 group
    (the kernel's vector path; its scalar fallback strides over the same grid), the same block
    and grid cap."""
    return plan_flat(blocks(n, FLAT_VEC_WIDTH))


def plan_nan_check(n: int) -> Plan:
    """``plan_clamp_finite``'s launch: one thread per float4 group (the kernel's vector path;
    its scalar fallback strides over the same grid)."""
    return plan_clamp_finite(n)


plan_target_q_clip = plan_flat


def plan_nan_check_fused(lengths: Sequence[int]) -> Plan:
    """One block per chunk of ``FUSED_THREADS * FUSED_PER_THREAD`` elements over all slots
    (capped at ``FUSED_MAX_BLOCKS``; the kernel's blocks stride over the chunks, so any grid
    covers every slot whatever the device lengths are)."""
    chunk = FUSED_THREADS * FUSED_PER_THREAD
    chunks = sum(-(-max(int(n), 0) // chunk) for n in lengths)
    return (max(1, min(FUSED_MAX_BLOCKS, chunks)),), (FUSED_THREADS,), 0


def plan_max_abs(n: int) -> Plan:
    """One block (the reduction tree is fixed, no second kernel, no atomics)."""
    del n
    return (1,), (REDUCE_THREADS,), 0


# --------------------------------------------------------------------------------------------
# Test entries (reference signatures)
# --------------------------------------------------------------------------------------------


def clamp_finite(x: np.ndarray, m: float) -> np.ndarray:
    """``isfinite(x) ? clip(x, -m, m) : 0`` on the GPU (see the reference's contract)."""
    bound = validate_clamp_finite(x, m)
    # A signal at the floor makes the device bound multiplier * fmaxf(1, 1) == bound exactly.
    signal = np.array([ISV_FLOOR], dtype=F32)
    (out,) = launch("clamp_finite", plan_clamp_finite(x.size), In(x), Out(x.shape, F32),
                     x.size, bound, In(signal))
    return out


def nan_check(x: np.ndarray, flag: int) -> np.int32:
    """Sticky sentinel check of one buffer: the slot's new int32 flag."""
    current = validate_nan_check(x, flag)
    (new_flag,) = launch("nan_check", plan_nan_check(x.size), In(x), x.size,
                          InOut(np.array([current], dtype=I32)))
    return np.int32(new_flag[0])


def nan_check_fused(buffers: Sequence[np.ndarray | None], flags: np.ndarray,
                    thresholds: np.ndarray) -> np.ndarray:
    """All sentinel slots in one launch: the new int32[n] flags.

    The test entry copies each buffer to its own device allocation and builds the kernel's
    device arrays of addresses (0 for a ``None`` or empty buffer) and lengths from the list.
    """
    validate_nan_check_fused(buffers, flags, thresholds)
    from foxhunt.fast.device import call as cu
    from cuda.bindings import driver

    device = runtime().device
    keep = []  # the slot buffers stay allocated until the launch has finished
    addresses = np.zeros(len(buffers), dtype=np.uint64)
    lengths = np.zeros(len(buffers), dtype=np.int64)
    try:
        for k, buf in enumerate(buffers):
            if buf is None or buf.size == 0:
                continue  # deferred or empty slot: never fires
            host = np.ascontiguousarray(buf)
            alloc = device.alloc(host.nbytes)
            keep.append(alloc)
            cu(driver.cuMemcpyHtoD, alloc.ptr, host.ctypes.data, host.nbytes)
            addresses[k] = alloc.ptr
            lengths[k] = host.size
        (new_flags,) = launch("nan_check_fused", plan_nan_check_fused(lengths.tolist()),
                               In(addresses), In(lengths), In(thresholds), InOut(flags),
                               len(buffers))
    finally:
        for alloc in keep:
            alloc.free()
    return new_flags


def max_abs(x: np.ndarray) -> np.float32:
    """``max_i |x_i|`` (fmaxf from 0: NaN ignored, empty or all-NaN gives 0) on the GPU."""
    check_f32_array("x", x)
    (out,) = launch("max_abs", plan_max_abs(x.size), In(x), x.size, Out((1,), F32))
    return np.float32(out[0])


def target_q_clip(q: np.ndarray, k1: float, q_abs_ref: float) -> np.ndarray:
    """Mech 1 target-Q clip on the GPU; the bound ``k1 * fmaxf(q_abs_ref, 1)`` is formed on
    the device from a pointer to the ISV value, as in the trainer."""
    multiplier, q_abs_ref32 = validate_target_q_clip(q, k1, q_abs_ref)
    isv_value = np.array([q_abs_ref32], dtype=F32)
    (out,) = launch("target_q_clip", plan_target_q_clip(q.size), In(q), Out(q.shape, F32),
                     q.size, multiplier, In(isv_value))
    return out


KERNELS = {
    "clamp_finite": clamp_finite,
    "nan_check": nan_check,
    "nan_check_fused": nan_check_fused,
    "max_abs": max_abs,
    "target_q_clip": target_q_clip,
}
