"""Decoding a model on this library's ops. `generate_autoregressive` is plain decoding, the baseline that
speculative decoding is measured against and must match: ragged prompts in one batch (each request at its
own cache length, no padding), per-request temperature / top-k / top-p, Philox-seeded per request so that a
request's tokens depend on its own prompt, parameters and seed only, EOS and max_new_tokens per request.

A token is drawn by the chain sampling kernel with no drafts: the bonus token from softmax(logits /
temperature) (argmax at temperature 0), uniform 0 of Philox stream 1 of (seed[r], offset = r's decode step).
"""
import time
from dataclasses import dataclass, field

import torch

from .ops import chain_speculative_sampling_from_logits
from .sampling import mask_top_k_top_p


@dataclass
class GenerationStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list = field(default_factory=list)
    target_forwards: int = 0
    generated_tokens: int = 0
    elapsed_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    sample_s: float = 0.0
    other_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts (vLLM's definition): tokens emitted per target forward of a speculative round."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass
class GenerationOutput:
    sequences: list  # list[list[int]]: each request's generated tokens (prompt excluded, EOS included)
    stats: GenerationStats
    request_stats: list = field(default_factory=list)


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


@torch.no_grad()
def generate_autoregressive(model, prompts, max_new_tokens=128, *, temperature=0.0, top_k=0, top_p=1.0, seed=0,
                            eos_token_id=None, stream=None, max_seq_len=None, paged=False) -> GenerationOutput:
    """Plain decoding of a batch of ragged prompts (lists of token ids). max_new_tokens, temperature, top_k,
    top_p and seed: a scalar or one per prompt. eos_token_id: an int, a list of ints, or None. stream: called
    as stream(request_index, new_token_ids) as tokens are emitted. max_seq_len: the cache's length per request
    (default: the longest prompt plus the largest max_new_tokens); a request stops when prompt + generated
    tokens reach it."""
    start = time.perf_counter()
    c = model.config
    prompts = check_prompts(prompts, c.vocab_size)
    batch = len(prompts)
    max_new = per_request(max_new_tokens, "max_new_tokens", batch, int)
    temps = per_request(temperature, "temperature", batch, (int, float))
    top_ks = per_request(top_k, "top_k", batch, int)
    top_ps = per_request(top_p, "top_p", batch, (int, float))
    seeds = per_request(seed, "seed", batch, int)
    if any(n < 1 for n in max_new) or any(t < 0 for t in temps) or any(k < 0 for k in top_ks) or \
            any(not 0 < p <= 1 for p in top_ps):
        raise ValueError("max_new_tokens must be >= 1, temperature >= 0, top_k >= 0 and top_p in (0, 1]")
    eos = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    max_seq_len = max_seq_len or max(len(p) for p in prompts) + max(max_new)
    for r, p in enumerate(prompts):
        if len(p) >= max_seq_len:
            raise ValueError(f"prompt {r} has {len(p)} tokens, max_seq_len is {max_seq_len}: no room to generate")
    device = model.device
    cache = model.new_kv_cache(batch, max_seq_len, paged=paged)
    cache.reserve(max_seq_len)  # every request may grow to max_seq_len (a no-op for the contiguous cache)
    stats = GenerationStats()

    # Prefill, one request at a time (each at its own length, no padding); only the last position is scored.
    logits = torch.empty(batch, c.vocab_size, dtype=torch.float32, device=device)
    for r, p in enumerate(prompts):
        ids = torch.tensor([p], dtype=torch.long, device=device)
        logits[r] = model(ids, cache, logits_indices=torch.tensor([len(p) - 1], device=device),
                          cache_rows=slice(r, r + 1))[0, 0]
        stats.target_forwards += 1
    cache.advance(torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=device))

    temperature_t = torch.tensor(temps, dtype=torch.float32, device=device)
    top_k_t = torch.tensor(top_ks, dtype=torch.long, device=device)
    top_p_t = torch.tensor(top_ps, dtype=torch.float32, device=device)
    seed_t = torch.tensor(seeds, dtype=torch.int64, device=device)
    no_drafts = torch.zeros(batch, 1, dtype=torch.int64, device=device)
    sequences = [[] for _ in range(batch)]
    active = [True] * batch
    while True:
        steps = torch.tensor([len(s) for s in sequences], dtype=torch.int64, device=device)
        masked = mask_top_k_top_p(logits, temperature_t, top_k_t, top_p_t)
        # K = 1 with no draft: the kernel draws the bonus token from row 0 (the same row twice, stride 0).
        out = chain_speculative_sampling_from_logits(
            no_drafts, masked.unsqueeze(1).expand(batch, 2, c.vocab_size), temperature=temperature_t,
            num_draft_tokens=torch.zeros(batch, dtype=torch.int32, device=device), seed=seed_t, offset=steps)
        tokens = out.output_token_ids[:, 0].tolist()  # the step's one host read
        for r, t in enumerate(tokens):
            if not active[r]:
                continue
            sequences[r].append(t)
            if stream is not None:
                stream(r, [t])
            if t in eos or len(sequences[r]) >= max_new[r] or len(prompts[r]) + len(sequences[r]) >= max_seq_len:
                active[r] = False
        if not any(active):
            break
        # Finished requests are fed their last token again without advancing: their slot is rewritten in place.
        last = torch.tensor([[s[-1]] for s in sequences], dtype=torch.long, device=device)
        logits = model(last, cache)[:, 0]
        stats.target_forwards += 1
        cache.advance(torch.tensor(active, dtype=torch.int32, device=device))
    stats.generated_tokens = sum(len(s) for s in sequences)
    stats.elapsed_s = time.perf_counter() - start
    return GenerationOutput(sequences, stats)
