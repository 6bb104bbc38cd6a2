"""Entries of the fused kernels: every branch in one launch, on branch-packed
``[R * A_total, NA]`` buffers (the per-branch kernels' tolerances, per output).
"""

from __future__ import annotations

import math

import numpy as np

from foxhunt.conformance.kernel_spec import Dims, Kwargs, SpecEntry
from foxhunt.conformance.specs.inputs import (
    F32,
    I32,
    error_cases,
    f32,
    log_softmax,
    maxabs,
    normal,
    reduction,
    replace,
    softmax,
    support,
    uniform,
    wrong_dtype,
)
from foxhunt.conformance.tolerance import REDUCTION


def _branches(d: Dims) -> tuple[int, ...]:
    """Three branches, two of them as wide as the case's largest (the seed's (3, 3, 2))."""
    return (d.actions, d.actions, max(1, d.actions - 1))


def _s_dueling_branches(d: Dims, rng) -> Kwargs:
    br = _branches(d)
    return {"v": normal(rng, (d.batch, d.atoms)),
            "adv": normal(rng, (d.batch * sum(br), d.atoms)), "branches": br}


def _s_dlogits_branches(d: Dims, rng) -> Kwargs:
    br = _branches(d)
    return {"dlogits": normal(rng, (d.batch * sum(br), d.atoms), 1e-2), "branches": br}


def _s_cql_branches(d: Dims, rng) -> Kwargs:
    br = _branches(d)
    rows = 2 * d.batch  # the online pass over [s; s2]: the first B samples of each block
    return {"logp": log_softmax(rng, (rows * sum(br), d.atoms)),
            "actions": np.stack([rng.integers(0, n, d.batch) for n in br]).astype(I32),
            "z": support(d.atoms), "alpha": F32(1.0), "scale": F32(1.0 / (d.batch * len(br))),
            "branches": br}


def _sc_dueling_branches(kwargs, expected):
    a = max(kwargs["branches"])
    return {"out": reduction(a, maxabs(kwargs["v"]) + 2 * maxabs(kwargs["adv"]))}


def _s_dueling_log_softmax_q_branches(d: Dims, rng) -> Kwargs:
    """One forward pass's heads (``dueling_combine_branches``' sample) and the support: with Q
    (the online pass) except in ``odd``, which runs the target pass's no-Q path (``q`` empty;
    ``tiny`` keeps Q: the registry's mutation check perturbs every output of ``tiny``)."""
    return {**_s_dueling_branches(d, rng), "z": support(d.atoms), "with_q": d.case != "odd"}


def _sc_dueling_log_softmax_q_branches(kwargs, expected):
    """dueling_combine_branches' scale for ``logits``, log_softmax_expected_q's for the rest."""
    a, na = max(kwargs["branches"]), kwargs["v"].shape[1]
    return {"logits": reduction(a, maxabs(kwargs["v"]) + 2 * maxabs(kwargs["adv"])),
            "logp": reduction(na, 1.0 + 2 * maxabs(expected["logits"])),
            "q": reduction(na, maxabs(kwargs["z"]))}


def _sc_dueling_bwd_branches(kwargs, expected):
    a, mag = max(kwargs["branches"]), maxabs(kwargs["dlogits"])
    return {"dv": reduction(a, mag), "dadv": reduction(a, 2 * mag)}


def _sc_dueling_bwd_sum_branches(kwargs, expected):
    br, mag = kwargs["branches"], maxabs(kwargs["dlogits"])
    return {"dv": reduction(sum(br) + len(br), mag), "dadv": reduction(max(br), 2 * mag)}


def _sc_cql_branches(kwargs, expected):
    logp, zmax, a = kwargs["logp"], maxabs(kwargs["z"]), max(kwargs["branches"])
    length = logp.shape[-1] + a
    dmag = maxabs(kwargs["alpha"]) * maxabs(kwargs["scale"]) * 2 * zmax
    return {"dlogits": reduction(length, dmag), "terms": reduction(length, zmax + math.log(a) + 1)}


def _s_c51_branches(d: Dims, rng) -> Kwargs:
    br = _branches(d)
    rows = 2 * d.batch  # the online pass over [s; s2]: the first B samples of each block
    return {"logp": log_softmax(rng, (rows * sum(br), d.atoms)),
            "actions": np.stack([rng.integers(0, n, d.batch) for n in br]).astype(I32),
            "m": softmax(rng, (len(br), d.batch, d.atoms)),
            "isw": uniform(rng, d.batch, 0.1, 1.0), "scale": F32(1.0 / (d.batch * len(br))),
            "branches": br}


