"""Generation controls (penalties, logit bias, bad words, min_tokens, min_p, logprobs, stop strings), lossless under
speculation: each verify-block row processed as transformers' logits processors process the same history; greedy and
invariant-sampled speculative output equal to plain decoding's with drafts accepted, for every drafter, chains and
trees; the sampled law equal to the processed target law (chi-square); logprobs equal to plain decoding's and to a
float64 reference; stop strings across rounds. Fixed seeds throughout."""
import itertools
import math

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from helpers.chi_square import assert_law
from helpers.laws import LAW_PROMPT, LAW_TOKENS, LAW_VOCAB, exact_distribution, exact_law_of, law_draft, law_target
from helpers.models import make_drafter, random_prompts, random_vocab, tiny_model
from specdec_ext import LookaheadDrafter, ModelDrafter, NgramDrafter, SpeculativeDecoder
from specdec_ext.logits_processing import BlockControls, process_block
from specdec_ext.ops import logits_normalizer
from specdec_ext.trees import ancestor_mask

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

VOCAB = 16
EOS = 0
PROMPTS = random_prompts(3, [6, 1, 14, 3, 9], vocab=VOCAB)
MAX_NEW = [20, 14, 9, 24, 17]
TREE = dict(num_nodes=16, depth=4, branching=3)
# Every control on, mixed per request. Bad words: a two-token sequence the target likes and a banned token.
CONTROLS = dict(repetition_penalty=[1.3, 1.0, 0.8, 1.2, 1.5], presence_penalty=0.2,
                frequency_penalty=[0.1, 0.0, 0.3, 0.0, 0.2], logit_bias={3: 1.5, 4: -2.0}, bad_words=[[5, 6], [7]],
                min_tokens=4, min_p=0.05)
SAMPLED = dict(temperature=[0.8, 1.0, 0.0, 0.8, 1.3], top_k=[0, 5, 0, 0, 0], top_p=[0.9, 1.0, 1.0, 0.9, 1.0],
               seed=[10, 20, 30, 40, 50])


@pytest.fixture(scope="module")
def target():
    return tiny_model(vocab=VOCAB, seed=1234, logit_scale=0.3)


def drafter_of(name, target):
    if name == "ngram":
        return NgramDrafter(3, 1)
    if name == "lookahead":
        return LookaheadDrafter(window=3, ngram=3, guesses=2)
    if name == "model":
        return ModelDrafter(tiny_model(vocab=VOCAB, seed=77, layers=1, hidden=32, heads=2, kv_heads=1,
                                       logit_scale=0.3))
    return make_drafter(name, target, random_vocab(VOCAB, 12, 1), seed=1)


CASES = [(d, "chain") for d in ("ngram", "model", "eagle", "medusa")] + \
        [(d, "tree") for d in ("ngram", "eagle", "medusa", "lookahead")]


# ------------------------------------------------------------------------------ rows vs transformers' processors

def history_rows(seed: int, tree: bool):
    """A batch of blocks with histories: (logits [B, W, V], block ids [B, W], prompts, outputs before the block (the
    last emitted token, block column 0, last), parents, ancestors, the history of every row)."""
    g = torch.Generator().manual_seed(seed)
    b, w = 3, 6
    logits = torch.randn(b, w, VOCAB, generator=g) * 3  # both signs: the repetition penalty's two branches
    ids = torch.randint(0, 6, (b, w), generator=g)      # few distinct tokens: repeats within a block
    prompts = [torch.randint(0, 6, (n,), generator=g).tolist() for n in (4, 1, 7)]
    outputs = [torch.randint(0, 6, (n,), generator=g).tolist() + [int(ids[r, 0])] for r, n in enumerate((3, 0, 5))]
    parents = torch.tensor([[-1, 0, 0, 1, 2, 2], [-1, 0, 1, 1, 0, 4], [-1, 0, 1, 2, 3, 4]]) if tree else \
        torch.arange(w).sub(1).expand(b, w)
    ancestors = ancestor_mask(parents)
    paths = [[[int(ids[r, j]) for j in range(1, w) if ancestors[r, i, j]] for i in range(w)] for r in range(b)]
    return logits, ids, prompts, outputs, parents, ancestors, paths


