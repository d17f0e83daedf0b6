"""What the test modules share, so that no test module imports another (tests/gpu included): the tiny random
models (built once per process: tiny_model, law_target, shipped_model), the law tests' exact laws, sampling and
chi-square, the inputs of the op tests, and the engine-shim checks that tests/gpu reruns on CUDA.

Shared models are read-only by contract: a test that changes a model builds its own (tiny_hf, arch_hf);
conftest.py checks at the end of the session that no shared model changed."""
import contextlib
import functools
import itertools
import json
import math
import types
import zlib
from collections.abc import Mapping

import gguf
import torch
import transformers
from gguf import GGMLQuantizationType as QType
from scipy import stats
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specdec_ext import SpeculativeDecoder, compat
from specdec_ext.compat import sglang
from specdec_ext.compat import transformers as transformers_shim
from specdec_ext.compat import vllm as vllm_shim
from specdec_ext.drafters import EagleDrafter, MedusaDrafter
from specdec_ext.models import LlamaForCausalLM, default_model_path, load_tokenizer
from specdec_ext.models.draft_heads import EagleHead, MedusaHeads

# ------------------------------------------------------------------------------------------------ shared models

_SHARED = []  # (model, fingerprint) of every shared model


def fingerprint(model) -> list:
    """Per tensor: its storage, its count of in-place writes, its sum (cheap, for the 135M shipped model too). The sums
    run on one thread: a float sum's rounding depends on how many threads split it, and a model registered inside a
    one-thread test is checked at the end of the session."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [(name, t.data_ptr(), t._version, float(t.sum())) for name, t in model.state_dict().items()]
    finally:
        torch.set_num_threads(threads)


def shared(model):
    """Registers a model built once and shared by many tests, to be checked unchanged at the end of the session."""
    _SHARED.append((model, fingerprint(model)))
    return model


def assert_shared_models_unchanged():
    changed = [type(m).__name__ for m, before in _SHARED if fingerprint(m) != before]
    assert not changed, f"a test changed a shared model ({changed}): give it its own copy"


# ---------------------------------------------------------------------------------------------- tiny decoding models

VOCAB = 128


def tiny_hf(*, vocab=VOCAB, hidden=64, layers=2, heads=4, kv_heads=2, seed=0, logit_scale=1.0):
    """A tiny random transformers Llama whose every parameter is distinct random data; logit_scale scales the
    LM head (1: logits of std ~8, peaked; ~0.1: a spread-out next-token distribution)."""
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=96,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, max_position_embeddings=256,
                                      rms_norm_eps=1e-5, tie_word_embeddings=False, attn_implementation="eager")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1 + 0.3 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            elif "lm_head" in name:
                p.copy_(noise * logit_scale)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))
    return model


@functools.cache
def shared_hf(**kwargs):
    """tiny_hf(**kwargs), built once per process and shared: read it, never change it (tests that move or convert a
    transformers model build their own with tiny_hf)."""
    return tiny_hf(**kwargs)


@functools.cache
def tiny_model(**kwargs) -> LlamaForCausalLM:
    """Our LlamaForCausalLM of shared_hf(**kwargs), built once per process and shared: read it, never change it
    (checked at the end of the session: assert_shared_models_unchanged)."""
    return shared(LlamaForCausalLM.from_hf(shared_hf(**kwargs)))


def random_prompts(seed, lengths, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab, (n,), generator=g).tolist() for n in lengths]


def exact_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """softmax(logits / T) under transformers' masks (TopK then TopP, after the temperature), in float64."""
    scores = logits.double().unsqueeze(0)
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(-1)[0]


# --------------------------------------------------------------------------------------- the law of the first tokens

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


def law_target() -> LlamaForCausalLM:
    return tiny_model(**LAW_TARGET)


def law_draft() -> LlamaForCausalLM:
    return tiny_model(**LAW_DRAFT)


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


def chi_square_power(law: dict, n: int, df: int, alpha: float = 1e-3) -> float:
    """Power against the hardest 1% bias: 0.01 of probability mass moved between the two most likely
    sequences (the shift with the smallest noncentrality n * 0.01^2 * (1/p1 + 1/p2))."""
    p1, p2 = sorted(law.values())[-2:]
    noncentrality = n * 0.01 ** 2 * (1 / p1 + 1 / p2)
    critical = stats.chi2.ppf(1 - alpha, df)
    return float(stats.ncx2.sf(critical, df, noncentrality))


def sample_first_tokens(target, drafter, case: str, tree=None):
    """LAW_SAMPLES[case] requests of LAW_PROMPT (seeds 0, 1, ...), k = 2 fixed (or tree rounds of these settings):
    the counts of their first LAW_TOKENS tokens (a dict over every sequence, as the law), the exact law, and the
    acceptance rate."""
    temperature, top_k, top_p = LAW_CASES[case]
    law = exact_law(temperature, top_k, top_p)
    per_call = 5000
    dec = SpeculativeDecoder(target, drafter, 2, adaptive=False, max_batch_size=per_call, tree=tree)
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


def assert_law(counts: dict, law: dict) -> None:
    """Chi-square of the counts against the law (cells expected < 5 pooled), p > 1e-3, with the test's power
    against the hardest 1% bias at this many samples checked to be >= 0.9; no sequence of probability 0 emitted."""
    assert sum(counts[s] for s, p in law.items() if p == 0) == 0, "a sequence of probability 0 was emitted"
    samples = sum(counts.values())
    expected = {s: p * samples for s, p in law.items() if p > 0}
    big = [s for s, e in expected.items() if e >= 5]
    observed = [counts[s] for s in big] + [sum(counts[s] for s in expected if s not in big)]
    cells = [expected[s] for s in big] + [sum(e for s, e in expected.items() if s not in big)]
    if cells[-1] == 0:
        observed, cells = observed[:-1], cells[:-1]
    assert chi_square_power(law, samples, len(cells) - 1) >= 0.9
    assert stats.chisquare(observed, cells).pvalue > 1e-3


# ----------------------------------------------------------------------------------------------------- KV caches

def record_paths(monkeypatch) -> list:
    """Wraps the decoder's tree sampling op: returns the list that each round's accepted paths (node lists from the
    root) are appended to."""
    from specdec_ext.engine import rounds

    paths = []
    op = rounds.tree_speculative_sampling_from_logits

    def recording(*args, **kwargs):
        out = op(*args, **kwargs)
        paths.extend(nodes[:a + 1] for nodes, a in zip(out.accepted_nodes.tolist(), out.num_accepted.tolist()))
        return out

    monkeypatch.setattr(rounds, "tree_speculative_sampling_from_logits", recording)
    return paths


def fresh_cache_rows(model, tokens, paged):
    """K/V of every layer for `tokens`, from a prefill into a fresh cache: [L, n, Hkv, D] each."""
    cache = model.new_kv_cache(1, len(tokens) + 1)
    model.prefill(cache, [0], [tokens])
    n = len(tokens)
    return cache.k[:, 0, :n], cache.v[:, 0, :n]


def cache_rows(cache, b, n):
    if cache.block_table is None:
        return cache.k[:, b, :n], cache.v[:, b, :n]
    pos = torch.arange(n)
    pages = cache.block_table[b, pos // cache.page_size].long()
    return cache.k[:, pages, pos % cache.page_size], cache.v[:, pages, pos % cache.page_size]


def assert_cache_holds(model, cache, b, tokens) -> None:
    """Request b's rows of `cache` hold the K and V of a fresh prefill of `tokens`, every layer."""
    k, v = cache_rows(cache, b, len(tokens))
    want_k, want_v = fresh_cache_rows(model, tokens, cache.block_table is not None)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v, want_v, rtol=1e-5, atol=1e-5)


