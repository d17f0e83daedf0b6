"""quantized_linear's 8-bit-activation path (activations="int8"): the activations' quantisation against a reference
written here (numpy float32), the integer kernels against float64 products of those quantised activations with the
dequantised weights, for every block format, instruction set (forced through SPECDEC_CPU_ISA) and thread count;
every output row bit-identical whatever the number of rows in the call (1-128) and on every instruction set; the
CUDA kernel's source under the emulator multiplying exactly the same quantised values; and a model kept quantised
with 8-bit activations against the same model with float activations."""
import numpy as np
import pytest
import torch

from helpers.quantized import FORMATS, columns, random_blocks, reference_weight
from specdec_ext import ops


def quantise_reference(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 -> q d per unit of 32 (float32), as the docs define it: d = max |x| / 127, q =
    round-half-even(x 127 / max |x|) clamped to [-127, 127], 0 for a unit of zeros."""
    units = x.numpy().astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(units).max(-1, keepdims=True)
    scale = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(np.clip(units * inverse, np.float32(-127), np.float32(127)))
    assert q.dtype == np.float32 and scale.dtype == np.float32
    return torch.from_numpy((q * scale).reshape(x.shape))


def identity_q8_0(k: int) -> torch.Tensor:
    """[k, k] Q8_0 blocks of the identity (d = 1): y = x's quantised values, each q d rounded once."""
    blocks = torch.zeros(k, k // 32, 34, dtype=torch.uint8)
    blocks[:, :, 0:2] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    for n in range(k):
        blocks[n, n // 32, 2 + n % 32] = 1
    return blocks.reshape(k, -1)


def test_activations_quantised_as_documented(gen):
    """Through a Q8_0 identity the int8 path returns its quantised activations: equal to the reference bit for
    bit, on units of mixed magnitudes, a unit of zeros, values at the rounding boundary, and exact small integers; a
    unit too small for 127 / max |x| (divided by its scale instead) within half a step."""
    k = 128
    x = torch.randn(6, k, generator=gen) * torch.logspace(-6, 3, 6).unsqueeze(1)
    x[0, 32:64] = 0.0
    x[1, :32] = torch.arange(-16, 16) + 0.5  # halves: q = x 127 / 15.5 lands near .5 for some
    x[2, :32] = torch.arange(-127, 129, 8).float()  # integers with max 121: q = round(x 127 / 121)
    x[3, 64:96] = torch.randn(32, generator=gen) * 1e-38  # max |x| < 127 / FLT_MAX: 127 / max |x| overflows
    want = quantise_reference(x)
    got = ops.quantized_linear(x, identity_q8_0(k), 8, activations="int8")
    tiny = slice(64, 96)
    d = float(x[3, tiny].abs().max()) / 127
    assert torch.isfinite(got[3, tiny]).all() and float((got[3, tiny] - x[3, tiny]).abs().max()) <= 0.5001 * d
    got[3, tiny], want[3, tiny] = 0.0, 0.0  # (the reference's own 127 / max |x| overflows there)
    assert torch.equal(got, want), float((got - want).abs().max())
    assert torch.equal(got[0, 32:64], torch.zeros(32))
    assert not torch.equal(got, x)  # the quantisation did happen (a planted "float" would fail here)


def test_non_finite_activations_poison_their_rows(gen):
    k = 64
    blocks = random_blocks(gen, 3, 9, k)
    x = torch.randn(3, k, generator=gen)
    x[1, 40] = float("inf")
    x[2, 3] = float("nan")
    got = ops.quantized_linear(x, blocks, 3, activations="int8")
    assert torch.isfinite(got[0]).all() and torch.isnan(got[1:]).all()


@pytest.mark.parametrize("threads", [1, 2], ids=lambda t: f"threads{t}")
@pytest.mark.parametrize("name", FORMATS)
def test_int8_matches_float64_and_rows_do_not_depend_on_m(name, isa, threads, gen):
    """Against float64 products of the reference's quantised activations with gguf's dequantised weights (float32
    accumulation apart), and every row of every call of 1..128 rows (at varying offsets) bit-identical to that
    row in the call of all 128."""
    format = FORMATS[name]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        k, n = columns(format)[1], 37  # 37 rows: groups of 8 and a last one of 5
        blocks = random_blocks(gen, format, n, k)
        w = reference_weight(blocks, format).double()
        x = torch.randn(128, k, generator=gen) * torch.rand(128, 1, generator=gen) * 4
        bias = torch.randn(n, generator=gen)
        full = ops.quantized_linear(x, blocks, format, bias, activations="int8")
        want = quantise_reference(x).double() @ w.T + bias.double()
        err = float((full.double() - want).norm() / want.norm())
        assert err <= 2e-6, (name, isa, threads, err)
        float_err = float((ops.quantized_linear(x, blocks, format, bias).double() - want).norm() / want.norm())
        assert float_err > 20 * err  # the reference sees the quantisation: the float path is far from it
        for m in range(1, 129):
            start = (m * 37) % (129 - m)
            got = ops.quantized_linear(x[start:start + m], blocks, format, bias, activations="int8")
            assert torch.equal(got, full[start:start + m]), (name, isa, threads, m, start)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name", FORMATS)
def test_int8_same_bits_on_every_isa(name, monkeypatch, gen):
    """The kernels keep one weight row per vector lane and never add across lanes: VNNI (where the CPU has it),
    AVX2 and scalar return the same bits."""
    format = FORMATS[name]
    k = columns(format)[1]
    blocks = random_blocks(gen, format, 21, k)
    x = torch.randn(19, k, generator=gen)
    results = {}
    for isa in ("avx512", "avx2", "sse2"):
        monkeypatch.setenv("SPECDEC_CPU_ISA", isa)
        try:
            ops.cpu_isa()
        except ValueError:
            continue
        results[isa] = ops.quantized_linear(x, blocks, format, activations="int8")
    assert "sse2" in results and len(results) >= 2
    for isa, got in results.items():
        assert torch.equal(got, results["sse2"]), (name, isa)


def test_int8_dtypes_shapes_and_bad_inputs(gen):
    blocks = random_blocks(gen, 12, 10, 256)
    x = torch.randn(2, 3, 256, generator=gen)
    y = ops.quantized_linear(x, blocks, 12, activations="int8")
    assert y.shape == (2, 3, 10) and y.dtype == torch.float32
    assert torch.equal(y.reshape(6, 10), ops.quantized_linear(x.reshape(6, 256), blocks, 12, activations="int8"))
    xb = x.bfloat16()
    yb = ops.quantized_linear(xb, blocks, 12, activations="int8")
    assert yb.dtype == torch.bfloat16
    assert torch.equal(yb, ops.quantized_linear(xb.float(), blocks, 12, activations="int8").bfloat16())
    for bad in ("INT8", "int4", "", None):
        with pytest.raises(ValueError, match="activations must be"):
            ops.quantized_linear(x, blocks, 12, activations=bad)
    with pytest.raises(ValueError, match='activations must be "float" or "int8"'):
        torch.ops.specdec.quantized_linear(x[0], blocks, 12, None, "int4")


def test_opcheck(gen):
    blocks = random_blocks(gen, 3, 10, 64)
    x, b = torch.randn(3, 64, generator=gen), torch.randn(10, generator=gen)
    torch.library.opcheck(torch.ops.specdec.quantized_linear.default, (x, blocks, 3, b, "int8"))


@pytest.mark.parametrize("name", FORMATS)
def test_emulated_cuda_kernel_multiplies_the_same_quantised_values(name, gen):
    """CUDA has no integer kernel: its launcher quantises the activations as the CPU does and multiplies them as
    floats. Its result equals the kernel's on the reference's quantised values bit for bit, and the CPU's integer
    path within float32 accumulation."""
    from specdec_ext import sim

    format = FORMATS[name]
    k = columns(format)[0]
    blocks = random_blocks(gen, format, 13, k)
    x = torch.randn(5, k, generator=gen) * 3
    x[4, :32] = 0.0
    got = sim.quantized_linear(x, blocks, format, activations="int8")
    assert torch.equal(got, sim.quantized_linear(quantise_reference(x), blocks, format))
    cpu = ops.quantized_linear(x, blocks, format, activations="int8")
    assert float((got - cpu).double().norm() / cpu.double().norm()) <= 4e-6
    with pytest.raises(ValueError, match="activations must be"):
        sim.quantized_linear(x, blocks, format, activations="int16")


# ------------------------------------------------------------------------------- the shipped model, 8-bit activations

def test_shipped_model_int8_against_dequantised_float32():
    """The approximation stated in docs/decoding.md, over the whole shipped prompt set (237 prompts, 12,121 positions,
    teacher-forced): the largest |logit difference| from the dequantised float32 model (measured 4.24) and the share of
    positions whose argmax agrees (measured 0.968; the bfloat16 model's is about 0.974)."""
    from helpers.models import shipped_model
    from specdec_ext.factory import prompt_ids
    from specdec_ext.models import LlamaForCausalLM, default_model_path
    from specdec_ext.training import load_prompts

    reference, tokenizer = shipped_model()
    kept = LlamaForCausalLM.from_pretrained(default_model_path(), keep_quantized=True)
    assert kept.activations == "int8"  # the default for weights kept quantised on the CPU
    largest, agree, positions = 0.0, 0, 0
    with torch.no_grad():
        for prompt in load_prompts("train") + load_prompts("heldout"):
            ids = torch.tensor([prompt_ids(tokenizer, prompt["prompt"])])
            want = reference(ids, reference.new_kv_cache(1, ids.shape[1]))
            got = kept(ids, kept.new_kv_cache(1, ids.shape[1]))
            largest = max(largest, float((got - want).abs().max()))
            agree += int((got.argmax(-1) == want.argmax(-1)).sum())
            positions += ids.shape[1]
    assert positions > 10_000
    assert 0.05 < largest <= 5.0, largest  # not zero: the activations were quantised
    assert agree / positions >= 0.95, agree / positions


def test_shipped_model_int8_speculative_greedy_equals_plain():
    """Greedy speculative decoding of the model kept quantised with 8-bit activations is its plain greedy decoding,
    token for token: n-gram chains, the shipped EAGLE head (on the integer kernels too) in chains and in trees of 16
    nodes, the shipped Medusa heads' trees and Lookahead. A verify block's rows have the bits of one-row steps: the
    GEMM's rows do not depend on the call's other rows (linear_int8.h), and a tree row attends to its ancestors at
    their positions (cpu/verify_attention.cpp)."""
    from helpers.models import shipped_model
    from specdec_ext import EagleDrafter, LookaheadDrafter, MedusaDrafter, NgramDrafter, SpeculativeDecoder
    from specdec_ext.engine import generate_autoregressive
    from specdec_ext.factory import prompt_ids
    from specdec_ext.models import LlamaForCausalLM, default_head_path, default_model_path
    from specdec_ext.models.draft_heads import EagleHead, MedusaHeads
    from specdec_ext.models.quantized import QuantizedWeight
    from specdec_ext.trees import TreeSettings

    _, tokenizer = shipped_model()
    kept = LlamaForCausalLM.from_pretrained(default_model_path(), keep_quantized=True, activations="int8")
    prompts = [prompt_ids(tokenizer, "Repeat this sentence twice: 'The lighthouse keeper climbed the stairs at dusk.'"),
               prompt_ids(tokenizer, "How do I keep a sourdough starter alive?")]
    eos = tokenizer.eos_token_id
    want = [generate_autoregressive(kept, [p], 40, eos_token_id=eos).sequences[0] for p in prompts]
    head = EagleHead.load(default_head_path("eagle"), kept)
    assert head.on_integer_kernels and head.decoder.activations == "int8"
    medusa = MedusaHeads.load(default_head_path("medusa"), kept)
    assert isinstance(medusa.lm_head_blocks, QuantizedWeight)  # the target's blocks of the draft vocabulary's rows
    for drafter, settings in ((NgramDrafter(), dict(num_speculative_tokens=6)),
                              (EagleDrafter(kept, head), dict(num_speculative_tokens=8)),
                              (EagleDrafter(kept, head), dict(tree=TreeSettings(num_nodes=16), adaptive=False)),
                              (MedusaDrafter(kept, medusa), dict(tree=TreeSettings(num_nodes=12), adaptive=False)),
                              (LookaheadDrafter(window=4, ngram=4, guesses=3), dict(adaptive=False))):
        dec = SpeculativeDecoder(kept, drafter, max_batch_size=1, **settings)
        for p, w in zip(prompts, want):
            out = dec.generate([p], 40, eos_token_id=eos)
            assert out.sequences[0] == w, type(drafter).__name__
            assert out.stats.num_draft_tokens > 0


def test_cost_tables_keep_kept_and_int8_models_apart(tmp_path):
    """The adaptive policy's cost tables are cached per model kind: a model kept quantised, with float or 8-bit
    activations, and the same file dequantised each get their own table (one shared before this key)."""
    from test_quantized_linear import write_mixed_gguf

    from specdec_ext import cost_tables
    from specdec_ext.models import LlamaForCausalLM

    path = write_mixed_gguf(tmp_path, tied=True)
    models = [LlamaForCausalLM.from_pretrained(path), LlamaForCausalLM.from_pretrained(path, keep_quantized=True),
              LlamaForCausalLM.from_pretrained(path, keep_quantized=True, activations="float")]
    keys = [cost_tables.table_key(m) for m in models]
    assert keys[0]["weights"] is None
    assert keys[1]["weights"] == {"kept": ["Q4_0", "Q4_1", "Q8_0"], "activations": "int8"}
    assert keys[2]["weights"]["activations"] == "float"
    assert len({cost_tables._table_file(k) for k in keys}) == 3


@pytest.mark.slow
def test_law_of_the_first_tokens_on_the_int8_path(tmp_path):
    """The lossless law on the integer path: the law target kept as Q8_0 with 8-bit activations, drafted by the float
    law draft (k = 2, rejection sampling, T = 1, 70,000 requests): its first 3 tokens against the exact law of that
    int8 model (helpers/laws.py: power >= 0.9 against the hardest 1% bias, checked by assert_law)."""
    from helpers.chi_square import assert_law
    from helpers.laws import exact_law, exact_law_of, law_draft, law_target_int8, sample_first_tokens
    from specdec_ext import ModelDrafter

    target = law_target_int8(tmp_path)
    assert target.activations == "int8"
    counts, law, acceptance = sample_first_tokens(target, ModelDrafter(law_draft()), "T=1")
    assert law == exact_law_of(target, 1.0, 0, 1.0)  # the law of the target sampled, not the float one's
    float_law = exact_law(1.0, 0, 1.0)
    assert 0.1 < acceptance < 0.95, acceptance
    assert max(abs(law[s] - float_law[s]) for s in law) > 1e-6  # the int8 model's law is its own
    assert_law(counts, law)


def test_default_activations_and_medusa_training_on_a_kept_target(tmp_path):
    """from_pretrained's default: int8 where weights are kept as blocks on the CPU, float where none are (an F32 file
    loaded with keep_quantized=True). Medusa heads on an int8 target decode with the target's blocks and train, with
    gradients, through their float copy of the rows."""
    from gguf import GGMLQuantizationType as QType
    from test_quantized_linear import write_mixed_gguf
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    from helpers.gguf_files import SMALL, random_model, write_gguf
    from specdec_ext.models import LlamaForCausalLM
    from specdec_ext.models.draft_heads import MedusaHeads

    f32 = write_gguf(tmp_path / "f32.gguf", random_model(HFLlama, LlamaConfig(**SMALL)), "llama", QType.F32)
    assert LlamaForCausalLM.from_pretrained(f32, keep_quantized=True).activations == "float"
    kept = LlamaForCausalLM.from_pretrained(write_mixed_gguf(tmp_path, tied=False), keep_quantized=True)
    assert kept.activations == "int8"
    heads = MedusaHeads(kept, torch.arange(0, 64, 3), 2)
    with torch.no_grad():
        heads.weight.normal_(std=0.05)
    features = torch.randn(3, kept.config.hidden_size)
    with torch.no_grad():
        decoded = heads(features)
    trained = heads(features)
    trained.square().sum().backward()
    assert heads.weight.grad is not None and float(heads.weight.grad.abs().sum()) > 0
    assert not torch.equal(decoded, trained.detach())  # the integer path, and the float copy
    assert float((decoded - trained.detach()).abs().max()) <= 0.05 * float(trained.detach().abs().max())


def test_eagle3_head_on_the_integer_kernels_round_trips_and_equals_plain(tmp_path):
    """An EAGLE-3 head saved, then loaded onto a target kept quantised with 8-bit activations: its fuse, fc and layer
    become Q8_0, its LM head the target's blocks, and greedy chains and trees with it equal plain greedy decoding."""
    from test_quantized_linear import write_mixed_gguf

    from helpers.models import random_prompts
    from specdec_ext import EagleDrafter, SpeculativeDecoder
    from specdec_ext.engine import generate_autoregressive
    from specdec_ext.models import LlamaForCausalLM
    from specdec_ext.models.draft_heads import EagleHead, eagle3_layers
    from specdec_ext.models.quantized import QuantizedWeight
    from specdec_ext.trees import TreeSettings

    kept = LlamaForCausalLM.from_pretrained(write_mixed_gguf(tmp_path, tied=False), keep_quantized=True)
    layers = eagle3_layers(kept.config.num_hidden_layers)
    head = EagleHead(kept, torch.arange(0, kept.config.vocab_size, 2), layers).init_weights(
        torch.Generator().manual_seed(8))
    head.save(tmp_path / "eagle3.safetensors")
    loaded = EagleHead.load(tmp_path / "eagle3.safetensors", kept)
    assert loaded.feature_layers == layers and loaded.on_integer_kernels
    assert isinstance(loaded.fuse_blocks, QuantizedWeight) and isinstance(loaded.decoder.lm_head, QuantizedWeight)
    float_head = EagleHead(kept, head.draft_vocab, layers)
    with torch.no_grad():
        for name, t in head.trained_state().items():
            float_head.trained_state()[name].copy_(t)
    assert all(torch.equal(a, b) for a, b in zip(head.trained_state().values(), float_head.trained_state().values()))
    prompts = random_prompts(3, [6, 11], vocab=kept.config.vocab_size)
    plain = generate_autoregressive(kept, prompts, 20).sequences
    for settings in (dict(num_speculative_tokens=3, adaptive=False), dict(tree=TreeSettings(num_nodes=8),
                                                                          adaptive=False)):
        out = SpeculativeDecoder(kept, EagleDrafter(kept, loaded), max_batch_size=2, **settings).generate(prompts, 20)
        assert out.sequences == plain and out.stats.num_draft_tokens > 0


def test_the_policy_guard_is_for_targets_whose_rows_do_not_depend_on_the_block(tmp_path):
    """SpeculativeDecoder enables the policy's wall-time guard only for a CPU target whose every projection and LM
    head are kept with 8-bit activations (rows with the same bits in any verify block)."""
    from test_quantized_linear import write_mixed_gguf

    from helpers.laws import law_target_int8
    from specdec_ext import NgramDrafter, SpeculativeDecoder
    from specdec_ext.models import LlamaForCausalLM

    mixed = write_mixed_gguf(tmp_path, tied=False)  # its gate/up is one float tensor
    cases = {"all int8": (law_target_int8(tmp_path), True),
             "one float projection": (LlamaForCausalLM.from_pretrained(mixed, keep_quantized=True), False),
             "float activations": (LlamaForCausalLM.from_pretrained(mixed, keep_quantized=True,
                                                                    activations="float"), False),
             "float32": (LlamaForCausalLM.from_pretrained(mixed), False)}
    for name, (model, want) in cases.items():
        assert SpeculativeDecoder(model, NgramDrafter(), 2).policy.rows_invariant is want, name
