"""Kernel benchmarks: every kernel of the conformance registry, and the step's GEMM shapes.

Kernels (group ``kernel-<name>``, one call per round, the ``seed`` shape case of
``foxhunt.conformance.registry``): the reference function on the CPU, and the fast kernel on
the GPU. The fast test entry copies its inputs to the device, launches and copies back; the
benchmark times only the launches: it runs the entry once while recording its launches (and
keeping the device buffers it allocated), then replays those launches on the same buffers.
The timed target is "launch, then synchronise the stream" (the host-visible latency of one
call); ``extra_info["gpu_us"]`` is the device time of one call, from CUDA events around a CUDA
graph of ``GRAPH_REPEATS`` calls (launch overhead excluded).

GEMMs (group ``gemm-<m>x<n>x<k>-<precision>``): a planned cuBLASLt GEMM of the fast path
(``foxhunt.fast.GemmPlan``), ``torch.mm`` on the GPU (f32: ``matmul precision "highest"``;
tf32: ``"high"``; bf16: BF16 tensors, so a BF16 result where the fast plan writes f32), and the
reference's emulated GEMM on the CPU for the step-sized shapes. ``extra_info`` has the device
time per GEMM and the achieved TFLOP/s.

The fused trunk forward (group ``trunk-forward-<rows>``, rows 256 and 512, seed widths):
``trunk_forward_bf16`` against the four nodes it replaces (two cuBLASLt RELU_AUX_BIAS GEMMs,
``f32_to_bf16``, ``clamp_finite_isv``), each as launches and as a CUDA graph (``gpu_us``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import pytest

from foxhunt.conformance.registry import SPECS
from foxhunt.reference.kernels import dense

#: The shape case every kernel is timed on (falls back to the kernel's first case).
CASE = "seed"
#: Calls captured in the CUDA graph whose replay measures a call's device time.
GRAPH_REPEATS = 100
INPUT_SEED = 0

#: (m, n, k): one 256^3 GEMM (SPEC 11's anchor), the stacked online forward of the first layer
#: ([2B, SD] x [SD, SH1]), and a large square GEMM for the GPU's peak rate.
GEMM_SHAPES = ((256, 256, 256), (512, 256, 128), (4096, 4096, 4096))
GEMM_PRECISIONS = ("f32", "tf32", "bf16")
#: The reference's emulated GEMM is timed only up to this many multiply-adds.
REFERENCE_GEMM_MAX_MACS = 1 << 26


def _case(spec) -> str:
    return CASE if CASE in spec.shape_cases else spec.shape_cases[0]


def _describe(value):
    """Shapes (not values) of a kernel's arguments, for ``extra_info``."""
    if isinstance(value, np.ndarray):
        return {"shape": list(value.shape), "dtype": str(value.dtype)}
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    if isinstance(value, (bool, int, float, np.number)):
        return float(value) if isinstance(value, (float, np.floating)) else int(value)
    return type(value).__name__


def _sample(name: str) -> tuple[str, dict]:
    spec = SPECS[name]
    case = _case(spec)
    return case, spec.sample_inputs(case, np.random.default_rng(INPUT_SEED))


# ---------------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("name", list(SPECS))
def test_kernel_reference(benchmark, harness, name):
    case, kwargs = _sample(name)
    benchmark.group = f"kernel-{name}"
    benchmark.extra_info.update(impl="reference", device="cpu", precision="f32", unit="call",
                                case=case, inputs={k: _describe(v) for k, v in kwargs.items()})
    benchmark.pedantic(SPECS[name].ref, kwargs=kwargs, rounds=harness.cpu_rounds, warmup_rounds=1)


@dataclass
class RecordedLaunches:
    """The launches a fast test entry made, replayable on the device buffers it allocated
    (kept alive here until ``free()``)."""

    stream: object
    launches: list = field(default_factory=list)
    allocations: list = field(default_factory=list)

    def replay(self) -> None:
        for kernel, grid, block, packed, shared_mem in self.launches:
            kernel.launch(grid, block, packed, stream=self.stream, shared_mem=shared_mem)

    def free(self) -> None:
        from foxhunt.fast.device import DeviceAllocation

        for allocation in self.allocations:
            DeviceAllocation.free(allocation)  # the class's free: the instance's is a no-op
        self.allocations.clear()


