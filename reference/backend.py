"""The backend interface: what every trainer (``reference``, ``fast``) provides, in one place.

The training loop (``foxhunt.reference.loop``) and the CLI talk only to this interface, so a
backend is chosen by name and nothing else changes. Both backends hold the same state (params,
target params, Adam m/v/t, spectral-norm u/v, BF16 mirrors, ISV bus, sentinel flags, the Mech 6
slow grad-norm EMA, step counter) and exchange it through ``state_dict`` / ``load_state_dict``
(flat NumPy arrays by name), which is also what checkpoints store: a checkpoint written by one
backend loads into the other.

The facts both trainers must agree on are written here once, and both use them:

- the step scalars (:class:`StepScalars`; :data:`READBACK_FIELDS`, the values a step reads
  back, in the order of a device readback block: :meth:`StepScalars.from_readback`);
- the GEMM mode of each precision (:data:`FORWARD_GEMM_MODE`, :data:`BACKWARD_GEMM_MODE`);
- the deferred-readback rule (:class:`DeferredReadback`, SPEC 9);
- the state a trainer exchanges and its validation (:func:`state_spec`,
  :func:`validate_state_dict`).
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, ClassVar, Mapping, Sequence

import numpy as np

from .batch import Batch
from .config import DQNConfig

#: GEMM mode of the forward and of the backward GEMMs per ``DQNConfig.precision`` (SPEC 9):
#: ``bf16`` runs the forward on BF16 operands and the backward on TF32-rounded F32 operands
#: (cuBLAS has no F32 x BF16 GEMM); ``f32`` is F32 throughout; ``tf32`` is TF32 throughout (F32
#: storage, every GEMM's inputs rounded to TF32 on the tensor cores).
FORWARD_GEMM_MODE: Mapping[str, str] = MappingProxyType(
    {"f32": "f32", "bf16": "bf16", "tf32": "tf32"})
BACKWARD_GEMM_MODE: Mapping[str, str] = MappingProxyType(
    {"f32": "f32", "bf16": "tf32", "tf32": "tf32"})


@dataclass(frozen=True)
class StepScalars:
    """Scalars of a step, subject to the deferred-readback rule (SPEC 9, :class:`DeferredReadback`).

    ``read_at`` is the step whose values these are; ``fresh`` says whether they were read at this
    step (``read_at == step``). Between readbacks a trainer returns the last values read.
    Norms are L2 norms of each gradient source before and after its budget clip; ``grad_norm`` is
    the norm entering Adam; ``safety_clip_fired`` says whether Adam's global clip scaled it.

    ``loss`` is the main loss ``c51_loss + cql_loss``; ``c51_loss`` is the MSE-blended
    ``(1 - w) c51 + w mse`` while the warm-up runs (``mse_weight`` w > 0). The second-wave
    fields (``iqn_*``, ``ens_*``, ``aux_*``, ``mse_*``; unweighted losses, norms before their
    source weight) are 0 for a source that is off.
    """

    step: int
    read_at: int
    fresh: bool
    loss: float
    c51_loss: float
    cql_loss: float
    grad_norm: float
    c51_norm_pre: float
    c51_norm_post: float
    cql_norm_pre: float
    cql_norm_post: float
    clip_bound: float
    safety_clip_fired: bool
    mean_q: float
    mean_target_q: float
    iqn_loss: float
    iqn_norm_pre: float
    iqn_norm_post: float
    ens_loss: float
    ens_norm_pre: float
    ens_norm_post: float
    aux_next_bar_loss: float
    aux_regime_loss: float
    mse_loss: float
    mse_weight: float
    flags: tuple[int, ...] = field(default_factory=tuple)

    #: The float fields that must be finite; a non-finite one forces a fresh read next step.
    FINITE_FIELDS: ClassVar[tuple[str, ...]] = (
        "loss", "c51_loss", "cql_loss", "grad_norm", "c51_norm_pre", "cql_norm_pre",
        "iqn_loss", "iqn_norm_pre", "ens_loss", "ens_norm_pre", "aux_next_bar_loss",
        "aux_regime_loss", "mse_loss",
    )

    def all_finite(self) -> bool:
        return all(np.isfinite(getattr(self, f)) for f in self.FINITE_FIELDS)

    def as_stale(self, step: int) -> "StepScalars":
        """``dataclasses.replace(self, step=step, fresh=False)``, without its ``__init__`` (a
        fast trainer's every step returns one: 5.3 us through ``replace`` on the dev machine's
        CPU, 0.6 us this way)."""
        stale = object.__new__(type(self))
        fields = stale.__dict__
        fields.update(self.__dict__)
        fields["step"], fields["fresh"] = step, False
        return stale

    @classmethod
    def zero(cls, n_flags: int) -> "StepScalars":
        """What a trainer returns before its first read: step 0, every value 0, flags clear."""
        values = {name: 0.0 for name in READBACK_FIELDS}
        values["safety_clip_fired"] = False
        return cls(step=0, read_at=0, fresh=False, flags=(0,) * n_flags, **values)

    @classmethod
    def from_readback(cls, step: int, values: Sequence[float], flags: Sequence[int]) -> "StepScalars":
        """Fresh scalars of ``step`` from a readback block: ``values[i]`` is field
        ``READBACK_FIELDS[i]`` (``safety_clip_fired`` as 0 / non-zero)."""
        if len(values) != len(READBACK_FIELDS):
            raise ValueError(f"readback block: {len(values)} values, expected "
                             f"{len(READBACK_FIELDS)} ({', '.join(READBACK_FIELDS)})")
        read = {name: float(v) for name, v in zip(READBACK_FIELDS, values)}
        read["safety_clip_fired"] = read["safety_clip_fired"] != 0.0
        return cls(step=step, read_at=step, fresh=True, flags=tuple(int(f) for f in flags), **read)


#: Each gradient source's loss field (``config.BUDGET_SOURCES`` order; every source also has
#: ``<source>_norm_pre`` / ``<source>_norm_post``), then the losses without a budget of their
#: own (the auxiliary heads sit in the C51 budget; the MSE warm-up is blended into C51).
SOURCE_LOSS_FIELDS: tuple[str, ...] = ("c51_loss", "cql_loss", "iqn_loss", "ens_loss",
                                       "aux_next_bar_loss", "aux_regime_loss", "mse_loss")

#: The fields a step reads back (every :class:`StepScalars` field but the bookkeeping ``step``,
#: ``read_at``, ``fresh`` and the ``flags``, read on their own), in declaration order: the
#: layout of a device readback block.
READBACK_FIELDS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(StepScalars) if f.name not in ("step", "read_at", "fresh", "flags"))


class DeferredReadback:
    """SPEC 9's deferred-readback rule, kept by every trainer.

    A step's scalars are read (fresh) when its number is a multiple of ``interval``, or when the
    previous read held a non-finite :attr:`StepScalars.FINITE_FIELDS` value; otherwise the last
    values read are returned, marked stale. ``end_epoch`` reads the last step's values whenever a
    step ran since the last :meth:`reset` (``load_state_dict`` resets; ``fold_boundary`` does
    not). ``read`` is called only when a read is due, so a device trainer synchronises only then.
    """

    def __init__(self, interval: int, n_flags: int):
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ValueError(f"readback_interval: {interval!r}; expected an int >= 1")
        self.interval = interval
        self.n_flags = n_flags
        self.reset()

    def reset(self) -> None:
        """Back to the state before any step: zero scalars, no forced read."""
        self.last = StepScalars.zero(self.n_flags)
        self.force_fresh = False
        self.stepped = False

    def is_due(self, step: int) -> bool:
        return step % self.interval == 0 or self.force_fresh

    def after_step(self, step: int, read: Callable[[], StepScalars]) -> StepScalars:
        """The scalars ``step()`` returns for step number ``step``."""
        self.stepped = True
        if self.is_due(step):
            return self._take(read())
        return self.last.as_stale(step)

    def end_epoch(self, step: int, read: Callable[[], StepScalars]) -> StepScalars:
        """The scalars ``end_epoch()`` returns: fresh if a step ran since the last reset."""
        if self.stepped:
            self._take(read())
        return dataclasses.replace(self.last, step=step, fresh=self.stepped)

    def _take(self, scalars: StepScalars) -> StepScalars:
        self.last = scalars
        self.force_fresh = not scalars.all_finite()
        return scalars


# ------------------------------------------------------------------------------ state
def state_spec(config: DQNConfig) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """``{key: (shape, dtype)}`` of the state every trainer exchanges (``state_dict``): the flat
    buffers (every tensor of the layout, second-wave heads included), Adam's moments and
    counter, the ISV, the flags, the step count, the spectral-norm vectors of every trained
    weight matrix and, with the IQN head on, ``seed`` (its quantile generator's key)."""
    from . import isv as isv_mod
    from . import sentinels
    from .layout import ParamLayout

    layout = ParamLayout(config)
    f32, i32, i64 = np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.int64)
    n = layout.num_elements
    spec = {
        "params": ((n,), f32), "target": ((n,), f32), "adam_m": ((n,), f32), "adam_v": ((n,), f32),
        "adam_t": ((1,), i64), "isv": ((isv_mod.ISV_LEN,), f32),
        "flags": ((sentinels.NUM_SENTINEL_SLOTS,), i32), "step": ((1,), i64),
    }
    for t in layout.weight_matrices:
        spec[f"sn_u.{t.name}"] = ((t.shape[0],), f32)
        spec[f"sn_v.{t.name}"] = ((t.shape[1],), f32)
    if config.iqn_on:  # the quantile fractions' generator key: a resumed run draws the same
        spec["seed"] = ((1,), i64)
    return spec


