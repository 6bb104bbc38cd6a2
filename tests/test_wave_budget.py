"""clip_saxpy_norm_partial_wave: the budget pipeline with the IQN and ensemble injections in one
pass (issue 18 performance; SPEC 4 step 5).

The reference twin against today's staged composition (``clip_saxpy_norm_partial`` once for
C51 + CQL, then once per source over the zero-padded source with the running gradient re-read
unclipped), bit for bit, with NaN/Inf planted and every clip firing and not; a source that is
off changes nothing; the argument checks; the plans (the core keeps its launch, a source that
is on replaces it by the one-pass launch); the CUDA kernel builds with NVRTC.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from foxhunt.fast.cpu_executor import CpuEngine
from foxhunt.fast.records import Launch
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.kernels import optim, wave

F32 = np.float32
SEG = 256
N = 3000
ENDS = {"iqn": 1700, "ens": 2300}
FLT_MAX = np.finfo(F32).max


def _parts(x: np.ndarray, count: int) -> np.ndarray:
    out = np.zeros(count, F32)
    own = optim.grad_norm_partial(x, SEG)
    out[:own.size] = own
    return out


def _inputs(rng, fire: dict[str, bool]):
    count = -(-N // SEG)
    xs = {"base": N, "inject": N, **ENDS}
    kw = {}
    for name, n in xs.items():
        x = rng.normal(0, 0.1, n).astype(F32)
        x[rng.choice(n, 3, replace=False)] = [np.nan, np.inf, -np.inf]
        norm = float(np.sqrt(optim.grad_norm_sq(x)))
        kw[name] = x
        kw[f"{name}_partials"] = _parts(x, count)
        kw[f"{name}_max_norm"] = F32(norm * (0.5 if fire[name] else 2.0))
    return kw


def _staged(kw, a, iqn_a, ens_a):
    """Today's graph 1: one clip_saxpy_norm_partial per stage (optim's reference kernels)."""
    s = optim.clip_saxpy_norm_partial(kw["base"], kw["inject"], kw["base_max_norm"],
                                      kw["base_partials"], a, kw["inject_max_norm"],
                                      kw["inject_partials"], SEG)
    norms = []
    for src, w in (("iqn", iqn_a), ("ens", ens_a)):
        padded = np.zeros(N, F32)
        padded[:ENDS[src]] = kw[src]
        s = optim.clip_saxpy_norm_partial(s.out, padded, FLT_MAX, s.partials, w,
                                          kw[f"{src}_max_norm"], kw[f"{src}_partials"], SEG)
        norms.append(s.inject_norm_sq)
    return s, norms


def _wave(kw, a, iqn_a, ens_a, *, iqn=True, ens=True):
    return wave.clip_saxpy_norm_partial_wave(
        kw["base"], kw["inject"], kw["base_max_norm"], kw["base_partials"], a,
        kw["inject_max_norm"], kw["inject_partials"], kw["iqn"] if iqn else None, iqn_a,
        kw["iqn_max_norm"], kw["iqn_partials"] if iqn else None, kw["ens"] if ens else None,
        ens_a, kw["ens_max_norm"], kw["ens_partials"] if ens else None, SEG)


@pytest.mark.parametrize("fires", list(itertools.product([False, True], repeat=4)))
def test_one_pass_is_the_staged_composition_bit_for_bit(fires):
    fire = dict(zip(("base", "inject", "iqn", "ens"), fires))
    rng = np.random.default_rng(sum(b << k for k, b in enumerate(fires)))
    kw = _inputs(rng, fire)
    staged, (iqn_sq, ens_sq) = _staged(kw, F32(1), F32(0.7), F32(0.3))
    got = _wave(kw, F32(1), F32(0.7), F32(0.3))
    # -0.0 past a source's range: the staged SAXPY of a zero gives +0.0, the range leaves it.
    assert np.array_equal(got.out.view(np.uint32) & 0x7FFFFFFF,
                          staged.out.view(np.uint32) & 0x7FFFFFFF)
    assert np.array_equal(np.isnan(got.out), np.isnan(staged.out))
    assert np.array_equal(got.partials, staged.partials)
    assert (got.iqn_norm_sq, got.ens_norm_sq) == (iqn_sq, ens_sq)
    # The clips act as configured: a firing clip scales its source below its own norm.
    for src, sq in (("iqn", got.iqn_norm_sq), ("ens", got.ens_norm_sq)):
        scale = optim.clip_scale(sq, kw[f"{src}_max_norm"])
        assert (scale < 1) == fire[src]
    # Planted non-finite source elements are skipped; a NaN base stays NaN.
    assert np.isnan(got.out[np.isnan(kw["base"])]).all()


def test_the_injection_by_hand_at_one_element():
    rng = np.random.default_rng(7)
    kw = _inputs(rng, dict(base=True, inject=False, iqn=True, ens=True))
    got = _wave(kw, F32(1), F32(2), F32(0.5))
    i = next(k for k in range(ENDS["iqn"]) if all(np.isfinite(kw[s][k]) for s in
                                                   ("base", "inject", "iqn", "ens")))
    s = {name: optim.clip_scale(optim.grad_norm_final(kw[f"{name}_partials"]),
                                kw[f"{name}_max_norm"])
         for name in ("base", "inject", "iqn", "ens")}
    r = F32(kw["base"][i] * s["base"])
    r = F32(r + F32(F32(1) * F32(kw["inject"][i] * s["inject"])))
    r = F32(r + F32(F32(2) * F32(kw["iqn"][i] * s["iqn"])))
    r = F32(r + F32(F32(0.5) * F32(kw["ens"][i] * s["ens"])))
    assert got.out[i] == r
    # Past the ensemble's range only the core pipeline wrote the element.
    core = optim.clip_saxpy_norm_partial(kw["base"], kw["inject"], kw["base_max_norm"],
                                         kw["base_partials"], F32(1), kw["inject_max_norm"],
                                         kw["inject_partials"], SEG)
    tail = slice(ENDS["ens"], N)
    np.testing.assert_array_equal(got.out[tail], core.out[tail])


@pytest.mark.parametrize("iqn,ens", [(False, False), (True, False), (False, True)])
def test_a_source_that_is_off_changes_nothing(iqn, ens):
    kw = _inputs(np.random.default_rng(3), dict(base=True, inject=True, iqn=True, ens=False))
    got = _wave(kw, F32(1), F32(1), F32(1), iqn=iqn, ens=ens)
    want = optim.clip_saxpy_norm_partial(kw["base"], kw["inject"], kw["base_max_norm"],
                                         kw["base_partials"], F32(1), kw["inject_max_norm"],
                                         kw["inject_partials"], SEG).out
    for src, on in (("iqn", iqn), ("ens", ens)):
        if on:
            end = ENDS[src]
            want = want.copy()
            want[:end] = optim.clipped_saxpy(want[:end], kw[src], F32(1), kw[f"{src}_max_norm"],
                                             optim.grad_norm_final(kw[f"{src}_partials"]))
        else:
            assert getattr(got, f"{src}_norm_sq") == 0
    assert np.array_equal(got.out, want, equal_nan=True)
    assert np.array_equal(got.partials, optim.grad_norm_partial(want, SEG))


@pytest.mark.parametrize("edit,match", [
    (dict(iqn_partials=None), r"^iqn, iqn_partials"),
    (dict(ens=np.zeros(N + 1, F32)), r"^ens: length"),
    (dict(iqn_partials=np.zeros(3, F32)), r"^iqn_partials: length"),
    (dict(ens_max_norm=-1.0), r"^ens_max_norm"),
    (dict(iqn=np.zeros(5, np.float64)), r"^iqn"),
])
def test_bad_arguments_name_the_field(edit, match):
    kw = _inputs(np.random.default_rng(1), dict(base=False, inject=False, iqn=False, ens=False))
    kw.update(edit)
    with pytest.raises(ValueError, match=match):
        wave.clip_saxpy_norm_partial_wave(
            kw["base"], kw["inject"], kw["base_max_norm"], kw["base_partials"], 1.0,
            kw["inject_max_norm"], kw["inject_partials"], kw["iqn"], 1.0, kw["iqn_max_norm"],
            kw["iqn_partials"], kw["ens"], 1.0, kw["ens_max_norm"], kw["ens_partials"], SEG)


def _budget_launches(config) -> list[str]:
    g1 = CpuEngine(config).plans["graph1"]
    return [n.kernel for n in g1.nodes() if isinstance(n, Launch)
            and n.kernel.startswith("clip_saxpy_norm_partial")]


@pytest.mark.parametrize("sources,want", [
    ({}, ["clip_saxpy_norm_partial"]),
    (dict(lambda_iqn=1.0), ["clip_saxpy_norm_partial_wave"]),
    (dict(ens_weight=0.5), ["clip_saxpy_norm_partial_wave"]),
    (dict(lambda_iqn=1.0, ens_weight=0.5), ["clip_saxpy_norm_partial_wave"]),
])
def test_graph1_has_one_budget_launch(sources, want):
    assert _budget_launches(DQNConfig.preset("tiny").replace(**sources)) == want


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_kernel_builds_with_nvrtc(arch, tmp_path):
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings is not installed")
    from foxhunt.fast._build import HEADER_SUFFIXES, compile_sources, source_files

    sources = {n: b for n, b in source_files().items()
               if n == "optim.cu" or n.endswith(HEADER_SUFFIXES)}
    module = compile_sources(arch, "ptx", cache_root=tmp_path, sources=sources)
    assert module.logs["optim.cu"] == ""
    assert module.kernels["clip_saxpy_norm_partial_wave"] == "optim.cu"
    # 4 + 2 per source (vector, partials) + 6 outputs pointers; n, 2 source n's, count,
    # final_threads, block_size 64-bit; 7 float scalars.
    types = [p.ptx_type for p in module.params["clip_saxpy_norm_partial_wave"]]
    assert len(types) == 27 and types.count("f32") == 7
