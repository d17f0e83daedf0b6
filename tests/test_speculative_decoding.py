"""SpeculativeDecoder with NgramDrafter and ModelDrafter on tiny random transformers models: greedy output equals
plain decoding token for token, the law of the first tokens at temperature > 0 is the target's exact law
(chi-square over every sequence, float64 conditionals from transformers), both caches hold what a fresh
prefill would after every round, seeds reproduce and a request ignores its batch, adaptive k, stats, bad
input. Fixed seeds throughout."""
import pytest
import torch

import specdec_ext
from helpers.chi_square import assert_law
from helpers.decoder_probes import CacheCheck, assert_cache_holds
from helpers.laws import LAW_CASES, LAW_PROMPT, LAW_TOKENS, law_draft, law_target, sample_first_tokens
from helpers.models import VOCAB, random_prompts, tiny_hf, tiny_model
from specdec_ext import AcceptanceMonitor, ModelDrafter, NgramDrafter, SpeculativeDecoder
from specdec_ext import ops as ops_module
from specdec_ext.engine import CostModel, generate_autoregressive
from specdec_ext.models import LlamaForCausalLM

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def pair():
    """A target and a different, smaller draft of the same vocabulary (random: acceptance is low but not 0 at
    temperature > 0), plus the target drafting for itself (acceptance 1 when greedy)."""
    return tiny_model(seed=1234), tiny_model(seed=77, layers=1, hidden=32, heads=2, kv_heads=1)


def drafters(target, draft):
    return {"ngram": NgramDrafter(3, 1), "model": ModelDrafter(draft), "self": ModelDrafter(target)}


def repetitive_prompts(seed, lengths):
    """Prompts that repeat a short random phrase (prompt lookup finds matches), of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        phrase = torch.randint(VOCAB, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        out.append((phrase * n)[:n])
    return out


# ------------------------------------------------------------------------------------------------------ greedy

@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("name", ["ngram", "model", "self"])
def test_greedy_equals_plain_decoding_with_continuous_batching(pair, name, paged):
    """7 ragged prompts through 3 slots: requests finish at different rounds (max_new_tokens per request) and
    waiting ones are admitted into the freed slots; k adaptive (fixed for the self-drafter)."""
    target, draft = pair
    prompts = random_prompts(5, [5, 21, 12, 3, 9, 1, 30])[:4] + repetitive_prompts(6, [14, 2, 25])
    max_new = [24, 7, 16, 30, 3, 20, 11]
    plain = generate_autoregressive(target, prompts, max_new)
    # The target drafting for itself never pays (adaptive k would switch it off): fixed k.
    dec = SpeculativeDecoder(target, drafters(target, draft)[name], 4, max_batch_size=3, paged=paged,
                             adaptive=name != "self")
    out = dec.generate(prompts, max_new)
    assert out.sequences == plain.sequences
    assert [len(s) for s in out.sequences] == max_new
    if name == "self":  # drafting with the target itself: every greedy draft is accepted
        assert out.stats.acceptance_rate == 1.0 and out.stats.mean_acceptance_length > 3
    # The decoder's own plain decoding agrees too, and the decoder can be reused.
    assert dec.generate_autoregressive(prompts, max_new).sequences == plain.sequences


def test_greedy_with_eos_and_max_seq_len(pair):
    target, draft = pair
    prompts = repetitive_prompts(8, [6, 14, 9])
    free = generate_autoregressive(target, prompts, 16).sequences
    eos = free[0][5]
    assert eos not in free[0][:5], "pick another prompt seed"
    def cut(s):
        return s[:s.index(eos) + 1] if eos in s else s
    for drafter in (NgramDrafter(), ModelDrafter(target)):  # ModelDrafter(target) drafts across the EOS
        dec = SpeculativeDecoder(target, drafter, 4, max_seq_len=20)
        got = dec.generate(prompts, 16, eos_token_id=eos).sequences
        assert got == [cut(s[:20 - len(p)]) for s, p in zip(free, prompts)]
        assert got[0][-1] == eos and len(got[0]) == 6


# ------------------------------------------------------------------------------------------------ lossless law

@pytest.fixture(scope="module")
def law_models():
    """helpers' law target and its different draft (8 tokens, spread-out distributions: acceptance ~0.5-0.7)."""
    return law_target(), law_draft()


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LAW_CASES))
@pytest.mark.parametrize("name, sampling", [("ngram", "rejection"), ("model", "rejection"), ("model", "block")])
def test_law_of_the_first_tokens_is_the_targets(law_models, name, sampling, case):
    """70,000 requests at T=1, 50,000 with top-k/top-p (seeds 0, 1, ...; LAW_SAMPLES) of one prompt, k = 2 fixed:
    the sequences of their first 3 tokens (512 possible) against the exact law by chi-square (cells expected < 5
    pooled), p > 1e-3. The power against the hardest 1% bias (see chi_square_power) is checked to be >= 0.9 for
    the law at hand; a concentrated error (a masked token sampled, a wrong q) moves far more. Mutation run once:
    handing the kernel the draft's unprocessed logits as q (ModelDrafter, top-k/top-p case) fails this test.
    sampling="block" with the model drafter (draft rows: block verification differs from token-wise there; with
    point proposals it accepts the same)."""
    target, draft = law_models
    drafter = NgramDrafter(2, 1) if name == "ngram" else ModelDrafter(draft)
    counts, law, acceptance = sample_first_tokens(target, drafter, case, sampling=sampling)
    assert 0.1 < acceptance < 0.95, ("the test needs drafts accepted and rejected", acceptance)
    assert_law(counts, law)


