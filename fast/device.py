"""The GPU context, streams, one-allocation arenas, pinned host memory and kernel launches.

Everything talks to the CUDA driver through ``cuda.bindings.driver``, imported lazily: this
module imports (and ``cuda_available()`` answers) on a machine with no driver and no
cuda-python; constructing a ``Device`` there raises ``NoCudaDeviceError`` saying why.

- ``Device(ordinal)``: the device's primary context (shared with cuBLAS and any other runtime
  API user in the process), made current, and one non-blocking stream ``device.stream``.
- ``Arena(device, nbytes)``: ONE device allocation carved into named sub-buffers, each
  256-byte aligned; ``arena.ptr(name)`` is a plain int resolved once, to be baked into launches
  and graphs (the seeds' cached-pointer idea). ``upload``/``download`` (synchronous) and
  ``upload_async``/``download_async``/``zero`` (ordered on a stream) move data. A host array
  given to an ``*_async`` call must stay alive and unchanged until the stream reaches the
  copy, and must be page-locked (``pinned_empty``) for the copy to be truly asynchronous and
  capturable in a graph.
- ``PinnedScalars(device, slots)``: page-locked, device-mapped host memory: kernels write
  through ``device_ptr(name)``, the host reads ``read(name)`` after a stream sync, with no copy.
- ``LoadedModule`` / ``Kernel``: a compiled ``foxhunt.fast._build.Module`` loaded into the
  context; ``kernel.launch(grid, block, *args, stream=...)`` packs the arguments by the
  kernel's PTX parameter types (a pointer is a plain int), checking their number and kinds.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

ALIGNMENT = 256  # bytes; cuBLAS(Lt)'s default operand alignment and a full L2 sector group


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
        self._extras: dict = {}  # per-device singletons of other modules (cuBLASLt handle)

    def make_current(self) -> None:
        call(_driver().cuCtxSetCurrent, self.context)

    def new_stream(self) -> Stream:
        drv = _driver()
        return Stream(call(drv.cuStreamCreate, drv.CUstream_flags.CU_STREAM_NON_BLOCKING.value))

    def synchronize(self) -> None:
        """Wait for all work in the context (every stream)."""
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
            call(_driver().cuStreamSynchronize, as_stream_handle(stream))

    def copy_to_host(self, out: np.ndarray, src_ptr: int, stream=None, *, wait: bool = True) -> np.ndarray:
        """Copy ``out.nbytes`` bytes from ``src_ptr`` into the C-contiguous host array ``out``."""
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError("out: the host array must be C-contiguous and writeable")
        stream = self.stream if stream is None else stream
        if out.nbytes:
            call(_driver().cuMemcpyDtoHAsync, out.ctypes.data, int(src_ptr), out.nbytes,
                 as_stream_handle(stream))
        if wait:
            call(_driver().cuStreamSynchronize, as_stream_handle(stream))
        return out

    def memset(self, ptr: int, byte: int, nbytes: int, stream=None) -> None:
        """Fill ``nbytes`` bytes at ``ptr`` with ``byte``, ordered on ``stream`` (no sync)."""
        stream = self.stream if stream is None else stream
        if nbytes:
            call(_driver().cuMemsetD8Async, int(ptr), int(byte) & 0xFF, int(nbytes),
                 as_stream_handle(stream))

    def load_module(self, module) -> LoadedModule:
        return LoadedModule(self, module)

    def pinned_empty(self, shape, dtype) -> np.ndarray:
        """An uninitialised page-locked host array (for asynchronous copies)."""
        shape, dtype = _check_shape_dtype("shape", shape, dtype)
        nbytes = max(1, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
        host = _PinnedHost(self, nbytes, mapped=False)
        return host.view(0, shape, dtype)

    def __repr__(self) -> str:
        return f"Device({self.ordinal}: {self.name}, {self.arch})"


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
            self.free()
        except Exception:  # noqa: BLE001 - interpreter shutdown or a dead context
            pass


# --------------------------------------------------------------------------------------------
# Arena
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


@dataclass(frozen=True)
class BufferSpec:
    """A named sub-buffer: byte ``offset`` into its arena, ``shape``, ``dtype``, ``nbytes``."""

    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


class ArenaLayout:
    """Pure bookkeeping of named buffers at ``ALIGNMENT``-byte offsets (no GPU needed).

    ``add(name, shape, dtype)`` returns the new ``BufferSpec``; ``nbytes`` is the total
    size the arena needs.
    """

    def __init__(self, capacity: int | None = None):
        self.capacity = capacity
        self.specs: dict[str, BufferSpec] = {}
        self.nbytes = 0

    def add(self, name: str, shape, dtype) -> BufferSpec:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name: {name!r} is not a non-empty string")
        if name in self.specs:
            raise ValueError(f"name: buffer {name!r} already exists in this arena")
        shape, dtype = _check_shape_dtype("shape", shape, dtype)
        offset = _round_up(self.nbytes, ALIGNMENT)
        spec = BufferSpec(name, offset, shape, dtype)
        end = offset + max(spec.nbytes, 1)
        if self.capacity is not None and end > self.capacity:
            raise ValueError(
                f"shape: buffer {name!r} ({spec.nbytes} bytes at offset {offset}) does not fit "
                f"in the arena's {self.capacity} bytes"
            )
        self.specs[name] = spec
        self.nbytes = end
        return spec

    def __contains__(self, name: str) -> bool:
        return name in self.specs

    def __getitem__(self, name: str) -> BufferSpec:
        try:
            return self.specs[name]
        except KeyError:
            raise KeyError(f"no buffer {name!r}; buffers: {sorted(self.specs)}") from None


class Arena:
    """One device allocation of ``nbytes`` (zero-filled) carved into named sub-buffers.

    ``add(name, shape, dtype) -> ptr`` carves a buffer; ``Arena.from_specs(device, {name:
    (shape, dtype)})`` sizes and carves in one go. ``ptr(name)`` is the buffer's device
    address (int), fixed for the arena's life.
    """

    def __init__(self, device: Device, nbytes: int):
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes: {nbytes!r} is not a positive int")
        self.device = device
        self.layout = ArenaLayout(capacity=_round_up(nbytes, ALIGNMENT))
        self._allocation = device.alloc(self.layout.capacity)
        self.base = self._allocation.ptr
        self._ptrs: dict[str, int] = {}
        call(_driver().cuMemsetD8Async, self.base, 0, self.layout.capacity, device.stream.handle)
        device.stream.synchronize()

    @classmethod
    def from_specs(cls, device: Device, specs: Mapping[str, tuple]) -> Arena:
        layout = ArenaLayout()
        for name, (shape, dtype) in specs.items():
            layout.add(name, shape, dtype)
        arena = cls(device, max(layout.nbytes, 1))
        for name, (shape, dtype) in specs.items():
            arena.add(name, shape, dtype)
        return arena

    @property
    def nbytes(self) -> int:
        return self.layout.capacity

    def add(self, name: str, shape, dtype) -> int:
        spec = self.layout.add(name, shape, dtype)
        self._ptrs[name] = self.base + spec.offset
        return self._ptrs[name]

    def ptr(self, name: str) -> int:
        try:
            return self._ptrs[name]
        except KeyError:
            raise KeyError(f"no buffer {name!r} in this arena; buffers: {sorted(self._ptrs)}") from None

    def spec(self, name: str) -> BufferSpec:
        return self.layout[name]

    def __contains__(self, name: str) -> bool:
        return name in self._ptrs

    def _checked_host(self, name: str, array, what: str) -> np.ndarray:
        spec = self.spec(name)
        if not isinstance(array, np.ndarray):
            raise ValueError(f"{what}: expected a NumPy array for buffer {name!r}, got {type(array).__name__}")
        if array.dtype != spec.dtype or array.shape != spec.shape:
            raise ValueError(
                f"{what}: buffer {name!r} holds {spec.shape} {spec.dtype}, "
                f"got {array.shape} {array.dtype}"
            )
        if not array.flags.c_contiguous:
            raise ValueError(f"{what}: the host array for {name!r} must be C-contiguous")
        return array

    def upload_async(self, name: str, array: np.ndarray, stream=None) -> None:
        """Copy ``array`` (exact shape and dtype of the buffer) to the device, on ``stream``."""
        array = self._checked_host(name, array, "array")
        if array.nbytes:
            stream = self.device.stream if stream is None else stream
            call(_driver().cuMemcpyHtoDAsync, self.ptr(name), array.ctypes.data, array.nbytes,
                 as_stream_handle(stream))

    def download_async(self, name: str, out: np.ndarray, stream=None) -> np.ndarray:
        """Copy the buffer into the host array ``out`` (exact shape and dtype), on ``stream``."""
        out = self._checked_host(name, out, "out")
        if not out.flags.writeable:
            raise ValueError(f"out: the host array for {name!r} is read-only")
        if out.nbytes:
            stream = self.device.stream if stream is None else stream
            call(_driver().cuMemcpyDtoHAsync, out.ctypes.data, self.ptr(name), out.nbytes,
                 as_stream_handle(stream))
        return out

    def upload(self, name: str, array: np.ndarray) -> None:
        """Synchronous upload, ordered after the work already on ``device.stream``."""
        self.upload_async(name, np.ascontiguousarray(array), self.device.stream)
        self.device.stream.synchronize()

    def download(self, name: str) -> np.ndarray:
        """Synchronous download (a fresh array), ordered after the work on ``device.stream``."""
        spec = self.spec(name)
        out = np.empty(spec.shape, spec.dtype)
        self.download_async(name, out, self.device.stream)
        self.device.stream.synchronize()
        return out

    def zero(self, name: str | None = None, stream=None) -> None:
        """Set one buffer (or the whole arena) to zero bytes, on ``stream``."""
        stream = self.device.stream if stream is None else stream
        if name is None:
            ptr, nbytes = self.base, self.layout.capacity
        else:
            ptr, nbytes = self.ptr(name), self.spec(name).nbytes
        if nbytes:
            call(_driver().cuMemsetD8Async, ptr, 0, nbytes, as_stream_handle(stream))

    def close(self) -> None:
        self._allocation.free()
        self._ptrs.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# --------------------------------------------------------------------------------------------
# Pinned host memory
# --------------------------------------------------------------------------------------------


class _PinnedHost:
    """One ``cuMemHostAlloc`` block; freed when the last NumPy view of it is gone."""

    def __init__(self, device: Device, nbytes: int, mapped: bool):
        drv = _driver()
        device.make_current()
        flags = drv.CU_MEMHOSTALLOC_PORTABLE | (drv.CU_MEMHOSTALLOC_DEVICEMAP if mapped else 0)
        self.nbytes = nbytes
        self.host_ptr = int(call(drv.cuMemHostAlloc, nbytes, flags))
        ctypes.memset(self.host_ptr, 0, nbytes)
        self.device_ptr = int(call(drv.cuMemHostGetDevicePointer, self.host_ptr, 0)) if mapped else 0

    def view(self, offset: int, shape, dtype) -> np.ndarray:
        count = int(np.prod(shape, dtype=np.int64))
        raw = (ctypes.c_char * max(count * dtype.itemsize, 1)).from_address(self.host_ptr + offset)
        raw._owner = self  # the array's base keeps this allocation alive
        return np.frombuffer(raw, dtype=dtype, count=count).reshape(shape)

    def __del__(self):
        try:
            call(_driver().cuMemFreeHost, self.host_ptr)
        except Exception:  # noqa: BLE001
            pass


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


# --------------------------------------------------------------------------------------------
# Modules and kernel launches
# --------------------------------------------------------------------------------------------

_INT_RANGES = {1: (-(1 << 7), 1 << 8), 2: (-(1 << 15), 1 << 16),
               4: (-(1 << 31), 1 << 32), 8: (-(1 << 63), 1 << 64)}
_FLOAT_DTYPES = {"f16": np.float16, "f32": np.float32, "f64": np.float64}


def _pack_arg(kernel: str, index: int, ptype, value) -> bytes:
    """One argument as the bytes the kernel parameter ``ptype`` holds."""
    where = f"{kernel} argument {index}"
    if ptype.count > 1:  # by-value aggregate: raw bytes of exactly its size
        raw = value.tobytes() if isinstance(value, (np.ndarray, np.generic)) else value
        if not isinstance(raw, (bytes, bytearray)) or len(raw) != ptype.nbytes:
            raise TypeError(f"{where}: expected {ptype.nbytes} raw bytes for a by-value aggregate")
        return bytes(raw)
    kind, size = ptype.ptx_type[0], ptype.nbytes
    if kind == "f":
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (float, int, np.floating, np.integer)):
            raise TypeError(f"{where}: expected a float for a .{ptype.ptx_type} parameter, got {value!r}")
        if isinstance(value, np.floating) and value.dtype.itemsize != size:
            raise TypeError(f"{where}: expected a {size}-byte float, got {value.dtype}")
        return np.asarray(value, dtype=_FLOAT_DTYPES[ptype.ptx_type]).tobytes()
    # Integer or pointer parameter (PTX does not say which: a pointer is a plain int).
    if isinstance(value, (float, np.floating)):
        raise TypeError(f"{where}: expected an int for a .{ptype.ptx_type} parameter, got {value!r}")
    if isinstance(value, np.integer) and value.dtype.itemsize > size:
        raise TypeError(f"{where}: a {value.dtype} does not fit a {size}-byte parameter")
    if not isinstance(value, (int, np.integer)):
        raise TypeError(f"{where}: expected an int (or pointer) for .{ptype.ptx_type}, got {value!r}")
    value = int(value)
    low, high = _INT_RANGES[size]
    if not low <= value < high:
        raise ValueError(f"{where}: {value} does not fit a {size}-byte parameter")
    return (value % high).to_bytes(size, "little")


def _dim3(value, what: str) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
    if not 1 <= len(dims) <= 3 or any(int(d) < 1 for d in dims):
        raise ValueError(f"{what}: {value!r} is not 1 to 3 positive ints")
    return tuple(int(d) for d in dims) + (1,) * (3 - len(dims))


class Kernel:
    """One ``__global__`` function of a loaded module. ``params`` are its PTX parameter
    types; ``launch`` checks and packs the arguments against them."""

    def __init__(self, name: str, function, params: Sequence):
        self.name = name
        self.function = function
        self.params = tuple(params)

    def pack(self, *args) -> PackedArgs:
        if len(args) != len(self.params):
            raise TypeError(f"{self.name} takes {len(self.params)} arguments, got {len(args)}")
        return PackedArgs([_pack_arg(self.name, i, p, a)
                           for i, (p, a) in enumerate(zip(self.params, args))])

    def launch(self, grid, block, *args, stream=None, shared_mem: int = 0) -> None:
        """Launch on ``stream`` (a ``Stream``, ``CUstream`` or int; required) with ``grid`` and
        ``block`` (int or up to 3 ints) and ``shared_mem`` bytes of dynamic shared memory."""
        packed = args[0] if len(args) == 1 and isinstance(args[0], PackedArgs) else self.pack(*args)
        if stream is None:
            raise ValueError("stream: a kernel launch needs an explicit stream (device.stream)")
        gx, gy, gz = _dim3(grid, "grid")
        bx, by, bz = _dim3(block, "block")
        call(_driver().cuLaunchKernel, self.function, gx, gy, gz, bx, by, bz, int(shared_mem),
             as_stream_handle(stream), packed.address, 0)

    def set_max_dynamic_shared(self, nbytes: int) -> None:
        """Allow more than 48 KiB of dynamic shared memory for this kernel."""
        drv = _driver()
        call(drv.cuFuncSetAttribute, self.function,
             drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(nbytes))

    def __repr__(self) -> str:
        return f"Kernel({self.name}, {[p.ptx_type for p in self.params]})"


class PackedArgs:
    """Kernel arguments packed once (reusable across launches): the driver's ``void**``."""

    def __init__(self, blobs: Sequence[bytes]):
        offsets, total = [], 0
        for blob in blobs:
            total = _round_up(total, 8)
            offsets.append(total)
            total += len(blob)
        self._storage = np.zeros(max(total, 8), dtype=np.uint8)
        for off, blob in zip(offsets, blobs):
            self._storage[off:off + len(blob)] = np.frombuffer(blob, dtype=np.uint8)
        base = self._storage.ctypes.data
        self._pointers = np.array([base + off for off in offsets] or [0], dtype=np.uint64)
        self.address = int(self._pointers.ctypes.data) if blobs else 0


