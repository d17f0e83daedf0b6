"""The public ops of §3, running the CUDA kernels' source under the SIMT emulator (csrc/sim) on CPU tensors.

Same names, arguments and checks as the top-level functions of specdec_ext; each call launches the CUDA
kernel, compiled as host C++, one fiber per CUDA thread. For tests: it is slow by design.
"""
import torch

from . import _extension, ops

_sim = _extension.load("_sim")
ops._register_fakes("specdec_sim")


def build_info() -> dict:
    """What the emulator extension was built with (address_sanitizer, compiler)."""
    return _sim.build_info()


def philox_uniform(seed, offset, n: int, stream: int = 0) -> torch.Tensor:
    """specdec_ext.philox_uniform under the emulator."""
    return ops._philox_uniform(torch.ops.specdec_sim, seed, offset, n, stream)
