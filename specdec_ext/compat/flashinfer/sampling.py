"""`flashinfer.sampling.chain_speculative_sampling` on specdec_ext's chain sampling kernel, following the contract of
FlashInfer 0.7.0rc3 to 0.7.4 (flashinfer/sampling.py; unchanged between them).

- draft_probs [B, K, V], draft_token_ids [B, K] (int32 or int64), target_probs [B, K+1, V]; float32, bfloat16 or
  float16, read as they are (FlashInfer first casts them to float32 copies).
- Returns (output_token_ids, output_accepted_token_num, output_emitted_draft_token_num):
  output_token_ids [B, K+1] int32: the accepted drafts, then the resampled (or bonus) token, then -1;
  accepted: the drafts that pass when each is judged on its own (u_i * q_i(x_i) < p_i(x_i), one uniform each);
  emitted: the drafts emitted before the first rejection (emitted + 1 tokens are emitted in all).
  Both counts are ADDED in place to maybe_output_accepted_token_num / maybe_output_emitted_draft_token_num when given
  ([B] int32 or int64 on the inputs' device), and start from zeros otherwise, as FlashInfer's.
- seed and offset, both given (both ints, or both int64/uint64 tensors of 1 or B entries): the Philox key and
  counter base of specdec_ext's RNG contract; the output depends only on the inputs, seed[b] and offset[b], and a
  new offset gives fresh draws. A seed shared by the batch (an int, or 1 entry) keys row b with seed ^ (b << 32), so
  that the rows draw independently, as FlashInfer's rows do (one seed, one Philox subsequence per row). Without them
  each request's key is drawn from `generator` (torch's default generator
  of the inputs' device when None), which therefore advances on every call, as FlashInfer's does.
- deterministic is accepted: this kernel is always deterministic.
No host synchronisation: with seed and offset tensors the call can be captured in a CUDA graph.

Deliberate differences from FlashInfer:
- The random streams differ (FlashInfer's is curand's), so one seed gives the same law, not the same tokens.
- seed / offset tensors of B entries key row b with seed[b] and offset[b] (FlashInfer's kernel reads entry 0 of each
  and separates the rows by subsequence).
- Only one of seed / offset raises ValueError (FlashInfer ignores a lone one and draws both from the generator).
- int64 count buffers receive the counts (FlashInfer adds into int32 copies of them, which the caller never sees).
- FlashInfer's kernel judges the first rejected draft a second time, with a fresh uniform, when it counts accepted
  drafts; here each draft is judged once, so the accepted count is a sum of independent Bernoulli(min(1, p_i/q_i)),
  with mean sum_i min(1, p_i/q_i): the documented meaning ("each token considered independently"). FlashInfer's
  count is larger in expectation wherever a draft is rejected.
"""
import torch

from ... import ops
from .. import backend

_OP = "chain_speculative_sampling"


def _check_shapes(draft_probs, draft_token_ids, target_probs) -> None:
    for name, t, shape in (("draft_probs", draft_probs, "[B, K, V]"), ("draft_token_ids", draft_token_ids, "[B, K]"),
                           ("target_probs", target_probs, "[B, K+1, V]")):
        if not isinstance(t, torch.Tensor) or t.dim() != len(shape.split(",")):
            raise ValueError(f"{_OP}: {name} must be a {shape} tensor, got {getattr(t, 'shape', type(t).__name__)}")
    batch, k, vocab = draft_probs.shape
    if tuple(draft_token_ids.shape) != (batch, k):
        raise ValueError(f"{_OP}: draft_token_ids must be [B, K] = [{batch}, {k}] (draft_probs' first dims), got "
                         f"{tuple(draft_token_ids.shape)}")
    if tuple(target_probs.shape) != (batch, k + 1, vocab):
        raise ValueError(f"{_OP}: target_probs must be [B, K+1, V] = [{batch}, {k + 1}, {vocab}], got "
                         f"{tuple(target_probs.shape)}")


