"""The live per-branch C51 support of ``DQNConfig.adaptive_atoms`` (issue 19; seed 002 slots
23-30, seed 000 Mech 2): branch d's atoms from its adaptive centre and half-width.

One kernel, ``live_support_build``, run at the start of every step (and of every act / eval
that reads Q) from the ISV at that moment; every consumer (the C51 projection, the expected Q
of the forward pass, the CQL gradient, the scalar targets, sentinel 47) reads its outputs.

Formula (float32, each operation rounded in the order written; the CUDA twin uses
``__fmul_rn`` / ``__fadd_rn`` / ``__fdiv_rn``, never a fused multiply-add). Branch d reads the
seed member ``m(d)`` of its slots (``isv.branch_slot``: SPEC branch 0 = DIR, 1 = MAG, ...):

```
bound = atom_growth_mult * fmax(ISV[Q_ABS_REF], 1)          Mech 2 (the floor on the signal)
floor = bound * 2^-10                                         (exact: a power of two)
h     = fmin(fmax(ISV[V_HALF_m], floor), bound)               (NaN half -> floor)
room  = bound - h
c     = ISV[V_CENTER_m] if finite-or-infinite else 0, then fmin(fmax(c, -room), room)
t_j   = (2 j - (NA - 1)) / (NA - 1)                           (exact integers, one division)
z_j   = c + h * t_j                                           j = 0 .. NA-1
lo, hi = z_0, z_{NA-1};  dz = (hi - lo) / (NA - 1)            (distributional.atom_spacing)
```

``t_0 = -1`` and ``t_{NA-1} = 1`` exactly. Mech 2: every atom satisfies ``|z_j| <= bound``
(up to one rounding of ``c + h``) whatever the slots hold; the producer's bound is re-applied
with the ``Q_ABS_REF`` of this moment. The seeds' three Mech 2 sites map to: the support's
producer (``atoms_update_kernel`` -> ``isv_producers.adaptive_support_update``), the learner's
per-sample support (``iql_value_kernel`` -> this kernel at the start of each step) and the
collector's act (``experience_kernels`` -> this kernel at the start of the greedy forward).
The floor keeps the support from degenerating: ``h >= bound/1024`` and ``|c| <= bound``, so
the spacing ``2 h / (NA - 1)`` exceeds 2^-19 ``bound`` (for ``NA <= 1025``), far above the
rounding of ``c + h t`` (about 2^-24 ``bound``): the atoms are strictly increasing and
``dz > 0``. With the ISV at its cold start (``isv.config_cold_starts``: centre
``(v_min + v_max)/2``, half ``(v_max - v_min)/2``) the support is ``[v_min, v_max]`` up to
rounding (the config checks ``|v| <= atom_growth_mult``).

The value stream is shared by the branches: atom ``j`` of the value logits is atom ``j`` of
every branch's combined logits, and branch d reads its combined distribution on its own
support ``z[d]`` (the seeds' per-branch support: the logits are indexed by atom, the positions
belong to the branch).

NaN/Inf contract: a NaN centre counts as 0 and a NaN half-width as the floor, infinite ones
are clamped (``+/-room``, ``bound``); a NaN or -Inf ``Q_ABS_REF`` counts as 1 (``fmax``). So
the outputs are finite whenever ``bound`` is; a ``Q_ABS_REF`` of +Inf (or one whose bound
overflows float32) gives a non-finite support, which sentinel 47 (``atom_span_max``) flags.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from foxhunt.reference import isv as isv_mod
from foxhunt.reference.kernels.argcheck import require_array, require_shape

F32 = np.dtype(np.float32)
#: ``floor = bound * HALF_FLOOR_FRACTION`` (2^-10, exact in float32).
HALF_FLOOR_FRACTION = np.float32(2.0 ** -10)
#: The columns of ``LiveSupport.bounds``: branch d's ``(v_min_d, v_max_d, dz_d)``.
BOUNDS_COLUMNS = ("v_min", "v_max", "dz")


class LiveSupport(NamedTuple):
    """Outputs of ``live_support_build``: ``z [D, NA]`` (branch d's atoms) and ``bounds [D, 3]``
    (``BOUNDS_COLUMNS``: the projection's clip range and spacing of branch d)."""

    z: np.ndarray
    bounds: np.ndarray


def branch_members(n_branches: int) -> tuple[int, ...]:
    """The seed-member offset (DIR 0, MAG 1, ORD 2, URG 3) of each SPEC branch: branch d reads
    ``V_CENTER_INDICES[m]`` / ``V_HALF_INDICES[m]`` with ``m = branch_members(D)[d]``."""
    if not 1 <= n_branches <= isv_mod.MAX_ISV_BRANCHES:
        raise ValueError(f"n_branches: {n_branches!r}; allowed 1..{isv_mod.MAX_ISV_BRANCHES} "
                         "(the ISV's per-branch support slots)")
    return tuple(isv_mod.branch_slot("V_CENTER", d).index - isv_mod.V_CENTER_INDICES[0]
                 for d in range(n_branches))


def validate_live_support_build(isv, n_branches, num_atoms, atom_growth_mult) -> np.float32:
    """The argument checks of ``live_support_build``; returns ``atom_growth_mult`` in float32."""
    require_array("isv", isv, F32, ndim=1)
    require_shape("isv", isv, (isv_mod.ISV_LEN,), "[ISV_LEN]")
    branch_members(n_branches)
    if isinstance(num_atoms, bool) or not isinstance(num_atoms, (int, np.integer)) \
            or not 2 <= num_atoms <= 1025:
        raise ValueError(f"num_atoms: {num_atoms!r}; allowed an int in [2, 1025] (the floor's "
                         "spacing argument)")
    k2 = np.float32(atom_growth_mult)
    if not (np.isfinite(k2) and k2 > 0):
        raise ValueError(f"atom_growth_mult: {atom_growth_mult!r}; allowed a finite float32 > 0")
    return k2


def live_support_build(isv: np.ndarray, n_branches: int, num_atoms: int,
                       atom_growth_mult) -> LiveSupport:
    """Branch d's live support from ISV slots 23-30 under Mech 2 (module docstring: the formula,
    the floor and the NaN contract). Shapes: ``isv [ISV_LEN]`` float32; returns ``LiveSupport(z
    [n_branches, NA], bounds [n_branches, 3])`` float32."""
    k2 = validate_live_support_build(isv, n_branches, num_atoms, atom_growth_mult)
    one = np.float32(1.0)
    with np.errstate(over="ignore", invalid="ignore"):
        bound = np.float32(k2 * np.fmax(isv[isv_mod.Q_ABS_REF_INDEX], one))
        floor = np.float32(bound * HALF_FLOOR_FRACTION)
        span = np.float32(num_atoms - 1)
        t = ((2 * np.arange(num_atoms) - (num_atoms - 1)).astype(F32) / span).astype(F32)
        z = np.zeros((n_branches, num_atoms), F32)
        bounds = np.zeros((n_branches, 3), F32)
        for d, m in enumerate(branch_members(n_branches)):
            half = np.fmin(np.fmax(isv[isv_mod.V_HALF_INDICES[m]], floor), bound)
            room = np.float32(bound - half)
            centre = isv[isv_mod.V_CENTER_INDICES[m]]
            centre = np.float32(0.0) if np.isnan(centre) else centre
            centre = np.fmin(np.fmax(centre, -room), room)
            z[d] = (centre + (half * t).astype(F32)).astype(F32)
            lo, hi = z[d, 0], z[d, -1]
            bounds[d] = (lo, hi, np.float32(np.float32(hi - lo) / span))
    return LiveSupport(z=z, bounds=bounds)


KERNELS = {"live_support_build": live_support_build}

__all__ = ["BOUNDS_COLUMNS", "HALF_FLOOR_FRACTION", "KERNELS", "LiveSupport", "branch_members",
           "live_support_build", "validate_live_support_build"]
