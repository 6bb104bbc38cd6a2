"""Entries of the optimiser kernels: gradient norms (one pass and two-phase), the clips and
guarded SAXPYs of the budget pipeline, Adam, and the Polyak update with its BF16 mirrors (and
with the sentinel check of its result).
"""

from __future__ import annotations

import dataclasses

import math

import numpy as np

from foxhunt.conformance.kernel_spec import Dims, Kwargs, SpecEntry, no_overflow
from foxhunt.conformance.specs.inputs import (
    F32,
    all_of,
    error_cases,
    f32,
    finite_outputs,
    i32,
    maxabs,
    norm_sq,
    normal,
    reduction,
    replace,
    sq_mag,
    u16,
    unchanged_where_nonfinite,
    uniform,
    wrong_dtype,
)
from foxhunt.conformance.tolerance import EXACT, REDUCTION, Tolerance
from foxhunt.reference.kernels.optim import data_clip_scale, grad_norm_final


def _s_vec(d: Dims, rng) -> Kwargs:
    return {"x": normal(rng, d.flat, 0.1)}


def _s_partial(d: Dims, rng) -> Kwargs:
    return {"x": normal(rng, d.flat, 0.1), "block_size": 256}


def _s_final(d: Dims, rng) -> Kwargs:
    return {"partials": uniform(rng, -(-d.flat // 256), 0.0, 3.0)}


def _s_clip(d: Dims, rng) -> Kwargs:
    x = normal(rng, d.flat, 0.1)
    ns = norm_sq(x)
    return {"x": x, "max_norm": F32(0.5 * math.sqrt(ns)), "norm_sq": ns}


def _s_saxpy(d: Dims, rng) -> Kwargs:
    return {"y": normal(rng, d.flat), "x": normal(rng, d.flat, 0.1), "a": F32(0.3)}


def _s_clipped_saxpy(d: Dims, rng) -> Kwargs:
    x = normal(rng, d.flat, 0.1)
    ns = norm_sq(x)
    return {"y": normal(rng, d.flat), "x": x, "a": F32(0.7), "max_norm": F32(0.5 * math.sqrt(ns)),
            "norm_sq": ns}


def _s_adam(d: Dims, rng) -> Kwargs:
    return {"param": normal(rng, d.flat, 0.1), "grad": normal(rng, d.flat, 0.01),
            "m": normal(rng, d.flat, 1e-3), "v": uniform(rng, d.flat, 0.0, 1e-4),
            "step": 3, "lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
            "weight_decay": 0.01, "grad_scale": F32(0.8), "weight_clamp": F32(100.0)}


def _s_adam_norm(d: Dims, rng) -> Kwargs:
    """``_s_adam`` with its scale from the total norm's partials: whole numbers (every order of
    their sum is exact, so the kernel's tree and the twin's pairwise sum agree) whose total puts
    the gradient over its bound (the clip acts)."""
    kw = {k: v for k, v in _s_adam(d, rng).items() if k != "grad_scale"}
    partials = rng.integers(0, 1000, 71 if d.case == "seed" else 5).astype(F32)
    return {**kw, "total_partials": partials,
            "clip_bound": F32(0.6 * math.sqrt(float(partials.sum())))}


#: Adam's outputs and bounds (both Adam kernels).
_ADAM_OUTPUTS = {"param": f32(Tolerance.ulp(4)), "m": f32(Tolerance.ulp(2)),
                 "v": f32(Tolerance.ulp(2))}


def _s_polyak(d: Dims, rng) -> Kwargs:
    return {"target": normal(rng, d.flat, 0.1), "online": normal(rng, d.flat, 0.1), "tau": F32(0.005)}


def _s_polyak_check(d: Dims, rng) -> Kwargs:
    """Graph 2's post-Polyak check: all of online, all of the new target, two thresholded
    ranges of online (a low threshold that fires on these samples, a high one that does not),
    a None entry and a flag already set."""
    n = d.flat
    split = n // 3
    return {**_s_polyak(d, rng),
            "entries": [("online", 0, n), None, ("target", 0, n), ("online", 0, split),
                        ("online", split, n - split)],
            "flags": np.array([0, 1, 0, 0, 0], dtype=np.int32),
            "thresholds": np.array([0.0, 0.0, 0.0, 0.2, 100.0], dtype=F32)}


def _polyak_errors(sample, *more):
    """The Polyak kernels' error cases: a tau outside [0, 1], a short ``online``, then ``more``."""
    return error_cases(sample, lambda k: replace(k, tau=1.5),
                       lambda k: replace(k, online=k["online"][:-1]), *more)


def _norm_partials(x: np.ndarray, segment: int) -> np.ndarray:
    """Phase-1 norm partials of ``x`` (finite squares per ``segment``, float64 sums)."""
    return np.array([norm_sq(x[k:k + segment]) for k in range(0, x.size, segment)], dtype=F32)


def _s_clip_saxpy_partial(d: Dims, rng) -> Kwargs:
    """The step's budget tail: both components over their budgets (both clips act), their
    norms given as phase-1 partials; the seed case uses the step's 4096-element norm segments,
    the others 256 (many segments, tails)."""
    seg = 4096 if d.case == "seed" else 256
    base, inject = normal(rng, d.flat, 0.1), normal(rng, d.flat, 0.1)
    base_sq, inject_sq = norm_sq(base), norm_sq(inject)
    return {"base": base, "inject": inject, "base_max_norm": F32(0.7 * math.sqrt(base_sq)),
            "base_partials": _norm_partials(base, seg), "a": F32(1.0),
            "inject_max_norm": F32(0.15 * math.sqrt(inject_sq)),
            "inject_partials": _norm_partials(inject, seg), "block_size": seg}


def _sc_guarded_saxpy(kwargs, expected):
    """Where ``x`` is non-finite, ``y`` is kept bit for bit."""
    return {"out": {"exact": ~np.isfinite(kwargs["x"])}}


def _sc_adam(kwargs, expected):
    """An element whose scaled gradient is non-finite is returned bit for bit."""
    with np.errstate(all="ignore"):
        skipped = ~np.isfinite(kwargs["grad"] * F32(kwargs["grad_scale"]))
    return {name: {"exact": skipped} for name in ("param", "m", "v")}


def _sc_adam_norm(kwargs, expected):
    """``_sc_adam`` at the scale the twin computes from the partials."""
    scale = data_clip_scale(grad_norm_final(kwargs["total_partials"]), kwargs["clip_bound"])
    return _sc_adam({**kwargs, "grad_scale": scale}, expected)


def _sc_norm(kwargs, expected):
    return {"out": reduction(kwargs["x"].size, sq_mag(kwargs["x"]))}


def _sc_partial(kwargs, expected):
    return {"out": reduction(kwargs["block_size"], sq_mag(kwargs["x"]))}


def _sc_final(kwargs, expected):
    return {"out": reduction(kwargs["partials"].size, maxabs(kwargs["partials"]))}


def _clip_factor64(norm_sq: float, max_norm: float) -> float:
    """``clip_scale`` in float64 (for bounds): NaN norm 1, +Inf norm 0."""
    n = math.sqrt(max(float(norm_sq), 0.0)) if not math.isnan(norm_sq) else 0.0
    return float(max_norm) / n if n > max_norm and n > 0 else 1.0


def _sc_clip_saxpy_partial(kwargs, expected):
    """The norms sum ``P`` partials (``grad_norm_final``); ``out_i = c_i + a y_i s_i`` with
    clip factors from those norms, which the two sides round differently: each factor is off
    by up to ~``P`` roundings, so ``out_i`` by that much of its terms ``|c_i| + |a y_i s_i|``
    (finite ones); ``partials`` sum ``block_size`` squares."""
    count = kwargs["base_partials"].size
    s_b = _clip_factor64(expected["base_norm_sq"], kwargs["base_max_norm"])
    s_i = _clip_factor64(expected["inject_norm_sq"], kwargs["inject_max_norm"])
    base64 = np.abs(kwargs["base"].astype(np.float64)) * s_b
    inject64 = np.abs(kwargs["inject"].astype(np.float64) * float(kwargs["a"])) * s_i
    terms = (np.where(np.isfinite(base64), base64, 0.0)
             + np.where(np.isfinite(inject64), inject64, 0.0))
    return {"out": reduction(count + 2, terms),
            "partials": reduction(kwargs["block_size"], sq_mag(expected["out"])),
            "base_norm_sq": reduction(count, maxabs(kwargs["base_partials"])),
            "inject_norm_sq": reduction(count, maxabs(kwargs["inject_partials"]))}


ENTRIES: tuple[SpecEntry, ...] = (
    # optim: norms are reductions; elementwise updates allow re-associated roundings
    SpecEntry(
        name="grad_norm_sq",
        outputs={"out": f32(REDUCTION)},
        sample=_s_vec,
        targets=("x",),
        errors=error_cases(
            _s_vec,
            lambda k: wrong_dtype(k, "x"),
        ),
        scales=_sc_norm,
        contract=finite_outputs("out", when=no_overflow),
    ),
    SpecEntry(
        name="grad_norm_partial",
        outputs={"out": f32(REDUCTION)},
        sample=_s_partial,
        targets=("x",),
        errors=error_cases(
            _s_partial,
            lambda k: replace(k, block_size=0),
            lambda k: wrong_dtype(k, "x"),
        ),
        scales=_sc_partial,
    ),
    SpecEntry(
        name="grad_norm_final",
        outputs={"out": f32(REDUCTION)},
        sample=_s_final,
        targets=("partials",),
        errors=error_cases(
            _s_final,
            lambda k: wrong_dtype(k, "partials"),
        ),
        scales=_sc_final,
    ),
    SpecEntry(
        name="clip_grad_inplace",
        outputs={"out": f32(Tolerance.ulp(2))},
        sample=_s_clip,
        targets=("x",),
        errors=error_cases(
            _s_clip,
            lambda k: replace(k, max_norm=-1.0),
            lambda k: wrong_dtype(k, "x"),
        ),
    ),
    SpecEntry(
        name="saxpy",
        outputs={"out": f32(Tolerance.ulp(1))},
        sample=_s_saxpy,
        targets=("y", "x"),
        errors=error_cases(
            _s_saxpy,
            lambda k: replace(k, x=k["x"][:-1]),
            lambda k: wrong_dtype(k, "y"),
        ),
        scales=_sc_guarded_saxpy,
        contract=unchanged_where_nonfinite("out", "x", "y"),
    ),
    SpecEntry(
        name="clipped_saxpy",
        outputs={"out": f32(Tolerance.ulp(2))},
        sample=_s_clipped_saxpy,
        targets=("y", "x"),
        errors=error_cases(
            _s_clipped_saxpy,
            lambda k: replace(k, x=k["x"][:-1]),
            lambda k: replace(k, max_norm=-1.0),
        ),
        scales=_sc_guarded_saxpy,
        contract=unchanged_where_nonfinite("out", "x", "y"),
    ),
    # fused budget tail: grad_norm_final's norms; out is clipped_saxpy's given the norms, but
    # its clip factors come from norms summed in another order (reduction over the partials);
    # grad_norm_partial's partials
    SpecEntry(
        name="clip_saxpy_norm_partial",
        outputs={
            "out": f32(REDUCTION),
            "partials": f32(REDUCTION),
            "base_norm_sq": f32(REDUCTION),
            "inject_norm_sq": f32(REDUCTION),
        },
        sample=_s_clip_saxpy_partial,
        targets=("base", "inject", "base_partials", "inject_partials"),
        errors=error_cases(
            _s_clip_saxpy_partial,
            lambda k: replace(k, inject=k["inject"][:-1]),
            lambda k: replace(k, base_max_norm=-1.0),
            lambda k: replace(k, block_size=0),
            lambda k: wrong_dtype(k, "base"),
            lambda k: replace(k, base=k["base"].reshape(5, -1), inject=k["inject"].reshape(5, -1)),
            lambda k: wrong_dtype(k, "base_partials"),
            lambda k: replace(k, inject_partials=k["inject_partials"][:-1]),
            lambda k: replace(k, base_partials=k["base_partials"][None, :]),
        ),
        scales=_sc_clip_saxpy_partial,
        contract=finite_outputs("partials", when=no_overflow),
    ),
    SpecEntry(
        name="adam_update",
        outputs=_ADAM_OUTPUTS,
        sample=_s_adam,
        targets=("param", "grad", "m", "v", "grad_scale"),
        errors=error_cases(
            _s_adam,
            lambda k: replace(k, step=0),
            lambda k: replace(k, grad=k["grad"][:-1]),
            lambda k: replace(k, beta1=1.0),
            lambda k: wrong_dtype(k, "m"),
        ),
        scales=_sc_adam,
        contract=all_of(finite_outputs("param"), unchanged_where_nonfinite("param", "grad", "param")),
    ),
    # adam_update with grad_norm_final + clip_scale (step_scalars' safety_scale) in front
    SpecEntry(
        name="adam_update_norm",
        outputs=_ADAM_OUTPUTS,
        sample=_s_adam_norm,
        targets=("param", "grad", "m", "v", "total_partials", "clip_bound"),
        errors=error_cases(
            _s_adam_norm,
            lambda k: replace(k, step=0),
            lambda k: replace(k, grad=k["grad"][:-1]),
            lambda k: replace(k, total_partials=k["total_partials"][None, :]),
            lambda k: wrong_dtype(k, "total_partials"),
        ),
        scales=_sc_adam_norm,
        contract=all_of(finite_outputs("param"), unchanged_where_nonfinite("param", "grad", "param")),
    ),
    SpecEntry(
        name="polyak_update",
        outputs={"out": f32(Tolerance.ulp(2))},
        sample=_s_polyak,
        targets=("target", "online"),
        errors=_polyak_errors(_s_polyak),
    ),
    # fused Polyak + BF16 mirrors: the mirror of a NaN blend carries the GPU's canonical NaN
    SpecEntry(
        name="polyak_update_mirror",
        outputs={
            "target": f32(Tolerance.ulp(2)),
            "online_bf16": u16(Tolerance.exact(bitwise=True)),
            "target_bf16": u16(Tolerance.exact(bitwise=True, nan_payload=False)),
        },
        sample=_s_polyak,
        targets=("target", "online"),
        errors=_polyak_errors(_s_polyak, lambda k: wrong_dtype(k, "target")),
    ),
)

# Polyak, its mirrors and the check of its result (graph 2's last node): the flags are exact.
ENTRIES += (
    SpecEntry(
        name="polyak_update_mirror_check",
        outputs={**next(e.outputs for e in ENTRIES if e.name == "polyak_update_mirror"),
                 "flags": i32(EXACT)},
        sample=_s_polyak_check,
        targets=("target", "online"),
        errors=_polyak_errors(
            _s_polyak_check,
            lambda k: wrong_dtype(k, "target"),
            lambda k: replace(k, entries=[("params", 0, 1)] * 5),
            lambda k: replace(k, flags=k["flags"][:-1]),
        ),
    ),
)

# The pointer variant (the scalar read from device memory, graph-fed by the ISV): the same
# kernel body, so the same samples, tolerances and error cases.
ENTRIES += tuple(dataclasses.replace(e, name="polyak_update_mirror_ptr") for e in ENTRIES
                 if e.name == "polyak_update_mirror")
