"""KV caches for a model: per-layer K/V storage, the lengths, and (paged) a page allocator.

Both keep every layer in one stacked tensor [L, ...], so truncate() cuts all layers in one launch and
layer(i) is a view. The lengths live on the device (cache_seqlens, int32): kernels read and advance
them without host synchronisation.

The protocol a model, a drafter and a decoder use, the same for both caches. Counts are host ints (an int for
every request, or a list for the requests of `rows`) or a device int32 tensor over `rows` (CUDA-graph steps);
only host counts keep the paged allocator's host mirror of the lengths current.
  reserve(num_tokens)        room for num_tokens more tokens per request (an int, or one count per request)
  attention_args(layer, rows) (k, v, cache_seqlens, block_table) of one layer for verify_attention, for the
                             requests in `rows` (a slice; all by default)
  advance(num_tokens, rows)  cache_seqlens[b] += num_tokens[b] after a forward wrote them (prefill, decode)
  truncate(num_kept, rows, ...)  after a verify block: keep num_kept of its tokens (truncate_kv_cache); with
                             free_pages=False only the device part runs (no host read: CUDA-graph capture), and
                             free_unused_pages(lengths) after the round's one host read gives the pages back
  restore_lengths(lengths)   every request's length set to a host-known value (a drafter dropping its draft
                             steps' tokens), pages past it freed
  release(b)                 a finished request: length 0 (and its pages freed)
"""
import torch

from .host import upload
from .ops import truncate_kv_cache


