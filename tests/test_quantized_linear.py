"""Weights kept as GGUF blocks: ops.dequantize equals the gguf package's dequantize (llama.cpp's reference) bit
for bit, ops.quantized_linear equals float64 products with those weights, for every block format, instruction set
(forced through SPECDEC_CPU_ISA; AVX-512 only on a CPU that has it), thread count and row count (1-16 in registers
or through the scratch, and a prefill's rows in chunks); and a model loaded with keep_quantized=True computes
what the same file dequantised at load computes."""
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from helpers.gguf_files import SMALL, random_model, write_gguf
from helpers.quantized import FORMATS, columns, random_blocks, reference_weight
from specdec_ext import ops
from specdec_ext.models import LlamaForCausalLM
from specdec_ext.models.quantized import QuantizedRowStack, QuantizedWeight


@pytest.mark.parametrize("name", FORMATS)
def test_dequantize_equals_gguf(name, isa, gen):
    format = FORMATS[name]
    for k in columns(format):
        blocks = random_blocks(gen, format, 29, k)
        want = reference_weight(blocks, format)
        got = ops.dequantize(blocks, format)
        assert got.dtype == torch.float32 and got.shape == (29, k)
        # Each weight is one rounding of an exact product (fp16 scale x small integer) either way: equal bits.
        assert torch.equal(got, want), (name, isa, k, float((got - want).abs().max()))
        ids = torch.tensor([[3, 0], [28, 3]])
        assert torch.equal(QuantizedWeight(blocks, format)[ids], want[ids])


@pytest.mark.parametrize("threads", [1, 2], ids=lambda t: f"threads{t}")
@pytest.mark.parametrize("name", FORMATS)
def test_quantized_linear_matches_float64(name, isa, threads, gen):
    format = FORMATS[name]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k in columns(format):
            n = 37  # not a multiple of any tile or panel
            blocks = random_blocks(gen, format, n, k)
            w = reference_weight(blocks, format).double()
            bias = torch.randn(n, generator=gen)
            # 1-16: decode steps and verify blocks (1-4 decode in registers, more through the scratch); 150: a
            # prefill, in chunks of rows.
            for m in [*range(1, 17), 150]:
                x = torch.randn(m, k, generator=gen)
                for b in (None, bias):
                    want = x.double() @ w.T + (0 if b is None else b.double())
                    got = ops.quantized_linear(x, blocks, format, b)
                    assert got.dtype == torch.float32 and got.shape == (m, n)
                    err = float((got.double() - want).norm() / want.norm())
                    assert err <= 2e-6, (name, isa, threads, k, m, err)  # float32 accumulation
            # every element, not just the norm
            x = torch.randn(3, k, generator=gen)
            assert torch.allclose(ops.quantized_linear(x, blocks, format).double(), x.double() @ w.T, rtol=1e-4,
                                  atol=1e-4 * float(w.abs().max()) * k ** 0.5)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name", ["Q4_1", "Q6_K"])
def test_16_bit_activations(name, gen):
    format = FORMATS[name]
    blocks = random_blocks(gen, format, 37, 256)
    w = reference_weight(blocks, format).double()
    for m in (1, 5, 40):
        for dtype in (torch.bfloat16, torch.float16):
            x = torch.randn(m, 256, generator=gen).to(dtype)
            got = ops.quantized_linear(x, blocks, format)
            assert got.dtype == dtype
            want = x.double() @ w.T
            assert float((got.double() - want).norm() / want.norm()) <= 8e-3  # the output rounded to 16 bits


def test_leading_dims_and_bad_inputs(gen):
    blocks = random_blocks(gen, 3, 10, 64)
    x = torch.randn(2, 3, 64, generator=gen)
    w = reference_weight(blocks, 3)
    assert torch.allclose(ops.quantized_linear(x, blocks, 3), x @ w.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="format must be a GGUF block type"):
        ops.quantized_linear(x, blocks, 0)
    with pytest.raises(ValueError, match="format must be a GGUF block type"):
        ops.dequantize(blocks, 7)
    with pytest.raises(ValueError, match="row_bytes a multiple of 20"):
        ops.quantized_linear(x, blocks[:, :30], 3)
    with pytest.raises(ValueError, match="qweight must be a uint8"):
        ops.quantized_linear(x, blocks.to(torch.int8), 3)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 64\]"):
        ops.quantized_linear(torch.randn(2, 65), blocks, 3)
    with pytest.raises(ValueError, match="x must be float32, bfloat16 or float16"):
        ops.quantized_linear(torch.randn(2, 64).double(), blocks, 3)
    with pytest.raises(ValueError, match="bias must be"):
        ops.quantized_linear(torch.randn(2, 64), blocks, 3, torch.randn(9))
    with pytest.raises(ValueError, match="qweight is on meta"):
        ops.quantized_linear(torch.randn(2, 64), blocks.to("meta"), 3)
    with pytest.raises(ValueError, match="QuantizedWeight: dtype"):
        QuantizedWeight(blocks, 3, torch.float16)


