"""SGLang's tree verification kernels with SGLang's signatures and buffer conventions, on this library's lossless tree
op (docs/design.md §5).

Contract followed: sgl-kernel 0.3.21 (`sgl_kernel.tree_speculative_sampling_target_only` and `verify_tree_greedy`;
csrc/speculative/speculative_sampling.cuh and eagle_utils.cu), as SGLang 0.5's EAGLE verify step calls them:

- A request's draft tree is N nodes in left-child / right-sibling form: retrive_next_token[b, n] is node n's first
  child, retrive_next_sibling[b, n] its next sibling, -1 for none; node 0 is the root (the last emitted token);
  nodes the root does not reach are padding. candidates [B, N] holds the nodes' tokens and retrive_index [B, N] each
  node's flat position in `predicts` (b * N + n in SGLang). SGLang passes these as int64; int32 works too.
- Outputs, written in place: accept_index [B, S] int32 holds the flat positions of the accepted path, root first,
  then -1 (SGLang's caller pre-fills -1; we write the -1s as well); accept_token_num [B] int32 the accepted drafts,
  root excluded; predicts (1-D int32) gets, at the flat position of each node on the path, the token that follows
  it: the next accepted draft, or after the last node the resampled or bonus token. Other entries of predicts are
  left as they were, as SGLang leaves them. A walk accepts at most S - 1 drafts (deeper nodes are not verified).
- target_probs [B, N, V] (float32 in SGLang; bfloat16 / float16 also work here): row n is the target after node n.
  uniform_samples [B, N] and uniform_samples_for_final_sampling [B] are the caller's coins (float32, [0, 1)).
- threshold_single / threshold_acc below 1 are SGLang's lossy acceptance and are refused: this library is lossless.
- draft_probs: SGLang passes a zero-filled [B, N, V] scratch buffer (its kernel writes into it; we never do). A
  request whose root row of draft_probs has no mass (that buffer, or None) verifies its children as point proposals,
  as SGLang does; otherwise its children are taken as drawn without replacement, in sibling order, from draft_probs
  row n (this library's lossless rule for sampled trees; SGLang's own kernel ignores draft probabilities).

How the trees reach the op: it gets every node SGLang's walk can test, the nodes the root reaches within depth S - 1
wherever they are numbered (deeper nodes and padding may come first), as long as each is numbered after its parent,
and its ancestors too; SGLang's tree builder numbers parents first, which leaves everything in, and another numbering
verifies a smaller tree, still losslessly. Node numbers, and so the [B, N, V] rows, are kept when those nodes are
0, 1, ... (SGLang's builder, padding at the end); otherwise the CPU renumbers them and gathers their rows, and CUDA
(which would need a host read to choose) keeps the numbers and gives the op the other nodes as parentless, which it
skips. The op tests a node's children in index order; SGLang's builder lists siblings in index order, where the two
agree exactly.

Host synchronisation: none on CUDA. Malformed trees (a link outside [-1, N), a node linked twice, a link to the root,
a cycle), candidates outside [0, V), repeated sibling tokens, retrive_index outside predicts and coins outside
[0, 1) raise ValueError on the CPU (and in strict mode, specdec_ext.set_strict, which reads back); otherwise CUDA
gives a malformed request a root-only tree and leaves other outputs defined. With draft_probs given, CUDA runs the
op for both kinds of request and keeps each request's (it cannot ask which kinds the batch holds without a read).

The engine is not imported.
"""
import functools

import torch

from .. import compat
from ..ops import LIMITS, is_strict
from ..trees import ancestor_mask

# The largest float32 below 1: the op takes uniforms in [0, 1).
_U_MAX = 1.0 - 2.0**-24
_SPELLINGS = {f"retrieve_{s}": f"retrive_{s}" for s in ("index", "next_token", "next_sibling")}