def controls_of(prompts, outputs, repetition=1.0, presence=0.0, frequency=0.0, **extra) -> BlockControls:
    b = len(prompts)
    counts = torch.zeros(b, VOCAB, dtype=torch.int32)
    in_prompt = torch.zeros(b, VOCAB, dtype=torch.bool)
    for r in range(b):
        counts[r] += torch.bincount(torch.tensor(outputs[r]), minlength=VOCAB).int()
        in_prompt[r, prompts[r]] = True
    longest = max(len(p) + len(o) for p, o in zip(prompts, outputs))
    history = torch.tensor([(p + o + [VOCAB - 1] * longest)[:longest] for p, o in zip(prompts, outputs)])
    return BlockControls(counts, in_prompt, history, torch.full((b,), float(repetition)),
                         torch.full((b,), float(presence)), torch.full((b,), float(frequency)), **extra)


def processed(logits, ids, controls, tree, parents, ancestors):
    kw = dict(ancestors=ancestors, parents=parents, depths=ancestors.sum(-1) - 1) if tree else {}
    return process_block(logits.clone(), ids, controls, **kw)


def processor_rows(processor, logits, prompts, outputs, paths):
    """transformers' processor on every row alone, with input_ids = that row's history."""
    out = logits.clone()
    for r, (p, o) in enumerate(zip(prompts, outputs)):
        for i, path in enumerate(paths[r]):
            out[r, i] = processor(torch.tensor([p + o + path]), logits[r, i].unsqueeze(0).clone())[0]
    return out


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_repetition_penalty_rows_are_transformers(tree):
    logits, ids, prompts, outputs, parents, ancestors, paths = history_rows(1, tree)
    for penalty in (1.7, 0.6):
        ours = processed(logits, ids, controls_of(prompts, outputs, repetition=penalty), tree, parents, ancestors)
        theirs = processor_rows(RepetitionPenaltyLogitsProcessor(penalty), logits, prompts, outputs, paths)
        assert torch.equal(ours, theirs)
        assert not torch.equal(ours, logits)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_bad_words_rows_are_transformers(tree):
    """Sequences of one, two and three tokens, matched across the history / block boundary and within the block."""
    logits, ids, prompts, outputs, parents, ancestors, paths = history_rows(2, tree)
    words = [[int(ids[0, 1]), int(ids[0, 2])], [int(outputs[2][-1]), int(ids[2, 1]), 9], [11],
             [int(outputs[0][-1]), 12]]
    context = max(len(w) for w in words) - 1
    prefixes = torch.tensor([[-2] * (context - len(w) + 1) + w[:-1] for w in words]).expand(3, -1, -1)
    last = torch.tensor([w[-1] for w in words]).expand(3, -1)
    tails = torch.tensor([([-1] * context + p + o)[-context:] for p, o in zip(prompts, outputs)])
    controls = BlockControls(tail=tails, bad_word_prefixes=prefixes, bad_word_last=last)
    ours = processed(logits, ids, controls, tree, parents, ancestors)
    theirs = processor_rows(NoBadWordsLogitsProcessor(words), logits, prompts, outputs, paths)
    assert torch.equal(ours, theirs)
    banned = (ours == float("-inf")).sum().item()
    assert banned > 3 * 6, "the words must ban beyond the single-token one"


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_min_tokens_and_logit_bias_rows_are_transformers(tree):
    logits, ids, prompts, outputs, parents, ancestors, paths = history_rows(3, tree)
    eos = [0, 13]
    min_new = 6  # the rows straddle it: outputs of 1, 4 and 6 tokens before blocks up to 5 deep
    controls = BlockControls(generated=torch.tensor([len(o) for o in outputs]), min_tokens=torch.full((3,), min_new),
                             stop_ids=torch.tensor(eos), logit_bias=torch.zeros(3, VOCAB).index_fill_(1,
                                                                                          torch.tensor([2, 5]), 1.25))
    ours = processed(logits, ids, controls, tree, parents, ancestors)
    bias = SequenceBiasLogitsProcessor({(2,): 1.25, (5,): 1.25})
    theirs = logits.clone()
    for r, (p, o) in enumerate(zip(prompts, outputs)):
        min_tokens = MinNewTokensLengthLogitsProcessor(len(p), min_new, eos)
        for i, path in enumerate(paths[r]):
            input_ids = torch.tensor([p + o + path])
            theirs[r, i] = bias(input_ids, min_tokens(input_ids, logits[r, i].unsqueeze(0).clone()))[0]
    assert torch.equal(ours, theirs)
    assert (ours[..., 0] == float("-inf")).any() and (ours[..., 0] != float("-inf")).any()


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_presence_and_frequency_rows_are_openai_formula(tree):
    """No transformers processor: the OpenAI / vLLM definition, in float64 - logit - frequency * count -
    presence * (count > 0) over output tokens (the drafts on the row's path included), after the repetition
    penalty over prompt and output."""
    logits, ids, prompts, outputs, parents, ancestors, paths = history_rows(4, tree)
    ours = processed(logits, ids, controls_of(prompts, outputs, 1.4, 0.7, 0.45), tree, parents, ancestors)
    for r, (p, o) in enumerate(zip(prompts, outputs)):
        for i, path in enumerate(paths[r]):
            out = o + path
            for v in range(VOCAB):
                x, count = float(logits[r, i, v]), out.count(v)
                if count or v in p:
                    x = x / 1.4 if x > 0 else x * 1.4
                expected = x - 0.45 * count - 0.7 * (count > 0)
                assert math.isclose(float(ours[r, i, v]), expected, rel_tol=1e-6, abs_tol=1e-6), (r, i, v)


