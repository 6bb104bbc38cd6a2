"""Issue 19, part two, in the reference step: the switches, the gamma schedule's consumer, the
loop's ISV slots and fold resets of the produced slots (reference.isv_step)."""

import numpy as np
import pytest

from foxhunt.reference import isv as isv_mod
from foxhunt.reference import isv_step
from foxhunt.reference.batch import Batch
from foxhunt.reference.config import CORE_STEP, DQNConfig
from foxhunt.reference.trainer import Trainer

ALL_ON = dict(adaptive_signals=True, q_stats=True, gamma_schedule=True)
TINY = DQNConfig.preset("tiny", readback_interval=1)


def _state_after(config, state, batch):
    t = Trainer(config, seed=1)
    t.load_state_dict({k: v.copy() for k, v in state.items()})
    t.step(batch)
    return t.state_dict()


@pytest.mark.parametrize("kwargs, needle", [
    (dict(q_stats=1), "q_stats=1"),
    (dict(gamma_schedule="yes"), "gamma_schedule='yes'"),
    (dict(q_stats=True, branches=(2, 3)), "branches[0]=2"),
    (dict(gamma_schedule=True, branches=(3, 2, 2, 2, 2)), "at most 4 branches"),
])
def test_switch_errors_are_one_line_naming_the_field(kwargs, needle):
    with pytest.raises(ValueError) as err:
        DQNConfig.preset("tiny", **kwargs)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_every_switch_off_by_default_and_in_tiny_all_on_in_the_seed_preset():
    """The dataclass defaults and ``tiny`` are the core step; ``seed`` is the seeds' step, whose
    ISV bus is live (every producer switch and the adaptive atoms)."""
    for config in (DQNConfig(), TINY):
        assert isv_step.adaptive_on(config) == () and not config.adaptive_atoms
    seed = DQNConfig.preset("seed")
    assert isv_step.adaptive_on(seed) == tuple(isv_step.ADAPTIVE_SWITCHES) and seed.adaptive_atoms
    assert isv_step.adaptive_on(DQNConfig.preset("seed", **CORE_STEP)) == ()
    with pytest.raises(ValueError, match="c51_warmup_epochs=4; allowed 0 .*adaptive_atoms=false"):
        DQNConfig.preset("seed", c51_warmup_epochs=4)


def test_info_says_which_adaptive_mechanisms_each_preset_runs(capsys):
    from foxhunt.reference import cli

    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    every = ", ".join([*isv_step.ADAPTIVE_SWITCHES, "adaptive_atoms"])
    seed, tiny = out.split("\n  seed ")[1], out.split("\n  tiny ")[1]
    assert seed.split("\n")[2].strip() == f"adaptive: {every}"
    assert tiny.split("\n")[2].strip() == "adaptive: off"


def test_the_gamma_schedule_discounts_by_the_isv_slots_at_the_start():
    """With the schedule on, a step from an ISV holding gammas (0.7, 0.6) trains exactly as a
    step with the switch off and ``gamma=(0.7, 0.6)``; only the producer's slots differ."""
    rng = np.random.default_rng(5)
    base = Trainer(TINY, seed=1)
    base.step(Batch.random(TINY, rng))
    state = base.state_dict()
    isv = state["isv"]
    isv[isv_mod.GAMMA_INDICES[0]], isv[isv_mod.GAMMA_INDICES[1]] = np.float32(0.7), np.float32(0.6)
    batch = Batch.random(TINY, rng)
    on = _state_after(TINY.replace(gamma_schedule=True), state, batch)
    fixed = _state_after(TINY.replace(gamma=(float(np.float32(0.7)), float(np.float32(0.6)))),
                         state, batch)
    for key in on:
        if key != "isv":
            np.testing.assert_array_equal(on[key], fixed[key], err_msg=key)
    written = list(isv_mod.GAMMA_SEED_INDICES)
    keep = np.ones(isv_mod.ISV_LEN, bool)
    keep[written] = False
    assert on["isv"][keep].tobytes() == fixed["isv"][keep].tobytes()
    # The schedule at epoch 0 of TOTAL_EPOCHS 0: progress 0, the seed's base gammas.
    np.testing.assert_array_equal(on["isv"][written],
                                  np.array(isv_mod.GAMMA_SCHEDULE_BASE, np.float32))


