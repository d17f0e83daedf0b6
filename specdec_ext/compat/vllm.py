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
import dataclasses
import importlib
import importlib.util
import itertools
import logging
import sys
from collections.abc import Sequence

import torch
import torch.nn as nn

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

_vllm_rejection_sampler = None  # vLLM's own class, kept by register() for the batches this shim hands back


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


def _needs_vllm(sampling_metadata) -> str | None:
    """The first processing this shim leaves to vLLM's own sampler (logprobs, penalties, bad words, allowed-token
    masks, min_tokens at the draft positions), or None. Attributes the metadata lacks count as off."""
    if getattr(sampling_metadata, "max_num_logprobs", None) is not None:
        return "max_num_logprobs"
    if not getattr(sampling_metadata, "no_penalties", True):
        return "penalties"
    if getattr(sampling_metadata, "bad_words_token_ids", None):
        return "bad_words_token_ids"
    if getattr(sampling_metadata, "allowed_token_ids_mask", None) is not None:
        return "allowed_token_ids_mask"
    # vLLM 0.17-0.19 mask the stop tokens of requests short of min_tokens at the draft positions too (a processor's
    # apply_with_spec_decode); it has something to mask while its min_toks holds requests.
    processors = getattr(getattr(sampling_metadata, "logitsprocs", None), "non_argmax_invariant", None) or ()
    if any(hasattr(p, "apply_with_spec_decode") and getattr(p, "min_toks", None) for p in processors):
        return "min_tokens"
    return None


@dataclasses.dataclass
class SamplerOutput:
    """vLLM's SamplerOutput fields, used when vllm.v1.outputs is not loaded."""
    sampled_token_ids: torch.Tensor
    logprobs_tensors: object = None


def _sampler_output(token_ids: torch.Tensor):
    outputs = sys.modules.get("vllm.v1.outputs")
    cls = getattr(outputs, "SamplerOutput", SamplerOutput)
    return cls(sampled_token_ids=token_ids, logprobs_tensors=None)


def process_target_logits(logits, num_draft_tokens: list[int], sampling_metadata,
                          cu_num_draft_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """vLLM's processing of the draft positions' target rows: logits [T, V] -> probabilities [T, V] float32 of
    softmax(top-k/top-p masked logits / temperature) per request; greedy rows keep their argmax. With
    cu_num_draft_tokens on the logits' device the rows' owners come from it (no host-to-device copy: a copy from
    pageable host memory synchronises the stream)."""
    logits = logits.float()
    if sampling_metadata.all_greedy:
        return logits.softmax(-1)
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
    return (logits / torch.where(greedy, 1.0, temperature).unsqueeze(-1)).softmax(-1)


class RejectionSampler(nn.Module):
    """Drop-in for vLLM's v1 RejectionSampler (the GPU model runner builds it as RejectionSampler(self.sampler)).

    forward(metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput: the bonus tokens come from the
    Sampler on the bonus rows (vLLM's rule: its processors, penalties and seeded generators apply there); the draft
    positions' target rows get temperature, top-k and top-p per request (greedy rows untouched), then
    rejection_sample. Batches that need logprobs, penalties, bad words, allowed-token masks or (vLLM 0.17-0.19)
    min_tokens at the draft positions are handed to vLLM's own RejectionSampler when register() found it, and raise
    NotImplementedError otherwise."""

    def __init__(self, sampler):
        super().__init__()
        self.sampler = sampler
        self._vllm = None

    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        if metadata.max_spec_len > MAX_SPEC_LEN:
            raise ValueError(f"RejectionSampler: metadata.max_spec_len {metadata.max_spec_len} exceeds {MAX_SPEC_LEN}")
        unsupported = _needs_vllm(sampling_metadata)
        if unsupported is not None:
            if _vllm_rejection_sampler is None:
                raise NotImplementedError(f"RejectionSampler: sampling_metadata asks for {unsupported}, which this "
                                          "shim leaves to vLLM's RejectionSampler (call register() inside vLLM)")
            if self._vllm is None:
                self._vllm = _vllm_rejection_sampler(self.sampler)
            return self._vllm(metadata, draft_probs, logits, sampling_metadata)
        bonus = self.sampler(logits=logits[metadata.bonus_logits_indices], sampling_metadata=sampling_metadata,
                             predict_bonus_token=True).sampled_token_ids
        target_probs = process_target_logits(logits[metadata.target_logits_indices], metadata.num_draft_tokens,
                                             sampling_metadata, metadata.cu_num_draft_tokens)
        token_ids = rejection_sample(metadata.draft_token_ids, metadata.num_draft_tokens, metadata.max_spec_len,
                                     metadata.cu_num_draft_tokens, draft_probs, target_probs, bonus,
                                     sampling_metadata)
        return _sampler_output(token_ids)

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
