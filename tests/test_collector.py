"""Tests of the collection cycle: the host ring on the replay twins, the reference collector,
and the device collector's plan on the CPU executor (bit for bit the reference cycle, resume,
and no host synchronisation between the readback points)."""

from __future__ import annotations

import numpy as np
import pytest

from foxhunt.fast import device as fast_device
from foxhunt.fast.collector import FastCollector
from foxhunt.fast.cpu_executor import CpuTrainer
from foxhunt.reference import loop
from foxhunt.reference.collector import Collector, ReplayRing, Walks
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.kernels import env as env_kernels
from foxhunt.reference.kernels import rng
from foxhunt.reference.market import SyntheticMarket, feature_warmup, market_features
from foxhunt.reference.replay import ReplayBuffer

F32, I32 = np.float32, np.int32
CFG = DQNConfig.preset("tiny")
SEED = 7
KW = dict(n_envs=4, capacity=128, reward_scale=1000.0, seed=SEED, cycle=5)


@pytest.fixture(scope="module")
def market():
    """The run's tables and short walks (episodes of 50 bars: some end within a test)."""
    bars = SyntheticMarket.preset("default", seed=3, n_bars=600).generate()
    feats = market_features(bars, loop.choose_windows(CFG.state_dim))
    seg = loop.fold_segments(len(bars), feature_warmup(loop.choose_windows(CFG.state_dim)), 1,
                             0.125, 0.125)[0]
    t0, t_val = seg.train
    return env_kernels.market_tables(bars, feats), Walks(t_val, t0, t_val - 1 - 50, 50)


# ------------------------------------------------------------------------------ ReplayRing


def _transitions(gen, n):
    sd, nb = CFG.state_dim, CFG.n_branches
    return dict(s=gen.standard_normal((n, sd)).astype(F32), a=gen.integers(0, 2, (n, nb)).astype(I32),
                r=gen.standard_normal(n).astype(F32), s2=gen.standard_normal((n, sd)).astype(F32),
                done=(gen.random(n) < 0.2).astype(F32),
                next_ret=(0.01 * gen.standard_normal(n)).astype(F32),
                regime=gen.integers(0, 3, n).astype(np.int8),
                discount=gen.uniform(0.5, 1.0, n).astype(F32))


def test_ring_adds_like_the_host_replay_buffer():
    """``replay_add`` through the ring stores what ``ReplayBuffer.add`` (its own code) stores."""
    gen = np.random.default_rng(0)
    ring, old = ReplayRing(CFG, 50), ReplayBuffer(CFG, 50)
    for n in (7, 20, 30, 11):  # wraps twice
        tr = _transitions(gen, n)
        ring.add(**{k: v for k, v in tr.items() if k not in ("next_ret", "regime")},
                 next_ret=tr["next_ret"], regime=tr["regime"])
        old.add(**{k: v for k, v in tr.items() if k not in ("next_ret", "regime")},
                next_ret=tr["next_ret"], regime=tr["regime"])
    a, b = ring.state(), old.state()
    assert a.keys() == b.keys()
    for key in a:
        assert np.array_equal(a[key], b[key]), key


def test_ring_sample_reads_its_rows_with_the_philox_draws_and_weights():
    gen = np.random.default_rng(1)
    ring = ReplayRing(CFG, 64)
    tr = _transitions(gen, 48)
    ring.add(**{k: v for k, v in tr.items() if k not in ("next_ret", "regime")},
             next_ret=tr["next_ret"], regime=tr["regime"])
    ring.priority[:48] = gen.uniform(0.1, 3.0, 48).astype(F32)
    batch, idx = ring.sample(SEED, 99)
    assert idx.max() < 48
    # The draws: the first prefix above u * total (a linear scan over float64-free float32 sums).
    prefix = np.cumsum(ring.priority, dtype=F32)
    u = rng.uniform(SEED, rng.STREAMS["replay_sample"], 99, np.arange(CFG.batch_size))
    want = [int(np.argmax(prefix[:48] > F32(uk * prefix[47]))) for uk in u]
    assert idx.tolist() == want
    assert np.array_equal(batch.s, tr["s"][idx]) and np.array_equal(batch.s2, tr["s2"][idx])
    assert np.array_equal(batch.a, tr["a"][idx]) and np.array_equal(batch.regime, tr["regime"][idx])
    p = ring.priority[idx].astype(np.float64)
    assert np.allclose(batch.isw, (p.min() / p) ** float(ring.beta), rtol=1e-6)
    batch.validate(CFG)


