"""Second wave (issue 18): the auxiliary labels (market -> env -> replay -> batch), and the
step-level composition of the second-wave sources."""

import dataclasses
import math

import numpy as np
import pytest

from foxhunt.reference import market
from foxhunt.reference.batch import Batch
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.env import BranchingEnv
from foxhunt.reference.loop import LoopSettings, run
from foxhunt.reference.market import Bars, SyntheticMarket, causal_regime_labels, regime_labels
from foxhunt.reference.replay import ReplayBuffer

TINY = DQNConfig.preset("tiny")


# -------------------------------------------------------------------------------- labels


def _bars(close, regime=None) -> Bars:
    close = np.asarray(close, np.float64)
    n = close.shape[0]
    return Bars(np.arange(n) * 60, close, close * 1.001, close * 0.999, close, np.ones(n), regime)


def _labels_by_loop(close, window, lookback):
    """The README's rule, one bar at a time in plain Python floats (an independent method)."""
    r = [0.0] + [close[t] / close[t - 1] - 1.0 for t in range(1, len(close))]
    vols, out = [], []
    for t in range(len(close)):
        recent = r[max(0, t - window + 1): t + 1]
        trend = sum(recent)
        vols.append(math.sqrt(sum(x * x for x in recent) / len(recent)))
        ranked = vols[max(0, t - lookback + 1): t + 1]
        below = sum(v < vols[t] for v in ranked)
        if 3 * below >= 2 * len(ranked):
            out.append(market.REGIME_MEAN_REVERT)
        else:
            out.append(market.REGIME_TREND_UP if trend >= 0 else market.REGIME_TREND_DOWN)
    return out


def test_causal_regime_labels_by_hand():
    # window 2, lookback 3. r = [0, .01, -.0099, .04, 0, -.05, -.001, -.001];
    # vol = sqrt(mean r^2 of 2) = [0, .0071, .0099, .0291, .0283, .0354, .03536, .001];
    # high iff 3 * #(trailing vols below vol_t) >= 2 * #(trailing vols), else the trend sign.
    close = [100.0, 101.0, 100.0, 104.0, 104.0, 98.8, 98.7012, 98.6024988]
    labels = causal_regime_labels(_bars(close), window=2, lookback=3)
    assert labels.dtype == np.int8
    assert labels.tolist() == [0, 0, 2, 2, 0, 2, 2, 1]
    # Halving every bar (exact in f32): r = -0.5 from bar 1, vol = [0, .354, .408, .5, .5, ...]
    # with window 3; lookback 4 ranks bar 3 high (3 of 4 below), then ties are not "below".
    halving = 4096.0 * 0.5 ** np.arange(8)
    assert causal_regime_labels(_bars(halving), window=3, lookback=4).tolist() == \
        [0, 1, 2, 2, 1, 1, 1, 1]


@pytest.mark.parametrize("window,lookback", [(20, 500), (5, 7), (1, 1), (3, 4100)])
def test_causal_regime_labels_match_a_plain_loop(window, lookback):
    bars = SyntheticMarket(3, 1200).generate()
    plain = _bars(bars.close)  # no labels: the CSV case
    expect = _labels_by_loop(bars.close.astype(np.float64).tolist(), window, lookback)
    assert causal_regime_labels(plain, window, lookback).tolist() == expect


def test_causal_regime_labels_use_past_bars_only():
    bars = _bars(SyntheticMarket(4, 2000).generate().close)
    full = causal_regime_labels(bars)
    for cut in (1, 2, 21, 499, 501, 1234):
        assert np.array_equal(causal_regime_labels(bars.slice(0, cut)), full[:cut])
    changed = bars.close.copy()
    changed[1500:] *= 1.7
    later = causal_regime_labels(_bars(changed))
    assert np.array_equal(later[:1500], full[:1500]) and not np.array_equal(later, full)


def test_causal_regime_labels_find_the_synthetic_regimes():
    """The CSV rule is a proxy: on the synthetic market it agrees with the true regimes far
    above chance (1/3)."""
    bars = SyntheticMarket(5, 20_000).generate()
    guess = causal_regime_labels(_bars(bars.close))
    assert np.mean(guess == bars.regime) > 0.5