def _either_spelling(fn):
    """SGLang spells the tree arguments retrive_* in sgl_kernel and retrieve_* in newer callers: take both."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        for new, old in _SPELLINGS.items():
            if new in kwargs:
                if old in kwargs:
                    raise TypeError(f"{fn.__name__}: got both {old} and {new}")
                kwargs[old] = kwargs.pop(new)
        return fn(*args, **kwargs)
    return wrapper


def _host_checks(device) -> bool:
    """Whether inputs are validated on the host: always on the CPU (free), on CUDA only in strict mode."""
    return device.type == "cpu" or is_strict()


def _check_buffers(op, predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                   retrive_next_sibling, device):
    """SGLang's shapes and dtypes; returns (B, N, S)."""
    tensors = dict(predicts=predicts, accept_index=accept_index, accept_token_num=accept_token_num,
                   candidates=candidates, retrive_index=retrive_index, retrive_next_token=retrive_next_token,
                   retrive_next_sibling=retrive_next_sibling)
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
        if t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device}, the inputs on {device}")
    for name, dims in (("predicts", 1), ("accept_index", 2), ("accept_token_num", 1)):
        if tensors[name].dim() != dims or tensors[name].dtype != torch.int32:
            raise ValueError(f"{op}: {name} must be a {dims}-D int32 tensor, got {tensors[name].dim()}-D "
                             f"{tensors[name].dtype}")
    if candidates.dim() != 2:
        raise ValueError(f"{op}: candidates must be [B, N], got shape {tuple(candidates.shape)}")
    batch, n = candidates.shape
    for name in ("candidates", "retrive_index", "retrive_next_token", "retrive_next_sibling"):
        t = tensors[name]
        if t.shape != (batch, n):
            raise ValueError(f"{op}: {name} must be [B, N] = [{batch}, {n}] like candidates, got {tuple(t.shape)}")
        if t.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{op}: {name} must be int64 (or int32), got {t.dtype}")
    if not 1 <= n <= LIMITS["max_tree_nodes"]:
        raise ValueError(f"{op}: N = {n} tree nodes, this library takes 1 to {LIMITS['max_tree_nodes']}")
    if accept_index.shape[0] != batch or accept_index.shape[1] < 1:
        raise ValueError(f"{op}: accept_index must be [B, S] with B = {batch} and S >= 1, got "
                         f"{tuple(accept_index.shape)}")
    if accept_token_num.shape != (batch,):
        raise ValueError(f"{op}: accept_token_num must be [B] = [{batch}], got {tuple(accept_token_num.shape)}")
    return batch, n, accept_index.shape[1]


def _read_tree(op, next_token, next_sibling, max_depth, host):
    """Left-child / right-sibling links [B, N] -> (parent [B, N] (-1: root, padding, malformed), depth [B, N],
    rank [B, N] (place in the sibling list), in_tree [B, N] (reachable within max_depth; the root always)).

    Vectorised: every node has at most one incoming link, so the links reversed form chains, ranked by pointer
    doubling (log2 N gathers) twice: along sibling links (rank, and the first sibling, whose incoming link is its
    parent's first-child link) and along parents (depth, and the top, which is the root for reachable nodes). A
    chain that does not end after N steps is a cycle. A malformed request keeps only its root."""
    batch, n = next_token.shape
    device = next_token.device
    idx = torch.arange(n, device=device).expand(batch, n)
    links, out_of_range = [], []
    for t in (next_token, next_sibling):
        t = t.long()
        bad = (t < -1) | (t >= n)
        out_of_range.append(bad.any(-1))
        links.append(torch.where(bad | (t < 0), n, t))  # column n: a dummy that absorbs "no link"
    child, sibling = links
    ones = torch.ones_like(child)
    indeg = torch.zeros(batch, n + 1, dtype=torch.long, device=device).scatter_add_(1, child, ones)
    indeg = indeg.scatter_add_(1, sibling, ones)[:, :n]
    pred = torch.arange(n + 1, device=device).repeat(batch, 1)
    pred = pred.scatter_(1, child, idx).scatter_(1, sibling, idx)[:, :n]
    first = torch.zeros(batch, n + 1, dtype=torch.bool, device=device).scatter_(1, child, True)[:, :n]
    has_pred = indeg > 0
    terminal = first | ~has_pred  # a sibling list's head, or a node nothing links to
    hop, rank = torch.where(terminal, idx, pred), (~terminal).long()
    for _ in range(n.bit_length()):
        rank, hop = rank + rank.gather(1, hop), hop.gather(1, hop)
    sibling_cycle = ~terminal.gather(1, hop)
    parent = torch.where(first.gather(1, hop) & ~sibling_cycle, pred.gather(1, hop), -1)
    up, depth = torch.where(parent >= 0, parent, idx), (parent >= 0).long()
    for _ in range(n.bit_length()):
        depth, up = depth + depth.gather(1, up), up.gather(1, up)
    parent_cycle = parent.gather(1, up) >= 0
    problems = {
        "retrive_next_token holds a link outside [-1, N)": out_of_range[0],
        "retrive_next_sibling holds a link outside [-1, N)": out_of_range[1],
        "a node is linked to twice (retrive_next_token / retrive_next_sibling)": (indeg > 1).any(-1),
        "a link points back to the root, node 0": indeg[:, 0] > 0,
        "the links form a cycle (retrive_next_token / retrive_next_sibling)": (sibling_cycle | parent_cycle).any(-1),
    }
    malformed = torch.stack(list(problems.values()), -1)
    if host and bool(malformed.any()):
        b, k = malformed.nonzero()[0].tolist()
        raise ValueError(f"{op}: malformed tree in request {b}: {list(problems)[k]}")
    ok = ~malformed.any(-1, keepdim=True)
    in_tree = (ok & (up == 0) & ~parent_cycle & (depth <= max_depth)) | (idx == 0)
    return torch.where(in_tree, parent, -1), torch.where(in_tree, depth, 0), rank, in_tree