def test_ring_priority_update_takes_the_running_max_for_a_non_finite_td():
    ring = ReplayRing(CFG, 40)
    ring.add(**{k: v for k, v in _transitions(np.random.default_rng(2), 40).items()
                if k not in ("next_ret", "regime")}, next_ret=np.zeros(40, F32), regime=np.zeros(40, I32))
    ring.max_priority = F32(3.0)
    ring.update_priorities(np.array([1, 2], I32), np.array([np.nan, 0.5], F32))
    assert ring.priority[1] == F32(3.0)  # the old keep-the-stale-priority rule is gone
    want = (0.5 + float(ring.priority_eps)) ** float(ring.alpha)
    assert ring.priority[2] == pytest.approx(want, rel=1e-6)
    assert ring.max_priority == F32(3.0)


def test_walks_of_a_training_segment():
    w = Walks.of_segment((100, 2000))
    assert w == Walks(n_bars=2000, min_start=100, last_start=2000 - 1 - 1000, episode_len=1000)
    short = Walks.of_segment((10, 457))
    assert short.episode_len == 446 and short.last_start == short.min_start == 10


# ------------------------------------------------------------------ the reference collector


def _run(collector, trainer, cycles, eps=0.3):
    collector.warmup(trainer, 40)
    collector.begin_epoch(eps)
    return [collector.cycle_step(trainer) for _ in range(cycles)]


def test_reference_collector_counts_cycles_and_fills_the_ring(market):
    from foxhunt.reference.trainer import Trainer

    tables, walks = market
    col = Collector(CFG, tables, walks, **KW)
    _run(col, Trainer(CFG, seed=1), 3)
    assert col.cycle == 5 + 10 + 3  # warm-up: 40 transitions of 4 walks, then 3 cycles
    assert col.size == 52 and col.ring.cursor == 52
    assert np.all(col.ring.priority[:52] > 0) and np.all(col.ring.priority[52:] == 0)


def test_reference_collector_resumes_bitwise(market):
    from foxhunt.reference.trainer import Trainer

    tables, walks = market
    whole, t_whole = Collector(CFG, tables, walks, **KW), Trainer(CFG, seed=1)
    _run(whole, t_whole, 4)
    whole.cycle_step(t_whole)
    half, t_half = Collector(CFG, tables, walks, **KW), Trainer(CFG, seed=1)
    _run(half, t_half, 4)
    arrays, meta = half.state()
    resumed = Collector(CFG, tables, walks, **{**KW, "cycle": half.cycle})
    resumed.load_state(arrays, meta)
    resumed.begin_epoch(0.3)
    resumed.cycle_step(t_half)
    _assert_same(whole, resumed)


def _assert_same(a, b):
    ra = a.ring if isinstance(a, Collector) else a.ring()
    rb = b.ring if isinstance(b, Collector) else b.ring()
    sa, sb = ra.state(), rb.state()
    for key in sa:
        assert np.array_equal(sa[key], sb[key], equal_nan=True), key
    ea = a.env if isinstance(a, Collector) else a.walk_state()
    eb = b.env if isinstance(b, Collector) else b.walk_state()
    for name, x, y in zip(env_kernels.EnvState._fields, ea, eb):
        assert np.array_equal(x, y), name
    assert a.cycle == b.cycle
    for col in (a, b):
        if isinstance(col, FastCollector):  # the device's own counter, not only the host mirror
            assert col._device.arena.download("cycle").tolist() == [col.cycle]


# ------------------------------------------------------- the device plan on the CPU executor


