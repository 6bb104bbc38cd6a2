"""Seed lists as users write them: ``"0-15"``, ``"0,3,7"``, ``"0-3,8"`` (the one syntax of
``foxhunt train --seeds``, ``foxhunt sweep --seeds`` and the long-run parity's ``--seeds``)."""

from __future__ import annotations

import re

#: The most seeds one spec may list: a typo like ``0-999999999`` is refused before it is expanded.
MAX_SEEDS = 10_000
_ITEM = re.compile(r"([0-9]+)(?:-([0-9]+))?", re.ASCII)


def seed_ranges(text: str, limit: int) -> tuple[int, ...]:
    """The seeds of ``text`` in the order written: comma-separated items, each an integer >= 0
    or an inclusive range ``a-b`` with ``a <= b`` (spaces around items allowed). ``ValueError``
    with the reason (the bad item; a range that runs backwards; more than ``limit`` seeds,
    counted before a range is expanded, so ``0-999999999`` is refused at once). Duplicates are
    the caller's rule."""
    seeds: list[int] = []
    for item in text.split(","):
        item = item.strip()
        match = _ITEM.fullmatch(item)
        if match is None:
            raise ValueError(f"{item!r} is not a seed or a range" if item else "an empty item")
        first = int(match[1])
        last = first if match[2] is None else int(match[2])
        if last < first:
            raise ValueError(f"range {item!r} runs backwards")
        if len(seeds) + (last - first + 1) > limit:
            raise ValueError(f"more than {limit} seeds")
        seeds.extend(range(first, last + 1))
    return tuple(seeds)


__all__ = ["MAX_SEEDS", "seed_ranges"]
