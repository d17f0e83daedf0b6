"""One round of speculative decoding, for every running request at once (ragged: each at its own length and k):

  1. the drafter proposes up to k tokens per request (ChainRound) or a tree of candidates (TreeRound);
  2. the Verifier scores the request's last emitted token plus its drafts in one target forward (a tree under
     its mask), the sampling op accepts a prefix (a path) and draws the next token (greedy and sampled requests
     in one launch, temperature inside the kernel, top-k/top-p masks applied to target and draft logits alike),
     and truncate_kv_cache keeps the accepted tokens in the target's cache (a tree's path moved to the front);
  3. one host read of the emitted tokens; the drafter rolls back to what was accepted.
Plain decoding is a ChainRound without a drafter (k = 0: the verify block is the last token alone).

Invariant: the target's cache holds every token of a request but the last emitted one, which opens the next
verify block. Request r's round draws from Philox key seed[r] at offset = tokens r has generated, so its output
depends on its own prompt, parameters and seed only. Under Gumbel coupling (sampling="invariant") the token at
each position is the Gumbel-max sample with that position's noise, whoever drafted: the output is plain
decoding's, whatever the drafter, k, tree or batch.
"""
import time
from dataclasses import dataclass

import torch

from ..drafters.base import RoundInputs
from ..host import read, upload
from ..ops import chain_speculative_sampling_from_logits, tree_speculative_sampling_from_logits


@dataclass
class RoundResult:
    """What a round did, per row of its batch (host lists, from the round's one read)."""
    tokens: list        # the tokens each row emits: its accepted drafts, then the resampled or bonus token
    num_draft: list     # drafts verified (a tree: its nodes below the root)
    num_accepted: list  # drafts accepted (a tree: the accepted path's depth)
    depths: list        # a tree's depth, or None (chains)
    paths: list         # a tree's accepted nodes below the root (node = rank + 1), or None (chains)
    draft_s: float = 0.0
    verify_s: float = 0.0
    sample_s: float = 0.0


