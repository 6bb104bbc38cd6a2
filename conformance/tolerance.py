"""The conformance tolerance policy (SPEC section 8), in one place.

Four kinds of criterion, one :class:`Tolerance` record each:

``exact``
    ``np.array_equal(actual, expected, equal_nan=True)``; optionally the sign of every zero
    (``signed_zero``) or the raw bit pattern (``bitwise``, for fingerprint bits and BF16
    patterns). Clamps, masks, argmax, flags, casts. ``inputs["free_bits"]`` (optional, integer):
    bits that may differ (decisions the kernel's GEMM bound cannot settle: specs/trunk.py).
``ulp``
    The NaN, +Inf and -Inf maps must be identical first; then every finite element is within
    ``max_ulp`` units in the last place (:func:`ulp_distance`, ``+0`` and ``-0`` are 0 apart).
    f32 elementwise kernels: 1 for correctly rounded operations, 2-4 where ``expf``/``logf``/
    ``powf`` or a re-associated pair of roundings is involved.
``reduction``
    Identical non-finite maps, then per element
    ``|actual - expected| <= rtol * |expected| + atol_per_elem * length * magnitude`` where
    ``length`` is the number of terms reduced and ``magnitude`` the largest ``|term|`` (both
    given per comparison in ``inputs``): f32 sums in a different order differ by roughly one
    rounding per term relative to the running sum, which the absolute floor covers even when
    the sum cancels.
``gemm``
    A GEMM on rounded inputs with FP32 accumulation, compared with the float64 product ``C64``
    of the same rounded operands ``A [M, K]`` and ``B [K, N]`` (given in ``inputs``)::

        |C - C64| <= safety * (u_in * |C64| + (gamma_K + m_in * (2 + m_in)) * (|A| @ |B|))
        gamma_K = K * 2^-24 / (1 - K * 2^-24)

    ``u_in`` (:data:`U_IN`) is 2^-8 for BF16 and 2^-10 for TF32: a relative slack of one input
    rounding unit on the result. C is F32, so no BF16/TF32 output rounding is applied.
    ``m_in`` (:data:`INPUT_MISMATCH`) bounds how differently the fast path and the reference
    may round an operand: 0 where both round bit-identically (F32; BF16 RNE done by our own
    kernels), 2^-10 for TF32 because tensor cores may truncate where the reference rounds to
    nearest (one TF32 ulp apart at most); a product of two such operands then differs by
    ``m_in * (2 + m_in) * |a| |b|``, which must scale with ``|A| @ |B|``, not ``|C64|``
    (a cancelling dot product has a tiny ``|C64|`` but not tiny rounding differences).
    ``safety`` (:data:`GEMM_SAFETY` = 2) covers accumulators that round by truncation (one
    ulp, not half) and the float64 reference's own ``K * 2^-53``. On top, an RMS check:
    ``rms(C - C64) <= (u_in + 2 m_in + GEMM_RMS_FACTOR * sqrt(K) * 2^-24) * rms(S)`` with
    ``S = sqrt((A*A) @ (B*B))``, the natural size of a dot product's rounding error (about
    ``|C64|`` for random data, but it does not vanish when a dot product cancels). It catches a
    systematically wrong result that the worst-case bound would let through.
    Two optional ``inputs`` of a fused layer (``conformance/specs/trunk.py``): ``"clip": (lo,
    hi)`` compares with ``clip(C64, lo, hi)`` (a ReLU and a clamp: monotone and 1-Lipschitz, so
    the bound, still from the unclipped ``C64``, holds unchanged); ``"a_slack"`` ``[M, K]``, how far
    the operand the fast path multiplied may lie from ``A`` (its own rounding of an activation it
    computed), adds ``safety * (a_slack @ |B|)`` (to the bound; the RMS check sees the error
    beyond it).

:func:`assert_conforms` applies one tolerance and raises ``AssertionError`` with the message
style of ``torch.testing.assert_close`` (mismatch count and %, greatest absolute / relative /
ULP difference and its index); :func:`compare` returns the same facts as a
:class:`Comparison` without raising (the report uses it). Each kernel's per-output
tolerances sit in its conformance entry (``foxhunt.conformance.specs``); the cuBLAS GEMM's,
per precision mode, in :data:`GEMM_TOLERANCES` (:func:`gemm_tolerance` raises ``KeyError`` for
an unknown mode). There are no defaults, and ``None`` (never a falsy value) means "unset".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

from foxhunt.conformance.comparison import Comparison, failure_message

#: Unit roundoff of float32 (round to nearest): half an ulp of 1.0.
F32_UNIT_ROUNDOFF = 2.0**-24

#: Relative slack of one input rounding unit, per GEMM precision mode.
U_IN: Mapping[str, float] = MappingProxyType({"f32": 0.0, "bf16": 2.0**-8, "tf32": 2.0**-10})

#: Largest relative difference between the fast path's and the reference's rounding of one
#: GEMM operand, per mode (TF32: truncation vs round-to-nearest-away, one TF32 ulp).
INPUT_MISMATCH: Mapping[str, float] = MappingProxyType({"f32": 0.0, "bf16": 0.0, "tf32": 2.0**-10})

#: Safety factor on the worst-case GEMM bound (truncating accumulators, float64 reference).
GEMM_SAFETY = 2.0

#: Multiplier of ``sqrt(K) * 2^-24`` in the GEMM RMS relative-error check.
GEMM_RMS_FACTOR = 4.0

#: SPEC 8: "rtol ~ 1e-5" for f32 reductions.
REDUCTION_RTOL = 1e-5

#: Absolute floor per reduced term, in units of the largest |term|: four f32 roundings.
REDUCTION_ATOL_PER_ELEM = 4.0 * F32_UNIT_ROUNDOFF

KINDS = ("exact", "ulp", "reduction", "gemm")

# Names of the fields each kind requires (all others must stay None / default).
_REQUIRED = {
    "exact": (),
    "ulp": ("max_ulp",),
    "reduction": ("rtol", "atol_per_elem"),
    "gemm": ("mode", "safety"),
}
_OPTIONAL_FIELDS = ("max_ulp", "rtol", "atol_per_elem", "mode", "k", "safety")


@dataclass(frozen=True)
class Tolerance:
    """One comparison criterion; build it with :meth:`exact`, :meth:`ulp`, :meth:`reduction`
    or :meth:`gemm` (the constructor validates that exactly the fields of its kind are set)."""

    kind: str
    max_ulp: int | None = None
    rtol: float | None = None
    atol_per_elem: float | None = None
    mode: str | None = None
    k: int | None = None
    safety: float | None = None
    signed_zero: bool = False
    bitwise: bool = False
    #: With ``bitwise``: treat any two NaN patterns as equal (float32, or BF16 held in uint16).
    #: NaN *payloads* are not part of any kernel contract: GPU arithmetic returns the canonical
    #: NaN (0x7FFFFFFF) where x86 propagates an input's payload; NaN *positions* still must match.
    nan_payload: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Tolerance kind {self.kind!r} is unknown; allowed: {KINDS}")
        required = _REQUIRED[self.kind]
        allowed = set(required) | ({"k"} if self.kind == "gemm" else set())
        for name in _OPTIONAL_FIELDS:
            value = getattr(self, name)
            if name in required and value is None:
                raise ValueError(f"Tolerance.{self.kind} needs {name} (got None)")
            if name not in allowed and value is not None:
                raise ValueError(f"Tolerance.{self.kind} takes no {name} (got {value!r})")
        if not self.nan_payload and not self.bitwise:
            raise ValueError("nan_payload=False only qualifies a bitwise comparison")
        if self.bitwise and self.kind != "exact":
            raise ValueError(f"bitwise=True is only meaningful for kind 'exact', not {self.kind!r}")
        if self.signed_zero and self.kind not in ("exact", "ulp"):
            raise ValueError(f"signed_zero=True applies to 'exact' and 'ulp', not {self.kind!r}")
        if self.max_ulp is not None and (not isinstance(self.max_ulp, int) or self.max_ulp < 0):
            raise ValueError(f"max_ulp must be a non-negative int, got {self.max_ulp!r}")
        for name in ("rtol", "atol_per_elem", "safety"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
        if self.mode is not None and self.mode not in U_IN:
            raise ValueError(f"GEMM mode {self.mode!r} is unknown; allowed: {tuple(U_IN)}")
        if self.k is not None and (not isinstance(self.k, int) or self.k < 1):
            raise ValueError(f"GEMM K must be a positive int, got {self.k!r}")
        if self.safety is not None and self.safety < 1:
            raise ValueError(f"GEMM safety factor must be >= 1, got {self.safety!r}")

    # -- constructors ------------------------------------------------------------------
    @classmethod
    def exact(cls, *, signed_zero: bool = False, bitwise: bool = False,
              nan_payload: bool = True) -> "Tolerance":
        return cls("exact", signed_zero=signed_zero, bitwise=bitwise, nan_payload=nan_payload)

    @classmethod
    def ulp(cls, max_ulp: int, *, signed_zero: bool = False) -> "Tolerance":
        return cls("ulp", max_ulp=max_ulp, signed_zero=signed_zero)

    @classmethod
    def reduction(cls, rtol: float, atol_per_elem: float) -> "Tolerance":
        return cls("reduction", rtol=rtol, atol_per_elem=atol_per_elem)

    @classmethod
    def gemm(cls, mode: str, k: int | None = None, *, safety: float = GEMM_SAFETY) -> "Tolerance":
        return cls("gemm", mode=mode, k=k, safety=safety)

    def describe(self) -> str:
        """Short human-readable form for tables and messages."""
        if self.kind == "exact":
            extra = [w for w, on in (("bitwise", self.bitwise), ("signed zero", self.signed_zero)) if on]
            return "exact" + (f" ({', '.join(extra)})" if extra else "")
        if self.kind == "ulp":
            return f"<= {self.max_ulp} ULP" + (" (signed zero)" if self.signed_zero else "")
        if self.kind == "reduction":
            return f"rtol {self.rtol:g} + {self.atol_per_elem:.3g}*L*max|term|"
        k = "K" if self.k is None else f"K={self.k}"
        return f"gemm {self.mode} bound ({k}, safety {self.safety:g})"


def gamma(k: int) -> float:
    """Higham's ``gamma_K = K u / (1 - K u)`` for float32 accumulation (u = 2^-24)."""
    ku = k * F32_UNIT_ROUNDOFF
    if ku >= 1:
        raise ValueError(f"gamma_K undefined for K={k}: K * 2^-24 >= 1")
    return ku / (1.0 - ku)


