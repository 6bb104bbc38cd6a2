"""The fast Trainer against the reference Trainer: one step from a shared state, NaN injection,
deferred readback, checkpoints both ways, fold boundary, greedy Q values.

Every test runs on two executors of the fast Trainer's plan:

- ``cpu``: ``foxhunt.fast.cpu_executor.CpuTrainer``, the fast Trainer's own records (arena
  layout, every launch bound by parameter name and checked, GEMM shapes/epilogues/alignment,
  the graphs' branch structure as a dependency graph, readback, state exchange) run on the CPU
  by the same-name reference kernels. It checks the plan on any machine; it cannot check the
  CUDA code itself (the conformance suite and the ``gpu`` executor do). Parallel branches run
  "latest ready record first" (a dependency missing between branches changes the result) or in
  capture order.
- ``gpu``: the real thing (NVRTC kernels, cuBLASLt, CUDA graphs); skipped with the reason where
  no CUDA device/driver is usable.

One-step comparisons with the reference live in ``conformance/test_step.py`` (GPU) and
``conformance/test_step_cpu_executor.py`` (this executor) under the step-conformance bounds;
here the wiring is checked: exact where the contract is exact (initial state, flags, NaN maps,
readback bookkeeping, checkpoints, folds), and the greedy Q values and TD errors within the
forward-only bound of ``conformance.step_bounds.fwd_eps`` (on the conditioned shared batch,
away from ReLU switches and double-DQN near ties).
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

from foxhunt.conformance.step_bounds import fwd_eps
from foxhunt.conformance.step_harness import SOURCES, shared_case
from foxhunt.fast.device import cuda_available
from foxhunt.reference import isv as isv_mod
from foxhunt.reference import sentinels
from foxhunt.reference.batch import Batch
from foxhunt.reference.budgets import budget_pipeline
from foxhunt.reference.config import CORE_STEP, DQNConfig
from foxhunt.reference.kernels import distributional as dist
from foxhunt.reference.step import loss_and_grads
from foxhunt.reference.trainer import Trainer as RefTrainer

_GPU_OK, _GPU_REASON = cuda_available()
WARM_STEPS = 3
SCALAR_FIELDS = ("loss", "c51_loss", "cql_loss", "grad_norm", "c51_norm_pre", "c51_norm_post",
                 "cql_norm_pre", "cql_norm_post", "clip_bound", "mean_q", "mean_target_q")


# ============================================================================================
# Fixtures
# ============================================================================================

BACKENDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("gpu", id="gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not _GPU_OK, reason=f"no CUDA device/driver: {_GPU_REASON}")]),
]


@pytest.fixture(params=BACKENDS)
def backend(request):
    """``(name, make)``: ``make(config, seed=0, **options)`` builds the fast Trainer on the CPU
    executor or the GPU (``options``: the CPU executor's ``branch_order``)."""
    name = request.param
    from foxhunt.fast.cpu_executor import CpuTrainer
    from foxhunt.fast.trainer import Trainer

    made = []

    def make(config, seed=0, **options):
        trainer = CpuTrainer(config, seed=seed, **options) if name == "cpu" else Trainer(config, seed=seed)
        made.append(trainer)
        return trainer

    yield name, make
    for trainer in made:
        trainer.close()


def _warm_reference(config: DQNConfig, seed: int, steps: int = WARM_STEPS):
    ref = RefTrainer(config, seed=seed)
    rng = np.random.default_rng(seed + 100)
    with np.errstate(all="ignore"):
        for _ in range(steps):
            ref.step(Batch.random(config, rng))
    return ref, rng


def _q_bound(config: DQNConfig, want: np.ndarray) -> np.ndarray:
    """The step comparison's bound on greedy Q values: ``fwd_eps (|Q| + max|z|)``."""
    z = dist.support(config.v_min, config.v_max, config.num_atoms)
    return fwd_eps(config) * (np.abs(want.astype(np.float64)) + float(np.max(np.abs(z))))


def _assert_q_close(config: DQNConfig, want: list, got: list) -> None:
    assert len(got) == len(want)
    for w, g in zip(want, got):
        assert g.shape == w.shape and g.dtype == np.float32
        assert np.all(np.abs(g.astype(np.float64) - w) <= _q_bound(config, w)), np.abs(g - w).max()


# ============================================================================================
# Tests
# ============================================================================================


@pytest.mark.skipif(_GPU_OK, reason="a CUDA device is present")
def test_construction_without_a_gpu_says_so():
    from foxhunt.fast import NoCudaDeviceError, Trainer

    with pytest.raises(NoCudaDeviceError, match="no CUDA device"):
        Trainer(DQNConfig.preset("tiny"))


def test_package_exports_the_trainer():
    import foxhunt.fast
    from foxhunt.reference.backend import TrainerBackend, get_backend

    assert foxhunt.fast.Trainer is get_backend("fast")
    assert issubclass(foxhunt.fast.Trainer, TrainerBackend)
    assert foxhunt.fast.Trainer.backend_name == "fast"


def test_step_layout_covers_every_reference_sentinel_buffer():
    """The fused check watches exactly the reference's per-step buffers, online(s) rows only
    (the core step; the second wave's slots: tests/test_fast_second_wave.py)."""
    from foxhunt.fast.sentinel_plan import sentinel_pieces
    from foxhunt.fast.step_layout import StepLayout

    for preset in ("tiny", "seed"):
        config = DQNConfig.preset(preset, **CORE_STEP)
        lay = StepLayout(config)
        ref = RefTrainer(config.replace(readback_interval=1))
        batch = Batch.random(config, np.random.default_rng(0))
        with np.errstate(all="ignore"):
            out = loss_and_grads(config, ref.params, ref.target, batch, layout=ref.layout)
            grad, _ = budget_pipeline(config, out["grad_c51"], out["grad_cql"])
        want = ref._sentinel_buffers(batch, out, grad)
        pieces = sentinel_pieces(lay)
        assert sorted(pieces) == sorted(want)
        for name, buf in want.items():
            total = sum(p.count for p in pieces[name])
            if name.endswith("_max") and name != "atom_span_max" and name != "h2_max_abs":
                # parameter-group ranges include the padding between tensors (always zero)
                assert buf.size <= total < buf.size + 64 * len(lay.param_layout.tensors), name
            else:
                assert total == buf.size, name


@pytest.mark.parametrize("source", ["core", "all"])
@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_initial_state_is_the_reference_state(backend, precision, source):
    name, make = backend
    config = DQNConfig.preset("tiny", precision=precision, **SOURCES[source])
    want = RefTrainer(config, seed=5).state_dict()
    got = make(config, seed=5).state_dict()
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].shape == want[key].shape and got[key].dtype == want[key].dtype, key
        assert np.array_equal(want[key].view(np.uint8), got[key].view(np.uint8)), key


