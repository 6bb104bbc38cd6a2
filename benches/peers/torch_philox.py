"""The reference's counter-based generator (``reference/kernels/rng.py``: Philox4x32-10, its word
packing and ``u32_to_uniform``) in PyTorch tensor operations, so the peer draws the IQN quantile
fractions on its own device, bit for bit the reference's.

PyTorch has no unsigned 32-bit arithmetic, so every word lives in an ``int64`` tensor holding a
value in ``[0, 2**32)``. The one product Philox needs, ``M * x`` for a 32-bit constant ``M`` and
word ``x``, can reach ``2**64`` and would overflow ``int64``; ``_mulhilo`` splits ``M`` into
16-bit halves instead (each partial product stays below ``2**48``)::

    a = x * (M & 0xffff);  b = x * (M >> 16)                   (both < 2**48)
    t = a + ((b & 0xffff) << 16)                               (< 2**49)
    hi = (b >> 16) + (t >> 32);  lo = t & 0xffffffff           (hi * 2**32 + lo == M * x)

The key words are Python integers (a draw's key is the run's seed, one per call), so the key
schedule costs no tensor operation.

``TauTable`` precomputes the quantile fractions of a block of consecutive steps with this
generator, on the peer's device, outside the step (and outside any captured CUDA graph); the
step reads its row through a device-side counter (``TauTable.row``), so a captured step replays
with fresh fractions and no host work. Why that is fair to both sides: the fractions are exactly
the reference's (same generator, same counters, so the peer does the same learning work); the
generation is about 220 elementwise operations per block (10 rounds of two split products and
the xors), amortised over the block's steps (1024 on CUDA: microseconds per step), where the
fast path draws them per step inside its one fused tau/cosine kernel. Per step the peer then
gathers its row and computes the cosine features in a few launches. Neither side gets numbers
the other does not compute, and the generation the peer moves out of the step costs it
microseconds per step amortised, so timing the peer's step this way favours it, if anything.
"""

from __future__ import annotations

import torch

from foxhunt.reference.kernels.rng import (
    PHILOX_M0,
    PHILOX_M1,
    PHILOX_ROUNDS,
    PHILOX_W0,
    PHILOX_W1,
    UNIFORM_SHIFT,
    split_u64,
)

MASK32 = 0xFFFFFFFF
MASK16 = 0xFFFF


def _mulhilo(m: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hi, lo)`` 32-bit words of ``m * x`` (module docstring); ``x`` int64 in ``[0, 2**32)``."""
    a = x * (m & MASK16)
    b = x * (m >> 16)
    t = a + ((b & MASK16) << 16)
    return (b >> 16) + (t >> 32), t & MASK32


def philox_word0(c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor,
                 key: int) -> torch.Tensor:
    """Word 0 of ``philox4x32(ctr=[c0, c1, c2, c3], key=[key & 0xffffffff, key >> 32])``
    (``rng.philox4x32``'s rounds; the other three output words are not needed). The counters
    are int64 tensors of 32-bit words that broadcast together; returns int64 in ``[0, 2**32)``."""
    k0, k1 = split_u64("key", key)
    for r in range(PHILOX_ROUNDS):
        if r:
            k0, k1 = (k0 + PHILOX_W0) & MASK32, (k1 + PHILOX_W1) & MASK32
        hi0, lo0 = _mulhilo(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0


def uniform(key: int, streams: torch.Tensor, offsets: torch.Tensor, n: int) -> torch.Tensor:
    """``rng.uniform(key, stream, offset, i)`` for every stream ``[S]``, offset ``[T]`` (int64
    tensors, offsets in ``[0, 2**63)``) and index ``i < n``: float32 ``[S, T, n]`` on their
    device, bit for bit the reference's (``u32_to_uniform``: ``(2 (u >> 9) + 1) * 2**-24``,
    exact in float32)."""
    device = streams.device
    c0 = torch.arange(n, dtype=torch.int64, device=device).view(1, 1, n)
    c1 = streams.view(-1, 1, 1)
    c2 = (offsets & MASK32).view(1, -1, 1)
    c3 = (offsets >> 32).view(1, -1, 1)
    u = philox_word0(c0, c1, c2, c3, key)
    return (((u >> UNIFORM_SHIFT) << 1) | 1).to(torch.float32) * 2.0**-24


class TauTable:
    """The quantile fractions of ``block`` consecutive steps, ``[block, len(streams), rows]``
    float32 on ``device``, and the device counter ``slot`` (int64 ``[1]``) of the row the next
    step reads (module docstring).

    ``ensure(step)`` (host, before a step runs): if ``step`` lies outside the block, regenerate
    it for ``[step, step + block)`` and reset ``slot`` to 0. ``row()`` (inside the step): the
    current row ``[len(streams), rows]``; ``advance()`` (inside the step, after its last read):
    ``slot += 1``. The host keeps the step count; one ``ensure`` per executed step keeps it and
    ``slot`` in step."""

    def __init__(self, key: int, streams: tuple[int, ...], rows: int, block: int,
                 device: torch.device):
        split_u64("key", key)  # a one-line ValueError now rather than at the first step
        self.key, self.rows, self.block, self.device = int(key), int(rows), int(block), device
        self.streams = torch.tensor(streams, dtype=torch.int64, device=device)
        self.table = torch.zeros((self.block, len(streams), self.rows), dtype=torch.float32,
                                 device=device)
        self.slot = torch.zeros(1, dtype=torch.int64, device=device)
        self.base: int | None = None

    def rekey(self, key: int) -> None:
        """Draw from now on under ``key`` (a loaded state's seed); the block is regenerated at the
        next ``ensure``."""
        split_u64("key", key)
        self.key, self.base = int(key), None

    def ensure(self, step: int) -> None:
        if self.base is not None and self.base <= step < self.base + self.block:
            return
        offsets = torch.arange(step, step + self.block, dtype=torch.int64, device=self.device)
        self.table.copy_(uniform(self.key, self.streams, offsets, self.rows).transpose(0, 1))
        self.slot.fill_(0)
        self.base = step

    def row(self) -> torch.Tensor:
        return self.table.index_select(0, self.slot).squeeze(0)

    def advance(self) -> None:
        self.slot.add_(1)


__all__ = ["TauTable", "philox_word0", "uniform"]
