"""The public ops: argument checks and defaults, then one call into torch.ops.specdec; fake kernels so the
ops trace under torch.compile and CUDA-graph capture.

Each op's checks live in a `_<op>(ops, ...)` function that takes the op namespace, so that
specdec_ext.sim runs exactly the same checks in front of the emulated kernels (torch.ops.specdec_sim).
"""
from typing import NamedTuple

import torch

from . import _extension

_extension.load("_C")

_INT64_MIN, _UINT64_END = -(2**63), 2**64


def _request_vector(value, name: str, op: str, batch: int | None, device) -> torch.Tensor:
    """A per-request int64 vector from an int (broadcast to the batch) or a 0-/1-D integer tensor."""
    if isinstance(value, bool) or not isinstance(value, (int, torch.Tensor)):
        raise TypeError(f"{op}: {name} must be an int or an integer tensor, got {type(value).__name__}")
    if isinstance(value, int):
        if not _INT64_MIN <= value < _UINT64_END:
            raise ValueError(f"{op}: {name} must fit in 64 bits, got {value}")
        if value >= 2**63:  # a uint64 seed: keep its bits
            value -= _UINT64_END
        return torch.full((batch or 1,), value, dtype=torch.int64, device=device)
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise ValueError(f"{op}: {name} must be an integer tensor, got {value.dtype}")
    if value.dim() > 1:
        raise ValueError(f"{op}: {name} must be a 0-D or 1-D tensor, got shape {tuple(value.shape)}")
    value = value.to(torch.int64).reshape(-1)
    if batch is not None and value.numel() == 1 and batch != 1:
        value = value.expand(batch)
    if batch is not None and value.numel() != batch:
        raise ValueError(f"{op}: {name} has {value.numel()} entries for a batch of {batch}")
    return value.contiguous()


def _philox_uniform(ops, seed, offset, n: int, stream: int = 0) -> torch.Tensor:
    op = "philox_uniform"
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 2**34:
        raise ValueError(f"{op}: n must be an int in [0, 2^34], got {n!r}")
    if isinstance(stream, bool) or not isinstance(stream, int) or not 0 <= stream < 2**32:
        raise ValueError(f"{op}: stream must be an int in [0, 2^32), got {stream!r}")
    tensors = [t for t in (seed, offset) if isinstance(t, torch.Tensor)]
    device = tensors[0].device if tensors else torch.device("cpu")
    if any(t.device != device for t in tensors):
        raise ValueError(f"{op}: seed and offset must be on the same device, got {[str(t.device) for t in tensors]}")
    batch = next((t.numel() for t in tensors if t.dim() == 1), None)  # seed's length, else offset's
    seed = _request_vector(seed, "seed", op, batch, device)
    offset = _request_vector(offset, "offset", op, seed.numel(), device)
    return ops.philox_uniform(seed, offset, n, stream)


def philox_uniform(seed, offset, n: int, stream: int = 0) -> torch.Tensor:
    """Uniforms in the open interval (0, 1) from counter-based Philox4x32-10: the random stream that every
    sampling op of this library draws from (RNG contract, DESIGN.md §3.1).

    seed, offset: [B] integer tensors or ints (broadcast); a request's key and counter base.
    n: uniforms per request. stream: which of the request's independent streams.
    Returns [B, n] float32 on the device of seed/offset; row b depends only on (seed[b], offset[b], stream).
    """
    return _philox_uniform(torch.ops.specdec, seed, offset, n, stream)


class SamplingOutput(NamedTuple):
    output_token_ids: torch.Tensor  # [B, K+1] int32: accepted drafts, the resampled or bonus token, then -1
    num_accepted: torch.Tensor  # [B] int32; tokens emitted = num_accepted + 1


_strict = False

# Error bits of the sampling kernels (SamplingError in csrc/include/specdec/sampling_math.h) -> what they mean.
_SAMPLING_ERRORS = {
    1: "{target} holds NaN or inf",
    2: "{draft} holds NaN or inf",
    4: "draft_token_ids holds ids outside [0, V)",
    8: "num_draft_tokens holds values outside [0, K]",
    16: "temperature must be finite and >= 0",
}


def set_strict(enabled: bool) -> None:
    """Strict mode: on CUDA (and under the emulator) the sampling ops check their inputs on the device and
    raise on NaN/Inf, out-of-range ids or counts. The check synchronises with the host, so it is for
    debugging; without it, invalid rows still get defined, in-range outputs. The CPU kernels always raise."""
    global _strict
    _strict = bool(enabled)


