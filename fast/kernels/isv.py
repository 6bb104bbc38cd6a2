"""Fast-path launchers of the ISV producer kernels (``cuda_src/isv.cu``), twins of
``foxhunt.reference.kernels.isv`` under the same names and signatures.

The kernels update the ISV vector in place, writing only the slots they produce (every other
slot, the fingerprint bits included, keeps its bits). Slot indices, the signal count and the
adaptive-rate constants come from the ISV registry (``foxhunt.reference.isv``) as kernel
arguments, so they are defined once:

- ``isv_signal_update(isv, signals, num_signals, sharpe, alpha_base, sharpe_clamp,
  sharpe_gain)``: ``sharpe`` is a device pointer to one float32 (the bus's Sharpe slot in the
  trainer, refreshed by the host at epoch end, so the captured graph needs no update);
- ``isv_q_abs_ref_update(isv, slot, q, n, alpha)`` and ``isv_h2_rms_update(isv, slot, h2, n,
  alpha)``: one block reduces the ``n`` values (fixed tree, no atomics).

Numerics: ``isv_signal_update`` rounds exactly as the reference (bitwise equal); the two
mean-based producers differ from NumPy's summation order by rounding only (reduction
tolerance).
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.kernels._runtime import In, InOut, call
from foxhunt.reference.isv import (
    H_S2_RMS_EMA_INDEX,
    NUM_SIGNALS,
    Q_ABS_REF_INDEX,
    SHARPE_CLAMP,
    SHARPE_GAIN,
)
from foxhunt.reference.kernels.isv import (
    validate_isv_h2_rms_update,
    validate_isv_q_abs_ref_update,
    validate_isv_signal_update,
)

F32 = np.float32

#: Threads of the one-block mean reductions, at most (a multiple of 32).
REDUCTION_MAX_THREADS = 1024
#: Block sizes are whole warps (the block trees need them).
WARP = 32

Plan = tuple[int, int, int]


def _warp_multiple(count: int, cap: int) -> int:
    return min(cap, max(WARP, -(-int(count) // WARP) * WARP))


def plan_isv_signal_update(num_signals: int = NUM_SIGNALS) -> Plan:
    """One block, one thread per signal slot."""
    return 1, _warp_multiple(num_signals, REDUCTION_MAX_THREADS), 0


def plan_isv_q_abs_ref_update(n: int) -> Plan:
    """One block reducing ``n`` Q values; its size (hence the tree) depends on ``n`` only."""
    return 1, _warp_multiple(n, REDUCTION_MAX_THREADS), 0


def plan_isv_h2_rms_update(n: int) -> Plan:
    """One block reducing ``n`` activations; its size depends on ``n`` only."""
    return 1, _warp_multiple(n, REDUCTION_MAX_THREADS), 0


def isv_signal_update(isv: np.ndarray, signals: np.ndarray, sharpe: float,
                      alpha_base: float) -> np.ndarray:
    """Test entry of the CUDA ``isv_signal_update``: guarded EMA of the 13 signal slots at the
    Sharpe-adaptive rate. Contract as the reference twin (bitwise); returns the new ``isv``."""
    ab = validate_isv_signal_update(isv, signals, sharpe, alpha_base)
    with np.errstate(over="ignore"):  # a huge float64 Sharpe becomes +/-inf, as in the reference
        sharpe32 = F32(sharpe)
    grid, block, smem = plan_isv_signal_update(NUM_SIGNALS)
    (out,) = call("isv_signal_update", grid, block, InOut(isv), In(signals), NUM_SIGNALS,
                  In(np.array([sharpe32], dtype=F32)), ab, F32(SHARPE_CLAMP), F32(SHARPE_GAIN),
                  shared_mem=smem)
    return out


def isv_q_abs_ref_update(isv: np.ndarray, q: np.ndarray, alpha: float) -> np.ndarray:
    """Test entry of the CUDA ``isv_q_abs_ref_update``: guarded EMA of the mean ``|q|`` over the
    finite ``q`` into ``ISV[Q_ABS_REF]``. Contract as the reference twin."""
    a = validate_isv_q_abs_ref_update(isv, q, alpha)
    grid, block, smem = plan_isv_q_abs_ref_update(q.size)
    (out,) = call("isv_q_abs_ref_update", grid, block, InOut(isv), Q_ABS_REF_INDEX, In(q), q.size,
                  a, shared_mem=smem)
    return out


def isv_h2_rms_update(isv: np.ndarray, h2: np.ndarray, alpha: float) -> np.ndarray:
    """Test entry of the CUDA ``isv_h2_rms_update``: guarded EMA of ``RMS(h2)`` over the finite
    ``h2`` into ``ISV[H_S2_RMS_EMA]``. Contract as the reference twin."""
    a = validate_isv_h2_rms_update(isv, h2, alpha)
    grid, block, smem = plan_isv_h2_rms_update(h2.size)
    (out,) = call("isv_h2_rms_update", grid, block, InOut(isv), H_S2_RMS_EMA_INDEX, In(h2),
                  h2.size, a, shared_mem=smem)
    return out


KERNELS = {
    "isv_signal_update": isv_signal_update,
    "isv_q_abs_ref_update": isv_q_abs_ref_update,
    "isv_h2_rms_update": isv_h2_rms_update,
}

__all__ = [
    "KERNELS", "isv_h2_rms_update", "isv_q_abs_ref_update", "isv_signal_update",
    "plan_isv_h2_rms_update", "plan_isv_q_abs_ref_update", "plan_isv_signal_update",
]
