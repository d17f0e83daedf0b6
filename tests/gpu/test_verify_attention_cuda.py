"""verify_attention on CUDA (tensor cores): against the float64 reference, no host sync, CUDA-graph capture,
device-side handling of invalid requests."""
import pytest
import torch

import specdec_ext
from specdec_ext import reference

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def rel_error(out, ref):
    return float((out.double().cpu() - ref.cpu()).norm() / ref.cpu().norm())


def make_case(g, batch, n_q, hq, hkv, d, dtype, lengths, page_size=None):
    q = torch.randn(batch, n_q, hq, d, generator=g).to(dtype)
    k_new = torch.randn(batch, n_q, hkv, d, generator=g).to(dtype)
    v_new = torch.randn(batch, n_q, hkv, d, generator=g).to(dtype)
    capacity = max(lengths) + n_q
    if page_size:
        per_seq = -(-capacity // page_size)
        num_pages = batch * per_seq + 5
        table = torch.randperm(num_pages, generator=g)[: batch * per_seq].int().reshape(batch, per_seq).cuda()
        shape = (num_pages, page_size, hkv, d)
    else:
        table, shape = None, (batch, capacity + 7, hkv, d)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    cuda = [t.cuda() for t in (q, k_cache, v_cache, torch.tensor(lengths, dtype=torch.int32), k_new, v_new)]
    return (*cuda, table)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("n_q", [1, 2, 6, 16, 64])
@pytest.mark.parametrize("hq,hkv", [(32, 8), (8, 8), (8, 1), (12, 4)])
@pytest.mark.parametrize("page_size", [None, 16, 256])
def test_against_reference(dtype, d, n_q, hq, hkv, page_size):
    g = torch.Generator().manual_seed(n_q * 1000 + hq * 10 + hkv + d)
    lengths = [0, 1, 700, 6000]
    q, kc, vc, sl, kn, vn, table = make_case(g, 4, n_q, hq, hkv, d, dtype, lengths, page_size)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    out, lse = specdec_ext.verify_attention(q, kc, vc, sl, kn, vn, block_table=table, return_lse=True)
    ref, ref_lse = reference.verify_attention(q, kc_ref, vc_ref, sl, kn, vn, block_table=table, return_lse=True)
    assert rel_error(out, ref) <= TOLERANCE[dtype]
    assert torch.allclose(lse.cpu(), ref_lse.cpu().float(), atol=2e-3)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_tree_mask_per_request():
    g = torch.Generator().manual_seed(3)
    n_q = 12
    q, kc, vc, sl, kn, vn, table = make_case(g, 3, n_q, 32, 8, 128, torch.bfloat16, [5, 300, 4000], 16)
    masks = torch.zeros(3, n_q, n_q, dtype=torch.bool)
    for b in range(3):
        for i in range(n_q):
            masks[b, i, i] = True
            if i:
                masks[b, i] |= masks[b, int(torch.randint(0, i, (1,), generator=g))]
    masks = masks.cuda()
    out = specdec_ext.verify_attention(q, kc, vc, sl, block_table=table, tree_mask=masks)
    ref = reference.verify_attention(q, kc, vc, sl, block_table=table, tree_mask=masks)
    assert rel_error(out, ref) <= 2e-2


def test_no_host_sync_and_graph_capture():
    g = torch.Generator().manual_seed(4)
    q, kc, vc, sl, kn, vn, _ = make_case(g, 2, 5, 32, 8, 128, torch.bfloat16, [100, 3000])
    want = reference.verify_attention(q, kc.clone(), vc.clone(), sl, kn, vn)
    torch.cuda.set_sync_debug_mode("error")
    try:
        specdec_ext.verify_attention(q, kc.clone(), vc.clone(), sl, kn, vn)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out = torch.empty_like(q)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        specdec_ext.verify_attention(q, kc, vc, sl, kn, vn)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        out.copy_(specdec_ext.verify_attention(q, kc, vc, sl, kn, vn))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_error(out, want) <= 2e-2


def test_invalid_request_is_nan_and_strict_raises():
    g = torch.Generator().manual_seed(5)
    q, kc, vc, sl, kn, vn, _ = make_case(g, 2, 4, 8, 2, 64, torch.float16, [10, 20])
    sl[1] = kc.shape[1]  # request 1's block runs past the cache
    out = specdec_ext.verify_attention(q, kc, vc, sl, kn, vn)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[0]).any()
    specdec_ext.set_strict(True)
    try:
        with pytest.raises(ValueError, match="runs outside the cache"):
            specdec_ext.verify_attention(q, kc, vc, sl)
    finally:
        specdec_ext.set_strict(False)


