"""verify_attention on the CPU kernel against the float64 reference: relative error ||out - ref|| / ||ref||
within fp32 2e-5, bf16 2e-2, fp16 4e-3."""
import pytest
import torch

import specdec_ext
from helpers.verify_attention import TOLERANCE, random_tree_mask, rel_error
from specdec_ext import reference


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
    torch.library.opcheck(torch.ops.specdec.verify_attention.default,
                          (q, kc, vc, sl, kn, vn, None, None, None, torch.empty_like(q), q.new_empty(q.shape[:3],
                           dtype=torch.float32), None))


# ----- the CUDA kernel under the emulator (float16/bfloat16, head dim 64/128, small shapes) -----------------
# Requests of more than 256 cached tokens take several KV splits (256 keys each up to 8064 tokens) and the merge
# kernel: the long-context and random-shape cases below, and the layout tests' longer requests.
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
    # Long contexts at B = 1 take several KV splits, merged by lse (6000 tokens: 24 splits of 256 keys);
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
    with pytest.raises(ValueError, match="head dim 16, 32, 64, 128 or 256, got 96"):
        sim.verify_attention(q, kc, vc, sl)


def test_sim_opcheck(gen, sim):
    q, kc, vc, sl, kn, vn, _ = make_case(gen, 2, 3, 4, 2, 64, torch.bfloat16, [4, 9])
    torch.library.opcheck(torch.ops.specdec_sim.verify_attention.default,
                          (q, kc, vc, sl, kn, vn, None, None, None, torch.empty_like(q), q.new_empty(q.shape[:3],
                           dtype=torch.float32), None))


@pytest.mark.parametrize("trial", range(8))
def test_random_shapes_cpu_and_sim(trial, gen, sim):
    # Every dimension drawn fresh per run: batch, queries, GQA ratio, head dim, layout, page size, mask, lengths.
    def pick(*choices):
        return choices[int(torch.randint(0, len(choices), (1,), generator=gen))]
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


# ----- engine layouts (docs/design.md §3.4): HND, strided pages, CSR page tables, flat q, window, soft cap, out= ------
# Each form is compared bit for bit with the padded NHD block-table call on the same data (out and lse poisoned with
# NaN before the kernel writes them), and the forms' arithmetic against the float64 reference.
LAYOUT_BACKENDS = ["cpu", "sim"]


def backend_ops(name):
    if name == "cpu":
        return specdec_ext
    from specdec_ext import sim
    return sim


def backend_dtype(name, gen):
    choices = [torch.float32, torch.bfloat16] if name == "cpu" else [torch.bfloat16, torch.float16]
    return choices[int(torch.randint(0, 2, (1,), generator=gen))]


def poisoned_call(f, q, *args, **kwargs):
    """f(..., out=NaN-filled, return_lse=True): the returned tensors are the buffer passed in, fully written."""
    out = torch.full_like(q, float("nan"))
    got, lse = f(q, *args, out=out, return_lse=True, **kwargs)
    assert got is out
    return out, lse


def nhd_to_hnd(cache):
    """The same cache in HND ([.., H, S, D]), contiguous."""
    return cache.transpose(1, 2).contiguous()


