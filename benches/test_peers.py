"""The PyTorch peer computes the reference's step, so timing it against fast is an honest comparison.

On the CPU, float32, ``tiny`` and ``seed`` presets, the core step and each second-wave source
(``torch_wave.WAVE_SOURCES``: IQN, auxiliary heads, ensemble, MSE warm-up) alone and all
together:

- losses, TD errors, double-DQN actions and every per-source gradient equal the reference's
  ``loss_and_grads`` on one batch (distinct online and target parameters);
- two full steps from a shared reference state give the reference ``Trainer``'s parameters,
  target, Adam moments, spectral-norm vectors and step scalars, also in "stressed"
  configurations where the budget clips and the spectral-norm rescale actually fire;
- the IQN quantile fractions are the reference generator's, bit for bit, across the peer's
  precomputed blocks;
- the step's GEMM FLOP count (used for TFLOP/s) equals PyTorch's own FLOP counter.

Tolerances are float32 ones: the two implementations sum in different orders, nothing more.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

import torch

from foxhunt.reference import isv as isv_mod
from foxhunt.reference.batch import Batch
from foxhunt.reference.config import CORE_STEP, DQNConfig, source_overrides
from foxhunt.reference.kernels import rng
from foxhunt.reference.layout import ParamLayout, init_params
from foxhunt.reference.step import loss_and_grads
from foxhunt.reference.trainer import Trainer
from peers.torch_philox import TauTable, uniform
from peers.torch_step import MODES, SCALARS, TorchStep, step_gemm_flops
from peers.torch_wave import WAVE_SOURCES

PRESETS = ("tiny", "seed")
#: Scalars and per-sample values: a few float32 ulps of accumulated rounding.
RTOL = 1e-5
#: Gradients and moments: relative error per element plus a floor relative to the largest
#: element (tiny elements are sums of cancelling terms whose rounding is not relative to them).
GRAD_RTOL, GRAD_FLOOR = 1e-4, 1e-5
#: Parameters after steps: Adam's first steps move each element by about lr * sign(g), so an
#: absolute bound well under lr shows both took the same step.
PARAM_ATOL_LR = 1e-2
UNIT_VECTOR_ATOL = 1e-5

#: Budgets clip (tiny's norms ~0.03 and ~0.15 against budgets 0.007 and 0.0015; with the second
#: wave, IQN ~0.008 and ensemble ~0.005 against 0.001 and 0.0005) and every weight matrix
#: (sigma ~1) is rescaled to sigma_max.
STRESSED = {"max_grad_norm": 0.01, "sigma_max": 0.5}

#: Each second-wave source alone and all of them together.
SOURCES = {name: source_overrides(name) for name in (*WAVE_SOURCES, "all")}
#: The epoch the warm-up cases run at: blend weight 1 - 1/4, so both terms count.
MSE_EPOCH = 1


def ens_loss_atol(config: DQNConfig) -> float:
    """The ensemble loss is a KL divergence, the difference of a cross-entropy and an entropy
    of size up to ``log(NA)`` that nearly cancel: its rounding is relative to those, not to the
    (small) difference."""
    return RTOL * float(np.log(config.num_atoms))


def assert_close(name: str, actual: np.ndarray, expected: np.ndarray, *, rtol: float, atol: float) -> None:
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    diff = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
    bound = atol + rtol * np.abs(expected.astype(np.float64))
    bad = diff > bound
    if bad.any():
        i = np.unravel_index(np.argmax(diff - bound), diff.shape)
        raise AssertionError(
            f"{name}: {bad.sum()} of {bad.size} elements ({100 * bad.mean():.2f}%) differ beyond "
            f"rtol={rtol}, atol={atol:.3g}; greatest difference {diff.max():.3g} at index {i} "
            f"(actual {actual[i]!r}, expected {expected[i]!r})")


def assert_grad_close(name: str, actual: np.ndarray, expected: np.ndarray) -> None:
    assert np.abs(expected).max() > 0, f"{name}: the reference gradient is all zero"
    assert_close(name, actual, expected, rtol=GRAD_RTOL, atol=GRAD_FLOOR * np.abs(expected).max())


@pytest.mark.parametrize("preset", PRESETS)
def test_losses_and_gradients_match_reference(preset):
    config = DQNConfig.preset(preset, precision="f32", **CORE_STEP)
    layout = ParamLayout(config)
    # A target net far from the online one (x4: sharper distributions), so that p' matters.
    params, target = init_params(layout, 11), init_params(layout, 12) * np.float32(4)
    batch = Batch.random(config, np.random.default_rng(13))
    ref = loss_and_grads(config, params, target, batch)
    peer = TorchStep(config, device="cpu", state={"params": params, "target": target})
    out = peer.loss_and_grads(batch)

    np.testing.assert_array_equal(out["a_star"], ref["a_star"])
    assert_close("c51_loss", out["c51_loss"], ref["c51_loss"], rtol=RTOL, atol=0)
    assert_close("cql_loss", out["cql_loss"], ref["cql_loss"], rtol=RTOL, atol=0)
    assert_close("td_errors", out["td_errors"], ref["td_errors"], rtol=RTOL,
                 atol=RTOL * np.abs(ref["td_errors"]).max())
    assert_grad_close("grad_c51", out["grad_c51"], ref["grad_c51"])
    assert_grad_close("grad_cql", out["grad_cql"], ref["grad_cql"])
    # Not vacuous: the sources differ, and using the wrong net for p' would fail the check.
    assert not np.allclose(ref["grad_c51"], ref["grad_cql"])
    wrong_target = loss_and_grads(config, params, params, batch)["grad_c51"]
    assert np.abs(wrong_target - ref["grad_c51"]).max() > 1e3 * GRAD_FLOOR * np.abs(ref["grad_c51"]).max()


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("preset", PRESETS)
def test_second_wave_losses_and_gradients_match_reference(preset, source):
    """Every second-wave loss and gradient of one batch, at a step count and seed that set the
    IQN fractions, an epoch inside the warm-up and a label scale that has seen a batch."""
    config = DQNConfig.preset(preset, precision="f32", **SOURCES[source])
    layout = ParamLayout(config)
    params, target = init_params(layout, 11), init_params(layout, 12) * np.float32(4)
    batch = Batch.random(config, np.random.default_rng(13))
    isv = isv_mod.bus_for(config).to_array()
    isv[isv_mod.EPOCH_IDX_INDEX] = MSE_EPOCH
    isv[isv_mod.AUX_LABEL_SCALE_EMA_INDEX] = 0.02  # the EMA blends (a cold 0 would be replaced)
    step, seed = 5, 7
    ref = loss_and_grads(config, params, target, batch, isv=isv, step=step, seed=seed)
    peer = TorchStep(config, device="cpu", seed=seed, state={
        "params": params, "target": target, "isv": isv, "step": np.array([step], np.int64)})
    out = peer.loss_and_grads(batch)

    assert_close("c51_loss", out["c51_loss"], ref["c51_loss"], rtol=RTOL, atol=0)
    assert_grad_close("grad_c51", out["grad_c51"], ref["grad_c51"])
    assert_grad_close("grad_cql", out["grad_cql"], ref["grad_cql"])
    expected = set()
    if ref["iqn"] is not None:
        expected |= {"iqn_loss", "grad_iqn_head", "grad_iqn_trunk"}
        assert_close("iqn_loss", out["iqn_loss"], ref["iqn"].loss, rtol=RTOL, atol=0)
        assert_grad_close("grad_iqn_head", out["grad_iqn_head"], ref["iqn"].head_grad)
        assert_grad_close("grad_iqn_trunk", out["grad_iqn_trunk"], ref["iqn"].trunk_grad)
        # Not vacuous: another step's fractions give another loss.
        other = loss_and_grads(config, params, target, batch, isv=isv, step=step + 1, seed=seed)
        assert abs(other["iqn"].loss - ref["iqn"].loss) > 1e3 * RTOL * abs(ref["iqn"].loss)
    if ref["ens"] is not None:
        expected |= {"ens_loss", "grad_ens"}
        assert_close("ens_loss", out["ens_loss"], ref["ens"].loss, rtol=RTOL, atol=ens_loss_atol(config))
        assert_grad_close("grad_ens", out["grad_ens"], ref["ens"].trunk_grad)
    if ref["aux"] is not None:
        expected |= {"aux_next_bar_loss", "aux_regime_loss"}
        for key, want in (("aux_next_bar_loss", ref["aux"].loss_nb),
                          ("aux_regime_loss", ref["aux"].loss_rg)):
            assert_close(key, out[key], want, rtol=RTOL, atol=0)
        aux = slice(layout.core_end, layout.main_adam_end)
        assert np.abs(ref["grad_c51"][aux]).max() > 0  # the heads' gradients are in the C51 source
        assert_close("label_scale", out["label_scale"], ref["isv"][isv_mod.AUX_LABEL_SCALE_EMA_INDEX],
                     rtol=RTOL, atol=0)
    if ref["mse"] is not None:
        expected |= {"mse_loss", "mse_weight"}
        assert_close("mse_loss", out["mse_loss"], ref["mse"].loss, rtol=RTOL, atol=0)
        assert out["mse_weight"] == ref["mse"].w == np.float32(0.75)
        peer.set_epoch(config.c51_warmup_epochs)  # past the warm-up: the plain C51 loss
        core = loss_and_grads(config.replace(c51_warmup_epochs=0), params, target, batch)
        assert_close("c51_loss past the warm-up", peer.loss_and_grads(batch)["c51_loss"],
                     core["c51_loss"], rtol=RTOL, atol=0)
    wave_keys = {"iqn_loss", "grad_iqn_head", "grad_iqn_trunk", "ens_loss", "grad_ens",
                 "aux_next_bar_loss", "aux_regime_loss", "mse_loss", "mse_weight"}
    assert set(out) & wave_keys == expected  # a source that is off computes nothing


@pytest.mark.parametrize("source", ("core", "iqn", "mse"))
def test_n_step_losses_and_gradients_match_reference(source):
    """n-step batches (issue 22): per-sample discounts gamma_ref ** k, k in 1..16 (and the
    floored 1e-30), per-branch gammas unlike gamma_ref (0.99, 0.9): the peer's targets are the
    reference's; not vacuous (the 1-step losses differ)."""
    config = DQNConfig.preset("tiny", precision="f32", gamma=(0.99, 0.9), **source_overrides(source))
    layout = ParamLayout(config)
    params, target = init_params(layout, 11), init_params(layout, 12) * np.float32(4)
    rng = np.random.default_rng(17)
    batch = Batch.random(config, rng)
    disc = np.float32(0.99) ** rng.integers(1, 17, config.batch_size).astype(np.float32)
    disc[0] = 1e-30
    batch = dataclasses.replace(batch, discount=disc.astype(np.float32))
    isv = isv_mod.bus_for(config).to_array()
    isv[isv_mod.EPOCH_IDX_INDEX] = MSE_EPOCH
    step, seed = 5, 7
    ref = loss_and_grads(config, params, target, batch, isv=isv, step=step, seed=seed)
    peer = TorchStep(config, device="cpu", seed=seed, n_step=3, state={
        "params": params, "target": target, "isv": isv, "step": np.array([step], np.int64)})
    out = peer.loss_and_grads(batch)
    assert_close("c51_loss", out["c51_loss"], ref["c51_loss"], rtol=RTOL, atol=0)
    assert_grad_close("grad_c51", out["grad_c51"], ref["grad_c51"])
    one = loss_and_grads(config, params, target, dataclasses.replace(batch, discount=None),
                         isv=isv, step=step, seed=seed)
    assert abs(one["c51_loss"] - ref["c51_loss"]) > 100 * RTOL * abs(ref["c51_loss"])
    if config.iqn_on:
        assert_close("iqn_loss", out["iqn_loss"], ref["iqn"].loss, rtol=RTOL, atol=0)
        assert_grad_close("grad_iqn_head", out["grad_iqn_head"], ref["iqn"].head_grad)
        assert abs(one["iqn"].loss - ref["iqn"].loss) > 1e3 * RTOL * abs(ref["iqn"].loss)
    if config.mse_on:
        assert_close("mse_loss", out["mse_loss"], ref["mse"].loss, rtol=RTOL, atol=0)
        assert abs(one["mse"].loss - ref["mse"].loss) > 1e3 * RTOL * abs(ref["mse"].loss)
    with pytest.raises(ValueError, match=r"^batch\.discount: missing"):
        peer.loss_and_grads(dataclasses.replace(batch, discount=None))