def validate_state_dict(config: DQNConfig, state: Mapping[str, np.ndarray]) -> None:
    """Check ``state`` against :func:`state_spec` and the ISV fingerprint before anything is
    loaded: ``ValueError`` naming the key (missing, unexpected, not an array, wrong shape or
    dtype), ``FingerprintMismatch`` for an ISV vector of another registry."""
    from . import isv as isv_mod

    expected = state_spec(config)
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise ValueError(f"state mismatch: missing {missing}, unexpected {extra}")
    for k, (shape, dtype) in expected.items():
        value = state[k]
        if not isinstance(value, np.ndarray):
            raise ValueError(f"state[{k!r}]: expected a numpy array, got {type(value).__name__}")
        if value.shape != shape or value.dtype != dtype:
            raise ValueError(f"state[{k!r}]: shape {value.shape} dtype {value.dtype}, "
                             f"expected shape {shape} dtype {dtype}")
    isv_mod.ISVBus().from_array(state["isv"])  # FingerprintMismatch, before any field is loaded


def check_epoch(epoch) -> int:
    """``epoch`` as an int, or ``ValueError``: an integer in ``[0, 2**24]`` (ISV slots are
    float32, exact for integers up to 2**24)."""
    if isinstance(epoch, (bool, np.bool_)) or not isinstance(epoch, (int, np.integer)) \
            or not 0 <= epoch <= 2**24:
        raise ValueError(f"epoch={epoch!r}: must be an integer in [0, {2**24}]")
    return int(epoch)


