"""specdec_ext.compat.transformers: patch() routes transformers' assisted sampling (generate(assistant_model=...,
do_sample=True)) through our from-logits kernel. The law of the first generated tokens is the target's processed
law (chi-square against float64 exact laws), the shim keeps transformers' return convention, patch/unpatch restore
the original, torch.manual_seed reproduces a call. Fixed seeds throughout."""
import contextlib
import subprocess
import sys

import pytest
import torch

from helpers.chi_square import bias_power, law_pvalue
from helpers.compat_transformers import (
    ASSISTED_SAMPLING,
    GENERATE_SAMPLES,
    CountingOps,
    assisted_models,
    check_law_of_the_shims_call,
    check_torch_manual_seed_reproduces_generate,
    complete_sequences,
    generate_counts,
    table_law,
    table_model,
    table_round,
)
from helpers.laws import LAW_PROMPT, exact_law
from specdec_ext import compat
from specdec_ext.compat import transformers as shim

transformers = pytest.importorskip("transformers")
hf_utils = pytest.importorskip("transformers.generation.utils")

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(autouse=True)
def restore_transformers():
    """Every test leaves transformers unpatched, whatever it did."""
    yield
    shim.unpatch()
    assert not shim.is_patched()


# ------------------------------------------------------------------------------------- the law through generate()

@pytest.mark.slow
def test_generate_law_under_patch_is_the_targets_processed_law(monkeypatch):
    """1,500 generate() calls (batch 1 is transformers' limit; ~40 s), T = 1.2, top-k 4, top-p 0.9 (both cut): the
    first 3 tokens (41 sequences of positive probability) against the exact float64 law, p > 1e-3. Round 1 drafts
    2 candidates (max_new_tokens 3), so first- and second-position acceptance, the residual and the bonus token
    all enter. Power against a shift of 1% between the two likeliest sequences is ~0.01 at this sample count,
    0.61 against 4%, >= 0.9 against 5% (asserted); a sequence of probability 0 (a filtered token) fails at once.
    The 1% power is the direct tests' below (the shim's exact call) and tests/test_speculative_decoding.py's."""
    target, assistant = assisted_models()
    law = exact_law(ASSISTED_SAMPLING["temperature"], ASSISTED_SAMPLING["top_k"], ASSISTED_SAMPLING["top_p"])
    counting = CountingOps(compat.backend())
    monkeypatch.setattr(shim, "backend", lambda: counting)
    with shim.patch():
        counts = generate_counts(target, assistant, GENERATE_SAMPLES, seed=2024, **ASSISTED_SAMPLING)
    drafted = sum(k for k, _ in counting.calls)
    accepted = sum(a for _, a in counting.calls)
    assert len(counting.calls) >= GENERATE_SAMPLES, "generate() did not verify with the shim"
    assert 0.2 < accepted / drafted < 0.9, ("the test needs drafts accepted and rejected", accepted / drafted)
    pvalue, df = law_pvalue(counts, law)
    assert bias_power(law, GENERATE_SAMPLES, df, 0.05) >= 0.9
    assert pvalue > 1e-3, (pvalue, df)


def test_eos_in_the_candidates_ends_the_sequence():
    """transformers 5.24 has no is_done_candidate: the caller crops valid_tokens at the first EOS (and at max_length).
    With an EOS that the assistant drafts often, every output ends at its first EOS and never runs past it."""
    target, assistant = assisted_models()
    eos = 0  # the likeliest token after LAW_PROMPT (law ~0.4)
    prompt = torch.tensor([LAW_PROMPT])
    torch.manual_seed(7)
    ended = 0
    with shim.patch():
        for _ in range(40):
            new = target.generate(prompt, assistant_model=assistant, do_sample=True, max_new_tokens=6,
                                  eos_token_id=eos, temperature=1.0)[0, len(LAW_PROMPT):].tolist()
            assert eos not in new[:-1] and (len(new) == 6 or new[-1] == eos), new
            ended += new[-1] == eos
    assert ended >= 10


# ------------------------------------------------------------------------------------------- patch() and unpatch()

