"""``DQNConfig.adaptive_atoms`` (issue 19, part three): the live per-branch support of ISV
23-30 under Mech 2 (``reference.kernels.live_support``), its consumers in the reference step,
sentinel 47 on the live span, and the fold reset of the support slots."""

import numpy as np
import pytest

from foxhunt.reference import isv as isv_mod
from foxhunt.reference import sentinels
from foxhunt.reference.batch import Batch
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.kernels import distributional
from foxhunt.reference.kernels.live_support import branch_members, live_support_build
from foxhunt.reference.step import loss_and_grads, step_supports
from foxhunt.reference.trainer import Trainer

TINY = DQNConfig.preset("tiny", readback_interval=1, q_stats=True, adaptive_atoms=True)
NA = TINY.num_atoms


def _isv(config=TINY, **slots) -> np.ndarray:
    bus = isv_mod.bus_for(config)
    for name, value in slots.items():
        bus.set(name, value)
    return bus.to_array()


def _by_hand(centre: float, half: float, num_atoms: int) -> np.ndarray:
    """``c + h t_j`` in float64 (the float32 formula's exact value, unrounded)."""
    t = (2 * np.arange(num_atoms) - (num_atoms - 1)) / (num_atoms - 1)
    return centre + half * t


# ------------------------------------------------------------------------------ the formula
def test_support_is_centre_plus_half_times_t_per_branch():
    members = branch_members(TINY.n_branches)
    names = ("DIR", "MAG", "ORD", "URG")
    isv = _isv(**{f"V_CENTER_{names[members[0]]}": 1.5, f"V_HALF_{names[members[0]]}": 4.0,
                  f"V_CENTER_{names[members[1]]}": -2.0, f"V_HALF_{names[members[1]]}": 0.5})
    out = live_support_build(isv, TINY.n_branches, NA, 100.0)
    for d, (c, h) in enumerate(((1.5, 4.0), (-2.0, 0.5))):
        expected = _by_hand(c, h, NA)
        np.testing.assert_allclose(out.z[d], expected, rtol=0, atol=4 * np.spacing(np.float32(abs(c) + h)))
        assert out.z[d, 0] == np.float32(c - h) and out.z[d, -1] == np.float32(c + h)
        np.testing.assert_allclose(out.bounds[d], [c - h, c + h, 2 * h / (NA - 1)], rtol=1e-6)


def test_cold_start_is_the_configured_support():
    config = TINY.replace(v_min=-3.0, v_max=7.0)
    out = step_supports(config, _isv(config))
    fixed = distributional.support(-3.0, 7.0, NA)
    np.testing.assert_allclose(out.z, np.tile(fixed, (config.n_branches, 1)), rtol=0, atol=1e-6)
    assert np.all(out.bounds[:, :2] == np.array([-3.0, 7.0], np.float32))


def test_off_gives_the_fixed_support_bit_for_bit():
    config = TINY.replace(adaptive_atoms=False)
    out = step_supports(config, _isv(config, V_HALF_DIR=3.0, V_CENTER_ORD=1.0))
    fixed = distributional.support(config.v_min, config.v_max, NA)
    assert out.z.tobytes() == np.tile(fixed, (config.n_branches, 1)).tobytes()


@pytest.mark.parametrize("q_abs_ref", [0.0, 2.5])
def test_mech2_bounds_every_atom_and_the_floor_keeps_it_apart(q_abs_ref):
    k2 = 50.0
    bound = k2 * max(q_abs_ref, 1.0)
    isv = _isv(Q_ABS_REF=q_abs_ref, V_CENTER_DIR=1e9, V_HALF_DIR=1e-30,
               V_CENTER_ORD=-3.0, V_HALF_ORD=1e12)
    out = live_support_build(isv, TINY.n_branches, NA, k2)
    assert np.all(np.abs(out.z) <= np.float32(bound) * (1 + 1e-6))
    assert np.all(np.diff(out.z, axis=1) > 0) and np.all(out.bounds[:, 2] > 0)
    # DIR: the half-width at its floor bound / 1024, the centre pushed to bound - half.
    half = bound / 1024
    np.testing.assert_allclose(out.z[0], _by_hand(bound - half, half, NA), rtol=1e-6)
    # ORD: the half-width capped at the bound, so the centre is 0.
    np.testing.assert_allclose(out.z[1], _by_hand(0.0, bound, NA), rtol=1e-6)


