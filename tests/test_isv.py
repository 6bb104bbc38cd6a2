"""The ISV registry, bus, resets, layout fingerprint and adaptive EMA rate (SPEC 7, seed 002)."""

from __future__ import annotations

import dataclasses
import io
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from foxhunt.reference import isv
from foxhunt.reference.isv import (
    CrossFold,
    FingerprintMismatch,
    FoldReset,
    ISVBus,
    ISVSlot,
    ResetCategory,
    SchemaContract,
    SoftReset,
)

# The seed's indices (seeds/002, "ISV Slot Allocation Registry"), written out by hand.
SEED_INDICES = {
    "Q_DRIFT": 0, "GRAD_NORM_EMA": 1, "TD_ERR_EMA": 2, "ENS_VAR_EMA": 3, "ENS_VAR_VEL": 4,
    "REWARD_EMA": 5, "ATOM_UTIL_EMA": 6, "LOSS_EMA": 7, "ADX_EMA": 8, "REGIME_DISAGREE": 9,
    "REGIME_VEL_EMA": 10, "REGIME_STABILITY": 11, "LEARNING_HEALTH": 12,
    "Q_ABS_REF": 16, "SHARPE_EMA": 22,
    "GRAD_NORM_TARGET_DIR": 31, "GRAD_NORM_TARGET_MAG": 32, "GRAD_NORM_TARGET_ORD": 33,
    "GRAD_NORM_TARGET_URG": 34, "GRAD_SCALE_LIMIT": 35,
    "EPOCH_IDX": 39, "TOTAL_EPOCHS": 40,
    "GAMMA_DIR_EFF": 43, "GAMMA_MAG_EFF": 44, "GAMMA_ORD_EFF": 45, "GAMMA_URG_EFF": 46,
    "CQL_ALPHA": 48, "H_S2_RMS_EMA": 96,
    "LAYOUT_FINGERPRINT_LO": 115, "LAYOUT_FINGERPRINT_HI": 116, "AUX_LABEL_SCALE_EMA": 117,
}
SEED_CATEGORIES = {
    "Q_ABS_REF": "FoldReset", "SHARPE_EMA": "FoldReset", "EPOCH_IDX": "FoldReset",
    "TOTAL_EPOCHS": "SchemaContract", "GAMMA_DIR_EFF": "FoldReset", "CQL_ALPHA": "FoldReset",
    "GRAD_NORM_TARGET_DIR": "SoftReset(500)", "GRAD_SCALE_LIMIT": "SoftReset(500)",
    "LAYOUT_FINGERPRINT_LO": "SchemaContract", "LAYOUT_FINGERPRINT_HI": "SchemaContract",
    "H_S2_RMS_EMA": "FoldReset", "LEARNING_HEALTH": "FoldReset",
}

# Bit patterns that must survive every copy: quiet NaN, signalling NaN, NaN with payload, -0,
# smallest subnormal, +Inf, all ones.
SPECIAL_U32 = (0x7FC00000, 0x7F800001, 0x7FA5A5A5, 0x80000000, 0x00000001, 0x7F800000, 0xFFFFFFFF)


# --------------------------------------------------------------------------- registry
@pytest.mark.parametrize("name, index", sorted(SEED_INDICES.items(), key=lambda kv: kv[1]))
def test_named_slots_use_the_seed_indices(name, index):
    assert isv.slot(name).index == index
    assert isv.slot_at(index).name == name


@pytest.mark.parametrize("name, category", sorted(SEED_CATEGORIES.items()))
def test_reset_categories_follow_the_seed(name, category):
    assert str(isv.slot(name).reset) == category


