"""The vLLM Model Runner V2 shim (specdec_ext.compat.vllm_v2): rejection_sample in vLLM 0.34's layout (logits rows of
request b at cu_num_logits[b]..cu_num_logits[b + 1], draft_sampled the input token of each row, per-request-state
temperature / seed / draft logits through idx_mapping): greedy, ragged and placeholder cases against an argmax computed
here; the exact law of (accepted count, first token) and of the emitted sequence, in token and block verification,
computed here in float64; seeds by request state (a request's tokens whatever its batch and slot); the draft logits'
two forms (0.34's DraftLogitsCache, 0.28-0.33's tensor) and row_mapping; vocabulary padding; refusals; and
patch_model_runner_v2 / register() against stand-in vllm module trees with 0.34's, 0.28's and an unknown signature.
The small cases run on the CPU kernel and on the CUDA kernel's source under the emulator (checked equal to the CPU
kernel on the same draws); the law cases on the CPU kernel."""
import copy
import functools
import inspect
import logging
import sys
import types

import pytest
import torch

from helpers.chi_square import assert_law, rows_chi_square_pvalue
from helpers.compat_backends import on
from helpers.compat_vllm import dirichlet_rows
from specdec_ext.compat import vllm as vllm_shim
from specdec_ext.compat import vllm_v2

# "native": specdec_ext's own kernels, chosen by the tensors' device (the CPU kernel here); "sim": the CUDA kernel's
# source under the emulator.
BACKENDS = ["native", "sim"]
P = vllm_v2.PLACEHOLDER_TOKEN_ID
V2 = "vllm.v1.worker.gpu.spec_decode"


class DraftLogitsCache:
    """vLLM 0.34's per-request-state draft logits, as the shim reads them: values [rows, K, Vd] (pre-temperature) and
    row_mapping [max_num_reqs] (None: the request state's own row)."""

    def __init__(self, values, row_mapping=None):
        self.values, self.row_mapping = values, row_mapping


def layout(drafts):
    """V2's layout of requests with these drafts (a list of per-request lists, -1 a placeholder, or an [n, k] tensor):
    (draft_sampled [num_logits] int64, cu_num_logits [num_reqs + 1] int32, counts [num_reqs]). Row cu[b] + i holds
    draft i's input token: the last emitted token (100 + b here: outside the small vocabularies, never a draft), then
    the drafts; the bonus row's input is the last draft."""
    if isinstance(drafts, torch.Tensor):
        n, k = drafts.shape
        sampled = torch.cat([100 + torch.arange(n).unsqueeze(1), drafts.long()], 1).reshape(-1)
        counts = torch.full((n,), k, dtype=torch.int64)
    else:
        sampled = torch.tensor([t for b, ds in enumerate(drafts) for t in [100 + b, *ds]], dtype=torch.int64)
        counts = torch.tensor([len(ds) for ds in drafts], dtype=torch.int64)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), (counts + 1).cumsum(0)]).to(torch.int32)
    return sampled, cu, counts


def call(target_logits, drafts, *, temperature, seed=None, pos0=None, idx_mapping=None, cache=None, k=None,
         **kwargs):
    """rejection_sample on requests with these drafts. temperature and seed by request state (a float: every state's
    temperature; seed None: state s has seed 7919 s + 7), idx_mapping the state of each request (default b), pos0 the
    position of each request's first row (default 100 b + 3), k num_speculative_steps (default the most drafts)."""
    draft_sampled, cu, counts = layout(drafts)
    batch, num_logits = counts.numel(), draft_sampled.numel()
    assert target_logits.shape[0] == num_logits
    idx = torch.arange(batch) if idx_mapping is None else torch.as_tensor(idx_mapping, dtype=torch.int64)
    temperature = torch.as_tensor(temperature, dtype=torch.float32)
    states = max(int(idx.max()) + 1 if batch else 1, temperature.numel())
    temperature = temperature.expand(states).contiguous() if temperature.dim() == 0 else temperature
    seed = torch.arange(states, dtype=torch.int64) * 7919 + 7 if seed is None else \
        torch.as_tensor(seed, dtype=torch.int64)
    first = torch.arange(batch) * 100 + 3 if pos0 is None else torch.as_tensor(pos0, dtype=torch.int64)
    rows = counts + 1
    local = torch.arange(num_logits) - torch.repeat_interleave(cu[:-1].long(), rows, output_size=num_logits)
    pos = torch.repeat_interleave(first, rows, output_size=num_logits) + local
    expanded = torch.repeat_interleave(idx, rows, output_size=num_logits)
    k = int(counts.max()) if k is None and batch else k or 0
    return vllm_v2.rejection_sample(target_logits, cache, draft_sampled, cu, pos, idx, expanded, local, temperature,
                                    seed, k, **kwargs)


