"""Entries of the fused MLP forwards (``cuda_src/trunk.cu``): the trunk (reference
``foxhunt.reference.kernels.trunk.trunk_forward_bf16``: the four nodes it replaces, composed) and
the heads (``heads_forward_bf16``, at the end of this docstring).

Sizes ``(rows, SD, H1, H2)`` per shape case (:func:`trunk_dims`): ``tiny`` and ``seed`` the
presets' online forward (``2 * batch`` rows; seed: 512 x 128 -> 256 -> 256); ``odd`` 257 rows
(a partial last block) of widths 48 -> 80 -> 272 (legal multiples of 16 that leave a K chunk of
16, a partial pass of n8 tiles, a second pass and padded bitmask rows); the extremal cases 5
rows of 16 -> 32 -> 16. ``tiny`` runs without bitmasks (the null-pointer path).

Samples: states and weights bounded (``|x| <= 1``, ``|w| <= GAIN / sqrt(fan in)``), so that an
injected f32 max (BF16 ``0x7F7F``) overflows no sum in any order (``H1 * max|w1| * max|w2| <=
GAIN^2 sqrt(H1 / SD) < 1``): the non-finite maps of both paths are then order-independent. The
bound of Mech 10's clamp, ``mult * max(isv[index], 1)`` with ``mult`` 1/2, clamps part of h2.
The extremal cases read the bound from ISV slot 256, a boundary position of the poisoned ISV.

Tolerances. Each layer is a GEMM on BF16 operands with FP32 accumulation in the tensor cores'
order, so it is judged by the GEMM policy (kind "gemm", safety 2) on the layer's own operands
``A = [a, 1]`` and ``B = [W^T; b]`` (the bias as one more term, so K is the layer's fan in + 1).
Those operands are the BF16 values themselves, exact in float32, and both paths multiply exactly
them, so the bound is the policy's without input-rounding slack (its mode "f32": ``2 gamma_K
|A| |B|``; mode "bf16" would add ``2^-7 |C64|`` for a rounding that does not differ here, and let
a 0.1% error through). The epilogue enters as ``clip``: ReLU ``(0, inf)``, ReLU plus the clamp
``(0, bound)`` for h2 (1-Lipschitz, the bound holds unchanged). h2pre and h2 are bounded against
layer 2 ALONE on the reference's own ``h1_bf16``, plus ``a_slack``: where the reference's h1 lies
within layer 1's bound ``E1`` of a BF16 rounding midpoint, the fast path may round its h1 to the
neighbouring BF16 value, and that operand difference (exactly ``|bf16(h1 +- E1) - h1_bf16|``) is
added times ``|W2|``. That is the stricter of the meaningful choices: a compound bound with K =
SD + H1 on the float64 chain would be looser for every element, while layer 2's bound without
the slack fails legitimately (one flipped BF16 operand changes a dot product by 2^-8 of one
term, more than ``gamma_K |A| |B|`` where the product cancels). The bitmasks and BF16 copies are
compared bit for bit except the bits the bound cannot decide (``free_bits``): an aux bit whose
pre-activation interval ``C64 +- E`` straddles 0, a BF16 copy whose value interval straddles a
rounding midpoint (the reference's own NaN payloads aside). Where a layer's float64 product is
not finite (a NaN/Inf row or column), the clamped h2 must equal the reference's bit for bit.

The heads (``heads_forward_bf16``): sizes ``(rows, H2, hidden, out)`` per case
(:func:`heads_dims`): ``tiny`` and ``seed`` the presets' heads (value head, then each branch's
``n_d * NA`` advantages) at the online forward's ``2 * batch`` rows; ``odd`` 257 rows of H2 = 48
into hidden widths (32, 48, 16) and outputs (7, 20, 1) (n8 tiles of two heads side by side, an
output tile mostly padding); ``extremal`` 5 rows, one head of 16 -> 1. Samples and bounds as the
trunk's: layer 1 is one GEMM over the heads side by side (``hid``; ``hid_bf16`` bit for bit but
the undecided bits), layer 2 one GEMM of ``hid_bf16`` against the heads' W2 as a block-diagonal
``[HT, OT]`` operand (zeros off the blocks add nothing to ``|A| |B|``; K = HT + 1 makes
``gamma_K`` looser than a head's own K + 1) plus the operand slack of layer 1's undecided BF16
roundings, no clip (no ReLU on the outputs).

The heads' outputs with the dueling log-softmax (``heads_out_dueling_bf16``): sizes ``(rows,
hidden, branches, NA)`` per case (:func:`hod_dims`): ``tiny`` and ``seed`` the presets' online
forward; ``odd`` 257 rows of hidden widths (32, 48, 16), branches (4, 1) of 7 atoms (a partial
n8 tile per head), the target pass's no-Q path; ``extremal`` 5 rows, one branch of 2 actions and
3 atoms. Samples: non-negative hidden values (a ReLU's) up to 1, W2 and b2 as the heads', the
support of ``NA`` atoms. ``hid_bf16`` bit for bit (both paths round the same f32 values); ``out``
by the GEMM policy on ``[hid_bf16, 1]`` against the block-diagonal ``[W2^T; b2]`` (both paths
multiply exactly these operands; no slack). ``logits`` / ``logp`` / ``q``: the dueling
log-softmax's own reduction bound (``dueling_log_softmax_q_branches``' entry) plus ``out``'s GEMM
bound ``E`` carried through it: a logit's error is at most ``E_v + E_adv + mean_a E_adv`` of its
cell (``L``); a log-probability's at most its ``L`` plus the row's largest finite ``L`` (the
log-sum-exp is 1-Lipschitz in the max norm; a ``-Inf`` logit adds exactly 0 to it in both
paths); ``q``'s at most ``2 max|z|`` times the row's largest finite ``L`` (``dq = sum_j p_j (z_j -
q) dlogit_j``). The carried bound enters as extra magnitude of the reduction tolerance.
``heads_out_dueling_f32`` (the f32 step's): the same cases and bounds with W2 float32 (uniform,
not BF16 values) and no ``hid_bf16``: ``out`` by the GEMM policy on ``[hid, 1]`` against the
block-diagonal ``[W2^T; b2]``.

The heads' input gradients into the trunk (``heads_dh2_tf32``): sizes ``(rows, hidden, H2)`` per
case (:func:`dh2_dims`): ``tiny`` and ``seed`` the presets' loss backward (``batch_size`` rows,
the value head and a head a branch, ``shared_h2``); ``odd`` 257 rows, hidden widths (21, 300,
12) (a width that is no multiple of 4 takes the kernel's 4-byte staging; 300 gives a warp two
chunks of k; k tails within a warp's range) and H2 = 40 (a partial column tile); ``extremal`` 5
rows, widths (16, 8), H2 = 16.
Samples: hidden gradients with the ReLU's zeros, W1 as the heads', a pre-activation clamped at
1.5 (so the clamp's mask is exercised). Both outputs by the GEMM policy on the concatenated
``tf32_round`` operands ``[dhid] @ [W1]`` (k = sum(hidden): the parts' sum is that product); the
elements the masks zero in ``out`` bit for bit.
"""

