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
import operator
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from .costs import CostModel, draft_cost_model
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
    calibration_s: float = 0.0       # measuring the cost model of adaptive k (first use only; not in elapsed_s)
    finish_reason: str | None = None  # per request: "eos", "length", "max_seq_len" or "context"
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
    finish_reasons: list = field(default_factory=list)  # per request: "eos" (it emitted an EOS token), "length"
    #   (max_new_tokens), "max_seq_len" (the decoder's max_seq_len) or "context" (the model's max_position_embeddings)


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


def as_int(value, name: str) -> int:
    """A Python int from an int, a numpy integer or a 0-d integer tensor; ValueError naming `name` for anything else
    (bools, floats, strings)."""
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None


def as_float(value, name: str) -> float:
    """A Python float from an int, float, numpy number or 0-d tensor; ValueError naming `name` otherwise."""
    if isinstance(value, (bool, np.bool_, str, bytes)) or (isinstance(value, torch.Tensor) and value.numel() != 1):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}") from None


def per_request(value, name: str, batch: int, convert) -> list:
    """A scalar broadcast to the batch, or a list/tuple/1-D array with one entry per request, each converted by
    `convert` (as_int, as_float)."""
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 1:
        value = value.tolist()
    listed = isinstance(value, (list, tuple))
    values = list(value) if listed else [value] * batch
    if len(values) != batch:
        raise ValueError(f"{name} has {len(values)} entries for {batch} prompts")
    return [convert(v, f"{name}[{i}]" if listed else name) for i, v in enumerate(values)]


def check_prompts(prompts, vocab_size: int) -> list:
    """The prompts as lists of Python ints: a list of token-id sequences (lists, tuples, 1-D numpy arrays or
    tensors of ints)."""
    if isinstance(prompts, (torch.Tensor, np.ndarray)) and prompts.ndim == 2:
        prompts = list(prompts)
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of token-id lists, got {type(prompts).__name__}")
    if all(isinstance(p, (int, np.integer)) for p in prompts):
        raise ValueError("prompts must be a list of prompts (token-id lists); got a flat list of ints: pass "
                         "[ids] for one prompt")
    out = []
    for r, p in enumerate(prompts):
        if isinstance(p, (torch.Tensor, np.ndarray)):
            if p.ndim != 1:
                raise ValueError(f"prompt {r} must be 1-D, got shape {tuple(p.shape)}")
            if p.dtype in (torch.bool, np.bool_) or not (
                    (isinstance(p, torch.Tensor) and not p.is_floating_point() and not p.is_complex()) or
                    (isinstance(p, np.ndarray) and np.issubdtype(p.dtype, np.integer))):
                raise ValueError(f"prompt {r} must hold integer token ids, got dtype {p.dtype}")
            p = p.tolist()
        elif not isinstance(p, (list, tuple)):
            raise ValueError(f"prompt {r} must be a list of token ids, got {type(p).__name__} {p!r}")
        ids = [as_int(t, f"prompt {r}, token {i}") for i, t in enumerate(p)]
        if not ids:
            raise ValueError(f"prompt {r} is empty")
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt {r}, token {bad}: id {ids[bad]} is outside the vocabulary [0, {vocab_size})")
        out.append(ids)
    return out


