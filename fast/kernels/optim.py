"""Fast-path launchers of the optimiser kernels (``cuda_src/optim.cu``), twins of
``foxhunt.reference.kernels.optim`` under the same names and signatures.

Each public function is a numpy-in/numpy-out test entry (conformance and debugging): it
validates with the reference's ``validate_<name>`` (or check; same ``ValueError``), launches
the CUDA kernel once through ``_runtime.call`` and returns what the reference returns, with the same dtypes and shapes. The
trainer launches the same kernels on arena pointers inside CUDA graphs, with the ``plan_*``
launch shapes below.

Kernel arguments (the trainer passes the same, with arena pointers):

- flat buffers as pointers plus their length ``n`` (int64); in-place kernels update their first
  buffer (``x``, ``y``, ``param``/``m``/``v``, ``target``); the fused budget tail
  ``clip_saxpy_norm_partial`` reads ``base``/``inject`` and the two loss norms' phase-1
  partials and writes the separate ``out``, ``partials`` and the two norms (after its inputs);
  ``polyak_update_mirror`` updates ``target`` and writes the
  two BF16 mirrors (uint16 bit patterns); ``polyak_update_mirror_check`` also takes
  ``nan_check_fused``'s tables (``buffers`` addresses, ``lengths``, ``thresholds``, ``flags``,
  ``n_entries``) and stores the flags of the entries that fire;
- **device scalars**: values produced on the device within a step are read through pointers,
  so a captured graph always sees the current value: ``norm_sq`` (float32, from
  ``grad_norm_sq`` / ``grad_norm_final``) of the clips, and Adam's ``step`` (int64),
  ``grad_scale`` and ``weight_clamp`` (float32). A test entry uploads its scalar argument into
  a one-element buffer;
- configuration constants by value (float32): ``max_norm``, ``a``, ``lr``, ``beta1``,
  ``beta2``, ``eps``, ``weight_decay``, ``tau``.

Numerics: elementwise kernels round exactly where the reference does (``__fmul_rn``,
``__fadd_rn``, correctly rounded ``/`` and ``sqrtf``): bitwise equal to the reference. Adam's
bias corrections ``1 - beta^t`` take the power in double and round it once to float32 (the
correctly rounded float32 power but for cases of probability ~2^-28). The reference's
``np.power`` on float32 scalars is not correctly rounded and depends on the CPU (NumPy's SVML
power where the CPU has AVX-512, glibc's ``powf`` otherwise); on an AVX-512 machine it differs
by one ulp for some steps (e.g. ``t = 4`` at ``beta1 = 0.9``; not the conformance samples'
``step = 3``), and then ``param`` differs by several ulp (8 seen) where the update nearly
cancels it (beyond the 4-ulp tolerance). The reference should take the power the same way,
``np.float32(float(beta) ** float(np.float32(t)))`` (portable and correctly rounded).
Norms are fixed-tree float32 reductions (deterministic, no atomics); they differ from NumPy's
pairwise order by rounding, within the reduction tolerance.
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.kernels._runtime import (FLAT_VEC_WIDTH, In, InOut, Out, blocks, call, launch,
                                           runtime)
from foxhunt.reference.kernels.argcheck import check_f32_array
from foxhunt.reference.kernels.safety import validate_nan_check_fused
from foxhunt.reference.kernels.optim import (
    AdamState,
    ClipSaxpyPartial,
    PolyakMirror,
    PolyakMirrorCheck,
    validate_adam_update,
    validate_adam_update_norm,
    validate_clip_grad_inplace,
    validate_clip_saxpy_norm_partial,
    validate_clipped_saxpy,
    validate_grad_norm_partial,
    validate_polyak_check_entries,
    validate_polyak_update,
    validate_saxpy,
)

F32 = np.float32

#: Threads per block of the elementwise kernels (grid-stride loops: any grid is correct).
ELEMENTWISE_THREADS = 256
#: Grid cap of the elementwise kernels: enough blocks to fill an H200, the loops cover the rest.
ELEMENTWISE_MAX_BLOCKS = 4096
#: Threads of the one-block reductions (``grad_norm_sq``, ``grad_norm_final``), at most.
REDUCTION_MAX_THREADS = 1024
#: Threads per block of ``grad_norm_partial`` and the fused budget tail, at most: the kernels'
#: launch bound (HB_PARTIAL_MAX_THREADS in optim.cu; a larger block does not launch).
PARTIAL_MAX_THREADS = 256
#: Block sizes of the reductions are multiples of a warp (the block trees need whole warps).
WARP = 32

Plan = tuple[int, int, int]


# ---------------------------------------------------------------------------------------------
# Launch plans: (grid, block, dynamic shared memory bytes)
# ---------------------------------------------------------------------------------------------


def _warp_multiple(count: int, cap: int) -> int:
    """Threads for ``count`` items: ``count`` rounded up to whole warps, within ``[32, cap]``."""
    return min(cap, max(WARP, -(-int(count) // WARP) * WARP))


def plan_elementwise(n: int) -> Plan:
    """Grid-stride launch over ``n`` elements (``clip_grad_inplace``, the SAXPYs, Adam, Polyak)."""
    return min(blocks(n, ELEMENTWISE_THREADS), ELEMENTWISE_MAX_BLOCKS), ELEMENTWISE_THREADS, 0


def plan_grad_norm_sq(n: int) -> Plan:
    """One block; its size (which fixes the reduction tree) depends on ``n`` only."""
    return 1, _warp_multiple(n, REDUCTION_MAX_THREADS), 0


def plan_grad_norm_partial(n: int, block_size: int) -> Plan:
    """One block per ``block_size`` segment (at least one block, which writes nothing if n = 0).
    The kernel's blocks stride over the segments, so any smaller grid (>= 1) gives the same
    partials; the block size fixes the tree."""
    return blocks(n, block_size), _warp_multiple(block_size, PARTIAL_MAX_THREADS), 0


def plan_grad_norm_final(count: int) -> Plan:
    """One block over the ``count`` partials."""
    return 1, _warp_multiple(count, REDUCTION_MAX_THREADS), 0


def plan_clip_saxpy_norm_partial(n: int, block_size: int) -> Plan:
    """``grad_norm_partial``'s launch (one block per ``block_size`` segment, the same block
    size): the fused partials then follow grad_norm_partial's tree and equal its bits. As
    there, the blocks stride over the segments: any smaller grid (>= 1) gives the same
    outputs."""
    return plan_grad_norm_partial(n, block_size)


def final_threads_clip_saxpy_norm_partial(count: int) -> int:
    """The kernel's ``final_threads`` argument for ``count`` partials per norm: the block of
    ``plan_grad_norm_final(count)``, whose tree the fused kernel replays for both norms (so
    they are ``grad_norm_final``'s bits)."""
    return plan_grad_norm_final(count)[1]


plan_clip_grad_inplace = plan_elementwise


def plan_saxpy(n: int) -> Plan:
    """``plan_elementwise`` with one thread per group of ``FLAT_VEC_WIDTH`` elements (the
    kernel's float4 path; its scalar fallback strides over the same grid), the same block and
    grid cap. Any grid gives the same bits."""
    grid = min(blocks(n, ELEMENTWISE_THREADS * FLAT_VEC_WIDTH), ELEMENTWISE_MAX_BLOCKS)
    return grid, ELEMENTWISE_THREADS, 0


plan_clipped_saxpy = plan_elementwise
#: Elements per thread and grid-stride round of ``adam_update`` (ADAM_UNROLL in optim.cu).
#: Measured on the H200 (seed preset, 0.29M elements, a chain of 20 launches in one graph):
#: 2 per thread (568 blocks) 6.1 us per launch, 4 per thread 6.5 us, 1 per thread 6.6 us.
ADAM_UNROLL = 2


def plan_adam_update(n: int) -> Plan:
    """``plan_elementwise`` with ``ADAM_UNROLL`` elements per thread: one grid-stride round
    (the kernel's loads then overlap its per-step scalars; see optim.cu)."""
    grid = min(blocks(n, ELEMENTWISE_THREADS * ADAM_UNROLL), ELEMENTWISE_MAX_BLOCKS)
    return grid, ELEMENTWISE_THREADS, 0


#: ``adam_update_norm``'s launch is ``adam_update``'s (its extra block reduction replays
#: ``grad_norm_final``'s tree in any block).
plan_adam_update_norm = plan_adam_update
#: ``adam_update_norm``'s ``final_threads`` argument for ``count`` partials: the block of
#: ``plan_grad_norm_final(count)`` (so its total is ``grad_norm_final``'s / ``step_scalars``' bits).
final_threads_adam_update_norm = final_threads_clip_saxpy_norm_partial


plan_polyak_update = plan_elementwise


def plan_polyak_update_mirror(n: int) -> Plan:
    """``plan_elementwise`` with one thread per group of ``FLAT_VEC_WIDTH`` elements
    (the kernel's float4 path; its scalar fallback strides over the same grid), the same block
    and grid cap. Also ``polyak_update_mirror_ptr``'s."""
    grid = min(blocks(n, ELEMENTWISE_THREADS * FLAT_VEC_WIDTH), ELEMENTWISE_MAX_BLOCKS)
    return grid, ELEMENTWISE_THREADS, 0


def _device_scalar(value, dtype) -> In:
    """A scalar the kernel reads through a pointer, as a one-element input buffer."""
    return In(np.array([value], dtype=dtype))


# ---------------------------------------------------------------------------------------------
# Gradient norms
# ---------------------------------------------------------------------------------------------


def grad_norm_sq(x: np.ndarray) -> np.float32:
    """Test entry of the CUDA ``grad_norm_sq``: ``sum x_i^2`` over the finite ``x_i`` (float32).

    Contract as ``reference.kernels.optim.grad_norm_sq``; one block, fixed reduction tree.
    """
    check_f32_array("x", x)
    grid, block, smem = plan_grad_norm_sq(x.size)
    (out,) = call("grad_norm_sq", grid, block, In(x), x.size, Out((1,), F32), shared_mem=smem)
    return F32(out[0])


def grad_norm_partial(x: np.ndarray, block_size: int) -> np.ndarray:
    """Test entry of the CUDA ``grad_norm_partial``: float32[ceil(N / block_size)] sums of finite
    squares, one CUDA block per segment (the plan's grid). Contract as the reference twin."""
    bs = validate_grad_norm_partial(x, block_size)
    n = x.shape[0]
    bs = min(bs, max(n, 1))  # same partials; keeps the kernel's int64 arithmetic in range
    grid, block, smem = plan_grad_norm_partial(n, bs)
    (partials,) = call("grad_norm_partial", grid, block, In(x), n, bs,
                       Out((-(-n // bs),), F32), shared_mem=smem)
    return partials


def grad_norm_final(partials: np.ndarray) -> np.float32:
    """Test entry of the CUDA ``grad_norm_final``: the plain float32 sum of the partials (NaN and
    Inf propagate). Contract as the reference twin."""
    check_f32_array("partials", partials, ndim=1)
    count = partials.shape[0]
    grid, block, smem = plan_grad_norm_final(count)
    (out,) = call("grad_norm_final", grid, block, In(partials), count, Out((1,), F32),
                  shared_mem=smem)
    return F32(out[0])


# ---------------------------------------------------------------------------------------------
# Clip and SAXPY
# ---------------------------------------------------------------------------------------------


def clip_grad_inplace(x: np.ndarray, max_norm: float, norm_sq: float) -> np.ndarray:
    """Test entry of the CUDA ``clip_grad_inplace``: ``x * clip_scale(norm_sq, max_norm)``.

    The kernel reads ``norm_sq`` from device memory. Contract as the reference twin (bitwise).
    """
    mn, ns = validate_clip_grad_inplace(x, max_norm, norm_sq)
    grid, block, smem = plan_clip_grad_inplace(x.size)
    (out,) = call("clip_grad_inplace", grid, block, InOut(x), x.size, mn, _device_scalar(ns, F32),
                  shared_mem=smem)
    return out


def saxpy(y: np.ndarray, x: np.ndarray, a: float) -> np.ndarray:
    """Test entry of the CUDA ``saxpy``: ``y_i + a * x_i`` where ``x_i`` is finite, else ``y_i``.
    Contract as the reference twin (bitwise)."""
    a32 = validate_saxpy(y, x, a)
    grid, block, smem = plan_saxpy(y.size)
    (out,) = call("saxpy", grid, block, InOut(y), In(x), y.size, a32, shared_mem=smem)
    return out


def clipped_saxpy(y: np.ndarray, x: np.ndarray, a: float, max_norm: float,
                  norm_sq: float) -> np.ndarray:
    """Test entry of the CUDA ``clipped_saxpy``: ``y_i + a * (x_i * s)`` where ``x_i`` is finite,
    ``s = clip_scale(norm_sq, max_norm)`` (``norm_sq`` read from device memory). Contract as
    the reference twin (bitwise)."""
    a32, mn, ns = validate_clipped_saxpy(y, x, a, max_norm, norm_sq)
    grid, block, smem = plan_clipped_saxpy(y.size)
    (out,) = call("clipped_saxpy", grid, block, InOut(y), In(x), y.size, a32, mn,
                  _device_scalar(ns, F32), shared_mem=smem)
    return out


def clip_saxpy_norm_partial(base: np.ndarray, inject: np.ndarray, base_max_norm: float,
                            base_partials: np.ndarray, a: float, inject_max_norm: float,
                            inject_partials: np.ndarray, block_size: int) -> ClipSaxpyPartial:
    """Test entry of the CUDA ``clip_saxpy_norm_partial``: ``base_norm_sq = grad_norm_final(
    base_partials)``, ``inject_norm_sq = grad_norm_final(inject_partials)``, ``out =
    clipped_saxpy(clip_grad_inplace(base, ...), inject, a, ...)`` and ``partials =
    grad_norm_partial(out, block_size)`` in one launch. Contract as the reference twin; the
    norms are ``grad_norm_final``'s fixed tree (bitwise equal to its launch), ``out`` bitwise
    given the norms, ``partials`` the fixed tree of ``grad_norm_partial``. Returns
    ``ClipSaxpyPartial(out, partials, base_norm_sq, inject_norm_sq)``."""
    args = validate_clip_saxpy_norm_partial(base, inject, base_max_norm, base_partials, a,
                                            inject_max_norm, inject_partials, block_size)
    n = base.shape[0]
    count = base_partials.shape[0]
    bs = min(args.block_size, max(n, 1))  # as grad_norm_partial's entry: same segments
    grid, block, smem = plan_clip_saxpy_norm_partial(n, bs)
    out, partials, base_sq, inject_sq = call(
        "clip_saxpy_norm_partial", grid, block, In(base), In(inject), n, args.base_max_norm,
        In(base_partials), args.a, args.inject_max_norm, In(inject_partials), count,
        final_threads_clip_saxpy_norm_partial(count), bs, Out((n,), F32),
        Out((-(-n // bs),), F32), Out((1,), F32), Out((1,), F32), shared_mem=smem)
    return ClipSaxpyPartial(out=out, partials=partials, base_norm_sq=F32(base_sq[0]),
                            inject_norm_sq=F32(inject_sq[0]))


# ---------------------------------------------------------------------------------------------
# Adam
# ---------------------------------------------------------------------------------------------


def adam_update(param: np.ndarray, grad: np.ndarray, m: np.ndarray, v: np.ndarray, *,
                step: int, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, grad_scale: float, weight_clamp: float) -> AdamState:
    """Test entry of the CUDA ``adam_update`` (AdamW, per-element guard, Mech 9 clamp).

    ``step``, ``grad_scale`` and ``weight_clamp`` are read from device memory by the kernel.
    Contract and order of roundings as the reference twin; bitwise equal except where the
    bias correction's power differs (module docstring). Returns ``AdamState(param, m, v)``.
    """
    t, lr32, b1, b2, eps32, wd, scale, clamp = validate_adam_update(
        param, grad, m, v, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay, grad_scale=grad_scale, weight_clamp=weight_clamp)
    if t >= 2**63:
        raise ValueError(f"step={step!r}: must be an integer >= 1 and < 2**63 "
                         "(int64 on the device)")
    grid, block, smem = plan_adam_update(param.size)
    new_param, new_m, new_v = call(
        "adam_update", grid, block, InOut(param), In(grad), InOut(m), InOut(v), param.size,
        _device_scalar(t, np.int64), lr32, b1, b2, eps32, wd, _device_scalar(scale, F32),
        _device_scalar(clamp, F32), shared_mem=smem)
    return AdamState(new_param, new_m, new_v)


def adam_update_norm(param: np.ndarray, grad: np.ndarray, m: np.ndarray, v: np.ndarray,
                     total_partials: np.ndarray, clip_bound, *, step: int, lr: float,
                     beta1: float, beta2: float, eps: float, weight_decay: float,
                     weight_clamp: float) -> AdamState:
    """Test entry of the CUDA ``adam_update_norm`` (``adam_update`` with its gradient scale
    from the total norm's partials; contract as the reference twin). ``step``, ``clip_bound``
    and ``weight_clamp`` are read from device memory by the kernel. Returns
    ``AdamState(param, m, v)``."""
    t, lr32, b1, b2, eps32, wd, _, clamp = validate_adam_update_norm(
        param, grad, m, v, total_partials, clip_bound, step=step, lr=lr, beta1=beta1,
        beta2=beta2, eps=eps, weight_decay=weight_decay, weight_clamp=weight_clamp)
    if t >= 2**63:
        raise ValueError(f"step={step!r}: must be an integer >= 1 and < 2**63 "
                         "(int64 on the device)")
    count = total_partials.size
    grid, block, smem = plan_adam_update_norm(param.size)
    new_param, new_m, new_v = call(
        "adam_update_norm", grid, block, InOut(param), In(grad), InOut(m), InOut(v), param.size,
        _device_scalar(t, np.int64), lr32, b1, b2, eps32, wd, In(total_partials), count,
        final_threads_adam_update_norm(count), _device_scalar(np.float32(clip_bound), F32),
        _device_scalar(clamp, F32), shared_mem=smem)
    return AdamState(new_param, new_m, new_v)


# ---------------------------------------------------------------------------------------------
# Target network
# ---------------------------------------------------------------------------------------------


def polyak_update(target: np.ndarray, online: np.ndarray, tau: float) -> np.ndarray:
    """Test entry of the CUDA ``polyak_update``: ``(1 - tau) * target + tau * online``.
    Contract as the reference twin (bitwise)."""
    tau32 = validate_polyak_update(target, online, tau)
    grid, block, smem = plan_polyak_update(target.size)
    (out,) = call("polyak_update", grid, block, InOut(target), In(online), target.size, tau32,
                  shared_mem=smem)
    return out


def polyak_update_mirror(target: np.ndarray, online: np.ndarray, tau: float) -> PolyakMirror:
    """Test entry of the CUDA ``polyak_update_mirror``: ``polyak_update`` and the BF16 mirrors
    of ``online`` and of the new target in one launch. Contract as the reference twin
    (bitwise). Returns ``PolyakMirror(target, online_bf16, target_bf16)``."""
    tau32 = validate_polyak_update(target, online, tau)
    grid, block, smem = plan_polyak_update_mirror(target.size)
    new_target, online_bf16, target_bf16 = call(
        "polyak_update_mirror", grid, block, InOut(target), In(online), target.size, tau32,
        Out(target.shape, np.uint16), Out(target.shape, np.uint16), shared_mem=smem)
    return PolyakMirror(target=new_target, online_bf16=online_bf16, target_bf16=target_bf16)


def polyak_update_mirror_ptr(target: np.ndarray, online: np.ndarray, tau: float) -> PolyakMirror:
    """Test entry of the CUDA ``polyak_update_mirror_ptr`` (``tau`` passed in device memory);
    contract as the reference twin (bitwise)."""
    tau32 = validate_polyak_update(target, online, tau)
    grid, block, smem = plan_polyak_update_mirror(target.size)
    new_target, online_bf16, target_bf16 = call(
        "polyak_update_mirror_ptr", grid, block, InOut(target), In(online), target.size,
        _device_scalar(tau32, F32),
        Out(target.shape, np.uint16), Out(target.shape, np.uint16), shared_mem=smem)
    return PolyakMirror(target=new_target, online_bf16=online_bf16, target_bf16=target_bf16)


def polyak_update_mirror_check(target: np.ndarray, online: np.ndarray, tau: float, entries,
                               flags: np.ndarray, thresholds: np.ndarray) -> PolyakMirrorCheck:
    """Test entry of the CUDA ``polyak_update_mirror_check``: ``polyak_update_mirror`` and the
    sentinel check of its result in one launch; contract as the reference twin (bitwise). The
    entry uploads ``target`` and ``online`` to allocations of its own and builds the kernel's
    tables (``nan_check_fused``'s: addresses, 0 for a ``None`` or empty entry, and lengths) with
    each entry's address inside them."""
    tau32 = validate_polyak_update(target, online, tau)
    checked = validate_polyak_check_entries(entries, online.size)
    validate_nan_check_fused([None] * len(checked), flags, thresholds)
    device = runtime().device
    hosts = {"target": np.ascontiguousarray(target), "online": np.ascontiguousarray(online)}
    allocs = {name: device.alloc(max(host.nbytes, 4)) for name, host in hosts.items()}
    try:
        for name, host in hosts.items():
            device.copy_to_device(allocs[name].ptr, host)
        addresses = np.zeros(len(checked), dtype=np.uint64)
        lengths = np.zeros(len(checked), dtype=np.int64)
        for k, entry in enumerate(checked):
            if entry is not None and entry[2] > 0:
                source, offset, count = entry
                addresses[k] = allocs[source].ptr + 4 * int(offset)
                lengths[k] = count
        online_bf16, target_bf16, new_flags = launch(
            "polyak_update_mirror_check", plan_polyak_update_mirror(target.size),
            allocs["target"].ptr, allocs["online"].ptr, target.size, tau32,
            Out(target.shape, np.uint16), Out(target.shape, np.uint16), In(addresses),
            In(lengths), In(thresholds), InOut(flags), len(checked))
        new_target = device.copy_to_host(np.empty_like(hosts["target"]), allocs["target"].ptr)
    finally:
        for alloc in allocs.values():
            alloc.free()
    return PolyakMirrorCheck(new_target, online_bf16, target_bf16, new_flags)


KERNELS = {
    "grad_norm_sq": grad_norm_sq,
    "grad_norm_partial": grad_norm_partial,
    "grad_norm_final": grad_norm_final,
    "clip_grad_inplace": clip_grad_inplace,
    "saxpy": saxpy,
    "clipped_saxpy": clipped_saxpy,
    "adam_update": adam_update,
    "adam_update_norm": adam_update_norm,
    "polyak_update": polyak_update,
    "clip_saxpy_norm_partial": clip_saxpy_norm_partial,
    "polyak_update_mirror": polyak_update_mirror,
    "polyak_update_mirror_ptr": polyak_update_mirror_ptr,
    "polyak_update_mirror_check": polyak_update_mirror_check,
}

__all__ = [
    "KERNELS", "adam_update", "adam_update_norm", "clip_grad_inplace", "clip_saxpy_norm_partial",
    "clipped_saxpy", "final_threads_adam_update_norm", "final_threads_clip_saxpy_norm_partial",
    "grad_norm_final", "grad_norm_partial", "grad_norm_sq", "plan_adam_update",
    "plan_adam_update_norm", "plan_clip_grad_inplace", "plan_clip_saxpy_norm_partial",
    "plan_clipped_saxpy", "plan_elementwise", "plan_grad_norm_final", "plan_grad_norm_partial",
    "plan_grad_norm_sq", "plan_polyak_update", "plan_polyak_update_mirror", "plan_saxpy",
    "polyak_update", "polyak_update_mirror", "polyak_update_mirror_check",
    "polyak_update_mirror_ptr",
]
