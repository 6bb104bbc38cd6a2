"""The population's reference twin (SPEC 12, issue 24): N reference trainers, one after the other.

``Population(config, seeds=[s0, s1, ...], overrides=[{...}, {...}, ...], n_step=1)`` holds
member ``i`` as one reference :class:`~foxhunt.reference.trainer.Trainer` built from
``config.replace(**overrides[i])`` with ``seed=seeds[i]`` and ``n_step``. A population step is
each member's own ``Trainer.step`` on its own batch, so a member is bitwise its single trainer: its params,
target, Adam state, spectral-norm vectors, ISV, sentinel flags and deferred readback are its
own, and a NaN in one member's batch flags that member only.

Members share one architecture. Per member only the fields of :data:`MEMBER_FIELDS` may
differ from ``config`` (plus the seed): the scalars the fast population reads per member.
The second-wave weights may differ in value but not in on/off: each of ``SOURCE_WEIGHTS`` turns
on a source that adds tensors (the next-bar and regime heads, the IQN head, the ensemble
priors; ``layout``), so a member's weight must be > 0 exactly where ``config``'s is; a weight
that switches its source on or off relative to ``config`` is refused, as is any field outside
:data:`MEMBER_FIELDS` (shape fields, ``precision``, the safety multipliers, the ISV switches,
the MSE warm-up, ...), each with a one-line ``ValueError`` naming the member, the field, the
value and what is allowed.

A member's checkpoint is ``population.member(i).save(path)``: an ordinary checkpoint of its own
config, which a single trainer of either backend loads (``Trainer.load(path)``).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from .backend import StepScalars
from .batch import Batch
from .config import SOURCE_WEIGHTS, DQNConfig, require_int
from .step import check_batch_kind
from .trainer import Trainer

#: The ``DQNConfig`` fields a population member may override (its seed is given apart, in
#: ``seeds``): the per-member scalars of issue 24. The fast population imports this set.
MEMBER_FIELDS: tuple[str, ...] = ("lr", "gamma", "cql_alpha", "tau", *SOURCE_WEIGHTS)


def member_configs(config: DQNConfig, seeds: Sequence[int],
                   overrides: Sequence[Mapping[str, Any]] | None = None) -> list[DQNConfig]:
    """Each member's config ``config.replace(**overrides[i])``, after checking the seeds and the
    overrides (see the module docstring); ``ValueError`` (one line) on the first bad one."""
    seeds = list(seeds)
    if not seeds:
        raise ValueError("seeds=[]: a population needs at least one member (one seed each)")
    overrides = [{}] * len(seeds) if overrides is None else list(overrides)
    if len(overrides) != len(seeds):
        raise ValueError(f"overrides: {len(overrides)} given for {len(seeds)} seeds; "
                         "allowed: one dict per member (or none at all)")
    configs = []
    for i, (seed, over) in enumerate(zip(seeds, overrides)):
        if isinstance(seed, np.integer):
            seed = int(seed)
        require_int(f"member {i}: seed", seed, minimum=0)
        if not isinstance(over, Mapping):
            raise ValueError(f"member {i}: overrides[{i}]={over!r}; allowed: a dict of "
                             f"{list(MEMBER_FIELDS)}")
        for name, value in over.items():
            if name not in MEMBER_FIELDS:
                raise ValueError(f"member {i}: {name}={value!r} may not differ within a "
                                 f"population; allowed per-member fields: {list(MEMBER_FIELDS)}")
            if name in SOURCE_WEIGHTS and _is_on(value) != (getattr(config, name) > 0):
                raise ValueError(
                    f"member {i}: {name}={value!r} turns its source "
                    f"{'on' if _is_on(value) else 'off'} (it adds tensors); allowed: a value "
                    f"{'> 0' if getattr(config, name) > 0 else 'of 0'}, as the population's "
                    f"{name}={getattr(config, name)!r}")
        try:
            configs.append(config.replace(**over))
        except ValueError as exc:  # the field's own range check: say which member
            raise ValueError(f"member {i}: {exc}") from None
    return configs


def _is_on(value: Any) -> bool:
    """Whether a source weight's value switches its source on (> 0); a non-number is left to
    ``DQNConfig``'s own check (treated as on here, so its range error names it)."""
    try:
        return value > 0
    except TypeError:
        return True


class MemberAccess:
    """What every population offers over its members (``self._members``: one trainer each):
    this reference twin and ``foxhunt.fast.population.Population``."""

    _members: list

    def __len__(self) -> int:
        return len(self._members)

    def member(self, i: int):
        """Member ``i``'s trainer (its checkpoint: ``member(i).save(path)``)."""
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < len(self):
            raise ValueError(f"member={i!r}: allowed members are 0 .. {len(self) - 1}")
        return self._members[int(i)]

    def end_epoch(self) -> list[StepScalars]:
        """Each member's scalars of its last step (fresh where it stepped since its last load)."""
        return [t.end_epoch() for t in self._members]

    def set_epoch(self, epoch: int) -> None:
        for t in self._members:
            t.set_epoch(epoch)

    def fold_boundary(self) -> None:
        """Each member's ``fold_boundary()`` (Mech 3, Mech 4, ISV fold reset, flags reset)."""
        for t in self._members:
            t.fold_boundary()

    def state_dict(self, member: int) -> dict:
        """Member ``member``'s full state (``Trainer.state_dict``: a single trainer of either
        backend loads it)."""
        return self.member(member).state_dict()

    def load_member_state(self, member: int, state: dict) -> None:
        """Load ``state`` into member ``member`` (validated first: ``Trainer.load_state_dict``)."""
        self.member(member).load_state_dict(state)


class Population(MemberAccess):
    """N reference trainers of one architecture, stepped one after the other (the fast
    population's reference twin); see the module docstring."""

    def __init__(self, config: DQNConfig, seeds: Sequence[int],
                 overrides: Sequence[Mapping[str, Any]] | None = None, *, n_step: int = 1):
        self.config = config
        seeds = list(seeds)
        configs = member_configs(config, seeds, overrides)  # everything checked first
        self.seeds = [int(s) for s in seeds]
        self._members = [Trainer(c, seed=s, n_step=n_step) for c, s in zip(configs, self.seeds)]

    def step(self, batches: Sequence[Batch]) -> list[StepScalars]:
        """One step of every member on its own batch (``batches[i]`` for member ``i``); returns
        each member's ``StepScalars`` (deferred-readback rule per member). Every batch is
        validated before any member steps, so a bad one changes no member's state."""
        batches = list(batches)
        if len(batches) != len(self._members):
            raise ValueError(f"batches: {len(batches)} given; allowed: one per member "
                             f"({len(self._members)})")
        for i, (t, b) in enumerate(zip(self._members, batches)):
            try:
                check_batch_kind(b, t.n_step_on)
                b.validate(t.config)
            except ValueError as exc:
                raise ValueError(f"member {i}: {exc}") from None
        return [t.step(b) for t, b in zip(self._members, batches)]
