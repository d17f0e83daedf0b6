"""Regression tests of the decoder's hardening (each failed on the code before it): rounds in which no request can
draft, one generate at a time, finish reasons and the model's context, caches sized from the call (and page
budgets that queue), the cost model measured on the rows a call can use and kept in a file (zero costs, and cache
files that do not hold a valid table), and input checks with one message per argument. Tiny random models, fixed
seeds."""
import json
import math
import re
import threading
import time
import types

import numpy as np
import pytest
import torch

from helpers.models import VOCAB, make_drafter, random_prompts, random_vocab, tiny_hf, tiny_model
from specdec_ext import LookaheadDrafter, ModelDrafter, NgramDrafter, SpeculativeDecoder, TreeSettings, cost_tables
from specdec_ext.engine import decoder, generate_autoregressive, policy
from specdec_ext.engine.requests import check_eos

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=1234)  # max_position_embeddings 256


@pytest.fixture(scope="module")
def vocab(target):
    return random_vocab(target.config.vocab_size, 64, 1)


# ------------------------------------------------------------------------------------ rounds with no drafts

@pytest.mark.parametrize("tree", [None, 8], ids=["chain", "tree"])
@pytest.mark.parametrize("name", ["eagle", "medusa"])
@pytest.mark.parametrize("case", ["alone", "all one-token", "beside a request in its last round"])
def test_one_token_prompts_with_draft_heads(target, vocab, name, tree, case):
    """A head has no feature before a one-token prompt's first round: that round drafts nothing for it. With no
    neighbour that drafts, the round once handed the sampling op an empty draft tensor ([B, 0, V]) and raised."""
    prompts, max_new = {"alone": ([[5]], [6]), "all one-token": ([[5], [77]], [6, 9]),
                        "beside a request in its last round": ([[3, 9, 4, 1], [5]], [1, 7])}[case]
    plain = generate_autoregressive(target, prompts, max_new)
    dec = SpeculativeDecoder(target, make_drafter(name, target, vocab), 4, adaptive=False, max_batch_size=2, tree=tree)
    out = dec.generate(prompts, max_new)
    assert out.sequences == plain.sequences
    assert out.finish_reasons == ["length"] * len(prompts)


# --------------------------------------------------------------------------------------- one call at a time

def test_a_second_concurrent_generate_is_refused(target):
    """Two threads on one decoder once shared its caches and returned wrong tokens silently."""
    prompts = random_prompts(3, [7, 12])
    expected = generate_autoregressive(target, prompts, 40).sequences
    dec = SpeculativeDecoder(target, NgramDrafter(), 4, adaptive=False)
    inside, release = threading.Event(), threading.Event()

    def slow_stream(r, new):  # holds the first call inside its loop until the second has tried
        inside.set()
        release.wait(600)  # the timeouts here guard against a hang; none bounds how long a step may take

    results = {}
    first = threading.Thread(target=lambda: results.setdefault("first", dec.generate(prompts, 40, stream=slow_stream)))
    first.start()
    assert inside.wait(600)
    try:
        with pytest.raises(RuntimeError, match="already running"):
            dec.generate(prompts, 40)
    finally:
        release.set()
        first.join(600)
    assert not first.is_alive() and results["first"].sequences == expected
    # A stream callback that re-enters the decoder is refused too, and the decoder stays usable.
    with pytest.raises(RuntimeError, match="already running"):
        dec.generate(prompts, 5, stream=lambda r, new: dec.generate(prompts, 5))
    assert dec.generate(prompts, 40).sequences == expected


# ------------------------------------------------------------------------------ finish reasons and context

def test_finish_reasons(target):
    """Each request's reason, against an oracle from plain decoding: the first of its EOS, its max_new_tokens and
    the decoder's max_seq_len that it reaches."""
    prompts = random_prompts(4, [6, 3, 3])
    max_new = [12, 12, 5]
    free = generate_autoregressive(target, prompts, 12).sequences
    eos = free[1][4]

    def expected(seq, prompt, m):
        n = min(m, 12 - len(prompt))
        first = seq.index(eos) if eos in seq else len(seq)
        return "eos" if first < n else "length" if m <= 12 - len(prompt) else "max_seq_len"

    dec = SpeculativeDecoder(target, NgramDrafter(), 3, max_seq_len=12)
    out = dec.generate(prompts, max_new, eos_token_id=eos)
    assert out.finish_reasons == [expected(*x) for x in zip(free, prompts, max_new)]
    assert out.finish_reasons[1] == "eos" and "max_seq_len" in out.finish_reasons + ["max_seq_len"]
    assert [st.finish_reason for st in out.request_stats] == out.finish_reasons


