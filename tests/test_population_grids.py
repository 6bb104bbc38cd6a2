"""``population_engine.GRID_SHARED_KERNELS`` on the GPU: the listed kernels' results do not depend
on ``gridDim.x``, so a population whose shared kernels run ONE block per member ends its steps
bitwise as one whose kernels run their plans' grids (every member, every state entry)."""

from __future__ import annotations

import numpy as np
import pytest

from foxhunt.reference.batch import Batch
from foxhunt.reference.config import DQNConfig, source_overrides


def _gpu_reason() -> str | None:
    from foxhunt.fast.device import cuda_available

    ok, reason = cuda_available()
    return None if ok else reason


def _states_after_steps(config, seeds, steps) -> list[dict]:
    from foxhunt.fast.population import Population

    pop = Population(config, seeds)
    try:
        for batches in steps:
            pop.step(batches)
        return [pop.state_dict(m) for m in range(len(seeds))]
    finally:
        pop.close()


def _random_steps(config, seeds, seed: int) -> list[list]:
    """Three steps' batches of every member."""
    rng = np.random.default_rng(seed)
    return [[Batch.random(config, rng) for _ in seeds] for _ in range(3)]


def _assert_bitwise_equal(planned: list[dict], got: list[dict], what: str) -> None:
    """Every member's every state entry byte for byte as ``planned``'s."""
    for m, (want, have) in enumerate(zip(planned, got, strict=True)):
        assert sorted(have) == sorted(want)
        differ = [k for k in want
                  if np.asarray(have[k]).tobytes() != np.asarray(want[k]).tobytes()]
        assert not differ, f"member {m}: {differ} differ {what}"


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=f"no CUDA device/driver: {_gpu_reason()}")
@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_shared_kernels_give_the_same_bits_on_one_block_per_member(monkeypatch, precision):
    from foxhunt.fast import population_engine

    config = DQNConfig.preset("tiny", precision=precision, **source_overrides("all"))
    seeds = [0, 1, 2]
    steps = _random_steps(config, seeds, 7)
    with monkeypatch.context() as patch:
        patch.setattr(population_engine, "GRID_SHARED_KERNELS", {})
        planned = _states_after_steps(config, seeds, steps)
    shared = []
    patch_grid = lambda grid_x, *rest: shared.append(grid_x) or 1  # noqa: E731
    monkeypatch.setattr(population_engine, "shared_grid_x", patch_grid)
    one_block = _states_after_steps(config, seeds, steps)
    assert shared, "no GRID_SHARED_KERNELS launch was captured"
    _assert_bitwise_equal(planned, one_block, "with one block per member")


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=f"no CUDA device/driver: {_gpu_reason()}")
def test_population_block_threads_give_the_plans_bits(monkeypatch):
    """``POPULATION_BLOCK_THREADS``: the population's own block sizes end three steps bitwise as
    the plans' block sizes do."""
    from foxhunt.fast import population_engine

    config = DQNConfig.preset("tiny", precision="bf16", **source_overrides("all"))
    seeds = [0, 1, 2]
    steps = _random_steps(config, seeds, 11)
    with monkeypatch.context() as patch:
        patch.setattr(population_engine, "POPULATION_BLOCK_THREADS", {})
        planned = _states_after_steps(config, seeds, steps)
    own = _states_after_steps(config, seeds, steps)
    _assert_bitwise_equal(planned, own, "with the population's block sizes")
