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
Mech 10's clamp keeps the walk going). The support: ``tiny`` and ``seed`` one for every branch
(``z [NA]``, ``z_stride = 0``: the fixed ``[v_min, v_max]``); ``odd``, the tiny network on a
support per branch (``z [n_branches, NA]``, ``z_stride = NA``, :func:`branch_supports`: distinct
rows that no affine map relates, so a branch read on another's row picks other actions and
records other margins).

Tolerances (the twin's module docstring): the rewards, positions held and costs are compared
bit for bit on the bars before the reference's first near tie (``walk.first_near_tie``) and not
after it; the margins within twice ``walk.q_error_bound`` up to and including that bar.

The chunked walk (``walk_rounds.greedy_walk_chunked``: ``rounds`` launches of walk.cu's
``greedy_walk_round``) has its own entry builder, :func:`chunked_entry`: the same samples plus
``n_chunks`` (:data:`CHUNKS`) and ``rounds`` (:data:`ROUNDS` per case, drawn where there are
several). After ``rounds`` rounds chunk ``g`` holds the sequential walk that starts flat at chunk
``h = max(0, g - rounds + 1)`` (``walk_rounds.greedy_walk_round``'s doc), on both paths, whatever
the merges did; so chunk ``g``'s rows are exact before the first near tie of THAT walk (from
chunk ``h``'s first step, its earlier chunks' steps included: a tie there changes the state the
chunk starts from) and free after it (:func:`chunk_ties`). With ``rounds >= n_chunks`` that is
the whole walk's first near tie, as for ``greedy_walk``.
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
    greedy_walk,
    q_error_bound,
    walk_dims,
    walk_offsets,
)
from foxhunt.reference.kernels.walk_rounds import CHUNKED, chunk_steps, greedy_walk_chunked
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
#: The chunked walk's chunks, and its rounds per shape case (one drawn from the tuple; the
#: extremal cases run the tiny network: the tiny rounds).
CHUNKS = 4
ROUNDS = {"tiny": (1, 2, 4), "seed": (4,)}
#: The shape cases: the presets' networks on one support, and ``odd`` on a support per branch.
WALK_CASES = ("tiny", "seed", "odd")


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


def branch_supports(config: DQNConfig) -> np.ndarray:
    """float32 ``[n_branches, NA]``: branch d's support ``c_d + h_d sign(t) |t|^(1.5 + d)``,
    ``t = linspace(-1, 1, NA)``, ``c_d = (d - 1) h / 4``, ``h_d = h (1 + d/2)`` with ``h`` the
    config's half-width ``(v_max - v_min) / 2``: increasing rows of distinct centres, widths
    and shapes (no two related by an affine map, which would leave the greedy actions as
    they are)."""
    t = np.linspace(-1.0, 1.0, config.num_atoms)
    half = (config.v_max - config.v_min) / 2
    rows = [(d - 1) * half / 4 + half * (1 + d / 2) * np.sign(t) * np.abs(t) ** (1.5 + d)
            for d in range(config.n_branches)]
    return np.array(rows, F32)


def _support(config: DQNConfig, case: str) -> Kwargs:
    """``z`` and ``z_stride`` of a shape case (module docstring)."""
    if case == "odd":
        return dict(z=branch_supports(config), z_stride=config.num_atoms)
    return dict(z=np.linspace(config.v_min, config.v_max, config.num_atoms, dtype=F32),
                z_stride=0)


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
        **_support(config, dims.case), isv=isv,
        isv_index=isv_mod.H_S2_RMS_EMA_INDEX, h2_clamp_mult=np.float32(config.h2_clamp_mult),
        close=close, high=(close + spread).astype(F32), low=(close - spread).astype(F32),
        features=rng.standard_normal((T, n_features)).astype(F32),
        costs=cost_table(ExecutionCosts()), start=FIRST_BAR, n_steps=T - 1 - FIRST_BAR)


def _tie_scales(kwargs: Kwargs, tie: np.ndarray) -> dict:
    """Per row, ``tie`` the step of the first near tie that row depends on: exact before it,
    unbounded after it; margins within twice the Q bound up to and including it."""
    rows = np.arange(tie.shape[0])
    free = np.where(rows < tie, 0.0, np.inf)
    bound = 2.0 * q_error_bound(kwargs["z"], kwargs["bf16"])
    out = {name: {**reduction(1, free), "exact": rows < tie}
           for name in ("rewards", "positions", "costs")}
    out["margins"] = reduction(1, np.where(rows <= tie, bound, np.inf))
    return out


def _sc_walk(kwargs: Kwargs, expected) -> dict:
    """Exact before the reference's first near tie, unbounded after it (module docstring)."""
    margins = expected["margins"]
    tie = first_near_tie(margins, kwargs["z"], kwargs["bf16"])
    return _tie_scales(kwargs, np.full(margins.shape[0], tie))


def _s_chunked(dims: Dims, rng: np.random.Generator) -> Kwargs:
    kwargs = _s_walk(dims, rng)
    rounds = ROUNDS.get(dims.case, ROUNDS["tiny"])
    return {**kwargs, "n_chunks": CHUNKS, "rounds": int(rng.choice(rounds))}