def poisoned_logits(rows, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3 + 1.5


def assert_well_formed(sampled, num_sampled, batch, k, vocab):
    """vLLM's output form: [B, k + 1] int64 and [B] int32, num_sampled >= 1 tokens in range, then -1."""
    assert sampled.dtype == torch.int64 and num_sampled.dtype == torch.int32
    assert sampled.shape == (batch, k + 1) and num_sampled.shape == (batch,)
    filled = torch.arange(k + 1) < num_sampled.long().unsqueeze(1)
    assert (num_sampled >= 1).all()
    assert ((sampled >= 0) & (sampled < vocab))[filled].all() and (sampled[~filled] == P).all()


# ----------------------------------------------------------------------------------------------- greedy, layout

def expected_greedy(logits, drafts):
    """Accept while the draft is the target row's argmax (a placeholder never is); then that row's argmax (the bonus
    row's after all drafts)."""
    argmax = logits.argmax(-1).tolist()
    out, row = [], 0
    for ds in drafts:
        tokens = []
        for i, d in enumerate(ds):
            if d < 0 or d != argmax[row + i]:
                break
            tokens.append(d)
        tokens.append(argmax[row + len(tokens)])
        out.append(tokens)
        row += len(ds) + 1
    return out


def greedy_batch():
    """Ragged drafts (0 to 4, one request without drafts), placeholders, drafts equal to the target's argmax up to a
    chosen count and then not, and sampled requests (temperature 0.8) between the greedy ones. Request states are a
    permutation of the requests (temperature looked up through idx_mapping). The placeholder request's row at its
    first placeholder has argmax 0, the id a placeholder is clamped to: a shim that verified the clamped id would
    accept it. Returns (logits, drafts, idx_mapping, temperature by state, greedy request indices)."""
    vocab = 40
    drafts = [[0, 0, 0, 0], [0, 0], [], [9, 9, 9], [0, 0, 0], [0, P, P], [0, 0, 0, 0], [5], [0, 0, 0, 0]]
    greedy = [0, 1, 2, 4, 5, 6, 8]
    accept = {0: 4, 1: 1, 2: 0, 4: 3, 5: 1, 6: 2, 8: 0}  # drafts equal to the argmax, then one that differs
    rows = sum(len(d) + 1 for d in drafts)
    logits = poisoned_logits(rows, vocab, seed=3)
    row = 0
    for b, ds in enumerate(drafts):
        if b == 5:
            logits[row + 1, 0] = logits[row + 1].max() + 1.0
        argmax = logits.argmax(-1).tolist()
        if b in accept:
            for i in range(len(ds)):
                if ds[i] >= 0:
                    ds[i] = argmax[row + i] if i < accept[b] else (argmax[row + i] + 1) % vocab
        row += len(ds) + 1
    idx_mapping = [5, 7, 8, 0, 2, 1, 6, 4, 3]  # a sampled request in the state of a greedy one with drafts
    temperature = [0.0] * len(drafts)
    for b in range(len(drafts)):
        if b not in greedy:
            temperature[idx_mapping[b]] = 0.8
    return logits, drafts, idx_mapping, temperature, greedy


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block", [False, True], ids=["token", "block"])
def test_greedy_requests_accept_the_targets_argmax_prefix(backend, block):
    """Every greedy request's tokens are computed here from the target's argmax (block verification verifies greedy
    requests token by token, as vLLM does); the sampled requests beside them only have the output's form. The draft
    rows of the greedy requests' states are NaN: never read."""
    logits, drafts, idx_mapping, temperature, greedy = greedy_batch()
    cache = poisoned_logits(len(drafts) * 4, logits.shape[1], seed=6).view(len(drafts), 4, -1)
    cache[[idx_mapping[b] for b in greedy]] = float("nan")
    with on(backend):
        sampled, num_sampled = call(logits, drafts, temperature=temperature, idx_mapping=idx_mapping,
                                    cache=DraftLogitsCache(cache), use_block_verification=block)
    want = expected_greedy(logits, drafts)
    assert_well_formed(sampled, num_sampled, len(drafts), 4, logits.shape[1])
    assert [len(want[b]) for b in greedy] == [5, 2, 1, 4, 2, 3, 1]
    for b in greedy:
        assert num_sampled[b] == len(want[b]) and sampled[b].tolist() == want[b] + [P] * (5 - len(want[b])), b


def test_a_temperature_below_the_sampling_eps_is_greedy():
    """The docstring: "A temperature of exactly 0 is greedy in vLLM; here any temperature below 1e-5 is". Requests at
    temperature 5e-6 and 1e-7 (and 0, and vLLM's older -1) whose first draft is not the target's argmax: greedy
    verification rejects it and emits the argmax, whatever the seed."""
    vocab, n = 40, 32
    logits = poisoned_logits(3 * n, vocab, seed=4)
    argmax = logits.argmax(-1).view(n, 3)
    drafts = torch.stack([(argmax[:, 0] + 1) % vocab, argmax[:, 1]], 1)
    for temperature in (0.0, -1.0, 1e-7, 5e-6):
        sampled, num_sampled = call(logits, drafts, temperature=temperature)
        assert num_sampled.tolist() == [1] * n, temperature
        assert torch.equal(sampled[:, 0], argmax[:, 0]), temperature


def test_an_empty_batch():
    sampled, num_sampled = vllm_v2.rejection_sample(
        torch.randn(0, 16), None, torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int32),
        *[torch.zeros(0, dtype=torch.int64)] * 4, torch.ones(3), torch.ones(3, dtype=torch.int64), 3)
    assert sampled.shape == (0, 4) and num_sampled.shape == (0,)
    assert sampled.dtype == torch.int64 and num_sampled.dtype == torch.int32


# -------------------------------------------------------------------------------------------------------- law

VOCAB, TEMPERATURE = 6, 0.5
N = 120_000  # requests per law case (the power is stated in test_emitted_tokens_follow_the_target)


