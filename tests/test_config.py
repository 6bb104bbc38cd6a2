"""DQNConfig: presets, validation messages that name the field, JSON round trip."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from foxhunt.reference.config import BUDGET_SOURCES, CORE_STEP, DQNConfig, source_overrides


def test_seed_preset_matches_spec_table():
    c = DQNConfig.preset("seed")
    assert (c.batch_size, c.state_dim, c.shared_h1, c.shared_h2, c.value_h, c.adv_h) == (256, 128, 256, 256, 128, 128)
    assert (c.num_atoms, c.v_min, c.v_max, c.branches) == (51, -10.0, 10.0, (3, 3, 2))
    assert c.gammas == (0.99, 0.99, 0.99)
    assert c.budgets == (0.70, 0.15, 0.10, 0.05)
    assert (c.max_grad_norm, c.sigma_max, c.lr, c.beta1, c.beta2, c.adam_eps) == (10.0, 3.0, 1e-4, 0.9, 0.999, 1e-8)
    assert (c.tau, c.cql_alpha, c.readback_interval, c.precision) == (0.005, 1.0, 100, "bf16")
    assert math.isclose(sum(c.budget(s) for s in BUDGET_SOURCES), c.max_grad_norm, rel_tol=1e-12)


def test_tiny_preset():
    c = DQNConfig.preset("tiny")
    assert (c.state_dim, c.shared_h1, c.shared_h2, c.value_h, c.adv_h, c.num_atoms, c.branches) == (16, 32, 32, 16, 16, 11, (3, 2))


@pytest.mark.parametrize(
    "field,value",
    [
        ("num_atoms", 1), ("num_atoms", 0), ("batch_size", 0), ("batch_size", -4), ("state_dim", 2.5),
        ("shared_h1", True), ("v_min", float("nan")), ("branches", ()), ("branches", (3, 1)),
        ("gamma", 1.5), ("gamma", (0.9, 0.9)), ("max_grad_norm", 0.0), ("sigma_max", -1.0),
        ("lr", float("inf")), ("beta1", 1.0), ("beta2", -0.1), ("tau", 2.0), ("precision", "fp16"),
        ("budgets", (0.7, 0.15, 0.1, 0.1)), ("budgets", (0.7, 0.3)), ("readback_interval", 0),
        ("weight_clamp_mult", 0.0), ("grad_slow_ema_alpha", 0.0), ("adam_eps", 0.0),
    ],
)
def test_bad_value_names_the_field(field, value):
    with pytest.raises(ValueError) as err:
        DQNConfig.preset("seed").replace(**{field: value})
    assert field in str(err.value)
    assert repr(value) in str(err.value) or str(value) in str(err.value)


def test_v_min_must_be_below_v_max():
    with pytest.raises(ValueError, match="v_min"):
        DQNConfig(v_min=1.0, v_max=1.0)


def test_unknown_preset_and_field():
    with pytest.raises(ValueError, match="preset='huge'"):
        DQNConfig.preset("huge")
    with pytest.raises(ValueError, match="num_atom"):
        DQNConfig().replace(num_atom=3)


def test_json_round_trip_and_unknown_keys():
    c = DQNConfig.preset("tiny", gamma=(0.9, 0.95), precision="f32")
    assert DQNConfig.from_json(c.to_json()) == c
    d = c.to_dict()
    d["bogus_field"] = 1
    with pytest.raises(ValueError, match="bogus_field"):
        DQNConfig.from_dict(d)


@given(
    b=st.floats(allow_nan=True, allow_infinity=True, width=32),
    which=st.integers(0, 3),
)
def test_budget_validation_property(b, which):
    budgets = list(DQNConfig().budgets)
    budgets[which] = b
    ok = math.isfinite(b) and 0 <= b <= 1 and abs(math.fsum(budgets) - 1) <= 1e-6
    if ok:
        assert DQNConfig(budgets=tuple(budgets)).budgets[which] == b
    else:
        with pytest.raises(ValueError, match="budgets"):
            DQNConfig(budgets=tuple(budgets))


@given(n=st.integers(-5, 300))
def test_num_atoms_property(n):
    if n >= 2:
        assert DQNConfig(num_atoms=n).num_atoms == n
    else:
        with pytest.raises(ValueError, match="num_atoms"):
            DQNConfig(num_atoms=n)


# ------------------------------------------------------------------ strict types, every field
def _fields_of(kind):
    """The DQNConfig fields whose annotation is ``kind`` (read from the annotations, not from
    the validation code under test)."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(DQNConfig)
    return [f.name for f in dataclasses.fields(DQNConfig) if hints[f.name] == kind]


