"""truncate_kv_cache on CUDA: the same caches as the CPU kernel, no host sync, capturable in a CUDA graph."""
import pytest
import torch

import specdec_ext


def test_cuda_matches_cpu_paged_and_contiguous():
    g = torch.Generator().manual_seed(0)
    batch, layers, block_len = 6, 4, 9
    for paged in (False, True):
        if paged:
            page_size, pages_per_seq = 8, 6
            num_pages = batch * pages_per_seq + 3
            table = torch.randperm(num_pages, generator=g)[: batch * pages_per_seq].int().reshape(batch, pages_per_seq)
            shape, capacity = (num_pages, page_size, 8, 128), page_size * pages_per_seq
        else:
            table, shape, capacity = None, (batch, 64, 8, 128), 64
        k = torch.randn(layers, *shape, generator=g).bfloat16()
        v = torch.randn(layers, *shape, generator=g).bfloat16()
        lengths = torch.randint(0, capacity - block_len + 1, (batch,), generator=g, dtype=torch.int32)
        num_kept = torch.randint(0, block_len + 1, (batch,), generator=g, dtype=torch.int32)
        kept = torch.full((batch, block_len), -1, dtype=torch.int32)
        for b in range(batch):
            n = int(num_kept[b])
            kept[b, :n] = torch.randperm(block_len, generator=g)[:n].sort().values.int()
        cpu = (lengths.clone(), k.clone(), v.clone())
        specdec_ext.truncate_kv_cache(cpu[0], num_kept, kept_indices=kept, k_caches=cpu[1], v_caches=cpu[2],
                                      block_table=table, clear=True)
        gpu = (lengths.cuda(), k.cuda(), v.cuda())
        # copied before the check: a copy from pageable host memory synchronises by itself
        num_kept_gpu, kept_gpu, table_gpu = num_kept.cuda(), kept.cuda(), None if table is None else table.cuda()
        torch.cuda.set_sync_debug_mode("error")
        try:
            specdec_ext.truncate_kv_cache(gpu[0], num_kept_gpu, kept_indices=kept_gpu, k_caches=gpu[1],
                                          v_caches=gpu[2], block_table=table_gpu, clear=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for a, b in zip(gpu, cpu):
            assert torch.equal(a.cpu(), b)


def test_cuda_graph_capture():
    k = torch.randn(2, 3, 32, 2, 64, device="cuda")
    v = torch.randn(2, 3, 32, 2, 64, device="cuda")
    lengths = torch.tensor([0, 4, 10], dtype=torch.int32, device="cuda")
    num_kept = torch.tensor([1, 2, 3], dtype=torch.int32, device="cuda")
    kept = torch.tensor([[2, -1, -1], [0, 2, -1], [0, 1, 2]], dtype=torch.int32, device="cuda")
    want = (lengths.clone().cpu(), k.clone().cpu(), v.clone().cpu())
    specdec_ext.truncate_kv_cache(want[0], num_kept.cpu(), kept_indices=kept.cpu(), k_caches=want[1], v_caches=want[2],
                                  clear=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # captured, not run: the replay below applies the truncation once
        specdec_ext.truncate_kv_cache(lengths, num_kept, kept_indices=kept, k_caches=k, v_caches=v, clear=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(lengths.cpu(), want[0]) and torch.equal(k.cpu(), want[1]) and torch.equal(v.cpu(), want[2])


def test_cuda_matches_cpu_engine_layouts():
    """HND pages interleaved K/V (FlashInfer's kv[:, 0] / kv[:, 1]) through a CSR table: CUDA == CPU."""
    g = torch.Generator().manual_seed(1)
    batch, layers, block_len, page, heads, dim = 5, 3, 16, 8, 4, 128
    pages = [6, 3, 4, 6, 2]
    num_pages = sum(pages) + 4
    indices = torch.randperm(num_pages, generator=g)[: sum(pages)].int()
    indptr = torch.tensor([0] + pages).cumsum(0).int()
    kv = torch.randn(layers, num_pages, 2, heads, page, dim, generator=g).bfloat16()
    lengths = torch.tensor([n * page - block_len for n in pages], dtype=torch.int32).clamp(min=0)
    num_kept = torch.randint(0, block_len + 1, (batch,), generator=g, dtype=torch.int32)
    kept = torch.full((batch, block_len), -1, dtype=torch.int32)
    for b in range(batch):
        n = int(num_kept[b])
        kept[b, :n] = torch.randperm(block_len, generator=g)[:n].sort().values.int()
    cpu = (lengths.clone(), kv.clone())
    specdec_ext.truncate_kv_cache(cpu[0], num_kept, kept_indices=kept, k_caches=cpu[1][:, :, 0], v_caches=cpu[1][:, :,
                                                                                                                 1],
                                  kv_indptr=indptr, kv_indices=indices, kv_layout="HND", clear=True)
    gpu = (lengths.cuda(), kv.cuda())
    specdec_ext.truncate_kv_cache(gpu[0], num_kept.cuda(), kept_indices=kept.cuda(), k_caches=gpu[1][:, :, 0],
                                  v_caches=gpu[1][:, :, 1], kv_indptr=indptr.cuda(), kv_indices=indices.cuda(),
                                  kv_layout="HND", clear=True)
    assert torch.equal(gpu[0].cpu(), cpu[0]) and torch.equal(gpu[1].cpu(), cpu[1])


def test_page_listed_twice_within_a_request_is_refused():
    """Request 0's block spans one page listed twice: left untouched (its length too), strict mode raises; request 1
    is truncated."""
    g = torch.Generator().manual_seed(3)
    k = [torch.randn(4, 4, 2, 64, generator=g).bfloat16().cuda()]
    v = [torch.randn(4, 4, 2, 64, generator=g).bfloat16().cuda()]
    kept = torch.tensor([[0, 2, -1], [0, 1, -1]], dtype=torch.int32).cuda()
    table = torch.tensor([[0, 0], [1, 2]], dtype=torch.int32).cuda()
    lengths = torch.tensor([3, 3], dtype=torch.int32).cuda()
    before = k[0].clone()
    specdec_ext.truncate_kv_cache(lengths, 2, kept_indices=kept, k_caches=k, v_caches=v, block_len=3, block_table=table)
    assert lengths.tolist() == [3, 5] and torch.equal(k[0][0], before[0])
    specdec_ext.set_strict(True)
    try:
        with pytest.raises(ValueError, match="a page of the block twice"):
            specdec_ext.truncate_kv_cache(torch.tensor([3, 3], dtype=torch.int32).cuda(), 2, kept_indices=kept,
                                          k_caches=[t.clone() for t in k], v_caches=[t.clone() for t in v],
                                          block_len=3, block_table=table)
    finally:
        specdec_ext.set_strict(False)
