"""Which buffer ranges each fused sentinel slot checks, and when (pure: no GPU).

``sentinel_pieces(layout)``: per slot name, the contiguous ranges (``Piece``) that hold exactly
the buffers of the reference's ``Trainer._sentinel_buffers`` (online(s) rows only where it
names the online pass). ``sentinel_plan(layout)``: the descriptor entries of ``nan_check_fused``
(entry ``k < n_slots`` is slot ``k``'s first piece, later entries the extra pieces of
multi-range slots) and each slot's threshold rule. ``desc_lengths_split(layout)``: the entries'
lengths split by when they are checked (the batch in graph 1; in graph 2 the Adam moments after
Adam, params and target after Polyak, the rest beside the optimiser chain).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from foxhunt.fast import support_plan
from foxhunt.fast.step_layout import DESC_LENGTH_KEYS, READBACK_INDEX
from foxhunt.fast.wave_layout import wave_sentinel_pieces
from foxhunt.reference import isv as isv_mod
from foxhunt.reference import sentinels

#: Arena buffers that graph 2 writes and the fused sentinel check reads (params and target,
#: Adam moments): their slots are checked inside the optimiser chain, the others beside it.
GRAPH2_WRITTEN = frozenset({"params2", "adam_m", "adam_v"})
#: Of those, the Adam moments: final after Adam, checked beside the rest of the chain (params
#: and target are checked after Polyak).
ADAM_MOMENTS = frozenset({"adam_m", "adam_v"})


@dataclass(frozen=True)
class Piece:
    """One contiguous range checked for sentinel slot ``slot``: ``(buffer, packed key or None,
    offset in units of the buffer's dtype (bytes for ``batch``), float32 count)`` (resolved to
    a pointer once the arena exists)."""

    slot: int
    buffer: str
    key: object
    offset: int
    count: int


@dataclass
class SentinelPlan:
    """Descriptor entries of the fused check: entry ``k < n_slots`` is slot ``k`` itself (its
    first piece, or empty), entries ``n_slots + j`` are extra pieces of multi-range slots
    (``extras[j].slot``); thresholds follow each entry's slot rule."""

    n_slots: int
    first: dict  # slot index -> Piece
    extras: list  # Piece
    rules: dict  # slot index -> (multiplier, isv index, power)

    @property
    def n_pieces(self) -> int:
        return len(self.extras)

    @property
    def n_desc(self) -> int:
        return self.n_slots + len(self.extras)