def check_eos(eos_token_id, vocab_size: int) -> set:
    """eos_token_id (None, an int or a list of ints) as a set of ids in [0, vocab_size)."""
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, (torch.Tensor, np.ndarray)) and eos_token_id.ndim == 1:
        eos_token_id = eos_token_id.tolist()
    values = eos_token_id if isinstance(eos_token_id, (list, tuple, set, frozenset)) else [eos_token_id]
    eos = {as_int(e, "eos_token_id") for e in values}
    bad = sorted(e for e in eos if not 0 <= e < vocab_size)
    if bad:
        raise ValueError(f"eos_token_id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return eos


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
    finish_reason: str | None = None

    @property
    def tokens(self) -> list:
        return self.prompt + self.generated


FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def available_memory(device: torch.device) -> int | None:
    """Bytes that an allocation on `device` can still get (CUDA: free device memory; CPU: MemAvailable), or None
    when it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


DRAFTER_METHODS = ("bind", "admit", "propose", "rollback", "release")  # the Drafter protocol (specdec_ext.drafting)


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

    page_size = 16  # the paged caches' page size (num_pages counts these)

    def __init__(self, target, drafter=None, num_speculative_tokens: int = 4, *, adaptive=True, max_batch_size: int = 8,
                 cuda_graphs="auto", max_seq_len: int | None = None, paged: bool = False, num_pages: int | None = None,
                 monitor=None, costs: "CostModel | None" = None, tree=None):
        from .models.llama import LlamaForCausalLM  # the decoder needs the models; `import specdec_ext` does not

        if not isinstance(target, LlamaForCausalLM):
            hint = " (LlamaForCausalLM.from_hf(model) converts a transformers model)" \
                if type(target).__module__.startswith("transformers") else ""
            raise ValueError(f"SpeculativeDecoder: target must be a specdec_ext.models.LlamaForCausalLM{hint}, got "
                             f"{type(target).__name__}")
        if drafter is not None and not all(callable(getattr(drafter, m, None)) for m in DRAFTER_METHODS):
            raise ValueError(f"SpeculativeDecoder: drafter must be a Drafter (NgramDrafter, ModelDrafter, EagleDrafter, "
                             f"MedusaDrafter) or None, got {type(drafter).__name__} {drafter!r:.60}")
        k_limit = LIMITS["max_draft_tokens"]
        if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int) or \
                not 1 <= num_speculative_tokens <= k_limit:
            raise ValueError(f"SpeculativeDecoder: num_speculative_tokens must be an int in [1, {k_limit}], got "
                             f"{num_speculative_tokens!r}")
        if adaptive not in (True, False, "heuristic") or isinstance(adaptive, int) and not isinstance(adaptive, bool):
            raise ValueError(f"SpeculativeDecoder: adaptive must be True, False or 'heuristic', got {adaptive!r}")
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"SpeculativeDecoder: max_batch_size must be an int >= 1, got {max_batch_size!r}")
        context = target.config.max_position_embeddings
        if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or
                                        not 2 <= max_seq_len <= context):
            raise ValueError(f"SpeculativeDecoder: max_seq_len must be an int in [2, {context}] (the model's "
                             f"max_position_embeddings) or None, got {max_seq_len!r}")
        if num_pages is not None and (not paged or isinstance(num_pages, bool) or not isinstance(num_pages, int) or
                                      num_pages < 1):
            raise ValueError(f"SpeculativeDecoder: num_pages must be an int >= 1 with paged=True, or None, got "
                             f"{num_pages!r}")
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
        if monitor is not None and not callable(getattr(monitor, "observe", None)):
            raise ValueError(f"SpeculativeDecoder: monitor must be an AcceptanceMonitor or None, got {monitor!r}")
        if costs is not None and not isinstance(costs, CostModel):
            raise ValueError(f"SpeculativeDecoder: costs must be a CostModel or None, got {type(costs).__name__}")
        self.target, self.drafter, self.num_speculative_tokens = target, drafter, num_speculative_tokens
        self.adaptive, self.max_batch_size, self.max_seq_len = adaptive, max_batch_size, max_seq_len
        self.paged, self.num_pages, self.monitor = paged, num_pages, monitor
        self.graphs = StepGraphs(enabled=on_cuda and cuda_graphs in ("auto", True))
        self.costs = costs  # CostModel; measured on first use with a drafter when adaptive=True and None
        self.measured_costs = costs is None  # ours to extend when a later run needs more rows
        self.cache = None
        # One generate at a time: the caches, the drafter's state and the per-slot buffers belong to the run.
        self._running = threading.Lock()

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
    def _run(self, prompts, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id, stream, speculate):
        if not self._running.acquire(blocking=False):
            raise RuntimeError("SpeculativeDecoder: a generate call is already running on this decoder (another "
                               "thread, or a stream callback): a decoder runs one call at a time; make one decoder "
                               "per thread")
        try:
            return self._decode(prompts, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id, stream,
                                speculate)
        finally:
            self._running.release()

    @torch.no_grad()
    def _decode(self, prompts, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id, stream, speculate):
        start = time.perf_counter()
        requests, eos, max_seq_len = self._requests(prompts, max_new_tokens, temperature, top_k, top_p, seed,
                                                    eos_token_id)
        if stream is not None and not callable(stream):
            raise ValueError(f"stream must be a callable(request_index, new_token_ids) or None, got {stream!r}")
        drafter = self.drafter if speculate else None
        stats = GenerationStats()
        stats.calibration_s = self._bind(requests, max_seq_len, drafter)
        start += stats.calibration_s
        waiting = deque(requests)
        slots = [None] * min(self.max_batch_size, len(requests))  # the request in each cache row
        while waiting or any(slots):
            t0 = time.perf_counter()
            self._admit(waiting, slots, drafter, stats, max_seq_len)
            batch = max(b for b, r in enumerate(slots) if r is not None) + 1
            batch = self.graphs.bucket(batch, len(slots))
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
                if not max(ks):  # no request could draft (e.g. a head before its first feature): a plain round
                    proposal = None
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
                reason = "eos" if cut is not None else "length" if len(r.generated) >= r.max_new_tokens else \
                    self._limit_reason if len(r.tokens) >= max_seq_len else None
                if reason is not None:
                    r.finish_reason = reason
                    self._finish(r, b, slots, drafter)
            stats.other_s += time.perf_counter() - t0
        for r in requests:
            stats.generated_tokens += len(r.generated)
        stats.elapsed_s = time.perf_counter() - start
        return GenerationOutput([r.generated for r in requests], stats, [r.stats for r in requests],
                                [r.finish_reason for r in requests])

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
        """The call's requests, its EOS ids and the length limit of a request (prompt + generated tokens): the
        decoder's max_seq_len, else the model's context."""
        c = self.target.config
        prompts = check_prompts(prompts, c.vocab_size)
        n = len(prompts)
        max_new = per_request(max_new_tokens, "max_new_tokens", n, as_int)
        temps = per_request(temperature, "temperature", n, as_float)
        top_ks = per_request(top_k, "top_k", n, as_int)
        top_ps = per_request(top_p, "top_p", n, as_float)
        seeds = per_request(seed, "seed", n, as_int)
        check = lambda values, name, ok, what: next(
            (ValueError(f"{name}{f'[{i}]' if n > 1 else ''} must be {what}, got {v!r}") for i, v in enumerate(values)
             if not ok(v)), None)
        # float32 is what the kernels compute in: a temperature that overflows it would be infinite there.
        error = check(max_new, "max_new_tokens", lambda m: m >= 1, "an int >= 1") or \
            check(temps, "temperature", lambda t: 0 <= t <= FLOAT32_MAX, f"finite and >= 0 (at most {FLOAT32_MAX:.3g})") or \
            check(top_ks, "top_k", lambda k: k >= 0, "an int >= 0 (0: off)") or \
            check(top_ps, "top_p", lambda p: 0 < p <= 1, "in (0, 1] (1: off)") or \
            check(seeds, "seed", lambda s: -(2**63) <= s < 2**63, "a signed 64-bit integer")
        if error is not None:
            raise error
        top_ks = [min(k, c.vocab_size) for k in top_ks]  # top_k >= V keeps every token
        eos = check_eos(eos_token_id, c.vocab_size)
        limit = self.max_seq_len or c.max_position_embeddings
        self._limit_reason = "max_seq_len" if self.max_seq_len else "context"
        for r, p in enumerate(prompts):
            if len(p) >= limit:
                what = f"max_seq_len is {limit}" if self.max_seq_len else \
                    f"the model's context (max_position_embeddings) is {limit}"
                raise ValueError(f"prompt {r} has {len(p)} tokens and {what}: no room to generate")
        requests = [Request(i, p, m, t, k, q, s) for i, (p, m, t, k, q, s) in
                    enumerate(zip(prompts, max_new, temps, top_ks, top_ps, seeds))]
        return requests, eos, limit

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _request_pages(self, r: Request, limit: int) -> int:
        """The most pages request r can hold in the target's cache: its longest sequence plus a verify block."""
        return self._pages(min(len(r.prompt) + r.max_new_tokens, limit) + self._widest_block())

    def _bind(self, requests: list, limit: int, drafter) -> float:
        """Caches and per-slot parameter buffers, sized from what the call needs (its slots, its longest sequence
        capped by `limit`) and kept across calls while they are large enough (CUDA graphs replay on these very
        tensors). The verify block of a request near its end may run up to the widest block past it, hence the
        margin. Measures the cost model of adaptive k when it does not yet cover the call's row counts; returns
        the seconds that took."""
        slots = min(self.max_batch_size, len(requests))
        longest = max(min(len(r.prompt) + r.max_new_tokens, limit) for r in requests)
        capacity = longest + self._widest_block()
        device = self.target.device
        if self.cache is None or self.capacity < capacity or self.cache.batch_size < slots:
            self.cache = None  # free the old one before allocating
            self.cache = self._allocate(self.target, slots, capacity, self.num_pages)
            self.capacity = capacity
            self.temperature = torch.zeros(slots, dtype=torch.float32, device=device)
            self.top_k = torch.zeros(slots, dtype=torch.int64, device=device)
            self.top_p = torch.ones(slots, dtype=torch.float32, device=device)
            self.seed = torch.zeros(slots, dtype=torch.int64, device=device)
            self.steps = torch.zeros(slots, dtype=torch.int64, device=device)
            self.graphs.clear()
        rows = self.cache.batch_size
        if self.num_pages is not None:  # the largest request alone must fit, or it would wait for ever
            need = max(self._request_pages(r, limit) for r in requests) + rows * self._pages(self._widest_block())
            if need > self.num_pages:
                raise ValueError(f"SpeculativeDecoder: num_pages={self.num_pages} pages of {self.page_size} tokens "
                                 f"cannot hold a request of up to {longest} tokens beside {rows} slots' verify "
                                 f"blocks ({need} pages needed): raise num_pages or lower max_new_tokens")
        for b in range(rows):
            self.cache.release(b)
        if drafter is not None:
            # A drafter's cache holds at most the target's tokens of a request plus its own draft block.
            draft_pages = None if self.num_pages is None else self.num_pages + rows * self._pages(2 * self._widest_block())
            drafter.bind(self.target, rows, self.capacity, self.paged, self.graphs, num_pages=draft_pages)
        if drafter is None or self.adaptive is not True or \
                (self.costs is not None and not self.measured_costs):
            return 0.0
        width = self.tree.num_nodes if self.tree is not None else self.num_speculative_tokens + 1
        draft_width = self.tree.branching if self.tree is not None else 1  # rows per request of a draft step
        draft_model = draft_cost_model(drafter)
        if self.costs is not None and self.costs.covers(slots * width, slots * draft_width, draft_model is not None):
            return 0.0
        t0 = time.perf_counter()
        self.costs = CostModel.measure(self.target, draft_model, slots * width, slots * draft_width)
        return time.perf_counter() - t0

    def _allocate(self, model, rows: int, capacity: int, num_pages):
        """model.new_kv_cache, or a ValueError naming what to lower when the cache cannot fit in memory."""
        c = model.config
        if not self.paged:
            tokens = rows * capacity
        else:  # a page pool: the budget, or every slot's pages at capacity
            tokens = (num_pages if num_pages is not None else rows * self._pages(capacity)) * self.page_size
        size = 2 * c.num_hidden_layers * tokens * c.num_key_value_heads * c.head_dim * model.dtype.itemsize
        free = available_memory(model.device)
        what = f"num_pages={num_pages}" if num_pages is not None else \
            f"max_batch_size={self.max_batch_size} (this call: {rows} slots) x max_seq_len {capacity}"
        message = (f"SpeculativeDecoder: the KV cache needs {size / 2**30:.2f} GiB ({what}, {c.num_hidden_layers} "
                   f"layers) and {{}}: lower max_new_tokens, max_seq_len or max_batch_size"
                   f"{', or num_pages' if self.paged else ', or use paged=True with num_pages'}")
        if free is not None and size > free:
            raise ValueError(message.format(f"{free / 2**30:.2f} GiB are available on {model.device}"))
        try:
            return model.new_kv_cache(rows, capacity, paged=self.paged, page_size=self.page_size, num_pages=num_pages)
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            raise ValueError(message.format(f"allocating it failed ({str(e).splitlines()[0][:100]})")) from None

    def _admit(self, waiting, slots, drafter, stats, limit: int) -> None:
        """Fills free slots (lowest first) with waiting requests, in order: their prompt but the last token is
        prefilled into the target's cache (the last opens the first verify block) and handed to the drafter. With
        a page budget (num_pages) a request is admitted only while the pages it can come to hold fit beside the
        running requests' (each counted at its most), so a run never runs out of pages: the rest wait."""
        admitted = []
        if self.num_pages is not None:
            committed = sum(self._request_pages(r, limit) for r in slots if r is not None) + \
                self.cache.batch_size * self._pages(self._widest_block())
        for b in range(len(slots)):
            if slots[b] is None and waiting:
                if self.num_pages is not None:
                    pages = self._request_pages(waiting[0], limit)
                    if committed + pages > self.num_pages:
                        break  # first come, first served: the next request waits for pages
                    committed += pages
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
        r.stats.finish_reason = r.finish_reason
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