def test_constants_and_length():
    assert isv.ISV_LEN == 286  # the seed's ISV_TOTAL_DIM after the SP5 reservation
    assert (isv.Q_ABS_REF_INDEX, isv.SHARPE_EMA_INDEX, isv.EPOCH_IDX_INDEX,
            isv.TOTAL_EPOCHS_INDEX, isv.CQL_ALPHA_INDEX, isv.H_S2_RMS_EMA_INDEX,
            isv.FINGERPRINT_LO_INDEX, isv.FINGERPRINT_HI_INDEX) == (16, 22, 39, 40, 48, 96, 115, 116)
    assert isv.SIGNAL_INDICES == tuple(range(13)) and isv.NUM_SIGNALS == 13
    assert isv.slot("LAYOUT_FINGERPRINT_LO").type == "u32bits"
    assert isv.slot("EPOCH_IDX").type == "counter"
    assert isv.slot_at(37 + 1) is None  # a seed gap stays unnamed


def test_branch_slots_map_spec_branches_to_the_seed_families():
    # exposure -> DIR, order -> ORD, urgency -> URG, a fourth branch -> MAG
    assert [isv.branch_slot("GAMMA", d).index for d in range(4)] == [43, 45, 46, 44]
    assert isv.GAMMA_INDICES == (43, 45, 46, 44)
    assert [isv.branch_slot("GRAD_NORM_TARGET", d).index for d in range(4)] == [31, 33, 34, 32]
    with pytest.raises(ValueError, match="branch"):
        isv.branch_slot("GAMMA", 4)
    with pytest.raises(ValueError, match="family"):
        isv.branch_slot("TAU", 0)


def test_unknown_name_raises():
    with pytest.raises(ValueError, match="NOPE"):
        isv.slot("NOPE")


def _s(index, name, type_="f32", reset=FoldReset, cold=0.0):
    return ISVSlot(index, name, type_, "p", ("c",), reset, cold)


def test_the_shipped_registry_validates():
    isv.validate_registry(isv.REGISTRY)  # also run at import


@pytest.mark.parametrize("slots, match", [
    ((_s(3, "A"), _s(3, "B")), "overlap at index 3"),
    ((_s(3, "A"), _s(4, "A")), "'A' is used twice"),
    ((_s(286, "A"),), r"index=286 must be an integer in \[0, 286\)"),
    ((_s(-1, "A"),), "index=-1"),
    ((_s(1, "lower"),), "upper-case identifier"),
    ((_s(1, "A", "f64"),), "type='f64'"),
    ((_s(1, "A", "u32bits", FoldReset),), "must be SchemaContract"),
    ((_s(1, "A", "u32bits", SchemaContract, 1.0),), "u32bits cold_start"),
    ((_s(1, "A", "counter", FoldReset, 0.5),), "counter cold_start"),
    ((_s(1, "A", cold=math.nan),), "cold_start=nan"),
    ((_s(1, "A", reset="FoldReset"),), "not a ResetCategory"),
    (("not a slot",), "not an ISVSlot"),
])
def test_bad_registries_raise(slots, match):
    with pytest.raises(ValueError, match=match):
        isv.validate_registry(slots)


def test_the_shipped_registry_with_one_duplicate_raises():
    dup = dataclasses.replace(isv.slot("SHARPE_EMA"), index=isv.Q_ABS_REF_INDEX)
    with pytest.raises(ValueError, match="overlap at index 16"):
        isv.validate_registry((*isv.REGISTRY, dup))
    renamed = dataclasses.replace(isv.slot("SHARPE_EMA"), index=200, name="Q_ABS_REF")
    with pytest.raises(ValueError, match="Q_ABS_REF"):
        isv.validate_registry((*isv.REGISTRY, renamed))


@pytest.mark.parametrize("kind, bars, match", [
    ("Reset", None, "allowed values"),
    ("SoftReset", 0, "decay_bars=0"),
    ("SoftReset", None, "decay_bars=None"),
    ("FoldReset", 5, "takes no decay_bars"),
])
def test_bad_reset_categories_raise(kind, bars, match):
    with pytest.raises(ValueError, match=match):
        ResetCategory(kind, bars)


