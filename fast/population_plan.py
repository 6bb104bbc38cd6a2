"""One plan for a population: the members' step plans aligned record by record (issue 24, SPEC 12).

A population steps N members of one architecture with ONE set of launches (``member_build``:
every kernel with a member dimension; ``gemm``'s batched plans). Each member's own step plan is
what a single trainer of its config and seed would run (``StepProgram`` and the graph plans of
``graph1_plan`` / ``graph2_plan``); the members may differ only in values, never in structure.
``align_members(plans)`` walks the members' plans in lockstep and checks exactly that:

- the same record kinds in the same order, the same branch structure (``Parallel`` sides and
  main, ``Record`` / ``Wait`` events), the same kernels with the same launch shapes, the same
  GEMM specs and the same buffers (``Buf``: name, packed key, offset) for every pointer, copy
  end and GEMM operand: so member m's launch reads and writes member m's copy of the same
  regions, and one launch (grid.z = N) serves them all;
- a kernel's SCALAR arguments may differ (a member's lr, tau, a loss weight, the IQN key drawn
  from its seed): each launch whose scalars differ is reported with every member's values, the
  input of its per-member scalar blocks (``member_build.member_scalar_block``).

A difference anywhere else raises ``PopulationPlanError`` naming the graph, the record (its
position and kernel) and what differs: two members whose plans differ in structure cannot share
launches (a second-wave source on in one and off in another, another batch size, ...). Values
the plan keeps in buffers rather than in launch arguments (the ``gamma`` and ``alpha`` constants
of ``step_constants``, the parameters, the ISV) are per member by the arena's replication and
are not compared here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from foxhunt.fast.records import Buf, Copy, Gemm, Launch, Ops, Parallel, Record, Wait


class PopulationPlanError(ValueError):
    """Members whose plans differ in more than kernel scalar values."""


@dataclass(frozen=True)
class MemberScalars:
    """A launch whose scalar arguments differ between members: ``graph`` and the record's
    ``index`` in that graph's walk order (``Ops.nodes()``), its ``kernel``, and ``values``: per
    member, ``{parameter: value}`` of EVERY scalar argument of the launch (a scalar block holds
    them all; ``differ`` names the ones that differ)."""

    graph: str
    index: int
    kernel: str
    values: tuple[Mapping[str, object], ...]
    differ: tuple[str, ...]


def _same_scalar(a, b) -> bool:
    """Scalars equal as the kernel sees them: same type and, for floats, the same bits."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (float, np.floating)):
        return np.asarray(a).tobytes() == np.asarray(b).tobytes()
    return bool(a == b)


def _is_scalar(value) -> bool:
    return value is not None and not isinstance(value, Buf)


class _Walk:
    """The lockstep walk of one graph's N member plans."""

    def __init__(self, graph: str):
        self.graph = graph
        self.index = 0  # node index in Ops.nodes() order
        self.found: list[MemberScalars] = []

    def fail(self, what: str, member: int, mine, theirs) -> None:
        raise PopulationPlanError(f"{self.graph}, record {self.index}: {what} differs between "
                                  f"member 0 ({mine}) and member {member} ({theirs}); members "
                                  "share launches only where their plans differ in kernel scalars")

    def ops(self, members: Sequence[Ops]) -> None:
        first = members[0].items
        for m, other in enumerate(members[1:], start=1):
            if len(other.items) != len(first):
                self.fail("the number of records", m, len(first), len(other.items))
        for position, item in enumerate(first):
            items = [ops.items[position] for ops in members]
            for m, other in enumerate(items[1:], start=1):
                if type(other) is not type(item):
                    self.fail("the record kind", m, type(item).__name__, type(other).__name__)
            if isinstance(item, Parallel):
                for m, other in enumerate(items[1:], start=1):
                    if len(other.sides) != len(item.sides):
                        self.fail("the number of parallel sides", m, len(item.sides), len(other.sides))
                for side in range(len(item.sides)):
                    self.ops([it.sides[side] for it in items])
                self.ops([it.main for it in items])
            elif isinstance(item, (Record, Wait)):
                for m, other in enumerate(items[1:], start=1):
                    if other.event != item.event:
                        self.fail(f"the {type(item).__name__.lower()} event", m, item.event, other.event)
            else:
                self.node(items)
                self.index += 1

    def node(self, items: list) -> None:
        first = items[0]
        if isinstance(first, Launch):
            self.launch(items)
        elif isinstance(first, Gemm):
            for m, other in enumerate(items[1:], start=1):
                if other.spec != first.spec:
                    self.fail("the GEMM", m, first.spec, other.spec)
                for name in ("a", "b", "c", "bias", "aux"):
                    if getattr(other, name) != getattr(first, name):
                        self.fail(f"GEMM operand {name}", m, getattr(first, name), getattr(other, name))
        elif isinstance(first, Copy):
            for m, other in enumerate(items[1:], start=1):
                if (other.dst, other.src, other.nbytes, other.kind) != \
                        (first.dst, first.src, first.nbytes, first.kind):
                    self.fail("the copy", m, first, other)
        else:  # pragma: no cover - Ops holds only the record kinds above
            raise TypeError(type(first))

    def launch(self, items: list[Launch]) -> None:
        first = items[0]
        for m, other in enumerate(items[1:], start=1):
            if other.kernel != first.kernel:
                self.fail("the kernel", m, first.kernel, other.kernel)
            if other.shape != first.shape:
                self.fail(f"kernel {first.kernel}'s launch shape", m, first.shape, other.shape)
            if list(other.args) != list(first.args):
                self.fail(f"kernel {first.kernel}'s parameters", m, list(first.args), list(other.args))
        differ = []
        for name, value in first.args.items():
            values = [it.args[name] for it in items]
            if not _is_scalar(value):
                for m, other in enumerate(values[1:], start=1):
                    if other != value:
                        self.fail(f"kernel {first.kernel}'s buffer {name}", m, value, other)
                continue
            for m, other in enumerate(values[1:], start=1):
                if not _is_scalar(other):
                    self.fail(f"kernel {first.kernel}'s argument {name}", m, value, other)
            if not all(_same_scalar(value, other) for other in values[1:]):
                differ.append(name)
        if differ:
            scalars = [{k: v for k, v in it.args.items() if _is_scalar(v)} for it in items]
            self.found.append(MemberScalars(self.graph, self.index, first.kernel, tuple(scalars),
                                            tuple(differ)))


def align_members(plans: Sequence[Mapping[str, Ops]]) -> list[MemberScalars]:
    """Check the members' plans ``plans[m] = {graph: Ops}`` (the same graph names in each) are
    one plan but for kernel scalars, and return the launches whose scalars differ (module
    docstring); ``PopulationPlanError`` names the first structural difference."""
    if not plans:
        raise ValueError("plans: a population needs at least one member's plan")
    names = list(plans[0])
    for m, plan in enumerate(plans[1:], start=1):
        if list(plan) != names:
            raise PopulationPlanError(f"member {m}'s graphs {list(plan)} are not member 0's {names}")
    found: list[MemberScalars] = []
    for name in names:
        walk = _Walk(name)
        walk.ops([plan[name] for plan in plans])
        found.extend(walk.found)
    return found


__all__ = ["MemberScalars", "PopulationPlanError", "align_members"]
