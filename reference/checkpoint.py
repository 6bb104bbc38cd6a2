"""Checkpoints: safetensors tensors + config JSON + layout fingerprint in the metadata.

Format (version 1): one ``.safetensors`` file; tensors are the trainer's ``state_dict()``
(params, target, Adam m/v/t, spectral-norm ``sn_u.*``/``sn_v.*``, ISV, sentinel flags, Mech 6
slow EMA, step); metadata holds ``format``, ``config`` (JSON), ``fingerprint`` (the ISV layout
fingerprint, 16 hex digits), ``param_layout`` (the parameter layout's canonical text), the
writing ``backend``, and any caller extras (e.g. the training loop's RNG state).

Saving writes a temporary file in the target directory, flushes it to disk, then renames it
over the target: a failed or interrupted save never leaves a truncated file where a good one
was. Loading checks the fingerprint (stored in the metadata *and* in the ISV slots 115/116) and
the layout before returning anything; there are no migrations.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from . import isv as isv_mod
from .config import DQNConfig
from .layout import ParamLayout

FORMAT = "foxhunt-checkpoint-1"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this version (format, fingerprint or layout)."""


def save_checkpoint(path, config: DQNConfig, state: dict[str, np.ndarray], *, backend: str,
                    extra: dict[str, str] | None = None) -> Path:
    from safetensors.numpy import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {
        "format": FORMAT,
        "config": config.to_json(),
        "fingerprint": f"{isv_mod.layout_fingerprint():016x}",
        "param_layout": ParamLayout(config).canonical(),
        "backend": backend,
    }
    for k, v in (extra or {}).items():
        if k in metadata:
            raise ValueError(f"extra metadata key {k!r} collides with a reserved key")
        metadata[k] = str(v)
    tensors = {k: np.ascontiguousarray(v) for k, v in state.items()}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def read_metadata(path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as fh:
        return dict(fh.metadata() or {})


def load_checkpoint(path) -> tuple[DQNConfig, dict[str, np.ndarray]]:
    """``(config, state)`` of a checkpoint, after checking format, fingerprint and layout."""
    from safetensors.numpy import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    meta = read_metadata(path)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {str(path)!r}: format {meta.get('format')!r}, expected {FORMAT!r}")
    ours = f"{isv_mod.layout_fingerprint():016x}"
    theirs = meta.get("fingerprint", "<missing>")
    if theirs != ours:
        raise isv_mod.FingerprintMismatch(
            f"checkpoint {str(path)!r} has layout fingerprint 0x{theirs}, this build has 0x{ours}; "
            "there are no migrations"
        )
    config = DQNConfig.from_json(meta["config"])
    layout_text = ParamLayout(config).canonical()
    if meta.get("param_layout") != layout_text:
        raise CheckpointError(
            f"checkpoint {str(path)!r}: parameter layout differs from the one its config gives "
            "in this build"
        )
    state = load_file(str(path))
    if "isv" in state:
        stored = isv_mod.read_fingerprint(state["isv"])
        if f"{stored:016x}" != ours:
            raise isv_mod.FingerprintMismatch(
                f"checkpoint {str(path)!r}: ISV slots hold fingerprint 0x{stored:016x}, "
                f"this build has 0x{ours}"
            )
    return config, state


def check_compatible(config: DQNConfig, path) -> None:
    """Raise ``CheckpointError`` naming both shapes if ``path`` was written for another layout."""
    theirs, _ = load_checkpoint(path)
    a, b = ParamLayout(theirs), ParamLayout(config)
    if a.canonical() != b.canonical():
        raise CheckpointError(
            f"checkpoint {str(path)!r} has {a.total_params} parameters ({theirs.branches} branches, "
            f"{theirs.num_atoms} atoms); this config has {b.total_params} ({config.branches}, "
            f"{config.num_atoms} atoms)"
        )
