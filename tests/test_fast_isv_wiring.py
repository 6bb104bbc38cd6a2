"""Issue 19, part two, in the fast step's own plan on the CPU executor: each switch's producers
and the gamma schedule's consumer against the reference step within the step bounds
(``conformance.step_compare``; SPEC 8's one-step-at-a-time trajectory from the shared state)."""

import numpy as np
import pytest

from foxhunt.conformance.step_compare import compare_step, run_step
from foxhunt.fast.cpu_executor import CpuTrainer
from foxhunt.fast.graph1_plan import graph1_ops
from foxhunt.fast.graph2_plan import graph2_ops
from foxhunt.reference.batch import Batch
from foxhunt.reference.config import ADAPTIVE_ON, DQNConfig
from foxhunt.reference import isv as isv_mod
from foxhunt.reference import isv_step
from foxhunt.reference.isv_step import ADAPTIVE_SWITCHES
from foxhunt.reference.trainer import Trainer

#: SPEC 8's trajectory: 300 steps, compared one step at a time from the shared state.
TRAJECTORY_STEPS = 300
PRODUCER_KERNELS = {"isv_signal_build", "isv_signal_update", "q_stats_update",
                    "q_quantile_update", "adaptive_support_update", "per_branch_gamma_update",
                    "epsilon_tau_update", "cql_alpha_ramp"}
#: Every issue-19 switch: the producers' and the live per-branch support (``adaptive_atoms``,
#: a consumer of q_stats' slots 23-30).
EVERY_SWITCH = ADAPTIVE_ON
#: The loop's exploration schedule of the compared steps (sched, cap): ``set_loop_signals``.
EPSILON = (0.4, 1.0)


def _compare(config, state, batch, trainers=None):
    """The reference's step and the fast plan's from ``state`` on ``batch``, compared;
    ``trainers``: a ``(reference, CpuTrainer)`` pair of ``config`` to reuse (each loads the
    state, which resets everything a step reads but the schedule, set here first), else new."""
    ref, fast = trainers or (Trainer(config), CpuTrainer(config))
    for t in (ref, fast):  # the schedule (not in the state), then the state (slot 41 with it)
        t.set_loop_signals(epsilon=EPSILON)
        t.load_state_dict({k: v.copy() for k, v in state.items()})
    try:
        ro, fo = run_step(ref, batch), run_step(fast, batch)
    finally:
        if trainers is None:
            fast.close()
    bad = [r.message for r in compare_step(config, state, ro, fo) if not r.passed]
    assert not bad, "\n".join(bad)
    return ro


def _start(config, steps, seed=0):
    rng = np.random.default_rng(seed)
    t = Trainer(config, seed=1)
    t.set_loop_signals(total_epochs=10, sharpe_ema=0.7, epsilon=EPSILON)
    t.set_epoch(3)
    for _ in range(steps):
        t.step(Batch.random(config, rng))
    return t, rng


@pytest.mark.parametrize("switch", [*ADAPTIVE_SWITCHES, "all"])
@pytest.mark.parametrize("steps", [0, 2], ids=["fresh", "warm"])
def test_one_step_with_a_switch_on_matches_the_reference(switch, steps):
    on = EVERY_SWITCH if switch == "all" else {switch: True}
    config = DQNConfig.preset("tiny", precision="f32", readback_interval=1, **on)
    t, rng = _start(config, steps)
    _compare(config, t.state_dict(), Batch.random(config, rng))


def test_a_trajectory_one_step_at_a_time_stays_within_the_bounds():
    """SPEC 8: the reference walks; at every step the fast step from the reference's state is
    compared with the reference's (every switch on, the ISV's producer slots bounded)."""
    config = DQNConfig.preset("tiny", precision="f32", readback_interval=1, **EVERY_SWITCH)
    t, rng = _start(config, 0, seed=4)
    trainers = (Trainer(config), CpuTrainer(config))  # one pair, loaded from each step's state
    try:
        for _ in range(TRAJECTORY_STEPS):
            state, batch = t.state_dict(), Batch.random(config, rng)
            _compare(config, state, batch, trainers)
            t.step(batch)
    finally:
        trainers[1].close()


