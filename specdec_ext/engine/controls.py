"""A generate call's generation controls: checked and broadcast on the host (a scalar or one per prompt, like the
sampling parameters), kept per slot on the device (SlotControls), applied to every verify block by
logits_processing.process_block inside the verify step, and the logprobs of the emitted tokens.

The controls (vLLM's SamplingParams and transformers' logits processors name them so):
  repetition_penalty   > 0, 1 off: transformers' definition, over the prompt and the output
  presence_penalty     0 off, frequency_penalty 0 off: OpenAI's / vLLM's, over the output
  logit_bias           {token id: bias} added to the logits
  bad_words            strings (tokenised as vLLM does: the word and " " + word) or token-id sequences
                       (transformers' bad_words_ids): the last token is banned where the history ends with the rest
  min_tokens           no EOS before this many output tokens
  min_p                keep tokens with p >= min_p * max p (inside the sampling kernels, after temperature)
  logprobs             None, or n in [0, 20]: the emitted token's log-probability, its rank and the n most likely
  stop                 strings that end a request (engine/stops.py: matched on the detokenised text), with
                       include_stop_str_in_output
and, for the text: tokenizer (any object with .encode / .decode: the output gains each request's text) and
text_stream (called as text_stream(request_index, text) with text that can no longer change: never past a stop).
"""
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from ..host import read, upload
from ..logits_processing import BlockControls
from .requests import as_float, as_int, per_request

MAX_LOGPROBS = 20
LOGPROBS_MODES = ("processed", "raw")  # of the target distribution the token was drawn from, or of its raw logits
CONTROL_NAMES = ("repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "bad_words",
                 "min_tokens", "min_p", "logprobs", "logprobs_mode", "stop", "include_stop_str_in_output",
                 "tokenizer", "text_stream")


@dataclass
class Controls:
    """One request's controls, checked (the defaults are off)."""
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict = field(default_factory=dict)  # {token id: float}
    bad_words: list = field(default_factory=list)   # token-id sequences
    min_tokens: int = 0
    min_p: float = 0.0
    logprobs: int | None = None
    stop: list = field(default_factory=list)        # strings


class CallControls(NamedTuple):
    """What a call turns on, for every request (the verify step's shape: one CUDA graph each)."""
    penalties: bool = False
    logit_bias: bool = False
    bad_words: tuple = ()          # (entries, context) of the bad-word table: its width N and C, () off
    min_tokens: bool = False
    min_p: bool = False
    logprobs: int | None = None    # the most alternatives a request asked for (None: no logprobs)
    logprobs_mode: str = "processed"

    @property
    def on(self) -> bool:
        return self.penalties or self.logit_bias or bool(self.bad_words) or self.min_tokens

    @property
    def processes_logits(self) -> bool:
        return self.on


class TokenLogprobs(NamedTuple):
    """The log-probability of an emitted token: under the target distribution it was drawn from (logprobs_mode
    "processed": the controls, temperature and top-k / top-p / min-p applied; a greedy request's at temperature 1,
    unfiltered) or under the raw logits ("raw")."""
    logprob: float
    rank: int                     # 1 + the tokens more likely than it
    top: list                     # the n most likely: [(token id, logprob)], best first (-inf where filtered out)


def _is_word(entry) -> bool:
    """A bad word: a string or a token-id sequence."""
    return isinstance(entry, str) or (isinstance(entry, (list, tuple)) and bool(entry) and
                                      all(isinstance(t, (int, np.integer)) and not isinstance(t, bool)
                                          for t in entry))


def bad_word_ids(words, vocab_size: int, tokenizer, name: str) -> list:
    """Bad words as token-id sequences: a string is tokenised as vLLM does (the word with its leading space
    stripped, and " " + word when that starts with another token of the same count), a sequence kept."""
    out = []
    for i, word in enumerate(words):
        where = f"{name}[{i}]"
        if not _is_word(word):
            raise ValueError(f"{where} must be a string or a non-empty list of token ids, got {word!r}")
        if isinstance(word, str):
            if not word.strip():
                raise ValueError(f"{where} is an empty string")
            if tokenizer is None:
                raise ValueError(f"{where} is a string ({word!r}): pass tokenizer= to tokenise it, or give token ids")
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            out.append(list(plain))
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                out.append(list(spaced))
        else:
            ids = [as_int(t, f"{where}[{j}]") for j, t in enumerate(word)]
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise ValueError(f"{where}: token id {bad} is outside the vocabulary [0, {vocab_size})")
            out.append(ids)
    return out


