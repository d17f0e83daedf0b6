"""Drafters: what proposes the tokens that the target verifies in a round of speculative decoding.

The protocol (what SpeculativeDecoder calls), over the decoder's request slots [0, max_batch_size):
  bind(target, max_batch_size, capacity, paged)  before a run: check the target, allocate what the drafter keeps
  admit(slots, prefixes)         new requests: each prompt but its last token (which opens the first round)
  propose(round) -> Proposal     up to round.num_tokens[b] tokens for each slot b < round.batch (ragged, 0 allowed)
  rollback(num_accepted)         after the round: keep what the target accepted ([batch] ints), drop the rest
  release(slot)                  a finished request

A Proposal holds draft_token_ids [batch, K] int64 (-padded with valid ids past each row's count), the count per
row, and draft_logits [batch, K, V] (the processed logits the drafts were drawn from: q = softmax(logits / T),
handed to the sampling kernel as they are) or None for point proposals (q one-hot at the draft token).
"""
from dataclasses import dataclass

import numpy as np
import torch

from .graphs import StepGraphs
from .sampling import mask_top_k_top_p, sample_from_logits

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
    any_top_k: bool = False
    any_top_p: bool = False


@dataclass
class Proposal:
    draft_token_ids: torch.Tensor  # [batch, K] int64
    num_draft_tokens: list         # [batch] ints, each <= K and <= what was asked
    draft_logits: torch.Tensor | None = None  # [batch, K, V] float32, or None: point proposals


