"""The vLLM shim's checks (its CPU tests, rerun by tests/gpu on CUDA): vLLM's rejection sampler cases, the law of the
emitted tokens, seeded requests, mixed greedy/random batches, RejectionSampler.forward's processing of the target."""
import types

import torch

from helpers.chi_square import rows_chi_square_pvalue
from helpers.compat_backends import on
from specdec_ext.compat import vllm as vllm_shim

P = vllm_shim.PLACEHOLDER_TOKEN_ID  # what vLLM writes in a row's unused slots


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
    return vllm_shim.rejection_sample(ids, counts, k, cu, None, argmax_rows(argmaxes, vocab, device),
                                      bonus_ids(bonus, device), metadata or sampling_metadata())


def check_greedy_case(backend, case, device):
    drafts, argmaxes, bonus, expected = GREEDY_CASES[case]
    marks = [0.0 if b % 2 else -1.0 for b in range(len(drafts))]
    with on(backend):
        out = greedy_call(drafts, argmaxes, bonus, device=device)
        # The same batch marked greedy row by row (temperature 0, and vLLM's older -1) in a mixed-mode batch.
        marked = greedy_call(drafts, argmaxes, bonus, device=device, metadata=sampling_metadata(marks, device=device))
    assert out.dtype == torch.int32
    assert out.tolist() == expected
    assert marked.tolist() == expected


def check_k32(backend, gen, device):
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
        sampled = vllm_shim.rejection_sample(ids, counts, width, cu, None, one_hot, bonus_ids([7, 8], device),
                                             sampling_metadata([1.0, 0.5], device=device))
    assert out.tolist() == [drafts[0] + [7], drafts[1][:31] + [wrong, P]]
    assert sampled.tolist() == [drafts[0] + [7], drafts[1] + [8]]


def dirichlet_rows(vocab, *shape):
    """Rows drawn from Dirichlet(2, ..., 2) with torch's default generator (the caller seeds it)."""
    return torch.distributions.Dirichlet(torch.full((vocab,), 2.0)).sample(shape)


def markov_batch(n, vocab, seed):
    """n requests of k = 2 drafts with prefix-dependent rows: p0, q0 at position 0; p1[x0], q1[x0] at position 1, where
    x0 is the first draft; bonus tokens drawn from p2[x1]. Returns the flat call's arguments, p0 and p1."""
    torch.manual_seed(seed)
    p0, q0 = dirichlet_rows(vocab), dirichlet_rows(vocab)
    p1, q1, p2 = (dirichlet_rows(vocab, vocab) for _ in range(3))
    x0 = torch.multinomial(q0, n, replacement=True)
    x1 = torch.multinomial(q1[x0], 1).squeeze(-1)
    bonus = torch.multinomial(p2[x1], 1).int()
    ids = torch.stack([x0, x1], 1).reshape(-1).int()
    target = torch.stack([p0.expand(n, vocab), p1[x0]], 1).reshape(2 * n, vocab)
    draft = torch.stack([q0.expand(n, vocab), q1[x0]], 1).reshape(2 * n, vocab)
    cu = torch.arange(1, n + 1, dtype=torch.int32) * 2
    return (ids, [2] * n, 2, cu, draft, target, bonus), p0, p1


def check_emitted_tokens_follow_the_target(backend, n, with_draft, device):
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
        out = vllm_shim.rejection_sample(*on_device, meta).cpu()
    if backend == "sim":
        torch.manual_seed(99)
        assert torch.equal(out, vllm_shim.rejection_sample(*on_device, meta))
        return
    y = out.long()
    assert ((y >= 0) & (y < vocab) | (y == P)).all() and (y[:, 0] >= 0).all()
    emitted = (y >= 0).sum(-1)  # accepted + 1
    assert (y[emitted == 3, 2] == bonus[emitted == 3, 0]).all(), "after every draft is accepted, the bonus token"
    assert ((emitted == 3) | (y[:, 2] == P)).all() and ((emitted >= 2) | (y[:, 1] == P)).all()
    assert rows_chi_square_pvalue(torch.bincount(y[:, 0], minlength=vocab).unsqueeze(0), p0.unsqueeze(0)) > 1e-4
    reached = emitted >= 2  # y0 was the accepted first draft
    assert (y[reached, 0] == ids.view(n, 2)[reached, 0].long()).all()
    counts1 = torch.zeros(vocab, vocab)
    counts1.index_put_((y[reached, 0], y[reached, 1]), torch.ones(int(reached.sum())), accumulate=True)
    assert rows_chi_square_pvalue(counts1, p1) > 1e-4
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
    return vllm_shim.rejection_sample(*args, meta), generators


def check_deterministic_when_seeded(backend, device):
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


def check_mixed_greedy_and_random_batch(backend, device):
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
            outs.append(vllm_shim.rejection_sample(ids, counts, k, cu, draft, target, bonus_ids([7, 8, 9, 10], device),
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
    def as_t(x):
        return torch.tensor(x, dtype=torch.int32, device=device)
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


def check_rejection_sampler_forward_processes_the_target(backend, n, device):
    # Fixed seed; 60,000 requests per config, whose first token must follow the processed law. With at most 8 tokens
    # of probability >= ~0.05, a 1% shift between two tokens has noncentrality >= 60,000 * 2e-4 / 0.5 = 24: power ~0.9
    # at the 1e-4 level (V - 1 <= 7 dof, critical value ~29), ~1 for a bias of 1.5%.
    meta, logits, sm = forward_batch(n, device)
    sampler = BonusSampler()
    module = vllm_shim.RejectionSampler(sampler)
    torch.manual_seed(3)
    with on(backend):
        out = module(meta, None, logits, sm)
    assert sampler.calls == [((n, 8), True)], "the bonus rows go through the engine's sampler, once"
    assert out.logprobs_tensors is None
    y = out.sampled_token_ids
    assert y.shape == (n, 4) and y.dtype == torch.int32
    if backend == "sim":
        torch.manual_seed(3)
        assert torch.equal(y, vllm_shim.RejectionSampler(BonusSampler())(meta, None, logits, sm).sampled_token_ids)
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
        assert rows_chi_square_pvalue(counts[law > 0].unsqueeze(0), law[law > 0].unsqueeze(0)) > 1e-4, f"config {c}"