def _check_in_tree(op, in_tree, values, low, high, name, what):
    bad = in_tree & ((values < low) | (values >= high))
    if bool(bad.any()):
        b, c = bad.nonzero()[0].tolist()
        raise ValueError(f"{op}: {name}[{b}, {c}] = {int(values[b, c])} is outside {what}")


def _write_outputs(predicts, accept_index, accept_token_num, retrive_index, nodes, tokens, num_accepted):
    """SGLang's outputs from a path: nodes [B, W] (root first, -1 after), tokens [B, W] (tokens[j]: what follows
    nodes[j]), num_accepted [B]. Only predicts' entries at the path's flat positions change: the writes go through a
    copy with one spare slot that absorbs the rest (a masked write would need the mask's count on the host)."""
    batch, s = accept_index.shape
    cols = min(nodes.shape[1], s)  # the trees were cut at depth S - 1: the path fits
    nodes, tokens = nodes[:, :cols].long(), tokens[:, :cols]
    on_path = nodes >= 0
    flat = retrive_index.long().gather(1, nodes.clamp_min(0))
    index = torch.full((batch, s), -1, dtype=torch.int32, device=nodes.device)
    index[:, :cols] = torch.where(on_path, flat, -1)
    accept_index.copy_(index)
    accept_token_num.copy_(num_accepted)
    size = predicts.numel()
    buffer = torch.cat([predicts, predicts.new_zeros(1)])
    target = torch.where(on_path & (flat >= 0) & (flat < size), flat, size)
    buffer.scatter_(0, target.reshape(-1), tokens.to(torch.int32).reshape(-1))
    predicts.copy_(buffer[:size])


