"""Stand-in `flashinfer.prefill`: BatchPrefillWithPagedKVCacheWrapper is specdec_ext's shim;
single_prefill_with_kv_cache, the engine's kernel that FlashInfer's tests take as the reference, is attention in
float64 PyTorch here."""
import math

import torch

from specdec_ext.compat.flashinfer.prefill import BatchPrefillWithPagedKVCacheWrapper

__all__ = ["BatchPrefillWithPagedKVCacheWrapper", "single_prefill_with_kv_cache"]


def single_prefill_with_kv_cache(q, k, v, custom_mask=None, packed_custom_mask=None, causal=False, kv_layout="NHD",
                                 pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None,
                                 window_left=-1, logits_soft_cap=None, rope_scale=None, rope_theta=None,
                                 return_lse=False):
    """Attention of one request, as FlashInfer defines it: q [qo_len, Hq, D], k / v [kv_len, Hk, D] (NHD; HND is
    [Hk, kv_len, D]); causal aligns the queries to the end of the KV (query i sees positions <= kv_len - qo_len + i);
    custom_mask [qo_len, kv_len] bool (True = visible); window_left keeps the window_left positions before the
    diagonal; logits_soft_cap c > 0 maps a logit x to c * tanh(x / c). Output in q's dtype; lse in base 2."""
    if pos_encoding_mode != "NONE" or packed_custom_mask is not None:
        raise ValueError("the stand-in reference takes pos_encoding_mode NONE and an unpacked custom_mask only")
    if kv_layout == "HND":
        k, v = k.transpose(0, 1), v.transpose(0, 1)
    qo_len, heads, dim = q.shape
    kv_len, kv_heads = k.shape[0], k.shape[1]
    qd, kd, vd = (t.double() for t in (q, k, v))
    kd = kd.repeat_interleave(heads // kv_heads, dim=1)
    vd = vd.repeat_interleave(heads // kv_heads, dim=1)
    logits = torch.einsum("qhd,khd->hqk", qd, kd) * (sm_scale if sm_scale is not None else 1.0 / math.sqrt(dim))
    if logits_soft_cap:
        logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
    i = torch.arange(qo_len).unsqueeze(1) + (kv_len - qo_len)
    j = torch.arange(kv_len).unsqueeze(0)
    visible = torch.ones(qo_len, kv_len, dtype=torch.bool)
    if custom_mask is not None:
        visible = custom_mask.reshape(qo_len, kv_len).cpu().bool()
    elif causal:
        visible = j <= i
    if window_left >= 0:
        visible = visible & (j >= i - window_left)
    logits = logits.masked_fill(~visible.to(logits.device), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", logits.softmax(-1).nan_to_num(0.0), vd).to(q.dtype)
    if return_lse:
        return out, (torch.logsumexp(logits, -1) / math.log(2.0)).transpose(0, 1).float()
    return out


def __getattr__(name):
    raise AttributeError(f"flashinfer.prefill.{name} is not part of specdec_ext's stand-in")
