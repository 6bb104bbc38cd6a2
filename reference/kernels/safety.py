"""Safety kernels (SPEC 5, 6; seed: NaN audit, SP1-SP3): finite clamps, sentinel NaN checks,
max-abs diagnostics and the Mech 1 target-Q clip.

NaN conventions used here (each kernel's docstring states its own contract):

- ``clamp_finite`` is the sanitiser of Mech 9 / Mech 10: NaN and +/-Inf become +0.0.
- Sentinel checks (``nan_check``, ``nan_check_fused``) *detect*: they never change data, and
  their flags are sticky (a flag that is 1 stays 1 until the fold-boundary reset).
- Reductions written with CUDA ``fmaxf`` (``max_abs``, the ``max(isv, 1)`` floor of every
  ISV-driven bound) return the non-NaN operand, so the reference uses ``np.fmax``.
- ``target_q_clip`` clips with comparisons, so a NaN target stays NaN (visible to the sentinel
  and the loss readback) instead of being turned into a bound by ``fmaxf``/``fminf``.

The argument checks shared by the reference kernels (``check_f32_array`` and friends) live in
``foxhunt.reference.kernels.argcheck`` and are re-exported here. Each kernel's
``validate_<name>`` is shared with its fast test entry (``foxhunt.fast.kernels.safety``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

# The shared argument checks live in ``_checks``; re-exported here, where they used to be.
from foxhunt.reference.kernels.argcheck import (
    check_array,
    check_f32_array,
    check_f32_scalar,
    check_flag,
    check_int,
    check_same_shape,
    data_f32,
)

# ---------------------------------------------------------------------------------------------
# Helpers (not kernels)
# ---------------------------------------------------------------------------------------------

#: The floor of every ISV-driven bound: ``multiplier * max(isv, ISV_FLOOR)`` (SPEC 5).
ISV_FLOOR = np.float32(1.0)


def _isv_bound_args(multiplier: float, isv_value: float) -> tuple[np.float32, np.float32]:
    """``isv_bound``'s checks: ``(multiplier, isv_value)`` as float32."""
    return (check_f32_scalar("multiplier", multiplier, lo=0.0, lo_open=True),
            data_f32("isv_value", isv_value))


def _isv_bound_f32(m: np.float32, isv: np.float32) -> np.float32:
    with np.errstate(over="ignore"):
        return np.float32(m * np.fmax(isv, ISV_FLOOR))


def isv_bound(multiplier: float, isv_value: float) -> np.float32:
    """ISV-driven bound ``multiplier * fmaxf(isv_value, 1)`` in float32 (SPEC 5, Mech 1/2/5/9/10).

    The floor is on the *signal*, never on the bound: a cold-start ISV of 0 gives exactly
    ``multiplier`` (``bound.max(const)`` would re-create the seeds' cold-start clamp pathology).
    ``isv_value`` is data: NaN or -Inf give ``multiplier`` (CUDA ``fmaxf`` returns the non-NaN
    operand), +Inf gives +Inf (no bound), a huge value may overflow to +Inf.
    ``multiplier`` must be finite and > 0.
    """
    return _isv_bound_f32(*_isv_bound_args(multiplier, isv_value))


# ---------------------------------------------------------------------------------------------
# Validation shared with the fast test entries
# ---------------------------------------------------------------------------------------------


def validate_clamp_finite(x, m) -> np.float32:
    """The argument checks of ``clamp_finite``; returns the bound ``m`` in float32."""
    check_f32_array("x", x)
    return check_f32_scalar("m", m, lo=0.0, allow_inf=True)


def validate_nan_check(x, flag) -> np.int32:
    """The argument checks of ``nan_check``; returns ``flag`` as int32."""
    check_f32_array("x", x)
    return check_flag("flag", flag)


def validate_nan_check_fused(buffers, flags, thresholds) -> None:
    """The argument checks of ``nan_check_fused``: flags, thresholds, then every buffer."""
    check_array("flags", flags, np.int32, ndim=1)
    check_f32_array("thresholds", thresholds, ndim=1)
    n = len(buffers)
    if flags.shape != (n,) or thresholds.shape != (n,):
        raise ValueError(f"flags shape {flags.shape} and thresholds shape {thresholds.shape} "
                         f"must both be ({n},), one entry per buffer")
    if np.any((flags != 0) & (flags != 1)):
        raise ValueError(f"flags={flags!r}: every flag must be 0 or 1")
    for k, buf in enumerate(buffers):
        if buf is not None:
            check_f32_array(f"buffers[{k}]", buf)


def validate_target_q_clip(q, k1, q_abs_ref) -> tuple[np.float32, np.float32]:
    """The argument checks of ``target_q_clip`` (``isv_bound``'s for ``k1``, ``q_abs_ref``);
    returns ``(k1, q_abs_ref)`` in float32."""
    check_f32_array("q", q)
    return _isv_bound_args(k1, q_abs_ref)


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


