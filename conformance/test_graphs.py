"""CUDA-graph replay == eager launch, bitwise (SPEC 8/9; issue 6 part 4), the batched spectral
norm on the seed network's 10 matrices == 10 individual launches, and the ISV fingerprint bits
through device round trips and kernel launches.

- Every kernel of the registry (every area), on its ``tiny`` sample and on one extremal case
  (NaN/Inf/subnormal/-0 injected): the fast test entry runs once with ``_runtime.call``
  recorded; each recorded launch is then repeated on fresh device buffers eagerly and as a
  captured ``GraphCapture`` (capturing runs nothing; the graph is replayed twice, inputs reset
  in between), and all results must be bit-identical to the test entry's. Kernels whose
  arguments carry device pointers inside arrays (:data:`POINTER_KERNELS`) cannot be re-run on
  fresh buffers this way and have their own graph tests below; a new such kernel fails with a
  message saying so.
- The cuBLASLt GEMM plans in each precision mode (f32, tf32, bf16 with a fused bias+ReLU):
  replay == eager, bitwise.
- ``batched_spectral_norm`` over the ``seed`` preset's 10 weight matrices (half of them scaled
  above ``sigma_max``, so both paths of the bound run) in one arena, as the trainer holds them:
  one batched launch == 10 ``spectral_norm`` launches bitwise, graph replay == eager, and the
  reference within the conformance tolerance (rtol 1e-5, SPEC 8).
- ``polyak_update_mirror_check`` on an online/target pair of rows with an entry table into them
  (graph 2's last node): graph replay == eager bitwise, and the reference's flags and values.
- The layout fingerprint slots (115/116) hold u32 bit patterns; with real fingerprints and
  NaN/Inf/subnormal/-0 patterns they survive an arena upload/download (synchronous and through
  pinned memory) and every ``isv_*`` kernel launch (eager and replayed) bit for bit.

Every graph test needs a GPU (marked ``gpu``): skipped with the ``cuda_device`` fixture's reason
without one; two table self-checks run everywhere.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest

from foxhunt.conformance import registry
from foxhunt.conformance.registry import KernelSpec
from foxhunt.conformance.tolerance import compare
from foxhunt.reference import isv as isv_mod
from foxhunt.reference.config import CORE_STEP, DQNConfig
from foxhunt.reference.layout import ParamLayout, init_params
from foxhunt.reference.kernels import dense as ref_dense
from foxhunt.reference.kernels import optim as ref_optim
from foxhunt.reference.kernels import safety as ref_safety
from foxhunt.reference.kernels import spectral as ref_spectral

F32 = np.float32
SPECS = registry.SPECS

#: Kernels whose test entries pass device pointers inside an argument array (descriptors,
#: slot address tables) into memory the entry owns: they are graph-tested by their own tests.
POINTER_KERNELS = {
    "batched_spectral_norm": "test_batched_spectral_norm_on_the_seed_matrices",
    "nan_check_fused": "test_fused_nan_check_graph_replay_equals_eager",
    "polyak_update_mirror_check": "test_polyak_check_graph_replay_equals_eager",
}

#: Graph replays per captured launch (inputs reset in between): a graph is replayed every step.
REPLAYS = 2

#: Fingerprint slot contents (lo, hi) as u32 bit patterns: the real layout fingerprint, then
#: signalling / quiet / negative NaNs with payloads, infinities, a subnormal and -0.
FINGERPRINT_PATTERNS = (
    (isv_mod.LAYOUT_FINGERPRINT & 0xFFFFFFFF, isv_mod.LAYOUT_FINGERPRINT >> 32),
    (0x7F800001, 0xFFC00000),
    (0x7FC12345, 0xFFFFFFFF),
    (0x7FBFFFFF, 0xFF800001),
    (0x7F800000, 0xFF800000),
    (0x00000001, 0x80000000),
)


def _rng(*key: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32("/".join(key).encode()))


def _bits(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x)
    return x.view(f"u{x.dtype.itemsize}") if x.dtype.kind == "f" else x


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(_bits(a), _bits(b))


def _first_difference(a: np.ndarray, b: np.ndarray) -> str:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    differ = np.flatnonzero(_bits(a).ravel() != _bits(b).ravel())
    i = int(differ[0])
    return f"{len(differ)} element(s) differ, first at flat index {i}: {a.ravel()[i]!r} vs {b.ravel()[i]!r}"


def _runtime():
    from foxhunt.fast.kernels._runtime import runtime

    return runtime()


# ============================================================================ recorded launches
@dataclass
class Launch:
    """One ``_runtime.call``: the kernel, its launch shape, its arguments as they were before
    the launch (``In``/``InOut`` arrays copied), and the outputs the call returned."""

    name: str
    grid: Any
    block: Any
    args: tuple
    shared_mem: int
    outputs: tuple


class PointerPayload(AssertionError):
    pass


class Recorder:
    """Stands in for ``_runtime.call`` in the fast kernel modules; records, then delegates."""

    def __init__(self, real: Callable):
        self.real = real
        self.launches: list[Launch] = []

    def __call__(self, name, grid, block, *args, shared_mem: int = 0):
        from foxhunt.fast.kernels._runtime import In, InOut

        snapshot = []
        for arg in args:
            if isinstance(arg, (In, InOut)):
                host = np.ascontiguousarray(arg.array)
                if host.dtype.fields is not None or host.dtype == np.uint64:  # device addresses
                    raise PointerPayload(name)
                snapshot.append(type(arg)(host.copy()))
            else:
                snapshot.append(arg)
        outputs = self.real(name, grid, block, *args, shared_mem=shared_mem)
        self.launches.append(Launch(name, grid, block, tuple(snapshot), shared_mem,
                                    tuple(np.array(o, copy=True) for o in outputs)))
        return outputs


def record_launches(fn: Callable, kwargs: dict) -> list[Launch]:
    """Run a fast test entry with every kernel module's ``call`` recorded (patches undone)."""
    import importlib

    from foxhunt.fast import kernels as fast_kernels
    from foxhunt.fast.kernels import _runtime

    recorder = Recorder(_runtime.call)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_runtime, "call", recorder)
        for area in fast_kernels.AREAS:
            module = importlib.import_module(f"{fast_kernels.__name__}.{area}")
            if getattr(module, "call", None) is recorder.real:
                patch.setattr(module, "call", recorder)
        with np.errstate(all="ignore"):
            fn(**{k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in kwargs.items()})
    return recorder.launches


