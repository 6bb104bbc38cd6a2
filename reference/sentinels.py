"""Sentinel slots: the NaN / magnitude flags of one training step (SPEC 6; seed ``000``).

A sentinel slot names one buffer at one point of the step. The flags live in an ``int32``
buffer of ``NUM_SENTINEL_SLOTS`` entries; a check sets slot k to 1 if any element of its buffer
is non-finite, or, for a ``threshold`` slot, if ``max|x| >= threshold_k``. Flags are sticky
until explicitly reset (fold boundary).

Numbers are the seed's wherever the same buffer exists here: 1/2 online value/advantage
logits, 3 MSE loss, 6 ``grad_buf``, 7/8 the loss's saved log-probs and projection, 12 ``h2``,
24/25 ``d_value_logits`` / ``d_adv_logits``, 26-31 the auxiliary-source buffers, 33-35 the
trunk-gradient snapshots, 36-48 Mech 5 Adam/weight diagnostics, 49 the ``h2`` max-abs
diagnostic. Indices whose seed buffer has no counterpart stay unassigned (16-20: the seed's GRN
sub-stages; 32: its bottleneck) and their flag stays 0. Other buffers of our step take the
seed's unused low indices (0, 4, 5, 9-11, 13-15, 21-23) and indices from 50 on.
Per-component gradient buffers: ``grad_c51`` (54) and ``grad_cql`` (14) before their budgets,
``iqn_trunk_grad`` (26) and ``ens_trunk_grad`` (51) trunk scratches, ``grad_buf`` (6) the sum.

Points (``STEP_POINTS``, in step order) say which moment of the step the checked values come
from. ``inline`` slots snapshot a buffer that is overwritten later (h2 before the Mech 10 clamp;
the trunk-gradient buffer ``d_h2`` at three moments) and are separate checks at their point;
every other slot is checked by one fused launch per captured graph (``fused_slots``): graph 1 is
forward + loss + backward + budgets, graph 2 the optimiser + spectral norm + target update.

Threshold rules (Mech 5 / Mech 10): ``multiplier * max(ISV[base], 1) ** power``; the floor is on
the ISV signal, never on the threshold (SPEC 5). ``base`` is ``Q_ABS_REF`` for the Q-space
diagnostics (36-48) and ``H_S2_RMS_EMA`` for slot 49 (activation space; don't conflate them).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from foxhunt.reference import isv as isv_mod

KINDS = ("nonfinite", "threshold")

#: Moments of the step a slot's values come from, in step order.
STEP_POINTS = (
    "batch",            # the sampled batch, before the forward passes
    "forward",          # after the three forward passes (h2 after the Mech 10 clamp)
    "trunk_pre_clamp",  # h2 of each pass right after the trunk, before the Mech 10 clamp
    "loss",             # after the C51 / CQL / MSE losses and the Mech 1 targets
    "head_grads",       # gradients at the heads' outputs (logits, quantiles, aux d h2)
    "backward_main",    # trunk-gradient buffer after the main heads backward, before the trunk
    "aux_saxpy",        # trunk-gradient buffer after the auxiliary heads' d h2 SAXPYs
    "iqn_copy",         # trunk-gradient buffer after the IQN d h2 copy into it
    "component_grads",  # each source's own flat gradient (scratch) buffer, before its budget
    "backward",         # grad_buf after the budget pipeline, before Adam
    "optimizer",        # after Adam (Mech 9 clamp) and spectral norm
    "target_update",    # after the Polyak update / hard sync
)

#: Which captured graph (SPEC 9) ends at or after each point.
POINT_GRAPH = MappingProxyType({p: (2 if p in ("optimizer", "target_update") else 1)
                                for p in STEP_POINTS})

# Seed multipliers of the thresholds without a config field (Mech 5 table, seed 000).
TARGET_Q_DIAG_MULT = 95.0
ATOM_SPAN_DIAG_MULT = 190.0


@dataclass(frozen=True)
class ThresholdRule:
    """``threshold = multiplier * max(ISV[isv_slot], 1) ** power`` (float32).

    ``config_field`` names the ``DQNConfig`` field that overrides ``multiplier`` (``None``: the
    seed's constant is used). A NaN ISV value counts as 1 (CUDA ``fmaxf(NaN, 1) = 1``).
    """

    multiplier: float
    isv_slot: str = "Q_ABS_REF"
    power: int = 1
    config_field: str | None = None

    def value(self, isv_value: float, multiplier: float | None = None) -> np.float32:
        m = np.float32(self.multiplier if multiplier is None else multiplier)
        eff = np.fmax(np.float32(isv_value), np.float32(1.0))
        with np.errstate(over="ignore"):
            base = eff if self.power == 1 else np.float32(eff * eff)
            return np.float32(m * base)


@dataclass(frozen=True)
class SentinelSlot:
    """One flag: ``buffer`` checked at ``point``; ``threshold`` set iff ``kind == "threshold"``."""

    index: int
    name: str
    kind: str
    buffer: str
    point: str
    inline: bool = False
    threshold: ThresholdRule | None = None
    description: str = ""


def _nf(index: int, name: str, buffer: str, point: str, description: str,
        inline: bool = False) -> SentinelSlot:
    return SentinelSlot(index, name, "nonfinite", buffer, point, inline, None, description)


def _th(index: int, name: str, buffer: str, point: str, rule: ThresholdRule,
        description: str) -> SentinelSlot:
    return SentinelSlot(index, name, "threshold", buffer, point, False, rule, description)


_ADAM_M = ThresholdRule(100.0, "Q_ABS_REF", 1, "adam_m_diag_mult")
_ADAM_V = ThresholdRule(1e6, "Q_ABS_REF", 2, "adam_v_diag_mult")
_WEIGHT = ThresholdRule(1e3, "Q_ABS_REF", 1, "weight_diag_mult")
_GROUPS = ("trunk", "value", "branch", "iqn")  # Mech 5 parameter groups, the seed's order

SENTINELS: tuple[SentinelSlot, ...] = (
    _nf(0, "states", "s", "batch", "batch states s [B, SD]"),
    _nf(1, "online_value_logits", "v", "forward",
        "online(s) value-stream logits v [B, NA] (seed: on_v_logits)"),
    _nf(2, "online_adv_logits", "adv", "forward",
        "online(s) advantage logits of every branch [B, n_d, NA] (seed: on_b_logits)"),
    _nf(3, "mse_loss", "mse_loss", "loss", "expected-Q MSE warmup loss (seed: mse_loss_scalar)"),
    _nf(4, "online_next_logits", "logits_next", "forward",
        "online(s2) logits of every branch (double-DQN action choice)"),
    _nf(5, "target_next_logits", "target_logits_next", "forward",
        "target(s2) logits of every branch"),
    _nf(6, "grad_buf", "grad_buf", "backward",
        "main flat gradient after the budget pipeline, before Adam"),
    _nf(7, "current_logp", "logp", "loss",
        "online(s) log-probabilities logp_d [B, n_d, NA] (seed: save_current_lp)"),
    _nf(8, "projected_dist", "m", "loss",
        "C51 projected target distributions m (seed: save_projected)"),
    _nf(9, "td_errors", "td_errors", "loss", "per-sample loss / PER priority [B]"),
    _nf(10, "c51_loss", "c51_loss", "loss", "C51 total loss"),
    _nf(11, "h1", "h1", "forward", "trunk first layer h1 [B, SH1] of every forward pass"),
    _nf(12, "h2", "h2", "trunk_pre_clamp",
        "trunk output h2 [B, SH2] of every forward pass, before the Mech 10 clamp "
        "(seed: save_h_s2)", inline=True),
    _nf(13, "cql_loss", "cql_loss", "loss", "CQL loss"),
    _nf(14, "grad_cql", "grad_cql", "component_grads",
        "CQL flat gradient in its own buffer, before its 15% budget"),
    _nf(15, "params", "params", "optimizer",
        "online flat parameters after Adam (Mech 9 clamp) and spectral norm"),
    _nf(21, "next_states", "s2", "batch", "batch next states s2 [B, SD]"),
    _nf(22, "rewards", "r", "batch", "batch rewards r [B]"),
    _nf(23, "importance_weights", "isw", "batch", "batch importance weights isw [B]"),
    _nf(24, "d_value_logits", "d_value_logits", "head_grads",
        "C51 gradient w.r.t. the value logits [B, NA] (seed: d_value_logits_buf)"),
    _nf(25, "d_adv_logits", "d_adv_logits", "head_grads",
        "C51 gradient w.r.t. the advantage logits [B, sum n_d, NA] (seed: d_adv_logits_buf)"),
    _nf(26, "iqn_trunk_grad", "iqn_trunk_grad", "component_grads",
        "IQN trunk-gradient scratch, before its 10% budget (seed: iqn_trunk_m)"),
    _nf(27, "iqn_d_h2", "iqn_d_h2", "head_grads",
        "IQN head's gradient w.r.t. h2 [B, SH2] (seed: iqn_d_h_s2_ptr)"),
    _nf(28, "iqn_d_quantiles", "iqn_d_quantiles", "head_grads",
        "quantile Huber loss gradient w.r.t. the quantile values (seed: d_branch_logits_buf)"),
    _nf(29, "cql_d_value_logits", "cql_d_value_logits", "head_grads",
        "CQL gradient w.r.t. the value logits [B, NA]"),
    _nf(30, "aux_next_bar_d_h2", "aux_next_bar_d_h2", "head_grads",
        "next-bar regression head's gradient w.r.t. h2 [B, SH2] (seed: aux_dh_s2_nb_buf)"),
    _nf(31, "ens_d_logits", "ens_d_logits", "head_grads",
        "ensemble-diversity KL gradient w.r.t. head 0's logits (seed: ensemble_d_logits_buf)"),
    _nf(33, "d_h2_post_main", "d_h2", "backward_main",
        "trunk-gradient buffer after the main heads backward (seed: bw_d_h_s2_post_main)",
        inline=True),
    _nf(34, "d_h2_post_aux", "d_h2", "aux_saxpy",
        "trunk-gradient buffer after the auxiliary SAXPYs (seed: bw_d_h_s2_post_aux)",
        inline=True),
    _nf(35, "d_h2_post_iqn", "d_h2", "iqn_copy",
        "trunk-gradient buffer after the IQN d h2 copy (seed: bw_d_h_s2_post_iqn)", inline=True),
    *(_th(36 + g, f"{group}_adam_m_max", f"adam_m[{group}]", "optimizer", _ADAM_M,
          f"max |Adam m| of the {group} parameters (Mech 5)") for g, group in enumerate(_GROUPS)),
    *(_th(40 + g, f"{group}_adam_v_max", f"adam_v[{group}]", "optimizer", _ADAM_V,
          f"max |Adam v| of the {group} parameters (Mech 5)") for g, group in enumerate(_GROUPS)),
    _th(44, "trunk_weight_max", "params[trunk]", "optimizer", _WEIGHT,
        "max |w| of the trunk parameters (Mech 5; Mech 9 clamps at 100x)"),
    _th(45, "heads_weight_max", "params[heads]", "optimizer", _WEIGHT,
        "max |w| of the value and branch head parameters (Mech 5)"),
    _th(46, "target_q_post_clip", "target_q", "loss",
        ThresholdRule(TARGET_Q_DIAG_MULT, "Q_ABS_REF", 1, None),
        "Mech 1-clipped scalar targets [B, n_branches]"),
    _th(47, "atom_span_max", "support", "loss",
        ThresholdRule(ATOM_SPAN_DIAG_MULT, "Q_ABS_REF", 1, None),
        "the step's per-branch atom positions z [n_branches, NA] (Mech 2: the live support "
        "of adaptive_atoms, else the fixed [v_min, v_max])"),
    _th(48, "iqn_weight_max", "params[iqn]", "optimizer", _WEIGHT,
        "max |w| of the IQN head parameters (Mech 5)"),
    _th(49, "h2_max_abs", "h2", "forward",
        ThresholdRule(1e3, "H_S2_RMS_EMA", 1, "h2_diag_mult"),
        "h2 after the Mech 10 clamp (clamp at 100x, diagnostic at 1000x the RMS EMA)"),
    _nf(50, "cql_d_adv_logits", "cql_d_adv_logits", "head_grads",
        "CQL gradient w.r.t. the advantage logits [B, sum n_d, NA]"),
    _nf(51, "ens_trunk_grad", "ens_trunk_grad", "component_grads",
        "ensemble-diversity trunk-gradient scratch, before its 5% budget"),
    _nf(52, "aux_regime_d_h2", "aux_regime_d_h2", "head_grads",
        "regime classification head's gradient w.r.t. h2 [B, SH2]"),
    _nf(53, "target_params", "target_params", "target_update",
        "target flat parameters after the Polyak update / hard sync"),
    _nf(54, "grad_c51", "grad_c51", "component_grads",
        "C51 flat gradient, before its 70% budget clip (grad_buf starts as its clipped copy)"),
)


def validate_sentinels(slots: Sequence[SentinelSlot], num_slots: int | None = None) -> None:
    """Raise ``ValueError`` unless ``slots`` is a consistent sentinel table.

    Checked: entries are ``SentinelSlot``; index an int >= 0 (and < ``num_slots`` if given); no
    duplicate index or name; name a lower-case identifier; kind in ``KINDS``; a threshold rule
    iff the kind is ``threshold``, with a positive finite multiplier, power 1 or 2, and an
    ``isv_slot`` that exists in the ISV registry; point in ``STEP_POINTS``.
    """
    seen_index: dict[int, str] = {}
    seen_name: dict[str, int] = {}
    for s in slots:
        if not isinstance(s, SentinelSlot):
            raise ValueError(f"sentinel entry {s!r} is not a SentinelSlot")
        if isinstance(s.index, bool) or not isinstance(s.index, int) or s.index < 0 or \
                (num_slots is not None and s.index >= num_slots):
            bound = f"[0, {num_slots})" if num_slots is not None else ">= 0"
            raise ValueError(f"sentinel {s.name!r}: index={s.index!r} must be an integer {bound}")
        if s.index in seen_index:
            raise ValueError(
                f"sentinel slots {seen_index[s.index]!r} and {s.name!r} share index {s.index}"
            )
        if not isinstance(s.name, str) or not s.name.isidentifier() or s.name != s.name.lower():
            raise ValueError(f"sentinel {s.index}: name={s.name!r} must be a lower-case identifier")
        if s.name in seen_name:
            raise ValueError(
                f"sentinel name {s.name!r} is used twice (indices {seen_name[s.name]} and {s.index})"
            )
        if s.kind not in KINDS:
            raise ValueError(f"sentinel {s.name!r}: kind={s.kind!r}; allowed values are {KINDS}")
        if s.point not in STEP_POINTS:
            raise ValueError(f"sentinel {s.name!r}: point={s.point!r}; allowed values are {STEP_POINTS}")
        if (s.kind == "threshold") != (s.threshold is not None):
            raise ValueError(
                f"sentinel {s.name!r}: kind={s.kind!r} with threshold={s.threshold!r}; a "
                "threshold rule is required for kind 'threshold' and forbidden otherwise"
            )
        if s.threshold is not None:
            rule = s.threshold
            if not np.isfinite(rule.multiplier) or rule.multiplier <= 0:
                raise ValueError(
                    f"sentinel {s.name!r}: multiplier={rule.multiplier!r} must be finite and > 0"
                )
            if rule.power not in (1, 2):
                raise ValueError(f"sentinel {s.name!r}: power={rule.power!r}; allowed values are (1, 2)")
            isv_mod.slot(rule.isv_slot)  # raises ValueError for an unknown ISV slot name
        seen_index[s.index] = s.name
        seen_name[s.name] = s.index


validate_sentinels(SENTINELS)

#: Length of the int32 flag buffer (largest index + 1; unassigned indices stay 0).
NUM_SENTINEL_SLOTS = max(s.index for s in SENTINELS) + 1

_BY_NAME: Mapping[str, SentinelSlot] = MappingProxyType({s.name: s for s in SENTINELS})
_BY_INDEX: Mapping[int, SentinelSlot] = MappingProxyType({s.index: s for s in SENTINELS})


def slot_by_name(name: str) -> SentinelSlot:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown sentinel slot name {name!r}; known: {sorted(_BY_NAME)}") from None


def index(name: str) -> int:
    """The flag index of slot ``name`` (``index("h2") == 12``)."""
    return slot_by_name(name).index


def slot_by_index(index: int) -> SentinelSlot | None:
    """The slot at ``index``, or ``None`` for an unassigned index."""
    return _BY_INDEX.get(index)


def fused_slots(graph: int) -> tuple[SentinelSlot, ...]:
    """The non-inline slots checked by the fused launch at the end of captured graph 1 or 2."""
    if graph not in (1, 2):
        raise ValueError(f"graph={graph!r}: allowed values are (1, 2)")
    return tuple(s for s in SENTINELS if not s.inline and POINT_GRAPH[s.point] == graph)


class ThresholdTable(NamedTuple):
    """Every slot's threshold rule as the arrays of ``kernels.step.step_bounds``, each
    ``[NUM_SENTINEL_SLOTS]``: ``mult`` (float32, 0 for a non-threshold slot), ``isv_index``
    (int32 ISV index, -1 for a non-threshold slot: threshold 0) and ``power`` (int32, 1 or 2)."""

    mult: np.ndarray
    isv_index: np.ndarray
    power: np.ndarray


def _multiplier(rule: ThresholdRule, config: Any | None) -> float:
    """The rule's multiplier: its ``config_field`` of ``config`` where both are given."""
    if config is not None and rule.config_field is not None:
        return getattr(config, rule.config_field)
    return rule.multiplier


def threshold_table(config: Any | None = None) -> ThresholdTable:
    """The threshold rules of every slot as arrays (``config`` overrides the seed multipliers as
    in ``sentinel_thresholds``); ``step_bounds(isv, ..., *threshold_table(config), ...)`` gives
    ``sentinel_thresholds(isv, config)``."""
    mult = np.zeros(NUM_SENTINEL_SLOTS, np.float32)
    isv_index = np.full(NUM_SENTINEL_SLOTS, -1, np.int32)
    power = np.ones(NUM_SENTINEL_SLOTS, np.int32)
    for s in SENTINELS:
        if s.threshold is not None:
            mult[s.index] = _multiplier(s.threshold, config)
            isv_index[s.index] = isv_mod.slot(s.threshold.isv_slot).index
            power[s.index] = s.threshold.power
    return ThresholdTable(mult, isv_index, power)


def sentinel_thresholds(isv: np.ndarray, config: Any | None = None) -> np.ndarray:
    """float32 ``[NUM_SENTINEL_SLOTS]``: each threshold slot's threshold, 0 elsewhere.

    ``isv`` is the ISV vector (float32 ``[ISV_LEN]``); ``config`` (a ``DQNConfig`` or anything
    with the rules' ``config_field`` attributes) overrides the seed multipliers. 0 means
    "non-finite check only", the convention of the fused check kernel.
    """
    if not isinstance(isv, np.ndarray) or isv.dtype != np.float32 or isv.shape != (isv_mod.ISV_LEN,):
        raise ValueError(
            f"isv: got {type(isv).__name__} {getattr(isv, 'dtype', '?')} "
            f"{getattr(isv, 'shape', '?')}; need a float32 array of shape ({isv_mod.ISV_LEN},)"
        )
    out = np.zeros(NUM_SENTINEL_SLOTS, np.float32)
    for s in SENTINELS:
        rule = s.threshold
        if rule is None:
            continue
        out[s.index] = rule.value(isv[isv_mod.slot(rule.isv_slot).index], _multiplier(rule, config))
    return out


def _check_flags(flags: np.ndarray) -> np.ndarray:
    if not isinstance(flags, np.ndarray) or flags.dtype != np.int32 or \
            flags.shape != (NUM_SENTINEL_SLOTS,):
        raise ValueError(
            f"flags: got {type(flags).__name__} {getattr(flags, 'dtype', '?')} "
            f"{getattr(flags, 'shape', '?')}; need an int32 array of shape ({NUM_SENTINEL_SLOTS},)"
        )
    bad = np.flatnonzero((flags != 0) & (flags != 1))
    if bad.size:
        raise ValueError(
            f"flags: slot {int(bad[0])} holds {int(flags[bad[0]])}; flags are 0 or 1"
        )
    return np.flatnonzero(flags)


def flagged_names(flags: np.ndarray) -> list[str]:
    """Names of the flagged slots in index order (``"<unassigned:k>"`` for an unassigned k)."""
    return [(_BY_INDEX[i].name if i in _BY_INDEX else f"<unassigned:{i}>")
            for i in map(int, _check_flags(flags))]


def format_flags(flags: np.ndarray) -> str:
    """``"12:h2, 24:d_value_logits"`` for the flagged slots; ``"none"`` if nothing is flagged."""
    idx = [int(i) for i in _check_flags(flags)]
    if not idx:
        return "none"
    return ", ".join(f"{i}:{_BY_INDEX[i].name if i in _BY_INDEX else '<unassigned>'}" for i in idx)


__all__ = [
    "ATOM_SPAN_DIAG_MULT", "KINDS", "NUM_SENTINEL_SLOTS", "POINT_GRAPH", "SENTINELS",
    "STEP_POINTS", "SentinelSlot", "TARGET_Q_DIAG_MULT", "ThresholdRule", "ThresholdTable",
    "flagged_names", "format_flags", "fused_slots", "index", "sentinel_thresholds", "slot_by_index",
    "slot_by_name", "threshold_table", "validate_sentinels",
]
