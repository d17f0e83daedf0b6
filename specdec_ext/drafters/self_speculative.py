"""Self-speculative drafting: the target drafts for itself with a subset of its own layers (the first L, or any
increasing set), then its own final norm and LM head. No weights of its own, no training: it serves any model.

The draft steps run over the target's own KV cache. The cache holds every token of a request but the last emitted
one (the decoder's invariant); draft step i feeds one token at position len + i and writes the subset's layers of
that slot, reading the full model's entries for the prefix. Those slots lie inside the round's verify block
[len, len + k], which the verify forward then writes for every layer: nothing a draft step wrote survives the round,
and the cache after each round is the one a fresh prefill of the kept tokens gives (tests/test_self_speculative.py).
A tree round feeds the last emitted token at slot len, then its expanded nodes as one block after it: slots [len,
len + 1 + (depth - 1) x branching), the verify block's and past it (past the request's length after the round, so
never read before they are written again). The cache lengths are advanced on the device during the draft and set
back to the host's values after it.
"""
import hashlib
import json

import torch

from ..graphs import StepGraphs
from ..host import upload
from ..logits_processing import DraftColumns
from ..trees import MAX_TREE_NODES, ancestor_mask, grow_dynamic_tree, last_tokens
from .base import Drafter, Proposal, RoundInputs, control_block, controlled_rows, draft_proposal, draw_from_draft_vocab
from .registry import DrafterEntry, bad_spec, register_drafter


def candidate_subsets(num_layers: int) -> dict:
    """The skip patterns search_layers tries, by name: for each share of the layers kept (40-80%), the first n
    (early exit), the first quarter of them and the last rest (the output end kept), and the first two and last two
    with the rest spread evenly between (layer skipping)."""
    out = {}
    for share in (0.4, 0.5, 0.6, 0.7, 0.8):
        n = max(1, min(num_layers - 1, round(share * num_layers)))
        head = max(1, n // 4)
        inner = max(0, n - 4)
        spread = [2 + round(j * (num_layers - 5) / max(inner - 1, 1)) for j in range(inner)] if inner else []
        for name, layers in ((f"first{n}", range(n)), (f"ends{n}", [*range(head), *range(num_layers - n + head,
                                                                                            num_layers)]),
                             (f"spread{n}", [0, 1, *spread, num_layers - 2, num_layers - 1])):
            layers = tuple(sorted(set(layers)))
            if 0 < len(layers) < num_layers and layers not in out.values():
                out[name] = layers
    return out


def draft_cost(target, layers: tuple, draft_rows: int) -> float:
    """A draft step's weights over a full step's (what a bandwidth-bound decode step reads): the subset's layers and
    the LM head's rows it scores, against every layer and the whole head."""
    c = target.config
    kv = c.num_key_value_heads * c.head_dim
    per_layer = 2 * c.hidden_size * c.hidden_size + 2 * c.hidden_size * kv + 3 * c.hidden_size * c.intermediate_size
    head = c.hidden_size
    return (len(layers) * per_layer + draft_rows * head) / (c.num_hidden_layers * per_layer + c.vocab_size * head)


def calibration_prompts(target, count: int = 4, length: int = 24, seed: int = 0) -> list:
    """Text the target writes itself: `count` token ids drawn with `seed`, each continued greedily for `length`
    tokens (no tokenizer needed; what a request asks it to continue is its own kind of text)."""
    from ..engine import generate_autoregressive

    starts = torch.randint(0, target.config.vocab_size, (count,), generator=torch.Generator().manual_seed(seed))
    prompts = [[int(t)] for t in starts]
    out = generate_autoregressive(target, prompts, length)
    return [p + s for p, s in zip(prompts, out.sequences)]


def search_layers(target, k: int = 4, draft_vocab: torch.Tensor | None = None, prompts: list | None = None,
                  new_tokens: int = 32, seed: int = 0) -> tuple[tuple, list]:
    """The layer subset of candidate_subsets that maximises mean acceptance length / (1 + k x draft_cost) on greedy
    chains of k drafts over `prompts` (default: calibration_prompts(target, seed=seed)), and every candidate's row.
    Deterministic: the acceptance is counted, not timed, and the cost is the weights read. The result is cached on
    disk (like the cost model's tables), keyed by the model, the prompts and the settings; a malformed file is
    measured again."""
    from ..cost_tables import cache_dir, table_key
    from ..engine import SpeculativeDecoder

    prompts = prompts if prompts is not None else calibration_prompts(target, seed=seed)
    candidates = candidate_subsets(target.config.num_hidden_layers)
    rows_scored = target.config.vocab_size if draft_vocab is None else len(draft_vocab)
    key = {"model": table_key(target), "prompts": prompts, "k": k, "new_tokens": new_tokens,
           "draft_vocab": None if draft_vocab is None else draft_vocab.tolist(), "family": list(candidates.values())}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
    path = cache_dir() / "self_speculative" / f"{digest}.json"
    try:
        cached = json.loads(path.read_text())
        layers = tuple(cached["layers"])
        if layers in candidates.values() and isinstance(cached["rows"], list):
            return layers, cached["rows"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    import sys

    from tqdm import tqdm

    rows = []
    for name, layers in tqdm(candidates.items(), desc="searching the draft layers", unit="subset", file=sys.stderr,
                             leave=False):
        dec = SpeculativeDecoder(target, SelfSpeculativeDrafter(target, layers, draft_vocab), k, adaptive=False,
                                 max_batch_size=len(prompts))
        stats = dec.generate(prompts, new_tokens).stats
        cost = draft_cost(target, layers, rows_scored)
        rows.append({"name": name, "layers": list(layers), "mean_acceptance_length": stats.mean_acceptance_length,
                     "draft_cost": cost, "score": stats.mean_acceptance_length / (1 + k * cost)})
    best = max(rows, key=lambda row: (row["score"], -len(row["layers"])))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"layers": best["layers"], "rows": rows}))
    return tuple(best["layers"]), rows


