"""ISV producer kernels of issue 19 (SPEC 7; seed ``002``): the raw signal vector, the Q
statistics, the per-branch Q quantiles, the adaptive support (Mech 2-bounded), the per-branch
gamma schedule, the CQL-alpha ramp and the adaptive exploration epsilon / Polyak tau.

Every ``*_update`` / ``*_ramp`` kernel takes the whole ISV vector ``isv`` (float32 ``[ISV_LEN]``)
and returns its new value; only the slots it produces change (every other element, the
fingerprint bits included, is copied bit-exactly); the input is never mutated.
``isv_signal_build`` returns the ``signals [13]`` vector that ``isv_signal_update`` blends.

Conventions shared by all kernels (their CUDA twins in ``cuda_src/isv_producers.cu`` round
identically, so fast and reference agree bit for bit):

* EMAs use ``kernels.isv._ema`` (guarded: a non-finite sample keeps the slot, a non-finite
  slot takes the sample) at the adaptive rate ``alpha = alpha_base (1 + 0.5 |clamp(sharpe,
  -2, 2)|)`` with ``sharpe = ISV[SHARPE_EMA]`` (slot 22; NaN counts as 0).
* Batch means skip non-finite elements: ``mean = lane_sum(finite x) / count(finite x)`` where
  ``lane_sum`` is the kernel's fixed order (``LANES`` strided partial sums, each added in
  element order, then the partials added in lane order), NaN when no element is finite.
* Products and sums are rounded one at a time (no FMA); ``fmax``/``fmin`` are CUDA's
  ``fmaxf``/``fminf`` (``np.fmax``/``np.fmin``: the non-NaN operand wins), used only where a
  NaN operand is meant to be ignored, as each docstring says.

Branch mapping (``isv.PER_BRANCH_ORDER``): SPEC branch d writes the seed's per-branch member
``PER_BRANCH_ORDER[d]`` (exposure -> DIR, order -> ORD, urgency -> URG).
"""

from __future__ import annotations

import math

import numpy as np

from foxhunt.reference import isv as reg
from foxhunt.reference.kernels.isv import _check_isv, _ema

F32 = np.float32

#: Lanes of the fixed-order batch means (the CUDA twins run one warp of this many threads).
LANES = 32
#: ``Q_DRIFT = (q_mean - q_ema) / fmax(|q_ema|, Q_DRIFT_FLOOR)`` (the seed's 0.1).
Q_DRIFT_FLOOR = 0.1
#: An atom is *used* when its batch-mean probability is at least this fraction of uniform
#: (``ATOM_UTIL_FRACTION / NA``). The seed names the signal only; 0.1 is foxhunt's choice.
ATOM_UTIL_FRACTION = 0.1
#: The percentiles of ``q_quantile_update`` (the seed's 5th / 95th), in whole percent.
QUANTILE_LO_PCT = 5
QUANTILE_HI_PCT = 95
#: ``tau_eff = tau * (TAU_HEALTH_FLOOR + (1 - TAU_HEALTH_FLOOR) * health)``.
TAU_HEALTH_FLOOR = 0.5

#: Signals of ``isv_signal_build`` (``isv.SIGNAL_NAMES`` order).
_SIG = {name: i for i, name in enumerate(reg.SIGNAL_NAMES)}
#: The exposure branch's Q-mean EMAs whose mean is the Q EMA of ``Q_DRIFT``.
Q_EMA_SLOTS = reg.Q_DIR_ACTION_SLOTS


# --------------------------------------------------------------------------- checks
def _f32(name: str, x, ndim: int) -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.dtype != F32 or x.ndim != ndim:
        raise ValueError(f"{name}: got {type(x).__name__} {getattr(x, 'dtype', '?')} "
                         f"{getattr(x, 'shape', '?')}; need a float32 array with {ndim} dims")
    if x.size == 0:
        raise ValueError(f"{name}: shape {x.shape}; need at least one element")
    return x


def _real(name: str, value, lo: float = -math.inf, hi: float = math.inf,
          finite: bool = True) -> F32:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ValueError(f"{name}={value!r}: need a real scalar")
    v = float(value)
    if finite and (not math.isfinite(v) or not lo <= v <= hi):
        raise ValueError(f"{name}={value!r}: must be finite and in [{lo}, {hi}]")
    with np.errstate(over="ignore"):
        return F32(v)


