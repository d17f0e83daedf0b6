"""Read Llama / Qwen2 checkpoints from GGUF files (llama.cpp's format) into Hugging Face form.

`load_gguf(path)` returns a `config.json`-style dict and an iterator over (Hugging Face tensor name, float32
array) pairs, so a GGUF file can feed the same model code as a safetensors checkpoint. Dequantization at load
is the `gguf` package's own (the reference implementation maintained with llama.cpp); with keep_quantized the
block formats the kernels read (KEPT_TYPES) come through as stored instead.
"""
from __future__ import annotations

import re
import reprlib
from collections.abc import Iterator
from os import PathLike

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

# The tensor types this loader accepts: the float formats and the quantizations common for small models.
SUPPORTED_TYPES = frozenset(
    {
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q6_K,
    }
)

# general.architecture -> Hugging Face model class.
_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# GGUF names of tensors outside the transformer blocks -> Hugging Face names.
_GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# GGUF names inside block i ("blk.{i}.<name>") -> Hugging Face names inside "model.layers.{i}.".
_BLOCK_TENSOR_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}

_BLOCK_TENSOR_PATTERN = re.compile(r"blk\.(\d+)\.(.+)")

# llama3-style GGUFs store their frequency-dependent RoPE scaling as this tensor, which this loader does not
# implement; refusing it is better than silently running the model with unscaled rotary embeddings.
_ROPE_FREQS_TENSOR = "rope_freqs.weight"


_KINDS = {int: ((int,), "an integer"), float: ((int, float), "a number"), str: ((str,), "a string")}


def _field(reader: GGUFReader, key: str, kind: type, default=None):
    """The value of metadata field `key`, or `default` if absent; kind (int, float or str): the type the value must
    have (an int does for a float)."""
    field = reader.get_field(key)
    if field is None:
        return default
    value = field.contents()
    types, noun = _KINDS[kind]
    if isinstance(value, bool) or not isinstance(value, types):
        raise ValueError(f"GGUF metadata {key!r} must be {noun}, got {reprlib.repr(value)} "
                         f"({'/'.join(t.name for t in field.types)})")
    return value


def _required_field(reader: GGUFReader, key: str, kind: type):
    value = _field(reader, key, kind)
    if value is None:
        raise ValueError(f"GGUF metadata lacks the required key {key!r}")
    return value


def read_gguf_config(reader: GGUFReader) -> dict:
    """A Hugging Face `config.json`-style dict built from the GGUF file's metadata (llama and qwen2 only). The
    metadata's types are checked here, its values by LlamaConfig.from_dict."""
    arch = _field(reader, "general.architecture", str)
    if arch not in _HF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} (supported: {', '.join(sorted(_HF_ARCHITECTURES))})"
        )
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    if _ROPE_FREQS_TENSOR in tensors:
        raise ValueError(f"GGUF tensor {_ROPE_FREQS_TENSOR!r} (llama3-style RoPE scaling) is unsupported")

    vocab_size = _field(reader, f"{arch}.vocab_size", int)
    if vocab_size is None:
        # Older converters omit <arch>.vocab_size; the token list, else the embedding, gives it.
        tokens = reader.get_field("tokenizer.ggml.tokens")
        if tokens is not None:
            vocab_size = len(tokens.data)  # one data index per array element; avoids decoding every token
        elif "token_embd.weight" in tensors:
            vocab_size = int(tensors["token_embd.weight"].shape[-1])  # GGUF shapes are reversed: rows last
        else:
            raise ValueError(f"GGUF file has neither {arch}.vocab_size, tokenizer.ggml.tokens nor token_embd.weight")

    hidden_size = _required_field(reader, f"{arch}.embedding_length", int)
    num_heads = _required_field(reader, f"{arch}.attention.head_count", int)
    # No key_length: hidden / heads (None for 0 heads, which LlamaConfig.from_dict refuses by name).
    head_dim = _field(reader, f"{arch}.attention.key_length", int, hidden_size // num_heads if num_heads else None)

    rope_scaling = None
    scaling_type = _field(reader, f"{arch}.rope.scaling.type", str, "none")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": _required_field(reader, f"{arch}.rope.scaling.factor", float)}
    elif scaling_type != "none":
        raise ValueError(f"GGUF RoPE scaling type {scaling_type!r} ({arch}.rope.scaling.type) is unsupported")

    has_qkv_bias = any(name.endswith(("attn_q.bias", "attn_k.bias", "attn_v.bias")) for name in tensors)
    return {
        "model_type": arch,
        "architectures": [_HF_ARCHITECTURES[arch]],
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": _required_field(reader, f"{arch}.feed_forward_length", int),
        "num_hidden_layers": _required_field(reader, f"{arch}.block_count", int),
        "num_attention_heads": num_heads,
        "num_key_value_heads": _field(reader, f"{arch}.attention.head_count_kv", int, num_heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(_required_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", float)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", float, 10000.0)),
        "max_position_embeddings": _required_field(reader, f"{arch}.context_length", int),
        # llama.cpp's converter writes no output.weight when the model reuses its embedding as the LM head.
        "tie_word_embeddings": "output.weight" not in tensors,
        "rope_scaling": rope_scaling,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", int),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id", int),
        # Qwen2's q/k/v projections always carry biases; a llama GGUF has them only if its tensors say so.
        "attention_bias": arch == "qwen2" or has_qkv_bias,
    }


