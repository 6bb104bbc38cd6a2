"""The peer's runtime plumbing: the batch upload (pinned staging, non-blocking copies into
static device tensors), the compiled-instance limit and the CUDA graph node count."""

from __future__ import annotations

import numpy as np
import torch

from foxhunt.reference.batch import Batch
from foxhunt.reference.config import DQNConfig

BATCH_FIELDS = ("s", "a", "r", "s2", "done", "isw")
#: The label fields and the weight that makes the step read each.
LABEL_FIELDS = (("next_ret", "aux_next_bar_weight"), ("regime", "aux_regime_weight"))


def batch_fields(config: DQNConfig, n_step_on: bool = False) -> tuple[str, ...]:
    """The batch fields the step uploads: the core ones, the labels of the heads that are on and,
    for n-step steps (issue 22), the effective discount."""
    labels = tuple(name for name, weight in LABEL_FIELDS if getattr(config, weight) > 0)
    return BATCH_FIELDS + labels + (("discount",) if n_step_on else ())


class BatchUpload:
    """Static device tensors ``inputs`` (one per ``batch_fields``) and ``upload(batch)``.

    On the CPU, a plain copy. On CUDA each upload copies the batch into a pinned staging buffer
    (two, alternating, each guarded by an event) and from there into ``inputs`` with
    ``non_blocking=True``, as the fast trainer gets its batches; it never synchronises the
    device (it waits only for the copy that last read the same staging buffer)."""

    def __init__(self, config: DQNConfig, device: torch.device, n_step_on: bool = False):
        c = config
        self.config, self.device = config, device
        B, SD, nb = c.batch_size, c.state_dim, c.n_branches
        specs = {"s": ((B, SD), torch.float32), "a": ((B, nb), torch.int32),
                 "r": ((B,), torch.float32), "s2": ((B, SD), torch.float32),
                 "done": ((B,), torch.float32), "isw": ((B,), torch.float32),
                 "next_ret": ((B,), torch.float32), "regime": ((B,), torch.int32),
                 "discount": ((B,), torch.float32)}
        specs = {k: specs[k] for k in batch_fields(c, n_step_on)}
        self.inputs = {k: torch.zeros(shape, dtype=dt, device=device)
                       for k, (shape, dt) in specs.items()}
        if device.type == "cuda":
            self._staging = [{k: torch.empty(shape, dtype=dt, pin_memory=True)
                              for k, (shape, dt) in specs.items()} for _ in range(2)]
            self._staging_np = [{k: t.numpy() for k, t in slot.items()} for slot in self._staging]
            self._staged = [torch.cuda.Event(), torch.cuda.Event()]
            self._slot = 0

    def upload(self, batch: Batch) -> None:
        batch.validate(self.config)
        if (batch.discount is not None) != ("discount" in self.inputs):
            raise ValueError("batch.discount: " + ("missing; this step is n-step" if batch.discount
                             is None else "given, but this step is 1-step (n_step=1)"))
        if self.device.type != "cuda":
            for k in self.inputs:
                self.inputs[k].copy_(torch.from_numpy(getattr(batch, k)))
            return
        k_slot = self._slot
        self._slot = 1 - k_slot
        self._staged[k_slot].synchronize()  # the copy that last read this staging slot is done
        for k in self.inputs:
            np.copyto(self._staging_np[k_slot][k], getattr(batch, k))
            self.inputs[k].copy_(self._staging[k_slot][k], non_blocking=True)
        self._staged[k_slot].record()


#: Compiled instances per process the benchmarks may create (precisions x modes x scaling points).
MAX_COMPILED_INSTANCES = 64


def allow_many_compiled_instances() -> None:
    """Dynamo caches compiled code per code object, guarded on ``self``'s identity: every
    ``TorchStep`` instance adds an entry. Past the recompile limit (default 8) it would silently
    run eager, so raise the limit."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):  # the newer name, then the older one
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name,
                    max(getattr(torch._dynamo.config, name), MAX_COMPILED_INSTANCES))


def count_graph_nodes(graph) -> int | None:
    """Nodes of a captured ``torch.cuda.CUDAGraph`` (needs ``keep_graph=True`` and cuda-python);
    None when either is missing."""
    try:
        from cuda.bindings import driver

        from foxhunt.fast.graphs import count_nodes

        return count_nodes(driver.CUgraph(int(graph.raw_cuda_graph())))
    except Exception:  # noqa: BLE001 - a count is a nicety, never a failure
        return None


__all__ = ["BATCH_FIELDS", "LABEL_FIELDS", "MAX_COMPILED_INSTANCES", "BatchUpload",
           "allow_many_compiled_instances", "batch_fields", "count_graph_nodes"]
