"""verification="block" of the chain sampling ops (Sun et al., "Block Verification Accelerates Speculative Decoding",
arXiv 2403.10444; specdec/chain_sampling.h, chain_block_verify) and the flat form's per-request cap (num_draft_tokens
with cu_num_draft_tokens): the law of the emitted sequences, the exact acceptance by enumeration and its closed form,
bit-exactness between the CPU kernel and the CUDA kernel under the emulator, the float64 reference, and the errors."""
import itertools
import math

import pytest
import torch

import specdec_ext
from helpers.chi_square import assert_law, chi_square_power, chi_square_pvalue
from helpers.sampling_inputs import dirichlet, make_chain_inputs, ragged_batch, reduced_vocab
from specdec_ext import reference, sim

BACKENDS = {"cpu": specdec_ext, "sim": sim}
NAMESPACES = {"cpu": torch.ops.specdec, "sim": torch.ops.specdec_sim}


def poisoned(batch, k):
    return torch.full((batch, k + 1), -77, dtype=torch.int32), torch.full((batch,), -77, dtype=torch.int32)


def call(backend, logits, ids, target, draft, *, control, **kw):
    ops = BACKENDS[backend]
    if logits:
        return ops.chain_speculative_sampling_from_logits(ids, target, draft, temperature=control, **kw)
    return ops.chain_speculative_sampling(ids, target, draft, greedy=control, **kw)


def with_strict(backend, fn):
    """fn(), in strict mode on the emulator (whose kernels record errors instead of raising)."""
    if backend == "cpu":
        return fn()
    specdec_ext.set_strict(True)
    try:
        return fn()
    finally:
        specdec_ext.set_strict(False)


# ----- the law of the emitted sequences ----------------------------------------------------------------------------
def markov_tables(gen, k, vocab):
    """A first-order target and draft: p0, q0 the laws at position 0; P[i][a] the target's law at position i + 1
    after token a, Q[i - 1][a] the draft's (the law of x_{i+1} after x_i = a)."""
    p0, q0 = dirichlet(gen, vocab), dirichlet(gen, vocab)
    big_p = torch.stack([dirichlet(gen, vocab, vocab) for _ in range(k)])
    big_q = torch.stack([dirichlet(gen, vocab, vocab) for _ in range(max(k - 1, 1))])
    return p0, q0, big_p, big_q


def draft_round(gen, n, p0, q0, big_p, big_q):
    """n rounds: drafts x_1..x_k from the draft chain, the target rows [n, k+1, V] (row i after x_i) and the draft
    rows [n, k, V] (row i the law x_{i+1} was drawn from)."""
    k, vocab = big_p.shape[0], p0.numel()
    x = [torch.multinomial(q0.expand(n, vocab), 1, replacement=True, generator=gen).squeeze(-1)]
    for i in range(1, k):
        x.append(torch.multinomial(big_q[i - 1][x[-1]], 1, generator=gen).squeeze(-1))
    ids = torch.stack(x, -1)
    target = torch.stack([p0.expand(n, vocab)] + [big_p[i][ids[:, i]] for i in range(k)], 1)
    draft = torch.stack([q0.expand(n, vocab)] + [big_q[i - 1][ids[:, i - 1]] for i in range(1, k)], 1)
    return ids, target, draft


def complete_from_target(gen, tokens, accepted, p0, big_p):
    """The emitted tokens y_0..y_accepted, continued to length k + 1 by sampling the target chain: the sequence plain
    sampling would have produced if the round is lossless."""
    k = big_p.shape[0]
    y = tokens.long().clone()
    for i in range(1, k + 1):
        draw = torch.multinomial(big_p[i - 1][y[:, i - 1].clamp_min(0)], 1, generator=gen).squeeze(-1)
        y[:, i] = torch.where(accepted.long() < i, draw, y[:, i])
    return y


def sequence_law(p0, big_p) -> dict:
    """P(y_0..y_k = s) for every s in V^(k+1) under the target chain, float64."""
    k, vocab = big_p.shape[0], p0.numel()
    law = {}
    for s in itertools.product(range(vocab), repeat=k + 1):
        prob = float(p0[s[0]])
        for i in range(1, k + 1):
            prob *= float(big_p[i - 1][s[i - 1], s[i]])
        law[s] = prob
    return law


