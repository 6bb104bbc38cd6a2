"""The CPU twins (``foxhunt.fast.cpu_kernels.Twin``) of the kernels the second-wave sources add
to the fast step, and of the generic kernels only they launch (``clamp_finite``,
``grad_norm_final``, ``clip_grad_inplace``). Registered in ``cpu_kernels.TWINS`` when
``cpu_kernels`` is imported; same rules as there (extents from the launch's scalars, ``run``
calls the same-name reference kernel on copies of the views).
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.cpu_kernels import branches, twin
from foxhunt.reference.isv import ISV_LEN
from foxhunt.reference.kernels import iqn, optim, safety, wave
from foxhunt.reference.kernels import step as rstep

F32 = np.float32
_READBACK = len(rstep.READBACK_FIELDS)


# --------------------------------------------------------------------------------------------
# Generic kernels
# --------------------------------------------------------------------------------------------


@twin("clamp_finite", x="n", out="n", signal=1)
def _clamp_finite(a):
    # The kernel's bound: multiplier * fmaxf(*signal, 1) (safety.isv_bound's value).
    return {"out": safety.clamp_finite(a.x, safety.isv_bound(a.multiplier, a.signal[0]))}


@twin("grad_norm_final", partials="count", out=1)
def _grad_norm_final(a):
    return {"out": [optim.grad_norm_final(a.partials)]}


@twin("clip_grad_inplace", x="n", norm_sq=1)
def _clip_grad_inplace(a):
    return {"x": optim.clip_grad_inplace(a.x, a.max_norm, a.norm_sq[0])}


# --------------------------------------------------------------------------------------------
# IQN head
# --------------------------------------------------------------------------------------------


@twin("iqn_tau_cos", step=1, tau="rows", cosines=("rows", "n_cos"))
def _iqn_tau_cos(a):
    r = iqn.iqn_tau_cos(a.step, a.key_lo, a.key_hi, a.stream, a.rows, a.n_cos)
    return {"tau": r.tau, "cosines": r.cosines}


def _sample_rows(a):
    return a.rows // a.n_quantiles


@twin("iqn_modulate", nullable=("e_bf16",), h2=(_sample_rows, "hidden"), phi=("rows", "hidden"),
      e=("rows", "hidden"), e_bf16=("rows", "hidden"))
def _iqn_modulate(a):
    if a.rows % a.n_quantiles:
        raise ValueError(f"iqn_modulate: rows {a.rows} is not a multiple of n_quantiles "
                         f"{a.n_quantiles}")
    with_bf16 = a.view("e_bf16") is not None
    r = iqn.iqn_modulate(a.h2, a.phi, a.n_quantiles, with_bf16)
    return {"e": r.e, "e_bf16": r.e_bf16} if with_bf16 else {"e": r.e}


def _quantile_rows(a):
    return a.batch * a.n_quantiles


@twin("iqn_modulate_backward", de=(_quantile_rows, "hidden"), h2=("batch", "hidden"),
      phi=(_quantile_rows, "hidden"), d_h2=("batch", "hidden"),
      d_phi_pre=(_quantile_rows, "hidden"))
def _iqn_modulate_backward(a):
    r = iqn.iqn_modulate_backward(a.de, a.h2, a.phi, a.n_quantiles)
    return {"d_h2": r.d_h2, "d_phi_pre": r.d_phi_pre}


_Q = (_quantile_rows, "a_total")


@twin("iqn_quantile_huber", q=_Q, q_target=_Q, tau=_quantile_rows, actions=("n_branches", "batch"),
      a_star=("n_branches", "batch"), r="batch", done="batch", gamma="n_branches", isw="batch",
      isv=ISV_LEN, n_actions="n_branches", action_offset="n_branches",
      y=("n_branches", "batch", "n_quantiles"), dq=_Q, loss=1)
def _iqn_quantile_huber(a):
    table = branches(a, a.n_branches)
    if sum(table) != a.a_total:
        raise ValueError(f"iqn_quantile_huber: a_total {a.a_total} is not the branches' "
                         f"{sum(table)} actions")
    r = iqn.iqn_quantile_huber(a.q, a.q_target, a.tau, a.actions, a.a_star, a.r, a.done,
                               a.gamma, a.isw, a.isv, a.q_abs_ref_index, a.k1, table,
                               a.n_quantiles)
    return {"y": r.y, "dq": r.dq, "loss": [r.loss]}


# --------------------------------------------------------------------------------------------
# Second-wave step plumbing
# --------------------------------------------------------------------------------------------


@twin("step_count_advance", step_count=1)
def _step_count_advance(a):
    return {"step_count": wave.step_count_advance(a.step_count)}


@twin("source_norm_scalars", norm_sq=1, readback=_READBACK)
def _source_norm_scalars(a):
    return {"readback": wave.source_norm_scalars(a.norm_sq, a.readback, a.budget, a.pre_index,
                                                 a.post_index)}


@twin("mse_loss_blend", readback=_READBACK)
def _mse_loss_blend(a):
    return {"readback": wave.mse_loss_blend(a.readback, a.c51_index, a.mse_loss_index,
                                            a.mse_weight_index)}
