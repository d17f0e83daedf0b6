"""skinny_linear (the CPU kernel of decode and verify projections) against float64, every row count it takes."""
import pytest
import torch

from specdec_ext.ops import skinny_linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 16])
@pytest.mark.parametrize("n,k", [(1000, 576), (37, 13), (64, 8), (3, 1)])
def test_matches_float64(dtype, m, n, k, gen):
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    for bias in (None, b):
        want = x.double() @ w.double().T + (0 if bias is None else bias.double())
        got = skinny_linear(x, w, bias)
        assert got.dtype == dtype and got.shape == (m, n)
        # float32 accumulation, then the output rounded to the dtype
        tol = 1e-6 if dtype == torch.float32 else 8e-3
        assert float((got.double() - want).norm() / want.norm()) <= tol


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
