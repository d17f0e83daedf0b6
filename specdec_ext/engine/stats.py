"""What a generate call reports: per-request and total statistics (vLLM's names), the output, and a monitor of
the acceptance rate."""
import warnings
from collections import deque
from dataclasses import dataclass, field


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
    draft_s: float = 0.0             # the drafter's proposals, rollbacks and admissions
    verify_s: float = 0.0            # the target's verify forwards (with CUDA graphs: the whole verify step)
    sample_s: float = 0.0            # masks, the sampling kernel, the cache truncation and the round's host read
    #                                  (with CUDA graphs: the wait for the replayed verify step)
    other_s: float = 0.0             # prefills and the host's bookkeeping
    prefill_s: float = 0.0           # of other_s: the target's prefills of admitted prompts (on CUDA their
    #                                  launches: the device's work is waited for by the next round's read)
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

    def add_times(self, result) -> None:
        """A round's target forward and its time split (a RoundResult)."""
        self.target_forwards += 1
        self.draft_s += result.seconds["draft"]
        self.verify_s += result.seconds["verify"]
        self.sample_s += result.seconds["sample"]

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
    #   (max_new_tokens), "max_seq_len" (the decoder's max_seq_len), "context" (the model's max_position_embeddings)
    #   or "stop" (a stop string)
    texts: list | None = None        # with tokenizer=: each request's text (cut at its stop string)
    stop_reasons: list | None = None  # with stop strings: the one each request matched, else None
    logprobs: list | None = None     # with logprobs=: per request a TokenLogprobs per generated token (None for a
    #                                  request that did not ask)


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
