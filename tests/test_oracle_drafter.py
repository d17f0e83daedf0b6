"""OracleDrafter and the end-to-end bound (specdec_ext/bench/e2e_synthetic.py): realised tokens per round against the
chain formula on the tiny synthetic target, speculative output equal to the reference run, the bound and efficiency
of a hand-computed row, and the benchmark's synthetic rows at a tiny size."""
import json
import math

import pytest
import torch

from specdec_ext import SpeculativeDecoder
from specdec_ext.bench import e2e
from specdec_ext.bench.e2e_synthetic import chain_tokens_per_round, first_difference, leviathan_bound, realised
from specdec_ext.drafters import OracleDrafter
from specdec_ext.models import synthetic

SAMPLING = {"greedy": ({}, "rejection"), "invariant": ({"temperature": 0.8, "top_p": 0.95}, "invariant")}


@pytest.fixture(scope="module")
def tiny():
    return synthetic("tiny", dtype=torch.float32, device="cpu", seed=0)


def reference_run(model, batch: int, new_tokens: int, mode: str, seed: int = 0):
    """(prompts, plain decoding's sequences, the oracle's references) of `batch` random prompts."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=generator).tolist()
               for n in torch.randint(4, 12, (batch,), generator=generator).tolist()]
    params, sampling = SAMPLING[mode]
    plain = SpeculativeDecoder(model, None, max_batch_size=batch, sampling=sampling)
    sequences = plain.generate_autoregressive(prompts, new_tokens, seed=list(range(batch)), **params).sequences
    return prompts, sequences, [p + s for p, s in zip(prompts, sequences)]


def speculate(model, prompts, references, mode, a, k=4, *, slots=8, tree=None, draft_model=None, seed=0,
              new_tokens=None):
    params, sampling = SAMPLING[mode]
    decoder = SpeculativeDecoder(model, OracleDrafter(references, a, seed=seed, draft_model=draft_model), k,
                                 adaptive=False, max_batch_size=slots, tree=tree, sampling=sampling)
    new_tokens = new_tokens or len(references[0]) - len(prompts[0])
    return decoder.generate(prompts, new_tokens, seed=list(range(len(prompts))), **params)


# -------------------------------------------------------------------------------------------- the formulas

def test_chain_formula_bound_and_efficiency_of_a_hand_computed_row():
    # k = 4, a = 0.8: 1 + 0.8 + 0.64 + 0.512 + 0.4096
    assert chain_tokens_per_round(0.8, 4) == pytest.approx(3.3616)
    assert chain_tokens_per_round(0.0, 4) == 1.0 and chain_tokens_per_round(1.0, 4) == 5.0
    # 3.2 tokens per round, c = 0.1, v = 1.2: the round costs 4 * 0.1 + 1.2 = 1.6 plain steps, bound 3.2 / 1.6 = 2
    bound = leviathan_bound(3.2, 4, 0.1, 1.2)
    assert bound == pytest.approx(2.0)
    assert 1.7 / bound == pytest.approx(0.85)  # a measured speedup of 1.7: efficiency 0.85
    assert leviathan_bound(3.3616, 4, 0.0, 1.0) == pytest.approx(3.3616)  # free drafts, verify = a plain step


def test_first_difference():
    assert first_difference([[1, 2], [3, 4]], [[1, 2], [3, 4]]) is None
    assert first_difference([[1, 2], [3, 4]], [[1, 2], [3, 5]]) == (1, 1)
    assert first_difference([[1, 2, 3]], [[1, 2]]) == (0, 2)


# ----------------------------------------------------------------------------------------------- the drafter

@pytest.mark.parametrize("mode", ["greedy", "invariant"])
def test_realised_tokens_per_round_follow_the_chain_formula(tiny, mode):
    """32 requests x 200 tokens at k = 4, a = 0.8: about 1,900 rounds with drafts. Tokens per round take 1..5 with
    variance 2.57 (mean 3.36), so their mean has a standard error of 0.037; the test allows 0.15 (4 s.e.: a false
    alarm below 1e-4), and an acceptance off by 0.05 (mean 3.05, 0.31 away) passes it with probability below 1e-4.
    The expected value is the formula at each round's own k (the last rounds of a request draft fewer)."""
    prompts, plain, references = reference_run(tiny, 32, 200, mode)
    out = speculate(tiny, prompts, references, mode, 0.8)
    assert out.sequences == plain
    tokens, formula, _ = realised(out.request_stats, 0.8)
    assert formula == pytest.approx(3.36, abs=0.05)  # nearly every round drafts 4
    assert abs(tokens - formula) < 0.15, (tokens, formula)


@pytest.mark.parametrize("mode", ["greedy", "invariant"])
@pytest.mark.parametrize("tree", [None, {"num_nodes": 10, "depth": 4, "branching": 3}], ids=["chain", "tree"])
def test_speculative_output_is_the_reference_run(tiny, mode, tree):
    prompts, plain, references = reference_run(tiny, 5, 40, mode, seed=1)
    for a in (0.0, 0.5, 1.0):
        out = speculate(tiny, prompts, references, mode, a, slots=2, tree=tree)
        assert out.sequences == plain, (a, first_difference(plain, out.sequences))
        tokens, _, _ = realised(out.request_stats, a)
        if a == 0.0:
            assert tokens == 1.0  # every proposal wrong: the recovered token alone
        if a == 1.0:  # every proposal right: k + 1 per round but where a request's end cuts the round
            assert tokens > 4.5
            assert out.stats.acceptance_rate == 1.0 if tree is None else out.stats.acceptance_rate < 1.0  # siblings


