"""The CUDA sampling kernels split a request's 1024 canonical lanes over S blocks (its slices, S = 1 .. 32, whole warps
each) that meet through global memory in a cooperative launch. The split must change no bit: with S forced to each
split the launcher can pick (SPECDEC_SAMPLING_SLICES), the emulated kernel returns the CPU kernel's tokens and counts
exactly, on every path: probabilities and logits, every dtype, padded and flat layouts, K = 0 and 128, a vocabulary
that is not a multiple of the tile (nor of 8: scalar loads), both couplings, block verification, row filters, a
reduced draft vocabulary, FlashInfer's independent count, and trees."""
import pytest
import torch

import specdec_ext
from helpers.sampling_inputs import (
    make_chain_inputs,
    make_tree_inputs,
    padded_and_flat_trees,
    ragged_batch,
    reduced_vocab,
)
from specdec_ext import sim

SLICES = [1, 2, 4, 8, 16, 32]  # every split the launcher can pick
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
VOCAB = 8203  # two tiles, the second partial; not a multiple of 8, so rows take the scalar loads
BACKENDS = {"cpu": specdec_ext, "sim": sim}


@pytest.fixture(params=SLICES, ids=lambda s: f"slices{s}")
def slices(request, monkeypatch, strict):
    """Forces the emulated launches to S blocks per request, in strict mode (valid input: no error may be recorded)."""
    monkeypatch.setenv("SPECDEC_SAMPLING_SLICES", str(request.param))
    return request.param


def assert_same(slices, batch, make):
    """make(backend) -> an output tuple: the CPU kernel's and the emulated kernel's must be equal, and the emulated
    launch must have had the forced shape (every request at once: the emulated device holds 4 groups of any S)."""
    cpu, emu = make("cpu"), make("sim")
    assert len(cpu) == len(emu)
    for a, b in zip(cpu, emu):
        assert torch.equal(a, b), (a, b)
    groups = min(batch, 4) if slices > 1 else batch
    assert sim.last_launch() == {"blocks": groups * slices, "threads_per_block": 1024 // slices, "cluster_blocks": 1,
                                 "cooperative": slices > 1}
    return cpu


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_draft", [True, False], ids=["draft", "point"])
def test_chain_probs_and_logits(slices, dtype, with_draft, gen):
    batch, k = 6, 4  # 6 > 4 groups at once: the grid-stride loop runs a second request on some groups
    inp = make_chain_inputs(gen, batch, k, VOCAB, dtype, with_draft, sharpness=1.0)
    inp["num_draft_tokens"][:2] = k
    greedy = torch.tensor([True, False, False, False, True, False])
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.6, 0.0, 0.4])
    cpu = assert_same(slices, batch, lambda be: BACKENDS[be].chain_speculative_sampling(
        inp["ids"], inp["target_probs"], inp["draft_probs"], num_draft_tokens=inp["num_draft_tokens"], greedy=greedy,
        seed=inp["seed"], offset=inp["offset"]))
    assert bool((cpu.num_accepted < inp["num_draft_tokens"]).any())  # a residual draw happened
    assert_same(slices, batch, lambda be: BACKENDS[be].chain_speculative_sampling_from_logits(
        inp["ids"], inp["target_logits"], inp["draft_logits"], temperature=temperature,
        num_draft_tokens=inp["num_draft_tokens"], seed=inp["seed"], offset=inp["offset"]))


