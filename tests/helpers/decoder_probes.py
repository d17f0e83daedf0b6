"""Probes of a decoder under test: what a KV cache holds against a fresh prefill (after every round: CacheCheck),
and the tree paths each round accepted (record_paths)."""
import torch


def fresh_cache_rows(model, tokens, paged):
    """K/V of every layer for `tokens`, from a prefill into a fresh cache: [L, n, Hkv, D] each."""
    cache = model.new_kv_cache(1, len(tokens) + 1)
    model.prefill(cache, [0], [tokens])
    n = len(tokens)
    return cache.k[:, 0, :n], cache.v[:, 0, :n]


def cache_rows(cache, b, n):
    if cache.block_table is None:
        return cache.k[:, b, :n], cache.v[:, b, :n]
    pos = torch.arange(n)
    pages = cache.block_table[b, pos // cache.page_size].long()
    return cache.k[:, pages, pos % cache.page_size], cache.v[:, pages, pos % cache.page_size]


def assert_cache_holds(model, cache, b, tokens) -> None:
    """Request b's rows of `cache` hold the K and V of a fresh prefill of `tokens`, every layer."""
    k, v = cache_rows(cache, b, len(tokens))
    want_k, want_v = fresh_cache_rows(model, tokens, cache.block_table is not None)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v, want_v, rtol=1e-5, atol=1e-5)


class CacheCheck:
    """A `stream` callback for generate(): after every round, request r's target cache holds the K and V of a fresh
    prefill of its tokens but the last (which the next round feeds); more(r, tokens, n) checks what else a test needs
    (a drafter's cache). tokens: each request's prompt and what was streamed; rounds: (request, tokens emitted)."""

    def __init__(self, target, decoder, prompts, more=None):
        self.target, self.decoder, self.more = target, decoder, more
        self.prompts, self.tokens, self.rounds = prompts, [list(p) for p in prompts], []

    def __call__(self, r, new) -> None:
        self.tokens[r] += new
        n = int(self.decoder.cache.cache_seqlens[r])
        assert n == len(self.tokens[r]) - 1
        assert_cache_holds(self.target, self.decoder.cache, r, self.tokens[r][:n])
        if self.more is not None:
            self.more(r, self.tokens[r], n)
        self.rounds.append((r, len(new)))

    def generated(self) -> list:
        return [t[len(p):] for t, p in zip(self.tokens, self.prompts)]


def record_paths(monkeypatch) -> list:
    """Wraps the decoder's tree sampling op: returns the list that each round's accepted paths (node lists from the
    root) are appended to."""
    from specdec_ext.engine import rounds

    paths = []
    op = rounds.tree_speculative_sampling_from_logits

    def recording(*args, **kwargs):
        out = op(*args, **kwargs)
        paths.extend(nodes[:a + 1] for nodes, a in zip(out.accepted_nodes.tolist(), out.num_accepted.tolist()))
        return out

    monkeypatch.setattr(rounds, "tree_speculative_sampling_from_logits", recording)
    return paths