def csr_table(table, kv_lens, page_size):
    """FlashInfer's CSR page table for requests whose pages are table[b, :pages_b], pages_b = ceil(kv_len / page)."""
    pages = [-(-n // page_size) for n in kv_lens]
    indptr = torch.tensor([0] + pages, dtype=torch.int32).cumsum(0).int()
    indices = torch.cat([table[b, :n] for b, n in enumerate(pages)]).int()
    last = torch.tensor([n - (p - 1) * page_size if p else 0 for n, p in zip(kv_lens, pages)], dtype=torch.int32)
    return indptr, indices, last


@pytest.mark.parametrize("backend", LAYOUT_BACKENDS)
@pytest.mark.parametrize("paged", [None, 16], ids=["contiguous", "paged"])
def test_hnd_equals_nhd(backend, paged, gen):
    f, dtype = backend_ops(backend).verify_attention, backend_dtype(backend, gen)
    lengths = [int(x) for x in torch.randint(0, 600, (3,), generator=gen)]
    q, kc, vc, sl, kn, vn, table = make_case(gen, 3, 5, 8, 2, 64, dtype, lengths, paged=paged)
    nhd = (kc.clone(), vc.clone())
    hnd = (nhd_to_hnd(kc), nhd_to_hnd(vc))
    out, lse = poisoned_call(f, q, *nhd, sl, kn, vn, block_table=table)
    out_h, lse_h = poisoned_call(f, q, *hnd, sl, kn, vn, block_table=table, kv_layout="HND")
    assert torch.equal(out, out_h) and torch.equal(lse, lse_h)
    assert torch.equal(nhd_to_hnd(nhd[0]), hnd[0]) and torch.equal(nhd_to_hnd(nhd[1]), hnd[1])  # same appends
    ref = reference.verify_attention(q, kc.clone(), vc.clone(), sl, kn, vn, block_table=table)
    assert rel_error(out_h, ref) <= TOLERANCE[dtype]


@pytest.mark.parametrize("backend", LAYOUT_BACKENDS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("engine", ["flashinfer", "vllm"])
def test_strided_page_views_equal_separate_tensors(backend, layout, engine, gen):
    f, dtype = backend_ops(backend).verify_attention, backend_dtype(backend, gen)
    lengths = [int(x) for x in torch.randint(0, 300, (3,), generator=gen)]
    q, kc, vc, sl, kn, vn, table = make_case(gen, 3, 4, 4, 2, 64, dtype, lengths, paged=8)
    if layout == "HND":
        kc, vc = nhd_to_hnd(kc), nhd_to_hnd(vc)
    # FlashInfer: one [pages, 2, ...] tensor, K and V interleaved per page (page stride 2x a page); vLLM: [2, pages,
    # ...].
    kv = torch.stack([kc, vc], dim=1 if engine == "flashinfer" else 0)
    k_view, v_view = (kv[:, 0], kv[:, 1]) if engine == "flashinfer" else (kv[0], kv[1])
    assert k_view.data_ptr() != kc.data_ptr() and (engine == "vllm" or not k_view.is_contiguous())
    sep = (kc.clone(), vc.clone())
    out, lse = poisoned_call(f, q, *sep, sl, kn, vn, block_table=table, kv_layout=layout)
    out_v, lse_v = poisoned_call(f, q, k_view, v_view, sl, kn, vn, block_table=table, kv_layout=layout)
    assert torch.equal(out, out_v) and torch.equal(lse, lse_v)
    assert torch.equal(k_view, sep[0]) and torch.equal(v_view, sep[1])  # the appends went through the views


@pytest.mark.parametrize("backend", LAYOUT_BACKENDS)
@pytest.mark.parametrize("append", [False, True])
def test_csr_table_equals_block_table(backend, append, gen):
    f, dtype = backend_ops(backend).verify_attention, backend_dtype(backend, gen)
    n_q, page, batch = 6, 16, 4
    lengths = [int(x) for x in torch.randint(0, 700, (batch,), generator=gen)]
    lengths[1] = page - n_q  # the block ends on a page boundary: a full last page
    q, kc, vc, sl, kn, vn, table = make_case(gen, batch, n_q, 8, 2, 64, dtype, lengths, paged=page)
    indptr, indices, last = csr_table(table, [n + n_q for n in lengths], page)
    # A block table with as many columns as kv_indices has entries: both forms bound a request's capacity alike (the
    # CUDA kernel sizes its grid from that bound; the splits come from each request's length), so the bits agree.
    wide = torch.zeros(batch, indices.numel(), dtype=torch.int32)
    wide[:, : table.shape[1]] = table
    new = (kn, vn) if append else (None, None)
    ref_caches, csr_caches = (kc.clone(), vc.clone()), (kc.clone(), vc.clone())
    out, lse = poisoned_call(f, q, *ref_caches, sl, *new, block_table=wide)
    out_c, lse_c = poisoned_call(f, q, *csr_caches, None, *new, kv_indptr=indptr, kv_indices=indices,
                                 kv_last_page_len=last)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)
    assert torch.equal(ref_caches[0], csr_caches[0]) and torch.equal(ref_caches[1], csr_caches[1])
    ref = reference.verify_attention(q, kc.clone(), vc.clone(), None, *new, kv_indptr=indptr, kv_indices=indices,
                                     kv_last_page_len=last)
    assert rel_error(out_c, ref) <= TOLERANCE[dtype]


@pytest.mark.parametrize("backend", LAYOUT_BACKENDS)
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
def test_ragged_q_equals_per_request_calls(backend, tree, gen):
    """qo_indptr with some Q_b = 0 and rows past qo_indptr[B]: each request's rows are bit for bit the padded call
    of that request alone; rows no request owns are not written."""
    f, dtype = backend_ops(backend).verify_attention, backend_dtype(backend, gen)
    counts = [3, 0, 7, 1, 0, 5]
    batch, hq, hkv, d, page = len(counts), 4, 2, 64, 16
    lengths = [int(x) for x in torch.randint(0, 900, (batch,), generator=gen)]
    starts = [sum(counts[:b]) for b in range(batch + 1)]
    total = starts[-1] + 2  # two trailing rows that no request owns
    q = torch.randn(total, hq, d, generator=gen).to(dtype)
    kn, vn = torch.randn(total, hkv, d, generator=gen).to(dtype), torch.randn(total, hkv, d, generator=gen).to(dtype)
    per_seq = -(-(max(lengths) + max(counts)) // page)
    table = torch.randperm(batch * per_seq + 3, generator=gen)[: batch * per_seq].int().reshape(batch, per_seq)
    kc = torch.randn(batch * per_seq + 3, page, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(batch * per_seq + 3, page, hkv, d, generator=gen).to(dtype)
    masks = [random_tree_mask(gen, n) if tree else None for n in counts]
    flat_mask = torch.cat([m.reshape(-1) for m in masks]) if tree else None
    indptr = torch.tensor(starts, dtype=torch.int32)
    sl = torch.tensor(lengths, dtype=torch.int32)
    caches = (kc.clone(), vc.clone())
    out, lse = poisoned_call(f, q, *caches, sl, kn, vn, block_table=table, qo_indptr=indptr,
                             tree_mask=flat_mask)
    assert torch.isnan(out[starts[-1]:]).all()  # rows no request owns: the poisoned buffer, unwritten
    one_caches = (kc.clone(), vc.clone())
    for b, n in enumerate(counts):
        if n == 0:
            continue
        rows = slice(starts[b], starts[b + 1])
        one, one_lse = poisoned_call(f, q[rows].unsqueeze(0), *one_caches, sl[b:b + 1], kn[rows].unsqueeze(0),
                                     vn[rows].unsqueeze(0), block_table=table[b:b + 1], tree_mask=masks[b])
        assert torch.equal(out[rows], one[0]) and torch.equal(lse[rows], one_lse[0]), b
    assert torch.equal(caches[0], one_caches[0]) and torch.equal(caches[1], one_caches[1])
    ref = reference.verify_attention(q, kc.clone(), vc.clone(), sl, kn, vn, block_table=table, qo_indptr=indptr,
                                     tree_mask=flat_mask)
    assert rel_error(out[: starts[-1]], ref[: starts[-1]]) <= TOLERANCE[dtype]


@pytest.mark.parametrize("backend", LAYOUT_BACKENDS)
def test_flat_q_with_csr_hnd_strided_cache(backend, gen):
    """Everything a FlashInfer caller hands over at once: flat q, CSR table, HND pages interleaved K/V."""
    f, dtype = backend_ops(backend).verify_attention, backend_dtype(backend, gen)
    counts, page, hq, hkv, d = [2, 5, 0, 4], 8, 6, 3, 64
    lengths = [int(x) for x in torch.randint(0, 200, (4,), generator=gen)]
    per_seq = -(-(max(lengths) + max(counts)) // page)
    table = torch.randperm(4 * per_seq, generator=gen).int().reshape(4, per_seq)
    kv = torch.randn(4 * per_seq, 2, hkv, page, d, generator=gen).to(dtype)
    indptr, indices, last = csr_table(table, [n + c for n, c in zip(lengths, counts)], page)
    qo = torch.tensor([0, 2, 7, 7, 11], dtype=torch.int32)
    q = torch.randn(11, hq, d, generator=gen).to(dtype)
    kn, vn = torch.randn(11, hkv, d, generator=gen).to(dtype), torch.randn(11, hkv, d, generator=gen).to(dtype)
    ref_kv = kv.clone()
    out, lse = poisoned_call(f, q, kv[:, 0], kv[:, 1], None, kn, vn, qo_indptr=qo, kv_indptr=indptr,
                             kv_indices=indices, kv_last_page_len=last, kv_layout="HND")
    ref, ref_lse = reference.verify_attention(q, ref_kv[:, 0], ref_kv[:, 1], None, kn, vn, qo_indptr=qo,
                                              kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last,
                                              kv_layout="HND", return_lse=True)
    assert rel_error(out, ref) <= TOLERANCE[dtype] and torch.allclose(lse, ref_lse, atol=2e-3)
    assert torch.equal(kv, ref_kv)


@pytest.mark.parametrize("backend", LAYOUT_BACKENDS)
@pytest.mark.parametrize("window,cap", [(0, 0.0), (5, 0.0), (300, 0.0), (-1, 30.0), (40, 5.0), (2000, 50.0)])
def test_sliding_window_and_soft_cap_against_reference(backend, window, cap, gen):
    f, dtype = backend_ops(backend).verify_attention, backend_dtype(backend, gen)
    lengths = [int(x) for x in torch.randint(0, 1400, (3,), generator=gen)]
    lengths[0] = 1300  # several KV splits (CPU: 512 keys each), the window starting inside the first
    q, kc, vc, sl, kn, vn, table = make_case(gen, 3, 7, 4, 2, 64, dtype, lengths, paged=16)
    q = q * 4  # scores of several units, so that the cap changes them
    mask = random_tree_mask(gen, 7) if window == 5 else None
    check_against_reference(f, q, kc, vc, sl, kn, vn, lse_atol=3e-3, block_table=table, tree_mask=mask,
                            window_left=window, logits_soft_cap=cap)
    if 0 <= window < 1300:  # the window changes the result (a window that skipped nothing would test nothing)
        plain = f(q, kc.clone(), vc.clone(), sl, kn, vn, block_table=table, tree_mask=mask)
        windowed = f(q, kc.clone(), vc.clone(), sl, kn, vn, block_table=table, tree_mask=mask, window_left=window)
        assert not torch.equal(plain, windowed)


@pytest.mark.parametrize("backend", LAYOUT_BACKENDS)
def test_q128_and_head_dim_256(backend, gen):
    f = backend_ops(backend).verify_attention
    dtype = torch.bfloat16
    for n_q, d, lengths in ((128, 64, [90, 3]), (9, 256, [700, 0]), (128, 256, [70])):
        q, kc, vc, sl, kn, vn, _ = make_case(gen, len(lengths), n_q, 2, 1, d, dtype, lengths)
        check_against_reference(f, q, kc, vc, sl, kn, vn, lse_atol=3e-3)
    with pytest.raises(ValueError, match=r"Q must be in \[1, 128\]"):
        f(torch.randn(1, 129, 2, 64).to(dtype), kc[:, :, :, :64].contiguous(), vc[:, :, :, :64].contiguous(), sl)


@pytest.mark.parametrize("backend", LAYOUT_BACKENDS)
def test_out_is_written_in_place(backend, gen):
    f, dtype = backend_ops(backend).verify_attention, backend_dtype(backend, gen)
    q, kc, vc, sl, kn, vn, table = make_case(gen, 2, 3, 4, 2, 64, dtype, [40, 9], paged=8)
    expected = f(q, kc.clone(), vc.clone(), sl, kn, vn, block_table=table)
    out = torch.full_like(q, float("nan"))
    got = f(q, kc.clone(), vc.clone(), sl, kn, vn, block_table=table, out=out)
    assert got is out and torch.equal(out, expected)
    with pytest.raises(ValueError, match="out must be"):
        f(q, kc, vc, sl, block_table=table, out=torch.empty(2, 3, 4, 32, dtype=dtype))


def layout_bad_cases(gen):
    """(kwargs, message) pairs of inconsistent engine layouts, on a flat-q CSR call that is valid without them."""
    page = 8
    q = torch.randn(5, 2, 64, generator=gen).half()
    kc, vc = torch.randn(6, page, 1, 64, generator=gen).half(), torch.randn(6, page, 1, 64, generator=gen).half()
    good = dict(qo_indptr=torch.tensor([0, 2, 5], dtype=torch.int32), kv_indptr=torch.tensor([0, 2, 3],
                                                                                             dtype=torch.int32),
                kv_indices=torch.tensor([4, 0, 2], dtype=torch.int32), kv_last_page_len=torch.tensor([3, 8],
                                                                                                     dtype=torch.int32))
    cases = [
        ({"qo_indptr": torch.tensor([0, 3, 2], dtype=torch.int32)}, "qo_indptr"),     # decreasing
        ({"qo_indptr": torch.tensor([0, 2, 6], dtype=torch.int32)}, "qo_indptr"),     # past T
        ({"kv_indptr": torch.tensor([0, 3, 2], dtype=torch.int32)}, "kv_indptr"),     # decreasing
        ({"kv_indptr": torch.tensor([0, 2, 4], dtype=torch.int32)}, "kv_indptr"),     # past len(kv_indices)
        ({"kv_indices": torch.tensor([4, 6, 2], dtype=torch.int32)}, "kv_indices"),   # page 6 of 6
        ({"kv_indices": torch.tensor([4, -1, 2], dtype=torch.int32)}, "kv_indices"),
        ({"kv_last_page_len": torch.tensor([3, 9], dtype=torch.int32)}, "kv_last_page_len"),
        ({"kv_last_page_len": torch.tensor([3, 0], dtype=torch.int32)}, "kv_last_page_len"),
        ({"kv_last_page_len": torch.tensor([3, 2], dtype=torch.int32)}, "runs outside the cache"),  # 2 keys, Q_b = 3
        ({"tree_mask": torch.ones(12, dtype=torch.bool)}, "tree_mask"),               # needs 4 + 9
    ]
    return q, kc, vc, good, cases


@pytest.mark.parametrize("backend", LAYOUT_BACKENDS)
def test_bad_layout_inputs_are_named(backend, gen):
    f = backend_ops(backend).verify_attention
    q, kc, vc, good, cases = layout_bad_cases(gen)
    if backend == "cpu":
        q, kc, vc = q.float(), kc.float(), vc.float()
    f(q, kc, vc, **good)  # valid as it is
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            if backend == "cpu":
                f(q, kc, vc, **{**good, **change})
            else:
                with _strict():
                    f(q, kc, vc, **{**good, **change})
    with pytest.raises(ValueError, match="kv_layout"):
        f(q, kc, vc, **good, kv_layout="NDH")
    with pytest.raises(ValueError, match="cache_seqlens must be None"):
        f(q, kc, vc, torch.zeros(2, dtype=torch.int32), **good)
    with pytest.raises(ValueError, match="not both"):
        f(q, kc, vc, **good, block_table=torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="window_left"):
        f(q, kc, vc, **good, window_left=-2)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        f(q, kc, vc, **good, logits_soft_cap=float("nan"))
    with pytest.raises(ValueError, match="qo_indptr"):  # a request of more than 128 rows
        f(torch.randn(130, 2, 64).to(q.dtype), kc, vc, **{**good, "qo_indptr": torch.tensor([0, 129, 130],
                                                                                              dtype=torch.int32)})
    # Pages whose slots are not dense (every other slot of a view): refused, not misread.
    sparse_k, sparse_v = kc.as_strided((6, 4, 1, 64), (512, 128, 64, 1)), vc.as_strided((6, 4, 1, 64), (512, 128, 64,
                                                                                                        1))
    with pytest.raises(ValueError, match="each page of a paged cache must be dense"):
        f(q, sparse_k, sparse_v, **good)


@pytest.mark.parametrize("backend", LAYOUT_BACKENDS)
@pytest.mark.parametrize("csr", [False, True], ids=["block_table", "csr"])
def test_written_page_listed_twice_within_a_request_is_refused(backend, csr, gen):
    """Request 1's table lists page 0 three times ([0, 0, 0]) and its new tokens go to the third entry: appending and
    reading the aliases would race (the CPU appends first, the CUDA kernel reads the new keys from k_new). Refused on
    the CPU and in strict mode; without strict mode the emulated kernel still stays in bounds (ASan). A page shared
    across requests, or listed twice but only read, is accepted (across requests the caller owns the race)."""
    f, page, d = backend_ops(backend).verify_attention, 8, 64
    dtype = torch.float32 if backend == "cpu" else torch.bfloat16
    q = torch.randn(2, 3, 2, d, generator=gen).to(dtype)
    kc, vc = torch.randn(5, page, 1, d, generator=gen).to(dtype), torch.randn(5, page, 1, d, generator=gen).to(dtype)
    kn, vn = torch.randn(2, 3, 1, d, generator=gen).to(dtype), torch.randn(2, 3, 1, d, generator=gen).to(dtype)
    table = torch.tensor([[1, 2, 3], [0, 0, 0]], dtype=torch.int32)
    lengths = torch.tensor([4, 2 * page + 1], dtype=torch.int32)  # request 1 appends to its third entry
    if csr:
        layout = dict(kv_indptr=torch.tensor([0, 1, 4], dtype=torch.int32), kv_indices=torch.tensor([1, 0, 0, 0],
                      dtype=torch.int32), kv_last_page_len=torch.tensor([7, 4], dtype=torch.int32))
        args = (None, kn, vn)
    else:
        layout, args = dict(block_table=table), (lengths, kn, vn)
    def call():
        return f(q, kc.clone(), vc.clone(), *args, **layout)
    if backend == "cpu":
        with pytest.raises(ValueError, match="request 1: .*a page the new tokens go to twice"):
            call()
    else:
        out = call()  # the caller's race: a defined, in-bounds call
        assert out.shape == q.shape
        with _strict(), pytest.raises(ValueError, match="a page the new tokens go to twice"):
            call()
    # Read-only aliases (no append) and a page shared by two requests are accepted, and agree with the reference.
    for table, lens, new in ((torch.tensor([[1, 2, 3], [0, 0, 4]], dtype=torch.int32), [4, 14], (None, None)),
                             (torch.tensor([[0, 2, 3], [0, 1, 4]], dtype=torch.int32), [10, 17], (kn, vn))):
        lens = torch.tensor(lens, dtype=torch.int32)
        with _strict():
            got = f(q, kc.clone(), vc.clone(), lens, *new, block_table=table)
        want = reference.verify_attention(q, kc.clone(), vc.clone(), lens, *new, block_table=table)
        assert rel_error(got, want) <= TOLERANCE[dtype]


class _strict:
    def __enter__(self):
        specdec_ext.set_strict(True)

    def __exit__(self, *exc):
        specdec_ext.set_strict(False)


def test_sim_device_checks_of_layouts_never_read_out_of_bounds(gen):
    """The emulated kernel's own checks (no Python checks in front: the op called directly): an inconsistent request
    gets the error bit and NaN rows where its rows are known, nothing out of bounds (ASan), the others are right."""
    from specdec_ext import sim  # noqa: F401  (registers torch.ops.specdec_sim)
    q, kc, vc, good, cases = layout_bad_cases(gen)
    bits = specdec_ext.ops._ERROR_BITS["verify_attention"]
    want, _ = poisoned_call(specdec_ext.sim.verify_attention, q, kc.clone(), vc.clone(), **good)
    for change, message in cases:
        args = {**good, **change}
        out, lse = torch.full_like(q, float("nan")), torch.full(q.shape[:2], float("nan"))
        flags = torch.zeros(1, dtype=torch.int32)
        torch.ops.specdec_sim.verify_attention(q, kc.clone(), vc.clone(), None, None, None, None, args.get("tree_mask"),
                                               None, out, lse, flags, args["qo_indptr"], args["kv_indptr"],
                                               args["kv_indices"], args["kv_last_page_len"], "NHD", -1, 0.0)
        assert int(flags) != 0, message
        named = " ".join(m for bit, m in bits.items() if int(flags) & bit)
        assert message in named or (message == "kv_indices" and "points outside" in named), (message, named)
        if "kv_last_page_len" in change:  # only request 1 is broken: request 0 is untouched by it, request 1 is NaN
            assert torch.equal(out[:2], want[:2]) and torch.isnan(out[2:]).all() and torch.isnan(lse[2:]).all()


@pytest.mark.parametrize("namespace", ["specdec", "specdec_sim"])
def test_opcheck_engine_forms(namespace, gen):
    from specdec_ext import sim  # noqa: F401
    ns = getattr(torch.ops, namespace)
    dtype = torch.bfloat16
    q = torch.randn(7, 4, 64, generator=gen).to(dtype)
    kv = torch.randn(6, 2, 2, 8, 64, generator=gen).to(dtype)  # [pages, K/V, Hkv, page, D]: HND, strided pages
    kn, vn = torch.randn(7, 2, 64, generator=gen).to(dtype), torch.randn(7, 2, 64, generator=gen).to(dtype)
    qo = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    indptr, indices = torch.tensor([0, 2, 3, 5], dtype=torch.int32), torch.tensor([5, 1, 0, 2, 4], dtype=torch.int32)
    last = torch.tensor([8, 2, 3], dtype=torch.int32)
    mask = torch.cat([random_tree_mask(gen, 3).reshape(-1), random_tree_mask(gen, 4).reshape(-1)])
    torch.library.opcheck(ns.verify_attention.default,
                          (q, kv[:, 0], kv[:, 1], None, kn, vn, None, mask, None, torch.empty_like(q),
                           torch.empty(7, 4), None, qo, indptr, indices, last, "HND", 4, 20.0))
