"""pytest configuration of the benchmarks (pytest-benchmark): fast vs reference vs PyTorch.

Every benchmark sets ``benchmark.group`` to its workload (``step-seed-bf16``, ``epoch-seed-f32``,
``kernel-adam_update``, ``gemm-256x256x256-bf16``, ``scaling-batch-1024``...), so one run prints
the side-by-side table, and ``extra_info`` to what ``benches/report.py`` needs: ``impl``
(``fast``, ``reference``, ``torch-<mode>``, ``torch-eager-cpu``), ``precision``, ``device``,
shapes, the GPU event time per unit (``gpu_us``), graph node counts and achieved GEMM TFLOP/s.

Modes:

- quick (default, what CI runs with plain ``python -m pytest -q``): CPU cases take 3 rounds;
  the reference and PyTorch-CPU ``seed`` epochs (300 steps, about 10 s each) are skipped with a
  reason. The whole of ``benches/`` takes well under a minute on 2 CPU cores.
- ``FOXHUNT_BENCH_FULL=1``: more rounds and every case.

GPU cases skip with a reason when there is no GPU: PyTorch cases when
``torch.cuda.is_available()`` is False, fast cases when ``foxhunt.fast.cuda_available()`` says
no, or when ``foxhunt.fast.Trainer`` cannot be imported yet.

Timing rules: the fast step and the PyTorch CUDA step are asynchronous, so a round runs N steps
and then synchronises, and pytest-benchmark reports the round's time divided by N (per step).
The GPU event time (``gpu_us``) is measured separately with CUDA events on the stream the work
runs on. Trainers are built, compiled, captured and warmed up once per session, outside timing,
and shared by the step, epoch and scaling benchmarks.

Isolation: PyTorch's CUDA peers leave the process slower for every later CUDA launch, whoever
makes it. Measured on the H200 with the fast bf16 step (one process, in order): alone, 22 us of
host enqueue and 144 us of GPU time per step (epoch 44.2 ms); after the ``graph`` and
``compile-graph`` peers were built, 32 us and 150 us (46.0 ms); after one ``torch.profiler``
trace of a peer (CUPTI stays attached), 60 us and 152 us (46.9 ms). So the PyTorch CUDA cases
run last (``pytest_collection_modifyitems``: the items using ``torch_cuda`` after all others,
each part in collection order), and the profiler count of a peer's device operations
(``device_ops_per_step``) is opt-in (``FOXHUNT_BENCH_OPCOUNT=1``; a run with it is not a
timing run: every peer timed after the first count is slowed by it).
"""

from __future__ import annotations

import importlib.metadata
import itertools
import math
import os
import platform
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pytest

from foxhunt.fast.device import driver_event_time
from foxhunt.reference.batch import Batch
from foxhunt.reference.config import CORE_STEP, DQNConfig
from foxhunt.reference.loop import LoopSettings

FULL = os.environ.get("FOXHUNT_BENCH_FULL") == "1"
FULL_REASON = "too long for the quick run: set FOXHUNT_BENCH_FULL=1 to run it"
#: Count each CUDA peer's device operations per step with torch.profiler (module docstring).
OPCOUNT = os.environ.get("FOXHUNT_BENCH_OPCOUNT") == "1"

#: Training steps in one epoch (the seeds' epoch, SPEC 10).
EPOCH_STEPS = LoopSettings().steps_per_epoch

#: Distinct random batches each trainer cycles through.
BATCH_POOL = 8
BATCH_SEED = 20240229