def test_min_p_keeps_what_transformers_keeps():
    """min_p inside the sampling kernels: the kept mass (ops.logits_normalizer's log-normaliser) is that of
    transformers' MinPLogitsWarper after the temperature."""
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(64, 200, generator=g) * 2
    for min_p, t in ((0.05, 1.0), (0.2, 0.7), (0.5, 1.3)):
        ours = logits_normalizer(rows, temperature=t, min_p=min_p)
        warped = MinPLogitsWarper(min_p)(None, rows / t)
        assert torch.allclose(ours, warped.logsumexp(-1), rtol=0, atol=2e-5)
        assert (warped == float("-inf")).any()


# ------------------------------------------------------------------------------------------------ decoding

@pytest.mark.parametrize("name,shape", CASES, ids=[f"{d}-{s}" for d, s in CASES])
def test_greedy_speculative_equals_plain_with_every_control(target, name, shape):
    dec = SpeculativeDecoder(target, drafter_of(name, target), 3, adaptive=False, max_batch_size=3,
                             tree=TREE if shape == "tree" else None)
    plain = dec.generate_autoregressive(PROMPTS, MAX_NEW, eos_token_id=EOS, **CONTROLS)
    out = dec.generate(PROMPTS, MAX_NEW, eos_token_id=EOS, **CONTROLS)
    assert out.sequences == plain.sequences
    assert out.stats.num_accepted_tokens > 0, "drafts must be accepted for the test to test speculation"
    assert plain.sequences != dec.generate_autoregressive(PROMPTS, MAX_NEW, eos_token_id=EOS).sequences
    for tokens in out.sequences:  # the bans hold: no 7, no 5 followed by 6, no EOS in the first 4 tokens
        assert 7 not in tokens and EOS not in tokens[:4]
        assert all(a != 5 or b != 6 for a, b in zip(tokens, tokens[1:]))


