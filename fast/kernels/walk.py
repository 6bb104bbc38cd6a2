"""Fast launcher of ``cuda_src/walk.cu``'s ``greedy_walk`` (twin:
``foxhunt.reference.kernels.walk``, same name and signature).

``greedy_walk(...)`` is the numpy-in/numpy-out test entry: it validates with the reference's
``validate_greedy_walk`` (same ``ValueError``), builds the BF16 mirror of ``params`` with the
``f32_to_bf16`` kernel (the trainer's mirror is made the same way), launches ONE block and
returns the reference's ``WalkRecord``. The evaluator's fused mode (``fast.eval_plan``)
launches the same kernel on arena buffers with :func:`plan_greedy_walk` (every parameter by its
name in walk.cu: ``params, params_bf16, param_offsets, bf16, state_dim, h1, h2, value_h,
adv_h, num_atoms, n_branches, n_actions, action_offset, z, isv, isv_index, h2_clamp_mult,
close, high, low, features, n_features, costs, n_bars, start, n_steps, rec_reward, rec_held,
rec_cost, rec_margin, record_len``; ``rec_margin`` may be null, ``params_bf16`` too when
``bf16`` is 0).
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.kernels._runtime import In, Out, device_scalar, launch
from foxhunt.fast.kernels.dense import f32_to_bf16
from foxhunt.reference.kernels.fused import branch_offsets
from foxhunt.reference.kernels.walk import WalkRecord, validate_greedy_walk

F32, I32 = np.float32, np.int32

#: Threads of the one block (WALK_THREADS in walk.cu) and its warps.
WALK_THREADS = 1024
WALK_WARPS = WALK_THREADS // 32
#: Dynamic shared memory a launch may ask for without the opt-in attribute.
SHARED_LIMIT = 48 * 1024


def walk_shared_floats(dims, branches) -> int:
    """walk.cu's shared layout: x, h1, h2, the heads' hidden rows, their outputs (v and every
    branch's adv), q, and two scratch rows of ``num_atoms`` per warp."""
    sd, h1, h2, value_h, adv_h, na = (int(d) for d in dims)
    nb, a_total = len(branches), sum(int(n) for n in branches)
    return sd + h1 + h2 + value_h + nb * adv_h + na * (1 + a_total) + a_total + 2 * WALK_WARPS * na


def plan_greedy_walk(dims, branches) -> tuple:
    """ONE block of ``WALK_THREADS``; dynamic shared memory :func:`walk_shared_floats` floats
    (``ValueError`` past ``SHARED_LIMIT``: a network that large needs the cluster version).
    Seed shapes: 19.5 KiB."""
    nbytes = 4 * walk_shared_floats(dims, branches)
    if nbytes > SHARED_LIMIT:
        raise ValueError(f"dims={tuple(dims)!r}, branches={tuple(branches)!r}: greedy_walk needs "
                         f"{nbytes} bytes of shared memory; at most {SHARED_LIMIT} are allowed")
    return (1,), (WALK_THREADS,), nbytes


def greedy_walk(params, param_offsets, dims, branches, bf16, z, isv, isv_index, h2_clamp_mult,
                close, high, low, features, costs, start, n_steps) -> WalkRecord:
    """Test entry of the CUDA ``greedy_walk`` (contract as the reference twin)."""
    T, start, n_steps = validate_greedy_walk(
        params, param_offsets, dims, branches, bf16, z, isv, isv_index, h2_clamp_mult, close,
        high, low, features, costs, start, n_steps)
    branches = tuple(int(n) for n in branches)
    sd, h1, h2, value_h, adv_h, na = (int(d) for d in dims)
    mirror = In(f32_to_bf16(params)) if bf16 else 0
    rows = max(n_steps, 1)
    outs = launch("greedy_walk", plan_greedy_walk(dims, branches), In(params), mirror,
                  In(param_offsets), int(bool(bf16)), sd, h1, h2, value_h, adv_h, na,
                  len(branches), In(np.array(branches, I32)),
                  In(np.array(branch_offsets(branches), I32)), In(z), In(isv), int(isv_index),
                  np.float32(h2_clamp_mult), In(close), In(high), In(low), In(features),
                  features.shape[1], In(costs), T, device_scalar(start, I32),
                  device_scalar(n_steps, I32), Out((rows,), F32), Out((rows,), F32),
                  Out((rows,), F32), Out((rows,), F32), n_steps)
    return WalkRecord(*(o[:n_steps] for o in outs))


KERNELS = {"greedy_walk": greedy_walk}