class CacheCheck:
    """A `stream` callback for generate(): after every round, request r's target cache holds the K and V of a fresh
    prefill of its tokens but the last (which the next round feeds); more(r, tokens, n) checks what else a test needs
    (a drafter's cache). tokens: each request's prompt and what was streamed; rounds: (request, tokens emitted)."""

    def __init__(self, target, decoder, prompts, more=None):
        self.target, self.decoder, self.more = target, decoder, more
        self.prompts, self.tokens, self.rounds = prompts, [list(p) for p in prompts], []

    def __call__(self, r, new) -> None:
        self.tokens[r] += new
        n = int(self.decoder.cache.cache_seqlens[r])
        assert n == len(self.tokens[r]) - 1
        assert_cache_holds(self.target, self.decoder.cache, r, self.tokens[r][:n])
        if self.more is not None:
            self.more(r, self.tokens[r], n)
        self.rounds.append((r, len(new)))

    def generated(self) -> list:
        return [t[len(p):] for t, p in zip(self.tokens, self.prompts)]


# ------------------------------------------------------------------------------------------------------- draft heads

def random_vocab(vocab: int, size: int, seed: int) -> torch.Tensor:
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:size].sort().values


def random_medusa(target, vocab, num_heads, seed):
    heads = MedusaHeads(target, vocab, num_heads)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        heads.weight.copy_(torch.randn(heads.weight.shape, generator=g) / heads.weight.shape[-1] ** 0.5)
        heads.bias.copy_(torch.randn(heads.bias.shape, generator=g) * 0.1)
    return heads


def make_drafter(name, target, vocab, seed=0):
    if name == "eagle":
        return EagleDrafter(target, EagleHead(target, vocab).init_weights(torch.Generator().manual_seed(seed)))
    return MedusaDrafter(target, random_medusa(target, vocab, 4, seed))


# ----------------------------------------------------- transformers models of every supported architecture (loaders)

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
LINEAR = {"rope_type": "linear", "factor": 2.5}
# name -> (architecture, num_attention_heads, num_key_value_heads, tie_word_embeddings, rope_scaling)
ARCH_CASES = {
    "llama-mha-untied": ("llama", 4, 4, False, None),
    "llama-gqa2-tied": ("llama", 4, 2, True, None),
    "llama-gqa4-llama3": ("llama", 4, 1, False, LLAMA3),
    "llama-gqa2-linear-tied": ("llama", 8, 4, True, LINEAR),
    "qwen2-gqa2": ("qwen2", 4, 2, False, None),
    "qwen2-gqa4-tied": ("qwen2", 4, 1, True, None),
    "mistral-gqa2": ("mistral", 4, 2, False, None),
}


ARCH_CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
}


def seed_of(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def randomize(model, seed: int):
    """Every parameter distinct random data (norm weights around 1, biases non-zero), so a swapped, dropped or
    mis-scaled tensor shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1 + 0.3 * noise)
            elif name.endswith("bias"):
                p.copy_(0.5 * noise)
            elif "embed_tokens" in name and not model.config.tie_word_embeddings:
                p.copy_(0.01 * noise)  # small, as in trained models: rms_norm's eps then matters
            elif "embed_tokens" in name:  # a tied head: kept at unit scale, or bf16 logits lose precision
                p.copy_(noise)
            elif "lm_head" in name:
                p.copy_(noise)
            else:  # linear layers: outputs of half the input's scale (bf16's rounding then stays near 1%)
                p.copy_(0.5 * noise / math.sqrt(p.shape[-1]))
    return model


def arch_hf(arch="llama", heads=4, kv_heads=2, tie=False, rope_scaling=None, *, seed=0, head_dim=None,
            hidden=64, **extra):
    """A tiny random transformers model; its shapes that the case does not fix come from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    config_class, model_class = ARCH_CLASSES[arch]
    kwargs = dict(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, tie_word_embeddings=tie, max_position_embeddings=512,
                  intermediate_size=int(torch.randint(64, 161, (1,), generator=g)),
                  rms_norm_eps=float(torch.tensor([1e-6, 1e-5])[torch.randint(2, (1,), generator=g)]),
                  attn_implementation="eager")
    rope_theta = float(torch.tensor([500.0, 10000.0, 50000.0])[torch.randint(3, (1,), generator=g)])
    kwargs["rope_parameters"] = dict(rope_scaling or {"rope_type": "default"}, rope_theta=rope_theta)
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    if arch == "mistral":
        kwargs["sliding_window"] = None
    kwargs.update(extra)
    config = config_class(**kwargs)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_class(config).eval()
    return randomize(model, seed + 1)


def hf_case(name):
    arch, heads, kv_heads, tie, rope = ARCH_CASES[name]
    return arch_hf(arch, heads, kv_heads, tie, rope, seed=seed_of(name))


def save_hf(hf, path, edit=None):
    """hf saved as a safetensors directory at path, its config.json changed by edit(config) if given."""
    hf.save_pretrained(path, safe_serialization=True)
    if edit is not None:
        config = json.loads((path / "config.json").read_text())
        edit(config)
        (path / "config.json").write_text(json.dumps(config))
    return path


@functools.cache
def shipped_model():
    """The shipped SmolLM2-135M-Instruct (float32) and its tokenizer, loaded once per process and shared: read them,
    never change them."""
    path = default_model_path()
    return shared(LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)), load_tokenizer(path)


# ----------------------------------------------------------------------- GGUF files written as llama.cpp writes them

SMALL = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
# Hugging Face names -> GGUF names, written out here independently of the loader's own table.
GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
GGUF_BLOCK_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf_name):
    if hf_name in GGUF_NAMES:
        return GGUF_NAMES[hf_name]
    _, _, layer, *module, suffix = hf_name.split(".")  # model.layers.{i}.<module>.{weight,bias}
    return f"blk.{layer}.{GGUF_BLOCK_NAMES['.'.join(module)]}.{suffix}"


def llama_cpp_permute(w, n_head):
    """llama.cpp convert_hf_to_gguf's LlamaModel.permute (q/k rows into its rotary layout)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_model(model_class, config):
    """A model whose every parameter (norms too) is distinct random data, so a swapped tensor shows."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = model_class(config).eval()
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(torch.randn(param.shape) * 0.1)
    return model


def write_gguf(path, model, arch, weight_type=QType.F32, *, extra_tensors=(), tensor_types=None,
               extra_metadata=None):
    """Write `model` as llama.cpp's converter would: its metadata keys, tensor names and q/k permutation.

    2-D weights are stored as `weight_type`, 1-D tensors (norms, biases) as F32, like llama.cpp does;
    `tensor_types` overrides the type of single GGUF tensors, `extra_tensors` adds (name, array) pairs.
    """
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"tok{i}" for i in range(config.vocab_size)])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    for key, value in (extra_metadata or {}).items():
        getattr(writer, key)(value)

    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # llama.cpp writes no output tensor for a tied head
        name = gguf_name(hf_name)
        data = tensor.float().numpy()
        if arch == "llama" and ".attn_q." in name:
            data = llama_cpp_permute(data, config.num_attention_heads)
        elif arch == "llama" and ".attn_k." in name:
            data = llama_cpp_permute(data, config.num_key_value_heads)
        qtype = (tensor_types or {}).get(name, weight_type if data.ndim == 2 else QType.F32)
        if qtype == QType.F32:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    for name, data in extra_tensors:
        writer.add_tensor(name, data)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ------------------------------------------------------------------ inputs of the sampling ops, and their chi-square