def test_written_page_listed_twice_is_refused_in_strict_mode():
    """Request 1 appends into its third table entry, page 0, which its first two entries list too: strict mode raises
    (the kernel's check), without it the call stays defined; a page shared across requests is accepted."""
    g = torch.Generator().manual_seed(8)
    page, d = 16, 64
    q = torch.randn(2, 3, 2, d, generator=g).bfloat16().cuda()
    kc, vc = (torch.randn(6, page, 1, d, generator=g).bfloat16().cuda() for _ in range(2))
    kn, vn = (torch.randn(2, 3, 1, d, generator=g).bfloat16().cuda() for _ in range(2))
    lengths = torch.tensor([4, 2 * page + 1], dtype=torch.int32).cuda()
    aliased = torch.tensor([[1, 2, 3], [0, 0, 0]], dtype=torch.int32).cuda()
    out = specdec_ext.verify_attention(q, kc.clone(), vc.clone(), lengths, kn, vn, block_table=aliased)
    assert not torch.isnan(out[0]).any()
    specdec_ext.set_strict(True)
    try:
        with pytest.raises(ValueError, match="a page the new tokens go to twice"):
            specdec_ext.verify_attention(q, kc.clone(), vc.clone(), lengths, kn, vn, block_table=aliased)
        shared = torch.tensor([[0, 2, 3], [0, 1, 4]], dtype=torch.int32).cuda()  # page 0 read by both
        lengths = torch.tensor([20, 2 * page + 1], dtype=torch.int32).cuda()
        got = specdec_ext.verify_attention(q, kc.clone(), vc.clone(), lengths, kn, vn, block_table=shared)
    finally:
        specdec_ext.set_strict(False)
    want = reference.verify_attention(q.cpu(), kc.cpu(), vc.cpu(), lengths.cpu(), kn.cpu(), vn.cpu(),
                                      block_table=shared.cpu())
    assert rel_error(got, want) <= TOLERANCE[torch.bfloat16]


def test_opcheck():
    g = torch.Generator().manual_seed(6)
    q, kc, vc, sl, kn, vn, _ = make_case(g, 2, 3, 8, 2, 128, torch.bfloat16, [4, 90])
    torch.library.opcheck(torch.ops.specdec.verify_attention.default,
                          (q, kc, vc, sl, kn, vn, None, None, None, torch.empty_like(q),
                           q.new_empty(q.shape[:3], dtype=torch.float32), None))


@pytest.mark.parametrize("page_size", [None, 16])
def test_output_bits_do_not_depend_on_the_batch(page_size):
    # A request's KV splits depend on its own cached length only: alone, or in batches of other sizes and lengths
    # that fill the GPU differently, its output and lse are the same bits.
    g = torch.Generator().manual_seed(17)
    lengths = [3000, 9000, 100, 1, 20000, 700]
    q, kc, vc, sl, _, _, table = make_case(g, 6, 5, 32, 8, 128, torch.bfloat16, lengths, page_size)
    def run(rows):
        rows_t = torch.tensor(rows, device="cuda")
        if page_size:
            return specdec_ext.verify_attention(q[rows_t], kc, vc, sl[rows_t], block_table=table[rows_t],
                                                return_lse=True)
        return specdec_ext.verify_attention(q[rows_t], kc[rows_t], vc[rows_t], sl[rows_t], return_lse=True)
    alone, alone_lse = run([0])
    for rows in ([0, 1], [0, 1, 2, 3, 4, 5], [0] * 64, [0, 2]):
        out, lse = run(rows)
        assert torch.equal(out[0], alone[0]) and torch.equal(lse[0], alone_lse[0]), rows


