"""Entries of the training step's own kernels (``cuda_src/step.cu``, reference
``foxhunt.reference.kernels.step``): the step's ISV-driven bounds, Mech 10's clamp from the ISV,
the double-DQN gathers, the scalar targets, the TD errors' branch mean, the trunk gradient's sum
and masks, the step scalars and the merge of sentinel pieces.

All but three outputs are exact (the kernels round where the reference does, in its order):
``double_dqn_gather_branches``' ``p_next`` is ``expf`` against NumPy's float32 ``exp`` (CUDA's
``expf`` is within 2 ulp, NumPy's SIMD float32 ``exp`` within 2.52 ulp: 5 ulp apart at most);
``step_scalars``' total norm is a block-tree sum against NumPy's pairwise one (a reduction;
its other outputs follow the norm, their other elements are copied or exact). ``loss_scalars``'
means keep the reduction tolerance although the reference now sums in the kernel's order
(``reference.kernels.step.block_total``: a sum of +-f32 max overflows in both or neither).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from foxhunt.conformance.kernel_spec import Dims, Kwargs, Output, SpecEntry
from foxhunt.conformance.specs.inputs import (
    F32,
    I32,
    V_MAX,
    V_MIN,
    error_cases,
    f32,
    finite_outputs,
    i32,
    isv_vector,
    log_softmax,
    maxabs,
    normal,
    reduction,
    replace,
    softmax,
    support,
    u16,
    uniform,
    wrong_dtype,
)
from foxhunt.conformance.specs.distributional import (
    gamma_eff_slack,
    n_step_exact,
    n_step_inputs,
    project_bound,
)
from foxhunt.conformance.tolerance import EXACT, REDUCTION, Tolerance
from foxhunt.reference import isv as isv_mod
from foxhunt.reference.kernels.step import READBACK_FIELDS, READBACK_INDEX

#: CUDA ``expf`` (2 ulp) against NumPy's float32 ``exp`` (2.52 ulp).
EXP_ULP = Tolerance.ulp(5)


def _branches(d: Dims) -> tuple[int, ...]:
    """Three branches, two of them as wide as the case's largest (the seed's (3, 3, 2))."""
    return (d.actions, d.actions, max(1, d.actions - 1))


def _isv(rng) -> np.ndarray:
    isv = isv_vector(rng)
    isv[isv_mod.GRAD_NORM_SLOW_EMA_INDEX] = F32(abs(rng.standard_normal()) * 5)
    return isv


# ------------------------------------------------------------------------------ samples
def _s_step_bounds(d: Dims, rng) -> Kwargs:
    k = d.atoms
    index = rng.integers(-1, isv_mod.ISV_LEN, k).astype(I32)
    return {"isv": _isv(rng), "adam_t": np.array([int(rng.integers(0, 10_000))], np.int64),
            "thr_mult": uniform(rng, k, 0.5, 50.0), "thr_isv_index": index,
            "thr_power": rng.integers(1, 3, k).astype(I32),
            "q_abs_ref_index": isv_mod.Q_ABS_REF_INDEX,
            "slow_ema_index": isv_mod.GRAD_NORM_SLOW_EMA_INDEX, "weight_clamp_mult": F32(100.0),
            "max_grad_norm": F32(10.0), "anchor_mult": F32(3.0)}


def _s_clamp_isv(d: Dims, rng) -> Kwargs:
    """A bound of 1.5 * max(ISV, 1) over values of scale 3: some clamped; the BF16 mirror
    except in ``odd`` (the null-pointer path: an empty mirror)."""
    return {"x": normal(rng, (d.batch, d.hidden), 3.0), "isv": _isv(rng),
            "index": isv_mod.H_S2_RMS_EMA_INDEX, "mult": F32(1.5), "with_bf16": d.case != "odd"}


def _s_gather(d: Dims, rng) -> Kwargs:
    br = _branches(d)
    return {"logp_target": log_softmax(rng, (d.batch * sum(br), d.atoms)),
            "q_online": normal(rng, 2 * d.batch * sum(br)),
            "actions": np.stack([rng.integers(0, n, d.batch) for n in br]).astype(I32),
            "branches": br, "batch": d.batch}


def _s_front(d: Dims, rng) -> Kwargs:
    """The C51 front's inputs: the gathers' (``_s_gather``), the online pass's log-probabilities
    over ``[s; s2]`` (``q_rows = 2 batch`` samples per block) and the projection's targets,
    per-branch gammas and weights (n-step samples where the case has them)."""
    kwargs = _s_gather(d, rng)
    br, rows = kwargs["branches"], kwargs["q_online"].shape[0]
    nb = len(br)
    return {**kwargs, "logp": log_softmax(rng, (rows, d.atoms)), "r": normal(rng, d.batch, 3.0),
            "done": (rng.random(d.batch) < 0.2).astype(F32),
            "gamma": uniform(rng, nb, 0.9, 0.999), "z": support(d.atoms), "v_min": V_MIN,
            "v_max": V_MAX, "isw": uniform(rng, d.batch, 0.1, 1.0),
            "scale": F32(1.0 / (d.batch * 2)), **n_step_inputs(d, rng)}


def _not_taken_packed(kwargs) -> np.ndarray:
    """``[B * A_total, 1]`` mask of the branch-packed rows of actions not taken (written 0)."""
    rows = []
    for d, n in enumerate(kwargs["branches"]):
        rows.append((np.arange(n)[None, :] != kwargs["actions"][d][:, None]).reshape(-1))
    return np.concatenate(rows)[:, None]


def _sc_front(kwargs, expected):
    """``m``: the projection's bound on the gathered ``p_next`` (its few-ulp ``expf`` difference
    is far inside it); ``dlogits``: ``c51_project_grad``'s bound, the other actions' rows exact;
    ``dv`` and ``dadv`` sum (and subtract a mean of) up to ``A_total`` such terms per cell."""
    m_bound = project_bound({**kwargs, "p_next": expected["p_next"]})
    isw_scale = maxabs(kwargs["isw"]) * maxabs(kwargs["scale"])
    grad = isw_scale * max(maxabs(expected["m"]), 1.0) * m_bound["magnitude"]
    na, a_total = kwargs["z"].shape[0], sum(kwargs["branches"])
    return {"m": m_bound,
            "dlogits": {**reduction(na, grad), "exact": _not_taken_packed(kwargs)},
            "dv": reduction(na * (a_total + 1), grad),
            "dadv": reduction(2 * na * (a_total + 1), grad)}


def _s_scalar_targets(d: Dims, rng) -> Kwargs:
    nb = len(_branches(d))
    return {"p_next": softmax(rng, (nb, d.batch, d.atoms)), "z": support(d.atoms),
            "r": normal(rng, d.batch), "done": (rng.random(d.batch) < 0.2).astype(F32),
            "gamma": uniform(rng, nb, 0.9, 0.999), **n_step_inputs(d, rng)}


def _sc_scalar_targets(kwargs, expected):
    """1-step samples (and the done samples of n-step ones) bit for bit, as before issue 22;
    n-step samples within the effective gamma's error times ``|e| <= max|z|``."""
    return {"out": {**reduction(1, gamma_eff_slack(kwargs, maxabs(kwargs["z"]))),
                    "exact": n_step_exact(kwargs)[None, :]}}


