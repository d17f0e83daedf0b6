"""Edge and bad inputs of every op, on the CPU kernels and on the CUDA kernels under the emulator: empty
batches, caches at their ends, integer and mask dtypes that used to be narrowed or inverted silently,
tensors on another device, validation that must not depend on the random outcome of a round, requests
that must fail whole, and bits that must not depend on the batch."""
import functools
from contextlib import contextmanager

import pytest
import torch

import specdec_ext
from specdec_ext import sim
from specdec_ext.kv_cache import PagedKVCache

BACKENDS = {"cpu": specdec_ext, "sim": sim}


@pytest.fixture(params=list(BACKENDS))
def backend(request):
    return request.param


@contextmanager
def strict_mode():
    specdec_ext.set_strict(True)
    try:
        yield
    finally:
        specdec_ext.set_strict(False)


def attention_dtype(backend):
    return torch.float32 if backend == "cpu" else torch.float16  # the emulated tensor-core kernel: fp16/bf16


def randn(*shape, gen, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


# ----- empty batches ----------------------------------------------------------------------------------
def test_empty_batch_every_op(backend, gen):
    ops = BACKENDS[backend]
    dt = attention_dtype(backend)
    q = randn(0, 4, 4, 64, gen=gen, dtype=dt)
    kc, vc = randn(1, 32, 2, 64, gen=gen, dtype=dt), randn(1, 32, 2, 64, gen=gen, dtype=dt)
    out, lse = ops.verify_attention(q, kc, vc, torch.zeros(0, dtype=torch.int32), return_lse=True)
    assert out.shape == (0, 4, 4, 64) and lse.shape == (0, 4, 4)
    pages = randn(3, 8, 2, 64, gen=gen, dtype=dt)
    out = ops.verify_attention(q, pages, pages.clone(), torch.zeros(0, dtype=torch.int32),
                               block_table=torch.zeros(0, 2, dtype=torch.int32))
    assert out.shape == (0, 4, 4, 64)
    for logits in (False, True):
        kw = {"temperature": 0.7} if logits else {}
        f = ops.chain_speculative_sampling_from_logits if logits else ops.chain_speculative_sampling
        res = f(torch.zeros(0, 3, dtype=torch.int64), torch.rand(0, 4, 50), seed=7, offset=3, **kw)  # an int seed
        assert res.output_token_ids.shape == (0, 4) and res.num_accepted.shape == (0,)
    lengths = torch.zeros(0, dtype=torch.int32)
    ops.truncate_kv_cache(lengths, torch.zeros(0, dtype=torch.int32), block_len=3, k_caches=[kc], v_caches=[vc],
                          clear=True)
    assert ops.philox_uniform(torch.zeros(0, dtype=torch.int64), 0, 5).shape == (0, 5)


def test_heads_and_capacity_of_zero_raise(backend, gen):
    ops = BACKENDS[backend]
    dt = attention_dtype(backend)
    sl = torch.zeros(1, dtype=torch.int32)
    kc = randn(1, 16, 2, 64, gen=gen, dtype=dt)
    with pytest.raises(ValueError, match="at least one head"):
        ops.verify_attention(randn(1, 2, 0, 64, gen=gen, dtype=dt), kc, kc.clone(), sl)
    empty = randn(1, 0, 2, 64, gen=gen, dtype=dt)
    with pytest.raises(ValueError, match="k_cache holds no positions"):
        ops.verify_attention(randn(1, 2, 2, 64, gen=gen, dtype=dt), empty, empty.clone(), sl)
    with pytest.raises(ValueError, match="block_table has no columns"):
        ops.verify_attention(randn(1, 2, 2, 64, gen=gen, dtype=dt), kc, kc.clone(), sl,
                             block_table=torch.zeros(1, 0, dtype=torch.int32))


@pytest.mark.parametrize("scale", [float("inf"), float("nan"), 0.0, -1.0, 1e60])
def test_softmax_scale_must_be_finite_and_positive(backend, scale, gen):
    dt = attention_dtype(backend)
    q, kc = randn(1, 2, 2, 64, gen=gen, dtype=dt), randn(1, 8, 2, 64, gen=gen, dtype=dt)
    sl = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="softmax_scale"):
        BACKENDS[backend].verify_attention(q, kc, kc.clone(), sl, softmax_scale=scale)
    namespace = torch.ops.specdec if backend == "cpu" else torch.ops.specdec_sim
    with pytest.raises(ValueError, match="softmax_scale"):  # the op itself checks too
        namespace.verify_attention(q, kc, kc.clone(), sl, None, None, None, None, scale, torch.empty_like(q), None,
                                   None)


