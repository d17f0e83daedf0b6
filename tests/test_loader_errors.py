"""Malformed model and draft-head files are refused with a ValueError naming the file and what is wrong in it (the
field, the tensor, the offset of a truncation), never a bare KeyError / IndexError / numpy message, and never by
loading something that fails later (a string rms_norm_eps) or holds uninitialised memory (a head file lacking a
tensor). Tiny random models; GGUF files written as tests/test_gguf_loader.py writes them."""
import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from helpers.gguf_files import SMALL, random_model, write_gguf
from helpers.models import hf_case, random_medusa, random_vocab, save_hf, tiny_model
from specdec_ext.models import LlamaConfig, LlamaForCausalLM
from specdec_ext.models.draft_heads import EagleHead, MedusaHeads
from specdec_ext.models.gguf_loader import load_gguf

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=1234)


# ------------------------------------------------------------------------------------------------- config.json

VALID = dict(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
             max_position_embeddings=256, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}

# (edit of VALID, what the message must name)
BAD_CONFIGS = {
    "missing-hidden_size": ({"hidden_size": None}, "missing 'hidden_size'"),
    "missing-vocab_size": ({"vocab_size": None}, "missing 'vocab_size'"),
    "string-rms_norm_eps": ({"rms_norm_eps": "1e-5"}, "rms_norm_eps"),
    "zero-rms_norm_eps": ({"rms_norm_eps": 0}, "rms_norm_eps"),
    "nan-rms_norm_eps": ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
    "string-rope_theta": ({"rope_theta": "10000"}, "rope_theta"),
    "negative-rope_theta": ({"rope_theta": -1.0}, "rope_theta"),
    "zero-heads": ({"num_attention_heads": 0}, "num_attention_heads"),
    "float-hidden_size": ({"hidden_size": 64.0}, "hidden_size"),
    "bool-vocab_size": ({"vocab_size": True}, "vocab_size"),
    "negative-layers": ({"num_hidden_layers": -2}, "num_hidden_layers"),
    "string-intermediate_size": ({"intermediate_size": "96"}, "intermediate_size"),
    "heads-not-multiple-of-kv": ({"num_key_value_heads": 3}, "num_key_value_heads"),
    "hidden-not-multiple-of-heads": ({"hidden_size": 66}, "hidden_size 66 is not a multiple"),
    "odd-head_dim": ({"head_dim": 15}, "head_dim"),
    "string-max_position_embeddings": ({"max_position_embeddings": "256"}, "max_position_embeddings"),
    "string-eos": ({"eos_token_id": "2"}, "eos_token_id"),
    "negative-eos-in-list": ({"eos_token_id": [2, -1]}, "eos_token_id"),
    "float-bos": ({"bos_token_id": 1.5}, "bos_token_id"),
    "string-tie": ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),
    "rope_scaling-not-object": ({"rope_scaling": "linear"}, "rope_scaling"),
    "linear-without-factor": ({"rope_scaling": {"rope_type": "linear"}}, "missing 'factor'"),
    "linear-string-factor": ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, "factor"),
    "llama3-without-low_freq_factor": ({"rope_scaling": {k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}},
                                       "missing 'low_freq_factor'"),
    "llama3-high-not-above-low": ({"rope_scaling": dict(LLAMA3, high_freq_factor=1.0)}, "high_freq_factor"),
    "rope_parameters-string-theta": ({"rope_theta": None, "rope_parameters": {"rope_theta": "1e4"}}, "rope_theta"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_malformed_config_field_is_named(case, tmp_path):
    edit, message = BAD_CONFIGS[case]
    d = {k: v for k, v in {**VALID, **edit}.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_dict(d)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=message) as error:
        LlamaConfig.from_json(path)
    assert str(path) in str(error.value)


def test_valid_config_still_loads():
    config = LlamaConfig.from_dict(dict(VALID, rope_scaling=LLAMA3))
    assert (config.head_dim, config.num_key_value_heads, config.rms_norm_eps, config.eos_token_id) == (16, 2, 1e-5, [2])
    assert config.rope_scaling == LLAMA3


@pytest.mark.parametrize("text, where", [('{"vocab_size": 64,\n "hidden_size": }', "line 2 column 17"),
                                         ("[1, 2]", "JSON object"), ("", "line 1 column 1")],
                         ids=["malformed", "a-list", "empty"])
def test_config_json_that_is_no_json_object(tmp_path, text, where):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=where) as error:
        LlamaConfig.from_json(path)
    assert str(path) in str(error.value)


