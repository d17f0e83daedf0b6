"""The FlashInfer shim on CUDA: the documented example, FlashInfer's test statement at its sizes, the CPU kernel's
counts
for the same keys, the prefill wrapper against the float64 reference (fp16 / bf16, head dims 64 and 128), CUDA-graph
capture of both; and, where the real flashinfer is installed, the same calls on it."""
import importlib.util

import pytest
import torch

from helpers.compat_flashinfer import (
    DOCUMENTED_OUTPUT,
    check_flashinfer_statement,
    documented_example,
    flashinfer_case,
    flashinfer_masks,
    paged_batch,
    plan_and_run,
    reference_attention,
)
from helpers.verify_attention import TOLERANCE, rel_error
from specdec_ext.compat.flashinfer import BatchPrefillWithPagedKVCacheWrapper, sampling

CUDA = torch.device("cuda")
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None


def to_cuda(*tensors):
    return [None if t is None else t.to(CUDA) for t in tensors]


def test_documented_example_on_cuda():
    draft, ids, target = documented_example(CUDA)
    for seed in range(200):
        out, acc, emit = sampling.chain_speculative_sampling(draft, ids, target, seed=seed, offset=3 * seed)
        assert out.tolist() == DOCUMENTED_OUTPUT and acc.tolist() == [1] and emit.tolist() == [1]
    assert sampling.chain_speculative_sampling(draft, ids, target)[0].tolist() == DOCUMENTED_OUTPUT


@pytest.mark.parametrize("batch", [1, 99, 989])
@pytest.mark.parametrize("vocab", [111, 32000, 128256])
@pytest.mark.parametrize("k", [1, 3, 5, 7])
@pytest.mark.parametrize("onehot", [False, True])
def test_flashinfer_test_statement_on_cuda(batch, vocab, k, onehot, gen):
    if batch * (k + 1) * vocab > 300_000_000:
        pytest.skip("memory: FlashInfer marks its largest cases slow for the same reason")
    draft, ids, target, target_ids = flashinfer_case(gen, batch, k, vocab, onehot)
    seed, offset = torch.randint(0, 2**62, (batch,), generator=gen), torch.arange(batch)
    acc, emit = torch.zeros(batch, dtype=torch.int32, device=CUDA), torch.zeros(batch, dtype=torch.int32, device=CUDA)
    out, acc, emit = sampling.chain_speculative_sampling(*to_cuda(draft, ids, target), acc, emit, seed=seed.to(CUDA),
                                                         offset=offset.to(CUDA))
    check_flashinfer_statement(out.cpu(), acc.cpu(), emit.cpu(), ids, vocab, target_ids)
    cpu = sampling.chain_speculative_sampling(draft, ids, target, seed=seed, offset=offset)
    assert torch.equal(acc.cpu(), cpu[1]) and torch.equal(emit.cpu(), cpu[2])  # same keys, same decisions


def test_sampling_is_capturable_in_a_cuda_graph(gen):
    batch, k, vocab = 32, 4, 32000
    draft, ids, target, _ = to_cuda(*flashinfer_case(gen, batch, k, vocab, onehot=False))
    seed = torch.randint(0, 2**62, (batch,), device=CUDA)
    offset = torch.zeros(batch, dtype=torch.int64, device=CUDA)
    acc, emit = torch.zeros(batch, dtype=torch.int32, device=CUDA), torch.zeros(batch, dtype=torch.int32, device=CUDA)
    sampling.chain_speculative_sampling(draft, ids, target, acc, emit, seed=seed, offset=offset)  # warm-up
    acc.zero_()
    emit.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _, _ = sampling.chain_speculative_sampling(draft, ids, target, acc, emit, seed=seed, offset=offset)
    want_acc, want_emit = torch.zeros_like(acc), torch.zeros_like(emit)
    for step in range(3):
        offset.fill_(step)
        graph.replay()
        ref, want_acc, want_emit = sampling.chain_speculative_sampling(draft, ids, target, want_acc, want_emit,
                                                                       seed=seed, offset=offset.clone())
        assert torch.equal(out, ref)
    assert torch.equal(acc, want_acc) and torch.equal(emit, want_emit)  # the captured adds accumulate per replay


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("mask_kind", ["causal", "full", "custom", "packed"])
def test_wrapper_matches_reference_on_cuda(dtype, head_dim, layout, mask_kind, gen):
    page, hq, hkv = 16, 8, 2
    qo_lens = [5, 0, 12, 1, 9]
    prefix_lens = [int(x) for x in torch.randint(0, 700, (4,), generator=gen)] + [page * 20 - 9]
    q, cache, qo_indptr, kv_indptr, indices, last, kv_lens = paged_batch(gen, qo_lens, prefix_lens, page, hq, hkv,
                                                                          head_dim, dtype, layout)
    masks = flashinfer_masks(gen, mask_kind, qo_lens, kv_lens)
    wrapper = BatchPrefillWithPagedKVCacheWrapper(torch.empty(1, dtype=torch.uint8, device=CUDA), layout)
    out, lse = plan_and_run(wrapper, to_cuda(q, cache, qo_indptr, kv_indptr, indices, last), page, hq, hkv, mask_kind,
                            masks)
    ref, ref_lse = reference_attention(q, cache, layout, qo_indptr, kv_indptr, indices, masks, page)
    assert rel_error(out.cpu(), ref) <= TOLERANCE[dtype]
    assert torch.allclose(lse.cpu().double(), ref_lse, atol=2e-2)