def test_lse_only_when_asked(backend, gen):
    dt = attention_dtype(backend)
    q, kc = randn(2, 3, 4, 64, gen=gen, dtype=dt), randn(2, 16, 2, 64, gen=gen, dtype=dt)
    sl = torch.tensor([3, 9], dtype=torch.int32)
    namespace = torch.ops.specdec if backend == "cpu" else torch.ops.specdec_sim

    def call(scale, lse):
        out = torch.full_like(q, float("nan"))
        namespace.verify_attention(q, kc, kc.clone(), sl, None, None, None, None, scale, out, lse, None)
        return out

    out = call(None, None)
    lse = torch.full((2, 3, 4), float("nan"))
    assert torch.equal(out, call(None, lse)) and torch.isfinite(lse).all()
    # softmax_scale None is 1/sqrt(D).
    assert torch.equal(out, call(0.125, None))


def test_sampling_needs_a_target_tensor():
    with pytest.raises(TypeError, match="target_probs must be a tensor"):
        specdec_ext.chain_speculative_sampling(torch.zeros(1, 2, dtype=torch.int64), None)
    with pytest.raises(TypeError, match="target_logits must be a tensor"):
        specdec_ext.chain_speculative_sampling_from_logits(torch.zeros(1, 2, dtype=torch.int64), None, temperature=1.0)


# ----- truncation: lengths only, near the end of the cache ------------------------------------------------
def test_lengths_only_near_the_end_of_the_cache(backend, strict):
    k = [torch.randn(1, 100, 1, 4)]
    lengths = torch.tensor([50], dtype=torch.int32)
    BACKENDS[backend].truncate_kv_cache(lengths, torch.tensor([3], dtype=torch.int32), k_caches=k, v_caches=k)
    assert lengths.tolist() == [53]
    # A prefill advances by more than a verify block; up to the last slot is fine.
    BACKENDS[backend].truncate_kv_cache(lengths, 47, k_caches=k, v_caches=k)
    assert lengths.tolist() == [100]


@pytest.mark.parametrize("case", ["past_cache", "over_block_len", "int32_overflow", "negative"])
def test_rejected_lengths_only_truncation_raises_or_is_reported(backend, case):
    k = [torch.randn(2, 100, 1, 4)]
    kw = {"k_caches": k, "v_caches": k}
    lengths, kept, message = [98, 5], [3, 1], "outside the cache"
    if case == "over_block_len":
        lengths, kept, message = [10, 5], [9, 1], "num_kept must be in"
        kw["block_len"] = 4
    elif case == "int32_overflow":
        lengths, kept, message = [2**31 - 10, 5], [20, 1], "2\\^31 - 1"
        kw = {}  # no caches: only the int32 lengths bound it
    elif case == "negative":
        lengths, kept, message = [10, 5], [-1, 1], "num_kept must be in"
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    num_kept = torch.tensor(kept, dtype=torch.int32)
    f = BACKENDS[backend].truncate_kv_cache
    if backend == "cpu":
        with pytest.raises(ValueError, match=message):
            f(seqlens, num_kept, **kw)
        assert seqlens.tolist() == lengths  # nothing changed
        return
    f(seqlens, num_kept, **kw)  # like CUDA: the rejected request is left alone, the other advances
    assert seqlens.tolist() == [lengths[0], lengths[1] + 1]
    with strict_mode():
        with pytest.raises(ValueError, match=message):
            f(torch.tensor(lengths, dtype=torch.int32), num_kept, **kw)