def chunk_ties(kwargs: Kwargs, whole_walk_margins: np.ndarray) -> np.ndarray:
    """Per row of ``greedy_walk_chunked(**kwargs)``: the step of the first near tie of the
    sequential walk its chunk ``g`` holds (flat from chunk ``h = max(0, g - rounds + 1)``
    through chunk ``g``; ``k1(g)`` when it has none). ``whole_walk_margins``: that walk's
    margins for ``h = 0`` (the chunked walk's own margins serve: its rows ``[0, k1(g))`` are
    then that walk's); ``h > 0`` walks are run here (``greedy_walk`` from chunk ``h``)."""
    n_steps, n_chunks, rounds = kwargs["n_steps"], kwargs["n_chunks"], kwargs["rounds"]
    z, bf16 = kwargs["z"], kwargs["bf16"]
    walk_args = {k: v for k, v in kwargs.items() if k not in ("n_chunks", "rounds")}
    tie = np.zeros(n_steps, np.int64)
    for g in range(n_chunks):
        k0, k1 = chunk_steps(n_steps, n_chunks, g)
        if k0 == k1:
            continue
        h0 = chunk_steps(n_steps, n_chunks, max(0, g - rounds + 1))[0]
        if h0 == 0:
            margins = whole_walk_margins[:k1]
        else:
            margins = greedy_walk(**{**walk_args, "start": kwargs["start"] + h0,
                                     "n_steps": k1 - h0}).margins
        tie[k0:k1] = h0 + first_near_tie(margins, z, bf16)
    return tie


def _sc_chunked(kwargs: Kwargs, expected) -> dict:
    """Exact before the first near tie of each chunk's walk (module docstring)."""
    return _tie_scales(kwargs, chunk_ties(kwargs, expected["margins"]))


def _c_walk(kwargs: Kwargs, outputs, poisoned) -> list[str]:
    """Positions are exposures (-1, 0, 1); rewards and costs stay finite (prices are)."""
    bad = []
    if not np.isin(outputs["positions"], (-1.0, 0.0, 1.0)).all():
        bad.append("positions: a value outside {-1, 0, 1}")
    for name in ("rewards", "costs"):
        if not np.isfinite(outputs[name]).all():
            bad.append(f"{name}: a non-finite value from finite prices")
    return bad


_WALK_ERRORS = (
    lambda k: wrong_dtype(k, "params"),
    lambda k: replace(k, param_offsets=k["param_offsets"][:-1]),
    lambda k: replace(k, n_steps=k["close"].shape[0]),
    lambda k: replace(k, start=-1),
    lambda k: replace(k, features=np.zeros((k["close"].shape[0], k["dims"][0]), F32)),
    lambda k: replace(k, z=k["z"][:-1]),
    lambda k: replace(k, z_stride=1),
    lambda k: replace(k, z_stride=k["dims"][5], z=np.tile(k["z"], (len(k["branches"]) + 1, 1))),
    lambda k: replace(k, branches=(3, 0)),
)
_OUTPUTS = {"rewards": f32(WITHIN), "positions": f32(WITHIN), "costs": f32(WITHIN),
            "margins": f32(WITHIN)}


def walk_entry(name: str) -> SpecEntry:
    """The entry of a kernel whose twin is ``walk.greedy_walk``."""
    return SpecEntry(name=name, outputs=_OUTPUTS, sample=_s_walk, targets=("features",),
                     errors=error_cases(_s_walk, *_WALK_ERRORS), scales=_sc_walk,
                     contract=_c_walk, cases=WALK_CASES)


def chunked_entry(name: str) -> SpecEntry:
    """The entry of a kernel whose twin is ``walk.greedy_walk_chunked`` (module docstring)."""
    return SpecEntry(
        name=name, outputs=_OUTPUTS, sample=_s_chunked, targets=("features",),
        errors=error_cases(_s_chunked, *_WALK_ERRORS,
                           lambda k: replace(k, n_chunks=0),
                           lambda k: replace(k, rounds=0)),
        scales=_sc_chunked, contract=_c_walk, cases=WALK_CASES)


#: The entry builder of each twin (here and in ``specs/walk_rounds.py``); a walk twin without
#: one fails the import (a name that pairs with nothing).
ENTRY_OF_TWIN = {greedy_walk: walk_entry, greedy_walk_chunked: chunked_entry}

ENTRIES = tuple(ENTRY_OF_TWIN[twin](name) for name, twin in WALK_TWINS.items())
#: The chunked walk's entries by ``walk.CHUNKED``'s names. Not in :data:`ENTRIES` (the
#: registry pairs entries with ``foxhunt.reference.kernels.KERNELS``, CUDA kernels and fast
#: entries by one name): they join it through ``walk_rounds.KERNELS`` (a name whose twin is
#: ``greedy_walk_chunked``); ``tests/test_walk_chunks.py`` runs them on the CPU until then.
CHUNKED_ENTRIES = tuple(chunked_entry(name) for name in CHUNKED)