# --------------------------------------------------------------------------- bus and resets
def _perturbed_bus(**kw) -> ISVBus:
    """A bus whose every f32/counter slot holds a value far from its cold start."""
    bus = ISVBus(**kw)
    for s in isv.REGISTRY:
        if s.type != "u32bits":
            bus.set(s.name, 1000.0 + s.index)
    return bus


def test_cold_start_values():
    bus = ISVBus()
    values = bus.to_array()
    assert values[isv.Q_ABS_REF_INDEX] == 0.0
    assert values[isv.H_S2_RMS_EMA_INDEX] == 1.0  # neutral RMS (seed, Mech 10)
    assert values[isv.CQL_ALPHA_INDEX] == 1.0
    assert all(values[i] == np.float32(0.99) for i in isv.GAMMA_INDICES)
    gaps = [i for i in range(isv.ISV_LEN) if isv.slot_at(i) is None]
    assert np.all(values[gaps] == 0.0) and len(gaps) == isv.ISV_LEN - len(isv.REGISTRY)
    assert bus.read_fingerprint() == isv.LAYOUT_FINGERPRINT


def test_fold_reset_per_category():
    bus = _perturbed_bus()
    before = bus.to_array()
    bus.fold_reset()
    after = bus.to_array()
    for s in isv.REGISTRY:
        i = s.index
        if s.reset.kind == "FoldReset":
            assert after[i] == np.float32(s.cold_start), s.name
        elif s.reset.kind == "SoftReset":
            # one half-life toward cold start 0: (1000 + i) / 2, exact in float32
            assert after[i] == np.float32((1000.0 + i) / 2), s.name
        else:  # SchemaContract, CrossFold: untouched, bit for bit
            assert after.view(np.uint32)[i] == before.view(np.uint32)[i], s.name
    assert isv.slot("GRAD_NORM_SLOW_EMA").reset == CrossFold
    assert after[isv.GRAD_NORM_SLOW_EMA_INDEX] == np.float32(1037.0)
    assert after[isv.TOTAL_EPOCHS_INDEX] == np.float32(1040.0)
    assert bus.read_fingerprint() == isv.LAYOUT_FINGERPRINT


@pytest.mark.parametrize("bars", [0, 1, 250, 500, 1000, 5000])
def test_soft_reset_decays_with_half_life_decay_bars(bars):
    bus = _perturbed_bus()
    fold_slot_before = bus.get("Q_ABS_REF")
    bus.soft_reset(bars)
    for name in ("GRAD_NORM_TARGET_DIR", "GRAD_SCALE_LIMIT"):
        v0 = 1000.0 + isv.slot(name).index
        expected = v0 * 2.0 ** (-bars / 500.0)  # cold start 0; float64 oracle
        assert bus.get(name) == pytest.approx(expected, rel=2e-7), name
    assert bus.get("Q_ABS_REF") == fold_slot_before  # other categories untouched


def test_soft_reset_heals_non_finite_values_and_rejects_bad_bars():
    bus = ISVBus()
    bus.set("GRAD_SCALE_LIMIT", math.nan)
    bus.set("GRAD_NORM_TARGET_ORD", math.inf)
    bus.soft_reset(10)
    assert bus.get("GRAD_SCALE_LIMIT") == 0.0 and bus.get("GRAD_NORM_TARGET_ORD") == 0.0
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="bars"):
            bus.soft_reset(bad)


def test_cold_start_overrides_survive_fold_reset():
    bus = ISVBus(cold_start_overrides={"CQL_ALPHA": 0.25, "GAMMA_ORD_EFF": 0.9, "TOTAL_EPOCHS": 50})
    assert bus.get("CQL_ALPHA") == np.float32(0.25)
    assert bus.get("TOTAL_EPOCHS") == 50.0
    bus.set("CQL_ALPHA", 7.0)
    bus.set("GAMMA_ORD_EFF", 0.5)
    bus.fold_reset()
    assert bus.get("CQL_ALPHA") == np.float32(0.25)
    assert bus.get("GAMMA_ORD_EFF") == np.float32(0.9)
    assert bus.cold_start("GAMMA_DIR_EFF") == np.float32(0.99)


