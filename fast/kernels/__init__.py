"""Fast-path kernel launchers: one module per area, one launcher per CUDA kernel, each under
the kernel's name (mirroring ``foxhunt.reference.kernels``).

Each area module defines ``KERNELS = {name: launcher}``; this package merges them into one
registry. A name defined twice is an error at import. An area whose module does not exist yet
is listed in ``MISSING_AREAS`` (the conformance registry turns that into failures); any other
import error propagates. Importing this package needs no GPU.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType

AREAS = ("dense", "distributional", "optim", "spectral", "safety", "replay", "isv", "fused")


def _collect() -> tuple[dict, tuple[str, ...]]:
    merged: dict = {}
    missing = []
    for area in AREAS:
        qualified = f"{__name__}.{area}"
        try:
            module = importlib.import_module(qualified)
        except ModuleNotFoundError as exc:
            if exc.name != qualified:
                raise  # the area exists but something it imports is missing
            missing.append(area)
            continue
        for name, fn in module.KERNELS.items():
            if name in merged:
                raise ImportError(
                    f"fast kernel {name!r} is defined in both "
                    f"{merged[name].__module__} and {fn.__module__}"
                )
            merged[name] = fn
    return merged, tuple(missing)


_kernels, MISSING_AREAS = _collect()
KERNELS = MappingProxyType(_kernels)

__all__ = ["AREAS", "KERNELS", "MISSING_AREAS"]