def markov_requests(n, seed):
    """n requests of k = 2 drafts, x0 ~ q0 and x1 ~ q1[x0] (Dirichlet(2) rows over VOCAB tokens); target rows p0,
    p1[x0], p2[x1] as processed logits (log p: vLLM's logits after its temperature) and the draft rows as vLLM stores
    them, pre-temperature: TEMPERATURE * log q, which the shim must divide by the request's temperature to get q back.
    Returns (target_logits [3n, V], draft [n, 2, V], drafts [n, 2], (p0, q0, p1, q1))."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        p0, q0, p1, q1, p2 = (normalised(dirichlet_rows(VOCAB, *shape)) for shape in ((), (), (VOCAB,), (VOCAB,),
                                                                                    (VOCAB,)))
        x0 = torch.multinomial(q0, n, replacement=True)
        x1 = torch.multinomial(q1[x0], 1).squeeze(-1)
    target = torch.stack([p0.expand(n, VOCAB), p1[x0], p2[x1]], 1).log().float()
    draft = (torch.stack([q0.expand(n, VOCAB), q1[x0]], 1).log() * TEMPERATURE).float()
    return target.reshape(3 * n, VOCAB), draft, torch.stack([x0, x1], 1), (p0, q0, p1, q1)


def normalised(rows):
    rows = rows.double()
    return rows / rows.sum(-1, keepdim=True)


@functools.lru_cache(maxsize=None)
def markov_run(form, block):
    """The N requests of markov_requests (fixed seed; each request its own seed slot and position, so its draws are
    independent of the others') through the shim: (sampled, num_sampled, drafts, laws)."""
    target, draft, drafts, laws = markov_requests(N, seed=1234)
    cache = {"cache": DraftLogitsCache(draft), "tensor": draft, "point": None}[form]
    sampled, num_sampled = call(target, drafts, temperature=TEMPERATURE, cache=cache, use_block_verification=block)
    return sampled, num_sampled, drafts, laws


def first_token_law(laws, point, block):
    """P(accepted = a, first token = v) [3, V], in float64, written out from the rules: the drafts x0 ~ q0, x1 ~
    q1[x0]; judged against q (or the point mass at the draft: no draft logits). Token-wise: x_i accepted w.p.
    min(1, p_i(x_i) / q_i(x_i)) while the previous ones were; a rejection at 0 emits from norm(max(p0 - q0, 0)).
    Block (Sun et al., arXiv 2403.10444): c_1 = min(1, p0(x0) / q0(x0)), c_2 = min(1, c_1 p1(x1) / q1(x1)); h_1 =
    R / (R + 1 - c_1), R = sum max(c_1 p1 - q1, 0); h_2 = c_2; tau = the largest i with u_i < h_i (0 if none), i.e.
    P(tau = 2) = h_2, P(tau = 1) = h_1 (1 - h_2); tau = 0 emits from norm(max(p0 - q0, 0)) as token-wise does."""
    p0, q0, p1, q1 = laws
    eye = torch.eye(VOCAB, dtype=torch.float64)
    law = torch.zeros(3, VOCAB, dtype=torch.float64)
    for x0 in range(VOCAB):
        for x1 in range(VOCAB):
            weight = q0[x0] * q1[x0, x1]
            e0, e1 = (eye[x0], eye[x1]) if point else (q0, q1[x0])
            c1 = min(1.0, float(p0[x0] / e0[x0]))
            if block:
                c2 = min(1.0, c1 * float(p1[x0, x1] / e1[x1]))
                residual = float((c1 * p1[x0] - e1).clamp_min(0).sum())
                h1 = residual / (residual + 1 - c1) if residual + 1 - c1 > 0 else 1.0
                at = [(1 - h1) * (1 - c2), h1 * (1 - c2), c2]
            else:
                a1 = min(1.0, float(p1[x0, x1] / e1[x1]))
                at = [1 - c1, c1 * (1 - a1), c1 * a1]
            recovered = (p0 - e0).clamp_min(0)
            law[0] += weight * at[0] * recovered / recovered.sum()
            law[1, x0] += weight * at[1]
            law[2, x0] += weight * at[2]
    assert abs(float(law.sum()) - 1) < 1e-12
    return law


@pytest.mark.parametrize("block", [False, True], ids=["token", "block"])
@pytest.mark.parametrize("form", ["cache", "point"])
def test_emitted_tokens_follow_the_target(form, block):
    """120,000 requests (each its own seed slot and position), V = 6, temperature 0.5 (the draft logits stored at
    it, the target's processed). (1) The joint law of (accepted count, first token), 18 cells, written out by
    first_token_law: assert_law checks its power against moving 1% of probability between the two likeliest cells
    (>= 0.9 at the 1e-3 level; here ~1: noncentrality >= 120 at <= 17 dof), and that no sample falls in a cell of
    probability 0 (a recovered token where q0 >= p0). It fails a
    shim that reads the draft logits at the wrong temperature (q^2 here), from another request's state or step, or
    verifies point proposals against q. (2) The emitted sequence: its second token, completed where only one token
    was emitted by a draw from the target p1[y0] (what the next step would emit), follows p1[y0] row by row (36
    cells; a 1% shift between the two likeliest tokens of every row has noncentrality 96 at 30 dof: power 0.999 at
    the 1e-4 level). For
    block verification only the sequence's law is lossless, not the second token's given that the first draft was
    accepted: hence the completion."""
    sampled, num_sampled, drafts, laws = markov_run(form, block)
    assert_well_formed(sampled, num_sampled, N, 2, VOCAB)
    accepted = num_sampled.long() - 1
    first = sampled[:, 0]
    assert (first[accepted >= 1] == drafts[accepted >= 1, 0]).all() and (sampled[accepted == 2, 1] ==
                                                                         drafts[accepted == 2, 1]).all()
    law = first_token_law(laws, form == "point", block)
    cells = torch.bincount(accepted * VOCAB + first, minlength=3 * VOCAB).tolist()
    assert_law({(a, v): cells[a * VOCAB + v] for a in range(3) for v in range(VOCAB)},
                {(a, v): float(law[a, v]) for a in range(3) for v in range(VOCAB)})
    _, _, p1, _ = laws
    g = torch.Generator().manual_seed(77)
    completion = torch.multinomial(p1[first], 1, generator=g).squeeze(-1)
    second = torch.where(num_sampled >= 2, sampled[:, 1], completion)
    pairs = torch.bincount(first * VOCAB + second, minlength=VOCAB * VOCAB).view(VOCAB, VOCAB)
    assert rows_chi_square_pvalue(pairs, p1) > 1e-4


def test_the_tensor_form_gives_the_cache_forms_tokens_on_the_law_case():
    """vLLM 0.28-0.33's draft_logits tensor on the 120,000 requests of the law case (token verification): the very
    tokens of the DraftLogitsCache form, whose law test_emitted_tokens_follow_the_target checks, so the tensor form
    follows the same law."""
    sampled, num_sampled, _, _ = markov_run("tensor", False)
    want_sampled, want_num, _, _ = markov_run("cache", False)
    assert torch.equal(sampled, want_sampled) and torch.equal(num_sampled, want_num)


def test_block_verification_accepts_more_than_token_wise():
    """The mean accepted count of the same 120,000 requests (draft logits) under both verifications, against its
    closed form (first_token_law: 1.097 token-wise, 1.164 block-wise here): each within 4.5 standard errors (0.0025
    and 0.0026) of its own, and the block mean above the token-wise one. A block verification that fell back to
    token-wise acceptance fails the first check by ~26 standard errors."""
    means = {}
    for block in (False, True):
        sampled, num_sampled, _, laws = markov_run("cache", block)
        accepted = num_sampled.double() - 1
        expected = float((first_token_law(laws, False, block).sum(-1) * torch.arange(3.0, dtype=torch.float64))
                         .sum())
        error = float(accepted.std()) / N ** 0.5
        assert abs(float(accepted.mean()) - expected) < 4.5 * error, (block, float(accepted.mean()), expected)
        means[block] = (float(accepted.mean()), expected)
    assert means[True][1] > means[False][1] + 0.02, means  # the case is one where block verification gains
    assert means[True][0] > means[False][0], means


@pytest.mark.parametrize("block", [False, True], ids=["token", "block"])
def test_a_sampled_request_stops_at_its_placeholder_and_draws_from_that_row(block):
    """Sampled requests with drafts [x, -1] where the target's row 0 is one-hot at x (always accepted): the second
    token comes from the target's row 1, whose law is p (not a residual), and nothing after it, in either
    verification (block verification over the one draft before the placeholder). 40,000 requests, V = 6: assert_law's
    power against a 1% shift between the two likeliest tokens is 0.97 at the 1e-3 level."""
    n = 40_000
    p = torch.tensor([0.1, 0.15, 0.2, 0.25, 0.12, 0.18], dtype=torch.float64)
    row0 = torch.full((VOCAB,), float("-inf"))
    row0[2] = 0.0
    target = torch.stack([row0, p.log().float(), poisoned_logits(1, VOCAB)[0]]).repeat(n, 1)
    drafts = torch.tensor([[2, P]]).expand(n, 2)
    for cache in (None, DraftLogitsCache(poisoned_logits(2 * n, VOCAB, seed=7).view(n, 2, VOCAB))):
        sampled, num_sampled = call(target, drafts, temperature=0.9, cache=cache, use_block_verification=block)
        assert num_sampled.tolist() == [2] * n and (sampled[:, 0] == 2).all() and (sampled[:, 2] == P).all()
        counts = torch.bincount(sampled[:, 1], minlength=VOCAB).tolist()
        assert_law(dict(enumerate(counts)), dict(enumerate(p.tolist())))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block", [False, True], ids=["token", "block"])
def test_what_vllms_sampler_masked_is_never_emitted(backend, block):
    """V2 applies the generation controls (penalties, bad words, allowed tokens, min_tokens, logit bias, with the
    drafts in each row's history) in its sampler before rejection_sample: a token the processed logits hold at -inf
    is masked at that position. Every draft here is such a token at its own row, while the draft logits put almost
    all their mass on it: each draft is rejected, and the token emitted at its row is one the row allows; greedy
    requests (temperature 0) too. 64 requests of 3 drafts, V = 16, fixed seeds."""
    n, k, vocab = 64, 3, 16
    gen = torch.Generator().manual_seed(21)
    drafts = torch.randint(0, vocab, (n, k), generator=gen)
    target = (torch.randn(n, k + 1, vocab, generator=gen) * 2 + 0.5)
    banned = torch.zeros(n, k + 1, vocab, dtype=torch.bool)
    banned[:, :k].scatter_(2, drafts.unsqueeze(-1), True)  # each draft at its own row
    banned |= torch.rand(n, k + 1, vocab, generator=gen) < 0.3  # and other tokens, as bad words / masks ban them
    banned[..., vocab - 1] = False  # every row keeps a token
    target = target.masked_fill(banned, float("-inf")).view(-1, vocab)
    peaked = torch.full((n, k, vocab), -5.0).scatter_(2, drafts.unsqueeze(-1), 20.0)
    temperature = torch.where(torch.arange(n) % 4 == 0, 0.0, 1.0)
    with on(backend):
        sampled, num_sampled = call(target, drafts, temperature=temperature, cache=DraftLogitsCache(peaked),
                                    use_block_verification=block)
    assert_well_formed(sampled, num_sampled, n, k, vocab)
    assert num_sampled.tolist() == [1] * n, "every draft is masked at its row: none accepted"
    first = sampled[:, 0]
    assert not banned[torch.arange(n), 0, first].any(), "the token emitted at row 0 is one the row allows"
    greedy = torch.arange(n) % 4 == 0
    rows = target.view(n, k + 1, vocab)[:, 0]
    assert torch.equal(first[greedy], rows[greedy].argmax(-1))


# ------------------------------------------------------------------------------------- seeds, request states

class Request:
    """One request of test_a_request_gets_its_tokens_whatever_its_batch_and_state_slot: its drafts, target rows,
    temperature, seed, first position and draft rows [3, V] (pre-temperature)."""

    def __init__(self, drafts, temperature, seed, pos0, vocab, gen):
        self.drafts, self.temperature, self.seed, self.pos0 = drafts, temperature, seed, pos0
        self.target = torch.randn(len(drafts) + 1, vocab, generator=gen) * 0.3
        # Draft rows near the target's (acceptances and rejections both likely), stored at the request's temperature.
        near = self.target[:3] if len(drafts) >= 3 else torch.randn(3, vocab, generator=gen) * 0.3
        self.draft = (near + 0.3 * torch.randn(3, vocab, generator=gen)) * max(temperature, 1.0)

    def but(self, **changes):
        other = copy.copy(self)
        other.__dict__.update(changes)
        return other


def batch_call(requests, slots, states, backend="native", block=False):
    """The requests in this order, request i in state slot slots[i] of tables of `states` states (the other slots
    poisoned: NaN temperature and draft rows), the cache's rows in another order still (row_mapping). Returns each
    request's (tokens, num_sampled)."""
    temperature = torch.full((states,), float("nan"))
    seed = torch.full((states,), -12345, dtype=torch.int64)
    values = torch.full((states + 1, 3, requests[0].target.shape[1]), float("nan"))
    row_mapping = (torch.arange(states) * 5 + 2) % (states + 1)  # state s -> a row, not s
    for r, s in zip(requests, slots):
        temperature[s], seed[s], values[row_mapping[s]] = r.temperature, r.seed, r.draft
    with on(backend):
        sampled, num_sampled = call(torch.cat([r.target for r in requests]), [r.drafts for r in requests],
                                    temperature=temperature, seed=seed, pos0=[r.pos0 for r in requests],
                                    idx_mapping=slots, cache=DraftLogitsCache(values, row_mapping), k=3,
                                    use_block_verification=block)
    return [(sampled[i].tolist(), int(num_sampled[i])) for i in range(len(requests))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block", [False, True], ids=["token", "block"])
def test_a_request_gets_its_tokens_whatever_its_batch_and_state_slot(backend, block):
    """Six requests (ragged, one without drafts, one greedy, one with a placeholder), V = 500: each alone in a batch,
    all together in two orders and slot assignments, and together with four other requests: every request gets the
    same tokens each time (its randomness is its state's seed and its first row's position), and the same twice.
    Another seed or first position gives another output for some request."""
    gen = torch.Generator().manual_seed(8)
    vocab = 500
    def drafts(n):
        return torch.randint(0, vocab, (n,), generator=gen).tolist()
    requests = [Request(drafts(3), 0.8, 11, 40, vocab, gen), Request([], 1.0, 12, 7, vocab, gen),
                Request(drafts(2), 0.0, 13, 90, vocab, gen), Request(drafts(3), 1.3, 14, 0, vocab, gen),
                Request(drafts(1) + [P, P], 0.6, 15, 5, vocab, gen), Request(drafts(3), 1.0, 16, 300, vocab, gen)]
    others = [Request(drafts(3), 0.9, 21 + i, 50, vocab, gen) for i in range(4)]
    alone = [batch_call([r], [i], 6, backend, block)[0] for i, r in enumerate(requests)]
    assert alone == [batch_call([r], [i], 6, backend, block)[0] for i, r in enumerate(requests)], "twice"
    assert batch_call(requests, [0, 1, 2, 3, 4, 5], 6, backend, block) == alone
    order, slots = [3, 5, 0, 4, 1, 2], [7, 0, 2, 9, 4, 1]
    assert batch_call([requests[i] for i in order], slots, 10, backend, block) == [alone[i] for i in order]
    mixed = [others[0], requests[2], others[1], requests[0], requests[5], others[2], requests[1], requests[4],
             others[3], requests[3]]
    got = batch_call(mixed, [9, 2, 8, 0, 5, 7, 1, 4, 6, 3], 10, backend, block)
    assert [got[mixed.index(r)] for r in requests] == alone
    want = expected_greedy(requests[2].target, [requests[2].drafts])[0]
    assert alone[2] == (want + [P] * (4 - len(want)), len(want)), "the greedy request"
    for change in ("seed", "pos0"):
        changed = [batch_call([r.but(**{change: getattr(r, change) + 1})], [i], 6, backend, block)[0]
                   for i, r in enumerate(requests)]
        assert changed != alone, f"the {change} must matter"


def test_draft_rows_are_read_through_row_mapping_and_the_tensor_form_equals_the_cache():
    """Eight sampled requests. The cache's row_mapping sends request state s to row row_mapping[s]: the same tokens as
    a cache whose rows are in state order; the rows no state maps to are NaN (never read). A row of -1 (a request
    whose drafts are all placeholders) is never read either. The tensor form (0.28-0.33) equals the cache with
    row_mapping None. The draft rows matter: other rows give other tokens."""
    vocab, k, n = 30, 3, 8
    gen = torch.Generator().manual_seed(21)
    logits = torch.randn(n * (k + 1), vocab, generator=gen)
    drafts = torch.randint(0, vocab, (n, k), generator=gen)
    by_state = logits.view(n, k + 1, vocab)[:, :k] + torch.randn(n, k, vocab, generator=gen)
    kw = dict(temperature=torch.linspace(0.5, 1.5, n), seed=torch.arange(n) + 1)
    want = call(logits, drafts, cache=DraftLogitsCache(by_state), **kw)
    assert all(torch.equal(a, b) for a, b in zip(call(logits, drafts, cache=by_state, **kw), want))
    rows = torch.full((n + 3, k, vocab), float("nan"))
    row_mapping = torch.randperm(n + 2, generator=gen)[:n] + 1  # row 0 never mapped: NaN
    rows[row_mapping] = by_state
    mapped = call(logits, drafts, cache=DraftLogitsCache(rows, row_mapping), **kw)
    assert all(torch.equal(a, b) for a, b in zip(mapped, want))
    assert not torch.equal(call(logits, drafts, cache=DraftLogitsCache(by_state.roll(1, 0)), **kw)[0], want[0])
    assert not torch.equal(call(logits, drafts, cache=None, **kw)[0], want[0])
    # Request 0's drafts all placeholders, its row_mapping -1: no row of its own (the NaN rows are not read).
    held = torch.where(torch.arange(n) == 0, -1, row_mapping)
    placeholders = drafts.clone()
    placeholders[0] = P
    got = call(logits, placeholders, cache=DraftLogitsCache(rows, held), **kw)
    assert got[1][0] == 1 and got[0][0, 1:].tolist() == [P] * k
    assert torch.equal(got[0][1:], want[0][1:]) and torch.equal(got[1][1:], want[1][1:])


def test_only_the_shared_vocabulary_is_used_when_the_two_differ():
    """vLLM's rule: verify over min(V, Vd). A target padded past the draft's vocabulary (the padded columns given the
    largest logits here) never emits them; a draft vocabulary wider than the target's gives the tokens of its first
    V columns."""
    vocab, draft_vocab = 24, 20
    logits = poisoned_logits(6, vocab, seed=31)
    logits[:, draft_vocab:] = 50.0
    drafts = [[1, 2], [3, 4]]
    narrow = poisoned_logits(4, draft_vocab, seed=33).view(2, 2, -1)
    for temperature in ([1.0, 0.7], [0.0, 0.0]):
        out, num = call(logits, drafts, temperature=temperature, cache=narrow)
        assert_well_formed(out, num, 2, 2, draft_vocab)
    wide = poisoned_logits(4, vocab + 8, seed=34).view(2, 2, -1)
    target = poisoned_logits(6, vocab, seed=32)
    got = call(target, drafts, temperature=[1.0, 0.7], cache=wide)
    want = call(target, drafts, temperature=[1.0, 0.7], cache=wide[..., :vocab].contiguous())
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_emulated_kernel_gives_the_cpu_kernels_tokens():
    """A mixed batch (ragged, greedy and sampled, placeholders, states permuted, draft logits in the cache form and
    none), token and block verification: the CUDA kernel's source under the emulator gives the CPU kernel's tokens."""
    logits, drafts, idx_mapping, temperature, _ = greedy_batch()
    temperature = [0.7 if t == 0 and s % 2 else t for s, t in enumerate(temperature)]
    cache = DraftLogitsCache(poisoned_logits(len(drafts) * 4, logits.shape[1], seed=9).view(len(drafts), 4, -1))
    for block in (False, True):
        for c in (cache, None):
            runs = []
            for backend in BACKENDS:
                with on(backend):
                    runs.append(call(logits, drafts, temperature=temperature, idx_mapping=idx_mapping, cache=c,
                                     use_block_verification=block))
            assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1]), (block, c)