def counts_for_rows(cache, counts, rows: slice) -> torch.Tensor:
    """Counts for the requests of `rows` (an int, a host list or a device tensor) as the [batch_size] int32 device
    tensor the ops take, 0 outside `rows`."""
    start, stop, _ = rows.indices(cache.batch_size)
    device = cache.cache_seqlens.device
    if isinstance(counts, torch.Tensor):
        if (start, stop) == (0, cache.batch_size):
            return counts.to(torch.int32)
        full = torch.zeros(cache.batch_size, dtype=torch.int32, device=device)
        full[start:stop] = counts
        return full
    if isinstance(counts, int):
        counts = [counts] * (stop - start)
    return upload([0] * start + list(counts) + [0] * (cache.batch_size - stop), torch.int32, device)


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

    def advance(self, num_tokens, rows: slice = slice(None)) -> None:
        """cache_seqlens[b] += num_tokens[b] for the requests of `rows`, after a forward wrote those tokens."""
        truncate_kv_cache(self.cache_seqlens, counts_for_rows(self, num_tokens, rows), k_caches=self.k, v_caches=self.v)

    def truncate(self, num_kept, rows: slice = slice(None), *, block_len=None, kept_indices=None, clear=False,
                 free_pages=True) -> None:
        """After verifying a block written at cache_seqlens: keep num_kept of its tokens in every layer (kept_indices
        [len(rows), Q] or [batch_size, Q])."""
        truncate_kv_cache(self.cache_seqlens, counts_for_rows(self, num_kept, rows), block_len=block_len,
                          kept_indices=pad_rows(self, kept_indices, rows), k_caches=self.k, v_caches=self.v,
                          clear=clear)

    def restore_lengths(self, lengths: list) -> None:
        """Every request's length set to lengths[b] (host ints)."""
        self.cache_seqlens.copy_(upload(lengths, torch.int32, self.cache_seqlens.device), non_blocking=True)

    def free_unused_pages(self, lengths: list | None = None) -> None:
        """No pages to give back."""

    def release(self, request: int) -> None:
        self.cache_seqlens[request].fill_(0)  # no host-to-device copy (that would synchronise)

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
        self._lengths = [0] * max_batch_size  # the host's mirror of cache_seqlens: current unless _stale
        self._stale = False                    # a device-side change (a CUDA-graph step, a truncation) since
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
        get its pages, nothing is allocated and it raises. Reads the lengths back from the device only when a
        device-side change left the host mirror behind."""
        requests = range(len(self._table)) if requests is None else [self._request(b, "reserve") for b in requests]
        counts = num_tokens if isinstance(num_tokens, (list, tuple)) else [num_tokens] * len(requests)
        if len(counts) != len(requests) or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in counts):
            raise ValueError(f"PagedKVCache.reserve: num_tokens must be an int >= 0 or one per request, got "
                             f"{num_tokens!r}")
        if self._stale:
            self._mirror(self.cache_seqlens.tolist())
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

    def advance(self, num_tokens, rows: slice = slice(None)) -> None:
        """cache_seqlens[b] += num_tokens[b] for the requests of `rows` after a forward wrote those tokens into
        reserved pages; no host synchronisation (the kernel checks the pages)."""
        counts = counts_for_rows(self, num_tokens, rows)
        truncate_kv_cache(self.cache_seqlens, counts, k_caches=self.k, v_caches=self.v, block_table=self.block_table)
        if isinstance(num_tokens, torch.Tensor):
            self._stale = True
        else:
            start, stop, _ = rows.indices(self.batch_size)
            added = [num_tokens] * (stop - start) if isinstance(num_tokens, int) else num_tokens
            for b, n in zip(range(start, stop), added):
                self._lengths[b] += n

    def truncate(self, num_kept, rows: slice = slice(None), *, block_len=None, kept_indices=None, clear=False,
                 free_pages=True) -> None:
        """After verifying a block: keep num_kept of its tokens in every layer (kept_indices [len(rows), Q] or
        [batch_size, Q]), then (free_pages) free whole pages past the new lengths, which reads them back. A
        request that truncation rejects raises on the CPU (set_strict(True) on CUDA)."""
        truncate_kv_cache(self.cache_seqlens, counts_for_rows(self, num_kept, rows), block_len=block_len,
                          kept_indices=pad_rows(self, kept_indices, rows), k_caches=self.k, v_caches=self.v,
                          block_table=self.block_table, clear=clear)
        self._stale = True
        if free_pages:
            self.free_unused_pages()

    def free_unused_pages(self, lengths: list | None = None) -> None:
        """Gives back the pages past each request's length: `lengths` as the caller knows them (the device already
        holds them: a round's truncation, whose counts the round's one host read returned), or read back."""
        self._mirror(self.cache_seqlens.tolist() if lengths is None else list(lengths))

    def restore_lengths(self, lengths: list) -> None:
        """Every request's length set to lengths[b] (host ints), pages past them freed: a drafter dropping the tokens
        its draft steps wrote."""
        self.cache_seqlens.copy_(upload(lengths, torch.int32, self.cache_seqlens.device), non_blocking=True)
        self._mirror(list(lengths))

    def release(self, request: int) -> None:
        """Frees every page of a finished request and sets its length to 0."""
        request = self._request(request, "release")
        self._free.extend(reversed(self._table[request]))
        self._table[request] = []
        self._lengths[request] = 0
        self.cache_seqlens[request].fill_(0)  # no host-to-device copy (that would synchronise)
        self._upload()

    def _mirror(self, lengths: list) -> None:
        """The host's lengths set to the device's, and the pages past them given back."""
        if len(lengths) != self.batch_size:
            raise ValueError(f"PagedKVCache: lengths must have {self.batch_size} entries, got {len(lengths)}")
        self._lengths, self._stale = lengths, False
        freed = False
        for b, length in enumerate(lengths):
            keep_pages = -(-length // self.page_size)
            while len(self._table[b]) > keep_pages:
                self._free.append(self._table[b].pop())
                freed = True
        if freed:
            self._upload()

    def _request(self, b, what: str) -> int:
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < len(self._table):
            raise ValueError(f"PagedKVCache.{what}: request must be an int in [0, {len(self._table)}), got {b!r}")
        return b

    def _upload(self) -> None:
        width = self.block_table.shape[1]
        table = [pages + [-1] * (width - len(pages)) for pages in self._table]
        self.block_table.copy_(upload(table, torch.int32, self.block_table.device), non_blocking=True)


def pad_rows(cache, kept_indices, rows: slice):
    """kept_indices of the requests of `rows` as [batch_size, Q] (-1 elsewhere: nothing moves there)."""
    if kept_indices is None or kept_indices.shape[0] == cache.batch_size:
        return kept_indices
    start, stop, _ = rows.indices(cache.batch_size)
    full = torch.full((cache.batch_size, kept_indices.shape[1]), -1, dtype=torch.int32, device=kept_indices.device)
    full[start:stop] = kept_indices
    return full