#: Timing budgets (seconds of measured time per benchmark) and the target length of one round
#: of an asynchronous (GPU) benchmark: long enough that the final synchronisation is noise.
GPU_BUDGET_S = 8.0 if FULL else 2.0
CPU_BUDGET_S = 5.0 if FULL else 0.0
GPU_ROUND_S = 0.02
QUICK_CPU_ROUNDS = 3
MAX_STEPS_PER_ROUND = 200
EPOCH_BUDGET_S = 30.0 if FULL else 10.0


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (skipped with a reason otherwise)")
    config.addinivalue_line("markers", "slow: long-running (long-run parity, full epochs)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The PyTorch CUDA cases last, so nothing else is timed after a CUDA peer exists (module
    docstring: Isolation); otherwise collection order (the sort is stable)."""
    items.sort(key=lambda item: "torch_cuda" in getattr(item, "fixturenames", ()))


# ------------------------------------------------------------------------------ availability
def torch_cuda_reason() -> str | None:
    """None when PyTorch can use a CUDA device, else why not."""
    try:
        import torch
    except ImportError as exc:
        return f"PyTorch is not installed ({exc})"
    if not torch.cuda.is_available():
        return (f"no CUDA device for PyTorch: torch.cuda.is_available() is False "
                f"(torch {torch.__version__}, CUDA build {torch.version.cuda})")
    return None


def fast_cuda_reason() -> str | None:
    """None when the fast path can use a CUDA device, else why not."""
    try:
        from foxhunt.fast import cuda_available
    except Exception as exc:  # noqa: BLE001 - any import failure means no fast path here
        return f"foxhunt.fast does not import: {type(exc).__name__}: {exc}"
    ok, reason = cuda_available()
    return None if ok else f"no CUDA device for the fast path: {reason}"


@pytest.fixture(scope="session")
def torch_cuda():
    """``torch.device("cuda")``; skips the benchmark when PyTorch has no CUDA device."""
    reason = torch_cuda_reason()
    if reason:
        pytest.skip(reason)
    import torch

    return torch.device("cuda")


@pytest.fixture(scope="session")
def fast_cuda() -> None:
    """Skips the benchmark when the fast path has no CUDA device."""
    reason = fast_cuda_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def fast_trainer_cls(fast_cuda):
    """``foxhunt.fast.Trainer``; skips when it cannot be imported (yet)."""
    try:
        from foxhunt.fast import Trainer
    except Exception as exc:  # noqa: BLE001 - not written yet, or broken: skip with the reason
        pytest.skip(f"foxhunt.fast.Trainer cannot be imported: {type(exc).__name__}: {exc}")
    return Trainer


# ------------------------------------------------------------------------------ workloads
def shapes(config: DQNConfig) -> dict:
    """The network's sizes, for ``extra_info``."""
    c = config
    return {"batch": c.batch_size, "state_dim": c.state_dim, "trunk": [c.shared_h1, c.shared_h2],
            "heads": [c.value_h, c.adv_h], "atoms": c.num_atoms, "branches": list(c.branches)}


_BATCHES: dict[DQNConfig, list[Batch]] = {}


def batch_pool(config: DQNConfig) -> list[Batch]:
    """``BATCH_POOL`` random batches for ``config`` (seeded; the same for every implementation)."""
    key = config.replace(precision="f32")
    if key not in _BATCHES:
        rng = np.random.default_rng(BATCH_SEED)
        _BATCHES[key] = [Batch.random(config, rng) for _ in range(BATCH_POOL)]
    return _BATCHES[key]


# ------------------------------------------------------------------------------ runners
@dataclass
class Runner:
    """One implementation of the training step, behind one interface for the benchmarks.

    ``step(batch)`` may be asynchronous; ``sync()`` waits for all its work; ``end_epoch()`` ends an
    epoch as the training loop does (the fast trainer's fresh readback, the peer's scalar read).
    ``event_time(run, n)`` gives the GPU time per call of ``run`` over ``n`` calls, measured with
    CUDA events on the implementation's stream (None on the CPU)."""

    impl: str
    config: DQNConfig
    device: str
    step: Callable[[Batch], Any]
    sync: Callable[[], None]
    end_epoch: Callable[[], Any]
    event_time: Callable[[Callable[[], Any], int], float] | None = None
    info: dict = field(default_factory=dict)

    @property
    def on_gpu(self) -> bool:
        return self.device != "cpu"