# ------------------------------------------------------------------------------------------------- refusals

def good_args():
    """A valid call: two requests of 2 and 1 drafts, by position as vLLM passes them."""
    draft_sampled, cu, _ = layout([[1, 2], [3]])
    return [poisoned_logits(5, 8), None, draft_sampled, cu, torch.arange(5), torch.tensor([1, 0]),
            torch.tensor([1, 1, 1, 0, 0]), torch.tensor([0, 1, 2, 0, 1]), torch.ones(2), torch.arange(2), 2]


NAMES = ["target_logits", "draft_logits_cache", "draft_sampled", "cu_num_logits", "pos", "idx_mapping",
         "expanded_idx_mapping", "expanded_local_pos", "temperature", "seed", "num_speculative_steps"]
BAD = [
    ("target_logits", lambda a: a[0][0]),
    ("target_logits", lambda a: a[0].unsqueeze(0)),
    ("target_logits", lambda a: a[0][:1]),  # fewer rows than requests (and than the other row tensors)
    ("draft_logits_cache", lambda a: torch.randn(4, 8)),
    ("draft_logits_cache", lambda a: types.SimpleNamespace(values=None, row_mapping=None)),
    ("draft_logits_cache", lambda a: types.SimpleNamespace(values=torch.randn(2, 8), row_mapping=None)),
    ("draft_logits_cache", lambda a: torch.randn(2, 1, 8)),  # fewer draft steps than num_speculative_steps
    ("draft_sampled", lambda a: a[2][:4]),
    ("draft_sampled", lambda a: a[2].view(1, 5)),
    ("cu_num_logits", lambda a: a[3].view(1, 3)),
    ("cu_num_logits", lambda a: a[3][:0]),
    ("pos", lambda a: torch.arange(6)),
    ("idx_mapping", lambda a: torch.tensor([0, 1, 0])),
    ("idx_mapping", lambda a: torch.tensor([[0, 1]])),
    ("expanded_idx_mapping", lambda a: a[6][:4]),
    ("expanded_local_pos", lambda a: torch.zeros(6, dtype=torch.int64)),
    ("temperature", lambda a: torch.ones(2, 1)),
    ("seed", lambda a: 5),
    ("num_speculative_steps", lambda a: 2.0),
    ("num_speculative_steps", lambda a: True),
    ("num_speculative_steps", lambda a: -1),
    ("num_speculative_steps", lambda a: 129),
]


