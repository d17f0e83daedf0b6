"""How much a round drafts: k per request (fixed, transformers' heuristic, or adaptive from the measured costs and
the request's acceptance) and the node budget of tree rounds.

The costs: seconds of the target's forward over R rows (batch x Q new tokens) and of one draft step over R rows
(what the drafter's cost_probe runs: a draft model's or head's forward, Medusa's heads, an n-gram lookup), at a
few row counts R, interpolated between them. A table is measured once per model (or drafter), dtype, device,
thread count and build, on the row counts a run can use, and kept in a file under the user's cache directory
($SPECDEC_CACHE_DIR, else $XDG_CACHE_HOME/specdec_ext, else ~/.cache/specdec_ext), so that a second run pays nothing
and chooses the same k. Live timings would make k, and with it the sampled tokens, depend on the machine's load; a
fixed table makes a run reproducible per seed.
"""
import dataclasses
import hashlib
import json
import math
import numbers
import os
import platform
import time
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch

import numpy as np

from .._version import __version__

# Around the CPU GEMM's 8-row passes and 16-row path; past 64, the widest tree blocks of a batch.
ROW_POINTS = (1, 2, 4, 8, 9, 12, 16, 17, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def interpolate(points: dict, x: float) -> float:
    """Piecewise linear through {x: y} points; flat below the first (and for one point), extended with the last
    slope above the last."""
    xs = sorted(points)
    if x <= xs[0] or len(xs) == 1:
        return points[xs[0]]
    hi = next((i for i, v in enumerate(xs) if v >= x), len(xs) - 1)
    x0, x1 = xs[hi - 1], xs[hi]
    return points[x0] + (points[x1] - points[x0]) * (x - x0) / (x1 - x0)


def row_points(max_rows: int) -> list:
    """The row counts measured for runs of up to max_rows rows: ROW_POINTS below it, and max_rows itself."""
    return sorted({r for r in ROW_POINTS if r < max_rows} | {max(1, max_rows)})


def cache_dir() -> Path:
    base = os.environ.get("SPECDEC_CACHE_DIR")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdec_ext"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                        platform.processor())
    except OSError:
        return platform.processor() or platform.machine()


def environment(device: torch.device) -> dict:
    """What any step's cost depends on besides its own shape: the device, the threads and the build."""
    from .. import build_info

    info = build_info()
    return {"device": _device_name(device), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "specdec_ext": __version__,
            "build": {k: info.get(k) for k in ("compiler", "cpu_features_compiled", "cuda_archs", "openmp")}}


def table_key(model) -> dict:
    """What a forward's cost depends on: the model's shape and dtype, and the environment."""
    return {"config": dataclasses.asdict(model.config), "dtype": str(model.dtype), **environment(model.device)}


def _table_file(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return cache_dir() / "costs" / f"{digest}.json"


def step_seconds(step, device: torch.device, repeats: int = 3) -> float:
    """Median seconds of step() over `repeats` runs after a warm-up."""
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[len(times[1:]) // 2]


def forward_step(model, rows: int):
    """One forward of Q = rows new tokens at batch 1 on a scratch cache, as a function of nothing."""
    cache = model.new_kv_cache(1, rows + 1)
    ids = torch.zeros(1, rows, dtype=torch.long, device=model.device)
    indices = torch.arange(rows, device=model.device)
    return lambda: model(ids, cache, logits_indices=indices)


def forward_seconds(model, rows: int) -> float:
    return step_seconds(forward_step(model, rows), model.device)


def seconds_table(table, *, zero_ok: bool) -> dict | None:
    """table as {int rows: float seconds} when it maps row counts >= 1 to finite seconds > 0 (>= 0 with
    zero_ok), else None: a NaN would make every tokens-over-cost comparison false (k = 0 every round), a negative or
    zero cost a free round."""
    if not isinstance(table, Mapping):
        return None
    for r, s in table.items():
        if isinstance(r, bool) or not isinstance(r, numbers.Integral) or r < 1 or isinstance(s, bool) or \
                not isinstance(s, numbers.Real) or not math.isfinite(s) or not (s > 0 or zero_ok and s == 0):
            return None
    return {int(r): float(s) for r, s in table.items()}


def _read_table(path: Path, key: dict) -> dict:
    """The {rows: seconds} saved for `key` at path; {} (measure again) where there is none, or it is another
    version's, or it does not pass seconds_table (a hand edit, a truncated write, a timer's zero)."""
    try:
        saved = json.loads(path.read_text())
        if not isinstance(saved, dict) or saved.get("key") != json.loads(json.dumps(key, default=str)):
            return {}
        rows = saved["seconds"]
        if not isinstance(rows, dict) or not all(r.isascii() and r.isdigit() for r in rows):
            return {}
        return seconds_table({int(r): s for r, s in rows.items()}, zero_ok=False) or {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return {}


def _write_table(path: Path, key: dict, table: dict) -> None:
    """Replaces the file at path by the table, through a temp file that a failed write removes; a file that cannot
    be written (a read-only cache, a directory at its path) is warned of: the table is measured again next run."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"key": key, "seconds": table}, default=str, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        warnings.warn(f"specdec_ext: cannot write the cost table cache {path} ({e}); it is measured again next run",
                      RuntimeWarning, stacklevel=3)


def cost_table(key: dict, seconds_of, max_rows: int, *, use_file: bool = True) -> dict:
    """{rows: seconds} at row_points(max_rows) of the step that `key` names: read from its cache file where it has
    them, measured by seconds_of(rows) (and added to the file) where it does not. A file whose table is not valid
    (seconds_table) counts as absent: measured again and overwritten. A measured table with a zero (a step under
    the timer's resolution) is used by this run but not written: a cached zero would make every later run's rounds
    free."""
    path = _table_file(key)
    table = _read_table(path, key) if use_file else {}
    missing = [r for r in row_points(max_rows) if r not in table]
    for r in missing:
        table[r] = seconds_of(r)
    if missing and use_file and seconds_table(table, zero_ok=False) is not None:
        _write_table(path, key, table)
    return {r: table[r] for r in row_points(max_rows)}


def forward_costs(model, max_rows: int, *, use_file: bool = True) -> dict:
    """{rows: seconds} of `model`'s forward at row_points(max_rows) (see cost_table)."""
    return cost_table(table_key(model), lambda rows: forward_seconds(model, rows), max_rows, use_file=use_file)


def draft_costs(drafter, device: torch.device, max_rows: int, *, use_file: bool = True) -> dict | None:
    """{rows: seconds} of one draft step of `drafter` (its cost_probe) at row_points(max_rows); None when the
    drafter does not say."""
    probe = drafter.cost_probe()
    if probe is None:
        return None
    key, prepare = probe
    key = {**environment(device), **key}
    return cost_table(key, lambda rows: step_seconds(prepare(rows), device), max_rows, use_file=use_file)


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

        tokens = lambda k: sum((1 - a ** (k + 1)) / (1 - a) for a in alphas)
        return max(range(k_max + 1), key=lambda k: tokens(k) / cost(k))


class Policy:
    """The k of each request's next round and the node budget of a tree round.

    adaptive: False (always k_max), "heuristic" (transformers' assisted generation: +2 after a fully accepted
    round, -1 otherwise) or True: per request an acceptance estimate (drafted tokens up to and including the first
    rejection are the trials, decayed so that it follows the request's text; prior 0.5 with the weight of two
    trials), and one k for the round's requests (their verify block is as wide as the widest, so a wider k for one
    costs every row) that maximises their expected tokens over the round's cost, the drafter's own steps included.
    Tree rounds: the node budget (see tree_size). Every 8th round probes past the choice, so that low estimates
    can recover."""

    def __init__(self, adaptive, k_max: int, tree, drafter, costs: CostModel | None):
        self.adaptive, self.k_max, self.tree, self.drafter = adaptive, k_max, tree, drafter
        self.costs = costs
        self.measured_costs = costs is None  # ours to extend when a later run needs more rows

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
        depth is cut to that too). Every 8th round probes a tree twice that size. A drafter that sizes its own trees
        (sizes_own_tree) gets the whole budget and plans its tree from the costs (None: adaptive is off)."""
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
                steps, rows = self.drafter.draft_work(min(depth, n - 1), self.tree)
                return steps * self.costs.draft_cost(batch * rows) + self.costs.verify_cost(batch * n)

            n = max(range(2, n_max + 1), key=lambda n: (batch + gain[n - 2]) / cost(n))
            if round_index % 8 == 7:
                n = min(n_max, 2 * n)
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
