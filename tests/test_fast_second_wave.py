"""The second-wave sources in the fast step's plan (issue 18), on the CPU executor.

- Weight 0: the plan is the core plan, record for record, whatever the sources' shape fields;
  no record names a second-wave kernel or buffer. A source that is on adds its records (and
  only its buffers).
- Sentinels: a NaN planted in a source's buffer at the moment its slot watches it raises that
  slot's flag, in the reference ``Trainer`` and in the fast plan alike (the same flags, and
  every step comparison within the step-conformance bounds).
- State: the device step counter and the seed are the state's ``step`` and ``seed``; a state
  of another seed re-keys the quantile fractions.

One-step conformance of each source (alone and together, both precisions, injections,
checkpoints) is ``conformance/test_step_cpu_executor.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest

from foxhunt.conformance.step_compare import compare_step, failures, run_step
from foxhunt.conformance.step_harness import (PRECISIONS, SOURCES, fast_sources, set_trunk_grads,
                                              shared_case)
from foxhunt.fast import cpu_executor
from foxhunt.fast.cpu_executor import CpuEngine, CpuTrainer
from foxhunt.fast.graph1_plan import gather_project_dueling
from foxhunt.fast.graph2_plan import scalars_beside_adam
from foxhunt.fast.records import Buf, Gemm, Launch
from foxhunt.fast.wave_layout import injected_sources
from foxhunt.reference import aux_heads, iqn_head, sentinels
from foxhunt.reference import step as ref_step
from foxhunt.reference import trainer as ref_trainer
from foxhunt.reference.kernels.step import READBACK_INDEX
from foxhunt.reference.config import CORE_STEP, DQNConfig
from foxhunt.reference.kernels import aux as aux_kernels
from foxhunt.reference.kernels import ensemble as ens_kernels
from foxhunt.reference.kernels import iqn as iqn_kernels
from foxhunt.reference.kernels import warmup as warmup_kernels
from foxhunt.reference.kernels import rng
from foxhunt.reference.layout import ParamLayout
from foxhunt.reference.trainer import Trainer

#: Kernel areas only the second-wave sources launch.
WAVE_AREAS = ("iqn", "aux", "ensemble", "warmup", "wave")
#: Every second-wave shape field, away from its default (they must change nothing at weight 0).
SHAPES_CHANGED = dict(iqn_quantiles=3, iqn_embed=7, ens_heads=4, aux_hidden=9, n_regimes=5)


def _plans(config: DQNConfig) -> dict:
    return CpuEngine(config).plans


def _described(plans: dict) -> list[str]:
    return [plans["graph1"].describe(), plans["graph2"].describe(),
            *(ops.describe() for ops in plans["upload"])]


def _wave_kernels() -> set[str]:
    import importlib

    return {name for area in WAVE_AREAS
            for name in importlib.import_module(f"foxhunt.reference.kernels.{area}").KERNELS}


def _kernels(plans: dict) -> set[str]:
    return {n.kernel for key in ("graph1", "graph2") for n in plans[key].nodes()
            if isinstance(n, Launch)}


def _buffers(plans: dict) -> set[str]:
    out = set()
    for key in ("graph1", "graph2"):
        for node in plans[key].nodes():
            out.update(acc.buffer for acc in node.accesses)
    return out


# ------------------------------------------------------------------------------ weight 0
@pytest.mark.parametrize("preset", ["tiny", "seed"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_weight_zero_is_the_core_plan_record_for_record(preset, precision):
    core = DQNConfig.preset(preset, precision=precision, **CORE_STEP)
    shaped = core.replace(**SHAPES_CHANGED)
    assert not shaped.second_wave_on
    plans_core, plans_shaped = _plans(core), _plans(shaped)
    assert _described(plans_shaped) == _described(plans_core)
    assert not _kernels(plans_core) & _wave_kernels()
    wave_buffers = set(CpuEngine(core.replace(**SOURCES["iqn"])).layout.specs) - \
        set(CpuEngine(core).layout.specs)
    assert wave_buffers and not _buffers(plans_core) & wave_buffers


@pytest.mark.parametrize("source", fast_sources())
def test_a_source_adds_records_and_keeps_every_core_kernel(source):
    core = DQNConfig.preset("tiny")
    on = core.replace(**SOURCES[source])
    plans_core, plans_on = _plans(core), _plans(on)
    # An injected source's budget launch replaces the core's (one pass: wave_plan.budget); the
    # MSE warm-up runs the C51 front as its three kernels (graph1_plan.gather_project_dueling).
    # With an injected source, graph 2's Adam reads step_scalars' safety_scale (adam_update)
    # instead of summing the partials itself, unless step_scalars runs beside it
    # (graph2_plan.scalars_beside_adam).
    replaced = {"clip_saxpy_norm_partial"} if injected_sources(on) else set()
    if not scalars_beside_adam(on):
        replaced.add("adam_update_norm")
    if gather_project_dueling(core) and not gather_project_dueling(on):
        replaced.add("c51_gather_project_dueling_branches")
        assert {"double_dqn_gather_branches", "c51_project_grad"} <= _kernels(plans_on)
    assert _kernels(plans_core) - replaced <= _kernels(plans_on)
    assert not replaced & _kernels(plans_on)
    assert _kernels(plans_on) & _wave_kernels()
    for key in ("graph1", "graph2"):
        assert plans_on[key].node_count() > plans_core[key].node_count() or key == "graph2" \
            and not on.iqn_on


# ------------------------------------------------------------------------------ planted NaNs
@contextlib.contextmanager
def _patched(obj, name, wrap):
    saved = getattr(obj, name)
    setattr(obj, name, wrap(saved))
    try:
        yield
    finally:
        setattr(obj, name, saved)


@contextlib.contextmanager
def _fast_plant(match, buffer: Buf):
    """After the first record ``match(node)`` accepts runs, element 0 of ``buffer`` is NaN."""
    planted = []

    def wrap(run_node):
        def run(mem, node):
            run_node(mem, node)
            if not planted and match(node):
                mem.view(buffer, 1)[0] = np.nan
                planted.append(node)
        return run

    with _patched(cpu_executor, "run_node", wrap):
        yield planted


def _launch(kernel: str, **args):
    def match(node):
        return isinstance(node, Launch) and node.kernel == kernel and all(
            node.args.get(k) == Buf(v) if isinstance(v, str) else node.args.get(k) == v
            for k, v in args.items())
    return match


def _nan_at_first(x: np.ndarray) -> np.ndarray:
    x = np.array(x, copy=True)
    x.reshape(-1)[0] = np.nan
    return x


def _out_replaced(fn, **fields):
    """``fn`` whose result (a dataclass) has element 0 of each named field set to NaN."""
    def run(*a, **k):
        out = fn(*a, **k)
        return dataclasses.replace(out, **{f: _nan_at_first(getattr(out, f)) for f in fields})
    return run


def _tuple_replaced(fn, field: str):
    """``fn`` whose result (a NamedTuple) has element 0 of ``field`` set to NaN."""
    def run(*a, **k):
        out = fn(*a, **k)
        return out._replace(**{field: _nan_at_first(getattr(out, field))})
    return run


def _gemm_into(buffer: Buf):
    """The record of the GEMM that writes ``buffer``: a cuBLASLt GEMM, or a launch of a backward
    GEMM kernel (``step_program.BACKWARD_GEMM_KERNEL``)."""
    from foxhunt.fast.step_program import BACKWARD_GEMM_KERNEL

    return lambda node: ((isinstance(node, Gemm) and node.c == buffer)
                         or (isinstance(node, Launch) and node.kernel in BACKWARD_GEMM_KERNEL.values()
                             and node.args.get("c") == buffer))


def _slot_cases(config: DQNConfig) -> dict:
    """``{slot: (reference patch context, fast plant context)}``: each second-wave buffer with
    a sentinel slot, poisoned at the moment its slot watches it (after the records that read it
    have run) in both implementations."""
    lay = ParamLayout(config)
    w_s1 = lay["w_s1"].offset

    def nan_at(offset):
        def wrap(fn):
            def run(*a, **k):
                grad = fn(*a, **k)
                grad[offset] = np.nan
                return grad
            return run
        return wrap

    def trace_post_aux(fn):
        def run(*a, trace=None, **k):
            grad = fn(*a, trace=trace, **k)
            if trace is not None and "d_h2_post_aux" in trace:
                trace["d_h2_post_aux"] = _nan_at_first(trace["d_h2_post_aux"])
            return grad
        return run

    def mse_loss_after_blend(fn):
        def run(*a, **k):
            out = fn(*a, **k)
            out["mse"] = dataclasses.replace(out["mse"], loss=np.float32(np.nan))
            return out
        return run

    def rb(name):
        return Buf("readback", offset=READBACK_INDEX[name])

    return {
        "iqn_d_h2": (lambda: _patched(iqn_kernels, "iqn_modulate_backward",
                                      lambda fn: _tuple_replaced(fn, "d_h2")),
                     lambda: _fast_plant(_launch("iqn_modulate_backward"), Buf("iqn_d_h2"))),
        "iqn_d_quantiles": (lambda: _patched(iqn_kernels, "iqn_quantile_huber",
                                             lambda fn: _tuple_replaced(fn, "dq")),
                            lambda: _fast_plant(_launch("iqn_quantile_huber"), Buf("iqn_dq"))),
        "iqn_trunk_grad": (lambda: _patched(iqn_head, "trunk_backward", nan_at(w_s1)),
                           lambda: _fast_plant(_gemm_into(Buf("iqn_trunk_grad", offset=w_s1)),
                                               Buf("iqn_trunk_grad", offset=w_s1))),
        "d_h2_post_iqn": (lambda: _patched(ref_step, "iqn_loss_and_grads",
                                           lambda fn: _out_replaced(fn, d_h2_guarded=1)),
                          lambda: _fast_plant(_launch("h2_grad_sum_mask", dh2_out="dh2_iqn"),
                                              Buf("dh2_iqn"))),
        "aux_next_bar_d_h2": (lambda: _patched(ref_step, "aux_loss_and_grads",
                                               lambda fn: _out_replaced(fn, d_h2_nb=1)),
                              lambda: _fast_plant(_launch("clamp_finite", x="aux_d_h2_nb"),
                                                  Buf("aux_d_h2_nb"))),
        "aux_regime_d_h2": (lambda: _patched(ref_step, "aux_loss_and_grads",
                                             lambda fn: _out_replaced(fn, d_h2_rg=1)),
                            lambda: _fast_plant(_launch("saxpy", x="aux_d_h2_rg"),
                                                Buf("aux_d_h2_rg"))),
        "d_h2_post_aux": (lambda: _patched(ref_step, "backward", trace_post_aux),
                          lambda: _fast_plant(_launch("h2_grad_sum_mask", parts="dh2_c51"),
                                              Buf("dh2_c51"))),
        "ens_d_logits": (lambda: _patched(ref_step, "ens_loss_and_grads",
                                          lambda fn: _out_replaced(fn, d_logits=1)),
                         lambda: _fast_plant(_gemm_into(Buf("ens_dpre")), Buf("ens_d_v"))),
        "ens_trunk_grad": (lambda: _patched(aux_heads, "trunk_backward", nan_at(w_s1)),
                           lambda: _fast_plant(_gemm_into(Buf("ens_trunk_grad", offset=w_s1)),
                                               Buf("ens_trunk_grad", offset=w_s1))),
        "mse_loss": (lambda: _patched(ref_trainer, "loss_and_grads", mse_loss_after_blend),
                     lambda: _fast_plant(_launch("mse_loss_blend"), rb("mse_loss"))),
    }


#: The planted slots of each source (``SOURCES`` names).
SLOTS = {"iqn": ("iqn_d_h2", "iqn_d_quantiles", "iqn_trunk_grad", "d_h2_post_iqn"),
         "aux": ("aux_next_bar_d_h2", "aux_regime_d_h2", "d_h2_post_aux"),
         "ens": ("ens_d_logits", "ens_trunk_grad"),
         "mse": ("mse_loss",)}


def _run_both(case, state, ref_ctx, fast_ctx):
    ref = Trainer(case.config)
    ref.load_state_dict({k: v.copy() for k, v in state.items()})
    fast = CpuTrainer(case.config)
    fast.load_state_dict({k: v.copy() for k, v in state.items()})
    with ref_ctx(), np.errstate(all="ignore"):
        want = run_step(ref, case.batch)
    with fast_ctx() as planted:
        got = run_step(fast, case.batch)
    assert planted is None or planted, "the fast plan has no record that writes the poisoned buffer"
    return want, got


def _assert_only_its_flag(case, slot: str, want, got) -> None:
    """Both steps raised slot ``slot`` alone and agree within the step bounds."""
    expected = np.zeros(sentinels.NUM_SENTINEL_SLOTS, np.int32)
    expected[sentinels.index(slot)] = 1
    assert np.array_equal(want.state["flags"], expected), np.flatnonzero(want.state["flags"])
    assert np.array_equal(got.state["flags"], expected), np.flatnonzero(got.state["flags"])
    bad = failures(compare_step(case.config, case.state, want, got))
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("source, slot", [(src, slot) for src, slots in SLOTS.items()
                                          for slot in slots if src in fast_sources()])
def test_a_nan_planted_in_a_source_buffer_raises_exactly_its_flag(source, slot, precision,
                                                                 monkeypatch):
    """The trunk gradients' launches unfused (``FUSE_AUX_TRUNK_GRAD``, ``FUSE_GUARD_MASK`` off:
    the plants name the unfused launches; the fused ones' plants: the next test)."""
    set_trunk_grads(monkeypatch, False)
    case = shared_case("tiny", precision, "warm", source)
    ref_ctx, fast_ctx = _slot_cases(case.config)[slot]
    want, got = _run_both(case, case.state, ref_ctx, fast_ctx)
    _assert_only_its_flag(case, slot, want, got)


