"""Fast launcher of the counter-based generator's conformance kernel (``cuda_src/rng.cu``), twin
of ``foxhunt.reference.kernels.rng`` under the same name and signature.

``philox_uniform`` is a numpy-in/numpy-out test entry: it validates with the reference's
``validate_philox_uniform`` (same ``ValueError``), launches the kernel once and returns the
draws. The kernels that consume random numbers call ``rng_uniform`` (``cuda_src/rng.cuh``)
inline; this launch exists so that the arithmetic is compared bit for bit.
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.kernels._runtime import Out, launch, plan_flat
from foxhunt.reference.kernels.rng import validate_philox_uniform

plan_philox_uniform = plan_flat


def philox_uniform(n, key_lo, key_hi, stream, offset_lo, offset_hi) -> np.ndarray:
    """Test entry of the CUDA ``philox_uniform`` (contract as the reference twin)."""
    n, k_lo, k_hi, s, o_lo, o_hi = validate_philox_uniform(n, key_lo, key_hi, stream, offset_lo,
                                                            offset_hi)
    (out,) = launch("philox_uniform", plan_philox_uniform(n), Out((n,), np.float32), n, k_lo, k_hi,
                    s, o_lo, o_hi)
    return out


KERNELS = {
    "philox_uniform": philox_uniform,
}