@pytest.mark.parametrize("name,shape", CASES, ids=[f"{d}-{s}" for d, s in CASES])
def test_invariant_sampling_equals_plain_with_every_control(target, name, shape):
    """sampling="invariant": the tokens are the Gumbel-max samples of the processed target rows, whoever drafts."""
    plain = SpeculativeDecoder(target, None, max_batch_size=1, sampling="invariant").generate_autoregressive(
        PROMPTS, MAX_NEW, eos_token_id=EOS, **SAMPLED, **CONTROLS)
    dec = SpeculativeDecoder(target, drafter_of(name, target), 3, adaptive=False, max_batch_size=3,
                             tree=TREE if shape == "tree" else None, sampling="invariant")
    out = dec.generate(PROMPTS, MAX_NEW, eos_token_id=EOS, **SAMPLED, **CONTROLS)
    assert out.sequences == plain.sequences
    assert out.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("name", ["model", "eagle", "medusa"])
def test_sampling_drafters_draw_from_controlled_rows(target, name, monkeypatch):
    """The drafters that sample draw each draft from their row processed with the history it extends: no draft is a
    banned token (bad word 7, or 6 after 5). Mutation run once: drafting from the unprocessed rows fails it."""
    drafter = drafter_of(name, target)
    proposals = []
    propose = drafter.propose

    def recording(r):
        p = propose(r)
        proposals.append((p, [list(h) if h is not None else None for h in r.histories]))
        return p

    monkeypatch.setattr(drafter, "propose", recording)
    dec = SpeculativeDecoder(target, drafter, 3, adaptive=False, max_batch_size=3)
    out = dec.generate(PROMPTS, MAX_NEW, eos_token_id=EOS, **SAMPLED, **CONTROLS)
    assert out.stats.num_accepted_tokens > 0
    drafts = 0
    for p, histories in proposals:
        for row, (ids, history) in enumerate(zip(p.draft_token_ids.tolist(), histories)):
            if history is None:
                continue
            previous = history[-1]
            for i, token in enumerate(ids[:p.num_draft_tokens[row]]):
                drafts += 1
                assert token != 7 and not (previous == 5 and token == 6), (name, row, i, token)
                previous = token
    assert drafts > 50


def test_logprobs_equal_plain_decoding_and_the_float64_reference(target):
    """The emitted tokens' logprobs (processed: the controls, temperature and filters applied) equal plain
    decoding's to float32 rounding, and a float64 reference of the processed distribution: softmax of the
    processed row / T under transformers' top-k / top-p warpers, -inf outside what they keep."""
    n = 4
    kw = dict(eos_token_id=EOS, **SAMPLED, **CONTROLS, logprobs=n)
    kw.pop("min_p")
    plain = SpeculativeDecoder(target, None, max_batch_size=1, sampling="invariant").generate_autoregressive(
        PROMPTS, MAX_NEW, **kw)
    out = SpeculativeDecoder(target, drafter_of("ngram", target), 3, adaptive=False, max_batch_size=3,
                             sampling="invariant").generate(PROMPTS, MAX_NEW, **kw)
    assert out.sequences == plain.sequences and out.stats.num_accepted_tokens > 0
    for spec_rows, plain_rows, seq in zip(out.logprobs, plain.logprobs, out.sequences):
        assert len(spec_rows) == len(seq)
        for a, b in zip(spec_rows, plain_rows):
            assert a.rank == b.rank and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert math.isclose(a.logprob, b.logprob, abs_tol=2e-5)
            assert all(math.isclose(x, y, abs_tol=2e-5) or x == y for (_, x), (_, y) in zip(a.top, b.top))
    # The float64 reference: replay request 0's history through plain processing, one row at a time.
    r = 0
    history = PROMPTS[r] + out.sequences[r]
    t, top_k, top_p = SAMPLED["temperature"][r], SAMPLED["top_k"][r], SAMPLED["top_p"][r]
    for i, entry in enumerate(out.logprobs[r]):
        prefix = history[:len(PROMPTS[r]) + i]
        with torch.no_grad():
            row = target(torch.tensor([prefix]), target.new_kv_cache(1, len(prefix)))[0, -1]
        row = reference_processing(row, PROMPTS[r], prefix[len(PROMPTS[r]):], r)
        p = exact_distribution(row, t, top_k, top_p)
        token = history[len(PROMPTS[r]) + i]
        assert math.isclose(entry.logprob, math.log(p[token]), abs_tol=1e-4)
        for alt, lp in entry.top:
            assert (lp == float("-inf")) == (p[alt] == 0)
            assert lp == float("-inf") or math.isclose(lp, math.log(p[alt]), abs_tol=1e-4)


