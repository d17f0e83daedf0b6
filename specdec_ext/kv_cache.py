"""KV caches for a model: per-layer K/V storage, the lengths, and (paged) a page allocator.

Both keep every layer in one stacked tensor [L, ...], so truncate() cuts all layers in one launch and
layer(i) is a view. The lengths live on the device (cache_seqlens, int32): kernels read and advance
them without host synchronisation.

The protocol a model and a decoder use, the same for both caches:
  reserve(num_tokens)        room for num_tokens more tokens per request (an int, or one count per request)
  attention_args(layer, rows) (k, v, cache_seqlens, block_table) of one layer for verify_attention, for the
                             requests in `rows` (a slice; all by default)
  advance(num_tokens)        cache_seqlens[b] += num_tokens[b] after a forward wrote them (prefill, decode)
  truncate(num_kept, ...)    after a verify block: keep num_kept of its tokens (truncate_kv_cache); with
                             free_pages=False only the device part runs (no host read: CUDA-graph capture),
                             and free_unused_pages() after the round's host read gives the pages back
  release(b)                 a finished request: length 0 (and its pages freed)
"""
import torch

from .ops import truncate_kv_cache


class StaticKVCache:
    """Contiguous cache: k, v are [num_layers, batch_size, max_seq_len, num_kv_heads, head_dim]."""

    def __init__(self, num_layers: int, batch_size: int, max_seq_len: int, num_kv_heads: int, head_dim: int, *,
                 dtype=torch.bfloat16, device="cpu"):
        shape = (num_layers, batch_size, max_seq_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.cache_seqlens = torch.zeros(batch_size, dtype=torch.int32, device=device)
        self.block_table = None
        self.max_seq_len = max_seq_len

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    def attention_args(self, layer: int, rows: slice = slice(None)):
        """(k_cache, v_cache, cache_seqlens, block_table) of `layer` for the requests in `rows` (views)."""
        return self.k[layer, rows], self.v[layer, rows], self.cache_seqlens[rows], None

    def reserve(self, num_tokens, requests=None) -> None:
        """Nothing to allocate: every request owns max_seq_len slots (the kernels check the range)."""

    def advance(self, num_tokens) -> None:
        """cache_seqlens[b] += num_tokens[b] (an int or [B] int32), after a forward wrote those tokens."""
        truncate_kv_cache(self.cache_seqlens, num_tokens, k_caches=self.k, v_caches=self.v)

    def truncate(self, num_kept, *, block_len=None, kept_indices=None, clear=False, free_pages=True) -> None:
        """After verifying a block written at cache_seqlens: keep num_kept of its tokens in every layer."""
        truncate_kv_cache(self.cache_seqlens, num_kept, block_len=block_len, kept_indices=kept_indices,
                          k_caches=self.k, v_caches=self.v, clear=clear)

    def free_unused_pages(self) -> None:
        """No pages to give back."""

    def release(self, request: int) -> None:
        self.cache_seqlens[request] = 0

    def reset(self) -> None:
        self.cache_seqlens.zero_()


class PagedKVCache:
    """Paged cache: k, v are [num_layers, num_pages, page_size, num_kv_heads, head_dim]; request b's position s
    is in page block_table[b, s // page_size]. Unassigned table entries are -1, so a kernel that reaches one
    reports it instead of reading another request's page.

    The allocator runs on the host with a mirror of the lengths: reserve() before a verify step gives every
    request pages for its block, truncate() frees whole pages past the new lengths (reading num_kept back,
    the one host synchronisation of a round, which a scheduler needs anyway)."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, *,
                 max_batch_size: int, max_pages_per_seq: int, dtype=torch.bfloat16, device="cpu"):
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"PagedKVCache: page_size must be a power of two, got {page_size}")
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size
        self.cache_seqlens = torch.zeros(max_batch_size, dtype=torch.int32, device=device)
        self.block_table = torch.full((max_batch_size, max_pages_per_seq), -1, dtype=torch.int32, device=device)
        self._table = [[] for _ in range(max_batch_size)]  # host copy of each request's pages
        self._lengths = [0] * max_batch_size
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    @property
    def batch_size(self) -> int:
        return self.cache_seqlens.shape[0]

    def attention_args(self, layer: int, rows: slice = slice(None)):
        """(k_cache, v_cache, cache_seqlens, block_table) of `layer` for the requests in `rows` (views)."""
        return self.k[layer], self.v[layer], self.cache_seqlens[rows], self.block_table[rows]

    def reserve(self, num_tokens, requests=None) -> None:
        """Makes room for num_tokens more tokens after the current length of each request (all by default);
        num_tokens is an int, or one count per request of `requests`. All or nothing: if any request cannot
        get its pages, nothing is allocated and it raises. Reads the lengths back from the device."""
        requests = range(len(self._table)) if requests is None else [self._request(b, "reserve") for b in requests]
        counts = num_tokens if isinstance(num_tokens, (list, tuple)) else [num_tokens] * len(requests)
        if len(counts) != len(requests) or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in counts):
            raise ValueError(f"PagedKVCache.reserve: num_tokens must be an int >= 0 or one per request, got {num_tokens!r}")
        self._lengths = self.cache_seqlens.tolist()
        max_pages = self.block_table.shape[1]
        needs = {}
        for b, n in zip(requests, counts):
            need = -(-(self._lengths[b] + n) // self.page_size)
            if need > max_pages:
                raise ValueError(f"PagedKVCache: request {b} needs {need} pages, max_pages_per_seq is {max_pages}")
            needs[b] = max(needs.get(b, 0), need - len(self._table[b]))
        if sum(needs.values()) > len(self._free):
            raise RuntimeError(f"PagedKVCache: out of pages ({len(self._free)} free, the requests need "
                               f"{sum(needs.values())} more)")
        for b, more in needs.items():
            self._table[b].extend(self._free.pop() for _ in range(more))
        self._upload()

    def advance(self, num_tokens) -> None:
        """cache_seqlens[b] += num_tokens[b] (an int or [B] int32) after a forward wrote those tokens into
        reserved pages; no host synchronisation (the kernel checks the pages)."""
        truncate_kv_cache(self.cache_seqlens, num_tokens, k_caches=self.k, v_caches=self.v,
                          block_table=self.block_table)

    def truncate(self, num_kept, *, block_len=None, kept_indices=None, clear=False, free_pages=True) -> None:
        """After verifying a block: keep num_kept of its tokens in every layer, then (free_pages) free whole
        pages past the new lengths. A request that truncation rejects raises on the CPU (set_strict(True) on
        CUDA); the host's lengths are read back from the device, so they never disagree with cache_seqlens."""
        truncate_kv_cache(self.cache_seqlens, num_kept, block_len=block_len, kept_indices=kept_indices,
                          k_caches=self.k, v_caches=self.v, block_table=self.block_table, clear=clear)
        if free_pages:
            self.free_unused_pages()

    def free_unused_pages(self) -> None:
        """Gives back the pages past each request's length (a host read of the lengths)."""
        self._lengths = self.cache_seqlens.tolist()  # the round's one host read
        for b, length in enumerate(self._lengths):
            keep_pages = -(-length // self.page_size)
            while len(self._table[b]) > keep_pages:
                self._free.append(self._table[b].pop())
        self._upload()

    def release(self, request: int) -> None:
        """Frees every page of a finished request and sets its length to 0."""
        request = self._request(request, "release")
        self._free.extend(reversed(self._table[request]))
        self._table[request] = []
        self._lengths[request] = 0
        self.cache_seqlens[request] = 0
        self._upload()

    def _request(self, b, what: str) -> int:
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < len(self._table):
            raise ValueError(f"PagedKVCache.{what}: request must be an int in [0, {len(self._table)}), got {b!r}")
        return b

    def _upload(self) -> None:
        table = torch.full(tuple(self.block_table.shape), -1, dtype=torch.int32)
        for b, pages in enumerate(self._table):
            table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        self.block_table.copy_(table)
