"""A smaller model of the target's vocabulary as the drafter."""
import torch

from ..host import upload
from .base import (
    DraftCache,
    Drafter,
    Proposal,
    RoundFeedback,
    RoundInputs,
    control_block,
    controlled_rows,
    draw_draft,
    padded,
)
from .registry import DrafterEntry, path_value, register_drafter


class ModelDrafter(Drafter):
    """A smaller model of the same vocabulary drafts k tokens per request, one batched forward per token, on its
    own KV cache. Each token is drawn from the processed distribution it reports (the target's temperature,
    top-k and top-p of that request) with its own Philox key, so q in the sampling kernel is the law the
    drafts came from.

    Its cache holds a prefix of each request's tokens: at a round's start every token not yet in it (the last
    emitted one; two after a round whose drafts were all accepted, since the last draft was never fed; more
    after rounds without drafts) is fed in one ragged forward, whose last position gives the first draft."""

    def __init__(self, draft_model):
        self.model = draft_model
        self.state = DraftCache()

    def bind(self, target, slots: int, capacity: int, *, paged: bool = False, num_pages=None,
             cuda_graphs: bool = False) -> None:
        m = self.model
        if m.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"ModelDrafter: the draft model's vocabulary has {m.config.vocab_size} tokens, the "
                             f"target's {target.config.vocab_size}: they must be the same")
        if m.device != target.device:
            raise ValueError(f"ModelDrafter: the draft model is on {m.device}, the target on {target.device}")
        self.cache = self.state.bind(m, slots, capacity, paged, num_pages, cuda_graphs)
        self.round = None

    def cache_margin(self, k_max: int, tree=None) -> int:
        return k_max + 1  # the drafts of a round after its pending tokens

    def draft_work(self, k: int, tree=None) -> tuple[int, int]:
        return k, 1  # one forward per drafted token (the first also feeds the pending tokens)

    def cost_probe(self):
        from ..cost_tables import forward_step, table_key

        return table_key(self.model), lambda rows: forward_step(self.model, rows)

    def admit(self, slots: list, prefixes: list, hidden_states=None) -> None:
        self.model.prefill(self.cache, slots, prefixes)
        for b, p in zip(slots, prefixes):
            self.state.lengths[b] = len(p)

    def release(self, slot: int) -> None:
        self.state.release(slot)

    @torch.no_grad()
    def propose(self, r: RoundInputs) -> Proposal:
        device, kmax, rows = self.model.device, max(r.num_tokens), slice(0, r.batch)
        lengths = self.state.lengths
        pending = [h[lengths[b]:] if h is not None else [] for b, h in enumerate(r.histories)]
        width = max(max(len(p) for p in pending), 1)
        self.cache.reserve([width + kmax] * r.batch, requests=list(range(r.batch)))
        last = upload([[max(len(p) - 1, 0)] for p in pending], torch.long, device)
        # Rows padded past their pending tokens write past their length: nothing reads those slots.
        logits = self.model(padded(pending, 0, torch.int64, device), self.cache, logits_indices=last,
                            cache_rows=rows)[:, 0]
        self.state.advance([len(p) for p in pending], rows)
        draft_ids = torch.empty(r.batch, kmax, dtype=torch.int64, device=device)
        draft_logits = torch.empty(r.batch, kmax, logits.shape[-1], dtype=torch.float32, device=device)
        wants = upload(r.num_tokens, torch.int32, device)

        block = control_block(r, device)  # with generation controls: the last token, then the drafts so far

        def step(logits, offset, grow, block, feed: bool):
            """Draws a token per row from the logits (the controls applied here, the rest in the kernel); feeds it
            (next logits) unless it is the last. Returns (the token, the row it was drawn from, the next logits)."""
            logits = controlled_rows(logits, r, block)
            token = draw_draft(logits, r, offset)
            if not feed:
                return token, logits, logits
            next_logits = self.model(token.unsqueeze(1), self.cache, cache_rows=rows)[:, 0]
            self.cache.advance(grow, rows)  # device counts: the host mirror is restored at rollback
            return token, logits, next_logits

        for i in range(kmax):
            feed = i + 1 < kmax
            grow = (wants > i + 1).int()  # rows that draft token i + 2 keep token i + 1
            key = ("draft", r.batch, r.coupling, r.min_p is not None, r.controls_epoch, feed) + \
                ((i,) if block is not None else ())
            token, row, next_logits = self.state.graphs.run(key, lambda x, o, g, c: step(x, o, g, c, feed),
                                                            (logits, r.steps + i, grow, block),
                                                            state=[self.cache.cache_seqlens])
            draft_ids[:, i], draft_logits[:, i] = token, row
            if block is not None:
                block = torch.cat([block, token.unsqueeze(1)], 1)
            logits = next_logits.clone() if feed else logits
        self.round = list(r.num_tokens)
        return Proposal(draft_ids, list(r.num_tokens), draft_logits)

    def rollback(self, feedback: RoundFeedback) -> None:
        """Keeps the tokens fed this round that the target accepted: the pending ones (already in the host mirror)
        and the accepted drafts that were fed (every draft but the last is); an idle row keeps nothing more.
        Nothing to do after a round without drafts: the tokens wait in the history for the next propose."""
        if self.round is None:
            return
        asked, self.round = self.round, None
        for b, (k, a) in enumerate(zip(asked, feedback.num_accepted)):
            self.state.lengths[b] += min(max(a, 0), max(k - 1, 0))
        self.state.restore()


# --------------------------------------------------------------------------------- its command-line spelling


def draft_model_drafter(target, path, keep_quantized: bool = False) -> ModelDrafter:
    """A ModelDrafter of the model at `path` (HF directory or .gguf), on the target's device and dtype; keep_quantized:
    its GGUF block weights kept as stored, whatever the target's."""
    from ..models import LlamaForCausalLM

    return ModelDrafter(LlamaForCausalLM.from_pretrained(path, device=target.device, dtype=target.dtype,
                                                         keep_quantized=keep_quantized))


register_drafter(DrafterEntry(
    name="model", drafter_class=ModelDrafter, syntax="model:PATH", help="a draft model",
    parse=lambda spec, value: {"path": path_value(spec, value, required=True)}, build=draft_model_drafter,
    needs_draft_model=True))
