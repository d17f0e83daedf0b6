"""specdec_ext.compat.transformers: patch() routes transformers' assisted sampling (generate(assistant_model=...,
do_sample=True)) through our from-logits kernel. The law of the first generated tokens is the target's processed
law (chi-square against float64 exact laws), the shim keeps transformers' return convention, patch/unpatch restore
the original, torch.manual_seed reproduces a call. Fixed seeds throughout."""
import contextlib
import subprocess
import sys

import pytest
import torch
from scipy import stats
from test_plain_decoding import tiny_hf
from test_speculative_decoding import LAW_PROMPT, chi_square_power, exact_law

from specdec_ext import compat
from specdec_ext.compat import transformers as shim

transformers = pytest.importorskip("transformers")
hf_utils = pytest.importorskip("transformers.generation.utils")

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

VOCAB, TOKENS = 8, 3
SAMPLING = dict(temperature=1.2, top_k=4, top_p=0.9)


@pytest.fixture(autouse=True)
def restore_transformers():
    """Every test leaves transformers unpatched, whatever it did."""
    yield
    shim.unpatch()
    assert not shim.is_patched()


# ------------------------------------------------------------------------------------------ helpers (also for tests/gpu)

def law_models(device="cpu"):
    """The law target and a different assistant (tests/test_speculative_decoding.py's pair, as transformers models:
    acceptance ~0.6), no EOS (an EOS would end sequences early), and the target's float64 copy for the exact law."""
    target = tiny_hf(vocab=VOCAB, layers=1, seed=99, logit_scale=0.15)
    assistant = tiny_hf(vocab=VOCAB, layers=1, hidden=32, seed=5, logit_scale=0.15)
    for m in (target, assistant):
        m.generation_config.eos_token_id = m.generation_config.bos_token_id = m.generation_config.pad_token_id = None
    hf64 = tiny_hf(vocab=VOCAB, layers=1, seed=99, logit_scale=0.15).double()
    return target.to(device), assistant.to(device), hf64


def generate_counts(target, assistant, n: int, seed: int, **sampling) -> dict:
    """Counts of the first TOKENS tokens of n assisted generate() calls from LAW_PROMPT, after torch.manual_seed(seed)."""
    prompt = torch.tensor([LAW_PROMPT], device=target.device)
    torch.manual_seed(seed)
    counts = {}
    for _ in range(n):
        out = target.generate(prompt, assistant_model=assistant, do_sample=True, max_new_tokens=TOKENS, **sampling)
        s = tuple(out[0, len(LAW_PROMPT):].tolist())
        counts[s] = counts.get(s, 0) + 1
    return counts


def law_pvalue(counts: dict, law: dict) -> tuple[float, int]:
    """Chi-square p-value of the counts against the law (cells expected < 5 pooled) and its degrees of freedom;
    raises if a sequence of probability 0 was emitted."""
    n = sum(counts.values())
    impossible = {s: c for s, c in counts.items() if law.get(s, 0.0) == 0.0}
    assert not impossible, f"sequences of probability 0 emitted: {impossible}"
    expected = {s: p * n for s, p in law.items() if p > 0}
    big = [s for s, e in expected.items() if e >= 5]
    observed = [counts.get(s, 0) for s in big] + [sum(counts.get(s, 0) for s in expected if s not in big)]
    cells = [expected[s] for s in big] + [sum(e for s, e in expected.items() if s not in big)]
    if cells[-1] == 0:
        observed, cells = observed[:-1], cells[:-1]
    return float(stats.chisquare(observed, cells).pvalue), len(cells) - 1


def power(law: dict, n: int, df: int, bias: float) -> float:
    """chi_square_power (a 1% shift between the two likeliest sequences) scaled to a shift of `bias`: the
    noncentrality is n * bias^2 * (...), i.e. that of n * (bias / 0.01)^2 samples at 1%."""
    return chi_square_power(law, int(n * (bias / 0.01) ** 2), df)


class CountingOps:
    """The real ops, recording (drafted, accepted) of every chain sampling call (reads the count on the host)."""

    def __init__(self, ops):
        self.ops, self.calls = ops, []

    def chain_speculative_sampling_from_logits(self, draft_token_ids, *args, **kwargs):
        out = self.ops.chain_speculative_sampling_from_logits(draft_token_ids, *args, **kwargs)
        self.calls.append((draft_token_ids.shape[1], int(out.num_accepted[0])))
        return out


