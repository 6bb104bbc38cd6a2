"""The issue-19 ISV producers and the gamma schedule's consumer in the fast step, as records
(``foxhunt.reference.isv_step`` says which run, in which order; this module only places them).

- Graph 1, first (``consumers``): with the gamma schedule on, branch d's ISV gamma slot is
  copied into the ``gamma`` buffer (one 4-byte device copy per branch), which every target
  kernel reads (scalar targets, the C51 projections, the IQN targets): the discount of the
  step's start. Likewise the CQL-alpha ramp's slot into ``alpha_step`` (read by
  ``cql_logit_grad_branches`` and ``loss_scalars_ptr`` instead of the constant ``alpha``) and
  the adaptive tau's slot into ``tau_step`` (read by graph 2's ``polyak_update_mirror_ptr``):
  graph 2's producers then rewrite the slots, and the consumers still see the step's start.
- Graph 2, on the producers' branch after the existing producers: ``isv_signal_build`` (from
  graph 1's ``q_taken``, ``td``, ``p_next``, the readback's ``grad_norm`` and ``loss``) and
  ``isv_signal_update``; ``q_stats_update`` on the first B rows of branch 0's ``q_o`` block,
  ``q_quantile_update`` on each branch's, ``adaptive_support_update``;
  ``per_branch_gamma_update``; ``epsilon_tau_update`` (from ``eps_schedule``, a state buffer
  the trainer's ``set_loop_signals`` uploads); ``cql_alpha_ramp``. Each writes only its own ISV
  slots, which nothing else in graph 2 reads or writes.
- The collection cycle's ``env_act`` reads ``act_epsilon_buffer``: ``ISV[EPSILON_EFF]`` with
  ``adaptive_epsilon_tau`` on (training cycles; warm-up cycles keep the collector's ``eps``).
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast import support_plan
from foxhunt.fast.records import Buf, Ops
from foxhunt.reference import isv as reg
from foxhunt.reference import isv_step
from foxhunt.reference.kernels import isv_producers as ref

F32, I32 = np.float32, np.int32
_SIG = {name: i for i, name in enumerate(reg.SIGNAL_NAMES)}
#: Threads of the one-warp producers (the CUDA cap).
WARP = ref.LANES


def add_isv_buffers(lay) -> None:
    """The buffers of ``lay.config``'s switched producers (none with every switch off)."""
    c = lay.config
    if c.adaptive_signals:
        lay._add("signals", reg.NUM_SIGNALS, F32)
        lay._add("q_ema_slots", len(ref.Q_EMA_SLOTS), I32, "constant")
        lay._add("z_branches", (lay.nb, lay.NA), F32, "constant")
    if c.q_stats:
        lay._add("q_dir_slots", len(reg.Q_DIR_ACTION_SLOTS), I32, "constant")
    if c.gamma_schedule:
        lay._add("gamma_sched_base", reg.MAX_ISV_BRANCHES, F32, "constant")
        lay._add("gamma_sched_max", reg.MAX_ISV_BRANCHES, F32, "constant")
    if c.cql_alpha_ramp:
        lay._add("alpha_step", 1, F32)
    if c.adaptive_epsilon_tau:
        lay._add("tau_step", 1, F32)
        lay._add("eps_schedule", 2, F32, "state")
    support_plan.add_support_buffers(lay)  # adaptive_atoms


def isv_constants(lay) -> dict[str, np.ndarray]:
    """Host values of ``add_isv_buffers``' constant buffers."""
    from foxhunt.reference.step import support

    c, out = lay.config, {}
    if c.adaptive_signals:
        out["q_ema_slots"] = np.array(ref.Q_EMA_SLOTS, I32)
        out["z_branches"] = np.tile(support(c), (lay.nb, 1)).astype(F32)
    if c.q_stats:
        out["q_dir_slots"] = np.array(reg.Q_DIR_ACTION_SLOTS, I32)
    if c.gamma_schedule:
        out["gamma_sched_base"], out["gamma_sched_max"] = isv_step.gamma_schedule_tables()
    out.update(support_plan.support_constants(lay))
    return out


