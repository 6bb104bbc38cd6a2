"""ParamLayout: GOFF order, aligned offsets, parameter counts, views, deterministic init."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from foxhunt.reference.config import DQNConfig
from foxhunt.reference.layout import ALIGN_BYTES, ParamLayout, init_params

SEED_NAMES = [
    "w_s1", "b_s1", "w_s2", "b_s2", "w_v1", "b_v1", "w_v2", "b_v2",
    "w_exposure1", "b_exposure1", "w_exposure2", "b_exposure2",
    "w_order1", "b_order1", "w_order2", "b_order2",
    "w_urgency1", "b_urgency1", "w_urgency2", "b_urgency2",
]


def test_seed_layout_counts_and_order():
    lay = ParamLayout(DQNConfig.preset("seed"))
    assert lay.total_params == 289611
    assert [t.name for t in lay.tensors] == SEED_NAMES
    assert [t.index for t in lay.tensors] == list(range(20))
    assert len(lay.weight_matrices) == 10
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
