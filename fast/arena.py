"""``Arena(device, nbytes)``: ONE device allocation carved into named sub-buffers, each
256-byte aligned; ``arena.ptr(name)`` is a plain int resolved once, to be baked into launches and
graphs (the seeds' cached-pointer idea). ``upload``/``download`` (synchronous) and
``upload_async``/``download_async``/``zero`` (ordered on a stream) move data. A host array given
to an ``*_async`` call must stay alive and unchanged until the stream reaches the copy, and must
be page-locked (``Device.pinned_empty``) for the copy to be truly asynchronous and capturable in
a graph. ``ArenaLayout`` is the pure bookkeeping (no GPU): the CPU executor's ``HostArena``
carves its host block with it, so both put every buffer at the same offset.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from foxhunt.fast.device import (
    ALIGNMENT,
    Device,
    _check_shape_dtype,
    _driver,
    _round_up,
    as_stream_handle,
    call,
)


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


__all__ = ["Arena", "ArenaLayout", "BufferSpec"]
