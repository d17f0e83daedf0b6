"""verify_attention on the CPU kernel against the float64 reference: relative error ||out - ref|| / ||ref||
within fp32 2e-5, bf16 2e-2, fp16 4e-3."""
import pytest
import torch

import specdec_ext
from specdec_ext import reference

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def rel_error(out, ref):
    return float((out.double() - ref).norm() / ref.norm())


def make_case(gen, batch, n_q, hq, hkv, d, dtype, lengths, paged=None, s_max=None):
    q = torch.randn(batch, n_q, hq, d, generator=gen).to(dtype)
    k_new = torch.randn(batch, n_q, hkv, d, generator=gen).to(dtype)
    v_new = torch.randn(batch, n_q, hkv, d, generator=gen).to(dtype)
    capacity = max(lengths) + n_q
    if paged:
        page_size = paged
        pages_per_seq = -(-capacity // page_size)
        num_pages = batch * pages_per_seq + 3
        table = torch.randperm(num_pages, generator=gen)[: batch * pages_per_seq].int().reshape(batch, pages_per_seq)
        shape = (num_pages, page_size, hkv, d)
    else:
        table, shape = None, (batch, s_max or capacity + 3, hkv, d)
    k_cache = torch.randn(shape, generator=gen).to(dtype)  # random everywhere: unwritten rows would show
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    return q, k_cache, v_cache, torch.tensor(lengths, dtype=torch.int32), k_new, v_new, table


def random_tree_mask(gen, n_q):
    """A valid token tree: each node's parent is an earlier node; a node sees itself and its ancestors."""
    mask = torch.zeros(n_q, n_q, dtype=torch.bool)
    for i in range(n_q):
        mask[i, i] = True
        if i > 0:
            parent = int(torch.randint(0, i, (1,), generator=gen))
            mask[i] |= mask[parent]
    return mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n_q", [1, 2, 6, 16, 64])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 2), (8, 1), (6, 2)])
def test_contiguous_causal_with_append(dtype, n_q, hq, hkv, gen):
    lengths = [int(x) for x in torch.randint(0, 300, (3,), generator=gen)]
    lengths[0] = 0
    q, kc, vc, sl, kn, vn, _ = make_case(gen, 3, n_q, hq, hkv, 64, dtype, lengths)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    out, lse = specdec_ext.verify_attention(q, kc, vc, sl, kn, vn, return_lse=True)
    ref, ref_lse = reference.verify_attention(q, kc_ref, vc_ref, sl, kn, vn, return_lse=True)
    assert rel_error(out, ref) <= TOLERANCE[dtype]
    assert torch.allclose(lse, ref_lse, atol=1e-3 if dtype != torch.float32 else 1e-5)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)  # the new tokens written, nothing else


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("page_size", [8, 16, 256])
def test_paged_tree_mask_new_tokens_already_in_cache(dtype, page_size, gen):
    n_q = 9
    lengths = [int(x) for x in torch.randint(0, 400, (4,), generator=gen)]
    q, kc, vc, sl, _, _, table = make_case(gen, 4, n_q, 8, 2, 128, dtype, lengths, paged=page_size)
    masks = torch.stack([random_tree_mask(gen, n_q) for _ in range(4)])
    out = specdec_ext.verify_attention(q, kc, vc, sl, block_table=table, tree_mask=masks)
    ref = reference.verify_attention(q, kc, vc, sl, block_table=table, tree_mask=masks)
    assert rel_error(out, ref) <= TOLERANCE[dtype]
    shared = specdec_ext.verify_attention(q, kc, vc, sl, block_table=table, tree_mask=masks[0])
    assert rel_error(shared, reference.verify_attention(q, kc, vc, sl, block_table=table, tree_mask=masks[0])) <= \
        TOLERANCE[dtype]


def test_long_context_splits_and_scale(gen):
    # One request with 6000 cached tokens: the CPU kernel splits the keys and merges the splits by lse.
    q, kc, vc, sl, kn, vn, _ = make_case(gen, 1, 5, 8, 2, 128, torch.float32, [6000])
    out, lse = specdec_ext.verify_attention(q, kc, vc, sl, kn, vn, softmax_scale=0.05, return_lse=True)
    ref, ref_lse = reference.verify_attention(q, kc.clone(), vc.clone(), sl, kn, vn, softmax_scale=0.05, return_lse=True)
    assert rel_error(out, ref) <= 2e-5
    assert torch.allclose(lse, ref_lse, atol=1e-4)


def test_bad_arguments_are_named(gen):
    q, kc, vc, sl, kn, vn, table = make_case(gen, 2, 4, 6, 4, 64, torch.float32, [5, 7])
    f = specdec_ext.verify_attention
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        f(q, kc, vc, sl)
    q, kc, vc, sl, kn, vn, table = make_case(gen, 2, 4, 8, 4, 64, torch.float32, [5, 7], s_max=10)
    with pytest.raises(ValueError, match="runs outside the cache"):
        f(q, kc, vc, sl)
    q, kc, vc, sl, kn, vn, table = make_case(gen, 2, 4, 8, 4, 64, torch.float32, [5, 7], paged=4)
    bad = table.clone()
    bad[1, 0] = 999
    with pytest.raises(ValueError, match="block_table points outside"):
        f(q, kc, vc, sl, block_table=bad)
    with pytest.raises(ValueError, match="k_cache must have q's dtype"):
        f(q, kc.double(), vc.double(), sl, block_table=table)
    with pytest.raises(ValueError, match="cache_seqlens"):
        f(q, kc, vc, sl.long(), block_table=table)
    with pytest.raises(ValueError, match="tree_mask"):
        f(q, kc, vc, sl, block_table=table, tree_mask=torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="k_new"):
        f(q, kc, vc, sl, kn[:, :2], vn[:, :2], block_table=table)


def test_opcheck(gen):
    q, kc, vc, sl, kn, vn, _ = make_case(gen, 2, 3, 4, 2, 64, torch.bfloat16, [4, 9])
    torch.library.opcheck(torch.ops.specdec.verify_attention.default, (q, kc, vc, sl, kn, vn, None, None, 0.0, True))