def check_layer_subset(layers, num_layers: int, who: str = "SelfSpeculativeDrafter") -> tuple:
    """An int L (the first L layers) or increasing layer indices -> the tuple of indices; ValueError otherwise. A
    subset is a strict one: all the layers would draft at the target's own cost."""
    if isinstance(layers, bool):
        raise ValueError(f"{who}: layers must be an int or a tuple of layer indices, got {layers!r}")
    if isinstance(layers, int):
        if not 1 <= layers < num_layers:
            raise ValueError(f"{who}: layers={layers}: the first L layers draft, L in [1, {num_layers - 1}] (the "
                             f"target has {num_layers})")
        return tuple(range(layers))
    if not isinstance(layers, (tuple, list)) or not layers or \
            any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers for i in layers) or \
            any(a >= b for a, b in zip(layers, layers[1:])) or len(layers) >= num_layers:
        raise ValueError(f"{who}: layers must be an int L or increasing layer indices in [0, {num_layers}), fewer "
                         f"than all {num_layers}, got {layers!r}")
    return tuple(layers)


class SelfSpeculativeDrafter(Drafter):
    """Drafts k tokens per request with the target's layers `layers` (an int L: the first L; increasing indices; or
    "auto": search_layers' choice for chains of k, measured once per model and cached), one batched forward of the
    subset per token, over the target's own KV cache (module docstring).
    draft_vocab [Vd] (sorted target ids, optional): score only those rows of the target's LM head, whose full
    product dominates a small model's step (SmolLM2-135M: the head is a fifth of the weights); the sampling op
    reads the rows over those columns. Each draft is drawn from the processed distribution it reports. An int N: the
    first N token ids, a vocabulary that needs no data: BPE tokenizers number tokens in merge order, and the
    earlier a merge, the more frequent its pair was in the tokenizer's corpus (SmolLM2's first 8,192 ids hold 90% of
    its held-out chat answers' tokens; bench/RESULTS.md).
    Tree rounds (tree=...) grow EAGLE-2's dynamic tree with the subset (propose_tree).

    Example
    -------
    >>> from specdec_ext import SelfSpeculativeDrafter, SpeculativeDecoder
    >>> dec = SpeculativeDecoder(model, SelfSpeculativeDrafter(model, 12), 4)  # doctest: +SKIP
    """

    shares_target_cache = True
    supports_trees = True

    def __init__(self, target, layers="auto", draft_vocab: torch.Tensor | int | None = None, k: int = 4):
        from ..models.draft_heads import check_draft_vocab
        from ..models.quantized import QuantizedWeight

        self.target = target
        vocab = target.config.vocab_size
        if isinstance(draft_vocab, int) and not isinstance(draft_vocab, bool):
            if not 1 <= draft_vocab <= vocab:
                raise ValueError(f"SelfSpeculativeDrafter: draft_vocab={draft_vocab}: the first N token ids, N in "
                                 f"[1, {vocab}]")
            draft_vocab = torch.arange(draft_vocab) if draft_vocab < vocab else None
        if isinstance(layers, str) and layers == "auto":  # the skip pattern that pays best on this model
            layers, self.search = search_layers(target, k, draft_vocab)
        self.layers = check_layer_subset(layers, target.config.num_hidden_layers)
        self.cache, self.graphs = None, StepGraphs(enabled=False)
        if draft_vocab is None:
            draft_vocab = torch.arange(vocab, device=target.device)
            self.lm_head = None
        else:
            draft_vocab = check_draft_vocab(draft_vocab, vocab, "SelfSpeculativeDrafter").to(target.device)
            head = target.lm_head
            self.lm_head = head.gather(draft_vocab) if isinstance(head, QuantizedWeight) else head[draft_vocab]
        self.draft_vocab = draft_vocab
        self.draft_to_target = draft_vocab.int()
        self.columns = DraftColumns.of(draft_vocab, vocab)

    def bind(self, target, slots: int, capacity: int, *, paged: bool = False, num_pages=None,
             cuda_graphs: bool = False) -> None:
        if target is not self.target:
            raise ValueError("SelfSpeculativeDrafter: the decoder's target must be the model it was made for (it "
                             "drafts with that model's layers)")
        self.device, self.cuda_graphs = target.device, cuda_graphs

    def use_target_cache(self, cache) -> None:
        """The decoder's KV cache of the target, handed over before each run (the draft steps write its slots)."""
        if cache is not self.cache:
            self.cache, self.graphs = cache, StepGraphs(enabled=self.cuda_graphs)  # graphs of the old cache: stale

    def check_tree(self, tree) -> None:
        if (tree.depth - 1) * tree.branching > MAX_TREE_NODES:  # the draft block holds every expanded node
            raise ValueError(f"tree: (depth - 1) x branching must be at most {MAX_TREE_NODES} for self-speculative "
                             f"drafting, got ({tree.depth} - 1) x {tree.branching}")

    def cache_margin(self, k_max: int, tree=None) -> int:
        """The slots the draft steps write in the target's cache: the root, then the expanded nodes of a tree (a
        chain's k drafts stay inside its verify block)."""
        return k_max + 1 if tree is None else 1 + (tree.depth - 1) * self.branching(tree)

    def draft_work(self, k: int, tree=None) -> tuple[int, int]:
        """A forward of the subset per draft depth: a chain's of one row; a tree's root of one row, then expansion d
        (1 <= d < k) of the d x branching nodes expanded so far (propose_tree): their mean, rounded up."""
        if tree is None or k <= 1:
            return k, 1
        return k, -(-(1 + self.branching(tree) * k * (k - 1) // 2) // k)

    def branching(self, tree) -> int:
        """The children a tree round expands per node: the tree's branching, at most the draft vocabulary."""
        return min(tree.branching, len(self.draft_vocab))

    def cost_probe(self):
        from ..cost_tables import table_key

        target, layers = self.target, self.layers

        def prepare(rows: int):
            cache = target.new_kv_cache(1, rows + 1)
            ids = torch.zeros(1, rows, dtype=torch.long, device=target.device)
            indices = torch.arange(rows, device=target.device)
            return lambda: target(ids, cache, logits_indices=indices, layers=layers, lm_head=self.lm_head)

        return {**table_key(target), "self_speculative_layers": list(layers), "draft_vocab": len(self.draft_vocab)}, \
            prepare

    @torch.no_grad()
    def propose(self, r: RoundInputs) -> Proposal:
        device, kmax, rows = self.device, max(r.num_tokens), slice(0, r.batch)
        lengths = [len(h) - 1 if h is not None else 0 for h in r.histories]  # the cache: all tokens but the last
        self.cache.reserve([kmax + 1] * r.batch, requests=list(range(r.batch)))  # the verify block's slots
        tokens = upload([[h[-1] if h is not None else 0] for h in r.histories], torch.int64, device)
        draft_ids = torch.empty(r.batch, kmax, dtype=torch.int64, device=device)
        block = control_block(r, device)  # with generation controls: the last token, then the drafts so far
        one = torch.ones(r.batch, dtype=torch.int32, device=device)
        vocab = self.target.config.vocab_size

        def step(tokens, offset, block):
            """One token per row through the subset at the cache length (advanced after), and the draft drawn from
            its row over the draft vocabulary: (the draft's target id, the row to report or None)."""
            logits = self.target(tokens, self.cache, cache_rows=rows, layers=self.layers, lm_head=self.lm_head)[:, 0]
            self.cache.advance(one, rows)
            logits = controlled_rows(logits, r, block, self.columns)
            return draw_from_draft_vocab(logits, self.draft_vocab, vocab, r, offset)

        drawn = []
        for i in range(kmax):
            key = ("self-draft", r.batch, r.coupling, r.min_p is not None, r.controls_epoch) + \
                ((i,) if block is not None else ())
            token, row = self.graphs.run(key, step, (tokens, r.steps + i, block), state=[self.cache.cache_seqlens])
            draft_ids[:, i] = token
            drawn.append(row.clone() if row is not None else None)  # a replay rewrites the captured row
            tokens = token.unsqueeze(1)
            if block is not None:
                block = torch.cat([block, tokens], 1)
        self.cache.restore_lengths(lengths + [0] * (self.cache.batch_size - r.batch))  # slots past the batch: empty
        return draft_proposal(draft_ids, list(r.num_tokens), drawn, self.draft_to_target)

    @torch.no_grad()
    def propose_tree(self, r: RoundInputs, budget: int, branching: int):
        """EAGLE-2's dynamic tree (trees.grow_dynamic_tree) grown by the subset: the last emitted token is fed at the
        cache length, then each expansion feeds every node expanded so far as one block after it under a tree mask.
        All of it is written at [len, len + 1 + (depth - 1) x branching): the verify block's slots, which the verify
        rewrites, and slots past the request's length after the round. Point proposals (deterministic top-k), as
        EAGLE's."""
        device, rows = self.device, slice(0, r.batch)
        k = min(branching, len(self.draft_vocab))
        asked = [n if h is not None else 0 for n, h in zip(r.num_tokens, r.histories)]
        lengths = [len(h) - 1 if h is not None else 0 for h in r.histories]
        self.cache.reserve([1 + max(max(asked) - 1, 0) * k] * r.batch, requests=list(range(r.batch)))
        roots = last_tokens(r.histories, device)
        logits = self.target(roots.unsqueeze(1), self.cache, cache_rows=rows, layers=self.layers,
                             lm_head=self.lm_head)[:, 0]
        self.cache.advance(torch.ones(r.batch, dtype=torch.int32, device=device), rows)

        def expand(tokens, parents, chosen):
            first = tokens.shape[1] - k
            return self.target(tokens, self.cache, cache_rows=rows, layers=self.layers, lm_head=self.lm_head,
                               tree_mask=ancestor_mask(parents),
                               logits_indices=torch.arange(first, first + k, device=device))

        tree = grow_dynamic_tree(logits, self.draft_vocab, asked, branching, budget, roots, expand)
        self.cache.restore_lengths(lengths + [0] * (self.cache.batch_size - r.batch))
        return tree


# --------------------------------------------------------------------------------- its command-line spelling

def parse_layers(spec: str, value: str | None) -> dict:
    """self (the searched subset), self:L (the first L layers) or self:A,B,C (those layers), each optionally with
    /N after the layers (self:/N for the searched ones): a draft vocabulary of the first N token ids."""
    if value is None:
        return {"layers": "auto"}
    if not value:
        raise bad_spec(spec)
    layers, _, vocab = value.partition("/")
    out = {}
    try:
        if vocab or "/" in value:
            out["draft_vocab"] = int(vocab)
        numbers = [int(v) for v in layers.split(",")] if layers else None
    except ValueError:
        raise bad_spec(spec) from None
    out["layers"] = "auto" if numbers is None else numbers[0] if len(numbers) == 1 and "," not in layers else \
        tuple(numbers)
    return out


register_drafter(DrafterEntry(
    name="self", drafter_class=SelfSpeculativeDrafter, syntax="self[:LAYERS][/N]",
    help="self-speculative drafting with the target's own layers",
    value_help="L: the first L; A,B,C: those; without: searched on the model; /N: drafts over the first N token ids",
    parse=parse_layers, build=SelfSpeculativeDrafter))
