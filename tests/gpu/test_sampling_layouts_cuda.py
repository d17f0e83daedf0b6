"""The sampling ops' engine layouts on CUDA (docs/design.md §3.4): the flat form equals the padded form, caller
uniforms and reduced draft vocabularies give the CPU kernel's tokens bit for bit, K = 128 and V = 262,208, and the flat
call is capturable in a CUDA graph."""
import pytest
import torch

import specdec_ext
from helpers.sampling_inputs import padded_and_flat_trees, ragged_batch, reduced_vocab, scatter_full
from specdec_ext.bench.common import cuda_graph

CUDA = torch.device("cuda")


def to_cuda(d):
    return {k: v.to(CUDA) if isinstance(v, torch.Tensor) else v for k, v in d.items()}


@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_flat_equals_padded_and_cpu(gen, logits, dtype):
    batch, max_k, vocab = 40, 8, 32000
    padded, flat = ragged_batch(gen, batch, max_k, vocab, dtype)
    kind = "logits" if logits else "probs"
    fn = "chain_speculative_sampling_from_logits" if logits else "chain_speculative_sampling"
    control = {"temperature": 0.9} if logits else {}

    def call(d, device, flat_form):
        extra = dict(uniforms=d["uniforms"], final_uniforms=padded["final_uniforms"].to(device),
                     bonus_token_ids=padded["bonus"].to(device))
        if flat_form:
            return getattr(specdec_ext, fn)(d["ids"], d[f"target_{kind}_nobonus"], d[f"draft_{kind}"], seed=1,
                                            cu_num_draft_tokens=d["cu"], max_draft_tokens=max_k, **extra, **control)
        return getattr(specdec_ext, fn)(d["ids"], d[f"target_{kind}"], d[f"draft_{kind}"], seed=1,
                                        num_draft_tokens=d["num_draft_tokens"], **extra, **control)

    cuda_flat, cuda_padded = call(to_cuda(flat), CUDA, True), call(to_cuda(padded), CUDA, False)
    cpu_flat = call(flat, torch.device("cpu"), True)
    for a, b in ((cuda_flat, cuda_padded), (cuda_flat, cpu_flat)):
        assert torch.equal(a.output_token_ids.cpu(), b.output_token_ids.cpu())
        assert torch.equal(a.num_accepted.cpu(), b.num_accepted.cpu())


def test_flat_trees_equal_padded_on_cuda(gen):
    padded, flat = padded_and_flat_trees(gen, 12, 9, 5000)
    p, f = to_cuda(padded), to_cuda(flat)
    want = specdec_ext.tree_speculative_sampling_from_logits(p["parents"], p["cand"], p["target_logits"],
                                                             p["draft_logits"],
                                                             temperature=0.8, num_nodes=p["num_nodes"], seed=3)
    got = specdec_ext.tree_speculative_sampling_from_logits(f["parents"], f["cand"], f["target_logits"],
                                                            f["draft_logits"],
                                                            temperature=0.8, cu_num_draft_tokens=f["cu"],
                                                            max_draft_tokens=8, seed=3)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_reduced_draft_vocabulary_on_cuda(gen):
    batch, k, vocab, draft_vocab = 16, 4, 128256, 32000
    d2t = reduced_vocab(gen, vocab, draft_vocab)
    target = torch.randn(batch, k + 1, vocab, generator=gen) * 2
    target[..., d2t.long()] += 3.0
    draft = target[:, :k, d2t.long()] + 0.5 * torch.randn(batch, k, draft_vocab, generator=gen)
    ids = d2t[torch.multinomial(torch.softmax(draft, -1).reshape(-1, draft_vocab), 1, generator=gen).reshape(batch,
                                                                                                             k)].int()
    def args(dev):
        return (ids.to(dev), target.to(dev), draft.to(dev))
    got = specdec_ext.chain_speculative_sampling_from_logits(*args(CUDA), temperature=1.0, seed=5,
                                                             draft_to_target=d2t.to(CUDA))
    full = specdec_ext.chain_speculative_sampling_from_logits(ids.to(CUDA), target.to(CUDA),
                                                              scatter_full(draft, d2t, vocab, True).to(CUDA),
                                                              temperature=1.0, seed=5)
    cpu = specdec_ext.chain_speculative_sampling_from_logits(*args("cpu"), temperature=1.0, seed=5, draft_to_target=d2t)
    for a, b in ((got, full), (got, cpu)):
        assert torch.equal(a.output_token_ids.cpu(), b.output_token_ids.cpu())


def test_limits_on_cuda(gen):
    for batch, k, vocab in ((4, 128, 1000), (3, 3, 262_208), (2, 2, 2**20)):
        logits = torch.randn(batch, k + 1, vocab, generator=gen)
        hot = torch.randint(0, vocab, (batch, k + 1), generator=gen)
        logits.scatter_(-1, hot.unsqueeze(-1), 12.0)
        ids = hot[:, :k].int()
        a = specdec_ext.chain_speculative_sampling_from_logits(ids.cuda(), logits.cuda(), None, temperature=1.0, seed=2)
        b = specdec_ext.chain_speculative_sampling_from_logits(ids, logits, None, temperature=1.0, seed=2)
        assert torch.equal(a.output_token_ids.cpu(), b.output_token_ids)


def test_flat_call_in_a_cuda_graph(gen):
    batch, max_k, vocab = 8, 4, 4096
    padded, flat = ragged_batch(gen, batch, max_k, vocab)
    f = to_cuda(flat)
    seed = torch.arange(batch, device=CUDA)
    temperature = torch.full((batch,), 0.7, device=CUDA)  # the op refuses Python numbers under capture
    out = (torch.full((batch, max_k + 1), -7, dtype=torch.int32, device=CUDA),
           torch.zeros(batch, dtype=torch.int32, device=CUDA))
    def call():
        return specdec_ext.chain_speculative_sampling_from_logits(
            f["ids"], f["target_logits"], f["draft_logits"], temperature=temperature, seed=seed, offset=seed,
            cu_num_draft_tokens=f["cu"], max_draft_tokens=max_k, out=out)
    eager = call()
    eager = (eager.output_token_ids.clone(), eager.num_accepted.clone())
    graph = cuda_graph(call)
    out[0].fill_(-7)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])