#: Non-finite batch data and a NaN parameter. A NaN importance weight is a user error
#: (``Batch.validate`` refuses it); its case bypasses the validation, as the reference's
#: tests do, to check the device path's slot 23 all the same.
_INJECTIONS = {
    "state_nan": ("s", (2, 3), np.nan),
    "next_state_nan": ("s2", (1, 0), np.nan),
    "reward_inf": ("r", (3,), np.inf),
    "reward_nan": ("r", (0,), np.nan),
    "isw_nan": ("isw", (4,), np.nan),
    "param_nan": None,
}


@pytest.mark.parametrize("case", sorted(_INJECTIONS))
@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_nan_injection_gives_the_same_flags_and_nan_maps(backend, precision, case, monkeypatch):
    name, make = backend
    if case == "isw_nan":
        monkeypatch.setattr(Batch, "validate", lambda self, config: self)
    config = DQNConfig.preset("tiny", precision=precision, readback_interval=1)
    ref, rng = _warm_reference(config, seed=7)
    batch = Batch.random(config, rng)
    state = ref.state_dict()
    spec = _INJECTIONS[case]
    if spec is None:
        params = state["params"].copy()
        params[ref.layout["w_v2"].offset + 5] = np.nan
        state["params"] = params
        ref.load_state_dict(state)
    else:
        field, pos, value = spec
        arr = getattr(batch, field).copy()
        arr[pos] = value
        batch = dataclasses.replace(batch, **{field: arr})
    fast = make(config)
    fast.load_state_dict(state)
    with np.errstate(all="ignore"):
        want = ref.step(batch)
    got = fast.step(batch)
    assert sentinels.format_flags(fast.flags) == sentinels.format_flags(ref.flags)
    assert np.array_equal(fast.flags, ref.flags)
    assert got.flags == want.flags and any(want.flags)
    for f in SCALAR_FIELDS:
        assert np.isnan(getattr(got, f)) == np.isnan(getattr(want, f)), f
    assert np.array_equal(np.isnan(fast.last_td_errors()), np.isnan(ref.last_td_errors()))
    sw, sg = ref.state_dict(), fast.state_dict()
    for key in sw:
        if sw[key].dtype.kind == "f":
            assert np.array_equal(np.isnan(sw[key]), np.isnan(sg[key])), key


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_deferred_readback_sequence_matches_the_reference(backend, precision):
    """120 steps at readback_interval 50, a NaN reward at step 100 (a readback: the next step
    reads fresh), then end_epoch: the same (step, read_at, fresh) sequence, flags and
    finiteness of every scalar as the reference run on the same batches (the values
    themselves diverge with the trajectories: one step at a time is compared in
    conformance)."""
    name, make = backend
    config = DQNConfig.preset("tiny", precision=precision, readback_interval=50)
    ref = RefTrainer(config, seed=9)
    fast = make(config, seed=9)
    rng = np.random.default_rng(9)
    fresh_steps = []
    for step in range(1, 121):
        batch = Batch.random(config, rng)
        if step == 100:
            r = batch.r.copy()
            r[3] = np.nan
            batch = dataclasses.replace(batch, r=r)
        with np.errstate(all="ignore"):
            want = ref.step(batch)
        got = fast.step(batch)
        assert (got.step, got.read_at, got.fresh) == (want.step, want.read_at, want.fresh), step
        assert got.flags == want.flags, step
        for f in SCALAR_FIELDS:
            assert np.isfinite(getattr(got, f)) == np.isfinite(getattr(want, f)), (step, f)
        if got.fresh:
            fresh_steps.append(step)
    assert fresh_steps == [50, 100, 101]
    want, got = ref.end_epoch(), fast.end_epoch()
    assert (got.step, got.read_at, got.fresh) == (want.step, want.read_at, want.fresh) == (120, 120, True)


