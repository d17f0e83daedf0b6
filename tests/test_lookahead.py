"""LookaheadDrafter (Lookahead decoding: a Jacobi window and an n-gram pool in the target's own verify forward) on tiny
random transformers models and on the shipped model: the block's tree (guesses, window columns, merged into one
trie) and the window's step by hand-computed examples; greedy output equals plain decoding token for token (ragged
prompts, B = 1 and 4 with continuous batching, static and paged caches, fixed and adaptive sizing); the law of the
first tokens at temperature > 0 is the target's exact law (with top-k/top-p); the target's cache holds a fresh
prefill of the emitted tokens after every step (the window's K/V gone); the plan follows the costs; bad settings
raise naming the argument. Fixed seeds throughout."""
import pytest

from helpers.chi_square import assert_law
from helpers.decoder_probes import CacheCheck, record_paths
from helpers.laws import LAW_CASES, law_target, sample_first_tokens
from helpers.models import random_prompts, shipped_model, tiny_model
from specdec_ext import LookaheadDrafter, SpeculativeDecoder
from specdec_ext.drafters.base import RoundFeedback, RoundInputs
from specdec_ext.engine import CostModel, generate_autoregressive
from specdec_ext.factory import make_drafter, prompt_ids

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

VOCAB = 16  # spread-out distributions: greedy text of a random model repeats, so the window's n-grams get accepted


@pytest.fixture(scope="module")
def target():
    return tiny_model(vocab=VOCAB, seed=1234, logit_scale=0.3)


def round_inputs(histories, num_tokens):
    """What propose_tree reads of a round (the sampling tensors are the verifier's)."""
    return RoundInputs(len(histories), num_tokens, histories, None, None, None, None, None)


# ------------------------------------------------------------------------------------------ the block by hand

def test_block_is_the_trie_of_guesses_and_window_columns(target):
    """Window W = 3 with N - 1 = 2 levels [[10, 11, 12], [20, 21, 22]], the pool's n-gram (6, 7) of the root 5, one
    guess: the guess first (nodes 1-2), then column i = level 0's tokens 0..i and level 1's token i, sharing the
    trunk 10 -> 11 -> 12. Then the step: the target's greedy tokens 30, 31, 32 at the columns' last nodes (4, 6, 8)
    make the n-grams (10, 20, 30), (11, 21, 31), (12, 22, 32) and the next window [[20, 21, 22], [30, 31, 32]]."""
    d = LookaheadDrafter(window=3, ngram=3, guesses=1)
    d.bind(target, 1, 64)
    d.admit([0], [[1, 2]])
    s = d.requests[0]
    s.levels, s.pool = [[10, 11, 12], [20, 21, 22]], {5: [(6, 7)]}
    tree = d.propose_tree(round_inputs([[1, 2, 5]], [8]), 64, 1)
    assert tree.parents.tolist() == [[-1, 0, 1, 0, 3, 3, 5, 5, 7]]
    assert tree.token_ids.tolist() == [[5, 6, 7, 10, 20, 11, 21, 12, 22]]
    assert tree.num_nodes.tolist() == [9] and tree.depths.tolist() == [[0, 1, 2, 1, 2, 2, 3, 3, 4]]
    argmax = [0, 0, 0, 0, 30, 0, 31, 0, 32]
    d.rollback(RoundFeedback([1], None, paths=[[1]], block_argmax=[argmax]))  # the guess's first token accepted
    assert s.levels == [[20, 21, 22], [30, 31, 32]]
    assert s.pool == {5: [(6, 7)], 10: [(20, 30)], 11: [(21, 31)], 12: [(22, 32)]}
    assert (d.stats.pool_hits, d.stats.accepted_tokens, d.stats.pool_ngrams) == (1, 1, 3)


def test_block_is_cut_to_depth_and_budget_and_padded_for_graphs(target):
    d = LookaheadDrafter(window=3, ngram=3, guesses=1)
    d.bind(target, 1, 64)
    d.admit([0], [[1, 2]])
    s = d.requests[0]
    s.levels, s.pool = [[10, 11, 12], [20, 21, 22]], {5: [(6, 7)]}
    # Depth 2 (the request's room): columns 1 and 2 lose their level-1 nodes, so they keep their last guess.
    tree = d.propose_tree(round_inputs([[1, 2, 5]], [2]), 64, 1)
    assert tree.token_ids.tolist() == [[5, 6, 7, 10, 20, 11]] and tree.parents.tolist() == [[-1, 0, 1, 0, 3, 3]]
    d.rollback(RoundFeedback([0], None, paths=[[]], block_argmax=[[0, 0, 0, 0, 30, 0]]))
    assert s.levels == [[20, 21, 22], [30, 21, 22]] and s.pool[10] == [(20, 30)] and 11 not in s.pool
    # A budget of 4 nodes: the root, the guess, then the trunk's first node.
    tree = d.propose_tree(round_inputs([[1, 2, 5]], [8]), 4, 1)
    assert tree.token_ids.tolist() == [[5, 6, 7, 20]]
    # On CUDA every tree is as wide as the budget (one graph per budget), padding after num_nodes.
    d.pad_to_budget = True
    tree = d.propose_tree(round_inputs([[1, 2, 5], None], [8, 0]), 12, 1)
    assert tree.parents.shape == (2, 12) and tree.num_nodes.tolist() == [9, 1]
    assert tree.parents[0, 9:].tolist() == [-1] * 3 and tree.parents[1].tolist() == [-1] * 12


