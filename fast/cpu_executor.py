"""The CPU executor: the fast step's own records, run on the CPU by the reference kernels.

The plan the GPU captures (``StepProgram`` and the graph modules) is built here unchanged, over
``HostArena``: the step layout in one zero-filled host byte block, carved exactly as the
device ``Arena`` (256-byte aligned buffers at the same offsets; addresses are the block's
offsets from a fake base, so descriptor tables holding pointers resolve to it). Then:

- a kernel record calls its same-name reference twin (``foxhunt.fast.cpu_kernels``) on NumPy
  views of the regions its arguments name, shaped by the twin's extents;
- a GEMM record runs ``CpuGemm``: the reference GEMM (``reference.kernels.dense.gemm``: BF16
  operands exact, TF32 rounding emulated, float64-exact products summed in float32 order of
  NumPy) with its epilogue in float32 (bias, ReLU with the bitmask cuBLASLt writes, the ReLU
  gradient with the bias gradient, the bias gradient of an operand);
- a copy moves bytes between a region and a named host buffer;
- a graph is its dependency graph (``dataflow.dependency_graph``), run in a topological order:
  ``"latest_first"`` (always the most recently made record whose dependencies have run: a
  dependency missing between parallel branches changes the result) or ``"capture_order"``.

``CpuTrainer`` is ``foxhunt.fast.Trainer`` (the same host code: staging ring, deferred
readback, state exchange, folds, the evaluation graphs and their cache) on this executor: it
runs the whole fast step on a machine without a GPU (CI), where the conformance step tests
compare it with the reference ``Trainer``.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections.abc import Mapping
from types import MappingProxyType

import numpy as np

from foxhunt.fast.cpu_kernels import TWINS, Args, shape_of
from foxhunt.fast.eval_plan import Q_HOST, X_HOST, eval_host_nbytes, eval_ops
from foxhunt.fast.graph2_plan import staging_name
from foxhunt.fast.gpu_engine import step_plans
from foxhunt.fast.dataflow import check_dataflow, dependency_graph
from foxhunt.fast.device import SYNCS
from foxhunt.fast.records import Buf, Copy, Gemm, Host, Launch, Ops, kernel_params
from foxhunt.fast.step_layout import BufferTable, EvalLayout, StepLayout, elements
from foxhunt.fast.step_program import StepProgram, step_constants
from foxhunt.fast.trainer import STAGING_RING, Trainer
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.kernels import dense

F32 = np.float32
BRANCH_ORDERS = ("latest_first", "capture_order")
#: The architecture the CPU plan is built for (launch shapes that depend on it: the spectral
#: norm's clusters).
CPU_ARCH = "sm_90"
_BASES = itertools.count(1)


class HostArena:
    """The layout ``specs`` in one zero-filled host byte block, carved like the device
    ``Arena`` (``ptr``, ``spec``, ``upload``, ``download``, ``zero``, ``close``)."""

    def __init__(self, specs: Mapping[str, tuple], nbytes: int | None = None):
        from foxhunt.fast.arena import ArenaLayout

        self.layout = ArenaLayout()
        for name, (shape, dtype) in specs.items():
            self.layout.add(name, shape, dtype)
        if nbytes is not None and nbytes < self.layout.nbytes:
            raise ValueError(f"nbytes: {nbytes} is less than the layout's {self.layout.nbytes} bytes")
        self.block = np.zeros(max(self.layout.nbytes if nbytes is None else nbytes, 1), np.uint8)
        self.base = next(_BASES) << 40  # a fake, 256-byte aligned address space of its own

    def view(self, offset: int, nbytes: int) -> HostArena:
        """The same layout over bytes ``[offset, offset + nbytes)`` of this block, at its own
        addresses (a population member's copy: ``foxhunt.fast.population``)."""
        view = object.__new__(HostArena)
        view.layout, view.block = self.layout, self.block[offset:offset + nbytes]
        view.base = self.base + offset
        return view

    def __contains__(self, name: str) -> bool:
        return name in self.layout

    def spec(self, name: str):
        return self.layout[name]

    def ptr(self, name: str) -> int:
        return self.base + self.layout[name].offset

    def array(self, name: str) -> np.ndarray:
        """The live typed view of buffer ``name``."""
        spec = self.layout[name]
        return self.block[spec.offset:spec.offset + spec.nbytes].view(spec.dtype).reshape(spec.shape)

    def upload(self, name: str, array: np.ndarray) -> None:
        SYNCS.note()  # the device arena's upload synchronises
        spec = self.layout[name]
        array = np.asarray(array)
        if array.dtype != spec.dtype or array.shape != spec.shape:
            raise ValueError(f"array: buffer {name!r} holds {spec.shape} {spec.dtype}, got "
                             f"{array.shape} {array.dtype}")
        self.array(name)[...] = array

    def download(self, name: str) -> np.ndarray:
        SYNCS.note()  # the device arena's download synchronises
        return self.array(name).copy()

    def zero(self, name: str | None = None, stream=None) -> None:
        if name is None:
            self.block[:] = 0
        else:
            self.array(name).reshape(-1).view(np.uint8)[:] = 0

    def at(self, address: int, nbytes: int) -> np.ndarray | None:
        """The bytes ``[address, address + nbytes)`` if they lie in this arena, else None."""
        start = address - self.base
        if 0 <= start and start + nbytes <= self.block.size:
            return self.block[start:start + nbytes]
        return None

    def close(self) -> None:
        """Nothing to release (host memory)."""


class Memory:
    """What records resolve to on the CPU: buffer tables with their arenas, host buffers."""

    def __init__(self, tables: list[tuple[BufferTable, HostArena]], host: Mapping[str, np.ndarray]):
        self.tables = tables
        self.host = host
        self._found: dict[Buf, tuple] = {}

    def _find(self, buf: Buf):
        """``buf``'s region and the arena that holds it (the tables do not change: each
        buffer's answer is kept; a ``Buf`` with an unhashable key is resolved every time)."""
        try:
            found = self._found.get(buf)
        except TypeError:
            return self._resolve(buf)
        if found is None:
            found = self._found[buf] = self._resolve(buf)
        return found

    def _resolve(self, buf: Buf):
        for table, arena in self.tables:
            if buf.name in table:
                return table.region(buf), arena
        raise KeyError(f"no buffer {buf.name!r}")

    def address(self, buf: Buf) -> int:
        region, arena = self._find(buf)
        return arena.ptr(region.buffer) + region.byte_start

    def view(self, buf: Buf, count: int, dtype=None) -> np.ndarray:
        """``count`` elements from ``buf`` (a writable 1-D view of the region's dtype)."""
        region, arena = self._find(buf)
        dtype = region.dtype if dtype is None else np.dtype(dtype)
        spec = arena.spec(region.buffer)
        start = spec.offset + region.byte_start
        return arena.block[start:start + count * dtype.itemsize].view(dtype)

    def bytes(self, end: Buf | Host, nbytes: int) -> np.ndarray:
        if isinstance(end, Host):
            return self.host[end.name].reshape(-1).view(np.uint8)[:nbytes]
        return self.view(end, nbytes, np.uint8)

    def at(self, address: int, count: int, dtype: np.dtype) -> np.ndarray:
        for _, arena in self.tables:
            raw = arena.at(address, count * dtype.itemsize)
            if raw is not None:
                return raw.view(dtype)
        raise ValueError(f"address {address:#x} ({count} x {dtype}) is in no arena of this plan")


# --------------------------------------------------------------------------------------------
# GEMMs
# --------------------------------------------------------------------------------------------


class MemberMemory:
    """``Memory.view`` of population member ``i``: every region ``offset`` (``i *
    batch_stride``) bytes past member 0's (``Memory.at``: an address in no arena is an error)."""

    def __init__(self, mem: Memory, offset: int):
        self.mem, self.offset = mem, offset

    def address(self, buf: Buf) -> int:
        return self.mem.address(buf) + self.offset

    def view(self, buf: Buf, count: int, dtype=None) -> np.ndarray:
        dtype = self.mem._find(buf)[0].dtype if dtype is None else np.dtype(dtype)
        return self.mem.at(self.address(buf), count, dtype)

    def at(self, address: int, count: int, dtype: np.dtype) -> np.ndarray:
        return self.mem.at(address, count, dtype)


class CpuGemm:
    """A GEMM "plan" on the CPU: ``GemmPlan``'s arguments and checks (``GemmSpec``), run by the
    reference GEMM with the epilogue in float32 (module docstring). A batched plan (``batch`` >
    1, ``gemm`` module docstring) runs ``batch`` independent GEMMs, member ``i``'s operands,
    bias and aux ``i * batch_stride`` bytes past member 0's (the record's buffers), or each
    operand ``i`` times its own stride (per-operand strides)."""

    def __init__(self, m, n, k, *, trans_a=False, trans_b=False, precision="f32", epilogue=None,
                 lda=None, ldb=None, ldc=None, alpha=1.0, beta=0.0, min_alignment=256,
                 workspace_limit=0, heuristic=None, sm_count_target=0, batch=1, batch_stride=0):
        from foxhunt.fast.gemm import GemmSpec, check_batch, check_sm_count_target

        #: ``GemmPlan.heuristic``'s place: the CPU chooses no algorithm (``PlanCache`` passes
        #: back what it got).
        self.heuristic = heuristic
        self.spec = GemmSpec(m, n, k, trans_a, trans_b, precision, epilogue, lda, ldb, ldc, alpha, beta)
        if min_alignment not in (4, 8, 16, 32, 64, 128, 256):
            raise ValueError(f"min_alignment: {min_alignment!r} is not a power of two in [4, 256]")
        self.min_alignment = min_alignment
        self.workspace_limit = workspace_limit
        self.sm_count_target = check_sm_count_target(sm_count_target)  # checked; no effect here
        self.batch, self.batch_stride = check_batch(batch, batch_stride, self.spec)

    @staticmethod
    def _stored(mem: Memory | MemberMemory, address: int, shape, ld: int, dtype) -> np.ndarray:
        full = mem.at(address, (shape[0] - 1) * ld + shape[1], np.dtype(dtype))
        return np.lib.stride_tricks.as_strided(full, shape=shape, strides=(ld * full.itemsize, full.itemsize))

    def run(self, mem: Memory, node: Gemm) -> None:
        from foxhunt.fast.gemm import operand_offsets

        for buf in (node.a, node.b, node.c):
            if mem.address(buf) % self.min_alignment:
                raise ValueError(f"GEMM operand {buf} is not {self.min_alignment}-byte aligned")
        for member in range(self.batch):  # (a member stride keeps the alignment: check_batch)
            self._run_one(mem, node, operand_offsets(self.batch_stride, member))

    def _run_one(self, mem: Memory | MemberMemory, node: Gemm, offsets: dict[str, int]) -> None:
        s = self.spec

        def at(name: str) -> int:  # the operand's address in this member
            return mem.address(getattr(node, name)) + offsets[name]

        def vector(name: str, count: int) -> np.ndarray:
            return mem.at(at(name), count, np.dtype(np.uint8 if name == "aux" else F32))

        a = self._stored(mem, at("a"), s.a_shape, s.lda, s.input_dtype).copy()
        b = self._stored(mem, at("b"), s.b_shape, s.ldb, s.input_dtype).copy()
        mode = s.precision
        if mode == "bf16":
            a, b, mode = dense.bf16_to_f32(a), dense.bf16_to_f32(b), "f32"
        c = self._stored(mem, at("c"), s.c_shape, s.ldc, F32)
        with np.errstate(all="ignore"):
            out = dense.gemm(a, b, trans_a=s.trans_a, trans_b=s.trans_b, mode=mode)
            if s.alpha != 1.0:
                out = (F32(s.alpha) * out).astype(F32)
            if s.beta != 0.0:
                out = (out + F32(s.beta) * c).astype(F32)
            ep = s.epilogue
            aux_row = (s.aux_ld or 0) // 8
            if ep in ("bias", "relu_bias", "relu_aux_bias"):
                out = (out + vector("bias", s.n)[None, :]).astype(F32)
                if ep != "bias":
                    mask = ~(out <= 0)  # a NaN passes and sets its bit (f32 plans: gemm docstring)
                    out = np.where(mask, out, F32(0)).astype(F32)
                    if ep == "relu_aux_bias":
                        bits = np.packbits(mask, axis=1, bitorder="little")
                        aux = vector("aux", s.aux_nbytes).reshape(s.m, aux_row)
                        aux[:, :bits.shape[1]] = bits
            elif ep == "drelu_bgrad":
                aux = vector("aux", s.aux_nbytes).reshape(s.m, aux_row)
                mask = np.unpackbits(aux, axis=1, bitorder="little")[:, :s.n].astype(bool)
                out = np.where(mask, out, F32(0)).astype(F32)
                vector("bias", s.n)[:] = dense.bias_grad_reduce(out)
            elif ep == "bgradb":  # cuBLASLt's BGRADB: cuBLAS's B is our row-major A
                op_a = np.ascontiguousarray(a.T if s.trans_a else a)
                vector("bias", s.m)[:] = np.sum(op_a, axis=1, dtype=F32)
            elif ep == "bgrada":  # cuBLASLt's BGRADA: cuBLAS's A is our row-major B
                vector("bias", s.n)[:] = np.sum(b.T if s.trans_b else b, axis=0, dtype=F32)
        c[...] = out


#: In ``cpu_planner``'s ``refused_epilogues``: refuse every plan with per-operand batch strides
#: (the stacked backward's GEMMs), whatever its epilogue.
STACKED = "stacked"


def cpu_planner(refused_epilogues=()):
    """A planner for ``StepProgram`` making ``CpuGemm``s; the epilogues in ``refused_epilogues``
    (and with ``STACKED`` among them, every plan with per-operand batch strides) raise
    ``GemmPlanError`` as a cuBLASLt without an algorithm for them would."""
    refused = frozenset(refused_epilogues)

    def plan(*args, epilogue=None, **kwargs):
        from foxhunt.fast.gemm import GemmPlanError

        if epilogue in refused:
            raise GemmPlanError(f"CPU planner: epilogue {epilogue!r} refused on request")
        if STACKED in refused and isinstance(kwargs.get("batch_stride"), Mapping):
            raise GemmPlanError("CPU planner: per-operand batch strides refused on request")
        return CpuGemm(*args, epilogue=epilogue, **kwargs)
    return plan


# --------------------------------------------------------------------------------------------
# Running records
# --------------------------------------------------------------------------------------------


@functools.cache
def _params_by_name(kernel: str) -> Mapping[str, object]:
    """Kernel ``kernel``'s parameters (``records.kernel_params``) by name."""
    return MappingProxyType({p.name: p for p in kernel_params()[kernel]})


def run_launch(mem: Memory, node: Launch) -> None:
    """Call the kernel's reference twin on views of its arguments and store what it writes."""
    twin = TWINS[node.kernel]
    params = _params_by_name(node.kernel)
    scalars = {k: v for k, v in node.args.items() if not params[k].pointer}

    def table(name, count, dtype):
        return mem.view(node.args[name], count, dtype).copy()

    sizing = Args(scalars, node.shape, table=table)
    views = {}
    for name, p in params.items():
        if p.pointer:
            buf = node.args[name]
            if buf is None:
                views[name] = None
                continue
            shape = shape_of(twin.extents[name], sizing)
            views[name] = mem.view(buf, elements(shape)).reshape(shape)
    out = twin.run(Args(scalars, node.shape, table=table, views=views, at=mem.at))
    for name, value in out.items():
        if params[name].const or views.get(name) is None:
            raise AssertionError(f"twin of {node.kernel} wrote {name!r}, which it may not write")
        view = views[name]
        value = np.asarray(value)
        if value.size != view.size:
            raise AssertionError(f"twin of {node.kernel}: {name!r} has {value.size} elements, "
                                 f"the kernel writes {view.size}")
        view[...] = value.astype(view.dtype, copy=False).reshape(view.shape)


def run_node(mem: Memory, node) -> None:
    if isinstance(node, Launch):
        run_launch(mem, node)
    elif isinstance(node, Gemm):
        node.plan.run(mem, node)
    elif isinstance(node, Copy):
        mem.bytes(node.dst, node.nbytes)[:] = mem.bytes(node.src, node.nbytes)
    else:  # pragma: no cover - records.NODE_RECORDS are the three above
        raise AssertionError(type(node))


def topological_order(deps: list[frozenset], branch_order: str) -> list[int]:
    """A topological order of a dependency graph: ``latest_first`` always runs the most
    recently made ready node, ``capture_order`` the earliest."""
    if branch_order not in BRANCH_ORDERS:
        raise ValueError(f"branch_order: {branch_order!r} is not allowed; expected one of {BRANCH_ORDERS}")
    n = len(deps)
    children: list[list[int]] = [[] for _ in range(n)]
    missing = [len(d) for d in deps]
    for i, ds in enumerate(deps):
        for j in ds:
            children[j].append(i)
    sign = -1 if branch_order == "latest_first" else 1
    heap = [sign * i for i in range(n) if missing[i] == 0]
    heapq.heapify(heap)
    out = []
    while heap:
        i = sign * heapq.heappop(heap)
        out.append(i)
        for c in children[i]:
            missing[c] -= 1
            if missing[c] == 0:
                heapq.heappush(heap, sign * c)
    if len(out) != n:
        raise AssertionError("dependency cycle")
    return out


class CpuGraph:
    """One graph's records in the order they run (``topological_order``)."""

    def __init__(self, ops: Ops, branch_order: str):
        self.nodes, deps = dependency_graph([ops])
        self.order = topological_order(deps, branch_order)

    @property
    def node_count(self) -> int:
        return len(self.nodes)

    def replay(self, mem: Memory) -> None:
        for i in self.order:
            run_node(mem, self.nodes[i])


# --------------------------------------------------------------------------------------------
# The engine behind CpuTrainer
# --------------------------------------------------------------------------------------------


class CpuEngine:
    """What ``fast.Trainer`` needs of a device, on the CPU (see ``gpu_engine.GpuEngine``)."""

    def __init__(self, config: DQNConfig, *, gemm_workspace: str = "none",
                 branch_order: str = "latest_first", refused_epilogues=(),
                 staging_slots: int = STAGING_RING, seed: int = 0, n_step_on: bool = False,
                 fused_trunk: bool = False, fused_heads: bool = False,
                 stacked_backward: bool = False):
        self.branch_order = branch_order
        self.layout = lay = StepLayout(config, n_step_on=n_step_on)
        self.arena = HostArena(lay.specs)
        self._mem = Memory([(lay, self.arena)], {})
        constants = step_constants(lay, self._mem.address)
        for name, value in constants.items():
            self.arena.upload(name, value.reshape(self.arena.spec(name).shape))
        self._staging = [np.zeros(lay.batch_nbytes, np.uint8) for _ in range(staging_slots)]
        self._mem.host = {staging_name(s): buf for s, buf in enumerate(self._staging)}
        self.program = prog = StepProgram(
            lay, planner=cpu_planner(refused_epilogues), constants=constants,
            host_nbytes={staging_name(s): lay.batch_nbytes for s in range(staging_slots)},
            arch=CPU_ARCH, gemm_workspace=gemm_workspace, seed=seed, fuse_trunk=fused_trunk,
            fuse_heads=fused_heads, stacked_backward=stacked_backward)
        self.plans = step_plans(prog, staging_slots)
        ops_up, ops1, ops2 = self.plans["upload"], self.plans["graph1"], self.plans["graph2"]
        self._upload = [CpuGraph(ops, branch_order) for ops in ops_up]
        self._graph1, self._graph2 = CpuGraph(ops1, branch_order), CpuGraph(ops2, branch_order)
        self.planned_launches = (ops_up[0].node_count(), ops1.node_count(), ops2.node_count())
        self.graph_node_counts = self.planned_launches

    def staging(self, slot: int) -> dict[str, np.ndarray]:
        return self.layout.batch_views(self._staging[slot])

    def launch(self, slot: int) -> None:
        for graph in (self._upload[slot], self._graph1, self._graph2):
            graph.replay(self._mem)

    def read(self) -> tuple[np.ndarray, np.ndarray]:
        readback, flags = self.arena.array("readback").copy(), self.arena.array("flags").copy()
        SYNCS.note()  # the GPU engine's read: one stream synchronisation
        return readback, flags

    def synchronize(self) -> None:
        """Nothing is in flight on the CPU (counted as the GPU's synchronisation)."""
        SYNCS.note()

    def forget_uploads(self) -> None:
        """No upload is ever in flight on the CPU."""

    def build_eval(self, rows: int) -> CpuEval:
        return CpuEval(self, rows)

    def close(self) -> None:
        """Nothing to release (host memory)."""


class CpuEval:
    """The ``q_values`` graph for ``rows`` states on the CPU (``eval_plan.eval_ops``)."""

    def __init__(self, engine: CpuEngine, rows: int):
        self.evl = evl = EvalLayout(engine.layout, rows)
        self.arena = HostArena(evl.specs)
        sizes = eval_host_nbytes(evl)
        self.x_host = np.zeros(sizes[X_HOST] // 4, F32)
        self.q_host = np.zeros(sizes[Q_HOST] // 4, F32)
        ops = eval_ops(engine.program, evl)
        check_dataflow([ops], lambda name: evl.role(name) if name in evl else engine.layout.role(name),
                       evl.zero_padding())
        self.graph = CpuGraph(ops, engine.branch_order)
        self._mem = Memory([(evl, self.arena), (engine.layout, engine.arena)],
                           {X_HOST: self.x_host, Q_HOST: self.q_host})

    def run(self, states: np.ndarray) -> list[np.ndarray]:
        self.x_host[...] = np.asarray(states, F32).reshape(-1)
        self.graph.replay(self._mem)
        SYNCS.note()  # the GPU evaluation graph's synchronisation
        return self.evl.split_q(self.q_host)

    def close(self) -> None:
        """Nothing to release (host memory)."""


class CpuTrainer(Trainer):
    """``foxhunt.fast.Trainer`` on the CPU executor (module docstring).

    ``branch_order``: the order parallel branches run in (``topological_order``);
    ``refused_epilogues``: GEMM epilogues the CPU planner refuses, as a cuBLASLt without an
    algorithm for them would (the step then takes the kernel fallbacks)."""

    def __init__(self, config: DQNConfig, seed: int = 0, *, gemm_workspace: str = "none",
                 branch_order: str = "latest_first", refused_epilogues=(), n_step: int = 1,
                 fused_trunk: bool = False, fused_heads: bool = False,
                 stacked_backward: bool = False):
        self._cpu_options = dict(branch_order=branch_order, refused_epilogues=tuple(refused_epilogues))
        super().__init__(config, seed, gemm_workspace=gemm_workspace, n_step=n_step,
                         fused_trunk=fused_trunk, fused_heads=fused_heads,
                         stacked_backward=stacked_backward)

    def _make_engine(self, config: DQNConfig, *, seed: int, device,
                     gemm_workspace: str, n_step_on: bool = False,
                     fused_trunk: bool = False, fused_heads: bool = False,
                     stacked_backward: bool = False) -> CpuEngine:
        if device is not None:
            raise ValueError(f"device: {device!r}; the CPU executor takes no device")
        self._check_config(config)
        return CpuEngine(config, gemm_workspace=gemm_workspace, staging_slots=STAGING_RING,
                         seed=seed, n_step_on=n_step_on, fused_trunk=fused_trunk,
                         fused_heads=fused_heads, stacked_backward=stacked_backward,
                         **self._cpu_options)


__all__ = ["BRANCH_ORDERS", "STACKED", "CpuEngine", "CpuGemm", "CpuGraph", "CpuTrainer", "HostArena",
           "Memory", "MemberMemory", "cpu_planner", "run_node", "topological_order"]
