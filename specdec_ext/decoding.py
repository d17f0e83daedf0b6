"""Speculative decoding of a target model on this library's ops, and plain decoding on the same machinery.

One round, for every running request at once (ragged: each at its own length and with its own k):
  1. the drafter proposes up to k tokens per request;
  2. the target scores the request's last emitted token plus its drafts in one forward (Q = k + 1);
  3. chain_speculative_sampling_from_logits accepts a prefix of the drafts and draws the next token (greedy and
     sampled requests in one launch, temperature inside the kernel, top-k/top-p masks applied to target and
     draft logits alike), and truncate_kv_cache keeps num_accepted + 1 of the block in the target's cache;
  4. one host read of the emitted tokens: requests advance by their own counts, the drafter rolls back,
     finished requests free their slot and the next prompt is admitted (continuous batching).
Plain decoding (generate_autoregressive) is the same round with no drafts.

Tree rounds (SpeculativeDecoder(tree=...)): the drafter proposes a tree of candidates per request (specdec_ext.trees)
instead of a chain; the target scores [last emitted token = root, nodes...] in one forward under the tree mask,
tree_speculative_sampling_from_logits accepts a path from the root and draws the next token, and truncate_kv_cache
moves the path's K/V to the front of the block (kept_indices). The drafter rolls back with the target's hidden
states of the path, in path order, as if it had been a chain.

Invariants: the target's cache holds every token of a request but the last emitted one, which opens the next
verify block. Request r's round draws from Philox key seed[r] at offset = tokens r has generated, so its output
depends on its own prompt, parameters and seed only.
"""
import math
import time
import warnings
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from .drafting import RoundInputs
from .graphs import StepGraphs
from .ops import LIMITS, SamplingOutput, chain_speculative_sampling_from_logits, tree_speculative_sampling_from_logits
from .sampling import mask_top_k_top_p
from .trees import TreeSettings


@dataclass
class GenerationStats:
    num_drafts: int = 0              # rounds that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list = field(default_factory=list)  # [i]: rounds whose draft i (0-based) was accepted
    drafted_per_position: list = field(default_factory=list)   # [i]: rounds that drafted a token i
    target_forwards: int = 0         # per request: verify rounds it took part in; in total: every target forward
    generated_tokens: int = 0
    elapsed_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0            # the target's verify forwards
    sample_s: float = 0.0            # masks, the sampling kernel and the cache truncation
    other_s: float = 0.0             # prefills and the host's bookkeeping
    k_per_round: list = field(default_factory=list)  # per request: the k asked of the drafter each round (tree
    #                                                    rounds: the tree's nodes below the root)
    accepted_depths: list = field(default_factory=list)  # each round with drafts: the drafts accepted (chain: the
    #                                                    accepted prefix; tree: the accepted path's depth); in total,
    #                                                    every request's rounds in order

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts (vLLM's definition): tokens emitted per target forward of a speculative round."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate_per_position(self) -> list:
        """[i]: the share of rounds drafting a token i whose token i was accepted (vLLM's per-position rate)."""
        return [(self.accepted_per_position[i] if i < len(self.accepted_per_position) else 0) / n
                for i, n in enumerate(self.drafted_per_position)]

    @property
    def mean_accepted_depth(self) -> float:
        """Drafts accepted per round with drafts (tree rounds: the accepted path's depth below the root); a round
        emits one token more."""
        return sum(self.accepted_depths) / len(self.accepted_depths) if self.accepted_depths else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def add_round(self, num_draft: int, num_accepted: int, depth: int | None = None) -> None:
        """A round that verified num_draft drafts and accepted num_accepted; depth: a tree's depth (positions are
        depths below the root: drafted_per_position[i] counts the rounds whose tree reached depth i + 1)."""
        if num_draft:
            positions = num_draft if depth is None else depth
            self.num_drafts += 1
            self.num_draft_tokens += num_draft
            self.num_accepted_tokens += num_accepted
            self.accepted_depths.append(num_accepted)
            if len(self.drafted_per_position) < positions:
                self.drafted_per_position += [0] * (positions - len(self.drafted_per_position))
            for i in range(positions):
                self.drafted_per_position[i] += 1
            if len(self.accepted_per_position) < num_accepted:
                self.accepted_per_position += [0] * (num_accepted - len(self.accepted_per_position))
            for i in range(num_accepted):
                self.accepted_per_position[i] += 1


@dataclass
class GenerationOutput:
    sequences: list  # list[list[int]]: each request's generated tokens (prompt excluded, EOS included)
    stats: GenerationStats
    request_stats: list = field(default_factory=list)


class AcceptanceMonitor:
    """Acceptance over the last `window` drafted tokens; warns (once, until it recovers) when it falls below
    `threshold`. Give it to SpeculativeDecoder(monitor=...) or call observe() yourself."""

    def __init__(self, window: int = 1000, threshold: float = 0.3):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"AcceptanceMonitor: window must be an int >= 1, got {window!r}")
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"AcceptanceMonitor: threshold must be in [0, 1], got {threshold!r}")
        self.window, self.threshold = window, threshold
        self.outcomes = deque(maxlen=window)  # 1 accepted, 0 rejected or never reached, per drafted token
        self.warned = False

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.outcomes.extend([1] * num_accepted + [0] * (num_draft_tokens - num_accepted))
        rate = self.acceptance_rate
        if len(self.outcomes) == self.window and rate < self.threshold and not self.warned:
            warnings.warn(f"speculative decoding: acceptance rate {rate:.2f} over the last {self.window} draft "
                          f"tokens is below {self.threshold:.2f}", RuntimeWarning, stacklevel=2)
            self.warned = True
        elif rate >= self.threshold:
            self.warned = False

    @property
    def acceptance_rate(self) -> float:
        return sum(self.outcomes) / len(self.outcomes) if self.outcomes else 1.0


