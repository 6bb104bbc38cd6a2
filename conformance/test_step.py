"""Step conformance (SPEC 8; issue 6 part 5): one ``step()`` of ``foxhunt.fast.Trainer`` against
the reference ``Trainer`` from one shared state, in each precision mode, presets ``tiny`` and
``seed``.

How a step is compared
----------------------
Trajectories diverge chaotically, so the implementations are compared one step at a time from a
shared state: a reference trainer's ``state_dict()`` (``fresh``: straight after construction,
so the step is Adam's first; ``warm``: after ``WARMUP_STEPS`` reference steps) is loaded into a
reference and a fast trainer, both step on the same batch, and every buffer of the two
``state_dict()``s, the step's scalars and TD errors are compared under :data:`STEP_BOUNDS` (one
table, the reason for each row next to it). In short:

- only the gradient can legitimately carry more than a few roundings of difference (a chain of
  GEMMs and reductions, TF32 operands that tensor cores may truncate): it is compared through
  the Adam moments, ``m = beta1 m0 + (1 - beta1) g``, with a per-tensor norm-wise bound and a
  per-element bound of relative size :func:`grad_eps`;
- everything downstream of the moments is compared *conditionally*: the fast path's parameters
  must be what the reference optimiser tail (Adam from the fast path's own ``m``/``v``, Mech 9,
  the batched spectral norm from the shared ``u``/``v``) gives, and the fast target what Polyak
  gives from the fast parameters, within a few roundings (Adam: 8 u relative to its operands;
  the spectral norm's rtol 1e-5 and Polyak's 2 ULP, the kernels' own tolerances). A direct
  worst-case bound against the reference's parameters (``2 lr R + ...``: each implementation
  moves a parameter by at most ``lr R``) is checked too;
- flags, counters, the ISV slots the step does not write (fingerprint bits included), the
  padding and the elements the reference's Adam skipped are compared bit for bit.

Discontinuities. A ReLU mask or a double-DQN argmax sitting within rounding distance of its
switching point legitimately flips one sample's whole contribution, and no tight bound survives
that. The batch is therefore *conditioned* (:func:`condition_batch`): a forward pass that
carries the size of the legitimate difference between two correct implementations
(:func:`deviation_forward`: independent accumulation roundings ``2 u sqrt(K) |w x|_2`` added in
quadrature through the layers, and in ``bf16`` a whole BF16 ulp wherever an activation sits
near a rounding midpoint) finds the rows of ``s`` whose ReLU pre-activations, and the rows of
``s2`` whose top-two expected Q values, lie within ``MARGIN_SAFETY`` such deviations of their
switching point, and those rows are redrawn. What remains is continuous in the rounding noise.

CPU self-checks (run everywhere): the reference steps bitwise-identically from one
``state_dict`` (the precondition of the comparison); ``state_dict`` and checkpoints round-trip
bit for bit; the bounds accept a legitimate re-implementation (every GEMM, bias-gradient, norm
and spectral mat-vec accumulated in float64, TF32 operands truncated as tensor cores may) and
reject deliberately wrong steps (a dropped CQL gradient, a sign error, TF32 in ``f32`` mode,
wrong lr or tau, a skipped spectral norm or ISV producer, a tail bug); the GPU tests' harnesses
(NaN injection, readback sequence, checkpoint interchange) run with a reference stand-in for
the fast trainer.

GPU (skipped with the ``cuda_device`` fixture's reason without one; a missing fast trainer is
a failure naming what is missing): one step per preset x precision x start; NaN/Inf injection
(NaN in ``s``, NaN / +Inf in ``r``, a NaN parameter: identical flags and NaN maps); the
``(step, fresh, read_at)`` readback sequence over 250 steps, re-synchronised from the reference
state every step, and free-running with non-finite readbacks; checkpoint interchange both ways.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import pytest

from foxhunt.conformance.registry import SPECS
from foxhunt.conformance.tolerance import (
    F32_UNIT_ROUNDOFF,
    INPUT_MISMATCH,
    REDUCTION_RTOL,
    Comparison,
    Tolerance,
    compare,
    gamma,
)
from foxhunt.reference import isv as isv_mod
from foxhunt.reference.backend import StepScalars, TrainerBackend, get_backend
from foxhunt.reference.batch import Batch
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.kernels import dense, optim, safety, spectral
from foxhunt.reference.layout import ParamLayout, branch_name
from foxhunt.reference.backend import BACKWARD_GEMM_MODE as BACKWARD_MODE
from foxhunt.reference.backend import FORWARD_GEMM_MODE as FORWARD_MODE
from foxhunt.reference.network import forward
from foxhunt.reference.step import support
from foxhunt.reference.trainer import ISV_PRODUCER_ALPHA, SLOW_EMA, Trainer

F32 = np.float32
F64 = np.float64
U = F32_UNIT_ROUNDOFF

PRESETS = ("tiny", "seed")
PRECISIONS = ("f32", "bf16")
STARTS = ("fresh", "warm")

#: Seed of the shared state and batches; reference steps taken before a ``warm`` state.
CASE_SEED = 11
WARMUP_STEPS = 3

#: Longest chain of GEMMs between the loss and a weight gradient (head layer 2 dX, head layer 1
#: dX, trunk layer 2 dX, trunk layer 1 dW), and between the input and the logits (4 layers).
BACKWARD_GEMM_DEPTH = 4
FORWARD_GEMM_DEPTH = 4
#: Factor on the gradient / forward error models (the CPU self-check's legitimate variant,
#: with TF32 truncation, reaches about a quarter of the bf16 bound, 1/100 of the f32 one).
GRAD_SAFETY = 2.0
#: A row is redrawn when a discontinuity lies within this many deviations of it (a Gaussian
#: rounding difference exceeds 8 sigma with probability ~1e-15).
MARGIN_SAFETY = 8.0
MAX_CONDITION_ROUNDS = 200

#: Roundings allowed in the conditional Adam check, relative to |p0| + |lr update| + |p|: the
#: update's chain (division, sqrt, add, division, product) and the bias corrections' power.
ADAM_ROUNDINGS = 8
#: Polyak's and the spectral norm's conditional checks use the kernels' own tolerances.
POLYAK_TOL = SPECS["polyak_update"].tolerance_of("out")
SPECTRAL_TOL = SPECS["batched_spectral_norm"].tolerance_of("us")
EXACT = Tolerance.exact()

#: The readback-sequence tests: steps, and the steps whose batch carries a NaN reward.
SEQUENCE_STEPS = 250
SEQUENCE_POISONED = (100, 150)


# ============================================================================ the bound table
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
        "slots (ISV_STEP_PRODUCERS): rtol 1e-5 + alpha eps |signal|",
        "an EMA (1-alpha) isv0 + alpha signal from the shared isv0 moves by alpha times the "
        "signal's difference; the signal is a forward (eps_f) or gradient-norm (eps_g) quantity"),
    "flags": Row("exact", "sentinel flags (SPEC 8: flags exactly equal)"),
    "adam_t": Row("exact", "step counter"),
    "step": Row("exact", "step counter"),
    "padding": Row("exact (+0.0)", "the layout's padding is always zero in every flat buffer"),
    "td_errors": Row("|d td_b| <= eps_f (|td_b| + log NA)",
                     "per-sample cross-entropy (forward only): its natural scale is log NA"),
    "q_values": Row("|dQ| <= eps_f (|Q| + max|z|)",
                    "the greedy evaluation after the step: a forward pass on the new parameters "
                    "(those are checked above), expected Q in [v_min, v_max]"),
    "scalars.counters": Row("exact", "step, read_at, fresh, safety_clip_fired, flags"),
    "scalars.norms": Row("|d| <= eps_g |x| + 4u|x|",
                         "| ||g_f|| - ||g_r|| | <= ||g_f - g_r|| <= eps_g ||g_r|| (triangle inequality)"),
    "scalars.losses": Row("|d| <= eps_f (|x| + log NA)", "forward reductions of cross-entropies"),
    "scalars.q": Row("|d| <= eps_f (|x| + max|z|)", "forward means of expected Q in [v_min, v_max]"),
    "scalars.clip_bound": Row("rtol 1e-5", "min(mgn, 100 max(slow EMA, 1)) of the shared state"),
}

#: ISV slots the step writes: slot name -> (EMA rate, "forward" | "gradient" signal).
ISV_STEP_PRODUCERS: Mapping[str, tuple[Callable[[DQNConfig], float], str]] = {
    "Q_ABS_REF": (lambda c: ISV_PRODUCER_ALPHA, "forward"),
    "H_S2_RMS_EMA": (lambda c: ISV_PRODUCER_ALPHA, "forward"),
    SLOW_EMA: (lambda c: c.grad_slow_ema_alpha, "gradient"),
}

COUNTER_FIELDS = ("step", "read_at", "fresh", "safety_clip_fired", "flags")
NORM_FIELDS = ("grad_norm", "c51_norm_pre", "c51_norm_post", "cql_norm_pre", "cql_norm_post")
LOSS_FIELDS = ("loss", "c51_loss", "cql_loss")
Q_FIELDS = ("mean_q", "mean_target_q")


def bound_row(key: str) -> Row:
    """The table row of a state_dict key (``sn_u.w_s1`` -> ``sn_u.*``); KeyError if none."""
    if key in STEP_BOUNDS:
        return STEP_BOUNDS[key]
    family = key.split(".")[0] + ".*"
    if "." in key and family in STEP_BOUNDS:
        return STEP_BOUNDS[family]
    raise KeyError(f"state_dict key {key!r} has no row in STEP_BOUNDS: add its bound and reason")


def k_max(config: DQNConfig) -> int:
    """The longest inner dimension of any GEMM of the step (forward K, backward dX and dW K)."""
    c = config
    return max(c.batch_size, c.state_dim, c.shared_h1, c.shared_h2, c.value_h, c.adv_h,
               max(c.branches) * c.num_atoms)


def grad_eps(config: DQNConfig) -> float:
    """Relative (norm-wise) gradient difference allowed between two correct implementations.

    Per backward GEMM: each operand may be rounded differently (``INPUT_MISMATCH``: TF32
    truncation vs round-to-nearest), a relative ``2 m_in`` on the product, plus the forward
    operands' mismatch carried into the activations, plus a different accumulation order
    (``gamma_K``); over ``BACKWARD_GEMM_DEPTH`` chained GEMMs, times ``GRAD_SAFETY``.
    f32: about 1.2e-4 at the seed size (TF32 used by mistake gives ~3e-3 and fails);
    bf16: about 1.6e-2 (the TF32 operands dominate).
    """
    fwd, bwd = FORWARD_MODE[config.precision], BACKWARD_MODE[config.precision]
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
    fwd = FORWARD_MODE[config.precision]
    per_gemm = 2 * INPUT_MISMATCH[fwd] + gamma(k_max(config))
    flips = BF16_FLIP_ALLOWANCE if fwd == "bf16" else 0.0
    return GRAD_SAFETY * FORWARD_GEMM_DEPTH * per_gemm + flips


# ============================================================================ custom bounds
@dataclass(frozen=True)
class StepBound(Tolerance):
    """An elementwise absolute bound computed per element (``inputs["magnitude"]``) under the
    reduction machinery (``rtol 0``, ``atol_per_elem 1``, ``length 1``), described in words."""

    text: str = ""

    def describe(self) -> str:
        return self.text


def _bounded(name: str, actual: Any, expected: Any, bound: Any, text: str,
             exact: Any = None) -> Comparison:
    tol = StepBound("reduction", rtol=0.0, atol_per_elem=1.0, text=text)
    inputs: dict = {"length": 1, "magnitude": np.asarray(bound, F64)}
    if exact is not None:
        inputs["exact"] = exact
    return compare(name, actual, expected, tol, inputs)


def _add_problem(result: Comparison, problem: str) -> None:
    result.problems.append(problem)
    result.passed = False
    result.message = (result.message + "\n" + problem) if result.message else f"{result.name}: {problem}"


def _normwise(result: Comparison, diff: np.ndarray, allowed: float, what: str) -> None:
    """Attach a norm-wise check ``||diff|| <= allowed`` (NaN entries ignored) to ``result``."""
    err = float(np.sqrt(np.sum(np.where(np.isfinite(diff), diff, 0.0) ** 2)))
    ratio = 0.0 if err == 0 else (err / allowed if allowed > 0 else math.inf)
    if result.rms_rel is None or ratio > result.rms_rel:
        result.rms_rel, result.rms_bound = ratio, 1.0
    if ratio > 1.0:
        _add_problem(result, f"{what}: norm-wise difference {err:.3g} exceeds {allowed:.3g} "
                             f"({ratio:.3g} x bound)")


def _bits(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x)
    return x.view(f"u{x.dtype.itemsize}") if x.dtype.kind == "f" else x


# ============================================================================ outcomes
@dataclass
class StepOutcome:
    """What one trainer produced from the shared state: ``state_dict()`` after the step, the
    scalars ``step()`` returned, ``end_epoch()``'s fresh scalars, the TD errors, and the greedy
    evaluation ``q_values`` of the batch's states after the step."""

    state: dict[str, np.ndarray]
    scalars: StepScalars
    end: StepScalars
    td: np.ndarray
    q: list[np.ndarray]


