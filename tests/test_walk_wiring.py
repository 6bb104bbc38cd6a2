"""``DeviceEvaluator(mode="fused")``: the greedy walk of a segment in one ``greedy_walk`` launch
(``fast.eval_plan.fused_ops``), run by the CPU executor (the kernel's reference twin), against
the chunk graphs of ``mode="graph"`` on real fold segments. The two forwards sum in different
orders (lane-strided dot products against GEMMs), so their actions agree up to the first near
tie (``walk.first_near_tie`` of the margins, computed here by the reference walk on the
trainer's live parameters); before it, every per-bar reward is equal. With ``adaptive_atoms``
the walk reads the live per-branch support built from the trainer's current ISV (``z_e``,
``z_stride = NA``)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from foxhunt.conformance.specs.walk import branch_supports
from foxhunt.fast import device as fast_device
from foxhunt.fast.cpu_executor import CpuTrainer
from foxhunt.fast.eval_plan import POLICIES, walk_tensor_sizes
from foxhunt.fast.evaluator import DeviceEvaluator
from foxhunt.reference import loop
from foxhunt.reference.batch import Batch
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.env import ExecutionCosts
from foxhunt.reference.isv import H_S2_RMS_EMA_INDEX
from foxhunt.reference.kernels import env as env_kernels
from foxhunt.reference.kernels import walk
from foxhunt.reference.layout import ParamLayout
from foxhunt.reference.market import SyntheticMarket, feature_warmup, market_features
from foxhunt.reference.metrics import bar_seconds, bars_per_year
from foxhunt.reference.step import step_supports, support

CHUNK = 16
#: The config switches of the live per-branch support (``adaptive_atoms`` needs ``q_stats``).
ADAPTIVE = {"q_stats": True, "adaptive_atoms": True}
#: The fixed support (the ``seed`` preset turns the adaptive atoms on).
FIXED = {"adaptive_atoms": False}


def _setup(precision: str, seed: int, preset: str = "tiny", trainer_class=CpuTrainer,
           **changes):
    """A trainer of ``preset`` (with ``changes``; the CPU executor's, or on a GPU
    ``fast.Trainer``) stepped a few times (its greedy policy trades), the run's bars and its
    two folds' validation and test segments, and a graph-mode and a fused-mode evaluator."""
    config = DQNConfig.preset(preset, precision=precision, **changes)
    trainer = trainer_class(config, seed=seed)
    gen = np.random.default_rng(seed)
    for _ in range(3):
        trainer.step(Batch.random(config, gen))
    bars = SyntheticMarket(4, 1200).generate()
    windows = loop.choose_windows(config.state_dim)
    feats = market_features(bars, windows)
    folds = loop.fold_segments(len(bars), feature_warmup(windows), 2, 0.125, 0.125)
    segments = [getattr(seg, name) for seg in folds for name in loop.EVAL_SEGMENTS]
    tables = env_kernels.market_tables(bars, feats)
    steps = max(120, *(stop - start - 1 for start, stop in segments))
    graph = DeviceEvaluator(trainer, tables, max_steps=steps, chunk=CHUNK)
    fused = DeviceEvaluator(trainer, tables, max_steps=steps, chunk=CHUNK, mode="fused")
    per_year = bars_per_year(bar_seconds(bars.timestamp))
    return config, trainer, tables, segments, per_year, graph, fused


@pytest.fixture(scope="module", params=[("f32", False), ("bf16", False), ("f32", True),
                                        ("bf16", True)],
                ids=["f32", "bf16", "f32-live", "bf16-live"])
def run_setup(request):
    """``_setup`` on the fixed support, and on the live per-branch one (``-live``)."""
    precision, live = request.param
    setup = _setup(precision, seed=3, **(ADAPTIVE if live else {}))
    yield setup
    for ev in setup[-2:]:
        ev.close()