def make_chain_inputs(gen, batch, k, vocab, dtype=torch.float32, with_draft=True, sharpness=2.0):
    """Correlated target and draft logits (so that drafts are often, not always, accepted), their
    probabilities, and draft tokens sampled from the draft distribution."""
    base = torch.randn(batch, k + 1, vocab, generator=gen) * sharpness
    target_logits = base
    draft_logits = base[:, :k] + 0.7 * torch.randn(batch, k, vocab, generator=gen)
    target_probs = torch.softmax(target_logits, -1)
    draft_probs = torch.softmax(draft_logits, -1)
    ids = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=gen).reshape(batch, k).int()
    return {
        "ids": ids,
        "target_probs": target_probs.to(dtype),
        "draft_probs": draft_probs.to(dtype) if with_draft else None,
        "target_logits": target_logits.to(dtype),
        "draft_logits": draft_logits.to(dtype) if with_draft else None,
        "num_draft_tokens": torch.randint(0, k + 1, (batch,), generator=gen, dtype=torch.int32),
        "seed": torch.randint(-(2**63), 2**63 - 1, (batch,), generator=gen),
        "offset": torch.randint(0, 2**40, (batch,), generator=gen),
    }


def misaligned_copy(t):
    """The same values in rows that start one element past a 16-byte boundary (the kernels' scalar path)."""
    if t is None:
        return None
    padded = torch.empty(*t.shape[:-1], t.shape[-1] + 1, dtype=t.dtype)
    padded[..., 1:] = t
    return padded[..., 1:]


def dirichlet(gen, *shape, concentration=1.0):
    g = torch.distributions.Gamma(torch.full(shape, concentration, dtype=torch.float64), 1.0)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    x = g.sample()
    return x / x.sum(-1, keepdim=True)


def chi_square_pvalue(counts, expected_probs, min_expected=5.0):
    """Pearson chi-square of count rows against probability rows (pooled); cells with too small an
    expectation are merged into one per row."""
    stat, dof = 0.0, 0
    for c, p in zip(counts, expected_probs):
        n = c.sum()
        if n == 0:
            continue
        e = n * p
        small = e < min_expected
        obs = torch.cat([c[~small], c[small].sum().reshape(1)]) if small.any() else c
        exp = torch.cat([e[~small], e[small].sum().reshape(1)]) if small.any() else e
        keep = exp > 0
        stat += float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
        dof += int(keep.sum()) - 1
    return stats.chi2.sf(stat, dof), dof


# ------------------------------------------------------------------------------------------------------------- trees

def random_trees(gen, batch, n, vocab, branching, depth):
    """[B, n] parents and candidate tokens of random trees: node c's parent is a random earlier node with fewer
    than `branching` children and depth below `depth`; siblings' tokens are distinct. Returns parents, tokens
    and the number of nodes each tree got (<= n)."""
    parents = torch.full((batch, n), -1, dtype=torch.int32)
    tokens = torch.randint(0, vocab, (batch, n), generator=gen, dtype=torch.int32)
    num_nodes = torch.ones(batch, dtype=torch.int32)
    for b in range(batch):
        node_depth, kids = [0], [[]]
        for c in range(1, n):
            open_ = [i for i in range(c) if len(kids[i]) < min(branching, vocab) and node_depth[i] < depth]
            if not open_:
                break
            p = open_[int(torch.randint(0, len(open_), (1,), generator=gen))]
            used = {int(tokens[b, k]) for k in kids[p]}
            free = [v for v in range(vocab) if v not in used] if vocab <= 64 else None
            x = free[int(torch.randint(0, len(free), (1,), generator=gen))] if free is not None else int(tokens[b, c])
            while x in used:
                x = int(torch.randint(0, vocab, (1,), generator=gen))
            parents[b, c], tokens[b, c] = p, x
            kids[p].append(c)
            kids.append([])
            node_depth.append(node_depth[p] + 1)
            num_nodes[b] = c + 1
    return parents, tokens, num_nodes


def make_tree_inputs(gen, batch, n, vocab, dtype=torch.float32, with_draft=True, branching=3, depth=4, sharpness=2.0,
                     ragged=True):
    parents, tokens, full = random_trees(gen, batch, n, vocab, branching, depth)
    num_nodes = torch.minimum(full, torch.randint(1, n + 1, (batch,), generator=gen, dtype=torch.int32)) if ragged \
        else full
    base = torch.randn(batch, n, vocab, generator=gen) * sharpness
    # Candidates are often, not always, the target's likely tokens: raise each node's token in its parent's row.
    rows = torch.arange(batch).unsqueeze(-1)
    base[rows, parents.long().clamp_min(0), tokens.long()] += torch.where(parents >= 0, 2.0, 0.0)
    draft = base + 0.7 * torch.randn(batch, n, vocab, generator=gen)
    return {
        "parents": parents, "tokens": tokens, "num_nodes": num_nodes,
        "target_logits": base.to(dtype), "draft_logits": draft.to(dtype) if with_draft else None,
        "target_probs": torch.softmax(base, -1).to(dtype),
        "draft_probs": torch.softmax(draft, -1).to(dtype) if with_draft else None,
        "seed": torch.randint(-(2**63), 2**63 - 1, (batch,), generator=gen),
        "offset": torch.randint(0, 2**40, (batch,), generator=gen),
    }


# -------------------------------------------------------------------------------------------------- verify_attention

# verify_attention's bound on the relative error against the float64 reference, by dtype
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def rel_error(out, ref):
    return float((out.double() - ref).norm() / ref.norm())


def random_tree_mask(gen, n_q):
    """A valid token tree: each node's parent is an earlier node; a node sees itself and its ancestors."""
    mask = torch.zeros(n_q, n_q, dtype=torch.bool)
    for i in range(n_q):
        mask[i, i] = True
        if i > 0:
            parent = int(torch.randint(0, i, (1,), generator=gen))
            mask[i] |= mask[parent]
    return mask


# ---------------------------------------------------------- the sampling ops' engine layouts (padded and flat twins)

def ragged_batch(gen, batch, max_k, vocab, dtype=torch.float32, sharpness=3.0, zero_rows=True, full=False):
    """A padded batch with ragged counts (k = 0 rows included; every count max_k with full) and its flat twin over the
    same rows."""
    counts = torch.randint(0, max_k + 1, (batch,), generator=gen, dtype=torch.int32)
    if full:
        counts.fill_(max_k)
    elif zero_rows:
        counts[0] = 0
    base = torch.randn(batch, max_k + 1, vocab, generator=gen) * sharpness
    draft_logits = base[:, :max_k] + 0.7 * torch.randn(batch, max_k, vocab, generator=gen)
    target_logits = base
    draft_probs = torch.softmax(draft_logits, -1)
    ids = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=gen).reshape(batch, max_k).int() \
        if max_k else torch.zeros(batch, 0, dtype=torch.int32)
    # Half the drafts are the target's argmax, so that point proposals are accepted too.
    take_best = torch.rand(batch, max_k, generator=gen) < 0.5
    ids = torch.where(take_best, target_logits[:, :max_k].argmax(-1).int(), ids)
    # Poison what the padded form must not read: drafts past each count.
    pad = torch.arange(max_k) >= counts.unsqueeze(-1)
    ids = torch.where(pad, torch.full_like(ids, 10**6), ids)
    padded = {
        "ids": ids, "num_draft_tokens": counts,
        "target_probs": torch.softmax(target_logits, -1).to(dtype), "draft_probs": draft_probs.to(dtype),
        "target_logits": target_logits.to(dtype), "draft_logits": draft_logits.to(dtype),
        "uniforms": torch.rand(batch, max_k, generator=gen), "final_uniforms": torch.rand(batch, generator=gen),
        "bonus": torch.randint(0, vocab, (batch,), generator=gen, dtype=torch.int64),
        "seed": torch.randint(-(2**62), 2**62, (batch,), generator=gen),
        "offset": torch.randint(0, 2**40, (batch,), generator=gen),
    }
    flat = {"cu": counts.cumsum(0).int(), "ids": torch.cat([ids[b, :counts[b]] for b in range(batch)])}
    for kind in ("probs", "logits"):
        t, d = padded[f"target_{kind}"], padded[f"draft_{kind}"]
        flat[f"target_{kind}"] = torch.cat([t[b, :counts[b] + 1] for b in range(batch)])  # k_b rows, then the bonus row
        flat[f"target_{kind}_nobonus"] = torch.cat([t[b, :counts[b]] for b in range(batch)])
        flat[f"draft_{kind}"] = torch.cat([d[b, :counts[b]] for b in range(batch)])
    flat["uniforms"] = torch.cat([padded["uniforms"][b, :counts[b]] for b in range(batch)])
    return padded, flat


