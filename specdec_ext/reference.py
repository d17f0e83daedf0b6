"""Readable, vectorised pure-PyTorch references of every op: the test oracle and the benchmark baseline.

Each function computes what the op's contract says, on any device, with no custom kernel.
"""
import torch

# ---------------------------------------------------------------------------------------------------
# Philox4x32-10 on int64 tensors holding uint32 values. torch has no uint32 multiply-high, so each
# 32x32-bit product is formed from two 32x16-bit products, which stay below 2^49 and cannot overflow.
_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = 0xFFFFFFFF


def _mulhilo32(a: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t = a * (x & 0xFFFF)
    mid = a * (x >> 16) + (t >> 16)
    return ((mid & 0xFFFF) << 16) | (t & 0xFFFF), mid >> 16


def philox4x32_10(counter: tuple, key: tuple) -> tuple:
    """Philox4x32-10 of counter (4 int64 tensors of uint32 words) under key (2 of them); broadcasts."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        lo0, hi0 = _mulhilo32(_M0, c0)
        lo1, hi1 = _mulhilo32(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + _W0) & _MASK32
        k1 = (k1 + _W1) & _MASK32
    return c0, c1, c2, c3


def philox_uniform(seed: torch.Tensor, offset: torch.Tensor, n: int, stream: int = 0) -> torch.Tensor:
    """[B, n] float32 uniforms in (0, 1): element i of row b is word i % 4 of
    Philox4x32-10(counter=(i // 4, stream, offset_lo, offset_hi), key=(seed_lo, seed_hi)), mapped to
    (2 * (word >> 9) + 1) * 2^-24."""
    seed = seed.to(torch.int64).reshape(-1, 1)
    offset = offset.to(torch.int64).reshape(-1, 1)
    blocks = (n + 3) // 4
    block = torch.arange(blocks, dtype=torch.int64, device=seed.device).reshape(1, -1)
    counter = (
        block.expand(seed.shape[0], blocks),
        torch.full_like(block, stream),
        offset & _MASK32,
        (offset >> 32) & _MASK32,
    )
    words = torch.stack(philox4x32_10(counter, (seed & _MASK32, (seed >> 32) & _MASK32)), dim=-1)
    words = words.reshape(seed.shape[0], blocks * 4)[:, :n]
    return (((words >> 9) << 1) | 1).to(torch.float32) * 2.0**-24
