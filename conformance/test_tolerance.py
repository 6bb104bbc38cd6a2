"""The tolerance policy (exact, ULP, reduction, GEMM bound, messages, the lookup table) and the
hypothesis strategies that inject special values."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foxhunt.conformance.strategies import (
    F32_LARGEST_SUBNORMAL,
    F32_MAX,
    F32_SMALLEST_SUBNORMAL,
    SPECIAL_VALUES,
    Injection,
    boundary_positions,
    f32_with_specials,
    finite_f32,
    inject,
    injections,
    tail_sizes,
)
from foxhunt.conformance.tolerance import (
    F32_UNIT_ROUNDOFF,
    GEMM_SAFETY,
    REDUCTION,
    U_IN,
    Tolerance,
    assert_conforms,
    compare,
    gamma,
    gemm_bound,
    gemm_tolerance,
    ulp_distance,
)
from foxhunt.reference.kernels.dense import gemm, round_for

F32 = np.float32


def _step(x: np.float32, k: int) -> np.float32:
    """``x`` moved ``k`` float32 values up (k > 0) or down, one nextafter at a time."""
    target = F32(np.inf if k > 0 else -np.inf)
    for _ in range(abs(k)):
        x = np.nextafter(x, target, dtype=F32)
    return F32(x)


# ------------------------------------------------------------------------------ ULP distance
def test_ulp_distance_hand_cases() -> None:
    one = F32(1.0)
    assert ulp_distance(one, np.nextafter(one, F32(2))) == 1
    assert ulp_distance(F32(0.0), F32(-0.0)) == 0
    assert ulp_distance(F32_SMALLEST_SUBNORMAL, -F32_SMALLEST_SUBNORMAL) == 2
    assert ulp_distance(F32_MAX, F32(np.inf)) == 1
    assert ulp_distance(F32(np.nan), F32(np.nan)) == 0
    assert ulp_distance(F32(np.nan), one) == np.iinfo(np.int64).max
    # 1.0 and 2.0 are 2^23 float32 values apart (one binade).
    assert ulp_distance(one, F32(2.0)) == 2**23


def test_ulp_distance_rejects_float64() -> None:
    with pytest.raises(ValueError, match="a must be float32, got float64"):
        ulp_distance(np.float64(1.0), F32(1.0))


@given(x=st.floats(width=32, allow_nan=False, allow_infinity=False), k=st.integers(-40, 40))
def test_ulp_distance_counts_nextafter_steps(x: float, k: int) -> None:
    # nextafter steps from +0 to -smallest subnormal (and from -0 to +smallest), so zero is
    # visited once, matching the ordering in which +0 and -0 are one value.
    x = F32(x)
    y = _step(x, k)
    if np.isfinite(y):
        assert ulp_distance(x, y) == abs(k)
        assert ulp_distance(y, x) == abs(k)


# ------------------------------------------------------------------------------ Tolerance records
def test_tolerance_fields_are_validated() -> None:
    with pytest.raises(ValueError, match="needs max_ulp"):
        Tolerance("ulp")
    with pytest.raises(ValueError, match="takes no rtol"):
        Tolerance("ulp", max_ulp=1, rtol=1e-5)
    with pytest.raises(ValueError, match="kind 'fuzzy' is unknown"):
        Tolerance("fuzzy")
    with pytest.raises(ValueError, match="needs atol_per_elem"):
        Tolerance("reduction", rtol=1e-5)
    with pytest.raises(ValueError, match="GEMM mode 'fp8' is unknown"):
        Tolerance.gemm("fp8")
    with pytest.raises(ValueError, match="bitwise=True is only meaningful"):
        Tolerance("ulp", max_ulp=1, bitwise=True)


def test_zero_tolerances_are_not_unset() -> None:
    """JAX's ``tol or default`` bug: 0 must mean 0, not "use the default"."""
    a = np.array([1.0, 2.0], F32)
    b = np.array([1.0, np.nextafter(F32(2.0), F32(3))], F32)
    assert not compare("zero ulp", b, a, Tolerance.ulp(0)).passed
    exact_sum = Tolerance.reduction(0.0, 0.0)
    assert not compare("zero red", b, a, exact_sum, {"length": 2, "magnitude": 2.0}).passed
    assert compare("zero ulp", a.copy(), a, Tolerance.ulp(0)).passed


