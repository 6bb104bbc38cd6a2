"""What a conformance test knows about one kernel: :class:`SpecEntry` (the kernel-specific
record, built by keyword, its tolerances inside), :class:`KernelSpec` (an entry bound to the
reference function and the fast test entry of the same name), the shape cases and the extremal
value sets.

A :class:`SpecEntry` says how to test a kernel, after PyTorch's OpInfo (one record per op,
every field by keyword):

- ``outputs``: the returned values in order (a NamedTuple's fields; ``"out"`` for a single
  array or scalar), each an :class:`Output` with its dtype and the :class:`Tolerance` the fast
  result is judged by (:mod:`foxhunt.conformance.tolerance`);
- ``sample(dims, rng)``: keyword arguments for one shape case (``tiny`` and ``seed`` from the
  config presets, ``odd`` with 257 x 259 tails that cross the 256-thread block boundary);
- ``targets``: the arguments the extremal cases poison (NaN, +/-Inf, +/-0, subnormals and f32
  max injected at the block boundaries of each, one case per special set and argument);
- ``errors(rng)``: bad keyword arguments and the exception class each must raise;
- ``scales(kwargs, expected)``: per reduction (or partly exact) output, the ``length`` and
  ``magnitude`` its bound scales with (and an ``exact`` mask where some elements must match bit
  for bit); required when an output's tolerance is a reduction;
- ``contract(kwargs, outputs, poisoned)``: violated output guarantees (``poisoned`` is the
  extremal label ``"set:argument"``, None for sample inputs).

Optional fields are ``None`` when unset (never a falsy stand-in). An entry checks itself when
it is built: a bad field fails at import, naming the kernel and the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from foxhunt.conformance.strategies import (
    F32_LARGEST_SUBNORMAL,
    F32_MAX,
    F32_SMALLEST_SUBNORMAL,
    F32_TINY,
    Injection,
    boundary_positions,
    inject,
)
from foxhunt.conformance.tolerance import Tolerance

F32 = np.float32

#: Shape cases every kernel is run on (``SpecEntry.cases`` may restrict them).
SHAPE_CASES = ("tiny", "seed", "odd")

#: Flat-buffer lengths: ``tiny`` crosses two 256-element block boundaries with a tail of 3;
#: ``seed`` is SPEC 3's parameter count. Replay sizes: ``seed`` a 100k buffer with a tail.
FLAT_LENGTHS = MappingProxyType({"tiny": 2 * 256 + 3, "seed": 289_611})
REPLAY_ITEMS = MappingProxyType({"tiny": 2 * 256 + 3, "seed": 100_003})

#: Output dtypes a kernel may return.
OUTPUT_DTYPES = ("float32", "int32", "int64", "uint16", "uint8")

#: Label prefix of ad-hoc injections (hypothesis) whose finite values are all small.
OVERFLOW_FREE_INJECTION = "injected-small"

Kwargs = dict[str, Any]
Sample = Callable[["Dims", np.random.Generator], Kwargs]
Errors = Callable[[np.random.Generator], "list[tuple[Kwargs, type[BaseException]]]"]
Scales = Callable[[Kwargs, Mapping[str, np.ndarray]], Mapping[str, Mapping[str, Any]]]
Contract = Callable[[Kwargs, Mapping[str, np.ndarray], "str | None"], "list[str]"]


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
    return Dims(case, cfg.batch_size, cfg.shared_h1, cfg.num_atoms, max(cfg.branches),
                FLAT_LENGTHS[case], cfg.shared_h2, cfg.shared_h1, REPLAY_ITEMS[case])


def case_dims(case: str) -> Dims:
    """Dims of a shape case; ``ValueError`` for an unknown case."""
    if case in ("tiny", "seed"):
        return _preset_dims(case)
    if case == "odd":  # TransformerEngine's 257 x 259 tails: every dimension crosses a block
        return Dims("odd", 257, 259, 51, 3, 257 * 259, 259, 257, 257 * 259)
    if case == "extremal":  # small, but rows of 259 and a flat length of 515 cross 256 and 512
        return Dims("extremal", 5, 259, 11, 3, 515, 7, 5, 515)
    raise ValueError(f"shape case {case!r} is unknown; allowed: {SHAPE_CASES + ('extremal',)}")


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


def no_overflow(poisoned: str | None) -> bool:
    """True for sample inputs, extremal sets without huge finite values, and ad-hoc injections
    labelled :data:`OVERFLOW_FREE_INJECTION`; False for anything else."""
    if poisoned is None:
        return True
    label = poisoned.split(":")[0]
    if label == OVERFLOW_FREE_INJECTION:
        return True
    return any(s.label == label and s.overflow_free for s in EXTREMAL_SETS)


def _bf16_pattern(value: np.float32) -> np.uint16:
    """The BF16 pattern with the same sign/exponent/high mantissa as ``value`` (truncated)."""
    return np.uint16(np.array([value], dtype=F32).view(np.uint32)[0] >> 16)


def poison(value: Any, xset: ExtremalSet) -> Any:
    """``value`` with ``xset`` injected: arrays at their boundary positions, lists per entry,
    scalars replaced by the set's first value."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return type(value)(poison(v, xset) for v in value)
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
@dataclass(frozen=True)
class Output:
    """One returned value of a kernel: its dtype and the tolerance fast vs reference."""

    dtype: str
    tolerance: Tolerance


