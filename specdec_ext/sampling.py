"""Sampling shared by the target and the draft. Temperature, top-k, top-p and min-p are applied inside the sampling
kernels (softmax(logits / temperature) in float32, then the per-request processing of csrc/include/specdec/
row_filter.h, without sorting), so logits are handed over unprocessed; specdec_ext.reference.filter_logits is the
readable version of the processing. The draw itself is specdec_ext.ops.sample_without_drafts."""
import torch

from .ops import sample_without_drafts


def sample_from_logits(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor,
                       offset: torch.Tensor, coupling: str = "rejection", *, top_k=None, top_p=None,
                       min_p=None) -> torch.Tensor:
    """ops.sample_without_drafts with the controls passed by position (the drafters' call): one token per row of
    logits [B, V], drawn as the sampling ops draw the target's tokens, so that a drafter sampling here proposes from
    exactly the q it reports. Returns [B] int32."""
    return sample_without_drafts(logits, temperature=temperature, seed=seed, offset=offset, coupling=coupling,
                                 top_k=top_k, top_p=top_p, min_p=min_p)