def test_gemm_tolerance_raises_for_unknown_modes() -> None:
    assert gemm_tolerance("bf16") == Tolerance.gemm("bf16")
    assert gemm_tolerance("tf32") == Tolerance.gemm("tf32")
    with pytest.raises(KeyError, match=r"no GEMM tolerance for mode 'fp16'; known modes: "
                                       r"\('f32', 'bf16', 'tf32'\)"):
        gemm_tolerance("fp16")


# ------------------------------------------------------------------------------ exact
def test_exact_nan_positions_and_signed_zero() -> None:
    e = np.array([1.0, np.nan, 0.0, -0.0], F32)
    assert compare("x", e.copy(), e, Tolerance.exact()).passed
    moved = np.array([1.0, 2.0, np.nan, -0.0], F32)
    r = compare("x", moved, e, Tolerance.exact())
    assert not r.passed and r.mismatches == 2 and not r.nan_map_equal
    flipped = np.array([1.0, np.nan, -0.0, -0.0], F32)
    assert compare("x", flipped, e, Tolerance.exact()).passed
    r = compare("x", flipped, e, Tolerance.exact(signed_zero=True))
    assert not r.passed and r.mismatches == 1


def test_exact_bitwise_sees_nan_payloads() -> None:
    e = np.array([0x7FC00000, 0x7FC00001], np.uint32).view(F32)
    a = np.array([0x7FC00000, 0x7FC00000], np.uint32).view(F32)
    assert compare("x", a, e, Tolerance.exact()).passed
    assert not compare("x", a, e, Tolerance.exact(bitwise=True)).passed


def test_dtype_and_shape_must_agree_first() -> None:
    e = np.zeros(3, F32)
    r = compare("x", np.zeros(3, np.float64), e, Tolerance.ulp(4))
    assert not r.passed and "dtype differs: actual float64, expected float32" in r.message
    r = compare("x", np.zeros((3, 1), F32), e, Tolerance.exact())
    assert not r.passed and "shape differs" in r.message


def test_exact_int_flags() -> None:
    e = np.array([0, 1, 0], np.int32)
    r = compare("flags", np.array([0, 1, 1], np.int32), e, Tolerance.exact())
    assert not r.passed and r.mismatches == 1 and "index (2,)" in r.message


# ------------------------------------------------------------------------------ ULP
def test_ulp_bound_and_message() -> None:
    e = np.ones((2, 3), F32)
    a = e.copy()
    a[1, 2] = _step(F32(1.0), 3)
    assert compare("k.out", a, e, Tolerance.ulp(3)).passed
    r = compare("k.out", a, e, Tolerance.ulp(2))
    assert not r.passed
    assert r.worst_ulp == 3 and r.worst_ulp_index == (1, 2)
    lines = r.message.splitlines()
    assert lines[0] == "k.out: Tensor-likes are not close! (tolerance: <= 2 ULP)"
    assert "Mismatched elements: 1 / 6 (16.7%)" in lines
    assert "Greatest ULP difference: 3 at index (1, 2) (up to 2 allowed)" in lines
    assert any(line.startswith("Greatest absolute difference: ") and line.endswith("at index (1, 2)")
               for line in lines)
    with pytest.raises(AssertionError, match="Greatest relative difference"):
        assert_conforms("k.out", a, e, Tolerance.ulp(2))


def test_ulp_requires_identical_nonfinite_maps() -> None:
    e = np.array([1.0, np.inf, np.nan], F32)
    assert compare("x", e.copy(), e, Tolerance.ulp(1)).passed
    for bad in ([1.0, -np.inf, np.nan], [1.0, np.inf, 1.0], [np.nan, np.inf, np.nan]):
        r = compare("x", np.array(bad, F32), e, Tolerance.ulp(10**9))
        assert not r.passed and "maps differ" in r.message