from __future__ import annotations

import numpy as np

from foxhunt.conformance.kernel_spec import Dims, Kwargs, Output, SpecEntry
from foxhunt.conformance.specs.inputs import (
    all_of,
    error_cases,
    f32,
    finite_outputs,
    isv_vector,
    maxabs,
    product_overflow,
    reduction,
    replace,
    support,
    u16,
    wrong_dtype,
)
from foxhunt.conformance.tolerance import (
    GEMM_TOLERANCES,
    REDUCTION,
    REDUCTION_ATOL_PER_ELEM,
    Tolerance,
    gemm_bound,
    gemm_reference,
)
from foxhunt.reference import isv as isv_mod
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.kernels.dense import bf16_to_f32, f32_to_bf16, tf32_round
from foxhunt.reference.kernels.safety import isv_bound
from foxhunt.reference.kernels.trunk import relu_aux_bits

F32, F64, U16 = np.float32, np.float64, np.uint16

#: Extremal sizes and the odd case (module docstring); tiny / seed come from the presets.
EXTREMAL_DIMS = (5, 16, 32, 16)
ODD_DIMS = (257, 48, 80, 272)
#: Weights are uniform in ``+- GAIN / sqrt(fan in)`` (GAIN^2 sqrt(2) < 1: no overflow).
GAIN = 0.5
#: Biases uniform in ``+- BIAS``; Mech 10's multiplier in the samples.
BIAS = 1.5
CLAMP_MULT = F32(0.5)
#: The extremal cases' ISV slot (a boundary position: the poisoned ISV's specials land there).
EXTREMAL_ISV_INDEX = 256