# (inputs, draft rows, layout, K, V, rounds). Layout "flat_cap": the flat form with every request's K drafts in its
# layout and a random cap num_draft_tokens[b] in [0, K] (Task B), the drafts and rows past the cap poisoned.
LAW_CASES = {
    "probs-draft-padded-K3": ("probs", True, "padded", 3, 4, 60_000),
    "probs-point-flatcap-K3": ("probs", False, "flat_cap", 3, 4, 60_000),
    "logits-draft-flatcap-K2": ("logits", True, "flat_cap", 2, 5, 60_000),
    "logits-point-padded-K4": ("logits", False, "padded", 4, 3, 60_000),
}


@pytest.mark.parametrize("case", LAW_CASES)
def test_emitted_sequences_follow_the_target(case):
    """Each round's emitted tokens y_0..y_tau, continued to K + 1 tokens by sampling the target, must have the target
    chain's joint law over V^(K+1) (64 to 256 sequences; prefix-dependent p and q at every position). Pearson
    chi-square at p > 1e-3 (cells expected below 5 pooled); assert_law also checks that the power against the hardest
    1% bias (one point of probability moved between the two likeliest sequences) is >= 0.9 at this many rounds (for
    these laws it is > 0.99 at 60,000 rounds). Fixed seeds."""
    kind, with_draft, layout, k, vocab, n = LAW_CASES[case]
    gen = torch.Generator().manual_seed(20240 + k * 10 + vocab)
    p0, q0, big_p, big_q = markov_tables(gen, k, vocab)
    ids, target, draft = draft_round(gen, n, p0, q0, big_p, big_q)
    temperature = 0.8
    if kind == "logits":  # logits whose softmax at the temperature is the chain
        target, draft = (target.log() * temperature).float(), (draft.log() * temperature).float()
    else:
        target, draft = target.float(), draft.float()
    draft = draft if with_draft else None
    seed = torch.randint(-(2**63), 2**63 - 1, (n,), generator=gen)
    kw = dict(seed=seed, offset=3, verification="block", out=poisoned(n, k))
    control = temperature if kind == "logits" else False
    if layout == "padded":
        out = call("cpu", kind == "logits", ids.int(), target, draft, control=control, **kw)
    else:
        caps = torch.randint(0, k + 1, (n,), generator=gen, dtype=torch.int32)
        flat_ids = torch.where(torch.arange(k) < caps.unsqueeze(-1), ids, -1).int().reshape(-1)
        flat_target = target.clone()
        flat_target[torch.arange(k + 1) > caps.unsqueeze(-1)] = float("nan")  # past the cap's row: never read
        flat_draft = None
        if draft is not None:
            flat_draft = draft.clone()
            flat_draft[torch.arange(k) >= caps.unsqueeze(-1)] = float("nan")
            flat_draft = flat_draft.reshape(-1, vocab)
        out = call("cpu", kind == "logits", flat_ids, flat_target.reshape(-1, vocab), flat_draft, control=control,
                   cu_num_draft_tokens=((torch.arange(n) + 1) * k).int(), max_draft_tokens=k, num_draft_tokens=caps,
                   **kw)
        assert bool((out.num_accepted <= caps).all())
    acc = out.num_accepted
    assert bool((acc >= 0).all()) and bool((acc <= k).all())
    assert 0 < float(acc.float().mean()) < k, "the rounds must mix acceptances and rejections"
    y = complete_from_target(gen, out.output_token_ids, acc, p0, big_p)
    place = vocab ** torch.arange(k, -1, -1)
    counts = torch.bincount((y * place).sum(-1), minlength=vocab ** (k + 1)).tolist()
    sequences = list(itertools.product(range(vocab), repeat=k + 1))
    assert_law(dict(zip(sequences, counts)), sequence_law(p0, big_p))