# ------------------------------------------------------------------------------ ULP
def _ordered(x: np.ndarray) -> np.ndarray:
    """Map float32 bit patterns to int64 so that float order is integer order (+0 == -0 == 0)."""
    bits = x.view(np.int32).astype(np.int64)
    return np.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


def ulp_distance(a: Any, b: Any) -> np.ndarray:
    """Number of float32 values between ``a`` and ``b`` (int64, elementwise, broadcast).

    ``+0`` and ``-0`` are 0 apart; the largest finite float and ``inf`` are 1 apart. Where both
    are NaN the distance is 0; where exactly one is NaN it is ``int64 max``. Inputs must be
    float32 (a float64 value would silently be compared at the wrong precision).
    """
    a = np.asarray(a)
    b = np.asarray(b)
    for name, arr in (("a", a), ("b", b)):
        if arr.dtype != np.float32:
            raise ValueError(f"ulp_distance: {name} must be float32, got {arr.dtype}")
    a, b = np.broadcast_arrays(a, b)
    dist = np.abs(_ordered(np.ascontiguousarray(a)) - _ordered(np.ascontiguousarray(b)))
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    dist = np.where(nan_a & nan_b, 0, dist)
    return np.where(nan_a ^ nan_b, np.iinfo(np.int64).max, dist)