def test_regime_labels_prefer_the_market_own_and_reject_bad_arguments():
    bars = SyntheticMarket(6, 300).generate()
    assert regime_labels(bars) is bars.regime
    plain = _bars(bars.close)
    assert np.array_equal(regime_labels(plain), causal_regime_labels(plain))
    for kw, name in (({"window": 0}, "window"), ({"lookback": 1.5}, "lookback")):
        with pytest.raises(ValueError, match=f"{name}: .* need an integer >= 1"):
            causal_regime_labels(plain, **kw)


@pytest.mark.parametrize("labelled", [True, False])
def test_env_info_carries_the_next_bar_return_and_the_regime_of_bar_t(labelled):
    source = SyntheticMarket(7, 400).generate()
    bars = source if labelled else _bars(source.close)
    expect_regime = source.regime if labelled else causal_regime_labels(bars)
    env = BranchingEnv(bars, state_dim=64, n_envs=3, branches=(3, 2), seed=1)
    env.reset(np.array([100, 200, 300]))
    for _ in range(5):
        t = env.t.copy()
        _, _, _, info = env.step(np.zeros((3, 2), np.int32))
        c, c1 = bars.close[t].astype(np.float64), bars.close[t + 1].astype(np.float64)
        np.testing.assert_allclose(info["ret"], (c1 - c) / c, rtol=2e-7)
        assert info["regime"].tolist() == expect_regime[t].tolist()


def test_replay_stores_and_samples_the_labels():
    cfg = TINY.replace(batch_size=8)
    buf = ReplayBuffer(cfg, 16)
    rng = np.random.default_rng(0)
    src = Batch.random(cfg.replace(batch_size=12), rng)
    next_ret = np.arange(12, dtype=np.float32) / 100
    regime = np.arange(12, dtype=np.int32) % 3
    buf.add(src.s, src.a, src.r, src.s2, src.done, next_ret=next_ret, regime=regime)
    batch, idx = buf.sample(rng)
    assert batch.next_ret.dtype == np.float32 and batch.regime.dtype == np.int32
    assert np.array_equal(batch.next_ret, next_ret[idx])
    assert np.array_equal(batch.regime, regime[idx])
    assert np.array_equal(batch.s, src.s[idx])  # the labels travel with their transitions
    # The ring wraps: transitions 12..16 land in slots 12..15 and 0 with their labels.
    buf.add(src.s[:5], src.a[:5], src.r[:5], src.s2[:5], src.done[:5],
            next_ret=np.full(5, -1.0, np.float32), regime=np.full(5, 2, np.int32))
    assert buf.next_ret[[12, 13, 14, 15, 0]].tolist() == [-1.0] * 5
    assert buf.regime[:4].tolist() == [2, 1, 2, 0] and buf.next_ret[1] == np.float32(0.01)
    restored = ReplayBuffer(cfg, 16)
    restored.load_state(buf.state())
    assert np.array_equal(restored.next_ret, buf.next_ret)
    assert np.array_equal(restored.regime, buf.regime)
    with pytest.raises(TypeError, match="next_ret"):
        buf.add(src.s, src.a, src.r, src.s2, src.done)  # labels are not optional here


def test_batch_random_fills_labels_in_range():
    cfg = TINY.replace(n_regimes=5, aux_regime_weight=0.1, aux_next_bar_weight=0.1)
    b = Batch.random(cfg, np.random.default_rng(1))
    assert b.next_ret.shape == (cfg.batch_size,) and b.next_ret.dtype == np.float32
    assert np.isfinite(b.next_ret).all() and 0 < np.abs(b.next_ret).max() < 0.1
    assert b.regime.dtype == np.int32 and set(b.regime.tolist()) == set(range(5))


