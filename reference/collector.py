"""Experience collection and the training cycle on the NumPy twins of the device kernels (issue 20).

This is the reference twin of ``foxhunt.fast.collector``: the same cycle, the same state, the
same kernels (their reference functions, in the order the device plan launches them), so one
cycle from the same state gives the same actions, samples and results on both backends.

State (what the device keeps in its arena; ``state()`` / ``load_state()`` for resume):

- the ``n_envs`` walks (``kernels.env.EnvState``: bar index, steps, time in position,
  position, entry price) and their current states ``obs`` (``env_observe`` of that state);
- the replay ring (``ReplayRing``: the arrays of ``kernels.replay``'s ring, the cursor, the
  size and the running maximum priority);
- the n-step windows (``kernels.replay.nstep_buffers``' ``win_*``: each env's steps not yet
  emitted; empty at the fold's start, so a fold's first transitions wait for their ``k`` steps
  and a window still open at the fold's end is dropped with the walks);
- ``cycle``: the global cycle counter (never reset, across folds and resumes): the offset of
  every random draw of a cycle (``kernels.rng.uniform(seed, stream, cycle, i)``).

One cycle (``collect``, then on training cycles ``train``, then ``cycle += 1``), with the
exploration rate ``eps`` of ``begin_epoch`` (the device's ``eps`` scalar, written at epoch
start; the warm-up cycles use 1):

1. act: ``q = trainer.q_values(obs)``, ``env_act`` (epsilon-greedy per env and branch, with the
   streams ``explore`` and ``explore_action``);
2. ``env_step`` with auto-reset (offsets from the stream ``episode_start``): rewards times
   ``reward_scale``, ``done``, the next states ``s2``, the labels ``next_ret`` and ``regime``;
3. ``nstep_window`` (issue 22): the step joins its env's window of the last ``n_step`` steps,
   and the finished n-step transitions come out (``kernels.replay.nstep_window``: the
   discounted reward sum, the state ``k`` steps on, ``done``, the labels of the first step and
   ``discount = gamma_ref ** k``, ``gamma_ref = config.gammas[0]``, ``k = n_step`` or fewer
   where the episode ended; ``n_step = 1``: every step as it is); ``replay_add`` of those
   transitions at the running maximum priority; ``obs`` becomes the post-reset states;
4. ``ring_prefix_sum`` of the priorities, ``replay_sample`` (stream ``replay_sample``),
   ``importance_weights``, ``replay_gather``: the batch;
5. ``trainer.step(batch)``, then ``replay_update_priorities`` from the step's TD errors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .batch import Batch
from .config import DQNConfig
from .env import ExecutionCosts
from .isv_step import act_epsilon
from .kernels import env as env_kernels
from .kernels import replay as replay_kernels
from .market import Bars
from .replay import ReplayBuffer
from .step import check_n_step

F32, I32, I64 = np.float32, np.int32, np.int64
#: Longest episode of a training walk, in bars (shorter where the training segment is).
MAX_EPISODE_LEN = 1000


class ReplayRing(ReplayBuffer):
    """``ReplayBuffer``'s arrays, state and checks, written and read by the device replay
    kernels' twins: ``add`` is ``replay_add``; ``sample(key, cycle)`` is ``ring_prefix_sum`` (the fast
    cycle's ``scan_tiles`` + ``scan_offsets`` order) of every priority (zero beyond ``size``), ``replay_sample``, ``importance_weights`` and
    ``replay_gather``; ``update_priorities`` is ``replay_update_priorities`` (a non-finite TD
    error takes the running maximum; the last of repeated rows wins).

    ``n_step``: the transitions' window (``LoopSettings.n_step``); above 1 the sampled batches
    carry the stored ``discount`` (``Batch.discount``), at 1 they leave it ``None`` (1-step
    targets, today's batches)."""

    def __init__(self, config: DQNConfig, capacity: int, *, n_step: int = 1, **kwargs):
        super().__init__(config, capacity, **kwargs)
        self.n_step = int(n_step)

    def ring_pos(self) -> np.ndarray:
        """``(cursor, size)`` as the device's int32 ``ring_pos``."""
        return np.array([self.cursor, self.size], I32)

    def ring(self) -> dict[str, np.ndarray]:
        """The stored arrays by ``replay_gather``'s parameter names (live views)."""
        return {f"ring_{name}": getattr(self, name) for name, _, _ in replay_kernels.RING_FIELDS}

    def add(self, s, a, r, s2, done, *, next_ret, regime, discount) -> None:
        """``replay_add`` in place (the arrays converted to the ring's dtypes first)."""
        values = dict(s=s, a=a, r=r, s2=s2, done=done, next_ret=next_ret, regime=regime,
                      discount=discount)
        tr = {name: np.ascontiguousarray(values[name], dtype) for name, dtype, _ in replay_kernels.RING_FIELDS}
        if tr["r"].shape[0] == 0:  # a cycle where every window is still filling
            return
        pos, top = self.ring_pos(), np.array([self.max_priority], F32)
        replay_kernels.validate_replay_add(**tr, ring=self.ring(), priority=self.priority,
                                           ring_pos=pos, max_priority=top)
        replay_kernels.write_transitions({name: getattr(self, name) for name, _, _ in
                                          replay_kernels.RING_FIELDS}, self.priority, pos, top, tr)
        self.cursor, self.size = int(pos[0]), int(pos[1])

    def sample(self, key: int, cycle: int) -> tuple[Batch, np.ndarray]:
        """A batch of ``config.batch_size`` rows with the draws of cycle ``cycle`` under ``key``
        (the run's seed), and the sampled rows."""
        B = self.config.batch_size
        if self.size < B:
            raise ValueError(f"replay holds {self.size} transitions, fewer than batch_size={B}")
        prefix = replay_kernels.ring_prefix_sum(self.priority)
        idx = replay_kernels.replay_sample(prefix, self.ring_pos(), key, np.array([cycle], I64), B)
        isw = replay_kernels.importance_weights(self.priority, idx, self.beta, self.size)
        g = replay_kernels.replay_gather(idx, **self.ring())
        nstep = {"discount": g.discount} if self.n_step > 1 else {}
        batch = Batch(s=g.x[:B], a=np.ascontiguousarray(g.a.T), r=g.r, s2=g.x[B:], done=g.done,
                      isw=isw, next_ret=g.next_ret, regime=g.regime, **nstep)
        return batch, idx

    def update_priorities(self, idx: np.ndarray, td_errors: np.ndarray) -> None:
        """``replay_update_priorities`` in place."""
        td = np.asarray(td_errors, F32)
        top = np.array([self.max_priority], F32)
        alpha, eps = replay_kernels.validate_replay_update_priorities(
            td, idx, self.priority, top, self.alpha, self.priority_eps)
        replay_kernels.write_priorities(td, idx, self.priority, top, alpha, eps)
        self.max_priority = top[0]


@dataclass(frozen=True)
class Walks:
    """Where a fold's training walks run: bars ``[0, n_bars)`` of the run's tables (the walk
    ends at the training segment's end), starts drawn in ``[min_start, last_start]``, episodes
    of ``episode_len`` steps."""

    n_bars: int
    min_start: int
    last_start: int
    episode_len: int

    @classmethod
    def of_segment(cls, train: tuple[int, int]) -> Walks:
        """The walks over training segment ``[t0, t_val)``: ``BranchingEnv(bars[:t_val],
        min_start=t0, episode_len=min(MAX_EPISODE_LEN, t_val - t0 - 1))``."""
        t0, t_val = train
        episode_len = min(MAX_EPISODE_LEN, t_val - t0 - 1)
        return cls(n_bars=t_val, min_start=t0, last_start=t_val - 1 - episode_len,
                   episode_len=episode_len)


def nstep_gamma(config: DQNConfig, n_step: int) -> np.float32:
    """``gamma_ref = config.gammas[0]`` (float32): the gamma whose powers are the n-step
    transitions' discounts. With ``n_step > 1`` it must lie in (0, 1) (the loss takes its
    logarithm): ``step.check_n_step``'s one-line ``ValueError`` naming gamma and n_step."""
    check_n_step(config, n_step)
    return F32(config.gammas[0])


def nstep_state(n_envs: int, n_step: int, config: DQNConfig) -> dict[str, np.ndarray]:
    """Empty n-step windows and output rows (``kernels.replay.nstep_buffers``), zero-filled."""
    return {name: np.zeros(shape, dtype) for name, (dtype, shape) in replay_kernels.nstep_buffers(
        n_envs, n_step, config.state_dim, config.n_branches).items()}


#: The n-step window arrays a resume state holds (``state()``'s ``nstep.<name>``).
WINDOW_ARRAYS = ("win_s", "win_a", "win_r", "win_next_ret", "win_regime", "win_len")


class Collector:
    """One fold's experience on the reference twins (module docstring).

    ``Collector(config, tables, walks, *, n_envs, capacity, reward_scale, seed, cycle,
    n_step=1, costs=ExecutionCosts())``: ``tables`` are ``kernels.env.market_tables`` of the
    run's bars; the walks start at cycle ``cycle`` (their offsets drawn with it); ``n_step`` is
    the transitions' window (``nstep_gamma`` checks gamma for it). ``trainer`` is any backend
    (its ``q_values``, ``step`` and ``last_td_errors``).
    """

    #: The env-state arrays ``state()`` saves (``kernels.env.EnvState``'s fields).
    ENV_ARRAYS = env_kernels.EnvState._fields

    def __init__(self, config: DQNConfig, tables: env_kernels.MarketTables, walks: Walks, *,
                 n_envs: int, capacity: int, reward_scale: float, seed: int, cycle: int,
                 n_step: int = 1, costs: ExecutionCosts = ExecutionCosts()):
        self.config = config
        self.tables = tables
        self.walks = walks
        self.n_envs = int(n_envs)
        self.seed = int(seed)
        self.reward_scale = F32(reward_scale)
        self.costs = env_kernels.cost_table(costs)
        self.n_step = int(n_step)
        self.gamma_ref = nstep_gamma(config, self.n_step)
        self.ring = ReplayRing(config, capacity, n_step=self.n_step)
        self.window = nstep_state(self.n_envs, self.n_step, config)
        self.cycle = int(cycle)
        self.env = env_kernels.env_reset(None, self.n_envs, walks.min_start, walks.last_start,
                                         self.seed, np.array([self.cycle], I64))
        self.obs = self._observe()
        self._no_record = np.zeros((0, self.n_envs), F32)  # training walks record nothing
        self.begin_epoch(1.0)

    def _observe(self) -> np.ndarray:
        e = self.env
        return env_kernels.env_observe(self.tables.features, self.tables.close, e.t, e.position,
                                       e.entry_price, e.time_in_position, self.config.state_dim)

    @property
    def size(self) -> int:
        """Transitions in the replay ring."""
        return self.ring.size

    def begin_epoch(self, eps: float) -> None:
        """The exploration rate of the cycles that follow."""
        self.eps = F32(eps)

    def collect(self, trainer, eps=None) -> None:
        """Steps 1 to 3 of the cycle (module docstring) at ``self.cycle``, exploring with
        ``eps`` (default ``self.eps``)."""
        c, w, tb = self.config, self.walks, self.tables
        cycle = np.array([self.cycle], I64)
        eps = self.eps if eps is None else F32(eps)
        if eps >= 1:  # every action explores: the greedy choice is not needed
            q = np.zeros(self.n_envs * sum(c.branches), F32)
        else:
            q = env_kernels.pack_q(trainer.q_values(self.obs))
        actions = env_kernels.env_act(q, c.branches, eps, self.seed, cycle)
        out = env_kernels.env_step(
            tb.close, tb.high, tb.low, tb.features, tb.regime, *self.env, actions,
            self._no_record, self._no_record, self._no_record, self.costs, w.n_bars, w.min_start,
            w.last_start, w.episode_len, 1, self.reward_scale, c.state_dim, self.seed, cycle)
        self.window = replay_kernels.nstep_window(
            self.obs, actions, out.r, out.done, out.s2, out.next_ret, out.regime,
            **self.window, n_step=self.n_step, gamma_ref=self.gamma_ref)._asdict()
        m = int(self.window.pop("n_out")[0])
        w = self.window
        self.ring.add(w["out_s"][:m], w["out_a"][:m], w["out_r"][:m], w["out_s2"][:m],
                      w["out_done"][:m], next_ret=w["out_next_ret"][:m],
                      regime=w["out_regime"][:m], discount=w["out_discount"][:m])
        self.env = env_kernels.EnvState(*out[:len(self.ENV_ARRAYS)])
        self.obs = out.obs

    def train(self, trainer):
        """Steps 4 and 5 of the cycle at ``self.cycle``: the trainer's ``StepScalars``."""
        batch, idx = self.ring.sample(self.seed, self.cycle)
        scalars = trainer.step(batch)
        self.ring.update_priorities(idx, trainer.last_td_errors())
        return scalars

    def warmup(self, trainer, transitions: int) -> None:
        """Collection cycles with ``eps = 1`` until the ring holds ``transitions``."""
        eps = self.eps
        self.begin_epoch(1.0)
        while self.size < transitions:
            self.collect(trainer)
            self.cycle += 1
        self.begin_epoch(eps)

    def cycle_step(self, trainer):
        """One training cycle; the step's ``StepScalars``. It explores with ``isv_step.
        act_epsilon`` (the trainer's ISV 41 with ``adaptive_epsilon_tau`` on)."""
        self.collect(trainer, act_epsilon(self.config, trainer, self.eps))
        scalars = self.train(trainer)
        self.cycle += 1
        return scalars

    def close(self) -> None:
        """Nothing to release (host memory; the fast collector releases its arenas)."""

    # -- resume
    def state(self) -> tuple[dict[str, np.ndarray], dict]:
        """``(arrays, meta)``: the ring's ``state()`` arrays as ``replay.<name>``, the walks as
        ``env.<name>``, the n-step windows as ``nstep.<name>`` (``WINDOW_ARRAYS``); ``meta``
        the ring's size, cursor and maximum priority (JSON-ready). The cycle counter is the
        caller's to save (it outlives the fold)."""
        ring = self.ring.state()
        arrays = {f"replay.{k}": ring.pop(k) for k in ReplayBuffer.STATE_ARRAYS}
        arrays.update({f"env.{k}": getattr(self.env, k).copy() for k in self.ENV_ARRAYS})
        arrays.update({f"nstep.{k}": self.window[k].copy() for k in WINDOW_ARRAYS})
        return arrays, ring

    def load_state(self, arrays: dict[str, np.ndarray], meta: dict) -> None:
        """Restore ``state()`` (the cycle counter is set by the constructor)."""
        self.ring.load_state({**meta, **{k: arrays[f"replay.{k}"] for k in ReplayBuffer.STATE_ARRAYS}})
        env = []
        for name, now in zip(self.ENV_ARRAYS, self.env):
            arr = np.asarray(arrays[f"env.{name}"])
            if arr.shape != now.shape or arr.dtype != now.dtype:
                raise ValueError(f"env state {name}: {arr.dtype} {arr.shape} is not allowed; "
                                 f"need {now.dtype} {now.shape}")
            env.append(arr.copy())
        self.env = env_kernels.EnvState(*env)
        self.obs = self._observe()
        self.window.update(load_windows(arrays, self.window))


def load_windows(arrays: dict[str, np.ndarray], now: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The ``nstep.<name>`` arrays of a resume state, checked against the windows ``now``
    (dtype and shape: the same n_envs, n_step, state_dim and branches); copies."""
    out = {}
    for name in WINDOW_ARRAYS:
        arr = np.asarray(arrays[f"nstep.{name}"])
        if arr.shape != now[name].shape or arr.dtype != now[name].dtype:
            raise ValueError(f"n-step window {name}: {arr.dtype} {arr.shape} is not allowed; "
                             f"need {now[name].dtype} {now[name].shape}")
        out[name] = arr.copy()
    return out


def fold_collector(trainer, config: DQNConfig, bars: Bars, feats: np.ndarray,
                   train: tuple[int, int], settings, cycle: int):
    """The collector of one fold's training segment ``train`` for ``settings``
    (``loop.LoopSettings``), starting at cycle ``cycle``: ``foxhunt.fast.collector.
    FastCollector`` (the cycle as one device graph) for a fast trainer, this module's
    ``Collector`` for any other."""
    kwargs = dict(n_envs=settings.n_envs, capacity=settings.replay_capacity,
                  reward_scale=settings.reward_scale, seed=settings.seed, cycle=cycle,
                  n_step=settings.n_step)
    tables, walks = env_kernels.market_tables(bars, feats), Walks.of_segment(train)
    if getattr(trainer, "backend_name", None) == "fast":
        from foxhunt.fast.collector import FastCollector  # only when the run asked for it

        return FastCollector(trainer, config, tables, walks, **kwargs)
    return Collector(config, tables, walks, **kwargs)


__all__ = ["Collector", "MAX_EPISODE_LEN", "ReplayRing", "WINDOW_ARRAYS", "Walks", "fold_collector",
           "load_windows", "nstep_gamma", "nstep_state"]
