"""Launch records: the fast step's plan as data (SPEC 9, "The plan is data").

A plan is an ``Ops`` list of records, each checked when it is added:

- ``Launch(kernel, shape, args)``: a kernel of ``cuda_src``, every argument bound by the
  kernel's own parameter name (read from the source by ``foxhunt.fast.cuda_parse``) to a
  region of a named buffer (``Buf``; a ``str`` is short for ``Buf(name)``), ``None`` (a null
  pointer, where the kernel's twin declares the parameter nullable) or a scalar; ``shape`` is
  the launch configuration (grid, block, dynamic shared memory: cuda.core's ``LaunchConfig``).
- ``Gemm(plan, a, b, c, bias, aux)``: a planned GEMM (``plan.spec`` is its ``GemmSpec``) with
  its operands by name.
- ``Copy(dst, src, nbytes, kind)``: an async copy between a buffer and a named host buffer
  (``Host``, pinned memory on the GPU) or two buffers.
- ``Parallel(sides, main)``, ``Record(event)``, ``Wait(event)``: the branch structure (the GPU
  forks side streams and joins them; the CPU executor builds the same dependency graph).

``Binder`` checks a record against the kernels' declarations and the step layout and fails
with ``PlanError`` naming the kernel and the parameter: a missing, extra or misspelt argument;
a buffer bound to a scalar parameter or a scalar to a pointer; an int parameter given a float;
a buffer whose dtype is not the parameter's element type; a written (non-``const``) parameter
bound to a read-only buffer (the batch, the constants); a region shorter than the extent the
kernel's twin declares for that parameter (``foxhunt.fast.cpu_kernels``). Once a whole plan is
built, ``check_dataflow`` asserts that every scratch region a record reads was written by a
record it depends on (``dependency_graph``: the graph edges stream capture makes): an input
bound to a buffer nothing has written yet, or a missing edge between parallel branches, fails
there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

F32 = np.dtype(np.float32)
U16 = np.dtype(np.uint16)
I32 = np.dtype(np.int32)
I64 = np.dtype(np.int64)
U64 = np.dtype(np.uint64)
U8 = np.dtype(np.uint8)

#: Element type of a pointer parameter -> the buffer dtype it must point into (a descriptor
#: struct is read as bytes: its twin declares its extent in bytes).
ELEMENT_DTYPES = {"float": F32, "int": I32, "long long": I64, "unsigned short": U16,
                  "unsigned long long": U64, "unsigned char": U8, "SpectralMatrix": U8}
#: Scalar parameter types -> (kind, low, high): the values a by-value argument may take.
SCALAR_TYPES = {"int": ("int", -(1 << 31), 1 << 31), "long long": ("int", -(1 << 63), 1 << 63),
                "unsigned": ("int", 0, 1 << 32), "float": ("float", None, None)}
#: Buffer roles: what a written parameter may not be bound to.
READ_ONLY_ROLES = frozenset({"batch", "constant"})
#: ``Copy`` kinds (the driver call each becomes on the GPU).
COPY_KINDS = ("htod", "dtod", "dtoh")


class PlanError(ValueError):
    """A record that does not match its kernel, its buffers or the plan's data flow."""


# --------------------------------------------------------------------------------------------
# Kernel parameters
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Param:
    """One kernel parameter: ``name``, its C type, whether it is a pointer, ``const`` (read
    only) and its element (pointee or scalar) type."""

    name: str
    ctype: str
    pointer: bool
    const: bool
    element: str


def _param(ctype: str, name: str) -> Param:
    words = ctype.replace("*", " * ").split()
    pointer = "*" in words
    const = pointer and words[0] == "const"
    element = " ".join(w for w in words if w not in ("const", "*", "__restrict__", "volatile"))
    return Param(name, ctype, pointer, const, element)


