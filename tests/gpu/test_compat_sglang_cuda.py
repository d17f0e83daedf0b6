"""The SGLang shim on CUDA: SGLang's kernel test case, the same outputs as the CPU kernel on the same coins, SGLang's
decisions, no host synchronisation, and (where sgl_kernel is installed) sgl_kernel's own outputs."""
import pytest
import torch
from helpers import (POISON, SGLANG_EXPECTED, first_two_law_batch, random_lcrs, sglang_greedy, sglang_kernel_case,
                     sglang_sample)

from specdec_ext.bench.compat_sglang import eagle_like_tree, sglang_target_only_torch

CUDA = torch.device("cuda")


def to_cuda(d):
    return {k: v.to(CUDA) for k, v in d.items()}


def eagle_case(gen, batch, n, vocab):
    _, ri, nt, ns = eagle_like_tree(batch, n, 2, "cpu")
    parent = torch.where(torch.arange(n) == 0, 0, (torch.arange(n) - 1) // 2)
    cand = torch.stack([torch.randperm(vocab, generator=gen)[:n] for _ in range(batch)])
    logits = torch.randn(batch, n, vocab, generator=gen)
    logits[torch.arange(batch).unsqueeze(-1), parent[1:], cand[:, 1:]] += 6.0
    tree = dict(candidates=cand, retrive_index=ri, retrive_next_token=nt, retrive_next_sibling=ns)
    return tree, torch.softmax(logits, -1), torch.rand(batch, n, generator=gen), torch.rand(batch, generator=gen)


def test_sglang_kernel_case_on_cuda(gen):
    tree, target = sglang_kernel_case()
    got = sglang_sample(to_cuda(tree), target.to(CUDA), torch.rand(2, 6, generator=gen).to(CUDA),
                        torch.rand(2, generator=gen).to(CUDA), 4, 12)
    got = [t.cpu() for t in got]
    assert got[0].tolist() == [POISON if v == -1 else v for v in SGLANG_EXPECTED["predicts"]]
    assert got[1].tolist() == SGLANG_EXPECTED["accept_index"]
    assert got[2].tolist() == SGLANG_EXPECTED["accept_token_num"]


@pytest.mark.parametrize("sampled", [False, True])
def test_cuda_equals_cpu_on_the_same_coins(sampled):
    gen = torch.Generator().manual_seed(3)
    tree, rows, draft, _, _ = first_two_law_batch(gen, 4000, sampled)
    coins, final = torch.rand(4000, 6, generator=gen), torch.rand(4000, generator=gen)
    want = sglang_sample(tree, rows, coins, final, 3, 4000 * 6, draft)
    got = sglang_sample(to_cuda(tree), rows.to(CUDA), coins.to(CUDA), final.to(CUDA), 3, 4000 * 6,
                        None if draft is None else draft.to(CUDA))
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b)


def test_sglang_decisions_large_vocab_without_host_sync(gen):
    batch, n, vocab = 64, 8, 128256
    tree, target, coins, final = eagle_case(gen, batch, n, vocab)
    tree, target, coins, final = to_cuda(tree), target.to(CUDA), coins.to(CUDA), final.to(CUDA)
    sglang_sample(tree, target, coins, final, 4, batch * n)  # warm-up (lazy initialisation may synchronise)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = sglang_sample(tree, target, coins, final, 4, batch * n)
        sglang_greedy(tree, target.argmax(-1), 4, batch * n)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = sglang_target_only_torch(*(tree[k] for k in ("candidates", "retrive_index", "retrive_next_token",
                                                          "retrive_next_sibling")), coins, final, target, 4)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    expected = torch.where(want[0] == -1, POISON, want[0])
    # Each request's last token is drawn by inverse CDF over 128256 entries: the torch reference's CUDA cumsum adds
    # in another order than the kernel, so a coin within float32 rounding of a boundary may pick the neighbouring
    # token. Every other slot must match exactly; the last tokens may differ in a few requests (a systematic error
    # would move most of the 64), and only to a token the target gives mass at that node.
    last = want[1].gather(1, want[2].long().unsqueeze(1)).squeeze(1).long()
    others = torch.ones_like(expected, dtype=torch.bool)
    others[last] = False
    assert torch.equal(got[0][others], expected[others])
    moved = (got[0][last] != expected[last]).nonzero().flatten().tolist()
    assert len(moved) <= 2, moved
    for b in moved:
        node = int(last[b]) - b * n
        assert target[b, node, int(got[0][last[b]])] > 0


def test_greedy_on_cuda_equals_cpu(gen):
    tree = random_lcrs(gen, 64, 9, 2, shuffle=True)
    target_predict = torch.randint(0, 2, (64, 9), generator=gen)
    want = sglang_greedy(tree, target_predict, 5, 64 * 9)
    got = sglang_greedy(to_cuda(tree), target_predict.to(CUDA), 5, 64 * 9)
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b)


def sgl_call(fn, *outputs, tree, **kw):
    """sgl_kernel spells the tree arguments retrive_* or retrieve_* depending on its version."""
    try:
        fn(*outputs, **tree, **kw)
    except TypeError:
        fn(*outputs, **{k.replace("retrive", "retrieve"): v for k, v in tree.items()}, **kw)


def test_against_sgl_kernel(gen):
    sgl_kernel = pytest.importorskip("sgl_kernel")
    batch, n, vocab = 32, 8, 32000
    tree, target, coins, final = eagle_case(gen, batch, n, vocab)
    tree, target, coins, final = to_cuda(tree), target.to(CUDA), coins.to(CUDA), final.to(CUDA)
    want = [torch.full((batch * n,), POISON, dtype=torch.int32, device=CUDA),
            torch.full((batch, 4), -1, dtype=torch.int32, device=CUDA), torch.zeros(batch, dtype=torch.int32, device=CUDA)]
    sgl_call(sgl_kernel.tree_speculative_sampling_target_only, *want, tree=tree, uniform_samples=coins,
             uniform_samples_for_final_sampling=final, target_probs=target, draft_probs=torch.zeros_like(target))
    got = sglang_sample(tree, target, coins, final, 4, batch * n)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    # the last token is drawn by inverse CDF on both sides; float32 sums may differ at a bucket's edge
    assert (got[0] == want[0]).float().mean() > 0.98
    want = [torch.full((batch * n,), POISON, dtype=torch.int32, device=CUDA),
            torch.full((batch, 4), -1, dtype=torch.int32, device=CUDA), torch.zeros(batch, dtype=torch.int32, device=CUDA)]
    sgl_call(sgl_kernel.verify_tree_greedy, *want, tree=tree, target_predict=target.argmax(-1))
    got = sglang_greedy(tree, target.argmax(-1), 4, batch * n)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
