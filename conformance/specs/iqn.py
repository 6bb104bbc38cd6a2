"""Entries of the IQN head's kernels (``cuda_src/iqn.cu``, reference
``foxhunt.reference.kernels.iqn``).

Every output is exact but one: the kernels round where the reference does, in its order
(``iqn_quantile_huber``'s loss total is ``step.block_total``'s one-block tree in both). The
exception is ``iqn_tau_cos``' cosines: both compute the float64 cosine of the same float64
argument and round it to float32 once; CUDA's double ``cos`` and NumPy's differ by a few
float64 ulp, which changes the float32 result only when the value lies within those few ulp of
a float32 rounding midpoint, and then by one float32 ulp (``COS_ULP``). The fractions
themselves are integer arithmetic: bit for bit.

Shapes: ``N`` quantile fractions per sample (the contract's 5; 3 in ``odd``, with a feature
count of 67 that is no power of two), three branches as in the step kernels' entries.
"""

from __future__ import annotations

import numpy as np

from foxhunt.conformance.kernel_spec import Dims, Kwargs, SpecEntry, no_overflow
from foxhunt.conformance.specs.inputs import (
    F32,
    I32,
    error_cases,
    f32,
    finite_outputs,
    isv_vector,
    normal,
    replace,
    u16,
    uniform,
    wrong_dtype,
)
from foxhunt.conformance.specs.distributional import gamma_eff_slack, n_step_exact, n_step_inputs
from foxhunt.conformance.specs.inputs import maxabs, reduction
from foxhunt.conformance.tolerance import EXACT, REDUCTION, Tolerance
from foxhunt.reference import isv as isv_mod
from foxhunt.reference.kernels.fused import branch_offsets
from foxhunt.reference.kernels.rng import MAX_INDEX, STREAMS

#: Bit for bit (integer arithmetic, an exact conversion).
BITWISE = Tolerance.exact(bitwise=True, nan_payload=False)
#: Two float64 cosines a few ulp apart, each rounded once to float32.
COS_ULP = Tolerance.ulp(1)


def _n_quantiles(d: Dims) -> int:
    return 3 if d.case == "odd" else 5


def _n_cos(d: Dims) -> int:
    return 67 if d.case == "odd" else 64


def _branches(d: Dims) -> tuple[int, ...]:
    """Three branches, two of them as wide as the case's largest (the seed's (3, 3, 2))."""
    return (d.actions, d.actions, max(1, d.actions - 1))


def _activation(rng, shape) -> np.ndarray:
    """A post-ReLU activation: non-negative, about a third exact zeros."""
    return np.maximum(normal(rng, shape), F32(0)).astype(F32)


# ------------------------------------------------------------------------------ samples
def _s_tau_cos(d: Dims, rng) -> Kwargs:
    """A step count past 2**32 (``odd``: below it), a 64-bit key, one of the two IQN streams."""
    high = 0 if d.case == "odd" else int(rng.integers(1, 1 << 20))
    step = (high << 32) | int(rng.integers(0, MAX_INDEX, dtype=np.uint64))
    return {"step": np.array([step], np.int64),
            "key_lo": int(rng.integers(0, MAX_INDEX, dtype=np.uint64)),
            "key_hi": int(rng.integers(0, MAX_INDEX, dtype=np.uint64)),
            "stream": STREAMS["iqn_tau_target" if d.case == "seed" else "iqn_tau_online"],
            "rows": d.batch * _n_quantiles(d), "n_cos": _n_cos(d)}


def _s_modulate(d: Dims, rng) -> Kwargs:
    """The BF16 mirror except in ``odd`` (the null-pointer path: an empty mirror)."""
    n = _n_quantiles(d)
    return {"h2": _activation(rng, (d.batch, d.hidden)),
            "phi": _activation(rng, (d.batch * n, d.hidden)), "n_quantiles": n,
            "with_bf16": d.case != "odd"}


def _s_modulate_backward(d: Dims, rng) -> Kwargs:
    n = _n_quantiles(d)
    return {"de": normal(rng, (d.batch * n, d.hidden), 1e-2),
            "h2": _activation(rng, (d.batch, d.hidden)),
            "phi": _activation(rng, (d.batch * n, d.hidden)), "n_quantiles": n}


def _s_quantile_huber(d: Dims, rng) -> Kwargs:
    """Quantiles of scale 3 and a Mech 1 bound of ``2 * max(ISV, 1)``: some targets clipped,
    errors on both sides of the Huber threshold. In the extremal case the first sample takes
    action 0 in branch 0 and the last sample the last action of the last branch, so the
    poisoned first and last elements of ``q`` / ``q_target`` are read."""
    # The odd case's N = 37: a block's pairs span many rho tiles (max(1, 8192 // N^2) = 5 pairs
    # each; fast/kernels/iqn.py), the path the seed's N = 8 never takes.
    br, n, b = _branches(d), (37 if d.case == "odd" else _n_quantiles(d)), d.batch
    actions = np.stack([rng.integers(0, k, b) for k in br]).astype(I32)
    a_star = np.stack([rng.integers(0, k, b) for k in br]).astype(I32)
    if d.case == "extremal":
        actions[0, 0] = a_star[0, 0] = 0
        actions[-1, -1] = a_star[-1, -1] = br[-1] - 1
    return {"q": normal(rng, (b * n, sum(br)), 3.0), "q_target": normal(rng, (b * n, sum(br)), 3.0),
            "tau": uniform(rng, b * n, 0.0, 1.0), "actions": actions, "a_star": a_star,
            "r": normal(rng, b), "done": (rng.random(b) < 0.2).astype(F32),
            "gamma": uniform(rng, len(br), 0.9, 0.999), "isw": uniform(rng, b, 0.2, 1.5),
            "isv": isv_vector(rng), "q_abs_ref_index": isv_mod.Q_ABS_REF_INDEX, "k1": F32(2.0),
            "branches": br, "n_quantiles": n, **n_step_inputs(d, rng)}


