"""specdec_ext.engine.generate_autoregressive (plain decoding) and specdec_ext.reference.filter_logits (the readable
version of the kernels' top-k / top-p / min-p processing):
greedy equals transformers' argmax step by step, seeded sampling is reproducible and independent of the rest of
the batch, the sampled tokens follow softmax(logits / T) under transformers' top-k / top-p masks, EOS and
max_new_tokens are per request, bad arguments are refused. Fixed seeds throughout."""
import pytest
import torch
from scipy import stats
from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from helpers.laws import exact_distribution
from helpers.models import VOCAB, random_prompts, shared_hf, tiny_model
from specdec_ext.engine import generate_autoregressive
from specdec_ext.reference import filter_logits


@pytest.fixture(scope="module")
def models():
    return shared_hf(seed=1234), tiny_model(seed=1234)


# Tiny models: one intra-op thread (conftest.one_intra_op_thread).
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@torch.no_grad()
def hf_greedy(hf, prompt, n):
    """n tokens of step-by-step argmax over transformers' logits (a full forward per step, no cache)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


# ------------------------------------------------------------------------------------------------------ greedy

@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("lengths", [[13], [5, 21, 12]], ids=["B1", "ragged3"])
def test_greedy_equals_transformers_argmax(models, lengths, paged):
    hf, model = models
    prompts = random_prompts(len(lengths), lengths)
    n = 12
    out = generate_autoregressive(model, prompts, n, paged=paged)
    want = [hf_greedy(hf, p, n) for p in prompts]
    assert out.sequences == want
    assert out.stats.generated_tokens == n * len(prompts)
    assert len({tuple(s) for s in want}) == len(prompts)  # the requests really differ


def test_greedy_batch_of_more_than_16_requests(models):
    """A batch larger than the decode GEMM's small-row path (16 rows): still transformers' argmax per request."""
    hf, model = models
    g = torch.Generator().manual_seed(20)
    prompts = random_prompts(20, torch.randint(2, 16, (20,), generator=g).tolist())
    out = generate_autoregressive(model, prompts, 4)
    assert out.sequences == [hf_greedy(hf, p, 4) for p in prompts]


# ---------------------------------------------------------------------------------------------------- sampling

SAMPLING = dict(temperature=0.8, top_k=20, top_p=0.9)


def test_seeded_sampling_is_reproducible_and_batch_independent(models):
    _, model = models
    a, b, c, d = random_prompts(7, [9, 4, 17, 11])
    alone = generate_autoregressive(model, [a], 24, seed=7, **SAMPLING).sequences[0]
    again = generate_autoregressive(model, [a], 24, seed=7, **SAMPLING).sequences[0]
    assert alone == again
    # Inside a batch, at another index, next to other prompts, seeds, parameters and lengths.
    batch = generate_autoregressive(model, [b, a, c, d], [10, 24, 30, 5], seed=[3, 7, 7, 12345],
                                    temperature=[1.0, 0.8, 0.8, 0.0], top_k=[0, 20, 20, 3], top_p=[0.5, 0.9, 0.9, 1.0])
    assert batch.sequences[1] == alone
    assert [len(s) for s in batch.sequences] == [10, 24, 30, 5]
    paged = generate_autoregressive(model, [c, a], 24, seed=[1, 7], paged=True, **SAMPLING)
    assert paged.sequences[1] == alone
    # The seed matters and the tokens are sampled, not greedy.
    others = [generate_autoregressive(model, [a], 24, seed=s, **SAMPLING).sequences[0] for s in (8, 9)]
    assert alone not in others
    assert generate_autoregressive(model, [a], 24).sequences[0] not in [alone] + others


# Power of this test, roughly: N = 20000 draws, a token of probability p >= 0.1 whose frequency is off by 0.01
# (the excess taken from the rest) moves its count by 200 against a standard deviation sqrt(N p (1 - p)) <= 71,
# i.e. >= 2.8 sd at p = 0.5 and 4.7 sd at p = 0.1. The chi-square statistic then has noncentrality
# N (0.01^2/p + 0.01^2/(1-p)) = 22 at p = 0.1; against the p = 1e-3 critical value that is power ~0.77 with 4
# degrees of freedom (top-k 5), ~0.6 with 8 and ~0.45 with 15 (the unmasked 16-token case). The per-token binomial
# check below (Bonferroni over the tokens, same 1e-3) detects it with power ~0.76 at p = 0.1. So a 1% bias is
# caught more often than not, a 2% bias (noncentrality ~89, 9 sd) essentially always, a masking error (mass on a
# token that must have none) always.
N_DRAWS = 20000
LAW_CASES = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.0, 0, 0.8)]


@pytest.mark.slow  # ~10-15 s each: N_DRAWS prefills
@pytest.mark.parametrize("temperature,top_k,top_p", LAW_CASES)
def test_sampled_tokens_follow_the_exact_distribution(temperature, top_k, top_p):
    vocab = 16
    spread = dict(vocab=vocab, layers=1, seed=99, logit_scale=0.08)
    hf, model = shared_hf(**spread), tiny_model(**spread)
    prompt = [3, 5, 7]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt]), use_cache=False).logits[0, -1]
    probs = exact_distribution(logits, temperature, top_k, top_p)
    # The test's own design: a spread-out distribution, and no top-k / top-p boundary within rounding.
    assert float(probs.max()) < 0.6 and int((probs > 0.05).sum()) >= 3
    ordered = (logits.double() / temperature).sort(descending=True).values
    if top_k:
        assert float(ordered[top_k - 1] - ordered[top_k]) > 1e-3
    if top_p < 1:
        cumulative = ordered.softmax(-1).cumsum(-1)
        assert float((cumulative - top_p).abs().min()) > 1e-3

    counts = torch.zeros(vocab, dtype=torch.long)
    per_call = 5000
    for start in range(0, N_DRAWS, per_call):
        out = generate_autoregressive(model, [prompt] * per_call, 1, temperature=temperature, top_k=top_k,
                                      top_p=top_p, seed=list(range(start, start + per_call)))
        counts += torch.bincount(torch.tensor(out.sequences)[:, 0], minlength=vocab)
    assert int(counts.sum()) == N_DRAWS
    assert counts[probs == 0].sum() == 0, "a masked token was sampled"
    expected = probs * N_DRAWS
    # Chi-square over the tokens with mass; those expected fewer than 5 times pooled into one cell.
    keep = expected >= 5
    observed = counts[keep].double().tolist()
    cells = expected[keep].tolist()
    rest = (probs > 0) & ~keep
    if rest.any():
        observed.append(float(counts[rest].sum()))
        cells.append(float(expected[rest].sum()))
    assert stats.chisquare(observed, cells).pvalue > 1e-3, (counts.tolist(), [round(x, 1) for x in expected.tolist()])
    support = probs > 0
    for token in support.nonzero().flatten().tolist():
        p_value = stats.binomtest(int(counts[token]), N_DRAWS, float(probs[token])).pvalue
        assert p_value * int(support.sum()) > 1e-3, (token, int(counts[token]), float(expected[token]))


# ----------------------------------------------------------------------------------- EOS, lengths, streaming

def test_eos_and_max_new_tokens_are_per_request(models):
    _, model = models
    prompts = random_prompts(21, [6, 14, 9])
    free = generate_autoregressive(model, prompts, 16).sequences
    # An EOS that request 0 emits at its 4th token (and not before), absent from some other request.
    eos = free[0][3]
    assert eos not in free[0][:3], "pick another prompt seed"
    assert any(eos not in s for s in free[1:]), "pick another prompt seed"
    def cut(s):
        return s[:s.index(eos) + 1] if eos in s else s
    got = generate_autoregressive(model, prompts, 16, eos_token_id=eos).sequences
    assert got == [cut(s) for s in free]
    assert len(got[0]) == 4 and got[0][-1] == eos
    # A list of EOS ids; ids that never appear change nothing.
    absent = next(t for t in range(VOCAB) if all(t not in s for s in free))
    assert generate_autoregressive(model, prompts, 16, eos_token_id=[absent, eos]).sequences == got
    # max_new_tokens per request
    lengths = [3, 16, 7]
    got = generate_autoregressive(model, prompts, lengths).sequences
    assert got == [s[:n] for s, n in zip(free, lengths)]
    # max_seq_len bounds prompt + generated tokens
    got = generate_autoregressive(model, prompts, 16, max_seq_len=20).sequences
    assert got == [s[:20 - len(p)] for s, p in zip(free, prompts)]


def test_stream_receives_every_token_in_order(models):
    _, model = models
    prompts = random_prompts(22, [6, 14, 9])
    calls = []
    out = generate_autoregressive(model, prompts, [5, 9, 2], temperature=0.9, seed=[1, 2, 3],
                                  stream=lambda r, tokens: calls.append((r, list(tokens))))
    streamed = [[] for _ in prompts]
    for r, tokens in calls:
        assert len(tokens) >= 1
        streamed[r].extend(tokens)
    assert streamed == out.sequences
    assert [len(s) for s in streamed] == [5, 9, 2]
    # Emitted as they are generated: one token per request and step, the steps in order (step k of every
    # request before step k + 1 of any).
    steps = []
    seen = [0] * len(prompts)
    for r, tokens in calls:
        assert len(tokens) == 1
        steps.append(seen[r])
        seen[r] += 1
    assert steps == sorted(steps)


# -------------------------------------------------------------------------------------------------- bad inputs

BAD_CALLS = {
    "no prompts": (([], 4), {}),
    "empty prompt": (([[1, 2], []], 4), {}),
    "token id = vocab": (([[1, VOCAB]], 4), {}),
    "negative token id": (([[-1, 2]], 4), {}),
    "prompt = max_seq_len": (([[1] * 8], 4), {"max_seq_len": 8}),
    "prompt > max_seq_len": (([[1] * 9], 4), {"max_seq_len": 8}),
    "max_new_tokens list too short": (([[1], [2], [3]], [4, 4]), {}),
    "seed list too long": (([[1], [2]], 4), {"seed": [1, 2, 3]}),
    "temperature list too short": (([[1], [2]], 4), {"temperature": [0.5]}),
    "negative temperature": (([[1, 2]], 4), {"temperature": -0.5}),
    "negative temperature in a list": (([[1], [2]], 4), {"temperature": [0.5, -1.0]}),
    "max_new_tokens 0": (([[1, 2]], 0), {}),
    "top_p 0": (([[1, 2]], 4), {"temperature": 1.0, "top_p": 0.0}),
    "negative top_k": (([[1, 2]], 4), {"temperature": 1.0, "top_k": -1}),
}


@pytest.mark.parametrize("what", list(BAD_CALLS))
def test_bad_arguments_raise_value_error(models, what):
    _, model = models
    args, kwargs = BAD_CALLS[what]
    with pytest.raises(ValueError):
        generate_autoregressive(model, *args, **kwargs)


# -------------------------------------------------------------------------------------------- filter_logits

def hf_mask(row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """Where transformers' Temperature -> TopK -> TopP -> MinP warpers put -inf, for one row of logits."""
    scores = TemperatureLogitsWarper(temperature)(None, row.unsqueeze(0).double().clone())
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p > 0.0:
        scores = MinPLogitsWarper(min_p)(None, scores)
    return torch.isneginf(scores[0])


