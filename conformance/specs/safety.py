"""Entries of the safety kernels: the finite clamp, the NaN checks (one buffer, and every
sentinel slot in one fused launch), max |x| and the Mech 1 target-Q clip.
"""

from __future__ import annotations

import numpy as np

from foxhunt.conformance.kernel_spec import Dims, Kwargs, SpecEntry
from foxhunt.conformance.specs.inputs import (
    F32,
    I32,
    error_cases,
    f32,
    finite_outputs,
    i32,
    normal,
    replace,
    wrong_dtype,
)
from foxhunt.conformance.tolerance import EXACT


def _s_clamp(d: Dims, rng) -> Kwargs:
    return {"x": normal(rng, (d.batch, d.hidden), 3.0), "m": F32(2.0)}


def _s_nan_check(d: Dims, rng) -> Kwargs:
    return {"x": normal(rng, (d.batch, d.hidden)), "flag": int(rng.integers(0, 2))}


def _s_fused(d: Dims, rng) -> Kwargs:
    sizes = (d.batch * d.hidden, d.flat, d.atoms, 1)
    return {"buffers": [normal(rng, n) for n in sizes[:2]] + [None] + [normal(rng, n) for n in sizes[2:]],
            "flags": np.array([0, 1, 0, 0, 0], dtype=I32),
            "thresholds": np.array([0.0, 2.5, 1.0, 3.0, -1.0], dtype=F32)}


def _s_max_abs(d: Dims, rng) -> Kwargs:
    return {"x": normal(rng, (d.batch, d.hidden))}


def _s_target_clip(d: Dims, rng) -> Kwargs:
    return {"q": normal(rng, (d.batch, d.actions), 40.0), "k1": 10.0, "q_abs_ref": F32(3.0)}


ENTRIES: tuple[SpecEntry, ...] = (
    # safety: clamps, flags and max are exact
    SpecEntry(
        name="clamp_finite",
        outputs={"out": f32(EXACT)},
        sample=_s_clamp,
        targets=("x",),
        errors=error_cases(
            _s_clamp,
            lambda k: replace(k, m=-1.0),
            lambda k: wrong_dtype(k, "x"),
        ),
        contract=finite_outputs("out"),
    ),
    SpecEntry(
        name="nan_check",
        outputs={"out": i32(EXACT)},
        sample=_s_nan_check,
        targets=("x",),
        errors=error_cases(
            _s_nan_check,
            lambda k: replace(k, flag=2),
            lambda k: wrong_dtype(k, "x"),
        ),
    ),
    SpecEntry(
        name="nan_check_fused",
        outputs={"out": i32(EXACT)},
        sample=_s_fused,
        targets=("buffers", "thresholds"),
        errors=error_cases(
            _s_fused,
            lambda k: replace(k, flags=k["flags"][:-1]),
            lambda k: replace(k, flags=k["flags"].astype(np.int64)),
            lambda k: replace(k, thresholds=k["thresholds"][:-1]),
        ),
    ),
    SpecEntry(
        name="max_abs",
        outputs={"out": f32(EXACT)},
        sample=_s_max_abs,
        targets=("x",),
        errors=error_cases(
            _s_max_abs,
            lambda k: wrong_dtype(k, "x"),
        ),
    ),
    SpecEntry(
        name="target_q_clip",
        outputs={"out": f32(EXACT)},
        sample=_s_target_clip,
        targets=("q", "q_abs_ref"),
        errors=error_cases(
            _s_target_clip,
            lambda k: replace(k, k1=-1.0),
            lambda k: wrong_dtype(k, "q"),
        ),
    ),
)
