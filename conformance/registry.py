"""The kernel registry: one :class:`KernelSpec` per kernel, paired by name, and the check that
``cuda_src/``, the reference ``KERNELS`` and the fast ``KERNELS`` describe the same kernels.

A spec pairs the reference function (``foxhunt.reference.kernels.KERNELS[name]``) with the fast
path's numpy-in/numpy-out test entry (``foxhunt.fast.kernels.KERNELS[name]``, same signature)
and says how to test them: sample inputs per shape case (``tiny`` and ``seed`` from the config
presets, ``odd`` with 257 x 259 tails that cross the 256-thread block boundary), extremal
inputs (NaN, +/-Inf, +/-0, subnormals and f32 max injected at the block boundaries of each
poisonable argument, one case per special set and argument), error inputs (and the class they
raise), the tolerance of each output (:func:`foxhunt.conformance.tolerance.tolerance_for`)
and, for reduction outputs, the length and magnitude the bound scales with.

The kernel-specific half of each spec lives in :data:`SPEC_TABLE`, keyed by kernel name; an
entry becomes a :class:`KernelSpec` (in :data:`SPECS`) only when the reference defines that
kernel, so the table may run ahead of the reference. :func:`check_consistency` reports every
gap as a problem string: a CUDA kernel without a reference twin, a reference kernel without a
CUDA kernel or fast entry (unless :data:`DIVERGENCES` says why; required where a GPU is
present, since on a CPU the fast path may still be being written), a fast entry without a
reference twin, a signature mismatch between reference and fast, a reference kernel without a
spec. The conformance tests turn a non-empty list into a failure; the port's remaining gaps
are listed by :func:`missing_ports` (a skip reason on a CPU, a failure on a GPU).

Infrastructure sources in ``cuda_src/`` whose file name starts with ``_`` (the fast path's
build/launch self test, ``_selftest.cu``) are not kernels of the specification and are not
paired (:func:`infrastructure_sources` lists them, so a report can show what was skipped).
"""

from __future__ import annotations

import importlib
import inspect
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from foxhunt.conformance.cuda_parse import KernelDecl, parse_cuda_dir
from foxhunt.conformance.strategies import (
    F32_LARGEST_SUBNORMAL,
    F32_MAX,
    F32_SMALLEST_SUBNORMAL,
    F32_TINY,
    Injection,
    boundary_positions,
    inject,
)
from foxhunt.conformance.tolerance import Tolerance, tolerance_for

F32 = np.float32
I32 = np.int32

#: Shape cases every kernel is run on (``SpecEntry.cases`` may restrict them).
SHAPE_CASES = ("tiny", "seed", "odd")

#: Flat-buffer lengths: ``tiny`` crosses two 256-element block boundaries with a tail of 3;
#: ``seed`` is SPEC 3's parameter count. Replay sizes: ``seed`` a 100k buffer with a tail.
_FLAT = {"tiny": 2 * 256 + 3, "seed": 289_611}
_ITEMS = {"tiny": 2 * 256 + 3, "seed": 100_003}

#: Reference kernels that deliberately have no CUDA kernel: ``{name: reason}``. Empty: every
#: reference kernel is a CUDA kernel. (Helpers such as ``hard_sync`` and the GEMM emulation
#: are not in the reference ``KERNELS`` at all.)
DIVERGENCES: Mapping[str, str] = MappingProxyType({})

#: The dtype key under which kernel tolerances are looked up (kernels compute in float32).
KERNEL_DTYPE = "f32"


def default_cuda_dir() -> Path:
    """``cuda_src/`` of the installed package (works from a wheel and an editable install)."""
    return Path(str(resources.files("foxhunt.cuda_src")))


def is_infrastructure_source(file_name: str) -> bool:
    """Build/launch self-test sources (``_*.cu``) hold no specification kernels."""
    return file_name.startswith("_")


def infrastructure_sources(cuda_dir: str | Path) -> tuple[str, ...]:
    return tuple(sorted(p.name for p in Path(cuda_dir).iterdir()
                        if p.suffix in (".cu", ".cuh") and is_infrastructure_source(p.name)))


def cuda_kernels(cuda_dir: str | Path) -> dict[str, KernelDecl]:
    """The specification kernels declared in ``cuda_dir`` (infrastructure sources skipped)."""
    skip = frozenset(infrastructure_sources(cuda_dir))
    return parse_cuda_dir(cuda_dir, exclude=skip)


# ------------------------------------------------------------------------------------ dims
@dataclass(frozen=True)
class Dims:
    """Sizes for one shape case."""

    case: str
    batch: int      # B (rows of activations)
    hidden: int     # columns of activations / bias length
    atoms: int      # NA
    actions: int    # A of the largest branch
    flat: int       # flat parameter / gradient buffer length
    w_out: int      # spectral-norm matrix rows
    w_in: int       # spectral-norm matrix columns
    items: int      # replay buffer items


def _preset_dims(case: str) -> Dims:
    from foxhunt.reference.config import DQNConfig

    cfg = DQNConfig.preset(case)
    return Dims(case, cfg.batch_size, cfg.shared_h1, cfg.num_atoms, max(cfg.branches), _FLAT[case],
                cfg.shared_h2, cfg.shared_h1, _ITEMS[case])


def case_dims(case: str) -> Dims:
    """Dims of a shape case; ``ValueError`` for an unknown case."""
    if case in ("tiny", "seed"):
        return _preset_dims(case)
    if case == "odd":  # TransformerEngine's 257 x 259 tails: every dimension crosses a block
        return Dims("odd", 257, 259, 51, 3, 257 * 259, 259, 257, 257 * 259)
    if case == "extremal":  # small, but rows of 259 and a flat length of 515 cross 256 and 512
        return Dims("extremal", 5, 259, 11, 3, 515, 7, 5, 515)
    raise ValueError(f"shape case {case!r} is unknown; allowed: {SHAPE_CASES + ('extremal',)}")


# ------------------------------------------------------------------------------ generators
def _normal(rng: np.random.Generator, shape, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(F32)


def _uniform(rng: np.random.Generator, shape, lo: float, hi: float) -> np.ndarray:
    return rng.uniform(lo, hi, shape).astype(F32)


def _bits_f32(rng: np.random.Generator, shape) -> np.ndarray:
    """Uniformly random float32 bit patterns (NaN, Inf and subnormals included)."""
    return rng.integers(0, 2**32, size=shape, dtype=np.uint64).astype(np.uint32).view(F32)


def _softmax(rng: np.random.Generator, shape, scale: float = 2.0) -> np.ndarray:
    x = rng.standard_normal(shape) * scale
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(F32)


def _log_softmax(rng: np.random.Generator, shape, scale: float = 2.0) -> np.ndarray:
    x = rng.standard_normal(shape) * scale
    m = x.max(axis=-1, keepdims=True)
    return (x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))).astype(F32)


V_MIN, V_MAX = -10.0, 10.0


def _support(atoms: int) -> np.ndarray:
    from foxhunt.reference.kernels.distributional import support

    return support(V_MIN, V_MAX, atoms)


def _maxabs(*arrays: Any) -> float:
    """Largest finite ``|x|`` over all arrays (0.0 if none); float64 for the bound."""
    best = 0.0
    for a in arrays:
        a = np.asarray(a, dtype=np.float64)
        fin = np.abs(a[np.isfinite(a)])
        if fin.size:
            best = max(best, float(fin.max()))
    return best


def _isv_vector(rng: np.random.Generator) -> np.ndarray:
    """The cold-start ISV vector (fingerprint bits included) with the EMA slots randomised."""
    from foxhunt.reference import isv as isv_registry

    vec = isv_registry.ISVBus().to_array().astype(F32, copy=True)
    for index in (*range(isv_registry.NUM_SIGNALS), isv_registry.Q_ABS_REF_INDEX,
                  isv_registry.H_S2_RMS_EMA_INDEX):
        vec[index] = F32(abs(rng.standard_normal()) * 2)
    return vec


# -------------------------------------------------------------------------- extremal sets
@dataclass(frozen=True)
class ExtremalSet:
    """A cycle of special values placed at an array's block-boundary positions."""

    label: str
    values: tuple[np.float32, ...]
    #: No huge finite value in the set: a guarded kernel's outputs must stay finite (with
    #: f32 max injected, a finite square or sum may overflow legitimately).
    overflow_free: bool

    def injections(self, size: int) -> list[Injection]:
        pos = boundary_positions(size)
        return [Injection(p, self.values[i % len(self.values)]) for i, p in enumerate(pos)]