# ------------------------------------------------------------------------------ comparison
def _index(flat: int, shape: tuple) -> tuple:
    return tuple(int(i) for i in np.unravel_index(flat, shape)) if shape else ()


def _argmax_index(values: np.ndarray, shape: tuple) -> tuple[float, tuple | None]:
    if values.size == 0:
        return 0.0, None
    flat = int(np.argmax(values))
    return values.reshape(-1)[flat], _index(flat, shape)


def _nonfinite_map_problems(actual: np.ndarray, expected: np.ndarray,
                            free: np.ndarray | None = None) -> list[str]:
    """Where the NaN / +Inf / -Inf maps differ, outside ``free`` (a boolean mask)."""
    problems = []
    for label, fn in (("NaN", np.isnan),
                      ("+Inf", lambda x: np.isposinf(x)),
                      ("-Inf", lambda x: np.isneginf(x))):
        diff = fn(actual) != fn(expected)
        if free is not None:
            diff &= ~free
        if diff.any():
            first = _index(int(np.flatnonzero(diff.reshape(-1))[0]), actual.shape)
            problems.append(
                f"{label} maps differ at {int(diff.sum())} position(s), first at index {first}: "
                f"actual={actual[first]!r}, expected={expected[first]!r}")
    return problems


def _diffs(actual: np.ndarray, expected: np.ndarray, usable: np.ndarray):
    """abs and rel differences in float64 on the ``usable`` positions (0 elsewhere)."""
    a = np.where(usable, actual, 0).astype(np.float64)
    e = np.where(usable, expected, 0).astype(np.float64)
    abs_diff = np.abs(a - e)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel_diff = np.where(abs_diff == 0, 0.0, abs_diff / np.abs(e))
    return abs_diff, rel_diff