def test_opcheck(gen):
    blocks = random_blocks(gen, 8, 10, 64)
    x, b = torch.randn(3, 64, generator=gen), torch.randn(10, generator=gen)
    torch.library.opcheck(torch.ops.specdec.quantized_linear.default, (x, blocks, 8, b))
    torch.library.opcheck(torch.ops.specdec.quantized_linear.default, (x, blocks, 8, None))
    torch.library.opcheck(torch.ops.specdec.dequantize.default, (blocks, 8))


# ------------------------------------------------------------------------- the CUDA kernel under the emulator

@pytest.mark.parametrize("name", FORMATS)
def test_emulated_cuda_kernel_matches_cpu_and_float64(name, gen):
    """The W4/W8 x A16 CUDA kernel's source under the emulator: its weights are decode_unit's, so dequantize equals
    gguf's bit for bit; products equal float64 within float32 accumulation and the CPU kernel within twice that,
    for 1-20 rows (a tile of 16 and a second one), float32, bfloat16 and float16 activations, with a bias."""
    from specdec_ext import sim

    format = FORMATS[name]
    k = columns(format)[0]
    n = 13  # 4 warps a block: a last block with one row
    blocks = random_blocks(gen, format, n, k)
    w = reference_weight(blocks, format)
    assert torch.equal(sim.dequantize(blocks, format), w)
    bias = torch.randn(n, generator=gen)
    for m in (1, 3, 16, 20):
        x = torch.randn(m, k, generator=gen)
        want = x.double() @ w.double().T + bias.double()
        got = sim.quantized_linear(x, blocks, format, bias)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        assert float((got.double() - want).norm() / want.norm()) <= 2e-6, (name, m)
        cpu = ops.quantized_linear(x, blocks, format, bias)
        assert float((got - cpu).double().norm() / want.norm()) <= 4e-6, (name, m)
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(5, k, generator=gen).to(dtype)
        got = sim.quantized_linear(x, blocks, format)
        want = x.double() @ w.double().T
        assert got.dtype == dtype and float((got.double() - want).norm() / want.norm()) <= 8e-3, (name, dtype)


def test_emulated_bad_inputs(gen):
    from specdec_ext import sim

    blocks = random_blocks(gen, 3, 4, 64)
    with pytest.raises(ValueError, match="format must be a GGUF block type"):
        sim.quantized_linear(torch.randn(2, 64), blocks, 7)
    with pytest.raises(ValueError, match="row_bytes a multiple of 144"):
        sim.quantized_linear(torch.randn(2, 64), blocks, 12)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 64\]"):
        sim.quantized_linear(torch.randn(2, 32), blocks, 3)
    with pytest.raises(ValueError, match="bias must be"):
        torch.ops.specdec_sim.quantized_linear(torch.randn(2, 64), blocks, 3, torch.randn(4).double())


# ------------------------------------------------------------------------------------------ models kept quantised

