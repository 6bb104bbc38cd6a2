"""Reference twins of the fused MLP forwards (``cuda_src/trunk.cu``). ``trunk_forward_bf16``, the
composition of the reference functions of the four nodes it replaces in the BF16 step's forward
(``fast/step_program.py``: ``StepProgram.forward``):

1. the GEMM ``xb @ W1^T`` (``dense.gemm`` in mode ``"bf16"``, what the cuBLASLt plan computes)
   with the RELU_AUX_BIAS epilogue (``dense.add_bias_relu`` plus the bitmask, ``relu_aux_bits``);
2. ``dense.f32_to_bf16(h1)``;
3. the GEMM ``h1_bf16 @ W2^T`` with the same epilogue;
4. ``step.clamp_finite_isv`` (Mech 10, with its BF16 mirror).

No arithmetic of its own: ``relu_aux_bits`` packs the comparison the epilogue already makes
(``not pre <= 0``) into cuBLASLt's bitmask layout, as ``fast.cpu_executor.CpuGemm`` does.

Shapes (the kernel's rule, checked by :func:`check_trunk_dims`): ``rows >= 1``; ``SD``, ``H1`` and
``H2`` positive multiples of :data:`TRUNK_WIDTH_MULTIPLE` (the MMA tile's k and two n8 tiles).

``heads_forward_bf16``, the composition of the nodes the heads' fused forward replaces (the same
step, after the trunk): every head's first-layer GEMM on ``h2_bf16`` with the RELU_BIAS epilogue,
``dense.f32_to_bf16`` of the hidden values, every head's second-layer GEMM with the BIAS epilogue
(``dense.gemm`` mode ``"bf16"``, then one f32 bias add). The heads are given side by side
(:func:`heads_forward_bf16`); :func:`heads_packed_offsets` is the step's packed layout of the
outputs (``fast/step_layout.py``), which the fast test entry and the CPU executor's twin use.

``heads_out_dueling_bf16``, the composition of the nodes that end a BF16 training pass's heads
(``StepProgram.forward`` with ``FUSE_HEAD_OUTPUTS``): ``dense.f32_to_bf16`` of the hidden
values, every head's second-layer GEMM with the BIAS epilogue and
``fused.dueling_log_softmax_q_branches`` (:func:`heads_out_dueling_bf16`); ``heads_out_dueling_f32``,
its twin in the f32 step (every head's f32 second-layer GEMM with the BIAS epilogue and the
dueling log-softmax: :func:`heads_out_dueling_f32`).

``heads_dh2_tf32``, the composition of the nodes that take a TF32 backward pass from the heads'
hidden gradients into the trunk (``StepProgram.backward`` with ``FUSE_HEADS_DH2``): every head's
input gradient ``dhid_h @ W1_h`` (``dense.gemm`` mode ``"tf32"``, what the cuBLASLt TF32 plan
computes) and ``step.h2_grad_sum_mask`` of those parts in the reference's order (the branch heads,
then the value head): :func:`heads_dh2_tf32`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from foxhunt.reference.kernels import dense, step
from foxhunt.reference.kernels.argcheck import (
    check_f32_array,
    check_int,
    f32_scalar,
    require_array,
    require_shape,
)

F32, U8, U16 = np.dtype(np.float32), np.dtype(np.uint8), np.dtype(np.uint16)

#: SD, H1 and H2 must be multiples of this (mma.m16n8k16's k; an n16 pair of n8 tiles).
TRUNK_WIDTH_MULTIPLE = 16
#: cuBLASLt pads each row of a ReLU bitmask to 128 bits (``fast.gemm.AUX_ROW_ALIGN_BYTES``).
AUX_ROW_ALIGN_BYTES = 16


def aux_row_bytes(cols: int) -> int:
    """Bytes of one row of a ReLU bitmask over ``cols`` columns: ``ceil(cols / 8)`` rounded up to
    a multiple of :data:`AUX_ROW_ALIGN_BYTES` (``fast.gemm.GemmSpec.aux_ld // 8``)."""
    data_bytes = -(-cols // 8)
    return -(-data_bytes // AUX_ROW_ALIGN_BYTES) * AUX_ROW_ALIGN_BYTES


def relu_aux_bits(h: np.ndarray) -> np.ndarray:
    """The RELU_AUX_BIAS bitmask of a ReLU output ``h [M, N]`` (float32): ``uint8 [M,
    aux_row_bytes(N)]``, bit ``j % 8`` of byte ``j // 8`` of row ``i`` set where ``not h[i, j] <=
    0`` (a NaN sets it; ``h`` is ``t <= 0 ? 0 : t``, so this is the same test on the
    pre-activation ``t``); the padding bytes are 0."""
    rows, cols = h.shape
    out = np.zeros((rows, aux_row_bytes(cols)), U8)
    bits = np.packbits(~(h <= 0), axis=1, bitorder="little")
    out[:, :bits.shape[1]] = bits
    return out


def check_trunk_dims(rows, sd, h1, h2) -> tuple[int, int, int, int]:
    """The fused kernel's shape rule, one ``ValueError`` naming the field, the value and the rule;
    returns the four sizes as ints."""
    rows = check_int("rows", rows, minimum=1)
    sizes = []
    for name, value in (("SD", sd), ("H1", h1), ("H2", h2)):
        ok = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
        if not ok or value < 1 or value % TRUNK_WIDTH_MULTIPLE:
            raise ValueError(f"{name}={value!r}: the fused trunk kernel needs a positive multiple "
                             f"of {TRUNK_WIDTH_MULTIPLE}")
        sizes.append(int(value))
    return (rows, *sizes)


class TrunkForward(NamedTuple):
    """Outputs of ``trunk_forward_bf16``: every buffer the four nodes write. ``aux1`` / ``aux2``
    are empty (``uint8 [0]``) without ``with_aux``."""

    h1: np.ndarray       # float32 [rows, H1]
    aux1: np.ndarray     # uint8 [rows, aux_row_bytes(H1)]
    h1_bf16: np.ndarray  # uint16 [rows, H1]
    h2pre: np.ndarray    # float32 [rows, H2]
    aux2: np.ndarray     # uint8 [rows, aux_row_bytes(H2)]
    h2: np.ndarray       # float32 [rows, H2]
    h2_bf16: np.ndarray  # uint16 [rows, H2]


def validate_trunk_forward_bf16(xb, w1, b1, w2, b2, isv, index, mult, with_aux=True):
    """The argument checks of ``trunk_forward_bf16``; returns ``(rows, SD, H1, H2, index,
    mult)`` as the kernel receives them."""
    require_array("xb", xb, U16, ndim=2)
    require_array("w1", w1, U16, ndim=2)
    require_array("w2", w2, U16, ndim=2)
    rows, sd = xb.shape
    h1 = w1.shape[0]
    require_shape("w1", w1, (h1, sd), "[H1, SD] with SD = xb.shape[1]")
    require_array("b1", b1, F32, ndim=1)
    require_shape("b1", b1, (h1,), "[H1] with H1 = w1.shape[0]")
    h2 = w2.shape[0]
    require_shape("w2", w2, (h2, h1), "[H2, H1] with H1 = w1.shape[0]")
    require_array("b2", b2, F32, ndim=1)
    require_shape("b2", b2, (h2,), "[H2] with H2 = w2.shape[0]")
    dims = check_trunk_dims(rows, sd, h1, h2)
    check_f32_array("isv", isv, ndim=1)
    index = check_int("index", index, minimum=0, maximum=isv.shape[0] - 1)
    if not isinstance(with_aux, (bool, np.bool_)):
        raise ValueError(f"with_aux={with_aux!r}: must be a bool")
    return (*dims, index, f32_scalar("mult", mult))


def _dense_relu_aux(a_bf16: np.ndarray, w_bf16: np.ndarray, b: np.ndarray, with_aux: bool):
    """One forward GEMM node: ``relu(a @ w^T + b)`` in mode bf16 and its bitmask."""
    pre = dense.gemm(dense.bf16_to_f32(a_bf16), dense.bf16_to_f32(w_bf16), trans_b=True,
                     mode="bf16", rounded=True)
    h = dense.add_bias_relu(pre, b)
    return h, relu_aux_bits(h) if with_aux else np.zeros(0, U8)


def trunk_forward_bf16(xb: np.ndarray, w1: np.ndarray, b1: np.ndarray, w2: np.ndarray,
                       b2: np.ndarray, isv: np.ndarray, index: int, mult,
                       with_aux: bool = True) -> TrunkForward:
    """The trunk forward of ``rows`` BF16 states, as the four nodes compute it:

    - ``h1 = relu(xb @ W1^T + b1)`` (GEMM on the BF16 values, float32 accumulation; then one f32
      bias add and the select ``t <= 0 ? 0 : t``), ``aux1 = relu_aux_bits(h1)``;
    - ``h1_bf16 = f32_to_bf16(h1)``;
    - ``h2pre = relu(h1_bf16 @ W2^T + b2)``, ``aux2 = relu_aux_bits(h2pre)``;
    - ``h2, h2_bf16 = clamp_finite_isv(h2pre, isv, index, mult, with_bf16=True)``.

    Shapes: ``xb [rows, SD]``, ``w1 [H1, SD]``, ``w2 [H2, H1]`` uint16 (BF16 bit patterns);
    ``b1 [H1]``, ``b2 [H2]``, ``isv [L]`` float32; SD, H1, H2 multiples of 16. ``with_aux=False``:
    no bitmasks (empty ``aux1`` / ``aux2``; the kernel gets null pointers).

    NaN contract: the nodes' (IEEE through the GEMMs: a NaN/Inf in row i of ``xb`` reaches row i of
    ``h1`` and ``h2pre`` only; in W1 row j or ``b1[j]`` column j of ``h1``, hence all of ``h2pre``;
    NaN pre-activations stay NaN and set their aux bits; ``f32_to_bf16`` keeps NaN; the clamp
    maps NaN/Inf to +0.0 and a NaN ISV value gives the bound ``mult``).
    """
    *_, index, mult = validate_trunk_forward_bf16(xb, w1, b1, w2, b2, isv, index, mult, with_aux)
    h1, aux1 = _dense_relu_aux(xb, w1, b1, bool(with_aux))
    h1_bf16 = dense.f32_to_bf16(h1)
    h2pre, aux2 = _dense_relu_aux(h1_bf16, w2, b2, bool(with_aux))
    h2, h2_bf16 = step.clamp_finite_isv(h2pre, isv, index, mult, with_bf16=True)
    return TrunkForward(h1, aux1, h1_bf16, h2pre, aux2, h2, h2_bf16)


#: At most this many heads (cuda_src/trunk.cu HEADS_MAX: the value head and 7 branches).
HEADS_MAX = 8
#: Fields of one head in the fused heads kernel's table (trunk.cu HEADS_FIELDS): hidden, out,
#: then the element offsets of W1, b1, W2, b2 from the parameter set's first element.
HEADS_FIELDS = 6


class HeadsForward(NamedTuple):
    """Outputs of ``heads_forward_bf16``, the heads side by side: ``hid`` / ``hid_bf16``
    ``[rows, HT]`` (head h's hidden columns at ``sum(hidden[:h])``), ``out [rows, OT]`` (head h's
    outputs at ``sum(out[:h])``; head 0 is the value head's ``v``, heads 1.. the branches'
    advantages)."""

    hid: np.ndarray       # float32 [rows, HT]
    hid_bf16: np.ndarray  # uint16 [rows, HT]
    out: np.ndarray       # float32 [rows, OT]


def check_heads_dims(h2_width, hidden, out) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The heads kernel's shape rule (H2 and every hidden width positive multiples of
    :data:`TRUNK_WIDTH_MULTIPLE`, every output width >= 1, 1 to :data:`HEADS_MAX` heads), one
    ``ValueError`` naming the field, the value and the rule; returns ``(hidden, out)`` as ints."""
    hidden = tuple(int(h) for h in np.asarray(hidden).ravel())
    out = tuple(int(o) for o in np.asarray(out).ravel())
    if not 1 <= len(hidden) <= HEADS_MAX or len(out) != len(hidden):
        raise ValueError(f"hidden={hidden}, out={out}: the fused heads kernel needs 1 to "
                         f"{HEADS_MAX} heads, one hidden and one output width each")
    for name, value in (("H2", h2_width), *((f"hidden[{h}]", w) for h, w in enumerate(hidden))):
        if value < 1 or value % TRUNK_WIDTH_MULTIPLE:
            raise ValueError(f"{name}={value!r}: the fused heads kernel needs a positive multiple "
                             f"of {TRUNK_WIDTH_MULTIPLE}")
    if min(out) < 1:
        raise ValueError(f"out={out}: every head needs at least one output")
    return hidden, out


def validate_heads_forward_bf16(h2b, w1, b1, w2, b2, hidden, out):
    """The argument checks of ``heads_forward_bf16``; returns ``(rows, H2, hidden, out)``."""
    require_array("h2b", h2b, U16, ndim=2)
    require_array("hidden", hidden, np.dtype(np.int32), ndim=1)
    require_array("out", out, np.dtype(np.int32), ndim=1)
    rows, h2 = h2b.shape
    hid, outs = check_heads_dims(h2, hidden, out)
    ht, ot, hmax = sum(hid), sum(outs), max(hid)
    require_array("w1", w1, U16, ndim=2)
    require_shape("w1", w1, (ht, h2), "[sum(hidden), H2] with H2 = h2b.shape[1]")
    require_array("b1", b1, F32, ndim=1)
    require_shape("b1", b1, (ht,), "[sum(hidden)]")
    require_array("w2", w2, U16, ndim=2)
    require_shape("w2", w2, (ot, hmax), "[sum(out), max(hidden)]")
    require_array("b2", b2, F32, ndim=1)
    require_shape("b2", b2, (ot,), "[sum(out)]")
    check_int("rows", rows, minimum=1)
    return rows, h2, hid, outs


def second_layers(hid: np.ndarray, w2: np.ndarray, b2: np.ndarray, hidden, out, *,
                  mode: str = "bf16") -> list:
    """Every head's second layer ``hid[:, H_h] @ w2[O_h, :hidden[h]]^T + b2[O_h]`` (the GEMM
    ``dense.gemm`` in ``mode``, float32 accumulation, one f32 bias add), a ``[rows, out[h]]``
    float32 array a head (the heads side by side as in :func:`heads_forward_bf16`). ``mode``
    ``"bf16"``: ``hid`` and ``w2`` are BF16 bits (uint16); ``"f32"``: float32 values."""
    if mode == "bf16":
        hid, w2 = dense.bf16_to_f32(hid), dense.bf16_to_f32(w2)
    parts = []
    for h, (width, o0, o1) in enumerate(zip(hidden, np.cumsum((0,) + tuple(out[:-1])),
                                            np.cumsum(out))):
        h0 = sum(hidden[:h])
        pre = dense.gemm(np.ascontiguousarray(hid[:, h0:h0 + width]),
                         np.ascontiguousarray(w2[o0:o1, :width]), trans_b=True, mode=mode,
                         rounded=True)
        parts.append((pre + b2[o0:o1]).astype(F32, copy=False))
    return parts


def heads_forward_bf16(h2b: np.ndarray, w1: np.ndarray, b1: np.ndarray, w2: np.ndarray,
                       b2: np.ndarray, hidden: np.ndarray, out: np.ndarray) -> HeadsForward:
    """The heads' forward of ``rows`` BF16 h2 rows, as the nodes it replaces compute it, per head
    h (hidden columns ``H_h = sum(hidden[:h]) ..``, output columns ``O_h = sum(out[:h]) ..``):

    - ``hid[:, H_h] = relu(h2b @ w1[H_h]^T + b1[H_h])`` (GEMM on the BF16 values, float32
      accumulation, one f32 bias add, the select ``t <= 0 ? 0 : t``);
    - ``hid_bf16 = f32_to_bf16(hid)``;
    - ``out[:, O_h] = hid_bf16[:, H_h] @ w2[O_h, :hidden[h]]^T + b2[O_h]``.

    Shapes: ``h2b [rows, H2]``, ``w1 [HT, H2]``, ``w2 [OT, max(hidden)]`` uint16 (BF16 bits; a
    head's W2 rows use their first ``hidden[h]`` columns, the rest is not read), ``b1 [HT]``,
    ``b2 [OT]`` float32, ``hidden`` / ``out`` int32 ``[n_heads]`` (HT, OT their sums).

    NaN contract: the nodes' (IEEE through the GEMMs: a NaN/Inf in row i of ``h2b`` reaches row
    i of every output only; in ``w1`` row j or ``b1[j]`` column j of ``hid``, hence every output
    of that head; NaN pre-activations stay NaN; ``f32_to_bf16`` keeps NaN).
    """
    rows, _, hid_w, outs = validate_heads_forward_bf16(h2b, w1, b1, w2, b2, hidden, out)
    hid = dense.add_bias_relu(
        dense.gemm(dense.bf16_to_f32(h2b), dense.bf16_to_f32(w1), trans_b=True, mode="bf16",
                   rounded=True), b1)
    hid_bf16 = dense.f32_to_bf16(hid)
    parts = second_layers(hid_bf16, w2, b2, hid_w, outs)
    return HeadsForward(hid, hid_bf16, np.concatenate(parts, axis=1).astype(F32))


def heads_packed_offsets(hidden, out, rows: int, hid_align: int):
    """The step's packed layout of the heads' outputs (``fast/step_layout.py``): ``(hid_off,
    hid_total, adv_off, adv_total)``: head h's ``[rows, hidden[h]]`` block of ``hid`` /
    ``hid_bf16`` starts at ``hid_off[h]`` (aligned to ``hid_align`` elements), head h >= 1's
    ``[rows, out[h]]`` block of ``adv`` at ``adv_off[h]`` (head 0's is ``v``; ``adv_off[0]`` 0)."""
    hid_off, end = [], 0
    for width in hidden:
        start = -(-end // hid_align) * hid_align
        hid_off.append(start)
        end = start + rows * int(width)
    adv_off, end_adv = [0], 0
    for o in out[1:]:
        adv_off.append(end_adv)
        end_adv += rows * int(o)
    return tuple(hid_off), end, tuple(adv_off), end_adv


class HeadsOutDueling(NamedTuple):
    """Outputs of ``heads_out_dueling_bf16``: ``hid_bf16 [rows, HT]`` and ``out [rows, OT]`` side
    by side as :class:`HeadsForward`'s, then ``dueling_log_softmax_q_branches``' ``logits`` /
    ``logp [rows * A_total, NA]`` (branch-packed) and ``q [rows * A_total]`` (``[0]`` without
    ``with_q``)."""

    hid_bf16: np.ndarray  # uint16 [rows, HT]
    out: np.ndarray       # float32 [rows, OT]
    logits: np.ndarray    # float32 [rows * A_total, NA]
    logp: np.ndarray      # float32 [rows * A_total, NA]
    q: np.ndarray         # float32 [rows * A_total] or [0]


class HeadsOutDuelingF32(NamedTuple):
    """Outputs of ``heads_out_dueling_f32``: :class:`HeadsOutDueling`'s without ``hid_bf16``."""

    out: np.ndarray       # float32 [rows, OT]
    logits: np.ndarray    # float32 [rows * A_total, NA]
    logp: np.ndarray      # float32 [rows * A_total, NA]
    q: np.ndarray         # float32 [rows * A_total] or [0]


def check_heads_out_dims(hidden, out, n_actions, num_atoms, kernel: str = "heads_out_dueling_bf16"):
    """The shape rule of ``kernel``'s heads (``heads_out_dueling_bf16`` or ``_f32``; the fast
    kernels add their limits: fast ``kernels.trunk.check_heads_out_dueling``): every hidden width
    a positive multiple of 16, at least one branch, the value head and one head a branch, ``out ==
    (NA, n_0 NA, ...)``; one ``ValueError`` naming the field, the value and the rule. Returns
    ``(hidden, out, branches)`` as int tuples."""
    from foxhunt.reference.kernels.fused import require_branches

    hidden, out = check_heads_dims(TRUNK_WIDTH_MULTIPLE, hidden, out)
    branches = tuple(int(n) for n in n_actions)
    num_atoms = check_int("num_atoms", num_atoms, minimum=1)
    if not branches:
        raise ValueError(f"n_actions={branches}: {kernel} needs at least one branch")
    branches = require_branches(branches)
    if len(hidden) != len(branches) + 1:
        raise ValueError(f"hidden={hidden}: {kernel} needs the value head and one "
                         f"head a branch: {len(branches) + 1} heads for n_actions={branches}")
    want = (num_atoms,) + tuple(n * num_atoms for n in branches)
    if out != want:
        raise ValueError(f"out={out}: {kernel} needs (NA, n_0 NA, ...) = {want}")
    return hidden, out, branches


def validate_heads_out_dueling(hid, w2, b2, z, hidden, out, n_actions, with_q, *,
                               kernel: str = "heads_out_dueling_bf16"):
    """The argument checks of ``kernel`` (``heads_out_dueling_bf16``: ``w2`` uint16 BF16 bits;
    ``heads_out_dueling_f32``: float32); returns ``(rows, hidden, out, branches, with_q)``: ``hid
    [rows, HT]`` float32, ``w2 [OT, max(hidden)]``, ``b2 [OT]`` float32, ``z [NA]`` float32,
    ``hidden`` / ``out`` int32 ``[n_heads]`` (2 to HEADS_MAX heads, every hidden width a positive
    multiple of 16), ``n_actions`` int32 ``[n_heads - 1]`` with ``out[0] == NA`` and ``out[d + 1]
    == n_actions[d] * NA``, ``with_q`` a bool."""
    require_array("hid", hid, F32, ndim=2)
    require_array("hidden", hidden, np.dtype(np.int32), ndim=1)
    require_array("out", out, np.dtype(np.int32), ndim=1)
    require_array("n_actions", n_actions, np.dtype(np.int32), ndim=1)
    require_array("z", z, F32, ndim=1)
    rows = hid.shape[0]
    hid_w, outs, branches = check_heads_out_dims(hidden, out, n_actions, z.shape[0],  # NA: z's
                                                 kernel)
    require_shape("hid", hid, (rows, sum(hid_w)), "[rows, sum(hidden)]")
    require_array("w2", w2, F32 if kernel.endswith("_f32") else U16, ndim=2)
    require_shape("w2", w2, (sum(outs), max(hid_w)), "[sum(out), max(hidden)]")
    require_array("b2", b2, F32, ndim=1)
    require_shape("b2", b2, (sum(outs),), "[sum(out)]")
    check_int("rows", rows, minimum=1)
    if not isinstance(with_q, (bool, np.bool_)):
        raise ValueError(f"with_q: {with_q!r} is not allowed; expected True or False")
    return rows, hid_w, outs, branches, bool(with_q)


def _dueling_of(parts: list, z: np.ndarray, branches, with_q: bool):
    """``dueling_log_softmax_q_branches`` on the value head's and the branch heads' outputs
    (``parts``, :func:`second_layers`' list)."""
    from foxhunt.reference.kernels import fused

    na = int(z.shape[0])
    adv = np.concatenate([p.reshape(-1, na) for p in parts[1:]], axis=0).astype(F32)
    return fused.dueling_log_softmax_q_branches(parts[0], adv, z, branches, with_q)


def heads_out_dueling_bf16(hid: np.ndarray, w2: np.ndarray, b2: np.ndarray, z: np.ndarray,
                           hidden: np.ndarray, out: np.ndarray, n_actions: np.ndarray,
                           with_q) -> HeadsOutDueling:
    """A pass's heads from their hidden values to the dueling log-softmax, as the nodes it
    replaces compute it (the heads side by side as in :func:`heads_forward_bf16`):

    - ``hid_bf16 = f32_to_bf16(hid)``;
    - per head h: ``out[:, O_h] = hid_bf16[:, H_h] @ w2[O_h, :hidden[h]]^T + b2[O_h]`` (GEMM on
      the BF16 values, float32 accumulation, one f32 bias add); head 0 is the value head ``v
      [rows, NA]``, head d + 1 branch d's advantages ``[rows, n_d NA]`` (the rows of branch d's
      block of the packed ``adv``);
    - ``logits, logp, q = fused.dueling_log_softmax_q_branches(v, adv, z, n_actions, with_q)``.

    NaN contract: the nodes' composed (IEEE through the GEMMs: a NaN or Inf in row i of ``hid``
    reaches row i of its head's outputs; in ``w2`` row j or ``b2[j]`` that output column in every
    row; ``f32_to_bf16`` keeps NaN; then ``dueling_log_softmax_q_branches``' contract).
    """
    rows, hid_w, outs, branches, with_q = validate_heads_out_dueling(
        hid, w2, b2, z, hidden, out, n_actions, with_q)
    hid_bf16 = dense.f32_to_bf16(hid)
    parts = second_layers(hid_bf16, w2, b2, hid_w, outs)
    r = _dueling_of(parts, z, branches, with_q)
    return HeadsOutDueling(hid_bf16, np.concatenate(parts, axis=1).astype(F32), r.logits, r.logp,
                           r.q)


def heads_out_dueling_f32(hid: np.ndarray, w2: np.ndarray, b2: np.ndarray, z: np.ndarray,
                          hidden: np.ndarray, out: np.ndarray, n_actions: np.ndarray,
                          with_q) -> HeadsOutDuelingF32:
    """The f32 step's twin of :func:`heads_out_dueling_bf16`, the composition of the nodes it
    replaces there (the heads side by side as in :func:`heads_forward_bf16`):

    - per head h: ``out[:, O_h] = hid[:, H_h] @ w2[O_h, :hidden[h]]^T + b2[O_h]`` (``dense.gemm``
      mode ``"f32"``: float32 products and sums, then one f32 bias add; cuBLASLt's f32 GEMM with
      the BIAS epilogue); head 0 the value head ``v [rows, NA]``, head d + 1 branch d's
      advantages ``[rows, n_d NA]``;
    - ``logits, logp, q = fused.dueling_log_softmax_q_branches(v, adv, z, n_actions, with_q)``.

    Shapes as :func:`heads_out_dueling_bf16`'s with ``w2`` float32. NaN contract: the nodes'
    composed (IEEE through the GEMMs: a NaN or Inf in row i of ``hid`` reaches row i of its head's
    outputs; in ``w2`` row j or ``b2[j]`` that output column in every row; then
    ``dueling_log_softmax_q_branches``' contract).
    """
    rows, hid_w, outs, branches, with_q = validate_heads_out_dueling(
        hid, w2, b2, z, hidden, out, n_actions, with_q, kernel="heads_out_dueling_f32")
    parts = second_layers(hid, w2, b2, hid_w, outs, mode="f32")
    r = _dueling_of(parts, z, branches, with_q)
    return HeadsOutDuelingF32(np.concatenate(parts, axis=1).astype(F32), r.logits, r.logp, r.q)


def check_heads_dh2_dims(hidden) -> tuple[int, ...]:
    """``heads_dh2_tf32``'s rule on the heads (1 to :data:`HEADS_MAX` of them, every hidden width
    >= 1), one ``ValueError`` naming the field, the value and the rule; the widths as ints."""
    hidden = tuple(int(h) for h in np.asarray(hidden).ravel())
    if not 1 <= len(hidden) <= HEADS_MAX:
        raise ValueError(f"hidden={hidden}: heads_dh2_tf32 needs 1 to {HEADS_MAX} heads")
    for h, width in enumerate(hidden):
        if width < 1:
            raise ValueError(f"hidden[{h}]={width}: heads_dh2_tf32 needs a width >= 1")
    return hidden


def validate_heads_dh2_tf32(dhid, w1, hidden, h2, h2_pre) -> tuple[int, tuple[int, ...], int]:
    """The argument checks of ``heads_dh2_tf32``; returns ``(rows, hidden, H2)``: ``dhid [rows,
    HT]``, ``w1 [HT, H2]``, ``h2`` and ``h2_pre [rows, H2]`` float32 (``HT = sum(hidden)``),
    ``hidden`` int32 ``[n_heads]`` (:func:`check_heads_dh2_dims`)."""
    require_array("dhid", dhid, F32, ndim=2)
    require_array("w1", w1, F32, ndim=2)
    require_array("hidden", hidden, np.dtype(np.int32), ndim=1)
    hid_w = check_heads_dh2_dims(hidden)
    rows, h2_width = dhid.shape[0], w1.shape[1]
    check_int("rows", rows, minimum=1)
    check_int("H2", h2_width, minimum=1)
    require_shape("dhid", dhid, (rows, sum(hid_w)), "[rows, sum(hidden)]")
    require_shape("w1", w1, (sum(hid_w), h2_width), "[sum(hidden), H2]")
    for name, x in (("h2", h2), ("h2_pre", h2_pre)):
        require_array(name, x, F32, ndim=2)
        require_shape(name, x, (rows, h2_width), "[rows, H2]")
    return rows, hid_w, h2_width


def heads_dh2_order(n_heads: int) -> tuple[int, ...]:
    """The order the heads' parts of ``d h2`` are summed in (the reference network's,
    ``fast/step_layout.py``'s ``dh2p``): the branch heads ``1 .. n_heads - 1``, then the value
    head 0."""
    return tuple(range(1, n_heads)) + (0,)


def heads_dh2_tf32(dhid: np.ndarray, w1: np.ndarray, hidden: np.ndarray, h2: np.ndarray,
                   h2_pre: np.ndarray) -> step.TrunkGrad:
    """A TF32 backward pass from the heads' hidden gradients into the trunk, as the nodes it
    replaces compute it (the heads side by side as in :func:`heads_forward_bf16`):

    - per head h: ``part_h = dense.gemm(dhid[:, H_h], w1[H_h, :], mode="tf32")`` (``dhid_h [rows,
      hidden[h]] @ W1_h [hidden[h], H2]``, TF32 operands, float32 accumulation);
    - ``dh2, out = step.h2_grad_sum_mask(parts, h2, h2_pre)`` with the parts in
      :func:`heads_dh2_order` (the sum from zeros, then Mech 10's clamp and the trunk ReLU).

    NaN contract: the nodes' composed (IEEE through the GEMMs: a NaN or Inf in row i of ``dhid``
    reaches row i of ``dh2``, one in row k of ``w1`` a column of every row; then
    ``h2_grad_sum_mask``'s masks: a NaN ``h2_pre`` or ``h2_pre <= 0`` gives +0 in ``out``).
    """
    _, hid_w, _ = validate_heads_dh2_tf32(dhid, w1, hidden, h2, h2_pre)
    starts = np.cumsum((0,) + hid_w)
    parts = [dense.gemm(np.ascontiguousarray(dhid[:, starts[h]:starts[h + 1]]),
                        np.ascontiguousarray(w1[starts[h]:starts[h + 1]]), mode="tf32")
             for h in heads_dh2_order(len(hid_w))]
    return step.h2_grad_sum_mask(np.stack(parts), h2, h2_pre)


KERNELS = {"trunk_forward_bf16": trunk_forward_bf16, "heads_forward_bf16": heads_forward_bf16,
           "heads_out_dueling_bf16": heads_out_dueling_bf16,
           "heads_out_dueling_f32": heads_out_dueling_f32, "heads_dh2_tf32": heads_dh2_tf32}
