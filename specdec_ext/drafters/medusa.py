"""Medusa drafting: heads on the target's hidden state of the last scored token, chains and candidate trees."""
import torch

from ..host import upload
from ..logits_processing import DraftColumns
from ..trees import Candidates, last_tokens
from .base import (
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


class MedusaDrafter(Drafter):
    """Drafts with MedusaHeads from the target's hidden state of the last scored token (the one whose logits
    drew the request's last token): head i proposes the token i + 1 places after it, all heads at once, one
    proposal chain per round. k is at most the number of heads."""

    needs_hidden_states = True
    supports_trees = True

    def __init__(self, target, heads):
        from ..models.draft_heads import check_target

        check_target(heads.target_config, target, "MedusaDrafter")
        self.target, self.heads = target, heads
        self.observer = None  # an OnlineDraftTraining fed the (feature, next token) pairs of what is served
        self.draft_to_target = heads.draft_vocab.int()  # the verify step's column map of the draft rows

    def bind(self, target, slots: int, capacity: int, *, paged: bool = False, num_pages=None,
             cuda_graphs: bool = False) -> None:
        if target is not self.target:
            raise ValueError("MedusaDrafter: made for another target model than the decoder's")
        self.features = [None] * slots  # [H]: the target's feature of the last scored token
        self.unpaired = [[] for _ in range(slots)]  # with an observer: features whose next token is not yet known
        if self.observer is not None:  # a new run: the slots' requests are new
            for b in list(self.observer.streams):
                self.observer.release(b)

    def draft_work(self, k: int, tree=None) -> tuple[int, int]:
        return (1 if k else 0), 1  # every head in one step

    def cost_probe(self):
        """The heads over `rows` features (every head in one call)."""
        from ..cost_tables import table_key

        def prepare(rows: int):
            features = torch.ones(rows, self.target.config.hidden_size, dtype=self.target.dtype,
                                  device=self.target.device)
            return lambda: self.heads(features)

        return {**table_key(self.target), "drafter": "medusa heads", "heads": self.heads.num_heads,
                "draft_vocab": len(self.heads.draft_vocab)}, prepare

    def admit(self, slots: list, prefixes: list, hidden_states=None) -> None:
        for b, h, p in zip(slots, hidden_states, prefixes):
            self.features[b] = h[-1] if len(h) else None
            if self.observer is not None:  # the last feature's next token is the prompt's last
                self.observer.pairs(b, h[:-1], list(p[1:]))
                self.unpaired[b] = [h[-1:]] if len(h) else []

    def release(self, slot: int) -> None:
        self.features[slot] = None
        if self.observer is not None:
            self.unpaired[slot] = []
            self.observer.release(slot)

    def pair(self, r: RoundInputs) -> None:
        """Hands the observer each row's features queued since its last round, with their next tokens: the last
        tokens of the history (a round queues the features of the last emitted token and the accepted drafts, and
        emits the accepted drafts and one more)."""
        for b in range(r.batch):
            if self.unpaired[b] and r.histories[b] is not None:
                features = torch.cat(self.unpaired[b])
                self.observer.pairs(b, features, r.histories[b][len(r.histories[b]) - len(features):])
                self.unpaired[b] = []

    def head_logits(self, r: RoundInputs):
        """(tokens asked per row, at most the number of heads and 0 for a row without a feature; the heads'
        logits [B, heads, Vd])."""
        device = self.target.device
        if self.observer is not None:
            self.pair(r)
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
        drawn = []
        block = control_block(r, device)
        columns = DraftColumns.of(self.heads.draft_vocab, vocab) if block is not None else None
        for i in range(kmax):
            row = controlled_rows(logits[:, i], r, block, columns)
            draft_ids[:, i], row = draw_from_draft_vocab(row, self.heads.draft_vocab, vocab, r, r.steps + i)
            drawn.append(row)
            block = torch.cat([block, draft_ids[:, i:i + 1]], 1) if block is not None else None
        return draft_proposal(draft_ids, asked, drawn, self.draft_to_target)

    @torch.no_grad()
    def propose_tree(self, r: RoundInputs, budget: int, branching: int):
        """Medusa's candidate tree: the nodes at depth d + 1 are the paths through head d's top-`branching`
        tokens, scored by the product of the heads' probabilities along them; the best budget - 1 prefixes make
        the tree. Grown depth by depth, keeping the best budget - 1 of each (no other can be among the best
        overall). Point proposals."""
        device, vocab = self.target.device, self.heads.draft_vocab
        asked, logits = self.head_logits(r)
        deepest = upload(asked, torch.int64, device).unsqueeze(-1)
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

    def rollback(self, feedback: RoundFeedback) -> None:
        # One copy for all rows: the feedback's tensor can be a captured verify step's output, which a later replay
        # rewrites (rounds in which no row drafts do not call propose).
        hidden = feedback.hidden_states.clone()
        for b, a in enumerate(feedback.num_accepted):
            if a >= 0:
                self.features[b] = hidden[b, a]
                if self.observer is not None:
                    self.unpaired[b].append(hidden[b, :a + 1])


# --------------------------------------------------------------------------------- its command-line spelling


def medusa_drafter(target, path=None) -> MedusaDrafter:
    """A MedusaDrafter of the heads file at `path` (None: the one shipped for the default model)."""
    from ..models import default_head_path
    from ..models.draft_heads import MedusaHeads

    return MedusaDrafter(target, MedusaHeads.load(path or default_head_path("medusa"), target))


register_drafter(DrafterEntry(
    name="medusa", drafter_class=MedusaDrafter, syntax="medusa[:PATH]", help="trained Medusa heads",
    value_help="without PATH, the ones shipped for the default model",
    parse=lambda spec, value: {"path": path_value(spec, value, required=False)}, build=medusa_drafter,
    trained_heads=True))
