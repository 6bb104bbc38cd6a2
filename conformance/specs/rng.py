"""Entry of the counter-based generator's conformance kernel (``cuda_src/rng.cu``, reference
``foxhunt.reference.kernels.rng``).

``philox_uniform`` is integer arithmetic plus one exact int -> float conversion, so its output
is compared bit for bit. It has no float input (nothing to poison). The samples cover offsets
with a non-zero high word and a key with both words set, so that every counter and key word
is exercised; the contract checks that every draw lies in ``(0, 1)`` on the 2**-24 grid of
odd multiples.
"""

from __future__ import annotations

import numpy as np

from foxhunt.conformance.kernel_spec import Dims, Kwargs, SpecEntry
from foxhunt.conformance.specs.inputs import error_cases, f32, replace
from foxhunt.conformance.tolerance import Tolerance
from foxhunt.reference.kernels.rng import MAX_INDEX, STREAMS

#: Bit for bit (integer arithmetic, exact conversion).
BITWISE = Tolerance.exact(bitwise=True, nan_payload=False)


def _word(rng) -> int:
    return int(rng.integers(0, MAX_INDEX, dtype=np.uint64))


def _s_philox_uniform(d: Dims, rng) -> Kwargs:
    """``d.flat`` draws (crosses block boundaries with a tail) of a random stream id, a random
    64-bit key and an offset whose high word is set (``odd``: a high word of 0, the common case
    of a step count below 2**32)."""
    return {"n": d.flat, "key_lo": _word(rng), "key_hi": _word(rng),
            "stream": int(rng.choice(list(STREAMS.values()))), "offset_lo": _word(rng),
            "offset_hi": 0 if d.case == "odd" else _word(rng)}


def _c_philox_uniform(kwargs, outputs, poisoned) -> list[str]:
    out = outputs["out"].astype(np.float64)
    problems = []
    if out.shape != (kwargs["n"],):
        problems.append(f"out: shape {out.shape}, expected ({kwargs['n']},)")
    if out.size and not (np.all(out > 0) and np.all(out < 1)):
        problems.append("out: a draw outside the open interval (0, 1)")
    grid = out * 2.0**24
    if out.size and not np.all((grid == np.round(grid)) & (np.round(grid) % 2 == 1)):
        problems.append("out: a draw that is not an odd multiple of 2**-24")
    return problems


ENTRIES: tuple[SpecEntry, ...] = (
    SpecEntry(
        name="philox_uniform",
        outputs={"out": f32(BITWISE)},
        sample=_s_philox_uniform,
        targets=(),  # integer arguments only: no float to poison
        errors=error_cases(
            _s_philox_uniform,
            lambda k: replace(k, n=-1),
            lambda k: replace(k, key_lo=MAX_INDEX),
            lambda k: replace(k, offset_hi=-1),
            lambda k: replace(k, stream=1.5),
        ),
        contract=_c_philox_uniform,
    ),
)
