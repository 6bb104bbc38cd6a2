"""The GPU context, streams, one-allocation arenas, pinned host memory and kernel launches.

Everything talks to the CUDA driver through ``cuda.bindings.driver``, imported lazily: this
module imports (and ``cuda_available()`` answers) on a machine with no driver and no
cuda-python; constructing a ``Device`` there raises ``NoCudaDeviceError`` saying why.

- ``Device(ordinal)``: the device's primary context (shared with cuBLAS and any other runtime
  API user in the process), made current, and one non-blocking stream ``device.stream``.
- ``Arena`` (``foxhunt.fast.arena``, re-exported here): ONE device allocation carved into
  named, 256-byte aligned sub-buffers.
- ``PinnedScalars(device, slots)``: page-locked, device-mapped host memory: kernels write
  through ``device_ptr(name)``, the host reads ``read(name)`` after a stream sync, with no copy.
- ``LoadedModule`` / ``Kernel`` (``foxhunt.fast.kernel_launch``, re-exported here): a compiled
  ``foxhunt.fast._build.Module`` loaded into the context, and its kernels' launches.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

ALIGNMENT = 256  # bytes; cuBLAS(Lt)'s default operand alignment and a full L2 sector group


class SyncCounter:
    """Host synchronisations issued through the device layer (stream and context syncs,
    synchronous copies; the CPU executor counts the same points): tests count them to show
    that the training loop synchronises only at its readback points."""

    def __init__(self) -> None:
        self.count = 0

    def note(self) -> None:
        self.count += 1


#: The process's synchronisation counter (``SYNCS.count``).
SYNCS = SyncCounter()


class NoCudaDeviceError(RuntimeError):
    """No usable CUDA driver or device (or cuda-python is not installed)."""


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error."""


# --------------------------------------------------------------------------------------------
# Driver access
# --------------------------------------------------------------------------------------------


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise NoCudaDeviceError(
            "cuda-python (cuda.bindings) is not installed; install foxhunt[gpu] to use the "
            f"fast path ({exc})"
        ) from exc
    return driver


def _error_text(drv, err) -> str:
    try:
        _, name = drv.cuGetErrorName(err)
        _, text = drv.cuGetErrorString(err)
        return f"{name.decode()}: {text.decode()}"
    except Exception:  # noqa: BLE001 - best effort, the code itself is still reported
        return repr(err)


