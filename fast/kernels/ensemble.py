"""Fast launcher of the ensemble-diversity kernel (``cuda_src/ensemble.cu``), twin of
``foxhunt.reference.kernels.ensemble.ens_kl_grad`` under the same name and signature.

Kernel parameters (C order): ``ens_kl_grad(v, priors, d_v, kl, loss, batch, num_atoms,
n_priors, eps)``: ONE block, one thread per sample (the loss is a block reduction); ``priors``
is ``[n_priors, batch, num_atoms]`` (the prior heads' logits, stacked); ``loss`` points at one
float (the step binds it to its readback entry).

Numerics: ``expf``/``logf`` against NumPy's float32 ``exp``/``log``, the sums in the
reference's order; the loss is a block-tree sum (reduction).
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.kernels._runtime import In, Out, launch
from foxhunt.fast.kernels.aux import plan_one_block
from foxhunt.reference.kernels.ensemble import EnsKlGrad, validate_ens_kl_grad

F32 = np.float32

plan_ens_kl_grad = plan_one_block


def ens_kl_grad(v, priors, eps) -> EnsKlGrad:
    """Test entry of the CUDA ``ens_kl_grad`` (contract as the reference twin)."""
    eps32 = validate_ens_kl_grad(v, priors, eps)
    n_priors, batch, num_atoms = priors.shape
    d_v, kl, loss = launch("ens_kl_grad", plan_ens_kl_grad(batch), In(v), In(priors),
                           Out(v.shape, F32), Out((batch,), F32), Out((1,), F32), batch, num_atoms,
                           n_priors, eps32)
    return EnsKlGrad(d_v, kl, F32(loss[0]))


KERNELS = {
    "ens_kl_grad": ens_kl_grad,
}