def _per_request_lists(value, name: str, n: int, is_entry) -> list:
    """A list of entries for every request, or a list with one such list per prompt -> [n] lists."""
    if value is None:
        return [[] for _ in range(n)]
    if isinstance(value, dict):
        raise ValueError(f"{name} must be a list (of entries, or one list per prompt), got a dict")
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        value = [value]
    if value and all(isinstance(v, (list, tuple)) and not is_entry(v) for v in value):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} lists for {n} prompts (a list per prompt, or one list of "
                             f"entries for all)")
        return [list(v) for v in value]
    return [list(value) for _ in range(n)]


def make_controls(n: int, vocab_size: int, eos: set, given: dict) -> tuple[list, CallControls, object]:
    """The call's keyword arguments (CONTROL_NAMES) -> (a Controls per request, the CallControls, the tokenizer)."""
    unknown = sorted(set(given) - set(CONTROL_NAMES))
    if unknown:
        raise ValueError(f"unknown generation control {unknown[0]!r}: the controls are {', '.join(CONTROL_NAMES)}")
    tokenizer = given.get("tokenizer")
    mode = given.get("logprobs_mode", "processed")
    if given.get("text_stream") is not None and (tokenizer is None or not callable(given["text_stream"])):
        raise ValueError("text_stream must be a callable(request_index, text), with tokenizer= to detokenise")
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {mode!r}")

    def scalars(name, default, convert, ok, what):
        values = per_request(given.get(name, default), name, n, convert)
        bad = next((i for i, v in enumerate(values) if not ok(v)), None)
        if bad is not None:
            raise ValueError(f"{name}{f'[{bad}]' if n > 1 else ''} must be {what}, got {values[bad]!r}")
        return values

    def optional_int(value, name):
        return None if value is None else as_int(value, name)

    repetition = scalars("repetition_penalty", 1.0, as_float, lambda v: 0 < v < math.inf, "finite and > 0 (1: off)")
    presence = scalars("presence_penalty", 0.0, as_float, math.isfinite, "finite (0: off)")
    frequency = scalars("frequency_penalty", 0.0, as_float, math.isfinite, "finite (0: off)")
    min_tokens = scalars("min_tokens", 0, as_int, lambda v: v >= 0, "an int >= 0")
    min_p = scalars("min_p", 0.0, as_float, lambda v: 0 <= v < 1, "in [0, 1) (0: off)")
    logprobs = scalars("logprobs", None, optional_int, lambda v: v is None or 0 <= v <= MAX_LOGPROBS,
                       f"None or an int in [0, {MAX_LOGPROBS}]")
    biases = given.get("logit_bias")
    biases = [biases] * n if biases is None or isinstance(biases, dict) else list(biases)
    if len(biases) != n:
        raise ValueError(f"logit_bias has {len(biases)} entries for {n} prompts (a dict, or one dict per prompt)")
    checked_biases = []
    for i, bias in enumerate(biases):
        name = f"logit_bias[{i}]" if isinstance(given.get("logit_bias"), (list, tuple)) else "logit_bias"
        if bias is not None and not isinstance(bias, dict):
            raise ValueError(f"{name} must be a dict {{token id: bias}}, got {type(bias).__name__}")
        out = {}
        for token, value in (bias or {}).items():
            t, v = as_int(token, f"{name} key"), as_float(value, f"{name}[{token!r}]")
            if not 0 <= t < vocab_size:
                raise ValueError(f"{name}: token id {t} is outside the vocabulary [0, {vocab_size})")
            if not math.isfinite(v):
                raise ValueError(f"{name}[{t}] must be finite, got {v!r} (bad_words bans a token)")
            out[t] = v
        checked_biases.append(out)
    words = _per_request_lists(given.get("bad_words"), "bad_words", n, _is_word)
    words = [bad_word_ids(w, vocab_size, tokenizer, "bad_words" if n == 1 else f"bad_words (prompt {i})")
             for i, w in enumerate(words)]
    stops = _per_request_lists(given.get("stop"), "stop", n, lambda v: False)
    for i, s in enumerate(stops):
        bad = next((x for x in s if not isinstance(x, str) or not x), None) if s else None
        if s and bad is not None:
            raise ValueError(f"stop must hold non-empty strings, got {bad!r}")
        if s and tokenizer is None:
            raise ValueError("stop strings are matched on the text: pass tokenizer= (any object with .decode(ids))")
    controls = [Controls(*values) for values in zip(repetition, presence, frequency, checked_biases, words,
                                                    min_tokens, min_p, logprobs, stops)]
    longest = max((len(w) for c in controls for w in c.bad_words), default=0)
    table = (max(len(c.bad_words) for c in controls), longest - 1) if longest else ()
    asked = [c.logprobs for c in controls if c.logprobs is not None]
    call = CallControls(
        penalties=any(c.repetition_penalty != 1 or c.presence_penalty or c.frequency_penalty for c in controls),
        logit_bias=any(c.logit_bias for c in controls), bad_words=table,
        min_tokens=bool(eos) and any(c.min_tokens for c in controls), min_p=any(c.min_p for c in controls),
        logprobs=max(asked) if asked else None, logprobs_mode=mode)
    return controls, call, tokenizer