def test_fast_cycle_on_the_cpu_executor_equals_the_reference_cycle(market):
    """Warm-up and training cycles of the fast plan (records run by the reference kernels)
    against the reference collector driving the same trainer code: the ring, the walks, the
    counter and the trainers' whole state agree bit for bit, and so do the step scalars."""
    tables, walks = market
    t_ref, t_fast = CpuTrainer(CFG, seed=1), CpuTrainer(CFG, seed=1)
    ref, fast = Collector(CFG, tables, walks, **KW), FastCollector(t_fast, CFG, tables, walks, **KW)
    for eps in (1.0, 0.3, 0.0):  # all explore, mixed, all greedy
        ref.warmup(t_ref, 40)
        fast.warmup(t_fast, 40)
        ref.begin_epoch(eps)
        fast.begin_epoch(eps)
        for _ in range(3):
            assert ref.cycle_step(t_ref) == fast.cycle_step(t_fast)
    _assert_same(ref, fast)
    a, b = t_ref.state_dict(), t_fast.state_dict()
    assert all(np.array_equal(a[k], b[k], equal_nan=True) for k in a)
    assert fast.size == ref.size == 76  # 40 warm-up + 9 cycles of 4


def test_fast_cycles_synchronise_only_at_readback_points(market):
    """Counted through the device layer (``fast.device.SYNCS``): a training cycle issues no
    host synchronisation except the deferred readback's, every ``readback_interval`` steps."""
    tables, walks = market
    cfg = DQNConfig.preset("tiny", readback_interval=4)
    trainer = CpuTrainer(cfg, seed=1)
    col = FastCollector(trainer, cfg, tables, walks, **KW)
    col.warmup(trainer, 40)
    col.begin_epoch(0.5)
    before = fast_device.SYNCS.count
    fresh = [col.cycle_step(trainer).fresh for _ in range(10)]
    assert fast_device.SYNCS.count - before == sum(fresh) == 2  # steps 4 and 8
    before = fast_device.SYNCS.count
    trainer.end_epoch()
    assert fast_device.SYNCS.count - before == 1


def test_fast_collector_resumes_bitwise_from_either_collector_state(market):
    """The device state read back (``state()``) restores into a new fast collector, and the
    reference collector's state into a fast one: both continue exactly as the uninterrupted
    run."""
    tables, walks = market
    whole_t = CpuTrainer(CFG, seed=1)
    whole = FastCollector(whole_t, CFG, tables, walks, **KW)
    _run(whole, whole_t, 3)
    saved_trainer = whole_t.state_dict()
    arrays, meta = whole.state()
    cycle = whole.cycle
    whole.cycle_step(whole_t)
    for source in ("fast", "reference"):
        t = CpuTrainer(CFG, seed=1)
        t.load_state_dict(saved_trainer)
        if source == "reference":
            ref = Collector(CFG, tables, walks, **KW)
            ref_t = CpuTrainer(CFG, seed=1)
            _run(ref, ref_t, 3)
            arrays, meta = ref.state()
        col = FastCollector(t, CFG, tables, walks, **{**KW, "cycle": cycle})
        col.load_state(arrays, meta)
        col.begin_epoch(0.3)
        col.cycle_step(t)
        _assert_same(whole, col)


def test_fast_plan_binds_the_batch_it_gathers_and_reads_no_unwritten_buffer(market):
    """The training plan's records: the fused batch kernel writes the trainer's batch and its
    weights (graph 1 reads nothing else of it: ``check_dataflow`` passed at construction); every
    kernel of the cycle appears once per cycle, the fused ones in place of the kernels they
    fuse, and no copy is left (the forward reads ``obs`` in place). The priority update (the
    previous cycle's, deferred) is the head's side branch."""
    tables, walks = market
    trainer = CpuTrainer(CFG, seed=1)
    col = FastCollector(trainer, CFG, tables, walks, **KW)
    nodes = col.plans["train"][0].nodes()
    head = [n.kernel for n in nodes if hasattr(n, "kernel")]
    tail = [n.kernel for n in col.plans["train"][0].items[0].sides[0].nodes()]
    for name in ("collect_transition", "scan_tiles", "replay_batch"):
        assert head.count(name) == 1, name
    for name in ("env_act", "env_step", "nstep_window", "replay_add", "scan_offsets",
                 "replay_sample", "importance_weights", "replay_gather", "cycle_advance"):
        assert name not in head, name
    from foxhunt.fast.records import Copy
    assert not any(isinstance(n, Copy) for n in nodes)
    assert tail == ["replay_update_priorities"]
    assert str(col.plans["train"][0].items[0].sides[0].nodes()[0].args["cycle"]) == "cycle"
    batch = next(n for n in nodes if getattr(n, "kernel", "") == "replay_batch")
    assert {str(batch.args[k]) for k in ("x", "a", "r", "done", "w")} == {
        "batch.x", "batch.a", "batch.r", "batch.done", "batch.isw"}