@functools.lru_cache(maxsize=1)
def kernel_params() -> Mapping[str, tuple[Param, ...]]:
    """``{kernel: parameters}`` of every ``extern "C" __global__`` kernel in ``cuda_src``."""
    from foxhunt.fast.cuda_parse import package_kernels

    return MappingProxyType({name: tuple(_param(t, p) for t, p in decl.params)
                             for name, decl in package_kernels().items()})


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Buf:
    """A region of buffer ``name``: from the start of packed sub-buffer ``key`` (or of the
    buffer), plus ``offset`` elements; it runs to the end of the buffer."""

    name: str
    key: object = None
    offset: int = 0

    def __str__(self) -> str:
        key = "" if self.key is None else f"[{self.key!r}]"
        return f"{self.name}{key}" + (f"+{self.offset}" if self.offset else "")


@dataclass(frozen=True)
class Host:
    """A named host buffer (pinned memory on the GPU), the far side of a ``Copy``."""

    name: str

    def __str__(self) -> str:
        return f"host:{self.name}"


def as_buf(value) -> Buf | None:
    return Buf(value) if isinstance(value, str) else value


def _dim3(value, what: str, kernel: str) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
    if not 1 <= len(dims) <= 3 or any(not isinstance(d, (int, np.integer)) or int(d) < 1 for d in dims):
        raise PlanError(f"kernel {kernel}: {what} {value!r} is not 1 to 3 positive ints")
    return tuple(int(d) for d in dims) + (1,) * (3 - len(dims))


@dataclass(frozen=True)
class LaunchShape:
    """Grid and block (3 ints each) and dynamic shared memory bytes (cuda.core's LaunchConfig)."""

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int = 0

    @classmethod
    def of(cls, plan, kernel: str = "?") -> LaunchShape:
        """From a ``(grid, block, shared_mem)`` plan of ``foxhunt.fast.kernels.<area>``."""
        if isinstance(plan, LaunchShape):
            return plan
        grid, block, shared = plan
        if not isinstance(shared, (int, np.integer)) or shared < 0:
            raise PlanError(f"kernel {kernel}: shared memory {shared!r} is not a non-negative int")
        return cls(_dim3(grid, "grid", kernel), _dim3(block, "block", kernel), int(shared))


@dataclass(frozen=True)
class Access:
    """A region a record reads or writes: buffer, first byte, byte count."""

    buffer: str
    start: int
    nbytes: int
    write: bool
    what: str  # "kernel k parameter p" / "GEMM operand a": for messages


@dataclass(frozen=True)
class Launch:
    kernel: str
    shape: LaunchShape
    args: Mapping[str, object]  # parameter name -> Buf | None | scalar, in parameter order
    accesses: tuple[Access, ...] = field(default=(), compare=False, repr=False)

    def __str__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.args.items())
        return f"{self.kernel}<<<{self.shape.grid}, {self.shape.block}, {self.shape.shared_mem}>>>({args})"


@dataclass(frozen=True)
class Gemm:
    plan: object  # has .spec (a foxhunt.fast.gemm.GemmSpec)
    a: Buf
    b: Buf
    c: Buf
    bias: Buf | None = None
    aux: Buf | None = None
    accesses: tuple[Access, ...] = field(default=(), compare=False, repr=False)

    @property
    def spec(self):
        return self.plan.spec

    def __str__(self) -> str:
        s = self.spec
        return (f"gemm {s.precision} {s.m}x{s.n}x{s.k} ta={s.trans_a} tb={s.trans_b} "
                f"epilogue={s.epilogue}: c={self.c} a={self.a} b={self.b} bias={self.bias} aux={self.aux}")


@dataclass(frozen=True)
class Copy:
    dst: Buf | Host
    src: Buf | Host
    nbytes: int
    kind: str
    accesses: tuple[Access, ...] = field(default=(), compare=False, repr=False)

    def __str__(self) -> str:
        return f"copy {self.kind} {self.nbytes} bytes {self.src} -> {self.dst}"


@dataclass(frozen=True)
class Parallel:
    sides: tuple  # of Ops, each on its own forked stream
    main: object  # Ops, on the current stream


@dataclass(frozen=True)
class Record:
    event: str


@dataclass(frozen=True)
class Wait:
    event: str


NODE_RECORDS = (Launch, Gemm, Copy)


