"""The SGLang shim on CUDA: SGLang's kernel test case, the same outputs as the CPU kernel on the same coins, SGLang's
decisions, no host synchronisation, and (where sgl_kernel is installed) sgl_kernel's own outputs."""
import pytest
import torch

from helpers.compat_sglang import (
    POISON,
    SGLANG_EXPECTED,
    first_two_law_batch,
    random_lcrs,
    sglang_greedy,
    sglang_kernel_case,
    sglang_sample,
)
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
    # would move most of the 64), and only where the coin lies at the boundary between the two (check_last_tokens).
    last = want[1].gather(1, want[2].long().unsqueeze(1)).squeeze(1).long()
    others = torch.ones_like(expected, dtype=torch.bool)
    others[last] = False
    assert torch.equal(got[0][others], expected[others])
    moved = (got[0][last] != expected[last]).nonzero().flatten().tolist()
    assert len(moved) <= 2, moved
    check_last_tokens(tree, target, want[1], want[2], 4, final, got[0][last].long(), expected[last].long())


# The last token's draw in float32, against the exact CDF. Each float32 addition rounds by at most 2**-24 (6e-8) of a
# partial sum, itself at most the row's mass. The kernel reaches an entry's prefix in about 100 additions (pairwise
# within 8-entry blocks, then lanes, groups and 8192-entry tiles one after another), torch's CUDA cumsum in a few
# hundred (a scan within chunks of the row, a carry across them): under 2e-5 of the mass even were every rounding one
# way; a float32 cumsum adding all 128256 entries (~8e-6 each) one after another is off by 8e-6 on such rows. 1e-4
# of the mass leaves room for that, and stays ~20x below the mass of a child here (its logit raised by 6: ~2e-3), the
# shift a residual that kept a rejected child would make, and far below where a wrong row or coin would land.
CDF_ROUNDING = 1e-4


def last_token_rows(tree, target, accept_index, accept_token_num, num_steps):
    """[B, V] float64: the row each request's last token is drawn from, as sglang_target_only_torch draws it (not
    normalised: the coin is scaled by the row's mass): the target's row at the last accepted node, without the
    tokens of the node's children if the walk stopped there by rejecting them (fewer than num_steps - 1 drafts
    accepted: every child was tested and rejected; a leaf has none). A request that accepted num_steps - 1 drafts
    never tested its last node's children."""
    batch = target.shape[0]
    rows = torch.arange(batch, device=target.device)
    flat = accept_index.gather(1, accept_token_num.long().unsqueeze(1)).long()  # [B, 1]: retrive_index of the node
    node = (tree["retrive_index"].long() == flat).int().argmax(1)
    residual = target[rows, node].double()
    stopped = accept_token_num.long() < num_steps - 1
    child = torch.where(stopped, tree["retrive_next_token"][rows, node].long(), -1)
    while bool((child >= 0).any()):
        live = child >= 0
        token = tree["candidates"][rows, child.clamp_min(0)].long()
        residual[rows[live], token[live]] = 0.0
        child = torch.where(live, tree["retrive_next_sibling"][rows, child.clamp_min(0)].long(), -1)
    return residual


def check_last_tokens(tree, target, accept_index, accept_token_num, num_steps, final, got, expected):
    """Every last token the kernel drew (got [B]) is the exact inverse-CDF draw of the coin final[b] * mass up to
    CDF_ROUNDING of the mass; where it differs from the torch reference's (expected [B]), the coin lies within
    CDF_ROUNDING of the boundary between the two tokens: they are neighbours in CDF order but for entries of
    (nearly) no mass, and the coin sits where float32 rounding decides between them."""
    residual = last_token_rows(tree, target, accept_index, accept_token_num, num_steps)
    cdf = residual.cumsum(-1)
    mass = cdf[:, -1]
    coin = final.double() * mass
    tol = CDF_ROUNDING * mass
    def through(t):
        return cdf.gather(1, t.unsqueeze(1)).squeeze(1)  # the CDF through token t
    def before(t):
        return through(t) - residual.gather(1, t.unsqueeze(1)).squeeze(1)  # ... and before it
    for name, t in (("kernel", got), ("reference", expected)):
        no_mass = residual.gather(1, t.unsqueeze(1)).squeeze(1) <= 0
        assert not bool(no_mass.any()), f"{name}: last tokens without mass in their row: {no_mass.nonzero().tolist()}"
        outside = (coin < before(t) - tol) | (coin > through(t) + tol)
        assert not bool(outside.any()), f"{name}: last tokens off the coin's place: {outside.nonzero().tolist()}"
    lo, hi = torch.minimum(got, expected), torch.maximum(got, expected)
    # the boundary: the CDF through the lower token, and before the higher (equal for neighbours in CDF order)
    off = (got != expected) & (((coin - through(lo)).abs() > tol) | ((coin - before(hi)).abs() > tol))
    assert not bool(off.any()), [(b, int(got[b]), int(expected[b]), float(coin[b] / mass[b]),
                                  float(through(lo)[b] / mass[b]), float(before(hi)[b] / mass[b]))
                                 for b in off.nonzero().flatten().tolist()]


