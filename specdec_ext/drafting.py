"""Drafters: what proposes the tokens that the target verifies in a round of speculative decoding.

The protocol (what SpeculativeDecoder calls), over the decoder's request slots [0, max_batch_size):
  bind(target, max_batch_size, capacity, paged, graphs, num_pages)  before a run: check the target, allocate what
                                 the drafter keeps (num_pages: its paged cache's page budget, None: the worst case)
  admit(slots, prefixes, hidden_states=None)  new requests: each prompt but its last token (which opens the first
                                 round), and the target's hidden states of those tokens when the drafter asks
  propose(round) -> Proposal     up to round.num_tokens[b] tokens for each slot b < round.batch (ragged, 0 allowed)
  propose_tree(round, budget, branching) -> DraftTree   tree rounds (EagleDrafter, MedusaDrafter, NgramDrafter): a
                                 tree of at most `budget` nodes (the root included) per slot, no deeper than
                                 round.num_tokens[b], best nodes first (specdec_ext.trees)
  rollback(num_accepted, hidden_states=None)  after every round: keep what the target accepted ([batch] ints, -1
                                 for a row without a request), drop the rest; hidden_states [batch, Q, H]: the
                                 target's, of the round's block (after a tree round: of the accepted path's nodes,
                                 in path order, so a path reads as a chain of num_accepted drafts)
  release(slot)                  a finished request
A drafter whose needs_hidden_states is True (the trained heads) gets the target's last-layer hidden states, which
the target's forwards return alongside the logits (no second pass).

A Proposal holds draft_token_ids [batch, K] int64 (-padded with valid ids past each row's count), the count per
row, and draft_logits [batch, K, V] (the processed logits the drafts were drawn from: q = softmax(logits / T),
handed to the sampling kernel as they are) or None for point proposals (q one-hot at the draft token).
"""
from dataclasses import dataclass

import numpy as np
import torch

from .graphs import StepGraphs
from .sampling import mask_top_k_top_p, sample_from_logits
from .trees import Candidates, DraftTree, ancestor_mask, best_tree, last_tokens, trie

# The draft model's Philox key is the request's seed XOR this (the golden-ratio constant as a signed int64), so its
# draws never reuse the target's; its counter is the position of the drafted token (tokens generated before it).
DRAFT_KEY = 0x9E3779B97F4A7C15 - 2**64


@dataclass
class RoundInputs:
    """What a drafter sees of a round: rows [0, batch) of the decoder's slots."""
    batch: int
    num_tokens: list        # [batch] ints: how many tokens to propose for each row (0 for idle rows)
    histories: list         # [batch] token lists (prompt + generated; None for idle rows)
    temperature: torch.Tensor  # [batch] float32 on the device, and top_k [batch] int64, top_p [batch] float32
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor      # [batch] int64: the requests' seeds
    steps: torch.Tensor     # [batch] int64: tokens generated so far (the Philox counter of this round)
    max_top_k: int = 0      # the largest top_k of a sampled request (0: none), and whether one has top_p < 1
    any_top_p: bool = False


@dataclass
class Proposal:
    draft_token_ids: torch.Tensor  # [batch, K] int64
    num_draft_tokens: list         # [batch] ints, each <= K and <= what was asked
    draft_logits: torch.Tensor | None = None  # [batch, K, V] float32, or None: point proposals


def per_slot(counts: dict, cache) -> torch.Tensor:
    """{slot: count} as a [cache.batch_size] int32 tensor on the cache's device (0 elsewhere): what advance and
    truncate take."""
    full = [0] * cache.batch_size
    for b, n in counts.items():
        full[b] = n
    return torch.tensor(full, dtype=torch.int32, device=cache.cache_seqlens.device)


