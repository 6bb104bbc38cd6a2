"""Records to CUDA work: resolve a plan's names to device addresses and enqueue it on a stream.

``Lowering(module, address, host)``: ``address(buf)`` is a region's device address,
``host[name]`` a pinned host buffer. ``enqueue(ops, stream, pool)`` issues the records in walk
order on ``stream``, eagerly or inside a ``GraphCapture`` (where they become graph nodes):
a kernel record is packed once (its arguments in the kernel's parameter order) and launched, a
GEMM record runs its plan on the resolved operands, a copy is the matching driver copy;
``parallel`` forks side streams from ``pool`` off an event and joins them back, ``record`` /
``wait`` become events (edges, in a capture). The CPU executor builds the same edges
(``dataflow.dependency_graph``).

A copy's host end is a raw address the DMA engine writes (or reads) whenever the graph runs, so
each one is checked as it is resolved (``host_arrays``): the buffer exists, is C-contiguous
(writeable when written), is page-locked (``device.pinned_block``) and holds the copy's bytes
inside its block. The owner of a captured graph passes ``host_arrays(ops)`` to
``GraphCapture.hold``: the graph keeps them alive as long as it can be launched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping

import numpy as np

from foxhunt.fast.cuda_parse import package_kernels
from foxhunt.fast.records import (
    Buf,
    Copy,
    Gemm,
    Host,
    Launch,
    Ops,
    Parallel,
    Record,
    Wait,
    kernel_params,
)

#: ``Copy`` kinds and the driver call each enqueues.
COPY_FUNCTIONS = {"htod": "cuMemcpyHtoDAsync", "dtod": "cuMemcpyDtoDAsync", "dtoh": "cuMemcpyDtoHAsync"}
#: Dynamic shared memory above this needs the kernel's opt-in attribute.
DEFAULT_SHARED_LIMIT = 48 * 1024
#: Kernels launched early on sm_90 and newer (programmatic dependent launch: ``Kernel.launch``'s
#: ``early``): scheduled while the kernel before them on the stream still runs. They are the
#: kernels whose first statement is ``fh_early_wait()`` (``cuda_src/early_launch.cuh``;
#: ``cuda_parse.KernelDecl.early``), so none reads or writes anything before its predecessors
#: are done: every kernel of the step's graphs (tests/test_early_launch.py).
EARLY_LAUNCH = frozenset(name for name, decl in package_kernels().items() if decl.early)


class BranchPool:
    """Side streams and events for the fork/join sections of a plan (created on demand,
    reused by every enqueue; ``reset()`` before each top-level enqueue).

    A stream is never handed out twice within one enqueue: a reused stream would order its
    new work after its old work, a false dependency between branches that are meant to run
    concurrently. Events are reused freely (a wait binds to the event's latest record)."""

    def __init__(self):
        self.streams: list = []
        self.events: list = []
        self._s = self._e = 0

    def reset(self) -> None:
        self._s = self._e = 0

    def reserve(self, ops: Ops) -> None:
        """Create what enqueueing ``ops`` takes, up front (not during a graph capture)."""
        streams, events = ops.branch_resources()
        self.reset()
        for _ in range(streams):
            self.stream()
        for _ in range(events):
            self.event()
        self.reset()

    def stream(self):
        from foxhunt.fast.device import Stream, _driver, call

        if self._s == len(self.streams):
            drv = _driver()
            self.streams.append(Stream(call(drv.cuStreamCreate,
                                            drv.CUstream_flags.CU_STREAM_NON_BLOCKING.value)))
        self._s += 1
        return self.streams[self._s - 1]

    def event(self):
        from foxhunt.fast.device import _driver, call

        if self._e == len(self.events):
            drv = _driver()
            self.events.append(call(drv.cuEventCreate, drv.CUevent_flags.CU_EVENT_DISABLE_TIMING.value))
        self._e += 1
        return self.events[self._e - 1]

    def close(self) -> None:
        from foxhunt.fast.device import _driver

        for s in self.streams:
            s.close()
        for e in self.events:
            _driver().cuEventDestroy(e)
        self.streams, self.events = [], []


def layered_address(pairs, fallback: Callable[[Buf], int]) -> Callable[[Buf], int]:
    """The device address of a record's buffer for a plan with its own arenas beside the
    engine's: the first ``(table, arena)`` of ``pairs`` whose table names the buffer (the arena's
    pointer to the table's region), else ``fallback`` (the engine's own buffers)."""
    pairs = tuple(pairs)

    def address(buf: Buf) -> int:
        for table, arena in pairs:
            if buf.name in table:
                region = table.region(buf)
                return arena.ptr(region.buffer) + region.byte_start
        return fallback(buf)

    return address


class Lowering:
    """Resolves and enqueues records (module docstring)."""

    def __init__(self, module, address: Callable[[Buf], int], host: Mapping[str, np.ndarray]):
        from foxhunt.fast._build import normalize_arch

        self.module = module
        #: Programmatic dependent launches exist from sm_90 (``EARLY_LAUNCH``).
        device = getattr(module, "device", None)
        self.early_launch = device is not None and normalize_arch(device.arch) >= 90
        self.address = address
        self.host = host
        self._packed: dict[int, tuple] = {}  # id(Launch) -> (kernel, PackedArgs, record)

    @contextlib.contextmanager
    def early_launches(self, on: bool):
        """Inside the block, kernels are launched early (``EARLY_LAUNCH``) only if ``on`` and the
        device has programmatic dependent launches; after it, as before."""
        before = self.early_launch
        self.early_launch = before and bool(on)
        try:
            yield
        finally:
            self.early_launch = before

    def _end(self, end, nbytes: int, write: bool) -> int:
        return self._host(end, nbytes, write).ctypes.data if isinstance(end, Host) else self.address(end)

    def _host(self, end: Host, nbytes: int, write: bool) -> np.ndarray:
        """The host array of copy end ``end``, checked (module docstring)."""
        from foxhunt.fast.device import pinned_block

        where = f"copy {'to' if write else 'from'} host buffer {end.name!r}"
        array = self.host.get(end.name)
        if not isinstance(array, np.ndarray):
            raise ValueError(f"{where}: no such host array; host buffers: {sorted(self.host)}")
        if not array.flags.c_contiguous or (write and not array.flags.writeable):
            raise ValueError(f"{where}: the array must be C-contiguous{' and writeable' if write else ''}")
        if nbytes > array.nbytes:
            raise ValueError(f"{where}: {nbytes} bytes do not fit its {array.nbytes} bytes")
        block = pinned_block(array)
        if block is None or not block.contains(array.ctypes.data, nbytes):
            raise ValueError(f"{where}: not page-locked memory (Device.pinned_empty); a graph's copy "
                             "needs a pinned buffer that it holds")
        return array

    def host_arrays(self, ops: Ops) -> list[np.ndarray]:
        """The host arrays the copies of ``ops`` read or write (each checked, each once), for
        ``GraphCapture.hold``."""
        arrays: dict[int, np.ndarray] = {}
        for node in ops.nodes():
            if isinstance(node, Copy):
                for end, write in ((node.dst, True), (node.src, False)):
                    if isinstance(end, Host):
                        array = self._host(end, node.nbytes, write)
                        arrays[id(array)] = array
        return list(arrays.values())

    def packed(self, node: Launch):
        """``(kernel, packed arguments)`` of a launch record (packed once)."""
        cached = self._packed.get(id(node))
        if cached is None:
            kernel = self.module.kernel(node.kernel)
            if node.shape.shared_mem > DEFAULT_SHARED_LIMIT:
                kernel.set_max_dynamic_shared(node.shape.shared_mem)
            values = []
            for p in kernel_params()[node.kernel]:
                value = node.args[p.name]
                values.append((0 if value is None else self.address(value)) if p.pointer else value)
            cached = self._packed[id(node)] = (kernel, kernel.pack(*values, *self.extra_args(node)),
                                               node)
        return cached[0], cached[1]

    def extra_args(self, node: Launch) -> tuple:
        """Arguments after the kernel's own (none here; the population's member build takes
        two more: ``population.PopulationLowering``)."""
        return ()

    def launch(self, node: Launch, stream) -> None:
        """Enqueue one kernel record on ``stream`` (early where ``EARLY_LAUNCH`` says so)."""
        kernel, packed = self.packed(node)
        kernel.launch(node.shape.grid, node.shape.block, packed, stream=stream,
                      shared_mem=node.shape.shared_mem,
                      early=self.early_launch and node.kernel in EARLY_LAUNCH)

    def copy(self, node: Copy, handle) -> None:
        """Enqueue one copy record on the stream ``handle``."""
        from foxhunt.fast.device import _driver, call

        call(getattr(_driver(), COPY_FUNCTIONS[node.kind]), self._end(node.dst, node.nbytes, True),
             self._end(node.src, node.nbytes, False), node.nbytes, handle)

    def prepare(self, ops: Ops) -> None:
        """Pack every launch of ``ops`` now (kernel lookups and attributes outside a capture)."""
        for node in ops.nodes():
            if isinstance(node, Launch):
                self.packed(node)

    def enqueue(self, ops: Ops, stream, pool: BranchPool | None = None, _events: dict | None = None,
                *, captured: list | None = None) -> None:
        """Issue ``ops`` on ``stream`` (module docstring). ``captured`` (inside a capture): a
        list that gets, per kernel, GEMM and copy record in walk order (``Ops.nodes()``'s), the
        graph nodes its stream's next node would depend on right after it (``capture_frontier``:
        the record's last node)."""
        from foxhunt.fast.device import _driver, as_stream_handle, call
        from foxhunt.fast.graphs import capture_frontier

        drv = _driver()
        if _events is None:
            _events = {}
            if pool is not None:
                pool.reset()
        handle = as_stream_handle(stream)
        for it in ops.items:
            if isinstance(it, (Launch, Gemm, Copy)):
                if isinstance(it, Launch):
                    self.launch(it, stream)
                elif isinstance(it, Gemm):
                    it.plan.run(self.address(it.a), self.address(it.b), self.address(it.c),
                                bias_ptr=None if it.bias is None else self.address(it.bias),
                                aux_ptr=None if it.aux is None else self.address(it.aux),
                                stream=stream)
                else:
                    self.copy(it, handle)
                if captured is not None:
                    captured.append(capture_frontier(handle))
            elif isinstance(it, Parallel):
                if pool is None:
                    raise ValueError("enqueue: a parallel section needs a BranchPool")
                fork = pool.event()
                call(drv.cuEventRecord, fork, handle)
                joins = []
                for side in it.sides:
                    side_stream = pool.stream()
                    call(drv.cuStreamWaitEvent, side_stream.handle, fork, 0)
                    self.enqueue(side, side_stream, pool, _events, captured=captured)
                    join = pool.event()
                    call(drv.cuEventRecord, join, side_stream.handle)
                    joins.append(join)
                self.enqueue(it.main, stream, pool, _events, captured=captured)
                for join in joins:
                    call(drv.cuStreamWaitEvent, handle, join, 0)
            elif isinstance(it, Record):
                if it.event in _events:
                    raise ValueError(f"event {it.event!r} recorded twice")
                if pool is None:
                    raise ValueError("enqueue: events need a BranchPool")
                _events[it.event] = ev = pool.event()
                call(drv.cuEventRecord, ev, handle)
            elif isinstance(it, Wait):
                if it.event not in _events:
                    raise ValueError(f"wait on event {it.event!r} before it is recorded")
                call(drv.cuStreamWaitEvent, handle, _events[it.event], 0)
            else:  # pragma: no cover - records.Ops holds only the kinds above
                raise AssertionError(type(it))


__all__ = ["BranchPool", "COPY_FUNCTIONS", "Lowering", "layered_address"]