# ------------------------------------------------------------------------------ the interface
class TrainerBackend(abc.ABC):
    """A trainer: state on some device, one ``step`` per batch.

    Contract (both backends, tested by the conformance suite):
    - ``step(batch)`` runs SPEC 4 in order and returns ``StepScalars`` under the deferred-readback
      rule (:class:`DeferredReadback`): fresh at steps that are multiples of
      ``readback_interval``, on ``end_epoch()``, and on the step after a fresh read with a
      non-finite value; otherwise the last values. The batch is validated once, before any
      state changes.
    - ``end_epoch()`` returns fresh scalars of the last step.
    - ``fold_boundary()`` does Mech 3 (hard target sync), Mech 4 (Adam m, v, t reset), ISV
      FoldReset/SoftReset, and resets the sentinel flags; it keeps the Mech 6 slow EMA.
    - ``set_epoch(epoch)`` writes ISV ``EPOCH_IDX`` (the loop, at each epoch start).
    - ``q_values(states)`` is the greedy evaluation: expected Q per branch ``[N, n_d]``.
    - ``last_td_errors()`` gives the last step's per-sample TD errors (for replay priorities);
      ``RuntimeError`` before any step since construction or ``load_state_dict``.
    - ``state_dict()`` / ``load_state_dict()`` exchange the full state (:func:`state_spec`) as
      NumPy arrays; ``load_state_dict`` validates everything first (:func:`validate_state_dict`).
    - ``save(path)`` writes a checkpoint atomically; ``load(path)`` (classmethod) reads one
      written by either backend, failing on a fingerprint or shape mismatch.
    """

    backend_name: ClassVar[str]
    config: DQNConfig

    @abc.abstractmethod
    def step(self, batch: Batch) -> StepScalars: ...

    @abc.abstractmethod
    def end_epoch(self) -> StepScalars: ...

    @abc.abstractmethod
    def fold_boundary(self) -> None: ...

    @abc.abstractmethod
    def set_epoch(self, epoch: int) -> None:
        """Write ``epoch`` (the epoch within the fold, 0-based; :func:`check_epoch`) into ISV
        slot ``EPOCH_IDX`` (39), the MSE warm-up's clock; the loop calls it at each epoch
        start. The slot is FoldReset, so ``fold_boundary`` sets it back to 0."""

    @abc.abstractmethod
    def q_values(self, states: np.ndarray) -> list[np.ndarray]: ...

    def frozen_q_values(self) -> Callable[[np.ndarray], list[np.ndarray]]:
        """``q_values`` for a walk during which the trainer does not step (``loop.evaluate``:
        thousands of one-state calls): values equal to ``q_values``' while the parameters and
        the ISV are unchanged. A backend may form what does not depend on the states once
        (the reference ``Trainer`` does); by default, ``q_values`` itself."""
        return self.q_values

    @abc.abstractmethod
    def last_td_errors(self) -> np.ndarray:
        """Per-sample TD errors ``[B]`` of the last step (the replay priorities' source)."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, np.ndarray]: ...

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, np.ndarray]) -> None: ...

    @property
    @abc.abstractmethod
    def flags(self) -> np.ndarray:
        """The sentinel flag buffer (int32, sticky until ``fold_boundary``)."""

    def save(self, path) -> None:
        from .checkpoint import save_checkpoint

        save_checkpoint(path, self.config, self.state_dict(), backend=self.backend_name)

    @classmethod
    def load(cls, path, **kwargs) -> "TrainerBackend":
        from .checkpoint import load_checkpoint

        config, state = load_checkpoint(path)
        trainer = cls(config, **kwargs)
        trainer.load_state_dict(state)
        return trainer


#: Backend name -> ``"module:class"`` of its trainer, imported by name only when asked (the
#: reference never imports ``fast`` otherwise, and this module imports no trainer).
BACKENDS: Mapping[str, str] = MappingProxyType({
    "reference": "foxhunt.reference.trainer:Trainer",
    "fast": "foxhunt.fast:Trainer",
})


def get_backend(name) -> type[TrainerBackend]:
    """The trainer class of backend ``name`` (``reference`` or ``fast``); a callable that builds
    a trainer (e.g. ``functools.partial(fast.Trainer, gemm_workspace="default")``) is returned
    as it is."""
    if callable(name):
        return name
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r}: allowed values are 'reference' and 'fast'")
    module, attr = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), attr)
