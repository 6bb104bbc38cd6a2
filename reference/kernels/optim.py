"""Optimiser kernels (SPEC 4 steps 5, 6, 9; seeds: gradient-stability plan, NaN audit).

The budget pipeline of step 5 and the Adam of step 6 are built from these kernels::

    grad  = clip_grad_inplace(grad, 0.70*mgn, grad_norm_sq(grad))
    grad  = clipped_saxpy(grad, cql, 1, 0.15*mgn, grad_norm_sq(cql))
    ...
    scale = safety_clip_scale(grad_norm_sq(grad), mgn)
    param, m, v = adam_update(param, grad, m, v, grad_scale=scale, ...)

The fused kernels of the fast step are compositions of these, under their own names:
``clip_saxpy_norm_partial`` (phase 2 of both loss norms, the budget clip, the clipped injection
and phase 1 of the total norm), ``adam_update_norm`` (Adam with Mech 6's clip factor from the
total norm's partials), ``polyak_update_mirror`` (the Polyak update and the BF16 mirrors of
both networks) and ``polyak_update_mirror_check`` (that, and the sentinel check of its result).

Norms skip non-finite elements: Adam's per-element guard discards a non-finite gradient, so it
must not poison the clip scale of the finite ones. Every SAXPY skips non-finite ``x_i``.
All arithmetic is float32, in the order written in each docstring (products rounded before
sums: a CUDA twin that wants bitwise equality compiles these with ``--fmad=false`` or
``__fmul_rn``/``__fadd_rn``; with FMA contraction it differs by rounding). Subnormals are not
flushed to zero.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from foxhunt.reference.kernels.argcheck import (
    check_f32_array,
    check_f32_scalar,
    check_int,
    check_same_shape,
    data_f32,
)
from foxhunt.reference.kernels.dense import f32_to_bf16
from foxhunt.reference.kernels.safety import clamp_finite, nan_check_fused

_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)


# ---------------------------------------------------------------------------------------------
# Validation shared with the fast test entries (foxhunt.fast.kernels.optim)
# ---------------------------------------------------------------------------------------------


def validate_grad_norm_partial(x, block_size) -> int:
    """The argument checks of ``grad_norm_partial``; returns ``block_size`` as an int."""
    check_f32_array("x", x, ndim=1)
    return check_int("block_size", block_size, minimum=1)


def validate_clip_grad_inplace(x, max_norm, norm_sq) -> tuple[np.float32, np.float32]:
    """The argument checks of ``clip_grad_inplace`` (``clip_scale``'s for the scalars);
    returns ``(max_norm, norm_sq)`` in float32."""
    check_f32_array("x", x)
    return _clip_scale_args(norm_sq, max_norm)


def _check_f32_same_shape(**arrays: np.ndarray) -> None:
    """Each keyword array float32 (in order), then all of one shape."""
    for name, arr in arrays.items():
        check_f32_array(name, arr)
    check_same_shape(**arrays)


def validate_saxpy(y, x, a) -> np.float32:
    """The argument checks of ``saxpy``; returns ``a`` in float32."""
    _check_f32_same_shape(y=y, x=x)
    return check_f32_scalar("a", a)


def validate_clipped_saxpy(y, x, a, max_norm,
                           norm_sq) -> tuple[np.float32, np.float32, np.float32]:
    """The argument checks of ``clipped_saxpy``; returns ``(a, max_norm, norm_sq)`` in float32."""
    a32 = validate_saxpy(y, x, a)
    return (a32, *_clip_scale_args(norm_sq, max_norm))


class AdamArgs(NamedTuple):
    """``adam_update``'s checked scalars, as the kernel receives them."""

    step: int
    lr: np.float32
    beta1: np.float32
    beta2: np.float32
    eps: np.float32
    weight_decay: np.float32
    grad_scale: np.float32
    weight_clamp: np.float32


def validate_adam_update(param, grad, m, v, *, step, lr, beta1, beta2, eps, weight_decay,
                         grad_scale, weight_clamp) -> AdamArgs:
    """The argument checks of ``adam_update`` (its docstring has the ranges); returns the
    scalars (``AdamArgs``)."""
    _check_f32_same_shape(param=param, grad=grad, m=m, v=v)
    return AdamArgs(
        step=check_int("step", step, minimum=1),
        lr=check_f32_scalar("lr", lr, lo=0.0),
        beta1=check_f32_scalar("beta1", beta1, lo=0.0, hi=1.0, hi_open=True),
        beta2=check_f32_scalar("beta2", beta2, lo=0.0, hi=1.0, hi_open=True),
        eps=check_f32_scalar("eps", eps, lo=0.0, lo_open=True),
        weight_decay=check_f32_scalar("weight_decay", weight_decay, lo=0.0),
        grad_scale=data_f32("grad_scale", grad_scale),
        weight_clamp=check_f32_scalar("weight_clamp", weight_clamp, lo=0.0, lo_open=True,
                                      allow_inf=True),
    )


def validate_polyak_update(target, online, tau) -> np.float32:
    """The argument checks of ``polyak_update``; returns ``tau`` in float32."""
    _check_f32_same_shape(target=target, online=online)
    return check_f32_scalar("tau", tau, lo=0.0, hi=1.0)


class ClipSaxpyArgs(NamedTuple):
    """``clip_saxpy_norm_partial``'s checked scalars, as the kernel receives them."""

    base_max_norm: np.float32
    a: np.float32
    inject_max_norm: np.float32
    block_size: int


def validate_clip_saxpy_norm_partial(base, inject, base_max_norm, base_partials, a,
                                     inject_max_norm, inject_partials,
                                     block_size) -> ClipSaxpyArgs:
    """The argument checks of ``clip_saxpy_norm_partial`` (those of the kernels it fuses, under
    the fused names, plus one length for both partial arrays); returns the scalars
    (``ClipSaxpyArgs``)."""
    check_f32_array("base", base, ndim=1)
    check_f32_array("inject", inject)
    check_same_shape(base=base, inject=inject)
    base_max_norm32 = check_f32_scalar("base_max_norm", base_max_norm, lo=0.0)
    check_f32_array("base_partials", base_partials, ndim=1)
    a32 = check_f32_scalar("a", a)
    inject_max_norm32 = check_f32_scalar("inject_max_norm", inject_max_norm, lo=0.0)
    check_f32_array("inject_partials", inject_partials, ndim=1)
    check_same_shape(base_partials=base_partials, inject_partials=inject_partials)
    return ClipSaxpyArgs(
        base_max_norm=base_max_norm32,
        a=a32,
        inject_max_norm=inject_max_norm32,
        block_size=check_int("block_size", block_size, minimum=1),
    )


# ---------------------------------------------------------------------------------------------
# Gradient norms
# ---------------------------------------------------------------------------------------------


def _finite_sq_sum(x: np.ndarray) -> np.float32:
    with np.errstate(over="ignore", invalid="ignore"):
        sq = np.where(np.isfinite(x), x * x, _ZERO)
    # float32 accumulation in NumPy's pairwise order.
    return np.float32(np.sum(sq, dtype=np.float32))


def grad_norm_sq(x: np.ndarray) -> np.float32:
    """Squared L2 norm over the finite elements: ``sum_{i: isfinite(x_i)} x_i^2`` in float32.

    Shapes: ``x`` float32, any shape (a flat gradient buffer; empty gives 0). Returns a float32
    scalar; the norm is ``norm_from_sq(result) = sqrt(max(result, 0))``.

    NaN contract: NaN and +/-Inf elements are skipped (Adam's per-element guard discards them;
    they must not poison the clip scale of the finite elements). A finite ``|x_i| >~ 1.8e19``
    squares to +Inf, so the sum is +Inf and every clip scale built on it is 0.

    Accumulation: squares rounded to float32, summed in float32 in NumPy's pairwise order. The
    fast path (a block tree reduction) and the two-phase twins (``grad_norm_partial`` then
    ``grad_norm_final``) sum in other orders; for non-negative terms every order is within
    ``gamma_{N-1} * sum`` (``gamma_k = k u / (1 - k u)``, ``u = 2^-24``) of the exact sum.
    """
    check_f32_array("x", x)
    return _finite_sq_sum(x)


def grad_norm_partial(x: np.ndarray, block_size: int) -> np.ndarray:
    """Phase 1 of the two-phase norm: per-block sums of finite squares.

    ``partials[k] = grad_norm_sq(x[k*block_size : (k+1)*block_size])``.

    Shapes: ``x`` float32[N] (1-D); ``block_size`` an int >= 1. Returns float32[ceil(N /
    block_size)] (empty for N = 0). Same NaN contract as ``grad_norm_sq``: non-finite elements
    are skipped; a partial is +Inf only if a finite square overflowed. Partials are never NaN.
    """
    bs = validate_grad_norm_partial(x, block_size)
    n_blocks = -(-x.shape[0] // bs)
    return np.array([_finite_sq_sum(x[k * bs:(k + 1) * bs]) for k in range(n_blocks)],
                    dtype=np.float32)


def grad_norm_final(partials: np.ndarray) -> np.float32:
    """Phase 2 of the two-phase norm: ``sum_k partials[k]`` in float32 (NumPy pairwise order).

    ``grad_norm_final(grad_norm_partial(x, bs))`` equals ``grad_norm_sq(x)`` up to f32
    rounding of the different summation order (both within ``gamma_{N-1} * sum`` of the exact
    sum, so they differ by at most ``2 gamma_{N-1} * sum``).

    Shapes: ``partials`` float32[P] (empty gives 0). Returns a float32 scalar. NaN contract:
    plain sum, nothing skipped: a +Inf partial (overflow) gives +Inf, exactly as the one-shot
    norm does; a NaN partial (never produced by phase 1) would propagate.
    """
    check_f32_array("partials", partials, ndim=1)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.float32(np.sum(partials, dtype=np.float32))


def norm_from_sq(norm_sq: float) -> np.float32:
    """Helper: ``sqrtf(fmaxf(norm_sq, 0))``; NaN or negative ``norm_sq`` give 0 (fmaxf rule)."""
    return np.float32(np.sqrt(np.fmax(data_f32("norm_sq", norm_sq), _ZERO)))


def _clip_scale_args(norm_sq: float, max_norm: float) -> tuple[np.float32, np.float32]:
    """``clip_scale``'s checks, in its order: ``(max_norm, norm_sq)`` in float32."""
    return check_f32_scalar("max_norm", max_norm, lo=0.0), data_f32("norm_sq", norm_sq)


def _clip_scale_f32(mn: np.float32, norm_sq: np.float32) -> np.float32:
    n = norm_from_sq(norm_sq)
    if n > mn and n > _ZERO:
        return np.float32(mn / n)
    return _ONE


def clip_scale(norm_sq: float, max_norm: float) -> np.float32:
    """Helper: the clip factor ``s = max_norm / n if n > max_norm and n > 0 else 1``.

    ``n = norm_from_sq(norm_sq)``; float32 division. ``norm_sq`` is data: NaN gives ``n = 0``
    and ``s = 1`` (``fmaxf`` rule; ``grad_norm_sq`` never returns NaN), +Inf gives ``s = 0``
    (the component is discarded for this step). ``max_norm`` must be finite and >= 0.
    Always returns a finite value in ``[0, 1]``.
    """
    return _clip_scale_f32(*_clip_scale_args(norm_sq, max_norm))


def data_clip_scale(norm_sq, max_norm) -> np.float32:
    """``clip_scale`` with ``max_norm`` taken as data, unchecked (a NaN or +Inf bound never
    clips; a negative one is used as it is): the factors ``step_scalars`` computes from device
    values (Mech 6's ``safety_scale``, the budgets' post-clip norms) and ``adam_update_norm``'s
    gradient scale."""
    with np.errstate(all="ignore"):
        return _clip_scale_f32(data_f32("max_norm", max_norm), data_f32("norm_sq", norm_sq))


#: Adam's global-norm safety clip factor (SPEC 4 step 6): the same rule as the budget clips,
#: at ``max_grad_norm``. The caller passes it to ``adam_update`` as ``grad_scale``.
safety_clip_scale = clip_scale


# ---------------------------------------------------------------------------------------------
# Clip and SAXPY (the budget pipeline)
# ---------------------------------------------------------------------------------------------


def clip_grad_inplace(x: np.ndarray, max_norm: float, norm_sq: float) -> np.ndarray:
    """Budget clip of a gradient buffer: ``x * s``, ``s = clip_scale(norm_sq, max_norm)``.

    Shapes: ``x`` float32, any shape; ``max_norm`` finite >= 0; ``norm_sq`` the float32 value
    of ``grad_norm_sq(x)`` (data). Returns the new value of ``x`` (float32, same shape).

    Guarantee: the finite part of the result has norm ``<= max_norm`` up to f32 rounding
    (relative ``~1e-6``) and up to squares that underflow in ``grad_norm_sq`` (elements below
    ``~2^-75`` count as 0: at most ``sqrt(N * 2^-149)`` absolute).

    NaN contract: a plain multiply by the finite scalar ``s``; NaN stays NaN, +/-Inf stays
    +/-Inf when ``s > 0`` and becomes NaN when ``s = 0``. Non-finite gradient elements are
    skipped later by the SAXPYs and by Adam, not here.
    """
    s = _clip_scale_f32(*validate_clip_grad_inplace(x, max_norm, norm_sq))
    with np.errstate(invalid="ignore"):
        return (x * s).astype(np.float32, copy=False)


def _guarded_axpy(y: np.ndarray, x: np.ndarray, a: np.float32) -> np.ndarray:
    finite = np.isfinite(x)
    with np.errstate(over="ignore", invalid="ignore"):
        updated = y + a * x
    return np.where(finite, updated, y).astype(np.float32, copy=False)


def saxpy(y: np.ndarray, x: np.ndarray, a: float) -> np.ndarray:
    """Guarded SAXPY: ``y_i + a * x_i`` if ``isfinite(x_i)`` else ``y_i``.

    Order: the product ``a * x_i`` is rounded to float32, then the sum (no FMA).

    Shapes: ``y``, ``x`` float32 of the same shape; ``a`` a finite float32 scalar. Returns the
    new value of ``y``.

    NaN contract: a non-finite ``x_i`` never reaches ``y`` (``y_i`` kept bit for bit); a
    non-finite ``y_i`` propagates; a finite ``x_i`` whose product or sum overflows gives +/-Inf.
    """
    return _guarded_axpy(y, x, validate_saxpy(y, x, a))


def clipped_saxpy(y: np.ndarray, x: np.ndarray, a: float, max_norm: float,
                  norm_sq: float) -> np.ndarray:
    """Budget injection: ``saxpy(y, clip_grad_inplace(x, max_norm, norm_sq), a)``.

    Per element: ``y_i + a * (x_i * s)`` if ``isfinite(x_i)`` else ``y_i`` with
    ``s = clip_scale(norm_sq, max_norm)``; roundings in that order (``x_i * s``, then ``a *``,
    then ``+``). ``x`` itself is not modified (the scratch buffer keeps the raw component).

    Shapes and NaN contract as ``saxpy`` and ``clip_grad_inplace``: non-finite ``x_i`` are
    skipped (tested on ``x_i`` before scaling; ``s`` is finite and ``<= 1``, so a finite
    ``x_i`` stays finite after scaling).
    """
    a32, mn, ns = validate_clipped_saxpy(y, x, a, max_norm, norm_sq)
    s = _clip_scale_f32(mn, ns)
    with np.errstate(invalid="ignore"):
        xs = x * s
    # s is finite and in [0, 1], so isfinite(x_i * s) == isfinite(x_i).
    return _guarded_axpy(y, xs, a32)


class ClipSaxpyPartial(NamedTuple):
    """``clip_saxpy_norm_partial`` outputs: the budgeted gradient, its norm partials and the
    two component norms the clips used."""

    out: np.ndarray
    partials: np.ndarray
    base_norm_sq: np.float32
    inject_norm_sq: np.float32


def clip_saxpy_norm_partial(base: np.ndarray, inject: np.ndarray, base_max_norm: float,
                            base_partials: np.ndarray, a: float, inject_max_norm: float,
                            inject_partials: np.ndarray, block_size: int) -> ClipSaxpyPartial:
    """The budget pipeline's tail in one kernel: phase 2 of both component norms, clip ``base``,
    inject the clipped ``inject``, and phase 1 of the new buffer's norm. The composition::

        base_norm_sq   = grad_norm_final(base_partials)
        inject_norm_sq = grad_norm_final(inject_partials)
        out      = clipped_saxpy(clip_grad_inplace(base, base_max_norm, base_norm_sq),
                                 inject, a, inject_max_norm, inject_norm_sq)
        partials = grad_norm_partial(out, block_size)

    In the step: ``base`` the C51 gradient (budget ``0.70 mgn``), ``inject`` the CQL gradient
    (budget ``0.15 mgn``, ``a = 1``), ``*_partials`` their ``grad_norm_partial`` (phase 1 of
    their norms); ``out`` is the gradient Adam reads, ``partials`` feed ``grad_norm_final``
    (the total norm) and the two norms go to the step's readback.

    Per element, rounded in this order (``s_b = clip_scale(base_norm_sq, base_max_norm)``,
    ``s_i = clip_scale(inject_norm_sq, inject_max_norm)``, both finite in ``[0, 1]``)::

        c     = base_i * s_b
        out_i = c + a * (inject_i * s_i)   if isfinite(inject_i)   else c

    and ``partials[k] = sum of out_i^2 over the finite out_i of segment k`` (``grad_norm_partial``).

    Shapes: ``base``, ``inject`` float32[N] (1-D, one shape); ``base_partials``,
    ``inject_partials`` float32[P] (1-D, one shape; P = 0 gives norms 0); ``base_max_norm``,
    ``inject_max_norm`` finite >= 0; ``a`` finite; ``block_size`` an int >= 1. Returns
    ``ClipSaxpyPartial(out float32[N], partials float32[ceil(N / block_size)], base_norm_sq
    float32, inject_norm_sq float32)``; the inputs are not modified.

    NaN contract (the fused kernels'): the norms are plain sums of the partials
    (``grad_norm_final``: a NaN partial gives a NaN norm, a +Inf partial or an overflowing sum
    +Inf; never -0.0); a NaN norm gives scale 1, a +Inf norm scale 0. A NaN ``base_i`` gives a
    NaN ``out_i``; a +/-Inf ``base_i`` stays +/-Inf when ``s_b > 0`` and becomes NaN when
    ``s_b = 0``; a non-finite ``inject_i`` is skipped (``out_i = base_i * s_b`` bit for bit); a
    finite sum or product that overflows gives +/-Inf. ``partials`` skip the non-finite
    ``out_i``: never NaN, +Inf only if a finite square overflowed.
    """
    validate_clip_saxpy_norm_partial(base, inject, base_max_norm, base_partials, a,
                                     inject_max_norm, inject_partials, block_size)
    base_norm_sq = grad_norm_final(base_partials)
    inject_norm_sq = grad_norm_final(inject_partials)
    clipped = clip_grad_inplace(base, base_max_norm, base_norm_sq)
    out = clipped_saxpy(clipped, inject, a, inject_max_norm, inject_norm_sq)
    return ClipSaxpyPartial(out=out, partials=grad_norm_partial(out, block_size),
                            base_norm_sq=base_norm_sq, inject_norm_sq=inject_norm_sq)


# ---------------------------------------------------------------------------------------------
# Adam
# ---------------------------------------------------------------------------------------------


class AdamState(NamedTuple):
    """``adam_update`` outputs: the new parameter, first and second moment buffers."""

    param: np.ndarray
    m: np.ndarray
    v: np.ndarray


def _pow_rounded_once(beta: np.float32, t: int) -> np.float32:
    """``beta ** float32(t)`` computed in double, rounded once to float32 (portable: libm's
    float32 ``powf`` differs between platforms; CUDA's double ``pow`` is within 2 ulp of double)."""
    return np.float32(float(beta) ** float(np.float32(t)))


def adam_update(param: np.ndarray, grad: np.ndarray, m: np.ndarray, v: np.ndarray, *,
                step: int, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, grad_scale: float, weight_clamp: float) -> AdamState:
    """Adam (decoupled weight decay) with per-element guard and Mech 9 weight clamp, float32.

    Per element, in this order (every operation rounded to float32)::

        g = grad * grad_scale
        if !isfinite(g): param, m, v unchanged            # gradient zeroed, element skipped
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * (g * g)
        mhat = m / (1 - powf(beta1, t));  vhat = v / (1 - powf(beta2, t))
        param = param - lr * (mhat / (sqrtf(vhat) + eps) + weight_decay * param)
        param = clamp_finite(param, weight_clamp)                                 # Mech 9

    Weight decay is decoupled (AdamW, Loshchilov & Hutter): it acts on the parameter, not
    through the moments; ``param - lr*(... + wd*param)`` equals torch AdamW's
    ``param*(1 - lr*wd) - lr*adam_step`` in exact arithmetic. With ``weight_decay = 0`` this is
    torch.optim.Adam.

    Shapes: ``param``, ``grad``, ``m``, ``v`` float32 of one shape (the flat buffers).
    Scalars: ``step`` t, an int >= 1 (bias corrections need it; raise otherwise); the bias
    corrections are ``1 - beta^t`` with ``beta^t`` taken in double and rounded once to float32
    (float32 ``powf`` is not correctly rounded and differs between libms; the kernel does the same); ``lr``, ``weight_decay`` finite >= 0; ``beta1``, ``beta2`` in [0, 1);
    ``eps`` finite > 0; ``grad_scale`` (data) the global safety-clip factor from
    ``safety_clip_scale(grad_norm_sq(grad), max_grad_norm)``; ``weight_clamp`` the Mech 9 bound
    ``isv_bound(weight_clamp_mult, ISV[Q_ABS_REF])``, > 0 (``+inf`` allowed: no magnitude
    clamp; there is no "0 disables" convention, because the clamp is also the guarantee that no
    non-finite parameter is ever written).

    NaN contract: an element whose scaled gradient is NaN/+-Inf (including a NaN or Inf
    ``grad_scale``, or ``Inf * 0``) is skipped: its ``param``, ``m``, ``v`` are returned bit for
    bit. Otherwise the new parameter passes ``clamp_finite``: a non-finite result (e.g. from a
    non-finite input ``param``, or ``m`` and ``v`` both overflowed) becomes 0, a finite one is
    clamped to ``[-weight_clamp, weight_clamp]``. ``m`` and ``v`` are stored as computed: they can
    saturate to +/-Inf (never NaN from finite inputs); the Mech 5 sentinel slots watch them and
    Mech 4 resets them at the fold boundary. The gradient buffer is not an output: the next
    backward pass overwrites it.

    Returns ``AdamState(param, m, v)``, new float32 arrays.
    """
    t, lr32, b1, b2, eps32, wd, scale, clamp = validate_adam_update(
        param, grad, m, v, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay, grad_scale=grad_scale, weight_clamp=weight_clamp)

    bc1 = _ONE - _pow_rounded_once(b1, t)
    bc2 = _ONE - _pow_rounded_once(b2, t)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        g = grad * scale
        ok = np.isfinite(g)
        m_new = b1 * m + (_ONE - b1) * g
        v_new = b2 * v + (_ONE - b2) * (g * g)
        mhat = m_new / bc1
        vhat = v_new / bc2
        update = mhat / (np.sqrt(vhat) + eps32) + wd * param
        p_new = param - lr32 * update
    p_new = clamp_finite(p_new.astype(np.float32, copy=False), clamp)
    return AdamState(
        np.where(ok, p_new, param).astype(np.float32, copy=False),
        np.where(ok, m_new, m).astype(np.float32, copy=False),
        np.where(ok, v_new, v).astype(np.float32, copy=False),
    )


def validate_adam_update_norm(param, grad, m, v, total_partials, clip_bound, *, step, lr,
                              beta1, beta2, eps, weight_decay, weight_clamp) -> AdamArgs:
    """The argument checks of ``adam_update_norm``: ``adam_update``'s (with a placeholder
    ``grad_scale``), ``total_partials`` float32 [P] and ``clip_bound`` data; returns
    ``adam_update``'s scalars with ``grad_scale`` 1 (the kernel computes it)."""
    check_f32_array("total_partials", total_partials, ndim=1)
    data_f32("clip_bound", clip_bound)
    return validate_adam_update(param, grad, m, v, step=step, lr=lr, beta1=beta1, beta2=beta2,
                                eps=eps, weight_decay=weight_decay, grad_scale=1.0,
                                weight_clamp=weight_clamp)


def adam_update_norm(param: np.ndarray, grad: np.ndarray, m: np.ndarray, v: np.ndarray,
                     total_partials: np.ndarray, clip_bound, *, step: int, lr: float,
                     beta1: float, beta2: float, eps: float, weight_decay: float,
                     weight_clamp: float) -> AdamState:
    """``adam_update`` with its ``grad_scale`` computed from the total gradient norm's phase-1
    partials (graph 2's main Adam, so that it need not wait for ``step_scalars``), exactly::

        total_sq   = grad_norm_final(total_partials)
        grad_scale = clip_scale(total_sq, clip_bound)   # step_scalars' safety_scale (Mech 6)
        adam_update(param, grad, m, v, ..., grad_scale=grad_scale, weight_clamp=weight_clamp)

    ``clip_bound`` is data, as ``step_scalars`` takes it (``step_bounds``' Mech 6 bound: a NaN
    or +Inf bound never clips; no range check). Shapes and the other scalars as
    ``adam_update``; ``total_partials`` float32 [P] (``grad_norm_partial`` of the total
    gradient). NaN contract: ``grad_norm_final``'s (an +Inf partial gives +Inf, scale 0: every
    element's ``g = 0 * grad`` is +-0 or NaN, the NaN ones skipped), ``clip_scale``'s (a NaN
    total gives scale 1), then ``adam_update``'s. Returns ``AdamState(param, m, v)``.
    """
    validate_adam_update_norm(param, grad, m, v, total_partials, clip_bound, step=step, lr=lr,
                              beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                              weight_clamp=weight_clamp)
    scale = data_clip_scale(grad_norm_final(total_partials), clip_bound)
    return adam_update(param, grad, m, v, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                       weight_decay=weight_decay, grad_scale=scale, weight_clamp=weight_clamp)


# ---------------------------------------------------------------------------------------------
# Target network
# ---------------------------------------------------------------------------------------------


def polyak_update(target: np.ndarray, online: np.ndarray, tau: float) -> np.ndarray:
    """Polyak target update: ``(1 - tau) * target + tau * online`` in float32.

    Order: ``1 - tau`` rounded once; the two products rounded, then their sum (no FMA).

    Shapes: ``target``, ``online`` float32 of one shape; ``tau`` in [0, 1]. Returns the new
    target. NaN contract: plain arithmetic, NaN/Inf in either input propagate (Adam's Mech 9
    clamp keeps the online parameters finite; the target is only ever a blend of them).
    """
    tau32 = validate_polyak_update(target, online, tau)
    keep = _ONE - tau32
    with np.errstate(over="ignore", invalid="ignore"):
        return (keep * target + tau32 * online).astype(np.float32, copy=False)


class PolyakMirror(NamedTuple):
    """``polyak_update_mirror`` outputs: the new target and the BF16 mirrors of both networks."""

    target: np.ndarray
    online_bf16: np.ndarray
    target_bf16: np.ndarray


def polyak_update_mirror(target: np.ndarray, online: np.ndarray, tau: float) -> PolyakMirror:
    """Polyak update and the BF16 mirrors of the online and new target parameters, in one
    kernel (graph 2's tail). The composition::

        target      = polyak_update(target, online, tau)
        online_bf16 = f32_to_bf16(online)
        target_bf16 = f32_to_bf16(target)          # of the NEW target

    Per element: ``t = (1 - tau) * target_i + tau * online_i`` (``1 - tau`` rounded once, the
    two products rounded, then the sum; no FMA), then BF16 round-to-nearest-even of
    ``online_i`` and of ``t`` on the bit pattern (``dense.f32_to_bf16``).

    Shapes: ``target``, ``online`` float32 of one shape (the flat parameter buffers); ``tau``
    in [0, 1]. Returns ``PolyakMirror(target float32, online_bf16 uint16, target_bf16
    uint16)``, all of the inputs' shape; the inputs are not modified.

    NaN contract: the blend is plain arithmetic, NaN/Inf in either input propagate to the new
    target (``polyak_update``); the mirrors follow ``f32_to_bf16``: +/-Inf stay +/-Inf, a NaN
    stays a quiet NaN with its sign and high payload bits, and finite values at or above
    ``0x1.FFp127`` plus half a BF16 ulp round to +/-Inf.
    """
    validate_polyak_update(target, online, tau)
    new_target = polyak_update(target, online, tau)
    return PolyakMirror(target=new_target, online_bf16=f32_to_bf16(online),
                        target_bf16=f32_to_bf16(new_target))


def polyak_update_mirror_ptr(target: np.ndarray, online: np.ndarray, tau: float) -> PolyakMirror:
    """``polyak_update_mirror`` whose CUDA kernel reads ``tau`` through a device pointer (the
    adaptive tau, ``ISV[TAU_EFF]`` at the step's start, so no host value enters the step).
    Same contract, bit for bit."""
    return polyak_update_mirror(target, online, tau)


#: Most active entries ``polyak_update_mirror_check`` takes (``POLYAK_CHECK_MAX`` in optim.cu:
#: one bit of a thread's word each).
POLYAK_CHECK_MAX = 32
#: What a ``polyak_update_mirror_check`` entry checks: the online values or the NEW target.
POLYAK_CHECK_SOURCES = ("online", "target")


class PolyakMirrorCheck(NamedTuple):
    """``polyak_update_mirror_check`` outputs: ``polyak_update_mirror``'s and the new flags."""

    target: np.ndarray
    online_bf16: np.ndarray
    target_bf16: np.ndarray
    flags: np.ndarray


def validate_polyak_check_entries(entries, n: int) -> list[tuple[str, int, int] | None]:
    """The argument checks of ``polyak_update_mirror_check``'s ``entries`` for parameter
    buffers of ``n`` elements: each ``None`` or ``(source, offset, count)`` with ``source`` in
    ``POLYAK_CHECK_SOURCES`` and ``0 <= offset``, ``0 <= count``, ``offset + count <= n``; at most
    ``POLYAK_CHECK_MAX`` with ``count > 0``. Returns them as a list."""
    out = list(entries)
    active = 0
    for k, entry in enumerate(out):
        if entry is None:
            continue
        if not (isinstance(entry, tuple) and len(entry) == 3):
            raise ValueError(f"entries[{k}]: {entry!r} is not allowed; expected None or "
                             f"(source, offset, count)")
        source, offset, count = entry
        if source not in POLYAK_CHECK_SOURCES:
            raise ValueError(f"entries[{k}]: source {source!r} is not allowed; expected one of "
                             f"{POLYAK_CHECK_SOURCES}")
        if not (0 <= int(offset) and 0 <= int(count) and int(offset) + int(count) <= n):
            raise ValueError(f"entries[{k}]: offset {offset}, count {count} is not allowed; "
                             f"expected 0 <= offset, 0 <= count, offset + count <= {n}")
        active += int(count) > 0
    if active > POLYAK_CHECK_MAX:
        raise ValueError(f"entries: {active} active entries is not allowed; expected at most "
                         f"{POLYAK_CHECK_MAX}")
    return out


def polyak_update_mirror_check(target: np.ndarray, online: np.ndarray, tau: float, entries,
                               flags: np.ndarray, thresholds: np.ndarray) -> PolyakMirrorCheck:
    """``polyak_update_mirror`` and the sentinel check of its result in one kernel (graph 2's
    last node: the check of params and target after Polyak). The composition::

        target, online_bf16, target_bf16 = polyak_update_mirror(target, online, tau)
        flags = nan_check_fused(buffers, flags, thresholds)
        # buffers[k] = None                                   for entries[k] None
        #            = online[offset:offset + count]          for ("online", offset, count)
        #            = target[offset:offset + count]          for ("target", ...): the NEW target

    Shapes: ``target``, ``online`` float32 ``[n]``; ``tau`` in [0, 1]; ``entries`` one per flag
    (``validate_polyak_check_entries``: None or ``(source, offset, count)``, at most
    ``POLYAK_CHECK_MAX`` with ``count > 0``); ``flags`` int32 0/1 and ``thresholds`` float32, one
    per entry. Returns ``PolyakMirrorCheck``; the inputs are not modified.

    NaN contract: ``polyak_update_mirror``'s for the values; ``nan_check_fused``'s for the flags
    (an entry fires on a non-finite element, or on ``|x| >= threshold`` where ``threshold > 0``;
    a NaN, zero or negative threshold disables the magnitude test; flags are sticky)."""
    validate_polyak_update(target, online, tau)
    checked = validate_polyak_check_entries(entries, online.size)
    r = polyak_update_mirror(target, online, tau)
    sources = {"online": online.reshape(-1), "target": r.target.reshape(-1)}
    buffers = [None if e is None else sources[e[0]][int(e[1]):int(e[1]) + int(e[2])]
               for e in checked]
    new_flags = nan_check_fused(buffers, flags, thresholds)
    return PolyakMirrorCheck(r.target, r.online_bf16, r.target_bf16, new_flags)


def hard_sync(target: np.ndarray, online: np.ndarray) -> np.ndarray:
    """Hard target sync at a fold boundary (Mech 3): the new target is a copy of ``online``.

    Not a kernel (the fast path issues a device-to-device copy), hence not in ``KERNELS``.
    Shapes: both float32 of one shape. Bit-exact, NaN included.
    """
    _check_f32_same_shape(target=target, online=online)
    return online.copy()


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
    "AdamArgs", "AdamState", "ClipSaxpyArgs", "ClipSaxpyPartial", "KERNELS", "POLYAK_CHECK_MAX",
    "POLYAK_CHECK_SOURCES", "PolyakMirror", "PolyakMirrorCheck",
    "adam_update", "adam_update_norm", "clip_grad_inplace", "clip_saxpy_norm_partial", "clip_scale",
    "clipped_saxpy", "data_clip_scale",
    "grad_norm_final", "grad_norm_partial", "grad_norm_sq", "hard_sync", "norm_from_sq",
    "polyak_update", "polyak_update_mirror", "polyak_update_mirror_check", "polyak_update_mirror_ptr",
    "safety_clip_scale", "saxpy",
    "validate_adam_update", "validate_adam_update_norm", "validate_clip_grad_inplace", "validate_clip_saxpy_norm_partial",
    "validate_clipped_saxpy", "validate_grad_norm_partial", "validate_polyak_check_entries",
    "validate_polyak_update",
    "validate_saxpy",
]