def _sc_c51_loss_branches(kwargs, expected):
    """c51_loss's scales per branch (global maxima over the branches)."""
    logp, m = kwargs["logp"], kwargs["m"]
    isw_scale = maxabs(kwargs["isw"]) * maxabs(kwargs["scale"])
    return {"ce": reduction(logp.shape[-1], maxabs(logp) * max(maxabs(m), 1.0)),
            "total": reduction(m.shape[1], isw_scale * max(maxabs(expected["ce"]), 1.0))}


#: The argument errors of the two dueling-backward entries (same arguments).
_dlogits_branch_errors = error_cases(
    _s_dlogits_branches,
    lambda k: wrong_dtype(k, "dlogits"),
    lambda k: replace(k, dlogits=k["dlogits"][:-1]),
    lambda k: replace(k, branches=()),
)


ENTRIES: tuple[SpecEntry, ...] = (
    # fused: the per-branch kernels in one launch (their tolerances)
    SpecEntry(
        name="dueling_combine_branches",
        outputs={"out": f32(REDUCTION)},
        sample=_s_dueling_branches,
        targets=("v", "adv"),
        errors=error_cases(
            _s_dueling_branches,
            lambda k: replace(k, v=k["v"][:, :-1]),
            lambda k: wrong_dtype(k, "adv"),
            lambda k: replace(k, branches=(3, 0)),
        ),
        scales=_sc_dueling_branches,
    ),
    # fused dueling_combine_branches + log_softmax_expected_q: their tolerances, per output
    SpecEntry(
        name="dueling_log_softmax_q_branches",
        outputs={"logits": f32(REDUCTION), "logp": f32(REDUCTION), "q": f32(REDUCTION)},
        sample=_s_dueling_log_softmax_q_branches,
        targets=("v", "adv", "z"),
        errors=error_cases(
            _s_dueling_log_softmax_q_branches,
            lambda k: replace(k, v=k["v"][:, :-1]),
            lambda k: wrong_dtype(k, "adv"),
            lambda k: replace(k, z=k["z"][:-1]),
            lambda k: wrong_dtype(k, "z"),
            lambda k: replace(k, branches=(3, 0)),
            lambda k: replace(k, with_q=1),
        ),
        scales=_sc_dueling_log_softmax_q_branches,
    ),
    SpecEntry(
        name="dueling_combine_backward_branches",
        outputs={"dv": f32(REDUCTION), "dadv": f32(REDUCTION)},
        sample=_s_dlogits_branches,
        targets=("dlogits",),
        errors=_dlogits_branch_errors,
        scales=_sc_dueling_bwd_branches,
    ),
    # fused dueling_combine_backward_branches + the branch sum of dv: their tolerances
    SpecEntry(
        name="dueling_combine_backward_sum_branches",
        outputs={"dv": f32(REDUCTION), "dadv": f32(REDUCTION)},
        sample=_s_dlogits_branches,
        targets=("dlogits",),
        errors=_dlogits_branch_errors,
        scales=_sc_dueling_bwd_sum_branches,
    ),
    SpecEntry(
        name="cql_logit_grad_branches",
        outputs={"dlogits": f32(REDUCTION), "terms": f32(REDUCTION)},
        sample=_s_cql_branches,
        targets=("logp", "z", "alpha", "scale"),
        errors=error_cases(
            _s_cql_branches,
            lambda k: replace(k, actions=np.full_like(k["actions"], max(k["branches"]))),
            lambda k: replace(k, actions=k["actions"][:-1]),
            lambda k: replace(k, z=k["z"][:-1]),
        ),
        scales=_sc_cql_branches,
    ),
    SpecEntry(
        name="c51_loss_branches",
        outputs={"ce": f32(REDUCTION), "total": f32(REDUCTION)},
        sample=_s_c51_branches,
        targets=("logp", "m", "isw", "scale"),
        errors=error_cases(
            _s_c51_branches,
            lambda k: replace(k, actions=np.full_like(k["actions"], max(k["branches"]))),
            lambda k: replace(k, actions=k["actions"].astype(np.int64)),
            lambda k: replace(k, m=k["m"][:, :, :-1]),
            lambda k: replace(k, isw=k["isw"][:-1]),
            lambda k: replace(k, branches=(3, 0)),
        ),
        scales=_sc_c51_loss_branches,
    ),
)
