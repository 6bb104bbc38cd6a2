"""The device collector's deferred priority update (``foxhunt.fast.collector``'s docstring): a
training cycle's update runs at the next cycle's head, beside the act forward, or at a flush.

The oracle is the reference collector (``reference.collector.Collector``: the update at the end
of its own cycle) driving a ``CpuTrainer`` of the same seed; the fast plans run on the CPU
executor in both of its branch orders (the side branch first or last)."""

from __future__ import annotations

import numpy as np
import pytest

from foxhunt.fast.collect_plan import RING_BUFFERS
from foxhunt.fast.collector import FastCollector
from foxhunt.fast.cpu_executor import CpuTrainer
from foxhunt.fast.dataflow import dependency_graph
from foxhunt.fast.records import Parallel
from foxhunt.reference import loop
from foxhunt.reference.batch import Batch
from foxhunt.reference.collector import Collector, Walks
from foxhunt.reference.config import DQNConfig, source_overrides
from foxhunt.reference.kernels import env as env_kernels
from foxhunt.reference.market import SyntheticMarket, feature_warmup, market_features

CFG = DQNConfig.preset("tiny")
KW = dict(n_envs=4, capacity=128, reward_scale=1000.0, seed=7, cycle=5)
ORDERS = ("latest_first", "capture_order")


@pytest.fixture(scope="module")
def market():
    """The run's tables and short walks (episodes of 50 bars: some end within a test)."""
    bars = SyntheticMarket.preset("default", seed=3, n_bars=600).generate()
    windows = loop.choose_windows(CFG.state_dim)
    t0, t_val = loop.fold_segments(len(bars), feature_warmup(windows), 1, 0.125, 0.125)[0].train
    tables = env_kernels.market_tables(bars, market_features(bars, windows))
    return tables, Walks(t_val, t0, t_val - 1 - 50, 50)


def _pair(market, order="latest_first"):
    """A reference and a fast collector (own trainers, same seed), warmed up, eps 0.3."""
    tables, walks = market
    t_ref, t_fast = CpuTrainer(CFG, seed=1), CpuTrainer(CFG, seed=1, branch_order=order)
    ref, fast = Collector(CFG, tables, walks, **KW), FastCollector(t_fast, CFG, tables, walks, **KW)
    for col, t in ((ref, t_ref), (fast, t_fast)):
        col.warmup(t, 40)
        col.begin_epoch(0.3)
    return (ref, t_ref), (fast, t_fast)


def _device(fast: FastCollector, name: str) -> np.ndarray:
    return fast._device.arena.download(name)


def _assert_ring_is_the_reference(ref: Collector, fast: FastCollector) -> None:
    """The device's ring arrays, priorities, maximum and counter, downloaded directly."""
    for buf, name in RING_BUFFERS:
        assert np.array_equal(_device(fast, buf), getattr(ref.ring, name)), name
    assert np.array_equal(_device(fast, "priority"), ref.ring.priority)
    assert _device(fast, "max_priority")[0] == ref.ring.max_priority
    assert _device(fast, "cycle").tolist() == [ref.cycle] == [fast.cycle]


@pytest.mark.parametrize("order", ORDERS)
def test_cycles_then_a_flush_equal_the_reference_order(market, order):
    """N cycles leave the last update pending (the device counter one behind the host's, the
    priorities not yet the reference's); a flush makes the ring, priorities and counter the
    reference cycle's bit for bit; an epoch boundary (``begin_epoch``, ``end_epoch``) in
    between needs none; a second flush is a no-op and the cycles after it agree too."""
    (ref, t_ref), (fast, t_fast) = _pair(market, order)
    for eps in (0.3, 0.0):
        ref.begin_epoch(eps)
        fast.begin_epoch(eps)
        for _ in range(3):
            assert ref.cycle_step(t_ref) == fast.cycle_step(t_fast)
        t_ref.end_epoch()
        t_fast.end_epoch()
    assert _device(fast, "cycle").tolist() == [fast.cycle - 1] == [ref.cycle - 1]
    assert not np.array_equal(_device(fast, "priority"), ref.ring.priority)
    fast.flush()
    _assert_ring_is_the_reference(ref, fast)
    fast.flush()
    _assert_ring_is_the_reference(ref, fast)
    for _ in range(2):  # the first with no update pending, the second with one
        assert ref.cycle_step(t_ref) == fast.cycle_step(t_fast)
    fast.flush()
    _assert_ring_is_the_reference(ref, fast)
    a, b = t_ref.state_dict(), t_fast.state_dict()
    assert all(np.array_equal(a[k], b[k], equal_nan=True) for k in a)


