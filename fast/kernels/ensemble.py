"""Fast launcher of the ensemble-diversity kernel (``cuda_src/ensemble.cu``), twin of
``foxhunt.reference.kernels.ensemble.ens_kl_grad`` under the same name and signature.

Kernel parameters (C order): ``ens_kl_grad(v, priors, d_v, kl, loss, batch, num_atoms,
n_priors, eps)``: ONE thread-block cluster (``cluster_blocks``: 8 blocks on sm_90, else 1),
each block a share of the samples, one warp per sample in its own shared-memory slot (the
loss is block 0's block reduction after the cluster barrier); ``priors`` is ``[n_priors, batch,
num_atoms]`` (the prior heads' logits, stacked); ``loss`` points at one float (the step binds it
to its readback entry).

Numerics: ``expf``/``logf`` against NumPy's float32 functions, the sums in the reference's
order (the same bits on any cluster size); the loss is a block-tree sum (reduction).
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.kernels._runtime import In, Out, cluster_blocks, launch
from foxhunt.fast.kernels.aux import AUX_MAX_THREADS
from foxhunt.reference.kernels.ensemble import EnsKlGrad, validate_ens_kl_grad

F32 = np.float32

#: Threads of each block of ``ens_kl_grad``: CUDA's largest block (``REDUCE_MAX_THREADS``).
ENS_THREADS = AUX_MAX_THREADS
#: Shared floats of a block (``ENS_SMEM_FLOATS`` in ensemble.cu), in one-sample slots of
#: ``(1 + n_priors) * (2 * num_atoms + 3)`` floats (one per working warp; the kernel pads the
#: rows to 4 floats where the padded slot still fits).
ENS_SMEM_FLOATS = 11520


def ens_tile(num_atoms: int, n_priors: int) -> int:
    """Sample slots of a block's shared memory, unpadded (the kernel uses ``min(warps, slots)``
    warps, one sample each at a time); raises where one sample does not fit."""
    per_sample = (1 + int(n_priors)) * (2 * int(num_atoms) + 3)
    if per_sample > ENS_SMEM_FLOATS:
        raise ValueError(f"ens_kl_grad: num_atoms={num_atoms} with n_priors={n_priors} needs "
                         f"{per_sample} shared floats per sample; at most {ENS_SMEM_FLOATS} fit "
                         "(allowed: (1 + n_priors) * (2 * num_atoms + 3) <= that)")
    return ENS_SMEM_FLOATS // per_sample


def plan_ens_kl_grad(batch: int, num_atoms: int, n_priors: int, arch=None):
    """One cluster (``arch`` as ``cluster_blocks``) of ``ENS_THREADS``-thread blocks (the loss's
    reduction tree is fixed); checks that a sample's slot fits.

    Why the largest block: a block's warps each take one sample at a time (32 samples in
    flight per block; the seed's 256 samples are one per warp of the cluster), synchronising
    with ``__syncwarp`` only, so they hide each other's latency."""
    ens_tile(num_atoms, n_priors)
    return cluster_blocks(arch), ENS_THREADS, 0


def ens_kl_grad(v, priors, eps) -> EnsKlGrad:
    """Test entry of the CUDA ``ens_kl_grad`` (contract as the reference twin)."""
    eps32 = validate_ens_kl_grad(v, priors, eps)
    n_priors, batch, num_atoms = priors.shape
    d_v, kl, loss = launch("ens_kl_grad", plan_ens_kl_grad(batch, num_atoms, n_priors), In(v),
                           In(priors), Out(v.shape, F32), Out((batch,), F32), Out((1,), F32),
                           batch, num_atoms, n_priors, eps32)
    return EnsKlGrad(d_v, kl, F32(loss[0]))


KERNELS = {
    "ens_kl_grad": ens_kl_grad,
}
