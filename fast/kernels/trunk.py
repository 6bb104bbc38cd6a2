"""Fast launchers of the fused MLP forwards (``cuda_src/trunk.cu``): the trunk (reference twin
``foxhunt.reference.kernels.trunk.trunk_forward_bf16``, the four nodes it replaces) and the heads
(``heads_forward_bf16``, the nine nodes of a pass's heads up to the dueling combine: below
the trunk's sections).

``plan_trunk_forward_bf16(rows, SD, H1, H2)`` gives the launch ``(grid, block, shared_mem)``:
grid ``(cluster, ceil(rows / TRUNK_ROWS_PER_BLOCK))`` of ``TRUNK_THREADS`` threads, one
thread-block cluster (``cluster_blocks(arch)``: 8 blocks from sm_90, 1 before) per 16 rows, each
cluster block computing its slice of every layer's columns, and the dynamic shared memory of
:func:`trunk_shared_bytes` (trunk.cu's layout: the block's xb tile, the cluster's whole h1_bf16
tile, then the block's W1 and W2 slices whole where they are at most ``TRUNK_COLS_PER_PASS``
columns (:func:`trunk_resident`: widths up to 512 on sm_90), else ``TRUNK_STAGES`` W staging
buffers; every row padded by ``TRUNK_PAD`` BF16). Above
``SHARED_LIMIT`` (48 KiB; the seed shapes need 37.5 KiB) the kernel needs the opt-in attribute
(``Kernel.set_max_dynamic_shared``): the graph lowering sets it from a launch record's shape
(``fast.graph_lowering``), the test entry here before its launch. Shapes the kernel cannot run
raise one ``ValueError`` naming the field, the value and the rule
(``reference.kernels.trunk.check_trunk_dims``; too wide for one block's shared memory on the
architecture: :data:`foxhunt.fast.kernels.walk.SHARED_OPTIN`).

Kernel parameters (C order): ``xb, w1, b1, w2, b2, h1, aux1, h1_bf16, h2pre, aux2, h2, h2_bf16,
rows, sd, h1_width, h2_width, isv, index, mult``; ``aux1`` / ``aux2`` may be null (no bitmask).

Numerics: the GEMMs accumulate in the tensor cores' order, so ``h1`` / ``h2pre`` / ``h2`` are
within the GEMM bound of the twin's, not bitwise (``conformance/specs/trunk.py``).

Speed (``benches/bench_kernels.py`` group ``trunk-forward-<rows>``, seed widths, ``gpu_us``
inside a CUDA graph, 256 / 512 rows): session 15's version, one block per 16 rows streaming all
of W1 and W2, took 15.9 / 15.9 us against 8.4 / 8.7 us for the four nodes it replaces (H200,
session 19, call A); split over clusters it takes 6.3 / 7.7 us against 8.4 / 8.8 (H200, call B)
and 6.5 / 7.8 against 8.5 / 9.0 (H100, call C, where 32 rows per block took 7.0 / 8.6 and 64
rows 10.2 / 10.3), and 5.9 / 7.3 us once its copy loops lost their divisions (H200, call G).
In the step it is off by default (``Trainer(..., fused_trunk=True)`` turns it on;
``fast.step_program``): the core bf16 step measured 124.7 / 125.0 us with it against 126.8 /
125.7 without on the H200 (call B), 125.7 / 124.9 against 125.7 / 125.6 (call G), 129.2 / 129.6
against 128.7 / 128.6 on the H100 (call C), and the step with every second-wave source 1-2 us
slower (calls B, C).

The heads (``plan_heads_forward_bf16(rows, H2, hidden, out)``): grid ``(cluster, ceil(rows /
16))`` of ``HEADS_THREADS`` (8 warps, one n8 tile of each layer a warp), shared memory of
:func:`heads_shared_bytes`; the step passes the weights' element offsets in a table
(:func:`heads_table`, the constant ``head_table``) and the test entry lays the heads out in a
parameter buffer of its own. Speed (H200, session 27, the README's "The heads' forward in one
kernel"): 13.3 / 10.4 us a launch in the step's graph (512 / 256 rows) against 10.4 us for the
nine nodes' part of the online pass's chain; the bf16 step with ``fused_heads=True`` took 118.2
us against 114.7 us without, so it is off by default.

The heads' outputs with the dueling log-softmax (``plan_heads_out_dueling_bf16(rows, hidden, out,
branches, NA)``): grid ``(ceil(rows / 16), n_branches)`` of ``HOD_THREADS`` (16 warps), shared
memory of :func:`hod_shared_bytes` (at most ``SHARED_LIMIT``: no opt-in); shapes it cannot run
(:func:`check_heads_out_dueling`) raise one ``ValueError``, and the step then keeps the nodes
(:func:`hod_fusable`). The BF16 training passes use it by default (``fast.step_program``'s
``FUSE_HEAD_OUTPUTS``; the README's "The heads' outputs and the dueling log-softmax in one
launch" has its figures). Its f32 twin ``heads_out_dueling_f32``
(``plan_heads_out_dueling_f32``, the same grid, blocks of ``HODF_THREADS``: 32 warps of one n8
tile each) keeps the f32 hidden tiles and both heads' whole W2 in shared memory (rows padded by
``HODF_PAD``; 137,664 bytes at the seed shapes, opted in up to the architecture's limit:
:func:`hod_shared_limit`) and can end the f32 step's training passes (``HOD_KERNELS`` names each
precision's kernel); off by default (``FUSE_HEAD_OUTPUTS``: every version so far measured slower
than the nodes; the README's "The f32 heads' outputs from shared memory").

The heads' input gradients into the trunk (``plan_heads_dh2_tf32(rows, H2, hidden)``,
``heads_dh2_tf32``, the TF32 backward's part GEMMs and ``h2_grad_sum_mask`` in one launch): a
thread-block cluster a 64 x 64 output tile (its blocks share the heads and split each head's k;
the partial tiles are summed through distributed shared memory), blocks of
``HEADS_DH2_THREADS``, shared memory of :func:`heads_dh2_shared_bytes`. The step reads the heads'
W1 through the table and the hidden gradients from its packed ``dhid`` (``hid_align`` the step's
``OPERAND_ALIGN``); the test entry lays them out the same way (:func:`place_w1`,
:func:`pack_hidden`).

Kernel parameters (C order): ``dhid, params, table, h2, h2_pre, dh2_out, out, rows, h2_width,
n_heads, hid_align``.
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.kernels._runtime import In, Out, blocks, cluster_blocks, launch, runtime
from foxhunt.fast.kernels.walk import SHARED_LIMIT, SHARED_OPTIN, shared_optin
from foxhunt.reference.kernels.argcheck import check_int
from foxhunt.reference.kernels.step import TrunkGrad
from foxhunt.reference.kernels.trunk import (
    HEADS_FIELDS,
    TRUNK_WIDTH_MULTIPLE,
    HeadsForward,
    HeadsOutDueling,
    HeadsOutDuelingF32,
    TrunkForward,
    aux_row_bytes,
    check_heads_dims,
    check_heads_out_dims,
    check_heads_dh2_dims,
    check_trunk_dims,
    heads_packed_offsets,
    validate_heads_dh2_tf32,
    validate_heads_forward_bf16,
    validate_heads_out_dueling,
    validate_trunk_forward_bf16,
)

F32, U8, U16 = np.float32, np.uint8, np.uint16

#: trunk.cu's TRUNK_MT (m16 tiles per block; TRUNK_BM = 16 TRUNK_MT rows), TRUNK_THREADS,
#: TRUNK_NCH (output columns per pass), TRUNK_KC (k per staged W chunk), TRUNK_STAGES and
#: TRUNK_PAD (``tests/test_kernels_trunk.py`` reads them back from the source).
TRUNK_M_TILES = 1
TRUNK_ROWS_PER_BLOCK = 16 * TRUNK_M_TILES
TRUNK_THREADS = 128
TRUNK_COLS_PER_PASS = 64
TRUNK_K_CHUNK = 64
TRUNK_STAGES = 3
TRUNK_PAD = 8
BF16_BYTES = 2
#: The architecture a plan is made for when none is named: the performance target (H200).
DEFAULT_ARCH = 90

Plan = tuple


def trunk_slice(width: int, cluster: int) -> int:
    """Columns of a layer ``width`` wide per cluster block (trunk.cu's ``trunk_slice``): ``ceil(width
    / (8 cluster))`` n8 tiles."""
    return -(-width // (8 * cluster)) * 8


def trunk_resident(h1: int, h2: int, cluster: int) -> bool:
    """Whether the kernel copies its W slices whole (both slices at most ``TRUNK_COLS_PER_PASS``
    columns) instead of streaming them in ``TRUNK_K_CHUNK`` chunks (trunk.cu)."""
    return max(trunk_slice(h1, cluster), trunk_slice(h2, cluster)) <= TRUNK_COLS_PER_PASS


def trunk_fusable(sd: int, h1: int, h2: int, arch) -> bool:
    """Whether the step runs its trunk as this kernel on ``arch``: thread-block clusters (sm_90
    and newer), widths the kernel takes (multiples of 16) and W slices it keeps whole
    (:func:`trunk_resident`); elsewhere the four nodes are faster (module docstring)."""
    cluster = cluster_blocks(arch)
    widths_ok = all(w >= TRUNK_WIDTH_MULTIPLE and w % TRUNK_WIDTH_MULTIPLE == 0 for w in (sd, h1, h2))
    return cluster > 1 and widths_ok and trunk_resident(h1, h2, cluster)


def trunk_shared_bytes(sd: int, h1: int, h2: int, cluster: int) -> int:
    """Dynamic shared memory of one block (trunk.cu): the xb tile ``BM x (SD + PAD)``, the
    h1_bf16 tile ``BM x (H1 + PAD)``, then resident (:func:`trunk_resident`) the block's W1 and W2
    slices ``s1 x (SD + PAD)`` and ``s2 x (H1 + PAD)``, else ``STAGES`` W chunks ``NCH x (KC +
    PAD)``; all BF16."""
    elems = TRUNK_ROWS_PER_BLOCK * (sd + TRUNK_PAD) + TRUNK_ROWS_PER_BLOCK * (h1 + TRUNK_PAD)
    if trunk_resident(h1, h2, cluster):
        elems += (trunk_slice(h1, cluster) * (sd + TRUNK_PAD)
                  + trunk_slice(h2, cluster) * (h1 + TRUNK_PAD))
    else:
        elems += TRUNK_STAGES * TRUNK_COLS_PER_PASS * (TRUNK_K_CHUNK + TRUNK_PAD)
    return elems * BF16_BYTES


def plan_trunk_forward_bf16(rows: int, sd: int, h1: int, h2: int, *, arch=DEFAULT_ARCH) -> Plan:
    """``((cluster, ceil(rows / 16)), (128,), trunk_shared_bytes(SD, H1, H2, cluster))`` with
    ``cluster = cluster_blocks(arch)``; ``ValueError`` for widths that are not multiples of 16 or need more
    shared memory than ``arch`` offers."""
    rows, sd, h1, h2 = check_trunk_dims(rows, sd, h1, h2)
    cluster = cluster_blocks(arch)
    nbytes = _within_shared_limit(trunk_shared_bytes(sd, h1, h2, cluster), arch,
                                  f"SD + H1={sd + h1}: the fused trunk kernel")
    return (cluster, blocks(rows, TRUNK_ROWS_PER_BLOCK)), (TRUNK_THREADS,), nbytes


def _within_shared_limit(nbytes: int, arch, what: str) -> int:
    """``nbytes``, or ``ValueError`` ("<what> needs N bytes ...") where one block of ``arch``
    cannot have that much dynamic shared memory (:data:`SHARED_OPTIN`)."""
    from foxhunt.fast._build import normalize_arch

    limit = SHARED_OPTIN.get(normalize_arch(arch), min(SHARED_OPTIN.values()))
    if nbytes > limit:
        raise ValueError(f"{what} needs {nbytes} bytes of shared memory per block; "
                         f"sm_{normalize_arch(arch)} allows {limit}")
    return nbytes


def trunk_forward_bf16(xb, w1, b1, w2, b2, isv, index, mult, with_aux: bool = True) -> TrunkForward:
    """Test entry of the CUDA ``trunk_forward_bf16`` (contract as the reference twin); without
    ``with_aux`` the kernel gets null bitmask pointers and ``aux1`` / ``aux2`` come back empty."""
    rows, sd, h1, h2, index, mult = validate_trunk_forward_bf16(xb, w1, b1, w2, b2, isv, index,
                                                               mult, with_aux)
    rt = runtime()
    plan = plan_trunk_forward_bf16(rows, sd, h1, h2, arch=rt.device.arch)
    aux1 = Out((rows, aux_row_bytes(h1)), U8) if with_aux else 0
    aux2 = Out((rows, aux_row_bytes(h2)), U8) if with_aux else 0
    outs = list(launch("trunk_forward_bf16", plan, In(xb), In(w1), In(b1), In(w2), In(b2),
                       Out((rows, h1), F32), aux1, Out((rows, h1), U16), Out((rows, h2), F32),
                       aux2, Out((rows, h2), F32), Out((rows, h2), U16), rows, sd, h1, h2,
                       In(isv), index, mult))
    if not with_aux:
        empty = np.zeros(0, U8)
        outs = [outs[0], empty, outs[1], outs[2], empty, outs[3], outs[4]]
    return TrunkForward(*outs)


# ---------------------------------------------------------------------------------------------
# heads_forward_bf16 (trunk.cu): the heads' first layers, f32_to_bf16 and second layers in one
# launch, resident only.
# ---------------------------------------------------------------------------------------------
#: W offsets must be multiples of this many elements (16-byte cp.async of BF16).
HEADS_W_ALIGN = 8
#: trunk.cu's HEADS_WARPS: one n8 tile of each layer per warp, so a cluster block computes at
#: most 8 HEADS_WARPS columns of a layer (``tests/test_kernels_heads.py`` reads it back).
HEADS_WARPS = 8
HEADS_THREADS = 32 * HEADS_WARPS
HEADS_COLS_PER_BLOCK = 8 * HEADS_WARPS


def heads_widths(hidden, out) -> tuple[int, int, int]:
    """``(HT, VT, Hmax)``: the heads' hidden columns side by side, their output columns each
    padded to a multiple of 8 (trunk.cu's virtual columns), the widest hidden layer."""
    return sum(hidden), sum(-(-o // 8) * 8 for o in out), max(hidden)


def heads_resident(hidden, out, cluster: int) -> bool:
    """Whether one cluster block's share of each layer is at most a tile a warp (the kernel's
    only path)."""
    ht, vt, _ = heads_widths(hidden, out)
    return max(trunk_slice(ht, cluster), trunk_slice(vt, cluster)) <= HEADS_COLS_PER_BLOCK


def heads_fusable(h2: int, hidden, out, arch) -> bool:
    """Whether the step runs its heads' forward as ``heads_forward_bf16`` on ``arch``:
    thread-block clusters (sm_90 and newer), widths the kernel takes (``check_heads_dims``) and
    slices it keeps whole (:func:`heads_resident`)."""
    try:
        hidden, out = check_heads_dims(h2, hidden, out)
    except ValueError:
        return False
    cluster = cluster_blocks(arch)
    return cluster > 1 and heads_resident(hidden, out, cluster)


def heads_shared_bytes(h2: int, hidden, out, cluster: int) -> int:
    """Dynamic shared memory of one block (trunk.cu): the h2 tile ``BM x (H2 + PAD)``, the
    cluster's hid tile ``BM x (HT + PAD)``, then the block's W1 rows ``s1 x (H2 + PAD)`` and, in
    their place after layer 1, its W2 rows ``s2 x (Hmax + PAD)``; all BF16."""
    ht, vt, hmax = heads_widths(hidden, out)
    elems = (TRUNK_ROWS_PER_BLOCK * (h2 + TRUNK_PAD) + TRUNK_ROWS_PER_BLOCK * (ht + TRUNK_PAD)
             + max(trunk_slice(ht, cluster) * (h2 + TRUNK_PAD),
                   trunk_slice(vt, cluster) * (hmax + TRUNK_PAD)))
    return elems * BF16_BYTES


def plan_heads_forward_bf16(rows: int, h2: int, hidden, out, *, arch=DEFAULT_ARCH) -> Plan:
    """``((cluster, ceil(rows / 16)), (HEADS_THREADS,), heads_shared_bytes(...))``;
    ``ValueError`` for shapes the kernel cannot run: widths (``check_heads_dims``), a share of
    either layer wider than a block's warps (``HT`` or the padded ``VT`` above ``cluster *
    HEADS_COLS_PER_BLOCK``: 512 on sm_90), or more shared memory than ``arch`` offers."""
    from foxhunt.fast._build import normalize_arch

    rows = check_int("rows", rows, minimum=1)
    hidden, out = check_heads_dims(h2, hidden, out)
    cluster = cluster_blocks(arch)
    if not heads_resident(hidden, out, cluster):
        ht, vt, _ = heads_widths(hidden, out)
        raise ValueError(f"hidden={hidden}, out={out}: the fused heads kernel keeps at most "
                         f"{cluster * HEADS_COLS_PER_BLOCK} hidden and padded output columns on "
                         f"sm_{normalize_arch(arch)} (clusters of {cluster}); got {ht} and {vt}")
    nbytes = _within_shared_limit(heads_shared_bytes(h2, hidden, out, cluster), arch,
                                  f"H2={h2}: the fused heads kernel")
    return (cluster, blocks(rows, TRUNK_ROWS_PER_BLOCK)), (HEADS_THREADS,), nbytes


def heads_table(hidden, out, offsets) -> np.ndarray:
    """The kernel's table ``int32 [n_heads, HEADS_FIELDS]`` from the widths and each head's
    ``(w1, b1, w2, b2)`` element offsets; ``ValueError`` for a W offset the kernel's 16-byte
    copies cannot read."""
    rows = []
    for h, (width, o, offs) in enumerate(zip(hidden, out, offsets)):
        for name, off in (("w1", offs[0]), ("w2", offs[2])):
            if off % HEADS_W_ALIGN:
                raise ValueError(f"head {h}'s {name} offset {off}: the fused heads kernel needs a "
                                 f"multiple of {HEADS_W_ALIGN} elements")
        rows.append((width, o, *offs))
    return np.array(rows, np.int32).reshape(len(rows), HEADS_FIELDS)


def place_heads(hidden, out, w2, b2, w1=None, b1=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The test entries' parameter set: the heads' tensors one after another (each start a
    multiple of ``HEADS_W_ALIGN``), the BF16 weights in a mirror, the f32 biases (and a float32
    ``w2``: ``heads_out_dueling_f32``'s) in a parameter buffer of the same length, given side by
    side (``w2 [OT, max(hidden)]``, a head's first ``hidden[h]`` columns placed); ``(mirror,
    params, table)``. Without ``w1`` / ``b1`` (``[HT,
    H2]`` / ``[HT]``; ``heads_out_dueling_bf16`` reads neither) they take no room."""
    h2 = 0 if w1 is None else w1.shape[1]
    offsets, end = [], 0
    for width, o in zip(hidden, out):
        head = []
        for size in (width * h2, 0 if b1 is None else width, o * width, o):
            head.append(end)
            end = -(-(end + size) // HEADS_W_ALIGN) * HEADS_W_ALIGN
        offsets.append(head)
    mirror, params = np.zeros(max(end, 1), U16), np.zeros(max(end, 1), F32)
    h0 = o0 = 0
    for (w1o, b1o, w2o, b2o), width, o in zip(offsets, hidden, out):
        if w1 is not None:
            mirror[w1o:w1o + width * h2] = w1[h0:h0 + width].ravel()
        if b1 is not None:
            params[b1o:b1o + width] = b1[h0:h0 + width]
        (params if w2.dtype == F32 else mirror)[w2o:w2o + o * width] = w2[o0:o0 + o, :width].ravel()
        params[b2o:b2o + o] = b2[o0:o0 + o]
        h0, o0 = h0 + width, o0 + o
    return mirror, params, heads_table(hidden, out, offsets)


def heads_forward_bf16(h2b, w1, b1, w2, b2, hidden, out) -> HeadsForward:
    """Test entry of the CUDA ``heads_forward_bf16`` (contract as the reference twin): the heads'
    tensors are placed one after another in a parameter buffer (BF16 weights, f32 biases), the
    kernel writes the step's packed layout (``hid_align`` the step's ``OPERAND_ALIGN``) and the
    outputs are returned side by side."""
    from foxhunt.fast.step_layout import OPERAND_ALIGN

    rows, h2, hid_w, outs = validate_heads_forward_bf16(h2b, w1, b1, w2, b2, hidden, out)
    mirror, params, table = place_heads(hid_w, outs, w2, b2, w1, b1)
    hid_off, hid_total, adv_off, adv_total = heads_packed_offsets(hid_w, outs, rows, OPERAND_ALIGN)
    rt = runtime()
    plan = plan_heads_forward_bf16(rows, h2, hid_w, outs, arch=rt.device.arch)
    hid, hid_bf16, v, adv = launch(
        "heads_forward_bf16", plan, In(h2b), In(mirror), In(params), In(table),
        Out((max(hid_total, 1),), F32), Out((max(hid_total, 1),), U16), Out((rows, outs[0]), F32),
        Out((max(adv_total, 1),), F32), rows, h2, len(hid_w), OPERAND_ALIGN)
    return HeadsForward(*unpack_heads(hid_w, outs, rows, hid_off, adv_off, hid, hid_bf16, v, adv))


# ---------------------------------------------------------------------------------------------
# heads_out_dueling_bf16 / heads_out_dueling_f32 (trunk.cu): (f32_to_bf16 of the hidden values,)
# the heads' second layers and dueling_log_softmax_q_branches in one launch; a block per 16 rows
# and branch.
# ---------------------------------------------------------------------------------------------
#: trunk.cu's HOD_WARPS and HOD_TILES: a block's value-head and branch-head outputs in n8 tiles,
#: at most HOD_TILES a warp (``tests/test_kernels_heads.py`` reads them back).
HOD_WARPS = 16
HOD_THREADS = 32 * HOD_WARPS
HOD_TILES = 2
#: dueling.cuh's register path (kDuelingRegRows, kWarp * kDuelingRegChunks), which the kernel's
#: dueling log-softmax runs: at most this many actions a branch and atoms.
HOD_MAX_ACTIONS = 4
HOD_MAX_ATOMS = 64
#: trunk.cu's HODF_PAD: floats of padding a row of ``heads_out_dueling_f32``'s hidden and W2 tiles.
HODF_PAD = 4
#: trunk.cu's HODF_WARPS and HODF_TILES: ``heads_out_dueling_f32``'s warps a block, n8 tiles a
#: warp.
HODF_WARPS = 32
HODF_THREADS = 32 * HODF_WARPS
HODF_TILES = 1
#: The kernel of each step precision whose training passes end their heads in one launch.
HOD_KERNELS = {"bf16": "heads_out_dueling_bf16", "f32": "heads_out_dueling_f32"}
#: Each precision's kernel block: (warps, n8 tiles a warp).
HOD_BLOCKS = {"bf16": (HOD_WARPS, HOD_TILES), "f32": (HODF_WARPS, HODF_TILES)}


def hod_shared_bytes(hidden, out, precision: str = "bf16") -> int:
    """Dynamic shared memory of one block (trunk.cu), the branch head ``h`` that needs the most:
    BF16, the value head's and head ``h``'s hidden tiles ``BM x (hidden + TRUNK_PAD)`` then
    their f32 output tiles ``BM x out``; f32, the two hidden tiles ``BM x (hidden + HODF_PAD)``,
    the two heads' W2 tiles ``out x (hidden + HODF_PAD)`` (float32), then the output tiles."""
    bm = TRUNK_ROWS_PER_BLOCK
    if precision == "bf16":
        return max(BF16_BYTES * bm * (hidden[0] + hidden[h] + 2 * TRUNK_PAD)
                   + 4 * bm * (out[0] + out[h]) for h in range(1, len(hidden)))
    return max(4 * ((bm + out[0]) * (hidden[0] + HODF_PAD) + (bm + out[h]) * (hidden[h] + HODF_PAD)
                    + bm * (out[0] + out[h])) for h in range(1, len(hidden)))


def hod_shared_limit(precision: str, arch=None) -> int:
    """The most dynamic shared memory a block of ``HOD_KERNELS[precision]`` may use: BF16, 48
    KiB (``SHARED_LIMIT``, no opt-in); f32, the opt-in of ``arch``
    (:data:`foxhunt.fast.kernels.walk.SHARED_OPTIN`; ``None``: any architecture the step runs
    on, the smallest of them)."""
    if precision == "bf16":
        return SHARED_LIMIT
    return shared_optin(arch) if arch is not None else min(SHARED_OPTIN.values())


def check_heads_out_dueling(hidden, out, branches, num_atoms, precision: str = "bf16",
                            arch=None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape rule of ``heads_out_dueling_bf16`` / ``heads_out_dueling_f32`` (``precision``;
    trunk.cu's header) on ``arch``: the reference's (``check_heads_out_dims``), then the kernel's
    limits (the register path's actions and atoms, n8 tiles a block, shared memory:
    :func:`hod_shared_limit`); one ``ValueError`` naming the field, the value and the rule;
    returns ``(hidden, out)``."""
    kernel = HOD_KERNELS[precision]
    hidden, out, branches = check_heads_out_dims(hidden, out, branches, num_atoms, kernel)
    if not 1 <= num_atoms <= HOD_MAX_ATOMS:
        raise ValueError(f"num_atoms={num_atoms}: {kernel} runs the dueling "
                         f"log-softmax's register path (1 to {HOD_MAX_ATOMS} atoms)")
    for d, n in enumerate(branches):
        if not 1 <= n <= HOD_MAX_ACTIONS:
            raise ValueError(f"n_actions[{d}]={n}: {kernel} runs the dueling "
                             f"log-softmax's register path (1 to {HOD_MAX_ACTIONS} actions)")
    tiles = max(-(-out[0] // 8) + -(-o // 8) for o in out[1:])
    warps, per_warp = HOD_BLOCKS[precision]
    most = warps * per_warp
    if tiles > most:
        raise ValueError(f"out={out}: {kernel} computes at most "
                         f"{most} n8 tiles a block; the value head and a branch need {tiles}")
    nbytes = hod_shared_bytes(hidden, out, precision)
    limit = hod_shared_limit(precision, arch)
    if nbytes > limit:
        raise ValueError(f"hidden={hidden}: {kernel} needs {nbytes} bytes of "
                         f"shared memory per block; it runs with at most {limit}")
    return hidden, out


def hod_fusable(hidden, out, branches, num_atoms, precision: str = "bf16", arch=None) -> bool:
    """Whether a pass's heads can end in ``HOD_KERNELS[precision]`` on ``arch``
    (:func:`check_heads_out_dueling`; ``None``: any architecture the step runs on, sm_80 and
    newer); False for a precision without a kernel (tf32)."""
    if precision not in HOD_KERNELS:
        return False
    try:
        check_heads_out_dueling(hidden, out, branches, num_atoms, precision, arch)
    except ValueError:
        return False
    return True


def _plan_hod(precision: str, rows: int, hidden, out, branches, num_atoms: int, arch) -> Plan:
    rows = check_int("rows", rows, minimum=1)
    hidden, out = check_heads_out_dueling(hidden, out, branches, num_atoms, precision, arch)
    return ((blocks(rows, TRUNK_ROWS_PER_BLOCK), len(hidden) - 1), (32 * HOD_BLOCKS[precision][0],),
            hod_shared_bytes(hidden, out, precision))


def plan_heads_out_dueling_bf16(rows: int, hidden, out, branches, num_atoms: int,
                                arch=None) -> Plan:
    """``((ceil(rows / 16), n_branches), (HOD_THREADS,), hod_shared_bytes(...))``; ``ValueError``
    for shapes the kernel cannot run on ``arch`` (:func:`check_heads_out_dueling`)."""
    return _plan_hod("bf16", rows, hidden, out, branches, num_atoms, arch)


def plan_heads_out_dueling_f32(rows: int, hidden, out, branches, num_atoms: int,
                               arch=None) -> Plan:
    """As :func:`plan_heads_out_dueling_bf16`, with the f32 kernel's block (``HODF_THREADS``)
    and shared memory (opted in above 48 KiB: the graph lowering sets the attribute from the
    record's shape)."""
    return _plan_hod("f32", rows, hidden, out, branches, num_atoms, arch)


def _launch_hod(precision: str, hid, w2, b2, z, hidden, out, n_actions, with_q):
    """The test entries' launch: the heads' W2 and b2 placed one after another in a parameter
    buffer (``place_heads``), the hidden values in the step's packed layout (``hid_align`` the
    step's ``OPERAND_ALIGN``); ``(rows, hidden, out, hid_off, adv_off, outputs, with_q)``."""
    from foxhunt.fast.step_layout import OPERAND_ALIGN
    from foxhunt.reference.kernels.fused import branch_offsets

    kernel = HOD_KERNELS[precision]
    rows, hid_w, outs, branches, with_q = validate_heads_out_dueling(
        hid, w2, b2, z, hidden, out, n_actions, with_q, kernel=kernel)
    na = int(z.shape[0])
    plan = _plan_hod(precision, rows, hid_w, outs, branches, na, runtime().device.arch)
    mirror, params, table = place_heads(hid_w, outs, w2, b2)
    hid_off, hid_total, adv_off, adv_total = heads_packed_offsets(hid_w, outs, rows, OPERAND_ALIGN)
    packed = pack_hidden(hid_w, hid, hid_off)
    total = sum(branches)
    weights = [In(mirror), In(params)] if precision == "bf16" else [In(params)]
    hid_bf16 = [Out((max(hid_total, 1),), U16)] if precision == "bf16" else []
    outputs = launch(
        kernel, plan, In(packed), *weights, In(table), In(z), In(np.array(branches, np.int32)),
        In(np.array(branch_offsets(branches), np.int32)), *hid_bf16, Out((rows, na), F32),
        Out((max(adv_total, 1),), F32), Out((rows * total, na), F32), Out((rows * total, na), F32),
        Out((rows * total if with_q else 1,), F32), rows, len(hid_w), OPERAND_ALIGN, na,
        int(with_q))
    return rows, hid_w, outs, hid_off, adv_off, outputs, with_q


def heads_out_dueling_bf16(hid, w2, b2, z, hidden, out, n_actions, with_q) -> HeadsOutDueling:
    """Test entry of the CUDA ``heads_out_dueling_bf16`` (contract as the reference twin): the
    heads' W2 and b2 placed one after another in a parameter buffer, the hidden values in the
    step's packed layout (``hid_align`` the step's ``OPERAND_ALIGN``); the outputs side by side
    as the twin's."""
    rows, hid_w, outs, hid_off, adv_off, outputs, with_q = _launch_hod(
        "bf16", hid, w2, b2, z, hidden, out, n_actions, with_q)
    hid_bf16, v, adv, logits, logp, q = outputs
    return HeadsOutDueling(unpack_hidden(hid_w, rows, hid_off, hid_bf16),
                           unpack_out(outs, rows, adv_off, v, adv), logits, logp,
                           q if with_q else np.zeros(0, F32))


def heads_out_dueling_f32(hid, w2, b2, z, hidden, out, n_actions, with_q) -> HeadsOutDuelingF32:
    """Test entry of the CUDA ``heads_out_dueling_f32`` (contract as the reference twin; the
    placement of :func:`heads_out_dueling_bf16`'s, W2 in the f32 parameter buffer)."""
    rows, hid_w, outs, hid_off, adv_off, outputs, with_q = _launch_hod(
        "f32", hid, w2, b2, z, hidden, out, n_actions, with_q)
    v, adv, logits, logp, q = outputs
    return HeadsOutDuelingF32(unpack_out(outs, rows, adv_off, v, adv), logits, logp,
                              q if with_q else np.zeros(0, F32))


def _blocks_of(flat, rows, offsets, widths) -> list:
    return [flat[s:s + rows * w].reshape(rows, w) for s, w in zip(offsets, widths)]


def pack_hidden(hidden, side_by_side: np.ndarray, hid_off) -> np.ndarray:
    """The heads' blocks of ``side_by_side [rows, sum(hidden)]`` (float32) in a packed buffer,
    head h's at ``hid_off[h]`` (``heads_packed_offsets``; zeros between): the inverse of
    :func:`unpack_hidden`."""
    rows = side_by_side.shape[0]
    packed = np.zeros(max(max(o + rows * w for o, w in zip(hid_off, hidden)), 1), F32)
    h0 = 0
    for off, width in zip(hid_off, hidden):
        packed[off:off + rows * width] = side_by_side[:, h0:h0 + width].ravel()
        h0 += width
    return packed


def unpack_hidden(hidden, rows, hid_off, flat) -> np.ndarray:
    """A packed hidden buffer (``hid`` or ``hid_bf16``) as the heads' blocks side by side."""
    return np.concatenate(_blocks_of(flat, rows, hid_off, hidden), axis=1)


def unpack_out(out, rows, adv_off, v, adv) -> np.ndarray:
    """The packed ``v`` and ``adv`` as the heads' outputs side by side ``[rows, OT]``."""
    return np.concatenate([v.reshape(rows, out[0])] + _blocks_of(adv, rows, adv_off[1:], out[1:]),
                          axis=1)


def unpack_heads(hidden, out, rows, hid_off, adv_off, hid, hid_bf16, v, adv):
    """The packed buffers as the side-by-side ``(hid, hid_bf16, out)`` of ``HeadsForward``."""
    return (unpack_hidden(hidden, rows, hid_off, hid), unpack_hidden(hidden, rows, hid_off, hid_bf16),
            unpack_out(out, rows, adv_off, v, adv))


# -------------------------------------------------- the heads' input gradients into the trunk
#: trunk.cu's HDH_BM x HDH_BN (the output tile of a cluster), HDH_KC (the k of a staged chunk)
#: and HDH_THREADS (``tests/test_kernels_heads_dh2.py`` reads them back).
HEADS_DH2_TILE = (64, 64)
HEADS_DH2_KC = 64
HEADS_DH2_THREADS = 256


def heads_dh2_shared_bytes() -> int:
    """heads_dh2_tf32's dynamic shared memory (cuda_src/trunk.cu): a chunk of ``HDH_KC`` k of the
    tile's dhid rows and W1 columns (rows padded by 4 and 8 floats), which the block's partial
    tile (``HDH_BM HDH_BN`` floats) reuses: 35,840 bytes, no opt-in."""
    (bm, bn), kc = HEADS_DH2_TILE, HEADS_DH2_KC
    return 4 * max(kc * (bm + 4) + kc * (bn + 8), bm * bn)


def plan_heads_dh2_tf32(rows: int, h2_width: int, hidden, *, arch=DEFAULT_ARCH) -> Plan:
    """``((ceil(H2 / 64) cluster, ceil(rows / 64)), (HDH_THREADS,), heads_dh2_shared_bytes())``
    with ``cluster = cluster_blocks(arch)`` (a cluster a 64 x 64 output tile); one ``ValueError``
    naming the field for sizes the kernel cannot run (:func:`~foxhunt.reference.kernels.trunk.
    check_heads_dh2_dims`)."""
    check_int("rows", rows, minimum=1)
    check_int("H2", h2_width, minimum=1)
    check_heads_dh2_dims(hidden)
    bm, bn = HEADS_DH2_TILE
    return ((blocks(h2_width, bn) * cluster_blocks(arch), blocks(rows, bm)), (HEADS_DH2_THREADS,),
            heads_dh2_shared_bytes())


def heads_dh2_fits(hidden, arch=DEFAULT_ARCH) -> bool:
    """Whether the step runs heads of these hidden widths as ``heads_dh2_tf32`` on ``arch``: sizes
    :func:`plan_heads_dh2_tf32` accepts, on an architecture with clusters (before sm_90 the one
    block would take the heads one after another)."""
    try:
        plan_heads_dh2_tf32(1, 1, hidden, arch=arch)
    except ValueError:
        return False
    return cluster_blocks(arch) > 1


def place_w1(hidden, w1) -> tuple[np.ndarray, np.ndarray]:
    """The test entry's parameter set for ``heads_dh2_tf32``: the heads' float32 W1 blocks
    ``[hidden[h], H2]`` of ``w1 [HT, H2]`` one after another (each start a multiple of
    ``HEADS_W_ALIGN``); ``(params, table)`` (the table's other fields 0: the kernel reads
    ``hidden`` and ``w1``)."""
    h2 = w1.shape[1]
    offsets, end = [], 0
    for width in hidden:
        offsets.append((end, 0, 0, 0))
        end = -(-(end + width * h2) // HEADS_W_ALIGN) * HEADS_W_ALIGN
    params = np.zeros(max(end, 1), F32)
    h0 = 0
    for (w1o, *_), width in zip(offsets, hidden):
        params[w1o:w1o + width * h2] = w1[h0:h0 + width].ravel()
        h0 += width
    return params, heads_table(hidden, [0] * len(hidden), offsets)


def heads_dh2_tf32(dhid, w1, hidden, h2, h2_pre) -> TrunkGrad:
    """Test entry of the CUDA ``heads_dh2_tf32`` (contract as the reference twin): the heads' W1
    placed one after another in a parameter buffer (:func:`place_w1`), the hidden gradients in the
    step's packed layout (``hid_align`` the step's ``OPERAND_ALIGN``)."""
    from foxhunt.fast.step_layout import OPERAND_ALIGN

    rows, hid_w, h2_width = validate_heads_dh2_tf32(dhid, w1, hidden, h2, h2_pre)
    params, table = place_w1(hid_w, w1)
    hid_off = heads_packed_offsets(hid_w, [0] * len(hid_w), rows, OPERAND_ALIGN)[0]
    packed = pack_hidden(hid_w, dhid, hid_off)
    plan = plan_heads_dh2_tf32(rows, h2_width, hid_w, arch=runtime().device.arch)
    dh2, out = launch("heads_dh2_tf32", plan, In(packed), In(params), In(table), In(h2), In(h2_pre),
                      Out((rows, h2_width), F32), Out((rows, h2_width), F32), rows, h2_width,
                      len(hid_w), OPERAND_ALIGN)
    return TrunkGrad(dh2, out)


KERNELS = {"trunk_forward_bf16": trunk_forward_bf16, "heads_forward_bf16": heads_forward_bf16,
           "heads_out_dueling_bf16": heads_out_dueling_bf16,
           "heads_out_dueling_f32": heads_out_dueling_f32, "heads_dh2_tf32": heads_dh2_tf32}
