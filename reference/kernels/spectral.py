"""Spectral-norm kernels (SPEC 4 step 7; seeds: gradient-stability plan Task 3-4, zero-sync plan
section 5 "batched spectral norm").

One power iteration per step on every weight matrix ``W [out, in]`` with persistent unit
vectors ``u [out]``, ``v [in]``, in PyTorch's order, so that
``torch.nn.utils.parametrizations.spectral_norm`` (``n_power_iterations=1``, ``eps=1e-12``) is an
oracle for ``u``, ``v`` and ``sigma``::

    u = W v   / max(||W v||,   1e-12)
    v = W^T u / max(||W^T u||, 1e-12)
    sigma = u . (W v)                       # with the new v
    if sigma > sigma_max: W = W * (sigma_max / sigma)

Unlike the PyTorch parametrization (which always divides by sigma), the weight is only
rescaled when its estimated spectral norm exceeds ``sigma_max``.

Arithmetic is float32: products rounded to float32 and summed in float32, in NumPy's order
(pairwise along each row for ``W v``, row by row for ``W^T u``, pairwise for the dots). The
fast kernel (one block cluster per matrix, tree reductions) matches within ``rtol 1e-5`` (SPEC 8); its
batched and individual launches must agree bit for bit, as ``batched_spectral_norm`` and
``spectral_norm`` do here.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from foxhunt.reference.kernels.argcheck import check_f32_array, check_f32_scalar, check_int

#: Normalisation floor ``max(||x||, SPECTRAL_EPS)`` (PyTorch's default ``eps``).
SPECTRAL_EPS = np.float32(1e-12)


class SpectralNormResult(NamedTuple):
    """``spectral_norm`` outputs: new weight, new ``u``, new ``v``, the estimate ``sigma``."""

    w: np.ndarray
    u: np.ndarray
    v: np.ndarray
    sigma: np.float32


class BatchedSpectralNormResult(NamedTuple):
    """``batched_spectral_norm`` outputs: lists, one entry per matrix."""

    ws: list
    us: list
    vs: list
    sigmas: list


def _normalize(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        norm = np.sqrt(np.sum(x * x, dtype=np.float32))
        return (x / np.fmax(norm, SPECTRAL_EPS)).astype(np.float32, copy=False)


def _matvec(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return np.sum(w * x[None, :], axis=1, dtype=np.float32)


def _rmatvec(w: np.ndarray, y: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return np.sum(w * y[:, None], axis=0, dtype=np.float32)


def _check_matrix(name: str, w: np.ndarray, u_name: str, u: np.ndarray, v_name: str,
                  v: np.ndarray) -> None:
    check_f32_array(name, w, ndim=2)
    check_f32_array(u_name, u, ndim=1)
    check_f32_array(v_name, v, ndim=1)
    out_dim, in_dim = w.shape
    if out_dim == 0 or in_dim == 0:
        raise ValueError(f"{name}: shape {w.shape} is empty; both dimensions must be >= 1")
    if u.shape != (out_dim,) or v.shape != (in_dim,):
        raise ValueError(f"{u_name} shape {u.shape} / {v_name} shape {v.shape} do not match "
                         f"{name} shape {w.shape}; expected ({out_dim},) and ({in_dim},)")


def _check_sigma_max(sigma_max) -> np.float32:
    return check_f32_scalar("sigma_max", sigma_max, lo=0.0, lo_open=True)


def validate_spectral_norm(w, u, v, sigma_max) -> np.float32:
    """The argument checks of ``spectral_norm``; returns ``sigma_max`` in float32."""
    _check_matrix("w", w, "u", u, "v", v)
    return _check_sigma_max(sigma_max)


def validate_batched_spectral_norm(ws, us, vs, sigma_max) -> np.float32:
    """The argument checks of ``batched_spectral_norm``; returns ``sigma_max`` in float32."""
    n = len(ws)
    check_int("len(ws)", n, minimum=1)
    if len(us) != n or len(vs) != n:
        raise ValueError(f"len(us)={len(us)}, len(vs)={len(vs)}: must equal len(ws)={n}")
    for k in range(n):
        _check_matrix(f"ws[{k}]", ws[k], f"us[{k}]", us[k], f"vs[{k}]", vs[k])
    return _check_sigma_max(sigma_max)


def _power_iteration(w: np.ndarray, u: np.ndarray, v: np.ndarray,
                     sigma_max: np.float32) -> SpectralNormResult:
    u_new = _normalize(_matvec(w, v))
    v_new = _normalize(_rmatvec(w, u_new))
    with np.errstate(over="ignore", invalid="ignore"):
        sigma = np.float32(np.sum(u_new * _matvec(w, v_new), dtype=np.float32))
    if sigma > sigma_max:
        w_new = (w * np.float32(sigma_max / sigma)).astype(np.float32, copy=False)
    else:
        w_new = w.copy()
    return SpectralNormResult(w_new, u_new, v_new, sigma)


def spectral_norm(w: np.ndarray, u: np.ndarray, v: np.ndarray,
                  sigma_max: float) -> SpectralNormResult:
    """One power iteration and the spectral-norm bound on one weight matrix (module docstring).

    Shapes: ``w`` float32[out, in] (both >= 1), ``u`` float32[out], ``v`` float32[in] (unit
    vectors, persistent across steps and saved in checkpoints); ``sigma_max`` finite > 0.
    Returns ``SpectralNormResult(w, u, v, sigma)``: new float32 arrays and a float32 scalar.
    The rescale factor ``sigma_max / sigma`` is one float32 division, then one multiply per
    element; when ``sigma <= sigma_max`` the weight is returned bit for bit.

    NaN contract: the normalisation floors use ``fmaxf`` (a zero ``W v`` gives ``u = 0``, then
    ``v = 0`` and ``sigma = 0``: no NaN, no rescale). A NaN in ``W`` (or ``u``, ``v``) gives a
    NaN ``sigma``; ``sigma > sigma_max`` is then false and ``W`` is returned unchanged (the
    sentinels and Mech 9 deal with non-finite weights, not this kernel). ``u`` and ``v`` then
    hold NaN: ``fmaxf(NaN, 1e-12)`` is ``1e-12``, so a NaN norm divides the finite entries of
    ``W v`` by ``1e-12`` and leaves its NaN entries NaN; they spread to all of ``v``.
    """
    return _power_iteration(w, u, v, validate_spectral_norm(w, u, v, sigma_max))


def batched_spectral_norm(ws: Sequence[np.ndarray], us: Sequence[np.ndarray],
                          vs: Sequence[np.ndarray],
                          sigma_max: float) -> BatchedSpectralNormResult:
    """``spectral_norm`` on every matrix of a list (the fast path: one launch, one block per
    matrix, a device array of descriptors).

    Shapes: three sequences of equal length n >= 1, entry ``k`` as ``spectral_norm``'s
    arguments; ``sigma_max`` one bound for all (SPEC 3: all weight matrices share it).
    Returns ``BatchedSpectralNormResult(ws, us, vs, sigmas)``, lists of length n, bit for bit
    equal to mapping ``spectral_norm`` over the matrices. Same NaN contract, per matrix.
    """
    bound = validate_batched_spectral_norm(ws, us, vs, sigma_max)
    results = [_power_iteration(w, u, v, bound) for w, u, v in zip(ws, us, vs)]
    return BatchedSpectralNormResult(
        [r.w for r in results], [r.u for r in results], [r.v for r in results],
        [r.sigma for r in results],
    )


def init_spectral_vectors(shape: tuple[int, int], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Helper (not a kernel): deterministic initial unit vectors ``(u [out], v [in])``.

    Standard normal draws from ``numpy.random.default_rng(seed)`` (``u`` first, then ``v``),
    normalised in float64 and rounded to float32, so ``||u||`` and ``||v||`` are 1 within a few
    float32 ulp. The same ``(shape, seed)`` always gives the same vectors; give each matrix its
    own seed.
    """
    if not isinstance(shape, tuple) or len(shape) != 2:
        raise ValueError(f"shape={shape!r}: expected a tuple (out, in)")
    out_dim = check_int("shape[0]", shape[0], minimum=1)
    in_dim = check_int("shape[1]", shape[1], minimum=1)
    rng = np.random.default_rng(check_int("seed", seed, minimum=0))
    vectors = []
    for size in (out_dim, in_dim):
        x = rng.standard_normal(size)
        vectors.append((x / np.linalg.norm(x)).astype(np.float32))
    return vectors[0], vectors[1]


KERNELS = {
    "spectral_norm": spectral_norm,
    "batched_spectral_norm": batched_spectral_norm,
}

__all__ = [
    "BatchedSpectralNormResult", "KERNELS", "SPECTRAL_EPS", "SpectralNormResult",
    "batched_spectral_norm", "init_spectral_vectors", "spectral_norm",
    "validate_batched_spectral_norm", "validate_spectral_norm",
]