def _torch_event_time(run: Callable[[], Any], n: int) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / n


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return repr(value)


#: Attribute names under which the fast trainer may report its graphs' node counts.
FAST_NODE_ATTRS = ("graph_node_counts", "node_counts", "graph_node_count", "node_count", "graph_nodes")


def fast_graph_nodes(trainer) -> Any:
    for attr in FAST_NODE_ATTRS:
        value = getattr(trainer, attr, None)
        if value is None:
            continue
        try:
            value = value() if callable(value) else value
        except Exception:  # noqa: BLE001 - a count is a nicety
            continue
        return _jsonable(value)
    return None


def _fast_sync(trainer) -> Callable[[], None]:
    if callable(getattr(trainer, "synchronize", None)):
        return trainer.synchronize
    device = getattr(trainer, "device", None)
    if callable(getattr(device, "synchronize", None)):
        return device.synchronize

    def ctx_sync() -> None:  # the fast path uses the primary context, current on this thread
        from cuda.bindings import driver as drv

        from foxhunt.fast.device import call

        call(drv.cuCtxSynchronize)

    return ctx_sync


def _fast_stream(trainer):
    stream = getattr(trainer, "stream", None)
    if stream is None:
        stream = getattr(getattr(trainer, "device", None), "stream", None)
    return stream


def _warm(runner: Runner, steps: int = 2) -> Runner:
    for batch in batch_pool(runner.config)[:steps]:
        runner.step(batch)
    runner.sync()
    return runner


def make_reference(config: DQNConfig) -> Runner:
    from foxhunt.reference.trainer import Trainer

    trainer = Trainer(config, seed=0)
    return _warm(Runner("reference", config, "cpu", trainer.step, lambda: None, trainer.end_epoch))


def make_fast(trainer_cls, config: DQNConfig, impl: str = "fast", **options) -> Runner:
    """The fast trainer of ``config`` (``options``: its keyword options) as runner ``impl``."""
    trainer = trainer_cls(config, seed=0, **options)
    stream = _fast_stream(trainer)
    event_time = (lambda run, n: driver_event_time(stream, run, n)) if stream is not None else None
    runner = Runner(impl, config, "cuda", trainer.step, _fast_sync(trainer), trainer.end_epoch,
                    event_time)
    _warm(runner)
    runner.info["graph_nodes"] = fast_graph_nodes(trainer)
    planned = getattr(trainer, "planned_launches", None)
    if planned is not None:
        runner.info["planned_launches"] = _jsonable(planned)
    return runner


def make_peer(config: DQNConfig, mode: str, device: str) -> Runner:
    """A PyTorch peer; a compile mode that cannot compile here (no Triton, no compiler) skips
    with the error as the reason."""
    from peers.torch_step import COMPILED_MODES, TorchStep

    peer = TorchStep(config, mode=mode, device=device)
    last: dict = {}

    def step(batch: Batch) -> None:
        last["out"] = peer.step(batch)

    impl = f"torch-{mode}" + ("-cpu" if device == "cpu" else "")
    runner = Runner(impl, config, device, step, peer.synchronize,
                    lambda: peer.read_scalars(last["out"]),
                    _torch_event_time if device != "cpu" else None)
    try:
        _warm(runner, steps=3)
    except Exception as exc:
        if mode in COMPILED_MODES:
            pytest.skip(f"torch.compile failed on this machine: {type(exc).__name__}: {exc}")
        raise
    runner.info["graph_nodes"] = peer.graph_nodes
    if device != "cpu" and OPCOUNT:
        runner.info["device_ops_per_step"] = _device_ops_per_step(runner)
    return runner


