"""The round on CUDA: one host synchronisation per round (torch's sync debug mode sees none besides the round's
read), and a drafter shared by decoders of different batch sizes replays its CUDA graphs on its current cache."""
import collections
import warnings

import pytest
import torch
from helpers import make_drafter, random_prompts, random_vocab, tiny_hf

from specdec_ext import ModelDrafter, NgramDrafter, SpeculativeDecoder
from specdec_ext.engine import rounds
from specdec_ext.models import LlamaForCausalLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def target():
    # head dim 64 and bfloat16: what the CUDA verify attention takes
    return LlamaForCausalLM.from_hf(tiny_hf(hidden=128, heads=2, kv_heads=1, seed=1234), dtype=torch.bfloat16,
                                    device="cuda")


@pytest.mark.parametrize("paged", [False, True], ids=["static", "paged"])
@pytest.mark.parametrize("name,tree", [("ngram", None), ("model", None), ("eagle", None), ("medusa", None),
                                       ("ngram", 8), ("eagle", 8)])
def test_one_host_synchronisation_per_round(target, name, tree, paged, monkeypatch):
    vocab = random_vocab(target.config.vocab_size, 48, 5).cuda()
    drafter = {"ngram": NgramDrafter, "model": lambda: ModelDrafter(target)}.get(
        name, lambda: make_drafter(name, target, vocab, 3))()
    prompts = [p * 3 for p in random_prompts(8, [5, 7])]
    dec = SpeculativeDecoder(target, drafter, 3, adaptive=False, max_batch_size=2, paged=paged, tree=tree,
                             cuda_graphs=True)
    kwargs = dict(temperature=[0.0, 0.9], top_p=[1.0, 0.8], seed=[4, 5])
    dec.generate(prompts, 14, **kwargs)  # captures the graphs, warms the pinned-memory allocator
    reads = []
    real_read = rounds.read
    monkeypatch.setattr(rounds, "read", lambda t: reads.append(1) or real_read(t))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = dec.generate(prompts, 14, **kwargs)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    # where: the Python line that called the synchronising op
    syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    assert syncs == [], "; ".join(f"{n}x {where}" for where, n in collections.Counter(syncs).items())
    assert len(reads) == max(s.target_forwards for s in out.request_stats)


def test_shared_drafter_replays_on_its_current_cache(target):
    draft = LlamaForCausalLM.from_hf(tiny_hf(hidden=128, heads=2, kv_heads=1, layers=1, seed=7), dtype=torch.bfloat16,
                                     device="cuda")
    prompts = random_prompts(9, [6, 9, 4])
    kwargs = dict(temperature=0.8, seed=[1, 2, 3])
    make = lambda drafter, slots: SpeculativeDecoder(target, drafter, 3, adaptive=False, max_batch_size=slots,
                                                     cuda_graphs=True)
    expected = {s: make(ModelDrafter(draft), s).generate(prompts, 12, **kwargs).sequences for s in (1, 3)}
    shared = ModelDrafter(draft)
    one, three = make(shared, 1), make(shared, 3)
    for dec, slots in ((one, 1), (three, 3), (one, 1), (three, 3)):
        assert dec.generate(prompts, 12, **kwargs).sequences == expected[slots]
        assert shared.state.graphs.graphs, "nothing was captured"