@contextlib.contextmanager
def record_launches(rt):
    """While active, every ``Kernel.launch`` is recorded (arguments packed once) and every
    allocation of ``rt.device`` outlives the entry's own ``free()``."""
    from foxhunt.fast.device import Kernel, PackedArgs

    record = RecordedLaunches(rt.stream)
    original_launch = Kernel.launch
    original_alloc = rt.device.alloc

    def launch(self, grid, block, *args, stream=None, shared_mem=0):
        packed = args[0] if len(args) == 1 and isinstance(args[0], PackedArgs) else self.pack(*args)
        record.launches.append((self, grid, block, packed, shared_mem))
        return original_launch(self, grid, block, packed, stream=stream, shared_mem=shared_mem)

    def alloc(nbytes):
        allocation = original_alloc(nbytes)
        allocation.free = lambda: None
        record.allocations.append(allocation)
        return allocation

    Kernel.launch = launch
    rt.device.alloc = alloc
    try:
        yield record
    except BaseException:
        record.free()
        raise
    finally:
        Kernel.launch = original_launch
        del rt.device.alloc


def graph_time(harness, stream, run, repeats: int = GRAPH_REPEATS) -> tuple[float, int]:
    """``(seconds per call, graph nodes)``: ``run`` captured ``repeats`` times in a CUDA graph,
    replayed between CUDA events."""
    from foxhunt.fast.graphs import GraphCapture

    graph = GraphCapture(stream)
    try:
        with graph:
            for _ in range(repeats):
                run()
        graph.replay()
        return harness.driver_event_time(stream, graph.replay, 3) / repeats, graph.node_count
    finally:
        graph.close()


def time_on_stream(benchmark, harness, stream, run, group: str) -> tuple[float, int]:
    """Time ``run`` (launches on ``stream``) two ways: pytest-benchmark rounds of ``run`` plus
    a synchronisation, in ``group``; then ``graph_time`` (seconds per call in a CUDA graph, and
    its node count)."""
    def target() -> None:
        run()
        stream.synchronize()

    benchmark.group = group
    benchmark.pedantic(target, rounds=harness.gpu_rounds, warmup_rounds=3)
    return graph_time(harness, stream, run)