def consumers(prog, ops: Ops) -> None:
    """Graph 1's first records: the consumed slots of the step's start copied out of the ISV
    (``gamma[d] = ISV[GAMMA_INDICES[d]]``, ``alpha_step = ISV[CQL_ALPHA]``, ``tau_step =
    ISV[TAU_EFF]``) for the switches that are on; nothing with every switch off."""
    c = prog.config
    if c.gamma_schedule:
        for d in range(prog.lay.nb):
            ops.copy(Buf("gamma", offset=d), Buf("isv", offset=reg.GAMMA_INDICES[d]), 4, "dtod")
    if c.cql_alpha_ramp:
        ops.copy("alpha_step", Buf("isv", offset=reg.CQL_ALPHA_INDEX), 4, "dtod")
    if c.adaptive_epsilon_tau:
        ops.copy("tau_step", Buf("isv", offset=reg.TAU_EFF_INDEX), 4, "dtod")


def alpha_buffer(config) -> str:
    """The buffer ``cql_logit_grad_branches`` reads the CQL coefficient from."""
    return "alpha_step" if config.cql_alpha_ramp else "alpha"


def loss_scalars_alpha(config) -> tuple[str, dict]:
    """``loss_scalars``' kernel and alpha argument: the constant ``cql_alpha``, or with the
    ramp on ``loss_scalars_ptr`` reading ``alpha_step``."""
    if config.cql_alpha_ramp:
        return "loss_scalars_ptr", {"alpha": "alpha_step"}
    return "loss_scalars", {"alpha": F32(config.cql_alpha)}


def polyak_tau(config) -> tuple[str, dict]:
    """The Polyak update's kernel and tau argument: the constant ``tau``, or with
    ``adaptive_epsilon_tau`` on ``polyak_update_mirror_ptr`` reading ``tau_step``."""
    if config.adaptive_epsilon_tau:
        return "polyak_update_mirror_ptr", {"tau": "tau_step"}
    return "polyak_update_mirror", {"tau": F32(config.tau)}


def act_epsilon_buffer(config):
    """What a training cycle's ``env_act`` reads its epsilon from (``isv_step.act_epsilon``):
    ``ISV[EPSILON_EFF]`` with ``adaptive_epsilon_tau`` on, else the collector's ``eps``."""
    return Buf("isv", offset=reg.EPSILON_EFF_INDEX) if config.adaptive_epsilon_tau else "eps"


def _rate(ab: float) -> dict:
    return dict(sharpe_slot=reg.SHARPE_EMA_INDEX, alpha_base=F32(ab),
                sharpe_clamp=F32(reg.SHARPE_CLAMP), sharpe_gain=F32(reg.SHARPE_GAIN))


