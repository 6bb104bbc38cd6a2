"""Reference dense-layer kernels: bias+ReLU epilogues, ReLU backward, bias gradients, and the
BF16 / TF32 rounding the GEMMs see.

Every kernel here is plain NumPy in float32 (uint16 for BF16 bit patterns), never mutates its
inputs, and is listed in ``KERNELS`` under the CUDA kernel's name. The GEMMs themselves are
cuBLAS calls on the fast path, not our kernels: ``round_for`` and ``gemm`` emulate them (inputs
rounded per precision mode, float32 accumulation) for the reference step and the conformance
bounds, and are deliberately absent from ``KERNELS``. The exceptions are ``gemm_tf32`` and
``gemm_f32``, the backward's short TF32 / f32 GEMMs (with an optional ReLU mask) that the fast path
runs as its own kernels: their twins are ``gemm`` then ``relu_mask``.

ReLU NaN contract (shared by ``add_bias_relu``, ``add_bias_relu_bf16`` and ``relu_mask``): the
activation is the select ``t <= 0 ? 0 : t``, so a NaN pre-activation stays NaN in ``h`` (the
sentinel slots that watch h1/h2, e.g. slot 12 before the Mech 10 clamp, must see it; ``fmaxf(t,
0)`` or ``t > 0 ? t : 0`` would silently turn it into 0). The backward mask is the matching
select ``h <= 0 ? 0 : dy``. Both agree with ``torch.relu`` and its autograd
(``threshold_backward``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from foxhunt.reference.kernels.argcheck import ieee, require_array, require_shape

F32 = np.dtype(np.float32)
U16 = np.dtype(np.uint16)
U32 = np.dtype(np.uint32)

# IEEE binary32 field masks (on the uint32 view).
_SIGN_MASK = np.uint32(0x8000_0000)
_ABS_MASK = np.uint32(0x7FFF_FFFF)
_EXP_MASK = np.uint32(0x7F80_0000)  # also the bit pattern of +Inf
_F32_QUIET_BIT = np.uint32(0x0040_0000)

# BF16 = the high 16 bits of a binary32. Round-to-nearest-even adds 0x7FFF plus the lowest kept
# bit, then truncates.
_BF16_SHIFT = np.uint32(16)
_BF16_HALF_ULP_MINUS_ONE = np.uint32(0x7FFF)
_BF16_QUIET_BIT = np.uint32(0x0040)  # the f32 quiet bit, seen in the high half

# TF32 keeps 10 explicit mantissa bits: the low 13 bits of the binary32 are dropped.
_TF32_DROPPED_BITS = 13
_TF32_HALF_ULP = np.uint32(1 << (_TF32_DROPPED_BITS - 1))  # 0x1000
_TF32_KEEP_MASK = np.uint32(0xFFFF_FFFF ^ ((1 << _TF32_DROPPED_BITS) - 1))  # 0xFFFFE000

GEMM_MODES = ("f32", "bf16", "tf32")


# --------------------------------------------------------------------------------------------
# Validation shared with the fast test entries (foxhunt.fast.kernels.dense).
# --------------------------------------------------------------------------------------------


def validate_add_bias_relu(y, b) -> None:
    """The argument checks of ``add_bias_relu`` and ``add_bias_relu_bf16``."""
    require_array("y", y, F32, ndim=2)
    require_array("b", b, F32, ndim=1)
    require_shape("b", b, (y.shape[1],), "[N] with N = y.shape[1]")


validate_add_bias_relu_bf16 = validate_add_bias_relu


def validate_relu_mask(dy, h) -> None:
    """The argument checks of ``relu_mask``."""
    require_array("dy", dy, F32, ndim=2)
    require_array("h", h, F32, ndim=2)
    require_shape("h", h, dy.shape, "dy.shape [M, N]")


#: ``relu_mask_bias_grad`` takes ``relu_mask``'s arguments (``bias_grad_reduce`` then checks
#: nothing more: ``dx`` is a float32 matrix by construction).
validate_relu_mask_bias_grad = validate_relu_mask


# --------------------------------------------------------------------------------------------
# Kernels.
# --------------------------------------------------------------------------------------------


@ieee
def add_bias_relu(y: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Bias + ReLU epilogue: ``out[i, n] = relu(y[i, n] + b[n])``.

    Shapes: ``y [M, N]`` float32 (the GEMM output), ``b [N]`` float32; returns ``[M, N]`` float32.
    The sum is one correctly rounded f32 add; the ReLU is the select ``t <= 0 ? 0 : t``
    (CUDA: ``out = (t <= 0.0f) ? 0.0f : t``, exact).

    NaN/Inf contract: NaN in ``y`` or ``b`` (or ``Inf + -Inf``) gives NaN (propagated, visible to
    the sentinels); ``+Inf`` stays ``+Inf``; ``-Inf`` and every ``t <= 0`` (``-0.0`` included)
    give ``+0.0``. Do not use ``fmaxf(t, 0)``: it maps NaN to 0.
    """
    validate_add_bias_relu(y, b)
    pre = y + b[np.newaxis, :]
    return np.where(pre <= 0, np.float32(0), pre).astype(F32, copy=False)