#: The GEMM policy's bound without input-rounding slack (module docstring: the operands given
#: are the BF16 values both paths multiply, exactly).
GEMM = GEMM_TOLERANCES["f32"]
BITS = Tolerance.exact(bitwise=True, nan_payload=False)
MASK = Tolerance.exact()
ALL_BITS = np.iinfo(U16).max


def trunk_dims(case: str) -> tuple[int, int, int, int]:
    """``(rows, SD, H1, H2)`` of a shape case (module docstring)."""
    if case == "extremal":
        return EXTREMAL_DIMS
    if case == "odd":
        return ODD_DIMS
    cfg = DQNConfig.preset(case)
    return 2 * cfg.batch_size, cfg.state_dim, cfg.shared_h1, cfg.shared_h2


def _bf16(rng, shape, scale: float) -> np.ndarray:
    return f32_to_bf16(rng.uniform(-scale, scale, shape).astype(F32))


def trunk_sample(rng, rows: int, sd: int, h1: int, h2: int, *, with_aux: bool = True,
                 index: int = isv_mod.H_S2_RMS_EMA_INDEX) -> Kwargs:
    """Keyword arguments of ``trunk_forward_bf16`` for one shape (module docstring's values);
    ``index``: the ISV slot of the clamp's bound (given the H_S2_RMS_EMA slot's random value)."""
    isv = isv_vector(rng)
    isv[index] = isv[isv_mod.H_S2_RMS_EMA_INDEX]
    return {"xb": _bf16(rng, (rows, sd), 1.0), "w1": _bf16(rng, (h1, sd), GAIN / np.sqrt(sd)),
            "b1": rng.uniform(-BIAS, BIAS, h1).astype(F32),
            "w2": _bf16(rng, (h2, h1), GAIN / np.sqrt(h1)),
            "b2": rng.uniform(-BIAS, BIAS, h2).astype(F32), "isv": isv, "index": index,
            "mult": CLAMP_MULT, "with_aux": with_aux}


def _sample(d: Dims, rng) -> Kwargs:
    index = EXTREMAL_ISV_INDEX if d.case == "extremal" else isv_mod.H_S2_RMS_EMA_INDEX
    return trunk_sample(rng, *trunk_dims(d.case), with_aux=d.case != "odd", index=index)


# ----------------------------------------------------------------------------- the bounds
def _operands(a: np.ndarray, w: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``([a, 1], [W^T; b])`` in float64: the layer's GEMM with the bias as one more term (``w``
    BF16 bits, or float32 values)."""
    ones = np.ones((a.shape[0], 1), F64)
    w32 = bf16_to_f32(w) if w.dtype == U16 else w
    return (np.concatenate([a.astype(F64), ones], axis=1),
            np.concatenate([w32.T.astype(F64), b[None, :].astype(F64)], axis=0))


def _outward_f32(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The float32 interval that contains ``[lo, hi]`` (float64)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return (np.nextafter(lo.astype(F32), F32(-np.inf)),
                np.nextafter(hi.astype(F32), F32(np.inf)))


def _layer(a, slack, w_bf16, b, clip) -> tuple[dict, np.ndarray, np.ndarray]:
    """One layer's comparison inputs and the float32 interval ``[lo, hi]`` that holds the fast
    path's pre-activation wherever it conforms (``C64 +- bound``)."""
    a64, b64 = _operands(a, w_bf16, b)
    inputs = {"a": a64, "b": b64, "clip": clip}
    c64, abs_ab = gemm_reference(a64, b64)
    with np.errstate(invalid="ignore", over="ignore"):
        bound = gemm_bound(GEMM, c64, abs_ab, a64.shape[1])
        if slack is not None:
            inputs["a_slack"] = np.concatenate([slack, np.zeros((a.shape[0], 1))], axis=1)
            bound = bound + GEMM.safety * (inputs["a_slack"] @ np.abs(b64))
        lo, hi = _outward_f32(c64 - bound, c64 + bound)
    return inputs, lo, hi