# ------------------------------------------------------------------------------------- the law through generate()

GENERATE_SAMPLES = 1500


def test_generate_law_under_patch_is_the_targets_processed_law(monkeypatch):
    """1,500 generate() calls (batch 1 is transformers' limit; ~40 s), T = 1.2, top-k 4, top-p 0.9 (both cut): the
    first 3 tokens (41 sequences of positive probability) against the exact float64 law, p > 1e-3. Round 1 drafts
    2 candidates (max_new_tokens 3), so first- and second-position acceptance, the residual and the bonus token
    all enter. Power against a shift of 1% between the two likeliest sequences is ~0.01 at this sample count,
    0.61 against 4%, >= 0.9 against 5% (asserted); a sequence of probability 0 (a filtered token) fails at once.
    The 1% power is the direct tests' below (the shim's exact call) and tests/test_speculative_decoding.py's."""
    target, assistant, hf64 = law_models()
    law = exact_law(hf64, LAW_PROMPT, SAMPLING["temperature"], SAMPLING["top_k"], SAMPLING["top_p"])
    counting = CountingOps(compat.backend())
    monkeypatch.setattr(shim, "backend", lambda: counting)
    with shim.patch():
        counts = generate_counts(target, assistant, GENERATE_SAMPLES, seed=2024, **SAMPLING)
    drafted = sum(k for k, _ in counting.calls)
    accepted = sum(a for _, a in counting.calls)
    assert len(counting.calls) >= GENERATE_SAMPLES, "generate() did not verify with the shim"
    assert 0.2 < accepted / drafted < 0.9, ("the test needs drafts accepted and rejected", accepted / drafted)
    pvalue, df = law_pvalue(counts, law)
    assert power(law, GENERATE_SAMPLES, df, 0.05) >= 0.9
    assert pvalue > 1e-3, (pvalue, df)


def test_eos_in_the_candidates_ends_the_sequence():
    """transformers 5.24 has no is_done_candidate: the caller crops valid_tokens at the first EOS (and at max_length).
    With an EOS that the assistant drafts often, every output ends at its first EOS and never runs past it."""
    target, assistant, _ = law_models()
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

def test_torch_manual_seed_reproduces_generate(device="cpu"):
    """The kernel's key comes from torch's default generator on the logits' device (torch.manual_seed seeds every
    device), like transformers' own sampling: the same seed gives the same tokens, different seeds different ones."""
    target, assistant, _ = law_models(device)
    prompt = torch.tensor([LAW_PROMPT], device=device)

    def run(seed):
        torch.manual_seed(seed)
        return target.generate(prompt, assistant_model=assistant, do_sample=True, max_new_tokens=12,
                               **SAMPLING)[0].tolist()

    with shim.patch():
        first = [run(s) for s in range(6)]
        assert [run(s) for s in range(6)] == first
    assert len({tuple(s) for s in first}) >= 4


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

TABLE_VOCAB = 6


def table_model(seed=3):
    """A 'model' given by tables, so the law is exact and cheap: target logits for every prefix of up to 2 tokens
    (rows [V], [V, V], [V, V, V]) and draft logits for up to 1 (rows [V], [V, V]). Each target row keeps 3 or 4
    tokens and filters the rest to -inf (top-k style); its draft row is the target's plus noise, with one allowed
    token filtered (the draft gives it 0: it keeps its full p in the residual) and one filtered token allowed
    (the target gives it 0: always rejected)."""
    g = torch.Generator().manual_seed(seed)

    def rows(*shape):
        logits = 1.5 * torch.randn(*shape, TABLE_VOCAB, generator=g, dtype=torch.float64)
        keep = torch.randint(3, 5, shape, generator=g).unsqueeze(-1)
        rank = torch.rand(*shape, TABLE_VOCAB, generator=g).argsort(-1).argsort(-1)
        draft = logits + torch.randn(logits.shape, generator=g, dtype=torch.float64)
        # ranks 0..keep-1 are the target's tokens; the draft drops rank 0 and takes rank keep instead
        return (logits.masked_fill(rank >= keep, float("-inf")),
                draft.masked_fill((rank == 0) | (rank > keep), float("-inf")))

    (t0, d0), (t1, d1), (t2, _) = rows(), rows(TABLE_VOCAB), rows(TABLE_VOCAB, TABLE_VOCAB)
    return [t0, t1, t2], [d0, d1]


