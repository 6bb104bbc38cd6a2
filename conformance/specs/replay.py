"""Entries of the replay kernels: the priorities' prefix sum, proportional sampling on it,
and the importance weights.
"""

from __future__ import annotations

import numpy as np

from foxhunt.conformance.kernel_spec import Dims, Kwargs, SpecEntry
from foxhunt.conformance.specs.inputs import (
    F32,
    I32,
    error_cases,
    f32,
    i32,
    maxabs,
    reduction,
    replace,
    uniform,
    wrong_dtype,
)
from foxhunt.conformance.tolerance import EXACT, REDUCTION


def _s_prefix(d: Dims, rng) -> Kwargs:
    p = uniform(rng, d.items, 0.0, 1.0)
    p[rng.random(d.items) < 0.1] = 0  # zero priorities are never sampled
    return {"p": p}


def _s_sample(d: Dims, rng) -> Kwargs:
    p = _s_prefix(d, rng)["p"]
    return {"prefix": np.cumsum(p, dtype=F32), "u": uniform(rng, d.batch, 0.0, 1.0)}


def _s_weights(d: Dims, rng) -> Kwargs:
    return {"priorities": uniform(rng, d.items, 0.01, 1.0),
            "idx": rng.integers(0, d.items, d.batch).astype(I32), "beta": 0.4, "n_valid": d.items}


def _sc_prefix(kwargs, expected):
    return {"out": reduction(kwargs["p"].size, maxabs(kwargs["p"]))}


def _sc_weights(kwargs, expected):
    return {"out": reduction(1, 1.0)}  # one division and one powf per weight, weights in (0, 1]


ENTRIES: tuple[SpecEntry, ...] = (
    # replay: scans are reductions; the binary search on a given prefix is exact
    SpecEntry(
        name="prefix_sum",
        outputs={"out": f32(REDUCTION)},
        sample=_s_prefix,
        targets=("p",),
        errors=error_cases(
            _s_prefix,
            lambda k: wrong_dtype(k, "p"),
            lambda k: replace(k, p=k["p"].reshape(5, -1)),
        ),
        scales=_sc_prefix,
    ),
    SpecEntry(
        name="sample_proportional",
        outputs={"out": i32(EXACT)},
        sample=_s_sample,
        targets=("prefix", "u"),
        errors=error_cases(
            _s_sample,
            lambda k: replace(k, prefix=k["prefix"][:0]),
            lambda k: wrong_dtype(k, "u"),
        ),
    ),
    SpecEntry(
        name="importance_weights",
        outputs={"out": f32(REDUCTION)},
        sample=_s_weights,
        targets=("priorities",),
        errors=error_cases(
            _s_weights,
            lambda k: replace(k, idx=np.full_like(k["idx"], k["n_valid"])),
            lambda k: replace(k, beta=1.5),
            lambda k: replace(k, n_valid=0),
        ),
        scales=_sc_weights,
    ),
)