@pytest.fixture(scope="module")
def walks(run_setup):
    """``walks(kind, start, stop)``: on ``run_setup``'s trainer (never stepped by the tests that
    share it), the fused walk of the segment with ``equity`` (``kind="fused"``) or the reference
    walk with its arguments (``kind="reference"``: ``(walk, args)``), each computed once for
    every test of the setup that compares it (a fused walk of the four segments costs the CPU
    executor several seconds)."""
    config, trainer, tables, _, per_year, _, fused = run_setup
    done = {}

    def get(kind, start, stop):
        if (kind, start, stop) not in done:
            if kind == "fused":
                done[kind, start, stop] = fused.walk(start, stop, per_year, equity=True)
            elif kind == "reference":
                args = _walk_args(config, trainer, tables, start, stop)
                done[kind, start, stop] = walk.greedy_walk(**args), args
            else:
                raise ValueError(kind)
        return done[kind, start, stop]

    return get


def _support(config, isv) -> dict:
    """The walk's support on ``isv``: the live per-branch one (``reference.step.step_supports``
    of ``adaptive_atoms``, ``z [nb, NA]``, ``z_stride = NA``), else the fixed one (stride 0)."""
    if config.adaptive_atoms:
        return dict(z=step_supports(config, isv).z, z_stride=config.num_atoms)
    return dict(z=support(config), z_stride=0)


def _walk_args(config, trainer, tables, start, stop) -> dict:
    """``greedy_walk``'s arguments: the trainer's live online parameters and ISV (and the
    support of that ISV), the tables."""
    arena = trainer.engine.arena
    isv = arena.download("isv")
    return dict(
        params=arena.download("params2")[0],
        param_offsets=walk.walk_offsets(ParamLayout(config), config.n_branches),
        dims=walk.walk_dims(config), branches=config.branches, bf16=config.precision == "bf16",
        **_support(config, isv), isv=isv, isv_index=H_S2_RMS_EMA_INDEX,
        h2_clamp_mult=config.h2_clamp_mult, close=tables.close, high=tables.high, low=tables.low,
        features=tables.features, costs=env_kernels.cost_table(ExecutionCosts()), start=start,
        n_steps=stop - start - 1)


def _kernel_args(config, trainer, tables, start, stop, per_branch: bool) -> dict:
    """``_walk_args``; with ``per_branch`` on the distinct supports of the conformance ``odd``
    case (``branch_supports``, ``z_stride = NA``) in place of the trainer's."""
    args = _walk_args(config, trainer, tables, start, stop)
    if per_branch:
        args.update(z=branch_supports(config), z_stride=config.num_atoms)
    return args


def _cut(config, trainer, tables, start, stop) -> int:
    """The first near tie of the reference walk on the trainer's live online parameters and
    ISV (its margins against its support's Q bound)."""
    args = _walk_args(config, trainer, tables, start, stop)
    return _near_tie(walk.greedy_walk(**args), args)


def _near_tie(reference, args) -> int:
    """The first near tie of the reference walk ``reference`` made with ``args``."""
    return walk.first_near_tie(reference.margins, args["z"], args["bf16"])


def test_fused_walk_equals_the_graph_walk_up_to_the_first_near_tie(run_setup, walks):
    _fused_equals_graph(run_setup, walks)


def _fused_equals_graph(setup, walks) -> None:
    config, trainer, tables, segments, per_year, graph, fused = setup
    compared = 0
    for start, stop in segments:
        n = stop - start - 1
        want = graph.walk(start, stop, per_year, equity=True)
        got = walks("fused", start, stop)
        cut = _near_tie(*walks("reference", start, stop))
        assert np.array_equal(got.rewards[:cut], want.rewards[:cut])
        if cut == n:  # the same records: the same metrics, bit for bit
            assert got.metrics.tolist() == want.metrics.tolist()
        compared += cut
        assert np.count_nonzero(want.rewards[:cut]) > 0  # the prefix compared is not flat
    assert compared >= len(segments) * 20