def test_the_models_context_bounds_prompts_and_generation(target):
    context = target.config.max_position_embeddings  # 256
    dec = SpeculativeDecoder(target, NgramDrafter(), 4)
    with pytest.raises(ValueError,
                       match=r"prompt 1 has 256 tokens and the model's context \(max_position_embeddings\)"):
        dec.generate([[1, 2], [3] * context], 4)
    with pytest.raises(ValueError, match="max_seq_len must be an int in"):
        SpeculativeDecoder(target, NgramDrafter(), 4, max_seq_len=context + 1)
    # Generation stops at the context, with its reason; a huge max_new_tokens allocates no more than that.
    prompt = random_prompts(9, [context - 6])
    out = dec.generate(prompt, 10**9)
    assert len(out.sequences[0]) == 6 and out.finish_reasons == ["context"]
    assert out.sequences == generate_autoregressive(target, prompt, 6).sequences
    assert dec.cache.k.shape[1:3] == (1, context + 5)  # one slot, the context plus a verify block


# -------------------------------------------------------------------------------------------------- memory

def test_caches_are_sized_from_the_call(target):
    dec = SpeculativeDecoder(target, ModelDrafter(target), 4, max_batch_size=8, adaptive=False)
    dec.generate(random_prompts(2, [5, 9]), 7)
    assert dec.cache.k.shape[1:3] == (2, 9 + 7 + 5)  # 2 slots of the longest sequence plus a block
    assert dec.drafter.cache.k.shape[1:3] == (2, 21)


def test_an_allocation_that_cannot_succeed_names_what_to_lower(target, monkeypatch):
    monkeypatch.setattr(decoder, "available_memory", lambda device: 1000)
    dec = SpeculativeDecoder(target, NgramDrafter(), 4, max_batch_size=4)
    with pytest.raises(ValueError, match=r"KV cache needs .* GiB \(max_batch_size=4 \(this call: 2 slots\) x "
                                         r"max_seq_len "
                                         r"17, 2 layers\).*lower max_new_tokens, max_seq_len or max_batch_size"):
        dec.generate(random_prompts(2, [5, 9]), 3)
    monkeypatch.undo()
    assert dec.generate(random_prompts(2, [5, 9]), 3).finish_reasons == ["length", "length"]


def test_a_page_budget_queues_requests_instead_of_failing(target):
    """Six requests through four slots of a cache with pages for about two at their longest: the rest wait until
    pages are free, and every output equals plain decoding's."""
    prompts = random_prompts(11, [20, 5, 33, 9, 14, 26])
    max_new = [30, 25, 12, 40, 20, 18]
    plain = generate_autoregressive(target, prompts, max_new)
    dec = SpeculativeDecoder(target, ModelDrafter(target), 4, max_batch_size=4, paged=True, num_pages=16,
                             adaptive=False)
    out = dec.generate(prompts, max_new)
    assert out.sequences == plain.sequences
    assert dec.cache.k.shape[1] == 16
    with pytest.raises(ValueError, match="num_pages=4 pages of 16 tokens cannot hold a request"):
        SpeculativeDecoder(target, NgramDrafter(), 4, paged=True, num_pages=4).generate(prompts, max_new)
    with pytest.raises(ValueError, match="num_pages must be an int >= 1 with paged=True"):
        SpeculativeDecoder(target, NgramDrafter(), 4, num_pages=16)


# ------------------------------------------------------------------------------------- the cost model's table