class BiasReluBf16(NamedTuple):
    """Outputs of ``add_bias_relu_bf16``: the f32 activation (kept for the backward ReLU mask)
    and its BF16 copy (uint16 bit patterns) that feeds the next BF16 GEMM."""

    out: np.ndarray
    out_bf16: np.ndarray


def add_bias_relu_bf16(y: np.ndarray, b: np.ndarray) -> BiasReluBf16:
    """``add_bias_relu`` fused with the BF16 cast: returns ``BiasReluBf16(out, out_bf16)``.

    ``out = add_bias_relu(y, b)`` (``[M, N]`` float32) and ``out_bf16 = f32_to_bf16(out)``
    (``[M, N]`` uint16, round-to-nearest-even). NaN/Inf: as ``add_bias_relu``, then as
    ``f32_to_bf16`` (a NaN stays a quiet NaN with its sign; ``+Inf`` stays ``+Inf``).
    """
    out = add_bias_relu(y, b)
    return BiasReluBf16(out=out, out_bf16=f32_to_bf16(out))


@ieee
def relu_mask(dy: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Backward through ReLU from the post-ReLU activation: ``dx = h <= 0 ? 0 : dy``.

    Shapes: ``dy [M, N]`` and ``h [M, N]`` float32; returns ``[M, N]`` float32. This is
    ``dy * (h > 0)`` for finite inputs, written as a select (exact; CUDA:
    ``dx = (h <= 0.0f) ? 0.0f : dy``) so that it matches the forward's NaN rule.

    NaN/Inf contract: where ``h <= 0`` the result is ``+0.0`` whatever ``dy`` holds (a NaN or Inf
    ``dy`` there is dropped, as in torch's ``threshold_backward``; a multiply would give NaN).
    Where ``h > 0`` or ``h`` is NaN, ``dy`` passes unchanged (NaN and Inf included).
    """
    validate_relu_mask(dy, h)
    return np.where(h <= 0, np.float32(0), dy).astype(F32, copy=False)


@ieee
def bias_grad_reduce(dy: np.ndarray) -> np.ndarray:
    """Bias gradient: column sums ``db[n] = sum_i dy[i, n]`` with float32 accumulation.

    Shapes: ``dy [M, N]`` float32; returns ``[N]`` float32. The summation order is not part of
    the contract (the fast kernel reduces in a tree); conformance uses the reduction tolerance.
    NaN/Inf contract: plain IEEE sums, no guard: a NaN in a column makes that column's sum NaN;
    ``+Inf`` and ``-Inf`` in one column give NaN.
    """
    require_array("dy", dy, F32, ndim=2)
    return np.sum(dy, axis=0, dtype=F32)


class ReluBiasGrad(NamedTuple):
    """Outputs of ``relu_mask_bias_grad``: the ReLU-masked gradient and its column sums."""

    dx: np.ndarray
    db: np.ndarray


def relu_mask_bias_grad(dy: np.ndarray, h: np.ndarray) -> ReluBiasGrad:
    """``relu_mask`` fused with ``bias_grad_reduce``: returns ``ReluBiasGrad(dx, db)`` with
    ``dx = relu_mask(dy, h)`` (``dx[i, n] = h[i, n] <= 0 ? 0 : dy[i, n]``) and
    ``db = bias_grad_reduce(dx)`` (``db[n] = sum_i dx[i, n]``, float32 accumulation).

    Shapes: ``dy [M, N]`` and ``h [M, N]`` float32; returns ``dx [M, N]`` and ``db [N]``
    float32. ``dx`` is exact (a select); ``db`` is a float32 reduction whose order is not part of
    the contract (conformance: reduction tolerance, as ``bias_grad_reduce``).

    NaN/Inf contract (the two kernels' contracts, composed): where ``h <= 0``, ``dx`` is ``+0.0``
    whatever ``dy`` holds (a NaN or Inf ``dy`` there is dropped and does not reach ``db``); where
    ``h > 0`` or ``h`` is NaN, ``dy`` passes unchanged into ``dx`` (NaN and Inf included). ``db``
    sums ``dx`` with plain IEEE adds, no guard: a NaN that passed the mask makes its column's sum
    NaN; a passed ``+Inf`` and ``-Inf`` in one column give NaN. (The fast kernel re-sums a column
    holding a non-finite or huge term row by row, as the reference does, so such columns get the
    reference's result exactly; see ``bias_grad_reduce``'s CUDA kernel.)
    """
    validate_relu_mask_bias_grad(dy, h)
    dx = relu_mask(dy, h)
    return ReluBiasGrad(dx=dx, db=bias_grad_reduce(dx))


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to BF16 (round to nearest, ties to even), returned as uint16 bit patterns.

    Shapes: ``x`` float32, any shape; returns uint16 of the same shape. Bit exact on the uint32
    view ``u``: ``(u + 0x7FFF + ((u >> 16) & 1)) >> 16``. Subnormals are rounded like any other
    value (no flush to zero); finite values at or above ``0x1.FFp127`` + half a BF16 ulp round to
    ``+/-Inf``, as round-to-nearest requires.

    NaN/Inf contract: ``+/-Inf`` stay ``+/-Inf``. A NaN stays NaN with its sign and the high
    payload bits kept and the quiet bit set: ``(u >> 16) | 0x0040`` (setting the bit also keeps
    a NaN whose payload sat only in the dropped low half from becoming Inf). Deliberate
    divergence: torch and CUDA's ``__float2bfloat16_rn`` return a canonical NaN (sign dropped);
    the fast kernel implements this bit formula instead, and NaN positions agree either way.
    """
    require_array("x", x, F32)
    u = x.view(U32)
    is_nan = (u & _ABS_MASK) > _EXP_MASK
    lowest_kept_bit = (u >> _BF16_SHIFT) & np.uint32(1)
    # uint32 wraps only for NaN patterns near 0xFFFFFFFF, which the select below discards.
    rounded = (u + _BF16_HALF_ULP_MINUS_ONE + lowest_kept_bit) >> _BF16_SHIFT
    quiet_nan = (u >> _BF16_SHIFT) | _BF16_QUIET_BIT
    return np.where(is_nan, quiet_nan, rounded).astype(U16)


def bf16_to_f32(u: np.ndarray) -> np.ndarray:
    """Widen BF16 bit patterns to float32 exactly: the pattern becomes the high half of the f32.

    Shapes: ``u`` uint16, any shape; returns float32 of the same shape. Exact for every pattern
    (NaN payloads and signs, Inf, subnormals, signed zeros).
    """
    require_array("u", u, U16)
    return (u.astype(U32) << _BF16_SHIFT).view(F32)


def tf32_round(x: np.ndarray) -> np.ndarray:
    """Round float32 to TF32 (10 explicit mantissa bits) as PTX ``cvt.rna.tf32.f32`` does.

    Shapes: ``x`` float32, any shape; returns float32 of the same shape whose low 13 bits are 0.
    Round to nearest, ties away from zero, on the uint32 view of a finite ``u``:
    ``(u + 0x1000) & 0xFFFFE000`` (the add on the magnitude bits rounds a tie up in magnitude;
    a carry moves into the exponent correctly; values within half a TF32 ulp of ``FLT_MAX``
    round to ``+/-Inf``). Subnormals are rounded on the same bit grid.

    NaN/Inf contract: ``+/-Inf`` unchanged; a NaN stays a quiet NaN with its sign and high
    payload bits, low 13 bits cleared: ``(u & 0xFFFFE000) | 0x00400000``.

    Note: cuBLAS's TF32 tensor-core path may truncate the low 13 bits instead of rounding;
    the conformance GEMM bound uses ``u_in = 2**-10`` for TF32 inputs, which covers both.
    """
    require_array("x", x, F32)
    u = x.view(U32)
    is_finite = (u & _EXP_MASK) != _EXP_MASK
    is_nan = (u & _ABS_MASK) > _EXP_MASK
    # uint32 wraps only for NaN patterns, which the selects below discard.
    rounded = (u + _TF32_HALF_ULP) & _TF32_KEEP_MASK
    quiet_nan = (u & _TF32_KEEP_MASK) | _F32_QUIET_BIT
    bits = np.where(is_finite, rounded, np.where(is_nan, quiet_nan, u))
    return bits.astype(U32).view(F32)


# --------------------------------------------------------------------------------------------
# GEMM emulation (cuBLAS does these on the fast path; not in KERNELS).
# --------------------------------------------------------------------------------------------


def round_for(x: np.ndarray, mode: str) -> np.ndarray:
    """The float32 values a GEMM in precision ``mode`` actually multiplies.

    ``"f32"``: ``x`` unchanged (a copy); ``"bf16"``: ``bf16_to_f32(f32_to_bf16(x))`` (RNE);
    ``"tf32"``: ``tf32_round(x)`` (ties away from zero). ``x`` float32, any shape.
    """
    require_array("x", x, F32)
    if mode == "f32":
        return x.copy()
    if mode == "bf16":
        return bf16_to_f32(f32_to_bf16(x))
    if mode == "tf32":
        return tf32_round(x)
    raise ValueError(f"mode: {mode!r} is not allowed; expected one of {GEMM_MODES}")


@ieee
def gemm(
    a: np.ndarray,
    b: np.ndarray,
    *,
    trans_a: bool = False,
    trans_b: bool = False,
    mode: str = "f32",
    rounded: bool = False,
) -> np.ndarray:
    """``C = op(a) @ op(b)`` on inputs rounded per ``mode``, float32 accumulation.

    ``rounded=True`` promises that ``a`` and ``b`` already are ``round_for(., mode)`` values
    (rounding is idempotent, so the result is the same; callers that reuse an operand in
    several GEMMs round it once).

    ``op(x)`` is ``x.T`` when the matching ``trans_*`` flag is set. Shapes: ``op(a) [M, K]``,
    ``op(b) [K, N]`` float32; returns ``C [M, N]`` float32. Inputs are rounded with
    ``round_for(., mode)`` and multiplied with ``np.matmul`` on float32 (BLAS SGEMM: float32
    products and sums; the order differs from cuBLAS, which the conformance bound covers).
    NaN/Inf contract: IEEE, as SGEMM computes (a NaN input poisons its row of C / column of C;
    ``Inf * 0`` gives NaN); rounding keeps NaN and Inf (see ``f32_to_bf16``, ``tf32_round``).
    """
    require_array("a", a, F32, ndim=2)
    require_array("b", b, F32, ndim=2)
    if mode not in GEMM_MODES:
        raise ValueError(f"mode: {mode!r} is not allowed; expected one of {GEMM_MODES}")
    op_a = a.T if trans_a else a
    op_b = b.T if trans_b else b
    if op_a.shape[1] != op_b.shape[0]:
        raise ValueError(
            f"b: op(b) has shape {op_b.shape} but op(a) has shape {op_a.shape}; "
            f"the inner dimensions (K) must match"
        )
    if rounded:
        out = np.matmul(op_a, op_b)
    else:
        out = np.matmul(round_for(np.ascontiguousarray(op_a), mode),
                        round_for(np.ascontiguousarray(op_b), mode))
    return out.astype(F32, copy=False)


def validate_gemm_tf32(a, b, h, trans_a) -> tuple[int, int, int]:
    """The argument checks of ``gemm_tf32`` and ``gemm_f32``; returns ``(m, n, k)``."""
    require_array("a", a, F32, ndim=2)
    require_array("b", b, F32, ndim=2)
    if not isinstance(trans_a, (bool, np.bool_)):
        raise TypeError(f"trans_a: expected a bool, got {type(trans_a).__name__}")
    k, m = a.shape if trans_a else a.shape[::-1]
    if b.shape[0] != k:
        raise ValueError(f"b: shape {b.shape} but op(a) is [{m}, {k}]; expected [K, N] with "
                         f"K = {k}")
    n = b.shape[1]
    if h is not None:
        require_array("h", h, F32, ndim=2)
        require_shape("h", h, (m, n), "[M, N], op(a) @ b's shape")
    return m, n, k


def gemm_tf32(a: np.ndarray, b: np.ndarray, h: np.ndarray | None = None, *,
              trans_a: bool = False) -> np.ndarray:
    """The backward's TF32 GEMM with the ReLU mask as its optional epilogue (the CUDA kernel
    ``gemm_tf32``): ``c = gemm(a, b, trans_a=trans_a, mode="tf32")``, then with ``h``
    ``relu_mask(c, h)``. A composition of the two, so a plan that runs it in place of a TF32 GEMM
    and a ``relu_mask`` computes the same bits on the CPU.

    Shapes: ``a [M, K]`` (``trans_a``: ``[K, M]``), ``b [K, N]``, ``h [M, N]`` float32; returns
    ``[M, N]`` float32. NaN/Inf contract: ``gemm``'s (IEEE, the TF32 rounding keeps NaN and Inf),
    then ``relu_mask``'s (``h <= 0`` gives ``+0.0`` whatever the product; a NaN ``h`` passes it).
    """
    return _masked_gemm(a, b, h, trans_a, "tf32")


def gemm_f32(a: np.ndarray, b: np.ndarray, h: np.ndarray | None = None, *,
             trans_a: bool = False) -> np.ndarray:
    """``gemm_tf32``'s exact-f32 twin (the CUDA kernel ``gemm_f32``, the f32 precision's
    backward): ``c = gemm(a, b, trans_a=trans_a, mode="f32")``, then with ``h`` ``relu_mask(c,
    h)``. Shapes and NaN/Inf contract as ``gemm_tf32`` (no rounding of the operands)."""
    return _masked_gemm(a, b, h, trans_a, "f32")


def _masked_gemm(a, b, h, trans_a, mode: str) -> np.ndarray:
    """``gemm(a, b, trans_a=trans_a, mode=mode)``, then with ``h`` ``relu_mask(c, h)``: the
    composition ``gemm_tf32`` and ``gemm_f32`` are."""
    validate_gemm_tf32(a, b, h, trans_a)
    c = gemm(a, b, trans_a=bool(trans_a), mode=mode)
    return c if h is None else relu_mask(c, h)


KERNELS = {
    "add_bias_relu": add_bias_relu,
    "add_bias_relu_bf16": add_bias_relu_bf16,
    "relu_mask": relu_mask,
    "bias_grad_reduce": bias_grad_reduce,
    "relu_mask_bias_grad": relu_mask_bias_grad,
    "f32_to_bf16": f32_to_bf16,
    "bf16_to_f32": bf16_to_f32,
    "tf32_round": tf32_round,
    "gemm_tf32": gemm_tf32,
    "gemm_f32": gemm_f32,
}
