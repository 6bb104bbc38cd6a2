"""The fast Trainer's device side: one arena, the step's graphs captured once, replayed per step.

``GpuEngine(config, device=, gemm_workspace=, staging_slots=, seed=)`` compiles ``cuda_src`` with NVRTC
for the device (disk cache), allocates ONE arena holding every buffer of the step
(``StepLayout``), uploads the constants, builds the plan (``StepProgram``: every GEMM planned
once; the records checked, ``dataflow.check_dataflow``) and captures, through
``graph_lowering.Lowering``: the upload graph once per pinned staging buffer (on a second
stream), and graph 1 then graph 2 as one step graph (on the step stream). ``launch(slot)``
enqueues one step with device-side event waits only (no host sync, no allocation).
``build_eval(rows)`` captures the ``q_values`` graph for ``rows`` states (``eval_plan``) on its
own small arena.

The CPU executor's ``CpuEngine`` offers the same methods (``foxhunt.fast.cpu_executor``).
"""

from __future__ import annotations

import functools

import numpy as np

from foxhunt.fast.eval_plan import Q_HOST, X_HOST, eval_host_specs, eval_ops
from foxhunt.fast.graph1_plan import graph1_ops
from foxhunt.fast.graph2_plan import graph2_ops, staging_name, upload_ops
from foxhunt.fast.graph_lowering import BranchPool, Lowering, layered_address
from foxhunt.fast import step_program
from foxhunt.fast.dataflow import check_dataflow, release_points
from foxhunt.fast.step_layout import READBACK_FIELDS, EvalLayout, StepLayout
from foxhunt.fast.step_program import StepProgram, step_constants
from foxhunt.reference.config import DQNConfig


#: The host mirrors of ``readback`` and ``flags`` (``GpuEngine.read``), and their arena buffers.
READBACK_HOST, FLAGS_HOST = "readback_host", "flags_host"
READ_BUFFERS = {READBACK_HOST: "readback", FLAGS_HOST: "flags"}


#: Whether the staging ring (the upload graphs' sources, which the host only writes) is
#: allocated write-combined (``Device.pinned_empty``'s ``write_combined``): the host's batch
#: writes then bypass its caches, so the upload's copy does not wait on them. Off: on H100s
#: (session 44, ``Trainer.step``, two trainers an arm, three calls) it was no faster (core bf16
#: 103.4 / 103.0 / 104.6 us against 102.6 / 103.0 / 102.9 cached, every second-wave source 152.9
#: / 152.6 / 153.5 against 152.8 / 152.6 / 153.1, core f32 138.0 against 137.4); not measured on
#: an H200's host.
WRITE_COMBINED_STAGING = False


def host_buffer_specs(layout: StepLayout, staging_slots: int) -> dict[str, tuple]:
    """The engine's pinned host buffers, ``{name: (shape, dtype)}``: the staging ring (byte
    mirrors of the arena's ``batch``, the upload graphs' sources) and the mirrors of the
    ``readback`` block and the ``flags`` (``read``'s copies out)."""
    specs = {staging_name(s): ((layout.batch_nbytes,), np.dtype(np.uint8)) for s in range(staging_slots)}
    specs[READBACK_HOST] = ((len(READBACK_FIELDS),), np.dtype(np.float32))
    specs[FLAGS_HOST] = ((layout.sentinel.n_desc,), np.dtype(np.int32))
    return specs


def pinned_host_buffers(device, layout: StepLayout, staging_slots: int,
                        members: int | None = None) -> dict[str, np.ndarray]:
    """The buffers of ``host_buffer_specs`` on ``device``, page-locked and zero-filled, each of
    ``members`` rows where ``members`` is given (a population's); the staging ring
    write-combined where :data:`WRITE_COMBINED_STAGING`."""
    lead = () if members is None else (members,)
    staging = {staging_name(s) for s in range(staging_slots)}
    return {name: device.pinned_empty((*lead, *shape), dtype,
                                      write_combined=WRITE_COMBINED_STAGING and name in staging)
            for name, (shape, dtype) in host_buffer_specs(layout, staging_slots).items()}


def step_plans(program: StepProgram, staging_slots: int) -> dict:
    """The records of the upload graphs (one per staging slot), graph 1 and graph 2 made by
    ``program``, their dataflow checked: ``{"upload": [Ops], "graph1": Ops, "graph2": Ops}``."""
    lay = program.lay
    ops_up = upload_ops(program, staging_slots)
    ops1, ops2 = graph1_ops(program), graph2_ops(program)
    check_dataflow([ops_up[0], ops1, ops2], lay.role, lay.zero_padding())
    return {"upload": ops_up, "graph1": ops1, "graph2": ops2}