# ------------------------------------------------------------------------------ reduction
def test_reduction_accepts_other_summation_orders() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1000, 37)).astype(F32)
    pairwise = x.sum(axis=0, dtype=F32)                       # NumPy's order
    sequential = np.zeros(37, F32)
    for row in x:                                             # left to right
        sequential = (sequential + row).astype(F32)
    blocked = x.reshape(4, 250, 37).sum(axis=1, dtype=F32).sum(axis=0, dtype=F32)
    scale = {"length": 1000, "magnitude": np.abs(x).max(axis=0)}
    for actual in (sequential, blocked):
        assert compare("colsum", actual, pairwise, REDUCTION, scale).passed
    # A cancelling sum (exact result 0) differs only by rounding: the absolute floor covers it.
    c = np.concatenate([x, -x[::-1]]).astype(F32)
    seq = np.zeros(37, F32)
    for row in c:
        seq = (seq + row).astype(F32)
    assert compare("cancel", seq, c.sum(axis=0, dtype=F32), REDUCTION,
                   {"length": 2000, "magnitude": np.abs(c).max(axis=0)}).passed


def test_reduction_catches_a_dropped_term() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((257, 5)).astype(F32)
    expected = x.sum(axis=0, dtype=F32)
    actual = x[:-1].sum(axis=0, dtype=F32)  # an off-by-one tail: the last row is lost
    r = compare("colsum", actual, expected, REDUCTION, {"length": 257, "magnitude": np.abs(x).max()})
    assert not r.passed and r.worst_ratio > 1 and "Worst error / bound" in r.message


def test_reduction_needs_its_scale() -> None:
    e = np.ones(3, F32)
    with pytest.raises(ValueError, match=r"needs inputs with keys \('length', 'magnitude'\)"):
        compare("x", e, e, REDUCTION)
    with pytest.raises(ValueError, match="length must be a positive int"):
        compare("x", e, e, REDUCTION, {"length": 0, "magnitude": 1.0})


def test_exact_region_inside_a_tolerance() -> None:
    e = np.array([1.0, 2.0, np.nan], F32)
    a = e.copy()
    a[0] = _step(F32(1.0), 1)
    assert compare("x", a, e, Tolerance.ulp(1)).passed
    r = compare("x", a, e, Tolerance.ulp(1), {"exact": [True, False, False]})
    assert not r.passed and "must be copied bit for bit" in r.message


# ------------------------------------------------------------------------------ GEMM bound
def test_gamma_matches_the_formula() -> None:
    assert gamma(1) == pytest.approx(2**-24 / (1 - 2**-24), rel=1e-15)
    assert gamma(4096) == pytest.approx(4096 * 2**-24 / (1 - 4096 * 2**-24), rel=1e-15)
    with pytest.raises(ValueError):
        gamma(2**24)


def _operands(m: int, k: int, n: int, seed: int):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((m, k)).astype(F32), rng.standard_normal((k, n)).astype(F32)


@pytest.mark.parametrize("mode", ["f32", "bf16", "tf32"])
def test_reference_gemm_is_within_its_own_bound(mode: str) -> None:
    a, b = _operands(257, 259, 253, 2)
    c = gemm(a, b, mode=mode)
    result = assert_conforms(f"gemm[{mode}]", c, c, Tolerance.gemm(mode),
                             {"a": round_for(a, mode), "b": round_for(b, mode)})
    assert 0 < result.worst_ratio <= 1 and result.rms_rel <= result.rms_bound


def _truncate_tf32(x: np.ndarray) -> np.ndarray:
    return (x.view(np.uint32) & np.uint32(0xFFFFE000)).view(F32)