def producers(prog, ops: Ops) -> None:
    """Graph 2's switched producers, in ``isv_step.run_producers``' order."""
    from foxhunt.reference.kernels.step import READBACK_INDEX

    lay, c = prog.lay, prog.config
    B, nb, NA = lay.B, lay.nb, lay.NA
    ab = reg.ALPHA_BASE_DEFAULT
    if c.adaptive_signals:
        sig = {f"sig_{k}": _SIG[n] for k, n in (
            ("q_drift", "Q_DRIFT"), ("grad_norm", "GRAD_NORM_EMA"), ("td", "TD_ERR_EMA"),
            ("var", "ENS_VAR_EMA"), ("var_vel", "ENS_VAR_VEL"), ("reward", "REWARD_EMA"),
            ("util", "ATOM_UTIL_EMA"), ("loss", "LOSS_EMA"), ("health", "LEARNING_HEALTH"))}
        ops.kernel("isv_signal_build", (1, WARP, 0), isv="isv", q_taken="q_taken", td="td",
                   r="batch.r", p_next="p_next", z=support_plan.signal_support(c),
                   grad_norm=Buf("readback", offset=READBACK_INDEX["grad_norm"]),
                   loss=Buf("readback", offset=READBACK_INDEX["loss"]), signals="signals",
                   num_signals=reg.NUM_SIGNALS, nb=nb, B=B, na=NA, q_ema_slots="q_ema_slots",
                   n_q_ema=len(ref.Q_EMA_SLOTS), q_drift_floor=F32(ref.Q_DRIFT_FLOOR),
                   atom_util_fraction=F32(ref.ATOM_UTIL_FRACTION), **sig)
        isvk = prog.kernels("isv")
        ops.kernel("isv_signal_update", isvk.plan_isv_signal_update(reg.NUM_SIGNALS), isv="isv",
                   signals="signals", num_signals=reg.NUM_SIGNALS,
                   sharpe=Buf("isv", offset=reg.SHARPE_EMA_INDEX), alpha_base=F32(ab),
                   sharpe_clamp=F32(reg.SHARPE_CLAMP), sharpe_gain=F32(reg.SHARPE_GAIN))
    if c.q_stats:
        n0 = lay.branches[0]
        ops.kernel("q_stats_update", (1, WARP, 0), isv="isv", q=Buf("q_o", 0), B=B,
                   n_actions=n0, action_slots="q_dir_slots", abs_slot=reg.Q_DIR_ABS_REF_INDEX,
                   **_rate(ab))
        plan = prog.kernels("isv_producers").plan_q_quantile_update
        for d, n in enumerate(lay.branches):
            m = ref._member(d)
            count = B * n
            ops.kernel("q_quantile_update", plan(count), isv="isv", q=Buf("q_o", d), n=count, lo_slot=reg.Q_P05_INDICES[m], hi_slot=reg.Q_P95_INDICES[m],
                       lo_pct=ref.QUANTILE_LO_PCT, hi_pct=ref.QUANTILE_HI_PCT, **_rate(ab))
        ops.kernel("adaptive_support_update", (1, WARP, 0), isv="isv",
                   n_members=reg.MAX_ISV_BRANCHES, p05_base=reg.Q_P05_INDICES[0],
                   p95_base=reg.Q_P95_INDICES[0], centre_base=reg.V_CENTER_INDICES[0],
                   half_base=reg.V_HALF_INDICES[0], q_abs_ref_slot=reg.Q_ABS_REF_INDEX,
                   atom_growth_mult=F32(c.atom_growth_mult),
                   headroom=F32(isv_step.SUPPORT_HEADROOM),
                   half_floor=F32(isv_step.SUPPORT_HALF_FLOOR))
    if c.gamma_schedule:
        ops.kernel("per_branch_gamma_update", (1, WARP, 0), isv="isv",
                   gamma_base="gamma_sched_base", gamma_max="gamma_sched_max",
                   n_members=reg.MAX_ISV_BRANCHES, gamma_slot=reg.GAMMA_SEED_INDICES[0],
                   epoch_slot=reg.EPOCH_IDX_INDEX, total_slot=reg.TOTAL_EPOCHS_INDEX)
    if c.adaptive_epsilon_tau:
        ops.kernel("epsilon_tau_update", (1, WARP, 0), isv="isv", schedule="eps_schedule",
                   tau=F32(c.tau), tau_health_floor=F32(ref.TAU_HEALTH_FLOOR),
                   eps_slot=reg.EPSILON_EFF_INDEX, tau_slot=reg.TAU_EFF_INDEX,
                   health_slot=_SIG["LEARNING_HEALTH"])
    if c.cql_alpha_ramp:
        ops.kernel("cql_alpha_ramp", (1, WARP, 0), isv="isv", cql_alpha=F32(c.cql_alpha),
                   cql_slot=reg.CQL_ALPHA_INDEX, eps_slot=reg.EPSILON_EFF_INDEX, **_rate(ab))


__all__ = ["act_epsilon_buffer", "add_isv_buffers", "alpha_buffer", "consumers",
           "isv_constants", "loss_scalars_alpha", "polyak_tau", "producers"]