# --------------------------------------------------------------------------------------------
# Regions and the binder
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Region:
    """Where a ``Buf`` points: its buffer, dtype, first element and the elements up to the end
    of the buffer, and the buffer's role (``state``, ``scratch``, ``batch``, ``constant``)."""

    buffer: str
    dtype: np.dtype
    start: int  # elements from the buffer's first byte
    available: int
    role: str

    @property
    def byte_start(self) -> int:
        return self.start * self.dtype.itemsize


class Binder:
    """Checks records as they are made (module docstring).

    ``regions(buf) -> Region`` resolves a buffer name (raises ``KeyError`` for an unknown one);
    ``host_nbytes``: the host buffers' sizes; ``constants``: host values of the constant
    buffers (what an extent that depends on a table, e.g. ``n_actions``, reads);
    ``alignment(buf)``: the byte alignment of a region's first element (for GEMM plans).
    """

    def __init__(self, regions: Callable[[Buf], Region], *, constants: Mapping[str, np.ndarray],
                 host_nbytes: Mapping[str, int] = MappingProxyType({})):
        self.regions = regions
        self.constants = constants
        self.host_nbytes = dict(host_nbytes)

    # -- helpers
    def region(self, buf: Buf, what: str) -> Region:
        try:
            region = self.regions(buf)
        except KeyError as exc:
            raise PlanError(f"{what}: {exc.args[0] if exc.args else buf}") from None
        if region.available < 0:
            raise PlanError(f"{what}: {buf} starts past the end of buffer {buf.name!r}")
        return region

    def table(self, buf: Buf, count: int, dtype: np.dtype, what: str) -> np.ndarray:
        """``count`` values of a constant buffer at ``buf`` (for extents that read a table)."""
        region = self.region(buf, what)
        if region.role != "constant" or region.buffer not in self.constants:
            raise PlanError(f"{what}: its extent reads {buf}, which is not a constant buffer")
        flat = np.ascontiguousarray(self.constants[region.buffer]).reshape(-1).view(np.uint8)
        start = region.byte_start
        return flat[start:start + count * dtype.itemsize].view(dtype)

    # -- kernel launches
    def launch(self, kernel: str, plan, args: Mapping[str, object]) -> Launch:
        from foxhunt.fast.cpu_kernels import TWINS, Args, shape_of

        params = kernel_params().get(kernel)
        if params is None:
            raise PlanError(f"kernel {kernel}: no such kernel in cuda_src")
        twin = TWINS.get(kernel)
        if twin is None:
            raise PlanError(f"kernel {kernel}: no CPU twin in foxhunt.fast.cpu_kernels.TWINS")
        names = [p.name for p in params]
        missing = [n for n in names if n not in args]
        extra = [n for n in args if n not in names]
        if extra:
            raise PlanError(f"kernel {kernel}: no parameter {extra[0]!r} (parameters: {', '.join(names)})")
        if missing:
            raise PlanError(f"kernel {kernel}: parameter {missing[0]!r} is not bound")
        shape = LaunchShape.of(plan, kernel)
        bound: dict[str, object] = {}
        regions: dict[str, Region] = {}
        scalars: dict[str, object] = {}
        for p in params:
            value = as_buf(args[p.name])
            where = f"kernel {kernel}: parameter {p.name!r} ({p.ctype})"
            if p.pointer:
                if value is None:
                    if p.name not in twin.nullable:
                        raise PlanError(f"{where}: a null pointer is not allowed here")
                elif not isinstance(value, Buf):
                    raise PlanError(f"{where}: expected a buffer, got {value!r}")
                else:
                    region = self.region(value, where)
                    want = ELEMENT_DTYPES.get(p.element)
                    if want is None:
                        raise PlanError(f"{where}: element type {p.element!r} has no buffer dtype")
                    if region.dtype != want:
                        raise PlanError(f"{where}: bound to {value} of dtype {region.dtype}; "
                                        f"expected {want}")
                    if not p.const and region.role in READ_ONLY_ROLES:
                        raise PlanError(f"{where}: writes, but {value} is a read-only "
                                        f"{region.role} buffer")
                    regions[p.name] = region
            else:
                scalars[p.name] = value = _check_scalar(where, p, value)
            bound[p.name] = value
        # Extents: every bound region holds at least what the twin declares for its parameter.
        ns = Args(scalars, shape, table=lambda name, count, dtype: self.table(
            bound[name], count, dtype, f"kernel {kernel}: parameter {name!r}"))
        accesses = []
        for p in params:
            if p.name not in regions:
                continue
            region = regions[p.name]
            count = int(np.prod(shape_of(twin.extents[p.name], ns), dtype=np.int64))
            if count > region.available:
                raise PlanError(f"kernel {kernel}: parameter {p.name!r} needs {count} elements; "
                                f"{bound[p.name]} holds {region.available}")
            accesses.append(Access(region.buffer, region.byte_start, count * region.dtype.itemsize,
                                   not p.const, f"kernel {kernel} parameter {p.name!r}"))
        return Launch(kernel, shape, MappingProxyType(bound), tuple(accesses))

    # -- GEMMs
    def gemm(self, plan, *, a, b, c, bias=None, aux=None) -> Gemm:
        a, b, c, bias, aux = (as_buf(x) for x in (a, b, c, bias, aux))
        spec = plan.spec
        in_dtype = spec.input_dtype
        accesses = []

        def operand(name, buf, dtype, count, write):
            where = f"GEMM {spec.m}x{spec.n}x{spec.k} ({spec.epilogue}) operand {name}"
            if not isinstance(buf, Buf):
                raise PlanError(f"{where}: expected a buffer, got {buf!r}")
            region = self.region(buf, where)
            if region.dtype != dtype:
                raise PlanError(f"{where}: bound to {buf} of dtype {region.dtype}; expected {dtype}")
            if write and region.role in READ_ONLY_ROLES:
                raise PlanError(f"{where}: writes, but {buf} is a read-only {region.role} buffer")
            if count > region.available:
                raise PlanError(f"{where}: needs {count} elements; {buf} holds {region.available}")
            accesses.append(Access(region.buffer, region.byte_start, count * dtype.itemsize, write, where))

        def stored(shape, ld):
            return (shape[0] - 1) * ld + shape[1]

        operand("a", a, in_dtype, stored(spec.a_shape, spec.lda), False)
        operand("b", b, in_dtype, stored(spec.b_shape, spec.ldb), False)
        if spec.beta != 0.0:
            operand("c", c, F32, stored(spec.c_shape, spec.ldc), False)
        operand("c", c, F32, stored(spec.c_shape, spec.ldc), True)
        grad_epilogue = spec.epilogue in ("drelu_bgrad", "bgrada", "bgradb")
        if spec.bias_len is not None:
            operand("bias", bias, F32, spec.bias_len, grad_epilogue)
        elif bias is not None:
            raise PlanError(f"GEMM epilogue {spec.epilogue!r}: takes no bias, got {bias}")
        if spec.aux_ld is not None:
            operand("aux", aux, U8, spec.aux_nbytes, spec.epilogue == "relu_aux_bias")
        elif aux is not None:
            raise PlanError(f"GEMM epilogue {spec.epilogue!r}: takes no aux bitmask, got {aux}")
        return Gemm(plan, a, b, c, bias, aux, tuple(accesses))

    # -- copies
    def copy(self, dst, src, nbytes: int, kind: str) -> Copy:
        if kind not in COPY_KINDS:
            raise PlanError(f"copy kind {kind!r}: expected one of {', '.join(COPY_KINDS)}")
        dst, src = as_buf(dst), as_buf(src)
        sides = {"htod": (Buf, Host), "dtod": (Buf, Buf), "dtoh": (Host, Buf)}[kind]
        accesses = []
        for what, end, want, write in (("dst", dst, sides[0], True), ("src", src, sides[1], False)):
            where = f"copy {kind} {what}"
            if not isinstance(end, want):
                raise PlanError(f"{where}: expected a {want.__name__}, got {end!r}")
            if isinstance(end, Host):
                size = self.host_nbytes.get(end.name)
                if size is None:
                    raise PlanError(f"{where}: no host buffer {end.name!r}")
            else:
                region = self.region(end, where)
                if write and region.role == "constant":
                    raise PlanError(f"{where}: writes the constant buffer {end}")
                size = region.available * region.dtype.itemsize
                accesses.append(Access(region.buffer, region.byte_start, int(nbytes), write, where))
            if nbytes > size:
                raise PlanError(f"{where}: {nbytes} bytes do not fit {end} ({size} bytes)")
        return Copy(dst, src, int(nbytes), kind, tuple(accesses))