def test_patch_and_unpatch_restore_the_original():
    original = hf_utils._speculative_sampling
    assert original is not shim.speculative_sampling
    with shim.patch():
        assert hf_utils._speculative_sampling is shim.speculative_sampling
        with shim.patch():  # nested: the outer patch stays in force after it
            assert shim.is_patched()
        assert hf_utils._speculative_sampling is shim.speculative_sampling
    assert hf_utils._speculative_sampling is original
    shim.patch()
    shim.patch()  # a duplicate plain call changes nothing
    with shim.patch():
        pass
    assert hf_utils._speculative_sampling is shim.speculative_sampling  # the plain patch outlives the with block
    shim.unpatch()
    assert hf_utils._speculative_sampling is original
    shim.unpatch()  # unpatching twice is a no-op
    assert hf_utils._speculative_sampling is original
    with pytest.raises(RuntimeError), shim.patch():  # an exception in the block still unpatches
        raise RuntimeError
    assert hf_utils._speculative_sampling is original


def test_importing_the_shim_does_not_import_transformers():
    code = "import sys, specdec_ext.compat.transformers; assert 'transformers' not in sys.modules, 'imported'"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


# ------------------------------------------------------------------------------ the shim against transformers' own

def one_hot_rows(tokens, vocab):
    """Logits that put all mass on one token per row (others -inf): the acceptance test is then deterministic."""
    rows = torch.full((1, len(tokens), vocab), float("-inf"))
    rows[0, torch.arange(len(tokens)), torch.tensor(tokens)] = 0.0
    return rows


# candidates 5, 2, 7 after the prefix 1, 3; the target's one-hot tokens per position; the expected emission
ONE_HOT = {
    "first rejected": ([4, 2, 7, 1], [4], 0),
    "second rejected": ([5, 6, 7, 1], [5, 6], 1),
    "last rejected": ([5, 2, 0, 1], [5, 2, 0], 2),
    "all accepted, bonus": ([5, 2, 7, 3], [5, 2, 7, 3], 3),
}


@pytest.mark.parametrize("ops", ["native", "emulated"])
@pytest.mark.parametrize("case", list(ONE_HOT))
def test_one_hot_target_gives_transformers_tokens_and_convention(case, ops):
    """A one-hot target makes every decision certain: the tokens and n_matches are known, and must be what
    transformers' own function returns, with its dtypes and shapes (valid_tokens [1, n + 1] int64, n_matches a
    0-d int64 tensor). The draft rows are random, with -inf entries (a top-k filtered assistant)."""
    target_tokens, want, n = ONE_HOT[case]
    candidate_input_ids = torch.tensor([[1, 3, 5, 2, 7]])
    g = torch.Generator().manual_seed(11)
    candidate_logits = torch.randn(1, 3, 9, generator=g)
    candidate_logits[0, :, 0] = float("-inf")
    new_logits = one_hot_rows(target_tokens, 9)
    with compat.emulated() if ops == "emulated" else contextlib.nullcontext():
        tokens, matches = shim.speculative_sampling(candidate_input_ids, candidate_logits, 3, new_logits)
    theirs, their_matches = hf_utils._speculative_sampling(candidate_input_ids, candidate_logits, 3, new_logits)
    assert tokens.tolist() == [want] == theirs.tolist()
    assert int(matches) == n == int(their_matches)
    assert tokens.dtype == theirs.dtype == torch.int64 and tokens.shape == (1, n + 1)
    assert matches.dtype == their_matches.dtype and matches.dim() == their_matches.dim() == 0


@pytest.mark.parametrize("case", list(ONE_HOT))
def test_is_done_candidate_of_transformers_4(case):
    """transformers 4.x passed is_done_candidate (a bool) fifth: when every candidate is accepted and the last one
    ended the sequence there is no bonus token (the candidates, n_matches = K - 1); otherwise nothing changes."""
    target_tokens, want, n = ONE_HOT[case]
    candidate_input_ids = torch.tensor([[1, 3, 5, 2, 7]])
    candidate_logits = torch.zeros(1, 3, 9)
    new_logits = one_hot_rows(target_tokens, 9)
    tokens, matches = shim.speculative_sampling(candidate_input_ids, candidate_logits, 3, new_logits, True)
    if n == 3:
        want, n = [5, 2, 7], 2
    assert tokens.tolist() == [want] and int(matches) == n
    tokens, matches = shim.speculative_sampling(candidate_input_ids, candidate_logits, 3, new_logits, False)
    assert tokens.tolist() == [ONE_HOT[case][1]] and int(matches) == ONE_HOT[case][2]


