"""The sentinel slot table (SPEC 6, NaN-audit seed 000): numbers, thresholds, formatting."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from foxhunt.reference import isv, sentinels
from foxhunt.reference.sentinels import SentinelSlot, ThresholdRule

# The seed's numbers for buffers our step has (seed 000: SP1 slot table, Mech 5/10 table).
SEED_SLOTS = {
    1: "online_value_logits", 2: "online_adv_logits", 3: "mse_loss", 6: "grad_buf",
    7: "current_logp", 8: "projected_dist", 12: "h2", 24: "d_value_logits",
    25: "d_adv_logits", 26: "iqn_trunk_grad", 27: "iqn_d_h2", 28: "iqn_d_quantiles",
    29: "cql_d_value_logits", 30: "aux_next_bar_d_h2", 31: "ens_d_logits",
    33: "d_h2_post_main", 34: "d_h2_post_aux", 35: "d_h2_post_iqn",
    36: "trunk_adam_m_max", 37: "value_adam_m_max", 38: "branch_adam_m_max",
    39: "iqn_adam_m_max", 40: "trunk_adam_v_max", 41: "value_adam_v_max",
    42: "branch_adam_v_max", 43: "iqn_adam_v_max", 44: "trunk_weight_max",
    45: "heads_weight_max", 46: "target_q_post_clip", 47: "atom_span_max",
    48: "iqn_weight_max", 49: "h2_max_abs",
}
# Seed Mech 5/10 thresholds as (multiplier, ISV base, power) by slot.
SEED_THRESHOLDS = {
    **{k: (100.0, "Q_ABS_REF", 1) for k in range(36, 40)},
    **{k: (1e6, "Q_ABS_REF", 2) for k in range(40, 44)},
    44: (1e3, "Q_ABS_REF", 1), 45: (1e3, "Q_ABS_REF", 1), 46: (95.0, "Q_ABS_REF", 1),
    47: (190.0, "Q_ABS_REF", 1), 48: (1e3, "Q_ABS_REF", 1), 49: (1e3, "H_S2_RMS_EMA", 1),
}


def _flags(*indices: int) -> np.ndarray:
    flags = np.zeros(sentinels.NUM_SENTINEL_SLOTS, np.int32)
    flags[list(indices)] = 1
    return flags


def _isv(q_abs_ref: float = 0.0, h2_rms: float = 1.0) -> np.ndarray:
    vec = isv.ISVBus().to_array()
    vec[isv.Q_ABS_REF_INDEX] = np.float32(q_abs_ref)
    vec[isv.H_S2_RMS_EMA_INDEX] = np.float32(h2_rms)
    return vec


# --------------------------------------------------------------------------- the table
@pytest.mark.parametrize("index, name", sorted(SEED_SLOTS.items()))
def test_seed_numbers_are_kept(index, name):
    assert sentinels.slot_by_index(index).name == name
    assert sentinels.slot_by_name(name).index == index


def test_per_component_gradient_buffers_have_slots():
    for name in ("grad_c51", "grad_cql", "iqn_trunk_grad", "ens_trunk_grad"):
        assert sentinels.slot_by_name(name).point == "component_grads"
    assert sentinels.slot_by_name("grad_buf").point == "backward"
    assert sentinels.index("grad_buf") == 6 and sentinels.index("h2") == 12
    with pytest.raises(ValueError, match="nope"):
        sentinels.index("nope")


def test_table_shape_and_unassigned_indices():
    assert sentinels.NUM_SENTINEL_SLOTS == max(s.index for s in sentinels.SENTINELS) + 1
    assert sentinels.NUM_SENTINEL_SLOTS >= 50
    for hole in (16, 17, 18, 19, 20, 32):  # the seed's GRN sub-stages and bottleneck
        assert sentinels.slot_by_index(hole) is None
    names = [s.name for s in sentinels.SENTINELS]
    assert len(names) == len(set(names))
    sentinels.validate_sentinels(sentinels.SENTINELS, sentinels.NUM_SENTINEL_SLOTS)


def test_trunk_gradient_snapshots_share_one_buffer_at_three_inline_points():
    snaps = [sentinels.slot_by_index(i) for i in (33, 34, 35)]
    assert {s.buffer for s in snaps} == {"d_h2"}
    assert [s.point for s in snaps] == ["backward_main", "aux_saxpy", "iqn_copy"]
    assert all(s.inline for s in snaps)
    h2 = sentinels.slot_by_name("h2")
    assert h2.inline and h2.point == "trunk_pre_clamp"  # Mech 10: check before the clamp
    assert {s.index for s in sentinels.SENTINELS if s.inline} == {12, 33, 34, 35}


def test_threshold_slots_follow_the_seed():
    kinds = {s.index: s.kind for s in sentinels.SENTINELS}
    assert {k for k, v in kinds.items() if v == "threshold"} == set(SEED_THRESHOLDS)
    for index, (mult, base, power) in SEED_THRESHOLDS.items():
        rule = sentinels.slot_by_index(index).threshold
        assert (rule.multiplier, rule.isv_slot, rule.power) == (mult, base, power), index


def test_fused_groups_partition_the_non_inline_slots():
    g1 = {s.index for s in sentinels.fused_slots(1)}
    g2 = {s.index for s in sentinels.fused_slots(2)}
    assert not g1 & g2
    assert g1 | g2 == {s.index for s in sentinels.SENTINELS if not s.inline}
    assert {6, 24, 25, 26, 49} <= g1
    assert set(range(36, 46)) | {48} <= g2
    with pytest.raises(ValueError, match="graph"):
        sentinels.fused_slots(3)


def test_step_points_are_ordered_as_in_the_step():
    p = sentinels.STEP_POINTS
    assert p.index("batch") < p.index("forward") < p.index("loss") < p.index("head_grads") \
        < p.index("backward_main") < p.index("aux_saxpy") < p.index("iqn_copy") \
        < p.index("backward") < p.index("optimizer") < p.index("target_update")


# --------------------------------------------------------------------------- thresholds
def test_thresholds_scale_with_the_isv_signal():
    thr = sentinels.sentinel_thresholds(_isv(q_abs_ref=50.0, h2_rms=4.0))
    assert thr.dtype == np.float32 and thr.shape == (sentinels.NUM_SENTINEL_SLOTS,)
    expected = {36: 5e3, 39: 5e3, 40: 2.5e9, 43: 2.5e9, 44: 5e4, 45: 5e4, 46: 4750.0,
                47: 9500.0, 48: 5e4, 49: 4e3}
    for index, value in expected.items():
        assert thr[index] == np.float32(value), index
    non_threshold = [i for i in range(sentinels.NUM_SENTINEL_SLOTS) if i not in SEED_THRESHOLDS]
    assert np.all(thr[non_threshold] == 0.0)


@pytest.mark.parametrize("q, h", [(0.0, 0.0), (0.5, 0.25), (math.nan, math.nan), (-7.0, -3.0)])
def test_thresholds_floor_the_signal_not_the_bound(q, h):
    # below 1 (cold start), NaN (CUDA fmaxf(NaN, 1) = 1) or negative: the signal counts as 1
    thr = sentinels.sentinel_thresholds(_isv(q_abs_ref=q, h2_rms=h))
    for index, (mult, _base, _power) in SEED_THRESHOLDS.items():
        assert thr[index] == np.float32(mult), index


def test_thresholds_take_multipliers_from_the_config():
    from foxhunt.reference.config import DQNConfig

    default = DQNConfig()
    for s in sentinels.SENTINELS:  # config defaults are the seed's numbers
        if s.threshold is not None and s.threshold.config_field is not None:
            assert getattr(default, s.threshold.config_field) == s.threshold.multiplier, s.name
    cfg = DQNConfig(adam_m_diag_mult=10.0, adam_v_diag_mult=2.0, weight_diag_mult=3.0,
                    h2_diag_mult=7.0)
    thr = sentinels.sentinel_thresholds(_isv(q_abs_ref=4.0, h2_rms=5.0), cfg)
    assert thr[36] == 40.0 and thr[41] == 32.0 and thr[45] == 12.0 and thr[49] == 35.0
    assert thr[46] == np.float32(95.0 * 4.0)  # no config field: the seed constant


def test_thresholds_reject_a_bad_isv_vector():
    with pytest.raises(ValueError, match="isv"):
        sentinels.sentinel_thresholds(np.zeros(10, np.float32))
    with pytest.raises(ValueError, match="isv"):
        sentinels.sentinel_thresholds(_isv().astype(np.float64))


def test_thresholds_drive_the_fused_check():
    safety = pytest.importorskip("foxhunt.reference.kernels.safety")
    n = sentinels.NUM_SENTINEL_SLOTS
    buffers: list = [None] * n
    for s in sentinels.SENTINELS:
        buffers[s.index] = np.ones(8, np.float32)
    buffers[24] = np.array([0.0, math.nan], np.float32)          # non-finite: fires
    buffers[49] = np.array([3999.0, -4000.0], np.float32)        # max|h2| = 1000 x RMS: fires
    buffers[36] = np.array([4999.0], np.float32)                 # below 100 x Q_ABS_REF: quiet
    buffers[40] = np.array([2.4e9], np.float32)                  # below 1e6 x Q^2: quiet
    thr = sentinels.sentinel_thresholds(_isv(q_abs_ref=50.0, h2_rms=4.0))
    flags = safety.nan_check_fused(buffers, np.zeros(n, np.int32), thr)
    assert sentinels.format_flags(flags) == "24:d_value_logits, 49:h2_max_abs"


# --------------------------------------------------------------------------- formatting
def test_format_flags():
    assert sentinels.format_flags(_flags(24, 12)) == "12:h2, 24:d_value_logits"
    assert sentinels.format_flags(_flags()) == "none"
    assert sentinels.format_flags(_flags(6, 26, 49)) == "6:grad_buf, 26:iqn_trunk_grad, 49:h2_max_abs"
    assert sentinels.format_flags(_flags(32)) == "32:<unassigned>"


def test_flagged_names():
    assert sentinels.flagged_names(_flags(35, 6, 12)) == ["grad_buf", "h2", "d_h2_post_iqn"]
    assert sentinels.flagged_names(_flags()) == []
    assert sentinels.flagged_names(_flags(17)) == ["<unassigned:17>"]


_N = sentinels.NUM_SENTINEL_SLOTS


@pytest.mark.parametrize("flags, match", [
    (np.zeros(10, np.int32), "shape"),
    (np.zeros(_N, np.float32), "int32"),
    ([0] * _N, "int32"),
    (_flags(3) * 2, "slot 3 holds 2"),
    (-_flags(5), "slot 5 holds -1"),
])
def test_bad_flags_raise(flags, match):
    with pytest.raises(ValueError, match=match):
        sentinels.format_flags(flags)
    with pytest.raises(ValueError, match=match):
        sentinels.flagged_names(flags)


def test_unknown_name_raises():
    with pytest.raises(ValueError, match="nope"):
        sentinels.slot_by_name("nope")


# --------------------------------------------------------------------------- validation
_OK = SentinelSlot(1, "a", "nonfinite", "buf", "forward")
_RULE = ThresholdRule(10.0, "Q_ABS_REF", 1, None)


@pytest.mark.parametrize("slots, match", [
    ((_OK, dataclasses.replace(_OK, name="b")), "share index 1"),
    ((_OK, dataclasses.replace(_OK, index=2)), "'a' is used twice"),
    ((dataclasses.replace(_OK, index=-1),), "index=-1"),
    ((dataclasses.replace(_OK, name="Upper"),), "lower-case identifier"),
    ((dataclasses.replace(_OK, kind="magnitude"),), "kind='magnitude'"),
    ((dataclasses.replace(_OK, point="later"),), "point='later'"),
    ((dataclasses.replace(_OK, kind="threshold"),), "threshold rule is required"),
    ((dataclasses.replace(_OK, threshold=_RULE),), "forbidden otherwise"),
    ((dataclasses.replace(_OK, kind="threshold", threshold=dataclasses.replace(_RULE, power=3)),),
     "power=3"),
    ((dataclasses.replace(_OK, kind="threshold",
                          threshold=dataclasses.replace(_RULE, multiplier=0.0)),), "multiplier=0.0"),
    ((dataclasses.replace(_OK, kind="threshold",
                          threshold=dataclasses.replace(_RULE, isv_slot="NOPE")),), "NOPE"),
    (("not a slot",), "not a SentinelSlot"),
])
def test_bad_tables_raise(slots, match):
    with pytest.raises(ValueError, match=match):
        sentinels.validate_sentinels(slots)


def test_index_bound_is_checked_when_given():
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        sentinels.validate_sentinels((_OK,), num_slots=1)


def test_the_shipped_table_with_a_duplicate_raises():
    dup = dataclasses.replace(sentinels.slot_by_name("h2"), name="h2_again")
    with pytest.raises(ValueError, match="share index 12"):
        sentinels.validate_sentinels((*sentinels.SENTINELS, dup))


# --------------------------------------------------------------------------- second wave
# A NaN planted in one second-wave buffer of a reference step raises exactly that buffer's
# slot (issue 18): the buffer is replaced after ``loss_and_grads`` computed it, so nothing
# downstream of it sees the NaN except the check. The expected sets are written from the slot
# table, not read from the trainer.
from foxhunt.reference import trainer as trainer_mod  # noqa: E402
from foxhunt.reference.batch import Batch  # noqa: E402
from foxhunt.reference.config import DQNConfig  # noqa: E402
from foxhunt.reference.kernels import spectral  # noqa: E402

_WAVE = dict(lambda_iqn=1.0, ens_weight=0.5, aux_next_bar_weight=0.1, aux_regime_weight=0.1,
             c51_warmup_epochs=4)


def _poison(x: np.ndarray) -> np.ndarray:
    x = np.array(x, copy=True)
    x.reshape(-1)[min(5, x.size - 1)] = np.nan
    return x


def _plant_out(path: tuple[str, ...]):
    """An ``edit(out)`` that replaces the buffer at ``path`` (a key, then attributes or trace
    keys) of ``loss_and_grads``' result with a copy holding one NaN."""
    def edit(out):
        holder, key = out, path[0]
        for name in path[1:]:
            holder, key = (holder[key] if isinstance(holder, dict) else getattr(holder, key)), name
        if isinstance(holder, dict):
            holder[key] = _poison(holder[key])
        elif dataclasses.is_dataclass(holder) and not holder.__dataclass_params__.frozen:
            setattr(holder, key, _poison(getattr(holder, key)))
        else:  # a NamedTuple or a frozen dataclass: rebuilt with the poisoned field
            rebuilt = (holder._replace(**{key: _poison(getattr(holder, key))})
                       if hasattr(holder, "_replace")
                       else dataclasses.replace(holder, **{key: _poison(getattr(holder, key))}))
            out[path[0]] = rebuilt
    return edit