@dataclass
class _Buffer:
    alloc: Any
    upload: np.ndarray | None  # the recorded input (In/InOut); None for an Out buffer
    readable: bool             # InOut or Out: read back after the launch
    initial: np.ndarray        # what it holds after reset (the input, or the 0xFF poison)


class Buffers:
    """Fresh device buffers for one recorded launch: ``In``/``InOut`` hold the recorded inputs,
    ``Out`` the 0xFF poison (as the test entries do); ``reset`` restores that, ``read`` returns
    what the ``Out``/``InOut`` buffers hold."""

    def __init__(self, launch: Launch):
        from foxhunt.fast.kernels._runtime import In, InOut, Out

        rt = _runtime()
        self.device, self.stream = rt.device, rt.stream
        self.buffers: list[_Buffer] = []
        self.args: list = []
        for arg in launch.args:
            if isinstance(arg, (In, InOut)):
                buf = _Buffer(self.device.alloc(max(arg.array.nbytes, 4)), arg.array,
                              isinstance(arg, InOut), arg.array)
            elif isinstance(arg, Out):
                dtype = np.dtype(arg.dtype)
                shape = tuple(int(s) for s in np.atleast_1d(arg.shape)) if arg.shape != () else ()
                nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                poison = np.frombuffer(b"\xff" * nbytes, dtype).reshape(shape)
                buf = _Buffer(self.device.alloc(max(nbytes, 4)), None, True, poison)
            else:
                self.args.append(arg)
                continue
            self.buffers.append(buf)
            self.args.append(buf.alloc.ptr)

    def initial(self) -> tuple:
        return tuple(b.initial for b in self.buffers if b.readable)

    def reset(self) -> None:
        for b in self.buffers:
            if b.upload is None:
                self.device.memset(b.alloc.ptr, 0xFF, b.alloc.nbytes, self.stream)
            else:
                self.device.copy_to_device(b.alloc.ptr, b.upload, self.stream, wait=False)
        self.stream.synchronize()

    def read(self) -> tuple:
        return tuple(self.device.copy_to_host(np.empty(b.initial.shape, b.initial.dtype), b.alloc.ptr,
                                              self.stream)
                     for b in self.buffers if b.readable)

    def free(self) -> None:
        for b in self.buffers:
            b.alloc.free()


