"""The synthetic Llama-3.2-1B shape on CUDA (bfloat16), as the end-to-end benchmark runs it: a CUDA-graph round equals
its eager round, one host synchronisation per round (the round's read; torch's sync debug mode sees none), and no
graph captured after the warm-up."""
import pytest
import torch

from specdec_ext import SpeculativeDecoder
from specdec_ext.bench.e2e_synthetic import counted_syncs, first_difference, realised
from specdec_ext.drafters import OracleDrafter
from specdec_ext.models import synthetic

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

NEW_TOKENS = 48


@pytest.fixture(scope="module")
def model():
    return synthetic("llama-3.2-1b", device="cuda", seed=0)


@pytest.fixture(scope="module")
def run(model):
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (4, 24), generator=generator).tolist()
    plain = SpeculativeDecoder(model, None, max_batch_size=4, cuda_graphs=True)
    reference = plain.generate_autoregressive(prompts, NEW_TOKENS).sequences
    return prompts, reference, [p + s for p, s in zip(prompts, reference)]


@pytest.mark.parametrize("tree", [None, {"num_nodes": 8, "depth": 4, "branching": 2}], ids=["chain", "tree"])
def test_graph_round_equals_eager_round(model, run, tree):
    prompts, _, references = run
    outputs = {}
    for graphs in (True, False):
        decoder = SpeculativeDecoder(model, OracleDrafter(references, 0.8, seed=1), 4, adaptive=False,
                                     max_batch_size=4, tree=tree, cuda_graphs=graphs)
        outputs[graphs] = decoder.generate(prompts, NEW_TOKENS)
    assert outputs[True].sequences == outputs[False].sequences, first_difference(outputs[False].sequences,
                                                                                 outputs[True].sequences)
    assert [s.k_per_round for s in outputs[True].request_stats] == \
        [s.k_per_round for s in outputs[False].request_stats]


def test_one_synchronisation_per_round_and_no_recapture(model, run):
    prompts, _, references = run
    draft = synthetic("head", device="cuda", seed=2, target_config=model.config)
    decoder = SpeculativeDecoder(model, OracleDrafter(references, 0.8, seed=1, draft_model=draft), 4,
                                 adaptive=False, max_batch_size=4, cuda_graphs=True)
    decoder.generate(prompts, NEW_TOKENS)  # warm-up: every graph captured
    with counted_syncs(torch.device("cuda")) as counts:
        out = decoder.generate(prompts, NEW_TOKENS)
    _, _, rounds = realised(out.request_stats, 0.8)
    assert counts["syncs"] == 0
    assert counts["reads"] == rounds  # the batch's rounds: one read each
    assert counts["captures"] == 0
