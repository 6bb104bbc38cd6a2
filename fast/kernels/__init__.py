"""Fast-path kernel launchers: one module per area, one launcher per CUDA kernel, each under
the kernel's name (mirroring ``foxhunt.reference.kernels``).

Each area module defines ``KERNELS = {name: launcher}``; this package merges them into one
registry. A name defined twice is an error at import. Importing this package needs no GPU.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType

AREAS = ("dense", "distributional", "optim", "spectral", "safety", "replay", "isv", "fused", "step", "rng", "iqn", "aux", "ensemble", "warmup", "env", "wave", "isv_producers", "walk", "walk_rounds", "collect", "live_support", "trunk")


def _collect() -> dict:
    merged: dict = {}
    for area in AREAS:
        module = importlib.import_module(f"{__name__}.{area}")
        for name, fn in module.KERNELS.items():
            if name in merged:
                raise ImportError(
                    f"fast kernel {name!r} is defined in both "
                    f"{merged[name].__module__} and {fn.__module__}"
                )
            merged[name] = fn
    return merged


KERNELS = MappingProxyType(_collect())

__all__ = ["AREAS", "KERNELS"]
