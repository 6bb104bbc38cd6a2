"""Entries of the spectral-norm kernels: one power iteration on one weight matrix and on every
weight matrix in one launch (SPEC 8: rtol 1e-5 on sigma, u, v, W).
"""

from __future__ import annotations

import numpy as np

from foxhunt.conformance.kernel_spec import Dims, Kwargs, SpecEntry
from foxhunt.conformance.specs.inputs import (
    F32,
    error_cases,
    f32,
    maxabs,
    normal,
    reduction,
    replace,
    wrong_dtype,
)
from foxhunt.conformance.tolerance import REDUCTION


def _unit(rng, n: int) -> np.ndarray:
    x = rng.standard_normal(n)
    return (x / np.linalg.norm(x)).astype(F32)


def _s_spectral(d: Dims, rng) -> Kwargs:
    return {"w": normal(rng, (d.w_out, d.w_in), 0.3), "u": _unit(rng, d.w_out), "v": _unit(rng, d.w_in),
            "sigma_max": 3.0}


def _s_batched(d: Dims, rng) -> Kwargs:
    shapes = [(d.w_out, d.w_in), (d.w_in, d.w_out), (max(d.w_out // 2, 1), d.w_in + 3)]
    return {"ws": [normal(rng, s, 0.3) for s in shapes], "us": [_unit(rng, s[0]) for s in shapes],
            "vs": [_unit(rng, s[1]) for s in shapes], "sigma_max": 3.0}


def _spectral_scale(w, sigma_max, expected_w, expected_u, expected_v, sigma) -> dict:
    """Two chained mat-vecs and norms (length out + in); an unscaled W is copied bit for bit."""
    length = sum(w.shape)
    unscaled = not bool(np.asarray(sigma) > F32(sigma_max))
    return {"w": {**reduction(length, maxabs(expected_w)), "exact": unscaled},
            "u": reduction(length, maxabs(expected_u)), "v": reduction(length, maxabs(expected_v)),
            "sigma": reduction(length, maxabs(sigma))}


def _sc_spectral(kwargs, expected):
    return _spectral_scale(kwargs["w"], kwargs["sigma_max"], expected["w"], expected["u"],
                           expected["v"], expected["sigma"])


def _sc_batched(kwargs, expected):
    out = {}
    for k, w in enumerate(kwargs["ws"]):
        one = _spectral_scale(w, kwargs["sigma_max"], expected[f"ws[{k}]"], expected[f"us[{k}]"],
                              expected[f"vs[{k}]"], expected[f"sigmas[{k}]"])
        for name, plural in (("w", "ws"), ("u", "us"), ("v", "vs"), ("sigma", "sigmas")):
            out[f"{plural}[{k}]"] = one[name]
    return out


ENTRIES: tuple[SpecEntry, ...] = (
    # spectral: SPEC 8, rtol 1e-5 on sigma, u, v, W
    SpecEntry(
        name="spectral_norm",
        outputs={
            "w": f32(REDUCTION),
            "u": f32(REDUCTION),
            "v": f32(REDUCTION),
            "sigma": f32(REDUCTION),
        },
        sample=_s_spectral,
        targets=("w", "u", "v"),
        errors=error_cases(
            _s_spectral,
            lambda k: replace(k, u=k["u"][:-1]),
            lambda k: replace(k, sigma_max=0.0),
            lambda k: wrong_dtype(k, "w"),
        ),
        scales=_sc_spectral,
    ),
    SpecEntry(
        name="batched_spectral_norm",
        outputs={
            "ws": f32(REDUCTION),
            "us": f32(REDUCTION),
            "vs": f32(REDUCTION),
            "sigmas": f32(REDUCTION),
        },
        sample=_s_batched,
        targets=("ws", "us", "vs"),
        errors=error_cases(
            _s_batched,
            lambda k: replace(k, us=k["us"][:-1]),
            lambda k: replace(k, ws=[]),
            lambda k: replace(k, sigma_max=-3.0),
        ),
        scales=_sc_batched,
    ),
)
