"""The step's issue-19 ISV producers and consumers, switched by ``DQNConfig`` (SPEC 7; seed
``002``): one place that says which producer runs, in which order, on what, and which slot a
consumer reads. Both backends follow it: the reference trainer calls ``run_producers``; the
fast plan (``foxhunt.fast.isv_plan``) launches the same kernels in the same order.

Switches (``ADAPTIVE_SWITCHES``; each off by default: then nothing here runs and the step is
bitwise the step without them):

* ``adaptive_signals``: ``isv_signal_build`` on this step's buffers, then
  ``isv_signal_update`` (slots 0-12, adaptive rate from ``ISV[SHARPE_EMA]``).
* ``q_stats``: ``q_stats_update`` on the exposure branch's online Q(s) (slots 17-21),
  ``q_quantile_update`` on each branch's online Q(s) (50-57), then
  ``adaptive_support_update`` (23-30; consumed with ``adaptive_atoms`` on: the live
  per-branch support, ``kernels.live_support``).
* ``gamma_schedule``: ``per_branch_gamma_update`` (43-46, the seed's schedule
  ``isv.GAMMA_SCHEDULE_BASE`` -> ``GAMMA_SCHEDULE_MAX`` over ``EPOCH_IDX / (TOTAL_EPOCHS -
  1)``); consumer: the C51 projection, the scalar targets and the IQN targets discount
  branch d by ``ISV[GAMMA_INDICES[d]]`` at the start of the step (the config's ``gamma`` is
  then the cold start: the first step after construction or a fold boundary uses it).
* ``adaptive_epsilon_tau``: ``epsilon_tau_update`` (41/42) from the learning health and the
  loop's exploration schedule (``eps_schedule``: ``(sched, cap)``, ``set_loop_signals``);
  consumers: the Polyak update blends with ``ISV[TAU_EFF]`` at the start of the step (cold
  start ``tau``), and a training cycle's ``env_act`` explores with ``ISV[EPSILON_EFF]``
  (``act_epsilon``; warm-up cycles with 1).
* ``cql_alpha_ramp``: ``cql_alpha_ramp`` (48, toward ``cql_alpha * (1 - ISV[EPSILON_EFF])``);
  consumer: the CQL loss and its gradient read ``ISV[CQL_ALPHA]`` at the start of the step
  (cold start ``cql_alpha``). Slot 41 is the loop's schedule at each epoch start (written by
  ``set_loop_signals(epsilon=...)`` with any switch on), so the ramp follows the exploration
  share with or without ``adaptive_epsilon_tau``.

Order (after the step's existing producers ``Q_ABS_REF`` and ``H_S2_RMS_EMA``): signals, Q
statistics, quantiles by branch, support, gamma, epsilon / tau, CQL alpha (which reads this
step's epsilon). Every producer runs once per step (the seeds
update the quantiles and support per epoch; per step keeps them inside the captured graph with
no host round trip, and the EMA rate makes the difference a rate choice).

Rates: every EMA here uses ``isv.ALPHA_BASE_DEFAULT`` with the Sharpe-adaptive gain.
"""

from __future__ import annotations

import numpy as np

from . import isv as isv_mod
from .config import ADAPTIVE_SWITCHES
from .kernels import isv as isv_kernels
from .kernels import isv_producers as prod

#: The trainer's ``eps_schedule`` (``(sched, cap)``) before the loop first sets it.
EPS_SCHEDULE_COLD = (0.0, 0.0)
#: ``adaptive_support_update``'s half-width headroom over the quantile half-range and its floor
#: (foxhunt's choice: the seed names ATOM_HEADROOM_BASE without a value).
SUPPORT_HEADROOM = 1.5
SUPPORT_HALF_FLOOR = 1.0
#: Rate of the loop's Sharpe EMA (slot 22), one update per epoch from the validation Sharpe
#: (foxhunt's choice: a few epochs of memory).
SHARPE_EMA_RATE = 0.3
#: The exposure branch's actions that ``q_stats_update`` reads (short, flat, long).
Q_STATS_ACTIONS = len(isv_mod.Q_DIR_ACTION_SLOTS)


def adaptive_on(config) -> tuple[str, ...]:
    """The ``ADAPTIVE_SWITCHES`` that are on in ``config``."""
    return tuple(n for n in ADAPTIVE_SWITCHES if getattr(config, n))


def step_gammas(config, isv: np.ndarray) -> tuple[float, ...]:
    """Branch d's discount for a step starting from ``isv``: ``ISV[GAMMA_INDICES[d]]`` with the
    gamma schedule on, else the config's."""
    if not config.gamma_schedule:
        return config.gammas
    return tuple(float(isv[isv_mod.GAMMA_INDICES[d]]) for d in range(config.n_branches))


def step_config(config, isv: np.ndarray):
    """The config a step starting from ``isv`` computes with: the gamma schedule's and the
    CQL-alpha ramp's consumers replace ``gamma`` / ``cql_alpha`` by their ISV slots."""
    changes = {}
    if config.gamma_schedule:
        changes["gamma"] = step_gammas(config, isv)
    if config.cql_alpha_ramp:
        changes["cql_alpha"] = float(isv[isv_mod.CQL_ALPHA_INDEX])
    return config.replace(**changes) if changes else config


