"""The random models the tests run, built from seeds: tiny transformers Llamas and ours (tiny_hf, tiny_model), random
prompts, random draft heads and drafters, transformers models of every supported architecture (the loaders' cases),
and the shipped SmolLM2-135M-Instruct.

Shared models (tiny_model, shared_hf, shipped_model: built once per process) are read-only by contract: a test that
changes a model builds its own (tiny_hf, arch_hf); conftest.py checks at the end of the session that no shared model
changed (assert_shared_models_unchanged)."""
import functools
import json
import math
import zlib

import torch
import transformers

from specdec_ext.drafters import EagleDrafter, MedusaDrafter
from specdec_ext.models import LlamaForCausalLM, default_model_path, load_tokenizer
from specdec_ext.models.draft_heads import EagleHead, MedusaHeads, eagle3_layers

# ----------------------------------------------------------------------------------------------------- shared models

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
    """"eagle" (an EAGLE-1 head), "eagle3" (EAGLE-3 features: the target's low, middle and high layers) or "medusa",
    with random weights."""
    if name in ("eagle", "eagle3"):
        layers = eagle3_layers(target.config.num_hidden_layers) if name == "eagle3" else None
        return EagleDrafter(target, EagleHead(target, vocab, layers).init_weights(torch.Generator().manual_seed(seed)))
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
