"""Tests for foxhunt.reference.kernels.dense: bias+ReLU epilogues, ReLU backward, bias gradient,
BF16/TF32 rounding and the GEMM emulation.

Oracles: torch (CPU) autograd on float64-promoted inputs for the Linear+ReLU backward, torch's
own float32/bfloat16 ops for the elementwise contracts, and float64 rounding formulas written
here (independent of the bit tricks in the code under test).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from foxhunt.reference.kernels import dense

F32_EPS = 2.0**-24  # unit roundoff of float32


def gamma_k(k: int) -> float:
    """Higham's gamma_k = k u / (1 - k u) for float32: the bound on a k-term dot product's
    relative error (w.r.t. the sum of absolute products)."""
    return k * F32_EPS / (1.0 - k * F32_EPS)


def assert_within(actual: np.ndarray, expected: np.ndarray, bound: np.ndarray, what: str) -> None:
    """``|actual - expected| <= bound`` elementwise, with an assert_close-style message."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    err = np.abs(actual.astype(np.float64) - expected)
    bad = ~(err <= bound)
    if bad.any():
        worst = np.unravel_index(np.argmax(np.where(bad, err - bound, -np.inf)), err.shape)
        raise AssertionError(
            f"{what}: {bad.sum()} / {bad.size} ({100.0 * bad.mean():.3g}%) elements exceed the "
            f"bound; greatest absolute difference {err.max():.3e}; worst at {worst}: "
            f"actual {actual[worst]!r}, expected {expected[worst]!r}, bound {bound[worst]:.3e}"
        )


def bits32(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.uint32)


# ---------------------------------------------------------------------------------------------
# Independent float64 rounding oracles.
# ---------------------------------------------------------------------------------------------


def _quantum(x64: np.ndarray, significant_bits: int) -> np.ndarray:
    """Spacing of the target format at |x| (same exponent range as float32: the subnormal
    spacing is 2**-149 scaled by the dropped bits)."""
    _, exponent = np.frexp(np.where(x64 == 0, 1.0, x64))  # |x| in [2**(e-1), 2**e)
    min_quantum = 2.0 ** (-149 + (24 - significant_bits))
    return np.maximum(np.ldexp(1.0, exponent - significant_bits), min_quantum)


def bf16_oracle(x: np.ndarray) -> np.ndarray:
    """Round finite float32 values to BF16 (8 significant bits, RNE) in float64, as float32."""
    x64 = x.astype(np.float64)
    q = _quantum(x64, 8)
    rounded = np.round(x64 / q) * q  # np.round is half-to-even; x64 / q is exact
    with np.errstate(over="ignore"):
        return rounded.astype(np.float32)  # beyond the BF16 max rounds to +/-Inf


def tf32_oracle(x: np.ndarray) -> np.ndarray:
    """Round finite float32 values to TF32 (11 significant bits, ties away from zero)."""
    x64 = x.astype(np.float64)
    q = _quantum(x64, 11)
    rounded = np.copysign(np.floor(np.abs(x64) / q + 0.5) * q, x64)
    with np.errstate(over="ignore"):
        return rounded.astype(np.float32)


def all_high_halves_with(lows: list[int]) -> np.ndarray:
    """Every float32 pattern (high << 16) | low for all 2**16 high halves and the given lows."""
    high = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    return np.concatenate([high | np.uint32(low) for low in lows]).view(np.float32)


TIE_AND_NEIGHBOUR_LOWS = [0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x4000, 0xC000]


def is_nan_bits(u: np.ndarray) -> np.ndarray:
    return (u & 0x7FFF_FFFF) > 0x7F80_0000


# ---------------------------------------------------------------------------------------------
# BF16
# ---------------------------------------------------------------------------------------------


def test_f32_to_bf16_matches_torch_on_all_high_halves_and_tie_lows():
    x = all_high_halves_with(TIE_AND_NEIGHBOUR_LOWS)
    ours = dense.f32_to_bf16(x)
    assert ours.dtype == np.uint16 and ours.shape == x.shape
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    not_nan = ~is_nan_bits(x.view(np.uint32))
    mismatch = np.flatnonzero(not_nan & (ours != theirs))
    assert mismatch.size == 0, (
        f"{mismatch.size} non-NaN patterns differ from torch, first "
        f"{hex(int(x.view(np.uint32)[mismatch[0]]))}: ours {hex(int(ours[mismatch[0]]))}, "
        f"torch {hex(int(theirs[mismatch[0]]))}"
    )


