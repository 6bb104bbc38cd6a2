"""Launch plans of the kernels that run on a thread-block cluster (``cuda_src/cluster.cuh``):
``ens_kl_grad`` and ``iqn_quantile_huber``. CPU-only: the plans are arithmetic on the sizes; the
kernels themselves are checked by conformance on the GPU."""

from __future__ import annotations

import pytest

from foxhunt.fast.kernels._runtime import CLUSTER_SM90, cluster_blocks
from foxhunt.fast.kernels.ensemble import ENS_SMEM_FLOATS, ens_tile, plan_ens_kl_grad
from foxhunt.fast.kernels.iqn import IQN_LOSS_THREADS, IQN_RHO_FLOATS, plan_iqn_quantile_huber


@pytest.mark.parametrize("arch,blocks", [("sm_80", 1), ("sm_86", 1), ("sm_90", CLUSTER_SM90),
                                         (100, CLUSTER_SM90)])
def test_a_cluster_has_eight_blocks_from_sm90_and_one_before(arch, blocks):
    assert cluster_blocks(arch) == blocks


def test_ens_kl_grad_plan_takes_the_largest_block_and_checks_its_tile():
    """The block size (the loss's reduction tree) is CUDA's largest, whatever the batch; the tile is
    ``ENS_SMEM_FLOATS // ((1 + P) (2 NA + 3))`` samples (36 for the seed's 51 atoms and 2
    priors), and an atom count whose single sample does not fit is refused by name."""
    assert plan_ens_kl_grad(256, 51, 2, "sm_90") == (CLUSTER_SM90, 1024, 0)
    assert plan_ens_kl_grad(5, 11, 2, "sm_80") == (1, 1024, 0)
    assert ens_tile(51, 2) == ENS_SMEM_FLOATS // (3 * 105) == 36
    too_many = ENS_SMEM_FLOATS // 6  # (1 + 2) * (2 * NA + 3) > ENS_SMEM_FLOATS
    with pytest.raises(ValueError, match=rf"ens_kl_grad: num_atoms={too_many} with n_priors=2"):
        plan_ens_kl_grad(256, too_many, 2, "sm_90")


@pytest.mark.parametrize("pairs,n,arch", [(768, 8, "sm_90"), (771, 37, "sm_90"), (15, 5, "sm_80"),
                                          (1, 1, "sm_90")])
def test_iqn_quantile_huber_plan_holds_a_blocks_terms_and_one_rho_tile(pairs, n, arch):
    c = cluster_blocks(arch)
    grid, block, smem = plan_iqn_quantile_huber(pairs, n, arch)
    tile = max(1, IQN_RHO_FLOATS // (n * n))
    assert (grid, block) == (c, IQN_LOSS_THREADS)
    assert smem == 4 * (-(-pairs // c) + tile * n * n)
