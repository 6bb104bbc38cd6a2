"""The bounds of step conformance (SPEC 8): one ``step()`` of a second implementation against
the reference ``Trainer`` from one shared state, every compared quantity with its criterion
(:data:`STEP_BOUNDS`, the reason for each row next to it) and the error models the criteria
are derived from (:func:`grad_eps`, :func:`fwd_eps`).

Trajectories diverge chaotically, so the implementations are compared one step at a time from a
shared state (:mod:`.step_harness`): a reference trainer's ``state_dict()`` is loaded into a
reference and a second trainer, both step on the same batch, and every buffer of the two
``state_dict()``s, the step's scalars and TD errors are compared (:mod:`.step_compare`). In short:

- only the gradient can legitimately carry more than a few roundings of difference (a chain of
  GEMMs and reductions, TF32 operands that tensor cores may truncate): it is compared through
  the Adam moments, ``m = beta1 m0 + (1 - beta1) g``, with a per-tensor norm-wise bound and a
  per-element bound of relative size :func:`grad_eps`;
- everything downstream of the moments is compared *conditionally*: the second implementation's
  parameters must be what the reference optimiser tail (Adam from its own ``m``/``v``, Mech 9,
  the batched spectral norm from the shared ``u``/``v``) gives, and its target what Polyak
  gives from its parameters, within a few roundings (Adam: 8 u relative to its operands; the
  spectral norm's rtol 1e-5 and Polyak's 2 ULP, the kernels' own tolerances). A direct
  worst-case bound against the reference's parameters (``2 lr R + ...``: each implementation
  moves a parameter by at most ``lr R``) is checked too;
- flags, counters, the ISV slots the step does not write (fingerprint bits included), the
  padding and the elements the reference's Adam skipped are compared bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from foxhunt.conformance.registry import SPECS
from foxhunt.conformance.tolerance import F32_UNIT_ROUNDOFF, INPUT_MISMATCH, Tolerance, gamma
from foxhunt.reference.backend import BACKWARD_GEMM_MODE, FORWARD_GEMM_MODE
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.trainer import ISV_PRODUCER_ALPHA, SLOW_EMA

F32 = np.float32
F64 = np.float64
U = F32_UNIT_ROUNDOFF

#: Longest chain of GEMMs between the loss and a weight gradient (head layer 2 dX, head layer 1
#: dX, trunk layer 2 dX, trunk layer 1 dW), and between the input and the logits (4 layers).
BACKWARD_GEMM_DEPTH = 4
FORWARD_GEMM_DEPTH = 4
#: Factor on the gradient / forward error models (the CPU self-check's legitimate variant,
#: with TF32 truncation, reaches about a quarter of the bf16 bound, 1/100 of the f32 one).
GRAD_SAFETY = 2.0
#: Roundings allowed in the conditional Adam check, relative to |p0| + |lr update| + |p|: the
#: update's chain (division, sqrt, add, division, product) and the bias corrections' power.
ADAM_ROUNDINGS = 8
#: Polyak's and the spectral norm's conditional checks use the kernels' own tolerances.
POLYAK_TOL = SPECS["polyak_update"].tolerance_of("out")
SPECTRAL_TOL = SPECS["batched_spectral_norm"].tolerance_of("us")
EXACT = Tolerance.exact()


@dataclass(frozen=True)
class Row:
    criterion: str
    reason: str


#: Every buffer of ``state_dict()`` and every compared output of a step, with its criterion.
#: ``sn_u.*`` / ``sn_v.*`` stand for the spectral-norm vectors of every weight matrix.
STEP_BOUNDS: Mapping[str, Row] = {
    "adam_m": Row(
        "per tensor T: ||dm||_T <= (1-b1) eps_g ||g||_T + rounding; per element "
        "|dm_i| <= (1-b1) eps_g (|g_i| + max_T|g|) + 2u(b1|m0| + (1-b1)|g| + |m|); bitwise where the "
        "reference's Adam skipped a non-zero m0/v0 (a non-finite gradient) and in the padding",
        "m = b1 m0 + (1-b1) g from the shared m0: the gradient g (GEMM chain + reductions) is the "
        "only quantity whose rounding differences legitimately grow; eps_g = grad_eps()"),
    "adam_v": Row(
        "|dv_i| <= (1-b2)(2|g_i| + dg_i) dg_i + 2u(b2 v0 + (1-b2) g^2 + |v|) with dg_i the m bound's "
        "gradient term; per-tensor norm-wise likewise; bitwise where adam_m is",
        "v = b2 v0 + (1-b2) g^2: the same gradient difference, squared"),
    "params": Row(
        "conditional: fast params vs reference Adam(p0, fast m, fast v) -> Mech 9 -> batched spectral "
        "norm(shared u0, v0): 8 u (|p0| + |lr update| + |p|), scaled matrices + rtol 1e-5; "
        "direct: |dp| <= 2 lr R_i "
        "+ (1e-5 + 4 lr ||R||_T / sigma_max)|p| + 8u(|p0| + |p|)",
        "given its moments the optimiser tail is elementwise arithmetic plus the spectral norm "
        "(rtol 1e-5, SPEC 8); each implementation moves a parameter by at most lr R_i, "
        "R_i = sqrt(bc2)/bc1 (b1|m0|/sqrt(b2 v0) + (1-b1)/sqrt(1-b2)), so a gradient error can at "
        "most flip a step"),
    "target": Row(
        "conditional: fast target vs polyak(target0, fast params) within 2 ULP; direct: "
        "|dtarget| <= tau * (direct params bound) + 4u|target|",
        "target = (1-tau) target0 + tau params, target0 shared"),
    "sn_u.*": Row(
        "conditional: vs the reference spectral norm of the fast path's post-Adam weights from the "
        "shared u0, v0: rtol 1e-5 + 4u (rows+cols) max|u|",
        "SPEC 8: fast vs reference spectral norm rtol 1e-5; a direct comparison would measure the "
        "power iteration's sensitivity to the legitimate O(lr) weight differences, not the kernel"),
    "sn_v.*": Row("as sn_u.*", "as sn_u.*"),
    "isv": Row(
        "slots the reference step does not write: bitwise (fingerprint bits included); producer "
        "slots (ISV_STEP_PRODUCERS): rtol 1e-5 + alpha eps |signal| (Q statistics: alpha eps_f "
        "(|signal| + max|z|))",
        "an EMA (1-alpha) isv0 + alpha signal from the shared isv0 moves by alpha times the "
        "signal's difference; the signal is a forward (eps_f) or gradient-norm (eps_g) quantity"),
    "flags": Row("exact", "sentinel flags (SPEC 8: flags exactly equal)"),
    "adam_t": Row("exact", "step counter"),
    "step": Row("exact", "step counter"),
    "seed": Row("exact", "the run's seed: the IQN quantile fractions' generator key"),
    "padding": Row("exact (+0.0)", "the layout's padding is always zero in every flat buffer"),
    "td_errors": Row("|d td_b| <= eps_f (|td_b| + log NA)",
                     "per-sample cross-entropy (forward only): its natural scale is log NA"),
    "q_values": Row("|dQ| <= eps_f (|Q| + max|z|)",
                    "the greedy evaluation after the step: a forward pass on the new parameters "
                    "(those are checked above), expected Q in [v_min, v_max]"),
    "scalars.counters": Row("exact", "step, read_at, fresh, safety_clip_fired, flags"),
    "scalars.norms": Row("|d| <= eps_g |x| + 4u|x|",
                         "| ||g_f|| - ||g_r|| | <= ||g_f - g_r|| <= eps_g ||g_r|| (triangle inequality)"),
    "scalars.ens_norms": Row("|d| <= (eps_g + 4u + 8u / sqrt(2 KL)) |x|, KL = -ens_loss",
                             "the diversity gradient (p_k - p_0) / (B (K-1)) cancels when the "
                             "heads agree: rounding u of p is u / sqrt(2 KL) of the difference"),
    "scalars.losses": Row("|d| <= eps_f (|x| + log max(NA, n_regimes))",
                          "forward reductions of cross-entropies (C51 and CQL over NA atoms, the "
                          "ensemble's KL, the regime head's over n_regimes classes)"),
    "scalars.q": Row("|d| <= eps_f (|x| + max|z|)",
                     "forward means of expected Q in [v_min, v_max], and the IQN quantile Huber "
                     "loss (|d rho| <= |d u|: its quantiles are Q estimates on the same scale)"),
    "scalars.q_squared": Row("|d| <= eps_f (|x| + max|z|^2)",
                             "the MSE warm-up's 0.5 (E[Q] - y)^2: |d| <= |E - y| |dE| with E and "
                             "y on the support's scale"),
    "scalars.unit": Row("|d| <= eps_f (|x| + 1)",
                        "the next-bar head's squared error against labels scaled to unit RMS "
                        "(ISV 117)"),
    "scalars.exact": Row("exact", "the MSE warm-up's blend weight max(0, 1 - epoch / W): epoch "
                                  "from the shared ISV"),
    "scalars.clip_bound": Row("rtol 1e-5", "min(mgn, 100 max(slow EMA, 1)) of the shared state"),
}

#: Velocity signals: slot -> ("velocity", the slot whose signal it differences). A velocity
#: (signal now minus the slot's old value) cancels: its error is eps_f times the differenced
#: signal's size, not its own (ENS_VAR_VEL = the batch's distribution variance - ENS_VAR_EMA).
VELOCITY_OF = {"ENS_VAR_VEL": ("velocity", "ENS_VAR_EMA")}
#: Signals of the Q drift ``(q_mean - q_ema) / fmax(|q_ema|, 0.1)``: ``q_mean`` is a forward Q
#: mean (error eps_f (|q_mean| + max|z|), scalars.q) over a divisor that may be 0.1, so the
#: drift's error is that over the divisor, not eps_f times the (cancelled) drift; the learning
#: health ``util / (1 + |drift|)`` inherits it.
Q_DRIFT_KIND = "q_drift"
DRIFT_SIGNALS = ("Q_DRIFT", "LEARNING_HEALTH")


def _isv_step_producers() -> dict:
    from foxhunt.reference import isv as reg

    top = reg.ALPHA_BASE_DEFAULT * (1 + reg.SHARPE_GAIN * reg.SHARPE_CLAMP)
    out = {}
    for name in reg.SIGNAL_NAMES:
        if not reg.is_reserved(reg.slot(name)):
            kind = "gradient" if name in ("GRAD_NORM_EMA", "LOSS_EMA") else "forward"
            kind = VELOCITY_OF.get(name, Q_DRIFT_KIND if name in DRIFT_SIGNALS else kind)
            out[name] = (lambda c: top if c.adaptive_signals else None, kind)
    stats = [s.name for s in reg.REGISTRY if s.producer in ("q_stats_update", "q_quantile_update")]
    for name in stats:  # Q statistics: a Q estimate's error scales with the support (scalars.q)
        out[name] = (lambda c: top if c.q_stats else None, "q")
    for s in reg.REGISTRY:
        if s.producer == "adaptive_support_update":
            out[s.name] = (lambda c: 1.0 if c.q_stats else None, "q")
        if s.producer == "per_branch_gamma_update":  # epoch counters only: rtol alone
            out[s.name] = (lambda c: 1.0 if c.gamma_schedule else None, "data")
        if s.producer == "epsilon_tau_update":  # written directly, from the health signal
            out[s.name] = (lambda c: 1.0 if c.adaptive_epsilon_tau else None, "forward")
        if s.producer == "cql_alpha_ramp":  # an EMA toward cql_alpha (1 - this step's epsilon)
            out[s.name] = (lambda c: top if c.cql_alpha_ramp else None, "forward")
    return out


#: ISV slots the step writes: slot name -> (EMA rate, or None where the config's step does not
#: write the slot; "forward" | "gradient" | "q" | "data" | "q_drift" | ("velocity", slot)
#: signal). A "data"
#: signal is a reduction of the batch itself (no GEMM upstream): the slot is bounded by the
#: reduction rtol alone; a "q" signal is a statistic of expected Q values, whose error is
#: eps_f (|Q| + max|z|) (q_values); a velocity is bounded by its differenced slot's signal.
ISV_STEP_PRODUCERS: Mapping[str, tuple[Callable[[DQNConfig], float | None], str]] = {
    "Q_ABS_REF": (lambda c: ISV_PRODUCER_ALPHA, "forward"),
    "H_S2_RMS_EMA": (lambda c: ISV_PRODUCER_ALPHA, "forward"),
    SLOW_EMA: (lambda c: c.grad_slow_ema_alpha, "gradient"),
    # The next-bar head's label scale: an EMA of the batch's next-return RMS (adaptive rate).
    "AUX_LABEL_SCALE_EMA": (lambda c: 1.0 if c.aux_next_bar_on else None, "data"),
    # Issue 19's switched producers (reference.isv_step): EMAs at the Sharpe-adaptive rate,
    # bounded at its largest value; the support, epsilon and tau are written directly (rate
    # 1); the gamma schedule reads only epoch counters (rtol alone).
    **_isv_step_producers(),
}

COUNTER_FIELDS = ("step", "read_at", "fresh", "safety_clip_fired", "flags")
NORM_FIELDS = ("grad_norm", "c51_norm_pre", "c51_norm_post", "cql_norm_pre", "cql_norm_post",
               "iqn_norm_pre", "iqn_norm_post", "ens_norm_pre", "ens_norm_post")
#: The ensemble's norms (STEP_BOUNDS scalars.ens_norms) and the others (scalars.norms).
ENS_NORM_FIELDS = ("ens_norm_pre", "ens_norm_post")
NORM_FIELDS_OTHER = tuple(n for n in NORM_FIELDS if n not in ENS_NORM_FIELDS)
LOSS_FIELDS = ("loss", "c51_loss", "cql_loss", "ens_loss", "aux_regime_loss")
Q_FIELDS = ("mean_q", "mean_target_q", "iqn_loss")
Q_SQUARED_FIELDS = ("mse_loss",)
UNIT_FIELDS = ("aux_next_bar_loss",)
EXACT_SCALAR_FIELDS = ("mse_weight",)


def bound_row(key: str) -> Row:
    """The table row of a state_dict key (``sn_u.w_s1`` -> ``sn_u.*``); KeyError if none."""
    if key in STEP_BOUNDS:
        return STEP_BOUNDS[key]
    family = key.split(".")[0] + ".*"
    if "." in key and family in STEP_BOUNDS:
        return STEP_BOUNDS[family]
    raise KeyError(f"state_dict key {key!r} has no row in STEP_BOUNDS: add its bound and reason")


def k_max(config: DQNConfig) -> int:
    """The longest inner dimension of any GEMM of the step (forward K, backward dX and dW K),
    the second-wave heads' included (the IQN head's weight gradients sum over its B N rows)."""
    c = config
    ks = [c.batch_size, c.state_dim, c.shared_h1, c.shared_h2, c.value_h, c.adv_h,
          max(c.branches) * c.num_atoms]
    if c.iqn_on:
        ks += [c.batch_size * c.iqn_quantiles, c.iqn_embed, sum(c.branches)]
    if c.aux_on:
        ks += [c.aux_hidden, c.n_regimes]
    return max(ks)


def grad_eps(config: DQNConfig) -> float:
    """Relative (norm-wise) gradient difference allowed between two correct implementations.

    Per backward GEMM: each operand may be rounded differently (``INPUT_MISMATCH``: TF32
    truncation vs round-to-nearest), a relative ``2 m_in`` on the product, plus the forward
    operands' mismatch carried into the activations, plus a different accumulation order
    (``gamma_K``); over ``BACKWARD_GEMM_DEPTH`` chained GEMMs, times ``GRAD_SAFETY``.
    f32: about 1.2e-4 at the seed size (TF32 used by mistake gives ~3e-3 and fails);
    bf16: about 1.6e-2 (the TF32 operands dominate).
    """
    fwd, bwd = FORWARD_GEMM_MODE[config.precision], BACKWARD_GEMM_MODE[config.precision]
    per_gemm = 2 * INPUT_MISMATCH[bwd] + 2 * INPUT_MISMATCH[fwd] + gamma(k_max(config))
    return GRAD_SAFETY * BACKWARD_GEMM_DEPTH * per_gemm


#: Forward results in bf16 may also see a few BF16 rounding flips of activations (a flip is
#: one BF16 ulp, 2^-8 relative, on one of the >= 16 terms of a dot product): 2^-11 relative.
BF16_FLIP_ALLOWANCE = 2.0**-11


def fwd_eps(config: DQNConfig) -> float:
    """Relative difference allowed on forward-only results (losses, TD errors, mean Q, ISV
    signals): operand mismatch and accumulation order over ``FORWARD_GEMM_DEPTH`` layers, times
    ``GRAD_SAFETY``, plus ``BF16_FLIP_ALLOWANCE`` in bf16. About 1.2e-4 (f32) and 6e-4 (bf16)
    at the seed size; the CPU variant's forward results differ by ~1e-7."""
    fwd = FORWARD_GEMM_MODE[config.precision]
    per_gemm = 2 * INPUT_MISMATCH[fwd] + gamma(k_max(config))
    flips = BF16_FLIP_ALLOWANCE if fwd == "bf16" else 0.0
    return GRAD_SAFETY * FORWARD_GEMM_DEPTH * per_gemm + flips
