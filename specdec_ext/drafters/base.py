"""The Drafter protocol: what proposes the tokens that the target verifies in a round, and what it answers about
itself, so that the decoder never looks inside a drafter.

The decoder calls, over its request slots [0, slots):
  bind(target, slots, capacity, paged=, num_pages=, cuda_graphs=)  before a run: check the target, allocate what
                                 the drafter keeps (its cache of `capacity` tokens per slot; num_pages: a paged
                                 cache's page budget, None: the worst case); a drafter that reallocates drops the
                                 CUDA graphs it captured on the old cache (it owns both)
  admit(slots, prefixes, hidden_states=None)  new requests: each prompt but its last token (which opens the first
                                 round), and the target's hidden states of those tokens when needs_hidden_states
  propose(round) -> Proposal     up to round.num_tokens[b] tokens for each slot b < round.batch (ragged, 0 allowed)
  propose_tree(round, budget, branching) -> DraftTree   tree rounds (supports_trees): at most `budget` nodes (the
                                 root included) per slot, no deeper than round.num_tokens[b], best nodes first
  rollback(feedback)             after every round: keep what the target accepted (a RoundFeedback: the accepted
                                 counts, and what the drafter declared it needs of the round's forward)
  release(slot)                  a finished request
and asks:
  supports_trees
  needs_hidden_states, needs_block_argmax   what the round's RoundFeedback carries besides the counts
  sizes_own_tree                 True: the drafter chooses how much of the node budget a tree round fills: the
                                 policy hands it the whole budget and calls plan(costs, batch, round_index) before
                                 each tree round (costs: the CostModel, None when adaptive is off)
  round_tree()                   the TreeSettings of this drafter's rounds when the decoder is given none (None:
                                 chain rounds)
  check_tree(tree)               ValueError when a TreeSettings is not one this drafter can propose
  cache_margin(k_max, tree)      slots a round writes past a request's tokens in the drafter's own cache (the
                                 target's, with shares_target_cache)
  draft_work(k, tree)            (steps, rows per request of each step) of a round drafting k tokens (a tree of
                                 depth k): what the cost model multiplies the step's cost by
  use_target_cache(cache)        with shares_target_cache: the decoder's KV cache of the target, before each run (a
                                 drafter whose draft steps run the target's own layers over it: self-speculative)
  cost_probe()                   (key, prepare): what a draft step's cost depends on (the cost file's key) and
                                 prepare(rows) -> a function running one draft step over `rows` rows on scratch
                                 state, which the cost model times, so that no drafter counts as free

A Proposal holds draft_token_ids [batch, K] int64 (padded with valid ids past each row's count), the count per
row, and draft_logits [batch, K, V] (the processed logits the drafts were drawn from: q = softmax(logits / T)) or
None for point proposals (q one-hot at the draft token).
"""
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..graphs import StepGraphs
from ..host import upload
from ..ops import sample_without_drafts

# A draft model's or head's Philox key is the request's seed XOR this (the golden-ratio constant as a signed
# int64), so its draws never reuse the target's; its counter is the position of the drafted token. Under Gumbel
# coupling a draft is drawn with the target's own noise at its position instead (draw_draft).
DRAFT_KEY = 0x9E3779B97F4A7C15 - 2**64


@dataclass
class RoundInputs:
    """What a drafter sees of a round: rows [0, batch) of the decoder's slots."""
    batch: int
    num_tokens: list        # [batch] ints: how many tokens to propose for each row (0 for idle rows)
    histories: list         # [batch] token lists (prompt + generated; None for idle rows)
    temperature: torch.Tensor  # [batch] float32 on the device, and top_k [batch] int32, top_p [batch] float32: the
    top_k: torch.Tensor        # sampling kernels process every row with them (draft rows as the target's)
    top_p: torch.Tensor
    seed: torch.Tensor      # [batch] int64: the requests' seeds
    steps: torch.Tensor     # [batch] int64: tokens generated so far (the Philox counter of this round)
    coupling: str = "rejection"  # the sampling ops' coupling: "gumbel" under sampling="invariant"
    min_p: torch.Tensor | None = None  # [batch] float32, or None when no request of the call sets min_p
    controls: object = None  # logits_processing.BlockControls of the call's generation controls, or None (off)
    controls_epoch: int = 0  # changes when the controls' tensors are reallocated: a key of any captured draft step