def test_filter_logits_equals_transformers_warpers():
    g = torch.Generator().manual_seed(2024)
    v = 50
    params = [  # (temperature, top_k, top_p), one per row
        (1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.9), (0.5, 10, 0.5), (2.0, 1, 1.0), (1.0, 0, 0.01),
        (0.9, 49, 0.95), (1.0, 50, 1.0), (1.0, 200, 0.7), (0.3, 3, 0.999), (1.7, 20, 0.2), (0.8, 0, 0.6),
    ]
    b = len(params)
    logits = torch.randn(b, v, generator=g) * (1 + 2 * torch.rand(b, 1, generator=g))
    logits[4, 7] = 30.0  # one dominant entry
    temperature = torch.tensor([p[0] for p in params])
    top_k = torch.tensor([p[1] for p in params])
    top_p = torch.tensor([p[2] for p in params])
    got = filter_logits(logits, temperature, top_k, top_p)
    assert got.shape == logits.shape and got.dtype == torch.float32
    for r, (t, k, p) in enumerate(params):
        want = hf_mask(logits[r], t, k, p)
        assert torch.equal(torch.isneginf(got[r]), want), (r, t, k, p)
        assert torch.equal(got[r][~want], logits[r][~want])  # the rest unchanged (not scaled)
    masked_count = torch.isneginf(got).sum(-1)
    assert masked_count[0] == 0 and masked_count[1] == v - 5 and masked_count[4] == v - 1

    # [B, K, V] logits (a verify block): each request's parameters on all its rows.
    block = torch.randn(b, 3, v, generator=g)
    got = filter_logits(block, temperature, top_k, top_p)
    for r, (t, k, p) in enumerate(params):
        for i in range(3):
            assert torch.equal(torch.isneginf(got[r, i]), hf_mask(block[r, i], t, k, p)), (r, i)

    # Ties at the top-k boundary are kept, as transformers keeps them.
    tied = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0, -1.0, 2.0]])
    got = filter_logits(tied, torch.tensor([1.0]), torch.tensor([2]), torch.tensor([1.0]))
    assert torch.equal(torch.isneginf(got[0]), hf_mask(tied[0], 1.0, 2, 1.0))
    assert int(torch.isfinite(got).sum()) == 5

    # Greedy rows (temperature 0) are left alone whatever top-k / top-p say.
    got = filter_logits(logits[:3], torch.zeros(3), torch.tensor([1, 2, 0]), torch.tensor([0.1, 1.0, 0.3]))
    assert torch.equal(got, logits[:3])

    # min-p after top-k and top-p (transformers' order), alone and combined with them.
    min_ps = [0.0, 0.05, 0.2, 0.5, 0.01, 0.9, 0.1, 0.3, 0.02, 0.4, 0.15, 0.6]
    got = filter_logits(logits, temperature, top_k, top_p, torch.tensor(min_ps))
    for r, ((t, k, p), mp) in enumerate(zip(params, min_ps)):
        assert torch.equal(torch.isneginf(got[r]), hf_mask(logits[r], t, k, p, mp)), (r, mp)
    assert int(torch.isneginf(got).sum()) > int(torch.isneginf(filter_logits(logits, temperature, top_k, top_p)).sum())
