"""Caller normalisers (target_lse, draft_lse) of the from-logits sampling ops, and logits_normalizer, which computes
them as the kernels do.

- logits_normalizer is ln sum exp(logits / T) over each processed row (float64 check), the same bits on the CPU and
  under the emulator for every split of a row over blocks, +inf for greedy rows and -inf for rows without mass.
- With normalisers the CPU kernel and the emulated CUDA kernel agree bit for bit for every split the launcher can
  pick, chain and tree, padded and flat, token and block verification, row filters, every dtype, K = 0 and 128.
- The kernels use the caller's value: p(x) = exp(x / T - lse), so a normaliser raised by ln 2 halves every acceptance
  probability (decided at uniforms on either side of the boundary); the helper's own values give the tokens of the
  call without normalisers on these inputs; a non-finite entry is ignored (that row's statistics are computed).
- Strict mode catches a normaliser off its row's by more than 2^-14 + 2^-20 |lse|, naming target_lse or draft_lse;
  within that it passes. Wrong shapes, dtypes and devices raise naming the argument."""
import math

import pytest
import torch

import specdec_ext
from helpers.sampling_inputs import make_chain_inputs, make_tree_inputs, padded_and_flat_trees, ragged_batch
from specdec_ext import reference, sim

BACKENDS = {"cpu": specdec_ext, "sim": sim}
SLICES = [1, 2, 32]  # one block, the smallest split and the largest (test_sampling_slices covers every split)
VOCAB = 8203  # two tiles, the second partial, not a multiple of 8


@pytest.fixture(params=SLICES, ids=lambda s: f"slices{s}")
def slices(request, monkeypatch):
    monkeypatch.setenv("SPECDEC_SAMPLING_SLICES", str(request.param))
    return request.param


def assert_equal_outputs(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y), (x, y)


def lse_float64(logits, temperature, **filters):
    """ln sum exp(x / T) over each row [B, V] processed by the controls (reference.filter_logits), in float64;
    temperature [B]."""
    x = reference.filter_logits(logits.double(), temperature, **filters)
    return torch.logsumexp(x / temperature.double()[:, None], -1)


# ------------------------------------------------------------------------------------------ logits_normalizer

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_helper_is_the_rows_log_sum_exp_on_every_backend_and_split(slices, dtype, gen):
    logits = (torch.randn(3, 4, VOCAB, generator=gen) * 3).to(dtype)  # [B, R, V]: any leading shape
    temperature = torch.tensor([0.6, 1.0, 1.7]).repeat_interleave(4).reshape(3, 4)
    cpu = specdec_ext.logits_normalizer(logits, temperature=temperature)
    emu = sim.logits_normalizer(logits, temperature=temperature)
    assert cpu.shape == (3, 4) and cpu.dtype == torch.float32
    assert torch.equal(cpu, emu)
    exact = torch.logsumexp(logits.double() / temperature[..., None].double(), -1)
    assert torch.allclose(cpu.double(), exact, rtol=2e-7, atol=2e-6)


def test_the_helper_processes_rows_as_the_ops_do(gen):
    batch = 6
    logits = torch.randn(batch, 3000, generator=gen) * 2
    logits[5, 100:] = float("-inf")
    controls = {"top_k": torch.tensor([0, 5, 0, 50, 0, 0], dtype=torch.int32),
                "top_p": torch.tensor([1.0, 1.0, 0.8, 0.9, 1.0, 1.0]),
                "min_p": torch.tensor([0.0, 0.0, 0.0, 0.1, 0.2, 0.0])}
    temperature = torch.tensor([0.9, 1.2, 0.5, 1.0, 0.7, 1.0])
    for be in BACKENDS.values():
        got = be.logits_normalizer(logits, temperature=temperature, **controls)
        exact = lse_float64(logits, temperature, **controls)
        assert torch.allclose(got.double(), exact, rtol=2e-7, atol=2e-6), (got, exact)
    # Greedy rows (temperature below the threshold) get +inf, rows without mass -inf.
    empty = torch.full((2, 50), float("-inf"))
    for be in BACKENDS.values():
        assert be.logits_normalizer(logits[:2], temperature=0.0).tolist() == [math.inf, math.inf]
        assert be.logits_normalizer(empty, temperature=1.0).tolist() == [-math.inf, -math.inf]