@dataclass
class RoundFeedback:
    """What a drafter learns of the round it drafted, for its rollback: rows [0, batch) of the decoder's slots."""
    num_accepted: list  # [batch] ints: the drafts the target accepted (a tree: the accepted path's depth); -1 for a
    #                     row without a request
    hidden_states: torch.Tensor | None = None  # [batch, Q, H] with needs_hidden_states: the target's, of the round's
    #                     block (after a tree round: of the accepted path, in path order)
    paths: list | None = None  # after a tree round: [batch] lists, each row's accepted nodes below the root
    block_argmax: list | None = None  # after a tree round, with needs_block_argmax: [batch] lists, the target's
    #                     greedy token at every node of the block, from the same forward


@dataclass
class Proposal:
    draft_token_ids: torch.Tensor  # [batch, K] int64
    num_draft_tokens: list         # [batch] ints, each <= K and <= what was asked
    draft_logits: torch.Tensor | None = None  # [batch, K, V or Vd] float32 as drawn from (unprocessed), or None: point
    draft_to_target: torch.Tensor | None = None  # [Vd] int32: the target id of each column of a reduced vocabulary


class Drafter(ABC):
    """Defaults for a drafter that keeps no state between rounds and proposes chains only: a subclass writes
    propose()."""

    needs_hidden_states = False
    hidden_state_layers = None  # with needs_hidden_states: None for the last layer's, or the layers to read (EAGLE-3)
    needs_block_argmax = False
    supports_trees = False
    sizes_own_tree = False
    shares_target_cache = False

    @property
    def target_features(self):
        """The target forward's output_hidden_states for this drafter: False, True (the last layer's) or layers."""
        return self.needs_hidden_states and (self.hidden_state_layers or True)

    def bind(self, target, slots: int, capacity: int, *, paged: bool = False, num_pages=None,
             cuda_graphs: bool = False) -> None:
        self.device = target.device

    def admit(self, slots: list, prefixes: list, hidden_states=None) -> None:
        pass

    @abstractmethod
    def propose(self, r: RoundInputs) -> Proposal:
        """Up to r.num_tokens[b] draft tokens for each row b < r.batch."""

    def propose_tree(self, r: RoundInputs, budget: int, branching: int):
        raise ValueError(f"{type(self).__name__} does not propose trees (supports_trees is False)")

    def rollback(self, feedback: RoundFeedback) -> None:
        pass

    def release(self, slot: int) -> None:
        pass

    def use_target_cache(self, cache) -> None:
        pass

    def round_tree(self):
        return None

    def check_tree(self, tree) -> None:
        if not self.supports_trees:
            raise ValueError(f"tree rounds need a drafter that proposes trees (one whose supports_trees is True), "
                             f"got {type(self).__name__}")

    def cache_margin(self, k_max: int, tree=None) -> int:
        return 0

    def draft_work(self, k: int, tree=None) -> tuple[int, int]:
        return (1 if k else 0), 1

    def cost_probe(self):
        """None: this drafter did not say what its steps cost, and the cost model counts them as free."""
        return None


class DraftCache:
    """A drafter's KV cache with a host mirror of each request's length, and the CUDA graphs captured on it: both
    are replaced together, so a graph never replays against a freed cache (a drafter shared by decoders of
    different batch sizes reallocates on each bind)."""

    def __init__(self):
        self.cache, self.shape = None, None
        self.graphs = StepGraphs(enabled=False)

    def bind(self, model, slots: int, capacity: int, paged: bool, num_pages, cuda_graphs: bool):
        """Reuses the cache while its shape is the run's (its graphs stay valid), else allocates a new one and drops
        the graphs; every request emptied."""
        shape = (slots, capacity, paged, num_pages, cuda_graphs)
        if self.shape != shape:
            self.cache = None  # free the old one before allocating
            self.cache = model.new_kv_cache(slots, capacity, paged=paged, num_pages=num_pages)
            self.graphs = StepGraphs(enabled=cuda_graphs)
            self.shape = shape
        for b in range(slots):
            self.cache.release(b)
        self.lengths = [0] * slots  # host mirror: tokens (or pairs) of request b that the cache holds
        return self.cache

    def advance(self, counts: list, rows: slice) -> None:
        """The requests of `rows` grew by counts (host ints) after a forward wrote them."""
        self.cache.advance(counts, rows)
        for b, n in zip(range(*rows.indices(len(self.lengths))), counts):
            self.lengths[b] += n

    def restore(self) -> None:
        """Back to the host mirror's lengths: drops what draft steps wrote after it."""
        self.cache.restore_lengths(self.lengths)

    def release(self, slot: int) -> None:
        self.cache.release(slot)
        self.lengths[slot] = 0


