"""specdec_ext: the kernels of lossless speculative decoding as a PyTorch extension.

Public ops (docs/design.md §3) are importable from here; `specdec_ext.reference` holds their pure-PyTorch
references, `specdec_ext.sim` runs the CUDA kernels' source under the SIMT emulator.
"""
from ._version import __version__
from .drafters import (
    Drafter,
    EagleDrafter,
    LookaheadDrafter,
    MedusaDrafter,
    ModelDrafter,
    NgramDrafter,
    SelfSpeculativeDrafter,
)
from .engine import AcceptanceMonitor, GenerationOutput, GenerationStats, SpeculativeDecoder
from .kv_cache import PagedKVCache, StaticKVCache
from .ops import (
    SamplingOutput,
    TreeSamplingOutput,
    chain_speculative_sampling,
    chain_speculative_sampling_from_logits,
    gumbel_sample,
    is_strict,
    logits_normalizer,
    philox_uniform,
    sample_without_drafts,
    set_strict,
    tree_speculative_sampling,
    tree_speculative_sampling_from_logits,
    truncate_kv_cache,
    verify_attention,
)
from .trees import DraftTree, TreeSettings


def build_info() -> dict:
    """What the compiled extension contains: version, CUDA architectures, compiler, CPU features."""
    from . import _C

    return _C.build_info()


__all__ = [
    "__version__",
    "AcceptanceMonitor",
    "Drafter",
    "EagleDrafter",
    "LookaheadDrafter",
    "MedusaDrafter",
    "GenerationOutput",
    "GenerationStats",
    "ModelDrafter",
    "NgramDrafter",
    "SelfSpeculativeDrafter",
    "SpeculativeDecoder",
    "build_info",
    "DraftTree",
    "PagedKVCache",
    "SamplingOutput",
    "StaticKVCache",
    "TreeSamplingOutput",
    "TreeSettings",
    "chain_speculative_sampling",
    "chain_speculative_sampling_from_logits",
    "gumbel_sample",
    "is_strict",
    "logits_normalizer",
    "philox_uniform",
    "sample_without_drafts",
    "set_strict",
    "tree_speculative_sampling",
    "tree_speculative_sampling_from_logits",
    "truncate_kv_cache",
    "verify_attention",
]