def _device_ops_per_step(runner: Runner) -> int | None:
    """Kernels, copies and memsets one step puts on the GPU (torch.profiler; None if it fails)."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile

        batch = batch_pool(runner.config)[0]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.step(batch)
            runner.sync()
        count = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        return count or None  # 0: the profiler saw no device activity (no CUPTI), not "no work"
    except Exception:  # noqa: BLE001 - a count is a nicety
        return None


# ------------------------------------------------------------------------------ timing
def _estimate_step(runner: Runner, batches: list[Batch]) -> float:
    n = 5 if runner.on_gpu else 1
    runner.sync()
    t0 = time.perf_counter()
    for i in range(n):
        runner.step(batches[i % len(batches)])
    runner.sync()
    return (time.perf_counter() - t0) / n


def _plan(est_s: float, on_gpu: bool, budget_s: float) -> tuple[int, int]:
    """``(steps_per_round, rounds)`` for a step that takes about ``est_s`` seconds."""
    if on_gpu:
        per_round = max(1, min(MAX_STEPS_PER_ROUND, math.ceil(GPU_ROUND_S / max(est_s, 1e-7))))
        rounds = max(5, min(200, int(budget_s / (per_round * est_s))))
        return per_round, rounds
    if budget_s <= 0:
        return 1, QUICK_CPU_ROUNDS
    return 1, max(QUICK_CPU_ROUNDS, min(50, int(budget_s / est_s)))


def _median_s(benchmark) -> float | None:
    stats = getattr(getattr(benchmark, "stats", None), "stats", None)
    return getattr(stats, "median", None)


def bench_steps(benchmark, runner: Runner, *, group: str, budget_s: float | None = None,
                **extra: Any) -> None:
    """Time ``runner``'s step (per step; N steps then a sync per round) under ``group``."""
    from peers.torch_step import step_gemm_flops

    config = runner.config
    batches = batch_pool(config)
    est = _estimate_step(runner, batches)
    budget = budget_s if budget_s is not None else (GPU_BUDGET_S if runner.on_gpu else CPU_BUDGET_S)
    per_round, rounds = _plan(est, runner.on_gpu, budget)
    cycle = itertools.cycle(batches)
    calls = itertools.count(1)

    def target() -> None:
        runner.step(next(cycle))
        if next(calls) % per_round == 0:  # the last step of a round waits for the GPU
            runner.sync()

    benchmark.group = group
    runner.sync()
    benchmark.pedantic(target, rounds=rounds, iterations=per_round, warmup_rounds=1)
    runner.sync()

    flops = step_gemm_flops(config)
    info = {"impl": runner.impl, "precision": config.precision, "device": runner.device,
            "unit": "step", "shapes": shapes(config), "steps_per_round": per_round,
            "gemm_gflop_per_step": flops / 1e9, **runner.info, **extra}
    seconds = _median_s(benchmark) or est
    if runner.event_time is not None:
        gpu_s = runner.event_time(lambda: runner.step(next(cycle)), max(per_round, 20))
        info["gpu_us"] = gpu_s * 1e6
        seconds = gpu_s
    info["gemm_tflops"] = flops / seconds / 1e12
    benchmark.extra_info.update(_jsonable(info))


def bench_epoch(benchmark, runner: Runner, *, group: str, **extra: Any) -> None:
    """Time one epoch (``EPOCH_STEPS`` steps, then ``end_epoch()``, which synchronises)."""
    config = runner.config
    batches = batch_pool(config)
    est = _estimate_step(runner, batches) * EPOCH_STEPS
    rounds = 1 if not runner.on_gpu and not FULL else max(1, min(5, int(EPOCH_BUDGET_S / est)))
    cycle = itertools.cycle(batches)

    def epoch() -> None:
        for _ in range(EPOCH_STEPS):
            runner.step(next(cycle))
        runner.end_epoch()

    benchmark.group = group
    runner.sync()
    benchmark.pedantic(epoch, rounds=rounds, iterations=1, warmup_rounds=0)
    info = {"impl": runner.impl, "precision": config.precision, "device": runner.device,
            "unit": "epoch", "steps": EPOCH_STEPS, "shapes": shapes(config), **runner.info, **extra}
    if runner.event_time is not None and FULL:
        info["gpu_us"] = runner.event_time(epoch, 1) * 1e6
    benchmark.extra_info.update(_jsonable(info))


