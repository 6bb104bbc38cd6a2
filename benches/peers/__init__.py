"""Peers of the foxhunt training step written in other frameworks, for the benchmarks.

``torch_step``: the same step (SPEC 4, with the second-wave sources of ``torch_wave`` that the
config turns on) written idiomatically in PyTorch, in four execution modes (eager,
``torch.compile``, the whole step captured in a CUDA graph, and compiled + captured), each in
f32 or with BF16 autocast. ``benches/test_peers.py`` checks on the CPU that its losses,
gradients and one full step equal the reference's, so the timing comparison is honest.
"""

from .torch_step import MODES, TorchStep, step_gemm_flops

__all__ = ["MODES", "TorchStep", "step_gemm_flops"]
