"""truncate_kv_cache on the CPU kernel and the CUDA kernel under the emulator, against the reference, on
caches filled with random values (so that every moved, cleared or untouched row is checked)."""
import pytest
import torch

import specdec_ext
from specdec_ext import reference, sim

BACKENDS = {"cpu": specdec_ext, "sim": sim}
NAMESPACES = {"cpu": torch.ops.specdec, "sim": torch.ops.specdec_sim}


def make_caches(gen, layers, shape, dtype):
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(layers)], \
        [torch.randn(shape, generator=gen).to(dtype) for _ in range(layers)]


def random_kept(gen, batch, block_len, num_kept):
    kept = torch.full((batch, block_len), -1, dtype=torch.int32)
    for b in range(batch):
        n = int(num_kept[b])
        kept[b, :n] = torch.randperm(block_len, generator=gen)[:n].sort().values.int()
    return kept


def paged_layout(gen, batch, capacity_pages, page_size, extra_pages=5):
    """A random page table: each request owns capacity_pages distinct pages of a shared pool."""
    num_pages = batch * capacity_pages + extra_pages
    perm = torch.randperm(num_pages, generator=gen)[: batch * capacity_pages].int()
    return perm.reshape(batch, capacity_pages), num_pages


def run_both(backend, lengths, num_kept, caches, **kw):
    """The op and the reference on copies of the same inputs; returns both results."""
    ks, vs = caches
    got = (lengths.clone(), [k.clone() for k in ks], [v.clone() for v in vs])
    want = (lengths.clone(), [k.clone() for k in ks], [v.clone() for v in vs])
    BACKENDS[backend].truncate_kv_cache(got[0], num_kept, k_caches=got[1], v_caches=got[2], **kw)
    reference.truncate_kv_cache(want[0], num_kept, k_caches=want[1], v_caches=want[2], **kw)
    return got, want


def assert_same(got, want):
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1] + got[2], want[1] + want[2]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("clear", [False, True], ids=["keep", "clear"])
def test_contiguous_matches_reference(backend, dtype, tree, clear, gen):
    batch, layers, s_max, heads, dim, block_len = 5, 3, 40, 2, 8, 7
    caches = make_caches(gen, layers, (batch, s_max, heads, dim), dtype)
    lengths = torch.randint(0, s_max - block_len + 1, (batch,), generator=gen, dtype=torch.int32)
    lengths[0] = 0  # an empty cache before the block
    num_kept = torch.randint(0, block_len + 1, (batch,), generator=gen, dtype=torch.int32)
    kw = {"block_len": block_len, "clear": clear}
    if tree:
        kw["kept_indices"] = random_kept(gen, batch, block_len, num_kept)
    got, want = run_both(backend, lengths, num_kept, caches, **kw)
    assert_same(got, want)
    assert torch.equal(got[0], lengths + num_kept)
    if not tree and not clear:  # a chain truncation without clear touches no cache row
        for a, b in zip(got[1] + got[2], caches[0] + caches[1]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 4, 8])
def test_paged_tree_compaction_across_page_boundaries(backend, page_size, gen):
    batch, layers, heads, dim, block_len = 4, 3, 3, 4, 9
    capacity_pages = (30 + page_size - 1) // page_size
    table, num_pages = paged_layout(gen, batch, capacity_pages, page_size)
    caches = make_caches(gen, layers, (num_pages, page_size, heads, dim), torch.float32)
    lengths = torch.randint(0, capacity_pages * page_size - block_len + 1, (batch,), generator=gen, dtype=torch.int32)
    num_kept = torch.randint(0, block_len + 1, (batch,), generator=gen, dtype=torch.int32)
    kept = random_kept(gen, batch, block_len, num_kept)
    got, want = run_both(backend, lengths, num_kept, caches, kept_indices=kept, block_table=table, clear=True)
    assert_same(got, want)
    # Pages no request owns are untouched.
    owned = set(table.flatten().tolist())
    for a, b in zip(got[1], caches[0]):
        for page in range(num_pages):
            if page not in owned:
                assert torch.equal(a[page], b[page])