def test_window_is_seeded_from_the_request_and_warms_up_level_by_level(target):
    """A new request's level 0 is its history at evenly spaced places; each step adds a level (no n-grams) until
    N - 1 levels, then each step adds the columns' n-grams and drops the oldest level. Guesses: the history's
    continuation after the last two tokens first, then the pool's, then after the root alone."""
    d = LookaheadDrafter(window=3, ngram=4, guesses=3)
    d.bind(target, 1, 64)
    d.admit([0], [[1, 2, 3, 4, 5]])
    history = [1, 2, 3, 4, 5, 6]
    tree = d.propose_tree(round_inputs([history], [8]), 64, 3)
    s = d.requests[0]
    assert s.levels == [[1, 3, 5]]
    assert tree.token_ids.tolist() == [[6, 1, 3, 5]] and tree.parents.tolist() == [[-1, 0, 1, 2]]
    d.rollback(RoundFeedback([0], None, paths=[[]], block_argmax=[[0, 7, 8, 9]]))
    assert s.levels == [[1, 3, 5], [7, 8, 9]] and s.pool == {}
    d.propose_tree(round_inputs([history], [8]), 64, 3)
    d.rollback(RoundFeedback([0], None, paths=[[]],
                             block_argmax=[[0] * 16]))  # a level of zeros: the third of N - 1 = 3
    assert len(s.levels) == 3 and s.pool == {}
    s.pool = {6: [(9, 9, 9)]}
    history = [6, 1, 2, 6, 7, 8, 1, 2, 6]  # after (2, 6): 7 8 1; after 6 alone: also 1 2 6
    tree = d.propose_tree(round_inputs([history], [8]), 64, 3)
    assert s.round.sources == ["history", "pool", "history"]
    assert tree.token_ids[0, 1:4].tolist() == [7, 8, 1] and tree.token_ids[0, 4:7].tolist() == [9, 9, 9]


def test_window_learns_the_targets_greedy_tokens_at_its_columns(target, monkeypatch):
    """Through the decoder: after each round the window's new level holds, for each column, the target's greedy
    next token after the request's history and that column's tokens, as plain decoding of that sequence gives it.
    Mutation run once: reading the block's argmax one column early in the round's packed result fails here."""
    prompt = random_prompts(8, [12], vocab=VOCAB)[0]
    drafter = LookaheadDrafter(window=3, ngram=3, guesses=1)
    rounds_seen, histories = [], []
    propose, step = drafter.propose_tree, drafter._jacobi_step

    def recording_propose(r, budget, branching):
        histories.append(list(r.histories[0]))
        return propose(r, budget, branching)

    def recording_step(s, rnd, argmax):
        before = [list(level) for level in s.levels]
        step(s, rnd, argmax)
        rounds_seen.append((histories[-1], before, list(s.levels[-1])))

    monkeypatch.setattr(drafter, "propose_tree", recording_propose)
    monkeypatch.setattr(drafter, "_jacobi_step", recording_step)
    SpeculativeDecoder(target, drafter, adaptive=False, max_batch_size=1).generate([prompt], 12)
    assert len(rounds_seen) >= 3
    for history, levels, new in rounds_seen:
        for i in range(3):
            column = levels[0][:i + 1] + [level[i] for level in levels[1:]]
            assert new[i] == generate_autoregressive(target, [history + column], 1).sequences[0][0]


# ------------------------------------------------------------------------------------------------------ greedy

