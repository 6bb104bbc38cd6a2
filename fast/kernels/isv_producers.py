"""Fast-path launchers of the issue-19 ISV producers (``cuda_src/isv_producers.cu``), twins of
``foxhunt.reference.kernels.isv_producers`` under the same names and signatures.

Slot indices, percentiles and constants are passed to the kernels from the registry
(``foxhunt.reference.isv``) and the reference module, so each is defined once. Every kernel
rounds exactly as its reference (one fixed reduction order, no FMA): bitwise equal.

In the step (the wiring part), ``grad_norm`` and ``loss`` of ``isv_signal_build`` are device
pointers into the readback block, ``q`` of ``q_stats_update`` / ``q_quantile_update`` the
first ``B`` rows of a branch's ``q_o`` block, and the int / gamma arrays constant buffers.
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.kernels._runtime import In, InOut, Out, call, device_scalar
from foxhunt.reference import isv as reg
from foxhunt.reference.kernels import isv_producers as ref
from foxhunt.reference.kernels.isv import _check_isv

F32 = np.float32
I32 = np.int32

#: Threads of ``q_quantile_update`` (the CUDA ISVP_SELECT_THREADS cap; a multiple of 32).
SELECT_THREADS = 1024
#: The most dynamic shared memory a launch gets without opting in (bytes).
SHARED_DEFAULT = 48 * 1024


def plan_q_quantile_update(count: int) -> tuple[int, int, int]:
    """``(grid, block, shared bytes)`` of ``q_quantile_update`` on ``count`` values: one block of
    ``min(SELECT_THREADS, P)`` threads, ``P`` the power of two ``>= max(count, 32)``, and ``P``
    floats of shared memory where they fit ``SHARED_DEFAULT`` (the kernel then sorts them;
    else it counts ranks: the same values, slower)."""
    padded = 32
    while padded < count:
        padded *= 2
    shared = padded * 4 if padded * 4 <= SHARED_DEFAULT else 0
    return 1, min(SELECT_THREADS, padded), shared


def plan_isv_signal_build(nb: int, B: int, na: int) -> tuple[int, int, int]:
    """``(grid, block, shared bytes)`` of ``isv_signal_build``: one block with a thread per
    sample (``nb * B``, for the per-sample variances) and per (branch, atom) pair (``nb * na``,
    for the utilisation), rounded up to whole warps, at least the 3 warps of the batch means,
    at most ``SELECT_THREADS`` (more samples or pairs: each thread takes several, same bits)."""
    need = max(int(nb) * int(B), int(nb) * int(na), 3 * ref.LANES)
    return 1, min(SELECT_THREADS, -(-need // ref.LANES) * ref.LANES), 0

_SIG = {name: i for i, name in enumerate(reg.SIGNAL_NAMES)}


def _rate_args(alpha_base) -> tuple:
    ab = ref._real("alpha_base", alpha_base, 0.0, reg.ALPHA_BASE_MAX)
    return I32(reg.SHARPE_EMA_INDEX), ab, F32(reg.SHARPE_CLAMP), F32(reg.SHARPE_GAIN)


def isv_signal_build(isv: np.ndarray, q_taken: np.ndarray, td: np.ndarray, r: np.ndarray,
                     p_next: np.ndarray, z: np.ndarray, grad_norm: float,
                     loss: float) -> np.ndarray:
    """Test entry of the CUDA ``isv_signal_build`` (``plan_isv_signal_build``'s block);
    contract as the reference."""
    return signal_build_block(None, isv, q_taken, td, r, p_next, z, grad_norm, loss)


def signal_build_block(threads: int | None, isv, q_taken, td, r, p_next, z, grad_norm,
                       loss) -> np.ndarray:
    """``isv_signal_build`` on a block of ``threads`` (``None``: the plan's): any multiple of 32
    up to ``SELECT_THREADS`` gives the same bits (tests/test_quantile_paths.py)."""
    _check_isv(isv)
    q_taken, td, r = ref._f32("q_taken", q_taken, 2), ref._f32("td", td, 1), ref._f32("r", r, 1)
    p_next, z = ref._f32("p_next", p_next, 3), ref._f32("z", z, 2)
    nb, B = q_taken.shape
    if td.shape != (B,) or r.shape != (B,):
        raise ValueError(f"td {td.shape}, r {r.shape}: need ({B},) like q_taken's batch")
    if p_next.shape[:2] != (nb, B) or z.shape != (nb, p_next.shape[2]):
        raise ValueError(f"p_next {p_next.shape}, z {z.shape}: need [{nb}, {B}, NA] and "
                         f"[{nb}, NA] for q_taken {q_taken.shape}")
    gn = ref._real("grad_norm", grad_norm, finite=False)
    ls = ref._real("loss", loss, finite=False)
    grid, planned, _ = plan_isv_signal_build(nb, B, p_next.shape[2])
    threads = planned if threads is None else threads
    if threads % ref.LANES or not ref.LANES <= threads <= SELECT_THREADS:
        raise ValueError(f"threads={threads}: allowed a multiple of {ref.LANES} in "
                         f"[{ref.LANES}, {SELECT_THREADS}]")
    (out,) = call("isv_signal_build", grid, threads, In(isv), In(q_taken), In(td), In(r),
                  In(p_next), In(z), device_scalar(gn), device_scalar(ls),
                  Out((reg.NUM_SIGNALS,), F32), I32(reg.NUM_SIGNALS), I32(nb), I32(B),
                  I32(p_next.shape[2]), In(np.array(ref.Q_EMA_SLOTS, I32)),
                  I32(len(ref.Q_EMA_SLOTS)), F32(ref.Q_DRIFT_FLOOR), F32(ref.ATOM_UTIL_FRACTION),
                  *(I32(_SIG[n]) for n in ("Q_DRIFT", "GRAD_NORM_EMA", "TD_ERR_EMA", "ENS_VAR_EMA",
                                           "ENS_VAR_VEL", "REWARD_EMA", "ATOM_UTIL_EMA",
                                           "LOSS_EMA", "LEARNING_HEALTH")))
    return out


def q_stats_update(isv: np.ndarray, q: np.ndarray, alpha_base: float) -> np.ndarray:
    """Test entry of the CUDA ``q_stats_update`` (one warp); contract as the reference."""
    _check_isv(isv)
    q = ref._f32("q", q, 2)
    if q.shape[1] != len(reg.Q_DIR_ACTION_SLOTS):
        raise ValueError(f"q: shape {q.shape}; need [B, {len(reg.Q_DIR_ACTION_SLOTS)}] (the "
                         "exposure branch's short, flat, long)")
    sharpe_slot, ab, clamp, gain = _rate_args(alpha_base)
    (out,) = call("q_stats_update", 1, ref.LANES, InOut(isv), In(q), I32(q.shape[0]),
                  I32(q.shape[1]), In(np.array(reg.Q_DIR_ACTION_SLOTS, I32)),
                  I32(reg.Q_DIR_ABS_REF_INDEX), sharpe_slot, ab, clamp, gain)
    return out


def q_quantile_update(isv: np.ndarray, q: np.ndarray, branch: int,
                      alpha_base: float) -> np.ndarray:
    """Test entry of the CUDA ``q_quantile_update`` (one block, exact selection)."""
    _check_isv(isv)
    q = ref._f32("q", q, 2)
    m = ref._member(ref._branch(branch))
    sharpe_slot, ab, clamp, gain = _rate_args(alpha_base)
    grid, threads, shared = plan_q_quantile_update(q.size)
    (out,) = call("q_quantile_update", grid, threads, InOut(isv), In(q), np.int64(q.size),
                  I32(reg.Q_P05_INDICES[m]), I32(reg.Q_P95_INDICES[m]),
                  I32(ref.QUANTILE_LO_PCT), I32(ref.QUANTILE_HI_PCT), sharpe_slot, ab, clamp, gain,
                  shared_mem=shared)
    return out


def adaptive_support_update(isv: np.ndarray, atom_growth_mult: float, headroom: float,
                            half_floor: float) -> np.ndarray:
    """Test entry of the CUDA ``adaptive_support_update``; contract as the reference."""
    _check_isv(isv)
    k2 = ref._real("atom_growth_mult", atom_growth_mult, 0.0, float("inf"))
    hr = ref._real("headroom", headroom, 0.0, float("inf"))
    hf = ref._real("half_floor", half_floor, 0.0, float("inf"))
    (out,) = call("adaptive_support_update", 1, 32, InOut(isv), I32(reg.MAX_ISV_BRANCHES),
                  I32(reg.Q_P05_INDICES[0]), I32(reg.Q_P95_INDICES[0]),
                  I32(reg.V_CENTER_INDICES[0]), I32(reg.V_HALF_INDICES[0]),
                  I32(reg.Q_ABS_REF_INDEX), k2, hr, hf)
    return out


def per_branch_gamma_update(isv: np.ndarray, gamma_base: np.ndarray,
                            gamma_max: np.ndarray) -> np.ndarray:
    """Test entry of the CUDA ``per_branch_gamma_update``; contract as the reference."""
    _check_isv(isv)
    base = ref._check_vec4("gamma_base", gamma_base)
    top = ref._check_vec4("gamma_max", gamma_max)
    (out,) = call("per_branch_gamma_update", 1, 32, InOut(isv), In(base), In(top),
                  I32(reg.MAX_ISV_BRANCHES), I32(reg.GAMMA_SEED_INDICES[0]),
                  I32(reg.EPOCH_IDX_INDEX), I32(reg.TOTAL_EPOCHS_INDEX))
    return out


def cql_alpha_ramp(isv: np.ndarray, cql_alpha: float, alpha_base: float) -> np.ndarray:
    """Test entry of the CUDA ``cql_alpha_ramp``; contract as the reference."""
    _check_isv(isv)
    ca = ref._real("cql_alpha", cql_alpha, 0.0, float("inf"))
    sharpe_slot, ab, clamp, gain = _rate_args(alpha_base)
    (out,) = call("cql_alpha_ramp", 1, 32, InOut(isv), ca, I32(reg.CQL_ALPHA_INDEX),
                  I32(reg.EPSILON_EFF_INDEX), sharpe_slot, ab, clamp, gain)
    return out


def epsilon_tau_update(isv: np.ndarray, schedule: np.ndarray, tau: float) -> np.ndarray:
    """Test entry of the CUDA ``epsilon_tau_update``; contract as the reference."""
    _check_isv(isv)
    sched = ref.check_eps_schedule(schedule)
    tu = ref._real("tau", tau, 0.0, 1.0)
    (out,) = call("epsilon_tau_update", 1, 32, InOut(isv), In(sched), tu,
                  F32(ref.TAU_HEALTH_FLOOR), I32(reg.EPSILON_EFF_INDEX), I32(reg.TAU_EFF_INDEX),
                  I32(_SIG["LEARNING_HEALTH"]))
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

__all__ = ["KERNELS", "SELECT_THREADS", "SHARED_DEFAULT", "plan_isv_signal_build",
           "plan_q_quantile_update", "signal_build_block", *KERNELS]