# ------------------------------------------------------------------- the loop's fast path


LOOP_CONFIG = DQNConfig.preset("tiny", readback_interval=4)
LOOP_SETTINGS = loop.LoopSettings(folds=2, epochs=2, steps_per_epoch=9, n_envs=4,
                                  warmup_transitions=40, replay_capacity=128, seed=5)
LOOP_BARS = SyntheticMarket.preset("default", seed=3, n_bars=800).generate()


def _loop(out_dir=None, *, resume=False, stop_after=None, on_step=None):
    steps = []

    def step(i, scalars):
        steps.append(i)
        if on_step:
            on_step(i, scalars)

    return loop.run(LOOP_CONFIG, LOOP_BARS, LOOP_SETTINGS, backend=CpuTrainer, out_dir=out_dir,
                    resume=resume, on_step=step,
                    should_stop=None if stop_after is None else lambda: len(steps) >= stop_after)


def test_loop_fast_path_synchronises_only_at_readback_points():
    """Within an epoch the loop's fast path (the collector's cycle graph, the trainer's
    bookkeeping, ``on_step``) synchronises exactly at the deferred readbacks."""
    seen = []
    result = _loop(on_step=lambda i, s: seen.append((i, s.fresh, fast_device.SYNCS.count)))
    assert result.status == "completed"
    checked = 0
    for (_, _, before), (i, fresh, after) in zip(seen, seen[1:]):
        if i == 0:
            continue  # an epoch boundary (evaluation, checkpoints) lies in between
        assert after - before == int(fresh), (i, fresh)
        checked += 1
    assert checked == LOOP_SETTINGS.folds * LOOP_SETTINGS.epochs * (LOOP_SETTINGS.steps_per_epoch - 1)


def test_loop_fast_path_resumes_bitwise(tmp_path):
    """Interrupted inside fold 0's second epoch (the ring and walks come back from the device
    state saved at the first epoch's end) and resumed: the same records and final trainer."""
    from foxhunt.reference.checkpoint import load_checkpoint

    whole = _loop(tmp_path / "whole")
    part = _loop(tmp_path / "part", stop_after=LOOP_SETTINGS.steps_per_epoch + 4)
    assert part.status == "interrupted" and len(part.records) == 1
    resumed = _loop(tmp_path / "part", resume=True)
    untimed = [{k: v for k, v in vars(r).items() if k not in loop.TIMING_FIELDS}
               for r in whole.records]
    assert [{k: v for k, v in vars(r).items() if k not in loop.TIMING_FIELDS}
            for r in resumed.records] == untimed
    _, a = load_checkpoint(tmp_path / "whole" / "checkpoints" / "last.safetensors")
    _, b = load_checkpoint(tmp_path / "part" / "checkpoints" / "last.safetensors")
    assert all(np.array_equal(a[k], b[k], equal_nan=True) for k in a)


def test_the_cycle_kernels_twins_declare_every_pointer_parameter():
    from foxhunt.fast.collect_plan import register_twins
    from foxhunt.fast.cpu_kernels import TWINS
    from foxhunt.fast.records import kernel_params

    register_twins()
    params = kernel_params()
    for name in ("env_act", "env_step", "replay_add", "scan_tiles", "scan_offsets", "replay_sample",
                 "importance_weights", "replay_gather", "replay_update_priorities",
                 "cycle_advance", "nstep_window", "collect_transition", "replay_batch"):
        pointers = {p.name for p in params[name] if p.pointer}
        assert set(TWINS[name].extents) == pointers, name
        assert TWINS[name].nullable <= pointers, name