@pytest.mark.parametrize("backend", BACKENDS)
def test_stacked_layers_and_other_requests_untouched(backend, gen):
    layers, batch, s_max, heads, dim = 4, 3, 20, 2, 4
    k = torch.randn(layers, batch, s_max, heads, dim, generator=gen)
    v = torch.randn(layers, batch, s_max, heads, dim, generator=gen)
    k0, v0 = k.clone(), v.clone()
    lengths = torch.tensor([3, 0, 10], dtype=torch.int32)
    kept = torch.tensor([[1, 3, -1, -1], [0, 1, 2, 3], [-1, -1, -1, -1]], dtype=torch.int32)
    BACKENDS[backend].truncate_kv_cache(lengths, torch.tensor([2, 4, 0]), kept_indices=kept, k_caches=k, v_caches=v,
                                        clear=True)
    assert lengths.tolist() == [5, 4, 10]
    assert torch.equal(k[:, 0, 3], k0[:, 0, 4]) and torch.equal(k[:, 0, 4], k0[:, 0, 6])
    assert bool((k[:, 0, 5:7] == 0).all()) and bool((v[:, 2, 10:14] == 0).all())
    assert torch.equal(k[:, 1], k0[:, 1]) and torch.equal(v[:, 1], v0[:, 1])  # kept everything in place
    assert torch.equal(k[:, 0, :3], k0[:, 0, :3]) and torch.equal(k[:, 0, 7:], k0[:, 0, 7:])
    assert torch.equal(k[:, 2, :10], k0[:, 2, :10]) and torch.equal(k[:, 2, 14:], k0[:, 2, 14:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_lengths_only(backend):
    lengths = torch.tensor([4, 9], dtype=torch.int32)
    BACKENDS[backend].truncate_kv_cache(lengths, torch.tensor([1, 3], dtype=torch.int32))
    assert lengths.tolist() == [5, 12]


def bad_cases():
    k = [torch.randn(2, 10, 1, 4)]
    v = [torch.randn(2, 10, 1, 4)]
    ok_kept = torch.tensor([[0, 1, -1], [0, -1, -1]], dtype=torch.int32)
    return [
        ({"num_kept": torch.tensor([4, 1]), "kept_indices": ok_kept}, "num_kept must be in"),
        ({"num_kept": torch.tensor([2, 1]), "kept_indices": torch.tensor([[1, 1, -1], [0, -1, -1]], dtype=torch.int32)},
         "kept_indices must increase"),
        ({"num_kept": torch.tensor([2, 1]), "kept_indices": ok_kept, "lengths": [8, 0]}, "outside the cache"),
    ], k, v


@pytest.mark.parametrize("backend", BACKENDS)
def test_invalid_requests(backend):
    cases, k, v = bad_cases()
    for kw, message in cases:
        lengths = torch.tensor(kw.pop("lengths", [2, 3]), dtype=torch.int32)
        ks, vs = [t.clone() for t in k], [t.clone() for t in v]
        def call():
            return BACKENDS[backend].truncate_kv_cache(lengths, kw["num_kept"], kept_indices=kw["kept_indices"],
                                                                    k_caches=ks, v_caches=vs, clear=True)
        if backend == "cpu":  # raises before writing anything
            with pytest.raises(ValueError, match=message):
                call()
            assert torch.equal(ks[0], k[0])
        else:  # like CUDA: the invalid request is left untouched, strict mode raises
            before = lengths.clone()
            call()
            specdec_ext.set_strict(True)
            try:
                with pytest.raises(ValueError, match=message):
                    BACKENDS[backend].truncate_kv_cache(lengths.clone(), kw["num_kept"],
                                                        kept_indices=kw["kept_indices"],
                                                        k_caches=[t.clone() for t in k],
                                                        v_caches=[t.clone() for t in v])
            finally:
                specdec_ext.set_strict(False)
            assert int(lengths[0]) == int(before[0])  # request 0 is the invalid one in every case
            assert int(lengths[1]) == int(before[1]) + int(kw["num_kept"][1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_page_index_out_of_range(backend):
    k = [torch.randn(4, 4, 1, 2)]
    v = [torch.randn(4, 4, 1, 2)]
    table = torch.tensor([[0, 9]], dtype=torch.int32)  # page 9 does not exist
    kept = torch.tensor([[0, 2, -1]], dtype=torch.int32)
    lengths = torch.tensor([3], dtype=torch.int32)
    if backend == "cpu":
        with pytest.raises(ValueError, match="block_table points outside"):
            specdec_ext.truncate_kv_cache(lengths, 2, kept_indices=kept, k_caches=k, v_caches=v, block_table=table)
    else:
        k0 = k[0].clone()
        sim.truncate_kv_cache(lengths, 2, kept_indices=kept, k_caches=k, v_caches=v, block_table=table)
        assert torch.equal(k[0], k0) and lengths.tolist() == [3]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("csr", [False, True], ids=["block_table", "csr"])
def test_page_listed_twice_within_a_request_is_refused(backend, csr, gen):
    """A request whose block spans one page listed twice ([0, 0]): moving row 5 to row 3 would read and write one
    physical row on one backend and two on another. Refused on the CPU; under the emulator (as on CUDA) the request
    is left untouched and strict mode raises. Aliasing across requests is the caller's race, not checked."""
    k, v = [torch.randn(4, 4, 1, 2, generator=gen)], [torch.randn(4, 4, 1, 2, generator=gen)]
    kept = torch.tensor([[0, 2, -1], [0, 1, -1]], dtype=torch.int32)
    table = torch.tensor([[0, 0], [1, 2]], dtype=torch.int32)
    layout = dict(kv_indptr=torch.tensor([0, 2, 4], dtype=torch.int32), kv_indices=table.reshape(-1)) if csr else \
        dict(block_table=table)
    lengths = torch.tensor([3, 3], dtype=torch.int32)
    ks, vs = [k[0].clone()], [v[0].clone()]
    def call(lens, ks, vs):
        return BACKENDS[backend].truncate_kv_cache(lens, 2, kept_indices=kept, k_caches=ks,
                                                                         v_caches=vs, block_len=3, **layout)
    if backend == "cpu":
        with pytest.raises(ValueError, match="request 0: .*a page of the block twice"):
            call(lengths, ks, vs)
        assert torch.equal(ks[0], k[0]) and lengths.tolist() == [3, 3]  # nothing written
    else:
        call(lengths, ks, vs)
        assert torch.equal(ks[0][0], k[0][0]) and lengths.tolist() == [3, 5]  # request 0 untouched, 1 truncated
        specdec_ext.set_strict(True)
        try:
            with pytest.raises(ValueError, match="a page of the block twice"):
                call(torch.tensor([3, 3], dtype=torch.int32), [k[0].clone()], [v[0].clone()])
        finally:
            specdec_ext.set_strict(False)
    shared = torch.tensor([[0, 1], [0, 2]], dtype=torch.int32)  # page 0 in both requests: accepted
    layout = dict(kv_indptr=torch.tensor([0, 2, 4], dtype=torch.int32), kv_indices=shared.reshape(-1)) if csr else \
        dict(block_table=shared)
    lengths = torch.tensor([3, 3], dtype=torch.int32)
    call(lengths, [k[0].clone()], [v[0].clone()])
    assert lengths.tolist() == [5, 5]


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments_are_named(backend):
    f = BACKENDS[backend].truncate_kv_cache
    k = [torch.randn(2, 10, 1, 4)]
    with pytest.raises(ValueError, match="cache_seqlens"):
        f(torch.zeros(2, dtype=torch.int64), 1, k_caches=k, v_caches=k, block_len=3, clear=True)
    with pytest.raises(ValueError, match="same number of layers"):
        f(torch.zeros(2, dtype=torch.int32), 1, k_caches=k, v_caches=[], block_len=3, clear=True)
    with pytest.raises(ValueError, match="block_len is needed"):
        f(torch.zeros(2, dtype=torch.int32), 1, k_caches=k, v_caches=k, clear=True)
    with pytest.raises(ValueError, match="k_caches and v_caches are needed"):
        f(torch.zeros(2, dtype=torch.int32), 1, block_len=3, clear=True)
    with pytest.raises(ValueError, match=r"v_caches\[0\]|shape, strides and dtype"):
        f(torch.zeros(2, dtype=torch.int32), 1, k_caches=k, v_caches=[torch.randn(2, 10, 1, 5)], block_len=3,
          clear=True)


@pytest.mark.parametrize("backend", NAMESPACES)
def test_opcheck(backend, gen):
    ks, vs = make_caches(gen, 2, (3, 16, 2, 4), torch.float32)
    lengths = torch.tensor([0, 5, 9], dtype=torch.int32)
    kept = torch.tensor([[0, 2, -1], [1, -1, -1], [0, 1, 2]], dtype=torch.int32)
    torch.library.opcheck(NAMESPACES[backend].truncate_kv_cache.default,
                          (lengths, torch.tensor([2, 1, 3], dtype=torch.int32), kept, ks, vs, None, 3, True, None))


# ----- engine layouts (docs/design.md §3.4): HND, strided page views, CSR page tables ---------------------------------
def to_hnd(cache):
    return cache.transpose(1, 2).contiguous()


def random_round(gen, batch, block_len, capacity):
    lengths = torch.randint(0, capacity - block_len + 1, (batch,), generator=gen, dtype=torch.int32)
    num_kept = torch.randint(0, block_len + 1, (batch,), generator=gen, dtype=torch.int32)
    return lengths, num_kept, random_kept(gen, batch, block_len, num_kept)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_hnd_equals_nhd(backend, paged, tree, gen):
    batch, layers, heads, dim, block_len, page = 4, 2, 3, 8, 9, 4
    if paged:
        table, num_pages = paged_layout(gen, batch, 8, page)
        shape, kw = (num_pages, page, heads, dim), {"block_table": table}
    else:
        shape, kw = (batch, 32, heads, dim), {}
    caches = make_caches(gen, layers, shape, torch.bfloat16)
    lengths, num_kept, kept = random_round(gen, batch, block_len, 32)
    kw.update(block_len=block_len, clear=True, kept_indices=kept if tree else None)
    got, want = run_both(backend, lengths, num_kept, caches, **kw)
    hnd = ([to_hnd(k) for k in caches[0]], [to_hnd(v) for v in caches[1]])
    got_h, want_h = run_both(backend, lengths, num_kept, hnd, kv_layout="HND", **kw)
    assert_same(got_h, want_h)
    assert torch.equal(got_h[0], got[0])
    for a, b in zip(got_h[1] + got_h[2], got[1] + got[2]):
        assert torch.equal(a, to_hnd(b))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_strided_page_views_equal_separate_tensors(backend, layout, gen):
    batch, heads, dim, block_len, page = 3, 2, 8, 6, 4
    table, num_pages = paged_layout(gen, batch, 6, page)
    inner = (page, heads, dim) if layout == "NHD" else (heads, page, dim)
    kv = [torch.randn(num_pages, 2, *inner, generator=gen) for _ in range(2)]  # FlashInfer: K and V of a page together
    separate = ([x[:, 0].clone() for x in kv], [x[:, 1].clone() for x in kv])
    lengths, num_kept, kept = random_round(gen, batch, block_len, 24)
    kw = dict(block_len=block_len, kept_indices=kept, clear=True, block_table=table, kv_layout=layout)
    lengths_views = lengths.clone()
    BACKENDS[backend].truncate_kv_cache(lengths_views, num_kept, k_caches=[x[:, 0] for x in kv],
                                        v_caches=[x[:, 1] for x in kv], **kw)
    got, want = run_both(backend, lengths, num_kept, separate, **kw)
    assert_same(got, want)
    assert torch.equal(lengths_views, got[0])
    for layer, x in enumerate(kv):
        assert torch.equal(x[:, 0], got[1][layer]) and torch.equal(x[:, 1], got[2][layer])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_csr_table_equals_block_table(backend, layout, gen):
    batch, heads, dim, block_len, page = 4, 2, 4, 7, 4
    table, num_pages = paged_layout(gen, batch, 8, page)
    shape = (num_pages, page, heads, dim) if layout == "NHD" else (num_pages, heads, page, dim)
    caches = make_caches(gen, 2, shape, torch.float16)
    lengths, num_kept, kept = random_round(gen, batch, block_len, 32)
    # Each request lists only the pages its block reaches (FlashInfer's table after the verify step's append).
    pages = [-(-(int(n) + block_len) // page) for n in lengths]
    indptr = torch.tensor([0] + pages).cumsum(0).int()
    indices = torch.cat([table[b, :n] for b, n in enumerate(pages)]).int()
    kw = dict(block_len=block_len, kept_indices=kept, clear=True, kv_layout=layout)
    got, want = run_both(backend, lengths, num_kept, caches, block_table=table, **kw)
    got_c, want_c = run_both(backend, lengths, num_kept, caches, kv_indptr=indptr, kv_indices=indices, **kw)
    assert_same(got_c, want_c)
    assert_same(got_c, got)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_layout_inputs_are_named(backend):
    f = BACKENDS[backend].truncate_kv_cache
    k = [torch.randn(6, 4, 1, 4)]
    kept = torch.tensor([[0, 2, -1], [1, -1, -1]], dtype=torch.int32)
    indices = torch.tensor([3, 1, 0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="kv_layout"):
        f(torch.tensor([1, 2], dtype=torch.int32), 1, k_caches=k, v_caches=k, block_len=3, clear=True, kv_layout="nhd")
    with pytest.raises(ValueError, match="kv_indptr and kv_indices"):
        f(torch.tensor([1, 2], dtype=torch.int32), 1, k_caches=k, v_caches=k, block_len=3, clear=True,
          kv_indptr=torch.tensor([0, 2, 4], dtype=torch.int32))
    bad = [(torch.tensor([0, 3, 2], dtype=torch.int32), indices, "kv_indptr"),   # decreasing: request 1
           (torch.tensor([0, 2, 5], dtype=torch.int32), indices, "kv_indptr"),   # past len(kv_indices): request 1
           (torch.tensor([0, 2, 4], dtype=torch.int32), torch.tensor([3, 1, 9, 5], dtype=torch.int32),
            "points outside"),
           (torch.tensor([0, 2, 3], dtype=torch.int32), indices,
            "outside the cache")]  # request 1's block past its page
    for indptr, idx, message in bad:
        lengths = torch.tensor([1, 2], dtype=torch.int32)
        ks, vs = [k[0].clone()], [k[0].clone()]
        def call(lens):
            return f(lens, torch.tensor([2, 1], dtype=torch.int32), kept_indices=kept, k_caches=ks,
                                      v_caches=vs, kv_indptr=indptr, kv_indices=idx)
        if backend == "cpu":
            with pytest.raises(ValueError, match=message):
                call(lengths)
            assert torch.equal(ks[0], k[0]) and lengths.tolist() == [1, 2]
        else:
            call(lengths)  # request 1 is left untouched, request 0 goes ahead
            assert lengths.tolist() == [3, 2]
            specdec_ext.set_strict(True)
            try:
                with pytest.raises(ValueError, match=message):
                    call(torch.tensor([1, 2], dtype=torch.int32))
            finally:
                specdec_ext.set_strict(False)


@pytest.mark.parametrize("backend", NAMESPACES)
def test_opcheck_engine_forms(backend, gen):
    kv = torch.randn(2, 7, 2, 3, 4, 8, generator=gen)  # layers x [pages, K/V, H, page, D]
    lengths = torch.tensor([0, 5, 2], dtype=torch.int32)
    kept = torch.tensor([[0, 2, -1], [1, -1, -1], [0, 1, 2]], dtype=torch.int32)
    indptr, indices = torch.tensor([0, 1, 3, 5], dtype=torch.int32), torch.tensor([6, 0, 2, 5, 1], dtype=torch.int32)
    torch.library.opcheck(NAMESPACES[backend].truncate_kv_cache.default,
                          (lengths, torch.tensor([2, 1, 3], dtype=torch.int32), kept, [x[:, 0] for x in kv],
                           [x[:, 1] for x in kv], None, 3, True, None, indptr, indices, "HND"))