def test_the_producers_write_their_slots_and_only_them():
    rng = np.random.default_rng(2)
    config = TINY.replace(**ALL_ON)
    t = Trainer(config, seed=1)
    t.set_loop_signals(total_epochs=40)
    t.set_epoch(20)
    before = t.isv.to_array()
    t.step(Batch.random(config, rng))
    after = t.isv.to_array()
    changed = set(np.flatnonzero(before.view(np.uint32) != after.view(np.uint32)).tolist())
    signals = set(range(13)) - {8, 9, 10, 11}  # the regime signals are reserved (stay 0)
    q_stats = {17, 19, 20, 21}
    quantiles = {50, 52, 54, 56}  # tiny has 2 branches: DIR (50/54) and ORD (52/56)
    # Every member's half-width moves (headroom 1.5 over the cold half-range); the centres of
    # the members no branch feeds (MAG 24, URG 26) stay at their cold 0 = (-10 + 10) / 2.
    support = set(range(23, 31)) - {24, 26}
    gamma = set(range(43, 47))
    existing = {isv_mod.Q_ABS_REF_INDEX, isv_mod.H_S2_RMS_EMA_INDEX,
                isv_mod.GRAD_NORM_SLOW_EMA_INDEX}
    assert changed == signals | q_stats | quantiles | support | gamma | existing
    # gamma at epoch 20 of 40: progress 20 / 39 of the way from base to max.
    p = np.float32(np.float32(20) / np.float32(39))
    for k, s in enumerate(isv_mod.GAMMA_SEED_INDICES):
        lo, hi = np.float32(isv_mod.GAMMA_SCHEDULE_BASE[k]), np.float32(isv_mod.GAMMA_SCHEDULE_MAX[k])
        assert abs(after[s] - (lo + (hi - lo) * p)) <= 1e-6


def test_fold_reset_returns_every_produced_slot_to_the_configured_cold_start():
    config = TINY.replace(gamma=(0.95, 0.9), cql_alpha=0.3, v_min=-4.0, v_max=6.0, **ALL_ON)
    t = Trainer(config, seed=1)
    t.set_loop_signals(total_epochs=12, sharpe_ema=1.5)
    t.set_epoch(5)
    rng = np.random.default_rng(0)
    for _ in range(3):
        t.step(Batch.random(config, rng))
    moved = t.isv.to_array()
    t.fold_boundary()
    v = t.isv.to_array()
    assert moved[isv_mod.GAMMA_INDICES[0]] != np.float32(0.95)  # the schedule had moved it
    assert v[isv_mod.GAMMA_INDICES[0]] == np.float32(0.95)
    assert v[isv_mod.GAMMA_INDICES[1]] == np.float32(0.9)
    assert v[isv_mod.CQL_ALPHA_INDEX] == np.float32(0.3)
    for m in range(isv_mod.MAX_ISV_BRANCHES):
        assert v[isv_mod.Q_P05_INDICES[m]] == np.float32(-4.0)
        assert v[isv_mod.Q_P95_INDICES[m]] == np.float32(6.0)
        assert v[isv_mod.V_CENTER_INDICES[m]] == np.float32(1.0)
        assert v[isv_mod.V_HALF_INDICES[m]] == np.float32(5.0)
    assert not v[:13].any() and not v[17:22].any()
    assert v[isv_mod.SHARPE_EMA_INDEX] == 0 and v[isv_mod.EPOCH_IDX_INDEX] == 0
    assert v[isv_mod.TOTAL_EPOCHS_INDEX] == 12  # SchemaContract: kept


def test_loop_signals_and_the_sharpe_ema():
    t = Trainer(TINY, seed=0)
    t.set_loop_signals(total_epochs=40)
    assert t.isv_value("TOTAL_EPOCHS") == 40.0
    t.set_loop_signals(sharpe_ema=-0.25)
    assert t.isv_value("SHARPE_EMA") == np.float32(-0.25)
    with pytest.raises(ValueError, match="epoch=-1"):
        t.set_loop_signals(total_epochs=-1)
    # 0.3 of the way from 1.0 to 2.0 (by hand); a NaN Sharpe keeps the EMA.
    assert abs(float(isv_step.sharpe_ema(1.0, 2.0)) - 1.3) < 1e-6
    assert isv_step.sharpe_ema(1.0, float("nan")) == np.float32(1.0)
