"""The second-wave sources' buffers of the fast step (SPEC 4 second wave; issue 18), added to
the ``StepLayout`` of a config that turns them on (pure: no GPU). A source whose weight is 0
adds nothing: the layout of the core step is unchanged, buffer for buffer.

- IQN (``lambda_iqn``): the device step counter ``step_count`` (state: the quantile fractions'
  offset, ``state_dict["step"]``), the head's forward for the online (``o``) and target (``t``)
  passes (fractions, cosine features, ``phi``, ``e = h2 * phi``, quantiles; packed, each a GEMM
  operand), the loss's targets and gradient, the head's backward, its own gradient buffer
  ``iqn_grad`` (the IQN tensors' range: element ``k`` is parameter ``iqn_lo + k``) and norm,
  and the trunk backward of its ``d h2`` into ``iqn_trunk_grad`` (the trunk range) and its
  sanitised copy ``iqn_trunk_clean`` (the budget's input; layout-sized, zero past the trunk).
- Auxiliary heads (``aux_next_bar_weight``, ``aux_regime_weight``): per head its hidden layer,
  output, their gradients and its weighted ``d h2`` (sentinels 30, 52); with both, their sum.
  Their labels ride in the batch (``batch.next_ret``, ``batch.regime``: ``StepLayout``).
- Ensemble (``ens_weight``): the frozen priors' hidden layers and logits, the KL's outputs, the
  value head's backward and the guarded trunk backward into ``ens_trunk_grad`` (``[0,
  value_end)``; sentinel 51) and its sanitised copy ``ens_trunk_clean``.
- MSE warm-up (``c51_warmup_epochs``): no buffer (it blends ``dlogits_c51`` in place; its
  loss and weight are readback entries, sentinel 3 the loss's).
- The budget: with IQN or the ensemble on, one pass applies every clip and SAXPY
  (``clip_saxpy_norm_partial_wave``) into ``grad``; each injected source has its norm partials
  and squared norm (``wave_plan.budget``).

``wave_sentinel_pieces(lay)``: the ranges of the sources' fused sentinel slots.
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.records import F32, I64, U16
from foxhunt.reference import sentinels
from foxhunt.reference.kernels.step import READBACK_INDEX

def injected_sources(config) -> tuple[str, ...]:
    """The budget sources injected after the C51 + CQL pipeline, in the reference's order
    (``budgets.second_wave_budgets``): ``iqn``, then ``ens``."""
    return tuple(s for s, on in (("iqn", config.iqn_on), ("ens", config.ens_on)) if on)


def add_wave_buffers(lay) -> None:
    """Add the buffers of ``lay.config``'s second-wave sources to ``lay`` (a ``StepLayout``
    whose core buffers exist)."""
    from foxhunt.fast.step_layout import NORM_SEGMENT, OPERAND_ALIGN, Packed, blocks

    c, pl = lay.config, lay.param_layout
    lay.grad_base = {}  # gradient buffers holding one range of the layout: {name: first element}
    for src in injected_sources(c):
        lay._add(f"partials_{src}", lay.n_partials, F32)
        lay._add(f"sq_{src}", 1, F32)
    if c.second_wave_on:  # the IQN Adam's grad_scale, the aux sum's clamp signal
        lay._add("one", 1, F32, "constant")
    if c.aux_on:
        _aux_buffers(lay)
    if c.ens_on:
        _ens_buffers(lay)
    if not c.iqn_on:
        return
    B, H, nb = lay.B, lay.H2, lay.nb
    N, K, A = c.iqn_quantiles, c.iqn_embed, lay.A_total
    M = B * N
    lay.iqn_rows = M
    lay._add("step_count", 1, I64, "state")

    def pair(name, per, dtype=F32):
        p = Packed(name, dtype, OPERAND_ALIGN)
        for tag in ("o", "t"):
            p.add(tag, per)
        lay._add_packed(p)

    pair("iqn_tau", M)
    pair("iqn_cos", M * K)
    pair("iqn_phi", M * H)
    pair("iqn_e", M * H)
    pair("iqn_q", M * A)
    if lay.bf16:
        pair("iqn_cos_bf16", M * K, U16)
        pair("iqn_e_bf16", M * H, U16)
    lay._add("iqn_y", (nb, B, N), F32)
    lay._add("iqn_dq", (M, A), F32)
    lay._add("iqn_de", (M, H), F32)
    lay._add("iqn_d_phi_pre", (M, H), F32)
    lay._add("iqn_d_h2", (B, H), F32)
    lo, hi = pl.iqn_range
    lay.grad_base["iqn_grad"] = lo
    lay._add("iqn_grad", hi - lo, F32)
    lay._add("partials_iqn_head", blocks(hi - lo, NORM_SEGMENT), F32)
    lay._add("sq_iqn_head", 1, F32)
    # The trunk backward of the guarded d h2 (its copy into dh2_iqn is sentinel 35's buffer).
    _guarded_trunk_buffers(lay, "iqn", pl.trunk_end)


def aux_heads(config) -> tuple[tuple[str, int], ...]:
    """``(layout key, outputs)`` of each auxiliary head that is on: ``nb`` (one prediction),
    ``rg`` (``n_regimes`` logits)."""
    return tuple((key, n) for key, on, n in (("nb", config.aux_next_bar_on, 1),
                                             ("rg", config.aux_regime_on, config.n_regimes))
                 if on)


def _aux_buffers(lay) -> None:
    """Each head's hidden layer (and its BF16 copy), outputs, their gradients and its weighted
    ``d h2`` (sentinels 30, 52); with both heads, their guarded sum ``aux_dh2``; the C51 trunk's
    masked copy of the sum with them, and the C51 heads' own sum (slot 33's, beside the trunk)."""
    c = lay.config
    B, H, AXH = lay.B, lay.H2, c.aux_hidden
    for key, n_out in aux_heads(c):
        for name in ("aux_hid", "aux_dhid", "aux_dpre"):
            lay._add(f"{name}_{key}", (B, AXH), F32)
        if lay.bf16:
            lay._add(f"aux_hid_bf16_{key}", (B, AXH), U16)
        lay._add(f"aux_out_{key}", (B, n_out), F32)
        lay._add(f"aux_dout_{key}", (B, n_out), F32)
        lay._add(f"aux_d_h2_{key}", (B, H), F32)
    if len(aux_heads(c)) > 1:
        lay._add("aux_dh2", (B, H), F32)
    lay._add("dh2s_c51", (B, H), F32)
    # The C51 heads' d h2 sum before the auxiliary SAXPY (slot 33's copy) and its masks.
    lay._add("dh2_main_c51", (B, H), F32)
    lay._add("dh2m_main_c51", (B, H), F32)


def _ens_buffers(lay) -> None:
    """The prior heads' hidden layers (and BF16 copies) and logits ``[K-1, B, NA]``, the KL's
    outputs, the value head's backward, the guarded trunk backward into ``ens_trunk_grad``
    (``[0, value_end)``; sentinel 51) and its sanitised copy ``ens_trunk_clean`` (layout-sized,
    zero past the value head)."""
    from foxhunt.fast.step_layout import OPERAND_ALIGN, Packed

    c, pl = lay.config, lay.param_layout
    B, H, NA, VH = lay.B, lay.H2, lay.NA, c.value_h
    priors = range(1, c.ens_heads)
    # The priors' logits contiguous (ens_kl_grad reads [K-1, B, NA]); the hidden layers aligned.
    for name, per, dtype, align in (("ens_hid", B * VH, F32, OPERAND_ALIGN),
                                    ("ens_priors", B * NA, F32, 1)) + (
            (("ens_hid_bf16", B * VH, U16, OPERAND_ALIGN),) if lay.bf16 else ()):
        p = Packed(name, dtype, align)
        for k in priors:
            p.add(k, per)
        lay._add_packed(p)
    lay._add("ens_d_v", (B, NA), F32)
    lay._add("ens_kl", B, F32)
    lay._add("ens_dhv", (B, VH), F32)
    lay._add("ens_dpre", B * VH, F32)
    lay._add("ens_d_h2", (B, H), F32)
    _guarded_trunk_buffers(lay, "ens", pl.value_end)


def _guarded_trunk_buffers(lay, src: str, grad_len: int) -> None:
    """The buffers of a source's guarded trunk backward (IQN, ensemble): the guard's output
    ``dh2g_<src>``, the trunk-gradient buffer it is copied into ``dh2_<src>``, its masked form,
    h1's gradient, the fallback scratch, the source's gradient over ``[0, grad_len)`` and its
    sanitised copy over the whole layout."""
    B, H, H1 = lay.B, lay.H2, lay.H1
    for name in (f"dh2g_{src}", f"dh2_{src}", f"dh2m_{src}"):
        lay._add(name, (B, H), F32)
    lay._add(f"dh1_{src}", (B, H1), F32)
    lay._add(f"dpre_{src}", B * H1, F32)
    lay._add(f"{src}_trunk_grad", grad_len, F32)
    lay._add(f"{src}_trunk_clean", lay.NP, F32)


def wave_constants(lay) -> dict[str, np.ndarray]:
    """Host values of the second-wave constant buffers (``step_program.step_constants``)."""
    return {"one": np.ones(1, np.float32)} if "one" in lay.specs else {}


def wave_zero_padding(lay) -> dict[str, list[tuple[int, int]]]:
    """Byte ranges of the second-wave buffers that no record writes (zero since the arena was
    made): the padding between the tensors of a range gradient, the trunk gradient's, and the
    sanitised trunk gradient and norm partials past the trunk."""
    from foxhunt.fast.step_layout import NORM_SEGMENT

    pl, out = lay.param_layout, {}

    def gaps(name, lo, hi, tensors):
        spans, end = [], lo
        for t in sorted(tensors, key=lambda t: t.offset):
            if t.offset > end:
                spans.append(((end - lo) * 4, (t.offset - lo) * 4))
            end = max(end, t.end)
        if hi > end:
            spans.append(((end - lo) * 4, (hi - lo) * 4))
        if spans:
            out[name] = spans

    if lay.config.iqn_on:
        gaps("iqn_grad", *pl.iqn_range, pl.group_tensors("iqn"))
    for src, end, groups in (("iqn", pl.trunk_end, ("trunk",)),
                             ("ens", pl.value_end, ("trunk", "value"))):
        if src not in injected_sources(lay.config):
            continue
        gaps(f"{src}_trunk_grad", 0, end, [t for g in groups for t in pl.group_tensors(g)])
        out[f"{src}_trunk_clean"] = [(end * 4, lay.NP * 4)]
        used = -(-end // NORM_SEGMENT)
        if used < lay.n_partials:
            out[f"partials_{src}"] = [(used * 4, lay.n_partials * 4)]
    return out


def wave_sentinel_pieces(lay, one) -> dict[str, list]:
    """The fused sentinel slots of the second-wave sources that are on, by slot name, as
    ``one(name, buffer, offset, count)`` pieces (``sentinel_plan.sentinel_pieces``' helper):
    exactly the buffers of the reference's ``Trainer._sentinel_buffers``."""
    c, pl = lay.config, lay.param_layout
    out: dict[str, list] = {}
    if c.iqn_on:
        lo, hi = pl.iqn_range
        M = lay.B * c.iqn_quantiles
        out.update({
            "iqn_trunk_grad": one("iqn_trunk_grad", "iqn_trunk_grad", 0, pl.trunk_end),
            "iqn_d_h2": one("iqn_d_h2", "iqn_d_h2", 0, lay.B * lay.H2),
            "iqn_d_quantiles": one("iqn_d_quantiles", "iqn_dq", 0, M * lay.A_total),
            "iqn_adam_m_max": one("iqn_adam_m_max", "adam_m", lo, hi - lo),
            "iqn_adam_v_max": one("iqn_adam_v_max", "adam_v", lo, hi - lo),
            "iqn_weight_max": one("iqn_weight_max", "params2", lo, hi - lo),
        })
    for key, name in (("nb", "aux_next_bar_d_h2"), ("rg", "aux_regime_d_h2")):
        if any(k == key for k, _ in aux_heads(c)):
            out[name] = one(name, f"aux_d_h2_{key}", 0, lay.B * lay.H2)
    if c.ens_on:
        out["ens_d_logits"] = one("ens_d_logits", "ens_d_v", 0, lay.B * lay.NA)
        out["ens_trunk_grad"] = one("ens_trunk_grad", "ens_trunk_grad", 0, pl.value_end)
    if c.mse_on:
        out["mse_loss"] = one("mse_loss", "readback", READBACK_INDEX["mse_loss"], 1)
    assert all(not sentinels.slot_by_name(name).inline for name in out)
    return out


__all__ = ["add_wave_buffers", "aux_heads", "injected_sources",
           "wave_constants", "wave_sentinel_pieces", "wave_zero_padding"]
