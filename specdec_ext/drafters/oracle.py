"""A drafter at a set acceptance, for measuring the round itself: it knows what the target will emit.

The speedup of speculative decoding mixes two things: how often the drafter is right, and what the round costs
around the drafts (the verify forward, sampling, truncation, host work, draft steps). OracleDrafter fixes the first
so that a benchmark measures the second. It is given the output of plain decoding of the same requests (greedy, or
sampling="invariant", whose tokens speculative decoding must reproduce) and proposes its next tokens, each replaced
independently by a wrong token with probability 1 - acceptance. With a draft model it also runs that model's real
draft steps (its cache and CUDA graphs) and discards their tokens, so the draft cost is a real model's.

Chain rounds then accept a draft exactly while the proposals are right: tokens per round (accepted + 1) has mean
(1 - a^(k+1)) / (1 - a) for k drafts at acceptance a (Leviathan et al.), since each position's fate is decided once,
independently of the round it is drafted in (the uniform of (seed, request, position)). Tree rounds propose the
reference path, each node wrong with probability 1 - a as in a chain, plus wrong siblings below it: the accepted
depth follows the chain's law, the siblings add verify work only.

A wrong token is never accepted by greedy or Gumbel-coupled verification (the target emits the reference token
there). Under rejection sampling of sampled requests a point proposal is accepted with the target's probability of
it, so the acceptance is not the oracle's: measure greedy or sampling="invariant".
"""
import numpy as np
import torch

from ..trees import best_tree, last_tokens
from .base import Drafter, Proposal, RoundFeedback, RoundInputs, padded


