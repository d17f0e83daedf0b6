"""The vLLM shim (specdec_ext.compat.vllm): vLLM v1's rejection_sample cases, the law of the emitted tokens, seeded
requests, mixed greedy/random batches, RejectionSampler.forward's logits processing, parse_output, register() against
a stand-in vllm package and the plugin entry point, bad inputs. Every sampling case runs on the CPU kernel and on the
CUDA kernel's source under the emulator (smaller there, and checked equal to the CPU kernel on the same draws)."""
import ast
import contextlib
import importlib.metadata
import logging
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from scipy import stats

from specdec_ext.compat import emulated
from specdec_ext.compat import vllm as shim

# "native": specdec_ext's own kernels, chosen by the tensors' device (the CPU kernel here; tests/gpu runs the same
# tests with device="cuda"); "sim": the CUDA kernel's source under the emulator.
BACKENDS = ["native", "sim"]
P = shim.PLACEHOLDER_TOKEN_ID


def on(backend):
    return emulated() if backend == "sim" else contextlib.nullcontext()


def sampling_metadata(temperature=None, generators=None, top_k=None, top_p=None, device="cpu", **extra):
    """The fields of vLLM's SamplingMetadata the shim reads. temperature None: an all-greedy batch (vLLM then passes
    no temperature); otherwise greedy rows are marked by a temperature of 0 (or -1, older vLLM)."""
    t = None if temperature is None else torch.tensor(temperature, dtype=torch.float32, device=device)
    greedy = torch.ones(1, dtype=torch.bool) if t is None else t < 1e-5
    fields = dict(temperature=t, all_greedy=bool(greedy.all()), all_random=not bool(greedy.any()),
                  generators=generators or {}, top_k=top_k, top_p=top_p, max_num_logprobs=None, no_penalties=True,
                  bad_words_token_ids={}, allowed_token_ids_mask=None)
    fields.update(extra)
    return types.SimpleNamespace(**fields)


def flat(drafts, device="cpu"):
    """vLLM's flat form of per-request draft lists: (draft_token_ids [T] int32, num_draft_tokens, max_spec_len,
    cu_num_draft_tokens [B] int32)."""
    counts = [len(d) for d in drafts]
    ids = torch.tensor([t for d in drafts for t in d], dtype=torch.int32, device=device)
    cu = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    return ids, counts, max(counts, default=0), cu


def argmax_rows(tokens, vocab, device="cpu"):
    """Target rows [T, V] whose argmax is tokens[i], with mass on every other token too (so a wrong draft has p > 0)."""
    probs = torch.ones(len(tokens), vocab)
    probs[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] = 4.0
    return (probs / probs.sum(-1, keepdim=True)).to(device)


def bonus_ids(tokens, device="cpu"):
    return torch.tensor(tokens, dtype=torch.int32, device=device).view(-1, 1)


# vLLM's own rejection sampler test cases, written out by hand: (drafts per request, the target argmax at each draft
# position, the bonus tokens, the expected output). A greedy row emits the drafts while they equal the argmax, then
# the argmax at the first mismatch, or the bonus token after the last draft (no drafts: the bonus alone).
GREEDY_CASES = {
    "perfect_match": ([[11, 12, 13]], [11, 12, 13], [14], [[11, 12, 13, 14]]),
    "early_mismatch_first": ([[11, 12, 13]], [20, 12, 13], [14], [[20, P, P, P]]),
    "early_mismatch_middle": ([[11, 12, 13]], [11, 21, 13], [14], [[11, 21, P, P]]),
    "multiple_sequences": ([[11, 12], [13]], [11, 12, 13], [15, 16], [[11, 12, 15], [13, 16, P]]),
    "single_token_sequence": ([[11]], [11], [12], [[11, 12]]),
    "single_token_mismatch": ([[11]], [22], [12], [[22, P]]),
    "empty_sequence": ([[]], [], [15], [[15]]),
    "multiple_mismatches": ([[1, 2, 3], [4, 5, 6]], [1, 2, 7, 4, 8, 6], [9, 10], [[1, 2, 7, P], [4, 8, P, P]]),
    "ragged_with_empty_drafts": ([[1, 2], [], [3, 4, 5], []], [1, 2, 3, 9, 5], [6, 7, 8, 10],
                                 [[1, 2, 6, P], [7, P, P, P], [3, 9, P, P], [10, P, P, P]]),
}