#: The fused trunk-gradient launches (``step_program``'s switch, the source, the slot and where
#: the fast plan is poisoned: after the fused launch that reads or writes the watched buffer).
FUSED_PLANTS = [
    ("FUSE_AUX_TRUNK_GRAD", "aux", "aux_next_bar_d_h2",
     (_launch("h2_grad_sum_aux_mask", aux_a="aux_d_h2_nb"), Buf("aux_d_h2_nb"))),
    ("FUSE_AUX_TRUNK_GRAD", "aux", "aux_regime_d_h2",
     (_launch("h2_grad_sum_aux_mask", aux_b="aux_d_h2_rg"), Buf("aux_d_h2_rg"))),
    ("FUSE_AUX_TRUNK_GRAD", "aux", "d_h2_post_main",
     (_launch("h2_grad_sum_aux_mask", dh2_main="dh2_main_c51"), Buf("dh2_main_c51"))),
    ("FUSE_AUX_TRUNK_GRAD", "aux", "d_h2_post_aux",
     (_launch("h2_grad_sum_aux_mask", dh2="dh2_c51"), Buf("dh2_c51"))),
    ("FUSE_GUARD_MASK", "iqn", "d_h2_post_iqn",
     (_launch("h2_guard_mask", dh2_out="dh2_iqn"), Buf("dh2_iqn"))),
]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("switch, source, slot, fused_plant", FUSED_PLANTS)
def test_a_nan_planted_beside_a_fused_trunk_grad_raises_exactly_its_flag(
        switch, source, slot, fused_plant, precision, monkeypatch):
    """With a source's trunk gradient in fewer launches (``FUSE_AUX_TRUNK_GRAD``,
    ``FUSE_GUARD_MASK``, the default): each buffer a fused launch reads or writes that a slot
    watches, poisoned after it ran, raises that slot alone, as the reference's poisoned value
    does."""
    from foxhunt.fast import step_program

    monkeypatch.setattr(step_program, switch, True)
    case = shared_case("tiny", precision, "warm", source)
    if slot == "d_h2_post_main":
        def trace_post_main(fn):
            def run(*a, trace=None, **k):
                grad = fn(*a, trace=trace, **k)
                if trace is not None and "d_h2_post_aux" in trace:  # the C51 pass's trace
                    trace["d_h2"] = _nan_at_first(trace["d_h2"])  # slot 33's (trainer.py)
                return grad
            return run
        ref_ctx = lambda: _patched(ref_step, "backward", trace_post_main)  # noqa: E731
    else:
        ref_ctx = _slot_cases(case.config)[slot][0]
    want, got = _run_both(case, case.state, ref_ctx, lambda: _fast_plant(*fused_plant))
    _assert_only_its_flag(case, slot, want, got)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("key, slot", [("adam_m", "iqn_adam_m_max"), ("adam_v", "iqn_adam_v_max"),
                                       ("params", "iqn_weight_max")])