def padded(rows: list, fill, dtype: torch.dtype, device) -> torch.Tensor:
    """Ragged host lists as one [len(rows), longest] tensor on `device` (one upload, not one per row)."""
    width = max((len(row) for row in rows), default=0)
    return upload([list(row) + [fill] * (width - len(row)) for row in rows], dtype, device).reshape(len(rows), width)


def draw_draft(logits: torch.Tensor, r: RoundInputs, offset: torch.Tensor) -> torch.Tensor:
    """A sampled draft token per row [batch] int64 from unprocessed logits [batch, V or Vd] (a column of them), drafting
    the tokens at positions `offset` (tokens generated), processed inside the kernel with the requests' top-k, top-p
    and min-p: with the draft's own Philox key (rejection coupling; the verifier processes the reported rows the same
    way), or with the target's Gumbel noise at that position (gumbel coupling: the draft is the target's own token
    wherever the two argmaxes of log-probability plus noise agree; the noise is indexed by target id, so the columns
    must be target ids)."""
    seed = r.seed if r.coupling == "gumbel" else r.seed ^ DRAFT_KEY
    return sample_without_drafts(logits, temperature=r.temperature, seed=seed, offset=offset, coupling=r.coupling,
                                 top_k=r.top_k, top_p=r.top_p, min_p=r.min_p).long()


def controlled_rows(logits: torch.Tensor, r: RoundInputs, block: torch.Tensor | None, columns=None) -> torch.Tensor:
    """A drafter's logits [batch, V] (or [batch, Vd] over a draft vocabulary: columns, a DraftColumns) processed by the
    call's generation controls for the draft after `block` [batch, 1 + i] int64 (the last emitted token, then the i
    drafts so far): the row a draft is drawn from and reported as (the verifier processes the target's rows so; the
    sampling op reads the draft's as given). The logits themselves when the call has no controls (block None)."""
    if r.controls is None or block is None:
        return logits
    from ..logits_processing import process_block

    if columns is None:
        return process_block(logits.clone().unsqueeze(1), block, r.controls)[:, 0]
    padded = torch.cat([logits, logits.new_full((logits.shape[0], 1), float("-inf"))], 1)  # Vd: a trash column
    return process_block(padded.unsqueeze(1), block, r.controls, columns=columns)[:, 0, :-1]


def control_block(r: RoundInputs, device) -> torch.Tensor | None:
    """The last emitted token of each row [batch, 1] int64, the start of the block controlled_rows reads; None when
    the call has no controls."""
    if r.controls is None:
        return None
    return upload([[h[-1] if h else 0] for h in r.histories], torch.int64, device).view(r.batch, 1)


def draw_from_draft_vocab(logits: torch.Tensor, draft_vocab: torch.Tensor, vocab_size: int, r: RoundInputs,
                          offset: torch.Tensor):
    """A draft per row from logits over a draft vocabulary [B, Vd] (draft_vocab [Vd] its target ids): (the target ids
    [B] int64, the row to report). Rejection coupling samples the Vd columns themselves and reports them as they are
    (with draft_to_target, the verifier reads q over the same columns); gumbel coupling needs the target's noise, which
    is indexed by target id, so it draws over the full vocabulary (-inf off the draft vocabulary) and reports nothing
    (the verifier reads no draft rows then)."""
    if r.coupling != "gumbel":
        return draft_vocab[draw_draft(logits, r, offset)], logits
    full = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
    full[:, draft_vocab] = logits
    return draw_draft(full, r, offset), None


def draft_proposal(draft_ids: torch.Tensor, asked: list, rows: list, draft_to_target: torch.Tensor) -> Proposal:
    """A proposal of drafts drawn over a draft vocabulary: the rows [B, Vd] of each step stacked, with their column map
    draft_to_target [Vd] int32 (one tensor kept by the drafter: a CUDA graph of the verify step reads it), or no rows
    (gumbel coupling, or nothing drafted)."""
    if not rows or rows[0] is None:
        return Proposal(draft_ids, asked)
    return Proposal(draft_ids, asked, torch.stack(rows, 1), draft_to_target)
