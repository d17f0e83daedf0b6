"""The round on CUDA: one host synchronisation per round (torch's sync debug mode sees none besides the round's
read), and a drafter shared by decoders of different batch sizes replays its CUDA graphs on its current cache."""
import collections
import warnings

import pytest
import torch

from helpers.models import make_drafter, random_prompts, random_vocab, tiny_hf
from specdec_ext import LookaheadDrafter, ModelDrafter, NgramDrafter, SpeculativeDecoder
from specdec_ext.engine import rounds
from specdec_ext.models import LlamaForCausalLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def target():
    # head dim 64 and bfloat16: what the CUDA verify attention takes
    return LlamaForCausalLM.from_hf(tiny_hf(hidden=128, heads=2, kv_heads=1, seed=1234), dtype=torch.bfloat16,
                                    device="cuda")


def in_order(events: list, *names) -> bool:
    """Whether names occur in events in this order (others between them)."""
    rest = iter(events)
    return all(name in rest for name in names)  # `in` consumes the iterator up to the match


@pytest.mark.parametrize("paged", [False, True], ids=["static", "paged"])
@pytest.mark.parametrize("name,tree", [("ngram", None), ("model", None), ("eagle", None), ("medusa", None),
                                       ("ngram", 8), ("eagle", 8), ("lookahead", None)])
def test_one_host_synchronisation_per_round(target, name, tree, paged, monkeypatch):
    """Continuous batching: five requests of different lengths on two slots, so that requests finish in different
    rounds and their slots are released (the caches' release, the drafter's) and refilled (the round's per-request
    columns set, a prefill) between rounds of the monitored generate. Lookahead: its own trees (tree=None takes its
    round_tree), padded to the budget, num_nodes uploaded through pinned memory."""
    vocab = random_vocab(target.config.vocab_size, 48, 5).cuda()
    drafter = {"ngram": NgramDrafter, "model": lambda: ModelDrafter(target),
               "lookahead": lambda: LookaheadDrafter(window=4, ngram=3, guesses=3)}.get(
        name, lambda: make_drafter(name, target, vocab, 3))()
    prompts = [p * 3 for p in random_prompts(8, [5, 7, 4, 6, 3])]
    max_new = [14, 5, 9, 3, 11]
    dec = SpeculativeDecoder(target, drafter, 3, adaptive=False, max_batch_size=2, paged=paged, tree=tree,
                             cuda_graphs=True)
    kwargs = dict(temperature=[0.0, 0.9, 0.7, 0.0, 1.0], top_p=[1.0, 0.8, 0.9, 1.0, 0.95], seed=[4, 5, 6, 7, 8])
    dec.generate(prompts, max_new, **kwargs)  # captures the graphs, warms the pinned-memory allocator
    # The same call again (same caches and buffers, the same rounds), its events in order: a round, its host reads,
    # a slot released (a request finished), a slot's columns set (a request admitted).
    events = []
    real_read, real_run, real_release, real_set = rounds.read, dec.speculative.run, dec.cache.release, dec.params.set
    monkeypatch.setattr(rounds, "read", lambda t: events.append("read") or real_read(t))
    monkeypatch.setattr(dec.speculative, "run", lambda *a, **kw: events.append("round") or real_run(*a, **kw))
    monkeypatch.setattr(dec.cache, "release", lambda b: events.append("release") or real_release(b))
    monkeypatch.setattr(dec.params, "set", lambda b, r: events.append("admit") or real_set(b, r))
    widths = []  # Lookahead: (tree width, the round's node budget)
    if name == "lookahead":
        propose = drafter.propose_tree

        def recording_propose(r, budget, branching):
            tree = propose(r, budget, branching)
            widths.append((tree.parents.shape[1], budget))
            return tree

        monkeypatch.setattr(drafter, "propose_tree", recording_propose)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = dec.generate(prompts, max_new, **kwargs)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    # where: the Python line that called the synchronising op
    syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    assert syncs == [], "; ".join(f"{n}x {where}" for where, n in collections.Counter(syncs).items())
    reads = [e for e in events if e in ("round", "read")]
    assert reads == ["round", "read"] * (len(reads) // 2), "one read per round"
    assert reads.count("round") >= max(s.target_forwards for s in out.request_stats)
    # The path under test ran inside the monitored call: a request released after a round, a waiting one admitted
    # into its slot, and more rounds after that.
    assert in_order(events, "round", "release", "admit", "round"), events
    assert len(out.sequences) == len(prompts) and all(0 < len(s) <= m for s, m in zip(out.sequences, max_new))
    if name == "lookahead":  # every tree as wide as the budget on CUDA, eager or replayed
        assert drafter.pad_to_budget and widths and all(w == budget for w, budget in widths), widths


def test_shared_drafter_replays_on_its_current_cache(target):
    draft = LlamaForCausalLM.from_hf(tiny_hf(hidden=128, heads=2, kv_heads=1, layers=1, seed=7), dtype=torch.bfloat16,
                                     device="cuda")
    prompts = random_prompts(9, [6, 9, 4])
    kwargs = dict(temperature=0.8, seed=[1, 2, 3])
    def make(drafter, slots):
        return SpeculativeDecoder(target, drafter, 3, adaptive=False, max_batch_size=slots,
                                                         cuda_graphs=True)
    expected = {s: make(ModelDrafter(draft), s).generate(prompts, 12, **kwargs).sequences for s in (1, 3)}
    shared = ModelDrafter(draft)
    one, three = make(shared, 1), make(shared, 3)
    for dec, slots in ((one, 1), (three, 3), (one, 1), (three, 3)):
        assert dec.generate(prompts, 12, **kwargs).sequences == expected[slots]
        assert shared.state.graphs.graphs, "nothing was captured"
