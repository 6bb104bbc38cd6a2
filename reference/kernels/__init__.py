"""Reference kernels: one plain-NumPy function per CUDA kernel, under the kernel's name.

Each area module (``dense``, ``distributional``, ``optim``, ``spectral``, ``safety``,
``replay``, ``isv``) defines a ``KERNELS`` dict ``{name: function}``; this package merges
them into one registry. A name defined twice is an error at import, never a silent
override. ``cuda_src/`` and ``foxhunt.fast.kernels`` use exactly these names.
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
                    f"reference kernel {name!r} is defined in both "
                    f"{merged[name].__module__} and {fn.__module__}"
                )
            merged[name] = fn
    return merged


KERNELS = MappingProxyType(_collect())

__all__ = ["AREAS", "KERNELS"]