# ----- exact acceptance: enumeration, closed form, measured --------------------------------------------------------
def exact_acceptance(p0, q0, big_p, big_q, k, point=False):
    """By enumerating every draft sequence x in V^k (its probability Q(x) under the draft chain) and integrating the
    uniforms out, in float64: the law of block verification's tau (P(tau = j | x) = h_j prod_{i > j} (1 - h_i),
    h_0 = 1); the closed form P(tau >= j) = E_Q[c_j(x_1..x_j)] (P(tau >= j | x_1..x_j) = c_j, the paper's weights:
    equal to the enumeration's); and token verification's P(tau >= j) = E_Q[prod_{i <= j} min(1, p_{i-1}(x_i) /
    q_{i-1}(x_i))]. point: the verifier's q is the point mass at each draft (the drafts still come from the chain).
    Lists indexed by j = 0..k."""
    vocab = len(p0)
    block_tau, closed, token = [0.0] * (k + 1), [0.0] * (k + 1), [0.0] * (k + 1)
    for x in itertools.product(range(vocab), repeat=k):
        qx = q0[x[0]]
        for i in range(1, k):
            qx *= big_q[i - 1][x[i - 1]][x[i]]
        prow = [p0] + [big_p[i][x[i]] for i in range(k)]
        qrow = [q0] + [big_q[i - 1][x[i - 1]] for i in range(1, k)]
        if point:
            qrow = [[1.0 if v == x[i] else 0.0 for v in range(vocab)] for i in range(k)]
        c, tok = [1.0], [1.0]
        for j in range(1, k + 1):
            p, q = prow[j - 1][x[j - 1]], qrow[j - 1][x[j - 1]]
            c.append(min(1.0, c[-1] * p / q) if q > 0 else 0.0)
            tok.append(tok[-1] * (min(1.0, p / q) if q > 0 else 0.0))
        h = [1.0]
        for j in range(1, k):
            r = sum(max(c[j] * prow[j][v] - qrow[j][v], 0.0) for v in range(vocab))
            h.append(r / (r + 1.0 - c[j]) if r + 1.0 - c[j] > 0 else 1.0)
        h.append(c[k])
        for j in range(k + 1):
            block_tau[j] += qx * h[j] * math.prod(1.0 - h[i] for i in range(j + 1, k + 1))
            closed[j] += qx * c[j]
            token[j] += qx * tok[j]
    return block_tau, closed, token


def at_least(law):
    """P(tau >= j), j = 0..k, from the law of tau."""
    return [sum(law[j:]) for j in range(len(law))]


def tables_as_lists(p0, q0, big_p, big_q):
    return p0.tolist(), q0.tolist(), big_p.tolist(), big_q.tolist()


def measured_tau(n, p0, q0, big_p, big_q, verification, point=False, seed=5):
    gen = torch.Generator().manual_seed(seed)
    ids, target, draft = draft_round(gen, n, p0, q0, big_p, big_q)
    out = specdec_ext.chain_speculative_sampling(ids.int(), target.float(), None if point else draft.float(),
                                                 seed=torch.randint(0, 2**62, (n,), generator=gen), offset=11,
                                                 verification=verification)
    return out.num_accepted.long()


def paper_example():
    """Sun et al.'s motivating example: context-free target (1/3, 2/3) and draft (2/3, 1/3) over {a, b}, K = 2: token
    verification accepts 10/9 drafts in expectation, block verification 11/9 (the full-information optimum is 12/9)."""
    mb, ms = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64), torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)
    return mb, ms, mb.expand(2, 2, 2).clone(), ms.expand(1, 2, 2).clone()


def test_exact_acceptance_of_the_papers_example():
    p0, q0, big_p, big_q = paper_example()
    block_tau, closed, token = exact_acceptance(*tables_as_lists(p0, q0, big_p, big_q), 2)
    assert sum(at_least(block_tau)[1:]) == pytest.approx(11 / 9, abs=1e-12)
    assert sum(closed[1:]) == pytest.approx(11 / 9, abs=1e-12)
    assert sum(token[1:]) == pytest.approx(10 / 9, abs=1e-12)
    # Measured, 40,000 rounds each: the standard error of a mean count is ~0.004, the gap 1/9 is ~25 of them.
    n = 40_000
    block = measured_tau(n, p0, q0, big_p, big_q, "block")
    tok = measured_tau(n, p0, q0, big_p, big_q, "token")
    for got, want in ((block, 11 / 9), (tok, 10 / 9)):
        se = float(got.double().std()) / math.sqrt(n)
        assert abs(float(got.double().mean()) - want) < 4.5 * se, (float(got.double().mean()), want, se)
    assert float(block.double().mean()) > float(tok.double().mean()) + 0.08