class NgramDrafter:
    """Prompt lookup: the tokens that followed the most recent earlier occurrence of the longest suffix of the
    request's tokens (prompt + generated), suffixes of max_ngram down to min_ngram tokens. Point proposals."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if isinstance(min_ngram, bool) or not isinstance(min_ngram, int) or not isinstance(max_ngram, int) or \
                not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"NgramDrafter: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.device = torch.device("cpu")

    def bind(self, target, max_batch_size: int, capacity: int, paged: bool, graphs=None, num_pages=None) -> None:
        self.device = target.device

    needs_hidden_states = False

    def admit(self, slots: list, prefixes: list, hidden_states=None) -> None:
        pass

    def release(self, slot: int) -> None:
        pass

    def rollback(self, num_accepted: list, hidden_states=None) -> None:
        pass

    def lookup(self, tokens, k: int) -> list:
        """Up to k tokens that followed the latest earlier match of the longest suffix (none: [])."""
        found = self.continuations(tokens, k, 1)
        return found[0] if found else []

    def continuations(self, tokens, k: int, count: int) -> list:
        """Up to `count` lists of up to k tokens: what followed earlier matches of the request's suffixes, the
        longest suffix first and its latest match first; each earlier position once (a match of a long suffix
        also matches the shorter ones)."""
        if k <= 0:
            return []
        seq = np.asarray(tokens, dtype=np.int64)
        found, starts = [], set()
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            # hits[i]: the n-gram at i (every one that has a successor) is the suffix; built one offset at a time,
            # n vector compares, where a window view's fixed cost dwarfs a short history's whole lookup.
            m = len(seq) - n
            hits = seq[:m] == seq[-n]
            for j in range(1, n):
                hits &= seq[j:j + m] == seq[j - n]
            for start in np.flatnonzero(hits)[::-1] + n:
                if len(found) == count:
                    return found
                if start not in starts:
                    starts.add(start)
                    found.append(seq[start:start + k].tolist())
        return found

    def propose(self, r: RoundInputs) -> Proposal:
        drafts = [self.lookup(h, k) if h is not None else [] for h, k in zip(r.histories, r.num_tokens)]
        width = max(len(d) for d in drafts)
        # One tensor from padded host lists (0, a valid id, past each row's count), not a copy per row.
        ids = torch.tensor([d + [0] * (width - len(d)) for d in drafts], dtype=torch.int64).reshape(r.batch, width)
        return Proposal(ids.to(self.device), [len(d) for d in drafts])

    def propose_tree(self, r: RoundInputs, budget: int, branching: int) -> DraftTree:
        """The trie of up to `branching` continuations (see continuations), each node scored by how many of them
        pass through it (ties: the longer, later match first). Point proposals."""
        tries = [trie(self.continuations(h, k, branching)) if h is not None else ([], [], [])
                 for h, k in zip(r.histories, r.num_tokens)]
        width = max(len(t[0]) for t in tries)
        pad = lambda values, fill: [v + [fill] * (width - len(v)) for v in values]  # one tensor each, not one per row
        parents = torch.tensor(pad([p for p, _, _ in tries], 0), dtype=torch.int64).reshape(r.batch, width)
        tokens = torch.tensor(pad([t for _, t, _ in tries], 0), dtype=torch.int64).reshape(r.batch, width)
        scores = torch.tensor(pad([c for _, _, c in tries], float("-inf")), dtype=torch.float32).reshape(r.batch, width)
        return best_tree(parents.to(self.device), tokens.to(self.device), scores.to(self.device),
                         last_tokens(r.histories, self.device), budget)


class ModelDrafter:
    """A smaller model of the same vocabulary drafts k tokens per request, one batched forward per token, on its
    own KV cache. Each token is drawn from the processed distribution it reports (the target's temperature,
    top-k and top-p of that request) with its own Philox key, so q in the sampling kernel is the law the
    drafts came from.

    Its cache holds a prefix of each request's tokens: at a round's start every token not yet in it (the last
    emitted one; two after a round whose drafts were all accepted, since the last draft was never fed; more
    after rounds without drafts) is fed in one ragged forward, whose last position gives the first draft."""

    needs_hidden_states = False

    def __init__(self, draft_model):
        self.model = draft_model
        self.cache = None

    def bind(self, target, max_batch_size: int, capacity: int, paged: bool, graphs=None, num_pages=None) -> None:
        m = self.model
        self.graphs = graphs or StepGraphs(enabled=False)
        if m.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"ModelDrafter: the draft model's vocabulary has {m.config.vocab_size} tokens, the "
                             f"target's {target.config.vocab_size}: they must be the same")
        if m.device != target.device:
            raise ValueError(f"ModelDrafter: the draft model is on {m.device}, the target on {target.device}")
        if self.cache is None or (self.cache.batch_size, self.capacity, self.paged, self.num_pages) != \
                (max_batch_size, capacity, paged, num_pages):
            self.cache = None
            self.cache = m.new_kv_cache(max_batch_size, capacity, paged=paged, num_pages=num_pages)
            self.capacity, self.paged, self.num_pages = capacity, paged, num_pages
        for b in range(max_batch_size):
            self.cache.release(b)
        self.lengths = [0] * max_batch_size  # host mirror: how many of request b's tokens the cache holds
        self.round = None

    def admit(self, slots: list, prefixes: list, hidden_states=None) -> None:
        self.model.prefill(self.cache, slots, prefixes)
        for b, p in zip(slots, prefixes):
            self.lengths[b] = len(p)

    def release(self, slot: int) -> None:
        self.cache.release(slot)
        self.lengths[slot] = 0

    @torch.no_grad()
    def propose(self, r: RoundInputs) -> Proposal:
        device, kmax = self.model.device, max(r.num_tokens)
        rows = range(r.batch)
        pending = [r.histories[b][self.lengths[b]:] if r.histories[b] is not None else None for b in rows]
        width = max(len(p) if p is not None else 1 for p in pending)
        self.cache.reserve([width + kmax] * r.batch, requests=list(rows))
        base = self.cache.cache_seqlens.clone()
        # One tensor from padded host lists, not a copy per row.
        ids = torch.tensor([(p or []) + [0] * (width - len(p or [])) for p in pending], dtype=torch.int64)
        last = torch.tensor([[len(p) - 1 if p is not None else 0] for p in pending], device=device)
        # Rows padded past their pending tokens write past their length: nothing reads those slots.
        logits = self.model(ids.to(device), self.cache, logits_indices=last, cache_rows=slice(0, r.batch))[:, 0]
        self.cache.advance(per_slot({b: len(p) for b, p in enumerate(pending) if p is not None}, self.cache))
        draft_ids = torch.empty(r.batch, kmax, dtype=torch.int64, device=device)
        draft_logits = torch.empty(r.batch, kmax, logits.shape[-1], dtype=torch.float32, device=device)
        wants = torch.tensor(r.num_tokens, device=device)
        cache_rows = self.cache.batch_size

        def step(logits, offset, grow, feed: bool):
            """Draws a token per row from the processed logits; feeds it (next logits) unless it is the last."""
            masked = mask_top_k_top_p(logits, r.temperature, r.top_k, r.top_p, max_top_k=r.max_top_k,
                                      any_top_p=r.any_top_p)
            token = sample_from_logits(masked, r.temperature, r.seed ^ DRAFT_KEY, offset).long()
            if not feed:
                return masked, token, logits
            logits = self.model(token.unsqueeze(1), self.cache, cache_rows=slice(0, r.batch))[:, 0]
            full = torch.zeros(cache_rows, dtype=torch.int32, device=device)
            full[:r.batch] = grow
            self.cache.advance(full)
            return masked, token, logits

        for i in range(kmax):
            feed = i + 1 < kmax
            grow = (wants > i + 1).int()  # rows that draft token i + 2 keep token i + 1
            key = ("draft", r.batch, r.max_top_k, r.any_top_p, feed)
            masked, token, next_logits = self.graphs.run(key, lambda l, o, g: step(l, o, g, feed),
                                                         (logits, r.steps + i, grow),
                                                         state=[self.cache.cache_seqlens])
            draft_ids[:, i], draft_logits[:, i] = token, masked
            logits = next_logits.clone() if feed else logits
        self.round = (base, pending, list(r.num_tokens))
        return Proposal(draft_ids, list(r.num_tokens), draft_logits)

    def rollback(self, num_accepted: list, hidden_states=None) -> None:
        """Keeps the tokens fed this round that the target accepted: the pending ones and the accepted drafts
        that were fed (every draft but the last is); an idle row keeps nothing. Nothing to do after a round
        without drafts: the tokens wait in the history for the next propose."""
        if self.round is None:
            return
        base, pending, asked = self.round
        self.round = None
        kept = {b: len(p) + min(a, max(k - 1, 0)) for b, (p, k, a) in enumerate(zip(pending, asked, num_accepted))
                if p is not None}
        self.cache.cache_seqlens.copy_(base)
        self.cache.truncate(per_slot(kept, self.cache))
        for b, n in kept.items():
            self.lengths[b] += n


def draw_from_draft_vocab(logits: torch.Tensor, draft_vocab: torch.Tensor, vocab_size: int, r: RoundInputs,
                          offset: torch.Tensor):
    """Logits over a draft vocabulary [B, Vd] -> (processed logits over the full vocabulary [B, V], -inf outside
    the draft vocabulary, and the token drawn from them [B] int64): q is zero outside it."""
    full = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
    full[:, draft_vocab] = logits
    masked = mask_top_k_top_p(full, r.temperature, r.top_k, r.top_p, max_top_k=r.max_top_k, any_top_p=r.any_top_p)
    return masked, sample_from_logits(masked, r.temperature, r.seed ^ DRAFT_KEY, offset).long()


class EagleDrafter:
    """Drafts with an EagleHead (specdec_ext.models.draft_heads) on the target's own hidden states.

    The head's cache holds pairs (feature of token j, token j + 1) whose features are the target's. A prompt's
    pairs are fed at admission; at a round's start every pair not yet in it is fed in one ragged forward (the
    features the target's last verify block returned); its last output gives the first draft, and each later
    draft step feeds the head's own predicted feature with the token just drafted. Those draft-step pairs are dropped after the round: the next
    round feeds the target's features of whatever was accepted instead."""

    needs_hidden_states = True

    def __init__(self, target, head):
        from .models.draft_heads import check_target

        check_target(head.target_config, target, "EagleDrafter")
        self.target, self.head = target, head
        self.cache = None

    def bind(self, target, max_batch_size: int, capacity: int, paged: bool, graphs=None, num_pages=None) -> None:
        if target is not self.target:
            raise ValueError("EagleDrafter: made for another target model than the decoder's")
        if self.cache is None or (self.cache.batch_size, self.capacity, self.paged, self.num_pages) != \
                (max_batch_size, capacity, paged, num_pages):
            self.cache = None
            self.cache = self.head.decoder.new_kv_cache(max_batch_size, capacity, paged=paged, num_pages=num_pages)
            self.capacity, self.paged, self.num_pages = capacity, paged, num_pages
        for b in range(max_batch_size):
            self.cache.release(b)
        self.lengths = [0] * max_batch_size  # pairs in the head's cache
        self.pending = [[] for _ in range(max_batch_size)]  # target features not yet fed: [n, H] tensors
        self.base = None

    @torch.no_grad()
    def admit(self, slots: list, prefixes: list, hidden_states=None) -> None:
        """Feeds each prefix's pairs whose two halves it holds; the last feature waits for the token after the
        prefix. So a round's ragged forward is at most k + 1 wide and its padded rows stay inside the cache (a
        prompt's width there could run a row near its end past it). One forward per run of consecutive slots
        whose prefixes have one length, as the target's prefill: no row is padded, and admitting a batch costs
        a forward per distinct length, not one per request."""
        device = self.target.device
        for b, h in zip(slots, hidden_states):
            self.lengths[b], self.pending[b] = 0, [h[-1:]] if len(h) else []
        i = 0
        while i < len(slots):
            j, n = i, len(hidden_states[i]) - 1  # the pairs of slot i's prefix
            while j + 1 < len(slots) and slots[j + 1] == slots[j] + 1 and len(hidden_states[j + 1]) - 1 == n:
                j += 1
            if n > 0:
                rows = slots[i:j + 1]
                self.cache.reserve([n] * len(rows), requests=rows)
                tokens = torch.tensor([p[1:] for p in prefixes[i:j + 1]], dtype=torch.int64, device=device)
                features = torch.stack([h[:-1] for h in hidden_states[i:j + 1]])
                self.head(tokens, features, self.cache, cache_rows=slice(rows[0], rows[-1] + 1),
                          logits_indices=torch.tensor([n - 1], device=device))
                self.cache.advance(per_slot(dict.fromkeys(rows, n), self.cache))
                for b in rows:
                    self.lengths[b] = n
            i = j + 1

    def release(self, slot: int) -> None:
        self.cache.release(slot)
        self.lengths[slot], self.pending[slot] = 0, []

    def feed_pending(self, r: RoundInputs, block: int):
        """Feeds every row's pending pairs in one ragged forward, with room for a draft block of `block` slots per
        row after them. Returns (rows' counts of tokens asked, 0 for a row without a feature yet; the logits of
        the token after the last emitted one [B, Vd]; the head's feature of the last emitted token [B, 1, H])."""
        device = self.target.device
        live = [r.histories[b] is not None and bool(self.pending[b]) for b in range(r.batch)]
        counts = [sum(len(f) for f in self.pending[b]) if live[b] else 0 for b in range(r.batch)]
        # A request whose prompt is one token has no feature yet: it drafts from the next round on.
        asked = [k if n else 0 for k, n in zip(r.num_tokens, counts)]
        width = max(max(counts), 1)
        self.cache.reserve([width + block] * r.batch, requests=list(range(r.batch)))
        # Assembled with a constant number of tensor ops, whatever the batch (a round runs at every batch size).
        padded = [[0] * width for _ in range(r.batch)]
        for b, n in enumerate(counts):
            if n:
                start = self.lengths[b] + 1  # pair j joins feature j with token j + 1
                padded[b][:n] = r.histories[b][start:start + n]
        tokens = torch.tensor(padded, dtype=torch.int64)
        features = torch.zeros(r.batch, width, self.target.config.hidden_size, dtype=self.target.dtype, device=device)
        if any(counts):
            queued = torch.cat([f for b in range(r.batch) if live[b] for f in self.pending[b]])  # rows in slot order
            count = torch.tensor(counts, device=device)
            row = torch.repeat_interleave(torch.arange(r.batch, device=device), count)
            column = torch.arange(len(queued), device=device) - torch.repeat_interleave(count.cumsum(0) - count, count)
            features[row, column] = queued
        last = torch.tensor([[max(n - 1, 0)] for n in counts], device=device)
        logits, hidden = self.head(tokens.to(device), features, self.cache, cache_rows=slice(0, r.batch),
                                   logits_indices=last)
        feature = hidden.gather(1, last.unsqueeze(-1).expand(-1, 1, hidden.shape[-1]))  # [B, 1, H]
        self.cache.advance(per_slot(dict(enumerate(counts)), self.cache))
        for b, n in enumerate(counts):
            self.lengths[b] += n
            self.pending[b] = []
        self.base = self.cache.cache_seqlens.clone()
        return asked, logits[:, 0], feature

    @torch.no_grad()
    def propose(self, r: RoundInputs) -> Proposal:
        device, vocab = self.target.device, self.target.config.vocab_size
        kmax = max(r.num_tokens)
        asked, logits, feature = self.feed_pending(r, kmax)
        kmax = max(asked)
        draft_ids = torch.zeros(r.batch, kmax, dtype=torch.int64, device=device)
        draft_logits = torch.empty(r.batch, kmax, vocab, dtype=torch.float32, device=device)
        wants = torch.tensor(asked, device=device)
        for i in range(kmax):
            masked, token = draw_from_draft_vocab(logits, self.head.draft_vocab, vocab, r, r.steps + i)
            draft_ids[:, i], draft_logits[:, i] = token, masked
            if i + 1 < kmax:
                logits, feature = self.head(token.unsqueeze(1), feature, self.cache, cache_rows=slice(0, r.batch))
                logits = logits[:, 0]
                grow = torch.zeros(self.cache.batch_size, dtype=torch.int32, device=device)
                grow[:r.batch] = (wants > i + 1).int()
                self.cache.advance(grow)
        return Proposal(draft_ids, asked, draft_logits)

    @torch.no_grad()
    def propose_tree(self, r: RoundInputs, budget: int, branching: int) -> DraftTree:
        """EAGLE-2's dynamic tree (Li et al. 2024): the top-`branching` tokens of the head after the last emitted
        token are the first layer; then, for each further depth, the `branching` best nodes of the last layer (by
        cumulative draft log-probability) are fed to the head in one forward and their top-`branching` tokens
        become the next layer. Finally the best budget - 1 nodes of all layers make the tree (a node's ancestors
        score higher, so they are in it). Point proposals: the children are deterministic, so the tree sampling
        op tests each against the target in turn.

        Each forward feeds every node expanded so far as one draft block after the head's cache, under a tree
        mask (a node sees the cache and its ancestors; its position is the cache length + its depth), and never
        advances the cache: the block is dropped at rollback, which queues the target's features of the
        accepted path instead, as after a chain round."""
        device, vocab = self.target.device, self.head.draft_vocab
        k = min(branching, len(vocab))
        asked, logits, feature = self.feed_pending(r, (max(r.num_tokens) - 1) * k)
        depth = max(asked)
        deepest = torch.tensor(asked, device=device).unsqueeze(-1)  # [B, 1]: a row's tree goes this deep (0: none)
        nodes = Candidates(r.batch, device)
        top = logits.log_softmax(-1).topk(k)
        layer_scores = torch.where(deepest >= 1, top.values, float("-inf"))  # [B, m]: the layer's candidates
        layer_tokens = vocab[top.indices]
        layer = nodes.add(torch.zeros_like(top.indices), layer_tokens, layer_scores)
        frontier = torch.arange(k, device=device).expand(r.batch, k)  # the layer's nodes to expand (all of the first)
        inputs_feature = feature.expand(-1, k, -1)  # a pair joins the parent's predicted feature with the node's token
        parent_slot = torch.full((r.batch, k), -1, device=device)  # the parent's slot in the draft block (-1: root)
        block_tokens, block_features, block_parents = [], [], []
        for d in range(1, depth):
            block_tokens.append(layer_tokens.gather(1, frontier))
            block_features.append(inputs_feature)
            block_parents.append(parent_slot)
            parents = torch.cat(block_parents, 1)
            fed = (d - 1) * k  # the block's slots before this depth's
            logits, hidden = self.head(torch.cat(block_tokens, 1), torch.cat(block_features, 1), self.cache,
                                       cache_rows=slice(0, r.batch), tree_mask=ancestor_mask(parents),
                                       logits_indices=torch.arange(fed, fed + k, device=device))
            top = logits.log_softmax(-1).topk(k)  # [B, k expanded, k children]
            scores = (layer_scores.gather(1, frontier).unsqueeze(-1) + top.values).flatten(1)
            layer_scores = torch.where(deepest > d, scores, float("-inf"))
            layer_tokens = vocab[top.indices].flatten(1)
            layer = nodes.add(layer.gather(1, frontier).repeat_interleave(k, 1), layer_tokens, layer_scores)
            frontier = layer_scores.topk(k).indices
            expanded = frontier // k  # which fed node of this depth each new frontier node is a child of
            inputs_feature = hidden[:, fed:fed + k].gather(1, expanded.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
            parent_slot = fed + expanded
        return nodes.best_tree(last_tokens(r.histories, device), budget)

    def rollback(self, num_accepted: list, hidden_states=None) -> None:
        """Drops the draft-step pairs; queues the target's features of the round's accepted tokens (the last
        emitted token's and the accepted drafts')."""
        if self.base is not None:
            self.cache.cache_seqlens.copy_(self.base)
            self.cache.free_unused_pages()
            self.base = None
        for b, a in enumerate(num_accepted):
            if a >= 0:
                self.pending[b].append(hidden_states[b, :a + 1])


class MedusaDrafter:
    """Drafts with MedusaHeads from the target's hidden state of the last scored token (the one whose logits
    drew the request's last token): head i proposes the token i + 1 places after it, all heads at once, one
    proposal chain per round. k is at most the number of heads."""

    needs_hidden_states = True

    def __init__(self, target, heads):
        from .models.draft_heads import check_target

        check_target(heads.target_config, target, "MedusaDrafter")
        self.target, self.heads = target, heads

    def bind(self, target, max_batch_size: int, capacity: int, paged: bool, graphs=None, num_pages=None) -> None:
        if target is not self.target:
            raise ValueError("MedusaDrafter: made for another target model than the decoder's")
        self.features = [None] * max_batch_size  # [H]: the target's feature of the last scored token

    def admit(self, slots: list, prefixes: list, hidden_states=None) -> None:
        for b, h in zip(slots, hidden_states):
            self.features[b] = h[-1] if len(h) else None

    def release(self, slot: int) -> None:
        self.features[slot] = None

    def head_logits(self, r: RoundInputs):
        """(tokens asked per row, at most the number of heads and 0 for a row without a feature; the heads'
        logits [B, heads, Vd])."""
        device = self.target.device
        asked = [min(k, self.heads.num_heads) if r.histories[b] is not None and self.features[b] is not None else 0
                 for b, k in enumerate(r.num_tokens)]
        features = torch.stack([self.features[b] if self.features[b] is not None else
                                torch.zeros(self.target.config.hidden_size, dtype=self.target.dtype, device=device)
                                for b in range(r.batch)])
        return asked, self.heads(features)

    @torch.no_grad()
    def propose(self, r: RoundInputs) -> Proposal:
        device, vocab = self.target.device, self.target.config.vocab_size
        asked, logits = self.head_logits(r)  # [B, heads, Vd]
        kmax = max(asked)
        draft_ids = torch.zeros(r.batch, kmax, dtype=torch.int64, device=device)
        draft_logits = torch.empty(r.batch, kmax, vocab, dtype=torch.float32, device=device)
        for i in range(kmax):
            masked, token = draw_from_draft_vocab(logits[:, i], self.heads.draft_vocab, vocab, r, r.steps + i)
            draft_ids[:, i], draft_logits[:, i] = token, masked
        return Proposal(draft_ids, asked, draft_logits)

    @torch.no_grad()
    def propose_tree(self, r: RoundInputs, budget: int, branching: int) -> DraftTree:
        """Medusa's candidate tree: the nodes at depth d + 1 are the paths through head d's top-`branching`
        tokens, scored by the product of the heads' probabilities along them; the best budget - 1 prefixes make
        the tree. Grown depth by depth, keeping the best budget - 1 of each (no other can be among the best
        overall). Point proposals."""
        device, vocab = self.target.device, self.heads.draft_vocab
        asked, logits = self.head_logits(r)
        deepest = torch.tensor(asked, device=device).unsqueeze(-1)
        top = logits[:, :max(asked)].log_softmax(-1).topk(min(branching, len(vocab)))  # [B, depth, k]
        k = top.indices.shape[-1]
        nodes = Candidates(r.batch, device)
        layer = torch.zeros(r.batch, 1, dtype=torch.long, device=device)  # the root
        layer_scores = torch.zeros(r.batch, 1, device=device)
        for d in range(max(asked)):
            scores = (layer_scores.unsqueeze(-1) + top.values[:, d].unsqueeze(1)).flatten(1)  # [B, m * k]
            scores = torch.where(deepest > d, scores, float("-inf"))
            keep = scores.topk(min(budget - 1, scores.shape[1])).indices
            tokens = vocab[top.indices[:, d]].repeat(1, layer.shape[1])
            layer_scores = scores.gather(1, keep)
            layer = nodes.add(layer.repeat_interleave(k, 1).gather(1, keep), tokens.gather(1, keep), layer_scores)
        return nodes.best_tree(last_tokens(r.histories, device), budget)

    def rollback(self, num_accepted: list, hidden_states=None) -> None:
        for b, a in enumerate(num_accepted):
            if a >= 0:
                self.features[b] = hidden_states[b, a]