def test_lossy_ensemble_verification_is_refused():
    ids, logits = torch.tensor([[1, 2]]), torch.zeros(1, 1, 4)
    with pytest.raises(ValueError, match="assistant_ensemble_weight.*lossless"):
        shim.speculative_sampling(ids, logits, 1, torch.zeros(1, 2, 4), assistant_ensemble_weight=0.5)
    with pytest.raises(ValueError, match="batch size 1"):
        shim.speculative_sampling(ids.repeat(2, 1), logits.repeat(2, 1, 1), 1, torch.zeros(2, 2, 4))


# ------------------------------------------------------------------------------------------------ reproducibility

def test_torch_manual_seed_reproduces_generate():
    check_torch_manual_seed_reproduces_generate("cpu")


def test_the_shim_draws_its_key_from_torch_default_generator():
    g = torch.Generator().manual_seed(3)
    ids = torch.tensor([[0, 1, 2, 3, 4]])
    draft, target = torch.randn(1, 4, 50, generator=g), torch.randn(1, 5, 50, generator=g)

    def draws(seed):
        torch.manual_seed(seed)
        return [shim.speculative_sampling(ids, draft, 4, target)[0].tolist() for _ in range(20)]

    assert draws(1) == draws(1)
    assert draws(1) != draws(2)


# -------------------------------------------------------------------------- the law of the shim's call, directly


def test_law_of_the_shims_call_at_a_large_batch():
    check_law_of_the_shims_call("cpu")


SHIM_SAMPLES = 6000


def test_law_of_the_shim_function():
    """The shim function itself, 6,000 calls (batch 1; its op call costs ~0.25 ms, ~1 ms under AddressSanitizer),
    on the table model: the 3-token sequences against the exact law (50 cells), p > 1e-3. Power against the
    hardest 1% shift 0.02, 0.56 against 2%, >= 0.99 against 3% (asserted). Catches what the large-batch test cannot:
    the shim's slicing of
    the candidates, its temperature, its cut of the output."""
    t, d = table_model()
    law = table_law(t)
    g = torch.Generator().manual_seed(19)
    drafts, target, draft = table_round(t, d, SHIM_SAMPLES, g)
    prefix = torch.tensor([[4, 1, 0]])
    emitted = torch.full((SHIM_SAMPLES, 3), -1)
    lengths = torch.empty(SHIM_SAMPLES, dtype=torch.long)
    torch.manual_seed(0)
    for i in range(SHIM_SAMPLES):
        tokens, matches = shim.speculative_sampling(torch.cat([prefix, drafts[i:i + 1]], 1), draft[i:i + 1], 2,
                                                    target[i:i + 1])
        emitted[i, :tokens.shape[1]] = tokens[0]
        lengths[i] = tokens.shape[1]
        assert int(matches) == tokens.shape[1] - 1
    counts = complete_sequences(t, emitted, lengths, g)
    pvalue, df = law_pvalue(counts, law)
    assert bias_power(law, SHIM_SAMPLES, df, 0.03) >= 0.99
    assert pvalue > 1e-3, (pvalue, df)


def test_transformers_5_17_call_form():
    """transformers 5.17 called `_speculative_sampling(ids, logits, K, new_logits, is_done_candidate,
    assistant_ensemble_weight=w)`, is_done_candidate a [1] bool tensor from its stopping criteria; 5.18 on pass only
    the weight, by keyword. Both bind, and 5.17's flag keeps its meaning (no bonus token after an accepted EOS)."""
    vocab, k = 5, 2
    drafts = torch.tensor([[0, 3, 1]])
    target = torch.full((1, k + 1, vocab), -1e4).index_fill_(2, torch.tensor([3]), 0.0)
    target[0, 1, 1] = 0.0
    target[0, 1, 3] = -1e4
    draft = target[:, :k].clone()
    for flag, want in ((torch.tensor([True]), [[3, 1]]), (torch.tensor([False]), None)):
        tokens, n = shim.speculative_sampling(drafts, draft, k, target, flag,
                                                           assistant_ensemble_weight=None)
        assert int(n) == (k - 1 if want else k) and (want is None or tokens.tolist() == want)
    tokens, n = shim.speculative_sampling(drafts, draft, k, target, assistant_ensemble_weight=None)
    assert int(n) == k and tokens[0, :k].tolist() == [3, 1]
    with pytest.raises(ValueError, match="lossy"):
        shim.speculative_sampling(drafts, draft, k, target, torch.tensor([False]),
                                               assistant_ensemble_weight=0.5)