def is_strict() -> bool:
    return _strict


def _error_flags(device, records_errors: bool):
    """The kernels' device-side error word, when strict mode asks for their device-side checks."""
    return torch.zeros(1, dtype=torch.int32, device=device) if records_errors and _strict else None


def _raise_recorded_errors(op: str, device, flags, messages: dict) -> None:
    """Raises ValueError naming every error bit the kernel recorded in `flags` (messages: bit -> text)."""
    if flags is None:
        return
    bits = int(flags.item())  # the host sync that strict mode is for
    if bits:
        raise ValueError(f"{op}: invalid input detected on {device}: " + "; ".join(
            msg for bit, msg in messages.items() if bits & bit))


def _per_request(value, name: str, op: str, batch: int, device, dtype) -> torch.Tensor:
    """A [B] tensor of `dtype` on `device` from a Python scalar (broadcast) or a 0-/1-D tensor."""
    if isinstance(value, torch.Tensor):
        if value.dim() > 1 or value.numel() not in (1, batch):
            raise ValueError(f"{op}: {name} must be a scalar or have B = {batch} entries, got shape {tuple(value.shape)}")
        if value.device != device:
            raise ValueError(f"{op}: {name} is on {value.device} but the inputs are on {device}")
        return value.reshape(-1).to(dtype).expand(batch).contiguous()
    return torch.full((batch,), value, dtype=dtype, device=device)