def test_cost_model_measures_only_the_rows_a_call_uses_and_is_kept_in_a_file(target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    measured = []
    real = cost_tables.forward_step  # what the target's table and a draft model's probe time
    monkeypatch.setattr(cost_tables, "forward_step", lambda model, rows: measured.append(rows) or real(model, rows))
    prompt = random_prompts(1, [9])
    dec = SpeculativeDecoder(target, ModelDrafter(target), 4, max_batch_size=8)
    t0 = time.perf_counter()
    first = dec.generate(prompt, 10)
    wall = time.perf_counter() - t0
    # One request: verify blocks of at most 1 x (4 + 1) rows and draft steps of 1 row (the same model: the row is
    # in its table already), not 8 x 5.
    assert sorted(measured) == [1, 2, 4, 5] and max(dec.costs.verify) == 5
    assert first.stats.calibration_s > 0
    assert first.stats.elapsed_s <= wall - first.stats.calibration_s + 1e-3  # the calibration is reported apart
    # A second decoder of the same model in another run reads the file: no measurement.
    measured.clear()
    again = SpeculativeDecoder(target, ModelDrafter(target), 4, max_batch_size=8).generate(prompt, 10)
    assert measured == []  # read from the file, not measured (how fast the read was is not asserted)
    assert again.sequences == first.sequences
    # A wider call measures only the rows it adds.
    dec.generate(random_prompts(2, [4, 6, 8]), 4)
    assert sorted(measured) == [3, 8, 9, 12, 15] and max(dec.costs.verify) == 15
    assert len(list((tmp_path / "costs").glob("*.json"))) == 1  # the target drafts for itself: one model, one file


@pytest.mark.parametrize("verify,draft,name", [
    ({1: math.nan}, None, "verify"), ({1: 1.0, 8: math.inf}, None, "verify"), ({1: -1.0}, None, "verify"),
    ({0: 1.0}, None, "verify"), ({}, None, "verify"), ({1: "1.0"}, None, "verify"), ([1.0], None, "verify"),
    ({1: 1.0}, {1: math.nan}, "draft"), ({1: 1.0}, {1: -0.1}, "draft"), ({1: 1.0}, {2.5: 0.1}, "draft")])
def test_cost_model_refuses_seconds_that_are_not_finite_and_non_negative(verify, draft, name):
    """A NaN once made every tokens-over-cost comparison false (k = 0 every round: speculation off)."""
    with pytest.raises(ValueError, match=f"CostModel: {name} must be a .*dict of row counts >= 1 to finite seconds"):
        policy.CostModel(verify, draft)


def test_zero_costs_say_nothing_and_the_most_tokens_win(target):
    """Tables of zeros (accepted: steps too fast to matter) once made every adaptive round divide by a zero cost
    (ZeroDivisionError in best_k and tree_size). They say nothing about costs: the largest k and tree win, and the
    greedy tokens are plain decoding's. A table falling with the rows, extended past its last point, reaches zero
    too."""
    zeros = policy.CostModel({1: 0.0, 8: 0.0}, {1: 0.0})
    assert zeros.best_k([0.3, 0.9], 6) == 6 and zeros.best_k(0.5, 4, ModelDrafter(target).draft_work) == 4
    assert policy.CostModel({1: 1.0, 2: 0.5}).best_k(0.5, 4) == 4  # 0 at 3 rows, below at 4: a floor, not free
    prompts = [p * 3 for p in random_prompts(5, [4, 6])]
    plain = generate_autoregressive(target, prompts, 12).sequences
    for drafter, tree in ((ModelDrafter(target), None), (NgramDrafter(), None), (NgramDrafter(), 8)):
        out = SpeculativeDecoder(target, drafter, 4, max_batch_size=2, tree=tree,
                                 costs=policy.CostModel({1: 0.0, 8: 0.0})).generate(prompts, 12)
        assert out.sequences == plain
        if isinstance(drafter, ModelDrafter):
            assert all(s.k_per_round[0] == 4 for s in out.request_stats)
    tree = TreeSettings.of(8)
    running = [types.SimpleNamespace(node_hits=np.zeros(7), node_tries=np.zeros(7), k=None) for _ in range(2)]
    assert policy.Policy(True, 4, tree, NgramDrafter(), zeros).tree_size(running, 0) == 8
    lookahead = LookaheadDrafter(window=2, ngram=4, guesses=2)
    lookahead.requests = [None]
    lookahead.admit([0], [[1]])
    lookahead.plan(zeros, 1, 0)
    assert lookahead.planned == (2, 2, 3)


def test_a_measured_zero_is_used_but_never_cached(target, tmp_path, monkeypatch):
    """A step timed at zero (under the timer's resolution: a glitch) runs, but is not written: a cached zero would
    make every later run's rounds free."""
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cost_tables, "step_seconds", lambda step, device, repeats=3: 0.0)
    prompts = random_prompts(6, [7])
    out = SpeculativeDecoder(target, ModelDrafter(target), 4, max_batch_size=1).generate(prompts, 8)
    assert out.sequences == generate_autoregressive(target, prompts, 8).sequences
    assert not list(tmp_path.glob("costs/*"))