def clamp_finite(x: np.ndarray, m: float) -> np.ndarray:
    """Sanitising clamp: ``isfinite(x) ? clamp(x, -m, m) : 0`` (Mech 9, Mech 10, aux guard).

    Shapes: ``x`` float32, any shape; ``m`` float32 scalar, ``m >= 0`` (``+inf`` allowed: only
    the non-finite map applies). Returns a new float32 array of ``x``'s shape.

    NaN contract: exact. NaN, +Inf and -Inf become +0.0; finite values are clamped to
    ``[-m, m]`` (``-0.0`` stays ``-0.0``). The output is never non-finite.
    """
    bound = validate_clamp_finite(x, m)
    return np.where(np.isfinite(x), np.clip(x, -bound, bound), np.float32(0.0)).astype(
        np.float32, copy=False)


def nan_check(x: np.ndarray, flag: int) -> np.int32:
    """Sticky sentinel check of one buffer: ``flag | any(!isfinite(x))`` as int32 0/1.

    Shapes: ``x`` float32, any shape (empty allowed: nothing to flag); ``flag`` the slot's
    current int32 value, 0 or 1. Returns the slot's new value.

    NaN contract: fires exactly when ``x`` holds a NaN, +Inf or -Inf; large finite values and
    subnormals do not fire. Never clears a set flag.
    """
    f = validate_nan_check(x, flag)
    return np.int32(1) if f or not np.all(np.isfinite(x)) else np.int32(0)


def nan_check_fused(buffers: Sequence[np.ndarray | None], flags: np.ndarray,
                    thresholds: np.ndarray) -> np.ndarray:
    """All per-step sentinel slots in one launch (one CUDA block per slot; SPEC 6).

    Slot ``k`` fires (its flag becomes 1) if ``buffers[k]`` holds any non-finite element, or if
    ``thresholds[k] > 0`` and ``max|buffers[k]| >= thresholds[k]``. Flags are sticky.

    Shapes: ``buffers`` a sequence of n entries, each a float32 array (any shape, may be empty)
    or ``None`` (a deferred slot: never fires, flag kept); ``flags`` int32[n] of 0/1;
    ``thresholds`` float32[n]. Returns the new int32[n] flags.

    NaN contract: a threshold that is 0, negative or NaN disables the magnitude test (the
    comparison ``threshold > 0`` is false); the non-finite test always runs. A ``+inf``
    threshold can only be met by an Inf element, which fires anyway.
    """
    validate_nan_check_fused(buffers, flags, thresholds)
    out = flags.copy()
    for k, buf in enumerate(buffers):
        if buf is None or buf.size == 0:
            continue
        fires = not np.all(np.isfinite(buf))
        threshold = thresholds[k]
        if not fires and threshold > 0:
            fires = bool(np.max(np.abs(buf)) >= threshold)
        if fires:
            out[k] = 1
    return out


def max_abs(x: np.ndarray) -> np.float32:
    """``max_i |x_i|`` as an ``fmaxf`` reduction starting at 0 (Mech 5 / slot 49 diagnostics).

    Shapes: ``x`` float32, any shape. Returns a float32 scalar; exact (max is exact).

    NaN contract: NaN elements are ignored (``fmaxf`` returns the non-NaN operand, so the result
    does not depend on reduction order); +/-Inf give +Inf; an empty or all-NaN ``x`` gives 0.
    Non-finite elements are the job of the NaN checks, which run beside this diagnostic.
    """
    check_f32_array("x", x)
    return np.float32(np.fmax.reduce(np.abs(x), axis=None, initial=np.float32(0.0)))


def target_q_clip(q: np.ndarray, k1: float, q_abs_ref: float) -> np.ndarray:
    """Mech 1 target-Q clip: ``clip(q, -b, b)``, ``b = k1 * fmaxf(q_abs_ref, 1)`` (``isv_bound``).

    Shapes: ``q`` float32, any shape; ``k1`` the config multiplier (finite, > 0); ``q_abs_ref``
    the ISV slot ``Q_ABS_REF`` (data, float32). Returns a new float32 array of ``q``'s shape.

    NaN contract: the bound follows ``isv_bound`` (the floor is on the signal: NaN or a
    cold-start ``q_abs_ref`` below 1 give ``b = k1``; +Inf gives no clip). The clip is written
    with comparisons (``q > b ? b : (q < -b ? -b : q)``), so a NaN target stays NaN and stays
    visible to the sentinels and the loss readback; +/-Inf become +/-b. (An ``fminf(fmaxf(..))``
    clip would instead turn NaN into a bound, silently and order-dependently.)
    """
    bound = _isv_bound_f32(*validate_target_q_clip(q, k1, q_abs_ref))
    return np.clip(q, -bound, bound).astype(np.float32, copy=False)


KERNELS = {
    "clamp_finite": clamp_finite,
    "nan_check": nan_check,
    "nan_check_fused": nan_check_fused,
    "max_abs": max_abs,
    "target_q_clip": target_q_clip,
}

__all__ = [
    "ISV_FLOOR", "KERNELS", "check_array", "check_f32_array", "check_f32_scalar", "check_flag",
    "check_int", "check_same_shape", "clamp_finite", "data_f32", "isv_bound", "max_abs",
    "nan_check", "nan_check_fused", "target_q_clip", "validate_clamp_finite", "validate_nan_check",
    "validate_nan_check_fused", "validate_target_q_clip",
]
