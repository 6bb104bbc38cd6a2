"""Greedy evaluation on the device (issue 20): the walk's plan (``fast.eval_plan``) run by the
CPU executor through ``fast.evaluator.DeviceEvaluator`` against the reference walk
(``loop.evaluate`` / ``loop.evaluate_segment``: the host environment stepped bar by bar with
one ``q_values`` call per bar) on real fold segments, and the training loop's fast path with
it (records, timings, synchronisations)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from foxhunt.fast import device as fast_device
from foxhunt.fast.cpu_executor import CpuTrainer
from foxhunt.fast.eval_plan import POLICIES
from foxhunt.fast.evaluator import DeviceEvaluator
from foxhunt.reference import evaluator as evaluator_mod
from foxhunt.reference import loop
from foxhunt.reference.batch import Batch
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.kernels import env as env_kernels
from foxhunt.reference.market import SyntheticMarket, feature_warmup, market_features
from foxhunt.reference.metrics import METRIC_NAMES, bar_seconds, bars_per_year

#: Bars per chunk graph in these tests: no segment below is a multiple of it (a partial chunk
#: walks past every segment's end).
CHUNK = 16


@pytest.fixture(scope="module")
def run_setup():
    """A tiny trainer stepped a few times (its greedy policy trades), the run's bars and its
    two folds' validation and test segments; the last test segment ends at the last bar."""
    config = DQNConfig.preset("tiny")
    trainer = CpuTrainer(config, seed=3)
    gen = np.random.default_rng(0)
    for _ in range(3):
        trainer.step(Batch.random(config, gen))
    bars = SyntheticMarket(4, 1200).generate()
    windows = loop.choose_windows(config.state_dim)
    feats = market_features(bars, windows)
    segments = loop.fold_segments(len(bars), feature_warmup(windows), 2, 0.125, 0.125)
    per_year = bars_per_year(bar_seconds(bars.timestamp))
    evaluator = DeviceEvaluator(trainer, env_kernels.market_tables(bars, feats), max_steps=120,
                                chunk=CHUNK)
    yield config, trainer, bars, feats, segments, per_year, evaluator
    evaluator.close()


def _segments(segments):
    return [getattr(seg, name) for seg in segments for name in loop.EVAL_SEGMENTS]


def _as_f32(metrics) -> list:
    return [np.float32(getattr(metrics, m)) for m in METRIC_NAMES]


def _greedy_walk_matches_the_host(ev, trainer, bars, feats, config, start, stop, per_year):
    """``ev``'s greedy walk of ``[start, stop)`` against the host's: metrics bit for bit (float32
    of ``loop.evaluate_segment``'s), per-bar rewards equal to ``loop.evaluate``'s. Returns
    ``(got, want, curve)``."""
    got = ev.walk(start, stop, per_year, equity=True)
    want, curve = loop.evaluate_segment(trainer, bars, feats, config, (start, stop), "greedy",
                                        per_year)
    assert got.metrics.tolist() == _as_f32(want)
    walk = loop.evaluate(trainer, bars, feats, config.state_dim, config.branches, start, stop)
    assert np.array_equal(got.rewards.astype(np.float64), walk["rewards"])
    return got, want, curve


def test_device_walk_equals_the_reference_walk_on_every_segment(run_setup):
    """Metrics: ``loop.evaluate_segment``'s float64 values rounded to float32, bit for bit
    (the CPU twin of ``eval_metrics`` is the reference's); per-bar rewards: ``loop.evaluate``'s."""
    config, trainer, bars, feats, segments, per_year, ev = run_setup
    assert segments[-1].test[1] == len(bars)
    for start, stop in _segments(segments):
        assert (stop - start - 1) % CHUNK != 0
        got, want, curve = _greedy_walk_matches_the_host(ev, trainer, bars, feats, config, start,
                                                         stop, per_year)
        assert np.array_equal(np.cumprod(1.0 + got.rewards.astype(np.float64)), curve)
        assert want.turnover > 0  # the policy trades: the walk is not trivial


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "greedy"])
def test_device_baselines_equal_the_reference_baselines(run_setup, policy):
    config, _, bars, feats, segments, per_year, ev = run_setup
    for segment in _segments(segments):
        got = ev.walk(*segment, per_year, policy=policy)
        want, _ = loop.evaluate_segment(None, bars, feats, config, segment, policy, per_year)
        assert got.metrics.tolist() == _as_f32(want) and got.rewards is None


