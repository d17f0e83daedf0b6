"""Sampling shared by the target and the draft. Temperature, top-k, top-p and min-p are applied inside the sampling
kernels (softmax(logits / temperature) in float32, then the per-request processing of csrc/include/specdec/
row_filter.h, without sorting), so logits are handed over unprocessed; specdec_ext.reference.filter_logits is the
readable version of the processing."""
import torch

from .ops import chain_speculative_sampling_from_logits


def sample_from_logits(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor,
                       offset: torch.Tensor, coupling: str = "rejection", *, top_k=None, top_p=None,
                       min_p=None) -> torch.Tensor:
    """One token per row of logits [B, V], drawn by the chain sampling kernel with no drafts: its bonus token, from
    softmax(logits / temperature[b]) in float32 processed by top_k, top_p, min_p ([B] or None: off; argmax at
    temperature 0), with uniform 0 of Philox stream 1 of (seed[b], offset[b]). Returns [B] int32. The same kernel
    computes the draft distribution q from these logits and controls when they are handed to it, so a drafter
    sampling here proposes from exactly the q it reports (processed over the same columns in the same order).
    coupling="gumbel": the Gumbel-max sample with the noise of (seed[b], position offset[b]) instead (gumbel_sample's
    draw), the token the sampling ops' gumbel coupling draws at that position."""
    batch, vocab = logits.shape
    out = chain_speculative_sampling_from_logits(
        torch.zeros(batch, 1, dtype=torch.int64, device=logits.device), logits.unsqueeze(1).expand(batch, 2, vocab),
        temperature=temperature, num_draft_tokens=torch.zeros(batch, dtype=torch.int32, device=logits.device),
        seed=seed, offset=offset, coupling=coupling, top_k=top_k, top_p=top_p, min_p=min_p)
    return out.output_token_ids[:, 0]
