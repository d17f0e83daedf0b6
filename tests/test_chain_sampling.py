"""chain_speculative_sampling(_from_logits): the CPU kernel and the CUDA kernel under the emulator, against
the reference, the exact law of the emitted tokens, and their error handling."""
import math

import pytest
import torch

import specdec_ext
from helpers.chi_square import chi_square_pvalue
from helpers.sampling_inputs import dirichlet, make_chain_inputs, misaligned_copy
from specdec_ext import reference, sim

BACKENDS = {"cpu": specdec_ext, "sim": sim}
NAMESPACES = {"cpu": torch.ops.specdec, "sim": torch.ops.specdec_sim}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def poisoned_out(batch, k):
    return (torch.full((batch, k + 1), -77, dtype=torch.int32), torch.full((batch,), -77, dtype=torch.int32))


def run_probs(backend, inp, greedy=None, **kw):
    return BACKENDS[backend].chain_speculative_sampling(
        inp["ids"], inp["target_probs"], inp["draft_probs"], num_draft_tokens=inp["num_draft_tokens"], greedy=greedy,
        seed=inp["seed"], offset=inp["offset"], out=poisoned_out(*inp["ids"].shape), **kw)


def run_logits(backend, inp, temperature, **kw):
    return BACKENDS[backend].chain_speculative_sampling_from_logits(
        inp["ids"], inp["target_logits"], inp["draft_logits"], temperature=temperature,
        num_draft_tokens=inp["num_draft_tokens"], seed=inp["seed"], offset=inp["offset"],
        out=poisoned_out(*inp["ids"].shape), **kw)


def check_well_formed(out, k, num_draft_tokens, vocab):
    ids, acc = out
    assert ids.dtype == torch.int32 and acc.dtype == torch.int32
    assert bool(((acc >= 0) & (acc <= num_draft_tokens)).all())
    pos = torch.arange(k + 1).unsqueeze(0)
    emitted = pos <= acc.unsqueeze(-1).long()
    assert bool(((ids >= 0) & (ids < vocab))[emitted].all()), "an emitted token is out of range"
    assert bool((ids[~emitted] == -1).all()), "padding must be -1 (every element written)"


def residual_cdf(p, q):
    """float64 CDF of norm(max(0, p - q)) (p itself where that is zero), for boundary checks."""
    r = (p - q).clamp_min(0) if q is not None else p
    if r.sum() <= 0:
        r = p
    return r.cumsum(0)


def assert_tokens_match_reference(out, ref, p_rows, q_rows, ids, num_draft_tokens, u_resample, max_boundary_rows):
    """Acceptance must agree exactly; the last token may differ only where the reference's threshold lies
    within float32 rounding of a CDF boundary at the kernel's token."""
    assert torch.equal(out.num_accepted, ref[1])
    differ = (out.output_token_ids != ref[0]).any(-1).nonzero().flatten().tolist()
    assert len(differ) <= max_boundary_rows, f"{len(differ)} rows differ from the reference"
    for b in differ:
        j = int(out.num_accepted[b])
        tok = int(out.output_token_ids[b, j])
        assert torch.equal(out.output_token_ids[b, :j], ref[0][b, :j])
        p = p_rows[b, j].double()
        q = None
        if j < int(num_draft_tokens[b]):  # a rejected draft: the residual; else the bonus token, from p itself
            if q_rows is not None:
                q = q_rows[b, j].double()
            else:
                q = torch.zeros_like(p)
                q[int(ids[b, j])] = 1.0
        cdf = residual_cdf(p, q)
        t = float(u_resample[b]) * float(cdf[-1])
        tol = 1e-5 * float(cdf[-1])
        lo = float(cdf[tok - 1]) if tok > 0 else 0.0
        assert lo - tol <= t <= float(cdf[tok]) + tol, f"row {b}: token {tok} is not at the threshold's boundary"