def test_one_synchronisation_per_segment_and_one_chunk_graph_per_policy(run_setup):
    """Counted through the device layer (``fast.device.SYNCS``): a whole segment, however many
    chunk launches it takes, synchronises once. The chunk graph holds ``CHUNK`` copies of one
    bar's records and is built once, whatever the segment."""
    _, _, _, _, segments, per_year, ev = run_setup
    for start, stop in _segments(segments):
        before = fast_device.SYNCS.count
        ev.walk(start, stop, per_year)
        assert fast_device.SYNCS.count - before == 1
    built = [key for key in ev._device._plans if key[0] == "chunk"]
    assert ("chunk", "greedy") in built and len(set(built)) == len(built)
    bar = ev._device._plans[("chunk", "greedy")]
    assert len(bar) == CHUNK and all(graph is bar[0] for graph in bar)
    assert ev.node_counts()["chunk"] == CHUNK * bar[0].node_count


def test_the_walk_reads_the_trainer_s_live_parameters():
    """Stepping the trainer between two walks changes the policy the next walk follows: it
    equals the reference walk of the stepped trainer (the graphs read the live arena)."""
    config = DQNConfig.preset("tiny")
    trainer = CpuTrainer(config, seed=5)
    bars = SyntheticMarket(7, 700).generate()
    feats = market_features(bars, loop.choose_windows(config.state_dim))
    per_year = bars_per_year(bar_seconds(bars.timestamp))
    segment = (500, 560)
    ev = DeviceEvaluator(trainer, env_kernels.market_tables(bars, feats), max_steps=60, chunk=8)
    gen = np.random.default_rng(1)
    seen = []
    for _ in range(3):
        got = ev.walk(*segment, per_year, equity=True).rewards
        want = loop.evaluate(trainer, bars, feats, config.state_dim, config.branches, *segment)
        assert np.array_equal(got.astype(np.float64), want["rewards"])
        seen.append(got)
        for _ in range(4):
            trainer.step(Batch.random(config, gen))
    assert not all(np.array_equal(seen[0], s) for s in seen[1:])  # the policy did change


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_adaptive_atoms_walk_equals_the_reference_walk(precision):
    """With ``adaptive_atoms`` (Q on the live per-branch support of the trainer's current ISV)
    the CPU executor's evaluator (``mode="auto"``: the chunk graphs there) gives the host
    walk's metrics rounded to float32 and its per-bar rewards, bit for bit, on every segment,
    after steps that moved the support away from its cold start."""
    from foxhunt.reference.step import step_supports

    config = DQNConfig.preset("tiny", precision=precision, q_stats=True, adaptive_atoms=True)
    trainer = CpuTrainer(config, seed=3)
    cold = step_supports(config, trainer.engine.arena.download("isv")).z
    gen = np.random.default_rng(0)
    for _ in range(3):
        trainer.step(Batch.random(config, gen))
    assert not np.array_equal(step_supports(config, trainer.engine.arena.download("isv")).z, cold)
    bars = SyntheticMarket(4, 1200).generate()
    feats = market_features(bars, loop.choose_windows(config.state_dim))
    segments = loop.fold_segments(len(bars), feature_warmup(loop.choose_windows(
        config.state_dim)), 2, 0.125, 0.125)
    per_year = bars_per_year(bar_seconds(bars.timestamp))
    ev = DeviceEvaluator(trainer, env_kernels.market_tables(bars, feats), max_steps=120,
                         chunk=CHUNK)
    assert ev.mode == "graph"
    traded = 0
    for start, stop in _segments(segments):
        _, want, _ = _greedy_walk_matches_the_host(ev, trainer, bars, feats, config, start, stop,
                                                   per_year)
        traded += want.turnover > 0
    assert traded > 0
    ev.close()


def test_bf16_walk_equals_the_reference_walk():
    """The bf16 forward (the BF16 copy of the state, BF16 GEMM operands) in the walk is the
    ``q_values`` forward's: the same actions as ``loop.evaluate`` with that trainer."""
    config = DQNConfig.preset("tiny", precision="bf16")
    trainer = CpuTrainer(config, seed=2)
    bars = SyntheticMarket(9, 700).generate()
    feats = market_features(bars, loop.choose_windows(config.state_dim))
    per_year = bars_per_year(bar_seconds(bars.timestamp))
    ev = DeviceEvaluator(trainer, env_kernels.market_tables(bars, feats), max_steps=80, chunk=32)
    got = ev.walk(600, 679, per_year, equity=True)
    want, _ = loop.evaluate_segment(trainer, bars, feats, config, (600, 679), "greedy", per_year)
    assert got.metrics.tolist() == _as_f32(want) and want.turnover > 0


@pytest.mark.parametrize("args, kwargs, message", [
    ((100, 222), {}, "segment [100, 222): 121 steps exceed max_steps=120"),
    ((100, 101), {}, "stop=101: must be an integer >= 102"),
    ((1100, 1201), {}, "stop=1201: must be an integer >= 1102 and <= 1200"),
    ((-1, 50), {}, "start=-1: must be an integer >= 0"),
    ((100, 150), {"policy": "random"}, "policy='random': allowed values are 'greedy', "),
])
def test_walk_refuses_what_it_cannot_walk(run_setup, args, kwargs, message):
    *_, per_year, ev = run_setup
    with pytest.raises(ValueError, match=re.escape(message)):
        ev.walk(*args, per_year, **kwargs)