def greedy_call(drafts, argmaxes, bonus, vocab=64, device="cpu", metadata=None):
    ids, counts, k, cu = flat(drafts, device)
    return shim.rejection_sample(ids, counts, k, cu, None, argmax_rows(argmaxes, vocab, device),
                                 bonus_ids(bonus, device), metadata or sampling_metadata())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(GREEDY_CASES))
def test_greedy_cases(backend, case, device="cpu"):
    drafts, argmaxes, bonus, expected = GREEDY_CASES[case]
    marks = [0.0 if b % 2 else -1.0 for b in range(len(drafts))]
    with on(backend):
        out = greedy_call(drafts, argmaxes, bonus, device=device)
        # The same batch marked greedy row by row (temperature 0, and vLLM's older -1) in a mixed-mode batch.
        marked = greedy_call(drafts, argmaxes, bonus, device=device, metadata=sampling_metadata(marks, device=device))
    assert out.dtype == torch.int32
    assert out.tolist() == expected
    assert marked.tolist() == expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_k32(backend, gen, device="cpu"):
    k, vocab = 32, 500
    drafts = torch.randint(0, vocab, (2, k), generator=gen).tolist()
    wrong = (drafts[1][31] + 1) % vocab
    argmaxes = drafts[0] + drafts[1][:31] + [wrong]
    with on(backend):
        out = greedy_call(drafts, argmaxes, [7, 8], vocab, device)
        # Sampled rows whose target is one-hot at each draft accept every draft whatever the uniforms.
        ids, counts, width, cu = flat(drafts, device)
        one_hot = torch.zeros(2 * k, vocab, device=device)
        one_hot[torch.arange(2 * k), ids.long()] = 1.0
        sampled = shim.rejection_sample(ids, counts, width, cu, None, one_hot, bonus_ids([7, 8], device),
                                        sampling_metadata([1.0, 0.5], device=device))
    assert out.tolist() == [drafts[0] + [7], drafts[1][:31] + [wrong, P]]
    assert sampled.tolist() == [drafts[0] + [7], drafts[1] + [8]]


def dirichlet(vocab, *shape):
    """Rows drawn from Dirichlet(2, ..., 2) with torch's default generator (the caller seeds it)."""
    return torch.distributions.Dirichlet(torch.full((vocab,), 2.0)).sample(shape)


def chi_square_pvalue(counts, probs):
    """One test over the rows of counts [R, V] against probs [R, V]: the sum of the rows' statistics, sum of (V - 1)
    degrees of freedom over the rows that have samples."""
    counts, probs = counts.double(), probs.double()
    n = counts.sum(-1, keepdim=True)
    used = n.squeeze(-1) > 0
    expected = n * probs
    assert (expected[used] >= 5).all(), "too few samples per cell for the chi-square approximation"
    stat = ((counts - expected) ** 2 / expected)[used].sum().item()
    return stats.chi2.sf(stat, int(used.sum()) * (probs.shape[-1] - 1))


def markov_batch(n, vocab, seed):
    """n requests of k = 2 drafts with prefix-dependent rows: p0, q0 at position 0; p1[x0], q1[x0] at position 1, where
    x0 is the first draft; bonus tokens drawn from p2[x1]. Returns the flat call's arguments, p0 and p1."""
    torch.manual_seed(seed)
    p0, q0 = dirichlet(vocab), dirichlet(vocab)
    p1, q1, p2 = (dirichlet(vocab, vocab) for _ in range(3))
    x0 = torch.multinomial(q0, n, replacement=True)
    x1 = torch.multinomial(q1[x0], 1).squeeze(-1)
    bonus = torch.multinomial(p2[x1], 1).int()
    ids = torch.stack([x0, x1], 1).reshape(-1).int()
    target = torch.stack([p0.expand(n, vocab), p1[x0]], 1).reshape(2 * n, vocab)
    draft = torch.stack([q0.expand(n, vocab), q1[x0]], 1).reshape(2 * n, vocab)
    cu = torch.arange(1, n + 1, dtype=torch.int32) * 2
    return (ids, [2] * n, 2, cu, draft, target, bonus), p0, p1


