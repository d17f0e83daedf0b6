"""Random GGUF blocks of every format kept quantised, and their reference dequantisation (the gguf package)."""
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize as gguf_dequantize

from specdec_ext import ops

FORMATS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}
# Byte offsets of each block's fp16 scale fields (d, and m / dmin where the format has one).
HALF_FIELDS = {2: [0], 3: [0, 2], 8: [0], 12: [0, 2], 14: [208]}


def random_blocks(gen, format, n, k):
    """[n, row_bytes] blocks: every quant bit pattern random; the fp16 scales finite, of both signs and a spread
    of magnitudes, with zeros and subnormals among them (random bits would make some inf or NaN)."""
    weights, nbytes = ops.QUANTIZED_FORMATS[format]
    blocks = torch.randint(0, 256, (n, k // weights, nbytes), generator=gen, dtype=torch.uint8)
    for offset in HALF_FIELDS[format]:
        scales = torch.randn(n, k // weights, generator=gen) * 0.02
        scales[torch.rand(scales.shape, generator=gen) < 0.05] = 0.0
        scales[torch.rand(scales.shape, generator=gen) < 0.05] = 3e-6  # fp16 subnormal
        blocks[:, :, offset:offset + 2] = scales.half().view(torch.uint8).reshape(n, k // weights, 2)
    return blocks.reshape(n, -1)


def reference_weight(blocks, format) -> torch.Tensor:
    return torch.from_numpy(gguf_dequantize(blocks.numpy(), QType(format)).astype(np.float32))


def columns(format):
    return [256, 512] if ops.QUANTIZED_FORMATS[format][0] == 256 else [64, 576]
