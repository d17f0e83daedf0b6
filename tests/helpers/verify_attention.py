"""verify_attention's bound on the relative error, its error measure, and random token-tree masks (the FlashInfer shim's
attention tests use them too)."""
import torch

# verify_attention's bound on the relative error against the float64 reference, by dtype
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def rel_error(out, ref):
    return float((out.double() - ref).norm() / ref.norm())


def random_tree_mask(gen, n_q):
    """A valid token tree: each node's parent is an earlier node; a node sees itself and its ancestors."""
    mask = torch.zeros(n_q, n_q, dtype=torch.bool)
    for i in range(n_q):
        mask[i, i] = True
        if i > 0:
            parent = int(torch.randint(0, i, (1,), generator=gen))
            mask[i] |= mask[parent]
    return mask
