"""verify_attention's split plan and the invariances it keeps, on the CPU kernel and the CUDA kernel under the emulator.

- The split size of the CUDA kernel follows the request's cached length alone (attention_length_split_keys): 256 keys,
  doubled until its keys with up to 128 new tokens fill at most 32 splits; the CPU's is a fixed 512. Splits are cut at
  absolute multiples of the size.
- A query row's bits depend neither on its request's number of new tokens Q nor on the other requests of the batch:
  row i of a call with Q = q equals row i of the call with Q = 6 bit for bit, and a request alone equals that request
  in a ragged batch. A row verified at cached length L equals the same row decoded alone at L + i (the greedy
  speculative == plain greedy property), wherever the split size does not change between L and L + i.
- Forced split sizes (SPECDEC_ATTENTION_SPLIT_KEYS: 64, 320, 4096), with a sliding window whose start straddles a
  split, stay within the float64 reference's tolerance."""
import pytest
import torch

import specdec_ext
from helpers.verify_attention import TOLERANCE, rel_error
from specdec_ext import reference, sim
from specdec_ext.ops import _C

BACKENDS = {"cpu": specdec_ext, "sim": sim}
DTYPE = {"cpu": torch.float32, "sim": torch.bfloat16}


def test_the_cuda_split_size_follows_the_cached_length():
    size = _C.attention_split_keys
    assert [size(n) for n in (0, 1, 100, 8064)] == [256] * 4
    assert [size(n) for n in (8065, 16256, 16257, 32640, 32641)] == [512, 512, 1024, 1024, 2048]
    for length in (0, 777, 8065, 40000, 10**6):
        keys = size(length)
        assert -(-(length + 128) // keys) <= 32 and (keys == 256 or -(-(length + 128) // (keys // 2)) > 32)


def case(gen, backend, lengths, n_q, hq=8, hkv=2, d=64, extra_rows=0):
    """Flat q for requests of n_q[b] new tokens at cached lengths[b], a contiguous cache with room for them."""
    dtype = DTYPE[backend]
    total = sum(n_q) + extra_rows
    q = torch.randn(total, hq, d, generator=gen).to(dtype)
    kn = torch.randn(total, hkv, d, generator=gen).to(dtype)
    vn = torch.randn(total, hkv, d, generator=gen).to(dtype)
    s_max = max(length + n for length, n in zip(lengths, n_q)) + 5
    kc = torch.randn(len(lengths), s_max, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(len(lengths), s_max, hkv, d, generator=gen).to(dtype)
    return q, kn, vn, kc, vc


def call(backend, q, kc, vc, lengths, kn, vn, **kw):
    out, lse = BACKENDS[backend].verify_attention(q, kc.clone(), vc.clone(), torch.tensor(lengths, dtype=torch.int32),
                                                  kn, vn, return_lse=True, **kw)
    return out, lse


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("length,hq,d", [(250, 8, 64), (505, 8, 64), (700, 16, 64), (2100, 8, 64), (505, 8, 32)],
                         ids=["cuda_boundary", "cpu_boundary", "two_row_tiles", "splits", "head_dim32"])
def test_a_rows_bits_do_not_depend_on_q(backend, length, hq, d, gen):
    # Q = 1 .. 9 new tokens. At cached length 250 the request's keys cross the CUDA kernel's first split boundary (256)
    # from Q = 7 on, at 505 the CPU's (512) from Q = 8 on: more splits, the same rows. With hq = 16 and hkv = 2
    # (G = 8) Q = 8 is 64 rows, Q = 9 72: a second row tile.
    q, kn, vn, kc, vc = case(gen, backend, [length], [9], hq=hq, d=d)
    full, full_lse = call(backend, q[None], kc, vc, [length], kn[None], vn[None])
    for n in (1, 2, 5, 6, 8):
        out, lse = call(backend, q[None, :n], kc, vc, [length], kn[None, :n], vn[None, :n])
        assert torch.equal(out[0], full[0, :n]) and torch.equal(lse[0], full_lse[0, :n]), n
    ref = reference.verify_attention(q[None], kc.clone(), vc.clone(), torch.tensor([length], dtype=torch.int32),
                                     kn[None], vn[None])
    assert rel_error(full, ref) <= TOLERANCE[q.dtype]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rows_bits_do_not_depend_on_the_batch(backend, gen):
    lengths, n_q = [40, 2500, 900, 0, 9000], [3, 1, 7, 2, 5]
    q, kn, vn, kc, vc = case(gen, backend, lengths, n_q)
    indptr = torch.tensor([0] + n_q).cumsum(0).int()
    out, lse = call(backend, q, kc, vc, lengths, kn, vn, qo_indptr=indptr)
    for b in range(len(lengths)):
        rows = slice(int(indptr[b]), int(indptr[b + 1]))
        one, one_lse = call(backend, q[rows][None], kc[b:b + 1], vc[b:b + 1], [lengths[b]], kn[rows][None],
                            vn[rows][None])
        assert torch.equal(out[rows], one[0]) and torch.equal(lse[rows], one_lse[0]), b


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("length", [0, 1000, 8000])
def test_verified_rows_equal_rows_decoded_one_at_a_time(backend, length, gen):
    # Row i of a block of 5 verified at cached length L is bit for bit the row decoded alone at L + i, its predecessors
    # already in the cache: the speculative and the plain greedy step compute the same attention.
    q, kn, vn, kc, vc = case(gen, backend, [length], [5])
    block, _ = call(backend, q[None], kc, vc, [length], kn[None], vn[None])
    k_cache, v_cache = kc.clone(), vc.clone()
    for i in range(5):
        one = BACKENDS[backend].verify_attention(q[None, i:i + 1], k_cache, v_cache,
                                                 torch.tensor([length + i], dtype=torch.int32), kn[None, i:i + 1],
                                                 vn[None, i:i + 1])  # appends token i
        assert torch.equal(one[0, 0], block[0, i]), i


@pytest.mark.parametrize("backend", ["cpu"])
@pytest.mark.parametrize("length", [57, 500, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_rows_equal_their_paths_decoded_one_at_a_time(backend, length, dtype, gen):
    # A tree node's row is bit for bit the last row of its path (its ancestors, then itself) decoded one token at a
    # time: it sees its ancestors' keys at positions L, L + 1, ... as plain decoding puts them, not at their places
    # in the block, even where those places fall in another key tile (57: the tile boundary 64) or split (500: 512).
    from helpers.verify_attention import random_tree_mask

    n_q = 24
    q, kn, vn, kc, vc = case(gen, backend, [length], [n_q])
    q, kn, vn, kc, vc = (t.to(dtype) for t in (q, kn, vn, kc, vc))
    mask = random_tree_mask(gen, n_q)
    while int(mask.sum(-1).max()) < 9:  # deep enough to cross the boundaries
        mask = random_tree_mask(gen, n_q)
    tree, tree_lse = call(backend, q[None], kc, vc, [length], kn[None], vn[None], tree_mask=mask)
    for node in range(n_q):
        path = [int(j) for j in mask[node].nonzero().flatten()]
        k_cache, v_cache = kc.clone(), vc.clone()
        for depth, j in enumerate(path):  # each step appends its token
            one, one_lse = BACKENDS[backend].verify_attention(
                q[None, j:j + 1], k_cache, v_cache, torch.tensor([length + depth], dtype=torch.int32),
                kn[None, j:j + 1], vn[None, j:j + 1], return_lse=True)
        assert torch.equal(one[0, 0], tree[0, node]) and torch.equal(one_lse[0, 0], tree_lse[0, node]), (node, path)


@pytest.mark.parametrize("split_keys", [64, 320, 4096])
@pytest.mark.parametrize("window", [-1, 700])
def test_forced_split_sizes_against_the_reference(split_keys, window, monkeypatch, gen):
    monkeypatch.setenv("SPECDEC_ATTENTION_SPLIT_KEYS", str(split_keys))
    lengths, n_q = [1500, 37, 4100], 4
    q, kn, vn, kc, vc = case(gen, "sim", lengths, [n_q] * 3)
    q, kn, vn = (t.reshape(3, n_q, *t.shape[1:]) for t in (q, kn, vn))
    out, lse = call("sim", q, kc, vc, lengths, kn, vn, window_left=window)
    ref, ref_lse = reference.verify_attention(q, kc.clone(), vc.clone(), torch.tensor(lengths, dtype=torch.int32), kn,
                                              vn, window_left=window, return_lse=True)
    assert rel_error(out, ref) <= TOLERANCE[q.dtype]
    assert torch.allclose(lse, ref_lse.float(), atol=2e-2)
    # Every size gives a row the same attention up to rounding.
    monkeypatch.delenv("SPECDEC_ATTENTION_SPLIT_KEYS")
    default, _ = call("sim", q, kc, vc, lengths, kn, vn, window_left=window)
    assert rel_error(out, default.double()) <= TOLERANCE[q.dtype]


def test_a_bad_forced_split_size_is_named(monkeypatch, gen):
    q, kn, vn, kc, vc = case(gen, "sim", [10], [2])
    for value in ("100", "0", "-64", "x"):
        monkeypatch.setenv("SPECDEC_ATTENTION_SPLIT_KEYS", value)
        with pytest.raises(ValueError, match="SPECDEC_ATTENTION_SPLIT_KEYS must be a positive multiple of 64"):
            call("sim", q[None], kc, vc, [10], kn[None], vn[None])


@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 1)], ids=["G1", "G4"])
def test_large_tree_masks_against_the_reference(hq, hkv, gen):
    # Trees of 100 nodes: the CUDA kernel keeps each query's mask row as four 32-bit words; with G = 1 the 100 query
    # rows span two row tiles (the second starting at query 64), with G = 4 seven. Paged cache, new tokens appended,
    # lengths on both sides of a split boundary.
    from helpers.verify_attention import random_tree_mask

    n_q, d, page = 100, 64, 16
    lengths = [0, 200, 530]
    q = torch.randn(3, n_q, hq, d, generator=gen).bfloat16()
    kn, vn = (torch.randn(3, n_q, hkv, d, generator=gen).bfloat16() for _ in range(2))
    per_seq = -(-(max(lengths) + n_q) // page)
    table = torch.randperm(3 * per_seq + 2, generator=gen)[: 3 * per_seq].int().reshape(3, per_seq)
    kc, vc = (torch.randn(3 * per_seq + 2, page, hkv, d, generator=gen).bfloat16() for _ in range(2))
    masks = torch.stack([random_tree_mask(gen, n_q) for _ in range(3)])
    sl = torch.tensor(lengths, dtype=torch.int32)
    out = sim.verify_attention(q, kc.clone(), vc.clone(), sl, kn, vn, block_table=table, tree_mask=masks)
    ref = reference.verify_attention(q, kc.clone(), vc.clone(), sl, kn, vn, block_table=table, tree_mask=masks)
    assert rel_error(out, ref) <= TOLERANCE[q.dtype]
