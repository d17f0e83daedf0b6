"""Tree speculative sampling on CUDA: the same decisions and tokens as the CPU kernel (bit-exact, by the
canonical order), capturable in a CUDA graph, defined output on malformed trees."""
import pytest
import torch

import specdec_ext
from helpers.sampling_inputs import make_tree_inputs


def run(inp, device, logits, control, **kw):
    d = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
    c = control.to(device) if isinstance(control, torch.Tensor) else control
    if logits:
        return specdec_ext.tree_speculative_sampling_from_logits(
            d["parents"], d["tokens"], d["target_logits"], d["draft_logits"], temperature=c, num_nodes=d["num_nodes"],
            seed=d["seed"], offset=d["offset"], **kw)
    return specdec_ext.tree_speculative_sampling(d["parents"], d["tokens"], d["target_probs"], d["draft_probs"],
                                                 greedy=c, num_nodes=d["num_nodes"], seed=d["seed"], offset=d["offset"],
                                                 **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
@pytest.mark.parametrize("with_draft", [True, False], ids=["sampled", "point"])
# On 132 SMs batch 1 runs each request on 32 blocks, 20 on 4, 60 on 2, 300 on one block (sampling_slices).
@pytest.mark.parametrize("batch,n,vocab", [(1, 64, 49152), (20, 32, 32000), (60, 16, 3001), (300, 8, 1000)])
def test_cuda_matches_cpu_exactly(dtype, logits, with_draft, batch, n, vocab, strict):
    gen = torch.Generator().manual_seed(batch * 7 + n + vocab)
    inp = make_tree_inputs(gen, batch, n, vocab, dtype, with_draft, branching=4, depth=6)
    control = (torch.rand(batch, generator=gen) + 0.3) if logits else torch.rand(batch, generator=gen) < 0.2
    cpu = run(inp, "cpu", logits, control)
    gpu = run(inp, "cuda", logits, control)  # strict mode (the fixture): valid input records no error
    for a, b in zip(cpu, gpu):
        assert torch.equal(a, b.cpu())


def test_graph_capture_replays_the_same_tokens():
    gen = torch.Generator().manual_seed(3)
    inp = make_tree_inputs(gen, 8, 32, 49152, torch.bfloat16, True, branching=4, depth=6)
    d = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
    out = tuple(torch.empty(s, dtype=torch.int32, device="cuda") for s in ((8, 32), (8, 32), (8,)))
    temperature = torch.full((8,), 0.8, device="cuda")  # the op refuses Python numbers under capture
    def step():
        return specdec_ext.tree_speculative_sampling_from_logits(
            d["parents"], d["tokens"], d["target_logits"], d["draft_logits"], temperature=temperature,
            num_nodes=d["num_nodes"],
            seed=d["seed"], offset=d["offset"], out=out)
    eager = [t.clone() for t in step()]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for t in out:
        t.fill_(-5)
    graph.replay()
    assert all(torch.equal(a, b) for a, b in zip(eager, out))


def test_malformed_trees_give_defined_output_and_strict_mode_raises():
    gen = torch.Generator().manual_seed(4)
    inp = make_tree_inputs(gen, 4, 6, 300, ragged=False)
    inp["parents"] = torch.tensor([-1, 0, 1, 9, 1, 4], dtype=torch.int32).expand(4, 6).contiguous()
    out = run(inp, "cuda", True, 1.0)
    # Node 3's parent is out of range: it is never a child; the rest of the tree (0-1-2, 0-1-4-5) is walked.
    assert not bool((out.accepted_nodes == 3).any()) and bool((out.num_accepted <= 3).all())
    specdec_ext.set_strict(True)
    try:
        with pytest.raises(ValueError, match="not a tree"):
            run(inp, "cuda", True, 1.0)
    finally:
        specdec_ext.set_strict(False)
