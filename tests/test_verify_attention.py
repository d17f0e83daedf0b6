"""verify_attention on the CPU kernel against the float64 reference: relative error ||out - ref|| / ||ref||
within fp32 2e-5, bf16 2e-2, fp16 4e-3."""
import pytest
import torch

import specdec_ext
from specdec_ext import reference

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def rel_error(out, ref):
    return float((out.double() - ref).norm() / ref.norm())


def check_against_reference(f, q, k_cache, v_cache, lengths, k_new=None, v_new=None, *, lse_atol, **kwargs):
    """Runs f (one backend's verify_attention) and the float64 reference on copies of the same caches: the
    output within the dtype's tolerance, lse within lse_atol, and the caches equal afterwards (the new tokens
    written, nothing else)."""
    ref_caches, caches = (k_cache.clone(), v_cache.clone()), (k_cache.clone(), v_cache.clone())
    ref, ref_lse = reference.verify_attention(q, *ref_caches, lengths, k_new, v_new, return_lse=True, **kwargs)
    out, lse = f(q, *caches, lengths, k_new, v_new, return_lse=True, **kwargs)
    assert rel_error(out, ref) <= TOLERANCE[q.dtype], f
    assert torch.allclose(lse, ref_lse, atol=lse_atol), f
    assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1]), f


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
    check_against_reference(specdec_ext.verify_attention, q, kc, vc, sl, kn, vn,
                            lse_atol=1e-3 if dtype != torch.float32 else 1e-5)


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
    check_against_reference(specdec_ext.verify_attention, q, kc, vc, sl, kn, vn, lse_atol=1e-4, softmax_scale=0.05)


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
    torch.library.opcheck(torch.ops.specdec.verify_attention.default, (q, kc, vc, sl, kn, vn, None, None, None, True, None))


# ----- the CUDA kernel under the emulator (float16/bfloat16, head dim 64/128, small shapes) -----------------
# The emulator runs a 4-SM device, so even these shapes take the split-KV path with its merge kernel.
SIM_DTYPES = [torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def sim():
    from specdec_ext import sim
    return sim


@pytest.mark.parametrize("dtype", SIM_DTYPES, ids=str)
@pytest.mark.parametrize("n_q", [1, 2, 6, 16, 64])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 2), (8, 1), (6, 2)])
def test_sim_contiguous_causal_with_append(dtype, n_q, hq, hkv, gen, sim):
    lengths = [int(x) for x in torch.randint(0, 200, (3,), generator=gen)]
    lengths[0] = 0
    q, kc, vc, sl, kn, vn, _ = make_case(gen, 3, n_q, hq, hkv, 64, dtype, lengths)
    check_against_reference(sim.verify_attention, q, kc, vc, sl, kn, vn, lse_atol=2e-3)


@pytest.mark.parametrize("dtype", SIM_DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [8, 16, 256])
def test_sim_paged_tree_mask(dtype, page_size, gen, sim):
    n_q = 9
    lengths = [int(x) for x in torch.randint(0, 300, (3,), generator=gen)]
    q, kc, vc, sl, kn, vn, table = make_case(gen, 3, n_q, 8, 2, 128, dtype, lengths, paged=page_size)
    masks = torch.stack([random_tree_mask(gen, n_q) for _ in range(3)])
    check_against_reference(sim.verify_attention, q, kc, vc, sl, kn, vn, lse_atol=2e-3, block_table=table,
                            tree_mask=masks)
    # One mask for every request; the new tokens are already in the cache.
    out = sim.verify_attention(q, kc, vc, sl, block_table=table, tree_mask=masks[1])
    assert rel_error(out, reference.verify_attention(q, kc, vc, sl, block_table=table, tree_mask=masks[1])) <= \
        TOLERANCE[dtype]


def test_sim_row_with_nothing_visible(sim):
    # A tree row that sees no new token in an empty cache has no keys: output 0 and lse -inf, as on the CPU.
    q = torch.randn(1, 3, 2, 64).half()
    kc, vc = torch.randn(1, 8, 1, 64).half(), torch.randn(1, 8, 1, 64).half()
    mask = torch.tensor([[True, False, False], [False, False, False], [True, True, True]])
    sl = torch.zeros(1, dtype=torch.int32)
    out, lse = sim.verify_attention(q, kc, vc, sl, tree_mask=mask, return_lse=True)
    cpu_out, cpu_lse = specdec_ext.verify_attention(q, kc, vc, sl, tree_mask=mask, return_lse=True)
    assert torch.equal(out[0, 1], torch.zeros_like(out[0, 1])) and torch.isneginf(lse[0, 1]).all()
    assert rel_error(out, cpu_out.double()) <= 4e-3 and torch.allclose(lse, cpu_lse, atol=2e-3)