def replay_launch(launch: Launch) -> tuple[tuple, list[tuple], tuple, tuple]:
    """``(eager, replays, after_capture, initial)``: the launch run eagerly on fresh buffers, then
    captured (``after_capture``: the buffers right after capturing, which must still hold
    ``initial``) and replayed ``REPLAYS`` times with the inputs reset before each replay."""
    from foxhunt.fast.graphs import GraphCapture

    rt = _runtime()
    kernel = rt.module.kernel(launch.name)
    bufs = Buffers(launch)
    try:
        bufs.reset()
        kernel.launch(launch.grid, launch.block, *bufs.args, stream=rt.stream, shared_mem=launch.shared_mem)
        eager = bufs.read()
        bufs.reset()
        graph = GraphCapture(rt.stream)
        try:
            with graph:
                kernel.launch(launch.grid, launch.block, *bufs.args, stream=rt.stream,
                              shared_mem=launch.shared_mem)
            assert graph.node_types().get("KERNEL", 0) == 1, dict(graph.node_types())
            after_capture = bufs.read()
            replays = []
            for _ in range(REPLAYS):
                bufs.reset()
                graph.replay()
                rt.stream.synchronize()
                replays.append(bufs.read())
        finally:
            graph.close()
        initial = bufs.initial()
    finally:
        bufs.free()
    return eager, replays, after_capture, initial


def check_graph_equals_eager(launches: list[Launch]) -> list[str]:
    """Problems (empty when every launch replays bit-identically to its eager runs)."""
    problems = []
    for k, launch in enumerate(launches):
        eager, replays, after_capture, initial = replay_launch(launch)
        where = f"launch {k} ({launch.name})"
        for i, (want, got) in enumerate(zip(launch.outputs, eager)):
            if not _same_bits(got, want):
                problems.append(f"{where} output {i}: eager on fresh buffers != the test entry's "
                                f"result ({_first_difference(got, want)}): not deterministic")
        for r, replay in enumerate(replays):
            for i, (want, got) in enumerate(zip(eager, replay)):
                if not _same_bits(got, want):
                    problems.append(f"{where} output {i}: graph replay {r} != eager "
                                    f"({_first_difference(got, want)})")
        changed = [i for i, (a, b) in enumerate(zip(after_capture, initial)) if not _same_bits(a, b)]
        if changed:
            problems.append(f"{where}: output buffer(s) {changed} changed during capture (the launch "
                            "ran instead of being recorded)")
    return problems


# ============================================================================ every kernel
def _graph_cases() -> list:
    cases = []
    for name, spec in SPECS.items():
        if name in POINTER_KERNELS:
            continue
        cases.append(pytest.param(spec, spec.shape_cases[0], id=f"{name}-{spec.shape_cases[0]}"))
        labels = spec.extremal_labels()
        if labels:
            cases.append(pytest.param(spec, labels[0], id=f"{name}-{labels[0]}"))
    return cases


def _inputs(spec: KernelSpec, case: str) -> dict:
    rng = _rng("graphs", spec.name, case)
    if case in spec.shape_cases:
        return spec.sample_inputs(case, rng)
    return spec.extremal_case(case, rng)


def test_pointer_kernels_are_registry_kernels() -> None:
    """The table of kernels with their own graph tests must not go stale."""
    assert set(POINTER_KERNELS) <= set(SPECS), sorted(set(POINTER_KERNELS) - set(SPECS))


@pytest.mark.gpu
@pytest.mark.parametrize("spec, case", _graph_cases())
def test_kernel_graph_replay_equals_eager(spec: KernelSpec, case: str, cuda_device,
                                          record_property) -> None:
    record_property("kernel", spec.name)
    record_property("case", f"graph replay == eager ({case})")
    if spec.fast is None:
        pytest.fail(f"{spec.name}: no fast test entry in foxhunt.fast.kernels.KERNELS")
    try:
        launches = record_launches(spec.fast, _inputs(spec, case))
    except PointerPayload:
        pytest.fail(f"{spec.name}: its launch passes device pointers inside an array; add it to "
                    "POINTER_KERNELS with a graph test of its own")
    assert launches, f"{spec.name}: the fast test entry launched no kernel through _runtime.call"
    problems = check_graph_equals_eager(launches)
    assert not problems, "\n".join(problems)


