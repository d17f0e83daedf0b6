"""The vLLM Model Runner V2 shim (specdec_ext.compat.vllm_v2): rejection_sample in vLLM 0.34's layout (logits rows of
request b at cu_num_logits[b]..cu_num_logits[b + 1], draft_sampled the input token of each row, per-request-state
temperature / seed / draft logits through idx_mapping), greedy and placeholder cases against an argmax computed here,
the law of the emitted tokens (token and block verification), seeds by request state, the draft logits' two forms
(0.34's DraftLogitsCache, 0.28-0.33's tensor), refusals, and patch_model_runner_v2 / register() against stand-in
vllm module trees with 0.34's and 0.28's signatures."""
import logging
import sys
import types

import pytest
import torch

from helpers.chi_square import rows_chi_square_pvalue
from helpers.compat_vllm import dirichlet_rows
from specdec_ext.compat import vllm as vllm_shim
from specdec_ext.compat import vllm_v2

V2 = "vllm.v1.worker.gpu.spec_decode"


class DraftLogitsCache:
    """vLLM 0.34's per-request-state draft logits, as the shim reads them: values [rows, K, Vd] (pre-temperature) and
    row_mapping [max_num_reqs] (None: the request state's own row)."""

    def __init__(self, values, row_mapping=None):
        self.values, self.row_mapping = values, row_mapping


def layout(drafts, last_tokens=None):
    """V2's layout of requests with these drafts ([b] lists; -1 a placeholder): (draft_sampled [num_logits] int64,
    cu_num_logits [num_reqs + 1] int32). Row cu[b] + i holds draft i's input token: the last emitted token, then the
    drafts; the bonus row's input is the last draft."""
    sampled, cu = [], [0]
    for b, ds in enumerate(drafts):
        sampled += [100 + b if last_tokens is None else last_tokens[b]] + list(ds)
        cu.append(len(sampled))
    return torch.tensor(sampled, dtype=torch.int64), torch.tensor(cu, dtype=torch.int32)


def call(target_logits, drafts, *, temperature, seed=None, pos0=None, idx_mapping=None, cache=None, k=None,
         **kwargs):
    """rejection_sample on requests with these drafts; temperature / seed by request state (idx_mapping: the state of
    each request, default b), pos0: the position of each request's first row."""
    draft_sampled, cu = layout(drafts)
    batch, num_logits = len(drafts), draft_sampled.numel()
    idx = torch.arange(batch) if idx_mapping is None else torch.as_tensor(idx_mapping)
    states = int(idx.max()) + 1 if batch else 1
    temperature = torch.as_tensor(temperature, dtype=torch.float32).expand(states).contiguous()
    seed = torch.arange(states, dtype=torch.int64) + 7 if seed is None else torch.as_tensor(seed, dtype=torch.int64)
    first = torch.tensor([0] + [100 * b for b in range(1, batch)]) if pos0 is None else torch.as_tensor(pos0)
    pos = torch.cat([first[b] + torch.arange(len(ds) + 1) for b, ds in enumerate(drafts)]) if batch else \
        torch.zeros(0, dtype=torch.int64)
    owner = torch.repeat_interleave(idx, torch.tensor([len(ds) + 1 for ds in drafts])) if batch else pos
    local = torch.cat([torch.arange(len(ds) + 1) for ds in drafts]) if batch else pos
    k = max((len(ds) for ds in drafts), default=0) if k is None else k
    assert target_logits.shape[0] == num_logits
    return vllm_v2.rejection_sample(target_logits, cache, draft_sampled, cu, pos, idx, owner, local, temperature, seed,
                                    k, **kwargs)