# 20000: three tiles. Under the emulator (4 SMs) batch 1 runs each request on 4 blocks, batch 2 on 2, larger
# batches on one block.
SHAPES = [(1, 1, 1), (3, 1, 7), (6, 4, 1000), (5, 3, 2111), (4, 16, 300), (8, 2, 20000), (2, 3, 20000), (1, 4, 5000)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_draft", [True, False], ids=["draft_probs", "point_drafts"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch,k,vocab", SHAPES)
def test_probs_match_reference(backend, with_draft, dtype, batch, k, vocab, gen):
    inp = make_chain_inputs(gen, batch, k, vocab, dtype, with_draft)
    greedy = torch.rand(batch, generator=gen) < 0.25
    out = run_probs(backend, inp, greedy)
    check_well_formed(out, k, inp["num_draft_tokens"], vocab)
    ref = reference.chain_speculative_sampling(inp["ids"], inp["target_probs"], inp["draft_probs"],
                                               num_draft_tokens=inp["num_draft_tokens"], greedy=greedy,
                                               seed=inp["seed"], offset=inp["offset"])
    u = reference.philox_uniform(inp["seed"], inp["offset"], 1, stream=1)[:, 0]
    assert_tokens_match_reference(out, ref, inp["target_probs"].float(),
                                  None if not with_draft else inp["draft_probs"].float(),
                                  inp["ids"], inp["num_draft_tokens"], u, max_boundary_rows=max(1, batch // 50))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_draft", [True, False], ids=["draft_logits", "point_drafts"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch,k,vocab", SHAPES)
def test_logits_match_reference(backend, with_draft, dtype, batch, k, vocab, gen):
    inp = make_chain_inputs(gen, batch, k, vocab, dtype, with_draft)
    temperature = torch.rand(batch, generator=gen) * 1.5 + 0.2
    temperature[torch.rand(batch, generator=gen) < 0.25] = 0.0
    out = run_logits(backend, inp, temperature)
    check_well_formed(out, k, inp["num_draft_tokens"], vocab)
    ref = reference.chain_speculative_sampling_from_logits(
        inp["ids"], inp["target_logits"], inp["draft_logits"], temperature=temperature,
        num_draft_tokens=inp["num_draft_tokens"], seed=inp["seed"], offset=inp["offset"])
    # The kernels' float32 softmax can flip a decision only where u * q is within rounding of p: allow a few.
    mismatched = (out.num_accepted != ref[1]).sum().item() + (out.output_token_ids != ref[0]).any(-1).sum().item()
    assert mismatched <= max(1, batch // 50), (out, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
@pytest.mark.parametrize("with_draft", [True, False], ids=["draft", "point"])
@pytest.mark.parametrize("batch,vocab", [(24, 2500), (16, 20000)], ids=["one_tile", "three_tiles"])
def test_cpu_kernel_and_emulated_cuda_kernel_agree_exactly(dtype, logits, with_draft, batch, vocab, gen, strict):
    # Both sum in the canonical order with the same exp, so even resampled tokens agree bit for bit. 20000 is a
    # multiple of 8 (16-byte loads on the GPU) and spans three tiles; 2500 is not (scalar loads); the misaligned
    # copy takes the scalar path with the same values and must give the same tokens.
    k = 4
    inp = make_chain_inputs(gen, batch, k, vocab, dtype, with_draft, sharpness=1.0)
    shifted = {key: misaligned_copy(val) if key.endswith(("probs", "logits")) else val for key, val in inp.items()}
    # Strict mode (the fixture): valid input, so the emulated kernel must not record an error either.
    cpu, emu, emu_shifted = run_all_backends(inp, shifted, logits, batch, gen)
    for out in (emu, emu_shifted):
        assert torch.equal(cpu.output_token_ids, out.output_token_ids)
        assert torch.equal(cpu.num_accepted, out.num_accepted)
    resampled = cpu.output_token_ids.gather(1, cpu.num_accepted.long()[:, None])[2:]
    assert bool((resampled >= 0).all())
    if vocab > 8192:  # the tile level of the search picked a later tile (fails with probability 0.41^14 < 4e-6)
        assert bool((resampled >= 8192).any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
@pytest.mark.parametrize("batch,slices", [(1, 4), (2, 2), (3, 1)])
def test_lanes_split_over_blocks_change_no_bit(dtype, logits, batch, slices, gen, strict):
    # The emulated device has 4 SMs, so the launcher splits each request's 1024 lanes over 4 blocks of 256 threads
    # at batch 1, over 2 blocks at batch 2, and runs one block of 1024 threads at batch 3 (sampling_slices). The
    # blocks of a request combine their lanes through global memory in a cooperative launch and keep 4 / 2 / 1
    # tiles of loads in flight; the tokens must be the CPU kernel's (every forced split: test_sampling_slices.py).
    # Several rounds, so that acceptance, residual and bonus sampling, and (round 0) greedy rows all occur; 20000
    # entries span three tiles. Round 1 also runs on misaligned rows (scalar loads); round 4 has p == q with
    # p(x) = q(x) = 0, whose residual has no mass, so the token is resampled from p after a search that found nothing.
    for round_ in range(5):
        inp = make_chain_inputs(gen, batch, 4, 20000, dtype, with_draft=round_ != 3, sharpness=1.0)
        inp["num_draft_tokens"][0] = 4
        if round_ == 4:
            inp["target_logits"][:, :, 7] = -math.inf
            inp["target_probs"][:, :, 7] = 0.0
            inp["draft_logits"], inp["draft_probs"] = inp["target_logits"][:, :4], inp["target_probs"][:, :4]
            inp["ids"][:, 0] = 7
        inputs = [inp, {key: misaligned_copy(val) if key.endswith(("probs", "logits")) else val
                        for key, val in inp.items()}] if round_ == 1 else [inp]
        if logits:
            t = torch.zeros(batch) if round_ == 0 else torch.rand(batch, generator=gen) + 0.3
            cpu, emus = run_logits("cpu", inp, t), [run_logits("sim", x, t) for x in inputs]
        else:
            greedy = torch.full((batch,), round_ == 0)
            cpu, emus = run_probs("cpu", inp, greedy), [run_probs("sim", x, greedy) for x in inputs]
        assert sim.last_launch() == {"blocks": batch * slices, "threads_per_block": 1024 // slices,
                                     "cluster_blocks": 1, "cooperative": slices > 1}
        if round_ == 4:
            assert bool((cpu.num_accepted == 0).all()) and bool((cpu.output_token_ids[:, 0] != 7).all())
        for emu in emus:
            assert torch.equal(cpu.output_token_ids, emu.output_token_ids), round_
            assert torch.equal(cpu.num_accepted, emu.num_accepted), round_


def run_all_backends(inp, shifted, logits, batch, gen):
    """The CPU kernel, the emulated CUDA kernel, and the emulated kernel on misaligned rows; rows 0 and 1 greedy."""
    if logits:
        t = torch.rand(batch, generator=gen) + 0.3
        t[:2] = 0.0  # two greedy rows: the argmax path
        cpu, emu, emu_shifted = run_logits("cpu", inp, t), run_logits("sim", inp, t), run_logits("sim", shifted, t)
    else:
        greedy = torch.arange(batch) < 2
        cpu, emu, emu_shifted = (run_probs("cpu", inp, greedy), run_probs("sim", inp, greedy),
                                 run_probs("sim", shifted, greedy))
    return cpu, emu, emu_shifted


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_rows_are_exact(backend, gen):
    batch, k, vocab = 40, 5, 257
    inp = make_chain_inputs(gen, batch, k, vocab)
    # Make some drafts equal the target argmax so greedy rows accept a prefix of varying length.
    argmax = inp["target_probs"].argmax(-1)[:, :k].int()
    keep = torch.rand(batch, k, generator=gen) < 0.7
    inp["ids"] = torch.where(keep, argmax, inp["ids"])
    out = run_probs(backend, inp, greedy=True)
    match = (inp["ids"] == argmax).int().cumprod(-1).sum(-1)
    want_acc = torch.minimum(match, inp["num_draft_tokens"])
    assert torch.equal(out.num_accepted, want_acc.int())
    full_argmax = inp["target_probs"].argmax(-1)
    for b in range(batch):
        a = int(want_acc[b])
        assert out.output_token_ids[b, :a].tolist() == inp["ids"][b, :a].tolist()
        assert int(out.output_token_ids[b, a]) == int(full_argmax[b, a])
    # Temperature 0 on the logits path is the same greedy rule on the logits.
    out_l = run_logits(backend, inp, 0.0)
    assert torch.equal(out_l.output_token_ids, out.output_token_ids)


@pytest.mark.parametrize("backend", BACKENDS)
def test_deterministic_and_batch_invariant(backend, gen):
    batch, k, vocab = 9, 3, 600
    inp = make_chain_inputs(gen, batch, k, vocab)
    first, again = run_probs(backend, inp), run_probs(backend, inp)
    assert torch.equal(first.output_token_ids, again.output_token_ids)
    perm = torch.randperm(batch, generator=gen)
    shuffled = {key: (v[perm] if isinstance(v, torch.Tensor) else v) for key, v in inp.items()}
    out = run_probs(backend, shuffled)
    assert torch.equal(out.output_token_ids, first.output_token_ids[perm])
    one = {key: (v[4:5] if isinstance(v, torch.Tensor) else v) for key, v in inp.items()}
    assert torch.equal(run_probs(backend, one).output_token_ids[0], first.output_token_ids[4])
    # A different offset (the next decode step) gives different uniforms.
    moved = dict(inp, offset=inp["offset"] + 1)
    assert not torch.equal(run_probs(backend, moved).output_token_ids, first.output_token_ids) or batch == 0


# ----- the law of the emitted tokens ---------------------------------------------------------------
def markov_case(gen, k, vocab):
    """Prefix-dependent target and draft: row i depends on the token before it (first-order tables)."""
    p0, q0 = dirichlet(gen, vocab), dirichlet(gen, vocab)
    p = [dirichlet(gen, vocab, vocab) for _ in range(k)]   # p[i][prev]: target at position i+1
    q = [dirichlet(gen, vocab, vocab) for _ in range(k - 1)]
    return p0, q0, p, q


def sample_round(gen, n, k, vocab, p0, q0, p, q):
    x = [torch.multinomial(q0.expand(n, vocab), 1, replacement=True, generator=gen).squeeze(-1)]
    for i in range(1, k):
        x.append(torch.multinomial(q[i - 1][x[-1]], 1, generator=gen).squeeze(-1))
    ids = torch.stack(x, -1)
    target = torch.stack([p0.expand(n, vocab)] + [p[i][ids[:, i]] for i in range(k)], 1)
    draft = torch.stack([q0.expand(n, vocab)] + [q[i - 1][ids[:, i - 1]] for i in range(1, k)], 1)
    return ids, target, draft


@pytest.mark.parametrize("backend,trials", [("cpu", 200_000), pytest.param("sim", 4_000, marks=pytest.mark.slow)])
def test_emitted_tokens_follow_the_target_at_every_position(backend, trials):
    # Fixed seed. Position 0 has `trials` samples; with V = 6 and p ~ 1/6, moving 1% of probability between two
    # tokens gives a noncentrality of trials * 2 * 0.01^2 / (1/6) = 0.0012 * trials: 240 on the CPU kernel (power
    # ~1 against the 1e-4 level, critical value ~26 at 5 dof); under the emulator (4,000 trials, each a block of
    # 1024 fibers) a 3% bias gives 43 (power 0.97; 0.92 at 3,500 trials, so no fewer). The emulated CUDA kernel's
    # outputs are also checked to equal the CPU kernel's bit for bit, so it inherits the CPU kernel's 1% power.
    gen = torch.Generator().manual_seed(1234)
    k, vocab = 3, 6
    p0, q0, p, q = markov_case(gen, k, vocab)
    ids, target, draft = sample_round(gen, trials, k, vocab, p0, q0, p, q)
    seed = torch.randint(-(2**63), 2**63 - 1, (trials,), generator=gen)
    out = BACKENDS[backend].chain_speculative_sampling(ids.int(), target.float(), draft.float(), seed=seed, offset=7)
    acc, toks = out.num_accepted.long(), out.output_token_ids.long()
    # Position 0: y0 ~ p0. Position i > 0 (reached when y_{i-1} was an accepted draft): y_i ~ p[i-1][y_{i-1}].
    pvalues = [chi_square_pvalue(torch.bincount(toks[:, 0], minlength=vocab).double().unsqueeze(0), p0.unsqueeze(0))[0]]
    for i in range(1, k + 1):
        reached = acc >= i
        counts = torch.zeros(vocab, vocab, dtype=torch.float64)
        counts.index_put_((toks[reached, i - 1], toks[reached, i]), torch.ones(int(reached.sum()), dtype=torch.float64),
                          accumulate=True)
        pvalues.append(chi_square_pvalue(counts, p[i - 1])[0])
    assert min(pvalues) > 1e-4, pvalues
    # Where drafts are point proposals (no draft probabilities), the law is the same.
    out = BACKENDS[backend].chain_speculative_sampling(ids.int(), target.float(), None, seed=seed, offset=8)
    pv0 = chi_square_pvalue(torch.bincount(out.output_token_ids[:, 0].long(), minlength=vocab).double().unsqueeze(0),
                            p0.unsqueeze(0))[0]
    assert pv0 > 1e-4


@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
def test_multi_round_sequences_follow_the_target_markov_chain(logits):
    # Sequences of length 8 decoded in rounds of K = 3 drafts from a first-order draft chain Q, verified against
    # a target chain P; ragged progress, offsets advancing per round. The 140,000 transitions y_{t-1} -> y_t
    # (20,000 sequences x 7) must follow P: a 1% shift of P's mass in one row (~1/V of the transitions, 20,000)
    # has noncentrality ~20,000 * 2e-4 * V = 20 at V = 5: detected at the 1e-4 level with power ~0.6 per row,
    # and a bias present in every row (a systematic error) with power ~1.
    gen = torch.Generator().manual_seed(99)
    n, k, vocab, length = 20_000, 3, 5, 8
    P, Q = dirichlet(gen, vocab, vocab, concentration=2.0), dirichlet(gen, vocab, vocab, concentration=2.0)
    start = torch.randint(0, vocab, (n,), generator=gen)
    # Each sequence's first length + 1 tokens, how many it has emitted (it runs on past length + 1 until every one
    # is that long) and its last token, which the next round drafts from.
    y = torch.zeros(n, length + 1, dtype=torch.long)
    y[:, 0], filled, last = start, torch.ones(n, dtype=torch.long), start
    seed = torch.randint(-(2**63), 2**63 - 1, (n,), generator=gen)
    temperature = 0.8
    for rnd in range(40):
        x = [torch.multinomial(Q[last], 1, generator=gen).squeeze(-1)]
        for _ in range(1, k):
            x.append(torch.multinomial(Q[x[-1]], 1, generator=gen).squeeze(-1))
        ids = torch.stack(x, -1)
        prev = torch.cat([last.unsqueeze(-1), ids], -1)  # the token before each position
        if logits:  # logits whose softmax at `temperature` is the chain
            out = specdec_ext.chain_speculative_sampling_from_logits(
                ids.int(), (P[prev].log() * temperature).float(), (Q[prev[:, :k]].log() * temperature).float(),
                temperature=temperature, seed=seed, offset=rnd)
        else:
            out = specdec_ext.chain_speculative_sampling(ids.int(), P[prev].float(), Q[prev[:, :k]].float(),
                                                         seed=seed, offset=rnd)
        tokens, accepted = out.output_token_ids.long(), out.num_accepted.long()
        position = filled.unsqueeze(-1) + torch.arange(k + 1)  # where each emitted token lands
        kept = (position <= accepted.unsqueeze(-1) + filled.unsqueeze(-1)) & (position <= length)
        y[kept.nonzero()[:, 0], position[kept]] = tokens[kept]
        last = tokens.gather(1, accepted.unsqueeze(-1)).squeeze(-1)
        filled += accepted + 1
        if int(filled.min()) > length:
            break
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    counts.index_put_((y[:, :-1].reshape(-1), y[:, 1:].reshape(-1)), torch.ones(n * length, dtype=torch.float64),
                      accumulate=True)
    pvalue, _ = chi_square_pvalue(counts, P)
    assert pvalue > 1e-4, pvalue


@pytest.mark.parametrize("backend,trials", [("cpu", 100_000), ("sim", 3_000)])
def test_mean_accepted_matches_leviathan(backend, trials):
    # Same p and q at every position: E[accepted] = sum_{i=1..K} alpha^i with alpha = sum_x min(p(x), q(x)).
    # 100,000 trials: standard error ~0.004, so a 1% error in the mean (~0.015) is > 3.5 standard errors
    # (emulator, 3,000 trials: a 6% error).
    gen = torch.Generator().manual_seed(7)
    k, vocab = 4, 50
    p, q = dirichlet(gen, vocab), dirichlet(gen, vocab)
    alpha = float(torch.minimum(p, q).sum())
    expected = sum(alpha**i for i in range(1, k + 1))
    ids = torch.multinomial(q.expand(trials, vocab), k, replacement=True, generator=gen).int()
    seed = torch.randint(-(2**63), 2**63 - 1, (trials,), generator=gen)
    out = BACKENDS[backend].chain_speculative_sampling(ids, p.float().expand(trials, k + 1, vocab).contiguous(),
                                                       q.float().expand(trials, k, vocab).contiguous(), seed=seed)
    acc = out.num_accepted.double()
    se = float(acc.std()) / math.sqrt(trials)
    assert abs(float(acc.mean()) - expected) < 4.5 * se, (float(acc.mean()), expected, se)


# ----- edge cases ----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_draft_probability_is_rejected(backend, gen):
    batch, k, vocab = 200, 2, 9
    inp = make_chain_inputs(gen, batch, k, vocab)
    q = inp["draft_probs"].clone()
    q.scatter_(-1, inp["ids"].long().unsqueeze(-1), 0.0)  # q(x) = 0 at every draft token
    out = BACKENDS[backend].chain_speculative_sampling(inp["ids"], inp["target_probs"], q, seed=inp["seed"])
    assert bool((out.num_accepted == 0).all())
    # The resampled token comes from max(0, p - q), so never from a token where q >= p.
    p0, q0 = inp["target_probs"][:, 0], q[:, 0]
    tok = out.output_token_ids[:, 0].long()
    assert bool((p0.gather(-1, tok[:, None]) > q0.gather(-1, tok[:, None])).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_p_equal_q_with_a_zero_probability_draft_falls_back_to_p(backend, gen):
    batch, k, vocab = 300, 1, 5
    p = dirichlet(gen, vocab).float()
    p[3] = 0.0
    p /= p.sum()
    ids = torch.full((batch, k), 3, dtype=torch.int32)
    target = p.expand(batch, k + 1, vocab).contiguous()
    out = BACKENDS[backend].chain_speculative_sampling(ids, target, target[:, :k].contiguous(),
                                                       seed=torch.arange(batch))
    # p(x) = q(x) = 0: rejected; max(0, p - q) = 0 everywhere, so the token is drawn from p.
    assert bool((out.num_accepted == 0).all())
    tok = out.output_token_ids[:, 0].long()
    assert bool((p[tok] > 0).all())
    assert len(set(tok.tolist())) > 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_hot_targets_are_reproduced(backend, gen):
    batch, k, vocab = 30, 4, 70
    truth = torch.randint(0, vocab, (batch, k + 1), generator=gen)
    target = torch.nn.functional.one_hot(truth, vocab).float()
    inp = make_chain_inputs(gen, batch, k, vocab)
    ids = torch.where(torch.rand(batch, k, generator=gen) < 0.6, truth[:, :k].int(), inp["ids"])
    out = BACKENDS[backend].chain_speculative_sampling(ids, target, inp["draft_probs"], seed=inp["seed"])
    for b in range(batch):
        a = int(out.num_accepted[b])
        assert out.output_token_ids[b, : a + 1].tolist() == truth[b, : a + 1].tolist()


@pytest.mark.parametrize("backend", BACKENDS)
def test_vocabulary_of_one_and_no_drafts(backend, gen):
    out = BACKENDS[backend].chain_speculative_sampling(torch.zeros(3, 2, dtype=torch.int32), torch.ones(3, 3, 1),
                                                       torch.ones(3, 2, 1), seed=5)
    assert out.output_token_ids.tolist() == [[0, 0, 0]] * 3 and out.num_accepted.tolist() == [2] * 3
    inp = make_chain_inputs(gen, 4, 3, 40)
    out = BACKENDS[backend].chain_speculative_sampling(inp["ids"], inp["target_probs"], inp["draft_probs"],
                                                       num_draft_tokens=0, seed=inp["seed"])
    assert out.num_accepted.tolist() == [0] * 4
    assert bool((out.output_token_ids[:, 1:] == -1).all()) and bool((out.output_token_ids[:, 0] >= 0).all())
    ref = reference.chain_speculative_sampling(inp["ids"], inp["target_probs"], inp["draft_probs"],
                                               num_draft_tokens=0, seed=inp["seed"])
    assert torch.equal(out.output_token_ids, ref[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_logits_are_never_emitted(backend, gen):
    batch, k, vocab = 50, 3, 300
    inp = make_chain_inputs(gen, batch, k, vocab)
    mask = torch.rand(batch, k + 1, vocab, generator=gen) < 0.5
    mask[..., 0] = False
    tl = inp["target_logits"].masked_fill(mask, float("-inf"))
    out = BACKENDS[backend].chain_speculative_sampling_from_logits(inp["ids"], tl, inp["draft_logits"],
                                                                   temperature=1.0, seed=inp["seed"])
    for b in range(batch):
        a = int(out.num_accepted[b])
        for i in range(a + 1):
            assert not mask[b, i, int(out.output_token_ids[b, i])]


# ----- arguments and errors ------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_generator_and_default_seed(backend, gen):
    inp = make_chain_inputs(gen, 5, 2, 50)
    f = BACKENDS[backend].chain_speculative_sampling
    a = f(inp["ids"], inp["target_probs"], inp["draft_probs"], generator=torch.Generator().manual_seed(3))
    b = f(inp["ids"], inp["target_probs"], inp["draft_probs"], generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.output_token_ids, b.output_token_ids)
    check_well_formed(f(inp["ids"], inp["target_probs"], inp["draft_probs"]), 2, torch.full((5,), 2), 50)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments_are_named(backend, gen):
    inp = make_chain_inputs(gen, 3, 2, 10)
    f = BACKENDS[backend].chain_speculative_sampling
    ids, tp, dp = inp["ids"], inp["target_probs"], inp["draft_probs"]
    with pytest.raises(ValueError, match="target_probs"):
        f(ids, tp[:, :2], dp, seed=1)
    with pytest.raises(ValueError, match="draft_probs"):
        f(ids, tp, dp.double(), seed=1)
    with pytest.raises(ValueError, match="draft_probs"):
        f(ids, tp, dp[:, :, :5], seed=1)
    with pytest.raises(ValueError, match="draft_token_ids"):
        f(ids.float(), tp, dp, seed=1)
    with pytest.raises(ValueError, match="at most 128 draft tokens"):
        f(torch.zeros(3, 129, dtype=torch.int32), torch.rand(3, 130, 10), None, seed=1)
    with pytest.raises(ValueError, match="K must be in"):  # the kernels' own check, past the wrapper
        NAMESPACES[backend].chain_speculative_sampling(
            torch.zeros(3, 129, dtype=torch.int32), torch.rand(3, 130, 10), None, torch.zeros(3, dtype=torch.int32),
            torch.zeros(3, dtype=torch.bool), torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64),
            torch.empty(3, 130, dtype=torch.int32), torch.empty(3, dtype=torch.int32), None)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        f(ids, tp, dp, num_draft_tokens=torch.ones(2, dtype=torch.int32), seed=1)
    with pytest.raises(ValueError, match="seed"):
        f(ids, tp, dp, seed=torch.ones(2, dtype=torch.long))
    with pytest.raises(ValueError, match="out"):
        f(ids, tp, dp, seed=1, out=(torch.empty(3, 3, dtype=torch.int32),))
    with pytest.raises(ValueError, match="output_token_ids"):
        f(ids, tp, dp, seed=1, out=(torch.empty(3, 2, dtype=torch.int32), torch.empty(3, dtype=torch.int32)))
    with pytest.raises(ValueError, match=r"last \(vocabulary\) dimension"):
        f(ids, tp.transpose(1, 2).contiguous().transpose(1, 2), dp, seed=1)
    with pytest.raises(ValueError, match="temperature"):
        BACKENDS[backend].chain_speculative_sampling_from_logits(ids, inp["target_logits"], None, temperature=-1.0)


def test_invalid_values_raise_on_cpu(gen):
    inp = make_chain_inputs(gen, 3, 2, 10)
    f = specdec_ext.chain_speculative_sampling
    bad_ids = inp["ids"].clone()
    bad_ids[1, 0] = 10
    with pytest.raises(ValueError, match="draft_token_ids holds ids outside"):
        f(bad_ids, inp["target_probs"], inp["draft_probs"], seed=1)
    nan_target = inp["target_probs"].clone()
    nan_target[0, 0, :] = float("nan")
    with pytest.raises(ValueError, match="target_probs holds NaN"):
        f(inp["ids"], nan_target, inp["draft_probs"], seed=1)
    with pytest.raises(ValueError, match="num_draft_tokens holds values outside"):
        f(inp["ids"], inp["target_probs"], inp["draft_probs"], num_draft_tokens=3, seed=1)
    nan_logits = inp["target_logits"].clone()
    nan_logits[2, 0, 3] = float("nan")
    with pytest.raises(ValueError, match="target_logits holds NaN"):
        specdec_ext.chain_speculative_sampling_from_logits(inp["ids"], nan_logits, None, temperature=1.0, seed=1)


@pytest.mark.parametrize("batch", [4, 1], ids=["one_block", "four_blocks"])
def test_device_side_checks_under_the_emulator(batch, gen):
    # Like CUDA: no host sync by default (a defined, in-range output), a ValueError in strict mode. At batch 1
    # the request's lanes are split over 4 blocks, which all record the errors.
    inp = make_chain_inputs(gen, batch, 3, 40)
    tp = inp["target_probs"].clone()
    tp[batch // 4, :, :] = float("nan")
    ids = inp["ids"].clone()
    ids[batch // 2, 0] = -5
    out = sim.chain_speculative_sampling(ids, tp, inp["draft_probs"], seed=inp["seed"])
    # The all-NaN request's rows have no mass to sample: its last token is -1 (README); the others are in range.
    nan_request = batch // 4
    others = [b for b in range(batch) if b != nan_request]
    check_well_formed((out.output_token_ids[others], out.num_accepted[others]), 3, torch.full((len(others),), 3), 40)
    assert out.output_token_ids[nan_request, int(out.num_accepted[nan_request])] == -1
    specdec_ext.set_strict(True)
    try:
        with pytest.raises(ValueError, match="target_probs holds NaN or inf.*draft_token_ids holds ids outside"):
            sim.chain_speculative_sampling(ids, tp, inp["draft_probs"], seed=inp["seed"])
        ok = sim.chain_speculative_sampling(inp["ids"], inp["target_probs"], inp["draft_probs"], seed=inp["seed"])
        check_well_formed(ok, 3, torch.full((batch,), 3), 40)
    finally:
        specdec_ext.set_strict(False)


@pytest.mark.parametrize("backend", NAMESPACES)
@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
def test_opcheck(backend, logits, gen):
    batch, k, vocab = 3, 2, 33
    inp = make_chain_inputs(gen, batch, k, vocab, torch.bfloat16)
    control = torch.tensor([0.0, 1.0, 0.7]) if logits else torch.tensor([True, False, False])
    ns = NAMESPACES[backend]
    fn = ns.chain_speculative_sampling_from_logits if logits else ns.chain_speculative_sampling
    target = inp["target_logits"] if logits else inp["target_probs"]
    draft = inp["draft_logits"] if logits else inp["draft_probs"]
    out_ids, out_acc = poisoned_out(batch, k)
    torch.library.opcheck(fn.default, (inp["ids"], target, draft, inp["num_draft_tokens"], control, inp["seed"],
                                       inp["offset"], out_ids, out_acc, None))


def test_traces_under_torch_compile(gen):
    inp = make_chain_inputs(gen, 4, 3, 64)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(ids, target, draft, seed):
        out = specdec_ext.chain_speculative_sampling(ids, target, draft, seed=seed, offset=0)
        return out.output_token_ids, out.num_accepted + 1

    ids, emitted = step(inp["ids"], inp["target_probs"], inp["draft_probs"], inp["seed"])
    eager = specdec_ext.chain_speculative_sampling(inp["ids"], inp["target_probs"], inp["draft_probs"],
                                                   seed=inp["seed"], offset=0)
    assert torch.equal(ids, eager.output_token_ids) and torch.equal(emitted, eager.num_accepted + 1)


@pytest.mark.parametrize("backend", [specdec_ext, sim], ids=["cpu", "emulator"])
def test_sample_without_drafts_is_the_chain_ops_bonus_token(backend):
    """sample_without_drafts draws exactly the bonus token of the chain op with K = 1 and no draft, row for row,
    with temperatures, top-k and top-p per row, in both couplings."""
    g = torch.Generator().manual_seed(11)
    batch, vocab = 64, 50
    logits = torch.randn(batch, vocab, generator=g) * 3
    temperature = torch.rand(batch, generator=g) * 1.5
    temperature[::7] = 0.0
    top_k = torch.randint(0, 10, (batch,), generator=g, dtype=torch.int32)
    top_p = torch.rand(batch, generator=g) * 0.5 + 0.5
    seed = torch.randint(0, 2**40, (batch,), generator=g)
    offset = torch.randint(0, 1000, (batch,), generator=g)
    for coupling in ("rejection", "gumbel"):
        ours = backend.sample_without_drafts(logits, temperature=temperature, seed=seed, offset=offset,
                                             coupling=coupling, top_k=top_k, top_p=top_p)
        chain = backend.chain_speculative_sampling_from_logits(
            torch.full((batch, 1), 3, dtype=torch.int64), logits.unsqueeze(1).repeat(1, 2, 1), temperature=temperature,
            num_draft_tokens=torch.zeros(batch, dtype=torch.int32), seed=seed, offset=offset, coupling=coupling,
            top_k=top_k, top_p=top_p)
        assert ours.dtype == torch.int32 and ours.shape == (batch,)
        assert torch.equal(ours, chain.output_token_ids[:, 0])
    greedy = backend.sample_without_drafts(logits, temperature=0.0, seed=0, offset=0)
    assert torch.equal(greedy.long(), logits.argmax(-1))


def test_sample_without_drafts_follows_softmax():
    """200,000 draws (one row per Philox counter) of softmax(logits / 0.8) over 8 tokens: Pearson chi-square
    against the float64 law at p < 1e-3. Power: one percentage point of probability moved between any two tokens
    (the likeliest, 0.464, and another) gives noncentrality at least 190 on 7 degrees of freedom, caught with
    probability above 0.999. (The row-for-row identity with the chain op above is the exact check.)"""
    draws, temperature = 200_000, 0.8
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.0, 0.7, 1.3])
    tokens = specdec_ext.sample_without_drafts(logits.expand(draws, 8), temperature=temperature, seed=2024,
                                               offset=torch.arange(draws))
    counts = torch.bincount(tokens.long(), minlength=8).double()
    law = torch.softmax(logits.double() / temperature, -1)
    assert chi_square_pvalue(counts.unsqueeze(0), law.unsqueeze(0))[0] > 1e-3