# ----- engine layouts (docs/design.md §3.4), the CPU tests' twins on the tensor-core kernel --------------------------
def nhd_to_hnd(cache):
    return cache.transpose(1, 2).contiguous()


def csr_table(table, kv_lens, page_size):
    pages = [-(-n // page_size) for n in kv_lens]
    indptr = torch.tensor([0] + pages, dtype=torch.int32).cumsum(0).int()
    indices = torch.cat([table[b, :n].cpu() for b, n in enumerate(pages)]).int()
    last = torch.tensor([n - (p - 1) * page_size if p else 0 for n, p in zip(kv_lens, pages)], dtype=torch.int32)
    return indptr.cuda(), indices.cuda(), last.cuda()


def poisoned(f, q, *args, **kwargs):
    out = torch.full_like(q, float("nan"))
    got, lse = f(q, *args, out=out, return_lse=True, **kwargs)
    assert got is out
    return out, lse


@pytest.mark.parametrize("d", [64, 128, 256])
def test_layouts_agree_bit_for_bit(d):
    """HND == NHD, FlashInfer's interleaved K/V pages == separate tensors, CSR table == block table (with as many
    columns as kv_indices has entries; the KV splits come from each request's length either way)."""
    g = torch.Generator().manual_seed(21 + d)
    lengths, n_q, page = [0, 700, 5000, 33], 6, 16
    q, kc, vc, sl, kn, vn, table = make_case(g, 4, n_q, 16, 4, d, torch.bfloat16, lengths, page)
    f = specdec_ext.verify_attention
    base = (kc.clone(), vc.clone())
    out, lse = poisoned(f, q, *base, sl, kn, vn, block_table=table)
    hnd = (nhd_to_hnd(kc), nhd_to_hnd(vc))
    out_h, lse_h = poisoned(f, q, *hnd, sl, kn, vn, block_table=table, kv_layout="HND")
    assert torch.equal(out, out_h) and torch.equal(lse, lse_h) and torch.equal(nhd_to_hnd(base[0]), hnd[0])
    kv = torch.stack([kc, vc], dim=1)
    out_v, lse_v = poisoned(f, q, kv[:, 0], kv[:, 1], sl, kn, vn, block_table=table)
    assert torch.equal(out, out_v) and torch.equal(lse, lse_v) and torch.equal(kv[:, 0], base[0])
    indptr, indices, last = csr_table(table, [n + n_q for n in lengths], page)
    wide = torch.zeros(4, indices.numel(), dtype=torch.int32, device="cuda")
    wide[:, : table.shape[1]] = table
    out_w, lse_w = poisoned(f, q, kc.clone(), vc.clone(), sl, kn, vn, block_table=wide)
    out_c, lse_c = poisoned(f, q, kc.clone(), vc.clone(), None, kn, vn, kv_indptr=indptr, kv_indices=indices,
                            kv_last_page_len=last)
    assert torch.equal(out_w, out_c) and torch.equal(lse_w, lse_c)
    ref = reference.verify_attention(q, kc.clone(), vc.clone(), sl, kn, vn, block_table=table)
    assert rel_error(out_c, ref) <= 2e-2


def test_ragged_q_equals_per_request_calls():
    g = torch.Generator().manual_seed(22)
    counts, hq, hkv, d, page = [3, 0, 128, 1, 0, 64], 8, 2, 128, 16
    lengths = [100, 7, 3000, 0, 50, 900]
    starts = [sum(counts[:b]) for b in range(len(counts) + 1)]
    total = starts[-1]
    q = torch.randn(total, hq, d, generator=g).bfloat16().cuda()
    kn, vn = (torch.randn(total, hkv, d, generator=g).bfloat16().cuda() for _ in range(2))
    per_seq = -(-(max(lengths) + max(counts)) // page)
    table = torch.randperm(6 * per_seq, generator=g).int().reshape(6, per_seq).cuda()
    kc, vc = (torch.randn(6 * per_seq, page, hkv, d, generator=g).bfloat16().cuda() for _ in range(2))
    sl = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    indptr = torch.tensor(starts, dtype=torch.int32, device="cuda")
    f = specdec_ext.verify_attention
    out, lse = poisoned(f, q, kc.clone(), vc.clone(), sl, kn, vn, block_table=table, qo_indptr=indptr)
    caches = (kc.clone(), vc.clone())
    for b, n in enumerate(counts):
        if n:
            rows = slice(starts[b], starts[b + 1])
            one, one_lse = poisoned(f, q[rows][None], *caches, sl[b:b + 1], kn[rows][None], vn[rows][None],
                                    block_table=table[b:b + 1])
            assert torch.equal(out[rows], one[0]) and torch.equal(lse[rows], one_lse[0]), b


@pytest.mark.parametrize("window,cap", [(0, 0.0), (100, 0.0), (-1, 30.0), (500, 10.0)])
def test_window_and_soft_cap_against_reference(window, cap):
    g = torch.Generator().manual_seed(23)
    q, kc, vc, sl, kn, vn, table = make_case(g, 3, 7, 16, 4, 256, torch.bfloat16, [4000, 20, 900], 16)
    q = q * 4
    out = specdec_ext.verify_attention(q, kc.clone(), vc.clone(), sl, kn, vn, block_table=table, window_left=window,
                                       logits_soft_cap=cap)
    ref = reference.verify_attention(q, kc.clone(), vc.clone(), sl, kn, vn, block_table=table, window_left=window,
                                     logits_soft_cap=cap)
    assert rel_error(out, ref) <= 2e-2


def test_out_capturable_with_flat_q_and_csr():
    g = torch.Generator().manual_seed(24)
    q, kc, vc, sl, kn, vn, table = make_case(g, 2, 5, 8, 2, 128, torch.bfloat16, [300, 40], 16)
    indptr, indices, last = csr_table(table, [305, 45], 16)
    qo = torch.tensor([0, 5, 10], dtype=torch.int32, device="cuda")
    flat = q.reshape(10, 8, 128)
    kw = dict(qo_indptr=qo, kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last)
    want = specdec_ext.verify_attention(flat, kc.clone(), vc.clone(), None, **kw)
    out = torch.full_like(flat, float("nan"))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        specdec_ext.verify_attention(flat, kc, vc, None, out=out, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    out.fill_(float("nan"))
    with torch.cuda.graph(graph):
        specdec_ext.verify_attention(flat, kc, vc, None, out=out, **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


def test_unsupported_head_dim_raises():
    # The H200 run of 2026-12-04 saw a model of head dim 16 crash inside this call (a segfault, where the emulator
    # build of the same launcher raises). Head dim 16 is now a kernel of its own; 48 is not, and this is the first GPU
    # test of a ValueError raised by a CUDA launcher's own C++ check (every other GPU error test raises from Python).
    q = torch.randn(1, 7, 4, 48, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(1, 16, 2, 48, device="cuda", dtype=torch.bfloat16)
    new = torch.randn(1, 7, 2, 48, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head dim 16, 32, 64, 128 or 256, got 48"):
        specdec_ext.verify_attention(q, cache, cache.clone(), torch.zeros(1, dtype=torch.int32, device="cuda"), new,
                                     new.clone())
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        specdec_ext.verify_attention(q.float()[..., :16], cache.float()[..., :16].contiguous(),
                                     cache.float()[..., :16].contiguous(), torch.zeros(1, dtype=torch.int32,
                                                                                       device="cuda"))


@pytest.mark.parametrize("head_dim", [16, 32])
def test_small_head_dims_match_the_cpu(head_dim):
    # The tests' tiny models have head dim 16: their attention now runs on the tensor-core kernel.
    g = torch.Generator().manual_seed(head_dim)
    q = torch.randn(2, 5, 8, head_dim, generator=g).bfloat16()
    cache = torch.randn(2, 300, 2, head_dim, generator=g).bfloat16()
    lengths = torch.tensor([100, 290], dtype=torch.int32)
    new = torch.randn(2, 5, 2, head_dim, generator=g).bfloat16()
    want = specdec_ext.verify_attention(q.float(), cache.float(), cache.float(), lengths, new.float(), new.float())
    got = specdec_ext.verify_attention(q.cuda(), cache.cuda(), cache.cuda().clone(), lengths.cuda(), new.cuda(),
                                       new.cuda())
    assert float((got.cpu().float() - want).abs().max()) < 2e-2
