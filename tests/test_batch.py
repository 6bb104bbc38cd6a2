"""`Batch.validate`: importance weights finite and > 0 and n-step discounts in (0, 1], else one
line naming the first bad index and value; a trainer refuses such a batch before changing any
state. (Shapes, dtypes, actions and ``done`` are tested in test_step_oracle.py.)"""

import dataclasses
import re

import numpy as np
import pytest

from foxhunt.reference.batch import Batch
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.trainer import Trainer

TINY = DQNConfig.preset("tiny")  # batch_size 32

#: id: (bad value, how the message spells it)
BAD_ISW = {
    "nan": (np.nan, "nan"),
    "plus_inf": (np.inf, "inf"),
    "minus_inf": (-np.inf, "-inf"),
    "zero": (0.0, "0.0"),
    "minus_zero": (-0.0, "-0.0"),
    "negative": (-0.25, "-0.25"),
}


def batch_with_isw(index_values: dict[int, float], seed: int = 0) -> Batch:
    b = Batch.random(TINY, np.random.default_rng(seed))
    isw = b.isw.copy()
    for i, v in index_values.items():
        isw[i] = v
    return dataclasses.replace(b, isw=isw)


@pytest.mark.parametrize("index", [0, 13, TINY.batch_size - 1])
@pytest.mark.parametrize("case", sorted(BAD_ISW))
def test_bad_importance_weight_is_refused_naming_index_and_value(case, index):
    value, spelled = BAD_ISW[case]
    with pytest.raises(ValueError) as err:
        batch_with_isw({index: value}).validate(TINY)
    msg = str(err.value)
    assert msg.startswith(f"batch.isw[{index}]={spelled}: ")
    assert "finite" in msg and "> 0" in msg and "\n" not in msg


def test_the_first_bad_index_is_named():
    with pytest.raises(ValueError, match=re.escape("batch.isw[4]=-1.0")):
        batch_with_isw({20: np.nan, 4: -1.0, 9: 0.0}).validate(TINY)


@pytest.mark.parametrize("value", [np.float32(1.4e-45), np.finfo(np.float32).tiny, 1.0,
                                   np.finfo(np.float32).max],
                         ids=["smallest_subnormal", "smallest_normal", "one", "largest"])
def test_finite_positive_edge_weights_pass(value):
    b = batch_with_isw({0: value, 31: value})
    assert b.validate(TINY) is b
    assert b.isw[0] == np.float32(value) > 0  # the value really is in the batch


def test_trainer_refuses_the_batch_before_stepping():
    trainer = Trainer(TINY, seed=3)
    before = trainer.state_dict()
    with pytest.raises(ValueError, match=r"batch\.isw\[7\]=nan"):
        trainer.step(batch_with_isw({7: np.nan}))
    assert trainer.step_count == 0
    after = trainer.state_dict()
    assert all(before[k].tobytes() == after[k].tobytes() for k in before)


@pytest.mark.parametrize("value, spelled", [(np.nan, "nan"), (0.0, "0.0"), (-0.5, "-0.5"),
                                            (np.nextafter(np.float32(1), np.float32(2)), "1.0000001192092896"),
                                            (np.inf, "inf")])
def test_a_bad_n_step_discount_is_refused_naming_index_and_value(value, spelled):
    """``discount`` (n-step batches) must be finite and in (0, 1]: the first bad entry is named;
    the bounds' edges (the smallest subnormal, 1) pass."""
    b = Batch.random(TINY, np.random.default_rng(4))
    discount = np.full(TINY.batch_size, 0.9, np.float32)
    discount[[0, 31]] = np.float32(1.4e-45), 1.0
    assert dataclasses.replace(b, discount=discount).validate(TINY) is not None
    discount[[11, 20]] = value, np.nan
    with pytest.raises(ValueError, match=rf"^batch\.discount\[11\]={re.escape(spelled)}: effective "
                                         r"discounts must be finite and in \(0, 1\]$"):
        dataclasses.replace(b, discount=discount).validate(TINY)
