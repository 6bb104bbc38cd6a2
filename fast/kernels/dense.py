"""Fast-path launchers of the dense kernels (``cuda_src/dense.cu``; reference:
``foxhunt.reference.kernels.dense``).

Each public function has the reference's name and signature, validates with the reference's
own ``validate_<name>`` (or check), so bad input raises the same ``ValueError``, runs the CUDA
kernel once through :func:`foxhunt.fast.kernels._runtime.call` and returns the reference's
structure, shapes and dtypes. ``plan_<name>(...)`` gives ``(grid, block, shared_mem)`` for a
launch; the trainer reuses it with arena pointers. Kernel parameters (C order):

- ``add_bias_relu(y, b, out, rows, cols)``; ``add_bias_relu_bf16(y, b, out, out_bf16, rows,
  cols)``: 2-D grid, x over columns, y striding rows; ``out`` may alias ``y``.
- ``relu_mask(dy, h, dx, n)``, ``f32_to_bf16(x, out, n)``, ``bf16_to_f32(u, out, n)``,
  ``tf32_round(x, out, n)``: flat grid-stride loops, ``n`` an int64 element count; the two
  BF16 casts take 4 elements per thread where their pointers are aligned for it (16 bytes
  float32, 8 bytes BF16; a scalar loop otherwise), so their plans launch a quarter of the
  threads (``plan_flat_vec4``).
- ``bias_grad_reduce(dy, db, rows, cols)``: blocks of (32 columns, fewer for narrower
  matrices, x ``BIAS_GRAD_CHUNKS`` row chunks); deterministic, no atomics; equal to the reference bit for bit when
  ``rows <= BIAS_GRAD_CHUNKS``, a reassociated sum otherwise (see the kernel's comment).
- ``relu_mask_bias_grad(dy, h, dx, db, rows, cols)``: ``relu_mask`` then ``bias_grad_reduce``
  in one launch, blocks of (8 columns x ``BIAS_GRAD_CHUNKS`` row chunks); ``dx`` and ``db`` are
  bit for bit those of the two separate launches; ``dx`` may be ``dy`` itself (in place), ``h``
  and ``db`` must not overlap ``dx``/``dy``.
- ``gemm_tf32(a, b, c, h, m, n, k, trans_a, tile_m, tile_n)``: ``c = op(a) @ b`` in TF32, masked
  by ``h`` (``relu_mask``) when ``h`` is not null; blocks of ``tile_m x tile_n`` outputs (one of
  ``GEMM_TF32_TILES``) and ``GEMM_TF32_WARPS`` warps that split k (cuda_src/dense.cu).
  ``gemm_f32`` (same arguments, plan and limits): its exact-f32 twin on the CUDA cores. The step
  runs the TF32 backward's GEMMs that :func:`gemm_tf32_fits` with ``gemm_tf32`` and the f32
  backward's masked ones with ``gemm_f32`` (``fast.step_program``). Measured alone on the H200
  (session 33, a chain of ``relu_mask`` -> GEMM nodes, us a GEMM node, cuBLASLt's heuristic choice
  -> ``gemm_tf32`` with tiles of 16 x 16 / 16 x 32): 256x128x153 4.63 -> 2.90 / 3.22, 256x256x128
  3.92 -> 3.06 / 2.85, 256x256x256 4.86 -> 3.88 / 3.57, the weight gradient 256x128x256
  (``trans_a``) 4.85 -> 2.77 / 3.15; in the step, where most of them run beside the critical
  chain, fewer blocks measured faster (:data:`GEMM_TF32_MAX_BLOCKS`).

Numerics: every elementwise kernel is exact (bitwise equal to the reference);
``bias_grad_reduce`` is a float32 reduction (conformance: reduction tolerance); ``gemm_tf32`` and
``gemm_f32`` are GEMMs (conformance: the GEMM policy on the values they multiply; their masked
elements bit for bit).
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.kernels._runtime import FLAT_VEC_WIDTH, In, Out, blocks, launch, plan_flat, runtime
from foxhunt.reference.kernels.argcheck import require_array
from foxhunt.reference.kernels.dense import (
    F32,
    U16,
    BiasReluBf16,
    ReluBiasGrad,
    validate_add_bias_relu,
    validate_add_bias_relu_bf16,
    validate_gemm_tf32,
    validate_relu_mask,
    validate_relu_mask_bias_grad,
)

#: Largest column block of the bias epilogues; narrower rows (e.g. 51 atoms) get a block of
#: their width rounded up to a warp.
BIAS_MAX_THREADS = 256
WARP = 32
#: CUDA's limit on gridDim.y; the bias epilogues stride rows beyond it.
MAX_GRID_Y = 65535
#: bias_grad_reduce: columns per block (one warp wide) and row chunks per block (blockDim.y,
#: at most 32, the kernel's shared-memory array).
BIAS_GRAD_COLS = 32
BIAS_GRAD_CHUNKS = 16
#: bias_grad_reduce: the narrowest column block (one 32-byte row segment), for narrow matrices.
BIAS_GRAD_MIN_COLS = 8
#: relu_mask_bias_grad: columns per block (one 32-byte row segment; cols = 128 / 256 give 16 / 32
#: blocks). Its row chunks are BIAS_GRAD_CHUNKS, so its db has bias_grad_reduce's bits.
RELU_BIAS_GRAD_COLS = 8

#: gemm_tf32 (cuda_src/tf32_mma.cuh; ``tests/test_kernels_backward_gemm.py`` reads them back): the warps
#: of a block (they split k) and the rows of an MMA fragment.
GEMM_TF32_WARPS = 8
GEMM_TF32_ROWS = 16
#: gemm_tf32's tiles ``(tile_m, tile_n)``, in the order :func:`gemm_tf32_tile` tries them.
GEMM_TF32_TILES = ((16, 16), (16, 32), (32, 32))
#: The GEMMs the step runs as ``gemm_tf32`` (:func:`gemm_tf32_fits`): k at most this, and at most
#: this many blocks. The kernel trades blocks for bytes per SM, but most of the step's backward
#: GEMMs run beside its critical chain, whose kernels their blocks then crowd out. Measured on the
#: H200 (session 33, seed preset, the core bf16 step's driver-event time): call G, cuBLASLt's GEMMs
#: 107.6 us, every GEMM that fits 128 blocks of 16 x 16 or 16 x 32 as this kernel 108.8 us, those
#: that fit 64 blocks 101.2 us; call H, cuBLASLt 108.1 us, 16-row tiles within 64 blocks 101.7 us,
#: the 32 x 32 tile added (the 256 x 256 products then fit 64 blocks too) 104.0 us, within 32
#: blocks (every seed GEMM that fits then takes 32 x 32 tiles) 102.0 us, 32 x 32 tiles alone 100.8
#: us; every second-wave source 162.7, 156.8, 156.9, 155.9 us, the tf32 core step 127.4, 120.0,
#: 121.3, 119.2 us (call H's first four).
GEMM_TF32_MAX_K = 256
GEMM_TF32_MAX_BLOCKS = 32
F32_BYTES = 4

Plan = tuple  # (grid, block, shared_mem)


# --------------------------------------------------------------------------------------------
# Launch plans
# --------------------------------------------------------------------------------------------


def plan_add_bias_relu(rows: int, cols: int) -> Plan:
    """x covers the ``cols`` columns (blocks of up to 256 threads), y one row per block."""
    threads = min(BIAS_MAX_THREADS, WARP * blocks(cols, WARP))
    return (blocks(cols, threads), max(1, min(rows, MAX_GRID_Y))), (threads,), 0


plan_add_bias_relu_bf16 = plan_add_bias_relu
plan_relu_mask = plan_flat
plan_tf32_round = plan_flat


def plan_flat_vec4(n: int) -> Plan:
    """``plan_flat`` over the ``ceil(n / 4)`` groups of 4 elements: one thread per group (the
    kernel's vector path; its scalar fallback strides over the same grid), the same block and
    grid cap."""
    return plan_flat(blocks(n, FLAT_VEC_WIDTH))


plan_f32_to_bf16 = plan_flat_vec4
plan_bf16_to_f32 = plan_flat_vec4


def plan_bias_grad_reduce(rows: int, cols: int) -> Plan:
    """One block per ``BIAS_GRAD_COLS`` columns (fewer when there are fewer: ``cols`` rounded up
    to ``BIAS_GRAD_MIN_COLS``, so the IQN head's 8 columns take a block of 8 lanes, not 32);
    ``BIAS_GRAD_CHUNKS`` row chunks per block (blockDim.y, which alone fixes db's bits)."""
    del rows  # the kernel splits any number of rows into blockDim.y chunks
    width = min(BIAS_GRAD_COLS, BIAS_GRAD_MIN_COLS * blocks(cols, BIAS_GRAD_MIN_COLS))
    return (blocks(cols, width),), (width, BIAS_GRAD_CHUNKS), 0


def plan_relu_mask_bias_grad(rows: int, cols: int) -> Plan:
    """One block per 8 columns; ``BIAS_GRAD_CHUNKS`` row chunks per block (the chunking of
    ``plan_bias_grad_reduce``, which the bitwise equality with it relies on)."""
    del rows  # the kernel splits any number of rows into blockDim.y chunks
    return ((blocks(cols, RELU_BIAS_GRAD_COLS),), (RELU_BIAS_GRAD_COLS, BIAS_GRAD_CHUNKS), 0)


def _gemm_tf32_blocks(m: int, n: int, tile: tuple[int, int]) -> int:
    return blocks(m, tile[0]) * blocks(n, tile[1])


def gemm_tf32_tile(m: int, n: int) -> tuple[int, int]:
    """gemm_tf32's tile ``(tile_m, tile_n)`` for an ``m x n`` product: the first of
    ``GEMM_TF32_TILES`` whose grid stays within ``GEMM_TF32_MAX_BLOCKS`` (the smallest tiles that
    do: more SMs, fewer bytes each), else the largest. The bits do not depend on it."""
    return next((t for t in GEMM_TF32_TILES if _gemm_tf32_blocks(m, n, t) <= GEMM_TF32_MAX_BLOCKS),
                GEMM_TF32_TILES[-1])


def gemm_tf32_shared_bytes(k: int, trans_a: bool, tile: tuple[int, int]) -> int:
    """gemm_tf32's dynamic shared memory (cuda_src/dense.cu): per warp ``kw (tile_n + 8)`` floats
    of b and ``tile_m (kw + 4)`` (``trans_a``: ``kw (tile_m + 8)``) of a, ``kw = 8 ceil(ceil(k /
    8) / WARPS)``, then the warps' partial tiles, ``WARPS tile_m tile_n`` floats."""
    tile_m, tile_n = tile
    kw = 8 * blocks(blocks(k, 8), GEMM_TF32_WARPS)
    a_floats = kw * (tile_m + 8) if trans_a else tile_m * (kw + 4)
    per_warp = kw * (tile_n + 8) + a_floats
    return F32_BYTES * GEMM_TF32_WARPS * (per_warp + tile_m * tile_n)


def gemm_tf32_fits(m: int, n: int, k: int) -> bool:
    """Whether the step runs the TF32 GEMM ``m x n x k`` as ``gemm_tf32``: ``k <=
    GEMM_TF32_MAX_K`` and a grid of at most ``GEMM_TF32_MAX_BLOCKS`` blocks (module docstring)."""
    return (1 <= k <= GEMM_TF32_MAX_K and min(m, n) >= 1
            and _gemm_tf32_blocks(m, n, gemm_tf32_tile(m, n)) <= GEMM_TF32_MAX_BLOCKS)


def plan_gemm_tf32(m: int, n: int, k: int, trans_a: bool, *, arch=90) -> Plan:
    """``((ceil(n / tile_n), ceil(m / tile_m)), (WARPS * 32,), gemm_tf32_shared_bytes(k, trans_a,
    tile))`` with ``tile = gemm_tf32_tile(m, n)``; ``ValueError`` where one block of ``arch``
    cannot have that shared memory."""
    from foxhunt.fast._build import normalize_arch
    from foxhunt.fast.kernels.walk import shared_optin  # walk imports this module

    for name, value in (("m", m), ("n", n), ("k", k)):
        if int(value) < 1:
            raise ValueError(f"{name}={value}: gemm_tf32 needs positive sizes")
    tile = gemm_tf32_tile(m, n)
    nbytes = gemm_tf32_shared_bytes(k, trans_a, tile)
    if nbytes > shared_optin(arch):
        raise ValueError(f"k={k}: gemm_tf32 needs {nbytes} bytes of shared memory per block; "
                         f"sm_{normalize_arch(arch)} allows {shared_optin(arch)}")
    return (blocks(n, tile[1]), blocks(m, tile[0])), (GEMM_TF32_WARPS * 32,), nbytes


# --------------------------------------------------------------------------------------------
# Test entries (reference signatures)
# --------------------------------------------------------------------------------------------


def add_bias_relu(y: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``relu(y + b)`` on the GPU: see ``foxhunt.reference.kernels.dense.add_bias_relu``."""
    validate_add_bias_relu(y, b)
    rows, cols = y.shape
    (out,) = launch("add_bias_relu", plan_add_bias_relu(rows, cols),
                     In(y), In(b), Out((rows, cols), F32), rows, cols)
    return out


def add_bias_relu_bf16(y: np.ndarray, b: np.ndarray) -> BiasReluBf16:
    """``add_bias_relu`` fused with the BF16 cast: returns ``BiasReluBf16(out, out_bf16)``."""
    validate_add_bias_relu_bf16(y, b)
    rows, cols = y.shape
    out, out_bf16 = launch("add_bias_relu_bf16", plan_add_bias_relu_bf16(rows, cols),
                            In(y), In(b), Out((rows, cols), F32), Out((rows, cols), U16),
                            rows, cols)
    return BiasReluBf16(out=out, out_bf16=out_bf16)


def relu_mask(dy: np.ndarray, h: np.ndarray) -> np.ndarray:
    """``h <= 0 ? 0 : dy`` on the GPU: see ``foxhunt.reference.kernels.dense.relu_mask``."""
    validate_relu_mask(dy, h)
    (dx,) = launch("relu_mask", plan_relu_mask(dy.size), In(dy), In(h), Out(dy.shape, F32),
                    dy.size)
    return dx


def bias_grad_reduce(dy: np.ndarray) -> np.ndarray:
    """Column sums ``db[n] = sum_i dy[i, n]`` on the GPU (float32, deterministic)."""
    require_array("dy", dy, F32, ndim=2)
    rows, cols = dy.shape
    (db,) = launch("bias_grad_reduce", plan_bias_grad_reduce(rows, cols),
                    In(dy), Out((cols,), F32), rows, cols)
    return db


def relu_mask_bias_grad(dy: np.ndarray, h: np.ndarray) -> ReluBiasGrad:
    """``relu_mask`` fused with ``bias_grad_reduce`` on the GPU: returns ``ReluBiasGrad(dx, db)``;
    see ``foxhunt.reference.kernels.dense.relu_mask_bias_grad``."""
    validate_relu_mask_bias_grad(dy, h)
    rows, cols = dy.shape
    dx, db = launch("relu_mask_bias_grad", plan_relu_mask_bias_grad(rows, cols),
                    In(dy), In(h), Out((rows, cols), F32), Out((cols,), F32), rows, cols)
    return ReluBiasGrad(dx=dx, db=db)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> BF16 bit patterns (RNE; the reference's NaN rule), any shape."""
    require_array("x", x, F32)
    (out,) = launch("f32_to_bf16", plan_f32_to_bf16(x.size), In(x), Out(x.shape, U16), x.size)
    return out


def bf16_to_f32(u: np.ndarray) -> np.ndarray:
    """BF16 bit patterns -> float32 (exact), any shape."""
    require_array("u", u, U16)
    (out,) = launch("bf16_to_f32", plan_bf16_to_f32(u.size), In(u), Out(u.shape, F32), u.size)
    return out


def tf32_round(x: np.ndarray) -> np.ndarray:
    """float32 -> TF32 (ties away from zero; the reference's NaN rule), any shape."""
    require_array("x", x, F32)
    (out,) = launch("tf32_round", plan_tf32_round(x.size), In(x), Out(x.shape, F32), x.size)
    return out


def _backward_gemm(name: str, a, b, h, trans_a) -> np.ndarray:
    """The test entries of ``gemm_tf32`` and ``gemm_f32`` (one plan)."""
    m, n, k = validate_gemm_tf32(a, b, h, trans_a)
    plan = plan_gemm_tf32(m, n, k, bool(trans_a), arch=runtime().device.arch)
    (c,) = launch(name, plan, In(a), In(b), Out((m, n), F32), In(h) if h is not None else 0,
                  m, n, k, int(bool(trans_a)), *gemm_tf32_tile(m, n))
    return c


def gemm_tf32(a: np.ndarray, b: np.ndarray, h: np.ndarray | None = None, *,
              trans_a: bool = False) -> np.ndarray:
    """``op(a) @ b`` in TF32, masked by ``h`` when given, on the GPU: see
    ``foxhunt.reference.kernels.dense.gemm_tf32``."""
    return _backward_gemm("gemm_tf32", a, b, h, trans_a)


def gemm_f32(a: np.ndarray, b: np.ndarray, h: np.ndarray | None = None, *,
             trans_a: bool = False) -> np.ndarray:
    """``op(a) @ b`` in f32, masked by ``h`` when given, on the GPU: see
    ``foxhunt.reference.kernels.dense.gemm_f32``."""
    return _backward_gemm("gemm_f32", a, b, h, trans_a)


#: gemm_f32 launches as gemm_tf32 (the same staging and grid).
plan_gemm_f32 = plan_gemm_tf32


KERNELS = {
    "add_bias_relu": add_bias_relu,
    "add_bias_relu_bf16": add_bias_relu_bf16,
    "relu_mask": relu_mask,
    "bias_grad_reduce": bias_grad_reduce,
    "relu_mask_bias_grad": relu_mask_bias_grad,
    "f32_to_bf16": f32_to_bf16,
    "bf16_to_f32": bf16_to_f32,
    "tf32_round": tf32_round,
    "gemm_tf32": gemm_tf32,
    "gemm_f32": gemm_f32,
}
