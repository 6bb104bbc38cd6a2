"""``reference.kernels.warmup.mse_warmup`` against torch autograd (float64) and hand-built cases
for the blend weight and the NaN contract. (The CUDA twin runs against it in conformance.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from foxhunt.reference import isv as isv_mod
from foxhunt.reference.kernels.distributional import support
from foxhunt.reference.kernels.fused import branch_offsets
from foxhunt.reference.kernels.warmup import mse_warmup, warmup_weight

F32 = np.float32
U = 2.0 ** -24
BRANCHES = (3, 3, 2)
B, NA = 16, 11
EPOCH = isv_mod.EPOCH_IDX_INDEX


def _isv(epoch: float) -> np.ndarray:
    isv = isv_mod.ISVBus().to_array().astype(F32, copy=True)
    isv[EPOCH] = F32(epoch)
    return isv


def _problem(seed: int = 0):
    """Online logits of [s; s2] (R = 2B samples per branch block), actions, targets, weights."""
    rng = np.random.default_rng(seed)
    logits = [rng.standard_normal((2 * B, n, NA)) * 2 for n in BRANCHES]
    actions = np.stack([rng.integers(0, n, B) for n in BRANCHES]).astype(np.int32)
    target_q = (rng.standard_normal((len(BRANCHES), B)) * 3).astype(F32)
    isw = rng.uniform(0.1, 1.0, B).astype(F32)
    dl_c51 = [(rng.standard_normal((B, n, NA)) * 1e-3).astype(F32) for n in BRANCHES]
    return logits, actions, target_q, isw, dl_c51


def _packed(blocks) -> np.ndarray:
    return np.concatenate([b.reshape(-1, NA) for b in blocks]).astype(F32)


def _kernel_inputs(logits, actions):
    """``logp`` branch-packed, and ``q_taken`` (E at the taken action) from it."""
    logp = [torch.log_softmax(torch.from_numpy(x), -1).numpy().astype(F32) for x in logits]
    z = support(-10.0, 10.0, NA)
    rows = np.arange(B)
    q_taken = np.stack([np.exp(lp[rows, actions[d]]) @ z for d, lp in enumerate(logp)]).astype(F32)
    return _packed(logp), q_taken, z


def _torch_mse(logits, actions, target_q, isw):
    """``(1/nb) sum_d sum_b isw_b 0.5 (E_d[b] - y)^2 / B`` and its gradient w.r.t. the logits of
    the first B samples, float64."""
    z = torch.from_numpy(support(-10.0, 10.0, NA).astype(np.float64))
    total = 0.0
    leaves = [torch.from_numpy(x[:B]).requires_grad_(True) for x in logits]
    for d, t in enumerate(leaves):
        p = torch.softmax(t, -1)[torch.arange(B), torch.from_numpy(actions[d].astype(np.int64))]
        td = (p * z).sum(-1) - torch.from_numpy(target_q[d].astype(np.float64))
        total = total + (torch.from_numpy(isw.astype(np.float64)) * 0.5 * td * td).sum()
    loss = total / (B * len(BRANCHES))
    loss.backward()
    return loss.item(), [t.grad.numpy() for t in leaves]


@pytest.mark.parametrize("epoch, w", [(0, 1.0), (1, 0.75), (3, 0.25)])
def test_mse_warmup_matches_autograd_and_blends(epoch, w):
    logits, actions, target_q, isw, dl_c51 = _problem()
    logp, q_taken, z = _kernel_inputs(logits, actions)
    out = mse_warmup(logp, actions, q_taken, target_q, isw, z, _packed(dl_c51), _isv(epoch),
                     EPOCH, 4, BRANCHES)
    loss, grads = _torch_mse(logits, actions, target_q, isw)
    assert out.w == F32(w)
    # q_taken is float32 (a few ulp of E); then 48 float32 parts summed pairwise
    assert out.loss == pytest.approx(loss, rel=64 * U)
    want = (1 - w) * _packed(dl_c51).astype(np.float64) + w * _packed(grads)
    # g = ((isw scale) td) (p (z - E)) and the blend: a handful of float32 roundings of terms
    # no larger than the largest element (measured: under 4 ulp of it)
    np.testing.assert_allclose(out.dlogits, want, rtol=0, atol=16 * U * np.abs(want).max())


def test_mse_warmup_after_the_warmup_leaves_the_c51_gradient_bitwise():
    logits, actions, target_q, isw, dl_c51 = _problem(1)
    logp, q_taken, z = _kernel_inputs(logits, actions)
    dl = _packed(dl_c51)
    dl[0, 0] = np.nan  # even a NaN is passed through untouched
    for epoch in (4, 7):
        out = mse_warmup(logp, actions, q_taken, target_q, isw, z, dl, _isv(epoch), EPOCH, 4,
                         BRANCHES)
        assert out.w == 0 and out.dlogits.tobytes() == dl.tobytes()
        assert out.loss > 0  # the MSE is still reported


def test_mse_warmup_reads_the_first_b_samples_of_each_block():
    logits, actions, target_q, isw, dl_c51 = _problem(2)
    logp, q_taken, z = _kernel_inputs(logits, actions)
    poisoned = logp.copy()
    for n, off in zip(BRANCHES, branch_offsets(BRANCHES)):  # online(s2): rows B..2B of a block
        poisoned[2 * B * off + B * n:2 * B * (off + n)] = np.nan
    args = (actions, q_taken, target_q, isw, z, _packed(dl_c51), _isv(1), EPOCH, 4, BRANCHES)
    a, b = mse_warmup(logp, *args), mse_warmup(poisoned, *args)
    assert all(np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(a, b))


def test_mse_warmup_nan_contract():
    logits, actions, target_q, isw, dl_c51 = _problem(3)
    logp, q_taken, z = _kernel_inputs(logits, actions)
    target_q = target_q.copy()
    target_q[0, 5] = np.nan  # branch 0, sample 5: its taken row's g, and the loss
    out = mse_warmup(logp, actions, q_taken, target_q, isw, z, _packed(dl_c51), _isv(1), EPOCH, 4,
                     BRANCHES)
    rows = out.dlogits.reshape(-1, NA)
    bad = 5 * BRANCHES[0] + actions[0, 5]
    assert np.all(np.isnan(rows[bad])) and np.isnan(out.loss)
    assert np.isfinite(np.delete(rows, bad, axis=0)).all()


@pytest.mark.parametrize("epoch, warmup, w", [(0, 5, 1.0), (5, 5, 0.0), (9, 5, 0.0),
                                              (2, 8, 0.75), (np.nan, 5, 0.0)])
def test_warmup_weight(epoch, warmup, w):
    assert warmup_weight(F32(epoch), warmup) == F32(w)


def test_mse_warmup_rejects_bad_arguments():
    logits, actions, target_q, isw, dl_c51 = _problem()
    logp, q_taken, z = _kernel_inputs(logits, actions)
    args = dict(logp=logp, actions=actions, q_taken=q_taken, target_q=target_q, isw=isw, z=z,
                dlogits_c51=_packed(dl_c51), isv=_isv(0), epoch_index=EPOCH, warmup_epochs=4,
                branches=BRANCHES)
    for bad, match in (({"warmup_epochs": 0}, "warmup_epochs"),
                       ({"epoch_index": isv_mod.ISV_LEN}, "epoch_index"),
                       ({"actions": np.full_like(actions, 3)}, "actions"),
                       ({"dlogits_c51": _packed(dl_c51)[1:]}, "dlogits_c51"),
                       ({"q_taken": q_taken[:, 1:]}, "q_taken")):
        with pytest.raises(ValueError, match=match):
            mse_warmup(**{**args, **bad})


def test_warmup_plan_matches_warmup_cu():
    """plan_mse_warmup launches warmup.cu's WARMUP_THREADS (its __launch_bounds__), a warp per
    (branch, sample)."""
    import re
    from importlib import resources

    from foxhunt.fast.kernels import warmup as fast_warmup

    text = (resources.files("foxhunt.cuda_src") / "warmup.cu").read_text()
    threads = int(re.search(r"#define WARMUP_THREADS (\d+)", text).group(1))
    assert fast_warmup.WARMUP_THREADS == threads
    (grid,), (block,), shared = fast_warmup.plan_mse_warmup(256, BRANCHES, 51)
    assert block == threads and shared == 0 and grid * block == len(BRANCHES) * 256 * 32