@pytest.mark.parametrize("source", ["core", "all"])
def test_checkpoints_interchange_both_ways(backend, tmp_path, source):
    name, make = backend
    config = DQNConfig.preset("tiny", precision="bf16", readback_interval=1, **SOURCES[source])
    fast = make(config, seed=4)
    rng = np.random.default_rng(4)
    for _ in range(3):
        fast.step(Batch.random(config, rng))
    fast.save(tmp_path / "fast.safetensors")
    ref = RefTrainer.load(tmp_path / "fast.safetensors")
    want = fast.state_dict()
    got = ref.state_dict()
    for key in want:
        assert np.array_equal(want[key].view(np.uint8), got[key].view(np.uint8)), key
    with np.errstate(all="ignore"):
        ref.step(Batch.random(config, rng))
    ref.save(tmp_path / "ref.safetensors")
    back = type(fast).load(tmp_path / "ref.safetensors")
    try:
        want, got = ref.state_dict(), back.state_dict()
        for key in want:
            assert np.array_equal(want[key].view(np.uint8), got[key].view(np.uint8)), key
        assert back.step_count == ref.step_count == 4
    finally:
        back.close()


@pytest.mark.parametrize("source", ["core", "all"])
def test_fold_boundary_matches_the_reference_exactly(backend, source):
    name, make = backend
    config = DQNConfig.preset("tiny", precision="f32", readback_interval=1, **SOURCES[source])
    ref, rng = _warm_reference(config, seed=6)
    state = ref.state_dict()
    isv = state["isv"].copy()
    isv[isv_mod.GRAD_NORM_SLOW_EMA_INDEX] = 3.5  # CrossFold: kept
    isv[isv_mod.Q_ABS_REF_INDEX] = 7.0
    state["isv"] = isv
    flags = np.zeros_like(state["flags"])
    flags[sentinels.index("h2")] = 1
    state["flags"] = flags
    ref.load_state_dict(state)
    fast = make(config)
    fast.load_state_dict(state)
    ref.fold_boundary()
    fast.fold_boundary()
    want, got = ref.state_dict(), fast.state_dict()
    for key in want:
        assert np.array_equal(want[key].view(np.uint8), got[key].view(np.uint8)), key
    assert not got["flags"].any() and got["adam_t"][0] == 0
    assert np.array_equal(got["target"], got["params"])