EXTREMAL_SETS: tuple[ExtremalSet, ...] = (
    ExtremalSet("nan", (F32(np.nan),), True),
    ExtremalSet("inf", (F32(np.inf), F32(-np.inf)), True),
    ExtremalSet("zero_subnormal", (F32(-0.0), F32(0.0), F32_SMALLEST_SUBNORMAL,
                                   -F32_LARGEST_SUBNORMAL, F32_TINY), True),
    ExtremalSet("huge", (F32_MAX, -F32_MAX), False),
    ExtremalSet("mixed", (F32(np.nan), F32(np.inf), F32(-np.inf), F32(-0.0),
                          F32_SMALLEST_SUBNORMAL, F32_MAX), False),
)


def _bf16_pattern(value: np.float32) -> np.uint16:
    """The BF16 pattern with the same sign/exponent/high mantissa as ``value`` (truncated)."""
    return np.uint16(np.array([value], dtype=F32).view(np.uint32)[0] >> 16)


def _poison(value: Any, xset: ExtremalSet) -> Any:
    """``value`` with ``xset`` injected: arrays at their boundary positions, lists per entry,
    scalars replaced by the set's first value."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return type(value)(_poison(v, xset) for v in value)
    arr = np.asarray(value)
    if arr.ndim == 0:
        return F32(xset.values[0])
    if arr.dtype == np.uint16:
        out = arr.copy()
        flat = out.reshape(-1)
        for inj in xset.injections(arr.size):
            flat[inj.position] = _bf16_pattern(inj.value)
        return out
    if arr.dtype != F32:
        raise TypeError(f"cannot inject float specials into a {arr.dtype} argument")
    return inject(arr, xset.injections(arr.size))


# ----------------------------------------------------------------------------- the entries
Kwargs = dict[str, Any]
Scales = Callable[[Kwargs, Mapping[str, np.ndarray]], Mapping[str, Mapping[str, Any]]]
Contract = Callable[[Kwargs, Mapping[str, np.ndarray], "str | None"], list[str]]


@dataclass(frozen=True)
class SpecEntry:
    """The kernel-specific half of a :class:`KernelSpec` (no functions bound yet).

    ``outputs`` names the returned values in order (a NamedTuple's fields; ``("out",)`` for a
    single array or scalar); ``dtypes`` their dtypes. ``sample(dims, rng)`` builds kwargs;
    ``targets`` are the arguments extremal cases poison (arrays, lists of arrays, or data
    scalars the contract allows to be non-finite); ``errors(rng)`` lists bad kwargs and the
    exception class each must raise; ``scales(kwargs, expected)`` gives, per reduction output,
    ``{"length", "magnitude"}``; ``contract(kwargs, outputs, poisoned)`` returns violated
    output guarantees (``poisoned`` is the extremal label ``"set:argument"``, None for sample
    inputs).
    """

    outputs: tuple[str, ...]
    dtypes: Mapping[str, str]
    sample: Callable[[Dims, np.random.Generator], Kwargs]
    targets: tuple[str, ...]
    errors: Callable[[np.random.Generator], list[tuple[Kwargs, type[BaseException]]]]
    scales: Scales | None = None
    contract: Contract | None = None
    cases: tuple[str, ...] = SHAPE_CASES
    #: Sample inputs are finite, so float outputs must be (False where samples are random
    #: bit patterns that include NaN and Inf on purpose).
    finite_sample: bool = True


def _red(length: int, magnitude: Any) -> dict:
    return {"length": max(int(length), 1), "magnitude": magnitude}


def _finite_outputs(*names: str, when: Callable[[str | None], bool] = lambda p: True) -> Contract:
    """Contract: the named outputs are finite (whenever ``when(poisoned)``)."""
    def check(kwargs, outputs, poisoned):
        if not when(poisoned):
            return []
        bad = [n for n in names if not np.all(np.isfinite(outputs[n]))]
        return [f"output {n!r} holds non-finite values (poisoned: {poisoned})" for n in bad]
    return check


def _unchanged_where_nonfinite(out: str, source: str, kept: str) -> Contract:
    """Contract: where ``source`` is non-finite, output ``out`` equals input ``kept`` bit for bit."""
    def check(kwargs, outputs, poisoned):
        mask = ~np.isfinite(kwargs[source])
        if not mask.any():
            return []
        got = outputs[out][mask].view(np.uint32)
        want = np.asarray(kwargs[kept])[mask].view(np.uint32)
        if np.array_equal(got, want):
            return []
        return [f"{out!r} changed where {source!r} is non-finite (must keep {kept!r} bit for bit)"]
    return check


def _all(*contracts: Contract) -> Contract:
    def check(kwargs, outputs, poisoned):
        return [p for c in contracts for p in c(kwargs, outputs, poisoned)]
    return check


def _wrong_dtype(kwargs: Kwargs, name: str) -> Kwargs:
    bad = dict(kwargs)
    with np.errstate(invalid="ignore"):  # signalling-NaN bit patterns widen quietly
        bad[name] = np.asarray(kwargs[name]).astype(np.float64)
    return bad


def _replace(kwargs: Kwargs, **changes: Any) -> Kwargs:
    bad = dict(kwargs)
    bad.update(changes)
    return bad


def _errors(sample: Callable[[Dims, np.random.Generator], Kwargs],
            *edits: Callable[[Kwargs], Kwargs], exc: type[BaseException] = ValueError):
    """Error cases built from the extremal-size sample: each edit breaks one argument."""
    def build(rng: np.random.Generator) -> list[tuple[Kwargs, type[BaseException]]]:
        base = sample(case_dims("extremal"), rng)
        return [(edit(base), exc) for edit in edits]
    return build


# -- dense ---------------------------------------------------------------------------------
def _s_bias(d: Dims, rng) -> Kwargs:
    return {"y": _normal(rng, (d.batch, d.hidden)), "b": _normal(rng, d.hidden, 0.5)}


def _s_relu_mask(d: Dims, rng) -> Kwargs:
    h = np.where(rng.random((d.batch, d.hidden)) < 0.5, F32(0), _uniform(rng, (d.batch, d.hidden), 0.01, 2))
    return {"dy": _normal(rng, (d.batch, d.hidden)), "h": h.astype(F32)}


def _s_dy(d: Dims, rng) -> Kwargs:
    return {"dy": _normal(rng, (d.batch, d.hidden))}


def _s_bits(d: Dims, rng) -> Kwargs:
    return {"x": _bits_f32(rng, (d.batch, d.hidden))}


def _s_bf16(d: Dims, rng) -> Kwargs:
    return {"u": rng.integers(0, 2**16, size=(d.batch, d.hidden), dtype=np.uint32).astype(np.uint16)}


def _sc_bias_grad(kwargs, expected):
    dy = kwargs["dy"]
    return {"out": _red(dy.shape[0], np.max(np.where(np.isfinite(dy), np.abs(dy), 0), axis=0))}


def _sc_relu_mask_bias_grad(kwargs, expected):
    """db sums the masked gradient (the exact output dx): bias_grad_reduce's scales on dx."""
    return {"db": _sc_bias_grad({"dy": expected["dx"]}, None)["out"]}


# -- distributional --------------------------------------------------------------------------
def _s_dueling(d: Dims, rng) -> Kwargs:
    return {"v": _normal(rng, (d.batch, d.atoms)), "adv": _normal(rng, (d.batch, d.actions, d.atoms))}


def _s_dlogits(d: Dims, rng) -> Kwargs:
    return {"dlogits": _normal(rng, (d.batch, d.actions, d.atoms), 1e-2)}


def _s_logits(d: Dims, rng) -> Kwargs:
    return {"logits": _normal(rng, (d.batch, d.actions, d.atoms), 3.0)}


def _s_expected_q(d: Dims, rng) -> Kwargs:
    return {"logp": _log_softmax(rng, (d.batch, d.actions, d.atoms)), "z": _support(d.atoms)}


def _s_select(d: Dims, rng) -> Kwargs:
    q = np.round(rng.standard_normal((d.batch, d.actions)) * 2) / 2  # half steps: ties occur
    return {"q": q.astype(F32)}


def _s_project(d: Dims, rng) -> Kwargs:
    return {"p_next": _softmax(rng, (d.batch, d.atoms)), "r": _normal(rng, d.batch, 3.0),
            "done": (rng.random(d.batch) < 0.2).astype(F32), "gamma": F32(0.99),
            "z": _support(d.atoms), "v_min": V_MIN, "v_max": V_MAX}


def _s_c51(d: Dims, rng) -> Kwargs:
    return {"logp": _log_softmax(rng, (d.batch, d.actions, d.atoms)),
            "actions": rng.integers(0, d.actions, d.batch).astype(I32),
            "m": _softmax(rng, (d.batch, d.atoms)), "isw": _uniform(rng, d.batch, 0.1, 1.0),
            "scale": F32(1.0 / (d.batch * 2))}


