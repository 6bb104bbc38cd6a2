"""The device-resident collector: collection, replay and the training step as one captured
graph per cycle (issue 20), the fast twin of ``foxhunt.reference.collector``.

``FastCollector(trainer, config, tables, walks, *, n_envs, capacity, reward_scale, seed, cycle,
n_step=1, costs)`` takes a ``foxhunt.fast.Trainer`` (on the GPU, or a ``CpuTrainer``: the same records run
by the reference kernels) and builds, for the fold's ``walks``, four plans of
``foxhunt.fast.collect_plan`` records over the trainer's arena, the collector's own arena and
the forward's:

- ``warmup``: act, env step, n-step window, replay add, cycle advance;
- ``train``: the previous cycle's priority update (from its step's ``td`` and ``sample_idx``,
  advancing ``cycle``) on a side branch beside the act forward, then the env step, n-step
  window and replay add, the sampled batch gathered into the trainer's ``batch``, then the
  trainer's graphs 1 and 2 (their own records);
- ``train_first``: the same with no update (the first cycle after the warm-up or a flush);
- ``flush``: the pending priority update alone.

The reference cycle ends with its priority update; here that update is deferred into the next
cycle's head (``collect_plan``'s docstring: why this is the reference order and what it saves):
after a training cycle an update is pending (a host flag), and ``cycle_step`` runs ``train``
while one is, else ``train_first``. Whenever the host is about to read or replace what the
update writes (the priorities, the maximum priority, the counter) or run a plan that reads them
outside a training cycle, it runs ``flush`` first: ``ring()`` and ``state()`` (resume),
``load_state``, ``warmup`` and ``close``; ``flush()`` is public for a caller about to step the
trainer directly (its graph 1 overwrites the ``td`` the update reads: a pending update with the
trainer stepped elsewhere raises instead of using them). The epochs need no flush:
``begin_epoch`` writes ``eps`` only, and the update stays pending across the epoch boundary.
The walks (``walk_state``), the windows and the ring's size (``ring_pos``) are not the
update's: they are read without one.

On the GPU each plan is ONE captured CUDA graph on the trainer's stream: a training cycle is
one graph launch and the trainer's host bookkeeping (``Trainer.step_enqueued``: the step count
and the deferred readback), with no synchronisation between the readback points. The host
keeps mirrors of what it can compute without asking the device (the cycle counter, which
counts a cycle whose update is pending: the device's lags it by one until the update runs; the
ring's size where ``n_step = 1``: ``n_envs`` per cycle; above 1 a cycle adds what the episodes'
ends decide, so the size is read back, outside the epochs' cycles: in ``warmup`` and ``size``);
the ring, the n-step windows, the walks and the counter live on the device and are read back
only for a resume state (``state()``).

Same interface as ``reference.collector.Collector``: ``begin_epoch(eps)``,
``warmup(trainer, transitions)``, ``cycle_step(trainer)``, ``size``, ``cycle``, ``state()``,
``load_state(arrays, meta)``. The walks start (or resume) from host-computed states: the
reference ``env_reset`` / ``env_observe`` on the host, uploaded once per fold.
"""

from __future__ import annotations

import functools

import numpy as np

from foxhunt.fast.collect_plan import (
    ENV_BUFFERS,
    RING_BUFFERS,
    TABLE_BUFFERS,
    NSTEP_BUFFERS,
    CollectLayout,
    act_ops,
    advance_ops,
    collect_binder,
    collect_role,
    env_ops,
    priority_ops,
    register_twins,
    train_head_ops,
)
from foxhunt.fast import isv_plan
from foxhunt.fast.dataflow import check_dataflow
from foxhunt.fast.records import Ops
from foxhunt.fast.step_layout import EvalLayout
from foxhunt.reference.collector import (WINDOW_ARRAYS, ReplayRing, Walks, load_windows,
                                        nstep_gamma)
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.env import ExecutionCosts
from foxhunt.reference.kernels import env as env_kernels
from foxhunt.reference.replay import ReplayBuffer

F32, I32, I64 = np.float32, np.int32, np.int64


