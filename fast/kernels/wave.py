"""Fast launchers of the second-wave step plumbing (``cuda_src/wave.cu``), twins of
``foxhunt.reference.kernels.wave`` under the same names and signatures.

Each public function is a numpy-in/numpy-out test entry (conformance and debugging): it
validates with the reference's ``validate_<name>`` (same ``ValueError``), launches the CUDA
kernel once through ``_runtime.launch`` and returns what the reference returns. The step plan
launches the same kernels on arena pointers with ``plan_single`` (one thread: a handful of
scalars). Exact: each kernel rounds where its reference does.
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.kernels._runtime import In, InOut, launch
from foxhunt.reference.kernels.wave import (
    validate_mse_loss_blend,
    validate_source_norm_scalars,
    validate_step_count_advance,
)

Plan = tuple[int, int, int]


def plan_single() -> Plan:
    """One block of one thread."""
    return 1, 1, 0


def step_count_advance(step_count) -> np.ndarray:
    """Test entry of the CUDA ``step_count_advance`` (contract as the reference twin)."""
    validate_step_count_advance(step_count)
    (out,) = launch("step_count_advance", plan_single(), InOut(step_count))
    return out


def source_norm_scalars(norm_sq, readback, budget, pre_index, post_index) -> np.ndarray:
    """Test entry of the CUDA ``source_norm_scalars`` (contract as the reference twin)."""
    budget, pre, post = validate_source_norm_scalars(norm_sq, readback, budget, pre_index,
                                                     post_index)
    (out,) = launch("source_norm_scalars", plan_single(), In(norm_sq), InOut(readback), budget,
                    pre, post)
    return out


def mse_loss_blend(readback, c51_index, mse_loss_index, mse_weight_index) -> np.ndarray:
    """Test entry of the CUDA ``mse_loss_blend`` (contract as the reference twin)."""
    c51, mse, weight = validate_mse_loss_blend(readback, c51_index, mse_loss_index,
                                               mse_weight_index)
    (out,) = launch("mse_loss_blend", plan_single(), InOut(readback), c51, mse, weight)
    return out


KERNELS = {
    "step_count_advance": step_count_advance,
    "source_norm_scalars": source_norm_scalars,
    "mse_loss_blend": mse_loss_blend,
}