@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
def test_flat_layouts_and_caller_uniforms(slices, logits, gen):
    batch, max_k = 5, 3
    padded, flat = ragged_batch(gen, batch, max_k, 9000, torch.bfloat16)
    kind = "logits" if logits else "probs"
    control = {"temperature": torch.tensor([0.0, 0.5, 1.0, 1.3, 0.8])} if logits else \
        {"greedy": torch.tensor([True, False, False, False, False])}

    def run(be, bonus):
        f = BACKENDS[be].chain_speculative_sampling_from_logits if logits else BACKENDS[be].chain_speculative_sampling
        target = flat[f"target_{kind}_nobonus"] if bonus else flat[f"target_{kind}"]
        return f(flat["ids"], target, flat[f"draft_{kind}"], cu_num_draft_tokens=flat["cu"], max_draft_tokens=max_k,
                 bonus_token_ids=padded["bonus"] if bonus else None, uniforms=flat["uniforms"],
                 final_uniforms=padded["final_uniforms"], seed=padded["seed"], offset=padded["offset"], **control)

    for bonus in (False, True):
        assert_same(slices, batch, lambda be: run(be, bonus))


@pytest.mark.parametrize("k,vocab", [(0, VOCAB), (128, 301)], ids=["k0", "k128"])
def test_no_drafts_and_the_most_drafts(slices, k, vocab, gen):
    batch = 3
    inp = make_chain_inputs(gen, batch, k, vocab, torch.float32, sharpness=0.3)
    inp["num_draft_tokens"].fill_(k)
    if k:  # drafts equal to the target's argmax: the greedy request 0 accepts all 128, the others run deep
        argmax = inp["target_logits"][:, :k].argmax(-1).int()
        inp["ids"] = torch.where(torch.rand(batch, k, generator=gen) < 0.97, argmax, inp["ids"])
        inp["ids"][0] = inp["target_logits"][0, :k].argmax(-1).int()
    temperature = torch.tensor([0.0, 1.0, 0.05])
    cpu = assert_same(slices, batch, lambda be: BACKENDS[be].chain_speculative_sampling_from_logits(
        inp["ids"], inp["target_logits"], inp["draft_logits"], temperature=temperature,
        num_draft_tokens=inp["num_draft_tokens"], seed=inp["seed"], offset=inp["offset"]))
    if k:
        assert int(cpu.num_accepted[0]) == k


def test_gumbel_block_filters_reduced_vocab_and_independent_count(slices, gen):
    batch, k, vocab, draft_vocab = 5, 4, VOCAB, 6001
    inp = make_chain_inputs(gen, batch, k, vocab, torch.float32, sharpness=1.0)
    temperature = torch.tensor([0.0, 0.6, 1.0, 1.2, 0.9])
    common = dict(temperature=temperature, num_draft_tokens=inp["num_draft_tokens"], seed=inp["seed"],
                  offset=inp["offset"])
    # Both couplings and both verifications, with top-k / top-p / min-p per request.
    filters = dict(top_k=torch.tensor([0, 50, 0, 7, 0], dtype=torch.int32),
                   top_p=torch.tensor([1.0, 0.9, 0.6, 1.0, 0.8]), min_p=torch.tensor([0.0, 0.0, 0.05, 0.0, 0.01]))
    for extra in ({"coupling": "gumbel"}, {"verification": "block"}, filters, {"verification": "block", **filters}):
        draft = None if extra.get("coupling") == "gumbel" else inp["draft_logits"]  # Gumbel reads no draft rows
        assert_same(slices, batch, lambda be: BACKENDS[be].chain_speculative_sampling_from_logits(
            inp["ids"], inp["target_logits"], draft, **common, **extra))
    # A draft with its own, smaller vocabulary (a gathered draft row), and FlashInfer's independent count.
    draft_to_target = reduced_vocab(gen, vocab, draft_vocab)
    draft_probs = torch.softmax(torch.randn(batch, k, draft_vocab, generator=gen), -1)
    ids = draft_to_target[torch.multinomial(draft_probs.reshape(-1, draft_vocab), 1, generator=gen).reshape(batch, k)]

    def run(be):
        independent = torch.full((batch,), -7, dtype=torch.int32)
        out = BACKENDS[be].chain_speculative_sampling(
            ids, inp["target_probs"], draft_probs, draft_to_target=draft_to_target, seed=inp["seed"],
            offset=inp["offset"], accepted_independently=independent)
        return (*out, independent)
    assert_same(slices, batch, run)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
