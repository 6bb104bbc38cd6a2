"""Where graph 2 checks params and target after Polyak (``graph2_plan.post_check_in_polyak``):
inside the Polyak launch (``polyak_update_mirror_check``, bound to the ``desc_lens_post``
entries of the sentinel tables) with the constant tau, as its own ``nan_check_fused`` after
``polyak_update_mirror_ptr`` with the adaptive tau; either way the last node of the chain.
CPU only: the plans of ``CpuEngine``."""

import pytest

from foxhunt.fast.cpu_executor import CpuEngine
from foxhunt.fast.dataflow import dependency_graph
from foxhunt.fast.graph2_plan import post_check_in_polyak
from foxhunt.fast.records import Buf, Launch
from foxhunt.fast.sentinel_plan import desc_entries, desc_lengths_split
from foxhunt.reference.config import SECOND_WAVE_SOURCES, DQNConfig, source_overrides


def _launches(ops) -> list[Launch]:
    return [n for n in ops.nodes() if isinstance(n, Launch)]


def _name(value):
    return value.name if isinstance(value, Buf) else value


@pytest.mark.parametrize("source", ["core", *SECOND_WAVE_SOURCES, "all"])
@pytest.mark.parametrize("adaptive_tau", [False, True])
def test_the_post_polyak_check_runs_in_polyak_with_the_constant_tau(source, adaptive_tau):
    config = DQNConfig.preset("tiny", **{**source_overrides(source),
                                         "adaptive_epsilon_tau": adaptive_tau})
    engine = CpuEngine(config, seed=0)
    g2 = engine.plans["graph2"]
    launches = _launches(g2)
    fused = [n for n in launches if n.kernel == "polyak_update_mirror_check"]
    post_checks = [n for n in launches if n.kernel == "nan_check_fused"
                   and _name(n.args["lengths"]) == "desc_lens_post"]
    polyak = "polyak_update_mirror_ptr" if adaptive_tau else "polyak_update_mirror"
    assert post_check_in_polyak(engine.layout, polyak) == (not adaptive_tau)
    if adaptive_tau:
        assert not fused and len(post_checks) == 1
        last = post_checks[0]
    else:
        assert len(fused) == 1 and not post_checks
        assert not any(n.kernel == "polyak_update_mirror" for n in launches)
        last = fused[0]
        args = {k: _name(v) for k, v in last.args.items()}
        assert (args["buffers"], args["lengths"], args["thresholds"], args["flags"]) == \
            ("desc_ptrs", "desc_lens_post", "thresholds", "flags")
        assert args["n_entries"] == engine.layout.sentinel.n_desc
        NP = engine.layout.NP
        assert args["online"] == args["target"] == "params2" and args["n"] == NP
        assert (last.args["online"].offset, last.args["target"].offset) == (0, NP)
    # nothing in graph 2 depends on the node that checks params and target
    nodes, deps = dependency_graph([g2])
    at = next(i for i, n in enumerate(nodes) if n is last)
    assert not any(at in d for d in deps)


def test_the_post_entries_are_params_and_target_and_few():
    # What the fused kernel may check: entries in params2 only, at most POLYAK_CHECK_MAX.
    engine = CpuEngine(DQNConfig.preset("seed", **source_overrides("all")), seed=0)
    sp = engine.layout.sentinel
    lens = desc_lengths_split(sp)["desc_lens_post"]
    post = [piece for k, piece in desc_entries(sp) if lens[k]]
    assert post and {piece.buffer for piece in post} == {"params2"}
    NP = engine.layout.NP
    assert {(p.offset, p.count) for p in post} >= {(0, NP), (NP, NP)}  # all of params, target