def test_fused_baselines_are_the_graph_baselines(run_setup):
    """The fused mode walks only the greedy policy in one launch; the baselines keep the chunk
    graphs (the same numbers as in graph mode)."""
    *_, segments, per_year, graph, fused = run_setup
    start, stop = segments[0]
    for policy in POLICIES[1:]:
        got = fused.walk(start, stop, per_year, policy=policy, equity=True)
        want = graph.walk(start, stop, per_year, policy=policy, equity=True)
        assert got.metrics.tolist() == want.metrics.tolist()
        assert np.array_equal(got.rewards, want.rewards)


def test_fused_greedy_walk_is_one_graph_and_one_synchronisation(run_setup):
    """The fused plan: the two copies in, ``SPAN_PASSES`` launches of ``greedy_walk_spans`` on
    ``SPAN_CHUNKS`` clusters (``pass_index`` 0 .. ``SPAN_PASSES - 1``: no tail), then
    ``SPAN_ROUNDS`` launches of ``greedy_walk_round`` on ``SPAN_CHUNKS`` clusters (``round`` 0
    .. ``SPAN_ROUNDS - 1``) on the spans' buffers, whatever the segment's length; no greedy
    chunk graph is ever built; one synchronisation per segment. The CPU plan is built for sm_90
    (``cpu_executor.CPU_ARCH``), where the tiny network fits a cluster (16 rows a pass). With
    ``adaptive_atoms`` one ``live_support_build`` from the ISV into ``z_e`` comes first, and the
    walks read ``z_e`` with ``z_stride = NA``; else the fixed ``z`` with 0."""
    from foxhunt.fast.kernels.walk import SPAN_CHUNKS, SPAN_PASSES, SPAN_ROUNDS

    config, *_, segments, per_year, _, fused = run_setup
    live = ["live_support_build"] if config.adaptive_atoms else []
    for start, stop in segments:
        before = fast_device.SYNCS.count
        fused.walk(start, stop, per_year)
        assert fast_device.SYNCS.count - before == 1
    (graph,) = fused._device._plans["fused"]
    launches = [node for node in graph.nodes if getattr(node, "kernel", None)]
    assert SPAN_ROUNDS == SPAN_CHUNKS  # as many rounds as chunks: exact for every policy
    assert [node.kernel for node in launches] == (live + ["greedy_walk_spans"] * SPAN_PASSES
                                                  + ["greedy_walk_round"] * SPAN_ROUNDS)
    if live:
        build = launches.pop(0)
        assert (str(build.args["isv"]), str(build.args["z"])) == ("isv", "z_e")
    support = ("z_e", config.num_atoms) if live else ("z", 0)
    assert {(str(node.args["z"]), node.args["z_stride"]) for node in launches} == {support}
    spans, rounds = launches[:SPAN_PASSES], launches[SPAN_PASSES:]
    assert [node.args["pass_index"] for node in spans] == list(range(SPAN_PASSES))
    assert {node.args["hold_rows"] for node in spans} == {16}
    assert [node.args["round"] for node in rounds] == list(range(SPAN_ROUNDS))
    assert {(node.args["n_chunks"], node.args["span_chunks"], node.args["span_passes"],
             str(node.args["span_state"]), str(node.args["span_brk"])) for node in rounds} == {
        (SPAN_CHUNKS, SPAN_CHUNKS, SPAN_PASSES, "walk_span_state", "walk_span_brk")}
    assert {(str(node.args["state"]), str(node.args["brk"])) for node in spans} == {
        ("walk_span_state", "walk_span_brk")}
    assert [node.shape.grid[0] for node in launches] == [8 * SPAN_CHUNKS] * len(launches)
    assert fused._device.node_count("fused") == 2 + len(live) + SPAN_PASSES + SPAN_ROUNDS
    assert ("chunk", "greedy") not in fused._device._plans


