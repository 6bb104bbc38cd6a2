"""Straight-through rounding of forward GEMM operands for the torch autograd oracles
(``tests/test_iqn_oracle.py``, ``tests/test_aux_oracle.py``): the value a GEMM of the precision's
forward mode (``backend.FORWARD_GEMM_MODE``) multiplies, computed by torch itself, and the
gradient of the identity (the reference differentiates the unrounded operands; its backward
GEMMs' own input rounding is what the oracles' gradient tolerances allow for)."""

from __future__ import annotations

import torch

from foxhunt.reference.backend import FORWARD_GEMM_MODE

F64 = torch.float64


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """float32, then BF16 round-to-nearest-even (torch's conversion)."""
    return x + (x.to(torch.float32).to(torch.bfloat16).to(F64) - x).detach()


def _tf32(x: torch.Tensor) -> torch.Tensor:
    """float32, then TF32 (10 explicit significand bits) round to nearest, ties away from zero:
    half a TF32 ulp added to the magnitude's bits, the 13 low bits cleared (finite values)."""
    bits = x.detach().to(torch.float32).view(torch.int32)
    held = ((bits + 0x1000) & ~0x1FFF).view(torch.float32)
    return x + (held.to(F64) - x).detach()


def forward_rounder(precision: str):
    """The straight-through rounding of ``precision``'s forward GEMM operands (the identity in
    f32)."""
    return {"f32": lambda x: x, "bf16": _bf16, "tf32": _tf32}[FORWARD_GEMM_MODE[precision]]