def _require_inputs(tol: Tolerance, inputs: Mapping | None, keys: tuple[str, ...]) -> Mapping:
    if inputs is None or any(k not in inputs for k in keys):
        have = None if inputs is None else sorted(inputs)
        raise ValueError(f"a {tol.kind} tolerance needs inputs with keys {keys}; got {have}")
    return inputs


def compare(name: str, actual: Any, expected: Any, tol: Tolerance,
            inputs: Mapping | None = None) -> Comparison:
    """Compare ``actual`` (fast) with ``expected`` (reference) under ``tol``; never raises on a
    mismatch (it raises ``ValueError`` for a misused tolerance, ``TypeError`` for a non-tolerance).

    ``inputs``: ``{"length": L, "magnitude": M}`` for ``reduction`` (M scalar or broadcastable
    to the output), ``{"a": A, "b": B}`` for ``gemm`` (the rounded operands as multiplied,
    ``A [M, K]``, ``B [K, N]``; optional ``"clip"``, ``"a_slack"``), ``{"free_bits": F}`` for
    ``exact`` (optional). Any kind also takes ``"exact"``: a boolean mask (broadcastable
    to the output) of elements the kernel only copies, which must then be equal bit for bit; a
    float kind ``"overflow"``: a boolean mask of elements whose sums may overflow in one order of
    summation and not in another (their finite magnitudes add up past float32's range), whose
    non-finite class is then the summation order's, not a contract (they still count only where
    both results are finite).
    """
    if not isinstance(tol, Tolerance):
        raise TypeError(f"{name}: tolerance must be a Tolerance, got {type(tol).__name__}")
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    result = Comparison(name=name, tolerance=tol, numel=int(expected.size))
    # CuPy-style: the type facts must agree before any value is looked at.
    if actual.dtype != expected.dtype:
        result.problems.append(f"dtype differs: actual {actual.dtype}, expected {expected.dtype}")
    if actual.shape != expected.shape:
        result.problems.append(f"shape differs: actual {actual.shape}, expected {expected.shape}")
    if result.problems:
        return _finish(result)
    if tol.kind == "exact":
        _compare_exact(result, actual, expected, tol, inputs)
    else:
        if expected.dtype.kind != "f":
            raise ValueError(f"{name}: a {tol.kind} tolerance needs float outputs, got {expected.dtype}")
        free = None
        if inputs is not None and "overflow" in inputs:
            free = np.broadcast_to(np.asarray(inputs["overflow"], dtype=bool), actual.shape)
        maps = _nonfinite_map_problems(actual, expected, free)
        result.nan_map_equal = not maps
        result.problems.extend(maps)
        usable = np.isfinite(actual) & np.isfinite(expected)
        # Positions whose non-finite class differs count as mismatched elements.
        differ = ((np.isnan(actual) != np.isnan(expected))
                  | (np.isposinf(actual) != np.isposinf(expected))
                  | (np.isneginf(actual) != np.isneginf(expected)))
        result.mismatches += int(np.count_nonzero(differ if free is None else differ & ~free))
        if tol.kind == "ulp":
            _compare_ulp(result, actual, expected, tol, usable)
        elif tol.kind == "reduction":
            _compare_reduction(result, actual, expected, tol, usable, inputs)
        else:
            _compare_gemm(result, actual, expected, tol, usable, inputs)
    if inputs is not None and "exact" in inputs:
        _compare_exact_region(result, actual, expected, inputs["exact"])
    return _finish(result)


