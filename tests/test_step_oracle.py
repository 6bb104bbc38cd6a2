"""`loss_and_grads` against an independent torch-autograd implementation (float64 oracle).

The torch network, the double-DQN choice, the projection and both losses are written here from
SPEC 3-4 without calling foxhunt's kernels; only the flat-buffer slicing uses the layout.
"""

import dataclasses

import numpy as np
import pytest
import torch

from foxhunt.reference.batch import Batch
from foxhunt.reference.config import CORE_STEP, DQNConfig
from foxhunt.reference.layout import ParamLayout, branch_name, init_params
from foxhunt.reference.step import loss_and_grads


def torch_losses(config, layout, params, target, batch):
    """(c51_loss, cql_loss, td_errors) as float64 torch tensors; ``params`` requires grad."""
    c = config
    z = torch.linspace(c.v_min, c.v_max, c.num_atoms, dtype=torch.float64)
    dz = (c.v_max - c.v_min) / (c.num_atoms - 1)

    def unpack(flat):
        return {t.name: flat[t.offset:t.end].reshape(t.shape) for t in layout.tensors}

    def net(p, x):
        h2 = torch.relu(torch.relu(x @ p["w_s1"].T + p["b_s1"]) @ p["w_s2"].T + p["b_s2"])
        v = torch.relu(h2 @ p["w_v1"].T + p["b_v1"]) @ p["w_v2"].T + p["b_v2"]
        out = []
        for d, n in enumerate(c.branches):
            br = branch_name(d)
            adv = (torch.relu(h2 @ p[f"w_{br}1"].T + p[f"b_{br}1"]) @ p[f"w_{br}2"].T + p[f"b_{br}2"])
            adv = adv.reshape(x.shape[0], n, c.num_atoms)
            logits = v[:, None, :] + adv - adv.mean(dim=1, keepdim=True)
            out.append(torch.log_softmax(logits, dim=-1))
        return out

    s, s2 = (torch.tensor(batch.s, dtype=torch.float64), torch.tensor(batch.s2, dtype=torch.float64))
    r = torch.tensor(batch.r, dtype=torch.float64)
    done = torch.tensor(batch.done, dtype=torch.float64)
    isw = torch.tensor(batch.isw, dtype=torch.float64)
    a = torch.tensor(batch.a, dtype=torch.long)
    B, nb = c.batch_size, c.n_branches
    p_on = unpack(params)
    logp_s = net(p_on, s)
    with torch.no_grad():
        logp_s2 = net(unpack(params.detach()), s2)
        logp_t = net(unpack(target), s2)
    c51 = torch.zeros((), dtype=torch.float64)
    cql = torch.zeros((), dtype=torch.float64)
    td = torch.zeros(B, dtype=torch.float64)
    rows = torch.arange(B)
    # n-step batches (issue 22): gamma_d ** n_eff per sample, in float64.
    n_eff = None if batch.discount is None else (
        torch.log(torch.tensor(np.maximum(batch.discount, 1e-9), dtype=torch.float64))
        / np.log(np.float64(np.float32(c.gammas[0]))))
    for d, gamma in enumerate(c.gammas):
        gamma = gamma if n_eff is None else (gamma ** n_eff)[:, None]
        with torch.no_grad():
            q2 = (logp_s2[d].exp() * z).sum(-1)
            a_star = q2.argmax(dim=1)  # torch returns the first maximal index
            p_next = logp_t[d][rows, a_star].exp()
            tz = (r[:, None] + gamma * (1 - done[:, None]) * z[None, :]).clamp(c.v_min, c.v_max)
            w = (1 - (tz[:, None, :] - z[None, :, None]).abs() / dz).clamp(0, 1)  # [B, i, j]
            m = (w * p_next[:, None, :]).sum(-1)
        ce = -(m * logp_s[d][rows, a[:, d]]).sum(-1)
        c51 = c51 + (isw * ce).sum() / B / nb
        td = td + ce.detach() / nb
        q = (logp_s[d].exp() * z).sum(-1)
        cql = cql + c.cql_alpha * (torch.logsumexp(q, dim=1) - q[rows, a[:, d]]).mean() / nb
    return c51, cql, td


def _oracle(config, seed, n_step=False):
    layout = ParamLayout(config)
    rng = np.random.default_rng(seed)
    params = init_params(layout, seed)
    target = init_params(layout, seed + 1)
    batch = Batch.random(config, rng)
    if n_step:  # discounts gamma_ref ** k, k in 1..16, and a floored 1e-30
        disc = np.float32(config.gammas[0]) ** rng.integers(1, 17, config.batch_size)
        disc[0] = 1e-30
        batch = dataclasses.replace(batch, discount=disc.astype(np.float32))
    ours = loss_and_grads(config, params, target, batch, layout=layout)
    p64 = torch.tensor(params, dtype=torch.float64, requires_grad=True)
    t64 = torch.tensor(target, dtype=torch.float64)
    c51, cql, td = torch_losses(config, layout, p64, t64, batch)
    (g_c51,) = torch.autograd.grad(c51, p64, retain_graph=True)
    (g_cql,) = torch.autograd.grad(cql, p64)
    return layout, ours, (c51.item(), cql.item(), td.numpy(), g_c51.numpy(), g_cql.numpy())


