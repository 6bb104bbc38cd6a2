"""Hypothesis strategies for float32 arrays with special values injected at chosen positions.

``hnp.arrays`` shares one fill value across an array, so it rarely puts a NaN next to a
finite value; we build the finite body from a drawn seed (fast even for 257 x 259 arrays,
and it shrinks to seed 0) and then inject specials *explicitly* at positions drawn from a
pool that always contains the places CUDA kernels get wrong: the first and last element and
the block boundaries ``k*256 - 1, k*256, k*256 + 1``.

The same :class:`Injection` list can be applied to the reference's and the fast path's
inputs (:func:`inject`), so both see the same non-finite input at the same position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from hypothesis import strategies as st

F32 = np.float32
F32_MAX = np.finfo(np.float32).max
F32_TINY = np.finfo(np.float32).tiny  # smallest normal
F32_SMALLEST_SUBNORMAL = np.float32(np.finfo(np.float32).smallest_subnormal)
F32_LARGEST_SUBNORMAL = np.nextafter(F32_TINY, F32(0), dtype=np.float32)

#: Every special value the kernels' NaN/Inf contracts talk about, as float32.
SPECIAL_VALUES: tuple[np.float32, ...] = tuple(F32(v) for v in (
    np.nan, np.inf, -np.inf, 0.0, -0.0, F32_MAX, -F32_MAX,
    F32_SMALLEST_SUBNORMAL, -F32_SMALLEST_SUBNORMAL, F32_LARGEST_SUBNORMAL, F32_TINY,
))
NON_FINITE: tuple[np.float32, ...] = (F32(np.nan), F32(np.inf), F32(-np.inf))
SUBNORMALS: tuple[np.float32, ...] = (F32_SMALLEST_SUBNORMAL, -F32_SMALLEST_SUBNORMAL,
                                      F32_LARGEST_SUBNORMAL)

#: The CUDA block size whose boundaries get special attention.
BLOCK = 256


@dataclass(frozen=True)
class Injection:
    """Put ``value`` at flat index ``position``."""

    position: int
    value: np.float32


def boundary_positions(size: int, block: int = BLOCK, max_blocks: int = 4) -> tuple[int, ...]:
    """Flat indices ``0, size-1`` and ``k*block - 1, k*block, k*block + 1`` for the first
    ``max_blocks`` boundaries and the last one, restricted to ``[0, size)``, sorted, unique."""
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    ks = set(range(1, max_blocks + 1)) | {size // block}
    pos = {0, size - 1}
    for k in ks:
        pos.update((k * block - 1, k * block, k * block + 1))
    return tuple(sorted(p for p in pos if 0 <= p < size))


def inject(array: np.ndarray, injections: Sequence[Injection]) -> np.ndarray:
    """A float32 copy of ``array`` with each injection applied (the input is not modified)."""
    out = np.array(array, dtype=np.float32, copy=True)
    flat = out.reshape(-1)
    for inj in injections:
        if not 0 <= inj.position < flat.size:
            raise ValueError(f"injection position {inj.position} outside an array of {flat.size}")
        flat[inj.position] = inj.value
    return out


def injections(size: int, *, values: Sequence = SPECIAL_VALUES, positions: Sequence[int] | None = None,
               min_count: int = 1, max_count: int = 6, random_positions: bool = True
               ) -> st.SearchStrategy[list[Injection]]:
    """Lists of :class:`Injection` at distinct positions of an array of ``size`` elements.

    Positions come from ``positions`` (default :func:`boundary_positions`) and, when
    ``random_positions``, from anywhere in the array as well.
    """
    pool = tuple(boundary_positions(size) if positions is None else positions)
    if any(not 0 <= p < size for p in pool):
        raise ValueError(f"positions {pool} must lie in [0, {size})")
    vals = tuple(F32(v) for v in values)
    if not vals:
        raise ValueError("no special values to inject")
    position = st.sampled_from(pool)
    if random_positions:
        position = st.one_of(position, st.integers(0, size - 1))
    max_count = min(max_count, size)
    return st.lists(
        st.tuples(position, st.sampled_from(vals)).map(lambda pv: Injection(int(pv[0]), F32(pv[1]))),
        min_size=min(min_count, max_count), max_size=max_count, unique_by=lambda inj: inj.position)


def finite_f32(shape: tuple[int, ...], *, scale: float = 1.0, distribution: str = "normal"
               ) -> st.SearchStrategy[np.ndarray]:
    """Finite float32 arrays of ``shape`` from a drawn seed (``normal`` or ``uniform(-1, 1)``,
    times ``scale``)."""
    if distribution not in ("normal", "uniform"):
        raise ValueError(f"distribution must be 'normal' or 'uniform', got {distribution!r}")

    def build(seed: int) -> np.ndarray:
        rng = np.random.default_rng(seed)
        body = rng.standard_normal(shape) if distribution == "normal" else rng.uniform(-1, 1, shape)
        return (body * scale).astype(np.float32)

    return st.integers(0, 2**32 - 1).map(build)


@st.composite
def f32_with_specials(draw, shape: tuple[int, ...], *, values: Sequence = SPECIAL_VALUES,
                      positions: Sequence[int] | None = None, scale: float = 1.0,
                      min_count: int = 1, max_count: int = 6,
                      random_positions: bool = True) -> np.ndarray:
    """A finite float32 array of ``shape`` with specials injected (see :func:`injections`)."""
    body = draw(finite_f32(shape, scale=scale))
    size = int(np.prod(shape, dtype=np.int64))
    return inject(body, draw(injections(size, values=values, positions=positions,
                                        min_count=min_count, max_count=max_count,
                                        random_positions=random_positions)))


def tail_sizes(block: int = BLOCK) -> st.SearchStrategy[int]:
    """Lengths around block multiples (1, block +- 1, 2*block + 1, ...) and small odd ones."""
    near = [k * block + d for k in (1, 2, 4) for d in (-1, 0, 1)]
    return st.one_of(st.sampled_from([1, 2, 3, 31, 33, *near]), st.integers(1, 4 * block + 3))


def load_hypothesis_profile() -> str:
    """Register the ``ci`` (derandomised, no deadline, 60 examples) and ``dev`` (random, 200
    examples) hypothesis profiles and load ``$HYPOTHESIS_PROFILE`` (default ``ci``). Both test
    trees' conftests call this, so the profiles are defined once."""
    import os

    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "ci",
        derandomize=True,
        deadline=None,
        max_examples=60,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    settings.register_profile("dev", deadline=None, max_examples=200)
    name = os.environ.get("HYPOTHESIS_PROFILE", "ci")
    settings.load_profile(name)
    return name

