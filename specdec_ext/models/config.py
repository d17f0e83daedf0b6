"""LlamaConfig: the hyperparameters of a Llama-family model, from a Hugging Face config.json (or its dict)
or from GGUF metadata (gguf_loader.read_gguf_config gives the same dict)."""
import json
from dataclasses import dataclass, field
from pathlib import Path

# model_type -> what it adds to Llama. Anything else is refused by name.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = (None, "default", "linear", "llama3")


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict) -> "LlamaConfig":
        """From a Hugging Face config dict; raises ValueError naming what this library does not support."""
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"LlamaConfig: model_type {model_type!r} is not supported (supported: "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)})")
        if d.get("sliding_window") is not None and d.get("use_sliding_window", model_type == "mistral"):
            raise ValueError(f"LlamaConfig: sliding-window attention (sliding_window={d['sliding_window']}) is not "
                             "supported")
        # transformers 5 writes rope_parameters (rope_type, rope_theta, ...); older config.json files rope_theta
        # and rope_scaling.
        parameters = d.get("rope_parameters") or {}
        scaling = d.get("rope_scaling") or parameters or None
        if scaling is not None:
            rope_type = scaling.get("rope_type", scaling.get("type"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"LlamaConfig: rope_scaling type {rope_type!r} is not supported (supported: linear, "
                                 "llama3)")
            scaling = None if rope_type in (None, "default") else dict(scaling, rope_type=rope_type)
        if d.get("mlp_bias"):
            raise ValueError("LlamaConfig: mlp_bias is not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"LlamaConfig: hidden_act {d['hidden_act']!r} is not supported (SwiGLU with silu only)")
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        rope_theta = d.get("rope_theta", parameters.get("rope_theta", 10000.0))
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            model_type=model_type,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=[] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos],
        )

    @classmethod
    def from_json(cls, path) -> "LlamaConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))
