"""CPU twins of the issue-19 ISV producers the fast step launches (``foxhunt.fast.isv_plan``),
registered into ``foxhunt.fast.cpu_kernels.TWINS``; each calls its reference kernel
(``foxhunt.reference.kernels.isv_producers``, ``kernels.isv``) after checking that the launch's
slot arguments are the registry's. Also the twins of the consumers' pointer variants
(``loss_scalars_ptr``, ``polyak_update_mirror_ptr``)."""

from __future__ import annotations

import numpy as np

from foxhunt.fast.cpu_kernels import twin
from foxhunt.reference import isv as reg
from foxhunt.reference.kernels import isv as risv
from foxhunt.reference.kernels import optim
from foxhunt.reference.kernels import step as rstep
from foxhunt.reference.kernels import isv_producers as prod

_SIG = {name: i for i, name in enumerate(reg.SIGNAL_NAMES)}


def _check(kernel: str, **pairs) -> None:
    for name, (got, want) in pairs.items():
        if int(got) != int(want):
            raise ValueError(f"{kernel}: {name}={got}; the reference uses {want}")


def _alpha_base(a, kernel: str) -> np.float32:
    _check(kernel, sharpe_slot=(a.sharpe_slot, reg.SHARPE_EMA_INDEX))
    if np.float32(a.sharpe_clamp) != np.float32(reg.SHARPE_CLAMP) or \
            np.float32(a.sharpe_gain) != np.float32(reg.SHARPE_GAIN):
        raise ValueError(f"{kernel}: sharpe_clamp / sharpe_gain are not the registry's")
    return a.alpha_base


@twin("isv_signal_build", isv=reg.ISV_LEN, q_taken=("nb", "B"), td="B", r="B",
      p_next=("nb", "B", "na"), z=("nb", "na"), grad_norm=1, loss=1, signals="num_signals",
      q_ema_slots="n_q_ema")
def _isv_signal_build(a):
    _check("isv_signal_build", n_q_ema=(a.n_q_ema, len(prod.Q_EMA_SLOTS)),
           num_signals=(a.num_signals, reg.NUM_SIGNALS),
           sig_health=(a.sig_health, _SIG["LEARNING_HEALTH"]))
    if tuple(int(s) for s in a.q_ema_slots) != tuple(prod.Q_EMA_SLOTS):
        raise ValueError(f"isv_signal_build: q_ema_slots {list(a.q_ema_slots)} are not the "
                         f"reference's {prod.Q_EMA_SLOTS}")
    return {"signals": prod.isv_signal_build(a.isv, a.q_taken, a.td, a.r, a.p_next, a.z,
                                             a.grad_norm[0], a.loss[0])}


@twin("isv_signal_update", isv=reg.ISV_LEN, signals="num_signals", sharpe=1)
def _isv_signal_update(a):
    return {"isv": risv.isv_signal_update(a.isv, a.signals, a.sharpe[0], a.alpha_base)}


@twin("q_stats_update", isv=reg.ISV_LEN, q=("B", "n_actions"), action_slots="n_actions")
def _q_stats_update(a):
    _check("q_stats_update", abs_slot=(a.abs_slot, reg.Q_DIR_ABS_REF_INDEX))
    if tuple(int(s) for s in a.action_slots) != tuple(reg.Q_DIR_ACTION_SLOTS):
        raise ValueError(f"q_stats_update: action_slots {list(a.action_slots)} are not the "
                         f"registry's {reg.Q_DIR_ACTION_SLOTS}")
    return {"isv": prod.q_stats_update(a.isv, a.q, _alpha_base(a, "q_stats_update"))}


@twin("q_quantile_update", isv=reg.ISV_LEN, q="n")
def _q_quantile_update(a):
    members = [d for d in range(reg.MAX_ISV_BRANCHES)
               if reg.Q_P05_INDICES[prod._member(d)] == int(a.lo_slot)]
    if not members or reg.Q_P95_INDICES[prod._member(members[0])] != int(a.hi_slot):
        raise ValueError(f"q_quantile_update: slots {a.lo_slot}/{a.hi_slot} are no member's")
    _check("q_quantile_update", lo_pct=(a.lo_pct, prod.QUANTILE_LO_PCT),
           hi_pct=(a.hi_pct, prod.QUANTILE_HI_PCT))
    return {"isv": prod.q_quantile_update(a.isv, a.q.reshape(1, -1), members[0],
                                          _alpha_base(a, "q_quantile_update"))}