class _CpuDevice:
    """The plans on the CPU executor (``cpu_executor``): host arenas, graphs run in order."""

    def __init__(self, engine, cl: CollectLayout, evl: EvalLayout):
        from foxhunt.fast.cpu_executor import HostArena, Memory

        self.engine = engine
        self.arena = HostArena(cl.specs)
        self._eval_arena = HostArena(evl.specs)
        self._mem = Memory([(engine.layout, engine.arena), (evl, self._eval_arena),
                            (cl, self.arena)], {})
        self._plans: dict[str, list] = {}

    def build(self, name: str, graphs: list[Ops]) -> None:
        from foxhunt.fast.cpu_executor import CpuGraph

        self._plans[name] = [CpuGraph(ops, self.engine.branch_order) for ops in graphs]

    def run(self, name: str) -> None:
        for graph in self._plans[name]:
            graph.replay(self._mem)

    def close(self) -> None:
        """Nothing to release (host memory)."""


class _GpuDevice:
    """The plans on the GPU: one captured graph each, replayed on the trainer's stream."""

    def __init__(self, engine, cl: CollectLayout, evl: EvalLayout):
        from foxhunt.fast.arena import Arena
        from foxhunt.fast.graph_lowering import Lowering, layered_address

        self.engine = engine
        self.arena = Arena.from_specs(engine.device, cl.specs)
        self._eval_arena = Arena.from_specs(engine.device, evl.specs)
        address = layered_address([(cl, self.arena), (evl, self._eval_arena)], engine.address)
        self._lowering = Lowering(engine.module, address, {})
        self._graphs: dict[str, object] = {}

    def build(self, name: str, graphs: list[Ops]) -> None:
        from foxhunt.fast.graphs import GraphCapture

        for ops in graphs:
            self.engine.pool.reserve(ops)
            self._lowering.prepare(ops)
        graph = GraphCapture(self.engine.stream, max_branches=0)  # branches come from the pool
        with graph:
            for ops in graphs:
                self._lowering.enqueue(ops, self.engine.stream, self.engine.pool)
        old = self._graphs.pop(name, None)
        if old is not None:
            old.close()
        self._graphs[name] = graph

    def run(self, name: str) -> None:
        self._graphs[name].replay()

    def close(self) -> None:
        """Release the graphs and the arenas (after the trainer's stream is idle)."""
        self.engine.synchronize()
        for graph in self._graphs.values():
            graph.close()
        self._graphs.clear()
        self.arena.close()
        self._eval_arena.close()


