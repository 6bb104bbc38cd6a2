"""The backend-agnostic training loop: walk-forward folds, experience, epochs, evaluation.

For each fold ``F0..Fk`` (contiguous, non-overlapping windows of the bar series, in time
order), the first ``train_frac`` of the window is the training segment and the rest is the
held-out evaluation segment. Within a fold:

- ``n_envs`` parallel walks over the training segment collect experience with epsilon-greedy
  exploration, independently per branch (epsilon decays linearly over the first
  ``explore_frac`` of all epochs), into a prioritised replay buffer;
- each epoch runs ``steps_per_epoch`` training steps (300, the seeds' epoch), one environment
  step of every walk per training step, priorities updated from the step's TD errors;
- at epoch end the greedy policy is evaluated on the held-out segment: annualised Sharpe of
  its per-bar rewards; the best epoch of the fold is checkpointed;
- ``halt_nan`` stops the run at a non-finite loss readback, ``halt_grad_collapse`` when the
  gradient norm stays below 1e-8 for 5 consecutive epochs; both name the flagged sentinel slots.

At each fold boundary the trainer's ``fold_boundary()`` runs (Mech 3/4, ISV fold reset,
sentinel flags reset) and the replay buffer is emptied (a new market window).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from . import sentinels
from .backend import StepScalars, TrainerBackend, get_backend
from .config import DQNConfig, require_int, require_positive, require_range
from .env import BranchingEnv, annualised_sharpe, equity_curve
from .market import (DEFAULT_WINDOWS, N_POSITION_FEATURES, Bars, feature_warmup,
                     market_features, n_market_features)
from .replay import ReplayBuffer

GRAD_COLLAPSE_NORM = 1e-8
GRAD_COLLAPSE_EPOCHS = 5


@dataclass(frozen=True)
class LoopSettings:
    """Everything about a run that is not the network: data split, exploration, outputs."""

    folds: int = 2
    epochs: int = 3
    steps_per_epoch: int = 300
    n_envs: int = 16
    train_frac: float = 0.75
    replay_capacity: int = 50_000
    warmup_transitions: int = 1024
    eps_start: float = 1.0
    eps_end: float = 0.05
    explore_frac: float = 0.6
    #: Rewards are per-bar fractional returns (~1e-4); they are scaled into the C51 support.
    reward_scale: float = 1000.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("folds", "epochs", "steps_per_epoch", "n_envs", "replay_capacity"):
            require_int(name, getattr(self, name), minimum=1)
        require_int("warmup_transitions", self.warmup_transitions, minimum=0)
        require_range("train_frac", self.train_frac, 0.1, 0.95)
        require_positive("reward_scale", self.reward_scale)
        for name in ("eps_start", "eps_end", "explore_frac"):
            require_range(name, getattr(self, name), 0.0, 1.0)


#: The ``StepScalars`` fields an epoch record carries over (the epoch-end readback).
STEP_FIELDS = ("loss", "c51_loss", "cql_loss", "grad_norm", "c51_norm_pre", "c51_norm_post",
               "cql_norm_pre", "cql_norm_post", "mean_q")


@dataclass
class EpochRecord:
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
    epsilon: float
    sharpe: float
    eval_return: float
    epoch_time_s: float
    steps_per_s: float
    flagged: list[str] = field(default_factory=list)


@dataclass
class RunResult:
    records: list[EpochRecord]
    halted: str | None
    interrupted: bool
    best: dict  # fold -> {"epoch", "sharpe", "checkpoint", "equity"}
    flat_sharpe: dict


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


def fold_segments(n_bars: int, warmup: int, folds: int, train_frac: float) -> list[tuple[int, int, int]]:
    """``(train_start, eval_start, eval_stop)`` per fold over bars ``[warmup, n_bars)``."""
    usable = n_bars - warmup
    width = usable // folds
    if width < 64:
        raise ValueError(f"{n_bars} bars give folds of {width} bars after the {warmup}-bar feature "
                         f"warm-up; need at least 64 per fold (use fewer folds or more data)")
    out = []
    for f in range(folds):
        start = warmup + f * width
        split = start + int(width * train_frac)
        out.append((start, split, start + width))
    return out


def _greedy(trainer: TrainerBackend, states: np.ndarray) -> np.ndarray:
    return np.stack([q.argmax(axis=1) for q in trainer.q_values(states)], axis=1).astype(np.int32)


def _act(trainer, states, eps, branches, rng) -> np.ndarray:
    actions = _greedy(trainer, states)
    explore = rng.random(actions.shape) < eps
    random_actions = np.stack([rng.integers(0, n, size=len(states)) for n in branches], axis=1)
    return np.where(explore, random_actions, actions).astype(np.int32)


def evaluate(trainer: TrainerBackend, bars: Bars, feats: np.ndarray, state_dim: int,
             branches, start: int, stop: int, policy: str = "greedy") -> np.ndarray:
    """Per-bar rewards of the greedy (or ``flat``) policy over bars ``[start, stop)``."""
    env = BranchingEnv(bars.slice(0, stop), feats[:stop], state_dim=state_dim, n_envs=1,
                       branches=branches, auto_reset=False, min_start=0)
    states = env.reset(np.array([start]))
    rewards = []
    flat = np.array([[1] + [0] * (len(branches) - 1)], np.int32)
    while True:
        action = flat if policy == "flat" else _greedy(trainer, states)
        states, r, done, _ = env.step(action)
        rewards.append(float(r[0]))
        if done[0]:
            break
        states = env.observe()
    return np.asarray(rewards, np.float64)


def run(config: DQNConfig, bars: Bars, settings: LoopSettings, *, backend: str = "reference",
        out_dir: Path | None = None, on_step: Callable[[int, StepScalars], None] | None = None,
        on_epoch: Callable[[EpochRecord], None] | None = None,
        on_epoch_start: Callable[[int, int], None] | None = None) -> RunResult:
    """Train ``config`` on ``bars`` with ``settings``; see the module docstring."""
    trainer_cls = get_backend(backend)
    trainer = trainer_cls(config, seed=settings.seed)
    rng = np.random.default_rng(settings.seed)
    windows = choose_windows(config.state_dim)
    feats = market_features(bars, windows)
    segments = fold_segments(len(bars), feature_warmup(windows), settings.folds, settings.train_frac)
    total_epochs = settings.folds * settings.epochs
    records: list[EpochRecord] = []
    best: dict = {}
    flat_sharpe: dict = {}
    halted = None
    low_grad_epochs = 0
    ckpt_dir = (out_dir / "checkpoints") if out_dir else None
    try:
        for fold, (t0, t_eval, t_stop) in enumerate(segments):
            if fold > 0:
                trainer.fold_boundary()
            replay = ReplayBuffer(config, settings.replay_capacity)
            env = BranchingEnv(bars.slice(0, t_eval), feats[:t_eval], state_dim=config.state_dim,
                               n_envs=settings.n_envs, branches=config.branches, min_start=t0,
                               episode_len=min(1000, t_eval - t0 - 1), seed=settings.seed + fold)
            states = env.reset()
            flat_sharpe[fold] = annualised_sharpe(evaluate(trainer, bars, feats, config.state_dim,
                                                           config.branches, t_eval, t_stop, "flat"))
            while len(replay) < max(settings.warmup_transitions, config.batch_size):
                actions = _act(trainer, states, 1.0, config.branches, rng)
                s2, r, done, _ = env.step(actions)
                replay.add(states, actions, r * np.float32(settings.reward_scale), s2, done.astype(np.float32))
                states = env.observe()
            for epoch in range(settings.epochs):
                if on_epoch_start:
                    on_epoch_start(fold, epoch)
                g = fold * settings.epochs + epoch
                eps = settings.eps_end + (settings.eps_start - settings.eps_end) * max(
                    0.0, 1.0 - g / max(1.0, settings.explore_frac * total_epochs))
                tic = time.perf_counter()
                for i in range(settings.steps_per_epoch):
                    actions = _act(trainer, states, eps, config.branches, rng)
                    s2, r, done, _ = env.step(actions)
                    replay.add(states, actions, r * np.float32(settings.reward_scale), s2,
                               done.astype(np.float32))
                    states = env.observe()
                    batch, idx = replay.sample(rng)
                    scalars = trainer.step(batch)
                    replay.update_priorities(idx, trainer.last_td_errors())
                    if on_step:
                        on_step(i, scalars)
                    if scalars.fresh and not scalars.all_finite():
                        break
                scalars = trainer.end_epoch()
                elapsed = time.perf_counter() - tic
                rewards = evaluate(trainer, bars, feats, config.state_dim, config.branches, t_eval, t_stop)
                sharpe = annualised_sharpe(rewards)
                flagged = sentinels.flagged_names(np.asarray(scalars.flags, np.int32))
                rec = EpochRecord(
                    fold=fold, epoch=epoch, global_epoch=g, steps=scalars.step,
                    **{name: getattr(scalars, name) for name in STEP_FIELDS}, epsilon=eps,
                    sharpe=sharpe, eval_return=float(rewards.sum()), epoch_time_s=elapsed,
                    steps_per_s=settings.steps_per_epoch / max(elapsed, 1e-9), flagged=flagged,
                )
                records.append(rec)
                if on_epoch:
                    on_epoch(rec)
                if fold not in best or sharpe > best[fold]["sharpe"]:
                    path = None
                    if ckpt_dir is not None:
                        path = ckpt_dir / f"fold{fold}_best.safetensors"
                        trainer.save(path)
                    best[fold] = {"epoch": epoch, "sharpe": sharpe, "checkpoint": str(path) if path else None,
                                  "equity": equity_curve(rewards).tolist()}
                if not scalars.all_finite():
                    halted = f"halt_nan at fold {fold} epoch {epoch}: flagged slots {sentinels.format_flags(np.asarray(scalars.flags, np.int32))}"
                    break
                low_grad_epochs = low_grad_epochs + 1 if scalars.grad_norm < GRAD_COLLAPSE_NORM else 0
                if low_grad_epochs >= GRAD_COLLAPSE_EPOCHS:
                    halted = (f"halt_grad_collapse at fold {fold} epoch {epoch}: gradient norm < "
                              f"{GRAD_COLLAPSE_NORM} for {GRAD_COLLAPSE_EPOCHS} epochs; flagged slots "
                              f"{sentinels.format_flags(np.asarray(scalars.flags, np.int32))}")
                    break
            if halted:
                break
    except KeyboardInterrupt:
        return RunResult(records, halted, True, best, flat_sharpe)
    return RunResult(records, halted, False, best, flat_sharpe)


def write_jsonl(path: Path, record: EpochRecord) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(asdict(record), allow_nan=True) + "\n")
        fh.flush()


def sharpe_summary(result: RunResult) -> str:
    lines = []
    for fold, info in sorted(result.best.items()):
        lines.append(f"fold {fold}: best Sharpe {info['sharpe']:+.2f} at epoch {info['epoch']} "
                     f"(flat policy {result.flat_sharpe.get(fold, math.nan):+.2f})")
    return "\n".join(lines)
