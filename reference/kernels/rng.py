"""Counter-based random numbers: Philox4x32-10 (Salmon et al., "Parallel Random Numbers: As
Easy as 1, 2, 3", SC'11; the Random123 library's constants), bit-identical in NumPy and CUDA
(``cuda_src/rng.cuh`` mirrors every function here; ``cuda_src/rng.cu`` holds the
``philox_uniform`` kernel).

A draw is a pure function of ``(key, stream, offset, index)``: no generator state lives
anywhere, so the reference and the fast path reproduce each other bit for bit, a CUDA graph
replays the same launch with the offset read from device memory, and a checkpoint needs only
the offset (e.g. the trainer's step count).

The one word packing (nobody else re-derives it; ``rng.cuh`` mirrors it)::

    ctr = [index, stream, offset & 0xffffffff, offset >> 32]      uint32 x 4
    key = [key & 0xffffffff, key >> 32]                           uint32 x 2  (the run's seed)
    uniform(key, stream, offset, index) = u32_to_uniform(philox4x32(ctr, key)[0])

``index`` is a 32-bit element index (the kernels index with 32-bit ints; ``MAX_INDEX``),
``stream`` a 32-bit stream id (:data:`STREAMS`), ``offset`` and ``key`` 64-bit. Distinct
``(stream, offset, index)`` under one key are distinct counters, so their words are independent.

``u32_to_uniform(u) = ((u >> 9) + 0.5) * 2**-23``: 2**23 equally spaced values, the odd
multiples of 2**-24 in ``(0, 1)`` (smallest ``2**-24``, largest ``1 - 2**-24``), each exact in
float32 (24 significant bits at most), so both backends get the same bits with no rounding at
all and a draw is never 0 or 1.
"""

from __future__ import annotations

from types import MappingProxyType

import numpy as np

from foxhunt.reference.kernels.argcheck import check_int

U32 = np.dtype(np.uint32)
U64 = np.dtype(np.uint64)
F32 = np.dtype(np.float32)

#: Philox4x32 multipliers and Weyl key increments (Random123 ``PHILOX_M4x32_0/1``,
#: ``PHILOX_W32_0/1``).
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
#: Rounds (Philox4x32-10: the Random123 default, Crush-resistant with margin).
PHILOX_ROUNDS = 10

#: ``u32_to_uniform``: the high ``32 - UNIFORM_SHIFT`` bits make a 23-bit integer ``k``, and the
#: draw is ``(2 k + 1) * 2**-24``: exact in float32.
UNIFORM_SHIFT = 9
UNIFORM_SCALE = np.float32(2.0**-24)

#: Largest element index + 1 (the index is one counter word).
MAX_INDEX = 2**32
#: Largest key / offset + 1 (two counter or key words).
MAX_U64 = 2**64

#: Stream ids, one per consumer of random numbers (contract of issue 18; stream 0 unused so a
#: zeroed argument never aliases a real stream).
STREAMS = MappingProxyType({
    "iqn_tau_online": 1,
    "iqn_tau_target": 2,
    "explore": 3,
    "replay_sample": 4,
    "episode_start": 5,
    "explore_action": 6,
})

_LOW32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)


