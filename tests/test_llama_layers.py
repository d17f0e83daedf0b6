"""The C++ layer loop (torch.ops.specdec_internal.llama_layers, cpu/llama_layers.cpp) against models/llama.py's Python
loop: the same ops on the same arguments, so the same bits, for float32 and bfloat16 models, weights kept quantised
(row stacks of two formats and a dequantised float part) with float and 8-bit activations, decode steps, chains, trees,
ragged prefill, static and paged caches and a subset of a cache's requests; and where the Python loop still runs."""
import pytest
import torch
from test_quantized_linear import write_mixed_gguf

from helpers.models import hf_case, tiny_model
from specdec_ext.models import LlamaForCausalLM
from specdec_ext.models.llama import MAX_ATTENTION_QUERIES


def python_loop(monkeypatch):
    monkeypatch.setattr(LlamaForCausalLM, "cpu_step_args", lambda *args, **kwargs: None)


def forwards(model, gen, paged: bool, hidden=True):
    """Logits and hidden states (hidden: output_hidden_states, True or layers) of a prefill, a decode step, a chain,
    a tree and a ragged prefill, on one cache."""
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 40), generator=gen)
    cache = model.new_kv_cache(2, 96, paged=paged, page_size=16)
    out = []
    with torch.no_grad():
        cache.reserve(17)
        out.append(model(ids[:, :17], cache, output_hidden_states=hidden))
        cache.advance(17)
        for width in (1, 5):
            cache.reserve(width)
            out.append(model(ids[:, 17:17 + width], cache, output_hidden_states=hidden))
            cache.advance(width)
        mask = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0], [1, 1, 0, 1, 0, 0],
                             [1, 0, 1, 0, 1, 0], [1, 1, 0, 1, 0, 1]], dtype=torch.bool)
        cache.reserve(6)
        out.append(model(ids[:, 30:36], cache, tree_mask=mask, output_hidden_states=hidden))
        cache.advance(3)  # a tree's first three nodes kept, as a round would not, but lengths are all that matter
        one = model.new_kv_cache(3, 64, paged=paged, page_size=16)
        one.reserve([7, 0, 4], requests=[0, 1, 2])
        out.append(model(ids[:1, :11], one, qo_indptr=[0, 7, 7, 11], output_hidden_states=hidden))
        sub = model.new_kv_cache(3, 64, paged=paged, page_size=16)
        sub.reserve(3)
        out.append(model(ids[:2, :3], sub, cache_rows=slice(1, 3), output_hidden_states=hidden))
    return out


def assert_same(got, want):
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            assert torch.equal(a, b), float((a.float() - b.float()).abs().max())


