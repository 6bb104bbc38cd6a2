"""The IQN head's gradients (``reference/iqn_head.py``) against torch autograd.

torch (CPU, float64) builds the same loss from the same parameters, the same quantile fractions
(drawn here from ``rng.uniform`` directly) and the same inputs: the trunk's forward values are
the reference forward's (``online.h1``, ``online.h2``: "the same h2"), autograd differentiates
through its linear layers and ReLU masks (so it reaches ``W_s1 .. b_s2`` and ``h2``), then the
head on ``h2``, the target head on the target pass's ``h2``, and the contract's quantile Huber
loss. It checks the loss, ``head_grad``, ``d_h2`` and ``trunk_grad`` at the ``tiny`` and
``seed`` presets with the IQN head on, in every precision mode.

Tolerances (norm-wise relative error per tensor, ``|g - g64| / |g64|``; measured values in
brackets, three parameter seeds):

- loss, every mode: ``1e-5``. The forward is modelled exactly (in ``bf16`` and ``tf32`` the
  head's forward GEMM operands are rounded in torch too, ``oracle_rounding``), so only float32
  accumulation differs: an ``N^2 B D``-term sum of positive terms, about ``2**-24`` relative per
  rounding [<= 1.3e-7].
- gradients, ``f32``: ``1e-5``. Every GEMM and reduction is float32; the longest chain has
  about six stages and the longest sums ``B N = 1280`` terms, relative error about
  ``sqrt(K) 2**-24`` each (``K 2**-24 = 7.6e-5`` worst case) [<= 5e-7]. A wrong factor, mask
  or index is ``O(1)``.
- gradients, ``bf16`` and ``tf32``: ``1e-2``. The backward GEMMs round their operands to TF32 (``2**-11``
  relative each, not modelled in torch); a chain of up to three backward GEMMs of two rounded
  operands gives about ``6 * 2**-11 = 3e-3`` [bf16 <= 2.4e-3, tf32 <= 4.3e-4 (session 26);
  ``b_iq``, a plain column sum, 8e-7].
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from foxhunt.reference.batch import Batch
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.iqn_head import iqn_loss_and_grads
from foxhunt.reference.kernels import rng
from foxhunt.reference.kernels.fused import branch_offsets
from foxhunt.reference.layout import ParamLayout, init_params
from foxhunt.reference.network import forward
from oracle_rounding import forward_rounder

F64 = torch.float64
TRUNK = ("w_s1", "b_s1", "w_s2", "b_s2")
HEAD = ("w_phi", "b_phi", "w_iq", "b_iq")
LOSS_TOLERANCE = 1e-5
GRAD_TOLERANCE = {"f32": 1e-5, "bf16": 1e-2, "tf32": 1e-2}
SEED, STEP, Q_ABS_REF, H2_RMS = 2024, 123_456, 0.7, 1.3


def _setup(preset: str, precision: str, seed: int = 0):
    config = DQNConfig.preset(preset, lambda_iqn=1.0, precision=precision)
    layout = ParamLayout(config)
    gen = np.random.default_rng(seed)
    params = init_params(layout, seed)
    views = layout.views(params)
    for name in ("b_s1", "b_s2", "b_phi", "b_iq"):  # biases start at 0: make them matter
        views[name][...] = (0.1 * gen.standard_normal(views[name].shape)).astype(np.float32)
    target = params.copy()
    target += (0.05 * gen.standard_normal(target.shape) * (~layout.padding_mask())).astype(np.float32)
    batch = Batch.random(config, gen)
    a_star = np.stack([gen.integers(0, n, config.batch_size) for n in config.branches],
                      axis=1).astype(np.int32)
    h2_bound = np.float32(config.h2_clamp_mult * max(H2_RMS, 1.0))
    online = forward(config, layout, params, batch.s, h2_bound=h2_bound)
    target_next = forward(config, layout, target, batch.s2, h2_bound=h2_bound)
    return config, layout, params, target, batch, a_star, online, target_next


def _torch_iqn(config, layout, params, target, batch, a_star, online, target_next):
    """The contract's IQN loss in float64 torch; returns ``(loss, grads by name, d h2)``.

    The trunk's values are the reference forward's (``online.h1``, ``online.h2``: "the same
    h2"), its gradients autograd's through the linear layers and the ReLU masks of those values
    (``h = h_ref + (lin - lin.detach()) * (h_ref > 0)``). In ``bf16`` mode the head's forward
    GEMM operands are rounded to BF16 (``_bf16``) as SPEC 9 says the fast path does."""
    rnd = forward_rounder(config.precision)
    n, k = config.iqn_quantiles, config.iqn_embed
    b = config.batch_size
    rows = b * n
    p = {name: torch.tensor(v, dtype=F64, requires_grad=True)
         for name, v in layout.views(params).items() if name in TRUNK + HEAD}
    pt = {name: torch.tensor(v, dtype=F64) for name, v in layout.views(target).items() if name in HEAD}
    tau = torch.tensor(rng.uniform(SEED, rng.STREAMS["iqn_tau_online"], STEP, np.arange(rows)), dtype=F64)
    tau_t = torch.tensor(rng.uniform(SEED, rng.STREAMS["iqn_tau_target"], STEP, np.arange(rows)),
                         dtype=F64)

    def head(w, h2, fractions):
        cos = torch.cos(torch.pi * torch.arange(k, dtype=F64)[None, :] * fractions[:, None])
        cos = cos.to(torch.float32).to(F64)  # the kernel's features are float32
        phi = torch.relu(rnd(cos) @ rnd(w["w_phi"]).T + w["b_phi"])
        return rnd(h2.repeat_interleave(n, dim=0) * phi) @ rnd(w["w_iq"]).T + w["b_iq"]

    def relu_layer(x, w, bias, h_ref):
        lin = x @ w.T + bias
        return h_ref + (lin - lin.detach()) * (h_ref > 0)

    h1_ref, h2_ref = (torch.tensor(a, dtype=F64) for a in (online.h1, online.h2))
    h1 = relu_layer(torch.tensor(batch.s, dtype=F64), p["w_s1"], p["b_s1"], h1_ref)
    h2 = relu_layer(h1, p["w_s2"], p["b_s2"], h2_ref)  # Mech 10 left h2 unchanged (asserted)
    h2.retain_grad()
    q = head(p, h2, tau).reshape(b, n, -1)
    qt = head(pt, torch.tensor(target_next.h2, dtype=F64), tau_t).reshape(b, n, -1)
    r, done, isw = (torch.tensor(getattr(batch, f), dtype=F64) for f in ("r", "done", "isw"))
    bound = config.target_q_clip_mult * max(Q_ABS_REF, 1.0)
    idx = torch.arange(b)
    loss = torch.zeros((), dtype=F64)
    for d, (off, gamma) in enumerate(zip(branch_offsets(config.branches), config.gammas)):
        sel = qt[idx, :, off + torch.from_numpy(a_star[:, d]).long()]             # [B, j]
        y = torch.clamp(r[:, None] + gamma * (1 - done[:, None]) * sel, -bound, bound)
        taken = q[idx, :, off + torch.from_numpy(batch.a[:, d]).long()]         # [B, i]
        u = y[:, None, :] - taken[:, :, None]
        w = torch.abs(tau.reshape(b, n)[:, :, None] - (u < 0).to(F64)).detach()
        huber = torch.where(u.abs() <= 1, 0.5 * u * u, u.abs() - 0.5)
        loss = loss + (isw * (w * huber).sum(dim=(1, 2)) / n).sum() / b / config.n_branches
    loss.backward()
    return loss.item(), {name: t.grad.numpy() for name, t in p.items()}, h2.grad.numpy()


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


@pytest.mark.parametrize("precision", ["f32", "bf16", "tf32"])
@pytest.mark.parametrize("preset", ["tiny", "seed"])
def test_iqn_gradients_match_torch_autograd(preset, precision):
    config, layout, params, target, batch, a_star, online, target_next = _setup(preset, precision)
    assert np.array_equal(online.h2, online.h2_pre_clamp)  # the oracle has no clamp to model
    out = iqn_loss_and_grads(config, layout, params, target, online, target_next, batch, a_star,
                             STEP, SEED, Q_ABS_REF, H2_RMS, mode=precision)
    loss64, grads64, d_h2_64 = _torch_iqn(config, layout, params, target, batch, a_star, online,
                                          target_next)
    assert abs(float(out.loss) - loss64) <= LOSS_TOLERANCE * abs(loss64)
    tol = GRAD_TOLERANCE[precision]
    assert _rel(out.d_h2, d_h2_64) <= tol
    head, trunk = layout.views(out.head_grad), layout.views(out.trunk_grad)
    for name in HEAD:
        assert _rel(head[name], grads64[name]) <= tol, name
    for name in TRUNK:
        assert _rel(trunk[name], grads64[name]) <= tol, name
    # Each flat buffer is zero outside its own tensors.
    start, end = layout.iqn_range
    assert not np.any(out.head_grad[:start]) and not np.any(out.head_grad[end:])
    assert not np.any(out.trunk_grad[layout.trunk_end:])
    # Nothing to guard or sanitise at these magnitudes: the clean buffers are the raw ones.
    assert np.array_equal(out.d_h2_guarded, out.d_h2)
    assert np.array_equal(out.trunk_grad_clean, out.trunk_grad)


def test_fractions_are_the_generators_at_the_step_and_seed():
    config, layout, params, target, batch, a_star, online, target_next = _setup("tiny", "f32")
    args = (config, layout, params, target, online, target_next, batch, a_star)
    out = iqn_loss_and_grads(*args, STEP, SEED, Q_ABS_REF, H2_RMS, mode="f32")
    rows = np.arange(config.batch_size * config.iqn_quantiles)
    assert np.array_equal(out.tau, rng.uniform(SEED, rng.STREAMS["iqn_tau_online"], STEP, rows))
    assert np.array_equal(out.tau_target, rng.uniform(SEED, rng.STREAMS["iqn_tau_target"], STEP, rows))
    later = iqn_loss_and_grads(*args, STEP + 1, SEED, Q_ABS_REF, H2_RMS, mode="f32")
    assert not np.any(later.tau == out.tau) and later.loss != out.loss


def test_guard_and_sanitisation_bound_the_trunk_path():
    """A tiny guard multiplier clamps ``d_h2`` (and the trunk gradient) to its bound; a NaN
    target quantile reaches the loss and ``dq`` (sentinels) but neither clean buffer."""
    config, layout, params, target, batch, a_star, online, target_next = _setup("tiny", "f32")
    small = config.replace(aux_guard_mult=1e-6)
    out = iqn_loss_and_grads(small, layout, params, target, online, target_next, batch, a_star,
                             STEP, SEED, Q_ABS_REF, 0.5, mode="f32")
    bound = np.float32(1e-6)  # 1e-6 * max(0.5, 1): the floor is on the signal
    assert np.abs(out.d_h2).max() > bound
    assert np.array_equal(out.d_h2_guarded, np.clip(out.d_h2, -bound, bound))
    assert np.abs(out.trunk_grad_clean).max() <= bound

    poisoned = target_next.h2.copy()
    poisoned[3, :] = np.nan
    target_next.h2 = poisoned
    bad = iqn_loss_and_grads(config, layout, params, target, online, target_next, batch, a_star,
                             STEP, SEED, Q_ABS_REF, H2_RMS, mode="f32")
    assert np.isnan(bad.loss) and np.isnan(bad.d_quantiles).any() and np.isnan(bad.y).any()
    assert np.isfinite(bad.d_h2_guarded).all() and np.isfinite(bad.trunk_grad_clean).all()


def test_iqn_off_or_bad_arguments_raise_one_line_errors():
    config, layout, params, target, batch, a_star, online, target_next = _setup("tiny", "f32")
    off = config.replace(lambda_iqn=0.0)
    with pytest.raises(ValueError, match="lambda_iqn"):
        iqn_loss_and_grads(off, ParamLayout(off), params[:ParamLayout(off).num_elements], target,
                           online, target_next, batch, a_star, STEP, SEED, 0.0, 0.0, mode="f32")
    args = (config, layout, params, target, online, target_next, batch)
    for kwargs, field in ((dict(a_star=a_star[:, :1]), "a_star"), (dict(step=-1), "step"),
                          (dict(seed=2**64), "seed"), (dict(mode="fp16"), "mode")):
        call = dict(a_star=a_star, step=STEP, seed=SEED, mode="f32") | kwargs
        with pytest.raises(ValueError, match=field):
            iqn_loss_and_grads(*args, call["a_star"], call["step"], call["seed"], 0.0, 0.0,
                               mode=call["mode"])
