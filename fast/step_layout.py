"""The fast step's buffers: every buffer of one training step in one arena, by name (pure: no GPU).

``StepLayout(config)``: ``specs`` (``{name: (shape, dtype)}`` for ``Arena.from_specs``, in
allocation order), ``packed`` (sub-buffers packed into one buffer: ``Packed``), the batch
fields (``batch_fields``: byte mirrors of the pinned staging buffers; records name them
``batch.x``, ``batch.a``, ...), each buffer's role (``role(name)``: ``state`` persists across
steps, ``batch`` is written only by the upload, ``constant`` is uploaded once, ``scratch`` is
rewritten every step) and the sentinel plan (``foxhunt.fast.sentinel_plan``).
``EvalLayout(layout, rows)``: the buffers of the greedy forward on ``rows`` states (their own
small arena; names end in ``e`` / ``_e`` so they never shadow a step buffer).

``region(buf)`` resolves a record's ``Buf`` (name, packed key, element offset) to its buffer,
dtype, first element, the elements up to the end of the buffer (of the batch field, for
``batch.*``) and role: what ``foxhunt.fast.binder.Binder`` checks records against and what
both executors resolve to addresses.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from foxhunt.fast.records import F32, I32, I64, U8, U16, U64, Buf, Region
from foxhunt.reference import isv as isv_mod
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.backend import READBACK_FIELDS
from foxhunt.reference.kernels.step import READBACK_INDEX
from foxhunt.reference.kernels.trunk import HEADS_FIELDS, heads_dh2_order
from foxhunt.reference.layout import ParamLayout, branch_name

#: Elements per block of the two-phase gradient norms (grad_norm_partial's block_size).
NORM_SEGMENT = 4096
#: Alignment (elements) of the sub-buffers that are GEMM operands: 256 bytes of float32.
OPERAND_ALIGN = 64
#: The length arrays of the fused sentinel checks (``sentinel_plan.desc_lengths_split``).
DESC_LENGTH_KEYS = ("desc_lens_batch", "desc_lens_pre", "desc_lens_moments", "desc_lens_post")
#: Alignment (bytes) of the batch fields in the staging buffers and the arena's ``batch``.
BATCH_FIELD_ALIGN = 256

NORMS = ("c51", "cql", "total")
LOSSES = ("c51", "cql")


def stacked_name(stem: str) -> str:
    """The buffer holding the losses' blocks ``<stem>_c51``, ``<stem>_cql`` (``LOSSES`` order)."""
    return f"{stem}_losses"


