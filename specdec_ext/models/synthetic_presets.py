"""Synthetic Llama models: this library's LlamaForCausalLM at the published shapes of real checkpoints (Llama 3.2
1B, Llama 3.1 8B), a tiny one for tests, and a one-layer stand-in for a draft head, with random weights drawn
on the target device from a seed. Nothing is downloaded or shipped: they measure what the shapes cost (the
benchmark's timings), not what a trained model says.

The weights are scaled so that greedy decoding is not degenerate (output_is_degenerate): a random model at the
usual initialisation (std 0.02 everywhere) repeats its input token or falls into a short cycle, which would make
speculative decoding's acceptance meaningless. The comment above QK_FACTOR says how and why.
"""
import dataclasses
import math

import torch

from .config import LlamaConfig
from .llama import LlamaForCausalLM

# The published config.json values (meta-llama/Llama-3.2-1B, meta-llama/Llama-3.1-8B), as Hugging Face dicts: what
# the two share, then each one's own.
_LLAMA3 = {
    "model_type": "llama", "vocab_size": 128256, "num_attention_heads": 32, "num_key_value_heads": 8,
    "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "attention_bias": False,
    "bos_token_id": 128000, "eos_token_id": 128001,
}


def _llama3_rope(factor: float) -> dict:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


SYNTHETIC_PRESETS = {
    "llama-3.2-1b": {**_LLAMA3, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "head_dim": 64, "tie_word_embeddings": True, "rope_scaling": _llama3_rope(32.0)},
    "llama-3.1-8b": {**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "head_dim": 128, "tie_word_embeddings": False, "rope_scaling": _llama3_rope(8.0)},
    # head_dim 64: a head dim of the CUDA attention kernel (16, 32, 64, 128, 256), so the tests' model runs there too.
    "tiny": {
        "model_type": "llama", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
        "tie_word_embeddings": False, "attention_bias": False,
    },
}
# "head": the target's config with one layer (needs target_config), the cost of an EAGLE-style one-layer draft head.
HEAD = "head"
NAMES = (*SYNTHETIC_PRESETS, HEAD)

# Every weight ~ N(0, std^2) with std = factor / sqrt(fan_in) (the norms' weights are 1, biases 0): a projection
# of an RMSNorm output (RMS 1) has RMS ~ factor. The invariant the factors keep: the next greedy token depends on
# several earlier tokens of the context, not on the current token alone, so greedy decoding neither repeats the
# current token nor falls into the short cycles of a random map token -> token (output_is_degenerate).
# - lm_head (and the embedding, which is lm_head when tied): std LOGIT_STD / sqrt(hidden), so the logits (rows
#   dotted with the final RMSNorm output) have std LOGIT_STD: a few units, as a trained model's, so that sampling
#   at temperature 1 is neither near-uniform nor near-greedy.
# - o_proj, down_proj: each layer's two additions to the residual stream (RMS ~ ADDITION_RMS x factor: SwiGLU and
#   attention's weighted averages shrink RMS-1 inputs to ~0.6, measured) add up to a final residual of RMS ~
#   RESIDUAL_RMS. The current token's embedding (norm LOGIT_STD) is in that residual, and with tied embeddings it
#   raises its own logit by LOGIT_STD^2 / RESIDUAL_RMS, i.e. LOGIT_STD / RESIDUAL_RMS logit stds: 1/4 here, far
#   below the gap a random token needs to become the argmax. With the layers' additions at RMS ~1 (factor 1) that
#   boost is ~3 stds on a two-layer model and greedy decoding repeats the current token (period 1, measured on a
#   tied `tiny`), as it does at Hugging Face's init (std 0.02 everywhere), where the embedding is the residual.
# - q_proj, k_proj: the attention scores q . k / sqrt(head_dim) have std ~ QK_FACTOR^2 (~2), so each head attends
#   to a few earlier tokens chosen by content and (through RoPE) relative position rather than to the average of
#   the context, which changes by 1/length per token and drifts to a fixed point (with q = k = 0 a `tiny` fell
#   into period 2). Measured on `tiny`, 128 greedy tokens: factor 0.5 gives 78-110 distinct, 1.5 gives 106-125.
QK_FACTOR = 1.5
LOGIT_STD = 4.0
RESIDUAL_RMS = 4 * LOGIT_STD
ADDITION_RMS = 0.6
# output_is_degenerate: a periodic tail counts from this many tokens (and three periods) on.
MIN_PERIODIC_TAIL = 16


