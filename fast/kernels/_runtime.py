"""Shared plumbing of the fast kernels' numpy-in/numpy-out test entries.

A test entry has the same name and signature as its reference twin; it copies its NumPy inputs
to the device, launches the kernel once on the runtime's stream, waits, and returns NumPy
outputs shaped like the reference's. Test entries are for conformance and debugging only: the
trainer launches kernels on arena pointers inside CUDA graphs and never goes through here.

``call(name, grid, block, *args)`` takes, per kernel parameter, one of:

- ``In(array)``: copied to a fresh device buffer, passed as its pointer;
- ``Out(shape, dtype)``: a fresh device buffer poisoned with 0xFF bytes (a NaN pattern for
  floats, so an element the kernel forgets to write shows up), read back after the launch;
- ``InOut(array)``: copied in, passed as a pointer, read back after the launch;
- a Python/NumPy scalar: passed by value (packed by the kernel's PTX parameter type).

It returns the read-back arrays of the ``Out``/``InOut`` arguments, in argument order. A launch
with more than ``SHARED_LIMIT`` bytes of dynamic shared memory first opts the kernel in to them
(``Kernel.set_max_dynamic_shared``), as the graph lowering does for a launch record.

Also here, shared by the area modules: the flat grid-stride launch plan (``plan_flat``), the
launch of a ``(grid, block, shared_mem)`` plan (``launch``), the 32-bit index limit
(``check_elements``), the blocks of a thread-block cluster (``cluster_blocks``) and the upload
of a scalar a kernel reads through a pointer (``device_scalar``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

#: Threads per block of the flat grid-stride kernels, and their grid cap (grid-stride loops
#: cover the rest): ~8 waves of 256-thread blocks on a 132-SM H200, so a launch never pays for
#: idle blocks.
FLAT_THREADS = 256
FLAT_MAX_BLOCKS = 4096
#: Elements per thread of the flat kernels' vector paths (``cuda_src/flat.cuh``: one float4 group
#: where the pointers are 16-byte aligned); their plans launch one thread per group.
FLAT_VEC_WIDTH = 4
#: The kernels index with 32-bit ints (grid-stride steps included): arrays stay below this.
MAX_ELEMENTS = 2**30
#: Dynamic shared memory a block gets without the kernel's opt-in attribute.
SHARED_LIMIT = 48 * 1024
#: Blocks of a ``cuda_src/cluster.cuh`` thread-block cluster on sm_90 and newer (its
#: ``FH_CLUSTER``: the portable size); 1 before sm_90, which has no clusters.
CLUSTER_SM90 = 8


@dataclass(frozen=True)
class In:
    array: np.ndarray


@dataclass(frozen=True)
class Out:
    shape: tuple
    dtype: object


@dataclass(frozen=True)
class InOut:
    array: np.ndarray


class Runtime:
    """Device 0, its stream, and every ``cuda_src`` kernel compiled for its architecture."""

    def __init__(self) -> None:
        from foxhunt.fast._build import package_module
        from foxhunt.fast.device import Device

        self.device = Device(0)
        self.module = self.device.load_module(package_module(self.device.arch))
        self.stream = self.device.stream


_runtime: Runtime | None = None
_lock = threading.Lock()


def runtime() -> Runtime:
    """The process-wide runtime, created on first use (raises ``NoCudaDeviceError`` without a GPU)."""
    global _runtime
    with _lock:
        if _runtime is None:
            _runtime = Runtime()
        return _runtime


def call(name: str, grid, block, *args, shared_mem: int = 0) -> tuple[np.ndarray, ...]:
    rt = runtime()
    dev = rt.device
    keep = []  # device allocations and host sources alive until the read-back
    launch_args = []
    reads = []
    for arg in args:
        if isinstance(arg, (In, InOut)):
            host = np.ascontiguousarray(arg.array)
            alloc = dev.alloc(max(host.nbytes, 4))
            dev.copy_to_device(alloc.ptr, host, wait=False)
            keep.extend((alloc, host))
            launch_args.append(alloc.ptr)
            if isinstance(arg, InOut):
                reads.append((alloc, host.shape, host.dtype))
        elif isinstance(arg, Out):
            dtype = np.dtype(arg.dtype)
            shape = tuple(int(s) for s in np.atleast_1d(arg.shape)) if arg.shape != () else ()
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            alloc = dev.alloc(max(nbytes, 4))
            dev.memset(alloc.ptr, 0xFF, max(nbytes, 4))
            keep.append(alloc)
            launch_args.append(alloc.ptr)
            reads.append((alloc, shape, dtype))
        else:
            launch_args.append(arg)
    # Copies, poison and launch are all ordered on the runtime's stream; the read-backs wait.
    kernel = rt.module.kernel(name)
    if shared_mem > SHARED_LIMIT:
        kernel.set_max_dynamic_shared(shared_mem)
    kernel.launch(grid, block, *launch_args, stream=rt.stream, shared_mem=shared_mem)
    outputs = [dev.copy_to_host(np.empty(shape, dtype), alloc.ptr) for alloc, shape, dtype in reads]
    for item in keep:
        if hasattr(item, "free"):
            item.free()
    return tuple(outputs)


def cluster_blocks(arch=None) -> int:
    """Blocks of a ``cluster.cuh`` cluster for ``arch`` (default: the test runtime's device): the
    ``FH_CLUSTER`` that the kernels compile in for it (``CLUSTER_SM90`` from sm_90, else 1)."""
    from foxhunt.fast._build import normalize_arch

    if arch is None:
        arch = runtime().device.arch
    return CLUSTER_SM90 if normalize_arch(arch) >= 90 else 1


def blocks(n: int, threads: int) -> int:
    """Blocks of ``threads`` covering ``n`` items (at least 1)."""
    return max(1, -(-int(n) // threads))


def plan_flat(n: int) -> tuple:
    """A flat grid-stride launch over ``n`` elements: ``((grid,), (FLAT_THREADS,), 0)``."""
    return (min(blocks(n, FLAT_THREADS), FLAT_MAX_BLOCKS),), (FLAT_THREADS,), 0


def launch(name: str, plan: tuple, *args) -> tuple[np.ndarray, ...]:
    """``call`` with a ``(grid, block, shared_mem)`` plan."""
    grid, block, shared_mem = plan
    return call(name, grid, block, *args, shared_mem=shared_mem)


def check_elements(name: str, x: np.ndarray) -> None:
    """Raise unless ``x`` has fewer than ``MAX_ELEMENTS`` elements (the kernels' 32-bit indices)."""
    if x.size >= MAX_ELEMENTS:
        raise ValueError(
            f"{name}: {x.size} elements is not allowed; the fast kernels index with 32-bit ints "
            f"(expected fewer than {MAX_ELEMENTS})"
        )


def device_scalar(value, dtype=np.float32) -> In:
    """A scalar the kernel reads through a pointer (one ``dtype`` element on the device)."""
    return In(np.array([value], dtype=dtype))
