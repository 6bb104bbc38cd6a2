"""Entries of the fused evaluation walk (``cuda_src/walk.cu``, reference
``foxhunt.reference.kernels.walk``): ``greedy_walk`` (one block) and ``greedy_walk_cluster`` (one
thread-block cluster), a whole segment in one launch; the same samples, bounds and contract for
both (one twin). That the two kernels' records are bitwise equal is ``tests/test_walk.py``'s
GPU case.

Sizes per shape case: the ``tiny`` and ``seed`` presets' networks (bf16, their branches and
atoms; the extremal cases run the tiny network) on tables of :data:`BARS` bars with up to
:data:`MAX_FEATURES` market features; the walk starts at bar 3 and runs to the table's last
bar. Parameters are normal with a gain that spreads the expected Q of the actions (so most bars
are decided by a margin far above the Q error bound: ``tests/test_walk.py`` checks the samples
are not vacuous); prices are a random walk whose bars trade through their neighbours' closes.
The extremal cases poison the feature table (NaN, Inf, huge values reach the state rows;
Mech 10's clamp keeps the walk going).

Tolerances (the twin's module docstring): the rewards, positions held and costs are compared
bit for bit on the bars before the reference's first near tie (``walk.first_near_tie``) and not
after it; the margins within twice ``walk.q_error_bound`` up to and including that bar.
"""

from __future__ import annotations

import numpy as np

from foxhunt.conformance.kernel_spec import Dims, Kwargs, SpecEntry
from foxhunt.conformance.specs.inputs import error_cases, f32, reduction, replace, wrong_dtype
from foxhunt.conformance.tolerance import Tolerance
from foxhunt.reference import isv as isv_mod
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.env import ExecutionCosts
from foxhunt.reference.kernels.env import cost_table
from foxhunt.reference.kernels.walk import KERNELS as WALK_TWINS
from foxhunt.reference.kernels.walk import (
    first_near_tie,
    q_error_bound,
    walk_dims,
    walk_offsets,
)
from foxhunt.reference.layout import ParamLayout

F32, I32 = np.float32, np.int32

#: Bars of the tables per shape case (the extremal cases: short walks of the tiny network).
BARS = {"tiny": 64, "seed": 160, "extremal": 24}
MAX_FEATURES = 8
FIRST_BAR = 3
#: The weights' gain over 1/sqrt(fan in): spreads the actions' Q well past the error bound.
GAIN = 1.4
#: Bound comparisons: within ``magnitude`` per element (one term, no relative part).
WITHIN = Tolerance.reduction(0.0, 1.0)


def _config(dims: Dims) -> DQNConfig:
    return DQNConfig.preset("seed" if dims.case == "seed" else "tiny")


def _params(config: DQNConfig, rng: np.random.Generator) -> np.ndarray:
    layout = ParamLayout(config)
    params = layout.zeros()
    views = layout.views(params)
    for tensor in layout.tensors:
        shape = tensor.shape
        fan_in = shape[-1] if len(shape) == 2 else 1
        views[tensor.name][...] = rng.standard_normal(shape) * (GAIN / np.sqrt(fan_in))
    return params


def _s_walk(dims: Dims, rng: np.random.Generator) -> Kwargs:
    config = _config(dims)
    T = BARS.get(dims.case, BARS["tiny"])
    n_features = min(MAX_FEATURES, config.state_dim - 3)
    close = (100.0 * np.exp(np.cumsum(rng.normal(0, 0.004, T)))).astype(F32)
    spread = np.abs(rng.normal(0, 0.003, T)) * close
    isv = np.zeros(isv_mod.ISV_LEN, F32)
    isv[isv_mod.H_S2_RMS_EMA_INDEX] = 1.5
    return dict(
        params=_params(config, rng), param_offsets=walk_offsets(ParamLayout(config),
                                                                 config.n_branches),
        dims=walk_dims(config), branches=tuple(config.branches),
        bf16=config.precision == "bf16",
        z=np.linspace(config.v_min, config.v_max, config.num_atoms, dtype=F32), isv=isv,
        isv_index=isv_mod.H_S2_RMS_EMA_INDEX, h2_clamp_mult=np.float32(config.h2_clamp_mult),
        close=close, high=(close + spread).astype(F32), low=(close - spread).astype(F32),
        features=rng.standard_normal((T, n_features)).astype(F32),
        costs=cost_table(ExecutionCosts()), start=FIRST_BAR, n_steps=T - 1 - FIRST_BAR)


def _sc_walk(kwargs: Kwargs, expected) -> dict:
    """Exact before the reference's first near tie, unbounded after it (module docstring)."""
    margins = expected["margins"]
    n = margins.shape[0]
    tie = first_near_tie(margins, kwargs["z"], kwargs["bf16"])
    rows = np.arange(n)
    free = np.where(rows < tie, 0.0, np.inf)
    bound = 2.0 * q_error_bound(kwargs["z"], kwargs["bf16"])
    out = {name: {**reduction(1, free), "exact": rows < tie}
           for name in ("rewards", "positions", "costs")}
    out["margins"] = reduction(1, np.where(rows <= tie, bound, np.inf))
    return out


def _c_walk(kwargs: Kwargs, outputs, poisoned) -> list[str]:
    """Positions are exposures (-1, 0, 1); rewards and costs stay finite (prices are)."""
    bad = []
    if not np.isin(outputs["positions"], (-1.0, 0.0, 1.0)).all():
        bad.append("positions: a value outside {-1, 0, 1}")
    for name in ("rewards", "costs"):
        if not np.isfinite(outputs[name]).all():
            bad.append(f"{name}: a non-finite value from finite prices")
    return bad


ENTRIES = tuple(
    SpecEntry(
        name=name,
        outputs={"rewards": f32(WITHIN), "positions": f32(WITHIN), "costs": f32(WITHIN),
                 "margins": f32(WITHIN)},
        sample=_s_walk,
        targets=("features",),
        errors=error_cases(
            _s_walk,
            lambda k: wrong_dtype(k, "params"),
            lambda k: replace(k, param_offsets=k["param_offsets"][:-1]),
            lambda k: replace(k, n_steps=k["close"].shape[0]),
            lambda k: replace(k, start=-1),
            lambda k: replace(k, features=np.zeros((k["close"].shape[0], k["dims"][0]), F32)),
            lambda k: replace(k, z=k["z"][:-1]),
            lambda k: replace(k, branches=(3, 0)),
        ),
        scales=_sc_walk,
        contract=_c_walk,
        cases=("tiny", "seed"),
    )
    for name in WALK_TWINS  # both kernels of walk.cu, one twin
)