def run_step(trainer: TrainerBackend, batch: Batch) -> StepOutcome:
    with np.errstate(all="ignore"):
        scalars = trainer.step(_copy_batch(batch))
        td = np.array(trainer.last_td_errors(), copy=True)
        end = trainer.end_epoch()
        q = [np.array(x, copy=True) for x in trainer.q_values(batch.s.copy())]
    return StepOutcome({k: np.array(v, copy=True) for k, v in trainer.state_dict().items()},
                       scalars, end, td, q)


def close(*trainers: TrainerBackend) -> None:
    """Release device resources of trainers that hold them (the fast trainer's ``close``)."""
    for trainer in trainers:
        release = getattr(trainer, "close", None)
        if callable(release):
            release()


def _copy_batch(batch: Batch) -> Batch:
    return Batch(**{f.name: np.array(getattr(batch, f.name), copy=True)
                    for f in dataclasses.fields(Batch)})


# ============================================================================ the comparison
class _Context:
    """Derived facts of one comparison: layout, constants, and the reference's gradient."""

    def __init__(self, config: DQNConfig, before: Mapping[str, np.ndarray]):
        self.config = config
        self.layout = ParamLayout(config)
        self.before = before
        self.eps_g = grad_eps(config)
        self.eps_f = fwd_eps(config)
        self.b1, self.b2 = F32(config.beta1), F32(config.beta2)
        self.lr, self.tau = F32(config.lr), F32(config.tau)
        self.t = int(before["adam_t"][0]) + 1
        self.padding = self.layout.padding_mask()
        self.z = support(config)
        self.log_na = math.log(config.num_atoms)
        self.zmax = float(np.max(np.abs(self.z)))

    def tensors(self):
        return [(t, slice(t.offset, t.end)) for t in self.layout.tensors]

    def weight_clamp(self) -> F32:
        q_abs_ref = self.before["isv"][isv_mod.Q_ABS_REF_INDEX]
        return F32(safety.isv_bound(F32(self.config.weight_clamp_mult), q_abs_ref))


def _unchanged(after: np.ndarray, before: np.ndarray) -> np.ndarray:
    return _bits(after) == _bits(before)


def recovered_grad(m_after: np.ndarray, m_before: np.ndarray, beta1: F32) -> np.ndarray:
    """The gradient Adam saw, from ``m = b1 m0 + (1-b1) g`` (float64; error ~ 2^-24 |m| / (1-b1))."""
    b1 = F64(beta1)
    with np.errstate(all="ignore"):
        return (m_after.astype(F64) - b1 * m_before.astype(F64)) / F64(F32(1) - beta1)


