"""Weights kept as GGUF blocks (llama.cpp's Q8_0, Q4_0, Q4_1, Q4_K, Q6_K): a model loaded with
keep_quantized=True holds its projections, LM head and embedding table this way and multiplies with them through
ops.quantized_linear, so a decode step reads the file's bytes (Q4_1: 0.625 bytes a weight), not float32.

A QuantizedWeight stands where a [N, K] weight tensor stands in LlamaForCausalLM: `linear` (llama.py) and
`embed` dispatch on it; `weight[ids]` gives dequantised rows (an embedding lookup, a draft head's copy of LM-head
rows). Projections that are fused in the model (q/k/v, gate/up) but stored in different formats in the file
(Q4_K_M files keep v and down in Q6_K) become a QuantizedRowStack: one product per part, concatenated.

`activations` ("float" or "int8") is quantized_linear's: with "int8" the activations are quantised to 8 bits per
32 values and multiplied on integer dot products (docs/ops.md states the approximation).
"""
from __future__ import annotations

import torch

from .. import ops

FORMAT_NAMES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 14: "Q6_K"}
ACTIVATIONS = ("float", "int8")  # quantized_linear's modes


class QuantizedWeight:
    """A [N, K] weight as GGUF blocks: `blocks` uint8 [N, row_bytes] in `format` (a GGML type id); `dtype` is the
    dtype of the activations it multiplies and of the rows it hands out (the model's); `activations` how
    quantized_linear multiplies them ("float" or "int8")."""

    def __init__(self, blocks: torch.Tensor, format: int, dtype: torch.dtype = torch.float32,
                 activations: str = "float"):
        k = ops._check_blocks("QuantizedWeight", blocks, format)
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"QuantizedWeight: dtype must be float32 or bfloat16, got {dtype}")
        check_activations("QuantizedWeight", activations)
        self.blocks, self.format, self.dtype, self.activations = blocks.contiguous(), format, dtype, activations
        self.shape = torch.Size((blocks.shape[0], k))

    def __repr__(self) -> str:
        return (f"QuantizedWeight({FORMAT_NAMES[self.format]}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"activations={self.activations!r})")

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.device != self.blocks.device:  # ops.quantized_linear's own check, the one the op cannot make itself
            raise ValueError(f"QuantizedWeight: the weight is on {self.blocks.device} but x is on {x.device}")
        # The op checks the rest (x's width and dtype, bias); calling it directly saves the wrapper's Python in a
        # decode step (121 products).
        y = torch.ops.specdec.quantized_linear(x.reshape(-1, self.shape[1]), self.blocks, self.format, bias,
                                               self.activations)
        return y.view(*x.shape[:-1], self.shape[0])

    def __getitem__(self, index) -> torch.Tensor:
        """Rows `index` (ids of any shape, a slice) dequantised: [..., K] in self.dtype."""
        rows = self.blocks[index]
        flat = rows.reshape(-1, rows.shape[-1])
        return ops.dequantize(flat, self.format).to(self.dtype).reshape(*rows.shape[:-1], self.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The whole weight as a [N, K] tensor of self.dtype."""
        return self[:]

    def rows(self, start: int, stop: int) -> QuantizedWeight:
        """Rows [start, stop) as a QuantizedWeight (a view of the blocks)."""
        return QuantizedWeight(self.blocks[start:stop], self.format, self.dtype, self.activations)

    def gather(self, index: torch.Tensor) -> QuantizedWeight:
        """Rows `index` (a 1-D tensor of row ids) as a QuantizedWeight of their own (a copy of their blocks)."""
        return QuantizedWeight(self.blocks[index], self.format, self.dtype, self.activations)

    def to(self, device) -> QuantizedWeight:
        return QuantizedWeight(self.blocks.to(device), self.format, self.dtype, self.activations)

    def detach(self) -> QuantizedWeight:
        return self


class QuantizedRowStack:
    """Row blocks of one [N, K] weight in different formats (parts stacked along N)."""

    def __init__(self, parts: list[QuantizedWeight]):
        self.parts = parts
        self.dtype = parts[0].dtype
        if len({p.activations for p in parts}) != 1:
            raise ValueError("QuantizedRowStack: the parts must share one activations mode")
        self.shape = torch.Size((sum(p.shape[0] for p in parts), parts[0].shape[1]))
        self.offsets = [0]
        for p in parts:
            self.offsets.append(self.offsets[-1] + p.shape[0])

    def __repr__(self) -> str:
        return f"QuantizedRowStack({', '.join(map(repr, self.parts))})"

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        ys = [p.linear(x, None if bias is None else bias[a:b])
              for p, a, b in zip(self.parts, self.offsets, self.offsets[1:])]
        return torch.cat(ys, dim=-1)

    @property
    def activations(self) -> str:
        return self.parts[0].activations

    @activations.setter
    def activations(self, mode: str) -> None:
        check_activations("QuantizedRowStack", mode)
        for p in self.parts:
            p.activations = mode

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def to(self, device) -> QuantizedRowStack:
        return QuantizedRowStack([p.to(device) for p in self.parts])

    def detach(self) -> QuantizedRowStack:
        return self


def stack_rows(parts: list[QuantizedWeight]) -> QuantizedWeight | QuantizedRowStack:
    """One weight from row blocks: consecutive parts of one format concatenated (one product), a QuantizedRowStack
    of those runs when formats differ."""
    runs = [[parts[0]]]
    for p in parts[1:]:
        if p.format == runs[-1][-1].format:
            runs[-1].append(p)
        else:
            runs.append([p])
    merged = [r[0] if len(r) == 1 else QuantizedWeight(torch.cat([p.blocks for p in r]), r[0].format, r[0].dtype,
                                                        r[0].activations)
              for r in runs]
    return merged[0] if len(merged) == 1 else QuantizedRowStack(merged)


def quantize_q8_0(weight: torch.Tensor, activations: str = "float") -> QuantizedWeight:
    """A float [N, K] weight (K a multiple of 32) as Q8_0 blocks, as llama.cpp quantises it: per 32 weights an fp16
    scale d = max |w| / 127 and q = round(w / d) (here by the stored fp16 d, so |w - q d| <= d / 2 + d's rounding
    error x 127). The weight's dtype stays the activations' dtype. Used for draft heads' own trained weights when the
    target runs on the integer kernels."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] % 32 or weight.numel() == 0:
        raise ValueError(f"quantize_q8_0: weight must be a non-empty [N, K] tensor with K a multiple of 32, got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    units = weight.detach().float().reshape(weight.shape[0], -1, 32)  # [N, K / 32, 32]
    scale = (units.abs().amax(-1) / 127).half()  # [N, K / 32] fp16
    inverse = torch.where(scale > 0, 1.0 / scale.float(), torch.zeros_like(scale, dtype=torch.float32))
    q = torch.round(units * inverse.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    blocks = torch.cat([scale.view(torch.uint8).reshape(*scale.shape, 2), q.view(torch.uint8)], dim=-1)
    return QuantizedWeight(blocks.reshape(weight.shape[0], -1).contiguous(), 8, weight.dtype, activations)


def check_activations(what: str, mode) -> None:
    if mode not in ACTIVATIONS:
        raise ValueError(f"{what}: activations must be one of {ACTIVATIONS}, got {mode!r}")


def is_quantized(weight) -> bool:
    return isinstance(weight, (QuantizedWeight, QuantizedRowStack))
