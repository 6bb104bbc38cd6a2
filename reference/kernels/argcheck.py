"""Argument checks shared by the reference kernel modules (not kernels; not in any ``KERNELS``).

Bad arguments raise ``ValueError`` naming the argument, the bad value or shape, and what is
allowed. Data values (NaN, Inf in arrays or data scalars) are never errors: they follow each
kernel's NaN contract.

Two families, each with its own message wording (kept as the kernels have always raised it):

- ``require_array`` / ``require_shape`` / ``f32_scalar``: the dense and distributional kernels;
- ``check_array`` and friends (``check_f32_array``, ``check_same_shape``, ``data_f32``,
  ``check_f32_scalar``, ``check_int``, ``check_flag``): optim, spectral, safety and replay.

A kernel whose validation is more than one check has a ``validate_<name>`` in its area module
built from these; the fast test entry of the same name calls it too, so the rules exist once.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

# Kernels follow IEEE arithmetic on purpose (NaN/Inf propagate per their contracts), so
# NumPy's floating-point warnings are noise: a decorator that silences them for kernel bodies.
ieee = np.errstate(all="ignore")


# ---------------------------------------------------------------------------------------------
# Dense / distributional family
# ---------------------------------------------------------------------------------------------


def require_array(name: str, x, dtype, ndim: int | None = None) -> np.ndarray:
    """Return ``x`` if it is an ndarray of exactly ``dtype`` (and ``ndim`` dims), else raise."""
    want = np.dtype(dtype)
    if not isinstance(x, np.ndarray):
        raise ValueError(
            f"{name}: expected a numpy.ndarray of dtype {want}, got {type(x).__name__}"
        )
    if x.dtype != want:
        raise ValueError(f"{name}: dtype {x.dtype} is not allowed; expected {want}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(
            f"{name}: shape {x.shape} has {x.ndim} dimension(s); expected {ndim}"
        )
    return x


def require_shape(name: str, x: np.ndarray, shape: tuple, meaning: str) -> None:
    """Raise unless ``x.shape == shape``; ``meaning`` spells the expected shape symbolically."""
    if x.shape != tuple(shape):
        raise ValueError(f"{name}: shape {x.shape} is not allowed; expected {meaning} = {shape}")


def f32_scalar(name: str, value) -> np.float32:
    """A real scalar argument (Python or NumPy number, or a 0-d real array) as float32, what the
    CUDA launch receives. Non-finite values are allowed (contracts say how they propagate)."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        raise ValueError(
            f"{name}: expected a real scalar (int, float or numpy floating), "
            f"got {type(value).__name__} {value!r}"
        )
    return np.float32(value)


# ---------------------------------------------------------------------------------------------
# Optim / spectral / safety / replay family
# ---------------------------------------------------------------------------------------------


def is_number(value: Any) -> bool:
    """A real scalar: a Python or NumPy int/float (not bool), or a 0-d real ndarray."""
    if isinstance(value, np.ndarray):
        return value.ndim == 0 and value.dtype.kind in "fiu"
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )


def check_array(name: str, x: Any, dtype: type, *, ndim: int | None = None) -> np.ndarray:
    """Return ``x`` if it is an ndarray of ``dtype`` (and ``ndim`` dimensions), else raise."""
    if not isinstance(x, np.ndarray):
        raise ValueError(f"{name}: expected a numpy.ndarray of {np.dtype(dtype).name}, "
                         f"got {type(x).__name__}")
    if x.dtype != dtype:
        raise ValueError(f"{name}: dtype {x.dtype} not allowed; expected {np.dtype(dtype).name}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name}: shape {x.shape} has {x.ndim} dimensions; expected {ndim}")
    return x


def check_f32_array(name: str, x: Any, *, ndim: int | None = None) -> np.ndarray:
    """Return ``x`` if it is a float32 ndarray (with ``ndim`` dimensions if given), else raise."""
    return check_array(name, x, np.float32, ndim=ndim)


def check_same_shape(**arrays: np.ndarray) -> None:
    """Raise unless all keyword arrays have the same shape (the first one is the reference)."""
    items = list(arrays.items())
    ref_name, ref = items[0]
    for name, arr in items[1:]:
        if arr.shape != ref.shape:
            raise ValueError(f"{name}: shape {arr.shape} differs from {ref_name} shape "
                             f"{ref.shape}; they must be equal")


def data_f32(name: str, value: Any) -> np.float32:
    """A data scalar (any float32 value, NaN and Inf included) rounded to float32."""
    if not is_number(value):
        raise ValueError(f"{name}={value!r}: expected a real scalar")
    with np.errstate(over="ignore"):
        return np.float32(value)


def check_f32_scalar(name: str, value: Any, *, lo: float = -math.inf, hi: float = math.inf,
                     lo_open: bool = False, hi_open: bool = False,
                     allow_inf: bool = False) -> np.float32:
    """A configuration scalar rounded to float32; raise unless it lies in the given range.

    NaN is always rejected; +/-Inf only with ``allow_inf`` (and if inside the range). The range
    is checked on the float32-rounded value, the one the kernel sees.
    """
    v = data_f32(name, value)
    ok = not math.isnan(v) and (allow_inf or math.isfinite(v))
    ok = ok and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not ok:
        left = "(" if lo_open else "["
        right = ")" if hi_open else "]"
        inf_note = "" if allow_inf else ", finite"
        raise ValueError(f"{name}={value!r}: allowed range is {left}{lo}, {hi}{right}{inf_note}"
                         f" (after rounding to float32: {v!r})")
    return v


def check_int(name: str, value: Any, *, minimum: int, maximum: int | None = None) -> int:
    """An integer argument (Python or NumPy integer, not bool) in ``[minimum, maximum]``."""
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    ok = ok and value >= minimum and (maximum is None or value <= maximum)
    if not ok:
        hi = "" if maximum is None else f" and <= {maximum}"
        raise ValueError(f"{name}={value!r}: must be an integer >= {minimum}{hi}")
    return int(value)


def check_flag(name: str, value: Any) -> np.int32:
    """A sentinel flag: the integer 0 or 1."""
    return np.int32(check_int(name, value, minimum=0, maximum=1))


__all__ = [
    "check_array", "check_f32_array", "check_f32_scalar", "check_flag", "check_int",
    "check_same_shape", "data_f32", "f32_scalar", "ieee", "is_number", "require_array",
    "require_shape",
]