def test_the_helpers_errors_name_its_arguments():
    logits = torch.randn(2, 10)
    for be in BACKENDS.values():
        with pytest.raises(ValueError, match="logits_normalizer: temperature must be"):
            be.logits_normalizer(logits, temperature=torch.ones(3))
        with pytest.raises(ValueError, match="logits_normalizer.*temperature"):
            be.logits_normalizer(logits, temperature=-1.0)
        with pytest.raises(ValueError, match="logits_normalizer.*top_p"):
            be.logits_normalizer(logits, temperature=1.0, top_p=1.5)
    bad = logits.clone()
    bad[1, 3] = float("nan")
    with pytest.raises(ValueError, match="logits_normalizer.*logits holds NaN"):
        specdec_ext.logits_normalizer(bad, temperature=1.0)


# --------------------------------------------------------------------- the ops with the caller's normalisers

def chain_normalizers(be, inp, temperature):
    """The helper's normalisers of a padded chain's target [B, K+1, V] and draft [B, K, V] rows."""
    k1 = inp["target_logits"].shape[1]
    target = be.logits_normalizer(inp["target_logits"], temperature=temperature[:, None].expand(-1, k1))
    draft = None
    if inp["draft_logits"] is not None:
        draft = be.logits_normalizer(inp["draft_logits"], temperature=temperature[:, None].expand(-1, k1 - 1))
    return target, draft


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("with_draft", [True, False], ids=["draft", "point"])
@pytest.mark.parametrize("verification", ["token", "block"])
def test_chain_with_normalizers_is_bit_exact_across_backends(slices, dtype, with_draft, verification, gen):
    batch, k = 6, 4
    inp = make_chain_inputs(gen, batch, k, VOCAB, dtype, with_draft, sharpness=1.0)
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.6, 0.9, 0.4])
    target_lse, draft_lse = chain_normalizers(specdec_ext, inp, temperature)
    # Exact normalisers, and ones moved by a few thousandths (a caller's own, or a wrong one: defined either way).
    shifted = (target_lse + 3e-3 * torch.randn(target_lse.shape, generator=gen),
               None if draft_lse is None else draft_lse - 2e-3 * torch.rand(draft_lse.shape, generator=gen))
    for lse in ((target_lse, draft_lse), shifted):
        outs = [be.chain_speculative_sampling_from_logits(
            inp["ids"], inp["target_logits"], inp["draft_logits"], temperature=temperature,
            num_draft_tokens=inp["num_draft_tokens"], seed=inp["seed"], offset=inp["offset"],
            verification=verification, target_lse=lse[0], draft_lse=lse[1], top_k=torch.tensor([0, 0, 40, 0, 0, 0]),
            top_p=torch.tensor([1.0, 0.9, 1.0, 1.0, 0.95, 1.0])) for be in BACKENDS.values()]
        assert_equal_outputs(*outs)


@pytest.mark.parametrize("k", [0, 128])
def test_chain_extreme_draft_counts_with_normalizers(k, gen):
    batch, vocab = 2, 300
    inp = make_chain_inputs(gen, batch, k, vocab, sharpness=0.5)
    inp["num_draft_tokens"][:] = k
    temperature = torch.tensor([0.8, 1.3])
    target_lse, draft_lse = chain_normalizers(specdec_ext, inp, temperature)
    outs = [be.chain_speculative_sampling_from_logits(
        inp["ids"], inp["target_logits"], inp["draft_logits"], temperature=temperature,
        num_draft_tokens=inp["num_draft_tokens"], seed=inp["seed"], offset=inp["offset"], target_lse=target_lse,
        draft_lse=draft_lse) for be in BACKENDS.values()]
    assert_equal_outputs(*outs)


