"""Entry of the live per-branch C51 support (``live_support_build``, ``DQNConfig.adaptive_atoms``):
the same float32 operations in both backends, so every output is exact."""

from __future__ import annotations

from foxhunt.conformance.kernel_spec import Dims, Kwargs, SpecEntry
from foxhunt.conformance.specs.inputs import (
    F32,
    error_cases,
    f32,
    isv_vector,
    replace,
    wrong_dtype,
)
from foxhunt.conformance.tolerance import EXACT


def _s_live_support(d: Dims, rng) -> Kwargs:
    """A randomised ISV with the support slots spread over the regimes of the formula: inside
    Mech 2's bound, a centre pushed to the bound, a half-width below the floor or above the
    bound (the bound is ``atom_growth_mult * max(Q_ABS_REF, 1)``)."""
    from foxhunt.reference import isv as reg

    vec = isv_vector(rng)
    vec[reg.Q_ABS_REF_INDEX] = F32(rng.uniform(0, 3))
    for k in range(reg.MAX_ISV_BRANCHES):
        vec[reg.V_CENTER_INDICES[k]] = F32(rng.choice([-1.0, 1.0]) * rng.uniform(0, 30))
        vec[reg.V_HALF_INDICES[k]] = F32(rng.choice([1e-4, 1.0, 1e3]) * rng.uniform(0.1, 20))
    return {"isv": vec, "n_branches": int(min(d.actions, reg.MAX_ISV_BRANCHES)),
            "num_atoms": d.atoms, "atom_growth_mult": float(rng.choice([5.0, 100.0]))}


ENTRIES: tuple[SpecEntry, ...] = (
    SpecEntry(
        name="live_support_build",
        outputs={"z": f32(EXACT), "bounds": f32(EXACT)},
        sample=_s_live_support,
        targets=("isv",),
        errors=error_cases(
            _s_live_support,
            lambda k: replace(k, isv=k["isv"][:-1]),
            lambda k: wrong_dtype(k, "isv"),
            lambda k: replace(k, n_branches=5),
            lambda k: replace(k, num_atoms=1),
            lambda k: replace(k, atom_growth_mult=0.0),
        ),
    ),
)