class FastCollector:
    """One fold's experience on the device (module docstring)."""

    #: The env-state arrays ``state()`` saves (``kernels.env.EnvState``'s fields).
    ENV_ARRAYS = env_kernels.EnvState._fields

    def __init__(self, trainer, config: DQNConfig, tables: env_kernels.MarketTables,
                 walks: Walks, *, n_envs: int, capacity: int, reward_scale: float, seed: int,
                 cycle: int, n_step: int = 1, costs: ExecutionCosts = ExecutionCosts()):
        from foxhunt.fast.cpu_executor import CpuEngine

        register_twins()
        engine = trainer.engine
        prog, lay = engine.program, engine.layout
        self.config, self.walks, self.seed = config, walks, int(seed)
        self.n_envs, self.cycle, self.n_step = int(n_envs), int(cycle), int(n_step)
        gamma_ref = nstep_gamma(config, self.n_step)
        # The ring's checks and constants (alpha, beta, eps), its host mirror of (cursor, size).
        self._ring = ReplayRing(config, capacity, n_step=self.n_step)
        self.cl = cl = CollectLayout(lay, n_envs=n_envs, capacity=capacity,
                                     n_bars=tables.close.shape[0], n_features=tables.features.shape[1],
                                     n_step=self.n_step)
        self.evl = evl = EvalLayout(lay, n_envs)
        binder = collect_binder(prog, cl, evl)
        new = functools.partial(Ops, binder)
        env = dict(reward_scale=reward_scale, gamma_ref=gamma_ref, seed=self.seed)
        update = dict(alpha=float(self._ring.alpha), priority_eps=float(self._ring.priority_eps))
        warm, first, head, flush = new(), new(), new(), new()
        act_ops(warm, prog, cl, evl)
        env_ops(warm, prog, cl, walks, eps="eps", **env)
        advance_ops(warm, prog)
        for ops, pending in ((first, None), (head, update)):
            train_head_ops(ops, prog, cl, evl, walks, update=pending, beta=float(self._ring.beta),
                           eps=isv_plan.act_epsilon_buffer(config), **env)
        priority_ops(flush, prog, cl, **update)
        step = [trainer.plans["graph1"], trainer.plans["graph2"]]
        self.plans = {"warmup": [warm], "train_first": [first, *step], "train": [head, *step],
                      "flush": [flush]}
        preset = {**lay.zero_padding(), **evl.zero_padding(), **cl.zero_padding()}
        role = collect_role(prog, cl, evl)
        for graphs in self.plans.values():
            check_dataflow(graphs, role, preset)
        # A training cycle's priority update waits for the next cycle's head (or ``flush``):
        # whether one is pending, and the trainer's step count when its ``td`` was written.
        self._pending, self._td_step = False, None
        self._trainer = trainer
        self._device = (_CpuDevice if isinstance(engine, CpuEngine) else _GpuDevice)(engine, cl, evl)
        for name, graphs in self.plans.items():
            self._device.build(name, graphs)
        # Uploaded once per fold: the tables, the costs, an empty ring, the counter, the walks.
        up = self._device.arena.upload
        for buf, name in TABLE_BUFFERS:
            up(buf, getattr(tables, name))
        up("env_costs", env_kernels.cost_table(costs))
        up("max_priority", np.array([self._ring.max_priority], F32))
        self._upload_cycle()
        self.begin_epoch(1.0)
        self._tables = tables
        self._set_walks(env_kernels.env_reset(None, self.n_envs, walks.min_start, walks.last_start,
                                              self.seed, np.array([self.cycle], I64)))

    # -- host <-> device
    def _upload_cycle(self) -> None:
        self._device.arena.upload("cycle", np.array([self.cycle], I64))

    def _set_walks(self, env: env_kernels.EnvState) -> None:
        """Upload walk states ``env`` and their states ``obs`` (the reference ``env_observe``)."""
        obs = env_kernels.env_observe(self._tables.features, self._tables.close, env.t,
                                      env.position, env.entry_price, env.time_in_position,
                                      self.config.state_dim)
        for buf, field, _ in ENV_BUFFERS:
            self._device.arena.upload(buf, getattr(env, field))
        self._device.arena.upload("obs", obs)

    @property
    def size(self) -> int:
        """Transitions in the ring: a host mirror where ``n_step = 1`` (every cycle adds
        ``n_envs``), else read back from the device (a synchronisation)."""
        if self.n_step > 1:
            self._ring.cursor, self._ring.size = (int(v) for v in
                                                  self._device.arena.download("ring_pos"))
        return self._ring.size

    def _added(self) -> None:
        if self.n_step == 1:
            self._ring.size = min(self._ring.size + self.n_envs, self._ring.capacity)
            self._ring.cursor = (self._ring.cursor + self.n_envs) % self._ring.capacity
        self.cycle += 1

    # -- the cycle
    def begin_epoch(self, eps: float) -> None:
        """Write the exploration rate of the cycles that follow (one upload, outside a cycle)."""
        self.eps = F32(eps)
        self._device.arena.upload("eps", np.array([self.eps], F32))

    def _check_engine(self, trainer) -> None:
        """The graphs embed the addresses, GEMM plans and seed key of the engine they were
        built on: a rebuilt (``Trainer._reseed``) or closed one must not be run through them."""
        if trainer.engine is not self._device.engine or getattr(trainer.engine, "closed", False):
            raise RuntimeError("trainer: its engine was rebuilt (a state of another seed loaded) "
                               "or closed after this collector was built; build a new FastCollector")

    def warmup(self, trainer, transitions: int) -> None:
        """Collection cycles with ``eps = 1`` until the ring holds ``transitions``."""
        self._check_engine(trainer)
        eps = self.eps
        if self.size < transitions:
            self.flush()  # the warm-up cycles read the counter and the priorities
            self.begin_epoch(1.0)
            while self.size < transitions:
                self._device.run("warmup")
                self._added()
            self.begin_epoch(eps)

    def cycle_step(self, trainer):
        """One training cycle (one graph launch on the GPU); the step's ``StepScalars``. Its
        priority update is left pending (module docstring)."""
        # the mirror (n_step > 1: the last size read back, a lower bound) before a read-back
        if self._ring.size < self.config.batch_size and self.size < self.config.batch_size:
            raise ValueError(f"replay holds {self.size} transitions, fewer than "
                             f"batch_size={self.config.batch_size}")
        self._check_engine(trainer)
        self._check_pending(trainer)
        self._device.run("train" if self._pending else "train_first")
        self._added()
        scalars = trainer.step_enqueued()
        self._pending, self._td_step = True, trainer.step_count
        return scalars

    def _check_pending(self, trainer) -> None:
        """A pending update reads the ``td`` its cycle's step wrote: a step run since (outside
        this collector) has overwritten them. (A state loaded into the trainer moves its step
        count too: refused alike, the host cannot tell the two apart.)"""
        if self._pending and trainer.step_count != self._td_step:
            raise RuntimeError(f"trainer: its step count moved from {self._td_step} to "
                               f"{trainer.step_count} (stepped outside this collector, or a state "
                               f"loaded) while this collector's priority update is pending; call "
                               f"flush() before stepping the trainer or loading its state")

    def flush(self) -> None:
        """Run the pending priority update, if any (one graph launch, no synchronisation)."""
        if self._pending:
            self._check_engine(self._trainer)
            self._check_pending(self._trainer)
            self._device.run("flush")
            self._pending = False

    # -- resume (synchronises: only at epoch ends)
    def ring(self) -> ReplayRing:
        """The device ring read back into a host ``ReplayRing`` (a copy; the pending update run
        first)."""
        self.flush()
        ring = ReplayRing(self.config, self._ring.capacity, n_step=self.n_step)
        arena = self._device.arena
        for buf, name in RING_BUFFERS:
            setattr(ring, name, arena.download(buf))
        ring.priority = arena.download("priority")
        ring.cursor, ring.size = (int(v) for v in arena.download("ring_pos"))
        ring.max_priority = arena.download("max_priority")[0]
        return ring

    def walk_state(self) -> env_kernels.EnvState:
        return env_kernels.EnvState(*(self._device.arena.download(buf) for buf, _, _ in ENV_BUFFERS))

    def state(self) -> tuple[dict[str, np.ndarray], dict]:
        """``reference.collector.Collector.state()``'s format, read from the device."""
        ring = self.ring().state()
        arrays = {f"replay.{k}": ring.pop(k) for k in ReplayBuffer.STATE_ARRAYS}
        env = self.walk_state()
        arrays.update({f"env.{k}": getattr(env, k) for k in self.ENV_ARRAYS})
        arrays.update({f"nstep.{k}": v for k, v in self._windows().items()})
        return arrays, ring

    def _windows(self) -> dict[str, np.ndarray]:
        """The n-step windows read back (``reference.collector.WINDOW_ARRAYS``)."""
        bufs = {name: buf for buf, name in NSTEP_BUFFERS}
        return {k: self._device.arena.download(bufs[k]) for k in WINDOW_ARRAYS}

    def load_state(self, arrays: dict[str, np.ndarray], meta: dict) -> None:
        """Restore ``state()`` onto the device (the cycle counter is the constructor's, advanced
        by the pending update first: the host mirror counts its cycle)."""
        self.flush()
        ring = ReplayRing(self.config, self._ring.capacity, n_step=self.n_step)
        ring.load_state({**meta, **{k: arrays[f"replay.{k}"] for k in ReplayBuffer.STATE_ARRAYS}})
        arena = self._device.arena
        for buf, name in RING_BUFFERS:
            arena.upload(buf, getattr(ring, name))
        arena.upload("priority", ring.priority)
        arena.upload("ring_pos", ring.ring_pos())
        arena.upload("max_priority", np.array([ring.max_priority], F32))
        self._ring.cursor, self._ring.size = ring.cursor, ring.size
        now = self.walk_state()
        env = []
        for name, have in zip(self.ENV_ARRAYS, now):
            arr = np.asarray(arrays[f"env.{name}"])
            if arr.shape != have.shape or arr.dtype != have.dtype:
                raise ValueError(f"env state {name}: {arr.dtype} {arr.shape} is not allowed; "
                                 f"need {have.dtype} {have.shape}")
            env.append(arr)
        self._set_walks(env_kernels.EnvState(*env))
        bufs = {name: buf for buf, name in NSTEP_BUFFERS}
        for name, arr in load_windows(arrays, self._windows()).items():
            arena.upload(bufs[name], arr)

    def close(self) -> None:
        """Run the pending update where its trainer still can (else drop it: the collector's
        state goes with it), then release the graphs and arenas."""
        engine = self._trainer.engine
        if (self._pending and engine is self._device.engine and not getattr(engine, "closed", False)
                and self._trainer.step_count == self._td_step):
            self.flush()
        self._device.close()


__all__ = ["FastCollector"]