# ============================================================================ GEMM plans
GEMM_CASES = [("f32", None), ("tf32", None), ("bf16", "relu_bias")]


@pytest.mark.gpu
@pytest.mark.parametrize("precision, epilogue", GEMM_CASES, ids=[p for p, _ in GEMM_CASES])
def test_gemm_plan_graph_replay_equals_eager(precision, epilogue, cuda_device, record_property) -> None:
    from foxhunt.fast.device import Arena
    from foxhunt.fast.gemm import GemmPlan
    from foxhunt.fast.graphs import GraphCapture
    from foxhunt.reference.kernels.dense import f32_to_bf16

    record_property("kernel", "gemm")
    record_property("case", f"graph replay == eager ({precision})")
    rt = _runtime()
    cfg = DQNConfig.preset("seed")
    m, n, k = cfg.batch_size, cfg.shared_h1, cfg.state_dim  # the first layer: x W^T (+ b, ReLU)
    rng = _rng("gemm-graph", precision)
    a = rng.standard_normal((m, k)).astype(F32)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(F32)
    store = np.uint16 if precision == "bf16" else F32
    arena = Arena.from_specs(rt.device, {"a": ((m, k), store), "w": ((n, k), store),
                                         "bias": ((n,), F32), "c": ((m, n), F32)})
    plan = GemmPlan(rt.device, m, n, k, trans_b=True, precision=precision, epilogue=epilogue)
    try:
        arena.upload("a", f32_to_bf16(a) if precision == "bf16" else a)
        arena.upload("w", f32_to_bf16(w) if precision == "bf16" else w)
        arena.upload("bias", rng.standard_normal(n).astype(F32))
        extra = {"bias_ptr": arena.ptr("bias")} if epilogue else {}

        def enqueue():
            plan.run(arena.ptr("a"), arena.ptr("w"), arena.ptr("c"), stream=rt.stream, **extra)

        enqueue()
        eager = arena.download("c")
        assert np.any(eager != 0)
        arena.zero("c")
        graph = GraphCapture(rt.stream)
        try:
            with graph:
                enqueue()
            assert np.all(arena.download("c") == 0), "capturing ran the GEMM"
            for r in range(REPLAYS):
                arena.zero("c")
                graph.replay()
                got = arena.download("c")
                assert _same_bits(got, eager), f"replay {r}: {_first_difference(got, eager)}"
        finally:
            graph.close()
    finally:
        plan.close()
        arena.close()


# ============================================================================ spectral norm
def seed_spectral_problem() -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """The seed network's 10 weight matrices at init (every other one scaled by 8, so its
    sigma exceeds sigma_max and the rescaling path runs) with the trainer's u, v."""
    layout = ParamLayout(DQNConfig.preset("seed", **CORE_STEP))
    views = layout.views(init_params(layout, 5))
    ws, us, vs = [], [], []
    for i, t in enumerate(layout.weight_matrices):
        ws.append((views[t.name] * F32(8 if i % 2 else 1)).astype(F32))
        u, v = ref_spectral.init_spectral_vectors(t.shape, 5000 + i)
        us.append(u)
        vs.append(v)
    return ws, us, vs