def test_a_nan_in_the_iqn_state_raises_its_mech5_flag(key, slot, precision):
    case = shared_case("tiny", precision, "warm", "iqn")
    state = case.fresh_state()
    lo, hi = ParamLayout(case.config).iqn_range
    state[key][lo + 3] = np.nan
    want, got = _run_both(case, state, contextlib.nullcontext, contextlib.nullcontext)
    assert want.state["flags"][sentinels.index(slot)] == 1
    assert np.array_equal(got.state["flags"], want.state["flags"])
    for name in ("params", "adam_m", "adam_v"):  # the same non-finite maps
        assert np.array_equal(np.isfinite(got.state[name]), np.isfinite(want.state[name])), name
    if key == "params":  # (a non-finite moment makes the step bounds' own scales non-finite)
        bad = failures(compare_step(case.config, state, want, got))
        assert not bad, "\n".join(bad)


# ------------------------------------------------------------------------------ the bounds see it
def _zero_field(fn, field: str):
    def run(*a, **k):
        out = fn(*a, **k)
        return out._replace(**{field: np.zeros_like(getattr(out, field))})
    return run


#: A fast step that drops one source's gradient (the CPU twins patched while it runs).
DROPPED = {
    "iqn": lambda: _patched(iqn_kernels, "iqn_quantile_huber", lambda fn: _zero_field(fn, "dq")),
    "aux": lambda: _patched(aux_kernels, "aux_regime_loss_grad",
                            lambda fn: _zero_field(fn, "d_logits")),
    "ens": lambda: _patched(ens_kernels, "ens_kl_grad", lambda fn: _zero_field(fn, "d_v")),
    "mse": lambda: _patched(warmup_kernels, "mse_warmup",
                            lambda fn: lambda *a, **k: fn(*a, **k)._replace(dlogits=a[6].copy())),
}


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("source", [s for s in DROPPED if s in fast_sources()])
def test_the_step_bounds_reject_a_step_without_the_source(source, precision):
    """Each source's contribution is visible to step conformance: a fast step whose source
    gradient is dropped fails it (and the same step with the source passes: the other tests)."""
    case = shared_case("tiny", precision, "warm", source)
    want, got = _run_both(case, case.state, contextlib.nullcontext, DROPPED[source])
    assert failures(compare_step(case.config, case.state, want, got))


# ------------------------------------------------------------------------------ state
def test_the_device_step_counter_is_the_state_step_and_keys_by_the_seed():
    config = DQNConfig.preset("tiny", **SOURCES["iqn"])
    case = shared_case("tiny", "f32", "warm", "iqn")
    fast = CpuTrainer(config, seed=0)
    fast.load_state_dict(case.fresh_state())
    assert int(fast.state_dict()["seed"][0]) == int(case.state["seed"][0]) == fast.seed
    step0 = int(case.state["step"][0])
    assert int(fast.debug_buffer("step_count")[0]) == step0
    fast.step(case.batch)
    assert int(fast.state_dict()["step"][0]) == step0 + 1 == fast.step_count
    # The fractions the step drew are the reference generator's at (seed, step0).
    want = iqn_kernels.iqn_tau_cos(np.array([step0], np.int64), int(case.state["seed"][0]), 0,
                                   rng.STREAMS["iqn_tau_online"],
                                   config.batch_size * config.iqn_quantiles, config.iqn_embed)
    assert np.array_equal(fast.debug_buffer("iqn_tau")[:want.tau.size], want.tau)