def test_block_verification_accepts_more_than_token_wise(law_models):
    """The model drafter on the law models at T = 1, k = 2, 20,000 requests (about 50,000 drafts) per mode, the same
    seeds: block verification's acceptance rate (measured 0.388 at 10,000 requests) above token-wise (0.367) by more
    than 0.01. Each rate's standard error is at most sqrt(0.25 / 50,000) = 0.0022 treating drafts as independent
    (positions of one request are correlated: say 0.004), so the margin is 2.5 s.e. of the difference below the
    measured gap of 0.022 and a verification that accepts no more than token-wise fails it with p < 1e-4."""
    target, draft = law_models
    rates = {}
    for sampling in ("rejection", "block"):
        temperature, top_k, top_p = LAW_CASES["T=1"]
        dec = SpeculativeDecoder(target, ModelDrafter(draft), 2, adaptive=False, max_batch_size=5000,
                                 sampling=sampling)
        accepted = drafted = 0
        for start in range(0, 20_000, 5000):
            out = dec.generate([LAW_PROMPT] * 5000, LAW_TOKENS, temperature=temperature, top_k=top_k, top_p=top_p,
                               seed=list(range(start, start + 5000)))
            accepted, drafted = accepted + out.stats.num_accepted_tokens, drafted + out.stats.num_draft_tokens
        rates[sampling] = accepted / drafted
    assert rates["block"] > rates["rejection"] + 0.01, rates


