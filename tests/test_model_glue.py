"""The CPU's one-call elementwise steps of a decoder layer (cpu/model_glue.cpp) against the torch expressions they
replace (models/llama.py's own, and transformers' for RoPE): RoPE and SiLU bit for bit, the norms within float32
rounding; and a model forward on them equals the forward on torch's ops."""
import pytest
import torch
import torch.nn.functional as F

import specdec_ext.models.llama as llama
from helpers.models import shared_hf
from specdec_ext.models import LlamaForCausalLM

DTYPES = [torch.float32, torch.bfloat16]


def torch_rms_norm(x, w, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_and_add_rms_norm(dtype, gen):
    for shape in [(1, 1, 576), (3, 5, 64), (7, 1)]:
        x = (torch.randn(shape, generator=gen) * 3).to(dtype)
        d = torch.randn(shape, generator=gen).to(dtype)
        w = torch.randn(shape[-1], generator=gen).to(dtype)
        want = torch_rms_norm(x, w, 1e-5)
        got = torch.ops.specdec.rms_norm(x, w, 1e-5)
        tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
        torch.testing.assert_close(got, want, **tol)
        residual = x.clone()
        got = torch.ops.specdec.add_rms_norm(residual, d, w, 1e-5)
        assert torch.equal(residual, x + d)  # added in place, rounded as torch rounds
        torch.testing.assert_close(got, torch_rms_norm(x + d, w, 1e-5), **tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_split_is_transformers_rope_bit_for_bit(dtype, gen):
    b, q, hq, hkv, d = 2, 3, 4, 2, 16
    qkv = torch.randn(b, q, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    angles = torch.rand(b, q, 1, d // 2, generator=gen) * 50
    angles = torch.cat((angles, angles), -1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)

    def rope(x):  # transformers' apply_rotary_pos_emb
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin

    qw, kw, vw = qkv.split([hq * d, hkv * d, hkv * d], -1)
    got = torch.ops.specdec.rotary_split(qkv, cos, sin, hq, hkv)
    for g, want in zip(got, (rope(qw.reshape(b, q, hq, d)), rope(kw.reshape(b, q, hkv, d)), vw.reshape(b, q, hkv, d))):
        assert g.is_contiguous() and torch.equal(g, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul(dtype, gen):
    gate_up = (torch.randn(3, 2, 2 * 40, generator=gen) * 4).to(dtype)
    gate, up = gate_up.chunk(2, -1)
    assert torch.equal(torch.ops.specdec.silu_mul(gate_up), F.silu(gate) * up)


def test_bad_inputs_name_themselves():
    with pytest.raises(ValueError, match="weight must be a contiguous"):
        torch.ops.specdec.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5)
    with pytest.raises(ValueError, match="delta must be"):
        torch.ops.specdec.add_rms_norm(torch.randn(2, 8), torch.randn(2, 7), torch.randn(8), 1e-5)
    with pytest.raises(ValueError, match="qkv must be a contiguous"):
        torch.ops.specdec.rotary_split(torch.randn(1, 1, 30), torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4), 4, 2)
    with pytest.raises(ValueError, match="cos and sin must be"):
        torch.ops.specdec.rotary_split(torch.randn(1, 1, 32), torch.randn(1, 1, 1, 2), torch.randn(1, 1, 1, 4), 4, 2)
    with pytest.raises(ValueError, match="gate_up must be"):
        torch.ops.specdec.silu_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="rms_norm: no kernel for dtype"):
        torch.ops.specdec.rms_norm(torch.randn(2, 8).half(), torch.randn(8).half(), 1e-5)
    with pytest.raises(ValueError, match="no kernel for dtype"):
        torch.ops.specdec.silu_mul(torch.randn(2, 8).half())


def test_opcheck(gen):
    x, w = torch.randn(2, 3, 8, generator=gen), torch.randn(8, generator=gen)
    torch.library.opcheck(torch.ops.specdec.rms_norm.default, (x, w, 1e-5))
    torch.library.opcheck(torch.ops.specdec.add_rms_norm.default, (x.clone(), x, w, 1e-5))
    qkv = torch.randn(1, 2, 32, generator=gen)
    cs = torch.randn(1, 2, 1, 4, generator=gen)
    torch.library.opcheck(torch.ops.specdec.rotary_split.default, (qkv, cs, cs, 4, 2))
    torch.library.opcheck(torch.ops.specdec.silu_mul.default, (x,))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_on_glue_ops_equals_forward_on_torch_ops(dtype, monkeypatch):
    model = LlamaForCausalLM.from_hf(shared_hf(), dtype=dtype)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5, 8, 9, 7, 9, 3]])
    with torch.no_grad():
        cache = model.new_kv_cache(2, 16)
        fused, fused_hidden = model(ids, cache, output_hidden_states=True)
        monkeypatch.setattr(llama, "fused_glue", lambda *a, **k: False)
        cache = model.new_kv_cache(2, 16)
        plain, plain_hidden = model(ids, cache, output_hidden_states=True)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(fused, plain, **tol)
    torch.testing.assert_close(fused_hidden, plain_hidden, **tol)