def _chain_sampling(ops, draft_token_ids, target, draft, *, logits, num_draft_tokens, greedy_or_temperature, seed,
                    offset, generator, out, records_errors) -> SamplingOutput:
    op = "chain_speculative_sampling_from_logits" if logits else "chain_speculative_sampling"
    tname = "target_logits" if logits else "target_probs"
    if not isinstance(draft_token_ids, torch.Tensor) or draft_token_ids.dim() != 2:
        raise ValueError(f"{op}: draft_token_ids must be a [B, K] tensor")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"{op}: {tname} must be a tensor, got {type(target).__name__}")
    batch, k = draft_token_ids.shape
    device = target.device
    if num_draft_tokens is None:
        num_draft_tokens = torch.full((batch,), k, dtype=torch.int32, device=device)
    else:
        num_draft_tokens = _per_request(num_draft_tokens, "num_draft_tokens", op, batch, device, torch.int32)
    if logits:
        t = greedy_or_temperature
        if isinstance(t, (int, float)) and not isinstance(t, bool) and not (t >= 0 and t != float("inf")):
            raise ValueError(f"{op}: temperature must be finite and >= 0, got {t}")
        control = _per_request(t, "temperature", op, batch, device, torch.float32)
    else:
        greedy = False if greedy_or_temperature is None else greedy_or_temperature
        control = _per_request(greedy, "greedy", op, batch, device, torch.bool)
    if seed is None:
        gen_device = generator.device if generator is not None else device
        seed = torch.randint(-(2**63), 2**63 - 1, (batch,), generator=generator, device=gen_device).to(device)
    else:
        seed = _request_vector(seed, "seed", op, batch, device)
    offset = _request_vector(0 if offset is None else offset, "offset", op, batch, device)
    if seed.device != device or offset.device != device:
        raise ValueError(f"{op}: seed and offset must be on {device}")
    if out is None:
        out = SamplingOutput(torch.empty((batch, k + 1), dtype=torch.int32, device=device),
                             torch.empty((batch,), dtype=torch.int32, device=device))
    elif not (isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
        raise ValueError(f"{op}: out must be a tuple (output_token_ids [B, K+1] int32, num_accepted [B] int32)")
    out = SamplingOutput(*out)
    flags = _error_flags(device, records_errors)
    fn = ops.chain_speculative_sampling_from_logits if logits else ops.chain_speculative_sampling
    fn(draft_token_ids, target, draft, num_draft_tokens, control, seed, offset, out.output_token_ids, out.num_accepted,
       flags)
    names = {"target": tname, "draft": "draft_logits" if logits else "draft_probs"}
    _raise_recorded_errors(op, device, flags, {bit: msg.format(**names) for bit, msg in _SAMPLING_ERRORS.items()})
    return out


def chain_speculative_sampling(draft_token_ids, target_probs, draft_probs=None, *, num_draft_tokens=None, greedy=None,
                               seed=None, offset=None, generator=None, out=None) -> SamplingOutput:
    """Chain speculative sampling (DESIGN.md §3.1) from probabilities: accept draft token x at position i with
    probability min(1, p_i(x) / q_i(x)); at the first rejection draw from norm(max(0, p_i - q_i)); if all
    num_draft_tokens[b] drafts are accepted, draw a bonus token from p_k. The emitted tokens are distributed
    exactly as sampling the target alone.

    draft_token_ids [B, K] int32/int64; target_probs [B, K+1, V]; draft_probs [B, K, V] or None (point
    proposals: q is one-hot at the draft token), float32/bfloat16/float16.
    num_draft_tokens [B] (ragged batches), greedy [B] bool or a bool, seed/offset [B] or ints (Philox key
    and counter base; seed None draws from `generator`), out: preallocated (output_token_ids, num_accepted).
    Returns SamplingOutput(output_token_ids [B, K+1] int32, num_accepted [B] int32).
    """
    return _chain_sampling(torch.ops.specdec, draft_token_ids, target_probs, draft_probs, logits=False,
                           num_draft_tokens=num_draft_tokens, greedy_or_temperature=greedy, seed=seed, offset=offset,
                           generator=generator, out=out, records_errors=target_probs.device.type != "cpu")


def chain_speculative_sampling_from_logits(draft_token_ids, target_logits, draft_logits=None, *, temperature,
                                           num_draft_tokens=None, seed=None, offset=None, generator=None,
                                           out=None) -> SamplingOutput:
    """chain_speculative_sampling from logits: p = softmax(target_logits / temperature[b]) and likewise q are
    computed inside the kernel in float32 and never written to memory; temperature 0 makes a row greedy.
    temperature: a float or [B] float32."""
    return _chain_sampling(torch.ops.specdec, draft_token_ids, target_logits, draft_logits, logits=True,
                           num_draft_tokens=num_draft_tokens, greedy_or_temperature=temperature, seed=seed,
                           offset=offset, generator=generator, out=out,
                           records_errors=target_logits.device.type != "cpu")


_TRUNCATE_ERRORS = {
    1: "num_kept must be in [0, block_len]",
    2: "kept_indices must increase within [0, block_len) for the first num_kept entries",
    4: "the block [cache_seqlens, cache_seqlens + block_len) runs outside the cache",
    8: "block_table points outside the paged cache",
}
_MAX_BLOCK_LEN = 64


def _layers(caches, name: str) -> list:
    """A list of per-layer caches from a list/tuple or one stacked [L, ...] tensor."""
    if isinstance(caches, torch.Tensor):
        if caches.dim() != 5:
            raise ValueError(f"truncate_kv_cache: a stacked {name} must be [L, ...] with 4-D layers, got {tuple(caches.shape)}")
        return list(caches.unbind(0))
    caches = list(caches)
    if not all(isinstance(c, torch.Tensor) for c in caches):
        raise TypeError(f"truncate_kv_cache: {name} must be tensors")
    return caches


def _truncate_kv_cache(ops, cache_seqlens, num_kept, *, block_len, kept_indices, k_caches, v_caches, block_table, clear,
                       records_errors) -> None:
    op = "truncate_kv_cache"
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"{op}: cache_seqlens must be a [B] int32 tensor")
    batch, device = cache_seqlens.numel(), cache_seqlens.device
    if kept_indices is not None:
        if not isinstance(kept_indices, torch.Tensor) or kept_indices.dim() != 2:
            raise ValueError(f"{op}: kept_indices must be a [B, block_len] int32 tensor")
        if block_len is not None and block_len != kept_indices.shape[1]:
            raise ValueError(f"{op}: block_len {block_len} disagrees with kept_indices' {kept_indices.shape[1]} columns")
        block_len = kept_indices.shape[1]
        kept_indices = kept_indices.to(torch.int32).contiguous()
    if block_len is None:
        if clear:
            raise ValueError(f"{op}: block_len is needed with clear=True")
        block_len = _MAX_BLOCK_LEN  # lengths only: bounds num_kept
    num_kept = _per_request(num_kept, "num_kept", op, batch, device, torch.int32)
    k_caches, v_caches = _layers(k_caches, "k_caches"), _layers(v_caches, "v_caches")
    if block_table is not None:
        block_table = block_table.to(torch.int32).contiguous()
    flags = _error_flags(device, records_errors)
    ops.truncate_kv_cache(cache_seqlens, num_kept, kept_indices, k_caches, v_caches, block_table, int(block_len),
                          bool(clear), flags)
    _raise_recorded_errors(op, device, flags, _TRUNCATE_ERRORS)