class GpuEngine:
    """See the module docstring."""

    def __init__(self, config: DQNConfig, *, device=None, gemm_workspace: str = "none",
                 staging_slots: int = 2, seed: int = 0, n_step_on: bool = False,
                 fused_trunk: bool = False, fused_heads: bool = False,
                 stacked_backward: bool = False):
        from foxhunt.fast._build import package_module
        from foxhunt.fast.device import Arena, Device
        from foxhunt.fast.gemm import GemmPlan, PlanCache, cublaslt_version
        from foxhunt.fast.gemm_algos import AlgoStore

        dev = Device(0) if device is None else device
        dev.make_current()
        self.device = dev
        #: Set by ``close()``: graphs built on this engine (a collector's, an evaluator's) must
        #: not run any more (they read its freed arena).
        self.closed = False
        self.module = dev.load_module(package_module(dev.arch))
        self.layout = lay = StepLayout(config, n_step_on=n_step_on)
        self.arena = Arena.from_specs(dev, lay.specs)
        # A name the step layout does not have raises its own error (StepLayout.region).
        self.address = layered_address([(lay, self.arena)], lay.region)
        constants = step_constants(lay, self.address)
        for name, value in constants.items():
            self.arena.upload(name, value.reshape(self.arena.spec(name).shape))
        self.stream = dev.stream
        pinned = pinned_host_buffers(dev, lay, staging_slots)
        # Each distinct GEMM planned once (the step and evaluation passes repeat shapes).
        self.gemm_plans = PlanCache(functools.partial(GemmPlan, dev),
                                    store=AlgoStore.for_device(dev, cublaslt_version()))
        self.program = StepProgram(
            lay, planner=self.gemm_plans, constants=constants,
            host_nbytes={staging_name(s): pinned[staging_name(s)].nbytes for s in range(staging_slots)},
            arch=dev.arch, gemm_workspace=gemm_workspace, seed=seed, sm_count=dev.multiprocessor_count,
            fuse_trunk=fused_trunk, fuse_heads=fused_heads, stacked_backward=stacked_backward)
        self._capture(pinned, step_plans(self.program, staging_slots),
                      Lowering(self.module, self.address, pinned),
                      split=config.precision in step_program.SPLIT_STEP_GRAPH,
                      priority_by_graph=config.precision in step_program.PRIORITY_BY_GRAPH,
                      graph2_early=config.precision in step_program.GRAPH2_EARLY_LAUNCH)

    def _capture(self, pinned: dict, plans: dict, lowering: Lowering, *,
                 split: bool = False, priority_by_graph: bool = False,
                 graph2_early: bool = True) -> None:
        """Capture ``plans`` (``step_plans``') through ``lowering``: the upload graphs on a
        second stream, graphs 1 and 2 on the step stream, as ONE step graph or, with ``split``
        (``step_program.SPLIT_STEP_GRAPH``), as two launched one after the other; ``pinned``:
        the host buffers (``host_buffer_specs``' names: the staging ring and the read mirrors).
        ``priority_by_graph`` (``step_program.PRIORITY_BY_GRAPH``): one step graph's launch
        priorities ranked over graph 1's nodes and graph 2's apart (``GraphCapture.priority_group``),
        as a split's two graphs are. ``graph2_early`` (``step_program.GRAPH2_EARLY_LAUNCH``):
        graph 2's kernels launched early (``Lowering.early_launches``), else each starts after
        its predecessors end."""
        from foxhunt.fast.device import _driver, call
        from foxhunt.fast.graphs import GraphCapture, set_capture_frontier

        ops_up, ops1, ops2 = plans["upload"], plans["graph1"], plans["graph2"]
        #: Graph 2 as a graph of its own (``split``), else None (it is in ``_step_graph``).
        self._graph2 = None
        staging_slots = len(ops_up)
        # Pinned staging ring (byte mirrors of the arena's batch buffer) and its views.
        self._staging = [pinned[staging_name(s)] for s in range(staging_slots)]
        self._staging_views = [self.batch_views(buf) for buf in self._staging]
        drv = _driver()
        no_timing = drv.CUevent_flags.CU_EVENT_DISABLE_TIMING.value
        # The upload stream and its events: uploaded[slot] (after the upload graph that read
        # staging buffer slot) and graph1_done (recorded by the step graph after graph 1).
        self._upload_stream = self.device.new_stream()
        self._uploaded = [call(drv.cuEventCreate, no_timing) for _ in range(staging_slots)]
        self._event_used = [False] * staging_slots
        self._graph1_done = call(drv.cuEventCreate, no_timing)
        self.pool = BranchPool()  # side streams and events of the parallel sections
        self.lowering = lowering
        for ops in (*ops_up, ops1, ops2):
            self.pool.reserve(ops)
            self.lowering.prepare(ops)
        # Each upload graph ends in an external event record node of uploaded[slot]: a launch
        # records it itself (one driver call where a launch and a record took two: the host's
        # Trainer.step paces the core bf16 step, benches/step_host.py), and the graph's hold
        # waits on it before letting the staging buffer go.
        record = drv.CUevent_record_flags.CU_EVENT_RECORD_EXTERNAL.value
        self._upload = []
        for slot, ops in enumerate(ops_up):
            graph = GraphCapture(self._upload_stream)
            with graph:
                self.lowering.enqueue(ops, self._upload_stream, self.pool)
                call(drv.cuEventRecordWithFlags, self._uploaded[slot], self._upload_stream.handle,
                     record)
            graph.hold(*self.lowering.host_arrays(ops), launch_event=self._uploaded[slot])
            self._upload.append(graph)
        # Graphs 1 and 2 are ONE captured graph (a graph boundary costs about 5 us per step on
        # the H200: the wave step's graph 1 then graph 2 took 198.1 us, as one graph 192.9 us),
        # unless split (step_program.SPLIT_STEP_GRAPH: then graph 2 is a graph of its own).
        # graph1_done is an external event record node on a side branch forked after graph 1
        # (the upload stream waits on it); with step_program.EARLY_UPLOAD_RELEASE, the branch
        # depends only on graph 1's last users of the batch (dataflow.release_points), so the
        # next upload may start before graph 1 ends (where graph 2 uses the batch, or no node
        # does, the record stays after graph 1). Graph 2 does not wait for the record.
        release = (release_points(ops_up[0], [ops1, ops2])
                   if step_program.EARLY_UPLOAD_RELEASE else None)
        captured = [] if release else None
        self._step_graph = GraphCapture(self.stream, max_branches=1)
        with self._step_graph:
            self.lowering.enqueue(ops1, self.stream, self.pool, captured=captured)
            with self._step_graph.branch() as side:
                if release:
                    if len(captured) != ops1.node_count():  # pragma: no cover - enqueue's contract
                        raise AssertionError(f"{len(captured)} nodes captured, graph 1 has "
                                             f"{ops1.node_count()}")
                    set_capture_frontier(side.handle,
                                         [node for i in release for node in captured[i]])
                call(drv.cuEventRecordWithFlags, self._graph1_done, side.handle, record)
                graph1_nodes = self._step_graph.nodes_so_far()
                if not split:
                    if priority_by_graph:
                        self._step_graph.priority_group()
                    with self.lowering.early_launches(graph2_early):
                        self.lowering.enqueue(ops2, self.stream, self.pool)
        if split:
            self._graph2 = GraphCapture(self.stream, max_branches=0)  # the pool's branches only
            with self._graph2, self.lowering.early_launches(graph2_early):
                self.lowering.enqueue(ops2, self.stream, self.pool)
        graph2_nodes = (self._graph2.node_count if split
                        else self._step_graph.node_count - graph1_nodes)
        self._node_counts = (self._upload[0].node_count, graph1_nodes, graph2_nodes)
        self.plans = plans
        #: Launches per step as planned (upload, graph 1, graph 2).
        self.planned_launches = (ops_up[0].node_count(), ops1.node_count(), ops2.node_count())
        # Host mirrors of the readback block and the flags (pinned: the async copies are real).
        self._readback_host, self._flags_host = pinned[READBACK_HOST], pinned[FLAGS_HOST]
        for host_name, name in READ_BUFFERS.items():  # read() copies the host mirror's size
            if self.read_nbytes(pinned[host_name]) > self.arena.spec(name).nbytes:
                raise AssertionError(f"{host_name}: {pinned[host_name].nbytes} bytes, buffer "
                                     f"{name!r} holds {self.arena.spec(name).nbytes}")

    def batch_views(self, staging: np.ndarray):
        """The named views of one staging buffer (what ``staging(slot)`` returns)."""
        return self.layout.batch_views(staging)

    @staticmethod
    def read_nbytes(mirror: np.ndarray) -> int:
        """Bytes ``read()`` copies into a read mirror (the whole mirror)."""
        return mirror.nbytes

    @property
    def graph_node_counts(self) -> tuple[int, int, int]:
        """Nodes of the upload graph (the copy and its ``uploaded[slot]`` record node), and of
        the step graph's two parts: graph 1 (with the ``graph1_done`` record node) and graph 2."""
        return self._node_counts

    def capture_plans(self, names):
        """A new ``GraphCapture`` on the step stream of ``plans[name]`` for each of ``names``, in
        order, as one graph (benches time parts of the step with it; the caller closes it)."""
        from foxhunt.fast.graphs import GraphCapture

        graph = GraphCapture(self.stream)
        with graph:
            for name in names:
                self.lowering.enqueue(self.plans[name], self.stream, self.pool)
        return graph

    def staging(self, slot: int) -> dict[str, np.ndarray]:
        """Views of staging buffer ``slot``, once the upload that last read it is done (blocks
        only when the GPU is a whole ring behind)."""
        from foxhunt.fast.device import _driver, call

        if self._event_used[slot]:
            call(_driver().cuEventSynchronize, self._uploaded[slot])
        return self._staging_views[slot]

    def launch(self, slot: int) -> None:
        """Enqueue one step from staging buffer ``slot``: the upload graph on the upload stream
        (after the previous step's last users of the batch: its ``graph1_done`` record node,
        after graph 1 or, with ``step_program.EARLY_UPLOAD_RELEASE``, after graph 1's last
        readers of the batch; the graph records ``uploaded[slot]`` as its last node), then the step
        graph (graphs 1 and 2, after the upload) on the step stream. Four driver calls (five with
        a split step graph), only device-side event waits: no host sync."""
        from foxhunt.fast.device import _driver, call

        drv = _driver()
        up, main = self._upload_stream.handle, self.stream.handle
        call(drv.cuStreamWaitEvent, up, self._graph1_done, 0)
        self._upload[slot].replay(up)
        self._event_used[slot] = True
        call(drv.cuStreamWaitEvent, main, self._uploaded[slot], 0)
        self.replay_step_graphs()

    def replay_step_graphs(self) -> None:
        """Replay the step graph (graphs 1 and 2; with a split capture, graph 1's then graph
        2's) on the step stream."""
        self._step_graph.replay()
        if self._graph2 is not None:
            self._graph2.replay()

    def read(self) -> tuple[np.ndarray, np.ndarray]:
        """Synchronise, then the readback block and the flags (copies)."""
        for out, name in zip((self._readback_host, self._flags_host), READ_BUFFERS.values()):
            self.device.copy_to_host(out, self.arena.ptr(name), wait=False)
        self.stream.synchronize()  # the copies land before the mirrors are read
        return self._readback_host.copy(), self._flags_host.copy()

    def synchronize(self) -> None:
        self.stream.synchronize()

    def forget_uploads(self) -> None:
        """After a synchronisation no upload is in flight: the staging ring is free."""
        self._event_used = [False] * len(self._event_used)

    def build_eval(self, rows: int) -> GpuEval:
        return GpuEval(self, rows)

    def close(self) -> None:
        """Release the graphs, GEMM plans, events and device memory (unusable afterwards)."""
        from foxhunt.fast.device import _driver

        self.closed = True
        try:
            self._upload_stream.synchronize()
            self.stream.synchronize()
        finally:
            for g in [*self._upload, self._step_graph, self._graph2]:
                if g is not None:
                    g.close()
            self.gemm_plans.close()
            self.pool.close()
            for event in [*self._uploaded, self._graph1_done]:
                _driver().cuEventDestroy(event)
            self._upload_stream.close()
            self.arena.close()


