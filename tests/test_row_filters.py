"""top_k / top_p / min_p inside the from-logits sampling ops (csrc/include/specdec/row_filter.h): the kept set of every
row equals the float64 reference's (reference.filter_logits, itself checked against transformers' warpers in
test_plain_decoding), ties at the threshold included; target and draft rows are processed alike, so the emitted law is
the processed target's; the CPU kernel and the CUDA kernel under the emulator agree bit for bit; bad controls raise
naming themselves. Fixed seeds throughout."""
import pytest
import torch
from scipy import stats

import specdec_ext
from helpers.chi_square import chi_square_pvalue
from helpers.sampling_inputs import make_chain_inputs, make_tree_inputs
from specdec_ext import reference, sim

BACKENDS = {"cpu": specdec_ext, "sim": sim}


def rows_of_every_shape(gen, vocab, count):
    """Rows of logits: peaked (one or a few large entries), flat (small spread), spread (randn * 3), and with ties at
    every value (integers), -inf entries among them."""
    x = torch.randn(count, vocab, generator=gen)
    kinds = torch.arange(count) % 4
    x[kinds == 0] *= 4.0
    x[kinds == 0, torch.randint(vocab, (1,), generator=gen)] += 12.0
    x[kinds == 1] *= 0.05
    x[kinds == 2] *= 3.0
    x[kinds == 3] = torch.randint(-3, 4, (int((kinds == 3).sum()), vocab), generator=gen).float()
    if vocab > 4:
        x[:, torch.randint(vocab, (max(vocab // 10, 1),), generator=gen)] = float("-inf")
        x[:, 0] = x[:, 0].clamp_min(-5.0)  # at least one finite entry
    return x


def controls(gen, count, vocab):
    """Per-row (temperature, top_k, top_p, min_p): each control alone, all three, and off."""
    t = torch.rand(count, generator=gen) * 1.3 + 0.3
    k = torch.randint(1, max(vocab, 2) + 3, (count,), generator=gen).int()
    p = torch.rand(count, generator=gen) * 0.98 + 0.01
    mp = torch.rand(count, generator=gen) * 0.3
    which = torch.arange(count) % 5
    k = torch.where((which == 0) | (which == 3), k, 0)
    p = torch.where((which == 1) | (which == 3), p, 1.0)
    mp = torch.where((which == 2) | (which == 3), mp, 0.0)
    return t, k.int(), p, mp


def kept_by_kernel(ops, rows, t, k, p, mp, probes):
    """Whether each probe token (one per row) survives the kernel's processing of its row: a point proposal tested with
    uniform 0 is accepted iff its processed probability is > 0."""
    count, vocab = rows.shape
    out = ops.chain_speculative_sampling_from_logits(
        probes.view(-1, 1), rows.unsqueeze(1).expand(count, 2, vocab), temperature=t, seed=0, offset=0,
        uniforms=torch.zeros(count, 1), top_k=k, top_p=p, min_p=mp)
    return out.num_accepted.bool()


def boundary_probes(filtered, rows):
    """Per row, the kept entry of least value (the threshold: its ties too) and the removed finite entry of most value
    (-1 if every finite entry is kept), from the reference's processed rows."""
    kept = torch.isfinite(filtered)
    removed = torch.isfinite(rows) & ~kept
    least_kept = torch.where(kept, rows, float("inf")).argmin(-1)
    most_removed = torch.where(removed, rows, float("-inf")).argmax(-1)
    return least_kept, torch.where(removed.any(-1), most_removed, -1)


# The emulator runs 1024 lanes per row on one core: a row within a tile and one over two tiles.
@pytest.mark.parametrize("backend,vocab", [("cpu", v) for v in (2, 7, 1000, 8193, 49152, 262208)] +
                         [("sim", 7), ("sim", 8193)])
def test_kept_set_equals_the_reference(backend, vocab):
    """The threshold found by the kernel is the reference's: the least kept entry (every entry tied with it) survives,
    the largest removed one does not; since the kept set is {x >= threshold}, the two sets are equal."""
    gen = torch.Generator().manual_seed(vocab)
    count = 6 if backend == "sim" else 40 if vocab < 100_000 else 10
    rows = rows_of_every_shape(gen, vocab, count)
    t, k, p, mp = controls(gen, count, vocab)
    filtered = reference.filter_logits(rows, t, k, p, mp)
    least_kept, most_removed = boundary_probes(filtered, rows)
    ops = BACKENDS[backend]
    assert kept_by_kernel(ops, rows, t, k, p, mp, least_kept).all()
    has_removed = most_removed >= 0
    assert has_removed.sum() >= count // 3  # the controls did remove something in many rows
    assert not kept_by_kernel(ops, rows, t, k, p, mp, most_removed.clamp_min(0))[has_removed].any()
    # Ties of the threshold: every entry equal to the least kept value survives.
    threshold = rows.gather(1, least_kept.unsqueeze(1))
    tie_rows, tie_cols = ((rows == threshold) & (torch.arange(vocab) != least_kept.unsqueeze(1))).nonzero(as_tuple=True)
    # Integer rows tie thousands of entries: 64 probes (8 under the emulator, which runs a threshold's ~60 passes
    # slowly).
    pick = torch.randperm(len(tie_rows), generator=gen)[:8 if backend == "sim" else 64]
    tie_rows, tie_cols = tie_rows[pick], tie_cols[pick]
    if len(tie_rows):
        assert kept_by_kernel(ops, rows[tie_rows], t[tie_rows], k[tie_rows], p[tie_rows], mp[tie_rows], tie_cols).all()


def test_ties_at_every_threshold():
    """Integer logits: top-k's k-th value, top-p's boundary value and min-p's are all tied several times; each control
    keeps every tie, on CPU and under the emulator."""
    row = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0, -1.0, 2.0, 1.0, 3.0]])
    cases = [(1.0, 3, 1.0, 0.0), (1.0, 0, 0.3, 0.0), (1.0, 0, 0.0001, 0.0), (1.0, 0, 1.0, 0.3), (0.5, 2, 0.99, 0.0)]
    for t, k, p, mp in cases:
        want = torch.isfinite(reference.filter_logits(row, t, k, p, mp))[0]
        for ops in BACKENDS.values():
            got = kept_by_kernel(ops, row.expand(10, -1), torch.full((10,), t), torch.full((10,), k, dtype=torch.int32),
                                 torch.full((10,), p), torch.full((10,), mp), torch.arange(10))
            assert torch.equal(got, want), (t, k, p, mp, got, want)
    # top-k 3 keeps both 3s and every 2 (the third largest, tied four times); top-p 1e-4 keeps both 3s.
    assert torch.isfinite(reference.filter_logits(row, 1.0, 3)).sum() == 6
    assert torch.isfinite(reference.filter_logits(row, 1.0, 0, 0.0001)).sum() == 2


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_decisions_equal_the_reference(tree):
    """Acceptance decisions and emitted tokens from processed target and draft rows equal the float64 reference's
    (which processes the rows with filter_logits, then runs the unprocessed reference)."""
    gen = torch.Generator().manual_seed(31 + tree)
    batch, vocab = 64, 300
    t, k, p, mp = controls(gen, batch, vocab)
    t[:4] = 0.0  # greedy requests among them: never processed
    if tree:
        inp = make_tree_inputs(gen, batch, 8, vocab)
        args = (inp["parents"], inp["tokens"], inp["target_logits"], inp["draft_logits"])
        kw = dict(temperature=t, num_nodes=inp["num_nodes"], seed=torch.arange(batch), offset=0, top_k=k, top_p=p,
                  min_p=mp)
        got = specdec_ext.tree_speculative_sampling_from_logits(*args, **kw)
        want = reference.tree_speculative_sampling_from_logits(*args, **kw)
    else:
        inp = make_chain_inputs(gen, batch, 4, vocab)
        args = (inp["ids"], inp["target_logits"], inp["draft_logits"])
        kw = dict(temperature=t, seed=torch.arange(batch), offset=0, top_k=k, top_p=p, min_p=mp,
                  num_draft_tokens=torch.full((batch,), 4, dtype=torch.int32))
        got = specdec_ext.chain_speculative_sampling_from_logits(*args, **kw)
        want = reference.chain_speculative_sampling_from_logits(*args, **kw)
    assert torch.equal(got.num_accepted, want[-1])
    assert torch.equal(got.output_token_ids, want[0])
    # The controls matter: without them the same inputs decide differently somewhere.
    plain = {key: value for key, value in kw.items() if key not in ("top_k", "top_p", "min_p")}
    op = (specdec_ext.tree_speculative_sampling_from_logits if tree
          else specdec_ext.chain_speculative_sampling_from_logits)
    assert not torch.equal(op(*args, **plain).output_token_ids, got.output_token_ids)


@pytest.mark.parametrize("coupling,dtype", [("rejection", torch.float32), ("gumbel", torch.bfloat16)], ids=str)
def test_cpu_equals_emulator_bit_for_bit(coupling, dtype):
    gen = torch.Generator().manual_seed(5)
    batch, vocab = 24, 8200  # two tiles of the canonical order
    t, k, p, mp = controls(gen, batch, vocab)
    inp = make_chain_inputs(gen, batch, 3, vocab, dtype=dtype)
    draft = inp["draft_logits"] if coupling == "rejection" else None
    kw = dict(temperature=t, seed=torch.arange(batch) * 7, offset=3, top_k=k, top_p=p, min_p=mp, coupling=coupling,
              num_draft_tokens=torch.randint(0, 4, (batch,), generator=gen, dtype=torch.int32))
    outs = [ops.chain_speculative_sampling_from_logits(inp["ids"], inp["target_logits"], draft, **kw)
            for ops in BACKENDS.values()]
    assert torch.equal(outs[0].output_token_ids, outs[1].output_token_ids)
    assert torch.equal(outs[0].num_accepted, outs[1].num_accepted)
    trees = make_tree_inputs(gen, 8, 6, vocab, dtype=dtype)
    tkw = dict(temperature=t[:8], num_nodes=trees["num_nodes"], seed=torch.arange(8), offset=1, top_k=k[:8],
               top_p=p[:8], min_p=mp[:8], coupling=coupling)
    tdraft = trees["draft_logits"] if coupling == "rejection" else None
    touts = [ops.tree_speculative_sampling_from_logits(trees["parents"], trees["tokens"], trees["target_logits"],
                                                       tdraft,
                                                       **tkw) for ops in BACKENDS.values()]
    for a, b in zip(touts[0], touts[1]):
        assert torch.equal(a, b)


def test_draft_vocabulary_rows_are_processed_over_their_own_columns():
    """Draft rows over a reduced vocabulary (draft_to_target) are processed over their Vd columns: the op's decisions
    equal those on the same rows expanded to the full vocabulary (-inf off the map), which have the same kept set."""
    gen = torch.Generator().manual_seed(8)
    batch, vocab, vd = 16, 500, 120
    t, k, p, mp = controls(gen, batch, vd)
    inp = make_chain_inputs(gen, batch, 3, vocab)
    draft_to_target = torch.randperm(vocab, generator=gen)[:vd].int()
    small = torch.randn(batch, 3, vd, generator=gen) * 2
    full = torch.full((batch, 3, vocab), float("-inf"))
    full[..., draft_to_target.long()] = small
    ids = draft_to_target[torch.randint(vd, (batch, 3), generator=gen)]
    kw = dict(temperature=t, seed=torch.arange(batch), offset=0, top_k=k, top_p=p, min_p=mp)
    for ops in BACKENDS.values():
        mapped = ops.chain_speculative_sampling_from_logits(ids, inp["target_logits"], small,
                                                            draft_to_target=draft_to_target, **kw)
        expanded = ops.chain_speculative_sampling_from_logits(ids, inp["target_logits"], full, **kw)
        assert torch.equal(mapped.output_token_ids, expanded.output_token_ids)


def test_flat_form_equals_padded():
    gen = torch.Generator().manual_seed(12)
    batch, k_max, vocab = 6, 3, 700
    t, k, p, mp = controls(gen, batch, vocab)
    inp = make_chain_inputs(gen, batch, k_max, vocab)
    counts = torch.tensor([0, 3, 1, 2, 3, 1], dtype=torch.int32)
    kw = dict(temperature=t, seed=torch.arange(batch), offset=0, top_k=k, top_p=p, min_p=mp)
    padded = specdec_ext.chain_speculative_sampling_from_logits(inp["ids"], inp["target_logits"], inp["draft_logits"],
                                                                num_draft_tokens=counts, **kw)
    take = torch.arange(k_max).unsqueeze(0) < counts.unsqueeze(1)
    target_take = torch.arange(k_max + 1).unsqueeze(0) <= counts.unsqueeze(1)
    flat = specdec_ext.chain_speculative_sampling_from_logits(
        inp["ids"][take], inp["target_logits"][target_take], inp["draft_logits"][take],
        cu_num_draft_tokens=counts.cumsum(0).int(), max_draft_tokens=k_max, **kw)
    assert torch.equal(padded.output_token_ids, flat.output_token_ids)
    want = reference.chain_speculative_sampling_from_logits(
        inp["ids"][take], inp["target_logits"][target_take], inp["draft_logits"][take],
        cu_num_draft_tokens=counts.cumsum(0).int(), max_draft_tokens=k_max, **kw)
    assert torch.equal(flat.output_token_ids, want[0])


# The law: first emitted token over LAW_SAMPLES requests sharing one target row and one draft row; the drafts are drawn
# from the processed draft distribution (by the op itself: its bonus draw from the draft row). Power: the chi-square
# test at alpha 1e-3 detects 1% of mass moved between the two likeliest tokens with probability >= 0.99 (computed
# below); the planted bug (draft rows left unprocessed while the drafts come from the processed q) moves far more.
LAW_SAMPLES = 40_000


@pytest.mark.parametrize("backend", ["cpu"])
@pytest.mark.parametrize("case", ["top-k", "top-p", "min-p", "all"])
def test_emitted_law_is_the_processed_target(backend, case):
    ops = BACKENDS[backend]
    gen = torch.Generator().manual_seed(77)
    vocab, n = 16, LAW_SAMPLES
    target = torch.randn(vocab, generator=gen) * 1.5
    draft = target + torch.randn(vocab, generator=gen) * 1.0
    t = 0.8
    k, p, mp = {"top-k": (6, 1.0, 0.0), "top-p": (0, 0.8, 0.0), "min-p": (0, 1.0, 0.1), "all": (8, 0.9, 0.05)}[case]
    controls_ = dict(top_k=torch.full((n,), k, dtype=torch.int32), top_p=torch.full((n,), p),
                     min_p=torch.full((n,), mp))
    seeds = torch.arange(n) * 3 + 1
    draft_rows = draft.expand(n, 1, vocab)
    # Drafts drawn from the processed q: the op's bonus draw from the draft row (no drafts, K = 1).
    drafts = ops.chain_speculative_sampling_from_logits(
        torch.zeros(n, 1, dtype=torch.int64), draft.expand(n, 2, vocab), temperature=t, seed=seeds ^ 0x5EED, offset=0,
        num_draft_tokens=torch.zeros(n, dtype=torch.int32), **controls_).output_token_ids[:, :1].long()
    out = ops.chain_speculative_sampling_from_logits(drafts, target.expand(n, 2, vocab), draft_rows, temperature=t,
                                                     seed=seeds, offset=0, **controls_)
    first = out.output_token_ids[:, 0].long()
    want = reference.filter_logits(target.unsqueeze(0), t, k, p, mp).double().div(t).softmax(-1)[0]
    want_q = reference.filter_logits(draft.unsqueeze(0), t, k, p, mp).double().div(t).softmax(-1)[0]
    counts = torch.bincount(first, minlength=vocab)
    assert counts[want == 0].sum() == 0, "a token the processing removes was emitted"
    assert torch.bincount(drafts[:, 0], minlength=vocab)[want_q == 0].sum() == 0
    p1, p2 = sorted(want.tolist())[-2:]
    df = int((want > 0).sum()) - 1
    power = stats.ncx2.sf(stats.chi2.ppf(1 - 1e-3, df), df, n * 0.01 ** 2 * (1 / p1 + 1 / p2))
    assert power >= 0.99
    assert chi_square_pvalue([counts.double()], [want])[0] > 1e-3
    accepted = out.num_accepted.float().mean()
    assert 0.1 < accepted < 0.95  # drafts both accepted and rejected: the residual draw is exercised


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_controls_name_themselves(backend):
    ops = BACKENDS[backend]
    gen = torch.Generator().manual_seed(2)
    inp = make_chain_inputs(gen, 2, 2, 50)
    call = lambda **kw: ops.chain_speculative_sampling_from_logits(  # noqa: E731
        inp["ids"], inp["target_logits"], inp["draft_logits"], temperature=0.8, seed=0, offset=0, **kw)
    for name, value in [("top_k", -1), ("top_p", 0.0), ("top_p", 1.5), ("min_p", 1.0), ("min_p", -0.1)]:
        with pytest.raises(ValueError, match=name):
            call(**{name: value})
    bad = {"top_k": torch.tensor([3, -2], dtype=torch.int32), "top_p": torch.tensor([0.5, float("nan")]),
           "min_p": torch.tensor([0.0, 1.0])}
    for name, value in bad.items():  # the message names the control and the request (1)
        message = rf"{name} must be .*, got {name}\[1\] = .* \(request 1\)"
        if backend == "cpu":
            with pytest.raises(ValueError, match=message):
                call(**{name: value})
        else:
            specdec_ext.set_strict(True)
            try:
                with pytest.raises(ValueError, match=message):
                    call(**{name: value})
            finally:
                specdec_ext.set_strict(False)
            call(**{name: value})  # without strict mode: a defined output, the request sampled unprocessed
    with pytest.raises(ValueError, match="top_k"):
        call(top_k=torch.tensor([1, 2, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="top_p"):
        call(top_p=torch.tensor([0.5, 0.5], dtype=torch.float64).to(torch.complex64))


def test_opcheck_with_controls():
    """The schemas with top_k / top_p / min_p pass torch.library.opcheck (fake kernels, aliasing, autograd): chain and
    tree on CPU, chain under the emulator (the same schema code; opcheck runs an op a dozen times)."""
    gen = torch.Generator().manual_seed(6)
    batch, k, vocab = 4, 3, 100
    inp = make_chain_inputs(gen, batch, k, vocab)
    trees = make_tree_inputs(gen, batch, 5, vocab)
    controls_ = dict(top_k=torch.tensor([0, 5, 50, 2], dtype=torch.int32), top_p=torch.tensor([0.9, 1.0, 0.5, 0.7]),
                     min_p=torch.tensor([0.0, 0.1, 0.0, 0.05]))
    temperature = torch.full((batch,), 0.8)
    for ns in (torch.ops.specdec, torch.ops.specdec_sim):
        args = (inp["ids"], inp["target_logits"], inp["draft_logits"], inp["num_draft_tokens"], temperature,
                inp["seed"], inp["offset"], torch.full((batch, k + 1), -7, dtype=torch.int32),
                torch.zeros(batch, dtype=torch.int32), None)
        torch.library.opcheck(ns.chain_speculative_sampling_from_logits.default, args, controls_)
        if ns is torch.ops.specdec_sim:
            continue
        tree_args = (trees["parents"], trees["tokens"], trees["num_nodes"], trees["target_logits"],
                     trees["draft_logits"],
                     temperature, torch.arange(batch), torch.zeros(batch, dtype=torch.int64),
                     torch.full((batch, 5), -7, dtype=torch.int32), torch.full((batch, 5), -7, dtype=torch.int32),
                     torch.zeros(batch, dtype=torch.int32), None)
        torch.library.opcheck(ns.tree_speculative_sampling_from_logits.default, tree_args, controls_)