def test_switches_off_launch_no_issue19_producer():
    plain = CpuTrainer(DQNConfig.preset("tiny", precision="f32"))
    try:
        names = {item.kernel for item in _launches(plain)}
        scalars = {item.kernel: item for item in _launches(plain, graph1_ops)}
    finally:
        plain.close()
    assert not names & PRODUCER_KERNELS and "isv_q_abs_ref_update" in names
    # the consumers' constant paths: the scalar kernels (Polyak with the post-Polyak check in
    # its pass: graph2_plan.post_check_in_polyak), no pointer variant
    assert {"loss_scalars", "polyak_update_mirror_check"} <= names | set(scalars)
    assert not {"loss_scalars_ptr", "polyak_update_mirror_ptr"} & (names | set(scalars))


def test_consumers_read_the_slots_of_the_step_start():
    """With the ramp and the adaptive tau on, graph 1 starts with the copies of ISV 48 / 42 and
    the CQL and Polyak kernels read them through pointers."""
    config = DQNConfig.preset("tiny", precision="f32", cql_alpha_ramp=True,
                              adaptive_epsilon_tau=True)
    t = CpuTrainer(config)
    try:
        g1 = {item.kernel: item for item in _launches(t, graph1_ops)}
        g2 = {item.kernel: item for item in _launches(t)}
    finally:
        t.close()
    assert "loss_scalars_ptr" in g1 and "loss_scalars" not in g1
    assert "polyak_update_mirror_ptr" in g2
    assert not {"polyak_update_mirror", "polyak_update_mirror_check"} & set(g2)
    assert {"epsilon_tau_update", "cql_alpha_ramp"} <= set(g2)


def _launches(trainer, build=graph2_ops):
    from foxhunt.fast.records import Launch, Parallel

    def walk(ops):
        for item in ops.items:
            if isinstance(item, Parallel):
                for side in (*item.sides, item.main):
                    yield from walk(side)
            elif isinstance(item, Launch):
                yield item
    return list(walk(build(trainer._engine.program)))


# ------------------------------------------------------------------ fold resets, collectors
ALL_ON = EVERY_SWITCH


@pytest.mark.parametrize("backend", [Trainer, CpuTrainer], ids=["reference", "fast-cpu"])
def test_fold_reset_with_every_switch_on_returns_to_the_configured_values(backend):
    """FoldReset slots go back to this config's cold starts (non-default gamma, cql_alpha, tau),
    SchemaContract ones stay, in both backends."""
    config = DQNConfig.preset("tiny", precision="f32", gamma=(0.95, 0.9), cql_alpha=0.3,
                              tau=0.02, **ALL_ON)
    t = backend(config, seed=1)
    t.set_loop_signals(total_epochs=12, sharpe_ema=1.5, epsilon=(0.4, 1.0))
    t.set_epoch(5)
    rng = np.random.default_rng(0)
    for _ in range(3):
        t.step(Batch.random(config, rng))
    moved = t.state_dict()["isv"]
    t.fold_boundary()
    v = t.state_dict()["isv"]
    if hasattr(t, "close"):
        t.close()
    # the producers had moved every consumed slot away from its cold start
    assert moved[isv_mod.EPSILON_EFF_INDEX] >= np.float32(0.4)
    assert moved[isv_mod.TAU_EFF_INDEX] != np.float32(0.02)
    assert moved[isv_mod.CQL_ALPHA_INDEX] < np.float32(0.3)
    assert moved[isv_mod.GAMMA_INDICES[0]] != np.float32(0.95)
    assert [v[i] for i in isv_mod.GAMMA_INDICES[:2]] == [np.float32(0.95), np.float32(0.9)]
    assert v[isv_mod.CQL_ALPHA_INDEX] == np.float32(0.3)
    assert v[isv_mod.TAU_EFF_INDEX] == np.float32(0.02)
    assert v[isv_mod.EPSILON_EFF_INDEX] == 0  # the loop writes the next epoch's schedule
    assert v[isv_mod.TOTAL_EPOCHS_INDEX] == 12  # SchemaContract: kept