def _compare_exact_region(result: Comparison, actual: np.ndarray, expected: np.ndarray,
                          mask: Any) -> None:
    """Elements under ``mask`` must be bit-for-bit equal (values a kernel only copies or scales
    exactly), two NaNs counting as equal: NaN payloads are no kernel's contract (see
    ``Tolerance.nan_payload``), NaN positions are."""
    mask = np.broadcast_to(np.asarray(mask, dtype=bool), actual.shape)
    view = np.dtype(f"u{actual.dtype.itemsize}")
    a, e = np.ascontiguousarray(actual), np.ascontiguousarray(expected)
    differ = mask & (a.view(view) != e.view(view)) & ~(_nan_bits(a) & _nan_bits(e))
    if differ.any():
        idx = _index(int(np.flatnonzero(differ.reshape(-1))[0]), actual.shape)
        result.mismatches += int(differ.sum())
        result.problems.append(
            f"{int(differ.sum())} element(s) that must be copied bit for bit differ, first at index "
            f"{idx}: actual={actual[idx]!r}, expected={expected[idx]!r}")


def _record_diffs(result: Comparison, abs_diff: np.ndarray, rel_diff: np.ndarray, shape) -> None:
    result.worst_abs, result.worst_abs_index = _argmax_index(abs_diff, shape)
    result.worst_rel, result.worst_rel_index = _argmax_index(rel_diff, shape)
    result.worst_abs = float(result.worst_abs)
    result.worst_rel = float(result.worst_rel)


def _record_ratio(result: Comparison, err: np.ndarray, bound: np.ndarray, shape) -> None:
    bound = np.broadcast_to(bound, err.shape)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(err == 0, 0.0, err / bound)
    ratio = np.where(np.isnan(ratio), np.inf, ratio)
    result.mismatches += int((err > bound).sum())
    result.worst_ratio, result.worst_ratio_index = _argmax_index(ratio, shape)
    result.worst_ratio = float(result.worst_ratio)
    if result.worst_ratio_index is not None:
        result.bound_at_worst = float(bound[result.worst_ratio_index])


def _nan_bits(x: np.ndarray) -> np.ndarray:
    """NaN mask of float32 values, or of BF16 bit patterns held in uint16."""
    if x.dtype == np.uint16:
        return ((x & 0x7F80) == 0x7F80) & ((x & 0x007F) != 0)
    if x.dtype.kind == "f":
        return np.isnan(x)
    raise ValueError(f"nan_payload=False needs float or BF16 (uint16) data, got {x.dtype}")


def _compare_exact(result, actual, expected, tol, inputs=None) -> None:
    if tol.bitwise:
        if actual.dtype.kind not in "fiub":
            raise ValueError(f"{result.name}: bitwise comparison of dtype {actual.dtype}")
        view = np.dtype(f"u{actual.dtype.itemsize}") if actual.dtype.kind == "f" else actual.dtype
        differ = actual.view(view) != expected.view(view)
        if not tol.nan_payload:
            differ &= ~(_nan_bits(actual) & _nan_bits(expected))
    elif actual.dtype.kind in "fc":
        differ = ~((actual == expected) | (np.isnan(actual) & np.isnan(expected)))
        result.nan_map_equal = bool(np.array_equal(np.isnan(actual), np.isnan(expected)))
        if tol.signed_zero:
            zeros = (actual == 0) & (expected == 0)
            differ |= zeros & (np.signbit(actual) != np.signbit(expected))
    else:
        differ = actual != expected
    differ = np.asarray(differ)
    free = None if inputs is None else inputs.get("free_bits")
    if free is not None:  # bits decided at a threshold the kernel's bound cannot decide
        view = np.dtype(f"u{actual.dtype.itemsize}")
        free = np.broadcast_to(np.asarray(free).astype(view), actual.shape)
        differ = differ & (((actual.view(view) ^ expected.view(view)) & ~free) != 0)
    result.mismatches = int(differ.sum())
    if result.mismatches and actual.dtype.kind in "fiu":
        finite = (np.isfinite(actual) & np.isfinite(expected)) if actual.dtype.kind == "f" else True
        abs_diff, rel_diff = _diffs(actual, expected, differ & finite)
        _record_diffs(result, abs_diff, rel_diff, actual.shape)
    if result.mismatches:
        flat = int(np.flatnonzero(differ.reshape(-1))[0])
        idx = _index(flat, actual.shape)
        result.worst_ratio = math.inf
        result.worst_ratio_index = idx
        result.problems.append(
            f"first differing element at index {idx}: actual={actual[idx]!r}, expected={expected[idx]!r}")