class NgramDrafter:
    """Prompt lookup: the tokens that followed the most recent earlier occurrence of the longest suffix of the
    request's tokens (prompt + generated), suffixes of max_ngram down to min_ngram tokens. Point proposals."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if isinstance(min_ngram, bool) or not isinstance(min_ngram, int) or not isinstance(max_ngram, int) or \
                not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"NgramDrafter: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.device = torch.device("cpu")

    def bind(self, target, max_batch_size: int, capacity: int, paged: bool, graphs=None) -> None:
        self.device = target.device

    def admit(self, slots: list, prefixes: list) -> None:
        pass

    def release(self, slot: int) -> None:
        pass

    def rollback(self, num_accepted: list) -> None:
        pass

    def lookup(self, tokens, k: int) -> list:
        """Up to k tokens that followed the latest earlier match of the longest suffix (none: [])."""
        if k <= 0:
            return []
        seq = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # every n-gram that has a successor
            hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return seq[start:start + k].tolist()
        return []

    def propose(self, r: RoundInputs) -> Proposal:
        drafts = [self.lookup(h, k) if h is not None else [] for h, k in zip(r.histories, r.num_tokens)]
        width = max(len(d) for d in drafts)
        ids = torch.zeros(r.batch, max(width, 1), dtype=torch.int64)
        for b, d in enumerate(drafts):
            ids[b, :len(d)] = torch.tensor(d, dtype=torch.int64)
        return Proposal(ids[:, :width].to(self.device), [len(d) for d in drafts])


class ModelDrafter:
    """A smaller model of the same vocabulary drafts k tokens per request, one batched forward per token, on its
    own KV cache. Each token is drawn from the processed distribution it reports (the target's temperature,
    top-k and top-p of that request) with its own Philox key, so q in the sampling kernel is the law the
    drafts came from.

    Its cache holds a prefix of each request's tokens: at a round's start every token not yet in it (the last
    emitted one; two after a round whose drafts were all accepted, since the last draft was never fed; more
    after rounds without drafts) is fed in one ragged forward, whose last position gives the first draft."""

    def __init__(self, draft_model):
        self.model = draft_model
        self.cache = None

    def bind(self, target, max_batch_size: int, capacity: int, paged: bool, graphs=None) -> None:
        m = self.model
        self.graphs = graphs or StepGraphs(enabled=False)
        if m.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"ModelDrafter: the draft model's vocabulary has {m.config.vocab_size} tokens, the "
                             f"target's {target.config.vocab_size}: they must be the same")
        if m.device != target.device:
            raise ValueError(f"ModelDrafter: the draft model is on {m.device}, the target on {target.device}")
        if self.cache is None or (self.cache.batch_size, self.capacity, self.paged) != (max_batch_size, capacity, paged):
            self.cache = m.new_kv_cache(max_batch_size, capacity, paged=paged)
            self.capacity, self.paged = capacity, paged
        for b in range(max_batch_size):
            self.cache.release(b)
        self.lengths = [0] * max_batch_size  # host mirror: how many of request b's tokens the cache holds
        self.round = None

    def admit(self, slots: list, prefixes: list) -> None:
        self.model.prefill(self.cache, slots, prefixes)
        for b, p in zip(slots, prefixes):
            self.lengths[b] = len(p)

    def release(self, slot: int) -> None:
        self.cache.release(slot)
        self.lengths[slot] = 0

    def _per_slot(self, counts: dict) -> torch.Tensor:
        full = [0] * self.cache.batch_size
        for b, n in counts.items():
            full[b] = n
        return torch.tensor(full, dtype=torch.int32, device=self.model.device)

    @torch.no_grad()
    def propose(self, r: RoundInputs) -> Proposal:
        device, kmax = self.model.device, max(r.num_tokens)
        rows = range(r.batch)
        pending = [r.histories[b][self.lengths[b]:] if r.histories[b] is not None else None for b in rows]
        width = max(len(p) if p is not None else 1 for p in pending)
        self.cache.reserve([width + kmax] * r.batch, requests=list(rows))
        base = self.cache.cache_seqlens.clone()
        ids = torch.zeros(r.batch, width, dtype=torch.int64)
        for b, p in enumerate(pending):
            if p is not None:
                ids[b, :len(p)] = torch.tensor(p, dtype=torch.int64)
        last = torch.tensor([[len(p) - 1 if p is not None else 0] for p in pending], device=device)
        # Rows padded past their pending tokens write past their length: nothing reads those slots.
        logits = self.model(ids.to(device), self.cache, logits_indices=last, cache_rows=slice(0, r.batch))[:, 0]
        self.cache.advance(self._per_slot({b: len(p) for b, p in enumerate(pending) if p is not None}))
        draft_ids = torch.empty(r.batch, kmax, dtype=torch.int64, device=device)
        draft_logits = torch.empty(r.batch, kmax, logits.shape[-1], dtype=torch.float32, device=device)
        wants = torch.tensor(r.num_tokens, device=device)
        cache_rows = self.cache.batch_size

        def step(logits, offset, grow, feed: bool):
            """Draws a token per row from the processed logits; feeds it (next logits) unless it is the last."""
            masked = mask_top_k_top_p(logits, r.temperature, r.top_k, r.top_p, any_top_k=r.any_top_k,
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
            key = ("draft", r.batch, r.any_top_k, r.any_top_p, feed)
            masked, token, next_logits = self.graphs.run(key, lambda l, o, g: step(l, o, g, feed),
                                                         (logits, r.steps + i, grow),
                                                         state=[self.cache.cache_seqlens])
            draft_ids[:, i], draft_logits[:, i] = token, masked
            logits = next_logits.clone() if feed else logits
        self.round = (base, pending, list(r.num_tokens))
        return Proposal(draft_ids, list(r.num_tokens), draft_logits)

    def rollback(self, num_accepted: list) -> None:
        """Keeps the tokens fed this round that the target accepted: the pending ones and the accepted drafts
        that were fed (every draft but the last is); an idle row keeps nothing."""
        if self.round is None:
            return
        base, pending, asked = self.round
        self.round = None
        kept = {b: len(p) + min(a, max(k - 1, 0)) for b, (p, k, a) in enumerate(zip(pending, asked, num_accepted))
                if p is not None}
        self.cache.cache_seqlens.copy_(base)
        self.cache.truncate(self._per_slot(kept))
        for b, n in kept.items():
            self.lengths[b] += n
