"""The host's side of a decoding round on CUDA: small uploads through pinned memory that never block the host,
and the round's one read of its results.

A round's host work (token ids of the n-gram drafter, counts, the paged caches' block tables) is a few hundred
bytes; copied from pageable memory each would block the host until the device caught up. From pinned memory the
copy is queued behind the work already launched and the host goes on (the caching host allocator keeps the pinned
block until the copy has run). On the CPU both are plain tensor constructions and reads.
"""
import torch


def upload(values, dtype: torch.dtype, device) -> torch.Tensor:
    """Host values (an int, a list or nested lists) as a tensor on `device`, without a host synchronisation."""
    if torch.device(device).type == "cuda":
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)


def read(tensor: torch.Tensor) -> list:
    """The tensor's values as (nested) Python lists: the one place a round waits for the device. On CUDA the copy
    goes to pinned memory and the host waits for it alone (the work queued after it keeps running)."""
    if tensor.device.type != "cuda":
        return tensor.tolist()
    staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    staged.copy_(tensor, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return staged.tolist()
