"""The auxiliary heads', the ensemble diversity's and the MSE warm-up's gradients
(``reference/aux_heads.py``) against torch autograd.

torch (CPU, float64) builds the same losses from the same parameters and inputs: the network's
forward values are the reference forward's (``online.h1``, ``h2``, ``hv``, ``v``, ``logits``), and
autograd differentiates through their linear layers and ReLU masks (``h = h_ref + (lin -
lin.detach()) * (h_ref > 0)``), so it reaches the heads' parameters, ``h2``, the value head and
the trunk. The heads themselves (ELU layers, outputs, prior heads) are recomputed in torch. It
checks, at the ``tiny`` and ``seed`` presets in both precision modes: the aux losses, parameter
gradients and each head's ``d h2``; the ensemble loss, ``d_logits`` (``d v``) and trunk
gradient (value head and trunk); the MSE loss, its logit gradient and the blend.

Tolerances (norm-wise relative error per tensor, ``|g - g64| / |g64|``; measured maxima over
the cases in brackets):

- losses: ``1e-5`` in every mode (the forward is modelled exactly; in ``bf16`` and ``tf32`` the
  heads' forward GEMM operands are rounded in torch too, ``oracle_rounding``): float32
  accumulation and a few ulp of ``expm1``/``exp``/``log`` per term [<= 1.6e-6].
- gradients, ``f32``: ``1e-5``. Every GEMM and reduction is float32; the longest chain (the
  ensemble into ``W_s1``) has about eight stages and sums of up to 256 terms, about
  ``sqrt(K) 2**-24`` relative each [<= 1.3e-6]. A wrong factor, mask or index is ``O(1)``
  (a head weight off by 3% shows as 3e-2).
- gradients, ``bf16`` and ``tf32``: ``1e-2``. The backward GEMMs round their operands to TF32
  (``2**-11`` relative each, not modelled in torch); up to four backward GEMMs of two rounded
  operands give about ``8 * 2**-11 = 4e-3`` [bf16 <= 3.2e-3, tf32 <= 5.7e-4 (session 26)].
  The MSE has no GEMM: ``f32``'s bound in every mode [<= 1.7e-7].
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from foxhunt.reference import isv as isv_mod
from foxhunt.reference.aux_heads import aux_loss_and_grads, ens_loss_and_grads, mse_blend
from foxhunt.reference.batch import Batch
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.kernels.distributional import support
from foxhunt.reference.layout import ParamLayout, init_params
from foxhunt.reference.network import forward
from oracle_rounding import forward_rounder

F32, F64 = np.float32, torch.float64
TRUNK = ("w_s1", "b_s1", "w_s2", "b_s2")
VALUE = ("w_v1", "b_v1", "w_v2", "b_v2")
LOSS_TOLERANCE = 1e-5
GRAD_TOLERANCE = {"f32": 1e-5, "bf16": 1e-2, "tf32": 1e-2}
W_NB, W_RG = 0.3, 0.2
LABEL_SCALE, H2_RMS, EPOCH, WARMUP = 0.01, 1.3, 1, 4
SOURCES = dict(aux_next_bar_weight=W_NB, aux_regime_weight=W_RG, ens_weight=1.0,
               c51_warmup_epochs=WARMUP, adaptive_atoms=False)  # the warm-up's fixed support


def _setup(preset: str, precision: str, seed: int = 0, **overrides):
    config = DQNConfig.preset(preset, precision=precision, **(SOURCES | overrides))
    layout = ParamLayout(config)
    gen = np.random.default_rng(seed)
    params = init_params(layout, seed)
    views = layout.views(params)
    for t in layout.tensors:  # biases start at 0: make them matter
        if len(t.shape) == 1:
            views[t.name][...] = (0.1 * gen.standard_normal(t.shape)).astype(F32)
    batch = Batch.random(config, gen)
    isv = isv_mod.bus_for(config).to_array()
    isv[isv_mod.AUX_LABEL_SCALE_EMA_INDEX] = F32(LABEL_SCALE)
    isv[isv_mod.H_S2_RMS_EMA_INDEX] = F32(H2_RMS)
    isv[isv_mod.EPOCH_IDX_INDEX] = F32(EPOCH)
    h2_bound = F32(config.h2_clamp_mult * max(H2_RMS, 1.0))
    online = forward(config, layout, params, batch.s, h2_bound=h2_bound)
    assert np.array_equal(online.h2, online.h2_pre_clamp)  # the oracle has no clamp to model
    return config, layout, params, batch, isv, online


def _rounder(config):
    return forward_rounder(config.precision)


def _leaves(layout, params, names) -> dict[str, torch.Tensor]:
    return {n: torch.tensor(v, dtype=F64, requires_grad=True)
            for n, v in layout.views(params).items() if n in names}


def _layer(x, w, b, ref, rnd, relu: bool):
    """The reference's value ``ref`` with the gradient of ``rnd(x) rnd(w)^T + b`` (masked by the
    ReLU of ``ref`` when ``relu``)."""
    lin = rnd(x) @ rnd(w).T + b
    delta = lin - lin.detach()
    return torch.tensor(ref, dtype=F64) + (delta * torch.tensor(ref > 0) if relu else delta)


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


# --------------------------------------------------------------------------------------------
# Auxiliary heads
# --------------------------------------------------------------------------------------------


def _torch_aux(config, layout, params, batch, online):
    """The weighted aux losses in float64 torch; returns ``(losses, grads by name, d h2 of the
    total, d h2 per head)``."""
    rnd = _rounder(config)
    p = _leaves(layout, params, [t.name for t in layout.group_tensors("aux")])
    h2 = torch.tensor(online.h2, dtype=F64, requires_grad=True)

    def hidden(key):
        return torch.nn.functional.elu(rnd(h2) @ rnd(p[f"w_{key}1"]).T + p[f"b_{key}1"])

    pred = (rnd(hidden("nb")) @ rnd(p["w_nb2"]).T + p["b_nb2"])[:, 0]
    label = torch.tensor(batch.next_ret.astype(np.float64) / float(F32(LABEL_SCALE)))
    valid = torch.isfinite(label)
    loss_nb = ((pred[valid] - label[valid]) ** 2).mean()
    logits = rnd(hidden("rg")) @ rnd(p["w_rg2"]).T + p["b_rg2"]
    loss_rg = torch.nn.functional.cross_entropy(logits, torch.from_numpy(batch.regime.astype(np.int64)))
    weighted = {"nb": float(F32(W_NB)) * loss_nb, "rg": float(F32(W_RG)) * loss_rg}
    parts = {k: torch.autograd.grad(v, h2, retain_graph=True)[0].numpy() for k, v in weighted.items()}
    total = weighted["nb"] + weighted["rg"]
    grads = torch.autograd.grad(total, [h2, *p.values()])
    return ({"nb": loss_nb.item(), "rg": loss_rg.item()},
            {n: g.numpy() for n, g in zip(p, grads[1:])}, grads[0].numpy(), parts)


@pytest.mark.parametrize("precision", ["f32", "bf16", "tf32"])
@pytest.mark.parametrize("preset", ["tiny", "seed"])
def test_aux_gradients_match_torch_autograd(preset, precision):
    config, layout, params, batch, isv, online = _setup(preset, precision)
    batch.next_ret[[1, 5]] = np.nan  # NaN-flagged returns are masked out of the loss
    out = aux_loss_and_grads(config, layout, params, online, batch, isv)
    losses, grads64, d_h2_64, parts64 = _torch_aux(config, layout, params, batch, online)
    assert abs(float(out.loss_nb) - losses["nb"]) <= LOSS_TOLERANCE * losses["nb"]
    assert abs(float(out.loss_rg) - losses["rg"]) <= LOSS_TOLERANCE * losses["rg"]
    tol = GRAD_TOLERANCE[precision]
    g = layout.views(out.param_grad)
    for name, want in grads64.items():
        assert _rel(g[name], want) <= tol, name
    assert _rel(out.d_h2, d_h2_64) <= tol
    assert _rel(out.d_h2_nb, parts64["nb"]) <= tol and _rel(out.d_h2_rg, parts64["rg"]) <= tol
    start, end = layout.core_end, layout.main_adam_end  # zero outside the aux tensors
    assert not np.any(out.param_grad[:start]) and not np.any(out.param_grad[end:])


def test_aux_single_head_and_nan_contract():
    config, layout, params, batch, isv, online = _setup("tiny", "f32", aux_regime_weight=0.0,
                                                        ens_weight=0.0, c51_warmup_epochs=0)
    assert "w_rg1" not in layout.by_name
    out = aux_loss_and_grads(config, layout, params, online, batch, isv)
    assert out.d_h2_rg is None and out.loss_rg == 0
    assert np.array_equal(out.d_h2, out.d_h2_nb)  # 0 + 1 * x
    online.h2 = online.h2.copy()
    online.h2[2, 0] = np.nan  # a poisoned activation reaches the head's d h2 (sentinel 30) ...
    bad = aux_loss_and_grads(config, layout, params, online, batch, isv)
    assert np.isnan(bad.d_h2_nb[2]).all() and np.isnan(bad.loss_nb)
    assert np.isfinite(bad.d_h2).all()  # ... but not the trunk-gradient buffer (guarded sum)


# --------------------------------------------------------------------------------------------
# Ensemble diversity
# --------------------------------------------------------------------------------------------


def _torch_ens(config, layout, params, batch, online):
    """The diversity loss in float64 torch; returns ``(loss, grads by name, d v)``."""
    rnd = _rounder(config)
    p = _leaves(layout, params, TRUNK + VALUE)
    pe = {n: torch.tensor(v, dtype=F64) for n, v in layout.views(params).items() if n.startswith("w_e")
          or n.startswith("b_e")}
    h1 = _layer(torch.tensor(batch.s, dtype=F64), p["w_s1"], p["b_s1"], online.h1, lambda x: x, True)
    h2 = _layer(h1, p["w_s2"], p["b_s2"], online.h2, lambda x: x, True)
    hv = _layer(h2, p["w_v1"], p["b_v1"], online.hv, rnd, True)
    v = _layer(hv, p["w_v2"], p["b_v2"], online.v, rnd, False)
    v.retain_grad()
    h2c = torch.tensor(online.h2, dtype=F64)
    priors = torch.stack([
        rnd(torch.relu(rnd(h2c) @ rnd(pe[f"w_e{k}1"]).T + pe[f"b_e{k}1"])) @ rnd(pe[f"w_e{k}2"]).T
        + pe[f"b_e{k}2"] for k in range(1, config.ens_heads)])
    logp0, logpk = torch.log_softmax(v, -1), torch.log_softmax(priors, -1)
    loss = -(logpk.exp() * (logpk - logp0)).sum() / (config.batch_size * (config.ens_heads - 1))
    loss.backward()
    return loss.item(), {n: t.grad.numpy() for n, t in p.items()}, v.grad.numpy()


@pytest.mark.parametrize("precision", ["f32", "bf16", "tf32"])
@pytest.mark.parametrize("preset", ["tiny", "seed"])
def test_ens_gradients_match_torch_autograd(preset, precision):
    config, layout, params, batch, isv, online = _setup(preset, precision)
    out = ens_loss_and_grads(config, layout, params, online, isv, mode=precision)
    loss64, grads64, dv64 = _torch_ens(config, layout, params, batch, online)
    assert abs(float(out.loss) - loss64) <= LOSS_TOLERANCE * abs(loss64)
    tol = GRAD_TOLERANCE[precision]
    assert _rel(out.d_logits, dv64) <= tol
    g = layout.views(out.trunk_grad)
    for name in TRUNK + VALUE:
        assert _rel(g[name], grads64[name]) <= tol, name
    assert not np.any(out.trunk_grad[layout.value_end:])  # the frozen priors get nothing
    # Nothing to guard or sanitise at these magnitudes: the clean buffers are the raw ones.
    assert np.array_equal(out.d_h2_guarded, out.d_h2)
    assert np.array_equal(out.trunk_grad_clean, out.trunk_grad)


def test_ens_guard_and_sanitisation():
    """A tiny guard multiplier clamps ``d h2`` and the scratch to its bound; a NaN prior reaches
    ``d_logits`` (sentinel 31) and the raw scratch (sentinel 51), never the clean one."""
    config, layout, params, batch, isv, online = _setup("tiny", "f32")
    small = config.replace(aux_guard_mult=1e-7)
    out = ens_loss_and_grads(small, layout, params, online, isv, mode="f32")
    bound = F32(1e-7) * F32(H2_RMS)  # aux_guard_mult * max(ISV[H_S2_RMS_EMA], 1)
    assert np.abs(out.d_h2).max() > bound
    assert np.array_equal(out.d_h2_guarded, np.clip(out.d_h2, -bound, bound))
    assert np.abs(out.trunk_grad_clean).max() <= bound
    poisoned = params.copy()
    layout.view(poisoned, "b_e12")[0] = np.nan
    bad = ens_loss_and_grads(config, layout, poisoned, online, isv, mode="f32")
    assert np.isnan(bad.d_logits).all() and np.isnan(bad.loss)
    assert np.isnan(bad.trunk_grad).any() and np.isfinite(bad.trunk_grad_clean).all()


def test_ens_mode_overrides_the_precision():
    config, layout, params, batch, isv, online = _setup("tiny", "f32")
    f32 = ens_loss_and_grads(config, layout, params, online, isv, mode="f32")
    bf16 = ens_loss_and_grads(config, layout, params, online, isv, mode="bf16")
    assert not np.array_equal(f32.trunk_grad, bf16.trunk_grad)
    assert _rel(bf16.trunk_grad, f32.trunk_grad.astype(np.float64)) <= GRAD_TOLERANCE["bf16"]


# --------------------------------------------------------------------------------------------
# MSE warm-up
# --------------------------------------------------------------------------------------------


def _torch_mse(config, online, batch, target_q):
    """The expected-Q MSE in float64 torch on the reference's logits; returns ``(loss, d logits
    per branch)``."""
    z = torch.tensor(support(config.v_min, config.v_max, config.num_atoms), dtype=F64)
    leaves = [torch.tensor(x, dtype=F64, requires_grad=True) for x in online.logits]
    rows = torch.arange(config.batch_size)
    isw = torch.tensor(batch.isw, dtype=F64)
    loss = torch.zeros((), dtype=F64)
    for d, t in enumerate(leaves):
        p = torch.softmax(t, -1)[rows, torch.from_numpy(batch.a[:, d].astype(np.int64))]
        td = (p * z).sum(-1) - torch.tensor(target_q[:, d], dtype=F64)
        loss = loss + (isw * 0.5 * td * td).sum()
    loss = loss / (config.batch_size * config.n_branches)
    loss.backward()
    return loss.item(), [t.grad.numpy() for t in leaves]


@pytest.mark.parametrize("precision", ["f32", "bf16", "tf32"])
@pytest.mark.parametrize("preset", ["tiny", "seed"])
def test_mse_gradient_and_blend_match_torch_autograd(preset, precision):
    config, layout, params, batch, isv, online = _setup(preset, precision)
    gen = np.random.default_rng(9)
    target_q = (3 * gen.standard_normal((config.batch_size, config.n_branches))).astype(F32)
    dl_c51 = [(1e-3 * gen.standard_normal(x.shape)).astype(F32) for x in online.logits]
    out = mse_blend(config, online, batch, target_q, dl_c51, EPOCH)
    loss64, grads64 = _torch_mse(config, online, batch, target_q)
    w = 1 - EPOCH / WARMUP
    assert out.w == F32(w)
    assert abs(float(out.loss) - loss64) <= LOSS_TOLERANCE * loss64
    for d, (got, g64) in enumerate(zip(out.dlogits, grads64)):
        # float32 log-probabilities of the logits (not modelled); no GEMM involved
        assert _rel(got, (1 - w) * dl_c51[d] + w * g64) <= GRAD_TOLERANCE["f32"], d
        pure = mse_blend(config, online, batch, target_q, [np.zeros_like(x) for x in dl_c51], 0)
        assert pure.w == 1 and _rel(pure.dlogits[d], g64) <= GRAD_TOLERANCE["f32"], d


def test_mse_after_the_warmup_leaves_c51_bitwise():
    config, layout, params, batch, isv, online = _setup("tiny", "f32")
    target_q = np.zeros((config.batch_size, config.n_branches), F32)
    dl_c51 = [np.full(x.shape, -0.0, F32) for x in online.logits]
    dl_c51[0][0, 0, 0] = np.nan
    out = mse_blend(config, online, batch, target_q, dl_c51, WARMUP)
    assert out.w == 0 and out.loss > 0
    assert all(a.tobytes() == b.tobytes() for a, b in zip(out.dlogits, dl_c51))


def test_sources_off_or_bad_arguments_raise_one_line_errors():
    config, layout, params, batch, isv, online = _setup("tiny", "f32")
    off = config.replace(aux_next_bar_weight=0.0, aux_regime_weight=0.0, ens_weight=0.0,
                         c51_warmup_epochs=0)
    lay_off = ParamLayout(off)
    p_off = init_params(lay_off, 0)
    with pytest.raises(ValueError, match="aux_next_bar_weight"):
        aux_loss_and_grads(off, lay_off, p_off, online, batch, isv)
    with pytest.raises(ValueError, match="ens_weight"):
        ens_loss_and_grads(off, lay_off, p_off, online, isv, mode="f32")
    with pytest.raises(ValueError, match="c51_warmup_epochs"):
        mse_blend(off, online, batch, np.zeros((config.batch_size, config.n_branches), F32),
                  [np.zeros_like(x) for x in online.logits], 0)
    with pytest.raises(ValueError, match="mode"):
        ens_loss_and_grads(config, layout, params, online, isv, mode="fp16")
    with pytest.raises(ValueError, match="isv"):
        aux_loss_and_grads(config, layout, params, online, batch, isv[:-1])
    with pytest.raises(ValueError, match="epoch"):
        mse_blend(config, online, batch, np.zeros((config.batch_size, config.n_branches), F32),
                  [np.zeros_like(x) for x in online.logits], "one")
