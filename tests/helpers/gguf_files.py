"""GGUF files written as llama.cpp writes them (its metadata keys, tensor names and q/k permutation), from a small
random transformers model (SMALL, random_model)."""
import gguf
import torch
from gguf import GGMLQuantizationType as QType

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
