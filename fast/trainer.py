"""The fast ``Trainer``: SPEC 4 on the GPU, each step the two step graphs and a captured upload.

Same interface, state and numerics contract as ``foxhunt.reference.trainer.Trainer`` (the
``TrainerBackend`` of ``foxhunt.reference.backend``). The step's plan is data: the buffers
(``step_layout``) and the launch records of each graph (``step_program``, ``graph1_plan``,
``graph2_plan``, ``eval_plan``); the device side (arena, capture, replay) is
``gpu_engine.GpuEngine``. This class is the host side, shared with ``cpu_executor.CpuTrainer``
(the same plan run on the CPU by the reference kernels).

- Construction: ``Trainer(config, seed=0, *, device=None, gemm_workspace="none",
  fused_trunk=False, fused_heads=False, stacked_backward=False)`` raises
  ``NoCudaDeviceError`` (with the reason) where no CUDA device/driver is usable. Otherwise the
  engine compiles, allocates, plans and captures, and the initial state of
  ``reference.Trainer(config, seed)`` is uploaded (params, target, Adam m/v/t, spectral-norm
  u/v, ISV, flags; identical bits). ``gemm_workspace`` (``"none"`` or ``"default"``): the GEMM
  plans' workspace policy (``step_program``). ``fused_trunk``: the training passes run the trunk
  forward as ONE ``trunk_forward_bf16`` kernel instead of four nodes (``StepProgram``; bf16 on
  sm_90 and newer only, else ``ValueError``); off by default (session 39 measured the core bf16
  step 0.6-1.0 us faster with it, session 40 with the role shares of ``step_program`` no faster
  and the step with every second-wave source 1.5 us slower: README, "The f32 heads' outputs in
  one launch; the fused trunk with the role shares").
  ``fused_heads``: the training passes run the heads' first layers, their BF16 copy and second
  layers as ONE ``heads_forward_bf16`` kernel instead of nine nodes (same conditions).
  ``stacked_backward``: the C51 and CQL backward passes run stacked, each of their GEMMs one
  cuBLASLt launch of two batches (``StepProgram.backward``); off by default: measured no faster.
- ``step(batch)``: validates the batch on the host, writes it into a pinned staging buffer (a
  ring of ``STAGING_RING``, so the host never overwrites a buffer a queued upload has not
  copied yet: the engine waits on the event recorded after the upload that read it, which only
  blocks when the GPU is a whole ring behind), then the engine enqueues the upload graph (on a
  second stream, after the previous step's graph 1), then graph 1 and graph 2 (on the GPU, one
  captured step graph). Every value that
  changes from step to step (ISV-driven bounds, norms, Adam's step) is read on the device: no
  allocation, no synchronisation, no host round trip.
- Deferred readback exactly as the reference (SPEC 9): at a step that is a multiple of
  ``readback_interval``, after a non-finite fresh read, and at ``end_epoch()``, the host
  synchronises and reads the device ``readback`` block and the flags (the only syncs of the
  hot path); otherwise ``step`` returns the last values read, marked stale.
- ``q_values``, ``last_td_errors``, ``state_dict``/``load_state_dict``, ``fold_boundary`` and
  the ``flags`` property synchronise (they are not in the hot path). Checkpoints use the
  reference's keys, dtypes and shapes: a checkpoint loads into either backend.
- Second wave (every source of ``config.SECOND_WAVE_SWITCHES``): with the IQN head on, the state's ``step``
  is the device step counter the quantile fractions read as their offset (graph 2 advances
  it), and its ``seed`` the fractions' key, a launch argument of graph 1: loading the state of
  another seed rebuilds the engine (``_reseed``).
"""

from __future__ import annotations


import numpy as np

from foxhunt.reference import isv as isv_mod
from foxhunt.reference import sentinels
from foxhunt.reference.isv_step import eps_schedule
from foxhunt.reference.backend import (
    DeferredReadback,
    StepScalars,
    TrainerBackend,
    check_epoch,
    validate_state_dict,
)
from foxhunt.reference.batch import Batch
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.kernels import dense as ref_dense
from foxhunt.reference.step import check_batch_kind, check_n_step
from foxhunt.reference.trainer import Trainer as ReferenceTrainer

#: Pinned staging buffers (and upload graphs) the host cycles through.
STAGING_RING = 2
#: Row counts whose ``q_values`` graph is kept (least recently used evicted beyond it).
EVAL_CACHE_SIZE = 8


def check_step_batch(config: DQNConfig, layout, batch: Batch) -> None:
    """Refuse a batch the step cannot take (``Batch.validate``), or whose kind (n-step or
    1-step) is not the layout's (its discounts would be ignored, or missing)."""
    batch.validate(config)
    check_batch_kind(batch, layout.n_step_on)