def test_int64_tables_on_cuda_are_range_checked(gen):
    """int64 tables on the device (FlashInfer's plan takes them): in range, the int32 tables' output; a page id of
    2**32 + 1 is refused, not read as page 1."""
    page, hq, hkv, d = 16, 8, 2, 64
    q, cache, *table, kv_lens = paged_batch(gen, [4, 3], [30, 70], page, hq, hkv, d, torch.float16, "NHD")
    masks = flashinfer_masks(gen, "custom", [4, 3], kv_lens)
    def make():
        return BatchPrefillWithPagedKVCacheWrapper(torch.empty(1, dtype=torch.uint8, device=CUDA), "NHD")
    want, _ = plan_and_run(make(), to_cuda(q, cache, *table), page, hq, hkv, "custom", masks)
    got, _ = plan_and_run(make(), to_cuda(q, cache, *(t.long() for t in table)), page, hq, hkv, "custom", masks)
    assert torch.equal(got, want)
    indices = table[2].long().clone()
    indices[0] = 2**32 + 1
    with pytest.raises(ValueError, match="paged_kv_indices holds values outside the int32 range"):
        make().plan(*to_cuda(table[0], table[1], indices, table[3]), hq, hkv, d, page, causal=True)


def test_wrapper_run_replays_in_a_cuda_graph(gen):
    page, hq, hkv, d, dtype = 16, 8, 2, 128, torch.bfloat16
    bufs = [torch.zeros(4, dtype=torch.int32, device=CUDA), torch.zeros(4, dtype=torch.int32, device=CUDA),
            torch.zeros(256, dtype=torch.int32, device=CUDA), torch.zeros(3, dtype=torch.int32, device=CUDA)]
    wrapper = BatchPrefillWithPagedKVCacheWrapper(torch.empty(1, device=CUDA), "NHD", use_cuda_graph=True,
                                                  qo_indptr_buf=bufs[0], paged_kv_indptr_buf=bufs[1],
                                                  paged_kv_indices_buf=bufs[2], paged_kv_last_page_len_buf=bufs[3])
    cases = []
    for prefix_lens in ([100, 7, 300], [40, 250, 3]):
        q, cache, *table, kv_lens = paged_batch(gen, [5, 5, 5], prefix_lens, page, hq, hkv, d, dtype, "NHD",
                                                spare_pages=40 - sum(-(-(p + 5) // page) for p in prefix_lens))
        cases.append((q, cache, table, flashinfer_masks(gen, "custom", [5, 5, 5], [p + 5 for p in prefix_lens])))
    q_buf, cache_buf = cases[0][0].to(CUDA), cases[0][1].to(CUDA)
    out = torch.zeros_like(q_buf)
    def flat(masks):
        return torch.cat([m.reshape(-1) for m in masks]).to(CUDA)
    wrapper.plan(*to_cuda(*cases[0][2]), hq, hkv, d, page, custom_mask=flat(cases[0][3]))
    wrapper.run(q_buf, cache_buf, out=out)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q_buf, cache_buf, out=out)
    for q, cache, table, masks in cases:
        wrapper.plan(*to_cuda(*table), hq, hkv, d, page, custom_mask=flat(masks))
        q_buf.copy_(q)
        cache_buf.copy_(cache)
        graph.replay()
        ref, _ = reference_attention(q, cache, "NHD", table[0], table[1], table[2], masks, page)
        assert rel_error(out.cpu(), ref) <= TOLERANCE[dtype]


# ----- against the real FlashInfer -----------------------------------------------------------------------------------
@pytest.mark.skipif(not HAS_FLASHINFER, reason="flashinfer is not installed")
def test_real_flashinfer_documented_example_agrees():
    import flashinfer

    draft, ids, target = documented_example(CUDA)
    theirs = flashinfer.sampling.chain_speculative_sampling(draft, ids, target)
    ours = sampling.chain_speculative_sampling(draft, ids, target)
    assert all(torch.equal(a.cpu().long(), b.cpu().long()) for a, b in zip(theirs, ours))


@pytest.mark.skipif(not HAS_FLASHINFER, reason="flashinfer is not installed")
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("mask_kind", ["causal", "full", "custom"])
def test_real_flashinfer_wrapper_agrees(layout, mask_kind, gen):
    import flashinfer

    page, hq, hkv, d, dtype = 16, 8, 2, 128, torch.float16
    qo_lens, prefix_lens = [5, 12, 1], [130, 7, 300]
    q, cache, *table, kv_lens = paged_batch(gen, qo_lens, prefix_lens, page, hq, hkv, d, dtype, layout)
    masks = flashinfer_masks(gen, mask_kind, qo_lens, kv_lens)
    batch = to_cuda(q, cache, *table)
    workspace = torch.zeros(128 * 1024 * 1024, dtype=torch.uint8, device=CUDA)
    results = []
    for wrapper_class in (flashinfer.BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper):
        wrapper = wrapper_class(workspace, layout)
        mask_args = {"causal": {"causal": True}, "full": {},
                     "custom": {"custom_mask": torch.cat([m.reshape(-1) for m in masks]).to(CUDA)}}[mask_kind]
        wrapper.plan(*batch[2:], hq, hkv, d, page, q_data_type=dtype, **mask_args)
        results.append(wrapper.run(batch[0], batch[1], return_lse=True))
    (theirs, their_lse), (ours, our_lse) = results
    assert rel_error(ours.cpu(), theirs.cpu().double()) <= TOLERANCE[dtype]
    assert torch.allclose(our_lse, their_lse, atol=2e-2)  # both base 2
