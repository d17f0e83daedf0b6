"""Self-speculative drafting (SelfSpeculativeDrafter): the target's forward over a subset of its layers against
transformers' model with only those layers; greedy speculative output equal to plain decoding's with drafts accepted
(chains and trees, static and paged caches, ragged batches, a draft vocabulary or the full one); the target's cache a
fresh prefill after every round (the draft steps write the verify block's slots, which the verify rewrites); trees
the subset's best paths; the law of the first tokens (chi-square, chains and trees) and invariant sampling; bad
settings refused. Fixed seeds throughout."""
import re

import pytest
import torch

from helpers.chi_square import assert_law
from helpers.decoder_probes import CacheCheck, check_best_paths, record_paths
from helpers.laws import LAW_CASES, law_target, sample_first_tokens
from helpers.models import random_prompts, shared_hf, tiny_model
from specdec_ext import SelfSpeculativeDrafter, SpeculativeDecoder
from specdec_ext.drafters.registry import parse_drafter
from specdec_ext.engine import generate_autoregressive
from specdec_ext.models import LlamaForCausalLM

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

VOCAB = 16
MODEL = dict(vocab=VOCAB, seed=1234, logit_scale=0.3, layers=4)
PROMPTS = random_prompts(3, [6, 1, 14, 3, 9], vocab=VOCAB)
MAX_NEW = [20, 14, 9, 24, 17]
TREE = dict(num_nodes=12, depth=4, branching=3)


@pytest.fixture(scope="module")
def target():
    return tiny_model(**MODEL)


@pytest.mark.parametrize("layers", [(0, 1), (0, 2, 3), (1,)])
@pytest.mark.parametrize("loop", ["c++", "python"])
def test_a_subset_forward_is_the_model_with_those_layers(layers, loop, monkeypatch):
    """Prefill and decode steps through `layers` only, each on its own layer of the cache, against transformers'
    model whose decoder holds just those layers (whole sequences, float32)."""
    if loop == "python":
        monkeypatch.setattr(LlamaForCausalLM, "cpu_step_args", lambda *args, **kwargs: None)
    model = tiny_model(**MODEL)
    hf = shared_hf(**MODEL)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    cache = model.new_kv_cache(2, 16)
    with torch.no_grad():
        cache.k.normal_()  # poisoned: a layer outside the subset is never read, one inside always written first
        cache.v.normal_()
        ours = [model(ids[:, :8], cache, layers=layers)]
        cache.advance(8)
        for t in range(8, 12):
            ours.append(model(ids[:, t:t + 1], cache, layers=layers))
            cache.advance(1)
        ours = torch.cat(ours, 1)
        kept = hf.model.layers
        try:
            hf.model.layers = torch.nn.ModuleList([kept[i] for i in layers])
            theirs = hf(ids, use_cache=False).logits
        finally:
            hf.model.layers = kept
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-4, atol=1e-4)


def test_the_c_plus_plus_loop_runs_a_subset_as_the_python_loop(target, monkeypatch):
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(4))
    out = []
    for python in (False, True):
        if python:
            monkeypatch.setattr(LlamaForCausalLM, "cpu_step_args", lambda *args, **kwargs: None)
        cache = target.new_kv_cache(2, 8)
        with torch.no_grad():
            out.append((target(ids, cache, layers=(0, 3)), cache.k.clone()))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    assert not out[0][1][1].any() and out[0][1][3].any()  # layer 1 untouched, layer 3 written


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("paged", [False, True], ids=["static", "paged"])
@pytest.mark.parametrize("layers,vocab", [(2, None), ((0, 2), None), ((0, 3), torch.arange(0, VOCAB, 2)), (2, 12)],
                         ids=["first2", "skip", "skip-draft-vocab", "first2-first-ids"])
