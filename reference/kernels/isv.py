"""ISV producer kernels: EMA updates of bus slots (SPEC 7; seed ``002``).

Every kernel takes the whole ISV vector ``isv`` (float32 ``[ISV_LEN]``) and returns its new
value; only the slots the kernel produces change, every other element (the fingerprint bits
included) is copied bit-exactly. The input is never mutated.

One EMA rule for all of them (``_ema``), per slot:

    new = (1 - alpha) * old + alpha * x        float32, each product and the sum rounded
                                               (the CUDA twin uses __fmul_rn/__fadd_rn, no FMA)

NaN/Inf contract (a non-finite input never poisons a slot):
  * ``x`` non-finite                 -> ``old`` (the slot keeps its value);
  * ``old`` non-finite, ``x`` finite -> ``x``   (a poisoned slot is re-seeded by the next signal);
  * the blend overflows              -> ``old``.
So a slot that holds a finite value always holds a finite value afterwards.
"""

from __future__ import annotations

import math

import numpy as np

from foxhunt.reference.isv import (
    H_S2_RMS_EMA_INDEX,
    ISV_LEN,
    NUM_SIGNALS,
    Q_ABS_REF_INDEX,
    adaptive_ema_rate,
)


# --------------------------------------------------------------------------- checks
def _check_isv(isv: np.ndarray) -> None:
    if not isinstance(isv, np.ndarray) or isv.dtype != np.float32 or isv.shape != (ISV_LEN,):
        raise ValueError(
            f"isv: got {type(isv).__name__} {getattr(isv, 'dtype', '?')} "
            f"{getattr(isv, 'shape', '?')}; need a float32 array of shape ({ISV_LEN},)"
        )


def _check_f32_array(name: str, x: np.ndarray, shape: tuple[int, ...] | None = None) -> None:
    if not isinstance(x, np.ndarray) or x.dtype != np.float32:
        raise ValueError(
            f"{name}: got {type(x).__name__} {getattr(x, 'dtype', '?')}; need a float32 array"
        )
    if shape is not None and x.shape != shape:
        raise ValueError(f"{name}: shape {x.shape}; need {shape}")
    if shape is None and x.ndim < 1:
        raise ValueError(f"{name}: a 0-d array; need at least one dimension")


def _check_scalar(name: str, value: float, lo: float, hi: float) -> np.float32:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ValueError(f"{name}={value!r}: need a real scalar")
    v = float(value)
    if not math.isfinite(v) or not lo <= v <= hi:
        raise ValueError(f"{name}={value!r}: must be finite and in [{lo}, {hi}]")
    return np.float32(v)


def _check_sharpe(sharpe: float) -> None:
    if isinstance(sharpe, bool) or not isinstance(sharpe, (int, float, np.floating, np.integer)):
        raise ValueError(f"sharpe={sharpe!r}: need a real scalar (NaN allowed)")


# --------------------------------------------------------------------------- validation
# Shared with the fast test entries (foxhunt.fast.kernels.isv).
def validate_isv_signal_update(isv, signals, sharpe, alpha_base) -> np.float32:
    """The argument checks of ``isv_signal_update``; returns ``alpha_base`` in float32."""
    _check_isv(isv)
    _check_f32_array("signals", signals, (NUM_SIGNALS,))
    _check_sharpe(sharpe)
    return _check_scalar("alpha_base", alpha_base, 0.0, 0.5)


def _validate_mean_ema(isv, name: str, x, alpha) -> np.float32:
    _check_isv(isv)
    _check_f32_array(name, x)
    return _check_scalar("alpha", alpha, 0.0, 1.0)


def validate_isv_q_abs_ref_update(isv, q, alpha) -> np.float32:
    """The argument checks of ``isv_q_abs_ref_update``; returns ``alpha`` in float32."""
    return _validate_mean_ema(isv, "q", q, alpha)


def validate_isv_h2_rms_update(isv, h2, alpha) -> np.float32:
    """The argument checks of ``isv_h2_rms_update``; returns ``alpha`` in float32."""
    return _validate_mean_ema(isv, "h2", h2, alpha)


# --------------------------------------------------------------------------- the EMA rule
def _ema(old: np.ndarray, x: np.ndarray, alpha: np.float32) -> np.ndarray:
    """The guarded float32 EMA of the module docstring, elementwise."""
    old = np.asarray(old, np.float32)
    x = np.asarray(x, np.float32)
    keep = np.float32(1.0) - alpha
    with np.errstate(over="ignore", invalid="ignore"):
        blended = keep * old + alpha * x
    x_ok = np.isfinite(x)
    return np.where(~x_ok, old,
                    np.where(~np.isfinite(old), x,
                             np.where(np.isfinite(blended), blended, old))).astype(np.float32)


def _replace_slot(isv: np.ndarray, index: int, value: np.float32) -> np.ndarray:
    out = isv.copy()
    out[index] = value
    return out