@pytest.mark.parametrize("overrides, match", [
    ({"NOPE": 1.0}, "NOPE"),
    ({"LAYOUT_FINGERPRINT_LO": 1.0}, "u32bits"),
    ({"CQL_ALPHA": math.inf}, "finite"),
    ({"EPOCH_IDX": 1.5}, "counter"),
])
def test_bad_overrides_raise(overrides, match):
    with pytest.raises(ValueError, match=match):
        ISVBus(cold_start_overrides=overrides)


def test_get_set_and_bits_access():
    bus = ISVBus()
    bus.set("Q_ABS_REF", 3.5)
    assert bus.get("Q_ABS_REF") == np.float32(3.5) and bus.get("Q_ABS_REF").dtype == np.float32
    bus.set("EPOCH_IDX", 7)
    assert bus.get("EPOCH_IDX") == 7.0
    with pytest.raises(ValueError, match="counter"):
        bus.set("EPOCH_IDX", 2.5)
    with pytest.raises(ValueError, match="u32 bits"):
        bus.set("LAYOUT_FINGERPRINT_HI", 1.0)
    with pytest.raises(ValueError, match="get_bits"):
        bus.get("LAYOUT_FINGERPRINT_LO")
    assert bus.get_bits("LAYOUT_FINGERPRINT_LO") == isv.LAYOUT_FINGERPRINT & 0xFFFFFFFF
    assert bus.get_bits("LAYOUT_FINGERPRINT_HI") == isv.LAYOUT_FINGERPRINT >> 32


def test_copy_is_independent_and_bit_exact():
    bus = _perturbed_bus(cold_start_overrides={"CQL_ALPHA": 0.5})
    twin = bus.copy()
    assert np.array_equal(twin.to_array().view(np.uint32), bus.to_array().view(np.uint32))
    twin.set("Q_ABS_REF", -1.0)
    assert bus.get("Q_ABS_REF") == np.float32(1016.0)
    twin.fold_reset()
    assert twin.get("CQL_ALPHA") == np.float32(0.5)


def test_to_array_is_a_copy():
    bus = ISVBus()
    arr = bus.to_array()
    arr[isv.Q_ABS_REF_INDEX] = 9.0
    assert bus.get("Q_ABS_REF") == 0.0


def test_from_array_checks_length_dtype_and_fingerprint():
    bus = ISVBus()
    good = bus.to_array()
    good[isv.Q_ABS_REF_INDEX] = 2.0
    bus.from_array(good)
    assert bus.get("Q_ABS_REF") == 2.0
    good[isv.Q_ABS_REF_INDEX] = 5.0  # the bus holds a copy
    assert bus.get("Q_ABS_REF") == 2.0
    with pytest.raises(ValueError, match=r"shape \(286,\)"):
        bus.from_array(np.zeros(285, np.float32))
    with pytest.raises(ValueError, match="float32"):
        bus.from_array(good.astype(np.float64))
    foreign = good.copy()
    isv.write_fingerprint(foreign, 0x0123456789ABCDEF)
    with pytest.raises(FingerprintMismatch) as err:
        bus.from_array(foreign)
    msg = str(err.value)
    assert "0x0123456789abcdef" in msg and f"0x{isv.LAYOUT_FINGERPRINT:016x}" in msg
    assert isinstance(err.value, ValueError)
    assert (err.value.expected, err.value.found) == (isv.LAYOUT_FINGERPRINT, 0x0123456789ABCDEF)
    bus.from_array(foreign, check_fingerprint=False)
    assert bus.read_fingerprint() == 0x0123456789ABCDEF


