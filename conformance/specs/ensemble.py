"""Entry of the ensemble-diversity kernel ``ens_kl_grad``: head 0's logits against K - 1 = 2
prior heads (the contract's K = 3).

Tolerances: ``expf``/``logf`` against NumPy's float32 functions, the sums in the same order:
each output is judged as a reduction over the ``P * NA`` softmax terms it depends on (a few ulp
per term), relative to the largest term; the loss also sums the ``B`` samples (block tree).
"""

from __future__ import annotations

import numpy as np

from foxhunt.conformance.kernel_spec import Dims, Kwargs, SpecEntry
from foxhunt.conformance.specs.inputs import (
    error_cases,
    f32,
    normal,
    reduction,
    replace,
    wrong_dtype,
)
from foxhunt.conformance.tolerance import REDUCTION
from foxhunt.reference.kernels.ensemble import ENS_SOFTMAX_EPS

#: Prior heads in the samples (K - 1 with the contract's default K = 3).
N_PRIORS = 2


def _s_ens(d: Dims, rng) -> Kwargs:
    """The odd case has 3 x 257 samples: on a cluster of 8 blocks each block's 97 samples take
    three shared-memory tiles (at most 36 samples of 51 atoms each; fast/kernels/ensemble.py)."""
    batch = 3 * d.batch if d.case == "odd" else d.batch
    return {"v": normal(rng, (batch, d.atoms), 2.0),
            "priors": normal(rng, (N_PRIORS, batch, d.atoms), 2.0), "eps": ENS_SOFTMAX_EPS}


def _log_softmax64(x: np.ndarray) -> np.ndarray:
    """float64 log-softmax over the last axis (non-finite rows give NaN)."""
    x = x.astype(np.float64)
    with np.errstate(all="ignore"):
        m = np.max(x, axis=-1, keepdims=True)
        return x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


def _sc_ens(kwargs, expected):
    """Sizes from a float64 evaluation: ``d_v``'s terms are probabilities times ``scale``; ``kl``'s
    are ``p_k (log p_k - log p_0)``; the loss sums ``B`` of those rows times ``scale``."""
    v, priors = kwargs["v"], kwargs["priors"]
    n_priors, batch, num_atoms = priors.shape
    scale = 1.0 / (batch * n_priors)
    lp0, lpk = _log_softmax64(v), _log_softmax64(priors)
    with np.errstate(all="ignore"):
        terms = np.exp(lpk) * (lpk - lp0[np.newaxis])
    finite = terms[np.isfinite(terms)]
    term = max(float(np.abs(finite).max()) if finite.size else 0.0, 1.0)
    length = n_priors * num_atoms
    return {"d_v": reduction(length, scale), "kl": reduction(length, term),
            "loss": reduction(length * batch, scale * term)}


ENTRIES: tuple[SpecEntry, ...] = (
    SpecEntry(
        name="ens_kl_grad",
        outputs={"d_v": f32(REDUCTION), "kl": f32(REDUCTION), "loss": f32(REDUCTION)},
        sample=_s_ens,
        targets=("v", "priors"),
        errors=error_cases(
            _s_ens,
            lambda k: wrong_dtype(k, "v"),
            lambda k: replace(k, priors=k["priors"][:, :-1]),
            lambda k: replace(k, priors=k["priors"][:0]),
            lambda k: replace(k, eps=0.0),
        ),
        scales=_sc_ens,
    ),
)
