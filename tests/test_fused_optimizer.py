"""``adam_spectral_polyak``: graph 2's optimiser chain (Adam, every weight matrix's spectral
norm, Polyak with the BF16 mirrors) in one launch.

Its reference twin is the composition of the three reference kernels; the CUDA kernel's outputs
are compared with it in conformance (``conformance/specs/spectral.py``). Here: where graph 2
plans it, that the twin is that composition, that a step with it ends in the same bits as a
step with the three launches (the CPU executor; and the GPU, where there is one), and on the GPU
that the kernel's outputs are bitwise the three CUDA kernels'.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from foxhunt.fast import graph2_plan
from foxhunt.fast.kernels.spectral import adam_spectral_polyak_fits
from foxhunt.fast.records import Launch
from foxhunt.reference.batch import Batch
from foxhunt.reference.config import DQNConfig, source_overrides
from foxhunt.reference.kernels import optim, spectral

F32 = np.float32
FUSED = "adam_spectral_polyak"


def _names(ops) -> list[str]:
    return [node.kernel for node in ops.nodes() if isinstance(node, Launch)]


def _both_ways(monkeypatch, make, run) -> list:
    """``run(trainer)`` for a trainer ``make()`` builds with the fused launch in graph 2, then
    for one built with the three (``graph2_plan.fused_optimizer`` patched off)."""
    out = []
    for fused in (True, False):
        with monkeypatch.context() as patch:
            if not fused:
                patch.setattr(graph2_plan, "fused_optimizer", lambda prog: False)
            trainer = make()
            try:
                names = _names(trainer.engine.plans["graph2"])
                assert names.count(FUSED) + names.count(FUSED + "_ptr") == int(fused)
                out.append(run(trainer))
            finally:
                getattr(trainer, "close", lambda: None)()
    return out


def _overrides(source: str) -> dict:
    """A step variant's config overrides; "adaptive": the core step with the adaptive tau (the
    ``_ptr`` kernel)."""
    if source == "adaptive":
        return {**source_overrides("core"), "adaptive_epsilon_tau": True}
    return source_overrides(source)


def _differ(state0: dict, state1: dict) -> list[str]:
    """The state entries whose bytes differ (and any entry only one side has)."""
    keys = state0.keys() | state1.keys()
    return sorted(k for k in keys if k not in state0 or k not in state1
                  or np.asarray(state0[k]).tobytes() != np.asarray(state1[k]).tobytes())


# ------------------------------------------------------------------------------ in the plan
@pytest.mark.parametrize("overrides, fused", [
    (source_overrides("core"), FUSED), (source_overrides("iqn"), FUSED),
    (source_overrides("all"), FUSED),
    ({**source_overrides("core"), "adaptive_epsilon_tau": True}, FUSED + "_ptr")])
def test_graph2_runs_adam_spectral_and_polyak_as_one_launch(overrides, fused):
    """Seed bf16 step (the CPU executor's plans): the fused launch replaces the main Adam, the
    spectral norm and Polyak; the IQN head's Adam runs before it (its range is normed and
    blended there); with the adaptive tau the kernel reads tau through a pointer."""
    from foxhunt.fast.cpu_executor import CpuEngine

    config = DQNConfig.preset("seed", precision="bf16", **overrides)
    names = _names(CpuEngine(config).plans["graph2"])
    assert names.count(fused) == 1
    assert not {"batched_spectral_norm", "polyak_update_mirror", "polyak_update_mirror_ptr"} & set(names)
    assert names.count("adam_update") == int(config.iqn_on)
    assert len({FUSED, FUSED + "_ptr"} & set(names)) == 1
    if config.iqn_on:
        assert names.index("adam_update") < names.index(fused)


def test_fits_needs_the_matrices_to_tile_the_buffer_from_its_start_in_order():
    assert adam_spectral_polyak_fits([0, 10, 30], [8, 20, 5], 40)
    assert adam_spectral_polyak_fits([0, 8], [8, 2], 10)  # no tail, the buffer's end
    assert not adam_spectral_polyak_fits([2, 10], [8, 2], 20)  # elements before the first
    assert not adam_spectral_polyak_fits([0, 6], [8, 2], 20)  # overlap
    assert not adam_spectral_polyak_fits([0, 12], [8, 10], 20)  # past the end
    assert not adam_spectral_polyak_fits([], [], 20)


@pytest.mark.parametrize("precision, source", [("f32", "core"), ("bf16", "core"),
                                               ("bf16", "iqn"), ("bf16", "all"),
                                               ("bf16", "adaptive")])
def test_on_the_cpu_executor_the_fused_launch_steps_bitwise_as_its_three_kernels(
        monkeypatch, precision, source):
    """The twin is the composition of the three kernels' reference functions, so the CPU
    executor's steps with and without the fused launch end in the same bits (every state
    buffer: parameters, target, moments, spectral vectors; the step scalars)."""
    from foxhunt.fast.cpu_executor import CpuTrainer

    config = DQNConfig.preset("tiny", precision=precision, **_overrides(source))
    batches = [Batch.random(config, np.random.default_rng(s)) for s in range(3)]

    def run(trainer):
        scalars = [trainer.step(b) for b in batches]
        return trainer.state_dict(), scalars

    (state0, scalars0), (state1, scalars1) = _both_ways(
        monkeypatch, lambda: CpuTrainer(config, seed=5), run)
    assert not _differ(state0, state1)
    assert scalars0 == scalars1


# ------------------------------------------------------------------------------ the twin
def _sample(rng, *, poison: bool = False) -> dict:
    shapes, at = [], 0
    for rows, cols in ((6, 9), (9, 6), (3, 12)):
        shapes.append((at, rows, cols))
        at += rows * cols + rows + 3
    n = at
    kw = {"param": (rng.standard_normal(n) * 2).astype(F32),
          "grad": (rng.standard_normal(n) * 0.1).astype(F32),
          "m": (rng.standard_normal(n) * 1e-3).astype(F32),
          "v": rng.uniform(0, 1e-4, n).astype(F32), "target": rng.standard_normal(n).astype(F32),
          "us": [np.full(r, 1 / np.sqrt(r), F32) for _, r, _ in shapes],
          "vs": [np.full(c, 1 / np.sqrt(c), F32) for _, _, c in shapes], "shapes": shapes,
          "n_adam": shapes[2][0] + 7, "step": 4, "lr": 1e-2, "beta1": 0.9, "beta2": 0.999,
          "eps": 1e-8, "weight_decay": 0.01, "grad_scale": F32(0.5), "weight_clamp": F32(50.0),
          "sigma_max": 1.5, "tau": F32(0.05)}
    if poison:
        kw["grad"][55] = np.nan  # Adam leaves element 55 (matrix 0's tail: no norm scales it)
        kw["param"][shapes[1][0] + 2] = np.inf  # Adam zeroes it (its clamp): matrix 1 stays finite
        kw["target"][-1] = np.nan
    return kw


@pytest.mark.parametrize("poison", [False, True])
def test_the_twin_is_adam_then_the_spectral_norms_then_polyak_with_the_mirrors(poison):
    kw = _sample(np.random.default_rng(3), poison=poison)
    r = spectral.adam_spectral_polyak(**kw)
    n_adam = kw["n_adam"]
    p, m, v = kw["param"].copy(), kw["m"].copy(), kw["v"].copy()
    a = optim.adam_update(p[:n_adam], kw["grad"][:n_adam], m[:n_adam], v[:n_adam],
                          step=kw["step"], lr=kw["lr"], beta1=kw["beta1"], beta2=kw["beta2"],
                          eps=kw["eps"], weight_decay=kw["weight_decay"],
                          grad_scale=kw["grad_scale"], weight_clamp=kw["weight_clamp"])
    p[:n_adam], m[:n_adam], v[:n_adam] = a.param, a.m, a.v
    sigmas = []
    for k, (o, rows, cols) in enumerate(kw["shapes"]):
        s = spectral.spectral_norm(p[o:o + rows * cols].reshape(rows, cols), kw["us"][k],
                                   kw["vs"][k], kw["sigma_max"])
        p[o:o + rows * cols] = s.w.ravel()
        assert r.us[k].tobytes() == s.u.tobytes() and r.vs[k].tobytes() == s.v.tobytes()
        sigmas.append(s.sigma)
    blend = optim.polyak_update_mirror(kw["target"], p, kw["tau"])
    for name, want in (("param", p), ("m", m), ("v", v), ("target", blend.target),
                       ("online_bf16", blend.online_bf16), ("target_bf16", blend.target_bf16)):
        assert getattr(r, name).tobytes() == want.tobytes(), name
    assert np.array_equal(r.sigmas, sigmas)
    # at least one matrix was scaled, and past n_adam the moments are the inputs
    assert any(s > kw["sigma_max"] for s in sigmas)
    assert r.m[n_adam:].tobytes() == kw["m"][n_adam:].tobytes()
    if poison:
        assert r.param[55] == kw["param"][55] and r.m[55] == kw["m"][55]
        assert np.isnan(r.target[-1]) and np.all(np.isfinite(r.param))


@pytest.mark.parametrize("change, message", [
    (lambda kw: kw.update(n_adam=10**6), "n_adam"),
    (lambda kw: kw.update(shapes=[(1, 6, 9), *kw["shapes"][1:]]), "shapes[0][0]"),
    (lambda kw: kw.update(shapes=[kw["shapes"][0], (4, 9, 6), kw["shapes"][2]]), "shapes[1][0]"),
    (lambda kw: kw.update(shapes=[*kw["shapes"][:2], (kw["shapes"][2][0], 3, 10**4)]),
     "shapes[2]"),
    (lambda kw: kw.update(us=kw["us"][:2]), "len(us)"),
    (lambda kw: kw.update(vs=[kw["vs"][0][:-1], *kw["vs"][1:]]), "vs[0]"),
    (lambda kw: kw.update(target=kw["target"][:-1]), "target"),
    (lambda kw: kw.update(tau=2.0), "tau"),
    (lambda kw: kw.update(sigma_max=0.0), "sigma_max"),
])
def test_the_twin_names_the_argument_it_refuses(change, message):
    kw = _sample(np.random.default_rng(0))
    change(kw)
    with pytest.raises(ValueError, match=re.escape(message)):
        spectral.adam_spectral_polyak(**kw)


# ------------------------------------------------------------------------------ on the GPU
def _gpu_reason() -> str | None:
    from foxhunt.fast.device import cuda_available

    ok, reason = cuda_available()
    return None if ok else reason


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=f"no CUDA device/driver: {_gpu_reason()}")
@pytest.mark.parametrize("poison", [False, True])
@pytest.mark.parametrize("kernel", [FUSED, FUSED + "_ptr"])
def test_on_the_gpu_the_kernel_gives_the_three_kernels_bits(kernel, poison):
    """adam_update on [0, n_adam), batched_spectral_norm, polyak_update_mirror (their CUDA
    kernels, in a row) against the one launch: every output byte for byte."""
    from foxhunt.fast.kernels import optim as fopt
    from foxhunt.fast.kernels import spectral as fspec

    kw = _sample(np.random.default_rng(7), poison=poison)
    got = getattr(fspec, kernel)(**kw)
    n_adam = kw["n_adam"]
    p, m, v = kw["param"].copy(), kw["m"].copy(), kw["v"].copy()
    a = fopt.adam_update(p[:n_adam], kw["grad"][:n_adam], m[:n_adam], v[:n_adam],
                         step=kw["step"], lr=kw["lr"], beta1=kw["beta1"], beta2=kw["beta2"],
                         eps=kw["eps"], weight_decay=kw["weight_decay"],
                         grad_scale=kw["grad_scale"], weight_clamp=kw["weight_clamp"])
    p[:n_adam], m[:n_adam], v[:n_adam] = a.param, a.m, a.v
    views = [p[o:o + rows * cols].reshape(rows, cols) for o, rows, cols in kw["shapes"]]
    s = fspec.batched_spectral_norm(views, kw["us"], kw["vs"], kw["sigma_max"])
    for view, w in zip(views, s.ws):
        view[...] = w
    blend = fopt.polyak_update_mirror(kw["target"], p, kw["tau"])
    for name, want in (("param", p), ("m", m), ("v", v), ("target", blend.target),
                       ("online_bf16", blend.online_bf16), ("target_bf16", blend.target_bf16)):
        assert getattr(got, name).tobytes() == want.tobytes(), name
    for k in range(len(kw["shapes"])):
        assert got.us[k].tobytes() == s.us[k].tobytes()
        assert got.vs[k].tobytes() == s.vs[k].tobytes()
        assert F32(got.sigmas[k]).tobytes() == F32(s.sigmas[k]).tobytes()


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=f"no CUDA device/driver: {_gpu_reason()}")
@pytest.mark.parametrize("precision, source", [("f32", "core"), ("bf16", "core"),
                                               ("bf16", "all"), ("bf16", "adaptive")])
def test_on_the_gpu_the_fused_launch_steps_bitwise_as_its_three_kernels(monkeypatch, precision,
                                                                         source):
    """Seed preset, 3 steps (a NaN in one batch's rewards in the last): the GPU steps with and
    without the fused launch end in the same bits (graph replays of the step)."""
    from foxhunt.fast.trainer import Trainer

    config = DQNConfig.preset("seed", precision=precision, **_overrides(source))
    batches = [Batch.random(config, np.random.default_rng(s)) for s in range(3)]
    batches[2].r[3] = np.nan

    def run(trainer):
        for b in batches:
            trainer.step(b)
        return trainer.state_dict()

    assert not _differ(*_both_ways(monkeypatch, lambda: Trainer(config, seed=5), run))