# ----- no silent narrowing or reinterpretation ----------------------------------------------------------------
def test_int64_tensors_outside_int32_raise(backend, gen):
    ops = BACKENDS[backend]
    dt = attention_dtype(backend)
    q, pages = randn(1, 2, 2, 64, gen=gen, dtype=dt), randn(4, 8, 2, 64, gen=gen, dtype=dt)
    sl = torch.tensor([3], dtype=torch.int32)
    table = torch.tensor([[2**32 + 1, 0]], dtype=torch.int64)  # narrowed, it would read page 1
    with pytest.raises(ValueError, match="block_table holds values outside the int32 range"):
        ops.verify_attention(q, pages, pages.clone(), sl, block_table=table)
    within = torch.tensor([[1, 0]], dtype=torch.int64)
    assert torch.equal(ops.verify_attention(q, pages, pages.clone(), sl, block_table=within),
                       ops.verify_attention(q, pages, pages.clone(), sl, block_table=within.int()))
    lengths = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="num_kept holds values outside the int32 range"):
        ops.truncate_kv_cache(lengths, torch.tensor([2**32 + 1]), k_caches=[pages], v_caches=[pages],
                              block_table=within)
    with pytest.raises(ValueError, match="block_table holds values outside"):
        ops.truncate_kv_cache(lengths, 1, k_caches=[pages], v_caches=[pages], block_table=table)
    with pytest.raises(ValueError, match="kept_indices holds values outside"):
        ops.truncate_kv_cache(lengths, 1, kept_indices=torch.tensor([[2**32, -1]]), k_caches=[pages],
                              v_caches=[pages], block_table=within)
    assert lengths.tolist() == [3]


def test_non_integer_counts_and_indices_raise(backend):
    ops = BACKENDS[backend]
    ids, probs = torch.zeros(1, 3, dtype=torch.int64), torch.full((1, 4, 10), 0.1)
    for bad in (2.7, torch.tensor([2.7]), True, torch.tensor([True])):
        with pytest.raises(ValueError, match="num_draft_tokens must be an integer"):
            ops.chain_speculative_sampling(ids, probs, num_draft_tokens=bad, seed=1)
    with pytest.raises(ValueError, match="greedy must be a bool"):
        ops.chain_speculative_sampling(ids, probs, greedy=torch.tensor([1]), seed=1)
    lengths = torch.tensor([3], dtype=torch.int32)
    k = [torch.randn(1, 10, 1, 4)]
    with pytest.raises(ValueError, match="num_kept must be an integer"):
        ops.truncate_kv_cache(lengths, torch.tensor([1.5]), k_caches=k, v_caches=k)
    with pytest.raises(ValueError, match="kept_indices must be an integer tensor"):
        ops.truncate_kv_cache(lengths, 1, kept_indices=torch.tensor([[0.0, 1.0]]), k_caches=k, v_caches=k)
    assert lengths.tolist() == [3]


def test_float_tree_mask_is_refused(backend, gen):
    dt = attention_dtype(backend)
    q, kc = randn(1, 3, 2, 64, gen=gen, dtype=dt), randn(1, 8, 2, 64, gen=gen, dtype=dt)
    sl = torch.tensor([2], dtype=torch.int32)
    additive = torch.zeros(3, 3).masked_fill(~torch.ones(3, 3, dtype=torch.bool).tril(), float("-inf"))
    with pytest.raises(ValueError, match="tree_mask must be a bool tensor"):
        BACKENDS[backend].verify_attention(q, kc, kc.clone(), sl, tree_mask=additive)
    with pytest.raises(ValueError, match="tree_mask must be a bool tensor"):
        BACKENDS[backend].verify_attention(q, kc, kc.clone(), sl, tree_mask=torch.ones(3, 3, dtype=torch.int32))


# ----- devices ------------------------------------------------------------------------------------------------
def test_tensors_on_another_device_are_named(backend, gen):
    ops = BACKENDS[backend]
    dt = attention_dtype(backend)
    q = randn(1, 2, 2, 64, gen=gen, dtype=dt)
    meta = torch.empty(1, 8, 2, 64, dtype=dt, device="meta")
    sl = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="k_cache is on meta but q is on cpu"):
        ops.verify_attention(q, meta, meta, sl)
    kc = randn(1, 8, 2, 64, gen=gen, dtype=dt)
    with pytest.raises(ValueError, match="cache_seqlens is on meta but q is on cpu"):
        ops.verify_attention(q, kc, kc.clone(), sl.to("meta"))
    probs = torch.full((1, 3, 10), 0.1)
    with pytest.raises(ValueError, match="draft_probs is on meta but target_probs is on cpu"):
        ops.chain_speculative_sampling(torch.zeros(1, 2, dtype=torch.int64), probs,
                                       torch.empty(1, 2, 10, device="meta"), seed=1)
    with pytest.raises(ValueError, match=r"k_caches\[0\] is on meta but cache_seqlens is on cpu"):
        ops.truncate_kv_cache(torch.zeros(1, dtype=torch.int32), 1, block_len=2, clear=True,
                              k_caches=[torch.empty(1, 8, 1, 4, device="meta")],
                              v_caches=[torch.empty(1, 8, 1, 4, device="meta")])