STEP_CASES = [("tiny", "core", {}), ("seed", "core", {}), ("tiny", "core", STRESSED)]
STEP_CASES += [(preset, source, {}) for preset in PRESETS for source in SOURCES]
STEP_CASES += [("tiny", "all", STRESSED)]


@pytest.mark.parametrize("preset,source,overrides", STEP_CASES,
                         ids=[f"{p}-{s}" + ("-stressed" if o else "") for p, s, o in STEP_CASES])
def test_steps_match_reference_trainer(preset, source, overrides):
    config = DQNConfig.preset(preset, precision="f32", **source_overrides(source), **overrides)
    rng = np.random.default_rng(21)
    batches = [Batch.random(config, rng) for _ in range(3)]
    trainer = Trainer(config, seed=3)
    if config.mse_on:
        trainer.set_epoch(MSE_EPOCH)
    trainer.step(batches[0])  # a shared state with Adam moments and t = 1
    peer = TorchStep(config, device="cpu", seed=3, state=trainer.state_dict())
    for batch in batches[1:]:
        trainer.step(batch)
        out = peer.step(batch)
    scalars = trainer.end_epoch()
    mine = peer.read_scalars(out)
    for key in SCALARS:
        atol = ens_loss_atol(config) if key == "ens_loss" else 0
        assert_close(key, mine[key], getattr(scalars, key), rtol=1e-4, atol=atol)
    for key, on in (("iqn_loss", config.iqn_on), ("ens_loss", config.ens_on),
                    ("aux_regime_loss", config.aux_regime_on), ("mse_weight", config.mse_on)):
        assert (getattr(scalars, key) != 0) == on, key
    if overrides:
        for name in ("c51", "cql") + (("iqn", "ens") if source == "all" else ()):
            post, pre = getattr(scalars, f"{name}_norm_post"), getattr(scalars, f"{name}_norm_pre")
            assert post < pre, f"the {name} budget clip did not fire"

    ref_state, state = trainer.state_dict(), peer.export_state()
    assert state["step"][0] == ref_state["step"][0] == 3
    atol = PARAM_ATOL_LR * config.lr
    for key in ("params", "target"):
        assert_close(key, state[key], ref_state[key], rtol=0, atol=atol)
    for key in ("adam_m", "adam_v"):
        assert_grad_close(key, state[key], ref_state[key])
    for key in state:
        if key.startswith("sn_"):
            assert_close(key, state[key], ref_state[key], rtol=0, atol=UNIT_VECTOR_ATOL)
    layout = ParamLayout(config)
    if config.ens_on:  # the priors are frozen in both
        r = slice(*layout.ens_range)
        np.testing.assert_array_equal(state["params"][r], init_params(layout, 3)[r])
    if overrides:  # the rescale fired on every matrix (Adam alone moves each weight by ~lr)
        initial = init_params(layout, 3)
        for t in layout.weight_matrices:
            before = np.linalg.norm(layout.view(initial, t.name))
            assert np.linalg.norm(layout.view(ref_state["params"], t.name)) < 0.9 * before, t.name