def test_batch_labels_are_validated():
    cfg = TINY.replace(aux_regime_weight=0.1, aux_next_bar_weight=0.1)
    b = Batch.random(cfg, np.random.default_rng(2))
    # Missing labels: fine while their head is off, one line naming the weight otherwise.
    core = dataclasses.replace(b, next_ret=None, regime=None)
    assert core.validate(TINY) is core
    with pytest.raises(ValueError, match=r"batch.next_ret: missing; aux_next_bar_weight=0.1"):
        core.validate(cfg)
    with pytest.raises(ValueError, match=r"batch.regime: missing; aux_regime_weight=0.1"):
        dataclasses.replace(b, regime=None).validate(cfg)
    with pytest.raises(ValueError, match=r"batch.regime: dtype int64, expected int32"):
        dataclasses.replace(b, regime=b.regime.astype(np.int64)).validate(cfg)
    with pytest.raises(ValueError, match=r"batch.next_ret: shape \(31,\)"):
        dataclasses.replace(b, next_ret=b.next_ret[:-1]).validate(TINY)
    for bad in (-1, 3, 127):
        regime = b.regime.copy()
        regime[7] = bad
        with pytest.raises(ValueError, match=rf"batch.regime\[7\]={bad}: regime ids must be in "
                                             r"\[0, 2\] \(n_regimes=3\)"):
            dataclasses.replace(b, regime=regime).validate(cfg)
        # The range belongs to the regime head: with it off the ids are not read.
        dataclasses.replace(b, regime=regime).validate(TINY)
    # A non-finite next-bar return is data (masked out of the loss), not an error.
    next_ret = b.next_ret.copy()
    next_ret[3] = np.nan
    dataclasses.replace(b, next_ret=next_ret).validate(cfg)


def test_loop_feeds_the_env_labels_to_the_trainer(monkeypatch):
    from foxhunt.reference.trainer import Trainer

    seen = []
    step = Trainer.step

    def spy(self, batch):
        seen.append(batch)
        return step(self, batch)

    monkeypatch.setattr(Trainer, "step", spy)
    bars = SyntheticMarket(8, 1600).generate()
    settings = LoopSettings(folds=1, epochs=1, steps_per_epoch=3, n_envs=2, warmup_transitions=64,
                            replay_capacity=256, seed=3)
    run(TINY, bars, settings)
    assert len(seen) == 3
    c = bars.close  # f32: each label is some bar's f32 return (C' - P) / P
    rets = set(((c[1:] - c[:-1]) / c[:-1]).tolist())
    for b in seen:
        assert b.regime.dtype == np.int32 and set(b.regime.tolist()) <= {0, 1, 2}
        assert set(b.next_ret.tolist()) <= rets
        assert np.abs(b.next_ret).max() > 0  # not the replay's zero fill


def test_loop_refuses_too_few_regime_classes():
    bars = SyntheticMarket(9, 1600).generate()
    cfg = TINY.replace(aux_regime_weight=0.1, n_regimes=2)
    assert int(bars.regime.max()) == 2
    with pytest.raises(ValueError, match=r"n_regimes=2: the market's regime labels reach 2; "
                                         r"need n_regimes >= 3"):
        run(cfg, bars, LoopSettings(folds=1, epochs=1, steps_per_epoch=1))


# -------------------------------------------------------------------------------- the step
from foxhunt.reference import isv as isv_mod  # noqa: E402
from foxhunt.reference import step as step_mod  # noqa: E402
from foxhunt.reference.kernels import optim  # noqa: E402
from foxhunt.reference.layout import ParamLayout  # noqa: E402
from foxhunt.reference.trainer import Trainer  # noqa: E402

#: The composition functions of the sources (helpers A and B) as the step module sees them.
SOURCE_FUNCTIONS = ("iqn_loss_and_grads", "aux_loss_and_grads", "ens_loss_and_grads", "mse_blend")


def _norm64(x: np.ndarray) -> float:
    x64 = x.astype(np.float64)
    return float(np.sqrt(np.sum(np.where(np.isfinite(x64), x64, 0.0) ** 2)))


def _clipped64(x: np.ndarray, budget: float) -> np.ndarray:
    n = _norm64(x)
    s = budget / n if n > budget and n > 0 else 1.0
    x64 = x.astype(np.float64)
    return np.where(np.isfinite(x64), x64 * s, 0.0)


def _capture_adam(monkeypatch) -> list[dict]:
    """Record every ``optim.adam_update`` call of the trainer (its grad and grad_scale)."""
    calls = []
    real = optim.adam_update

    def spy(param, grad, m, v, **kw):
        calls.append({"n": param.shape[0], "grad": grad.copy(), **kw})
        return real(param, grad, m, v, **kw)

    monkeypatch.setattr(optim, "adam_update", spy)
    return calls