def test_warmup_cycles_after_training_cycles_run_the_pending_update_first(market):
    """Warm-up cycles read the counter and write the ring: a warm-up to more transitions after
    training cycles (the update pending) equals the reference's."""
    (ref, t_ref), (fast, t_fast) = _pair(market)
    for _ in range(3):
        assert ref.cycle_step(t_ref) == fast.cycle_step(t_fast)
    for col, t in ((ref, t_ref), (fast, t_fast)):
        col.warmup(t, col.size + 20)
    assert fast.size == ref.size == 40 + 3 * 4 + 20
    _assert_ring_is_the_reference(ref, fast)  # nothing pending after a warm-up
    assert ref.cycle_step(t_ref) == fast.cycle_step(t_fast)


def test_state_flushes_the_pending_update(market):
    """``state()`` with an update pending equals the state after an explicit flush and the
    reference collector's; the cycles after it continue as the reference does."""
    (ref, t_ref), (fast, t_fast) = _pair(market)
    _, (flushed, t_flushed) = _pair(market)
    for _ in range(4):
        ref.cycle_step(t_ref)
        fast.cycle_step(t_fast)
        flushed.cycle_step(t_flushed)
    flushed.flush()
    want, want_meta = ref.state()
    for col in (flushed, fast):  # explicit flush, then state(); state() alone
        arrays, meta = col.state()
        assert meta == want_meta and arrays.keys() == want.keys()
        for k in want:
            assert np.array_equal(arrays[k], want[k], equal_nan=True), k
    assert _device(fast, "cycle").tolist() == [fast.cycle]
    for _ in range(2):
        assert ref.cycle_step(t_ref) == fast.cycle_step(t_fast)
    fast.flush()
    _assert_ring_is_the_reference(ref, fast)


def test_load_state_runs_the_pending_update_before_it_replaces_the_ring(market):
    """A state loaded into a collector with an update pending: the update is spent on the old
    ring (advancing the counter), not on the loaded one, so the collector continues exactly as
    a new one built at its counter with the same state and trainer."""
    tables, walks = market
    _, (col, t) = _pair(market)
    for _ in range(3):
        col.cycle_step(t)
    arrays, meta = col.state()
    col.cycle_step(t)  # pending again, its td from this cycle's step
    t_new = CpuTrainer(CFG, seed=1)
    t_new.load_state_dict(t.state_dict())
    new = FastCollector(t_new, CFG, tables, walks, **{**KW, "cycle": col.cycle})
    for c in (col, new):
        c.load_state(arrays, meta)
        c.begin_epoch(0.3)
    assert _device(col, "cycle").tolist() == [col.cycle] == [new.cycle]
    col.cycle_step(t)
    new.cycle_step(t_new)
    (a, a_meta), (b, b_meta) = col.state(), new.state()
    assert a_meta == b_meta and all(np.array_equal(a[k], b[k], equal_nan=True) for k in a)
    assert _device(col, "cycle").tolist() == [new.cycle] == _device(new, "cycle").tolist()
    sa, sb = t.state_dict(), t_new.state_dict()
    assert all(np.array_equal(sa[k], sb[k], equal_nan=True) for k in sa)


