"""Fast ``live_support_build`` (``cuda_src/distributional.cu``): the live per-branch C51
support of ``DQNConfig.adaptive_atoms`` (the formula: ``foxhunt.reference.kernels.live_support``).
A launch plan and a numpy-in/numpy-out test entry with the reference's signature and checks."""

from __future__ import annotations

import numpy as np

from foxhunt.fast.kernels._runtime import In, Out, blocks, call
from foxhunt.reference import isv as isv_mod
from foxhunt.reference.kernels.live_support import (
    F32,
    LiveSupport,
    branch_members,
    validate_live_support_build,
)

Plan = tuple[int, int, int]  # (grid, block, dynamic shared-memory bytes)
WARP = 32
THREADS = 256


def plan_live_support_build(n_branches: int, num_atoms: int) -> Plan:
    """One block per branch, one thread per atom (whole warps, at most ``THREADS``)."""
    return max(1, n_branches), min(THREADS, WARP * blocks(num_atoms, WARP)), 0


def live_support_build(isv: np.ndarray, n_branches: int, num_atoms: int,
                       atom_growth_mult) -> LiveSupport:
    """Fast ``live_support_build``: ``LiveSupport(z [D, NA], bounds [D, 3])`` (exact: the same
    float32 operations as the reference, correctly rounded)."""
    k2 = validate_live_support_build(isv, n_branches, num_atoms, atom_growth_mult)
    members = np.array(branch_members(n_branches), np.int32)
    grid, block, shared = plan_live_support_build(n_branches, num_atoms)
    z, bounds = call("live_support_build", grid, block, In(isv), In(members),
                     Out((n_branches, num_atoms), F32), Out((n_branches, 3), F32), n_branches,
                     num_atoms, isv_mod.Q_ABS_REF_INDEX, isv_mod.V_CENTER_INDICES[0],
                     isv_mod.V_HALF_INDICES[0], k2, shared_mem=shared)
    return LiveSupport(z=z, bounds=bounds)


KERNELS = {"live_support_build": live_support_build}

__all__ = ["KERNELS", "live_support_build", "plan_live_support_build"]