def _state_bits(trainer: Trainer) -> dict[str, bytes]:
    return {k: v.tobytes() for k, v in trainer.state_dict().items()}


@pytest.mark.parametrize("lam", [1.0, 0.3])
@pytest.mark.parametrize("mgn", [10.0, 1e-3])
def test_iqn_step_composes_the_budgets_and_its_own_adam(lam, mgn, monkeypatch):
    """With only IQN on, the main Adam's gradient is clip(c51, .70 mgn) + clipped(cql, .15 mgn)
    + lambda * clipped(iqn trunk, .10 mgn) over [0, trunk_end), recomputed here in float64 from
    ``loss_and_grads``' raw parts; the IQN head's Adam gets the head gradient over its range with
    its own clip at mgn."""
    config = TINY.replace(lambda_iqn=lam, max_grad_norm=mgn)
    trainer = Trainer(config, seed=4)
    rng = np.random.default_rng(9)
    for _ in range(2):
        trainer.step(Batch.random(config, rng))
    batch = Batch.random(config, rng)
    lay = trainer.layout
    isv = trainer.isv.to_array()
    h2_bound = np.float32(config.h2_clamp_mult * max(float(isv[isv_mod.H_S2_RMS_EMA_INDEX]), 1.0))
    raw = step_mod.loss_and_grads(config, trainer.params.copy(), trainer.target.copy(), batch,
                                  q_abs_ref=isv[isv_mod.Q_ABS_REF_INDEX], h2_bound=h2_bound,
                                  layout=lay, isv=isv, step=trainer.step_count, seed=4)
    calls = _capture_adam(monkeypatch)
    trainer.step(batch)
    assert [c["n"] for c in calls] == [lay.main_adam_end, lay.iqn_range[1] - lay.iqn_range[0]]
    expect = _clipped64(raw["grad_c51"], 0.70 * mgn) + _clipped64(raw["grad_cql"], 0.15 * mgn)
    T = lay.trunk_end
    expect[:T] += lam * _clipped64(raw["iqn"].trunk_grad_clean[:T], 0.10 * mgn)
    np.testing.assert_allclose(calls[0]["grad"], expect[:lay.main_adam_end], rtol=2e-5,
                               atol=1e-6 * mgn)
    assert np.abs(raw["iqn"].trunk_grad_clean[:T]).max() > 0  # the IQN part is really there
    assert not raw["iqn"].trunk_grad_clean[T:].any()
    head = raw["iqn"].head_grad[slice(*lay.iqn_range)]
    np.testing.assert_array_equal(calls[1]["grad"], head)
    n = _norm64(head)
    np.testing.assert_allclose(calls[1]["grad_scale"], mgn / n if n > mgn else 1.0, rtol=1e-6)
    assert calls[1]["step"] == calls[0]["step"] == trainer.adam_t  # one shared Adam counter
    s = trainer._current
    np.testing.assert_allclose([s.iqn_loss, s.iqn_norm_pre], [raw["iqn"].loss,
                               _norm64(raw["iqn"].trunk_grad_clean[:T])], rtol=1e-5)
    assert s.iqn_norm_post <= 0.10 * mgn * (1 + 1e-6)
    assert (s.ens_loss, s.aux_next_bar_loss, s.mse_weight) == (0.0, 0.0, 0.0)


def test_weight_zero_sources_are_not_called_and_the_step_is_the_core_step(monkeypatch):
    """Every second-wave weight 0, every shape field of the sources changed: no source function
    is called and the state after three steps is bitwise that of the default config."""
    for name in SOURCE_FUNCTIONS:
        def refuse(*args, _name=name, **kwargs):
            raise AssertionError(f"{_name} called with its source off")
        monkeypatch.setattr(step_mod, name, refuse, raising=False)
    shapes = dict(iqn_quantiles=9, iqn_embed=3, ens_heads=6, aux_hidden=5, n_regimes=7)
    runs = []
    for config in (TINY, TINY.replace(**shapes)):
        trainer = Trainer(config, seed=6)
        rng = np.random.default_rng(6)
        trainer.set_epoch(0)
        for _ in range(3):
            trainer.step(Batch.random(TINY, rng))
        runs.append(_state_bits(trainer))
    assert runs[0] == runs[1]
    assert "seed" not in runs[0]  # no IQN, no generator key in the state


