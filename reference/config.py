"""`DQNConfig`: every size, rate and safety multiplier of the network and the step (SPEC 3, 6).

A frozen dataclass validated at construction: each bad value raises ``ValueError`` naming the
field, the value, and what is allowed. ``DQNConfig.preset("seed")`` is the production size
(289,611 core parameters, plus the IQN and auxiliary heads it turns on: ``SEED_SECOND_WAVE``,
and every adaptive ISV mechanism: ``ADAPTIVE_ON``); ``DQNConfig.preset("tiny")`` is the size the
fast tests use (core step only). The field defaults are the ``seed`` sizes with every
second-wave source and every adaptive mechanism off (``CORE_STEP``).

JSON round trip: ``DQNConfig.from_dict(cfg.to_dict()) == cfg``; unknown keys are rejected by
name so that a checkpoint written by a different version fails loudly instead of silently
dropping a field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

#: ``DQNConfig.precision``: the GEMMs' precision (SPEC 9; the GEMM mode of each:
#: ``backend.FORWARD_GEMM_MODE`` / ``BACKWARD_GEMM_MODE``). ``f32``: SGEMM-equivalent throughout;
#: ``bf16``: the forward on BF16 weight mirrors and activations, the backward in TF32; ``tf32``:
#: F32 storage (no mirrors, as ``f32``) with every GEMM on TF32 tensor cores (inputs rounded to
#: TF32, F32 accumulation), issue 26's documented TF32 variant of the f32 step.
PRECISIONS = ("f32", "bf16", "tf32")

#: The four gradient sources of the budget pipeline (SPEC 4 step 5), in pipeline order.
BUDGET_SOURCES = ("c51", "cql", "iqn", "ens")

#: The second-wave source weights (0 = the source is off), in layout order of their tensors
#: where they have any (SPEC 4; issue 18 contract).
SOURCE_WEIGHTS = ("aux_next_bar_weight", "aux_regime_weight", "lambda_iqn", "ens_weight")

#: Every field that switches a second-wave source on (> 0), with what it switches on.
SECOND_WAVE_SWITCHES = {
    "aux_next_bar_weight": "the next-bar auxiliary head",
    "aux_regime_weight": "the regime auxiliary head",
    "lambda_iqn": "the IQN head",
    "ens_weight": "the ensemble diversity source",
    "c51_warmup_epochs": "the MSE warm-up",
}

#: The issue-19 ISV producer switches (``reference.isv_step`` runs them), with what each turns
#: on; ``adaptive_atoms``, their consumer, is apart (it needs ``q_stats``).
ADAPTIVE_SWITCHES = {
    "adaptive_signals": "the signal EMAs 0-12 (isv_signal_build + isv_signal_update)",
    "q_stats": "the Q statistics 17-21, the per-branch Q quantiles 50-57 and the adaptive "
               "support 23-30",
    "gamma_schedule": "the per-branch gamma schedule 43-46, read by the C51 targets",
    "cql_alpha_ramp": "the CQL-alpha ramp 48, read by the CQL loss",
    "adaptive_epsilon_tau": "the adaptive exploration epsilon 41 (read by the collectors) and "
                            "Polyak tau 42 (read by the target update)",
}
#: Every adaptive mechanism on: each producer switch and the adaptive atoms (the seeds run
#: them all; the ``seed`` preset turns them on).
ADAPTIVE_ON: dict[str, Any] = {**dict.fromkeys(ADAPTIVE_SWITCHES, True), "adaptive_atoms": True}

#: The overrides that turn every second-wave source and every adaptive mechanism off: the core
#: step (C51 + CQL).
CORE_STEP: dict[str, Any] = {**{name: 0 for name in SECOND_WAVE_SWITCHES},
                             **dict.fromkeys(ADAPTIVE_ON, False)}

#: Each second-wave source alone, as the fields that turn it on: SPEC 4's seed weights where it
#: gives them (IQN 1.0, auxiliary heads 0.1 each), the ensemble at weight 1.0 with its default K
#: (``ens_heads``), the warm-up over 4 epochs. Tests, conformance and benches use these.
SECOND_WAVE_SOURCES: dict[str, dict[str, Any]] = {
    "iqn": {"lambda_iqn": 1.0},
    "aux": {"aux_next_bar_weight": 0.1, "aux_regime_weight": 0.1},
    "mse": {"c51_warmup_epochs": 4},
    "ens": {"ens_weight": 1.0},
}


def source_overrides(source: str) -> dict[str, Any]:
    """The config overrides of one step variant: ``"core"`` (every source off), one of
    ``SECOND_WAVE_SOURCES`` alone, or ``"all"`` of them together."""
    if source == "core":
        return dict(CORE_STEP)
    if source == "all":
        return {**CORE_STEP, **{k: v for f in SECOND_WAVE_SOURCES.values() for k, v in f.items()}}
    if source not in SECOND_WAVE_SOURCES:
        raise ValueError(f"source={source!r}: allowed values are "
                         f"{('core', *SECOND_WAVE_SOURCES, 'all')}")
    return {**CORE_STEP, **SECOND_WAVE_SOURCES[source]}


#: Tolerance on ``sum(budgets) == 1``.
BUDGET_SUM_TOL = 1e-6


def _budgets_default() -> tuple[float, float, float, float]:
    return (0.70, 0.15, 0.10, 0.05)


@dataclass(frozen=True)
class DQNConfig:
    """Configuration of the branching dueling C51 DQN and its training step.

    Sizes (SPEC 3): ``batch_size`` B, ``state_dim`` SD, trunk widths ``shared_h1`` / ``shared_h2``,
    head widths ``value_h`` / ``adv_h``, ``num_atoms`` NA on ``[v_min, v_max]``, ``branches`` (actions
    per branch), ``gamma`` (one float, or one per branch).

    Safety multipliers (SPEC 6; each bound is ``multiplier * max(isv_signal, 1)``, the floor is
    on the signal, never on the bound): ``target_q_clip_mult`` (Mech 1), ``atom_growth_mult``
    (Mech 2; with the fixed support a construction check ``max(|v_min|, |v_max|) <=
    atom_growth_mult``), ``adam_m_diag_mult`` / ``adam_v_diag_mult`` / ``weight_diag_mult`` (Mech 5 sentinel
    thresholds), ``grad_clip_anchor_mult`` and ``grad_slow_ema_alpha`` (Mech 6),
    ``weight_clamp_mult`` (Mech 9), ``h2_clamp_mult`` / ``h2_diag_mult`` (Mech 10),
    ``aux_guard_mult`` (input range guard around auxiliary trunk backwards).

    Second wave (SPEC 4; issue 18 contract). Each source has a weight; weight 0 removes it
    (no tensors, no work) and the step is then bitwise the core step:

    * IQN head: ``lambda_iqn``; ``iqn_quantiles`` N quantile fractions per sample (online and
      target; the seeds' IQN_NUM_QUANTILES = 5), ``iqn_embed`` cosine features
      ``k = 0 .. iqn_embed - 1``.
    * Ensemble diversity: ``ens_weight``; ``ens_heads`` K (head 0 is the value stream, heads
      1 .. K-1 are frozen randomized priors).
    * Auxiliary heads: ``aux_next_bar_weight`` (next-bar return regression) and
      ``aux_regime_weight`` (regime classification over ``n_regimes`` classes), each an ELU
      hidden layer of ``aux_hidden`` units on h2.
    * MSE warm-up: ``c51_warmup_epochs`` W; blend weight ``w = max(0, 1 - epoch / W)``.

    The shape fields of a source (``iqn_quantiles``, ``ens_heads``, ``aux_hidden``, ...)
    only act when the source's weight is > 0.

    Adaptive ISV mechanisms (issue 19; bools, off by default, all on in the ``seed`` preset as
    in the seeds; ``ADAPTIVE_SWITCHES``, ``reference.isv_step``):
    ``adaptive_signals`` (signal EMAs 0-12), ``q_stats`` (Q statistics 17-21, per-branch Q
    quantiles 50-57, adaptive support 23-30; needs an exposure branch of 3 actions),
    ``gamma_schedule`` (per-branch gamma 43-46, which the C51 targets then read; ``gamma`` is
    its cold start), ``cql_alpha_ramp`` (ISV 48 ramps toward ``cql_alpha * (1 - ISV[41])``:
    less pessimism while the data is mostly exploration; the CQL loss then reads the slot, and
    ``cql_alpha`` is its cold start and ceiling), ``adaptive_epsilon_tau`` (ISV 41/42 each
    step from the learning health: exploration ``min(sched * (2 - h), cap)``, Polyak
    ``tau * (0.5 + 0.5 h)``; the collectors act with slot 41 and the target update reads slot
    42, whose cold start is ``tau``).

    The exploration schedule and ``adaptive_epsilon_tau``: ``LoopSettings``' ``eps_start``,
    ``eps_end`` and ``explore_frac`` keep today's linear decay ``sched`` over the run's epochs.
    Switch off: the collectors act with ``sched``, as before. Switch on: the loop hands
    ``(sched, max(eps_start, eps_end))`` to the trainer at each epoch start
    (``set_loop_signals(epsilon=...)``), which writes ``sched`` into slot 41 (the epoch's cold
    start) and keeps the pair for ``epsilon_tau_update``: ``sched`` is the floor of the
    adaptive epsilon and the cap its ceiling. Warm-up cycles act with 1 either way.

    ``adaptive_atoms`` (bool, off by default, on in the ``seed`` preset): branch d's C51 support is the live support of
    ``kernels.live_support`` (centre and half-width from ISV 23-30 under Mech 2's bound
    ``atom_growth_mult * max(ISV[Q_ABS_REF], 1)``), read at the start of each step by the
    projection, the expected Q, the CQL gradient, the scalar targets and sentinel 47, and by
    ``q_values``. It needs ``q_stats=True`` (the producer of 23-30; it does not turn it on) and
    ``c51_warmup_epochs=0`` (the MSE warm-up's expected Q reads the fixed support). ``v_min`` /
    ``v_max`` are then the support's cold start (and its value after a fold reset).
    """

    batch_size: int = 256
    state_dim: int = 128
    shared_h1: int = 256
    shared_h2: int = 256
    value_h: int = 128
    adv_h: int = 128
    num_atoms: int = 51
    v_min: float = -10.0
    v_max: float = 10.0
    branches: tuple[int, ...] = (3, 3, 2)
    gamma: float | tuple[float, ...] = 0.99
    max_grad_norm: float = 10.0
    budgets: tuple[float, float, float, float] = field(default_factory=_budgets_default)
    sigma_max: float = 3.0
    lr: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    tau: float = 0.005
    cql_alpha: float = 1.0
    readback_interval: int = 100
    precision: str = "bf16"
    # Safety multipliers (SPEC 6; values from the NaN-audit seed).
    target_q_clip_mult: float = 100.0
    atom_growth_mult: float = 100.0
    adam_m_diag_mult: float = 100.0
    adam_v_diag_mult: float = 1e6
    weight_diag_mult: float = 1e3
    grad_clip_anchor_mult: float = 100.0
    grad_slow_ema_alpha: float = 0.001
    weight_clamp_mult: float = 100.0
    h2_clamp_mult: float = 100.0
    h2_diag_mult: float = 1e3
    aux_guard_mult: float = 1e6
    # Auxiliary-source weights (SPEC 4, second wave); 0 disables a source.
    lambda_iqn: float = 0.0
    ens_weight: float = 0.0
    c51_warmup_epochs: int = 0
    iqn_quantiles: int = 5
    iqn_embed: int = 64
    ens_heads: int = 3
    aux_next_bar_weight: float = 0.0
    aux_regime_weight: float = 0.0
    aux_hidden: int = 32
    n_regimes: int = 3
    # Issue-19 ISV producers and consumers (reference.isv_step.ADAPTIVE_SWITCHES); off by default.
    adaptive_signals: bool = False
    q_stats: bool = False
    gamma_schedule: bool = False
    cql_alpha_ramp: bool = False
    adaptive_epsilon_tau: bool = False
    adaptive_atoms: bool = False

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        # Normalise sequences given as lists (e.g. from JSON) to tuples before checking.
        for name in ("branches", "budgets"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        if isinstance(self.gamma, list):
            object.__setattr__(self, "gamma", tuple(self.gamma))
        self._validate()

    def _validate(self) -> None:
        for name in ("batch_size", "state_dim", "shared_h1", "shared_h2", "value_h", "adv_h",
                     "readback_interval"):
            require_int(name, getattr(self, name), minimum=1)
        require_int("num_atoms", self.num_atoms, minimum=2)
        require_int("c51_warmup_epochs", self.c51_warmup_epochs, minimum=0)
        require_finite("v_min", self.v_min)
        require_finite("v_max", self.v_max)
        if not self.v_min < self.v_max:
            raise ValueError(
                f"v_min={self.v_min!r} must be < v_max={self.v_max!r} (the C51 support is [v_min, v_max])"
            )
        if not isinstance(self.branches, tuple) or len(self.branches) == 0:
            raise ValueError(
                f"branches={self.branches!r}: need a non-empty tuple of action counts, e.g. (3, 3, 2)"
            )
        for i, n in enumerate(self.branches):
            if isinstance(n, bool) or not isinstance(n, int) or n < 2:
                raise ValueError(
                    f"branches={self.branches!r}: branches[{i}]={n!r}, each branch needs an "
                    "integer number of actions >= 2"
                )
        if not (_is_real(self.gamma) or isinstance(self.gamma, tuple)):
            raise ValueError(f"gamma={self.gamma!r}: must be a number in [0.0, 1.0] or a tuple "
                             "of them, one per branch")
        if isinstance(self.gamma, tuple):
            for i, g in enumerate(self.gamma):
                require_range(f"gamma[{i}]", g, 0.0, 1.0)  # before gammas' float() hides a str
        gammas = self.gammas
        if isinstance(self.gamma, tuple) and len(self.gamma) != len(self.branches):
            raise ValueError(
                f"gamma={self.gamma!r}: a per-branch gamma needs {len(self.branches)} values "
                f"(one per branch), got {len(self.gamma)}"
            )
        for i, g in enumerate(gammas):
            require_range(f"gamma[{i}]" if isinstance(self.gamma, tuple) else "gamma", g, 0.0, 1.0)
        require_positive("max_grad_norm", self.max_grad_norm)
        if not isinstance(self.budgets, tuple) or len(self.budgets) != len(BUDGET_SOURCES):
            raise ValueError(
                f"budgets={self.budgets!r}: need {len(BUDGET_SOURCES)} fractions "
                f"({', '.join(BUDGET_SOURCES)})"
            )
        for src, b in zip(BUDGET_SOURCES, self.budgets):
            require_range(f"budgets[{src}]", b, 0.0, 1.0)
        total = math.fsum(self.budgets)
        if abs(total - 1.0) > BUDGET_SUM_TOL:
            raise ValueError(
                f"budgets={self.budgets!r} sum to {total!r}; they must sum to 1 within "
                f"{BUDGET_SUM_TOL} so that the budgets add up to max_grad_norm exactly"
            )
        require_positive("sigma_max", self.sigma_max)
        require_positive("lr", self.lr)
        require_range("beta1", self.beta1, 0.0, 1.0, hi_open=True)
        require_range("beta2", self.beta2, 0.0, 1.0, hi_open=True)
        require_positive("adam_eps", self.adam_eps)
        require_range("weight_decay", self.weight_decay, 0.0, math.inf)
        require_range("tau", self.tau, 0.0, 1.0)
        require_range("cql_alpha", self.cql_alpha, 0.0, math.inf)
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r}: allowed values are {PRECISIONS}")
        for name in ("target_q_clip_mult", "atom_growth_mult", "adam_m_diag_mult",
                     "adam_v_diag_mult", "weight_diag_mult", "grad_clip_anchor_mult",
                     "weight_clamp_mult", "h2_clamp_mult", "h2_diag_mult", "aux_guard_mult"):
            require_positive(name, getattr(self, name))
        require_range("grad_slow_ema_alpha", self.grad_slow_ema_alpha, 0.0, 1.0, lo_open=True)
        # Mech 2 bounds the atom positions by atom_growth_mult * max(ISV[Q_ABS_REF], 1). The
        # support here is fixed, so the bound acts once, at construction, at its smallest value
        # (the signal's floor 1): every atom must lie within atom_growth_mult.
        if max(abs(self.v_min), abs(self.v_max)) > self.atom_growth_mult:
            raise ValueError(
                f"v_min={self.v_min!r}, v_max={self.v_max!r}: the support must lie within Mech 2's "
                f"atom bound atom_growth_mult={self.atom_growth_mult!r} (|v| <= atom_growth_mult)")
        for name in SOURCE_WEIGHTS:
            require_range(name, getattr(self, name), 0.0, math.inf)
        from .isv_step import ADAPTIVE_SWITCHES, Q_STATS_ACTIONS

        for name in ADAPTIVE_SWITCHES:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: must be True or False")
        if (self.q_stats or self.gamma_schedule) and len(self.branches) > 4:
            raise ValueError(f"branches={self.branches!r}: q_stats and gamma_schedule need at "
                             "most 4 branches (the ISV's per-branch slots)")
        if self.q_stats and self.branches[0] != Q_STATS_ACTIONS:
            raise ValueError(f"q_stats=True: branches[0]={self.branches[0]!r}; the exposure "
                             f"branch's Q statistics need {Q_STATS_ACTIONS} actions (short, flat, "
                             "long)")
        if not isinstance(self.adaptive_atoms, bool):
            raise ValueError(f"adaptive_atoms={self.adaptive_atoms!r}: must be True or False")
        if self.adaptive_atoms and not self.q_stats:
            raise ValueError("adaptive_atoms=True: needs q_stats=True (the producer of the "
                             "support slots 23-30)")
        if self.adaptive_atoms and self.c51_warmup_epochs:
            raise ValueError(f"adaptive_atoms=True: c51_warmup_epochs={self.c51_warmup_epochs!r}"
                             "; allowed 0 (the MSE warm-up reads the fixed support: to warm up, "
                             "also set adaptive_atoms=false)")
        for name, minimum in (("iqn_quantiles", 1), ("iqn_embed", 1), ("ens_heads", 2),
                              ("aux_hidden", 1), ("n_regimes", 2)):
            require_int(name, getattr(self, name), minimum=minimum)

    # ------------------------------------------------------------------ derived values
    @property
    def gammas(self) -> tuple[float, ...]:
        """Discount per branch (a scalar ``gamma`` is broadcast)."""
        if isinstance(self.gamma, tuple):
            return tuple(float(g) for g in self.gamma)
        return (float(self.gamma),) * len(self.branches)

    @property
    def n_branches(self) -> int:
        return len(self.branches)

    @property
    def delta_z(self) -> float:
        """Atom spacing ``dz = (v_max - v_min) / (NA - 1)``."""
        return (self.v_max - self.v_min) / (self.num_atoms - 1)

    @property
    def iqn_on(self) -> bool:
        return self.lambda_iqn > 0

    @property
    def ens_on(self) -> bool:
        return self.ens_weight > 0

    @property
    def aux_next_bar_on(self) -> bool:
        return self.aux_next_bar_weight > 0

    @property
    def aux_regime_on(self) -> bool:
        return self.aux_regime_weight > 0

    @property
    def aux_on(self) -> bool:
        return self.aux_next_bar_on or self.aux_regime_on

    @property
    def mse_on(self) -> bool:
        return self.c51_warmup_epochs > 0

    @property
    def second_wave_on(self) -> tuple[str, ...]:
        """The names of the ``SECOND_WAVE_SWITCHES`` fields that are > 0 (empty: the core
        step)."""
        return tuple(n for n in SECOND_WAVE_SWITCHES if getattr(self, n) > 0)

    def budget(self, source: str) -> float:
        """Absolute norm budget of one gradient source: ``fraction * max_grad_norm``."""
        try:
            i = BUDGET_SOURCES.index(source)
        except ValueError:
            raise ValueError(f"source={source!r}: allowed values are {BUDGET_SOURCES}") from None
        return self.budgets[i] * self.max_grad_norm

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "DQNConfig":
        """``"seed"`` (production: 289,611 core parameters, IQN and auxiliary heads on) or
        ``"tiny"`` (fast tests, core step)."""
        try:
            base = PRESETS[name]
        except KeyError:
            raise ValueError(f"preset={name!r}: allowed values are {tuple(PRESETS)}") from None
        return cls(**{**base, **overrides})

    def replace(self, **changes: Any) -> "DQNConfig":
        """A copy with some fields changed (validated like any construction)."""
        unknown = sorted(set(changes) - _field_names())
        if unknown:
            raise ValueError(f"unknown DQNConfig field(s) {unknown}; known: {sorted(_field_names())}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for k, v in out.items():
            if isinstance(v, tuple):
                out[k] = list(v)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DQNConfig":
        unknown = sorted(set(data) - _field_names())
        if unknown:
            raise ValueError(f"unknown DQNConfig key(s) {unknown}; known: {sorted(_field_names())}")
        return cls(**dict(data))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "DQNConfig":
        return cls.from_dict(json.loads(text))


#: The ``seed`` preset's second-wave switches (SPEC 4, from the seeds): the IQN head (its 10%
#: budget at full weight) and both auxiliary heads on; the ensemble off (its priors are
#: implemented and conformance-tested, but the seeds run it dormant); MSE warm-up 0 epochs.
#: The dataclass defaults keep every source off: ``DQNConfig()`` is the core step (C51 + CQL).
SEED_SECOND_WAVE: dict[str, Any] = dict(lambda_iqn=1.0, aux_next_bar_weight=0.1,
                                         aux_regime_weight=0.1)

PRESETS: dict[str, dict[str, Any]] = {
    # The seeds' step: its second-wave sources and every adaptive mechanism (seed 002's live
    # ISV bus; the dataclass defaults keep them off).
    "seed": {**SEED_SECOND_WAVE, **ADAPTIVE_ON},
    "tiny": dict(
        batch_size=32, state_dim=16, shared_h1=32, shared_h2=32, value_h=16, adv_h=16,
        num_atoms=11, branches=(3, 2),
    ),
}


def _field_names() -> set[str]:
    return {f.name for f in dataclasses.fields(DQNConfig)}


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def require_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r}: must be an integer >= {minimum}")


def require_finite(name: str, value: Any) -> None:
    if not _is_real(value) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r}: must be a finite number")


def require_positive(name: str, value: Any) -> None:
    if not _is_real(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r}: must be a finite number > 0")


def require_range(name: str, value: Any, lo: float, hi: float, *,
                   lo_open: bool = False, hi_open: bool = False) -> None:
    ok = _is_real(value) and not math.isnan(value)
    if ok:
        ok = (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
        ok = ok and (math.isfinite(value) or hi == math.inf and value != math.inf)
    if not ok:
        left = "(" if lo_open else "["
        right = ")" if hi_open or hi == math.inf else "]"
        raise ValueError(f"{name}={value!r}: allowed range is {left}{lo}, {hi}{right}")