def _alpha(isv: np.ndarray, alpha_base) -> F32:
    ab = _real("alpha_base", alpha_base, 0.0, reg.ALPHA_BASE_MAX)
    return reg.adaptive_ema_rate(isv[reg.SHARPE_EMA_INDEX], ab)


# --------------------------------------------------------------------------- fixed-order sums
def lane_sum(x: np.ndarray) -> F32:
    """Float32 sum of ``x`` (1-D, finite) in the kernels' order: lane ``t`` adds elements
    ``t, t + LANES, ...`` in turn, then the ``LANES`` partials are added in lane order."""
    x = np.asarray(x, F32).ravel()
    rows = np.zeros(((x.size + LANES - 1) // LANES) * LANES, F32)
    rows[:x.size] = x
    acc = np.zeros(LANES, F32)
    with np.errstate(over="ignore", invalid="ignore"):
        for row in rows.reshape(-1, LANES):
            acc = (acc + row).astype(F32)
        total = F32(0.0)
        for v in acc:
            total = F32(total + v)
    return total


def finite_mean(x: np.ndarray) -> F32:
    """``lane_sum`` of the finite elements of ``x`` (flat order) over their count; NaN if none
    is finite (an overflowing sum gives +/-Inf)."""
    x = np.asarray(x, F32).ravel()
    ok = np.isfinite(x)
    count = int(ok.sum())
    if count == 0:
        return F32(np.nan)
    with np.errstate(over="ignore", invalid="ignore"):
        return F32(lane_sum(np.where(ok, x, F32(0.0))) / F32(count))


def distribution_variance(p: np.ndarray, z: np.ndarray) -> np.ndarray:
    """Per-sample ``Var_p[z] = sum_j (p_j z_j) z_j - (sum_j p_j z_j)^2``, the atom sums in atom
    order; ``fmax(v, 0)`` for a finite ``v``, NaN otherwise. ``p [nb, B, NA]``, ``z [nb, NA]``."""
    mean = np.zeros(p.shape[:2], F32)
    ez2 = np.zeros(p.shape[:2], F32)
    with np.errstate(over="ignore", invalid="ignore"):
        for j in range(p.shape[2]):
            pz = (p[:, :, j] * z[:, None, j]).astype(F32)
            mean = (mean + pz).astype(F32)
            ez2 = (ez2 + (pz * z[:, None, j]).astype(F32)).astype(F32)
        v = (ez2 - (mean * mean).astype(F32)).astype(F32)
    return np.where(np.isfinite(v), np.fmax(v, F32(0.0)), F32(np.nan)).astype(F32)


# --------------------------------------------------------------------------- isv_signal_build
def isv_signal_build(isv: np.ndarray, q_taken: np.ndarray, td: np.ndarray, r: np.ndarray,
                     p_next: np.ndarray, z: np.ndarray, grad_norm: float,
                     loss: float) -> np.ndarray:
    """The raw ``signals [13]`` of this step for ``isv_signal_update`` (slots 0-12), read from
    the step's own buffers; ``isv`` is read only.

    Shapes: ``q_taken [nb, B]`` (Q of the taken action per branch; row 0 is exposure),
    ``td [B]``, ``r [B]``, ``p_next [nb, B, NA]`` (the target distribution at the double-DQN
    action), ``z [nb, NA]`` (each branch's support), ``grad_norm`` and ``loss`` (the step's
    gradient norm entering Adam and total loss; pointers to device scalars in CUDA).

    * 0 ``Q_DRIFT = (q_mean - q_ema) / fmax(|q_ema|, 0.1)``: ``q_mean`` = finite mean of
      ``q_taken[0]``; ``q_ema`` = mean of the exposure Q-mean EMAs ``ISV[17], ISV[20],
      ISV[19]`` (short, flat, long; added in that order, then / 3).
    * 1 ``grad_norm``; 7 ``loss`` (as given: non-finite passes through, the EMA ignores it).
    * 2 finite mean of ``td``; 5 finite mean of ``r``.
    * 3 finite mean over the ``nb * B`` samples (flat order) of ``distribution_variance``.
    * 4 ``signals[3] - ISV[3]``: the variance's velocity against its EMA before this step.
    * 6 atom utilisation: the share of the ``nb * NA`` (branch, atom) pairs whose finite mean
      over the batch (added in batch order; no finite value: unused) is ``>= 0.1 / NA``.
    * 8-11 0 (reserved: the seed's ADX / CUSUM regime signals; our states carry neither).
    * 12 health ``= util / (1 + |Q_DRIFT|)`` in ``[0, 1]`` (the seed gives the range only: a
      collapsed distribution or a drifting Q lowers it); NaN drift gives NaN (slot kept).

    A mean with no finite element is NaN, and so is everything computed from it: the EMA of
    ``isv_signal_update`` then keeps that slot.
    """
    _check_isv(isv)
    q_taken, td, r = _f32("q_taken", q_taken, 2), _f32("td", td, 1), _f32("r", r, 1)
    p_next, z = _f32("p_next", p_next, 3), _f32("z", z, 2)
    nb, B = q_taken.shape
    if td.shape != (B,) or r.shape != (B,):
        raise ValueError(f"td {td.shape}, r {r.shape}: need ({B},) like q_taken's batch")
    if p_next.shape[:2] != (nb, B) or z.shape != (nb, p_next.shape[2]):
        raise ValueError(f"p_next {p_next.shape}, z {z.shape}: need [{nb}, {B}, NA] and "
                         f"[{nb}, NA] for q_taken {q_taken.shape}")
    gn, ls = _real("grad_norm", grad_norm, finite=False), _real("loss", loss, finite=False)
    na = p_next.shape[2]
    out = np.zeros(reg.NUM_SIGNALS, F32)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        q_ema = F32(0.0)
        for s in Q_EMA_SLOTS:
            q_ema = F32(q_ema + isv[s])
        q_ema = F32(q_ema / F32(len(Q_EMA_SLOTS)))
        drift = F32((finite_mean(q_taken[0]) - q_ema) / np.fmax(abs(q_ema), F32(Q_DRIFT_FLOOR)))
        var = finite_mean(distribution_variance(p_next, z))
        acc = np.zeros((nb, na), F32)
        count = np.zeros((nb, na), np.int64)
        for b in range(B):
            row = p_next[:, b, :]
            ok = np.isfinite(row)
            acc = np.where(ok, (acc + row).astype(F32), acc)
            count += ok
        atom_mean = (acc / np.maximum(count, 1).astype(F32)).astype(F32)
        threshold = F32(F32(ATOM_UTIL_FRACTION) / F32(na))
        used = int(np.sum((count > 0) & (atom_mean >= threshold)))
        util = F32(F32(used) / F32(nb * na))
        out[_SIG["Q_DRIFT"]] = drift
        out[_SIG["GRAD_NORM_EMA"]] = gn
        out[_SIG["TD_ERR_EMA"]] = finite_mean(td)
        out[_SIG["ENS_VAR_EMA"]] = var
        out[_SIG["ENS_VAR_VEL"]] = F32(var - isv[_SIG["ENS_VAR_EMA"]])
        out[_SIG["REWARD_EMA"]] = finite_mean(r)
        out[_SIG["ATOM_UTIL_EMA"]] = util
        out[_SIG["LOSS_EMA"]] = ls
        out[_SIG["LEARNING_HEALTH"]] = F32(util / F32(F32(1.0) + abs(drift)))
    return out


# --------------------------------------------------------------------------- Q statistics
def q_stats_update(isv: np.ndarray, q: np.ndarray, alpha_base: float) -> np.ndarray:
    """EMAs of the exposure branch's Q statistics (the seed's direction family, slots 17-21).

    ``q [B, 3]``: Q(s) of the exposure branch's actions (0 short, 1 flat, 2 long). For action
    a, ``ISV[Q_DIR_ACTION_SLOTS[a]]`` (17 short, 20 flat, 19 long) = EMA of the finite mean of
    ``q[:, a]``; ``ISV[21]`` (Q_DIR_ABS_REF) = EMA of the finite mean of ``|q|`` (flat order).
    Adaptive rate from ``ISV[22]``. 18 (Hold) and the magnitude family 13-15 are reserved; 16
    (Q_ABS_REF) stays with ``isv_q_abs_ref_update``. A column with no finite value keeps its slot.
    """
    _check_isv(isv)
    q = _f32("q", q, 2)
    if q.shape[1] != len(reg.Q_DIR_ACTION_SLOTS):
        raise ValueError(f"q: shape {q.shape}; need [B, {len(reg.Q_DIR_ACTION_SLOTS)}] (the "
                         "exposure branch's short, flat, long)")
    alpha = _alpha(isv, alpha_base)
    out = isv.copy()
    for a, s in enumerate(reg.Q_DIR_ACTION_SLOTS):
        out[s] = _ema(isv[s:s + 1], np.array([finite_mean(q[:, a])], F32), alpha)[0]
    with np.errstate(over="ignore"):
        mean_abs = finite_mean(np.abs(q))
    s = reg.Q_DIR_ABS_REF_INDEX
    out[s] = _ema(isv[s:s + 1], np.array([mean_abs], F32), alpha)[0]
    return out


def _branch(branch) -> int:
    if isinstance(branch, bool) or not isinstance(branch, (int, np.integer)) \
            or not 0 <= int(branch) < reg.MAX_ISV_BRANCHES:
        raise ValueError(f"branch={branch!r}: must be an integer in [0, {reg.MAX_ISV_BRANCHES})")
    return int(branch)


def _member(branch: int) -> int:
    """The seed-order offset (DIR 0, MAG 1, ORD 2, URG 3) of SPEC branch ``branch``."""
    return reg.branch_slot("Q_P05", branch).index - reg.Q_P05_INDICES[0]


def percentile_rank(count: int, pct: int) -> int:
    """0-based rank of the ``pct``-th percentile among ``count`` sorted values (lower nearest
    rank, integer arithmetic): ``(pct * (count - 1)) // 100``."""
    return (pct * (count - 1)) // 100


def q_quantile_update(isv: np.ndarray, q: np.ndarray, branch: int,
                      alpha_base: float) -> np.ndarray:
    """EMAs of SPEC branch ``branch``'s 5th / 95th Q percentiles (slots 50-53 / 54-57).

    ``q [B, n]``: Q(s) of the branch's actions. Over the ``c`` finite values (``-0`` counted as
    ``+0``), the exact order statistics of rank ``percentile_rank(c, 5)`` and
    ``percentile_rank(c, 95)`` (0-based, ascending; a selection, no sort order dependence) are
    blended into ``Q_P05`` / ``Q_P95`` of the branch's member at the adaptive rate. No finite
    value: both slots unchanged. Cold start (and fold reset): the configured ``v_min`` /
    ``v_max`` (``isv.config_cold_starts``).
    """
    _check_isv(isv)
    q = _f32("q", q, 2)
    b = _branch(branch)
    alpha = _alpha(isv, alpha_base)
    vals = q[np.isfinite(q)]
    out = isv.copy()
    if vals.size == 0:
        return out
    vals = np.sort((vals + F32(0.0)).astype(F32))
    m = _member(b)
    for pct, index in ((QUANTILE_LO_PCT, reg.Q_P05_INDICES[m]),
                       (QUANTILE_HI_PCT, reg.Q_P95_INDICES[m])):
        x = vals[percentile_rank(vals.size, pct)]
        out[index] = _ema(isv[index:index + 1], np.array([x], F32), alpha)[0]
    return out


# --------------------------------------------------------------------------- adaptive support
def adaptive_support_update(isv: np.ndarray, atom_growth_mult: float, headroom: float,
                            half_floor: float) -> np.ndarray:
    """Centre and half-width of each seed member's support (slots 23-26 / 27-30) from its Q
    percentile EMAs (50-57), bounded by Mech 2.

    Per member m (DIR, MAG, ORD, URG): ``lo = ISV[50+m]``, ``hi = ISV[54+m]``;
    ``c = 0.5 (lo + hi)``, ``h = fmax(headroom * (0.5 |hi - lo|), half_floor)``;
    Mech 2: ``bound = atom_growth_mult * fmax(ISV[Q_ABS_REF], 1)`` (the floor on the signal;
    a NaN signal counts as 1); ``h' = fmin(h, bound)``, ``room = bound - h'``,
    ``c' = fmin(fmax(c, -room), room)``, so every atom ``c' + h' t`` (``|t| <= 1``) has
    ``|z| <= bound``. A non-finite ``lo`` or ``hi``: the member's two slots are unchanged.
    Written directly (the percentiles are already EMAs).
    """
    _check_isv(isv)
    k2 = _real("atom_growth_mult", atom_growth_mult, 0.0, math.inf)
    hr = _real("headroom", headroom, 0.0, math.inf)
    hf = _real("half_floor", half_floor, 0.0, math.inf)
    out = isv.copy()
    with np.errstate(over="ignore", invalid="ignore"):
        bound = F32(k2 * np.fmax(isv[reg.Q_ABS_REF_INDEX], F32(1.0)))
        for m in range(reg.MAX_ISV_BRANCHES):
            lo, hi = isv[reg.Q_P05_INDICES[m]], isv[reg.Q_P95_INDICES[m]]
            if not (np.isfinite(lo) and np.isfinite(hi)):
                continue
            centre = F32(F32(0.5) * F32(lo + hi))
            half = np.fmax(F32(hr * F32(F32(0.5) * abs(F32(hi - lo)))), hf)
            half = np.fmin(half, bound)
            room = F32(bound - half)
            out[reg.V_CENTER_INDICES[m]] = np.fmin(np.fmax(centre, -room), room)
            out[reg.V_HALF_INDICES[m]] = half
    return out


# --------------------------------------------------------------------------- schedules
def _progress(epoch: F32, horizon: F32) -> F32:
    """``fmin(fmax(epoch / horizon, 0), 1)``: a NaN ratio counts as 0 (``fmaxf``)."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return np.fmin(np.fmax(F32(epoch / horizon), F32(0.0)), F32(1.0))


def _check_vec4(name: str, x) -> np.ndarray:
    x = _f32(name, x, 1)
    if x.shape != (reg.MAX_ISV_BRANCHES,) or not np.all(np.isfinite(x)) \
            or not np.all((x > 0) & (x <= 1)):
        raise ValueError(f"{name}={x!r}: need float32 [{reg.MAX_ISV_BRANCHES}] in (0, 1] "
                         "(seed order DIR, MAG, ORD, URG)")
    return x


def per_branch_gamma_update(isv: np.ndarray, gamma_base: np.ndarray,
                            gamma_max: np.ndarray) -> np.ndarray:
    """The per-branch discounts (slots 43-46, seed order DIR, MAG, ORD, URG) on a linear
    epoch schedule from ``gamma_base`` to ``gamma_max`` (seed defaults
    ``isv.GAMMA_SCHEDULE_BASE`` / ``GAMMA_SCHEDULE_MAX``).

    ``p = fmin(fmax(ISV[EPOCH_IDX] / fmax(ISV[TOTAL_EPOCHS] - 1, 1), 0), 1)`` (NaN counts as
    0), ``gamma_k = base_k + (max_k - base_k) * p``. Written directly.
    """
    _check_isv(isv)
    base, top = _check_vec4("gamma_base", gamma_base), _check_vec4("gamma_max", gamma_max)
    with np.errstate(invalid="ignore"):
        denom = np.fmax(F32(isv[reg.TOTAL_EPOCHS_INDEX] - F32(1.0)), F32(1.0))
    p = _progress(isv[reg.EPOCH_IDX_INDEX], denom)
    out = isv.copy()
    for k, s in enumerate(reg.GAMMA_SEED_INDICES):
        out[s] = F32(base[k] + F32(F32(top[k] - base[k]) * p))
    return out


def cql_alpha_ramp(isv: np.ndarray, cql_alpha: float, alpha_base: float) -> np.ndarray:
    """EMA of ``ISV[CQL_ALPHA]`` (48) toward ``cql_alpha * (1 - f)``, ``f = fmin(fmax(
    ISV[EPSILON_EFF], 0), 1)``, at the adaptive rate.

    The seed ramps toward ``cql_alpha * max(0, 1 - seed_frac)`` (no pessimism while the data is
    scripted seed-phase exploration); foxhunt has no scripted phase, and the share of
    exploratory actions (the effective epsilon, slot 41) takes its place. A non-finite epsilon
    keeps the slot. Cold start and fold reset: ``config.cql_alpha``.
    """
    _check_isv(isv)
    ca = _real("cql_alpha", cql_alpha, 0.0, math.inf)
    alpha = _alpha(isv, alpha_base)
    eps = isv[reg.EPSILON_EFF_INDEX]
    target = F32(np.nan)
    if np.isfinite(eps):
        f = np.fmin(np.fmax(eps, F32(0.0)), F32(1.0))
        target = F32(ca * F32(F32(1.0) - f))
    s = reg.CQL_ALPHA_INDEX
    out = isv.copy()
    out[s] = _ema(isv[s:s + 1], np.array([target], F32), alpha)[0]
    return out


def check_eps_schedule(schedule) -> np.ndarray:
    """``schedule``: float32 ``[2]``, the loop's epsilon of this epoch and its cap, both finite
    in ``[0, 1]`` (``LoopSettings``' linear decay and ``max(eps_start, eps_end)``)."""
    x = _f32("schedule", schedule, 1)
    if x.shape != (2,) or not np.all(np.isfinite(x)) or not np.all((x >= 0) & (x <= 1)):
        raise ValueError(f"schedule={x!r}: need float32 [2] (epsilon, cap), finite, in [0, 1]")
    return x


def epsilon_tau_update(isv: np.ndarray, schedule: np.ndarray, tau: float) -> np.ndarray:
    """Adaptive exploration epsilon (slot 41) and Polyak tau (slot 42), written directly.

    ``schedule = (sched, cap)``: the loop's epsilon of this epoch (``LoopSettings``' linear
    decay over the run's epochs) and its cap ``max(eps_start, eps_end)``, in device memory (the
    trainer's ``eps_schedule``, written by ``set_loop_signals``). ``h = fmin(fmax(
    ISV[LEARNING_HEALTH], 0), 1)`` (a non-finite health counts as 1, no evidence); ``eps =
    fmin(sched * (2 - h), cap)`` (a poor learning health explores up to twice the schedule;
    the schedule is the floor); ``tau_eff = tau * (0.5 + 0.5 h)`` (a poor health slows the
    target net, ``TAU_HEALTH_FLOOR``).
    """
    _check_isv(isv)
    sched, cap = check_eps_schedule(schedule)
    tu = _real("tau", tau, 0.0, 1.0)
    h = isv[_SIG["LEARNING_HEALTH"]]
    h = np.fmin(np.fmax(h, F32(0.0)), F32(1.0)) if np.isfinite(h) else F32(1.0)
    floor = F32(TAU_HEALTH_FLOOR)
    out = isv.copy()
    out[reg.EPSILON_EFF_INDEX] = np.fmin(F32(sched * F32(F32(2.0) - h)), cap)
    out[reg.TAU_EFF_INDEX] = F32(tu * F32(floor + F32(F32(F32(1.0) - floor) * h)))
    return out


KERNELS = {
    "isv_signal_build": isv_signal_build,
    "q_stats_update": q_stats_update,
    "q_quantile_update": q_quantile_update,
    "adaptive_support_update": adaptive_support_update,
    "per_branch_gamma_update": per_branch_gamma_update,
    "cql_alpha_ramp": cql_alpha_ramp,
    "epsilon_tau_update": epsilon_tau_update,
}

__all__ = [
    "ATOM_UTIL_FRACTION", "KERNELS", "check_eps_schedule", "LANES", "QUANTILE_HI_PCT", "QUANTILE_LO_PCT",
    "Q_DRIFT_FLOOR", "Q_EMA_SLOTS", "TAU_HEALTH_FLOOR", "adaptive_support_update",
    "cql_alpha_ramp", "distribution_variance", "epsilon_tau_update", "finite_mean",
    "isv_signal_build", "lane_sum", "percentile_rank", "per_branch_gamma_update",
    "q_quantile_update", "q_stats_update",
]