@pytest.mark.parametrize("hidden", [True, (1, 0)], ids=["last", "layers"])  # layers: EAGLE-3's features
@pytest.mark.parametrize("paged", [False, True], ids=["static", "paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["llama-gqa2-tied", "qwen2-gqa2"])  # Qwen2: q/k/v biases
def test_float_models_equal_the_python_loop(case, dtype, paged, hidden, monkeypatch, gen):
    model = LlamaForCausalLM.from_hf(hf_case(case), dtype=dtype)
    assert (model.layers[0].qkv_bias is not None) == case.startswith("qwen2")
    assert model.cpu_step_args(torch.zeros(1, 1, model.config.hidden_size, dtype=dtype), model.new_kv_cache(1, 8),
                               slice(None), 1, None) is not None  # the C++ loop does run here
    got = forwards(model, torch.Generator().manual_seed(gen.initial_seed()), paged, hidden)
    python_loop(monkeypatch)
    assert_same(got, forwards(model, torch.Generator().manual_seed(gen.initial_seed()), paged, hidden))


def test_layer_outputs_are_transformers_hidden_states(gen):
    """output_hidden_states=(layers): the residual stream after each layer, side by side: layer 0's as transformers'
    hidden states give it (entry 1; its last entry is after the final norm), the last layer's as
    output_hidden_states=True does; in the C++ loop (a cache) and without a cache."""
    hf = hf_case("llama-gqa2-tied")
    model = LlamaForCausalLM.from_hf(hf)
    ids = torch.randint(0, model.config.vocab_size, (2, 13), generator=gen)
    with torch.no_grad():
        want = hf(ids, output_hidden_states=True).hidden_states
        cache = model.new_kv_cache(2, 16)
        cache.reserve(13)
        _, cached = model(ids, cache, output_hidden_states=(1, 0))
        _, whole = model(ids, None, output_hidden_states=(0, 1))
        _, last = model(ids, None, output_hidden_states=True)
    h = model.config.hidden_size
    assert model.config.num_hidden_layers == 2
    torch.testing.assert_close(cached, torch.cat((last, want[1]), -1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(whole[..., :h], want[1], rtol=1e-4, atol=1e-4)
    assert torch.equal(whole[..., h:], last)
    for bad in ((), (0, 0), (2,), (True,), [0]):
        with pytest.raises(ValueError, match="output_hidden_states"):
            model(ids, None, output_hidden_states=bad)


@pytest.mark.parametrize("paged", [False, True], ids=["static", "paged"])
@pytest.mark.parametrize("activations", ["float", "int8"])
def test_kept_models_equal_the_python_loop(tmp_path, activations, paged, monkeypatch, gen):
    """A file that mixes formats as real ones do: q/k Q4_0 with v Q8_0 (a row stack), o Q4_1, down Q8_0, gate F32
    with up Q4_1 (one float tensor): every kind of projection the C++ loop multiplies."""
    model = LlamaForCausalLM.from_pretrained(write_mixed_gguf(tmp_path, tied=False), keep_quantized=True,
                                             activations=activations)
    got = forwards(model, torch.Generator().manual_seed(gen.initial_seed()), paged)
    python_loop(monkeypatch)
    assert_same(got, forwards(model, torch.Generator().manual_seed(gen.initial_seed()), paged))


def test_where_the_python_loop_runs(tmp_path, monkeypatch):
    from specdec_ext import sim

    model = tiny_model()
    x = torch.zeros(1, 1, model.config.hidden_size)
    cache = model.new_kv_cache(1, 200)
    assert model.cpu_step_args(x, cache, slice(None), 1, None) is not None
    assert model.cpu_step_args(x, cache, slice(None), MAX_ATTENTION_QUERIES + 1, None) is None  # chunked blocks
    assert model.cpu_step_args(x, None, slice(None), 1, None) is None  # no cache: training
    assert model.cpu_step_args(x, object(), slice(None), 1, None) is None  # an engine's cache
    assert model.cpu_step_args(x, model.new_kv_cache(3, 8), slice(0, 3, 2), 1, None) is None  # rows with a step
    monkeypatch.setattr(model, "ops", sim)  # the shared model: restored after the test
    assert model.cpu_step_args(x, cache, slice(None), 1, None) is None  # the emulated CUDA kernels
    kept = LlamaForCausalLM.from_pretrained(write_mixed_gguf(tmp_path, tied=True), keep_quantized=True)
    kept.layers[0].o_proj.activations = "float"  # one weight unlike the others
    assert kept.cpu_step_args(x, kept.new_kv_cache(1, 8), slice(None), 1, None) is None
    kept.activations = "float"
    assert kept.cpu_step_args(x, kept.new_kv_cache(1, 8), slice(None), 1, None)[4] == "float"


def test_bad_arguments_are_named():
    x = torch.zeros(1, 1, 8)
    with pytest.raises(ValueError, match="llama_layers: inconsistent arguments"):
        torch.ops.specdec_internal.llama_layers(x, x, x, [], [], [0, 0, 0], [None], [x[0, 0]], [], 1e-5, 1, 1,
                                                "float", torch.zeros(1, 1, 1, 1, 1), torch.zeros(1, 1, 1, 1, 1),
                                                torch.zeros(1, dtype=torch.int32), None, 0, 1, None, None, None, [],
                                                [])


def test_a_cache_layer_outside_the_cache_is_refused(gen):
    """cache_layers (a subset of the layers, each on its own layer of the cache) names layers of the cache only."""
    model = tiny_model(vocab=16, seed=1234, logit_scale=0.3, layers=4)
    x = torch.zeros(1, 1, model.config.hidden_size)
    cache = model.new_kv_cache(1, 4)
    args = model.cpu_step_args(x, cache, slice(None), 1, None, [model.layers[0]])
    weights, formats, parts, biases, activations, k, v, table, start, stop = args
    cos = sin = torch.ones(1, 1, 1, model.config.head_dim)
    layer = model.layers[0]
    with pytest.raises(ValueError, match="llama_layers: cache layer 4 outside the cache's 4"):
        torch.ops.specdec_internal.llama_layers(x, cos, sin, weights, formats, parts, biases, [layer.input_layernorm],
                                                [layer.post_attention_layernorm], 1e-5, 4, 2, activations, k, v,
                                                cache.cache_seqlens, table, start, stop, None, None, None, [], [4])
