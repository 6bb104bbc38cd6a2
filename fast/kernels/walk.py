"""Fast launchers of ``cuda_src/walk.cu``'s greedy walks: ``greedy_walk``, ``greedy_walk_cluster``,
``greedy_walk_hold`` and ``greedy_walk_spans`` (twin of all four:
``foxhunt.reference.kernels.walk.greedy_walk``, same signature; bitwise equal records), and
``greedy_walk_round`` (the chunked repair walk: ``greedy_walk_chunked`` runs its rounds from
flat; twin ``reference.kernels.walk_rounds``); ``greedy_walk_span_rounds``, the evaluator's
fused walk (span launches, then rounds on their base), is a test entry of its own (twin
``greedy_walk``).

The test entries are numpy-in/numpy-out: they validate with the reference's checks (same
``ValueError``), build the BF16 mirror of ``params`` with the ``f32_to_bf16`` kernel (the
trainer's mirror is made the same way), launch on the test runtime's device and return the
reference's ``WalkRecord``: ONE block (``greedy_walk``), ONE thread-block cluster
(``greedy_walk_cluster``: 8 blocks from sm_90, 1 before; ``greedy_walk_hold``: the cluster walk,
many steps a pass while the policy holds), the span walk's launches (``greedy_walk_spans``:
``SPAN_PASSES`` launches on ``SPAN_CHUNKS`` clusters, then its tail on one), or the fused walk
as the evaluator runs it (``greedy_walk_span_rounds``: the ``SPAN_PASSES`` span launches, then
``SPAN_ROUNDS`` launches of ``greedy_walk_round`` on ``SPAN_CHUNKS`` clusters with the spans'
buffers as their base).

The evaluator's fused mode (``fast.eval_plan.fused_ops``) launches, on arena buffers and every
parameter by its name in walk.cu, the span launches and the rounds where :func:`plan_walk`
picks the cluster kernel, else ``greedy_walk``. The common parameters: ``params, params_bf16,
param_offsets, bf16, state_dim, h1, h2, value_h, adv_h, num_atoms, n_branches, n_actions,
action_offset, z, z_stride, isv, isv_index, h2_clamp_mult, close, high, low, features,
n_features, costs, n_bars, start, n_steps``, then the kernel's own (the span walk: ``n_chunks,
n_passes, pass_index, hold_rows, state, brk``; a round: ``n_chunks, round, span_chunks,
span_passes, span_state, span_brk, trace, ends``), then ``rec_reward, rec_held, rec_cost,
rec_margin, record_len`` (``rec_margin`` may be null, ``params_bf16`` too when ``bf16`` is 0,
``span_state`` and ``span_brk`` too: a round without a span base). Branch d's support is ``z +
d * z_stride`` (``reference.kernels.walk.check_support``): ``z_stride`` 0 with the fixed support
``z [NA]``, ``NA`` with the live per-branch support ``[n_branches, NA]`` (the evaluator's
``z_e``, built from the ISV of the walk's start).

**Which kernel** (:func:`plan_walk`): the cluster kernel on sm_90 and newer when its block's
slices fit the architecture's opt-in shared memory (:data:`SHARED_OPTIN`), else the one-block
kernel (before sm_90 there are no clusters; walk.cu compiles the cluster kernels there as
one-block versions that hold every weight, which nothing plans). Shared memory per block of
the cluster kernel, seed preset (:func:`cluster_shared_bytes`, counted by hand in
``tests/test_walk.py``): 92,468 bytes in bf16, 164,660 bytes in f32 (the f32 weights, 1.15 MB,
split over 8 blocks: 144 KiB each); both fit sm_90's 227 KiB. The hold and span kernels add
their rows' activations (:func:`hold_shared_bytes`: 16 rows in bf16, 8 in f32 for the seed
network). More than 48 KiB needs the kernel's opt-in attribute: the graph lowering
(``fast.graph_lowering``) sets it before capture, the test entries here before their launch.
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.kernels._runtime import (SHARED_LIMIT, In, InOut, Out, device_scalar, launch,
                                           runtime)
from foxhunt.fast.kernels.dense import f32_to_bf16
from foxhunt.reference.kernels.argcheck import check_int
from foxhunt.reference.kernels.fused import branch_offsets
from foxhunt.reference.kernels.walk import WalkRecord, validate_greedy_walk
from foxhunt.reference.kernels.walk_rounds import (
    NO_SPAN_BASE,
    WalkRoundState,
    validate_greedy_walk_round,
)
from foxhunt.reference.kernels.walk_spans import HOLD_MAX, SPAN_BREAK, SPAN_STATE

F32, I32 = np.float32, np.int32

#: Threads of the one block (WALK_THREADS in walk.cu) and its warps.
WALK_THREADS = 1024
WALK_WARPS = WALK_THREADS // 32
#: Threads of each block of the cluster kernel (WALK_CLUSTER_THREADS) and its warps.
CLUSTER_THREADS = 1024
CLUSTER_WARPS = CLUSTER_THREADS // 32
#: Blocks of the cluster kernel from sm_90 (WALK_CLUSTER; 1 before: no clusters).
WALK_CLUSTER_SM90 = 8
#: Opt-in dynamic shared memory per block by architecture (CUDA C Programming Guide, "Technical
#: Specifications per Compute Capability"); an architecture not listed gets the smallest.
SHARED_OPTIN = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024,
                100: 227 * 1024, 103: 227 * 1024, 120: 99 * 1024}
#: The kernels, in the order :func:`plan_walk` prefers them.
WALK_KERNELS = ("greedy_walk_cluster", "greedy_walk")


def walk_activation_floats(dims, branches, warps: int) -> int:
    """walk.cu's ``walk_acts``: x, h1, h2, the heads' hidden rows, their outputs (v and every
    branch's adv), q, and two scratch rows of ``num_atoms`` per warp."""
    sd, h1, h2, value_h, adv_h, na = (int(d) for d in dims)
    nb, a_total = len(branches), sum(int(n) for n in branches)
    return sd + h1 + h2 + value_h + nb * adv_h + na * (1 + a_total) + a_total + 2 * warps * na


def walk_shared_floats(dims, branches) -> int:
    """The one-block kernel's shared memory: :func:`walk_activation_floats` of its warps."""
    return walk_activation_floats(dims, branches, WALK_WARPS)


def walk_layers(dims, branches) -> tuple[tuple[int, int, int, int], ...]:
    """walk.cu's ``walk_layer_of``: ``(rows, split, k_lo, k_hi)`` of each dense layer, rows
    ``[0, split)`` with fan in ``k_lo``, the rest ``k_hi``."""
    sd, h1, h2, value_h, adv_h, na = (int(d) for d in dims)
    hid = value_h + len(branches) * adv_h
    out = na * (1 + sum(int(n) for n in branches))
    return (h1, h1, sd, sd), (h2, h2, h1, h1), (hid, hid, h2, h2), (out, na, value_h, adv_h)


def owned_rows(rows: int, rank: int, cluster: int) -> tuple[int, int]:
    """walk.cu's ``walk_owned``: rows ``[r0, r1)`` of block ``rank``, ``ceil(rows / C)`` each."""
    q = -(-rows // cluster)
    r0 = min(rows, rank * q)
    return r0, min(rows, r0 + q)


def cluster_slices(dims, branches, cluster: int) -> tuple[int, int]:
    """``(bias floats, weight elements)`` every block of the cluster kernel reserves: per layer
    ``ceil(rows / C)`` biases and the largest weight slice of any rank (``walk_slice_cap``)."""
    biases = weights = 0
    for rows, split, k_lo, k_hi in walk_layers(dims, branches):
        biases += -(-rows // cluster)
        sizes = []
        for rank in range(cluster):
            r0, r1 = owned_rows(rows, rank, cluster)
            lo = min(r1, split) - min(r0, split)
            sizes.append(lo * k_lo + (r1 - r0 - lo) * k_hi)
        weights += max(sizes)
    return biases, weights


def cluster_shared_bytes(dims, branches, bf16: bool, cluster: int) -> int:
    """Dynamic shared memory of one block of the cluster kernel: its activations, bias slices
    (f32) and weight slices (BF16 or f32)."""
    biases, weights = cluster_slices(dims, branches, cluster)
    floats = walk_activation_floats(dims, branches, CLUSTER_WARPS) + biases
    return 4 * floats + (2 if bf16 else 4) * weights


def cluster_size(arch) -> int:
    """Blocks of the cluster kernel that walk.cu compiles for ``arch``: 8 from sm_90, else 1."""
    from foxhunt.fast._build import normalize_arch

    return WALK_CLUSTER_SM90 if normalize_arch(arch) >= 90 else 1


def shared_optin(arch) -> int:
    """The most dynamic shared memory a block may opt in to on ``arch`` (:data:`SHARED_OPTIN`)."""
    from foxhunt.fast._build import normalize_arch

    return SHARED_OPTIN.get(normalize_arch(arch), min(SHARED_OPTIN.values()))


def plan_greedy_walk(dims, branches) -> tuple:
    """ONE block of ``WALK_THREADS``; dynamic shared memory :func:`walk_shared_floats` floats
    (``ValueError`` past ``SHARED_LIMIT``). Seed shapes: 19.5 KiB."""
    nbytes = 4 * walk_shared_floats(dims, branches)
    if nbytes > SHARED_LIMIT:
        raise ValueError(f"dims={tuple(dims)!r}, branches={tuple(branches)!r}: greedy_walk needs "
                         f"{nbytes} bytes of shared memory; at most {SHARED_LIMIT} are allowed")
    return (1,), (WALK_THREADS,), nbytes


def plan_greedy_walk_cluster(dims, branches, bf16: bool, arch) -> tuple:
    """ONE cluster of :func:`cluster_size` blocks of ``CLUSTER_THREADS``; dynamic shared memory
    :func:`cluster_shared_bytes` (``ValueError`` past :func:`shared_optin` of ``arch``)."""
    cluster = cluster_size(arch)
    nbytes = cluster_shared_bytes(dims, branches, bf16, cluster)
    limit = shared_optin(arch)
    if nbytes > limit:
        raise ValueError(f"dims={tuple(dims)!r}, branches={tuple(branches)!r}, bf16={bool(bf16)}: "
                         f"greedy_walk_cluster needs {nbytes} bytes of shared memory per block of "
                         f"{cluster}; {arch} allows at most {limit}")
    return (cluster,), (CLUSTER_THREADS,), nbytes


def plan_greedy_walk_round(dims, branches, bf16: bool, arch, n_chunks: int) -> tuple:
    """``n_chunks`` clusters of :func:`plan_greedy_walk_cluster`'s blocks (cluster ``g`` walks
    chunk ``g``), each block with that plan's shared memory; ``ValueError`` as that plan, and
    before sm_90 (no clusters: one block would have to hold every weight)."""
    if cluster_size(arch) < 2:
        raise ValueError(f"arch={arch!r}: greedy_walk_round needs thread-block clusters (sm_90 "
                         "and newer)")
    (cluster,), block, nbytes = plan_greedy_walk_cluster(dims, branches, bf16, arch)
    return (int(n_chunks) * cluster,), block, nbytes


#: The row counts the hold plans try, largest first (at most ``walk_spans.HOLD_MAX``, walk.cu's
#: WALK_HOLD_MAX: the most rows a pass runs).
HOLD_ROWS = tuple(r for r in (16, 8, 4, 2, 1) if r <= HOLD_MAX)


def hold_shared_bytes(dims, branches, bf16: bool, cluster: int, rows: int) -> int:
    """Dynamic shared memory of one block of ``greedy_walk_hold`` with ``rows`` inputs: their
    activations (:func:`walk_activation_floats` without scratch, ``rows`` times), the scratch
    rows (two of ``num_atoms`` per warp), the bias slices (f32) and weight slices."""
    biases, weights = cluster_slices(dims, branches, cluster)
    na = int(dims[5])
    floats = rows * walk_activation_floats(dims, branches, 0) + 2 * CLUSTER_WARPS * na + biases
    return 4 * floats + (2 if bf16 else 4) * weights


def plan_greedy_walk_hold(dims, branches, bf16: bool, arch) -> tuple[tuple, int]:
    """``(plan, rows)``: ONE cluster as :func:`plan_greedy_walk_cluster`, with the most state
    rows of :data:`HOLD_ROWS` whose :func:`hold_shared_bytes` fit :func:`shared_optin` of
    ``arch`` (seed preset: 16 in bf16, 8 in f32); ``ValueError`` before sm_90 or when not even
    one row fits."""
    cluster = cluster_size(arch)
    if cluster < 2:
        raise ValueError(f"arch={arch!r}: greedy_walk_hold needs thread-block clusters (sm_90 "
                         "and newer)")
    limit = shared_optin(arch)
    for rows in HOLD_ROWS:
        nbytes = hold_shared_bytes(dims, branches, bf16, cluster, rows)
        if nbytes <= limit:
            return ((cluster,), (CLUSTER_THREADS,), nbytes), rows
    raise ValueError(f"dims={tuple(dims)!r}, branches={tuple(branches)!r}, bf16={bool(bf16)}: "
                     f"greedy_walk_hold needs {nbytes} bytes of shared memory per block for one "
                     f"row; {arch} allows at most {limit}")


#: ``greedy_walk_spans``: its clusters (as many as an H200 runs at once: 132 SMs, 16 clusters of
#: 8) and its span launches before the tail (in the evaluator: before the rounds).
SPAN_CHUNKS = 16
SPAN_PASSES = 8
#: The evaluator's ``greedy_walk_round`` launches after the spans, on ``SPAN_CHUNKS`` chunks:
#: as many rounds as chunks make the walk exact for every policy (walk.cu's header).
SPAN_ROUNDS = SPAN_CHUNKS


def plan_greedy_walk_spans(dims, branches, bf16: bool, arch, n_chunks: int) -> tuple:
    """``(span plan, tail plan, rows)``: ``n_chunks`` clusters, and one cluster for the tail,
    each block with :func:`plan_greedy_walk_hold`'s shared memory and rows."""
    (grid, block, nbytes), rows = plan_greedy_walk_hold(dims, branches, bf16, arch)
    return ((int(n_chunks) * grid[0],), block, nbytes), (grid, block, nbytes), rows


def plan_walk(dims, branches, bf16: bool, arch) -> tuple[str, tuple]:
    """``(kernel, plan)`` of the fused walk on ``arch`` (module docstring): the cluster kernel
    from sm_90 where it fits, else the one-block kernel."""
    if cluster_size(arch) > 1:
        try:
            return "greedy_walk_cluster", plan_greedy_walk_cluster(dims, branches, bf16, arch)
        except ValueError:
            pass  # too large for one cluster's shared memory: the one-block kernel reads L2
    return "greedy_walk", plan_greedy_walk(dims, branches)


def _inputs(params, param_offsets, dims, branches, bf16, z, z_stride, isv,
            isv_index, h2_clamp_mult, close, high, low, features, costs, T, start,
            n_steps) -> tuple:
    """The launch arguments every walk kernel of walk.cu takes first, ``params`` to ``n_steps``
    (its parameter order; the BF16 mirror made by the ``f32_to_bf16`` kernel)."""
    branches = tuple(int(n) for n in branches)
    mirror = In(f32_to_bf16(params)) if bf16 else 0
    return (In(params), mirror, In(param_offsets), int(bool(bf16)), *(int(d) for d in dims),
            len(branches), In(np.array(branches, I32)),
            In(np.array(branch_offsets(branches), I32)), In(np.ascontiguousarray(z)),
            int(z_stride), In(isv), int(isv_index), np.float32(h2_clamp_mult), In(close),
            In(high), In(low), In(features), features.shape[1], In(costs), T,
            device_scalar(start, I32), device_scalar(n_steps, I32))


def _walk(kernel, plan, params, param_offsets, dims, branches, bf16, z, z_stride, isv,
          isv_index, h2_clamp_mult, close, high, low, features, costs, start,
          n_steps) -> WalkRecord:
    """Validate, then one launch of ``kernel`` with ``plan(dims, branches, bf16)``."""
    T, start, n_steps = validate_greedy_walk(
        params, param_offsets, dims, branches, bf16, z, z_stride, isv, isv_index, h2_clamp_mult,
        close, high, low, features, costs, start, n_steps)
    branches = tuple(int(n) for n in branches)
    shape = plan(dims, branches, bool(bf16))
    extra = ()
    if len(shape) == 2:  # greedy_walk_hold: (plan, rows); rows is its hold_rows argument
        shape, hold_rows = shape
        extra = (hold_rows,)
    rows = max(n_steps, 1)
    outs = launch(kernel, shape, *_inputs(params, param_offsets, dims, branches,
                                          bf16, z, z_stride, isv, isv_index, h2_clamp_mult,
                                          close, high, low, features, costs, T, start, n_steps),
                  *extra, Out((rows,), F32), Out((rows,), F32), Out((rows,), F32),
                  Out((rows,), F32), n_steps)
    return WalkRecord(*(o[:n_steps] for o in outs))


def greedy_walk(params, param_offsets, dims, branches, bf16, z, z_stride, isv, isv_index,
                h2_clamp_mult, close, high, low, features, costs, start, n_steps) -> WalkRecord:
    """Test entry of the CUDA ``greedy_walk`` (contract as the reference twin)."""
    return _walk("greedy_walk", lambda d, b, _: plan_greedy_walk(d, b), params, param_offsets,
                 dims, branches, bf16, z, z_stride, isv, isv_index, h2_clamp_mult, close, high,
                 low, features, costs, start, n_steps)


def greedy_walk_cluster(params, param_offsets, dims, branches, bf16, z, z_stride, isv,
                        isv_index, h2_clamp_mult, close, high, low, features, costs, start,
                        n_steps) -> WalkRecord:
    """Test entry of the CUDA ``greedy_walk_cluster`` on the test runtime's device (contract as
    the reference twin; ``ValueError`` where the slices do not fit its shared memory)."""
    return _walk("greedy_walk_cluster",
                 lambda d, b, bf: plan_greedy_walk_cluster(d, b, bf, runtime().device.arch), params,
                 param_offsets, dims, branches, bf16, z, z_stride, isv, isv_index, h2_clamp_mult,
                 close, high, low, features, costs, start, n_steps)


def greedy_walk_round(params, param_offsets, dims, branches, bf16, z, z_stride, isv, isv_index,
                      h2_clamp_mult, close, high, low, features, costs, start, n_steps, n_chunks,
                      round, span_chunks, span_passes, span_state, span_brk, trace, ends,
                      rec_reward, rec_held, rec_cost, rec_margin) -> WalkRoundState:
    """Test entry of the CUDA ``greedy_walk_round``: ONE launch (one round) on copies of the
    buffers, returned as the twin's ``WalkRoundState`` (contract and errors as the twin's; the
    span base's buffers are read only)."""
    T, start, n_steps, n_chunks, round, span_chunks, span_passes = validate_greedy_walk_round(
        params, param_offsets, dims, branches, bf16, z, z_stride, isv, isv_index, h2_clamp_mult,
        close, high, low, features, costs, start, n_steps, n_chunks, round, span_chunks,
        span_passes, span_state, span_brk, trace, ends, rec_reward, rec_held, rec_cost,
        rec_margin)
    plan = plan_greedy_walk_round(dims, branches, bool(bf16), runtime().device.arch, n_chunks)
    rows = max(n_steps, 1)  # (no zero-byte buffers)

    def rows_of(x, shape, dtype):
        out = np.zeros(shape, dtype)
        out[:n_steps] = x
        return InOut(out)

    margin = 0 if rec_margin is None else rows_of(rec_margin, rows, F32)
    outs = launch("greedy_walk_round", plan,
                  *_inputs(params, param_offsets, dims, branches, bf16,
                           z, z_stride, isv, isv_index, h2_clamp_mult, close, high, low,
                           features, costs, T, start, n_steps), n_chunks, round, span_chunks,
                  span_passes,
                  0 if span_state is None else In(np.ascontiguousarray(span_state)),
                  0 if span_brk is None else In(np.ascontiguousarray(span_brk)),
                  rows_of(trace, (rows, 3), I32), InOut(np.ascontiguousarray(ends)),
                  rows_of(rec_reward, rows, F32), rows_of(rec_held, rows, F32),
                  rows_of(rec_cost, rows, F32), margin, n_steps)
    trace2, ends2, reward, held, cost = outs[:5]
    return WalkRoundState(trace2[:n_steps], ends2, reward[:n_steps], held[:n_steps],
                          cost[:n_steps], None if rec_margin is None else outs[5][:n_steps])


def greedy_walk_chunked(params, param_offsets, dims, branches, bf16, z, z_stride, isv,
                        isv_index, h2_clamp_mult, close, high, low, features, costs, start,
                        n_steps, n_chunks, rounds) -> WalkRecord:
    """``rounds`` launches of ``greedy_walk_round`` (rounds 0 .. rounds - 1) on zeroed state
    buffers, as the evaluator runs them; the records (twin: the reference's
    ``greedy_walk_chunked``; with ``rounds >= n_chunks`` bitwise ``greedy_walk_cluster``'s)."""
    _, _, steps = validate_greedy_walk(
        params, param_offsets, dims, branches, bf16, z, z_stride, isv, isv_index, h2_clamp_mult,
        close, high, low, features, costs, start, n_steps)
    n_chunks = check_int("n_chunks", n_chunks, minimum=1)
    rounds = check_int("rounds", rounds, minimum=1)
    state = WalkRoundState(np.zeros((steps, 3), I32), np.zeros((2, n_chunks, 3), I32),
                           *(np.zeros(steps, F32) for _ in range(4)))
    for r in range(rounds):
        state = greedy_walk_round(params, param_offsets, dims, branches, bf16, z, z_stride, isv,
                                  isv_index, h2_clamp_mult, close, high, low, features, costs,
                                  start, n_steps, n_chunks, r, **NO_SPAN_BASE,
                                  **state._asdict())
    return WalkRecord(state.rec_reward, state.rec_held, state.rec_cost, state.rec_margin)


def greedy_walk_hold(params, param_offsets, dims, branches, bf16, z, z_stride, isv, isv_index,
                     h2_clamp_mult, close, high, low, features, costs, start,
                     n_steps) -> WalkRecord:
    """Test entry of the CUDA ``greedy_walk_hold`` on the test runtime's device, its rows from
    :func:`plan_greedy_walk_hold` (contract as the reference twin; bitwise
    ``greedy_walk_cluster``'s records)."""
    return _walk("greedy_walk_hold",
                 lambda d, b, bf: plan_greedy_walk_hold(d, b, bf, runtime().device.arch), params,
                 param_offsets, dims, branches, bf16, z, z_stride, isv, isv_index, h2_clamp_mult,
                 close, high, low, features, costs, start, n_steps)


def greedy_walk_spans(params, param_offsets, dims, branches, bf16, z, z_stride, isv, isv_index,
                      h2_clamp_mult, close, high, low, features, costs, start,
                      n_steps) -> WalkRecord:
    """Test entry of the CUDA ``greedy_walk_spans``: its ``SPAN_PASSES`` span launches on
    ``SPAN_CHUNKS`` clusters, then the tail on one (the span walk on its own: the evaluator
    launches rounds in place of the tail, :func:`greedy_walk_span_rounds`), on the test
    runtime's device; the records (contract as the reference twin ``greedy_walk``; bitwise
    ``greedy_walk_cluster``'s)."""
    T, start, n_steps = validate_greedy_walk(
        params, param_offsets, dims, branches, bf16, z, z_stride, isv, isv_index, h2_clamp_mult,
        close, high, low, features, costs, start, n_steps)
    span, tail, hold_rows = plan_greedy_walk_spans(dims, branches, bool(bf16),
                                                   runtime().device.arch, SPAN_CHUNKS)
    inputs = _inputs(params, param_offsets, dims, branches, bf16, z,
                     z_stride, isv, isv_index, h2_clamp_mult, close, high, low, features, costs,
                     T, start, n_steps)
    recs, _, _ = _span_launches(inputs, span, tail, hold_rows, n_steps, SPAN_PASSES + 1)
    return WalkRecord(*(r[:n_steps] for r in recs))


def _span_launches(inputs, span, tail, hold_rows, n_steps, launches) -> tuple:
    """Launches ``0 .. launches - 1`` of ``greedy_walk_spans`` (``SPAN_PASSES`` passes on
    ``SPAN_CHUNKS`` clusters, the tail after them) on zeroed buffers: ``(records, state,
    brk)``, the records ``max(n_steps, 1)`` rows each."""
    rows = max(n_steps, 1)
    state = np.zeros((2, len(SPAN_STATE)), I32)
    brk = np.zeros((2, SPAN_CHUNKS, len(SPAN_BREAK)), I32)
    recs = [np.zeros(rows, F32) for _ in range(4)]
    for p in range(launches):
        plan = span if p < SPAN_PASSES else tail
        state, brk, *recs = launch("greedy_walk_spans", plan, *inputs, SPAN_CHUNKS, SPAN_PASSES,
                                   p, hold_rows, InOut(state), InOut(brk),
                                   *(InOut(r) for r in recs), n_steps)
    return recs, state, brk


def greedy_walk_span_rounds(params, param_offsets, dims, branches, bf16, z, z_stride, isv,
                            isv_index, h2_clamp_mult, close, high, low, features, costs, start,
                            n_steps) -> WalkRecord:
    """Test entry of the evaluator's fused walk (``eval_plan.fused_ops`` on sm_90): the CUDA
    ``greedy_walk_spans``' ``SPAN_PASSES`` span launches on ``SPAN_CHUNKS`` clusters (no tail),
    then ``SPAN_ROUNDS`` launches of ``greedy_walk_round`` on ``SPAN_CHUNKS`` chunks with the
    spans' buffers as their base (:func:`plan_greedy_walk_round`), on the test runtime's device;
    the records (contract as the reference twin ``greedy_walk``; bitwise
    ``greedy_walk_cluster``'s; the reference composition is
    ``walk_rounds.greedy_walk_spans_and_rounds``)."""
    T, start, n_steps = validate_greedy_walk(
        params, param_offsets, dims, branches, bf16, z, z_stride, isv, isv_index, h2_clamp_mult,
        close, high, low, features, costs, start, n_steps)
    arch = runtime().device.arch
    span, tail, hold_rows = plan_greedy_walk_spans(dims, branches, bool(bf16), arch, SPAN_CHUNKS)
    common = (params, param_offsets, dims, branches, bf16, z, z_stride, isv, isv_index,
              h2_clamp_mult, close, high, low, features, costs, T, start, n_steps)
    recs, state, brk = _span_launches(_inputs(*common), span, tail,
                                      hold_rows, n_steps, SPAN_PASSES)
    plan = plan_greedy_walk_round(dims, branches, bool(bf16), arch, SPAN_CHUNKS)
    inputs = _inputs(*common)
    rows = max(n_steps, 1)
    trace = np.zeros((rows, 3), I32)
    ends = np.zeros((2, SPAN_CHUNKS, 3), I32)
    for r in range(SPAN_ROUNDS):
        trace, ends, *recs = launch("greedy_walk_round", plan, *inputs, SPAN_CHUNKS, r,
                                    SPAN_CHUNKS, SPAN_PASSES, In(state), In(brk), InOut(trace),
                                    InOut(ends), *(InOut(x) for x in recs), n_steps)
    return WalkRecord(*(x[:n_steps] for x in recs))


KERNELS = {"greedy_walk": greedy_walk, "greedy_walk_cluster": greedy_walk_cluster,
           "greedy_walk_hold": greedy_walk_hold, "greedy_walk_spans": greedy_walk_spans,
           "greedy_walk_span_rounds": greedy_walk_span_rounds}