def test_string_rms_norm_eps_is_refused_at_load(tmp_path):
    save_hf(hf_case("llama-gqa2-tied"), tmp_path, lambda c: c.update(rms_norm_eps="1e-05"))
    with pytest.raises(ValueError, match="config.json: rms_norm_eps must be a positive number"):
        LlamaForCausalLM.from_pretrained(tmp_path)


# ----------------------------------------------------------------------------------------- safetensors directory

@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded")
    hf_case("qwen2-gqa2").save_pretrained(path, safe_serialization=True, max_shard_size="20KB")
    return path


def copy_of(sharded, tmp_path):
    shutil.copytree(sharded, tmp_path / "model")
    return tmp_path / "model"


def test_malformed_index_json(sharded, tmp_path):
    path = copy_of(sharded, tmp_path)
    index = path / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"a": ')
    with pytest.raises(ValueError, match="model.safetensors.index.json: not a valid JSON file.*line 1 column 22"):
        LlamaForCausalLM.from_pretrained(path)
    index.write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match="model.safetensors.index.json: no 'weight_map'"):
        LlamaForCausalLM.from_pretrained(path)


def test_index_naming_a_missing_shard(sharded, tmp_path):
    path = copy_of(sharded, tmp_path)
    shard = sorted(path.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ValueError, match=f"index.json: the shard '{shard.name}' it names does not exist"):
        LlamaForCausalLM.from_pretrained(path)


@pytest.mark.parametrize("cut", [5, 100, -8], ids=["header-length", "header", "data"])
def test_corrupt_safetensors_file_is_named(sharded, tmp_path, cut):
    path = copy_of(sharded, tmp_path)
    shard = sorted(path.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:cut])
    with pytest.raises(ValueError, match="not a readable safetensors file") as error:
        LlamaForCausalLM.from_pretrained(path)
    assert str(shard) in str(error.value)


# ------------------------------------------------------------------------------------------------------- GGUF

@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    model = random_model(HFLlamaForCausalLM, HFLlamaConfig(**SMALL))
    return write_gguf(tmp_path_factory.mktemp("gguf") / "model.gguf", model, "llama")


def cut_points(path):
    """Offsets to cut the file at: inside the header, the metadata, the tensor infos and the tensor data."""
    reader = gguf.GGUFReader(path)
    last = reader.tensors[-1]
    return {"version": 6, "counts": 16, "metadata": reader.fields["llama.embedding_length"].offset + 10,
            "token-list": reader.fields["tokenizer.ggml.tokens"].offset + 100,
            "tensor-info": reader.tensors[3].field.offset + 4, "first-tensor": reader.data_offset + 10,
            "last-byte": last.data_offset + last.n_bytes - 1}


@pytest.mark.parametrize("where", ["version", "counts", "metadata", "token-list", "tensor-info", "first-tensor",
                                   "last-byte"])
def test_truncated_gguf(gguf_file, tmp_path, where):
    cut = cut_points(gguf_file)[where]
    path = tmp_path / "cut.gguf"
    path.write_bytes(gguf_file.read_bytes()[:cut])
    with pytest.raises(ValueError, match=rf"truncated: the read at offset \d+ needs \d+ bytes, the file has {cut}"
                       ) as error:
        load_gguf(path)
    assert str(path) in str(error.value)


# (the writer's method, the key it writes, how the test writes it instead)
WRONG_TYPES = {
    "string-embedding_length": ("add_embedding_length", "llama.embedding_length", "add_string", str),
    "string-rms-eps": ("add_layer_norm_rms_eps", "llama.attention.layer_norm_rms_epsilon", "add_string", str),
    "float-head_count": ("add_head_count", "llama.attention.head_count", "add_float32", float),
    "array-context_length": ("add_context_length", "llama.context_length", "add_array", lambda v: [v]),
    "string-eos": ("add_eos_token_id", "tokenizer.ggml.eos_token_id", "add_string", str),
}