def _free(lo, hi, finite, f) -> np.ndarray:
    """Elements whose BF16 copy ``f32_to_bf16(f(v))`` is not the same for every ``v`` in
    ``[lo, hi]`` (``f`` monotone), where the layer's float64 product is finite."""
    return finite & (f32_to_bf16(f(lo)) != f32_to_bf16(f(hi)))


def _relu(x):
    return np.where(x <= 0, F32(0), x).astype(F32)


def _aux_free(lo, hi, finite, with_aux) -> np.ndarray:
    """Bits of the ReLU mask that ``[lo, hi]`` leaves undecided (it straddles 0)."""
    if not with_aux:
        return np.zeros(0, np.uint8)
    return relu_aux_bits(np.where(finite & (lo <= 0) & (hi > 0), F32(1), F32(0)))


def _relu_layer_and_slack(a_bf16, w_bf16, b, out_bf16):
    """A first ReLU layer's comparison inputs, its interval ``[lo, hi]``, where it is finite, and
    the operand slack its undecided BF16 roundings give the next layer (module docstring:
    ``|bf16(relu(h1 +- E1)) - h1_bf16|``, ``out_bf16`` the reference's BF16 copy)."""
    one, lo, hi = _layer(bf16_to_f32(a_bf16), None, w_bf16, b, (0.0, np.inf))
    fin = np.isfinite(lo) & np.isfinite(hi)
    ref = bf16_to_f32(out_bf16).astype(F64)
    with np.errstate(invalid="ignore"):
        ends = [bf16_to_f32(f32_to_bf16(_relu(v))).astype(F64) for v in (lo, hi)]
        slack = np.where(fin, np.maximum(np.abs(ends[0] - ref), np.abs(ends[1] - ref)), 0.0)
    return one, lo, hi, fin, slack


def _scales(kwargs: Kwargs, expected) -> dict:
    """Per output, the comparison inputs of the module docstring."""
    with_aux = kwargs.get("with_aux", True)
    one, lo1, hi1, fin1, slack = _relu_layer_and_slack(kwargs["xb"], kwargs["w1"], kwargs["b1"],
                                                       expected["h1_bf16"])
    two, lo2, hi2 = _layer(bf16_to_f32(expected["h1_bf16"]), slack, kwargs["w2"], kwargs["b2"],
                           (0.0, np.inf))
    fin2 = np.isfinite(lo2) & np.isfinite(hi2)
    bound = float(isv_bound(kwargs["mult"], kwargs["isv"][kwargs["index"]]))
    clamped = dict(two, clip=(0.0, bound), exact=~np.isfinite(gemm_reference(two["a"], two["b"])[0]))
    clamp = lambda v: np.minimum(_relu(v), F32(bound))  # noqa: E731 - h2's monotone map
    return {
        "h1": one,
        "aux1": {"free_bits": _aux_free(lo1, hi1, fin1, with_aux)},
        "h1_bf16": {"free_bits": np.where(_free(lo1, hi1, fin1, _relu), ALL_BITS, 0)},
        "h2pre": two,
        "aux2": {"free_bits": _aux_free(lo2, hi2, fin2, with_aux)},
        "h2": clamped,
        "h2_bf16": {"free_bits": np.where(_free(lo2, hi2, fin2, clamp), ALL_BITS, 0)},
    }


# --------------------------------------------------------------------------- the contract
def rows_stay(source: str, outputs: tuple[str, ...], what: str):
    """The contract that a non-finite row of BF16 input ``source`` reaches only its own row of
    each of ``outputs`` (checked where ``source`` is the poisoned input)."""
    def check(kwargs, out, poisoned) -> list[str]:
        if poisoned is None or poisoned.split(":")[1] != source:
            return []
        bad_rows = ~np.all(np.isfinite(bf16_to_f32(kwargs[source])), axis=1)
        leaked = [n for n in outputs if not np.all(np.isfinite(out[n][~bad_rows]))]
        return [f"{n!r}: a non-finite {what} leaked into another row" for n in leaked]
    return check