class OracleDrafter(Drafter):
    """Proposes the continuation of a reference run, each token wrong with probability 1 - acceptance.

    Parameters
    ----------
    reference_tokens : list of lists of int
        Per request, in the order the requests are given to generate: its prompt followed by what plain decoding
        emitted for it (`generate_autoregressive(...).sequences[i]`, same sampling parameters and seeds).
    acceptance : float
        The probability that each proposed token is the reference's, in [0, 1].
    seed : int
        Which tokens are wrong: position j of request i is wrong when the uniform of (seed, i, j) is >= acceptance,
        whatever the batch, k or round it is drafted in.
    draft_model : LlamaForCausalLM or None
        A model of the target's vocabulary whose draft steps run for their cost (a ModelDrafter's: its own cache,
        one forward per drafted token, CUDA graphs on CUDA); its tokens are discarded. Tree rounds run its chain of
        the tree's depth (one row per request per step). None: no draft cost.

    Requests are matched to references in the order the decoder admits them (first come, first served), and each
    admitted prompt is checked against its reference's. Point proposals (no draft logits).

    Examples
    --------
    >>> from specdec_ext.engine import SpeculativeDecoder, generate_autoregressive
    >>> plain = generate_autoregressive(model, prompts, 64).sequences                      # doctest: +SKIP
    >>> oracle = OracleDrafter([p + s for p, s in zip(prompts, plain)], acceptance=0.8)    # doctest: +SKIP
    >>> out = SpeculativeDecoder(model, oracle, 4, adaptive=False).generate(prompts, 64)  # doctest: +SKIP
    >>> out.sequences == plain                                                             # doctest: +SKIP
    True
    """

    supports_trees = True

    def __init__(self, reference_tokens, acceptance: float, seed: int = 0, draft_model=None):
        if not isinstance(reference_tokens, (list, tuple)) or not reference_tokens or \
                not all(isinstance(t, (list, tuple)) and len(t) >= 1 for t in reference_tokens):
            raise ValueError("OracleDrafter: reference_tokens must be a non-empty list of token lists (each request's "
                             "prompt and plain decoding's tokens)")
        if isinstance(acceptance, bool) or not isinstance(acceptance, (int, float)) or not 0 <= acceptance <= 1:
            raise ValueError(f"OracleDrafter: acceptance must be a number in [0, 1], got {acceptance!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"OracleDrafter: seed must be a non-negative int, got {seed!r}")
        self.reference = [list(map(int, t)) for t in reference_tokens]
        self.acceptance, self.seed = float(acceptance), seed
        self.inner = None
        if draft_model is not None:
            from .model import ModelDrafter

            self.inner = ModelDrafter(draft_model)
        self.device = torch.device("cpu")

    # ------------------------------------------------------------------------------------------ the protocol
    def bind(self, target, slots: int, capacity: int, *, paged: bool = False, num_pages=None,
             cuda_graphs: bool = False) -> None:
        self.vocab_size = target.config.vocab_size
        if self.vocab_size <= self.MAX_SIBLINGS + 1:
            raise ValueError(f"OracleDrafter: the target's vocabulary ({self.vocab_size}) must have more than "
                             f"{self.MAX_SIBLINGS + 1} tokens")
        if max(max(t) for t in self.reference) >= self.vocab_size:
            raise ValueError(f"OracleDrafter: reference_tokens hold ids past the target's vocabulary "
                             f"({self.vocab_size})")
        self.device = target.device
        self.admitted = 0  # requests admitted this run: the next admission's reference
        self.slot_request = [None] * slots  # the reference index of the request in each slot
        self.candidates = {}  # request -> [len, MAX_SIBLINGS + 1] int64 (_candidates), made at admission
        if self.inner is not None:
            self.inner.bind(target, slots, capacity, paged=paged, num_pages=num_pages, cuda_graphs=cuda_graphs)

    def admit(self, slots: list, prefixes: list, hidden_states=None) -> None:
        for b, prefix in zip(slots, prefixes):
            i = self.admitted
            if i >= len(self.reference) or self.reference[i][:len(prefix)] != list(prefix):
                raise ValueError(f"OracleDrafter: request {i} (admitted into slot {b}) does not start as reference "
                                 f"{i}: give the references in the order of generate's prompts")
            self.admitted += 1
            self.slot_request[b] = i
            self.candidates[i] = self._candidates(i)
        if self.inner is not None:
            self.inner.admit(slots, prefixes, hidden_states)

    def release(self, slot: int) -> None:
        self.candidates.pop(self.slot_request[slot], None)
        self.slot_request[slot] = None
        if self.inner is not None:
            self.inner.release(slot)

    def propose(self, r: RoundInputs) -> Proposal:
        if self.inner is not None:
            self.inner.propose(r)  # its cost; its tokens and logits discarded
        drafts = [self._chain(b, h, k) for b, (h, k) in enumerate(zip(r.histories, r.num_tokens))]
        return Proposal(padded(drafts, 0, torch.int64, self.device), [len(d) for d in drafts])

    def propose_tree(self, r: RoundInputs, budget: int, branching: int):
        """The reference path as a chain proposes it (each node wrong with probability 1 - a), then wrong siblings
        of its nodes, shallowest first, up to `branching` children per node and budget - 1 nodes below the root."""
        if self.inner is not None:
            self.inner.propose(r)
        parents, tokens, scores = [], [], []
        for b, (h, k) in enumerate(zip(r.histories, r.num_tokens)):
            path = self._chain(b, h, k)
            # Scores: the path first (every path node above every sibling), then siblings shallowest first; a node
            # never scores above its parent, as best_tree needs.
            n = len(path)
            p, t, s = list(range(n)), list(path), [-float(d) for d in range(1, n + 1)]
            candidates = self.candidates[self.slot_request[b]] if path else None
            for depth in range(1, n + 1):  # candidate `depth` is the path node at that depth
                pos = len(h) + depth - 1
                for j in range(min(branching - 1, self.MAX_SIBLINGS)):
                    if len(t) >= budget - 1:
                        break
                    p.append(depth - 1)  # a sibling of path node `depth`: a child of its parent
                    t.append(int(candidates[pos, j + 1]))  # never the path node's token (distinct offsets)
                    s.append(-n - depth - j / branching)
            parents.append(p)
            tokens.append(t)
            scores.append(s)
        return best_tree(padded(parents, 0, torch.int64, self.device), padded(tokens, 0, torch.int64, self.device),
                         padded(scores, float("-inf"), torch.float32, self.device),
                         last_tokens(r.histories, self.device), budget)

    def rollback(self, feedback: RoundFeedback) -> None:
        if self.inner is not None:
            self.inner.rollback(feedback)

    def cache_margin(self, k_max: int, tree=None) -> int:
        return self.inner.cache_margin(k_max, tree) if self.inner is not None else 0

    def draft_work(self, k: int, tree=None) -> tuple[int, int]:
        return self.inner.draft_work(k, tree) if self.inner is not None else (0, 1)

    def cost_probe(self):
        return self.inner.cost_probe() if self.inner is not None else None

    # ------------------------------------------------------------------------------------------------ helpers
    # Wrong tokens per position: the reference token plus distinct nonzero offsets (mod V), one per sibling.
    MAX_SIBLINGS = 8

    def _candidates(self, i: int):
        """[n, MAX_SIBLINGS + 1] int64 for reference i's positions: column 0 the token proposed there (the
        reference's, or a wrong one with probability 1 - acceptance), the other columns wrong siblings."""
        ref = np.asarray(self.reference[i], dtype=np.int64)
        rng = np.random.default_rng([self.seed, i])
        is_wrong = rng.random(len(ref)) >= self.acceptance
        v, w = self.vocab_size, self.MAX_SIBLINGS + 1
        # w distinct offsets in [1, V) per position, a random start and a stride of (V - 1) // w (bind checks V > w).
        start = rng.integers(0, v - 1, (len(ref), 1))
        offsets = 1 + (start + np.arange(w) * ((v - 1) // w)) % (v - 1)
        wrong = (ref[:, None] + offsets) % v  # [n, w], none equal to ref, distinct along a row
        return np.concatenate([np.where(is_wrong, wrong[:, 0], ref)[:, None], wrong[:, 1:]], 1)

    def _chain(self, b: int, history, k: int) -> list:
        """The up to k tokens proposed after `history` for the request in slot b: the reference continuation at
        the history's length, wrong where its fate says, cut at the reference's end."""
        if history is None or k <= 0:
            return []
        i = self.slot_request[b]
        start = len(history)
        end = min(start + k, len(self.reference[i]))
        return self.candidates[i][start:end, 0].tolist() if end > start else []
