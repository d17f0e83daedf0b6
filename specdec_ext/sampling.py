"""Logits processing shared by the target and the draft: per-request top-k and top-p masks, applied as
transformers applies them (temperature first, then top-k, then top-p). Temperature itself is applied inside
the sampling kernels (softmax(logits / temperature) in float32), so the processed logits are only masked:
a masked entry is -inf, every other entry is unchanged."""
import torch

from .ops import chain_speculative_sampling_from_logits


def mask_top_k_top_p(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                     top_p: torch.Tensor, *, max_top_k: int | None = None,
                     any_top_p: bool | None = None) -> torch.Tensor:
    """logits [B, ..., V] float32; temperature, top_k (0 = off), top_p (1.0 = off): [B]. Returns the logits with
    the entries outside each row's top-k, then outside the smallest set whose probability at the request's
    temperature reaches top_p, set to -inf (ties at a boundary are kept, at least one entry always is).
    Greedy rows (temperature 0) are returned unchanged: the masks never remove the argmax.
    max_top_k (the largest top_k of a sampled request, 0 if none) and any_top_p (whether a sampled request has
    top_p < 1), when the caller knows them: no host read (CUDA-graph capture); None reads them from the tensors."""
    b, v = logits.shape[0], logits.shape[-1]
    shape = (b,) + (1,) * (logits.dim() - 1)
    sampled = temperature > 0
    k = torch.where(sampled & (top_k > 0), top_k.clamp(max=v), v).long()
    p = torch.where(sampled, top_p, 1.0)
    masked = (k < v).view(shape)
    if max_top_k is None:
        max_top_k = int(torch.where(k < v, k, 0).max()) if b else 0  # one host read: no top-k, no topk()
    max_top_k = min(max_top_k, v)
    if max_top_k > 0:
        kth = logits.topk(max_top_k, dim=-1).values.gather(
            -1, (k.clamp(max=max_top_k).view(shape) - 1).expand(*logits.shape[:-1], 1))
        logits = logits.masked_fill(masked & (logits < kth), float("-inf"))
    if any_top_p is None:
        any_top_p = bool((p < 1.0).any())
    if any_top_p:
        scaled = logits / torch.where(sampled, temperature, 1.0).view(shape)
        sorted_logits, order = scaled.sort(dim=-1)  # ascending, as transformers' TopPLogitsWarper
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - p).view(shape)
        remove[..., -1] = False
        logits = logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    return logits


def sample_from_logits(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor,
                       offset: torch.Tensor, coupling: str = "rejection") -> torch.Tensor:
    """One token per row of logits [B, V] (already masked), drawn by the chain sampling kernel with no drafts:
    its bonus token, from softmax(logits / temperature[b]) in float32 (argmax at temperature 0), with uniform 0
    of Philox stream 1 of (seed[b], offset[b]). Returns [B] int32. The same kernel computes the draft
    distribution q from these logits when they are handed to it, so a drafter sampling here proposes from
    exactly the q it reports. coupling="gumbel": the Gumbel-max sample with the noise of (seed[b], position
    offset[b]) instead (gumbel_sample's draw), the token the sampling ops' gumbel coupling draws at that position."""
    batch, vocab = logits.shape
    out = chain_speculative_sampling_from_logits(
        torch.zeros(batch, 1, dtype=torch.int64, device=logits.device), logits.unsqueeze(1).expand(batch, 2, vocab),
        temperature=temperature, num_draft_tokens=torch.zeros(batch, dtype=torch.int32, device=logits.device),
        seed=seed, offset=offset, coupling=coupling)
    return out.output_token_ids[:, 0]