def test_fold_boundary_resets_gamma_and_cql_alpha_to_the_configured_values(backend):
    """The per-branch gamma and CQL-alpha slots are FoldReset with this config's cold starts
    (``isv.config_cold_starts``), not the registry's 0.99 and 1.0 (a bug until 2026-12)."""
    name, make = backend
    gammas, alpha = (0.95, 0.9), 0.25  # tiny has two branches
    config = DQNConfig.preset("tiny", precision="f32", gamma=gammas, cql_alpha=alpha)
    ref, fast = RefTrainer(config, seed=2), make(config, seed=2)
    for trainer in (ref, fast):
        isv = trainer.state_dict()["isv"]
        state = trainer.state_dict()
        isv[list(isv_mod.GAMMA_INDICES[:2])] = 0.5  # anything a fold reset must undo
        isv[isv_mod.CQL_ALPHA_INDEX] = 9.0
        state["isv"] = isv
        trainer.load_state_dict(state)
        trainer.fold_boundary()
        got = trainer.state_dict()["isv"]
        assert [got[i] for i in isv_mod.GAMMA_INDICES[:2]] == [np.float32(g) for g in gammas]
        assert got[isv_mod.CQL_ALPHA_INDEX] == np.float32(alpha)
    assert np.array_equal(ref.state_dict()["isv"].view(np.uint32), fast.state_dict()["isv"].view(np.uint32))


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_q_values_and_td_errors_match_the_reference(backend, precision):
    """Greedy Q values before and after a step, and the step's TD errors, within the step
    comparison's forward-only bounds, on the conditioned shared case (``step_harness``)."""
    name, make = backend
    case = shared_case("tiny", precision, "warm")
    config = case.config
    ref = RefTrainer(config)
    ref.load_state_dict(case.fresh_state())
    fast = make(config)
    fast.load_state_dict(case.fresh_state())
    with pytest.raises(RuntimeError, match="no step"):
        fast.last_td_errors()
    states = case.batch.s[:7].copy()
    _assert_q_close(config, ref.q_values(states), fast.q_values(states))
    with pytest.raises(ValueError, match="states"):
        fast.q_values(states[:, :3])
    with np.errstate(all="ignore"):
        ref.step(case.batch)
    fast.step(case.batch)
    want, got = ref.last_td_errors(), fast.last_td_errors()
    log_na = np.log(config.num_atoms)
    assert got.shape == (config.batch_size,)
    assert np.all(np.abs(got.astype(np.float64) - want) <= fwd_eps(config) * (np.abs(want) + log_na))
    # The q_values graph of 7 rows is replayed: it reads the weights after the step and the new
    # states (float64 input is cast), and earlier results are copies, not the pinned output.
    before = fast.q_values(states)
    kept = [q.copy() for q in before]
    _assert_q_close(config, ref.q_values(states), before)
    other = case.batch.s[7:14].astype(np.float64)
    _assert_q_close(config, ref.q_values(other.astype(np.float32)), fast.q_values(other))
    for q, k in zip(before, kept):
        assert np.array_equal(q, k)
    _assert_q_close(config, ref.q_values(states[:1]), fast.q_values(states[:1]))