# ----- sampling: validation that does not depend on the round's outcome ------------------------------------------
def rejecting_round(backend: str, logits: bool):
    """B=4, K=3, V=20, where every request rejects its first draft (p(x) = 0): rows 1 and 2 are never read.
    Draft id 0 has no target mass at position 0. Returns the ids, the target, and the op with its arguments."""
    b, k, v = 4, 3, 20
    ids = torch.zeros(b, k, dtype=torch.int64)
    p = torch.rand(b, k + 1, v, generator=torch.Generator().manual_seed(5)) + 0.1
    p[:, 0, 0] = 0.0
    p = p / p.sum(-1, keepdim=True)
    target = p.log() if logits else p
    ops = BACKENDS[backend]
    if logits:
        return ids, target, functools.partial(ops.chain_speculative_sampling_from_logits, temperature=1.0)
    return ids, target, ops.chain_speculative_sampling


@pytest.mark.parametrize("logits", [False, True])
def test_draft_ids_are_checked_where_the_round_never_reads(backend, logits):
    ids, target, f = rejecting_round(backend, logits)
    res = f(ids, target, seed=3)
    assert res.num_accepted.tolist() == [0, 0, 0, 0]  # the premise: position 0 rejects, 1 and 2 are not read
    bad = ids.clone()
    bad[1, 1] = 20
    if backend == "cpu":
        out = torch.full((4, 4), -7, dtype=torch.int32), torch.full((4,), -7, dtype=torch.int32)
        with pytest.raises(ValueError, match="draft_token_ids holds ids outside"):
            f(bad, target, seed=3, out=out)
        assert (out[0] == -7).all() and (out[1] == -7).all()  # raised before anything was written
    else:
        assert torch.equal(f(bad, target, seed=3).output_token_ids, res.output_token_ids)  # defined output
        with strict_mode():
            with pytest.raises(ValueError, match="draft_token_ids holds ids outside"):
                f(bad, target, seed=3)
    # Ids past num_draft_tokens[b] are padding, never checked.
    padded = ids.clone()
    padded[1, 2] = 999
    n = torch.tensor([3, 2, 3, 3], dtype=torch.int32)
    with strict_mode():
        f(padded, target, num_draft_tokens=n, seed=3)


@pytest.mark.parametrize("logits", [False, True])
def test_strict_mode_checks_rows_the_round_never_reads(backend, logits):
    ids, target, f = rejecting_round(backend, logits)
    poisoned = target.clone()
    poisoned[2, 2, 7] = float("nan")  # request 2 rejects at position 0: row 2 is never read
    f(ids, poisoned, seed=3)  # not read: no error outside strict mode
    with strict_mode():
        with pytest.raises(ValueError, match=r"\[2, 2\] holds NaN"):
            f(ids, poisoned, seed=3)
        draft = torch.softmax(torch.randn(4, 3, 20), -1)
        draft = draft.log() if logits else draft
        draft[0, 1, 3] = float("inf")
        with pytest.raises(ValueError, match=r"draft_(probs|logits)\[0, 1\] holds NaN"):
            f(ids, target, draft, seed=3)
        # Rows past num_draft_tokens[b] are padding: a NaN there is not an error, even in strict mode.
        f(ids, poisoned, num_draft_tokens=torch.tensor([3, 3, 1, 3], dtype=torch.int32), seed=3)


