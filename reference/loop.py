"""The backend-agnostic training loop: walk-forward folds, experience, epochs, evaluation, resume.

The bar series after the feature warm-up is cut into ``folds`` contiguous, non-overlapping
windows ``F0..Fk`` in time order; each window is cut, in time order, into a **training**
segment, a **validation** segment (``val_frac`` of the window: chooses the best epoch) and a
**test** segment (``test_frac``: reported, never used to choose) (SPEC 10). Within a fold:

- ``n_envs`` parallel walks over the training segment collect experience with epsilon-greedy
  exploration, independently per branch (epsilon decays linearly over the first
  ``explore_frac`` of all epochs), into a prioritised replay buffer of ``n_step``-step
  transitions (discounted reward sums over up to ``n_step`` steps, shorter at episode ends,
  each with its effective discount ``gamma_ref ** k``; ``collector`` module);
- each epoch runs ``steps_per_epoch`` training steps (300, the seeds' epoch), one environment
  step of every walk per training step, priorities updated from the step's TD errors;
- the experience is a collector's (``collector.fold_collector``): the cycle of the device
  kernels (act, env step, replay add, sample, step, priority update), run by their NumPy twins
  on the reference backend and as one captured graph per cycle on the fast backend (no host
  synchronisation between the readback points). Every random draw (exploration, episode
  starts, replay sampling) is the counter-based generator's at the global cycle counter, so a
  cycle gives the same actions and samples on both backends;
- at epoch end the greedy policy is evaluated on the validation and the test segment
  (``metrics.segment_metrics``: Sharpe annualised from the data's own bar spacing, total
  return, max drawdown, turnover, costs): a walk of the host environment with one
  ``q_values`` call per bar, or for a fast trainer the whole walk on the device with one
  readback per segment (``evaluator.segment_evaluator``; its metrics are float32); the epoch
  with the best **validation** Sharpe is
  the fold's best (checkpointed as ``fold{k}_best.safetensors``), and its test metrics are the
  fold's result; the flat and buy-and-hold baselines are evaluated once per fold on the same
  segments;
- each record times the epoch's collection and training (``train_s``: on the fast backend
  one graph per cycle does both, so only their sum exists) and its evaluation (``eval_s``);
- ``halt_nan`` stops the run at a non-finite loss readback, ``halt_grad_collapse`` when the
  gradient norm stays below 1e-8 for 5 consecutive epochs; both name the flagged sentinel slots.

At each fold boundary the trainer's ``fold_boundary()`` runs (Mech 3/4, ISV fold reset,
sentinel flags reset) and the replay buffer is emptied (a new market window); the cycle
counter runs on.

Stopping and resuming: ``should_stop()`` is checked before every epoch and after every
training step; when it returns True the loop stops at once (the epoch in progress is not
recorded) and returns with ``interrupted=True``. With ``out_dir`` the loop writes the resume
state at the end of every epoch (``loop_state``); ``resume=True`` continues from it and ends
bitwise where the uninterrupted run ends. A failed checkpoint write logs a warning through
``logging.getLogger("foxhunt")`` and the run goes on.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from . import loop_state, sentinels
from .backend import READBACK_FIELDS, StepScalars, TrainerBackend, get_backend
from .collector import fold_collector, nstep_gamma
from .config import DQNConfig, require_int, require_positive, require_range
from .env import BranchingEnv, rollout
from .evaluator import segment_evaluator
from .isv_step import adaptive_on, sharpe_ema
from .kernels.replay import MAX_N_STEP
from .market import (DEFAULT_WINDOWS, N_POSITION_FEATURES, Bars, feature_warmup,
                     market_features, n_market_features, regime_labels)
from .metrics import (METRIC_NAMES, SegmentMetrics, bar_seconds, bars_per_year, equity_curve,
                      segment_metrics)

LOG = logging.getLogger("foxhunt")

GRAD_COLLAPSE_NORM = 1e-8
GRAD_COLLAPSE_EPOCHS = 5
#: The smallest fold, and the smallest validation and test segments, in bars.
MIN_FOLD_BARS = 64
MIN_EVAL_BARS = 16
#: The segments every fold is evaluated on, in time order after training.
EVAL_SEGMENTS = ("val", "test")


@dataclass(frozen=True)
class LoopSettings:
    """Everything about a run that is not the network: data split, exploration, outputs."""

    folds: int = 2
    epochs: int = 3
    steps_per_epoch: int = 300
    n_envs: int = 16
    #: Shares of each fold's window: validation (chooses the best epoch), then test (reported).
    val_frac: float = 0.125
    test_frac: float = 0.125
    replay_capacity: int = 50_000
    warmup_transitions: int = 1024
    eps_start: float = 1.0
    eps_end: float = 0.05
    explore_frac: float = 0.6
    #: Rewards are per-bar fractional returns (~1e-4); they are scaled into the C51 support.
    reward_scale: float = 1000.0
    seed: int = 0
    #: Environment steps per transition (issue 22: n-step returns, ``collector`` module); 1 is
    #: 1-step. ``foxhunt train`` uses 3 for the ``seed`` preset unless ``--n-step`` says.
    n_step: int = 1

    def __post_init__(self) -> None:
        for name in ("folds", "epochs", "steps_per_epoch", "n_envs", "replay_capacity"):
            require_int(name, getattr(self, name), minimum=1)
        require_int("warmup_transitions", self.warmup_transitions, minimum=0)
        require_int("seed", self.seed, minimum=0)
        # Each at most 0.45: the training segment keeps at least 10% of the fold.
        for name in ("val_frac", "test_frac"):
            require_range(name, getattr(self, name), 0.05, 0.45)
        require_positive("reward_scale", self.reward_scale)
        for name in ("eps_start", "eps_end", "explore_frac"):
            require_range(name, getattr(self, name), 0.0, 1.0)
        if (isinstance(self.n_step, bool) or not isinstance(self.n_step, int)
                or not 1 <= self.n_step <= MAX_N_STEP):
            raise ValueError(f"n_step={self.n_step!r}: must be an integer in [1, {MAX_N_STEP}]")


#: The ``StepScalars`` fields an epoch record carries over (the epoch-end readback): every
#: read-back field but the per-step clip diagnostics and the target mean.
STEP_FIELDS = tuple(name for name in READBACK_FIELDS
                    if name not in ("clip_bound", "safety_clip_fired", "mean_target_q"))
#: Wall-clock fields of a record: the only ones that differ between identical runs.
TIMING_FIELDS = ("train_s", "eval_s", "steps_per_s")


@dataclass
class EpochRecord:
    """One finished epoch: the epoch-end readback, then the greedy policy's metrics on the
    fold's validation (``val_*``) and test (``test_*``) segments (``metrics.METRIC_NAMES``),
    then the wall-clock seconds of the epoch's collection and training steps (``train_s``,
    through the epoch-end readback) and of its evaluation (``eval_s``)."""

    fold: int
    epoch: int
    global_epoch: int
    steps: int
    loss: float
    c51_loss: float
    cql_loss: float
    grad_norm: float
    c51_norm_pre: float
    c51_norm_post: float
    cql_norm_pre: float
    cql_norm_post: float
    mean_q: float
    iqn_loss: float
    iqn_norm_pre: float
    iqn_norm_post: float
    ens_loss: float
    ens_norm_pre: float
    ens_norm_post: float
    aux_next_bar_loss: float
    aux_regime_loss: float
    mse_loss: float
    mse_weight: float
    epsilon: float
    val_sharpe: float
    val_total_return: float
    val_max_drawdown: float
    val_turnover: float
    val_costs: float
    test_sharpe: float
    test_total_return: float
    test_max_drawdown: float
    test_turnover: float
    test_costs: float
    train_s: float
    eval_s: float
    steps_per_s: float
    flagged: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class FoldSegments:
    """A fold's bar ranges ``[start, stop)``: training, then validation, then test."""

    train: tuple[int, int]
    val: tuple[int, int]
    test: tuple[int, int]


