"""The fast population: N members of one architecture stepped by ONE graph replay (SPEC 12, issue 24).

``Population(config, seeds=[...], overrides=[...], *, device=None, gemm_workspace="none",
n_step=1)`` trains N members, each with its own parameters, target, Adam state, spectral-norm vectors, ISV,
sentinel flags, deferred readback and batch, and per-member scalars where a member overrides
one of ``reference.population.MEMBER_FIELDS`` (lr, gamma, cql_alpha, tau, the second-wave
weights; the seed keys the IQN head's quantile fractions). Its reference twin is
``reference.population.Population`` (N reference trainers in turn); ``CpuPopulation`` is this
class on the CPU executor (CI runs it).

How one plan serves N members:

- **One arena, N copies.** The step layout (``StepLayout``, the same for every member:
  checked) plus one ``member_scalars`` buffer is carved once; member m's copy of every buffer
  lies ``m * stride`` bytes past member 0's (``stride``: the carved size rounded up to 256
  bytes). Each member's constants are its own (``step_constants`` at its own addresses: the
  sentinel and spectral-norm descriptors hold pointers, ``gamma`` and ``alpha`` its values).
- **Kernels** come from the member build (``member_build.member_module``: every kernel moves
  its pointers by ``blockIdx.z * member_stride`` bytes) and launch with ``gridDim.z = N``;
  those of ``population_engine.GRID_SHARED_KERNELS`` with their blocks shared among the
  members. A population of
  one runs the plain kernels (the single trainer's plan exactly): the member build cost 2 % at
  N = 1 (measured on the H200, seed preset, bf16: 232.1 against 227.8 us per step).
- **Scalars.** Every member's step plan is built (``StepProgram`` per distinct member config and
  seed, on the CPU planner) and ``population_plan.align_members`` checks they are one plan but
  for kernel scalar arguments. Each launch whose scalars differ gets a scalar block per member
  in ``member_scalars`` (``member_build.member_scalar_block``), found in the real plan by graph,
  kernel and occurrence; every other launch passes null and reads its own arguments.
- **GEMMs** are cuBLASLt strided-batched plans (``batch = N``, ``batch_stride = stride``);
  every GEMM is planned for ``min(N, GEMM_SM_SHARE) / GEMM_SM_SHARE`` of the SMs.
- **Copies** (the batch upload, the reads) are one 2-D copy each: N rows of the copy's bytes,
  pitch ``stride`` on the device and the per-member size of the host buffer on the host.

A step is ``Population.step(batches)``: every batch checked before any is written, then the
upload graph, graph 1 and graph 2 once for all members. ``member(i)`` is member i as a fast
``Trainer`` (``backend_name = "fast-member"``): its state exchange, checkpoints (``save``: an
ordinary checkpoint a single trainer of either backend loads), folds, ISV signals, deferred
readback and ``q_values`` (a graph of the plain kernels at its own addresses) are a single
trainer's; its ``step`` raises (members step together). A NaN in one member's batch flags only
that member: no launch reads another member's copy.

Modules: ``population_plan`` (the members' plans aligned; ``PopulationPlan``, what every backend
shares), ``population_engine`` (the GPU engine, its CPU twin, a member's view), this one (the
host side).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from foxhunt.fast.population_engine import CpuPopulationEngine, MemberEngine, PopulationEngine
from foxhunt.fast.population_plan import PopulationPlan
from foxhunt.fast.trainer import STAGING_RING, Trainer, check_step_batch, write_batch
from foxhunt.reference import sentinels
from foxhunt.reference.backend import DeferredReadback, StepScalars
from foxhunt.reference.batch import Batch
from foxhunt.reference.population import MemberAccess
from foxhunt.reference.step import check_n_step
from foxhunt.reference.trainer import Trainer as ReferenceTrainer

# --------------------------------------------------------------------------------------------
# The host side
# --------------------------------------------------------------------------------------------


class Member(Trainer):
    """Member ``index`` of a population as a fast ``Trainer`` (module docstring); built by the
    population (its initial state: ``reference.Trainer(config, seed)``'s, as a single fast
    trainer's)."""

    backend_name = "fast-member"

    def __init__(self, index: int, config, seed: int, engine: MemberEngine):  # noqa: D107
        self._closed = True
        self.index, self.seed, self.config = index, int(seed), config
        self._engine = engine
        self.n_step_on = engine.layout.n_step_on
        self._eval_cache: dict[int, object] = {}
        self._readback = DeferredReadback(config.readback_interval, sentinels.NUM_SENTINEL_SLOTS)
        self._closed = False
        self.load_state_dict(ReferenceTrainer(config, seed=self.seed).state_dict())

    def step(self, batch: Batch) -> StepScalars:
        raise RuntimeError(f"member {self.index} of a population steps with the others: "
                           "Population.step(batches), one batch per member")

    def device_segments(self, bars, feats, segments):
        """The greedy walk of this member's evaluation segments on the device
        (``reference.evaluator.device_segments``: a ``DeviceEvaluator`` over its engine view,
        the plain kernels at its own addresses), as a single fast trainer's run gets."""
        from foxhunt.reference.evaluator import device_segments

        return device_segments(self, bars, feats, segments)

    def _reseed(self, seed: int) -> None:
        raise ValueError(f"state: seed {seed} is not member {self.index}'s seed {self.seed}; a "
                         "population member's IQN quantile key is fixed when the population is "
                         "built (load it into a single trainer instead)")


class Population(MemberAccess):
    """N fast trainers of one architecture stepped by one graph replay (module docstring).

    ``Population(config, seeds, overrides=None, *, device=None, gemm_workspace="none",
    n_step=1)``: the members' configs as ``reference.population.member_configs`` checks them;
    ``n_step`` > 1: n-step transitions (every batch carries ``discount``, as a fast
    ``Trainer(n_step=)``'s); raises ``NoCudaDeviceError`` (with the reason) where no CUDA
    device/driver is usable."""

    def __init__(self, config, seeds: Sequence[int], overrides: Sequence[Mapping[str, Any]] | None = None,
                 *, device=None, gemm_workspace: str = "none", n_step: int = 1, **engine_options):
        self._closed = True
        self.config = config
        self.plan = plan = PopulationPlan(config, seeds, overrides,
                                          n_step_on=check_n_step(config, n_step))
        self.seeds = plan.seeds
        self._engine = self._make_engine(plan, device=device, gemm_workspace=gemm_workspace,
                                         **engine_options)
        self._read = None  # the population's last read, until the next launch or synchronisation
        try:
            self._members = [Member(m, plan.configs[m], plan.seeds[m],
                                    self._engine.member_engine(m, self))
                             for m in range(plan.members)]
        except BaseException:  # nothing held by a population that was never made
            self._engine.close()
            raise
        self._closed = False
        #: Population steps taken (the staging ring's position).
        self.steps = 0

    def _make_engine(self, plan: PopulationPlan, *, device, gemm_workspace: str):
        from foxhunt.fast.device import _require_cuda

        _require_cuda()  # NoCudaDeviceError with the reason, before any other work
        return PopulationEngine(plan, device=device, gemm_workspace=gemm_workspace)

    @property
    def engine(self):
        """The device side (``PopulationEngine``, or the CPU twin's ``CpuPopulationEngine``)."""
        return self._engine

    def read_member(self, member: int) -> tuple[np.ndarray, np.ndarray]:
        """Member ``member``'s readback and flags: one read (a synchronisation) serves every
        member until the next launch or state change (``forget_read``)."""
        if self._read is None:
            self._read = self._engine.read()
        return self._read[0][member].copy(), self._read[1][member].copy()

    def forget_read(self) -> None:
        self._read = None

    def step(self, batches: Sequence[Batch]) -> list[StepScalars]:
        """One step of every member on its own batch (``batches[i]`` for member ``i``): every
        batch checked before any is written, then one upload and one replay of the step's
        graphs; each member's ``StepScalars`` by its own deferred-readback rule."""
        batches = list(batches)
        if len(batches) != len(self):
            raise ValueError(f"batches: {len(batches)} given; allowed: one per member ({len(self)})")
        for i, (member, batch) in enumerate(zip(self._members, batches)):
            try:
                check_step_batch(member.config, self._engine.layout, batch)
            except ValueError as exc:
                raise ValueError(f"member {i}: {exc}") from None
        slot = self.steps % STAGING_RING
        for member, batch, views in zip(self._members, batches, self._engine.staging(slot)):
            write_batch(member.config, batch, views)
        self._engine.launch(slot)
        self.forget_read()
        self.steps += 1
        return [member.step_enqueued() for member in self._members]

    def close(self) -> None:
        """Release the graphs, GEMM plans, events and device memory (unusable afterwards)."""
        if self._closed:
            return
        self._closed = True
        try:
            for member in self._members:
                member.close()
        finally:
            self._engine.close()


class CpuPopulation(Population):
    """``Population`` on the CPU executor (``CpuPopulationEngine``); ``branch_order`` and
    ``refused_epilogues`` as ``cpu_executor.CpuTrainer``'s."""

    def _make_engine(self, plan: PopulationPlan, *, device, gemm_workspace: str,
                     branch_order: str = "latest_first", refused_epilogues=()):
        if device is not None:
            raise ValueError(f"device: {device!r}; the CPU executor takes no device")
        return CpuPopulationEngine(plan, gemm_workspace=gemm_workspace, branch_order=branch_order,
                                   refused_epilogues=tuple(refused_epilogues))


__all__ = ["CpuPopulation", "Member", "Population"]
