"""The issue-19 ISV producers (reference twins) against independent float64 / hand
computations, their NaN contracts, and the registry facts they rely on."""

from __future__ import annotations

import math

import numpy as np
import pytest

from foxhunt.reference import isv as reg
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.kernels import isv_producers as P
from foxhunt.reference.kernels.isv import isv_signal_update

F32 = np.float32
SIG = {n: i for i, n in enumerate(reg.SIGNAL_NAMES)}


def _isv(sharpe: float = 0.0) -> np.ndarray:
    vec = reg.ISVBus().to_array()
    vec[reg.SHARPE_EMA_INDEX] = F32(sharpe)
    return vec


def _rate(sharpe: float, base: float = 0.05) -> float:
    """The SPEC 7 rate, computed here in float64."""
    return base * (1 + 0.5 * min(2.0, abs(sharpe)))


def _ema(old: float, x: float, a: float) -> float:
    return (1 - a) * old + a * x


def _changed(before: np.ndarray, after: np.ndarray) -> set[int]:
    return set(np.flatnonzero(before.view(np.uint32) != after.view(np.uint32)).tolist())


# ------------------------------------------------------------------------- fixed-order sums
def test_lane_sum_and_finite_mean_match_float64():
    rng = np.random.default_rng(1)
    x = rng.standard_normal(1000).astype(F32)
    assert P.lane_sum(x) == pytest.approx(float(x.astype(np.float64).sum()), abs=1e-4)
    x[[3, 40, 999]] = [np.nan, np.inf, -np.inf]
    ok = np.isfinite(x)
    assert P.finite_mean(x) == pytest.approx(float(x[ok].astype(np.float64).mean()), rel=1e-5)
    assert np.isnan(P.finite_mean(np.full(7, np.nan, F32)))


def test_lane_sum_order_is_lanes_then_partials():
    # 33 ones and a 2^24 in lane 0: lane 0 holds 2^24 + 1 + 1 (each +1 rounds away), the
    # other lanes 1 each; the order decides the result, which is computed here by hand.
    x = np.ones(65, F32)
    x[0] = F32(2**24)
    lane0 = F32(F32(F32(2**24) + F32(1)) + F32(1))  # elements 0, 32, 64
    total = lane0
    for _ in range(31):
        total = F32(total + F32(2))  # lanes 1..31 hold elements t and t + 32
    assert P.lane_sum(x) == total


# ------------------------------------------------------------------------- isv_signal_build
def _signal_inputs():
    q_taken = np.array([[1.0, 3.0, np.nan, 2.0], [9.0, 9.0, 9.0, 9.0]], F32)
    td = np.array([0.5, 1.5, 2.5, np.inf], F32)
    r = np.array([-1.0, 1.0, 2.0, 2.0], F32)
    # Branch 0: every sample puts all mass on atom 2; branch 1: uniform over 4 atoms.
    p = np.zeros((2, 4, 4), F32)
    p[0, :, 2] = 1.0
    p[1] = 0.25
    z = np.array([[-3, -1, 1, 3], [-2, -1, 1, 2]], F32)
    return q_taken, td, r, p, z


def test_signal_build_formulas_by_hand():
    isv = _isv()
    for s, v in zip(reg.Q_DIR_ACTION_SLOTS, (1.0, 2.0, 3.0)):
        isv[s] = F32(v)
    isv[SIG["ENS_VAR_EMA"]] = F32(0.5)
    q_taken, td, r, p, z = _signal_inputs()
    sig = P.isv_signal_build(isv, q_taken, td, r, p, z, 7.5, 1.25)
    q_ema = 2.0
    drift = (2.0 - q_ema) / 2.0  # finite mean of 1, 3, 2 is 2
    var0 = 0.0  # a point mass
    var1 = np.mean(np.array([-2, -1, 1, 2.0]) ** 2)  # uniform, mean 0
    var = (4 * var0 + 4 * var1) / 8
    used = 1 + 4  # branch 0 only atom 2; branch 1 all four (0.25 >= 0.1 / 4)
    util = used / 8
    assert sig[SIG["Q_DRIFT"]] == pytest.approx(drift, abs=1e-7)
    assert sig[SIG["GRAD_NORM_EMA"]] == F32(7.5)
    assert sig[SIG["TD_ERR_EMA"]] == pytest.approx(1.5)
    assert sig[SIG["ENS_VAR_EMA"]] == pytest.approx(var, rel=1e-6)
    assert sig[SIG["ENS_VAR_VEL"]] == pytest.approx(var - 0.5, rel=1e-6)
    assert sig[SIG["REWARD_EMA"]] == pytest.approx(1.0)
    assert sig[SIG["ATOM_UTIL_EMA"]] == pytest.approx(util)
    assert sig[SIG["LOSS_EMA"]] == F32(1.25)
    assert sig[SIG["LEARNING_HEALTH"]] == pytest.approx(util / (1 + abs(drift)))
    for name in ("ADX_EMA", "REGIME_DISAGREE", "REGIME_VEL_EMA", "REGIME_STABILITY"):
        assert sig[SIG[name]] == 0.0