@pytest.mark.parametrize("backend,n", [("native", 200_000), ("sim", 500)])
@pytest.mark.parametrize("with_draft", [True, False], ids=["draft_probs", "point_proposals"])
def test_emitted_tokens_follow_the_target(backend, n, with_draft, device="cpu"):
    # Fixed seeds. Position 0 has n samples; with V = 6 and p ~ 1/6, moving 1% of probability between two tokens gives
    # a noncentrality of n * 2 * 0.01^2 / (1/6) = 0.0012 n = 240 at n = 200,000: power ~1 against the 1e-4 level
    # (critical value ~26 at 5 dof). Position 1, given an accepted first draft, is checked against p1[y0] row by row.
    # Under the emulator the same draws must give the CPU kernel's tokens bit for bit, so it inherits that power.
    vocab = 6
    (ids, counts, k, cu, draft, target, bonus), p0, p1 = markov_batch(n, vocab, seed=1234)
    on_device = [t.to(device) if isinstance(t, torch.Tensor) else t
                 for t in (ids, counts, k, cu, draft if with_draft else None, target, bonus)]
    meta = sampling_metadata([1.0] * n, device=device)
    torch.manual_seed(99)  # the unseeded requests' uniforms come from torch's default generator (every device's)
    with on(backend):
        out = shim.rejection_sample(*on_device, meta).cpu()
    if backend == "sim":
        torch.manual_seed(99)
        assert torch.equal(out, shim.rejection_sample(*on_device, meta))
        return
    y = out.long()
    assert ((y >= 0) & (y < vocab) | (y == P)).all() and (y[:, 0] >= 0).all()
    emitted = (y >= 0).sum(-1)  # accepted + 1
    assert (y[emitted == 3, 2] == bonus[emitted == 3, 0]).all(), "after every draft is accepted, the bonus token"
    assert ((emitted == 3) | (y[:, 2] == P)).all() and ((emitted >= 2) | (y[:, 1] == P)).all()
    assert chi_square_pvalue(torch.bincount(y[:, 0], minlength=vocab).unsqueeze(0), p0.unsqueeze(0)) > 1e-4
    reached = emitted >= 2  # y0 was the accepted first draft
    assert (y[reached, 0] == ids.view(n, 2)[reached, 0].long()).all()
    counts1 = torch.zeros(vocab, vocab)
    counts1.index_put_((y[reached, 0], y[reached, 1]), torch.ones(int(reached.sum())), accumulate=True)
    assert chi_square_pvalue(counts1, p1) > 1e-4
    assert 1000 < int((emitted == 3).sum()) < n - 1000, "the batch must mix acceptances and rejections"


def spread_batch(drafts, vocab, device="cpu"):
    """Target rows near uniform over V, point proposals: a draft is accepted with probability ~1/V, so a row's output
    is (almost surely) its recovered token at position 0, nearly uniform over the vocabulary."""
    ids, counts, k, cu = flat(drafts, device)
    gen = torch.Generator().manual_seed(5)
    target = torch.softmax(0.1 * torch.randn(ids.numel(), vocab, generator=gen), -1).to(device)
    return ids, counts, k, cu, None, target, bonus_ids(list(range(900, 900 + len(drafts))), device)