def test_greedy_equals_plain_with_drafts_accepted(target, layers, vocab, paged, tree, monkeypatch):
    """5 ragged prompts (one of a single token) through 3 slots; tree rounds accept paths deeper than one node and
    off the first branch."""
    paths = record_paths(monkeypatch)
    dec = SpeculativeDecoder(target, SelfSpeculativeDrafter(target, layers, vocab), 3, adaptive=False,
                             max_batch_size=3, paged=paged, tree=tree)
    out = dec.generate(PROMPTS, MAX_NEW)
    assert out.sequences == generate_autoregressive(target, PROMPTS, MAX_NEW, paged=paged).sequences
    assert out.stats.num_accepted_tokens > 10 and out.stats.mean_acceptance_length > 1.2, out.stats
    if tree is not None:
        assert max(len(p) for p in paths) >= 3 and any(p != list(range(len(p))) for p in paths)
    if paged:  # every page back in the pool once the requests finished
        assert dec.cache.free_pages == dec.cache.k.shape[1]


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("paged", [False, True], ids=["static", "paged"])
def test_the_cache_is_a_fresh_prefill_after_every_round(target, paged, tree):
    """Sampled, so that drafts are rejected at every position: the draft steps' writes never outlive a round (a
    tree's draft block runs past the verify block's slots: past the request's length after the round)."""
    prompts = random_prompts(31, [7, 15, 1], vocab=VOCAB)
    dec = SpeculativeDecoder(target, SelfSpeculativeDrafter(target, (0, 2)), 3, adaptive=False, max_batch_size=3,
                             paged=paged, tree=tree)
    check = CacheCheck(target, dec, prompts)
    out = dec.generate(prompts, 16, temperature=1.0, seed=[4, 5, 6], stream=check)
    assert check.generated() == out.sequences and len(check.rounds) >= 3 * 4
    assert 0 < out.stats.num_accepted_tokens < out.stats.num_draft_tokens


def test_trees_are_the_subsets_best_paths(target):
    """Each node of a drafted tree scored again as a chain (check_best_paths): a fresh cache prefilled by the whole
    model with the request's tokens but the last (what the drafter reads), then the subset over the last token and
    the parent's path, causally. A wrong tree mask, position or parent slot in the draft block changes those
    distributions."""
    layers = (0, 2)

    def log_probs(r, b, path):
        history = r.histories[b]
        cache = target.new_kv_cache(1, len(history) + TREE["depth"])
        with torch.no_grad():
            target.prefill(cache, [0], [history[:-1]])
            logits = target(torch.tensor([history[-1:] + path]), cache, layers=layers)[0, -1]
        return logits.double().log_softmax(-1)

    check_best_paths(target, SelfSpeculativeDrafter(target, layers), TREE, random_prompts(9, [6, 11], vocab=VOCAB), 6,
                     log_probs)


def test_invariant_sampling_equals_plain(target):
    params = dict(temperature=[0.8, 1.0, 0.0, 0.8, 1.3], top_p=[0.9, 1.0, 1.0, 0.9, 1.0], seed=[1, 2, 3, 4, 5])
    plain = SpeculativeDecoder(target, None, max_batch_size=1, sampling="invariant").generate_autoregressive(
        PROMPTS, MAX_NEW, **params)
    dec = SpeculativeDecoder(target, SelfSpeculativeDrafter(target, 2), 3, adaptive=False, max_batch_size=3,
                             sampling="invariant")
    out = dec.generate(PROMPTS, MAX_NEW, **params)
    assert out.sequences == plain.sequences and out.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("tree", [None, dict(num_nodes=8, depth=2, branching=3)], ids=["chain", "tree"])
@pytest.mark.parametrize("case", list(LAW_CASES))
def test_law_of_the_first_tokens_is_the_targets(case, tree):
    """Rejection sampling with drafts drawn from the first layer of the two-layer law target; tree rounds test its
    top-3 point proposals at each node in turn (70,000 or 50,000 seeds by case, power >= 0.9 against a 1% bias,
    checked by assert_law)."""
    target = law_target(2)
    counts, law, acceptance = sample_first_tokens(target, SelfSpeculativeDrafter(target, 1), case, tree=tree)
    assert 0.02 < acceptance < 0.95, acceptance
    assert_law(counts, law)


@pytest.mark.parametrize("layers,message", [
    (0, "layers=0: the first L layers draft, L in [1, 3]"),
    (4, "layers=4: the first L layers draft"),
    (True, "layers must be an int or a tuple"),
    ((2, 1), "increasing layer indices in [0, 4)"),
    ((0, 1, 2, 3), "fewer than all 4"),
    ((0, 7), "increasing layer indices in [0, 4)"),
])
def test_bad_layers_are_refused(target, layers, message):
    with pytest.raises(ValueError) as e:
        SelfSpeculativeDrafter(target, layers)
    assert message in str(e.value)


@pytest.mark.parametrize("vocab,message", [(0, "draft_vocab=0: the first N token ids, N in [1, 16]"),
                                           (17, "draft_vocab=17: the first N"),
                                           (torch.tensor([3, 1]), "sorted, distinct token ids in [0, 16)")])