def test_philox_matches_reference_generator():
    """The peer's Philox (int64 tensor arithmetic) gives the reference's draws bit for bit,
    including keys and offsets with high words set."""
    for key in (0, 7, 2**40 + 12345, 2**64 - 1):
        offsets = [0, 5, 2**32 - 1, 2**32 + 3, 2**63 - 1]
        got = uniform(key, torch.tensor([1, 2, 0xFFFFFFFF]), torch.tensor(offsets), 300).numpy()
        for i, stream in enumerate((1, 2, 0xFFFFFFFF)):
            for j, offset in enumerate(offsets):
                want = rng.uniform(key, stream, offset, np.arange(300))
                np.testing.assert_array_equal(got[i, j].view(np.uint32), want.view(np.uint32))


def test_tau_table_rows_follow_the_step_count_across_blocks():
    """Each executed step reads its own step's fractions, also past a block's end and after a
    rekey (the device counter and the host's step count stay together)."""
    streams = (rng.STREAMS["iqn_tau_online"], rng.STREAMS["iqn_tau_target"])
    table = TauTable(9, streams, 12, 3, torch.device("cpu"))
    key = 9
    for step in [*range(10, 17), *range(40, 42)]:
        if step == 40:
            key = 2**33 + 1
            table.rekey(key)
        table.ensure(step)
        row = table.row().numpy()
        for i, stream in enumerate(streams):
            np.testing.assert_array_equal(row[i], rng.uniform(key, stream, step, np.arange(12)))
        table.advance()
    with pytest.raises(ValueError, match="key"):
        TauTable(-1, streams, 12, 3, torch.device("cpu"))


