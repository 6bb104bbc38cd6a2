"""ParamLayout: GOFF order, aligned offsets, parameter counts, views, deterministic init."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from foxhunt.reference.config import CORE_STEP, DQNConfig
from foxhunt.reference.layout import ALIGN_BYTES, ParamLayout, init_params

SEED_NAMES = [
    "w_s1", "b_s1", "w_s2", "b_s2", "w_v1", "b_v1", "w_v2", "b_v2",
    "w_exposure1", "b_exposure1", "w_exposure2", "b_exposure2",
    "w_order1", "b_order1", "w_order2", "b_order2",
    "w_urgency1", "b_urgency1", "w_urgency2", "b_urgency2",
]


def test_seed_layout_counts_and_order():
    core = ParamLayout(DQNConfig())  # the field defaults: the seed sizes, second wave off
    assert core.total_params == core.core_params == 289611
    assert [t.name for t in core.tensors] == SEED_NAMES
    assert [t.index for t in core.tensors] == list(range(20))
    assert len(core.weight_matrices) == 10
    lay = ParamLayout(DQNConfig.preset("seed"))  # the preset adds the IQN and auxiliary heads
    assert [t.name for t in lay.tensors][:20] == SEED_NAMES and lay.core_params == 289611
    sh2, axh, ncos, actions = 256, 32, 64, 3 + 3 + 2
    aux = (axh * sh2 + axh + axh + 1) + (axh * sh2 + axh + 3 * axh + 3)  # next-bar, regime
    iqn = sh2 * ncos + sh2 + actions * sh2 + actions
    assert lay.head_params == {"aux": aux, "iqn": iqn, "ens": 0}
    assert lay.total_params == 289611 + aux + iqn == 324887
    assert len(lay.weight_matrices) == 10 + 4 + 2
    assert lay["w_order2"].shape == (3 * 51, 128)
    assert lay["w_urgency2"].shape == (2 * 51, 128)
    assert lay["w_s1"].shape == (256, 128)


@pytest.mark.parametrize("preset", ["seed", "tiny"])
def test_offsets_aligned_and_disjoint(preset):
    lay = ParamLayout(DQNConfig.preset(preset))
    prev_end = 0
    for t in lay.tensors:
        assert (t.offset * 4) % ALIGN_BYTES == 0
        assert t.offset >= prev_end
        prev_end = t.end
    assert lay.num_elements >= prev_end and (lay.num_elements * 4) % ALIGN_BYTES == 0
    assert lay.num_elements - lay.padding_mask().sum() == lay.total_params


@given(
    branches=st.lists(st.integers(2, 7), min_size=1, max_size=5).map(tuple),
    atoms=st.integers(2, 64),
    h=st.integers(1, 70),
)
def test_param_count_formula(branches, atoms, h):
    c = DQNConfig(state_dim=h + 3, shared_h1=h, shared_h2=h + 1, value_h=h + 2, adv_h=h, num_atoms=atoms, branches=branches)
    lay = ParamLayout(c)
    expected = (c.shared_h1 * (c.state_dim + 1) + c.shared_h2 * (c.shared_h1 + 1)
                + c.value_h * (c.shared_h2 + 1) + atoms * (c.value_h + 1)
                + sum(c.adv_h * (c.shared_h2 + 1) + n * atoms * (c.adv_h + 1) for n in branches))
    assert lay.total_params == expected
    assert len(lay.tensors) == 8 + 4 * len(branches)
    assert len(lay.weight_matrices) == 4 + 2 * len(branches)


def test_views_share_memory_and_init_is_deterministic():
    lay = ParamLayout(DQNConfig.preset("tiny"))
    a = init_params(lay, 7)
    b = init_params(lay, 7)
    c = init_params(lay, 8)
    assert a.dtype == np.float32 and np.array_equal(a, b) and not np.array_equal(a, c)
    assert not a[lay.padding_mask()].any()
    v = lay.views(a)
    for t in lay.tensors:
        if t.is_weight:
            bound = 1 / np.sqrt(t.shape[1])
            assert np.abs(v[t.name]).max() <= bound and np.abs(v[t.name]).max() > 0.5 * bound
        else:
            assert not v[t.name].any()
    v["b_s1"][:] = 3.0
    assert a[lay["b_s1"].offset] == 3.0


def test_view_rejects_wrong_buffer():
    lay = ParamLayout(DQNConfig.preset("tiny"))
    with pytest.raises(ValueError, match=str(lay.num_elements)):
        lay.view(np.zeros(10, np.float32), "w_s1")
    with pytest.raises(KeyError, match="w_nope"):
        lay.view(lay.zeros(), "w_nope")


# ------------------------------------------------------------------ second wave (issue 18)
ALL_ON = dict(lambda_iqn=1.0, ens_weight=0.5, aux_next_bar_weight=0.1, aux_regime_weight=0.1)


def second_wave(preset="tiny", **over):
    return DQNConfig.preset(preset, **{**ALL_ON, **over})


@pytest.mark.parametrize("preset", ["seed", "tiny"])
def test_second_wave_tensors_follow_the_core_in_contract_order(preset):
    c = second_wave(preset, iqn_embed=8, ens_heads=3, aux_hidden=5, n_regimes=4)
    lay, core = ParamLayout(c), ParamLayout(DQNConfig.preset(preset, **CORE_STEP))
    n_core = len(core.tensors)
    assert [(t.name, t.shape, t.offset) for t in lay.tensors[:n_core]] == \
        [(t.name, t.shape, t.offset) for t in core.tensors]
    SH2, VH, NA, A = c.shared_h2, c.value_h, c.num_atoms, sum(c.branches)
    expect = [
        ("w_nb1", (5, SH2), "aux"), ("b_nb1", (5,), "aux"), ("w_nb2", (1, 5), "aux"), ("b_nb2", (1,), "aux"),
        ("w_rg1", (5, SH2), "aux"), ("b_rg1", (5,), "aux"), ("w_rg2", (4, 5), "aux"), ("b_rg2", (4,), "aux"),
        ("w_phi", (SH2, 8), "iqn"), ("b_phi", (SH2,), "iqn"), ("w_iq", (A, SH2), "iqn"), ("b_iq", (A,), "iqn"),
    ]
    for k in (1, 2):
        expect += [(f"w_e{k}1", (VH, SH2), "ens"), (f"b_e{k}1", (VH,), "ens"),
                   (f"w_e{k}2", (NA, VH), "ens"), (f"b_e{k}2", (NA,), "ens")]
    assert [(t.name, t.shape, t.group) for t in lay.tensors[n_core:]] == expect
    assert [t.index for t in lay.tensors] == list(range(n_core + len(expect)))
    for t in lay.tensors:
        assert (t.offset * 4) % ALIGN_BYTES == 0
    # Counts, by hand from the shapes above.
    aux = (5 * SH2 + 5 + 5 + 1) + (5 * SH2 + 5 + 4 * 5 + 4)
    iqn = SH2 * 8 + SH2 + A * SH2 + A
    ens = 2 * (VH * SH2 + VH + NA * VH + NA)
    assert lay.head_params == {"aux": aux, "iqn": iqn, "ens": ens}
    assert lay.core_params == core.total_params
    assert lay.total_params == core.total_params + aux + iqn + ens
    assert lay.num_elements - lay.padding_mask().sum() == lay.total_params
    if preset == "seed":
        assert lay.core_params == 289611


def test_second_wave_ranges():
    c = second_wave()
    lay = ParamLayout(c)
    assert lay.trunk_end == lay["b_s2"].end and lay.value_end == lay["b_v2"].end
    last_core = lay.tensors[8 + 4 * c.n_branches - 1]
    assert lay.core_end == last_core.end
    assert lay.main_adam_end == lay["b_rg2"].end
    assert lay.iqn_range == (lay["w_phi"].offset, lay["b_iq"].end)
    assert lay.ens_range == (lay["w_e11"].offset, lay["b_e22"].end)
    # Without aux heads the main Adam ends with the core; without IQN / ensemble no range.
    only_iqn = ParamLayout(DQNConfig.preset("tiny", lambda_iqn=1.0))
    assert only_iqn.main_adam_end == only_iqn.core_end and only_iqn.ens_range is None
    assert only_iqn.iqn_range[0] >= only_iqn.core_end
    core = ParamLayout(DQNConfig.preset("tiny"))
    assert (core.iqn_range, core.ens_range) == (None, None)
    assert core.main_adam_end == core.core_end and core.head_params == {"aux": 0, "iqn": 0, "ens": 0}
    # Each head alone: only its tensors.
    nb = ParamLayout(DQNConfig.preset("tiny", aux_next_bar_weight=0.1))
    assert [t.name for t in nb.group_tensors("aux")] == ["w_nb1", "b_nb1", "w_nb2", "b_nb2"]
    rg = ParamLayout(DQNConfig.preset("tiny", aux_regime_weight=0.1))
    assert [t.name for t in rg.group_tensors("aux")] == ["w_rg1", "b_rg1", "w_rg2", "b_rg2"]


def test_trained_weight_matrices_exclude_the_frozen_priors():
    lay = ParamLayout(second_wave(ens_heads=4))
    names = [t.name for t in lay.weight_matrices]
    core = [t.name for t in ParamLayout(DQNConfig.preset("tiny")).weight_matrices]
    assert names == core + ["w_nb1", "w_nb2", "w_rg1", "w_rg2", "w_phi", "w_iq"]


def test_canonical_layout_names_every_tensor():
    core = ParamLayout(DQNConfig.preset("tiny"))
    # Shape fields of a source that is off change nothing.
    assert ParamLayout(DQNConfig.preset("tiny", iqn_embed=3, ens_heads=5, aux_hidden=7,
                                        n_regimes=9)).canonical() == core.canonical()
    on = ParamLayout(second_wave())
    lines = on.canonical().split("\n")
    assert len(lines) == len(on.tensors) and lines[:len(core.tensors)] == core.canonical().split("\n")
    for t in on.tensors:
        assert f"{t.index}|{t.name}|{'x'.join(map(str, t.shape))}|{t.offset}" in lines
    texts = {ParamLayout(second_wave(**{k: v})).canonical()
             for k, v in (("iqn_embed", 9), ("ens_heads", 2), ("aux_hidden", 6), ("n_regimes", 5))}
    assert len(texts | {on.canonical()}) == 5


def test_second_wave_init_keeps_the_core_and_each_head_independent():
    core_cfg, on_cfg = DQNConfig.preset("tiny"), second_wave()
    core, on = ParamLayout(core_cfg), ParamLayout(on_cfg)
    a, b = init_params(core, 11), init_params(on, 11)
    assert np.array_equal(a[:core.core_end].view(np.uint32), b[:core.core_end].view(np.uint32))
    assert not b[on.padding_mask()].any()
    # The IQN head draws the same values whether or not the other heads exist.
    only = ParamLayout(DQNConfig.preset("tiny", lambda_iqn=1.0))
    c = init_params(only, 11)
    for name in ("w_phi", "w_iq"):
        assert np.array_equal(only.view(c, name), on.view(b, name))
    v = on.views(b)
    for t in on.tensors[len(core.tensors):]:
        if t.is_weight:
            bound = 1 / np.sqrt(t.shape[1])
            assert 0.5 * bound < np.abs(v[t.name]).max() <= bound
        else:
            assert not v[t.name].any()
    assert not np.array_equal(v["w_e11"], v["w_e21"])  # each prior its own draw
