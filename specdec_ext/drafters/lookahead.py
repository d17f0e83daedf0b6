"""Lookahead decoding (Fu, Bailis, Stoica and Zhang, 2024): a Jacobi window and an n-gram pool inside the target's
own verify forward; no draft model, no training.

Each round is one target forward over a tree rooted at the request's last emitted token (node at depth d: position
cache length + d; verify_attention's tree mask lets a node see its ancestors):
  - the verification branch: up to G guesses of N - 1 tokens that may follow the root: what followed earlier
    occurrences of the request's last 2-3 tokens (prompt lookup), then the pool's n-grams that start with the root
    token (latest first), then what followed earlier occurrences of the root token alone;
  - the lookahead branch: the Jacobi window, L <= N - 1 levels of W tokens, level l column i at depth i + l + 1.
    Level 0 is a chain from the root (the trunk); column i hangs levels 1 .. L - 1 below the trunk's node i, so that
    a window node's ancestors are the contiguous guess of the positions before it, which is what a Jacobi iteration
    feeds it.
Guesses and columns are token sequences from the root, merged into one prefix trie (a node is a token at a depth
under given ancestors: an equal prefix is the same computation), so the method's 2-D mask is a tree mask, ragged per
request.

The tree sampling op verifies the whole tree (point proposals: lossless at any temperature, greedy output equal to
plain greedy decoding) and truncate_kv_cache keeps the accepted path only: the window's K/V never stay in the cache.
From the same forward, the target's greedy token at each column's last level is that column's next level; once the
window holds N - 1 levels, each column with its new token is an n-gram (levels[0][i], ..., levels[N-2][i], new[i])
that enters the pool under its first token, and the oldest level is dropped.
"""
from dataclasses import dataclass

import numpy as np
import torch

from ..host import upload
from ..trees import MAX_TREE_NODES, DraftTree, TreeSettings, trie_paths
from .base import Drafter, Proposal, RoundFeedback, RoundInputs, padded
from .ngram import NgramDrafter
from .registry import DrafterEntry, register_drafter


@dataclass
class LookaheadStats:
    """What the drafter did over a generate call (reset by each)."""
    steps: int = 0            # rounds it proposed a tree for (one target forward each)
    window_steps: int = 0     # of which ran the Jacobi window
    accepted_tokens: int = 0  # drafts accepted
    history_hits: int = 0     # rounds whose accepted path was a continuation of the request's own tokens
    pool_hits: int = 0        # rounds whose accepted path was an n-gram of the pool (the window's, earlier)
    window_hits: int = 0      # rounds whose accepted path ran through the window's own nodes only
    pool_ngrams: int = 0      # n-grams the window added to the pools

    @property
    def accepted_per_step(self) -> float:
        return self.accepted_tokens / self.steps if self.steps else 0.0

    def summary(self) -> str:
        return (f"lookahead: {self.accepted_per_step:.2f} drafts accepted per step; accepted paths from the request's "
                f"own tokens {self.history_hits}, from the pool {self.pool_hits}, from the window {self.window_hits}; "
                f"{self.pool_ngrams} n-grams pooled; window run in {self.window_steps} of {self.steps} steps")


@dataclass
class _Round:
    """A row's last proposal, for rollback: the nodes of each guess and column, and where each guess came from."""
    guesses: list   # [g] node lists
    sources: list   # [g] "history" or "pool"
    columns: list   # [w] node lists: column i's trunk nodes 0..i, then its levels 1..L-1 (shorter if cut)
    levels: int     # L, the window's levels when proposed


class _Request:
    """One slot's state: its window, its pool and the decayed counts that size its rounds."""

    def __init__(self, guesses: int, length: int):
        self.levels = None  # the Jacobi window: up to N - 1 levels of W tokens, oldest first (None: not yet seeded)
        self.pool = {}      # first token -> tuples of the N - 1 tokens that followed it, latest first
        self.round = None
        # Decayed rounds whose accepted path ran through guess rank j to depth d + 1 ([j, d]), and rounds that offered
        # rank j; tokens credited to the window (its own nodes, and the pool n-grams it made), and the columns it ran.
        self.guess_hits, self.guess_tries = np.zeros((guesses, length)), np.zeros(guesses)
        self.window_hits = self.window_tries = 0.0