@pytest.mark.parametrize("greedy", [False, True])
@pytest.mark.parametrize("logits", [False, True])
def test_target_row_without_mass(backend, logits, greedy):
    v = 12
    ids = torch.tensor([[3, 4], [3, 4]])
    p = torch.softmax(torch.randn(2, 3, v, generator=torch.Generator().manual_seed(2)), -1)
    p[1, 0] = 0.0  # request 1's first target row has no mass; request 0 is fine
    target = p.log() if logits else p  # log(0) = -inf: every logit masked
    kw = {"temperature": 0.0 if greedy else 1.0} if logits else {"greedy": greedy}
    f = (BACKENDS[backend].chain_speculative_sampling_from_logits if logits else
         BACKENDS[backend].chain_speculative_sampling)
    if backend == "cpu":
        with pytest.raises(ValueError, match="no mass"):
            f(ids, target, seed=11, **kw)
        return
    res = f(ids, target, seed=11, **kw)  # like CUDA without strict mode: a defined output, -1 for the token
    assert res.num_accepted[1] == 0 and res.output_token_ids[1].tolist() == [-1, -1, -1]
    assert 0 <= int(res.output_token_ids[0, int(res.num_accepted[0])]) < v
    with strict_mode():
        with pytest.raises(ValueError, match="no mass"):
            f(ids, target, seed=11, **kw)