@pytest.mark.parametrize("point", [False, True], ids=["draft_rows", "point_drafts"])
def test_exact_acceptance_by_enumeration(point):
    """A first-order chain with V = 3, K = 3. The enumeration's P(tau >= j) equals the closed form E_Q[c_j] (float64,
    1e-12) and is at least token verification's at every j (the paper's guarantee): strictly above it in total with
    draft rows, equal to it for point proposals (whose only lossless acceptance of x is prod p(x_i)). The
    op's law of tau over 0..K (100,000 rounds) against the enumeration: chi-square at p > 1e-3, with power >= 0.9
    against one point of probability moved between the two likeliest counts (asserted); and token verification's mean
    against its own exact value."""
    gen = torch.Generator().manual_seed(77)
    k, vocab, n = 3, 3, 100_000
    p0, q0, big_p, big_q = markov_tables(gen, k, vocab)
    block_tau, closed, token = exact_acceptance(*tables_as_lists(p0, q0, big_p, big_q), k, point)
    assert sum(block_tau) == pytest.approx(1.0, abs=1e-12)
    for j in range(k + 1):
        assert at_least(block_tau)[j] == pytest.approx(closed[j], abs=1e-12)
        assert at_least(block_tau)[j] >= token[j] - 1e-12
    if point:  # q a point mass: c_j = p_0(x_1) ... p_{j-1}(x_j), token verification's own acceptance
        assert closed == pytest.approx(token, abs=1e-12)
    else:
        assert sum(closed[1:]) > sum(token[1:]) + 1e-2
    tau = measured_tau(n, p0, q0, big_p, big_q, "block", point)
    counts = torch.bincount(tau, minlength=k + 1).double()
    law = torch.tensor(block_tau, dtype=torch.float64)
    assert chi_square_power(dict(enumerate(block_tau)), n, k) >= 0.9
    assert chi_square_pvalue(counts.unsqueeze(0), law.unsqueeze(0))[0] > 1e-3
    tok = measured_tau(n, p0, q0, big_p, big_q, "token", point).double()
    assert abs(float(tok.mean()) - sum(token[1:])) < 4.5 * float(tok.std()) / math.sqrt(n)
    if not point:
        assert float(tau.double().mean()) > float(tok.mean())


# ----- bit-exactness and the reference -----------------------------------------------------------------------------
@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
@pytest.mark.parametrize("with_draft", [True, False], ids=["draft", "point"])
@pytest.mark.parametrize("batch,k,vocab", [(12, 4, 2111), (5, 3, 9000)], ids=["one_tile", "two_tiles"])
def test_cpu_kernel_and_emulated_cuda_kernel_agree_exactly(logits, with_draft, batch, k, vocab, gen, strict):
    """Tokens and counts of block verification, bit for bit, padded and flat (the same rows), with mixed greedy and
    sampled requests, ragged counts, and (logits) temperatures with per-request top-k / top-p. Strict mode (the
    fixture): valid input, so the emulated kernel must record no error either."""
    padded, flat = ragged_batch(gen, batch, k, vocab, sharpness=1.5)
    kind = "logits" if logits else "probs"
    if logits:
        control = torch.rand(batch, generator=gen) + 0.4
        control[1] = 0.0
        filters = dict(top_k=torch.randint(0, 40, (batch,), generator=gen, dtype=torch.int32),
                       top_p=torch.rand(batch, generator=gen) * 0.3 + 0.7)
    else:
        control, filters = torch.arange(batch) % 5 == 1, {}
    keys = dict(seed=padded["seed"], offset=padded["offset"], control=control, verification="block", **filters)
    draft = padded[f"draft_{kind}"] if with_draft else None
    flat_draft = flat[f"draft_{kind}"] if with_draft else None
    outs = []
    for backend in BACKENDS:
        outs.append(call(backend, logits, padded["ids"], padded[f"target_{kind}"], draft,
                         num_draft_tokens=padded["num_draft_tokens"], out=poisoned(batch, k), **keys))
        outs.append(call(backend, logits, flat["ids"], flat[f"target_{kind}"], flat_draft,
                         cu_num_draft_tokens=flat["cu"], max_draft_tokens=k, out=poisoned(batch, k), **keys))
    for out in outs[1:]:
        assert torch.equal(out.output_token_ids, outs[0].output_token_ids)
        assert torch.equal(out.num_accepted, outs[0].num_accepted)
    acc = outs[0].num_accepted
    assert bool((acc <= padded["num_draft_tokens"]).all())
    emitted = torch.arange(k + 1) <= acc.unsqueeze(-1).long()
    tokens = outs[0].output_token_ids
    assert bool(((tokens >= 0) & (tokens < vocab))[emitted].all()) and bool((tokens[~emitted] == -1).all())