def poisoned_logits(rows, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3 + 1.5


# ----------------------------------------------------------------------------------------------- greedy, layout

def expected_greedy(logits, drafts):
    """Accept while the draft is the target row's argmax; then that row's argmax (the bonus row's after all)."""
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


@pytest.mark.parametrize("block", [False, True], ids=["token", "block"])
def test_greedy_requests_accept_the_targets_argmax_prefix(block):
    """Ragged drafts (0 to 4, one request without drafts), placeholders ending drafts early, drafts equal to the
    argmax planted at chosen positions: every request's tokens are computed here from the target's argmax."""
    vocab = 40
    drafts = [[0, 0, 0, 0], [0, 0], [], [0, 0, 0], [0, -1, -1], [0, 0, 0, 0]]
    rows = sum(len(d) + 1 for d in drafts)
    logits = poisoned_logits(rows, vocab, seed=3)
    argmax, row = logits.argmax(-1).tolist(), 0
    accept = [4, 1, 0, 3, 1, 2]  # drafts equal to the argmax, then one that differs (or a placeholder)
    for b, ds in enumerate(drafts):
        for i in range(len(ds)):
            if ds[i] >= 0:
                ds[i] = argmax[row + i] if i < accept[b] else (argmax[row + i] + 1) % vocab
        row += len(ds) + 1
    sampled, num_sampled = call(logits, drafts, temperature=0.0, use_block_verification=block)
    want = expected_greedy(logits, drafts)
    assert sampled.dtype == torch.int64 and num_sampled.dtype == torch.int32
    assert sampled.shape == (len(drafts), 5) and num_sampled.shape == (len(drafts),)
    assert num_sampled.tolist() == [len(w) for w in want] == [5, 2, 1, 4, 2, 3]
    for b, w in enumerate(want):
        assert sampled[b].tolist() == w + [-1] * (5 - len(w)), b


def test_a_placeholder_ends_the_drafts_and_the_last_token_comes_from_its_row():
    vocab = 16
    logits = poisoned_logits(4, vocab, seed=5)
    argmax = logits.argmax(-1).tolist()
    sampled, num_sampled = call(logits, [[argmax[0], -1, -1]], temperature=0.0)
    assert num_sampled.tolist() == [2] and sampled[0].tolist() == [argmax[0], argmax[1], -1, -1]


# -------------------------------------------------------------------------------------------------------- law

def markov_requests(n, vocab, seed, temperature):
    """n requests of k = 2 drafts: x0 ~ q0, x1 ~ q1[x0]; target rows p0, p1[x0], p2[x1] as processed logits (log p:
    vLLM's logits after its temperature) and the draft rows as vLLM stores them, pre-temperature: temperature *
    log q, which the shim must divide by the request's temperature to get q back."""
    torch.manual_seed(seed)
    p0, q0 = dirichlet_rows(vocab), dirichlet_rows(vocab)
    p1, q1, p2 = (dirichlet_rows(vocab, vocab) for _ in range(3))
    x0 = torch.multinomial(q0, n, replacement=True)
    x1 = torch.multinomial(q1[x0], 1).squeeze(-1)
    target = torch.stack([p0.expand(n, vocab), p1[x0], p2[x1]], 1).log()            # [n, 3, V]
    draft = torch.stack([q0.expand(n, vocab), q1[x0]], 1).log() * temperature         # [n, 2, V]
    drafts = torch.stack([x0, x1], 1).tolist()
    return target.reshape(3 * n, vocab), draft, drafts, p0, p1


@pytest.mark.parametrize("form", ["cache", "tensor", "point"])
def test_emitted_tokens_follow_the_target(form):
    """200,000 requests (each its own seed slot), V = 6, Dirichlet(2) rows, temperature 0.5. The first token has the
    law p0; after an accepted first draft the second has p1[x0], row by row. Moving 1% of probability between two
    tokens of p0 (~1/6 each) gives a noncentrality of 200,000 * 2 * 0.01^2 * 6 = 240 at 5 dof: power ~1 at the
    1e-4 level. A shim that read the draft logits at the wrong temperature (q^2 here) or from another request's
    state fails it. Point proposals (no draft logits): the drafts are judged as one-hot q."""
    n, vocab, temperature = 200_000, 6, 0.5
    target, draft, drafts, p0, p1 = markov_requests(n, vocab, seed=1234, temperature=temperature)
    cache = {"cache": DraftLogitsCache(draft), "tensor": draft, "point": None}[form]
    sampled, num_sampled = call(target, drafts, temperature=temperature, cache=cache)
    y = sampled
    assert ((y >= 0) & (y < vocab) | (y == -1)).all() and (y[:, 0] >= 0).all()
    assert torch.equal(num_sampled.long(), (y >= 0).sum(-1))
    assert rows_chi_square_pvalue(torch.bincount(y[:, 0], minlength=vocab).unsqueeze(0), p0.unsqueeze(0)) > 1e-4
    reached = num_sampled >= 2
    x = torch.tensor(drafts)
    assert (y[reached, 0] == x[reached, 0]).all()
    counts = torch.zeros(vocab, vocab)
    counts.index_put_((y[reached, 0], y[reached, 1]), torch.ones(int(reached.sum())), accumulate=True)
    assert rows_chi_square_pvalue(counts, p1) > 1e-4
    assert 1000 < int((num_sampled == 3).sum()) < n - 1000, "the batch must mix acceptances and rejections"


def test_block_verification_keeps_the_first_tokens_law_and_accepts_more():
    """use_block_verification=True on the same requests and seeds: the first token's law is p0 (power as above),
    and the mean number of accepted drafts is above token-wise verification's by more than 0.015 (the same 200,000
    requests: measured 1.326 against 1.297, standard error of either mean 0.0018, of their difference at most 0.0025:
    the margin is 6 standard errors above no gain and 5 below the measured one)."""
    n, vocab, temperature = 200_000, 6, 0.5
    target, draft, drafts, p0, _ = markov_requests(n, vocab, seed=4321, temperature=temperature)
    token = call(target, drafts, temperature=temperature, cache=DraftLogitsCache(draft))[1].double() - 1
    sampled, num_sampled = call(target, drafts, temperature=temperature, cache=DraftLogitsCache(draft),
                                use_block_verification=True)
    assert rows_chi_square_pvalue(torch.bincount(sampled[:, 0], minlength=vocab).unsqueeze(0), p0.unsqueeze(0)) > 1e-4
    block = num_sampled.double() - 1
    assert float(block.mean()) > float(token.mean()) + 0.015, (float(block.mean()), float(token.mean()))


# ------------------------------------------------------------------------------------- seeds, request states

def test_a_request_gets_its_tokens_whatever_its_batch_and_state_slot():
    """A request's randomness is keyed by its state's seed and the position of its first row: alone, or second in a
    batch under another state slot (the temperature and seed tables permuted to match), it gets the same tokens."""
    vocab = 50
    logits = poisoned_logits(4, vocab, seed=11)
    draft = torch.randn(1, 3, vocab)
    ds = [[logits[i].argmax().item() for i in range(2)] + [7]]
    alone = call(logits, ds, temperature=[0.8], seed=[99], pos0=[40], cache=draft)
    assert torch.equal(call(logits, ds, temperature=[0.8], seed=[99], pos0=[40], cache=draft)[0], alone[0])
    other = poisoned_logits(3, vocab, seed=12)
    states = torch.randn(3, 3, vocab)
    states[2] = draft[0]
    both = call(torch.cat([other, logits]), [[1, 2], ds[0]], temperature=[1.0, 0.3, 0.8], seed=[5, 6, 99],
                pos0=[0, 40], idx_mapping=[0, 2], cache=states)
    assert torch.equal(both[0][1], alone[0][0]) and both[1][1] == alone[1][0]
    moved = call(logits, ds, temperature=[0.8], seed=[98], pos0=[40], cache=draft)
    later = call(logits, ds, temperature=[0.8], seed=[99], pos0=[41], cache=draft)
    many = [call(logits, ds, temperature=[0.8], seed=[s], pos0=[40], cache=draft)[0] for s in range(20)]
    assert any(not torch.equal(m, alone[0]) for m in many + [moved[0], later[0]]), "the seed must matter"


def test_draft_rows_are_read_through_row_mapping_and_the_tensor_form_equals_the_cache():
    """The cache's row_mapping sends request state s to row row_mapping[s]: the same tokens as a cache whose rows are
    in state order; a row of -1 (drafts all placeholders) is never read; the tensor form (0.28-0.33) equals the cache
    with row_mapping None."""
    vocab, k = 30, 3
    logits = poisoned_logits(8, vocab, seed=21)
    drafts = [[3, 4, 5], [6, 7, 8]]
    by_state = torch.randn(2, k, vocab)
    kw = dict(temperature=[0.9, 0.6], seed=[1, 2])
    want = call(logits, drafts, cache=DraftLogitsCache(by_state), **kw)
    assert all(torch.equal(a, b) for a, b in zip(call(logits, drafts, cache=by_state, **kw), want))
    rows = torch.full((5, k, vocab), float("nan"))  # rows no request maps to: NaN, which the kernel would refuse
    rows[4], rows[1] = by_state[0], by_state[1]
    mapped = call(logits, drafts, cache=DraftLogitsCache(rows, torch.tensor([4, 1])), **kw)
    assert all(torch.equal(a, b) for a, b in zip(mapped, want))
    placeholders = call(logits, [[-1, -1, -1], [6, 7, 8]], cache=DraftLogitsCache(rows, torch.tensor([-1, 1])), **kw)
    assert placeholders[1][0] == 1 and placeholders[0][0, 1:].tolist() == [-1] * 3


def test_only_the_draft_vocabulary_is_used_when_the_targets_is_padded_wider():
    """A target vocabulary padded past the draft's (vLLM's rule: verify over min(V, Vd)): the padded columns, given
    the largest logits here, are never emitted."""
    vocab, draft_vocab = 24, 20
    logits = poisoned_logits(3, vocab, seed=31)
    logits[:, draft_vocab:] = 50.0
    out, _ = call(logits, [[1, 2]], temperature=[1.0], cache=torch.randn(1, 2, draft_vocab))
    assert ((out < draft_vocab) & (out >= -1)).all(), out
    out, _ = call(logits, [[1, 2]], temperature=[0.0], cache=torch.randn(1, 2, draft_vocab))
    assert (out[0, :1] < draft_vocab).all(), out


# ------------------------------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("kwargs, match", [
    (dict(synthetic_conditional_rates=torch.ones(2)), "synthetic_conditional_rates"),
    (dict(fly_window_size=4), "fly_window_size"),
    (dict(watermark_key=3), "watermark"),
    (dict(contexts=torch.zeros(1)), "watermark"),
])
def test_lossy_modes_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        call(poisoned_logits(3, 8), [[1, 2]], temperature=[1.0], **kwargs)


