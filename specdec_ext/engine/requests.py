"""A generate call's requests: its arguments checked and broadcast (a scalar or one per prompt), and the state of
each request while it runs."""
import operator
from dataclasses import dataclass, field

import numpy as np
import torch

from .stats import GenerationStats


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
    controls: object = None       # engine.controls.Controls
    stops: object = None          # engine.stops.StopChecker when the request has stop strings
    logprobs: list | None = None  # with logprobs: a TokenLogprobs per generated token

    @property
    def tokens(self) -> list:
        return self.prompt + self.generated


FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def make_requests(config, prompts, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id,
                  max_seq_len: int | None):
    """A call's requests, its EOS ids, the length limit of a request (prompt + generated tokens: the decoder's
    max_seq_len, else the model's context) and the finish reason of reaching it (the generation controls:
    controls.attach_controls)."""

    prompts = check_prompts(prompts, config.vocab_size)
    n = len(prompts)
    max_new = per_request(max_new_tokens, "max_new_tokens", n, as_int)
    temps = per_request(temperature, "temperature", n, as_float)
    top_ks = per_request(top_k, "top_k", n, as_int)
    top_ps = per_request(top_p, "top_p", n, as_float)
    seeds = per_request(seed, "seed", n, as_int)
    def check(values, name, ok, what):
        return next(
            (ValueError(f"{name}{f'[{i}]' if n > 1 else ''} must be {what}, got {v!r}") for i, v in enumerate(values)
             if not ok(v)), None)
    # float32 is what the kernels compute in: a temperature that overflows it would be infinite there.
    error = check(max_new, "max_new_tokens", lambda m: m >= 1, "an int >= 1") or \
        check(temps, "temperature", lambda t: 0 <= t <= FLOAT32_MAX,
              f"finite and >= 0 (at most {FLOAT32_MAX:.3g})") or \
        check(top_ks, "top_k", lambda k: k >= 0, "an int >= 0 (0: off)") or \
        check(top_ps, "top_p", lambda p: 0 < p <= 1, "in (0, 1] (1: off)") or \
        check(seeds, "seed", lambda s: -(2**63) <= s < 2**63, "a signed 64-bit integer")
    if error is not None:
        raise error
    top_ks = [min(k, config.vocab_size) for k in top_ks]  # top_k >= V keeps every token
    eos = check_eos(eos_token_id, config.vocab_size)
    limit = max_seq_len or config.max_position_embeddings
    for r, p in enumerate(prompts):
        if len(p) >= limit:
            what = f"max_seq_len is {limit}" if max_seq_len else \
                f"the model's context (max_position_embeddings) is {limit}"
            raise ValueError(f"prompt {r} has {len(p)} tokens and {what}: no room to generate")
    requests = [Request(i, p, m, t, k, q, s) for i, (p, m, t, k, q, s) in
                enumerate(zip(prompts, max_new, temps, top_ks, top_ps, seeds))]
    return requests, eos, limit, "max_seq_len" if max_seq_len else "context"
