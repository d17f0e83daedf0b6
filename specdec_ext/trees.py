"""Draft trees: what a drafter proposes for a tree round of speculative decoding, and the pure helpers that build one.

A tree round verifies several continuations in one target forward. Node 0 is the root, the request's last emitted
token (it opens the verify block, as in a chain round); every other node is a draft token whose parent is an
earlier node. The target scores all N nodes at once with a tree mask (a node sees its ancestors and itself, at
position cache length + depth), tree_speculative_sampling_from_logits walks the tree from the root and accepts a
path, and truncate_kv_cache moves the path's K/V to the front of the block (kept_indices).

Drafters grow candidate nodes layer by layer with a score each (the cumulative log-probability of the path under
the draft, or any value that never rises from a parent to its child) and keep the best: best_tree() sorts the
candidates by score, best first, ties in the order they were grown, so a parent always precedes its children and
the first n nodes of a tree are the best tree of n nodes. The decoder relies on that order: node i + 1 is the
candidate of rank i, which is what its adaptive tree size measures.
"""
import math
from dataclasses import dataclass, field

import torch

from .host import upload
from .ops import LIMITS

MAX_TREE_NODES = LIMITS["max_tree_nodes"]  # the tree sampling op's limit on a block (verify_attention takes 128)


@dataclass(frozen=True)
class TreeSettings:
    """Tree rounds for SpeculativeDecoder(tree=...).

    num_nodes: nodes per tree, the root included: the verify block's width (at most 64); with adaptive=True the
    most a round uses. depth: the deepest draft token below the root (a round emits at most depth + 1 tokens).
    branching: children expanded per node: EAGLE's top-k at each expanded node and the number of nodes expanded
    per depth; Medusa's top-k per head; the n-gram drafter's number of matched continuations."""
    # Defaults for the shipped model on a CPU, where a verify block's cost grows about linearly up to 16 rows:
    # with adaptive=True a round uses 4-8 of the 16 nodes (bench/e2e.py's tree rows); a flatter cost (a GPU)
    # affords the whole budget.
    num_nodes: int = 16
    depth: int = 5
    branching: int = 4

    def __post_init__(self):
        for name, low, high in (("num_nodes", 2, MAX_TREE_NODES), ("depth", 1, MAX_TREE_NODES - 1),
                                ("branching", 1, MAX_TREE_NODES - 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
                raise ValueError(f"tree: {name} must be an int in [{low}, {high}], got {v!r}")
        if self.depth > self.num_nodes - 1:
            raise ValueError(f"tree: depth {self.depth} needs at least {self.depth + 1} num_nodes, got "
                             f"{self.num_nodes}")

    @classmethod
    def of(cls, spec) -> "TreeSettings":
        """TreeSettings from itself, a dict of its fields, an int (num_nodes, the other fields their defaults,
        depth cut to fit) or a string: "32" or "nodes=32,depth=6,branching=4" (any subset)."""
        if isinstance(spec, cls):
            return spec
        if isinstance(spec, str):
            text = spec.strip()
            if text.isdigit():
                spec = int(text)
            else:
                names = {"nodes": "num_nodes", "num_nodes": "num_nodes", "depth": "depth", "branching": "branching"}
                fields = {}
                for part in filter(None, text.split(",")):
                    key, _, value = part.partition("=")
                    if key.strip() not in names or not value.strip().lstrip("-").isdigit():
                        raise ValueError(f"tree: expected N or nodes=N,depth=D,branching=K, got {spec!r}")
                    fields[names[key.strip()]] = int(value)
                spec = fields
        if isinstance(spec, int) and not isinstance(spec, bool):
            return cls(num_nodes=spec, depth=max(1, min(cls.depth, spec - 1)))
        if isinstance(spec, dict):
            unknown = set(spec) - {"num_nodes", "depth", "branching"}
            if unknown:
                raise ValueError(f"tree: unknown settings {sorted(unknown)} (num_nodes, depth, branching)")
            return cls(**spec)
        raise ValueError(f"tree must be None, a TreeSettings, a dict, an int or a string, got {spec!r}")


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """parents [B, N] (-1: the root or padding) -> [B, N, N] bool, row c: c and its ancestors. The transitive
    closure of the parent relation by repeated squaring (log2 N boolean matrix products)."""
    b, n = parents.shape
    reach = torch.zeros(b, n, n, dtype=torch.float32, device=parents.device)
    reach.scatter_(2, parents.clamp_min(0).long().unsqueeze(-1), (parents >= 0).float().unsqueeze(-1))
    reach += torch.eye(n, device=parents.device)
    for _ in range(math.ceil(math.log2(max(n, 2)))):
        reach = torch.bmm(reach, reach).clamp_max_(1.0)
    return reach > 0


@dataclass
class DraftTree:
    """A drafted tree per request of a round (rows [0, batch) of the decoder's slots).

    parents [B, N] int32 (what the sampling op takes, with no range check on the host: a CUDA graph captures
    the verify step): node 0 is the root (-1), parents[b, c] < c for 0 < c < num_nodes[b], -1 past it.
    token_ids [B, N] int64: node 0 holds the root token (the last emitted one), padding 0.
    num_nodes [B] int32 on the device: nodes in request b's tree, root included (1: no drafts).
    draft_logits [B, N, V] or None: row n the draft distribution n's children were sampled from without
    replacement; None: children are point proposals (deterministic top-k, n-gram, Medusa).
    Derived: tree_mask [B, N, N] bool (ancestor-or-self: what verify_attention lets a node see of the block)
    and depths [B, N] (the root 0; padding 0)."""
    parents: torch.Tensor
    token_ids: torch.Tensor
    num_nodes: torch.Tensor
    draft_logits: torch.Tensor | None = None
    tree_mask: torch.Tensor = field(init=False, repr=False)
    depths: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self):
        self.parents = self.parents.int()
        self.tree_mask = ancestor_mask(self.parents)
        self.depths = self.tree_mask.sum(-1) - 1


def best_tree(parents: torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor, root_tokens: torch.Tensor,
              budget: int) -> DraftTree:
    """Candidates -> the tree of their best budget - 1 nodes below the root.

    parents [B, C] (candidate index of each candidate's parent, 0 = the root; candidate c's parent < c), tokens
    [B, C] (distinct among siblings), scores [B, C] float (-inf: not a candidate; never higher than the parent's,
    so the best nodes always include their ancestors), root_tokens [B]. Candidate indices count from 1 (0 is the
    root). Nodes come out best first (a stable sort: ties keep the candidates' order, in which parents come
    first), so parents precede children and a prefix of the tree is the best smaller tree."""
    b, c = scores.shape
    device = scores.device
    n = min(budget - 1, c)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :n]  # [B, n] candidates, best first
    valid = scores.gather(1, order).isfinite()
    # Where each kept candidate (1-based, 0 = root) lands in the tree: node j + 1 for the j-th best.
    node_of = torch.full((b, c + 1), -1, dtype=torch.long, device=device)
    node_of[:, 0] = 0
    rank = torch.arange(1, n + 1, device=device).expand(b, n)
    node_of.scatter_(1, torch.where(valid, order + 1, 0), torch.where(valid, rank, 0))
    node_parents = torch.full((b, n + 1), -1, dtype=torch.long, device=device)
    node_parents[:, 1:] = torch.where(valid, node_of.gather(1, parents.gather(1, order)), -1)
    node_tokens = torch.zeros(b, n + 1, dtype=torch.long, device=device)
    node_tokens[:, 0] = root_tokens
    node_tokens[:, 1:] = torch.where(valid, tokens.gather(1, order), 0)
    return DraftTree(node_parents, node_tokens, (valid.sum(1) + 1).int())


