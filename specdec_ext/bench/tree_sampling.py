"""tree_speculative_sampling_from_logits (point and sampled children), ours against PyTorch and the reference.

Trees shaped as a decoder drafts them (breadth first, `branching` children per node, N nodes), candidates
drawn from a draft related to the target, so that walks go a few nodes deep. Two baselines in the same run:
`torch`, a vectorised float32 implementation of the same method (over requests; one step per depth and per
child, softmax over the whole [B, N, V] tensors, the last token by an exponential race), and `reference`, the
float64 oracle of specdec_ext.reference. bytes: what the op must read, floor_us: their time at the copy bandwidth
measured in the run; grid: the CUDA launch, blocks x threads (an H200's when run on the CPU). GB/s (from graph_us on
a GPU) counts the bytes the op must read at least: the target row (and, when its children were sampled, the draft
row) of every node on the accepted path, once more for the row the last token is drawn from.
"""
import torch

import specdec_ext
from specdec_ext import reference

from ..factory import choose_device
from .chain_sampling import graph_replay_us
from .common import (
    add_common_arguments,
    copy_bandwidth_gbs,
    int_list,
    median_us,
    print_row,
    report,
    sampling_grid,
    save,
)

BRANCHING = 4  # children per node of the drafted trees


def add_arguments(parser) -> None:
    parser.add_argument("--batch", type=int_list, default=[1, 8, 64], help="batch sizes B (default 1,8,64)")
    parser.add_argument("--nodes", type=int_list, default=[8, 32, 64],
                        help="tree nodes N, the root included (default 8,32,64)")
    parser.add_argument("--vocab", type=int_list, default=[49152], help="vocabulary sizes V (default 49152)")
    parser.add_argument("--dtype", default="float32,bfloat16",
                        help="comma-separated logits dtypes (default float32,bfloat16)")
    add_common_arguments(parser)


