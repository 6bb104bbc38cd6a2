"""Stand-ins for a second implementation on the CPU: the reference trainer stepping under a
legitimate variant (:func:`legitimate_variant`: other summation orders, TF32 truncation) that
the step bounds must accept, or under a deliberate bug (:func:`bug_variant`, :data:`BUGS`) that
they must reject.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from foxhunt.conformance.step_bounds import F32, F64
from foxhunt.conformance.step_harness import PRECISIONS, Factory
from foxhunt.reference.backend import FORWARD_GEMM_MODE, StepScalars
from foxhunt.reference.batch import Batch
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.kernels import dense, optim, spectral
from foxhunt.reference.layout import ParamLayout
from foxhunt.reference.trainer import Trainer

@contextlib.contextmanager
def _patches(*items: tuple[Any, str, Any]) -> Iterator[None]:
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in items]
    try:
        for obj, name, value in items:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def _tf32_truncate(x: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(x, F32).view(np.uint32)
    keep = np.where(np.isfinite(x), bits & np.uint32(0xFFFFE000), bits)
    return keep.astype(np.uint32).view(F32)


def tf32_nearest_even(x: np.ndarray) -> np.ndarray:
    """float32 rounded to TF32 (10 explicit significand bits), to nearest, ties to even, as
    cuBLASLt's TF32 plans round their operands; NaN and Inf kept."""
    bits = np.ascontiguousarray(x, F32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x0FFF + ((bits >> 13) & 1)) & 0xFFFFE000
    keep = np.where(np.isfinite(x), rounded, bits)
    return keep.astype(np.uint32).view(F32)


def legitimate_variant(config: DQNConfig | None = None) -> contextlib.AbstractContextManager:
    """A correct re-implementation that rounds differently from the reference: GEMMs, bias
    gradients, norms and the spectral mat-vecs accumulated in float64 and rounded once, TF32
    operands truncated (as tensor cores may) instead of rounded to nearest (ties away). Where
    ``config``'s forward GEMMs are TF32 (``precision="tf32"``) its TF32 operands are rounded to
    nearest, ties to even, as cuBLASLt's TF32 plans do on the H200 (``tests/test_fast_gpu.py``):
    truncating a forward operand moves every ReLU switching point by up to a TF32 ulp, which no
    conditioned batch keeps clear of (``step_conditioning``), and the fast path does not do it."""
    ref_round_for, ref_matvec, ref_rmatvec = dense.round_for, spectral._matvec, spectral._rmatvec
    tf32 = tf32_nearest_even if config is not None and \
        FORWARD_GEMM_MODE[config.precision] == "tf32" else _tf32_truncate

    def round_for(x, mode):
        return tf32(x) if mode == "tf32" else ref_round_for(x, mode)

    def gemm(a, b, *, trans_a=False, trans_b=False, mode="f32", rounded=False):
        op_a = np.ascontiguousarray(a.T if trans_a else a)
        op_b = np.ascontiguousarray(b.T if trans_b else b)
        if not rounded:
            op_a, op_b = round_for(op_a, mode), round_for(op_b, mode)
        with np.errstate(all="ignore"):
            return (op_a.astype(F64) @ op_b.astype(F64)).astype(F32)

    def bias_grad_reduce(dy):
        with np.errstate(all="ignore"):
            return np.sum(dy.astype(F64), axis=0).astype(F32)

    def grad_norm_sq(x):
        with np.errstate(all="ignore"):
            x64 = np.where(np.isfinite(x), x, 0).astype(F64)
            return F32(np.sum(x64 * x64))

    def matvec(w, x):
        with np.errstate(all="ignore"):
            return (w.astype(F64) @ x.astype(F64)).astype(F32)

    def rmatvec(w, y):
        with np.errstate(all="ignore"):
            return (w.astype(F64).T @ y.astype(F64)).astype(F32)

    del ref_matvec, ref_rmatvec
    return _patches((dense, "round_for", round_for), (dense, "gemm", gemm),
                    (dense, "bias_grad_reduce", bias_grad_reduce), (optim, "grad_norm_sq", grad_norm_sq),
                    (spectral, "_matvec", matvec), (spectral, "_rmatvec", rmatvec))