class SpectralArena:
    """The 10 matrices and their vectors in one arena, with the batched kernel's descriptors."""

    def __init__(self, ws, us, vs):
        from foxhunt.fast.device import Arena
        from foxhunt.fast.kernels.spectral import SPECTRAL_MATRIX_DTYPE, spectral_descriptors

        rt = _runtime()
        self.host = (ws, us, vs)
        self.count = len(ws)
        specs = {}
        for k, (w, u, v) in enumerate(zip(ws, us, vs)):
            specs.update({f"w{k}": (w.shape, F32), f"u{k}": (u.shape, F32), f"v{k}": (v.shape, F32)})
        specs["desc"] = ((self.count,), SPECTRAL_MATRIX_DTYPE)
        specs["sigmas"] = ((self.count,), F32)
        self.arena = Arena.from_specs(rt.device, specs)
        p = self.arena.ptr
        self.desc = spectral_descriptors([(p(f"w{k}"), p(f"u{k}"), p(f"v{k}"), *ws[k].shape)
                                          for k in range(self.count)])

    def reset(self) -> None:
        ws, us, vs = self.host
        for k in range(self.count):
            self.arena.upload(f"w{k}", ws[k])
            self.arena.upload(f"u{k}", us[k])
            self.arena.upload(f"v{k}", vs[k])
        self.arena.upload("desc", self.desc)
        self.arena.upload("sigmas", np.full(self.count, np.nan, F32))

    def read(self) -> dict[str, np.ndarray]:
        out = {"sigmas": self.arena.download("sigmas")}
        for k in range(self.count):
            for name in ("w", "u", "v"):
                out[f"{name}{k}"] = self.arena.download(f"{name}{k}")
        return out

    def close(self) -> None:
        self.arena.close()


def _sigma_max() -> F32:
    return F32(DQNConfig.preset("seed").sigma_max)


def _launch_batched(sa: SpectralArena, stream) -> None:
    from foxhunt.fast.kernels.spectral import plan_batched_spectral_norm

    grid, block, smem = plan_batched_spectral_norm(sa.count)
    _runtime().module.kernel("batched_spectral_norm").launch(
        grid, block, sa.arena.ptr("desc"), sa.count, _sigma_max(), F32(ref_spectral.SPECTRAL_EPS),
        sa.arena.ptr("sigmas"), stream=stream, shared_mem=smem)


def _launch_individual(sa: SpectralArena, k: int, stream) -> None:
    from foxhunt.fast.kernels.spectral import plan_spectral_norm

    grid, block, smem = plan_spectral_norm()
    rows, cols = sa.host[0][k].shape
    p = sa.arena.ptr
    _runtime().module.kernel("spectral_norm").launch(
        grid, block, p(f"w{k}"), p(f"u{k}"), p(f"v{k}"), rows, cols, _sigma_max(),
        F32(ref_spectral.SPECTRAL_EPS), p("sigmas") + 4 * k, stream=stream, shared_mem=smem)


def _diff_report(a: dict, b: dict, what: str) -> list[str]:
    return [f"{what}: {key}: {_first_difference(b[key], a[key])}"
            for key in a if not _same_bits(a[key], b[key])]


@pytest.mark.gpu
def test_batched_spectral_norm_on_the_seed_matrices(cuda_device, record_property) -> None:
    from foxhunt.fast.graphs import GraphCapture

    record_property("kernel", "batched_spectral_norm")
    record_property("case", "seed matrices: batched == individual == graph replay")
    ws, us, vs = seed_spectral_problem()
    rt = _runtime()
    sa = SpectralArena(ws, us, vs)
    try:
        sa.reset()
        _launch_batched(sa, rt.stream)
        batched = sa.read()
        sa.reset()
        for k in range(sa.count):
            _launch_individual(sa, k, rt.stream)
        individual = sa.read()
        problems = _diff_report(batched, individual, "10 individual launches vs one batched launch")
        sa.reset()
        graph = GraphCapture(rt.stream)
        try:
            with graph:
                _launch_batched(sa, rt.stream)
            for r in range(REPLAYS):
                sa.reset()
                graph.replay()
                problems += _diff_report(batched, sa.read(), f"graph replay {r} vs eager")
        finally:
            graph.close()
    finally:
        sa.close()
    assert not problems, "\n".join(problems)

    # And the reference, within SPEC 8's rtol 1e-5 (the registry's spectral-norm tolerance).
    ref = ref_spectral.batched_spectral_norm(ws, us, vs, _sigma_max())
    assert any(s > _sigma_max() for s in ref.sigmas) and any(s <= _sigma_max() for s in ref.sigmas)
    spec = SPECS["batched_spectral_norm"]
    kwargs = {"ws": ws, "us": us, "vs": vs, "sigma_max": _sigma_max()}
    expected = spec.split_outputs(ref)
    actual = {}
    for k in range(sa.count):
        actual.update({f"ws[{k}]": batched[f"w{k}"], f"us[{k}]": batched[f"u{k}"],
                       f"vs[{k}]": batched[f"v{k}"], f"sigmas[{k}]": batched["sigmas"][k]})
    scales = spec.compare_inputs(kwargs, expected)
    results = [compare(f"batched_spectral_norm[seed].{key}", np.asarray(actual[key]),
                       np.asarray(expected[key]), spec.tolerance_of(key), scales[key])
               for key in expected]
    for r in results:
        record_property("comparison", r.as_dict())
    bad = [r.message for r in results if not r.passed]
    assert not bad, "\n\n".join(bad)


