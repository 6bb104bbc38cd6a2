"""The training loop's files under ``out_dir/checkpoints``: best checkpoints and the resume state.

- ``fold{k}_best.safetensors``: the trainer at fold ``k``'s best epoch (chosen on validation).
- ``last.safetensors`` (the trainer, ``trainer.save``) and ``last.loop.npz`` beside it (the
  loop: position, the collector's cycle counter (the offset of every random draw: the whole
  RNG state), records, fold results, halt counters, and within a fold the collector's replay
  ring and walks, read back from the device on the fast backend), written at the end of every
  epoch. The pair is
  committed together: both are written to temporary files first, then renamed into place one
  right after the other, and ``last.loop.npz`` names the trainer step it belongs to, so a
  torn pair is detected on resume instead of resuming from a mix.
- ``last.loop.npz`` holds the arrays by name and ``meta``: JSON text written with Python's
  ``json`` (``NaN`` tokens allowed: this file is read only by the loop, and a NaN loss must
  come back as NaN, not as null, for a resumed run to equal the uninterrupted one).

Every file is written to a temporary name (``.<name>.*.tmp``) in the same directory and then
``os.replace``d; ``remove_stale_temporaries`` deletes those an earlier crash left. A failed
write (``OSError``: disk full, permissions) logs one warning through
``logging.getLogger("foxhunt")`` naming the file and the error; the run goes on.

The resume pair is written in the background: ``save_resume`` takes the snapshot at once (the
trainer's ``state_dict()`` and the collector's ``state()``, both host copies, and the meta as
JSON text) and hands it to a writer thread (serialising, hashing, writing, fsync and the two
renames: 0.13 s an epoch with the 52 MB replay ring of a 60,000-bar run, profile on the H200),
so the next epoch trains meanwhile. ``wait()`` joins that thread: ``save_resume`` waits for
the previous write first, the loop waits before it returns (also on an error or a stop), and
so does every read of the store. A writer's ``OSError`` is the warning above, logged when it
happens; any other exception is raised again by ``wait()``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .atomic import TMP_SUFFIX, fsync_directory, open_temporary
from .backend import StepScalars
from .config import DQNConfig
from .market import Bars

LOG = logging.getLogger("foxhunt")

FORMAT = "foxhunt-loop-state-5"  # 2: second-wave scalars, replay labels; 3: the cycle counter
# 4: records time training (train_s) and evaluation (eval_s) apart; 5: the replay's n-step
# discount and the collector's n-step windows (issue 22)
CHECKPOINTS = "checkpoints"
LAST_TRAINER = "last.safetensors"
LAST_LOOP = "last.loop.npz"


class ResumeError(ValueError):
    """No resume state, or one that does not belong to this run (config, settings, data)."""


def best_name(fold: int) -> str:
    return f"fold{fold}_best.safetensors"


def data_hash(bars: Bars) -> str:
    """``runs.bars_sha256(bars)``: the hash ``config.json`` records for the run's data."""
    from .runs import bars_sha256  # runs imports the loop: imported when first needed

    return bars_sha256(bars)


@dataclass
class Progress:
    """Where a run stands: the next epoch to run (``fold``, ``epoch``), whether it is ``done``
    (completed or halted), its records and fold results so far, the grad-collapse counter,
    and (as saved) the collector's cycle counter, the last readback, and within a fold the
    collector's state (``replay``: its arrays, ``replay_meta``: the rest)."""

    fold: int = 0
    epoch: int = 0
    done: bool = False
    halted: str | None = None
    records: list = field(default_factory=list)
    folds: list = field(default_factory=list)
    low_grad_epochs: int = 0
    cycle: int = 0
    last_scalars: StepScalars | None = None
    replay: dict | None = None
    replay_meta: dict | None = None

    def advance(self, fold: int, epoch: int, settings) -> None:
        """Epoch ``epoch`` of fold ``fold`` has finished: move to the next one."""
        self.fold, self.epoch = (fold, epoch + 1) if epoch + 1 < settings.epochs else (fold + 1, 0)
        self.done = bool(self.halted) or self.fold >= settings.folds


def _remove_quietly(path) -> None:
    # already gone, or not removable: nothing more to do about it
    with contextlib.suppress(OSError):
        os.unlink(path)