def test_f32_to_bf16_matches_float64_rne_oracle():
    x = all_high_halves_with(TIE_AND_NEIGHBOUR_LOWS)
    finite = np.isfinite(x)
    expected = bf16_oracle(x[finite]).view(np.uint32)
    ours = dense.bf16_to_f32(dense.f32_to_bf16(x[finite])).view(np.uint32)
    assert np.array_equal(ours, expected)


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        (0x3F80_8000, 0x3F80),  # 1 + 2**-8: a tie, mantissa even -> down
        (0x3F81_8000, 0x3F82),  # tie, mantissa odd -> up to even
        (0x3F80_8001, 0x3F81),  # just above the tie -> up
        (0x3F80_7FFF, 0x3F80),  # just below the tie -> down
        (0xBF81_8000, 0xBF82),  # negative tie -> even (magnitude up)
        (0x0000_8000, 0x0000),  # subnormal tie -> even (zero)
        (0x0001_8000, 0x0002),  # subnormal tie, odd -> up
        (0x0000_8001, 0x0001),  # smallest BF16 subnormal, no flush to zero
        (0x8000_0000, 0x8000),  # -0 keeps its sign
        (0x7F7F_FFFF, 0x7F80),  # FLT_MAX rounds to +Inf
        (0x7F7F_7FFF, 0x7F7F),  # largest value rounding to the BF16 max
        (0x7F80_0000, 0x7F80),  # +Inf
        (0xFF80_0000, 0xFF80),  # -Inf
    ],
)
def test_f32_to_bf16_hand_cases(pattern, expected):
    x = np.array([pattern], dtype=np.uint32).view(np.float32)
    assert int(dense.f32_to_bf16(x)[0]) == expected


@pytest.mark.parametrize(
    "pattern", [0x7FC0_0000, 0xFFC0_0000, 0x7F80_0001, 0xFF80_0001, 0x7FA5_0000, 0x7FFF_FFFF,
                0xFFFF_FFFF, 0x7F80_8000]
)
def test_f32_to_bf16_nan_stays_quiet_nan_with_sign_and_high_payload(pattern):
    x = np.array([pattern], dtype=np.uint32).view(np.float32)
    out = int(dense.f32_to_bf16(x)[0])
    assert (out & 0x7FFF) > 0x7F80, f"{hex(pattern)} -> {hex(out)} is not a NaN"
    assert out & 0x0040, "quiet bit must be set"
    assert (out & 0x8000) == ((pattern >> 16) & 0x8000), "sign must be kept"
    assert (out & ~0x0040) == ((pattern >> 16) & ~0x0040), "high payload bits must be kept"


def test_bf16_to_f32_is_exact_on_every_pattern():
    u = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    out = dense.bf16_to_f32(u)
    assert out.dtype == np.float32
    assert np.array_equal(out.view(np.uint32), u.astype(np.uint32) << 16)
    torch_wide = torch.from_numpy(u.view(np.int16)).view(torch.bfloat16).float().numpy()
    finite = np.isfinite(torch_wide)
    assert np.array_equal(out[finite].view(np.uint32), torch_wide[finite].view(np.uint32))
    assert np.array_equal(np.isnan(out), np.isnan(torch_wide))
    # Every pattern whose NaNs are already quiet round-trips bit for bit.
    quiet_or_not_nan = ~((u & 0x7FFF) > 0x7F80) | ((u & 0x0040) != 0)
    back = dense.f32_to_bf16(out)
    assert np.array_equal(back[quiet_or_not_nan], u[quiet_or_not_nan])


# ---------------------------------------------------------------------------------------------
# TF32
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1.0 + 2.0**-11, 1.0 + 2.0**-10),  # tie -> away from zero (RNE would give 1.0)
        (-(1.0 + 2.0**-11), -(1.0 + 2.0**-10)),  # negative tie -> away from zero
        (1.0 + 3 * 2.0**-11, 1.0 + 2.0**-9),  # tie, mantissa odd -> away
        (1.0 + 2.0**-11 - 2.0**-23, 1.0),  # just below the tie
        (1.0 + 2.0**-11 + 2.0**-23, 1.0 + 2.0**-10),  # just above the tie
        (2.0 - 2.0**-23, 2.0),  # carry into the exponent
        (3.0, 3.0),
        (0.0, 0.0),
        (2.0**-149, 0.0),  # smallest subnormal: below half a TF32 subnormal step
        (2.0**-137, 2.0**-136),  # subnormal tie -> away from zero
        (float(np.finfo(np.float32).max), np.inf),  # rounds past the largest TF32 value
        (np.inf, np.inf),
        (-np.inf, -np.inf),
    ],
)
def test_tf32_round_hand_cases(value, expected):
    out = dense.tf32_round(np.array([value], dtype=np.float32))
    assert out.dtype == np.float32
    assert bits32(out)[0] == bits32(np.array([expected]))[0], f"{value!r} -> {out[0]!r}"