def test_a_step_outside_the_collector_with_an_update_pending_is_refused(market):
    """The pending update reads the ``td`` of its cycle's step: once the trainer has stepped
    elsewhere they are gone, so the next cycle and ``state()`` raise; flushing first is fine."""
    _, (col, t) = _pair(market)
    col.cycle_step(t)
    col.flush()
    t.step(Batch.random(CFG, np.random.default_rng(0)))
    col.cycle_step(t)  # nothing was pending: runs
    t.step(Batch.random(CFG, np.random.default_rng(1)))
    for call in (lambda: col.cycle_step(t), col.state, col.flush):
        with pytest.raises(RuntimeError, match="stepped outside this collector, or a state loaded"):
            call()
    col.close()  # the collector's state is dropped: no error


def test_close_after_the_engine_was_rebuilt_drops_the_pending_update(market):
    """A trainer rebuilt (a state of another seed loaded: the IQN head's key is baked into its
    graphs) with an update pending: the update cannot run on the old engine's graphs;
    ``state()`` says why, ``close()`` releases."""
    tables, walks = market
    config = DQNConfig.preset("tiny", **source_overrides("iqn"))
    t = CpuTrainer(config, seed=1)
    col = FastCollector(t, config, tables, walks, **KW)
    col.warmup(t, config.batch_size)
    col.cycle_step(t)
    old = t.engine
    t.load_state_dict(CpuTrainer(config, seed=2).state_dict())
    assert t.engine is not old
    with pytest.raises(RuntimeError, match="rebuilt"):
        col.state()
    col.close()


# ------------------------------------------------------------------------- the plans


def _chain(graphs) -> int:
    """The longest chain of dependent nodes of ``graphs`` run in order (as captured)."""
    _, deps = dependency_graph(graphs)
    depth: list[int] = []
    for d in deps:  # every dependency has a smaller index
        depth.append(1 + max((depth[j] for j in d), default=0))
    return max(depth)


def _overlap(a, b) -> bool:
    return a.buffer == b.buffer and a.start < b.start + b.nbytes and b.start < a.start + a.nbytes


def test_the_update_is_off_the_training_cycles_chain(market):
    """``train`` = [head, graph 1, graph 2], no tail graph: the head's first record is the
    parallel (side: the update alone, main: the act forward), and the rest of the head is
    ``train_first``'s. Its chain is ``train_first``'s, one node shorter than the old order's
    (``train_first`` then the update as a tail graph), with one node more; and the two
    branches touch no common bytes where either writes."""
    tables, walks = market
    trainer = CpuTrainer(CFG, seed=1)
    col = FastCollector(trainer, CFG, tables, walks, **KW)
    train, first, flush = col.plans["train"], col.plans["train_first"], col.plans["flush"]
    assert [len(train), len(first)] == [3, 3]
    assert train[1:] == first[1:] == [trainer.plans["graph1"], trainer.plans["graph2"]]
    fork = train[0].items[0]
    assert isinstance(fork, Parallel) and len(fork.sides) == 1
    (update,) = fork.sides[0].nodes()
    assert update.kernel == "replay_update_priorities"
    assert {k: str(update.args[k]) for k in ("td", "idx", "priority", "cycle")} == {
        "td": "td", "idx": "sample_idx", "priority": "priority", "cycle": "cycle"}
    assert [str(n) for n in flush[0].nodes()] == [str(update)]
    act = [str(n) for n in fork.main.nodes()]
    rest = [str(n) for n in train[0].nodes()][len(act) + 1:]
    assert act + rest == [str(n) for n in first[0].nodes()]
    assert [r.split("<<<")[0] for r in rest] == ["collect_transition", "scan_tiles", "replay_batch"]
    assert sum(g.node_count() for g in train) == sum(g.node_count() for g in first) + 1
    assert _chain(train) == _chain(first) == _chain(first + flush) - 1
    for a in update.accesses:
        for b in (acc for node in fork.main.nodes() for acc in node.accesses):
            assert not (_overlap(a, b) and (a.write or b.write)), (a, b)
    col.close()