def synthetic_config(name: str, target_config: LlamaConfig | None = None) -> LlamaConfig:
    """The LlamaConfig of preset `name` (SYNTHETIC_PRESETS, or "head": target_config with one layer)."""
    if name == HEAD:
        if not isinstance(target_config, LlamaConfig):
            raise ValueError(f"synthetic model {HEAD!r}: target_config must be the target's LlamaConfig (the head is "
                             f"one layer at its width), got {target_config!r}")
        return dataclasses.replace(target_config, num_hidden_layers=1)
    if name not in SYNTHETIC_PRESETS:
        raise ValueError(f"unknown synthetic model {name!r} (presets: {', '.join(NAMES)})")
    if target_config is not None:
        raise ValueError(f"synthetic model {name!r}: target_config is for {HEAD!r} only")
    return LlamaConfig.from_dict(SYNTHETIC_PRESETS[name], f"synthetic model {name!r}")


def parameter_count(config: LlamaConfig) -> int:
    """The number of weights of a model of this config (a tied LM head counted once)."""
    c = config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size + \
        2 * c.hidden_size + (q + 2 * kv if c.attention_bias else 0)
    embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return embeddings + c.num_hidden_layers * layer + c.hidden_size


def describe_shape(config: LlamaConfig) -> str:
    """One line: the shape of a model of this config and its parameter count."""
    c = config
    layers = f"{c.num_hidden_layers} layer{'s' if c.num_hidden_layers > 1 else ''}"
    return (f"hidden {c.hidden_size}, {layers}, {c.num_attention_heads}/{c.num_key_value_heads} heads, head_dim "
            f"{c.head_dim}, intermediate {c.intermediate_size}, vocab {c.vocab_size}, rope theta {c.rope_theta:g}, "
            f"{'tied' if c.tie_word_embeddings else 'untied'}, {parameter_count(c) / 1e9:.3g}B parameters")


def weight_std(name: str, tensor: torch.Tensor, config: LlamaConfig) -> float | None:
    """The std of the Hugging Face weight `name` (its slot `tensor`), or None for a norm's weight (ones)."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith(".bias"):
        return 0.0
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return LOGIT_STD / math.sqrt(config.hidden_size)
    module = name.split(".")[-2]
    factor = 1.0  # v_proj, gate_proj, up_proj
    if module in ("o_proj", "down_proj"):  # 2 L additions of independent directions: their RMS adds in squares
        factor = RESIDUAL_RMS / (ADDITION_RMS * math.sqrt(2 * config.num_hidden_layers))
    elif module in ("q_proj", "k_proj"):
        factor = QK_FACTOR
    return factor / math.sqrt(tensor.shape[1])  # a [out, in] weight: fan_in is in


@torch.no_grad()
def synthetic(name: str, dtype: torch.dtype | None = None, device="cpu", seed: int = 0, *,
              target_config: LlamaConfig | None = None) -> LlamaForCausalLM:
    """LlamaForCausalLM of preset `name` (synthetic_config) with random weights (weight_std) drawn on `device`
    by a generator seeded with `seed`, weight by weight in the model's dtype: an 8B bfloat16 model needs its own
    16 GB and no float32 copy. dtype: bfloat16 on CUDA, float32 elsewhere by default. The same name, seed, dtype
    and device give the same weights."""
    config = synthetic_config(name, target_config)
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = LlamaForCausalLM(config, dtype=dtype, device=device)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    for weight in model.weight_names():  # a fixed order: the seed fixes every weight
        tensor = model.slot(weight)  # the parameter, or its rows in a fused one (q/k/v, gate/up)
        std = weight_std(weight, tensor, config)
        if std is None:
            tensor.fill_(1.0)
        elif std == 0.0:
            tensor.zero_()
        else:
            tensor.normal_(0.0, std, generator=generator)
    return model


def output_is_degenerate(tokens, min_distinct: int = 32, max_period: int = 8) -> str | None:
    """Why a generated token sequence is degenerate, or None: a tail of max(MIN_PERIODIC_TAIL, 3 p) tokens or more
    that repeats with a period p <= max_period (each of its tokens after the first p equals the one p before: by
    chance, among V equally likely tokens, with probability V^-(tail - p), nil for V >= 32), or fewer than
    min_distinct distinct tokens."""
    tokens = [int(t) for t in tokens]
    for period in range(1, max_period + 1):  # first: a stuck model's output is both, the period says more
        run = 0  # trailing tokens equal to the one `period` before
        while run < len(tokens) - period and tokens[-1 - run] == tokens[-1 - run - period]:
            run += 1
        tail = run + period
        if run and tail >= max(MIN_PERIODIC_TAIL, 3 * period):
            return f"the last {tail} tokens repeat with period {period}"
    distinct = len(set(tokens))
    if distinct < min_distinct:
        return f"{distinct} distinct tokens of {len(tokens)} (fewer than {min_distinct})"
    return None