def test_nan_slots_are_finite_supports():
    isv = _isv(V_CENTER_DIR=np.nan, V_HALF_DIR=np.nan, Q_ABS_REF=np.nan)
    out = live_support_build(isv, TINY.n_branches, NA, 100.0)
    assert np.all(np.isfinite(out.z))
    np.testing.assert_allclose(out.z[0], _by_hand(0.0, 100.0 / 1024, NA), rtol=1e-6)


def test_config_errors_are_one_line():
    for kwargs, words in (({"adaptive_atoms": 1}, "adaptive_atoms=1"),
                          ({"adaptive_atoms": True, "q_stats": False}, "needs q_stats=True"),
                          ({"adaptive_atoms": True, "q_stats": True, "c51_warmup_epochs": 2},
                           "c51_warmup_epochs=2")):
        with pytest.raises(ValueError, match=words) as err:
            DQNConfig.preset("tiny", **kwargs)
        assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------ the step
def test_step_reads_each_branch_on_its_own_support():
    """Q, the projection's clip and the scalar targets of branch d use z[d] (by hand: the
    expected Q in float64 and the projected mean inside the live range)."""
    rng = np.random.default_rng(5)
    config = TINY
    from foxhunt.reference.layout import ParamLayout, init_params

    layout = ParamLayout(config)
    params = init_params(layout, 1)
    batch = Batch.random(config, rng)
    isv = _isv(V_CENTER_DIR=0.5, V_HALF_DIR=0.25, V_CENTER_ORD=-1.0, V_HALF_ORD=2.0)
    out = loss_and_grads(config, params, params.copy(), batch, isv=isv, layout=layout)
    zs = out["support"].z
    for d in range(config.n_branches):
        p = np.exp(out["online"].logp[d].astype(np.float64))
        np.testing.assert_allclose(out["q_s"][d], p[:config.batch_size] @ zs[d], rtol=1e-5,
                                   atol=1e-6)
        m = out["m"][d].astype(np.float64)
        np.testing.assert_allclose(m.sum(axis=1), 1.0, atol=1e-5)
        mean = m @ zs[d]
        assert np.all(mean >= zs[d, 0] - 1e-5) and np.all(mean <= zs[d, -1] + 1e-5)
        # Where nothing is clipped the projection preserves the mean of r + g z (SPEC 4).
        p_next = out["p_next"][d].astype(np.float64)
        tz = batch.r[:, None] + config.gammas[d] * (1 - batch.done[:, None]) * zs[d][None, :]
        inside = np.all((tz >= zs[d, 0]) & (tz <= zs[d, -1]), axis=1)
        np.testing.assert_allclose(mean[inside], (p_next * tz).sum(axis=1)[inside], atol=1e-4)


def test_atom_growth_mult_acts_with_adaptive_atoms():
    rng = np.random.default_rng(2)
    batch = Batch.random(TINY, rng)
    results = []
    for k2 in (100.0, 10.0):
        config = TINY.replace(atom_growth_mult=k2)
        trainer = Trainer(config, seed=1)
        trainer.isv.set("V_HALF_DIR", 30.0)  # beyond the smaller bound only
        results.append(trainer.step(batch).c51_loss)
    assert results[0] != results[1]


def _flagged(trainer) -> list[str]:
    return [s.name for s in sentinels.SENTINELS if trainer.flags[s.index]]


@pytest.mark.parametrize("half, fires", [(195.0, True), (150.0, False)])
def test_sentinel_47_sees_the_live_span(half, fires):
    """A planted half-width: max |z| = half against 190 * max(Q_ABS_REF, 1) = 190 (Q_ABS_REF
    is 0 at the cold start); Mech 2 allows it with atom_growth_mult 200."""
    config = TINY.replace(atom_growth_mult=200.0)
    trainer = Trainer(config, seed=1)
    trainer.isv.set("V_HALF_DIR", half)
    trainer.step(Batch.random(config, np.random.default_rng(0)))
    assert _flagged(trainer) == (["atom_span_max"] if fires else [])
    assert sentinels.index("atom_span_max") == 47


