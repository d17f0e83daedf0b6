"""vLLM v1's rejection sampler on specdec_ext's chain speculative sampling kernel.

Follows the contract of Model Runner V1's RejectionSampler in vLLM 0.12 to 0.19 (`vllm/v1/sample/rejection_sampler.py`
in the form whose RejectionSampler takes the Sampler and samples the bonus token itself; the earlier form, whose
forward took bonus_token_ids, is not followed; 0.20 on build it from the speculative config and are left alone). The
releases' own tests of it pass against this class (tests/engine_suites/vllm_v1.py, docs/engines.md "Version matrix"):

- `rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs, target_probs,
  bonus_token_ids, sampling_metadata)`: flat drafts [T], `num_draft_tokens` a host list, `cu_num_draft_tokens` [B]
  int32 inclusive cumsum, `target_probs` [T, V] already processed, `draft_probs` [T, V] or None (n-gram / EAGLE point
  proposals), `bonus_token_ids` [B, 1]. Returns [B, max_spec_len + 1] int32: the accepted drafts, the recovered or
  bonus token, then -1 (vLLM's placeholder). (Later vLLM releases pass target logits here instead; this shim keeps the
  probabilities form of docs/design.md §3.1.) A draft id equal to the placeholder, -1 (vLLM pads draft_token_ids with
  it), is rejected: a greedy row emits the target's argmax at its position (-1 never equals it, in those releases
  too), a random row its recovered token, drawn from norm(max(p - q, 0)) at that position (from p without
  draft_probs), and neither emits anything after it. For random rows that is vLLM's rule since vllm-project/vllm#46533
  (its test test_placeholder_draft_token_rejected_random); the 0.11/0.12 kernel read the probability at id -1, outside
  the row, and could in rare cases accept it. Any other id outside [0, V) raises ValueError.
- `RejectionSampler(sampler)`, an nn.Module with vLLM's `forward(metadata, draft_probs, logits, sampling_metadata)`:
  `logits` [T + B, V] holds each request's draft rows then its bonus row (`metadata.target_logits_indices`,
  `metadata.bonus_logits_indices`); the bonus token comes from vLLM's Sampler, as in vLLM. Returns a SamplerOutput.
  Every batch is verified here, with what vLLM 0.14-0.19's class does at the draft positions: penalties
  (repetition over prompt and output, frequency and presence over the output, the drafts before each position
  counted as output), the allowed-token mask, bad words (matched against the output tokens and the drafts, not the
  prompt) and, on 0.17-0.19, min_tokens (all by `apply_generation_controls`, on specdec_ext.logits_processing), then
  temperature, top-k and top-p; and with `max_num_logprobs` set the sampled tokens' logprobs (`logprobs_tensors`:
  from the raw target rows, or the processed ones in the sampler's "processed_*" logprobs_mode; the bonus rows' from
  the Sampler), in the layout the release's model runner reads (0.12-0.13: the emitted tokens' rows; 0.14-0.19: every
  output slot's). Like vLLM, logit bias, min_p and other logits processors are not applied at the draft positions.
  `parse_output` returns either release's second result (0.12-0.13: cumulative counts; 0.14-0.19: logprob lists).
- `register()`: the `vllm.general_plugins` entry point; swaps vLLM's RejectionSampler for this one.

sampling_metadata is duck-typed (vLLM's SamplingMetadata or any object with its attributes): `all_greedy`,
`all_random`, `temperature` [B] (None when all greedy; a greedy row has temperature 0, or -1 in older vLLM: both are
below 1e-5), `generators` {request index: torch.Generator}, and for the module `top_k` / `top_p` [B] or None.
Nothing here imports vLLM.

Randomness follows vLLM's reproducibility contract: the acceptance uniforms and the recovered token's uniform are
drawn on the device from torch's default generator, except for a seeded request with k > 0 drafts, whose k uniforms
and then its one final uniform come from its own generator, in that order. A request without drafts draws nothing.
So the same generator state gives the same output, whatever else is in the batch (vLLM's reproducibility
contract); the generator is left in another state than vLLM leaves it (vLLM also draws V exponentials per request
for the recovered token), and the tokens are not vLLM's. Acceptance is u * q < p (an exact
u = 0 never accepts a token the target gives probability 0); the recovered token is the inverse CDF of
norm(max(p - q, 0)) at the final uniform.
"""
import copy
import dataclasses
import importlib
import importlib.util
import itertools
import logging
import sys
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn as nn

from ..logits_processing import BlockControls, process_block
from ..ops import LIMITS, MIN_TEMPERATURE
from ..reference import filter_logits
from . import backend, parameters, replace_in_vllm_modules

logger = logging.getLogger(__name__)

PLACEHOLDER_TOKEN_ID = -1
MAX_SPEC_LEN = LIMITS["max_draft_tokens"]
# Where vLLM defines its RejectionSampler; register() also patches every loaded vllm module that imported the name.
VLLM_MODULE = "vllm.v1.sample.rejection_sampler"
# The rejection_sample this module follows (vLLM 0.12-0.14). vLLM's own is internal to the class register() replaces:
# 0.16-0.19 pass it target logits in target_probs' place (the softmax moved into it), the class's contract unchanged.
V1_REJECTION_SAMPLE_PARAMETERS = ["draft_token_ids", "num_draft_tokens", "max_spec_len", "cu_num_draft_tokens",
                                  "draft_probs", "target_probs", "bonus_token_ids", "sampling_metadata"]