def reference_processing(row, prompt, output, r):
    """CONTROLS for request r on one row, readable, float64: bans, bias, then the penalties."""
    x = row.double().clone()
    history = prompt + output
    x[7] = float("-inf")
    if history[-1] == 5:
        x[6] = float("-inf")
    if len(output) < CONTROLS["min_tokens"]:
        x[EOS] = float("-inf")
    x[3] += 1.5
    x[4] -= 2.0
    rep, pres, freq = CONTROLS["repetition_penalty"][r], CONTROLS["presence_penalty"], \
        CONTROLS["frequency_penalty"][r]
    for v in range(VOCAB):
        count = output.count(v)
        if count or v in prompt:
            x[v] = x[v] / rep if x[v] > 0 else x[v] * rep
        x[v] -= freq * count + pres * (count > 0)
    return x


def test_logprob_alternatives_are_filtered_as_the_kernels_filter():
    """Each reported alternative is -inf exactly where reference.filter_logits (the kernels' rules, float64) removes
    it: top-k, top-p (a confident nucleus of one token included) and min-p, mixed per row; a temperature below
    MIN_TEMPERATURE is greedy (reported at T = 1, nothing filtered)."""
    from specdec_ext.engine.controls import emitted_logprobs
    from specdec_ext.reference import filter_logits

    g = torch.Generator().manual_seed(11)
    rows = torch.randn(64, 300, generator=g) * 2.5
    rows[0, 7] = 14.0  # one token of p > 0.99999: top-p keeps it alone
    t = torch.rand(64, generator=g) + 0.3
    t[1] = 1e-6
    top_k = torch.randint(0, 12, (64,), generator=g).int()
    top_p = torch.where(torch.rand(64, generator=g) < 0.7, torch.rand(64, generator=g) * 0.9 + 0.05, 1.0)
    min_p = torch.where(torch.rand(64, generator=g) < 0.5, torch.rand(64, generator=g) * 0.2, 0.0)
    t[0], top_k[0], top_p[0], min_p[0] = 1.0, 0, 0.9, 0.0
    tokens = rows.argmax(-1)
    out = emitted_logprobs(rows, tokens, 8, temperature=t, top_k=top_k, top_p=top_p, min_p=min_p)
    expected = filter_logits(rows, t, top_k, top_p, min_p)
    filtered = 0
    for m, entry in enumerate(out):
        assert math.isfinite(entry.logprob) and entry.rank == 1
        t_m = 1.0 if m == 1 else float(t[m])
        kept = expected[m].isfinite() if m != 1 else torch.ones(300, dtype=torch.bool)
        lse = torch.logsumexp(rows[m].double()[kept] / t_m, 0)
        for token, lp in entry.top:
            assert (lp == float("-inf")) == (not bool(kept[token])), (m, token, lp)
            filtered += lp == float("-inf")
            if lp != float("-inf"):
                assert math.isclose(lp, float(rows[m, token] / t_m - lse), abs_tol=1e-4)
    assert filtered > 50 and out[0].top[1][1] == float("-inf")


def test_each_request_gets_its_own_number_of_alternatives(target):
    out = SpeculativeDecoder(target, drafter_of("ngram", target), 3, adaptive=False, max_batch_size=3).generate(
        PROMPTS[:3], 8, logprobs=[0, 5, None])
    assert [len(e.top) for e in out.logprobs[0]] == [0] * 8 and [len(e.top) for e in out.logprobs[1]] == [5] * 8
    assert out.logprobs[2] is None


