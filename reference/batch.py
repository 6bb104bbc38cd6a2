"""`Batch`: one training batch (s, a, r, s2, done, isw, the auxiliary heads' labels
next_ret, regime, and the n-step transitions' effective discount), validated against a config."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .config import DQNConfig


#: The label fields (optional while their head is off), in ``Batch`` order.
LABEL_FIELDS = ("next_ret", "regime")
#: Every field that may be ``None``: the labels and the n-step discount (``None``: 1-step).
OPTIONAL_FIELDS = LABEL_FIELDS + ("discount",)


@functools.lru_cache(maxsize=64)
def _field_specs(B: int, SD: int, nb: int) -> tuple[tuple[str, tuple[int, ...], np.dtype], ...]:
    """``(field, shape, dtype)`` of every ``Batch`` field for these sizes, in ``Batch`` order."""
    f32, i32 = np.dtype(np.float32), np.dtype(np.int32)
    return (("s", (B, SD), f32), ("a", (B, nb), i32), ("r", (B,), f32), ("s2", (B, SD), f32),
            ("done", (B,), f32), ("isw", (B,), f32), ("next_ret", (B,), f32),
            ("regime", (B,), i32), ("discount", (B,), f32))


@functools.lru_cache(maxsize=64)
def _action_bounds(B: int, branches: tuple[int, ...]) -> np.ndarray:
    """Each action's exclusive upper bound, ``[B, n_branches]`` uint32 (read-only: cached; a
    comparison against the whole array costs half one that broadcasts a row)."""
    bounds = np.tile(np.asarray(branches, np.uint32), (B, 1))
    bounds.flags.writeable = False
    return bounds


@dataclass(frozen=True)
class Batch:
    """States ``s``/``s2`` f32 ``[B, SD]``, actions ``a`` int32 ``[B, n_branches]``, rewards ``r``
    f32 ``[B]``, ``done`` f32 ``[B]`` (0 or 1), importance weights ``isw`` f32 ``[B]`` (finite,
    > 0).

    The auxiliary heads' labels (SPEC 4 second wave): ``next_ret`` f32 ``[B]``, the return
    ``(C' - P) / P`` of the transition's bar t -> t+1 (may hold NaN/Inf like ``r``: such a
    sample is masked out of the next-bar loss), and ``regime`` int32 ``[B]``, the market's
    regime id of bar t (``market.regime_labels``), in ``[0, n_regimes)``. Both come from the
    environment (``info["ret"]``, ``info["regime"]``) through the replay buffer. ``None``
    means "not supplied", allowed only while the head that reads the label is off.

    ``discount`` f32 ``[B]`` (issue 22, n-step returns): the transition's effective discount
    ``gamma_ref ** k`` (``k`` the environment steps the transition spans, ``gamma_ref =
    config.gammas[0]``), finite and in ``(0, 1]``. ``None`` means 1-step transitions (every
    target uses the branch's gamma as before); present, the targets use the per-sample
    ``gamma_eff_d = gamma_d ** (log(discount) / log(gamma_ref))``
    (``kernels.distributional.effective_gamma``)."""

    s: np.ndarray
    a: np.ndarray
    r: np.ndarray
    s2: np.ndarray
    done: np.ndarray
    isw: np.ndarray
    next_ret: np.ndarray | None = None
    regime: np.ndarray | None = None
    discount: np.ndarray | None = None

    def validate(self, config: DQNConfig) -> "Batch":
        """Check shapes, dtypes, action ranges, ``done`` in {0, 1} and ``isw`` finite and > 0;
        returns ``self`` or raises ``ValueError`` naming the field, the first bad index and value.
        A valid batch costs one vectorised pass per check. ``s``, ``s2`` and ``r`` may hold
        NaN/Inf (market data): the sentinels flag those; so may ``next_ret``.

        Labels: ``next_ret`` / ``regime`` must be present when ``aux_next_bar_weight`` /
        ``aux_regime_weight`` is > 0; when present they are checked for shape and dtype, and
        ``regime`` (when the regime head is on, its only reader) for the range
        ``[0, n_regimes)``.

        ``discount`` (optional): shape ``[B]``, float32, every value finite and in ``(0, 1]``
        (the reference gamma it is taken against, ``(0, 1)``, is checked where the targets are
        formed: ``step.loss_and_grads``)."""
        for label, weight in (("next_ret", "aux_next_bar_weight"), ("regime", "aux_regime_weight")):
            if getattr(self, label) is None and getattr(config, weight) > 0:
                raise ValueError(f"batch.{label}: missing; {weight}={getattr(config, weight)!r} "
                                 f"needs the {label} labels (allowed: None only when {weight}=0)")
        for name, shape, dtype in _field_specs(config.batch_size, config.state_dim, config.n_branches):
            arr = getattr(self, name)
            if arr is None and name in OPTIONAL_FIELDS:
                continue
            if not isinstance(arr, np.ndarray):
                raise ValueError(f"batch.{name}: expected a numpy array, got {type(arr).__name__}")
            if arr.shape != shape:
                raise ValueError(f"batch.{name}: shape {arr.shape}, expected {shape} for this config")
            if arr.dtype != dtype:
                raise ValueError(f"batch.{name}: dtype {arr.dtype}, expected {dtype}")
        # Few NumPy calls for a valid batch (this runs on the fast trainer's hot path, where each
        # costs one to three microseconds; ``count_nonzero`` is cheaper than ``all``): viewed as
        # uint32 a negative action is >= 2**31, so one comparison checks both bounds; isw's range
        # is checked by its extremes (NaN propagates through them and fails the comparisons). The
        # per-entry scans only run to name the first bad entry.
        bounds = _action_bounds(config.batch_size, config.branches)
        if np.count_nonzero(self.a.view(np.uint32) < bounds) != bounds.size:
            for d, n in enumerate(config.branches):
                col = self.a[:, d]
                bad = np.flatnonzero((col < 0) | (col >= n))
                if bad.size:
                    i = int(bad[0])
                    raise ValueError(f"batch.a[{i}, {d}]={int(col[i])}: branch {d} has {n} actions, "
                                     f"allowed range [0, {n - 1}]")
        done = self.done
        # Every non-zero entry (NaN and Inf included) must be a 1: count both.
        if np.count_nonzero(done) != np.count_nonzero(done == 1):
            i = int(np.flatnonzero((done != 0) & (done != 1))[0])
            raise ValueError(f"batch.done[{i}]={done[i]!r}: allowed values are 0 and 1")
        # Importance weights scale each sample's loss: a non-finite or non-positive one is a bug
        # upstream (replay gives (0, 1]), not data, so it is refused here rather than flagged.
        isw = self.isw
        if not (np.minimum.reduce(isw) > 0 and np.maximum.reduce(isw) < np.inf):
            ok = (isw > 0) & (isw < np.inf)  # NaN fails both comparisons
            i = int(np.flatnonzero(~ok)[0])
            raise ValueError(f"batch.isw[{i}]={float(isw[i])!r}: importance weights must be "
                             "finite and > 0 (allowed range (0, inf))")
        regime = self.regime
        if config.aux_regime_on and (np.count_nonzero(regime.view(np.uint32) < config.n_regimes)
                                     != regime.size):
            i = int(np.flatnonzero((self.regime < 0) | (self.regime >= config.n_regimes))[0])
            raise ValueError(f"batch.regime[{i}]={int(self.regime[i])}: regime ids must be in "
                             f"[0, {config.n_regimes - 1}] (n_regimes={config.n_regimes})")
        discount = self.discount
        if discount is not None and not (np.minimum.reduce(discount) > 0
                                         and np.maximum.reduce(discount) <= 1):
            ok = (discount > 0) & (discount <= 1)  # NaN fails both comparisons
            i = int(np.flatnonzero(~ok)[0])
            raise ValueError(f"batch.discount[{i}]={float(discount[i])!r}: effective discounts "
                             "must be finite and in (0, 1]")
        return self

    @classmethod
    def random(cls, config: DQNConfig, rng: np.random.Generator) -> "Batch":
        """A valid random batch: normal states, uniform actions, normal rewards, 10% done,
        labels ``next_ret ~ 0.01 N(0, 1)`` (a bar return's size) and uniform ``regime`` ids in
        ``[0, n_regimes)`` (drawn after the other fields)."""
        B, SD = config.batch_size, config.state_dim
        a = np.stack([rng.integers(0, n, size=B) for n in config.branches], axis=1).astype(np.int32)
        return cls(
            s=rng.standard_normal((B, SD)).astype(np.float32),
            a=a,
            r=rng.standard_normal(B).astype(np.float32),
            s2=rng.standard_normal((B, SD)).astype(np.float32),
            done=(rng.random(B) < 0.1).astype(np.float32),
            isw=rng.uniform(0.5, 1.0, size=B).astype(np.float32),
            next_ret=(0.01 * rng.standard_normal(B)).astype(np.float32),
            regime=rng.integers(0, config.n_regimes, size=B).astype(np.int32),
        ).validate(config)