def test_flat_chain_with_normalizers(slices, gen):
    batch, max_k = 5, 3
    padded, flat = ragged_batch(gen, batch, max_k, 9000, torch.bfloat16)
    temperature = torch.tensor([0.0, 0.5, 1.0, 1.3, 0.8])
    rows = (flat["cu"] - torch.cat([torch.zeros(1, dtype=torch.int32), flat["cu"][:-1]])).long()
    target_t = temperature.repeat_interleave(rows + 1)  # request b's k_b rows and its bonus row
    draft_t = temperature.repeat_interleave(rows)
    target_lse = specdec_ext.logits_normalizer(flat["target_logits"], temperature=target_t)
    draft_lse = specdec_ext.logits_normalizer(flat["draft_logits"], temperature=draft_t)
    for lse in ((target_lse, draft_lse), (target_lse + 0.01, draft_lse - 0.02)):
        outs = [be.chain_speculative_sampling_from_logits(
            flat["ids"], flat["target_logits"], flat["draft_logits"], cu_num_draft_tokens=flat["cu"],
            max_draft_tokens=max_k, temperature=temperature, seed=padded["seed"], offset=padded["offset"],
            uniforms=flat["uniforms"], final_uniforms=padded["final_uniforms"], target_lse=lse[0],
            draft_lse=lse[1]) for be in BACKENDS.values()]
        assert_equal_outputs(*outs)
        # The flat rows are found as the padded ones: the padded call with the same normalisers agrees.
        padded_target = torch.full((batch, max_k + 1), float("nan"))
        padded_draft = torch.full((batch, max_k), float("nan"))
        start = 0
        for b in range(batch):
            n = int(rows[b])
            padded_target[b, :n + 1] = lse[0][start + b:start + b + n + 1]
            padded_draft[b, :n] = lse[1][start:start + n]
            start += n
        assert_equal_outputs(outs[0], specdec_ext.chain_speculative_sampling_from_logits(
            padded["ids"], padded["target_logits"], padded["draft_logits"], num_draft_tokens=padded["num_draft_tokens"],
            temperature=temperature, seed=padded["seed"], offset=padded["offset"], uniforms=padded["uniforms"],
            final_uniforms=padded["final_uniforms"], target_lse=padded_target, draft_lse=padded_draft))


@pytest.mark.parametrize("with_draft", [True, False], ids=["draft", "point"])
def test_trees_with_normalizers(slices, with_draft, gen):
    batch, n = 4, 10
    inp = make_tree_inputs(gen, batch, n, VOCAB, with_draft=with_draft)
    temperature = torch.tensor([0.7, 0.0, 1.2, 1.0])
    t = temperature[:, None].expand(-1, n)
    target_lse = specdec_ext.logits_normalizer(inp["target_logits"], temperature=t)
    draft_lse = specdec_ext.logits_normalizer(inp["draft_logits"], temperature=t) if with_draft else None
    outs = [be.tree_speculative_sampling_from_logits(
        inp["parents"], inp["tokens"], inp["target_logits"], inp["draft_logits"], num_nodes=inp["num_nodes"],
        temperature=temperature, seed=inp["seed"], offset=inp["offset"], target_lse=target_lse, draft_lse=draft_lse)
        for be in BACKENDS.values()]
    assert_equal_outputs(*outs)


def test_flat_trees_with_normalizers(gen):
    batch, max_nodes = 4, 6
    padded, flat = padded_and_flat_trees(gen, batch, max_nodes, 500)
    temperature = torch.tensor([0.9, 1.1, 0.6, 1.0])
    t = temperature.repeat_interleave(padded["num_nodes"].long())
    target_lse = specdec_ext.logits_normalizer(flat["target_logits"], temperature=t) + 0.01
    draft_lse = specdec_ext.logits_normalizer(flat["draft_logits"], temperature=t) - 0.01
    seed, offset = torch.arange(batch) + 5, torch.arange(batch) * 7
    outs = [be.tree_speculative_sampling_from_logits(
        flat["parents"], flat["cand"], flat["target_logits"], flat["draft_logits"], cu_num_draft_tokens=flat["cu"],
        max_draft_tokens=max_nodes - 1, temperature=temperature, seed=seed, offset=offset, target_lse=target_lse,
        draft_lse=draft_lse) for be in BACKENDS.values()]
    assert_equal_outputs(*outs)
    # The flat nodes' normalisers are found as the padded ones: the padded call with them agrees.
    padded_lse = [torch.full((batch, max_nodes), float("nan")) for _ in range(2)]
    start = 0
    for b in range(batch):
        n = int(padded["num_nodes"][b])
        for dst, src in zip(padded_lse, (target_lse, draft_lse)):
            dst[b, :n] = src[start:start + n]
        start += n
    assert_equal_outputs(outs[0], specdec_ext.tree_speculative_sampling_from_logits(
        padded["parents"], padded["cand"], padded["target_logits"], padded["draft_logits"],
        num_nodes=padded["num_nodes"], temperature=temperature, seed=seed, offset=offset, target_lse=padded_lse[0],
        draft_lse=padded_lse[1]))


