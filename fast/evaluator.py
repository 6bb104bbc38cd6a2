"""Greedy evaluation of a whole segment on the device (issue 20, SPEC 10), the fast twin of
``reference.loop.evaluate_segment``.

``DeviceEvaluator(trainer, tables, *, max_steps, chunk=CHUNK_BARS, costs=ExecutionCosts(),
mode="auto")``
takes a ``foxhunt.fast.Trainer`` (on the GPU, or a ``CpuTrainer``: the same records run by the
reference kernels) and the run's market tables (``kernels.env.market_tables``), and builds the
plans of ``foxhunt.fast.eval_plan`` on its own arena (the walk's ``WalkLayout`` and one
``EvalLayout(layout, 1)`` for the forward), reading the trainer's live parameters and ISV:

- ``begin``: the segment's first bar and flat state in, ``env_reset``;
- ``chunk`` per policy: ``chunk`` bars (``bar_ops``) in ONE graph, built on first use;
- ``end`` per ``(n, bars_per_year, equity)``: ``eval_metrics`` and the copies out (the
  ``END_CACHE_SIZE`` most recent kept);
- with ``mode="fused"``, ``fused``: the greedy walk of a whole segment on the device in ONE
  graph (``eval_plan.fused_ops``): from sm_90 the span launches of ``greedy_walk_spans`` (the
  steps the policy holds through checked 16 clusters at once), then the rounds of
  ``greedy_walk_round`` (what is left in 16 chunks walked in parallel, repaired until each
  merges with its predecessor's end), bitwise the one-cluster ``greedy_walk_cluster``'s
  records; else one launch of ``greedy_walk`` (one block); built with the evaluator. The
  greedy policy then takes ``fused`` and ``end`` instead of ``begin``, the chunks and ``end``
  (the baselines keep the chunk graphs). ``mode="graph"`` walks the greedy policy by chunk
  graphs too. ``mode="auto"`` (the default, ``auto_mode``) is ``"fused"`` where the fused walk
  runs on clusters, else ``"graph"``. Both modes read Q on the support of the trainer's current
  ISV: the fixed one, or with ``adaptive_atoms`` the live per-branch support built at the
  walk's start (``support_plan.eval_support``), as ``q_values`` does.

``walk(start, stop, bars_per_year, policy=, equity=)`` walks bars ``[start, stop)``
(``n = stop - start - 1`` steps, starting flat, as ``loop.evaluate``): the host writes the
first bar and its state into pinned buffers, enqueues ``begin``, ``ceil(n / chunk)`` launches
of the chunk graph and ``end`` on the trainer's stream (after every step enqueued before), and
synchronises ONCE; it returns the metrics (float32, ``kernels.env.EVAL_FIELDS`` order) and,
with ``equity``, the ``n`` per-bar rewards. No host round trip inside the segment.

On the GPU each plan is one captured CUDA graph (the chunk graph repeats the bar's records
``chunk`` times: ``chunk`` x the nodes of one forward, ``env_act`` and ``env_step``; the GEMMs
are planned once for the bar's records, not per copy; ``node_counts()`` says how many). A trainer whose engine is rebuilt (``Trainer.load_state_dict`` of
another seed with the IQN head on) is followed: the plans are rebuilt on the new engine.

Numerics (``mode="fused"``): ``greedy_walk``'s float order differs from the forward's GEMMs
(``reference.kernels.walk``), so its actions equal the chunk graphs' up to the first near tie
(``walk.first_near_tie``; ``tests/test_walk_wiring.py``). Numerics (``"graph"``): the walk's
records are those of ``kernels.env_walk.greedy_walk`` (F's twin of ``loop.evaluate``); on
the CPU executor the metrics are ``loop.evaluate_segment``'s rounded to float32 (bit for bit:
``tests/test_device_eval.py``), on the GPU within ``eval_metrics``' float64-reduction bound
(``conformance/specs/env.py``).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import NamedTuple

import numpy as np

from foxhunt.fast.dataflow import check_dataflow
from foxhunt.fast.eval_plan import (
    METRICS_HOST,
    N_STEPS_HOST,
    OBS_HOST,
    POLICIES,
    REWARDS_HOST,
    START_HOST,
    WALK_TABLES,
    WalkLayout,
    bar_ops,
    begin_ops,
    end_ops,
    fused_ops,
    register_twins,
    walk_binder,
    walk_role,
)
from foxhunt.fast.records import Ops
from foxhunt.fast.step_layout import BufferTable, EvalLayout
from foxhunt.reference.env import ExecutionCosts
from foxhunt.reference.kernels import env as env_kernels
from foxhunt.reference.kernels.argcheck import check_int

F32, I32, I64 = np.float32, np.int32, np.int64

#: Bars per launch of the chunk graph (the graph's size against the bars a last partial chunk
#: walks in vain: at most ``CHUNK_BARS - 1``). ``benches/bench_main_job.py`` times others.
CHUNK_BARS = 64
#: ``end`` graphs kept (one per segment length, annualisation and equity choice).
END_CACHE_SIZE = 8
#: How the greedy policy walks a segment: chunk graphs of per-bar records, or one kernel.
MODES = ("graph", "fused", "auto")


class WalkResult(NamedTuple):
    """One segment's readback: ``metrics`` float32 ``[len(EVAL_FIELDS)]`` and, when asked
    for, the per-bar ``rewards`` (unscaled) float32 ``[n]`` (else None)."""

    metrics: np.ndarray
    rewards: np.ndarray | None


class _CpuWalk:
    """The plans on the CPU executor: host arenas and host buffers, graphs run in order."""

    def __init__(self, engine, tables: list[BufferTable], host_specs: dict):
        from foxhunt.fast.cpu_executor import HostArena, Memory

        self.engine = engine
        self.arenas = [HostArena(table.specs) for table in tables]
        self.host = {name: np.zeros(shape, dtype) for name, (shape, dtype) in host_specs.items()}
        self._mem = Memory([(engine.layout, engine.arena), *zip(tables, self.arenas)], self.host)
        self._plans: dict = {}

    def build(self, key, graphs: list[Ops]) -> None:
        from foxhunt.fast.cpu_executor import CpuGraph

        made: dict[int, CpuGraph] = {}  # a repeated record list is ordered once
        for ops in graphs:
            if id(ops) not in made:
                made[id(ops)] = CpuGraph(ops, self.engine.branch_order)
        self._plans[key] = [made[id(ops)] for ops in graphs]

    def run(self, key) -> None:
        for graph in self._plans[key]:
            graph.replay(self._mem)

    def drop(self, key) -> None:
        self._plans.pop(key)

    def node_count(self, key) -> int:
        return sum(graph.node_count for graph in self._plans[key])

    def close(self, *, synchronize: bool = True) -> None:
        """Nothing to release (host memory)."""


class _GpuWalk:
    """The plans on the GPU: one captured graph each, on the trainer's stream; pinned host
    buffers for the copies in and out."""

    def __init__(self, engine, tables: list[BufferTable], host_specs: dict):
        from foxhunt.fast.arena import Arena
        from foxhunt.fast.graph_lowering import Lowering, layered_address

        self.engine = engine
        self.arenas = [Arena.from_specs(engine.device, table.specs) for table in tables]
        self.host = {name: engine.device.pinned_empty(shape, dtype)
                     for name, (shape, dtype) in host_specs.items()}
        address = layered_address(zip(tables, self.arenas), engine.address)
        self._lowering = Lowering(engine.module, address, self.host)
        self._graphs: dict = {}

    def build(self, key, graphs: list[Ops]) -> None:
        from foxhunt.fast.graphs import GraphCapture

        for ops in {id(ops): ops for ops in graphs}.values():
            self.engine.pool.reserve(ops)
            self._lowering.prepare(ops)
        graph = GraphCapture(self.engine.stream, max_branches=0)  # branches come from the pool
        with graph:
            for ops in graphs:
                self._lowering.enqueue(ops, self.engine.stream, self.engine.pool)
        graph.hold(*(a for ops in graphs for a in self._lowering.host_arrays(ops)))
        self._graphs[key] = graph

    def run(self, key) -> None:
        self._graphs[key].replay()

    def drop(self, key) -> None:
        self.engine.synchronize()  # no launch of it may be in flight
        self._graphs.pop(key).close()

    def node_count(self, key) -> int:
        return self._graphs[key].node_count

    def close(self, *, synchronize: bool = True) -> None:
        """Release the graphs and the arenas, once the trainer's stream is idle (``synchronize``
        False: the engine is closed already, and synchronised before it closed)."""
        if synchronize:
            self.engine.synchronize()
        for graph in self._graphs.values():
            graph.close()
        self._graphs.clear()
        for arena in self.arenas:
            arena.close()


def on_cpu(engine) -> bool:
    """Whether ``engine`` runs on the CPU executor (a ``CpuEngine``, or a CPU population
    member's ``MemberEngine``: no device)."""
    return getattr(engine, "device", None) is None


def auto_mode(trainer) -> str:
    """``mode="auto"``: ``"fused"`` where the fused walk runs on thread-block clusters (sm_90 and
    newer, the network in a cluster's shared memory; ``eval_plan.fused_walk_kernel`` is
    ``greedy_walk_cluster``, whose bar the span walk runs), with the fixed support or the live
    per-branch one alike; else ``"graph"`` (the one-block ``greedy_walk`` reads its weights from
    L2 and is slower than the chunk graphs). On the CPU executor: ``"graph"`` (its metrics are
    ``loop.evaluate_segment``'s bit for bit; the fused walk's twin sums in another order and is
    much slower there)."""
    from foxhunt.fast.eval_plan import fused_walk_kernel

    if on_cpu(trainer.engine):
        return "graph"
    return "fused" if fused_walk_kernel(trainer.engine.program) == "greedy_walk_cluster" else "graph"


class DeviceEvaluator:
    """Greedy (and baseline) walks over segments on the device (module docstring)."""

    def __init__(self, trainer, tables: env_kernels.MarketTables, *, max_steps: int,
                 chunk: int = CHUNK_BARS, costs: ExecutionCosts = ExecutionCosts(),
                 mode: str = "auto"):
        self.max_steps = check_int("max_steps", max_steps, minimum=1)
        self.chunk = check_int("chunk", chunk, minimum=1)
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: allowed values are {', '.join(map(repr, MODES))}")
        if mode == "auto":
            mode = auto_mode(trainer)
        self.mode = mode
        n_bars = tables.close.shape[0]
        if n_bars < 2:
            raise ValueError(f"tables: {n_bars} bars are not allowed; a walk needs at least 2")
        register_twins()
        self.trainer, self.tables, self.costs = trainer, tables, costs
        self._device = None
        self._build()

    # -- plans
    def _build(self) -> None:
        engine = self.trainer.engine
        prog, lay = engine.program, engine.layout
        self.wl = wl = WalkLayout(lay, n_bars=self.tables.close.shape[0],
                                  n_features=self.tables.features.shape[1],
                                  max_steps=self.max_steps)
        self.evl = evl = EvalLayout(lay, 1)
        self._new = functools.partial(Ops, walk_binder(prog, wl, evl))
        self._check = functools.partial(check_dataflow, role=walk_role(prog, wl, evl), preset={
            **lay.zero_padding(), **evl.zero_padding(), **wl.zero_padding()})
        walker = _CpuWalk if on_cpu(engine) else _GpuWalk
        self._device = walker(engine, [wl, evl], wl.host_specs())
        up = self._device.arenas[0].upload
        for buf, name in WALK_TABLES:
            up(buf, getattr(self.tables, name))
        up("walk_costs", env_kernels.cost_table(self.costs))
        up("walk_fixed", wl.fixed_actions())
        for name, value in wl.constants().items():
            up(name, value)
        up("walk_eps", np.zeros(1, F32))  # greedy: never explore
        up("walk_cycle", np.zeros(1, I64))
        self._begin = self._new()
        begin_ops(self._begin, prog, wl)
        self._check([self._begin])
        self._device.build("begin", [self._begin])
        if self.mode == "fused":
            fused = self._new()
            fused_ops(fused, prog, wl)
            self._check([fused])
            self._device.build("fused", [fused])
        self._engine = engine
        self._chunks: set[str] = set()
        self._ends: OrderedDict = OrderedDict()

    def _chunk(self, policy: str) -> tuple:
        key = ("chunk", policy)
        if policy not in self._chunks:
            bar = self._new()
            bar_ops(bar, self._engine.program, self.wl, policy)
            self._check([self._begin, bar, bar])  # a bar reads what the one before wrote
            self._device.build(key, [bar] * self.chunk)
            self._chunks.add(policy)
        return key

    def _end(self, n: int, bars_per_year: float, equity: bool) -> tuple:
        key = ("end", n, bars_per_year, equity)
        if key in self._ends:
            self._ends.move_to_end(key)
            return key
        if len(self._ends) >= END_CACHE_SIZE:  # evict the least recently used
            self._device.drop(self._ends.popitem(last=False)[0])
        ops = self._new()
        end_ops(ops, self._engine.program, self.wl, n=n, bars_per_year=bars_per_year,
                equity=equity)
        self._check([ops])
        self._device.build(key, [ops])
        self._ends[key] = None
        return key

    def node_counts(self, policy: str = "greedy") -> dict[str, int]:
        """Nodes (records on the CPU) of the ``begin`` graph and of ``policy``'s chunk graph."""
        return {"begin": self._device.node_count("begin"),
                "chunk": self._device.node_count(self._chunk(policy))}

    # -- walks
    def _check_segment(self, start, stop) -> int:
        T = self.wl.n_bars
        start = check_int("start", start, minimum=0)
        stop = check_int("stop", stop, minimum=start + 2, maximum=T)  # within the tables
        n = stop - start - 1
        if n > self.max_steps:
            raise ValueError(f"segment [{start}, {stop}): {n} steps exceed max_steps="
                             f"{self.max_steps} (the record rows this evaluator was built for)")
        return n

    def walk(self, start: int, stop: int, bars_per_year: float, *, policy: str = "greedy",
             equity: bool = False) -> WalkResult:
        """``policy`` (``eval_plan.POLICIES``) over bars ``[start, stop)`` (module docstring);
        one synchronisation."""
        n = self._check_segment(start, stop)
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: allowed values are "
                             f"{', '.join(map(repr, POLICIES))}")
        per_year = float(bars_per_year)
        if not np.isfinite(per_year) or per_year <= 0:
            raise ValueError(f"bars_per_year={bars_per_year!r}: need a finite value > 0")
        if getattr(self.trainer.engine, "closed", False):  # its arena is freed
            raise RuntimeError("walk: the trainer is closed; its graphs can no longer run")
        if self.trainer.engine is not self._engine:  # rebuilt (reseeded): follow it
            self._device.close(synchronize=False)
            self._build()
        end = self._end(n, per_year, bool(equity))
        host, tb = self._device.host, self.tables
        host[START_HOST][0] = start
        if self.mode == "fused" and policy == "greedy":
            host[N_STEPS_HOST][0] = n
            self._device.run("fused")
        else:
            chunk = self._chunk(policy)
            flat = np.zeros(1, F32)
            host[OBS_HOST][...] = env_kernels.env_observe(
                tb.features, tb.close, np.array([start], I32), flat, flat, np.zeros(1, I32),
                self.trainer.config.state_dim)[0]
            self._device.run("begin")
            for _ in range(-(-n // self.chunk)):
                self._device.run(chunk)
        self._device.run(end)
        self._engine.synchronize()  # the segment's one readback
        rewards = host[REWARDS_HOST][:n].copy() if equity else None
        return WalkResult(host[METRICS_HOST].copy(), rewards)

    def close(self) -> None:
        if self._device is not None:
            self._device.close()
            self._device = None


__all__ = ["CHUNK_BARS", "DeviceEvaluator", "END_CACHE_SIZE", "MODES", "WalkResult"]