# ------------------------------------------------------------------------------- the heads
#: The heads' odd and extremal cases (module docstring): ``(rows, H2, hidden, out)``.
HEADS_ODD = (257, 48, (32, 48, 16), (7, 20, 1))
HEADS_EXTREMAL = (5, 16, (16,), (1,))


def heads_dims(case: str) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
    """``(rows, H2, hidden, out)`` of a shape case (module docstring)."""
    if case == "extremal":
        return HEADS_EXTREMAL
    if case == "odd":
        return HEADS_ODD
    cfg = DQNConfig.preset(case)
    return (2 * cfg.batch_size, cfg.shared_h2, (cfg.value_h,) + (cfg.adv_h,) * cfg.n_branches,
            (cfg.num_atoms,) + tuple(n * cfg.num_atoms for n in cfg.branches))


def heads_sample(rng, rows: int, h2: int, hidden, out) -> Kwargs:
    """Keyword arguments of ``heads_forward_bf16`` (the trunk's value ranges; a head's W2 rows
    past its hidden width hold values too: the kernel must not read them)."""
    ht, ot = sum(hidden), sum(out)
    w2 = np.concatenate([_bf16(rng, (o, max(hidden)), GAIN / np.sqrt(w))
                         for w, o in zip(hidden, out)])
    return {"h2b": _bf16(rng, (rows, h2), 1.0), "w1": _bf16(rng, (ht, h2), GAIN / np.sqrt(h2)),
            "b1": rng.uniform(-BIAS, BIAS, ht).astype(F32), "w2": w2,
            "b2": rng.uniform(-BIAS, BIAS, ot).astype(F32),
            "hidden": np.array(hidden, np.int32), "out": np.array(out, np.int32)}


def _heads_sample(d: Dims, rng) -> Kwargs:
    return heads_sample(rng, *heads_dims(d.case))


def block_diagonal_w2(w2: np.ndarray, hidden, out) -> np.ndarray:
    """The heads' W2 as one ``[OT, HT]`` operand of ``w2``'s dtype (BF16 bits or float32): head
    h's ``w2`` rows (their first ``hidden[h]`` columns) at its hidden columns, zeros elsewhere."""
    full = np.zeros((sum(out), sum(hidden)), w2.dtype)
    h0 = o0 = 0
    for width, o in zip(hidden, out):
        full[o0:o0 + o, h0:h0 + width] = w2[o0:o0 + o, :width]
        h0, o0 = h0 + width, o0 + o
    return full


def _heads_scales(kwargs: Kwargs, expected) -> dict:
    """Per output, the comparison inputs (module docstring)."""
    hidden, out = (tuple(int(x) for x in kwargs[k]) for k in ("hidden", "out"))
    one, lo1, hi1, fin1, slack = _relu_layer_and_slack(kwargs["h2b"], kwargs["w1"], kwargs["b1"],
                                                       expected["hid_bf16"])
    two, _, _ = _layer(bf16_to_f32(expected["hid_bf16"]), slack,
                       block_diagonal_w2(kwargs["w2"], hidden, out), kwargs["b2"],
                       (-np.inf, np.inf))
    return {"hid": one, "hid_bf16": {"free_bits": np.where(_free(lo1, hi1, fin1, _relu), ALL_BITS, 0)},
            "out": two}


# ------------------------------------------------------- the heads' outputs and the dueling
#: ``heads_out_dueling_bf16``'s odd and extremal cases (module docstring): ``(rows, hidden,
#: branches, NA)``.
HOD_ODD = (257, (32, 48, 16), (4, 1), 7)
HOD_EXTREMAL = (5, (16, 16), (2,), 3)


def hod_dims(case: str) -> tuple[int, tuple[int, ...], tuple[int, ...], int]:
    """``(rows, hidden, branches, NA)`` of a shape case (module docstring)."""
    if case == "extremal":
        return HOD_EXTREMAL
    if case == "odd":
        return HOD_ODD
    cfg = DQNConfig.preset(case)
    return (2 * cfg.batch_size, (cfg.value_h,) + (cfg.adv_h,) * cfg.n_branches,
            tuple(cfg.branches), cfg.num_atoms)


