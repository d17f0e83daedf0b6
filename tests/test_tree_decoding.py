"""Tree rounds of SpeculativeDecoder (tree=...) with the EAGLE head's dynamic tree, Medusa's candidate tree and the
n-gram trie, on tiny random transformers models: greedy output equals plain decoding token for token (ragged
prompts, continuous batching, static and paged caches), the law of the first tokens at temperature > 0 is the
target's exact law, both caches hold what a fresh prefill would after every round, the drafted trees are well
formed and best first (EAGLE's scored by the head itself along each path), stats add up, the adaptive tree size
follows the costs, bad settings raise. Fixed seeds throughout."""
import pytest
import torch

import specdec_ext
from helpers.chi_square import assert_law
from helpers.decoder_probes import CacheCheck, cache_rows, check_best_paths, record_paths
from helpers.laws import LAW_CASES, law_target, sample_first_tokens
from helpers.models import make_drafter, random_prompts, random_vocab, tiny_model
from specdec_ext import ModelDrafter, NgramDrafter, SpeculativeDecoder
from specdec_ext.engine import CostModel, generate_autoregressive
from specdec_ext.trees import TreeSettings, best_tree, trie

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

# A 16-token vocabulary with spread-out distributions, so that random heads' top-k candidates are often right
# (trees accept paths deeper than 1 and off the first branch) and sampled paths vary; heads see 12 of the tokens.
VOCAB = 16
TREE = dict(num_nodes=24, depth=4, branching=4)


@pytest.fixture(scope="module")
def target():
    return tiny_model(vocab=VOCAB, seed=1234, logit_scale=0.3)


def tree_drafter(name, target, seed=1):
    if name == "ngram":
        return NgramDrafter(3, 1)
    return make_drafter(name, target, random_vocab(VOCAB, 12, 1), seed)


# ----------------------------------------------------------------------------------------------------- helpers

def test_best_tree_keeps_the_best_nodes_best_first():
    # Candidates 1..6 (0: the root) as (parent, token, score): 5 ties with its parent 3; 6 is not a candidate.
    parents = torch.tensor([[0, 0, 1, 1, 3, 2]])
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10]])
    scores = torch.tensor([[-0.1, -1.0, -0.3, -2.0, -0.3, float("-inf")]])
    tree = best_tree(parents, tokens, scores, torch.tensor([3]), budget=5)
    # The best 4: 1, 3, 5 (after its parent: the sort is stable), 2; renumbered 1..4 with parents before children.
    assert tree.parents.tolist() == [[-1, 0, 1, 2, 0]]
    assert tree.token_ids.tolist() == [[3, 5, 7, 9, 6]]
    assert tree.num_nodes.tolist() == [5] and tree.depths.tolist() == [[0, 1, 2, 3, 1]]
    assert tree.tree_mask[0].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0],
                                                [1, 0, 0, 0, 1]]
    # A budget past the candidates: all five finite ones, then padding (parent -1, token 0, seeing itself only).
    tree = best_tree(parents, tokens, scores, torch.tensor([3]), budget=10)
    assert tree.num_nodes.tolist() == [6] and tree.parents.tolist() == [[-1, 0, 1, 2, 0, 1, -1]]
    assert tree.token_ids[0, -1] == 0 and tree.tree_mask[0, -1].int().tolist() == [0] * 6 + [1]
    # The n-gram trie: shared prefixes once, counted per sequence through them.
    assert trie([[1, 2, 3], [1, 2, 4], [5]]) == ([0, 1, 2, 2, 0], [1, 2, 3, 4, 5], [2, 2, 1, 1, 1])


# ------------------------------------------------------------------------------------------------------ greedy

