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

Numerics: every elementwise kernel is exact (bitwise equal to the reference);
``bias_grad_reduce`` is a float32 reduction (conformance: reduction tolerance).
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.kernels._runtime import FLAT_VEC_WIDTH, In, Out, blocks, launch, plan_flat
from foxhunt.reference.kernels.argcheck import require_array
from foxhunt.reference.kernels.dense import (
    F32,
    U16,
    BiasReluBf16,
    ReluBiasGrad,
    validate_add_bias_relu,
    validate_add_bias_relu_bf16,
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


KERNELS = {
    "add_bias_relu": add_bias_relu,
    "add_bias_relu_bf16": add_bias_relu_bf16,
    "relu_mask": relu_mask,
    "bias_grad_reduce": bias_grad_reduce,
    "relu_mask_bias_grad": relu_mask_bias_grad,
    "f32_to_bf16": f32_to_bf16,
    "bf16_to_f32": bf16_to_f32,
    "tf32_round": tf32_round,
}