def test_q_values_keeps_a_bounded_cache_of_graphs(backend):
    """One graph per row count, at most EVAL_CACHE_SIZE of them (least recently used evicted);
    an evicted size is rebuilt on its next call and still gives the reference's values."""
    from foxhunt.fast import trainer as fast_trainer

    name, make = backend
    case = shared_case("tiny", "f32", "warm")
    config = case.config
    ref = RefTrainer(config)
    ref.load_state_dict(case.fresh_state())
    fast = make(config)
    fast.load_state_dict(case.fresh_state())
    size = fast_trainer.EVAL_CACHE_SIZE
    states = case.batch.s[:size + 3].copy()
    for rows in range(1, size + 3):
        fast.q_values(states[:rows])
        fast.q_values(states[:1])  # 1 row stays the most recently used
    assert sorted(fast._eval_cache) == [1, *range(4, size + 3)]  # 1 and the 7 latest
    for rows in (2, size + 2, 1):  # rebuilt after its eviction, kept, kept
        _assert_q_close(config, ref.q_values(states[:rows]), fast.q_values(states[:rows]))
    assert len(fast._eval_cache) == size and list(fast._eval_cache)[-3:] == [2, size + 2, 1]


def test_step_rejects_an_invalid_batch(backend):
    name, make = backend
    config = DQNConfig.preset("tiny", precision="f32")
    fast = make(config)
    batch = Batch.random(config, np.random.default_rng(0))
    bad = dataclasses.replace(batch, a=np.full_like(batch.a, 7))
    with pytest.raises(ValueError, match="batch.a"):
        fast.step(bad)
    assert fast.step_count == 0


def test_graph_node_counts_are_reported(backend):
    name, make = backend
    for precision in ("f32", "bf16"):
        for preset in ("tiny", "seed"):
            fast = make(DQNConfig.preset(preset, precision=precision))
            up, g1, g2 = fast.graph_node_counts
            assert fast.node_count == up + g1 + g2 > 0
            # the upload graph: the batch copy, and on the GPU its uploaded[slot] record node
            assert fast.planned_launches[0] == 1 and up == 1 + (name == "gpu")
            # cuBLASLt may launch more than one kernel per GEMM; never fewer nodes than planned
            assert g1 >= fast.planned_launches[1] and g2 >= fast.planned_launches[2]
            print(f"[{name} {preset} {precision}] graph nodes {up} + {g1} + {g2} = {fast.node_count} "
                  f"(planned launches {fast.planned_launches}); GEMM fallbacks: "
                  f"{list(fast.gemm_fallbacks) or 'none'}")


@pytest.mark.gpu
@pytest.mark.skipif(not _GPU_OK, reason=f"no CUDA device/driver: {_GPU_REASON}")
def test_step_graph_records_graph1_done_after_graph1_beside_graph2():
    """Graphs 1 and 2 are one step graph; its one event record node records the engine's
    ``graph1_done`` (the upload stream's wait) after every node of graph 1, and nothing waits
    for it (graph 2 starts without it)."""
    from cuda.bindings import driver as drv

    from foxhunt.fast.device import call
    from foxhunt.fast.graphs import graph_edges, graph_nodes
    from foxhunt.fast.trainer import Trainer

    fast = Trainer(DQNConfig.preset("tiny"))
    try:
        engine = fast._engine
        graph = engine._step_graph.graph
        record = drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_EVENT_RECORD
        records = [n for n in graph_nodes(graph) if call(drv.cuGraphNodeGetType, n) == record]
        assert len(records) == 1
        node = int(records[0])
        assert int(call(drv.cuGraphEventRecordNodeGetEvent, records[0])) == int(engine._graph1_done)
        edges = [(int(a), int(b)) for a, b in graph_edges(graph)]
        assert [b for a, b in edges if a == node] == []
        ancestors, todo = set(), [node]
        while todo:
            current = todo.pop()
            for a, b in edges:
                if b == current and a not in ancestors:
                    ancestors.add(a)
                    todo.append(a)
        _, g1, g2 = fast.graph_node_counts
        assert len(ancestors) == g1 - 1 and g2 >= fast.planned_launches[2]
    finally:
        fast.close()