# ============================================================================ fused NaN check
@pytest.mark.gpu
def test_fused_nan_check_graph_replay_equals_eager(cuda_device, record_property) -> None:
    from foxhunt.fast.device import Arena
    from foxhunt.fast.graphs import GraphCapture
    from foxhunt.fast.kernels.safety import plan_nan_check_fused

    record_property("kernel", "nan_check_fused")
    record_property("case", "graph replay == eager (slot address table)")
    rng = _rng("fused-nan-check")
    lengths = [515, 289_611, 7, 1024, 33]
    buffers = [rng.standard_normal(n).astype(F32) for n in lengths]
    buffers[0][514] = np.nan        # a NaN in a tail
    buffers[1][200_000] = np.inf    # an Inf deep in a long slot
    buffers[3][5] = F32(1e6)        # above its threshold
    thresholds = np.array([0, 0, 0, 1e3, 0], F32)
    flags0 = np.array([0, 0, 1, 0, 0], np.int32)  # slot 2 already set: sticky
    rt = _runtime()
    specs = {f"b{k}": ((n,), F32) for k, n in enumerate(lengths)}
    specs.update({"addr": ((len(lengths),), np.uint64), "len": ((len(lengths),), np.int64),
                  "thr": ((len(lengths),), F32), "flags": ((len(lengths),), np.int32)})
    arena = Arena.from_specs(rt.device, specs)
    try:
        for k, b in enumerate(buffers):
            arena.upload(f"b{k}", b)
        arena.upload("addr", np.array([arena.ptr(f"b{k}") for k in range(len(lengths))], np.uint64))
        arena.upload("len", np.array(lengths, np.int64))
        arena.upload("thr", thresholds)
        grid, block, smem = plan_nan_check_fused(lengths)
        kernel = rt.module.kernel("nan_check_fused")

        def enqueue():
            kernel.launch(grid, block, arena.ptr("addr"), arena.ptr("len"), arena.ptr("thr"),
                          arena.ptr("flags"), len(lengths), stream=rt.stream, shared_mem=smem)

        arena.upload("flags", flags0)
        enqueue()
        eager = arena.download("flags")
        graph = GraphCapture(rt.stream)
        try:
            arena.upload("flags", flags0)
            with graph:
                enqueue()
            assert np.array_equal(arena.download("flags"), flags0), "capturing ran the check"
            replays = []
            for _ in range(REPLAYS):
                arena.upload("flags", flags0)
                graph.replay()
                replays.append(arena.download("flags"))
        finally:
            graph.close()
    finally:
        arena.close()
    want = ref_safety.nan_check_fused(buffers, flags0, thresholds)
    assert np.array_equal(eager, want), f"eager {eager} vs reference {want}"
    for r, got in enumerate(replays):
        assert np.array_equal(got, eager), f"replay {r}: {got} vs eager {eager}"