#: slot name -> where its buffer is in ``loss_and_grads``' result.
PLANTED = {
    "mse_loss": ("mse", "loss"),
    "iqn_trunk_grad": ("iqn", "trunk_grad"),
    "iqn_d_h2": ("iqn", "d_h2"),
    "iqn_d_quantiles": ("iqn", "d_quantiles"),
    "aux_next_bar_d_h2": ("aux", "d_h2_nb"),
    "ens_d_logits": ("ens", "d_logits"),
    "d_h2_post_aux": ("trace_c51", "d_h2_post_aux"),
    "d_h2_post_iqn": ("iqn", "d_h2_guarded"),
    "ens_trunk_grad": ("ens", "trunk_grad"),
    "aux_regime_d_h2": ("aux", "d_h2_rg"),
}


def _wave_trainer(monkeypatch, edit=None) -> trainer_mod.Trainer:
    config = DQNConfig.preset("tiny", readback_interval=1, **_WAVE)
    trainer = trainer_mod.Trainer(config, seed=2)
    trainer.set_epoch(1)  # inside the warm-up: the MSE blend runs
    if edit is not None:
        real = trainer_mod.loss_and_grads

        def patched(*args, **kwargs):
            out = real(*args, **kwargs)
            edit(out)
            return out

        monkeypatch.setattr(trainer_mod, "loss_and_grads", patched)
    return trainer