def per_request(value, name: str, batch: int, kind) -> list:
    """A scalar broadcast to the batch, or a list/tuple with one entry per request, each checked."""
    values = list(value) if isinstance(value, (list, tuple)) else [value] * batch
    if len(values) != batch:
        raise ValueError(f"{name} has {len(values)} entries for {batch} prompts")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, kind):
            raise ValueError(f"{name} must be {'an int' if kind is int else 'a number'} (or one per prompt), got {v!r}")
    return values


def check_prompts(prompts, vocab_size: int) -> list:
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    out = []
    for r, p in enumerate(prompts):
        ids = p.tolist() if isinstance(p, torch.Tensor) else list(p)
        if not ids:
            raise ValueError(f"prompt {r} is empty")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in ids):
            raise ValueError(f"prompt {r} holds token ids outside [0, {vocab_size})")
        out.append(ids)
    return out


@dataclass
class Request:
    index: int
    prompt: list
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    generated: list = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    k: int = 0                 # the k of the next round (adaptive)
    accepted_ewma: float = 0.0  # decayed counts of accepted and of tried draft tokens: the acceptance estimate
    tried_ewma: float = 0.0
    node_hits: np.ndarray | None = None   # tree rounds: decayed counts, per tree node (= rank) i + 1, of rounds that
    node_tries: np.ndarray | None = None  # accepted it and of rounds whose tree held it
    started: float = 0.0

    @property
    def tokens(self) -> list:
        return self.prompt + self.generated


def interpolate(points: dict, x: float) -> float:
    """Piecewise linear through {x: y} points; flat below the first (and for one point), extended with the last
    slope above the last."""
    xs = sorted(points)
    if x <= xs[0] or len(xs) == 1:
        return points[xs[0]]
    hi = next((i for i, v in enumerate(xs) if v >= x), len(xs) - 1)
    x0, x1 = xs[hi - 1], xs[hi]
    return points[x0] + (points[x1] - points[x0]) * (x - x0) / (x1 - x0)