class GpuEval:
    """The ``q_values`` graph for ``rows`` states: copy in from a pinned buffer, the greedy
    forward on its own arena, copy out to a pinned buffer; replayed on the step stream."""

    def __init__(self, engine: GpuEngine, rows: int):
        from foxhunt.fast.device import Arena
        from foxhunt.fast.graphs import GraphCapture

        dev = engine.device
        self.engine = engine
        self.evl = evl = EvalLayout(engine.layout, rows)
        self.arena = Arena.from_specs(dev, evl.specs)
        host = {name: dev.pinned_empty(shape, dtype) for name, (shape, dtype) in eval_host_specs(evl).items()}
        self.x_host, self.q_host = host[X_HOST], host[Q_HOST]

        address = layered_address([(evl, self.arena)], engine.address)
        ops = eval_ops(engine.program, evl)
        check_dataflow([ops], lambda name: evl.role(name) if name in evl else engine.layout.role(name),
                       evl.zero_padding())
        lowering = Lowering(engine.module, address, host)
        engine.pool.reserve(ops)
        lowering.prepare(ops)
        self.graph = GraphCapture(engine.stream, max_branches=0)  # branches come from the pool
        with self.graph:
            lowering.enqueue(ops, engine.stream, engine.pool)
        self.graph.hold(*lowering.host_arrays(ops))  # x_host and q_host

    def run(self, states: np.ndarray) -> list[np.ndarray]:
        self.x_host[...] = states  # casts to float32
        self.graph.replay()
        self.engine.stream.synchronize()
        return self.evl.split_q(self.q_host)

    def close(self) -> None:
        """Release the graph and its arena (the stream is idle: each run synchronises)."""
        self.graph.close()
        self.arena.close()


__all__ = ["FLAGS_HOST", "READBACK_HOST", "READ_BUFFERS", "GpuEngine", "GpuEval", "host_buffer_specs",
           "pinned_host_buffers", "step_plans"]
