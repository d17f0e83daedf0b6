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
    """The shape of the last kernel launch on this thread: blocks, threads_per_block, cluster_blocks."""
    return _sim.last_launch()


def philox_uniform(seed, offset, n: int, stream: int = 0) -> torch.Tensor:
    """specdec_ext.philox_uniform under the emulator."""
    return ops._philox_uniform(torch.ops.specdec_sim, seed, offset, n, stream)


def chain_speculative_sampling(draft_token_ids, target_probs, draft_probs=None, *, num_draft_tokens=None, greedy=None,
                               seed=None, offset=None, generator=None, out=None) -> ops.SamplingOutput:
    """specdec_ext.chain_speculative_sampling under the emulator (device-side error recording, as on CUDA)."""
    return ops._chain_sampling(torch.ops.specdec_sim, draft_token_ids, target_probs, draft_probs, logits=False,
                               num_draft_tokens=num_draft_tokens, greedy_or_temperature=greedy, seed=seed,
                               offset=offset, generator=generator, out=out, records_errors=True)


def chain_speculative_sampling_from_logits(draft_token_ids, target_logits, draft_logits=None, *, temperature,
                                           num_draft_tokens=None, seed=None, offset=None, generator=None,
                                           out=None) -> ops.SamplingOutput:
    """specdec_ext.chain_speculative_sampling_from_logits under the emulator."""
    return ops._chain_sampling(torch.ops.specdec_sim, draft_token_ids, target_logits, draft_logits, logits=True,
                               num_draft_tokens=num_draft_tokens, greedy_or_temperature=temperature, seed=seed,
                               offset=offset, generator=generator, out=out, records_errors=True)


def truncate_kv_cache(cache_seqlens, num_kept, *, block_len=None, kept_indices=None, k_caches=(), v_caches=(),
                      block_table=None, clear=False) -> None:
    """specdec_ext.truncate_kv_cache under the emulator (device-side error recording, as on CUDA)."""
    ops._truncate_kv_cache(torch.ops.specdec_sim, cache_seqlens, num_kept, block_len=block_len,
                           kept_indices=kept_indices, k_caches=k_caches, v_caches=v_caches, block_table=block_table,
                           clear=clear, records_errors=True)


def verify_attention(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, *, block_table=None, tree_mask=None,
                     softmax_scale=None, return_lse=False):
    """specdec_ext.verify_attention's CUDA kernel under the emulator (float16/bfloat16, head dim 64 or 128;
    device-side error recording, as on CUDA)."""
    return ops._verify_attention(torch.ops.specdec_sim, q, k_cache, v_cache, cache_seqlens, k_new, v_new,
                                 block_table=block_table, tree_mask=tree_mask, softmax_scale=softmax_scale,
                                 return_lse=return_lse, records_errors=True)