def test_signal_build_drift_uses_the_floor_and_its_sign():
    isv = _isv()  # the Q EMA slots are 0: the divisor is the 0.1 floor
    q_taken, td, r, p, z = _signal_inputs()
    q_taken[0] = -0.3
    sig = P.isv_signal_build(isv, q_taken, td, r, p, z, 1.0, 1.0)
    assert sig[SIG["Q_DRIFT"]] == pytest.approx(-0.3 / 0.1, rel=1e-6)


def test_signal_build_nan_contract_and_the_update_keeps_the_slots():
    isv = _isv()
    isv[: reg.NUM_SIGNALS] = F32(0.75)
    q_taken, td, r, p, z = _signal_inputs()
    q_taken[0] = np.nan
    td[:] = np.nan
    p[1, :, 0] = np.nan  # every sample of branch 1 has a NaN: its variance is skipped
    sig = P.isv_signal_build(isv, q_taken, td, r, p, z, float("nan"), 2.0)
    assert np.isnan(sig[SIG["Q_DRIFT"]]) and np.isnan(sig[SIG["TD_ERR_EMA"]])
    assert np.isnan(sig[SIG["GRAD_NORM_EMA"]]) and np.isnan(sig[SIG["LEARNING_HEALTH"]])
    assert sig[SIG["ENS_VAR_EMA"]] == 0.0  # only branch 0's point masses remain
    # Branch 1's atom 0 has no finite value (unused); atoms 1-3 keep 0.25 each.
    assert sig[SIG["ATOM_UTIL_EMA"]] == pytest.approx(4 / 8)
    out = isv_signal_update(isv, sig, 0.0, 0.05)
    for name in ("Q_DRIFT", "TD_ERR_EMA", "GRAD_NORM_EMA", "LEARNING_HEALTH"):
        assert out[SIG[name]] == F32(0.75)
    assert np.all(np.isfinite(out))


def test_signal_build_rejects_mismatched_shapes():
    q_taken, td, r, p, z = _signal_inputs()
    with pytest.raises(ValueError, match="td"):
        P.isv_signal_build(_isv(), q_taken, td[:-1], r, p, z, 1.0, 1.0)
    with pytest.raises(ValueError, match="z"):
        P.isv_signal_build(_isv(), q_taken, td, r, p, z[:, :3], 1.0, 1.0)


# ------------------------------------------------------------------------- q_stats_update
@pytest.mark.parametrize("sharpe", [0.0, 1.0, -3.0])
def test_q_stats_update_matches_float64(sharpe):
    rng = np.random.default_rng(2)
    q = (rng.standard_normal((37, 3)) * 4).astype(F32)
    q[5, 1] = np.nan
    isv = _isv(sharpe)
    for s in (*reg.Q_DIR_ACTION_SLOTS, reg.Q_DIR_ABS_REF_INDEX):
        isv[s] = F32(rng.standard_normal())
    out = P.q_stats_update(isv, q, 0.05)
    a = _rate(sharpe)
    q64 = q.astype(np.float64)
    for action, slot in enumerate(reg.Q_DIR_ACTION_SLOTS):
        col = q64[:, action][np.isfinite(q64[:, action])]
        assert out[slot] == pytest.approx(_ema(float(isv[slot]), col.mean(), a), rel=1e-5, abs=1e-6)
    absq = np.abs(q64[np.isfinite(q64)])
    s = reg.Q_DIR_ABS_REF_INDEX
    assert out[s] == pytest.approx(_ema(float(isv[s]), absq.mean(), a), rel=1e-5)
    assert _changed(isv, out) <= {*reg.Q_DIR_ACTION_SLOTS, s}


def test_q_stats_mapping_short_flat_long():
    assert reg.Q_DIR_ACTION_SLOTS == (17, 20, 19)  # the seed's Short, Flat, Long
    q = np.tile(np.array([[-4.0, 0.5, 8.0]], F32), (4, 1))
    out = P.q_stats_update(_isv(), q, 0.5)  # alpha 0.5 from 0
    assert (out[17], out[20], out[19]) == (F32(-2.0), F32(0.25), F32(4.0))
    assert out[18] == 0.0  # Hold: reserved


