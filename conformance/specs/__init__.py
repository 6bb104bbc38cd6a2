"""The kernel entries, one module per area (the areas of ``foxhunt.reference.kernels``).

Each area module ``foxhunt.conformance.specs.<area>`` defines ``ENTRIES``, a tuple of
:class:`~foxhunt.conformance.kernel_spec.SpecEntry` built by keyword, one per kernel of that
area (the shared input generators and contracts are in :mod:`.inputs`). This package merges them
into :data:`SPEC_TABLE`, ``{kernel name: SpecEntry}``. A reference area without an entries
module fails the import (naming the module to add), and so does a name entered twice.

A kernel in a new area: add ``reference/kernels/<area>.py`` (and the area to the reference's
``AREAS``), then ``conformance/specs/<area>.py`` with its ``ENTRIES``.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import Mapping

from foxhunt.conformance.kernel_spec import SpecEntry


def collect_entries(areas) -> dict[str, SpecEntry]:
    """``{name: entry}`` over the ``ENTRIES`` of ``foxhunt.conformance.specs.<area>``."""
    table: dict[str, SpecEntry] = {}
    where: dict[str, str] = {}
    for area in areas:
        qualified = f"{__name__}.{area}"
        try:
            module = importlib.import_module(qualified)
        except ModuleNotFoundError as exc:
            if exc.name != qualified:
                raise
            raise ImportError(f"reference kernel area {area!r} has no conformance entries: add "
                              f"conformance/specs/{area}.py with its ENTRIES") from None
        for entry in module.ENTRIES:
            if entry.name in table:
                raise ImportError(f"kernel {entry.name!r} has entries in both {where[entry.name]} "
                                  f"and {qualified}")
            table[entry.name] = entry
            where[entry.name] = qualified
    return table


def _reference_areas() -> tuple[str, ...]:
    from foxhunt.reference.kernels import AREAS

    return AREAS


#: Every kernel's entry, by name, in area order.
SPEC_TABLE: Mapping[str, SpecEntry] = MappingProxyType(collect_entries(_reference_areas()))

__all__ = ["SPEC_TABLE", "collect_entries"]
