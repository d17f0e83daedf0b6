"""SGLang's target-only tree verification through the shim against SGLang's method in PyTorch.

The shim is specdec_ext.compat.sglang.

The baseline, `sglang_target_only_torch`, is a readable vectorised formulation of what SGLang's target-only tree
verification computes (sgl-kernel 0.3.21): per tree level, the current node's children in sibling order, the
cumulative target mass of the children tried so far against the node's coin; at the end the last token from the
target row minus the rejected children, by inverse CDF on the final coin. Trees as SGLang's EAGLE builder makes
them (siblings listed in index order, parents numbered first), candidates favoured by the target so walks go a few
levels deep. Both sides get the same coins; ours makes the same decisions (tests/test_compat_sglang.py).
"""
import torch

from ..compat import sglang
from ..factory import choose_device
from .common import add_common_arguments, int_list, median_us, print_row, report, save


def add_arguments(parser) -> None:
    parser.add_argument("--batch", type=int_list, default=[1, 8, 64], help="batch sizes B (default 1,8,64)")
    parser.add_argument("--nodes", type=int_list, default=[4, 8], help="tree nodes N, the root included (default 4,8)")
    parser.add_argument("--vocab", type=int_list, default=[32000, 128256],
                        help="vocabulary sizes V (default 32000,128256)")
    add_common_arguments(parser)