@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
def test_reduced_draft_vocabulary_under_block_verification(logits, gen):
    """draft_to_target gives the outputs of the same draft rows scattered into the full vocabulary, bit for bit, on the
    CPU and under the emulator (block mode reads every draft row in full through the map)."""
    batch, k, vocab, draft_vocab = 6, 3, 9000, 700
    d2t = reduced_vocab(gen, vocab, draft_vocab)
    target = torch.randn(batch, k + 1, vocab, generator=gen) * 2
    target[..., d2t.long()] += 3.0
    draft = target[:, :k, d2t.long()] + 0.5 * torch.randn(batch, k, draft_vocab, generator=gen)
    if not logits:
        target, draft = torch.softmax(target, -1), torch.softmax(draft, -1)
    q = torch.softmax(draft, -1) if logits else draft
    ids = d2t[torch.multinomial(q.reshape(-1, draft_vocab), 1, generator=gen).reshape(batch, k)].int()
    full = draft.new_full((batch, k, vocab), float("-inf") if logits else 0.0)
    full[..., d2t.long()] = draft
    control = 1.0 if logits else False
    kw = dict(seed=torch.arange(batch), offset=0, control=control, verification="block")
    want = call("cpu", logits, ids, target, full, out=poisoned(batch, k), **kw)
    for backend in BACKENDS:
        got = call(backend, logits, ids, target, draft, draft_to_target=d2t, out=poisoned(batch, k), **kw)
        assert torch.equal(got.output_token_ids, want.output_token_ids)
        assert torch.equal(got.num_accepted, want.num_accepted)