def truncate_kv_cache(cache_seqlens, num_kept, *, block_len=None, kept_indices=None, k_caches=(), v_caches=(),
                      block_table=None, clear=False) -> None:
    """Cuts the KV cache back after verification (DESIGN.md §3.3), in place, without a host sync on CUDA.

    cache_seqlens [B] int32: lengths before the verified block (as passed to verify); advanced by num_kept.
    num_kept [B] (or an int): tokens of the block that stay (chain: num_accepted + 1).
    kept_indices [B, Q] int32, -1 padded: block-relative indices of the kept tokens, increasing (tree): block
    slot kept_indices[b, j] moves to block slot j in every layer, all layers in one launch.
    k_caches, v_caches: every layer's cache, a list or one stacked [L, ...] tensor; contiguous
    [B, S_max, Hkv, D] or paged [num_pages, page_size, Hkv, D] with block_table [B, max_pages].
    clear: zero the block's discarded slots. block_len: Q, implied by kept_indices, needed for clear.
    Invalid requests raise on the CPU; on CUDA they are left untouched (set_strict(True) raises).
    """
    _truncate_kv_cache(torch.ops.specdec, cache_seqlens, num_kept, block_len=block_len, kept_indices=kept_indices,
                       k_caches=k_caches, v_caches=v_caches, block_table=block_table, clear=clear,
                       records_errors=cache_seqlens.device.type != "cpu")


# Error bits of verify_attention on CUDA (AttentionError in csrc/include/specdec/attention.h).
_ATTENTION_ERRORS = {
    1: "cache_seqlens[b] + Q runs outside the cache (or cache_seqlens[b] < 0)",
    2: "block_table points outside the paged cache",
}


def _verify_attention(ops, q, k_cache, v_cache, cache_seqlens, k_new, v_new, *, block_table, tree_mask, softmax_scale,
                      return_lse, records_errors):
    op = "verify_attention"
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("cache_seqlens", cache_seqlens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if tree_mask is not None:
        tree_mask = tree_mask.to(torch.bool).contiguous()
    if block_table is not None:
        block_table = block_table.to(torch.int32).contiguous()
    if softmax_scale is not None and not softmax_scale > 0:
        raise ValueError(f"{op}: softmax_scale must be > 0, got {softmax_scale}")
    flags = _error_flags(q.device, records_errors)
    out, lse = ops.verify_attention(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, tree_mask,
                                    float(softmax_scale or 0.0), bool(return_lse), flags)
    _raise_recorded_errors(op, q.device, flags, _ATTENTION_ERRORS)
    return (out, lse) if return_lse else out


def verify_attention(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, *, block_table=None, tree_mask=None,
                     softmax_scale=None, return_lse=False):
    """Attention of the verify step (DESIGN.md §3.2): q [B, Q, Hq, D] (Q = K+1 or a tree's size, 1..64) against
    the KV cache, contiguous [B, S_max, Hkv, D] or paged [num_pages, page_size, Hkv, D] with block_table
    [B, max_pages]. Query i of request b sees cache[0 : cache_seqlens[b]] and new token j where tree_mask[i, j]
    (default causal). k_new/v_new [B, Q, Hkv, D], when given, are written into the cache at
    cache_seqlens[b] + j first; cache_seqlens is not advanced. Hq % Hkv == 0 (GQA/MQA).
    Returns out [B, Q, Hq, D], or (out, lse [B, Q, Hq] float32) with return_lse.

    CPU: float32, bfloat16, float16, any head dim up to 256; invalid requests raise. CUDA: float16 and
    bfloat16 on tensor cores (sm_80+), head dim 64 or 128, no host sync; a request whose block runs past
    its cache or whose pages are outside the cache gets NaN outputs (set_strict(True) raises)."""
    return _verify_attention(torch.ops.specdec, q, k_cache, v_cache, cache_seqlens, k_new, v_new,
                             block_table=block_table, tree_mask=tree_mask, softmax_scale=softmax_scale,
                             return_lse=return_lse, records_errors=q.device.type != "cpu")


def _register_fakes(namespace: str) -> None:
    @torch.library.register_fake(f"{namespace}::philox_uniform")
    def _(seed, offset, n, stream=0):
        return seed.new_empty((seed.shape[0], n), dtype=torch.float32)

    @torch.library.register_fake(f"{namespace}::verify_attention")
    def _(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, tree_mask, softmax_scale, return_lse,
          error_flags):
        return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)

    for name in ("chain_speculative_sampling", "chain_speculative_sampling_from_logits", "truncate_kv_cache"):
        # Both write only their output arguments.
        torch.library.register_fake(f"{namespace}::{name}")(lambda *args: None)


_register_fakes("specdec")
