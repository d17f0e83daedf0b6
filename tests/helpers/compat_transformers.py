"""The transformers shim's checks (its CPU tests, rerun by tests/gpu on CUDA): assisted generate() on the law models,
and the shim's exact call on table models whose law is exact."""
import torch

from helpers.chi_square import bias_power, law_pvalue
from helpers.laws import LAW_DRAFT, LAW_PROMPT, LAW_TARGET, LAW_TOKENS
from helpers.models import tiny_hf
from specdec_ext import compat
from specdec_ext.compat import transformers as transformers_shim

ASSISTED_SAMPLING = dict(temperature=1.2, top_k=4, top_p=0.9)


def assisted_models(device="cpu"):
    """The law target and its draft as transformers models (an assistant: acceptance ~0.6), no EOS (an EOS would end
    sequences early). Built per call: generate() and .to() change them."""
    target, assistant = tiny_hf(**LAW_TARGET), tiny_hf(**LAW_DRAFT)
    for m in (target, assistant):
        m.generation_config.eos_token_id = m.generation_config.bos_token_id = m.generation_config.pad_token_id = None
    return target.to(device), assistant.to(device)


def generate_counts(target, assistant, n: int, seed: int, **sampling) -> dict:
    """Counts of the first LAW_TOKENS tokens of n assisted generate() calls from LAW_PROMPT, after
    torch.manual_seed(seed)."""
    prompt = torch.tensor([LAW_PROMPT], device=target.device)
    torch.manual_seed(seed)
    counts = {}
    for _ in range(n):
        out = target.generate(prompt, assistant_model=assistant, do_sample=True, max_new_tokens=LAW_TOKENS, **sampling)
        s = tuple(out[0, len(LAW_PROMPT):].tolist())
        counts[s] = counts.get(s, 0) + 1
    return counts


class CountingOps:
    """The real ops, recording (drafted, accepted) of every chain sampling call (reads the count on the host)."""

    def __init__(self, ops):
        self.ops, self.calls = ops, []

    def chain_speculative_sampling_from_logits(self, draft_token_ids, *args, **kwargs):
        out = self.ops.chain_speculative_sampling_from_logits(draft_token_ids, *args, **kwargs)
        self.calls.append((draft_token_ids.shape[1], int(out.num_accepted[0])))
        return out


GENERATE_SAMPLES = 1500
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


def complete_sequences(t, emitted: torch.Tensor, lengths: torch.Tensor, g: torch.Generator) -> dict:
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


def check_law_of_the_shims_call(device):
    """The exact call the shim makes (drafts, processed target rows, processed draft rows, temperature 1), at a
    batch of 50,000 rounds (~5 s: the CPU kernel costs ~0.1 ms a row at any V below one tile) whose drafts are sampled
    from the draft tables; completed by exact target draws, the
    3-token sequences must have the target's law (50 cells; acceptance ~0.6): p > 1e-3, with the power against the
    hardest 1%
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
    counts = complete_sequences(t, out.output_token_ids.cpu(), out.num_accepted.cpu() + 1, g)
    pvalue, df = law_pvalue(counts, law)
    assert bias_power(law, OP_SAMPLES, df, 0.01) >= 0.99
    assert pvalue > 1e-3, (pvalue, df)


def check_torch_manual_seed_reproduces_generate(device):
    """The kernel's key comes from torch's default generator on the logits' device (torch.manual_seed seeds every
    device), like transformers' own sampling: the same seed gives the same tokens, different seeds different ones."""
    target, assistant = assisted_models(device)
    prompt = torch.tensor([LAW_PROMPT], device=device)

    def run(seed):
        torch.manual_seed(seed)
        return target.generate(prompt, assistant_model=assistant, do_sample=True, max_new_tokens=12,
                               **ASSISTED_SAMPLING)[0].tolist()

    with transformers_shim.patch():
        first = [run(s) for s in range(6)]
        assert [run(s) for s in range(6)] == first
    assert len({tuple(s) for s in first}) >= 4