def test_tree_rounds_accept_the_path_and_never_a_sibling(tiny):
    """A tree holds the reference path and wrong siblings: the accepted depth follows the chain's law, so at a = 1
    every round accepts the whole path (depth 4), and the realised tokens per round stay within the chain's."""
    prompts, plain, references = reference_run(tiny, 4, 60, "greedy", seed=2)
    tree = {"num_nodes": 12, "depth": 4, "branching": 3}
    full = speculate(tiny, prompts, references, "greedy", 1.0, slots=4, tree=tree)
    assert full.sequences == plain
    assert all(d == 4 for s in full.request_stats for d in s.accepted_depths[:-1])
    tokens, _, _ = realised(speculate(tiny, prompts, references, "greedy", 0.7, slots=4, tree=tree).request_stats,
                            0.7)
    assert 1.0 < tokens < 5.0


def test_a_draft_model_runs_and_changes_no_token(tiny):
    """With a draft model its steps run (draft time spent) and the proposals are still the oracle's: the same
    tokens and the same rounds as without it."""
    draft = synthetic("head", dtype=torch.float32, device="cpu", seed=3, target_config=tiny.config)
    prompts, plain, references = reference_run(tiny, 3, 30, "greedy", seed=3)
    alone = speculate(tiny, prompts, references, "greedy", 0.7, slots=3)
    drafted = speculate(tiny, prompts, references, "greedy", 0.7, slots=3, draft_model=draft)
    assert drafted.sequences == alone.sequences == plain
    assert [s.k_per_round for s in drafted.request_stats] == [s.k_per_round for s in alone.request_stats]
    assert [s.num_accepted_tokens for s in drafted.request_stats] == \
        [s.num_accepted_tokens for s in alone.request_stats]
    assert drafted.stats.draft_s > 0


def test_fates_do_not_depend_on_the_batch(tiny):
    """Position j of request i is wrong by the uniform of (seed, i, j): each request's rounds are the same alone
    and beside others; another seed gives other rounds."""
    prompts, plain, references = reference_run(tiny, 4, 40, "greedy", seed=4)
    rounds = {slots: [s.k_per_round + [s.num_accepted_tokens] for s in
                      speculate(tiny, prompts, references, "greedy", 0.6, slots=slots).request_stats]
              for slots in (1, 4)}
    assert rounds[1] == rounds[4]
    other = [s.num_accepted_tokens for s in speculate(tiny, prompts, references, "greedy", 0.6, slots=4,
                                                      seed=9).request_stats]
    assert other != [r[-1] for r in rounds[4]]


@pytest.mark.parametrize("kwargs, match", [
    (dict(reference_tokens=[], acceptance=0.5), "reference_tokens"),
    (dict(reference_tokens=[[1, 2]], acceptance=1.5), "acceptance"),
    (dict(reference_tokens=[[1, 2]], acceptance=math.nan), "acceptance"),
    (dict(reference_tokens=[[1, 2]], acceptance=0.5, seed=-1), "seed"),
])
def test_bad_arguments_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OracleDrafter(**kwargs)


def test_references_in_another_order_are_refused(tiny):
    prompts, _, references = reference_run(tiny, 2, 8, "greedy", seed=5)
    with pytest.raises(ValueError, match="reference 0"):
        speculate(tiny, prompts, references[::-1], "greedy", 0.5, new_tokens=8)
    with pytest.raises(ValueError, match="vocabulary"):
        speculate(tiny, prompts, [r + [tiny.config.vocab_size] for r in references], "greedy", 0.5, new_tokens=8)


# --------------------------------------------------------------------------------------------- the benchmark

def test_synthetic_rows_at_a_tiny_size(tmp_path):
    """`specdec bench e2e --target synthetic:tiny` on the CPU: each row's fields, tokens equal to the reference,
    the bound and efficiency consistent with the row's own c, v and tokens per round."""
    import argparse

    parser = argparse.ArgumentParser()
    e2e.add_arguments(parser)
    out = tmp_path / "e2e.json"
    args = parser.parse_args(["--target", "synthetic:tiny", "--device", "cpu", "--batch", "1,2", "--k", "3",
                              "--oracle-acceptance", "0.5,0.9", "--draft", "none,head", "--new-tokens", "24",
                              "--repeats", "1", "--sampling", "greedy,invariant", "--tree", "8",
                              "--json", str(out), "--plot", str(tmp_path / "e2e.png")])
    assert e2e.main(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * 2 * 2 * 2 * 2  # B x sampling x draft x (chain, tree) x a
    for r in rows:
        assert r["same_as_plain"] is True, r
        assert r["bound"] == pytest.approx(r["tokens_per_round"] / (r["k"] * r["c"] + r["v"]))
        assert r["efficiency"] == pytest.approx(r["speedup"] / r["bound"])
        assert (r["c"] == 0) == (r["draft"] == "none") and r["v"] > 0
        assert (r["tokens_per_round_formula"] is None) == (r["tree"] != "-")
        assert r["recaptures"] == 0 and math.isnan(r["syncs_per_round"])  # counted on CUDA only
    assert (tmp_path / "e2e.png").stat().st_size > 0


def test_prefill_time_is_counted_apart(tiny):
    """GenerationStats.prefill_s: the prompts' prefills, part of other_s and of elapsed_s (the benchmark's tokens/s
    leave it out)."""
    prompts = [list(range(1, 200))] * 2
    s = SpeculativeDecoder(tiny, None, max_batch_size=2).generate_autoregressive(prompts, 4).stats
    assert 0 < s.prefill_s <= s.other_s < s.elapsed_s
