"""The SGLang shim's cases (tests/gpu reruns them on CUDA): sgl-kernel's own tree case, random trees in SGLang's
form, a batch whose law over the first two tokens is known, and the shim's calls into poisoned buffers."""
import functools

import torch

from specdec_ext.compat import sglang

POISON = -77


def sglang_buffers(batch, steps, size, device="cpu"):
    """Poisoned output buffers: what the shim must write (or leave) is then visible."""
    poisoned = functools.partial(torch.full, fill_value=POISON, dtype=torch.int32, device=device)
    return poisoned((size,)), poisoned((batch, steps)), poisoned((batch,))


def sglang_kernel_case():
    """The two requests of six nodes of sgl-kernel's tests/speculative/test_speculative_sampling.py, re-typed as
    data: request 0 is root -> {1 -> 2, 3 -> 4 -> 5}, request 1 is root -> {4 -> 5, 1 -> 2 -> 3} (its siblings
    listed out of index order); the target (temperature 0.01) all but certainly follows 0 -> 3 -> 4 -> 5 and
    0 -> 4 -> 5, and elsewhere emits token 18."""
    tree = dict(candidates=torch.tensor([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]]),
                retrive_index=torch.tensor([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]),
                retrive_next_token=torch.tensor([[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]]),
                retrive_next_sibling=torch.tensor([[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]]))
    logits = torch.full((2, 6, 20), 1.0)
    for b, n, v in ((0, 0, 3), (0, 3, 4), (0, 4, 5), (1, 0, 11), (1, 4, 12)):
        logits[b, n, v] = 10.0
    logits[logits.amax(-1) < 10.0] = torch.where(torch.arange(20) == 18, 10.0, 1.0)
    return tree, torch.softmax(logits / 0.01, -1)


SGLANG_EXPECTED = dict(predicts=[3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18],
                       accept_index=[[0, 3, 4, 5], [6, 10, 11, -1]], accept_token_num=[3, 2])


def sglang_sample(tree, target, coins, final, steps, size, draft=None, **kw):
    """sglang.tree_speculative_sampling_target_only into poisoned buffers: (predicts, accept_index,
    accept_token_num)."""
    predicts, accept_index, accept_token_num = sglang_buffers(target.shape[0], steps, size, target.device)
    sglang.tree_speculative_sampling_target_only(predicts, accept_index, accept_token_num, uniform_samples=coins,
                                                 uniform_samples_for_final_sampling=final, target_probs=target,
                                                 draft_probs=draft, **tree, **kw)
    return predicts, accept_index, accept_token_num


def sglang_greedy(tree, target_predict, steps, size):
    """sglang.verify_tree_greedy into poisoned buffers: (predicts, accept_index, accept_token_num)."""
    predicts, accept_index, accept_token_num = sglang_buffers(target_predict.shape[0], steps, size,
                                                                      target_predict.device)
    sglang.verify_tree_greedy(predicts, accept_index, accept_token_num, target_predict=target_predict, **tree)
    return predicts, accept_index, accept_token_num


def random_lcrs(gen, batch, n, vocab, shuffle):
    """Random trees in SGLang's form, ragged (padding nodes at the end), siblings in random list order; with
    shuffle, node numbers permuted (children may come before parents; the padding lands anywhere)."""
    nt = torch.full((batch, n), -1, dtype=torch.long)
    ns = torch.full((batch, n), -1, dtype=torch.long)
    cand = torch.zeros(batch, n, dtype=torch.long)
    for b in range(batch):
        size = int(torch.randint(1, n + 1, (1,), generator=gen))
        order = torch.randperm(n, generator=gen).tolist() if shuffle else list(range(n))
        order.remove(0)
        order = [0] + order  # node numbers of the tree's 0th, 1st, ... node
        parents = [None] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, size)]
        # distinct tokens when the vocabulary allows (the op's trees need distinct siblings; greedy takes repeats)
        cand[b] = torch.randperm(vocab, generator=gen)[:n] if vocab >= n else torch.randint(0, vocab, (n,),
                                                                                            generator=gen)
        for i in range(1, size):  # push front or back of the parent's list at random
            p, me = order[parents[i]], order[i]
            if nt[b, p] == -1 or bool(torch.rand(1, generator=gen) < 0.5):
                ns[b, me], nt[b, p] = nt[b, p], me
            else:
                last = int(nt[b, p])
                while ns[b, last] != -1:
                    last = int(ns[b, last])
                ns[b, last] = me
    ri = torch.arange(batch).unsqueeze(-1) * n + torch.arange(n)
    return dict(candidates=cand, retrive_index=ri, retrive_next_token=nt, retrive_next_sibling=ns)


def first_two_law_batch(gen, trials, sampled):
    """A fixed target over V = 6 tokens: p1 at the root, p2[t] after token t; the tree: root -> nodes 1, 2, 3 (tokens
    distinct), node 1 -> nodes 4, 5. Point proposals: fixed tokens; sampled: each node's children drawn without
    replacement from its draft row, in sibling order (q1 at the root, q2[t] after token t)."""
    vocab = 6
    p1 = torch.softmax(torch.randn(vocab, generator=gen), 0)
    p2 = torch.softmax(torch.randn(vocab, vocab, generator=gen) * 0.8, -1)
    q1 = torch.softmax(torch.randn(vocab, generator=gen), 0)
    q2 = torch.softmax(torch.randn(vocab, vocab, generator=gen), -1)
    if sampled:  # Gumbel top-k: distinct draws, in the order of drawing without replacement
        first = (q1.log() - torch.empty(trials, vocab).exponential_(generator=gen).log()).topk(3, -1).indices
        second = (q2[first[:, 0]].log() - torch.empty(trials, vocab).exponential_(generator=gen).log()).topk(2,
                                                                                                             -1).indices
    else:
        first, second = torch.tensor([[2, 0, 5]]).expand(trials, 3), torch.tensor([[1, 4]]).expand(trials, 2)
    cand = torch.cat([torch.zeros(trials, 1, dtype=torch.long), first, second], 1)
    rows = torch.stack([p1.expand(trials, vocab)] + [p2[cand[:, c]] for c in (1, 2, 3)] +
                       [torch.full((trials, vocab), 1.0 / vocab)] * 2, 1)
    draft = torch.stack([q1.expand(trials, vocab), q2[cand[:, 1]]] + [torch.full((trials, vocab), 1.0 / vocab)] * 4, 1)
    tree = dict(candidates=cand, retrive_index=torch.arange(trials * 6).reshape(trials, 6),
                retrive_next_token=torch.tensor([[1, 4, -1, -1, -1, -1]]).expand(trials, 6),
                retrive_next_sibling=torch.tensor([[-1, 2, 3, -1, 5, -1]]).expand(trials, 6))
    return tree, rows, draft if sampled else None, p1, p2