def test_q_stats_nan_column_keeps_its_slot():
    q = np.ones((4, 3), F32)
    q[:, 0] = np.nan
    isv = _isv()
    isv[17] = F32(3.0)
    out = P.q_stats_update(isv, q, 0.05)
    assert out[17] == F32(3.0)
    assert out[20] != isv[20]


# ------------------------------------------------------------------------- q_quantile_update
@pytest.mark.parametrize("n", [1, 2, 20, 257 * 3])
def test_quantiles_are_numpy_lower_percentiles(n):
    rng = np.random.default_rng(n)
    q = np.round(rng.standard_normal((n, 1)) * 3, 1).astype(F32)  # rounding makes ties
    isv = _isv()
    out = P.q_quantile_update(isv, q, 0, 0.5)
    vals = q.ravel().astype(np.float64)
    for pct, slot in ((5, reg.Q_P05_INDICES[0]), (95, reg.Q_P95_INDICES[0])):
        expect = np.percentile(vals, pct, method="inverted_cdf" if n == 1 else "lower")
        rank = (pct * (n - 1)) // 100
        assert np.sort(vals)[rank] == pytest.approx(expect)
        assert out[slot] == pytest.approx(0.5 * float(isv[slot]) + 0.5 * expect, rel=1e-6)


def test_quantiles_branch_mapping_and_nan_contract():
    q = np.arange(100, dtype=F32).reshape(50, 2)
    q[0, 0] = np.nan
    q[1, 1] = np.inf
    isv = _isv()
    out = P.q_quantile_update(isv, q, 1, 0.05)  # branch 1 (order) -> ORD slots 52 / 56
    assert _changed(isv, out) == {52, 56}
    finite = np.sort(q[np.isfinite(q)])
    a = 0.05
    assert out[52] == pytest.approx(_ema(-10.0, finite[(5 * 97) // 100], a), rel=1e-6)
    assert out[56] == pytest.approx(_ema(10.0, finite[(95 * 97) // 100], a), rel=1e-6)
    none = P.q_quantile_update(isv, np.full((3, 2), np.nan, F32), 2, 0.05)
    assert none.view(np.uint32).tolist() == isv.view(np.uint32).tolist()


def test_quantile_negative_zero_counts_as_positive_zero():
    q = np.array([[-0.0]], F32)
    isv = _isv()
    isv[reg.Q_P05_INDICES[0]] = F32(-0.0)
    out = P.q_quantile_update(isv, q, 0, 0.5)
    assert not np.signbit(out[reg.Q_P95_INDICES[0]]) and out[reg.Q_P95_INDICES[0]] == 5.0


# ------------------------------------------------------------------------- adaptive support
def _support_isv(lo, hi, q_abs_ref=0.0):
    isv = _isv()
    isv[reg.Q_ABS_REF_INDEX] = F32(q_abs_ref)
    for k in range(reg.MAX_ISV_BRANCHES):
        isv[reg.Q_P05_INDICES[k]] = F32(lo)
        isv[reg.Q_P95_INDICES[k]] = F32(hi)
    return isv


def test_support_centre_and_half_width_by_hand():
    out = P.adaptive_support_update(_support_isv(-2.0, 6.0), 100.0, 1.25, 1.0)
    assert out[reg.V_CENTER_INDICES[0]] == 2.0 and out[reg.V_HALF_INDICES[0]] == 5.0
    narrow = P.adaptive_support_update(_support_isv(3.0, 3.2), 100.0, 1.0, 1.0)
    assert narrow[reg.V_HALF_INDICES[2]] == 1.0  # the half-width floor


def test_support_mech2_bound_uses_the_signal_floor():
    # bound = 2 * max(0.5, 1) = 2: the half-width is cut to 2, so the centre must be 0.
    out = P.adaptive_support_update(_support_isv(-2.0, 6.0, q_abs_ref=0.5), 2.0, 1.25, 1.0)
    assert out[reg.V_HALF_INDICES[0]] == 2.0 and out[reg.V_CENTER_INDICES[0]] == 0.0
    # bound = 2 * 3 = 6: half 5 fits, the centre 2 is cut to the room 1.
    out = P.adaptive_support_update(_support_isv(-2.0, 6.0, q_abs_ref=3.0), 2.0, 1.25, 1.0)
    assert out[reg.V_HALF_INDICES[1]] == 5.0 and out[reg.V_CENTER_INDICES[1]] == 1.0
    nan_ref = P.adaptive_support_update(_support_isv(-2.0, 6.0, q_abs_ref=np.nan), 2.0, 1.25, 1.0)
    assert nan_ref[reg.V_HALF_INDICES[0]] == 2.0  # a NaN signal counts as the floor 1


def test_support_atoms_never_exceed_the_bound():
    rng = np.random.default_rng(5)
    for _ in range(200):
        lo, hi = sorted(rng.uniform(-500, 500, 2))
        ref = float(rng.uniform(0, 4))
        k2 = float(rng.uniform(1, 50))
        out = P.adaptive_support_update(_support_isv(lo, hi, ref), k2, 1.25, 1.0)
        bound = k2 * max(ref, 1.0)
        for k in range(reg.MAX_ISV_BRANCHES):
            c, h = float(out[reg.V_CENTER_INDICES[k]]), float(out[reg.V_HALF_INDICES[k]])
            assert h >= 0 and abs(c) + h <= bound * (1 + 1e-6)


def test_support_nonfinite_percentile_keeps_the_member():
    isv = _support_isv(-2.0, 6.0)
    isv[reg.Q_P95_INDICES[3]] = np.inf
    out = P.adaptive_support_update(isv, 100.0, 1.25, 1.0)
    assert out[reg.V_CENTER_INDICES[3]] == isv[reg.V_CENTER_INDICES[3]]
    assert out[reg.V_HALF_INDICES[3]] == isv[reg.V_HALF_INDICES[3]]
    for k in range(3):  # the other members move to centre 2, half-width 5
        assert out[reg.V_CENTER_INDICES[k]] == 2.0 and out[reg.V_HALF_INDICES[k]] == 5.0


# ------------------------------------------------------------------------- schedules
GB = np.array(reg.GAMMA_SCHEDULE_BASE, F32)
GM = np.array(reg.GAMMA_SCHEDULE_MAX, F32)


@pytest.mark.parametrize("epoch, total, frac", [(0, 10, 0.0), (9, 10, 1.0), (3, 7, 0.5),
                                                (20, 10, 1.0), (0, 0, 0.0), (np.nan, 10, 0.0)])
def test_gamma_schedule(epoch, total, frac):
    isv = _isv()
    isv[reg.EPOCH_IDX_INDEX] = F32(epoch)
    isv[reg.TOTAL_EPOCHS_INDEX] = F32(total)
    out = P.per_branch_gamma_update(isv, GB, GM)
    seed = [(0.92, 0.99), (0.88, 0.95), (0.85, 0.93), (0.80, 0.90)]  # seed 002's table
    for slot, (b, m) in zip(range(43, 47), seed):
        assert out[slot] == pytest.approx(b + (m - b) * frac, abs=1e-6)
    assert _changed(isv, out) <= set(range(43, 47))


@pytest.mark.parametrize("eps, target", [(0.25, 1.5 * 0.75), (1.0, 0.0), (-0.5, 1.5), (3.0, 0.0)])
def test_cql_alpha_ramp(eps, target):
    isv = _isv(sharpe=2.0)
    isv[reg.EPSILON_EFF_INDEX] = F32(eps)
    isv[reg.CQL_ALPHA_INDEX] = F32(0.4)
    out = P.cql_alpha_ramp(isv, 1.5, 0.05)
    assert out[reg.CQL_ALPHA_INDEX] == pytest.approx(_ema(0.4, target, _rate(2.0)), rel=1e-6)
    isv[reg.EPSILON_EFF_INDEX] = np.nan
    assert P.cql_alpha_ramp(isv, 1.5, 0.05)[reg.CQL_ALPHA_INDEX] == F32(0.4)


@pytest.mark.parametrize("sched, health", [(1.0, 1.0), (0.4, 0.5), (0.05, 0.0), (0.4, np.nan),
                                           (0.4, 7.0), (0.7, -1.0)])
def test_epsilon_tau(sched, health):
    isv = _isv()
    isv[SIG["LEARNING_HEALTH"]] = F32(health)
    out = P.epsilon_tau_update(isv, np.array([sched, 1.0], F32), 0.005)
    h = 1.0 if math.isnan(health) else min(max(health, 0.0), 1.0)
    # the schedule is the floor; a poor health explores up to twice it, capped at 1.
    assert out[reg.EPSILON_EFF_INDEX] == pytest.approx(min(sched * (2 - h), 1.0), rel=1e-6)
    assert out[reg.TAU_EFF_INDEX] == pytest.approx(0.005 * (0.5 + 0.5 * h), rel=1e-6)
    assert _changed(isv, out) <= {reg.EPSILON_EFF_INDEX, reg.TAU_EFF_INDEX}
    capped = P.epsilon_tau_update(isv, np.array([sched, 0.3], F32), 0.005)
    assert capped[reg.EPSILON_EFF_INDEX] == pytest.approx(min(sched * (2 - h), 0.3), rel=1e-6)


@pytest.mark.parametrize("schedule", [np.array([0.5], F32), np.array([0.5, 1.5], F32),
                                      np.array([np.nan, 1.0], F32), [0.5, 1.0]])
def test_epsilon_tau_rejects_a_bad_schedule(schedule):
    with pytest.raises(ValueError, match="schedule"):
        P.epsilon_tau_update(_isv(), schedule, 0.005)


# ------------------------------------------------------------------------- registry facts
def test_every_producer_writes_exactly_its_registry_slots():
    """A run of each kernel on a vector that makes every produced slot move changes exactly
    the non-reserved slots the registry names it the producer of."""
    rng = np.random.default_rng(9)
    isv = _isv(sharpe=0.7)
    isv[reg.TOTAL_EPOCHS_INDEX] = F32(10)
    isv[reg.EPOCH_IDX_INDEX] = F32(4)
    isv[SIG["LEARNING_HEALTH"]] = F32(0.6)
    isv[reg.EPSILON_EFF_INDEX] = F32(0.3)
    for k in range(reg.MAX_ISV_BRANCHES):
        isv[reg.Q_P05_INDICES[k]] = F32(-3 - k)
        isv[reg.Q_P95_INDICES[k]] = F32(4 + k)
    q4 = (rng.standard_normal((16, 3)) * 3).astype(F32)
    runs = {
        "q_stats_update": P.q_stats_update(isv, q4, 0.05),
        "adaptive_support_update": P.adaptive_support_update(isv, 100.0, 1.25, 1.0),
        "per_branch_gamma_update": P.per_branch_gamma_update(isv, GB, GM),
        "cql_alpha_ramp": P.cql_alpha_ramp(isv, 2.0, 0.05),
        "epsilon_tau_update": P.epsilon_tau_update(isv, np.array([0.5, 1.0], F32), 0.005),
    }
    quant = isv
    for b in range(reg.MAX_ISV_BRANCHES):
        quant = P.q_quantile_update(quant, q4, b, 0.05)
    runs["q_quantile_update"] = quant
    for name, out in runs.items():
        declared = {s.index for s in reg.REGISTRY if s.producer == name}
        assert declared and _changed(isv, out) == declared, name
    q_taken, td, r, p, z = _signal_inputs()
    sig = P.isv_signal_build(isv, q_taken, td, r, p, z, 1.0, 1.0)
    written = set(np.flatnonzero(sig != 0).tolist())
    signal_slots = {s.index for s in reg.REGISTRY if s.producer == "isv_signal_update"}
    assert written <= signal_slots
    reserved = {s.index for s in reg.REGISTRY if reg.is_reserved(s)}
    assert {8, 9, 10, 11, 13, 14, 15, 18} == reserved


def test_config_cold_starts_and_fold_reset_restore_the_configured_values():
    cfg = DQNConfig.preset("tiny", v_min=-5.0, v_max=15.0, cql_alpha=0.3, gamma=0.9)
    bus = reg.bus_for(cfg)
    for k in range(reg.MAX_ISV_BRANCHES):
        member = reg.PER_BRANCH_ORDER[k]
        assert bus.get(f"Q_P05_{member}") == F32(-5.0) and bus.get(f"Q_P95_{member}") == F32(15.0)
        assert bus.get(f"V_CENTER_{member}") == F32(5.0) and bus.get(f"V_HALF_{member}") == F32(10.0)
    values = P.per_branch_gamma_update(bus.to_array(), GB, GM)
    values = P.cql_alpha_ramp(values, 0.3, 0.05)
    values[reg.Q_P05_INDICES[0]] = F32(-1.0)
    bus.from_array(values)
    assert bus.get("GAMMA_DIR_EFF") == F32(0.92)
    bus.fold_reset()
    assert bus.get("GAMMA_DIR_EFF") == F32(0.9) and bus.get("CQL_ALPHA") == F32(0.3)
    assert bus.get("Q_P05_DIR") == F32(-5.0)
