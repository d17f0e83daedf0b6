"""coupling="gumbel" of the sampling ops and gumbel_sample: every row's token is the Gumbel-max sample with the noise of
its position, bit for bit the same on the CPU kernel and the CUDA kernel under the emulator; drafts are accepted when
they equal it; the law of gumbel_sample is the target's."""
import pytest
import torch

import specdec_ext
from helpers.chi_square import chi_square_pvalue
from helpers.sampling_inputs import make_chain_inputs, make_tree_inputs, padded_and_flat_trees
from specdec_ext import reference, sim

BACKENDS = {"cpu": specdec_ext, "sim": sim}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# V: one lane block, not a multiple of 8, several tiles of 8192 (the CUDA kernel's canonical lanes).
VOCABS = [8, 1001, 20000]


def chain(backend, inp, logits, temperature_or_greedy, **kw):
    ops = BACKENDS[backend]
    common = dict(num_draft_tokens=inp["num_draft_tokens"], seed=inp["seed"], offset=inp["offset"], coupling="gumbel",
                  **kw)
    if logits:
        return ops.chain_speculative_sampling_from_logits(inp["ids"], inp["target_logits"],
                                                          temperature=temperature_or_greedy, **common)
    return ops.chain_speculative_sampling(inp["ids"], inp["target_probs"], greedy=temperature_or_greedy, **common)


def temperatures(gen, batch):
    t = torch.rand(batch, generator=gen) * 1.5 + 0.2
    t[0] = 0.0  # a greedy row among sampled ones
    return t


def follow_the_target(backend, inp, logits, control, gen, share=0.8):
    """Makes drafts agree with the target: position by position, the first draft that differs from the row's token is
    replaced by it with probability `share`, so that requests accept runs of every length up to their count."""
    k = inp["ids"].shape[1]
    for _ in range(k):
        out = chain(backend, inp, logits, control)
        rows = torch.arange(inp["ids"].shape[0])
        at = out.num_accepted.long()
        take = (at < inp["num_draft_tokens"].long()) & (torch.rand(at.shape, generator=gen) < share)
        inp["ids"][rows[take], at[take]] = out.output_token_ids[rows[take], at[take]].to(inp["ids"].dtype)


def row_tokens(backend, rows, temperature, seed, positions):
    """gumbel_sample of each row [B, V] at its position."""
    return BACKENDS[backend].gumbel_sample(rows, temperature=temperature, seed=seed, positions=positions)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chain_emits_the_rows_gumbel_tokens(backend, vocab, dtype, gen):
    # Whatever the drafts: the output is each row's own gumbel_sample token at position offset + i, drafts kept while
    # they equal it. Half the drafts are set to those tokens, so that long accepted runs happen.
    batch, k = 9, 5
    inp = make_chain_inputs(gen, batch, k, vocab, dtype, with_draft=False)
    t = temperatures(gen, batch)
    rows = inp["target_logits"]
    expected = torch.stack([row_tokens(backend, rows[:, i], t, inp["seed"], inp["offset"] + i) for i in range(k + 1)],
                           1)
    lucky = torch.rand(batch, k, generator=gen) < 0.8
    lucky[2] = True  # row 2 accepts all k drafts, row 1 none
    inp["num_draft_tokens"][1:3] = k
    inp["ids"] = torch.where(lucky, expected[:, :k], inp["ids"])
    inp["ids"][1, 0] = (expected[1, 0] + 1) % vocab
    out = chain(backend, inp, True, t)
    for b in range(batch):
        n = int(inp["num_draft_tokens"][b])
        a = 0
        while a < n and int(inp["ids"][b, a]) == int(expected[b, a]):
            a += 1
        assert int(out.num_accepted[b]) == a
        assert out.output_token_ids[b, :a + 1].tolist() == expected[b, :a + 1].tolist()
        assert (out.output_token_ids[b, a + 1:] == -1).all()
    assert int(out.num_accepted[1]) == 0 and int(out.num_accepted[2]) == k