def hod_sample(rng, rows: int, hidden, branches, na: int, with_q: bool = True,
               precision: str = "bf16") -> Kwargs:
    """Keyword arguments of ``heads_out_dueling_bf16`` (``precision`` ``"f32"``:
    ``heads_out_dueling_f32``'s, W2 float32; module docstring's values; a head's W2 rows past its
    hidden width hold values too: the kernel must not read them)."""
    out = (na,) + tuple(n * na for n in branches)
    draw = _bf16 if precision == "bf16" else (
        lambda g, shape, scale: g.uniform(-scale, scale, shape).astype(F32))
    w2 = np.concatenate([draw(rng, (o, max(hidden)), GAIN / np.sqrt(w))
                         for w, o in zip(hidden, out)])
    return {"hid": rng.uniform(0.0, 1.0, (rows, sum(hidden))).astype(F32), "w2": w2,
            "b2": rng.uniform(-BIAS, BIAS, sum(out)).astype(F32), "z": support(na),
            "hidden": np.array(hidden, np.int32), "out": np.array(out, np.int32),
            "n_actions": np.array(branches, np.int32), "with_q": with_q}


def _hod_sample(d: Dims, rng) -> Kwargs:
    return hod_sample(rng, *hod_dims(d.case), with_q=d.case != "odd")


def _hod_f32_sample(d: Dims, rng) -> Kwargs:
    return hod_sample(rng, *hod_dims(d.case), with_q=d.case != "odd", precision="f32")


def _finite_or_max(x: np.ndarray) -> np.ndarray:
    """``x`` with its non-finite entries as the largest float64 (an unbounded allowance)."""
    return np.where(np.isfinite(x), x, np.finfo(F64).max)


def _hod_scales(kwargs: Kwargs, expected) -> dict:
    """Per output, the comparison inputs (module docstring)."""
    hidden, out = (tuple(int(x) for x in kwargs[k]) for k in ("hidden", "out"))
    branches = tuple(int(n) for n in kwargs["n_actions"])
    na, rows = out[0], kwargs["hid"].shape[0]
    bf16 = "hid_bf16" in expected  # heads_out_dueling_bf16's; the f32 kernel multiplies hid
    two, _, _ = _layer(bf16_to_f32(expected["hid_bf16"]) if bf16 else kwargs["hid"], None,
                       block_diagonal_w2(kwargs["w2"], hidden, out), kwargs["b2"],
                       (-np.inf, np.inf))
    with np.errstate(invalid="ignore", over="ignore"):
        c64, abs_ab = gemm_reference(two["a"], two["b"])
        e = gemm_bound(GEMM, c64, abs_ab, two["a"].shape[1])
        e_v, cells, o0 = e[:, :na], [], na
        for n in branches:
            e_adv = e[:, o0:o0 + n * na].reshape(rows, n, na)
            cells.append((e_v[:, None, :] + e_adv + e_adv.mean(axis=1, keepdims=True)).reshape(-1, na))
            o0 += n * na
        lmax_of = np.concatenate(cells)
        row_max = np.max(np.where(np.isfinite(expected["logits"]),
                                  np.nan_to_num(lmax_of, nan=np.inf), 0.0), axis=1)
        carried = {"logits": lmax_of, "logp": lmax_of + row_max[:, None],
                   "q": 2 * maxabs(kwargs["z"]) * row_max}
    v, adv = expected["out"][:, :na], expected["out"][:, na:]
    own = {"logits": (max(branches), maxabs(v) + 2 * maxabs(adv)),
           "logp": (na, 1.0 + 2 * maxabs(expected["logits"])), "q": (na, maxabs(kwargs["z"]))}
    out_scales = {"hid_bf16": {}, "out": two} if bf16 else {"out": two}
    for name, (length, magnitude) in own.items():
        with np.errstate(over="ignore"):  # a non-finite carried bound: an infinite allowance
            extra = _finite_or_max(carried[name]) / (REDUCTION_ATOL_PER_ELEM * max(int(length), 1))
        if name == "q" and not kwargs["with_q"]:
            extra = np.zeros(0)
        out_scales[name] = reduction(length, magnitude + extra)
    return out_scales