def reduced_vocab(gen, vocab, draft_vocab):
    return torch.randperm(vocab, generator=gen)[:draft_vocab].int()


def scatter_full(rows, draft_to_target, vocab, logits):
    full = rows.new_full((*rows.shape[:-1], vocab), float("-inf") if logits else 0.0)
    full[..., draft_to_target.long()] = rows
    return full


def padded_and_flat_trees(gen, batch, max_nodes, vocab, dtype=torch.float32):
    """Padded random trees with ragged node counts (a lone root included), rows favouring the candidates, and the flat
    twin (request b's nodes from cu[b-1] + b)."""
    counts = torch.randint(1, max_nodes + 1, (batch,), generator=gen, dtype=torch.int32)
    counts[0] = 1
    parents = torch.full((batch, max_nodes), -1, dtype=torch.int32)
    cand = torch.zeros(batch, max_nodes, dtype=torch.int32)
    for b in range(batch):
        for c in range(1, int(counts[b])):  # mostly a chain, with branches
            deep = bool(torch.rand(1, generator=gen) < 0.6)
            parents[b, c] = c - 1 if deep else int(torch.randint(0, c, (1,), generator=gen))
        cand[b] = torch.randperm(vocab, generator=gen)[:max_nodes].int()  # distinct: siblings never repeat
    logits = torch.randn(batch, max_nodes, vocab, generator=gen) * 2
    for b in range(batch):  # each node's target favours its first child, so that paths go deep
        seen = set()
        for c in range(1, int(counts[b])):
            p = int(parents[b, c])
            logits[b, p, cand[b, c]] += 2.0 if p in seen else 9.0
            seen.add(p)
    draft = logits + 0.5 * torch.randn(batch, max_nodes, vocab, generator=gen)
    padded = {"parents": parents, "cand": cand, "num_nodes": counts, "target_logits": logits.to(dtype),
              "draft_logits": draft.to(dtype), "target_probs": torch.softmax(logits, -1).to(dtype),
              "draft_probs": torch.softmax(draft, -1).to(dtype), "uniforms": torch.rand(batch, max_nodes, generator=gen)}
    flat = {"cu": (counts - 1).cumsum(0).int()}
    for key in ("parents", "cand", "target_logits", "draft_logits", "target_probs", "draft_probs", "uniforms"):
        flat[key] = torch.cat([padded[key][b, :counts[b]] for b in range(batch)])
    return padded, flat


# ----------------------------------------------------------------------------------------------- the FlashInfer shim

# ----- chain_speculative_sampling -----------------------------------------------------------------------------------
def documented_example(device="cpu"):
    """FlashInfer's docstring example: draft 2 passes (p = 0.6 >= q = 0.3), draft 1 fails (p = 0), and the residual
    max(0, p - q) of position 1 has all its mass on token 0: [[2, 0, -1]] with one draft accepted and one emitted,
    whatever the random draws."""
    draft = torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.2, 0.3, 0.4, 0.1]]], device=device)
    ids = torch.tensor([[2, 1]], dtype=torch.int32, device=device)
    target = torch.tensor([[[0.0, 0.1, 0.6, 0.3], [1.0, 0.0, 0.0, 0.0], [0.7, 0.1, 0.1, 0.1]]], device=device)
    return draft, ids, target


DOCUMENTED_OUTPUT = [[2, 0, -1]]  # the documented example's output


def flashinfer_case(gen, batch, k, vocab, onehot, device="cpu"):
    """FlashInfer's test inputs: normalised uniform draft rows, uniform draft ids; targets normalised uniform, or
    one-hot at the drafts followed by a uniform bonus id. Returns (draft, ids, target, target_ids or None)."""
    draft = torch.rand(batch, k, vocab, generator=gen)
    draft /= draft.sum(-1, keepdim=True)
    ids = torch.randint(0, vocab, (batch, k), generator=gen, dtype=torch.int32)
    target_ids = None
    if onehot:
        target_ids = torch.cat([ids, torch.randint(0, vocab, (batch, 1), generator=gen, dtype=torch.int32)], 1)
        target = torch.zeros(batch, k + 1, vocab).scatter_(2, target_ids.long().unsqueeze(-1), 1.0)
    else:
        target = torch.rand(batch, k + 1, vocab, generator=gen)
        target /= target.sum(-1, keepdim=True)
    to = lambda t: None if t is None else t.to(device)
    return to(draft), to(ids), to(target), to(target_ids)


def check_flashinfer_statement(out, accepted, emitted, ids, vocab, target_ids):
    """FlashInfer's test of chain_speculative_sampling, plus what its docstring promises about the counts."""
    batch, k = ids.shape
    assert out.dtype == torch.int32 and tuple(out.shape) == (batch, k + 1)
    if target_ids is not None:  # every draft has target mass 1: all pass, and the bonus is the target's one-hot id
        assert torch.equal(out, target_ids)
        assert torch.equal(emitted.long(), torch.full((batch,), k)) and torch.equal(accepted.long(), emitted.long())
    valid = out >= 0
    assert torch.all(out[valid] < vocab) and torch.all(out[~valid] == -1)
    mismatch = out[:, :-1] != ids
    for row in range(batch):
        where = mismatch[row].nonzero().flatten()
        if len(where):
            assert torch.all(where[1:] == where[:-1] + 1)  # the mismatches are contiguous
            assert torch.all(out[row, where[0] + 1:] == -1)  # and -1 from the one after the first
    assert torch.equal(emitted.long() + 1, valid.sum(1))
    assert torch.all(emitted <= accepted) and torch.all(accepted <= k)
    keep = torch.arange(k).unsqueeze(0) < emitted.long().unsqueeze(1)
    assert torch.equal(torch.where(keep, out[:, :k], -1), torch.where(keep, ids, -1))  # the emitted drafts verbatim