def sglang_target_only_torch(candidates, retrive_index, next_token, next_sibling, coins, final_coins, target_probs,
                             num_steps):
    """SGLang's target-only tree verification in PyTorch (thresholds 1). Returns (predicts [B * N] int32, -1 where
    not written; accept_index [B, num_steps] int32; accept_token_num [B] int32)."""
    batch, n, vocab = target_probs.shape
    device = target_probs.device
    rows = torch.arange(batch, device=device)
    node = torch.zeros(batch, dtype=torch.long, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    accepted = torch.zeros(batch, dtype=torch.long, device=device)
    path = torch.full((batch, num_steps), -1, dtype=torch.long, device=device)
    path[:, 0] = 0
    rejected = torch.zeros(batch, vocab, dtype=torch.bool, device=device)  # the current node's rejected children
    for _ in range(1, num_steps):
        child = torch.where(done, -1, next_token[rows, node])
        coin, mass = coins[rows, node], torch.zeros(batch, device=device)
        moved = torch.zeros_like(done)
        while bool((child >= 0).any()):
            live = child >= 0
            token = candidates[rows, child.clamp_min(0)]
            mass = mass + torch.where(live, target_probs[rows, node, token].float(), 0.0)
            take = live & (coin <= mass)
            rejected[rows, token] |= live & ~take
            node = torch.where(take, child, node)
            moved |= take
            child = torch.where(take | ~live, -1, next_sibling[rows, child.clamp_min(0)])
        rejected &= ~moved.unsqueeze(-1)  # a request that moved on draws its last token from a later node
        accepted += moved.long()
        path[rows[moved], accepted[moved]] = node[moved]
        done |= ~moved
        if bool(done.all()):
            break
    residual = torch.where(rejected, 0.0, target_probs[rows, node].float())
    cdf = residual.cumsum(-1)
    last = torch.searchsorted(cdf, (final_coins * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    last = last.clamp_max(vocab - 1)
    flat = retrive_index.gather(1, path.clamp_min(0))
    accept_index = torch.where(path >= 0, flat, -1).int()
    following = candidates.gather(1, torch.cat([path[:, 1:], path[:, :1]], 1).clamp_min(0))
    steps = torch.arange(num_steps, device=device)
    tokens = torch.where(steps < accepted.unsqueeze(-1), following, last.unsqueeze(-1))
    predicts = torch.full((batch * n + 1,), -1, dtype=torch.int32, device=device)
    predicts.scatter_(0, torch.where(steps <= accepted.unsqueeze(-1), flat, batch * n).reshape(-1),
                      tokens.int().reshape(-1))
    return predicts[:-1], accept_index, accepted.int()


def eagle_like_tree(batch, n, branching, device):
    """SGLang's builder's layout for a breadth-first tree of n nodes: node c's parent (c - 1) // branching, each
    node's first child its smallest child, siblings listed in index order, retrive_index b * n + c."""
    c = torch.arange(n)
    parent = torch.where(c == 0, -1, (c - 1) // branching)
    next_token = torch.full((n,), -1, dtype=torch.long)
    next_sibling = torch.full((n,), -1, dtype=torch.long)
    for i in range(n - 1, 0, -1):
        next_sibling[i] = next_token[parent[i]]
        next_token[parent[i]] = i
    def expand(t):
        return t.expand(batch, n).contiguous().to(device)
    return (expand(parent), (torch.arange(batch).unsqueeze(-1) * n + c).to(device), expand(next_token),
            expand(next_sibling))


def make_case(batch, n, vocab, device, gen):
    parent, retrive_index, next_token, next_sibling = eagle_like_tree(batch, n, 2, device)
    logits = torch.randn(batch, n, vocab, generator=gen) * 2.0
    candidates = torch.randint(0, vocab, (batch, n), generator=gen)
    candidates[:, 1:] = torch.randperm(vocab, generator=gen)[:n - 1]  # distinct, so siblings never repeat
    # The target likes the candidates (as it likes a trained head's): walks go a level or more deep.
    parent_rows = parent.clamp_min(0).cpu()
    logits[torch.arange(batch).unsqueeze(-1), parent_rows[:, 1:], candidates[:, 1:]] += 14.0
    return {"candidates": candidates.to(device), "retrive_index": retrive_index, "next_token": next_token,
            "next_sibling": next_sibling, "target_probs": torch.softmax(logits, -1).to(device),
            "coins": torch.rand(batch, n, generator=gen).to(device),
            "final": torch.rand(batch, generator=gen).to(device)}


def measure(case, batch, n, vocab, device, repeats):
    num_steps = n  # a chain could use every node
    predicts = torch.empty(batch * n, dtype=torch.int32, device=device)
    accept_index = torch.empty(batch, num_steps, dtype=torch.int32, device=device)
    accept_token_num = torch.empty(batch, dtype=torch.int32, device=device)
    args = (case["candidates"], case["retrive_index"], case["next_token"], case["next_sibling"], case["coins"],
            case["final"], case["target_probs"])
    def ours():
        return sglang.tree_speculative_sampling_target_only(
            predicts, accept_index, accept_token_num, args[0], args[1], args[2], args[3], args[4], args[5], args[6])
    def base():
        return sglang_target_only_torch(*args, num_steps)
    ours_us = median_us(ours, device, repeats)
    torch_us = median_us(base, device, repeats)
    _, want_index, want_num = base()
    ours()
    agree = bool(torch.equal(accept_index, want_index) and torch.equal(accept_token_num, want_num))
    return {"B": batch, "N": n, "V": vocab, "accepted": float(accept_token_num.float().mean()), "ours_us": ours_us,
            "torch_us": torch_us, "speedup": torch_us / ours_us, "same_path": agree}


def main(args) -> int:
    device = choose_device(args.device)
    rows = []
    for vocab in args.vocab:
        for batch in args.batch:
            for n in args.nodes:
                gen = torch.Generator().manual_seed(batch * 1000 + n * 10 + vocab)
                rows.append(measure(make_case(batch, n, vocab, device, gen), batch, n, vocab, device, args.repeats))
                print_row(rows[-1])
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    report(f"SGLang tree verification (target only): the shim against SGLang's method in PyTorch, on {name}", rows,
           ["B", "N", "V", "accepted", "ours_us", "torch_us", "speedup", "same_path"])
    save(args, {"title": f"SGLang shim vs PyTorch, {name}", "device": name}, rows, ["B", "N", "V"])
    return 0