def test_trees_padded_and_flat(slices, dtype, logits, gen):
    batch = 5
    inp = make_tree_inputs(gen, batch, 16, VOCAB, dtype, branching=3, depth=4, sharpness=1.0)
    kind = "logits" if logits else "probs"
    control = {"temperature": torch.tensor([0.0, 0.5, 1.0, 1.4, 0.8])} if logits else \
        {"greedy": torch.tensor([True, False, False, False, False])}
    f = "tree_speculative_sampling_from_logits" if logits else "tree_speculative_sampling"
    assert_same(slices, batch, lambda be: getattr(BACKENDS[be], f)(
        inp["parents"], inp["tokens"], inp[f"target_{kind}"], inp[f"draft_{kind}"], num_nodes=inp["num_nodes"],
        seed=inp["seed"], offset=inp["offset"], **control))
    if logits:  # top-k, top-p and min-p per request: the filter passes combine across the blocks too
        filters = dict(top_k=torch.tensor([0, 40, 0, 9, 0], dtype=torch.int32),
                       top_p=torch.tensor([1.0, 0.95, 0.7, 1.0, 0.85]), min_p=torch.tensor([0.0, 0.0, 0.02, 0.0, 0.0]))
        assert_same(slices, batch, lambda be: getattr(BACKENDS[be], f)(
            inp["parents"], inp["tokens"], inp["target_logits"], inp["draft_logits"], num_nodes=inp["num_nodes"],
            seed=inp["seed"], offset=inp["offset"], **control, **filters))
    padded, flat = padded_and_flat_trees(gen, batch, 8, 9000, dtype)
    seed, offset = torch.arange(batch) * 7919, torch.arange(batch) * 3
    assert_same(slices, batch, lambda be: getattr(BACKENDS[be], f)(
        flat["parents"], flat["cand"], flat[f"target_{kind}"], flat[f"draft_{kind}"], cu_num_draft_tokens=flat["cu"],
        max_draft_tokens=7, uniforms=flat["uniforms"], seed=seed, offset=offset, **control))


def test_a_forced_split_must_be_a_power_of_two_up_to_32(monkeypatch, gen):
    inp = make_chain_inputs(gen, 2, 2, 100)
    for bad in ("3", "64", "0", "four"):
        monkeypatch.setenv("SPECDEC_SAMPLING_SLICES", bad)
        with pytest.raises(ValueError, match="SPECDEC_SAMPLING_SLICES must be a power of two from 1 to 32"):
            sim.chain_speculative_sampling(inp["ids"], inp["target_probs"], inp["draft_probs"], seed=inp["seed"])


def test_trees_of_64_nodes_with_a_malformed_node_past_32(slices, gen):
    # A block of 32 threads checks two nodes each: a 64-node tree (the most) is read whole at every split, and a node
    # past the 32nd that is not a tree's is reported in strict mode (the fixture's), as the CPU raises.
    batch, n, vocab = 3, 64, 3000
    inp = make_tree_inputs(gen, batch, n, vocab, branching=2, depth=63, sharpness=1.0, ragged=False)
    assert bool((inp["num_nodes"] == n).all())
    temperature = torch.tensor([0.0, 0.9, 1.2])
    assert_same(slices, batch, lambda be: BACKENDS[be].tree_speculative_sampling_from_logits(
        inp["parents"], inp["tokens"], inp["target_logits"], inp["draft_logits"], temperature=temperature,
        seed=inp["seed"], offset=inp["offset"]))
    parents = inp["parents"].clone()
    parents[1, 40] = 50  # a parent after its child
    for be in BACKENDS:
        with pytest.raises(ValueError, match="not a tree"):
            BACKENDS[be].tree_speculative_sampling_from_logits(
                parents, inp["tokens"], inp["target_logits"], inp["draft_logits"], temperature=temperature,
                seed=inp["seed"], offset=inp["offset"])