def test_bus_needs_the_fingerprint_slots_where_the_seed_has_them():
    moved = tuple(dataclasses.replace(s, index=117 + 50) if s.name == "LAYOUT_FINGERPRINT_HI" else s
                  for s in isv.REGISTRY)
    with pytest.raises(ValueError, match="LAYOUT_FINGERPRINT_HI slot at index 116"):
        ISVBus(moved)


# --------------------------------------------------------------------------- fingerprint
@pytest.mark.parametrize("data, expected", [
    (b"", 0xCBF29CE484222325),
    (b"a", 0xAF63DC4C8601EC8C),
    (b"foobar", 0x85944171F73967E8),
    (b"hello world", 0x779A65E7023CD2E7),
])
def test_fnv1a_64_published_vectors(data, expected):
    assert isv.fnv1a_64(data) == expected


def test_canonical_layout_is_the_documented_text():
    text = isv.canonical_layout().decode("utf-8")
    lines = text.split("\n")
    assert lines[0] == "len=286"
    assert lines[1] == "0|Q_DRIFT|f32|FoldReset"
    assert "31|GRAD_NORM_TARGET_DIR|f32|SoftReset(500)" in lines
    assert "115|LAYOUT_FINGERPRINT_LO|u32bits|SchemaContract" in lines
    indices = [int(line.split("|")[0]) for line in lines[1:]]
    assert indices == sorted(indices) and len(indices) == len(isv.REGISTRY)
    assert isv.LAYOUT_FINGERPRINT == isv.fnv1a_64(text.encode("utf-8"))


@given(st.permutations(isv.REGISTRY))
def test_fingerprint_is_stable_under_rebuilding_and_ordering(perm):
    rebuilt = tuple(dataclasses.replace(s, producer="other", consumers=()) for s in perm)
    assert isv.layout_fingerprint(rebuilt) == isv.LAYOUT_FINGERPRINT


_FREE_INDICES = [i for i in range(isv.ISV_LEN) if isv.slot_at(i) is None]
_CATEGORIES = (FoldReset, SoftReset(500), SoftReset(499), SchemaContract, CrossFold)


@given(data=st.data(), which=st.integers(0, len(isv.REGISTRY) - 1),
       field=st.sampled_from(["index", "name", "type", "reset"]))
def test_fingerprint_changes_with_any_structural_field(data, which, field):
    s = isv.REGISTRY[which]
    if field == "index":
        new = data.draw(st.sampled_from(_FREE_INDICES))
    elif field == "name":
        new = s.name + data.draw(st.sampled_from(["_X", "2", "_EMA"]))
    elif field == "type":
        new = data.draw(st.sampled_from([t for t in isv.SLOT_TYPES if t != s.type]))
    else:
        new = data.draw(st.sampled_from([c for c in _CATEGORIES if c != s.reset]))
    mutated = tuple(dataclasses.replace(x, **{field: new}) if x is s else x for x in isv.REGISTRY)
    assert isv.layout_fingerprint(mutated) != isv.LAYOUT_FINGERPRINT


def test_fingerprint_changes_with_length_and_ignores_non_structural_fields():
    assert isv.layout_fingerprint(isv.REGISTRY, 287) != isv.LAYOUT_FINGERPRINT
    relabelled = tuple(dataclasses.replace(s, producer="x", consumers=("y",)) for s in isv.REGISTRY)
    assert isv.layout_fingerprint(relabelled) == isv.LAYOUT_FINGERPRINT


_U64 = st.one_of(
    st.integers(0, 2**64 - 1),
    st.tuples(st.sampled_from(SPECIAL_U32), st.sampled_from(SPECIAL_U32)).map(
        lambda hl: (hl[0] << 32) | hl[1]),
)


def _vec_with(fp: int) -> np.ndarray:
    vec = ISVBus().to_array()
    isv.write_fingerprint(vec, fp)
    return vec