@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_equals_emulator_bit_for_bit(logits, vocab, dtype, gen):
    batch, k = 16, 4
    inp = make_chain_inputs(gen, batch, k, vocab, dtype, with_draft=False, sharpness=1.0)
    control = temperatures(gen, batch) if logits else torch.arange(batch) % 5 == 0
    follow_the_target("cpu", inp, logits, control, gen)  # both backends walk past several positions
    cpu, emulated = chain("cpu", inp, logits, control), chain("sim", inp, logits, control)
    assert torch.equal(cpu.output_token_ids, emulated.output_token_ids)
    assert torch.equal(cpu.num_accepted, emulated.num_accepted)
    if logits:
        t = control
        rows = inp["target_logits"][:, 0]
        assert torch.equal(specdec_ext.gumbel_sample(rows, temperature=t, seed=inp["seed"], positions=inp["offset"]),
                           sim.gumbel_sample(rows, temperature=t, seed=inp["seed"], positions=inp["offset"]))


@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
def test_kernel_matches_the_float64_reference(logits, gen):
    # The reference's keys are float64 ln p + noise: the kernels' float32 base-2 keys pick another token only where
    # two keys are within rounding (a relative 1e-6): none in 4096 rows of 3000 tokens is expected.
    batch, k, vocab = 512, 7, 3000
    inp = make_chain_inputs(gen, batch, k, vocab, with_draft=False)
    control = temperatures(gen, batch) if logits else torch.arange(batch) % 7 == 0
    follow_the_target("cpu", inp, logits, control, gen)
    out = chain("cpu", inp, logits, control)
    common = dict(num_draft_tokens=inp["num_draft_tokens"], seed=inp["seed"], offset=inp["offset"], coupling="gumbel")
    if logits:
        ref = reference.chain_speculative_sampling_from_logits(inp["ids"], inp["target_logits"], temperature=control,
                                                               **common)
    else:
        ref = reference.chain_speculative_sampling(inp["ids"], inp["target_probs"], greedy=control, **common)
    # A near tie falls either way with probability ~4e-6 per decision: ~0.02 of the 4096 here differ on average, so
    # two requests are allowed (three or more: probability 1e-6).
    differ = (out.num_accepted != ref[1]) | (out.output_token_ids != ref[0]).any(-1)
    assert int(differ.sum()) <= 2, differ.nonzero().flatten().tolist()
    assert int(out.num_accepted.sum()) > batch  # the walk went past the first position
    rows = inp["target_logits"][:, 0]
    t = temperatures(gen, batch)
    drawn = specdec_ext.gumbel_sample(rows, temperature=t, seed=inp["seed"], positions=inp["offset"])
    assert int((drawn != reference.gumbel_sample(rows, temperature=t, seed=inp["seed"],
                                                 positions=inp["offset"])).sum()) <= 2


def test_noise_is_keyed_by_seed_and_position_only():
    # The same (seed, position) gives the same token for any batch and row index; another position or seed, another
    # token (with 1000 equally likely tokens, 64 draws all agreeing by chance has probability 1e-192).
    vocab, n = 1000, 64
    logits = torch.zeros(n, vocab)
    seeds, positions = torch.full((n,), 7), torch.arange(n) * 3
    tokens = specdec_ext.gumbel_sample(logits, temperature=1.0, seed=seeds, positions=positions)
    for i in (0, 17, 63):
        alone = specdec_ext.gumbel_sample(logits[:1], temperature=1.0, seed=7, positions=int(positions[i]))
        assert int(alone) == int(tokens[i])
    assert not torch.equal(tokens, specdec_ext.gumbel_sample(logits, temperature=1.0, seed=seeds,
                                                             positions=positions + 1))
    assert not torch.equal(tokens, specdec_ext.gumbel_sample(logits, temperature=1.0, seed=seeds + 1,
                                                             positions=positions))
    assert len(set(tokens.tolist())) > n // 2  # the positions' noises are independent


