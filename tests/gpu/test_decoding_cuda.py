"""SpeculativeDecoder on CUDA: the verify and draft steps replayed from CUDA graphs give exactly the eager
tokens (greedy and sampled, both drafters, contiguous and paged), and the op wrappers refuse a Python seed
while a graph is captured."""
import pytest
import torch

import specdec_ext
from helpers.models import random_prompts, tiny_hf
from specdec_ext import LookaheadDrafter, ModelDrafter, NgramDrafter, SpeculativeDecoder
from specdec_ext.engine import CostModel
from specdec_ext.models import LlamaForCausalLM


@pytest.fixture(scope="module")
def pair():
    # head dim 64 and bfloat16: what the CUDA verify attention takes
    def load(hf):
        return LlamaForCausalLM.from_hf(hf, dtype=torch.bfloat16, device="cuda")
    return load(tiny_hf(hidden=128, heads=2, kv_heads=1, seed=1234)), load(tiny_hf(hidden=128, heads=2, kv_heads=1,
                                                                                 layers=1, seed=7))


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("name", ["ngram", "model"])
@pytest.mark.parametrize("sampling", [{}, dict(temperature=0.8, top_k=20, top_p=0.9, seed=[1, 2, 3, 4, 5])])
def test_graph_replay_equals_eager(pair, name, paged, sampling):
    target, draft = pair
    prompts = random_prompts(3, [5, 21, 12, 9, 30])
    costs = CostModel({1: 1.0, 5: 1.2}, {1: 0.1})
    runs = []
    for graphs in (False, True):
        drafter = NgramDrafter() if name == "ngram" else ModelDrafter(draft)
        dec = SpeculativeDecoder(target, drafter, 4, max_batch_size=3, cuda_graphs=graphs, paged=paged, costs=costs)
        runs.append(dec.generate(prompts, [24, 7, 16, 30, 11], **sampling).sequences)
        if graphs:
            assert dec.graphs.graphs, "nothing was captured"
            runs.append(dec.generate(prompts, [24, 7, 16, 30, 11], **sampling).sequences)  # replay only
    assert runs[0] == runs[1] == runs[2]


def assert_replay_equals_eager(target, make_decoder, sampling):
    """make_decoder(cuda_graphs) run eagerly and from CUDA graphs on ragged prompts gives the same tokens, and greedy
    equals plain decoding. Returns the decoder that replayed."""
    prompts, new_tokens = random_prompts(3, [5, 21, 12, 9, 30]), [24, 7, 16, 30, 11]
    runs = []
    for graphs in (False, True):
        dec = make_decoder(graphs)
        runs.append(dec.generate(prompts, new_tokens, **sampling).sequences)
    assert dec.graphs.graphs, "nothing was captured"
    assert runs[0] == runs[1]
    if not sampling:
        assert runs[0] == SpeculativeDecoder(target, None, max_batch_size=3).generate_autoregressive(
            prompts, new_tokens).sequences
    return dec


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("sampling", [{}, dict(temperature=0.8, top_k=20, top_p=0.9, seed=[1, 2, 3, 4, 5])])
def test_tree_rounds_replay_equal_eager(pair, paged, sampling):
    # Tree rounds (n-gram tries): the tree verify step (forward under the tree mask, masks, the tree sampling op,
    # compaction of the path) replayed from CUDA graphs gives the eager tokens.
    target, _ = pair
    assert_replay_equals_eager(target, lambda graphs: SpeculativeDecoder(
        target, NgramDrafter(), max_batch_size=3, cuda_graphs=graphs, paged=paged, adaptive=False,
        tree=dict(num_nodes=8, depth=4, branching=2)), sampling)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("sampling", [{}, dict(temperature=0.8, top_k=20, top_p=0.9, seed=[1, 2, 3, 4, 5])])
def test_lookahead_rounds_replay_equal_eager(pair, paged, sampling):
    # Lookahead (window, pool, the block's argmax packed into the round's read, trees padded to the budget): replayed
    # from CUDA graphs it gives the eager tokens, one graph for every tree width.
    target, _ = pair
    dec = assert_replay_equals_eager(target, lambda graphs: SpeculativeDecoder(
        target, LookaheadDrafter(window=4, ngram=3, guesses=3), max_batch_size=3, cuda_graphs=graphs, paged=paged,
        adaptive=False), sampling)
    assert dec.drafter.stats.pool_ngrams > 0


def test_capture_refuses_a_python_seed():
    logits = torch.randn(2, 3, 16, device="cuda")
    drafts = torch.randint(16, (2, 2), device="cuda")
    temperature = torch.full((2,), 0.5, device="cuda")
    offset = torch.zeros(2, dtype=torch.int64, device="cuda")
    specdec_ext.chain_speculative_sampling_from_logits(drafts, logits, temperature=temperature, seed=torch.arange(
        2, device="cuda"), offset=offset)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="seed is a Python int while a CUDA graph"):
        with torch.cuda.graph(graph):
            specdec_ext.chain_speculative_sampling_from_logits(drafts, logits, temperature=temperature, seed=3,
                                                               offset=offset)