def test_cpu_fused_walk_is_the_reference_walk_bit_for_bit(run_setup, walks):
    """On the CPU executor the fused plan's launches (the span passes, then the rounds on
    their base: the per-launch twins) record ``walk.greedy_walk``'s rewards on the trainer's
    live parameters, bit for bit, on every segment; the policy trades more often than there
    are span passes on some segment, so the rounds walk steps there (each pass commits one
    break)."""
    from foxhunt.fast.kernels.walk import SPAN_PASSES

    segments = run_setup[3]
    most = 0
    for start, stop in segments:
        want, _ = walks("reference", start, stop)
        got = walks("fused", start, stop)
        assert got.rewards.tobytes() == want.rewards.tobytes()
        most = max(most, int(np.count_nonzero(np.diff(want.positions))))
    assert most > SPAN_PASSES


def test_the_fused_walk_reads_the_live_support_of_the_trainer_s_current_isv():
    """With ``adaptive_atoms`` the support the fused walk read (``z_e``, built in its graph) is
    ``live_support_build`` of the trainer's ISV at the walk, bit for bit, after every round of
    steps; the step's own ``z_live`` (built from the ISV at the last step's start) is not."""
    config, trainer, tables, segments, per_year, graph, fused = _setup("f32", seed=5, **ADAPTIVE)
    start, stop = segments[0]
    gen = np.random.default_rng(2)
    for _ in range(2):
        for _ in range(2):
            trainer.step(Batch.random(config, gen))
        fused.walk(start, stop, per_year)
        isv = trainer.engine.arena.download("isv")
        read = fused._device.arenas[1].download("z_e")
        assert read.tobytes() == step_supports(config, isv).z.tobytes()
        assert read.tobytes() != trainer.engine.arena.download("z_live").tobytes()
    graph.close()
    fused.close()


def test_walk_tensor_sizes_are_the_parameter_layout_s():
    """The twin's extent of ``params``: each tensor's size as ``ParamLayout`` sizes it."""
    config = DQNConfig.preset("tiny")
    lay = ParamLayout(config)
    names = walk.walk_tensors(config.n_branches)
    want = tuple(int(np.prod(lay[name].shape)) for name in names)
    assert walk_tensor_sizes(walk.walk_dims(config), config.branches) == want


def test_the_fused_walk_reads_the_trainer_s_live_parameters():
    """Stepping the trainer between two fused walks changes the policy the next walk follows:
    it equals the graph walk of the stepped trainer up to the first near tie."""
    config, trainer, tables, segments, per_year, graph, fused = _setup("f32", seed=5)
    start, stop = segments[0]
    gen = np.random.default_rng(1)
    seen = []
    for _ in range(3):
        got = fused.walk(start, stop, per_year, equity=True).rewards
        want = graph.walk(start, stop, per_year, equity=True).rewards
        cut = _cut(config, trainer, tables, start, stop)
        assert cut > 0 and np.array_equal(got[:cut], want[:cut])
        seen.append(got)
        for _ in range(4):
            trainer.step(Batch.random(config, gen))
    assert not all(np.array_equal(seen[0], s) for s in seen[1:])  # the policy did change
    graph.close()
    fused.close()


def test_the_evaluator_refuses_an_unknown_mode(run_setup):
    _, trainer, tables, *_ = run_setup
    with pytest.raises(ValueError, match=re.escape(
            "mode='cluster': allowed values are 'graph', 'fused'")):
        DeviceEvaluator(trainer, tables, max_steps=10, mode="cluster")


