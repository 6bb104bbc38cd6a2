"""Fast launcher of the fused trunk forward (``cuda_src/trunk.cu``; reference twin:
``foxhunt.reference.kernels.trunk.trunk_forward_bf16``, the four nodes it replaces).

``plan_trunk_forward_bf16(rows, SD, H1, H2)`` gives the launch ``(grid, block, shared_mem)``:
``ceil(rows / TRUNK_ROWS_PER_BLOCK)`` blocks of ``TRUNK_THREADS`` threads and the dynamic shared
memory of :func:`trunk_shared_bytes` (trunk.cu's layout: the block's xb tile, its h1_bf16 tile and
``TRUNK_STAGES`` W staging buffers, every row padded by ``TRUNK_PAD`` BF16). Above
``SHARED_LIMIT`` (48 KiB: the seed shapes need 74 KiB) the kernel needs the opt-in attribute
(``Kernel.set_max_dynamic_shared``): the graph lowering sets it from a launch record's shape
(``fast.graph_lowering``), the test entry here before its launch. Shapes the kernel cannot run
raise one ``ValueError`` naming the field, the value and the rule
(``reference.kernels.trunk.check_trunk_dims``; too wide for one block's shared memory on the
architecture: :data:`foxhunt.fast.kernels.walk.SHARED_OPTIN`).

Kernel parameters (C order): ``xb, w1, b1, w2, b2, h1, aux1, h1_bf16, h2pre, aux2, h2, h2_bf16,
rows, sd, h1_width, h2_width, isv, index, mult``; ``aux1`` / ``aux2`` may be null (no bitmask).

Numerics: the GEMMs accumulate in the tensor cores' order, so ``h1`` / ``h2pre`` / ``h2`` are
within the GEMM bound of the twin's, not bitwise (``conformance/specs/trunk.py``).

Not in the step: measured on the H200 (2026-12-02, ``benches/bench_kernels.py`` group
``trunk-forward-<rows>``, seed widths, inside a CUDA graph) it takes 15.8 us against 8.6 us
(256 rows) and 9.3 us (512 rows) for the four nodes it would replace: 16-row blocks give 16 or
32 blocks, each streaming all of W1 and W2 through its shared memory.
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.kernels._runtime import In, Out, blocks, launch, runtime
from foxhunt.fast.kernels.walk import SHARED_LIMIT, SHARED_OPTIN
from foxhunt.reference.kernels.trunk import (
    TrunkForward,
    aux_row_bytes,
    check_trunk_dims,
    validate_trunk_forward_bf16,
)

F32, U8, U16 = np.float32, np.uint8, np.uint16

#: trunk.cu's TRUNK_BM (rows per block), TRUNK_THREADS, TRUNK_NCH (output columns per pass),
#: TRUNK_KC (k per staged W chunk), TRUNK_STAGES and TRUNK_PAD (``tests/test_kernels_trunk.py``
#: reads them back from the source).
TRUNK_ROWS_PER_BLOCK = 16
TRUNK_THREADS = 256
TRUNK_COLS_PER_PASS = 256
TRUNK_K_CHUNK = 32
TRUNK_STAGES = 3
TRUNK_PAD = 8
BF16_BYTES = 2
#: The architecture a plan is made for when none is named: the performance target (H200).
DEFAULT_ARCH = 90

Plan = tuple


def trunk_shared_bytes(sd: int, h1: int, h2: int) -> int:
    """Dynamic shared memory of one block (trunk.cu): the xb tile ``BM x (SD + PAD)``, the
    h1_bf16 tile ``BM x (H1 + PAD)`` and ``STAGES`` W chunks ``min(NCH, max(H1, H2)) x (KC +
    PAD)``, all BF16."""
    w_rows = min(TRUNK_COLS_PER_PASS, max(h1, h2))
    elems = (TRUNK_ROWS_PER_BLOCK * (sd + TRUNK_PAD) + TRUNK_ROWS_PER_BLOCK * (h1 + TRUNK_PAD)
             + TRUNK_STAGES * w_rows * (TRUNK_K_CHUNK + TRUNK_PAD))
    return elems * BF16_BYTES


def plan_trunk_forward_bf16(rows: int, sd: int, h1: int, h2: int, *, arch=DEFAULT_ARCH) -> Plan:
    """``((ceil(rows / 16),), (256,), trunk_shared_bytes(SD, H1, H2))``; ``ValueError`` for
    widths that are not multiples of 16 or need more shared memory than ``arch`` offers."""
    from foxhunt.fast._build import normalize_arch

    rows, sd, h1, h2 = check_trunk_dims(rows, sd, h1, h2)
    nbytes = trunk_shared_bytes(sd, h1, h2)
    limit = SHARED_OPTIN.get(normalize_arch(arch), min(SHARED_OPTIN.values()))
    if nbytes > limit:
        raise ValueError(f"SD + H1={sd + h1}: the fused trunk kernel needs {nbytes} bytes of "
                         f"shared memory per block; sm_{normalize_arch(arch)} allows {limit}")
    return (blocks(rows, TRUNK_ROWS_PER_BLOCK),), (TRUNK_THREADS,), nbytes


def trunk_forward_bf16(xb, w1, b1, w2, b2, isv, index, mult, with_aux: bool = True) -> TrunkForward:
    """Test entry of the CUDA ``trunk_forward_bf16`` (contract as the reference twin); without
    ``with_aux`` the kernel gets null bitmask pointers and ``aux1`` / ``aux2`` come back empty."""
    rows, sd, h1, h2, index, mult = validate_trunk_forward_bf16(xb, w1, b1, w2, b2, isv, index,
                                                               mult, with_aux)
    rt = runtime()
    plan = plan_trunk_forward_bf16(rows, sd, h1, h2, arch=rt.device.arch)
    if plan[2] > SHARED_LIMIT:
        rt.module.kernel("trunk_forward_bf16").set_max_dynamic_shared(plan[2])
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


KERNELS = {"trunk_forward_bf16": trunk_forward_bf16}
