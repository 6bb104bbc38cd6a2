"""``fast.population_plan.align_members``: members' step plans (built by the CPU executor, as a
single trainer of each member's config and seed would run them) are one plan but for kernel
scalars; the launches whose scalars differ are found with every member's values, and each packs
into a member scalar block (``member_build``); a structural difference is refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from foxhunt.reference.kernels import rng as ref_rng
from foxhunt.fast.cpu_executor import CpuEngine
from foxhunt.fast.cuda_parse import package_kernels
from foxhunt.fast.graph2_plan import scalars_beside_adam
from foxhunt.fast.member_build import SCALAR_DTYPES, SCALAR_SLOT_BYTES, member_scalar_block, scalar_params
from foxhunt.fast.population_plan import PopulationPlanError, align_members
from foxhunt.reference.config import DQNConfig, source_overrides

F32 = np.float32
BASE = DQNConfig.preset("tiny", **source_overrides("all"))  # every second-wave source on


def _plans(config: DQNConfig, seed: int) -> dict:
    p = CpuEngine(config, seed=seed).plans
    return {"upload": p["upload"][0], "graph1": p["graph1"], "graph2": p["graph2"]}


def _differing(found) -> set[tuple[str, str, tuple[str, ...]]]:
    return {(f.graph, f.kernel, f.differ) for f in found}


def test_identical_members_have_no_member_scalars():
    assert align_members([_plans(BASE, 3), _plans(BASE, 3), _plans(BASE, 3)]) == []


def test_members_that_differ_in_lr_differ_in_the_adam_launches_only():
    lrs = (1e-4, 3e-4, 2.5e-5)
    found = align_members([_plans(BASE.replace(lr=lr), 0) for lr in lrs])
    # every source on (IQN injected): both Adams are adam_update where step_scalars ends graph 1;
    # the main one is adam_update_norm where it runs beside them (scalars_beside_adam)
    adams = {"adam_update"} | ({"adam_update_norm"} if scalars_beside_adam(BASE) else set())
    assert found and _differing(found) == {("graph2", a, ("lr",)) for a in adams}
    for f in found:
        assert [v["lr"] for v in f.values] == [F32(lr) for lr in lrs]
        assert all(isinstance(v["lr"], np.float32) for v in f.values)


def test_members_that_differ_in_seed_differ_in_the_iqn_key_only():
    """The seed draws the IQN quantile fractions' key (a launch argument): one launch per pass."""
    seeds = (0, 1, 2**40 + 5)
    found = align_members([_plans(BASE, s) for s in seeds])
    assert {(f.graph, f.kernel) for f in found} == {("graph1", "iqn_tau_cos")} and len(found) == 2
    for f in found:
        keys = [ref_rng.split_u64("seed", s) for s in seeds]
        assert [(v["key_lo"], v["key_hi"]) for v in f.values] == keys
        assert set(f.differ) == {"key_lo", "key_hi"}  # 2**40 + 5 has high bits


def test_members_that_differ_in_tau_and_the_loss_weights():
    other = BASE.replace(tau=0.01, lambda_iqn=0.5, ens_weight=0.2, aux_next_bar_weight=0.3)
    found = align_members([_plans(BASE, 0), _plans(other, 0)])
    by_kernel = {f.kernel: f for f in found}
    assert by_kernel["polyak_update_mirror_check"].differ == ("tau",)
    assert by_kernel["polyak_update_mirror_check"].values[1]["tau"] == F32(0.01)
    assert by_kernel["aux_next_bar_loss_grad"].values[1]["weight"] == F32(0.3)
    assert set(by_kernel["clip_saxpy_norm_partial_wave"].differ) == {"iqn_a", "ens_a"}
    assert set(by_kernel) == {"polyak_update_mirror_check", "aux_next_bar_loss_grad",
                              "clip_saxpy_norm_partial_wave"}