class Candidates:
    """Candidate nodes grown layer by layer on the device, for best_tree: add() a layer of [B, m] children of
    earlier candidates (0: the root) and get their candidate indices back."""

    def __init__(self, batch: int, device):
        self.parents, self.tokens, self.scores = [], [], []
        self.count, self.batch, self.device = 1, batch, device  # candidate 0 is the root

    def add(self, parents: torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.parents.append(parents.long())
        self.tokens.append(tokens.long())
        self.scores.append(scores.float())
        m = parents.shape[1]
        self.count += m
        return torch.arange(self.count - m, self.count, device=self.device).expand(self.batch, m)

    def best_tree(self, root_tokens: torch.Tensor, budget: int) -> DraftTree:
        if not self.parents:
            empty = torch.zeros(self.batch, 0, device=self.device)
            return best_tree(empty.long(), empty.long(), empty, root_tokens, budget)
        return best_tree(torch.cat(self.parents, 1), torch.cat(self.tokens, 1), torch.cat(self.scores, 1),
                         root_tokens, budget)


def grow_dynamic_tree(logits: torch.Tensor, vocab: torch.Tensor, asked: list, branching: int, budget: int,
                      roots: torch.Tensor, expand) -> DraftTree:
    """EAGLE-2's dynamic tree (Li et al. 2024), for any drafter that scores a block of tree nodes in one forward.

    The top-`branching` tokens after the root (logits [B, Vd] over vocab [Vd], the target ids of the columns) are
    the first layer; then, for each further depth, the `branching` best nodes of the last layer (by cumulative
    draft log-probability) are expanded in one forward and their top-`branching` tokens become the next layer.
    Finally the best budget - 1 nodes of all layers make the tree (a node's ancestors score higher, so they are in
    it). Row b's tree goes no deeper than asked[b] (0: the root alone). roots [B]: the root tokens.

    expand(tokens [B, n], parents [B, n], chosen [B, k] or None) -> logits [B, k, Vd]: the draft's next-token
    logits at the last k nodes of the block `tokens`: every node expanded so far, in the order expanded, each
    depth's k after the last (parents: slot of each node's parent in the block, -1: the root; a node sees the
    drafter's cache, then its ancestors in the block, at the cache length + its depth). chosen: which of the
    previous expand's last k nodes each of the new k is a child of (None on the first call: the root's children),
    for a drafter whose input carries state of the parent (EAGLE's predicted feature)."""
    device, k = logits.device, min(branching, len(vocab))
    batch, depth = len(asked), max(asked, default=0)
    deepest = upload(asked, torch.int64, device).unsqueeze(-1)  # [B, 1]: a row's tree goes this deep (0: none)
    nodes = Candidates(batch, device)
    top = logits.log_softmax(-1).topk(k)
    layer_scores = torch.where(deepest >= 1, top.values, float("-inf"))  # [B, k]: the layer's candidates
    layer_tokens = vocab[top.indices]
    layer = nodes.add(torch.zeros_like(top.indices), layer_tokens, layer_scores)
    frontier = torch.arange(k, device=device).expand(batch, k)  # the layer's nodes to expand (all of the first)
    chosen = None
    parent_slot = torch.full((batch, k), -1, device=device)  # the parent's slot in the block (-1: the root)
    block_tokens, block_parents = [], []
    for d in range(1, depth):
        block_tokens.append(layer_tokens.gather(1, frontier))
        block_parents.append(parent_slot)
        logits = expand(torch.cat(block_tokens, 1), torch.cat(block_parents, 1), chosen)
        top = logits.log_softmax(-1).topk(k)  # [B, k expanded, k children]
        scores = (layer_scores.gather(1, frontier).unsqueeze(-1) + top.values).flatten(1)
        layer_scores = torch.where(deepest > d, scores, float("-inf"))
        layer_tokens = vocab[top.indices].flatten(1)
        layer = nodes.add(layer.gather(1, frontier).repeat_interleave(k, 1), layer_tokens, layer_scores)
        frontier = layer_scores.topk(k).indices
        chosen = frontier // k  # which node this depth expanded each new frontier node is a child of
        parent_slot = (d - 1) * k + chosen
    return nodes.best_tree(roots, budget)


def trie(continuations: list) -> tuple[list, list, list]:
    """Token sequences -> their prefix trie as candidates for best_tree: (parents, tokens, counts), one entry per
    distinct prefix in the order first met, parents as candidate indices (0: the root, candidates from 1);
    count: how many of the sequences pass through the node (never more than its parent's)."""
    parents, tokens, counts, _ = trie_paths(continuations)
    return parents, tokens, counts


def trie_paths(sequences: list, max_nodes: int | None = None) -> tuple[list, list, list, list]:
    """trie() plus where each sequence went: (parents, tokens, counts, paths), paths[j] the nodes (candidate
    indices from 1) of sequence j's tokens. With max_nodes the trie stops growing at that many nodes: a sequence
    that would need more is cut there (its path is then a prefix of it)."""
    parents, tokens, counts, index, paths = [], [], [], {}, []
    for seq in sequences:
        node, path = 0, []
        for t in seq:
            key = (node, t)
            if key not in index:
                if max_nodes is not None and len(tokens) >= max_nodes:
                    break
                parents.append(node)
                tokens.append(t)
                counts.append(0)
                index[key] = len(tokens)
            node = index[key]
            counts[node - 1] += 1
            path.append(node)
        paths.append(path)
    return parents, tokens, counts, paths


def last_tokens(histories: list, device) -> torch.Tensor:
    """[B] int64: each row's last token (0 for idle rows), the roots of its tree."""
    return upload([h[-1] if h is not None else 0 for h in histories], torch.long, device)