class LookaheadDrafter(Drafter):
    """Lookahead decoding: window W (Jacobi columns), ngram N (n-gram size: a window of N - 1 levels and guesses of
    N - 1 tokens), guesses G (verification n-grams per round). Its rounds are tree rounds of at most
    1 + (W + G) * (N - 1) nodes (round_tree()), at most the tree sampling op's 64.

    The paper runs N = 5 with W = G (15 for its 7B models: 121 nodes, past the 64-node verify block); the defaults are
    N = 5 and W = G = 7, the widest equal pair that fits (57 nodes). With the decoder's adaptive=True each round runs
    the w <= W columns and g <= G guesses of l <= N - 1 tokens that maximise the expected tokens over the round's
    measured cost (plan()); on a GPU a wide block costs about what one row does, on a CPU it grows with the rows, and
    the plan shrinks to what pays."""

    supports_trees = True
    sizes_own_tree = True
    needs_block_argmax = True

    def __init__(self, window: int = 7, ngram: int = 5, guesses: int = 7):
        for name, value, low in (("window", window, 1), ("ngram", ngram, 2), ("guesses", guesses, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value < MAX_TREE_NODES:
                raise ValueError(f"LookaheadDrafter: {name} must be an int in [{low}, {MAX_TREE_NODES - 1}], got "
                                 f"{value!r}")
        nodes = 1 + (window + guesses) * (ngram - 1)
        if nodes > MAX_TREE_NODES:
            raise ValueError(f"LookaheadDrafter: window={window}, ngram={ngram}, guesses={guesses} make a verify block "
                             f"of 1 + (W + G) * (N - 1) = {nodes} nodes, past the tree sampling op's limit of "
                             f"{MAX_TREE_NODES}: lower window, guesses or ngram")
        self.window, self.ngram, self.guesses = window, ngram, guesses
        self._long = NgramDrafter(max_ngram=3, min_ngram=2)  # the request's own tokens: suffix of 2-3 tokens
        self._short = NgramDrafter(max_ngram=1, min_ngram=1)  # the root token alone
        self.device = torch.device("cpu")
        self.requests, self.stats, self.pad_to_budget = [], LookaheadStats(), False
        self.planned = (window, guesses, ngram - 1)  # (w, g, guess length) of the next round

    def round_tree(self) -> TreeSettings:
        nodes = 1 + (self.window + self.guesses) * (self.ngram - 1)
        return TreeSettings(num_nodes=nodes, depth=min(self.window + self.ngram - 2, nodes - 1),
                            branching=max(1, self.guesses))

    def check_tree(self, tree) -> None:
        pass  # any node budget: the trie is cut to it

    # --------------------------------------------------------------------------------------------- lifecycle
    def bind(self, target, slots: int, capacity: int, *, paged: bool = False, num_pages=None,
             cuda_graphs: bool = False) -> None:
        # On CUDA (where CUDA graphs run) every tree is as wide as the budget: one verify graph per budget, not one per
        # width, and eager rounds do the arithmetic replayed ones do (the GEMMs' accumulation order depends on the row
        # count; bfloat16 logits a rounding apart would let sampled tokens differ). Spare rows cost little on a GPU.
        self.device, self.pad_to_budget = target.device, target.device.type == "cuda"
        self.requests = [None] * slots
        self.stats = LookaheadStats()
        self.planned = (self.window, self.guesses, self.ngram - 1)

    def admit(self, slots: list, prefixes: list, hidden_states=None) -> None:
        for b in slots:
            self.requests[b] = _Request(self.guesses, self.ngram - 1)

    def release(self, slot: int) -> None:
        self.requests[slot] = None

    # ------------------------------------------------------------------------------------------------ sizing
    def plan(self, costs, batch: int, round_index: int) -> None:
        """The (w, g, l) of the next round: w columns, g guesses cut to l <= N - 1 tokens. Without costs (W, G, N - 1);
        with them the triple that maximises the running requests' expected tokens over the round's cost. A request's
        expected tokens: 1, plus for each guess rank j < g and depth d < l its decayed rate of accepted paths through
        rank j reaching depth d + 1 (prior 0.5^(d+1) with the weight of a tenth of a round), plus w times the window's
        tokens per column run (the window's own nodes and the pool n-grams it made; prior 0.5, same weight). The cost:
        the host's lookups and a verify of batch x (1 + g l + w (N - 1)) rows. Short guesses are what a CPU affords,
        whose verify cost grows with the rows; a GPU's flat cost affords the whole block. Every 8th round probes one
        more column and guess at full length, so that low estimates can recover."""
        length = self.ngram - 1
        if costs is None:
            self.planned = (self.window, self.guesses, length)
            return
        live = [s for s in self.requests if s is not None]
        prior = 0.05 * 0.5 ** np.arange(length)
        depth_gain = sum(((s.guess_hits + prior) / (s.guess_tries[:, None] + 0.1) for s in live),
                         np.zeros((self.guesses, length)))
        # gain[g, l]: guesses 0..g-1 cut to l tokens
        gain = np.zeros((self.guesses + 1, length + 1))
        gain[1:, 1:] = np.cumsum(np.cumsum(depth_gain, 0), 1)
        column_gain = sum((s.window_hits + 0.05) / (s.window_tries + 0.1) for s in live)
        rows = max(batch, 1)

        def rate(plan):  # plan = (w, g, l): cut is l, the guesses' length
            w, g, cut = plan
            return (rows + gain[g, cut] + w * column_gain) / \
                (costs.draft_cost(rows) + costs.verify_cost(rows * (1 + g * cut + w * length)))

        plans = [(w, g, cut) for w in range(self.window + 1) for g in range(self.guesses + 1)
                 for cut in (range(1, length + 1) if g else (length,))]
        w, g, cut = max(plans, key=rate)
        if round_index % 8 == 7:
            w, g, cut = min(self.window, w + 1), min(self.guesses, g + 1), length
        self.planned = (w, g, cut)

    # -------------------------------------------------------------------------------------------- proposing
    def _guesses(self, s: _Request, history, count: int) -> tuple[list, list]:
        """Up to `count` continuations of N - 1 tokens of the root: the request's own tokens after its last 2-3, the
        pool's n-grams of the root token, then its own tokens after the root alone; distinct."""
        k = self.ngram - 1
        found = self._long.continuations(history, k, count)
        sources = ["history"] * len(found)
        for gram in s.pool.get(history[-1], ()):
            if len(found) >= count:
                break
            if list(gram) not in found:
                found.append(list(gram))
                sources.append("pool")
        for seq in self._short.continuations(history, k, count):
            if len(found) >= count:
                break
            if seq not in found:
                found.append(seq)
                sources.append("history")
        return found, sources

    @staticmethod
    def _seed_level(history, width: int) -> list:
        """The window's first level: tokens of the request's history at evenly spaced places (the method starts from
        any guess; text of the request is a better one than random ids)."""
        return [history[(i * len(history)) // width] for i in range(width)]

    def _row(self, s: _Request, history, k: int, budget: int) -> tuple[list, list]:
        """A row's trie (parents, tokens) of at most budget - 1 nodes and depth k; records the round on s."""
        w, g, length = self.planned
        if s.levels is None:
            s.levels = [self._seed_level(history, self.window)]
        guesses, sources = self._guesses(s, history, g)
        levels = s.levels
        columns = [levels[0][:i + 1] + [level[i] for level in levels[1:]] for i in range(w)]
        sequences = [q[:min(k, length)] for q in guesses] + [q[:k] for q in columns]
        parents, tokens, _, paths = trie_paths(sequences, budget - 1)
        s.round = _Round(paths[:len(guesses)], sources, paths[len(guesses):], len(levels))
        return parents, tokens

    def propose_tree(self, r: RoundInputs, budget: int, branching: int) -> DraftTree:
        """The trie of each row's guesses and window columns (see the module's docstring), cut to `budget` nodes (the
        guesses first) and to depth r.num_tokens[b]; point proposals."""
        parents, tokens = [], []
        for b in range(r.batch):
            h, k, s = r.histories[b], r.num_tokens[b], self.requests[b] if b < len(self.requests) else None
            if h is None or s is None or k <= 0:
                if s is not None:
                    s.round = None
                parents.append([-1])
                tokens.append([h[-1] if h else 0])
                continue
            p, t = self._row(s, h, k, budget)
            parents.append([-1] + p)
            tokens.append([h[-1]] + t)
        self.stats.steps += 1
        self.stats.window_steps += self.planned[0] > 0
        num_nodes = upload([len(t) for t in tokens], torch.int32, self.device)
        if self.pad_to_budget:
            parents[0] = parents[0] + [-1] * (budget - len(parents[0]))
            tokens[0] = tokens[0] + [0] * (budget - len(tokens[0]))
        return DraftTree(padded(parents, -1, torch.int32, self.device), padded(tokens, 0, torch.int64, self.device),
                         num_nodes)

    def propose(self, r: RoundInputs) -> Proposal:
        """Chain rounds (a ChainRound driving this drafter directly): each row's first guess, no window."""
        drafts = []
        for b in range(r.batch):
            h, k, s = r.histories[b], r.num_tokens[b], self.requests[b] if b < len(self.requests) else None
            found = self._guesses(s, h, 1)[0] if h is not None and s is not None and k > 0 else []
            drafts.append(found[0][:k] if found else [])
        return Proposal(padded(drafts, 0, torch.int64, self.device), [len(d) for d in drafts])

    # ---------------------------------------------------------------------------------------------- rollback
    def rollback(self, feedback: RoundFeedback) -> None:
        """Credits the accepted path to the guess or window that proposed it, then advances each window that ran by
        the target's greedy tokens at its columns' last levels (block_argmax, of the round's forward)."""
        for b, accepted in enumerate(feedback.num_accepted):
            s = self.requests[b] if b < len(self.requests) else None
            if s is None or s.round is None or accepted < 0 or feedback.paths is None:
                continue
            rnd, s.round = s.round, None
            self._credit(s, rnd, feedback.paths[b])
            if rnd.columns:
                self._jacobi_step(s, rnd, feedback.block_argmax[b])

    def _credit(self, s: _Request, rnd: _Round, path: list) -> None:
        a = len(path)
        s.guess_hits *= 0.9
        s.guess_tries *= 0.9
        s.window_hits *= 0.9
        s.window_tries *= 0.9
        s.guess_tries[:self.planned[1]] += 1
        s.window_tries += len(rnd.columns)
        self.stats.accepted_tokens += a
        if not a:
            return
        rank = next((j for j, nodes in enumerate(rnd.guesses) if nodes[:a] == path), None)
        if rank is not None:
            s.guess_hits[rank, :a] += 1
            if rnd.sources[rank] == "pool":
                s.window_hits += a
                self.stats.pool_hits += 1
            else:
                self.stats.history_hits += 1
        elif any(nodes[:a] == path for nodes in rnd.columns):
            s.window_hits += a
            self.stats.window_hits += 1

    def _jacobi_step(self, s: _Request, rnd: _Round, argmax: list) -> None:
        """The window's next level from the target's greedy tokens at each column's last level (a column cut by the
        budget or the depth keeps its last guess); with N - 1 levels, the columns' n-grams go to the pool and the
        oldest level is dropped."""
        levels = s.levels
        new = list(levels[-1])
        done = [len(nodes) == i + rnd.levels for i, nodes in enumerate(rnd.columns)]
        for i, nodes in enumerate(rnd.columns):
            if done[i]:
                new[i] = argmax[nodes[-1]]
        if len(levels) < self.ngram - 1:
            levels.append(new)
            return
        for i, ok in enumerate(done):
            if ok:
                grams = s.pool.setdefault(levels[0][i], [])
                gram = tuple(level[i] for level in levels[1:]) + (new[i],)
                if gram in grams:
                    grams.remove(gram)
                grams.insert(0, gram)
                del grams[self.guesses:]
                self.stats.pool_ngrams += 1
        s.levels = levels[1:] + [new]

    # ---------------------------------------------------------------------------------------------- costs
    def cost_probe(self):
        """The host work of one round per row: the guesses' lookups over a 512-token history of random tokens (a
        miss scans every suffix) and the upload of a tree; no model step."""
        history = np.random.default_rng(0).integers(0, 32000, 512).tolist()
        probe = _Request(self.guesses, self.ngram - 1)

        def step(rows):
            for _ in range(rows):
                self._guesses(probe, history, self.guesses)
            return padded([[0] * (1 + (self.window + self.guesses) * (self.ngram - 1))] * rows, 0, torch.int64,
                          self.device)

        key = {"drafter": "lookahead", "window": self.window, "ngram": self.ngram, "guesses": self.guesses}
        return key, lambda rows: (lambda: step(rows))


# --------------------------------------------------------------------------------- its command-line spelling


def lookahead_settings(spec: str, value: str | None) -> dict:
    """'lookahead' or 'lookahead:W/N/G' -> LookaheadDrafter's arguments (checked by building one)."""
    if value is None:
        return {}
    parts = value.split("/")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--drafter lookahead:W/N/G takes three ints (window, ngram, guesses), got {spec!r}")
    settings = dict(zip(("window", "ngram", "guesses"), (int(p) for p in parts)))
    try:
        LookaheadDrafter(**settings)
    except ValueError as e:
        raise ValueError(f"--drafter {spec}: {e}") from None
    return settings


register_drafter(DrafterEntry(
    name="lookahead", drafter_class=LookaheadDrafter, syntax="lookahead[:W/N/G]",
    help="Lookahead decoding: a Jacobi window and an n-gram pool; trees of its own", parse=lookahead_settings,
    build=lambda target, **settings: LookaheadDrafter(**settings), drafts_from_the_text=True))