def test_tf32_truncating_hardware_passes_with_cancellation() -> None:
    """cuBLAS may truncate to TF32 where the reference rounds to nearest; that difference
    scales with |A| @ |B|, not |C64| (module docstring), most visibly where a dot product
    cancels (column 0 here is made to cancel for every row)."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((64, 64)).astype(F32)
    b = rng.standard_normal((64, 8)).astype(F32)
    b[-1, 0] = 1
    a[:, -1] = -(a[:, :-1].astype(np.float64) @ b[:-1, 0].astype(np.float64)).astype(F32)
    truncated = np.matmul(_truncate_tf32(a), _truncate_tf32(b)).astype(F32)
    inputs = {"a": round_for(a, "tf32"), "b": round_for(b, "tf32")}
    result = compare("tf32", truncated, gemm(a, b, mode="tf32"), Tolerance.gemm("tf32"), inputs)
    assert result.passed, result.message
    # The same data breaks a bound without the input-mismatch term (u_in |C64| + gamma_K |A||B|).
    c64 = inputs["a"].astype(np.float64) @ inputs["b"].astype(np.float64)
    abs_ab = np.abs(inputs["a"]).astype(np.float64) @ np.abs(inputs["b"]).astype(np.float64)
    naive = GEMM_SAFETY * (U_IN["tf32"] * np.abs(c64) + gamma(64) * abs_ab)
    assert np.count_nonzero(np.abs(truncated[:, 0] - c64[:, 0]) > naive[:, 0]) > 32
    assert np.all(np.abs(truncated - c64) <= gemm_bound(Tolerance.gemm("tf32"), c64, abs_ab, 64))


def test_gemm_bound_catches_wrong_results() -> None:
    a, b = _operands(65, 300, 33, 4)
    inputs = {"a": a, "b": b}
    expected = gemm(a, b, mode="f32")
    # Rounding the inputs to BF16 is far outside the F32 bound.
    assert not compare("f32", gemm(a, b, mode="bf16"), expected, Tolerance.gemm("f32"), inputs).passed
    # A K-tail bug: the last K element is dropped.
    tail = np.matmul(a[:, :-1], b[:-1]).astype(F32)
    r = compare("f32", tail, expected, Tolerance.gemm("f32"), inputs)
    assert not r.passed and "RMS relative error" in r.message
    with pytest.raises(ValueError, match="tolerance is for K=10 but the operands have K=300"):
        compare("f32", expected, expected, Tolerance.gemm("f32", 10), inputs)
    with pytest.raises(ValueError, match=r"needs inputs with keys \('a', 'b'\)"):
        compare("f32", expected, expected, Tolerance.gemm("f32"))


def test_gemm_nan_rows_must_match() -> None:
    a, b = _operands(8, 16, 8, 5)
    a[3, 7] = np.nan
    expected = gemm(a, b)
    assert compare("nan", expected.copy(), expected, Tolerance.gemm("f32"), {"a": a, "b": b}).passed
    wrong = expected.copy()
    wrong[3] = 0
    r = compare("nan", wrong, expected, Tolerance.gemm("f32"), {"a": a, "b": b})
    assert not r.passed and "NaN maps differ at 8 position(s)" in r.message


def test_f32_unit_roundoff() -> None:
    assert F32(1) + F32(F32_UNIT_ROUNDOFF) == F32(1)  # a tie rounds to even
    assert F32(1) + F32(2 * F32_UNIT_ROUNDOFF) > F32(1)


# ------------------------------------------------------------------------------ strategies
def test_hypothesis_profile_is_ci_unless_chosen() -> None:
    expected = os.environ.get("HYPOTHESIS_PROFILE", "ci")
    assert settings._current_profile == expected
    if expected == "ci":
        assert settings().derandomize and settings().deadline is None


def test_boundary_positions() -> None:
    pos = boundary_positions(257 * 259)
    for p in (0, 255, 256, 257, 511, 512, 513, 257 * 259 - 1):
        assert p in pos
    assert boundary_positions(1) == (0,)
    assert boundary_positions(256) == (0, 255)
    assert boundary_positions(300) == (0, 255, 256, 257, 299)
    with pytest.raises(ValueError):
        boundary_positions(0)


def test_inject_copies_and_places_values() -> None:
    base = np.arange(600, dtype=F32)
    out = inject(base, [Injection(255, F32(np.nan)), Injection(256, F32(-0.0))])
    assert base[255] == 255 and base[256] == 256  # input untouched
    assert np.isnan(out[255]) and out[256] == 0 and np.signbit(out[256])
    assert np.array_equal(np.delete(out, [255, 256]), np.delete(base, [255, 256]))
    with pytest.raises(ValueError, match="position 600 outside"):
        inject(base, [Injection(600, F32(0))])


@settings(max_examples=40)
@given(data=st.data(), size=tail_sizes())
def test_injections_are_distinct_and_in_range(data, size: int) -> None:
    drawn = data.draw(injections(size))
    positions = [inj.position for inj in drawn]
    assert 1 <= len(drawn) <= min(6, size)
    assert len(set(positions)) == len(positions)
    assert all(0 <= p < size for p in positions)
    special_bits = {np.array(v, F32).view(np.uint32).item() for v in SPECIAL_VALUES}
    assert all(np.array(inj.value, F32).view(np.uint32).item() in special_bits for inj in drawn)


@settings(max_examples=30)
@given(arr=f32_with_specials((3, 259), values=(F32(np.nan), F32(-np.inf)), positions=(0, 255, 256, 257),
                             random_positions=False))
def test_f32_with_specials_puts_specials_only_at_the_chosen_positions(arr: np.ndarray) -> None:
    assert arr.dtype == F32 and arr.shape == (3, 259)
    flat = arr.reshape(-1)
    special = ~np.isfinite(flat)
    assert 1 <= special.sum() <= 4
    assert set(np.flatnonzero(special).tolist()) <= {0, 255, 256, 257}
    assert np.all(np.isnan(flat[special]) | np.isneginf(flat[special]))


@settings(max_examples=20)
@given(arr=finite_f32((257,), scale=3.0))
def test_finite_f32_is_finite_float32(arr: np.ndarray) -> None:
    assert arr.dtype == F32 and arr.shape == (257,) and np.all(np.isfinite(arr))


def test_special_values_cover_the_contract() -> None:
    bits = [np.array(v, F32).view(np.uint32).item() for v in SPECIAL_VALUES]
    assert len(set(bits)) == len(bits)
    vals = np.array(SPECIAL_VALUES, F32)
    assert np.isnan(vals).any() and np.isposinf(vals).any() and np.isneginf(vals).any()
    assert F32_MAX in vals and -F32_MAX in vals and F32_LARGEST_SUBNORMAL in vals
    zeros = vals[vals == 0]
    assert sorted(np.signbit(zeros).tolist()) == [False, True]
    assert math.isclose(float(F32_SMALLEST_SUBNORMAL), 2.0**-149)


def test_bitwise_nan_payload_insensitive_only_for_nans():
    from foxhunt.conformance.tolerance import Tolerance, compare

    tol = Tolerance.exact(bitwise=True, nan_payload=False)
    canonical, quiet = np.uint16(0x7FFF), np.uint16(0x7FC0)
    a = np.array([canonical, 0x3F80, 0xFF80], np.uint16)
    b = np.array([quiet, 0x3F80, 0xFF80], np.uint16)
    assert compare("bf16", a, b, tol).mismatches == 0
    b2 = b.copy()
    b2[1] = 0x3F81  # a finite pattern still has to match bit for bit
    assert compare("bf16", a, b2, tol).mismatches == 1
    b3 = b.copy()
    b3[0] = 0x7F80  # +Inf is not NaN
    assert compare("bf16", a, b3, tol).mismatches == 1
    assert compare("bf16", a, b, Tolerance.exact(bitwise=True)).mismatches == 1
    with pytest.raises(ValueError, match="nan_payload"):
        Tolerance.exact(nan_payload=False)


def test_gemm_overflow_positions_free_their_class_and_exact_ones_skip_the_bound() -> None:
    """``overflow``: a position whose sums may overflow in one order and not another may be Inf
    in one result and finite in the other; elsewhere a class difference still fails. ``exact``:
    judged bit for bit, not by the bound (a masked zero against a nonzero product)."""
    big = np.float32(3.3e38)
    a = np.array([[1.0, 1.0], [1.0, -0.1]], np.float32)
    b = np.array([[big, 1.0], [big, 2.0]], np.float32)
    expected = np.array([[np.inf, 3.0], [np.float32(big * np.float32(0.9)), 0.8]], np.float32)
    actual = np.array([[np.float32(3.4e38), 3.0], [np.inf, 0.8]], np.float32)
    tol = Tolerance.gemm("f32")
    inputs = {"a": a, "b": b}
    assert not compare("g", actual, expected, tol, inputs).passed
    free = np.array([[True, False], [True, False]])
    assert compare("g", actual, expected, tol, {**inputs, "overflow": free}).passed
    masked = expected.copy()
    masked[0, 1] = 0.0
    assert not compare("g", masked, expected, tol, inputs).passed
    assert compare("g", masked, masked, tol, {**inputs, "exact": np.array([[False, True], [False, False]])}).passed
