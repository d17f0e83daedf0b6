"""tree_speculative_sampling(_from_logits): the CPU kernel and the CUDA kernel under the emulator, against the
reference and the chain op, the law of the emitted tokens on trees, and malformed trees."""
import math

import pytest
import torch

import specdec_ext
from helpers.chi_square import chi_square_pvalue
from helpers.sampling_inputs import dirichlet, make_tree_inputs, misaligned_copy
from specdec_ext import reference, sim

BACKENDS = {"cpu": specdec_ext, "sim": sim}
NAMESPACES = {"cpu": torch.ops.specdec, "sim": torch.ops.specdec_sim}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def poisoned_out(batch, n):
    return tuple(torch.full(shape, -77, dtype=torch.int32) for shape in ((batch, n), (batch, n), (batch,)))


def run(backend, inp, logits, control, **kw):
    args = (inp["parents"], inp["tokens"])
    common = dict(num_nodes=inp["num_nodes"], seed=inp["seed"], offset=inp["offset"],
                  out=poisoned_out(*inp["parents"].shape), **kw)
    if logits:
        return BACKENDS[backend].tree_speculative_sampling_from_logits(*args, inp["target_logits"], inp["draft_logits"],
                                                                       temperature=control, **common)
    return BACKENDS[backend].tree_speculative_sampling(*args, inp["target_probs"], inp["draft_probs"], greedy=control,
                                                       **common)


def run_reference(inp, logits, control):
    args = (inp["parents"], inp["tokens"])
    common = dict(num_nodes=inp["num_nodes"], seed=inp["seed"], offset=inp["offset"])
    if logits:
        return reference.tree_speculative_sampling_from_logits(*args, inp["target_logits"], inp["draft_logits"],
                                                               temperature=control, **common)
    return reference.tree_speculative_sampling(*args, inp["target_probs"], inp["draft_probs"], greedy=control, **common)


def check_well_formed(out, inp, vocab):
    """The path starts at the root and goes from parent to child inside the tree, its tokens are the nodes',
    the last token is in range, and everything after is -1 (every element written)."""
    tokens, nodes, acc = out
    parents = inp["parents"]
    for b in range(parents.shape[0]):
        a = int(acc[b])
        assert 0 <= a < int(inp["num_nodes"][b])
        path = nodes[b, :a + 1].tolist()
        assert path[0] == 0 and all(int(parents[b, c]) == p for p, c in zip(path, path[1:]))
        assert tokens[b, :a].tolist() == [int(inp["tokens"][b, c]) for c in path[1:]]
        assert 0 <= int(tokens[b, a]) < vocab
        assert bool((nodes[b, a + 1:] == -1).all()) and bool((tokens[b, a + 1:] == -1).all())