def test_deep_nodes_numbered_first_on_cuda_without_host_sync(gen):
    """S = 3 on trees whose depth-3 nodes come before root children in the numbering (root -> {1 -> 2 -> 3, 4, 5} and
    root -> {1 -> 3 -> 4, 2 -> 5}, 32 requests each): CUDA keeps the numbers and gives the op the deep nodes
    parentless, without a host read; the outputs are SGLang's kernel's (the port) on the same coins."""
    batch, n, vocab = 64, 6, 50
    nt = torch.tensor([[1, 2, 3, -1, -1, -1], [1, 3, 5, 4, -1, -1]]).repeat(batch // 2, 1)
    ns = torch.tensor([[-1, 4, -1, -1, 5, -1], [-1, 2, -1, -1, -1, -1]]).repeat(batch // 2, 1)
    cand = torch.stack([torch.randperm(vocab, generator=gen)[:n] for _ in range(batch)])
    tree = dict(candidates=cand, retrive_index=torch.arange(batch * n).view(batch, n), retrive_next_token=nt,
                retrive_next_sibling=ns)
    logits = torch.randn(batch, n, vocab, generator=gen)
    parent = torch.tensor([[0, 0, 1, 2, 0, 0], [0, 0, 0, 1, 3, 2]]).repeat(batch // 2, 1)
    logits[torch.arange(batch).unsqueeze(-1), parent, cand] += 3.0  # walks go two levels deep
    target = torch.softmax(logits, -1)
    coins, final = torch.rand(batch, n, generator=gen), torch.rand(batch, generator=gen)
    args = (to_cuda(tree), target.to(CUDA), coins.to(CUDA), final.to(CUDA), 3, batch * n)
    sglang_sample(*args)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = [t.cpu() for t in sglang_sample(*args)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # On the CPU (CUDA's kernel draws the CPU kernel's tokens bit for bit; the port's CUDA cumsum adds in another order)
    want = sglang_target_only_torch(*(tree[k] for k in ("candidates", "retrive_index", "retrive_next_token",
                                                          "retrive_next_sibling")), coins, final, target, 3)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert torch.equal(got[0], torch.where(want[0] == -1, POISON, want[0]))
    assert (want[1][0::2, 1] % n >= 4).any(), "a root child numbered after the deep node was accepted"


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
            torch.full((batch, 4), -1, dtype=torch.int32, device=CUDA), torch.zeros(batch, dtype=torch.int32,
                                                                                    device=CUDA)]
    sgl_call(sgl_kernel.tree_speculative_sampling_target_only, *want, tree=tree, uniform_samples=coins,
             uniform_samples_for_final_sampling=final, target_probs=target, draft_probs=torch.zeros_like(target))
    got = sglang_sample(tree, target, coins, final, 4, batch * n)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    # the last token is drawn by inverse CDF on both sides; float32 sums may differ at a bucket's edge
    assert (got[0] == want[0]).float().mean() > 0.98
    want = [torch.full((batch * n,), POISON, dtype=torch.int32, device=CUDA),
            torch.full((batch, 4), -1, dtype=torch.int32, device=CUDA), torch.zeros(batch, dtype=torch.int32,
                                                                                    device=CUDA)]
    sgl_call(sgl_kernel.verify_tree_greedy, *want, tree=tree, target_predict=target.argmax(-1))
    got = sglang_greedy(tree, target.argmax(-1), 4, batch * n)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