V1_TARGET_NAMES = ("target_probs", "target_logits")

# vLLM's own class, kept by register(): its parse_output tells which logprobs layout the release's model runner reads.
_vllm_rejection_sampler = None


def _require(meta, name: str, what: str):
    if not hasattr(meta, name):
        raise ValueError(f"rejection_sample: sampling_metadata has no attribute {name!r} ({what})")
    return getattr(meta, name)


def _greedy_rows(sampling_metadata, batch: int, device):
    """The greedy flag for the kernel: a bool for a uniform batch, else [B] bool from vLLM's temperature marker."""
    all_greedy = bool(_require(sampling_metadata, "all_greedy", "bool"))
    all_random = bool(_require(sampling_metadata, "all_random", "bool"))
    if all_greedy:
        return True
    if all_random:
        return False
    temperature = _require(sampling_metadata, "temperature", "[B] float tensor")
    if not isinstance(temperature, torch.Tensor) or temperature.numel() != batch:
        raise ValueError(f"rejection_sample: sampling_metadata.temperature must be a [B] tensor with B = {batch} "
                         "entries when the batch is not all greedy")
    return (temperature.reshape(-1) < MIN_TEMPERATURE).to(device)


def _uniforms(num_draft_tokens: list[int], generators: dict, device):
    """vLLM's draws: [T] acceptance uniforms and [B] final uniforms from the default generator on `device`, a seeded
    request's (k > 0) from its generator: k uniforms, then one. No host synchronisation."""
    uniforms = torch.rand(sum(num_draft_tokens), dtype=torch.float32, device=device)
    final = torch.rand(len(num_draft_tokens), dtype=torch.float32, device=device)
    if generators:  # host work only for seeded requests, not a loop over the batch
        starts = [0, *itertools.accumulate(num_draft_tokens)]
        for b in sorted(generators):
            k = num_draft_tokens[b]
            if k > 0:  # a request without drafts consumes nothing: vLLM's rule
                uniforms[starts[b]:starts[b] + k].uniform_(generator=generators[b])
                final[b:b + 1].uniform_(generator=generators[b])
    return uniforms, final


def _check_counts(num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_token_ids) -> list[int]:
    op = "rejection_sample"
    if not isinstance(draft_token_ids, torch.Tensor) or draft_token_ids.dim() != 1:
        raise ValueError(f"{op}: draft_token_ids must be a [T] tensor (the drafts of every request, flat)")
    if not isinstance(num_draft_tokens, Sequence) or isinstance(num_draft_tokens, (str, bytes)) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in num_draft_tokens):
        raise ValueError(f"{op}: num_draft_tokens must be a list of ints >= 0 (one per request), "
                         f"got {num_draft_tokens!r}")
    counts = list(num_draft_tokens)
    if sum(counts) != draft_token_ids.numel():
        raise ValueError(f"{op}: num_draft_tokens sums to {sum(counts)} but draft_token_ids has "
                         f"{draft_token_ids.numel()} tokens")
    if isinstance(max_spec_len, bool) or not isinstance(max_spec_len, int) or \
            not max(counts, default=0) <= max_spec_len <= MAX_SPEC_LEN:
        raise ValueError(f"{op}: max_spec_len must be an int in [max(num_draft_tokens) = {max(counts, default=0)}, "
                         f"{MAX_SPEC_LEN}], got {max_spec_len!r}")
    if not isinstance(cu_num_draft_tokens, torch.Tensor) or cu_num_draft_tokens.dim() != 1 or \
            cu_num_draft_tokens.numel() != len(counts):
        raise ValueError(f"{op}: cu_num_draft_tokens must be a [B] tensor with B = len(num_draft_tokens) = "
                         f"{len(counts)}")
    # On the CPU the two forms of the counts must agree; on a device this check would be a host read.
    if cu_num_draft_tokens.device.type == "cpu" and cu_num_draft_tokens.tolist() != \
            torch.tensor(counts, dtype=torch.int64).cumsum(0).tolist():
        raise ValueError(f"{op}: cu_num_draft_tokens is not the inclusive cumulative sum of num_draft_tokens")
    return counts


def rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs, target_probs,
                     bonus_token_ids, sampling_metadata) -> torch.Tensor:
    """vLLM v1's rejection_sample on our kernel: [B, max_spec_len + 1] int32, each row the accepted drafts, then
    the recovered token (first rejection) or bonus_token_ids[b] (all accepted, or no drafts), then -1.
    Greedy rows accept while the draft equals the target argmax, then emit the argmax. A placeholder draft (-1) is
    rejected, as vLLM rejects it; any other id outside [0, V) raises ValueError."""
    op = "rejection_sample"
    counts = _check_counts(num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_token_ids)
    batch, tokens = len(counts), draft_token_ids.numel()
    if not isinstance(target_probs, torch.Tensor) or target_probs.dim() != 2 or target_probs.shape[0] != tokens:
        raise ValueError(f"{op}: target_probs must be a [T, V] tensor with T = {tokens} rows, got "
                         f"{tuple(getattr(target_probs, 'shape', ()))}")
    if draft_probs is not None and (not isinstance(draft_probs, torch.Tensor) or
                                    draft_probs.shape != target_probs.shape):
        raise ValueError(f"{op}: draft_probs must be None or a tensor of target_probs' shape "
                         f"{tuple(target_probs.shape)}, got {tuple(getattr(draft_probs, 'shape', ()))}")
    if not isinstance(bonus_token_ids, torch.Tensor) or bonus_token_ids.numel() != batch or \
            bonus_token_ids.dim() not in (1, 2):
        raise ValueError(f"{op}: bonus_token_ids must be a [B, 1] tensor with B = {batch}, got "
                         f"{tuple(getattr(bonus_token_ids, 'shape', ()))}")
    device = target_probs.device
    greedy = _greedy_rows(sampling_metadata, batch, device)
    uniforms = final_uniforms = None
    if greedy is not True:  # vLLM draws nothing for an all-greedy batch
        generators = _require(sampling_metadata, "generators", "dict: request index -> torch.Generator")
        if not isinstance(generators, dict) or any(not isinstance(b, int) or not 0 <= b < batch for b in generators):
            raise ValueError(f"{op}: sampling_metadata.generators must map request indices in [0, {batch}) to "
                             f"torch.Generator objects, got keys {sorted(generators)!r}")
        uniforms, final_uniforms = _uniforms(counts, generators, device)
    # The op refuses ids outside [0, V): a placeholder goes to it as id 0, and what the op emits from the first
    # placeholder on is replaced below (other bad ids still reach the op, which refuses them).
    placeholder = draft_token_ids == PLACEHOLDER_TOKEN_ID
    # seed 0: the uniforms above replace every Philox draw, so the key is never read.
    out = backend().chain_speculative_sampling(
        torch.where(placeholder, 0, draft_token_ids), target_probs, draft_probs, greedy=greedy, seed=0, offset=0,
        cu_num_draft_tokens=cu_num_draft_tokens, max_draft_tokens=max_spec_len, bonus_token_ids=bonus_token_ids,
        uniforms=uniforms, final_uniforms=final_uniforms)
    if tokens == 0 or (placeholder.device.type == "cpu" and not bool(placeholder.any())):  # a free check on the CPU
        return out.output_token_ids
    return _reject_placeholders(out, placeholder, cu_num_draft_tokens, draft_probs, target_probs, greedy,
                                final_uniforms)