class SlotParams:
    """Per-slot sampling parameters on the device, written at admission (temperature, top_k, top_p, seed) and every
    round (steps: tokens generated, the Philox counter), which CUDA graphs replay on."""

    def __init__(self, slots: int, device, coupling: str = "rejection"):
        self.coupling = coupling
        self.temperature = torch.zeros(slots, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(slots, dtype=torch.int32, device=device)
        self.top_p = torch.ones(slots, dtype=torch.float32, device=device)
        self.seed = torch.zeros(slots, dtype=torch.int64, device=device)
        self.steps = torch.zeros(slots, dtype=torch.int64, device=device)

    def set(self, b: int, r) -> None:
        # fill_ takes the number as a kernel argument; `tensor[b] = number` would copy it from pageable host memory,
        # which synchronises with the device.
        for column, value in ((self.temperature, r.temperature), (self.top_k, r.top_k), (self.top_p, r.top_p),
                              (self.seed, r.seed)):
            column[b].fill_(value)

    def round_inputs(self, slots: list, batch: int, ks: list) -> RoundInputs:
        """The round's view for a drafter; uploads the steps (no host synchronisation)."""
        running = slots[:batch]
        self.steps[:batch].copy_(upload([len(r.generated) if r is not None else 0 for r in running], torch.int64,
                                        self.steps.device), non_blocking=True)
        return RoundInputs(batch, ks, [r.tokens if r is not None else None for r in running],
                           self.temperature[:batch], self.top_k[:batch], self.top_p[:batch], self.seed[:batch],
                           self.steps[:batch], self.coupling)


class Verifier:
    """The target's verify step for chains and trees: one forward over [last token, drafts] (a tree: [root, nodes]
    under its mask), the masks, the sampling op, and the truncation that keeps num_accepted + 1 tokens of the
    block (a tree's path moved to its front). One CUDA graph per step shape (batch, width, masks in use, sampled
    or point drafts, hidden states). Returns the round's results packed in one int32 tensor for its one read."""

    def __init__(self, target, graphs):
        self.target, self.graphs = target, graphs

    def bind(self, cache, params: SlotParams) -> None:
        self.cache, self.params = cache, params

    def __call__(self, r: RoundInputs, ids, live, draft_logits, *, num_draft=None, tree=None,
                 hidden_states: bool = False, draft_to_target=None, block_argmax: bool = False):
        """ids [batch, Q]; live [batch] int32 (0: an idle row, which keeps nothing); chain: num_draft [batch] int32
        (Q - 1 = the widest), draft_logits [batch, Q - 1, V or Vd] unprocessed (draft_to_target [Vd] with a draft
        vocabulary); tree: the DraftTree (its token_ids are ids). Every row is processed with the requests' top-k and
        top-p inside the sampling op. Returns (packed [batch, W] int32: chain output_token_ids [Q], num_accepted;
        tree also accepted_nodes [Q], num_nodes, depth, and with block_argmax the target's greedy token at every node
        [Q]; the target's hidden states of the accepted tokens in order when asked, else None; the time the forward
        ended, eager only)."""
        batch, width = ids.shape
        p, cache, rows = self.params, self.cache, slice(0, r.batch)
        if r.coupling == "gumbel":  # each row decides by its own Gumbel-max token: the draft rows are not read
            draft_logits = draft_to_target = None
        forward_done = [0.0]

        def step(ids, live, draft_logits, num_draft, parents, tree_mask, num_nodes, depths):
            logits = self.target(ids, cache, tree_mask=tree_mask, cache_rows=rows, output_hidden_states=hidden_states)
            logits, hidden = logits if hidden_states else (logits, None)  # [batch, Q, V] float32, [batch, Q, H]
            forward_done[0] = time.perf_counter()
            if parents is None:
                if width > 1:
                    drafts, target = ids[:, 1:].contiguous(), logits
                else:  # no drafts: K = 1 with none proposed, the bonus token drawn from row 0 (stride 0, no copy)
                    drafts, target = torch.zeros_like(ids), logits.expand(batch, 2, logits.shape[-1])
                out = chain_speculative_sampling_from_logits(drafts, target, draft_logits, temperature=r.temperature,
                                                             num_draft_tokens=num_draft, seed=r.seed, offset=r.steps,
                                                             coupling=r.coupling, draft_to_target=draft_to_target,
                                                             top_k=r.top_k, top_p=r.top_p)
                cache.truncate((out.num_accepted + 1) * live, rows, free_pages=False)
                packed = torch.cat([out.output_token_ids, out.num_accepted.unsqueeze(1)], 1)
                return packed, hidden
            out = tree_speculative_sampling_from_logits(parents, ids, logits, draft_logits,
                                                        temperature=r.temperature, num_nodes=num_nodes, seed=r.seed,
                                                        offset=r.steps, coupling=r.coupling, top_k=r.top_k,
                                                        top_p=r.top_p)
            cache.truncate((out.num_accepted + 1) * live, rows, kept_indices=out.accepted_nodes, free_pages=False)
            if hidden is not None:  # the path's features in path order: a chain of num_accepted drafts to the drafter
                path = out.accepted_nodes.long().clamp_min(0)
                hidden = hidden.gather(1, path.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
            packed = [out.output_token_ids, out.num_accepted.unsqueeze(1), out.accepted_nodes,
                      num_nodes.unsqueeze(1).int(), depths.amax(1, keepdim=True).int()]
            if block_argmax:  # what a Jacobi window learns from the same forward (LookaheadDrafter)
                packed.append(logits.argmax(-1).int())
            return torch.cat(packed, 1), hidden

        kind = "chain" if tree is None else "tree"
        key = (kind, batch, width, r.coupling, draft_logits is not None, hidden_states, block_argmax)
        inputs = (ids, live, draft_logits, num_draft) + ((None,) * 4 if tree is None else
                                                         (tree.parents, tree.tree_mask, tree.num_nodes, tree.depths))
        packed, hidden = self.graphs.run(key, step, inputs, state=[cache.cache_seqlens])
        return packed, hidden, forward_done[0]


class ChainRound:
    """Each request drafts up to its k tokens in a chain; drafter None: plain decoding (k = 0)."""

    def __init__(self, drafter, verifier: Verifier):
        self.drafter, self.verifier = drafter, verifier

    def run(self, r: RoundInputs, live: list, budget: int = 0) -> RoundResult:
        t0 = time.perf_counter()
        proposal = self.drafter.propose(r) if self.drafter is not None and max(r.num_tokens) else None
        ks = proposal.num_draft_tokens if proposal is not None else [0] * r.batch
        width = max(ks)
        if not width:  # no request could draft (e.g. a head before its first feature): a plain round
            proposal = None
        t1 = time.perf_counter()
        device = self.verifier.target.device
        ids = upload([[h[-1] if h is not None else 0] for h in r.histories], torch.int64, device)
        if width:
            ids = torch.cat([ids, proposal.draft_token_ids[:, :width]], 1)
        self.verifier.cache.reserve([width + 1] * r.batch, requests=list(range(r.batch)))
        hidden_states = self.drafter is not None and self.drafter.needs_hidden_states
        packed, hidden, t2 = self.verifier(r, ids, upload(live, torch.int32, device),
                                           proposal.draft_logits if proposal is not None else None,
                                           num_draft=upload(ks, torch.int32, device), hidden_states=hidden_states,
                                           draft_to_target=proposal.draft_to_target if proposal is not None else None)
        rows = read(packed)  # the round's one host read
        t3 = time.perf_counter()
        accepted = [row[-1] for row in rows]  # after output_token_ids [max(width, 1) + 1]
        if self.drafter is not None:
            self.drafter.rollback([a if alive else -1 for a, alive in zip(accepted, live)], hidden)
        return RoundResult([row[:a + 1] for row, a in zip(rows, accepted)], ks, accepted, [None] * r.batch,
                           [None] * r.batch, t1 - t0 + time.perf_counter() - t3, (t2 or t3) - t1, t3 - (t2 or t3))


class TreeRound:
    """Each request drafts a tree of at most `budget` nodes (the root included) and depth k."""

    def __init__(self, drafter, verifier: Verifier, branching: int):
        self.drafter, self.verifier, self.branching = drafter, verifier, branching

    def run(self, r: RoundInputs, live: list, budget: int = 0) -> RoundResult:
        if not max(r.num_tokens):  # no request may draft (at its end): a plain round
            return ChainRound(self.drafter, self.verifier).run(r, live)
        t0 = time.perf_counter()
        tree = self.drafter.propose_tree(r, budget, self.branching)
        t1 = time.perf_counter()
        n = tree.parents.shape[1]
        # Compaction touches the whole block of every row of the cache, idle ones too: each needs its pages.
        self.verifier.cache.reserve(n)
        device = self.verifier.target.device
        block_argmax = self.drafter.needs_block_argmax
        packed, hidden, t2 = self.verifier(r, tree.token_ids, upload(live, torch.int32, device), tree.draft_logits,
                                           tree=tree, hidden_states=self.drafter.needs_hidden_states,
                                           block_argmax=block_argmax)
        rows = read(packed)  # the round's one host read: tokens [n], accepted, path [n], nodes, depth[, argmax [n]]
        t3 = time.perf_counter()
        accepted = [row[n] for row in rows]
        paths = [row[n + 2:n + 2 + a] for row, a in zip(rows, accepted)]
        kept = [a if alive else -1 for a, alive in zip(accepted, live)]
        if block_argmax:
            self.drafter.rollback(kept, hidden, paths=paths, block_argmax=[row[2 * n + 3:] for row in rows])
        else:
            self.drafter.rollback(kept, hidden)
        return RoundResult([row[:a + 1] for row, a in zip(rows, accepted)], [row[2 * n + 1] - 1 for row in rows],
                           accepted, [row[2 * n + 2] for row in rows], paths,
                           t1 - t0 + time.perf_counter() - t3, (t2 or t3) - t1, t3 - (t2 or t3))
