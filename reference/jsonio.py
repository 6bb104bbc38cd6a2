"""JSON output that is always valid JSON: every file foxhunt writes goes through here.

``json.dumps`` writes ``NaN`` and ``Infinity`` by default, which are not JSON (RFC 8259) and
which strict readers (``jq``, JavaScript's ``JSON.parse``, Go) reject. Here a non-finite float
becomes ``null``; NumPy scalars and arrays become Python numbers and lists; tuples become
lists; dataclasses become dicts; ``Path`` becomes a string. Anything else is a ``TypeError``.

- ``dumps(obj, indent=None)``: the text (``allow_nan=False`` after the conversion, so a
  non-finite value that slipped through fails loudly instead of writing bad JSON).
- ``write_json(path, obj)``: atomic (``atomic.write_bytes_atomic``): a reader never sees a
  half-written file, a failed write leaves the old file as it was.
- ``append_jsonl(path, obj)``: one line, flushed, for metrics streams.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path, PurePath
from typing import Any

import numpy as np

from .atomic import write_bytes_atomic

def to_jsonable(obj: Any) -> Any:
    """``obj`` with non-finite floats as ``None`` and NumPy / tuple / dataclass / path values
    converted to plain JSON types (recursively). Dict keys become strings."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, (int, np.integer)) and not isinstance(obj, np.bool_):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        value = float(obj)
        return value if math.isfinite(value) else None
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, np.ndarray):
        return to_jsonable(obj.tolist())
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(dataclasses.asdict(obj))
    if isinstance(obj, PurePath):
        return str(obj)
    raise TypeError(f"cannot write a {type(obj).__name__} as JSON: {obj!r}")


def dumps(obj: Any, *, indent: int | None = None) -> str:
    """JSON text of ``obj`` (see ``to_jsonable``); keys keep their order."""
    return json.dumps(to_jsonable(obj), indent=indent, allow_nan=False)


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically (``atomic.write_bytes_atomic``): on any
    error the temporary file is removed and ``path`` is unchanged."""
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_json(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` as indented JSON to ``path`` atomically (``write_text_atomic``)."""
    return write_text_atomic(path, dumps(obj, indent=2) + "\n")


def append_jsonl(path: str | Path, obj: Any) -> None:
    """Append ``obj`` as one JSON line to ``path`` and flush it."""
    line = dumps(obj) + "\n"
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line)
        fh.flush()


def read_object(path: str | Path) -> dict | None:
    """The JSON object in file ``path``, or None when the file is missing, unreadable, not
    valid JSON or holds something else (a run's ``summary.json`` or a population's
    ``population.json`` before it is whole)."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def read_jsonl(path: str | Path) -> list[Any]:
    """The records of a JSON-lines file (blank lines skipped)."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
