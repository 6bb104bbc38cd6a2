"""The population's engines (issue 24; ``fast.population`` has the design): the GPU one
(``PopulationEngine``: ``GpuEngine``'s capture and replay over one arena of N member copies, the
member build's kernels through ``PopulationLowering``), its CPU executor twin
(``CpuPopulationEngine``) and member m's view of either (``MemberEngine``: what a single
trainer's host code and evaluation graphs use).
"""

from __future__ import annotations

import dataclasses
import functools
import math

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
from foxhunt.fast.device import SYNCS, _driver, call
from foxhunt.fast.gpu_engine import (READ_BUFFERS, GpuEngine, GpuEval, pinned_host_buffers,
                                      step_plans)
from foxhunt.fast.graph2_plan import staging_name
from foxhunt.fast.graph_lowering import EARLY_LAUNCH, Lowering, layered_address
from foxhunt.fast.kernels.spectral import spectral_shared_bytes
from foxhunt.fast.population_plan import (
    MEMBER_PROGRAM_OPTIONS,
    MEMBER_SCALARS,
    PopulationPlan,
    batched_planner,
    member_scalar_values,
)
from foxhunt.fast.records import Copy, Gemm, Host, Launch
from foxhunt.fast.step_program import StepProgram, step_constants
from foxhunt.fast.trainer import STAGING_RING

#: Kernels whose results do not depend on ``gridDim.x`` (their blocks stride over all the work,
#: and what they write is the same for any grid), with where that is said. A population launch
#: gives each member ``shared_grid_x`` blocks of them instead of the plan's ``grid.x``: the N
#: members together take about the blocks one member did, or one full wave of resident blocks
#: where that is more. Measured on the H200 (seed preset, bf16): ``nan_check_fused`` with its
#: single-trainer grid per member took 124, 59 and 36 us of graph 2's 370 us at N = 16 (each
#: block scans the slot table before its one chunk); sharing the flat kernels' grids too took
#: the step from 1,203 to 1,072 us at N = 16 and from 4,185 to 3,702 us at N = 64 (session 17,
#: before those kernels were vectorised). Not listed although grid-independent: the C51
#: projection gradient, a block per sample, took 44.9 us per launch at N = 64 grid-shared against
#: 32.7 us on its plan's grid (session 18).
GRID_SHARED_KERNELS = {
    "nan_check_fused": "fast.kernels.safety.plan_nan_check_fused",
    "nan_check": "cuda_src/safety.cu, nan_check's comment (any grid)",
    "f32_to_bf16": "cuda_src/dense.cu, the casts' comment",
    "bf16_to_f32": "cuda_src/dense.cu, the casts' comment",
    "relu_mask": "cuda_src/dense.cu (DENSE_FLAT_LOOP, elementwise)",
    "clamp_finite": "cuda_src/safety.cu, clamp_finite's comment",
    "clamp_finite_isv": "cuda_src/step.cu, clamp_finite_isv's comment",
    "h2_grad_sum_mask": "cuda_src/step.cu, h2_grad_sum_mask's comment",
    "scalar_target_q_branches": "cuda_src/step.cu (STEP_FLAT_LOOP, per sample)",
    "dueling_combine_backward_sum_branches": "cuda_src/fused.cu (grid-stride over the cells)",
    "dueling_log_softmax_q_branches": "cuda_src/fused.cu, the kernel's comment (grid-stride)",
    "adam_update": "cuda_src/optim.cu, adam_update's comment",
    "adam_update_norm": "cuda_src/optim.cu, adam_update_norm's comment (as adam_update)",
    "polyak_update_mirror": "cuda_src/optim.cu, polyak_update_mirror's comment",
    "polyak_update_mirror_ptr": "cuda_src/optim.cu, polyak_update_mirror's comment",
    "polyak_update_mirror_check": "cuda_src/optim.cu, polyak_update_mirror_check's comment",
    "iqn_tau_cos": "cuda_src/iqn.cu, iqn_tau_cos's comment",
    "iqn_modulate": "cuda_src/iqn.cu (IQN_GRID_LOOP, elementwise)",
    "iqn_modulate_backward": "cuda_src/iqn.cu (IQN_GRID_LOOP, per (b, h))",
    "mse_warmup": "cuda_src/warmup.cu, mse_warmup's comment",
    "double_dqn_gather_branches": "cuda_src/step.cu, the kernel's comment (grid-stride rows)",
    "grad_norm_partial": "cuda_src/optim.cu, grad_norm_partial's comment",
    "clip_saxpy_norm_partial": "cuda_src/optim.cu, clip_saxpy_norm_partial's comment",
    "clip_saxpy_norm_partial_wave": "cuda_src/optim.cu, clip_saxpy_norm_partial_wave's comment",
    "saxpy": "cuda_src/optim.cu, saxpy's comment",
    "cql_logit_grad": "cuda_src/distributional.cuh, the CQL gradient's comment (warp per sample)",
    "cql_logit_grad_branches": "cuda_src/distributional.cuh, the CQL gradient's comment",
}
#: Kernels whose outputs do not depend on their block size, launched by a population of more
#: than one member with these threads per block instead of the plan's (and where that is said).
#: ``batched_spectral_norm``: its trees are a 512-thread block's, replayed by any power of two
#: from 32 to 512 (cuda_src/spectral.cu's header); the single trainer keeps 512 (its step took
#: 129.4 us against 134.6 us with 256, session 17), while 256-thread clusters let a population
#: run twice the matrices at once: measured on the H200 (seed preset, bf16, one run each, session
#: 18) the step took 926.6 against 936.7 us at N = 16 and 3,105 against 3,173 us at N = 64.
POPULATION_BLOCK_THREADS = {
    "batched_spectral_norm": (256, "cuda_src/spectral.cu's header (SPECTRAL_TREE_THREADS)"),
}


