"""Shared pytest configuration: the hypothesis profiles (``ci`` derandomised, ``dev`` random),
defined once in ``foxhunt.conformance.strategies``; the ``lt`` fixture (cuBLASLt's bindings, or
a skip with the reason) of the GPU GEMM tests; the ``nvrtc_cache`` fixture (one NVRTC disk cache
for the session's builds of the same sources) and ``package_build`` (the session's two builds of
the whole package, read by every test that looks at the package's compiled kernels)."""

import os

import pytest

from foxhunt.conformance.strategies import load_hypothesis_profile

load_hypothesis_profile()


@pytest.fixture(scope="module")
def lt():
    """``nvmath.bindings.cublasLt`` as ``foxhunt.fast.gemm`` loads it; skips with the reason
    where it cannot be loaded."""
    from foxhunt.fast.gemm import CublasUnavailableError, _cublaslt

    try:
        return _cublaslt()
    except CublasUnavailableError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def nvrtc_cache(tmp_path_factory):
    """A ``compile_sources`` cache folder shared by the whole test session: a build of the same
    sources, options and architecture that another test already made is read back, not compiled
    again (CI has two cores; walk.cu alone takes about 5 s a build). Under pytest-xdist
    (``.ci/run``'s workers) one folder for all the workers of the run, beside their base
    temporary folders: a build is made under its entry's file lock (``fast._build._build_lock``),
    so a worker wanting a build another is making waits and reads it back. Tests of the cache
    itself keep a ``tmp_path`` of their own."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "nvrtc-shared"
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("nvrtc-shared")


#: The session's builds of the whole package, by architecture: sm_80 as PTX (the oldest
#: architecture, and the PTX a driver JIT-compiles), sm_90 as cubin (the build the GPU tests
#: load; a cubin build makes the PTX too). Each costs CI's two cores tens of seconds.
PACKAGE_BUILD_KINDS = {"sm_80": "ptx", "sm_90": "cubin"}


@pytest.fixture(scope="session")
def package_build(nvrtc_cache):
    """``package_build(arch)``: the whole package compiled for ``arch`` as
    ``package_build.kinds[arch]`` (``PACKAGE_BUILD_KINDS``) says, through the session's
    ``nvrtc_cache`` (one build a session, whichever test asks first)."""
    from foxhunt.fast._build import compile_sources

    def build(arch: str):
        return compile_sources(arch, PACKAGE_BUILD_KINDS[arch], cache_root=nvrtc_cache)

    build.kinds = PACKAGE_BUILD_KINDS
    return build