# ----- BatchPrefillWithPagedKVCacheWrapper --------------------------------------------------------------------------
def paged_batch(gen, qo_lens, prefix_lens, page_size, hq, hkv, d, dtype, layout, spare_pages=3):
    """A batch in FlashInfer's paged layout: one cache tensor [pages, 2, ...], each request's pages scattered at
    random, its KV (prefix + the qo_len new tokens) filling the last page partly or fully, and the CSR table."""
    kv_lens = [p + n for p, n in zip(prefix_lens, qo_lens)]
    pages = [-(-s // page_size) for s in kv_lens]
    num_pages = sum(pages) + spare_pages
    shape = (num_pages, 2, page_size, hkv, d) if layout == "NHD" else (num_pages, 2, hkv, page_size, d)
    cache = torch.randn(shape, generator=gen).to(dtype)
    indices = torch.randperm(num_pages, generator=gen)[:sum(pages)].int()
    kv_indptr = torch.tensor([0] + pages).cumsum(0).int()
    last = torch.tensor([s - (p - 1) * page_size if p else 0 for s, p in zip(kv_lens, pages)], dtype=torch.int32)
    qo_indptr = torch.tensor([0] + list(qo_lens)).cumsum(0).int()
    q = torch.randn(sum(qo_lens), hq, d, generator=gen).to(dtype)
    return q, cache, qo_indptr, kv_indptr, indices, last, kv_lens


def flashinfer_masks(gen, kind, qo_lens, kv_lens):
    """Per request the [qo_len, kv_len] bool mask FlashInfer's kernel applies (True: visible): causal aligned to the
    end of the KV, full, or a token tree over the new tokens with the prefix visible."""
    masks = []
    for n, s in zip(qo_lens, kv_lens):
        if kind == "causal":
            masks.append(torch.arange(s).unsqueeze(0) <= (s - n + torch.arange(n)).unsqueeze(1))
        elif kind == "full":
            masks.append(torch.ones(n, s, dtype=torch.bool))
        else:
            masks.append(torch.cat([torch.ones(n, s - n, dtype=torch.bool), random_tree_mask(gen, n)], 1))
    return masks


def pack_segments(masks):
    """FlashInfer's packed custom mask, written out here: each request's flattened bits from a byte boundary, bit j
    of a byte = element j."""
    out = []
    for m in masks:
        bits = m.reshape(-1).to(torch.int64)
        bits = torch.cat([bits, bits.new_zeros(-bits.numel() % 8)]).view(-1, 8)
        out.append((bits << torch.arange(8)).sum(1).to(torch.uint8))
    return torch.cat(out + [torch.zeros(0, dtype=torch.uint8)])


def reference_attention(q, cache, layout, qo_indptr, kv_indptr, indices, masks, page_size, scale=None, window_left=-1,
                        soft_cap=0.0):
    """float64 attention of each request's queries against the KV gathered from its pages with FlashInfer's masks
    (masks[b]: [qo_len, kv_len]); returns out [T, Hq, D] and the log-sum-exp in base 2 [T, Hq]."""
    t, hq, d = q.shape
    scale = d**-0.5 if scale is None else scale
    out = torch.zeros(t, hq, d, dtype=torch.float64)
    lse = torch.full((t, hq), float("-inf"), dtype=torch.float64)
    for b, mask in enumerate(masks):
        r0, (n, s) = int(qo_indptr[b]), mask.shape
        if n == 0:
            continue
        pos = torch.arange(s)
        page = indices[int(kv_indptr[b]) + pos // page_size].long()
        kv = cache[page, :, pos % page_size] if layout == "NHD" else cache[page, :, :, pos % page_size]
        k, v = (kv[:, j].double().repeat_interleave(hq // kv.shape[-2], 1) for j in (0, 1))  # [S, Hq, D]
        scores = torch.einsum("qhd,shd->hqs", q[r0:r0 + n].double(), k) * scale
        if soft_cap > 0:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        visible = mask.clone()
        if window_left >= 0:
            visible &= pos.unsqueeze(0) >= (s - n + torch.arange(n)).unsqueeze(1) - window_left
        scores = scores.masked_fill(~visible, float("-inf"))
        out[r0:r0 + n] = torch.einsum("hqs,shd->qhd", torch.softmax(scores, -1), v)
        lse[r0:r0 + n] = (torch.logsumexp(scores, -1) / math.log(2)).transpose(0, 1)
    return out, lse


def plan_and_run(wrapper, batch, page_size, hq, hkv, mask_kind, masks, **plan_kwargs):
    """plan() with FlashInfer's mask arguments for mask_kind, then run() into NaN-poisoned out / lse buffers."""
    q, cache, qo_indptr, kv_indptr, indices, last = batch
    mask_args = {"causal": {"causal": True}, "full": {},
                 "custom": {"custom_mask": torch.cat([m.reshape(-1) for m in masks])},
                 "packed": {"packed_custom_mask": pack_segments(masks)}}[mask_kind]
    wrapper.plan(qo_indptr, kv_indptr, indices, last, hq, hkv, q.shape[-1], page_size, **mask_args, **plan_kwargs)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=q.device)
    got, got_lse = wrapper.run(q, cache, out=out, lse=lse, return_lse=True)
    assert got is out and got_lse is lse
    return out, lse


# --------------------------------------------------------------------------------------------------- the SGLang shim

POISON = -77


def sglang_buffers(batch, steps, size, device="cpu"):
    """Poisoned output buffers: what the shim must write (or leave) is then visible."""
    poisoned = functools.partial(torch.full, fill_value=POISON, dtype=torch.int32, device=device)
    return poisoned((size,)), poisoned((batch, steps)), poisoned((batch,))


def sglang_kernel_case():
    """The two requests of six nodes of sgl-kernel's tests/speculative/test_speculative_sampling.py, re-typed as
    data: request 0 is root -> {1 -> 2, 3 -> 4 -> 5}, request 1 is root -> {4 -> 5, 1 -> 2 -> 3} (its siblings
    listed out of index order); the target (temperature 0.01) all but certainly follows 0 -> 3 -> 4 -> 5 and
    0 -> 4 -> 5, and elsewhere emits token 18."""
    tree = dict(candidates=torch.tensor([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]]),
                retrive_index=torch.tensor([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]),
                retrive_next_token=torch.tensor([[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]]),
                retrive_next_sibling=torch.tensor([[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]]))
    logits = torch.full((2, 6, 20), 1.0)
    for b, n, v in ((0, 0, 3), (0, 3, 4), (0, 4, 5), (1, 0, 11), (1, 4, 12)):
        logits[b, n, v] = 10.0
    logits[logits.amax(-1) < 10.0] = torch.where(torch.arange(20) == 18, 10.0, 1.0)
    return tree, torch.softmax(logits / 0.01, -1)


SGLANG_EXPECTED = dict(predicts=[3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18],
                       accept_index=[[0, 3, 4, 5], [6, 10, 11, -1]], accept_token_num=[3, 2])


def sglang_sample(tree, target, coins, final, steps, size, draft=None, **kw):
    """sglang.tree_speculative_sampling_target_only into poisoned buffers: (predicts, accept_index,
    accept_token_num)."""
    predicts, accept_index, accept_token_num = sglang_buffers(target.shape[0], steps, size, target.device)
    sglang.tree_speculative_sampling_target_only(predicts, accept_index, accept_token_num, uniform_samples=coins,
                                                 uniform_samples_for_final_sampling=final, target_probs=target,
                                                 draft_probs=draft, **tree, **kw)
    return predicts, accept_index, accept_token_num


def sglang_greedy(tree, target_predict, steps, size):
    """sglang.verify_tree_greedy into poisoned buffers: (predicts, accept_index, accept_token_num)."""
    predicts, accept_index, accept_token_num = sglang_buffers(target_predict.shape[0], steps, size,
                                                                      target_predict.device)
    sglang.verify_tree_greedy(predicts, accept_index, accept_token_num, target_predict=target_predict, **tree)
    return predicts, accept_index, accept_token_num


def random_lcrs(gen, batch, n, vocab, shuffle):
    """Random trees in SGLang's form, ragged (padding nodes at the end), siblings in random list order; with
    shuffle, node numbers permuted (children may come before parents; the padding lands anywhere)."""
    nt = torch.full((batch, n), -1, dtype=torch.long)
    ns = torch.full((batch, n), -1, dtype=torch.long)
    cand = torch.zeros(batch, n, dtype=torch.long)
    for b in range(batch):
        size = int(torch.randint(1, n + 1, (1,), generator=gen))
        order = torch.randperm(n, generator=gen).tolist() if shuffle else list(range(n))
        order.remove(0)
        order = [0] + order  # node numbers of the tree's 0th, 1st, ... node
        parents = [None] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, size)]
        # distinct tokens when the vocabulary allows (the op's trees need distinct siblings; greedy takes repeats)
        cand[b] = torch.randperm(vocab, generator=gen)[:n] if vocab >= n else torch.randint(0, vocab, (n,), generator=gen)
        for i in range(1, size):  # push front or back of the parent's list at random
            p, me = order[parents[i]], order[i]
            if nt[b, p] == -1 or bool(torch.rand(1, generator=gen) < 0.5):
                ns[b, me], nt[b, p] = nt[b, p], me
            else:
                last = int(nt[b, p])
                while ns[b, last] != -1:
                    last = int(ns[b, last])
                ns[b, last] = me
    ri = torch.arange(batch).unsqueeze(-1) * n + torch.arange(n)
    return dict(candidates=cand, retrive_index=ri, retrive_next_token=nt, retrive_next_sibling=ns)


def first_two_law_batch(gen, trials, sampled):
    """A fixed target over V = 6 tokens: p1 at the root, p2[t] after token t; the tree: root -> nodes 1, 2, 3 (tokens
    distinct), node 1 -> nodes 4, 5. Point proposals: fixed tokens; sampled: each node's children drawn without
    replacement from its draft row, in sibling order (q1 at the root, q2[t] after token t)."""
    vocab = 6
    p1 = torch.softmax(torch.randn(vocab, generator=gen), 0)
    p2 = torch.softmax(torch.randn(vocab, vocab, generator=gen) * 0.8, -1)
    q1 = torch.softmax(torch.randn(vocab, generator=gen), 0)
    q2 = torch.softmax(torch.randn(vocab, vocab, generator=gen), -1)
    if sampled:  # Gumbel top-k: distinct draws, in the order of drawing without replacement
        first = (q1.log() - torch.empty(trials, vocab).exponential_(generator=gen).log()).topk(3, -1).indices
        second = (q2[first[:, 0]].log() - torch.empty(trials, vocab).exponential_(generator=gen).log()).topk(2, -1).indices
    else:
        first, second = torch.tensor([[2, 0, 5]]).expand(trials, 3), torch.tensor([[1, 4]]).expand(trials, 2)
    cand = torch.cat([torch.zeros(trials, 1, dtype=torch.long), first, second], 1)
    rows = torch.stack([p1.expand(trials, vocab)] + [p2[cand[:, c]] for c in (1, 2, 3)] +
                       [torch.full((trials, vocab), 1.0 / vocab)] * 2, 1)
    draft = torch.stack([q1.expand(trials, vocab), q2[cand[:, 1]]] + [torch.full((trials, vocab), 1.0 / vocab)] * 4, 1)
    tree = dict(candidates=cand, retrive_index=torch.arange(trials * 6).reshape(trials, 6),
                retrive_next_token=torch.tensor([[1, 4, -1, -1, -1, -1]]).expand(trials, 6),
                retrive_next_sibling=torch.tensor([[-1, 2, 3, -1, 5, -1]]).expand(trials, 6))
    return tree, rows, draft if sampled else None, p1, p2


# --------------------------------------------------------- the vLLM shim (its CPU tests, rerun by tests/gpu on CUDA)

P = vllm_shim.PLACEHOLDER_TOKEN_ID  # what vLLM writes in a row's unused slots


def on(backend):
    """An engine shim's backend for a block: specdec_ext's own kernels (chosen by the tensors' device), or ("sim")
    the CUDA kernels' source under the emulator."""
    return compat.emulated() if backend == "sim" else contextlib.nullcontext()


def sampling_metadata(temperature=None, generators=None, top_k=None, top_p=None, device="cpu", **extra):
    """The fields of vLLM's SamplingMetadata the shim reads. temperature None: an all-greedy batch (vLLM then passes
    no temperature); otherwise greedy rows are marked by a temperature of 0 (or -1, older vLLM)."""
    t = None if temperature is None else torch.tensor(temperature, dtype=torch.float32, device=device)
    greedy = torch.ones(1, dtype=torch.bool) if t is None else t < 1e-5
    fields = dict(temperature=t, all_greedy=bool(greedy.all()), all_random=not bool(greedy.any()),
                  generators=generators or {}, top_k=top_k, top_p=top_p, max_num_logprobs=None, no_penalties=True,
                  bad_words_token_ids={}, allowed_token_ids_mask=None)
    fields.update(extra)
    return types.SimpleNamespace(**fields)


def flat(drafts, device="cpu"):
    """vLLM's flat form of per-request draft lists: (draft_token_ids [T] int32, num_draft_tokens, max_spec_len,
    cu_num_draft_tokens [B] int32)."""
    counts = [len(d) for d in drafts]
    ids = torch.tensor([t for d in drafts for t in d], dtype=torch.int32, device=device)
    cu = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    return ids, counts, max(counts, default=0), cu


def argmax_rows(tokens, vocab, device="cpu"):
    """Target rows [T, V] whose argmax is tokens[i], with mass on every other token too (so a wrong draft has p > 0)."""
    probs = torch.ones(len(tokens), vocab)
    probs[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] = 4.0
    return (probs / probs.sum(-1, keepdim=True)).to(device)


def bonus_ids(tokens, device="cpu"):
    return torch.tensor(tokens, dtype=torch.int32, device=device).view(-1, 1)


# vLLM's own rejection sampler test cases, written out by hand: (drafts per request, the target argmax at each draft
# position, the bonus tokens, the expected output). A greedy row emits the drafts while they equal the argmax, then
# the argmax at the first mismatch, or the bonus token after the last draft (no drafts: the bonus alone).
GREEDY_CASES = {
    "perfect_match": ([[11, 12, 13]], [11, 12, 13], [14], [[11, 12, 13, 14]]),
    "early_mismatch_first": ([[11, 12, 13]], [20, 12, 13], [14], [[20, P, P, P]]),
    "early_mismatch_middle": ([[11, 12, 13]], [11, 21, 13], [14], [[11, 21, P, P]]),
    "multiple_sequences": ([[11, 12], [13]], [11, 12, 13], [15, 16], [[11, 12, 15], [13, 16, P]]),
    "single_token_sequence": ([[11]], [11], [12], [[11, 12]]),
    "single_token_mismatch": ([[11]], [22], [12], [[22, P]]),
    "empty_sequence": ([[]], [], [15], [[15]]),
    "multiple_mismatches": ([[1, 2, 3], [4, 5, 6]], [1, 2, 7, 4, 8, 6], [9, 10], [[1, 2, 7, P], [4, 8, P, P]]),
    "ragged_with_empty_drafts": ([[1, 2], [], [3, 4, 5], []], [1, 2, 3, 9, 5], [6, 7, 8, 10],
                                 [[1, 2, 6, P], [7, P, P, P], [3, 9, P, P], [10, P, P, P]]),
}


def greedy_call(drafts, argmaxes, bonus, vocab=64, device="cpu", metadata=None):
    ids, counts, k, cu = flat(drafts, device)
    return vllm_shim.rejection_sample(ids, counts, k, cu, None, argmax_rows(argmaxes, vocab, device),
                                      bonus_ids(bonus, device), metadata or sampling_metadata())


def check_greedy_case(backend, case, device):
    drafts, argmaxes, bonus, expected = GREEDY_CASES[case]
    marks = [0.0 if b % 2 else -1.0 for b in range(len(drafts))]
    with on(backend):
        out = greedy_call(drafts, argmaxes, bonus, device=device)
        # The same batch marked greedy row by row (temperature 0, and vLLM's older -1) in a mixed-mode batch.
        marked = greedy_call(drafts, argmaxes, bonus, device=device, metadata=sampling_metadata(marks, device=device))
    assert out.dtype == torch.int32
    assert out.tolist() == expected
    assert marked.tolist() == expected


def check_k32(backend, gen, device):
    k, vocab = 32, 500
    drafts = torch.randint(0, vocab, (2, k), generator=gen).tolist()
    wrong = (drafts[1][31] + 1) % vocab
    argmaxes = drafts[0] + drafts[1][:31] + [wrong]
    with on(backend):
        out = greedy_call(drafts, argmaxes, [7, 8], vocab, device)
        # Sampled rows whose target is one-hot at each draft accept every draft whatever the uniforms.
        ids, counts, width, cu = flat(drafts, device)
        one_hot = torch.zeros(2 * k, vocab, device=device)
        one_hot[torch.arange(2 * k), ids.long()] = 1.0
        sampled = vllm_shim.rejection_sample(ids, counts, width, cu, None, one_hot, bonus_ids([7, 8], device),
                                             sampling_metadata([1.0, 0.5], device=device))
    assert out.tolist() == [drafts[0] + [7], drafts[1][:31] + [wrong, P]]
    assert sampled.tolist() == [drafts[0] + [7], drafts[1] + [8]]


def dirichlet_rows(vocab, *shape):
    """Rows drawn from Dirichlet(2, ..., 2) with torch's default generator (the caller seeds it)."""
    return torch.distributions.Dirichlet(torch.full((vocab,), 2.0)).sample(shape)


def rows_chi_square_pvalue(counts, probs):
    """One test over the rows of counts [R, V] against probs [R, V]: the sum of the rows' statistics, sum of (V - 1)
    degrees of freedom over the rows that have samples."""
    counts, probs = counts.double(), probs.double()
    n = counts.sum(-1, keepdim=True)
    used = n.squeeze(-1) > 0
    expected = n * probs
    assert (expected[used] >= 5).all(), "too few samples per cell for the chi-square approximation"
    stat = ((counts - expected) ** 2 / expected)[used].sum().item()
    return stats.chi2.sf(stat, int(used.sum()) * (probs.shape[-1] - 1))


def markov_batch(n, vocab, seed):
    """n requests of k = 2 drafts with prefix-dependent rows: p0, q0 at position 0; p1[x0], q1[x0] at position 1, where
    x0 is the first draft; bonus tokens drawn from p2[x1]. Returns the flat call's arguments, p0 and p1."""
    torch.manual_seed(seed)
    p0, q0 = dirichlet_rows(vocab), dirichlet_rows(vocab)
    p1, q1, p2 = (dirichlet_rows(vocab, vocab) for _ in range(3))
    x0 = torch.multinomial(q0, n, replacement=True)
    x1 = torch.multinomial(q1[x0], 1).squeeze(-1)
    bonus = torch.multinomial(p2[x1], 1).int()
    ids = torch.stack([x0, x1], 1).reshape(-1).int()
    target = torch.stack([p0.expand(n, vocab), p1[x0]], 1).reshape(2 * n, vocab)
    draft = torch.stack([q0.expand(n, vocab), q1[x0]], 1).reshape(2 * n, vocab)
    cu = torch.arange(1, n + 1, dtype=torch.int32) * 2
    return (ids, [2] * n, 2, cu, draft, target, bonus), p0, p1


def check_emitted_tokens_follow_the_target(backend, n, with_draft, device):
    # Fixed seeds. Position 0 has n samples; with V = 6 and p ~ 1/6, moving 1% of probability between two tokens gives
    # a noncentrality of n * 2 * 0.01^2 / (1/6) = 0.0012 n = 240 at n = 200,000: power ~1 against the 1e-4 level
    # (critical value ~26 at 5 dof). Position 1, given an accepted first draft, is checked against p1[y0] row by row.
    # Under the emulator the same draws must give the CPU kernel's tokens bit for bit, so it inherits that power.
    vocab = 6
    (ids, counts, k, cu, draft, target, bonus), p0, p1 = markov_batch(n, vocab, seed=1234)
    on_device = [t.to(device) if isinstance(t, torch.Tensor) else t
                 for t in (ids, counts, k, cu, draft if with_draft else None, target, bonus)]
    meta = sampling_metadata([1.0] * n, device=device)
    torch.manual_seed(99)  # the unseeded requests' uniforms come from torch's default generator (every device's)
    with on(backend):
        out = vllm_shim.rejection_sample(*on_device, meta).cpu()
    if backend == "sim":
        torch.manual_seed(99)
        assert torch.equal(out, vllm_shim.rejection_sample(*on_device, meta))
        return
    y = out.long()
    assert ((y >= 0) & (y < vocab) | (y == P)).all() and (y[:, 0] >= 0).all()
    emitted = (y >= 0).sum(-1)  # accepted + 1
    assert (y[emitted == 3, 2] == bonus[emitted == 3, 0]).all(), "after every draft is accepted, the bonus token"
    assert ((emitted == 3) | (y[:, 2] == P)).all() and ((emitted >= 2) | (y[:, 1] == P)).all()
    assert rows_chi_square_pvalue(torch.bincount(y[:, 0], minlength=vocab).unsqueeze(0), p0.unsqueeze(0)) > 1e-4
    reached = emitted >= 2  # y0 was the accepted first draft
    assert (y[reached, 0] == ids.view(n, 2)[reached, 0].long()).all()
    counts1 = torch.zeros(vocab, vocab)
    counts1.index_put_((y[reached, 0], y[reached, 1]), torch.ones(int(reached.sum())), accumulate=True)
    assert rows_chi_square_pvalue(counts1, p1) > 1e-4
    assert 1000 < int((emitted == 3).sum()) < n - 1000, "the batch must mix acceptances and rejections"


def spread_batch(drafts, vocab, device="cpu"):
    """Target rows near uniform over V, point proposals: a draft is accepted with probability ~1/V, so a row's output
    is (almost surely) its recovered token at position 0, nearly uniform over the vocabulary."""
    ids, counts, k, cu = flat(drafts, device)
    gen = torch.Generator().manual_seed(5)
    target = torch.softmax(0.1 * torch.randn(ids.numel(), vocab, generator=gen), -1).to(device)
    return ids, counts, k, cu, None, target, bonus_ids(list(range(900, 900 + len(drafts))), device)


def seeded_call(args, seeds, global_seed, device="cpu", temperature=None):
    """The batch with generators for the requests in `seeds` (index -> seed) and torch's default generator reseeded."""
    generators = {b: torch.Generator(device=device).manual_seed(s) for b, s in seeds.items()}
    torch.manual_seed(global_seed)
    if device != "cpu":
        torch.cuda.manual_seed(global_seed)
    batch = len(args[1])
    meta = sampling_metadata(temperature or [1.0] * batch, generators, device=device)
    return vllm_shim.rejection_sample(*args, meta), generators


def check_deterministic_when_seeded(backend, device):
    vocab = 1000
    drafts = [[1, 2, 3, 4], [5, 6, 7, 8], [], [9, 10, 11, 12], [13]]
    args = spread_batch(drafts, vocab, device)
    # Request 3 is greedy; 0, 2 and 4 are seeded; 1 is not.
    temperature = [1.0, 1.0, 1.0, 0.0, 0.7]
    with on(backend):
        a, gens = seeded_call(args, {0: 5, 2: 6, 4: 8}, 100, device, temperature)
        b, _ = seeded_call(args, {0: 5, 2: 6, 4: 8}, 200, device, temperature)
        c, _ = seeded_call(args, {0: 7, 2: 6, 4: 9}, 100, device, temperature)
        # Request 4 alone: its draft (flat index 12), its target row and its bonus token.
        ids, _, _, _, _, target, bonus = args
        alone_args = (ids[12:], [1], 1, torch.ones(1, dtype=torch.int32, device=device), None, target[12:], bonus[4:])
        alone, _ = seeded_call(alone_args, {0: 8}, 300, device, [0.7])
    same = [0, 2, 3, 4]
    assert torch.equal(a[same], b[same]), "seeded rows (and greedy ones) do not depend on torch's default generator"
    assert not torch.equal(a[1], b[1]), "an unseeded row draws from torch's default generator"
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[4], c[4]), "another generator state, another output"
    assert torch.equal(a[2], c[2]) and a[2].tolist() == [902, P, P, P, P], "no drafts: the bonus token alone"
    assert torch.equal(alone[0], a[4, :2]) and (a[4, 2:] == P).all(), \
        "a seeded request's output does not depend on the rest of the batch"
    # Consumption: k uniforms then one per seeded request with drafts; none without drafts (vLLM's rule).
    replay = torch.Generator(device=device).manual_seed(5)
    torch.empty(4, device=device).uniform_(generator=replay)
    torch.empty(1, device=device).uniform_(generator=replay)
    assert torch.equal(gens[0].get_state(), replay.get_state())
    assert torch.equal(gens[2].get_state(), torch.Generator(device=device).manual_seed(6).get_state())


