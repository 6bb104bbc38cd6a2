"""Run directories a user can manage (SPEC 10, "Runs are safe to manage").

- Every ``foxhunt train`` without ``--out`` gets a new directory ``runs/<UTC time>-seed<N>``
  (``-2``, ``-3``, ... appended if that name is taken); ``runs/latest`` is a relative symlink
  to the newest, replaced atomically (a new link under a temporary name, then ``os.replace``).
- An explicit ``--out`` that exists and is not empty is refused unless ``--overwrite`` (its
  files are removed first, so no stale checkpoint of the old run survives; only a directory
  that holds a foxhunt run is ever cleared) or ``--resume``.
- One writer per run directory: ``lock_run_dir`` takes an exclusive lock on
  ``RUN_DIR/.foxhunt.lock`` (``filelock``: ``flock`` on POSIX, ``msvcrt`` on Windows; released
  by the OS if the process dies) and fails at once, naming the directory, if it is held.
- ``config.json`` holds everything needed to rebuild the run: the ``DQNConfig``, the
  ``LoopSettings``, the backend and the data source with a SHA-256 of the bars
  (``write_run_config`` / ``read_run_config`` / ``load_bars``), so that ``--resume`` and
  ``foxhunt eval`` rebuild exactly what was trained on.

Errors a user can fix raise ``UsageError`` (a ``ValueError``) with one line naming the path.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from . import jsonio
from .config import DQNConfig
from .loop import LoopSettings
from .market import Bars
from .settings_io import section_from_dict

#: Where runs go when ``--out`` is not given, and the name of the link to the newest.
RUNS_ROOT = Path("runs")
LATEST = "latest"
LOCK_NAME = ".foxhunt.lock"
CONFIG_NAME = "config.json"
SUMMARY_NAME = "summary.json"
METRICS_NAME = "metrics.jsonl"
#: ``config.json`` format version (bumped when a key changes meaning).
CONFIG_FORMAT = 1
#: Market names of the synthetic data (``SyntheticMarket.preset``).
MARKETS = ("default", "strong_trend")


class UsageError(ValueError):
    """A mistake the user can fix; the message is one line naming what, which value, and what
    is allowed. The CLI prints it and exits with status 2."""


# ---------------------------------------------------------------------------------- directories
def new_run_dir(root: Path, seed: int | str, now: dt.datetime | None = None) -> Path:
    """Create and return a new, empty ``root/<UTC time>-seed<seed>[-k]`` directory (``seed``
    may be a label: a population's ``s0-15``)."""
    now = now or dt.datetime.now(dt.timezone.utc)
    base = f"{now.strftime('%Y%m%dT%H%M%SZ')}-seed{seed}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        for k in range(1, 1000):
            path = root / (base if k == 1 else f"{base}-{k}")
            try:
                path.mkdir()  # exist_ok=False: two runs started in one second never share one
                return path
            except FileExistsError:
                continue
    except OSError as exc:
        raise UsageError(f"cannot create a run directory under {root}: {exc.strerror}") from None
    raise UsageError(f"{root}: 999 runs named {base}-* already exist")


def point_latest(root: Path, run_dir: Path) -> bool:
    """Make ``root/latest`` a symlink to ``run_dir`` (atomically). Returns False, changing
    nothing, if ``root/latest`` is a real directory (an older foxhunt's default ``--out``) or
    the file system has no symlinks."""
    link = root / LATEST
    if link.is_dir() and not link.is_symlink():
        return False
    tmp = root / f".{LATEST}.{os.getpid()}.tmp"
    try:
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        tmp.symlink_to(os.path.relpath(run_dir, root), target_is_directory=True)
        os.replace(tmp, link)
    except OSError:
        if tmp.is_symlink():
            tmp.unlink()
        return False
    return True


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` holds (the start of) a foxhunt run."""
    return (path / CONFIG_NAME).is_file() or (path / LOCK_NAME).exists()


def check_out_dir(path: Path, *, overwrite: bool, resume: bool) -> Path:
    """Create ``--out`` if needed and refuse what would destroy another run; returns it.

    Refused (``UsageError``): a path that is a file or under a file, a directory that cannot be
    created, and a non-empty directory unless ``overwrite`` or ``resume``.
    """
    if path.exists() and not path.is_dir():
        raise UsageError(f"--out {path}: is a file, not a directory; choose a directory")
    if path.is_dir() and any(path.iterdir()):
        if not (overwrite or resume):
            raise UsageError(f"--out {path}: directory is not empty (an earlier run?); pass "
                             "--overwrite to replace it, --resume to continue it, or another --out")
        if overwrite and not is_run_dir(path):
            raise UsageError(f"--out {path}: not empty and holds no foxhunt run (no {CONFIG_NAME}); "
                             "--overwrite only replaces a run directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {path}: cannot create the directory: {exc.strerror}") from None
    return path


def clear_run_dir(path: Path) -> None:
    """Remove every entry of the run directory ``path`` except its lock file (``--overwrite``)."""
    for entry in path.iterdir():
        if entry.name == LOCK_NAME:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def lock_run_dir(path: Path):
    """Take the run directory's writer lock (released by ``.release()`` or process exit).

    Raises ``UsageError`` if another process holds it, or if the directory is not writable.
    """
    import filelock

    lock = filelock.FileLock(path / LOCK_NAME, timeout=0)
    try:
        lock.acquire()
    except filelock.Timeout:
        raise UsageError(f"{path}: another foxhunt process is writing to this run directory "
                         f"(it holds {path / LOCK_NAME}); wait for it or choose another --out") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot write to the run directory: {exc.strerror}") from None
    return lock


def truncate_lines(path: Path, n: int) -> int:
    """Keep the first ``n`` non-empty lines of ``path`` (atomically); returns how many it kept.
    A missing file is created empty."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True) if path.exists() else []
    kept = [line for line in lines if line.strip()][:n]
    jsonio.write_text_atomic(path, "".join(kept))
    return len(kept)


# ---------------------------------------------------------------------------------- provenance
def foxhunt_version() -> str:
    try:
        return metadata.version("foxhunt")
    except metadata.PackageNotFoundError:
        return "unknown"


def git_commit() -> dict | None:
    """``{"commit", "dirty"}`` of the source checkout this package runs from, or None when it is
    not a git checkout (an installed wheel) or git is missing."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(here), *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()

    try:
        top = Path(git("rev-parse", "--show-toplevel")).resolve()
        if top / "reference" != here:  # a venv inside some other repository
            return None
        return {"commit": git("rev-parse", "HEAD"),
                "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return None


def bars_sha256(bars: Bars) -> str:
    """SHA-256 over the bars' fields (name, dtype, shape and bytes of each, in field order):
    the same bars give the same hash whatever file or generator they came from."""
    h = hashlib.sha256()
    for f in dataclasses.fields(bars):
        value = getattr(bars, f.name)
        if value is None:
            continue
        h.update(f"{f.name}:{value.dtype.str}:{value.shape}".encode())
        h.update(value.tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------- data sources
def synthetic_source(market: str, n_bars: int, seed: int) -> dict:
    return {"kind": "synthetic", "market": market, "bars": n_bars, "seed": seed}


def csv_source(path: Path) -> dict:
    return {"kind": "csv", "path": str(Path(path).resolve())}


def describe_source(source: dict) -> str:
    if source["kind"] == "csv":
        return f"CSV {source['path']}"
    return f"synthetic market '{source['market']}', {source['bars']} bars, seed {source['seed']}"


def load_bars(source: dict) -> Bars:
    """The bars of a data source (``synthetic_source`` / ``csv_source``). A CSV problem raises
    ``UsageError`` naming the file; a recorded ``sha256`` that does not match raises too."""
    from .market import SyntheticMarket, load_csv

    if source["kind"] == "csv":
        path = Path(source["path"])
        if not path.is_file():
            raise UsageError(f"--data {path}: no such file")
        try:
            bars = load_csv(path)
        except ValueError as exc:
            raise UsageError(f"--data {path}: {exc}") from None
    elif source["kind"] == "synthetic":
        bars = SyntheticMarket.preset(source["market"], seed=source["seed"],
                                      n_bars=source["bars"]).generate()
    else:
        raise UsageError(f"data source kind {source['kind']!r}: allowed are 'csv', 'synthetic'")
    expected = source.get("sha256")
    if expected is not None and bars_sha256(bars) != expected:
        raise UsageError(f"{describe_source(source)}: the data changed since the run started "
                         f"(SHA-256 {bars_sha256(bars)[:12]}..., recorded {expected[:12]}...)")
    return bars


# ---------------------------------------------------------------------------------- config.json
@dataclass(frozen=True)
class RunConfig:
    """What ``config.json`` records: enough to rebuild the run."""

    config: DQNConfig
    settings: LoopSettings
    data: dict  # a data source with its "sha256"
    backend: str = "reference"
    preset: str | None = None
    threads: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {"format": CONFIG_FORMAT, "foxhunt_version": foxhunt_version(),
                "backend": self.backend, "preset": self.preset, "threads": self.threads,
                "config": self.config.to_dict(), "loop": dataclasses.asdict(self.settings),
                "data": self.data}


def write_run_config(run_dir: Path, run: RunConfig) -> Path:
    return jsonio.write_json(run_dir / CONFIG_NAME, run.to_dict())


def read_run_config(run_dir: Path) -> RunConfig:
    """Read ``run_dir/config.json``; ``UsageError`` naming the file if it is missing or bad."""
    import json

    path = Path(run_dir) / CONFIG_NAME
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"{run_dir}: no {CONFIG_NAME}; not a foxhunt run directory") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path}: cannot read it: {exc}") from None
    if not isinstance(raw, dict) or raw.get("format") != CONFIG_FORMAT:
        raise UsageError(f"{path}: format {raw.get('format') if isinstance(raw, dict) else None!r} "
                         f"is not readable by this foxhunt (format {CONFIG_FORMAT})")
    try:
        return RunConfig(config=section_from_dict("config", raw["config"], str(path)),
                         settings=section_from_dict("loop", raw["loop"], str(path)),
                         data=raw["data"], backend=raw["backend"], preset=raw.get("preset"),
                         threads=raw.get("threads", 1))
    except KeyError as exc:
        raise UsageError(f"{path}: no {exc} entry") from None
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc) if str(path) in str(exc) else f"{path}: {exc}") from None
