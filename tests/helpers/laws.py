"""Exact laws the decoder's tokens are tested against: one step under transformers' warpers (exact_distribution), and
the law of the first LAW_TOKENS tokens the law target emits after LAW_PROMPT (exact_law), with the decoder's samples
of it (sample_first_tokens; assert_law, in chi_square, tests them)."""
import functools
import itertools
import types
from collections.abc import Mapping

import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from helpers.models import tiny_hf, tiny_model
from specdec_ext import SpeculativeDecoder
from specdec_ext.models import LlamaForCausalLM


def exact_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """softmax(logits / T) under transformers' masks (TopK then TopP, after the temperature), in float64."""
    scores = logits.double().unsqueeze(0)
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(-1)[0]


LAW_VOCAB, LAW_TOKENS = 8, 3
LAW_CASES = {"T=1": (1.0, 0, 1.0), "T=0.7,top-k 5,top-p 0.9": (0.7, 5, 0.9)}


# Requests per case: the fewest multiples of 10,000 whose power against the hardest 1% bias (chi_square_power, for
# the case's exact law) is >= 0.95: 0.960 at T=1 (0.885 at 60,000); 0.978 for the concentrated top-k/top-p law
# (0.897 at 40,000; 0.9996 at 70,000). assert_law checks the power for the count it is given.
LAW_SAMPLES = {"T=1": 70_000, "T=0.7,top-k 5,top-p 0.9": 50_000}


LAW_PROMPT = [0, 4, 0, 0, 4, 0]  # the law target's likely tokens 0 and 4: prompt lookup proposes them
# The law target and a different draft: 8 tokens, spread-out distributions (the draft's far from the target's:
# acceptance ~0.5-0.7).
LAW_TARGET = dict(vocab=LAW_VOCAB, layers=1, seed=99, logit_scale=0.15)
LAW_DRAFT = dict(vocab=LAW_VOCAB, layers=1, hidden=32, seed=5, logit_scale=0.15)


def law_target(layers: int = 1) -> LlamaForCausalLM:
    """The law target; layers=2 its two-layer twin (an EAGLE-3 head needs two layers to read)."""
    return tiny_model(**{**LAW_TARGET, "layers": layers})


def law_draft() -> LlamaForCausalLM:
    return tiny_model(**LAW_DRAFT)


def law_target_int8(directory) -> LlamaForCausalLM:
    """The law target written as a GGUF of Q8_0 weights and loaded kept quantised with 8-bit activations: the
    integer path (its law is exact_law_of it, not the float target's)."""
    from gguf import GGMLQuantizationType as QType

    from helpers.gguf_files import write_gguf

    path = write_gguf(directory / "law_target_q8_0.gguf", tiny_hf(**LAW_TARGET), "llama", QType.Q8_0)
    return LlamaForCausalLM.from_pretrained(path, keep_quantized=True, activations="int8")


def exact_law_of(model: LlamaForCausalLM, temperature=1.0, top_k=0, top_p=1.0, distribution=None) -> Mapping:
    """exact_law from our model's own logits (float64 after them): each prefix's last row of a cached forward, the
    bits a decode step of that prefix computes. distribution(prefix, row) -> the next token's probabilities [V]
    (default: exact_distribution under temperature, top_k and top_p)."""
    if distribution is None:
        def distribution(prefix, row):
            return exact_distribution(row, temperature, top_k, top_p)
    law = {(): 1.0}
    for _ in range(LAW_TOKENS):
        prefixes = list(law)
        ids = torch.tensor([LAW_PROMPT + list(p) for p in prefixes])
        with torch.no_grad():
            logits = model(ids, model.new_kv_cache(len(prefixes), ids.shape[1]))[:, -1]
        law = {p + (t,): law[p] * float(q[t]) for p, row in zip(prefixes, logits)
               for q in [distribution(p, row)] for t in range(LAW_VOCAB)}
    return types.MappingProxyType(law)


@functools.cache
def exact_law(temperature, top_k, top_p) -> Mapping:
    """P(first LAW_TOKENS tokens after LAW_PROMPT = s) for every s in V^L, in lexicographic order, from the law
    target's float64 conditionals (transformers) under the same temperature / top-k / top-p (transformers' warpers).
    Computed once per process; read-only."""
    hf = tiny_hf(**LAW_TARGET).double()
    prompt = LAW_PROMPT
    law = {(): 1.0}
    for _ in range(LAW_TOKENS):
        prefixes = list(law)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + list(p) for p in prefixes]), use_cache=False).logits[:, -1]
        law = {p + (t,): law[p] * float(q[t]) for p, row in zip(prefixes, logits)
               for q in [exact_distribution(row, temperature, top_k, top_p)] for t in range(LAW_VOCAB)}
    return types.MappingProxyType(law)


def sample_first_tokens(target, drafter, case: str, tree=None, sampling: str = "rejection"):
    """LAW_SAMPLES[case] requests of LAW_PROMPT (seeds 0, 1, ...), k = 2 fixed (or tree rounds of these settings),
    verified as `sampling` says: the counts of their first LAW_TOKENS tokens (a dict over every sequence, as the
    law), the exact law, and the acceptance rate."""
    temperature, top_k, top_p = LAW_CASES[case]
    law = exact_law(temperature, top_k, top_p) if target is law_target() else \
        exact_law_of(target, temperature, top_k, top_p)
    per_call = 5000
    dec = SpeculativeDecoder(target, drafter, 2, adaptive=False, max_batch_size=per_call, tree=tree,
                             sampling=sampling)
    place = LAW_VOCAB ** torch.arange(LAW_TOKENS - 1, -1, -1)  # a sequence's index in lexicographic order
    counts = torch.zeros(LAW_VOCAB ** LAW_TOKENS, dtype=torch.long)
    accepted = drafted = 0
    samples = LAW_SAMPLES[case]
    for start in range(0, samples, per_call):
        out = dec.generate([LAW_PROMPT] * per_call, LAW_TOKENS, temperature=temperature, top_k=top_k, top_p=top_p,
                           seed=list(range(start, start + per_call)))
        tokens = torch.tensor(out.sequences)
        assert tokens.shape == (per_call, LAW_TOKENS) and 0 <= int(tokens.min()) and int(tokens.max()) < LAW_VOCAB
        counts += torch.bincount((tokens * place).sum(-1), minlength=len(counts))
        accepted += out.stats.num_accepted_tokens
        drafted += out.stats.num_draft_tokens
    assert drafted > samples
    sequences = itertools.product(range(LAW_VOCAB), repeat=LAW_TOKENS)
    return dict(zip(sequences, counts.tolist())), law, accepted / drafted
