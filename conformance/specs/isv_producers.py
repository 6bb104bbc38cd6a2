"""Entries of the issue-19 ISV producers (``reference/kernels/isv_producers.py``).

Tolerance: every output is compared exactly (NaN positions included). The kernels and their
twins share one reduction order (``lane_sum``), one selection rule (exact order statistics)
and round each product and sum separately, so there is no rounding slack to allow for; the
copied ISV slots (fingerprint bits included) must match too. Extremal cases poison the batch
buffers and the ISV vector itself (the slots a kernel reads); the contract is that a slot
that held a finite value still does, and that the signal vector keeps its ranges.
"""

from __future__ import annotations

import numpy as np

from foxhunt.conformance.kernel_spec import Dims, Kwargs, SpecEntry
from foxhunt.conformance.specs.inputs import (
    F32,
    error_cases,
    f32,
    isv_vector,
    normal,
    replace,
    softmax,
    uniform,
    wrong_dtype,
)
from foxhunt.conformance.tolerance import EXACT


def _isv(rng) -> np.ndarray:
    """The randomised cold-start vector with the slots these producers read set: the Sharpe
    EMA, Q_ABS_REF, the exposure Q means, ordered percentiles, epoch counters, health, epsilon."""
    from foxhunt.reference import isv as reg

    vec = isv_vector(rng)
    vec[reg.SHARPE_EMA_INDEX] = F32(rng.standard_normal() * 2)
    for s in reg.Q_DIR_ACTION_SLOTS:
        vec[s] = F32(rng.standard_normal() * 3)
    lo = rng.uniform(-8, 0, reg.MAX_ISV_BRANCHES)
    for k in range(reg.MAX_ISV_BRANCHES):
        vec[reg.Q_P05_INDICES[k]] = F32(lo[k])
        vec[reg.Q_P95_INDICES[k]] = F32(lo[k] + rng.uniform(0, 12))
    vec[reg.TOTAL_EPOCHS_INDEX] = F32(rng.integers(1, 60))
    vec[reg.EPOCH_IDX_INDEX] = F32(rng.integers(0, int(vec[reg.TOTAL_EPOCHS_INDEX]) + 1))
    vec[reg.NUM_SIGNALS - 1] = F32(rng.uniform(0, 1))  # LEARNING_HEALTH
    vec[reg.EPSILON_EFF_INDEX] = F32(rng.uniform(0, 1))
    return vec


def _s_signal(d: Dims, rng) -> Kwargs:
    nb = 3
    z = np.stack([np.linspace(-10, 10, d.atoms) * s for s in (1.0, 0.5, 2.0)]).astype(F32)
    return {"isv": _isv(rng), "q_taken": normal(rng, (nb, d.batch), 4.0),
            "td": uniform(rng, d.batch, 0.0, 3.0), "r": normal(rng, d.batch),
            "p_next": softmax(rng, (nb, d.batch, d.atoms), 3.0), "z": z,
            "grad_norm": F32(abs(rng.standard_normal()) * 5), "loss": F32(rng.uniform(0, 4))}


def _s_q_stats(d: Dims, rng) -> Kwargs:
    return {"isv": _isv(rng), "q": normal(rng, (d.batch, 3), 5.0), "alpha_base": 0.05}


