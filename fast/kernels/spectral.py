"""Fast-path launchers of the spectral-norm kernels (``cuda_src/spectral.cu``), twins of
``foxhunt.reference.kernels.spectral`` under the same names and signatures.

Both CUDA kernels run one device function (``hb_spectral_norm_cluster``: one power iteration
and the ``sigma_max`` bound on one matrix, by one thread-block cluster of
:func:`spectral_cluster` blocks of ``SPECTRAL_THREADS`` threads: 8 blocks on sm_90 and newer,
which split the matrix's rows and exchange partial sums through distributed shared memory, 1
before), so the batched launch and individual launches give bitwise identical ``W``, ``u``,
``v`` and ``sigma`` (SPEC 7/8) as long as both use these plans. Against the reference they agree
within the reduction tolerance (SPEC 8: rtol 1e-5): ``W v``, ``W^T u`` (each block's rows in
order, then the blocks in rank order), the norms and ``sigma`` are fixed orders instead of
NumPy's, and ``sigma`` is ``(W^T u) . v_new`` (mathematically the reference's
``u . (W v_new)``, without a third pass over ``W``; a NaN/Inf ``W`` gives the same NaN/zero
cases). The cluster size is compiled in (``__cluster_dims__``): a plan for another
architecture than the module's fails at launch, it never runs with a wrong split.

The bits depend on the matrix and the cluster size only, not on the block size: the norms'
trees are those of a block of ``SPECTRAL_TREE_THREADS`` (512) threads, which a launched block
of any power of two from 32 to 512 threads reproduces (``spectral.cu``'s header). The plans
launch ``SPECTRAL_THREADS`` (512). Measured on the H200 (session 17, seed preset, bf16), the
single trainer's step took 129.4 us with 512-thread blocks and 134.6 us with 256-thread blocks
(the same bits).

Dynamic shared memory (:func:`spectral_shared_bytes`, the same for both plans and any block
size): the kernel keeps its W^T u partials there, u of a block's rows, and -- when the whole
layout of :func:`spectral_shared_floats` fits -- the old ``v`` and the block's rows of ``W``,
copied from global memory once at the start; the power iteration's two matrix-vector passes and
the rescale then read shared memory instead of reading ``W`` three times. The plans size it for
the largest matrix of the seed preset (``SPECTRAL_CACHE_SHAPE``, 256 x 256: 32 rows x 256 of a
block on sm_90, every seed matrix fits), within the 48 KiB a launch gets without the opt-in
attribute; before sm_90 (one block per matrix: that matrix would need 256 KiB) only the
minimum, the size of the shared arrays before the cache (the same occupancy), with which the
small matrices are still cached. A matrix whose layout does not fit reads ``W`` from global
memory as before; cached or not, the bits are the same (``spectral.cu``'s header).

Kernel arguments:

- ``spectral_norm(w, u, v, rows, cols, sigma_max, eps, sigma_out)``: ``w`` [rows, cols]
  row-major, ``u`` [rows], ``v`` [cols], all updated in place; ``sigma_out`` one float32.
- ``batched_spectral_norm(mats, count, sigma_max, eps, sigmas)``: ``mats`` a device array of
  ``count`` descriptors laid out as :data:`SPECTRAL_MATRIX_DTYPE` (``w``, ``u``, ``v`` device
  pointers, ``rows``, ``cols``), one cluster per matrix; ``sigmas`` float32[count].

``eps`` is the reference's ``SPECTRAL_EPS`` (passed, not redefined in CUDA). The batched test
entry copies every matrix and vector into one device pool, builds the descriptors pointing
into it, launches once and reads the pool back; the trainer builds the descriptors once from
its arena pointers (:func:`spectral_descriptors`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from foxhunt.fast.kernels._runtime import In, InOut, Out, call, check_elements, runtime
from foxhunt.reference.kernels.argcheck import check_int
from foxhunt.reference.kernels.spectral import (
    SPECTRAL_EPS,
    BatchedSpectralNormResult,
    SpectralNormResult,
    validate_batched_spectral_norm,
    validate_spectral_norm,
)

F32 = np.float32

#: Threads of each block of a matrix's cluster (a power of two from 32 to
#: ``SPECTRAL_TREE_THREADS``). Both kernels use it; the bits do not depend on it (the module
#: docstring has the measurement that chose it).
SPECTRAL_THREADS = 512

#: The block size whose reduction trees the kernels reproduce (SPECTRAL_TREE_THREADS in
#: spectral.cu): the bits depend on it.
SPECTRAL_TREE_THREADS = 512

#: Blocks per matrix (thread-block cluster) on sm_90 and newer (SPECTRAL_CLUSTER in
#: spectral.cu); 1 before sm_90, which has no clusters.
SPECTRAL_CLUSTER_SM90 = 8

#: Columns per tile of the W^T u partials (SPECTRAL_COL_TILE in spectral.cu).
SPECTRAL_COL_TILE = 4096

#: Rows of a block whose u the minimum dynamic shared memory keeps in shared memory (the
#: static cache of the kernel before the dynamic layout: the minimum keeps its behaviour).
SPECTRAL_U_MIN = 512

#: The matrix the plans' dynamic shared memory is sized for: the seed preset's largest weight
#: matrix (``w_s2``, shared_h2 x shared_h1).
SPECTRAL_CACHE_SHAPE = (256, 256)

#: Dynamic shared memory a launch may have without the opt-in attribute (the test entries and
#: direct launches do not set it).
SPECTRAL_SHARED_LIMIT = 48 * 1024

#: One descriptor of ``batched_spectral_norm`` (``struct SpectralMatrix`` in spectral.cu).
SPECTRAL_MATRIX_DTYPE = np.dtype([("w", "<u8"), ("u", "<u8"), ("v", "<u8"),
                                  ("rows", "<i4"), ("cols", "<i4")])

#: Byte alignment of each array in the batched test entry's device pool.
POOL_ALIGNMENT = 256

_INT32_MAX = 2**31 - 1

Plan = tuple[int, int, int]


def spectral_cluster(arch=None) -> int:
    """Blocks per matrix for ``arch`` (default: the test runtime's device): 8 from sm_90, else 1
    (the value spectral.cu compiles in for that architecture)."""
    from foxhunt.fast._build import normalize_arch

    if arch is None:
        arch = runtime().device.arch
    return SPECTRAL_CLUSTER_SM90 if normalize_arch(arch) >= 90 else 1


def _up4(n: int) -> int:
    return -(-n // 4) * 4


def spectral_shared_floats(rows: int, cols: int, cluster: int) -> tuple[int, int, int]:
    """Floats of dynamic shared memory the kernel needs for a ``rows x cols`` matrix on a
    cluster of ``cluster`` blocks (spectral.cu's layout): ``(recv, with_u, with_w)`` -- the
    W^T u partials (required), plus u of a block's rows (kept in shared memory from ``with_u``
    on), plus the old v and the block's rows of W with 3 floats of alignment slack (cached from
    ``with_w`` on)."""
    per = -(-rows // cluster)
    recv = cluster * -(-min(cols, SPECTRAL_COL_TILE) // cluster)
    u_at = _up4(recv)
    v_at = _up4(u_at + per)
    w_at = _up4(v_at + cols)
    return recv, u_at + per, w_at + 3 + per * cols


def spectral_shared_bytes(arch=None) -> int:
    """Dynamic shared memory of both plans (``arch`` as :func:`spectral_cluster`): the layout of
    ``SPECTRAL_CACHE_SHAPE`` (W cached) where it fits in ``SPECTRAL_SHARED_LIMIT``, and at least
    the minimum: the partials of a full column tile and u of ``SPECTRAL_U_MIN`` rows (what the
    kernel's static arrays held before). Multiples of 16 bytes."""
    c = spectral_cluster(arch)
    minimum = 4 * (_up4(c * -(-SPECTRAL_COL_TILE // c)) + SPECTRAL_U_MIN)
    cached = 4 * _up4(spectral_shared_floats(*SPECTRAL_CACHE_SHAPE, c)[2])
    return max(minimum, cached) if cached <= SPECTRAL_SHARED_LIMIT else minimum


def plan_spectral_norm(arch=None) -> Plan:
    """One cluster for one matrix (``arch`` as :func:`spectral_cluster`), with
    :func:`spectral_shared_bytes` of dynamic shared memory."""
    return spectral_cluster(arch), SPECTRAL_THREADS, spectral_shared_bytes(arch)


def plan_batched_spectral_norm(count: int, arch=None) -> Plan:
    """One cluster per matrix, the same blocks and shared memory as :func:`plan_spectral_norm`."""
    return (check_int("count", count, minimum=1) * spectral_cluster(arch), SPECTRAL_THREADS,
            spectral_shared_bytes(arch))


#: Dynamic shared memory of the training step's launch on sm_90 and newer
#: (:func:`plan_step_spectral_norm`): more than half of an SM's 228 KiB, so that an SM holds
#: one block of a matrix's cluster and the 80 blocks of the seed's 10 matrices spread over 80
#: SMs. Measured on the H200 (session 24, critical_path.py --measure core, one call): graph 2
#: replayed in 25.6 us with the 35 KiB plan, 22.2 us with 76 KiB (two blocks an SM) and 21.2 us
#: with this (the kernel's node time alone unchanged, 7.3 us); the step as one graph 115.3 ->
#: 110.7 us. The kernel's bits do not depend on it (spectral.cu's header); larger matrices
#: (trunk widths from 512) are cached in shared memory with it where they were not.
SPECTRAL_SPREAD_SHARED = 116 * 1024


#: The matrices' clusters an H100 or H200 (132 SMs) runs at once with one block an SM
#: (``SPECTRAL_SPREAD_SHARED``): the driver's ``cuOccupancyMaxActiveClusters`` for
#: ``batched_spectral_norm``'s 8-block clusters answered 15 on both (sessions 35 and 47; 30 with
#: ``SPECTRAL_PAIR_SHARED``, 45 with 56 KiB). The step with every second-wave source has 16
#: weight matrices: with one block an SM its last cluster waited for another to finish.
SPECTRAL_SPREAD_CLUSTERS = 15

#: Dynamic shared memory of the training step's launch with more matrices than
#: ``SPECTRAL_SPREAD_CLUSTERS`` (:func:`plan_step_spectral_norm` with ``fit_clusters``): at most
#: half of an SM's 228 KiB (two blocks an SM), so that every matrix's cluster runs at once.
#: Measured on an H100 (session 47, ``critical_path.py --measure``, the seed step with every
#: second-wave source, bf16): the node took 13.2 us with ``SPECTRAL_SPREAD_SHARED``, 9.1 us
#: with this (and with 76 KiB), 8.7 us with 56 KiB; graph 2 replayed in 31.5, 28.3, 28.0 and
#: 29.1 us. The core step's 10 matrices: 8.4 us either way, graph 2 22.7 us with one block an
#: SM and 23.4-23.8 us with this.
SPECTRAL_PAIR_SHARED = 100 * 1024


def plan_step_spectral_norm(count: int, arch=None, *, fit_clusters: bool = False) -> Plan:
    """The training step's ``batched_spectral_norm`` launch: :func:`plan_batched_spectral_norm`
    with ``SPECTRAL_SPREAD_SHARED`` bytes of dynamic shared memory on sm_90 and newer (one
    block an SM; the graph lowering sets the kernel's opt-in limit for it), the plan's own
    before; with ``fit_clusters`` and more than ``SPECTRAL_SPREAD_CLUSTERS`` matrices,
    ``SPECTRAL_PAIR_SHARED`` (two blocks an SM). The bits do not depend on it. A population of
    more than one member launches it with :func:`spectral_shared_bytes`
    (``population_engine.population_shared``): its members' clusters fill the SMs anyway."""
    grid, block, smem = plan_batched_spectral_norm(count, arch)
    if spectral_cluster(arch) > 1:
        pair = fit_clusters and count > SPECTRAL_SPREAD_CLUSTERS
        smem = max(smem, SPECTRAL_PAIR_SHARED if pair else SPECTRAL_SPREAD_SHARED)
    return grid, block, smem


def _dims(name: str, w: np.ndarray) -> tuple[int, int]:
    check_elements(name, w)  # the kernels' int offsets within a matrix
    rows, cols = w.shape
    if rows > _INT32_MAX or cols > _INT32_MAX:
        raise ValueError(f"{name}: shape {w.shape} has a dimension above {_INT32_MAX} "
                         "(int32 on the device)")
    return rows, cols


def spectral_descriptors(matrices: Sequence[tuple[int, int, int, int, int]]) -> np.ndarray:
    """Descriptors ``(w_ptr, u_ptr, v_ptr, rows, cols)`` as the kernel reads them (upload the
    returned array to the device and pass its pointer as ``mats``)."""
    desc = np.zeros(len(matrices), dtype=SPECTRAL_MATRIX_DTYPE)
    for k, (w_ptr, u_ptr, v_ptr, rows, cols) in enumerate(matrices):
        desc[k] = (w_ptr, u_ptr, v_ptr, rows, cols)
    return desc


def spectral_norm(w: np.ndarray, u: np.ndarray, v: np.ndarray,
                  sigma_max: float) -> SpectralNormResult:
    """Test entry of the CUDA ``spectral_norm``: one power iteration and the bound on one matrix.

    Contract as ``reference.kernels.spectral.spectral_norm``. Returns
    ``SpectralNormResult(w, u, v, sigma)`` (float32 arrays and a float32 scalar).
    """
    bound = validate_spectral_norm(w, u, v, sigma_max)
    rows, cols = _dims("w", w)
    grid, block, smem = plan_spectral_norm()
    w_new, u_new, v_new, sigma = call(
        "spectral_norm", grid, block, InOut(w), InOut(u), InOut(v), rows, cols, bound,
        SPECTRAL_EPS, Out((1,), F32), shared_mem=smem)
    return SpectralNormResult(w_new, u_new, v_new, F32(sigma[0]))


def batched_spectral_norm(ws: Sequence[np.ndarray], us: Sequence[np.ndarray],
                          vs: Sequence[np.ndarray],
                          sigma_max: float) -> BatchedSpectralNormResult:
    """Test entry of the CUDA ``batched_spectral_norm``: one launch, one cluster per matrix.

    Same arguments, validation and result lists as the reference twin; every entry is bitwise
    equal to :func:`spectral_norm` on that matrix.
    """
    bound = validate_batched_spectral_norm(ws, us, vs, sigma_max)
    n = len(ws)
    dims = [_dims(f"ws[{k}]", ws[k]) for k in range(n)]

    hosts = [np.ascontiguousarray(a) for k in range(n) for a in (ws[k], us[k], vs[k])]
    offsets, total = [], 0
    for host in hosts:
        offsets.append(total)
        total += -(-host.nbytes // POOL_ALIGNMENT) * POOL_ALIGNMENT
    rt = runtime()
    drv, cu = _driver()
    stream = rt.stream.handle
    pool = rt.device.alloc(total)
    try:
        for host, off in zip(hosts, offsets):
            cu(drv.cuMemcpyHtoDAsync, pool.ptr + off, host.ctypes.data, host.nbytes, stream)
        ptrs = [pool.ptr + off for off in offsets]
        desc = spectral_descriptors([(ptrs[3 * k], ptrs[3 * k + 1], ptrs[3 * k + 2], *dims[k])
                                     for k in range(n)])
        grid, block, smem = plan_batched_spectral_norm(n)
        # call() launches on rt.stream after the copies above and synchronises the stream.
        (sigmas,) = call("batched_spectral_norm", grid, block, In(desc), n, bound, SPECTRAL_EPS,
                         Out((n,), F32), shared_mem=smem)
        outs = [np.empty_like(host) for host in hosts]
        for out, off in zip(outs, offsets):
            cu(drv.cuMemcpyDtoHAsync, out.ctypes.data, pool.ptr + off, out.nbytes, stream)
        rt.stream.synchronize()
    finally:
        pool.free()
    return BatchedSpectralNormResult(
        [outs[3 * k] for k in range(n)], [outs[3 * k + 1] for k in range(n)],
        [outs[3 * k + 2] for k in range(n)], [F32(s) for s in sigmas],
    )


def _driver():
    from cuda.bindings import driver

    from foxhunt.fast.device import call as cu

    return driver, cu


KERNELS = {
    "spectral_norm": spectral_norm,
    "batched_spectral_norm": batched_spectral_norm,
}

__all__ = [
    "KERNELS", "POOL_ALIGNMENT", "SPECTRAL_CACHE_SHAPE", "SPECTRAL_CLUSTER_SM90",
    "SPECTRAL_COL_TILE", "SPECTRAL_MATRIX_DTYPE", "SPECTRAL_PAIR_SHARED", "SPECTRAL_SHARED_LIMIT",
    "SPECTRAL_SPREAD_CLUSTERS", "SPECTRAL_SPREAD_SHARED", "SPECTRAL_THREADS",
    "SPECTRAL_TREE_THREADS", "SPECTRAL_U_MIN", "batched_spectral_norm",
    "plan_batched_spectral_norm", "plan_spectral_norm", "plan_step_spectral_norm",
    "spectral_cluster",
    "spectral_descriptors", "spectral_norm", "spectral_shared_bytes", "spectral_shared_floats",
]