def test_bad_inputs_name_the_argument():
    logits = poisoned_logits(3, 8)
    draft_sampled, cu = layout([[1, 2]])
    args = [logits, None, draft_sampled, cu, torch.arange(3), torch.tensor([0]), torch.zeros(3, dtype=torch.int64),
            torch.arange(3), torch.ones(1), torch.ones(1, dtype=torch.int64), 2]
    def bad(i, value, match):
        broken = list(args)
        broken[i] = value
        with pytest.raises(ValueError, match=match):
            vllm_v2.rejection_sample(*broken)
    bad(0, logits[0], "target_logits")
    bad(2, draft_sampled[:2], "draft_sampled")
    bad(4, torch.arange(4), "pos")
    bad(5, torch.tensor([0, 1]), "idx_mapping")
    bad(10, 2.0, "num_speculative_steps")
    bad(10, -1, "num_speculative_steps")
    bad(1, torch.randn(4, 8), "draft_logits_cache")
    bad(1, types.SimpleNamespace(values=None), "draft_logits_cache")


# ------------------------------------------------------------------------- patching vLLM's module tree

def stand_in_tree(monkeypatch, signature: str):
    """A vllm package holding Model Runner V2's two modules, with rejection_sample of vLLM 0.34's signature
    ("0.34"), of 0.28's ("0.28": draft_logits, no watermark keywords, a constructor without watermark_key), or
    another ("other")."""
    for name in ("vllm", "vllm.v1", "vllm.v1.worker", "vllm.v1.worker.gpu", V2):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    utils, sampler = types.ModuleType(f"{V2}.rejection_sampler_utils"), types.ModuleType(f"{V2}.rejection_sampler")
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
    sampler.RejectionSampler = RejectionSampler
    monkeypatch.setitem(sys.modules, utils.__name__, utils)
    monkeypatch.setitem(sys.modules, sampler.__name__, sampler)
    return utils, sampler, RejectionSampler