def test_constructor_refuses_bad_sizes(run_setup):
    _, trainer, bars, feats, *_ = run_setup
    tables = env_kernels.market_tables(bars, feats)
    for kwargs, message in ((dict(max_steps=0), "max_steps=0: must be an integer >= 1"),
                            (dict(max_steps=10, chunk=0), "chunk=0: must be an integer >= 1")):
        with pytest.raises(ValueError, match=message):
            DeviceEvaluator(trainer, tables, **kwargs)


# ------------------------------------------------------------------- the loop's fast path

LOOP_CONFIG = DQNConfig.preset("tiny", readback_interval=4)
LOOP_SETTINGS = loop.LoopSettings(folds=2, epochs=2, steps_per_epoch=6, n_envs=4,
                                  warmup_transitions=40, replay_capacity=128, seed=5)
LOOP_BARS = SyntheticMarket.preset("default", seed=3, n_bars=800).generate()


def test_fast_loop_evaluates_on_the_device_as_the_host_walk_does(monkeypatch):
    """The loop's fast path with the device evaluator against the same run evaluated by the
    host walk (``segment_evaluator`` returning None): the same training, and every metric of
    every record, baseline and fold result equal to the host's rounded to float32; each record
    times training and evaluation apart."""
    fast = loop.run(LOOP_CONFIG, LOOP_BARS, LOOP_SETTINGS, backend=CpuTrainer)
    monkeypatch.setattr(loop, "segment_evaluator", lambda *args: None)
    host = loop.run(LOOP_CONFIG, LOOP_BARS, LOOP_SETTINGS, backend=CpuTrainer)
    assert fast.status == host.status == "completed"
    assert len(fast.records) == len(host.records) == 4
    for a, b in zip(fast.records, host.records):
        assert a.loss == b.loss and a.steps == b.steps
        for seg in loop.EVAL_SEGMENTS:
            for m in METRIC_NAMES:
                assert getattr(a, f"{seg}_{m}") == np.float32(getattr(b, f"{seg}_{m}")), (seg, m)
        assert a.train_s > 0 and a.eval_s > 0
        assert a.steps_per_s == pytest.approx(LOOP_SETTINGS.steps_per_epoch / a.train_s)
    for fa, fb in zip(fast.folds, host.folds):
        assert fa.best_epoch == fb.best_epoch
        for seg in loop.EVAL_SEGMENTS:
            for mine, theirs in ((fa.flat, fb.flat), (fa.buy_hold, fb.buy_hold),
                                 (fa.best, fb.best)):
                assert _as_f32(mine[seg]) == _as_f32(theirs[seg])
                assert mine[seg].bars == theirs[seg].bars
        assert fa.best_equity == fb.best_equity
        assert fa.buy_hold_equity == fb.buy_hold_equity


def test_segment_evaluator_is_the_device_one_for_fast_trainers_only():
    from foxhunt.reference.trainer import Trainer

    feats = market_features(LOOP_BARS, loop.choose_windows(LOOP_CONFIG.state_dim))
    ref = evaluator_mod.segment_evaluator(Trainer(LOOP_CONFIG), LOOP_BARS, feats, [(500, 560)])
    assert ref is None
    dev = evaluator_mod.segment_evaluator(CpuTrainer(LOOP_CONFIG), LOOP_BARS, feats,
                                          [(500, 560), (600, 620)])
    assert dev.evaluator.max_steps == 59  # the longest segment's steps
    dev.close()


def test_the_walk_follows_an_engine_rebuilt_by_a_reseed():
    """Loading another seed's state with the IQN head on rebuilds the trainer's engine
    (``Trainer._reseed``): the next walk builds its plans on the new one and follows the loaded
    policy."""
    config = DQNConfig.preset("tiny", lambda_iqn=0.5)
    trainer = CpuTrainer(config, seed=1)
    bars = SyntheticMarket(5, 700).generate()
    feats = market_features(bars, loop.choose_windows(config.state_dim))
    per_year = bars_per_year(bar_seconds(bars.timestamp))
    ev = DeviceEvaluator(trainer, env_kernels.market_tables(bars, feats), max_steps=50, chunk=8)
    ev.walk(600, 650, per_year)
    other = CpuTrainer(config, seed=2)
    gen = np.random.default_rng(4)
    for _ in range(3):
        other.step(Batch.random(config, gen))
    engine = trainer.engine
    trainer.load_state_dict(other.state_dict())
    assert trainer.engine is not engine
    got = ev.walk(600, 650, per_year)
    assert ev._engine is trainer.engine  # the plans were rebuilt on it
    want, _ = loop.evaluate_segment(trainer, bars, feats, config, (600, 650), "greedy", per_year)
    assert got.metrics.tolist() == _as_f32(want)
    ev.close()