_GPU, _WHY = fast_device.cuda_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _GPU, reason=f"no CUDA device/driver: {_WHY}")
@pytest.mark.parametrize("live", [False, True], ids=["fixed", "live"])
@pytest.mark.parametrize("precision", ["bf16", "f32"])
def test_gpu_fused_walk_of_the_seed_network_is_the_one_block_kernel_s(precision, live):
    """On the GPU, the seed network: the fused plan captures the kernel ``plan_walk`` picks for
    the device (``greedy_walk_cluster`` from sm_90, over 48 KiB of shared memory per block: the
    graph lowering's opt-in), and its per-bar rewards are the one-block ``greedy_walk`` test
    entry's on the trainer's live parameters, bit for bit, on every bar (no near-tie cut: the
    two kernels sum in the same order; a freshly stepped seed network's margins are too small
    for a comparison with the chunk graphs to reach past a few bars). ``live``: with
    ``adaptive_atoms``, the plan's ``live_support_build`` first, the one-block entry on the live
    support of the trainer's ISV (``z_stride = NA``)."""
    from foxhunt.fast import Trainer
    from foxhunt.fast.kernels.walk import SPAN_PASSES, SPAN_ROUNDS, WALK_KERNELS
    from foxhunt.fast.kernels.walk import greedy_walk as one_block

    config, trainer, tables, segments, per_year, graph, fused = _setup(
        precision, seed=3, preset="seed", trainer_class=Trainer, **(ADAPTIVE if live else FIXED))
    try:
        traded = 0
        for start, stop in segments:
            got = fused.walk(start, stop, per_year, equity=True).rewards
            want = one_block(**_walk_args(config, trainer, tables, start, stop)).rewards
            assert got.tobytes() == want.tobytes()
            traded += np.count_nonzero(want)
        assert traded > 0
        packed = {node.kernel for *_, node in fused._device._lowering._packed.values()}
        walks = {*WALK_KERNELS, "greedy_walk_hold", "greedy_walk_spans", "greedy_walk_round"}
        if trainer.engine.device.compute_capability >= (9, 0):  # copies in, spans, rounds
            assert fused._device.node_count("fused") == 2 + live + SPAN_PASSES + SPAN_ROUNDS
            assert packed & walks == {"greedy_walk_spans", "greedy_walk_round"}
        else:  # two copies in, (the live support,) ONE walk kernel
            assert fused._device.node_count("fused") == 3 + live
            assert packed & walks == {"greedy_walk"}
    finally:
        graph.close()
        fused.close()
        trainer.close()


@pytest.mark.gpu
@pytest.mark.skipif(not _GPU, reason=f"no CUDA device/driver: {_WHY}")
@pytest.mark.parametrize("per_branch", [False, True], ids=["one-support", "per-branch"])
@pytest.mark.parametrize("precision", ["bf16", "f32"])
def test_gpu_walk_in_chunks_is_the_cluster_walk_bit_for_bit(precision, per_branch):
    """``greedy_walk_round``, ``n_chunks`` rounds over ``n_chunks`` chunks (the fast test entry
    ``greedy_walk_chunked``), records what ONE ``greedy_walk_cluster`` launch records, bit for bit
    (rewards, positions held, costs, margins), on the seed network's live parameters over real
    fold segments, for several chunk counts; and one round alone (every chunk from flat) differs
    from it where a chunk's true start holds a position, which the segments must show at least
    once (else the rounds after the first would be untested). ``per-branch``: on
    ``branch_supports`` (``z_stride = NA``)."""
    from foxhunt.fast import Trainer
    from foxhunt.fast.kernels.walk import greedy_walk_chunked, greedy_walk_cluster

    config, trainer, tables, segments, per_year, graph, fused = _setup(
        precision, seed=3, preset="seed", trainer_class=Trainer)
    try:
        repaired = 0
        for start, stop in segments:
            args = _kernel_args(config, trainer, tables, start, stop, per_branch)
            want = greedy_walk_cluster(**args)
            for n_chunks in (1, 3, 16):
                got = greedy_walk_chunked(**args, n_chunks=n_chunks, rounds=n_chunks)
                for name in want._fields:
                    assert getattr(got, name).tobytes() == getattr(want, name).tobytes(), \
                        (start, stop, n_chunks, name)
            first = greedy_walk_chunked(**args, n_chunks=16, rounds=1)
            repaired += first.positions.tobytes() != want.positions.tobytes()
        assert repaired > 0
    finally:
        graph.close()
        fused.close()
        trainer.close()