@dataclass
class FoldResult:
    """A fold's baselines (flat, buy-and-hold: per segment name) and its best epoch, chosen on
    the validation Sharpe, with that epoch's metrics and test-segment equity curve."""

    fold: int
    segments: FoldSegments
    flat: dict[str, SegmentMetrics]
    buy_hold: dict[str, SegmentMetrics]
    buy_hold_equity: list[float]
    best_epoch: int | None = None
    best: dict[str, SegmentMetrics] = field(default_factory=dict)
    best_equity: list[float] = field(default_factory=list)
    checkpoint: str | None = None


@dataclass
class RunResult:
    records: list[EpochRecord]
    halted: str | None
    interrupted: bool
    folds: list[FoldResult]
    bar_seconds: float
    bars_per_year: float

    @property
    def status(self) -> str:
        """``"halted"``, ``"interrupted"`` or ``"completed"``."""
        return "halted" if self.halted else "interrupted" if self.interrupted else "completed"


def choose_windows(state_dim: int) -> tuple[int, ...]:
    """The longest prefix of the default feature windows whose features fit ``state_dim``."""
    for k in range(len(DEFAULT_WINDOWS), 0, -1):
        w = DEFAULT_WINDOWS[:k]
        if n_market_features(w) + N_POSITION_FEATURES <= state_dim:
            return w
    raise ValueError(
        f"state_dim={state_dim}: too small for the market features "
        f"(need at least {n_market_features(DEFAULT_WINDOWS[:1]) + N_POSITION_FEATURES})"
    )