def blocks(n: int, threads: int) -> int:
    return max(1, -(-int(n) // threads))


def elements(shape) -> int:
    """The element count of an array of ``shape`` (an int or a sequence of ints; ``()`` is one):
    ``np.prod``'s value without its call overhead (``region`` runs for every record argument
    the CPU executor binds)."""
    if isinstance(shape, (int, np.integer)):
        return int(shape)
    return math.prod(int(d) for d in shape)


@dataclass
class Packed:
    """Sub-buffers packed into one arena buffer ``buffer`` of ``dtype``: ``offsets[key]`` in
    elements (each start rounded up to ``align`` elements), ``counts[key]``; ``total``."""

    buffer: str
    dtype: np.dtype
    align: int = 1
    offsets: dict = field(default_factory=dict)
    counts: dict = field(default_factory=dict)
    total: int = 0

    def add(self, key, count: int) -> int:
        start = -(-self.total // self.align) * self.align
        self.offsets[key] = start
        self.counts[key] = int(count)
        self.total = start + int(count)
        return start


@dataclass(frozen=True)
class Head:
    """One head of the network: ``key`` (``"value"`` or a branch name), hidden width, the
    tensors of its two layers, and its output width (NA, or n_d * NA)."""

    key: str
    hidden: int
    w1: str
    b1: str
    w2: str
    b2: str
    out: int


class BufferTable:
    """Named buffers (``specs``), packed sub-buffers (``packed``), typed views into a byte
    buffer (``views``: ``{name: (buffer, byte offset, shape, dtype)}``) and roles."""

    def __init__(self):
        self.specs: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        self.packed: dict[str, Packed] = {}
        self.views: dict[str, tuple[str, int, tuple[int, ...], np.dtype]] = {}
        self.roles: dict[str, str] = {}

    @staticmethod
    def _shape(shape) -> tuple[int, ...]:
        return (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)

    def _add(self, name: str, shape, dtype, role: str = "scratch") -> None:
        shape = self._shape(shape)
        if name in self.specs:
            raise ValueError(f"buffer {name!r} defined twice")
        self.specs[name] = (shape, np.dtype(dtype))
        self.roles[name] = role

    def _add_packed(self, packed: Packed) -> Packed:
        self.packed[packed.buffer] = packed
        self._add(packed.buffer, max(packed.total, 1), packed.dtype)
        return packed

    def _add_stacked(self, base: str, names, block, dtype, role: str = "scratch") -> None:
        """One buffer ``base`` of ``len(names)`` equal blocks, block ``i`` the view ``names[i]``
        at ``i`` block strides (the block rounded up to ``ALIGNMENT`` bytes, so every block is as
        aligned as the buffer): ``block`` is a block's ``Packed`` layout (each view gets it under
        its own name) or its shape. What the stacked backward's GEMMs read and write as one
        batched GEMM (``StepProgram``: two blocks of one buffer, one stride apart, per operand)."""
        from foxhunt.fast.device import ALIGNMENT, _round_up

        dtype = np.dtype(dtype)
        shape = (max(block.total, 1),) if isinstance(block, Packed) else self._shape(block)
        stride = _round_up(elements(shape) * dtype.itemsize, ALIGNMENT)
        self._add(base, len(names) * stride // dtype.itemsize, dtype, role)
        for i, name in enumerate(names):
            if name in self.specs or name in self.views:
                raise ValueError(f"buffer {name!r} defined twice")
            self.views[name] = (base, i * stride, shape, dtype)
            if isinstance(block, Packed):
                self.packed[name] = dataclasses.replace(block, buffer=name)

    def locate(self, name: str) -> tuple[str, int, tuple[int, ...], np.dtype]:
        """``(arena buffer, byte offset, shape, dtype)`` of buffer or view ``name``."""
        if name in self.views:
            return self.views[name]
        shape, dtype = self.specs[name]
        return name, 0, shape, dtype

    def __contains__(self, name: str) -> bool:
        return name in self.specs or name in self.views

    def role(self, name: str) -> str:
        return self.roles[self.views[name][0] if name in self.views else name]

    def region(self, buf: Buf) -> Region:
        """Where ``buf`` points (module docstring); ``KeyError`` names an unknown buffer or key."""
        name = buf.name
        if name in self.views:
            base, byte_offset, shape, dtype = self.views[name]
            start = buf.offset
            if buf.key is not None:
                packed = self.packed.get(name)
                if packed is None or buf.key not in packed.offsets:
                    raise KeyError(f"{buf}: view {name!r} has no packed key {buf.key!r}")
                start += packed.offsets[buf.key]
            count = elements(shape)
            return Region(base, dtype, byte_offset // dtype.itemsize + start,
                          count - start, self.roles[base])
        if name not in self.specs:
            raise KeyError(f"no buffer {name!r} in the step layout")
        shape, dtype = self.specs[name]
        start = buf.offset
        if buf.key is not None:
            packed = self.packed.get(name)
            if packed is None or buf.key not in packed.offsets:
                raise KeyError(f"{buf}: buffer {name!r} has no packed key {buf.key!r}")
            start += packed.offsets[buf.key]
        return Region(name, dtype, start, elements(shape) - start, self.roles[name])

    def zero_padding(self) -> dict[str, list[tuple[int, int]]]:
        """The alignment gaps between packed sub-buffers (bytes; never written: zero)."""
        out = {}
        for name, packed in self.packed.items():
            base, at = self.locate(name)[:2]
            spans = sorted((packed.offsets[k], packed.offsets[k] + packed.counts[k]) for k in packed.offsets)
            size = packed.dtype.itemsize
            gaps = [(at + hi * size, at + lo * size) for (_, hi), (lo, _) in zip(spans, spans[1:])
                    if lo > hi]
            if gaps:
                out[base] = out.get(base, []) + gaps
        return out

    def _pass_buffers(self, tag: str, rows: int) -> None:
        """Activations of one forward pass of ``rows`` rows (tag ``o`` online, ``t`` target,
        ``e`` evaluation)."""
        self._add(f"h1{tag}", (rows, self.H1), F32)
        self._add(f"h2pre{tag}", (rows, self.H2), F32)
        self._add(f"h2{tag}", (rows, self.H2), F32)
        hid = Packed(f"hid{tag}", F32, OPERAND_ALIGN)
        for h in self.heads:
            hid.add(h.key, rows * h.hidden)
        self._add_packed(hid)
        self._add(f"v{tag}", (rows, self.NA), F32)
        # Advantage logits of every branch, branch-packed (one fused dueling launch).
        adv = Packed(f"adv{tag}", F32)
        for d, n in enumerate(self.branches):
            adv.add(d, rows * n * self.NA)
        self._add_packed(adv)
        if self.bf16:
            self._add(f"h1{tag}_bf16", (rows, self.H1), U16)
            self._add(f"h2{tag}_bf16", (rows, self.H2), U16)
            self._add(f"hid{tag}_bf16", (max(hid.total, 1),), U16)


class StepLayout(BufferTable):
    """Every buffer of one fast training step for ``config`` (module docstring). ``n_step_on``:
    the step trains on n-step transitions (issue 22): the batch has the ``discount`` field and
    the target kernels read it (``gamma_ref = config.gammas[0]``)."""

    def __init__(self, config: DQNConfig, *, n_step_on: bool = False):
        from foxhunt.fast.sentinel_plan import sentinel_plan
        from foxhunt.fast.isv_plan import add_isv_buffers
        from foxhunt.fast.wave_layout import add_wave_buffers

        super().__init__()
        c = config
        self.config = c
        self.n_step_on = bool(n_step_on)
        self.param_layout = lay = ParamLayout(c)
        self.B, self.SD, self.H1, self.H2 = c.batch_size, c.state_dim, c.shared_h1, c.shared_h2
        self.NA, self.nb, self.branches = c.num_atoms, c.n_branches, tuple(c.branches)
        self.NP = lay.num_elements
        self.A_total = sum(self.branches)
        self.action_offset = tuple(int(sum(self.branches[:d])) for d in range(self.nb))
        self.bf16 = c.precision == "bf16"
        self.heads = (Head("value", c.value_h, "w_v1", "b_v1", "w_v2", "b_v2", c.num_atoms),) + tuple(
            Head(branch_name(d), c.adv_h, f"w_{branch_name(d)}1", f"b_{branch_name(d)}1",
                 f"w_{branch_name(d)}2", f"b_{branch_name(d)}2", n * c.num_atoms)
            for d, n in enumerate(self.branches))
        #: Each head's hidden and output widths, in ``heads`` order (the fused heads kernel's).
        self.head_hidden = tuple(h.hidden for h in self.heads)
        self.head_out = tuple(h.out for h in self.heads)
        self.weights = lay.weight_matrices
        self.n_partials = blocks(self.NP, NORM_SEGMENT)
        self._build_batch()
        self._build_state()
        self.sentinel = sentinel_plan(self)
        self._build_step()
        add_wave_buffers(self)
        add_isv_buffers(self)

    def _build_batch(self) -> None:
        B, SD, nb = self.B, self.SD, self.nb
        self.batch_fields: dict[str, tuple[int, tuple[int, ...], np.dtype]] = {}
        offset = 0
        # x = [s; s2] (one stacked online pass), actions transposed to [n_branches, B] (one row
        # per branch).
        fields = [("x", (2 * B, SD), F32), ("a", (nb, B), I32), ("r", (B,), F32),
                  ("done", (B,), F32), ("isw", (B,), F32)]
        # The auxiliary heads' labels, only for a head that is on (the core batch is unchanged).
        if self.config.aux_next_bar_on:
            fields.append(("next_ret", (B,), F32))
        if self.config.aux_regime_on:
            fields.append(("regime", (B,), I32))
        if self.n_step_on:  # the n-step transitions' effective discount (issue 22)
            fields.append(("discount", (B,), F32))
        for name, shape, dtype in fields:
            offset = -(-offset // BATCH_FIELD_ALIGN) * BATCH_FIELD_ALIGN
            self.batch_fields[name] = (offset, shape, dtype)
            self.views[f"batch.{name}"] = ("batch", offset, shape, dtype)
            offset += elements(shape) * dtype.itemsize
        self.batch_nbytes = offset

    def n_step_args(self) -> dict:
        """The n-step arguments every target kernel's record binds (issue 22): ``discount``
        (``batch.discount``, or a null pointer the kernel does not read when the step is
        1-step), ``gamma_ref`` (``config.gammas[0]``, the configured gamma of branch 0) and the
        flag ``n_step_on``."""
        return dict(discount="batch.discount" if self.n_step_on else None,
                    gamma_ref=np.float32(self.config.gammas[0]), n_step_on=int(self.n_step_on))

    def _build_state(self) -> None:
        # Params and target adjacent (one BF16 mirror launch for both), the mirrors likewise;
        # Adam; spectral-norm vectors; ISV.
        NP = self.NP
        self._add("params2", (2, NP), F32, "state")
        self._add("mirror2", (2, NP), U16, "state")
        self._add("adam_m", NP, F32, "state")
        self._add("adam_v", NP, F32, "state")
        self._add("adam_t", 1, I64, "state")
        sn_u, sn_v = Packed("sn_u", F32), Packed("sn_v", F32)
        for t in self.weights:
            sn_u.add(t.name, t.shape[0])
            sn_v.add(t.name, t.shape[1])
        self._add_packed(sn_u)
        self._add_packed(sn_v)
        self.roles["sn_u"] = self.roles["sn_v"] = "state"
        self._add("isv", isv_mod.ISV_LEN, F32, "state")

    def _build_step(self) -> None:
        B, SD, NA, nb, NP = self.B, self.SD, self.NA, self.nb, self.NP
        n_desc = self.sentinel.n_desc
        self._add("flags", n_desc, I32, "state")
        # Gradients and norms.
        # The losses' gradients are two blocks of one buffer (the stacked backward's GEMMs
        # write both in one launch).
        self._add_stacked(stacked_name("grad"), tuple(f"grad_{loss}" for loss in LOSSES), NP, F32)
        self._add("grad", NP, F32)
        for norm in NORMS:
            self._add(f"partials_{norm}", self.n_partials, F32)
            self._add(f"sq_{norm}", 1, F32)
        self._add("batch", self.batch_nbytes, U8, "batch")
        if self.bf16:
            self._add("xb", (2 * B, SD), U16)
        # Constants.
        # With the gamma schedule on, graph 1 writes gamma from the ISV (fast.isv_plan).
        self._add("gamma", nb, F32, "scratch" if self.config.gamma_schedule else "constant")
        for name, shape, dtype in (("z", NA, F32), ("alpha", 1, F32),
                                   ("scale", 1, F32), ("n_actions", nb, I32),
                                   ("action_offset", nb, I32), ("thr_mult", n_desc, F32),
                                   ("thr_isv_index", n_desc, I32), ("thr_power", n_desc, I32),
                                   ("desc_ptrs", n_desc, U64),
                                   ("head_table", (len(self.heads), HEADS_FIELDS), I32)):
            self._add(name, shape, dtype, "constant")
        # Lengths of the fused checks' slots (a zero length disables a slot), one array per
        # check: the batch in graph 1; in graph 2 the others beside the optimiser, the Adam
        # moments after Adam, params and target after Polyak.
        for key in DESC_LENGTH_KEYS:
            self._add(key, n_desc, I64, "constant")
        self._add("piece_slot", max(1, self.sentinel.n_pieces), I32, "constant")
        self._add("spectral_desc", (len(self.weights), 32), U8, "constant")
        # Device scalars.
        self._add("thresholds", n_desc, F32)
        self._add("weight_clamp", 1, F32)
        self._add("clip_bound", 1, F32)
        self._add("safety_scale", 1, F32)
        self._add("c51_total", nb, F32)
        self._add("readback", len(READBACK_FIELDS), F32)
        self._add("sigmas", len(self.weights), F32)
        # Forward passes: online over 2B rows (s and s'), target over B rows.
        self._pass_buffers("o", 2 * B)
        self._pass_buffers("t", B)
        # Logits and log-probabilities of every branch of both passes, packed (one
        # log_softmax launch), then expected Q of the online pass, packed (one launch).
        for name in ("logits", "logp"):
            p = Packed(name, F32)
            for d, n in enumerate(self.branches):
                p.add(("o", d), 2 * B * n * NA)
            for d, n in enumerate(self.branches):
                p.add(("t", d), B * n * NA)
            self._add_packed(p)
        q = Packed("q_o", F32)
        for d, n in enumerate(self.branches):
            q.add(d, 2 * B * n)
        self._add_packed(q)
        # Losses.
        self._add("a_star", (nb, B), I32)
        self._add("p_next", (nb, B, NA), F32)
        self._add("m", (nb, B, NA), F32)
        self._add("ce", (nb, B), F32)
        self._add("terms", (nb, B), F32)
        self._add("td", B, F32)
        self._add("q_taken", (nb, B), F32)
        self._add("target_q", (nb, B), F32)
        # Backward scratch, one set per loss (the two run in parallel graph branches); what
        # the stacked backward's GEMMs read or write is one buffer of two blocks per name
        # (``stacked_name``), the losses' blocks of it views ``<name>_<loss>``.
        for loss in LOSSES:
            p = Packed(f"dlogits_{loss}", F32)
            for d, n in enumerate(self.branches):
                p.add(d, B * n * NA)
            self._add_packed(p)
            self._add(f"dh2_{loss}", (B, self.H2), F32)

        def packed(stem: str, keys_counts, align: int = 1) -> Packed:
            p = Packed(stem, F32, align)
            for key, count in keys_counts:
                p.add(key, count)
            return p

        dhid = [(h.key, B * h.hidden) for h in self.heads]
        stacked_blocks = {
            "dv": (B, NA),
            # branch-packed (one fused dueling backward)
            "dadv": packed("dadv", [(d, B * n * NA) for d, n in enumerate(self.branches)]),
            "dhid": packed("dhid", dhid, OPERAND_ALIGN),
            # each head's part of dh2 (branches, then value: the order they are summed in)
            "dh2p": packed("dh2p", [(self.heads[h].key, B * self.H2)
                                    for h in heads_dh2_order(len(self.heads))], OPERAND_ALIGN),
            "dh2m": (B, self.H2),
            "dh1": (B, self.H1),
            # unmasked input gradients of the ReLU layers (then relu_mask_bias_grad)
            "dpre": packed("dpre", dhid + [("trunk", B * self.H1)], OPERAND_ALIGN),
        }
        for stem, block in stacked_blocks.items():
            self._add_stacked(stacked_name(stem), tuple(f"{stem}_{loss}" for loss in LOSSES),
                              block, F32)

    def batch_views(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        """Typed views of the batch fields inside a byte buffer that mirrors ``batch``."""
        views = {}
        for name, (offset, shape, dtype) in self.batch_fields.items():
            nbytes = elements(shape) * dtype.itemsize
            views[name] = buf[offset:offset + nbytes].view(dtype).reshape(shape)
        return views

    def zero_padding(self) -> dict[str, list[tuple[int, int]]]:
        """Byte ranges that no record writes, zero since the arena was made (``dataflow.
        check_dataflow``'s ``preset``): the alignment gaps between packed sub-buffers, and in
        the per-loss gradient buffers the padding between the parameter tensors."""
        from foxhunt.fast.wave_layout import wave_zero_padding

        out = BufferTable.zero_padding(self)
        pl = self.param_layout
        core = [t for t in pl.tensors if t.is_core]
        # grad_c51 also holds the auxiliary heads' gradients (the C51 budget); neither holds
        # the IQN head's or the ensemble priors'.
        for name, written in (("grad_c51", core + list(pl.group_tensors("aux"))), ("grad_cql", core)):
            base, at = self.locate(name)[:2]
            spans, end = [], 0
            for t in sorted(written, key=lambda t: t.offset):
                if t.offset > end:
                    spans.append((at + end * 4, at + t.offset * 4))
                end = max(end, t.end)
            if self.NP > end:
                spans.append((at + end * 4, at + self.NP * 4))
            out[base] = out.get(base, []) + spans
        out.update(wave_zero_padding(self))
        return out

    # -- parameter ranges
    def tensor_offset(self, name: str) -> int:
        return self.param_layout[name].offset

    def group_range(self, *groups: str) -> tuple[int, int]:
        """Element range ``[lo, hi)`` covering the tensors of ``groups`` (contiguous in the
        layout; the padding inside is always zero, which no sentinel test can flag)."""
        ts = [t for t in self.param_layout.tensors if t.group in groups]
        return min(t.offset for t in ts), max(t.end for t in ts)


class EvalLayout(BufferTable):
    """The greedy forward's buffers for ``rows`` states (``Trainer.q_values``): the input
    ``x_e`` (role ``batch``: written only by the copy in), its BF16 copy, one forward pass
    (tag ``e``), ``logits_e`` / ``logp_e`` and ``q_e`` (packed per branch)."""

    def __init__(self, layout: StepLayout, rows: int):
        from foxhunt.fast.support_plan import add_eval_support_buffers

        super().__init__()
        for name in ("H1", "H2", "NA", "SD", "branches", "heads", "bf16"):
            setattr(self, name, getattr(layout, name))
        self.rows = rows = int(rows)
        self._add("x_e", (rows, self.SD), F32, "batch")
        if self.bf16:
            self._add("xb_e", (rows, self.SD), U16)
        self._pass_buffers("e", rows)
        add_eval_support_buffers(self, layout.config)  # adaptive_atoms: its own live support
        for name in ("logits_e", "logp_e"):
            p = Packed(name, F32)
            for d, n in enumerate(self.branches):
                p.add(d, rows * n * self.NA)
            self._add_packed(p)
        q = Packed("q_e", F32)
        for d, n in enumerate(self.branches):
            q.add(d, rows * n)
        self._add_packed(q)
        clash = sorted(set(self.specs) & set(layout.specs))
        if clash:
            raise AssertionError(f"evaluation buffers {clash} shadow step buffers")

    def split_q(self, q: np.ndarray) -> list[np.ndarray]:
        """The packed ``q_e`` values as one ``[rows, n_d]`` array per branch (copies)."""
        offsets = self.packed["q_e"].offsets
        return [q[offsets[d]:offsets[d] + self.rows * n].reshape(self.rows, n).copy()
                for d, n in enumerate(self.branches)]


__all__ = ["BufferTable", "DESC_LENGTH_KEYS", "EvalLayout", "Head",
           "NORM_SEGMENT", "OPERAND_ALIGN", "Packed", "READBACK_FIELDS", "READBACK_INDEX",
           "StepLayout", "blocks", "stacked_name"]