def _hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSOR_NAMES:
        return _GLOBAL_TENSOR_NAMES[gguf_name]
    match = _BLOCK_TENSOR_PATTERN.fullmatch(gguf_name)
    if match and match.group(2) in _BLOCK_TENSOR_NAMES:
        return f"model.layers.{match.group(1)}.{_BLOCK_TENSOR_NAMES[match.group(2)]}"
    if gguf_name == _ROPE_FREQS_TENSOR:
        raise ValueError(f"GGUF tensor {gguf_name!r} (llama3-style RoPE scaling) is unsupported")
    raise ValueError(f"unknown GGUF tensor {gguf_name!r}")


def _undo_rotary_permutation(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's converter permutation of q/k rows (weights or biases).

    Hugging Face Llama rotates the two halves of each head's rows against each other; llama.cpp rotates
    adjacent pairs, so its converter interleaves the halves with
    `w.reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2).reshape(w.shape)`. Swapping the same two
    axes of the (n_head, rows // n_head // 2, 2, ...) view undoes it.
    """
    half_head = weights.shape[0] // n_head // 2
    return weights.reshape(n_head, half_head, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _check_rotary_rows(tensor, n_head, config: dict) -> None:
    """A q/k tensor's rows must split into n_head heads of two halves for _undo_rotary_permutation: a file whose
    metadata disagrees with its tensors fails here, naming both, instead of with numpy's reshape message mid-load.
    n_head < 1 is left to LlamaConfig.from_dict, which names the field."""
    rows = int(tensor.shape[-1])  # GGUF shapes are reversed: rows last (a bias: its length)
    if n_head is None or n_head < 1 or rows % (2 * n_head) == 0:
        return
    heads = "kv heads" if ".attn_k." in tensor.name else "heads"
    raise ValueError(f"GGUF tensor {tensor.name!r} has {rows} rows, not a multiple of 2 x {n_head} {heads}: "
                     f"llama.cpp's rotary permutation of its rows cannot be undone (the metadata gives "
                     f"{config['num_attention_heads']} heads, {config['num_key_value_heads']} kv heads, head dim "
                     f"{config['head_dim']})")


# The block formats that can stay quantised in the model (ops.quantized_linear reads them as stored).
KEPT_TYPES = frozenset({GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
                        GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K})


def read_gguf_tensors(reader: GGUFReader, config: dict, keep_quantized: bool = False):
    """Every tensor of the file as (Hugging Face name, float32 array in Hugging Face layout), lazily; with
    keep_quantized, a 2-D tensor of a KEPT_TYPES format comes as (name, (GGML type id, uint8 array [rows,
    row_bytes])) instead: its blocks as stored, rows in Hugging Face order.

    Names, types and q/k row counts are all checked before this returns, so a file this loader cannot read fails
    before any weight is dequantized; the dequantization itself happens one tensor at a time as the iterator
    advances.
    """
    hf_names = []
    for tensor in reader.tensors:
        hf_names.append(_hf_tensor_name(tensor.name))
        if tensor.tensor_type not in SUPPORTED_TYPES:
            raise ValueError(f"GGUF tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name}")

    # Only llama.cpp's llama converter permutes q/k; its qwen2 converter writes them unchanged.
    heads_to_unpermute = {}
    if config["model_type"] == "llama":
        heads_to_unpermute = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for tensor in reader.tensors:
        _check_rotary_rows(tensor, heads_to_unpermute.get(tensor.name.split(".")[-2]), config)

    def tensors() -> Iterator[tuple[str, np.ndarray]]:
        for tensor, hf_name in zip(reader.tensors, hf_names):
            # tensor.data is already in numpy (row-major) order, GGUF's reversed shape undone: a 2-D weight is
            # [rows, cols] = Hugging Face's [out_features, in_features]. Quantized data is [rows, bytes per
            # row] and dequantize expands it to [rows, cols].
            n_head = heads_to_unpermute.get(tensor.name.split(".")[-2])
            if keep_quantized and tensor.tensor_type in KEPT_TYPES and tensor.data.ndim == 2:
                blocks = tensor.data  # [rows, row_bytes]: the permutation of q/k rows moves whole rows of blocks
                if n_head is not None:
                    blocks = _undo_rotary_permutation(blocks, n_head)
                yield hf_name, (int(tensor.tensor_type), np.array(blocks, dtype=np.uint8, copy=True))
                continue
            weights = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
            if n_head is not None:
                weights = _undo_rotary_permutation(weights, n_head)
            if not weights.flags.writeable:
                # An F32 tensor comes back as a view of the read-only file mapping; copy it so callers own
                # a normal array (torch.from_numpy warns on read-only ones).
                weights = weights.copy()
            yield hf_name, weights

    return tensors()


class _CheckedReader(GGUFReader):
    """GGUFReader with every read bounds-checked: a truncated file (or a corrupt length or offset in it) fails
    saying so, with the offset, instead of with numpy's reshape message or a silently short array."""

    def _get(self, offset, dtype, count=1, override_order=None):
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > len(self.data):
            raise ValueError(f"truncated: the read at offset {int(offset)} needs {end} bytes, the file has "
                             f"{len(self.data)}")
        return super()._get(offset, dtype, count, override_order)


def load_gguf(path: str | PathLike, keep_quantized: bool = False) -> tuple[dict, Iterator]:
    """Open a GGUF file (memory-mapped) and return (Hugging Face config dict, iterator of named tensors; see
    read_gguf_tensors for keep_quantized)."""
    try:
        reader = _CheckedReader(path)
    except (ValueError, IndexError, KeyError, OverflowError) as error:  # a bad magic, truncation, corrupt fields
        raise ValueError(f"{str(path)!r} is not a readable GGUF file: {error}") from error
    try:
        config = read_gguf_config(reader)
        return config, read_gguf_tensors(reader, config, keep_quantized)
    except ValueError as error:
        raise ValueError(f"{str(path)!r}: {error}") from error