@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("name", ["eagle", "eagle3", "medusa", "ngram"])
def test_greedy_tree_decoding_equals_plain_decoding(target, name, paged, monkeypatch):
    """7 ragged prompts (one of a single token) through 3 slots, finishing at different rounds; the stats of the
    rounds add up to the emitted tokens."""
    prompts = random_prompts(5, [5, 21, 12, 1, 9, 3, 30], vocab=VOCAB)
    max_new = [24, 7, 16, 30, 3, 20, 11]
    plain = generate_autoregressive(target, prompts, max_new)
    paths = record_paths(monkeypatch)
    dec = SpeculativeDecoder(target, tree_drafter(name, target), adaptive=False, max_batch_size=3, paged=paged,
                             tree=TREE)
    out = dec.generate(prompts, max_new)
    assert out.sequences == plain.sequences
    # The trees were used: paths deeper than one node, and paths off the first branch (compaction moves K/V).
    assert max(len(p) for p in paths) >= 3 and any(p != list(range(len(p))) for p in paths)
    for s in out.request_stats:
        assert s.generated_tokens == s.num_accepted_tokens + s.target_forwards  # no EOS here
        assert len(s.accepted_depths) == s.num_drafts and sum(s.accepted_depths) == s.num_accepted_tokens
        assert max(s.accepted_depths, default=0) <= TREE["depth"]
        assert s.mean_accepted_depth == pytest.approx(s.mean_acceptance_length - 1)
        assert s.num_draft_tokens == sum(s.k_per_round) and all(k < TREE["num_nodes"] for k in s.k_per_round)
        assert sum(s.accepted_per_position) == s.num_accepted_tokens
        assert len(s.drafted_per_position) <= TREE["depth"]  # positions are depths in a tree round
    total = out.stats
    assert sorted(total.accepted_depths) == sorted(d for s in out.request_stats for d in s.accepted_depths)
    assert total.num_accepted_tokens == sum(s.num_accepted_tokens for s in out.request_stats)
    if paged:  # every page back in the pool once the requests finished
        assert dec.cache.free_pages == dec.cache.k.shape[1]


# ------------------------------------------------------------------------------------------------ lossless law

@pytest.mark.parametrize("case", list(LAW_CASES))
@pytest.mark.parametrize("name", [pytest.param("eagle", marks=pytest.mark.slow),
                                  pytest.param("eagle3", marks=pytest.mark.slow), "ngram"])
def test_law_of_the_first_tokens_is_the_targets_with_trees(name, case):
    """As test_speculative_decoding's law test (70,000 or 50,000 seeds by case, chi-square over the 512 sequences of
    3 tokens, power >= 0.9 against a 1% bias, checked by assert_law), with tree rounds of up to 8 nodes, depth 2 and
    3 children per node: point proposals tested in turn at each node, the rejected ones removed from the target's
    distribution. The n-gram trie branches on LAW_PROMPT; EAGLE's head (slow: its draft steps are head forwards) sees
    5 of the 8 tokens, the others coming through the residual. Mutation run once: handing the tree op the target's
    unmasked logits fails the top-k/top-p case (a masked token is emitted)."""
    target = law_target(2 if name == "eagle3" else 1)
    drafter = make_drafter(name, target, torch.tensor([0, 2, 4, 5, 7]), seed=11) if name.startswith("eagle") \
        else NgramDrafter(2, 1)
    counts, law, acceptance = sample_first_tokens(target, drafter, case,
                                                  tree=dict(num_nodes=8, depth=2, branching=3))
    assert 0.02 < acceptance < 0.9, ("the test needs tree nodes accepted and rejected", acceptance)
    assert_law(counts, law)


# ---------------------------------------------------------------------------------------------------- rollback