def _moment_comparisons(cx: _Context, ref: Mapping, fast: Mapping) -> list[Comparison]:
    b1, b2 = F64(cx.b1), F64(cx.b2)
    m0, v0 = cx.before["adam_m"], cx.before["adam_v"]
    skipped = _unchanged(ref["adam_m"], m0) & _unchanged(ref["adam_v"], v0)
    g = np.where(skipped, 0.0, recovered_grad(ref["adam_m"], m0, cx.b1))
    g = np.where(np.isfinite(g), g, 0.0)
    gmax = np.zeros_like(g)
    for _, sl in cx.tensors():
        gmax[sl] = np.max(np.abs(g[sl]), initial=0.0)
    dg = cx.eps_g * (np.abs(g) + gmax)
    m_r, v_r = ref["adam_m"].astype(F64), ref["adam_v"].astype(F64)
    m_round = 2 * U * (b1 * np.abs(m0) + (1 - b1) * np.abs(g) + np.abs(m_r))
    v_round = 2 * U * (b2 * np.abs(v0) + (1 - b2) * g * g + np.abs(v_r))
    # Where the reference skipped a non-zero state (a non-finite gradient), the moments must be
    # kept bit for bit; a skipped zero state is a zero gradient, bounded like any other.
    frozen = skipped & ((m0 != 0) | (v0 != 0)) | cx.padding
    m_bound = (1 - b1) * dg + m_round
    v_bound = (1 - b2) * (2 * np.abs(g) + dg) * dg + v_round
    m_cmp = _bounded("adam_m", fast["adam_m"], ref["adam_m"], m_bound,
                     f"gradient bound eps_g={cx.eps_g:.3g}", exact=frozen)
    v_cmp = _bounded("adam_v", fast["adam_v"], ref["adam_v"], v_bound,
                     f"gradient bound eps_g={cx.eps_g:.3g}", exact=frozen)
    with np.errstate(all="ignore"):
        dm = fast["adam_m"].astype(F64) - m_r
        dv = fast["adam_v"].astype(F64) - v_r
    for t, sl in cx.tensors():
        norm_g = float(np.linalg.norm(g[sl]))
        _normwise(m_cmp, dm[sl], (1 - b1) * cx.eps_g * norm_g + float(np.linalg.norm(m_round[sl])),
                  f"tensor {t.name}")
        g_top = float(gmax[sl][0]) if t.size else 0.0
        _normwise(v_cmp, dv[sl], (1 - b2) * (2 + cx.eps_g) * g_top * cx.eps_g * norm_g
                  + float(np.linalg.norm(v_round[sl])), f"tensor {t.name}")
    return [m_cmp, v_cmp]


