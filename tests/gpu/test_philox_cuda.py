"""philox_uniform on CUDA: identical to the CPU kernel, no host synchronisation, capturable in a CUDA graph."""
import pytest
import torch

import specdec_ext


def keys(batch, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-(2**63), 2**63 - 1, (batch,), generator=g),
            torch.randint(-(2**63), 2**63 - 1, (batch,), generator=g))


@pytest.mark.parametrize("batch,n", [(1, 1), (3, 5), (7, 64), (300, 1001), (4, 1 << 20)])
def test_cuda_matches_cpu_bit_exact(batch, n):
    seed, offset = keys(batch, batch * 1000 + n)
    cpu = specdec_ext.philox_uniform(seed, offset, n, 7)
    gpu = specdec_ext.philox_uniform(seed.cuda(), offset.cuda(), n, 7)
    assert torch.equal(gpu.cpu(), cpu)


def test_no_host_sync_and_cuda_graph_capture():
    seed, offset = (t.cuda() for t in keys(8, 1))
    specdec_ext.philox_uniform(seed, offset, 100)  # warm-up outside capture
    torch.cuda.set_sync_debug_mode("error")
    try:
        specdec_ext.philox_uniform(seed, offset, 100)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = specdec_ext.philox_uniform(seed, offset, 100)
    offset += 1
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), specdec_ext.philox_uniform(seed.cpu(), offset.cpu(), 100))


def test_opcheck_cuda():
    seed, offset = (t.cuda() for t in keys(3, 2))
    torch.library.opcheck(torch.ops.specdec.philox_uniform.default, (seed, offset, 13, 1))