def _sc_quantile_huber(kwargs, expected):
    """1-step samples bit for bit (every output, as before issue 22; the done samples of n-step
    ones too). n-step: a target ``y`` moves by at most the effective gamma's error times
    ``|q_target|``; ``dq`` (``c_b`` times N terms, each of slope <= 1 in ``y``; ``w`` jumps only
    where ``clip(u)`` is 0) and the loss (``sum c_b`` times ``N^2`` such terms over ``B N D``)
    by that times ``c_b N`` and ``max(isw) N``."""
    n, qt = kwargs["n_quantiles"], maxabs(kwargs["q_target"])
    c_max = maxabs(kwargs["isw"]) / (kwargs["r"].shape[0] * len(kwargs["branches"]) * n)
    rows = n_step_exact(kwargs)
    return {"y": {**reduction(1, gamma_eff_slack(kwargs, qt)), "exact": rows[None, :, None]},
            "dq": {**reduction(n, gamma_eff_slack(kwargs, c_max * qt)),
                   "exact": np.repeat(rows, n)[:, None]},
            "loss": {**reduction(1, gamma_eff_slack(kwargs, maxabs(kwargs["isw"]) * n * qt)),
                     "exact": np.array(rows.all())}}


# ------------------------------------------------------------------------------ contracts
def _c_tau_cos(kwargs, outputs, poisoned) -> list[str]:
    tau, cosines = outputs["tau"].astype(np.float64), outputs["cosines"].astype(np.float64)
    problems = []
    grid = tau * 2.0**24
    if not (np.all((tau > 0) & (tau < 1)) and np.all((grid == np.round(grid)) & (grid % 2 == 1))):
        problems.append("tau: a fraction that is not an odd multiple of 2**-24 in (0, 1)")
    if not np.all(np.abs(cosines) <= 1):
        problems.append("cosines: a feature outside [-1, 1]")
    if not np.all(cosines[:, 0] == 1):
        problems.append("cosines: feature k = 0 is not cos(0) = 1")
    return problems


def _c_quantile_huber(kwargs, outputs, poisoned) -> list[str]:
    """``dq`` is +0.0 (bits) outside each sample's taken columns; finite ``y`` within the bound."""
    dq, n = outputs["dq"], kwargs["n_quantiles"]
    taken = np.zeros(dq.shape, bool)
    rows = np.arange(kwargs["r"].shape[0]) * n
    for d, off in enumerate(branch_offsets(kwargs["branches"])):
        for i in range(n):
            taken[rows + i, off + kwargs["actions"][d]] = True
    problems = []
    if np.any(dq[~taken].view(np.uint32) != 0):
        problems.append("dq: an element outside the taken columns is not +0.0")
    isv = kwargs["isv"][kwargs["q_abs_ref_index"]]
    bound = np.float32(kwargs["k1"]) * np.fmax(isv, np.float32(1))
    y = outputs["y"]
    if np.any(np.abs(y[np.isfinite(y)]) > bound):
        problems.append("y: a finite target beyond the Mech 1 bound")
    return problems


# ------------------------------------------------------------------------------ entries
ENTRIES: tuple[SpecEntry, ...] = (
    SpecEntry(
        name="iqn_tau_cos",
        outputs={"tau": f32(BITWISE), "cosines": f32(COS_ULP)},
        sample=_s_tau_cos,
        targets=(),  # integer arguments only: no float to poison
        errors=error_cases(
            _s_tau_cos,
            lambda k: replace(k, step=np.array([-1], np.int64)),
            lambda k: replace(k, step=k["step"].astype(np.int32)),
            lambda k: replace(k, key_hi=MAX_INDEX),
            lambda k: replace(k, n_cos=0),
        ),
        contract=_c_tau_cos,
    ),
    SpecEntry(
        name="iqn_modulate",
        outputs={"e": f32(EXACT), "e_bf16": u16(BITWISE)},
        sample=_s_modulate,
        targets=("h2", "phi"),
        errors=error_cases(
            _s_modulate,
            lambda k: wrong_dtype(k, "phi"),
            lambda k: replace(k, phi=k["phi"][:-1]),
            lambda k: replace(k, n_quantiles=0),
        ),
    ),
    SpecEntry(
        name="iqn_quantile_huber",
        outputs={"y": f32(REDUCTION), "dq": f32(REDUCTION), "loss": f32(REDUCTION)},
        sample=_s_quantile_huber,
        targets=("q", "q_target", "tau", "r", "isw", "discount"),
        errors=error_cases(
            _s_quantile_huber,
            lambda k: wrong_dtype(k, "q"),
            lambda k: replace(k, q_target=k["q_target"][:-1]),
            lambda k: replace(k, actions=np.full_like(k["actions"], 99)),
            lambda k: replace(k, q_abs_ref_index=isv_mod.ISV_LEN),
            lambda k: replace(k, gamma=k["gamma"][:-1]),
            lambda k: replace(k, discount=k["discount"][:, None]),
        ),
        scales=_sc_quantile_huber,
        contract=_c_quantile_huber,
    ),
    SpecEntry(
        name="iqn_modulate_backward",
        outputs={"d_h2": f32(EXACT), "d_phi_pre": f32(EXACT)},
        sample=_s_modulate_backward,
        targets=("de", "h2", "phi"),
        errors=error_cases(
            _s_modulate_backward,
            lambda k: wrong_dtype(k, "de"),
            lambda k: replace(k, de=k["de"][:, :-1]),
        ),
        contract=finite_outputs("d_h2", when=no_overflow),
    ),
)