def seeded_call(args, seeds, global_seed, device="cpu", temperature=None):
    """The batch with generators for the requests in `seeds` (index -> seed) and torch's default generator reseeded."""
    generators = {b: torch.Generator(device=device).manual_seed(s) for b, s in seeds.items()}
    torch.manual_seed(global_seed)
    if device != "cpu":
        torch.cuda.manual_seed(global_seed)
    batch = len(args[1])
    meta = sampling_metadata(temperature or [1.0] * batch, generators, device=device)
    return shim.rejection_sample(*args, meta), generators


@pytest.mark.parametrize("backend", BACKENDS)
def test_deterministic_when_seeded(backend, device="cpu"):
    vocab = 1000
    drafts = [[1, 2, 3, 4], [5, 6, 7, 8], [], [9, 10, 11, 12], [13]]
    args = spread_batch(drafts, vocab, device)
    # Request 3 is greedy; 0, 2 and 4 are seeded; 1 is not.
    temperature = [1.0, 1.0, 1.0, 0.0, 0.7]
    with on(backend):
        a, gens = seeded_call(args, {0: 5, 2: 6, 4: 8}, 100, device, temperature)
        b, _ = seeded_call(args, {0: 5, 2: 6, 4: 8}, 200, device, temperature)
        c, _ = seeded_call(args, {0: 7, 2: 6, 4: 9}, 100, device, temperature)
        # Request 4 alone: its draft (flat index 12), its target row and its bonus token.
        ids, _, _, _, _, target, bonus = args
        alone_args = (ids[12:], [1], 1, torch.ones(1, dtype=torch.int32, device=device), None, target[12:], bonus[4:])
        alone, _ = seeded_call(alone_args, {0: 8}, 300, device, [0.7])
    same = [0, 2, 3, 4]
    assert torch.equal(a[same], b[same]), "seeded rows (and greedy ones) do not depend on torch's default generator"
    assert not torch.equal(a[1], b[1]), "an unseeded row draws from torch's default generator"
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[4], c[4]), "another generator state, another output"
    assert torch.equal(a[2], c[2]) and a[2].tolist() == [902, P, P, P, P], "no drafts: the bonus token alone"
    assert torch.equal(alone[0], a[4, :2]) and (a[4, 2:] == P).all(), \
        "a seeded request's output does not depend on the rest of the batch"
    # Consumption: k uniforms then one per seeded request with drafts; none without drafts (vLLM's rule).
    replay = torch.Generator(device=device).manual_seed(5)
    torch.empty(4, device=device).uniform_(generator=replay)
    torch.empty(1, device=device).uniform_(generator=replay)
    assert torch.equal(gens[0].get_state(), replay.get_state())
    assert torch.equal(gens[2].get_state(), torch.Generator(device=device).manual_seed(6).get_state())


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_greedy_and_random_batch(backend, device="cpu"):
    vocab = 16
    drafts = [[3, 4], [3, 4], [3, 4], [3, 4]]
    ids, counts, k, cu = flat(drafts, device)
    # Row 0 of each request: the draft 3 has p = 0.45, the argmax 5 has 0.5. Row 1: one-hot at the draft.
    first = torch.full((vocab,), 0.05 / (vocab - 2))
    first[3], first[5] = 0.45, 0.5
    second = torch.zeros(vocab)
    second[4] = 1.0
    target = torch.stack([first, second] * 4).to(device)
    draft = target.clone()  # q == p: a sampled row accepts every draft
    temperature = [0.0, 0.9, -1.0, 1.0]  # greedy, sampled, greedy (older vLLM's marker), sampled
    outs = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        with on(backend):
            outs.append(shim.rejection_sample(ids, counts, k, cu, draft, target, bonus_ids([7, 8, 9, 10], device),
                                              sampling_metadata(temperature, device=device)))
    for out in outs:
        assert out.tolist() == [[5, P, P], [3, 4, 8], [5, P, P], [3, 4, 10]]


def softmax64(logits, temperature):
    return torch.softmax(logits.double() / temperature, -1)


