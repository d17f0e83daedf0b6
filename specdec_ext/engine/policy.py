"""How much a round drafts: k per request (fixed, transformers' heuristic, or adaptive from the measured costs and
the request's acceptance) and the node budget of tree rounds.

The costs: seconds of the target's forward over R rows and of one draft step over R rows, measured at a few row
counts R and kept in a file (specdec_ext/cost_tables.py), interpolated between them here.
"""
import time

import numpy as np

from ..cost_tables import draft_costs, forward_costs, seconds_table


def interpolate(points: dict, x: float) -> float:
    """Piecewise linear through {x: y} points; flat below the first (and for one point), extended with the last
    slope above the last."""
    xs = sorted(points)
    if x <= xs[0] or len(xs) == 1:
        return points[xs[0]]
    hi = next((i for i, v in enumerate(xs) if v >= x), len(xs) - 1)
    x0, x1 = xs[hi - 1], xs[hi]
    return points[x0] + (points[x1] - points[x0]) * (x - x0) / (x1 - x0)


class CostModel:
    """Seconds of a target forward over R rows and of a draft step over R rows, at measured points R (interpolated
    between), for the adaptive choice of k and tree size: on a CPU a verify block's cost jumps where its rows need
    another pass over the weights, and on any device it grows with the batch. draft: None for a drafter that does
    not say what its steps cost (counted as free).

    Seconds must be finite and >= 0. A zero (a step too fast to matter) is allowed, but a round is never free:
    verify_cost is at least a billionth of the tables' largest seconds (also where interpolation past the last point
    falls to zero or below), so tokens over cost is always defined and, among the cheapest rounds, the one with the
    most tokens wins. Tables of zeros only say nothing about costs: every verify then costs the same (1), and the
    largest k and tree win."""

    def __init__(self, verify: dict, draft: dict | None = None):
        checked = seconds_table(verify, zero_ok=True)
        if not checked:
            raise ValueError(f"CostModel: verify must be a non-empty dict of row counts >= 1 to finite seconds >= 0, "
                             f"got {verify!r:.200}")
        checked_draft = seconds_table(draft if draft is not None else {}, zero_ok=True)
        if checked_draft is None:
            raise ValueError(f"CostModel: draft must be a dict of row counts >= 1 to finite seconds >= 0, or None, got "
                             f"{draft!r:.200}")
        self.verify, self.draft = checked, checked_draft
        largest = max([*self.verify.values(), *self.draft.values()])
        self.floor = largest * 1e-9 or largest or 1.0  # largest itself where a billionth of it underflows

    @classmethod
    def measure(cls, target, drafter, max_rows: int, max_draft_rows: int, *, use_file: bool = True) -> "CostModel":
        """The tables of the target and of the drafter's step up to max_rows / max_draft_rows rows."""
        verify = forward_costs(target, max_rows, use_file=use_file)
        return cls(verify, draft_costs(drafter, target.device, max_draft_rows, use_file=use_file))

    def covers(self, max_rows: int, max_draft_rows: int) -> bool:
        """Whether the tables reach the row counts a run can ask for."""
        return max(self.verify) >= max_rows and (not self.draft or max(self.draft) >= max_draft_rows)

    def verify_cost(self, rows: int) -> float:
        return max(interpolate(self.verify, rows), self.floor)

    def draft_cost(self, rows: int) -> float:
        return max(interpolate(self.draft, rows), 0.0) if self.draft else 0.0

    def best_k(self, alphas, k_max: int, work=lambda k: (k, 1)) -> int:
        """argmax over k in [0, k_max] of a round's expected tokens over its cost, for requests of acceptance
        estimates `alphas` (a list, one per request, or one float: a batch of 1) all drafting k (Leviathan et
        al.: (1 - alpha^(k+1)) / (1 - alpha) tokens each, for the drafter's work(k) = (steps, rows per request)
        of draft steps and a verify block of B x (k + 1) rows)."""
        alphas = [min(a, 0.999) for a in (alphas if isinstance(alphas, (list, tuple)) else [alphas])]
        batch = len(alphas)

        def cost(k):
            steps, rows = work(k)
            return steps * self.draft_cost(batch * rows) + self.verify_cost(batch * (k + 1))

        def tokens(k):
            return sum((1 - a ** (k + 1)) / (1 - a) for a in alphas)
        return max(range(k_max + 1), key=lambda k: tokens(k) / cost(k))