def test_tf32_round_matches_float64_ties_away_oracle_and_properties():
    x = all_high_halves_with([0x0000, 0x0FFF, 0x1000, 0x1001, 0x3000, 0x1FFF, 0xF000, 0xFFFF])
    finite = np.isfinite(x)
    xf = x[finite]
    out = dense.tf32_round(xf)
    assert np.array_equal(bits32(out), bits32(tf32_oracle(xf)))
    stays_finite = np.isfinite(out)
    assert np.all(bits32(out[stays_finite]) & 0x1FFF == 0), "low 13 bits must be zero"
    assert np.array_equal(bits32(dense.tf32_round(out)), bits32(out)), "idempotent"
    assert np.array_equal(bits32(dense.tf32_round(-xf)), bits32(-out)), "odd symmetric"
    normal = stays_finite & (np.abs(xf) >= np.finfo(np.float32).tiny)
    rel = np.abs(out[normal].astype(np.float64) - xf[normal]) / np.abs(xf[normal])
    assert rel.max() <= 2.0**-11, "error at most half a TF32 ulp"
    order = np.argsort(xf, kind="stable")
    assert np.all(np.diff(out[order].astype(np.float64)[stays_finite[order]]) >= 0), "monotone"


@pytest.mark.parametrize("pattern", [0x7FC0_0000, 0xFFC0_0000, 0x7F80_0001, 0xFF80_1FFF,
                                     0x7FA0_2000])
def test_tf32_round_nan_stays_quiet_nan_with_sign(pattern):
    x = np.array([pattern], dtype=np.uint32).view(np.float32)
    out = int(bits32(dense.tf32_round(x))[0])
    assert (out & 0x7FFF_FFFF) > 0x7F80_0000 and out & 0x0040_0000
    assert out & 0x8000_0000 == pattern & 0x8000_0000
    assert out & 0x1FFF == 0
    assert out & 0xFFBF_E000 == pattern & 0xFFBF_E000


# ---------------------------------------------------------------------------------------------
# Bias + ReLU, ReLU mask, bias gradient: elementwise contracts vs torch
# ---------------------------------------------------------------------------------------------

SPECIALS = [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45, 3e38, -3e38]


def finite_f32(shape):
    return hnp.arrays(np.float32, shape, elements=st.floats(-1e3, 1e3, width=32))


@st.composite
def matrix_with_specials(draw, shape):
    """A float32 matrix with special values injected at drawn positions (hnp.arrays shares
    fill values, so specials are placed explicitly)."""
    x = draw(finite_f32(shape)).copy()
    count = draw(st.integers(0, x.size))
    for _ in range(count):
        i = draw(st.integers(0, x.size - 1))
        x.flat[i] = draw(st.sampled_from(SPECIALS))
    return x


def equal_with_nan(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=True)


@settings(max_examples=40)
@given(data=st.data(), m=st.integers(1, 6), n=st.integers(1, 7))
def test_add_bias_relu_matches_torch_relu_including_specials(data, m, n):
    y = data.draw(matrix_with_specials((m, n)))
    b = data.draw(matrix_with_specials((1, n)))[0]
    y_before, b_before = y.copy(), b.copy()
    out = dense.add_bias_relu(y, b)
    expected = torch.relu(torch.from_numpy(y) + torch.from_numpy(b)).numpy()
    assert equal_with_nan(out, expected)
    with np.errstate(all="ignore"):
        pre = y + b
    assert not np.signbit(out[~np.isnan(pre) & (pre <= 0)]).any(), "t <= 0 gives +0.0"
    assert np.array_equal(np.isnan(out), np.isnan(pre)), "NaN propagates, exactly where t is NaN"
    assert equal_with_nan(y, y_before) and equal_with_nan(b, b_before), "inputs not mutated"