@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_lookahead_equals_plain_decoding(target, batch, paged, monkeypatch):
    """7 ragged prompts (one of a single token) through `batch` slots, finishing at different rounds, the window
    and the pool in every round (adaptive off): plain greedy decoding's tokens; the pool and the window supplied
    accepted paths, paths left the first branch, the stats add up."""
    prompts = random_prompts(5, [5, 21, 12, 1, 9, 3, 30], vocab=VOCAB)
    max_new = [24, 7, 16, 30, 3, 20, 11]
    plain = generate_autoregressive(target, prompts, max_new)
    paths = record_paths(monkeypatch)
    drafter = LookaheadDrafter(window=4, ngram=3, guesses=3)
    dec = SpeculativeDecoder(target, drafter, adaptive=False, max_batch_size=batch, paged=paged)
    assert dec.tree.num_nodes == 15 and dec.tree.depth == 5  # its own round_tree
    out = dec.generate(prompts, max_new)
    assert out.sequences == plain.sequences
    st = drafter.stats
    assert st.window_steps == st.steps > 0 and st.pool_ngrams > 0 and st.pool_hits > 0 and st.history_hits > 0
    assert st.accepted_tokens == out.stats.num_accepted_tokens and st.accepted_per_step > 0.3
    assert max(len(p) for p in paths) >= 3 and any(p != list(range(len(p))) for p in paths)
    for s in out.request_stats:
        assert s.generated_tokens == s.num_accepted_tokens + s.target_forwards
    if paged:
        assert dec.cache.free_pages == dec.cache.k.shape[1]


@pytest.mark.parametrize("costs,expected", [({1: 1.0, 64: 1.0}, "full"), ({1: 1.0, 2: 1.9, 64: 64.0}, "plain")])
def test_adaptive_sizing_follows_the_verify_cost_and_stays_greedy_exact(target, costs, expected):
    """A flat verify cost (a GPU's) runs the whole window and every guess; a cost growing with each row shrinks the
    plan to plain rounds between probes. Either way the tokens are plain greedy decoding's."""
    prompts = random_prompts(9, [6, 14, 2], vocab=VOCAB)
    drafter = LookaheadDrafter(window=3, ngram=3, guesses=2)
    dec = SpeculativeDecoder(target, drafter, max_batch_size=2, costs=CostModel(costs))
    plans = []
    plan = drafter.plan
    drafter.plan = lambda *args: (plan(*args), plans.append(drafter.planned))
    out = dec.generate(prompts, 20)
    assert out.sequences == generate_autoregressive(target, prompts, 20).sequences
    if expected == "full":
        assert set(plans) == {(3, 2, 2)}
    else:  # plain rounds, and one probe of a column and a guess every 8th round
        assert set(plans) == {(0, 0, 2), (1, 1, 2)} and plans.count((1, 1, 2)) <= len(plans) // 8 + 1


def test_plan_cuts_guesses_to_what_pays():
    """Rank 0 accepted to depth 1 every round, deeper never, no window hits: on a cost growing by 0.3 a row the plan
    is one guess of one token and no window (a 2-row block for 1.9 expected tokens, against 4 rows for 1.9); on a
    flat cost, everything."""
    d = LookaheadDrafter(window=2, ngram=4, guesses=2)
    d.requests = [None]
    d.admit([0], [[1]])
    s = d.requests[0]
    s.guess_hits[0] = [10.0, 0.0, 0.0]
    s.guess_tries[:] = 10.0
    s.window_tries = 100.0
    d.plan(CostModel({1: 1.0, 2: 1.3, 64: 19.9}), 1, 0)
    assert d.planned == (0, 1, 1)
    d.plan(CostModel({1: 1.0, 64: 1.0}), 1, 0)
    assert d.planned == (2, 2, 3)
    d.plan(CostModel({1: 1.0, 2: 1.3, 64: 19.9}), 1, 7)  # a probe round: one more column and guess, full length
    assert d.planned == (1, 2, 3)


def test_plan_without_costs_is_the_settings():
    d = LookaheadDrafter(window=5, ngram=4, guesses=2)
    d.requests = []
    d.plan(None, 1, 0)
    assert d.planned == (5, 2, 3)


# ------------------------------------------------------------------------------------------------ lossless law

@pytest.mark.parametrize("case", list(LAW_CASES))
def test_law_of_the_first_tokens_is_the_targets_with_lookahead(case):
    """As test_speculative_decoding's law test (70,000 or 50,000 seeds by case, chi-square over the 512 sequences of
    3 tokens, power >= 0.9 against a 1% bias, checked by assert_law), with Lookahead's trees (W = 2, N = 3, G = 2:
    the prompt's continuations and the window's trunk and columns, point proposals). Mutation run once: the tree op
    called without the requests' top_k/top_p fails the top-k/top-p case."""
    counts, law, acceptance = sample_first_tokens(law_target(), LookaheadDrafter(window=2, ngram=3, guesses=2), case)
    assert 0.02 < acceptance < 0.9, ("the test needs tree nodes accepted and rejected", acceptance)
    assert_law(counts, law)


# ---------------------------------------------------------------------------------------------------- the cache