@pytest.mark.parametrize("name,corrupt", BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD)])
def test_bad_inputs_name_the_argument(name, corrupt):
    args = good_args()
    vllm_v2.rejection_sample(*args)  # the unmodified call is valid
    args[NAMES.index(name)] = corrupt(args)
    with pytest.raises(ValueError, match=name):
        vllm_v2.rejection_sample(*args)


@pytest.mark.parametrize("kwargs, match", [
    (dict(synthetic_conditional_rates=torch.ones(2)), "synthetic_conditional_rates"),
    (dict(fly_window_size=4), "fly_window_size"),
    (dict(watermark_key=3), "watermark"),
    (dict(contexts=torch.zeros(5, 1, dtype=torch.int64)), "watermark"),
    (dict(watermarking=torch.ones(2, dtype=torch.bool)), "watermark"),
    (dict(watermarking_skip_mask=torch.zeros(5, dtype=torch.bool)), "watermark"),
])
def test_lossy_modes_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        vllm_v2.rejection_sample(*good_args(), **kwargs)


def test_what_changes_nothing_here_is_accepted():
    """use_fp64, skip_masked_vocab_blocks and the fly method's other settings (with fly_window_size 0) leave the
    tokens as they are."""
    want = vllm_v2.rejection_sample(*good_args())
    got = vllm_v2.rejection_sample(*good_args(), use_fp64=True, skip_masked_vocab_blocks=True, fly_window_size=0,
                                   fly_entropy_threshold=0.9, fly_entropy_top_k=7)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_draft_logits_by_either_releases_name():
    """0.34 calls the second argument draft_logits_cache, 0.28-0.33 draft_logits (their tests pass it by name): both
    names reach the same input; both at once, or the name and a second positional, is a TypeError."""
    args = good_args()
    args[1] = torch.randn(2, 2, 8)  # [max_num_reqs, K, V] draft logits by request state
    kwargs = dict(zip(NAMES, args))
    want = vllm_v2.rejection_sample(*args)
    for name in ("draft_logits_cache", "draft_logits"):
        by_name = {**{k: v for k, v in kwargs.items() if k != "draft_logits_cache"}, name: args[1]}
        got = vllm_v2.rejection_sample(**by_name)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), name
    with pytest.raises(TypeError, match="twice"):
        vllm_v2.rejection_sample(**kwargs, draft_logits=args[1])
    with pytest.raises(TypeError, match="twice"):
        vllm_v2.rejection_sample(*args[:2], draft_logits=args[1])
    assert list(inspect.signature(vllm_v2.rejection_sample).parameters)[:len(NAMES)] == NAMES