def table_law(t) -> dict:
    p0, p1, p2 = (x.softmax(-1) for x in t)
    law = p0[:, None, None] * p1[:, :, None] * p2
    return {(a, b, c): float(law[a, b, c]) for a in range(TABLE_VOCAB) for b in range(TABLE_VOCAB)
            for c in range(TABLE_VOCAB)}


def table_round(t, d, n: int, g: torch.Generator):
    """n rounds of K = 2: drafts sampled from the draft tables, and each round's [1, 3, V] target / [1, 2, V] draft
    rows for those drafts, float32 as transformers hands them over."""
    x1 = torch.multinomial(d[0].softmax(-1), n, replacement=True, generator=g)
    x2 = torch.multinomial(d[1][x1].softmax(-1), 1, generator=g)[:, 0]
    target = torch.stack([t[0].expand(n, -1), t[1][x1], t[2][x1, x2]], 1).float()
    draft = torch.stack([d[0].expand(n, -1), d[1][x1]], 1).float()
    return torch.stack([x1, x2], 1), target, draft


def complete(t, emitted: torch.Tensor, lengths: torch.Tensor, g: torch.Generator) -> dict:
    """Counts of 3-token sequences: each round's emitted tokens (first lengths[i] of emitted[i]), the rest drawn
    from the target tables (the next rounds of an exact target sampler)."""
    seq = emitted[:, :3].clone().long()
    for pos in (1, 2):
        need = lengths <= pos
        rows = t[1][seq[need, 0]] if pos == 1 else t[2][seq[need, 0], seq[need, 1]]
        seq[need, pos] = torch.multinomial(rows.softmax(-1), 1, generator=g)[:, 0]
    keys, counts = seq.unique(dim=0, return_counts=True)
    return {tuple(k.tolist()): int(c) for k, c in zip(keys, counts)}


def check_table_tables(t, d):
    """The tables hold both situations the test is about (a guard on the fixed seed)."""
    allowed = [x > float("-inf") for x in t]
    offered = [x > float("-inf") for x in d]
    assert any(bool((a & ~o).any()) for a, o in zip(allowed, offered)), "no token the target allows and the draft not"
    assert any(bool((o & ~a).any()) for a, o in zip(allowed, offered)), "no token the draft offers and the target not"


OP_SAMPLES = 50_000


def test_law_of_the_shims_call_at_a_large_batch(device="cpu"):
    """The exact call the shim makes (drafts, processed target rows, processed draft rows, temperature 1), at a
    batch of 50,000 rounds (~5 s: the CPU kernel costs ~0.1 ms a row at any V below one tile) whose drafts are sampled from the draft tables; completed by exact target draws, the
    3-token sequences must have the target's law (50 cells; acceptance ~0.6): p > 1e-3, with the power against the hardest 1%
    shift checked >= 0.99. A filtered token emitted fails at once."""
    t, d = table_model()
    check_table_tables(t, d)
    law = table_law(t)
    g = torch.Generator().manual_seed(17)
    drafts, target, draft = table_round(t, d, OP_SAMPLES, g)
    seeds = torch.arange(OP_SAMPLES, device=device)  # one key per round: rounds sharing a key share their draws
    out = compat.backend().chain_speculative_sampling_from_logits(drafts.to(device), target.to(device),
                                                                  draft.to(device), temperature=1.0, seed=seeds)
    acceptance = float(out.num_accepted.float().mean()) / 2
    assert 0.2 < acceptance < 0.8, acceptance
    counts = complete(t, out.output_token_ids.cpu(), out.num_accepted.cpu() + 1, g)
    pvalue, df = law_pvalue(counts, law)
    assert power(law, OP_SAMPLES, df, 0.01) >= 0.99
    assert pvalue > 1e-3, (pvalue, df)


SHIM_SAMPLES = 6000


def test_law_of_the_shim_function():
    """The shim function itself, 6,000 calls (batch 1; its op call costs ~0.25 ms, ~1 ms under AddressSanitizer),
    on the table model: the 3-token sequences against the exact law (50 cells), p > 1e-3. Power against the
    hardest 1% shift 0.02, 0.56 against 2%, >= 0.99 against 3% (asserted). Catches what the large-batch test cannot: the shim's slicing of
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
    counts = complete(t, emitted, lengths, g)
    pvalue, df = law_pvalue(counts, law)
    assert power(law, SHIM_SAMPLES, df, 0.03) >= 0.99
    assert pvalue > 1e-3, (pvalue, df)
