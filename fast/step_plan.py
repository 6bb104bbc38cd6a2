"""The fast Trainer's step, planned once: buffer layout in one arena, GEMM plans, launch lists.

Three layers, each usable on its own:

- ``StepLayout(config)`` (pure, no GPU): every buffer of the step (state, gradients, batch
  staging, the activations of the three forward passes, loss and backward scratch, the
  sentinel descriptor arrays, device scalars) as ``{name: (shape, dtype)}`` for
  ``Arena.from_specs``, plus the packed sub-buffers inside some of them (``Packed``), and the
  sentinel plan (which buffer range each fused slot checks; ``sentinel_plan``).
- ``Ops``: a launch list (kernel launches with arguments packed once, planned cuBLASLt GEMMs,
  async copies, parallel sections and named events) that ``enqueue``s onto a stream with a
  ``BranchPool``, eagerly or inside a ``GraphCapture`` (parallel sections become graph
  branches).
- ``StepProgram(device, module, config, arena, layout)``: builds the launch lists of the
  upload graph (``upload_ops(staging_ptrs)``: the batch copy from each pinned staging buffer;
  the trainer runs it on a second stream, off the critical path), graph 1 (``graph1_ops()``:
  prologue, the batch's sentinel check, three forward passes, losses, both backward passes,
  budget pipeline, inline sentinel checks, step scalars) and graph 2 (``graph2_ops()``: Adam
  with the safety clip and Mech 9, batched spectral norm, Polyak, the BF16 mirrors of params
  and target, ISV producers, the fused sentinel checks; the producers and the check of the
  buffers graph 2 does not write run as branches beside the whole optimiser chain, forked at
  the graph's start, the check of the Adam moments beside the chain after Adam), and the greedy
  forward of ``q_values`` (``eval_ops(arena, packed, rows)``, which the trainer captures as one
  graph per row count with the copies in and out of pinned memory).

Kernels are the reference kernels' CUDA twins (``cuda_src/<area>.cu``, launch shapes from
``foxhunt.fast.kernels.<area>.plan_*``) plus the trainer's glue kernels
(``cuda_src/_trainer_glue.cu``: step prologue/scalars, the Mech 10 clamp with its ISV-driven
bound read on the device, gathers, branch sums, the h2 gradient mask, sentinel piece merge).

GEMM precisions follow ``foxhunt.reference.network`` exactly: ``f32`` runs every GEMM in f32;
``bf16`` runs the forward GEMMs on BF16 operands (weights from the BF16 mirror, activations
converted by ``f32_to_bf16`` / the clamp glue) with f32 accumulation, and the backward GEMMs in
TF32 on the f32 activations and f32 master weights. Bias adds and ReLUs of the forward are
cuBLASLt epilogues (RELU_BIAS / RELU_AUX_BIAS / BIAS); the backward fuses the ReLU mask and the
bias gradient (DRELU_BGRAD) and the output layers' bias gradient (BGRADB, our "bgrada"); a
configuration cuBLASLt refuses (DRELU_BGRAD for every backward shape of the seed preset) falls
back to a plain GEMM plus ``relu_mask_bias_grad`` (the mask and the column sums in one launch).

Fusion plan (SPEC 11): online(s) and online(s2) share one pass over the stacked batch [s; s2].
The step is a dependency graph, not a chain (``Ops.parallel`` / ``record`` / ``wait``: side
streams and events from a ``BranchPool``, which stream capture turns into graph edges): the
target and online passes run in parallel, and inside each pass the four heads; the C51 and CQL
chains run in parallel, each split per branch (its loss kernels, dueling backward and head
GEMMs), with the value head after every branch's dueling backward and the trunk after every
head's ``dh2`` part (summed in the reference's order by ``glue_h2_grad_mask``); the heads'
weight gradients overlap the trunk. GEMMs are planned without a workspace where cuBLASLt allows
(``GEMM_WORKSPACE_LIMIT``: no memset or split-K reduction nodes).

Fused launches (each the composition of its reference kernels, paired and conformance-tested
under its own name), chosen to shorten the critical path: per forward pass
``dueling_log_softmax_q_branches`` (dueling combine, log-softmax, expected Q of every branch);
``glue_select_gather_taken`` (every branch's double-DQN choice and the gathers); per branch
``c51_project_grad``; ``dueling_combine_backward_sum_branches`` (with the value gradient summed
over branches); ``relu_mask_bias_grad`` (the DRELU_BGRAD fallback); ``cql_logit_grad_branches``
and ``c51_loss_branches``; ``clip_saxpy_norm_partial`` (the budget tail: both per-loss norms
from their partials, the clips, the SAXPY and the total norm's partials, whose sum
``glue_step_scalars`` finishes); in graph 2 ``polyak_update_mirror``. Not done: the issue's
concatenated head weights and stacked C51/CQL backward GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from foxhunt.reference import isv as isv_mod
from foxhunt.reference import sentinels
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.kernels.distributional import _atom_spacing
from foxhunt.reference.kernels.spectral import SPECTRAL_EPS
from foxhunt.reference.layout import ParamLayout, branch_name
from foxhunt.reference.trainer import ISV_PRODUCER_ALPHA

F32 = np.dtype(np.float32)
U16 = np.dtype(np.uint16)
I32 = np.dtype(np.int32)
I64 = np.dtype(np.int64)
U64 = np.dtype(np.uint64)
U8 = np.dtype(np.uint8)

#: Order of the step scalars in the device ``readback`` block (glue_loss_scalars and
#: glue_step_scalars write them).
READBACK_FIELDS = ("loss", "c51_loss", "cql_loss", "grad_norm", "c51_norm_pre", "c51_norm_post",
                   "cql_norm_pre", "cql_norm_post", "clip_bound", "safety_clip_fired", "mean_q",
                   "mean_target_q")
READBACK_INDEX = {name: i for i, name in enumerate(READBACK_FIELDS)}

#: Elements per block of the two-phase gradient norms (grad_norm_partial's block_size).
NORM_SEGMENT = 4096
#: Threads of the one-block glue kernels (GLUE_THREADS in _trainer_glue.cu).
GLUE_THREADS = 256
#: Grid cap of the flat glue kernels (grid-stride loops cover the rest).
GLUE_MAX_BLOCKS = 1024
#: Arena buffers that graph 2 writes and the fused sentinel check reads (params and target,
#: Adam moments): their slots are checked inside the optimiser chain, the others beside it.
GRAPH2_WRITTEN = frozenset({"params2", "adam_m", "adam_v"})
#: Of those, the Adam moments: final after Adam, checked beside the rest of the chain (params
#: and target are checked after Polyak).
ADAM_MOMENTS = frozenset({"adam_m", "adam_v"})
#: The length arrays of the fused sentinel checks (``StepProgram.desc_lengths_split``).
DESC_LENGTH_KEYS = ("desc_lens_batch", "desc_lens_pre", "desc_lens_moments", "desc_lens_post")
#: Workspace bytes a GEMM plan is first planned with (None: fast.gemm's default only); where
#: cuBLASLt has no algorithm within it, the plan takes the default limit. Measured on the H200
#: (seed preset): the algorithms that use a workspace add memset and split-K reduction nodes
#: to the graph (17 nodes) and make the step slower (bf16 251 us vs 219 us with none).
GEMM_WORKSPACE_LIMIT: int | None = 0
#: Where no algorithm fits GEMM_WORKSPACE_LIMIT: True plans with the default limit (6 DRELU_BGRAD
#: plans of the heads then bring 10 memsets back: bf16 232 us, f32 280 us on the H200); False
#: raises, so those epilogues take the plain GEMM + relu_mask + bias_grad_reduce fallback
#: (measured 219 us / 257 us; the fallback is the same math, checked by the GPU step tests).
GEMM_WORKSPACE_RETRY = False
#: The epilogues GEMM_WORKSPACE_RETRY = False applies to (those with a plain GEMM + kernels
#: fallback); every other plan still retries with the default workspace limit.
FALLBACK_EPILOGUES = ("drelu_bgrad", "bgrada")
#: Alignment (elements) of the sub-buffers that are GEMM operands: 256 bytes of float32.
OPERAND_ALIGN = 64

#: ``Ops.copy`` kinds and the driver call each enqueues.
COPY_FUNCTIONS = {"htod": "cuMemcpyHtoDAsync", "dtod": "cuMemcpyDtoDAsync", "dtoh": "cuMemcpyDtoHAsync"}

NORMS = ("c51", "cql", "total")
LOSSES = ("c51", "cql")


def _blocks(n: int, threads: int) -> int:
    return max(1, -(-int(n) // threads))


def flat_plan(n: int) -> tuple[int, int, int]:
    """Flat grid-stride launch of a glue kernel over ``n`` elements."""
    return min(_blocks(n, GLUE_THREADS), GLUE_MAX_BLOCKS), GLUE_THREADS, 0


def aux_nbytes(rows: int, cols: int) -> int:
    """Bytes of cuBLASLt's ReLU bitmask for a ``[rows, cols]`` output (``GemmSpec.aux_nbytes``)."""
    aux_ld_bits = -(-(-(-cols // 8)) // 16) * 16 * 8
    return aux_ld_bits // 8 * rows


# --------------------------------------------------------------------------------------------
# Layout (pure)
# --------------------------------------------------------------------------------------------


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

    def ptr(self, base: int, key) -> int:
        return base + self.offsets[key] * self.dtype.itemsize


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


class StepLayout:
    """Every buffer of one fast training step for ``config`` (see the module docstring).

    ``specs``: ``{name: (shape, dtype)}`` in allocation order; ``packed``: ``{buffer: Packed}``
    for buffers holding several sub-buffers. Batch staging mirrors the ``batch`` buffer byte for
    byte (``batch_fields``: ``{field: (byte offset, shape, dtype)}``).
    """

    def __init__(self, config: DQNConfig):
        c = config
        self.config = c
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
        self.weights = lay.weight_matrices
        self.specs: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        self.packed: dict[str, Packed] = {}
        self._build()

    # -- helpers
    def _add(self, name: str, shape, dtype) -> None:
        shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
        if name in self.specs:
            raise ValueError(f"buffer {name!r} defined twice")
        self.specs[name] = (shape, np.dtype(dtype))

    def _add_packed(self, packed: Packed) -> Packed:
        self.packed[packed.buffer] = packed
        self._add(packed.buffer, max(packed.total, 1), packed.dtype)
        return packed

    def _pass_buffers(self, tag: str, rows: int, *, aux: bool) -> None:
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
        if aux:
            self._add(f"aux1{tag}", aux_nbytes(rows, self.H1), U8)
            self._add(f"aux2{tag}", aux_nbytes(rows, self.H2), U8)
            for h in self.heads:
                self._add(f"auxh{tag}_{h.key}", aux_nbytes(rows, h.hidden), U8)

    def _build(self) -> None:
        B, SD, NA, nb, NP = self.B, self.SD, self.NA, self.nb, self.NP
        # Batch (mirrored byte for byte by the pinned staging buffers): x = [s; s2] (one
        # stacked online pass), actions transposed to [n_branches, B] (one row per branch).
        self.batch_fields: dict[str, tuple[int, tuple[int, ...], np.dtype]] = {}
        offset = 0
        for name, shape, dtype in (("x", (2 * B, SD), F32), ("a", (nb, B), I32), ("r", (B,), F32),
                                   ("done", (B,), F32), ("isw", (B,), F32)):
            offset = -(-offset // 256) * 256
            self.batch_fields[name] = (offset, shape, dtype)
            offset += int(np.prod(shape)) * dtype.itemsize
        self.batch_nbytes = offset
        # State: params and target adjacent (one BF16 mirror launch for both), the mirrors
        # likewise; Adam; spectral-norm vectors; ISV; flags (slot table plus extra pieces).
        self._add("params2", (2, NP), F32)
        self._add("mirror2", (2, NP), U16)
        self._add("adam_m", NP, F32)
        self._add("adam_v", NP, F32)
        self._add("adam_t", 1, I64)
        sn_u, sn_v = Packed("sn_u", F32), Packed("sn_v", F32)
        for t in self.weights:
            sn_u.add(t.name, t.shape[0])
            sn_v.add(t.name, t.shape[1])
        self._add_packed(sn_u)
        self._add_packed(sn_v)
        self._add("isv", isv_mod.ISV_LEN, F32)
        self.sentinel = sentinel_plan(self)
        n_desc = self.sentinel.n_desc
        self._add("flags", n_desc, I32)
        # Gradients and norms.
        for name in ("grad_c51", "grad_cql", "grad"):
            self._add(name, NP, F32)
        self.n_partials = _blocks(NP, NORM_SEGMENT)
        for norm in NORMS:
            self._add(f"partials_{norm}", self.n_partials, F32)
            self._add(f"sq_{norm}", 1, F32)
        self._add("batch", self.batch_nbytes, U8)
        if self.bf16:
            self._add("xb", (2 * B, SD), U16)
        # Constants.
        self._add("z", NA, F32)
        self._add("gamma", nb, F32)
        self._add("alpha", 1, F32)
        self._add("scale", 1, F32)
        self._add("n_actions", nb, I32)
        self._add("action_offset", nb, I32)
        self._add("thr_mult", n_desc, F32)
        self._add("thr_isv_index", n_desc, I32)
        self._add("thr_power", n_desc, I32)
        self._add("desc_ptrs", n_desc, U64)
        # Lengths of the fused checks' slots (a zero length disables a slot), one array per
        # check (StepProgram.desc_lengths_split): the batch in graph 1; in graph 2 the others
        # beside the optimiser, the Adam moments after Adam, params and target after Polyak.
        for key in DESC_LENGTH_KEYS:
            self._add(key, n_desc, I64)
        self._add("piece_slot", max(1, self.sentinel.n_pieces), I32)
        self._add("spectral_desc", (len(self.weights), 32), U8)
        # Device scalars.
        self._add("thresholds", n_desc, F32)
        self._add("weight_clamp", 1, F32)
        self._add("clip_bound", 1, F32)
        self._add("safety_scale", 1, F32)
        self._add("c51_total", nb, F32)
        self._add("readback", len(READBACK_FIELDS), F32)
        self._add("sigmas", len(self.weights), F32)
        # Forward passes: online over 2B rows (with ReLU bitmasks for the backward), target
        # over B rows.
        self._pass_buffers("o", 2 * B, aux=True)
        self._pass_buffers("t", B, aux=False)
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
        # Backward scratch, one set per loss (the two run in parallel graph branches).
        for loss in LOSSES:
            p = Packed(f"dlogits_{loss}", F32)
            for d, n in enumerate(self.branches):
                p.add(d, B * n * NA)
            self._add_packed(p)
            self._add(f"dv_{loss}", (B, NA), F32)
            dadv = Packed(f"dadv_{loss}", F32)  # branch-packed (one fused dueling backward)
            for d, n in enumerate(self.branches):
                dadv.add(d, B * n * NA)
            self._add_packed(dadv)
            dhid = Packed(f"dhid_{loss}", F32, OPERAND_ALIGN)
            for h in self.heads:
                dhid.add(h.key, B * h.hidden)
            self._add_packed(dhid)
            # Each head's part of dh2 (branches, then value: the order they are summed in).
            parts = Packed(f"dh2p_{loss}", F32, OPERAND_ALIGN)
            for h in self.heads[1:] + self.heads[:1]:
                parts.add(h.key, B * self.H2)
            self._add_packed(parts)
            self._add(f"dh2_{loss}", (B, self.H2), F32)
            self._add(f"dh2m_{loss}", (B, self.H2), F32)
            self._add(f"dh1_{loss}", (B, self.H1), F32)
            # Unmasked input gradients of the ReLU layers (one per parallel branch), used only
            # if cuBLASLt refuses DRELU_BGRAD.
            dpre = Packed(f"dpre_{loss}", F32, OPERAND_ALIGN)
            for h in self.heads:
                dpre.add(h.key, B * h.hidden)
            dpre.add("trunk", B * self.H1)
            self._add_packed(dpre)

    # -- evaluation (q_values) buffers for ``rows`` rows
    def eval_specs(self, rows: int) -> tuple[dict, dict]:
        """``(specs, packed)`` of the greedy forward on ``rows`` states (its own small arena)."""
        sub = StepLayout.__new__(StepLayout)
        sub.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("specs", "packed")})
        sub.specs, sub.packed = {}, {}
        sub._add("x", (rows, self.SD), F32)
        if self.bf16:
            sub._add("xb", (rows, self.SD), U16)
        sub._pass_buffers("e", rows, aux=False)
        for name in ("logits", "logp"):
            p = Packed(name, F32)
            for d, n in enumerate(self.branches):
                p.add(("e", d), rows * n * self.NA)
            sub._add_packed(p)
        q = Packed("q", F32)
        for d, n in enumerate(self.branches):
            q.add(d, rows * n)
        sub._add_packed(q)
        return sub.specs, sub.packed

    # -- parameter ranges
    def tensor_offset(self, name: str) -> int:
        return self.param_layout[name].offset

    def group_range(self, *groups: str) -> tuple[int, int]:
        """Element range ``[lo, hi)`` covering the tensors of ``groups`` (contiguous in the
        layout; the padding inside is always zero, which no sentinel test can flag)."""
        ts = [t for t in self.param_layout.tensors if t.group in groups]
        return min(t.offset for t in ts), max(t.end for t in ts)


# --------------------------------------------------------------------------------------------
# Sentinel plan (pure)
# --------------------------------------------------------------------------------------------


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


def sentinel_pieces(lay: StepLayout) -> dict[str, list[Piece]]:
    """The ranges each fused sentinel slot checks, by slot name: exactly the buffers of the
    reference's ``Trainer._sentinel_buffers`` (online(s) rows only where it names the online
    pass)."""
    B, SD, NA, NP, nb = lay.B, lay.SD, lay.NA, lay.NP, lay.nb
    idx = sentinels.index

    def one(name, buffer, offset, count, key=None):
        return [Piece(idx(name), buffer, key, offset, count)]

    def per_branch(name, make):
        return [Piece(idx(name), *make(d, n)) for d, n in enumerate(lay.branches)]

    trunk = lay.group_range("trunk")
    value = lay.group_range("value")
    branch = lay.group_range("branch")
    heads = lay.group_range("value", "branch")
    x_off = lay.batch_fields["x"][0]  # "batch" is a byte buffer: offsets in bytes
    rb = READBACK_INDEX
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
        "atom_span_max": one("atom_span_max", "z", 0, NA),
        "h2_max_abs": one("h2_max_abs", "h2o", 0, B * lay.H2),
    }
    for name, pieces in out.items():
        slot = sentinels.slot_by_name(name)
        if slot.inline:
            raise AssertionError(f"slot {name!r} is inline; it has no place in the fused check")
        assert all(p.slot == slot.index for p in pieces)
    return out


def sentinel_plan(lay: StepLayout) -> SentinelPlan:
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


# --------------------------------------------------------------------------------------------
# Launch lists
# --------------------------------------------------------------------------------------------


class BranchPool:
    """Side streams and events for the fork/join sections of ``Ops`` (created on demand,
    reused by every enqueue; ``reset()`` before each top-level enqueue).

    A stream is never handed out twice within one enqueue: a reused stream would order its
    new work after its old work, a false dependency between branches that are meant to run
    concurrently. Events are reused freely (a wait binds to the event's latest record)."""

    def __init__(self):
        self.streams: list = []
        self.events: list = []
        self._s = self._e = 0

    def reset(self) -> None:
        self._s = self._e = 0

    def reserve(self, ops: Ops) -> None:
        """Create what enqueueing ``ops`` takes, up front (not during a graph capture)."""
        streams, events = ops.branch_resources()
        self.reset()
        for _ in range(streams):
            self.stream()
        for _ in range(events):
            self.event()
        self.reset()

    def stream(self):
        from foxhunt.fast.device import Stream, _driver, call

        if self._s == len(self.streams):
            drv = _driver()
            self.streams.append(Stream(call(drv.cuStreamCreate,
                                            drv.CUstream_flags.CU_STREAM_NON_BLOCKING.value)))
        self._s += 1
        return self.streams[self._s - 1]

    def event(self):
        from foxhunt.fast.device import _driver, call

        if self._e == len(self.events):
            drv = _driver()
            self.events.append(call(drv.cuEventCreate, drv.CUevent_flags.CU_EVENT_DISABLE_TIMING.value))
        self._e += 1
        return self.events[self._e - 1]

    def close(self) -> None:
        from foxhunt.fast.device import _driver

        for s in self.streams:
            s.close()
        for e in self.events:
            _driver().cuEventDestroy(e)
        self.streams, self.events = [], []


class Ops:
    """A launch list: kernels (arguments packed once), GEMMs, copies, fork/join sections and
    named events.

    ``parallel(*sides, main)``: each ``side`` runs on its own stream, forked from the current
    point; ``main`` continues on the current stream; everything is joined afterwards.
    ``record(name)`` / ``wait(name)``: a cross-branch dependency (the waiting branch's later
    work runs after the recording branch's earlier work; a side must record before a later
    sibling or ``main`` waits: enqueue order is sides first, then main).
    ``enqueue(stream, pool)`` issues everything on ``stream`` (eagerly, or inside a graph
    capture, where the sections become graph branches: the events only add edges).
    """

    def __init__(self, module):
        self.module = module
        self.items: list[tuple] = []

    def kernel(self, name: str, plan, *args) -> None:
        grid, block, shared = plan
        k = self.module.kernel(name)
        if shared > 48 * 1024:
            k.set_max_dynamic_shared(shared)
        self.items.append(("kernel", k, grid, block, int(shared), k.pack(*args)))

    def gemm(self, plan, a: int, b: int, c: int, *, bias: int | None = None,
             aux: int | None = None) -> None:
        self.items.append(("gemm", plan, a, b, c, bias, aux))

    def copy(self, dst: int, src: int, nbytes: int, kind: str) -> None:
        """An async copy of ``nbytes`` bytes; a host side must be pinned memory (a graph node)."""
        if kind not in COPY_FUNCTIONS:
            raise ValueError(f"kind: {kind!r}; expected one of {', '.join(map(repr, COPY_FUNCTIONS))}")
        self.items.append(("copy", kind, int(dst), int(src), int(nbytes)))

    def parallel(self, *branches: Ops) -> None:
        """All but the last of ``branches`` on forked side streams, the last on this stream;
        joined afterwards (class docstring)."""
        if len(branches) < 2:
            raise ValueError(f"parallel: {len(branches)} branches; need at least 2")
        self.items.append(("parallel", branches[:-1], branches[-1]))

    def record(self, name: str) -> None:
        self.items.append(("record", name))

    def wait(self, name: str) -> None:
        self.items.append(("wait", name))

    def extend(self, other: Ops) -> None:
        self.items.extend(other.items)

    def node_count(self) -> int:
        count = 0
        for it in self.items:
            if it[0] == "parallel":
                count += sum(b.node_count() for b in it[1]) + it[2].node_count()
            elif it[0] not in ("record", "wait"):
                count += 1
        return count

    def branch_resources(self) -> tuple[int, int]:
        """``(side streams, events)`` one enqueue takes (``BranchPool.reserve``)."""
        streams = events = 0
        for it in self.items:
            if it[0] == "parallel":
                streams += len(it[1])
                events += 1 + len(it[1])
                for branch in (*it[1], it[2]):
                    s, e = branch.branch_resources()
                    streams, events = streams + s, events + e
            elif it[0] == "record":
                events += 1
        return streams, events

    def enqueue(self, stream, pool: BranchPool | None = None, _events: dict | None = None) -> None:
        from foxhunt.fast.device import _driver, as_stream_handle, call

        drv = _driver()
        if _events is None:
            _events = {}
            if pool is not None:
                pool.reset()
        handle = as_stream_handle(stream)
        for it in self.items:
            kind = it[0]
            if kind == "kernel":
                _, k, grid, block, shared, packed = it
                k.launch(grid, block, packed, stream=stream, shared_mem=shared)
            elif kind == "gemm":
                _, plan, a, b, c, bias, aux = it
                plan.run(a, b, c, bias_ptr=bias, aux_ptr=aux, stream=stream)
            elif kind == "copy":
                _, how, dst, src, nbytes = it
                call(getattr(drv, COPY_FUNCTIONS[how]), dst, src, nbytes, handle)
            elif kind == "parallel":
                _, sides, main = it
                if pool is None:
                    raise ValueError("Ops.enqueue: a parallel section needs a BranchPool")
                fork = pool.event()
                call(drv.cuEventRecord, fork, handle)
                joins = []
                for side in sides:
                    side_stream = pool.stream()
                    call(drv.cuStreamWaitEvent, side_stream.handle, fork, 0)
                    side.enqueue(side_stream, pool, _events)
                    join = pool.event()
                    call(drv.cuEventRecord, join, side_stream.handle)
                    joins.append(join)
                main.enqueue(stream, pool, _events)
                for join in joins:
                    call(drv.cuStreamWaitEvent, handle, join, 0)
            elif kind == "record":
                if it[1] in _events:
                    raise ValueError(f"event {it[1]!r} recorded twice")
                if pool is None:
                    raise ValueError("Ops.enqueue: events need a BranchPool")
                _events[it[1]] = ev = pool.event()
                call(drv.cuEventRecord, ev, handle)
            elif kind == "wait":
                if it[1] not in _events:
                    raise ValueError(f"wait on event {it[1]!r} before it is recorded")
                call(drv.cuStreamWaitEvent, handle, _events[it[1]], 0)
            else:  # pragma: no cover - internal
                raise AssertionError(kind)


def common_alignment(*ptrs: int) -> int:
    """Largest power of two in [4, 256] dividing every pointer (cuBLASLt's min_alignment)."""
    align = 256
    while align > 4 and any(p % align for p in ptrs):
        align //= 2
    bad = [hex(p) for p in ptrs if p % align]
    if bad:
        raise ValueError(f"GEMM operands {bad} are not 4-byte aligned; cuBLASLt plans need 4 "
                         "(bf16 precision with an odd batch_size * state_dim row offset?)")
    return align


class StepProgram:
    """GEMM plans and launch lists of the fast step (module docstring). Owns its GEMM plans."""

    def __init__(self, device, module, config: DQNConfig, arena, layout: StepLayout):
        from foxhunt.fast.kernels import dense, distributional, fused, isv, optim, safety, spectral

        self.k = {"dense": dense, "dist": distributional, "isv": isv, "optim": optim,
                  "safety": safety, "spectral": spectral, "fused": fused}
        self.device = device
        self.module = module
        self.config = config
        self.arena = arena
        self.lay = layout
        self.plans: list = []
        self.fwd_mode = "bf16" if layout.bf16 else "f32"
        self.bwd_mode = "tf32" if layout.bf16 else "f32"
        self.fallbacks: list[str] = []  # GEMM epilogues cuBLASLt refused (plain GEMM + kernels)
        self.pool = BranchPool()  # side streams and events of the parallel sections
        self._eval = None  # (arena, packed) of the evaluation forward being built

    # -- pointers
    def _where(self, name: str):
        """The (arena, packed table) holding buffer ``name``: the evaluation arena while
        ``eval_ops`` builds, else the step arena."""
        if self._eval is not None and name in self._eval[0]:
            return self._eval
        return self.arena, self.lay.packed

    def packed(self, name: str) -> Packed:
        return self._where(name)[1][name]

    def ptr(self, name: str, key=None, offset: int = 0) -> int:
        """Device address of buffer ``name`` (sub-buffer ``key`` of a packed one), plus
        ``offset`` elements."""
        arena, packed = self._where(name)
        if key is not None:
            offset += packed[name].offsets[key]
        return arena.ptr(name) + offset * arena.spec(name).dtype.itemsize

    def batch_ptr(self, name: str) -> int:
        """Device address of batch field ``name`` (``x``, ``a``, ``r``, ``done``, ``isw``)."""
        return self.ptr("batch", offset=self.lay.batch_fields[name][0])

    def weight(self, name: str, which: int, *, bf16: bool) -> int:
        """Pointer to tensor ``name`` of params (which=0) or target (which=1), f32 or BF16."""
        off = which * self.lay.NP + self.lay.tensor_offset(name)
        return self.ptr("mirror2" if bf16 else "params2", offset=off)

    def grad_ptr(self, grad: str, name: str) -> int:
        return self.ptr(grad, offset=self.lay.tensor_offset(name))

    # -- GEMMs
    def _plan(self, m, n, k, *, ptrs, **kw):
        from foxhunt.fast.gemm import GemmPlan

        from foxhunt.fast.gemm import GemmPlanError

        align = common_alignment(*ptrs)
        plan = None
        if GEMM_WORKSPACE_LIMIT is not None:
            try:
                plan = GemmPlan(self.device, m, n, k, min_alignment=align,
                                workspace_limit=GEMM_WORKSPACE_LIMIT, **kw)
            except GemmPlanError:
                if not GEMM_WORKSPACE_RETRY and kw.get("epilogue") in FALLBACK_EPILOGUES:
                    raise  # the epilogue plan then takes the plain GEMM + kernels fallback
                plan = None  # no algorithm within the limit: take the default's
        if plan is None:
            plan = GemmPlan(self.device, m, n, k, min_alignment=align, **kw)
        self.plans.append(plan)
        return plan

    def linear(self, ops: Ops, *, rows, n, k, x, w, c, bias, epilogue, aux=None) -> None:
        """``c = epilogue(x [rows, k] @ W[n, k]^T + bias)`` in the forward precision."""
        plan = self._plan(rows, n, k, ptrs=(x, w, c), trans_b=True, precision=self.fwd_mode,
                          epilogue=epilogue)
        ops.gemm(plan, x, w, c, bias=bias, aux=aux)

    def weight_grad(self, ops: Ops, *, dy, x, rows, n_out, n_in, dw, db=None) -> None:
        """``dW [n_out, n_in] = dy[rows, n_out]^T @ x[rows, n_in]`` and, when ``db`` is given,
        ``db = colsum(dy)`` through the bias-gradient epilogue (``"bgrada"`` in fast.gemm's
        row-major naming; a plain GEMM plus ``bias_grad_reduce`` if cuBLASLt refuses it), in
        the backward precision."""
        from foxhunt.fast.gemm import GemmPlanError

        if db is not None:
            try:
                plan = self._plan(n_out, n_in, rows, ptrs=(dy, x, dw), trans_a=True,
                                  precision=self.bwd_mode, epilogue="bgrada")
                ops.gemm(plan, dy, x, dw, bias=db)
                return
            except (GemmPlanError, ValueError) as exc:
                self.fallbacks.append(f"bgrada {n_out}x{n_in}x{rows}: {exc}")
            self.bias_grad(ops, dy, db, rows, n_out)
        plan = self._plan(n_out, n_in, rows, ptrs=(dy, x, dw), trans_a=True, precision=self.bwd_mode)
        ops.gemm(plan, dy, x, dw)

    def bias_grad(self, ops: Ops, dy: int, db: int, rows: int, cols: int) -> None:
        ops.kernel("bias_grad_reduce", self.k["dense"].plan_bias_grad_reduce(rows, cols),
                   dy, db, rows, cols)

    def input_grad(self, ops: Ops, *, dy, w, dx, rows, n_out, n_in, beta=0.0, relu=None) -> None:
        """``dx [rows, n_in] (+)= dy [rows, n_out] @ W [n_out, n_in]``; with ``relu=(aux, h,
        db, scratch)`` the result is masked by the forward ReLU (``h <= 0 ? 0 : dx``) and ``db =
        colsum(masked dx)`` (DRELU_BGRAD; or, if cuBLASLt refuses it, a plain GEMM into
        ``scratch``, then ``relu_mask_bias_grad``: relu_mask and bias_grad_reduce in one launch)."""
        from foxhunt.fast.gemm import GemmPlanError

        if relu is not None:
            aux, h, db, scratch = relu
            try:
                plan = self._plan(rows, n_in, n_out, ptrs=(dy, w, dx), precision=self.bwd_mode,
                                  epilogue="drelu_bgrad")
                ops.gemm(plan, dy, w, dx, bias=db, aux=aux)
                return
            except (GemmPlanError, ValueError) as exc:
                self.fallbacks.append(f"drelu_bgrad {rows}x{n_in}x{n_out}: {exc}")
            plan = self._plan(rows, n_in, n_out, ptrs=(dy, w, scratch), precision=self.bwd_mode)
            ops.gemm(plan, dy, w, scratch)
            ops.kernel("relu_mask_bias_grad",
                       self.k["dense"].plan_relu_mask_bias_grad(rows, n_in), scratch, h, dx, db,
                       rows, n_in)
            return
        plan = self._plan(rows, n_in, n_out, ptrs=(dy, w, dx), precision=self.bwd_mode, beta=beta)
        ops.gemm(plan, dy, w, dx)

    # -- kernels used in several places
    def to_bf16(self, ops: Ops, src: int, dst: int, n: int) -> None:
        ops.kernel("f32_to_bf16", self.k["dense"].plan_f32_to_bf16(n), src, dst, n)

    # -- forward
    def forward(self, ops: Ops, *, tag: str, rows: int, which: int, x: int, xb: int | None,
                aux: bool, logits_key, extra: Ops | None = None, q_ptr: int = 0) -> None:
        """One forward pass of ``rows`` rows with params (``which=0``) or target (1): trunk,
        Mech 10 clamp (bound from ISV[H_S2_RMS_EMA] on the device), heads, dueling combine
        into the packed ``logits`` buffer at ``logits_key(d)`` with the log-softmax (``logp``,
        same key) and, when ``q_ptr`` is given, expected Q (one launch over every branch). The
        heads' GEMMs run as parallel branches (first layers, then second layers); ``extra``
        runs alongside the first layers."""
        lay, c = self.lay, self.config
        bf16 = lay.bf16
        p32 = lambda name: self.weight(name, which, bf16=False)  # noqa: E731 - biases
        wfwd = lambda name: self.weight(name, which, bf16=bf16)  # noqa: E731 - GEMM weights
        relu_ep = "relu_aux_bias" if aux else "relu_bias"
        h1, h2pre, h2 = self.ptr(f"h1{tag}"), self.ptr(f"h2pre{tag}"), self.ptr(f"h2{tag}")
        x_in = xb if bf16 else x
        self.linear(ops, rows=rows, n=lay.H1, k=lay.SD, x=x_in, w=wfwd("w_s1"), c=h1,
                    bias=p32("b_s1"), epilogue=relu_ep,
                    aux=self.ptr(f"aux1{tag}") if aux else None)
        h1_in = h1
        if bf16:
            h1_in = self.ptr(f"h1{tag}_bf16")
            self.to_bf16(ops, h1, h1_in, rows * lay.H1)
        self.linear(ops, rows=rows, n=lay.H2, k=lay.H1, x=h1_in, w=wfwd("w_s2"), c=h2pre,
                    bias=p32("b_s2"), epilogue=relu_ep,
                    aux=self.ptr(f"aux2{tag}") if aux else None)
        h2b = self.ptr(f"h2{tag}_bf16") if bf16 else 0
        n2 = rows * lay.H2
        ops.kernel("glue_clamp_isv", flat_plan(n2), h2pre, h2, h2b, n2, self.ptr("isv"),
                   isv_mod.H_S2_RMS_EMA_INDEX, np.float32(c.h2_clamp_mult))
        h2_in = h2b if bf16 else h2
        hid = self.packed(f"hid{tag}")
        firsts = [] if extra is None else [extra]
        for h in lay.heads:
            branch = Ops(self.module)
            self.linear(branch, rows=rows, n=h.hidden, k=lay.H2, x=h2_in, w=wfwd(h.w1),
                        c=self.ptr(f"hid{tag}", h.key), bias=p32(h.b1), epilogue=relu_ep,
                        aux=self.ptr(f"auxh{tag}_{h.key}") if aux else None)
            firsts.append(branch)
        ops.parallel(*firsts)
        hid_in = {h.key: self.ptr(f"hid{tag}", h.key) for h in lay.heads}
        if bf16:
            self.to_bf16(ops, self.ptr(f"hid{tag}"), self.ptr(f"hid{tag}_bf16"), hid.total)
            hid_in = {h.key: self.ptr(f"hid{tag}_bf16", offset=hid.offsets[h.key])
                      for h in lay.heads}
        v = self.ptr(f"v{tag}")
        seconds = []
        for d, h in enumerate(lay.heads):
            branch = Ops(self.module)
            out = v if d == 0 else self.ptr(f"adv{tag}", d - 1)
            self.linear(branch, rows=rows, n=h.out, k=h.hidden, x=hid_in[h.key], w=wfwd(h.w2),
                        c=out, bias=p32(h.b2), epilogue="bias")
            seconds.append(branch)
        ops.parallel(*seconds)
        # Every branch's dueling combine, log-softmax and expected Q in one launch
        # (branch-packed adv, logits, logp; Q of branch d at rows * off_d of q).
        ops.kernel("dueling_log_softmax_q_branches",
                   self.k["fused"].plan_dueling_log_softmax_q_branches(rows, lay.branches, lay.NA),
                   v, self.ptr(f"adv{tag}"), self.ptr("z"), self.ptr("n_actions"),
                   self.ptr("action_offset"), self.ptr("logits", logits_key(0)),
                   self.ptr("logp", logits_key(0)), q_ptr, rows, lay.NA, 1 if q_ptr else 0)

    # -- backward of one loss
    def backward(self, ops: Ops, loss: str, pre: Ops) -> None:
        """network.backward for the logit gradients in ``dlogits_<loss>``, into ``grad_<loss>``
        (every tensor written, padding untouched); online(s) activations are rows 0..B.

        ``pre`` produces ``dlogits_<loss>`` of every branch; one fused dueling backward
        (``dueling_combine_backward_branches``) follows. Then parallel branches: one per
        advantage head (its GEMMs), the value head, and the trunk (after every head's ``dh2``
        part; the parts are summed in the reference's order: branches, then value).
        Each head computes its ``dh2`` part before its weight gradients, so those overlap the
        trunk."""
        lay = self.lay
        B, NA, H1, H2 = lay.B, lay.NA, lay.H1, lay.H2
        g = f"grad_{loss}"
        P = lambda name: self.weight(name, 0, bf16=False)  # noqa: E731 - f32 master weights
        h2 = self.ptr("h2o")
        parts = self.packed(f"dh2p_{loss}")

        def head(branch: Ops, hi: int, dy: int) -> None:
            h = lay.heads[hi]
            hid = self.ptr("hido", h.key)
            dhid = self.ptr(f"dhid_{loss}", h.key)
            self.input_grad(branch, dy=dy, w=P(h.w2), dx=dhid, rows=B, n_out=h.out, n_in=h.hidden,
                            relu=(self.ptr(f"auxho_{h.key}"), hid, self.grad_ptr(g, h.b1),
                                  self.ptr(f"dpre_{loss}", h.key)))
            self.input_grad(branch, dy=dhid, w=P(h.w1), dx=self.ptr(f"dh2p_{loss}", h.key),
                            rows=B, n_out=h.hidden, n_in=H2)
            branch.record(f"dh2p_{loss}_{h.key}")
            self.weight_grad(branch, dy=dy, x=hid, rows=B, n_out=h.out, n_in=h.hidden,
                             dw=self.grad_ptr(g, h.w2), db=self.grad_ptr(g, h.b2))
            self.weight_grad(branch, dy=dhid, x=h2, rows=B, n_out=h.hidden, n_in=H2,
                             dw=self.grad_ptr(g, h.w1))

        ops.extend(pre)
        # Every branch's dueling backward in one launch, with the value gradient summed over
        # the branches (the reference's order), so the value head starts at once.
        ops.kernel("dueling_combine_backward_sum_branches",
                   self.k["fused"].plan_dueling_combine_backward_sum_branches(B, lay.branches, NA),
                   self.ptr(f"dlogits_{loss}"), self.ptr("n_actions"), self.ptr("action_offset"),
                   self.ptr(f"dv_{loss}"), self.ptr(f"dadv_{loss}"), B, NA, lay.nb)
        chains = []
        for d, n in enumerate(lay.branches):
            branch = Ops(self.module)
            head(branch, d + 1, self.ptr(f"dadv_{loss}", d))
            chains.append(branch)
        value = Ops(self.module)
        head(value, 0, self.ptr(f"dv_{loss}"))
        chains.append(value)
        trunk = Ops(self.module)
        for h in lay.heads:
            trunk.wait(f"dh2p_{loss}_{h.key}")
        dh2 = self.ptr(f"dh2_{loss}")
        dh2m = self.ptr(f"dh2m_{loss}")
        order = [h.key for h in lay.heads[1:]] + [lay.heads[0].key]
        stride = _blocks(B * H2, OPERAND_ALIGN) * OPERAND_ALIGN
        assert [parts.offsets[k] for k in order] == [i * stride for i in range(len(order))]
        trunk.kernel("glue_h2_grad_mask", flat_plan(B * H2), self.ptr(f"dh2p_{loss}"),
                     len(order), stride, h2, self.ptr("h2preo"), dh2, dh2m, B * H2)
        # Slot 33 (C51 pass): the trunk-gradient buffer right after the main backward; nothing
        # writes dh2 afterwards, so the check is a branch beside the trunk's GEMMs.
        check = Ops(self.module)
        if loss == "c51":
            check.kernel("nan_check", self.k["safety"].plan_nan_check(B * H2), dh2, B * H2,
                         self.ptr("flags", offset=sentinels.index("d_h2_post_main")))
        dw2 = Ops(self.module)
        self.weight_grad(dw2, dy=dh2m, x=self.ptr("h1o"), rows=B, n_out=H2, n_in=H1,
                         dw=self.grad_ptr(g, "w_s2"), db=self.grad_ptr(g, "b_s2"))
        rest = Ops(self.module)
        dh1 = self.ptr(f"dh1_{loss}")
        self.input_grad(rest, dy=dh2m, w=P("w_s2"), dx=dh1, rows=B, n_out=H2, n_in=H1,
                        relu=(self.ptr("aux1o"), self.ptr("h1o"), self.grad_ptr(g, "b_s1"),
                              self.ptr(f"dpre_{loss}", "trunk")))
        self.weight_grad(rest, dy=dh1, x=self.batch_ptr("x"), rows=B, n_out=H1, n_in=lay.SD,
                         dw=self.grad_ptr(g, "w_s1"))
        trunk.parallel(*([check] if loss == "c51" else []), dw2, rest)
        chains.append(trunk)
        ops.parallel(*chains)

    def norm(self, ops: Ops, src: str, which: str) -> None:
        """Phase 1 of ``grad_norm_sq(src)``: ``partials_<which>`` (fixed trees, no atomics);
        ``clip_saxpy_norm_partial`` sums them (phase 2) for the budget clip."""
        opt = self.k["optim"]
        n = self.lay.NP
        ops.kernel("grad_norm_partial", opt.plan_grad_norm_partial(n, NORM_SEGMENT),
                   self.ptr(src), n, NORM_SEGMENT, self.ptr(f"partials_{which}"))

    # -- graph 1
    def upload_ops(self, staging_ptrs) -> list[Ops]:
        """The upload graph, once per pinned staging buffer: the batch copy from that buffer into
        the arena's ``batch``. The trainer replays it on its upload stream, after the previous
        step's graph 1 (the last reader of ``batch``) and before this step's graph 1, so the copy
        overlaps the previous step's graph 2 instead of heading this step's critical path.

        The bf16 states' BF16 copy stays graph 1's first node: measured on the H200 (seed
        preset, the step as ``Trainer.step`` enqueues it), 154.5 us per step with it there
        against 162.0 us with it in the upload graph (which then takes 16 us on its stream
        instead of 8 us)."""
        out = []
        for staging in staging_ptrs:
            ops = Ops(self.module)
            ops.copy(self.ptr("batch"), staging, self.lay.batch_nbytes, "htod")
            out.append(ops)
        return out

    def graph1_ops(self) -> Ops:
        """Graph 1, after the upload graph (module docstring). Branch structure:

        - the step prologue, then the fused check of the sentinel slots of the batch (they are
          checked here, not in graph 2, because the next step's upload overwrites the batch
          once this graph is done), alongside everything up to the step scalars;
        - the target pass alongside the online pass (heads parallel inside each);
        - after log-softmax and expected Q: the CQL chain (per branch: CQL logit gradient, then
          its heads' backward; value head; trunk; norm), the C51 chain (per branch: double-DQN
          choice, gather, projection, C51 gradient, then the heads' backward; value head; trunk;
          norm; copy and budget clip into ``grad``) and the C51 bookkeeping (scalar targets,
          Mech 1, per-branch C51 losses, td errors) run in parallel;
        - then the CQL budget SAXPY, the total norm and the step scalars.
        """
        lay, c = self.lay, self.config
        B, NA, nb = lay.B, lay.NA, lay.nb
        dist, safety, opt = self.k["dist"], self.k["safety"], self.k["optim"]
        NP = lay.NP
        sp = lay.sentinel
        prologue = Ops(self.module)
        prologue.kernel("glue_step_prologue", (1, GLUE_THREADS, 0), self.ptr("isv"),
                        self.ptr("adam_t"), self.ptr("weight_clamp"), self.ptr("clip_bound"),
                        self.ptr("thr_mult"), self.ptr("thr_isv_index"), self.ptr("thr_power"),
                        self.ptr("thresholds"), sp.n_desc, isv_mod.Q_ABS_REF_INDEX,
                        isv_mod.GRAD_NORM_SLOW_EMA_INDEX, np.float32(c.weight_clamp_mult),
                        np.float32(c.max_grad_norm), np.float32(c.grad_clip_anchor_mult))
        self.fused_check(prologue, "desc_lens_batch")
        ops = Ops(self.module)
        x = self.batch_ptr("x")
        x2 = x + B * lay.SD * 4
        xb = xb2 = None
        if lay.bf16:
            xb = self.ptr("xb")
            xb2 = xb + B * lay.SD * 2
            self.to_bf16(ops, x, xb, 2 * B * lay.SD)
        online, target = Ops(self.module), Ops(self.module)
        # Slot 12: online(s)'s h2 before the Mech 10 clamp (the clamp writes another buffer).
        check_h2 = Ops(self.module)
        check_h2.kernel("nan_check", safety.plan_nan_check(B * lay.H2), self.ptr("h2preo"),
                        B * lay.H2, self.ptr("flags", offset=sentinels.index("h2")))
        self.forward(online, tag="o", rows=2 * B, which=0, x=x, xb=xb, aux=True,
                     logits_key=lambda d: ("o", d), extra=check_h2, q_ptr=self.ptr("q_o"))
        self.forward(target, tag="t", rows=B, which=1, x=x2, xb=xb2, aux=False,
                     logits_key=lambda d: ("t", d))
        ops.parallel(target, online)
        a_ptr, r_ptr = self.batch_ptr("a"), self.batch_ptr("r")
        done_ptr, isw_ptr = self.batch_ptr("done"), self.batch_ptr("isw")
        lo, hi = np.float32(c.v_min), np.float32(c.v_max)
        dz = _atom_spacing(lo, hi, NA)

        # C51 logit gradients: one launch for every branch's double-DQN choice and gathers,
        # then per branch (parallel) the projection with the C51 gradient.
        c51_pre = Ops(self.module)
        c51_pre.kernel("glue_select_gather_taken", flat_plan(nb * B * NA),
                       self.ptr("logp", ("t", 0)), self.ptr("a_star"), self.ptr("q_o"), a_ptr,
                       self.ptr("n_actions"), self.ptr("action_offset"), self.ptr("p_next"),
                       self.ptr("q_taken"), nb, B, NA, 2 * B)
        c51_pre.record("gathered")
        projections = []
        for d, n in enumerate(lay.branches):
            proj = Ops(self.module)
            m = self.ptr("m", offset=d * B * NA)
            proj.kernel("c51_project_grad", dist.plan_c51_project_grad(B, n, NA),
                        self.ptr("p_next", offset=d * B * NA), r_ptr, done_ptr,
                        self.ptr("gamma", offset=d), self.ptr("z"), self.ptr("logp", ("o", d)),
                        a_ptr + d * B * 4, isw_ptr, self.ptr("scale"), m,
                        self.ptr("dlogits_c51", d), B, n, NA, lo, hi, dz)
            proj.record(f"m{d}")
            projections.append(proj)
        c51_pre.parallel(*projections)
        # CQL logit gradients of every branch in one launch (first B samples of each block).
        cql_pre = Ops(self.module)
        cql_pre.kernel("cql_logit_grad_branches",
                       self.k["fused"].plan_cql_logit_grad_branches(B, lay.branches, NA),
                       self.ptr("logp", ("o", 0)), a_ptr, self.ptr("z"), self.ptr("alpha"),
                       self.ptr("scale"), self.ptr("n_actions"), self.ptr("action_offset"),
                       self.ptr("dlogits_cql"), self.ptr("terms"), B, 2 * B, NA)
        cql_pre.record("cql_terms")
        cql_side = Ops(self.module)
        self.backward(cql_side, "cql", cql_pre)
        self.norm(cql_side, "grad_cql", "cql")
        c51_side = Ops(self.module)
        self.backward(c51_side, "c51", c51_pre)
        self.norm(c51_side, "grad_c51", "c51")
        # C51 bookkeeping, beside the backward passes, in two parallel chains: the scalar
        # targets and Mech 1 (they need the gathered p_next only), and the C51 losses and td
        # errors (after every branch's projection).
        targets, losses = Ops(self.module), Ops(self.module)
        targets.wait("gathered")
        targets.kernel("glue_scalar_targets", flat_plan(nb * B), self.ptr("p_next"),
                       self.ptr("z"), r_ptr, done_ptr, self.ptr("gamma"), self.ptr("target_q"),
                       nb, B, NA)
        targets.kernel("target_q_clip", safety.plan_target_q_clip(nb * B), self.ptr("target_q"),
                       self.ptr("target_q"), nb * B, np.float32(c.target_q_clip_mult),
                       self.ptr("isv", offset=isv_mod.Q_ABS_REF_INDEX))
        for d in range(nb):
            losses.wait(f"m{d}")
        losses.kernel("c51_loss_branches",
                      self.k["fused"].plan_c51_loss_branches(B, lay.branches, NA),
                      self.ptr("logp", ("o", 0)), a_ptr, self.ptr("m"), isw_ptr,
                      self.ptr("scale"), self.ptr("n_actions"), self.ptr("action_offset"),
                      self.ptr("ce"), self.ptr("c51_total"), B, 2 * B, NA)
        losses.kernel("glue_branch_sum", flat_plan(B), self.ptr("ce"), self.ptr("td"), B, nb,
                      B, np.float32(nb))
        books = Ops(self.module)
        books.parallel(targets, losses)
        # The loss scalars and means of the readback (the block reductions of the step
        # scalars), beside the backward passes: they need the C51 totals, Q's and the CQL terms.
        books.wait("cql_terms")
        books.kernel("glue_loss_scalars", (1, GLUE_THREADS, 0), self.ptr("c51_total"),
                     self.ptr("terms"), self.ptr("q_taken"), self.ptr("target_q"),
                     self.ptr("readback"), nb, B, np.float32(c.cql_alpha))
        ops.parallel(cql_side, c51_side, books)
        # Budget pipeline, one launch: the per-loss norms from their partials, grad =
        # clip(grad_c51, 0.70 mgn) + clipped(grad_cql, 0.15 mgn), and the total norm's phase-1
        # partials (phase 2 is in the step scalars).
        ops.kernel("clip_saxpy_norm_partial", opt.plan_clip_saxpy_norm_partial(NP, NORM_SEGMENT),
                   self.ptr("grad_c51"), self.ptr("grad_cql"), NP, np.float32(c.budget("c51")),
                   self.ptr("partials_c51"), np.float32(1.0), np.float32(c.budget("cql")),
                   self.ptr("partials_cql"), lay.n_partials,
                   opt.final_threads_clip_saxpy_norm_partial(lay.n_partials), NORM_SEGMENT,
                   self.ptr("grad"), self.ptr("partials_total"), self.ptr("sq_c51"),
                   self.ptr("sq_cql"))
        body = Ops(self.module)
        body.parallel(prologue, ops)
        # The total norm's phase 2 inside the step scalars (grad_norm_final's block size, so
        # its summation tree and bits).
        body.kernel("glue_step_scalars", opt.plan_grad_norm_final(lay.n_partials),
                    self.ptr("partials_total"), lay.n_partials, self.ptr("sq_total"),
                    self.ptr("sq_c51"), self.ptr("sq_cql"), self.ptr("clip_bound"),
                    self.ptr("isv"), self.ptr("safety_scale"), self.ptr("readback"),
                    np.float32(c.budget("c51")), np.float32(c.budget("cql")),
                    isv_mod.GRAD_NORM_SLOW_EMA_INDEX, np.float32(c.grad_slow_ema_alpha))
        return body

    # -- graph 2
    def graph2_ops(self) -> Ops:
        lay, c = self.lay, self.config
        NP = lay.NP
        opt, spec, isvk, safety = self.k["optim"], self.k["spectral"], self.k["isv"], self.k["safety"]
        body, ops = Ops(self.module), Ops(self.module)
        params, target = self.ptr("params2"), self.ptr("params2", offset=NP)
        # The optimiser chain on the capture stream: Adam, spectral norm, Polyak with the BF16
        # mirrors, then the post-Adam check. The side branches below fork at the start of
        # the graph (root nodes beside Adam): none of them reads what the chain writes.
        ops.kernel("adam_update", opt.plan_adam_update(NP), params, self.ptr("grad"),
                   self.ptr("adam_m"), self.ptr("adam_v"), NP, self.ptr("adam_t"),
                   np.float32(c.lr), np.float32(c.beta1), np.float32(c.beta2),
                   np.float32(c.adam_eps), np.float32(c.weight_decay), self.ptr("safety_scale"),
                   self.ptr("weight_clamp"))
        # After Adam, in parallel: the check of the Adam moments (final once Adam is done), and
        # the chain spectral norm, Polyak with the BF16 mirrors of params and target
        # ([params; target] in mirror2, one launch), the check of params and target.
        moments, chain = Ops(self.module), Ops(self.module)
        self.fused_check(moments, "desc_lens_moments")
        n_w = len(lay.weights)
        chain.kernel("batched_spectral_norm",
                     spec.plan_batched_spectral_norm(n_w, self.device.arch),
                     self.ptr("spectral_desc"), n_w, np.float32(c.sigma_max), SPECTRAL_EPS,
                     self.ptr("sigmas"))
        chain.kernel("polyak_update_mirror", opt.plan_polyak_update_mirror(NP), target, params,
                     NP, np.float32(c.tau), self.ptr("mirror2"), self.ptr("mirror2", offset=NP))
        self.fused_check(chain, "desc_lens_post")
        if moments.items:
            ops.parallel(moments, chain)
        else:
            ops.extend(chain)
        # Side branches beside the whole optimiser chain, from the start of the graph: the ISV
        # producers (they read graph 1's q_taken and h2 and write their own ISV slots, which
        # nothing in graph 2 reads: the bounds of this step were formed in graph 1) and the
        # fused check of the slots whose buffers graph 2 does not write. The slots of the Adam
        # moments are checked after Adam, those of params/target after Polyak and the mirrors;
        # the sticky flags are merged after the join.
        sp = lay.sentinel
        producers = Ops(self.module)
        nq = lay.nb * lay.B
        producers.kernel("isv_q_abs_ref_update", isvk.plan_isv_q_abs_ref_update(nq),
                         self.ptr("isv"), isv_mod.Q_ABS_REF_INDEX, self.ptr("q_taken"), nq,
                         np.float32(ISV_PRODUCER_ALPHA))
        nh = lay.B * lay.H2
        producers.kernel("isv_h2_rms_update", isvk.plan_isv_h2_rms_update(nh), self.ptr("isv"),
                         isv_mod.H_S2_RMS_EMA_INDEX, self.ptr("h2o"), nh,
                         np.float32(ISV_PRODUCER_ALPHA))
        checks_pre = Ops(self.module)
        self.fused_check(checks_pre, "desc_lens_pre")
        # The extra pieces' flags are ORed into their slots' flags once every piece has been
        # checked: right after the "pre" check when all pieces are there (the seed preset's
        # are: packed per-branch buffers that graph 2 does not write), else after the join.
        merge = Ops(self.module)
        if sp.n_pieces:
            merge.kernel("glue_merge_flags", (1, GLUE_THREADS, 0), self.ptr("flags"),
                         self.ptr("piece_slot"), sp.n_slots, sp.n_pieces)
        if all(piece.buffer not in GRAPH2_WRITTEN for piece in sp.extras):
            checks_pre.extend(merge)
            body.parallel(producers, checks_pre, ops)
        else:
            body.parallel(producers, checks_pre, ops)
            body.extend(merge)
        return body

    # -- constants the graphs read
    def desc_lengths(self) -> list[int]:
        sp = self.lay.sentinel
        lens = [0] * sp.n_desc
        for slot, piece in sp.first.items():
            lens[slot] = piece.count
        for j, piece in enumerate(sp.extras):
            lens[sp.n_slots + j] = piece.count
        return lens

    def desc_lengths_split(self) -> dict[str, list[int]]:
        """``desc_lengths()`` split in four complementary lists (0 where another list has the
        slot), by the arena buffer a slot checks: ``desc_lens_batch`` the batch (checked in
        graph 1, before the next upload overwrites it), ``desc_lens_moments`` the Adam moments
        (checked after Adam), ``desc_lens_post`` params and target (checked after Polyak),
        ``desc_lens_pre`` the rest (checked beside the optimiser chain)."""
        sp = self.lay.sentinel
        pieces = dict(sp.first)
        pieces.update({sp.n_slots + j: piece for j, piece in enumerate(sp.extras)})
        lens = self.desc_lengths()
        split = {key: [0] * sp.n_desc for key in DESC_LENGTH_KEYS}
        for k, piece in pieces.items():
            key = ("desc_lens_batch" if piece.buffer == "batch" else
                   "desc_lens_moments" if piece.buffer in ADAM_MOMENTS else
                   "desc_lens_post" if piece.buffer in GRAPH2_WRITTEN else "desc_lens_pre")
            split[key][k] = lens[k]
        return split

    def fused_check(self, ops: Ops, lens_key: str) -> None:
        """``nan_check_fused`` over the slots of ``desc_lengths_split()[lens_key]`` (no launch
        when that list is empty)."""
        lens = self.desc_lengths_split()[lens_key]
        if not any(lens):
            return
        ops.kernel("nan_check_fused", self.k["safety"].plan_nan_check_fused(lens),
                   self.ptr("desc_ptrs"), self.ptr(lens_key), self.ptr("thresholds"),
                   self.ptr("flags"), self.lay.sentinel.n_desc)

    def constants(self) -> dict[str, np.ndarray]:
        """Host values of the constant buffers (uploaded once, before capture)."""
        from foxhunt.fast.kernels.spectral import spectral_descriptors
        from foxhunt.reference.step import support

        lay, c = self.lay, self.config
        sp = lay.sentinel
        ptrs = np.zeros(sp.n_desc, np.uint64)
        lens = {key: np.array(x, np.int64) for key, x in self.desc_lengths_split().items()}
        mult = np.zeros(sp.n_desc, np.float32)
        index = np.full(sp.n_desc, -1, np.int32)
        power = np.ones(sp.n_desc, np.int32)

        def resolve(piece: Piece) -> int:
            return self.ptr(piece.buffer, piece.key, piece.offset)

        entries = [(slot, piece) for slot, piece in sp.first.items()]
        entries += [(sp.n_slots + j, piece) for j, piece in enumerate(sp.extras)]
        for k, piece in entries:
            ptrs[k] = resolve(piece)
            if piece.slot in sp.rules:
                mult[k], index[k], power[k] = sp.rules[piece.slot]
        mats = []
        for t in lay.weights:
            mats.append((self.weight(t.name, 0, bf16=False), self.ptr("sn_u", t.name),
                         self.ptr("sn_v", t.name), t.shape[0], t.shape[1]))
        return {
            "z": support(c),
            "gamma": np.array(c.gammas, np.float32),
            "alpha": np.array([c.cql_alpha], np.float32),
            "scale": np.array([1.0 / (lay.B * lay.nb)], np.float32),
            "n_actions": np.array(lay.branches, np.int32),
            "action_offset": np.array(lay.action_offset, np.int32),
            "thr_mult": mult, "thr_isv_index": index, "thr_power": power,
            "desc_ptrs": ptrs, **lens,
            "piece_slot": np.array([p.slot for p in sp.extras] or [0], np.int32),
            "spectral_desc": spectral_descriptors(mats).view(np.uint8).reshape(len(mats), 32),
        }

    # -- evaluation forward (captured per row count by Trainer.q_values)
    def eval_ops(self, arena, packed: dict, rows: int, *, x_host: int | None = None,
                 q_host: int | None = None) -> Ops:
        """Greedy forward on ``rows`` states in ``arena`` (buffers of ``StepLayout.eval_specs``):
        online params, Mech 10 clamp (the trainer's ISV), log-softmax, expected Q into ``q``
        (packed per branch). With ``x_host`` / ``q_host`` (pinned host addresses), the states are
        first copied in from ``x_host`` and ``q`` is copied out to ``q_host`` at the end, so the
        whole evaluation is one captured graph (``Trainer.q_values``)."""
        self._eval = (arena, packed)
        try:
            lay = self.lay
            ops = Ops(self.module)
            x = self.ptr("x")
            if x_host is not None:
                ops.copy(x, x_host, rows * lay.SD * 4, "htod")
            xb = None
            if lay.bf16:
                xb = self.ptr("xb")
                self.to_bf16(ops, x, xb, rows * lay.SD)
            self.forward(ops, tag="e", rows=rows, which=0, x=x, xb=xb, aux=False,
                         logits_key=lambda d: ("e", d), q_ptr=self.ptr("q"))
            if q_host is not None:
                ops.copy(q_host, self.ptr("q"), arena.spec("q").nbytes, "dtoh")
            return ops
        finally:
            self._eval = None
