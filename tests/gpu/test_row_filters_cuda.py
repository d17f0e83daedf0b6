"""top_k / top_p / min_p on CUDA: the CUDA kernel's decisions and tokens with processed rows equal the CPU kernel's bit
for bit (chain and tree, every split of a request over blocks, both couplings), with the thresholds found by bisection
on the GPU and by a histogram guess on the CPU; and the ops replay from a CUDA graph."""
import pytest
import torch

import specdec_ext
from helpers.sampling_inputs import make_chain_inputs, make_tree_inputs


def on(inp, device):
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}


def controls(gen, batch, vocab):
    t = torch.rand(batch, generator=gen) + 0.3
    t[0] = 0.0  # a greedy request: never processed
    k = torch.where(torch.arange(batch) % 3 == 0, torch.randint(1, 200, (batch,), generator=gen), 0).int()
    p = torch.where(torch.arange(batch) % 2 == 0, torch.rand(batch, generator=gen) * 0.9 + 0.05, 1.0)
    mp = torch.where(torch.arange(batch) % 5 == 1, torch.rand(batch, generator=gen) * 0.2, 0.0)
    return t, k, p, mp


@pytest.mark.parametrize("coupling", ["rejection", "gumbel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
# On 132 SMs batch 1 runs each request on 32 blocks, 20 on 4, 60 on 2, 300 on one block (sampling_slices).
@pytest.mark.parametrize("batch,k,vocab", [(1, 8, 49152), (20, 4, 128256), (60, 4, 3001), (300, 2, 1000)])
def test_chain_cuda_matches_cpu_exactly(coupling, dtype, batch, k, vocab, strict):
    gen = torch.Generator().manual_seed(batch + k + vocab)
    inp = make_chain_inputs(gen, batch, k, vocab, dtype)
    t, kk, p, mp = controls(gen, batch, vocab)
    outs = []
    for device in ("cpu", "cuda"):
        d = on(inp, device)
        out = specdec_ext.chain_speculative_sampling_from_logits(
            d["ids"], d["target_logits"], d["draft_logits"] if coupling == "rejection" else None,
            temperature=t.to(device), num_draft_tokens=d["num_draft_tokens"], seed=d["seed"], offset=d["offset"],
            coupling=coupling, top_k=kk.to(device), top_p=p.to(device), min_p=mp.to(device))
        outs.append([x.cpu() for x in out])
    assert all(torch.equal(a, b) for a, b in zip(*outs))


@pytest.mark.parametrize("batch,n,vocab", [(1, 64, 49152), (60, 16, 3001)])
def test_tree_cuda_matches_cpu_exactly(batch, n, vocab, strict):
    gen = torch.Generator().manual_seed(batch * 7 + n)
    inp = make_tree_inputs(gen, batch, n, vocab)
    t, kk, p, mp = controls(gen, batch, vocab)
    outs = []
    for device in ("cpu", "cuda"):
        d = on(inp, device)
        out = specdec_ext.tree_speculative_sampling_from_logits(
            d["parents"], d["tokens"], d["target_logits"], d["draft_logits"], temperature=t.to(device),
            num_nodes=d["num_nodes"], seed=torch.arange(batch, device=device), offset=0, top_k=kk.to(device),
            top_p=p.to(device), min_p=mp.to(device))
        outs.append([x.cpu() for x in out])
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_replays_from_a_cuda_graph():
    gen = torch.Generator().manual_seed(3)
    batch, k, vocab = 8, 4, 32000
    d = on(make_chain_inputs(gen, batch, k, vocab), "cuda")
    t, kk, p, mp = (x.cuda() for x in controls(gen, batch, vocab))
    kw = dict(temperature=t, num_draft_tokens=d["num_draft_tokens"], seed=d["seed"], offset=d["offset"], top_k=kk,
              top_p=p, min_p=mp)
    eager = specdec_ext.chain_speculative_sampling_from_logits(d["ids"], d["target_logits"], d["draft_logits"], **kw)
    out = (torch.empty_like(eager.output_token_ids), torch.empty_like(eager.num_accepted))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        specdec_ext.chain_speculative_sampling_from_logits(d["ids"], d["target_logits"], d["draft_logits"], out=out,
                                                           **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], eager.output_token_ids) and torch.equal(out[1], eager.num_accepted)
