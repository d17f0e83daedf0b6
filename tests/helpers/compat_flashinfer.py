"""The FlashInfer shim's cases and checks (tests/gpu reruns them on CUDA): chain_speculative_sampling's documented
example and FlashInfer's test statement; the paged prefill wrapper's batches, masks and float64 reference."""
import math

import torch

from helpers.verify_attention import random_tree_mask


# ----- chain_speculative_sampling -----------------------------------------------------------------------------------
def documented_example(device="cpu"):
    """FlashInfer's docstring example: draft 2 passes (p = 0.6 >= q = 0.3), draft 1 fails (p = 0), and the residual
    max(0, p - q) of position 1 has all its mass on token 0: [[2, 0, -1]] with one draft accepted and one emitted,
    whatever the random draws."""
    draft = torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.2, 0.3, 0.4, 0.1]]], device=device)
    ids = torch.tensor([[2, 1]], dtype=torch.int32, device=device)
    target = torch.tensor([[[0.0, 0.1, 0.6, 0.3], [1.0, 0.0, 0.0, 0.0], [0.7, 0.1, 0.1, 0.1]]], device=device)
    return draft, ids, target


DOCUMENTED_OUTPUT = [[2, 0, -1]]  # the documented example's output


def flashinfer_case(gen, batch, k, vocab, onehot, device="cpu"):
    """FlashInfer's test inputs: normalised uniform draft rows, uniform draft ids; targets normalised uniform, or
    one-hot at the drafts followed by a uniform bonus id. Returns (draft, ids, target, target_ids or None)."""
    draft = torch.rand(batch, k, vocab, generator=gen)
    draft /= draft.sum(-1, keepdim=True)
    ids = torch.randint(0, vocab, (batch, k), generator=gen, dtype=torch.int32)
    target_ids = None
    if onehot:
        target_ids = torch.cat([ids, torch.randint(0, vocab, (batch, 1), generator=gen, dtype=torch.int32)], 1)
        target = torch.zeros(batch, k + 1, vocab).scatter_(2, target_ids.long().unsqueeze(-1), 1.0)
    else:
        target = torch.rand(batch, k + 1, vocab, generator=gen)
        target /= target.sum(-1, keepdim=True)
    def to(t):
        return None if t is None else t.to(device)
    return to(draft), to(ids), to(target), to(target_ids)


def check_flashinfer_statement(out, accepted, emitted, ids, vocab, target_ids):
    """FlashInfer's test of chain_speculative_sampling, plus what its docstring promises about the counts."""
    batch, k = ids.shape
    assert out.dtype == torch.int32 and tuple(out.shape) == (batch, k + 1)
    if target_ids is not None:  # every draft has target mass 1: all pass, and the bonus is the target's one-hot id
        assert torch.equal(out, target_ids)
        assert torch.equal(emitted.long(), torch.full((batch,), k)) and torch.equal(accepted.long(), emitted.long())
    valid = out >= 0
    assert torch.all(out[valid] < vocab) and torch.all(out[~valid] == -1)
    mismatch = out[:, :-1] != ids
    for row in range(batch):
        where = mismatch[row].nonzero().flatten()
        if len(where):
            assert torch.all(where[1:] == where[:-1] + 1)  # the mismatches are contiguous
            assert torch.all(out[row, where[0] + 1:] == -1)  # and -1 from the one after the first
    assert torch.equal(emitted.long() + 1, valid.sum(1))
    assert torch.all(emitted <= accepted) and torch.all(accepted <= k)
    keep = torch.arange(k).unsqueeze(0) < emitted.long().unsqueeze(1)
    assert torch.equal(torch.where(keep, out[:, :k], -1), torch.where(keep, ids, -1))  # the emitted drafts verbatim