def _check_scalar(where: str, p: Param, value):
    kind = SCALAR_TYPES.get(p.element)
    if kind is None:
        raise PlanError(f"{where}: scalar type {p.element!r} is not supported")
    if isinstance(value, (Buf, Host)) or value is None:
        raise PlanError(f"{where}: a scalar parameter, got {value if value is not None else 'None'}")
    if isinstance(value, (bool, np.bool_)):
        raise PlanError(f"{where}: got the bool {value!r}; pass an int or a float")
    if kind[0] == "int":
        if not isinstance(value, (int, np.integer)):
            raise PlanError(f"{where}: expected an int, got {value!r}")
        if not kind[1] <= int(value) < kind[2]:
            raise PlanError(f"{where}: {value} does not fit")
        return int(value)
    if isinstance(value, np.floating) and value.dtype != F32:
        raise PlanError(f"{where}: expected a float32, got a {value.dtype}")
    if not isinstance(value, (float, np.floating)):
        raise PlanError(f"{where}: expected a float, got {value!r}")
    return np.float32(value)


# --------------------------------------------------------------------------------------------
# Ops: a list of records
# --------------------------------------------------------------------------------------------


class Ops:
    """A list of records made through ``binder`` (each checked as it is added).

    ``parallel(*branches)``: all but the last branch run on forked side streams, the last on
    this stream; everything is joined afterwards. ``record(event)`` / ``wait(event)``: a
    cross-branch dependency (a side records before a later sibling or the main branch waits:
    sides are walked first, then main).
    """

    def __init__(self, binder: Binder):
        self.binder = binder
        self.items: list = []

    def branch(self) -> Ops:
        """A new, empty list bound the same way (for ``parallel``)."""
        return Ops(self.binder)

    def kernel(self, name: str, plan, **args) -> None:
        self.items.append(self.binder.launch(name, plan, args))

    def gemm(self, plan, *, a, b, c, bias=None, aux=None) -> None:
        self.items.append(self.binder.gemm(plan, a=a, b=b, c=c, bias=bias, aux=aux))

    def copy(self, dst, src, nbytes: int, kind: str) -> None:
        self.items.append(self.binder.copy(dst, src, nbytes, kind))

    def parallel(self, *branches: Ops) -> None:
        if len(branches) < 2:
            raise PlanError(f"parallel: {len(branches)} branches; need at least 2")
        self.items.append(Parallel(tuple(branches[:-1]), branches[-1]))

    def record(self, event: str) -> None:
        self.items.append(Record(event))

    def wait(self, event: str) -> None:
        self.items.append(Wait(event))

    def extend(self, other: Ops) -> None:
        self.items.extend(other.items)

    def nodes(self) -> list:
        """The kernel, GEMM and copy records in walk order (sides before main)."""
        out = []
        for it in self.items:
            if isinstance(it, Parallel):
                for branch in (*it.sides, it.main):
                    out.extend(branch.nodes())
            elif isinstance(it, NODE_RECORDS):
                out.append(it)
        return out

    def node_count(self) -> int:
        return len(self.nodes())

    def branch_resources(self) -> tuple[int, int]:
        """``(side streams, events)`` one enqueue takes on the GPU."""
        streams = events = 0
        for it in self.items:
            if isinstance(it, Parallel):
                streams += len(it.sides)
                events += 1 + len(it.sides)
                for branch in (*it.sides, it.main):
                    s, e = branch.branch_resources()
                    streams, events = streams + s, events + e
            elif isinstance(it, Record):
                events += 1
        return streams, events

    def describe(self, indent: str = "") -> str:
        """The records, one a line, branches indented (for reading a plan)."""
        lines = []
        for it in self.items:
            if isinstance(it, Parallel):
                for k, branch in enumerate((*it.sides, it.main)):
                    label = "main" if k == len(it.sides) else f"side {k}"
                    lines.append(f"{indent}parallel {label}:")
                    lines.append(branch.describe(indent + "    "))
            elif isinstance(it, Record):
                lines.append(f"{indent}record {it.event}")
            elif isinstance(it, Wait):
                lines.append(f"{indent}wait {it.event}")
            else:
                lines.append(f"{indent}{it}")
        return "\n".join(line for line in lines if line)