def breadth_first_parents(n: int, branching: int) -> torch.Tensor:
    """Node c's parent in the complete `branching`-ary tree cut to n nodes: (c - 1) // branching."""
    c = torch.arange(n)
    return torch.where(c == 0, -1, (c - 1) // branching).int()


def make_case(batch, n, branching, vocab, sampled, dtype, device, gen):
    parents = breadth_first_parents(n, branching).expand(batch, n).contiguous()
    draft = torch.randn(batch, n, vocab, generator=gen) * 2.5
    # Each node's children: distinct draws from its parent's draft row (Gumbel top-k), sampled or its top-k.
    keys = draft if not sampled else draft - torch.empty_like(draft).exponential_(generator=gen).log()
    top = keys.topk(branching, -1).indices  # [B, N, branching]
    c = torch.arange(1, n)
    tokens = torch.zeros(batch, n, dtype=torch.int32)
    tokens[:, 1:] = top[:, (c - 1) // branching, (c - 1) % branching].int()
    target = draft + 0.8 * torch.randn(batch, n, vocab, generator=gen)
    # A draft that is often right, as a trained head is: its candidates are likely under the target too.
    target.scatter_add_(-1, top, torch.full(top.shape, 6.0))
    def to(t):
        return t.to(device=device, dtype=dtype)
    return {"parents": parents.to(device), "tokens": tokens.to(device), "target_logits": to(target),
            "draft_logits": to(draft) if sampled else None,
            "seed": torch.randint(0, 2**62, (batch,), generator=gen).to(device)}


def torch_tree_sampling(parents, tokens, p_all, q_all=None):
    """An efficient vectorised PyTorch implementation of the same method (float32, its own RNG): p_all [B, N, V]
    target probabilities, q_all the draft's or None (point proposals)."""
    batch, n, vocab = p_all.shape
    device = p_all.device
    rows, nodes = torch.arange(batch, device=device), torch.arange(n, device=device)
    par, ids = parents.long(), tokens.long()
    node = torch.zeros(batch, dtype=torch.long, device=device)
    depth, token = torch.zeros_like(node), torch.full_like(node, -1)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    path = torch.full((batch, n), -1, dtype=torch.long, device=device)
    path[:, 0] = 0
    while not bool(done.all()):
        remaining = (par == node[:, None]) & (nodes > 0) & ~done[:, None]
        r = p_all[rows, node].clone()
        q = q_all[rows, node].clone() if q_all is not None else None
        nxt = torch.full_like(node, -1)
        while bool(remaining.any()):
            has = remaining.any(-1)
            c = remaining.int().argmax(-1)
            remaining[rows, c] = False
            testing = has & (nxt < 0)
            x = ids[rows, c]
            u = torch.rand(batch, device=device)
            if q is None:
                accept = testing & (u * r.sum(-1) < r[rows, x])
                rejected = testing & ~accept
                r[rows[rejected], x[rejected]] = 0.0
            else:
                accept = testing & (q[rows, x] > 0) & (u * q[rows, x] < r[rows, x])
                rejected = (testing & ~accept)[:, None]
                residual = (r - q).clamp_min_(0)
                r = torch.where(rejected, residual / residual.sum(-1, keepdim=True).clamp_min(1e-30), r)
                q[rows[rejected[:, 0]], x[rejected[:, 0]]] = 0.0
                q = torch.where(rejected, q / q.sum(-1, keepdim=True).clamp_min(1e-30), q)
            nxt = torch.where(accept, c, nxt)
        moving, stopping = ~done & (nxt >= 0), ~done & (nxt < 0)
        token = torch.where(stopping, (r / torch.empty_like(r).exponential_()).argmax(-1), token)
        node = torch.where(moving, nxt, node)
        depth = depth + moving.long()
        path[rows[moving], depth[moving]] = node[moving]
        done |= stopping
    out = torch.full((batch, n), -1, dtype=torch.long, device=device)
    out[:, :n - 1] = torch.where(nodes[:n - 1] < depth[:, None], ids.gather(1, path.clamp_min(0))[:, 1:], -1)
    out[rows, depth] = token
    return out, path, depth


def bytes_read(out, n, branching, vocab, elem, sampled):
    """The least the op reads: each accepted-path node's target row (and draft row if it has sampled children),
    and the last token's row once more."""
    visited = out.num_accepted.long() + 1
    per_row = 2 if sampled else 1
    return int((visited * per_row + per_row).sum()) * vocab * elem


def measure(case, batch, n, branching, vocab, sampled, dtype, device, repeats, peak):
    parents, tokens, tl, dl, seed = (case[k] for k in ("parents", "tokens", "target_logits", "draft_logits", "seed"))
    t = torch.ones(batch, device=device)  # a device tensor: ours is also captured in a CUDA graph below
    def ours():
        return specdec_ext.tree_speculative_sampling_from_logits(parents, tokens, tl, dl, temperature=t, seed=seed)
    def base():
        return torch_tree_sampling(parents, tokens, torch.softmax(tl.float(), -1),
                                           torch.softmax(dl.float(), -1) if dl is not None else None)
    def ref():
        return reference.tree_speculative_sampling_from_logits(parents, tokens, tl, dl, temperature=1.0, seed=seed)
    ours_us = median_us(ours, device, repeats)
    torch_us = median_us(base, device, max(5, repeats // 4), warmup=2)
    ref_us = median_us(ref, device, max(3, repeats // 10), warmup=1)
    out = ours()
    graph_us = graph_replay_us(ours, device, repeats) if device.type == "cuda" else ours_us
    nbytes = bytes_read(out, n, branching, vocab, torch.finfo(dtype).bits // 8, sampled)
    gbs = nbytes / (graph_us * 1e-6) / 1e9
    return {"children": "sampled" if sampled else "point", "dtype": str(dtype).replace("torch.", ""), "B": batch,
            "N": n, "branching": branching, "V": vocab, "accepted": float(out.num_accepted.float().mean()),
            "ours_us": ours_us, "graph_us": graph_us, "torch_us": torch_us, "speedup": torch_us / ours_us,
            "reference_us": ref_us, "vs_reference": ref_us / ours_us, "bytes": nbytes,
            "floor_us": nbytes / (peak * 1e9) * 1e6, "GB/s": gbs, "of_copy_bw": gbs / peak,
            "grid": sampling_grid(batch, device)}


def main(args) -> int:
    device = choose_device(args.device)
    peak = copy_bandwidth_gbs(device)
    dtypes = [getattr(torch, d) for d in args.dtype.split(",")]
    rows = []
    for dtype in dtypes:
        for vocab in args.vocab:
            for batch in args.batch:
                for n in args.nodes:
                    for sampled in (False, True):
                        gen = torch.Generator().manual_seed(batch * 1000 + n * 10 + vocab + sampled)
                        case = make_case(batch, n, BRANCHING, vocab, sampled, dtype, device, gen)
                        rows.append(measure(case, batch, n, BRANCHING, vocab, sampled, dtype, device, args.repeats,
                                            peak))
                        print_row(rows[-1])
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    report(f"tree speculative sampling on {name} (copy bandwidth {peak:.0f} GB/s)", rows,
           ["children", "dtype", "B", "N", "V", "accepted", "ours_us", "graph_us", "torch_us", "speedup",
            "reference_us", "vs_reference", "bytes", "floor_us", "GB/s", "of_copy_bw", "grid"])
    save(args, {"title": f"tree speculative sampling, {name}", "device": name, "copy_bw_gbs": peak}, rows,
         ["children", "dtype", "B", "N", "V"])
    return 0
