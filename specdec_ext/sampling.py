"""Logits processing shared by the target and the draft: per-request top-k and top-p masks, applied as
transformers applies them (temperature first, then top-k, then top-p). Temperature itself is applied inside
the sampling kernels (softmax(logits / temperature) in float32), so the processed logits are only masked:
a masked entry is -inf, every other entry is unchanged."""
import torch


def mask_top_k_top_p(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                     top_p: torch.Tensor) -> torch.Tensor:
    """logits [B, ..., V] float32; temperature, top_k (0 = off), top_p (1.0 = off): [B]. Returns the logits with
    the entries outside each row's top-k, then outside the smallest set whose probability at the request's
    temperature reaches top_p, set to -inf (ties at a boundary are kept, at least one entry always is).
    Greedy rows (temperature 0) are returned unchanged: the masks never remove the argmax."""
    b, v = logits.shape[0], logits.shape[-1]
    shape = (b,) + (1,) * (logits.dim() - 1)
    sampled = temperature > 0
    k = torch.where(sampled & (top_k > 0), top_k.clamp(max=v), v).long()
    p = torch.where(sampled, top_p, 1.0)
    if bool((k < v).any()):  # one host read: skip the sort when no request asks for top-k
        kth = logits.topk(int(k.max()), dim=-1).values.gather(-1, (k.view(shape) - 1).expand(*logits.shape[:-1], 1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if bool((p < 1.0).any()):
        scaled = logits / torch.where(sampled, temperature, 1.0).view(shape)
        sorted_logits, order = scaled.sort(dim=-1)  # ascending, as transformers' TopPLogitsWarper
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - p).view(shape)
        remove[..., -1] = False
        logits = logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    return logits