class CheckpointStore:
    """The ``checkpoints`` directory of a run (see the module docstring)."""

    def __init__(self, out_dir: Path):
        self.dir = Path(out_dir) / CHECKPOINTS
        self._writer: threading.Thread | None = None
        self._writer_error: BaseException | None = None
        self._writer_ok = True
        self._data_hash: tuple[Bars, str] | None = None  # (the bars, their hash): one run's bars

    def data_hash(self, bars: Bars) -> str:
        """``data_hash(bars)``, computed once for the run's bars (not once per epoch)."""
        if self._data_hash is None or self._data_hash[0] is not bars:
            self._data_hash = (bars, data_hash(bars))
        return self._data_hash[1]

    def wait(self) -> bool:
        """Join the background write of the resume pair, if any: True if it was written (or
        there was none), False if it failed with an ``OSError`` (already warned); any other
        exception of the writer is raised here."""
        writer, self._writer = self._writer, None
        if writer is None:
            return True
        writer.join()
        error, ok = self._writer_error, self._writer_ok
        self._writer_error, self._writer_ok = None, True
        if error is not None:
            raise error
        return ok

    def remove_stale_temporaries(self) -> list[Path]:
        """Delete the temporary files (``.*.tmp``) an interrupted write left; returns them."""
        removed = []
        if self.dir.is_dir():
            for path in sorted(self.dir.glob(f".*{TMP_SUFFIX}")):
                try:
                    path.unlink()
                    removed.append(path)
                except OSError as exc:
                    LOG.warning("could not remove the stale temporary file %s: %s", path, exc)
        return removed

    def _guarded(self, what: str, write) -> bool:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            write()
            return True
        except OSError as exc:
            LOG.warning("could not write %s: %s; the run goes on without it", what, exc)
            return False

    def save_best(self, trainer, fold: int) -> str | None:
        """``trainer`` as fold ``fold``'s best checkpoint; its path, or None if the write failed
        (an older ``fold{k}_best`` is then removed: it is not the best epoch any more)."""
        path = self.dir / best_name(fold)
        if self._guarded(str(path), lambda: trainer.save(path)):
            return str(path)
        _remove_quietly(path)
        return None

    def save_resume(self, trainer, progress: Progress, config: DQNConfig, settings, bars: Bars,
                    collector) -> bool:
        """Snapshot the resume pair for ``progress`` (after ``advance``) and start writing it in
        the background (module docstring); returns ``wait()``'s answer for the previous write.
        """
        previous = self.wait()
        meta = {
            "format": FORMAT, "config": config.to_dict(), "settings": dataclasses.asdict(settings),
            "data_sha256": self.data_hash(bars), "trainer_step": int(trainer.step_count),
            "fold": progress.fold, "epoch": progress.epoch, "done": progress.done,
            "halted": progress.halted, "low_grad_epochs": progress.low_grad_epochs,
            "cycle": progress.cycle, "last_scalars": dataclasses.asdict(progress.last_scalars),
            "records": [dataclasses.asdict(r) for r in progress.records],
            "folds": [dataclasses.asdict(f) for f in progress.folds],
        }
        arrays = {}
        if not progress.done and progress.epoch > 0:  # the next epoch continues this fold
            arrays, meta["replay"] = collector.state()  # host copies
        # The snapshot: everything the writer needs, nothing it reads from live objects.
        meta_text = json.dumps(meta)
        state = trainer.state_dict()  # host copies (both backends)
        trainer_config, backend = trainer.config, trainer.backend_name
        loop_path, trainer_path = self.dir / LAST_LOOP, self.dir / LAST_TRAINER
        pending = self.dir / f".{LAST_TRAINER}.pending{TMP_SUFFIX}"

        def write() -> None:
            from .checkpoint import save_checkpoint

            temporaries = [pending]
            try:
                fd, tmp = open_temporary(loop_path)
                temporaries.append(tmp)
                with os.fdopen(fd, "wb") as fh:
                    np.savez(fh, meta=np.array(meta_text), **arrays)
                    fh.flush()
                    os.fsync(fh.fileno())
                save_checkpoint(pending, trainer_config, state, backend=backend)
                # The commit: two renames, back to back (meta["trainer_step"] detects a tear).
                os.replace(pending, trainer_path)
                os.replace(tmp, loop_path)
                fsync_directory(self.dir)
            finally:
                for name in temporaries:
                    _remove_quietly(name)

        def writer() -> None:
            try:
                self._writer_ok = self._guarded(f"the resume state {trainer_path} + {loop_path.name}",
                                                write)
            except BaseException as exc:  # noqa: BLE001  (raised again by wait())
                self._writer_ok, self._writer_error = False, exc

        self._writer = threading.Thread(target=writer, name="foxhunt-resume-writer")
        self._writer.start()
        return previous

    def read(self) -> tuple[dict, dict[str, np.ndarray]]:
        """``(meta, arrays)`` of ``last.loop.npz``; ``ResumeError`` if there is none."""
        self.wait()
        path = self.dir / LAST_LOOP
        if not path.is_file():
            raise ResumeError(f"{path}: no resume state (the run finished no epoch, or this is "
                              "not a run directory)")
        try:
            with np.load(path, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
            meta = json.loads(str(arrays.pop("meta")[()]))
        except (OSError, ValueError, KeyError) as exc:
            raise ResumeError(f"{path}: unreadable resume state ({exc})") from None
        if meta.get("format") != FORMAT:
            raise ResumeError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
        return meta, arrays

    def load(self, trainer, config: DQNConfig, settings, bars: Bars) -> Progress:
        """Restore ``trainer`` from ``last.safetensors`` and return the saved ``Progress``;
        ``ResumeError`` if the saved run had another config, settings or data, or if the pair
        is torn."""
        from .checkpoint import load_checkpoint
        from .loop import LoopSettings

        meta, arrays = self.read()
        where = self.dir / LAST_LOOP
        try:
            saved_config, saved_settings = DQNConfig.from_dict(meta["config"]), LoopSettings(**meta["settings"])
        except (TypeError, ValueError) as exc:  # written by a version with other fields
            raise ResumeError(f"{where}: the saved config or loop settings do not fit this "
                              f"version ({exc})") from None
        _same("config", saved_config, config, where)
        _same("loop setting", saved_settings, settings, where)
        if meta["data_sha256"] != self.data_hash(bars):
            raise ResumeError(f"{where}: the run was trained on other bars (data SHA-256 "
                              f"{meta['data_sha256'][:12]}..., these {self.data_hash(bars)[:12]}...)")
        trainer_path = self.dir / LAST_TRAINER
        _, state = load_checkpoint(trainer_path)
        trainer.load_state_dict(state)
        if trainer.step_count != meta["trainer_step"]:
            raise ResumeError(f"{trainer_path} is at step {trainer.step_count} but {where} at step "
                              f"{meta['trainer_step']} (a write was interrupted between the two); "
                              "cannot resume")
        progress = Progress(
            fold=meta["fold"], epoch=meta["epoch"], done=meta["done"], halted=meta["halted"],
            records=records_from_dicts(meta["records"]), folds=folds_from_dicts(meta["folds"]),
            low_grad_epochs=meta["low_grad_epochs"], cycle=meta["cycle"],
            last_scalars=StepScalars(**{**meta["last_scalars"],
                                        "flags": tuple(meta["last_scalars"]["flags"])}))
        if meta.get("replay") is not None:
            progress.replay, progress.replay_meta = arrays, meta["replay"]
        return progress


def _same(what: str, saved, current, where: Path) -> None:
    if saved != current:
        diff = [f"{f.name}={getattr(current, f.name)!r} (saved {getattr(saved, f.name)!r})"
                for f in dataclasses.fields(current) if getattr(saved, f.name) != getattr(current, f.name)]
        raise ResumeError(f"{where}: {what} differs from the saved run's: {', '.join(diff)}")


def records_from_dicts(items: list[dict]) -> list:
    from .loop import EpochRecord

    return [EpochRecord(**d) for d in items]


def folds_from_dicts(items: list[dict]) -> list:
    from .loop import FoldResult, FoldSegments
    from .metrics import SegmentMetrics

    def metrics(d: dict) -> dict:
        return {k: SegmentMetrics(**v) for k, v in d.items()}

    return [FoldResult(**{**d, "segments": FoldSegments(**{k: tuple(v) for k, v in d["segments"].items()}),
                          "flat": metrics(d["flat"]), "buy_hold": metrics(d["buy_hold"]),
                          "best": metrics(d["best"])}) for d in items]


def saved_epochs(out_dir: Path) -> int:
    """How many epoch records the resume state in ``out_dir`` holds."""
    meta, _ = CheckpointStore(out_dir).read()
    return len(meta["records"])