def _s_cql(d: Dims, rng) -> Kwargs:
    return {"logp": _log_softmax(rng, (d.batch, d.actions, d.atoms)),
            "actions": rng.integers(0, d.actions, d.batch).astype(I32),
            "z": _support(d.atoms), "alpha": F32(1.0), "scale": F32(1.0 / (d.batch * 2))}


def _s_log_softmax_q(d: Dims, rng) -> Kwargs:
    """The step's packed rows: online (2B) then target (B) samples, each of A action rows;
    Q over the online rows."""
    rows = d.batch * d.actions
    return {"logits": _normal(rng, (3 * rows, d.atoms), 3.0), "z": _support(d.atoms),
            "q_rows": 2 * rows}


def _s_project_grad(d: Dims, rng) -> Kwargs:
    c51 = _s_c51(d, rng)
    del c51["m"]  # the fused kernel's output
    return {**_s_project(d, rng), **c51}


def _sc_dueling(kwargs, expected):
    return {"out": _red(kwargs["adv"].shape[1], _maxabs(kwargs["v"]) + 2 * _maxabs(kwargs["adv"]))}


def _sc_dueling_bwd(kwargs, expected):
    a, mag = kwargs["dlogits"].shape[1], _maxabs(kwargs["dlogits"])
    return {"dv": _red(a, mag), "dadv": _red(a, 2 * mag)}


def _sc_log_softmax(kwargs, expected):
    x = kwargs["logits"]
    return {"out": _red(x.shape[-1], 1.0 + 2 * _maxabs(x))}


def _sc_expected_q(kwargs, expected):
    return {"out": _red(kwargs["logp"].shape[-1], _maxabs(kwargs["z"]))}


def _sc_project(kwargs, expected):
    return {"out": _red(kwargs["p_next"].shape[-1], 1.0)}


def _sc_c51_loss(kwargs, expected):
    logp, m = kwargs["logp"], kwargs["m"]
    isw_scale = _maxabs(kwargs["isw"]) * _maxabs(kwargs["scale"])
    return {"ce": _red(logp.shape[-1], _maxabs(logp) * max(_maxabs(m), 1.0)),
            "total": _red(logp.shape[0], isw_scale * max(_maxabs(expected["ce"]), 1.0))}


def _not_taken(kwargs) -> np.ndarray:
    """``[B, A, 1]`` mask of the actions not taken (their gradient rows are written 0)."""
    logp, actions = kwargs["logp"], kwargs["actions"]
    return (np.arange(logp.shape[1])[None, :] != actions[:, None])[..., None]


def _sc_c51_grad(kwargs, expected):
    isw_scale = _maxabs(kwargs["isw"]) * _maxabs(kwargs["scale"])
    return {"out": {**_red(kwargs["logp"].shape[-1], isw_scale * max(_maxabs(kwargs["m"]), 1.0)),
                    "exact": _not_taken(kwargs)}}


def _sc_log_softmax_q(kwargs, expected):
    x = kwargs["logits"]
    return {"logp": _red(x.shape[-1], 1.0 + 2 * _maxabs(x)),
            "q": _red(x.shape[-1], _maxabs(kwargs["z"]))}


def _sc_project_grad(kwargs, expected):
    isw_scale = _maxabs(kwargs["isw"]) * _maxabs(kwargs["scale"])
    return {"m": _red(kwargs["p_next"].shape[-1], 1.0),
            "dlogits": {**_red(kwargs["logp"].shape[-1],
                               isw_scale * max(_maxabs(expected["m"]), 1.0)),
                        "exact": _not_taken(kwargs)}}


def _sc_cql(kwargs, expected):
    logp, zmax = kwargs["logp"], _maxabs(kwargs["z"])
    length = logp.shape[-1] + logp.shape[1]
    dmag = _maxabs(kwargs["alpha"]) * _maxabs(kwargs["scale"]) * 2 * zmax
    return {"dlogits": _red(length, dmag), "terms": _red(length, zmax + math.log(logp.shape[1]) + 1)}


# -- fused (every branch in one launch; branch-packed [R * A_total, NA] buffers) --------------
def _branches(d: Dims) -> tuple[int, ...]:
    """Three branches, two of them as wide as the case's largest (the seed's (3, 3, 2))."""
    return (d.actions, d.actions, max(1, d.actions - 1))


def _s_dueling_branches(d: Dims, rng) -> Kwargs:
    br = _branches(d)
    return {"v": _normal(rng, (d.batch, d.atoms)),
            "adv": _normal(rng, (d.batch * sum(br), d.atoms)), "branches": br}


def _s_dlogits_branches(d: Dims, rng) -> Kwargs:
    br = _branches(d)
    return {"dlogits": _normal(rng, (d.batch * sum(br), d.atoms), 1e-2), "branches": br}


def _s_cql_branches(d: Dims, rng) -> Kwargs:
    br = _branches(d)
    rows = 2 * d.batch  # the online pass over [s; s2]: the first B samples of each block
    return {"logp": _log_softmax(rng, (rows * sum(br), d.atoms)),
            "actions": np.stack([rng.integers(0, n, d.batch) for n in br]).astype(I32),
            "z": _support(d.atoms), "alpha": F32(1.0), "scale": F32(1.0 / (d.batch * len(br))),
            "branches": br}


def _sc_dueling_branches(kwargs, expected):
    a = max(kwargs["branches"])
    return {"out": _red(a, _maxabs(kwargs["v"]) + 2 * _maxabs(kwargs["adv"]))}


def _s_dueling_log_softmax_q_branches(d: Dims, rng) -> Kwargs:
    """One forward pass's heads (``dueling_combine_branches``' sample) and the support: with Q
    (the online pass) except in ``odd``, which runs the target pass's no-Q path (``q`` empty;
    ``tiny`` keeps Q: the registry's mutation check perturbs every output of ``tiny``)."""
    return {**_s_dueling_branches(d, rng), "z": _support(d.atoms), "with_q": d.case != "odd"}


def _sc_dueling_log_softmax_q_branches(kwargs, expected):
    """dueling_combine_branches' scale for ``logits``, log_softmax_expected_q's for the rest."""
    a, na = max(kwargs["branches"]), kwargs["v"].shape[1]
    return {"logits": _red(a, _maxabs(kwargs["v"]) + 2 * _maxabs(kwargs["adv"])),
            "logp": _red(na, 1.0 + 2 * _maxabs(expected["logits"])),
            "q": _red(na, _maxabs(kwargs["z"]))}


def _sc_dueling_bwd_branches(kwargs, expected):
    a, mag = max(kwargs["branches"]), _maxabs(kwargs["dlogits"])
    return {"dv": _red(a, mag), "dadv": _red(a, 2 * mag)}


def _sc_dueling_bwd_sum_branches(kwargs, expected):
    br, mag = kwargs["branches"], _maxabs(kwargs["dlogits"])
    return {"dv": _red(sum(br) + len(br), mag), "dadv": _red(max(br), 2 * mag)}


def _sc_cql_branches(kwargs, expected):
    logp, zmax, a = kwargs["logp"], _maxabs(kwargs["z"]), max(kwargs["branches"])
    length = logp.shape[-1] + a
    dmag = _maxabs(kwargs["alpha"]) * _maxabs(kwargs["scale"]) * 2 * zmax
    return {"dlogits": _red(length, dmag), "terms": _red(length, zmax + math.log(a) + 1)}


def _s_c51_branches(d: Dims, rng) -> Kwargs:
    br = _branches(d)
    rows = 2 * d.batch  # the online pass over [s; s2]: the first B samples of each block
    return {"logp": _log_softmax(rng, (rows * sum(br), d.atoms)),
            "actions": np.stack([rng.integers(0, n, d.batch) for n in br]).astype(I32),
            "m": _softmax(rng, (len(br), d.batch, d.atoms)),
            "isw": _uniform(rng, d.batch, 0.1, 1.0), "scale": F32(1.0 / (d.batch * len(br))),
            "branches": br}


def _sc_c51_loss_branches(kwargs, expected):
    """c51_loss's scales per branch (global maxima over the branches)."""
    logp, m = kwargs["logp"], kwargs["m"]
    isw_scale = _maxabs(kwargs["isw"]) * _maxabs(kwargs["scale"])
    return {"ce": _red(logp.shape[-1], _maxabs(logp) * max(_maxabs(m), 1.0)),
            "total": _red(m.shape[1], isw_scale * max(_maxabs(expected["ce"]), 1.0))}