def _compare_ulp(result, actual, expected, tol, usable) -> None:
    if actual.dtype != np.float32:
        raise ValueError(f"{result.name}: ULP tolerance needs float32, got {actual.dtype}")
    ulps = np.where(usable, ulp_distance(actual, expected), 0)
    if tol.signed_zero:
        zeros = usable & (actual == 0) & (expected == 0) & (np.signbit(actual) != np.signbit(expected))
        if zeros.any():
            idx = _index(int(np.flatnonzero(zeros.reshape(-1))[0]), actual.shape)
            result.mismatches += int(zeros.sum())
            result.problems.append(f"sign of zero differs at {int(zeros.sum())} position(s), first {idx}")
    worst, idx = _argmax_index(ulps, actual.shape)
    result.worst_ulp, result.worst_ulp_index = int(worst), idx
    abs_diff, rel_diff = _diffs(actual, expected, usable)
    _record_diffs(result, abs_diff, rel_diff, actual.shape)
    _record_ratio(result, ulps.astype(np.float64), np.float64(tol.max_ulp), actual.shape)


def _compare_reduction(result, actual, expected, tol, usable, inputs) -> None:
    inputs = _require_inputs(tol, inputs, ("length", "magnitude"))
    length = inputs["length"]
    magnitude = np.asarray(inputs["magnitude"], dtype=np.float64)
    if not (isinstance(length, (int, np.integer)) and length >= 1):
        raise ValueError(f"{result.name}: reduction length must be a positive int, got {length!r}")
    # A non-finite magnitude comes from a non-finite term; the map check above judges those.
    magnitude = np.where(np.isfinite(magnitude), np.abs(magnitude), 0.0)
    abs_diff, rel_diff = _diffs(actual, expected, usable)
    bound = tol.rtol * np.abs(np.where(usable, expected, 0).astype(np.float64)) \
        + tol.atol_per_elem * float(length) * magnitude
    _record_diffs(result, abs_diff, rel_diff, actual.shape)
    _record_ratio(result, abs_diff, np.broadcast_to(bound, abs_diff.shape), actual.shape)


