"""Kernels of a compiled module, loaded into a device's context, and their launches.

``LoadedModule(device, module)``: a ``foxhunt.fast._build.Module`` (one driver module per source
file); ``kernel(name)`` looks a kernel up by name. ``Kernel.launch(grid, block, *args, stream=)``
packs the arguments by the kernel's PTX parameter types (a pointer is a plain int), checking
their number and kinds; ``Kernel.pack`` packs them once for many launches (``PackedArgs``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from foxhunt.fast.device import Device, _driver, _round_up, as_stream_handle, call

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
        self._max_dynamic_shared = 0

    def pack(self, *args) -> PackedArgs:
        if len(args) != len(self.params):
            raise TypeError(f"{self.name} takes {len(self.params)} arguments, got {len(args)}")
        return PackedArgs([_pack_arg(self.name, i, p, a)
                           for i, (p, a) in enumerate(zip(self.params, args))])

    def launch(self, grid, block, *args, stream=None, shared_mem: int = 0, early: bool = False) -> None:
        """Launch on ``stream`` (a ``Stream``, ``CUstream`` or int; required) with ``grid`` and
        ``block`` (int or up to 3 ints) and ``shared_mem`` bytes of dynamic shared memory.
        ``early`` (sm_90+; the kernel must begin with ``fh_early_wait()``,
        ``cuda_src/early_launch.cuh``): a programmatic dependent launch, which may start while
        the kernel before it on the stream still runs."""
        packed = args[0] if len(args) == 1 and isinstance(args[0], PackedArgs) else self.pack(*args)
        if stream is None:
            raise ValueError("stream: a kernel launch needs an explicit stream (device.stream)")
        gx, gy, gz = _dim3(grid, "grid")
        bx, by, bz = _dim3(block, "block")
        drv = _driver()
        if not early:
            call(drv.cuLaunchKernel, self.function, gx, gy, gz, bx, by, bz, int(shared_mem),
                 as_stream_handle(stream), packed.address, 0)
            return
        config = drv.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = gx, gy, gz
        config.blockDimX, config.blockDimY, config.blockDimZ = bx, by, bz
        config.sharedMemBytes = int(shared_mem)
        config.hStream = as_stream_handle(stream)
        attr = drv.CUlaunchAttribute()
        attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        config.attrs = [attr]
        config.numAttrs = 1
        call(drv.cuLaunchKernelEx, config, self.function, packed.address, 0)

    def set_max_dynamic_shared(self, nbytes: int) -> None:
        """Allow more than 48 KiB of dynamic shared memory for this kernel: at least ``nbytes``,
        never less than an earlier call allowed (the attribute is the function's, shared by every
        launch of it: one of a smaller launch must not lower it under a larger one's, which a
        later capture or launch would then fail with CUDA_ERROR_INVALID_VALUE)."""
        if int(nbytes) <= self._max_dynamic_shared:
            return
        drv = _driver()
        call(drv.cuFuncSetAttribute, self.function,
             drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(nbytes))
        self._max_dynamic_shared = int(nbytes)

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


__all__ = ["Kernel", "LoadedModule", "PackedArgs"]
