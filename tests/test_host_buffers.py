"""Host memory the device writes or reads (brief J): every copy record with a host end fits the
pinned buffer the GPU code allocates for it, for every preset, precision and step variant; the
lowering refuses a host end that is missing, too small, not page-locked, strided or read-only;
a captured graph keeps the host buffers it copies to alive until it is closed, and ``close``
waits for its last launch before letting them go; a collector refuses a rebuilt engine.

No GPU: the plans are built by the CPU executor's engine (the same records), the pinned blocks
are fakes carved like ``Device.pinned_empty`` (``_PinnedHost`` over a ctypes buffer), and the
driver of the lifetime tests is a fake that logs its calls."""

from __future__ import annotations

import ctypes
import gc
import weakref
from types import SimpleNamespace

import numpy as np
import pytest

from foxhunt.fast import device as fast_device
from foxhunt.fast import graphs as fast_graphs
from foxhunt.fast.cpu_executor import CpuEngine, CpuTrainer
from foxhunt.fast.eval_plan import (
    METRICS_HOST,
    OBS_HOST,
    POLICIES,
    Q_HOST,
    REWARDS_HOST,
    START_HOST,
    X_HOST,
    WalkLayout,
    bar_ops,
    begin_ops,
    end_ops,
    eval_host_specs,
    eval_ops,
    register_twins,
    walk_binder,
)
from foxhunt.fast.gpu_engine import READ_BUFFERS, host_buffer_specs
from foxhunt.fast.graph2_plan import staging_name
from foxhunt.fast.graph_lowering import Lowering
from foxhunt.fast.records import Copy, Host, Ops, PlanError
from foxhunt.fast.step_layout import EvalLayout
from foxhunt.fast.trainer import STAGING_RING
from foxhunt.reference.config import PRECISIONS, PRESETS, SECOND_WAVE_SOURCES, DQNConfig, source_overrides
from foxhunt.reference.kernels import env as env_kernels

SOURCES = ("core", *SECOND_WAVE_SOURCES, "all")
VARIANTS = [(p, prec, src) for p in PRESETS for prec in PRECISIONS for src in SOURCES]


class FakePinned(fast_device._PinnedHost):
    """A ``_PinnedHost`` over ordinary memory (no driver); freeing it frees nothing."""

    def __init__(self, nbytes: int):
        self._memory = (ctypes.c_char * nbytes)()
        self.nbytes, self.device_ptr = nbytes, 0
        self.host_ptr = ctypes.addressof(self._memory)

    def __del__(self):
        pass