def test_bad_draft_vocabularies_are_refused(target, vocab, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SelfSpeculativeDrafter(target, 2, vocab)


def test_the_first_n_ids_are_a_draft_vocabulary(target):
    assert SelfSpeculativeDrafter(target, 2, 5).draft_vocab.tolist() == [0, 1, 2, 3, 4]
    assert SelfSpeculativeDrafter(target, 2, VOCAB).lm_head is None  # all of them: the model's own head


def test_forward_refuses_bad_layers_and_another_target(target):
    with pytest.raises(ValueError, match="layers must be a non-empty tuple of increasing layer indices"):
        target(torch.zeros(1, 1, dtype=torch.long), target.new_kv_cache(1, 2), layers=(1, 1))
    other = tiny_model(**{**MODEL, "seed": 99})
    dec = SpeculativeDecoder(other, SelfSpeculativeDrafter(target, 2), 3)
    with pytest.raises(ValueError, match="the decoder's target must be the model it was made for"):
        dec.generate(PROMPTS[:1], 4)


@pytest.mark.parametrize("spec,arguments", [
    ("self:2", {"layers": 2}), ("self:0,2", {"layers": (0, 2)}), ("self", {"layers": "auto"}),
    ("self:/8", {"layers": "auto", "draft_vocab": 8}), ("self:0,2/8", {"layers": (0, 2), "draft_vocab": 8}),
    ("self:", None), ("self:3,", None), ("self:x", None), ("self:2/", None), ("self:2/x", None), ("self:2/8/8", None)])
def test_the_command_line_spelling(spec, arguments):
    if arguments is None:
        with pytest.raises(ValueError, match="--drafter must be"):
            parse_drafter(spec, lambda: True)
        return
    assert parse_drafter(spec, lambda: True)[1] == arguments


# ------------------------------------------------------------------------------------------------ the search

def test_the_search_is_deterministic_and_cached(target, tmp_path, monkeypatch):
    """Acceptance is counted and the cost is the weights read: two searches agree row for row; the second reads the
    cache file (no decoding); a malformed file is measured again; the choice maximises the score."""
    from specdec_ext.drafters import self_speculative

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    first, rows = self_speculative.search_layers(target, 3)
    assert {tuple(r["layers"]) for r in rows} == set(self_speculative.candidate_subsets(4).values())
    assert tuple(max(rows, key=lambda r: r["score"])["layers"]) == first
    assert all(r["score"] == r["mean_acceptance_length"] / (1 + 3 * r["draft_cost"]) for r in rows)
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "fresh"))
    assert self_speculative.search_layers(target, 3) == (first, rows)
    files = list((tmp_path / "fresh" / "self_speculative").glob("*.json"))
    assert len(files) == 1

    def no_decoding(*args, **kwargs):
        raise AssertionError("the cached search decoded again")

    monkeypatch.setattr("specdec_ext.engine.SpeculativeDecoder", no_decoding)
    assert self_speculative.search_layers(target, 3) == (first, rows)
    files[0].write_text('{"layers": [9, 9], "rows": []}')
    monkeypatch.undo()
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "fresh"))
    assert self_speculative.search_layers(target, 3) == (first, rows)


def test_draft_cost_counts_the_weights_read(target):
    from specdec_ext.drafters.self_speculative import draft_cost

    c = target.config
    assert draft_cost(target, tuple(range(c.num_hidden_layers)), c.vocab_size) == 1.0
    assert draft_cost(target, (0,), 4) < draft_cost(target, (0, 1), 4) < draft_cost(target, (0, 1), 8) < 1.0


def test_draft_work_counts_the_rows_a_round_feeds(target, monkeypatch):
    """The cost model's (steps, rows per step) of a round against the forwards propose and propose_tree run: a
    chain's k forwards of one row; a tree's root, then expansions re-feeding every node expanded so far."""
    fed = []
    forward = LlamaForCausalLM.forward

    def counting(self, input_ids, *args, **kwargs):
        if kwargs.get("layers") is not None:
            fed.append(input_ids.shape[1])
        return forward(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "forward", counting)
    # A draft vocabulary of 2 ids expands 2 children per node, whatever the tree's branching.
    for tree, vocab, want in ((None, None, [1] * 4), (dict(num_nodes=14, depth=4, branching=3), None, [1, 3, 6, 9]),
                              (dict(num_nodes=14, depth=4, branching=3), 2, [1, 2, 4, 6])):
        fed.clear()
        drafter = SelfSpeculativeDrafter(target, 2, vocab)
        dec = SpeculativeDecoder(target, drafter, 4, adaptive=False, max_batch_size=1, tree=tree)
        dec.generate(random_prompts(4, [9], vocab=VOCAB), 8)
        steps, rows = drafter.draft_work(4, dec.tree)
        first_round = fed[:steps]  # the first round drafts 4 deep (8 tokens to go)
        assert steps == 4 and first_round == want
        assert rows == -(-sum(first_round) // steps)