def attach_controls(requests: list, vocab_size: int, eos: set, given: dict) -> CallControls:
    """Gives each of a call's requests its Controls (and a StopChecker with a tokenizer, a logprobs list with
    logprobs) from the call's keyword arguments; returns what the call turns on."""
    from .stops import StopChecker  # here: the command line imports the engine, not the detokeniser

    controls, call, tokenizer = make_controls(len(requests), vocab_size, eos, given)
    include_stop = given.get("include_stop_str_in_output", False)
    if not isinstance(include_stop, bool):
        raise ValueError(f"include_stop_str_in_output must be True or False, got {include_stop!r}")
    if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
        raise ValueError(f"tokenizer must have .decode(ids) (and .encode(text) for string bad words), got "
                         f"{type(tokenizer).__name__}")
    for r, c in zip(requests, controls):
        r.controls = c
        r.stops = StopChecker(tokenizer, c.stop, include_stop) if tokenizer is not None else None
        r.logprobs = [] if c.logprobs is not None else None
    return call


class SlotControls:
    """The controls of the decoder's slots on the device: written at admission, advanced after every round by the
    tokens each request emitted (no read back), and viewed per round as a BlockControls."""

    def __init__(self, slots: int, vocab_size: int, device):
        self.slots, self.vocab, self.device = slots, vocab_size, device
        self.call = CallControls()
        self.shape = None
        self.epoch = 0  # counts reallocations: a CUDA graph captured on the old tensors must not replay
        # The per-slot scalars never move (a drafter's captured step reads min_p, for one).
        self.repetition = torch.ones(slots, dtype=torch.float32, device=device)
        self.presence = torch.zeros(slots, dtype=torch.float32, device=device)
        self.frequency = torch.zeros(slots, dtype=torch.float32, device=device)
        self.min_tokens = torch.zeros(slots, dtype=torch.int64, device=device)
        self.min_p = torch.zeros(slots, dtype=torch.float32, device=device)

    def configure(self, call: CallControls, eos: set, capacity: int) -> bool:
        """Allocates what `call` turns on for requests of up to `capacity` tokens; True when tensors were
        (re)allocated (CUDA graphs on old ones are stale)."""
        self.call = call
        stop_ids = tuple(sorted(eos)) if call.min_tokens else ()
        shape = (call.penalties, call.logit_bias, call.bad_words, stop_ids, capacity if call.penalties else 0)
        if shape == self.shape:
            return False
        self.stop_ids = upload(list(stop_ids), torch.int64, self.device) if stop_ids else None
        s, v, dev = self.slots, self.vocab, self.device
        # Counts and masks carry a trash column V: a padded upload of emitted tokens scatters its padding there.
        self.output_counts = torch.zeros(s, v + 1, dtype=torch.int32, device=dev) if call.penalties else None
        self.prompt_mask = torch.zeros(s, v + 1, dtype=torch.bool, device=dev) if call.penalties else None
        self.history = torch.zeros(s, capacity, dtype=torch.int64, device=dev) if call.penalties else None
        self.logit_bias = torch.zeros(s, v, dtype=torch.float32, device=dev) if call.logit_bias else None
        entries, context = call.bad_words or (0, 0)
        self.tail = torch.full((s, context), -1, dtype=torch.int64, device=dev)
        self.bad_word_prefixes = torch.full((s, entries, context), -2, dtype=torch.int64, device=dev)
        self.bad_word_last = torch.full((s, entries), -1, dtype=torch.int64, device=dev)
        self.shape = shape
        self.epoch += 1
        return True

    def admit(self, b: int, r) -> None:
        """Slot b takes request r (its controls and its prompt)."""
        c, call = r.controls, self.call
        for column, value in ((self.repetition, c.repetition_penalty), (self.presence, c.presence_penalty),
                              (self.frequency, c.frequency_penalty), (self.min_tokens, c.min_tokens),
                              (self.min_p, c.min_p)):
            column[b].fill_(value)
        if call.penalties:
            prompt = upload(r.prompt, torch.int64, self.device)
            self.output_counts[b].zero_()
            self.prompt_mask[b].zero_()
            self.prompt_mask[b].index_fill_(0, prompt, True)
            self.history[b].zero_()  # token 0 pads: apply_penalties gives it its own value
            self.history[b, :len(r.prompt)] = prompt
        if call.logit_bias:
            self.logit_bias[b].zero_()
            if c.logit_bias:
                self.logit_bias[b].index_put_((upload(list(c.logit_bias), torch.int64, self.device),),
                                              upload(list(c.logit_bias.values()), torch.float32, self.device))
        if call.bad_words:
            entries, context = call.bad_words
            prefixes = [[-2] * (context - len(w) + 1) + w[:-1] for w in c.bad_words] + \
                [[-2] * context] * (entries - len(c.bad_words))
            last = [w[-1] for w in c.bad_words] + [-1] * (entries - len(c.bad_words))
            self.bad_word_prefixes[b].copy_(upload(prefixes, torch.int64, self.device).view(entries, context))
            self.bad_word_last[b].copy_(upload(last, torch.int64, self.device))
            self.set_tail([b], [r.tokens])

    def set_tail(self, rows: list, histories: list) -> None:
        context = self.call.bad_words[1]
        if not context:
            return
        tails = [([-1] * context + list(h[-context:]))[-context:] for h in histories]
        self.tail[rows] = upload(tails, torch.int64, self.device)

    def advance(self, rows: list, new_tokens: list, histories: list) -> None:
        """Slots `rows` emitted `new_tokens` (lists) this round; histories: their tokens now (ending with them)."""
        if not rows:
            return
        if self.call.penalties:  # one upload: (slot, position, token) of every new token
            entries = [(b, len(h) - len(new) + i, t) for b, new, h in zip(rows, new_tokens, histories)
                       for i, t in enumerate(new)]
            if entries:
                slot, position, token = upload(entries, torch.int64, self.device).unbind(1)
                self.output_counts.view(-1).index_add_(0, slot * (self.vocab + 1) + token,
                                                       torch.ones_like(token, dtype=torch.int32))
                self.history.index_put_((slot, position), token)
        if self.call.bad_words:
            self.set_tail(rows, histories)

    def block(self, batch: int, generated: torch.Tensor) -> BlockControls:
        """Rows [0, batch) as the BlockControls of a round; generated [batch] int64: tokens output before it."""
        call, rows = self.call, slice(0, batch)
        v = self.vocab
        return BlockControls(
            output_counts=self.output_counts[rows, :v] if call.penalties else None,
            prompt_mask=self.prompt_mask[rows, :v] if call.penalties else None,
            history=self.history[rows] if call.penalties else None,
            repetition=self.repetition[rows], presence=self.presence[rows], frequency=self.frequency[rows],
            logit_bias=self.logit_bias[rows] if call.logit_bias else None,
            tail=self.tail[rows] if call.bad_words else None,
            bad_word_prefixes=self.bad_word_prefixes[rows] if call.bad_words else None,
            bad_word_last=self.bad_word_last[rows] if call.bad_words else None,
            generated=generated if call.min_tokens else None,
            min_tokens=self.min_tokens[rows] if call.min_tokens else None,
            stop_ids=self.stop_ids if call.min_tokens else None)