@pytest.mark.gpu
def test_polyak_check_graph_replay_equals_eager(cuda_device, record_property) -> None:
    # Graph 2's last node as the step holds it: online and target the two rows of one buffer,
    # the entry table pointing into them (all of online, a None entry, all of the new target,
    # two thresholded ranges of online), a flag already set; eager == every replay, bitwise,
    # and == the reference twin.
    from foxhunt.fast.device import Arena
    from foxhunt.fast.graphs import GraphCapture
    from foxhunt.fast.kernels.optim import plan_polyak_update_mirror

    record_property("kernel", "polyak_update_mirror_check")
    record_property("case", "graph replay == eager (entry address table)")
    rng = _rng("polyak-check")
    n, tau = 289_611, F32(0.005)
    split = n // 3
    both = (rng.standard_normal((2, n)) * 0.1).astype(F32)
    both[0, 5] = np.nan              # online: its entries 0 and 3 fire, 4 (finite, small) not
    both[1, 1000] = np.inf           # the new target: entry 2 fires
    entries = [("online", 0, n), None, ("target", 0, n), ("online", 0, split),
               ("online", split, n - split)]
    thresholds = np.array([0, 0, 0, 0.2, 100.0], F32)  # entry 3 fires on magnitude
    flags0 = np.array([0, 1, 0, 0, 0], np.int32)
    rt = _runtime()
    k = len(entries)
    arena = Arena.from_specs(rt.device, {
        "params2": ((2, n), F32), "mirror2": ((2, n), np.uint16), "addr": ((k,), np.uint64),
        "len": ((k,), np.int64), "thr": ((k,), F32), "flags": ((k,), np.int32)})
    try:
        rows = {"online": arena.ptr("params2"), "target": arena.ptr("params2") + 4 * n}
        arena.upload("addr", np.array([0 if e is None else rows[e[0]] + 4 * e[1] for e in entries],
                                      np.uint64))
        arena.upload("len", np.array([0 if e is None else e[2] for e in entries], np.int64))
        arena.upload("thr", thresholds)
        grid, block, smem = plan_polyak_update_mirror(n)
        kernel = rt.module.kernel("polyak_update_mirror_check")

        def reset():
            arena.upload("params2", both)
            arena.upload("mirror2", np.zeros((2, n), np.uint16))
            arena.upload("flags", flags0)

        def enqueue():
            kernel.launch(grid, block, rows["target"], rows["online"], n, tau,
                          arena.ptr("mirror2"), arena.ptr("mirror2") + 2 * n, arena.ptr("addr"),
                          arena.ptr("len"), arena.ptr("thr"), arena.ptr("flags"), k,
                          stream=rt.stream, shared_mem=smem)

        def outputs():
            return arena.download("params2"), arena.download("mirror2"), arena.download("flags")

        reset()
        enqueue()
        eager = outputs()
        graph = GraphCapture(rt.stream)
        try:
            reset()
            with graph:
                enqueue()
            assert np.array_equal(arena.download("flags"), flags0), "capturing ran the kernel"
            replays = []
            for _ in range(REPLAYS):
                reset()
                graph.replay()
                replays.append(outputs())
        finally:
            graph.close()
    finally:
        arena.close()
    want = ref_optim.polyak_update_mirror_check(both[1], both[0], tau, entries, flags0, thresholds)
    assert eager[2].tolist() == want.flags.tolist() == [1, 1, 1, 1, 0]
    # the blend of online's NaN is the GPU's canonical NaN (the conformance entry's contract:
    # bitwise but for a NaN's payload), everything else bitwise
    nan = np.isnan(want.target)
    assert np.array_equal(np.isnan(eager[0][1]), nan)
    assert eager[0][1][~nan].tobytes() == want.target[~nan].tobytes()
    assert eager[0][0].tobytes() == both[0].tobytes()  # online untouched
    assert np.array_equal(eager[1][0], want.online_bf16)
    assert np.array_equal(eager[1][1][~nan], want.target_bf16[~nan])
    assert np.all(np.isnan(ref_dense.bf16_to_f32(eager[1][1][nan])))
    for r, got in enumerate(replays):
        for name, g, e in zip(("params2", "mirror2", "flags"), got, eager):
            assert g.tobytes() == e.tobytes(), f"replay {r}: {name} differs from eager"


# ============================================================================ fingerprint bits
def _isv_with(lo: int, hi: int) -> np.ndarray:
    vec = isv_mod.ISVBus().to_array()
    bits = vec.view(np.uint32)
    bits[isv_mod.FINGERPRINT_LO_INDEX] = np.uint32(lo)
    bits[isv_mod.FINGERPRINT_HI_INDEX] = np.uint32(hi)
    return vec


FP_IDS = [f"{lo:08x}-{hi:08x}" for lo, hi in FINGERPRINT_PATTERNS]
FP_SLOTS = [isv_mod.FINGERPRINT_LO_INDEX, isv_mod.FINGERPRINT_HI_INDEX]


