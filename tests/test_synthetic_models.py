"""specdec_ext.models.synthetic: the presets have the published shapes (written out here, from the checkpoints'
config.json), the tiny model's greedy output is not degenerate, weights are a function of the seed, the "head"
stand-in takes its target's width, bad names are refused by name, and output_is_degenerate judges hand-made
sequences. The 1B and 8B models are never built here (GBs): their configs only."""
import pytest
import torch

from specdec_ext.engine import generate_autoregressive
from specdec_ext.models import LlamaConfig, describe_shape, output_is_degenerate, synthetic, synthetic_config

# Tiny models: one intra-op thread (conftest.one_intra_op_thread).
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
# name -> (hidden, heads, KV heads, head_dim, layers, vocab, intermediate, rope theta, rope scaling, tied)
PUBLISHED = {
    "llama-3.2-1b": (2048, 32, 8, 64, 16, 128256, 8192, 500000.0, dict(LLAMA3_ROPE, factor=32.0), True),
    "llama-3.1-8b": (4096, 32, 8, 128, 32, 128256, 14336, 500000.0, dict(LLAMA3_ROPE, factor=8.0), False),
}


def shape(config: LlamaConfig) -> tuple:
    c = config
    return (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.num_hidden_layers,
            c.vocab_size, c.intermediate_size, c.rope_theta, c.rope_scaling, c.tie_word_embeddings)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_have_the_published_shapes(name):
    config = synthetic_config(name)
    assert shape(config) == PUBLISHED[name]
    assert config.rms_norm_eps == 1e-5 and config.max_position_embeddings == 131072
    assert config.bos_token_id == 128000 and config.eos_token_id == [128001]
    assert not config.attention_bias and config.model_type == "llama"


def test_describe_shape_states_the_shape_and_parameter_count():
    # 1,235,814,400 weights (the tied LM head once): Llama 3.2 1B's published 1.24B; 8,030,261,248: 8.03B
    assert describe_shape(synthetic_config("llama-3.2-1b")) == (
        "hidden 2048, 16 layers, 32/8 heads, head_dim 64, intermediate 8192, vocab 128256, rope theta 500000, "
        "tied, 1.24B parameters")
    assert describe_shape(synthetic_config("llama-3.1-8b")).endswith("untied, 8.03B parameters")


def test_tiny_runs_on_the_cuda_kernels_head_dims():
    config = synthetic_config("tiny")
    assert config.head_dim in (16, 32, 64, 128, 256)  # the CUDA attention kernel's
    assert config.num_hidden_layers >= 2 and config.num_attention_heads > config.num_key_value_heads
    assert not config.tie_word_embeddings and config.rope_scaling is None