def emitted_logprobs(rows: torch.Tensor, tokens: torch.Tensor, n: int, *, temperature: torch.Tensor, top_k=None,
                     top_p=None, min_p=None, processed: bool = True) -> list:
    """The log-probabilities of emitted tokens, as TokenLogprobs (one host read).

    rows [M, V] float32: the logits each token was drawn from (processed by the controls; raw for processed=False);
    tokens [M] int; temperature [M] (below MIN_TEMPERATURE: greedy, reported at temperature 1, unfiltered), top_k /
    top_p / min_p [M] or None. The processed distribution's normaliser is the sampling kernels' own
    (ops.logits_normalizer). An alternative is marked filtered out (-inf) by the kernels' rules
    (reference.filter_logits): top-k keeps the values >= the k-th largest; top-p, over those, a value whose tokens
    strictly above it hold less than top_p of their mass; min-p the values with p >= min_p * max p."""
    from ..ops import MIN_TEMPERATURE, logits_normalizer

    if rows.shape[0] == 0:
        return []
    chosen = rows.gather(1, tokens.long().unsqueeze(1))                               # [M, 1]
    rank = (rows > chosen).sum(-1, dtype=torch.int32) + 1                             # [M]
    values, ids = rows.topk(max(n, 1), dim=-1)                                        # [M, n']
    if not processed:
        lse = rows.logsumexp(-1, keepdim=True)
        logprob, top = chosen - lse, values - lse
    else:
        greedy = temperature < MIN_TEMPERATURE
        filters = {name: torch.where(greedy, off, value) for name, value, off in
                   (("top_k", top_k, 0), ("top_p", top_p, 1.0), ("min_p", min_p, 0.0)) if value is not None}
        t = torch.where(greedy, 1.0, temperature)
        lse = logits_normalizer(rows, temperature=t, **filters).unsqueeze(1)
        t = t.unsqueeze(1)
        logprob, top = chosen / t - lse, values / t - lse
        kept = torch.ones_like(top, dtype=torch.bool)
        if "top_k" in filters:
            k = filters["top_k"].unsqueeze(1)
            kth = values.gather(1, (k.clamp(1, values.shape[-1]) - 1).long())
            kept &= (k <= 0) | (k > values.shape[-1]) | (values >= kth)
        if "min_p" in filters:
            kept &= (top - top[:, :1]).exp() >= filters["min_p"].unsqueeze(1)
        if "top_p" in filters:
            # The mass above a value's tie group, over what top-k kept (its own normaliser), against top_p: every
            # value above is among the top n'.
            top_k_only = {"top_k": filters["top_k"]} if "top_k" in filters else {}
            lse_k = logits_normalizer(rows, temperature=t.squeeze(1), **top_k_only).unsqueeze(1).double()
            mass = (values.double() / t.double() - lse_k).exp()
            above = (values.unsqueeze(-1) < values.unsqueeze(-2)).double() @ mass.unsqueeze(-1)
            kept &= above.squeeze(-1) < filters["top_p"].unsqueeze(1).double()
        top = torch.where(kept, top, float("-inf"))
    packed = torch.cat([logprob.view(torch.int32), rank.unsqueeze(1), ids[:, :n].int(),
                        top[:, :n].contiguous().view(torch.int32)], 1)
    values = np.asarray(read(packed), dtype=np.int32).reshape(-1, 2 + 2 * n)
    floats = values.view(np.float32)
    return [TokenLogprobs(float(floats[i, 0]), int(values[i, 1]),
                          [(int(values[i, 2 + j]), float(floats[i, 2 + n + j])) for j in range(n)])
            for i in range(len(values))]