def _mulhilo(m: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(hi, lo)`` of the 64-bit product ``m * x`` (uint32 ``x``): CUDA ``__umulhi`` / ``*``."""
    prod = np.uint64(m) * x.astype(U64)
    return (prod >> _SHIFT32).astype(U32), (prod & _LOW32).astype(U32)


def philox4x32(ctr: np.ndarray, key: np.ndarray) -> np.ndarray:
    """Philox4x32-10 of counters ``ctr`` under keys ``key`` (Random123's ``philox4x32``).

    Each round: ``hi0, lo0 = mulhilo(M0, c0)``; ``hi1, lo1 = mulhilo(M1, c2)``;
    ``c = [hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0]``; before every round but the first the key
    is bumped, ``k0 += W0``, ``k1 += W1`` (uint32, wrapping).

    Shapes: ``ctr`` uint32 ``[..., 4]``, ``key`` uint32 ``[..., 2]`` (leading dimensions
    broadcast). Returns uint32 ``[..., 4]``. Pure integer arithmetic: no NaN contract.
    """
    if not isinstance(ctr, np.ndarray) or ctr.dtype != U32 or ctr.ndim < 1 or ctr.shape[-1] != 4:
        raise ValueError(f"ctr: expected a uint32 array of shape [..., 4], got "
                         f"{getattr(ctr, 'dtype', type(ctr).__name__)} {getattr(ctr, 'shape', '')}")
    if not isinstance(key, np.ndarray) or key.dtype != U32 or key.ndim < 1 or key.shape[-1] != 2:
        raise ValueError(f"key: expected a uint32 array of shape [..., 2], got "
                         f"{getattr(key, 'dtype', type(key).__name__)} {getattr(key, 'shape', '')}")
    c0, c1, c2, c3 = (ctr[..., k] for k in range(4))
    k0, k1 = np.array(key[..., 0]), np.array(key[..., 1])
    w0, w1 = np.uint32(PHILOX_W0), np.uint32(PHILOX_W1)
    with np.errstate(over="ignore"):  # the key bump wraps modulo 2**32 on purpose
        for r in range(PHILOX_ROUNDS):
            if r:
                k0 = (k0 + w0).astype(U32)
                k1 = (k1 + w1).astype(U32)
            hi0, lo0 = _mulhilo(PHILOX_M0, c0)
            hi1, lo1 = _mulhilo(PHILOX_M1, c2)
            c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return np.stack(np.broadcast_arrays(c0, c1, c2, c3), axis=-1).astype(U32)


def u32_to_uniform(u: np.ndarray) -> np.ndarray:
    """``((u >> 9) + 0.5) * 2**-23``, computed as ``float32(2 (u >> 9) + 1) * 2**-24``: exact.

    Shapes: ``u`` uint32, any shape; returns float32 of the same shape, every value in
    ``[2**-24, 1 - 2**-24]`` (never 0 or 1).
    """
    if not isinstance(u, np.ndarray) or u.dtype != U32:
        raise ValueError(f"u: expected a uint32 array, got {getattr(u, 'dtype', type(u).__name__)}")
    odd = ((u >> np.uint32(UNIFORM_SHIFT)) << np.uint32(1)) | np.uint32(1)
    return (odd.astype(F32) * UNIFORM_SCALE).astype(F32)


def split_u64(name: str, value) -> tuple[int, int]:
    """``(lo, hi)`` 32-bit words of a 64-bit unsigned argument (``ValueError`` outside
    ``[0, 2**64)``)."""
    v = check_int(name, value, minimum=0, maximum=MAX_U64 - 1)
    return v & 0xFFFFFFFF, v >> 32


def check_stream(stream) -> int:
    """A stream id: an integer in ``[0, 2**32)`` (the ids in use are :data:`STREAMS`)."""
    return check_int("stream", stream, minimum=0, maximum=MAX_INDEX - 1)


def uniform(key: int, stream: int, offset: int, index) -> np.ndarray:
    """Uniform draws in ``(0, 1)``: ``u32_to_uniform(philox4x32([index, stream, offset_lo,
    offset_hi], [key_lo, key_hi])[0])`` for every element of ``index``.

    ``key`` (the run's seed) and ``offset`` are integers in ``[0, 2**64)``; ``stream`` in
    ``[0, 2**32)``; ``index`` an integer or integer array with values in ``[0, 2**32)``.
    Returns float32 of ``index``'s shape.
    """
    key_lo, key_hi = split_u64("key", key)
    off_lo, off_hi = split_u64("offset", offset)
    s = check_stream(stream)
    idx = np.asarray(index)
    if idx.dtype.kind not in "iu" or (idx.size and (idx.min() < 0 or idx.max() >= MAX_INDEX)):
        raise ValueError(f"index: expected integers in [0, {MAX_INDEX}), got dtype {idx.dtype}"
                         + (f" with range [{idx.min()}, {idx.max()}]" if idx.size else ""))
    words = np.empty(idx.shape + (4,), U32)
    words[..., 0] = idx.astype(U32)
    words[..., 1] = s
    words[..., 2] = off_lo
    words[..., 3] = off_hi
    out = philox4x32(words, np.array([key_lo, key_hi], U32))
    return u32_to_uniform(out[..., 0])


# --------------------------------------------------------------------------------------------
# The kernel twin (conformance of rng.cuh's arithmetic)
# --------------------------------------------------------------------------------------------


def validate_philox_uniform(n, key_lo, key_hi, stream, offset_lo, offset_hi) -> tuple[int, ...]:
    """The argument checks of ``philox_uniform``; returns the six integers."""
    n = check_int("n", n, minimum=0, maximum=2**31 - 1)
    words = tuple(check_int(name, value, minimum=0, maximum=MAX_INDEX - 1) for name, value in (
        ("key_lo", key_lo), ("key_hi", key_hi), ("stream", stream), ("offset_lo", offset_lo),
        ("offset_hi", offset_hi)))
    return (n, *words)


def philox_uniform(n: int, key_lo: int, key_hi: int, stream: int, offset_lo: int,
                   offset_hi: int) -> np.ndarray:
    """``out[i] = uniform(key, stream, offset, i)`` for ``i < n``, with ``key = key_hi << 32 |
    key_lo`` and ``offset = offset_hi << 32 | offset_lo`` (each word in ``[0, 2**32)``).

    Returns float32 ``[n]``. Exact: integer arithmetic and one exact conversion.
    """
    n, k_lo, k_hi, s, o_lo, o_hi = validate_philox_uniform(n, key_lo, key_hi, stream, offset_lo,
                                                            offset_hi)
    return uniform(k_hi << 32 | k_lo, s, o_hi << 32 | o_lo, np.arange(n, dtype=np.int64))


KERNELS = {
    "philox_uniform": philox_uniform,
}

__all__ = [
    "KERNELS", "MAX_INDEX", "MAX_U64", "PHILOX_M0", "PHILOX_M1", "PHILOX_ROUNDS", "PHILOX_W0",
    "PHILOX_W1", "STREAMS", "UNIFORM_SCALE", "UNIFORM_SHIFT", "check_stream", "philox4x32",
    "philox_uniform", "split_u64", "u32_to_uniform", "uniform", "validate_philox_uniform",
]