FLOAT_FIELDS = _fields_of(float) + ["gamma"]  # gamma: float | tuple[float, ...]
INT_FIELDS = _fields_of(int)


def test_field_lists_cover_the_config():
    assert "lr" in FLOAT_FIELDS and "batch_size" in INT_FIELDS
    assert len(FLOAT_FIELDS) >= 20 and len(INT_FIELDS) >= 8


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("bad", ["0.9", "1", True, False, None, b"1"])
def test_float_fields_reject_strings_booleans_and_none(field, bad):
    with pytest.raises(ValueError) as err:
        DQNConfig.preset("seed").replace(**{field: bad})
    assert field in str(err.value)


@pytest.mark.parametrize("field", INT_FIELDS)
@pytest.mark.parametrize("bad", ["64", 64.0, True, None])
def test_int_fields_reject_strings_floats_booleans_and_none(field, bad):
    with pytest.raises(ValueError) as err:
        DQNConfig.preset("seed").replace(**{field: bad})
    assert field in str(err.value)


@pytest.mark.parametrize("field,bad", [
    ("branches", "3,3,2"), ("branches", (3, "3", 2)), ("branches", (3, 3.0, 2)),
    ("budgets", "0.7,0.15,0.1,0.05"), ("budgets", (0.7, "0.15", 0.1, 0.05)),
    ("gamma", (0.99, "0.99", 0.99)), ("gamma", (0.99, True, 0.99)),
    ("precision", 32), ("precision", None),
])
def test_sequence_and_string_fields_reject_wrong_element_types(field, bad):
    with pytest.raises(ValueError) as err:
        DQNConfig.preset("seed").replace(**{field: bad})
    assert field in str(err.value)


def test_float_fields_accept_integers():
    c = DQNConfig.preset("seed").replace(lr=1, gamma=1, cql_alpha=0)
    assert (c.lr, c.gammas[0], c.cql_alpha) == (1, 1.0, 0)


# ------------------------------------------------------------------ settings_io: typing rules
from foxhunt.reference import settings_io  # noqa: E402


@pytest.mark.parametrize("tp,text,expected", [
    (int, "12", 12), (int, "-3", -3), (float, "3e-4", 3e-4), (float, "2", 2.0),
    (str, "f32", "f32"), (bool, "true", True), (tuple[int, ...], "3,3,2", (3, 3, 2)),
    (tuple[float, float], "0.5,0.25", (0.5, 0.25)), (float | tuple[float, ...], "0.9", 0.9),
    (float | tuple[float, ...], "0.9,0.8", (0.9, 0.8)), (int | None, "none", None),
])
def test_coerce_from_set_text(tp, text, expected):
    value = settings_io.coerce(tp, text, text=True)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("tp,text", [
    (int, "3.0"), (int, "1e3"), (int, "true"), (float, "abc"), (float, "true"), (bool, "1"),
    (tuple[float, float], "0.5"), (tuple[int, ...], "3,x"),
])
def test_coerce_rejects_bad_text(tp, text):
    with pytest.raises(TypeError):
        settings_io.coerce(tp, text, text=True)


@pytest.mark.parametrize("tp,value,expected", [
    (int, 3, 3), (float, 3, 3.0), (float, 0.5, 0.5), (str, "x", "x"),
    (tuple[int, ...], [3, 2], (3, 2)), (float | tuple[float, ...], [0.9, 0.8], (0.9, 0.8)),
])
def test_coerce_file_values(tp, value, expected):
    got = settings_io.coerce(tp, value, text=False)
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize("tp,value", [
    (int, 3.0), (int, True), (int, "3"), (float, "0.9"), (float, True), (float, None),
    (str, 1), (tuple[int, ...], "3,3"), (tuple[int, ...], [3, 2.0]), (bool, 1),
])
def test_coerce_rejects_wrong_file_types(tp, value):
    with pytest.raises(TypeError):
        settings_io.coerce(tp, value, text=False)


def test_an_ambiguous_name_needs_its_section(monkeypatch):
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class A:
        seed: int = 0
        lr: float = 0.1

    @dataclasses.dataclass(frozen=True)
    class B:
        seed: int = 1

    monkeypatch.setattr(settings_io, "SECTIONS", {"config": A, "loop": B})
    with pytest.raises(ValueError, match="'seed' is ambiguous: write one of config.seed, loop.seed"):
        settings_io.resolve("seed")
    assert settings_io.resolve("loop.seed").section == "loop"
    assert settings_io.resolve("lr").key == "config.lr"


