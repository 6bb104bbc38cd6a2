"""Fast distributional (C51) kernels: launch plans and numpy-in/numpy-out test entries.

One test entry per CUDA kernel of ``cuda_src/distributional.cu``, each with the name, signature,
validation (the reference's own ``validate_<name>``, so bad input raises the same
``ValueError``; then the fast path's own 32-bit index limit) and
return structure of its twin in :mod:`foxhunt.reference.kernels.distributional`. Each
``plan_NAME(sizes...) -> (grid, block, shared_mem)`` is the launch configuration; the trainer
reuses it with arena pointers (kernel parameter order: inputs, outputs, sizes, configuration;
see the ``.cu`` file's header).

Device scalars: ``gamma`` (c51_project, c51_project_grad), ``alpha`` and ``scale``
(cql_logit_grad) and ``scale`` (c51_loss, c51_grad, c51_project_grad) are read by the kernels through a pointer to one float (the ISV bus or an
arena slot), so a captured graph sees their current value; the test entries upload them.

Numerics (conformance/tolerance.py entries, all ``REDUCTION`` except the exact
``double_dqn_select``): sums over actions (dueling_combine, its backward, the CQL logsumexp)
run in action order and c51_project's sum over source atoms in source order, as the reference
does, so those agree with it bit for bit on the same inputs (CUDA's IEEE ``/`` and ``-fmad=false``);
sums over atoms elsewhere use a per-lane order plus a fixed warp butterfly (the reference uses
NumPy's pairwise order) and ``expf``/``logf`` are within 2 / 1 ULP, not correctly rounded.
Every reduction has a fixed order: outputs are bitwise repeatable.

Fused kernels (``log_softmax_expected_q``, ``c51_project_grad``): each runs the device bodies of
the two kernels it replaces, in their operation order, so its outputs are bitwise equal to the
two separate launches (their tolerances apply against the reference).
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.kernels._runtime import In, Out, blocks, call, check_elements, device_scalar
from foxhunt.reference.kernels.distributional import (
    F32,
    I32,
    C51Loss,
    C51ProjectGrad,
    CqlGrad,
    DuelingGrads,
    LogSoftmaxQ,
    validate_c51_grad,
    validate_c51_loss,
    validate_c51_project,
    validate_discount,
    validate_c51_project_grad,
    validate_c51_project_grad_live,
    validate_cql_logit_grad,
    validate_double_dqn_select,
    validate_dueling_combine,
    validate_dueling_combine_backward,
    validate_expected_q,
    validate_log_softmax_atoms,
    validate_log_softmax_expected_q,
)

Plan = tuple[int, int, int]  # (grid, block, dynamic shared-memory bytes)

WARP = 32
#: Block size of the elementwise and warp-per-row kernels.
THREADS = 256
#: Rows per block of the warp-per-row kernels (log_softmax_atoms, expected_q).
WARPS_PER_BLOCK = THREADS // WARP
#: c51_project: at most this many threads per block (its shared tiles; ``kProjectMaxThreads``).
PROJECT_MAX_THREADS = 256
#: c51_loss runs as one block of this many threads (``kLossMaxThreads``).
LOSS_THREADS = 1024
#: cql_logit_grad: at most this many warps per block (``kCqlMaxWarps``, its launch bound).
CQL_MAX_WARPS = 8
#: cql_logit_grad: warps per block of its plans (one warp per sample; small blocks so that a
#: single trainer's 256 samples spread over 64 blocks per branch).
CQL_WARPS = 4
#: Dynamic shared memory available without an opt-in.
SHARED_LIMIT = 48 * 1024
F32_BYTES = 4


def _flat_plan(n: int) -> Plan:
    """One thread per item, blocks of ``THREADS``."""
    return blocks(n, THREADS), THREADS, 0


def _warp_rows_plan(rows: int) -> Plan:
    """One warp per row, ``WARPS_PER_BLOCK`` rows per block."""
    return blocks(rows, WARPS_PER_BLOCK), THREADS, 0


# --------------------------------------------------------------------------------------------
# Plans.
# --------------------------------------------------------------------------------------------


def plan_dueling_combine(batch: int, num_actions: int, num_atoms: int) -> Plan:
    """One thread per ``(b, j)`` cell."""
    return _flat_plan(batch * num_atoms)


def plan_dueling_combine_backward(batch: int, num_actions: int, num_atoms: int) -> Plan:
    """One thread per ``(b, j)`` cell."""
    return _flat_plan(batch * num_atoms)


def plan_log_softmax_atoms(rows: int, num_atoms: int) -> Plan:
    """One warp per row of atoms."""
    return _warp_rows_plan(rows)


def plan_expected_q(batch: int, num_actions: int, num_atoms: int) -> Plan:
    """One warp per ``(b, a)`` row."""
    return _warp_rows_plan(batch * num_actions)


def plan_double_dqn_select(batch: int, num_actions: int) -> Plan:
    """One thread per sample."""
    return _flat_plan(batch)


def plan_c51_project(batch: int, num_atoms: int) -> Plan:
    """One block per sample; one thread per target atom (whole warps, at most 256)."""
    threads = min(PROJECT_MAX_THREADS, WARP * blocks(num_atoms, WARP))
    return max(1, batch), threads, 0


def plan_c51_loss(batch: int, num_actions: int, num_atoms: int) -> Plan:
    """One block (the total is reduced in a fixed order inside it)."""
    return 1, LOSS_THREADS, 0


def cql_warps(num_actions: int) -> int:
    """Warps per block of ``cql_logit_grad`` (and its fused form) for ``A`` actions: one warp
    per sample, ``CQL_WARPS``, fewer when their Q rows (``A`` floats of shared memory per warp)
    would pass ``SHARED_LIMIT``; 0 when one row does not fit (``A > SHARED_LIMIT / 4``)."""
    return min(CQL_WARPS, SHARED_LIMIT // (int(num_actions) * F32_BYTES))


def plan_cql_logit_grad(batch: int, num_actions: int, num_atoms: int) -> Plan:
    """One warp per sample (its ``A`` rows' Q, the action-order max/sum, then its ``A * NA``
    gradient elements), ``cql_warps(A)`` warps per block; shared memory holds each warp's ``A``
    Q values. Seed shapes (``batch = 256``, ``A = 3``): grid 64, 128 threads, 48 bytes."""
    warps = cql_warps(num_actions)
    if warps < 1:
        raise ValueError(
            f"num_actions: {num_actions} needs {num_actions * F32_BYTES} bytes of shared memory "
            f"per warp in cql_logit_grad; expected at most {SHARED_LIMIT} "
            f"(A <= {SHARED_LIMIT // F32_BYTES})"
        )
    return blocks(batch, warps), WARP * warps, warps * int(num_actions) * F32_BYTES


def plan_c51_grad(batch: int, num_actions: int, num_atoms: int) -> Plan:
    """One thread per element of ``dlogits``."""
    return _flat_plan(batch * num_actions * num_atoms)


def plan_log_softmax_expected_q(rows: int, num_atoms: int) -> Plan:
    """One warp per row of atoms (``log_softmax_atoms``' plan; the first ``q_rows`` warps also
    sum their row's Q)."""
    return _warp_rows_plan(rows)


def plan_c51_project_grad(batch: int, num_actions: int, num_atoms: int) -> Plan:
    """``c51_project``'s plan: one block per sample, one thread per target atom (whole warps,
    at most 256); the block also writes the sample's ``A * NA`` gradient elements."""
    return plan_c51_project(batch, num_atoms)


# --------------------------------------------------------------------------------------------
# Test entries (reference signatures).
# --------------------------------------------------------------------------------------------


def dueling_combine(v: np.ndarray, adv: np.ndarray) -> np.ndarray:
    """Fast ``dueling_combine``: ``logits [B, A, NA]`` (see the reference)."""
    validate_dueling_combine(v, adv)
    check_elements("adv", adv)
    batch, num_actions, num_atoms = adv.shape
    if adv.size == 0:
        return np.zeros(adv.shape, dtype=F32)
    grid, block, shared = plan_dueling_combine(batch, num_actions, num_atoms)
    (logits,) = call("dueling_combine", grid, block, In(v), In(adv), Out(adv.shape, F32),
                     batch, num_actions, num_atoms, shared_mem=shared)
    return logits


def dueling_combine_backward(dlogits: np.ndarray) -> DuelingGrads:
    """Fast ``dueling_combine_backward``: ``DuelingGrads(dv [B, NA], dadv [B, A, NA])``."""
    validate_dueling_combine_backward(dlogits)
    check_elements("dlogits", dlogits)
    batch, num_actions, num_atoms = dlogits.shape
    if dlogits.size == 0:
        return DuelingGrads(dv=np.zeros((batch, num_atoms), dtype=F32),
                            dadv=np.zeros(dlogits.shape, dtype=F32))
    grid, block, shared = plan_dueling_combine_backward(batch, num_actions, num_atoms)
    dv, dadv = call("dueling_combine_backward", grid, block, In(dlogits),
                    Out((batch, num_atoms), F32), Out(dlogits.shape, F32),
                    batch, num_actions, num_atoms, shared_mem=shared)
    return DuelingGrads(dv=dv, dadv=dadv)


def log_softmax_atoms(logits: np.ndarray) -> np.ndarray:
    """Fast ``log_softmax_atoms`` over the last axis: float32 of ``logits``' shape."""
    validate_log_softmax_atoms(logits)
    check_elements("logits", logits)
    num_atoms = logits.shape[-1]
    rows = logits.size // num_atoms
    if rows == 0:
        return np.zeros(logits.shape, dtype=F32)
    grid, block, shared = plan_log_softmax_atoms(rows, num_atoms)
    (logp,) = call("log_softmax_atoms", grid, block, In(logits), Out(logits.shape, F32),
                   rows, num_atoms, shared_mem=shared)
    return logp


def expected_q(logp: np.ndarray, z: np.ndarray) -> np.ndarray:
    """Fast ``expected_q``: ``q [B, A]``."""
    validate_expected_q(logp, z)
    check_elements("logp", logp)
    batch, num_actions, num_atoms = logp.shape
    if batch * num_actions == 0:
        return np.zeros((batch, num_actions), dtype=F32)
    grid, block, shared = plan_expected_q(batch, num_actions, num_atoms)
    (q,) = call("expected_q", grid, block, In(logp), In(z), Out((batch, num_actions), F32),
                batch * num_actions, num_atoms, shared_mem=shared)
    return q


def double_dqn_select(q: np.ndarray) -> np.ndarray:
    """Fast ``double_dqn_select``: ``int32 [B]`` (exact)."""
    validate_double_dqn_select(q)
    check_elements("q", q)
    batch, num_actions = q.shape
    if batch == 0:
        return np.zeros(0, dtype=I32)
    grid, block, shared = plan_double_dqn_select(batch, num_actions)
    (best,) = call("double_dqn_select", grid, block, In(q), Out((batch,), I32),
                   batch, num_actions, shared_mem=shared)
    return best


def n_step_args(discount, gamma_ref, batch: int) -> tuple:
    """The n-step launch arguments of a target kernel (``discount``, ``gamma_ref``,
    ``n_step_on``): ``(In(discount), gamma_ref, 1)``, or ``(0, 0.0, 0)`` (a null pointer the
    kernel does not read) for ``discount=None``. Checked by ``validate_discount``."""
    ref = validate_discount(discount, gamma_ref, batch)
    if ref is None:
        return 0, np.float32(0), 0
    return In(discount), ref, 1


def c51_project(
    p_next: np.ndarray,
    r: np.ndarray,
    done: np.ndarray,
    gamma,
    z: np.ndarray,
    v_min,
    v_max,
    discount: np.ndarray | None = None,
    gamma_ref=None,
) -> np.ndarray:
    """Fast ``c51_project`` (dense triangular form): ``m [B, NA]``."""
    g, lo, hi, dz = validate_c51_project(p_next, r, done, gamma, z, v_min, v_max, discount,
                                         gamma_ref)
    check_elements("p_next", p_next)
    batch, num_atoms = p_next.shape
    if batch == 0:
        return np.zeros((0, num_atoms), dtype=F32)
    grid, block, shared = plan_c51_project(batch, num_atoms)
    disc, ref, on = n_step_args(discount, gamma_ref, batch)
    (m,) = call("c51_project", grid, block, In(p_next), In(r), In(done), device_scalar(g), In(z),
                disc, Out((batch, num_atoms), F32), batch, num_atoms, lo, hi, dz, ref, on,
                shared_mem=shared)
    return m


def c51_loss(
    logp: np.ndarray,
    actions: np.ndarray,
    m: np.ndarray,
    isw: np.ndarray,
    scale,
) -> C51Loss:
    """Fast ``c51_loss``: ``C51Loss(ce [B], total)`` (one block; fixed-order total)."""
    s = validate_c51_loss(logp, actions, m, isw, scale)
    check_elements("logp", logp)
    batch, num_actions, num_atoms = logp.shape
    grid, block, shared = plan_c51_loss(batch, num_actions, num_atoms)
    ce, total = call("c51_loss", grid, block, In(logp), In(actions), In(m), In(isw),
                     device_scalar(s), Out((batch,), F32), Out((1,), F32),
                     batch, num_actions, num_atoms, shared_mem=shared)
    return C51Loss(ce=ce, total=np.float32(total[0]))


def c51_grad(
    logp: np.ndarray,
    actions: np.ndarray,
    m: np.ndarray,
    isw: np.ndarray,
    scale,
) -> np.ndarray:
    """Fast ``c51_grad``: ``dlogits [B, A, NA]``, ``+0.0`` at the actions not taken."""
    s = validate_c51_grad(logp, actions, m, isw, scale)
    check_elements("logp", logp)
    batch, num_actions, num_atoms = logp.shape
    if logp.size == 0:
        return np.zeros(logp.shape, dtype=F32)
    grid, block, shared = plan_c51_grad(batch, num_actions, num_atoms)
    (dlogits,) = call("c51_grad", grid, block, In(logp), In(actions), In(m), In(isw),
                      device_scalar(s), Out(logp.shape, F32),
                      batch, num_actions, num_atoms, shared_mem=shared)
    return dlogits


def cql_logit_grad(
    logp: np.ndarray,
    actions: np.ndarray,
    z: np.ndarray,
    alpha,
    scale,
) -> CqlGrad:
    """Fast ``cql_logit_grad``: ``CqlGrad(dlogits [B, A, NA], terms [B])``."""
    a_, s_ = validate_cql_logit_grad(logp, actions, z, alpha, scale)
    check_elements("logp", logp)
    batch, num_actions, num_atoms = logp.shape
    if batch == 0:
        return CqlGrad(dlogits=np.zeros(logp.shape, dtype=F32), terms=np.zeros(0, dtype=F32))
    grid, block, shared = plan_cql_logit_grad(batch, num_actions, num_atoms)
    dlogits, terms = call("cql_logit_grad", grid, block, In(logp), In(actions), In(z),
                          device_scalar(a_), device_scalar(s_), Out(logp.shape, F32),
                          Out((batch,), F32), batch, num_actions, num_atoms, shared_mem=shared)
    return CqlGrad(dlogits=dlogits, terms=terms)


def log_softmax_expected_q(logits: np.ndarray, z: np.ndarray, q_rows) -> LogSoftmaxQ:
    """Fast ``log_softmax_expected_q``: ``LogSoftmaxQ(logp [R, NA], q [q_rows])`` (bitwise
    equal to ``log_softmax_atoms`` then ``expected_q`` on the first ``q_rows`` rows)."""
    q_rows = validate_log_softmax_expected_q(logits, z, q_rows)
    check_elements("logits", logits)
    rows, num_atoms = logits.shape
    if rows == 0:
        return LogSoftmaxQ(logp=np.zeros(logits.shape, dtype=F32), q=np.zeros(0, dtype=F32))
    grid, block, shared = plan_log_softmax_expected_q(rows, num_atoms)
    logp, q = call("log_softmax_expected_q", grid, block, In(logits), In(z),
                   Out(logits.shape, F32), Out((q_rows,), F32), rows, q_rows, num_atoms,
                   shared_mem=shared)
    return LogSoftmaxQ(logp=logp, q=q)


def c51_project_grad(
    p_next: np.ndarray,
    r: np.ndarray,
    done: np.ndarray,
    gamma,
    z: np.ndarray,
    v_min,
    v_max,
    logp: np.ndarray,
    actions: np.ndarray,
    isw: np.ndarray,
    scale,
    discount: np.ndarray | None = None,
    gamma_ref=None,
) -> C51ProjectGrad:
    """Fast ``c51_project_grad``: ``C51ProjectGrad(m [B, NA], dlogits [B, A, NA])`` (bitwise
    equal to ``c51_project`` then ``c51_grad``)."""
    (g, lo, hi, dz), s = validate_c51_project_grad(p_next, r, done, gamma, z, v_min, v_max,
                                                   logp, actions, isw, scale, discount,
                                                   gamma_ref)
    check_elements("p_next", p_next)
    check_elements("logp", logp)
    batch, num_actions, num_atoms = logp.shape
    if batch == 0:
        return C51ProjectGrad(m=np.zeros((0, num_atoms), dtype=F32),
                              dlogits=np.zeros(logp.shape, dtype=F32))
    grid, block, shared = plan_c51_project_grad(batch, num_actions, num_atoms)
    disc, ref, on = n_step_args(discount, gamma_ref, batch)
    m, dlogits = call("c51_project_grad", grid, block, In(p_next), In(r), In(done),
                      device_scalar(g), In(z), In(logp), In(actions), In(isw), device_scalar(s),
                      disc, Out((batch, num_atoms), F32), Out(logp.shape, F32),
                      batch, num_actions, num_atoms, lo, hi, dz, ref, on, shared_mem=shared)
    return C51ProjectGrad(m=m, dlogits=dlogits)


def plan_c51_project_grad_live(batch: int, num_actions: int, num_atoms: int) -> Plan:
    """``c51_project_grad``'s plan (the same body)."""
    return plan_c51_project_grad(batch, num_actions, num_atoms)


def c51_project_grad_live(
    p_next: np.ndarray,
    r: np.ndarray,
    done: np.ndarray,
    gamma,
    z: np.ndarray,
    bounds: np.ndarray,
    logp: np.ndarray,
    actions: np.ndarray,
    isw: np.ndarray,
    scale,
    discount: np.ndarray | None = None,
    gamma_ref=None,
) -> C51ProjectGrad:
    """Fast ``c51_project_grad_live``: ``C51ProjectGrad(m, dlogits)``, bitwise
    ``c51_project_grad`` with ``v_min, v_max, dz = bounds`` (read on the device)."""
    (g, _lo, _hi, _dz), s = validate_c51_project_grad_live(
        p_next, r, done, gamma, z, bounds, logp, actions, isw, scale, discount, gamma_ref)
    check_elements("p_next", p_next)
    check_elements("logp", logp)
    batch, num_actions, num_atoms = logp.shape
    if batch == 0:
        return C51ProjectGrad(m=np.zeros((0, num_atoms), dtype=F32),
                              dlogits=np.zeros(logp.shape, dtype=F32))
    grid, block, shared = plan_c51_project_grad_live(batch, num_actions, num_atoms)
    disc, ref, on = n_step_args(discount, gamma_ref, batch)
    m, dlogits = call("c51_project_grad_live", grid, block, In(p_next), In(r), In(done),
                      device_scalar(g), In(z), In(bounds), In(logp), In(actions), In(isw),
                      device_scalar(s), disc, Out((batch, num_atoms), F32), Out(logp.shape, F32),
                      batch, num_actions, num_atoms, ref, on, shared_mem=shared)
    return C51ProjectGrad(m=m, dlogits=dlogits)


KERNELS = {
    "dueling_combine": dueling_combine,
    "dueling_combine_backward": dueling_combine_backward,
    "log_softmax_atoms": log_softmax_atoms,
    "expected_q": expected_q,
    "double_dqn_select": double_dqn_select,
    "c51_project": c51_project,
    "c51_loss": c51_loss,
    "c51_grad": c51_grad,
    "cql_logit_grad": cql_logit_grad,
    "log_softmax_expected_q": log_softmax_expected_q,
    "c51_project_grad": c51_project_grad,
    "c51_project_grad_live": c51_project_grad_live,
}