# Around the CPU GEMM's 8-row passes and 16-row path; past 64, the widest tree blocks of a batch.
ROW_POINTS = (1, 2, 4, 8, 9, 12, 16, 17, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def draft_cost_model(drafter):
    """What CostModel measures a draft step of `drafter` on: its draft model, or an EAGLE head's one-layer decoder
    (the head's step but for its feature fusion); None for drafters whose steps cost next to nothing (n-gram
    lookup, Medusa heads on the target's hidden state)."""
    head = getattr(drafter, "head", None)
    return getattr(drafter, "model", None) or getattr(head, "decoder", None)


class CostModel:
    """Seconds of a target forward over R rows (batch x Q tokens) and of a draft model's forward over R rows, at
    measured points R (interpolated between), for the adaptive choice of k: on a CPU a verify block's cost
    jumps where its rows need another pass over the weights, and on any device it grows with the batch.
    Measured once per decoder (a forward of Q = R at batch 1 on a scratch cache, for each R up to what the
    decoder can ask) and then fixed: live timings would make k, and with it the sampled tokens, depend on the
    machine's load. draft: None for drafters whose cost is not a forward (n-gram lookup: ~0)."""

    def __init__(self, verify: dict, draft: dict | None = None):
        if not verify or any(r < 1 or t < 0 for r, t in verify.items()):
            raise ValueError("CostModel: verify must map row counts >= 1 to seconds >= 0")
        self.verify, self.draft = dict(verify), dict(draft or {})

    @classmethod
    def measure(cls, target, draft_model, max_rows: int, max_draft_rows: int, repeats: int = 3) -> "CostModel":
        def seconds(model, rows):
            cache = model.new_kv_cache(1, rows + 1)
            ids = torch.zeros(1, rows, dtype=torch.long, device=model.device)
            times = []
            for _ in range(repeats + 1):  # the first is a warm-up
                if model.device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                model(ids, cache, logits_indices=torch.arange(rows, device=model.device))
                if model.device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            return sorted(times[1:])[len(times[1:]) // 2]

        points = lambda limit: [r for r in ROW_POINTS if r <= limit] or [1]
        verify = {r: seconds(target, r) for r in points(max_rows)}
        draft = {r: seconds(draft_model, r) for r in points(max_draft_rows)} if draft_model is not None else None
        return cls(verify, draft)

    def verify_cost(self, rows: int) -> float:
        return interpolate(self.verify, rows)

    def draft_cost(self, rows: int) -> float:
        return interpolate(self.draft, rows) if self.draft else 0.0

    def best_k(self, alphas, k_max: int) -> int:
        """argmax over k in [0, k_max] of a round's expected tokens over its cost, for requests of acceptance
        estimates `alphas` (a list, one per request, or one float: a batch of 1) all drafting k (Leviathan et
        al.: (1 - alpha^(k+1)) / (1 - alpha) tokens each for k draft steps over B rows and a verify block of
        B x (k + 1) rows)."""
        alphas = [min(a, 0.999) for a in (alphas if isinstance(alphas, (list, tuple)) else [alphas])]
        batch = len(alphas)
        cost = lambda k: k * self.draft_cost(batch) + self.verify_cost(batch * (k + 1))
        tokens = lambda k: sum((1 - a ** (k + 1)) / (1 - a) for a in alphas)
        return max(range(k_max + 1), key=lambda k: tokens(k) / cost(k))


class SpeculativeDecoder:
    """Lossless speculative decoding of `target` with `drafter` (NgramDrafter, ModelDrafter; None for plain
    decoding only). num_speculative_tokens: the largest k (at most the sampling op's limit). adaptive: True (k per
    request from its acceptance estimate and the measured costs), "heuristic" (+2 after a fully accepted round,
    -1 otherwise) or False (always num_speculative_tokens). max_batch_size: requests decoded at once; the rest
    wait and are admitted as slots free up. max_seq_len: prompt + generated tokens per request (default: per
    call, the longest prompt plus the largest max_new_tokens). cuda_graphs: "auto" (on CUDA), True or False.
    paged: PagedKVCache for target and draft (pages freed as requests finish). monitor: an AcceptanceMonitor fed
    every round. costs: the CostModel of adaptive k (default: measured on first use).

    tree: None (chain rounds) or tree rounds: a TreeSettings, a dict of its fields or an int (num_nodes): each round
    the drafter (EagleDrafter, MedusaDrafter, NgramDrafter) proposes a tree of up to num_nodes nodes (the root, the
    last emitted token, included) and depth, which the target verifies in one forward; num_speculative_tokens is
    then unused. With adaptive=True the round's node budget is the n <= num_nodes that maximises the expected tokens
    over the round's measured cost (see _choose_tree_size); otherwise every tree has num_nodes nodes (fewer when
    the drafter finds fewer candidates).

    Reproducibility: a fixed seed reproduces a request's tokens. With adaptive=False (or "heuristic") they do not
    depend on the other requests in its batch; with adaptive=True its k depends on how many requests share its
    rounds (a wider batch makes verify blocks dearer), and so do its sampled tokens (not their law)."""

    def __init__(self, target, drafter=None, num_speculative_tokens: int = 4, *, adaptive=True, max_batch_size: int = 8,
                 cuda_graphs="auto", max_seq_len: int | None = None, paged: bool = False, monitor=None,
                 costs: "CostModel | None" = None, tree=None):
        k_limit = LIMITS["max_draft_tokens"]
        if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int) or \
                not 1 <= num_speculative_tokens <= k_limit:
            raise ValueError(f"SpeculativeDecoder: num_speculative_tokens must be an int in [1, {k_limit}], got "
                             f"{num_speculative_tokens!r}")
        if adaptive not in (True, False, "heuristic"):
            raise ValueError(f"SpeculativeDecoder: adaptive must be True, False or 'heuristic', got {adaptive!r}")
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"SpeculativeDecoder: max_batch_size must be an int >= 1, got {max_batch_size!r}")
        if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or
                                        max_seq_len < 2):
            raise ValueError(f"SpeculativeDecoder: max_seq_len must be an int >= 2 or None, got {max_seq_len!r}")
        if cuda_graphs not in ("auto", True, False):
            raise ValueError(f"SpeculativeDecoder: cuda_graphs must be 'auto', True or False, got {cuda_graphs!r}")
        on_cuda = target.device.type == "cuda"
        if cuda_graphs is True and not on_cuda:
            raise ValueError("SpeculativeDecoder: cuda_graphs=True needs the target on a CUDA device")
        try:
            self.tree = None if tree is None else TreeSettings.of(tree)
        except ValueError as e:
            raise ValueError(f"SpeculativeDecoder: {e}") from None
        if self.tree is not None and drafter is not None and not hasattr(drafter, "propose_tree"):
            raise ValueError(f"SpeculativeDecoder: tree rounds need a drafter that proposes trees (EagleDrafter, "
                             f"MedusaDrafter, NgramDrafter), got {type(drafter).__name__}")
        self.target, self.drafter, self.num_speculative_tokens = target, drafter, num_speculative_tokens
        self.adaptive, self.max_batch_size, self.max_seq_len = adaptive, max_batch_size, max_seq_len
        self.paged, self.monitor = paged, monitor
        self.graphs = StepGraphs(enabled=on_cuda and cuda_graphs in ("auto", True))
        self.costs = costs  # CostModel; measured on first use with a drafter when adaptive=True and None
        self.cache = None

    # ------------------------------------------------------------------------------------------------ public
    def generate(self, prompts, max_new_tokens=128, *, temperature=0.0, top_k=0, top_p=1.0, seed=0,
                 eos_token_id=None, stream=None) -> GenerationOutput:
        """Speculative decoding of a list of ragged prompts (token-id lists). max_new_tokens, temperature, top_k,
        top_p, seed: a scalar or one per prompt; eos_token_id: an int, a list of ints or None; stream: called as
        stream(request_index, new_token_ids) as tokens are accepted."""
        if self.drafter is None:
            raise ValueError("SpeculativeDecoder.generate: no drafter was given (generate_autoregressive decodes "
                             "without one)")
        return self._run(prompts, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id, stream, True)

    def generate_autoregressive(self, prompts, max_new_tokens=128, *, temperature=0.0, top_k=0, top_p=1.0, seed=0,
                                eos_token_id=None, stream=None) -> GenerationOutput:
        """Plain decoding, one token per request and round, on the same kernels, scheduler and caches."""
        return self._run(prompts, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id, stream, False)

    # --------------------------------------------------------------------------------------------- the loop
    @torch.no_grad()
    def _run(self, prompts, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id, stream, speculate):
        start = time.perf_counter()
        requests, eos, max_seq_len = self._requests(prompts, max_new_tokens, temperature, top_k, top_p, seed,
                                                    eos_token_id)
        drafter = self.drafter if speculate else None
        self._bind(max_seq_len, drafter)
        stats = GenerationStats()
        waiting = deque(requests)
        slots = [None] * self.max_batch_size  # the request in each cache row
        while waiting or any(slots):
            t0 = time.perf_counter()
            self._admit(waiting, slots, drafter, stats)
            batch = max(b for b, r in enumerate(slots) if r is not None) + 1
            batch = self.graphs.bucket(batch, self.max_batch_size)
            tree_rounds = drafter is not None and self.tree is not None
            running = [r for r in slots[:batch] if r is not None]
            if drafter is not None and self.adaptive is True and not tree_rounds:
                self._choose_width(running, stats.target_forwards)
            budget = self._choose_tree_size(running, stats.target_forwards) if tree_rounds else 0
            # k: the drafts of a chain, the depth of a tree (cut so that a round cannot emit past the request's end)
            ks = [self._next_k(r, max_seq_len) if r is not None and drafter is not None else 0 for r in slots[:batch]]
            self._upload_steps(slots, batch)
            stats.other_s += time.perf_counter() - t0

            # 1. Draft: a chain of up to k tokens per request, or a tree of up to `budget` nodes and depth k.
            t0 = time.perf_counter()
            proposal = tree = None
            if max(ks) and tree_rounds:
                tree = drafter.propose_tree(self._round_inputs(slots, batch, ks), budget, self.tree.branching)
            elif max(ks):
                proposal = drafter.propose(self._round_inputs(slots, batch, ks))
                ks = proposal.num_draft_tokens
            t1 = time.perf_counter()
            # 2.-3. Verify: one target forward over the last token and the drafts (chain or tree), sampling, truncation.
            if tree is not None:
                out, paths, hidden, t2 = self._verify_tree(slots, batch, tree, drafter)
            else:
                out, hidden, t2 = self._verify(slots, batch, ks, proposal, drafter)
            tokens, num_accepted = out.output_token_ids.tolist(), out.num_accepted.tolist()  # the round's host read
            depths = [None] * batch
            if tree is not None:  # the drafts a tree verified, its depth, and the accepted path (node = rank + 1)
                ks, depths, paths = (tree.num_nodes - 1).tolist(), tree.depths.amax(1).tolist(), paths.tolist()
            t3 = time.perf_counter()
            if drafter is not None:
                drafter.rollback([a if r is not None else -1 for a, r in zip(num_accepted, slots)], hidden)
            self.cache.free_unused_pages()
            stats.draft_s += t1 - t0
            stats.verify_s += t2 - t1
            stats.sample_s += t3 - t2
            stats.target_forwards += 1

            # 4. Advance every request by its own count; finish, stream.
            t0 = time.perf_counter()
            for b, r in enumerate(slots[:batch]):
                if r is None:
                    continue
                a = num_accepted[b]
                new = tokens[b][:a + 1]
                cut = next((i for i, t in enumerate(new) if t in eos), None)
                if cut is not None:
                    new = new[:cut + 1]
                r.generated += new
                r.stats.target_forwards += 1
                r.stats.add_round(ks[b], a, depths[b])
                if drafter is not None:
                    r.stats.k_per_round.append(ks[b])
                stats.add_round(ks[b], a, depths[b])
                if self.monitor is not None and ks[b]:
                    self.monitor.observe(ks[b], a)
                if tree is not None:
                    self._observe_tree(r, ks[b], paths[b][1:a + 1])
                elif drafter is not None and not tree_rounds:
                    self._adapt(r, ks[b], a)
                if stream is not None:
                    stream(r.index, new)
                if cut is not None or len(r.generated) >= r.max_new_tokens or len(r.tokens) >= max_seq_len:
                    self._finish(r, b, slots, drafter)
            stats.other_s += time.perf_counter() - t0
        for r in requests:
            stats.generated_tokens += len(r.generated)
        stats.elapsed_s = time.perf_counter() - start
        return GenerationOutput([r.generated for r in requests], stats, [r.stats for r in requests])

    def _verify(self, slots, batch: int, ks: list, proposal, drafter):
        """The verify step: target forward over [last token, drafts], masks, sampling, truncation (a CUDA graph
        per (batch, Q) on CUDA). Returns the sampling output, the target's hidden states of the block when the
        drafter needs them (else None), and the time its forward was done (CPU timing)."""
        hidden_states = drafter is not None and drafter.needs_hidden_states
        width = max(ks)
        device = self.target.device
        ids = torch.zeros(batch, width + 1, dtype=torch.int64)
        ids[:, 0] = torch.tensor([r.tokens[-1] if r is not None else 0 for r in slots[:batch]])
        ids = ids.to(device)
        if width:
            ids[:, 1:] = proposal.draft_token_ids[:, :width]
        self.cache.reserve([width + 1] * batch, requests=list(range(batch)))
        num_draft = torch.tensor(ks, dtype=torch.int32, device=device)
        live = torch.tensor([r is not None for r in slots[:batch]], dtype=torch.int32, device=device)
        draft_logits = proposal.draft_logits if proposal is not None else None
        max_k, any_p = self._masks_in_use(slots[:batch])
        t = [0.0]

        def step(ids, num_draft, live, draft_logits):
            logits = self.target(ids, self.cache, cache_rows=slice(0, batch), output_hidden_states=hidden_states)
            logits, hidden = logits if hidden_states else (logits, None)  # [batch, Q, V] float32, [batch, Q, H]
            t[0] = time.perf_counter()
            target_logits = mask_top_k_top_p(logits, self.temperature[:batch], self.top_k[:batch], self.top_p[:batch],
                                             max_top_k=max_k, any_top_p=any_p)
            if width:
                drafts, target = ids[:, 1:].contiguous(), target_logits
            else:  # no drafts: K = 1 with none proposed, the bonus token drawn from row 0 (stride 0, no copy)
                drafts, target = torch.zeros_like(ids), target_logits.expand(batch, 2, target_logits.shape[-1])
            out = chain_speculative_sampling_from_logits(drafts, target, draft_logits, temperature=self.temperature[:batch],
                                                         num_draft_tokens=num_draft, seed=self.seed[:batch],
                                                         offset=self.steps[:batch])
            kept = torch.zeros(self.cache.batch_size, dtype=torch.int32, device=device)
            kept[:batch] = (out.num_accepted + 1) * live  # idle rows keep nothing
            self.cache.truncate(kept, free_pages=False)
            return out, hidden

        out, hidden = self.graphs.run(("verify", batch, width, max_k, any_p, draft_logits is not None, hidden_states),
                                      step, (ids, num_draft, live, draft_logits), state=[self.cache.cache_seqlens])
        return out, hidden, t[0] or time.perf_counter()

    def _verify_tree(self, slots, batch: int, tree, drafter):
        """The tree verify step: target forward over [root, nodes...] under the tree mask, the masks, the tree
        sampling op, compaction of the accepted path to the front of the block. Returns the sampling output, the
        accepted nodes [batch, N] (0 first, -1 padded), the target's hidden states of the path's nodes in path
        order when the drafter needs them (else None), and the time its forward was done."""
        hidden_states = drafter.needs_hidden_states
        n, device = tree.parents.shape[1], self.target.device
        # Compaction touches the whole block of every row of the cache, idle ones too: each needs its pages.
        self.cache.reserve(n)
        live = torch.tensor([r is not None for r in slots[:batch]], dtype=torch.int32, device=device)
        max_k, any_p = self._masks_in_use(slots[:batch])
        t = [0.0]

        def step(ids, parents, tree_mask, num_nodes, live, draft_logits):
            logits = self.target(ids, self.cache, tree_mask=tree_mask, cache_rows=slice(0, batch),
                                 output_hidden_states=hidden_states)
            logits, hidden = logits if hidden_states else (logits, None)  # [batch, N, V] float32, [batch, N, H]
            t[0] = time.perf_counter()
            target_logits = mask_top_k_top_p(logits, self.temperature[:batch], self.top_k[:batch], self.top_p[:batch],
                                             max_top_k=max_k, any_top_p=any_p)
            out = tree_speculative_sampling_from_logits(parents, ids, target_logits, draft_logits,
                                                        temperature=self.temperature[:batch], num_nodes=num_nodes,
                                                        seed=self.seed[:batch], offset=self.steps[:batch])
            kept = torch.zeros(self.cache.batch_size, dtype=torch.int32, device=device)
            kept[:batch] = (out.num_accepted + 1) * live  # idle rows keep nothing
            kept_indices = torch.full((self.cache.batch_size, n), -1, dtype=torch.int32, device=device)
            kept_indices[:batch] = out.accepted_nodes
            self.cache.truncate(kept, kept_indices=kept_indices, free_pages=False)
            if hidden is not None:  # the path's features in path order: a chain of num_accepted drafts to the drafter
                path = out.accepted_nodes.long().clamp_min(0)
                hidden = hidden.gather(1, path.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
            return SamplingOutput(out.output_token_ids, out.num_accepted), out.accepted_nodes, hidden

        key = ("tree", batch, n, max_k, any_p, tree.draft_logits is not None, hidden_states)
        out, paths, hidden = self.graphs.run(key, step, (tree.token_ids, tree.parents, tree.tree_mask, tree.num_nodes,
                                                         live, tree.draft_logits), state=[self.cache.cache_seqlens])
        return out, paths, hidden, t[0] or time.perf_counter()

    # ------------------------------------------------------------------------------------- scheduler helpers
    def _requests(self, prompts, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id):
        c = self.target.config
        prompts = check_prompts(prompts, c.vocab_size)
        n = len(prompts)
        max_new = per_request(max_new_tokens, "max_new_tokens", n, int)
        temps = per_request(temperature, "temperature", n, (int, float))
        top_ks = per_request(top_k, "top_k", n, int)
        top_ps = per_request(top_p, "top_p", n, (int, float))
        seeds = per_request(seed, "seed", n, int)
        if any(m < 1 for m in max_new) or any(not (t >= 0 and math.isfinite(t)) for t in temps) or \
                any(k < 0 for k in top_ks) or any(not 0 < p <= 1 for p in top_ps):
            raise ValueError("max_new_tokens must be >= 1, temperature finite and >= 0, top_k >= 0 and top_p in (0, 1]")
        if any(not -(2**63) <= s < 2**63 for s in seeds):
            raise ValueError("seed must fit in a signed 64-bit integer")
        if eos_token_id is None:
            eos = set()
        else:
            eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
            if any(isinstance(e, bool) or not isinstance(e, int) for e in eos):
                raise ValueError(f"eos_token_id must be an int, a list of ints or None, got {eos_token_id!r}")
        max_seq_len = self.max_seq_len or max(len(p) for p in prompts) + max(max_new)
        for r, p in enumerate(prompts):
            if len(p) >= max_seq_len:
                raise ValueError(f"prompt {r} has {len(p)} tokens, max_seq_len is {max_seq_len}: no room to generate")
        requests = [Request(i, p, m, float(t), k, float(q), s) for i, (p, m, t, k, q, s) in
                    enumerate(zip(prompts, max_new, temps, top_ks, top_ps, seeds))]
        return requests, eos, max_seq_len

    def _bind(self, max_seq_len: int, drafter) -> None:
        """Caches and per-slot parameter buffers, kept across calls while they are large enough (CUDA graphs
        replay on these very tensors). The verify block of a request near max_seq_len may run up to k slots past
        it (the batch's widest block), hence the margin."""
        capacity = max_seq_len + self._widest_block()
        s, device = self.max_batch_size, self.target.device
        if self.cache is None or self.capacity < capacity:
            self.cache = self.target.new_kv_cache(s, capacity, paged=self.paged)
            self.capacity = capacity
            self.temperature = torch.zeros(s, dtype=torch.float32, device=device)
            self.top_k = torch.zeros(s, dtype=torch.int64, device=device)
            self.top_p = torch.ones(s, dtype=torch.float32, device=device)
            self.seed = torch.zeros(s, dtype=torch.int64, device=device)
            self.steps = torch.zeros(s, dtype=torch.int64, device=device)
            self.graphs.clear()
        for b in range(s):
            self.cache.release(b)
        if drafter is not None:
            drafter.bind(self.target, s, self.capacity, self.paged, self.graphs)
        if drafter is not None and self.adaptive is True and self.costs is None:
            width = self.tree.num_nodes if self.tree is not None else self.num_speculative_tokens + 1
            draft_width = self.tree.branching if self.tree is not None else 1  # rows per request of a draft step
            self.costs = CostModel.measure(self.target, draft_cost_model(drafter), s * width, s * draft_width)

    def _admit(self, waiting, slots, drafter, stats) -> None:
        """Fills free slots (lowest first) with waiting requests: their prompt but the last token is prefilled
        into the target's cache (the last opens the first verify block) and handed to the drafter."""
        admitted = []
        for b in range(len(slots)):
            if slots[b] is None and waiting:
                r = waiting.popleft()
                slots[b] = r
                r.started = time.perf_counter()
                r.k = self.num_speculative_tokens if self.tree is None else self.tree.depth
                if self.tree is not None:
                    r.node_hits, r.node_tries = np.zeros(self.tree.num_nodes - 1), np.zeros(self.tree.num_nodes - 1)
                self.temperature[b], self.top_k[b], self.top_p[b], self.seed[b] = r.temperature, r.top_k, r.top_p, r.seed
                admitted.append(b)
        if not admitted:
            return
        prefixes = [slots[b].prompt[:-1] for b in admitted]
        hidden = None
        if drafter is not None and drafter.needs_hidden_states:
            forwards, hidden = self.target.prefill(self.cache, admitted, prefixes, output_hidden_states=True)
        else:
            forwards = self.target.prefill(self.cache, admitted, prefixes)
        stats.target_forwards += forwards
        if drafter is not None:
            t0 = time.perf_counter()
            drafter.admit(admitted, prefixes, hidden)
            stats.draft_s += time.perf_counter() - t0

    def _finish(self, r: Request, b: int, slots, drafter) -> None:
        slots[b] = None
        self.cache.release(b)
        if drafter is not None:
            drafter.release(b)
        r.stats.generated_tokens = len(r.generated)
        r.stats.elapsed_s = time.perf_counter() - r.started

    def _upload_steps(self, slots, batch: int) -> None:
        self.steps[:batch] = torch.tensor([len(r.generated) if r is not None else 0 for r in slots[:batch]])

    def _round_inputs(self, slots, batch: int, ks: list) -> RoundInputs:
        max_k, any_p = self._masks_in_use(slots[:batch])
        return RoundInputs(batch, ks, [r.tokens if r is not None else None for r in slots[:batch]],
                           self.temperature[:batch], self.top_k[:batch], self.top_p[:batch], self.seed[:batch],
                           self.steps[:batch], max_k, any_p)

    def _widest_block(self) -> int:
        """The most slots a round writes past a request's tokens in a cache: the verify block (chain: k + 1; tree:
        num_nodes), or an EAGLE head's pending pairs (up to depth + 1) and its tree draft block ((depth - 1) x
        branching)."""
        if self.tree is None:
            return self.num_speculative_tokens + 1
        t = self.tree
        return max(self.num_speculative_tokens + 1, t.num_nodes, t.depth + (t.depth - 1) * t.branching)

    @staticmethod
    def _masks_in_use(slots) -> tuple[int, bool]:
        """(the largest top_k of a sampled request or 0, whether one has top_p < 1): known on the host, so the
        masks read nothing back (and a CUDA graph is captured per combination)."""
        sampled = [r for r in slots if r is not None and r.temperature > 0]
        return max((r.top_k for r in sampled), default=0), any(r.top_p < 1 for r in sampled)

    # ------------------------------------------------------------------------------------------ adaptive k
    def _next_k(self, r: Request, max_seq_len: int) -> int:
        """The request's k for this round, cut so that the round cannot emit past max_new_tokens or
        max_seq_len (a round emits at most k + 1 tokens)."""
        room = min(r.max_new_tokens - len(r.generated), max_seq_len - len(r.tokens)) - 1
        return max(0, min(r.k, room))

    def _adapt(self, r: Request, k: int, accepted: int) -> None:
        """After a round in which r drafted k and `accepted` were accepted (DESIGN §4): r.k for "heuristic" and
        False; for True, r's acceptance estimate (drafted tokens up to and including the first rejection are the
        trials, decayed so that it follows the request's text; prior 0.5 with the weight of two trials)."""
        k_max = self.num_speculative_tokens
        if self.adaptive is False:
            r.k = k_max
        elif self.adaptive == "heuristic":  # transformers' assisted generation: +2 after a full round, else -1
            if k:
                r.k = min(k_max, r.k + 2) if accepted == k else max(1, r.k - 1)
        elif k:
            r.accepted_ewma = 0.9 * r.accepted_ewma + accepted
            r.tried_ewma = 0.9 * r.tried_ewma + accepted + (accepted < k)

    def _observe_tree(self, r: Request, num_draft: int, path: list) -> None:
        """After a tree round of num_draft nodes below the root whose accepted path is `path` (node indices): r's
        per-node acceptance counts, decayed as the chain's estimate."""
        if r.node_hits is None or not num_draft:
            return
        r.node_hits *= 0.9
        r.node_tries *= 0.9
        r.node_tries[:num_draft] += 1
        r.node_hits[[node - 1 for node in path]] += 1

    def _choose_tree_size(self, running: list, round_index: int) -> int:
        """The round's node budget: tree.num_nodes, or with adaptive=True the n in [2, num_nodes] that maximises the
        running requests' expected tokens over the round's cost. Trees are best nodes first (specdec_ext.trees): a
        tree of n nodes is the first n of a bigger one, and its node i is accepted as often as in the bigger one, so
        a request's expected tokens are 1 + the sum of its first n - 1 nodes' acceptance rates (decayed counts;
        prior 0.5 with the weight of a tenth of a round). The round costs a verify over batch x n rows plus
        min(depth, n - 1) draft steps over the frontier (the round's depth is cut to that too; an EAGLE head's steps
        are measured on its one-layer decoder, n-gram and Medusa steps cost nothing). Every 8th round probes a tree
        twice that size, so that the rates of the next nodes stay measured."""
        n_max, depth, branching = self.tree.num_nodes, self.tree.depth, self.tree.branching
        if self.adaptive is not True or not running:
            n = n_max
        else:
            gain = sum(np.cumsum((r.node_hits + 0.05) / (r.node_tries + 0.1)) for r in running)  # [i]: n = i + 2
            batch = len(running)
            # A tree of n nodes is at most n - 1 deep: its drafter runs min(depth, n - 1) steps over the frontier.
            draft = lambda n: min(depth, n - 1) * self.costs.draft_cost(batch * branching)
            n = max(range(2, n_max + 1),
                    key=lambda n: (batch + gain[n - 2]) / (draft(n) + self.costs.verify_cost(batch * n)))
            if round_index % 8 == 7:  # probe twice the chosen size, so that the next nodes' rates stay measured
                n = min(n_max, 2 * n)
        for r in running:
            r.k = min(depth, n - 1)
        return n

    def _choose_width(self, running: list, round_index: int) -> None:
        """adaptive=True: one k for the round's requests (their verify block is as wide as the widest, so a wider
        k for one costs every row), the k in [0, num_speculative_tokens] that maximises their expected tokens
        over the round's cost; k = 0 probes k = 1 every 8th round, so that low estimates can recover."""
        alphas = [(r.accepted_ewma + 1.0) / (r.tried_ewma + 2.0) for r in running]
        k = self.costs.best_k(alphas, self.num_speculative_tokens)
        if k == 0 and round_index % 8 == 7:
            k = 1
        for r in running:
            r.k = k


@torch.no_grad()
def generate_autoregressive(model, prompts, max_new_tokens=128, *, temperature=0.0, top_k=0, top_p=1.0, seed=0,
                            eos_token_id=None, stream=None, max_seq_len=None, paged=False) -> GenerationOutput:
    """Plain decoding of a batch of ragged prompts (lists of token ids), all at once: SpeculativeDecoder's
    generate_autoregressive with one slot per prompt. max_new_tokens, temperature, top_k, top_p and seed: a
    scalar or one per prompt. eos_token_id: an int, a list of ints, or None. stream: called as
    stream(request_index, new_token_ids) as tokens are emitted. max_seq_len: prompt + generated tokens per
    request (default: the longest prompt plus the largest max_new_tokens)."""
    batch = len(prompts) if isinstance(prompts, (list, tuple)) and prompts else 1
    decoder = SpeculativeDecoder(model, None, max_batch_size=batch, max_seq_len=max_seq_len, paged=paged)
    return decoder.generate_autoregressive(prompts, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                           seed=seed, eos_token_id=eos_token_id, stream=stream)