def test_fold_reset_returns_the_support_to_the_configured_range():
    config = TINY.replace(v_min=-3.0, v_max=7.0)
    trainer = Trainer(config, seed=1)
    rng = np.random.default_rng(4)
    for _ in range(3):
        trainer.step(Batch.random(config, rng))
    names = [s.name for s in isv_mod.REGISTRY if s.index in
             (*isv_mod.V_CENTER_INDICES, *isv_mod.V_HALF_INDICES)]
    moved = [trainer.isv_value(n) for n in names]
    assert moved != [2.0] * 4 + [5.0] * 4
    trainer.fold_boundary()
    for name in names:
        assert trainer.isv_value(name) == (2.0 if name.startswith("V_CENTER") else 5.0)
        assert isv_mod.slot(name).reset == isv_mod.FoldReset


# ------------------------------------------------------------------------------ the fast plan
FAST = DQNConfig.preset("tiny", precision="f32", readback_interval=1, q_stats=True,
                        adaptive_atoms=True)
#: Support slots away from the cold start: off-centre, narrower and wider than [v_min, v_max].
PLANTED = {"V_CENTER_DIR": 0.75, "V_HALF_DIR": 2.5, "V_CENTER_ORD": -4.0, "V_HALF_ORD": 30.0}


def _fast_launches(config, build):
    from foxhunt.fast.cpu_executor import CpuTrainer
    from foxhunt.fast.records import Launch, Parallel

    def walk(ops):
        for item in ops.items:
            if isinstance(item, Parallel):
                for side in (*item.sides, item.main):
                    yield from walk(side)
            elif isinstance(item, Launch):
                yield item
    t = CpuTrainer(config)
    try:
        return list(walk(build(t._engine.program)))
    finally:
        t.close()


def _compare_fast(config, state, batch):
    from foxhunt.conformance.step_compare import compare_step, run_step
    from foxhunt.fast.cpu_executor import CpuTrainer

    ref, fast = Trainer(config), CpuTrainer(config)
    for t in (ref, fast):
        t.load_state_dict({k: v.copy() for k, v in state.items()})
    try:
        ro, fo = run_step(ref, batch), run_step(fast, batch)
        flags = fast.flags.copy()
    finally:
        fast.close()
    bad = [r.message for r in compare_step(config, state, ro, fo) if not r.passed]
    assert not bad, "\n".join(bad)
    return ref, flags


@pytest.mark.parametrize("steps", [0, 3], ids=["fresh", "warm"])
def test_fast_step_on_the_live_support_matches_the_reference(steps):
    rng = np.random.default_rng(8)
    t = Trainer(FAST, seed=1)
    for _ in range(steps):
        t.step(Batch.random(FAST, rng))
    for name, value in PLANTED.items():
        t.isv.set(name, value)
    ref, _ = _compare_fast(FAST, t.state_dict(), Batch.random(FAST, rng))
    # the planted support was read: this step's Q differs from the fixed support's
    off = Trainer(FAST.replace(adaptive_atoms=False))
    off.load_state_dict(t.state_dict())
    states = Batch.random(FAST, rng).s
    assert not np.array_equal(ref.q_values(states)[0], off.q_values(states)[0])


def test_fast_sentinel_47_raises_exactly_that_flag():
    config = FAST.replace(atom_growth_mult=200.0)
    t = Trainer(config, seed=1)
    t.isv.set("V_HALF_DIR", 195.0)  # max |z| = 195 >= 190 * max(Q_ABS_REF = 0, 1)
    ref, flags = _compare_fast(config, t.state_dict(),
                               Batch.random(config, np.random.default_rng(1)))
    assert [s.name for s in sentinels.SENTINELS if flags[s.index]] == ["atom_span_max"]
    assert np.array_equal(flags, ref.flags)


def test_switch_off_adds_no_live_support_record_or_buffer():
    """adaptive_atoms off: no live-support buffer or launch; the consumers' fixed-support
    kernels (the branch-packed ones, c51_project_grad with its values). (Checked once against
    the plans before the switch existed: graph 1, graph 2 and the uploads described record
    for record identical for tiny/seed x f32/bf16 x {core, q_stats, every issue-19 switch,
    IQN + aux}.)"""
    from foxhunt.fast.cpu_executor import CpuEngine
    from foxhunt.fast.graph1_plan import gather_project_dueling, graph1_ops
    from foxhunt.fast.support_plan import EVAL_SUPPORT, MEMBERS, Z_BOUNDS, Z_LIVE

    live_buffers = {Z_LIVE, Z_BOUNDS, MEMBERS, *EVAL_SUPPORT}
    assert live_buffers - set(EVAL_SUPPORT) <= set(CpuEngine(FAST).layout.specs)
    assert not live_buffers & set(CpuEngine(FAST.replace(adaptive_atoms=False)).layout.specs)

    on = {item.kernel for item in _fast_launches(FAST, graph1_ops)}
    off = {item.kernel for item in _fast_launches(FAST.replace(adaptive_atoms=False),
                                                  graph1_ops)}
    live = {"live_support_build", "c51_project_grad_live", "expected_q", "cql_logit_grad"}
    assert live <= on and not live & off
    fixed = {"c51_gather_project_dueling_branches" if gather_project_dueling(FAST.replace(
        adaptive_atoms=False)) else "c51_project_grad", "cql_logit_grad_branches"}
    assert fixed <= off
    assert not fixed & on and "c51_gather_project_dueling_branches" not in on