@pytest.mark.parametrize("d,length,n_q", [(64, 6000, 5), (128, 1500, 64)])
def test_sim_long_context_many_rows(d, length, n_q, gen, sim):
    # Long contexts at B = 1 take several KV splits, merged by lse (6000 tokens: eight splits of 768 keys);
    # 64 queries x 2 heads = 128 query rows per KV head: two row tiles.
    q, kc, vc, sl, kn, vn, _ = make_case(gen, 1, n_q, 2, 1, d, torch.bfloat16, [length])
    check_against_reference(sim.verify_attention, q, kc, vc, sl, kn, vn, lse_atol=2e-3, softmax_scale=0.07)


def test_sim_invalid_requests_get_nan_and_strict_raises(gen, sim):
    q, kc, vc, sl, kn, vn, table = make_case(gen, 3, 4, 4, 2, 64, torch.float16, [5, 20, 7], paged=8)
    bad_table = table.clone()
    bad_table[1, 1] = 10_000  # request 1's second page is outside the cache
    lengths = sl.clone()
    lengths[2] = table.shape[1] * 8  # request 2's block runs past its pages
    kc_before, vc_before = kc.clone(), vc.clone()
    out, lse = sim.verify_attention(q, kc, vc, lengths, kn, vn, block_table=bad_table, return_lse=True)
    assert torch.isnan(out[1:]).all() and torch.isnan(lse[1:]).all()
    ref = reference.verify_attention(q[:1], kc_before.clone(), vc_before.clone(), sl[:1], kn[:1], vn[:1],
                                     block_table=table[:1])
    assert rel_error(out[:1], ref) <= 4e-3
    # Request 2 (block past the cache) wrote nothing; only request 0's and request 1's in-range slots changed.
    changed = (kc != kc_before).any(-1).any(-1)
    allowed = torch.zeros_like(changed)
    for b, n in ((0, 5), (1, 20)):
        for j in range(4):
            page = int(bad_table[b, (n + j) // 8])
            if page < kc.shape[0]:
                allowed[page, (n + j) % 8] = True
    assert not (changed & ~allowed).any()
    specdec_ext.set_strict(True)
    try:
        with pytest.raises(ValueError, match="block_table points outside.*|runs outside the cache"):
            sim.verify_attention(q, kc, vc, lengths, block_table=bad_table)
    finally:
        specdec_ext.set_strict(False)


def test_sim_unsupported_inputs_are_named(gen, sim):
    q, kc, vc, sl, _, _, _ = make_case(gen, 1, 2, 2, 1, 64, torch.float32, [3])
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        sim.verify_attention(q, kc, vc, sl)
    q, kc, vc, sl, _, _, _ = make_case(gen, 1, 2, 2, 1, 96, torch.float16, [3])
    with pytest.raises(ValueError, match="head dim 64 or 128"):
        sim.verify_attention(q, kc, vc, sl)


def test_sim_opcheck(gen, sim):
    q, kc, vc, sl, kn, vn, _ = make_case(gen, 2, 3, 4, 2, 64, torch.bfloat16, [4, 9])
    torch.library.opcheck(torch.ops.specdec_sim.verify_attention.default,
                          (q, kc, vc, sl, kn, vn, None, None, None, True, None))


@pytest.mark.parametrize("trial", range(8))
def test_random_shapes_cpu_and_sim(trial, gen, sim):
    # Every dimension drawn fresh per run: batch, queries, GQA ratio, head dim, layout, page size, mask, lengths.
    pick = lambda *choices: choices[int(torch.randint(0, len(choices), (1,), generator=gen))]
    batch, n_q, hkv, ratio, d = pick(1, 2, 5), pick(1, 3, 7, 17), pick(1, 2, 3), pick(1, 2, 3, 5), pick(64, 128)
    dtype = pick(torch.bfloat16, torch.float16)
    lengths = [int(x) for x in torch.randint(0, 700, (batch,), generator=gen)]
    paged = pick(None, 8, 32, 128, 24)  # 24: a page size that is not a power of two
    q, kc, vc, sl, kn, vn, table = make_case(gen, batch, n_q, hkv * ratio, hkv, d, dtype, lengths, paged=paged)
    mask = pick(None, random_tree_mask(gen, n_q))
    append = pick(True, False)
    new = (kn, vn) if append else (None, None)
    for f in (specdec_ext.verify_attention, sim.verify_attention):
        check_against_reference(f, q, kc, vc, sl, *new, lse_atol=2e-3, block_table=table, tree_mask=mask)
