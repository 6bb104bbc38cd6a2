"""Entries of the distributional (C51) kernels of one branch: the dueling combine and its
backward, log-softmax over atoms, expected Q, the double-DQN choice, the C51 projection, loss
and gradient, and the CQL logit gradient.
"""

from __future__ import annotations

import math

import numpy as np

from foxhunt.conformance.kernel_spec import Dims, Kwargs, SpecEntry
from foxhunt.conformance.specs.inputs import (
    F32,
    I32,
    V_MIN,
    V_MAX,
    error_cases,
    f32,
    i32,
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
from foxhunt.conformance.tolerance import EXACT, REDUCTION

#: The shape cases whose target-kernel samples are n-step (issue 22: a per-sample ``discount``,
#: ``n_step_on = 1``); ``tiny`` stays 1-step (``discount=None``, ``n_step_on = 0``), where the
#: kernels' outputs must keep today's bits (the ``exact`` masks of the scales).
N_STEP_CASES = ("seed", "odd", "extremal")
#: The reference gamma of the n-step samples' discounts.
N_STEP_GAMMA_REF = F32(0.99)
#: Relative error of the effective gamma, in float32 unit roundoffs, the n-step bounds allow:
#: CUDA's ``logf`` (1 ulp) and ``powf`` (4 ulp) against NumPy's float32 ``log`` / ``power``,
#: the division and ``n_eff``'s error carried through the power (ulps; see ``effective_gamma``).
GAMMA_EFF_ROUNDOFFS = 16.0


def n_step_inputs(d: Dims, rng) -> Kwargs:
    """The n-step arguments of a target kernel's sample: ``{}`` (1-step) unless ``d.case`` is
    in ``N_STEP_CASES``; else ``discount`` = ``gamma_ref ** k`` (float32 products, ``k`` uniform
    in 1..16) with the extremes ``1e-30`` (below the floor) first, ``1`` second and ``k = 16``
    last, and ``gamma_ref``. Drawn last, so the 1-step arguments of a case are unchanged."""
    if d.case not in N_STEP_CASES:
        return {}
    ks = rng.integers(1, 17, d.batch)
    ks[-1] = 16
    disc = np.empty(d.batch, F32)
    for b, k in enumerate(ks):
        value = N_STEP_GAMMA_REF
        for _ in range(int(k) - 1):
            value = F32(value * N_STEP_GAMMA_REF)
        disc[b] = value
    disc[0] = F32(1e-30)
    if d.batch > 2:
        disc[1] = F32(1)
    return {"discount": disc, "gamma_ref": N_STEP_GAMMA_REF}


def n_step_exact(kwargs) -> np.ndarray:
    """``[B]`` mask of the samples whose targets must keep their bits: every sample of a 1-step
    sample (``n_step_on = 0``: today's kernel), and the ``done`` samples of an n-step one (their
    effective gamma is multiplied by 0; a non-finite one gives NaN in both)."""
    done = kwargs["done"]
    if kwargs.get("discount") is None:
        return np.ones(done.shape, bool)
    return done == 1


def gamma_eff_slack(kwargs, scale) -> float:
    """The absolute error an effective gamma's ``GAMMA_EFF_ROUNDOFFS`` carry into ``g * x`` with
    ``|x| <= scale``, as a reduction bound's magnitude over one term (0 for 1-step samples)."""
    if kwargs.get("discount") is None:
        return 0.0
    return GAMMA_EFF_ROUNDOFFS / 4.0 * float(scale)  # the bound is 4 roundoffs per term


def _s_dueling(d: Dims, rng) -> Kwargs:
    return {"v": normal(rng, (d.batch, d.atoms)), "adv": normal(rng, (d.batch, d.actions, d.atoms))}


def _s_dlogits(d: Dims, rng) -> Kwargs:
    return {"dlogits": normal(rng, (d.batch, d.actions, d.atoms), 1e-2)}


def _s_logits(d: Dims, rng) -> Kwargs:
    return {"logits": normal(rng, (d.batch, d.actions, d.atoms), 3.0)}


def _s_expected_q(d: Dims, rng) -> Kwargs:
    return {"logp": log_softmax(rng, (d.batch, d.actions, d.atoms)), "z": support(d.atoms)}


def _s_select(d: Dims, rng) -> Kwargs:
    q = np.round(rng.standard_normal((d.batch, d.actions)) * 2) / 2  # half steps: ties occur
    return {"q": q.astype(F32)}


def _s_project(d: Dims, rng) -> Kwargs:
    return {"p_next": softmax(rng, (d.batch, d.atoms)), "r": normal(rng, d.batch, 3.0),
            "done": (rng.random(d.batch) < 0.2).astype(F32), "gamma": F32(0.99),
            "z": support(d.atoms), "v_min": V_MIN, "v_max": V_MAX, **n_step_inputs(d, rng)}


def _s_c51(d: Dims, rng) -> Kwargs:
    return {"logp": log_softmax(rng, (d.batch, d.actions, d.atoms)),
            "actions": rng.integers(0, d.actions, d.batch).astype(I32),
            "m": softmax(rng, (d.batch, d.atoms)), "isw": uniform(rng, d.batch, 0.1, 1.0),
            "scale": F32(1.0 / (d.batch * 2))}


def _s_cql(d: Dims, rng) -> Kwargs:
    return {"logp": log_softmax(rng, (d.batch, d.actions, d.atoms)),
            "actions": rng.integers(0, d.actions, d.batch).astype(I32),
            "z": support(d.atoms), "alpha": F32(1.0), "scale": F32(1.0 / (d.batch * 2))}


def _s_log_softmax_q(d: Dims, rng) -> Kwargs:
    """The step's packed rows: online (2B) then target (B) samples, each of A action rows;
    Q over the online rows."""
    rows = d.batch * d.actions
    return {"logits": normal(rng, (3 * rows, d.atoms), 3.0), "z": support(d.atoms),
            "q_rows": 2 * rows}


def _s_project_grad(d: Dims, rng) -> Kwargs:
    c51 = _s_c51(d, rng)
    del c51["m"]  # the fused kernel's output
    project = _s_project(d, rng)
    n_step = {k: project.pop(k) for k in ("discount", "gamma_ref") if k in project}
    return {**project, **c51, **n_step}


def _sc_dueling(kwargs, expected):
    return {"out": reduction(kwargs["adv"].shape[1], maxabs(kwargs["v"]) + 2 * maxabs(kwargs["adv"]))}


def _sc_dueling_bwd(kwargs, expected):
    a, mag = kwargs["dlogits"].shape[1], maxabs(kwargs["dlogits"])
    return {"dv": reduction(a, mag), "dadv": reduction(a, 2 * mag)}


def _sc_log_softmax(kwargs, expected):
    x = kwargs["logits"]
    return {"out": reduction(x.shape[-1], 1.0 + 2 * maxabs(x))}


def _sc_expected_q(kwargs, expected):
    return {"out": reduction(kwargs["logp"].shape[-1], maxabs(kwargs["z"]))}


def project_bound(kwargs) -> dict:
    """The projection's bound: the reduction over source atoms (weights <= 1), plus for
    n-step samples the effective gamma's error moving each target position by up to
    ``roundoffs * max|z|``, i.e. each weight by that over ``dz`` (1-step samples: today's
    bound)."""
    z = kwargs["z"]
    dz = float(z[1] - z[0])
    mass = max(maxabs(kwargs["p_next"]), 1.0)  # the weights' error times the moved mass
    return reduction(kwargs["p_next"].shape[-1], 1.0 + gamma_eff_slack(kwargs, mass * maxabs(z) / dz))


def _sc_project(kwargs, expected):
    return {"out": project_bound(kwargs)}


def _sc_c51_loss(kwargs, expected):
    logp, m = kwargs["logp"], kwargs["m"]
    isw_scale = maxabs(kwargs["isw"]) * maxabs(kwargs["scale"])
    return {"ce": reduction(logp.shape[-1], maxabs(logp) * max(maxabs(m), 1.0)),
            "total": reduction(logp.shape[0], isw_scale * max(maxabs(expected["ce"]), 1.0))}


def _not_taken(kwargs) -> np.ndarray:
    """``[B, A, 1]`` mask of the actions not taken (their gradient rows are written 0)."""
    logp, actions = kwargs["logp"], kwargs["actions"]
    return (np.arange(logp.shape[1])[None, :] != actions[:, None])[..., None]


def _sc_c51_grad(kwargs, expected):
    isw_scale = maxabs(kwargs["isw"]) * maxabs(kwargs["scale"])
    return {"out": {**reduction(kwargs["logp"].shape[-1], isw_scale * max(maxabs(kwargs["m"]), 1.0)),
                    "exact": _not_taken(kwargs)}}


def _sc_log_softmax_q(kwargs, expected):
    x = kwargs["logits"]
    return {"logp": reduction(x.shape[-1], 1.0 + 2 * maxabs(x)),
            "q": reduction(x.shape[-1], maxabs(kwargs["z"]))}


def _s_project_grad_live(d: Dims, rng) -> Kwargs:
    """``_s_project_grad`` on one branch of a live support (off-centre and narrower or wider
    than the fixed one, so some targets clip at both ends)."""
    from foxhunt.conformance.specs.live_support import _s_live_support
    from foxhunt.reference.kernels.live_support import live_support_build

    kwargs = _s_project_grad(d, rng)
    isv = _s_live_support(d, rng)["isv"]
    live = live_support_build(isv, 1, d.atoms, 100.0)
    del kwargs["v_min"], kwargs["v_max"]
    return {**kwargs, "z": live.z[0].copy(), "bounds": live.bounds[0].copy()}


def _sc_project_grad_live(kwargs, expected):
    lo, hi = kwargs["bounds"][:2]
    return _sc_project_grad({**kwargs, "v_min": lo, "v_max": hi}, expected)


def _sc_project_grad(kwargs, expected):
    isw_scale = maxabs(kwargs["isw"]) * maxabs(kwargs["scale"])
    m_bound = project_bound(kwargs)
    return {"m": m_bound,
            "dlogits": {**reduction(kwargs["logp"].shape[-1],
                               isw_scale * max(maxabs(expected["m"]), 1.0) * m_bound["magnitude"]),
                        "exact": _not_taken(kwargs)}}


def _sc_cql(kwargs, expected):
    logp, zmax = kwargs["logp"], maxabs(kwargs["z"])
    length = logp.shape[-1] + logp.shape[1]
    dmag = maxabs(kwargs["alpha"]) * maxabs(kwargs["scale"]) * 2 * zmax
    return {"dlogits": reduction(length, dmag), "terms": reduction(length, zmax + math.log(logp.shape[1]) + 1)}


ENTRIES: tuple[SpecEntry, ...] = (
    # distributional: short reductions (over actions or atoms) and exp/log
    SpecEntry(
        name="dueling_combine",
        outputs={"out": f32(REDUCTION)},
        sample=_s_dueling,
        targets=("v", "adv"),
        errors=error_cases(
            _s_dueling,
            lambda k: replace(k, v=k["v"][:, :-1]),
            lambda k: wrong_dtype(k, "adv"),
        ),
        scales=_sc_dueling,
    ),
    SpecEntry(
        name="dueling_combine_backward",
        outputs={"dv": f32(REDUCTION), "dadv": f32(REDUCTION)},
        sample=_s_dlogits,
        targets=("dlogits",),
        errors=error_cases(
            _s_dlogits,
            lambda k: wrong_dtype(k, "dlogits"),
            lambda k: replace(k, dlogits=k["dlogits"][0]),
        ),
        scales=_sc_dueling_bwd,
    ),
    SpecEntry(
        name="log_softmax_atoms",
        outputs={"out": f32(REDUCTION)},
        sample=_s_logits,
        targets=("logits",),
        errors=error_cases(
            _s_logits,
            lambda k: wrong_dtype(k, "logits"),
        ),
        scales=_sc_log_softmax,
    ),
    SpecEntry(
        name="expected_q",
        outputs={"out": f32(REDUCTION)},
        sample=_s_expected_q,
        targets=("logp", "z"),
        errors=error_cases(
            _s_expected_q,
            lambda k: replace(k, z=k["z"][:-1]),
            lambda k: wrong_dtype(k, "logp"),
        ),
        scales=_sc_expected_q,
    ),
    # fused log_softmax_atoms + expected_q: their tolerances, per output
    SpecEntry(
        name="log_softmax_expected_q",
        outputs={"logp": f32(REDUCTION), "q": f32(REDUCTION)},
        sample=_s_log_softmax_q,
        targets=("logits", "z"),
        errors=error_cases(
            _s_log_softmax_q,
            lambda k: replace(k, z=k["z"][:-1]),
            lambda k: replace(k, q_rows=k["logits"].shape[0] + 1),
            lambda k: replace(k, q_rows=-1),
            lambda k: wrong_dtype(k, "logits"),
            lambda k: replace(k, logits=k["logits"].reshape(1, *k["logits"].shape)),
        ),
        scales=_sc_log_softmax_q,
    ),
    SpecEntry(
        name="double_dqn_select",
        outputs={"out": i32(EXACT)},
        sample=_s_select,
        targets=("q",),
        errors=error_cases(
            _s_select,
            lambda k: wrong_dtype(k, "q"),
            lambda k: replace(k, q=k["q"][0]),
        ),
    ),
    SpecEntry(
        name="c51_project",
        outputs={"out": f32(REDUCTION)},
        sample=_s_project,
        targets=("p_next", "r", "done", "gamma", "discount"),
        errors=error_cases(
            _s_project,
            lambda k: replace(k, r=k["r"][:-1]),
            lambda k: replace(k, discount=k["discount"][:-1]),
            lambda k: replace(k, gamma_ref=F32(1.0)),
            lambda k: replace(k, v_min=20.0),
            lambda k: replace(k, z=k["z"][:-1]),
            lambda k: wrong_dtype(k, "p_next"),
        ),
        scales=_sc_project,
    ),
    SpecEntry(
        name="c51_loss",
        outputs={"ce": f32(REDUCTION), "total": f32(REDUCTION)},
        sample=_s_c51,
        targets=("logp", "m", "isw", "scale"),
        errors=error_cases(
            _s_c51,
            lambda k: replace(k, actions=np.full_like(k["actions"], k["logp"].shape[1])),
            lambda k: replace(k, actions=k["actions"].astype(np.int64)),
            lambda k: replace(k, isw=k["isw"][:-1]),
        ),
        scales=_sc_c51_loss,
    ),
    SpecEntry(
        name="c51_grad",
        outputs={"out": f32(REDUCTION)},
        sample=_s_c51,
        targets=("logp", "m", "isw", "scale"),
        errors=error_cases(
            _s_c51,
            lambda k: replace(k, actions=np.full_like(k["actions"], -1)),
            lambda k: replace(k, m=k["m"][:, :-1]),
        ),
        scales=_sc_c51_grad,
    ),
    # fused c51_project + c51_grad: their tolerances, per output
    SpecEntry(
        name="c51_project_grad",
        outputs={"m": f32(REDUCTION), "dlogits": f32(REDUCTION)},
        sample=_s_project_grad,
        targets=("p_next", "r", "done", "gamma", "logp", "isw", "scale", "discount"),
        errors=error_cases(
            _s_project_grad,
            lambda k: replace(k, r=k["r"][:-1]),
            lambda k: replace(k, discount=k["discount"].astype(np.float64)),
            lambda k: replace(k, gamma_ref=F32(0.0)),
            lambda k: replace(k, v_min=20.0),
            lambda k: wrong_dtype(k, "p_next"),
            lambda k: replace(k, actions=np.full_like(k["actions"], k["logp"].shape[1])),
            lambda k: replace(k, logp=k["logp"][:, :, :-1]),
            lambda k: replace(k, isw=k["isw"][:-1]),
        ),
        scales=_sc_project_grad,
    ),
    # c51_project_grad on a live support (adaptive_atoms): the bounds through a pointer
    SpecEntry(
        name="c51_project_grad_live",
        outputs={"m": f32(REDUCTION), "dlogits": f32(REDUCTION)},
        sample=_s_project_grad_live,
        targets=("p_next", "r", "done", "gamma", "logp", "isw", "scale", "discount"),
        errors=error_cases(
            _s_project_grad_live,
            lambda k: replace(k, bounds=k["bounds"][:2]),
            lambda k: replace(k, bounds=k["bounds"] * np.array([1, 1, 1.5], F32)),
            lambda k: replace(k, bounds=k["bounds"][[1, 0, 2]]),
            lambda k: wrong_dtype(k, "bounds"),
            lambda k: replace(k, r=k["r"][:-1]),
        ),
        scales=_sc_project_grad_live,
    ),
    SpecEntry(
        name="cql_logit_grad",
        outputs={"dlogits": f32(REDUCTION), "terms": f32(REDUCTION)},
        sample=_s_cql,
        targets=("logp", "z", "alpha", "scale"),
        errors=error_cases(
            _s_cql,
            lambda k: replace(k, actions=np.full_like(k["actions"], k["logp"].shape[1])),
            lambda k: replace(k, z=k["z"][:-1]),
        ),
        scales=_sc_cql,
    ),
)
