"""The CPU twins (``foxhunt.fast.cpu_kernels.Twin``) of the kernels the second-wave sources add
to the fast step, and of the generic kernels only they launch (``clamp_finite``,
``grad_norm_final``, ``clip_grad_inplace``, ``saxpy``). Registered in ``cpu_kernels.TWINS`` when
``cpu_kernels`` is imported; same rules as there (extents from the launch's scalars, ``run``
calls the same-name reference kernel on copies of the views).
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.cpu_kernels import branches, n_step_args, signal_bound, twin
from foxhunt.reference.isv import AUX_LABEL_SCALE_EMA_INDEX, ISV_LEN, SHARPE_CLAMP, SHARPE_GAIN
from foxhunt.reference.kernels import aux, ensemble, iqn, optim, safety, warmup, wave
from foxhunt.reference.kernels import step as rstep

F32 = np.float32
_READBACK = len(rstep.READBACK_FIELDS)


# --------------------------------------------------------------------------------------------
# Generic kernels
# --------------------------------------------------------------------------------------------


@twin("clamp_finite", x="n", out="n", signal=1)
def _clamp_finite(a):
    return {"out": safety.clamp_finite(a.x, signal_bound(a))}


@twin("grad_norm_final", partials="count", out=1)
def _grad_norm_final(a):
    return {"out": [optim.grad_norm_final(a.partials)]}


@twin("clip_grad_inplace", x="n", norm_sq=1)
def _clip_grad_inplace(a):
    return {"x": optim.clip_grad_inplace(a.x, a.max_norm, a.norm_sq[0])}


@twin("saxpy", y="n", x="n")
def _saxpy(a):
    return {"y": optim.saxpy(a.y, a.x, a.a)}


# --------------------------------------------------------------------------------------------
# Auxiliary heads, ensemble diversity, MSE warm-up
# --------------------------------------------------------------------------------------------


@twin("add_bias_elu", y=("rows", "cols"), b="cols", out=("rows", "cols"))
def _add_bias_elu(a):
    return {"out": aux.add_bias_elu(a.y, a.b)}


@twin("elu_backward", dy="n", h="n", dx="n")
def _elu_backward(a):
    # The kernel is flat over n elements; the reference takes the [rows, cols] layer.
    return {"dx": aux.elu_backward(a.dy.reshape(1, -1), a.h.reshape(1, -1)).reshape(-1)}


@twin("aux_next_bar_loss_grad", pred="batch", next_ret="batch", isv=ISV_LEN, d_pred="batch",
      loss=1)
def _aux_next_bar_loss_grad(a):
    r = aux.aux_next_bar_loss_grad(a.pred, a.next_ret, a.isv, a.label_scale_index,
                                   a.scale_floor, a.weight)
    return {"d_pred": r.d_pred, "loss": [r.loss]}


@twin("aux_regime_loss_grad", logits=("batch", "n_regimes"), regime="batch",
      d_logits=("batch", "n_regimes"), loss=1)
def _aux_regime_loss_grad(a):
    r = aux.aux_regime_loss_grad(a.logits, a.regime, a.weight)
    return {"d_logits": r.d_logits, "loss": [r.loss]}


@twin("isv_label_scale_update", isv=ISV_LEN, next_ret="n", sharpe=1)
def _isv_label_scale_update(a):
    if a.slot != AUX_LABEL_SCALE_EMA_INDEX:
        raise ValueError(f"isv_label_scale_update: slot {a.slot}; the reference writes slot "
                         f"{AUX_LABEL_SCALE_EMA_INDEX}")
    if (F32(a.sharpe_clamp), F32(a.sharpe_gain)) != (F32(SHARPE_CLAMP), F32(SHARPE_GAIN)):
        raise ValueError(f"isv_label_scale_update: sharpe_clamp {a.sharpe_clamp}, sharpe_gain "
                         f"{a.sharpe_gain} are not the ISV bus's {SHARPE_CLAMP}, {SHARPE_GAIN}")
    return {"isv": aux.isv_label_scale_update(a.isv, a.next_ret, a.sharpe[0], a.alpha_base)}


@twin("ens_kl_grad", v=("batch", "num_atoms"), priors=("n_priors", "batch", "num_atoms"),
      d_v=("batch", "num_atoms"), kl="batch", loss=1)
def _ens_kl_grad(a):
    r = ensemble.ens_kl_grad(a.v, a.priors, a.eps)
    return {"d_v": r.d_v, "kl": r.kl, "loss": [r.loss]}


def _mse_rows(a, rows: str):
    return getattr(a, rows) * sum(branches(a, a.n_branches))


@twin("mse_warmup", logp=(lambda a: _mse_rows(a, "block_rows"), "num_atoms"),
      actions=("n_branches", "batch"), q_taken=("n_branches", "batch"),
      target_q=("n_branches", "batch"), isw="batch", z="num_atoms",
      dlogits=(lambda a: _mse_rows(a, "batch"), "num_atoms"), isv=ISV_LEN,
      n_actions="n_branches", action_offset="n_branches", loss=1, weight=1)
def _mse_warmup(a):
    r = warmup.mse_warmup(a.logp, a.actions, a.q_taken, a.target_q, a.isw, a.z, a.dlogits, a.isv,
                          a.epoch_index, a.warmup_epochs, branches(a, a.n_branches))
    return {"dlogits": r.dlogits, "loss": [r.loss], "weight": [r.w]}


# --------------------------------------------------------------------------------------------
# IQN head
# --------------------------------------------------------------------------------------------


@twin("iqn_tau_cos", step=1, tau="rows", cosines=("rows", "n_cos"))
def _iqn_tau_cos(a):
    r = iqn.iqn_tau_cos(a.step, a.key_lo, a.key_hi, a.stream, a.rows, a.n_cos)
    return {"tau": r.tau, "cosines": r.cosines}


def _sample_rows(a):
    return a.rows // a.n_quantiles


@twin("iqn_modulate", nullable=("e", "e_bf16"), h2=(_sample_rows, "hidden"),
      phi=("rows", "hidden"), e=("rows", "hidden"), e_bf16=("rows", "hidden"))
def _iqn_modulate(a):
    if a.rows % a.n_quantiles:
        raise ValueError(f"iqn_modulate: rows {a.rows} is not a multiple of n_quantiles "
                         f"{a.n_quantiles}")
    with_bf16 = a.view("e_bf16") is not None
    if a.view("e") is None and not with_bf16:
        raise ValueError("iqn_modulate: e and e_bf16 are both null (nothing to write)")
    r = iqn.iqn_modulate(a.h2, a.phi, a.n_quantiles, with_bf16)
    out = {"e_bf16": r.e_bf16} if with_bf16 else {}
    if a.view("e") is not None:
        out["e"] = r.e
    return out


def _quantile_rows(a):
    return a.batch * a.n_quantiles


@twin("iqn_modulate_backward", de=(_quantile_rows, "hidden"), h2=("batch", "hidden"),
      phi=(_quantile_rows, "hidden"), d_h2=("batch", "hidden"),
      d_phi_pre=(_quantile_rows, "hidden"))
def _iqn_modulate_backward(a):
    r = iqn.iqn_modulate_backward(a.de, a.h2, a.phi, a.n_quantiles)
    return {"d_h2": r.d_h2, "d_phi_pre": r.d_phi_pre}


_Q = (_quantile_rows, "a_total")


@twin("iqn_quantile_huber", nullable=("discount",), q=_Q, q_target=_Q, tau=_quantile_rows,
      actions=("n_branches", "batch"), a_star=("n_branches", "batch"), r="batch", done="batch",
      gamma="n_branches", isw="batch", isv=ISV_LEN, n_actions="n_branches",
      action_offset="n_branches", discount="batch", y=("n_branches", "batch", "n_quantiles"),
      dq=_Q, loss=1)
def _iqn_quantile_huber(a):
    table = branches(a, a.n_branches)
    if sum(table) != a.a_total:
        raise ValueError(f"iqn_quantile_huber: a_total {a.a_total} is not the branches' "
                         f"{sum(table)} actions")
    r = iqn.iqn_quantile_huber(a.q, a.q_target, a.tau, a.actions, a.a_star, a.r, a.done,
                               a.gamma, a.isw, a.isv, a.q_abs_ref_index, a.k1, table,
                               a.n_quantiles, *n_step_args(a))
    return {"y": r.y, "dq": r.dq, "loss": [r.loss]}


# --------------------------------------------------------------------------------------------
# Second-wave step plumbing
# --------------------------------------------------------------------------------------------


@twin("step_count_advance", step_count=1)
def _step_count_advance(a):
    return {"step_count": wave.step_count_advance(a.step_count)}


@twin("clip_saxpy_norm_partial_wave", base="n", inject="n", base_partials="count",
      inject_partials="count", iqn="iqn_n", iqn_partials="count", ens="ens_n",
      ens_partials="count", out="n", partials=lambda a: -(-a.n // a.block_size),
      base_norm_sq_out=1, inject_norm_sq_out=1, iqn_norm_sq_out=1, ens_norm_sq_out=1,
      nullable=("iqn", "iqn_partials", "iqn_norm_sq_out", "ens", "ens_partials",
                "ens_norm_sq_out"))
def _clip_saxpy_norm_partial_wave(a):
    r = wave.clip_saxpy_norm_partial_wave(
        a.base, a.inject, a.base_max_norm, a.base_partials, a.a, a.inject_max_norm,
        a.inject_partials, a.iqn, a.iqn_a, a.iqn_max_norm, a.iqn_partials, a.ens, a.ens_a,
        a.ens_max_norm, a.ens_partials, a.block_size)
    out = {"out": r.out, "partials": r.partials, "base_norm_sq_out": [r.base_norm_sq],
           "inject_norm_sq_out": [r.inject_norm_sq]}
    for src, sq in (("iqn", r.iqn_norm_sq), ("ens", r.ens_norm_sq)):
        if getattr(a, f"{src}_partials") is not None:  # an off source's norm is not written
            out[f"{src}_norm_sq_out"] = [sq]
    return out


@twin("source_norm_scalars", norm_sq=1, readback=_READBACK)
def _source_norm_scalars(a):
    return {"readback": wave.source_norm_scalars(a.norm_sq, a.readback, a.budget, a.pre_index,
                                                 a.post_index)}


@twin("mse_loss_blend", readback=_READBACK)
def _mse_loss_blend(a):
    return {"readback": wave.mse_loss_blend(a.readback, a.c51_index, a.mse_loss_index,
                                            a.mse_weight_index)}