def processed_law(logits, temperature, top_k, top_p):
    """The law vLLM samples a draft position from, written out: softmax at the temperature, keep the top_k most
    likely tokens, renormalise, keep the shortest most-likely-first prefix whose mass reaches top_p, renormalise."""
    probs = softmax64(logits, temperature)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[order[:top_k]] = True
    kept = torch.where(keep, probs, 0.0)
    kept = kept / kept.sum()
    mass = kept[order].cumsum(0)
    prefix = int((mass < top_p - 1e-12).sum()) + 1
    final = torch.zeros_like(keep)
    final[order[:prefix]] = True
    law = torch.where(final & keep, probs, 0.0)
    return law / law.sum()


class BonusSampler:
    """Stands in for vLLM's Sampler: the argmax of each bonus row, recording how it was called."""

    def __init__(self):
        self.calls = []

    def __call__(self, *, logits, sampling_metadata, predict_bonus_token=False):
        self.calls.append((logits.shape, predict_bonus_token))
        return types.SimpleNamespace(sampled_token_ids=logits.argmax(-1, keepdim=True).int())


def spec_metadata(counts, draft_ids, device="cpu"):
    """vLLM's SpecDecodeMetadata for logits [T + B, V] laid out per request: its k_b draft rows, then its bonus row."""
    target_idx, bonus_idx, row = [], [], 0
    for k in counts:
        target_idx += range(row, row + k)
        bonus_idx.append(row + k)
        row += k + 1
    as_t = lambda x: torch.tensor(x, dtype=torch.int32, device=device)
    return types.SimpleNamespace(draft_token_ids=draft_ids, num_draft_tokens=counts, max_spec_len=max(counts),
                                 cu_num_draft_tokens=as_t(counts).cumsum(0).int(),
                                 target_logits_indices=as_t(target_idx),
                                 bonus_logits_indices=as_t(bonus_idx))


LOGITS = torch.tensor([2.0, 1.1, 0.3, -0.4, 1.6, -1.5, 0.8, -0.9])  # distinct: no ties at a top-k / top-p boundary
CONFIGS = [(0.7, 3, 1.0), (1.5, 8, 0.7), (1.0, 2, 0.9), (0.0, 8, 1.0)]  # (temperature, top_k, top_p); the last greedy


def forward_batch(n, device="cpu"):
    """n requests cycling through CONFIGS with k_b cycling 1, 2, 3 (ragged, so that the per-request settings must be
    expanded to the right rows), every row LOGITS, every draft token 1 (outside config 2's top-2: always rejected
    there; below the argmax: rejected by the greedy config)."""
    counts = [1 + b % 3 for b in range(n)]
    rows = sum(counts) + n
    logits = LOGITS.expand(rows, -1).clone()  # the bonus rows too: the stand-in sampler emits their argmax, 0
    cfg = [CONFIGS[b % len(CONFIGS)] for b in range(n)]
    meta = sampling_metadata([c[0] for c in cfg], top_k=torch.tensor([c[1] for c in cfg], dtype=torch.int32,
                                                                       device=device),
                             top_p=torch.tensor([c[2] for c in cfg], device=device), device=device)
    ids = torch.ones(sum(counts), dtype=torch.int32, device=device)
    return spec_metadata(counts, ids, device), logits.to(device), meta