def _fired(trainer) -> set[str]:
    return set(sentinels.flagged_names(trainer.flags))


def test_every_second_wave_slot_has_a_planted_case():
    wave = {26, 27, 28, 30, 31, 34, 35, 51, 52, 3}
    assert {sentinels.index(n) for n in PLANTED} == wave  # and 39, 43, 48 below


@pytest.mark.parametrize("slot", sorted(PLANTED))
def test_a_planted_nan_raises_exactly_its_slot(slot, monkeypatch):
    trainer = _wave_trainer(monkeypatch)
    rng = np.random.default_rng(0)
    trainer.step(Batch.random(trainer.config, rng))
    assert _fired(trainer) == set()  # a clean step of every source raises nothing
    monkeypatch.setattr(trainer_mod, "loss_and_grads", trainer_mod.loss_and_grads)
    trainer = _wave_trainer(monkeypatch, _plant_out(PLANTED[slot]))
    with np.errstate(all="ignore"):
        trainer.step(Batch.random(trainer.config, rng))
    assert _fired(trainer) == {slot}


@pytest.mark.parametrize("slot, moment", [("iqn_adam_m_max", "adam_m"),
                                          ("iqn_adam_v_max", "adam_v")])
def test_a_planted_nan_in_the_iqn_adam_moments_raises_exactly_its_slot(slot, moment, monkeypatch):
    """A NaN moment stays NaN through Adam (``m = b1 m + ...``); that element's parameter
    update is NaN, which Mech 9's clamp_finite writes as 0: nothing else fires."""
    trainer = _wave_trainer(monkeypatch)
    getattr(trainer, moment)[trainer.layout.iqn_range[0] + 3] = np.nan
    with np.errstate(all="ignore"):
        trainer.step(Batch.random(trainer.config, np.random.default_rng(1)))
    assert _fired(trainer) == {slot}
    assert np.isfinite(trainer.params).all()


def test_a_planted_nan_in_the_iqn_weights_after_the_optimizer(monkeypatch):
    """A NaN written into w_iq after Adam (by the spectral-norm step) is watched by slot 48 and,
    since it is part of the whole parameter buffer and the Polyak update carries it into the
    target, by slots 15 (params) and 53 (target_params)."""
    trainer = _wave_trainer(monkeypatch)
    position = [t.name for t in trainer.layout.weight_matrices].index("w_iq")
    real = spectral.batched_spectral_norm

    def planted(ws, us, vs, sigma_max):
        ws, us, vs, sigmas = real(ws, us, vs, sigma_max)
        ws[position] = _poison(ws[position])
        return ws, us, vs, sigmas

    monkeypatch.setattr(spectral, "batched_spectral_norm", planted)
    with np.errstate(all="ignore"):
        trainer.step(Batch.random(trainer.config, np.random.default_rng(2)))
    assert _fired(trainer) == {"iqn_weight_max", "params", "target_params"}