def write_mixed_gguf(tmp_path, tied, **config):
    """A llama GGUF whose projections mix formats as real files do: q/k Q4_0 with v Q8_0 (a row stack), gate F32
    with up Q4_1 (dequantised at load: a fused projection with a float part), o Q4_1, down Q8_0, embedding Q8_0.
    config: overrides of SMALL (sizes multiples of 32, the blocks' width)."""
    model = random_model(HFLlama, LlamaConfig(**{**SMALL, **config}, tie_word_embeddings=tied))
    types = {"token_embd.weight": QType.Q8_0, "output.weight": QType.Q4_1}
    for i in range(SMALL["num_hidden_layers"]):
        types.update({f"blk.{i}.attn_q.weight": QType.Q4_0, f"blk.{i}.attn_k.weight": QType.Q4_0,
                      f"blk.{i}.attn_v.weight": QType.Q8_0, f"blk.{i}.attn_output.weight": QType.Q4_1,
                      f"blk.{i}.ffn_gate.weight": QType.F32, f"blk.{i}.ffn_up.weight": QType.Q4_1,
                      f"blk.{i}.ffn_down.weight": QType.Q8_0})
    return write_gguf(tmp_path / "mixed.gguf", model, "llama", tensor_types=types)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_kept_model_equals_dequantised_model(tmp_path, tied):
    path = write_mixed_gguf(tmp_path, tied)
    plain = LlamaForCausalLM.from_pretrained(path)
    kept = LlamaForCausalLM.from_pretrained(path, keep_quantized=True, activations="float")
    assert kept.activations == "float" and plain.activations == "float"
    layer = kept.layers[0]
    assert isinstance(layer.qkv_proj, QuantizedRowStack) and [p.format for p in layer.qkv_proj.parts] == [2, 8]
    assert isinstance(layer.o_proj, QuantizedWeight) and layer.o_proj.format == 3
    assert isinstance(layer.down_proj, QuantizedWeight) and layer.down_proj.format == 8
    assert isinstance(layer.gate_up_proj, torch.Tensor)  # F32 gate + Q4_1 up: dequantised into one tensor
    assert torch.equal(layer.gate_up_proj, plain.layers[0].gate_up_proj)
    assert isinstance(kept.embed_tokens, QuantizedWeight) and kept.embed_tokens.format == 8
    assert (kept.lm_head is kept.embed_tokens) == tied
    assert kept.dtype == torch.float32
    for name in ("qkv_proj", "o_proj", "down_proj"):  # the same weights, rows in Hugging Face order (q/k unpermuted)
        assert torch.equal(getattr(layer, name).dequantize(), getattr(plain.layers[0], name)), name
    ids = torch.tensor([[1, 5, 9, 33, 2, 63, 17, 40, 8, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]])
    for q in (1, 4, 19):  # decode, a verify block in registers, a prefill through the scratch
        caches = [m.new_kv_cache(1, 64) for m in (plain, kept)]
        with torch.no_grad():
            want = plain(ids[:, :q], caches[0])
            got = kept(ids[:, :q], caches[1])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_keep_quantized_refuses_what_it_cannot_keep(tmp_path):
    path = write_mixed_gguf(tmp_path, tied=True)
    with pytest.raises(ValueError, match="keep_quantized runs float32 or bfloat16"):
        LlamaForCausalLM.from_pretrained(path, keep_quantized=True, dtype=torch.float16)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="keep_quantized needs a .gguf file"):
        LlamaForCausalLM.from_pretrained(tmp_path / "hf", keep_quantized=True)
    with pytest.raises(ValueError, match="activations must be one of"):
        LlamaForCausalLM.from_pretrained(path, keep_quantized=True, activations="int4")
    with pytest.raises(ValueError, match="needs weights kept as GGUF blocks"):
        LlamaForCausalLM.from_pretrained(path, activations="int8")


@pytest.mark.parametrize("activations", ["float", "int8"])
def test_target_and_draft_quantised_independently(tmp_path, activations):
    """A ModelDrafter over the file kept quantised drafts for the float target, and a float draft for the target
    kept quantised (float or 8-bit activations): greedy speculative output equals each target's plain greedy
    decoding."""
    from specdec_ext import ModelDrafter, SpeculativeDecoder
    from specdec_ext.engine import generate_autoregressive

    path = write_mixed_gguf(tmp_path, tied=False)
    plain = LlamaForCausalLM.from_pretrained(path)
    kept = LlamaForCausalLM.from_pretrained(path, keep_quantized=True, activations=activations)
    assert kept.activations == activations
    prompts = [[1, 5, 9, 33, 2], [7, 7, 8, 40, 41, 42, 7, 7]]
    for target, draft in ((plain, kept), (kept, plain)):
        dec = SpeculativeDecoder(target, ModelDrafter(draft), 3, max_batch_size=2)
        out = dec.generate(prompts, 12)
        assert out.stats.num_draft_tokens > 0
        assert out.sequences == generate_autoregressive(target, prompts, 12).sequences
