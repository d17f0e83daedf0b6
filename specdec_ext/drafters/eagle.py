"""EAGLE drafting: a one-layer head on the target's own hidden states, chains and EAGLE-2 dynamic trees."""
import torch

from ..host import upload
from ..logits_processing import DraftColumns
from ..trees import MAX_TREE_NODES, ancestor_mask, grow_dynamic_tree, last_tokens
from .base import (
    DraftCache,
    Drafter,
    Proposal,
    RoundFeedback,
    RoundInputs,
    control_block,
    controlled_rows,
    draft_proposal,
    draw_from_draft_vocab,
)
from .registry import DrafterEntry, path_value, register_drafter


class EagleDrafter(Drafter):
    """Drafts with an EagleHead (specdec_ext.models.draft_heads) on the target's own hidden states.

    The head's cache holds pairs (feature of token j, token j + 1) whose features are the target's. A prompt's
    pairs are fed at admission; at a round's start every pair not yet in it is fed in one ragged forward (the
    features the target's last verify block returned); its last output gives the first draft, and each later
    draft step feeds the head's own predicted feature with the token just drafted. Those draft-step pairs are
    dropped after the round: the next round feeds the target's features of whatever was accepted instead."""

    needs_hidden_states = True
    supports_trees = True

    def __init__(self, target, head):
        from ..models.draft_heads import check_target

        check_target(head.target_config, target, "EagleDrafter")
        self.target, self.head = target, head
        self.observer = None  # an OnlineDraftTraining fed the pairs the head is fed
        self.hidden_state_layers = head.feature_layers  # EAGLE-3: the target's low, middle and high layers
        self.draft_to_target = head.draft_vocab.int()  # the verify step's column map of the draft rows
        self.state = DraftCache()

    def bind(self, target, slots: int, capacity: int, *, paged: bool = False, num_pages=None,
             cuda_graphs: bool = False) -> None:
        if target is not self.target:
            raise ValueError("EagleDrafter: made for another target model than the decoder's")
        self.cache = self.state.bind(self.head.decoder, slots, capacity, paged, num_pages, cuda_graphs=False)
        self.pending = [[] for _ in range(slots)]  # target features not yet fed: [n, feature_width] tensors
        if self.observer is not None:  # a new run: the slots' requests are new
            for b in list(self.observer.streams):
                self.observer.release(b)

    def check_tree(self, tree) -> None:
        if (tree.depth - 1) * tree.branching > MAX_TREE_NODES:  # the draft block holds every expanded node
            raise ValueError(f"tree: (depth - 1) x branching must be at most {MAX_TREE_NODES} for EAGLE drafting, "
                             f"got ({tree.depth} - 1) x {tree.branching}")

    def cache_margin(self, k_max: int, tree=None) -> int:
        """The pending pairs (up to a round's accepted tokens + 1) and the draft block after them."""
        if tree is None:
            return k_max + 1
        return tree.depth + (tree.depth - 1) * tree.branching

    def draft_work(self, k: int, tree=None) -> tuple[int, int]:
        return k, (1 if tree is None else tree.branching)  # a tree's steps feed `branching` nodes per request

    def cost_probe(self):
        """One head step over `rows` pairs (fusion, the decoder layer, the draft-vocabulary LM head)."""
        from ..cost_tables import table_key

        def prepare(rows: int):
            cache = self.head.decoder.new_kv_cache(1, rows + 1)
            tokens = torch.ones(1, rows, dtype=torch.int64, device=self.target.device)
            features = torch.ones(1, rows, self.head.feature_width, dtype=self.target.dtype, device=self.target.device)
            indices = torch.arange(rows, device=self.target.device)
            return lambda: self.head(tokens, features, cache, logits_indices=indices)

        key = {**table_key(self.head.decoder), "drafter": "eagle head"}
        if self.head.feature_layers:  # EAGLE-3's step also fuses the target's layers
            key["feature_layers"] = list(self.head.feature_layers)
        return key, prepare

    @torch.no_grad()
    def admit(self, slots: list, prefixes: list, hidden_states=None) -> None:
        """Feeds each prefix's pairs whose two halves it holds; the last feature waits for the token after the
        prefix. So a round's ragged forward is at most k + 1 wide and its padded rows stay inside the cache (a
        prompt's width there could run a row near its end past it). One forward per run of consecutive slots
        whose prefixes have one length, as the target's prefill: admitting a batch costs a forward per distinct
        length, not one per request."""
        device = self.target.device
        for b, h, p in zip(slots, hidden_states, prefixes):
            self.state.lengths[b], self.pending[b] = 0, [h[-1:]] if len(h) else []
            if self.observer is not None:
                self.observer.pairs(b, h[:-1], list(p[1:]))
        i = 0
        while i < len(slots):
            j, n = i, len(hidden_states[i]) - 1  # the pairs of slot i's prefix
            while j + 1 < len(slots) and slots[j + 1] == slots[j] + 1 and len(hidden_states[j + 1]) - 1 == n:
                j += 1
            if n > 0:
                rows = slots[i:j + 1]
                self.cache.reserve([n] * len(rows), requests=rows)
                tokens = upload([p[1:] for p in prefixes[i:j + 1]], torch.int64, device)
                features = torch.stack([h[:-1] for h in hidden_states[i:j + 1]])
                self.head(tokens, features, self.cache, cache_rows=slice(rows[0], rows[-1] + 1),
                          logits_indices=upload([n - 1], torch.int64, device))
                self.state.advance([n] * len(rows), slice(rows[0], rows[-1] + 1))
            i = j + 1

    def release(self, slot: int) -> None:
        self.state.release(slot)
        self.pending[slot] = []
        if self.observer is not None:
            self.observer.release(slot)

    def feed_pending(self, r: RoundInputs, block: int):
        """Feeds every row's pending pairs in one ragged forward, with room for a draft block of `block` slots per
        row after them. Returns (rows' counts of tokens asked, 0 for a row without a feature yet; the logits of
        the token after the last emitted one [B, Vd]; the head's feature of the last emitted token [B, 1, H])."""
        device, rows = self.target.device, slice(0, r.batch)
        live = [r.histories[b] is not None and bool(self.pending[b]) for b in range(r.batch)]
        counts = [sum(len(f) for f in self.pending[b]) if live[b] else 0 for b in range(r.batch)]
        # A request whose prompt is one token has no feature yet: it drafts from the next round on.
        asked = [k if n else 0 for k, n in zip(r.num_tokens, counts)]
        width = max(max(counts), 1)
        self.cache.reserve([width + block] * r.batch, requests=list(range(r.batch)))
        lengths = self.state.lengths  # pair j joins feature j with token j + 1
        segments = [r.histories[b][lengths[b] + 1:lengths[b] + 1 + n] if n else [] for b, n in enumerate(counts)]
        tokens = upload([s + [0] * (width - len(s)) for s in segments], torch.int64, device)
        # Assembled with a constant number of tensor ops, whatever the batch (a round runs at every batch size).
        features = torch.zeros(r.batch, width, self.head.feature_width, dtype=self.target.dtype, device=device)
        if any(counts):
            queued = torch.cat([f for b in range(r.batch) if live[b] for f in self.pending[b]])  # rows in slot order
            row = upload([b for b, n in enumerate(counts) for _ in range(n)], torch.int64, device)
            column = upload([j for n in counts for j in range(n)], torch.int64, device)
            features[row, column] = queued
        last = upload([[max(n - 1, 0)] for n in counts], torch.int64, device)
        logits, hidden = self.head(tokens, features, self.cache, cache_rows=rows, logits_indices=last)
        feature = hidden.gather(1, last.unsqueeze(-1).expand(-1, 1, hidden.shape[-1]))  # [B, 1, H]
        self.state.advance(counts, rows)
        for b in range(r.batch):
            if self.observer is not None and counts[b]:  # the pairs just fed: what online training learns from
                self.observer.pairs(b, torch.cat(self.pending[b]), segments[b])
            self.pending[b] = []
        return asked, logits[:, 0], feature

    @torch.no_grad()
    def propose(self, r: RoundInputs) -> Proposal:
        device, vocab, rows = self.target.device, self.target.config.vocab_size, slice(0, r.batch)
        asked, logits, feature = self.feed_pending(r, max(r.num_tokens))
        kmax = max(asked)
        draft_ids = torch.zeros(r.batch, kmax, dtype=torch.int64, device=device)
        drawn = []  # the draft rows [B, Vd] drawn from, as controlled_rows left them (none under gumbel coupling)
        wants = upload(asked, torch.int32, device)
        block = control_block(r, device)
        columns = DraftColumns.of(self.head.draft_vocab, vocab) if block is not None else None
        for i in range(kmax):
            logits = controlled_rows(logits, r, block, columns)
            token, row = draw_from_draft_vocab(logits, self.head.draft_vocab, vocab, r, r.steps + i)
            draft_ids[:, i] = token
            block = torch.cat([block, token.unsqueeze(1)], 1) if block is not None else None
            drawn.append(row)
            if i + 1 < kmax:
                logits, feature = self.head(token.unsqueeze(1), feature, self.cache, cache_rows=rows)
                logits = logits[:, 0]
                self.cache.advance((wants > i + 1).int(), rows)  # dropped at rollback
        return draft_proposal(draft_ids, asked, drawn, self.draft_to_target)

    @torch.no_grad()
    def propose_tree(self, r: RoundInputs, budget: int, branching: int):
        """EAGLE-2's dynamic tree (trees.grow_dynamic_tree) from the head after the last emitted token. Point
        proposals: the children are deterministic, so the tree sampling op tests each against the target in turn.

        Each expansion feeds every node expanded so far as one draft block after the head's cache, under a tree
        mask, a node's pair joining its parent's predicted feature with its own token; it never advances the
        cache: the block is dropped at rollback, which queues the target's features of the accepted path instead,
        as after a chain round."""
        k = min(branching, len(self.head.draft_vocab))
        asked, logits, feature = self.feed_pending(r, (max(r.num_tokens) - 1) * k)
        features, fed = [], None  # the block's input features; the head's output features of the last k fed

        def expand(tokens, parents, chosen):
            nonlocal fed
            width = feature.shape[-1]
            features.append(feature.expand(-1, k, -1) if chosen is None else
                            fed.gather(1, chosen.unsqueeze(-1).expand(-1, -1, width)))
            first = tokens.shape[1] - k
            logits, hidden = self.head(tokens, torch.cat(features, 1), self.cache, cache_rows=slice(0, r.batch),
                                       tree_mask=ancestor_mask(parents),
                                       logits_indices=torch.arange(first, first + k, device=tokens.device))
            fed = hidden[:, first:]
            return logits

        return grow_dynamic_tree(logits, self.head.draft_vocab, asked, branching, budget,
                                 last_tokens(r.histories, self.target.device), expand)

    def rollback(self, feedback: RoundFeedback) -> None:
        """Drops the draft-step pairs (back to the host's lengths: the pairs fed from the target's features);
        queues the target's features of the round's accepted tokens (the last emitted token's and the accepted
        drafts')."""
        self.state.restore()
        # One copy for all rows: the feedback's tensor can be a captured verify step's output, which a later replay
        # rewrites while these wait for the next propose (rounds in which no row drafts skip it).
        hidden = feedback.hidden_states.clone()
        for b, a in enumerate(feedback.num_accepted):
            if a >= 0:
                self.pending[b].append(hidden[b, :a + 1])


# --------------------------------------------------------------------------------- its command-line spelling


def eagle_drafter(target, path=None) -> EagleDrafter:
    """An EagleDrafter of the head file at `path` (None: the one shipped for the default model)."""
    from ..models import default_head_path
    from ..models.draft_heads import EagleHead

    return EagleDrafter(target, EagleHead.load(path or default_head_path("eagle"), target))


register_drafter(DrafterEntry(
    name="eagle", drafter_class=EagleDrafter, syntax="eagle[:PATH]", help="a trained EAGLE head",
    value_help="without PATH, the one shipped for the default model",
    parse=lambda spec, value: {"path": path_value(spec, value, required=False)}, build=eagle_drafter,
    trained_heads=True))
