"""foxhunt.fast: the GPU implementation (NVRTC kernels from ``cuda_src/``, cuBLASLt GEMMs, CUDA
graphs), through cuda-python's ``cuda.bindings`` and nvmath-python's cuBLASLt binding.

Importing this package needs neither a GPU nor cuda-python: the submodules import the CUDA
libraries only when used. ``cuda_available()`` says whether a GPU can be used (and why not);
constructing a ``Device`` without one raises ``NoCudaDeviceError``.

Submodules: ``_build`` (NVRTC compile + disk cache; ``ptx_params`` reads the kernels'
parameter types), ``device`` (context, streams, pinned memory), ``arena`` (one allocation,
named buffers), ``kernel_launch`` (loaded modules, argument packing), ``gemm`` (planned
cuBLASLt GEMMs), ``graphs`` (stream
capture), ``kernels`` (one launcher per CUDA kernel, by area). The step's plan as data:
``cuda_parse`` (the kernels' parameters), ``records`` (launch records bound by parameter name),
``binder`` (each record checked when made), ``dataflow`` (the dependency graph and its data-flow
check), ``step_layout`` / ``sentinel_plan`` (the buffers), ``step_program``,
``graph1_plan``, ``graph2_plan``, ``eval_plan`` (the records of each graph); run by
``gpu_engine`` (through ``graph_lowering``) or, on the CPU, ``cpu_executor`` (the reference
twins of ``cpu_kernels``); ``trainer`` (the host side of both).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "compile_sources": "_build",
    "KernelCompileError": "_build",
    "Module": "_build",
    "cuda_available": "device",
    "Device": "device",
    "Arena": "device",
    "PinnedScalars": "device",
    "LoadedModule": "device",
    "Kernel": "device",
    "NoCudaDeviceError": "device",
    "CudaError": "device",
    "GemmPlan": "gemm",
    "GemmSpec": "gemm",
    "GemmPlanError": "gemm",
    "GraphCapture": "graphs",
    "Trainer": "trainer",
    "CpuTrainer": "cpu_executor",
    "Population": "population",
    "CpuPopulation": "population",
}

__all__ = [
    "Arena",
    "CpuPopulation",
    "CpuTrainer",
    "CudaError",
    "Device",
    "GemmPlan",
    "GemmPlanError",
    "GemmSpec",
    "GraphCapture",
    "Kernel",
    "KernelCompileError",
    "LoadedModule",
    "Module",
    "NoCudaDeviceError",
    "PinnedScalars",
    "Population",
    "Trainer",
    "compile_sources",
    "cuda_available",
]

assert sorted(_EXPORTS) == __all__


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