@given(_U64)
def test_fingerprint_bits_round_trip_through_copies(fp):
    vec = _vec_with(fp)
    bits = vec.view(np.uint32)
    assert int(bits[115]) == fp & 0xFFFFFFFF and int(bits[116]) == fp >> 32
    assert isv.read_fingerprint(vec) == fp
    assert isv.read_fingerprint(vec.copy()) == fp
    assert isv.read_fingerprint(np.array(vec)) == fp
    assert isv.read_fingerprint(np.frombuffer(vec.tobytes(), np.float32).copy()) == fp
    bus = ISVBus()
    bus.from_array(vec, check_fingerprint=False)
    assert bus.copy().read_fingerprint() == fp
    assert isv.read_fingerprint(bus.copy().to_array()) == fp


@given(_U64)
def test_fingerprint_bits_survive_np_save_load(fp):
    vec = _vec_with(fp)
    buf = io.BytesIO()
    np.save(buf, vec)
    buf.seek(0)
    assert isv.read_fingerprint(np.load(buf)) == fp


@given(_U64)
def test_fingerprint_bits_survive_safetensors(fp):
    st_numpy = pytest.importorskip("safetensors.numpy")
    vec = _vec_with(fp)
    loaded = st_numpy.load(st_numpy.save({"isv": vec}))["isv"]
    assert loaded.dtype == np.float32
    assert isv.read_fingerprint(loaded) == fp


def test_write_fingerprint_rejects_bad_values_and_vectors():
    vec = ISVBus().to_array()
    for bad in (-1, 2**64, 1.5):
        with pytest.raises(ValueError, match="fingerprint"):
            isv.write_fingerprint(vec, bad)
    with pytest.raises(ValueError, match="float32"):
        isv.read_fingerprint(vec.astype(np.float64))


def test_fingerprint_mismatch_takes_a_ready_message():
    err = FingerprintMismatch("checkpoint x: 0x1 vs 0x2")
    assert str(err) == "checkpoint x: 0x1 vs 0x2" and err.expected is None
    assert isinstance(err, ValueError)


def test_check_fingerprint():
    vec = ISVBus().to_array()
    isv.check_fingerprint(vec)
    isv.write_fingerprint(vec, isv.LAYOUT_FINGERPRINT ^ 1)
    with pytest.raises(FingerprintMismatch, match="checkpoint"):
        isv.check_fingerprint(vec, what="checkpoint")


# --------------------------------------------------------------------------- adaptive rate
@pytest.mark.parametrize("sharpe, expected", [
    (0.0, 0.05), (1.0, 0.075), (-1.0, 0.075), (2.0, 0.1), (-2.0, 0.1), (3.0, 0.1), (-50.0, 0.1),
    (math.inf, 0.1), (-math.inf, 0.1), (math.nan, 0.05), (0.5, 0.0625),
])
def test_adaptive_ema_rate(sharpe, expected):
    rate = isv.adaptive_ema_rate(sharpe)
    assert rate.dtype == np.float32
    assert rate == pytest.approx(expected, rel=1e-6)


@given(st.floats(allow_nan=True, allow_infinity=True),
       st.one_of(st.just(0.0), st.just(0.5), st.floats(1e-6, 0.5)))
def test_adaptive_ema_rate_bounds(sharpe, alpha_base):
    rate = float(isv.adaptive_ema_rate(sharpe, alpha_base))
    ab = float(np.float32(alpha_base))
    assert ab * (1 - 1e-6) <= rate <= 2 * ab * (1 + 1e-6)
    assert rate <= 1.0
    if not math.isnan(sharpe):
        expected = ab * (1 + 0.5 * min(abs(sharpe), 2.0))  # float64 oracle
        assert rate == pytest.approx(expected, rel=3e-7)


@pytest.mark.parametrize("alpha_base", [-0.01, 0.51, math.nan, math.inf])
def test_adaptive_ema_rate_rejects_bad_alpha_base(alpha_base):
    with pytest.raises(ValueError, match="alpha_base"):
        isv.adaptive_ema_rate(0.0, alpha_base)