@pytest.mark.parametrize("source", ("core", "all"))
@pytest.mark.parametrize("preset", PRESETS)
def test_step_gemm_flops_match_torch_flop_counter(preset, source):
    """The FLOP count behind the TFLOP/s figures, against ``torch.utils.flop_counter`` on the
    peer's forward + backward passes (which also count the projection's batched matmul:
    ``2 B NA^2`` per branch)."""
    from torch.utils.flop_counter import FlopCounterMode

    config = DQNConfig.preset(preset, precision="f32", **source_overrides(source))
    peer = TorchStep(config, device="cpu")
    batch = Batch.random(config, np.random.default_rng(0))
    with FlopCounterMode(display=False) as counter:
        peer.loss_and_grads(batch)
    projection = 2 * config.batch_size * config.num_atoms ** 2 * config.n_branches
    assert counter.get_total_flops() == step_gemm_flops(config) + projection


def test_modes_and_devices_are_checked():
    config = DQNConfig.preset("tiny", precision="f32")
    with pytest.raises(ValueError, match="mode='jit'"):
        TorchStep(config, mode="jit", device="cpu")
    for mode in ("graph", "compile-graph"):
        with pytest.raises(ValueError, match="not a CUDA device"):
            TorchStep(config, mode=mode, device="cpu")
    assert set(MODES) == {"eager", "compile", "graph", "compile-graph"}


@pytest.mark.slow
@pytest.mark.parametrize("source", ("core", "all"))
def test_compiled_peer_matches_eager(source):
    """``torch.compile`` changes the kernels, not the step (CPU inductor; about a minute)."""
    if os.environ.get("FOXHUNT_BENCH_FULL") != "1":
        pytest.skip("compiles the step with inductor (about a minute): set FOXHUNT_BENCH_FULL=1")
    config = DQNConfig.preset("tiny", precision="f32", **source_overrides(source))
    batches = [Batch.random(config, np.random.default_rng(i)) for i in range(3)]
    eager = TorchStep(config, mode="eager", device="cpu")
    compiled = TorchStep(config, mode="compile", device="cpu")
    for batch in batches:
        eager.step(batch)
        compiled.step(batch)
    a, b = eager.export_state(), compiled.export_state()
    for key in a:
        floor = GRAD_FLOOR * max(np.abs(a[key]).max(), config.lr)
        assert_close(key, b[key], a[key], rtol=GRAD_RTOL, atol=floor)