def gemm_reference(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(C64, |A| @ |B|)`` in float64 for operands ``a [M, K]``, ``b [K, N]``."""
    a64 = np.asarray(a, dtype=np.float64)
    b64 = np.asarray(b, dtype=np.float64)
    if a64.ndim != 2 or b64.ndim != 2 or a64.shape[1] != b64.shape[0]:
        raise ValueError(f"GEMM operands must be [M, K] and [K, N], got {a64.shape} and {b64.shape}")
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf operands: non-finite C64
        return a64 @ b64, np.abs(a64) @ np.abs(b64)


def gemm_bound(tol: Tolerance, c64: np.ndarray, abs_ab: np.ndarray, k: int) -> np.ndarray:
    """Per-element allowed ``|C - C64|`` (see the module docstring)."""
    m_in = INPUT_MISMATCH[tol.mode]
    with np.errstate(invalid="ignore", over="ignore"):
        return tol.safety * (U_IN[tol.mode] * np.abs(c64) + (gamma(k) + m_in * (2 + m_in)) * abs_ab)


def gemm_rms_bound(mode: str, k: int) -> float:
    """Allowed ``rms(C - C64) / rms(sqrt((A*A) @ (B*B)))``."""
    return U_IN[mode] + 2 * INPUT_MISMATCH[mode] + GEMM_RMS_FACTOR * math.sqrt(k) * F32_UNIT_ROUNDOFF


def _compare_gemm(result, actual, expected, tol, usable, inputs) -> None:
    inputs = _require_inputs(tol, inputs, ("a", "b"))
    c64, abs_ab = gemm_reference(inputs["a"], inputs["b"])
    k = int(np.shape(inputs["a"])[1])
    if tol.k is not None and tol.k != k:
        raise ValueError(f"{result.name}: tolerance is for K={tol.k} but the operands have K={k}")
    if c64.shape != actual.shape:
        raise ValueError(f"{result.name}: operands give C {c64.shape}, output is {actual.shape}")
    usable = usable & np.isfinite(c64)
    if "exact" in inputs:  # judged bit for bit (compare's "exact"), not by the bound
        usable = usable & ~np.broadcast_to(np.asarray(inputs["exact"], dtype=bool), usable.shape)
    bound = gemm_bound(tol, c64, abs_ab, k)
    slack = np.zeros_like(bound)
    if "a_slack" in inputs:
        with np.errstate(invalid="ignore", over="ignore"):
            slack = tol.safety * (np.asarray(inputs["a_slack"], np.float64)
                                  @ np.abs(np.asarray(inputs["b"], np.float64)))
        bound = bound + slack
    if "clip" in inputs:
        c64 = np.clip(c64, *inputs["clip"])
    a = np.where(usable, actual, 0).astype(np.float64)
    c = np.where(usable, c64, 0.0)
    err = np.abs(a - c)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(err == 0, 0.0, err / np.abs(c))
    _record_diffs(result, err, rel, actual.shape)
    _record_ratio(result, err, np.where(usable, bound, np.inf), actual.shape)
    # The reference must obey its own policy; otherwise the bound (or the reference) is wrong.
    e = np.where(usable, expected, 0).astype(np.float64)
    ref_bad = int((np.abs(e - c) > np.where(usable, bound, np.inf)).sum())
    if ref_bad:
        result.problems.append(f"the reference itself exceeds the GEMM bound at {ref_bad} element(s)")
    a64 = np.asarray(inputs["a"], dtype=np.float64)
    b64 = np.asarray(inputs["b"], dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        scale_sq = (a64 * a64) @ (b64 * b64)  # S^2, so rms(S) = sqrt(mean(S^2))
    norm = math.sqrt(float(np.mean(scale_sq[usable]))) if usable.any() else 0.0
    noise = np.maximum(err - slack, 0.0)[usable]  # the operand slack is an allowance, not noise
    rms_err = math.sqrt(float(np.mean(noise ** 2))) if usable.any() else 0.0
    result.rms_rel = 0.0 if rms_err == 0 else (rms_err / norm if norm > 0 else math.inf)
    result.rms_bound = gemm_rms_bound(tol.mode, k)
    if result.rms_rel > result.rms_bound:
        result.problems.append(
            f"RMS relative error {result.rms_rel:.3g} exceeds {result.rms_bound:.3g} (K={k}, {tol.mode})")


def _finish(result: Comparison) -> Comparison:
    result.passed = not result.problems and result.mismatches == 0
    if not result.passed:
        result.message = failure_message(result)
    return result


def assert_conforms(name: str, actual: Any, expected: Any, tol: Tolerance,
                    inputs: Mapping | None = None) -> Comparison:
    """:func:`compare`, raising ``AssertionError`` with the full message on a mismatch."""
    result = compare(name, actual, expected, tol, inputs)
    if not result.passed:
        raise AssertionError(result.message)
    return result


# ------------------------------------------------------------------------ shared criteria
EXACT = Tolerance.exact()
REDUCTION = Tolerance.reduction(REDUCTION_RTOL, REDUCTION_ATOL_PER_ELEM)

#: The cuBLAS GEMM's tolerance per precision mode (SPEC 9); the kernels' tolerances sit in their
#: conformance entries (``foxhunt.conformance.specs``).
GEMM_TOLERANCES: Mapping[str, Tolerance] = MappingProxyType(
    {mode: Tolerance.gemm(mode) for mode in U_IN})


def gemm_tolerance(mode: str) -> Tolerance:
    """The GEMM tolerance of precision ``mode``; ``KeyError`` naming the known modes."""
    try:
        return GEMM_TOLERANCES[mode]
    except KeyError:
        raise KeyError(f"no GEMM tolerance for mode {mode!r}; known modes: "
                       f"{tuple(GEMM_TOLERANCES)}") from None