# ------------------------------------------------------------------------- patching vLLM's module tree

def stand_in_tree(monkeypatch, signature: str):
    """A vllm package holding Model Runner V2's two modules and a module that imported RejectionSampler, with
    rejection_sample of vLLM 0.34's signature ("0.34"), of 0.28's ("0.28": draft_logits, no watermark or fly
    keywords, a constructor without watermark_key), or another ("other")."""
    for name in ("vllm", "vllm.v1", "vllm.v1.worker", "vllm.v1.worker.gpu", V2):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    utils, sampler = types.ModuleType(f"{V2}.rejection_sampler_utils"), types.ModuleType(f"{V2}.rejection_sampler")
    runner = types.ModuleType("vllm.v1.worker.gpu.model_runner")
    if signature == "0.34":
        def rejection_sample(target_logits, draft_logits_cache, draft_sampled, cu_num_logits, pos, idx_mapping,
                             expanded_idx_mapping, expanded_local_pos, temperature, seed, num_speculative_steps,
                             synthetic_conditional_rates=None, use_fp64=False, use_block_verification=False,
                             contexts=None, watermarking=None, watermarking_skip_mask=None, watermark_key=None,
                             fly_window_size=0, fly_entropy_threshold=0.3, fly_entropy_top_k=3,
                             skip_masked_vocab_blocks=False):
            raise AssertionError("vLLM's own function ran")
    elif signature == "0.28":
        def rejection_sample(target_logits, draft_logits, draft_sampled, cu_num_logits, pos, idx_mapping,
                             expanded_idx_mapping, expanded_local_pos, temperature, seed, num_speculative_steps,
                             synthetic_conditional_rates=None, use_fp64=False, use_block_verification=False):
            raise AssertionError("vLLM's own function ran")
    else:
        def rejection_sample(target_logits, draft_probs, cu_num_logits, temperature, seed):
            raise AssertionError("vLLM's own function ran")

    class RejectionSampler:
        def __init__(self, sampler, spec_config, device, **kwargs):
            if signature != "0.34" and kwargs:
                raise TypeError(f"unexpected {kwargs}")
            self.made = (sampler, spec_config, device, kwargs)

    utils.rejection_sample = sampler.rejection_sample = rejection_sample
    sampler.RejectionSampler = runner.RejectionSampler = RejectionSampler
    for module in (utils, sampler, runner):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    return utils, sampler, runner, RejectionSampler