def check_mixed_greedy_and_random_batch(backend, device):
    vocab = 16
    drafts = [[3, 4], [3, 4], [3, 4], [3, 4]]
    ids, counts, k, cu = flat(drafts, device)
    # Row 0 of each request: the draft 3 has p = 0.45, the argmax 5 has 0.5. Row 1: one-hot at the draft.
    first = torch.full((vocab,), 0.05 / (vocab - 2))
    first[3], first[5] = 0.45, 0.5
    second = torch.zeros(vocab)
    second[4] = 1.0
    target = torch.stack([first, second] * 4).to(device)
    draft = target.clone()  # q == p: a sampled row accepts every draft
    temperature = [0.0, 0.9, -1.0, 1.0]  # greedy, sampled, greedy (older vLLM's marker), sampled
    outs = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        with on(backend):
            outs.append(vllm_shim.rejection_sample(ids, counts, k, cu, draft, target, bonus_ids([7, 8, 9, 10], device),
                                                   sampling_metadata(temperature, device=device)))
    for out in outs:
        assert out.tolist() == [[5, P, P], [3, 4, 8], [5, P, P], [3, 4, 10]]


def softmax64(logits, temperature):
    return torch.softmax(logits.double() / temperature, -1)


def processed_law(logits, temperature, top_k, top_p):
    """The law vLLM samples a draft position from, written out: softmax at the temperature, keep the top_k most
    likely tokens, renormalise, keep the shortest most-likely-first prefix whose mass reaches top_p, renormalise."""
    probs = softmax64(logits, temperature)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[order[:top_k]] = True
    kept = torch.where(keep, probs, 0.0)
    kept = kept / kept.sum()
    mass = kept[order].cumsum(0)
    prefix = int((mass < top_p - 1e-12).sum()) + 1
    final = torch.zeros_like(keep)
    final[order[:prefix]] = True
    law = torch.where(final & keep, probs, 0.0)
    return law / law.sum()


