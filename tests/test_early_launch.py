"""Early launches (programmatic dependent launch, ``graph_lowering.EARLY_LAUNCH``): a kernel the
plan may start before its predecessor on the stream has finished must wait for it before it
touches memory. CPU-only: the sources are read and the lowering's choice is checked with a
stand-in kernel; what the GPU computes is the step conformance's."""

from __future__ import annotations

import re
import types

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
    first = _first_statements()
    assert EARLY_LAUNCH <= set(first), sorted(EARLY_LAUNCH - set(first))
    for kernel in sorted(EARLY_LAUNCH):
        assert first[kernel] == "fh_early_wait();", (kernel, first[kernel])
    # and a kernel outside the list is not made to wait for nothing
    assert first["f32_to_bf16"] != "fh_early_wait();"


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
        for name in ("adam_update", "f32_to_bf16"):
            lowering.launch(Launch(name, shape, {}), stream=0)
        assert log == [early, False], arch
    assert Lowering(None, lambda buf: 0, {}).early_launch is False