@twin("adaptive_support_update", isv=reg.ISV_LEN)
def _adaptive_support_update(a):
    _check("adaptive_support_update", n_members=(a.n_members, reg.MAX_ISV_BRANCHES),
           p05_base=(a.p05_base, reg.Q_P05_INDICES[0]), p95_base=(a.p95_base, reg.Q_P95_INDICES[0]),
           centre_base=(a.centre_base, reg.V_CENTER_INDICES[0]),
           half_base=(a.half_base, reg.V_HALF_INDICES[0]),
           q_abs_ref_slot=(a.q_abs_ref_slot, reg.Q_ABS_REF_INDEX))
    return {"isv": prod.adaptive_support_update(a.isv, a.atom_growth_mult, a.headroom,
                                                a.half_floor)}


@twin("per_branch_gamma_update", isv=reg.ISV_LEN, gamma_base="n_members", gamma_max="n_members")
def _per_branch_gamma_update(a):
    _check("per_branch_gamma_update", n_members=(a.n_members, reg.MAX_ISV_BRANCHES),
           gamma_slot=(a.gamma_slot, reg.GAMMA_SEED_INDICES[0]),
           epoch_slot=(a.epoch_slot, reg.EPOCH_IDX_INDEX),
           total_slot=(a.total_slot, reg.TOTAL_EPOCHS_INDEX))
    return {"isv": prod.per_branch_gamma_update(a.isv, a.gamma_base, a.gamma_max)}


@twin("epsilon_tau_update", isv=reg.ISV_LEN, schedule=2)
def _epsilon_tau_update(a):
    _check("epsilon_tau_update", eps_slot=(a.eps_slot, reg.EPSILON_EFF_INDEX),
           tau_slot=(a.tau_slot, reg.TAU_EFF_INDEX),
           health_slot=(a.health_slot, _SIG["LEARNING_HEALTH"]))
    if np.float32(a.tau_health_floor) != np.float32(prod.TAU_HEALTH_FLOOR):
        raise ValueError("epsilon_tau_update: tau_health_floor is not the reference's")
    return {"isv": prod.epsilon_tau_update(a.isv, a.schedule, a.tau)}


@twin("cql_alpha_ramp", isv=reg.ISV_LEN)
def _cql_alpha_ramp(a):
    _check("cql_alpha_ramp", cql_slot=(a.cql_slot, reg.CQL_ALPHA_INDEX),
           eps_slot=(a.eps_slot, reg.EPSILON_EFF_INDEX))
    return {"isv": prod.cql_alpha_ramp(a.isv, a.cql_alpha, _alpha_base(a, "cql_alpha_ramp"))}

# The consumers' pointer variants: the scalar is the one float32 their pointer names.
@twin("loss_scalars_ptr", c51_total="n_branches", terms=("n_branches", "batch"),
      q_taken=("n_branches", "batch"), target_q=("n_branches", "batch"),
      readback=len(rstep.READBACK_FIELDS), alpha=1)
def _loss_scalars_ptr(a):
    r = rstep.loss_scalars_ptr(a.c51_total, a.terms, a.q_taken, a.target_q, a.alpha[0])
    readback = a.readback
    for name, value in r._asdict().items():
        readback[rstep.READBACK_INDEX[name]] = value
    return {"readback": readback}


@twin("polyak_update_mirror_ptr", target="n", online="n", tau=1, online_bf16="n",
      target_bf16="n")
def _polyak_update_mirror_ptr(a):
    r = optim.polyak_update_mirror_ptr(a.target, a.online, a.tau[0])
    return {"target": r.target, "online_bf16": r.online_bf16, "target_bf16": r.target_bf16}