def shared_grid_x(grid_x: int, members: int, resident_blocks: int, sm_count: int,
                  grid_y: int = 1) -> int:
    """``grid.x`` per member of a ``GRID_SHARED_KERNELS`` launch over ``members`` members whose
    plan is ``(grid_x, grid_y)``: the plan's ``grid_x`` shared among them (``ceil(grid_x /
    members)``), but not fewer than a member's whole share of one wave (``floor(sm_count *
    resident_blocks / (members * grid_y))``, at least 1: rounding up would leave a second,
    nearly empty wave) and never more than ``grid_x``. ``resident_blocks``: the kernel's blocks
    an SM holds at once (its occupancy)."""
    wave = max(1, int(sm_count)) * max(1, int(resident_blocks))
    return min(grid_x, max(-(-grid_x // members), wave // (members * max(1, grid_y)), 1))


#: Kernels a population of more than one member launches with less dynamic shared memory than
#: the single trainer's plan, as a function of the architecture: ``batched_spectral_norm``'s
#: step plan spreads a cluster's blocks one an SM (``plan_step_spectral_norm``), which would
#: halve the clusters a population runs at once; its members take the plain plan's memory.
POPULATION_SHARED = {"batched_spectral_norm": spectral_shared_bytes}


def population_shared(kernel: str, shared_mem: int, members: int, arch) -> int:
    """The dynamic shared memory of a population launch of ``kernel`` planned with
    ``shared_mem``: the plan's, or for more than one member the ``POPULATION_SHARED`` entry's
    (never more than the plan's)."""
    if members > 1 and kernel in POPULATION_SHARED:
        return min(shared_mem, POPULATION_SHARED[kernel](arch))
    return shared_mem


def population_block(kernel: str, block: tuple, members: int) -> tuple:
    """The block of a population launch of ``kernel`` planned with ``block``: the plan's, or for
    more than one member the ``POPULATION_BLOCK_THREADS`` entry's threads."""
    if members > 1 and kernel in POPULATION_BLOCK_THREADS:
        return (POPULATION_BLOCK_THREADS[kernel][0], 1, 1)
    return tuple(block)


def upload_member_constants(plan: PopulationPlan, member_arenas, address0) -> list[dict]:
    """Each member's constant buffers (``step_constants`` of its own layout at its own
    addresses, ``address0`` being member 0's address function) and its scalar blocks, uploaded
    into its copy (``member_arenas[m]``); returns the constants per member."""
    out = []
    for m, arena in enumerate(member_arenas):
        constants = step_constants(plan.member_layouts[m], plan.member_address(address0, m))
        for name, value in constants.items():
            arena.upload(name, value.reshape(arena.spec(name).shape))
        arena.upload(MEMBER_SCALARS, plan.scalar_block_bytes(m))
        out.append(constants)
    return out


# --------------------------------------------------------------------------------------------
# The GPU engine
# --------------------------------------------------------------------------------------------


def memcpy_2d(dst: int, dst_host: bool, dst_pitch: int, src: int, src_host: bool, src_pitch: int,
              width: int, rows: int, stream_handle) -> None:
    """``rows`` rows of ``width`` bytes, row r from ``src + r * src_pitch`` to ``dst + r *
    dst_pitch`` (``cuMemcpy2DAsync``; a host end must be page-locked)."""
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
    block (or null) after its own arguments and runs with ``gridDim.z = members`` (early where
    ``EARLY_LAUNCH`` says so, as in ``Lowering``: the member build's wrapper of such a kernel
    waits before it reads its scalar block); each copy is one 2-D copy over the members (module
    docstring). GEMM records carry batched plans."""

    def __init__(self, module, address, host, *, members: int, stride: int, scalar_address,
                 sm_count: int, arch: str):
        super().__init__(module, address, host)
        self.members, self.stride, self.sm_count, self.arch = members, stride, sm_count, arch
        self.scalar_address = scalar_address  # id(Launch) -> member 0's block address
        self._resident: dict[tuple, int] = {}

    def extra_args(self, node: Launch) -> tuple:
        return self.stride, self.scalar_address.get(id(node), 0)

    def resident_blocks(self, kernel, threads: int, shared_mem: int) -> int:
        """Blocks of ``kernel`` (its member build) an SM holds at once with ``threads`` threads
        and ``shared_mem`` bytes of dynamic shared memory (the driver's occupancy answer, which
        counts its registers and shared memory), cached per launch shape."""
        key = (kernel.name, threads, shared_mem)
        if key not in self._resident:
            self._resident[key] = int(call(
                _driver().cuOccupancyMaxActiveBlocksPerMultiprocessor, kernel.function,
                threads, shared_mem))
        return self._resident[key]

    def launch(self, node: Launch, stream) -> None:
        gx, gy, gz = node.shape.grid
        if gz != 1:
            raise AssertionError(f"kernel {node.kernel}: grid.z = {gz}; the member build takes z")
        block = population_block(node.kernel, node.shape.block, self.members)
        shared = population_shared(node.kernel, node.shape.shared_mem, self.members, self.arch)
        kernel, packed = self.packed(node)
        if node.kernel in GRID_SHARED_KERNELS:
            resident = self.resident_blocks(kernel, math.prod(block), shared)
            gx = shared_grid_x(gx, self.members, resident, self.sm_count, gy)
        kernel.launch((gx, gy, self.members), block, packed, stream=stream,
                      shared_mem=shared,
                      early=self.early_launch and node.kernel in EARLY_LAUNCH)

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
        self.constants = upload_member_constants(plan, self.member_arenas, self.address)
        self.stream = dev.stream
        pinned = pinned_host_buffers(dev, lay, staging_slots, members=N)
        self.gemm_plans = PlanCache(functools.partial(GemmPlan, dev),
                                    store=AlgoStore.for_device(dev, cublaslt_version()))
        self._program_options = dict(
            host_nbytes={staging_name(s): lay.batch_nbytes for s in range(staging_slots)},
            arch=dev.arch, gemm_workspace=gemm_workspace, seed=plan.seeds[0],
            **MEMBER_PROGRAM_OPTIONS)
        self.program = StepProgram(lay, planner=batched_planner(self.gemm_plans, N, S),
                                   constants=self.constants[0],
                                   sm_count=plan.sm_count(dev.multiprocessor_count),
                                   **self._program_options)
        self._eval_program = None
        plans = step_plans(self.program, staging_slots)
        scalars = self.arena.ptr(MEMBER_SCALARS)
        self._capture(pinned, plans, Lowering(self.module, self.address, pinned) if N == 1 else
                      PopulationLowering(self.module, self.address, pinned, members=N, stride=S,
                                         sm_count=dev.multiprocessor_count, arch=dev.arch,
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
    builder for its evaluation graphs; ``read()`` its row of the population's read (``owner``'s
    ``read_member``; a synchronisation drops that read: ``owner.forget_read``);
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
        self.constants = upload_member_constants(plan, self.member_arenas, self._mem.address)
        self._planner = cpu_planner(refused_epilogues)
        self._program_options = dict(
            host_nbytes={staging_name(s): lay.batch_nbytes for s in range(staging_slots)},
            arch=CPU_ARCH, gemm_workspace=gemm_workspace, seed=plan.seeds[0],
            **MEMBER_PROGRAM_OPTIONS)
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
                        **node.args, **member_scalar_values(block, params, raw)})
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


__all__ = ["GRID_SHARED_KERNELS", "POPULATION_BLOCK_THREADS", "CpuPopulationEngine", "MemberArena",
           "MemberEngine", "PopulationEngine", "PopulationLowering", "memcpy_2d",
           "population_block", "population_shared"]