@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
@pytest.mark.parametrize("with_draft", [True, False], ids=["draft", "point"])
def test_reference_agrees_except_within_float32_rounding(logits, with_draft, gen):
    """The float64 reference takes the kernels' decisions: an accepted count may differ only where some u_j lies within
    float32 rounding (1e-5) of the reference's h_j, and at most max(1, B / 50) rows differ at all (counts or the last
    token, which can also differ where u * R is within rounding of a CDF boundary, as in token mode)."""
    batch, k, vocab = 400, 4, 40
    inp = make_chain_inputs(gen, batch, k, vocab, with_draft=with_draft, sharpness=1.0)
    kind = "logits" if logits else "probs"
    control = 0.9 if logits else False
    kw = dict(num_draft_tokens=inp["num_draft_tokens"], seed=inp["seed"], offset=inp["offset"], verification="block")
    out = call("cpu", logits, inp["ids"], inp[f"target_{kind}"], inp[f"draft_{kind}"], control=control,
               out=poisoned(batch, k), **kw)
    ref_fn = reference.chain_speculative_sampling_from_logits if logits else reference.chain_speculative_sampling
    ref = ref_fn(inp["ids"], inp[f"target_{kind}"], inp[f"draft_{kind}"],
                 **({"temperature": control} if logits else {"greedy": control}), **kw)
    differ = ((out.num_accepted != ref[1]) | (out.output_token_ids != ref[0]).any(-1)).nonzero().flatten()
    assert len(differ) <= max(1, batch // 50), (len(differ), out, ref)
    if logits:
        p = torch.softmax(inp["target_logits"].double() / control, -1)
        q = None if not with_draft else torch.softmax(inp["draft_logits"].double() / control, -1)
    else:
        p = inp["target_probs"].double()
        q = None if not with_draft else inp["draft_probs"].double()
    u = reference.philox_uniform(inp["seed"], inp["offset"], k).double()
    _, _, h = reference.block_verification(inp["ids"], p, q, inp["num_draft_tokens"], u)
    for b in (out.num_accepted != ref[1]).nonzero().flatten().tolist():
        n = int(inp["num_draft_tokens"][b])
        assert bool(((u[b, :n] - h[b, :n]).abs() <= 1e-5).any()), f"row {b}: a decision differs away from rounding"
    assert (out.num_accepted > 0).any() and (out.num_accepted < inp["num_draft_tokens"]).any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
def test_greedy_and_draftless_requests_are_token_verification(backend, logits, gen):
    """Greedy requests (greedy flag, temperature 0) are verified token by token in block mode, and a request with no
    drafts is plain sampling: their outputs are token mode's bit for bit. A draft equal to the target is always kept
    (c_j = 1, so h_j = 1) in both modes."""
    batch, k, vocab = 24, 4, 300
    padded, _ = ragged_batch(gen, batch, k, vocab)
    kind = "logits" if logits else "probs"
    control = torch.where(torch.arange(batch) % 3 == 0, 0.0, 0.8) if logits else torch.arange(batch) % 3 == 0
    keys = dict(seed=padded["seed"], offset=padded["offset"], control=control,
                num_draft_tokens=padded["num_draft_tokens"])
    token = call(backend, logits, padded["ids"], padded[f"target_{kind}"], padded[f"draft_{kind}"],
                 out=poisoned(batch, k), **keys)
    block = call(backend, logits, padded["ids"], padded[f"target_{kind}"], padded[f"draft_{kind}"],
                 out=poisoned(batch, k), verification="block", **keys)
    same = (torch.arange(batch) % 3 == 0) | (padded["num_draft_tokens"] == 0)
    assert same.sum() >= 8
    assert torch.equal(block.output_token_ids[same], token.output_token_ids[same])
    assert torch.equal(block.num_accepted[same], token.num_accepted[same])
    target = padded[f"target_{kind}"]
    both = [call(backend, logits, padded["ids"], target, target[:, :k], out=poisoned(batch, k), verification=v,
                 **dict(keys, control=0.8 if logits else False)) for v in ("token", "block")]
    for out in both:
        assert torch.equal(out.num_accepted, padded["num_draft_tokens"])


def test_nan_check_rule_of_block_mode(gen):
    """Block mode reads target rows 1..k-1 in full whatever tau is, so NaN there raises on the CPU even when the first
    draft is rejected for sure (p(x_1) = 0: token mode never reads them, and c_1 = 0 makes tau = 0, so block mode does
    not read the bonus row either)."""
    batch, k, vocab = 4, 3, 50
    inp = make_chain_inputs(gen, batch, k, vocab)
    target = inp["target_probs"].clone()
    target[torch.arange(batch), 0, inp["ids"][:, 0].long()] = 0.0
    bonus_nan = target.clone()
    bonus_nan[:, k, 7] = float("nan")
    row_nan = target.clone()
    row_nan[:, k - 1, 7] = float("nan")
    kw = dict(seed=inp["seed"], out=poisoned(batch, k))
    for rows in (bonus_nan, row_nan):
        out = specdec_ext.chain_speculative_sampling(inp["ids"], rows, inp["draft_probs"], **kw)
        assert bool((out.num_accepted == 0).all())
    out = specdec_ext.chain_speculative_sampling(inp["ids"], bonus_nan, inp["draft_probs"], verification="block", **kw)
    assert bool((out.num_accepted == 0).all())
    with pytest.raises(ValueError, match="target_probs holds NaN"):
        specdec_ext.chain_speculative_sampling(inp["ids"], row_nan, inp["draft_probs"], verification="block", **kw)


@pytest.mark.parametrize("with_draft", [True, False], ids=["draft", "point"])
def test_an_invalid_draft_id_ends_the_block_under_the_emulator(with_draft, gen):
    """Without strict mode the CUDA kernel (here emulated) takes an id outside [0, V) as the end of the block: with n
    valid drafts before it, the outputs are exactly those of the same request with num_draft_tokens = n (h_n = c_n,
    and tau = n draws from row n). Strict mode raises."""
    batch, k, vocab = 10, 4, 200
    inp = make_chain_inputs(gen, batch, k, vocab, sharpness=1.0)
    n = torch.arange(batch, dtype=torch.int32) % k
    ids = inp["ids"].clone()
    ids[torch.arange(batch), n.long()] = torch.where(torch.arange(batch) % 2 == 0, -1, vocab).int()
    draft = inp["draft_probs"] if with_draft else None
    kw = dict(seed=inp["seed"], offset=inp["offset"], verification="block")
    got = sim.chain_speculative_sampling(ids, inp["target_probs"], draft, out=poisoned(batch, k), **kw)
    want = sim.chain_speculative_sampling(ids, inp["target_probs"], draft, num_draft_tokens=n,
                                          out=poisoned(batch, k), **kw)
    assert torch.equal(got.output_token_ids, want.output_token_ids) and torch.equal(got.num_accepted, want.num_accepted)
    assert bool((got.num_accepted <= n).all())
    with pytest.raises(ValueError, match="draft_token_ids holds ids outside"):
        with_strict("sim", lambda: sim.chain_speculative_sampling(ids, inp["target_probs"], draft, **kw))


# ----- the flat form's cap (num_draft_tokens with cu_num_draft_tokens) ----------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
@pytest.mark.parametrize("verification", ["token", "block"])
@pytest.mark.parametrize("bonus", [False, True], ids=["bonus_rows", "bonus_ids"])
def test_flat_cap_equals_padded_counts(backend, logits, verification, bonus, gen):
    """Flat form with a cap num_draft_tokens[b] <= cu[b] - cu[b-1]: bit for bit the padded form with the same counts,
    with the layout's rows (the all-accepted token from target row start + b + cap, or the caller's bonus token). The
    drafts past the cap are -1, and the target / draft rows and uniforms past it are NaN / 2.0: never read or checked.
    Also the reference's flat form with the cap."""
    batch, k, vocab = 16, 5, 250
    padded, flat = ragged_batch(gen, batch, k, vocab, sharpness=1.5)
    counts = padded["num_draft_tokens"]
    caps = (torch.rand(batch, generator=gen) * (counts + 1).float()).int().clamp(max=counts)
    caps[1] = counts[1]
    kind = "logits" if logits else "probs"
    control = torch.tensor([0.0, 0.9, 1.2, 0.7]).repeat(4) if logits else torch.arange(batch) % 4 == 0
    starts = torch.cat([torch.zeros(1, dtype=torch.int32), flat["cu"][:-1]])
    position = torch.arange(len(flat["ids"]))
    request = torch.bucketize(position, flat["cu"], right=True)
    past = position - starts[request] >= caps[request]  # draft positions past each request's cap
    ids = torch.where(past, -1, flat["ids"])
    uniforms = torch.where(past, 2.0, flat["uniforms"])
    draft = flat[f"draft_{kind}"].clone()
    draft[past] = float("nan")
    rows_per = counts + (0 if bonus else 1)
    row_request = torch.repeat_interleave(torch.arange(batch), rows_per)
    row_start = torch.cat([torch.zeros(1, dtype=torch.long), rows_per.cumsum(0)[:-1].long()])
    row_index = torch.arange(int(rows_per.sum())) - row_start[row_request]
    target = flat[f"target_{kind}_nobonus" if bonus else f"target_{kind}"].clone()
    target[row_index > caps[row_request] - (1 if bonus else 0)] = float("nan")
    extra = dict(bonus_token_ids=padded["bonus"]) if bonus else {}
    keys = dict(seed=padded["seed"], offset=padded["offset"], control=control, verification=verification,
                final_uniforms=padded["final_uniforms"], **extra)
    padded_target = padded[f"target_{kind}"][:, :k] if bonus else padded[f"target_{kind}"]
    want = call(backend, logits, padded["ids"], padded_target, padded[f"draft_{kind}"], num_draft_tokens=caps,
                uniforms=padded["uniforms"], out=poisoned(batch, k), **keys)
    got = call(backend, logits, ids, target, draft, cu_num_draft_tokens=flat["cu"], max_draft_tokens=k,
               num_draft_tokens=caps, uniforms=uniforms, out=poisoned(batch, k), **keys)
    assert torch.equal(got.output_token_ids, want.output_token_ids)
    assert torch.equal(got.num_accepted, want.num_accepted)
    assert bool((got.num_accepted <= caps).all()) and (got.num_accepted == caps).any()
    if backend == "cpu" and not logits:
        ref = reference.chain_speculative_sampling(
            ids, target, draft, cu_num_draft_tokens=flat["cu"], max_draft_tokens=k, num_draft_tokens=caps,
            uniforms=uniforms, seed=padded["seed"], offset=padded["offset"], greedy=control,
            verification=verification, final_uniforms=padded["final_uniforms"], **extra)
        assert torch.equal(ref[1], got.num_accepted)


@pytest.mark.parametrize("backend", BACKENDS)
def test_flat_cap_out_of_range(backend, gen):
    """A cap above the layout's count or below 0 raises naming num_draft_tokens on the CPU (and in strict mode under
    the emulator); without strict mode the emulated CUDA kernel clamps it to [0, cu[b] - cu[b-1]]."""
    batch, k, vocab = 6, 3, 100
    padded, flat = ragged_batch(gen, batch, k, vocab, full=True)
    ops = BACKENDS[backend]
    kw = dict(cu_num_draft_tokens=flat["cu"], max_draft_tokens=k, seed=padded["seed"])
    for bad, clamped in ((k + 1, k), (-1, 0)):
        caps = torch.full((batch,), 2, dtype=torch.int32)
        caps[3] = bad
        with pytest.raises(ValueError, match="num_draft_tokens"):
            with_strict(backend, lambda: ops.chain_speculative_sampling(flat["ids"], flat["target_probs"],
                                                                        flat["draft_probs"], num_draft_tokens=caps,
                                                                        **kw))
        if backend == "sim":
            got = sim.chain_speculative_sampling(flat["ids"], flat["target_probs"], flat["draft_probs"],
                                                 num_draft_tokens=caps, **kw)
            want = sim.chain_speculative_sampling(flat["ids"], flat["target_probs"], flat["draft_probs"],
                                                  num_draft_tokens=caps.clamp(0, k).index_fill(0, torch.tensor(3),
                                                                                               clamped), **kw)
            assert torch.equal(got.output_token_ids, want.output_token_ids)
    with pytest.raises(ValueError, match="num_draft_tokens"):  # the reference's flat form checks it too
        reference.chain_speculative_sampling(flat["ids"], flat["target_probs"], flat["draft_probs"],
                                             num_draft_tokens=torch.full((batch,), k + 1), **kw)


# ----- errors ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
def test_refusals_name_the_argument(backend, logits, gen):
    inp = make_chain_inputs(gen, 3, 2, 20)
    kind = "logits" if logits else "probs"
    control = 1.0 if logits else False

    def run(**kw):
        return call(backend, logits, inp["ids"], inp[f"target_{kind}"], inp[f"draft_{kind}"], control=control,
                    seed=1, **kw)

    with pytest.raises(ValueError, match="verification must be one of"):
        run(verification="blocks")
    with pytest.raises(ValueError, match="verification must be one of"):
        run(verification=None)
    with pytest.raises(ValueError, match="verification='block'.*coupling='gumbel'"):
        call(backend, logits, inp["ids"], inp[f"target_{kind}"], None, control=control, seed=1, coupling="gumbel",
             verification="block")
    with pytest.raises(ValueError, match="accepted_independently"):
        run(verification="block", accepted_independently=torch.zeros(3, dtype=torch.int32))
    # The schemas refuse them too, past the wrapper.
    ns = NAMESPACES[backend]
    fn = ns.chain_speculative_sampling_from_logits if logits else ns.chain_speculative_sampling
    args = (inp["ids"], inp[f"target_{kind}"], None, inp["num_draft_tokens"],
            torch.ones(3) if logits else torch.zeros(3, dtype=torch.bool), inp["seed"], inp["offset"],
            torch.empty(3, 3, dtype=torch.int32), torch.empty(3, dtype=torch.int32), None)
    with pytest.raises(ValueError, match="verification must be"):
        fn(*args, verification="joint")
    with pytest.raises(ValueError, match="coupling"):
        fn(*args, coupling="gumbel", verification="block")
    with pytest.raises(ValueError, match="accepted_independently"):
        fn(*args, accepted_independently=torch.zeros(3, dtype=torch.int32), verification="block")
    # Every existing call keeps working: the schema's default is token verification.
    a, b = fn(*args[:7], *poisoned(3, 2), None), fn(*args[:7], *poisoned(3, 2), None, verification="token")
    assert a is None and b is None


@pytest.mark.parametrize("backend", NAMESPACES)
@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
def test_opcheck_with_block_verification(backend, logits, gen):
    batch, k, vocab = 3, 2, 33
    inp = make_chain_inputs(gen, batch, k, vocab, torch.bfloat16)
    control = torch.tensor([0.0, 1.0, 0.7]) if logits else torch.tensor([True, False, False])
    ns = NAMESPACES[backend]
    fn = ns.chain_speculative_sampling_from_logits if logits else ns.chain_speculative_sampling
    target = inp["target_logits"] if logits else inp["target_probs"]
    draft = inp["draft_logits"] if logits else inp["draft_probs"]
    torch.library.opcheck(fn.default, (inp["ids"], target, draft, inp["num_draft_tokens"], control, inp["seed"],
                                       inp["offset"], *poisoned(batch, k), None), {"verification": "block"})


def test_traces_under_torch_compile(gen):
    """The fake kernel takes the new argument: block verification and the flat cap trace with fullgraph=True."""
    batch, k, vocab = 4, 3, 64
    inp = make_chain_inputs(gen, batch, k, vocab)
    cu = ((torch.arange(batch) + 1) * k).int()
    caps = torch.tensor([3, 0, 2, 1], dtype=torch.int32)
    ids, target = inp["ids"].reshape(-1), inp["target_probs"].reshape(-1, vocab)
    draft = inp["draft_probs"].reshape(-1, vocab)

    def run(ids, target, draft, seed):
        out = specdec_ext.chain_speculative_sampling(ids, target, draft, seed=seed, offset=0, cu_num_draft_tokens=cu,
                                                     max_draft_tokens=k, num_draft_tokens=caps, verification="block")
        return out.output_token_ids, out.num_accepted + 1

    compiled = torch.compile(run, backend="aot_eager", fullgraph=True)
    got, want = compiled(ids, target, draft, inp["seed"]), run(ids, target, draft, inp["seed"])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
