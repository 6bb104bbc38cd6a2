"""The PyTorch peer computes the reference's step, so timing it against fast is an honest comparison.

On the CPU, float32, ``tiny`` and ``seed`` presets:

- losses, TD errors, double-DQN actions and both per-source gradients equal the reference's
  ``loss_and_grads`` on one batch (distinct online and target parameters);
- two full steps from a shared reference state give the reference ``Trainer``'s parameters,
  target, Adam moments and spectral-norm vectors, also in a "stressed" configuration where the
  budget clips and the spectral-norm rescale actually fire;
- the step's GEMM FLOP count (used for TFLOP/s) equals PyTorch's own FLOP counter.

Tolerances are float32 ones: the two implementations sum in different orders, nothing more.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from foxhunt.reference.batch import Batch
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.layout import ParamLayout, init_params
from foxhunt.reference.step import loss_and_grads
from foxhunt.reference.trainer import Trainer
from peers.torch_step import MODES, TorchStep, step_gemm_flops

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

#: Budgets clip (tiny's norms ~0.03 and ~0.15 against budgets 0.007 and 0.0015) and every
#: weight matrix (sigma ~1) is rescaled to sigma_max.
STRESSED = {"max_grad_norm": 0.01, "sigma_max": 0.5}


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
    config = DQNConfig.preset(preset, precision="f32")
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


@pytest.mark.parametrize("preset,overrides", [("tiny", {}), ("seed", {}), ("tiny", STRESSED)],
                         ids=["tiny", "seed", "tiny-stressed"])
def test_steps_match_reference_trainer(preset, overrides):
    config = DQNConfig.preset(preset, precision="f32", **overrides)
    rng = np.random.default_rng(21)
    batches = [Batch.random(config, rng) for _ in range(3)]
    trainer = Trainer(config, seed=3)
    trainer.step(batches[0])  # a shared state with Adam moments and t = 1
    peer = TorchStep(config, device="cpu", seed=3, state=trainer.state_dict())
    for batch in batches[1:]:
        trainer.step(batch)
        out = peer.step(batch)
    scalars = trainer.end_epoch()
    mine = peer.read_scalars(out)
    for key in ("loss", "c51_loss", "cql_loss", "c51_norm_pre", "cql_norm_pre", "grad_norm"):
        assert_close(key, mine[key], getattr(scalars, key), rtol=1e-4, atol=0)
    if overrides:
        assert scalars.c51_norm_post < scalars.c51_norm_pre, "the C51 budget clip did not fire"
        assert scalars.cql_norm_post < scalars.cql_norm_pre, "the CQL budget clip did not fire"

    ref_state, state = trainer.state_dict(), peer.export_state()
    atol = PARAM_ATOL_LR * config.lr
    for key in ("params", "target"):
        assert_close(key, state[key], ref_state[key], rtol=0, atol=atol)
    for key in ("adam_m", "adam_v"):
        assert_grad_close(key, state[key], ref_state[key])
    for key in state:
        if key.startswith("sn_"):
            assert_close(key, state[key], ref_state[key], rtol=0, atol=UNIT_VECTOR_ATOL)
    if overrides:  # the rescale fired on every matrix (Adam alone moves each weight by ~lr)
        layout = ParamLayout(config)
        initial = init_params(layout, 3)
        for t in layout.weight_matrices:
            before = np.linalg.norm(layout.view(initial, t.name))
            assert np.linalg.norm(layout.view(ref_state["params"], t.name)) < 0.9 * before, t.name


@pytest.mark.parametrize("preset", PRESETS)
def test_step_gemm_flops_match_torch_flop_counter(preset):
    """The FLOP count behind the TFLOP/s figures, against ``torch.utils.flop_counter`` on the
    peer's forward + backward passes (which also count the projection's batched matmul:
    ``2 B NA^2`` per branch)."""
    from torch.utils.flop_counter import FlopCounterMode

    config = DQNConfig.preset(preset, precision="f32")
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
def test_compiled_peer_matches_eager():
    """``torch.compile`` changes the kernels, not the step (CPU inductor; about a minute)."""
    if os.environ.get("FOXHUNT_BENCH_FULL") != "1":
        pytest.skip("compiles the step with inductor (about a minute): set FOXHUNT_BENCH_FULL=1")
    config = DQNConfig.preset("tiny", precision="f32")
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