def test_the_main_adam_leaves_the_padding_and_the_iqn_adam_only_its_range(monkeypatch):
    config = TINY.replace(lambda_iqn=1.0)
    trainer = Trainer(config, seed=1)
    rng = np.random.default_rng(1)
    for _ in range(3):
        trainer.step(Batch.random(config, rng))
    lay = trainer.layout
    pad = lay.padding_mask()
    for buf in (trainer.params, trainer.adam_m, trainer.adam_v, trainer.target):
        assert not buf[pad].any()
    r = slice(*lay.iqn_range)
    assert np.abs(trainer.adam_m[r]).max() > 0 and np.abs(trainer.adam_v[r]).max() > 0
    fresh = Trainer(config, seed=1)
    assert not np.array_equal(trainer.params[r], fresh.params[r])  # the IQN head learns


def test_set_epoch_writes_isv_39_and_the_fold_boundary_resets_it():
    trainer = Trainer(TINY, seed=0)
    assert trainer.isv.get("EPOCH_IDX") == 0
    trainer.set_epoch(7)
    assert trainer.isv.to_array()[39] == np.float32(7)
    assert trainer.state_dict()["isv"][39] == np.float32(7)
    trainer.fold_boundary()
    assert trainer.isv.get("EPOCH_IDX") == 0
    for bad in (-1, 1.5, True, 2**24 + 1, "3"):
        with pytest.raises(ValueError, match=rf"epoch={bad!r}: must be an integer in \[0, 16777216\]"):
            trainer.set_epoch(bad)


def test_the_loop_sets_the_epoch_at_each_epoch_start(monkeypatch):
    seen = []
    real = Trainer.set_epoch
    monkeypatch.setattr(Trainer, "set_epoch", lambda self, e: (seen.append(e), real(self, e))[1])
    bars = SyntheticMarket(8, 1600).generate()
    run(TINY, bars, LoopSettings(folds=2, epochs=3, steps_per_epoch=1, n_envs=2,
                                 warmup_transitions=32, replay_capacity=128, seed=1,
                                 val_frac=0.125, test_frac=0.125))
    assert seen == [0, 1, 2, 0, 1, 2]


def test_fast_cpu_executor_set_epoch_writes_the_device_isv():
    from foxhunt.fast.cpu_executor import CpuTrainer

    trainer = CpuTrainer(TINY, seed=0)
    trainer.set_epoch(5)
    assert trainer.state_dict()["isv"][39] == np.float32(5)
    trainer.fold_boundary()
    assert trainer.state_dict()["isv"][39] == 0


def test_iqn_state_round_trip_resumes_bitwise():
    config = TINY.replace(lambda_iqn=1.0)
    rng_a, rng_b = np.random.default_rng(3), np.random.default_rng(3)
    batches_a = [Batch.random(config, rng_a) for _ in range(4)]
    batches_b = [Batch.random(config, rng_b) for _ in range(4)]
    straight = Trainer(config, seed=11)
    for b in batches_a:
        straight.step(b)
    first = Trainer(config, seed=11)
    for b in batches_b[:2]:
        first.step(b)
    state = first.state_dict()
    assert state["seed"].tolist() == [11]
    assert {f"sn_u.{n}" for n in ("w_phi", "w_iq")} <= set(state)
    resumed = Trainer(config, seed=0)  # another seed: the state's key wins
    resumed.load_state_dict(state)
    for b in batches_b[2:]:
        resumed.step(b)
    assert _state_bits(resumed) == _state_bits(straight)


