"""Checkpoints: safetensors tensors + config JSON + layout fingerprint + an integrity hash.

Format (version 2, ``foxhunt-checkpoint-2``): one ``.safetensors`` file; tensors are the
trainer's ``state_dict()`` (params, target, Adam m/v/t, spectral-norm ``sn_u.*``/``sn_v.*``, ISV,
sentinel flags, Mech 6 slow EMA, step); metadata holds ``format``, ``config`` (JSON),
``fingerprint`` (the ISV layout fingerprint, 16 hex digits), ``param_layout`` (the parameter
layout's canonical text), the writing ``backend``, any caller extras, and ``sha256``: the
integrity hash (``integrity_hash``), a SHA-256 over

    json.dumps({"metadata": <every metadata entry but sha256>,
                "tensors": [[name, dtype.str, shape], ... in name order]},
               sort_keys=True, separators=(",", ":"))   (UTF-8)
    followed by each tensor's bytes in name order (little-endian, C order).

It covers what the file means (names, dtypes, shapes, values, metadata), not how safetensors
laid it out, so any tool can verify it from the decoded tensors.

Saving serialises in memory, writes a new temporary file in the target directory (created
with mode 0o666, so the process umask decides the final mode: 0o644 under the usual 0o022),
fsyncs it, renames it over the target and fsyncs the directory: a failed or interrupted save
never leaves a truncated file where a good one was, nor a temporary file behind (temporary
names are ``.<name>.<random hex>.tmp``).

Loading reads the file once and raises ``CheckpointError`` naming the file for anything
wrong with it, in this order: missing, empty, truncated or not a safetensors file, hash
mismatch (a damaged byte anywhere), unknown format, then the fingerprint (stored in the
metadata *and* in the ISV slots 115/116: ``CheckpointFingerprintMismatch``) and the layout.
There are no migrations. Files of version 1 (no hash, written before integrity hashes) still
load, with a warning on the ``foxhunt`` logger that damage cannot be detected in them; a
version-2 file without its hash is damaged and refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np

from . import isv as isv_mod
from .atomic import write_bytes_atomic
from .config import DQNConfig
from .layout import ParamLayout

FORMAT = "foxhunt-checkpoint-2"
#: The format before integrity hashes: loaded with a warning (see the module docstring).
LEGACY_FORMAT = "foxhunt-checkpoint-1"
HASH_KEY = "sha256"
#: safetensors: an 8-byte little-endian header length, the JSON header, then the tensor data.
_LENGTH_BYTES = 8

log = logging.getLogger("foxhunt")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, damaged, or of another format or layout.
    The message names the file."""


class CheckpointNotFound(CheckpointError, FileNotFoundError):
    """The checkpoint file does not exist (also a ``FileNotFoundError``)."""


class CheckpointFingerprintMismatch(CheckpointError, isv_mod.FingerprintMismatch):
    """The checkpoint was written for another ISV layout (also an ``isv.FingerprintMismatch``)."""


def integrity_hash(metadata: dict[str, str], tensors: dict[str, np.ndarray]) -> str:
    """SHA-256 hex digest of ``metadata`` (its ``sha256`` entry, if any, left out) and
    ``tensors``, by the recipe in the module docstring."""
    names = sorted(tensors)
    arrays = [np.asarray(tensors[n]) for n in names]
    arrays = [a.astype(a.dtype.newbyteorder("<"), copy=False) for a in arrays]
    described = {
        "metadata": {k: v for k, v in metadata.items() if k != HASH_KEY},
        "tensors": [[n, a.dtype.str, list(a.shape)] for n, a in zip(names, arrays)],
    }
    digest = hashlib.sha256(json.dumps(described, sort_keys=True, separators=(",", ":")).encode())
    for a in arrays:
        digest.update(np.ascontiguousarray(a).view(np.uint8))  # C-order bytes, copied only if needed
    return digest.hexdigest()


# --------------------------------------------------------------------------- writing
def save_checkpoint(path, config: DQNConfig, state: dict[str, np.ndarray], *, backend: str,
                    extra: dict[str, str] | None = None) -> Path:
    """Write ``state`` with its config, fingerprint, layout, ``backend``, ``extra`` metadata and
    integrity hash to ``path``, atomically; returns ``path``. An ``OSError`` (disk full,
    permissions) propagates after the temporary file is removed."""
    from safetensors.numpy import save

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
        if k in metadata or k == HASH_KEY:
            raise ValueError(f"extra metadata key {k!r} collides with a reserved key")
        metadata[k] = str(v)
    tensors = {k: np.ascontiguousarray(v) for k, v in state.items()}
    metadata[HASH_KEY] = integrity_hash(metadata, tensors)
    write_bytes_atomic(path, save(tensors, metadata=metadata))
    return path


# --------------------------------------------------------------------------- reading
def _where(path: Path) -> str:
    return f"checkpoint {str(path)!r}"


def _read_bytes(path: Path) -> bytes:
    if not path.exists():
        raise CheckpointNotFound(f"{_where(path)} does not exist")
    if not path.is_file():
        raise CheckpointError(f"{_where(path)} is not a regular file")
    data = path.read_bytes()
    if not data:
        raise CheckpointError(f"{_where(path)} is empty (0 bytes)")
    return data