# ------------------------------------------------------------------------------ harness
class Harness:
    """What the benchmark modules use (through the ``harness`` fixture; a bench module never
    imports this conftest): configs, batches, runners cached for the session, and the timing
    functions ``steps`` and ``epoch``."""

    full = FULL
    full_reason = FULL_REASON
    epoch_steps = EPOCH_STEPS
    #: Rounds of a CPU call benchmark (a kernel) and of a GPU one (launch + sync, ~20 us).
    cpu_rounds = 30 if FULL else QUICK_CPU_ROUNDS
    gpu_rounds = 1000 if FULL else 200

    def __init__(self) -> None:
        self._cache: dict[tuple, Runner | BaseException] = {}

    @staticmethod
    def config(preset: str, precision: str, **overrides: Any) -> DQNConfig:
        """The preset's sizes with every second-wave source off (the core step), then
        ``overrides`` (e.g. ``config.source_overrides(...)``'s sources)."""
        return DQNConfig.preset(preset, precision=precision, **{**CORE_STEP, **overrides})

    def _get(self, key: tuple, build: Callable[[], Runner]) -> Runner:
        """The cached runner; a build that skipped (a compile mode that cannot compile here)
        skips again without retrying."""
        if key not in self._cache:
            try:
                self._cache[key] = build()
            except pytest.skip.Exception as exc:
                self._cache[key] = exc
                raise
        value = self._cache[key]
        if isinstance(value, BaseException):
            pytest.skip(str(value))
        return value

    def reference(self, config: DQNConfig) -> Runner:
        return self._get(("reference", config), lambda: make_reference(config))

    def fast(self, trainer_cls, config: DQNConfig, impl: str = "fast", **options) -> Runner:
        return self._get(("fast", config, impl, tuple(sorted(options.items()))),
                         lambda: make_fast(trainer_cls, config, impl, **options))

    def peer(self, config: DQNConfig, mode: str, device: str) -> Runner:
        return self._get(("torch", mode, device, config), lambda: make_peer(config, mode, device))

    @staticmethod
    def driver_event_time(stream, run: Callable[[], Any], n: int) -> float:
        return driver_event_time(stream, run, n)

    @staticmethod
    def steps(benchmark, runner: Runner, **kwargs: Any) -> None:
        bench_steps(benchmark, runner, **kwargs)

    @staticmethod
    def epoch(benchmark, runner: Runner, **kwargs: Any) -> None:
        bench_epoch(benchmark, runner, **kwargs)


@pytest.fixture(scope="session")
def harness() -> Harness:
    return Harness()


# ------------------------------------------------------------------------------ machine info
def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def pytest_benchmark_update_machine_info(config, machine_info: dict) -> None:
    """Add the GPU, the driver and the library versions (the README table quotes them)."""
    info: dict[str, Any] = {"python": platform.python_version(), "full_mode": FULL,
                            "cpu_count": os.cpu_count()}
    for dist in ("foxhunt", "numpy", "torch", "cuda-bindings", "nvmath-python", "pytest-benchmark"):
        info[dist] = _version(dist)
    reason = fast_cuda_reason()
    info["fast_cuda"] = reason or "available"
    if torch_cuda_reason() is None:
        import torch

        info["gpu"] = torch.cuda.get_device_name(0)
        info["torch_cuda"] = torch.version.cuda
    if reason is None:
        from foxhunt.fast import cuda_available

        info["driver"] = cuda_available()[1]
    machine_info["foxhunt"] = info