@pytest.fixture(scope="module")
def fast_runtime(fast_cuda):
    from foxhunt.fast.kernels._runtime import runtime

    return runtime()


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(SPECS))
def test_kernel_fast(benchmark, harness, fast_runtime, name):
    spec = SPECS[name]
    if spec.fast is None:
        pytest.skip(f"{name}: foxhunt.fast.kernels has no test entry for it")
    rt = fast_runtime
    case, kwargs = _sample(name)
    with record_launches(rt) as record:
        spec.fast(**kwargs)
    try:
        if not record.launches:
            pytest.fail(f"{name}: the fast test entry launched no kernel")

        seconds, nodes = time_on_stream(benchmark, harness, rt.stream, record.replay,
                                        f"kernel-{name}")
        benchmark.extra_info.update(
            impl="fast", device="cuda", precision="f32", unit="call", case=case,
            inputs={k: _describe(v) for k, v in kwargs.items()},
            launches=[kernel.name for kernel, *_ in record.launches],
            gpu_us=seconds * 1e6, graph_nodes=nodes // GRAPH_REPEATS)
    finally:
        record.free()


# ---------------------------------------------------------------------------------- GEMMs
def _gemm_inputs(m: int, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(INPUT_SEED)
    return (rng.standard_normal((m, k)).astype(np.float32),
            rng.standard_normal((k, n)).astype(np.float32))


def _gemm_info(m, n, k, precision, impl, device, seconds=None, **extra) -> dict:
    info = {"impl": impl, "device": device, "precision": precision, "unit": "gemm",
            "shapes": {"m": m, "n": n, "k": k}, "gflop": 2 * m * n * k / 1e9, **extra}
    if seconds is not None:
        info["gpu_us"] = seconds * 1e6
        info["gemm_tflops"] = 2 * m * n * k / seconds / 1e12
    return info


GEMM_CASES = [(shape, precision) for shape in GEMM_SHAPES for precision in GEMM_PRECISIONS]
GEMM_IDS = [f"{m}x{n}x{k}-{p}" for (m, n, k), p in GEMM_CASES]


@pytest.mark.parametrize("shape,precision", GEMM_CASES, ids=GEMM_IDS)
def test_gemm_reference(benchmark, harness, shape, precision):
    m, n, k = shape
    if m * n * k > REFERENCE_GEMM_MAX_MACS:
        pytest.skip(f"the reference's emulated GEMM is timed only up to {REFERENCE_GEMM_MAX_MACS} "
                    "multiply-adds")
    a, b = _gemm_inputs(m, n, k)
    benchmark.group = f"gemm-{m}x{n}x{k}-{precision}"
    benchmark.extra_info.update(_gemm_info(m, n, k, precision, "reference", "cpu"))
    benchmark.pedantic(dense.gemm, args=(a, b), kwargs={"mode": precision},
                       rounds=harness.cpu_rounds, warmup_rounds=1)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,precision", GEMM_CASES, ids=GEMM_IDS)
def test_gemm_fast(benchmark, harness, fast_runtime, shape, precision):
    from foxhunt.fast.gemm import GemmPlan

    m, n, k = shape
    rt = fast_runtime
    dev = rt.device
    a, b = _gemm_inputs(m, n, k)
    if precision == "bf16":
        a, b = dense.f32_to_bf16(a), dense.f32_to_bf16(b)
    plan = GemmPlan(dev, m, n, k, precision=precision)
    buffers = [dev.alloc(x.nbytes) for x in (a, b)] + [dev.alloc(m * n * 4)]
    try:
        for buf, host in zip(buffers, (a, b)):
            dev.copy_to_device(buf.ptr, host)

        def run() -> None:
            plan.run(buffers[0].ptr, buffers[1].ptr, buffers[2].ptr, stream=rt.stream)

        seconds, _ = time_on_stream(benchmark, harness, rt.stream, run,
                                    f"gemm-{m}x{n}x{k}-{precision}")
        benchmark.extra_info.update(_gemm_info(m, n, k, precision, "fast", "cuda", seconds,
                                               algorithm_workspace=plan.workspace_nbytes))
    finally:
        for buf in buffers:
            buf.free()
        plan.close()


@pytest.mark.gpu
@pytest.mark.parametrize("shape,precision", GEMM_CASES, ids=GEMM_IDS)
def test_gemm_torch(benchmark, harness, torch_cuda, shape, precision):
    import torch

    m, n, k = shape
    a, b = (torch.from_numpy(x).to(torch_cuda) for x in _gemm_inputs(m, n, k))
    if precision == "bf16":
        a, b = a.bfloat16(), b.bfloat16()
    out = torch.empty((m, n), dtype=a.dtype, device=torch_cuda)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
    try:
        def run() -> None:
            torch.mm(a, b, out=out)

        def target() -> None:
            run()
            torch.cuda.synchronize()

        benchmark.group = f"gemm-{m}x{n}x{k}-{precision}"
        benchmark.pedantic(target, rounds=harness.gpu_rounds, warmup_rounds=3)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_REPEATS):
                run()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / GRAPH_REPEATS
        benchmark.extra_info.update(_gemm_info(m, n, k, precision, "torch", "cuda", seconds,
                                               output_dtype=str(out.dtype)))
    finally:
        torch.set_float32_matmul_precision(previous)


# ------------------------------------------------------------------- the fused trunk forward
#: Rows of the trunk forward benchmarks (the target pass, the stacked online pass), seed widths.
TRUNK_ROWS = (256, 512)


def _fused_trunk(rt, kw):
    """``(run, close)``: the fused kernel's launch, recorded from its test entry."""
    from foxhunt.fast.kernels.trunk import trunk_forward_bf16

    with record_launches(rt) as record:
        trunk_forward_bf16(**kw)
    return record.replay, record.free


def _chain_trunk(rt, kw):
    """``(run, close)``: the four nodes the fused kernel replaces (fast/step_program.py's
    forward): cuBLASLt RELU_AUX_BIAS GEMM, f32_to_bf16, the second GEMM, clamp_finite_isv."""
    from foxhunt.fast.arena import Arena
    from foxhunt.fast.gemm import GemmPlan
    from foxhunt.fast.kernels.dense import plan_f32_to_bf16
    from foxhunt.fast.kernels.step import plan_clamp_finite_isv

    (rows, sd), h1, h2 = kw["xb"].shape, kw["w1"].shape[0], kw["w2"].shape[0]
    dev = rt.device
    plans = [GemmPlan(dev, rows, n, k, trans_b=True, precision="bf16", epilogue="relu_aux_bias")
             for n, k in ((h1, sd), (h2, h1))]
    u16, f32 = np.uint16, np.float32
    arena = Arena.from_specs(dev, {
        "xb": ((rows, sd), u16), "w1": ((h1, sd), u16), "b1": ((h1,), f32),
        "h1": ((rows, h1), f32), "aux1": ((plans[0].spec.aux_nbytes,), np.uint8),
        "h1b": ((rows, h1), u16), "w2": ((h2, h1), u16), "b2": ((h2,), f32),
        "h2pre": ((rows, h2), f32), "aux2": ((plans[1].spec.aux_nbytes,), np.uint8),
        "h2": ((rows, h2), f32), "h2b": ((rows, h2), u16), "isv": (kw["isv"].shape, f32)})
    for name in ("xb", "w1", "b1", "w2", "b2", "isv"):
        arena.upload(name, kw[name])
    p = arena.ptr
    to_bf16 = rt.module.kernel("f32_to_bf16")
    bf16_plan = plan_f32_to_bf16(rows * h1)
    bf16_args = to_bf16.pack(p("h1"), p("h1b"), rows * h1)
    clamp = rt.module.kernel("clamp_finite_isv")
    clamp_plan = plan_clamp_finite_isv(rows * h2)
    clamp_args = clamp.pack(p("h2pre"), p("h2"), p("h2b"), rows * h2, p("isv"), kw["index"],
                            kw["mult"])

    def run() -> None:
        plans[0].run(p("xb"), p("w1"), p("h1"), bias_ptr=p("b1"), aux_ptr=p("aux1"),
                     stream=rt.stream)
        to_bf16.launch(*bf16_plan[:2], bf16_args, stream=rt.stream, shared_mem=bf16_plan[2])
        plans[1].run(p("h1b"), p("w2"), p("h2pre"), bias_ptr=p("b2"), aux_ptr=p("aux2"),
                     stream=rt.stream)
        clamp.launch(*clamp_plan[:2], clamp_args, stream=rt.stream, shared_mem=clamp_plan[2])

    def close() -> None:
        arena.close()
        for plan in plans:
            plan.close()
    return run, close


@pytest.mark.gpu
@pytest.mark.parametrize("rows", TRUNK_ROWS)
@pytest.mark.parametrize("impl", ("fused", "chain"))
def test_trunk_forward(benchmark, harness, fast_runtime, rows, impl):
    """Group ``trunk-forward-<rows>``: the fused kernel against the four-node chain it replaces,
    seed widths, BF16, with the ReLU bitmasks (the online pass)."""
    from foxhunt.conformance.specs.trunk import trunk_sample
    from foxhunt.reference.config import DQNConfig

    cfg = DQNConfig.preset("seed")
    dims = (rows, cfg.state_dim, cfg.shared_h1, cfg.shared_h2)
    kw = trunk_sample(np.random.default_rng(INPUT_SEED), *dims)
    rt = fast_runtime
    run, close = (_fused_trunk if impl == "fused" else _chain_trunk)(rt, kw)
    try:
        seconds, nodes = time_on_stream(benchmark, harness, rt.stream, run,
                                        f"trunk-forward-{rows}")
        benchmark.extra_info.update(
            impl=impl, device="cuda", precision="bf16", unit="forward",
            shapes=dict(zip(("rows", "SD", "H1", "H2"), dims)), gpu_us=seconds * 1e6,
            graph_nodes=nodes // GRAPH_REPEATS)
    finally:
        close()
