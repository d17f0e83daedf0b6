"""Stand-in for the `flashinfer` package (FlashInfer's tests import it): `sampling.chain_speculative_sampling` and
`prefill.BatchPrefillWithPagedKVCacheWrapper` are specdec_ext.compat.flashinfer's;
`prefill.single_prefill_with_kv_cache` (the reference the tests compare with) is reference PyTorch;
`jit.build_jit_specs` does nothing. Other attributes raise AttributeError: they are not what the shim replaces."""
from . import jit, prefill, sampling
from .prefill import BatchPrefillWithPagedKVCacheWrapper

__all__ = ["jit", "prefill", "sampling", "BatchPrefillWithPagedKVCacheWrapper"]


def __getattr__(name):
    raise AttributeError(f"flashinfer.{name} is not part of specdec_ext's stand-in (tests/engine_suites/standins)")