# --------------------------------------------------------------------------------------------
# Dependency graph and data flow
# --------------------------------------------------------------------------------------------


def dependency_graph(graphs: list[Ops]) -> tuple[list, list[frozenset]]:
    """The nodes (kernel, GEMM and copy records) of ``graphs`` run one after the other, and
    each node's direct dependencies (indices), exactly as stream capture makes them: a node
    depends on its stream's frontier; ``parallel`` forks every side from the current frontier
    and joins all of them afterwards; ``wait`` adds the frontier ``record`` saw. Every node of
    a graph depends on every node of the graphs before it. An event recorded twice, or waited
    on before it is recorded, raises ``PlanError``."""
    nodes: list = []
    deps: list[frozenset] = []

    def walk(ops: Ops, frontier: frozenset, events: dict) -> frozenset:
        for it in ops.items:
            if isinstance(it, Parallel):
                ends = [walk(side, frontier, events) for side in it.sides]
                frontier = frontier.union(walk(it.main, frontier, events), *ends)
            elif isinstance(it, Record):
                if it.event in events:
                    raise PlanError(f"event {it.event!r} recorded twice")
                events[it.event] = frontier
            elif isinstance(it, Wait):
                if it.event not in events:
                    raise PlanError(f"wait on event {it.event!r} before it is recorded")
                frontier = frontier | events[it.event]
            else:
                nodes.append(it)
                deps.append(frontier)
                frontier = frozenset({len(nodes) - 1})
        return frontier

    before: frozenset = frozenset()
    for ops in graphs:
        first = len(nodes)
        walk(ops, before, {})
        before = before | frozenset(range(first, len(nodes)))
    return nodes, deps