def test_gumbel_sample_law():
    # 2^20 draws of one distribution over 16 tokens, one position each. Power: moving 1% of a 0.25 cell's mass to
    # another (a 1% bias) gives a chi-square noncentrality of 52 on 15 degrees of freedom, found at p < 1e-4 with
    # probability 0.93. Fixed seed.
    n, vocab = 1 << 20, 16
    logits = torch.log(torch.tensor([0.25, 0.25, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05] + [0.0125] * 8))
    temperature = 0.8
    p = torch.softmax(logits.double() / temperature, -1)
    tokens = specdec_ext.gumbel_sample(logits.expand(n, vocab), temperature=temperature, seed=2024,
                                       positions=torch.arange(n))
    counts = torch.bincount(tokens.long(), minlength=vocab).double()
    pvalue, _ = chi_square_pvalue(counts.unsqueeze(0), p.unsqueeze(0))
    assert pvalue > 1e-4, (pvalue, (counts / n).tolist(), p.tolist())


def test_gumbel_sample_masks_and_greedy():
    # -inf (top-k / top-p masks) never wins; temperature 0 is the argmax (ties to the lowest id); a row with no mass
    # gives -1.
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 500, generator=gen)
    keep = logits.topk(3, -1).indices
    masked = torch.full_like(logits, float("-inf")).scatter(-1, keep, logits.gather(-1, keep))
    tokens = specdec_ext.gumbel_sample(masked, temperature=2.0, seed=1, positions=torch.arange(64))
    assert (tokens.long().unsqueeze(-1) == keep).any(-1).all()
    assert (tokens != logits.argmax(-1)).any()  # not always the argmax at temperature 2
    tied = torch.zeros(2, 10)
    tied[:, 3] = tied[:, 7] = 1.0
    assert specdec_ext.gumbel_sample(tied, temperature=0.0, seed=1, positions=0).tolist() == [3, 3]
    empty = torch.full((1, 10), float("-inf"))
    with pytest.raises(ValueError, match="no mass"):
        specdec_ext.gumbel_sample(empty, temperature=1.0, seed=1, positions=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gumbel_sample_errors_name_its_own_arguments(backend):
    """gumbel_sample runs on the chain op, but its errors speak of gumbel_sample, logits and positions."""
    ops = BACKENDS[backend]
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(5))
    cases = [(dict(positions=torch.zeros(4, dtype=torch.int64)), r"gumbel_sample: positions has 4 entries for a batch "
                                                                 r"of 3"),
             (dict(positions=torch.zeros(3)), r"gumbel_sample: positions"),
             (dict(seed=torch.zeros(2, dtype=torch.int64)), r"gumbel_sample: seed"),
             (dict(temperature=-1.0), r"gumbel_sample: temperature must be finite and >= 0"),
             (dict(top_p=torch.tensor([0.5, 1.5, 0.5])), r"gumbel_sample: top_p must be .*top_p\[1\]"),
             (dict(logits=torch.full((3, 20), float("nan"))), r"gumbel_sample: .*logits holds NaN")]
    for change, message in cases:
        kwargs = {"logits": logits, "temperature": 1.0, "seed": 1, "positions": 0, **change}
        with pytest.raises(ValueError, match=message) as e:
            if backend == "sim":
                specdec_ext.set_strict(True)
            try:
                ops.gumbel_sample(kwargs.pop("logits"), **kwargs)
            finally:
                specdec_ext.set_strict(False)
        assert "chain_speculative_sampling" not in str(e.value) and "offset" not in str(e.value) and \
            "target_logits" not in str(e.value)
    with pytest.raises(ValueError, match="gumbel_sample: logits must be float32, bfloat16 or float16"):
        ops.gumbel_sample(logits.double(), temperature=1.0, seed=1, positions=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
def test_tree_follows_the_gumbel_token_of_each_depth(backend, logits, gen):
    # Node n decides with the token of position offset + depth(n): the walk goes to the child carrying it, else
    # emits it. Checked against the float64 reference and, for the path, against gumbel_sample row by row.
    batch, n, vocab = 12, 24, 40
    inp = make_tree_inputs(gen, batch, n, vocab, with_draft=False, branching=4, depth=5, sharpness=1.0)
    control = temperatures(gen, batch) if logits else torch.arange(batch) % 6 == 0
    ops = BACKENDS[backend]
    common = dict(num_nodes=inp["num_nodes"], seed=inp["seed"], offset=inp["offset"], coupling="gumbel")
    if logits:
        out = ops.tree_speculative_sampling_from_logits(inp["parents"], inp["tokens"], inp["target_logits"],
                                                        temperature=control, **common)
        ref = reference.tree_speculative_sampling_from_logits(inp["parents"], inp["tokens"], inp["target_logits"],
                                                              temperature=control, **common)
    else:
        out = ops.tree_speculative_sampling(inp["parents"], inp["tokens"], inp["target_probs"], greedy=control,
                                            **common)
        ref = reference.tree_speculative_sampling(inp["parents"], inp["tokens"], inp["target_probs"], greedy=control,
                                                  **common)
    assert torch.equal(out.output_token_ids, ref[0]) and torch.equal(out.accepted_nodes, ref[1])
    assert torch.equal(out.num_accepted, ref[2])
    if logits:
        for b in range(batch):
            depth = int(out.num_accepted[b])
            for d in range(depth + 1):
                node = int(out.accepted_nodes[b, d])
                token = ops.gumbel_sample(inp["target_logits"][b, node].unsqueeze(0), temperature=control[b:b + 1],
                                          seed=inp["seed"][b:b + 1], positions=inp["offset"][b:b + 1] + d)
                assert int(out.output_token_ids[b, d]) == int(token)


@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
def test_a_chain_shaped_tree_is_the_chain(logits, gen):
    batch, k, vocab = 10, 6, 300
    inp = make_chain_inputs(gen, batch, k, vocab, with_draft=False, sharpness=0.5)
    control = temperatures(gen, batch) if logits else torch.arange(batch) % 4 == 0
    inp["num_draft_tokens"] = torch.full((batch,), k, dtype=torch.int32)
    follow_the_target("cpu", inp, logits, control, gen)
    for _ in range(k):  # row 0's drafts become its own tokens, one position per call: it accepts all k
        ch = chain("cpu", inp, logits, control)
        a = int(ch.num_accepted[0])
        if a < k:
            inp["ids"][0, a] = ch.output_token_ids[0, a]
    ch = chain("cpu", inp, logits, control)
    parents = torch.arange(-1, k, dtype=torch.int32).expand(batch, k + 1).contiguous()
    tokens = torch.cat([torch.zeros(batch, 1, dtype=torch.int32), inp["ids"]], 1)
    common = dict(seed=inp["seed"], offset=inp["offset"], coupling="gumbel")
    if logits:
        tree = specdec_ext.tree_speculative_sampling_from_logits(parents, tokens, inp["target_logits"],
                                                                 temperature=control, **common)
    else:
        tree = specdec_ext.tree_speculative_sampling(parents, tokens, inp["target_probs"], greedy=control, **common)
    assert torch.equal(tree.num_accepted, ch.num_accepted)
    assert torch.equal(tree.output_token_ids, ch.output_token_ids)
    assert int(ch.num_accepted[0]) == k


def test_flat_form_equals_padded(gen):
    batch, k, vocab = 6, 4, 700
    inp = make_chain_inputs(gen, batch, k, vocab, with_draft=False)
    t = temperatures(gen, batch)
    padded = chain("cpu", inp, True, t)
    counts = inp["num_draft_tokens"].long()
    cu = counts.cumsum(0).int()
    ids = torch.cat([inp["ids"][b, :int(counts[b])] for b in range(batch)])
    rows = torch.cat([inp["target_logits"][b, :int(counts[b]) + 1] for b in range(batch)])
    flat = specdec_ext.chain_speculative_sampling_from_logits(ids, rows, temperature=t, cu_num_draft_tokens=cu,
                                                              max_draft_tokens=k, seed=inp["seed"],
                                                              offset=inp["offset"],
                                                              coupling="gumbel")
    assert torch.equal(flat.output_token_ids, padded.output_token_ids)
    assert torch.equal(flat.num_accepted, padded.num_accepted)


@pytest.mark.parametrize("backend", BACKENDS)
def test_flat_trees_equal_padded(backend, gen):
    batch, n, vocab = 7, 12, 500
    ops = BACKENDS[backend]

    def flat_and_padded(g):
        padded, flat = padded_and_flat_trees(g, batch, n, vocab)
        # Temperatures up to 0.85: each node's favoured child then carries most of the mass (its logit is 9 above
        # the row's noise).
        t = temperatures(g, batch) * 0.5
        seed, offset = torch.randint(0, 2**62, (batch,), generator=g), torch.randint(0, 2**40, (batch,), generator=g)
        common = dict(temperature=t, seed=seed, offset=offset, coupling="gumbel")
        a = ops.tree_speculative_sampling_from_logits(padded["parents"], padded["cand"], padded["target_logits"],
                                                      num_nodes=padded["num_nodes"], **common)
        b = ops.tree_speculative_sampling_from_logits(flat["parents"], flat["cand"], flat["target_logits"],
                                                      cu_num_draft_tokens=flat["cu"], max_draft_tokens=n - 1, **common)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        return a

    flat_and_padded(gen)  # the run's inputs
    # Inputs of a fixed seed on which paths go deep (each node's first child is favoured), so the comparison covers
    # accepted paths whatever the run seed (two runs of random inputs found every path at most one deep).
    assert int(flat_and_padded(torch.Generator().manual_seed(24)).num_accepted.max()) >= 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_coupling_arguments_name_themselves(backend, gen):
    ops = BACKENDS[backend]
    inp = make_chain_inputs(gen, 2, 3, 50)
    base = dict(temperature=1.0, seed=1, offset=0)
    with pytest.raises(ValueError, match="coupling must be one of"):
        ops.chain_speculative_sampling_from_logits(inp["ids"], inp["target_logits"], coupling="gumble", **base)
    with pytest.raises(ValueError, match="draft_logits=None"):
        ops.chain_speculative_sampling_from_logits(inp["ids"], inp["target_logits"], inp["draft_logits"],
                                                   coupling="gumbel", **base)
    with pytest.raises(ValueError, match="uniforms must be None"):
        ops.chain_speculative_sampling_from_logits(inp["ids"], inp["target_logits"], coupling="gumbel",
                                                   uniforms=torch.full((2, 3), 0.5), **base)
    with pytest.raises(ValueError, match="final_uniforms must be None"):
        ops.chain_speculative_sampling(inp["ids"], inp["target_probs"], coupling="gumbel", seed=1,
                                       final_uniforms=torch.full((2,), 0.5))
    tree = make_tree_inputs(gen, 2, 5, 50)
    with pytest.raises(ValueError, match="draft_probs=None"):
        ops.tree_speculative_sampling(tree["parents"], tree["tokens"], tree["target_probs"], tree["draft_probs"],
                                      seed=1, coupling="gumbel")
    # The op itself (an engine calling torch.ops directly) checks too.
    namespace = torch.ops.specdec if backend == "cpu" else torch.ops.specdec_sim
    out = (torch.empty(2, 4, dtype=torch.int32), torch.empty(2, dtype=torch.int32))
    args = (inp["ids"], inp["target_logits"], None, torch.full((2,), 3, dtype=torch.int32), torch.ones(2),
            torch.ones(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), *out, None)
    with pytest.raises((ValueError, RuntimeError), match="coupling must be"):
        namespace.chain_speculative_sampling_from_logits(*args, coupling="other")
    with pytest.raises((ValueError, RuntimeError), match="reads no draft rows"):
        namespace.chain_speculative_sampling_from_logits(inp["ids"], inp["target_logits"], inp["draft_logits"],
                                                         *args[3:], coupling="gumbel")
