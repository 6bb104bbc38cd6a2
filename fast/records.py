"""Launch records: the fast step's plan as data (SPEC 9, "The plan is data").

A plan is an ``Ops`` list of records, each checked when it is added (``foxhunt.fast.binder``):

- ``Launch(kernel, shape, args)``: a kernel of ``cuda_src``, every argument bound by the
  kernel's own parameter name (read from the source by ``foxhunt.fast.cuda_parse``;
  ``kernel_params``) to a region of a named buffer (``Buf``; a ``str`` is short for
  ``Buf(name)``), ``None`` (a null pointer, where the kernel's twin declares the parameter
  nullable) or a scalar; ``shape`` is the launch configuration (grid, block, dynamic shared
  memory: cuda.core's ``LaunchConfig``).
- ``Gemm(plan, a, b, c, bias, aux)``: a planned GEMM (``plan.spec`` is its ``GemmSpec``) with
  its operands by name.
- ``Copy(dst, src, nbytes, kind)``: an async copy between a buffer and a named host buffer
  (``Host``, pinned memory on the GPU) or two buffers.
- ``Parallel(sides, main)``, ``Record(event)``, ``Wait(event)``: the branch structure (the GPU
  forks side streams and joins them; both executors share ``dataflow.dependency_graph``).

Each record carries the regions it reads and writes (``Access``), from which
``dataflow.check_dataflow`` checks the whole plan once it is built.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

F32 = np.dtype(np.float32)
U16 = np.dtype(np.uint16)
I32 = np.dtype(np.int32)
I64 = np.dtype(np.int64)
U64 = np.dtype(np.uint64)
U8 = np.dtype(np.uint8)



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
    #: Batch 1's ``(operand, buffer)`` pairs of a plan with per-operand strides
    #: (``Binder.gemm``), else empty.
    second: tuple[tuple[str, Buf], ...] = ()
    accesses: tuple[Access, ...] = field(default=(), compare=False, repr=False)

    @property
    def spec(self):
        return self.plan.spec

    def __str__(self) -> str:
        s = self.spec
        return (f"gemm {s.precision} {s.m}x{s.n}x{s.k} ta={s.trans_a} tb={s.trans_b} "
                f"epilogue={s.epilogue}: c={self.c} a={self.a} b={self.b} bias={self.bias} aux={self.aux}"
                + (" batch 1: " + " ".join(f"{k}={v}" for k, v in self.second)
                   if self.second else ""))


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
# Regions
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


# --------------------------------------------------------------------------------------------
# Ops: a list of records
# --------------------------------------------------------------------------------------------


class Ops:
    """A list of records made through ``binder`` (a ``foxhunt.fast.binder.Binder``: each record
    is checked as it is added).

    ``parallel(*branches)``: all but the last branch run on forked side streams, the last on
    this stream; everything is joined afterwards. ``record(event)`` / ``wait(event)``: a
    cross-branch dependency (a side records before a later sibling or the main branch waits:
    sides are walked first, then main).
    """

    def __init__(self, binder):
        self.binder = binder
        self.items: list = []

    def branch(self) -> Ops:
        """A new, empty list bound the same way (for ``parallel``)."""
        return Ops(self.binder)

    def kernel(self, name: str, plan, **args) -> None:
        self.items.append(self.binder.launch(name, plan, args))

    def gemm(self, plan, *, a, b, c, bias=None, aux=None, second=None) -> None:
        self.items.append(self.binder.gemm(plan, a=a, b=b, c=c, bias=bias, aux=aux, second=second))

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


__all__ = [
    "Access", "Buf", "Copy", "Gemm", "Host", "Launch", "LaunchShape", "NODE_RECORDS", "Ops",
    "Parallel", "Param", "PlanError", "Record", "Region", "Wait", "as_buf", "kernel_params",
]
