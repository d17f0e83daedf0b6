"""vLLM Model Runner V2's rejection sampler on specdec_ext's chain sampling kernel.

Follows the contract of vLLM 0.34's `vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py` (Model Runner V2,
vLLM's default runner since vllm-project/vllm#44443 and its only one from 0.34 on), and that of 0.28-0.33, which
differs only in taking the draft logits as a tensor, whose `RejectionSampler` (in
`rejection_sampler.py`, built as `RejectionSampler(sampler, spec_config, device, *, watermark_key=None)` and called
as `(logits, input_batch, draft_logits=None) -> SamplerOutput`) processes the logits with vLLM's own sampler
(penalties, bad words, logit bias, temperature, top-k / top-p: `Sampler.apply_sampling_params`) and then calls
`rejection_sample`. This module replaces that call; vLLM's sampler still does everything around it (the processing,
the logprobs of the sampled tokens, the counts of sampled and rejected tokens, chunking of large batches). So the
generation controls at the draft positions (penalties, bad words, allowed tokens, min_tokens and logit bias, each row
with the drafts before it in its history) arrive applied in `target_logits`, masked tokens at -inf, and the logprobs
stay vLLM's: unlike Model Runner V1's, nothing of them is left to this shim.

`rejection_sample(target_logits, draft_logits_cache, draft_sampled, cu_num_logits, pos, idx_mapping,
expanded_idx_mapping, expanded_local_pos, temperature, seed, num_speculative_steps, ...)`, shapes as vLLM's:

- `target_logits` [num_logits, V]: request b's rows cu_num_logits[b]..cu_num_logits[b + 1], its k_b draft
  positions then its bonus row, processed by vLLM's sampler: temperature already applied, masked entries -inf.
- `draft_logits_cache`: vLLM's DraftLogitsCache (duck-typed: `.values` [rows, K, Vd] pre-temperature draft logits,
  `.row_mapping` [max_num_reqs] or None), or vLLM 0.28-0.33's `draft_logits` [max_num_reqs, K, Vd] (pre-temperature,
  by request state; passed by position or by that name), or None (point proposals: n-gram, greedy drafting).
  Request b's draft step i is `values[row, i]`, row = idx_mapping[b] (through row_mapping when the cache is
  sharded; a row of -1 holds no drafts of that request, and vLLM has marked them placeholders). The rows are
  gathered into a [T, Vd] float32 copy divided by the request's temperature (one copy of T * Vd entries; the kernel
  then reads them as its draft rows), since the ops take draft rows per draft position and one temperature for
  target and draft. The copy is not small next to the op (`specdec bench compat_vllm_v2`, bench/RESULTS.md: 0.5-0.8x
  the op's time on a 2-core CPU, 5x at B = 32, V = 128256); reading the cache in place would take a draft-row index
  [T] and a draft temperature as op arguments, which the ops do not have.
- `draft_sampled` [num_logits]: the input token of each logits row, so request b's draft i is
  draft_sampled[cu_num_logits[b] + i + 1]. A draft of -1 (vLLM's placeholder) ends the request's drafts there: the
  drafts before it are verified and the last token comes from the target row at the placeholder, as vLLM does.
- `pos` [num_logits], `idx_mapping` [num_reqs], `temperature` and `seed` [max_num_reqs] by request state: request b's
  randomness is Philox keyed by (seed[idx_mapping[b]], pos of its first row), so the same request at the same
  position gets the same tokens whatever else is in the batch (vLLM's contract; the tokens are not vLLM's, whose
  noise is its own). A temperature of exactly 0 is greedy in vLLM; here any temperature below 1e-5 is (vLLM's
  `_SAMPLING_EPS`, the ops' threshold).
- Returns (sampled [num_reqs, num_speculative_steps + 1] int64, num_sampled [num_reqs] int32): the accepted drafts,
  then the recovered or bonus token; num_sampled = accepted + 1. Entries after them are -1.
- `use_block_verification=True`: block verification (the ops' `verification="block"`, docs/ops.md); greedy requests
  are verified token by token, as in vLLM.
- Refused with ValueError (this library is lossless): `synthetic_conditional_rates` (rejection_sample_method
  "synthetic"), `fly_window_size > 0` ("fly"), watermarking (`contexts`, `watermarking`, `watermark_key`).
  `use_fp64` (the precision of vLLM's Gumbel draw) and `skip_masked_vocab_blocks` (a shortcut of vLLM's kernel)
  change nothing here.
- A target row the verification reads that holds NaN, or has no mass (every logit -inf), is the ops' invalid input
  (docs/ops.md): ValueError on the CPU, a last token of -1 for that request on CUDA. vLLM instead maps NaN to -inf and
  emits some in-range token (its test_all_nan_target_logits_in_range); this shim surfaces such a row.

No host synchronisation: every step is a device op, so the call can be captured in a CUDA graph. Nothing here
imports vLLM; `register()` in specdec_ext.compat.vllm patches vLLM's module tree (`patch_model_runner_v2`).
"""
import inspect
import logging