@dataclass(frozen=True, kw_only=True)
class SpecEntry:
    """How to test one kernel (the fields are described in the module docstring)."""

    #: The kernel's name: the CUDA kernel, the reference function and the fast test entry.
    name: str
    #: Returned values in order, with their dtype and tolerance.
    outputs: Mapping[str, Output]
    #: ``sample(dims, rng) -> kwargs`` for one shape case.
    sample: Sample
    #: Arguments the extremal cases poison (arrays, lists of arrays, or data scalars).
    targets: tuple[str, ...]
    #: ``errors(rng) -> [(bad kwargs, exception class)]``.
    errors: Errors
    #: Bound inputs per reduction output; required where an output's tolerance is a reduction.
    scales: Scales | None = None
    #: Output guarantees beyond the comparison (finite outputs, kept elements).
    contract: Contract | None = None
    #: The shape cases this kernel runs on.
    cases: tuple[str, ...] = SHAPE_CASES
    #: Sample inputs are finite, so float outputs must be (False where samples are random
    #: bit patterns that include NaN and Inf on purpose).
    finite_sample: bool = True

    def __post_init__(self) -> None:
        where = f"SpecEntry {self.name!r}"
        if not (isinstance(self.name, str) and self.name.isidentifier()):
            raise ValueError(f"SpecEntry.name: {self.name!r} is not a kernel name (an identifier)")
        if not self.outputs:
            raise ValueError(f"{where}: outputs is empty; a kernel returns at least one value")
        for out, spec in self.outputs.items():
            if not isinstance(spec, Output) or not isinstance(spec.tolerance, Tolerance):
                raise TypeError(f"{where}: outputs[{out!r}] must be an Output with a Tolerance, "
                                f"got {spec!r}")
            if spec.dtype not in OUTPUT_DTYPES:
                raise ValueError(f"{where}: outputs[{out!r}].dtype {spec.dtype!r} is not one of "
                                 f"{OUTPUT_DTYPES}")
            if spec.tolerance.kind == "reduction" and self.scales is None:
                raise ValueError(f"{where}: outputs[{out!r}] has a reduction tolerance, so "
                                 "scales (its length and magnitude) must be given")
        object.__setattr__(self, "outputs", MappingProxyType(dict(self.outputs)))
        if not isinstance(self.targets, tuple) or not all(isinstance(t, str) for t in self.targets):
            raise ValueError(f"{where}: targets must be a tuple of argument names (empty only for "
                             f"a kernel without float input), got {self.targets!r}")
        unknown = [c for c in self.cases if c not in SHAPE_CASES]
        if not self.cases or unknown:
            raise ValueError(f"{where}: cases {self.cases!r}; allowed: a non-empty subset of "
                             f"{SHAPE_CASES}")
        for field_name in ("sample", "errors"):
            if not callable(getattr(self, field_name)):
                raise TypeError(f"{where}: {field_name} must be callable")

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(self.outputs)

    @property
    def dtypes(self) -> Mapping[str, str]:
        return MappingProxyType({k: v.dtype for k, v in self.outputs.items()})

    @property
    def tolerance(self) -> Mapping[str, Tolerance]:
        return MappingProxyType({k: v.tolerance for k, v in self.outputs.items()})


# ---------------------------------------------------------------------------- KernelSpec
@dataclass(frozen=True)
class KernelSpec:
    """A :class:`SpecEntry` bound to the reference function and the fast test entry (None
    where the fast side has none; the registry check reports that) of the same name."""

    name: str
    ref: Callable
    fast: Callable | None
    entry: SpecEntry

    def __post_init__(self) -> None:
        if self.entry.name != self.name:
            raise ValueError(f"KernelSpec {self.name!r} bound to the entry of {self.entry.name!r}")

    @property
    def outputs(self) -> tuple[str, ...]:
        return self.entry.output_names

    @property
    def tolerance(self) -> Mapping[str, Tolerance]:
        return self.entry.tolerance

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
        kwargs[target] = poison(kwargs[target], xset)
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

    def _output(self, output: str) -> Output:
        base = output.split("[")[0]
        try:
            return self.entry.outputs[base]
        except KeyError:
            raise KeyError(f"{self.name}: output {output!r} is unknown; outputs are "
                           f"{self.outputs}") from None

    def tolerance_of(self, output: str) -> Tolerance:
        return self._output(output).tolerance

    def dtype_of(self, output: str) -> np.dtype:
        return np.dtype(self._output(output).dtype)

    def compare_inputs(self, kwargs: Kwargs, expected: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """Per output, the ``inputs`` its tolerance needs (None where it needs none)."""
        scales = {} if self.entry.scales is None else dict(self.entry.scales(kwargs, expected))
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
        if self.entry.contract is None:
            return []
        return self.entry.contract(kwargs, outputs, poisoned)


__all__ = [
    "EXTREMAL_SETS", "FLAT_LENGTHS", "OUTPUT_DTYPES", "OVERFLOW_FREE_INJECTION", "REPLAY_ITEMS",
    "SHAPE_CASES", "Dims", "ExtremalSet", "KernelSpec", "Output", "SpecEntry", "case_dims",
    "no_overflow", "poison",
]