def bug_variant(name: str, config: DQNConfig) -> contextlib.AbstractContextManager:
    """A deliberately wrong step (what a fast-path bug would look like); see BUGS."""
    from foxhunt.reference import step as step_mod
    from foxhunt.reference import trainer as trainer_mod
    from foxhunt.reference.kernels import isv as isv_kernels

    layout = ParamLayout(config)
    if name == "cql_gradient_dropped":
        pipeline = trainer_mod.budget_pipeline
        return _patches((trainer_mod, "budget_pipeline",
                         lambda c, g51, gcql: pipeline(c, g51, np.zeros_like(gcql))))
    if name in ("sign_error_w_v2", "tail_block_zeroed_w_s1", "bf16_gradient_storage"):
        backward = step_mod.backward

        def wrong(*args, **kwargs):
            grad = backward(*args, **kwargs)
            if name == "sign_error_w_v2":
                t = layout["w_v2"]
                grad[t.offset:t.end] *= F32(-1)
            elif name == "tail_block_zeroed_w_s1":
                t = layout["w_s1"]
                grad[t.end - t.size % 64 - 64:t.end] = 0
            else:
                grad[:] = dense.bf16_to_f32(dense.f32_to_bf16(grad))
            return grad
        return _patches((step_mod, "backward", wrong))
    if name == "tf32_in_f32_mode":
        gemm = dense.gemm

        def tf32_gemm(a, b, *, trans_a=False, trans_b=False, mode="f32", rounded=False):
            if mode == "f32":
                a, b, mode, rounded = dense.tf32_round(a), dense.tf32_round(b), "tf32", True
            return gemm(a, b, trans_a=trans_a, trans_b=trans_b, mode=mode, rounded=rounded)
        return _patches((dense, "gemm", tf32_gemm))
    if name == "lr_times_1.5":
        adam = optim.adam_update
        return _patches((optim, "adam_update",
                         lambda *a, lr, **k: adam(*a, lr=F32(lr * F32(1.5)), **k)))
    if name == "polyak_tau_doubled":
        polyak = optim.polyak_update
        return _patches((optim, "polyak_update", lambda t, o, tau: polyak(t, o, F32(2 * tau))))
    if name == "spectral_norm_skipped":
        batched = spectral.batched_spectral_norm

        def skipped(ws, us, vs, sigma_max):
            res = batched(ws, us, vs, sigma_max)
            return res._replace(ws=[w.copy() for w in ws], us=[u.copy() for u in us],
                                vs=[v.copy() for v in vs])
        return _patches((spectral, "batched_spectral_norm", skipped))
    if name == "h2_rms_producer_skipped":
        return _patches((isv_kernels, "isv_h2_rms_update", lambda isv, h2, alpha: isv.copy()))
    raise ValueError(f"bug {name!r} is unknown; allowed: {BUGS}")


#: Deliberately wrong steps the bounds must reject, with the precisions they are visible in
#: (storing the gradient in BF16 is within bf16 mode's TF32-sized gradient bound).
BUGS: Mapping[str, tuple[str, ...]] = {
    "cql_gradient_dropped": PRECISIONS,
    "sign_error_w_v2": PRECISIONS,
    "tail_block_zeroed_w_s1": PRECISIONS,
    "bf16_gradient_storage": ("f32",),
    "tf32_in_f32_mode": ("f32",),
    "lr_times_1.5": PRECISIONS,
    "polyak_tau_doubled": PRECISIONS,
    "spectral_norm_skipped": PRECISIONS,
    "h2_rms_producer_skipped": PRECISIONS,
}


class VariantTrainer(Trainer):
    """The reference trainer stepping under a variant (a stand-in for a second implementation)."""

    variant: Callable[[DQNConfig], contextlib.AbstractContextManager] = \
        staticmethod(legitimate_variant)

    def step(self, batch: Batch) -> StepScalars:
        with self.variant(self.config):
            return super().step(batch)


def variant_factory(variant: Callable[[DQNConfig], contextlib.AbstractContextManager]) -> Factory:
    return type("Variant", (VariantTrainer,), {"variant": staticmethod(variant)})
