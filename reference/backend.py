"""The backend interface: what every trainer (``reference``, ``fast``) provides, in one place.

The training loop (``foxhunt.reference.loop``) and the CLI talk only to this interface, so a
backend is chosen by name and nothing else changes. Both backends hold the same state (params,
target params, Adam m/v/t, spectral-norm u/v, BF16 mirrors, ISV bus, sentinel flags, the Mech 6
slow grad-norm EMA, step counter) and exchange it through ``state_dict`` / ``load_state_dict``
(flat NumPy arrays by name), which is also what checkpoints store: a checkpoint written by one
backend loads into the other.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from .batch import Batch
from .config import DQNConfig


@dataclass(frozen=True)
class StepScalars:
    """Scalars of a step, subject to the deferred-readback rule (SPEC 9).

    ``read_at`` is the step whose values these are; ``fresh`` says whether they were read at this
    step (``read_at == step``). Between readbacks a trainer returns the last values read.
    Norms are L2 norms of each gradient source before and after its budget clip; ``grad_norm`` is
    the norm entering Adam; ``safety_clip_fired`` says whether Adam's global clip scaled it.
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
    flags: tuple[int, ...] = field(default_factory=tuple)

    #: The float fields that must be finite; a non-finite one forces a fresh read next step.
    FINITE_FIELDS: ClassVar[tuple[str, ...]] = (
        "loss", "c51_loss", "cql_loss", "grad_norm", "c51_norm_pre", "cql_norm_pre",
    )

    def all_finite(self) -> bool:
        return all(np.isfinite(getattr(self, f)) for f in self.FINITE_FIELDS)

    def as_stale(self, step: int) -> "StepScalars":
        import dataclasses

        return dataclasses.replace(self, step=step, fresh=False)


class TrainerBackend(abc.ABC):
    """A trainer: state on some device, one ``step`` per batch.

    Contract (both backends, tested by the conformance suite):
    - ``step(batch)`` runs SPEC 4 in order and returns ``StepScalars`` under the deferred-readback
      rule: fresh at steps that are multiples of ``readback_interval``, on ``end_epoch()``, and on
      the step after a fresh read with a non-finite value; otherwise the last values.
    - ``end_epoch()`` returns fresh scalars of the last step.
    - ``fold_boundary()`` does Mech 3 (hard target sync), Mech 4 (Adam m, v, t reset), ISV
      FoldReset/SoftReset, and resets the sentinel flags; it keeps the Mech 6 slow EMA.
    - ``q_values(states)`` is the greedy evaluation: expected Q per branch ``[N, n_d]``.
    - ``last_td_errors()`` gives the last step's per-sample TD errors (for replay priorities).
    - ``state_dict()`` / ``load_state_dict()`` exchange the full state as NumPy arrays.
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
    def q_values(self, states: np.ndarray) -> list[np.ndarray]: ...

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


def get_backend(name: str) -> type[TrainerBackend]:
    """The trainer class of backend ``name`` (``reference`` or ``fast``)."""
    if name == "reference":
        from .trainer import Trainer

        return Trainer
    if name == "fast":
        from foxhunt.fast import Trainer as FastTrainer  # imported by name only when asked

        return FastTrainer
    raise ValueError(f"backend={name!r}: allowed values are 'reference' and 'fast'")
