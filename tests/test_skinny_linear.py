"""skinny_linear (the CPU GEMM of decode and verify projections) against float64: every row count it takes (1-16),
odd shapes (K not a multiple of any vector width, N not a multiple of the weight panel), every instruction set the
kernel is built for (forced through SPECDEC_CPU_ISA; AVX-512 runs only on a CPU that has it), 1 and 2 threads."""
import pytest
import torch

from specdec_ext import ops
from specdec_ext.ops import skinny_linear

# (N, K): a model's shape, then N not a multiple of the 12-row panel and K not a multiple of 4, 8 or 16.
SHAPES = [(1000, 576), (37, 13), (64, 8), (3, 1), (25, 100), (13, 1031)]


@pytest.fixture(params=[1, 2], ids=lambda t: f"threads{t}")
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_float64(isa, threads, dtype, gen):
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=gen).to(dtype)
        b = torch.randn(n, generator=gen).to(dtype)
        for m in range(1, 17):
            x = torch.randn(m, k, generator=gen).to(dtype)
            for bias in (None, b):
                want = x.double() @ w.double().T + (0 if bias is None else bias.double())
                got = skinny_linear(x, w, bias)
                assert got.dtype == dtype and got.shape == (m, n)
                # float32 accumulation (error ~ sqrt(K) ulp), then the output rounded to the dtype
                tol = 2e-6 if dtype == torch.float32 else 8e-3
                err = float((got.double() - want).norm() / want.norm())
                assert err <= tol, (isa, threads, n, k, m, bias is None, err)


def test_every_output_written(isa, gen):
    """No output element left unwritten: each is compared with its own float64 value (a norm could hide one)."""
    w = torch.randn(61, 45, generator=gen)
    for m in range(1, 17):
        x = torch.randn(m, 45, generator=gen)
        want = x.double() @ w.double().T
        got = skinny_linear(x, w).double()
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (isa, m)


@pytest.mark.parametrize("value", ["neon", "bogus", "avx512f", "AVX"])
def test_bad_isa_setting_names_itself(monkeypatch, value):
    monkeypatch.setenv("SPECDEC_CPU_ISA", value)
    with pytest.raises(ValueError, match="SPECDEC_CPU_ISA must be avx512, avx2 or sse2"):
        skinny_linear(torch.randn(2, 8), torch.randn(3, 8))
    with pytest.raises(ValueError) as e:
        ops.cpu_isa()
    # One line naming the variable, the valid values and the bad value: no C++ backtrace.
    assert str(e.value) == f"SPECDEC_CPU_ISA must be avx512, avx2 or sse2 (any case; or unset), got '{value}'"


@pytest.mark.parametrize("value", ["SSE2", "Sse2", "sse2"])
def test_isa_setting_in_any_case(monkeypatch, value):
    monkeypatch.setenv("SPECDEC_CPU_ISA", value)
    assert ops.cpu_isa() == "sse2"
    x, w = torch.randn(3, 40), torch.randn(5, 40)
    assert torch.allclose(skinny_linear(x, w).double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5)


def test_leading_dims_and_bad_inputs(gen):
    x = torch.randn(2, 3, 40, generator=gen)
    w = torch.randn(24, 40, generator=gen)
    assert torch.allclose(skinny_linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="at most 16 rows"):
        skinny_linear(torch.randn(17, 40), w)
    with pytest.raises(ValueError, match="same dtype"):
        skinny_linear(torch.randn(2, 40), w.bfloat16())
    with pytest.raises(ValueError, match="K = 40"):
        skinny_linear(torch.randn(2, 40), torch.randn(24, 41))
    with pytest.raises(ValueError, match="no kernel for dtype"):
        skinny_linear(torch.randn(2, 40).half(), w.half())
    with pytest.raises(ValueError, match="weight is on meta"):
        skinny_linear(torch.randn(2, 40), w.to("meta"))


def test_opcheck(gen):
    x, w, b = torch.randn(3, 24, generator=gen), torch.randn(10, 24, generator=gen), torch.randn(10, generator=gen)
    torch.library.opcheck(torch.ops.specdec.skinny_linear.default, (x, w, b))
    torch.library.opcheck(torch.ops.specdec.skinny_linear.default, (x, w, None))