def _parse_header(path: Path, data: bytes) -> dict[str, str]:
    """The metadata of the safetensors file ``data``, after checking that its header is valid
    JSON and that its length and the tensors' data offsets account for every byte."""
    short = f"{_where(path)} is truncated or not a safetensors checkpoint"
    if len(data) < _LENGTH_BYTES:
        raise CheckpointError(f"{short}: {len(data)} bytes, fewer than the {_LENGTH_BYTES}-byte "
                              "header length")
    n = int.from_bytes(data[:_LENGTH_BYTES], "little")
    body = len(data) - _LENGTH_BYTES
    if n > body:
        raise CheckpointError(f"{short}: its header length field says {n} bytes, only {body} "
                              "follow")
    try:
        header = json.loads(data[_LENGTH_BYTES:_LENGTH_BYTES + n].decode("utf-8"))
        meta = header.pop("__metadata__", {})
        end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
        if not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
            raise ValueError("__metadata__ is not a map of strings")
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise CheckpointError(f"{_where(path)} is damaged or not a safetensors checkpoint: its "
                              f"header is not valid ({exc})") from None
    want = _LENGTH_BYTES + n + end
    if want > len(data):
        raise CheckpointError(f"{_where(path)} is truncated: {len(data)} bytes, its header "
                              f"describes {want}")
    if want < len(data):
        raise CheckpointError(f"{_where(path)} is damaged: {len(data) - want} bytes after its "
                              "last tensor")
    return meta


def read_metadata(path) -> dict[str, str]:
    """The metadata of checkpoint ``path`` (its header only: the hash is not verified; it is by
    ``load_checkpoint``). Raises ``CheckpointError`` for a missing or malformed file."""
    path = Path(path)
    return _parse_header(path, _read_bytes(path))


def load_checkpoint(path) -> tuple[DQNConfig, dict[str, np.ndarray]]:
    """``(config, state)`` of a checkpoint, after checking (in order) that it is a complete
    safetensors file, its integrity hash, format, fingerprint and layout; each failure raises
    ``CheckpointError`` (or its subclasses) naming the file."""
    from safetensors.numpy import load

    path = Path(path)
    data = _read_bytes(path)
    meta = _parse_header(path, data)
    try:
        state = load(data)
    except Exception as exc:  # safetensors' own error class: say which file, and what
        raise CheckpointError(f"{_where(path)} is damaged: {exc}") from None
    stored = meta.get(HASH_KEY)
    if stored is not None and stored != integrity_hash(meta, state):
        raise CheckpointError(f"{_where(path)} is damaged: its contents do not match its "
                              f"{HASH_KEY} integrity hash")
    fmt = meta.get("format")
    if fmt == LEGACY_FORMAT and stored is None:
        log.warning("%s predates integrity hashes (format %r): loaded without a damage check; "
                    "save it again to add one", _where(path), fmt)
    elif fmt == FORMAT and stored is None:
        raise CheckpointError(f"{_where(path)} is damaged: its {HASH_KEY} integrity hash is "
                              "missing")
    elif fmt != FORMAT:
        raise CheckpointError(f"{_where(path)}: format {fmt!r}, expected {FORMAT!r} "
                              f"(or {LEGACY_FORMAT!r} without a hash)")
    ours = f"{isv_mod.layout_fingerprint():016x}"
    theirs = meta.get("fingerprint", "<missing>")
    if theirs != ours:
        raise CheckpointFingerprintMismatch(
            f"{_where(path)} has layout fingerprint 0x{theirs}, this build has 0x{ours}; "
            "there are no migrations"
        )
    try:
        config = DQNConfig.from_json(meta["config"])
    except (KeyError, TypeError, ValueError) as exc:  # a key of another version, say
        raise CheckpointError(f"{_where(path)}: its config does not load in this version "
                              f"({type(exc).__name__}: {exc})") from None
    if meta.get("param_layout") != ParamLayout(config).canonical():
        raise CheckpointError(f"{_where(path)}: parameter layout differs from the one its config "
                              "gives in this build")
    if "isv" in state:
        in_slots = f"{isv_mod.read_fingerprint(state['isv']):016x}"
        if in_slots != ours:
            raise CheckpointFingerprintMismatch(
                f"{_where(path)}: ISV slots hold fingerprint 0x{in_slots}, this build has 0x{ours}"
            )
    return config, state


def check_compatible(config: DQNConfig, path) -> None:
    """Raise ``CheckpointError`` naming both shapes if ``path`` was written for another layout."""
    theirs, _ = load_checkpoint(path)
    a, b = ParamLayout(theirs), ParamLayout(config)
    if a.canonical() != b.canonical():
        raise CheckpointError(
            f"{_where(path)} has {a.total_params} parameters ({theirs.branches} branches, "
            f"{theirs.num_atoms} atoms; {a.counts_text()}); this config has {b.total_params} "
            f"({config.branches}, {config.num_atoms} atoms; {b.counts_text()})"
        )
