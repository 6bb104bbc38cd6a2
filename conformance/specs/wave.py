"""Entries of the second-wave step plumbing (``cuda_src/wave.cu``, reference
``foxhunt.reference.kernels.wave``): the step counter, a budget source's norms into the readback
block and the MSE warm-up's blend of the reported C51 loss. All exact: one thread rounds each
operation where the reference does.
"""

from __future__ import annotations

import math

import numpy as np

from foxhunt.conformance.kernel_spec import Dims, Kwargs, Output, SpecEntry, no_overflow
from foxhunt.conformance.specs.inputs import (
    F32,
    error_cases,
    f32,
    finite_outputs,
    maxabs,
    norm_sq,
    normal,
    reduction,
    replace,
    sq_mag,
    wrong_dtype,
)
from foxhunt.conformance.specs.optim import _clip_factor64, _norm_partials
from foxhunt.conformance.tolerance import EXACT, REDUCTION
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


#: Budget fractions of the four sources (SPEC 4 step 5); a sample scales each by a factor
#: below or above 1, so every clip fires in some samples and not in others.
_FRACTIONS = {"base": 0.70, "inject": 0.15, "iqn": 0.10, "ens": 0.05}
#: Each source's range as a fraction of the flat length (trunk, value end of the seed layout).
_RANGES = {"iqn": 0.6, "ens": 0.8}


def _s_wave_budget(d: Dims, rng) -> Kwargs:
    """The step's budget pipeline with both second-wave sources: four gradients, each source's
    partials over its range zero-padded to the base's count (the step's buffers), each budget
    its fraction of a ``max_grad_norm`` at which that clip fires or not (random per source);
    the seed case uses the step's 4096-element norm segments, the others 256."""
    seg = 4096 if d.case == "seed" else 256
    n = d.flat
    count = -(-n // seg)
    kw = {"block_size": seg}
    for name, frac in _FRACTIONS.items():
        x = normal(rng, max(1, int(n * _RANGES.get(name, 1.0))), 0.1)
        parts = np.zeros(count, F32)
        own = _norm_partials(x, seg)
        parts[:own.size] = own
        # Budget frac * mgn with mgn at 0.5x (clip fires) or 3x (no clip) of ||x|| / frac.
        mgn = math.sqrt(norm_sq(x)) / frac * float(rng.choice([0.5, 3.0]))
        kw[name] = x
        kw[f"{name}_partials"] = parts
        kw[f"{name}_max_norm"] = F32(frac * mgn)
    kw["a"], kw["iqn_a"], kw["ens_a"] = F32(1.0), F32(rng.choice([1.0, 0.5])), F32(0.3)
    order = ("base", "inject", "base_max_norm", "base_partials", "a", "inject_max_norm",
             "inject_partials", "iqn", "iqn_a", "iqn_max_norm", "iqn_partials", "ens", "ens_a",
             "ens_max_norm", "ens_partials", "block_size")
    return {k: kw[k] for k in order}


def _sc_wave_budget(kwargs, expected):
    """As ``clip_saxpy_norm_partial``'s bound: each norm sums ``P`` partials, so each clip
    factor is off by up to ~``P`` roundings, and ``out_i`` by that much of its finite terms
    (``|c_i| + |a y_i s_i|`` plus each source's ``|a_src x_i s_src|`` in its range) plus its
    four roundings; ``partials`` sum ``block_size`` squares."""
    count = kwargs["base_partials"].size
    terms = np.zeros(kwargs["base"].size)
    for name, a in (("base", 1.0), ("inject", kwargs["a"]), ("iqn", kwargs["iqn_a"]),
                    ("ens", kwargs["ens_a"])):
        s = _clip_factor64(expected[f"{name}_norm_sq"], kwargs[f"{name}_max_norm"])
        x64 = np.abs(kwargs[name].astype(np.float64) * float(a)) * s
        terms[:x64.size] += np.where(np.isfinite(x64), x64, 0.0)
    return {"out": reduction(count + 4, terms),
            "partials": reduction(kwargs["block_size"], sq_mag(expected["out"])),
            **{f"{name}_norm_sq": reduction(count, maxabs(kwargs[f"{name}_partials"]))
               for name in ("base", "inject", "iqn", "ens")}}


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
    # The budget pipeline with both second-wave sources in one pass (the step's all-on tail).
    SpecEntry(
        name="clip_saxpy_norm_partial_wave",
        outputs={name: f32(REDUCTION) for name in (
            "out", "partials", "base_norm_sq", "inject_norm_sq", "iqn_norm_sq", "ens_norm_sq")},
        sample=_s_wave_budget,
        targets=("base", "inject", "iqn", "ens", "base_partials", "inject_partials",
                 "iqn_partials", "ens_partials"),
        errors=error_cases(
            _s_wave_budget,
            lambda k: replace(k, iqn=np.concatenate([k["base"], k["base"][:1]])),
            lambda k: replace(k, ens_partials=k["ens_partials"][:-1]),
            lambda k: replace(k, iqn_partials=None),
            lambda k: replace(k, ens_max_norm=-1.0),
            lambda k: wrong_dtype(k, "iqn"),
            lambda k: replace(k, block_size=0),
        ),
        scales=_sc_wave_budget,
        contract=finite_outputs("partials", when=no_overflow),
    ),
)