SHAPES = [(1, 1, 5), (3, 5, 7), (6, 16, 1000), (5, 33, 2111), (4, 64, 300), (8, 12, 20000)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_draft", [True, False], ids=["sampled", "point"])
@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
@pytest.mark.parametrize("batch,n,vocab", SHAPES)
def test_matches_reference(backend, with_draft, logits, batch, n, vocab, gen):
    inp = make_tree_inputs(gen, batch, n, vocab, with_draft=with_draft)
    if logits:
        control = torch.rand(batch, generator=gen) * 1.5 + 0.2
        control[torch.rand(batch, generator=gen) < 0.25] = 0.0
    else:
        control = torch.rand(batch, generator=gen) < 0.25
    out = run(backend, inp, logits, control)
    check_well_formed(out, inp, vocab)
    ref = run_reference(inp, logits, control)
    # Decisions agree exactly on probabilities (the kernel's float32 normalisers can flip one only where u * q is
    # within rounding of r); from logits, the float32 softmax may flip a rare one. The last token may differ
    # where its threshold is within rounding of a CDF boundary.
    decisions = (out.accepted_nodes != ref[1]).any(-1).sum().item()
    last = (out.output_token_ids != ref[0]).any(-1).sum().item()
    assert decisions <= (max(1, batch // 50) if logits else 0), (out, ref)
    assert last <= max(1, batch // 50), (out, ref)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_draft", [True, False], ids=["sampled", "point"])
@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
def test_a_chain_shaped_tree_is_the_chain_op(backend, with_draft, logits, gen):
    # Node i + 1 is draft i, its draft row the chain's row i, its uniform the chain's: the same tokens, bit for bit.
    batch, k, vocab = 12, 5, 3000
    base = torch.randn(batch, k + 1, vocab, generator=gen) * 2
    draft = base[:, :k] + 0.7 * torch.randn(batch, k, vocab, generator=gen)
    ids = torch.multinomial(torch.softmax(draft, -1).reshape(-1, vocab), 1, generator=gen).reshape(batch, k).int()
    for rows in (base[:, :k], draft):  # p(x) and q(x) around 1/2: some drafts accepted, some rejected
        rows.scatter_(-1, ids.long().unsqueeze(-1), (rows.logsumexp(-1) + torch.randn(batch, k,
                                                                                      generator=gen)).unsqueeze(-1))
    # Whatever the draws: row 1 rejects its first draft (p(x) = 0), row 2 accepts all (p(x) = q(x) = 1).
    base[1, 0, ids[1, 0]] = -1e4
    base[2, torch.arange(k), ids[2].long()] = 1e4
    draft[2, torch.arange(k), ids[2].long()] = 1e4
    seed = torch.randint(-(2**63), 2**63 - 1, (batch,), generator=gen)
    parents = torch.arange(-1, k, dtype=torch.int32).expand(batch, k + 1).contiguous()
    tokens = torch.cat([torch.zeros(batch, 1, dtype=torch.int32), ids], 1)
    tree_draft = torch.cat([draft, torch.full((batch, 1, vocab), float("nan"))], 1)  # a leaf's row is never read
    ops = BACKENDS[backend]
    if logits:
        t = torch.rand(batch, generator=gen) + 0.3
        t[0] = 0.0
        chain = ops.chain_speculative_sampling_from_logits(ids, base, draft if with_draft else None, temperature=t,
                                                           seed=seed, offset=9)
        tree = ops.tree_speculative_sampling_from_logits(parents, tokens, base, tree_draft if with_draft else None,
                                                         temperature=t, seed=seed, offset=9)
    else:
        greedy = torch.arange(batch) == 0
        p, q = torch.softmax(base, -1), torch.softmax(draft, -1)
        chain = ops.chain_speculative_sampling(ids, p, q if with_draft else None, greedy=greedy, seed=seed, offset=9)
        tree_q = torch.cat([q, torch.full((batch, 1, vocab), float("nan"))], 1)
        tree = ops.tree_speculative_sampling(parents, tokens, p, tree_q if with_draft else None, greedy=greedy,
                                             seed=seed, offset=9)
    assert torch.equal(tree.num_accepted, chain.num_accepted)
    assert torch.equal(tree.output_token_ids[:, :k + 1], chain.output_token_ids)
    acc = chain.num_accepted.long().unsqueeze(-1)
    positions = torch.arange(k + 1)
    assert torch.equal(tree.accepted_nodes, torch.where(positions <= acc, positions, -1).int())
    assert int(chain.num_accepted[1]) == 0 and int(chain.num_accepted[2]) == k  # the planted rows


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
@pytest.mark.parametrize("with_draft", [True, False], ids=["sampled", "point"])
@pytest.mark.parametrize("batch,vocab", [(1, 20000), (2, 2500), (6, 20000)], ids=["slices4", "slices2", "block"])
def test_cpu_kernel_and_emulated_cuda_kernel_agree_exactly(dtype, logits, with_draft, batch, vocab, gen, strict):
    # Same rows, same order of every sum: every decision and every token agree, on 16-byte-aligned rows and on
    # misaligned ones (scalar loads), with a request's lanes on 4, 2 or 1 blocks. Strict mode (the
    # fixture): valid trees, so the emulated kernel records no error either.
    inp = make_tree_inputs(gen, batch, 24, vocab, dtype, with_draft, branching=4, depth=4, sharpness=1.0)
    shifted = {key: misaligned_copy(v) if key.endswith(("probs", "logits")) else v for key, v in inp.items()}
    control = (torch.rand(batch, generator=gen) + 0.3) if logits else torch.zeros(batch, dtype=torch.bool)
    cpu = run("cpu", inp, logits, control)
    for x in (inp, shifted):
        emu = run("sim", x, logits, control)
        for a, b in zip(cpu, emu):
            assert torch.equal(a, b)
    assert sim.last_launch()["threads_per_block"] == 1024 // {1: 4, 2: 2}.get(batch, 1)


def test_greedy_follows_the_argmax_path(gen):
    # Greedy requests walk to the child carrying the target's argmax while there is one; the argmax at the node
    # where none does is the last token. Checked against a direct walk, with trees that contain the argmax path.
    batch, n, vocab = 30, 40, 50
    inp = make_tree_inputs(gen, batch, n, vocab, with_draft=False, branching=4, depth=6, ragged=False)
    argmax = inp["target_probs"].argmax(-1)
    tokens = inp["tokens"].clone()
    for b in range(batch):  # make a random half of the nodes carry their parent's argmax (siblings stay distinct)
        for c in range(1, int(inp["num_nodes"][b])):
            p = int(inp["parents"][b, c])
            siblings = [i for i in range(1, c) if int(inp["parents"][b, i]) == p]
            if torch.rand(1, generator=gen) < 0.5 and all(int(tokens[b, i]) != int(argmax[b, p]) for i in siblings):
                tokens[b, c] = argmax[b, p]
            elif int(tokens[b, c]) in [int(tokens[b, i]) for i in siblings]:
                tokens[b, c] = next(v for v in range(vocab) if v not in [int(tokens[b, i]) for i in siblings])
    inp["tokens"] = tokens
    depths = []
    for backend in BACKENDS:
        out = run(backend, inp, logits=False, control=True)
        out_logits = run(backend, inp, logits=True, control=0.0)
        for b in range(batch):
            node, path = 0, [0]
            while True:
                child = [c for c in range(1, n) if int(inp["parents"][b, c]) == node and
                         int(tokens[b, c]) == int(argmax[b, node])]
                if not child:
                    break
                node = child[0]
                path.append(node)
            a = len(path) - 1
            depths.append(a)
            for o in (out, out_logits):
                assert o.accepted_nodes[b, :a + 1].tolist() == path and int(o.num_accepted[b]) == a
                assert int(o.output_token_ids[b, a]) == int(argmax[b, node])
    assert max(depths) >= 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_deterministic_and_batch_invariant(backend, gen):
    batch, n, vocab = 7, 20, 600
    inp = make_tree_inputs(gen, batch, n, vocab)
    first, again = run(backend, inp, True, 0.8), run(backend, inp, True, 0.8)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    perm = torch.randperm(batch, generator=gen)
    shuffled = {key: (v[perm] if isinstance(v, torch.Tensor) else v) for key, v in inp.items()}
    out = run(backend, shuffled, True, 0.8)
    assert all(torch.equal(a, b[perm]) for a, b in zip(out, first))
    one = {key: (v[3:4] if isinstance(v, torch.Tensor) else v) for key, v in inp.items()}
    assert all(torch.equal(a[0], b[3]) for a, b in zip(run(backend, one, True, 0.8), first))


# ----- the law of the emitted tokens ---------------------------------------------------------------
def full_tree(branching, depth):
    """Parents of the complete tree of `branching` children per node and `depth` levels, breadth first."""
    parents, level = [-1], [0]
    for _ in range(depth):
        nxt = []
        for p in level:
            for _ in range(branching):
                parents.append(p)
                nxt.append(len(parents) - 1)
        level = nxt
    return parents


def law_case(gen, trials, vocab, branching, depth, sampled):
    """Trees over first-order target and draft chains: the target at a node is P_d[token of the node] at depth
    d (P_0 at the root), the draft Q_d likewise. Children are the draft's top-`branching` tokens (point
    proposals) or `branching` draws without replacement from it (Gumbel top-k)."""
    q = [dirichlet(gen, vocab)] + [dirichlet(gen, vocab, vocab) for _ in range(depth)]
    p = [0.5 * qd + 0.5 * dirichlet(gen, *qd.shape) for qd in q]  # related to the draft, as a real target is
    parents = torch.tensor(full_tree(branching, depth), dtype=torch.int32)
    n = len(parents)
    tokens = torch.zeros(trials, n, dtype=torch.long)
    node_depth = [0] * n
    target = torch.empty(trials, n, vocab, dtype=torch.float64)
    draft = torch.empty(trials, n, vocab, dtype=torch.float64)
    target[:, 0], draft[:, 0] = p[0], q[0]
    first_child = 1
    for node in range(n):
        if node:
            node_depth[node] = node_depth[int(parents[node])] + 1
            d, x = node_depth[node], tokens[:, node]
            target[:, node] = p[d][x] if d < len(p) else p[-1][x]
            draft[:, node] = q[d][x] if d < len(q) else q[-1][x]
        kids = [c for c in range(first_child, n) if int(parents[c]) == node]
        if not kids:
            continue
        if sampled:
            keys = draft[:, node].log() - torch.empty(trials, vocab, dtype=torch.float64).exponential_(
                generator=gen).log()
            chosen = keys.topk(branching, -1).indices
        else:
            chosen = draft[:, node].topk(branching, -1).indices
        tokens[:, kids] = chosen
    return p, parents.expand(trials, n).contiguous(), tokens.int(), target.float(), draft.float() if sampled else None


@pytest.mark.parametrize("sampled", [False, True], ids=["point", "sampled"])
@pytest.mark.parametrize("branching,depth", [(1, 4), (2, 3), (3, 2), (4, 1), (4, 2), (2, 4)])
def test_first_two_tokens_follow_the_target(sampled, branching, depth):
    # Fixed seed, 60,000 trees per case on the CPU kernel (the emulated CUDA kernel is checked to equal it bit
    # for bit above). First token: 60,000 samples over V = 6 cells with p ~ 1/6; moving 1% of probability
    # between two tokens gives a chi-square noncentrality of 60000 * 2 * 0.01^2 / (1/6) = 72, power > 0.999
    # against the 1e-4 level (critical value ~25.7 at 5 dof). Second token given the first (reached when the
    # first was an accepted node, 30-90% of trees): P_1[y0] row by row, 18,000-54,000 pairs over 36 cells; the
    # same 1% shift in every row gives a noncentrality of 22-65 (critical value ~62 at 30 dof): power ~0.1-0.9
    # per case, over twelve cases; a 2% shift (noncentrality 86-260) is caught by every case.
    trials, vocab = 60_000, 6
    gen = torch.Generator().manual_seed(97 + 10 * branching + depth + 1000 * sampled)
    p, parents, tokens, target, draft = law_case(gen, trials, vocab, branching, depth, sampled)
    seed = torch.randint(-(2**63), 2**63 - 1, (trials,), generator=gen)
    out = specdec_ext.tree_speculative_sampling(parents, tokens, target, draft, seed=seed, offset=11)
    y = out.output_token_ids.long()
    pv0, _ = chi_square_pvalue(torch.bincount(y[:, 0], minlength=vocab).double().unsqueeze(0), p[0].unsqueeze(0))
    reached = out.num_accepted >= 1
    pairs = torch.zeros(vocab, vocab, dtype=torch.float64)
    pairs.index_put_((y[reached, 0], y[reached, 1]), torch.ones(int(reached.sum()), dtype=torch.float64),
                     accumulate=True)
    pv1, _ = chi_square_pvalue(pairs, p[1])
    assert pv0 > 1e-4 and pv1 > 1e-4, (pv0, pv1)
    assert 0.3 * trials < int(reached.sum()) < trials  # the second position is exercised, and rejection too


# ----- edge cases and malformed trees ----------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_p_equal_q_and_masked_tokens(backend, gen):
    # Children sampled from q == p: a rejected child leaves a residual without mass only by rounding; whatever
    # happens, masked tokens (-inf logits) are never emitted and every output is in range.
    batch, n, vocab = 10, 9, 40
    inp = make_tree_inputs(gen, batch, n, vocab, branching=3, depth=3, ragged=False)
    inp["target_logits"][:, :, 5] = -math.inf
    inp["draft_logits"] = inp["target_logits"].clone()
    out = run(backend, inp, True, 1.0)
    check_well_formed(out, inp, vocab)
    emitted = [int(out.output_token_ids[b, i]) for b in range(batch) for i in range(int(out.num_accepted[b]) + 1)]
    assert 5 not in emitted[-batch:] and all(int(out.output_token_ids[b, int(out.num_accepted[b])]) != 5
                                              for b in range(batch))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_root_alone_draws_the_bonus_token(backend, gen):
    inp = make_tree_inputs(gen, 5, 4, 30)
    inp["num_nodes"] = torch.ones(5, dtype=torch.int32)
    out = run(backend, inp, True, 1.0)
    assert bool((out.num_accepted == 0).all()) and bool((out.accepted_nodes[:, 1:] == -1).all())
    check_well_formed(out, inp, 30)


MALFORMED = {
    "parent_after_child": (lambda par, tok: par.__setitem__((1, 2), 3), "not a tree"),
    "cycle": (lambda par, tok: par.__setitem__((0, 3), 3), "not a tree"),
    "parent_out_of_range": (lambda par, tok: par.__setitem__((2, 1), 99), "not a tree"),
    "negative_parent": (lambda par, tok: par.__setitem__((2, 4), -3), "not a tree"),
    "root_with_parent": (lambda par, tok: par.__setitem__((1, 0), 0), "not a tree"),
    "duplicate_sibling": (lambda par, tok: (par.__setitem__((3, 2), 0), par.__setitem__((3, 1), 0),
                                            tok.__setitem__((3, 2), int(tok[3, 1]))), "repeats a token"),
    "token_out_of_range": (lambda par, tok: tok.__setitem__((0, 1), 30), "outside \\[0, V\\)"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_trees_raise_on_cpu_and_are_reported_by_the_emulator(case, gen):
    batch, n, vocab = 4, 6, 30
    inp = make_tree_inputs(gen, batch, n, vocab, branching=2, depth=5, ragged=False)
    inp["parents"] = torch.tensor([-1, 0, 1, 2, 3, 4], dtype=torch.int32).expand(batch, n).contiguous()
    inp["num_nodes"] = torch.full((batch,), n, dtype=torch.int32)
    edit, message = MALFORMED[case]
    edit(inp["parents"], inp["tokens"])
    with pytest.raises(ValueError, match=message):
        run("cpu", inp, True, 1.0)
    # The emulated CUDA kernel does not sync by default: a defined output that never leaves the valid part of
    # the tree (the emulator runs under AddressSanitizer in CI, so no read is out of bounds either)...
    out = run("sim", inp, True, 1.0)
    for b in range(batch):
        a = int(out.num_accepted[b])
        path = out.accepted_nodes[b, :a + 1].tolist()
        assert path[0] == 0 and all(0 < c < n for c in path[1:])
        assert 0 <= int(out.output_token_ids[b, a]) < vocab and bool((out.accepted_nodes[b, a + 1:] == -1).all())
    # ... and strict mode reports it.
    specdec_ext.set_strict(True)
    try:
        with pytest.raises(ValueError, match=message):
            run("sim", inp, True, 1.0)
    finally:
        specdec_ext.set_strict(False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments_are_named(backend, gen):
    inp = make_tree_inputs(gen, 3, 5, 20)
    ops = BACKENDS[backend]
    args = (inp["parents"], inp["tokens"], inp["target_logits"])
    with pytest.raises(ValueError, match="N must be in"):
        ops.tree_speculative_sampling_from_logits(torch.zeros(3, 65, dtype=torch.int32), torch.zeros(3, 65,
                                                                                                     dtype=torch.int32),
                                                  torch.zeros(3, 65, 20), temperature=1.0, seed=0)
    with pytest.raises(ValueError, match="candidate_token_ids must have the shape"):
        ops.tree_speculative_sampling_from_logits(inp["parents"], inp["tokens"][:, :4], inp["target_logits"],
                                                  temperature=1.0, seed=0)
    with pytest.raises(ValueError, match="target_logits must be \\[B, N, V\\]"):
        ops.tree_speculative_sampling_from_logits(*args[:2], inp["target_logits"][:, :4], temperature=1.0, seed=0)
    with pytest.raises(ValueError, match="draft_logits must be \\[B, N, V\\]"):
        ops.tree_speculative_sampling_from_logits(*args, inp["draft_logits"][:, :, :5], temperature=1.0, seed=0)
    with pytest.raises(ValueError, match="temperature must be finite"):
        ops.tree_speculative_sampling_from_logits(*args, temperature=-1.0, seed=0)
    if backend == "cpu":  # the emulated kernel records it (strict mode raises), as CUDA does
        with pytest.raises(ValueError, match="num_nodes"):
            ops.tree_speculative_sampling_from_logits(*args, temperature=1.0, num_nodes=torch.tensor([1, 9, 2]), seed=0)
    with pytest.raises(ValueError, match="parents must be"):
        ops.tree_speculative_sampling_from_logits(inp["parents"].float(), *args[1:], temperature=1.0, seed=0)


def test_strict_mode_checks_rows_the_walk_never_reads(gen):
    # The root's children carry masked tokens, so they are never accepted and their rows are never read: a NaN
    # there passes unnoticed on the CPU, and strict mode (every backend) reports it.
    inp = make_tree_inputs(gen, 2, 3, 20, ragged=False)
    inp["parents"] = torch.tensor([[-1, 0, 0]] * 2, dtype=torch.int32)
    inp["tokens"] = torch.tensor([[0, 4, 5]] * 2, dtype=torch.int32)
    inp["target_logits"][:, 0, 4:6] = -math.inf
    inp["target_logits"][1, 2, 7] = float("nan")
    assert bool((run("cpu", inp, True, 1.0).num_accepted == 0).all())
    specdec_ext.set_strict(True)
    try:
        for backend in BACKENDS:
            with pytest.raises(ValueError, match="target_logits\\[1, 2\\] holds NaN"):
                run(backend, inp, True, 1.0)
    finally:
        specdec_ext.set_strict(False)


def test_invalid_values_raise_on_cpu(gen):
    inp = make_tree_inputs(gen, 3, 5, 20, ragged=False)
    inp["target_logits"][0, 0, 3] = float("nan")
    with pytest.raises(ValueError, match="target_logits holds NaN"):
        run("cpu", inp, True, 1.0)


@pytest.mark.parametrize("backend", NAMESPACES)
@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
def test_opcheck(backend, logits, gen):
    batch, n, vocab = 3, 7, 33
    inp = make_tree_inputs(gen, batch, n, vocab, torch.bfloat16)
    control = torch.tensor([0.0, 1.0, 0.7]) if logits else torch.tensor([True, False, False])
    ns = NAMESPACES[backend]
    fn = ns.tree_speculative_sampling_from_logits if logits else ns.tree_speculative_sampling
    target = inp["target_logits"] if logits else inp["target_probs"]
    draft = inp["draft_logits"] if logits else inp["draft_probs"]
    torch.library.opcheck(fn.default, (inp["parents"], inp["tokens"], inp["num_nodes"], target, draft, control,
                                       inp["seed"], inp["offset"], *poisoned_out(batch, n), None))


def test_traces_under_torch_compile(gen):
    inp = make_tree_inputs(gen, 4, 9, 64)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(parents, tokens, target, seed):
        out = specdec_ext.tree_speculative_sampling_from_logits(parents, tokens, target, temperature=0.9, seed=seed,
                                                                offset=0)
        return out.accepted_nodes, out.num_accepted + 1

    nodes, emitted = step(inp["parents"], inp["tokens"], inp["target_logits"], inp["seed"])
    eager = specdec_ext.tree_speculative_sampling_from_logits(inp["parents"], inp["tokens"], inp["target_logits"],
                                                              temperature=0.9, seed=inp["seed"], offset=0)
    assert torch.equal(nodes, eager.accepted_nodes) and torch.equal(emitted, eager.num_accepted + 1)
