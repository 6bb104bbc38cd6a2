"""The fast ``Trainer``: SPEC 4 on the GPU, each step the two step graphs and a captured upload.

Same interface, state and numerics contract as ``foxhunt.reference.trainer.Trainer`` (the
``TrainerBackend`` of ``foxhunt.reference.backend``); the step's plan (buffers, GEMMs, launch
lists) is ``foxhunt.fast.step_plan``.

- Construction: ``Trainer(config, seed=0)`` raises ``NoCudaDeviceError`` (with the reason)
  where no CUDA device/driver is usable. Otherwise it compiles ``cuda_src`` with NVRTC for the
  device (disk cache), allocates ONE arena holding every buffer of the step, uploads the initial
  state of ``reference.Trainer(config, seed)`` (params, target, Adam m/v/t, spectral-norm u/v,
  ISV, flags; identical bits), plans every GEMM once, and captures the two step graphs.
- ``step(batch)``: validates the batch on the host, writes it into a pinned staging buffer (a
  ring of two, so the host never overwrites a buffer a queued upload has not copied yet: before
  reusing one it waits on the event recorded after the upload that read it, which only blocks
  when the GPU is two steps behind), then replays three graphs. The upload graph (captured copy
  from that staging buffer into the arena) runs on a second stream, ordered by device-side
  events after the previous step's graph 1 (the last reader of the batch) and before this
  step's graph 1: it overlaps the previous step's graph 2 instead of heading the step's
  critical path. Graph 1 (three forward passes, C51 + CQL losses,
  both backward passes, budget pipeline, inline sentinel checks, step scalars) and graph 2 (Adam
  with the Mech 6 safety clip and Mech 9 clamp, batched spectral norm, Polyak, BF16 mirrors, ISV
  producers, fused sentinel check) run on the step stream. Every value that changes from step
  to step (ISV-driven bounds, norms, Adam's step) is read on the device: no allocation, no
  synchronisation, no host round trip.
- Deferred readback exactly as the reference (SPEC 9): at a step that is a multiple of
  ``readback_interval``, after a non-finite fresh read, and at ``end_epoch()``, the host
  synchronises the stream and downloads the device ``readback`` block and the flags (the only
  syncs of the hot path); otherwise ``step`` returns the last values read, marked stale.
- ``q_values``, ``last_td_errors``, ``state_dict``/``load_state_dict``, ``fold_boundary`` and
  the ``flags`` property synchronise (they are not in the hot path). Checkpoints use the
  reference's keys, dtypes and shapes: a checkpoint loads into either backend.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from foxhunt.reference import isv as isv_mod
from foxhunt.reference import sentinels
from foxhunt.reference.backend import StepScalars, TrainerBackend
from foxhunt.reference.batch import Batch
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.kernels import dense as ref_dense
from foxhunt.reference.trainer import Trainer as ReferenceTrainer
from foxhunt.reference.trainer import _zero_scalars

from .step_plan import READBACK_FIELDS, READBACK_INDEX, StepLayout, StepProgram

#: Pinned staging buffers (and graph-1 instances) the host cycles through.
STAGING_RING = 2
#: Row counts whose ``q_values`` graph is kept (least recently used evicted beyond it).
EVAL_CACHE_SIZE = 8


class Trainer(TrainerBackend):
    """GPU trainer (CUDA graphs, cuBLASLt, NVRTC kernels); see the module docstring."""

    backend_name = "fast"

    def __init__(self, config: DQNConfig, seed: int = 0, *, device=None):
        from foxhunt.fast.device import Device, _require_cuda

        _require_cuda()  # NoCudaDeviceError with the reason, before any other work
        if not isinstance(config, DQNConfig):
            raise ValueError(f"config: expected a DQNConfig, got {type(config).__name__}")
        self.config = config
        self.seed = int(seed)
        self.device = Device(0) if device is None else device
        self._closed = False
        self._build()
        self.load_state_dict(ReferenceTrainer(config, seed=self.seed).state_dict())

    # ------------------------------------------------------------------ construction
    def _build(self) -> None:
        from foxhunt.fast._build import compile_sources
        from foxhunt.fast.device import Arena, _driver, call
        from foxhunt.fast.graphs import GraphCapture

        dev = self.device
        dev.make_current()
        self.module = dev.load_module(compile_sources(dev.arch))
        self.layout = lay = StepLayout(self.config)
        self.arena = Arena.from_specs(dev, lay.specs)
        self.program = prog = StepProgram(dev, self.module, self.config, self.arena, lay)
        for name, value in prog.constants().items():
            self.arena.upload(name, value.reshape(self.arena.spec(name).shape))
        self._stream = dev.stream
        # Pinned staging ring (byte mirrors of the arena's batch buffer) and its views.
        self._staging = [dev.pinned_empty(lay.batch_nbytes, np.uint8) for _ in range(STAGING_RING)]
        self._staging_views = [self._batch_views(buf) for buf in self._staging]
        drv = _driver()
        no_timing = drv.CUevent_flags.CU_EVENT_DISABLE_TIMING.value
        # The upload stream and its events: uploaded[slot] (after the upload graph that read
        # staging buffer slot) and graph1_done (after the last graph 1).
        self._upload_stream = dev.new_stream()
        self._uploaded = [call(drv.cuEventCreate, no_timing) for _ in range(STAGING_RING)]
        self._event_used = [False] * STAGING_RING
        self._graph1_done = call(drv.cuEventCreate, no_timing)
        # Capture: the upload graph once per staging buffer, graph 1 and graph 2 once.
        ops_up = prog.upload_ops([buf.ctypes.data for buf in self._staging])
        ops1, ops2 = prog.graph1_ops(), prog.graph2_ops()
        for ops in (*ops_up, ops1, ops2):
            prog.pool.reserve(ops)
        self._upload = []
        for ops in ops_up:
            graph = GraphCapture(self._upload_stream)
            with graph:
                ops.enqueue(self._upload_stream, prog.pool)
            self._upload.append(graph)
        self._graph1 = GraphCapture(self._stream)
        with self._graph1:
            ops1.enqueue(self._stream, prog.pool)
        self._graph2 = GraphCapture(self._stream)
        with self._graph2:
            ops2.enqueue(self._stream, prog.pool)
        #: Launches per step as planned (upload, graph 1, graph 2); the graphs' own node counts
        #: are ``graph_node_counts``.
        self.planned_launches = (ops_up[0].node_count(), ops1.node_count(), ops2.node_count())
        # Host mirrors of the readback block and the flags (pinned: the async copies are real).
        self._readback_host = dev.pinned_empty(len(READBACK_FIELDS), np.float32)
        self._flags_host = dev.pinned_empty(lay.sentinel.n_desc, np.int32)
        self._eval_cache: dict[int, tuple] = {}

    def _batch_views(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        views = {}
        for name, (offset, shape, dtype) in self.layout.batch_fields.items():
            nbytes = int(np.prod(shape)) * dtype.itemsize
            views[name] = buf[offset:offset + nbytes].view(dtype).reshape(shape)
        return views

    # ------------------------------------------------------------------ diagnostics
    @property
    def node_count(self) -> int:
        """Nodes of the graphs replayed per step (upload + graph 1 + graph 2)."""
        return sum(self.graph_node_counts)

    @property
    def graph_node_counts(self) -> tuple[int, int, int]:
        """Nodes of the upload graph, graph 1 and graph 2."""
        return self._upload[0].node_count, self._graph1.node_count, self._graph2.node_count

    def debug_buffer(self, name: str) -> np.ndarray:
        """A copy of arena buffer ``name`` (``foxhunt.fast.step_plan.StepLayout.specs``), for
        tests and debugging (e.g. ``grad_c51``, ``td``, ``target_q [n_branches, B]``);
        synchronises."""
        return self.arena.download(name)

    @property
    def gemm_fallbacks(self) -> tuple[str, ...]:
        """GEMM epilogues cuBLASLt refused on this device (done as plain GEMM + kernels)."""
        return tuple(self.program.fallbacks)

    # ------------------------------------------------------------------ the step
    def step(self, batch: Batch) -> StepScalars:
        from foxhunt.fast.device import _driver, call

        batch.validate(self.config)
        slot = self.step_count % STAGING_RING
        if self._event_used[slot]:  # staging reuse (see module doc)
            call(_driver().cuEventSynchronize, self._uploaded[slot])
        B = self.config.batch_size
        views = self._staging_views[slot]
        views["x"][:B] = batch.s
        views["x"][B:] = batch.s2
        views["a"][...] = batch.a.T
        views["r"][...] = batch.r
        views["done"][...] = batch.done
        views["isw"][...] = batch.isw
        self._launch(slot)
        self.step_count += 1
        self._stepped = True
        due = self.step_count % self.config.readback_interval == 0 or self._force_fresh
        if due:
            self._last = self._read_scalars()
            self._force_fresh = not self._last.all_finite()
            return self._last
        return self._last.as_stale(self.step_count)

    def _launch(self, slot: int) -> None:
        """Enqueue one step from staging buffer ``slot``: the upload graph on the upload stream
        (after the previous graph 1, the last reader of the batch), then graph 1 (after the
        upload) and graph 2 on the step stream. Only device-side event waits: no host sync."""
        from foxhunt.fast.device import _driver, call

        drv = _driver()
        up, main = self._upload_stream.handle, self._stream.handle
        call(drv.cuStreamWaitEvent, up, self._graph1_done, 0)
        self._upload[slot].replay(up)
        call(drv.cuEventRecord, self._uploaded[slot], up)
        self._event_used[slot] = True
        call(drv.cuStreamWaitEvent, main, self._uploaded[slot], 0)
        self._graph1.replay()
        call(drv.cuEventRecord, self._graph1_done, main)
        self._graph2.replay()

    def _read_scalars(self) -> StepScalars:
        """Synchronise and read the last step's scalars and flags (a fresh ``StepScalars``)."""
        dev = self.device
        dev.copy_to_host(self._readback_host, self.arena.ptr("readback"), wait=False)
        dev.copy_to_host(self._flags_host, self.arena.ptr("flags"), wait=False)
        self._stream.synchronize()
        vals = self._readback_host
        get = lambda name: float(vals[READBACK_INDEX[name]])  # noqa: E731
        n_slots = sentinels.NUM_SENTINEL_SLOTS
        return StepScalars(
            step=self.step_count, read_at=self.step_count, fresh=True,
            loss=get("loss"), c51_loss=get("c51_loss"), cql_loss=get("cql_loss"),
            grad_norm=get("grad_norm"), c51_norm_pre=get("c51_norm_pre"),
            c51_norm_post=get("c51_norm_post"), cql_norm_pre=get("cql_norm_pre"),
            cql_norm_post=get("cql_norm_post"), clip_bound=get("clip_bound"),
            safety_clip_fired=bool(get("safety_clip_fired") != 0.0), mean_q=get("mean_q"),
            mean_target_q=get("mean_target_q"),
            flags=tuple(int(f) for f in self._flags_host[:n_slots]),
        )

    def end_epoch(self) -> StepScalars:
        if self._stepped:
            self._last = self._read_scalars()
            self._force_fresh = not self._last.all_finite()
        return dataclasses.replace(self._last, step=self.step_count, fresh=self._stepped)

    # ------------------------------------------------------------------ folds and evaluation
    def fold_boundary(self) -> None:
        """Mech 3 hard target sync, Mech 4 Adam reset, ISV fold reset, sentinel flags reset
        (the Mech 6 slow EMA is a CrossFold ISV slot: kept)."""
        from foxhunt.fast.device import _driver, call

        lay, arena, dev = self.layout, self.arena, self.device
        stream = self._stream
        drv = _driver()
        NP = lay.NP
        params, mirror = arena.ptr("params2"), arena.ptr("mirror2")
        call(drv.cuMemcpyDtoDAsync, params + NP * 4, params, NP * 4, stream.handle)
        call(drv.cuMemcpyDtoDAsync, mirror + NP * 2, mirror, NP * 2, stream.handle)
        for name in ("adam_m", "adam_v", "adam_t", "flags"):
            arena.zero(name, stream)
        bus = isv_mod.ISVBus()
        bus.from_array(arena.download("isv"))  # synchronises the stream first
        bus.fold_reset()
        arena.upload("isv", bus.to_array())
        dev.make_current()

    def last_td_errors(self) -> np.ndarray:
        if not self._stepped:
            raise RuntimeError("last_td_errors(): no step has run yet")
        return self.arena.download("td")

    def q_values(self, states: np.ndarray) -> list[np.ndarray]:
        """Expected Q of every branch for ``states`` ``[N, state_dim]`` under the online params
        (``list`` of ``[N, n_d]`` float32 arrays, fresh copies); synchronises.

        Per row count ``N``, the first call captures one graph (copy in from a pinned buffer,
        the greedy forward of ``StepProgram.eval_ops`` on its own small arena, copy out to a
        pinned buffer); every call is a host copy into the pinned input, one graph launch on the
        step stream (so after every step enqueued before it) and one synchronisation."""
        states = np.asarray(states)
        SD = self.config.state_dim
        if states.ndim != 2 or states.shape[1] != SD or states.shape[0] < 1:
            raise ValueError(f"states: shape {states.shape}; expected [N, {SD}] with N >= 1")
        rows = states.shape[0]
        cached = self._eval_cache.pop(rows, None)
        if cached is None:
            if len(self._eval_cache) >= EVAL_CACHE_SIZE:  # evict the least recently used
                self._close_eval(self._eval_cache.pop(next(iter(self._eval_cache))))
            cached = self._build_eval(rows)
        self._eval_cache[rows] = cached  # most recently used last
        graph, _, x_host, q_host, q_offsets = cached
        x_host[...] = states  # casts to float32
        graph.replay()
        self._stream.synchronize()
        return [q_host[start:start + rows * n].reshape(rows, n).copy()
                for start, n in zip(q_offsets, self.config.branches)]

    def _build_eval(self, rows: int) -> tuple:
        """The ``q_values`` graph for ``rows`` states and what it uses: ``(graph, arena, x_host,
        q_host, q_offsets)``."""
        from foxhunt.fast.device import Arena
        from foxhunt.fast.graphs import GraphCapture

        specs, packed = self.layout.eval_specs(rows)
        arena = Arena.from_specs(self.device, specs)
        x_host = self.device.pinned_empty(specs["x"][0], np.float32)
        q_host = self.device.pinned_empty(arena.spec("q").shape, np.float32)
        ops = self.program.eval_ops(arena, packed, rows, x_host=x_host.ctypes.data,
                                    q_host=q_host.ctypes.data)
        self.program.pool.reserve(ops)
        graph = GraphCapture(self._stream, max_branches=0)  # branches come from the pool
        with graph:
            ops.enqueue(self._stream, self.program.pool)
        offsets = packed["q"].offsets
        return graph, arena, x_host, q_host, tuple(offsets[d] for d in range(len(self.config.branches)))

    @staticmethod
    def _close_eval(cached: tuple) -> None:
        """Release one ``q_values`` graph and its arena (the stream is idle: each call syncs)."""
        graph, arena, *_ = cached
        graph.close()
        arena.close()

    # ------------------------------------------------------------------ state exchange
    @property
    def flags(self) -> np.ndarray:
        """A copy of the sentinel flags (int32 ``[NUM_SENTINEL_SLOTS]``); synchronises."""
        return self.arena.download("flags")[:sentinels.NUM_SENTINEL_SLOTS].copy()

    def state_dict(self) -> dict[str, np.ndarray]:
        lay, arena = self.layout, self.arena
        params2 = arena.download("params2")
        state = {
            "params": params2[0].copy(), "target": params2[1].copy(),
            "adam_m": arena.download("adam_m"), "adam_v": arena.download("adam_v"),
            "adam_t": arena.download("adam_t").astype(np.int64),
            "isv": arena.download("isv"),
            "flags": arena.download("flags")[:sentinels.NUM_SENTINEL_SLOTS].copy(),
            "step": np.array([self.step_count], np.int64),
        }
        sn_u, sn_v = arena.download("sn_u"), arena.download("sn_v")
        pu, pv = lay.packed["sn_u"], lay.packed["sn_v"]
        for t in lay.weights:
            state[f"sn_u.{t.name}"] = sn_u[pu.offsets[t.name]:pu.offsets[t.name] + t.shape[0]].copy()
            state[f"sn_v.{t.name}"] = sn_v[pv.offsets[t.name]:pv.offsets[t.name] + t.shape[1]].copy()
        return state

    def _expected_state(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        lay = self.layout
        NP = lay.NP
        exp = {
            "params": ((NP,), np.dtype(np.float32)), "target": ((NP,), np.dtype(np.float32)),
            "adam_m": ((NP,), np.dtype(np.float32)), "adam_v": ((NP,), np.dtype(np.float32)),
            "adam_t": ((1,), np.dtype(np.int64)),
            "isv": ((isv_mod.ISV_LEN,), np.dtype(np.float32)),
            "flags": ((sentinels.NUM_SENTINEL_SLOTS,), np.dtype(np.int32)),
            "step": ((1,), np.dtype(np.int64)),
        }
        for t in lay.weights:
            exp[f"sn_u.{t.name}"] = ((t.shape[0],), np.dtype(np.float32))
            exp[f"sn_v.{t.name}"] = ((t.shape[1],), np.dtype(np.float32))
        return exp

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        expected = self._expected_state()
        missing = sorted(set(expected) - set(state))
        extra = sorted(set(state) - set(expected))
        if missing or extra:
            raise ValueError(f"state mismatch: missing {missing}, unexpected {extra}")
        for k, (shape, dtype) in expected.items():
            if state[k].shape != shape or state[k].dtype != dtype:
                raise ValueError(f"state[{k!r}]: shape {state[k].shape} dtype {state[k].dtype}, "
                                 f"expected shape {shape} dtype {dtype}")
        isv_mod.ISVBus().from_array(state["isv"])  # raises FingerprintMismatch, as the reference
        lay, arena = self.layout, self.arena
        self._stream.synchronize()
        params2 = np.stack([state["params"], state["target"]]).astype(np.float32)
        arena.upload("params2", params2)
        arena.upload("mirror2", ref_dense.f32_to_bf16(params2))
        arena.upload("adam_m", np.ascontiguousarray(state["adam_m"]))
        arena.upload("adam_v", np.ascontiguousarray(state["adam_v"]))
        arena.upload("adam_t", np.ascontiguousarray(state["adam_t"]))
        arena.upload("isv", np.ascontiguousarray(state["isv"]))
        flags = np.zeros(lay.sentinel.n_desc, np.int32)
        flags[:sentinels.NUM_SENTINEL_SLOTS] = state["flags"]
        arena.upload("flags", flags)
        for name in ("sn_u", "sn_v"):
            packed = lay.packed[name]
            buf = np.zeros(arena.spec(name).shape, np.float32)
            for t in lay.weights:
                start = packed.offsets[t.name]
                buf[start:start + packed.counts[t.name]] = state[f"{name}.{t.name}"]
            arena.upload(name, buf)
        self.step_count = int(state["step"][0])
        self._stepped = False
        self._force_fresh = False
        self._last = _zero_scalars(sentinels.NUM_SENTINEL_SLOTS)
        self._event_used = [False] * STAGING_RING

    def close(self) -> None:
        """Release the graphs, GEMM plans, events and device memory (unusable afterwards)."""
        from foxhunt.fast.device import _driver

        if self._closed:
            return
        self._closed = True
        try:
            self._upload_stream.synchronize()
            self._stream.synchronize()
        finally:
            for g in [*self._upload, self._graph1, self._graph2]:
                g.close()
            for plan in self.program.plans:
                plan.close()
            self.program.pool.close()
            for event in [*self._uploaded, self._graph1_done]:
                _driver().cuEventDestroy(event)
            self._upload_stream.close()
            for cached in self._eval_cache.values():
                self._close_eval(cached)
            self.arena.close()


__all__ = ["STAGING_RING", "Trainer"]
