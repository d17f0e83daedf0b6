"""Loading weights into LlamaForCausalLM: a Hugging Face directory (safetensors, sharded or not), a GGUF file
(gguf_loader: metadata to config, tensors dequantised), or a transformers model object. Every weight is
copied once, straight into its slot of the target dtype and device; a progress bar shows on a terminal.

The model's class comes in as `model_class` (LlamaForCausalLM.from_pretrained and from_hf pass their `cls`): this
module does not import llama.py, whose constructors import it."""
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from .config import LlamaConfig, read_json
from .quantized import QuantizedWeight, stack_rows


def fill_weights(model: nn.Module, tensors, total: int, what: str) -> nn.Module:
    """Copies (name, tensor) pairs into the model's slots; every weight must come exactly once. A QuantizedWeight
    value replaces its slot (place_quantized) instead of being copied."""
    needed = set(model.weight_names())
    missing = set(needed)
    quantized = {}
    for name, value in tqdm(tensors, total=total, desc=f"loading {what}", unit="tensor", leave=False, disable=None):
        if (name == "lm_head.weight" and model.config.tie_word_embeddings) or name.endswith("rotary_emb.inv_freq"):
            continue  # a tied head stored anyway; rotary tables are recomputed
        if name in needed and name not in missing:
            raise ValueError(f"{what}: weight {name!r} appears twice")
        slot = model.slot(name)  # raises for a weight this architecture does not have
        value = value if isinstance(value, QuantizedWeight) else torch.as_tensor(value)
        if tuple(value.shape) != tuple(slot.shape):
            raise ValueError(f"{what}: {name} has shape {tuple(value.shape)}, the config says {tuple(slot.shape)}")
        if isinstance(value, QuantizedWeight):
            quantized[name] = value
        else:
            with torch.no_grad():
                slot.copy_(value)
        missing.discard(name)
    if missing:
        raise ValueError(f"{what}: missing weights, e.g. {sorted(missing)[:3]}")
    place_quantized(model, quantized)
    return model


def place_quantized(model: nn.Module, weights: dict) -> None:
    """Puts weights kept as GGUF blocks (Hugging Face name -> QuantizedWeight) in place of the model's float
    tensors. A fused projection (q/k/v, gate/up) is kept quantised when all its parts are; if only some are, those
    are dequantised into the float tensor instead (a file that mixes float and block parts of one projection)."""
    groups = [(model, "embed_tokens", ["model.embed_tokens.weight"])]
    if not model.config.tie_word_embeddings:
        groups.append((model, "lm_head", ["lm_head.weight"]))
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        groups += [(layer, "qkv_proj", [p + f"self_attn.{n}_proj.weight" for n in "qkv"]),
                   (layer, "o_proj", [p + "self_attn.o_proj.weight"]),
                   (layer, "gate_up_proj", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                   (layer, "down_proj", [p + "mlp.down_proj.weight"])]
    for module, attr, names in groups:
        kept = [weights[n] for n in names if n in weights]
        if len(kept) == len(names):
            module._parameters.pop(attr, None)  # a plain attribute from here on, not an nn.Parameter
            setattr(module, attr, stack_rows(kept))
        else:
            with torch.no_grad():
                for n in names:
                    if n in weights:
                        model.slot(n).copy_(weights[n].dequantize())
    if model.config.tie_word_embeddings and "model.embed_tokens.weight" in weights:
        model._parameters.pop("lm_head", None)
        model.lm_head = model.embed_tokens


def load_from_hf(model_class: type, hf_model, *, dtype=None, device=None) -> nn.Module:
    config = LlamaConfig.from_dict(hf_model.config.to_dict(), type(hf_model.config).__name__)
    state = hf_model.state_dict()
    first = next(iter(state.values()))
    model = model_class(config, dtype=dtype or first.dtype, device=device or first.device)
    return fill_weights(model, state.items(), len(state), type(hf_model).__name__)


def load_pretrained(model_class: type, path, *, dtype=torch.float32, device="cpu",
                    keep_quantized: bool = False) -> nn.Module:
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf_model(model_class, path, dtype=dtype, device=device, keep_quantized=keep_quantized)
    if path.is_dir() and (path / "config.json").is_file():
        if keep_quantized:
            raise ValueError(f"from_pretrained: keep_quantized needs a .gguf file (block formats); {str(path)!r} is a "
                             "Hugging Face directory")
        return load_safetensors_dir(model_class, path, dtype=dtype, device=device)
    if path.is_dir() and len(ggufs := sorted(path.glob("*.gguf"))) == 1:
        return load_gguf_model(model_class, ggufs[0], dtype=dtype, device=device, keep_quantized=keep_quantized)
    raise ValueError(f"from_pretrained: {str(path)!r} is neither a Hugging Face model directory (config.json and "
                     "*.safetensors) nor a .gguf file")


def load_safetensors_dir(model_class: type, path: Path, *, dtype, device) -> nn.Module:
    from safetensors import SafetensorError, safe_open

    config = LlamaConfig.from_json(path / "config.json")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        content = read_json(index)
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index}: no 'weight_map' object of tensor name -> shard file name")
        files = sorted(set(weight_map.values()))
        for f in files:
            if not (path / f).is_file():
                raise ValueError(f"{index}: the shard {f!r} it names does not exist in {str(path)!r}")
    else:
        files = [p.name for p in sorted(path.glob("*.safetensors"))]
    if not files:
        raise ValueError(f"from_pretrained: no *.safetensors in {str(path)!r}")
    model = model_class(config, dtype=dtype, device=device)
    handles = []
    for f in files:  # safe_open checks the whole file's layout (header, offsets, size)
        try:
            handles.append(safe_open(path / f, framework="pt"))
        except SafetensorError as error:
            raise ValueError(f"{path / f}: not a readable safetensors file: {error}") from error
    names = [(h, k) for h in handles for k in h.keys()]
    # One tensor at a time, read in its stored dtype and copied into its slot: no second copy of the model.
    return fill_weights(model, ((k, h.get_tensor(k)) for h, k in names), len(names), path.name)


def load_gguf_model(model_class: type, path: Path, *, dtype, device, keep_quantized: bool = False) -> nn.Module:
    from .gguf_loader import load_gguf

    if keep_quantized and dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"from_pretrained: keep_quantized runs float32 or bfloat16 activations, got dtype {dtype}")
    config_dict, tensors = load_gguf(str(path), keep_quantized=keep_quantized)
    config = LlamaConfig.from_dict(config_dict, str(path))
    # The float tensors that quantised weights replace are allocated but never written: untouched pages cost no
    # memory.
    model = model_class(config, dtype=dtype, device=device)
    total = len(model.weight_names())

    def values():
        for name, value in tensors:
            if isinstance(value, tuple):  # (GGML type id, blocks)
                yield name, QuantizedWeight(torch.from_numpy(value[1]), value[0], dtype).to(device)
            else:
                yield name, torch.from_numpy(value)

    return fill_weights(model, values(), total, path.name)
