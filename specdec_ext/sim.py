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


def last_launch() -> dict:
    """The shape of the last kernel launch on this thread: blocks, threads_per_block, cluster_blocks, cooperative."""
    return _sim.last_launch()


# The public ops of §3, defined once in ops.Ops, on the emulated kernels: errors are recorded on the "device"
# (set_strict(True) raises), as on CUDA.
EMULATED = ops.Ops(torch.ops.specdec_sim, records_errors=lambda t: True)
philox_uniform = EMULATED.philox_uniform
chain_speculative_sampling = EMULATED.chain_speculative_sampling
chain_speculative_sampling_from_logits = EMULATED.chain_speculative_sampling_from_logits
tree_speculative_sampling = EMULATED.tree_speculative_sampling
gumbel_sample = EMULATED.gumbel_sample
sample_without_drafts = EMULATED.sample_without_drafts
logits_normalizer = EMULATED.logits_normalizer
tree_speculative_sampling_from_logits = EMULATED.tree_speculative_sampling_from_logits
truncate_kv_cache = EMULATED.truncate_kv_cache
verify_attention = EMULATED.verify_attention
quantized_linear = EMULATED.quantized_linear
dequantize = EMULATED.dequantize