@pytest.mark.parametrize("backend,n", [("native", 240_000), ("sim", 240)])
def test_rejection_sampler_forward_processes_the_target(backend, n, device="cpu"):
    # Fixed seed; 60,000 requests per config, whose first token must follow the processed law. With at most 8 tokens
    # of probability >= ~0.05, a 1% shift between two tokens has noncentrality >= 60,000 * 2e-4 / 0.5 = 24: power ~0.9
    # at the 1e-4 level (V - 1 <= 7 dof, critical value ~29), ~1 for a bias of 1.5%.
    meta, logits, sm = forward_batch(n, device)
    sampler = BonusSampler()
    module = shim.RejectionSampler(sampler)
    torch.manual_seed(3)
    with on(backend):
        out = module(meta, None, logits, sm)
    assert sampler.calls == [((n, 8), True)], "the bonus rows go through the engine's sampler, once"
    assert out.logprobs_tensors is None
    y = out.sampled_token_ids
    assert y.shape == (n, 4) and y.dtype == torch.int32
    if backend == "sim":
        torch.manual_seed(3)
        assert torch.equal(y, shim.RejectionSampler(BonusSampler())(meta, None, logits, sm).sampled_token_ids)
        return
    first = y[:, 0].long().cpu()
    for c, (temperature, top_k, top_p) in enumerate(CONFIGS):
        rows = first[c::len(CONFIGS)]
        if temperature == 0.0:  # greedy: the draft 1 is not the argmax 0, so the argmax
            assert (rows == 0).all()
            continue
        law = processed_law(LOGITS, temperature, top_k, top_p)
        counts = torch.bincount(rows, minlength=8)
        assert (counts[law == 0] == 0).all(), f"config {c}: a token outside top-k/top-p was emitted"
        assert chi_square_pvalue(counts[law > 0].unsqueeze(0), law[law > 0].unsqueeze(0)) > 1e-4, f"config {c}"


def test_processing_finds_each_rows_request_from_either_form_of_the_counts():
    """Ragged counts with requests without drafts: the rows' owners from cu_num_draft_tokens (the device path) and from
    the host list must give the same probabilities, each row processed with its own request's settings."""
    counts = [2, 0, 3, 0, 1]
    temperature, top_k, top_p = [0.5, 1.0, 2.0, 0.7, 0.0], [3, 8, 8, 2, 8], [1.0, 1.0, 0.6, 1.0, 1.0]
    meta = sampling_metadata(temperature, top_k=torch.tensor(top_k, dtype=torch.int32), top_p=torch.tensor(top_p))
    logits = LOGITS.expand(sum(counts), -1).clone()
    cu = torch.tensor(counts).cumsum(0).int()
    host = shim.process_target_logits(logits, counts, meta)
    device = shim.process_target_logits(logits, counts, meta, cu)
    assert torch.equal(host, device)
    owners = [b for b, k in enumerate(counts) for _ in range(k)]
    for row, b in enumerate(owners):
        if temperature[b] == 0.0:
            assert int(host[row].argmax()) == int(LOGITS.argmax())
        else:
            assert torch.allclose(host[row].double(), processed_law(LOGITS, temperature[b], top_k[b], top_p[b]),
                                  atol=1e-6), row


def test_forward_without_top_k_top_p_and_all_greedy():
    meta, logits, _ = forward_batch(6)
    sampler = BonusSampler()
    greedy = shim.RejectionSampler(sampler)(meta, None, logits, sampling_metadata()).sampled_token_ids
    # Every draft is 1, the argmax is 0: each request emits 0 once; the bonus is never reached.
    assert greedy.tolist() == [[0, P, P, P]] * 6
    torch.manual_seed(0)
    plain = shim.RejectionSampler(sampler)(meta, None, logits, sampling_metadata([1.0] * 6)).sampled_token_ids
    assert ((plain[:, 0] >= 0) & (plain[:, 0] < 8)).all()


def test_parse_output():
    out = torch.tensor([[5, 6, P], [P, P, P], [7, 300, P], [1, 2, 3]], dtype=torch.int32)
    tokens, cu = shim.RejectionSampler.parse_output(out, vocab_size=100)
    assert tokens == [[5, 6], [], [7], [1, 2, 3]] and cu is None
    tokens, cu = shim.RejectionSampler.parse_output(out, 100, discard_req_indices=[3], return_cu_num_tokens=True)
    assert tokens == [[5, 6], [], [7], []] and cu == [0, 2, 2, 3, 6]


def good_args(device="cpu"):
    ids, counts, k, cu = flat([[1, 2], [3]], device)
    target = argmax_rows([1, 2, 3], 8, device)
    return dict(draft_token_ids=ids, num_draft_tokens=counts, max_spec_len=k, cu_num_draft_tokens=cu,
                draft_probs=target.clone(), target_probs=target, bonus_token_ids=bonus_ids([4, 5], device),
                sampling_metadata=sampling_metadata([1.0, 0.0]))