# ----- verify_attention: a request that fails, fails whole ------------------------------------------------------------
def test_sim_bad_page_for_new_tokens_fails_every_row_tile_and_split(gen):
    # 33 queries x 2 heads per KV head = 66 rows: two row tiles; 700 cached tokens: three KV splits.
    n_q, hq, hkv, d, page = 33, 4, 2, 64, 16
    lengths = [700, 40]
    pages_per_seq = -(-(max(lengths) + n_q) // page)
    num_pages = 2 * pages_per_seq
    table = torch.arange(num_pages, dtype=torch.int32).reshape(2, pages_per_seq)
    table[0, (700 + n_q - 1) // page] = 10_000  # the page of request 0's last new token is outside the cache
    q = randn(2, n_q, hq, d, gen=gen, dtype=torch.float16)
    kc, vc = randn(num_pages, page, hkv, d, gen=gen, dtype=torch.float16), randn(num_pages, page, hkv, d, gen=gen,
                                                                                   dtype=torch.float16)
    kn, vn = randn(2, n_q, hkv, d, gen=gen, dtype=torch.float16), randn(2, n_q, hkv, d, gen=gen, dtype=torch.float16)
    sl = torch.tensor(lengths, dtype=torch.int32)
    k_before = kc.clone()
    out, lse = sim.verify_attention(q, kc, vc, sl, kn, vn, block_table=table, return_lse=True)
    assert torch.isnan(out[0]).all() and torch.isnan(lse[0]).all()
    assert torch.isfinite(out[1]).all()
    for j in range(n_q):  # nothing of request 0 was appended, not even to its valid pages
        pos = 700 + j
        p = int(table[0, pos // page])
        if p < num_pages:
            assert torch.equal(kc[p, pos % page], k_before[p, pos % page])
    with strict_mode():
        with pytest.raises(ValueError, match="block_table points outside"):
            sim.verify_attention(q, kc, vc, sl, kn, vn, block_table=table)


# ----- verify_attention: empty engine forms --------------------------------------------------------------------------
def test_flat_q_without_rows_and_requests_without_pages(backend, gen):
    """T = 0, B = 0, and a CSR request with no pages and no rows: defined, nothing read or written."""
    ops = BACKENDS[backend]
    dt = attention_dtype(backend)
    kc = randn(4, 8, 2, 64, gen=gen, dtype=dt)
    empty_q = randn(0, 4, 64, gen=gen, dtype=dt)
    out = ops.verify_attention(empty_q, kc, kc.clone(), torch.zeros(2, dtype=torch.int32),
                               qo_indptr=torch.zeros(3, dtype=torch.int32), block_table=torch.zeros(2, 1,
                                                                                                    dtype=torch.int32))
    assert out.shape == (0, 4, 64)
    out = ops.verify_attention(empty_q, kc, kc.clone(), torch.zeros(0, dtype=torch.int32),
                               qo_indptr=torch.zeros(1, dtype=torch.int32))
    assert out.shape == (0, 4, 64)
    # Request 0: no pages, no rows; request 1: 2 rows on pages [3, 1] (kv length 8 + 5, the rows its last two).
    q = randn(2, 4, 64, gen=gen, dtype=dt)
    before = kc.clone()
    args = dict(qo_indptr=torch.tensor([0, 0, 2], dtype=torch.int32), kv_indptr=torch.tensor([0, 0, 2],
                                                                                             dtype=torch.int32),
                kv_indices=torch.tensor([3, 1], dtype=torch.int32), kv_last_page_len=torch.tensor([0, 5],
                                                                                                  dtype=torch.int32))
    out = ops.verify_attention(q, kc, kc.clone(), None, **args)
    want = ops.verify_attention(q[None], kc, kc.clone(), torch.tensor([11], dtype=torch.int32),
                                block_table=torch.tensor([[3, 1]], dtype=torch.int32))
    assert torch.equal(out, want[0]) and torch.equal(kc, before)


# ----- batch invariance of verify_attention ----------------------------------------------------------------------
@pytest.mark.parametrize("paged", [False, True])
def test_attention_bits_do_not_depend_on_the_batch(backend, paged, gen):
    dt = attention_dtype(backend)
    n_q, hq, hkv, d, s_max, page = 5, 4, 2, 64, 2048, 16
    lengths = [1500, 1800, 100, 1, 700]
    q = randn(5, n_q, hq, d, gen=gen, dtype=dt)
    if paged:
        per_seq = s_max // page
        kc = randn(5 * per_seq, page, hkv, d, gen=gen, dtype=dt)
        table = torch.randperm(5 * per_seq, generator=gen).int().reshape(5, per_seq)
    else:
        kc, table = randn(5, s_max, hkv, d, gen=gen, dtype=dt), None
    vc = randn(*kc.shape, gen=gen, dtype=dt)

    def run(rows, threads):
        torch.set_num_threads(threads)
        try:
            if paged:
                return BACKENDS[backend].verify_attention(q[rows], kc, vc, torch.tensor([lengths[r] for r in rows],
                                                          dtype=torch.int32), block_table=table[rows],
                                                          return_lse=True)
            return BACKENDS[backend].verify_attention(q[rows], kc[rows], vc[rows],
                                                      torch.tensor([lengths[r] for r in rows], dtype=torch.int32),
                                                      return_lse=True)
        finally:
            torch.set_num_threads(original)

    original = torch.get_num_threads()
    alone, alone_lse = run([0], 1)
    for rows, threads in (([0, 1, 2], 2), ([0, 1, 2], 1), ([0, 1, 2, 3, 4], 2), ([0, 3], 2), ([0], 2)):
        out, lse = run(rows, threads)
        assert torch.equal(out[0], alone[0]), (rows, threads)
        assert torch.equal(lse[0], alone_lse[0]), (rows, threads)


# ----- PagedKVCache --------------------------------------------------------------------------------------------------
def make_paged(num_pages=6, max_batch=2, max_pages=4):
    return PagedKVCache(2, num_pages, 4, 1, 8, max_batch_size=max_batch, max_pages_per_seq=max_pages,
                        dtype=torch.float32)


def test_failed_reserve_allocates_nothing():
    cache = make_paged(num_pages=6)
    cache.reserve(5, requests=[0])  # 2 pages
    table, free = cache.block_table.clone(), cache.free_pages
    with pytest.raises(RuntimeError, match="out of pages"):
        cache.reserve(16)  # request 0 needs 2 more pages, request 1 needs 4: 6 > 4 free
    assert cache.free_pages == free and torch.equal(cache.block_table, table)
    with pytest.raises(ValueError, match="max_pages_per_seq"):
        cache.reserve(100)
    assert cache.free_pages == free and torch.equal(cache.block_table, table)
    cache.reserve(8)  # what fits still works: request 1 gets 2 pages
    assert cache.free_pages == free - 2


def test_paged_cache_bad_arguments():
    cache = make_paged()
    for bad in (-100, 2.5, True):
        with pytest.raises(ValueError, match="num_tokens must be an int >= 0"):
            cache.reserve(bad)
    for bad in (-1, 2, 1.0):
        with pytest.raises(ValueError, match="request must be an int in"):
            cache.release(bad)
    with pytest.raises(ValueError, match="request must be an int in"):
        cache.reserve(1, requests=[5])
    assert cache.free_pages == 6


def test_truncate_after_release_raises():
    cache = make_paged()
    cache.reserve(5)
    cache.truncate(torch.tensor([3, 5], dtype=torch.int32))
    assert cache.cache_seqlens.tolist() == [3, 5]
    cache.release(0)
    with pytest.raises(ValueError, match="block_table points outside"):
        cache.truncate(torch.tensor([2, 0], dtype=torch.int32))  # request 0 has no pages any more
    assert cache.cache_seqlens.tolist() == [0, 5]
    cache.truncate(torch.tensor([0, 0], dtype=torch.int32))
    assert cache.free_pages == 6 - 2