def sentinel_pieces(lay) -> dict[str, list[Piece]]:
    """The ranges each fused sentinel slot checks, by slot name: exactly the buffers of the
    reference's ``Trainer._sentinel_buffers`` (online(s) rows only where it names the online
    pass)."""
    B, SD, NA, NP, nb = lay.B, lay.SD, lay.NA, lay.NP, lay.nb
    idx = sentinels.index

    def one(name, buffer, offset, count, key=None):
        return [Piece(idx(name), buffer, key, offset, count)]

    def per_branch(name, make):
        return [Piece(idx(name), *make(d, n)) for d, n in enumerate(lay.branches)]

    span_buffer, span_length = support_plan.span_buffer(lay)  # the live support (Mech 2)
    trunk = lay.group_range("trunk")
    value = lay.group_range("value")
    branch = lay.group_range("branch")
    heads = lay.group_range("value", "branch")
    x_off = lay.batch_fields["x"][0]  # "batch" is a byte buffer: offsets in bytes
    rb = READBACK_INDEX  # "readback" entries of the loss scalars
    out = {
        "states": one("states", "batch", x_off, B * SD),
        "next_states": one("next_states", "batch", x_off + B * SD * 4, B * SD),
        "rewards": one("rewards", "batch", lay.batch_fields["r"][0], B),
        "importance_weights": one("importance_weights", "batch", lay.batch_fields["isw"][0], B),
        "online_value_logits": one("online_value_logits", "vo", 0, B * NA),
        "online_adv_logits": per_branch("online_adv_logits",
                                        lambda d, n: ("advo", d, 0, B * n * NA)),
        "online_next_logits": per_branch("online_next_logits",
                                         lambda d, n: ("logits", ("o", d), B * n * NA, B * n * NA)),
        "target_next_logits": per_branch("target_next_logits",
                                         lambda d, n: ("logits", ("t", d), 0, B * n * NA)),
        "h1": one("h1", "h1o", 0, B * lay.H1),
        "current_logp": per_branch("current_logp", lambda d, n: ("logp", ("o", d), 0, B * n * NA)),
        "projected_dist": one("projected_dist", "m", 0, nb * B * NA),
        "td_errors": one("td_errors", "td", 0, B),
        "c51_loss": one("c51_loss", "readback", rb["c51_loss"], 1),
        "cql_loss": one("cql_loss", "readback", rb["cql_loss"], 1),
        "d_value_logits": one("d_value_logits", "dv_c51", 0, B * NA),
        "d_adv_logits": per_branch("d_adv_logits", lambda d, n: ("dadv_c51", d, 0, B * n * NA)),
        "cql_d_value_logits": one("cql_d_value_logits", "dv_cql", 0, B * NA),
        "cql_d_adv_logits": per_branch("cql_d_adv_logits",
                                       lambda d, n: ("dadv_cql", d, 0, B * n * NA)),
        "grad_c51": one("grad_c51", "grad_c51", 0, NP),
        "grad_cql": one("grad_cql", "grad_cql", 0, NP),
        "grad_buf": one("grad_buf", "grad", 0, NP),
        "params": one("params", "params2", 0, NP),
        "target_params": one("target_params", "params2", NP, NP),
        "trunk_adam_m_max": one("trunk_adam_m_max", "adam_m", trunk[0], trunk[1] - trunk[0]),
        "value_adam_m_max": one("value_adam_m_max", "adam_m", value[0], value[1] - value[0]),
        "branch_adam_m_max": one("branch_adam_m_max", "adam_m", branch[0], branch[1] - branch[0]),
        "trunk_adam_v_max": one("trunk_adam_v_max", "adam_v", trunk[0], trunk[1] - trunk[0]),
        "value_adam_v_max": one("value_adam_v_max", "adam_v", value[0], value[1] - value[0]),
        "branch_adam_v_max": one("branch_adam_v_max", "adam_v", branch[0], branch[1] - branch[0]),
        "trunk_weight_max": one("trunk_weight_max", "params2", trunk[0], trunk[1] - trunk[0]),
        "heads_weight_max": one("heads_weight_max", "params2", heads[0], heads[1] - heads[0]),
        "target_q_post_clip": one("target_q_post_clip", "target_q", 0, nb * B),
        "atom_span_max": one("atom_span_max", span_buffer, 0, span_length),
        "h2_max_abs": one("h2_max_abs", "h2o", 0, B * lay.H2),
    }
    out.update(wave_sentinel_pieces(lay, one))
    for name, pieces in out.items():
        slot = sentinels.slot_by_name(name)
        if slot.inline:
            raise AssertionError(f"slot {name!r} is inline; it has no place in the fused check")
        assert all(p.slot == slot.index for p in pieces)
    return out


def sentinel_plan(lay) -> SentinelPlan:
    n_slots = sentinels.NUM_SENTINEL_SLOTS
    first: dict[int, Piece] = {}
    extras: list[Piece] = []
    for pieces in sentinel_pieces(lay).values():
        first[pieces[0].slot] = pieces[0]
        extras.extend(pieces[1:])
    rules = {}
    for s in sentinels.SENTINELS:
        if s.threshold is None:
            continue
        rule = s.threshold
        mult = rule.multiplier
        if rule.config_field is not None:
            mult = getattr(lay.config, rule.config_field)
        rules[s.index] = (np.float32(mult), isv_mod.slot(rule.isv_slot).index, int(rule.power))
    return SentinelPlan(n_slots, first, extras, rules)


def desc_entries(plan: SentinelPlan) -> list[tuple[int, Piece]]:
    """``(descriptor entry, piece)`` of every checked range."""
    return list(plan.first.items()) + [(plan.n_slots + j, p) for j, p in enumerate(plan.extras)]


def desc_lengths_split(plan: SentinelPlan) -> dict[str, list[int]]:
    """The descriptor entries' lengths in four complementary lists (0 where another list has
    the entry), by the arena buffer the entry checks: ``desc_lens_batch`` the batch (checked in
    graph 1, before the next upload overwrites it), ``desc_lens_moments`` the Adam moments
    (checked after Adam), ``desc_lens_post`` params and target (checked after Polyak),
    ``desc_lens_pre`` the rest (checked beside the optimiser chain)."""
    split = {key: [0] * plan.n_desc for key in DESC_LENGTH_KEYS}
    for k, piece in desc_entries(plan):
        key = ("desc_lens_batch" if piece.buffer == "batch" else
               "desc_lens_moments" if piece.buffer in ADAM_MOMENTS else
               "desc_lens_post" if piece.buffer in GRAPH2_WRITTEN else "desc_lens_pre")
        split[key][k] = piece.count
    return split