# ------------------------------------------------------------------------------ what the caller's value does

@pytest.mark.parametrize("backend", BACKENDS)
def test_the_callers_normalizer_sets_the_acceptance_probability(backend):
    # Point proposal x = 2 at t = 1: p(x) = exp(x_2 - lse). With lse raised by ln 2, p(x) halves: a uniform just below
    # the halved p accepts, one just above rejects (and the unshifted call accepts both).
    be = BACKENDS[backend]
    row = torch.tensor([1.0, 0.5, 2.0, -1.0, 0.0])
    logits = row.expand(8, 2, 5).contiguous()  # [B=8, K+1=2, V=5]
    p = math.exp(2.0 - math.log(sum(math.exp(v) for v in row.tolist())))
    margins = [-3e-3, -1e-3, 1e-3, 3e-3, -2e-2, 2e-2, -0.1, 0.1]
    uniforms = torch.tensor([[p / 2 * (1 + m)] for m in margins])
    lse = specdec_ext.logits_normalizer(logits, temperature=1.0)
    ids = torch.full((8, 1), 2, dtype=torch.int32)

    def accepted(target_lse):
        out = be.chain_speculative_sampling_from_logits(ids, logits, temperature=1.0, seed=0, uniforms=uniforms,
                                                        target_lse=target_lse)
        return out.num_accepted.tolist()

    assert accepted(lse + math.log(2)) == [int(m < 0) for m in margins]
    assert accepted(None) == [1] * 8 and accepted(lse) == [1] * 8
    # Non-finite entries are ignored: the row's own statistics decide.
    assert accepted(torch.full_like(lse, float("nan"))) == [1] * 8
    assert accepted(torch.full_like(lse, float("inf"))) == [1] * 8


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_helpers_values_give_the_tokens_of_the_call_without_them(backend):
    # Not a bit-for-bit guarantee: a decision (an acceptance, or where a residual draw crosses a cumulative sum) that
    # lies within the normaliser's float32 rounding of its boundary may move. Rare, but across fresh inputs not
    # negligible (one run of 2026-12-06 met one; 30 other seeds did not): fixed inputs here, 256 requests and ~1000
    # decisions that all agree.
    gen = torch.Generator().manual_seed(20261206)
    be = BACKENDS[backend]
    batch, k = 256, 4
    inp = make_chain_inputs(gen, batch, k, 600, sharpness=2.0)
    temperature = 0.3 + 1.2 * torch.rand(batch, generator=gen)
    target_lse, draft_lse = chain_normalizers(be, inp, temperature)
    kwargs = dict(temperature=temperature, num_draft_tokens=inp["num_draft_tokens"], seed=inp["seed"],
                  offset=inp["offset"])
    plain = be.chain_speculative_sampling_from_logits(inp["ids"], inp["target_logits"], inp["draft_logits"], **kwargs)
    given = be.chain_speculative_sampling_from_logits(inp["ids"], inp["target_logits"], inp["draft_logits"],
                                                      target_lse=target_lse, draft_lse=draft_lse, **kwargs)
    assert_equal_outputs(plain, given)
    assert 0 < int(plain.num_accepted.sum()) < int(inp["num_draft_tokens"].sum())  # acceptances and rejections


# --------------------------------------------------------------------------------------------- strict mode