@pytest.mark.gpu
@pytest.mark.skipif(not _GPU_OK, reason=f"no CUDA device/driver: {_GPU_REASON}")
@pytest.mark.parametrize("precision", ["f32", "bf16"])
@pytest.mark.parametrize("switch", ["SPLIT_STEP_GRAPH", "PRIORITY_BY_GRAPH", "GRAPH2_EARLY_LAUNCH"])
def test_each_step_graph_switch_steps_bitwise_as_without_it(monkeypatch, switch, precision):
    """``step_program.SPLIT_STEP_GRAPH`` with the precision in it captures graph 2 as a graph of
    its own (graph 1's graph keeps the ``graph1_done`` record and nothing of graph 2), with the
    same node counts; ``PRIORITY_BY_GRAPH`` keeps one step graph whose launch priorities are
    ranked in two groups, graph 1's nodes (with the record) and graph 2's;
    ``GRAPH2_EARLY_LAUNCH`` launches graph 2's kernels early or not. Each way three steps end in
    the same bits as with the switch's precision set empty."""
    from foxhunt.fast import step_program
    from foxhunt.fast.trainer import Trainer

    config = DQNConfig.preset("tiny", precision=precision)
    states, counts = {}, {}
    for on in (False, True):
        monkeypatch.setattr(step_program, switch, frozenset({precision}) if on else frozenset())
        fast = Trainer(config, seed=3)
        try:
            counts[on] = fast.graph_node_counts
            engine = fast._engine
            groups = [len(g) for g in engine._step_graph.priority_groups]
            if not on or switch == "GRAPH2_EARLY_LAUNCH":
                assert engine._graph2 is None and groups == []
            elif switch == "SPLIT_STEP_GRAPH":
                assert engine._graph2.node_count == counts[on][2]
                assert engine._step_graph.node_count == counts[on][1] and groups == []
            else:
                assert engine._graph2 is None and groups == list(counts[on][1:])
            for s in range(3):
                fast.step(Batch.random(config, np.random.default_rng(s)))
            states[on] = fast.state_dict()
        finally:
            fast.close()
    assert counts[True] == counts[False]
    differing = [k for k in states[False]
                 if np.asarray(states[False][k]).tobytes() != np.asarray(states[True][k]).tobytes()]
    assert differing == []


