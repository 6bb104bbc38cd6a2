"""Fast-path launchers of the prioritised-replay kernels (``cuda_src/replay.cu``; reference:
``foxhunt.reference.kernels.replay``).

Each public function has the reference's name and signature, validates with the reference's
``validate_<name>`` (or check; same ``ValueError``), runs the CUDA kernel once and returns the
reference's shapes and dtypes. ``plan_<name>(...)`` gives ``(grid, block, shared_mem)``.
Kernel parameters (C order):

- ``prefix_sum(p, s, n)``: ONE block of ``SCAN_THREADS`` threads (the kernel's launch bound)
  scanning tiles of ``SCAN_THREADS * 8`` elements in order, chained by a carry.
- ``sample_proportional(prefix, n_items, u, out, n)``: one thread per uniform, any grid; the
  total is ``prefix[n_items - 1]``, read on the device.
- ``importance_weights(priorities, idx, w, n, beta)``: ONE block (fminf tree, then a division
  and a ``powf`` per weight); the caller guarantees ``0 <= idx < n_valid``.

Numerics: ``sample_proportional`` is exact. ``prefix_sum`` associates differently from the
reference's sequential sum: results differ by rounding (conformance: reduction tolerance, with
length ``n`` and magnitude ``max|p|``). ``importance_weights`` uses CUDA ``powf`` (not correctly
rounded, a few ULP; glibc's ``powf`` on the reference side is within 1 ULP), compared under the
reduction tolerance (relative 1e-5).
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.kernels._runtime import In, Out, blocks, launch, plan_flat
from foxhunt.reference.kernels.argcheck import check_f32_array
from foxhunt.reference.kernels.replay import (
    validate_importance_weights,
    validate_sample_proportional,
)

F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)

#: prefix_sum's block size: fixed by the kernel (__launch_bounds__, 32 warps for the warp-total
#: scan); do not change one without the other.
SCAN_THREADS = 1024
#: importance_weights: one block, up to this many threads, a multiple of the warp size.
WEIGHTS_MAX_THREADS = 1024
WARP = 32

Plan = tuple  # (grid, block, shared_mem)


# --------------------------------------------------------------------------------------------
# Launch plans
# --------------------------------------------------------------------------------------------


def plan_prefix_sum(n: int) -> Plan:
    """One block of ``SCAN_THREADS`` (any ``n``; the kernel loops over tiles)."""
    del n
    return (1,), (SCAN_THREADS,), 0


#: One thread per uniform (grid-stride).
plan_sample_proportional = plan_flat


def plan_importance_weights(n: int) -> Plan:
    """One block: one thread per sample up to ``WEIGHTS_MAX_THREADS``, in whole warps."""
    threads = min(WEIGHTS_MAX_THREADS, WARP * blocks(n, WARP))
    return (1,), (threads,), 0


# --------------------------------------------------------------------------------------------
# Test entries (reference signatures)
# --------------------------------------------------------------------------------------------


def prefix_sum(p: np.ndarray) -> np.ndarray:
    """Inclusive prefix sums of ``p`` (float32[N]) on the GPU (single-block scan)."""
    check_f32_array("p", p, ndim=1)
    (s,) = launch("prefix_sum", plan_prefix_sum(p.size), In(p), Out(p.shape, F32), p.size)
    return s


def sample_proportional(prefix: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Proportional sampling by binary search on ``prefix`` (int32[n]), exactly the reference's."""
    n_items = validate_sample_proportional(prefix, u)
    (out,) = launch("sample_proportional", plan_sample_proportional(u.size), In(prefix), n_items,
                     In(u), Out(u.shape, I32), u.size)
    return out


def importance_weights(priorities: np.ndarray, idx: np.ndarray, beta: float,
                       n_valid: int) -> np.ndarray:
    """PER importance weights ``(p_min / p_{idx_k}) ** beta`` (float32[n]) on the GPU."""
    beta32, _ = validate_importance_weights(priorities, idx, beta, n_valid)
    (w,) = launch("importance_weights", plan_importance_weights(idx.size), In(priorities),
                   In(idx), Out(idx.shape, F32), idx.size, beta32)
    return w


KERNELS = {
    "prefix_sum": prefix_sum,
    "sample_proportional": sample_proportional,
    "importance_weights": importance_weights,
}
