"""Entries of the second-wave step plumbing (``cuda_src/wave.cu``, reference
``foxhunt.reference.kernels.wave``): the step counter, a budget source's norms into the readback
block and the MSE warm-up's blend of the reported C51 loss. All exact: one thread rounds each
operation where the reference does.
"""

from __future__ import annotations

import numpy as np

from foxhunt.conformance.kernel_spec import Dims, Kwargs, Output, SpecEntry
from foxhunt.conformance.specs.inputs import F32, error_cases, f32, normal, replace, wrong_dtype
from foxhunt.conformance.tolerance import EXACT
from foxhunt.reference.kernels.step import READBACK_FIELDS, READBACK_INDEX

_RB = len(READBACK_FIELDS)


def _s_step_count(d: Dims, rng) -> Kwargs:
    return {"step_count": np.array([int(rng.integers(0, 2**62))], np.int64)}


def _s_source_norms(d: Dims, rng) -> Kwargs:
    """A squared norm below or above the budget (both sides of the clip), the IQN entries."""
    budget = F32(1.0 + 4.0 * rng.random())
    norm = budget * F32(rng.choice([0.25, 0.9, 1.5, 40.0]))
    return {"norm_sq": np.array([norm * norm], F32), "readback": normal(rng, _RB),
            "budget": budget, "pre_index": READBACK_INDEX["iqn_norm_pre"],
            "post_index": READBACK_INDEX["iqn_norm_post"]}


def _s_mse_blend(d: Dims, rng) -> Kwargs:
    """A blend weight in (0, 1] or 0 (past the warm-up: untouched)."""
    readback = normal(rng, _RB)
    readback[READBACK_INDEX["mse_weight"]] = F32(rng.choice([0.0, 0.3, 1.0, rng.random()]))
    return {"readback": readback, "c51_index": READBACK_INDEX["c51_loss"],
            "mse_loss_index": READBACK_INDEX["mse_loss"],
            "mse_weight_index": READBACK_INDEX["mse_weight"]}


ENTRIES = (
    SpecEntry(
        name="step_count_advance",
        outputs={"out": Output("int64", EXACT)},
        sample=_s_step_count,
        targets=(),  # an int64 counter only: no float to poison
        errors=error_cases(
            _s_step_count,
            lambda k: replace(k, step_count=np.array([-1], np.int64)),
            lambda k: replace(k, step_count=k["step_count"].astype(np.uint64)),
        ),
    ),
    SpecEntry(
        name="source_norm_scalars",
        outputs={"out": f32(EXACT)},
        sample=_s_source_norms,
        targets=("norm_sq", "readback"),
        errors=error_cases(
            _s_source_norms,
            lambda k: wrong_dtype(k, "norm_sq"),
            lambda k: replace(k, post_index=_RB),
            lambda k: replace(k, post_index=k["pre_index"]),
            lambda k: replace(k, budget=-1.0),
        ),
    ),
    SpecEntry(
        name="mse_loss_blend",
        outputs={"out": f32(EXACT)},
        sample=_s_mse_blend,
        targets=("readback",),
        errors=error_cases(
            _s_mse_blend,
            lambda k: wrong_dtype(k, "readback"),
            lambda k: replace(k, c51_index=-1),
            lambda k: replace(k, mse_weight_index=k["mse_loss_index"]),
        ),
    ),
)