class Policy:
    """The k of each request's next round and the node budget of a tree round.

    adaptive: False (always k_max), "heuristic" (transformers' assisted generation: +2 after a fully accepted
    round, -1 otherwise) or True: per request an acceptance estimate (drafted tokens up to and including the first
    rejection are the trials, decayed so that it follows the request's text; prior 0.5 with the weight of two
    trials), and one k for the round's requests (their verify block is as wide as the widest, so a wider k for one
    costs every row) that maximises their expected tokens over the round's cost, the drafter's own steps included.
    Tree rounds: the node budget (see tree_size). Every 8th round probes past the choice, so that low estimates
    can recover. With adaptive=True and costs measured here (none given), a measured guard backs the model: when
    the rounds that drafted emit fewer tokens a second of wall time than the rounds that did not (the model leaves
    out the host's share of a round), rounds are plain until that changes (plain_round). Given costs, the choices
    are the model's alone (and do not depend on wall time)."""

    def __init__(self, adaptive, k_max: int, tree, drafter, costs: CostModel | None, invariant_sampling=False,
                 rows_invariant=False):
        self.adaptive, self.k_max, self.tree, self.drafter = adaptive, k_max, tree, drafter
        self.costs = costs
        self.measured_costs = costs is None  # ours to extend when a later run needs more rows
        # Decayed [tokens emitted, seconds] of the rounds that drafted (True) and of those that did not (False).
        self.measured = {True: [0.0, 0.0], False: [0.0, 0.0]}
        self.invariant_sampling = invariant_sampling  # tokens that do not depend on the drafts (sampling="invariant")
        # the target's logits of a row do not depend on the rows verified with it (greedy tokens then do not depend on
        # the rounds' sizes): the guard's condition, as it follows wall time
        self.rows_invariant = rows_invariant

    def observe_round(self, drafted: bool, tokens: int, seconds: float) -> None:
        """A round's wall time and the tokens it emitted, for the guard of plain_round."""
        emitted, spent = self.measured[drafted]
        self.measured[drafted] = [0.9 * emitted + tokens, 0.9 * spent + seconds]

    def plain_round(self, running: list, round_index: int) -> bool:
        """Whether this round should not draft, by measurement: the rounds that drafted have emitted fewer tokens a
        second than plain rounds (decayed over the recent rounds of each kind). Every 16th round is plain, to keep
        that rate current, and every 8th drafts as the model chooses, to keep the other current. Only where the
        tokens do not depend on the rounds' drafts or sizes (the choice follows wall time): greedy requests or
        sampling="invariant", on a target whose rows have the same bits in any verify block (the CPU's integer
        path: rows_invariant)."""
        if self.adaptive is not True or not self.measured_costs or not self.rows_invariant or not running or \
                round_index % 8 == 7:
            return False
        if not self.invariant_sampling and any(r.temperature > 0 for r in running):
            return False
        (spec_tokens, spec_s), (plain_tokens, plain_s) = self.measured[True], self.measured[False]
        if round_index % 16 == 3:
            return spec_s > 0.0
        return spec_s > 0.0 and plain_s > 0.0 and spec_tokens * plain_s < plain_tokens * spec_s

    def calibrate(self, target, slots: int) -> float:
        """Measures (or reads) the cost tables a run of `slots` requests can use, when adaptive=True needs them and
        they were not given; returns the seconds that took."""
        if self.drafter is None or self.adaptive is not True or (self.costs is not None and not self.measured_costs):
            return 0.0
        width = self.tree.num_nodes if self.tree is not None else self.k_max + 1
        _, rows = self.drafter.draft_work(self.tree.depth if self.tree else self.k_max, self.tree)
        if self.costs is not None and self.costs.covers(slots * width, slots * rows):
            return 0.0
        t0 = time.perf_counter()
        self.costs = CostModel.measure(target, self.drafter, slots * width, slots * rows)
        return time.perf_counter() - t0

    def start(self, r) -> None:
        """A request admitted: its first k, and the per-node counts of tree rounds."""
        r.k = self.k_max if self.tree is None else self.tree.depth
        if self.tree is not None:
            r.node_hits, r.node_tries = np.zeros(self.tree.num_nodes - 1), np.zeros(self.tree.num_nodes - 1)

    def plan(self, running: list, round_index: int) -> int:
        """Sets the round's k of each running request; returns the node budget of a tree round (0 for chains)."""
        if self.plain_round(running, round_index):
            for r in running:
                r.k = 0
            return 1 if self.tree is not None else 0
        if self.tree is not None:
            return self.tree_size(running, round_index)
        if self.adaptive is True and running:
            alphas = [(r.accepted_ewma + 1.0) / (r.tried_ewma + 2.0) for r in running]
            k = self.costs.best_k(alphas, self.k_max, lambda k: self.drafter.draft_work(k))
            if k == 0 and round_index % 8 == 7:
                k = 1
            for r in running:
                r.k = k
        return 0

    def tree_size(self, running: list, round_index: int) -> int:
        """The round's node budget: tree.num_nodes, or with adaptive=True the n in [2, num_nodes] that maximises the
        running requests' expected tokens over the round's cost. Trees are best nodes first (specdec_ext.trees): a
        tree of n nodes is the first n of a bigger one, and its node i is accepted as often as in the bigger one, so
        a request's expected tokens are 1 + the sum of its first n - 1 nodes' acceptance rates (decayed counts;
        prior 0.5 with the weight of a tenth of a round). The round costs a verify over batch x n rows plus the
        drafter's work for a tree of depth min(depth, n - 1) (a tree of n nodes is at most n - 1 deep: the round's
        depth is cut to that too). n = 1, no tree, is a plain round: chosen when no tree pays for its drafting and
        its wider verify block. Every 8th round probes a tree twice that size (at least 2 nodes). A drafter that sizes
        its own trees (sizes_own_tree) gets the whole budget and plans its tree from the costs (None: adaptive is
        off)."""
        n_max, depth = self.tree.num_nodes, self.tree.depth
        if self.drafter.sizes_own_tree:  # it fills the budget as it sees fit (Lookahead)
            self.drafter.plan(self.costs if self.adaptive is True else None, len(running), round_index)
            n = n_max
        elif self.adaptive is not True or not running:
            n = n_max
        else:
            gain = sum(np.cumsum((r.node_hits + 0.05) / (r.node_tries + 0.1)) for r in running)  # [i]: n = i + 2
            batch = len(running)

            def cost(n):
                if n == 1:  # no tree: a plain round (the drafter is fed its features all the same)
                    return self.costs.verify_cost(batch)
                steps, rows = self.drafter.draft_work(min(depth, n - 1), self.tree)
                return steps * self.costs.draft_cost(batch * rows) + self.costs.verify_cost(batch * n)

            def tokens(n):
                return batch + (gain[n - 2] if n > 1 else 0.0)

            n = max(range(1, n_max + 1), key=lambda n: tokens(n) / cost(n))
            if round_index % 8 == 7:
                n = min(n_max, max(2, 2 * n))
        for r in running:
            r.k = min(depth, n - 1)
        return n

    def observe(self, r, num_draft: int, accepted: int, path=None) -> None:
        """After a round in which r drafted num_draft tokens (a tree: nodes below the root, `path` the accepted
        nodes) and `accepted` were accepted."""
        if self.tree is not None:
            if r.node_hits is not None and num_draft:
                r.node_hits *= 0.9
                r.node_tries *= 0.9
                r.node_tries[:num_draft] += 1
                r.node_hits[[node - 1 for node in path]] += 1
        elif self.adaptive is False:
            r.k = self.k_max
        elif self.adaptive == "heuristic":
            if num_draft:
                r.k = min(self.k_max, r.k + 2) if accepted == num_draft else max(1, r.k - 1)
        elif num_draft:
            r.accepted_ewma = 0.9 * r.accepted_ewma + accepted
            r.tried_ewma = 0.9 * r.tried_ewma + accepted + (accepted < num_draft)

    @staticmethod
    def room(r, max_seq_len: int) -> int:
        """The request's k for this round, cut so that the round cannot emit past max_new_tokens or max_seq_len (a
        round emits at most k + 1 tokens)."""
        room = min(r.max_new_tokens - len(r.generated), max_seq_len - len(r.tokens)) - 1
        return max(0, min(r.k, room))