@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_caches_hold_a_fresh_prefill_after_every_tree_round(target, paged, monkeypatch):
    """EAGLE, sampled (paths vary and leave the first branch): after each round the target's cache holds the
    request's tokens but the last, the head's cache the pairs (target feature j, token j + 1) it was fed and its
    queue the target's features of the rest, each equal to a fresh prefill of those tokens. Mutations run once:
    compacting the block's first num_accepted + 1 slots instead of the path fails this test and the greedy one;
    handing the drafter the block's features in node order instead of the path's fails this one."""
    prompts = random_prompts(31, [7, 15, 1], vocab=VOCAB)
    drafter = tree_drafter("eagle", target)
    head = drafter.head
    paths = record_paths(monkeypatch)
    dec = SpeculativeDecoder(target, drafter, adaptive=False, max_batch_size=3, paged=paged, tree=TREE)

    def head_cache(r, tokens, n):
        # The head: m pairs fed, the features of tokens m .. n - 1 queued.
        m = int(drafter.cache.cache_seqlens[r])
        queued = torch.cat(drafter.pending[r]) if drafter.pending[r] else torch.empty(0, target.config.hidden_size)
        assert m == drafter.state.lengths[r] and m + len(queued) == n
        if n:
            _, features = target.prefill(target.new_kv_cache(1, n + 1), [0], [tokens[:n]], output_hidden_states=True)
            torch.testing.assert_close(queued, features[0][m:], rtol=1e-4, atol=1e-4)
        if m:
            fresh = head.decoder.new_kv_cache(1, m + 1)
            head(torch.tensor([tokens[1:m + 1]]), features[0][:m].unsqueeze(0), fresh)
            k, v = cache_rows(drafter.cache, r, m)
            torch.testing.assert_close(k, fresh.k[:, 0, :m], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(v, fresh.v[:, 0, :m], rtol=1e-4, atol=1e-4)

    check = CacheCheck(target, dec, prompts, head_cache)
    out = dec.generate(prompts, 16, temperature=1.0, seed=[4, 5, 6], stream=check)
    assert check.generated() == out.sequences
    assert len(check.rounds) >= 3 * 4 and max(len(p) for p in paths) >= 3
    assert any(p != list(range(len(p))) for p in paths)
    if paged:
        assert dec.cache.free_pages == dec.cache.k.shape[1] and drafter.cache.free_pages == drafter.cache.k.shape[1]


# ------------------------------------------------------------------------------------------------ the trees

@pytest.mark.parametrize("name", ["eagle", "medusa", "ngram"])
def test_drafted_trees_are_well_formed(target, name):
    """Every tree a drafter proposes during a ragged, mixed greedy/sampled run: parents before children, padding
    after num_nodes, no deeper than asked, distinct sibling tokens, the root the request's last token, head tokens
    inside the draft vocabulary, at most the budget."""
    drafter = tree_drafter(name, target)
    seen = []
    propose_tree = drafter.propose_tree
    drafter.propose_tree = lambda r, budget, branching: seen.append((r, budget, propose_tree(r, budget, branching))) \
        or seen[-1][2]
    prompts = random_prompts(8, [6, 1, 13], vocab=VOCAB)
    SpeculativeDecoder(target, drafter, adaptive=False, max_batch_size=2, tree=TREE).generate(
        prompts, [9, 12, 5], temperature=[0.0, 0.8, 1.0], seed=[1, 2, 3])
    assert len(seen) > 5
    allowed = set(random_vocab(VOCAB, 12, 1).tolist()) if name != "ngram" else set(range(VOCAB))
    for r, budget, tree in seen:
        assert budget == TREE["num_nodes"] and tree.parents.shape[1] <= budget
        for b in range(r.batch):
            n = int(tree.num_nodes[b])
            parents, tokens = tree.parents[b].tolist(), tree.token_ids[b].tolist()
            assert parents[0] == -1 and all(0 <= parents[c] < c for c in range(1, n))
            assert all(p == -1 for p in parents[n:])
            assert int(tree.depths[b].max()) <= r.num_tokens[b]
            assert len({(parents[c], tokens[c]) for c in range(1, n)}) == n - 1
            assert set(tokens[1:n]) <= allowed
            if r.histories[b] is not None:
                assert tokens[0] == r.histories[b][-1]
            else:
                assert n == 1


def test_eagle_trees_are_the_heads_best_paths(target):
    """Each node of an EAGLE tree scored again by feeding its parent's path to the head as a chain, one token at a
    time, on a copy of the head's cache (check_best_paths). A wrong tree mask, position or parent feature in the
    tree's draft block changes these distributions."""
    drafter = tree_drafter("eagle", target, seed=3)
    head, vocab = drafter.head, drafter.head.draft_vocab
    start = {}
    feed_pending = drafter.feed_pending

    def capture(r, block):
        asked, logits, feature = feed_pending(r, block)
        start.update(logits=logits, feature=feature, k=drafter.cache.k.clone(), v=drafter.cache.v.clone(),
                     lengths=drafter.cache.cache_seqlens.clone())
        return asked, logits, feature

    drafter.feed_pending = capture

    def log_probs(r, b, path):
        logits = start["logits"][b]
        if path:
            cache = head.decoder.new_kv_cache(1, drafter.cache.max_seq_len)
            cache.k.copy_(start["k"][:, b:b + 1])
            cache.v.copy_(start["v"][:, b:b + 1])
            cache.cache_seqlens.copy_(start["lengths"][b:b + 1])
            feature = start["feature"][b:b + 1]
            for token in path:
                logits, feature = head(torch.tensor([[token]]), feature, cache)
                cache.advance(1)
            logits = logits[0, 0]
        full = torch.full((VOCAB,), float("-inf"), dtype=torch.float64)
        full[vocab] = logits.double().log_softmax(-1)
        return full

    check_best_paths(target, drafter, TREE, random_prompts(9, [6, 11], vocab=VOCAB), 6, log_probs)


# ------------------------------------------------------------------------------------------ adaptive tree size

def test_adaptive_tree_size_follows_the_verify_cost(target):
    """adaptive=True picks the round's node budget from the measured acceptance of each tree rank and the verify
    cost per row: with a cost flat in the rows every round takes the full tree; with one that jumps 10x past 8 rows
    the rounds stay within 8 nodes but for every 8th round's probe of twice that size. Greedy tokens are plain
    decoding's either way."""
    prompts = random_prompts(12, [9, 14], vocab=VOCAB)
    plain = generate_autoregressive(target, prompts, 30).sequences
    budgets = {}
    for name, costs in (("flat", CostModel({1: 1.0, 64: 1.0})), ("steep", CostModel({1: 1.0, 8: 1.0, 9: 10.0}))):
        drafter = tree_drafter("eagle", target)
        propose_tree = drafter.propose_tree
        budgets[name] = []
        drafter.propose_tree = lambda r, budget, branching: budgets[name].append(budget) or \
            propose_tree(r, budget, branching)
        out = SpeculativeDecoder(target, drafter, max_batch_size=1, tree=TREE, costs=costs).generate(prompts, 30)
        assert out.sequences == plain
        for s in out.request_stats:  # a tree holds at most the round's budget
            assert all(k < TREE["num_nodes"] for k in s.k_per_round)
    assert set(budgets["flat"]) == {TREE["num_nodes"]} and len(budgets["flat"]) > 10
    small = [n for n in budgets["steep"] if n <= 8]
    assert len(small) >= 0.75 * len(budgets["steep"]) and max(budgets["steep"]) == min(16, TREE["num_nodes"])


def test_adaptive_tree_rounds_fall_back_to_plain_rounds_when_no_tree_pays(target):
    """When every tree's verify block costs more than its expected tokens pay for (here 2+ rows cost 50x one row), the
    policy runs plain rounds (no drafting, one row verified) but for every 8th round's probe of a 2-node tree: trees
    never lose to plain decoding by more than those probes. Greedy tokens are plain decoding's."""
    prompts = random_prompts(6, [9, 14], vocab=VOCAB)
    plain = generate_autoregressive(target, prompts, 40).sequences
    drafter = tree_drafter("eagle", target)
    budgets, propose_tree = [], drafter.propose_tree
    drafter.propose_tree = lambda r, budget, branching: budgets.append(budget) or propose_tree(r, budget, branching)
    costs = CostModel({1: 1.0, 2: 50.0, 64: 50.0})
    out = SpeculativeDecoder(target, drafter, max_batch_size=1, tree=TREE, costs=costs).generate(prompts, 40)
    assert out.sequences == plain
    rounds = [k for s in out.request_stats for k in s.k_per_round]
    drafted = [k for k in rounds if k > 0]
    assert set(budgets) == {2} and len(drafted) == len(budgets)  # only the probes drafted, one node each
    assert len(drafted) <= len(rounds) / 8 + len(prompts) and len(rounds) >= 35 * len(prompts)  # ~1 token a round


# --------------------------------------------------------------------------------------------------- bad input

# An EAGLE head's limit on (depth - 1) x branching is the EAGLE drafter's: tests/test_rounds.py.
@pytest.mark.parametrize("tree", [0, 1, 65, True, 2.5, "abc", "nodes=8,depth=9", "nodes=8,width=2",
                                  {"num_nodes": 8, "width": 2}, {"depth": 0}])
def test_bad_tree_settings_raise(target, tree):
    with pytest.raises(ValueError, match="tree"):
        SpeculativeDecoder(target, NgramDrafter(), tree=tree)


def test_tree_settings_parse_and_need_a_tree_drafter(target):
    assert TreeSettings.of("32") == TreeSettings(num_nodes=32) and TreeSettings.of(4) == TreeSettings(4, 3)
    assert TreeSettings.of("nodes=16,depth=3") == TreeSettings(16, 3) == TreeSettings.of({"num_nodes": 16, "depth": 3})
    assert TreeSettings.of("nodes=16,depth=3,branching=2") == TreeSettings(16, 3, 2)
    with pytest.raises(ValueError, match="tree rounds need a drafter that proposes trees"):
        SpeculativeDecoder(target, ModelDrafter(target), tree=16)
    assert specdec_ext.SpeculativeDecoder(target, NgramDrafter(), tree=16).tree == TreeSettings.of(16)