def test_controls_tensors_move_only_with_a_new_epoch(target):
    """Draft steps captured in CUDA graphs key on the controls' epoch; the per-slot scalars (min_p among them, read
    by a drafter's captured step) never move."""
    dec = SpeculativeDecoder(target, drafter_of("model", target), 3, adaptive=False, max_batch_size=2)
    dec.generate(PROMPTS[:2], 4, min_p=0.05)
    controls = dec.params.controls
    epoch, min_p = controls.epoch, controls.min_p
    dec.generate(PROMPTS[:2], 4, min_p=0.1)
    assert controls.epoch == epoch and controls.min_p is min_p
    dec.generate(PROMPTS[:2], 4, logit_bias={3: 1.0})
    assert controls.epoch == epoch + 1 and controls.min_p is min_p


def test_raw_logprobs_are_the_models_log_softmax(target):
    out = SpeculativeDecoder(target, drafter_of("ngram", target), 3, adaptive=False).generate(
        PROMPTS[:1], 12, repetition_penalty=1.5, logprobs=2, logprobs_mode="raw")
    history = PROMPTS[0] + out.sequences[0]
    for i, entry in enumerate(out.logprobs[0]):
        prefix = history[:len(PROMPTS[0]) + i]
        with torch.no_grad():
            row = target(torch.tensor([prefix]), target.new_kv_cache(1, len(prefix)))[0, -1].double()
        lp = row.log_softmax(-1)
        assert math.isclose(entry.logprob, float(lp[history[len(prefix)]]), abs_tol=1e-4)
        assert [t for t, _ in entry.top] == lp.topk(2).indices.tolist()
        assert entry.rank == int((lp > lp[history[len(prefix)]]).sum()) + 1


# ------------------------------------------------------------------------------------------------ the law

LAW_CONTROLS = dict(repetition_penalty=1.6, frequency_penalty=0.3, presence_penalty=0.2, logit_bias={1: 0.8},
                    bad_words=[[4, 0]], min_p=0.02)
LAW_SAMPLING = (1.0, 0, 1.0)
LAW_SAMPLES = 60_000  # power against the hardest 1% bias checked by assert_law (>= 0.9)


def controlled_law(model):
    """P(first LAW_TOKENS tokens) under LAW_CONTROLS, from our model's float64 rows processed by readable rules."""

    def distribution(prefix, row):
        x = row.double().clone()
        if (LAW_PROMPT + list(prefix))[-1] == 4:
            x[0] = float("-inf")
        x[1] += 0.8
        for v in range(LAW_VOCAB):
            count = list(prefix).count(v)
            if count or v in LAW_PROMPT:
                x[v] = x[v] / 1.6 if x[v] > 0 else x[v] * 1.6
            x[v] -= 0.3 * count + 0.2 * (count > 0)
        q = exact_distribution(x, *LAW_SAMPLING)
        q = torch.where(q >= 0.02 * q.max(), q, 0.0)
        return q / q.sum()

    return exact_law_of(model, distribution=distribution)


def sample_law(model, drafter, tree=None):
    dec = SpeculativeDecoder(model, drafter, 2, adaptive=False, max_batch_size=5000, tree=tree)
    counts = dict.fromkeys(itertools.product(range(LAW_VOCAB), repeat=LAW_TOKENS), 0)
    for start in range(0, LAW_SAMPLES, 5000):
        run = dec.generate if drafter is not None else dec.generate_autoregressive
        out = run([LAW_PROMPT] * 5000, LAW_TOKENS, temperature=1.0, seed=list(range(start, start + 5000)),
                  **LAW_CONTROLS)
        for s in out.sequences:
            counts[tuple(s)] += 1
    return counts, out.stats


# Sampled drafts (the model drafter, EAGLE chains) and point drafts in trees (EAGLE, Lookahead): the n-gram chains
# and Medusa trees ran once too (passed); the invariant-sampling test covers every drafter token for token.
LAW_DRAFTERS = ["plain", "model-chain", "eagle-chain", "eagle-tree", "lookahead-tree"]


