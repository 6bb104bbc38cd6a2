"""The comparison of one step (:func:`compare_step`): what each trainer produced
(:class:`StepOutcome`, :func:`run_step`) and every criterion of :data:`.step_bounds.STEP_BOUNDS`
applied to it, as :class:`~foxhunt.conformance.tolerance.Comparison` records that never raise.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from foxhunt.conformance.step_bounds import (
    ADAM_ROUNDINGS,
    COUNTER_FIELDS,
    ENS_NORM_FIELDS,
    EXACT,
    EXACT_SCALAR_FIELDS,
    F32,
    F64,
    ISV_STEP_PRODUCERS,
    Q_DRIFT_KIND,
    LOSS_FIELDS,
    NORM_FIELDS_OTHER,
    POLYAK_TOL,
    Q_FIELDS,
    Q_SQUARED_FIELDS,
    SPECTRAL_TOL,
    U,
    UNIT_FIELDS,
    bound_row,
    fwd_eps,
    grad_eps,
)
from foxhunt.conformance.tolerance import REDUCTION_RTOL, Comparison, Tolerance, compare
from foxhunt.reference import isv as isv_mod
from foxhunt.reference.backend import StepScalars, TrainerBackend
from foxhunt.reference.batch import Batch
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.isv_step import step_tau
from foxhunt.reference.kernels import optim, safety, spectral
from foxhunt.reference.kernels.isv_producers import Q_DRIFT_FLOOR, Q_EMA_SLOTS
from foxhunt.reference.layout import ParamLayout
from foxhunt.reference.step import step_supports


# ------------------------------------------------------------------------------ custom bounds
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


def bits(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x)
    return x.view(f"u{x.dtype.itemsize}") if x.dtype.kind == "f" else x


# ------------------------------------------------------------------------------ outcomes
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
        scalars = trainer.step(copy_batch(batch))
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


def copy_batch(batch: Batch) -> Batch:
    return Batch(**{f.name: None if getattr(batch, f.name) is None
                    else np.array(getattr(batch, f.name), copy=True)
                    for f in dataclasses.fields(Batch)})


# ------------------------------------------------------------------------------ the comparison
class _Context:
    """Derived facts of one comparison: layout, constants, and the reference's gradient."""

    def __init__(self, config: DQNConfig, before: Mapping[str, np.ndarray]):
        self.config = config
        self.layout = ParamLayout(config)
        self.before = before
        self.eps_g = grad_eps(config)
        self.eps_f = fwd_eps(config)
        self.b1, self.b2 = F32(config.beta1), F32(config.beta2)
        self.lr = F32(config.lr)
        self.tau = step_tau(config, before["isv"])  # the adaptive tau's slot, or the config's
        self.t = int(before["adam_t"][0]) + 1
        self.padding = self.layout.padding_mask()
        self.z = step_supports(config, before["isv"]).z  # per branch (adaptive_atoms)
        self.log_na = math.log(config.num_atoms)
        self.log_classes = math.log(max(config.num_atoms, config.n_regimes))
        self.zmax = float(np.max(np.abs(self.z)))

    def tensors(self):
        return [(t, slice(t.offset, t.end)) for t in self.layout.tensors]

    def weight_clamp(self) -> F32:
        q_abs_ref = self.before["isv"][isv_mod.Q_ABS_REF_INDEX]
        return F32(safety.isv_bound(F32(self.config.weight_clamp_mult), q_abs_ref))


def _unchanged(after: np.ndarray, before: np.ndarray) -> np.ndarray:
    return bits(after) == bits(before)


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
                 for name, (rate, kind) in ISV_STEP_PRODUCERS.items()
                 if rate(cx.config) is not None}
    bound = np.zeros(ref.shape, F64)
    def signal_of(index: int, alpha: float) -> float:  # the EMA's input: (x - (1-a) x0) / a
        return abs(F64(ref[index]) - (1 - alpha) * F64(before[index])) / alpha

    for index, (alpha, kind) in producers.items():
        signal = signal_of(index, alpha)
        if isinstance(kind, tuple):  # ("velocity", slot): bounded by the differenced signal
            base = isv_mod.slot(kind[1]).index
            eps, scale = cx.eps_f, signal + signal_of(base, producers[base][0])
        elif kind == Q_DRIFT_KIND:  # the Q mean's error over the drift's divisor (step_bounds)
            drift = isv_mod.slot("Q_DRIFT").index
            q_ema = np.mean(F64(before[list(Q_EMA_SLOTS)]))
            divisor = max(abs(q_ema), Q_DRIFT_FLOOR)
            q_mean = signal_of(drift, producers[drift][0]) * divisor + abs(q_ema)
            eps, scale = cx.eps_f, signal + (q_mean + cx.zmax) / divisor
        else:
            eps = {"forward": cx.eps_f, "gradient": cx.eps_g, "q": cx.eps_f, "data": 0.0}[kind]
            scale = signal + cx.zmax if kind == "q" else signal
        bound[index] = REDUCTION_RTOL * abs(F64(ref[index])) + alpha * eps * scale
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
    # The ensemble's diversity gradient (p_k - p_0) / (B (K-1)) subtracts nearly equal
    # probabilities when the heads agree: f32 rounding of p (u relative to p) becomes
    # u / sqrt(2 KL) relative to the difference, KL = -ens_loss (the mean KL per row and prior
    # head; ||p_k - p_0|| ~ sqrt(2 KL / NA), ||p|| ~ 1 / sqrt(NA)). STEP_BOUNDS scalars.ens_norms.
    kl = max(-F64(ref.ens_loss), U) if math.isfinite(F64(ref.ens_loss)) else U
    ens_amp = 8 * U / math.sqrt(2 * kl)
    for fields, rule in ((ENS_NORM_FIELDS, lambda x: (cx.eps_g + 4 * U + ens_amp) * abs(x)),
                         (NORM_FIELDS_OTHER, lambda x: cx.eps_g * abs(x) + 4 * U * abs(x)),
                         (LOSS_FIELDS, lambda x: cx.eps_f * (abs(x) + cx.log_classes)),
                         (Q_FIELDS, lambda x: cx.eps_f * (abs(x) + cx.zmax)),
                         (Q_SQUARED_FIELDS, lambda x: cx.eps_f * (abs(x) + cx.zmax ** 2)),
                         (UNIT_FIELDS, lambda x: cx.eps_f * (abs(x) + 1)),
                         (EXACT_SCALAR_FIELDS, lambda x: 0.0),
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
