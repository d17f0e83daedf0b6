"""Prompt lookup (n-gram) drafting: the request's own tokens are the draft model."""

import numpy as np
import torch

from ..trees import best_tree, last_tokens, trie
from .base import Drafter, Proposal, RoundInputs, padded
from .registry import DrafterEntry, no_value, register_drafter


class NgramDrafter(Drafter):
    """Prompt lookup: the tokens that followed the most recent earlier occurrence of the longest suffix of the
    request's tokens (prompt + generated), suffixes of max_ngram down to min_ngram tokens. Point proposals; trees
    are the trie of several such continuations."""

    supports_trees = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if isinstance(min_ngram, bool) or not isinstance(min_ngram, int) or not isinstance(max_ngram, int) or \
                not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"NgramDrafter: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.device = torch.device("cpu")

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
        return Proposal(padded(drafts, 0, torch.int64, self.device), [len(d) for d in drafts])

    def propose_tree(self, r: RoundInputs, budget: int, branching: int):
        """The trie of up to `branching` continuations (see continuations), each node scored by how many of them
        pass through it (ties: the longer, later match first). Point proposals."""
        tries = [trie(self.continuations(h, k, branching)) if h is not None else ([], [], [])
                 for h, k in zip(r.histories, r.num_tokens)]
        parents = padded([p for p, _, _ in tries], 0, torch.int64, self.device)
        tokens = padded([t for _, t, _ in tries], 0, torch.int64, self.device)
        scores = padded([c for _, _, c in tries], float("-inf"), torch.float32, self.device)
        return best_tree(parents, tokens, scores, last_tokens(r.histories, self.device), budget)

    def cost_probe(self):
        """One lookup per row over a 512-token history of random tokens (a miss scans every suffix: the worst case)
        and the upload of the drafts: one step per round, whatever k."""
        history = np.random.default_rng(0).integers(0, 32000, 512).tolist()
        def step(rows):
            return padded([self.lookup(history, 8) for _ in range(rows)], 0, torch.int64, self.device)
        key = {"drafter": "ngram", "max_ngram": self.max_ngram, "min_ngram": self.min_ngram}
        return key, lambda rows: (lambda: step(rows))


# --------------------------------------------------------------------------------- its command-line spelling

register_drafter(DrafterEntry(
    name="ngram", drafter_class=NgramDrafter, syntax="ngram", help="n-gram prompt lookup", parse=no_value,
    build=lambda target: NgramDrafter(), drafts_from_the_text=True))