@pytest.mark.parametrize("case", list(WRONG_TYPES))
def test_gguf_metadata_of_the_wrong_type_is_named(tmp_path, monkeypatch, case):
    method, key, writes, convert = WRONG_TYPES[case]
    monkeypatch.setattr(gguf.GGUFWriter, method, lambda self, value: getattr(self, writes)(key, convert(value)))
    path = write_gguf(tmp_path / "wrong.gguf", random_model(HFLlamaForCausalLM, HFLlamaConfig(**SMALL)), "llama")
    with pytest.raises(ValueError, match=rf"GGUF metadata '{key}' must be") as error:
        load_gguf(path)
    assert str(path) in str(error.value)


def test_gguf_metadata_out_of_range_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf.GGUFWriter, "add_head_count", lambda self, value: self.add_uint32(
        "llama.attention.head_count", 0))
    path = write_gguf(tmp_path / "zero.gguf", random_model(HFLlamaForCausalLM, HFLlamaConfig(**SMALL)), "llama")
    with pytest.raises(ValueError, match="zero.gguf: num_attention_heads must be a positive integer, got 0"):
        LlamaForCausalLM.from_pretrained(path)


# Head counts in the metadata that the config accepts but the q/k rows (llama-permuted for the model's own counts)
# cannot split into: (the model's config, the writer's method and the count it writes instead, the GGUF weight
# type, the message). The loader undoes llama.cpp's rotary permutation with a reshape by heads; numpy's reshape
# message named neither the file nor the tensor, and came mid-load.
BAD_HEAD_COUNTS = {
    "heads": (dict(SMALL), "add_head_count", 6, gguf.GGMLQuantizationType.F32,
              "GGUF tensor 'blk.0.attn_q.weight' has 64 rows, not a multiple of 2 x 6 heads: llama.cpp's rotary "
              "permutation of its rows cannot be undone (the metadata gives 6 heads, 2 kv heads, head dim 16)"),
    "heads-kept-quantized": (dict(SMALL), "add_head_count", 6, gguf.GGMLQuantizationType.Q8_0,
                             "GGUF tensor 'blk.0.attn_q.weight' has 64 rows, not a multiple of 2 x 6 heads"),
    "kv-heads": (dict(SMALL, hidden_size=24), "add_head_count_kv", 4, gguf.GGMLQuantizationType.F32,
                 "GGUF tensor 'blk.0.attn_k.weight' has 12 rows, not a multiple of 2 x 4 kv heads: llama.cpp's "
                 "rotary permutation of its rows cannot be undone (the metadata gives 4 heads, 4 kv heads, head dim "
                 "6)"),
}