def test_block_verification_in_the_decoder_greedy_reproducible_and_chains_only(pair):
    """sampling="block": greedy requests are plain greedy decoding's tokens; a seed reproduces a sampled request,
    alone or in a batch; tree rounds (and LookaheadDrafter, whose rounds are trees) are refused by name."""
    target, draft = pair
    a, b = repetitive_prompts(5, [9, 14])
    plain = generate_autoregressive(target, [a, b], 20).sequences
    out = SpeculativeDecoder(target, NgramDrafter(), 3, adaptive=False, max_batch_size=2,
                             sampling="block").generate([a, b], 20)
    assert out.sequences == plain and out.stats.num_accepted_tokens > 0
    dec = SpeculativeDecoder(target, ModelDrafter(draft), 3, adaptive=False, max_batch_size=2, sampling="block")
    assert dec.generate([a, b], 20).sequences == plain
    alone = dec.generate([a], 20, seed=3, temperature=0.9).sequences[0]
    assert dec.generate([b, a], 20, seed=[8, 3], temperature=[0.5, 0.9]).sequences[1] == alone
    with pytest.raises(ValueError, match="sampling='block' verifies chains"):
        SpeculativeDecoder(target, NgramDrafter(), 3, tree=8, sampling="block")
    with pytest.raises(ValueError, match="sampling='block' verifies chains"):
        SpeculativeDecoder(target, specdec_ext.LookaheadDrafter(), 3, sampling="block")
    with pytest.raises(ValueError, match="sampling must be one of"):
        SpeculativeDecoder(target, NgramDrafter(), 3, sampling="blocks")


# ---------------------------------------------------------------------------------------------------- rollback


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_caches_hold_a_fresh_prefill_after_every_round(pair, paged):
    """After each round (when the stream callback runs) the target's cache holds the request's tokens but the
    last emitted one, and the draft's a prefix of them, K and V equal to a fresh prefill of those tokens."""
    target, draft = pair
    prompts = random_prompts(31, [7, 15, 4])
    drafter = ModelDrafter(draft)
    dec = SpeculativeDecoder(target, drafter, 3, max_batch_size=3, paged=paged, adaptive=False)

    def draft_cache(r, tokens, n):
        m = int(drafter.cache.cache_seqlens[r])
        assert m == drafter.state.lengths[r] and len(tokens) - 2 <= m <= len(tokens) - 1
        assert_cache_holds(draft, drafter.cache, r, tokens[:m])

    check = CacheCheck(target, dec, prompts, draft_cache)
    out = dec.generate(prompts, 12, temperature=0.9, seed=[4, 5, 6], stream=check)
    assert check.generated() == out.sequences
    assert len(check.rounds) >= 3 * 3 and any(n > 1 for _, n in check.rounds), "rounds with accepted drafts needed"
    if paged:  # every page back in the pool once the requests finished
        assert dec.cache.free_pages == dec.cache.k.shape[1] and drafter.cache.free_pages == drafter.cache.k.shape[1]


# ---------------------------------------------------------------------------------------- determinism, batching

SAMPLING = dict(temperature=0.8, top_k=20, top_p=0.9)


@pytest.mark.parametrize("name", ["ngram", "model"])
def test_seeds_reproduce_and_a_request_ignores_its_batch(pair, name):
    """CPU, float32: request a's tokens alone equal its tokens in a batch with other prompts, seeds and
    parameters at another index (the batch has at most 15 rows of B x Q, so every GEMM row takes the same path;
    the attention's splits are batch invariant). adaptive=False: no cost enters k. Adaptive k from one cost model
    (a decoder that measures its own may choose other k, hence other, equally distributed, tokens) reproduces
    a run; its k depends on the batch size, so batch independence is checked with a cost that does not grow
    with the rows."""
    target, draft = pair
    a, b, c = repetitive_prompts(9, [11, 6, 17])
    draft_cost = {1: 0.2} if name == "model" else None
    costs = CostModel({1: 1.0, 5: 1.3}, draft_cost)
    def make(costs):
        return SpeculativeDecoder(target, drafters(target, draft)[name], 4, max_batch_size=3, costs=costs)
    alone = make(costs).generate([a], 24, seed=7, **SAMPLING).sequences[0]
    assert make(costs).generate([a], 24, seed=7, **SAMPLING).sequences[0] == alone
    assert make(costs).generate([a], 24, seed=8, **SAMPLING).sequences[0] != alone
    flat = CostModel({1: 1.0, 64: 1.0}, draft_cost)
    alone = make(flat).generate([a], 24, seed=7, **SAMPLING).sequences[0]
    batch = make(flat).generate([b, a, c], [10, 24, 30], seed=[3, 7, 11], temperature=[1.0, 0.8, 0.0],
                                top_k=[0, 20, 3], top_p=[0.5, 0.9, 1.0])
    assert batch.sequences[1] == alone
    def fixed():
        return SpeculativeDecoder(target, drafters(target, draft)[name], 3, adaptive=False, max_batch_size=3)
    alone = fixed().generate([a], 24, seed=7, **SAMPLING).sequences[0]
    assert fixed().generate([c, a], [30, 24], seed=[11, 7], temperature=[0.0, 0.8], top_k=[3, 20],
                            top_p=[1.0, 0.9]).sequences[1] == alone