def test_add_bias_relu_odd_shape_bitwise_vs_torch_f32():
    rng = np.random.default_rng(1)
    y = rng.standard_normal((257, 259)).astype(np.float32)
    b = rng.standard_normal(259).astype(np.float32)
    out = dense.add_bias_relu(y, b)
    expected = torch.relu(torch.from_numpy(y) + torch.from_numpy(b)).numpy()
    assert np.array_equal(out, expected)


def test_add_bias_relu_bf16_is_relu_then_rne_copy():
    rng = np.random.default_rng(2)
    y = rng.standard_normal((257, 259)).astype(np.float32)
    y[0, :4] = [np.nan, np.inf, -np.inf, -0.0]
    b = rng.standard_normal(259).astype(np.float32)
    result = dense.add_bias_relu_bf16(y, b)
    out, out_bf16 = result
    assert equal_with_nan(out, dense.add_bias_relu(y, b))
    assert out_bf16.dtype == np.uint16 and out_bf16.shape == y.shape
    finite = np.isfinite(out)
    torch_bf16 = torch.from_numpy(out[finite]).to(torch.bfloat16).view(torch.int16).numpy()
    assert np.array_equal(out_bf16[finite], torch_bf16.view(np.uint16))
    assert (out_bf16[0, 0] & 0x7FFF) > 0x7F80 and out_bf16[0, 1] == 0x7F80
    assert out_bf16[0, 2] == 0 and out_bf16[0, 3] == 0


@settings(max_examples=40)
@given(data=st.data(), m=st.integers(1, 6), n=st.integers(1, 7))
def test_relu_mask_matches_torch_threshold_backward_including_specials(data, m, n):
    dy = data.draw(matrix_with_specials((m, n)))
    h = np.abs(data.draw(matrix_with_specials((m, n))))  # post-ReLU: >= 0, NaN or +Inf
    h[data.draw(hnp.arrays(np.bool_, (m, n)))] = 0.0
    out = dense.relu_mask(dy, h)
    expected = torch.ops.aten.threshold_backward(
        torch.from_numpy(dy), torch.from_numpy(h), 0.0
    ).numpy()
    assert equal_with_nan(out, expected)
    assert np.all(out[h <= 0] == 0) and not np.signbit(out[h <= 0]).any()
    passes = ~(h <= 0)
    assert equal_with_nan(out[passes], dy[passes])


def test_bias_grad_reduce_vs_float64_with_error_bound_and_specials():
    rng = np.random.default_rng(3)
    dy = rng.standard_normal((257, 259)).astype(np.float32)
    out = dense.bias_grad_reduce(dy)
    assert out.dtype == np.float32 and out.shape == (259,)
    expected = dy.astype(np.float64).sum(axis=0)
    bound = gamma_k(257) * np.abs(dy.astype(np.float64)).sum(axis=0)
    assert_within(out, expected, bound, "bias_grad_reduce")
    dy[5, 0] = np.nan
    dy[7, 1], dy[9, 1] = np.inf, -np.inf
    dy[2, 2] = np.inf
    special = dense.bias_grad_reduce(dy)
    assert np.isnan(special[0]) and np.isnan(special[1]) and special[2] == np.inf
    assert np.all(np.isfinite(special[3:]))


# ---------------------------------------------------------------------------------------------
# relu_mask_bias_grad: the fused twin of relu_mask then bias_grad_reduce
# ---------------------------------------------------------------------------------------------


