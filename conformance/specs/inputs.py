"""The toolkit the kernel entries are written with: input generators, bound scales, output
contracts, error-case builders and the :class:`~foxhunt.conformance.kernel_spec.Output`
shorthands (``f32(EXACT)``: a float32 output compared exactly).

Generators return float32 (or int32) arrays from a ``numpy.random.Generator``; every finite
magnitude a bound needs is taken in float64 (:func:`maxabs`).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from foxhunt.conformance.kernel_spec import Contract, Kwargs, Output, Sample, case_dims
from foxhunt.conformance.tolerance import Tolerance

F32 = np.float32
I32 = np.int32

#: The value support ``[V_MIN, V_MAX]`` of the distributional samples.
V_MIN, V_MAX = -10.0, 10.0


# ------------------------------------------------------------------------ GEMM operands


def product_overflow(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Where the magnitudes of the finite products of ``a [M, K] @ b [K, N]`` add up past
    float32's range (float64; a non-finite operand counts 0): whether a partial sum then overflows
    depends on the summation order, which is no GEMM kernel's contract (``compare``'s
    ``overflow``)."""
    with np.errstate(invalid="ignore", over="ignore"):
        finite = [np.where(np.isfinite(x), np.abs(x), 0).astype(np.float64) for x in (a, b)]
        return (finite[0] @ finite[1]) > np.finfo(F32).max


# ----------------------------------------------------------------------------- outputs
def f32(tolerance: Tolerance) -> Output:
    """A float32 output judged by ``tolerance``."""
    return Output("float32", tolerance)


def i32(tolerance: Tolerance) -> Output:
    """An int32 output (indices, flags) judged by ``tolerance``."""
    return Output("int32", tolerance)


def u16(tolerance: Tolerance) -> Output:
    """A BF16 bit-pattern output (held in uint16) judged by ``tolerance``."""
    return Output("uint16", tolerance)


# ------------------------------------------------------------------------------ generators
def normal(rng: np.random.Generator, shape, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(F32)


def uniform(rng: np.random.Generator, shape, lo: float, hi: float) -> np.ndarray:
    return rng.uniform(lo, hi, shape).astype(F32)


def bits_f32(rng: np.random.Generator, shape) -> np.ndarray:
    """Uniformly random float32 bit patterns (NaN, Inf and subnormals included)."""
    return rng.integers(0, 2**32, size=shape, dtype=np.uint64).astype(np.uint32).view(F32)


def softmax(rng: np.random.Generator, shape, scale: float = 2.0) -> np.ndarray:
    x = rng.standard_normal(shape) * scale
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(F32)


def log_softmax(rng: np.random.Generator, shape, scale: float = 2.0) -> np.ndarray:
    x = rng.standard_normal(shape) * scale
    m = x.max(axis=-1, keepdims=True)
    return (x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))).astype(F32)


def support(atoms: int) -> np.ndarray:
    """The reference's atom support on ``[V_MIN, V_MAX]``."""
    from foxhunt.reference.kernels.distributional import support as reference_support

    return reference_support(V_MIN, V_MAX, atoms)


def isv_vector(rng: np.random.Generator) -> np.ndarray:
    """The cold-start ISV vector (fingerprint bits included) with the EMA slots randomised."""
    from foxhunt.reference import isv as isv_registry

    vec = isv_registry.ISVBus().to_array().astype(F32, copy=True)
    for index in (*range(isv_registry.NUM_SIGNALS), isv_registry.Q_ABS_REF_INDEX,
                  isv_registry.H_S2_RMS_EMA_INDEX):
        vec[index] = F32(abs(rng.standard_normal()) * 2)
    return vec


# ------------------------------------------------------------------------------ magnitudes
def maxabs(*arrays: Any) -> float:
    """Largest finite ``|x|`` over all arrays (0.0 if none); float64 for the bound."""
    best = 0.0
    for a in arrays:
        a = np.asarray(a, dtype=np.float64)
        fin = np.abs(a[np.isfinite(a)])
        if fin.size:
            best = max(best, float(fin.max()))
    return best


def sq_mag(x: np.ndarray) -> float:
    """Largest finite square of ``x``: the magnitude of a sum of squares' terms."""
    return maxabs(x) ** 2


def norm_sq(x: np.ndarray) -> np.float32:
    """Sum of the finite squares of ``x`` (float64 sum, rounded to float32)."""
    x64 = x.astype(np.float64)
    return F32(np.sum(x64[np.isfinite(x64)] ** 2))


def reduction(length: int, magnitude: Any) -> dict:
    """The bound inputs of a reduction output: ``length`` terms of largest size ``magnitude``."""
    return {"length": max(int(length), 1), "magnitude": magnitude}


# ------------------------------------------------------------------------------ contracts
def finite_outputs(*names: str, when: Callable[[str | None], bool] = lambda p: True) -> Contract:
    """Contract: the named outputs are finite (whenever ``when(poisoned)``)."""
    def check(kwargs, outputs, poisoned):
        if not when(poisoned):
            return []
        bad = [n for n in names if not np.all(np.isfinite(outputs[n]))]
        return [f"output {n!r} holds non-finite values (poisoned: {poisoned})" for n in bad]
    return check


def unchanged_where_nonfinite(out: str, source: str, kept: str) -> Contract:
    """Contract: where ``source`` is non-finite, output ``out`` equals input ``kept`` bit for bit."""
    def check(kwargs, outputs, poisoned):
        mask = ~np.isfinite(kwargs[source])
        if not mask.any():
            return []
        got = outputs[out][mask].view(np.uint32)
        want = np.asarray(kwargs[kept])[mask].view(np.uint32)
        if np.array_equal(got, want):
            return []
        return [f"{out!r} changed where {source!r} is non-finite (must keep {kept!r} bit for bit)"]
    return check


def all_of(*contracts: Contract) -> Contract:
    """Contract: every one of ``contracts``."""
    def check(kwargs, outputs, poisoned):
        return [p for c in contracts for p in c(kwargs, outputs, poisoned)]
    return check


# ------------------------------------------------------------------------------ error cases
def wrong_dtype(kwargs: Kwargs, name: str) -> Kwargs:
    """``kwargs`` with argument ``name`` widened to float64."""
    bad = dict(kwargs)
    with np.errstate(invalid="ignore"):  # signalling-NaN bit patterns widen quietly
        bad[name] = np.asarray(kwargs[name]).astype(np.float64)
    return bad


def replace(kwargs: Kwargs, **changes: Any) -> Kwargs:
    """``kwargs`` with some arguments replaced."""
    bad = dict(kwargs)
    bad.update(changes)
    return bad


def error_cases(sample: Sample, *edits: Callable[[Kwargs], Kwargs],
                exc: type[BaseException] = ValueError):
    """Error cases built from the extremal-size sample: each edit breaks one argument, and
    the kernel must raise ``exc``."""
    def build(rng: np.random.Generator) -> list[tuple[Kwargs, type[BaseException]]]:
        base = sample(case_dims("extremal"), rng)
        return [(edit(base), exc) for edit in edits]
    return build