def test_info_prints_each_head_parameter_count(capsys):
    from foxhunt.reference import cli

    seed_on = DQNConfig.preset("seed", lambda_iqn=1.0, aux_next_bar_weight=0.1,
                               aux_regime_weight=0.1)
    lay = ParamLayout(seed_on)
    SH2, A = 256, 8
    aux = 2 * (32 * SH2 + 32) + (32 + 1) + (3 * 32 + 3)
    iqn = SH2 * 64 + SH2 + A * SH2 + A
    assert lay.counts_text() == f"core=289,611 aux={aux:,} iqn={iqn:,} ens=off"
    assert cli.main(["info"]) == 0
    printed = capsys.readouterr().out
    for name in ("seed", "tiny"):
        line = ParamLayout(DQNConfig.preset(name)).counts_text()
        assert f"\n         {line}\n" in printed


ALL_ON = dict(lambda_iqn=0.7, ens_weight=0.5, aux_next_bar_weight=0.1, aux_regime_weight=0.2,
              c51_warmup_epochs=4)


def _raw_parts(trainer: Trainer, batch: Batch) -> dict:
    """``loss_and_grads`` with the trainer's own inputs for its next step."""
    isv = trainer.isv.to_array()
    c = trainer.config
    h2_bound = np.float32(c.h2_clamp_mult * max(float(isv[isv_mod.H_S2_RMS_EMA_INDEX]), 1.0))
    params = trainer.params.copy()
    out = step_mod.loss_and_grads(c, params, trainer.target.copy(), batch,
                                  q_abs_ref=isv[isv_mod.Q_ABS_REF_INDEX], h2_bound=h2_bound,
                                  layout=trainer.layout, isv=isv, step=trainer.step_count,
                                  seed=trainer.seed)
    return {**out, "params": params, "h2_bound": h2_bound}


@pytest.mark.parametrize("precision", ["f32", "bf16"])
@pytest.mark.parametrize("mgn", [10.0, 1e-2])
def test_all_sources_compose_into_the_main_adam_gradient(mgn, precision, monkeypatch):
    """Every source on: grad = clip(c51 incl. aux heads, .70) + clipped(cql, .15) + lambda *
    clipped(iqn, .10) on the trunk + w_ens * clipped(ens, .05) on trunk and value head,
    recomputed in float64 from the raw parts; the C51 part holds the aux heads' own
    gradients and, by linearity, the trunk backward of (heads' d h2 + aux d h2); the C51 logit
    gradient is the warm-up blend at w = 1 - 1/4. (In bf16 the backward GEMMs round their
    inputs to TF32, 2^-11 relative: the linearity holds to that.)"""
    config = TINY.replace(max_grad_norm=mgn, precision=precision, **ALL_ON)
    trainer = Trainer(config, seed=5)
    rng = np.random.default_rng(5)
    trainer.set_epoch(1)
    for _ in range(2):
        trainer.step(Batch.random(config, rng))
    batch = Batch.random(config, rng)
    raw = _raw_parts(trainer, batch)
    lay = trainer.layout
    calls = _capture_adam(monkeypatch)
    trainer.step(batch)

    expect = _clipped64(raw["grad_c51"], 0.70 * mgn) + _clipped64(raw["grad_cql"], 0.15 * mgn)
    T, V = lay.trunk_end, lay.value_end
    expect[:T] += 0.7 * _clipped64(raw["iqn"].trunk_grad_clean[:T], 0.10 * mgn)
    expect[:V] += 0.5 * _clipped64(raw["ens"].trunk_grad_clean[:V], 0.05 * mgn)
    np.testing.assert_allclose(calls[0]["grad"], expect[:lay.main_adam_end], rtol=2e-5,
                               atol=1e-6 * mgn)
    for part in (raw["ens"].trunk_grad_clean[:V], raw["iqn"].trunk_grad_clean[:T]):
        assert np.abs(part).max() > 0
    assert not raw["ens"].trunk_grad_clean[V:].any()

    # The aux heads' parameter gradients are the C51 part's values at their tensors.
    aux = slice(lay["w_nb1"].offset, lay.main_adam_end)
    np.testing.assert_array_equal(raw["grad_c51"][aux], raw["aux"].param_grad[aux])
    assert np.abs(raw["grad_c51"][aux]).max() > 0
    # The trunk of the C51 part: the trunk backward of (heads' d h2 + aux d h2), linear.
    from foxhunt.reference.network import trunk_backward

    parts = [trunk_backward(config, lay, raw["params"], raw["online"], d, h2_bound=raw["h2_bound"])
             for d in (raw["trace_c51"]["d_h2"], raw["aux"].d_h2)]
    linear = (parts[0] + parts[1])[:T]
    tol = dict(rtol=1e-4, atol=1e-7) if precision == "f32" else \
        dict(rtol=0, atol=4e-3 * np.abs(linear).max())
    np.testing.assert_allclose(raw["grad_c51"][:T], linear, **tol)
    # The warm-up blend at epoch 1 of 4.
    assert raw["mse"].w == np.float32(0.75)
    for d in range(config.n_branches):
        np.testing.assert_array_equal(raw["dlogits_c51"][d], raw["mse"].dlogits[d])
    s = trainer._current
    assert s.mse_weight == 0.75 and s.mse_loss > 0 and s.aux_regime_loss > 0
    assert s.aux_next_bar_loss > 0 and s.ens_loss != 0 and s.iqn_loss > 0
    assert s.ens_norm_post <= 0.05 * mgn * (1 + 1e-6)