class BonusSampler:
    """Stands in for vLLM's Sampler: the argmax of each bonus row, recording how it was called."""

    def __init__(self):
        self.calls = []

    def __call__(self, *, logits, sampling_metadata, predict_bonus_token=False):
        self.calls.append((logits.shape, predict_bonus_token))
        return types.SimpleNamespace(sampled_token_ids=logits.argmax(-1, keepdim=True).int())


def spec_metadata(counts, draft_ids, device="cpu"):
    """vLLM's SpecDecodeMetadata for logits [T + B, V] laid out per request: its k_b draft rows, then its bonus row."""
    target_idx, bonus_idx, row = [], [], 0
    for k in counts:
        target_idx += range(row, row + k)
        bonus_idx.append(row + k)
        row += k + 1
    as_t = lambda x: torch.tensor(x, dtype=torch.int32, device=device)
    return types.SimpleNamespace(draft_token_ids=draft_ids, num_draft_tokens=counts, max_spec_len=max(counts),
                                 cu_num_draft_tokens=as_t(counts).cumsum(0).int(),
                                 target_logits_indices=as_t(target_idx),
                                 bonus_logits_indices=as_t(bonus_idx))


LOGITS = torch.tensor([2.0, 1.1, 0.3, -0.4, 1.6, -1.5, 0.8, -0.9])  # distinct: no ties at a top-k / top-p boundary


