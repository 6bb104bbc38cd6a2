"""Where the step's scalars run (``graph2_plan.scalars_beside_adam``), with the injected
second-wave sources' norm launches: beside graph 2's Adam, which then computes Mech 6's clip
factor from the total norm's partials itself (``adam_update_norm``), unless an injected source
is on and ``step_program.WAVE_SCALARS_BESIDE_ADAM`` is off (then they end graph 1 and Adam reads
``safety_scale``); and what reads their outputs in graph 2 (the "pre" NaN check, which checks
the readback) comes after them. CPU only: the plans of ``CpuEngine``."""

import pytest

from foxhunt.fast import step_program
from foxhunt.fast.cpu_executor import CpuEngine
from foxhunt.fast.dataflow import dependency_graph
from foxhunt.fast.graph2_plan import scalars_beside_adam
from foxhunt.fast.records import Buf, Launch
from foxhunt.fast.wave_layout import injected_sources
from foxhunt.reference.config import SECOND_WAVE_SOURCES, DQNConfig, source_overrides


def _kernels(ops) -> list[str]:
    return [n.kernel for n in ops.nodes() if isinstance(n, Launch)]


def _bound(launch: Launch, name: str):
    value = launch.args[name]
    return value.name if isinstance(value, Buf) else value


@pytest.mark.parametrize("wave_beside", [False, True])
@pytest.mark.parametrize("source", ["core", *SECOND_WAVE_SOURCES, "all"])
def test_step_scalars_beside_adam_unless_an_injected_source_ends_graph1(source, wave_beside,
                                                                        monkeypatch):
    monkeypatch.setattr(step_program, "WAVE_SCALARS_BESIDE_ADAM", wave_beside)
    config = DQNConfig.preset("tiny", **source_overrides(source))
    plans = CpuEngine(config, seed=0).plans
    g1, g2 = _kernels(plans["graph1"]), _kernels(plans["graph2"])
    beside = scalars_beside_adam(config)
    assert beside == (not injected_sources(config) or wave_beside)
    assert (g1.count("step_scalars"), g2.count("step_scalars")) == ((0, 1) if beside else (1, 0))
    # the injected sources' norm launches go with step_scalars, one per source
    n_sources = len(injected_sources(config))
    assert (g1.count("source_norm_scalars"), g2.count("source_norm_scalars")) == \
        ((0, n_sources) if beside else (n_sources, 0))
    adams = [n for n in plans["graph2"].nodes()
             if isinstance(n, Launch) and n.kernel.startswith("adam_update")]
    main = next(n for n in adams if _bound(n, "param") == "params2" and n.args["param"].offset == 0)
    if beside:
        assert main.kernel == "adam_update_norm"
        assert _bound(main, "total_partials") == "partials_total"
        assert _bound(main, "clip_bound") == "clip_bound"
        if injected_sources(config):  # graph 1 ends with the budget launch
            assert g1[-1] == "clip_saxpy_norm_partial_wave"
    else:
        assert main.kernel == "adam_update" and _bound(main, "grad_scale") == "safety_scale"
        assert g1[-1] == "step_scalars"  # graph 1's last branch, beside the sources' norms
    assert "adam_update_norm" not in g1 and "adam_update" not in g1


@pytest.mark.parametrize("source", ["core", "aux", "all"])
def test_graph2_readers_of_the_step_scalars_come_after_them(source, monkeypatch):
    monkeypatch.setattr(step_program, "WAVE_SCALARS_BESIDE_ADAM", True)
    config = DQNConfig.preset("tiny", **{**source_overrides(source), "adaptive_signals": True})
    assert scalars_beside_adam(config)
    nodes, deps = dependency_graph([CpuEngine(config, seed=0).plans["graph2"]])
    ancestors = []
    for i in range(len(nodes)):
        found = set()
        for d in deps[i]:
            found |= ancestors[d] | {d}
        ancestors.append(found)
    index = {i: n for i, n in enumerate(nodes) if isinstance(n, Launch)}
    scalars = next(i for i, n in index.items() if n.kernel == "step_scalars")
    readers = [i for i, n in index.items()
               if (n.kernel == "nan_check_fused" and _bound(n, "lengths") == "desc_lens_pre")
               or n.kernel == "isv_signal_build"]
    # the injected sources' norms write the readback too (every source's with "all")
    writers = [scalars] + [i for i, n in index.items() if n.kernel == "source_norm_scalars"]
    assert len(writers) == 1 + (2 if source == "all" else 0)
    assert len(readers) == 2
    assert all(w in ancestors[i] for i in readers for w in writers)
    # ... and nothing of the optimiser chain waits for them
    adam = next(i for i, n in index.items() if n.kernel == "adam_update_norm")
    assert all(w not in ancestors[adam] and adam not in ancestors[w] for w in writers)
