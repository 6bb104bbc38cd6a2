"""The fast step's plan as data (``foxhunt.fast.records``): launches bound by parameter name and
checked when the plan is built, on the CPU; the dependency graph both executors share."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from foxhunt.fast.cpu_executor import CpuEngine, topological_order
from foxhunt.fast.cpu_kernels import TWINS
from foxhunt.fast.dataflow import check_dataflow, dependency_graph, release_points
from foxhunt.fast.records import (Access, Buf, Copy, Launch, Ops, Parallel, PlanError,
                                  kernel_params)
from foxhunt.reference.config import DQNConfig

CONFIGS = [("tiny", "f32"), ("tiny", "bf16"), ("seed", "f32"), ("seed", "bf16")]


def _engine(preset="tiny", precision="f32", fields=None, **options) -> CpuEngine:
    return CpuEngine(DQNConfig.preset(preset, precision=precision, **(fields or {})), **options)


def _launches(ops: Ops, kernel: str) -> list[Launch]:
    return [n for n in ops.nodes() if isinstance(n, Launch) and n.kernel == kernel]


def _replace(ops: Ops, old, new) -> bool:
    """Replace record ``old`` by ``new`` wherever it sits in ``ops`` (branches included)."""
    for i, it in enumerate(ops.items):
        if it is old:
            ops.items[i] = new
            return True
        if isinstance(it, Parallel) and any(_replace(b, old, new) for b in (*it.sides, it.main)):
            return True
    return False


# ------------------------------------------------------------------------------ the twins
def test_every_twin_declares_the_extent_of_each_pointer_parameter():
    params = kernel_params()
    for name, twin in TWINS.items():
        assert name in params, f"twin {name!r} names no kernel of cuda_src"
        pointers = {p.name for p in params[name] if p.pointer}
        assert set(twin.extents) == pointers, name
        assert twin.nullable <= pointers, name


@pytest.mark.parametrize("source", ["core", "all"])
@pytest.mark.parametrize("preset, precision", CONFIGS)
def test_the_plan_launches_only_kernels_with_a_twin_and_checks_clean(preset, precision, source):
    """Every launched kernel has its CPU twin, a same-name reference kernel and a same-name
    fast test entry, and lives in a kernel (not ``_`` infrastructure) file of cuda_src (the
    core step and the step with every second-wave source on)."""
    from foxhunt.conformance.step_harness import SOURCES
    from foxhunt.fast.cuda_parse import package_kernels
    from foxhunt.fast.kernels import KERNELS as FAST
    from foxhunt.reference.kernels import KERNELS as REFERENCE

    engine = _engine(preset, precision, SOURCES[source])
    plans = engine.plans
    kernels = {n.kernel for ops in (*plans["upload"], plans["graph1"], plans["graph2"])
               for n in ops.nodes() if isinstance(n, Launch)}
    assert kernels <= set(TWINS) and len(kernels) >= 20
    assert kernels <= set(REFERENCE) and kernels <= set(FAST), sorted(kernels - set(REFERENCE))
    assert not [k for k in kernels if package_kernels()[k].file.startswith("_")]
    # Every record's arguments are its kernel's parameters, in the kernel's order.
    for ops in (plans["graph1"], plans["graph2"]):
        for node in ops.nodes():
            if isinstance(node, Launch):
                assert list(node.args) == [p.name for p in kernel_params()[node.kernel]]


# ------------------------------------------------------------------------------ one record
C51_FRONT = "c51_gather_project_dueling_branches"  # the tiny core step's C51 front


def _c51_record(engine: CpuEngine) -> Launch:
    return _launches(engine.plans["graph1"], C51_FRONT)[0]


@pytest.mark.parametrize("change, match", [
    (lambda a: a.pop("isw"), rf"kernel {C51_FRONT}: parameter 'isw' is not bound"),
    (lambda a: a.update(weights="batch.isw"), rf"kernel {C51_FRONT}: no parameter 'weights'"),
    (lambda a: a.update(iws=a.pop("isw")), rf"kernel {C51_FRONT}: no parameter 'iws'"),
    (lambda a: a.update(isw=1.0), r"parameter 'isw' \(const float\* __restrict__\): expected a buffer"),
    (lambda a: a.update(batch=Buf("td")), r"parameter 'batch' \(int\): a scalar parameter"),
    (lambda a: a.update(batch=4.0), r"parameter 'batch' \(int\): expected an int"),
    (lambda a: a.update(v_min=np.float64(-10)), r"parameter 'v_min' \(float\): expected a float32"),
    (lambda a: a.update(actions=Buf("batch.r")), r"parameter 'actions' .*dtype float32; expected int32"),
    (lambda a: a.update(m=Buf("batch.r")), r"parameter 'm' .*writes, but batch.r is a read-only batch"),
    (lambda a: a.update(dlogits=Buf("z")), r"parameter 'dlogits' .*writes, but z is a read-only constant"),
    (lambda a: a.update(p_next=Buf("td")), r"parameter 'p_next' needs \d+ elements; td holds"),
    (lambda a: a.update(r=Buf("reward")), r"parameter 'r' .*no buffer 'reward'"),
    (lambda a: a.update(logp=Buf("logp", ("x", 0))), r"parameter 'logp' .*no packed key"),
    (lambda a: a.update(r=None), r"parameter 'r' .*a null pointer is not allowed"),
])
def test_a_wrong_argument_fails_naming_the_kernel_and_the_parameter(change, match):
    engine = _engine()
    record = _c51_record(engine)
    args = dict(record.args)
    engine.program.binder.launch(record.kernel, record.shape, args)  # the real record binds
    change(args)
    with pytest.raises(PlanError, match=match):
        engine.program.binder.launch(record.kernel, record.shape, args)


def test_an_unknown_kernel_fails():
    engine = _engine()
    record = _c51_record(engine)
    with pytest.raises(PlanError, match="kernel c51_projekt_grad: no such kernel in cuda_src"):
        engine.program.binder.launch("c51_projekt_grad", record.shape, dict(record.args))


def test_a_swapped_pair_of_same_typed_pointers_fails_when_the_plan_is_built(monkeypatch):
    """``c51_loss_branches`` with its outputs ``ce`` [D, B] and ``total`` [D] (both ``float*
    __restrict__``) swapped: the region bound to ``ce`` is shorter than the twin's extent, so
    building the plan (``CpuTrainer`` / ``GpuEngine`` construction) fails naming both."""
    original = Ops.kernel

    def swapping(self, name, plan, **args):
        if name == "c51_loss_branches":
            args["ce"], args["total"] = args["total"], args["ce"]
        return original(self, name, plan, **args)

    monkeypatch.setattr(Ops, "kernel", swapping)
    c = DQNConfig.preset("tiny")
    with pytest.raises(PlanError, match=rf"kernel c51_loss_branches: parameter 'ce' needs "
                                        rf"{c.n_branches * c.batch_size} elements; c51_total holds "
                                        rf"{c.n_branches}"):
        _engine()


def test_swapped_same_typed_pointers_are_caught_across_the_plan():
    """Every pair of pointer parameters of one C type, swapped in every record of graph 1 and
    graph 2 (seed preset, f32): the binder (dtype, read-only buffers, extents) and the data
    flow check (reads of what no dependency wrote) catch most; the rest are pairs the plan
    cannot tell apart (same type, role and size, both written before: e.g. ``base`` and
    ``inject`` of the budget tail), which the CPU step comparison catches instead."""
    engine = _engine("seed")
    lay, binder = engine.layout, engine.program.binder
    graphs = [engine.plans["upload"][0], engine.plans["graph1"], engine.plans["graph2"]]
    caught, missed = 0, []
    for ops in graphs[1:]:
        for node in ops.nodes():
            if not isinstance(node, Launch):
                continue
            pointers = [p for p in kernel_params()[node.kernel]
                        if p.pointer and node.args[p.name] is not None]
            for p, q in itertools.combinations(pointers, 2):
                if p.ctype != q.ctype or node.args[p.name] == node.args[q.name]:
                    continue
                args = dict(node.args)
                args[p.name], args[q.name] = args[q.name], args[p.name]
                try:
                    swapped = binder.launch(node.kernel, node.shape, args)
                    assert _replace(ops, node, swapped)
                    try:
                        check_dataflow(graphs, lay.role, lay.zero_padding())
                    finally:
                        assert _replace(ops, swapped, node)
                    missed.append(f"{node.kernel}: {p.name} <-> {q.name}")
                except PlanError:
                    caught += 1
    print(f"swapped same-typed pointer pairs: {caught} caught at plan build, {len(missed)} not: "
          + "; ".join(missed))
    assert caught > len(missed)
    assert not any(m.startswith(("c51_loss_branches", "dueling_combine_backward_sum_branches"))
                   for m in missed)


# ------------------------------------------------------------------------------ data flow
def test_a_missing_dependency_between_branches_fails_the_data_flow_check(monkeypatch):
    """Without the C51 losses' wait for the projections (event ``m`` of the tiny step's C51
    front; ``m0`` .. of per-branch projections), ``c51_loss_branches`` would read
    ``m`` (and the online ``logp`` the front's end implies) while they may still be written: the
    data flow check fails when the plan is built."""
    original = Ops.wait
    monkeypatch.setattr(Ops, "wait", lambda self, event: None if event == "m" else original(self, event))
    with pytest.raises(PlanError, match=r"kernel c51_loss_branches parameter '(m|logp)' reads bytes .* of '(m|logp)'"):
        _engine()


def _toy(*items) -> Ops:
    ops = Ops(binder=None)
    ops.items.extend(items)
    return ops


@pytest.mark.parametrize("order, want", [("latest_first", ["m1", "s1", "s2", "m2"]),
                                         ("capture_order", ["s1", "s2", "m1", "m2"])])
def test_dependency_graph_forks_joins_and_orders_like_stream_capture(order, want):
    """A side forked before any work on the main stream starts with a root node (as in CUDA);
    the join makes the next node depend on both ends; both orders keep every edge."""
    ops = _toy()
    ops.parallel(_toy("s1", "s2"), _toy("m1"))
    ops.items.append("m2")
    nodes, deps = dependency_graph([ops])
    assert nodes == ["s1", "s2", "m1", "m2"]
    assert deps == [frozenset(), {0}, frozenset(), {1, 2}]
    assert [nodes[i] for i in topological_order(deps, order)] == want
    # A second graph depends on every node of the first.
    nodes, deps = dependency_graph([ops, _toy("g2")])
    assert deps[-1] == {0, 1, 2, 3}


def test_dependency_graph_events():
    side = _toy("a")
    side.record("e")
    main = _toy("b")
    main.wait("e")
    main.items.append("c")
    ops = _toy()
    ops.parallel(side, main)
    nodes, deps = dependency_graph([ops])
    assert nodes == ["a", "b", "c"] and deps[2] == {0, 1}
    bad = _toy()
    bad.wait("never")
    with pytest.raises(PlanError, match="wait on event 'never' before it is recorded"):
        dependency_graph([bad])
    twice = _toy()
    twice.record("e")
    twice.record("e")
    with pytest.raises(PlanError, match="event 'e' recorded twice"):
        dependency_graph([twice])


def _user(name: str, buffer: str, start: int, nbytes: int, write: bool = False) -> Copy:
    """A toy node touching ``nbytes`` bytes of ``buffer`` from ``start``."""
    return Copy(Buf(buffer), Buf(buffer), nbytes, name,
                accesses=(Access(buffer, start, nbytes, write, name),))


def test_release_points_are_the_last_users_of_what_the_writer_writes():
    writer = _toy(_user("up", "batch", 0, 100, write=True))
    a, c, d = _user("a", "batch", 0, 10), _user("c", "batch", 50, 10), _user("d", "batch", 95, 8)
    outside, other = _user("outside", "batch", 100, 8), _user("other", "scratch", 0, 4)
    side, main = _toy(a, _user("b", "scratch", 0, 4)), _toy(c, other, d, outside)
    graph1 = _toy()
    graph1.parallel(side, main)
    graph1.items.append(_user("e", "scratch", 0, 4))
    nodes, _ = dependency_graph([graph1])
    assert [n.kind for n in nodes] == ["a", "b", "c", "other", "d", "outside", "e"]
    # c is an ancestor of d; "outside" reads bytes the writer does not write.
    assert release_points(writer, [graph1, _toy(_user("g2", "scratch", 0, 4))]) == [0, 4]
    assert release_points(writer, [graph1]) == [0, 4]
    # A later graph's user (a write counts too) leaves the point at graph 1's end.
    assert release_points(writer, [graph1, _toy(_user("g2", "batch", 99, 1, write=True))]) is None
    assert release_points(writer, [_toy(other)]) == []


@pytest.mark.parametrize("precision, source", [("bf16", "core"), ("f32", "core"),
                                               ("tf32", "core"), ("bf16", "all")])
def test_the_step_releases_its_batch_before_graph_1_ends(precision, source):
    """In the seed step every reader of the batch is one of the release points or one of their
    ancestors, the points read it and none depends on another; graph 2 never reads it, and
    graph 1's last node (the budget launch) comes after the points."""
    from foxhunt.reference.config import source_overrides

    engine = _engine("seed", precision, source_overrides(source))
    up, g1, g2 = engine.plans["upload"][0], engine.plans["graph1"], engine.plans["graph2"]
    points = release_points(up, [g1, g2])
    nodes, deps = dependency_graph([g1])
    readers = {i for i, n in enumerate(nodes) if any(a.buffer == "batch" for a in n.accesses)}
    assert points and set(points) <= readers

    def ancestors(i: int) -> set[int]:
        out, todo = set(), list(deps[i])
        while todo:
            j = todo.pop()
            if j not in out:
                out.add(j)
                todo.extend(deps[j])
        return out

    covered = set(points).union(*(ancestors(p) for p in points))
    assert readers <= covered
    assert not any(p in ancestors(q) for p in points for q in points)
    assert not any(a.buffer == "batch" for n in g2.nodes() for a in n.accesses)
    assert set(points).isdisjoint({len(nodes) - 1}) and set(points) <= ancestors(len(nodes) - 1)


# ------------------------------------------------------------------------------ switches
def test_gemm_workspace_is_a_parameter_with_two_values():
    from foxhunt.fast.cpu_executor import CpuTrainer

    config = DQNConfig.preset("tiny")
    assert CpuTrainer(config, gemm_workspace="default").program.gemm_workspace == "default"
    with pytest.raises(ValueError, match=r"gemm_workspace: 'some' is not allowed; expected one of "
                                         r"'none', 'default'"):
        CpuTrainer(config, gemm_workspace="some")


def _masked_gemm_kernel(node) -> bool:
    """A launch of a backward GEMM kernel with its ReLU mask (``step_program.bwd_gemm``'s ``h``)."""
    from foxhunt.fast.step_program import BACKWARD_GEMM_KERNEL

    return (getattr(node, "kernel", None) in BACKWARD_GEMM_KERNEL.values()
            and node.args.get("h") is not None)


def _masked_output(node):
    """The masked gradient a ``relu_mask`` or masked GEMM kernel launch writes."""
    return node.args["dx"] if node.kernel == "relu_mask" else node.args["c"]


@pytest.mark.parametrize("source", ["core", "all"])
def test_no_step_gemm_writes_or_reads_a_relu_bitmask(source):
    """Each ReLU layer's input gradient is masked by the layer's forward output in
    ``relu_mask_bias_grad`` (or ``relu_mask``) after a plain GEMM, or in a backward GEMM kernel's
    epilogue (``gemm_tf32`` / ``gemm_f32``), never by cuBLASLt's bitmask (RELU_AUX_BIAS +
    DRELU_BGRAD: the bf16 plans leave a NaN output's bit clear, ``step_program``'s docstring):
    under either workspace policy, stacked or not, no GEMM record of any graph has either
    epilogue or an aux operand, the layout has no bitmask buffer, and nothing is a fallback."""
    from foxhunt.fast.records import Gemm
    from foxhunt.reference.config import source_overrides

    for workspace in ("none", "default"):
        for stacked in (False, True):
            engine = _engine(fields=source_overrides(source), gemm_workspace=workspace,
                             stacked_backward=stacked)
            graphs = [*engine.plans["upload"], engine.plans["graph1"], engine.plans["graph2"]]
            nodes = [n for ops in graphs for n in ops.nodes()]
            gemms = [n for n in nodes if isinstance(n, Gemm)]
            assert gemms and all(g.aux is None for g in gemms)
            assert {g.spec.epilogue for g in gemms} & {"relu_aux_bias", "drelu_bgrad"} == set()
            bitmasks = ("aux1", "aux2", "auxh")
            assert not [n for n in engine.program.lay.specs if n.startswith(bitmasks)]
            assert engine.program.fallbacks == []
            masks = [n for n in nodes
                     if getattr(n, "kernel", None) in ("relu_mask_bias_grad", "relu_mask")
                     or _masked_gemm_kernel(n)]
            # per backward pass (C51, CQL): the three heads' hidden layers, the trunk's h1; with
            # every source also the IQN pass's h1 and the ensemble pass's value head and h1
            assert len(masks) == 2 * (3 + 1) + 3 * (source == "all")
            # a relu_mask's bias sum (or a masked GEMM kernel's) is a bias_grad_reduce of its
            # output (step_program.input_grad)
            sums = {n.args["dy"] for n in nodes if getattr(n, "kernel", None) == "bias_grad_reduce"}
            assert {_masked_output(n) for n in masks if n.kernel != "relu_mask_bias_grad"} <= sums


def test_the_output_layers_bias_gradients_are_a_kernel_beside_a_plain_gemm():
    """No step GEMM takes cuBLASLt's BGRADB epilogue (``step_program``'s docstring: slower on the
    H200): each output layer's ``db`` is a ``bias_grad_reduce`` launch."""
    engine = _engine(gemm_workspace="none")
    nodes = engine.plans["graph1"].nodes()
    assert "bgradb" not in {n.spec.epilogue for n in nodes if hasattr(n, "spec")}
    masked = {_masked_output(n) for n in nodes
              if getattr(n, "kernel", None) == "relu_mask" or _masked_gemm_kernel(n)}
    reduces = [n for n in nodes if getattr(n, "kernel", None) == "bias_grad_reduce"
               and n.args["dy"] not in masked]  # not a hidden layer's (relu_mask's output)
    # per backward pass (C51, CQL): the value head's and the three branch heads' output layers
    assert len(reduces) == 2 * (1 + 3)


@pytest.mark.parametrize("precision", ["bf16", "tf32"])
@pytest.mark.parametrize("source", ["core", "all"])
def test_relu_layers_keep_nan_in_every_precision(precision, source):
    """Where a precision's RELU_BIAS epilogue keeps a NaN (``gemm.RELU_EPILOGUE_KEEPS_NAN``) the
    forward's ReLU layers are that epilogue, as in f32; where it does not (tf32) none is, and
    each of f32's ReLU-epilogue GEMMs is a plain GEMM whose output ``add_bias_relu`` rewrites
    in place."""
    from foxhunt.fast.gemm import RELU_EPILOGUE_KEEPS_NAN
    from foxhunt.reference.config import source_overrides

    def graph1(p):
        config = DQNConfig.preset("seed", precision=p, **source_overrides(source))
        return CpuEngine(config).plans["graph1"].nodes()

    def gemms(nodes, epilogue):
        return [n for n in nodes if getattr(getattr(n, "plan", None), "spec", None) is not None
                and n.plan.spec.epilogue == epilogue]

    layers = len(gemms(graph1("f32"), "relu_bias"))
    assert layers >= 2 * (2 + 4)  # online and target passes: the trunk and the core heads
    nodes = graph1(precision)
    relus = [n for n in nodes if getattr(n, "kernel", None) == "add_bias_relu"]
    if RELU_EPILOGUE_KEEPS_NAN[precision]:
        assert len(gemms(nodes, "relu_bias")) == layers and not relus
    else:
        assert not gemms(nodes, "relu_bias") and len(relus) == layers
        assert all(n.args["y"] == n.args["out"] for n in relus)
        assert {n.args["y"] for n in relus} <= {n.c for n in gemms(nodes, None)}


@pytest.mark.parametrize("precision", ["f32", "bf16"])
@pytest.mark.parametrize("source", ["core", "all", "adaptive"])
def test_the_stacked_backward_steps_bit_for_bit_as_a_gemm_per_loss(precision, source):
    """The C51 and CQL backward passes stacked (``stacked_backward=True``: each GEMM one record
    of two batches), not stacked (the default), or stacked where the planner refuses per-operand
    strides (one GEMM per loss): the CPU executor's steps end in the same bits (state, step
    scalars, TD errors); with the refusal every stacked GEMM is noted in ``fallbacks`` and none
    is left."""
    from foxhunt.fast.cpu_executor import STACKED, CpuTrainer
    from foxhunt.fast.records import Gemm
    from foxhunt.reference.batch import Batch
    from foxhunt.reference.config import ADAPTIVE_ON, source_overrides

    # "adaptive": every source but the MSE warm-up (it reads the fixed support) and every
    # adaptive mechanism, the adaptive atoms' per-branch CQL gradients among them
    fields = ({**source_overrides("all"), **ADAPTIVE_ON, "c51_warmup_epochs": 0}
              if source == "adaptive" else source_overrides(source))
    config = DQNConfig.preset("tiny", precision=precision, **fields)
    batches = [Batch.random(config, np.random.default_rng(s)) for s in range(3)]
    runs = []
    for stacked, refused in ((True, ()), (True, (STACKED,)), (False, ())):
        trainer = CpuTrainer(config, seed=5, refused_epilogues=refused, stacked_backward=stacked)
        program = trainer._engine.program
        stacked = [n for n in trainer._engine.plans["graph1"].nodes()
                   if isinstance(n, Gemm) and n.second]
        scalars = [trainer.step(b) for b in batches]
        runs.append((trainer.state_dict(), scalars, np.array(trainer.last_td_errors()),
                     len(stacked), [f for f in program.fallbacks if f.startswith("stacked")]))
    (state0, scalars0, td0, n0, notes0) = runs[0]
    # per head 4 GEMMs (2 input, 2 weight gradients), the trunk's 3: all stacked
    heads = len(config.branches) + 1
    assert [(n, len(notes)) for *_, n, notes in runs] == [(4 * heads + 3, 0), (0, 4 * heads + 3),
                                                          (0, 0)]
    for state1, scalars1, td1, *_ in runs[1:]:
        differ = [k for k in state0
                  if np.asarray(state0[k]).tobytes() != np.asarray(state1[k]).tobytes()]
        assert not differ
        assert scalars0 == scalars1 and td0.tobytes() == td1.tobytes()


def test_debug_buffer_reads_a_view_as_its_own_block():
    """``grad_c51`` and ``grad_cql`` are blocks of ``grad_losses``: ``debug_buffer`` gives each
    as its own ``[NP]`` array, the bytes of its block."""
    from foxhunt.fast.cpu_executor import CpuTrainer
    from foxhunt.reference.batch import Batch

    config = DQNConfig.preset("tiny")
    trainer = CpuTrainer(config, seed=1)
    trainer.step(Batch.random(config, np.random.default_rng(0)))
    lay = trainer._engine.layout
    whole = trainer.debug_buffer("grad_losses")
    for loss in ("c51", "cql"):
        got = trainer.debug_buffer(f"grad_{loss}")
        base, offset, shape, dtype = lay.locate(f"grad_{loss}")
        assert base == "grad_losses" and got.shape == (lay.NP,) == shape and got.dtype == dtype
        assert np.array_equal(got, whole[offset // 4:offset // 4 + lay.NP])
        assert np.abs(got).max() > 0
    assert not np.array_equal(trainer.debug_buffer("grad_c51"), trainer.debug_buffer("grad_cql"))
    assert trainer.debug_buffer("td").shape == (config.batch_size,)