def fold_segments(n_bars: int, warmup: int, folds: int, val_frac: float,
                  test_frac: float) -> list[FoldSegments]:
    """Per fold over bars ``[warmup, n_bars)``: ``width = (n_bars - warmup) // folds`` bars,
    ``int(width * val_frac)`` validation and ``int(width * test_frac)`` test bars at its end,
    training before them."""
    width = (n_bars - warmup) // folds
    n_val, n_test = int(width * val_frac), int(width * test_frac)
    if width < MIN_FOLD_BARS or min(n_val, n_test) < MIN_EVAL_BARS:
        raise ValueError(
            f"{n_bars} bars give {folds} folds of {max(width, 0)} bars after the {warmup}-bar "
            f"feature warm-up ({n_val} validation, {n_test} test); need at least {MIN_FOLD_BARS} "
            f"per fold and {MIN_EVAL_BARS} per validation and test segment (use fewer folds, "
            f"more bars or larger val_frac/test_frac)")
    out = []
    for f in range(folds):
        start = warmup + f * width
        stop = start + width
        val, test = stop - n_test - n_val, stop - n_test
        out.append(FoldSegments(train=(start, val), val=(val, test), test=(test, stop)))
    return out


def _greedy(q_values: Callable[[np.ndarray], list], states: np.ndarray) -> np.ndarray:
    return np.stack([q.argmax(axis=1) for q in q_values(states)], axis=1).astype(np.int32)


#: Fixed actions of the baselines per branch (exposure, order type, urgency): a market order
#: placed now, flat (exposure 1) or long (exposure 2); cut to the config's branches.
BASELINE_ACTIONS = {"flat": (1, 0, 0), "buy_hold": (2, 0, 0)}


def evaluate(trainer: TrainerBackend | None, bars: Bars, feats: np.ndarray, state_dim: int,
             branches, start: int, stop: int, policy: str = "greedy") -> dict[str, np.ndarray]:
    """One walk over bars ``[start, stop)`` (``stop - start - 1`` steps, starting flat) by the
    ``greedy`` policy of ``trainer`` or a baseline of ``BASELINE_ACTIONS`` (``trainer`` unused).
    Returns ``{"rewards", "positions", "costs"}``: float64 ``[stop - start - 1]`` each (the
    position is the one held during each bar)."""
    env = BranchingEnv(bars.slice(0, stop), feats[:stop], state_dim=state_dim, n_envs=1,
                       branches=branches, auto_reset=False, min_start=0)
    if policy == "greedy":
        q_values = trainer.frozen_q_values()  # the trainer does not step during the walk
        act = lambda states: _greedy(q_values, states)  # noqa: E731
    elif policy in BASELINE_ACTIONS:
        fixed = np.array([BASELINE_ACTIONS[policy][: len(branches)]], np.int32)
        act = lambda states: fixed  # noqa: E731
    else:
        raise ValueError(f"policy={policy!r}: allowed values are 'greedy', "
                         f"{', '.join(repr(p) for p in BASELINE_ACTIONS)}")
    out = rollout(env, act, stop - start - 1, start_idx=start)
    return {"rewards": out["rewards"][:, 0].astype(np.float64),
            "positions": out["positions"][:, 0].astype(np.float64),
            "costs": out["costs"][:, 0].astype(np.float64)}


def evaluate_segment(trainer, bars, feats, config: DQNConfig, segment: tuple[int, int], policy: str,
                     per_year: float) -> tuple[SegmentMetrics, np.ndarray]:
    """``(metrics, equity curve)`` of ``policy`` on bars ``segment``."""
    walk = evaluate(trainer, bars, feats, config.state_dim, config.branches, *segment, policy)
    return (segment_metrics(walk["rewards"], walk["positions"], walk["costs"], per_year),
            equity_curve(walk["rewards"]))


def _evaluate(evaluator, trainer, bars, feats, config, segment, policy, per_year, *,
              equity: bool):
    """``evaluate_segment``, or the device walk where the run has one (``evaluator``: the
    equity curve only where ``equity`` asks for it)."""
    if evaluator is None:
        return evaluate_segment(trainer, bars, feats, config, segment, policy, per_year)
    return evaluator.evaluate(segment, policy, per_year, equity=equity)


