"""The sampling ops' engine layouts (docs/design.md §3.4): the flat form (cu_num_draft_tokens), caller bonus tokens and
uniforms, reduced draft vocabularies (draft_to_target), FlashInfer's independent accepted count, and the limits
(K = 128, V up to 2^24), on the CPU kernel and the CUDA kernel under the emulator."""
import pytest
import torch
from scipy import stats

import specdec_ext
from helpers.sampling_inputs import padded_and_flat_trees, ragged_batch, reduced_vocab, scatter_full
from specdec_ext import reference, sim

BACKENDS = {"cpu": specdec_ext, "sim": sim}


def poisoned(batch, k):
    return torch.full((batch, k + 1), -77, dtype=torch.int32), torch.full((batch,), -77, dtype=torch.int32)


def call(backend, logits, ids, target, draft, *, seed, offset, control, **kw):
    ops = BACKENDS[backend]
    if logits:
        return ops.chain_speculative_sampling_from_logits(ids, target, draft, temperature=control, seed=seed,
                                                          offset=offset, **kw)
    return ops.chain_speculative_sampling(ids, target, draft, greedy=control, seed=seed, offset=offset, **kw)


@pytest.mark.parametrize("backend", ["cpu", "sim"])
@pytest.mark.parametrize("logits", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_draft", [True, False])
def test_flat_form_equals_padded(gen, backend, logits, dtype, with_draft):
    batch, max_k, vocab = 21, 5, 300
    padded, flat = ragged_batch(gen, batch, max_k, vocab, dtype)
    kind = "logits" if logits else "probs"
    control = torch.tensor([0.0, 0.7, 1.0, 1.3, 0.0, 2.0, 0.9]).repeat(3) if logits else \
        torch.tensor([True, False, False, False, True, False, False]).repeat(3)
    keys = {"seed": padded["seed"], "offset": padded["offset"], "control": control}
    ref = call(backend, logits, padded["ids"], padded[f"target_{kind}"],
               padded[f"draft_{kind}"] if with_draft else None, num_draft_tokens=padded["num_draft_tokens"],
               out=poisoned(batch, max_k), **keys)
    got = call(backend, logits, flat["ids"], flat[f"target_{kind}"], flat[f"draft_{kind}"] if with_draft else None,
               cu_num_draft_tokens=flat["cu"], max_draft_tokens=max_k, out=poisoned(batch, max_k), **keys)
    assert torch.equal(got.output_token_ids, ref.output_token_ids)
    assert torch.equal(got.num_accepted, ref.num_accepted)
    assert (ref.num_accepted < padded["num_draft_tokens"]).any() and (ref.num_accepted > 0).any(), \
        "the batch must mix rejections and acceptances"
    # With caller bonus tokens and uniforms, both forms again agree (target rows [T, V]: no bonus rows at all).
    extra = {"bonus_token_ids": padded["bonus"], "final_uniforms": padded["final_uniforms"]}
    ref = call(backend, logits, padded["ids"], padded[f"target_{kind}"],
               padded[f"draft_{kind}"] if with_draft else None, num_draft_tokens=padded["num_draft_tokens"],
               uniforms=padded["uniforms"], **extra, **keys)
    got = call(backend, logits, flat["ids"], flat[f"target_{kind}_nobonus"],
               flat[f"draft_{kind}"] if with_draft else None, cu_num_draft_tokens=flat["cu"], max_draft_tokens=max_k,
               uniforms=flat["uniforms"], **extra, **keys)
    assert torch.equal(got.output_token_ids, ref.output_token_ids)
    assert torch.equal(got.num_accepted, ref.num_accepted)


@pytest.mark.parametrize("backend", ["cpu", "sim"])
def test_zero_drafts_everywhere_is_plain_sampling(gen, backend):
    """K = 0 for every request, padded ([B, 0]) and flat (T = 0): one token from each target row, as plain decoding."""
    batch, vocab = 5, 257
    logits = torch.randn(batch, 1, vocab, generator=gen) * 3
    seed, offset = torch.arange(batch) + 11, torch.arange(batch)
    padded = BACKENDS[backend].chain_speculative_sampling_from_logits(
        torch.zeros(batch, 0, dtype=torch.int32), logits, None, temperature=0.8, seed=seed, offset=offset)
    flat = BACKENDS[backend].chain_speculative_sampling_from_logits(
        torch.zeros(0, dtype=torch.int32), logits[:, 0], None, temperature=0.8, seed=seed, offset=offset,
        cu_num_draft_tokens=torch.zeros(batch, dtype=torch.int32), max_draft_tokens=0)
    ref = reference.chain_speculative_sampling_from_logits(torch.zeros(batch, 0, dtype=torch.int32), logits,
                                                           temperature=0.8, seed=seed, offset=offset)
    assert padded.output_token_ids.shape == (batch, 1)
    assert torch.equal(padded.output_token_ids, flat.output_token_ids)
    assert torch.equal(padded.num_accepted, torch.zeros(batch, dtype=torch.int32))
    assert (padded.output_token_ids[:, 0] == ref[0][:, 0]).float().mean() >= 0.8  # boundary rows aside
    assert ((padded.output_token_ids >= 0) & (padded.output_token_ids < vocab)).all()


@pytest.mark.parametrize("backend", ["cpu", "sim"])
@pytest.mark.parametrize("logits", [False, True])
def test_caller_bonus_row_is_never_read(gen, backend, logits):
    batch, k, vocab = 6, 3, 64
    padded, _ = ragged_batch(gen, batch, k, vocab, zero_rows=False)
    kind = "logits" if logits else "probs"
    target = padded[f"target_{kind}"].clone()
    # Drafts that are certainly accepted: point proposals of each row's argmax, greedy.
    ids = target[:, :k].argmax(-1).int()
    target[:, k] = float("nan")  # the bonus rows
    control = 0.0 if logits else True
    out = call(backend, logits, ids, target, None, seed=1, offset=0, control=control, bonus_token_ids=padded["bonus"],
               out=poisoned(batch, k))
    assert torch.equal(out.num_accepted, torch.full((batch,), k, dtype=torch.int32))
    assert torch.equal(out.output_token_ids[:, k], padded["bonus"].int())
    # Strict mode checks every row a request owns: the bonus rows are not its rows.
    specdec_ext.set_strict(True)
    try:
        strict = call(backend, logits, ids, target, None, seed=1, offset=0, control=0.0 if logits else True,
                      bonus_token_ids=padded["bonus"])
    finally:
        specdec_ext.set_strict(False)
    assert torch.equal(strict.output_token_ids, out.output_token_ids)
    # The same without bonus tokens reads the NaN rows and raises (so the test above can fail).
    if backend == "cpu":
        with pytest.raises(ValueError, match="NaN"):
            call(backend, logits, ids, target, None, seed=1, offset=0, control=control)
    # [B, K, V] target rows will do with bonus tokens; a bonus id outside [0, V) raises.
    out2 = call(backend, logits, ids, target[:, :k].contiguous(), None, seed=1, offset=0, control=control,
                bonus_token_ids=padded["bonus"].int())
    assert torch.equal(out2.output_token_ids, out.output_token_ids)
    with pytest.raises(ValueError, match="bonus_token_ids"):
        with_strict(backend, lambda: call(backend, logits, ids, target, None, seed=1, offset=0, control=control,
                                          bonus_token_ids=torch.full((batch,), vocab)))


def with_strict(backend, fn):
    """Runs fn, in strict mode on the emulator (whose kernels record errors instead of raising)."""
    if backend == "cpu":
        return fn()
    specdec_ext.set_strict(True)
    try:
        return fn()
    finally:
        specdec_ext.set_strict(False)


@pytest.mark.parametrize("logits", [False, True])
@pytest.mark.parametrize("with_draft", [True, False])
def test_caller_uniforms_cpu_equals_emulator_and_reference(gen, logits, with_draft):
    batch, k, vocab = 9, 4, 500
    padded, _ = ragged_batch(gen, batch, k, vocab)
    kind = "logits" if logits else "probs"
    draft = padded[f"draft_{kind}"] if with_draft else None
    control = 0.9 if logits else False
    kw = dict(num_draft_tokens=padded["num_draft_tokens"], uniforms=padded["uniforms"],
              final_uniforms=padded["final_uniforms"])
    # Seeds differ between the calls: with caller uniforms nothing may depend on them.
    cpu = call("cpu", logits, padded["ids"], padded[f"target_{kind}"], draft, seed=1, offset=0, control=control, **kw)
    emu = call("sim", logits, padded["ids"], padded[f"target_{kind}"], draft, seed=2, offset=5, control=control, **kw)
    assert torch.equal(cpu.output_token_ids, emu.output_token_ids) and torch.equal(cpu.num_accepted, emu.num_accepted)
    ref_fn = reference.chain_speculative_sampling_from_logits if logits else reference.chain_speculative_sampling
    ref = ref_fn(padded["ids"], padded[f"target_{kind}"], draft, seed=3, **kw,
                 **({"temperature": control} if logits else {"greedy": control}))
    assert torch.equal(cpu.num_accepted, ref[1])
    # Philox draws give other decisions on some rows: the uniforms were used.
    philox = call("cpu", logits, padded["ids"], padded[f"target_{kind}"], draft, seed=1, offset=0, control=control,
                  num_draft_tokens=padded["num_draft_tokens"])
    assert not torch.equal(philox.output_token_ids, cpu.output_token_ids)


@pytest.mark.parametrize("backend", ["cpu", "sim"])
def test_zero_uniforms_accept_every_draft_with_mass(gen, backend):
    batch, k, vocab = 8, 6, 40
    probs = torch.softmax(torch.randn(batch, k + 1, vocab, generator=gen), -1)
    draft = torch.softmax(torch.randn(batch, k, vocab, generator=gen), -1)
    ids = torch.randint(0, vocab, (batch, k), generator=gen, dtype=torch.int32)
    probs[3, 2, ids[3, 2]] = 0.0  # a draft the target gives no mass: rejected even at u = 0
    out = BACKENDS[backend].chain_speculative_sampling(ids, probs, draft, uniforms=torch.zeros(batch, k), seed=0)
    expected = torch.full((batch,), k, dtype=torch.int32)
    expected[3] = 2
    assert torch.equal(out.num_accepted, expected)


@pytest.mark.parametrize("backend", ["cpu", "sim"])
@pytest.mark.parametrize("logits", [False, True])
def test_accepted_independently(gen, backend, logits):
    batch, k, vocab = 24, 5, 200
    padded, _ = ragged_batch(gen, batch, k, vocab, sharpness=1.0)
    kind = "logits" if logits else "probs"
    control = torch.tensor([0.0, 1.0] * 12) if logits else torch.tensor([True, False] * 12)
    got = torch.full((batch,), -5, dtype=torch.int32)
    out = call(backend, logits, padded["ids"], padded[f"target_{kind}"], padded[f"draft_{kind}"], seed=padded["seed"],
               offset=padded["offset"], control=control, num_draft_tokens=padded["num_draft_tokens"],
               accepted_independently=got, uniforms=padded["uniforms"])
    expected = torch.full((batch,), -5, dtype=torch.int64)
    ref_fn = reference.chain_speculative_sampling_from_logits if logits else reference.chain_speculative_sampling
    ref_fn(padded["ids"], padded[f"target_{kind}"], padded[f"draft_{kind}"], seed=0,
           num_draft_tokens=padded["num_draft_tokens"], uniforms=padded["uniforms"], accepted_independently=expected,
           **({"temperature": control} if logits else {"greedy": control}))
    assert torch.equal(got.long(), expected)
    assert (got >= out.num_accepted).all()
    assert (got > out.num_accepted).any(), "some draft after a rejection must pass on its own"


@pytest.mark.parametrize("backend", ["cpu", "sim"])
@pytest.mark.parametrize("logits", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reduced_draft_vocabulary_equals_scattered_rows(gen, backend, logits, dtype):
    """Draft rows over Vd columns with draft_to_target give exactly the outputs of the same rows scattered into the
    full vocabulary (what engines copy today), chain and tree."""
    batch, k, vocab, draft_vocab = 6, 4, 9000, 700  # two tiles of 8192 entries
    d2t = reduced_vocab(gen, vocab, draft_vocab)
    target = torch.randn(batch, k + 1, vocab, generator=gen) * 2
    target[..., d2t.long()] += 3.0  # the target likes the draft's vocabulary, so drafts are often accepted
    draft = target[:, :k, d2t.long()] + 0.5 * torch.randn(batch, k, draft_vocab, generator=gen)
    if not logits:
        target, draft = torch.softmax(target, -1), torch.softmax(draft, -1)
    target, draft = target.to(dtype), draft.to(dtype)
    q = torch.softmax(draft.float(), -1) if logits else draft.float()
    ids = d2t[torch.multinomial(q.reshape(-1, draft_vocab), 1, generator=gen).reshape(batch, k)].int()
    control = 1.0 if logits else False
    full = scatter_full(draft, d2t, vocab, logits)
    got = call(backend, logits, ids, target, draft, seed=torch.arange(batch), offset=0, control=control,
               draft_to_target=d2t)
    want = call(backend, logits, ids, target, full, seed=torch.arange(batch), offset=0, control=control)
    assert torch.equal(got.output_token_ids, want.output_token_ids) and torch.equal(got.num_accepted, want.num_accepted)
    assert (got.num_accepted < k).any() and (got.num_accepted > 0).any()
    # A tree: node n's children drawn without replacement from draft row n; here a root with three children.
    parents = torch.tensor([[-1, 0, 0, 0, 1]]).expand(batch, 5).int().contiguous()
    cand = torch.stack([torch.zeros(batch, dtype=torch.int32), *[d2t[i * 7 % draft_vocab].expand(batch) for i in (1, 2,
                                                                                                                  3)],
                        ids[:, 1]], 1).int()
    tree_rows, tree_draft = target[:, [0, 1, 2, 3, 4]].contiguous(), torch.cat([draft, draft[:, :1]], 1).contiguous()
    ops = BACKENDS[backend]
    fn = ops.tree_speculative_sampling_from_logits if logits else ops.tree_speculative_sampling
    kw = {"temperature": 1.0} if logits else {}
    got = fn(parents, cand, tree_rows, tree_draft, seed=torch.arange(batch), draft_to_target=d2t, **kw)
    want = fn(parents, cand, tree_rows, scatter_full(tree_draft, d2t, vocab, logits), seed=torch.arange(batch), **kw)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def first_two_tokens_law(p0, p1, q0, d2t, n, seed_base, tree):
    """Emitted tokens of n rounds with fixed rows: draft x0 ~ q0 (reduced vocabulary, mapped by d2t); the target is
    p0 at the root and p1 after x0. Returns the first tokens and, for rounds that accepted x0, the second."""
    vocab, draft_vocab = p0.numel(), q0.numel()
    gen = torch.Generator().manual_seed(seed_base)
    x0 = d2t[torch.multinomial(q0, n, replacement=True, generator=gen)].int()
    seeds = torch.arange(n) + seed_base * 10**7
    if not tree:
        target = torch.stack([p0, p1]).expand(n, 2, vocab).contiguous()
        draft = q0.reshape(1, 1, -1).expand(n, 1, draft_vocab).contiguous()
        out = specdec_ext.chain_speculative_sampling(x0.unsqueeze(1), target, draft, seed=seeds, draft_to_target=d2t)
    else:  # the chain as a tree: root -> x0
        parents = torch.tensor([-1, 0]).expand(n, 2).int().contiguous()
        cand = torch.stack([torch.zeros(n, dtype=torch.int32), x0], 1)
        target = torch.stack([p0, p1]).expand(n, 2, vocab).contiguous()
        draft = torch.stack([q0, q0]).expand(n, 2, draft_vocab).contiguous()
        out = specdec_ext.tree_speculative_sampling(parents, cand, target, draft, seed=seeds, draft_to_target=d2t)
    tokens, accepted = out.output_token_ids, out.num_accepted
    return tokens[:, 0].long(), tokens[accepted == 1, 1].long()


@pytest.mark.parametrize("tree", [False, True])
def test_reduced_draft_vocabulary_law(tree):
    """The emitted tokens have the target's law when the draft lives on a reduced vocabulary: q is 0 off the map, so
    target tokens the draft cannot propose still come out (by residual resampling) with their probability.
    Power: n = 120,000 rounds; moving 1% of mass between two tokens of probability >= 0.05 is a chi-square
    noncentrality of at least 120000 * 2 * 0.01^2 / 0.1 = 240 on 11 degrees of freedom: caught with probability
    > 0.999 at the test's alpha = 1e-4."""
    vocab, draft_vocab, n = 12, 7, 120_000
    gen = torch.Generator().manual_seed(5)
    d2t = torch.tensor([3, 0, 7, 11, 5, 9, 1], dtype=torch.int32)
    p0 = torch.softmax(torch.randn(vocab, generator=gen), 0).double()
    p1 = torch.softmax(torch.randn(vocab, generator=gen), 0).double()
    q0 = torch.softmax(torch.randn(draft_vocab, generator=gen) + 1.0, 0).double()
    first, second = first_two_tokens_law(p0.float(), p1.float(), q0.float(), d2t, n, 5, tree)
    for tokens, p in ((first, p0), (second, p1)):
        counts = torch.bincount(tokens, minlength=vocab).double()
        chi2 = float(((counts - p * counts.sum()) ** 2 / (p * counts.sum())).sum())
        assert stats.chi2.sf(chi2, vocab - 1) > 1e-4, f"chi2 = {chi2:.1f} on {vocab - 1} dof"
    assert second.numel() > 0.2 * n


@pytest.mark.parametrize("backend", ["cpu", "sim"])
def test_limits_k128_large_vocab(gen, backend):
    """K = 128 draft tokens; V = 262,208 (Gemma 3) and 2^20: CPU == emulator bit for bit, acceptance as the
    reference."""
    for batch, k, vocab in ((2, 128, 64), (2, 3, 262_208), (1, 2, 2**20)):
        logits = torch.randn(batch, k + 1, vocab, generator=gen)
        hot = torch.randint(0, vocab, (batch, k + 1), generator=gen)
        logits.scatter_(-1, hot.unsqueeze(-1), 12.0)  # peaked rows, so that drafts of the hot tokens pass
        ids = hot[:, :k].int().clone()
        ids[:, k // 2] = (ids[:, k // 2] + 1) % vocab  # one likely rejection midway
        out = BACKENDS[backend].chain_speculative_sampling_from_logits(ids, logits, None, temperature=1.0,
                                                                       seed=torch.arange(batch), offset=3)
        ref = reference.chain_speculative_sampling_from_logits(ids, logits, temperature=1.0, seed=torch.arange(batch),
                                                               offset=3)
        assert torch.equal(out.num_accepted, ref[1])
        if backend == "sim":
            cpu = specdec_ext.chain_speculative_sampling_from_logits(ids, logits, None, temperature=1.0,
                                                                     seed=torch.arange(batch), offset=3)
            assert torch.equal(cpu.output_token_ids, out.output_token_ids)
        assert ((out.output_token_ids[:, :1] >= 0) & (out.output_token_ids[:, :1] < vocab)).all()


@pytest.mark.parametrize("backend", ["cpu", "sim"])
def test_tree_caller_uniforms(gen, backend):
    """uniforms[b, c] is node c's draw: a chain-shaped tree with the chain's uniforms shifted one column right is the
    chain op, bit for bit; CPU == emulator."""
    batch, k, vocab = 6, 4, 300
    padded, _ = ragged_batch(gen, batch, k, vocab, full=True)
    ids = padded["ids"]
    parents = torch.arange(-1, k).expand(batch, k + 1).int().contiguous()
    cand = torch.cat([torch.zeros(batch, 1, dtype=torch.int32), ids], 1)
    u_tree = torch.cat([torch.full((batch, 1), 0.5), padded["uniforms"]], 1)
    ops = BACKENDS[backend]
    tree = ops.tree_speculative_sampling(parents, cand, padded["target_probs"],
                                         torch.cat([padded["draft_probs"], padded["draft_probs"][:, :1]], 1),
                                         seed=9, uniforms=u_tree, final_uniforms=padded["final_uniforms"])
    chain = ops.chain_speculative_sampling(ids, padded["target_probs"], padded["draft_probs"], seed=10,
                                           uniforms=padded["uniforms"], final_uniforms=padded["final_uniforms"])
    assert torch.equal(tree.num_accepted, chain.num_accepted)
    assert torch.equal(tree.output_token_ids, chain.output_token_ids)


BAD_FLAT = [
    ("decreasing", [2, 1, 4], 4, "cu_num_draft_tokens"),
    ("past T", [1, 3, 9], 4, "cu_num_draft_tokens"),
    ("step above max", [0, 4, 4], 2, "cu_num_draft_tokens"),
    ("negative", [-1, 2, 4], 4, "cu_num_draft_tokens"),
]


@pytest.mark.parametrize("backend", ["cpu", "sim"])
@pytest.mark.parametrize("case", BAD_FLAT, ids=[c[0] for c in BAD_FLAT])
def test_bad_flat_layouts_raise(gen, backend, case):
    _, cu, max_k, name = case
    total, vocab, batch = 4, 50, 3
    probs = torch.softmax(torch.randn(total + batch, vocab, generator=gen), -1)
    ids = torch.randint(0, vocab, (total,), generator=gen, dtype=torch.int32)
    def fn():
        return BACKENDS[backend].chain_speculative_sampling(
            ids, probs, None, seed=0, cu_num_draft_tokens=torch.tensor(cu, dtype=torch.int32), max_draft_tokens=max_k)
    with pytest.raises(ValueError, match=name):
        with_strict(backend, fn)
    if backend == "sim":  # without strict mode: defined outputs, the inconsistent request emits nothing
        out = fn()
        assert ((out.output_token_ids >= -1) & (out.output_token_ids < vocab)).all()


@pytest.mark.parametrize("backend", ["cpu", "sim"])
@pytest.mark.parametrize("width", [3, 7])
def test_flat_out_of_the_wrong_width_is_refused(gen, backend, width):
    """The flat form's K is max_draft_tokens: an out= narrower or wider than max_draft_tokens + 1 is refused and
    named (the op itself reads K off out's width: it would decode with that K, or blame cu_num_draft_tokens)."""
    batch, max_k, vocab = 4, 5, 60
    padded, flat = ragged_batch(gen, batch, max_k, vocab, torch.float32)
    ops = BACKENDS[backend]
    out = (torch.full((batch, width), -77, dtype=torch.int32), torch.full((batch,), -77, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"out's output_token_ids must be \[B, max_draft_tokens \+ 1\] = \[4, 6\]"):
        ops.chain_speculative_sampling(flat["ids"], flat["target_probs"], None, seed=0, cu_num_draft_tokens=flat["cu"],
                                       max_draft_tokens=max_k, out=out)
    assert (out[0] == -77).all() and (out[1] == -77).all()  # nothing written
    trees, tree_flat = padded_and_flat_trees(gen, 3, 4, 30)
    for name in ("output_token_ids", "accepted_nodes"):
        tree_out = [torch.zeros(3, 4, dtype=torch.int32), torch.zeros(3, 4, dtype=torch.int32),
                    torch.zeros(3, dtype=torch.int32)]
        tree_out[0 if name == "output_token_ids" else 1] = torch.zeros(3, width, dtype=torch.int32)
        with pytest.raises(ValueError, match=f"out's {name} must be"):
            ops.tree_speculative_sampling(tree_flat["parents"], tree_flat["cand"], tree_flat["target_probs"], None,
                                          seed=0, cu_num_draft_tokens=tree_flat["cu"], max_draft_tokens=3,
                                          out=tuple(tree_out))


@pytest.mark.parametrize("backend", ["cpu", "sim"])
def test_non_contiguous_out_says_so(gen, backend):
    """An out= tensor of the right shape and dtype but strided: the message says what is wrong with it."""
    batch, k, vocab = 3, 2, 40
    probs = torch.softmax(torch.randn(batch, k + 1, vocab, generator=gen), -1)
    ids = torch.randint(0, vocab, (batch, k), generator=gen, dtype=torch.int32)
    strided = torch.zeros(batch, 2, dtype=torch.int32)[:, 0]
    with pytest.raises(ValueError, match=r"num_accepted must be a contiguous \[B\] = \[3\] Int tensor, got \[3\] Int "
                                         r"\(not contiguous\)"):
        BACKENDS[backend].chain_speculative_sampling(ids, probs, None, seed=0,
                                                     out=(torch.zeros(batch, k + 1, dtype=torch.int32), strided))
    strided = torch.zeros(batch, 2 * (k + 1), dtype=torch.int32)[:, ::2]
    with pytest.raises(ValueError, match=r"output_token_ids must be a contiguous .* \(not contiguous\)"):
        BACKENDS[backend].chain_speculative_sampling(ids, probs, None, seed=0,
                                                     out=(strided, torch.zeros(batch, dtype=torch.int32)))


@pytest.mark.parametrize("backend", ["cpu", "sim"])
def test_bad_engine_arguments_raise(gen, backend):
    batch, k, vocab = 3, 2, 40
    probs = torch.softmax(torch.randn(batch, k + 1, vocab, generator=gen), -1)
    draft = torch.softmax(torch.randn(batch, k, 6, generator=gen), -1)
    ids = torch.randint(0, 6, (batch, k), generator=gen, dtype=torch.int32)
    ops = BACKENDS[backend]
    cases = [
        (dict(draft_to_target=torch.tensor([1, 2, 3, 3, 4, 5], dtype=torch.int32)), "draft_to_target"),
        (dict(draft_to_target=torch.tensor([1, 2, 3, 40, 4, 5], dtype=torch.int32)), "draft_to_target"),
        (dict(draft_to_target=torch.tensor([1, 2, 3, -1, 4, 5], dtype=torch.int32)), "draft_to_target"),
        (dict(draft_to_target=torch.arange(5, dtype=torch.int32)), "draft_to_target"),
        (dict(draft_to_target=torch.arange(6, dtype=torch.int32), uniforms=torch.tensor([[0.5, 1.0]] * 3)), "uniforms"),
        (dict(draft_to_target=torch.arange(6, dtype=torch.int32), uniforms=torch.tensor([[0.5, -0.1]] * 3)),
         "uniforms"),
        (dict(draft_to_target=torch.arange(6, dtype=torch.int32), uniforms=torch.full((3, 2), float("nan"))),
         "uniforms"),
        (dict(draft_to_target=torch.arange(6, dtype=torch.int32), uniforms=torch.zeros(3, 3)), "uniforms"),
        (dict(draft_to_target=torch.arange(6, dtype=torch.int32), uniforms=torch.zeros(3, 2, dtype=torch.float64)),
         "uniforms"),
        (dict(draft_to_target=torch.arange(6, dtype=torch.int32), final_uniforms=torch.tensor([0.1, 0.2, 1.5])),
         "final_uniforms"),
        (dict(draft_to_target=torch.arange(6, dtype=torch.int32), max_draft_tokens=2), "max_draft_tokens"),
    ]
    for kw, name in cases:
        with pytest.raises(ValueError, match=name):
            with_strict(backend, lambda: ops.chain_speculative_sampling(ids, probs, draft, seed=0, **kw))
    with pytest.raises(ValueError, match="max_draft_tokens"):
        ops.chain_speculative_sampling(ids.reshape(-1), probs.reshape(-1, vocab)[:batch * k], None, seed=0,
                                       cu_num_draft_tokens=torch.tensor([2, 4, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="draft_to_target"):  # a map without draft rows
        ops.chain_speculative_sampling(ids, probs, None, seed=0, draft_to_target=torch.arange(6, dtype=torch.int32))


@pytest.mark.parametrize("rewrite", ["numpy", "data"])
def test_draft_to_target_rewritten_in_place_is_read_again(gen, rewrite):
    """A map rewritten in place without bumping its version counter (through numpy or `.data`) is the new map: the
    outputs follow its contents, and an invalid rewrite raises, as a fresh tensor would."""
    batch, k, vocab, draft_vocab = 8, 4, 400, 50
    first = reduced_vocab(gen, vocab, draft_vocab)
    target = torch.randn(batch, k + 1, vocab, generator=gen)
    draft = torch.softmax(torch.randn(batch, k, draft_vocab, generator=gen), -1)
    ids = first[torch.randint(0, draft_vocab, (batch, k), generator=gen)].int()
    target[..., first.long()] += 6.0  # the first map's columns are likely: its drafts are accepted
    target = torch.softmax(target, -1)
    d2t = first.clone()
    specdec_ext.chain_speculative_sampling(ids, target, draft, seed=torch.arange(batch), draft_to_target=d2t)
    second = torch.roll(first, 1)  # the same ids on other columns: other draft probabilities for each id
    version = d2t._version
    if rewrite == "numpy":
        d2t.numpy()[:] = second.numpy()
    else:
        d2t.data.copy_(second)
    assert d2t._version == version or rewrite == "data", "the rewrite must not be visible to the version counter"
    got = specdec_ext.chain_speculative_sampling(ids, target, draft, seed=torch.arange(batch), draft_to_target=d2t)
    want = specdec_ext.chain_speculative_sampling(ids, target, draft, seed=torch.arange(batch),
                                                  draft_to_target=second.clone())
    stale = specdec_ext.chain_speculative_sampling(ids, target, draft, seed=torch.arange(batch),
                                                   draft_to_target=first.clone())
    assert torch.equal(got.output_token_ids, want.output_token_ids) and torch.equal(got.num_accepted, want.num_accepted)
    assert not torch.equal(want.num_accepted, stale.num_accepted), "the two maps must give different outputs"
    d2t.numpy()[3] = d2t.numpy()[4]  # an id twice: refused, however the map got there
    with pytest.raises(ValueError, match="draft_to_target"):
        specdec_ext.chain_speculative_sampling(ids, target, draft, seed=torch.arange(batch), draft_to_target=d2t)


def test_opcheck_engine_layouts(gen):
    batch, max_k, vocab = 4, 3, 100
    padded, flat = ragged_batch(gen, batch, max_k, vocab)
    d2t = reduced_vocab(gen, vocab, 60)
    for ns in (torch.ops.specdec, torch.ops.specdec_sim):
        args = (flat["ids"], flat["target_logits_nobonus"], torch.randn(flat["ids"].numel(), 60, generator=gen), None,
                torch.full((batch,), 0.8), padded["seed"], padded["offset"], torch.full((batch, max_k + 1), -7,
                dtype=torch.int32), torch.zeros(batch, dtype=torch.int32), None)
        t2d = torch.full((vocab,), -1, dtype=torch.int32)
        t2d[d2t.long()] = torch.arange(60, dtype=torch.int32)
        kwargs = dict(cu_num_draft_tokens=flat["cu"], bonus_token_ids=padded["bonus"], uniforms=flat["uniforms"],
                      final_uniforms=padded["final_uniforms"], target_to_draft=t2d,
                      accepted_independently=torch.zeros(batch, dtype=torch.int32))
        torch.library.opcheck(ns.chain_speculative_sampling_from_logits.default, args, kwargs)


@pytest.mark.parametrize("backend", ["cpu", "sim"])
@pytest.mark.parametrize("logits", [False, True])
@pytest.mark.parametrize("with_draft", [True, False])
def test_flat_trees_equal_padded(gen, backend, logits, with_draft):
    batch, max_nodes, vocab = 14, 9, 120
    padded, flat = padded_and_flat_trees(gen, batch, max_nodes, vocab)
    kind = "logits" if logits else "probs"
    ops = BACKENDS[backend]
    fn = ops.tree_speculative_sampling_from_logits if logits else ops.tree_speculative_sampling
    control = {"temperature": torch.tensor([0.0, 0.8, 1.0, 1.2, 0.0, 0.9, 1.5]).repeat(2)} if logits else \
        {"greedy": torch.tensor([True, False, False, False, True, False, False]).repeat(2)}
    keys = dict(seed=torch.arange(batch) * 7 + 1, offset=torch.arange(batch), **control)
    for extra in ({}, {"uniforms": True, "final_uniforms": torch.rand(batch, generator=gen)}):
        u = {"uniforms": padded["uniforms"]} if extra else {}
        fu = {"final_uniforms": extra["final_uniforms"]} if extra else {}
        want = fn(padded["parents"], padded["cand"], padded[f"target_{kind}"],
                  padded[f"draft_{kind}"] if with_draft else None, num_nodes=padded["num_nodes"], **u, **fu, **keys)
        got = fn(flat["parents"], flat["cand"], flat[f"target_{kind}"], flat[f"draft_{kind}"] if with_draft else None,
                 cu_num_draft_tokens=flat["cu"], max_draft_tokens=max_nodes - 1,
                 **({"uniforms": flat["uniforms"]} if extra else {}), **fu, **keys)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        assert (want.num_accepted >= 2).any(), "some path must go deeper than one node"
    ref_fn = reference.tree_speculative_sampling_from_logits if logits else reference.tree_speculative_sampling
    ref = ref_fn(flat["parents"], flat["cand"], flat[f"target_{kind}"], flat[f"draft_{kind}"] if with_draft else None,
                 cu_num_draft_tokens=flat["cu"], max_draft_tokens=max_nodes - 1, uniforms=flat["uniforms"],
                 final_uniforms=extra["final_uniforms"], **keys)
    if not logits:  # from probabilities the reference agrees on every decision
        assert torch.equal(got.num_accepted, ref[2]) and torch.equal(got.accepted_nodes, ref[1])


@pytest.mark.parametrize("backend", ["cpu", "sim"])
def test_bad_flat_trees_raise(gen, backend):
    padded, flat = padded_and_flat_trees(gen, 3, 4, 30)
    fn = BACKENDS[backend].tree_speculative_sampling
    bad_cu = flat["cu"].clone()
    bad_cu[1] = bad_cu[2] + 1  # decreasing
    with pytest.raises(ValueError, match="cu_num_draft_tokens"):
        with_strict(backend, lambda: fn(flat["parents"], flat["cand"], flat["target_probs"], None, seed=0,
                                        cu_num_draft_tokens=bad_cu, max_draft_tokens=3))
    with pytest.raises(ValueError, match="max_draft_tokens"):
        fn(flat["parents"], flat["cand"], flat["target_probs"], None, seed=0, cu_num_draft_tokens=flat["cu"])
    with pytest.raises(ValueError, match="num_nodes"):
        fn(flat["parents"], flat["cand"], flat["target_probs"], None, seed=0, cu_num_draft_tokens=flat["cu"],
           max_draft_tokens=3, num_nodes=padded["num_nodes"])