@pytest.mark.gpu
@pytest.mark.parametrize("lo, hi", FINGERPRINT_PATTERNS, ids=FP_IDS)
def test_fingerprint_bits_survive_arena_round_trips(lo, hi, cuda_device, record_property) -> None:
    from foxhunt.fast.device import Arena

    record_property("kernel", "isv fingerprint")
    record_property("case", f"{lo:08x}-{hi:08x}")

    rt = _runtime()
    vec = _isv_with(lo, hi)
    arena = Arena.from_specs(rt.device, {"isv": ((isv_mod.ISV_LEN,), F32),
                                         "copy": ((isv_mod.ISV_LEN,), F32)})
    try:
        arena.upload("isv", vec)
        assert _same_bits(arena.download("isv"), vec), "synchronous upload/download"
        pinned = rt.device.pinned_empty((isv_mod.ISV_LEN,), F32)
        pinned[...] = vec
        arena.upload_async("copy", pinned, rt.stream)
        back = rt.device.pinned_empty((isv_mod.ISV_LEN,), F32)
        arena.download_async("copy", back, rt.stream)
        rt.stream.synchronize()
        assert _same_bits(back, vec), "pinned asynchronous upload/download"
        got = back.view(np.uint32)[FP_SLOTS]
        assert [int(x) for x in got] == [lo, hi]
    finally:
        arena.close()


def _isv_launches(vec: np.ndarray) -> list[tuple[str, dict]]:
    rng = _rng("isv-fingerprint")
    return [
        ("isv_signal_update", {"isv": vec, "signals": rng.standard_normal(isv_mod.NUM_SIGNALS).astype(F32),
                               "sharpe": 0.5, "alpha_base": 0.05}),
        ("isv_q_abs_ref_update", {"isv": vec, "q": rng.standard_normal((32, 3)).astype(F32), "alpha": 0.05}),
        ("isv_h2_rms_update", {"isv": vec, "h2": rng.standard_normal((32, 259)).astype(F32), "alpha": 0.05}),
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("lo, hi", FINGERPRINT_PATTERNS, ids=FP_IDS)
def test_fingerprint_bits_survive_isv_kernels(lo, hi, cuda_device, record_property) -> None:
    record_property("kernel", "isv fingerprint")
    record_property("case", f"{lo:08x}-{hi:08x}")
    vec = _isv_with(lo, hi)
    problems = []
    for name, kwargs in _isv_launches(vec):
        spec = SPECS[name]
        with np.errstate(all="ignore"):
            out = spec.fast(**{k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in kwargs.items()})
            ref = spec.ref(**{k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in kwargs.items()})
        got = [int(x) for x in np.asarray(out, F32).view(np.uint32)[FP_SLOTS]]
        if got != [lo, hi]:
            problems.append(f"{name}: fingerprint slots hold {[hex(g) for g in got]}, "
                            f"wrote {[hex(lo), hex(hi)]}")
        kept = _bits(np.asarray(ref, F32)) == _bits(vec)  # slots the reference copies
        changed = kept & (_bits(np.asarray(out, F32)) != _bits(vec))
        if changed.any():
            problems.append(f"{name}: slot(s) {np.flatnonzero(changed).tolist()} that the reference "
                            "copies bit for bit changed on the device")
        launches = record_launches(spec.fast, kwargs)
        problems += check_graph_equals_eager(launches)
        for launch in launches:
            for i, output in enumerate(launch.outputs):
                if output.shape == vec.shape and output.dtype == vec.dtype:
                    got = [int(x) for x in output.view(np.uint32)[FP_SLOTS]]
                    if got != [lo, hi]:
                        problems.append(f"{name} (recorded launch) output {i}: fingerprint {got}")
    assert not problems, "\n".join(problems)


def test_isv_kernels_registry_entries_exist() -> None:
    """The fingerprint test drives these kernels by name: they must stay in the registry."""
    missing = [name for name, _ in _isv_launches(_isv_with(0, 0)) if name not in SPECS]
    assert not missing, f"isv kernels missing from the registry: {missing}"
    assert SPECS["isv_q_abs_ref_update"].tolerance_of("out")