CONFIGS = [(0.7, 3, 1.0), (1.5, 8, 0.7), (1.0, 2, 0.9), (0.0, 8, 1.0)]  # (temperature, top_k, top_p); the last greedy


def forward_batch(n, device="cpu"):
    """n requests cycling through CONFIGS with k_b cycling 1, 2, 3 (ragged, so that the per-request settings must be
    expanded to the right rows), every row LOGITS, every draft token 1 (outside config 2's top-2: always rejected
    there; below the argmax: rejected by the greedy config)."""
    counts = [1 + b % 3 for b in range(n)]
    rows = sum(counts) + n
    logits = LOGITS.expand(rows, -1).clone()  # the bonus rows too: the stand-in sampler emits their argmax, 0
    cfg = [CONFIGS[b % len(CONFIGS)] for b in range(n)]
    meta = sampling_metadata([c[0] for c in cfg], top_k=torch.tensor([c[1] for c in cfg], dtype=torch.int32,
                                                                       device=device),
                             top_p=torch.tensor([c[2] for c in cfg], device=device), device=device)
    ids = torch.ones(sum(counts), dtype=torch.int32, device=device)
    return spec_metadata(counts, ids, device), logits.to(device), meta


def check_rejection_sampler_forward_processes_the_target(backend, n, device):
    # Fixed seed; 60,000 requests per config, whose first token must follow the processed law. With at most 8 tokens
    # of probability >= ~0.05, a 1% shift between two tokens has noncentrality >= 60,000 * 2e-4 / 0.5 = 24: power ~0.9
    # at the 1e-4 level (V - 1 <= 7 dof, critical value ~29), ~1 for a bias of 1.5%.
    meta, logits, sm = forward_batch(n, device)
    sampler = BonusSampler()
    module = vllm_shim.RejectionSampler(sampler)
    torch.manual_seed(3)
    with on(backend):
        out = module(meta, None, logits, sm)
    assert sampler.calls == [((n, 8), True)], "the bonus rows go through the engine's sampler, once"
    assert out.logprobs_tensors is None
    y = out.sampled_token_ids
    assert y.shape == (n, 4) and y.dtype == torch.int32
    if backend == "sim":
        torch.manual_seed(3)
        assert torch.equal(y, vllm_shim.RejectionSampler(BonusSampler())(meta, None, logits, sm).sampled_token_ids)
        return
    first = y[:, 0].long().cpu()
    for c, (temperature, top_k, top_p) in enumerate(CONFIGS):
        rows = first[c::len(CONFIGS)]
        if temperature == 0.0:  # greedy: the draft 1 is not the argmax 0, so the argmax
            assert (rows == 0).all()
            continue
        law = processed_law(LOGITS, temperature, top_k, top_p)
        counts = torch.bincount(rows, minlength=8)
        assert (counts[law == 0] == 0).all(), f"config {c}: a token outside top-k/top-p was emitted"
        assert rows_chi_square_pvalue(counts[law > 0].unsqueeze(0), law[law > 0].unsqueeze(0)) > 1e-4, f"config {c}"


# ------------------------------------------------- the transformers shim (its CPU tests, rerun by tests/gpu on CUDA)

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


def bias_power(law: dict, n: int, df: int, bias: float) -> float:
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
