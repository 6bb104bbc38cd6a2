"""Entries of the ISV producer kernels: the signal EMAs, Q_ABS_REF from the taken-action Q and
H_S2_RMS_EMA from h2 (every other slot copied bit for bit).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from foxhunt.conformance.kernel_spec import Dims, Kwargs, Scales, SpecEntry
from foxhunt.conformance.specs.inputs import (
    F32,
    error_cases,
    f32,
    isv_vector,
    maxabs,
    normal,
    reduction,
    replace,
    sq_mag,
    wrong_dtype,
)
from foxhunt.conformance.tolerance import REDUCTION, Tolerance


def _s_isv_signal(d: Dims, rng) -> Kwargs:
    from foxhunt.reference import isv as isv_registry

    return {"isv": isv_vector(rng), "signals": normal(rng, isv_registry.NUM_SIGNALS),
            "sharpe": F32(rng.standard_normal()), "alpha_base": 0.05}


def _s_isv_q(d: Dims, rng) -> Kwargs:
    return {"isv": isv_vector(rng), "q": normal(rng, (d.batch, d.actions), 5.0), "alpha": 0.05}


def _s_isv_h2(d: Dims, rng) -> Kwargs:
    return {"isv": isv_vector(rng), "h2": normal(rng, (d.batch, d.hidden)), "alpha": 0.05}


def _isv_copied(updated: Sequence[int]) -> np.ndarray:
    """Mask of the ISV slots a producer kernel only copies (all but ``updated``)."""
    from foxhunt.reference import isv as isv_registry

    mask = np.ones(isv_registry.ISV_LEN, dtype=bool)
    mask[list(updated)] = False
    return mask


def _sc_isv_signal(kwargs, expected):
    from foxhunt.reference import isv as isv_registry

    return {"out": {"exact": _isv_copied(range(isv_registry.NUM_SIGNALS))}}


def _sc_isv(source: str, slot_index: str, square: bool) -> Scales:
    """The EMA slot's bound scales with the reduced source and the slot's old value; every
    other slot is copied and must match bit for bit."""
    def scales(kwargs, expected):
        from foxhunt.reference import isv as isv_registry

        index = getattr(isv_registry, slot_index)
        x = kwargs[source]
        mag = sq_mag(x) if square else maxabs(x)
        return {"out": {**reduction(np.asarray(x).size, max(mag, maxabs(kwargs["isv"][index]))),
                        "exact": _isv_copied([index])}}
    return scales


def _isv_finite_where_finite(kwargs, outputs, poisoned):
    """A slot that held a finite value still does (the EMA guards)."""
    src = kwargs["isv"]
    bad = np.isfinite(src) & ~np.isfinite(outputs["out"])
    return [f"isv slots {np.flatnonzero(bad).tolist()} turned non-finite"] if bad.any() else []


ENTRIES: tuple[SpecEntry, ...] = (
    # isv: EMA updates (a mean/RMS reduction, then one blend)
    SpecEntry(
        name="isv_signal_update",
        outputs={"out": f32(Tolerance.ulp(4))},
        sample=_s_isv_signal,
        targets=("signals", "sharpe"),
        errors=error_cases(
            _s_isv_signal,
            lambda k: replace(k, isv=k["isv"][:-1]),
            lambda k: replace(k, signals=k["signals"][:-1]),
            lambda k: replace(k, alpha_base=0.9),
        ),
        scales=_sc_isv_signal,
        contract=_isv_finite_where_finite,
    ),
    SpecEntry(
        name="isv_q_abs_ref_update",
        outputs={"out": f32(REDUCTION)},
        sample=_s_isv_q,
        targets=("q",),
        errors=error_cases(
            _s_isv_q,
            lambda k: replace(k, alpha=1.5),
            lambda k: wrong_dtype(k, "q"),
        ),
        scales=_sc_isv("q", "Q_ABS_REF_INDEX", square=False),
        contract=_isv_finite_where_finite,
    ),
    SpecEntry(
        name="isv_h2_rms_update",
        outputs={"out": f32(REDUCTION)},
        sample=_s_isv_h2,
        targets=("h2",),
        errors=error_cases(
            _s_isv_h2,
            lambda k: replace(k, alpha=-0.1),
            lambda k: wrong_dtype(k, "h2"),
        ),
        scales=_sc_isv("h2", "H_S2_RMS_EMA_INDEX", square=True),
        contract=_isv_finite_where_finite,
    ),
)