def _s_quantile(d: Dims, rng) -> Kwargs:
    q = normal(rng, (d.batch, d.actions), 5.0)
    q.reshape(-1)[: q.size // 8] = q.reshape(-1)[q.size // 8: 2 * (q.size // 8)]  # ties
    return {"isv": _isv(rng), "q": q, "branch": int(rng.integers(0, 3)), "alpha_base": 0.05}


def _s_support(d: Dims, rng) -> Kwargs:
    vec = _isv(rng)
    from foxhunt.reference import isv as reg

    vec[reg.Q_ABS_REF_INDEX] = F32(rng.uniform(0, 3))
    # A small Mech 2 multiplier so the bound is active in some members.
    return {"isv": vec, "atom_growth_mult": float(rng.choice([2.0, 100.0])), "headroom": 1.25,
            "half_floor": 1.0}


def _s_gamma(d: Dims, rng) -> Kwargs:
    from foxhunt.reference import isv as reg

    return {"isv": _isv(rng), "gamma_base": np.array(reg.GAMMA_SCHEDULE_BASE, F32),
            "gamma_max": np.array(reg.GAMMA_SCHEDULE_MAX, F32)}


def _s_cql(d: Dims, rng) -> Kwargs:
    return {"isv": _isv(rng), "cql_alpha": 1.5, "alpha_base": 0.05}


def _s_eps(d: Dims, rng) -> Kwargs:
    return {"isv": _isv(rng), "schedule": np.array([0.4, 1.0], F32), "tau": 0.005}


def _isv_finite_where_finite(kwargs, outputs, poisoned):
    src = kwargs["isv"]
    bad = np.isfinite(src) & ~np.isfinite(outputs["out"])
    return [f"isv slots {np.flatnonzero(bad).tolist()} turned non-finite"] if bad.any() else []


def _signal_ranges(kwargs, outputs, poisoned):
    """Reserved signals are 0; utilisation is a finite share; health is NaN or in [0, 1]."""
    from foxhunt.reference import isv as reg

    sig = outputs["out"]
    names = {n: i for i, n in enumerate(reg.SIGNAL_NAMES)}
    problems = []
    reserved = [names[n] for n in ("ADX_EMA", "REGIME_DISAGREE", "REGIME_VEL_EMA",
                                   "REGIME_STABILITY")]
    if np.any(sig[reserved] != 0):
        problems.append(f"reserved signals {reserved} are not 0: {sig[reserved]}")
    util = sig[names["ATOM_UTIL_EMA"]]
    if not (np.isfinite(util) and 0 <= util <= 1):
        problems.append(f"atom utilisation {util} is not a share in [0, 1]")
    health = sig[names["LEARNING_HEALTH"]]
    if np.isfinite(health) and not 0 <= health <= 1:
        problems.append(f"health {health} outside [0, 1]")
    return problems


def _isv_entry(name, sample, targets, *edits) -> SpecEntry:
    return SpecEntry(name=name, outputs={"out": f32(EXACT)}, sample=sample, targets=targets,
                     errors=error_cases(sample, lambda k: replace(k, isv=k["isv"][:-1]),
                                        lambda k: wrong_dtype(k, "isv"), *edits),
                     contract=_isv_finite_where_finite)


ENTRIES: tuple[SpecEntry, ...] = (
    SpecEntry(
        name="isv_signal_build",
        outputs={"out": f32(EXACT)},
        sample=_s_signal,
        targets=("q_taken", "td", "r", "p_next", "grad_norm", "loss", "isv"),
        errors=error_cases(
            _s_signal,
            lambda k: replace(k, td=k["td"][:-1]),
            lambda k: replace(k, z=k["z"][:, :-1]),
            lambda k: wrong_dtype(k, "p_next"),
        ),
        contract=_signal_ranges,
        finite_sample=True,
    ),
    _isv_entry("q_stats_update", _s_q_stats, ("q", "isv"),
               lambda k: replace(k, q=k["q"][:, :2]), lambda k: replace(k, alpha_base=0.9)),
    _isv_entry("q_quantile_update", _s_quantile, ("q", "isv"),
               lambda k: replace(k, branch=4), lambda k: wrong_dtype(k, "q")),
    _isv_entry("adaptive_support_update", _s_support, ("isv",),
               lambda k: replace(k, headroom=float("nan")),
               lambda k: replace(k, atom_growth_mult=-1.0)),
    _isv_entry("per_branch_gamma_update", _s_gamma, ("isv",),
               lambda k: replace(k, gamma_base=k["gamma_base"][:3]),
               lambda k: replace(k, gamma_max=np.full(4, 1.5, F32))),
    _isv_entry("cql_alpha_ramp", _s_cql, ("isv",),
               lambda k: replace(k, cql_alpha=-1.0), lambda k: replace(k, alpha_base=0.6)),
    _isv_entry("epsilon_tau_update", _s_eps, ("isv",),
               lambda k: replace(k, schedule=np.array([1.5, 1.0], F32)),
               lambda k: replace(k, schedule=k["schedule"][:1]),
               lambda k: replace(k, tau=float("inf"))),
)
