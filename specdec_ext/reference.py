"""Readable, vectorised pure-PyTorch references of every op: the test oracle and the benchmark baseline.

Each function computes what the op's contract says, on any device, with no custom kernel.
"""
from typing import NamedTuple

import torch

from .ops import LIMITS

# Temperatures below this (0 included) make a request greedy: the kernels' constant (sampling_math.h).
MIN_TEMPERATURE = LIMITS["min_temperature"]

# ---------------------------------------------------------------------------------------------------
# Philox4x32-10 on int64 tensors holding uint32 values. torch has no uint32 multiply-high, so each
# 32x32-bit product is formed from two 32x16-bit products, which stay below 2^49 and cannot overflow.
_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = 0xFFFFFFFF


def _mulhilo32(a: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t = a * (x & 0xFFFF)
    mid = a * (x >> 16) + (t >> 16)
    return ((mid & 0xFFFF) << 16) | (t & 0xFFFF), mid >> 16


def philox4x32_10(counter: tuple, key: tuple) -> tuple:
    """Philox4x32-10 of counter (4 int64 tensors of uint32 words) under key (2 of them); broadcasts."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        lo0, hi0 = _mulhilo32(_M0, c0)
        lo1, hi1 = _mulhilo32(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + _W0) & _MASK32
        k1 = (k1 + _W1) & _MASK32
    return c0, c1, c2, c3


def philox_uniform(seed: torch.Tensor, offset: torch.Tensor, n: int, stream: int = 0) -> torch.Tensor:
    """[B, n] float32 uniforms in (0, 1): element i of row b is word i % 4 of
    Philox4x32-10(counter=(i // 4, stream, offset_lo, offset_hi), key=(seed_lo, seed_hi)), mapped to
    (2 * (word >> 9) + 1) * 2^-24."""
    seed = seed.to(torch.int64).reshape(-1, 1)
    offset = offset.to(torch.int64).reshape(-1, 1)
    blocks = (n + 3) // 4
    block = torch.arange(blocks, dtype=torch.int64, device=seed.device).reshape(1, -1)
    counter = (
        block.expand(seed.shape[0], blocks),
        torch.full_like(block, stream),
        offset & _MASK32,
        (offset >> 32) & _MASK32,
    )
    words = torch.stack(philox4x32_10(counter, (seed & _MASK32, (seed >> 32) & _MASK32)), dim=-1)
    words = words.reshape(seed.shape[0], blocks * 4)[:, :n]
    return (((words >> 9) << 1) | 1).to(torch.float32) * 2.0**-24


# ---------------------------------------------------------------------------------------------------
# Gumbel coupling (coupling="gumbel", sampling="invariant"): the noise of token v at a request's position n is
# -ln(-ln u), u = uniform v of Philox stream 2 at offset n; a row's token is argmax_v(ln p(v) + noise). Here in
# float64, so the kernels' (float32 keys, base 2) can differ only where two keys are within rounding of each other.
GUMBEL_STREAM = 2


def gumbel_noise(seed: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] float64: the Gumbel noise of every token at (seed[b], positions[b])."""
    u = philox_uniform(seed, positions, vocab, stream=GUMBEL_STREAM).double()
    return -torch.log(-torch.log(u))


def _gumbel_tokens(log_p: torch.Tensor, seed, offset, depth) -> torch.Tensor:
    """[B, R] Gumbel-max tokens of rows log_p [B, R, V] (float64 log-probabilities), row (b, i) at position
    offset[b] + depth[b, i]."""
    batch, rows, vocab = log_p.shape
    positions = (offset.long().unsqueeze(-1) + depth).reshape(-1)
    noise = gumbel_noise(seed.long().repeat_interleave(rows), positions, vocab).view(batch, rows, vocab)
    return (log_p + noise).argmax(-1)


def _gumbel_rows(log_p: torch.Tensor, greedy, seed, offset, depth=None) -> torch.Tensor:
    """Chain or tree rows [B, R, V] as one-hot rows on each row's token (a greedy walk over them emits those tokens):
    the argmax for greedy requests, else the Gumbel-max token at position offset[b] + depth[b, i] (depth None: the row
    index, a chain)."""
    batch, rows, vocab = log_p.shape
    if depth is None:
        depth = torch.arange(rows, device=log_p.device).expand(batch, rows)
    tokens = torch.where(greedy.unsqueeze(-1), log_p.argmax(-1), _gumbel_tokens(log_p, seed, offset, depth))
    return torch.nn.functional.one_hot(tokens, vocab).double()


def gumbel_sample(logits, *, temperature, seed, positions, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """Reference of specdec_ext.gumbel_sample: argmax_v(log_softmax(logits / t)[v] + noise(seed, position)), the
    argmax below MIN_TEMPERATURE; the logits processed by filter_logits first. Returns [B] int32."""
    batch, vocab = logits.shape
    logits = filter_logits(logits, temperature, top_k, top_p, min_p)
    t, greedy = _temperature(temperature, batch, logits.device)
    seed = torch.as_tensor(seed, device=logits.device).long().expand(batch)
    positions = torch.as_tensor(positions, device=logits.device).long().expand(batch)
    log_p = torch.log_softmax(logits.double() / torch.where(greedy, 1.0, t).unsqueeze(-1), -1)
    drawn = _gumbel_tokens(log_p.unsqueeze(1), seed, positions, torch.zeros(batch, 1, dtype=torch.long))[:, 0]
    return torch.where(greedy, logits.argmax(-1), drawn).int()


# ---------------------------------------------------------------------------------------------------
# Logits processing of the from-logits ops (csrc/include/specdec/row_filter.h), in float64: top-k keeps the values
# >= the k-th largest; top-p, over what top-k kept, the values >= the largest t whose softmax mass
# sum_{x >= t} exp((x - max) / T) reaches top_p of the total; min-p the values with exp((x - max) / T) >= min_p.
# Each keeps every entry tied with its threshold. The kernels sum the masses in float32 (canonical order), so the kept
# sets can differ only where a cumulative mass is within float32 rounding of top_p times the total.
def filter_logits(logits, temperature, top_k=None, top_p=None, min_p=None, *, dtype=torch.float64):
    """logits [B, ..., V] with per-request controls (a scalar or [B]: top_k 0 off, top_p 1 off, min_p 0 off) ->
    the logits with the removed entries -inf, unchanged for greedy requests (temperature below MIN_TEMPERATURE).
    dtype: of the masses (float32: the sort-based masks an engine applies before a sampling op, as a baseline)."""
    batch, vocab = logits.shape[0], logits.shape[-1]
    device = logits.device
    shape = (batch,) + (1,) * (logits.dim() - 1)

    def control(value, default, dtype):
        """-> (the control as [B, 1, ...], whether it may be on). A Python number is known on the host; a tensor is
        taken as on, so that nothing here reads device values back (engines call this inside their step)."""
        value = default if value is None else value
        if isinstance(value, torch.Tensor):
            return value.to(device=device, dtype=dtype).expand(batch).reshape(shape), True
        return torch.full(shape, value, dtype=dtype, device=device), value != default

    t, greedy = _temperature(temperature, batch, device)
    k, k_on = control(top_k, 0, torch.int64)
    p, p_on = control(top_p, 1.0, torch.float32)
    min_p, min_p_on = control(min_p, 0.0, torch.float32)
    p, min_p = p.to(dtype), min_p.to(dtype)
    x = logits.to(dtype)
    m = x.amax(-1, keepdim=True)
    lo = torch.full_like(m, float("-inf"))
    if k_on or p_on:
        values, order = x.sort(-1, descending=True)
    if k_on:
        kth = values.gather(-1, (k.clamp(1, vocab) - 1).expand_as(m))
        lo = torch.where((k > 0) & (k < vocab), kth, lo)
    w = torch.exp((x - m) / torch.where(greedy, 1.0, t).view(shape))
    if p_on:
        kept_by_k = torch.where(x >= lo, w, 0.0)
        cumulative = kept_by_k.gather(-1, order).cumsum(-1)
        # S(v) for each sorted value v: the cumulative mass through its last tie (the entries >= v number V - #(< v)).
        ascending = values.flip(-1).contiguous()
        through = vocab - torch.searchsorted(ascending, values.contiguous(), right=False)
        mass_at = cumulative.gather(-1, through - 1)
        reaches = mass_at >= p * cumulative[..., -1:]
        first = reaches.int().argmax(-1, keepdim=True)  # the largest value whose S reaches the target
        lo = torch.where(p < 1, torch.maximum(lo, values.gather(-1, first)), lo)
    if min_p_on:
        lo = torch.where(min_p > 0, torch.maximum(lo, torch.where(w >= min_p, x, float("inf")).amin(-1, keepdim=True)),
                         lo)
    lo = torch.where(greedy.view(shape), float("-inf"), lo)
    return torch.where(x >= lo, logits, torch.full_like(logits, float("-inf")))


# ---------------------------------------------------------------------------------------------------
# Chain speculative sampling. Same uniforms as the kernels (RNG contract): acceptance at position i uses
# uniform i of stream 0, the resampled or bonus token uniform 0 of stream 1. Acceptance is decided in
# float32 exactly as the kernels do (u * q < p); the resampled token is drawn by inverse CDF in float64 over
# the vocabulary in index order, so it can differ from the kernels' (float32, canonical order) only where
# u * R falls within rounding of a CDF boundary.
def _inverse_cdf(mass: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row-wise first index whose cumulative mass exceeds u * total (mass: [N, V] float64 >= 0)."""
    cdf = mass.cumsum(-1)
    threshold = (u.double() * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, threshold, right=True).clamp_max(mass.shape[-1] - 1).squeeze(-1)


def block_verification(ids, p_rows, q_rows, num_draft_tokens, u) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block verification (Sun et al., arXiv 2403.10444) of every request in float64: ids [B, K] (in range below
    num_draft_tokens [B]), target rows p_rows [B, K+1, V], draft rows q_rows [B, K, V] or None (point proposals),
    acceptance uniforms u [B, K]. Returns (tau [B], c [B, K+1], h [B, K]): the accepted count, the weights c_0..c_K
    and the thresholds h_1..h_K. c_0 = 1, c_j = min(1, c_{j-1} p_{j-1}(x_j) / q_{j-1}(x_j)) (0 where q = 0). With
    n = num_draft_tokens[b]: h_j = R_j / (R_j + 1 - c_j) for j < n, R_j = sum_v max(c_j p_j(v) - q_j(v), 0) (h_j = 1
    where R_j + 1 - c_j = 0), h_n = c_n, and tau = the largest j <= n with u_j < h_j (0 if none). The last token is
    the caller's: from norm(max(c_tau p_tau - q_tau, 0)) when tau < n, else the all-accepted token."""
    batch, k = ids.shape
    vocab = p_rows.shape[-1]
    ids = ids.long().clamp(0, vocab - 1)  # past num_draft_tokens: any value, never judged
    q_full = torch.nn.functional.one_hot(ids, vocab).double() if q_rows is None else q_rows[:, :k].double()
    p_x = p_rows[:, :k].gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    q_x = q_full.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    ratio = torch.where(q_x > 0, p_x / torch.where(q_x > 0, q_x, 1.0), 0.0)
    c = [torch.ones(batch, dtype=torch.float64, device=ids.device)]
    for j in range(k):
        c.append((c[-1] * ratio[:, j]).clamp(0.0, 1.0))
    c = torch.stack(c, -1)  # [B, K+1]
    n = num_draft_tokens.long()
    h = c[:, 1:].clone()  # h_j at index j - 1; h_n = c_n
    for j in range(1, k):
        residual = (c[:, j, None] * p_rows[:, j] - q_full[:, j]).clamp_min(0).sum(-1)
        denominator = residual + (1 - c[:, j])
        h_j = torch.where(denominator > 0, residual / torch.where(denominator > 0, denominator, 1.0), 1.0)
        h[:, j - 1] = torch.where(j < n, h_j, h[:, j - 1])
    j = torch.arange(1, k + 1, device=ids.device)
    accept = (u.double() < h) & (j <= n.unsqueeze(-1))
    tau = (accept.long() * j).amax(-1) if k else torch.zeros(batch, dtype=torch.long, device=ids.device)
    return tau, c, h


def _chain_reference(draft_token_ids, p_rows, q_rows, p_accept, q_accept, greedy, num_draft_tokens, seed, offset,
                     layout, verification="token"):
    """Shared by both reference ops. p_rows [B, K+1, V] and q_rows [B, K, V] (or None) are float64 masses;
    p_accept/q_accept [B, K] the float32 p(x), q(x) the acceptance test uses; layout the _EngineLayout;
    verification "token" or "block" (block_verification, for the requests that are not greedy)."""
    batch, k = draft_token_ids.shape
    device = draft_token_ids.device
    ids = draft_token_ids.long()
    u = philox_uniform(seed, offset, k, stream=0) if layout.uniforms is None else layout.uniforms.to(device)
    u_resample = philox_uniform(seed, offset, 1, stream=1)[:, 0] if layout.final_uniforms is None else \
        layout.final_uniforms.to(device)
    positions = torch.arange(k, device=device)
    active = positions < num_draft_tokens.long().unsqueeze(-1)
    argmax = p_rows.argmax(-1)  # [B, K+1]
    accept = torch.where(greedy.unsqueeze(-1), ids == argmax[:, :k], (q_accept > 0) & (u * q_accept < p_accept))
    accepted = (accept & active).long().cumprod(-1).sum(-1)  # leading accepted drafts
    rows = torch.arange(batch, device=device)
    weight = torch.ones(batch, dtype=torch.float64, device=device)  # of p in the residual: c_tau in block mode
    if verification == "block":
        if layout.accepted_independently is not None:
            raise ValueError("accepted_independently is not defined with verification='block'")
        tau, c, _ = block_verification(ids, p_rows, q_rows, num_draft_tokens, u)
        accepted = torch.where(greedy, accepted, tau)
        weight = torch.where(greedy, weight, c[rows, accepted])
    elif verification != "token":
        raise ValueError(f"verification must be 'token' or 'block', got {verification!r}")
    j = accepted  # the row the last token comes from
    p_j = p_rows[rows, j]
    rejected = j < num_draft_tokens.long()
    if k == 0:  # nothing drafted: the token comes from p_0
        q_j = torch.zeros_like(p_j)
    elif q_rows is not None:
        q_j = torch.where(rejected.unsqueeze(-1), q_rows[rows, j.clamp_max(k - 1)], torch.zeros_like(p_j))
    else:  # point proposals: q is one-hot at the rejected draft token
        q_j = torch.zeros_like(p_j)
        x = ids[rows, j.clamp_max(k - 1)]
        q_j[rows[rejected], x[rejected]] = 1.0
    residual = (weight.unsqueeze(-1) * p_j - q_j).clamp_min(0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_j)  # p == q: sample p itself
    token = torch.where(greedy, argmax[rows, j], _inverse_cdf(residual, u_resample))
    if layout.bonus_token_ids is not None:
        token = torch.where(rejected, token, layout.bonus_token_ids.reshape(-1).long())
    if layout.accepted_independently is not None:
        layout.accepted_independently.copy_((accept & active).sum(-1))
    out = torch.full((batch, k + 1), -1, dtype=torch.int32, device=device)
    keep = positions.unsqueeze(0) < accepted.unsqueeze(-1)
    out[:, :k] = torch.where(keep, ids, -1).int()
    out[rows, j] = token.int()
    return out, accepted.int()


def _defaults(draft_token_ids, num_draft_tokens, seed, offset):
    """[B] counts (default: all K drafts, or all N nodes of a tree), seeds and offsets."""
    batch, k = draft_token_ids.shape
    device = draft_token_ids.device
    def full(v, dtype):
        return v.to(device=device, dtype=dtype).expand(batch) if isinstance(v, torch.Tensor) else \
            torch.full((batch,), v, dtype=dtype, device=device)
    return (full(k if num_draft_tokens is None else num_draft_tokens, torch.int32), full(seed, torch.int64),
            full(0 if offset is None else offset, torch.int64))


def _checked_ids(draft_token_ids, num_draft_tokens, vocab: int) -> torch.Tensor:
    """The draft ids as int64, those below each request's count checked to be in [0, V); the ones past it (never
    read, any value) clamped into range for the gathers."""
    ids = draft_token_ids.long()
    active = torch.arange(ids.shape[1], device=ids.device) < num_draft_tokens.long().unsqueeze(-1)
    if (((ids < 0) | (ids >= vocab)) & active).any():
        raise ValueError("chain_speculative_sampling: draft_token_ids holds ids outside [0, V)")
    return ids.clamp(0, vocab - 1)


class _EngineLayout(NamedTuple):
    """The engine-layout arguments (docs/design.md §3.4) once the flat form is padded: uniforms [B, K] (or [B, N]),
    final_uniforms [B], bonus_token_ids [B], accepted_independently [B] to fill."""
    uniforms: torch.Tensor | None = None
    final_uniforms: torch.Tensor | None = None
    bonus_token_ids: torch.Tensor | None = None
    accepted_independently: torch.Tensor | None = None


def _full_draft_rows(draft_rows, draft_to_target, vocab: int, logits: bool):
    """Draft rows of a reduced vocabulary ([..., Vd], column j = target id draft_to_target[j]) as full-vocabulary rows:
    probability 0 (logit -inf) off the map."""
    if draft_rows is None or draft_to_target is None:
        return draft_rows
    ids = draft_to_target.long()
    if ((ids < 0) | (ids >= vocab)).any() or ids.unique().numel() != ids.numel():
        raise ValueError("draft_to_target must hold distinct ids in [0, V)")
    full = draft_rows.new_full((*draft_rows.shape[:-1], vocab), float("-inf") if logits else 0.0)
    full[..., ids] = draft_rows
    return full


def _pad_flat(cu_num_draft_tokens, max_draft_tokens, draft_token_ids, target_rows, draft_rows, uniforms, bonus,
              caps=None):
    """The flat form (vLLM's: request b owns draft positions cu[b-1]..cu[b], target rows from cu[b-1] + b, or
    cu[b-1] with caller bonus tokens) as the padded form: ([B, K] ids, [B, K+1, V] target rows, [B, K, V] draft rows,
    [B, K] uniforms, [B] counts), K = max_draft_tokens. The pad is zeros (never read: past each request's count).
    caps: the flat form's num_draft_tokens ([B], each in [0, cu[b] - cu[b-1]]): request b keeps its first caps[b]
    drafts, and its target rows up to its layout's row caps[b] (where its all-accepted token comes from)."""
    cu = cu_num_draft_tokens.long().tolist()
    batch, k, total = len(cu), max_draft_tokens, draft_token_ids.shape[0]
    starts = [0] + cu[:-1]
    if any(not 0 <= s <= e <= total or e - s > k for s, e in zip(starts, cu)):
        raise ValueError("cu_num_draft_tokens must be non-decreasing in [0, T] with steps of at most max_draft_tokens")
    counts = [e - s for s, e in zip(starts, cu)]
    if caps is not None:
        caps = torch.as_tensor(caps).to(torch.int64).expand(batch).tolist()
        if any(not 0 <= c <= n for c, n in zip(caps, counts)):
            raise ValueError("num_draft_tokens must be in [0, cu[b] - cu[b-1]] in the flat form")
        counts = caps
    ids = draft_token_ids.new_zeros((batch, k))
    target = target_rows.new_full((batch, k + 1, target_rows.shape[-1]), 1.0)
    draft = None if draft_rows is None else draft_rows.new_full((batch, k, draft_rows.shape[-1]), 1.0)
    u = None if uniforms is None else uniforms.new_full((batch, k), 0.5)
    for b, (s, n) in enumerate(zip(starts, counts)):  # the first n of the request's drafts and rows
        ids[b, :n] = draft_token_ids[s:s + n]
        first = s if bonus is not None else s + b
        target[b, :n + (bonus is None)] = target_rows[first:first + n + (bonus is None)]
        if draft is not None:
            draft[b, :n] = draft_rows[s:s + n]
        if u is not None:
            u[b, :n] = uniforms[s:s + n]
    return ids, target, draft, u, torch.tensor(counts, dtype=torch.int32, device=draft_token_ids.device)


def _chain_inputs(draft_token_ids, target_rows, draft_rows, num_draft_tokens, cu_num_draft_tokens, max_draft_tokens,
                  bonus_token_ids, uniforms, final_uniforms, draft_to_target, accepted_independently, logits: bool,
                  process=None):
    """Both chain references' inputs in the padded form with full-vocabulary draft rows, and the _EngineLayout.
    process(rows [B, R, V or Vd]), when given, is applied to the padded target and draft rows (a draft row over its own
    columns, before it is expanded)."""
    if cu_num_draft_tokens is not None:
        draft_token_ids, target_rows, draft_rows, uniforms, num_draft_tokens = _pad_flat(
            cu_num_draft_tokens, max_draft_tokens, draft_token_ids, target_rows, draft_rows, uniforms, bonus_token_ids,
            num_draft_tokens)
    elif bonus_token_ids is not None and target_rows.shape[1] == draft_token_ids.shape[1]:
        target_rows = torch.cat([target_rows, torch.ones_like(target_rows[:, :1])], 1)  # the bonus row, never used
    if process is not None:
        target_rows = process(target_rows)
        draft_rows = None if draft_rows is None else process(draft_rows)
    draft_rows = _full_draft_rows(draft_rows, draft_to_target, target_rows.shape[-1], logits)
    if uniforms is not None and ((uniforms < 0) | ~(uniforms < 1)).any() or \
            final_uniforms is not None and ((final_uniforms < 0) | ~(final_uniforms < 1)).any():
        raise ValueError("uniforms and final_uniforms must be in [0, 1)")
    layout = _EngineLayout(uniforms, final_uniforms, bonus_token_ids, accepted_independently)
    return draft_token_ids, target_rows, draft_rows, num_draft_tokens, layout


def chain_speculative_sampling(draft_token_ids, target_probs, draft_probs=None, *, num_draft_tokens=None, greedy=None,
                               seed, offset=None, cu_num_draft_tokens=None, max_draft_tokens=None, bonus_token_ids=None,
                               uniforms=None, final_uniforms=None, draft_to_target=None, accepted_independently=None,
                               coupling="rejection", verification="token"):
    """Reference of specdec_ext.chain_speculative_sampling (seed required), engine layouts included (the flat form is
    padded first; num_draft_tokens is then its cap). verification="block": block_verification. Returns
    (output_token_ids, num_accepted)."""
    draft_token_ids, target_probs, draft_probs, num_draft_tokens, layout = _chain_inputs(
        draft_token_ids, target_probs, draft_probs, num_draft_tokens, cu_num_draft_tokens, max_draft_tokens,
        bonus_token_ids, uniforms, final_uniforms, draft_to_target, accepted_independently, logits=False)
    batch, k = draft_token_ids.shape
    v = target_probs.shape[-1]
    num_draft_tokens, seed, offset = _defaults(draft_token_ids, num_draft_tokens, seed, offset)
    greedy = torch.as_tensor(False if greedy is None else greedy, device=draft_token_ids.device).expand(batch)
    if coupling == "gumbel" and verification == "block":
        raise ValueError("verification='block' is not defined with coupling='gumbel'")
    if coupling == "gumbel":  # every row's token is fixed by its noise: a greedy walk over one-hot rows
        target_probs = _gumbel_rows(target_probs.double().log(), greedy, seed, offset)
        greedy = torch.ones_like(greedy)
    ids = _checked_ids(draft_token_ids, num_draft_tokens, v)
    p32 = target_probs.float()
    p_accept = p32[:, :k].gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    q_accept = torch.ones_like(p_accept) if draft_probs is None else \
        draft_probs.float().gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    q_rows = None if draft_probs is None else draft_probs.double()
    return _chain_reference(draft_token_ids, p32.double(), q_rows, p_accept, q_accept, greedy, num_draft_tokens, seed,
                            offset, layout, verification)


def _temperature(temperature, batch: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """([B] float64 temperatures as the kernels read them (rounded to float32), [B] greedy: below
    MIN_TEMPERATURE, 0 included)."""
    t = torch.as_tensor(temperature, device=device).to(torch.float32).double().expand(batch)
    return t, t < MIN_TEMPERATURE


def chain_speculative_sampling_from_logits(draft_token_ids, target_logits, draft_logits=None, *, temperature,
                                           num_draft_tokens=None, seed, offset=None, cu_num_draft_tokens=None,
                                           max_draft_tokens=None, bonus_token_ids=None, uniforms=None,
                                           final_uniforms=None, draft_to_target=None, accepted_independently=None,
                                           coupling="rejection", top_k=None, top_p=None, min_p=None,
                                           verification="token"):
    """Reference of specdec_ext.chain_speculative_sampling_from_logits: softmax(logits / temperature) in float64
    (so acceptance can differ from the kernels' float32 where u * q is within rounding of p); greedy below
    MIN_TEMPERATURE; top_k, top_p, min_p by filter_logits (a draft row over its own columns)."""
    draft_token_ids, target_logits, draft_logits, num_draft_tokens, layout = _chain_inputs(
        draft_token_ids, target_logits, draft_logits, num_draft_tokens, cu_num_draft_tokens, max_draft_tokens,
        bonus_token_ids, uniforms, final_uniforms, draft_to_target, accepted_independently, logits=True,
        process=lambda rows: filter_logits(rows, temperature, top_k, top_p, min_p))
    batch, k = draft_token_ids.shape
    num_draft_tokens, seed, offset = _defaults(draft_token_ids, num_draft_tokens, seed, offset)
    t, greedy = _temperature(temperature, batch, draft_token_ids.device)
    scale = torch.where(greedy, 1.0, 1.0 / t).view(-1, 1, 1)
    p_rows = torch.softmax(target_logits.double() * scale, -1)
    q_rows = None if draft_logits is None else torch.softmax(draft_logits.double() * scale, -1)
    if coupling == "gumbel" and verification == "block":
        raise ValueError("verification='block' is not defined with coupling='gumbel'")
    if coupling == "gumbel":
        p_rows = _gumbel_rows(torch.log_softmax(target_logits.double() * scale, -1), greedy, seed, offset)
        greedy = torch.ones_like(greedy)
    ids = _checked_ids(draft_token_ids, num_draft_tokens, p_rows.shape[-1]).unsqueeze(-1)
    p_accept = p_rows[:, :k].gather(-1, ids).squeeze(-1).float()
    q_accept = torch.ones_like(p_accept) if q_rows is None else q_rows.gather(-1, ids).squeeze(-1).float()
    return _chain_reference(draft_token_ids, p_rows, q_rows, p_accept, q_accept, greedy, num_draft_tokens, seed, offset,
                            layout, verification)


# ---------------------------------------------------------------------------------------------------
# Tree speculative sampling (the method is README "Tree speculation" and csrc/include/specdec/tree_sampling.h).
# Node c > 0 is tested with uniform c - 1 of stream 0 (a chain-shaped tree draws what the chain op draws), the
# last token with uniform 0 of stream 1. Vectorised over requests: one step per tree depth, one per child.
def tree_node_errors(parents, candidate_token_ids, num_nodes, vocab) -> list:
    """What is malformed in each request's tree, as messages (empty if nothing): the root's parent is not -1,
    a parent is not an earlier node (out of range, after its child, a cycle), a candidate id is outside
    [0, V), or two children of one node carry the same token."""
    errors = []
    for b in range(parents.shape[0]):
        n, par, ids = int(num_nodes[b]), parents[b].tolist(), candidate_token_ids[b].tolist()
        if not 1 <= n <= parents.shape[1]:
            errors.append(f"num_nodes[{b}] = {n} is outside [1, N]")
            continue
        if par[0] != -1:
            errors.append(f"parents[{b}, 0] must be -1 (node 0 is the root)")
        seen = set()
        for c in range(1, n):
            if not 0 <= par[c] < c:
                errors.append(f"parents[{b}, {c}] = {par[c]} is not an earlier node")
            elif not 0 <= ids[c] < vocab:
                errors.append(f"candidate_token_ids[{b}, {c}] = {ids[c]} is outside [0, V)")
            elif (par[c], ids[c]) in seen:
                errors.append(f"node {c} of request {b} repeats a sibling's token {ids[c]}")
            seen.add((par[c], ids[c]))
    return errors


def _node_depths(parents, num_nodes) -> torch.Tensor:
    """[B, N] depth of every node of well-formed trees (parents before children; padding and nodes past
    num_nodes get depth 0, their rows never read)."""
    batch, n = parents.shape
    depth = torch.zeros(batch, n, dtype=torch.long, device=parents.device)
    in_tree = torch.arange(n, device=parents.device) < num_nodes.long().unsqueeze(-1)
    for c in range(1, n):
        par = parents[:, c].long()
        ok = in_tree[:, c] & (par >= 0) & (par < c)
        depth[:, c] = torch.where(ok, depth.gather(1, par.clamp(0, n - 1).unsqueeze(-1)).squeeze(-1) + 1, 0)
    return depth


def _tree_reference(parents, candidate_token_ids, num_nodes, p_rows, q_rows, greedy, seed, offset, layout):
    """p_rows [B, N, V] float64 target probabilities at every node; q_rows [B, N, V] (row n: the draft
    distribution n's children were drawn from without replacement) or None (point proposals)."""
    batch, n = parents.shape
    vocab = p_rows.shape[-1]
    errors = tree_node_errors(parents, candidate_token_ids, num_nodes, vocab)
    if errors:
        raise ValueError("tree_speculative_sampling: malformed tree: " + "; ".join(errors))
    device = parents.device
    rows, nodes = torch.arange(batch, device=device), torch.arange(n, device=device)
    par, ids = parents.long(), candidate_token_ids.long()
    in_tree = (nodes > 0) & (nodes < num_nodes.long().unsqueeze(-1))
    u_node = torch.cat([torch.ones(batch, 1, device=device), philox_uniform(seed, offset, n, stream=0)[:, :n - 1]], 1) \
        if layout.uniforms is None else layout.uniforms.to(device)
    u_resample = philox_uniform(seed, offset, 1, stream=1)[:, 0] if layout.final_uniforms is None else \
        layout.final_uniforms.to(device)
    node = torch.zeros(batch, dtype=torch.long, device=device)
    depth = torch.zeros_like(node)
    token = torch.full_like(node, -1)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    path = torch.full((batch, n), -1, dtype=torch.long, device=device)
    path[:, 0] = 0
    for _ in range(n):
        p = p_rows[rows, node]
        children = in_tree & (par == node.unsqueeze(-1)) & ~done.unsqueeze(-1)
        best = p.argmax(-1)
        match = children & (ids == best.unsqueeze(-1))
        nxt = torch.where(greedy & match.any(-1), match.int().argmax(-1), -1)
        # Sampling rows: the children in index order against the residual r (starts at p) and q (starts at the
        # node's draft row); a rejected point proposal leaves the residual, a rejected sample without
        # replacement makes r = norm(max(0, r - q)) and removes the token from q.
        r = p.clone()
        q = q_rows[rows, node].clone() if q_rows is not None else None
        stalled = torch.zeros_like(done)  # the residual summed to 0 (r == q): the token comes from p itself
        remaining = children & ~greedy.unsqueeze(-1)
        while remaining.any():
            has = remaining.any(-1)
            c = torch.where(has, remaining.int().argmax(-1), 0)
            remaining[rows, c] = False
            testing = has & (nxt < 0) & ~stalled
            x = ids[rows, c]
            rx = r[rows, x]
            if q is None:
                accept = testing & (u_node[rows, c] * r.sum(-1) < rx)
            else:
                qx = q[rows, x]
                accept = testing & (qx > 0) & (u_node[rows, c] * qx < rx)
            nxt = torch.where(accept, c, nxt)
            rejected = testing & ~accept
            if q is None:
                r[rows[rejected], x[rejected]] = 0.0
            else:
                residual = (r - q).clamp_min(0)
                total = residual.sum(-1, keepdim=True)
                stalled |= rejected & ~(total.squeeze(-1) > 0)
                r = torch.where(rejected.unsqueeze(-1), torch.where(total > 0, residual / total, residual), r)
                q[rows[rejected], x[rejected]] = 0.0
                q_total = q.sum(-1, keepdim=True)
                q = torch.where(rejected.unsqueeze(-1), torch.where(q_total > 0, q / q_total, 0.0), q)
        moving = ~done & (nxt >= 0)
        stopping = ~done & ~moving
        mass = torch.where((stalled | ~(r.sum(-1) > 0)).unsqueeze(-1), p, r)
        drawn = torch.where(greedy, best, _inverse_cdf(mass, u_resample))
        token = torch.where(stopping, drawn, token)
        node = torch.where(moving, nxt, node)
        depth = depth + moving.long()
        path[rows[moving], depth[moving]] = node[moving]
        done |= stopping
        if bool(done.all()):
            break
    path_tokens = ids.gather(1, path.clamp_min(0))[:, 1:]  # the tokens of the accepted nodes below the root
    out = torch.full((batch, n), -1, dtype=torch.int32, device=device)
    out[:, :n - 1] = torch.where(nodes[:n - 1] < depth.unsqueeze(-1), path_tokens, -1).int()
    out[rows, depth] = token.int()
    return out, path.int(), depth.int()


def _pad_flat_trees(cu_num_draft_tokens, max_draft_tokens, parents, candidate_token_ids, target_rows, draft_rows,
                    uniforms):
    """Flat trees (request b's k_b + 1 nodes from cu[b-1] + b) as padded [B, N] trees, N = max_draft_tokens + 1:
    (parents,
    candidate_token_ids, target rows, draft rows, uniforms, num_nodes). The pad is a valid filler, never read."""
    cu = [0] + cu_num_draft_tokens.long().tolist()
    batch, n = len(cu) - 1, max_draft_tokens + 1
    if any(not 0 <= cu[b] <= cu[b + 1] <= parents.shape[0] - batch or cu[b + 1] - cu[b] >= n for b in range(batch)):
        raise ValueError("cu_num_draft_tokens must be non-decreasing in [0, T] with steps of at most max_draft_tokens")

    def pad(flat, fill):
        if flat is None:
            return None
        out = flat.new_full((batch, n, *flat.shape[1:]), fill)
        for b in range(batch):
            out[b, :cu[b + 1] - cu[b] + 1] = flat[cu[b] + b:cu[b + 1] + b + 1]
        return out

    num_nodes = torch.tensor([cu[b + 1] - cu[b] + 1 for b in range(batch)], dtype=torch.int32)
    return (pad(parents, -1), pad(candidate_token_ids, 0), pad(target_rows, 1.0), pad(draft_rows, 1.0),
            pad(uniforms, 0.5), num_nodes)


def tree_speculative_sampling(parents, candidate_token_ids, target_probs, draft_probs=None, *, num_nodes=None,
                              greedy=None, seed, offset=None, uniforms=None, final_uniforms=None, draft_to_target=None,
                              cu_num_draft_tokens=None, max_draft_tokens=None, coupling="rejection"):
    """Reference of specdec_ext.tree_speculative_sampling (seed required; flat trees are padded first). Returns
    (output_token_ids, accepted_nodes, num_accepted)."""
    if cu_num_draft_tokens is not None:
        parents, candidate_token_ids, target_probs, draft_probs, uniforms, num_nodes = _pad_flat_trees(
            cu_num_draft_tokens, max_draft_tokens, parents, candidate_token_ids, target_probs, draft_probs, uniforms)
    num_nodes, seed, offset = _defaults(parents, num_nodes, seed, offset)
    greedy = torch.as_tensor(False if greedy is None else greedy, device=parents.device).expand(parents.shape[0])
    draft_probs = _full_draft_rows(draft_probs, draft_to_target, target_probs.shape[-1], logits=False)
    q_rows = None if draft_probs is None else draft_probs.double()
    p_rows = target_probs.double()
    if coupling == "gumbel":
        p_rows = _gumbel_rows(p_rows.log(), greedy, seed, offset, _node_depths(parents, num_nodes))
        greedy = torch.ones_like(greedy)
    return _tree_reference(parents, candidate_token_ids, num_nodes, p_rows, q_rows, greedy, seed, offset,
                           _EngineLayout(uniforms, final_uniforms))


def tree_speculative_sampling_from_logits(parents, candidate_token_ids, target_logits, draft_logits=None, *,
                                          temperature, num_nodes=None, seed, offset=None, uniforms=None,
                                          final_uniforms=None, draft_to_target=None, cu_num_draft_tokens=None,
                                          max_draft_tokens=None, coupling="rejection", top_k=None, top_p=None,
                                          min_p=None):
    """Reference of specdec_ext.tree_speculative_sampling_from_logits: softmax(logits / temperature) in float64;
    greedy below MIN_TEMPERATURE; top_k, top_p, min_p by filter_logits."""
    if cu_num_draft_tokens is not None:
        parents, candidate_token_ids, target_logits, draft_logits, uniforms, num_nodes = _pad_flat_trees(
            cu_num_draft_tokens, max_draft_tokens, parents, candidate_token_ids, target_logits, draft_logits, uniforms)
    target_logits = filter_logits(target_logits, temperature, top_k, top_p, min_p)
    if draft_logits is not None:
        draft_logits = filter_logits(draft_logits, temperature, top_k, top_p, min_p)
    batch = parents.shape[0]
    num_nodes, seed, offset = _defaults(parents, num_nodes, seed, offset)
    t, greedy = _temperature(temperature, batch, parents.device)
    scale = torch.where(greedy, 1.0, 1.0 / t).view(-1, 1, 1)
    p_rows = torch.softmax(target_logits.double() * scale, -1)
    draft_logits = _full_draft_rows(draft_logits, draft_to_target, target_logits.shape[-1], logits=True)
    q_rows = None if draft_logits is None else torch.softmax(draft_logits.double() * scale, -1)
    if coupling == "gumbel":
        p_rows = _gumbel_rows(torch.log_softmax(target_logits.double() * scale, -1), greedy, seed, offset,
                              _node_depths(parents, num_nodes))
        greedy = torch.ones_like(greedy)
    return _tree_reference(parents, candidate_token_ids, num_nodes, p_rows, q_rows, greedy, seed, offset,
                           _EngineLayout(uniforms, final_uniforms))


# ---------------------------------------------------------------------------------------------------
def _request_pages(b, block_table, kv_indptr, kv_indices):
    """Request b's page ids in order (block table row, or its run of the CSR kv_indices), or None (contiguous)."""
    if kv_indptr is not None:
        return kv_indices[int(kv_indptr[b]):int(kv_indptr[b + 1])].long()
    return None if block_table is None else block_table[b].long()


def truncate_kv_cache(cache_seqlens, num_kept, *, block_len=None, kept_indices=None, k_caches=(), v_caches=(),
                      block_table=None, clear=False, kv_layout="NHD", kv_indptr=None, kv_indices=None) -> None:
    """Reference of specdec_ext.truncate_kv_cache: request by request, layer by layer, in place."""
    num_kept = torch.as_tensor(num_kept, device=cache_seqlens.device).expand(cache_seqlens.shape).tolist()
    if kept_indices is not None:
        block_len = kept_indices.shape[1]
    if kv_layout == "HND":  # NHD views: writes reach the caches
        k_caches, v_caches = [k.transpose(1, 2) for k in k_caches], [v.transpose(1, 2) for v in v_caches]
    layers = list(zip(k_caches, v_caches))
    for b, (base, n) in enumerate(zip(cache_seqlens.tolist(), num_kept)):
        pages = _request_pages(b, block_table, kv_indptr, kv_indices)

        def slot(pos):  # (tensor index of the row) for position pos of request b
            if pages is None:
                return (b, pos)
            page_size = k_caches[0].shape[1]
            return (int(pages[pos // page_size]), pos % page_size)

        for k, v in layers:
            for cache in (k, v):
                if kept_indices is not None:
                    rows = [cache[slot(base + int(i))].clone() for i in kept_indices[b, :n]]
                    for j, row in enumerate(rows):
                        cache[slot(base + j)] = row
                if clear:
                    for j in range(n, block_len):
                        cache[slot(base + j)] = 0
        cache_seqlens[b] += n


# ---------------------------------------------------------------------------------------------------
def _cache_index(cache_nhd, b, positions, pages):
    """Index of request b's rows at `positions` in an NHD view of the cache ([B, S, ...] or [P, page, ...])."""
    if pages is None:
        return b, positions
    page_size = cache_nhd.shape[1]
    return pages[positions // page_size], positions % page_size


def verify_attention(q, k_cache, v_cache, cache_seqlens=None, k_new=None, v_new=None, *, block_table=None,
                     tree_mask=None, softmax_scale=None, return_lse=False, qo_indptr=None, kv_layout="NHD",
                     kv_indptr=None, kv_indices=None, kv_last_page_len=None, window_left=-1, logits_soft_cap=0.0,
                     dtype=torch.float64):
    """Reference of specdec_ext.verify_attention, computed in `dtype` (float64 for tests), request by request.
    Writes k_new/v_new into the cache first, like the op. Query i of request b sits at position length_b + i and
    sees cache[0 : length_b] and new token j (at length_b + j) where tree_mask[i, j] (default causal, j <= i),
    only keys at positions >= length_b + i - window_left with a window; scores s = scale * q.k become
    logits_soft_cap * tanh(s / logits_soft_cap) with a cap. Layouts as the op's (padded or flat q, NHD or HND,
    contiguous, block table or CSR table with length_b = kv_len_b - Q_b)."""
    hnd = kv_layout == "HND"
    kc = k_cache.transpose(1, 2) if hnd else k_cache  # NHD views: writes reach the caches
    vc = v_cache.transpose(1, 2) if hnd else v_cache
    flat = qo_indptr is not None
    if flat:
        batch = qo_indptr.numel() - 1
        bounds = [(int(qo_indptr[b]), int(qo_indptr[b + 1])) for b in range(batch)]
    else:
        batch, n_q = q.shape[:2]
        bounds = [(b * n_q, (b + 1) * n_q) for b in range(batch)]
    hq, d = q.shape[-2:]
    hkv = kc.shape[-2]
    q_rows = q.reshape(-1, hq, d)
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    out = torch.zeros(q_rows.shape, dtype=dtype, device=q.device)
    lse = torch.full(q_rows.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    k_rows = None if k_new is None else k_new.reshape(-1, hkv, d)
    v_rows = None if v_new is None else v_new.reshape(-1, hkv, d)
    mask_offset = 0
    for b, (r0, r1) in enumerate(bounds):
        n_q = r1 - r0
        pages = _request_pages(b, block_table, kv_indptr, kv_indices)
        if kv_indptr is not None:
            kv_len = 0 if len(pages) == 0 else (len(pages) - 1) * kc.shape[1] + int(kv_last_page_len[b])
            length = kv_len - n_q
        else:
            length = int(cache_seqlens[b])
        if tree_mask is None:
            mask = torch.ones(n_q, n_q, dtype=torch.bool, device=q.device).tril()
        elif flat:
            mask = tree_mask[mask_offset:mask_offset + n_q * n_q].reshape(n_q, n_q)
        else:
            mask = tree_mask if tree_mask.dim() == 2 else tree_mask[b]
        mask_offset += n_q * n_q
        if n_q == 0:
            continue
        new_pos = torch.arange(length, length + n_q, device=q.device)
        if k_rows is not None:
            kc[_cache_index(kc, b, new_pos, pages)] = k_rows[r0:r1]
            vc[_cache_index(vc, b, new_pos, pages)] = v_rows[r0:r1]
        positions = torch.arange(length + n_q, device=q.device)
        keys = kc[_cache_index(kc, b, positions, pages)].to(dtype).repeat_interleave(hq // hkv, dim=1)
        values = vc[_cache_index(vc, b, positions, pages)].to(dtype).repeat_interleave(hq // hkv, dim=1)
        visible = torch.cat([torch.ones(n_q, length, dtype=torch.bool, device=q.device), mask.bool()], dim=1)  # [Q, S]
        if window_left >= 0:
            query_pos = torch.arange(length, length + n_q, device=q.device).unsqueeze(1)
            visible &= positions.unsqueeze(0) >= query_pos - window_left
        scores = torch.einsum("qhd,shd->hqs", q_rows[r0:r1].to(dtype), keys) * scale
        if logits_soft_cap > 0:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        scores = scores.masked_fill(~visible.unsqueeze(0), float("-inf"))
        row_lse = torch.logsumexp(scores, -1)  # [H, Q]
        probs = torch.where(visible.any(-1).unsqueeze(0).unsqueeze(-1), torch.softmax(scores, -1), 0.0)
        out[r0:r1] = torch.einsum("hqs,shd->qhd", probs, values)
        lse[r0:r1] = row_lse.transpose(0, 1).float()
    out, lse = out.reshape(q.shape), lse.reshape(q.shape[:-1])
    return (out, lse) if return_lse else out
