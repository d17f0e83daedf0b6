"""FlashInfer's speculative-decoding entry points with FlashInfer's own signatures, on specdec_ext's kernels.

Follows the contract of FlashInfer 0.7.0rc3 to 0.7.4 (flashinfer/sampling.py, flashinfer/prefill.py; the signatures
of both releases are checked by tests/engine_suites):
    from specdec_ext.compat.flashinfer import sampling
    out, accepted, emitted = sampling.chain_speculative_sampling(draft_probs, draft_token_ids, target_probs)
    wrapper = BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD"); wrapper.plan(...); wrapper.run(q, kv_cache)

Importing this package imports no FlashInfer. Where FlashInfer's contract has a lossy or unsupported mode the call
raises ValueError naming the argument; the differences that remain are listed in each module's docstring.
"""
from . import prefill, sampling
from .prefill import BatchPrefillWithPagedKVCacheWrapper

__all__ = ["sampling", "prefill", "BatchPrefillWithPagedKVCacheWrapper"]