@pytest.mark.parametrize("signature", ["0.34", "0.28"])
def test_model_runner_v2_is_patched_and_its_sampler_refuses_lossy_methods(monkeypatch, signature):
    utils, sampler, original = stand_in_tree(monkeypatch, signature)
    patched = vllm_v2.patch_model_runner_v2()
    assert f"{V2}.rejection_sampler_utils.rejection_sample" in patched
    assert f"{V2}.rejection_sampler.rejection_sample" in patched
    assert utils.rejection_sample is vllm_v2.rejection_sample is sampler.rejection_sample
    ours = sampler.RejectionSampler
    assert ours is not original and issubclass(ours, original)
    assert vllm_v2.patch_model_runner_v2() == [] and sampler.RejectionSampler is ours, "idempotent"
    for method in ("standard", "block"):
        made = ours("sampler", types.SimpleNamespace(rejection_sample_method=method), "cpu").made
        assert made[:3] == ("sampler", types.SimpleNamespace(rejection_sample_method=method), "cpu")
    for method in ("synthetic", "fly"):
        with pytest.raises(ValueError, match=f"rejection_sample_method='{method}' is lossy"):
            ours("sampler", types.SimpleNamespace(rejection_sample_method=method), "cpu")
    with pytest.raises(ValueError, match="watermark_key"):
        ours("sampler", types.SimpleNamespace(rejection_sample_method="standard"), "cpu", watermark_key=5)


def test_an_unknown_signature_is_left_alone_with_a_warning(monkeypatch, caplog):
    utils, sampler, original = stand_in_tree(monkeypatch, "other")
    theirs = utils.rejection_sample
    with caplog.at_level(logging.WARNING, logger="specdec_ext.compat.vllm"):
        assert vllm_v2.patch_model_runner_v2() == []
    assert utils.rejection_sample is theirs and sampler.RejectionSampler is original
    assert "was not replaced" in caplog.text


def test_without_model_runner_v2_nothing_is_patched(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))  # a package without the V2 modules
    for name in list(sys.modules):
        if name.startswith("vllm."):
            monkeypatch.delitem(sys.modules, name)
    assert vllm_v2.patch_model_runner_v2() == []


def test_register_patches_model_runner_v2(monkeypatch):
    utils, sampler, original = stand_in_tree(monkeypatch, "0.34")
    vllm_shim.register()
    assert utils.rejection_sample is vllm_v2.rejection_sample and sampler.RejectionSampler is not original
