"""Inputs of the sampling ops (chain and tree rounds of random correlated target and draft rows), and the engine
layouts' twins: the same rows padded and flat."""
import torch

# ---------------------------------------------------------------------------------------- inputs of the sampling ops

def make_chain_inputs(gen, batch, k, vocab, dtype=torch.float32, with_draft=True, sharpness=2.0):
    """Correlated target and draft logits (so that drafts are often, not always, accepted), their
    probabilities, and draft tokens sampled from the draft distribution."""
    base = torch.randn(batch, k + 1, vocab, generator=gen) * sharpness
    target_logits = base
    draft_logits = base[:, :k] + 0.7 * torch.randn(batch, k, vocab, generator=gen)
    target_probs = torch.softmax(target_logits, -1)
    draft_probs = torch.softmax(draft_logits, -1)
    ids = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=gen).reshape(batch, k).int()
    return {
        "ids": ids,
        "target_probs": target_probs.to(dtype),
        "draft_probs": draft_probs.to(dtype) if with_draft else None,
        "target_logits": target_logits.to(dtype),
        "draft_logits": draft_logits.to(dtype) if with_draft else None,
        "num_draft_tokens": torch.randint(0, k + 1, (batch,), generator=gen, dtype=torch.int32),
        "seed": torch.randint(-(2**63), 2**63 - 1, (batch,), generator=gen),
        "offset": torch.randint(0, 2**40, (batch,), generator=gen),
    }


def misaligned_copy(t):
    """The same values in rows that start one element past a 16-byte boundary (the kernels' scalar path)."""
    if t is None:
        return None
    padded = torch.empty(*t.shape[:-1], t.shape[-1] + 1, dtype=t.dtype)
    padded[..., 1:] = t
    return padded[..., 1:]


def dirichlet(gen, *shape, concentration=1.0):
    g = torch.distributions.Gamma(torch.full(shape, concentration, dtype=torch.float64), 1.0)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    x = g.sample()
    return x / x.sum(-1, keepdim=True)


def random_trees(gen, batch, n, vocab, branching, depth):
    """[B, n] parents and candidate tokens of random trees: node c's parent is a random earlier node with fewer
    than `branching` children and depth below `depth`; siblings' tokens are distinct. Returns parents, tokens
    and the number of nodes each tree got (<= n)."""
    parents = torch.full((batch, n), -1, dtype=torch.int32)
    tokens = torch.randint(0, vocab, (batch, n), generator=gen, dtype=torch.int32)
    num_nodes = torch.ones(batch, dtype=torch.int32)
    for b in range(batch):
        node_depth, kids = [0], [[]]
        for c in range(1, n):
            open_ = [i for i in range(c) if len(kids[i]) < min(branching, vocab) and node_depth[i] < depth]
            if not open_:
                break
            p = open_[int(torch.randint(0, len(open_), (1,), generator=gen))]
            used = {int(tokens[b, k]) for k in kids[p]}
            free = [v for v in range(vocab) if v not in used] if vocab <= 64 else None
            x = free[int(torch.randint(0, len(free), (1,), generator=gen))] if free is not None else int(tokens[b, c])
            while x in used:
                x = int(torch.randint(0, vocab, (1,), generator=gen))
            parents[b, c], tokens[b, c] = p, x
            kids[p].append(c)
            kids.append([])
            node_depth.append(node_depth[p] + 1)
            num_nodes[b] = c + 1
    return parents, tokens, num_nodes


def make_tree_inputs(gen, batch, n, vocab, dtype=torch.float32, with_draft=True, branching=3, depth=4, sharpness=2.0,
                     ragged=True):
    parents, tokens, full = random_trees(gen, batch, n, vocab, branching, depth)
    num_nodes = torch.minimum(full, torch.randint(1, n + 1, (batch,), generator=gen, dtype=torch.int32)) if ragged \
        else full
    base = torch.randn(batch, n, vocab, generator=gen) * sharpness
    # Candidates are often, not always, the target's likely tokens: raise each node's token in its parent's row.
    rows = torch.arange(batch).unsqueeze(-1)
    base[rows, parents.long().clamp_min(0), tokens.long()] += torch.where(parents >= 0, 2.0, 0.0)
    draft = base + 0.7 * torch.randn(batch, n, vocab, generator=gen)
    return {
        "parents": parents, "tokens": tokens, "num_nodes": num_nodes,
        "target_logits": base.to(dtype), "draft_logits": draft.to(dtype) if with_draft else None,
        "target_probs": torch.softmax(base, -1).to(dtype),
        "draft_probs": torch.softmax(draft, -1).to(dtype) if with_draft else None,
        "seed": torch.randint(-(2**63), 2**63 - 1, (batch,), generator=gen),
        "offset": torch.randint(0, 2**40, (batch,), generator=gen),
    }


# ---------------------------------------------------------- the sampling ops' engine layouts (padded and flat twins)

