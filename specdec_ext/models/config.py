"""LlamaConfig: the hyperparameters of a Llama-family model, from a Hugging Face config.json (or its dict)
or from GGUF metadata (gguf_loader.read_gguf_config gives the same dict). Every field is checked: a malformed
config raises ValueError naming its source (the file) and the field."""
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

# model_type -> what it adds to Llama. Anything else is refused by name.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = (None, "default", "linear", "llama3")
REQUIRED = object()


def read_json(path):
    """The parsed JSON file; ValueError naming the file (and the line and column) if it is not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except ValueError as error:  # JSONDecodeError (with its line and column) or UnicodeDecodeError
        raise ValueError(f"{path}: not a valid JSON file: {error}") from error


def checked(d: dict, key: str, what: str, kind: type, default=REQUIRED):
    """d[key] as a positive int (kind int) or a positive finite number (kind float); absent or null: default."""
    value = d.get(key)
    if value is None:
        if default is REQUIRED:
            raise ValueError(f"{what}: missing {key!r}")
        return default
    number = isinstance(value, int) if kind is int else isinstance(value, (int, float)) and math.isfinite(value)
    if isinstance(value, bool) or not number or value <= 0:
        raise ValueError(f"{what}: {key} must be a positive {'integer' if kind is int else 'number'}, got {value!r}")
    return value


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
    def from_dict(cls, d: dict, what: str = "LlamaConfig") -> "LlamaConfig":
        """From a Hugging Face config dict; raises ValueError, prefixed by `what` (where the dict comes from),
        naming a missing or malformed field or what this library does not support."""
        if not isinstance(d, dict):
            raise ValueError(f"{what}: a config must be a JSON object, got {type(d).__name__}")
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"{what}: model_type {model_type!r} is not supported (supported: "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)})")
        if d.get("sliding_window") is not None and d.get("use_sliding_window", model_type == "mistral"):
            raise ValueError(f"{what}: sliding-window attention (sliding_window={d['sliding_window']}) is not "
                             "supported")
        # transformers 5 writes rope_parameters (rope_type, rope_theta, ...); older config.json files rope_theta
        # and rope_scaling.
        parameters = d.get("rope_parameters") or {}
        scaling = d.get("rope_scaling") or parameters or None
        for key, value in (("rope_parameters", parameters), ("rope_scaling", scaling)):
            if value is not None and not isinstance(value, dict):
                raise ValueError(f"{what}: {key} must be an object, got {value!r}")
        if scaling is not None:
            rope_type = scaling.get("rope_type", scaling.get("type"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"{what}: rope_scaling type {rope_type!r} is not supported (supported: linear, "
                                 "llama3)")
            scaling = None if rope_type in (None, "default") else dict(scaling, rope_type=rope_type)
        if scaling is not None:
            rope = f"{what}: rope_scaling ({scaling['rope_type']})"
            checked(scaling, "factor", rope, float)
            if scaling["rope_type"] == "llama3":
                low, high = checked(scaling, "low_freq_factor", rope, float), checked(scaling, "high_freq_factor",
                                                                                       rope, float)
                checked(scaling, "original_max_position_embeddings", rope, int)
                if high <= low:
                    raise ValueError(f"{rope}: high_freq_factor {high} must be greater than low_freq_factor {low}")
        if d.get("mlp_bias"):
            raise ValueError(f"{what}: mlp_bias is not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{what}: hidden_act {d['hidden_act']!r} is not supported (SwiGLU with silu only)")
        for key in ("tie_word_embeddings", "attention_bias"):
            if d.get(key) is not None and not isinstance(d[key], bool):
                raise ValueError(f"{what}: {key} must be true or false, got {d[key]!r}")

        sizes = {key: checked(d, key, what, int) for key in ("vocab_size", "hidden_size", "intermediate_size",
                                                             "num_hidden_layers", "num_attention_heads")}
        heads, hidden = sizes["num_attention_heads"], sizes["hidden_size"]
        kv_heads = checked(d, "num_key_value_heads", what, int, heads)
        if heads % kv_heads:
            raise ValueError(f"{what}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                             f"{kv_heads}")
        head_dim = checked(d, "head_dim", what, int, None)
        if head_dim is None:
            if hidden % heads:
                raise ValueError(f"{what}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
                                 "(and there is no head_dim)")
            head_dim = hidden // heads
        if head_dim % 2:
            raise ValueError(f"{what}: head_dim {head_dim} must be even (rotary embeddings rotate pairs)")
        rope_theta = checked(d, "rope_theta", what, float, None)
        if rope_theta is None:
            rope_theta = checked(parameters, "rope_theta", f"{what}: rope_parameters", float, 10000.0)
        eos = d.get("eos_token_id")
        eos = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]
        bos = d.get("bos_token_id")
        for key, ids in (("bos_token_id", [] if bos is None else [bos]), ("eos_token_id", eos)):
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise ValueError(f"{what}: {key} must be a token id (a non-negative integer)"
                                 f"{' or a list of them' if key == 'eos_token_id' else ''}, got {d[key]!r}")
        return cls(
            **sizes,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(checked(d, "rms_norm_eps", what, float, 1e-5)),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=checked(d, "max_position_embeddings", what, int, 4096),
            tie_word_embeddings=d.get("tie_word_embeddings") or False,
            attention_bias=d.get("attention_bias", model_type == "qwen2") or False,
            model_type=model_type,
            bos_token_id=bos,
            eos_token_id=eos,
        )

    @classmethod
    def from_json(cls, path) -> "LlamaConfig":
        return cls.from_dict(read_json(path), str(path))
