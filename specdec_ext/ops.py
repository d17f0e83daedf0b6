"""The public ops: argument checks and defaults, then one call into torch.ops.specdec; fake kernels so the
ops trace under torch.compile and CUDA-graph capture.

Each op's checks live in a `_<op>(ops, ...)` function that takes the op namespace, so that
specdec_ext.sim runs exactly the same checks in front of the emulated kernels (torch.ops.specdec_sim).
"""
import torch

from . import _extension

_extension.load("_C")

_INT64_MIN, _UINT64_END = -(2**63), 2**64


def _request_vector(value, name: str, op: str, batch: int | None, device) -> torch.Tensor:
    """A per-request int64 vector from an int (broadcast to the batch) or a 0-/1-D integer tensor."""
    if isinstance(value, bool) or not isinstance(value, (int, torch.Tensor)):
        raise TypeError(f"{op}: {name} must be an int or an integer tensor, got {type(value).__name__}")
    if isinstance(value, int):
        if not _INT64_MIN <= value < _UINT64_END:
            raise ValueError(f"{op}: {name} must fit in 64 bits, got {value}")
        if value >= 2**63:  # a uint64 seed: keep its bits
            value -= _UINT64_END
        return torch.full((batch or 1,), value, dtype=torch.int64, device=device)
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise ValueError(f"{op}: {name} must be an integer tensor, got {value.dtype}")
    if value.dim() > 1:
        raise ValueError(f"{op}: {name} must be a 0-D or 1-D tensor, got shape {tuple(value.shape)}")
    value = value.to(torch.int64).reshape(-1)
    if batch is not None and value.numel() == 1 and batch != 1:
        value = value.expand(batch)
    if batch is not None and value.numel() != batch:
        raise ValueError(f"{op}: {name} has {value.numel()} entries for a batch of {batch}")
    return value.contiguous()


def _philox_uniform(ops, seed, offset, n: int, stream: int = 0) -> torch.Tensor:
    op = "philox_uniform"
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 2**34:
        raise ValueError(f"{op}: n must be an int in [0, 2^34], got {n!r}")
    if isinstance(stream, bool) or not isinstance(stream, int) or not 0 <= stream < 2**32:
        raise ValueError(f"{op}: stream must be an int in [0, 2^32), got {stream!r}")
    tensors = [t for t in (seed, offset) if isinstance(t, torch.Tensor)]
    device = tensors[0].device if tensors else torch.device("cpu")
    if any(t.device != device for t in tensors):
        raise ValueError(f"{op}: seed and offset must be on the same device, got {[str(t.device) for t in tensors]}")
    batch = next((t.numel() for t in tensors if t.dim() == 1), None)  # seed's length, else offset's
    seed = _request_vector(seed, "seed", op, batch, device)
    offset = _request_vector(offset, "offset", op, seed.numel(), device)
    return ops.philox_uniform(seed, offset, n, stream)


def philox_uniform(seed, offset, n: int, stream: int = 0) -> torch.Tensor:
    """Uniforms in the open interval (0, 1) from counter-based Philox4x32-10: the random stream that every
    sampling op of this library draws from (RNG contract, DESIGN.md §3.1).

    seed, offset: [B] integer tensors or ints (broadcast); a request's key and counter base.
    n: uniforms per request. stream: which of the request's independent streams.
    Returns [B, n] float32 on the device of seed/offset; row b depends only on (seed[b], offset[b], stream).
    """
    return _philox_uniform(torch.ops.specdec, seed, offset, n, stream)


def _register_fakes(namespace: str) -> None:
    @torch.library.register_fake(f"{namespace}::philox_uniform")
    def _(seed, offset, n, stream=0):
        return seed.new_empty((seed.shape[0], n), dtype=torch.float32)


_register_fakes("specdec")