def adam_from_moments(cx: _Context, p0: np.ndarray, m: np.ndarray, v: np.ndarray,
                      skipped: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """SPEC 4 step 6 applied to given new moments: ``(params, |lr * update|)``, what the
    parameters must be given ``m`` and ``v`` (float32 operations in the reference's order;
    ``beta^t`` in double rounded once), and the size of the step (the rounding scale)."""
    c = cx.config
    bc1 = F32(1) - F32(float(cx.b1) ** cx.t)
    bc2 = F32(1) - F32(float(cx.b2) ** cx.t)
    with np.errstate(all="ignore"):
        update = (m / bc1) / (np.sqrt(v / bc2) + F32(c.adam_eps)) + F32(c.weight_decay) * p0
        step = (cx.lr * update).astype(F32)
        p = (p0 - step).astype(F32)
    p = safety.clamp_finite(p, cx.weight_clamp())
    return np.where(skipped, p0, p).astype(F32), np.where(skipped, 0.0, np.abs(step.astype(F64)))


def _adam_ratio_bound(cx: _Context) -> np.ndarray:
    """``R_i``: the largest ``|mhat / (sqrt(vhat) + eps)|`` any gradient can give from m0, v0."""
    m0, v0 = cx.before["adam_m"].astype(F64), cx.before["adam_v"].astype(F64)
    b1, b2 = F64(cx.b1), F64(cx.b2)
    bc1, bc2 = 1 - b1**cx.t, 1 - b2**cx.t
    with np.errstate(all="ignore"):
        carried = np.where(m0 == 0, 0.0, b1 * np.abs(m0) / np.sqrt(b2 * v0))
    carried = np.where(np.isnan(carried), np.inf, carried)
    return math.sqrt(bc2) / bc1 * (carried + (1 - b1) / math.sqrt(1 - b2))


def _param_comparisons(cx: _Context, ref: Mapping, fast: Mapping) -> list[Comparison]:
    c, lay = cx.config, cx.layout
    p0 = cx.before["params"]
    skipped_f = _unchanged(fast["adam_m"], cx.before["adam_m"]) & \
        _unchanged(fast["adam_v"], cx.before["adam_v"])
    p_adam, step = adam_from_moments(cx, p0, fast["adam_m"], fast["adam_v"], skipped_f)
    views = lay.views(p_adam)
    mats = lay.weight_matrices
    with np.errstate(all="ignore"):
        sn = spectral.batched_spectral_norm(
            [views[t.name] for t in mats], [cx.before[f"sn_u.{t.name}"] for t in mats],
            [cx.before[f"sn_v.{t.name}"] for t in mats], F32(c.sigma_max))
    expected = p_adam.copy()
    scaled = np.zeros(p0.shape, bool)
    results: list[Comparison] = []
    for k, t in enumerate(mats):
        expected[t.offset:t.end] = sn.ws[k].ravel()
        if not np.asarray(sn.sigmas[k] <= F32(c.sigma_max) * F32(1 - REDUCTION_RTOL)):
            scaled[t.offset:t.end] = True
        length = sum(t.shape)
        for name, exp in ((f"sn_u.{t.name}", sn.us[k]), (f"sn_v.{t.name}", sn.vs[k])):
            mag = float(np.max(np.abs(exp), initial=0.0))
            results.append(compare(f"{name} | fast weights", fast[name], exp, SPECTRAL_TOL,
                                   {"length": length, "magnitude": mag}))
    # Adam's arithmetic: ADAM_ROUNDINGS roundings relative to its operands (p0 and the step;
    # the result may cancel), plus rtol 1e-5 where the spectral norm rescaled the matrix.
    mag = np.abs(p0.astype(F64)) + step + np.abs(expected.astype(F64))
    bound = ADAM_ROUNDINGS * U * mag + np.where(scaled, REDUCTION_RTOL * np.abs(expected.astype(F64)), 0)
    results.append(_bounded("params | fast moments", fast["params"], expected,
                            np.where(np.isfinite(bound), bound, 0.0),
                            f"{ADAM_ROUNDINGS} u (|p0| + |lr update| + |p|) [+ rtol 1e-5 if rescaled]",
                            exact=cx.padding))

    # Direct: each implementation moves a parameter by at most lr R_i (plus its roundings).
    reach = 2 * F64(cx.lr) * _adam_ratio_bound(cx) * (1 + ADAM_ROUNDINGS * U)
    direct = reach.copy()
    p_r = np.abs(ref["params"].astype(F64))
    for t in mats:
        sl = slice(t.offset, t.end)
        rel = REDUCTION_RTOL + 2 * float(np.linalg.norm(reach[sl])) / c.sigma_max
        direct[sl] += rel * p_r[sl]
    direct += ADAM_ROUNDINGS * U * (p_r + np.abs(p0.astype(F64)))
    results.append(_bounded("params | reference", fast["params"], ref["params"],
                            np.where(cx.padding, 0.0, direct), "2 lr R_i + spectral + 8u(|p0| + |p|)",
                            exact=cx.padding))
    results.append(compare("target | fast params (Polyak)", fast["target"],
                           optim.polyak_update(cx.before["target"], fast["params"], cx.tau),
                           POLYAK_TOL, {"exact": cx.padding}))
    t_r = np.abs(ref["target"].astype(F64))
    results.append(_bounded("target | reference", fast["target"], ref["target"],
                            np.where(cx.padding, 0.0, F64(cx.tau) * direct + 4 * U * t_r),
                            "tau * params bound + 4u|target|", exact=cx.padding))
    return results


def _isv_comparison(cx: _Context, ref: np.ndarray, fast: np.ndarray) -> Comparison:
    before = cx.before["isv"]
    written = ~_unchanged(ref, before)
    producers = {isv_mod.slot(name).index: (rate(cx.config), kind)
                 for name, (rate, kind) in ISV_STEP_PRODUCERS.items()}
    bound = np.zeros(ref.shape, F64)
    for index, (alpha, kind) in producers.items():
        eps = cx.eps_f if kind == "forward" else cx.eps_g
        signal = abs(F64(ref[index]) - (1 - alpha) * F64(before[index])) / alpha
        bound[index] = REDUCTION_RTOL * abs(F64(ref[index])) + alpha * eps * signal
    exact = np.ones(ref.shape, bool)
    exact[list(producers)] = False
    result = _bounded("isv", fast, ref, np.where(np.isfinite(bound), bound, 0.0),
                      "bitwise; producers rtol 1e-5 + alpha eps |signal|", exact=exact)
    unknown = [isv_mod.slot_at(int(i)).name if isv_mod.slot_at(int(i)) else str(int(i))
               for i in np.flatnonzero(written) if int(i) not in producers]
    if unknown:
        _add_problem(result, f"the reference step writes ISV slot(s) {unknown}, which "
                             "ISV_STEP_PRODUCERS does not cover: add their bound")
    return result


def _scalar_comparisons(cx: _Context, label: str, ref: StepScalars, fast: StepScalars) -> list[Comparison]:
    out = []
    for name in COUNTER_FIELDS:  # compared as integers: a bool and a 0/1 int are the same fact
        out.append(compare(f"{label}.{name}", np.asarray(getattr(fast, name), np.int64),
                           np.asarray(getattr(ref, name), np.int64), EXACT))
    for fields, rule in ((NORM_FIELDS, lambda x: cx.eps_g * abs(x) + 4 * U * abs(x)),
                         (LOSS_FIELDS, lambda x: cx.eps_f * (abs(x) + cx.log_na)),
                         (Q_FIELDS, lambda x: cx.eps_f * (abs(x) + cx.zmax)),
                         (("clip_bound",), lambda x: REDUCTION_RTOL * abs(x))):
        for name in fields:
            r, f = F64(getattr(ref, name)), F64(getattr(fast, name))
            bound = rule(r) if math.isfinite(r) else 0.0
            out.append(_bounded(f"{label}.{name}", np.asarray(f), np.asarray(r), bound,
                                "see STEP_BOUNDS scalars.*"))
    return out


def compare_step(config: DQNConfig, before: Mapping[str, np.ndarray], ref: StepOutcome,
                 fast: StepOutcome) -> list[Comparison]:
    """Every comparison of one step (see :data:`STEP_BOUNDS`); none raises on a mismatch."""
    cx = _Context(config, before)
    results: list[Comparison] = []
    missing, extra = sorted(set(ref.state) - set(fast.state)), sorted(set(fast.state) - set(ref.state))
    if missing or extra:
        keys = compare("state_dict keys", np.array([0]), np.array([0]), EXACT)
        _add_problem(keys, f"fast state_dict lacks {missing}, has extra {extra}")
        return [keys]
    for key in ref.state:
        bound_row(key)  # every buffer has a documented bound (raises otherwise)
    for key in ("flags", "adam_t", "step"):
        results.append(compare(key, fast.state[key], ref.state[key], EXACT))
    results += _moment_comparisons(cx, ref.state, fast.state)
    results += _param_comparisons(cx, ref.state, fast.state)
    results.append(_isv_comparison(cx, ref.state["isv"], fast.state["isv"]))
    results.append(_bounded("td_errors", fast.td, ref.td,
                            cx.eps_f * (np.abs(ref.td.astype(F64)) + cx.log_na), "eps_f (|td| + log NA)"))
    if len(ref.q) != len(fast.q):
        results.append(compare("q_values", np.array([len(fast.q)]), np.array([len(ref.q)]), EXACT))
    for d, (q_r, q_f) in enumerate(zip(ref.q, fast.q)):
        results.append(_bounded(f"q_values[{d}]", q_f, q_r,
                                cx.eps_f * (np.abs(q_r.astype(F64)) + cx.zmax), "eps_f (|Q| + max|z|)"))
    results += _scalar_comparisons(cx, "step()", ref.scalars, fast.scalars)
    results += _scalar_comparisons(cx, "end_epoch()", ref.end, fast.end)
    return results


def failures(results: list[Comparison]) -> list[str]:
    return [r.message for r in results if not r.passed]


# ============================================================================ deviation forward
#: A BF16 rounding flip less likely than this (Gaussian tail bound) is not provided for.
FLIP_PROBABILITY_FLOOR = 1e-9


def _bf16_flips(x: np.ndarray, sigma: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(probability, jump)`` of ``x``'s BF16 rounding differing when the other implementation
    holds ``x + N(0, sigma)``: ``exp(-d^2 / 2 sigma^2)`` (a bound on the Gaussian tail beyond the
    distance ``d`` to the nearest rounding midpoint) and one BF16 ulp."""
    bits = np.ascontiguousarray(x, F32).view(np.uint32)
    low = (bits & np.uint32(0xFFFF)).astype(np.int64)
    f32_ulp = np.spacing(np.abs(x).astype(F32)).astype(F64)
    dist = np.abs(low - 0x8000) * f32_ulp
    with np.errstate(divide="ignore", invalid="ignore"):
        prob = np.where(sigma > 0, np.exp(-0.5 * (dist / sigma) ** 2), (dist == 0).astype(F64))
    return prob, 65536.0 * f32_ulp


@dataclass
class Deviations:
    """Reference values and how far a correct implementation may be from them: per ReLU
    pre-activation and per expected Q, the ``reach`` within which a switch counts as near."""

    pre_activations: list[tuple[str, np.ndarray, np.ndarray]]  # (name, t [N, H], reach [N, H])
    q: list[tuple[np.ndarray, np.ndarray]]                     # per branch (q, reach) [N, n_d]


def _max_single_flip(jump: np.ndarray, w_abs: np.ndarray, chunk: int = 32) -> np.ndarray:
    """``max_k |w[n, k]| jump[b, k]`` per (b, n): the largest effect of one flipped input
    (``jump`` is sparse: only the rows and columns holding a flip are visited)."""
    out = np.zeros((jump.shape[0], w_abs.shape[0]), np.float32)
    rows = np.flatnonzero(jump.any(axis=1))
    for start in range(0, len(rows), chunk):
        rs = rows[start:start + chunk]
        ks = np.flatnonzero(jump[rs].any(axis=0))
        j = jump[np.ix_(rs, ks)].astype(np.float32)
        out[rs] = np.max(j[:, None, :] * w_abs[None, :, ks].astype(np.float32), axis=2)
    return out.astype(F64)


def deviation_forward(config: DQNConfig, params: np.ndarray, x: np.ndarray,
                      h2_bound: F32) -> Deviations:
    """The forward pass with, for every ReLU pre-activation and expected Q, how far it may
    legitimately differ between two correct implementations (float64).

    Error model: the two implementations' accumulation errors are independent roundings, so a
    K-term dot product differs by a standard deviation of about ``2 u sqrt(K) |w x|_2``, and
    input deviations add in quadrature (a worst-case interval grows ~10x per layer and flags
    every row). In ``bf16`` an activation's BF16 rounding may flip (probability ``pi`` from its
    distance to the rounding midpoint): flips add ``pi J^2 w^2`` to the variance, and the
    largest single likely flip (``pi > FLIP_PROBABILITY_FLOOR``) is added to the reach in full.
    ``reach = MARGIN_SAFETY sigma + largest flip``. ReLU and the Mech 10 clamp are 1-Lipschitz;
    ``dQ = sum_j p_j (z_j - Q) dlogit_j``.
    """
    layout = ParamLayout(config)
    bf16 = FORWARD_MODE[config.precision] == "bf16"
    p = layout.views(params)
    with np.errstate(all="ignore"):
        act = forward(config, layout, params, x, h2_bound=h2_bound)

    def layer(inp, sigma_in, w_name, b_name):
        w, b = p[w_name], p[b_name].astype(F64)
        flip_var = np.zeros(inp.shape, F64)
        flip_max = 0.0
        if bf16:
            prob, jump = _bf16_flips(inp, sigma_in)
            flip_var = prob * jump * jump
            inp, w = dense.round_for(inp, "bf16"), dense.round_for(w, "bf16")
        x64, w64 = inp.astype(F64), w.astype(F64)
        if bf16:
            flip_max = _max_single_flip(np.where(prob > FLIP_PROBABILITY_FLOOR, jump, 0.0), np.abs(w64))
        t = x64 @ w64.T + b
        # Variances only set the size of a margin: float32 is plenty for them.
        w_sq = (w64 * w64).astype(np.float32)
        k = inp.shape[1] + 1
        var = ((sigma_in * sigma_in + flip_var).astype(np.float32) @ w_sq.T).astype(F64) \
            + (2 * U) ** 2 * k * (((x64 * x64).astype(np.float32) @ w_sq.T).astype(F64) + b * b)
        sigma = np.sqrt(var)
        return t, sigma, MARGIN_SAFETY * sigma + flip_max

    zero = np.zeros(x.shape, F64)
    t1, s1, r1 = layer(act.x, zero, "w_s1", "b_s1")
    t2, s2, r2 = layer(act.h1, s1, "w_s2", "b_s2")
    tv, sv, rv = layer(act.h2, s2, "w_v1", "b_v1")
    v, _, reach_v = layer(act.hv, sv, "w_v2", "b_v2")
    pre = [("h1", t1, r1), ("h2", t2, r2), ("hv", tv, rv)]
    z = support(config).astype(F64)
    qs = []
    n_rows = x.shape[0]
    for d, n in enumerate(config.branches):
        br = branch_name(d)
        ta, sa, ra = layer(act.h2, s2, f"w_{br}1", f"b_{br}1")
        pre.append((f"ha_{br}", ta, ra))
        adv, _, reach_adv = layer(act.ha[d], sa, f"w_{br}2", f"b_{br}2")
        adv, reach_adv = (a.reshape(n_rows, n, config.num_atoms) for a in (adv, reach_adv))
        reach_logit = reach_v[:, None, :] + reach_adv + reach_adv.mean(axis=1, keepdims=True) \
            + 4 * U * (np.abs(v)[:, None, :] + np.abs(adv) + np.abs(adv).mean(axis=1, keepdims=True))
        prob = np.exp(act.logp[d].astype(F64))
        q = (prob * z).sum(axis=2)
        reach_q = reach_logit.max(axis=2) * (prob * np.abs(z - q[:, :, None])).sum(axis=2) \
            + MARGIN_SAFETY * 4 * U * config.num_atoms * (prob * np.abs(z)).sum(axis=2)
        qs.append((q, reach_q))
    return Deviations(pre, qs)


def _h2_bound(config: DQNConfig, isv: np.ndarray) -> F32:
    return F32(safety.isv_bound(F32(config.h2_clamp_mult), isv[isv_mod.H_S2_RMS_EMA_INDEX]))


def near_relu_switch(config: DQNConfig, params: np.ndarray, s: np.ndarray, h2_bound: F32) -> np.ndarray:
    """Rows of ``s`` with a ReLU pre-activation within its reach of 0."""
    bad = np.zeros(s.shape[0], bool)
    for _, t, reach in deviation_forward(config, params, s, h2_bound).pre_activations:
        bad |= np.any(~(np.abs(t) > reach), axis=1)
    return bad


def near_argmax_tie(config: DQNConfig, params: np.ndarray, s2: np.ndarray, h2_bound: F32) -> np.ndarray:
    """Rows of ``s2`` whose best and second-best expected Q (any branch) are within the sum of
    their reaches."""
    bad = np.zeros(s2.shape[0], bool)
    for q, reach in deviation_forward(config, params, s2, h2_bound).q:
        order = np.argsort(-q, axis=1, kind="stable")
        rows = np.arange(q.shape[0])
        best, second = order[:, 0], order[:, 1]
        gap = q[rows, best] - q[rows, second]
        bad |= ~(gap > reach[rows, best] + reach[rows, second])
    return bad


def condition_batch(config: DQNConfig, state: Mapping[str, np.ndarray], batch: Batch,
                    rng: np.random.Generator) -> Batch:
    """Redraw the rows of ``s`` near a ReLU switch and of ``s2`` near a double-DQN tie (module
    docstring) until none is left; only the redrawn rows are re-examined."""
    params, h2_bound = state["params"], _h2_bound(config, state["isv"])
    s, s2 = batch.s.copy(), batch.s2.copy()
    todo_s, todo_s2 = np.arange(len(s)), np.arange(len(s2))
    for _ in range(MAX_CONDITION_ROUNDS):
        if len(todo_s):
            todo_s = todo_s[near_relu_switch(config, params, s[todo_s], h2_bound)]
        if len(todo_s2):
            todo_s2 = todo_s2[near_argmax_tie(config, params, s2[todo_s2], h2_bound)]
        if not len(todo_s) and not len(todo_s2):
            return dataclasses.replace(batch, s=s, s2=s2).validate(config)
        s[todo_s] = rng.standard_normal((len(todo_s), s.shape[1])).astype(F32)
        s2[todo_s2] = rng.standard_normal((len(todo_s2), s2.shape[1])).astype(F32)
    raise AssertionError(f"condition_batch: {len(todo_s)} rows of s and {len(todo_s2)} of s2 still "
                         f"near a discontinuity after {MAX_CONDITION_ROUNDS} rounds")


# ============================================================================ shared cases
@dataclass(frozen=True)
class Case:
    config: DQNConfig
    state: Mapping[str, np.ndarray]
    batch: Batch

    def fresh_state(self) -> dict[str, np.ndarray]:
        return {k: np.array(v, copy=True) for k, v in self.state.items()}


@functools.lru_cache(maxsize=None)
def shared_case(preset: str, precision: str, start: str) -> Case:
    """The shared state (``fresh`` or ``warm``) and a conditioned batch for one comparison."""
    config = DQNConfig.preset(preset, precision=precision)
    rng = np.random.default_rng([CASE_SEED, PRESETS.index(preset), PRECISIONS.index(precision)])
    trainer = Trainer(config, seed=CASE_SEED)
    if start == "warm":
        for _ in range(WARMUP_STEPS):
            trainer.step(Batch.random(config, rng))
    elif start != "fresh":
        raise ValueError(f"start={start!r}: allowed values are {STARTS}")
    state = trainer.state_dict()
    batch = condition_batch(config, state, Batch.random(config, rng), rng)
    return Case(config, state, batch)


def reference_from(case_config: DQNConfig, state: Mapping[str, np.ndarray]) -> Trainer:
    trainer = Trainer(case_config)
    trainer.load_state_dict({k: np.array(v, copy=True) for k, v in state.items()})
    return trainer


# ============================================================================ the fast trainer
def fast_trainer_class() -> type[TrainerBackend]:
    """``foxhunt.fast.Trainer`` through the backend registry (as ``loop.run`` finds it); a
    clear failure while it does not exist yet."""
    try:
        cls = get_backend("fast")
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"the fast trainer is not available: get_backend('fast') raised "
                    f"{type(exc).__name__}: {exc} (foxhunt.fast.Trainer in fast/trainer.py, "
                    "exported from foxhunt.fast, is what step conformance tests)")
    missing = [m for m in ("step", "end_epoch", "state_dict", "load_state_dict", "last_td_errors",
                           "fold_boundary", "save", "load") if not callable(getattr(cls, m, None))]
    if missing:
        pytest.fail(f"foxhunt.fast.Trainer lacks {missing} of the backend interface")
    return cls


#: A trainer class with the backend interface (``cls(config)``, ``cls.load(path)``).
Factory = type[TrainerBackend]


def fast_factory() -> Factory:
    return fast_trainer_class()


def _loaded(factory: Factory, config: DQNConfig, state: Mapping[str, np.ndarray]) -> TrainerBackend:
    trainer = factory(config)
    trainer.load_state_dict({k: np.array(v, copy=True) for k, v in state.items()})
    return trainer


def _record(record_property, case: str, results: list[Comparison]) -> None:
    record_property("kernel", "trainer.step")
    record_property("case", case)
    for r in results:
        record_property("comparison", r.as_dict())


def _assert_all(results: list[Comparison]) -> None:
    bad = failures(results)
    assert not bad, f"{len(bad)} of {len(results)} step comparisons failed:\n\n" + "\n\n".join(bad)


def state_round_trip_problems(trainer: TrainerBackend, state: Mapping[str, np.ndarray]) -> list[str]:
    """``load_state_dict(state)`` then ``state_dict()`` must give ``state`` back bit for bit."""
    got = trainer.state_dict()
    problems = []
    if set(got) != set(state):
        problems.append(f"keys differ: missing {sorted(set(state) - set(got))}, "
                        f"extra {sorted(set(got) - set(state))}")
    for k in sorted(set(got) & set(state)):
        a, b = np.asarray(got[k]), np.asarray(state[k])
        if a.dtype != b.dtype or a.shape != b.shape or not np.array_equal(_bits(a), _bits(b)):
            problems.append(f"{k}: not bit-identical after load_state_dict (dtype {a.dtype} vs "
                            f"{b.dtype}, shape {a.shape} vs {b.shape})")
    return problems


# ---------------------------------------------------------------------------- the checks
def one_step(factory: Factory, case: Case) -> tuple[list[Comparison], StepOutcome, StepOutcome]:
    """Both trainers from the shared state, one step: (comparisons, reference, other)."""
    ref = reference_from(case.config, case.state)
    other = _loaded(factory, case.config, case.state)
    try:
        problems = state_round_trip_problems(other, case.state)
        assert not problems, "state_dict round trip: " + "; ".join(problems)
        ref_out, other_out = run_step(ref, case.batch), run_step(other, case.batch)
    finally:
        close(other)
    return compare_step(case.config, case.state, ref_out, other_out), ref_out, other_out


INJECTIONS = ("nan_s", "nan_r", "inf_r", "nan_param")


def injected(case: Case, kind: str) -> tuple[dict[str, np.ndarray], Batch]:
    """The shared state and batch with one non-finite value planted (``INJECTIONS``)."""
    state, batch = case.fresh_state(), _copy_batch(case.batch)
    row = batch.s.shape[0] // 3
    if kind == "nan_s":
        batch.s[row, batch.s.shape[1] // 2] = np.nan
    elif kind == "nan_r":
        batch.r[row] = np.nan
    elif kind == "inf_r":
        batch.r[row] = np.inf
    elif kind == "nan_param":
        w = ParamLayout(case.config)["w_s1"]
        state["params"][w.offset + w.size // 2 + 1] = np.nan
    else:
        raise ValueError(f"kind={kind!r}: allowed values are {INJECTIONS}")
    return state, batch


def check_injection(factory: Factory, case: Case, kind: str) -> list[Comparison]:
    state, batch = injected(case, kind)
    ref = reference_from(case.config, state)
    other = _loaded(factory, case.config, state)
    try:
        ref_out, other_out = run_step(ref, batch), run_step(other, batch)
    finally:
        close(other)
    return compare_step(case.config, state, ref_out, other_out)


def _poisoned(batch: Batch) -> Batch:
    r = batch.r.copy()
    r[1] = np.nan
    return dataclasses.replace(batch, r=r)


def _sequence_batches(config: DQNConfig) -> list[Batch]:
    rng = np.random.default_rng([CASE_SEED, 250])
    batches = [Batch.random(config, rng) for _ in range(SEQUENCE_STEPS)]
    return [_poisoned(b) if k + 1 in SEQUENCE_POISONED else b for k, b in enumerate(batches)]


def _bookkeeping(s: StepScalars) -> tuple:
    finite = tuple(bool(np.isfinite(getattr(s, f))) for f in StepScalars.FINITE_FIELDS)
    return s.step, s.fresh, s.read_at, finite


def readback_sequences(factory: Factory, config: DQNConfig, resync: bool) -> tuple[list, list]:
    """The ``(step, fresh, read_at, finiteness)`` sequences of the reference and ``factory``'s
    trainer over ``SEQUENCE_STEPS`` steps (then ``end_epoch``) from the same initial state.

    ``resync``: before every step both trainers load the reference trainer's current state
    (``load_state_dict`` also resets the readback bookkeeping, identically in both by the
    backend contract); otherwise both run free on the same batches."""
    ref = Trainer(config, seed=CASE_SEED)
    other = _loaded(factory, config, ref.state_dict())
    seq_ref, seq_other = [], []
    try:
        with np.errstate(all="ignore"):
            for batch in _sequence_batches(config):
                if resync:
                    state = ref.state_dict()
                    ref.load_state_dict({k: np.array(v, copy=True) for k, v in state.items()})
                    other.load_state_dict({k: np.array(v, copy=True) for k, v in state.items()})
                seq_ref.append(_bookkeeping(ref.step(_copy_batch(batch))))
                seq_other.append(_bookkeeping(other.step(_copy_batch(batch))))
            seq_ref.append(_bookkeeping(ref.end_epoch()))
            seq_other.append(_bookkeeping(other.end_epoch()))
    finally:
        close(other)
    return seq_ref, seq_other


def expected_sequence(config: DQNConfig, resync: bool) -> list[tuple[int, bool, int]]:
    """SPEC 9's rule, independently: fresh at multiples of ``readback_interval`` and on the step
    after a fresh non-finite read (``resync`` resets that carry, and ``read_at`` to 0)."""
    out, last_read, force = [], 0, False
    interval = config.readback_interval
    for k in range(1, SEQUENCE_STEPS + 1):
        if resync:
            last_read, force = 0, False
        fresh = k % interval == 0 or force
        if fresh:
            last_read = k
            force = k in SEQUENCE_POISONED
        out.append((k, fresh, last_read))
    out.append((SEQUENCE_STEPS, True, SEQUENCE_STEPS))
    return out


def check_readback_sequence(factory: Factory, config: DQNConfig, resync: bool) -> None:
    seq_ref, seq_other = readback_sequences(factory, config, resync)
    want = expected_sequence(config, resync)
    got_ref = [s[:3] for s in seq_ref]
    assert got_ref == want, ("reference readback sequence deviates from SPEC 9 at step "
                             f"{next(i + 1 for i, (a, b) in enumerate(zip(got_ref, want)) if a != b)}")
    diff = [i for i, (a, b) in enumerate(zip(seq_ref, seq_other)) if a != b]
    assert not diff and len(seq_ref) == len(seq_other), (
        f"readback sequences differ at {len(diff)} step(s); first at index {diff[0] if diff else '-'}: "
        f"reference {seq_ref[diff[0]] if diff else '-'} vs other {seq_other[diff[0]] if diff else '-'} "
        "(step, fresh, read_at, finiteness of the loss/norm fields)")


def check_checkpoint_interchange(factory: Factory, case: Case, tmp_path) -> list[Comparison]:
    """Reference checkpoint -> the other trainer (and back): bit-exact state after loading, and
    the next step matches under STEP_BOUNDS in both directions."""
    path = tmp_path / "reference.safetensors"
    reference_from(case.config, case.state).save(path)
    other = factory.load(path)
    try:
        return _interchange(factory, other, case, path, tmp_path)
    finally:
        close(other)


def _interchange(other_cls: Factory, other: TrainerBackend, case: Case, path, tmp_path) -> list[Comparison]:
    from foxhunt.reference.checkpoint import read_metadata

    problems = state_round_trip_problems(other, case.state)
    assert not problems, "reference checkpoint -> other trainer: " + "; ".join(problems)
    ref_loaded = Trainer.load(path)
    results = compare_step(case.config, case.state, run_step(ref_loaded, case.batch),
                           run_step(other, case.batch))

    back = tmp_path / "other.safetensors"
    other.save(back)
    assert read_metadata(back).get("backend") == other_cls.backend_name
    after = other.state_dict()
    ref_back = Trainer.load(back)
    problems = state_round_trip_problems(ref_back, after)
    assert not problems, "other trainer's checkpoint -> reference: " + "; ".join(problems)
    other_back = other_cls.load(back)  # its readback bookkeeping starts afresh, like ref_back's
    try:
        problems = state_round_trip_problems(other_back, after)
        assert not problems, "other trainer's checkpoint -> other trainer: " + "; ".join(problems)
        rng = np.random.default_rng([CASE_SEED, 7])
        batch = condition_batch(case.config, after, Batch.random(case.config, rng), rng)
        results += compare_step(case.config, after, run_step(ref_back, batch),
                                run_step(other_back, batch))
    finally:
        close(other_back)
    return results


# ============================================================================ legitimate and buggy variants
@contextlib.contextmanager
def _patches(*items: tuple[Any, str, Any]) -> Iterator[None]:
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in items]
    try:
        for obj, name, value in items:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def _tf32_truncate(x: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(x, F32).view(np.uint32)
    keep = np.where(np.isfinite(x), bits & np.uint32(0xFFFFE000), bits)
    return keep.astype(np.uint32).view(F32)


def legitimate_variant() -> contextlib.AbstractContextManager:
    """A correct re-implementation that rounds differently from the reference: GEMMs, bias
    gradients, norms and the spectral mat-vecs accumulated in float64 and rounded once, TF32
    operands truncated (as tensor cores may) instead of rounded to nearest."""
    ref_round_for, ref_matvec, ref_rmatvec = dense.round_for, spectral._matvec, spectral._rmatvec

    def round_for(x, mode):
        return _tf32_truncate(x) if mode == "tf32" else ref_round_for(x, mode)

    def gemm(a, b, *, trans_a=False, trans_b=False, mode="f32", rounded=False):
        op_a = np.ascontiguousarray(a.T if trans_a else a)
        op_b = np.ascontiguousarray(b.T if trans_b else b)
        if not rounded:
            op_a, op_b = round_for(op_a, mode), round_for(op_b, mode)
        with np.errstate(all="ignore"):
            return (op_a.astype(F64) @ op_b.astype(F64)).astype(F32)

    def bias_grad_reduce(dy):
        with np.errstate(all="ignore"):
            return np.sum(dy.astype(F64), axis=0).astype(F32)

    def grad_norm_sq(x):
        with np.errstate(all="ignore"):
            x64 = np.where(np.isfinite(x), x, 0).astype(F64)
            return F32(np.sum(x64 * x64))

    def matvec(w, x):
        with np.errstate(all="ignore"):
            return (w.astype(F64) @ x.astype(F64)).astype(F32)

    def rmatvec(w, y):
        with np.errstate(all="ignore"):
            return (w.astype(F64).T @ y.astype(F64)).astype(F32)

    del ref_matvec, ref_rmatvec
    return _patches((dense, "round_for", round_for), (dense, "gemm", gemm),
                    (dense, "bias_grad_reduce", bias_grad_reduce), (optim, "grad_norm_sq", grad_norm_sq),
                    (spectral, "_matvec", matvec), (spectral, "_rmatvec", rmatvec))


def _bug(name: str, config: DQNConfig) -> contextlib.AbstractContextManager:
    """A deliberately wrong step (what a fast-path bug would look like); see BUGS."""
    from foxhunt.reference import step as step_mod
    from foxhunt.reference import trainer as trainer_mod
    from foxhunt.reference.kernels import isv as isv_kernels

    layout = ParamLayout(config)
    if name == "cql_gradient_dropped":
        pipeline = trainer_mod.budget_pipeline
        return _patches((trainer_mod, "budget_pipeline",
                         lambda c, g51, gcql: pipeline(c, g51, np.zeros_like(gcql))))
    if name in ("sign_error_w_v2", "tail_block_zeroed_w_s1", "bf16_gradient_storage"):
        backward = step_mod.backward

        def wrong(*args, **kwargs):
            grad = backward(*args, **kwargs)
            if name == "sign_error_w_v2":
                t = layout["w_v2"]
                grad[t.offset:t.end] *= F32(-1)
            elif name == "tail_block_zeroed_w_s1":
                t = layout["w_s1"]
                grad[t.end - t.size % 64 - 64:t.end] = 0
            else:
                grad[:] = dense.bf16_to_f32(dense.f32_to_bf16(grad))
            return grad
        return _patches((step_mod, "backward", wrong))
    if name == "tf32_in_f32_mode":
        gemm = dense.gemm

        def tf32_gemm(a, b, *, trans_a=False, trans_b=False, mode="f32", rounded=False):
            if mode == "f32":
                a, b, mode, rounded = dense.tf32_round(a), dense.tf32_round(b), "tf32", True
            return gemm(a, b, trans_a=trans_a, trans_b=trans_b, mode=mode, rounded=rounded)
        return _patches((dense, "gemm", tf32_gemm))
    if name == "lr_times_1.5":
        adam = optim.adam_update
        return _patches((optim, "adam_update",
                         lambda *a, lr, **k: adam(*a, lr=F32(lr * F32(1.5)), **k)))
    if name == "polyak_tau_doubled":
        polyak = optim.polyak_update
        return _patches((optim, "polyak_update", lambda t, o, tau: polyak(t, o, F32(2 * tau))))
    if name == "spectral_norm_skipped":
        batched = spectral.batched_spectral_norm

        def skipped(ws, us, vs, sigma_max):
            res = batched(ws, us, vs, sigma_max)
            return res._replace(ws=[w.copy() for w in ws], us=[u.copy() for u in us],
                                vs=[v.copy() for v in vs])
        return _patches((spectral, "batched_spectral_norm", skipped))
    if name == "h2_rms_producer_skipped":
        return _patches((isv_kernels, "isv_h2_rms_update", lambda isv, h2, alpha: isv.copy()))
    raise ValueError(f"bug {name!r} is unknown; allowed: {BUGS}")


#: Deliberately wrong steps the bounds must reject, with the precisions they are visible in
#: (storing the gradient in BF16 is within bf16 mode's TF32-sized gradient bound).
BUGS: Mapping[str, tuple[str, ...]] = {
    "cql_gradient_dropped": PRECISIONS,
    "sign_error_w_v2": PRECISIONS,
    "tail_block_zeroed_w_s1": PRECISIONS,
    "bf16_gradient_storage": ("f32",),
    "tf32_in_f32_mode": ("f32",),
    "lr_times_1.5": PRECISIONS,
    "polyak_tau_doubled": PRECISIONS,
    "spectral_norm_skipped": PRECISIONS,
    "h2_rms_producer_skipped": PRECISIONS,
}


class VariantTrainer(Trainer):
    """The reference trainer stepping under a variant (a stand-in for a second implementation)."""

    variant: Callable[[DQNConfig], contextlib.AbstractContextManager] = \
        staticmethod(lambda config: legitimate_variant())

    def step(self, batch: Batch) -> StepScalars:
        with self.variant(self.config):
            return super().step(batch)


def variant_factory(variant: Callable[[DQNConfig], contextlib.AbstractContextManager]) -> Factory:
    return type("Variant", (VariantTrainer,), {"variant": staticmethod(variant)})


# ============================================================================ CPU self-checks
# The preset is the parameter ``case`` so that ``--conformance-mode quick`` leaves out "seed".
CASES = [pytest.param(p, q, s, id=f"{p}-{q}-{s}") for p in PRESETS for q in PRECISIONS for s in STARTS]


def test_every_state_buffer_has_a_bound() -> None:
    keys = Trainer(DQNConfig.preset("tiny")).state_dict()
    missing = []
    for key in keys:
        try:
            bound_row(key)
        except KeyError as exc:
            missing.append(str(exc))
    assert not missing, "\n".join(missing)
    assert all(row.criterion and row.reason for row in STEP_BOUNDS.values())
    with pytest.raises(KeyError, match="no row in STEP_BOUNDS"):
        bound_row("new_buffer")


@pytest.mark.parametrize("case, precision, start", CASES)
def test_reference_steps_bitwise_identically_from_a_state_dict(case, precision, start) -> None:
    shared = shared_case(case, precision, start)
    one = run_step(reference_from(shared.config, shared.state), shared.batch)
    two = run_step(reference_from(shared.config, shared.state), shared.batch)
    assert one.state.keys() == two.state.keys()
    differ = [k for k in one.state if not np.array_equal(_bits(one.state[k]), _bits(two.state[k]))]
    assert not differ, f"the reference is not deterministic from one state_dict: {differ}"
    assert np.array_equal(_bits(one.td), _bits(two.td))
    assert all(np.array_equal(_bits(a), _bits(b)) for a, b in zip(one.q, two.q))
    assert dataclasses.astuple(one.end) == dataclasses.astuple(two.end)
    assert not failures(compare_step(shared.config, shared.state, one, two))


@pytest.mark.parametrize("case, precision, start", CASES)
def test_state_dict_round_trips_bit_for_bit(case, precision, start) -> None:
    shared = shared_case(case, precision, start)
    assert not state_round_trip_problems(reference_from(shared.config, shared.state), shared.state)


@pytest.mark.parametrize("case, precision, start", CASES)
def test_conditioned_batch_keeps_every_discontinuity_at_a_distance(case, precision, start) -> None:
    shared = shared_case(case, precision, start)
    config, params = shared.config, shared.state["params"]
    h2_bound = _h2_bound(config, shared.state["isv"])
    assert not near_relu_switch(config, params, shared.batch.s, h2_bound).any()
    assert not near_argmax_tie(config, params, shared.batch.s2, h2_bound).any()
    # The margins are not vacuous: a bias that puts unit 0 of layer 1 on its switch is caught.
    probe = shared.batch.s[:1]
    t1 = deviation_forward(config, params, probe, h2_bound).pre_activations[0][1]
    moved = params.copy()
    bias = ParamLayout(config).view(moved, "b_s1")
    bias[0] = F32(bias[0] - t1[0, 0])
    assert near_relu_switch(config, moved, probe, h2_bound)[0]
    assert not near_relu_switch(config, params, probe, h2_bound)[0]


def test_bf16_flip_probability_grows_near_a_rounding_midpoint() -> None:
    x = np.array([1.0 + 2.0**-8, 1.0, 1.0 + 2.0**-8 + 2.0**-20], F32)  # midpoint, grid, near
    prob, jump = _bf16_flips(x, np.full(3, 2.0**-20))
    assert prob[0] == 1.0 and prob[1] < 1e-300 and 0.5 < prob[2] < 0.7
    assert np.all(jump == 2.0**-7)  # one BF16 ulp at 1.0
    assert _bf16_flips(x[:1], np.zeros(1))[0][0] == 1.0  # exactly on a midpoint: always at risk


@pytest.mark.parametrize("case, precision, start", CASES)
def test_bounds_accept_a_legitimate_reimplementation(case, precision, start, record_property) -> None:
    results, ref, other = one_step(variant_factory(lambda c: legitimate_variant()),
                                   shared_case(case, precision, start))
    _record(record_property, f"{case}-{precision}-{start} (float64/TF32-truncating variant)", results)
    _assert_all(results)
    # The variant must really differ from the reference, or this test proves nothing.
    assert not np.array_equal(ref.state["adam_m"], other.state["adam_m"]), \
        "the legitimate variant no longer changes the step (reference internals renamed?)"


@pytest.mark.parametrize(("bug", "precision"),
                         [(bug, p) for bug, modes in BUGS.items() for p in modes])
def test_bounds_reject_a_wrong_step(bug, precision) -> None:
    """Each deliberate bug is rejected in every precision mode BUGS lists for it (a bug that is
    within a mode's bounds by design, e.g. BF16 gradient storage in bf16 mode, is not listed)."""
    results, _, _ = one_step(variant_factory(lambda c: _bug(bug, c)), shared_case("tiny", precision, "warm"))
    assert failures(results), f"{bug}: every comparison passed; the bounds cannot see this bug"


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kind", INJECTIONS)
def test_injection_harness_on_the_reference(kind, precision) -> None:
    shared = shared_case("tiny", precision, "warm")
    _assert_all(check_injection(variant_factory(lambda c: legitimate_variant()), shared, kind))
    state, batch = injected(shared, kind)
    out = run_step(reference_from(shared.config, state), batch)
    if kind != "inf_r":  # +Inf rewards are clipped onto the support: no flag needs to fire
        assert out.state["flags"].any(), f"{kind}: the reference raised no sentinel flag"


@pytest.mark.parametrize("resync", [True, False], ids=["resync", "free"])
def test_readback_sequence_harness_on_the_reference(resync) -> None:
    check_readback_sequence(Trainer, DQNConfig.preset("tiny"), resync)


def test_checkpoint_interchange_harness_on_the_reference(tmp_path) -> None:
    _assert_all(check_checkpoint_interchange(Trainer, shared_case("tiny", "bf16", "warm"), tmp_path))


# ============================================================================ GPU: fast vs reference
@pytest.mark.gpu
@pytest.mark.parametrize("case, precision, start", CASES)
def test_fast_step_matches_reference(case, precision, start, cuda_device, record_property) -> None:
    results, _, _ = one_step(fast_factory(), shared_case(case, precision, start))
    _record(record_property, f"{case}-{precision}-{start}", results)
    _assert_all(results)


@pytest.mark.gpu
@pytest.mark.parametrize("case", PRESETS)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kind", INJECTIONS)
def test_fast_step_with_injected_non_finite_values(kind, precision, case, cuda_device,
                                                   record_property) -> None:
    results = check_injection(fast_factory(), shared_case(case, precision, "warm"), kind)
    _record(record_property, f"{case}-{precision}-{kind}", results)
    _assert_all(results)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("resync", [True, False], ids=["resync", "free"])
def test_fast_readback_sequence_matches_reference(resync, precision, cuda_device, record_property) -> None:
    record_property("kernel", "trainer.step")
    record_property("case", f"tiny-{precision}-{'resync' if resync else 'free'}")
    check_readback_sequence(fast_factory(), DQNConfig.preset("tiny", precision=precision), resync)


@pytest.mark.gpu
@pytest.mark.parametrize("case", PRESETS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_fast_checkpoint_interchange(precision, case, cuda_device, tmp_path, record_property) -> None:
    results = check_checkpoint_interchange(fast_factory(), shared_case(case, precision, "warm"), tmp_path)
    _record(record_property, f"{case}-{precision}-checkpoint", results)
    _assert_all(results)
