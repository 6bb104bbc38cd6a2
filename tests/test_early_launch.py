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
from foxhunt.fast.records import Launch, LaunchShape, Ops, Parallel, Record, Wait


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


def _graph2_like() -> tuple[Ops, list[tuple[str, bool]]]:
    """Records shaped as the core step's graph 2 (``graph2_plan``: three sides beside Adam, one
    waiting on another's event; the checks forked after Adam), then one kernel after the join;
    and each launch's expected ``chained`` (every node its stream depends on issued by the
    same ``enqueue``), in enqueue order."""
    shape = LaunchShape((1, 1, 1), (32, 1, 1))

    def ops(*items) -> Ops:
        out = Ops(None)
        out.items.extend(Launch(it, shape, {}) if isinstance(it, str) else it for it in items)
        return out

    checks = Parallel(sides=(ops("nan_check_fused"),),
                      main=ops("batched_spectral_norm", "polyak_update_mirror_check"))
    top = Parallel(sides=(ops("step_scalars", Record("scalars")),
                          ops("isv_q_abs_ref_update", "isv_h2_rms_update"),
                          ops(Wait("scalars"), "nan_check_fused", "merge_piece_flags")),
                   main=ops("adam_update_norm", checks))
    expected = [("step_scalars", False), ("isv_q_abs_ref_update", False),
                ("isv_h2_rms_update", True), ("nan_check_fused", False),
                ("merge_piece_flags", True), ("adam_update_norm", False),
                ("nan_check_fused", True), ("batched_spectral_norm", True),
                ("polyak_update_mirror_check", True), ("adam_update", True)]
    return ops(top, "adam_update"), expected


@pytest.mark.parametrize("arch, early", [("sm_90", True), ("sm_80", False)])
def test_which_launches_early_by_the_enqueues_own_nodes(monkeypatch, arch, early):
    """``early_launches(True, which=...)`` (graph 2 of ``step_program.graph2_early``):
    ``"chained"`` launches a kernel early only where its stream depends on nothing but nodes the
    same ``enqueue`` issued: not each stream's first kernel (a side's after its fork, a side whose
    wait joins it to an event recorded after a kernel), but a kernel after a kernel, a fork after
    a kernel and a join of such streams; ``"first"`` exactly the others; ``"all"`` every listed
    kernel; inside ``early_launches(False)`` none. Anything else for ``which`` is refused."""
    from foxhunt.fast import device as fast_device

    fake = types.SimpleNamespace(CUresult=types.SimpleNamespace(CUDA_SUCCESS=0),
                                 CUstream=lambda handle: handle,
                                 cuEventRecord=lambda *args: (0,),
                                 cuStreamWaitEvent=lambda *args: (0,))
    monkeypatch.setattr(fast_device, "_driver", lambda: fake)
    pool = types.SimpleNamespace(reset=lambda: None, event=object,
                                 stream=lambda: types.SimpleNamespace(handle=1))
    lowering = Lowering(types.SimpleNamespace(device=types.SimpleNamespace(arch=arch)),
                        lambda buf: 0, {})
    log = []
    lowering.packed = lambda node: (types.SimpleNamespace(
        launch=lambda grid, block, packed, *, stream, shared_mem, early: log.append(
            (node.kernel, early))), None)
    ops, expected = _graph2_like()
    assert set(name for name, _ in expected) <= EARLY_LAUNCH
    for on, which, want in ((True, "chained", [(k, c and early) for k, c in expected]),
                            (True, "first", [(k, not c and early) for k, c in expected]),
                            (True, "all", [(k, early) for k, _ in expected]),
                            (False, "chained", [(k, False) for k, _ in expected])):
        log.clear()
        with lowering.early_launches(on, which=which):
            assert lowering.enqueue(ops, 0, pool) is True
        assert log == want, (on, which)
    assert lowering.early_which == "all"  # restored after the block
    refused = r"^which: 'some' is not allowed; expected one of all, chained, first$"
    with pytest.raises(ValueError, match=refused), lowering.early_launches(True, which="some"):
        pass


def test_graph2_early_names_each_precisions_choice(monkeypatch):
    """``step_program.graph2_early``: ``GRAPH2_EARLY_LAUNCH`` all, ``GRAPH2_CHAINED_EARLY`` and
    ``GRAPH2_FIRST_EARLY`` their halves, both halves all, none of them None."""
    from foxhunt.fast import step_program as sp

    monkeypatch.setattr(sp, "GRAPH2_EARLY_LAUNCH", frozenset({"bf16"}))
    monkeypatch.setattr(sp, "GRAPH2_CHAINED_EARLY", frozenset({"bf16", "f32", "tf32"}))
    monkeypatch.setattr(sp, "GRAPH2_FIRST_EARLY", frozenset({"tf32"}))
    assert [sp.graph2_early(p) for p in ("bf16", "f32", "tf32")] == ["all", "chained", "all"]
    monkeypatch.setattr(sp, "GRAPH2_CHAINED_EARLY", frozenset())
    assert [sp.graph2_early(p) for p in ("bf16", "f32", "tf32")] == ["all", None, "first"]
