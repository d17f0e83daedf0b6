import pytest
import torch

from specdec_ext import reference
from specdec_ext.kv_cache import PagedKVCache, StaticKVCache


def test_static_cache_truncates_every_layer(gen):
    cache = StaticKVCache(3, 2, 16, 2, 4, dtype=torch.float32)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    cache.cache_seqlens.copy_(torch.tensor([2, 5], dtype=torch.int32))
    want_k, want_v, want_len = cache.k.clone(), cache.v.clone(), cache.cache_seqlens.clone()
    kept = torch.tensor([[0, 3, -1, -1], [1, 2, 3, -1]], dtype=torch.int32)
    num_kept = torch.tensor([2, 3], dtype=torch.int32)
    cache.truncate(num_kept, kept_indices=kept, clear=True)
    reference.truncate_kv_cache(want_len, num_kept, kept_indices=kept, k_caches=want_k, v_caches=want_v, clear=True)
    assert torch.equal(cache.k, want_k) and torch.equal(cache.v, want_v) and torch.equal(cache.cache_seqlens, want_len)
    assert torch.equal(cache.layer(1)[0], want_k[1])


def test_paged_cache_reserves_frees_and_compacts(gen):
    cache = PagedKVCache(2, num_pages=12, page_size=4, num_kv_heads=1, head_dim=4, max_batch_size=3,
                         max_pages_per_seq=5, dtype=torch.float32)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    cache.reserve(6)  # block of 6 from length 0: 2 pages each
    assert cache.free_pages == 6
    table = cache.block_table.clone()
    owned = table[table >= 0].tolist()
    assert len(owned) == len(set(owned)) == 6
    want_k, want_v, want_len = cache.k.clone(), cache.v.clone(), cache.cache_seqlens.clone()
    kept = torch.tensor([[0, 5, -1, -1, -1, -1], [0, 1, 2, 3, 4, 5], [-1] * 6], dtype=torch.int32)
    num_kept = torch.tensor([2, 6, 0], dtype=torch.int32)
    cache.truncate(num_kept, kept_indices=kept, clear=True)
    reference.truncate_kv_cache(want_len, num_kept, kept_indices=kept, k_caches=want_k, v_caches=want_v,
                                block_table=table, clear=True)
    assert torch.equal(cache.k, want_k) and torch.equal(cache.v, want_v)
    assert cache.cache_seqlens.tolist() == [2, 6, 0]
    # Whole pages past the new lengths are free again: 1 + 2 + 0 pages kept.
    assert cache.free_pages == 12 - 3
    assert (cache.block_table[2] == -1).all() and (cache.block_table[0, 1:] == -1).all()
    cache.reserve(5)  # lengths 2, 6, 0 -> 7, 11, 5 tokens: 2 + 3 + 2 pages
    assert cache.free_pages == 12 - 7
    cache.release(1)
    assert cache.free_pages == 12 - 4 and cache.cache_seqlens[1] == 0


def test_paged_cache_limits():
    cache = PagedKVCache(1, num_pages=3, page_size=4, num_kv_heads=1, head_dim=2, max_batch_size=2, max_pages_per_seq=2,
                         dtype=torch.float32)
    with pytest.raises(ValueError, match="max_pages_per_seq"):
        cache.reserve(9, requests=[0])
    cache.reserve(8, requests=[0])
    with pytest.raises(RuntimeError, match="out of pages"):
        cache.reserve(8, requests=[1])
    with pytest.raises(ValueError, match="power of two"):
        PagedKVCache(1, num_pages=3, page_size=3, num_kv_heads=1, head_dim=2, max_batch_size=1, max_pages_per_seq=1)