@pytest.mark.parametrize("name", LAW_DRAFTERS)
def test_sampled_law_is_the_processed_target_law(name):
    """Rejection sampling (sampled drafts from the model drafter and the heads' chains; point drafts otherwise)."""
    target = law_target()
    kind, shape = (name.split("-") + [None])[:2]
    heads_vocab = torch.tensor([0, 2, 4, 5, 7])
    drafter = None if kind == "plain" else ModelDrafter(law_draft()) if kind == "model" else \
        NgramDrafter(2, 1) if kind == "ngram" else LookaheadDrafter(window=2, ngram=2, guesses=2) \
        if kind == "lookahead" else make_drafter(kind, target, heads_vocab, seed=11)
    tree = dict(num_nodes=8, depth=2, branching=3) if shape == "tree" and kind != "lookahead" else None
    counts, stats = sample_law(target, drafter, tree=tree)
    if drafter is not None:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert_law(counts, controlled_law(target))


# ------------------------------------------------------------------------------------------------ stop strings

class Letters:
    """Token i is the letter 'a' + i (multi-byte characters: tests/test_stop_strings.py)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i) for i in ids)

    def encode(self, text, add_special_tokens=False):
        return [ord(c) - 97 for c in text]


def test_stop_strings_end_requests_across_rounds(target):
    plain = SpeculativeDecoder(target, None, max_batch_size=1).generate_autoregressive(PROMPTS[:3], 20)
    texts = [Letters().decode(s) for s in plain.sequences]
    stops = [t[5:8] for t in texts]  # three letters that first appear at or after character 5
    streamed = {0: "", 1: "", 2: ""}

    def text_stream(r, piece):
        streamed[r] += piece

    dec = SpeculativeDecoder(target, drafter_of("ngram", target), 3, adaptive=False, max_batch_size=3)
    out = dec.generate(PROMPTS[:3], 20, stop=[[s] for s in stops], tokenizer=Letters(), text_stream=text_stream)
    assert out.stats.num_accepted_tokens > 0
    for r in range(3):
        end = texts[r].index(stops[r])
        assert out.texts[r] == texts[r][:end] and out.finish_reasons[r] == "stop" and out.stop_reasons[r] == stops[r]
        assert out.sequences[r] == plain.sequences[r][:end + 3]  # through the token that completed the stop
        assert streamed[r] == out.texts[r]
    included = dec.generate(PROMPTS[:1], 20, stop=stops[0], include_stop_str_in_output=True, tokenizer=Letters())
    assert included.texts[0] == texts[0][:texts[0].index(stops[0]) + 3]


# ------------------------------------------------------------------------------------------------ bad input

@pytest.mark.parametrize("kwargs,message", [
    (dict(repetition_penalty=0.0), "repetition_penalty must be finite and > 0"),
    (dict(presence_penalty=float("nan")), "presence_penalty must be finite"),
    (dict(logit_bias={99: 1.0}), "logit_bias: token id 99 is outside the vocabulary"),
    (dict(logit_bias={1: float("inf")}), "logit_bias[1] must be finite"),
    (dict(bad_words=["abc"]), "pass tokenizer="),
    (dict(bad_words=[[1, 99]]), "token id 99 is outside the vocabulary"),
    (dict(min_tokens=-1), "min_tokens must be an int >= 0"),
    (dict(min_p=1.0), "min_p must be in [0, 1)"),
    (dict(logprobs=21), "logprobs must be None or an int in [0, 20]"),
    (dict(logprobs_mode="sampled"), "logprobs_mode must be one of"),
    (dict(stop=["x"]), "pass tokenizer="),
    (dict(stop=[""], tokenizer=Letters()), "stop"),
    (dict(top_n=3), "unknown generation control 'top_n'"),
    (dict(bad_words=[1, 2]), "bad_words[0] must be a string or a non-empty list of token ids"),
    (dict(bad_words=[[1, 2], []]), "bad_words[1] must be a string or a non-empty list of token ids"),
    (dict(bad_words={1: 2}), "bad_words must be a list"),
    (dict(stop=["x"], tokenizer=Letters(), include_stop_str_in_output="yes"), "include_stop_str_in_output must be"),
])
def test_bad_controls_are_refused_by_name(target, kwargs, message):
    dec = SpeculativeDecoder(target, None)
    with pytest.raises(ValueError) as e:
        dec.generate_autoregressive(PROMPTS[:1], 4, **kwargs)
    assert message in str(e.value)