def _refuse_lossy(op, threshold_single, threshold_acc, deterministic):
    for name, value in (("threshold_single", threshold_single), ("threshold_acc", threshold_acc)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != 1.0:
            raise ValueError(f"{op}: {name} = {value!r}: SGLang's thresholds below 1 accept drafts the target would "
                             "reject (a lossy mode); this library is lossless, so they must be 1.0")
    if not isinstance(deterministic, bool):
        raise ValueError(f"{op}: deterministic must be a bool, got {deterministic!r}")


@_either_spelling
def tree_speculative_sampling_target_only(predicts, accept_index, accept_token_num, candidates, retrive_index,
                                          retrive_next_token, retrive_next_sibling, uniform_samples,
                                          uniform_samples_for_final_sampling, target_probs, draft_probs=None,
                                          threshold_single=1.0, threshold_acc=1.0, deterministic=True) -> None:
    """SGLang's tree verification by sampling (module docstring), lossless. Writes predicts, accept_index and
    accept_token_num in place; `deterministic` is accepted for SGLang's signature (this op always is)."""
    op = "tree_speculative_sampling_target_only"
    _refuse_lossy(op, threshold_single, threshold_acc, deterministic)
    if not isinstance(target_probs, torch.Tensor) or target_probs.dim() != 3:
        raise ValueError(f"{op}: target_probs must be a [B, N, V] tensor")
    device = target_probs.device
    batch, n, s = _check_buffers(op, predicts, accept_index, accept_token_num, candidates, retrive_index,
                                 retrive_next_token, retrive_next_sibling, device)
    vocab = target_probs.shape[2]
    if target_probs.shape[:2] != (batch, n):
        raise ValueError(f"{op}: target_probs must be [B, N, V] with B, N = {batch}, {n}, got "
                         f"{tuple(target_probs.shape)}")
    for name, t, shape in (("uniform_samples", uniform_samples, (batch, n)),
                           ("uniform_samples_for_final_sampling", uniform_samples_for_final_sampling, (batch,))):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.shape != shape or t.device != device:
            raise ValueError(f"{op}: {name} must be a float32 tensor of shape {list(shape)} on {device}")
    if draft_probs is not None and (not isinstance(draft_probs, torch.Tensor) or draft_probs.shape != target_probs.shape
                                    or draft_probs.device != device):
        raise ValueError(f"{op}: draft_probs must be None or a tensor shaped like target_probs "
                         f"{tuple(target_probs.shape)}"
                         f" on {device}")
    host = _host_checks(device)
    parent, _, _, in_tree = _read_tree(op, retrive_next_token, retrive_next_sibling, s - 1, host)
    idx = torch.arange(n, device=device).expand(batch, n)
    cand = candidates.long()
    if host:
        _check_in_tree(op, in_tree, cand, 0, vocab, "candidates", f"[0, V = {vocab})")
        _check_in_tree(op, in_tree, retrive_index.long(), 0, predicts.numel(), "retrive_index",
                       f"predicts' {predicts.numel()} entries")
        twins = in_tree.unsqueeze(1) & in_tree.unsqueeze(2) & (idx > 0).unsqueeze(1) & \
            (parent.unsqueeze(1) == parent.unsqueeze(2)) & (cand.unsqueeze(1) == cand.unsqueeze(2)) & \
            (idx.unsqueeze(1) != idx.unsqueeze(2))
        if bool(twins.any()):
            b, c, d = twins.nonzero()[0].tolist()
            raise ValueError(f"{op}: candidates: nodes {c} and {d} of request {b} are siblings with the same token "
                             f"{int(cand[b, c])} (siblings must be distinct)")
        coins = torch.cat([uniform_samples.reshape(-1), uniform_samples_for_final_sampling])
        if not bool(((coins >= 0) & (coins < 1)).all()):
            raise ValueError(f"{op}: uniform_samples and uniform_samples_for_final_sampling must be in [0, 1)")

    # The op's tree: every node SGLang's walk can test (in_tree: reached within depth S - 1, wherever it is numbered)
    # whose ancestors are all numbered after their parents, as the op wants them (a node numbered before its parent is
    # left out with its subtree: a smaller tree, still lossless). Nodes outside it (deeper than S - 1, padding) may
    # come anywhere in the numbering. On the host they are dropped and the rest renumbered in order, the rows gathered
    # (only when a request needs it); on CUDA, where that decision is a host read, they keep their numbers with parent
    # -1, which the kernel skips (never a child, nor its subtree: README "Tree speculation").
    usable = in_tree & ~(ancestor_mask(parent) & ~(parent < idx).unsqueeze(1)).any(-1)
    coins = uniform_samples.clamp(0.0, _U_MAX)
    final = uniform_samples_for_final_sampling.clamp(0.0, _U_MAX)
    target, draft, order = target_probs, draft_probs, None
    if host and not bool((usable == (idx < usable.sum(-1, keepdim=True))).all()):
        order = torch.where(usable, idx, n + idx).argsort(-1)  # the op's node j is node order[b, j]
        slot = order.argsort(-1)  # and node c the op's node slot[b, c]
        parent = torch.where(parent >= 0, slot.gather(1, parent.clamp_min(0)), -1).gather(1, order)
        usable, cand, coins = usable.gather(1, order), cand.gather(1, order), coins.gather(1, order)
        rows = torch.arange(batch, device=device).unsqueeze(-1)
        target = target_probs[rows, order]
        draft = None if draft_probs is None else draft_probs[rows, order]
    num_nodes = torch.where(usable, idx + 1, 1).amax(-1).int()
    parents = torch.where(usable, parent, -1).int()  # int32: the op would read int64 back to range-check it

    # Coins. SGLang spends node n's coin on n's children: in sibling order it accepts the first child whose
    # cumulative target mass reaches the coin. The op tests child c with its own uniform u_c, accepting it when
    # u_c * (mass of p_n not yet rejected) < p_n(x_c). For point proposals u_c = (coin_n - E_c) / (1 - E_c), where
    # E_c is the mass of the siblings tested before c, is the coin conditioned on their rejection (uniform, and
    # independent of every other node's coin): the op then makes SGLang's decisions on SGLang's coins. With draft
    # rows the op's rule is another one, and child c spends its own coin, uniform_samples[b, c]; the root's coin is
    # then unused. The last token spends uniform_samples_for_final_sampling in both.
    par = parents.long().clamp_min(0)
    rows = torch.arange(batch, device=device).unsqueeze(-1)
    mass = target[rows, par, cand.clamp(0, vocab - 1)].float()
    earlier = (parents.unsqueeze(1) == parents.unsqueeze(2)) & (idx.unsqueeze(1) < idx.unsqueeze(2)) & \
        (usable & (idx > 0)).unsqueeze(1)
    tested = (earlier.float() * mass.unsqueeze(1)).sum(-1)
    left = 1.0 - tested
    u_point = torch.where(left > 0, (coins.gather(1, par) - tested) / left.clamp_min(1e-30), 0.0).clamp(0.0, _U_MAX)

    ops = compat.backend()
    def run(rows_q, u):
        return ops.tree_speculative_sampling(parents, cand, target, rows_q, num_nodes=num_nodes,
                                                              uniforms=u.contiguous(), final_uniforms=final, seed=0)
    if draft is None:
        out = run(None, u_point)
    else:
        point = ~(draft[:, 0] > 0).any(-1)  # SGLang's zero-filled scratch buffer: point proposals
        if host and bool(point.all()):
            out = run(None, u_point)
        elif host and not bool(point.any()):
            out = run(draft, coins)
        else:
            a, b = run(None, u_point), run(draft, coins)
            out = [torch.where(point.view(-1, *[1] * (x.dim() - 1)), x, y) for x, y in zip(a, b)]
    tokens, nodes, accepted = out
    if order is not None:  # back to SGLang's node numbers
        nodes = torch.where(nodes >= 0, order.gather(1, nodes.long().clamp_min(0)), -1)
    _write_outputs(predicts, accept_index, accept_token_num, retrive_index, nodes, tokens, accepted)


@_either_spelling
def verify_tree_greedy(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                       retrive_next_sibling, target_predict) -> None:
    """SGLang's greedy tree verification: from the root, follow the first child (in sibling order) whose token is
    the target's argmax after its parent, target_predict [B, N] (int64), read at the parent's flat position
    retrive_index[b, parent] as SGLang reads it; then emit the argmax after the last accepted node. Outputs as
    tree_speculative_sampling_target_only's. Vectorised over nodes (no walk, no rows of V: the op is not needed)."""
    op = "verify_tree_greedy"
    if not isinstance(target_predict, torch.Tensor):
        raise TypeError(f"{op}: target_predict must be a tensor, got {type(target_predict).__name__}")
    device = target_predict.device
    batch, n, s = _check_buffers(op, predicts, accept_index, accept_token_num, candidates, retrive_index,
                                 retrive_next_token, retrive_next_sibling, device)
    if target_predict.shape != (batch, n) or target_predict.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{op}: target_predict must be [B, N] = [{batch}, {n}] int64 (the target's argmax ids), got "
                         f"{tuple(target_predict.shape)} {target_predict.dtype}")
    host = _host_checks(device)
    parent, depth, rank, in_tree = _read_tree(op, retrive_next_token, retrive_next_sibling, s - 1, host)
    flat_index = retrive_index.long()
    if host:
        _check_in_tree(op, in_tree, flat_index, 0, min(predicts.numel(), batch * n), "retrive_index",
                       f"[0, {min(predicts.numel(), batch * n)}) (predicts and target_predict are indexed by it)")
    idx = torch.arange(n, device=device).expand(batch, n)
    argmax = target_predict.reshape(-1).long()
    def after(nodes):
        return argmax[flat_index.gather(1, nodes).clamp(0, batch * n - 1)]
    match = in_tree & (idx > 0) & (candidates.long() == after(parent.clamp_min(0)))
    # The first matching child of a node in sibling order; a node is on the path when it and its ancestors are.
    beaten = (parent.unsqueeze(1) == parent.unsqueeze(2)) & (rank.unsqueeze(1) < rank.unsqueeze(2)) & match.unsqueeze(1)
    good = (match & ~beaten.any(-1)) | (idx == 0)
    on_path = in_tree & ~(ancestor_mask(parent) & ~good.unsqueeze(1)).any(-1)
    nodes = torch.full((batch, s + 1), -1, dtype=torch.long, device=device)
    nodes.scatter_(1, torch.where(on_path, depth, s), idx.clone())
    nodes = nodes[:, :s]
    accepted = on_path.sum(-1) - 1
    j = torch.arange(s, device=device)
    following = candidates.long().gather(1, torch.cat([nodes[:, 1:], nodes[:, :1]], 1).clamp_min(0))
    last = nodes.gather(1, accepted.unsqueeze(-1))
    tokens = torch.where(j < accepted.unsqueeze(-1), following, torch.where(j == accepted.unsqueeze(-1), after(last),
                                                                            -1))
    _write_outputs(predicts, accept_index, accept_token_num, retrive_index, nodes, tokens, accepted.int())
