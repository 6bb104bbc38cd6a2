"""Entries of the dense kernels: bias + ReLU (and its BF16 copy), the ReLU mask and bias
gradients of the backward, the BF16/TF32 casts, and the backward's GEMMs with their optional ReLU
mask: ``gemm_tf32`` (both paths multiply the operands' ``tf32_round`` values exactly, so it is
judged by the GEMM policy without input-rounding slack, ``GEMM_TOLERANCES["f32"]``, on those
values, as the BF16 kernels on their BF16 operands) and ``gemm_f32``, its exact-f32 twin (the same
policy on the operands themselves); the elements the mask zeroes bit for bit. Their shape cases
give ``m, k, n = batch, hidden, w_out``, ``trans_a`` in the seed and odd cases, no mask in the seed
case.
"""

from __future__ import annotations

import numpy as np

from foxhunt.conformance.kernel_spec import Dims, Kwargs, SpecEntry
from foxhunt.conformance.specs.inputs import (
    F32,
    bits_f32,
    error_cases,
    f32,
    normal,
    product_overflow,
    reduction,
    replace,
    u16,
    uniform,
    wrong_dtype,
)
from foxhunt.conformance.tolerance import EXACT, GEMM_TOLERANCES, REDUCTION, Tolerance
from foxhunt.reference.kernels.dense import tf32_round


def _s_bias(d: Dims, rng) -> Kwargs:
    return {"y": normal(rng, (d.batch, d.hidden)), "b": normal(rng, d.hidden, 0.5)}


def _s_relu_mask(d: Dims, rng) -> Kwargs:
    h = np.where(rng.random((d.batch, d.hidden)) < 0.5, F32(0), uniform(rng, (d.batch, d.hidden), 0.01, 2))
    return {"dy": normal(rng, (d.batch, d.hidden)), "h": h.astype(F32)}


def _s_dy(d: Dims, rng) -> Kwargs:
    return {"dy": normal(rng, (d.batch, d.hidden))}


def _s_bits(d: Dims, rng) -> Kwargs:
    return {"x": bits_f32(rng, (d.batch, d.hidden))}


def _s_bf16(d: Dims, rng) -> Kwargs:
    return {"u": rng.integers(0, 2**16, size=(d.batch, d.hidden), dtype=np.uint32).astype(np.uint16)}


def _s_backward_gemm(d: Dims, rng) -> Kwargs:
    m, k, n = d.batch, d.hidden, d.w_out
    trans_a = d.case in ("seed", "odd")
    a = normal(rng, (k, m) if trans_a else (m, k))
    h = None if d.case == "seed" else np.where(rng.random((m, n)) < 0.5, F32(0),
                                               uniform(rng, (m, n), 0.01, 2)).astype(F32)
    return {"a": a, "b": normal(rng, (k, n), 1.0 / np.sqrt(k)), "h": h, "trans_a": trans_a}


def _backward_gemm_scales(rounding):
    """The GEMM policy's operands, ``rounding(op(a))`` and ``rounding(b)`` (what both paths
    multiply: ``tf32_round``'s values for ``gemm_tf32``, the operands themselves for
    ``gemm_f32``); the mask's zeros (``h <= 0``) exact; ``overflow`` where the finite products'
    magnitudes add up past float32's range (then whether a partial sum overflows depends on the
    order: not a contract; ``tf32_round`` takes float32's largest values to +/-Inf, so the TF32
    products of the extremal cases never get there)."""
    def scales(kwargs, expected):
        a = rounding(np.ascontiguousarray(kwargs["a"].T if kwargs["trans_a"] else kwargs["a"]))
        b = rounding(kwargs["b"])
        h = kwargs["h"]
        with np.errstate(invalid="ignore"):
            exact = np.zeros(expected["out"].shape, bool) if h is None else h <= 0
        return {"out": {"a": a, "b": b, "exact": exact, "overflow": product_overflow(a, b) & ~exact}}
    return scales


def _backward_gemm_entry(name: str, rounding) -> SpecEntry:
    return SpecEntry(
        name=name,
        outputs={"out": f32(GEMM_TOLERANCES["f32"])},
        sample=_s_backward_gemm,
        targets=("a", "b", "h"),
        errors=lambda rng: (
            error_cases(
                _s_backward_gemm,
                lambda k: replace(k, b=k["b"][:-1]),
                lambda k: replace(k, h=k["h"][:, :-1]),
                lambda k: wrong_dtype(k, "a"),
                lambda k: wrong_dtype(k, "h"),
                lambda k: replace(k, a=k["a"][0]),
            )(rng)
            + error_cases(_s_backward_gemm, lambda k: replace(k, trans_a=1), exc=TypeError)(rng)
        ),
        scales=_backward_gemm_scales(rounding),
    )