# --------------------------------------------------------------------------- kernels
def isv_signal_update(isv: np.ndarray, signals: np.ndarray, sharpe: float,
                      alpha_base: float) -> np.ndarray:
    """EMA of the 13 signal slots ``isv[0:13]`` toward this step's raw ``signals``.

    ``alpha = alpha_base * (1 + 0.5 * |clamp(sharpe, -2, 2)|)`` (``isv.adaptive_ema_rate``: NaN
    Sharpe counts as 0, +/-Inf clamps to +/-2), then per slot i < 13
    ``isv'[i] = (1 - alpha) * isv[i] + alpha * signals[i]`` with the module's NaN guards
    (non-finite ``signals[i]`` -> slot unchanged; non-finite ``isv[i]`` -> ``signals[i]``).

    Shapes/dtypes: ``isv`` float32 ``[ISV_LEN]``, ``signals`` float32 ``[13]``, ``sharpe`` and
    ``alpha_base`` scalars (passed to the kernel as float32); ``alpha_base`` in ``[0, 0.5]``.
    Returns the new ``isv`` (float32 ``[ISV_LEN]``); slots >= 13 are copied bit-exactly.
    """
    alpha_base = validate_isv_signal_update(isv, signals, sharpe, alpha_base)
    alpha = adaptive_ema_rate(sharpe, alpha_base)
    out = isv.copy()
    out[:NUM_SIGNALS] = _ema(isv[:NUM_SIGNALS], signals, alpha)
    return out


def isv_q_abs_ref_update(isv: np.ndarray, q: np.ndarray, alpha: float) -> np.ndarray:
    """EMA of the batch's mean ``|Q|`` into ``ISV[Q_ABS_REF]`` (slot 16).

    ``mean_abs = sum(|q_i| for finite q_i) / count(finite q_i)`` (float32 accumulation; the
    reduction order is NumPy's and may differ from the CUDA tree by rounding), then
    ``isv'[16] = (1 - alpha) * isv[16] + alpha * mean_abs`` with the module's NaN guards.
    Non-finite ``q_i`` are skipped; if none is finite (or ``q`` is empty, or the sum overflows)
    the slot is unchanged.

    Shapes/dtypes: ``isv`` float32 ``[ISV_LEN]``; ``q`` float32, any shape (e.g. ``[B, n_actions]``
    expected Q values); ``alpha`` scalar in ``[0, 1]``. Returns the new ``isv``.
    """
    alpha = validate_isv_q_abs_ref_update(isv, q, alpha)
    finite = q[np.isfinite(q)]
    if finite.size == 0:
        return isv.copy()
    with np.errstate(over="ignore"):
        total = np.sum(np.abs(finite), dtype=np.float32)
        mean_abs = np.float32(total / np.float32(finite.size))
    new = _ema(isv[Q_ABS_REF_INDEX:Q_ABS_REF_INDEX + 1], np.array([mean_abs], np.float32), alpha)
    return _replace_slot(isv, Q_ABS_REF_INDEX, new[0])


def isv_h2_rms_update(isv: np.ndarray, h2: np.ndarray, alpha: float) -> np.ndarray:
    """EMA of ``RMS(h2)`` into ``ISV[H_S2_RMS_EMA]`` (slot 96), the Mech 10 / slot 49 base.

    ``rms = sqrt(max(sum(h_i^2 for finite h_i) / count(finite h_i), 0))`` (float32
    accumulation), then ``isv'[96] = (1 - alpha) * isv[96] + alpha * rms`` with the module's NaN
    guards. Non-finite ``h_i`` are skipped; if none is finite, or the squares overflow float32
    (|h| > ~1.8e19), the slot is unchanged.

    Shapes/dtypes: ``isv`` float32 ``[ISV_LEN]``; ``h2`` float32 ``[B, SH2]`` (any shape is
    accepted; the caller decides whether it is taken before or after the Mech 10 clamp);
    ``alpha`` scalar in ``[0, 1]``. Returns the new ``isv``.
    """
    alpha = validate_isv_h2_rms_update(isv, h2, alpha)
    finite = h2[np.isfinite(h2)]
    if finite.size == 0:
        return isv.copy()
    with np.errstate(over="ignore", invalid="ignore"):
        total = np.sum(np.square(finite), dtype=np.float32)
        mean_sq = np.float32(total / np.float32(finite.size))
        rms = np.sqrt(np.fmax(mean_sq, np.float32(0.0)), dtype=np.float32)
    new = _ema(isv[H_S2_RMS_EMA_INDEX:H_S2_RMS_EMA_INDEX + 1], np.array([rms], np.float32), alpha)
    return _replace_slot(isv, H_S2_RMS_EMA_INDEX, new[0])


KERNELS = {
    "isv_signal_update": isv_signal_update,
    "isv_q_abs_ref_update": isv_q_abs_ref_update,
    "isv_h2_rms_update": isv_h2_rms_update,
}