def test_tau_eff_starts_at_tau_only_with_the_switch_on():
    on = DQNConfig.preset("tiny", tau=0.02, adaptive_epsilon_tau=True)
    off = DQNConfig.preset("tiny", tau=0.02)
    assert isv_mod.bus_for(on).get("TAU_EFF") == np.float32(0.02)
    assert isv_mod.bus_for(off).get("TAU_EFF") == 0  # the registry's: bitwise today's bus


def test_set_loop_signals_epsilon_is_checked_in_one_line():
    t = Trainer(DQNConfig.preset("tiny", adaptive_epsilon_tau=True))
    for bad in ((0.5,), (0.5, 1.5), (float("nan"), 1.0), "x"):
        with pytest.raises(ValueError, match="epsilon="):
            t.set_loop_signals(epsilon=bad)
    t.set_loop_signals(epsilon=(0.25, 1.0))
    assert t.isv_value("EPSILON_EFF") == 0.25


def _market(config):
    from foxhunt.reference import loop
    from foxhunt.reference.collector import Walks
    from foxhunt.reference.kernels import env as env_kernels
    from foxhunt.reference.market import SyntheticMarket, feature_warmup, market_features

    bars = SyntheticMarket.preset("default", seed=3, n_bars=600).generate()
    windows = loop.choose_windows(config.state_dim)
    seg = loop.fold_segments(len(bars), feature_warmup(windows), 1, 0.125, 0.125)[0]
    t0, t_val = seg.train
    return (env_kernels.market_tables(bars, market_features(bars, windows)),
            Walks(t_val, t0, t_val - 1 - 50, 50))


def test_collectors_explore_with_the_adaptive_epsilon():
    """Every switch on: training cycles act with ISV 41 (``isv_step.act_epsilon``), warm-up
    cycles with 1; the fast cycle plan (CPU executor) equals the reference cycle bit for bit."""
    from foxhunt.fast.collector import FastCollector
    from foxhunt.reference.collector import Collector

    config = DQNConfig.preset("tiny", precision="f32", readback_interval=1, **ALL_ON)
    tables, walks = _market(config)
    kw = dict(n_envs=4, capacity=128, reward_scale=1000.0, seed=7, cycle=5)
    t_ref, t_fast = CpuTrainer(config, seed=1), CpuTrainer(config, seed=1)
    ref = Collector(config, tables, walks, **kw)
    fast = FastCollector(t_fast, config, tables, walks, **kw)
    try:
        for t in (t_ref, t_fast):
            t.set_loop_signals(total_epochs=4, epsilon=(0.3, 1.0))
        for col, t in ((ref, t_ref), (fast, t_fast)):
            col.warmup(t, 40)
            col.begin_epoch(0.3)
        for _ in range(4):
            assert ref.cycle_step(t_ref) == fast.cycle_step(t_fast)
        assert isv_step.act_epsilon(config, t_ref, 0.3) == np.float32(t_ref.isv_value("EPSILON_EFF"))
        assert isv_step.act_epsilon(config, t_ref, 0.3) >= np.float32(0.3)  # the floor
        a, b = t_ref.state_dict(), t_fast.state_dict()
        assert all(np.array_equal(a[k], b[k], equal_nan=True) for k in a)
        env_ref, env_fast = ref.env, fast.walk_state()
        assert all(np.array_equal(x, y) for x, y in zip(env_ref, env_fast))
    finally:
        fast.close()
        t_ref.close()
        t_fast.close()
    off = DQNConfig.preset("tiny")
    assert isv_step.act_epsilon(off, None, 0.3) == np.float32(0.3)
