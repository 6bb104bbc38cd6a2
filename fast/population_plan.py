"""One plan for a population: the members' step plans aligned record by record (issue 24, SPEC 12),
and ``PopulationPlan``, what every backend of a population shares (``fast.population``).

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

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from foxhunt.fast.arena import ArenaLayout
from foxhunt.fast.cpu_executor import CPU_ARCH, HostArena, Memory, cpu_planner
from foxhunt.fast.cuda_parse import package_kernels
from foxhunt.fast.device import ALIGNMENT, _round_up
from foxhunt.fast.graph1_plan import graph1_ops
from foxhunt.fast.graph2_plan import graph2_ops, staging_name, upload_ops
from foxhunt.fast.member_build import SCALAR_DTYPES, SCALAR_SLOT_BYTES, member_scalar_block, scalar_params
from foxhunt.fast.records import Buf, Copy, Gemm, Launch, Ops, Parallel, Record, Wait
from foxhunt.fast.step_layout import StepLayout
from foxhunt.fast.step_program import (
    GEMM_SM_SHARE,
    UNIFORM_SM_SHARES,
    StepProgram,
    step_constants,
)
from foxhunt.reference.population import member_configs


#: ``StepProgram`` options of every population plan: the members' GEMMs are batched over the
#: members (one stride for every operand), so the C51 and CQL backward passes are not stacked,
#: and every GEMM is planned for the same share of the SMs (``sm_count`` below; a single
#: trainer's shares by role were measured for one trainer's chain, not for batched GEMMs); the
#: heads' parts of ``d h2`` stay GEMMs batched over the members, not ``heads_dh2_tf32`` (measured
#: for one trainer's chain only).
MEMBER_PROGRAM_OPTIONS = {"stacked_backward": False, "sm_shares": UNIFORM_SM_SHARES,
                          "heads_dh2": False}


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


# --------------------------------------------------------------------------------------------
# The population's plan
# --------------------------------------------------------------------------------------------

#: The arena buffer holding the launches' per-member scalar blocks (after the step's buffers).
MEMBER_SCALARS = "member_scalars"



@dataclasses.dataclass(frozen=True)
class ScalarBlock:
    """The scalar blocks of one launch: the ``occurrence``-th launch of ``kernel`` in ``graph``'s
    walk order; member m's block (``blocks[m]``, uint8) at byte ``offset`` of its copy of
    ``member_scalars``."""

    graph: str
    kernel: str
    occurrence: int
    offset: int
    blocks: tuple[np.ndarray, ...]


def _record_plan(config, seed: int, n_step_on: bool) -> dict[str, Ops]:
    """One member's step records (``{graph: Ops}``), planned on the CPU (records do not depend on
    addresses or on the GEMM planner's choices but for fallbacks, which add launches without
    per-member scalars: ``ScalarBlock`` finds its launch by kernel and occurrence)."""
    lay = StepLayout(config, n_step_on=n_step_on)
    arena = HostArena(lay.specs)
    constants = step_constants(lay, Memory([(lay, arena)], {}).address)
    prog = StepProgram(lay, planner=cpu_planner(), constants=constants,
                       host_nbytes={staging_name(0): lay.batch_nbytes}, arch=CPU_ARCH, seed=seed,
                       **MEMBER_PROGRAM_OPTIONS)
    return {"upload": upload_ops(prog, 1)[0], "graph1": graph1_ops(prog), "graph2": graph2_ops(prog)}


def _config_key(config) -> str:
    return json.dumps(dataclasses.asdict(config), sort_keys=True, default=repr)


class PopulationPlan:
    """What every backend of a population shares (module docstring): the members' configs and
    seeds, the step layout, the arena's carving (``specs``, the step's buffers then
    ``member_scalars``), the member ``stride`` and the ``ScalarBlock``s."""

    def __init__(self, config, seeds: Sequence[int], overrides=None, *, n_step_on: bool = False):
        self.configs = member_configs(config, seeds, overrides)  # every override checked first
        self.seeds = [int(s) for s in seeds]
        self.members = len(self.seeds)
        self.n_step_on = n_step_on
        self.layout = StepLayout(self.configs[0], n_step_on=n_step_on)
        # One plan per distinct member: the config, and the seed where the IQN head's quantile
        # key (wave_plan, a launch argument) reads it; tests/test_population checks no other
        # launch argument depends on the seed.
        plans: dict[tuple, dict[str, Ops]] = {}
        layouts: dict[str, StepLayout] = {_config_key(self.configs[0]): self.layout}
        keys = []
        #: Each member's layout: the same buffers, its own config (``step_constants`` reads its
        #: gamma and cql_alpha from it).
        self.member_layouts = []
        for m, (c, seed) in enumerate(zip(self.configs, self.seeds)):
            config_key = _config_key(c)
            if config_key not in layouts:
                layouts[config_key] = StepLayout(c, n_step_on=n_step_on)
                if layouts[config_key].specs != self.layout.specs:
                    raise PopulationPlanError(f"member {m}: its step buffers differ from member 0's; "
                                              "members must share one architecture")
            self.member_layouts.append(layouts[config_key])
            key = (config_key, seed if c.iqn_on else None)
            if key not in plans:
                plans[key] = _record_plan(c, seed, n_step_on)
            keys.append(key)
        found = align_members([plans[key] for key in keys])
        first = plans[keys[0]]
        kernels = package_kernels()
        blocks, offset = [], 0
        for item in found:
            nodes = first[item.graph].nodes()
            occurrence = sum(1 for node in nodes[:item.index]
                             if isinstance(node, Launch) and node.kernel == item.kernel)
            params = kernels[item.kernel].params
            member_blocks = tuple(member_scalar_block(params, values) for values in item.values)
            blocks.append(ScalarBlock(item.graph, item.kernel, occurrence, offset, member_blocks))
            offset += _round_up(max(member_blocks[0].size, SCALAR_SLOT_BYTES), SCALAR_SLOT_BYTES)
        self.blocks = tuple(blocks)
        self.specs = {**self.layout.specs, MEMBER_SCALARS: ((max(offset, 1),), np.dtype(np.uint8))}
        carved = ArenaLayout()
        for name, (shape, dtype) in self.specs.items():
            carved.add(name, shape, dtype)
        self.stride = _round_up(carved.nbytes, ALIGNMENT)

    def scalar_block_bytes(self, member: int) -> np.ndarray:
        """Member ``member``'s copy of ``member_scalars`` (every launch's block at its offset)."""
        out = np.zeros(self.specs[MEMBER_SCALARS][0], np.uint8)
        for block in self.blocks:
            out[block.offset:block.offset + block.blocks[member].size] = block.blocks[member]
        return out

    def block_of(self, ops: Mapping[str, Ops]) -> dict[int, ScalarBlock]:
        """``{id(launch): ScalarBlock}`` for the launches of the real plan ``ops`` (``{graph:
        Ops}``, every upload slot's Ops under ``"upload"`` as a list) that take scalar blocks."""
        wanted = {(b.graph, b.kernel, b.occurrence): b for b in self.blocks}
        out: dict[int, ScalarBlock] = {}
        for graph, graph_ops in ops.items():
            for one in (graph_ops if isinstance(graph_ops, list) else [graph_ops]):
                seen: dict[str, int] = {}
                for node in one.nodes():
                    if isinstance(node, Launch):
                        n = seen.get(node.kernel, 0)
                        seen[node.kernel] = n + 1
                        block = wanted.get((graph, node.kernel, n))
                        if block is not None:
                            out[id(node)] = block
        if len({(b.graph, b.kernel, b.occurrence) for b in out.values()}) != len(self.blocks):
            raise AssertionError("a launch with per-member scalars is missing from the real plan")
        return out

    def member_address(self, address0, member: int):
        """The address function of member ``member`` from member 0's."""
        shift = member * self.stride
        return lambda buf: address0(buf) + shift

    def sm_count(self, device_sms: int) -> int:
        """The SM count the population's plans are made for: each batched GEMM serves N members,
        so it may take ``min(N, GEMM_SM_SHARE)`` shares of the device (``StepProgram`` plans
        for ``sm_count // GEMM_SM_SHARE``)."""
        return device_sms * min(self.members, GEMM_SM_SHARE)


def member_scalar_values(block: ScalarBlock, params, raw: np.ndarray) -> dict[str, object]:
    """The scalars a member kernel reads from its block bytes ``raw`` (``fh_member_scalar``)."""
    values = {}
    for j, (ptype, name) in enumerate(scalar_params(params)):
        dtype = np.dtype(SCALAR_DTYPES[ptype])
        value = raw[SCALAR_SLOT_BYTES * j:SCALAR_SLOT_BYTES * j + dtype.itemsize].view(dtype)[0]
        values[name] = float(value) if dtype.kind == "f" else int(value)
    return values


def batched_planner(planner, members: int, stride: int):
    """``planner`` making strided-batched plans over ``members`` (``batch_stride = stride``);
    ``planner`` itself for one member."""
    if members == 1:
        return planner

    def plan(m, n, k, **kw):
        return planner(m, n, k, batch=members, batch_stride=stride, **kw)
    return plan


__all__ = ["MEMBER_PROGRAM_OPTIONS", "MEMBER_SCALARS", "MemberScalars", "PopulationPlan",
           "PopulationPlanError", "ScalarBlock", "align_members", "batched_planner",
           "member_scalar_values"]