BAD = [
    ("draft_token_ids", lambda a: a["draft_token_ids"].view(1, 3)),
    ("num_draft_tokens", lambda a: [2, -1]),
    ("num_draft_tokens", lambda a: torch.tensor([2, 1])),
    ("num_draft_tokens", lambda a: [2, 2]),  # sums to 4, 3 drafts
    ("max_spec_len", lambda a: 1),
    ("max_spec_len", lambda a: 129),
    ("max_spec_len", lambda a: 2.0),
    ("cu_num_draft_tokens", lambda a: a["cu_num_draft_tokens"][:1]),
    ("cu_num_draft_tokens", lambda a: torch.tensor([1, 3], dtype=torch.int32)),  # not the cumsum of [2, 1]
    ("target_probs", lambda a: a["target_probs"][:2]),
    ("target_probs", lambda a: a["target_probs"].unsqueeze(0)),
    ("draft_probs", lambda a: a["draft_probs"][:, :4]),
    ("bonus_token_ids", lambda a: a["bonus_token_ids"][:1]),
    ("temperature", lambda a: sampling_metadata([1.0, 0.0, 1.0])),
    ("generators", lambda a: sampling_metadata([1.0, 0.0], {5: torch.Generator()})),
    ("all_greedy", lambda a: types.SimpleNamespace(temperature=None)),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,corrupt", BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD)])
def test_bad_inputs_name_the_argument(backend, name, corrupt):
    args = good_args()
    with on(backend):
        shim.rejection_sample(**args)  # the unmodified call is valid
        key = name if name in args else "sampling_metadata"
        args[key] = corrupt(args)
        with pytest.raises(ValueError, match=name):
            shim.rejection_sample(**args)


def test_forward_refuses_what_it_leaves_to_vllm_without_register(monkeypatch):
    monkeypatch.setattr(shim, "_vllm_rejection_sampler", None)
    meta, logits, _ = forward_batch(3)
    module = shim.RejectionSampler(BonusSampler())
    for field, value in (("max_num_logprobs", 0), ("no_penalties", False), ("bad_words_token_ids", {0: [[1]]}),
                         ("allowed_token_ids_mask", torch.zeros(3, 8, dtype=torch.bool))):
        with pytest.raises(NotImplementedError, match="penalties" if field == "no_penalties" else field):
            module(meta, None, logits, sampling_metadata([1.0] * 3, **{field: value}))
    too_long = types.SimpleNamespace(**{**vars(meta), "max_spec_len": 129})
    with pytest.raises(ValueError, match="max_spec_len"):
        module(too_long, None, logits, sampling_metadata())


class VllmRejectionSampler(nn.Module):
    """Stands in for vLLM's own class: records the calls handed to it."""
    calls = []

    def __init__(self, sampler):
        super().__init__()
        self.sampler = sampler

    def forward(self, *args):
        VllmRejectionSampler.calls.append(args)
        return "vllm's output"


class ModelRunnerV2RejectionSampler:
    """Another class of the same name (vLLM's model runner v2): another contract, never replaced."""


@pytest.fixture
def stand_in_vllm(monkeypatch):
    """A vllm package tree in sys.modules with the attribute paths vLLM's worker uses; removed after the test."""
    tree = {
        "vllm": {}, "vllm.v1": {}, "vllm.v1.sample": {},
        "vllm.v1.sample.rejection_sampler": {"RejectionSampler": VllmRejectionSampler},
        "vllm.v1.worker": {},
        "vllm.v1.worker.gpu_model_runner": {"RejectionSampler": VllmRejectionSampler},
        "vllm.v1.worker.gpu.spec_decode.rejection_sampler": {"RejectionSampler": ModelRunnerV2RejectionSampler},
        "not_vllm.runner": {"RejectionSampler": VllmRejectionSampler},
    }
    modules = {}
    for name, attrs in tree.items():
        modules[name] = types.ModuleType(name)
        vars(modules[name]).update(attrs)
        monkeypatch.setitem(sys.modules, name, modules[name])
    monkeypatch.setattr(shim, "_vllm_rejection_sampler", None)
    VllmRejectionSampler.calls = []
    return modules


def test_register_replaces_vllms_class_where_the_worker_looks(stand_in_vllm, monkeypatch, caplog):
    m = stand_in_vllm
    with caplog.at_level(logging.INFO, logger="specdec_ext.compat.vllm"):
        patched = shim.register()
    assert patched == ["vllm.v1.sample.rejection_sampler.RejectionSampler",
                       "vllm.v1.worker.gpu_model_runner.RejectionSampler"]
    assert m["vllm.v1.sample.rejection_sampler"].RejectionSampler is shim.RejectionSampler
    assert m["vllm.v1.worker.gpu_model_runner"].RejectionSampler is shim.RejectionSampler
    assert m["vllm.v1.worker.gpu.spec_decode.rejection_sampler"].RejectionSampler is ModelRunnerV2RejectionSampler
    assert m["not_vllm.runner"].RejectionSampler is VllmRejectionSampler
    assert [r.name for r in caplog.records] == ["specdec_ext.compat.vllm"]
    assert "gpu_model_runner" in caplog.records[0].getMessage()
    # Idempotent; a module that imported vLLM's class after the first call is patched by the next one.
    assert shim.register() == []
    late = types.ModuleType("vllm.v1.spec_decode.late")
    late.RejectionSampler = VllmRejectionSampler
    monkeypatch.setitem(sys.modules, late.__name__, late)
    assert shim.register() == ["vllm.v1.spec_decode.late.RejectionSampler"]
    assert m["vllm.v1.sample.rejection_sampler"].RejectionSampler is shim.RejectionSampler
    # What the model runner now builds hands logprobs batches to vLLM's own class, and samples the rest itself.
    runner_cls = m["vllm.v1.worker.gpu_model_runner"].RejectionSampler
    meta, logits, _ = forward_batch(3)
    module = runner_cls(BonusSampler())
    wants_logprobs = sampling_metadata([1.0] * 3, max_num_logprobs=2)
    assert module(meta, None, logits, wants_logprobs) == "vllm's output"
    assert len(VllmRejectionSampler.calls) == 1 and VllmRejectionSampler.calls[0][3] is wants_logprobs
    assert module(meta, None, logits, sampling_metadata()).sampled_token_ids.tolist() == [[0, P, P, P]] * 3
    assert len(VllmRejectionSampler.calls) == 1


def test_register_without_vllm_logs_and_does_nothing(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` fail
    monkeypatch.setattr(shim, "_vllm_rejection_sampler", None)
    with caplog.at_level(logging.INFO, logger="specdec_ext.compat.vllm"):
        assert shim.register() == []
    assert len(caplog.records) == 1 and "not importable" in caplog.records[0].getMessage()
    assert shim._vllm_rejection_sampler is None


def test_the_plugin_entry_point_is_declared():
    """setup.py declares it (the source of truth); an installed distribution's metadata, when it has the group, too."""
    setup_py = Path(__file__).resolve().parents[1] / "setup.py"
    call = next(node for node in ast.walk(ast.parse(setup_py.read_text()))
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup")
    entry_points = ast.literal_eval(next(kw.value for kw in call.keywords if kw.arg == "entry_points"))
    assert entry_points["vllm.general_plugins"] == ["specdec_ext = specdec_ext.compat.vllm:register"]
    name, value = (s.strip() for s in entry_points["vllm.general_plugins"][0].split("="))
    assert importlib.metadata.EntryPoint(name, value, "vllm.general_plugins").load() is shim.register
    installed = [e for e in importlib.metadata.distribution("specdec_ext").entry_points
                 if e.group == "vllm.general_plugins"]
    assert installed == [] or [(e.name, e.value) for e in installed] == [(name, value)]
