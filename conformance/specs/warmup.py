"""Entry of the MSE warm-up kernel ``mse_warmup`` on the step's branch-packed buffers: the online
log-probabilities of ``[s; s2]`` (``R = 2B`` samples per block), the C51 logit gradient, the
taken-action Q and the Mech 1 clipped targets; the epoch counter in the ISV.

The shape cases cover the three regimes of the blend weight: ``tiny`` at epoch 0 (``w = 1``),
``seed`` inside the warm-up (``w = 0.75``), ``odd`` after it (``w = 0``: the C51 gradient comes
back bit for bit).

Tolerances: ``w`` exact; the gradient exact wherever no ``expf`` is involved (every action but
the taken one, and every element when ``w == 0``), and within a few ulp of the taken row's terms
otherwise (a reduction bound of a few terms); the loss is a block-tree sum (reduction).
"""

from __future__ import annotations

import numpy as np

from foxhunt.conformance.kernel_spec import Dims, Kwargs, SpecEntry
from foxhunt.conformance.specs.inputs import (
    F32,
    I32,
    error_cases,
    f32,
    isv_vector,
    log_softmax,
    maxabs,
    normal,
    reduction,
    replace,
    support,
    uniform,
    wrong_dtype,
)
from foxhunt.conformance.tolerance import EXACT, REDUCTION
from foxhunt.reference import isv as isv_mod
from foxhunt.reference.kernels.fused import branch_offsets, split_branches

#: Warm-up length and epoch of each shape case: (W, epoch) -> w = max(0, 1 - epoch / W).
CASE_EPOCHS = {"tiny": (4, 0), "seed": (4, 1), "odd": (3, 5), "extremal": (4, 1)}
#: The few float32 roundings between an ``expf`` and an output element (a reduction bound's
#: length for an elementwise output).
TAKEN_ROUNDINGS = 4


def _branches(d: Dims) -> tuple[int, ...]:
    """Three branches, two of them as wide as the case's largest (the seed's (3, 3, 2))."""
    return (d.actions, d.actions, max(1, d.actions - 1))


def _taken_mask(actions: np.ndarray, branches) -> np.ndarray:
    """``[B * A_total, 1]`` mask of the taken actions' rows of a branch-packed gradient."""
    nb, batch = actions.shape
    mask = np.zeros((batch * sum(branches), 1), bool)
    for d, (n, off) in enumerate(zip(branches, branch_offsets(branches))):
        mask[batch * off + np.arange(batch) * n + actions[d], 0] = True
    return mask


def _s_mse(d: Dims, rng) -> Kwargs:
    br = _branches(d)
    batch, na = d.batch, d.atoms
    logp = log_softmax(rng, (2 * batch * sum(br), na))
    actions = np.stack([rng.integers(0, n, batch) for n in br]).astype(I32)
    z = support(na)
    rows = np.arange(batch)
    q_taken = np.stack([(np.exp(x[rows, actions[k]]) @ z) for k, x in
                        enumerate(split_branches(logp, br))]).astype(F32)
    dlogits = np.where(_taken_mask(actions, br), normal(rng, (batch * sum(br), na), 1e-3),
                       F32(0)).astype(F32)
    warmup, epoch = CASE_EPOCHS[d.case]
    isv = isv_vector(rng)
    isv[isv_mod.EPOCH_IDX_INDEX] = F32(epoch)
    return {"logp": logp, "actions": actions, "q_taken": q_taken,
            "target_q": normal(rng, (len(br), batch), 3.0), "isw": uniform(rng, batch, 0.1, 1.0),
            "z": z, "dlogits_c51": dlogits, "isv": isv,
            "epoch_index": isv_mod.EPOCH_IDX_INDEX, "warmup_epochs": warmup, "branches": br}


def _sc_mse(kwargs, expected):
    """Taken rows: ``w * g`` with ``|g| <= |isw scale td| * 2 max|z|`` next to ``(1 - w) c``;
    every other element (all of them when ``w == 0``) exact. The loss sums ``D * B`` parts."""
    nb, batch = kwargs["actions"].shape
    scale = 1.0 / (batch * nb)
    w = float(expected["w"])
    with np.errstate(all="ignore"):
        td = kwargs["q_taken"].astype(np.float64) - kwargs["target_q"]
    coef = maxabs(kwargs["isw"]) * scale * maxabs(td)
    g = coef * 2 * maxabs(kwargs["z"])
    exact = ~_taken_mask(kwargs["actions"], kwargs["branches"]) | (w == 0)
    mag = w * g + (1 - w) * maxabs(kwargs["dlogits_c51"])
    part = maxabs(kwargs["isw"]) * 0.5 * maxabs(td) ** 2 * scale
    return {"dlogits": {**reduction(TAKEN_ROUNDINGS, mag), "exact": exact},
            "loss": reduction(nb * batch, part)}


ENTRIES: tuple[SpecEntry, ...] = (
    SpecEntry(
        name="mse_warmup",
        outputs={"dlogits": f32(REDUCTION), "loss": f32(REDUCTION), "w": f32(EXACT)},
        sample=_s_mse,
        targets=("logp", "q_taken", "target_q", "dlogits_c51"),
        errors=error_cases(
            _s_mse,
            lambda k: wrong_dtype(k, "logp"),
            lambda k: replace(k, actions=np.full_like(k["actions"], 99)),
            lambda k: replace(k, target_q=k["target_q"][:, :-1]),
            lambda k: replace(k, warmup_epochs=0),
            lambda k: replace(k, epoch_index=isv_mod.ISV_LEN),
        ),
        scales=_sc_mse,
    ),
)