@pytest.mark.parametrize("case", list(BAD_HEAD_COUNTS))
def test_gguf_q_k_rows_that_do_not_split_into_the_heads_are_named(tmp_path, monkeypatch, case):
    config, method, count, weight_type, message = BAD_HEAD_COUNTS[case]
    real = getattr(gguf.GGUFWriter, method)
    monkeypatch.setattr(gguf.GGUFWriter, method, lambda self, value: real(self, count))
    model = random_model(HFLlamaForCausalLM, HFLlamaConfig(**config))
    path = write_gguf(tmp_path / "heads.gguf", model, "llama", weight_type,
                      extra_metadata={"add_key_length": model.config.hidden_size // model.config.num_attention_heads})
    keep = weight_type != gguf.GGMLQuantizationType.F32
    with pytest.raises(ValueError) as error:
        dict(load_gguf(path, keep_quantized=keep)[1])
    assert str(error.value).startswith(f"{str(path)!r}: {message}"), error.value
    # The whole load: refused by the loader before the model is built, not by the shapes while filling it.
    with pytest.raises(ValueError) as error:
        LlamaForCausalLM.from_pretrained(path, keep_quantized=keep)
    assert str(error.value).startswith(f"{str(path)!r}: {message}"), error.value


# ------------------------------------------------------------------------------------------------- head files

def rewrite(path, out, drop=(), add=None, meta=None):
    """The head file at `path`, written to `out`, with tensors dropped / added (or replaced) and metadata keys
    changed (None: removed)."""
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k not in drop}
        metadata = f.metadata()
    tensors.update(add or {})
    metadata = {k: v for k, v in {**metadata, **(meta or {})}.items() if v is not None}
    save_file(tensors, str(out), metadata=metadata)
    return out


@pytest.fixture(scope="module")
def head_files(target, tmp_path_factory):
    folder = tmp_path_factory.mktemp("heads")
    vocab = random_vocab(target.config.vocab_size, 32, 3)
    EagleHead(target, vocab).init_weights(torch.Generator().manual_seed(4)).save(folder / "eagle.safetensors")
    random_medusa(target, vocab, 3, 5).save(folder / "medusa.safetensors")
    return {"eagle": folder / "eagle.safetensors", "medusa": folder / "medusa.safetensors"}


# kind -> case -> (rewrite's arguments, what the message must name)
BAD_HEADS = {
    "eagle": {
        "missing-qkv": ({"drop": ["layer.qkv_proj"]}, r"missing tensors \['layer.qkv_proj'\]"),
        "missing-fc.weight": ({"drop": ["fc.weight"]}, r"missing tensors \['fc.weight'\]"),
        "extra": ({"add": {"layer.extra": torch.zeros(3)}}, r"unexpected tensors \['layer.extra'\]"),
        "broadcastable-shape": ({"add": {"fc.bias": torch.zeros(1)}}, r"'fc.bias' is torch.float32 \(1,\)"),
        "integer-weights": ({"add": {"feature_norm": torch.ones(64, dtype=torch.int64)}},
                            "'feature_norm'.*floating"),
        "no-target": ({"meta": {"target": None}}, "metadata target"),
        "target-not-json": ({"meta": {"target": "{hidden"}}, "metadata target"),
        "target-a-list": ({"meta": {"target": "[64]"}}, "metadata target"),
        "no-draft_vocab": ({"drop": ["draft_vocab"]}, "no draft_vocab"),
        "float-draft_vocab": ({"add": {"draft_vocab": torch.arange(8.0)}}, "draft_vocab must be"),
    },
    "medusa": {
        "missing-bias": ({"drop": ["bias"]}, r"missing tensors \['bias'\]"),
        "extra": ({"add": {"scale": torch.ones(3)}}, r"unexpected tensors \['scale'\]"),
        "no-num_heads": ({"meta": {"num_heads": None}}, "num_heads"),
        "string-num_heads": ({"meta": {"num_heads": "three"}}, "num_heads"),
        "num_heads-not-the-weights": ({"meta": {"num_heads": "2"}}, r"is torch.float32 \(3, 64.*needs.* \(2, 64"),
        "int32-draft_vocab-with-a-repeat": ({"add": {"draft_vocab": torch.tensor([1, 1, 2], dtype=torch.int32)}},
                                            "draft_vocab must be sorted"),
    },
}
HEAD_CLASSES = {"eagle": EagleHead, "medusa": MedusaHeads}


@pytest.mark.parametrize("kind, case", [(k, c) for k in BAD_HEADS for c in BAD_HEADS[k]])
def test_malformed_head_file_is_named(target, head_files, tmp_path, kind, case):
    edit, message = BAD_HEADS[kind][case]
    path = rewrite(head_files[kind], tmp_path / "edited.safetensors", **edit)
    with pytest.raises(ValueError, match=message) as error:
        HEAD_CLASSES[kind].load(path, target)
    assert str(path) in str(error.value)


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_head_file_that_is_not_safetensors(target, tmp_path, kind):
    path = tmp_path / "head.safetensors"
    path.write_bytes(np.random.default_rng(0).bytes(256))
    with pytest.raises(ValueError, match="not a readable safetensors file") as error:
        HEAD_CLASSES[kind].load(path, target)
    assert str(path) in str(error.value)
