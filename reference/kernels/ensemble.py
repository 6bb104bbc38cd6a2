"""Reference kernel of the ensemble-diversity source (SPEC 4, second wave;
``cuda_src/ensemble.cu``): the KL diversity loss between the value stream's logits (head 0)
and the frozen randomized prior heads, and its gradient on head 0's logits.

The prior heads' forward passes (``v_k = W_e{k}2 relu(W_e{k}1 h2 + b_e{k}1) + b_e{k}2``) are the
existing dense GEMMs and ``add_bias_relu``; the backward of ``d_v`` through the value head and
the trunk is the network's own (``foxhunt.reference.aux_heads``). This kernel sits between them.

All arithmetic is float32 in the order of the docstring; ``exp``/``log`` are NumPy's float32
functions here and CUDA's ``expf``/``logf`` there, and the loss is a block-tree sum there
(conformance: reduction tolerances).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from foxhunt.reference.kernels.argcheck import check_f32_scalar, ieee, require_array
from foxhunt.reference.kernels.aux import softmax_shifted

F32 = np.dtype(np.float32)

#: Floor of the softmax divisors (the seeds' ``sum + 1e-8f``): ``s < eps ? eps : s``. A finite
#: max-shifted row sums to at least 1, so the floor never binds there; a NaN sum stays NaN.
ENS_SOFTMAX_EPS = np.float32(1e-8)


def validate_ens_kl_grad(v, priors, eps) -> np.float32:
    """The argument checks of ``ens_kl_grad``; returns ``eps`` as float32."""
    require_array("v", v, F32, ndim=2)
    require_array("priors", priors, F32, ndim=3)
    if priors.shape[0] < 1 or priors.shape[1:] != v.shape or v.shape[0] < 1 or v.shape[1] < 1:
        raise ValueError(f"priors: shape {priors.shape}; expected [K - 1, B, NA] with K - 1 >= 1 "
                         f"prior heads and [B, NA] = v.shape = {v.shape} (B, NA >= 1)")
    return check_f32_scalar("eps", eps, lo=0.0, lo_open=True)


class EnsKlGrad(NamedTuple):
    """Outputs of ``ens_kl_grad``: ``d_v [B, NA]``, ``kl [B]`` (each sample's KL summed over the
    prior heads) and the loss (float32)."""

    d_v: np.ndarray
    kl: np.ndarray
    loss: np.float32


def _softmax_log(x: np.ndarray, eps: np.float32) -> tuple[np.ndarray, np.ndarray]:
    """``(p, log p)`` of every row, with the divisor ``sg = s < eps ? eps : s``:
    ``p = e / sg``, ``log p = shifted - log(sg)`` (``softmax_shifted``'s pieces)."""
    shifted, e, s = softmax_shifted(x)
    sg = np.where(s < eps, eps, s).astype(F32)  # NaN < eps is false: a NaN sum stays NaN
    return (e / sg[..., np.newaxis]).astype(F32), (shifted - np.log(sg)[..., np.newaxis]).astype(F32)


@ieee
def ens_kl_grad(v: np.ndarray, priors: np.ndarray, eps) -> EnsKlGrad:
    """KL diversity of head 0 (``v``, the value stream's logits) from the ``P = K - 1`` prior
    heads, and its gradient on ``v``:

    - per row, ``p = e / sg`` and ``log p = (x - m) - log(sg)`` (max-shifted, ``sg = s < eps ?
      eps : s``) for ``p_0 = softmax(v)`` and each ``p_k = softmax(priors[k - 1])``;
    - ``KL_k[b] = ((0 + p_k[b, 0] * (log p_k[b, 0] - log p_0[b, 0])) + ...)`` (atom order);
      ``kl[b] = (0 + KL_1[b]) + KL_2[b] + ...`` (head order);
    - ``scale = 1 / (B * P)`` (rounded once); ``loss = -(scale * sum_b kl[b])`` (the diversity
      loss ``-(1/(B (K-1))) sum_b sum_k KL(p_k || p_0)``: descending it pushes head 0 away from
      the priors);
    - ``d_v[b, j] = scale * ((0 + (p_1[b, j] - p_0[b, j])) + (p_2[b, j] - p_0[b, j]) + ...)``
      (the loss's exact gradient: ``d(-KL(p_k || softmax(v))) / dv = p_k - p_0``).

    Shapes: ``v [B, NA]`` float32, ``priors [P, B, NA]`` float32 (P >= 1), ``eps`` > 0. Returns
    ``EnsKlGrad(d_v [B, NA], kl [B], loss)`` float32. The priors are constants (frozen heads):
    no gradient flows to them.
    NaN/Inf contract, per sample: a NaN or ``+Inf`` logit, or a row of ``-Inf``, in ``v[b]`` or
    any ``priors[k, b]`` makes ``d_v[b]`` and ``kl[b]`` NaN (hence the loss); a ``-Inf`` logit
    in an otherwise finite row has probability 0 (``p = 0`` times a finite log gives 0; a prior
    with mass where ``p_0 = 0`` gives ``kl = +Inf``).
    """
    eps32 = validate_ens_kl_grad(v, priors, eps)
    n_priors, batch, num_atoms = priors.shape
    p0, logp0 = _softmax_log(v, eps32)
    scale = np.float32(1) / np.float32(batch * n_priors)
    kl = np.zeros(batch, F32)
    acc = np.zeros((batch, num_atoms), F32)
    for k in range(n_priors):
        pk, logpk = _softmax_log(priors[k], eps32)
        term = (pk * (logpk - logp0)).astype(F32)
        kl_k = np.zeros(batch, F32)
        for j in range(num_atoms):
            kl_k = (kl_k + term[:, j]).astype(F32)
        kl = (kl + kl_k).astype(F32)
        acc = (acc + (pk - p0)).astype(F32)
    loss = np.float32(-(scale * np.sum(kl, dtype=F32)))
    return EnsKlGrad((scale * acc).astype(F32), kl, loss)


KERNELS = {
    "ens_kl_grad": ens_kl_grad,
}