# ------------------------------------------------------------------------------------------- adaptive k, stats

def test_adaptive_k_follows_acceptance_and_stats_add_up(pair):
    target, draft = pair
    prompts = random_prompts(41, [9, 13])
    # A draft step costing 0.1 of a verify step, which grows 20% from Q = 1 to Q = 7: k = 6 pays at acceptance 1.
    costs = CostModel({1: 1.0, 7: 1.2}, {1: 0.1})
    # By hand: at alpha 0.2, k = 1 gives 1.2 / 1.133 = 1.06 tokens per verify cost, k = 0 gives 1, k = 2 0.98;
    # at 0.5, k = 2 gives 1.75 / 1.267 = 1.38 against 1.32 (k = 1) and 1.34 (k = 3).
    assert [costs.best_k(a, 6) for a in (0.0, 0.2, 0.5, 0.9, 1.0)] == [0, 1, 2, 6, 6]
    # A verify cost that doubles past 4 rows (as a CPU GEMM's extra pass over the weights), drafts free, alpha
    # 0.8, k <= 3: at batch 1, k = 3 (4 rows) gives 2.95 tokens per unit; at batch 2, k = 1 (4 rows) gives 1.8,
    # k = 3 (8 rows) 2.95 / 2 = 1.48.
    step = CostModel({1: 1.0, 4: 1.0, 5: 2.0, 8: 2.0})
    assert step.best_k(0.8, 3) == 3 and step.best_k([0.8, 0.8], 3) == 1
    # One request that drafts well and one that never does: 1.8 + 1 tokens for 4 rows beats 2 for 2 rows.
    assert step.best_k([0.8, 0.0], 3) == 1 and step.best_k([0.0, 0.0], 3) == 0
    good = SpeculativeDecoder(target, ModelDrafter(target), 6, costs=costs).generate(prompts, 40)
    bad = SpeculativeDecoder(target, ModelDrafter(draft), 6, costs=costs).generate(prompts, 40)
    for out in (good, bad):
        for s in out.request_stats:
            assert all(0 <= k <= 6 for k in s.k_per_round)
            assert s.generated_tokens == s.num_accepted_tokens + s.target_forwards  # no EOS here
            assert sum(s.accepted_per_position) == s.num_accepted_tokens
            assert s.num_draft_tokens == sum(s.k_per_round) == sum(s.drafted_per_position)
            # Position i is drafted in the rounds with k > i; the self-drafter accepts every one of them.
            assert s.drafted_per_position == [sum(k > i for k in s.k_per_round) for i in range(max(s.k_per_round))]
            if out is good:
                assert s.acceptance_rate_per_position == [1.0] * len(s.drafted_per_position)
        total = out.stats
        assert total.generated_tokens == 80
        assert total.num_accepted_tokens == sum(s.num_accepted_tokens for s in out.request_stats)
        assert sum(total.accepted_per_position) == total.num_accepted_tokens
        assert total.draft_s > 0 and total.verify_s > 0 and total.sample_s > 0
    def mean_k(out):
        return sum(sum(s.k_per_round) for s in out.request_stats) / sum(
            len(s.k_per_round) for s in out.request_stats)
    # The self-drafter is always right: k stays high; the random draft is rarely right: k falls (to 0, with probes).
    assert mean_k(good) > 4 and mean_k(bad) < 1.5, (mean_k(good), mean_k(bad))
    assert good.stats.acceptance_rate == 1.0 and bad.stats.acceptance_rate < 0.2
    # heuristic: +2 after a full round, -1 after a rejection, within [1, k]
    h = SpeculativeDecoder(target, ModelDrafter(draft), 6, adaptive="heuristic").generate(prompts, 30)
    for s in h.request_stats:
        ks = s.k_per_round
        assert ks[0] == 6 and min(ks[:-1]) >= 1  # the last round's k is cut to the 1 token left
        assert all(b in (max(1, a - 1), min(6, a + 2)) for a, b in zip(ks, ks[1:-1])), ks
    fixed = SpeculativeDecoder(target, ModelDrafter(draft), 3, adaptive=False).generate(prompts[:1], 30)
    assert set(fixed.request_stats[0].k_per_round[:-3]) == {3}