def test_every_member_scalar_launch_packs_into_scalar_blocks():
    """Each member's values fill the launch's scalar block; the slot of a differing parameter
    reads back that member's value."""
    configs = [BASE, BASE.replace(lr=3e-4, tau=0.01, lambda_iqn=0.5)]
    found = align_members([_plans(c, s) for c, s in zip(configs, (0, 7))])
    assert found
    kernels = package_kernels()
    for f in found:
        params = kernels[f.kernel].params
        names = [n for _, n in scalar_params(params)]
        for values in f.values:
            block = member_scalar_block(params, values)
            for name in f.differ:
                j = names.index(name)
                dtype = np.dtype(SCALAR_DTYPES[dict((n, t) for t, n in params)[name]])
                got = block[SCALAR_SLOT_BYTES * j:SCALAR_SLOT_BYTES * j + dtype.itemsize].view(dtype)[0]
                assert got == values[name], (f.kernel, name)


def test_a_structural_difference_is_refused_by_name():
    core = DQNConfig.preset("tiny", **source_overrides("core"))
    with pytest.raises(PopulationPlanError, match=r"^upload, record 0: the copy differs between "
                       r"member 0 \(copy htod \d+ bytes host:staging0 -> batch\) and member 1"):
        align_members([_plans(BASE, 0), _plans(core, 0)])
    with pytest.raises(PopulationPlanError, match=r"member 1's graphs \['graph1'\] are not member 0's"):
        align_members([{"graph1": _plans(BASE, 0)["graph1"], "graph2": _plans(BASE, 0)["graph2"]},
                       {"graph1": _plans(BASE, 0)["graph1"]}])
    with pytest.raises(ValueError, match="at least one member"):
        align_members([])


@pytest.mark.parametrize("grid_x, members, resident, sms, expected", [
    (4096, 64, 8, 132, 64),   # the plan's blocks shared: ceil(4096 / 64)
    (100, 64, 8, 132, 16),    # a member's whole share of one wave: floor(132 * 8 / 64)
    (10, 64, 8, 132, 10),     # never more than the plan's grid
    (300, 16, 2, 132, 19),    # two resident blocks per SM: floor(264 / 16) = 16 < ceil(300 / 16)
    (100, 16, 5, 132, 41),    # five resident blocks (registers): floor(660 / 16)
    (640, 1, 8, 132, 640),    # one member keeps its plan
    (3, 200, 1, 2, 1),        # at least one block per member
])
def test_shared_grid_x_shares_the_plan_but_keeps_a_full_wave(grid_x, members, resident, sms,
                                                             expected):
    from foxhunt.fast.population_engine import shared_grid_x

    assert shared_grid_x(grid_x, members, resident, sms) == expected
    # the members' blocks fit one wave whenever the plan's share does
    if -(-grid_x // members) * members <= sms * resident:
        assert expected * members <= max(sms * resident, members)


def test_shared_grid_x_counts_the_plans_grid_y_in_the_wave():
    from foxhunt.fast.population_engine import shared_grid_x

    # 3 rows of blocks per member: a member's share of the 1,056-block wave is 1056 // (16 * 3)
    assert shared_grid_x(100, 16, 8, 132, 3) == 22
    assert shared_grid_x(100, 16, 8, 132) == 66


def test_grid_shared_kernels_are_kernels_of_cuda_src():
    from foxhunt.fast.population_engine import GRID_SHARED_KERNELS

    kernels = package_kernels()
    missing = sorted(set(GRID_SHARED_KERNELS) - set(kernels))
    assert not missing, f"not kernels of cuda_src: {missing}"


def test_population_block_threads_name_kernels_and_keep_one_member_on_its_plan():
    from foxhunt.fast.kernels.spectral import SPECTRAL_TREE_THREADS
    from foxhunt.fast.population_engine import POPULATION_BLOCK_THREADS, population_block

    kernels = package_kernels()
    assert set(POPULATION_BLOCK_THREADS) <= set(kernels)
    threads = POPULATION_BLOCK_THREADS["batched_spectral_norm"][0]
    # a power of two the spectral kernels' trees replay (cuda_src/spectral.cu's header)
    assert 32 <= threads <= SPECTRAL_TREE_THREADS and threads & (threads - 1) == 0
    assert population_block("batched_spectral_norm", (512, 1, 1), 1) == (512, 1, 1)
    assert population_block("batched_spectral_norm", (512, 1, 1), 16) == (threads, 1, 1)
    assert population_block("adam_update", (256, 1, 1), 16) == (256, 1, 1)