V2_PATHS = sorted([f"{V2}.rejection_sampler_utils.rejection_sample", f"{V2}.rejection_sampler.rejection_sample",
                   f"{V2}.rejection_sampler.RejectionSampler", "vllm.v1.worker.gpu.model_runner.RejectionSampler"])


def spec(method):
    return types.SimpleNamespace(rejection_sample_method=method)


@pytest.mark.parametrize("signature", ["0.34", "0.28"])
def test_model_runner_v2_is_patched_and_its_sampler_refuses_lossy_methods(monkeypatch, signature):
    utils, sampler, runner, original = stand_in_tree(monkeypatch, signature)
    theirs = utils.rejection_sample
    patched = vllm_v2.patch_model_runner_v2()
    assert patched == V2_PATHS
    assert utils.rejection_sample is vllm_v2.rejection_sample is sampler.rejection_sample is not theirs
    ours = sampler.RejectionSampler
    assert ours is not original and issubclass(ours, original) and runner.RejectionSampler is ours
    assert vllm_v2.patch_model_runner_v2() == [] and sampler.RejectionSampler is ours, "idempotent"
    assert utils.rejection_sample is vllm_v2.rejection_sample
    for method in ("standard", "block"):
        made = ours("sampler", spec(method), "cpu").made
        assert made == ("sampler", spec(method), "cpu", {}), "built by vLLM's constructor, without watermark_key"
    assert ours("sampler", types.SimpleNamespace(), "cpu").made[0] == "sampler", "no method: vLLM's default"
    for method in ("synthetic", "fly"):
        with pytest.raises(ValueError, match=f"rejection_sample_method='{method}' is lossy"):
            ours("sampler", spec(method), "cpu")
    with pytest.raises(ValueError, match="watermark_key"):
        ours("sampler", spec("standard"), "cpu", watermark_key=5)


