"""The fast population: N members of one architecture stepped by ONE graph replay (SPEC 12, issue 24).

``Population(config, seeds=[...], overrides=[...], *, device=None, gemm_workspace="none")``
trains N members, each with its own parameters, target, Adam state, spectral-norm vectors, ISV,
sentinel flags, deferred readback and batch, and per-member scalars where a member overrides
one of ``reference.population.MEMBER_FIELDS`` (lr, gamma, cql_alpha, tau, the second-wave
weights; the seed keys the IQN head's quantile fractions). Its reference twin is
``reference.population.Population`` (N reference trainers in turn); ``CpuPopulation`` is this
class on the CPU executor (CI runs it).

How one plan serves N members:

- **One arena, N copies.** The step layout (``StepLayout``, the same for every member:
  checked) plus one ``member_scalars`` buffer is carved once; member m's copy of every buffer
  lies ``m * stride`` bytes past member 0's (``stride``: the carved size rounded up to 256
  bytes). Each member's constants are its own (``step_constants`` at its own addresses: the
  sentinel and spectral-norm descriptors hold pointers, ``gamma`` and ``alpha`` its values).
- **Kernels** come from the member build (``member_build.member_module``: every kernel moves
  its pointers by ``blockIdx.z * member_stride`` bytes) and launch with ``gridDim.z = N``;
  those of ``GRID_SHARED_KERNELS`` with their blocks shared among the members. A population of
  one runs the plain kernels (the single trainer's plan exactly): the member build cost 2 % at
  N = 1 (measured on the H200, seed preset, bf16: 232.1 against 227.8 us per step).
- **Scalars.** Every member's step plan is built (``StepProgram`` per distinct member config and
  seed, on the CPU planner) and ``population_plan.align_members`` checks they are one plan but
  for kernel scalar arguments. Each launch whose scalars differ gets a scalar block per member
  in ``member_scalars`` (``member_build.member_scalar_block``), found in the real plan by graph,
  kernel and occurrence; every other launch passes null and reads its own arguments.
- **GEMMs** are cuBLASLt strided-batched plans (``batch = N``, ``batch_stride = stride``);
  every GEMM is planned for ``min(N, GEMM_SM_SHARE) / GEMM_SM_SHARE`` of the SMs; the output
  layers' bias gradients take the kernel fallback (``POPULATION_FALLBACK_EPILOGUES``).
- **Copies** (the batch upload, the reads) are one 2-D copy each: N rows of the copy's bytes,
  pitch ``stride`` on the device and the per-member size of the host buffer on the host.

A step is ``Population.step(batches)``: every batch checked before any is written, then the
upload graph, graph 1 and graph 2 once for all members. ``member(i)`` is member i as a fast
``Trainer`` (``backend_name = "fast-member"``): its state exchange, checkpoints (``save``: an
ordinary checkpoint a single trainer of either backend loads), folds, ISV signals, deferred
readback and ``q_values`` (a graph of the plain kernels at its own addresses) are a single
trainer's; its ``step`` raises (members step together). A NaN in one member's batch flags only
that member: no launch reads another member's copy.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from foxhunt.fast.arena import Arena, ArenaLayout
from foxhunt.fast.cpu_executor import (
    CPU_ARCH,
    CpuEval,
    CpuGraph,
    HostArena,
    Memory,
    MemberMemory,
    cpu_planner,
    run_launch,
)
from foxhunt.fast.cuda_parse import package_kernels
from foxhunt.fast.device import ALIGNMENT, SYNCS, _round_up
from foxhunt.fast.gpu_engine import READ_BUFFERS, GpuEngine, GpuEval, host_buffer_specs, step_plans
from foxhunt.fast.graph1_plan import graph1_ops
from foxhunt.fast.graph2_plan import graph2_ops, staging_name, upload_ops
from foxhunt.fast.graph_lowering import Lowering, layered_address
from foxhunt.fast.member_build import SCALAR_DTYPES, SCALAR_SLOT_BYTES, member_scalar_block, scalar_params
from foxhunt.fast.population_plan import PopulationPlanError, align_members
from foxhunt.fast.records import Copy, Gemm, Host, Launch, Ops
from foxhunt.fast.step_layout import StepLayout
from foxhunt.fast.step_program import GEMM_SM_SHARE, StepProgram, step_constants
from foxhunt.fast.trainer import STAGING_RING, Trainer, check_step_batch, write_batch
from foxhunt.reference import sentinels
from foxhunt.reference.backend import DeferredReadback, StepScalars
from foxhunt.reference.batch import Batch
from foxhunt.reference.population import MemberAccess, member_configs
from foxhunt.reference.step import check_n_step
from foxhunt.reference.trainer import Trainer as ReferenceTrainer

#: The arena buffer holding the launches' per-member scalar blocks (after the step's buffers).
MEMBER_SCALARS = "member_scalars"
#: Kernels whose results do not depend on ``gridDim.x`` (their blocks stride over all the work,
#: and what they write is the same for any grid), with where that is said. A population launch
#: gives each member ``ceil(grid.x / N)`` blocks of them, so the N members take about the blocks
#: one member did: measured on the H200 (seed preset, bf16, N = 16), ``nan_check_fused`` with
#: its single-trainer grid per member took 124, 59 and 36 us of graph 2's 370 us (each block
#: scans the slot table before its one chunk).
GRID_SHARED_KERNELS = {"nan_check_fused": "fast.kernels.safety.plan_nan_check_fused"}


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
                       host_nbytes={staging_name(0): lay.batch_nbytes}, arch=CPU_ARCH, seed=seed)
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


def _member_scalar_values(block: ScalarBlock, params, raw: np.ndarray) -> dict[str, object]:
    """The scalars a member kernel reads from its block bytes ``raw`` (``fh_member_scalar``)."""
    values = {}
    for j, (ptype, name) in enumerate(scalar_params(params)):
        dtype = np.dtype(SCALAR_DTYPES[ptype])
        value = raw[SCALAR_SLOT_BYTES * j:SCALAR_SLOT_BYTES * j + dtype.itemsize].view(dtype)[0]
        values[name] = float(value) if dtype.kind == "f" else int(value)
    return values


#: Epilogues a population of more than one member takes as the plain GEMM plus the kernel
#: fallback (``step_program.FALLBACK_EPILOGUES``): cuBLASLt's batched BGRADB GEMMs are slow
#: (measured on the H200, seed preset, bf16: 256x256x256 took 23.8 us for 16 members, 6.4 for
#: one); refusing them took the population step from 1288.7 to 1240.0 us at N = 16 and from
#: 4451.2 to 4186.5 us at N = 64 (refusing DRELU_BGRAD too gained nothing more).
POPULATION_FALLBACK_EPILOGUES = ("bgradb",)


def batched_planner(planner, members: int, stride: int):
    """``planner`` making strided-batched plans over ``members`` (``batch_stride = stride``)
    that refuses ``POPULATION_FALLBACK_EPILOGUES`` (``GemmPlanError``: the step takes the
    kernel fallback); ``planner`` itself for one member."""
    if members == 1:
        return planner

    def plan(m, n, k, *, epilogue=None, **kw):
        from foxhunt.fast.gemm import GemmPlanError

        if epilogue in POPULATION_FALLBACK_EPILOGUES:
            raise GemmPlanError(f"a population takes epilogue {epilogue!r} as its kernel fallback")
        return planner(m, n, k, epilogue=epilogue, batch=members, batch_stride=stride, **kw)
    return plan


# --------------------------------------------------------------------------------------------
# The GPU engine
# --------------------------------------------------------------------------------------------


def memcpy_2d(dst: int, dst_host: bool, dst_pitch: int, src: int, src_host: bool, src_pitch: int,
              width: int, rows: int, stream_handle) -> None:
    """``rows`` rows of ``width`` bytes, row r from ``src + r * src_pitch`` to ``dst + r *
    dst_pitch`` (``cuMemcpy2DAsync``; a host end must be page-locked)."""
    from foxhunt.fast.device import _driver, call

    drv = _driver()
    kind = drv.CUmemorytype
    p = drv.CUDA_MEMCPY2D()
    p.srcMemoryType = kind.CU_MEMORYTYPE_HOST if src_host else kind.CU_MEMORYTYPE_DEVICE
    p.dstMemoryType = kind.CU_MEMORYTYPE_HOST if dst_host else kind.CU_MEMORYTYPE_DEVICE
    if src_host:
        p.srcHost = src
    else:
        p.srcDevice = src
    if dst_host:
        p.dstHost = dst
    else:
        p.dstDevice = dst
    p.srcPitch, p.dstPitch, p.WidthInBytes, p.Height = src_pitch, dst_pitch, width, rows
    call(drv.cuMemcpy2DAsync, p, stream_handle)


class PopulationLowering(Lowering):
    """``Lowering`` for the member build: each launch takes ``member_stride`` and its scalar
    block (or null) after its own arguments and runs with ``gridDim.z = members``; each copy is
    one 2-D copy over the members (module docstring). GEMM records carry batched plans."""

    def __init__(self, module, address, host, *, members: int, stride: int, scalar_address):
        super().__init__(module, address, host)
        self.members, self.stride = members, stride
        self.scalar_address = scalar_address  # id(Launch) -> member 0's block address

    def extra_args(self, node: Launch) -> tuple:
        return self.stride, self.scalar_address.get(id(node), 0)

    def launch(self, node: Launch, stream) -> None:
        gx, gy, gz = node.shape.grid
        if gz != 1:
            raise AssertionError(f"kernel {node.kernel}: grid.z = {gz}; the member build takes z")
        if node.kernel in GRID_SHARED_KERNELS:
            gx = -(-gx // self.members)
        kernel, packed = self.packed(node)
        kernel.launch((gx, gy, self.members), node.shape.block, packed, stream=stream,
                      shared_mem=node.shape.shared_mem)

    def copy(self, node: Copy, handle) -> None:
        ends = []
        for end, write in ((node.dst, True), (node.src, False)):
            if isinstance(end, Host):
                array = self._host(end, node.nbytes, write)
                ends.append((array.ctypes.data, True, array.nbytes // self.members))
            else:
                ends.append((self.address(end), False, self.stride))
        (dst, dst_host, dst_pitch), (src, src_host, src_pitch) = ends
        memcpy_2d(dst, dst_host, dst_pitch, src, src_host, src_pitch, node.nbytes, self.members,
                  handle)


class MemberArena(Arena):
    """Member m's copy of a population arena: ``ptr(name)`` is member 0's + ``offset``; the
    ``Arena`` methods (``upload``, ``download``, ``zero``) act on that copy; ``close`` releases
    nothing (the population's arena owns the memory)."""

    def __init__(self, arena: Arena, offset: int, nbytes: int):  # noqa: D107 - no super().__init__
        self.device = arena.device
        self.layout = ArenaLayout(capacity=nbytes)
        self.layout.specs, self.layout.nbytes = arena.layout.specs, arena.layout.nbytes
        self.base = arena.base + offset
        self._ptrs = {name: arena.ptr(name) + offset for name in arena.layout.specs}

    def close(self) -> None:
        """Nothing to release (see the class docstring)."""


class PopulationEngine(GpuEngine):
    """The population's device side: ``GpuEngine``'s staging ring, events, capture and replay
    over one arena of N member copies and the member build (module docstring). ``staging(slot)``
    is a list of N dicts of views (member m's batch); ``read()`` the ``[N, fields]`` readback and
    ``[N, n_desc]`` flags."""

    def __init__(self, plan: PopulationPlan, *, device=None, gemm_workspace: str = "none",
                 staging_slots: int = STAGING_RING):
        from foxhunt.fast._build import package_module
        from foxhunt.fast.device import Device
        from foxhunt.fast.gemm import GemmPlan, PlanCache, cublaslt_version
        from foxhunt.fast.gemm_algos import AlgoStore
        from foxhunt.fast.member_build import member_module

        dev = Device(0) if device is None else device
        dev.make_current()
        self.device, self.closed, self.population = dev, False, plan
        N, S = plan.members, plan.stride
        # A population of one needs no member dimension: the plain kernels (module docstring).
        self.module = dev.load_module(member_module(dev.arch) if N > 1 else package_module(dev.arch))
        self._plain_module = None if N > 1 else self.module  # the evaluation graphs' kernels
        self.layout = lay = plan.layout
        self.arena = Arena(dev, N * S)
        for name, (shape, dtype) in plan.specs.items():
            self.arena.add(name, shape, dtype)
        self.address = layered_address([(lay, self.arena)], lay.region)
        self.member_arenas = [MemberArena(self.arena, m * S, S) for m in range(N)]
        self.constants = []
        for m, arena in enumerate(self.member_arenas):
            constants = step_constants(plan.member_layouts[m], plan.member_address(self.address, m))
            for name, value in constants.items():
                arena.upload(name, value.reshape(arena.spec(name).shape))
            arena.upload(MEMBER_SCALARS, plan.scalar_block_bytes(m))
            self.constants.append(constants)
        self.stream = dev.stream
        pinned = {name: dev.pinned_empty((N, *shape), dtype)
                  for name, (shape, dtype) in host_buffer_specs(lay, staging_slots).items()}
        self.gemm_plans = PlanCache(functools.partial(GemmPlan, dev),
                                    store=AlgoStore.for_device(dev, cublaslt_version()))
        self._program_options = dict(
            host_nbytes={staging_name(s): lay.batch_nbytes for s in range(staging_slots)},
            arch=dev.arch, gemm_workspace=gemm_workspace, seed=plan.seeds[0])
        self.program = StepProgram(lay, planner=batched_planner(self.gemm_plans, N, S),
                                   constants=self.constants[0],
                                   sm_count=plan.sm_count(dev.multiprocessor_count),
                                   **self._program_options)
        self._eval_program = None
        plans = step_plans(self.program, staging_slots)
        scalars = self.arena.ptr(MEMBER_SCALARS)
        self._capture(pinned, plans, Lowering(self.module, self.address, pinned) if N == 1 else
                      PopulationLowering(self.module, self.address, pinned, members=N, stride=S,
                                         scalar_address={key: scalars + block.offset for key, block
                                                         in plan.block_of(plans).items()}))

    def batch_views(self, staging: np.ndarray):
        return [self.layout.batch_views(row) for row in staging]

    @staticmethod
    def read_nbytes(mirror: np.ndarray) -> int:
        return mirror[0].nbytes

    def read(self) -> tuple[np.ndarray, np.ndarray]:
        """Synchronise, then every member's readback block and flags (``[N, ...]`` copies)."""
        for out, name in zip((self._readback_host, self._flags_host), READ_BUFFERS.values()):
            memcpy_2d(out.ctypes.data, True, out[0].nbytes, self.arena.ptr(name), False,
                      self.population.stride, out[0].nbytes, self.population.members,
                      self.stream.handle)
        self.stream.synchronize()
        return self._readback_host.copy(), self._flags_host.copy()

    def eval_module(self):
        """The plain module (an evaluation graph runs one member, with the plain kernels)."""
        from foxhunt.fast._build import package_module

        if self._plain_module is None:
            self._plain_module = self.device.load_module(package_module(self.device.arch))
        return self._plain_module

    def eval_program(self) -> StepProgram:
        """A plan builder with unbatched GEMM plans, for the members' evaluation graphs."""
        if self._eval_program is None:
            self._eval_program = StepProgram(self.layout, planner=self.gemm_plans,
                                             constants=self.constants[0],
                                             sm_count=self.device.multiprocessor_count,
                                             **self._program_options)
        return self._eval_program

    def member_engine(self, member: int, owner) -> MemberEngine:
        return MemberEngine(self, member, self.member_arenas[member],
                            self.population.member_address(self.address, member), owner, GpuEval)

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self._plain_module is not None and self._plain_module is not self.module:
                self._plain_module.close()  # (the eval program's plans: gemm_plans closed them)


class MemberEngine:
    """Member m of a population engine, as a single trainer's engine (what ``fast.Trainer``'s
    host code and the evaluation graphs use): its own ``arena`` copy and ``address``, the
    population's device, stream and branch pool, the plain kernels and an unbatched plan
    builder for its evaluation graphs; ``read()`` its row of the population's read (``reader``);
    ``staging`` and ``launch`` are the population's only."""

    def __init__(self, engine, member: int, arena, address, owner, eval_class):
        self.population_engine, self.member, self._owner = engine, member, owner
        self.arena, self.address, self.layout = arena, address, engine.layout
        self.device, self.stream = getattr(engine, "device", None), getattr(engine, "stream", None)
        self.pool = getattr(engine, "pool", None)
        self.branch_order = getattr(engine, "branch_order", None)
        self._eval_class = eval_class

    @property
    def closed(self) -> bool:
        return self.population_engine.closed

    @property
    def module(self):
        return self.population_engine.eval_module()

    @property
    def program(self) -> StepProgram:
        return self.population_engine.eval_program()

    def read(self) -> tuple[np.ndarray, np.ndarray]:
        return self._owner.read_member(self.member)

    def synchronize(self) -> None:
        """Synchronise the population; its last read is dropped (what follows may change the
        flags: a fold boundary, a state load)."""
        self.population_engine.synchronize()
        self._owner.forget_read()

    def forget_uploads(self) -> None:
        """A member's state load synchronised the population: no upload is in flight."""
        self.population_engine.forget_uploads()

    def build_eval(self, rows: int):
        return self._eval_class(self, rows)

    def close(self) -> None:
        """Nothing to release: the population's engine owns everything."""


# --------------------------------------------------------------------------------------------
# The CPU executor twin
# --------------------------------------------------------------------------------------------


class CpuPopulationEngine:
    """The population engine on the CPU executor: one ``HostArena`` of N member copies, the
    same records (batched ``CpuGemm`` plans), each kernel record run for every member on its
    copy with its scalars read from its block as the member build reads them, each copy moved
    per member (module docstring)."""

    def __init__(self, plan: PopulationPlan, *, gemm_workspace: str = "none",
                 branch_order: str = "latest_first", refused_epilogues=(),
                 staging_slots: int = STAGING_RING):
        self.population, self.closed, self.branch_order = plan, False, branch_order
        N, S = plan.members, plan.stride
        self.layout = lay = plan.layout
        self.arena = HostArena(plan.specs, nbytes=N * S)
        self.member_arenas = [self.arena.view(m * S, S) for m in range(N)]
        self._staging = [np.zeros((N, lay.batch_nbytes), np.uint8) for _ in range(staging_slots)]
        self._mem = Memory([(lay, self.arena)], {staging_name(s): buf
                                                 for s, buf in enumerate(self._staging)})
        self.constants = []
        for m, arena in enumerate(self.member_arenas):
            constants = step_constants(plan.member_layouts[m],
                                       plan.member_address(self._mem.address, m))
            for name, value in constants.items():
                arena.upload(name, value.reshape(arena.spec(name).shape))
            arena.upload(MEMBER_SCALARS, plan.scalar_block_bytes(m))
            self.constants.append(constants)
        self._planner = cpu_planner(refused_epilogues)
        self._program_options = dict(
            host_nbytes={staging_name(s): lay.batch_nbytes for s in range(staging_slots)},
            arch=CPU_ARCH, gemm_workspace=gemm_workspace, seed=plan.seeds[0])
        self.program = StepProgram(lay, planner=batched_planner(self._planner, N, S),
                                   constants=self.constants[0], **self._program_options)
        self._eval_program = None
        self.plans = step_plans(self.program, staging_slots)
        self._blocks = plan.block_of(self.plans)
        self._upload = [CpuGraph(ops, branch_order) for ops in self.plans["upload"]]
        self._graph1 = CpuGraph(self.plans["graph1"], branch_order)
        self._graph2 = CpuGraph(self.plans["graph2"], branch_order)
        self.planned_launches = tuple(ops.node_count() for ops in (
            self.plans["upload"][0], self.plans["graph1"], self.plans["graph2"]))
        self.graph_node_counts = self.planned_launches

    def staging(self, slot: int) -> list[dict[str, np.ndarray]]:
        return [self.layout.batch_views(row) for row in self._staging[slot]]

    def launch(self, slot: int) -> None:
        for graph in (self._upload[slot], self._graph1, self._graph2):
            for i in graph.order:
                self._run(graph.nodes[i])

    def _run(self, node) -> None:
        N, S = self.population.members, self.population.stride
        if isinstance(node, Gemm):
            node.plan.run(self._mem, node)  # a batched plan: every member
        elif isinstance(node, Launch):
            block = self._blocks.get(id(node))
            params = package_kernels()[node.kernel].params if block is not None else None
            for m in range(N):
                one = node
                if block is not None:
                    raw = self.member_arenas[m].array(MEMBER_SCALARS)[block.offset:]
                    one = dataclasses.replace(node, args={
                        **node.args, **_member_scalar_values(block, params, raw)})
                run_launch(MemberMemory(self._mem, m * S), one)
        elif isinstance(node, Copy):
            for m in range(N):
                self._bytes(node.dst, m, node.nbytes)[:] = self._bytes(node.src, m, node.nbytes)
        else:  # pragma: no cover - records.NODE_RECORDS are the three above
            raise AssertionError(type(node))

    def _bytes(self, end, member: int, nbytes: int) -> np.ndarray:
        if isinstance(end, Host):
            return self._mem.host[end.name][member].reshape(-1).view(np.uint8)[:nbytes]
        return MemberMemory(self._mem, member * self.population.stride).view(end, nbytes, np.uint8)

    def read(self) -> tuple[np.ndarray, np.ndarray]:
        SYNCS.note()  # the GPU engine's read: one stream synchronisation
        return tuple(np.stack([arena.array(name).copy() for arena in self.member_arenas])
                     for name in READ_BUFFERS.values())

    def synchronize(self) -> None:
        """Nothing is in flight on the CPU (counted as the GPU's synchronisation)."""
        SYNCS.note()

    def forget_uploads(self) -> None:
        """No upload is ever in flight on the CPU."""

    def eval_module(self):
        return None

    def eval_program(self) -> StepProgram:
        if self._eval_program is None:
            self._eval_program = StepProgram(self.layout, planner=self._planner,
                                             constants=self.constants[0], **self._program_options)
        return self._eval_program

    def member_engine(self, member: int, owner) -> MemberEngine:
        return MemberEngine(self, member, self.member_arenas[member],
                            self.population.member_address(self._mem.address, member), owner,
                            CpuEval)

    def close(self) -> None:
        """Nothing to release (host memory)."""
        self.closed = True


# --------------------------------------------------------------------------------------------
# The host side
# --------------------------------------------------------------------------------------------


class Member(Trainer):
    """Member ``index`` of a population as a fast ``Trainer`` (module docstring); built by the
    population (its initial state: ``reference.Trainer(config, seed)``'s, as a single fast
    trainer's)."""

    backend_name = "fast-member"

    def __init__(self, index: int, config, seed: int, engine: MemberEngine):  # noqa: D107
        self._closed = True
        self.index, self.seed, self.config = index, int(seed), config
        self._engine = engine
        self.n_step_on = engine.layout.n_step_on
        self._eval_cache: dict[int, object] = {}
        self._readback = DeferredReadback(config.readback_interval, sentinels.NUM_SENTINEL_SLOTS)
        self._closed = False
        self.load_state_dict(ReferenceTrainer(config, seed=self.seed).state_dict())

    def step(self, batch: Batch) -> StepScalars:
        raise RuntimeError(f"member {self.index} of a population steps with the others: "
                           "Population.step(batches), one batch per member")

    def _reseed(self, seed: int) -> None:
        raise ValueError(f"state: seed {seed} is not member {self.index}'s seed {self.seed}; a "
                         "population member's IQN quantile key is fixed when the population is "
                         "built (load it into a single trainer instead)")


class Population(MemberAccess):
    """N fast trainers of one architecture stepped by one graph replay (module docstring).

    ``Population(config, seeds, overrides=None, *, device=None, gemm_workspace="none",
    n_step=1)``: the members' configs as ``reference.population.member_configs`` checks them;
    ``n_step`` > 1: n-step transitions (every batch carries ``discount``, as a fast
    ``Trainer(n_step=)``'s); raises ``NoCudaDeviceError`` (with the reason) where no CUDA
    device/driver is usable."""

    def __init__(self, config, seeds: Sequence[int], overrides: Sequence[Mapping[str, Any]] | None = None,
                 *, device=None, gemm_workspace: str = "none", n_step: int = 1, **engine_options):
        self._closed = True
        self.config = config
        self.plan = plan = PopulationPlan(config, seeds, overrides,
                                          n_step_on=check_n_step(config, n_step))
        self.seeds = plan.seeds
        self._engine = self._make_engine(plan, device=device, gemm_workspace=gemm_workspace,
                                         **engine_options)
        self._closed = False
        self._read = None  # the population's last read, until the next launch or synchronisation
        self._members = [Member(m, plan.configs[m], plan.seeds[m],
                                self._engine.member_engine(m, self))
                         for m in range(plan.members)]
        #: Population steps taken (the staging ring's position).
        self.steps = 0

    def _make_engine(self, plan: PopulationPlan, *, device, gemm_workspace: str):
        from foxhunt.fast.device import _require_cuda

        _require_cuda()  # NoCudaDeviceError with the reason, before any other work
        return PopulationEngine(plan, device=device, gemm_workspace=gemm_workspace)

    @property
    def engine(self):
        """The device side (``PopulationEngine``, or the CPU twin's ``CpuPopulationEngine``)."""
        return self._engine

    def read_member(self, member: int) -> tuple[np.ndarray, np.ndarray]:
        """Member ``member``'s readback and flags: one read (a synchronisation) serves every
        member until the next launch or state change (``forget_read``)."""
        if self._read is None:
            self._read = self._engine.read()
        return self._read[0][member].copy(), self._read[1][member].copy()

    def forget_read(self) -> None:
        self._read = None

    def step(self, batches: Sequence[Batch]) -> list[StepScalars]:
        """One step of every member on its own batch (``batches[i]`` for member ``i``): every
        batch checked before any is written, then one upload and one replay of the step's
        graphs; each member's ``StepScalars`` by its own deferred-readback rule."""
        batches = list(batches)
        if len(batches) != len(self):
            raise ValueError(f"batches: {len(batches)} given; allowed: one per member ({len(self)})")
        for i, (member, batch) in enumerate(zip(self._members, batches)):
            try:
                check_step_batch(member.config, self._engine.layout, batch)
            except ValueError as exc:
                raise ValueError(f"member {i}: {exc}") from None
        slot = self.steps % STAGING_RING
        for member, batch, views in zip(self._members, batches, self._engine.staging(slot)):
            write_batch(member.config, batch, views)
        self._engine.launch(slot)
        self.forget_read()
        self.steps += 1
        return [member.step_enqueued() for member in self._members]

    def close(self) -> None:
        """Release the graphs, GEMM plans, events and device memory (unusable afterwards)."""
        if self._closed:
            return
        self._closed = True
        try:
            for member in self._members:
                member.close()
        finally:
            self._engine.close()


class CpuPopulation(Population):
    """``Population`` on the CPU executor (``CpuPopulationEngine``); ``branch_order`` and
    ``refused_epilogues`` as ``cpu_executor.CpuTrainer``'s."""

    def _make_engine(self, plan: PopulationPlan, *, device, gemm_workspace: str,
                     branch_order: str = "latest_first", refused_epilogues=()):
        if device is not None:
            raise ValueError(f"device: {device!r}; the CPU executor takes no device")
        return CpuPopulationEngine(plan, gemm_workspace=gemm_workspace, branch_order=branch_order,
                                   refused_epilogues=tuple(refused_epilogues))


__all__ = ["GRID_SHARED_KERNELS", "MEMBER_SCALARS", "POPULATION_FALLBACK_EPILOGUES", "CpuPopulation", "CpuPopulationEngine", "Member", "MemberArena",
           "MemberEngine", "Population", "PopulationEngine", "PopulationLowering", "PopulationPlan",
           "ScalarBlock", "batched_planner", "memcpy_2d"]
