"""Entries of the spectral-norm kernels: one power iteration on one weight matrix and on every
weight matrix in one launch (SPEC 8: rtol 1e-5 on sigma, u, v, W); and graph 2's optimiser chain
in one launch (Adam, the batched spectral norm, Polyak with the BF16 mirrors): its parameters
under the spectral norm's bound, the moments under Adam's, the mirrors bit for bit where the
bound on their source cannot move a BF16 rounding.
"""

from __future__ import annotations

import dataclasses

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
    u16,
    uniform,
    wrong_dtype,
)
from foxhunt.conformance.specs.trunk import ALL_BITS, BITS
from foxhunt.conformance.tolerance import (
    REDUCTION,
    REDUCTION_ATOL_PER_ELEM,
    REDUCTION_RTOL,
    Tolerance,
)
from foxhunt.reference.kernels.dense import f32_to_bf16


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


def _s_fused(d: Dims, rng) -> Kwargs:
    """The batched entry's three matrices laid out in one parameter buffer, each followed by a
    tail (a bias and padding) as in the step's layout; Adam reaches halfway into the last
    matrix, so a cluster has elements with and without Adam."""
    dims = [(d.w_out, d.w_in), (d.w_in, d.w_out), (max(d.w_out // 2, 1), d.w_in + 3)]
    shapes, at = [], 0
    for rows, cols in dims:
        shapes.append((at, rows, cols))
        at += rows * cols + rows + 5
    n = at
    n_adam = shapes[-1][0] + dims[-1][0] * dims[-1][1] // 2
    return {"param": normal(rng, n, 0.3), "grad": normal(rng, n, 0.01),
            "m": normal(rng, n, 1e-3), "v": uniform(rng, n, 0.0, 1e-4),
            "target": normal(rng, n, 0.3), "us": [_unit(rng, r) for r, _ in dims],
            "vs": [_unit(rng, c) for _, c in dims], "shapes": shapes, "n_adam": n_adam,
            "step": 3, "lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
            "weight_decay": 0.01, "grad_scale": F32(0.8), "weight_clamp": F32(100.0),
            "sigma_max": 3.0, "tau": F32(0.005)}


def _free_bf16(x: np.ndarray, tol: np.ndarray) -> np.ndarray:
    """The BF16 bits of ``x``'s mirror that a value within ``tol`` of ``x`` may change."""
    x64 = x.astype(np.float64)
    with np.errstate(all="ignore"):
        lo, hi = ((x64 + sign * tol).astype(F32) for sign in (-1.0, 1.0))
        moved = np.isfinite(x) & (f32_to_bf16(lo) != f32_to_bf16(hi))
    return np.where(moved, ALL_BITS, 0)


def _sc_fused(kwargs, expected):
    """Parameters and target under the spectral norm's bound (the longest matrix's two
    mat-vecs; the target takes ``tau`` times the parameters' difference, within it); the
    moments under Adam's; each mirror's bits free where that bound straddles a rounding."""
    length = max(rows + cols for _, rows, cols in kwargs["shapes"])
    out, tols = {}, {}
    for name in ("param", "target"):
        x = expected[name]
        mag = maxabs(expected["param"], x)
        out[name] = reduction(length, mag)
        tols[name] = (REDUCTION_RTOL * np.abs(x.astype(np.float64))
                      + REDUCTION_ATOL_PER_ELEM * length * mag)
    out["online_bf16"] = {"free_bits": _free_bf16(expected["param"], tols["param"])}
    out["target_bf16"] = {"free_bits": _free_bf16(expected["target"], tols["target"])}
    with np.errstate(all="ignore"):
        skipped = ~np.isfinite(kwargs["grad"] * F32(kwargs["grad_scale"]))
    n_adam = kwargs["n_adam"]
    skipped[n_adam:] = True  # past Adam's range the moments are returned as they are
    out["m"] = out["v"] = {"exact": skipped}
    for k, (_, rows, cols) in enumerate(kwargs["shapes"]):
        out[f"us[{k}]"] = reduction(rows + cols, maxabs(expected[f"us[{k}]"]))
        out[f"vs[{k}]"] = reduction(rows + cols, maxabs(expected[f"vs[{k}]"]))
        out[f"sigmas[{k}]"] = reduction(rows + cols, maxabs(expected[f"sigmas[{k}]"]))
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
    SpecEntry(
        name="adam_spectral_polyak",
        outputs={
            "param": f32(REDUCTION),
            "m": f32(Tolerance.ulp(2)),
            "v": f32(Tolerance.ulp(2)),
            "target": f32(REDUCTION),
            "online_bf16": u16(BITS),
            "target_bf16": u16(BITS),
            "us": f32(REDUCTION),
            "vs": f32(REDUCTION),
            "sigmas": f32(REDUCTION),
        },
        sample=_s_fused,
        targets=("param", "grad", "m", "target", "us"),
        errors=error_cases(
            _s_fused,
            lambda k: replace(k, n_adam=k["param"].size + 1),
            lambda k: replace(k, shapes=[(1, *k["shapes"][0][1:]), *k["shapes"][1:]]),
            lambda k: replace(k, shapes=[k["shapes"][0], (0, *k["shapes"][1][1:]),
                                         *k["shapes"][2:]]),
            lambda k: replace(k, target=k["target"][:-1]),
            lambda k: replace(k, vs=k["vs"][:-1]),
            lambda k: replace(k, tau=1.5),
            lambda k: replace(k, step=0),
            lambda k: wrong_dtype(k, "m"),
        ),
        scales=_sc_fused,
    ),
)

# The pointer variant (tau read from device memory, graph-fed by the ISV): the same kernel body,
# so the same samples, tolerances and error cases.
ENTRIES += tuple(dataclasses.replace(e, name="adam_spectral_polyak_ptr") for e in ENTRIES
                 if e.name == "adam_spectral_polyak")