def test_an_unknown_signature_is_left_alone_with_a_warning(monkeypatch, caplog):
    utils, sampler, runner, original = stand_in_tree(monkeypatch, "other")
    theirs = utils.rejection_sample
    with caplog.at_level(logging.WARNING, logger="specdec_ext.compat.vllm"):
        assert vllm_v2.patch_model_runner_v2() == []
    assert utils.rejection_sample is theirs is sampler.rejection_sample
    assert sampler.RejectionSampler is original is runner.RejectionSampler
    assert "was not replaced" in caplog.text and "draft_probs" in caplog.text


def test_a_keyword_the_shim_does_not_know_leaves_vllm_alone(monkeypatch, caplog):
    """0.34's positional core, but a keyword this shim does not take (a call with it would fail here)."""
    utils, sampler, _, original = stand_in_tree(monkeypatch, "0.34")
    theirs = utils.rejection_sample

    def newer(target_logits, draft_logits_cache, draft_sampled, cu_num_logits, pos, idx_mapping, expanded_idx_mapping,
              expanded_local_pos, temperature, seed, num_speculative_steps, use_block_verification=False,
              typical_acceptance=None):
        raise AssertionError("vLLM's own function ran")

    utils.rejection_sample = newer
    with caplog.at_level(logging.WARNING, logger="specdec_ext.compat.vllm"):
        assert vllm_v2.patch_model_runner_v2() == []
    assert utils.rejection_sample is newer and sampler.rejection_sample is theirs
    assert sampler.RejectionSampler is original and "was not replaced" in caplog.text


def test_without_model_runner_v2_nothing_is_patched(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))  # a package without the V2 modules
    for name in list(sys.modules):
        if name.startswith("vllm."):
            monkeypatch.delitem(sys.modules, name)
    assert vllm_v2.patch_model_runner_v2() == []


def test_register_patches_model_runner_v2_and_says_so(monkeypatch, caplog):
    utils, sampler, runner, original = stand_in_tree(monkeypatch, "0.34")
    with caplog.at_level(logging.INFO, logger="specdec_ext.compat.vllm"):
        patched = vllm_shim.register()
    assert patched == V2_PATHS, "Model Runner V2's (the tree has no V1 sampler)"
    assert utils.rejection_sample is vllm_v2.rejection_sample and sampler.RejectionSampler is not original
    assert "Model Runner V2 verifies with specdec_ext's kernels" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="specdec_ext.compat.vllm"):
        assert vllm_shim.register() == [], "idempotent"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], "already registered: no warning"