def _sc_bias_grad(kwargs, expected):
    dy = kwargs["dy"]
    return {"out": reduction(dy.shape[0], np.max(np.where(np.isfinite(dy), np.abs(dy), 0), axis=0))}


def _sc_relu_mask_bias_grad(kwargs, expected):
    """db sums the masked gradient (the exact output dx): bias_grad_reduce's scales on dx."""
    return {"db": _sc_bias_grad({"dy": expected["dx"]}, None)["out"]}


ENTRIES: tuple[SpecEntry, ...] = (
    # dense: one correctly rounded add / select / cast per element -> exact
    SpecEntry(
        name="add_bias_relu",
        outputs={"out": f32(EXACT)},
        sample=_s_bias,
        targets=("y", "b"),
        errors=error_cases(
            _s_bias,
            lambda k: replace(k, b=k["b"][:-1]),
            lambda k: wrong_dtype(k, "y"),
            lambda k: replace(k, y=k["y"][0]),
        ),
    ),
    # The BF16 copy of a NaN sum carries the GPU's canonical NaN payload: positions must match.
    SpecEntry(
        name="add_bias_relu_bf16",
        outputs={
            "out": f32(EXACT),
            "out_bf16": u16(Tolerance.exact(bitwise=True, nan_payload=False)),
        },
        sample=_s_bias,
        targets=("y", "b"),
        errors=error_cases(
            _s_bias,
            lambda k: replace(k, b=k["b"][:-1]),
            lambda k: wrong_dtype(k, "b"),
        ),
    ),
    SpecEntry(
        name="relu_mask",
        outputs={"out": f32(EXACT)},
        sample=_s_relu_mask,
        targets=("dy", "h"),
        errors=error_cases(
            _s_relu_mask,
            lambda k: replace(k, h=k["h"][:, :-1]),
            lambda k: wrong_dtype(k, "dy"),
        ),
    ),
    SpecEntry(
        name="bias_grad_reduce",
        outputs={"out": f32(REDUCTION)},
        sample=_s_dy,
        targets=("dy",),
        errors=error_cases(
            _s_dy,
            lambda k: wrong_dtype(k, "dy"),
            lambda k: replace(k, dy=k["dy"][0]),
        ),
        scales=_sc_bias_grad,
    ),
    # fused relu_mask + bias_grad_reduce: their tolerances per output
    SpecEntry(
        name="relu_mask_bias_grad",
        outputs={"dx": f32(EXACT), "db": f32(REDUCTION)},
        sample=_s_relu_mask,
        targets=("dy", "h"),
        errors=error_cases(
            _s_relu_mask,
            lambda k: replace(k, h=k["h"][:, :-1]),
            lambda k: wrong_dtype(k, "dy"),
            lambda k: replace(k, dy=k["dy"][0], h=k["h"][0]),
        ),
        scales=_sc_relu_mask_bias_grad,
    ),
    SpecEntry(
        name="f32_to_bf16",
        outputs={"out": u16(Tolerance.exact(bitwise=True))},
        sample=_s_bits,
        targets=("x",),
        errors=error_cases(
            _s_bits,
            lambda k: wrong_dtype(k, "x"),
        ),
        finite_sample=False,
    ),
    SpecEntry(
        name="bf16_to_f32",
        outputs={"out": f32(Tolerance.exact(bitwise=True))},
        sample=_s_bf16,
        targets=("u",),
        errors=error_cases(
            _s_bf16,
            lambda k: replace(k, u=k["u"].astype(np.int32)),
        ),
        finite_sample=False,
    ),
    SpecEntry(
        name="tf32_round",
        outputs={"out": f32(Tolerance.exact(bitwise=True))},
        sample=_s_bits,
        targets=("x",),
        errors=error_cases(
            _s_bits,
            lambda k: wrong_dtype(k, "x"),
        ),
        finite_sample=False,
    ),
    _backward_gemm_entry("gemm_tf32", tf32_round),
    _backward_gemm_entry("gemm_f32", lambda x: np.asarray(x, F32)),
)