def _s_branch_mean(d: Dims, rng) -> Kwargs:
    nb = len(_branches(d))
    return {"parts": normal(rng, (nb, d.batch), 2.0), "divisor": F32(nb)}


def _s_h2_mask(d: Dims, rng) -> Kwargs:
    """The heads' parts of dh2 (branches and value) and a pre-activation clamped at 1.5."""
    pre = normal(rng, (d.batch, d.hidden))
    return {"parts": normal(rng, (len(_branches(d)) + 1, d.batch, d.hidden), 1e-2),
            "h2": np.clip(pre, -1.5, 1.5).astype(F32), "h2_pre": pre}


def _s_h2_aux_mask(d: Dims, rng) -> Kwargs:
    """``_s_h2_mask`` and the auxiliary heads' ``d h2``: both heads (next bar, regime) on the
    presets' shapes, one head (the kernel's null second pointer) on the odd one."""
    kw = _s_h2_mask(d, rng)
    heads = 1 if d.case == "odd" else 2
    return {**kw, "aux": normal(rng, (heads, d.batch, d.hidden), 1e-2)}


def _s_h2_guard_mask(d: Dims, rng) -> Kwargs:
    """An auxiliary trunk's ``d h2`` (some of it beyond the guard's bound of 0.02, which clips
    it) and ``_s_h2_mask``'s activations."""
    kw = _s_h2_mask(d, rng)
    return {"x": normal(rng, (d.batch, d.hidden), 1e-2), "m": F32(0.02), "h2": kw["h2"],
            "h2_pre": kw["h2_pre"]}


def _s_loss_scalars(d: Dims, rng) -> Kwargs:
    nb = len(_branches(d))
    return {"c51_total": uniform(rng, nb, 0.0, 3.0), "terms": normal(rng, (nb, d.batch), 2.0),
            "q_taken": normal(rng, (nb, d.batch), 5.0), "target_q": normal(rng, (nb, d.batch), 5.0),
            "alpha": F32(1.0)}


