"""foxhunt.reference: the specification as code (NumPy, CPU).

The names a user needs most are importable from here: ``DQNConfig``, ``ParamLayout``, ``Batch``,
``Trainer``, ``loss_and_grads`` (loaded lazily, so importing one module stays cheap).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "DQNConfig": "config",
    "ParamLayout": "layout",
    "Batch": "batch",
    "Trainer": "trainer",
    "StepScalars": "backend",
    "TrainerBackend": "backend",
    "loss_and_grads": "step",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
