"""Probes of a decoder under test: what a KV cache holds against a fresh prefill (after every round: CacheCheck),
the tree paths each round accepted (record_paths), and whether a drafter's trees are its best paths
(check_best_paths)."""
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


def check_best_paths(target, drafter, tree: dict, prompts: list, max_new: int, log_probs) -> list:
    """Greedy tree rounds of `drafter` (a dynamic-tree drafter: EAGLE's, the self drafter's), every tree it proposes
    checked against log_probs(r, b, path): the draft's log-probabilities [V] (over target ids, -inf off its draft
    vocabulary) after request b's last token and the tokens `path` below the root, computed as a chain. A node's
    children are among the top-`branching` tokens after its path, and the nodes come in decreasing cumulative
    log-probability under those distributions (what a wrong mask, position or parent in the draft block breaks).
    Which grown candidates the tree keeps is best_tree's, tested on its own. Returns the trees."""
    from specdec_ext import SpeculativeDecoder

    trees = []
    propose_tree = drafter.propose_tree

    def check(r, budget, branching):
        drafted = propose_tree(r, budget, branching)
        for b in range(r.batch):
            n = int(drafted.num_nodes[b])
            parents, tokens = drafted.parents[b].tolist(), drafted.token_ids[b].tolist()
            paths, score = {0: []}, {0: 0.0}
            for c in range(1, n):  # parents come first, so each node's path extends its parent's
                paths[c] = paths[parents[c]] + [tokens[c]]
                logp = log_probs(r, b, paths[parents[c]])
                score[c] = score[parents[c]] + float(logp[tokens[c]])
                assert float(logp[tokens[c]]) >= float(logp.topk(branching).values[-1]) - 1e-5, \
                    "a child outside its parent's top-k"
            ordered = [score[c] for c in range(1, n)]
            assert all(a >= b - 1e-4 for a, b in zip(ordered, ordered[1:])), ordered
        trees.append(drafted)
        return drafted

    drafter.propose_tree = check
    SpeculativeDecoder(target, drafter, adaptive=False, max_batch_size=2, tree=tree).generate(prompts, max_new)
    assert trees and max(int(t.num_nodes.max()) for t in trees) == tree["num_nodes"]
    return trees