import torch

from ..ops import LIMITS
from . import backend, parameters, replace_in_vllm_modules

logger = logging.getLogger("specdec_ext.compat.vllm")

PLACEHOLDER_TOKEN_ID = -1
# Where Model Runner V2 defines its rejection sampler and the function it verifies with.
SAMPLER_MODULE = "vllm.v1.worker.gpu.spec_decode.rejection_sampler"
UTILS_MODULE = "vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils"
LOSSLESS_METHODS = ("standard", "block")  # SpeculativeConfig.rejection_sample_method values this shim verifies
OP = "rejection_sample"
CORE_PARAMETERS = 11  # target_logits .. num_speculative_steps, which vLLM passes by position
DRAFT_LOGITS_NAMES = ("draft_logits_cache", "draft_logits")  # the second parameter: vLLM 0.34's name, 0.28-0.33's


def _tensor(value, name: str, dims: int, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != dims:
        raise ValueError(f"{OP}: {name} must be a {what} tensor, got {tuple(getattr(value, 'shape', ())) or value!r}")
    return value


def _refuse_lossy(synthetic_conditional_rates, fly_window_size, contexts, watermarking, watermarking_skip_mask,
                  watermark_key) -> None:
    if synthetic_conditional_rates is not None:
        raise ValueError(f"{OP}: synthetic_conditional_rates (rejection_sample_method='synthetic') accepts drafts "
                         "at set rates whatever the target says, which is lossy; specdec_ext verifies losslessly only")
    if fly_window_size:
        raise ValueError(f"{OP}: fly_window_size > 0 (rejection_sample_method='fly') defers rejections by entropy, "
                         "which is lossy; specdec_ext verifies losslessly only")
    if any(x is not None for x in (contexts, watermarking, watermarking_skip_mask, watermark_key)):
        raise ValueError(f"{OP}: watermarking (contexts, watermarking, watermark_key) is not supported by "
                         "specdec_ext's kernels; leave the watermark unset or the vLLM sampler unpatched")


def _draft_layout(cu_num_logits: torch.Tensor, num_logits: int):
    """Our flat form of vLLM's layout: (cu_num_draft_tokens [B] int32 inclusive, owner [T] int64 the request of each
    draft position, local [T] int64 its index among the request's drafts). Device ops only."""
    device = cu_num_logits.device
    cu = cu_num_logits.to(torch.int64)
    batch = cu.numel() - 1
    cu_drafts = cu[1:] - torch.arange(1, batch + 1, device=device)  # request b's rows less its bonus row, summed
    positions = torch.arange(num_logits - batch, device=device)
    owner = torch.searchsorted(cu_drafts, positions, right=True)
    local = positions - (cu_drafts - (cu[1:] - cu[:-1] - 1))[owner]
    return cu_drafts.to(torch.int32), owner, local


def rejection_sample(*args, **kwargs):
    """vLLM Model Runner V2's rejection_sample on our kernel: (sampled [num_reqs, K + 1] int64, num_sampled
    [num_reqs] int32), request b's accepted drafts then its recovered or bonus token, -1 after them.

    Its signature (`inspect.signature`) is vLLM 0.34's; the second argument may also be passed by 0.28-0.33's name,
    `draft_logits=` (their callers and tests pass it so), which a plain 0.34 signature would reject."""
    if DRAFT_LOGITS_NAMES[1] in kwargs:
        if DRAFT_LOGITS_NAMES[0] in kwargs or len(args) > 1:
            raise TypeError(f"{OP}: the draft logits were given twice ({', '.join(DRAFT_LOGITS_NAMES)})")
        kwargs[DRAFT_LOGITS_NAMES[0]] = kwargs.pop(DRAFT_LOGITS_NAMES[1])
    return _rejection_sample(*args, **kwargs)


def _rejection_sample(target_logits, draft_logits_cache, draft_sampled, cu_num_logits, pos, idx_mapping,
                      expanded_idx_mapping, expanded_local_pos, temperature, seed, num_speculative_steps,
                      synthetic_conditional_rates=None, use_fp64=False, use_block_verification=False, contexts=None,
                      watermarking=None, watermarking_skip_mask=None, watermark_key=None, fly_window_size=0,
                      fly_entropy_threshold=0.3, fly_entropy_top_k=3, skip_masked_vocab_blocks=False):
    _refuse_lossy(synthetic_conditional_rates, fly_window_size, contexts, watermarking, watermarking_skip_mask,
                  watermark_key)
    target_logits = _tensor(target_logits, "target_logits", 2, "[num_logits, V]")
    num_logits, vocab = target_logits.shape
    cu_num_logits = _tensor(cu_num_logits, "cu_num_logits", 1, "[num_reqs + 1]")
    batch = cu_num_logits.numel() - 1
    if batch < 0:
        raise ValueError(f"{OP}: cu_num_logits must hold num_reqs + 1 >= 1 entries")
    for name, value in (("draft_sampled", draft_sampled), ("pos", pos), ("expanded_idx_mapping", expanded_idx_mapping),
                        ("expanded_local_pos", expanded_local_pos)):
        if _tensor(value, name, 1, "[num_logits]").numel() != num_logits:
            raise ValueError(f"{OP}: {name} must have num_logits = {num_logits} entries (target_logits' rows), got "
                             f"{value.numel()}")
    if _tensor(idx_mapping, "idx_mapping", 1, "[num_reqs]").numel() != batch:
        raise ValueError(f"{OP}: idx_mapping must have num_reqs = {batch} entries, got {idx_mapping.numel()}")
    if isinstance(num_speculative_steps, bool) or not isinstance(num_speculative_steps, int) or \
            not 0 <= num_speculative_steps <= LIMITS["max_draft_tokens"]:
        raise ValueError(f"{OP}: num_speculative_steps must be an int in [0, {LIMITS['max_draft_tokens']}], got "
                         f"{num_speculative_steps!r}")
    if num_logits < batch:
        raise ValueError(f"{OP}: target_logits has {num_logits} rows, fewer than one per request ({batch})")
    device = target_logits.device
    idx = idx_mapping.to(device=device, dtype=torch.int64)
    request_temperature = _tensor(temperature, "temperature", 1, "[max_num_reqs]").to(device)[idx].float()
    request_seed = _tensor(seed, "seed", 1, "[max_num_reqs]").to(device)[idx].to(torch.int64)
    first_row = cu_num_logits[:-1].to(device=device, dtype=torch.int64)
    request_offset = pos.to(device)[first_row].to(torch.int64) if batch else first_row

    cu_drafts, owner, local = _draft_layout(cu_num_logits.to(device), num_logits)
    draft_ids = draft_sampled.to(device)[owner + torch.arange(owner.numel(), device=device) + 1]  # [T]
    # The drafts a request verifies: those before its first placeholder (the rest are never read).
    k_layout = (cu_num_logits[1:] - cu_num_logits[:-1] - 1).to(device=device, dtype=torch.int64)
    cap = k_layout.scatter_reduce(0, owner, torch.where(draft_ids < 0, local, k_layout[owner]), "amin")
    draft_ids = draft_ids.clamp_min(0).to(torch.int32)

    draft_rows = None
    if draft_logits_cache is not None:
        # vLLM 0.34's DraftLogitsCache, or 0.28-0.33's draft_logits tensor [max_num_reqs, K, Vd] by request state.
        is_tensor = isinstance(draft_logits_cache, torch.Tensor)
        values = draft_logits_cache if is_tensor else getattr(draft_logits_cache, "values", None)  # [rows, K, Vd]
        if not isinstance(values, torch.Tensor) or values.dim() != 3:
            raise ValueError(f"{OP}: draft_logits_cache must be a [rows, K, Vd] tensor or have .values one, got "
                             f"{type(draft_logits_cache).__name__}")
        row = idx
        row_mapping = None if is_tensor else getattr(draft_logits_cache, "row_mapping", None)
        if row_mapping is not None:
            row = row_mapping.to(device=device, dtype=torch.int64)[idx]
        row = row.clamp_min(0)  # -1: the request's drafts are placeholders, never read
        if values.shape[1] < num_speculative_steps:
            raise ValueError(f"{OP}: draft_logits_cache holds {values.shape[1]} draft steps per request, fewer than "
                             f"num_speculative_steps = {num_speculative_steps}")
        step = local.clamp_max(values.shape[1] - 1)  # positions past a request's drafts are never read
        # Pre-temperature draft logits at the request's temperature (greedy requests' rows are never read).
        scale = torch.where(request_temperature >= LIMITS["min_temperature"], request_temperature, 1.0)
        draft_rows = values[row[owner], step].float() / scale[owner].unsqueeze(-1)  # [T, Vd]
        vocab = min(vocab, values.shape[-1])  # a target vocabulary padded past the draft's: vLLM's rule
        draft_rows = draft_rows[:, :vocab]
    # The target logits carry the temperature already: the kernel runs sampled requests at temperature 1.
    # Greedy below the ops' threshold (vLLM: at exactly 0; its logits divided by a smaller temperature are one-hot).
    op_temperature = torch.where(request_temperature >= LIMITS["min_temperature"], 1.0, 0.0)
    out = backend().chain_speculative_sampling_from_logits(
        draft_ids, target_logits[:, :vocab], draft_rows, temperature=op_temperature, seed=request_seed,
        offset=request_offset, cu_num_draft_tokens=cu_drafts, max_draft_tokens=num_speculative_steps,
        num_draft_tokens=cap.to(torch.int32), verification="block" if use_block_verification else "token")
    return out.output_token_ids.to(torch.int64), out.num_accepted + 1


rejection_sample.__signature__ = inspect.signature(_rejection_sample)


def _sampler_class(base):
    """A subclass of vLLM's V2 RejectionSampler that refuses the lossy methods when it is built; its verification
    runs through the module's rejection_sample, which patch_model_runner_v2 points at ours."""

    class RejectionSampler(base):
        __doc__ = f"vLLM's {base.__module__}.RejectionSampler, verifying on specdec_ext's kernels (lossless only)."
        specdec_ext_base = base

        def __init__(self, sampler, spec_config, device, *args, watermark_key=None, **kwargs):
            method = getattr(spec_config, "rejection_sample_method", "standard")
            if method not in LOSSLESS_METHODS:
                raise ValueError(f"RejectionSampler: rejection_sample_method={method!r} is lossy; specdec_ext verifies "
                                 f"with {' or '.join(map(repr, LOSSLESS_METHODS))} only")
            if watermark_key is not None:
                raise ValueError("RejectionSampler: watermark_key is set, but specdec_ext's kernels do not watermark")
            super().__init__(sampler, spec_config, device, *args, **kwargs)  # vLLM < 0.30 takes no watermark_key

    RejectionSampler.__module__ = __name__
    return RejectionSampler


def patch_model_runner_v2() -> list[str]:
    """Points Model Runner V2's verification at this module: `rejection_sample` in its rejection_sampler and
    rejection_sampler_utils modules, and `RejectionSampler` (a subclass refusing lossy methods) wherever a loaded
    vllm module holds vLLM's class. Idempotent. Returns the attribute paths changed; warns and changes nothing when
    the module is there but its rejection_sample has another signature than the one this shim follows."""
    import importlib

    try:
        sampler_module = importlib.import_module(SAMPLER_MODULE)
        utils_module = importlib.import_module(UTILS_MODULE)
    except ImportError as e:
        logger.debug("specdec_ext: Model Runner V2's rejection sampler is not importable (%s)", e)
        return []
    theirs = getattr(utils_module, "rejection_sample", None)
    ours, known = parameters(rejection_sample), parameters(theirs)
    # The positional core in vLLM's order (the draft logits named as 0.28-0.33 or 0.34 name them), and no keyword
    # this shim does not know (a call with it would fail here).
    core = [DRAFT_LOGITS_NAMES[0] if name in DRAFT_LOGITS_NAMES else name for name in known[:CORE_PARAMETERS]]
    if theirs is not rejection_sample and (core != ours[:CORE_PARAMETERS] or
                                           not set(known) - set(DRAFT_LOGITS_NAMES) <= set(ours)):
        logger.warning("specdec_ext: %s.rejection_sample takes (%s), not the (%s) this shim follows; Model Runner "
                       "V2's rejection sampler was not replaced", UTILS_MODULE, ", ".join(known), ", ".join(ours))
        return []
    patched = []
    for module in (utils_module, sampler_module):
        if getattr(module, "rejection_sample", None) is not rejection_sample:
            setattr(module, "rejection_sample", rejection_sample)
            patched.append(f"{module.__name__}.rejection_sample")
    original = getattr(sampler_module, "RejectionSampler", None)
    if original is not None:
        base = getattr(original, "specdec_ext_base", original)
        ours_class = original if original is not base else _sampler_class(base)
        patched += replace_in_vllm_modules("RejectionSampler", base, ours_class)
    return sorted(patched)