# -- optim -----------------------------------------------------------------------------------
def _norm_sq(x: np.ndarray) -> np.float32:
    x64 = x.astype(np.float64)
    return F32(np.sum(x64[np.isfinite(x64)] ** 2))


def _s_vec(d: Dims, rng) -> Kwargs:
    return {"x": _normal(rng, d.flat, 0.1)}


def _s_partial(d: Dims, rng) -> Kwargs:
    return {"x": _normal(rng, d.flat, 0.1), "block_size": 256}


def _s_final(d: Dims, rng) -> Kwargs:
    return {"partials": _uniform(rng, -(-d.flat // 256), 0.0, 3.0)}


def _s_clip(d: Dims, rng) -> Kwargs:
    x = _normal(rng, d.flat, 0.1)
    ns = _norm_sq(x)
    return {"x": x, "max_norm": F32(0.5 * math.sqrt(ns)), "norm_sq": ns}


def _s_saxpy(d: Dims, rng) -> Kwargs:
    return {"y": _normal(rng, d.flat), "x": _normal(rng, d.flat, 0.1), "a": F32(0.3)}


def _s_clipped_saxpy(d: Dims, rng) -> Kwargs:
    x = _normal(rng, d.flat, 0.1)
    ns = _norm_sq(x)
    return {"y": _normal(rng, d.flat), "x": x, "a": F32(0.7), "max_norm": F32(0.5 * math.sqrt(ns)),
            "norm_sq": ns}


def _s_adam(d: Dims, rng) -> Kwargs:
    return {"param": _normal(rng, d.flat, 0.1), "grad": _normal(rng, d.flat, 0.01),
            "m": _normal(rng, d.flat, 1e-3), "v": _uniform(rng, d.flat, 0.0, 1e-4),
            "step": 3, "lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
            "weight_decay": 0.01, "grad_scale": F32(0.8), "weight_clamp": F32(100.0)}


def _s_polyak(d: Dims, rng) -> Kwargs:
    return {"target": _normal(rng, d.flat, 0.1), "online": _normal(rng, d.flat, 0.1), "tau": F32(0.005)}


def _norm_partials(x: np.ndarray, segment: int) -> np.ndarray:
    """Phase-1 norm partials of ``x`` (finite squares per ``segment``, float64 sums)."""
    return np.array([_norm_sq(x[k:k + segment]) for k in range(0, x.size, segment)], dtype=F32)


def _s_clip_saxpy_partial(d: Dims, rng) -> Kwargs:
    """The step's budget tail: both components over their budgets (both clips act), their
    norms given as phase-1 partials; the seed case uses the step's 4096-element norm segments,
    the others 256 (many segments, tails)."""
    seg = 4096 if d.case == "seed" else 256
    base, inject = _normal(rng, d.flat, 0.1), _normal(rng, d.flat, 0.1)
    base_sq, inject_sq = _norm_sq(base), _norm_sq(inject)
    return {"base": base, "inject": inject, "base_max_norm": F32(0.7 * math.sqrt(base_sq)),
            "base_partials": _norm_partials(base, seg), "a": F32(1.0),
            "inject_max_norm": F32(0.15 * math.sqrt(inject_sq)),
            "inject_partials": _norm_partials(inject, seg), "block_size": seg}


def _sq_mag(x: np.ndarray) -> float:
    return _maxabs(x) ** 2


def _sc_guarded_saxpy(kwargs, expected):
    """Where ``x`` is non-finite, ``y`` is kept bit for bit."""
    return {"out": {"exact": ~np.isfinite(kwargs["x"])}}


def _sc_adam(kwargs, expected):
    """An element whose scaled gradient is non-finite is returned bit for bit."""
    with np.errstate(all="ignore"):
        skipped = ~np.isfinite(kwargs["grad"] * F32(kwargs["grad_scale"]))
    return {name: {"exact": skipped} for name in ("param", "m", "v")}


def _sc_norm(kwargs, expected):
    return {"out": _red(kwargs["x"].size, _sq_mag(kwargs["x"]))}


def _sc_partial(kwargs, expected):
    return {"out": _red(kwargs["block_size"], _sq_mag(kwargs["x"]))}


def _sc_final(kwargs, expected):
    return {"out": _red(kwargs["partials"].size, _maxabs(kwargs["partials"]))}


def _clip_factor64(norm_sq: float, max_norm: float) -> float:
    """``clip_scale`` in float64 (for bounds): NaN norm 1, +Inf norm 0."""
    n = math.sqrt(max(float(norm_sq), 0.0)) if not math.isnan(norm_sq) else 0.0
    return float(max_norm) / n if n > max_norm and n > 0 else 1.0


def _sc_clip_saxpy_partial(kwargs, expected):
    """The norms sum ``P`` partials (``grad_norm_final``); ``out_i = c_i + a y_i s_i`` with
    clip factors from those norms, which the two sides round differently: each factor is off
    by up to ~``P`` roundings, so ``out_i`` by that much of its terms ``|c_i| + |a y_i s_i|``
    (finite ones); ``partials`` sum ``block_size`` squares."""
    count = kwargs["base_partials"].size
    s_b = _clip_factor64(expected["base_norm_sq"], kwargs["base_max_norm"])
    s_i = _clip_factor64(expected["inject_norm_sq"], kwargs["inject_max_norm"])
    base64 = np.abs(kwargs["base"].astype(np.float64)) * s_b
    inject64 = np.abs(kwargs["inject"].astype(np.float64) * float(kwargs["a"])) * s_i
    terms = (np.where(np.isfinite(base64), base64, 0.0)
             + np.where(np.isfinite(inject64), inject64, 0.0))
    return {"out": _red(count + 2, terms),
            "partials": _red(kwargs["block_size"], _sq_mag(expected["out"])),
            "base_norm_sq": _red(count, _maxabs(kwargs["base_partials"])),
            "inject_norm_sq": _red(count, _maxabs(kwargs["inject_partials"]))}


# -- spectral --------------------------------------------------------------------------------
def _unit(rng, n: int) -> np.ndarray:
    x = rng.standard_normal(n)
    return (x / np.linalg.norm(x)).astype(F32)


def _s_spectral(d: Dims, rng) -> Kwargs:
    return {"w": _normal(rng, (d.w_out, d.w_in), 0.3), "u": _unit(rng, d.w_out), "v": _unit(rng, d.w_in),
            "sigma_max": 3.0}


def _s_batched(d: Dims, rng) -> Kwargs:
    shapes = [(d.w_out, d.w_in), (d.w_in, d.w_out), (max(d.w_out // 2, 1), d.w_in + 3)]
    return {"ws": [_normal(rng, s, 0.3) for s in shapes], "us": [_unit(rng, s[0]) for s in shapes],
            "vs": [_unit(rng, s[1]) for s in shapes], "sigma_max": 3.0}


def _spectral_scale(w, sigma_max, expected_w, expected_u, expected_v, sigma) -> dict:
    """Two chained mat-vecs and norms (length out + in); an unscaled W is copied bit for bit."""
    length = sum(w.shape)
    unscaled = not bool(np.asarray(sigma) > F32(sigma_max))
    return {"w": {**_red(length, _maxabs(expected_w)), "exact": unscaled},
            "u": _red(length, _maxabs(expected_u)), "v": _red(length, _maxabs(expected_v)),
            "sigma": _red(length, _maxabs(sigma))}


def _sc_spectral(kwargs, expected):
    return _spectral_scale(kwargs["w"], kwargs["sigma_max"], expected["w"], expected["u"],
                           expected["v"], expected["sigma"])


def _sc_batched(kwargs, expected):
    out = {}
    for k, w in enumerate(kwargs["ws"]):
        one = _spectral_scale(w, kwargs["sigma_max"], expected[f"ws[{k}]"], expected[f"us[{k}]"],
                              expected[f"vs[{k}]"], expected[f"sigmas[{k}]"])
        for name, plural in (("w", "ws"), ("u", "us"), ("v", "vs"), ("sigma", "sigmas")):
            out[f"{plural}[{k}]"] = one[name]
    return out


# -- safety ----------------------------------------------------------------------------------
def _s_clamp(d: Dims, rng) -> Kwargs:
    return {"x": _normal(rng, (d.batch, d.hidden), 3.0), "m": F32(2.0)}


def _s_nan_check(d: Dims, rng) -> Kwargs:
    return {"x": _normal(rng, (d.batch, d.hidden)), "flag": int(rng.integers(0, 2))}


def _s_fused(d: Dims, rng) -> Kwargs:
    sizes = (d.batch * d.hidden, d.flat, d.atoms, 1)
    return {"buffers": [_normal(rng, n) for n in sizes[:2]] + [None] + [_normal(rng, n) for n in sizes[2:]],
            "flags": np.array([0, 1, 0, 0, 0], dtype=I32),
            "thresholds": np.array([0.0, 2.5, 1.0, 3.0, -1.0], dtype=F32)}


def _s_max_abs(d: Dims, rng) -> Kwargs:
    return {"x": _normal(rng, (d.batch, d.hidden))}


def _s_target_clip(d: Dims, rng) -> Kwargs:
    return {"q": _normal(rng, (d.batch, d.actions), 40.0), "k1": 10.0, "q_abs_ref": F32(3.0)}


# -- replay ----------------------------------------------------------------------------------
def _s_prefix(d: Dims, rng) -> Kwargs:
    p = _uniform(rng, d.items, 0.0, 1.0)
    p[rng.random(d.items) < 0.1] = 0  # zero priorities are never sampled
    return {"p": p}


def _s_sample(d: Dims, rng) -> Kwargs:
    p = _s_prefix(d, rng)["p"]
    return {"prefix": np.cumsum(p, dtype=F32), "u": _uniform(rng, d.batch, 0.0, 1.0)}


def _s_weights(d: Dims, rng) -> Kwargs:
    return {"priorities": _uniform(rng, d.items, 0.01, 1.0),
            "idx": rng.integers(0, d.items, d.batch).astype(I32), "beta": 0.4, "n_valid": d.items}


def _sc_prefix(kwargs, expected):
    return {"out": _red(kwargs["p"].size, _maxabs(kwargs["p"]))}


def _sc_weights(kwargs, expected):
    return {"out": _red(1, 1.0)}  # one division and one powf per weight, weights in (0, 1]


# -- isv -------------------------------------------------------------------------------------
def _s_isv_signal(d: Dims, rng) -> Kwargs:
    from foxhunt.reference import isv as isv_registry

    return {"isv": _isv_vector(rng), "signals": _normal(rng, isv_registry.NUM_SIGNALS),
            "sharpe": F32(rng.standard_normal()), "alpha_base": 0.05}


def _s_isv_q(d: Dims, rng) -> Kwargs:
    return {"isv": _isv_vector(rng), "q": _normal(rng, (d.batch, d.actions), 5.0), "alpha": 0.05}


def _s_isv_h2(d: Dims, rng) -> Kwargs:
    return {"isv": _isv_vector(rng), "h2": _normal(rng, (d.batch, d.hidden)), "alpha": 0.05}


def _isv_copied(updated: Sequence[int]) -> np.ndarray:
    """Mask of the ISV slots a producer kernel only copies (all but ``updated``)."""
    from foxhunt.reference import isv as isv_registry

    mask = np.ones(isv_registry.ISV_LEN, dtype=bool)
    mask[list(updated)] = False
    return mask


def _sc_isv_signal(kwargs, expected):
    from foxhunt.reference import isv as isv_registry

    return {"out": {"exact": _isv_copied(range(isv_registry.NUM_SIGNALS))}}


def _sc_isv(source: str, slot_index: str, square: bool) -> Scales:
    """The EMA slot's bound scales with the reduced source and the slot's old value; every
    other slot is copied and must match bit for bit."""
    def scales(kwargs, expected):
        from foxhunt.reference import isv as isv_registry

        index = getattr(isv_registry, slot_index)
        x = kwargs[source]
        mag = _sq_mag(x) if square else _maxabs(x)
        return {"out": {**_red(np.asarray(x).size, max(mag, _maxabs(kwargs["isv"][index]))),
                        "exact": _isv_copied([index])}}
    return scales


def _isv_finite_where_finite(kwargs, outputs, poisoned):
    """A slot that held a finite value still does (the EMA guards)."""
    src = kwargs["isv"]
    bad = np.isfinite(src) & ~np.isfinite(outputs["out"])
    return [f"isv slots {np.flatnonzero(bad).tolist()} turned non-finite"] if bad.any() else []


# -------------------------------------------------------------------------------- the table
#: Label prefix of ad-hoc injections (hypothesis) whose finite values are all small.
OVERFLOW_FREE_INJECTION = "injected-small"


def _no_overflow(poisoned: str | None) -> bool:
    """True for sample inputs, extremal sets without huge finite values, and ad-hoc injections
    labelled :data:`OVERFLOW_FREE_INJECTION`; False for anything else."""
    if poisoned is None:
        return True
    label = poisoned.split(":")[0]
    if label == OVERFLOW_FREE_INJECTION:
        return True
    return any(s.label == label and s.overflow_free for s in EXTREMAL_SETS)


_F, _I, _U16 = "float32", "int32", "uint16"

SPEC_TABLE: Mapping[str, SpecEntry] = MappingProxyType({
    # dense
    "add_bias_relu": SpecEntry(
        ("out",), {"out": _F}, _s_bias, ("y", "b"),
        _errors(_s_bias, lambda k: _replace(k, b=k["b"][:-1]), lambda k: _wrong_dtype(k, "y"),
                lambda k: _replace(k, y=k["y"][0]))),
    "add_bias_relu_bf16": SpecEntry(
        ("out", "out_bf16"), {"out": _F, "out_bf16": _U16}, _s_bias, ("y", "b"),
        _errors(_s_bias, lambda k: _replace(k, b=k["b"][:-1]), lambda k: _wrong_dtype(k, "b"))),
    "relu_mask": SpecEntry(
        ("out",), {"out": _F}, _s_relu_mask, ("dy", "h"),
        _errors(_s_relu_mask, lambda k: _replace(k, h=k["h"][:, :-1]), lambda k: _wrong_dtype(k, "dy"))),
    "bias_grad_reduce": SpecEntry(
        ("out",), {"out": _F}, _s_dy, ("dy",),
        _errors(_s_dy, lambda k: _wrong_dtype(k, "dy"), lambda k: _replace(k, dy=k["dy"][0])),
        scales=_sc_bias_grad),
    "relu_mask_bias_grad": SpecEntry(
        ("dx", "db"), {"dx": _F, "db": _F}, _s_relu_mask, ("dy", "h"),
        _errors(_s_relu_mask, lambda k: _replace(k, h=k["h"][:, :-1]), lambda k: _wrong_dtype(k, "dy"),
                lambda k: _replace(k, dy=k["dy"][0], h=k["h"][0])),
        scales=_sc_relu_mask_bias_grad),
    "f32_to_bf16": SpecEntry(
        ("out",), {"out": _U16}, _s_bits, ("x",),
        _errors(_s_bits, lambda k: _wrong_dtype(k, "x")), finite_sample=False),
    "bf16_to_f32": SpecEntry(
        ("out",), {"out": _F}, _s_bf16, ("u",),
        _errors(_s_bf16, lambda k: _replace(k, u=k["u"].astype(np.int32))), finite_sample=False),
    "tf32_round": SpecEntry(
        ("out",), {"out": _F}, _s_bits, ("x",),
        _errors(_s_bits, lambda k: _wrong_dtype(k, "x")), finite_sample=False),
    # distributional
    "dueling_combine": SpecEntry(
        ("out",), {"out": _F}, _s_dueling, ("v", "adv"),
        _errors(_s_dueling, lambda k: _replace(k, v=k["v"][:, :-1]), lambda k: _wrong_dtype(k, "adv")),
        scales=_sc_dueling),
    "dueling_combine_backward": SpecEntry(
        ("dv", "dadv"), {"dv": _F, "dadv": _F}, _s_dlogits, ("dlogits",),
        _errors(_s_dlogits, lambda k: _wrong_dtype(k, "dlogits"),
                lambda k: _replace(k, dlogits=k["dlogits"][0])),
        scales=_sc_dueling_bwd),
    "log_softmax_atoms": SpecEntry(
        ("out",), {"out": _F}, _s_logits, ("logits",),
        _errors(_s_logits, lambda k: _wrong_dtype(k, "logits")),
        scales=_sc_log_softmax),
    "expected_q": SpecEntry(
        ("out",), {"out": _F}, _s_expected_q, ("logp", "z"),
        _errors(_s_expected_q, lambda k: _replace(k, z=k["z"][:-1]), lambda k: _wrong_dtype(k, "logp")),
        scales=_sc_expected_q),
    "log_softmax_expected_q": SpecEntry(
        ("logp", "q"), {"logp": _F, "q": _F}, _s_log_softmax_q, ("logits", "z"),
        _errors(_s_log_softmax_q, lambda k: _replace(k, z=k["z"][:-1]),
                lambda k: _replace(k, q_rows=k["logits"].shape[0] + 1),
                lambda k: _replace(k, q_rows=-1), lambda k: _wrong_dtype(k, "logits"),
                lambda k: _replace(k, logits=k["logits"].reshape(1, *k["logits"].shape))),
        scales=_sc_log_softmax_q),
    "double_dqn_select": SpecEntry(
        ("out",), {"out": _I}, _s_select, ("q",),
        _errors(_s_select, lambda k: _wrong_dtype(k, "q"), lambda k: _replace(k, q=k["q"][0]))),
    "c51_project": SpecEntry(
        ("out",), {"out": _F}, _s_project, ("p_next", "r", "done", "gamma"),
        _errors(_s_project, lambda k: _replace(k, r=k["r"][:-1]), lambda k: _replace(k, v_min=20.0),
                lambda k: _replace(k, z=k["z"][:-1]), lambda k: _wrong_dtype(k, "p_next")),
        scales=_sc_project),
    "c51_loss": SpecEntry(
        ("ce", "total"), {"ce": _F, "total": _F}, _s_c51, ("logp", "m", "isw", "scale"),
        _errors(_s_c51, lambda k: _replace(k, actions=np.full_like(k["actions"], k["logp"].shape[1])),
                lambda k: _replace(k, actions=k["actions"].astype(np.int64)),
                lambda k: _replace(k, isw=k["isw"][:-1])),
        scales=_sc_c51_loss),
    "c51_grad": SpecEntry(
        ("out",), {"out": _F}, _s_c51, ("logp", "m", "isw", "scale"),
        _errors(_s_c51, lambda k: _replace(k, actions=np.full_like(k["actions"], -1)),
                lambda k: _replace(k, m=k["m"][:, :-1])),
        scales=_sc_c51_grad),
    "c51_project_grad": SpecEntry(
        ("m", "dlogits"), {"m": _F, "dlogits": _F}, _s_project_grad,
        ("p_next", "r", "done", "gamma", "logp", "isw", "scale"),
        _errors(_s_project_grad, lambda k: _replace(k, r=k["r"][:-1]),
                lambda k: _replace(k, v_min=20.0), lambda k: _wrong_dtype(k, "p_next"),
                lambda k: _replace(k, actions=np.full_like(k["actions"], k["logp"].shape[1])),
                lambda k: _replace(k, logp=k["logp"][:, :, :-1]),
                lambda k: _replace(k, isw=k["isw"][:-1])),
        scales=_sc_project_grad),
    "cql_logit_grad": SpecEntry(
        ("dlogits", "terms"), {"dlogits": _F, "terms": _F}, _s_cql, ("logp", "z", "alpha", "scale"),
        _errors(_s_cql, lambda k: _replace(k, actions=np.full_like(k["actions"], k["logp"].shape[1])),
                lambda k: _replace(k, z=k["z"][:-1])),
        scales=_sc_cql),
    # fused
    "dueling_combine_branches": SpecEntry(
        ("out",), {"out": _F}, _s_dueling_branches, ("v", "adv"),
        _errors(_s_dueling_branches, lambda k: _replace(k, v=k["v"][:, :-1]),
                lambda k: _wrong_dtype(k, "adv"), lambda k: _replace(k, branches=(3, 0))),
        scales=_sc_dueling_branches),
    "dueling_log_softmax_q_branches": SpecEntry(
        ("logits", "logp", "q"), {"logits": _F, "logp": _F, "q": _F},
        _s_dueling_log_softmax_q_branches, ("v", "adv", "z"),
        _errors(_s_dueling_log_softmax_q_branches, lambda k: _replace(k, v=k["v"][:, :-1]),
                lambda k: _wrong_dtype(k, "adv"), lambda k: _replace(k, z=k["z"][:-1]),
                lambda k: _wrong_dtype(k, "z"), lambda k: _replace(k, branches=(3, 0)),
                lambda k: _replace(k, with_q=1)),
        scales=_sc_dueling_log_softmax_q_branches),
    "dueling_combine_backward_branches": SpecEntry(
        ("dv", "dadv"), {"dv": _F, "dadv": _F}, _s_dlogits_branches, ("dlogits",),
        _errors(_s_dlogits_branches, lambda k: _wrong_dtype(k, "dlogits"),
                lambda k: _replace(k, dlogits=k["dlogits"][:-1]),
                lambda k: _replace(k, branches=())),
        scales=_sc_dueling_bwd_branches),
    "dueling_combine_backward_sum_branches": SpecEntry(
        ("dv", "dadv"), {"dv": _F, "dadv": _F}, _s_dlogits_branches, ("dlogits",),
        _errors(_s_dlogits_branches, lambda k: _wrong_dtype(k, "dlogits"),
                lambda k: _replace(k, dlogits=k["dlogits"][:-1]),
                lambda k: _replace(k, branches=())),
        scales=_sc_dueling_bwd_sum_branches),
    "cql_logit_grad_branches": SpecEntry(
        ("dlogits", "terms"), {"dlogits": _F, "terms": _F}, _s_cql_branches,
        ("logp", "z", "alpha", "scale"),
        _errors(_s_cql_branches,
                lambda k: _replace(k, actions=np.full_like(k["actions"], max(k["branches"]))),
                lambda k: _replace(k, actions=k["actions"][:-1]),
                lambda k: _replace(k, z=k["z"][:-1])),
        scales=_sc_cql_branches),
    "c51_loss_branches": SpecEntry(
        ("ce", "total"), {"ce": _F, "total": _F}, _s_c51_branches, ("logp", "m", "isw", "scale"),
        _errors(_s_c51_branches,
                lambda k: _replace(k, actions=np.full_like(k["actions"], max(k["branches"]))),
                lambda k: _replace(k, actions=k["actions"].astype(np.int64)),
                lambda k: _replace(k, m=k["m"][:, :, :-1]),
                lambda k: _replace(k, isw=k["isw"][:-1]),
                lambda k: _replace(k, branches=(3, 0))),
        scales=_sc_c51_loss_branches),
    # optim
    "grad_norm_sq": SpecEntry(
        ("out",), {"out": _F}, _s_vec, ("x",),
        _errors(_s_vec, lambda k: _wrong_dtype(k, "x")),
        scales=_sc_norm, contract=_finite_outputs("out", when=_no_overflow)),
    "grad_norm_partial": SpecEntry(
        ("out",), {"out": _F}, _s_partial, ("x",),
        _errors(_s_partial, lambda k: _replace(k, block_size=0), lambda k: _wrong_dtype(k, "x")),
        scales=_sc_partial),
    "grad_norm_final": SpecEntry(
        ("out",), {"out": _F}, _s_final, ("partials",),
        _errors(_s_final, lambda k: _wrong_dtype(k, "partials")),
        scales=_sc_final),
    "clip_grad_inplace": SpecEntry(
        ("out",), {"out": _F}, _s_clip, ("x",),
        _errors(_s_clip, lambda k: _replace(k, max_norm=-1.0), lambda k: _wrong_dtype(k, "x"))),
    "saxpy": SpecEntry(
        ("out",), {"out": _F}, _s_saxpy, ("y", "x"),
        _errors(_s_saxpy, lambda k: _replace(k, x=k["x"][:-1]), lambda k: _wrong_dtype(k, "y")),
        scales=_sc_guarded_saxpy, contract=_unchanged_where_nonfinite("out", "x", "y")),
    "clipped_saxpy": SpecEntry(
        ("out",), {"out": _F}, _s_clipped_saxpy, ("y", "x"),
        _errors(_s_clipped_saxpy, lambda k: _replace(k, x=k["x"][:-1]),
                lambda k: _replace(k, max_norm=-1.0)),
        scales=_sc_guarded_saxpy, contract=_unchanged_where_nonfinite("out", "x", "y")),
    "clip_saxpy_norm_partial": SpecEntry(
        ("out", "partials", "base_norm_sq", "inject_norm_sq"),
        {"out": _F, "partials": _F, "base_norm_sq": _F, "inject_norm_sq": _F},
        _s_clip_saxpy_partial, ("base", "inject", "base_partials", "inject_partials"),
        _errors(_s_clip_saxpy_partial, lambda k: _replace(k, inject=k["inject"][:-1]),
                lambda k: _replace(k, base_max_norm=-1.0), lambda k: _replace(k, block_size=0),
                lambda k: _wrong_dtype(k, "base"),
                lambda k: _replace(k, base=k["base"].reshape(5, -1),
                                   inject=k["inject"].reshape(5, -1)),
                lambda k: _wrong_dtype(k, "base_partials"),
                lambda k: _replace(k, inject_partials=k["inject_partials"][:-1]),
                lambda k: _replace(k, base_partials=k["base_partials"][None, :])),
        scales=_sc_clip_saxpy_partial, contract=_finite_outputs("partials", when=_no_overflow)),
    "adam_update": SpecEntry(
        ("param", "m", "v"), {"param": _F, "m": _F, "v": _F}, _s_adam,
        ("param", "grad", "m", "v", "grad_scale"),
        _errors(_s_adam, lambda k: _replace(k, step=0), lambda k: _replace(k, grad=k["grad"][:-1]),
                lambda k: _replace(k, beta1=1.0), lambda k: _wrong_dtype(k, "m")),
        scales=_sc_adam,
        contract=_all(_finite_outputs("param"), _unchanged_where_nonfinite("param", "grad", "param"))),
    "polyak_update": SpecEntry(
        ("out",), {"out": _F}, _s_polyak, ("target", "online"),
        _errors(_s_polyak, lambda k: _replace(k, tau=1.5), lambda k: _replace(k, online=k["online"][:-1]))),
    "polyak_update_mirror": SpecEntry(
        ("target", "online_bf16", "target_bf16"),
        {"target": _F, "online_bf16": _U16, "target_bf16": _U16}, _s_polyak, ("target", "online"),
        _errors(_s_polyak, lambda k: _replace(k, tau=1.5),
                lambda k: _replace(k, online=k["online"][:-1]), lambda k: _wrong_dtype(k, "target"))),
    # spectral
    "spectral_norm": SpecEntry(
        ("w", "u", "v", "sigma"), {"w": _F, "u": _F, "v": _F, "sigma": _F}, _s_spectral, ("w", "u", "v"),
        _errors(_s_spectral, lambda k: _replace(k, u=k["u"][:-1]), lambda k: _replace(k, sigma_max=0.0),
                lambda k: _wrong_dtype(k, "w")),
        scales=_sc_spectral),
    "batched_spectral_norm": SpecEntry(
        ("ws", "us", "vs", "sigmas"), {"ws": _F, "us": _F, "vs": _F, "sigmas": _F}, _s_batched,
        ("ws", "us", "vs"),
        _errors(_s_batched, lambda k: _replace(k, us=k["us"][:-1]), lambda k: _replace(k, ws=[]),
                lambda k: _replace(k, sigma_max=-3.0)),
        scales=_sc_batched),
    # safety
    "clamp_finite": SpecEntry(
        ("out",), {"out": _F}, _s_clamp, ("x",),
        _errors(_s_clamp, lambda k: _replace(k, m=-1.0), lambda k: _wrong_dtype(k, "x")),
        contract=_finite_outputs("out")),
    "nan_check": SpecEntry(
        ("out",), {"out": _I}, _s_nan_check, ("x",),
        _errors(_s_nan_check, lambda k: _replace(k, flag=2), lambda k: _wrong_dtype(k, "x"))),
    "nan_check_fused": SpecEntry(
        ("out",), {"out": _I}, _s_fused, ("buffers", "thresholds"),
        _errors(_s_fused, lambda k: _replace(k, flags=k["flags"][:-1]),
                lambda k: _replace(k, flags=k["flags"].astype(np.int64)),
                lambda k: _replace(k, thresholds=k["thresholds"][:-1]))),
    "max_abs": SpecEntry(
        ("out",), {"out": _F}, _s_max_abs, ("x",),
        _errors(_s_max_abs, lambda k: _wrong_dtype(k, "x"))),
    "target_q_clip": SpecEntry(
        ("out",), {"out": _F}, _s_target_clip, ("q", "q_abs_ref"),
        _errors(_s_target_clip, lambda k: _replace(k, k1=-1.0), lambda k: _wrong_dtype(k, "q"))),
    # replay
    "prefix_sum": SpecEntry(
        ("out",), {"out": _F}, _s_prefix, ("p",),
        _errors(_s_prefix, lambda k: _wrong_dtype(k, "p"), lambda k: _replace(k, p=k["p"].reshape(5, -1))),
        scales=_sc_prefix),
    "sample_proportional": SpecEntry(
        ("out",), {"out": _I}, _s_sample, ("prefix", "u"),
        _errors(_s_sample, lambda k: _replace(k, prefix=k["prefix"][:0]), lambda k: _wrong_dtype(k, "u"))),
    "importance_weights": SpecEntry(
        ("out",), {"out": _F}, _s_weights, ("priorities",),
        _errors(_s_weights, lambda k: _replace(k, idx=np.full_like(k["idx"], k["n_valid"])),
                lambda k: _replace(k, beta=1.5), lambda k: _replace(k, n_valid=0)),
        scales=_sc_weights),
    # isv
    "isv_signal_update": SpecEntry(
        ("out",), {"out": _F}, _s_isv_signal, ("signals", "sharpe"),
        _errors(_s_isv_signal, lambda k: _replace(k, isv=k["isv"][:-1]),
                lambda k: _replace(k, signals=k["signals"][:-1]), lambda k: _replace(k, alpha_base=0.9)),
        scales=_sc_isv_signal, contract=_isv_finite_where_finite),
    "isv_q_abs_ref_update": SpecEntry(
        ("out",), {"out": _F}, _s_isv_q, ("q",),
        _errors(_s_isv_q, lambda k: _replace(k, alpha=1.5), lambda k: _wrong_dtype(k, "q")),
        scales=_sc_isv("q", "Q_ABS_REF_INDEX", square=False), contract=_isv_finite_where_finite),
    "isv_h2_rms_update": SpecEntry(
        ("out",), {"out": _F}, _s_isv_h2, ("h2",),
        _errors(_s_isv_h2, lambda k: _replace(k, alpha=-0.1), lambda k: _wrong_dtype(k, "h2")),
        scales=_sc_isv("h2", "H_S2_RMS_EMA_INDEX", square=True), contract=_isv_finite_where_finite),
})


# ---------------------------------------------------------------------------- KernelSpec
@dataclass(frozen=True)
class KernelSpec:
    """A kernel's reference function, fast test entry (None where the fast path has none) and
    how to test them (see the module docstring)."""

    name: str
    ref: Callable
    fast: Callable | None
    entry: SpecEntry = field(repr=False)
    tolerance: Mapping[str, Tolerance] = field(repr=False)

    @property
    def outputs(self) -> tuple[str, ...]:
        return self.entry.outputs

    @property
    def shape_cases(self) -> tuple[str, ...]:
        return self.entry.cases

    def sample_inputs(self, shape_case: str, rng: np.random.Generator) -> Kwargs:
        if shape_case not in self.shape_cases:
            raise ValueError(f"{self.name}: shape case {shape_case!r} not in {self.shape_cases}")
        return self.entry.sample(case_dims(shape_case), rng)

    def extremal_labels(self) -> tuple[str, ...]:
        return tuple(f"{s.label}:{t}" for s in EXTREMAL_SETS for t in self.entry.targets)

    def extremal_case(self, label: str, rng: np.random.Generator) -> Kwargs:
        """The extremal-size sample with one special set injected into one argument."""
        set_label, target = label.split(":")
        xset = next(s for s in EXTREMAL_SETS if s.label == set_label)
        kwargs = self.entry.sample(case_dims("extremal"), rng)
        kwargs[target] = _poison(kwargs[target], xset)
        return kwargs

    def extremal_inputs(self, rng: np.random.Generator) -> list[Kwargs]:
        return [self.extremal_case(label, rng) for label in self.extremal_labels()]

    def error_inputs(self, rng: np.random.Generator) -> list[tuple[Kwargs, type[BaseException]]]:
        return self.entry.errors(rng)

    def split_outputs(self, result: Any) -> dict[str, np.ndarray]:
        """Name the returned values: ``{"out": x}``, a NamedTuple's fields, and lists as
        ``"ws[0]", "ws[1]", ...``. Raises ``AssertionError`` if the structure disagrees."""
        names = self.outputs
        if len(names) == 1:
            values: Sequence = (result,)
        else:
            fields = getattr(result, "_fields", None)
            if fields is not None and tuple(fields) != names:
                raise AssertionError(f"{self.name}: returns fields {fields}, the spec says {names}")
            if not isinstance(result, tuple) or len(result) != len(names):
                raise AssertionError(f"{self.name}: expected a tuple of {len(names)} outputs {names}, "
                                     f"got {type(result).__name__}")
            values = result
        out: dict[str, np.ndarray] = {}
        for name, value in zip(names, values):
            if isinstance(value, (list, tuple)):
                for k, item in enumerate(value):
                    out[f"{name}[{k}]"] = np.asarray(item)
            else:
                out[name] = np.asarray(value)
        return out

    def tolerance_of(self, output: str) -> Tolerance:
        return self.tolerance[output.split("[")[0]]

    def dtype_of(self, output: str) -> np.dtype:
        return np.dtype(self.entry.dtypes[output.split("[")[0]])

    def compare_inputs(self, kwargs: Kwargs, expected: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """Per output, the ``inputs`` its tolerance needs (None where it needs none)."""
        scales = dict(self.entry.scales(kwargs, expected)) if self.entry.scales else {}
        result = {}
        for output in expected:
            kind = self.tolerance_of(output).kind
            if kind == "reduction" and output not in scales:
                raise KeyError(f"{self.name}: output {output!r} has a reduction tolerance "
                               "but the spec gives no length/magnitude for it")
            result[output] = scales.get(output)
        return result

    def check_contract(self, kwargs: Kwargs, outputs: Mapping[str, np.ndarray],
                       poisoned: str | None) -> list[str]:
        return self.entry.contract(kwargs, outputs, poisoned) if self.entry.contract else []


# ----------------------------------------------------------------------- fast-path access
def cuda_availability() -> tuple[bool, str]:
    """``(available, reason)`` from ``foxhunt.fast.cuda_available()``; never raises. A fast
    package without that function (not written yet) counts as unavailable, with that reason."""
    try:
        fast = importlib.import_module("foxhunt.fast")
    except Exception as exc:  # noqa: BLE001 - any import failure means "no fast path here"
        return False, f"foxhunt.fast does not import ({type(exc).__name__}: {exc})"
    check = getattr(fast, "cuda_available", None)
    if check is None:
        return False, "foxhunt.fast has no cuda_available() yet"
    try:
        ok, reason = check()
    except Exception as exc:  # noqa: BLE001
        return False, f"foxhunt.fast.cuda_available() raised {type(exc).__name__}: {exc}"
    return bool(ok), str(reason)


def load_fast_kernels() -> tuple[Mapping[str, Callable], str | None]:
    """``(KERNELS, problem)``: the fast test entries, or ``({}, why)`` when they cannot be
    loaded. A package that imports but defines no ``KERNELS`` yet gives ``({}, None)``."""
    try:
        module = importlib.import_module("foxhunt.fast.kernels")
    except Exception as exc:  # noqa: BLE001
        return {}, f"importing foxhunt.fast.kernels failed: {type(exc).__name__}: {exc}"
    kernels = getattr(module, "KERNELS", None)
    if kernels is None:
        return {}, None
    return MappingProxyType(dict(kernels)), None


def reference_kernels() -> Mapping[str, Callable]:
    from foxhunt.reference.kernels import KERNELS

    return KERNELS


def build_specs(ref_kernels: Mapping[str, Callable], fast_kernels: Mapping[str, Callable],
                table: Mapping[str, SpecEntry] = SPEC_TABLE) -> dict[str, KernelSpec]:
    """A :class:`KernelSpec` for every reference kernel that has a table entry, in reference
    order. Tolerances come from :func:`tolerance_for`; a missing one raises ``KeyError``."""
    specs = {}
    for name, ref in ref_kernels.items():
        entry = table.get(name)
        if entry is None:
            continue  # reported by check_consistency as "no KernelSpec"
        specs[name] = KernelSpec(name, ref, fast_kernels.get(name), entry,
                                 tolerance_for(name, KERNEL_DTYPE))
    return specs


def _signature_key(fn: Callable) -> list[tuple]:
    sig = inspect.signature(fn)
    return [(p.name, p.kind.name, repr(p.default)) for p in sig.parameters.values()]


def check_consistency(cuda_dir: str | Path | None, ref_kernels: Mapping[str, Callable],
                      fast_kernels: Mapping[str, Callable], specs: Mapping[str, KernelSpec],
                      divergences: Mapping[str, str] = DIVERGENCES, *,
                      require_complete: bool = False) -> list[str]:
    """Every way the three kernel sets and the specs disagree, one string per problem.

    Always checked: a CUDA kernel without a reference twin, a fast entry without a reference
    twin, a reference/fast signature mismatch, a reference kernel without a spec (and a spec
    without a reference kernel), stale DIVERGENCES entries. With ``require_complete`` (a GPU
    is present, so the fast path must be whole): every reference kernel also needs a CUDA kernel
    and a fast entry (unless listed in ``divergences``), and an empty CUDA or fast side is a
    problem. :func:`missing_ports` gives those completeness problems on their own.
    """
    problems: list[str] = []
    cuda = cuda_kernels(cuda_dir) if cuda_dir is not None else {}
    ref_names, fast_names, cuda_names = set(ref_kernels), set(fast_kernels), set(cuda)

    for name in sorted(divergences):
        if name not in ref_names:
            problems.append(f"DIVERGENCES lists {name!r}, which is not a reference kernel")
        elif name in cuda_names:
            problems.append(f"DIVERGENCES lists {name!r}, but cuda_src defines it "
                            f"({cuda[name].where}): remove the stale entry")
    for name in sorted(cuda_names - ref_names):
        problems.append(f"CUDA kernel {name!r} ({cuda[name].where}) has no reference twin "
                        "in foxhunt.reference.kernels.KERNELS")
    for name in sorted(fast_names - ref_names):
        problems.append(f"fast kernel {name!r} has no reference twin")
    for name in sorted(ref_names & fast_names):
        if _signature_key(ref_kernels[name]) != _signature_key(fast_kernels[name]):
            problems.append(
                f"signature mismatch for {name!r}: reference {inspect.signature(ref_kernels[name])}"
                f" vs fast {inspect.signature(fast_kernels[name])}")
    for name in sorted(ref_names - set(specs)):
        problems.append(f"reference kernel {name!r} has no KernelSpec (add it to "
                        "foxhunt.conformance.registry.SPEC_TABLE)")
    for name in sorted(set(specs) - ref_names):
        problems.append(f"KernelSpec {name!r} has no reference kernel")
    if require_complete:
        problems += _missing(cuda_names, ref_names, fast_names, divergences)
    return problems


def _missing(cuda_names: set, ref_names: set, fast_names: set, divergences: Mapping) -> list[str]:
    problems = []
    if not cuda_names:
        problems.append('cuda_src/ declares no extern "C" __global__ kernels')
    if not fast_names:
        problems.append("foxhunt.fast.kernels.KERNELS is empty or missing")
    for name in sorted(ref_names - cuda_names - set(divergences)):
        problems.append(f"reference kernel {name!r} has no CUDA kernel in cuda_src/ "
                        "(add it, or list it in DIVERGENCES with a reason)")
    for name in sorted(ref_names - fast_names - set(divergences)):
        problems.append(f"reference kernel {name!r} has no fast test entry in "
                        "foxhunt.fast.kernels.KERNELS")
    return problems


def missing_ports(cuda_dir: str | Path | None, ref_kernels: Mapping[str, Callable],
                  fast_kernels: Mapping[str, Callable],
                  divergences: Mapping[str, str] = DIVERGENCES) -> list[str]:
    """The completeness problems alone: reference kernels without a CUDA kernel or a fast
    entry (not in ``divergences``), and an empty CUDA or fast side."""
    cuda = cuda_kernels(cuda_dir) if cuda_dir is not None else {}
    return _missing(set(cuda), set(ref_kernels), set(fast_kernels), divergences)


# ------------------------------------------------------------------------- module state
#: The reference kernels, the fast test entries (empty until the fast path provides them)
#: and the problem (if any) met while loading the latter.
REF_KERNELS: Mapping[str, Callable] = reference_kernels()
FAST_KERNELS, FAST_LOAD_PROBLEM = load_fast_kernels()

#: One KernelSpec per reference kernel that has a table entry.
SPECS: Mapping[str, KernelSpec] = MappingProxyType(build_specs(REF_KERNELS, FAST_KERNELS))

#: Entries of the table whose reference function does not exist (yet): inactive.
INACTIVE_ENTRIES: tuple[str, ...] = tuple(sorted(set(SPEC_TABLE) - set(REF_KERNELS)))

__all__ = [
    "DIVERGENCES", "EXTREMAL_SETS", "FAST_KERNELS", "FAST_LOAD_PROBLEM", "INACTIVE_ENTRIES",
    "KERNEL_DTYPE", "OVERFLOW_FREE_INJECTION", "REF_KERNELS", "SHAPE_CASES", "SPECS",
    "SPEC_TABLE", "KernelSpec", "SpecEntry", "build_specs", "case_dims", "check_consistency",
    "cuda_availability", "cuda_kernels", "default_cuda_dir", "infrastructure_sources",
    "load_fast_kernels", "missing_ports", "reference_kernels",
]