def call(fn, *args):
    """Call a ``cuda.bindings.driver`` function; raise ``CudaError`` unless it succeeded.

    Returns the outputs after the status: nothing, one value, or a tuple.
    """
    drv = _driver()
    result = fn(*args)
    err, values = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
    if err != drv.CUresult.CUDA_SUCCESS:
        raise CudaError(f"{fn.__name__} failed with {_error_text(drv, err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


@functools.lru_cache(maxsize=1)
def cuda_available() -> tuple[bool, str]:
    """``(True, description)`` when a CUDA driver and at least one device are usable, else
    ``(False, reason)``. Never raises; the answer is cached for the process."""
    try:
        drv = _driver()
    except NoCudaDeviceError as exc:
        return False, str(exc)
    try:
        (err,) = drv.cuInit(0)
    except Exception as exc:  # noqa: BLE001 - libcuda missing surfaces as various errors
        return False, f"the NVIDIA driver library (libcuda) could not be loaded: {exc}"
    if err != drv.CUresult.CUDA_SUCCESS:
        return False, f"cuInit failed with {_error_text(drv, err)}"
    err, count = drv.cuDeviceGetCount()
    if err != drv.CUresult.CUDA_SUCCESS or count == 0:
        return False, "the CUDA driver reports no device"
    err, version = drv.cuDriverGetVersion()
    return True, f"{count} CUDA device(s), driver API {version // 1000}.{version % 1000 // 10}"


def _require_cuda() -> None:
    ok, reason = cuda_available()
    if not ok:
        raise NoCudaDeviceError(
            f"no CUDA device/driver was found ({reason}); the fast backend needs an NVIDIA GPU "
            "(sm_80 or newer). Use the reference backend on this machine."
        )


def default_arch(ordinal: int = 0) -> str:
    """``"sm_XY"`` of CUDA device ``ordinal`` (no context is created)."""
    _require_cuda()
    drv = _driver()
    dev = call(drv.cuDeviceGet, ordinal)
    attr = drv.CUdevice_attribute
    major = call(drv.cuDeviceGetAttribute, attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
    minor = call(drv.cuDeviceGetAttribute, attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
    return f"sm_{major}{minor}"


# --------------------------------------------------------------------------------------------
# Device and streams
# --------------------------------------------------------------------------------------------


class Stream:
    """A CUDA stream: ``handle`` (``CUstream``) and ``ptr`` (its address as an int, what
    cuBLASLt takes)."""

    def __init__(self, handle, owned: bool = True):
        self.handle = handle
        self.ptr = int(handle)
        self._owned = owned

    def __int__(self) -> int:
        return self.ptr

    def synchronize(self) -> None:
        SYNCS.note()
        call(_driver().cuStreamSynchronize, self.handle)

    def is_capturing(self) -> bool:
        drv = _driver()
        status = call(drv.cuStreamIsCapturing, self.handle)
        return status != drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE

    def close(self) -> None:
        if self._owned and self.handle is not None:
            call(_driver().cuStreamDestroy, self.handle)
            self.handle = None


def as_stream_handle(stream):
    """A ``Stream``, raw ``CUstream`` or int -> ``CUstream``."""
    drv = _driver()
    if isinstance(stream, Stream):
        return stream.handle
    if isinstance(stream, int):
        return drv.CUstream(stream)
    return stream


class Device:
    """One CUDA device: its primary context (made current) and a non-blocking stream.

    Attributes: ``ordinal``, ``name``, ``compute_capability`` ``(major, minor)``, ``arch``
    (``"sm_90"``), ``multiprocessor_count``, ``stream``.
    """

    def __init__(self, ordinal: int = 0):
        _require_cuda()
        drv = _driver()
        count = call(drv.cuDeviceGetCount)
        if not 0 <= ordinal < count:
            raise ValueError(f"ordinal: {ordinal} is not a CUDA device; {count} device(s) exist")
        self.ordinal = ordinal
        self.handle = call(drv.cuDeviceGet, ordinal)
        attr = drv.CUdevice_attribute
        major = call(drv.cuDeviceGetAttribute,
                     attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.handle)
        minor = call(drv.cuDeviceGetAttribute,
                     attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.handle)
        self.compute_capability = (int(major), int(minor))
        self.arch = f"sm_{major}{minor}"
        self.multiprocessor_count = int(call(
            drv.cuDeviceGetAttribute, attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self.handle))
        self.name = call(drv.cuDeviceGetName, 256, self.handle).split(b"\0")[0].decode()
        self.context = call(drv.cuDevicePrimaryCtxRetain, self.handle)
        self.make_current()
        self.stream = self.new_stream()

    def make_current(self) -> None:
        call(_driver().cuCtxSetCurrent, self.context)

    def new_stream(self) -> Stream:
        drv = _driver()
        return Stream(call(drv.cuStreamCreate, drv.CUstream_flags.CU_STREAM_NON_BLOCKING.value))

    def synchronize(self) -> None:
        """Wait for all work in the context (every stream)."""
        SYNCS.note()
        call(_driver().cuCtxSynchronize)

    def alloc(self, nbytes: int) -> DeviceAllocation:
        return DeviceAllocation(self, nbytes)

    # Raw-pointer copies, ordered on a stream (default ``self.stream``). The synchronous driver
    # calls (cuMemcpyHtoD, cuMemsetD8) run on the legacy default stream, which does NOT order
    # with the non-blocking streams used here: never mix them with kernels on ``self.stream``.

    def copy_to_device(self, dst_ptr: int, host: np.ndarray, stream=None, *, wait: bool = True) -> None:
        """Copy a C-contiguous host array to ``dst_ptr`` on ``stream``; ``wait`` syncs it."""
        host = np.ascontiguousarray(host)
        stream = self.stream if stream is None else stream
        if host.nbytes:
            call(_driver().cuMemcpyHtoDAsync, int(dst_ptr), host.ctypes.data, host.nbytes,
                 as_stream_handle(stream))
        if wait:
            SYNCS.note()
            call(_driver().cuStreamSynchronize, as_stream_handle(stream))

    def copy_to_host(self, out: np.ndarray, src_ptr: int, stream=None, *, wait: bool = True) -> np.ndarray:
        """Copy ``out.nbytes`` bytes from ``src_ptr`` into the C-contiguous host array ``out``.
        With ``wait=False`` and a pinned ``out`` the copy lands later: the caller keeps ``out``
        alive until it has synchronised ``stream``."""
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError("out: the host array must be C-contiguous and writeable")
        stream = self.stream if stream is None else stream
        if out.nbytes:
            call(_driver().cuMemcpyDtoHAsync, out.ctypes.data, int(src_ptr), out.nbytes,
                 as_stream_handle(stream))
        if wait:
            SYNCS.note()
            call(_driver().cuStreamSynchronize, as_stream_handle(stream))
        return out

    def memset(self, ptr: int, byte: int, nbytes: int, stream=None) -> None:
        """Fill ``nbytes`` bytes at ``ptr`` with ``byte``, ordered on ``stream`` (no sync)."""
        stream = self.stream if stream is None else stream
        if nbytes:
            call(_driver().cuMemsetD8Async, int(ptr), int(byte) & 0xFF, int(nbytes),
                 as_stream_handle(stream))

    def load_module(self, module):
        """``module`` (a ``foxhunt.fast._build.Module``) loaded into this context
        (``kernel_launch.LoadedModule``)."""
        from foxhunt.fast.kernel_launch import LoadedModule

        return LoadedModule(self, module)

    def pinned_empty(self, shape, dtype, *, write_combined: bool = False) -> np.ndarray:
        """A page-locked host array (for asynchronous copies), zero-filled. ``write_combined``:
        allocated write-combined (``CU_MEMHOSTALLOC_WRITECOMBINED``): the host's writes bypass
        its caches, so a device copy from it does not wait on them, but the host's reads of it
        are uncached and slow: for buffers the host only writes (the step's staging ring)."""
        shape, dtype = _check_shape_dtype("shape", shape, dtype)
        if not isinstance(write_combined, (bool, np.bool_)):
            raise ValueError(f"write_combined={write_combined!r}: must be a bool")
        nbytes = max(1, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
        host = _PinnedHost(self, nbytes, mapped=False, write_combined=bool(write_combined))
        return host.view(0, shape, dtype)

    def __repr__(self) -> str:
        return f"Device({self.ordinal}: {self.name}, {self.arch})"


# --------------------------------------------------------------------------------------------
# Releases from finalizers while a graph is being captured
# --------------------------------------------------------------------------------------------
# A stream capture (``graphs.GraphCapture``, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) is invalidated
# by any unsafe call of the capturing thread: cuMemFree, cuMemFreeHost, a cuBLASLt descriptor's
# destroy. The garbage collector runs finalizers (``__del__``) at arbitrary points of that
# thread, a capture included: a previous trainer's buffer freed in the middle of graph 1's
# capture made it fail later with CUDA_ERROR_STREAM_CAPTURE_INVALIDATED (seen on the H200,
# intermittently, in the conformance and GPU test suites). So finalizers go through
# ``release``, which defers the call while any capture is open and runs it when the last one
# ends.
_CAPTURES = [0]  # open captures (a list: mutated in place, no ``global``)
_DEFERRED: list = []  # (function, args) released when the last capture ends


def capture_begins() -> None:
    _CAPTURES[0] += 1


def capture_ends() -> None:
    """Close one capture; after the last, run the deferred releases (errors ignored, as in the
    finalizers that asked for them)."""
    _CAPTURES[0] = max(0, _CAPTURES[0] - 1)
    while not _CAPTURES[0] and _DEFERRED:
        fn, args = _DEFERRED.pop()
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - a finalizer's release: nothing to report to
            pass


def release(fn, *args) -> None:
    """``fn(*args)`` now, or when the last open capture ends (a finalizer's free or destroy)."""
    if _CAPTURES[0]:
        _DEFERRED.append((fn, args))
    else:
        fn(*args)


class DeviceAllocation:
    """One ``cuMemAlloc`` block: ``ptr`` (int) and ``nbytes``; ``free()`` (also on GC)."""

    def __init__(self, device: Device, nbytes: int):
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes: {nbytes!r} is not a positive int")
        self.device = device
        self.nbytes = nbytes
        device.make_current()
        self._handle = call(_driver().cuMemAlloc, nbytes)
        self.ptr = int(self._handle)

    def free(self) -> None:
        if self._handle is not None:
            call(_driver().cuMemFree, self._handle)
            self._handle = None
            self.ptr = 0

    def __del__(self):
        try:
            if self._handle is not None:
                release(call, _driver().cuMemFree, self._handle)
                self._handle = None
        except Exception:  # noqa: BLE001 - interpreter shutdown or a dead context
            pass


# --------------------------------------------------------------------------------------------
# Shapes (shared with the arena)
# --------------------------------------------------------------------------------------------


def _round_up(value: int, base: int) -> int:
    return (value + base - 1) // base * base


def _check_shape_dtype(what: str, shape, dtype):
    if isinstance(shape, (int, np.integer)):
        shape = (int(shape),)
    try:
        shape = tuple(int(s) for s in shape)
    except TypeError:
        raise ValueError(f"{what}: {shape!r} is not a shape (a tuple of ints)") from None
    if any(s < 0 for s in shape):
        raise ValueError(f"{what}: {shape} has a negative dimension")
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype: {dtype!r} is not a NumPy dtype") from None
    if dtype.hasobject:
        raise ValueError(f"dtype: {dtype} holds Python objects; only plain numbers can live on the GPU")
    return shape, dtype


# --------------------------------------------------------------------------------------------
# Pinned host memory
# --------------------------------------------------------------------------------------------


class _PinnedHost:
    """One ``cuMemHostAlloc`` block; freed when the last NumPy view of it is gone."""

    def __init__(self, device: Device, nbytes: int, mapped: bool, write_combined: bool = False):
        drv = _driver()
        device.make_current()
        flags = (drv.CU_MEMHOSTALLOC_PORTABLE | (drv.CU_MEMHOSTALLOC_DEVICEMAP if mapped else 0)
                 | (drv.CU_MEMHOSTALLOC_WRITECOMBINED if write_combined else 0))
        self.write_combined = write_combined
        self.nbytes = nbytes
        self.host_ptr = int(call(drv.cuMemHostAlloc, nbytes, flags))
        ctypes.memset(self.host_ptr, 0, nbytes)
        self.device_ptr = int(call(drv.cuMemHostGetDevicePointer, self.host_ptr, 0)) if mapped else 0

    def view(self, offset: int, shape, dtype) -> np.ndarray:
        count = int(np.prod(shape, dtype=np.int64))
        if offset < 0 or offset + count * dtype.itemsize > self.nbytes:
            raise ValueError(f"view: {count * dtype.itemsize} bytes at offset {offset} overrun the "
                             f"{self.nbytes}-byte pinned block")
        raw = (ctypes.c_char * max(count * dtype.itemsize, 1)).from_address(self.host_ptr + offset)
        raw._owner = self  # the array's base keeps this allocation alive
        return np.frombuffer(raw, dtype=dtype, count=count).reshape(shape)

    def contains(self, address: int, nbytes: int) -> bool:
        """Whether bytes ``[address, address + nbytes)`` lie inside this block."""
        return self.host_ptr <= address and address + nbytes <= self.host_ptr + self.nbytes

    def __del__(self):
        # Only once no view is left, and a graph that copies to or from the block holds a view
        # (``GraphCapture.hold``) until it is closed and its last launch has finished.
        try:
            release(call, _driver().cuMemFreeHost, self.host_ptr)
        except Exception:  # noqa: BLE001
            pass


def pinned_block(array) -> _PinnedHost | None:
    """The page-locked block behind ``array`` (a view, at any depth, of memory from
    ``Device.pinned_empty`` or ``PinnedScalars``), or None for ordinary pageable memory."""
    obj = array
    while obj is not None:
        owner = getattr(obj, "_owner", None)
        if isinstance(owner, _PinnedHost):
            return owner
        obj = getattr(obj, "base", None)
    return None


class PinnedScalars:
    """Named slots of page-locked, device-mapped host memory for readback without copies.

    ``slots``: ``{name: dtype}`` or ``{name: (dtype, count)}``. Kernels write through
    ``device_ptr(name)``; after the stream is synchronised the host reads ``read(name)`` (a
    copy) or ``host(name)`` (a live view). Slots are 16-byte aligned; all start at zero.
    """

    SLOT_ALIGNMENT = 16

    def __init__(self, device: Device, slots: Mapping[str, object]):
        if not slots:
            raise ValueError("slots: at least one slot is needed")
        self.device = device
        self._layout: dict[str, tuple[int, tuple[int, ...], np.dtype]] = {}
        offset = 0
        for name, desc in slots.items():
            dtype, count = desc if isinstance(desc, tuple) else (desc, 1)
            shape, dtype = _check_shape_dtype(f"slots[{name!r}]", (count,), dtype)
            offset = _round_up(offset, self.SLOT_ALIGNMENT)
            self._layout[name] = (offset, shape, dtype)
            offset += max(shape[0] * dtype.itemsize, 1)
        self._memory = _PinnedHost(device, _round_up(offset, self.SLOT_ALIGNMENT), mapped=True)
        self._views = {name: self._memory.view(off, shape, dtype)
                       for name, (off, shape, dtype) in self._layout.items()}

    def _slot(self, name: str):
        try:
            return self._layout[name]
        except KeyError:
            raise KeyError(f"no slot {name!r}; slots: {sorted(self._layout)}") from None

    def device_ptr(self, name: str) -> int:
        return self._memory.device_ptr + self._slot(name)[0]

    def host(self, name: str) -> np.ndarray:
        self._slot(name)
        return self._views[name]

    def read(self, name: str) -> np.ndarray:
        return self.host(name).copy()

    def clear(self) -> None:
        ctypes.memset(self._memory.host_ptr, 0, self._memory.nbytes)


def driver_event_time(stream, run: Callable[[], Any], n: int) -> float:
    """Seconds per call of ``run`` between two CUDA events recorded on ``stream`` (driver API)."""
    drv = _driver()
    handle = as_stream_handle(stream)
    start, end = call(drv.cuEventCreate, 0), call(drv.cuEventCreate, 0)
    try:
        call(drv.cuEventRecord, start, handle)
        for _ in range(n):
            run()
        call(drv.cuEventRecord, end, handle)
        call(drv.cuEventSynchronize, end)
        ms = call(drv.cuEventElapsedTime, start, end)
    finally:
        drv.cuEventDestroy(start)
        drv.cuEventDestroy(end)
    return float(ms) / 1e3 / n


def grid_for(n: int, block: int) -> int:
    """Blocks needed to cover ``n`` items with ``block`` threads each (at least 1)."""
    return max(1, math.ceil(n / block))


# The arena and the kernel launches live in their own modules, which import this one; their names
# stay importable from here (where callers have always found them), resolved on first use so that
# importing either module first works.
_MOVED = {"Arena": "arena", "ArenaLayout": "arena", "BufferSpec": "arena",
          "Kernel": "kernel_launch", "LoadedModule": "kernel_launch", "PackedArgs": "kernel_launch"}


def __getattr__(name: str):
    if name in _MOVED:
        import importlib

        return getattr(importlib.import_module(f"foxhunt.fast.{_MOVED[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "ALIGNMENT",
    "Arena",
    "ArenaLayout",
    "BufferSpec",
    "CudaError",
    "Device",
    "DeviceAllocation",
    "Kernel",
    "LoadedModule",
    "NoCudaDeviceError",
    "PackedArgs",
    "PinnedScalars",
    "Stream",
    "call",
    "capture_begins",
    "capture_ends",
    "cuda_available",
    "default_arch",
    "driver_event_time",
    "grid_for",
    "pinned_block",
    "release",
]
