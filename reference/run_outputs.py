"""Optional live outputs of ``foxhunt train``: Prometheus gauges and TensorBoard scalars.

Both are optional extras (``foxhunt[metrics]``, ``foxhunt[tensorboard]``); asking for one that
is not installed, or for a port that is busy, raises ``UsageError`` with one line saying what
to do. Each sink has ``epoch(record)`` (an ``EpochRecord``), ``step(scalars)`` (``StepScalars``
at a readback point) and ``close()``.

- ``PrometheusGauges(port, host, seed=)``: an HTTP server on ``host:port`` (``127.0.0.1`` unless
  the user says otherwise: the gauges say how a run is going, not something to publish on every
  interface) serving the gradient norms of the four budget sources (C51, CQL, IQN,
  ensemble) before and after their clips, every component's loss and the validation / test
  Sharpe. Every gauge has a ``seed`` label (the run's seed): the members of ``foxhunt train
  --seeds`` share one server, each writing under its own seed (``member(seed)``), so no member
  overwrites another's values.
- ``TensorBoardScalars(log_dir)``: every numeric field of each epoch record as
  ``epoch/<field>`` at step ``global_epoch``, and every numeric field of the readback-point
  step scalars as ``step/<field>`` at the training step. Written with ``tensorboard.summary``
  (no TensorFlow or PyTorch needed).
"""

from __future__ import annotations

import copy
import dataclasses
import errno
from pathlib import Path

from .backend import SOURCE_LOSS_FIELDS
from .config import BUDGET_SOURCES
from .runs import UsageError

DEFAULT_METRICS_HOST = "127.0.0.1"
#: Record / scalar fields that are positions or labels, not measurements.
_NOT_SCALARS = frozenset({"fold", "epoch", "global_epoch", "step", "read_at", "fresh", "flags",
                          "flagged"})


def numeric_fields(obj) -> dict[str, float]:
    """The numeric (int, float, bool as 0/1) fields of a dataclass instance, except labels."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.name not in _NOT_SCALARS and isinstance(value, (int, float)):
            out[f.name] = float(value)
    return out


class PrometheusGauges:
    def __init__(self, port: int, host: str = DEFAULT_METRICS_HOST, *, seed: int = 0):
        try:
            import prometheus_client as prom
        except ImportError:
            raise UsageError("--metrics-port needs prometheus-client: "
                             "pip install 'foxhunt[metrics]'") from None
        #: The ``seed`` label this sink writes under (``member`` makes one per seed).
        self.seed = int(seed)
        self._owner = True  # closes the server; a member view does not
        self.registry = prom.CollectorRegistry()
        self.grad_norm = prom.Gauge("foxhunt_grad_norm", "gradient L2 norm by component and stage",
                                    ["component", "stage", "seed"], registry=self.registry)
        self.loss = prom.Gauge("foxhunt_loss", "training loss by component", ["component", "seed"],
                               registry=self.registry)
        self.sharpe = prom.Gauge("foxhunt_sharpe", "Sharpe of the greedy policy at the last epoch",
                                 ["segment", "seed"], registry=self.registry)
        try:
            self.server, self.thread = prom.start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UsageError(f"--metrics-port {port}: {host}:{port} is already in use; choose "
                                 "another port (0 picks a free one)") from None
            raise UsageError(f"--metrics-port {port} --metrics-host {host}: cannot serve there: "
                             f"{exc.strerror or exc}") from None

    @property
    def address(self) -> tuple[str, int]:
        return self.server.server_address[:2]

    def member(self, seed: int) -> PrometheusGauges:
        """This server's gauges written under ``seed`` (a population member's sink); its
        ``close`` leaves the server to this sink's own."""
        view = copy.copy(self)
        view.seed, view._owner = int(seed), False
        return view

    def epoch(self, rec) -> None:
        seed = str(self.seed)
        for comp in BUDGET_SOURCES:  # c51, cql, iqn, ens: 0 for a source that is off
            self.grad_norm.labels(comp, "pre", seed).set(getattr(rec, f"{comp}_norm_pre"))
            self.grad_norm.labels(comp, "post", seed).set(getattr(rec, f"{comp}_norm_post"))
        for name in SOURCE_LOSS_FIELDS:
            self.loss.labels(name.removesuffix("_loss"), seed).set(getattr(rec, name))
        self.grad_norm.labels("total", "adam", seed).set(rec.grad_norm)
        for segment in ("val", "test"):
            value = getattr(rec, f"{segment}_sharpe", None)
            if value is not None:
                self.sharpe.labels(segment, seed).set(value)

    def step(self, scalars) -> None:
        pass  # the gauges follow epochs; a scrape every few seconds would not see steps anyway

    def close(self) -> None:
        if self._owner:
            self.server.shutdown()
            self.server.server_close()


class TensorBoardScalars:
    @staticmethod
    def writer_class():
        """``tensorboard.summary.Writer``; ``UsageError`` with the install hint if missing."""
        try:
            from tensorboard.summary import Writer
        except ImportError:
            raise UsageError("--tensorboard needs the tensorboard package: "
                             "pip install 'foxhunt[tensorboard]'") from None
        return Writer

    def __init__(self, log_dir: Path):
        self.log_dir = Path(log_dir)
        self.writer = self.writer_class()(str(self.log_dir))

    def epoch(self, rec) -> None:
        for name, value in numeric_fields(rec).items():
            self.writer.add_scalar(f"epoch/{name}", value, step=rec.global_epoch)
        self.writer.flush()

    def step(self, scalars) -> None:
        for name, value in numeric_fields(scalars).items():
            self.writer.add_scalar(f"step/{name}", value, step=scalars.step)

    def close(self) -> None:
        self.writer.close()