@pytest.mark.gpu
@pytest.mark.skipif(not _GPU, reason=f"no CUDA device/driver: {_WHY}")
@pytest.mark.parametrize("per_branch", [False, True], ids=["one-support", "per-branch"])
@pytest.mark.parametrize("precision", ["bf16", "f32"])
def test_gpu_hold_and_span_walks_are_the_cluster_walk_bit_for_bit(precision, per_branch):
    """``greedy_walk_hold``, ``greedy_walk_spans`` (its passes and tail) and
    ``greedy_walk_span_rounds`` (the span passes, then ``greedy_walk_round``'s rounds on their
    base, as the evaluator launches them) record what ``greedy_walk_cluster`` records, bit for
    bit (rewards, positions held, costs, margins), on the seed network's live parameters over
    real fold segments (a policy that trades: short held stretches) and on the same network
    made to buy and hold (the top atom of the exposure branch's long action raised: every step
    after the fill holds, whole passes of W rows; the rounds find no step left).
    ``per-branch``: on ``branch_supports`` (``z_stride = NA``)."""
    from foxhunt.fast import Trainer
    from foxhunt.fast.kernels.walk import (greedy_walk_cluster, greedy_walk_hold,
                                           greedy_walk_span_rounds, greedy_walk_spans)
    from foxhunt.reference.layout import branch_name

    config, trainer, tables, segments, per_year, graph, fused = _setup(
        precision, seed=3, preset="seed", trainer_class=Trainer)
    try:
        lay = ParamLayout(config)
        top = lay[f"b_{branch_name(0)}2"].offset + 3 * config.num_atoms - 1  # long, top atom
        trades = holds = 0
        for start, stop in segments:
            args = _kernel_args(config, trainer, tables, start, stop, per_branch)
            hold = dict(args, params=args["params"].copy())
            hold["params"][top] += 50.0
            for kwargs in (args, hold):
                want = greedy_walk_cluster(**kwargs)
                for kernel in (greedy_walk_hold, greedy_walk_spans, greedy_walk_span_rounds):
                    got = kernel(**kwargs)
                    for name in want._fields:
                        assert getattr(got, name).tobytes() == getattr(want, name).tobytes(), \
                            (kernel.__name__, start, stop, name)
            trades += np.count_nonzero(np.diff(greedy_walk_cluster(**args).positions))
            holds += np.mean(greedy_walk_cluster(**hold).positions == 1.0) > 0.9
        assert trades > 0 and holds == len(segments)
    finally:
        graph.close()
        fused.close()
        trainer.close()


def test_auto_mode_picks_the_cluster_walk_on_a_gpu_engine_only(monkeypatch):
    """``mode="auto"`` (the default): "fused" where the fused walk is ``greedy_walk_cluster``,
    with the fixed support or the live per-branch one; "graph" on the CPU executor (a CPU
    population's members included) and before sm_90."""
    import types

    from foxhunt.fast import evaluator as ev
    from foxhunt.fast import eval_plan
    from foxhunt.fast.cpu_executor import CpuTrainer
    from foxhunt.reference.config import DQNConfig

    cpu = CpuTrainer(DQNConfig.preset("tiny"))
    assert ev.auto_mode(cpu) == "graph"
    # A GPU engine has a device (``evaluator.on_cpu``); a CPU population member's view has none.
    gpu_like = types.SimpleNamespace(config=cpu.config,
                                     engine=types.SimpleNamespace(program=None, device="H200"))
    from foxhunt.fast.population import CpuPopulation

    assert ev.auto_mode(CpuPopulation(DQNConfig.preset("tiny"), [0, 1]).member(1)) == "graph"
    for kernel, want in (("greedy_walk_cluster", "fused"), ("greedy_walk", "graph")):
        monkeypatch.setattr(eval_plan, "fused_walk_kernel", lambda prog, k=kernel: k)
        assert ev.auto_mode(gpu_like) == want
    monkeypatch.setattr(eval_plan, "fused_walk_kernel", lambda prog: "greedy_walk_cluster")
    adaptive = types.SimpleNamespace(config=types.SimpleNamespace(adaptive_atoms=True),
                                     engine=gpu_like.engine)
    assert ev.auto_mode(adaptive) == "fused"
    assert ev.auto_mode(CpuTrainer(DQNConfig.preset("tiny", **ADAPTIVE))) == "graph"