@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_cache_holds_a_fresh_prefill_after_every_step(target, paged, monkeypatch):
    """Sampled (paths vary and leave the first branch): after each step the target's cache holds the request's tokens
    but the last and nothing else, each row equal to a fresh prefill of those tokens: the window's K/V are gone.
    Mutation run once: truncating without kept_indices (the block's first rows kept) fails here."""
    prompts = random_prompts(31, [7, 15, 1], vocab=VOCAB)
    paths = record_paths(monkeypatch)
    drafter = LookaheadDrafter(window=3, ngram=3, guesses=2)
    dec = SpeculativeDecoder(target, drafter, adaptive=False, max_batch_size=3, paged=paged)
    check = CacheCheck(target, dec, prompts)
    out = dec.generate(prompts, 16, temperature=1.0, seed=[4, 5, 6], stream=check)
    assert check.generated() == out.sequences
    assert len(check.rounds) >= 3 * 4 and max(len(p) for p in paths) >= 3
    assert any(p != list(range(len(p))) for p in paths)
    if paged:
        assert dec.cache.free_pages == dec.cache.k.shape[1]


# ------------------------------------------------------------------------------------------ the shipped model

@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_shipped_model_lookahead_equals_plain_greedy(paged):
    """SmolLM2-135M-Instruct, two chat prompts at once, 32 tokens, the window and guesses in every round."""
    target, tokenizer = shipped_model()
    prompts = [prompt_ids(tokenizer, "Write a Python function that adds two numbers."),
               prompt_ids(tokenizer, "List three colours.")]
    plain = generate_autoregressive(target, prompts, 32)
    drafter = make_drafter("lookahead:3/4/3", target)
    out = SpeculativeDecoder(target, drafter, adaptive=False, max_batch_size=2, paged=paged).generate(prompts, 32)
    assert out.sequences == plain.sequences
    assert drafter.stats.window_steps > 0 and out.stats.target_forwards < 2 * 32


# ------------------------------------------------------------------------------------------------ bad settings

@pytest.mark.parametrize("settings,message", [
    (dict(window=0), "window must be an int in [1, 63], got 0"),
    (dict(window=True), "window must be an int in [1, 63], got True"),
    (dict(ngram=1), "ngram must be an int in [2, 63], got 1"),
    (dict(ngram=2.0), "ngram must be an int in [2, 63], got 2.0"),
    (dict(guesses=-1), "guesses must be an int in [0, 63], got -1"),
    (dict(window=15, ngram=5, guesses=15),
     "1 + (W + G) * (N - 1) = 121 nodes, past the tree sampling op's limit of 64"),
    (dict(window=8, ngram=5, guesses=8), "= 65 nodes"),
])
def test_bad_settings_raise(settings, message):
    with pytest.raises(ValueError) as e:
        LookaheadDrafter(**settings)
    assert message in str(e.value)


def test_largest_settings_fit_the_verify_block(target):
    """63 nodes below the root: accepted, and a tree of that size verifies (greedy equal to plain)."""
    drafter = LookaheadDrafter(window=31, ngram=2, guesses=32)
    assert drafter.round_tree().num_nodes == 64
    prompts = random_prompts(2, [40], vocab=VOCAB)
    out = SpeculativeDecoder(target, drafter, adaptive=False, max_batch_size=1).generate(prompts, 12)
    assert out.sequences == generate_autoregressive(target, prompts, 12).sequences


def test_chain_proposals_are_the_first_guess(target):
    """propose (a chain round driving the drafter) drafts each row's first guess cut to its k, no window."""
    d = LookaheadDrafter(window=2, ngram=4, guesses=2)
    d.bind(target, 3, 64)
    d.admit([0, 1], [[1, 2], [3]])
    d.requests[1].pool = {4: [(8, 9, 10)]}
    out = d.propose(round_inputs([[1, 2, 3, 1, 2], [3, 4], None], [2, 3, 0]))
    assert out.draft_token_ids.tolist() == [[3, 1, 0], [8, 9, 10], [0, 0, 0]] and out.num_draft_tokens == [2, 3, 0]


def test_command_line_spelling(target):
    """--drafter lookahead (its defaults) and lookahead:W/N/G; the stats line names what it counts."""
    assert (lambda d: (d.window, d.ngram, d.guesses))(make_drafter("lookahead", target)) == (7, 5, 7)
    drafter = make_drafter("lookahead:3/4/2", target)
    assert (drafter.window, drafter.ngram, drafter.guesses) == (3, 4, 2)
    assert drafter.round_tree().num_nodes == 1 + (3 + 2) * 3
    drafter.stats.steps, drafter.stats.accepted_tokens, drafter.stats.pool_hits = 4, 6, 2
    assert "1.50 drafts accepted per step" in drafter.stats.summary() and "from the pool 2" in drafter.stats.summary()