@pytest.mark.parametrize("backend", BACKENDS)
def test_strict_mode_catches_a_wrong_normalizer(backend, strict, gen):
    be = BACKENDS[backend]
    batch, k = 4, 3
    inp = make_chain_inputs(gen, batch, k, 700, sharpness=1.5)
    inp["num_draft_tokens"][:] = k
    temperature = torch.tensor([0.8, 1.0, 1.4, 0.6])
    target_lse, draft_lse = chain_normalizers(be, inp, temperature)

    def run(t_lse, d_lse):
        return be.chain_speculative_sampling_from_logits(
            inp["ids"], inp["target_logits"], inp["draft_logits"], temperature=temperature,
            num_draft_tokens=inp["num_draft_tokens"], seed=inp["seed"], offset=inp["offset"], target_lse=t_lse,
            draft_lse=d_lse)

    run(target_lse, draft_lse)  # exact
    tolerance = 2**-14 + 2**-20 * target_lse.abs()
    run(target_lse + 0.5 * tolerance, draft_lse - 3e-5)  # within the tolerance
    wrong = target_lse.clone()
    wrong[:, 0] += 2 * tolerance[:, 0]  # row 0 is read by every request
    with pytest.raises(ValueError, match="target_lse holds a row's normaliser"):
        run(wrong, draft_lse)
    with pytest.raises(ValueError, match="draft_lse holds a row's normaliser"):
        run(target_lse, draft_lse * 1.01)
    # Trees: the same check.
    tree = make_tree_inputs(gen, batch, 5, 700)
    t = temperature[:, None].expand(-1, 5)
    tree_lse = be.logits_normalizer(tree["target_logits"], temperature=t)
    with pytest.raises(ValueError, match="target_lse holds a row's normaliser"):
        be.tree_speculative_sampling_from_logits(tree["parents"], tree["tokens"], tree["target_logits"],
                                                 num_nodes=tree["num_nodes"], temperature=temperature, seed=1,
                                                 offset=2, target_lse=tree_lse - 0.01)
    # A row without mass has no normaliser to match: a finite value for it is flagged too.
    empty = inp["target_logits"].clone()
    empty[0, 0] = float("-inf")
    with pytest.raises(ValueError, match="target_lse holds a row's normaliser"):
        be.chain_speculative_sampling_from_logits(inp["ids"], empty, inp["draft_logits"], temperature=temperature,
                                                  num_draft_tokens=inp["num_draft_tokens"], seed=inp["seed"],
                                                  offset=inp["offset"], target_lse=target_lse, draft_lse=draft_lse)


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_strict_mode_a_wrong_normalizer_is_used(backend, gen):
    be = BACKENDS[backend]
    inp = make_chain_inputs(gen, 2, 2, 100)
    temperature = torch.tensor([1.0, 1.0])
    target_lse, draft_lse = chain_normalizers(be, inp, temperature)
    out = be.chain_speculative_sampling_from_logits(inp["ids"], inp["target_logits"], inp["draft_logits"],
                                                    temperature=temperature, num_draft_tokens=inp["num_draft_tokens"],
                                                    seed=inp["seed"], offset=inp["offset"], target_lse=target_lse + 1,
                                                    draft_lse=draft_lse)
    assert bool(((out.output_token_ids >= -1) & (out.output_token_ids < 100)).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_normalizer_arguments_are_checked(backend):
    be = BACKENDS[backend]
    ids, logits, draft = torch.zeros(2, 3, dtype=torch.int32), torch.randn(2, 4, 50), torch.randn(2, 3, 50)

    def run(**kw):
        return be.chain_speculative_sampling_from_logits(ids, logits, kw.pop("draft", draft), temperature=1.0, seed=0,
                                                         **kw)

    with pytest.raises(ValueError, match=r"target_lse must be a contiguous float32 tensor .*\[2, 4\]"):
        run(target_lse=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="target_lse must be a contiguous float32"):
        run(target_lse=torch.zeros(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"draft_lse must be a contiguous float32 tensor .*\[2, 3\]"):
        run(draft_lse=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="draft_lse normalises draft_logits, which is None"):
        run(draft=None, draft_lse=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="draft_lse is not taken with a draft vocabulary map"):
        run(draft=torch.randn(2, 3, 30), draft_to_target=torch.arange(30), draft_lse=torch.zeros(2, 3))
    with pytest.raises(TypeError, match="target_lse must be a float32 tensor or None"):
        run(target_lse=[0.0, 0.0])
    with pytest.raises(ValueError, match="target_lse is on meta"):
        run(target_lse=torch.zeros(2, 4, device="meta"))