def test_fast_q_values_read_the_live_support_of_the_current_isv():
    """The greedy forward (q_values, the collectors' act, the graph-mode walk) builds its own
    live support from the ISV of its start, as the reference's q_values does."""
    from foxhunt.fast.cpu_executor import CpuTrainer

    ref, fast = Trainer(FAST, seed=2), CpuTrainer(FAST, seed=2)
    states = np.random.default_rng(3).standard_normal((5, FAST.state_dim)).astype(np.float32)
    try:
        for name, value in PLANTED.items():
            ref.isv.set(name, value)
        fast.load_state_dict(ref.state_dict())
        for qr, qf in zip(ref.q_values(states), fast.q_values(states)):
            np.testing.assert_allclose(qf, qr, rtol=1e-5, atol=1e-5 * 30)
    finally:
        fast.close()


@pytest.mark.parametrize("backend", ["reference", "fast-cpu"])
def test_fold_reset_of_the_support_slots_in_both_backends(backend):
    from foxhunt.fast.cpu_executor import CpuTrainer

    config = FAST.replace(v_min=-3.0, v_max=7.0)
    t = (Trainer if backend == "reference" else CpuTrainer)(config, seed=1)
    rng = np.random.default_rng(4)
    for _ in range(3):
        t.step(Batch.random(config, rng))
    moved = t.state_dict()["isv"]
    t.fold_boundary()
    v = t.state_dict()["isv"]
    if hasattr(t, "close"):
        t.close()
    idx = [*isv_mod.V_CENTER_INDICES, *isv_mod.V_HALF_INDICES]
    assert [moved[i] for i in idx] != [2.0] * 4 + [5.0] * 4
    assert [v[i] for i in idx] == [2.0] * 4 + [5.0] * 4


def test_graph_mode_walk_acts_on_the_live_support():
    """The evaluator's graph-mode walk (the greedy forward per bar, its own live support from
    the ISV) equals the reference walk, whose q_values read the live support, with the cold
    support and with a planted one. (Branch d's support is affine in t with h > 0, so its
    argmax, hence the walk, is the same on both: the support reaches the policy through the
    learning targets; Q itself differs, test_fast_step_on_the_live_support...)"""
    from foxhunt.fast.cpu_executor import CpuTrainer
    from foxhunt.fast.evaluator import DeviceEvaluator
    from foxhunt.reference import loop
    from foxhunt.reference.kernels import env as env_kernels
    from foxhunt.reference.market import SyntheticMarket, market_features
    from foxhunt.reference.metrics import bar_seconds, bars_per_year

    config = DQNConfig.preset("tiny", q_stats=True, adaptive_atoms=True)
    trainer = CpuTrainer(config, seed=5)
    gen = np.random.default_rng(1)
    for _ in range(3):
        trainer.step(Batch.random(config, gen))
    bars = SyntheticMarket(7, 700).generate()
    feats = market_features(bars, loop.choose_windows(config.state_dim))
    per_year = bars_per_year(bar_seconds(bars.timestamp))
    segment = (500, 560)
    ev = DeviceEvaluator(trainer, env_kernels.market_tables(bars, feats), max_steps=60, chunk=8)
    try:
        for planted in (False, True):
            if planted:
                state = trainer.state_dict()
                for name, value in (("V_CENTER_DIR", 5.0), ("V_HALF_DIR", 0.5)):
                    state["isv"][isv_mod.slot(name).index] = value
                trainer.load_state_dict(state)
            got = ev.walk(*segment, per_year, equity=True).rewards
            want = loop.evaluate(trainer, bars, feats, config.state_dim, config.branches,
                                 *segment)
            assert np.array_equal(got.astype(np.float64), want["rewards"])
    finally:
        ev.close()
        trainer.close()