# ----- BatchPrefillWithPagedKVCacheWrapper --------------------------------------------------------------------------
def paged_batch(gen, qo_lens, prefix_lens, page_size, hq, hkv, d, dtype, layout, spare_pages=3):
    """A batch in FlashInfer's paged layout: one cache tensor [pages, 2, ...], each request's pages scattered at
    random, its KV (prefix + the qo_len new tokens) filling the last page partly or fully, and the CSR table."""
    kv_lens = [p + n for p, n in zip(prefix_lens, qo_lens)]
    pages = [-(-s // page_size) for s in kv_lens]
    num_pages = sum(pages) + spare_pages
    shape = (num_pages, 2, page_size, hkv, d) if layout == "NHD" else (num_pages, 2, hkv, page_size, d)
    cache = torch.randn(shape, generator=gen).to(dtype)
    indices = torch.randperm(num_pages, generator=gen)[:sum(pages)].int()
    kv_indptr = torch.tensor([0] + pages).cumsum(0).int()
    last = torch.tensor([s - (p - 1) * page_size if p else 0 for s, p in zip(kv_lens, pages)], dtype=torch.int32)
    qo_indptr = torch.tensor([0] + list(qo_lens)).cumsum(0).int()
    q = torch.randn(sum(qo_lens), hq, d, generator=gen).to(dtype)
    return q, cache, qo_indptr, kv_indptr, indices, last, kv_lens


def flashinfer_masks(gen, kind, qo_lens, kv_lens):
    """Per request the [qo_len, kv_len] bool mask FlashInfer's kernel applies (True: visible): causal aligned to the
    end of the KV, full, or a token tree over the new tokens with the prefix visible."""
    masks = []
    for n, s in zip(qo_lens, kv_lens):
        if kind == "causal":
            masks.append(torch.arange(s).unsqueeze(0) <= (s - n + torch.arange(n)).unsqueeze(1))
        elif kind == "full":
            masks.append(torch.ones(n, s, dtype=torch.bool))
        else:
            masks.append(torch.cat([torch.ones(n, s - n, dtype=torch.bool), random_tree_mask(gen, n)], 1))
    return masks


def pack_segments(masks):
    """FlashInfer's packed custom mask, written out here: each request's flattened bits from a byte boundary, bit j
    of a byte = element j."""
    out = []
    for m in masks:
        bits = m.reshape(-1).to(torch.int64)
        bits = torch.cat([bits, bits.new_zeros(-bits.numel() % 8)]).view(-1, 8)
        out.append((bits << torch.arange(8)).sum(1).to(torch.uint8))
    return torch.cat(out + [torch.zeros(0, dtype=torch.uint8)])


def reference_attention(q, cache, layout, qo_indptr, kv_indptr, indices, masks, page_size, scale=None, window_left=-1,
                        soft_cap=0.0):
    """float64 attention of each request's queries against the KV gathered from its pages with FlashInfer's masks
    (masks[b]: [qo_len, kv_len]); returns out [T, Hq, D] and the log-sum-exp in base 2 [T, Hq]."""
    t, hq, d = q.shape
    scale = d**-0.5 if scale is None else scale
    out = torch.zeros(t, hq, d, dtype=torch.float64)
    lse = torch.full((t, hq), float("-inf"), dtype=torch.float64)
    for b, mask in enumerate(masks):
        r0, (n, s) = int(qo_indptr[b]), mask.shape
        if n == 0:
            continue
        pos = torch.arange(s)
        page = indices[int(kv_indptr[b]) + pos // page_size].long()
        kv = cache[page, :, pos % page_size] if layout == "NHD" else cache[page, :, :, pos % page_size]
        k, v = (kv[:, j].double().repeat_interleave(hq // kv.shape[-2], 1) for j in (0, 1))  # [S, Hq, D]
        scores = torch.einsum("qhd,shd->hqs", q[r0:r0 + n].double(), k) * scale
        if soft_cap > 0:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        visible = mask.clone()
        if window_left >= 0:
            visible &= pos.unsqueeze(0) >= (s - n + torch.arange(n)).unsqueeze(1) - window_left
        scores = scores.masked_fill(~visible, float("-inf"))
        out[r0:r0 + n] = torch.einsum("hqs,shd->qhd", torch.softmax(scores, -1), v)
        lse[r0:r0 + n] = (torch.logsumexp(scores, -1) / math.log(2)).transpose(0, 1)
    return out, lse


def plan_and_run(wrapper, batch, page_size, hq, hkv, mask_kind, masks, **plan_kwargs):
    """plan() with FlashInfer's mask arguments for mask_kind, then run() into NaN-poisoned out / lse buffers."""
    q, cache, qo_indptr, kv_indptr, indices, last = batch
    mask_args = {"causal": {"causal": True}, "full": {},
                 "custom": {"custom_mask": torch.cat([m.reshape(-1) for m in masks])},
                 "packed": {"packed_custom_mask": pack_segments(masks)}}[mask_kind]
    wrapper.plan(qo_indptr, kv_indptr, indices, last, hq, hkv, q.shape[-1], page_size, **mask_args, **plan_kwargs)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=q.device)
    got, got_lse = wrapper.run(q, cache, out=out, lse=lse, return_lse=True)
    assert got is out and got_lse is lse
    return out, lse
