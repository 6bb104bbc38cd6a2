"""Early launches (programmatic dependent launch, ``graph_lowering.EARLY_LAUNCH``): a kernel the
plan may start before its predecessor on the stream has finished must wait for it before it
touches memory. CPU-only: the sources are read and the lowering's choice is checked with a
stand-in kernel; what the GPU computes is the step conformance's."""

from __future__ import annotations

import itertools
import re
import types

import pytest

from foxhunt.fast._build import source_files
from foxhunt.fast.cuda_parse import kernel_spans, strip_comments
from foxhunt.fast.graph_lowering import EARLY_LAUNCH, Lowering
from foxhunt.fast.records import Launch, LaunchShape


def _first_statements() -> dict[str, str]:
    """``{kernel: the first statement of its body}`` over ``cuda_src``."""
    out = {}
    for name, data in source_files().items():
        if not name.endswith((".cu", ".cuh")):
            continue
        text = strip_comments(data.decode("utf-8"))
        for span in kernel_spans(text):
            if span.body is not None:
                body = text[span.body[0] + 1:span.body[1] - 1]
                out[span.name] = re.sub(r"\s+", " ", body.strip().split(";", 1)[0]) + ";"
    return out


def test_every_early_kernel_waits_for_its_predecessors_first():
    """``EARLY_LAUNCH`` is exactly the kernels whose first statement is the wait (read here by
    a parse of its own), and a kernel that does not wait is not launched early."""
    first = _first_statements()
    assert EARLY_LAUNCH == {k for k, s in first.items() if s == "fh_early_wait();"}
    assert first["env_step"] != "fh_early_wait();" and "env_step" not in EARLY_LAUNCH


def _step_kernels() -> set[str]:
    """Every kernel the step's graphs launch, over the plan variants (core and every source,
    f32 and bf16, stacked or not, the fused trunk and heads, the adaptive mechanisms)."""
    from foxhunt.fast.cpu_executor import CpuEngine
    from foxhunt.reference.config import ADAPTIVE_ON, DQNConfig, source_overrides

    kernels = set()
    for source, precision, stacked, fused, adaptive in itertools.product(
            ("core", "all"), ("f32", "bf16"), (False, True), (False, True), (False, True)):
        if fused and precision != "bf16":
            continue
        fields = dict(source_overrides(source)) if source != "core" else {}
        if adaptive:
            fields.update(ADAPTIVE_ON, c51_warmup_epochs=0)
        engine = CpuEngine(DQNConfig.preset("tiny", precision=precision, **fields),
                           stacked_backward=stacked, fused_trunk=fused, fused_heads=fused)
        for ops in (*engine.plans["upload"], engine.plans["graph1"], engine.plans["graph2"]):
            kernels |= {n.kernel for n in ops.nodes() if isinstance(n, Launch)}
    return kernels


def test_every_kernel_of_the_step_launches_early():
    """The whole step launches early (session 22), not only its tail: a kernel added to the
    step without the wait as its first statement fails here."""
    kernels = _step_kernels()
    assert {"f32_to_bf16", "c51_project_grad", "adam_update", "nan_check_fused"} <= kernels
    assert kernels <= EARLY_LAUNCH, sorted(kernels - EARLY_LAUNCH)


def test_only_listed_kernels_launch_early_and_only_from_sm90():
    """A listed kernel's record is launched early on sm_90 and newer, never before; any other
    kernel never (the launch attribute is the only difference: the record is the same)."""
    shape = LaunchShape((1, 1, 1), (32, 1, 1))
    for arch, early in (("sm_90", True), ("sm_100", True), ("sm_80", False), ("sm_86", False)):
        module = types.SimpleNamespace(device=types.SimpleNamespace(arch=arch))
        lowering = Lowering(module, lambda buf: 0, {})
        log = []
        kernel = types.SimpleNamespace(
            launch=lambda grid, block, packed, *, stream, shared_mem, early: log.append(early))
        lowering.packed = lambda node: (kernel, None)
        for name in ("adam_update", "env_step"):
            lowering.launch(Launch(name, shape, {}), stream=0)
        assert log == [early, False], arch
    assert Lowering(None, lambda buf: 0, {}).early_launch is False


@pytest.mark.parametrize("arch, early", [("sm_90", True), ("sm_80", False)])
def test_early_launches_turns_them_off_inside_its_block_only(arch, early):
    """``Lowering.early_launches(False)`` (graph 2 of the precisions outside
    ``step_program.GRAPH2_EARLY_LAUNCH``): a listed kernel launches plainly inside the block
    and early again after it, also when the block raises; ``early_launches(True)`` never turns
    them on where the device has none."""
    shape = LaunchShape((1, 1, 1), (32, 1, 1))
    lowering = Lowering(types.SimpleNamespace(device=types.SimpleNamespace(arch=arch)),
                        lambda buf: 0, {})
    log = []
    kernel = types.SimpleNamespace(
        launch=lambda grid, block, packed, *, stream, shared_mem, early: log.append(early))
    lowering.packed = lambda node: (kernel, None)
    node = Launch("adam_update", shape, {})
    lowering.launch(node, stream=0)
    with lowering.early_launches(False):
        lowering.launch(node, stream=0)
    with lowering.early_launches(True):
        lowering.launch(node, stream=0)
    with pytest.raises(RuntimeError, match="boom"), lowering.early_launches(False):
        raise RuntimeError("boom")
    lowering.launch(node, stream=0)
    assert log == [early, False, early, early]