class LoadedModule:
    """A ``foxhunt.fast._build.Module`` loaded into a device's context (one driver module per
    source file). ``kernel(name)`` looks a kernel up by name; ``names`` lists them all."""

    def __init__(self, device: Device, module):
        drv = _driver()
        device.make_current()
        self.device = device
        self.module = module
        self._handles = {}
        for name, image in module.images.items():
            buffer = np.frombuffer(image, dtype=np.uint8)
            self._handles[name] = call(drv.cuModuleLoadData, buffer.ctypes.data)
        self._kernels: dict[str, Kernel] = {}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self.module.kernels))

    def kernel(self, name: str) -> Kernel:
        cached = self._kernels.get(name)
        if cached is not None:
            return cached
        try:
            file = self.module.kernels[name]
        except KeyError:
            raise KeyError(f"no kernel {name!r} in cuda_src; kernels: {list(self.names)}") from None
        function = call(_driver().cuModuleGetFunction, self._handles[file], name.encode())
        kernel = Kernel(name, function, self.module.params[name])
        self._kernels[name] = kernel
        return kernel

    def close(self) -> None:
        for handle in self._handles.values():
            call(_driver().cuModuleUnload, handle)
        self._handles.clear()
        self._kernels.clear()


def grid_for(n: int, block: int) -> int:
    """Blocks needed to cover ``n`` items with ``block`` threads each (at least 1)."""
    return max(1, math.ceil(n / block))


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
    "cuda_available",
    "default_arch",
    "grid_for",
]
