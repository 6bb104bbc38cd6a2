"""The issue-19 ISV producers and the gamma schedule's consumer in the fast step, as records
(``foxhunt.reference.isv_step`` says which run, in which order; this module only places them).

- Graph 1, first (``consumers``): with the gamma schedule on, branch d's ISV gamma slot is
  copied into the ``gamma`` buffer (one 4-byte device copy per branch), which every target
  kernel reads (scalar targets, the C51 projections, the IQN targets): the discount of the
  step's start. Likewise the CQL-alpha ramp's slot into ``alpha_step`` (read by
  ``cql_logit_grad_branches`` and ``loss_scalars_ptr`` instead of the constant ``alpha``) and
  the adaptive tau's slot into ``tau_step`` (read by graph 2's ``polyak_update_mirror_ptr``):
  graph 2's producers then rewrite the slots, and the consumers still see the step's start.
- Graph 2, beside the optimiser chain (``producers``): ``isv_signal_build`` (from graph 1's
  ``q_taken``, ``td``, ``p_next``, the readback's ``grad_norm`` and ``loss``),
  ``isv_signal_update``; ``q_stats_update`` on the first B rows of branch 0's ``q_o`` block,
  ``q_quantile_update`` on each branch's, ``adaptive_support_update``;
  ``per_branch_gamma_update``; ``epsilon_tau_update`` (from ``eps_schedule``, a state buffer
  the trainer's ``set_loop_signals`` uploads); ``cql_alpha_ramp``. Each writes only its own ISV
  slots, which nothing else in graph 2 reads or writes; they run as parallel branches wherever
  their slots allow (``ISV_ACCESS``, checked by ``isv_races``), so the producers' longest chain
  stays beside the optimiser's instead of adding to the step.
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


def _slot(value) -> int:
    """A slot argument: an int, or a ``Buf`` into ``isv`` (its offset)."""
    return value.offset if isinstance(value, Buf) else int(value)


def _range(base, count) -> set[int]:
    return set(range(int(base), int(base) + int(count)))


def _sharpe(a) -> set[int]:
    return {_slot(a["sharpe_slot"])}


#: The event graph 2 records once ``step_scalars`` has written the readback, ``safety_scale``
#: and Mech 6's slow EMA (``graph2_plan``); their graph-2 readers wait on it.
STEP_SCALARS_DONE = "step_scalars_done"

#: What each graph-2 kernel that binds ``isv`` reads and writes of it, from its launch's
#: arguments (``Launch.args``): ``kernel -> args -> (read slots, written slots)``, as its CUDA
#: header comment says. An EMA reads the slot it writes. The parallel branches of
#: ``producers`` are checked against it (tests/test_isv_branches.py): two kernels that no
#: dependency orders touch no common slot that either writes.
ISV_ACCESS = {
    "step_scalars": lambda a: ({_slot(a["slow_ema_index"])}, {_slot(a["slow_ema_index"])}),
    "isv_q_abs_ref_update": lambda a: ({_slot(a["slot"])}, {_slot(a["slot"])}),
    "isv_h2_rms_update": lambda a: ({_slot(a["slot"])}, {_slot(a["slot"])}),
    "isv_signal_build": lambda a: (set(ref.Q_EMA_SLOTS) | {_slot(a["sig_var"])}, set()),
    "isv_signal_update": lambda a: (_range(0, a["num_signals"]) | {_slot(a["sharpe"])},
                                    _range(0, a["num_signals"])),
    "q_stats_update": lambda a: (
        _sharpe(a) | set(reg.Q_DIR_ACTION_SLOTS[:a["n_actions"]]) | {_slot(a["abs_slot"])},
        set(reg.Q_DIR_ACTION_SLOTS[:a["n_actions"]]) | {_slot(a["abs_slot"])}),
    "q_quantile_update": lambda a: (_sharpe(a) | {_slot(a["lo_slot"]), _slot(a["hi_slot"])},
                                    {_slot(a["lo_slot"]), _slot(a["hi_slot"])}),
    "adaptive_support_update": lambda a: (
        _range(a["p05_base"], a["n_members"]) | _range(a["p95_base"], a["n_members"])
        | {_slot(a["q_abs_ref_slot"])},
        _range(a["centre_base"], a["n_members"]) | _range(a["half_base"], a["n_members"])),
    "per_branch_gamma_update": lambda a: ({_slot(a["epoch_slot"]), _slot(a["total_slot"])},
                                          _range(a["gamma_slot"], a["n_members"])),
    "epsilon_tau_update": lambda a: ({_slot(a["health_slot"])},
                                     {_slot(a["eps_slot"]), _slot(a["tau_slot"])}),
    "cql_alpha_ramp": lambda a: (_sharpe(a) | {_slot(a["eps_slot"]), _slot(a["cql_slot"])},
                                 {_slot(a["cql_slot"])}),
}


def isv_access(launch) -> tuple[frozenset[int], frozenset[int]]:
    """``(read, written)`` ISV slots of a graph-2 launch (``ISV_ACCESS``); ``KeyError`` naming a
    kernel that binds ``isv`` without an entry there."""
    if launch.kernel not in ISV_ACCESS:
        raise KeyError(f"{launch.kernel}: binds isv but has no ISV_ACCESS entry")
    read, written = ISV_ACCESS[launch.kernel](launch.args)
    return frozenset(read), frozenset(written)


def isv_races(graph: Ops) -> list[str]:
    """The pairs of launches of ``graph`` that bind ``isv``, that no dependency orders
    (``dataflow.dependency_graph``) and that share a slot one of them writes (``isv_access``):
    one line each, empty when any order of the branches gives the same ISV."""
    from foxhunt.fast.dataflow import dependency_graph
    from foxhunt.fast.records import Launch

    nodes, deps = dependency_graph([graph])
    ancestors: list[int] = []
    for i in range(len(nodes)):
        anc = 0
        for d in deps[i]:
            anc |= ancestors[d] | (1 << d)
        ancestors.append(anc)
    touching = [i for i, n in enumerate(nodes) if isinstance(n, Launch)
                and any(a.buffer == "isv" for a in n.accesses)]
    access = {i: isv_access(nodes[i]) for i in touching}
    out = []
    for k, i in enumerate(touching):
        for j in touching[k + 1:]:
            if ancestors[j] >> i & 1 or ancestors[i] >> j & 1:
                continue
            (ri, wi), (rj, wj) = access[i], access[j]
            shared = (wi & (rj | wj)) | (wj & ri)
            if shared:
                out.append(f"{nodes[i].kernel} and {nodes[j].kernel} are unordered and share "
                           f"ISV slots {sorted(shared)}")
    return out


def producers(prog, ops: Ops, first: Ops, rest: Ops, *, after_scalars: bool) -> None:
    """Graph 2's producers into ``ops``: the step's existing ones (``first``: ``Q_ABS_REF``,
    which ``adaptive_support_update`` reads; ``rest``: the others) and the switched ones of
    ``isv_step.run_producers``, as parallel branches wherever their ISV slots allow
    (``ISV_ACCESS``; ``tests/test_isv_branches.py`` checks every unordered pair of graph 2):

    - signals: (with ``after_scalars``, after ``STEP_SCALARS_DONE``: the readback's
      ``grad_norm`` and ``loss``) ``isv_signal_build``, event ``isv_q_means_read``,
      ``isv_signal_update``,
      ``epsilon_tau_update`` (reads this step's health), ``cql_alpha_ramp`` (reads this
      step's epsilon);
    - one branch per branch's ``q_quantile_update`` (event ``isv_quantile_<d>``); the gamma
      schedule; ``rest``;
    - main: ``first``, then (after ``isv_q_means_read``: the build reads the Q-mean EMAs that
      ``q_stats_update`` rewrites) ``q_stats_update``, then (after every quantile)
      ``adaptive_support_update``.

    Each kernel writes only its own slots and no two unordered kernels share a slot that
    either writes, so any order of the branches gives the reference's bits. With every switch
    off: ``first`` then ``rest``, as before issue 19."""
    from foxhunt.reference.kernels.step import READBACK_INDEX

    lay, c = prog.lay, prog.config
    B, nb, NA = lay.B, lay.nb, lay.NA
    ab = reg.ALPHA_BASE_DEFAULT
    if not isv_step.adaptive_on(c):
        ops.extend(first)
        ops.extend(rest)
        return
    sides, main = [], ops.branch()
    main.extend(first)
    signals = ops.branch()
    if c.adaptive_signals:
        sig = {f"sig_{k}": _SIG[n] for k, n in (
            ("q_drift", "Q_DRIFT"), ("grad_norm", "GRAD_NORM_EMA"), ("td", "TD_ERR_EMA"),
            ("var", "ENS_VAR_EMA"), ("var_vel", "ENS_VAR_VEL"), ("reward", "REWARD_EMA"),
            ("util", "ATOM_UTIL_EMA"), ("loss", "LOSS_EMA"), ("health", "LEARNING_HEALTH"))}
        plan = prog.kernels("isv_producers").plan_isv_signal_build(nb, B, NA)
        if after_scalars:  # step_scalars is in graph 2: the build reads its grad_norm and loss
            signals.wait(STEP_SCALARS_DONE)
        signals.kernel("isv_signal_build", plan, isv="isv", q_taken="q_taken", td="td",
                       r="batch.r", p_next="p_next", z=support_plan.signal_support(c),
                       grad_norm=Buf("readback", offset=READBACK_INDEX["grad_norm"]),
                       loss=Buf("readback", offset=READBACK_INDEX["loss"]), signals="signals",
                       num_signals=reg.NUM_SIGNALS, nb=nb, B=B, na=NA, q_ema_slots="q_ema_slots",
                       n_q_ema=len(ref.Q_EMA_SLOTS), q_drift_floor=F32(ref.Q_DRIFT_FLOOR),
                       atom_util_fraction=F32(ref.ATOM_UTIL_FRACTION), **sig)
        signals.record("isv_q_means_read")
        isvk = prog.kernels("isv")
        signals.kernel("isv_signal_update", isvk.plan_isv_signal_update(reg.NUM_SIGNALS),
                       isv="isv", signals="signals", num_signals=reg.NUM_SIGNALS,
                       sharpe=Buf("isv", offset=reg.SHARPE_EMA_INDEX), alpha_base=F32(ab),
                       sharpe_clamp=F32(reg.SHARPE_CLAMP), sharpe_gain=F32(reg.SHARPE_GAIN))
    if c.adaptive_epsilon_tau:
        signals.kernel("epsilon_tau_update", (1, WARP, 0), isv="isv", schedule="eps_schedule",
                       tau=F32(c.tau), tau_health_floor=F32(ref.TAU_HEALTH_FLOOR),
                       eps_slot=reg.EPSILON_EFF_INDEX, tau_slot=reg.TAU_EFF_INDEX,
                       health_slot=_SIG["LEARNING_HEALTH"])
    if c.cql_alpha_ramp:
        signals.kernel("cql_alpha_ramp", (1, WARP, 0), isv="isv", cql_alpha=F32(c.cql_alpha),
                       cql_slot=reg.CQL_ALPHA_INDEX, eps_slot=reg.EPSILON_EFF_INDEX, **_rate(ab))
    if signals.items:
        sides.append(signals)
    if c.q_stats:
        plan = prog.kernels("isv_producers").plan_q_quantile_update
        for d, n in enumerate(lay.branches):
            m, count, quantile = ref._member(d), B * n, ops.branch()
            quantile.kernel("q_quantile_update", plan(count), isv="isv", q=Buf("q_o", d),
                            n=count, lo_slot=reg.Q_P05_INDICES[m], hi_slot=reg.Q_P95_INDICES[m],
                            lo_pct=ref.QUANTILE_LO_PCT, hi_pct=ref.QUANTILE_HI_PCT, **_rate(ab))
            quantile.record(f"isv_quantile_{d}")
            sides.append(quantile)
        if c.adaptive_signals:
            main.wait("isv_q_means_read")
        main.kernel("q_stats_update", (1, WARP, 0), isv="isv", q=Buf("q_o", 0), B=B,
                    n_actions=lay.branches[0], action_slots="q_dir_slots",
                    abs_slot=reg.Q_DIR_ABS_REF_INDEX, **_rate(ab))
        for d in range(nb):
            main.wait(f"isv_quantile_{d}")
        main.kernel("adaptive_support_update", (1, WARP, 0), isv="isv",
                    n_members=reg.MAX_ISV_BRANCHES, p05_base=reg.Q_P05_INDICES[0],
                    p95_base=reg.Q_P95_INDICES[0], centre_base=reg.V_CENTER_INDICES[0],
                    half_base=reg.V_HALF_INDICES[0], q_abs_ref_slot=reg.Q_ABS_REF_INDEX,
                    atom_growth_mult=F32(c.atom_growth_mult),
                    headroom=F32(isv_step.SUPPORT_HEADROOM),
                    half_floor=F32(isv_step.SUPPORT_HALF_FLOOR))
    if c.gamma_schedule:
        gamma = ops.branch()
        gamma.kernel("per_branch_gamma_update", (1, WARP, 0), isv="isv",
                     gamma_base="gamma_sched_base", gamma_max="gamma_sched_max",
                     n_members=reg.MAX_ISV_BRANCHES, gamma_slot=reg.GAMMA_SEED_INDICES[0],
                     epoch_slot=reg.EPOCH_IDX_INDEX, total_slot=reg.TOTAL_EPOCHS_INDEX)
        sides.append(gamma)
    if rest.items:
        sides.append(rest)
    if sides:
        ops.parallel(*sides, main)
    else:
        ops.extend(main)


__all__ = ["ISV_ACCESS", "act_epsilon_buffer", "add_isv_buffers", "alpha_buffer", "consumers",
           "isv_access", "isv_constants", "isv_races", "loss_scalars_alpha", "polyak_tau", "producers"]