# ------------------------------------------------------------------ second wave (issue 18)
def test_second_wave_defaults_are_the_core_step_and_the_seed_preset_follows_spec_4():
    for c in (DQNConfig(), DQNConfig.preset("tiny"), DQNConfig.preset("seed", **CORE_STEP)):
        assert (c.lambda_iqn, c.ens_weight, c.aux_next_bar_weight, c.aux_regime_weight,
                c.c51_warmup_epochs) == (0.0, 0.0, 0.0, 0.0, 0)
        assert c.second_wave_on == () and not (c.iqn_on or c.ens_on or c.aux_on or c.mse_on)
    # SPEC 4: the seed preset runs the IQN head and the auxiliary heads, not the ensemble, no
    # warm-up; every other field is the dataclass default.
    seed = DQNConfig.preset("seed")
    assert (seed.lambda_iqn, seed.aux_next_bar_weight, seed.aux_regime_weight) == (1.0, 0.1, 0.1)
    assert (seed.ens_weight, seed.c51_warmup_epochs) == (0.0, 0)
    assert seed.replace(**CORE_STEP) == DQNConfig()
    assert source_overrides("iqn") == {**CORE_STEP, "lambda_iqn": 1.0}
    with pytest.raises(ValueError, match=r"^source='x': allowed values are \('core', 'iqn', 'aux', "
                                         r"'mse', 'ens', 'all'\)$"):
        source_overrides("x")
    c = DQNConfig()
    # The contract's shape defaults (the seeds' IQN_NUM_QUANTILES = 5).
    assert (c.iqn_quantiles, c.iqn_embed, c.ens_heads, c.aux_hidden, c.n_regimes) == (5, 64, 3, 32, 3)


@pytest.mark.parametrize("field,value,allowed", [
    ("lambda_iqn", -0.5, r"allowed range is \[0.0, inf\)"),
    ("ens_weight", float("inf"), r"allowed range is \[0.0, inf\)"),
    ("aux_next_bar_weight", float("nan"), r"allowed range"),
    ("aux_regime_weight", -1e-9, r"allowed range"),
    ("iqn_quantiles", 0, "must be an integer >= 1"),
    ("iqn_embed", 0, "must be an integer >= 1"),
    ("ens_heads", 1, "must be an integer >= 2"),
    ("aux_hidden", -3, "must be an integer >= 1"),
    ("n_regimes", 1, "must be an integer >= 2"),
    ("c51_warmup_epochs", -1, "must be an integer >= 0"),
])
def test_second_wave_fields_reject_bad_values_in_one_line(field, value, allowed):
    with pytest.raises(ValueError, match=rf"^{field}={value!r}: {allowed}") as err:
        DQNConfig.preset("tiny").replace(**{field: value})
    assert "\n" not in str(err.value)


def test_second_wave_switches_and_round_trip():
    from foxhunt.reference.config import SECOND_WAVE_SWITCHES

    on = DQNConfig.preset("tiny", lambda_iqn=1.0, ens_weight=0.05, aux_next_bar_weight=0.1,
                          aux_regime_weight=0.2, c51_warmup_epochs=3, iqn_quantiles=7,
                          iqn_embed=16, ens_heads=4, aux_hidden=8, n_regimes=5)
    assert on.second_wave_on == tuple(SECOND_WAVE_SWITCHES)
    assert on.iqn_on and on.ens_on and on.aux_on and on.aux_next_bar_on and on.aux_regime_on
    assert on.mse_on
    assert DQNConfig.from_dict(on.to_dict()) == on
    assert DQNConfig.from_json(on.to_json()) == on
    only = DQNConfig.preset("tiny", aux_regime_weight=0.1)
    assert only.second_wave_on == ("aux_regime_weight",)
    assert only.aux_on and not only.aux_next_bar_on


def test_atom_growth_mult_bounds_the_fixed_support():
    """Mech 2 with a fixed support: the atoms must lie within atom_growth_mult * max(Q, 1) at
    its floor, i.e. max(|v_min|, |v_max|) <= atom_growth_mult (checked at construction)."""
    assert DQNConfig(v_min=-10.0, v_max=10.0, atom_growth_mult=10.0).atom_growth_mult == 10.0
    with pytest.raises(ValueError, match=r"^v_min=-10.0, v_max=10.0: the support must lie within "
                                         r"Mech 2's atom bound atom_growth_mult=9.5 "):
        DQNConfig(atom_growth_mult=9.5)
    with pytest.raises(ValueError, match=r"v_min=-200.0, v_max=1.0: .* atom_growth_mult=100.0"):
        DQNConfig(v_min=-200.0, v_max=1.0)