def _epsilon(settings: LoopSettings, global_epoch: int) -> float:
    total = settings.folds * settings.epochs
    return settings.eps_end + (settings.eps_start - settings.eps_end) * max(
        0.0, 1.0 - global_epoch / max(1.0, settings.explore_frac * total))


def _flags_text(scalars: StepScalars) -> str:
    return sentinels.format_flags(np.asarray(scalars.flags, np.int32))


def run(config: DQNConfig, bars: Bars, settings: LoopSettings, *, backend: str = "reference",
        out_dir: Path | None = None, on_step: Callable[[int, StepScalars], None] | None = None,
        on_epoch: Callable[[EpochRecord], None] | None = None,
        on_epoch_start: Callable[[int, int], None] | None = None,
        should_stop: Callable[[], bool] | None = None, resume: bool = False,
        trainer: TrainerBackend | None = None) -> RunResult:
    """Train ``config`` on ``bars`` with ``settings``; see the module docstring.

    ``trainer``: a ready trainer of ``config`` and ``settings.seed`` (a population member in
    lockstep, ``population_runner``) used instead of a new one of ``backend``.

    ``resume=True`` continues the run whose resume state is in ``out_dir`` (same config,
    settings and bars, else ``loop_state.ResumeError``); its records are in the result, and
    ``on_epoch`` is called for new epochs only.
    """
    if resume and out_dir is None:
        raise ValueError("resume=True needs out_dir (the run directory holding the resume state)")
    nstep_gamma(config, settings.n_step)  # n-step transitions need 0 < gamma_ref < 1
    if config.aux_regime_on:  # the regime head's classes must cover the market's labels
        top = int(regime_labels(bars).max(initial=0))
        if top >= config.n_regimes:
            raise ValueError(f"n_regimes={config.n_regimes}: the market's regime labels reach {top}; "
                             f"need n_regimes >= {top + 1} for aux_regime_weight > 0")
    # Every trainer is built for its transitions: n-step ones carry ``batch.discount`` (a trainer
    # factory that cannot take ``n_step`` can still run 1-step loops).
    n_step = {"n_step": settings.n_step} if settings.n_step > 1 else {}
    if trainer is None:
        trainer = get_backend(backend)(config, seed=settings.seed, **n_step)
    elif trainer.config != config or trainer.seed != settings.seed:
        raise ValueError(f"trainer: seed {trainer.seed} and its config are not the run's (seed "
                         f"{settings.seed}); allowed: a trainer of the run's config and seed")
    windows = choose_windows(config.state_dim)
    feats = market_features(bars, windows)
    segments = fold_segments(len(bars), feature_warmup(windows), settings.folds, settings.val_frac,
                             settings.test_frac)
    spacing = bar_seconds(bars.timestamp)
    per_year = bars_per_year(spacing)
    store = loop_state.CheckpointStore(Path(out_dir)) if out_dir is not None else None
    if store is not None:
        store.remove_stale_temporaries()
    st = loop_state.Progress()
    if resume:
        st = store.load(trainer, config, settings, bars)
    result = lambda interrupted: RunResult(st.records, st.halted, interrupted, st.folds,  # noqa: E731
                                           spacing, per_year)
    if st.done:
        return result(False)
    held = st.last_scalars  # what the trainer's stale readback held before an interruption
    resumed_at = trainer.step_count if resume else None
    stop = should_stop or (lambda: False)
    collector = None
    evaluator = segment_evaluator(trainer, bars, feats, [getattr(seg, name) for seg in segments
                                                          for name in EVAL_SEGMENTS])
    try:
        for fold in range(st.fold, settings.folds):
            seg = segments[fold]
            if collector is not None:
                collector.close()
            collector = fold_collector(trainer, config, bars, feats, seg.train, settings, st.cycle)
            if st.epoch > 0:  # resuming inside a fold: its replay and walks come back as saved
                collector.load_state(st.replay, st.replay_meta)
            else:
                if stop():
                    return result(True)
                if fold > 0:
                    trainer.fold_boundary()
                st.folds.append(_baselines(fold, seg, bars, feats, config, per_year, evaluator))
                collector.warmup(trainer, max(settings.warmup_transitions, config.batch_size))
            fold_result = st.folds[fold]
            for epoch in range(st.epoch, settings.epochs):
                if stop():
                    return result(True)
                if on_epoch_start:
                    on_epoch_start(fold, epoch)
                trainer.set_epoch(epoch)  # ISV EPOCH_IDX: the MSE warm-up's clock, per fold
                g = fold * settings.epochs + epoch
                eps = _epsilon(settings, g)
                if adaptive_on(config):  # the schedules' horizon (ISV TOTAL_EPOCHS), epsilon (41)
                    trainer.set_loop_signals(total_epochs=settings.epochs, epsilon=(
                        eps, max(settings.eps_start, settings.eps_end)))
                tic = time.perf_counter()
                collector.begin_epoch(eps)
                for i in range(settings.steps_per_epoch):
                    scalars = collector.cycle_step(trainer)
                    if held is not None and not scalars.fresh and scalars.read_at < resumed_at:
                        scalars = dataclasses.replace(held, step=scalars.step, fresh=False)
                    if on_step:
                        on_step(i, scalars)
                    if stop():
                        return result(True)
                    if scalars.fresh and not scalars.all_finite():
                        break
                scalars = trainer.end_epoch()
                held = None
                train_s = time.perf_counter() - tic
                tic = time.perf_counter()
                metrics, equity = {}, {}
                for name in EVAL_SEGMENTS:
                    metrics[name], equity[name] = _evaluate(
                        evaluator, trainer, bars, feats, config, getattr(seg, name), "greedy",
                        per_year, equity=name == "test")
                eval_s = time.perf_counter() - tic
                rec = EpochRecord(
                    fold=fold, epoch=epoch, global_epoch=g, steps=scalars.step,
                    **{name: getattr(scalars, name) for name in STEP_FIELDS}, epsilon=eps,
                    **{f"{s}_{m}": getattr(metrics[s], m) for s in EVAL_SEGMENTS
                       for m in METRIC_NAMES},
                    train_s=train_s, eval_s=eval_s,
                    steps_per_s=settings.steps_per_epoch / max(train_s, 1e-9),
                    flagged=sentinels.flagged_names(np.asarray(scalars.flags, np.int32)),
                )
                st.records.append(rec)
                if adaptive_on(config):  # ISV SHARPE_EMA, the adaptive EMA rates' input
                    trainer.set_loop_signals(sharpe_ema=sharpe_ema(
                        trainer.isv_value("SHARPE_EMA"), rec.val_sharpe))
                if on_epoch:
                    on_epoch(rec)
                if fold_result.best_epoch is None or rec.val_sharpe > fold_result.best["val"].sharpe:
                    fold_result.best_epoch, fold_result.best = epoch, metrics
                    fold_result.best_equity = equity["test"].tolist()
                    if store is not None:
                        fold_result.checkpoint = store.save_best(trainer, fold)
                if not scalars.all_finite():
                    st.halted = (f"halt_nan at fold {fold} epoch {epoch}: flagged slots "
                                 f"{_flags_text(scalars)}")
                collapsed = scalars.grad_norm < GRAD_COLLAPSE_NORM
                st.low_grad_epochs = st.low_grad_epochs + 1 if collapsed else 0
                if not st.halted and st.low_grad_epochs >= GRAD_COLLAPSE_EPOCHS:
                    st.halted = (f"halt_grad_collapse at fold {fold} epoch {epoch}: gradient norm < "
                                 f"{GRAD_COLLAPSE_NORM} for {GRAD_COLLAPSE_EPOCHS} epochs; flagged "
                                 f"slots {_flags_text(scalars)}")
                st.advance(fold, epoch, settings)
                if store is not None:
                    st.cycle, st.last_scalars = collector.cycle, scalars
                    store.save_resume(trainer, st, config, settings, bars, collector)
                if st.halted:
                    return result(False)
    except KeyboardInterrupt:  # fallback: the CLI's signal handlers normally set should_stop
        return result(True)
    finally:
        if collector is not None:
            collector.close()
        if evaluator is not None:
            evaluator.close()
        if store is not None:  # the resume pair is written in the background: on disk now
            store.wait()
    return result(False)


def _baselines(fold: int, seg: FoldSegments, bars, feats, config, per_year,
               evaluator) -> FoldResult:
    """The fold's flat and buy-and-hold metrics on its validation and test segments."""
    flat, buy_hold, bh_equity = {}, {}, None
    for name in EVAL_SEGMENTS:
        segment, test = getattr(seg, name), name == "test"
        flat[name], _ = _evaluate(evaluator, None, bars, feats, config, segment, "flat",
                                  per_year, equity=False)
        buy_hold[name], eq = _evaluate(evaluator, None, bars, feats, config, segment,
                                       "buy_hold", per_year, equity=test)
        if test:
            bh_equity = eq.tolist()
    return FoldResult(fold=fold, segments=seg, flat=flat, buy_hold=buy_hold, buy_hold_equity=bh_equity)


def resume_epochs(out_dir) -> int:
    """How many epoch records the resume state in ``out_dir`` holds (``ResumeError`` if none)."""
    return loop_state.saved_epochs(Path(out_dir))