def _count_buffer(buf, name: str, batch: int, device) -> torch.Tensor:
    if buf is None:
        return torch.zeros(batch, dtype=torch.int32, device=device)
    if not isinstance(buf, torch.Tensor) or buf.dtype not in (torch.int32, torch.int64) or tuple(buf.shape) != (batch,):
        raise ValueError(f"{_OP}: {name} must be a [B] = [{batch}] int32 (or int64) tensor, got "
                         f"{getattr(buf, 'dtype', type(buf).__name__)} {tuple(getattr(buf, 'shape', ()))}")
    if buf.device != device:
        raise ValueError(f"{_OP}: {name} is on {buf.device} but draft_probs is on {device}")
    return buf


def _row_keys(seed: torch.Tensor, batch: int, device) -> torch.Tensor:
    """One shared key -> B distinct keys, seed ^ (b << 32) for row b (row 0 keeps the key): FlashInfer gives each row
    its own Philox subsequence of one seed; the same key for every row would draw the same uniforms in every row.
    Device ops only: no host read, capturable."""
    rows = torch.arange(batch, dtype=torch.int64, device=device) << 32
    return torch.bitwise_xor(seed.expand(batch), rows)


def _seed_and_offset(seed, offset, batch: int, device):
    """(seed, offset) for the op: both None (drawn from the generator), both ints, or both 1-D int64 tensors. A seed
    shared by the batch (an int, or a tensor of 1 entry) becomes one key per row (_row_keys)."""
    if seed is None and offset is None:
        return None, None
    if seed is None or offset is None:
        raise ValueError(f"{_OP}: seed and offset go together: give both (Philox key and counter) or neither (drawn "
                         "from generator)")
    if isinstance(seed, torch.Tensor) != isinstance(offset, torch.Tensor):
        raise ValueError(f"{_OP}: seed and offset must both be tensors or both be ints")
    if not isinstance(seed, torch.Tensor):
        for name, v in (("seed", seed), ("offset", offset)):
            if isinstance(v, bool) or not isinstance(v, int) or not -(2**63) <= v < 2**64:
                raise ValueError(f"{_OP}: {name} must be an int that fits in 64 bits, got {v!r}")
        if batch <= 1 or ops._capturing():
            return seed, offset  # under capture the op refuses Python ints (they would be frozen into the graph)
        seed = torch.full((1,), seed - 2**64 if seed >= 2**63 else seed, dtype=torch.int64, device=device)
        return _row_keys(seed, batch, device), offset
    for name, t in (("seed", seed), ("offset", offset)):
        if t.dtype not in (torch.int64, torch.uint64) or t.dim() != 1 or t.numel() not in (1, batch):
            raise ValueError(f"{_OP}: {name} must be a 1-D int64 or uint64 tensor of 1 or B = {batch} entries, got "
                             f"{t.dtype} {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{_OP}: {name} is on {t.device} but draft_probs is on {device}")
    seed, offset = seed.view(torch.int64), offset.view(torch.int64)  # uint64: the same 64 bits
    if seed.numel() == 1 and batch > 1:
        seed = _row_keys(seed, batch, device)
    return seed, offset


def chain_speculative_sampling(draft_probs, draft_token_ids, target_probs, maybe_output_accepted_token_num=None,
                               maybe_output_emitted_draft_token_num=None, deterministic=True, generator=None, seed=None,
                               offset=None):
    """FlashInfer's chain speculative sampling (module docstring): returns (output_token_ids [B, K+1] int32 with -1
    after the emitted tokens, accepted [B], emitted [B]), the counts added in place to the buffers given."""
    _check_shapes(draft_probs, draft_token_ids, target_probs)
    batch, device = draft_probs.shape[0], draft_probs.device
    accepted = _count_buffer(maybe_output_accepted_token_num, "maybe_output_accepted_token_num", batch, device)
    emitted = _count_buffer(maybe_output_emitted_draft_token_num, "maybe_output_emitted_draft_token_num", batch, device)
    seed, offset = _seed_and_offset(seed, offset, batch, device)
    independent = torch.empty(batch, dtype=torch.int32, device=device)
    out = backend().chain_speculative_sampling(draft_token_ids, target_probs, draft_probs, seed=seed, offset=offset,
                                               generator=generator, accepted_independently=independent)
    # FlashInfer accumulates into the caller's buffers (a running total across rounds).
    accepted.add_(independent)
    emitted.add_(out.num_accepted)
    return out.output_token_ids, accepted, emitted
