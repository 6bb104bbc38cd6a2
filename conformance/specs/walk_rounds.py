"""Entries of the chunked walk's area (reference ``foxhunt.reference.kernels.walk_rounds``):
walk.cu's ``greedy_walk_round``, tested as the evaluator runs it, its rounds composed (twin
``walk_rounds.greedy_walk_chunked``). Its samples, bounds and contract are
:func:`foxhunt.conformance.specs.walk.chunked_entry`'s (that module's docstring).
"""

from __future__ import annotations

from foxhunt.conformance.specs.walk import ENTRY_OF_TWIN
from foxhunt.reference.kernels.walk_rounds import KERNELS as ROUND_TWINS

ENTRIES = tuple(ENTRY_OF_TWIN[twin](name) for name, twin in ROUND_TWINS.items())

__all__ = ["ENTRIES"]