def test_priors_stay_frozen_and_spectral_norm_runs_on_the_trained_heads():
    config = TINY.replace(**ALL_ON)
    runs = {}
    for sigma_max in (1e-2, 1e3):
        trainer = Trainer(config.replace(sigma_max=sigma_max), seed=8)
        init = trainer.params.copy()
        sn0 = trainer.state_dict()
        rng = np.random.default_rng(8)
        for _ in range(3):
            trainer.step(Batch.random(config, rng))
        lay = trainer.layout
        r = slice(*lay.ens_range)
        assert np.array_equal(trainer.params[r].view(np.uint32), init[r].view(np.uint32))
        assert not trainer.adam_m[r].any() and not trainer.adam_v[r].any()
        state = trainer.state_dict()
        priors = [t.name for t in lay.group_tensors("ens") if t.is_weight]
        assert priors == ["w_e11", "w_e12", "w_e21", "w_e22"]
        assert not {f"sn_{x}.{n}" for n in priors for x in "uv"} & set(state)
        for name in ("w_nb1", "w_nb2", "w_rg1", "w_rg2", "w_phi", "w_iq"):
            assert not np.array_equal(state[f"sn_v.{name}"], sn0[f"sn_v.{name}"]), name
        runs[sigma_max] = trainer
    small, big = runs[1e-2], runs[1e3]
    for name in ("w_nb1", "w_rg2", "w_phi", "w_iq", "w_s1"):
        # sigma_max 0.01 shrinks every trained matrix (1e3 never fires on these inits)
        assert np.linalg.norm(small.layout.view(small.params, name)) < \
            0.5 * np.linalg.norm(big.layout.view(big.params, name)), name


@pytest.mark.parametrize("on", [True, False])
def test_isv_117_is_the_ema_of_the_finite_next_bar_rms(on):
    """SPEC 7 / the contract: the first batch's RMS of its finite next-bar returns replaces the
    cold start 0, later batches enter an EMA with alpha = 0.05 (a flat Sharpe); off, the slot
    keeps its cold start."""
    config = TINY.replace(aux_next_bar_weight=0.1 if on else 0.0)
    trainer = Trainer(config, seed=2)
    rng = np.random.default_rng(2)
    assert float(trainer.isv.get("AUX_LABEL_SCALE_EMA")) == 0.0
    assert float(trainer.isv.get("SHARPE_EMA")) == 0.0
    expect = 0.0
    for k in range(2):
        batch = Batch.random(config, rng)
        next_ret = batch.next_ret.copy()
        next_ret[4 + k] = np.nan
        with np.errstate(invalid="ignore"):
            trainer.step(dataclasses.replace(batch, next_ret=next_ret))
        finite = next_ret[np.isfinite(next_ret)].astype(np.float64)
        rms = math.sqrt(np.mean(finite ** 2))
        if on:
            expect = rms if k == 0 else 0.95 * expect + 0.05 * rms
        assert float(trainer.isv.get("AUX_LABEL_SCALE_EMA")) == pytest.approx(expect, rel=1e-6)