def assert_same_bits(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert actual.dtype == np.float32 and actual.shape == expected.shape, what
    assert np.array_equal(bits32(actual), bits32(expected)), f"{what}: bits differ"


def post_relu(rng: np.random.Generator, shape) -> np.ndarray:
    """A post-ReLU activation: about half exact zeros, the rest positive."""
    h = rng.uniform(0.01, 2.0, shape).astype(np.float32)
    h[rng.random(shape) < 0.5] = 0.0
    return h


@pytest.mark.parametrize("shape", [(256, 128), (256, 256), (257, 259), (1, 3)])
def test_relu_mask_bias_grad_is_the_composition_bitwise(shape):
    rng = np.random.default_rng(11)
    dy = rng.standard_normal(shape).astype(np.float32)
    h = post_relu(rng, shape)
    dy_before, h_before = dy.copy(), h.copy()
    result = dense.relu_mask_bias_grad(dy, h)
    assert isinstance(result, dense.ReluBiasGrad) and result._fields == ("dx", "db")
    dx = dense.relu_mask(dy, h)
    assert_same_bits(result.dx, dx, "dx")
    assert_same_bits(result.db, dense.bias_grad_reduce(dx), "db")
    assert_same_bits(dy, dy_before, "dy not mutated")
    assert_same_bits(h, h_before, "h not mutated")
    # Independent oracle: float64 column sums of torch's threshold_backward.
    masked = torch.ops.aten.threshold_backward(
        torch.from_numpy(dy).double(), torch.from_numpy(h).double(), 0.0
    ).numpy()
    bound = gamma_k(shape[0]) * np.abs(masked).sum(axis=0)
    assert_within(result.db, masked.sum(axis=0), bound, "relu_mask_bias_grad db")


@settings(max_examples=40)
@given(data=st.data(), m=st.integers(1, 6), n=st.integers(1, 7))
def test_relu_mask_bias_grad_is_the_composition_with_specials(data, m, n):
    dy = data.draw(matrix_with_specials((m, n)))
    h = data.draw(matrix_with_specials((m, n)))  # any sign: the contract covers every h
    h[data.draw(hnp.arrays(np.bool_, (m, n)))] = 0.0
    dx, db = dense.relu_mask_bias_grad(dy, h)
    expected_dx = dense.relu_mask(dy, h)
    assert_same_bits(dx, expected_dx, "dx")
    assert_same_bits(db, dense.bias_grad_reduce(expected_dx), "db")
    # The contract, restated: specials under h <= 0 are dropped; passed NaN / mixed Inf poison.
    passes = ~(h <= 0)
    passed = np.where(passes, dy, np.float32(0))
    poisoned = np.isnan(passed).any(axis=0) | (
        (passed == np.inf).any(axis=0) & (passed == -np.inf).any(axis=0))
    assert np.isnan(db[poisoned]).all()
    clean = ~np.isfinite(dy) & ~passes
    assert not np.isnan(dx[clean]).any() and np.all(dx[~passes] == 0)


def test_relu_mask_bias_grad_drops_specials_where_h_is_not_positive():
    dy = np.array([[np.nan, np.inf, 1.0], [2.0, -np.inf, np.nan]], np.float32)
    h = np.array([[0.0, -0.0, 1.0], [3.0, 0.0, np.nan]], np.float32)
    dx, db = dense.relu_mask_bias_grad(dy, h)
    assert np.array_equal(dx, np.array([[0.0, 0.0, 1.0], [2.0, 0.0, np.nan]], np.float32),
                          equal_nan=True)
    assert not np.signbit(dx[:, :2][h[:, :2] <= 0]).any()
    assert db[0] == 2.0 and db[1] == 0.0 and not np.signbit(db[1]) and np.isnan(db[2])


# ---------------------------------------------------------------------------------------------
# Linear + ReLU backward vs torch autograd (float64 oracle)
# ---------------------------------------------------------------------------------------------


LINEAR_SHAPES = pytest.mark.parametrize(
    ("batch", "d_in", "d_out"), [(4, 16, 32), (256, 128, 256), (5, 257, 259)],
    ids=["tiny", "seed", "odd"],
)


@LINEAR_SHAPES
def test_linear_relu_forward_vs_torch_within_dot_product_bound(batch, d_in, d_out):
    rng = np.random.default_rng(batch * 1000 + d_in)
    x = rng.standard_normal((batch, d_in)).astype(np.float32)
    w = (rng.standard_normal((d_out, d_in)) / np.sqrt(d_in)).astype(np.float32)
    b = rng.standard_normal(d_out).astype(np.float32)
    h = dense.add_bias_relu(dense.gemm(x, w, trans_b=True), b)
    h64 = torch.relu(torch.nn.functional.linear(
        torch.from_numpy(x).double(), torch.from_numpy(w).double(), torch.from_numpy(b).double()
    )).numpy()
    # relu is 1-Lipschitz, so the bound of the K-term dot product plus the bias add carries over.
    abs_x, abs_w = np.abs(x.astype(np.float64)), np.abs(w.astype(np.float64))
    assert_within(h, h64, gamma_k(d_in + 1) * (abs_x @ abs_w.T + np.abs(b)), "h")


@LINEAR_SHAPES
def test_linear_relu_backward_vs_torch_autograd(batch, d_in, d_out):
    rng = np.random.default_rng(batch * 1000 + d_in + 1)
    # Dyadic forward operands (multiples of 1/4, 1/32, 1/128 with few bits): the forward is
    # exact in float32, so float32 and the float64 oracle put every element (exact zeros
    # included) on the same side of the ReLU kink. dy is generic, so the backward GEMMs round.
    x = (rng.integers(-8, 9, (batch, d_in)) / 4).astype(np.float32)
    w = (rng.integers(-8, 9, (d_out, d_in)) / 32).astype(np.float32)
    b = (rng.integers(-256, 257, d_out) / 128).astype(np.float32)
    dy = rng.standard_normal((batch, d_out)).astype(np.float32)

    x64 = torch.from_numpy(x).double().requires_grad_()
    w64 = torch.from_numpy(w).double().requires_grad_()
    b64 = torch.from_numpy(b).double().requires_grad_()
    h64 = torch.relu(torch.nn.functional.linear(x64, w64, b64))
    h64.backward(torch.from_numpy(dy).double())

    h = dense.add_bias_relu(dense.gemm(x, w, trans_b=True), b)
    assert np.array_equal(h, h64.detach().numpy()), "dyadic forward must be exact"
    assert (h == 0).mean() > 0.3 and (h > 0).mean() > 0.3, "both ReLU sides exercised"
    d_pre = dense.relu_mask(dy, h)
    db = dense.bias_grad_reduce(d_pre)
    dw = dense.gemm(d_pre, x, trans_a=True)
    dx = dense.gemm(d_pre, w)
    for name, arr in [("d_pre", d_pre), ("db", db), ("dw", dw), ("dx", dx)]:
        assert arr.dtype == np.float32, name

    # d_pre is an exact select of the f32 dy, so the reductions below have exact inputs and
    # the float32 error is bounded by gamma_K times the sum of absolute products.
    abs_x, abs_w = np.abs(x.astype(np.float64)), np.abs(w.astype(np.float64))
    abs_dp = np.abs(d_pre.astype(np.float64))
    assert_within(db, b64.grad.numpy(), gamma_k(batch) * abs_dp.sum(axis=0), "db")
    assert_within(dw, w64.grad.numpy(), gamma_k(batch) * (abs_dp.T @ abs_x), "dw")
    assert_within(dx, x64.grad.numpy(), gamma_k(d_out) * (abs_dp @ abs_w), "dx")


# ---------------------------------------------------------------------------------------------
# GEMM emulation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", dense.GEMM_MODES)
@pytest.mark.parametrize(("trans_a", "trans_b"), [(False, False), (True, False), (False, True),
                                                  (True, True)])
def test_gemm_modes_vs_float64_on_rounded_inputs(mode, trans_a, trans_b):
    rng = np.random.default_rng(7)
    m, k, n = 33, 257, 19
    a_op = rng.standard_normal((m, k)).astype(np.float32)
    b_op = rng.standard_normal((k, n)).astype(np.float32)
    a = np.ascontiguousarray(a_op.T) if trans_a else a_op
    b = np.ascontiguousarray(b_op.T) if trans_b else b_op
    out = dense.gemm(a, b, trans_a=trans_a, trans_b=trans_b, mode=mode)
    assert out.dtype == np.float32 and out.shape == (m, n)
    if mode == "f32":
        a_r, b_r = a_op, b_op
    elif mode == "bf16":
        a_r, b_r = bf16_oracle(a_op), bf16_oracle(b_op)
    else:
        a_r, b_r = tf32_oracle(a_op), tf32_oracle(b_op)
    a64, b64 = a_r.astype(np.float64), b_r.astype(np.float64)
    bound = gamma_k(k) * (np.abs(a64) @ np.abs(b64))
    assert_within(out, a64 @ b64, bound, f"gemm[{mode}]")
    if mode != "f32":
        # Sensitivity: skipping the input rounding must be detectable by the same bound.
        exact64 = a_op.astype(np.float64) @ b_op.astype(np.float64)
        assert np.any(np.abs(out - exact64) > bound), "rounding had no visible effect"


def test_round_for_modes_and_gemm_specials():
    x = np.array([1.0 + 2.0**-11, 1.0 + 2.0**-8 + 2.0**-20, np.nan, -np.inf], dtype=np.float32)
    assert equal_with_nan(dense.round_for(x, "f32"), x)
    assert dense.round_for(x, "f32") is not x
    assert equal_with_nan(dense.round_for(x, "tf32"), dense.tf32_round(x))
    assert equal_with_nan(dense.round_for(x, "bf16"), dense.bf16_to_f32(dense.f32_to_bf16(x)))
    a = np.ones((2, 3), dtype=np.float32)
    b = np.ones((3, 2), dtype=np.float32)
    a[0, 1] = np.nan
    b[2, 1] = np.inf
    out = dense.gemm(a, b)
    assert np.isnan(out[0]).all() and out[1, 1] == np.inf and out[1, 0] == 3.0


# ---------------------------------------------------------------------------------------------
# Errors and registry
# ---------------------------------------------------------------------------------------------

_Y = np.zeros((3, 4), dtype=np.float32)
_B = np.zeros(4, dtype=np.float32)


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda: dense.add_bias_relu(_Y.astype(np.float64), _B), "y"),
        (lambda: dense.add_bias_relu(_Y, np.zeros(5, np.float32)), "b"),
        (lambda: dense.add_bias_relu(_Y[0], _B), "y"),
        (lambda: dense.add_bias_relu_bf16(_Y, _B.astype(np.float16)), "b"),
        (lambda: dense.relu_mask(_Y, np.zeros((4, 3), np.float32)), "h"),
        (lambda: dense.relu_mask(_Y.tolist(), _Y), "dy"),
        (lambda: dense.bias_grad_reduce(_B), "dy"),
        (lambda: dense.relu_mask_bias_grad(_Y, np.zeros((4, 3), np.float32)), "h"),
        (lambda: dense.relu_mask_bias_grad(_Y.astype(np.float64), _Y), "dy"),
        (lambda: dense.relu_mask_bias_grad(_Y, _Y.astype(np.float16)), "h"),
        (lambda: dense.relu_mask_bias_grad(_B, _B), "dy"),
        (lambda: dense.f32_to_bf16(_Y.astype(np.float64)), "x"),
        (lambda: dense.bf16_to_f32(_Y), "u"),
        (lambda: dense.tf32_round(_Y.view(np.int32)), "x"),
        (lambda: dense.round_for(_Y, "fp16"), "mode"),
        (lambda: dense.gemm(_Y, _Y), "b"),
        (lambda: dense.gemm(_Y, _Y, trans_b=True, mode="int8"), "mode"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_argument(call, argument):
    with pytest.raises(ValueError, match=rf"^{argument}:"):
        call()


def test_kernels_registry_lists_kernels_but_not_gemm_helpers():
    assert set(dense.KERNELS) == {
        "add_bias_relu", "add_bias_relu_bf16", "relu_mask", "bias_grad_reduce",
        "relu_mask_bias_grad", "f32_to_bf16", "bf16_to_f32", "tf32_round", "gemm_tf32", "gemm_f32",
    }
    for name, fn in dense.KERNELS.items():
        assert fn.__name__ == name and fn is getattr(dense, name)
    assert "gemm" not in dense.KERNELS and "round_for" not in dense.KERNELS


# ---------------------------------------------------------------------------------------------
# The fused CUDA kernel: NVRTC build (no GPU needed) and its launch plan
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_relu_mask_bias_grad_cuda_source_compiles(arch, tmp_path):
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings is not installed")
    from foxhunt.fast import _build

    sources = _build.source_files()
    unit = {n: b for n, b in sources.items()
            if n == "dense.cu" or n.endswith(_build.HEADER_SUFFIXES)}
    module = _build.compile_sources(arch, "ptx", cache_root=tmp_path, sources=unit)
    assert {"relu_mask", "bias_grad_reduce", "relu_mask_bias_grad"} <= set(module.kernels)
    params = [p.ptx_type for p in module.params["relu_mask_bias_grad"]]
    assert params == ["u64", "u64", "u64", "u64", "u32", "u32"]  # dy, h, dx, db, rows, cols


def test_relu_mask_bias_grad_plan_keeps_bias_grad_chunks_and_spreads_columns():
    from foxhunt.fast.kernels import dense as fast_dense

    for cols, want_blocks in [(128, 16), (256, 32), (51, 7), (0, 1)]:
        grid, block, shared = fast_dense.plan_relu_mask_bias_grad(256, cols)
        assert grid == (want_blocks,) and shared == 0
        # db's bits equal bias_grad_reduce's only with the same row chunking (blockDim.y).
        assert block[1] == fast_dense.plan_bias_grad_reduce(256, cols)[1][1]
        assert block[0] * 4 == 32  # one 32-byte row segment of float32 per block row