def _s_step_scalars(d: Dims, rng) -> Kwargs:
    """Partials of a total norm of about 20 over a clip bound of 10 (Mech 6 fires), per-loss
    norms below and above their budgets, the loss entries of the readback."""
    partials = uniform(rng, max(1, d.flat // 4096 + 1), 0.0, 400.0 / max(1, d.flat // 4096 + 1))
    readback = normal(rng, len(READBACK_FIELDS))
    return {"total_partials": partials, "c51_sq": F32(30.0), "cql_sq": F32(1.0),
            "clip_bound": F32(10.0), "isv": _isv(rng), "readback": readback,
            "budget_c51": F32(7.0), "budget_cql": F32(1.5),
            "slow_ema_index": isv_mod.GRAD_NORM_SLOW_EMA_INDEX, "slow_alpha": F32(1e-3)}


def _s_merge(d: Dims, rng) -> Kwargs:
    n_slots, pieces = 55, 1 + d.actions
    flags = (rng.random(n_slots + pieces) < 0.3).astype(I32)
    return {"flags": flags, "piece_slot": rng.integers(0, n_slots, pieces).astype(I32),
            "n_slots": n_slots}


# ------------------------------------------------------------------------------ scales
def _sc_loss_scalars(kwargs, expected):
    """Means: sums of ``L`` terms ``x / L`` (``L = B`` per branch for the CQL terms, ``D * B``
    for the Q's), each of magnitude ``max|x| / L``."""
    b = kwargs["terms"].shape[1]
    n_q = kwargs["q_taken"].size
    return {"cql_loss": reduction(b, maxabs(kwargs["terms"]) * float(kwargs["alpha"]) / b),
            "mean_q": reduction(n_q, maxabs(kwargs["q_taken"]) / n_q),
            "mean_target_q": reduction(n_q, maxabs(kwargs["target_q"]) / n_q)}


def _sc_step_scalars(kwargs, expected):
    """The total norm sums the partials; the clip factor, the norm in the readback and the slow
    EMA follow it (relative to their size); every other element is exact."""
    count = kwargs["total_partials"].size
    norm_only = np.ones(len(READBACK_FIELDS), bool)
    norm_only[READBACK_INDEX["grad_norm"]] = False
    slow_only = np.ones(kwargs["isv"].shape, bool)
    slow_only[kwargs["slow_ema_index"]] = False
    follows = reduction(count, 0.0)
    return {"total_sq": reduction(count, maxabs(kwargs["total_partials"])),
            "safety_scale": follows, "readback": {**follows, "exact": norm_only},
            "isv": {**follows, "exact": slow_only}}


# ------------------------------------------------------------------------------ entries
ENTRIES: tuple[SpecEntry, ...] = (
    SpecEntry(
        name="step_bounds",
        outputs={"adam_t": Output("int64", EXACT), "weight_clamp": f32(EXACT),
                 "clip_bound": f32(EXACT), "thresholds": f32(EXACT)},
        sample=_s_step_bounds,
        targets=("isv", "thr_mult"),
        errors=error_cases(
            _s_step_bounds,
            lambda k: wrong_dtype(k, "adam_t"),
            lambda k: replace(k, thr_power=np.full_like(k["thr_power"], 3)),
            lambda k: replace(k, q_abs_ref_index=isv_mod.ISV_LEN),
            lambda k: replace(k, thr_isv_index=k["thr_isv_index"][:-1]),
        ),
    ),
    SpecEntry(
        name="clamp_finite_isv",
        outputs={"out": f32(EXACT), "out_bf16": u16(EXACT)},
        sample=_s_clamp_isv,
        targets=("x",),
        errors=error_cases(
            _s_clamp_isv,
            lambda k: wrong_dtype(k, "x"),
            lambda k: replace(k, index=isv_mod.ISV_LEN),
        ),
        contract=finite_outputs("out"),
    ),
    SpecEntry(
        name="double_dqn_gather_branches",
        outputs={"a_star": i32(EXACT), "p_next": f32(EXP_ULP), "q_taken": f32(EXACT)},
        sample=_s_gather,
        targets=("logp_target", "q_online"),
        errors=error_cases(
            _s_gather,
            lambda k: wrong_dtype(k, "logp_target"),
            lambda k: replace(k, actions=np.full_like(k["actions"], 99)),
            lambda k: replace(k, batch=k["batch"] + 1),
        ),
    ),
    # double_dqn_gather_branches, c51_project_grad per branch, the C51 dueling backward
    SpecEntry(
        name="c51_gather_project_dueling_branches",
        outputs={"a_star": i32(EXACT), "p_next": f32(EXP_ULP), "q_taken": f32(EXACT),
                 "m": f32(REDUCTION), "dlogits": f32(REDUCTION), "dv": f32(REDUCTION),
                 "dadv": f32(REDUCTION)},
        sample=_s_front,
        targets=("logp_target", "q_online", "logp", "r", "done", "gamma", "isw", "scale",
                 "discount"),
        errors=error_cases(
            _s_front,
            lambda k: wrong_dtype(k, "logp_target"),
            lambda k: replace(k, actions=np.full_like(k["actions"], 99)),
            lambda k: replace(k, logp=k["logp"][:-1]),
            lambda k: replace(k, gamma=k["gamma"][:-1]),
            lambda k: replace(k, v_min=20.0),
            lambda k: replace(k, isw=k["isw"][:-1]),
            lambda k: replace(k, batch=k["batch"] + 1),
        ),
        scales=_sc_front,
    ),
    SpecEntry(
        name="scalar_target_q_branches",
        outputs={"out": f32(REDUCTION)},
        sample=_s_scalar_targets,
        targets=("p_next", "r", "discount"),
        errors=error_cases(
            _s_scalar_targets,
            lambda k: wrong_dtype(k, "p_next"),
            lambda k: replace(k, z=k["z"][:-1]),
            lambda k: replace(k, discount=k["discount"][:-1]),
            lambda k: replace(k, gamma_ref=float("nan")),
        ),
        scales=_sc_scalar_targets,
    ),
    SpecEntry(
        name="branch_mean",
        outputs={"out": f32(EXACT)},
        sample=_s_branch_mean,
        targets=("parts",),
        errors=error_cases(
            _s_branch_mean,
            lambda k: wrong_dtype(k, "parts"),
            lambda k: replace(k, parts=k["parts"][0]),
        ),
    ),
    SpecEntry(
        name="h2_grad_sum_mask",
        outputs={"dh2": f32(EXACT), "out": f32(EXACT)},
        sample=_s_h2_mask,
        targets=("parts", "h2_pre"),
        errors=error_cases(
            _s_h2_mask,
            lambda k: wrong_dtype(k, "parts"),
            lambda k: replace(k, h2=k["h2"][:-1]),
        ),
    ),
    SpecEntry(
        name="h2_grad_sum_aux_mask",
        outputs={"dh2_main": f32(EXACT), "dh2": f32(EXACT), "out": f32(EXACT)},
        sample=_s_h2_aux_mask,
        targets=("parts", "aux", "h2_pre"),
        errors=error_cases(
            _s_h2_aux_mask,
            lambda k: wrong_dtype(k, "aux"),
            lambda k: replace(k, aux=np.concatenate([k["aux"]] * 3)[:3]),
            lambda k: replace(k, aux=k["aux"][:, :-1]),
            lambda k: replace(k, h2=k["h2"][:-1]),
        ),
    ),
    SpecEntry(
        name="h2_guard_mask",
        outputs={"dh2": f32(EXACT), "out": f32(EXACT)},
        sample=_s_h2_guard_mask,
        targets=("x", "h2_pre"),
        errors=error_cases(
            _s_h2_guard_mask,
            lambda k: wrong_dtype(k, "x"),
            lambda k: replace(k, m=F32(-1.0)),
            lambda k: replace(k, h2=k["h2"][:-1]),
        ),
    ),
    SpecEntry(
        name="loss_scalars",
        outputs={"c51_loss": f32(EXACT), "cql_loss": f32(REDUCTION), "mean_q": f32(REDUCTION),
                 "mean_target_q": f32(REDUCTION)},
        sample=_s_loss_scalars,
        targets=("c51_total", "terms", "q_taken"),
        errors=error_cases(
            _s_loss_scalars,
            lambda k: wrong_dtype(k, "terms"),
            lambda k: replace(k, q_taken=k["q_taken"][:-1]),
        ),
        scales=_sc_loss_scalars,
    ),
    SpecEntry(
        name="step_scalars",
        outputs={"total_sq": f32(REDUCTION), "safety_scale": f32(REDUCTION),
                 "readback": f32(REDUCTION), "isv": f32(REDUCTION)},
        sample=_s_step_scalars,
        targets=("total_partials",),
        errors=error_cases(
            _s_step_scalars,
            lambda k: wrong_dtype(k, "total_partials"),
            lambda k: replace(k, readback=k["readback"][:-1]),
            lambda k: replace(k, slow_ema_index=-1),
        ),
        scales=_sc_step_scalars,
    ),
    SpecEntry(
        name="merge_piece_flags",
        outputs={"out": i32(EXACT)},
        sample=_s_merge,
        targets=(),  # int32 flags and slots only: no float to poison
        errors=error_cases(
            _s_merge,
            lambda k: replace(k, piece_slot=np.full_like(k["piece_slot"], 99)),
            lambda k: replace(k, n_slots=k["n_slots"] + 1),
        ),
    ),
)

# The pointer variant (the scalar read from device memory, graph-fed by the ISV): the same
# kernel body, so the same samples, tolerances and error cases.
ENTRIES += tuple(dataclasses.replace(e, name="loss_scalars_ptr") for e in ENTRIES
                 if e.name == "loss_scalars")