def ragged_batch(gen, batch, max_k, vocab, dtype=torch.float32, sharpness=3.0, zero_rows=True, full=False):
    """A padded batch with ragged counts (k = 0 rows included; every count max_k with full) and its flat twin over the
    same rows."""
    counts = torch.randint(0, max_k + 1, (batch,), generator=gen, dtype=torch.int32)
    if full:
        counts.fill_(max_k)
    elif zero_rows:
        counts[0] = 0
    base = torch.randn(batch, max_k + 1, vocab, generator=gen) * sharpness
    draft_logits = base[:, :max_k] + 0.7 * torch.randn(batch, max_k, vocab, generator=gen)
    target_logits = base
    draft_probs = torch.softmax(draft_logits, -1)
    ids = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=gen).reshape(batch, max_k).int() \
        if max_k else torch.zeros(batch, 0, dtype=torch.int32)
    # Half the drafts are the target's argmax, so that point proposals are accepted too.
    take_best = torch.rand(batch, max_k, generator=gen) < 0.5
    ids = torch.where(take_best, target_logits[:, :max_k].argmax(-1).int(), ids)
    # Poison what the padded form must not read: drafts past each count.
    pad = torch.arange(max_k) >= counts.unsqueeze(-1)
    ids = torch.where(pad, torch.full_like(ids, 10**6), ids)
    padded = {
        "ids": ids, "num_draft_tokens": counts,
        "target_probs": torch.softmax(target_logits, -1).to(dtype), "draft_probs": draft_probs.to(dtype),
        "target_logits": target_logits.to(dtype), "draft_logits": draft_logits.to(dtype),
        "uniforms": torch.rand(batch, max_k, generator=gen), "final_uniforms": torch.rand(batch, generator=gen),
        "bonus": torch.randint(0, vocab, (batch,), generator=gen, dtype=torch.int64),
        "seed": torch.randint(-(2**62), 2**62, (batch,), generator=gen),
        "offset": torch.randint(0, 2**40, (batch,), generator=gen),
    }
    flat = {"cu": counts.cumsum(0).int(), "ids": torch.cat([ids[b, :counts[b]] for b in range(batch)])}
    for kind in ("probs", "logits"):
        t, d = padded[f"target_{kind}"], padded[f"draft_{kind}"]
        flat[f"target_{kind}"] = torch.cat([t[b, :counts[b] + 1] for b in range(batch)])  # k_b rows, then the bonus row
        flat[f"target_{kind}_nobonus"] = torch.cat([t[b, :counts[b]] for b in range(batch)])
        flat[f"draft_{kind}"] = torch.cat([d[b, :counts[b]] for b in range(batch)])
    flat["uniforms"] = torch.cat([padded["uniforms"][b, :counts[b]] for b in range(batch)])
    return padded, flat


def reduced_vocab(gen, vocab, draft_vocab):
    return torch.randperm(vocab, generator=gen)[:draft_vocab].int()


def scatter_full(rows, draft_to_target, vocab, logits):
    full = rows.new_full((*rows.shape[:-1], vocab), float("-inf") if logits else 0.0)
    full[..., draft_to_target.long()] = rows
    return full


def padded_and_flat_trees(gen, batch, max_nodes, vocab, dtype=torch.float32):
    """Padded random trees with ragged node counts (a lone root included), rows favouring the candidates, and the flat
    twin (request b's nodes from cu[b-1] + b)."""
    counts = torch.randint(1, max_nodes + 1, (batch,), generator=gen, dtype=torch.int32)
    counts[0] = 1
    parents = torch.full((batch, max_nodes), -1, dtype=torch.int32)
    cand = torch.zeros(batch, max_nodes, dtype=torch.int32)
    for b in range(batch):
        for c in range(1, int(counts[b])):  # mostly a chain, with branches
            deep = bool(torch.rand(1, generator=gen) < 0.6)
            parents[b, c] = c - 1 if deep else int(torch.randint(0, c, (1,), generator=gen))
        cand[b] = torch.randperm(vocab, generator=gen)[:max_nodes].int()  # distinct: siblings never repeat
    logits = torch.randn(batch, max_nodes, vocab, generator=gen) * 2
    for b in range(batch):  # each node's target favours its first child, so that paths go deep
        seen = set()
        for c in range(1, int(counts[b])):
            p = int(parents[b, c])
            logits[b, p, cand[b, c]] += 2.0 if p in seen else 9.0
            seen.add(p)
    draft = logits + 0.5 * torch.randn(batch, max_nodes, vocab, generator=gen)
    padded = {"parents": parents, "cand": cand, "num_nodes": counts, "target_logits": logits.to(dtype),
              "draft_logits": draft.to(dtype), "target_probs": torch.softmax(logits, -1).to(dtype),
              "draft_probs": torch.softmax(draft, -1).to(dtype), "uniforms": torch.rand(batch, max_nodes,
                                                                                        generator=gen)}
    flat = {"cu": (counts - 1).cumsum(0).int()}
    for key in ("parents", "cand", "target_logits", "draft_logits", "target_probs", "draft_probs", "uniforms"):
        flat[key] = torch.cat([padded[key][b, :counts[b]] for b in range(batch)])
    return padded, flat