# -------------------------------------------------------------------------------- reporting
def test_a_run_with_every_source_reports_them(tmp_path, monkeypatch):
    """Epoch records (metrics.jsonl's fields), the Prometheus gauges, the grad-norm plot and
    TensorBoard's numeric fields carry each source's losses and pre/post-clip norms."""
    import json
    import socket

    from foxhunt.reference import plots
    from foxhunt.reference.run_outputs import PrometheusGauges, numeric_fields

    config = TINY.replace(**ALL_ON)
    bars = SyntheticMarket(8, 1600).generate()
    res = run(config, bars, LoopSettings(folds=1, epochs=2, steps_per_epoch=3, n_envs=2,
                                         warmup_transitions=64, replay_capacity=256, seed=2))
    rec = res.records[-1]
    for name in ("iqn_loss", "iqn_norm_pre", "iqn_norm_post", "ens_norm_pre", "ens_norm_post",
                 "aux_next_bar_loss", "aux_regime_loss", "mse_loss"):
        assert getattr(rec, name) != 0 and math.isfinite(getattr(rec, name)), name
        assert name in numeric_fields(rec)  # TensorBoard's epoch/<field> scalars
    assert [r.mse_weight for r in res.records] == [1.0, 0.75]  # epochs 0 and 1 of 4
    core = run(TINY, bars, LoopSettings(folds=1, epochs=1, steps_per_epoch=2, n_envs=2,
                                        warmup_transitions=64, replay_capacity=256, seed=2))
    assert all(getattr(core.records[0], n) == 0 for n in ("iqn_loss", "ens_norm_pre", "mse_weight"))

    drawn = []  # the labels of the lines the plots draw
    import matplotlib.axes

    orig = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda self, *a, **k: (drawn.append(k.get("label")), orig(self, *a, **k))[1])
    assert plots.write_plots(tmp_path, res)
    assert {"IQN before clip", "IQN after clip", "ensemble before clip",
            "ensemble after clip"} <= set(drawn)
    drawn.clear()
    plots.write_plots(tmp_path, core)
    assert not {"IQN before clip", "ensemble before clip"} & set(drawn)

    gauges = PrometheusGauges(0)
    try:
        gauges.epoch(rec)
        host, port = gauges.address
        with socket.create_connection((host, port), timeout=10) as conn:
            conn.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            body = b"".join(iter(lambda: conn.recv(65536), b"")).decode()
    finally:
        gauges.close()
    for comp in ("c51", "cql", "iqn", "ens"):
        for stage in ("pre", "post"):
            value = getattr(rec, f"{comp}_norm_{stage}")
            line = f'foxhunt_grad_norm{{component="{comp}",seed="0",stage="{stage}"}}'
            assert any(l.startswith(line) and math.isclose(float(l.split()[-1]), value,
                                                           rel_tol=1e-6)
                       for l in body.splitlines()), line
    for comp in ("iqn", "ens", "aux_next_bar", "aux_regime", "mse"):
        assert f'foxhunt_loss{{component="{comp}",seed="0"}}' in body
    json.dumps(dataclasses.asdict(rec))  # a metrics.jsonl line


def test_checkpoints_carry_the_second_wave_and_name_the_heads_on_a_mismatch(tmp_path):
    from foxhunt.reference.checkpoint import CheckpointError, check_compatible

    config = TINY.replace(**ALL_ON)
    trainer = Trainer(config, seed=4)
    rng = np.random.default_rng(4)
    trainer.set_epoch(2)
    for _ in range(2):
        trainer.step(Batch.random(config, rng))
    path = tmp_path / "wave.safetensors"
    trainer.save(path)
    loaded = Trainer.load(path)
    assert loaded.config == config and loaded.seed == 4
    assert _state_bits(loaded) == _state_bits(trainer)
    batch = Batch.random(config, rng)  # both continue identically
    a, b = trainer.step(batch), loaded.step(batch)
    assert a == b and _state_bits(loaded) == _state_bits(trainer)
    with pytest.raises(CheckpointError) as err:
        check_compatible(TINY, path)
    lay = ParamLayout(config)
    assert f"has {lay.total_params} parameters" in str(err.value)
    assert lay.counts_text() in str(err.value)
    assert ParamLayout(TINY).counts_text().endswith("aux=off iqn=off ens=off")
    assert ParamLayout(TINY).counts_text() in str(err.value)
