"""Entries of the dense kernels: bias + ReLU (and its BF16 copy), the ReLU mask and bias
gradients of the backward, and the BF16/TF32 casts.
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
    reduction,
    replace,
    u16,
    uniform,
    wrong_dtype,
)
from foxhunt.conformance.tolerance import EXACT, REDUCTION, Tolerance


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
)