def random_prompt(vocab_size: int, length: int, seed: int) -> list[int]:
    return torch.randint(vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tiny_greedy_output_is_not_degenerate(seed):
    model = synthetic("tiny", seed=seed)
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    prompt = random_prompt(model.config.vocab_size, 6, 1000 + seed)
    out = generate_autoregressive(model, [prompt], 128).sequences[0]
    assert len(out) == 128
    assert len(set(out)) >= 32, out
    for period in range(1, 9):  # no tail of 16 tokens (or more) repeating with a period of 8 or less
        assert any(out[i] != out[i - period] for i in range(128 - 16 + period, 128)), (period, out)
    assert output_is_degenerate(out) is None


@pytest.mark.parametrize("seed", [0, 1])
def test_tied_embeddings_do_not_make_the_model_repeat_its_input(seed):
    """Llama 3.2 1B ties its LM head to the embedding, which then favours the current token: a one-layer tied model
    at tiny's width (the hardest case: the least residual stream next to the embedding) does not repeat it."""
    target = LlamaConfig.from_dict({"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512,
                                    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                                    "head_dim": 64, "tie_word_embeddings": True})
    model = synthetic("head", seed=seed, target_config=target)
    assert len(model.layers) == 1 and model.lm_head is model.embed_tokens
    out = generate_autoregressive(model, [random_prompt(4096, 6, 2000 + seed)], 128).sequences[0]
    assert output_is_degenerate(out) is None, out
    assert sum(a == b for a, b in zip(out, out[1:])) <= 4, out  # repeats of the token just read: rare


def test_tiny_logits_have_a_few_units_of_spread():
    model = synthetic("tiny", seed=0)
    ids = torch.tensor([random_prompt(model.config.vocab_size, 8, 0)])  # [1, 8]
    with torch.no_grad():
        logits = model(ids, model.new_kv_cache(1, 8))  # [1, 8, V]
    std = logits.std(-1)  # [1, 8]
    assert bool(((std > 1) & (std < 10)).all()), std
    assert len(set(logits.argmax(-1)[0].tolist())) > 1  # not one token whatever the input


def weights(model) -> dict:
    return {name: model.slot(name).clone() for name in model.weight_names()}


def test_the_seed_fixes_the_weights_and_the_output():
    a, b, c = synthetic("tiny", seed=5), synthetic("tiny", seed=5), synthetic("tiny", seed=6)
    wa, wb, wc = weights(a), weights(b), weights(c)
    assert wa.keys() == wb.keys() == wc.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
        if not name.endswith("norm.weight"):  # the norms are ones whatever the seed
            assert not torch.equal(wa[name], wc[name]), name
    prompt = random_prompt(a.config.vocab_size, 5, 0)
    out_a, out_b, out_c = (generate_autoregressive(m, [prompt], 32).sequences[0] for m in (a, b, c))
    assert out_a == out_b
    assert out_a != out_c


def test_weights_are_drawn_in_the_models_dtype():
    model = synthetic("tiny", dtype=torch.bfloat16, seed=0)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert float(model.slot("model.layers.0.mlp.down_proj.weight").float().std()) > 0


def test_head_is_one_layer_at_the_targets_width():
    target = synthetic_config("llama-3.1-8b")
    head = synthetic_config("head", target_config=target)
    assert head.num_hidden_layers == 1
    assert (head.hidden_size, head.vocab_size, head.intermediate_size, head.num_attention_heads,
            head.num_key_value_heads, head.head_dim) == (4096, 128256, 14336, 32, 8, 128)
    assert target.num_hidden_layers == 32  # the target's config is not changed
    model = synthetic("head", seed=0, target_config=synthetic_config("tiny"))
    assert len(model.layers) == 1 and model.config.hidden_size == 256 and model.config.vocab_size == 4096


def test_bad_names_and_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="target_config"):
        synthetic_config("head")
    with pytest.raises(ValueError, match="target_config"):
        synthetic("head")
    with pytest.raises(ValueError, match="llama-3.2-1b") as error:
        synthetic("llama-3.2-2b")
    assert "'llama-3.2-2b'" in str(error.value) and "tiny" in str(error.value)
    with pytest.raises(ValueError, match="llama-3.1-8b"):
        synthetic_config("gpt2")


def test_output_is_degenerate_judges_hand_made_sequences():
    good = list(range(100, 228))  # 128 distinct tokens
    assert output_is_degenerate(good) is None
    assert "period 1" in output_is_degenerate([7] * 128)
    assert "distinct" in output_is_degenerate(list(range(20)) * 6)  # 20 distinct, no short period
    assert output_is_degenerate(list(range(20)) * 6, min_distinct=20) is None
    for period in (3, 8):  # after 64 distinct tokens, 64 tokens repeating with this period
        tokens = good[:64] + [1000 + i % period for i in range(64)]
        assert output_is_degenerate(tokens) == f"the last 64 tokens repeat with period {period}"
    nine = good[:64] + [1000 + i % 9 for i in range(64)]
    assert output_is_degenerate(nine) is None  # longer than max_period
    assert "period 9" in output_is_degenerate(nine, max_period=9)
    # a tail of two periods only (by chance in a good output) is not periodic; the same tail three times is
    assert output_is_degenerate(good[:120] + [1, 2, 3, 4, 1, 2, 3, 4]) is None
    assert "period 1" in output_is_degenerate(good[:100] + [5] * 28)
    assert output_is_degenerate(good[:120] + [5] * 8) is None