def write_batch(config: DQNConfig, batch: Batch, views: dict[str, np.ndarray]) -> None:
    """A checked batch (``check_step_batch``) into the named views of a staging buffer."""
    B = config.batch_size
    views["x"][:B] = batch.s
    views["x"][B:] = batch.s2
    views["a"][...] = batch.a.T
    views["r"][...] = batch.r
    views["done"][...] = batch.done
    views["isw"][...] = batch.isw
    for name in ("discount", "next_ret", "regime"):  # n-step discounts and the auxiliary
        if name in views:                             # heads' labels, where they are on
            views[name][...] = getattr(batch, name)


class Trainer(TrainerBackend):
    """GPU trainer (CUDA graphs, cuBLASLt, NVRTC kernels); see the module docstring."""

    backend_name = "fast"

    def __init__(self, config: DQNConfig, seed: int = 0, *, device=None, gemm_workspace: str = "none",
                 n_step: int = 1, fused_trunk: bool = False, fused_heads: bool = False,
                 stacked_backward: bool = False):
        self._closed = True  # until the engine exists
        self.seed = int(seed)
        for name, value in (("fused_trunk", fused_trunk), ("fused_heads", fused_heads),
                            ("stacked_backward", stacked_backward)):
            if not isinstance(value, (bool, np.bool_)):
                raise ValueError(f"{name}={value!r}: must be a bool")
        self._engine_options = dict(device=device, gemm_workspace=gemm_workspace,
                                    n_step_on=check_n_step(config, n_step),
                                    fused_trunk=bool(fused_trunk),
                                    fused_heads=bool(fused_heads),
                                    stacked_backward=bool(stacked_backward))
        self._engine = self._make_engine(config, seed=self.seed, **self._engine_options)
        self._closed = False
        self.config = config
        self._eval_cache: dict[int, object] = {}
        self._readback = DeferredReadback(config.readback_interval, sentinels.NUM_SENTINEL_SLOTS)
        self.load_state_dict(ReferenceTrainer(config, seed=self.seed).state_dict())

    @staticmethod
    def _check_config(config) -> None:
        if not isinstance(config, DQNConfig):
            raise ValueError(f"config: expected a DQNConfig, got {type(config).__name__}")

    def _make_engine(self, config: DQNConfig, *, seed: int, device, gemm_workspace: str,
                     n_step_on: bool, fused_trunk: bool = False, fused_heads: bool = False,
                     stacked_backward: bool = False):
        from foxhunt.fast.device import _require_cuda
        from foxhunt.fast.gpu_engine import GpuEngine

        self._check_config(config)  # a config error is the user's to fix on any machine
        _require_cuda()  # NoCudaDeviceError with the reason, before any other work
        return GpuEngine(config, device=device, gemm_workspace=gemm_workspace,
                         staging_slots=STAGING_RING, seed=seed, n_step_on=n_step_on,
                         fused_trunk=fused_trunk, fused_heads=fused_heads,
                         stacked_backward=stacked_backward)

    def _reseed(self, seed: int) -> None:
        """A new run seed with the IQN head on: its quantile fractions' generator key is a
        launch argument of graph 1, so the engine is rebuilt for it (a rare event: loading the
        state of another run; the ``engine`` property then returns the new one). The caller
        loads the whole state afterwards."""
        self._engine.synchronize()
        for cached in self._eval_cache.values():
            cached.close()
        self._eval_cache.clear()
        self._engine.close()
        self._closed = True
        self._engine = self._make_engine(self.config, seed=seed, **self._engine_options)
        self._closed = False
        self.seed = seed

    # ------------------------------------------------------------------ diagnostics
    @property
    def engine(self):
        """The device side (``gpu_engine.GpuEngine``, or the CPU executor's ``CpuEngine``): the
        device collector builds its graphs on its arena, program, stream and pool."""
        return self._engine

    @property
    def layout(self):
        """The step's buffers (``foxhunt.fast.step_layout.StepLayout``)."""
        return self._engine.layout

    @property
    def stream(self):
        """The stream graphs 1 and 2 run on (``None`` on the CPU executor): the benches time
        steps with CUDA events recorded on it."""
        return getattr(self._engine, "stream", None)

    @property
    def program(self):
        """The plan builder (``foxhunt.fast.step_program.StepProgram``)."""
        return self._engine.program

    @property
    def plans(self) -> dict:
        """The step's records: ``{"upload": [Ops per staging slot], "graph1": Ops, "graph2": Ops}``."""
        return self._engine.plans

    @property
    def node_count(self) -> int:
        """Nodes of the graphs replayed per step (upload + graph 1 + graph 2)."""
        return sum(self.graph_node_counts)

    @property
    def graph_node_counts(self) -> tuple[int, int, int]:
        """Nodes of the upload graph, graph 1 and graph 2 (on the GPU, graphs 1 and 2 are the two
        parts of one step graph; graph 1's count includes its ``graph1_done`` record node, the
        upload graph's its ``uploaded[slot]`` record node)."""
        return self._engine.graph_node_counts

    @property
    def planned_launches(self) -> tuple[int, int, int]:
        """Kernel, GEMM and copy records per step as planned (upload, graph 1, graph 2)."""
        return self._engine.planned_launches

    def debug_buffer(self, name: str) -> np.ndarray:
        """A copy of buffer ``name`` of the step layout (e.g. ``grad_c51``, ``td``,
        ``target_q [n_branches, B]``; a view such as ``grad_c51``, a block of ``grad_losses``,
        as its own shape), for tests and debugging; synchronises."""
        base, offset, shape, dtype = self._engine.layout.locate(name)
        whole = self._engine.arena.download(base)
        if base == name:
            return whole
        nbytes = int(np.prod(shape)) * dtype.itemsize
        return whole.reshape(-1).view(np.uint8)[offset:offset + nbytes].view(dtype).reshape(shape).copy()

    @property
    def gemm_fallbacks(self) -> tuple[str, ...]:
        """GEMM epilogues the planner refused (done as plain GEMM + kernels)."""
        return tuple(self._engine.program.fallbacks)

    # ------------------------------------------------------------------ the step
    def step(self, batch: Batch) -> StepScalars:
        check_step_batch(self.config, self.layout, batch)
        slot = self.step_count % STAGING_RING
        write_batch(self.config, batch, self._engine.staging(slot))
        self._engine.launch(slot)
        self.step_count += 1
        return self._readback.after_step(self.step_count, self._read_scalars)

    def step_enqueued(self) -> StepScalars:
        """The host side of one step whose graphs the caller enqueued itself, its batch already
        in the arena's ``batch`` (``foxhunt.fast.collector``: the cycle graph gathers it on the
        device): the step count and the deferred readback, exactly as ``step``."""
        self.step_count += 1
        return self._readback.after_step(self.step_count, self._read_scalars)

    def _read_scalars(self) -> StepScalars:
        """Synchronise and read the last step's scalars and flags (a fresh ``StepScalars``)."""
        values, flags = self._engine.read()
        return StepScalars.from_readback(self.step_count, values,
                                         flags[:sentinels.NUM_SENTINEL_SLOTS])

    def end_epoch(self) -> StepScalars:
        return self._readback.end_epoch(self.step_count, self._read_scalars)

    # ------------------------------------------------------------------ folds and evaluation
    def fold_boundary(self) -> None:
        """Mech 3 hard target sync (params and their BF16 mirror copied to the target's), Mech
        4 Adam reset, ISV fold reset, sentinel flags reset (the Mech 6 slow EMA is a CrossFold
        ISV slot: kept)."""
        arena = self._engine.arena
        self._engine.synchronize()
        for name in ("params2", "mirror2"):
            both = arena.download(name)
            both[1] = both[0]
            arena.upload(name, both)
        for name in ("adam_m", "adam_v", "adam_t", "flags"):
            arena.upload(name, np.zeros(arena.spec(name).shape, arena.spec(name).dtype))
        bus = isv_mod.bus_for(self.config)
        bus.from_array(arena.download("isv"))
        bus.fold_reset()
        arena.upload("isv", bus.to_array())

    def set_epoch(self, epoch: int) -> None:
        """ISV ``EPOCH_IDX`` on the device (an epoch start is a synchronisation point anyway)."""
        epoch = check_epoch(epoch)
        arena = self._engine.arena
        self._engine.synchronize()
        isv = arena.download("isv")
        isv[isv_mod.EPOCH_IDX_INDEX] = np.float32(epoch)
        arena.upload("isv", isv)

    def set_loop_signals(self, *, total_epochs: int | None = None,
                         sharpe_ema: float | None = None, epsilon=None) -> None:
        """ISV ``TOTAL_EPOCHS`` / ``SHARPE_EMA`` / ``EPSILON_EFF`` and the ``eps_schedule``
        buffer on the device (reference ``Trainer``'s contract; the loop calls it at epoch
        boundaries, synchronisation points anyway)."""
        pair = None if epsilon is None else eps_schedule(epsilon)
        arena = self._engine.arena
        self._engine.synchronize()
        isv = arena.download("isv")
        if pair is not None:
            isv[isv_mod.EPSILON_EFF_INDEX] = pair[0]
            if "eps_schedule" in self.layout:  # adaptive_epsilon_tau's producer reads it
                arena.upload("eps_schedule", pair)
        if total_epochs is not None:
            isv[isv_mod.TOTAL_EPOCHS_INDEX] = np.float32(check_epoch(total_epochs))
        if sharpe_ema is not None:
            isv[isv_mod.SHARPE_EMA_INDEX] = np.float32(sharpe_ema)
        arena.upload("isv", isv)

    def isv_value(self, name: str) -> float:
        """The current value of ISV slot ``name`` (synchronises)."""
        self._engine.synchronize()
        return float(self._engine.arena.download("isv")[isv_mod.slot(name).index])

    def last_td_errors(self) -> np.ndarray:
        if not self._readback.stepped:
            raise RuntimeError("last_td_errors(): no step has run yet")
        return self._engine.arena.download("td")

    def q_values(self, states: np.ndarray) -> list[np.ndarray]:
        """Expected Q of every branch for ``states`` ``[N, state_dim]`` under the online params
        (``list`` of ``[N, n_d]`` float32 arrays, fresh copies); synchronises.

        Per row count ``N``, the first call builds one evaluation graph (``eval_plan``: copy
        in, the greedy forward on its own small arena, copy out); every call is a host copy
        into its input, one graph replay after every step enqueued before it, and one
        synchronisation. At most ``EVAL_CACHE_SIZE`` graphs are kept (least recently used
        evicted)."""
        states = np.asarray(states)
        SD = self.config.state_dim
        if states.ndim != 2 or states.shape[1] != SD or states.shape[0] < 1:
            raise ValueError(f"states: shape {states.shape}; expected [N, {SD}] with N >= 1")
        rows = states.shape[0]
        cached = self._eval_cache.pop(rows, None)
        if cached is None:
            if len(self._eval_cache) >= EVAL_CACHE_SIZE:  # evict the least recently used
                self._eval_cache.pop(next(iter(self._eval_cache))).close()
            cached = self._engine.build_eval(rows)
        self._eval_cache[rows] = cached  # most recently used last
        return cached.run(states)

    # ------------------------------------------------------------------ state exchange
    @property
    def flags(self) -> np.ndarray:
        """A copy of the sentinel flags (int32 ``[NUM_SENTINEL_SLOTS]``); synchronises."""
        return self._engine.arena.download("flags")[:sentinels.NUM_SENTINEL_SLOTS].copy()

    def state_dict(self) -> dict[str, np.ndarray]:
        lay, arena = self.layout, self._engine.arena
        params2 = arena.download("params2")
        state = {
            "params": params2[0].copy(), "target": params2[1].copy(),
            "adam_m": arena.download("adam_m"), "adam_v": arena.download("adam_v"),
            "adam_t": arena.download("adam_t").astype(np.int64),
            "isv": arena.download("isv"),
            "flags": arena.download("flags")[:sentinels.NUM_SENTINEL_SLOTS].copy(),
            "step": np.array([self.step_count], np.int64),
        }
        if self.config.iqn_on:  # the device step counter (the quantile fractions' offset)
            state["step"] = arena.download("step_count").astype(np.int64)
            state["seed"] = np.array([self.seed], np.int64)
        sn_u, sn_v = arena.download("sn_u"), arena.download("sn_v")
        pu, pv = lay.packed["sn_u"], lay.packed["sn_v"]
        for t in lay.weights:
            state[f"sn_u.{t.name}"] = sn_u[pu.offsets[t.name]:pu.offsets[t.name] + t.shape[0]].copy()
            state[f"sn_v.{t.name}"] = sn_v[pv.offsets[t.name]:pv.offsets[t.name] + t.shape[1]].copy()
        return state

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        validate_state_dict(self.config, state)  # everything checked before anything is loaded
        if self.config.iqn_on and int(state["seed"][0]) != self.seed:
            self._reseed(int(state["seed"][0]))
        lay, arena = self.layout, self._engine.arena
        self._engine.synchronize()
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
        if self.config.iqn_on:
            arena.upload("step_count", np.ascontiguousarray(state["step"], np.int64))
        self.step_count = int(state["step"][0])
        self._readback.reset()
        self._engine.forget_uploads()

    def close(self) -> None:
        """Release the graphs, GEMM plans, events and device memory (unusable afterwards)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._engine.synchronize()
        finally:
            for cached in self._eval_cache.values():
                cached.close()
            self._engine.close()


__all__ = ["EVAL_CACHE_SIZE", "STAGING_RING", "Trainer", "check_step_batch", "write_batch"]