def _bad_seconds(seconds):
    return lambda saved: json.dumps({**saved, "seconds": seconds})


BAD_COST_FILES = {
    "negative": _bad_seconds({"1": 1e-3, "2": -1e-3, "4": 2e-3}),
    "zero": _bad_seconds({"1": 0.0, "2": 0.0, "4": 0.0}),
    "nan": _bad_seconds({"1": 1e-3, "2": math.nan, "4": 2e-3}),
    "inf": _bad_seconds({"1": 1e-3, "2": 1e-3, "4": math.inf}),
    "row 0": _bad_seconds({"0": 1e-3, "1": 1e-3, "2": 1e-3, "4": 2e-3}),
    "row not a count": _bad_seconds({"1": 1e-3, "2": 1e-3, "4": 2e-3, "one": 1e-3}),
    "seconds as text": _bad_seconds({"1": "1e-3", "2": "1e-3", "4": "2e-3"}),
    "seconds a list": _bad_seconds([1e-3, 1e-3, 2e-3]),
    "a list": lambda saved: "[]",
    "not JSON": lambda saved: json.dumps(saved)[:-9],
}


@pytest.mark.parametrize("bad", BAD_COST_FILES.values(), ids=BAD_COST_FILES.keys())
def test_a_cost_file_without_a_valid_table_is_measured_again_and_overwritten(target, tmp_path, monkeypatch, bad):
    """The cache file was trusted: negative seconds made every adaptive run of the model raise (a ValueError naming
    neither cache nor file), NaN or inf ones turned speculation off (k = 0), zeros divided by zero, until the file
    was deleted. Now such a table is absent: measured again, used, and the file overwritten with it."""
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    cost_tables.forward_costs(target, 4)
    (path,) = tmp_path.glob("costs/*.json")
    saved = json.loads(path.read_text())
    path.write_text(bad(saved))
    measured = []
    real = cost_tables.forward_step
    monkeypatch.setattr(cost_tables, "forward_step", lambda model, rows: measured.append(rows) or real(model, rows))
    prompts = random_prompts(7, [6])
    dec = SpeculativeDecoder(target, NgramDrafter(), 4, max_batch_size=1)
    assert dec.generate(prompts, 6).sequences == generate_autoregressive(target, prompts, 6).sequences
    assert sorted(measured) == [1, 2, 4, 5]  # all of the verify rows of k = 4, not only the 5 the file lacked
    rewritten = json.loads(path.read_text())
    assert rewritten["key"] == saved["key"] and sorted(map(int, rewritten["seconds"])) == [1, 2, 4, 5]
    assert all(math.isfinite(s) and s > 0 for s in rewritten["seconds"].values())
    assert dec.costs.verify == {int(r): s for r, s in rewritten["seconds"].items()}  # the run used what it wrote
    assert not list(tmp_path.glob("costs/*.tmp"))


def test_a_cost_file_that_cannot_be_written_leaves_no_temp_file(target, tmp_path, monkeypatch):
    """A directory where the file goes: each process once left its <digest>.<pid>.tmp behind. The measurement is
    used and a warning names the file."""
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    cost_tables.forward_costs(target, 4)
    (path,) = tmp_path.glob("costs/*.json")
    path.unlink()
    path.mkdir()
    for _ in range(2):  # measured again each time: nothing could be kept
        with pytest.warns(RuntimeWarning, match=f"cannot write the cost table cache {re.escape(str(path))}"):
            table = cost_tables.forward_costs(target, 4)
        assert sorted(table) == [1, 2, 4] and all(math.isfinite(s) and s > 0 for s in table.values())
    assert path.is_dir() and [p.name for p in path.parent.iterdir()] == [path.name]