def fake_pinned(shape, dtype) -> np.ndarray:
    """``Device.pinned_empty(shape, dtype)`` on a fake block."""
    shape, dtype = fast_device._check_shape_dtype("shape", shape, dtype)
    nbytes = max(1, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
    return FakePinned(nbytes).view(0, shape, dtype)


def fake_host(specs: dict) -> dict[str, np.ndarray]:
    return {name: fake_pinned(shape, dtype) for name, (shape, dtype) in specs.items()}


def host_copies(ops: Ops) -> list[tuple[str, int, bool]]:
    """``(host buffer, bytes, written)`` of every copy of ``ops`` with a host end."""
    out = []
    for node in ops.nodes():
        if isinstance(node, Copy):
            for end, write in ((node.dst, True), (node.src, False)):
                if isinstance(end, Host):
                    out.append((end.name, node.nbytes, write))
    return out


@pytest.fixture(scope="module", params=VARIANTS, ids=["-".join(v) for v in VARIANTS])
def engine(request):
    preset, precision, source = request.param
    config = DQNConfig.preset(preset, precision=precision, **source_overrides(source))
    return CpuEngine(config, staging_slots=STAGING_RING)


# ------------------------------------------------------------------ sizes, every variant


def test_step_copies_fit_the_engines_pinned_buffers(engine):
    """The upload graph of slot s reads exactly the arena's ``batch`` bytes from staging slot s;
    graphs 1 and 2 touch no host memory; ``read``'s mirrors are the size of their buffers."""
    lay = engine.layout
    host = fake_host(host_buffer_specs(lay, STAGING_RING))
    lowering = Lowering(None, lambda buf: 0, host)
    batch_shape, batch_dtype = lay.specs["batch"]
    batch_bytes = int(np.prod(batch_shape)) * np.dtype(batch_dtype).itemsize
    for slot, ops in enumerate(engine.plans["upload"]):
        assert host_copies(ops) == [(staging_name(slot), batch_bytes, False)]
        (held,) = lowering.host_arrays(ops)
        assert held is host[staging_name(slot)] and held.nbytes == batch_bytes
    for name in ("graph1", "graph2"):
        assert host_copies(engine.plans[name]) == []
    for host_name, buf in READ_BUFFERS.items():
        shape, dtype = lay.specs[buf]
        assert host[host_name].nbytes == int(np.prod(shape)) * np.dtype(dtype).itemsize


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_q_values_copies_fit_their_pinned_buffers(engine, rows):
    lay = engine.layout
    evl = EvalLayout(lay, rows)
    ops = eval_ops(engine.program, evl)
    host = fake_host(eval_host_specs(evl))
    q_shape, _ = evl.specs["q_e"]
    copies = dict(((name, write), nbytes) for name, nbytes, write in host_copies(ops))
    assert copies == {(X_HOST, False): rows * lay.SD * 4, (Q_HOST, True): int(np.prod(q_shape)) * 4}
    assert host[X_HOST].shape == (rows, lay.SD)  # GpuEval.run writes the states as they come
    assert host[Q_HOST].nbytes >= rows * sum(lay.branches) * 4
    assert {id(a) for a in Lowering(None, lambda b: 0, host).host_arrays(ops)} == \
        {id(host[X_HOST]), id(host[Q_HOST])}
    # split_q reads inside the copied bytes.
    got = evl.split_q(np.arange(host[Q_HOST].size, dtype=np.float32))
    assert [g.shape for g in got] == [(rows, n) for n in lay.branches]
    assert max(int(g.max()) for g in got) < host[Q_HOST].size


def test_walk_copies_fit_their_pinned_buffers(engine):
    register_twins()  # the walk's kernels are checked against their CPU twins
    lay, prog = engine.layout, engine.program
    max_steps = 37
    wl = WalkLayout(lay, n_bars=300, n_features=5, max_steps=max_steps)
    evl = EvalLayout(lay, 1)
    host = fake_host(wl.host_specs())
    lowering = Lowering(None, lambda b: 0, host)
    new = lambda: Ops(walk_binder(prog, wl, evl))  # noqa: E731
    begin = new()
    begin_ops(begin, prog, wl)
    assert sorted(host_copies(begin)) == sorted([(OBS_HOST, lay.SD * 4, False), (START_HOST, 4, False)])
    for policy in POLICIES:
        bar = new()
        bar_ops(bar, prog, wl, policy)
        assert host_copies(bar) == []
    end = new()
    end_ops(end, prog, wl, n=max_steps, bars_per_year=252.0, equity=True)
    assert sorted(host_copies(end)) == sorted([(REWARDS_HOST, max_steps * 4, True),
                                               (METRICS_HOST, len(env_kernels.EVAL_FIELDS) * 4, True)])
    for ops in (begin, end):
        lowering.host_arrays(ops)  # every end checked against its pinned buffer
    with pytest.raises(PlanError, match=f"holds {max_steps}"):  # one row more than recorded
        end_ops(new(), prog, wl, n=max_steps + 1, bars_per_year=252.0, equity=True)


# ------------------------------------------------------------------ the lowering's checks


@pytest.fixture(scope="module")
def tiny():
    return CpuEngine(DQNConfig.preset("tiny"), staging_slots=STAGING_RING)


def _eval(tiny, rows=3):
    evl = EvalLayout(tiny.layout, rows)
    return evl, eval_ops(tiny.program, evl)


def test_lowering_refuses_a_host_buffer_smaller_than_its_copy(tiny):
    evl, ops = _eval(tiny)
    host = fake_host(eval_host_specs(evl))
    q = host[Q_HOST]
    host[Q_HOST] = fake_pinned(q.size - 1, np.float32)
    with pytest.raises(ValueError, match=rf"'{Q_HOST}': {q.nbytes} bytes do not fit its {q.nbytes - 4} bytes"):
        Lowering(None, lambda b: 0, host).host_arrays(ops)


def test_lowering_refuses_pageable_strided_readonly_or_missing_host_memory(tiny):
    evl, ops = _eval(tiny)
    good = fake_host(eval_host_specs(evl))

    def refused(name, array, match):
        with pytest.raises(ValueError, match=match):
            Lowering(None, lambda b: 0, {**good, name: array}).host_arrays(ops)

    refused(Q_HOST, np.zeros_like(good[Q_HOST]), "not page-locked")
    wide = fake_pinned((good[X_HOST].shape[0], 2 * good[X_HOST].shape[1]), np.float32)
    refused(X_HOST, wide[:, ::2], "C-contiguous")
    readonly = fake_pinned(good[Q_HOST].shape, np.float32)
    readonly.flags.writeable = False
    refused(Q_HOST, readonly, "writeable")
    with pytest.raises(ValueError, match="no such host array"):
        Lowering(None, lambda b: 0, {X_HOST: good[X_HOST]}).host_arrays(ops)
    # A view that starts inside the block but whose copy would run past its end.
    block = FakePinned(good[Q_HOST].nbytes + 64)
    tail = block.view(64, good[Q_HOST].shape, np.dtype(np.float32))
    assert fast_device.pinned_block(tail) is block
    Lowering(None, lambda b: 0, {**good, Q_HOST: tail}).host_arrays(ops)  # fits exactly


def test_pinned_block_is_found_through_views_and_bounds_hold():
    block = FakePinned(256)
    arr = block.view(16, (4, 8), np.dtype(np.float32))
    for view in (arr, arr[1:], arr.reshape(-1), arr.view(np.uint8), arr[2]):
        assert fast_device.pinned_block(view) is block
        assert block.contains(view.ctypes.data, view.nbytes)
    assert fast_device.pinned_block(np.zeros(4)) is None
    assert not block.contains(arr.ctypes.data, 256)  # 16 + 256 bytes overrun the block
    with pytest.raises(ValueError, match="overrun the 256-byte pinned block"):
        block.view(128, (33,), np.dtype(np.float32))


@pytest.mark.parametrize("members", [None, 3])
@pytest.mark.parametrize("write_combined", [False, True])
def test_pinned_host_buffers_write_combine_the_staging_ring_only(monkeypatch, tiny, members,
                                                                 write_combined):
    """``pinned_host_buffers``: every ``host_buffer_specs`` buffer (``members`` rows of it for a
    population), zero-filled; only the staging ring's asked for write-combined, and only where
    ``WRITE_COMBINED_STAGING`` says so (the read mirrors are read by the host)."""
    from foxhunt.fast import gpu_engine

    monkeypatch.setattr(gpu_engine, "WRITE_COMBINED_STAGING", write_combined)
    asked = {}

    def pinned_empty(shape, dtype, *, write_combined=False):
        array = fake_pinned(shape, dtype)
        asked[id(array)] = write_combined
        return array

    specs = host_buffer_specs(tiny.layout, STAGING_RING)
    got = gpu_engine.pinned_host_buffers(SimpleNamespace(pinned_empty=pinned_empty), tiny.layout,
                                         STAGING_RING, members=members)
    assert list(got) == list(specs)
    staging = {staging_name(s) for s in range(STAGING_RING)}
    assert len(staging) == STAGING_RING >= 2 and staging < set(got) and set(READ_BUFFERS) < set(got)
    for name, (shape, dtype) in specs.items():
        lead = () if members is None else (members,)
        assert got[name].shape == (*lead, *shape) and got[name].dtype == dtype
        assert not got[name].any()
        assert asked[id(got[name])] is (write_combined and name in staging), name


def test_pinned_empty_refuses_a_write_combined_that_is_not_a_bool():
    with pytest.raises(ValueError, match=r"^write_combined=1: must be a bool$"):
        fast_device.Device.pinned_empty(object(), (4,), np.float32, write_combined=1)


# ------------------------------------------------------------------ lifetimes, with a fake driver


class FakeDriver:
    """The driver calls ``GraphCapture`` and ``Lowering`` make, logged; a launch stays in flight
    until its event is waited on. It has no graph to read nodes from: the captures here turn
    node priorities off (tests/test_fast_gpu.py checks them on a real graph)."""

    CUresult = SimpleNamespace(CUDA_SUCCESS=0, CUDA_ERROR_NOT_READY=600)
    CUstream_flags = SimpleNamespace(CU_STREAM_NON_BLOCKING=SimpleNamespace(value=1))
    CUevent_flags = SimpleNamespace(CU_EVENT_DISABLE_TIMING=SimpleNamespace(value=2))
    CUstreamCaptureMode = SimpleNamespace(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL=0)

    def __init__(self):
        self.log: list = []
        self.in_flight = False
        self._next = 100

    def _new(self, *_):
        self._next += 1
        return 0, self._new_handle()

    def _new_handle(self):
        return self._next

    def _ok(self, what):
        def fn(*args):
            self.log.append((what, *args))
            return (0,)
        fn.__name__ = what
        return fn

    def __getattr__(self, name):
        if name in ("cuStreamCreate", "cuEventCreate"):
            return self._new
        if name == "cuStreamEndCapture":
            return lambda s: (0, "graph")
        if name == "cuGraphInstantiate":
            return lambda g, f: (0, "exec")
        return self._ok(name)

    def cuGraphLaunch(self, exec_, stream):
        self.log.append(("cuGraphLaunch",))
        self.in_flight = True
        return (0,)

    def cuEventQuery(self, event):
        return (600 if self.in_flight else 0,)

    def cuEventSynchronize(self, event):
        self.log.append(("cuEventSynchronize", event))
        self.in_flight = False
        return (0,)


@pytest.fixture
def driver(monkeypatch):
    fake = FakeDriver()
    monkeypatch.setattr(fast_device, "_driver", lambda: fake)
    monkeypatch.setattr(fast_graphs, "_driver", lambda: fake)
    return fake


def empty_graph() -> fast_graphs.GraphCapture:
    """A captured graph of nothing on a stand-in stream (the fake driver's)."""
    graph = fast_graphs.GraphCapture(fast_device.Stream(1, owned=False), max_branches=0,
                                     node_priority=False)
    with graph:
        pass
    return graph


def _names(log):
    return [entry[0] for entry in log]


def test_a_graph_holds_its_host_buffers_until_its_last_launch_is_done(driver):
    block = FakePinned(64)
    array = block.view(0, (16,), np.dtype(np.float32))
    weakref.finalize(block, driver.log.append, ("freed",))
    graph = empty_graph()
    graph.hold(array)
    del array, block
    gc.collect()
    assert ("freed",) not in driver.log  # the graph's reference keeps the block
    graph.replay()
    syncs = fast_device.SYNCS.count
    graph.close()
    gc.collect()
    names = _names(driver.log)
    assert names.index("cuEventSynchronize") < names.index("freed")
    assert fast_device.SYNCS.count == syncs + 1


def test_closing_an_idle_graph_does_not_wait(driver):
    block = FakePinned(64)
    weakref.finalize(block, driver.log.append, ("freed",))
    graph = empty_graph()
    graph.hold(block.view(0, (16,), np.dtype(np.float32)))
    del block
    graph.replay()
    driver.in_flight = False  # the launch finished (a synchronisation elsewhere)
    syncs = fast_device.SYNCS.count
    graph.close()
    gc.collect()
    assert "cuEventSynchronize" not in _names(driver.log) and ("freed",) in driver.log
    assert fast_device.SYNCS.count == syncs


def test_a_graph_that_records_its_own_launch_event_launches_in_one_call(driver):
    """``hold(..., launch_event=e)``: the graph records ``e`` itself (its last node), so a
    replay is one driver call, and ``close`` waits on ``e`` (the caller's: not destroyed)
    before letting the buffers go."""
    block = FakePinned(64)
    weakref.finalize(block, driver.log.append, ("freed",))
    graph = empty_graph()
    graph.hold(block.view(0, (16,), np.dtype(np.float32)), launch_event=777)
    del block
    driver.log.clear()
    graph.replay()
    assert _names(driver.log) == ["cuGraphLaunch"]
    graph.close()
    gc.collect()
    names = _names(driver.log)
    assert names.index("cuEventSynchronize") < names.index("freed")
    assert ("cuEventSynchronize", 777) in driver.log
    assert ("cuEventDestroy", 777) not in driver.log


def test_a_launch_event_comes_with_the_first_hold(driver):
    graph = empty_graph()
    graph.hold(fake_pinned(4, np.float32))
    with pytest.raises(RuntimeError, match="launch_event must come with the first hold"):
        graph.hold(fake_pinned(4, np.float32), launch_event=777)


def test_hold_is_refused_during_a_capture(driver):
    graph = fast_graphs.GraphCapture(fast_device.Stream(1, owned=False), max_branches=0,
                                     node_priority=False)
    with graph:
        with pytest.raises(RuntimeError, match="after the capture"):
            graph.hold(fake_pinned(4, np.float32))


def test_enqueue_copies_exactly_the_records_bytes_from_the_checked_buffer(driver, tiny):
    host = fake_host(host_buffer_specs(tiny.layout, STAGING_RING))
    lowering = Lowering(None, lambda buf: 0xA000, host)
    ops = tiny.plans["upload"][1]
    lowering.enqueue(ops, fast_device.Stream(1, owned=False))
    (entry,) = [e for e in driver.log if e[0] == "cuMemcpyHtoDAsync"]
    assert entry[1:4] == (0xA000, host[staging_name(1)].ctypes.data, tiny.layout.batch_nbytes)
    driver.log.clear()
    host[staging_name(1)] = fake_pinned(tiny.layout.batch_nbytes - 1, np.uint8)
    with pytest.raises(ValueError, match="do not fit"):
        lowering.enqueue(ops, fast_device.Stream(1, owned=False))
    assert "cuMemcpyHtoDAsync" not in _names(driver.log)  # refused before the driver saw it


# ------------------------------------------------------------------ rebuilt engines


def test_a_collector_refuses_a_rebuilt_engine():
    from foxhunt.fast.collector import FastCollector
    from foxhunt.reference import loop
    from foxhunt.reference.collector import Walks
    from foxhunt.reference.market import SyntheticMarket, feature_warmup, market_features

    config = DQNConfig.preset("tiny", **source_overrides("iqn"))
    bars = SyntheticMarket.preset("default", seed=3, n_bars=400).generate()
    windows = loop.choose_windows(config.state_dim)
    feats = market_features(bars, windows)
    t0, t_val = loop.fold_segments(len(bars), feature_warmup(windows), 1, 0.125, 0.125)[0].train
    trainer = CpuTrainer(config, seed=1)
    collector = FastCollector(trainer, config, env_kernels.market_tables(bars, feats),
                              Walks(t_val, t0, t_val - 1 - 50, 50), n_envs=4, capacity=64,
                              reward_scale=1000.0, seed=1, cycle=0)
    collector.warmup(trainer, config.batch_size)
    collector.cycle_step(trainer)  # built on this engine: runs
    old = trainer.engine
    trainer.load_state_dict(CpuTrainer(config, seed=2).state_dict())  # another seed: rebuilt
    assert trainer.engine is not old
    with pytest.raises(RuntimeError, match="rebuilt"):
        collector.cycle_step(trainer)
    with pytest.raises(RuntimeError, match="rebuilt"):
        collector.warmup(trainer, 10 ** 6)