def step_tau(config, isv: np.ndarray) -> np.float32:
    """The Polyak tau of a step starting from ``isv``: ``ISV[TAU_EFF]`` with
    ``adaptive_epsilon_tau`` on, else the config's."""
    return np.float32(isv[isv_mod.TAU_EFF_INDEX] if config.adaptive_epsilon_tau else config.tau)


def act_epsilon(config, trainer, scheduled) -> np.float32:
    """The exploration rate of a training cycle: ``ISV[EPSILON_EFF]`` (the trainer's, after
    the previous step) with ``adaptive_epsilon_tau`` on, else ``scheduled`` (the loop's)."""
    if config.adaptive_epsilon_tau:
        return np.float32(trainer.isv_value("EPSILON_EFF"))
    return np.float32(scheduled)


def eps_schedule(epsilon) -> np.ndarray:
    """``set_loop_signals``' ``epsilon = (sched, cap)`` as the float32 ``[2]`` that
    ``epsilon_tau_update`` reads (one-line ``ValueError`` unless both are in ``[0, 1]``)."""
    try:
        pair = np.array(epsilon, np.float32)
    except (TypeError, ValueError):
        pair = None
    if pair is None or pair.shape != (2,) or not np.all(np.isfinite(pair)) \
            or not np.all((pair >= 0) & (pair <= 1)):
        raise ValueError(f"epsilon={epsilon!r}: need (sched, cap), two numbers in [0, 1] (the "
                         "loop's epsilon of this epoch and max(eps_start, eps_end))")
    return pair


def gamma_schedule_tables() -> tuple[np.ndarray, np.ndarray]:
    """``per_branch_gamma_update``'s base and max (seed order), float32 [4]."""
    return (np.array(isv_mod.GAMMA_SCHEDULE_BASE, np.float32),
            np.array(isv_mod.GAMMA_SCHEDULE_MAX, np.float32))


def run_producers(config, isv: np.ndarray, *, q_taken: np.ndarray, q_s: list[np.ndarray],
                  td: np.ndarray, r: np.ndarray, p_next: np.ndarray, z: np.ndarray,
                  grad_norm, loss, eps_schedule=EPS_SCHEDULE_COLD) -> np.ndarray:
    """The switched producers on ``isv`` (float32 [ISV_LEN]), in the module's order; returns
    the new vector. ``q_taken [nb, B]``, ``q_s`` (per branch ``[B, n_d]``, online Q(s)),
    ``td [B]``, ``r [B]``, ``p_next [nb, B, NA]``, ``z [NA]`` or ``[nb, NA]`` (the support, tiled per branch),
    ``grad_norm`` / ``loss`` (the step's readback values), ``eps_schedule`` (the trainer's
    ``(sched, cap)``)."""
    ab = isv_mod.ALPHA_BASE_DEFAULT
    if config.adaptive_signals:
        zz = np.ascontiguousarray(np.broadcast_to(z, (config.n_branches, z.shape[-1])))
        signals = prod.isv_signal_build(isv, np.ascontiguousarray(q_taken), td, r, p_next, zz,
                                        grad_norm, loss)
        isv = isv_kernels.isv_signal_update(isv, signals, isv[isv_mod.SHARPE_EMA_INDEX], ab)
    if config.q_stats:
        isv = prod.q_stats_update(isv, np.ascontiguousarray(q_s[0]), ab)
        for d, q in enumerate(q_s):
            isv = prod.q_quantile_update(isv, np.ascontiguousarray(q), d, ab)
        isv = prod.adaptive_support_update(isv, config.atom_growth_mult, SUPPORT_HEADROOM,
                                           SUPPORT_HALF_FLOOR)
    if config.gamma_schedule:
        isv = prod.per_branch_gamma_update(isv, *gamma_schedule_tables())
    if config.adaptive_epsilon_tau:
        isv = prod.epsilon_tau_update(isv, np.asarray(eps_schedule, np.float32), config.tau)
    if config.cql_alpha_ramp:
        isv = prod.cql_alpha_ramp(isv, config.cql_alpha, ab)
    return isv


def sharpe_ema(previous, sharpe) -> np.float32:
    """The loop's Sharpe EMA after one epoch: the guarded EMA (``kernels.isv._ema``) of
    ``previous`` toward ``sharpe`` at ``SHARPE_EMA_RATE`` (a non-finite Sharpe keeps it)."""
    return isv_kernels._ema(np.array([previous], np.float32), np.array([sharpe], np.float32),
                            np.float32(SHARPE_EMA_RATE))[0]


__all__ = ["ADAPTIVE_SWITCHES", "EPS_SCHEDULE_COLD", "Q_STATS_ACTIONS", "act_epsilon",
           "eps_schedule", "SHARPE_EMA_RATE", "SUPPORT_HALF_FLOOR",
           "SUPPORT_HEADROOM", "adaptive_on", "gamma_schedule_tables", "run_producers",
           "sharpe_ema", "step_config", "step_gammas", "step_tau"]