def hod_rows_stay(kwargs, out, poisoned) -> list[str]:
    """The contract that a row of ``hid`` whose multiplied copy is not finite (BF16: f32 max
    rounds to Inf; the f32 kernel multiplies ``hid`` itself) reaches only its own sample's rows of
    ``out``, ``logits``, ``logp`` and ``q`` (where ``hid`` is the poisoned input)."""
    if poisoned is None or poisoned.split(":")[1] != "hid":
        return []
    hid = kwargs["hid"]
    multiplied = bf16_to_f32(f32_to_bf16(hid)) if kwargs["w2"].dtype == U16 else hid
    bad = ~np.all(np.isfinite(multiplied), axis=1)
    rows = bad.shape[0]
    branches = tuple(int(n) for n in kwargs["n_actions"])
    packed = np.concatenate([np.repeat(bad, n) for n in branches])  # branch-packed (d, b, a)
    problems = []
    if not np.all(np.isfinite(out["out"][~bad])):
        problems.append("'out': a non-finite hidden row leaked into another row")
    for name in ("logits", "logp"):
        if not np.all(np.isfinite(out[name][~packed])):
            problems.append(f"{name!r}: a non-finite hidden row leaked into another sample")
    if kwargs["with_q"] and rows and not np.all(np.isfinite(out["q"][~packed])):
        problems.append("'q': a non-finite hidden row leaked into another sample")
    return problems


def _hod_errors(sample, *extra):
    """The error cases of ``heads_out_dueling_bf16`` / ``_f32`` (``extra``: the kernel's own)."""
    return error_cases(
        sample,
        lambda k: wrong_dtype(k, "hid"),
        *extra,
        lambda k: replace(k, hid=k["hid"][:, 1:].copy()),
        lambda k: replace(k, w2=k["w2"][1:].copy()),
        lambda k: replace(k, z=k["z"][:-1].copy()),
        lambda k: replace(k, hidden=(k["hidden"] + 8).astype(np.int32)),
        lambda k: replace(k, n_actions=np.concatenate([k["n_actions"], k["n_actions"][:1]])),
        lambda k: replace(k, with_q=1),
    )


# ------------------------------------------------ the heads' input gradients into the trunk
#: ``heads_dh2_tf32``'s odd and extremal cases (module docstring): ``(rows, hidden, H2)``.
DH2_ODD = (257, (21, 300, 12), 40)
DH2_EXTREMAL = (5, (16, 8), 16)


def dh2_dims(case: str) -> tuple[int, tuple[int, ...], int]:
    """``(rows, hidden, H2)`` of a shape case (module docstring)."""
    if case == "extremal":
        return DH2_EXTREMAL
    if case == "odd":
        return DH2_ODD
    cfg = DQNConfig.preset(case)
    return cfg.batch_size, (cfg.value_h,) + (cfg.adv_h,) * cfg.n_branches, cfg.shared_h2


def dh2_sample(d: Dims, rng) -> Kwargs:
    """Keyword arguments of ``heads_dh2_tf32`` for shape case ``d.case`` (module docstring)."""
    rows, hidden, h2 = dh2_dims(d.case)
    dhid = rng.standard_normal((rows, sum(hidden))) * 1e-2
    dhid[rng.random(dhid.shape) < 0.5] = 0.0  # the hidden ReLU's zeros
    pre = rng.standard_normal((rows, h2)).astype(F32)
    return {"dhid": dhid.astype(F32),
            "w1": np.concatenate([rng.uniform(-1, 1, (w, h2)) * GAIN / np.sqrt(h2)
                                  for w in hidden]).astype(F32),
            "hidden": np.array(hidden, np.int32), "h2": np.clip(pre, -1.5, 1.5).astype(F32),
            "h2_pre": pre}


def _dh2_scales(kwargs: Kwargs, expected) -> dict:
    """The GEMM policy's operands of both outputs (module docstring); ``out``'s masked
    elements exact; ``overflow`` where the finite products' magnitudes add up past float32's
    range (the order then decides: no contract)."""
    a, b = tf32_round(kwargs["dhid"]), tf32_round(kwargs["w1"])
    pre, h2 = kwargs["h2_pre"], kwargs["h2"]
    overflow = product_overflow(a, b)
    with np.errstate(invalid="ignore"):
        masked = ~(pre > 0) | (h2 != pre)  # h2_grad_sum_mask's zeros (a NaN pre among them)
    return {"dh2": {"a": a, "b": b, "overflow": overflow},
            "out": {"a": a, "b": b, "exact": masked, "overflow": overflow & ~masked}}