def test_acceptance_monitor_warns_under_its_threshold():
    monitor = AcceptanceMonitor(window=10, threshold=0.5)
    monitor.observe(4, 4)
    monitor.observe(4, 3)
    assert monitor.acceptance_rate == 7 / 8
    with pytest.warns(RuntimeWarning, match="below 0.50"):
        for _ in range(3):
            monitor.observe(4, 0)
    assert monitor.acceptance_rate == 0.0  # the window holds the last 10 outcomes only


# --------------------------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("k", [0, -1, 129, 2.5, True])
def test_bad_num_speculative_tokens(pair, k):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeDecoder(pair[0], NgramDrafter(), k)


def test_bad_inputs_raise_and_leave_nothing_half_done(pair):
    target, draft = pair
    other_vocab = LlamaForCausalLM.from_hf(tiny_hf(vocab=VOCAB + 3, layers=1, hidden=32, seed=3))
    with pytest.raises(ValueError, match="vocabulary"):
        SpeculativeDecoder(target, ModelDrafter(other_vocab)).generate([[1, 2]], 4)
    with pytest.raises(ValueError, match="no drafter"):
        SpeculativeDecoder(target, None).generate([[1, 2]], 4)
    dec = SpeculativeDecoder(target, ModelDrafter(draft), 4, max_batch_size=2, max_seq_len=16)
    want = dec.generate([[1, 2, 3], [4, 5]], 8, temperature=0.7, seed=[1, 2]).sequences
    for args, kwargs in [(([[1, 2], []], 4), {}), (([[1] * 16], 4), {}), (([[1] * 20], 4), {}),
                         (([[1], [2]], [4, 4, 4]), {}), (([[1], [2]], 4), {"seed": [1]}),
                         (([[1], [2]], 4), {"temperature": [0.5, 0.5, 0.5]}), (([[1, VOCAB]], 4), {}),
                         (([[1]], 4), {"top_p": 0.0, "temperature": 1.0}), (([], 4), {})]:
        with pytest.raises(ValueError):
            dec.generate(*args, **kwargs)
    assert dec.generate([[1, 2, 3], [4, 5]], 8, temperature=0.7, seed=[1, 2]).sequences == want
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDrafter(2, 3)


