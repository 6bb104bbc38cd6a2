"""cuBLASLt's algorithm choices kept on disk between processes: the GEMMs' twin of the kernel
cache (``fast._build``).

A plan asks cuBLASLt's heuristic (``cublasLtMatmulAlgoGetHeuristic``) for its algorithm; on the
H200 that took about 3.4 ms per distinct GEMM, 0.19 s of every ``seed`` trainer's construction
(56 distinct GEMMs). ``AlgoStore`` keeps the answers in ``<cache root>/cublaslt/<fingerprint>.json``
(``_build.cache_root``: ``$FOXHUNT_CACHE_DIR``, else ``$XDG_CACHE_HOME/foxhunt``, else
``~/.cache/foxhunt``). The fingerprint is a sha256 over :data:`FORMAT`, the cuBLASLt version and
the device (name, compute capability, multiprocessor count): the heuristic's inputs besides the
GEMM itself, so a stored answer is the one the heuristic gives there, the same algorithm and the
same bits. An entry maps a plan's key (``gemm.PlanCache.key``: the GEMM's spec, alignment and
workspace limit, as text) to the heuristic result's bytes (hex).

``gemm.PlanCache`` uses a stored algorithm only after ``cublasLtMatmulAlgoCheck`` accepted it for
the plan's descriptors (``GemmPlan(verify=True)``); one it rejects is forgotten and asked again.
Every new answer is written at once (the whole file, to a temporary file in the same folder,
then ``os.replace``: a reader never sees a torn file); an unreadable or foreign file counts as
empty and is rewritten; a failed write is a warning, never an error (the store is a cache).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path

#: The file format (part of the fingerprint: a new format never reads an old file).
FORMAT = "foxhunt-cublaslt-algos-2"
#: The store's subfolder of the cache root.
SUBDIR = "cublaslt"


def fingerprint(lt_version: int, device) -> str:
    """sha256 (hex) over :data:`FORMAT`, the cuBLASLt version and ``device``'s ``name``,
    ``compute_capability`` and ``multiprocessor_count``."""
    text = "\0".join((FORMAT, str(int(lt_version)), device.name,
                      "%d.%d" % tuple(device.compute_capability),
                      str(int(device.multiprocessor_count))))
    return hashlib.sha256(text.encode()).hexdigest()


def key_text(key) -> str:
    """A plan key (``PlanCache.key``: frozen dataclasses, ints and floats) as the store's text."""
    return repr(key)


class AlgoStore:
    """``AlgoStore(path)``: the stored answers of one file (``None``: nothing is read or kept on
    disk; the store then only answers what was put in this process)."""

    def __init__(self, path: Path | None):
        self.path = None if path is None else Path(path)
        self._algos: dict[str, bytes] = self._read() if self.path is not None else {}

    @classmethod
    def for_device(cls, device, lt_version: int, root: Path | None = None) -> AlgoStore:
        """The store of ``device`` with cuBLASLt ``lt_version`` under ``root`` (default:
        ``_build.cache_root()``)."""
        if root is None:
            from foxhunt.fast._build import cache_root

            root = cache_root()
        return cls(Path(root) / SUBDIR / f"{fingerprint(lt_version, device)}.json")

    def __len__(self) -> int:
        return len(self._algos)

    def get(self, key) -> bytes | None:
        """The stored heuristic result of ``key``, or None."""
        return self._algos.get(key_text(key))

    def put(self, key, result: bytes) -> None:
        """Keep ``result`` for ``key`` and write the file (when the store has one)."""
        self._algos[key_text(key)] = bytes(result)
        self._write()

    def forget(self, key) -> None:
        """Drop ``key`` (a stored algorithm cuBLASLt rejected) and write the file."""
        if self._algos.pop(key_text(key), None) is not None:
            self._write()

    def _read(self) -> dict[str, bytes]:
        try:
            payload = json.loads(self.path.read_text())
            if payload.get("format") != FORMAT or payload.get("file") != self.path.name:
                return {}
            return {str(k): bytes.fromhex(v) for k, v in payload["algos"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {}  # missing, torn by an old writer, foreign: asked again and rewritten

    def _write(self) -> None:
        if self.path is None:
            return
        payload = {"format": FORMAT, "file": self.path.name,
                   "algos": {k: v.hex() for k, v in sorted(self._algos.items())}}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w") as handle:
                    json.dump(payload, handle)
                os.replace(tmp, self.path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as exc:
            warnings.warn(f"foxhunt: could not write the cuBLASLt algorithm cache {self.path}: "
                          f"{exc}", stacklevel=3)


__all__ = ["FORMAT", "SUBDIR", "AlgoStore", "fingerprint", "key_text"]