def _covered(spans: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether the union of ``spans`` covers ``[start, end)``."""
    reach = start
    for lo, hi in sorted(spans):
        if lo > reach:
            break
        reach = max(reach, hi)
        if reach >= end:
            return True
    return reach >= end


def check_dataflow(graphs: list[Ops], role: Callable[[str], str],
                   preset: Mapping[str, list[tuple[int, int]]] = MappingProxyType({})) -> None:
    """Every scratch region a record of ``graphs`` (run in order) reads was written by a record
    it depends on (``dependency_graph``). State, batch and constant buffers hold values before
    the step, and so do the ``preset`` byte ranges ``{buffer: [(start, end), ...]}`` of scratch
    buffers (bytes no record writes, zero since the arena was made). Raises ``PlanError``
    naming the record that reads what none of its dependencies wrote: an input bound to the
    wrong buffer, or a missing dependency between parallel branches."""
    nodes, deps = dependency_graph(graphs)
    ancestors: list[int] = []
    writes: dict[str, list[tuple[int, int, int]]] = {}
    for i, node in enumerate(nodes):
        anc = 0
        for d in deps[i]:
            anc |= ancestors[d] | (1 << d)
        ancestors.append(anc)
        for acc in node.accesses:
            if acc.write or acc.nbytes == 0 or role(acc.buffer) != "scratch":
                continue
            spans = [(lo, hi) for j, lo, hi in writes.get(acc.buffer, ()) if anc >> j & 1]
            spans += preset.get(acc.buffer, [])
            if not _covered(spans, acc.start, acc.start + acc.nbytes):
                raise PlanError(f"{acc.what} reads bytes [{acc.start}, {acc.start + acc.nbytes}) "
                                f"of {acc.buffer!r}, which no record it depends on writes ({node})")
        for acc in node.accesses:
            if acc.write and acc.nbytes:
                writes.setdefault(acc.buffer, []).append((i, acc.start, acc.start + acc.nbytes))


__all__ = [
    "Access", "Binder", "Buf", "Copy", "Gemm", "Host", "Launch", "LaunchShape", "Ops",
    "Parallel", "Param", "PlanError", "Record", "Region", "Wait", "check_dataflow",
    "dependency_graph", "kernel_params",
]