def test_ngram_lookup_takes_the_longest_latest_match():
    d = NgramDrafter(3, 1)
    assert d.lookup([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2) == [7, 5]  # latest occurrence of [1, 2, 3]
    assert d.lookup([4, 2, 3, 8, 1, 2, 3], 3) == [8, 1, 2]  # [1, 2, 3] unseen: [2, 3]
    assert d.lookup([5, 6, 7, 6], 4) == [7, 6]  # only [6] matches; the draft ends at the sequence's end
    assert d.lookup([1, 2, 3], 4) == [] and d.lookup([1], 4) == []
    assert NgramDrafter(3, 2).lookup([5, 6, 7, 6], 4) == []  # min_ngram 2


# ------------------------------------------------------------------------------------------ CUDA-graph safety

def test_op_wrappers_refuse_python_scalars_while_capturing(monkeypatch):
    """Under CUDA-graph capture a Python seed, offset, temperature or count would be frozen into the graph:
    the wrappers raise (the capture state is simulated here; tests/gpu captures for real)."""
    b, k, v = 2, 3, 16
    logits = torch.randn(b, k + 1, v)
    drafts = torch.randint(v, (b, k))
    tensors = dict(temperature=torch.full((b,), 0.5), seed=torch.arange(b), offset=torch.zeros(b, dtype=torch.int64),
                   num_draft_tokens=torch.full((b,), k, dtype=torch.int32))
    monkeypatch.setattr(ops_module, "_capturing", lambda: True)
    specdec_ext.chain_speculative_sampling_from_logits(drafts, logits, **tensors)  # all tensors: fine
    for name, scalar in [("temperature", 0.5), ("seed", 3), ("offset", 0), ("num_draft_tokens", 2)]:
        with pytest.raises(ValueError, match=f"{name} is a Python .* CUDA graph"):
            specdec_ext.chain_speculative_sampling_from_logits(drafts, logits, **{**tensors, name: scalar})
    with pytest.raises(ValueError, match="seed is a Python"):
        specdec_ext.chain_speculative_sampling_from_logits(drafts, logits, **{**tensors, "seed": None})
    with pytest.raises(ValueError, match="offset is a Python"):
        specdec_ext.philox_uniform(torch.arange(2), 5, 4)
    with pytest.raises(ValueError, match="num_kept is a Python"):
        specdec_ext.truncate_kv_cache(torch.zeros(2, dtype=torch.int32), 1)


def test_measured_guard_turns_to_plain_rounds_when_drafting_loses():
    """The policy's guard (costs measured, not given): rounds are plain while the rounds that drafted emit fewer
    tokens a second than plain rounds, but for every 8th round (drafts, to keep that rate current); every 16th round
    is plain while drafting wins. Only for requests whose tokens do not depend on the drafts, on a target whose rows
    have the same bits in any block (a CPU model kept with 8-bit activations: SpeculativeDecoder sets it)."""
    from types import SimpleNamespace

    from specdec_ext.engine.policy import Policy

    greedy, sampled = SimpleNamespace(temperature=0.0), SimpleNamespace(temperature=0.7)
    policy = Policy(True, 4, None, drafter=None, costs=None, rows_invariant=True)
    assert not policy.plain_round([greedy], 0)  # nothing measured yet
    policy.observe_round(True, 10, 1.0)
    assert policy.plain_round([greedy], 3)  # drafting measured, plain not yet: a plain round measures it
    policy.observe_round(False, 10, 0.5)  # plain: 20 tokens/s against 10
    assert [policy.plain_round([greedy], i) for i in (0, 1, 6, 7, 15)] == [True, True, True, False, False]
    assert not policy.plain_round([greedy, sampled], 0)  # rejection-sampled tokens would follow wall time
    assert Policy(True, 4, None, None, None, invariant_sampling=True, rows_invariant=True).plain_round(
        [sampled], 3) is False  # nothing measured
    for _ in range(30):
        policy.observe_round(True, 30, 1.0)  # drafting now 30 tokens/s
    assert [policy.plain_round([greedy], i) for i in (0, 3, 19)] == [False, True, True]
    loose = Policy(True, 4, None, None, None)  # a target whose rows' bits follow the block (greedy tokens would too)
    loose.observe_round(True, 1, 1.0)
    loose.observe_round(False, 10, 0.1)
    assert not loose.plain_round([greedy], 0)
    given = Policy(True, 4, None, None, CostModel({1: 1.0}), rows_invariant=True)  # costs given: the model's only
    given.observe_round(True, 1, 1.0)
    given.observe_round(False, 10, 0.1)
    assert not given.plain_round([greedy], 0)
