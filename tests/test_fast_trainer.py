"""The fast Trainer against the reference Trainer: one step from a shared state, NaN injection,
deferred readback, checkpoints both ways, fold boundary, greedy Q values.

Every test runs on two backends of the fast Trainer:

- ``gpu``: the real thing (NVRTC kernels, cuBLASLt, CUDA graphs); skipped with the reason where
  no CUDA device/driver is usable.
- ``emulated``: the same ``foxhunt.fast.trainer`` / ``foxhunt.fast.step_plan`` code (arena
  layout, pointer arithmetic, argument lists checked against the kernels' PTX parameter types,
  GEMM shapes/epilogues/alignment, launch order, graph capture and replay, parallel branches,
  readback and state exchange) over a CPU emulation of the device layer: device memory is host
  memory, each CUDA kernel runs its reference twin, each cuBLASLt GEMM the reference GEMM
  emulation plus its epilogue, graphs record and replay. It checks the Trainer's wiring on any
  machine with NVRTC; it cannot check the CUDA code itself (the conformance suite and the
  ``gpu`` backend do). A captured graph is a dependency graph (stream order plus event
  waits); it replays in capture order or "latest ready node first", so a dependency missing
  between parallel branches shows; a capture must fork every side stream from the capture
  stream and join it back.

Tolerances (relative to the largest magnitude in each compared buffer; integers, flags and NaN
maps exact): ``emulated`` 1e-5 (the same reference kernels, different GEMM shapes and sum
orders). ``gpu``: cuBLAS accumulates in another order and cuBLAS's TF32 may truncate where the
reference rounds; a ReLU whose pre-activation is within rounding of 0 can flip its mask, and in
bf16 an activation within rounding of a BF16 tie can round the other way, which moves one
element by 2^-8 relative. Simulating those perturbations on the CPU (float64 accumulation, TF32
truncation) gives at most 1e-7 (f32) / 7e-4 (bf16) on the state after one step from a warm
state (three reference steps: at Adam's first step every update is +-lr * sign(g), so a
gradient of ~0 whose sign flips moves its parameter by 2 lr; after a few steps the moments
smooth that out), and up to 2e-3 from a cold one. The gpu bounds are 1e-3 (f32) and 1e-2
(bf16) from a warm state: ten times the simulated error, and far below what a wrong pointer,
a swapped operand or a missing term gives (order 1).
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import types

import numpy as np
import pytest

from foxhunt.fast.device import cuda_available
from foxhunt.reference import isv as isv_mod
from foxhunt.reference import sentinels
from foxhunt.reference.batch import Batch
from foxhunt.reference.budgets import budget_pipeline
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.kernels import dense, optim, safety, spectral
from foxhunt.reference.kernels import distributional as dist
from foxhunt.reference.kernels import fused
from foxhunt.reference.kernels import isv as risv
from foxhunt.reference.step import loss_and_grads
from foxhunt.reference.trainer import Trainer as RefTrainer

_GPU_OK, _GPU_REASON = cuda_available()
WARM_STEPS = 3
#: Relative Q margin below which two backends may choose different double-DQN actions.
NEAR_TIE = 1e-3
TOL = {("emulated", "f32"): 1e-5, ("emulated", "bf16"): 1e-5,
       ("gpu", "f32"): 1e-3, ("gpu", "bf16"): 1e-2}
SCALAR_FIELDS = ("loss", "c51_loss", "cql_loss", "grad_norm", "c51_norm_pre", "c51_norm_post",
                 "cql_norm_pre", "cql_norm_post", "clip_bound", "mean_q", "mean_target_q")


# ============================================================================================
# CPU emulation of the device layer (the ``emulated`` backend)
# ============================================================================================

F = np.float32
I = np.int32


def _view(ptr: int, count: int, dtype) -> np.ndarray:
    """A writable NumPy view of ``count`` elements at host address ``ptr``."""
    dtype = np.dtype(dtype)
    count = int(count)
    if count <= 0:
        return np.zeros(0, dtype)
    raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(int(ptr))
    return np.frombuffer(raw, dtype=dtype, count=count)


def _scalar(ptr, dtype=F):
    return _view(ptr, 1, dtype)[0]


class _Emulator:
    """Record-or-run dispatch: outside a capture a launch runs at once; inside, it is recorded
    as a node of the capture's dependency graph (stream order plus event waits) and runs at
    replay, in ``branch_order``: ``"capture_order"`` (the order of capture) or
    ``"latest_first"`` (always the most recently captured node whose dependencies have run:
    a dependency missing between parallel branches makes the result differ)."""

    def __init__(self, branch_order: str):
        self.branch_order = branch_order
        self.capture = None  # the _Graph being captured

    def dispatch(self, thunk, stream=None) -> None:
        if self.capture is None:
            thunk()
        else:
            self.capture.record(thunk, stream)


EMU = _Emulator("latest_first")


class _Stream:
    def __init__(self, side: bool = False):
        self.side = side
        self.handle = self
        self.ptr = id(self)

    def __int__(self):
        return self.ptr

    def synchronize(self):
        assert EMU.capture is None, "stream synchronisation inside a graph capture"

    def close(self):
        """Nothing to release: an emulated stream owns no driver resource."""


class _Event:
    deps: frozenset = frozenset()
    graph = None  # the _Graph whose capture recorded it last


class _Driver:
    CUevent_flags = types.SimpleNamespace(CU_EVENT_DISABLE_TIMING=types.SimpleNamespace(value=2))
    CUstream_flags = types.SimpleNamespace(CU_STREAM_NON_BLOCKING=types.SimpleNamespace(value=1))

    @staticmethod
    def cuStreamCreate(flags):  # noqa: N802
        assert EMU.capture is None, "stream creation inside a graph capture"
        return _Stream(side=True)

    @staticmethod
    def cuStreamDestroy(stream):  # noqa: N802
        pass

    @staticmethod
    def cuStreamWaitEvent(stream, event, flags):  # noqa: N802
        if EMU.capture is not None:
            EMU.capture.stream_wait(stream, event)

    @staticmethod
    def cuMemsetD8Async(ptr, byte, n, stream):  # noqa: N802 - driver API names
        EMU.dispatch(lambda: ctypes.memset(int(ptr), int(byte), int(n)), stream)

    @staticmethod
    def _copy(dst, src, n, stream):
        EMU.dispatch(lambda: ctypes.memmove(int(dst), int(src), int(n)), stream)

    cuMemcpyHtoDAsync = cuMemcpyDtoDAsync = cuMemcpyDtoHAsync = _copy

    @staticmethod
    def cuStreamSynchronize(stream):  # noqa: N802
        assert EMU.capture is None, "stream synchronisation inside a graph capture"

    @staticmethod
    def cuEventCreate(flags):  # noqa: N802
        assert EMU.capture is None, "event creation inside a graph capture"
        return _Event()

    @staticmethod
    def cuEventRecord(event, stream):  # noqa: N802
        if EMU.capture is not None:
            EMU.capture.event_record(event, stream)

    @staticmethod
    def cuEventSynchronize(event):  # noqa: N802
        assert EMU.capture is None

    @staticmethod
    def cuEventDestroy(event):  # noqa: N802
        pass


class _Allocation:
    def __init__(self, nbytes: int):
        self._buf = np.zeros(int(nbytes) + 512, np.uint8)
        self.ptr = (self._buf.ctypes.data + 255) // 256 * 256
        self.nbytes = nbytes

    def free(self):
        pass


class _Device:
    arch = "sm_90"
    compute_capability = (9, 0)
    name = "emulated"

    def __init__(self, ordinal: int = 0):
        self.stream = _Stream()
        self._extras = {}
        self._keep = []

    def make_current(self):
        pass

    def alloc(self, nbytes):
        return _Allocation(nbytes)

    def new_stream(self):
        return _Stream(side=True)

    def load_module(self, module):
        return _Module(module)

    def pinned_empty(self, shape, dtype):
        count = int(np.prod(shape))
        block = _Allocation(count * np.dtype(dtype).itemsize)
        self._keep.append(block)
        return _view(block.ptr, count, dtype).reshape(shape)

    def copy_to_host(self, out, src_ptr, stream=None, *, wait=True):
        EMU.dispatch(lambda: ctypes.memmove(out.ctypes.data, int(src_ptr), out.nbytes), stream)
        return out


class _Packed:
    def __init__(self, args):
        self.args = args


class _Kernel:
    def __init__(self, name, params):
        self.name = name
        self.params = params

    def pack(self, *args):
        from foxhunt.fast import device as fdev

        if len(args) != len(self.params):
            raise TypeError(f"{self.name} takes {len(self.params)} arguments, got {len(args)}")
        for i, (p, a) in enumerate(zip(self.params, args)):
            fdev._pack_arg(self.name, i, p, a)  # the real launcher's type and range checks
        return _Packed(tuple(F(a) if p.ptx_type == "f32" else int(a)
                             for p, a in zip(self.params, args)))

    def launch(self, grid, block, *args, stream=None, shared_mem=0):
        from foxhunt.fast import device as fdev

        packed = args[0] if len(args) == 1 and isinstance(args[0], _Packed) else self.pack(*args)
        assert stream is not None
        fdev._dim3(grid, "grid")
        fdev._dim3(block, "block")
        fn = EMULATED_KERNELS[self.name]
        if self.name.endswith("_branches"):  # fused kernels: gridDim.y is the branch count
            n_branches = grid[1]
            EMU.dispatch(lambda: fn(*packed.args, n_branches=n_branches), stream)
            return
        EMU.dispatch(lambda: fn(*packed.args), stream)

    def set_max_dynamic_shared(self, nbytes):
        pass


class _Module:
    def __init__(self, module):
        self.module = module

    def kernel(self, name):
        return _Kernel(name, self.module.params[name])


# -- the kernels: each runs its reference twin on the memory its pointers name
def k_f32_to_bf16(x, out, n):
    _view(out, n, np.uint16)[:] = dense.f32_to_bf16(_view(x, n, F).copy())


def k_relu_mask(dy, h, dx, n):
    r = dense.relu_mask(_view(dy, n, F).reshape(1, -1).copy(), _view(h, n, F).reshape(1, -1).copy())
    _view(dx, n, F)[:] = r.ravel()


def k_bias_grad_reduce(dy, db, rows, cols):
    _view(db, cols, F)[:] = dense.bias_grad_reduce(_view(dy, rows * cols, F).reshape(rows, cols).copy())


def k_relu_mask_bias_grad(dy, h, dx, db, rows, cols):
    n = rows * cols
    r = dense.relu_mask_bias_grad(_view(dy, n, F).reshape(rows, cols).copy(),
                                  _view(h, n, F).reshape(rows, cols).copy())
    _view(dx, n, F)[:] = r.dx.ravel()
    _view(db, cols, F)[:] = r.db


def k_dueling_combine(v, adv, logits, b, a, na):
    r = dist.dueling_combine(_view(v, b * na, F).reshape(b, na).copy(),
                             _view(adv, b * a * na, F).reshape(b, a, na).copy())
    _view(logits, b * a * na, F)[:] = r.ravel()


def k_dueling_combine_backward(dl, dv, dadv, b, a, na):
    r = dist.dueling_combine_backward(_view(dl, b * a * na, F).reshape(b, a, na).copy())
    _view(dv, b * na, F)[:] = r.dv.ravel()
    _view(dadv, b * a * na, F)[:] = r.dadv.ravel()


def k_log_softmax_atoms(logits, logp, rows, na):
    x = _view(logits, rows * na, F).reshape(rows, na).copy()
    _view(logp, rows * na, F)[:] = dist.log_softmax_atoms(x).ravel()


def k_expected_q(logp, z, q, rows, na):
    lp = _view(logp, rows * na, F).reshape(rows, 1, na).copy()
    _view(q, rows, F)[:] = dist.expected_q(lp, _view(z, na, F).copy()).ravel()


def k_double_dqn_select(q, best, b, a):
    _view(best, b, I)[:] = dist.double_dqn_select(_view(q, b * a, F).reshape(b, a).copy())


def k_c51_project(p, r, done, gamma, z, m, b, na, lo, hi, dz):
    assert F(dz) == dist._atom_spacing(F(lo), F(hi), na)
    out = dist.c51_project(_view(p, b * na, F).reshape(b, na).copy(), _view(r, b, F).copy(),
                           _view(done, b, F).copy(), _scalar(gamma), _view(z, na, F).copy(), lo, hi)
    _view(m, b * na, F)[:] = out.ravel()


def _c51_args(logp, act, m, isw, b, a, na):
    return (_view(logp, b * a * na, F).reshape(b, a, na).copy(), _view(act, b, I).copy(),
            _view(m, b * na, F).reshape(b, na).copy(), _view(isw, b, F).copy())


def k_c51_project_grad(p, r, done, gamma, z, logp, act, isw, scale, m, dl, b, a, na, lo, hi, dz):
    k_c51_project(p, r, done, gamma, z, m, b, na, lo, hi, dz)
    k_c51_grad(logp, act, m, isw, scale, dl, b, a, na)


def k_log_softmax_expected_q(logits, z, logp, q, rows, q_rows, na):
    r = dist.log_softmax_expected_q(_view(logits, rows * na, F).reshape(rows, na).copy(),
                                    _view(z, na, F).copy(), q_rows)
    _view(logp, rows * na, F)[:] = r.logp.ravel()
    _view(q, q_rows, F)[:] = r.q


def k_c51_loss(logp, act, m, isw, scale, ce, total, b, a, na):
    r = dist.c51_loss(*_c51_args(logp, act, m, isw, b, a, na), _scalar(scale))
    _view(ce, b, F)[:] = r.ce
    _view(total, 1, F)[0] = r.total


def k_c51_grad(logp, act, m, isw, scale, dl, b, a, na):
    r = dist.c51_grad(*_c51_args(logp, act, m, isw, b, a, na), _scalar(scale))
    _view(dl, b * a * na, F)[:] = r.ravel()


def k_cql_logit_grad(logp, act, z, alpha, scale, dl, terms, b, a, na):
    r = dist.cql_logit_grad(_view(logp, b * a * na, F).reshape(b, a, na).copy(),
                            _view(act, b, I).copy(), _view(z, na, F).copy(), _scalar(alpha),
                            _scalar(scale))
    _view(dl, b * a * na, F)[:] = r.dlogits.ravel()
    _view(terms, b, F)[:] = r.terms


def _branch_tables(n_actions, action_offset, nb):
    br = tuple(int(n) for n in _view(n_actions, nb, I))
    assert tuple(int(o) for o in _view(action_offset, nb, I)) == fused.branch_offsets(br)
    return br


def k_dueling_combine_branches(v, adv, n_actions, action_offset, logits, b, na, *, n_branches):
    br = _branch_tables(n_actions, action_offset, n_branches)
    rows = b * sum(br)
    r = fused.dueling_combine_branches(_view(v, b * na, F).reshape(b, na).copy(),
                                       _view(adv, rows * na, F).reshape(rows, na).copy(), br)
    _view(logits, rows * na, F)[:] = r.ravel()


def k_dueling_combine_backward_branches(dl, n_actions, action_offset, dv, dadv, b, na, *,
                                        n_branches):
    br = _branch_tables(n_actions, action_offset, n_branches)
    rows = b * sum(br)
    r = fused.dueling_combine_backward_branches(_view(dl, rows * na, F).reshape(rows, na).copy(), br)
    _view(dv, n_branches * b * na, F)[:] = r.dv.ravel()
    _view(dadv, rows * na, F)[:] = r.dadv.ravel()


def k_cql_logit_grad_branches(logp, act, z, alpha, scale, n_actions, action_offset, dl, terms, b,
                              block_rows, na, *, n_branches):
    br = _branch_tables(n_actions, action_offset, n_branches)
    r = fused.cql_logit_grad_branches(
        _view(logp, block_rows * sum(br) * na, F).reshape(-1, na).copy(),
        _view(act, n_branches * b, I).reshape(n_branches, b).copy(), _view(z, na, F).copy(),
        _scalar(alpha), _scalar(scale), br)
    _view(dl, b * sum(br) * na, F)[:] = r.dlogits.ravel()
    _view(terms, n_branches * b, F)[:] = r.terms.ravel()


def k_c51_loss_branches(logp, act, m, isw, scale, n_actions, action_offset, ce, total, b,
                        block_rows, na, *, n_branches):
    br = _branch_tables(n_actions, action_offset, n_branches)
    r = fused.c51_loss_branches(
        _view(logp, block_rows * sum(br) * na, F).reshape(-1, na).copy(),
        _view(act, n_branches * b, I).reshape(n_branches, b).copy(),
        _view(m, n_branches * b * na, F).reshape(n_branches, b, na).copy(),
        _view(isw, b, F).copy(), _scalar(scale), br)
    _view(ce, n_branches * b, F)[:] = r.ce.ravel()
    _view(total, n_branches, F)[:] = r.total


def k_dueling_log_softmax_q_branches(v, adv, z, n_actions, action_offset, logits, logp, q, b, na,
                                     with_q, *, n_branches):
    br = _branch_tables(n_actions, action_offset, n_branches)
    rows = b * sum(br)
    r = fused.dueling_log_softmax_q_branches(
        _view(v, b * na, F).reshape(b, na).copy(),
        _view(adv, rows * na, F).reshape(rows, na).copy(), _view(z, na, F).copy(), br,
        bool(with_q))
    _view(logits, rows * na, F)[:] = r.logits.ravel()
    _view(logp, rows * na, F)[:] = r.logp.ravel()
    if with_q:
        _view(q, rows, F)[:] = r.q


def k_dueling_combine_backward_sum_branches(dl, n_actions, action_offset, dv, dadv, b, na, nb, *,
                                            n_branches):
    del n_branches  # grid y is 1: the kernel loops over the branches (count: the last scalar)
    br = _branch_tables(n_actions, action_offset, nb)
    rows = b * sum(br)
    r = fused.dueling_combine_backward_sum_branches(
        _view(dl, rows * na, F).reshape(rows, na).copy(), br)
    _view(dv, b * na, F)[:] = r.dv.ravel()
    _view(dadv, rows * na, F)[:] = r.dadv.ravel()


def k_nan_check(x, n, flag):
    f = _view(flag, 1, I)
    f[0] = safety.nan_check(_view(x, n, F).copy(), int(f[0]))


def k_nan_check_fused(bufs, lens, thr, flags, n):
    buffers = [None if p == 0 else _view(int(p), int(length), F).copy()
               for p, length in zip(_view(bufs, n, np.uint64), _view(lens, n, np.int64))]
    fl = _view(flags, n, I)
    fl[:] = safety.nan_check_fused(buffers, fl.copy(), _view(thr, n, F).copy())


def k_target_q_clip(q, out, n, k1, q_abs_ref):
    _view(out, n, F)[:] = safety.target_q_clip(_view(q, n, F).copy(), k1, _scalar(q_abs_ref))


def k_grad_norm_partial(x, n, block_size, partials):
    _view(partials, -(-n // block_size), F)[:] = optim.grad_norm_partial(_view(x, n, F).copy(), block_size)


def k_grad_norm_final(partials, count, out):
    _view(out, 1, F)[0] = optim.grad_norm_final(_view(partials, count, F).copy())


def k_clip_grad_inplace(x, n, max_norm, norm_sq):
    xv = _view(x, n, F)
    xv[:] = optim.clip_grad_inplace(xv.copy(), max_norm, _scalar(norm_sq))


def k_clipped_saxpy(y, x, n, a, max_norm, norm_sq):
    yv = _view(y, n, F)
    yv[:] = optim.clipped_saxpy(yv.copy(), _view(x, n, F).copy(), a, max_norm, _scalar(norm_sq))


def k_clip_saxpy_norm_partial(base, inject, n, base_max_norm, base_partials, a, inject_max_norm,
                              inject_partials, count, final_threads, block_size, out, partials,
                              base_norm_sq, inject_norm_sq):
    r = optim.clip_saxpy_norm_partial(_view(base, n, F).copy(), _view(inject, n, F).copy(),
                                      base_max_norm, _view(base_partials, count, F).copy(), a,
                                      inject_max_norm, _view(inject_partials, count, F).copy(),
                                      block_size)
    _view(out, n, F)[:] = r.out
    _view(partials, -(-n // block_size), F)[:] = r.partials
    _view(base_norm_sq, 1, F)[0] = r.base_norm_sq
    _view(inject_norm_sq, 1, F)[0] = r.inject_norm_sq


def k_adam_update(param, grad, m, v, n, step, lr, beta1, beta2, eps, wd, grad_scale, clamp):
    pv, mv, vv = _view(param, n, F), _view(m, n, F), _view(v, n, F)
    r = optim.adam_update(pv.copy(), _view(grad, n, F).copy(), mv.copy(), vv.copy(),
                          step=int(_scalar(step, np.int64)), lr=lr, beta1=beta1, beta2=beta2,
                          eps=eps, weight_decay=wd, grad_scale=_scalar(grad_scale),
                          weight_clamp=_scalar(clamp))
    pv[:], mv[:], vv[:] = r.param, r.m, r.v


def k_polyak_update(target, online, n, tau):
    tv = _view(target, n, F)
    tv[:] = optim.polyak_update(tv.copy(), _view(online, n, F).copy(), tau)


def k_polyak_update_mirror(target, online, n, tau, online_bf16, target_bf16):
    tv = _view(target, n, F)
    r = optim.polyak_update_mirror(tv.copy(), _view(online, n, F).copy(), tau)
    tv[:] = r.target
    _view(online_bf16, n, np.uint16)[:] = r.online_bf16
    _view(target_bf16, n, np.uint16)[:] = r.target_bf16


def k_batched_spectral_norm(mats, count, sigma_max, eps, sigmas):
    from foxhunt.fast.kernels.spectral import SPECTRAL_MATRIX_DTYPE

    assert F(eps) == spectral.SPECTRAL_EPS
    desc = _view(mats, count * SPECTRAL_MATRIX_DTYPE.itemsize, np.uint8).view(SPECTRAL_MATRIX_DTYPE)
    for k, d in enumerate(desc):
        rows, cols = int(d["rows"]), int(d["cols"])
        w, u, v = _view(int(d["w"]), rows * cols, F), _view(int(d["u"]), rows, F), _view(int(d["v"]), cols, F)
        r = spectral.spectral_norm(w.reshape(rows, cols).copy(), u.copy(), v.copy(), sigma_max)
        w[:], u[:], v[:] = r.w.ravel(), r.u, r.v
        _view(sigmas, count, F)[k] = r.sigma


def k_isv_q_abs_ref_update(isv, slot, q, n, alpha):
    assert slot == isv_mod.Q_ABS_REF_INDEX
    iv = _view(isv, isv_mod.ISV_LEN, F)
    iv[:] = risv.isv_q_abs_ref_update(iv.copy(), _view(q, n, F).copy(), alpha)


def k_isv_h2_rms_update(isv, slot, h2, n, alpha):
    assert slot == isv_mod.H_S2_RMS_EMA_INDEX
    iv = _view(isv, isv_mod.ISV_LEN, F)
    iv[:] = risv.isv_h2_rms_update(iv.copy(), _view(h2, n, F).copy(), alpha)


# -- the trainer's glue kernels (cuda_src/_trainer_glue.cu), as the reference Trainer computes
def g_step_prologue(isv, adam_t, weight_clamp, clip_bound, thr_mult, thr_index, thr_power, thr,
                    n, q_index, slow_index, wc_mult, mgn, anchor):
    iv = _view(isv, isv_mod.ISV_LEN, F)
    mult, index, power, out = (_view(thr_mult, n, F), _view(thr_index, n, I),
                               _view(thr_power, n, I), _view(thr, n, F))
    for k in range(n):
        rule = sentinels.ThresholdRule(float(mult[k]), power=int(power[k]))
        out[k] = 0 if index[k] < 0 else rule.value(iv[index[k]])
    _view(weight_clamp, 1, F)[0] = safety.isv_bound(wc_mult, iv[q_index])
    _view(clip_bound, 1, F)[0] = F(min(F(mgn), safety.isv_bound(anchor, iv[slow_index])))
    _view(adam_t, 1, np.int64)[0] += 1


def g_clamp_isv(x, out, out_bf16, n, isv, index, mult):
    h2 = safety.clamp_finite(_view(x, n, F).copy(),
                             safety.isv_bound(mult, _view(isv, isv_mod.ISV_LEN, F)[index]))
    _view(out, n, F)[:] = h2
    if out_bf16:
        _view(out_bf16, n, np.uint16)[:] = dense.f32_to_bf16(h2)


def g_select_gather_taken(logp_t, a_star, q_o, actions, n_actions, action_offset, p_next,
                          q_taken, nb, b, na, q_rows):
    rows = np.arange(b)
    for d in range(nb):
        n_d, off = int(_view(n_actions, nb, I)[d]), int(_view(action_offset, nb, I)[d])
        q = _view(q_o + q_rows * off * 4, q_rows * n_d, F).reshape(q_rows, n_d)
        best = _view(a_star + d * b * 4, b, I)
        best[:] = dist.double_dqn_select(q[b:2 * b].copy())
        logp = _view(logp_t + b * na * off * 4, b * n_d * na, F).reshape(b, n_d, na)
        _view(p_next + d * b * na * 4, b * na, F)[:] = np.exp(logp[rows, best]).ravel()
        _view(q_taken + d * b * 4, b, F)[:] = q[rows, _view(actions + d * b * 4, b, I)]


def g_scalar_targets(p_next, z, r, done, gamma, target_q, nb, b, na):
    pn = _view(p_next, nb * b * na, F).reshape(nb, b, na)
    rr, dd, gg = _view(r, b, F), _view(done, b, F), _view(gamma, nb, F)
    out = _view(target_q, nb * b, F).reshape(nb, b)
    for d in range(nb):
        out[d] = rr + gg[d] * (F(1) - dd) * (pn[d] @ _view(z, na, F)).astype(F)


def g_branch_sum(parts, out, n, nb, stride, divisor):
    acc = np.zeros(n, F)
    for d in range(nb):
        acc = acc + _view(parts + d * stride * 4, n, F) / F(divisor)
    _view(out, n, F)[:] = acc


def g_h2_grad_mask(parts, n_parts, stride, h2, h2_pre, dh2, out, n):
    acc = np.zeros(n, F)
    for k in range(n_parts):
        acc = acc + _view(parts + k * stride * 4, n, F)
    _view(dh2, n, F)[:] = acc
    pre = _view(h2_pre, n, F).copy()
    masked = np.where(_view(h2, n, F) == pre, acc, F(0)).astype(F)
    _view(out, n, F)[:] = dense.relu_mask(masked.reshape(1, -1), pre.reshape(1, -1)).ravel()


def g_loss_scalars(c51_total, terms, q_taken, target_q, readback, nb, b, alpha):
    tr = _view(terms, nb * b, F).reshape(nb, b)
    cql = c51 = F(0)
    for d in range(nb):
        cql = F(cql + F(alpha) * np.mean(tr[d], dtype=F) / F(nb))
        c51 = F(c51 + _view(c51_total, nb, F)[d])
    rb = _view(readback, 12, F)
    rb[1], rb[2] = c51, cql
    rb[10] = np.mean(_view(q_taken, nb * b, F))
    rb[11] = np.mean(_view(target_q, nb * b, F))


def g_step_scalars(total_partials, n_partials, total_sq, c51_sq, cql_sq, clip_bound, isv,
                   safety_scale, readback, budget_c51, budget_cql, slow_index, slow_alpha):
    _view(total_sq, 1, F)[0] = optim.grad_norm_final(_view(total_partials, n_partials, F).copy())
    sq = [_scalar(c51_sq), _scalar(cql_sq), _scalar(total_sq)]
    n_c51, n_cql, norm = (optim.norm_from_sq(s) for s in sq)
    bound = _scalar(clip_bound)
    _view(safety_scale, 1, F)[0] = optim.clip_scale(sq[2], bound)
    rb = _view(readback, 12, F)
    rb[0] = rb[1] + rb[2]
    rb[3:10] = [norm, n_c51, F(n_c51 * optim.clip_scale(sq[0], budget_c51)), n_cql,
                F(n_cql * optim.clip_scale(sq[1], budget_cql)), bound, F(norm > bound)]
    iv = _view(isv, isv_mod.ISV_LEN, F)
    if np.isfinite(norm):
        iv[slow_index] = F((F(1) - F(slow_alpha)) * iv[slow_index] + F(slow_alpha) * norm)


def g_merge_flags(flags, piece_slot, n_slots, n_pieces):
    fl, slots = _view(flags, n_slots + n_pieces, I), _view(piece_slot, n_pieces, I)
    for k in range(n_pieces):
        if fl[n_slots + k]:
            fl[slots[k]] = 1


EMULATED_KERNELS = {name[2:]: fn for name, fn in dict(globals()).items() if name.startswith("k_")}
EMULATED_KERNELS.update({"glue_" + name[2:]: fn for name, fn in dict(globals()).items()
                         if name.startswith("g_")})


class _GemmPlan:
    """cuBLASLt plan stand-in: the real ``GemmSpec`` validation and alignment checks, then the
    reference GEMM emulation (``dense.gemm``) with the epilogue applied in float32."""

    def __init__(self, device, m, n, k, *, trans_a=False, trans_b=False, precision="f32",
                 epilogue=None, lda=None, ldb=None, ldc=None, alpha=1.0, beta=0.0,
                 min_alignment=256, workspace_limit=0):
        from foxhunt.fast.gemm import GemmSpec

        self.spec = GemmSpec(m, n, k, trans_a, trans_b, precision, epilogue, lda, ldb, ldc,
                             alpha, beta)
        assert min_alignment in (4, 8, 16, 32, 64, 128, 256)
        self.min_alignment = min_alignment

    @staticmethod
    def _stored(ptr, shape, ld, dtype):
        full = _view(ptr, (shape[0] - 1) * ld + shape[1], dtype)
        return np.lib.stride_tricks.as_strided(full, shape=shape,
                                               strides=(ld * full.itemsize, full.itemsize))

    def run(self, a_ptr, b_ptr, c_ptr, *, bias_ptr=None, aux_ptr=None, stream=None):
        s = self.spec
        for p in (a_ptr, b_ptr, c_ptr):
            assert p % self.min_alignment == 0, (hex(p), self.min_alignment, s)
        assert (bias_ptr is not None) == (s.bias_len is not None), s
        assert (aux_ptr is not None) == (s.aux_ld is not None), s
        assert stream is not None

        def thunk():
            dtype = np.uint16 if s.precision == "bf16" else F
            a = self._stored(a_ptr, s.a_shape, s.lda, dtype).copy()
            b = self._stored(b_ptr, s.b_shape, s.ldb, dtype).copy()
            mode = s.precision
            if mode == "bf16":
                a, b, mode = dense.bf16_to_f32(a), dense.bf16_to_f32(b), "f32"
            c = self._stored(c_ptr, s.c_shape, s.ldc, F)
            out = dense.gemm(a, b, trans_a=s.trans_a, trans_b=s.trans_b, mode=mode)
            if s.alpha != 1.0:
                out = (F(s.alpha) * out).astype(F)
            if s.beta != 0.0:
                out = (out + F(s.beta) * c).astype(F)
            ep = s.epilogue
            aux_row = (s.aux_ld or 0) // 8
            if ep in ("bias", "relu_bias", "relu_aux_bias"):
                out = (out + _view(bias_ptr, s.n, F)[None, :]).astype(F)
                if ep != "bias":
                    mask = ~(out <= 0)
                    out = np.where(mask, out, F(0)).astype(F)
                    if ep == "relu_aux_bias":
                        bits = np.packbits(mask, axis=1, bitorder="little")
                        _view(aux_ptr, s.aux_nbytes, np.uint8).reshape(s.m, aux_row)[:, :bits.shape[1]] = bits
            elif ep == "drelu_bgrad":
                aux = _view(aux_ptr, s.aux_nbytes, np.uint8).reshape(s.m, aux_row)
                mask = np.unpackbits(aux, axis=1, bitorder="little")[:, :s.n].astype(bool)
                out = np.where(mask, out, F(0)).astype(F)
                _view(bias_ptr, s.n, F)[:] = dense.bias_grad_reduce(out)
            elif ep == "bgrada":
                op_a = np.ascontiguousarray(a.T if s.trans_a else a)
                _view(bias_ptr, s.m, F)[:] = np.sum(op_a, axis=1, dtype=F)
            elif ep == "bgradb":
                _view(bias_ptr, s.n, F)[:] = np.sum(b.T if s.trans_b else b, axis=0, dtype=F)
            c[...] = out

        EMU.dispatch(thunk, stream)

    def close(self):
        pass


class _Graph:
    """GraphCapture stand-in: records a dependency graph (each node after the previous node of
    its stream and after the nodes its stream waited for through events), checks that every
    side stream was forked from the capture and joined back, and replays in EMU.branch_order.

    As in CUDA, a stream joins the capture by waiting on an event recorded in it, also one
    recorded before any work (an empty dependency set: the side stream's first node is then a
    root of the graph, beside the capture stream's first node)."""

    def __init__(self, stream, *, max_branches=4):
        self.stream = stream
        self.thunks: list = []
        self.deps: list[set] = []
        self._last: dict[int, int] = {}
        self._pending: dict[int, set] = {}
        self._members: set[int] = {self._key(stream)}  # streams taking part in the capture

    @staticmethod
    def _key(stream) -> int:
        return id(getattr(stream, "handle", stream))

    def __enter__(self):
        assert EMU.capture is None
        EMU.capture = self
        return self

    def __exit__(self, *exc):
        EMU.capture = None
        if exc[0] is None:
            main = self._key(self.stream)
            frontier = set(self._pending.get(main, ()))
            if main in self._last:
                frontier.add(self._last[main])
            seen, todo = set(), list(frontier)
            while todo:
                i = todo.pop()
                if i not in seen:
                    seen.add(i)
                    todo.extend(self.deps[i])
            unjoined = sorted(set(range(len(self.thunks))) - seen)
            assert not unjoined, f"capture ended with unjoined nodes {unjoined}"
        return False

    def record(self, thunk, stream):
        key = self._key(stream)
        deps = set(self._pending.pop(key, ()))
        if key in self._last:
            deps.add(self._last[key])
        assert key in self._members, "work on a stream that was not forked from the capture stream"
        self.thunks.append(thunk)
        self.deps.append(deps)
        self._last[key] = len(self.thunks) - 1

    def event_record(self, event, stream):
        key = self._key(stream)
        assert key in self._members, "event recorded on a stream outside the capture"
        deps = set(self._pending.get(key, ()))
        if key in self._last:
            deps.add(self._last[key])
        event.deps = frozenset(deps)
        event.graph = self

    def stream_wait(self, stream, event):
        assert event.graph is self, "wait on an event not recorded in this capture"
        key = self._key(stream)
        self._members.add(key)
        self._pending.setdefault(key, set()).update(event.deps)

    def order(self) -> list[int]:
        import heapq

        n = len(self.thunks)
        children = [[] for _ in range(n)]
        missing = [len(d) for d in self.deps]
        for i, deps in enumerate(self.deps):
            for j in deps:
                children[j].append(i)
        sign = -1 if EMU.branch_order == "latest_first" else 1
        heap = [sign * i for i in range(n) if missing[i] == 0]
        heapq.heapify(heap)
        out = []
        while heap:
            i = sign * heapq.heappop(heap)
            out.append(i)
            for c in children[i]:
                missing[c] -= 1
                if missing[c] == 0:
                    heapq.heappush(heap, sign * c)
        assert len(out) == n, "dependency cycle"
        return out

    def replay(self, stream=None):
        assert EMU.capture is None
        for i in self.order():
            self.thunks[i]()

    @property
    def node_count(self):
        return len(self.thunks)

    def close(self):
        pass


def _install_emulator(monkeypatch, branch_order: str) -> None:
    from foxhunt.fast import device as fdev
    from foxhunt.fast import gemm as fgemm
    from foxhunt.fast import graphs as fgraphs

    EMU.branch_order = branch_order
    EMU.capture = None
    monkeypatch.setattr(fdev, "_require_cuda", lambda: None)
    monkeypatch.setattr(fdev, "_driver", lambda: _Driver)
    monkeypatch.setattr(fdev, "call", lambda fn, *args: fn(*args))
    monkeypatch.setattr(fdev, "Device", _Device)
    monkeypatch.setattr(fgemm, "GemmPlan", _GemmPlan)
    monkeypatch.setattr(fgraphs, "GraphCapture", _Graph)


def _nvrtc_reason() -> str | None:
    try:
        from foxhunt.fast._build import compile_sources

        compile_sources("sm_90", "cubin")
    except Exception as exc:  # noqa: BLE001 - any failure means: cannot emulate here
        return f"NVRTC cannot build cuda_src here ({type(exc).__name__}: {exc})"
    return None


# ============================================================================================
# Fixtures
# ============================================================================================

BACKENDS = [
    pytest.param("emulated", id="emulated"),
    pytest.param("gpu", id="gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not _GPU_OK, reason=f"no CUDA device/driver: {_GPU_REASON}")]),
]


@pytest.fixture(scope="session")
def _nvrtc():
    return _nvrtc_reason()


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch, _nvrtc):
    """``(name, FastTrainer)``: the fast Trainer class on the real GPU or the emulated device."""
    name = request.param
    if name == "emulated":
        if _nvrtc is not None:
            pytest.skip(_nvrtc)
        _install_emulator(monkeypatch, "latest_first")
    from foxhunt.fast.trainer import Trainer

    made = []

    def make(config, seed=0):
        trainer = Trainer(config, seed=seed)
        made.append(trainer)
        return trainer

    yield name, make
    for trainer in made:
        trainer.close()


def _warm_reference(config: DQNConfig, seed: int, steps: int = WARM_STEPS):
    ref = RefTrainer(config, seed=seed)
    rng = np.random.default_rng(seed + 100)
    with np.errstate(all="ignore"):
        for _ in range(steps):
            ref.step(Batch.random(config, rng))
    return ref, rng


# ============================================================================================
# Comparisons
# ============================================================================================


def _rel_diff(want: np.ndarray, got: np.ndarray) -> float:
    """max |got - want| / max |want| over the finite elements (NaN maps compared separately)."""
    want64, got64 = want.astype(np.float64), got.astype(np.float64)
    finite = np.isfinite(want64) & np.isfinite(got64)
    if not finite.any():
        return 0.0
    scale = max(np.abs(want64[finite]).max(), 1e-30)
    return float(np.abs(got64[finite] - want64[finite]).max() / scale)


def _compare_states(want: dict, got: dict, tol: float, what: str) -> list[str]:
    """Differences beyond ``tol`` between two state dicts (empty list: equal within tol)."""
    problems = []
    assert sorted(want) == sorted(got), (sorted(want), sorted(got))
    for key in sorted(want):
        w, g = want[key], got[key]
        if w.shape != g.shape or w.dtype != g.dtype:
            problems.append(f"{what} {key}: {g.shape} {g.dtype} != {w.shape} {w.dtype}")
        elif key == "isv":
            bits = [isv_mod.FINGERPRINT_LO_INDEX, isv_mod.FINGERPRINT_HI_INDEX]
            if not np.array_equal(w.view(np.uint32)[bits], g.view(np.uint32)[bits]):
                problems.append(f"{what} isv fingerprint bits differ")
            d = np.abs(w.astype(np.float64) - g) / np.maximum(np.abs(w.astype(np.float64)), 1.0)
            if not np.array_equal(np.isnan(w), np.isnan(g)) or np.nanmax(d) > tol:
                i = int(np.nanargmax(d))
                problems.append(f"{what} isv[{i}] ({isv_mod.slot_at(i).name if isv_mod.slot_at(i) else i}):"
                                f" {g[i]!r} vs reference {w[i]!r}")
        elif w.dtype.kind in "iu":
            if not np.array_equal(w, g):
                problems.append(f"{what} {key}: {g.tolist()[:60]} != reference {w.tolist()[:60]}")
        else:
            if not np.array_equal(np.isnan(w), np.isnan(g)):
                problems.append(f"{what} {key}: NaN maps differ")
            r = _rel_diff(w, g)
            if r > tol:
                problems.append(f"{what} {key}: max rel diff {r:.2e} > {tol:.0e}")
    return problems


def _compare_scalars(want, got, tol: float) -> list[str]:
    problems = []
    for f in ("step", "read_at", "fresh", "safety_clip_fired", "flags"):
        if getattr(want, f) != getattr(got, f):
            problems.append(f"scalars.{f}: {getattr(got, f)!r} != reference {getattr(want, f)!r}")
    for f in SCALAR_FIELDS:
        w, g = getattr(want, f), getattr(got, f)
        if np.isnan(w) or np.isnan(g):
            if not (np.isnan(w) and np.isnan(g)):
                problems.append(f"scalars.{f}: {g!r} vs reference {w!r}")
        elif abs(g - w) > tol * max(abs(w), 1e-6):
            problems.append(f"scalars.{f}: {g!r} vs reference {w!r}")
    return problems


def _reference_intermediates(ref: RefTrainer, batch: Batch) -> dict[str, np.ndarray]:
    """What the reference step computes before updating anything (same state, same batch)."""
    c = ref.config
    with np.errstate(all="ignore"):
        out = loss_and_grads(c, ref.params, ref.target, batch, q_abs_ref=ref.isv.get("Q_ABS_REF"),
                             h2_bound=ref._bound(c.h2_clamp_mult, "H_S2_RMS_EMA"), layout=ref.layout)
        grad, _ = budget_pipeline(c, out["grad_c51"], out["grad_cql"])
    z = dist.support(c.v_min, c.v_max, c.num_atoms)
    gaps = []
    for logp in out["online_next"].logp:  # relative margin of each double-DQN choice
        q = np.sort(dist.expected_q(logp, z), axis=1)
        gaps.append((q[:, -1] - q[:, -2]) / np.maximum(np.abs(q[:, -1]), 1e-3))
    return {
        "grad_c51": out["grad_c51"], "grad_cql": out["grad_cql"], "grad": grad,
        "td": out["td_errors"], "target_q": out["target_q"].T, "q_taken": out["q_taken"].T,
        "m": np.stack(out["m"]), "a_star": out["a_star"].T, "a_star_gap": np.stack(gaps),
    }


def _step_report(backend_name, fast, ref, batch, tol) -> list[str]:
    """One step of both from the same state: every state buffer, the step scalars, the flags
    and the intermediate buffers of the fast step. Prints a table of the relative differences."""
    inter = _reference_intermediates(ref, batch)
    with np.errstate(all="ignore"):
        want_scalars = ref.step(batch)
    got_scalars = fast.step(batch)
    problems = _compare_scalars(want_scalars, got_scalars, tol)
    problems += _compare_states(ref.state_dict(), fast.state_dict(), tol, "state")
    rows = []
    gap = inter.pop("a_star_gap")
    same_choice = fast.debug_buffer("a_star").reshape(gap.shape) == inter["a_star"]
    for name, want in inter.items():
        got = fast.debug_buffer(name).reshape(want.shape)
        if name == "a_star":
            # A double-DQN choice may differ only on a near tie (Q values equal within the
            # GEMM rounding); its projected distribution m then differs by design.
            flipped = int((~same_choice).sum())
            rows.append(f"a_star: {flipped} near-tie flips")
            if np.any(~same_choice & (gap > NEAR_TIE)):
                problems.append(f"a_star differs beyond near ties: {np.argwhere(~same_choice).tolist()}")
            continue
        if name in ("m", "target_q"):
            want, got = want[same_choice], got[same_choice]
        elif name == "td":
            want, got = want[same_choice.all(axis=0)], got[same_choice.all(axis=0)]
        r = _rel_diff(want, got)
        rows.append(f"{name}: {r:.1e}")
        if r > tol or not np.array_equal(np.isnan(want), np.isnan(got)):
            problems.append(f"intermediate {name}: max rel diff {r:.2e}")
    sd, sf = ref.state_dict(), fast.state_dict()
    rows += [f"{k}: {_rel_diff(sd[k], sf[k]):.1e}" for k in ("params", "target", "adam_m", "adam_v")]
    print(f"[{backend_name} {ref.config.precision} B={ref.config.batch_size}] max rel diffs: "
          + ", ".join(rows))
    return problems


# ============================================================================================
# Tests
# ============================================================================================


@pytest.mark.skipif(_GPU_OK, reason="a CUDA device is present")
def test_construction_without_a_gpu_says_so():
    from foxhunt.fast import NoCudaDeviceError, Trainer

    with pytest.raises(NoCudaDeviceError, match="no CUDA device"):
        Trainer(DQNConfig.preset("tiny"))


def test_package_exports_the_trainer():
    import foxhunt.fast
    from foxhunt.reference.backend import TrainerBackend, get_backend

    assert foxhunt.fast.Trainer is get_backend("fast")
    assert issubclass(foxhunt.fast.Trainer, TrainerBackend)
    assert foxhunt.fast.Trainer.backend_name == "fast"


def test_step_layout_covers_every_reference_sentinel_buffer():
    """The fused check watches exactly the reference's per-step buffers, online(s) rows only."""
    from foxhunt.fast.step_plan import StepLayout, sentinel_pieces

    for preset in ("tiny", "seed"):
        config = DQNConfig.preset(preset)
        lay = StepLayout(config)
        ref = RefTrainer(config.replace(readback_interval=1))
        batch = Batch.random(config, np.random.default_rng(0))
        with np.errstate(all="ignore"):
            out = loss_and_grads(config, ref.params, ref.target, batch, layout=ref.layout)
            grad, _ = budget_pipeline(config, out["grad_c51"], out["grad_cql"])
        want = ref._sentinel_buffers(batch, out, grad)
        pieces = sentinel_pieces(lay)
        assert sorted(pieces) == sorted(want)
        for name, buf in want.items():
            total = sum(p.count for p in pieces[name])
            if name.endswith("_max") and name != "atom_span_max" and name != "h2_max_abs":
                # parameter-group ranges include the padding between tensors (always zero)
                assert buf.size <= total < buf.size + 64 * len(lay.param_layout.tensors), name
            else:
                assert total == buf.size, name


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_initial_state_is_the_reference_state(backend, precision):
    name, make = backend
    config = DQNConfig.preset("tiny", precision=precision)
    want = RefTrainer(config, seed=5).state_dict()
    got = make(config, seed=5).state_dict()
    assert _compare_states(want, got, 0.0, "initial") == []
    for key in want:
        assert np.array_equal(want[key].view(np.uint8), got[key].view(np.uint8)), key


@pytest.mark.parametrize("preset", ["tiny", "seed"])
@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_one_step_from_a_shared_state_matches_the_reference(backend, precision, preset, monkeypatch):
    name, make = backend
    config = DQNConfig.preset(preset, precision=precision, readback_interval=1)
    tol = TOL[(name, precision)]
    ref, rng = _warm_reference(config, seed=11)
    orders = ("latest_first", "capture_order") if name == "emulated" else (None,)
    for order in orders:
        if order is not None:
            EMU.branch_order = order
        fast = make(config)
        fast.load_state_dict(ref.state_dict())
        twin = copy.deepcopy(ref)
        batch = Batch.random(config, rng)
        problems = _step_report(name, fast, twin, batch, tol)
        assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_three_steps_resynchronised_from_the_reference_each_step(backend, precision):
    name, make = backend
    config = DQNConfig.preset("tiny", precision=precision, readback_interval=1)
    tol = TOL[(name, precision)]
    ref, rng = _warm_reference(config, seed=2)
    fast = make(config)
    for k in range(3):
        fast.load_state_dict(ref.state_dict())
        batch = Batch.random(config, rng)
        problems = _step_report(name, fast, ref, batch, tol)  # steps ref too
        assert problems == [], f"step {k}:\n" + "\n".join(problems)


_INJECTIONS = {
    "state_nan": ("s", (2, 3), np.nan),
    "next_state_nan": ("s2", (1, 0), np.nan),
    "reward_inf": ("r", (3,), np.inf),
    "reward_nan": ("r", (0,), np.nan),
    "isw_nan": ("isw", (4,), np.nan),
    "param_nan": None,
}


@pytest.mark.parametrize("case", sorted(_INJECTIONS))
@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_nan_injection_gives_the_same_flags_and_nan_maps(backend, precision, case):
    name, make = backend
    config = DQNConfig.preset("tiny", precision=precision, readback_interval=1)
    ref, rng = _warm_reference(config, seed=7)
    batch = Batch.random(config, rng)
    state = ref.state_dict()
    spec = _INJECTIONS[case]
    if spec is None:
        params = state["params"].copy()
        params[ref.layout["w_v2"].offset + 5] = np.nan
        state["params"] = params
        ref.load_state_dict(state)
    else:
        field, pos, value = spec
        arr = getattr(batch, field).copy()
        arr[pos] = value
        batch = dataclasses.replace(batch, **{field: arr})
    fast = make(config)
    fast.load_state_dict(state)
    with np.errstate(all="ignore"):
        want = ref.step(batch)
    got = fast.step(batch)
    assert sentinels.format_flags(fast.flags) == sentinels.format_flags(ref.flags)
    assert np.array_equal(fast.flags, ref.flags)
    assert got.flags == want.flags and any(want.flags)
    for f in SCALAR_FIELDS:
        assert np.isnan(getattr(got, f)) == np.isnan(getattr(want, f)), f
    assert np.array_equal(np.isnan(fast.last_td_errors()), np.isnan(ref.last_td_errors()))
    sw, sg = ref.state_dict(), fast.state_dict()
    for key in sw:
        if sw[key].dtype.kind == "f":
            assert np.array_equal(np.isnan(sw[key]), np.isnan(sg[key])), key


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_deferred_readback_sequence_matches_the_reference(backend, precision):
    """120 steps at readback_interval 50, a NaN reward at step 100 (a readback: the next step
    reads fresh), then end_epoch: the same (step, read_at, fresh) sequence and flags as the
    reference run on the same batches, the same values at every fresh read (within the
    tolerance of trajectories that diverge slowly)."""
    name, make = backend
    config = DQNConfig.preset("tiny", precision=precision, readback_interval=50)
    ref = RefTrainer(config, seed=9)
    fast = make(config, seed=9)
    rng = np.random.default_rng(9)
    tol = 20 * TOL[(name, precision)]
    fresh_steps = []
    for step in range(1, 121):
        batch = Batch.random(config, rng)
        if step == 100:
            r = batch.r.copy()
            r[3] = np.nan
            batch = dataclasses.replace(batch, r=r)
        with np.errstate(all="ignore"):
            want = ref.step(batch)
        got = fast.step(batch)
        assert (got.step, got.read_at, got.fresh) == (want.step, want.read_at, want.fresh), step
        assert got.flags == want.flags, step
        problems = [p for p in _compare_scalars(want, got, tol) if "flags" not in p]
        assert problems == [], f"step {step}: " + "; ".join(problems)
        if got.fresh:
            fresh_steps.append(step)
    assert fresh_steps == [50, 100, 101]
    want, got = ref.end_epoch(), fast.end_epoch()
    assert (got.step, got.read_at, got.fresh) == (want.step, want.read_at, want.fresh) == (120, 120, True)
    assert _compare_scalars(want, got, tol) == []


def test_checkpoints_interchange_both_ways(backend, tmp_path):
    from foxhunt.fast.trainer import Trainer as FastTrainer

    name, make = backend
    config = DQNConfig.preset("tiny", precision="bf16", readback_interval=1)
    fast = make(config, seed=4)
    rng = np.random.default_rng(4)
    for _ in range(3):
        fast.step(Batch.random(config, rng))
    fast.save(tmp_path / "fast.safetensors")
    ref = RefTrainer.load(tmp_path / "fast.safetensors")
    want = fast.state_dict()
    got = ref.state_dict()
    for key in want:
        assert np.array_equal(want[key].view(np.uint8), got[key].view(np.uint8)), key
    with np.errstate(all="ignore"):
        ref.step(Batch.random(config, rng))
    ref.save(tmp_path / "ref.safetensors")
    back = FastTrainer.load(tmp_path / "ref.safetensors")
    try:
        want, got = ref.state_dict(), back.state_dict()
        for key in want:
            assert np.array_equal(want[key].view(np.uint8), got[key].view(np.uint8)), key
        assert back.step_count == ref.step_count == 4
    finally:
        back.close()


def test_fold_boundary_matches_the_reference_exactly(backend):
    name, make = backend
    config = DQNConfig.preset("tiny", precision="f32", readback_interval=1)
    ref, rng = _warm_reference(config, seed=6)
    state = ref.state_dict()
    isv = state["isv"].copy()
    isv[isv_mod.GRAD_NORM_SLOW_EMA_INDEX] = 3.5  # CrossFold: kept
    isv[isv_mod.Q_ABS_REF_INDEX] = 7.0
    state["isv"] = isv
    flags = np.zeros_like(state["flags"])
    flags[sentinels.index("h2")] = 1
    state["flags"] = flags
    ref.load_state_dict(state)
    fast = make(config)
    fast.load_state_dict(state)
    ref.fold_boundary()
    fast.fold_boundary()
    want, got = ref.state_dict(), fast.state_dict()
    for key in want:
        assert np.array_equal(want[key].view(np.uint8), got[key].view(np.uint8)), key
    assert not got["flags"].any() and got["adam_t"][0] == 0
    assert np.array_equal(got["target"], got["params"])


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_q_values_and_td_errors_match_the_reference(backend, precision):
    name, make = backend
    config = DQNConfig.preset("tiny", precision=precision, readback_interval=1)
    tol = TOL[(name, precision)]
    ref, rng = _warm_reference(config, seed=8)
    fast = make(config)
    fast.load_state_dict(ref.state_dict())
    with pytest.raises(RuntimeError, match="no step"):
        fast.last_td_errors()
    states = rng.standard_normal((7, config.state_dim)).astype(np.float32)
    for want, got in zip(ref.q_values(states), fast.q_values(states)):
        assert got.shape == want.shape and got.dtype == np.float32
        assert _rel_diff(want, got) <= tol
    with pytest.raises(ValueError, match="states"):
        fast.q_values(states[:, :3])
    batch = Batch.random(config, rng)
    with np.errstate(all="ignore"):
        ref.step(batch)
    fast.step(batch)
    want, got = ref.last_td_errors(), fast.last_td_errors()
    assert got.shape == (config.batch_size,) and _rel_diff(want, got) <= tol
    # The q_values graph of 7 rows is replayed: it reads the weights after the step and the new
    # states (float64 input is cast), and earlier results are copies, not the pinned output.
    before = fast.q_values(states)
    kept = [q.copy() for q in before]
    other = rng.standard_normal((7, config.state_dim))
    for want, got in zip(ref.q_values(other.astype(np.float32)), fast.q_values(other)):
        assert _rel_diff(want, got) <= tol
    for q, k in zip(before, kept):
        assert np.array_equal(q, k)
    for want, got in zip(ref.q_values(states[:1]), fast.q_values(states[:1])):
        assert got.shape == want.shape and _rel_diff(want, got) <= tol


def test_q_values_keeps_a_bounded_cache_of_graphs(backend):
    """One graph per row count, at most EVAL_CACHE_SIZE of them (least recently used evicted);
    an evicted size is rebuilt on its next call and still gives the reference's values."""
    from foxhunt.fast import trainer as fast_trainer

    name, make = backend
    config = DQNConfig.preset("tiny", precision="f32")
    ref, rng = _warm_reference(config, seed=3)
    fast = make(config)
    fast.load_state_dict(ref.state_dict())
    size = fast_trainer.EVAL_CACHE_SIZE
    states = rng.standard_normal((size + 3, config.state_dim)).astype(np.float32)
    for rows in range(1, size + 3):
        fast.q_values(states[:rows])
        fast.q_values(states[:1])  # 1 row stays the most recently used
    assert sorted(fast._eval_cache) == [1, *range(4, size + 3)]  # 1 and the 7 latest
    for rows in (2, size + 2, 1):  # rebuilt after its eviction, kept, kept
        for want, got in zip(ref.q_values(states[:rows]), fast.q_values(states[:rows])):
            assert got.shape == want.shape and _rel_diff(want, got) <= TOL[(name, "f32")]
    assert len(fast._eval_cache) == size and list(fast._eval_cache)[-3:] == [2, size + 2, 1]


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_gemm_epilogue_fallbacks_give_the_same_step(monkeypatch, _nvrtc, precision):
    """Where cuBLASLt refuses DRELU_BGRAD or the bias-gradient epilogue, the step runs a plain
    GEMM plus relu_mask / bias_grad_reduce instead (emulated: every such plan refused)."""
    from foxhunt.fast.gemm import GemmPlanError

    if _nvrtc is not None:
        pytest.skip(_nvrtc)
    _install_emulator(monkeypatch, "latest_first")

    class Refusing(_GemmPlan):
        def __init__(self, *args, epilogue=None, **kwargs):
            if epilogue in ("drelu_bgrad", "bgrada"):
                raise GemmPlanError(f"emulated refusal of {epilogue}")
            super().__init__(*args, epilogue=epilogue, **kwargs)

    from foxhunt.fast import gemm as fgemm
    from foxhunt.fast.trainer import Trainer

    monkeypatch.setattr(fgemm, "GemmPlan", Refusing)
    config = DQNConfig.preset("tiny", precision=precision, readback_interval=1)
    ref, rng = _warm_reference(config, seed=12)
    fast = Trainer(config)
    assert len(fast.gemm_fallbacks) == 2 * (2 * len(config.branches) + 4)
    fast.load_state_dict(ref.state_dict())
    problems = _step_report("emulated-fallback", fast, ref, Batch.random(config, rng),
                            TOL[("emulated", precision)])
    assert problems == [], "\n".join(problems)


def test_step_rejects_an_invalid_batch(backend):
    name, make = backend
    config = DQNConfig.preset("tiny", precision="f32")
    fast = make(config)
    batch = Batch.random(config, np.random.default_rng(0))
    bad = dataclasses.replace(batch, a=np.full_like(batch.a, 7))
    with pytest.raises(ValueError, match="batch.a"):
        fast.step(bad)
    assert fast.step_count == 0


@pytest.mark.parametrize("order", ["latest_first", "capture_order"])
def test_emulated_capture_forks_at_the_start_and_keeps_its_checks(monkeypatch, order):
    """The emulated capture behind every ``emulated`` test: a side stream forked before any
    work on the capture stream starts with a root node (as in CUDA) and replay keeps every edge
    in both orders; work on a stream not forked from the capture, a branch not joined back and
    a wait on an event of another capture are rejected."""
    monkeypatch.setattr(EMU, "branch_order", order)
    main, side = _Stream(), _Stream(side=True)
    fork, join = _Event(), _Event()
    log = []

    def node(name, stream):
        EMU.dispatch(lambda: log.append(name), stream)

    with _Graph(main) as graph:
        _Driver.cuEventRecord(fork, main)  # nothing on the capture stream yet
        _Driver.cuStreamWaitEvent(side, fork, 0)
        node("s1", side)
        node("s2", side)
        node("m1", main)
        _Driver.cuEventRecord(join, side)
        _Driver.cuStreamWaitEvent(main, join, 0)
        node("m2", main)
    assert graph.deps == [set(), {0}, set(), {1, 2}]  # two roots: s1 (side stream) and m1
    graph.replay()
    want = ["m1", "s1", "s2", "m2"] if order == "latest_first" else ["s1", "s2", "m1", "m2"]
    assert log == want

    with pytest.raises(AssertionError, match="not forked"), _Graph(main):
        node("x", _Stream(side=True))
    with pytest.raises(AssertionError, match="unjoined nodes \\[0\\]"), _Graph(main):
        _Driver.cuEventRecord(fork, main)
        _Driver.cuStreamWaitEvent(side, fork, 0)
        node("s", side)
        node("m", main)
    with pytest.raises(AssertionError, match="not recorded in this capture"), _Graph(main):
        _Driver.cuStreamWaitEvent(side, join, 0)  # join was recorded in an earlier capture
    assert EMU.capture is None


def test_graph_node_counts_are_reported(backend):
    name, make = backend
    for precision in ("f32", "bf16"):
        for preset in ("tiny", "seed"):
            fast = make(DQNConfig.preset(preset, precision=precision))
            up, g1, g2 = fast.graph_node_counts
            assert fast.node_count == up + g1 + g2 > 0
            # the upload graph: the batch copy
            assert up == 1 == fast.planned_launches[0]
            # cuBLASLt may launch more than one kernel per GEMM; never fewer nodes than planned
            assert g1 >= fast.planned_launches[1] and g2 >= fast.planned_launches[2]
            print(f"[{name} {preset} {precision}] graph nodes {up} + {g1} + {g2} = {fast.node_count} "
                  f"(planned launches {fast.planned_launches}); GEMM fallbacks: "
                  f"{list(fast.gemm_fallbacks) or 'none'}")


@pytest.mark.gpu
@pytest.mark.skipif(not _GPU_OK, reason=f"no CUDA device/driver: {_GPU_REASON}")
@pytest.mark.parametrize("workspace", [None, 0], ids=["workspace-default", "workspace-0"])
def test_graph_replay_timing(monkeypatch, workspace):
    """Prints TIMING lines: the seed step's graph replays per step (the upload graph on its
    stream, graph 1 and graph 2, as ``step`` enqueues them, without the host's batch writes),
    node counts and kinds, for both precisions (a benchmark print; asserts only that it ran)."""
    from cuda.bindings import driver as drv

    from foxhunt.fast import step_plan
    from foxhunt.fast.device import call
    from foxhunt.fast.trainer import Trainer

    monkeypatch.setattr(step_plan, "GEMM_WORKSPACE_LIMIT", workspace, raising=False)
    for precision in ("bf16", "f32"):
        config = DQNConfig.preset("seed", precision=precision)
        fast = Trainer(config)
        try:
            rng = np.random.default_rng(0)
            for _ in range(3):
                fast.step(Batch.random(config, rng))
            stream = fast._stream
            up, g1, g2 = fast._upload[0], fast._graph1, fast._graph2
            start, end = call(drv.cuEventCreate, 0), call(drv.cuEventCreate, 0)
            times = []
            for _ in range(5):
                call(drv.cuEventRecord, start, stream.handle)
                for i in range(200):
                    fast._launch(i % 2)
                call(drv.cuEventRecord, end, stream.handle)
                call(drv.cuEventSynchronize, end)
                times.append(call(drv.cuEventElapsedTime, start, end) * 1e3 / 200)
            drv.cuEventDestroy(start)
            drv.cuEventDestroy(end)
            kinds = up.node_types() + g1.node_types() + g2.node_types()
            print(f"TIMING seed {precision} workspace={workspace}: {np.median(times):.1f} us/step "
                  f"(graph replays, median of 5x200; min {min(times):.1f}), nodes "
                  f"{up.node_count} + {g1.node_count} + {g2.node_count} = {fast.node_count} "
                  f"{dict(kinds)}, "
                  f"fallbacks {list(fast.gemm_fallbacks) or 'none'}")
            assert np.isfinite(np.median(times))
        finally:
            fast.close()


def test_step_orders_the_upload_by_device_events(monkeypatch, _nvrtc):
    """``step`` enqueues, in this order: the upload stream waits for the last graph 1 (the
    last reader of the batch), the upload graph of the step's staging slot, ``uploaded[slot]``
    recorded on the upload stream, the step stream waits for it, graph 1, ``graph1_done``
    recorded on the step stream, graph 2: device-side ordering only (no host sync)."""
    if _nvrtc is not None:
        pytest.skip(_nvrtc)
    _install_emulator(monkeypatch, "capture_order")
    from foxhunt.fast.trainer import Trainer

    config = DQNConfig.preset("tiny")
    fast = Trainer(config)
    try:
        log = []
        monkeypatch.setattr(_Driver, "cuStreamWaitEvent",
                            staticmethod(lambda stream, event, flags: log.append(("wait", stream, event))))
        monkeypatch.setattr(_Driver, "cuEventRecord",
                            staticmethod(lambda event, stream: log.append(("record", event, stream))))
        graphs = {"upload0": fast._upload[0], "upload1": fast._upload[1], "graph1": fast._graph1,
                  "graph2": fast._graph2}
        for name, graph in graphs.items():
            def replay(stream=None, _run=graph.replay, _name=name):
                log.append((_name, stream))
                _run(stream)
            monkeypatch.setattr(graph, "replay", replay)
        rng = np.random.default_rng(0)
        up, main = fast._upload_stream.handle, fast._stream.handle
        for slot in (0, 1):
            log.clear()
            fast.step(Batch.random(config, rng))
            assert log == [("wait", up, fast._graph1_done), (f"upload{slot}", up),
                           ("record", fast._uploaded[slot], up), ("wait", main, fast._uploaded[slot]),
                           ("graph1", None), ("record", fast._graph1_done, main), ("graph2", None)]
    finally:
        fast.close()