def _reject_placeholders(out, placeholder, cu_num_draft_tokens, draft_probs, target_probs, greedy, final_uniforms):
    """vLLM rejects a placeholder draft: a greedy row emits the target's argmax there, a random row the recovered
    token, drawn from norm(max(p - q, 0)) (q = 0 without draft_probs: from p), and nothing after it. Where the op
    accepted every draft before a request's first placeholder, its output from there on is replaced by that token
    (at the request's final uniform, which the op's output from there on alone used); elsewhere the placeholder was
    never reached. Device ops only: no host read."""
    tokens = target_probs.shape[0]
    batch, width = out.output_token_ids.shape
    device = target_probs.device
    cu = cu_num_draft_tokens.reshape(-1).to(device=device, dtype=torch.int64)
    row = torch.arange(tokens, dtype=torch.int64, device=device)
    owner = torch.searchsorted(cu, row, right=True)  # row t belongs to the request whose cumsum first exceeds t
    start = torch.cat([cu.new_zeros(1), cu[:-1]])  # each request's first row
    pos = row - start[owner]
    first = torch.full((batch,), width, dtype=torch.int64, device=device).scatter_reduce_(
        0, owner, torch.where(placeholder.reshape(-1), pos, width), "amin")  # width: none
    reached = first <= out.num_accepted.long()
    rows_at = (start + first).clamp(0, tokens - 1)  # the first placeholder's row (any row where none)
    p = target_probs[rows_at].float()
    token = p.argmax(-1)
    if greedy is not True:
        r = p if draft_probs is None else (p - draft_probs[rows_at].float()).clamp_min(0.0)
        # q == p leaves no residual (vLLM's kernel then emits an arbitrary token): draw from p, the target's law.
        r = torch.where(r.sum(-1, keepdim=True) > 0, r, p)
        cdf = r.cumsum(-1)
        drawn = torch.searchsorted(cdf, (final_uniforms * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
        # Capped at the last token with mass, so that a rounding at the top never draws one without.
        drawn = torch.minimum(drawn, (r > 0).long().cumsum(-1).argmax(-1))
        token = drawn if greedy is False else torch.where(greedy, token, drawn)
    col, first, reached = torch.arange(width, device=device), first.unsqueeze(-1), reached.unsqueeze(-1)
    ids = out.output_token_ids
    return torch.where(reached & (col == first), token.to(ids.dtype).unsqueeze(-1),
                       torch.where(reached & (col > first), PLACEHOLDER_TOKEN_ID, ids))


def _min_tokens_requests(sampling_metadata, batch: int) -> list[tuple[int, int, int, tuple[int, ...]]]:
    """(request, min_tokens, tokens output so far, stop ids) of each request short of its min_tokens whose stop tokens
    vLLM masks at the draft positions: those of a processor with vLLM 0.17-0.19's MinTokensLogitsProcessor interface
    (`min_toks` {request: (min_tokens, output ids, stop ids)} and `apply_with_spec_decode`; 0.12-0.16's processor has
    no such method, and vLLM leaves the draft positions unmasked there). Attributes the metadata lacks count as off."""
    processors = getattr(getattr(sampling_metadata, "logitsprocs", None), "non_argmax_invariant", None) or ()
    requests = []
    for processor in processors:
        if not hasattr(processor, "apply_with_spec_decode"):
            continue
        for b, (min_tokens, output_ids, stop_ids) in (getattr(processor, "min_toks", None) or {}).items():
            if stop_ids and 0 <= b < batch:
                requests.append((b, int(min_tokens), len(output_ids), tuple(sorted(stop_ids))))
    return requests


def _output_lists(sampling_metadata, batch: int, what: str) -> list:
    outputs = getattr(sampling_metadata, "output_token_ids", None)
    if outputs is None or len(outputs) < batch:
        raise ValueError(f"RejectionSampler: sampling_metadata.output_token_ids must hold each request's output token "
                         f"ids ({batch} lists) when {what} is on")
    return [list(o) for o in outputs[:batch]]


def _padded(rows: list[list[int]], width: int, fill: int, device) -> torch.Tensor:
    """rows right-aligned in a [len(rows), width] int64 tensor, `fill` on the left."""
    out = torch.full((len(rows), width), fill, dtype=torch.int64)
    for b, row in enumerate(rows):
        if row and width:
            out[b, width - len(row):] = torch.tensor(row, dtype=torch.int64)
    return out.to(device)


def _penalty_controls(sampling_metadata, outputs: list[list[int]], batch: int, vocab: int, device) -> dict:
    """BlockControls' penalty fields from vLLM's metadata: the output tokens' counts [B, V] (ids outside [0, V), the
    -1 placeholders of asynchronous scheduling among them, are not counted, as vLLM pads them out), the prompt's
    tokens [B, V] (vLLM pads prompt_token_ids with V), the history [B, L] and the three per-request penalties."""
    lengths = torch.tensor([len(o) for o in outputs], dtype=torch.int64)
    flat = torch.tensor([t for o in outputs for t in o], dtype=torch.int64).to(device)
    owner = torch.repeat_interleave(torch.arange(batch), lengths).to(device)
    dump = batch * vocab  # one bin past the end for the ids that are not counted
    bins = torch.where((flat >= 0) & (flat < vocab), owner * vocab + flat, dump)
    counts = torch.bincount(bins, minlength=dump + 1)[:dump].view(batch, vocab).to(torch.int32)
    prompt = _require(sampling_metadata, "prompt_token_ids", "[B, L] tensor, padded with V").to(device)[:batch].long()
    prompt = torch.where((prompt >= 0) & (prompt < vocab), prompt, vocab)
    prompt_mask = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=device).scatter_(1, prompt, True)[:, :vocab]

    def per_request(name):
        value = _require(sampling_metadata, name, "[B] tensor")
        return torch.as_tensor(value).to(device=device, dtype=torch.float32).reshape(-1)[:batch]

    # Every token a row may have seen (apply_penalties gathers these): the prompt and the outputs, 0 padding them.
    outputs_seen = _padded([[t if 0 <= t < vocab else 0 for t in o] for o in outputs],
                           max((len(o) for o in outputs), default=0), 0, device)
    history = torch.cat([torch.where(prompt < vocab, prompt, 0), outputs_seen], 1)
    return dict(output_counts=counts, prompt_mask=prompt_mask, history=history,
                repetition=per_request("repetition_penalties"),
                presence=per_request("presence_penalties"), frequency=per_request("frequency_penalties"))


def _bad_word_controls(bad_words: dict, outputs: list[list[int]], batch: int, device) -> tuple[dict, torch.Tensor]:
    """BlockControls' bad-word fields: each request's words as right-aligned prefixes and last tokens, and the tail
    of its history as vLLM matches it there: its output tokens only (not the prompt), as they are (a -1 placeholder
    matches nothing), -1 before the start. Returns them and each request's last output token (-1 when none)."""
    words = {b: [list(w) for w in ws if len(w)] for b, ws in bad_words.items() if 0 <= b < batch}
    context = max((len(w) - 1 for ws in words.values() for w in ws), default=0)
    count = max((len(ws) for ws in words.values()), default=0)
    prefixes = torch.full((batch, max(count, 1), context), -2, dtype=torch.int64)
    last = torch.full((batch, max(count, 1)), -1, dtype=torch.int64)
    for b, ws in words.items():
        for n, word in enumerate(ws):
            if len(word) > 1:
                prefixes[b, n, context - len(word) + 1:] = torch.tensor(word[:-1], dtype=torch.int64)
            last[b, n] = word[-1]
    tail = _padded([o[len(o) - context:] if context else [] for o in outputs], context, -1, device)
    last_output = _padded([o[-1:] for o in outputs], 1, -1, device)[:, 0]
    return dict(tail=tail, bad_word_prefixes=prefixes.to(device), bad_word_last=last.to(device)), last_output


def apply_generation_controls(logits: torch.Tensor, draft_token_ids: torch.Tensor, num_draft_tokens: list[int],
                              cu_num_draft_tokens: torch.Tensor, sampling_metadata) -> torch.Tensor:
    """vLLM's processing of the draft positions' target rows before temperature (Model Runner V1's
    RejectionSampler.apply_logits_processors): logits [T, V] float32, in place, each draft position's row processed
    with the history it has there, the request's output tokens then its drafts before that position:

    - repetition, frequency and presence penalties (`no_penalties` False): repetition on tokens of the prompt or of
      that history, frequency and presence on that history's counts (the drafts counted);
    - `allowed_token_ids_mask` [B, V] (True: not allowed): -inf on every draft position of the request;
    - `bad_words_token_ids` {request: [[ids]]}: a word's last token -inf where the history ends with its other
      tokens, matched against the output tokens and the drafts only (vLLM's history for bad words has no prompt);
    - min_tokens (vLLM 0.17-0.19): the stop tokens -inf at the draft positions j (from 0) with output + j < min_tokens.

    The rows are laid out per request as blocks [B, max k, V] for specdec_ext.logits_processing.process_block (row j
    of request b: column 0 its last output token, columns 1..j its drafts 0..j-1); the per-request stop-token sets
    of min_tokens go in one call per distinct set. Returns logits (unchanged when no control is on)."""
    counts = list(num_draft_tokens)
    tokens, vocab = logits.shape
    batch = len(counts)
    penalties = not getattr(sampling_metadata, "no_penalties", True)
    bad_words = getattr(sampling_metadata, "bad_words_token_ids", None) or {}
    allowed = getattr(sampling_metadata, "allowed_token_ids_mask", None)
    min_tokens = _min_tokens_requests(sampling_metadata, batch)
    if tokens == 0 or not (penalties or bad_words or allowed is not None or min_tokens):
        return logits
    device = logits.device
    width = max(counts)
    cu = cu_num_draft_tokens.to(device=device, dtype=torch.int64).reshape(-1)
    k = torch.diff(cu, prepend=cu.new_zeros(1))
    start = cu - k
    col = torch.arange(width, device=device)
    valid = col < k.unsqueeze(1)                                            # [B, W]: the request's draft positions
    rows = (start.unsqueeze(1) + col).clamp(0, tokens - 1)                  # their flat rows (any row where invalid)
    block = logits[rows]                                                    # [B, W, V]
    # Column j >= 1 of a request's block is its draft j - 1 (read only by the rows after it).
    drafts = draft_token_ids.to(device=device, dtype=torch.int64)[(start.unsqueeze(1) + col - 1).clamp(0, tokens - 1)]
    outputs = _output_lists(sampling_metadata, batch, "a penalty or bad words") if penalties or bad_words else None

    fields = {}
    if penalties:
        fields.update(_penalty_controls(sampling_metadata, outputs, batch, vocab, device))
    if allowed is not None:
        fields["logit_bias"] = torch.zeros(batch, vocab, device=device).masked_fill_(
            allowed.to(device)[:batch].bool(), float("-inf"))
    if fields:
        # Ids outside [0, V) (a -1 placeholder draft) stand in as token 0: only rows after a placeholder, which emit
        # nothing, see them. Column 0 (any token) is in the history already.
        ids = torch.where((drafts >= 0) & (drafts < vocab), drafts, 0)
        ids[:, 0] = 0
        process_block(block, ids, BlockControls(**fields))
    if bad_words:
        bad, last_output = _bad_word_controls(bad_words, outputs, batch, device)
        ids = drafts.clone()
        ids[:, 0] = last_output
        process_block(block, ids, BlockControls(**bad))
    groups = {}
    for b, minimum, generated, stop_ids in min_tokens:
        groups.setdefault(stop_ids, []).append((b, minimum, generated))
    for stop_ids, members in groups.items():
        minimum = torch.zeros(batch, dtype=torch.int64)
        generated = torch.zeros(batch, dtype=torch.int64)
        for b, m, g in members:
            minimum[b], generated[b] = m, g
        process_block(block, drafts, BlockControls(generated=generated.to(device), min_tokens=minimum.to(device),
                                                   stop_ids=torch.tensor(stop_ids, dtype=torch.int64, device=device)))
    logits[rows[valid]] = block[valid]
    return logits


@dataclasses.dataclass
class SamplerOutput:
    """vLLM's SamplerOutput fields, used when vllm.v1.outputs is not loaded."""
    sampled_token_ids: torch.Tensor
    logprobs_tensors: object = None


class LogprobsTensors(NamedTuple):
    """vLLM's LogprobsTensors fields (and the filter parse_output uses), used when vllm.v1.outputs is not loaded:
    per output slot, the sampled token then the top-n ids [N, n + 1] int32, their logprobs [N, n + 1] float32, and
    the sampled token's rank [N] (1 + the number of tokens with a larger logprob)."""
    logprob_token_ids: torch.Tensor
    logprobs: torch.Tensor
    selected_token_ranks: torch.Tensor

    def filter(self, mask: torch.Tensor) -> "LogprobsTensors":
        return LogprobsTensors(*(t[mask] for t in self))

    def tolists(self, cu_num_generated_tokens: list[int]):
        """Per request: (token ids, logprobs, ranks) as lists, split at the cumulative counts."""
        return [tuple(t[a:b].tolist() for t in self)
                for a, b in zip(cu_num_generated_tokens[:-1], cu_num_generated_tokens[1:])]


def _sampler_output(token_ids: torch.Tensor, logprobs_tensors=None):
    outputs = sys.modules.get("vllm.v1.outputs")
    cls = getattr(outputs, "SamplerOutput", SamplerOutput)
    return cls(sampled_token_ids=token_ids, logprobs_tensors=logprobs_tensors)


def _replaced(sampling_metadata, **changes):
    """A copy of the metadata with `changes` (dataclasses.replace for vLLM's SamplingMetadata)."""
    if dataclasses.is_dataclass(sampling_metadata) and not isinstance(sampling_metadata, type):
        return dataclasses.replace(sampling_metadata, **changes)
    copied = copy.copy(sampling_metadata)
    for name, value in changes.items():
        setattr(copied, name, value)
    return copied


def dense_logprobs_layout() -> bool:
    """Whether the model runner reads the logprobs of every output slot (vLLM 0.14-0.19: [B * (K + 1)] rows, which its
    parse_output filters) rather than those of the emitted tokens only (0.12-0.13). Told by the parse_output of the
    vLLM class register() replaced; without one, the newer form."""
    if _vllm_rejection_sampler is None:
        return True
    return "logprobs_tensors" in parameters(getattr(_vllm_rejection_sampler, "parse_output", None))


def logprobs_tensors(num_logprobs: int, metadata, num_rows: int, target_rows: torch.Tensor,
                     bonus_rows: torch.Tensor, token_ids: torch.Tensor, logits_mode: bool, dense: bool = True):
    """The LogprobsTensors vLLM's V1 RejectionSampler returns for output token_ids [B, K + 1] (-1 padded).

    Its [num_rows, V] layout (the forward's `logits`) gets target_rows at metadata.target_logits_indices and
    bonus_rows at metadata.bonus_logits_indices (zeros elsewhere); output slot j of request b reads row
    s_b + j, s_b the request's first row (the exclusive cumulative sum of k + 1), clamped to the last row. Dense
    (0.14-0.19): every slot, a -1 slot scored as token 0 (parse_output drops it); else (0.12-0.13) the emitted
    slots only. Scores: the rows themselves in a logits mode, else their log_softmax in float32; then the sampled
    token's score, the top num_logprobs (torch.topk) and the sampled token's rank (entries >= its score)."""
    vocab = target_rows.shape[-1] if target_rows.numel() else bonus_rows.shape[-1]
    device = token_ids.device
    final = torch.zeros(num_rows, vocab, dtype=torch.float32, device=device)
    final[metadata.target_logits_indices.to(device).long()] = target_rows.to(device, torch.float32)
    final[metadata.bonus_logits_indices.to(device).long()] = bonus_rows.to(device, torch.float32)
    batch, width = token_ids.shape
    cu_sampled = getattr(metadata, "cu_num_sampled_tokens", None)
    if cu_sampled is None:
        cu_sampled = torch.tensor(metadata.num_draft_tokens, dtype=torch.int64).add(1).cumsum(0)
    cu_sampled = cu_sampled.to(device=device, dtype=torch.int64).reshape(-1)
    first = torch.cat([cu_sampled.new_zeros(1), cu_sampled[:-1]])
    slots = first.unsqueeze(1) + torch.arange(width, device=device)
    tokens = token_ids.long()
    if dense:
        slots = slots.flatten().clamp(max=num_rows - 1)
        tokens = torch.where(tokens == PLACEHOLDER_TOKEN_ID, 0, tokens).flatten()
    else:
        emitted = tokens != PLACEHOLDER_TOKEN_ID
        slots, tokens = slots[emitted], tokens[emitted]
    scores = final[slots]
    if not logits_mode:
        scores = scores.log_softmax(-1, dtype=torch.float32)
    top, top_ids = scores.topk(num_logprobs, -1)
    chosen = scores.gather(-1, tokens.unsqueeze(-1))
    ranks = (scores >= chosen).sum(-1)
    cls = getattr(sys.modules.get("vllm.v1.outputs"), "LogprobsTensors", LogprobsTensors)
    return cls(torch.cat([tokens.unsqueeze(-1), top_ids], 1).to(torch.int32), torch.cat([chosen, top], 1), ranks)


def processed_target_logits(logits, num_draft_tokens: list[int], sampling_metadata,
                            cu_num_draft_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """vLLM's sampling constraints on the draft positions' target rows: logits [T, V] -> [T, V] float32, top-k/top-p
    masked (-inf) and divided by the request's temperature; greedy rows (and an all-greedy batch) unchanged. With
    cu_num_draft_tokens on the logits' device the rows' owners come from it (no host-to-device copy: a copy from
    pageable host memory synchronises the stream)."""
    logits = logits.float()
    if sampling_metadata.all_greedy:
        return logits
    tokens, vocab = logits.shape
    if isinstance(cu_num_draft_tokens, torch.Tensor) and cu_num_draft_tokens.device == logits.device:
        # Row t belongs to the request whose inclusive cumsum first exceeds t.
        positions = torch.arange(tokens, dtype=torch.int64, device=logits.device)
        owner = torch.searchsorted(cu_num_draft_tokens.reshape(-1).to(torch.int64), positions, right=True)
    else:
        owner = torch.repeat_interleave(torch.arange(len(num_draft_tokens)),
                                        torch.tensor(num_draft_tokens, dtype=torch.int64)).to(logits.device)

    def per_token(x, fill):
        if x is None:
            return torch.full((tokens,), fill, device=logits.device)
        return x.to(logits.device).reshape(-1)[owner]

    temperature = per_token(sampling_metadata.temperature, 1.0).float()
    greedy = temperature < MIN_TEMPERATURE
    temperature = torch.where(greedy, 0.0, temperature)  # vLLM's -1 marker counts as 0 for the masks
    top_k, top_p = getattr(sampling_metadata, "top_k", None), getattr(sampling_metadata, "top_p", None)
    if top_k is not None or top_p is not None:
        # vLLM's probabilities are materialised here (its draft probabilities are), so sort-based masks serve, in
        # float32 as vLLM's own apply_top_k_top_p.
        logits = filter_logits(logits, temperature, per_token(top_k, 0).long().clamp(max=vocab),
                               per_token(top_p, 1.0).float(), dtype=torch.float32)
    return logits / torch.where(greedy, 1.0, temperature).unsqueeze(-1)


def process_target_logits(logits, num_draft_tokens: list[int], sampling_metadata,
                          cu_num_draft_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """vLLM's processing of the draft positions' target rows after their generation controls: logits [T, V] ->
    probabilities [T, V] float32, the softmax of processed_target_logits; greedy rows keep their argmax."""
    return processed_target_logits(logits, num_draft_tokens, sampling_metadata, cu_num_draft_tokens).softmax(-1)


class RejectionSampler(nn.Module):
    """Drop-in for vLLM's v1 RejectionSampler (the GPU model runner builds it as RejectionSampler(self.sampler)).

    forward(metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput, every batch on specdec_ext's kernels,
    in vLLM 0.14-0.19's order:
    1. the bonus tokens from the Sampler on the bonus rows (vLLM's rule: its processors, penalties and seeded
       generators apply there); with logprobs asked, called as vLLM calls it (max_num_logprobs=-1 and the logits
       mode of the sampler's logprobs_mode), so that it also returns the bonus rows' logits;
    2. the draft positions' target rows in float32: apply_generation_controls (penalties with the drafts counted,
       the allowed-token mask, bad words matched across the drafts, min_tokens on 0.17-0.19), then temperature,
       top-k and top-p per request (greedy rows untouched), then rejection_sample;
    3. with `max_num_logprobs` set (0: the sampled token's only), the output slots' LogprobsTensors (logprobs_tensors)
       from the raw target rows, or in the sampler's "processed_*" modes the rows after step 2, and the bonus rows'
       logits of step 1; in the layout the release's model runner reads (dense_logprobs_layout).
    Processors vLLM leaves out at the draft positions stay out here (logit bias, min_p, custom ones: they reach only
    the bonus rows, through the Sampler)."""

    def __init__(self, sampler):
        super().__init__()
        self.sampler = sampler

    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        if metadata.max_spec_len > MAX_SPEC_LEN:
            raise ValueError(f"RejectionSampler: metadata.max_spec_len {metadata.max_spec_len} exceeds {MAX_SPEC_LEN}")
        num_logprobs = getattr(sampling_metadata, "max_num_logprobs", None)
        mode = str(getattr(self.sampler, "logprobs_mode", "raw_logprobs"))
        processed_mode = mode.startswith("processed")
        bonus_rows = logits[metadata.bonus_logits_indices]
        if num_logprobs is None:
            bonus = self.sampler(logits=bonus_rows, sampling_metadata=sampling_metadata, predict_bonus_token=True)
        else:
            bonus = self.sampler(logits=bonus_rows, sampling_metadata=_replaced(sampling_metadata, max_num_logprobs=-1),
                                 predict_bonus_token=True,
                                 logprobs_mode_override="processed_logits" if processed_mode else "raw_logits")
            if getattr(bonus, "logprobs_tensors", None) is None:
                raise ValueError("RejectionSampler: the Sampler returned no logits of the bonus rows "
                                 "(max_num_logprobs=-1), which the logprobs of the bonus tokens need")
        raw = logits[metadata.target_logits_indices].float()  # indexing copies: the caller's logits stay as they are
        keep_raw = num_logprobs is not None and not processed_mode
        controlled = apply_generation_controls(raw.clone() if keep_raw else raw, metadata.draft_token_ids,
                                               metadata.num_draft_tokens, metadata.cu_num_draft_tokens,
                                               sampling_metadata)
        processed = processed_target_logits(controlled, metadata.num_draft_tokens, sampling_metadata,
                                            metadata.cu_num_draft_tokens)
        token_ids = rejection_sample(metadata.draft_token_ids, metadata.num_draft_tokens, metadata.max_spec_len,
                                     metadata.cu_num_draft_tokens, draft_probs, processed.softmax(-1),
                                     bonus.sampled_token_ids, sampling_metadata)
        scores = None
        if num_logprobs is not None:
            scores = logprobs_tensors(num_logprobs, metadata, logits.shape[0], processed if processed_mode else raw,
                                      bonus.logprobs_tensors.logprobs, token_ids, mode.endswith("logits"),
                                      dense_logprobs_layout())
        return _sampler_output(token_ids, scores)

    @staticmethod
    def parse_output(output_token_ids: torch.Tensor, vocab_size: int, discard_req_indices: Sequence[int] = (),
                     logprobs_tensors=None, *, return_cu_num_tokens: bool = False):
        """vLLM's: the rows of output_token_ids as lists without placeholders (and ids >= vocab_size); the rows in
        discard_req_indices empty. The second result is either release's: with logprobs_tensors (vLLM 0.14-0.19's
        model runner passes the batch's LogprobsTensors, from vLLM's own class), their rows of the kept tokens as
        LogprobsLists (`logprobs_tensors.filter(mask).tolists(cu)`); with return_cu_num_tokens=True (0.12-0.13), the
        cumulative token counts [B + 1]; else None. The counts are taken before discarding, as vLLM's."""
        rows = output_token_ids.cpu()
        valid = (rows != PLACEHOLDER_TOKEN_ID) & (rows < vocab_size)
        cu = [0] + valid.sum(1).cumsum(0).tolist() if logprobs_tensors is not None or return_cu_num_tokens else None
        second = logprobs_tensors.filter(valid.flatten()).tolists(cu) if logprobs_tensors is not None else cu
        if len(discard_req_indices):
            valid[list(discard_req_indices)] = False
        return [row[mask].tolist() for row, mask in zip(rows, valid)], second


def _vllm_importable() -> bool:
    if "vllm" in sys.modules:  # None there means an import of vllm is blocked
        return sys.modules["vllm"] is not None
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def _v1_contract_differs(module) -> str | None:
    """Why Model Runner V1's sampler in `module` is not the form this shim follows (vLLM 0.12-0.19), or None."""
    constructor = parameters(module.RejectionSampler.__init__)
    if constructor[:1] != ["sampler"] or "spec_config" in constructor:  # 0.20+ builds it from the spec config
        return f"its RejectionSampler takes ({', '.join(constructor)})"
    function = getattr(module, "rejection_sample", None)
    if function is not None:
        names = parameters(function)[:8]
        if len(names) < 8 or names[5] not in V1_TARGET_NAMES or \
                names[:5] + names[6:] != V1_REJECTION_SAMPLE_PARAMETERS[:5] + V1_REJECTION_SAMPLE_PARAMETERS[6:]:
            return f"its rejection_sample takes ({', '.join(parameters(function))})"
    return None


def _patch_model_runner_v1() -> list[str]:
    """Replaces Model Runner V1's RejectionSampler in VLLM_MODULE and in every loaded vllm module that imported it.
    Returns the attribute paths changed; [] when V1 is absent (vLLM 0.34 removed it) or has another contract."""
    global _vllm_rejection_sampler
    try:
        module = importlib.import_module(VLLM_MODULE)
    except ImportError as e:
        logger.debug("specdec_ext: %s is not importable (%s)", VLLM_MODULE, e)
        return []
    current = getattr(module, "RejectionSampler", None)
    if current is None:
        logger.debug("specdec_ext: %s has no RejectionSampler", VLLM_MODULE)
        return []
    if current is not RejectionSampler:
        differs = _v1_contract_differs(module)
        if differs is not None:
            logger.warning("specdec_ext: Model Runner V1's rejection sampler in %s has another contract than the one "
                           "specdec_ext.compat.vllm follows (%s); it was not replaced", VLLM_MODULE, differs)
            return []
        _vllm_rejection_sampler = current
    original = _vllm_rejection_sampler
    # Only references to vLLM's V1 class are swapped: another class of that name (Model Runner V2's) is patched by
    # vllm_v2.patch_model_runner_v2.
    return replace_in_vllm_modules("RejectionSampler", original, RejectionSampler)


def register() -> list[str]:
    """vLLM plugin entry point (group vllm.general_plugins), called in every vLLM process before the model runner is
    chosen: points both runners' verification at specdec_ext's kernels where their contract is one this package
    follows. Model Runner V1 (vLLM 0.12-0.19): its RejectionSampler replaced by this module's, in
    vllm.v1.sample.rejection_sampler and in every loaded vllm module that imported it. Model Runner V2 (vLLM 0.28-0.34):
    its rejection_sample and RejectionSampler (specdec_ext.compat.vllm_v2.patch_model_runner_v2). Idempotent.
    Returns the attribute paths it changed and logs which runner's; never raises: without vLLM it logs that, and for a
    vLLM whose samplers have other contracts it warns and changes nothing."""
    if not _vllm_importable():
        logger.info("specdec_ext: vllm is not importable; the vLLM rejection sampler was not replaced")
        return []
    from .vllm_v2 import patch_model_runner_v2

    patched = {"V1": [], "V2": []}
    for runner, patch in (("V1", _patch_model_runner_v1), ("V2", patch_model_runner_v2)):
        try:
            patched[runner] = patch()
        except Exception as e:  # a plugin must not stop vLLM from starting: say why and leave vLLM as it is
            logger.warning("specdec_ext: patching Model Runner %s's rejection sampler failed (%s: %s); not replaced",
                           runner, type(e).__name__, e)
    for runner, paths in patched.items():
        if paths:
            logger.info("specdec_ext: Model Runner %s verifies with specdec_ext's kernels: replaced %s", runner,
                        ", ".join(paths))
    if not any(patched.values()) and not _already_registered():
        version = getattr(sys.modules.get("vllm"), "__version__", "unknown")
        logger.warning("specdec_ext: vLLM %s has no rejection sampler with a contract specdec_ext follows (Model "
                       "Runner V1 of vLLM 0.12-0.19, V2 of vLLM 0.28-0.34); nothing was replaced", version)
    return sorted(patched["V1"] + patched["V2"])


def _already_registered() -> bool:
    """Whether an earlier register() call left its replacements in place (a second call then changes nothing)."""
    v1 = sys.modules.get(VLLM_MODULE)
    v2 = sys.modules.get("vllm.v1.worker.gpu.spec_decode.rejection_sampler")
    from . import vllm_v2

    return getattr(v1, "RejectionSampler", None) is RejectionSampler or \
        getattr(v2, "rejection_sample", None) is vllm_v2.rejection_sample