def assert_grad_close(layout, ours, ref, what):
    assert ours.dtype == np.float32
    assert not ours[layout.padding_mask()].any(), f"{what}: padding must stay zero"
    for t in layout.tensors:
        a = ours[t.offset:t.end].astype(np.float64)
        b = ref[t.offset:t.end]
        scale = np.abs(b).max() + 1e-30
        err = np.abs(a - b).max() / scale
        assert err < 2e-4, f"{what}[{t.name}]: max error {err:.3g} relative to max|grad| {scale:.3g}"


@pytest.mark.parametrize("n_step", [False, True], ids=["1-step", "n-step"])
@pytest.mark.parametrize("preset", ["tiny", "seed"])
def test_loss_and_grads_match_torch_autograd(preset, n_step):
    # The core step (C51 + CQL) at the preset's sizes; the second wave has its own oracles.
    # n-step: per-sample discounts, the targets' gamma_d ** n_eff (issue 22).
    branches = DQNConfig.preset(preset).branches
    config = DQNConfig.preset(preset, precision="f32", gamma=(0.99, 0.9, 0.5)[: len(branches)],
                              **CORE_STEP)
    layout, ours, (c51, cql, td, g_c51, g_cql) = _oracle(config, seed=3, n_step=n_step)
    assert ours["c51_loss"].dtype == np.float32 and ours["cql_loss"].dtype == np.float32
    np.testing.assert_allclose(ours["c51_loss"], c51, rtol=1e-5)
    np.testing.assert_allclose(ours["cql_loss"], cql, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ours["td_errors"], td, rtol=1e-5, atol=1e-6)
    assert_grad_close(layout, ours["grad_c51"], g_c51, "grad_c51")
    assert_grad_close(layout, ours["grad_cql"], g_cql, "grad_cql")


@pytest.mark.parametrize("precision, loss_rtol, grad_rel", [("bf16", 2e-2, 5e-2),
                                                              ("tf32", 2e-3, 1e-3)])
def test_rounded_modes_are_close_to_f32(precision, loss_rtol, grad_rel):
    """BF16 (8-bit significands) and TF32 (11-bit) GEMM inputs: different from f32, but only at
    their rounding level (TF32's about 2^-3 of BF16's)."""
    base = DQNConfig.preset("tiny", precision="f32")
    layout = ParamLayout(base)
    params, target = init_params(layout, 5), init_params(layout, 6)
    batch = Batch.random(base, np.random.default_rng(5))
    f32 = loss_and_grads(base, params, target, batch)
    other = loss_and_grads(base.replace(precision=precision), params, target, batch)
    np.testing.assert_allclose(other["c51_loss"], f32["c51_loss"], rtol=loss_rtol)
    rel = np.linalg.norm(other["grad_c51"] - f32["grad_c51"]) / np.linalg.norm(f32["grad_c51"])
    assert 0 < rel < grad_rel


def test_batch_validation_names_the_field():
    config = DQNConfig.preset("tiny")
    b = Batch.random(config, np.random.default_rng(0))
    bad_a = b.a.copy()
    bad_a[3, 1] = 2  # branch 1 of tiny has 2 actions
    with pytest.raises(ValueError, match=r"batch\.a\[3, 1\]=2"):
        Batch(b.s, bad_a, b.r, b.s2, b.done, b.isw).validate(config)
    with pytest.raises(ValueError, match=r"batch\.r: dtype float64"):
        Batch(b.s, b.a, b.r.astype(np.float64), b.s2, b.done, b.isw).validate(config)
    with pytest.raises(ValueError, match=r"batch\.s2: shape"):
        Batch(b.s, b.a, b.r, b.s2[:, :-1], b.done, b.isw).validate(config)
    with pytest.raises(ValueError, match=r"batch\.done\[0\]"):
        Batch(b.s, b.a, b.r, b.s2, np.full_like(b.done, 0.5), b.isw).validate(config)


@pytest.mark.parametrize("value", [-1, -(2**31), 2**31 - 1])
@pytest.mark.parametrize("branch", [0, 1, 2])
def test_batch_validation_catches_every_out_of_range_action(branch, value):
    """Negative and too-large actions in any branch, at any row; valid edge values pass."""
    config = DQNConfig.preset("seed", **CORE_STEP)
    b = Batch.random(config, np.random.default_rng(1))
    edge = b.a.copy()
    edge[:, branch] = config.branches[branch] - 1
    edge[0, branch] = 0
    Batch(b.s, edge, b.r, b.s2, b.done, b.isw).validate(config)  # the bounds themselves are valid
    bad_a = edge.copy()
    bad_a[-1, branch] = value
    with pytest.raises(ValueError, match=rf"batch\.a\[{len(bad_a) - 1}, {branch}\]={value}: "):
        Batch(b.s, bad_a, b.r, b.s2, b.done, b.isw).validate(config)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf, -1.0, 2.0, 1e-30, np.float32(1.4e-45),
                                   np.nextafter(np.float32(1), np.float32(2)),
                                   np.nextafter(np.float32(1), np.float32(0)), 3e38])
def test_batch_validation_rejects_done_values_other_than_0_and_1(value):
    config = DQNConfig.preset("tiny")
    b = Batch.random(config, np.random.default_rng(2))
    done = b.done.copy()
    done[5] = value
    with pytest.raises(ValueError, match=r"batch\.done\[5\]="):
        Batch(b.s, b.a, b.r, b.s2, done, b.isw).validate(config)
    done[5] = -0.0  # == 0
    Batch(b.s, b.a, b.r, b.s2, done, b.isw).validate(config)
