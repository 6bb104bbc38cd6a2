"""Which walk evaluates a run's segments, per backend (issue 20, SPEC 10).

- A fast trainer (``backend_name == "fast"``: on the GPU, or the CPU executor's
  ``CpuTrainer``): ``foxhunt.fast.evaluator.DeviceEvaluator``, the greedy policy and the
  baselines walked on the device over the run's market tables (uploaded once), the metrics
  reduced there, one readback per segment.
- A fast population's member (``backend_name == "fast-member"``, with its own
  ``device_segments``): the same device walk over its engine view (issue 24).
- Any other trainer: ``None``, and the loop walks the host environment bar by bar
  (``loop.evaluate_segment``: one ``q_values`` call per bar), whose records the device walk
  reproduces (``kernels.env_walk.greedy_walk`` is the composition of the kernels' twins that
  proves it, ``tests/test_env_twin.py``).

The device's metrics are float32 (``kernels.env.eval_metrics``): ``segment_metrics_of`` turns
them into the ``metrics.SegmentMetrics`` the loop records, so both backends report the same
fields (the fast one rounded to float32 once; ``tests/test_device_eval.py``).
"""

from __future__ import annotations

import numpy as np

from .kernels import env as env_kernels
from .market import Bars
from .metrics import SegmentMetrics, equity_curve


def segment_metrics_of(values: np.ndarray, bars: int) -> SegmentMetrics:
    """``SegmentMetrics`` of ``eval_metrics``' output ``values`` (``EVAL_FIELDS`` order) for a
    walk of ``bars`` steps."""
    return SegmentMetrics(**{name: float(v) for name, v in zip(env_kernels.EVAL_FIELDS, values)},
                          bars=int(bars))


class DeviceSegments:
    """``loop.evaluate_segment``'s contract on a ``DeviceEvaluator``: ``evaluate(segment,
    policy, per_year, equity=)`` gives ``(SegmentMetrics, equity curve)``; the curve (float64,
    ``metrics.equity_curve`` of the read-back rewards) only when ``equity`` is asked for (the
    loop keeps the test segment's), else None."""

    def __init__(self, evaluator):
        self.evaluator = evaluator

    def evaluate(self, segment: tuple[int, int], policy: str, per_year: float, *,
                 equity: bool) -> tuple[SegmentMetrics, np.ndarray | None]:
        start, stop = segment
        out = self.evaluator.walk(start, stop, per_year, policy=policy, equity=equity)
        curve = equity_curve(out.rewards.astype(np.float64)) if equity else None
        return segment_metrics_of(out.metrics, stop - start - 1), curve

    def close(self) -> None:
        self.evaluator.close()


def device_segments(trainer, bars: Bars, feats: np.ndarray,
                    segments: list[tuple[int, int]]) -> DeviceSegments:
    """A ``DeviceEvaluator`` of a fast ``trainer`` (or a fast population's member) over ``bars``
    (with their ``feats``) for walks over ``segments`` (``[start, stop)`` each: they size its
    record rows)."""
    from foxhunt.fast.evaluator import DeviceEvaluator  # only when the run asked for it

    steps = max(stop - start - 1 for start, stop in segments)
    return DeviceSegments(DeviceEvaluator(trainer, env_kernels.market_tables(bars, feats),
                                          max_steps=steps))


def segment_evaluator(trainer, bars: Bars, feats: np.ndarray,
                      segments: list[tuple[int, int]]) -> DeviceSegments | None:
    """The device evaluator of a run over ``bars`` for walks over ``segments``
    (``device_segments``), or None where the trainer has no device walk (module docstring). A
    trainer with a ``device_segments(bars, feats, segments)`` method of its own (a fast
    population's member, ``foxhunt.fast.population.Member``; the lockstep runner's proxy of one,
    which builds and runs it in the population's thread) gives its own."""
    own = getattr(trainer, "device_segments", None)
    if callable(own):
        return own(bars, feats, segments)
    if getattr(trainer, "backend_name", None) != "fast":
        return None
    return device_segments(trainer, bars, feats, segments)


__all__ = ["DeviceSegments", "device_segments", "segment_evaluator", "segment_metrics_of"]