ENTRIES = (
    SpecEntry(
        name="trunk_forward_bf16",
        outputs={"h1": f32(GEMM), "aux1": Output("uint8", MASK), "h1_bf16": u16(BITS),
                 "h2pre": f32(GEMM), "aux2": Output("uint8", MASK), "h2": f32(GEMM),
                 "h2_bf16": u16(BITS)},
        sample=_sample,
        targets=("xb", "w1", "b1", "w2", "b2", "isv"),
        errors=error_cases(
            _sample,
            lambda k: wrong_dtype(k, "xb"),
            lambda k: replace(k, xb=k["xb"][:, :8].copy(), w1=k["w1"][:, :8].copy()),
            lambda k: replace(k, w2=k["w2"][:8].copy(), b2=k["b2"][:8].copy()),
            lambda k: replace(k, w1=k["w1"][:, 1:].copy()),
            lambda k: replace(k, index=k["isv"].shape[0]),
            lambda k: replace(k, with_aux=1),
        ),
        scales=_scales,
        contract=all_of(finite_outputs("h2"), rows_stay("xb", ("h1", "h2pre"), "state")),
    ),
    SpecEntry(
        name="heads_forward_bf16",
        outputs={"hid": f32(GEMM), "hid_bf16": u16(BITS), "out": f32(GEMM)},
        sample=_heads_sample,
        targets=("h2b", "w1", "b1", "w2", "b2"),
        errors=error_cases(
            _heads_sample,
            lambda k: wrong_dtype(k, "h2b"),
            lambda k: replace(k, h2b=k["h2b"][:, :8].copy(), w1=k["w1"][:, :8].copy()),
            lambda k: replace(k, w1=k["w1"][1:].copy()),
            lambda k: replace(k, out=np.concatenate([k["out"], k["out"][:1]])),
            lambda k: replace(k, hidden=(k["hidden"] + 8).astype(np.int32)),
            lambda k: replace(k, out=k["out"].astype(np.int64)),
        ),
        scales=_heads_scales,
        contract=rows_stay("h2b", ("hid", "out"), "h2 row"),
    ),
    SpecEntry(
        name="heads_out_dueling_bf16",
        outputs={"hid_bf16": u16(BITS), "out": f32(GEMM), "logits": f32(REDUCTION),
                 "logp": f32(REDUCTION), "q": f32(REDUCTION)},
        sample=_hod_sample,
        targets=("hid", "w2", "b2", "z"),
        errors=_hod_errors(_hod_sample),
        scales=_hod_scales,
        contract=hod_rows_stay,
    ),
    SpecEntry(
        name="heads_out_dueling_f32",
        outputs={"out": f32(GEMM), "logits": f32(REDUCTION), "logp": f32(REDUCTION),
                 "q": f32(REDUCTION)},
        sample=_hod_f32_sample,
        targets=("hid", "w2", "b2", "z"),
        errors=_hod_errors(_hod_f32_sample, lambda k: wrong_dtype(k, "w2")),
        scales=_hod_scales,
        contract=hod_rows_stay,
    ),
    SpecEntry(
        name="heads_dh2_tf32",
        outputs={"dh2": f32(GEMM), "out": f32(GEMM)},
        sample=dh2_sample,
        targets=("dhid", "w1", "h2_pre"),
        errors=error_cases(
            dh2_sample,
            lambda k: wrong_dtype(k, "dhid"),
            lambda k: wrong_dtype(k, "w1"),
            lambda k: replace(k, dhid=k["dhid"][:, 1:].copy()),
            lambda k: replace(k, w1=k["w1"][:, 1:].copy()),
            lambda k: replace(k, h2=k["h2"][:-1].copy()),
            lambda k: replace(k, hidden=np.zeros(0, np.int32)),
            lambda k: replace(k, hidden=np.array([16, 0], np.int32)),
        ),
        scales=_dh2_scales,
    ),
)