# ----------------------------------------------------------------------------------------------- bad input

def test_prompts_a_user_would_pass_are_accepted(target):
    prompts = random_prompts(5, [6, 3])
    expected = generate_autoregressive(target, prompts, 5).sequences
    dec = SpeculativeDecoder(target, NgramDrafter(), 4)
    forms = [[np.array(p) for p in prompts], [[np.int64(t) for t in p] for p in prompts],
             [torch.tensor(p) for p in prompts], [tuple(p) for p in prompts], [torch.tensor(p, dtype=torch.int32)
                                                                              for p in prompts]]
    for form in forms:
        assert dec.generate(form, 5).sequences == expected
    assert dec.generate(prompts, np.int64(5), top_k=2**70, temperature=np.float32(0), seed=np.int64(3)).sequences == \
        expected
    assert check_eos(np.int64(3), VOCAB) == check_eos([torch.tensor(3)], VOCAB) == {3}


BAD = {
    "flat list": (dict(prompts=[1, 2, 3]), "flat list of ints: pass \\[ids\\]"),
    "float id": (dict(prompts=[[1, 2.5]]), "prompt 0, token 1 must be an int, got float"),
    "bool id": (dict(prompts=[[1, True]]), "prompt 0, token 1 must be an int"),
    "nested id": (dict(prompts=[[1, [2]]]), "prompt 0, token 1 must be an int, got list"),
    "id out of range": (dict(prompts=[[1, VOCAB]]), f"prompt 0, token 1: id {VOCAB} is outside the vocabulary"),
    "float tensor": (dict(prompts=[torch.ones(3)]), "prompt 0 must hold integer token ids"),
    "string prompt": (dict(prompts=["hello"]), "prompt 0 must be a list of token ids, got str"),
    "eos float": (dict(eos_token_id=2.0), "eos_token_id must be an int, got float"),
    "eos bool": (dict(eos_token_id=True), "eos_token_id must be an int, got True"),
    "eos out of range": (dict(eos_token_id=VOCAB), f"eos_token_id {VOCAB} is outside the vocabulary"),
    "max_new_tokens 0": (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1, got 0"),
    "max_new_tokens float": (dict(max_new_tokens=2.5), "max_new_tokens must be an int, got float"),
    "temperature negative": (dict(temperature=-1.0), "temperature must be finite and >= 0"),
    "temperature overflows float32": (dict(temperature=1e39), "temperature must be finite and >= 0"),
    "temperature string": (dict(temperature="hot"), "temperature must be a number"),
    "top_k negative": (dict(top_k=-1), "top_k must be an int >= 0"),
    "top_p 0": (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    "top_p list entry": (dict(prompts=[[1], [2]], top_p=[0.5, 2.0]), r"top_p\[1\] must be in \(0, 1\]"),
    "seed overflow": (dict(seed=2**64), "seed must be a signed 64-bit integer"),
    "stream not callable": (dict(stream=3), "stream must be a callable"),
}


@pytest.mark.parametrize("what", list(BAD))
def test_bad_arguments_get_one_message_each(target, what):
    kwargs, message = BAD[what]
    kwargs = dict(kwargs)
    prompts = kwargs.pop("prompts", [[1, 2, 3]])
    max_new = kwargs.pop("max_new_tokens", 4)
    dec = SpeculativeDecoder(target, NgramDrafter(), 4)
    with pytest.raises(ValueError, match=message):
        dec.generate(prompts, max_new, **kwargs)
    assert dec.generate([[1, 2, 3]], 4).finish_reasons == ["length"]  # still usable


def test_bad_constructor_arguments_name_them(target):
    with pytest.raises(ValueError, match="drafter must be a Drafter .* got str"):
        SpeculativeDecoder(target, "ngram")
    with pytest.raises(ValueError, match=r"target must be a specdec_ext.models.LlamaForCausalLM \(LlamaForCausalLM"
                                         r".from_hf\(model\) converts a transformers model\)"):
        SpeculativeDecoder(tiny_hf(seed=3), NgramDrafter())
    with pytest.raises(ValueError, match="adaptive must be True, False or 'heuristic', got 1"):
        SpeculativeDecoder(target, NgramDrafter(), adaptive=1)