@pytest.mark.gpu
@pytest.mark.skipif(not _GPU_OK, reason=f"no CUDA device/driver: {_GPU_REASON}")
@pytest.mark.parametrize("workspace", ["default", "none"], ids=["workspace-default", "workspace-0"])
def test_graph_replay_timing(workspace):
    """Prints TIMING lines: the seed step's graph replays per step (the upload graph on its
    stream, then the step graph, as ``step`` enqueues them, without the host's batch writes),
    node counts and kinds, for both precisions. Asserts that the graphs timed are the whole
    step (their nodes add up to ``node_count``) and that every loop took time."""
    from cuda.bindings import driver as drv

    from foxhunt.fast.device import call
    from foxhunt.fast.trainer import Trainer

    for precision in ("bf16", "f32"):
        config = DQNConfig.preset("seed", precision=precision)
        fast = Trainer(config, gemm_workspace=workspace)
        try:
            rng = np.random.default_rng(0)
            for _ in range(3):
                fast.step(Batch.random(config, rng))
            engine = fast._engine
            stream = engine.stream
            up, step = engine._upload[0], engine._step_graph
            start, end = call(drv.cuEventCreate, 0), call(drv.cuEventCreate, 0)
            times = []
            for _ in range(5):
                call(drv.cuEventRecord, start, stream.handle)
                for i in range(200):
                    engine.launch(i % 2)
                call(drv.cuEventRecord, end, stream.handle)
                call(drv.cuEventSynchronize, end)
                times.append(call(drv.cuEventElapsedTime, start, end) * 1e3 / 200)
            drv.cuEventDestroy(start)
            drv.cuEventDestroy(end)
            graphs = [up, step] + ([engine._graph2] if engine._graph2 is not None else [])
            kinds = sum((g.node_types() for g in graphs[1:]), up.node_types())
            print(f"TIMING seed {precision} workspace={workspace}: {np.median(times):.1f} us/step "
                  f"(graph replays, median of 5x200; min {min(times):.1f}), nodes "
                  f"{' + '.join(str(g.node_count) for g in graphs)} = {fast.node_count} "
                  f"{dict(kinds)}, "
                  f"fallbacks {list(fast.gemm_fallbacks) or 'none'}")
            assert sum(g.node_count for g in graphs) == fast.node_count == sum(kinds.values())
            assert min(times) > 0 and np.isfinite(max(times))
        finally:
            fast.close()


@pytest.mark.parametrize("split", [False, True], ids=["one-step-graph", "split"])
def test_step_orders_the_upload_by_device_events(monkeypatch, split):
    """``GpuEngine.launch`` enqueues, in this order: the upload stream waits for the last
    graph 1 (the last reader of the batch: ``graph1_done``, which the step graph records), the
    upload graph of the step's staging slot (which records ``uploaded[slot]`` itself, its last
    node: no record call), the step stream waits for it, the step graph (graphs 1 and 2; split:
    graph 1's graph, then graph 2's):
    device-side ordering only (no host sync; ``tests/test_upload_events.py`` checks the
    record node's semantics on the GPU). A staging buffer is handed out again only after its
    upload's event (a stand-in driver records the calls; the engine's state is what its
    constructor makes)."""
    from foxhunt.fast import device as fdev
    from foxhunt.fast.gpu_engine import GpuEngine

    log = []
    driver = types.SimpleNamespace(
        cuStreamWaitEvent=lambda stream, event, flags: log.append(("wait", stream, event)),
        cuEventRecord=lambda event, stream: log.append(("record", event, stream)),
        cuEventSynchronize=lambda event: log.append(("sync", event)))
    monkeypatch.setattr(fdev, "_driver", lambda: driver)
    monkeypatch.setattr(fdev, "call", lambda fn, *args: fn(*args))

    class Graph:
        def __init__(self, name):
            self.name = name

        def replay(self, stream=None):
            log.append((self.name, stream))

    engine = GpuEngine.__new__(GpuEngine)
    engine._upload_stream = types.SimpleNamespace(handle="up")
    engine.stream = types.SimpleNamespace(handle="main")
    engine._upload = [Graph("upload0"), Graph("upload1")]
    engine._step_graph = Graph("step")
    engine._graph2 = Graph("graph2") if split else None
    engine._uploaded, engine._graph1_done = ["uploaded0", "uploaded1"], "graph1_done"
    engine._event_used = [False, False]
    engine._staging_views = [{"slot": 0}, {"slot": 1}]
    for slot in (0, 1):
        log.clear()
        assert engine.staging(slot) == {"slot": slot} and log == []  # not used yet: no wait
        engine.launch(slot)
        assert log == [("wait", "up", "graph1_done"), (f"upload{slot}", "up"),
                       ("wait", "main", f"uploaded{slot}"), ("step", None)] + (
                           [("graph2", None)] if split else [])
    log.clear()
    assert engine.staging(0) == {"slot": 0} and log == [("sync", "uploaded0")]
    engine.forget_uploads()
    log.clear()
    engine.staging(1)
    assert log == []
