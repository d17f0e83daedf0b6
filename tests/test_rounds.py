"""The round's machinery (specdec_ext.engine, specdec_ext.drafters): one host read per round, the Drafter protocol
(a new drafter is one class), the drafters' own cost answers in adaptive k, the KV caches' host-known lengths, and
a drafter shared by decoders of different batch sizes (its cache and its CUDA graphs replaced together)."""
import collections

import pytest
import torch
from torch.overrides import TorchFunctionMode

from helpers.models import make_drafter, random_prompts, random_vocab, tiny_hf
from specdec_ext import Drafter, LookaheadDrafter, ModelDrafter, NgramDrafter, SpeculativeDecoder, TreeSettings
from specdec_ext.cost_tables import draft_costs
from specdec_ext.drafters import Proposal
from specdec_ext.engine import CostModel, generate_autoregressive
from specdec_ext.host import upload
from specdec_ext.kv_cache import PagedKVCache
from specdec_ext.models import LlamaForCausalLM

# Tensor -> Python conversions: what is a host synchronisation on CUDA.
HOST_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
              torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.nonzero}


class CountHostReads(TorchFunctionMode):
    """Counts the host reads of tensors made inside it, by the function that made them. Checks that read only CPU
    tensors (where a read costs nothing; on CUDA the kernels check on the device) are left out: the model's token-id
    range check (on CUDA in strict mode) and verify_attention's qo_indptr check (a ragged prefill's flat form)."""

    def __init__(self):
        super().__init__()
        self.by_caller = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            import inspect

            callers = [f.function for f in inspect.stack()[1:4]]
            if "check_input" not in callers and "_check_indptr" not in callers:
                self.by_caller[callers[0] if callers[0] != "__torch_function__" else callers[1]] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def target():
    return LlamaForCausalLM.from_hf(tiny_hf(seed=77))


def drafter_of(name, target):
    vocab = random_vocab(target.config.vocab_size, 48, 5)
    return {"ngram": lambda: NgramDrafter(), "model": lambda: ModelDrafter(target),
            "eagle": lambda: make_drafter("eagle", target, vocab, 3),
            "medusa": lambda: make_drafter("medusa", target, vocab, 4),
            "lookahead": lambda: LookaheadDrafter(window=3, ngram=3, guesses=2)}[name]()


@pytest.mark.parametrize("paged", [False, True], ids=["static", "paged"])
@pytest.mark.parametrize("name,tree", [("ngram", None), ("model", None), ("eagle", None), ("medusa", None),
                                       ("ngram", 8), ("eagle", 8), ("medusa", 8), ("lookahead", None)])
def test_one_host_read_per_round(target, name, tree, paged):
    """Every round reads the device once (its packed results), whatever the drafter, chain or tree, static or paged
    cache, sampled or greedy: uploads go through pinned memory and the paged allocator's mirror follows from the
    round's read. Admission (prefill) reads nothing either. Counted on the CPU by the same conversions that are
    host synchronisations on CUDA (tests/gpu counts them with torch's sync debug mode)."""
    prompts = [p * 3 for p in random_prompts(8, [5, 7])]  # repetitive: the n-gram drafter finds drafts
    dec = SpeculativeDecoder(target, drafter_of(name, target), 3, adaptive=False, max_batch_size=2, paged=paged,
                             tree=tree)
    dec.generate(prompts, 10)
    with CountHostReads() as reads:
        out = dec.generate(prompts, 14, temperature=[0.0, 0.9], top_p=[1.0, 0.8], seed=[4, 5])
    rounds = max(s.target_forwards for s in out.request_stats)
    assert out.stats.num_draft_tokens > 0
    assert sum(reads.by_caller.values()) == rounds, reads.by_caller
    assert set(reads.by_caller) == {"read"}, reads.by_caller


class RepeatLastToken(Drafter):
    """A drafter written against the protocol alone: it proposes the request's last token k times."""

    def propose(self, r):
        drafts = [[h[-1]] * k if h is not None else [] for h, k in zip(r.histories, r.num_tokens)]
        width = max(len(d) for d in drafts)
        ids = upload([d + [0] * (width - len(d)) for d in drafts], torch.int64, self.device)
        return Proposal(ids, [len(d) for d in drafts])


def test_a_new_drafter_is_one_class(target):
    """A Drafter subclass with only propose() runs chains through the decoder, greedy equal to plain decoding, with
    adaptive k (its steps count as free: it gives no cost probe); tree rounds refuse it by name."""
    prompts = [[9, 9, 9, 9, 9, 3, 9, 9], [4, 4, 4, 4, 4]]
    plain = generate_autoregressive(target, prompts, 16).sequences
    for adaptive in (False, True):
        out = SpeculativeDecoder(target, RepeatLastToken(), 3, adaptive=adaptive, max_batch_size=2,
                                 costs=CostModel({1: 1.0, 8: 1.1})).generate(prompts, 16)
        assert out.sequences == plain and out.stats.num_draft_tokens > 0
    with pytest.raises(ValueError, match="tree rounds need a drafter that proposes trees.*RepeatLastToken"):
        SpeculativeDecoder(target, RepeatLastToken(), tree=8)
    with pytest.raises(ValueError, match="drafter must be a Drafter"):
        SpeculativeDecoder(target, object())


@pytest.mark.parametrize("name", ["ngram", "model", "eagle", "medusa"])
def test_every_drafter_answers_its_cost(target, name, tmp_path, monkeypatch):
    """Each shipped drafter gives a probe whose step the cost model times (n-gram lookups and Medusa heads
    included: none counts as free), and says how many steps of how many rows a round of k drafts takes."""
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    drafter = drafter_of(name, target)
    drafter.bind(target, 2, 64)
    table = draft_costs(drafter, target.device, 4)
    assert sorted(table) == [1, 2, 4] and all(s > 0 for s in table.values())
    assert draft_costs(drafter, target.device, 4) == table  # the second time from the file
    steps, rows = drafter.draft_work(4)
    assert (steps, rows) == ((4, 1) if name in ("model", "eagle") else (1, 1))
    if name != "model":
        assert drafter.draft_work(3, TreeSettings(8, 3, 2)) == ((3, 2) if name == "eagle" else (1, 1))


def test_adaptive_k_weighs_the_drafters_steps(target):
    """With the same acceptance, a drafter whose round costs one step (n-gram, Medusa) affords more drafts than one
    paying a step per draft (a draft model): the policy multiplies the step cost by the drafter's own work."""
    costs = CostModel({1: 1.0, 16: 1.0}, {1: 0.3})
    per_draft = costs.best_k(0.7, 8, ModelDrafter(target).draft_work)
    per_round = costs.best_k(0.7, 8, NgramDrafter().draft_work)
    assert per_draft < per_round == 8
    # By hand, alpha 0.7: k = 2 gives (1 - 0.343) / 0.3 / (1 + 0.6) = 1.369 tokens per unit, k = 1 1.307, k = 3 1.34.
    assert per_draft == 2


def test_eagle_checks_its_tree_block(target):
    """(depth - 1) x branching nodes feed an EAGLE head's draft block: its limit is the EAGLE drafter's, not the
    tree's (the n-gram drafter takes the same settings)."""
    wide = dict(num_nodes=64, depth=12, branching=8)
    with pytest.raises(ValueError, match=r"\(depth - 1\) x branching must be at most 64 for EAGLE"):
        SpeculativeDecoder(target, drafter_of("eagle", target), tree=wide)
    assert SpeculativeDecoder(target, NgramDrafter(), tree=wide).tree == TreeSettings(**wide)


def test_paged_cache_lengths_follow_the_host_without_reads():
    """restore_lengths and free_unused_pages(lengths) set the host mirror and free the pages past the lengths without
    reading the device; a device-side change (a truncation) makes the next reserve read the lengths back once."""
    cache = PagedKVCache(1, 8, 4, 1, 8, max_batch_size=2, max_pages_per_seq=4, dtype=torch.float32)
    cache.reserve([9, 5])
    cache.advance([9, 5])
    assert cache.free_pages == 8 - 3 - 2
    with CountHostReads() as reads:
        cache.restore_lengths([3, 5])
        cache.reserve([2, 0])  # 3 + 2 fits in 2 pages: nothing new
    assert cache.cache_seqlens.tolist() == [3, 5] and cache.free_pages == 8 - 2 - 2
    assert sum(reads.by_caller.values()) == 0
    cache.truncate(torch.tensor([1, 0], dtype=torch.int32), free_pages=False)  # device only: lengths 4, 5
    with CountHostReads() as reads:
        cache.reserve([5, 0])  # reads the lengths back: 4 + 5 needs 3 pages
    assert sum(reads.by_caller.values()) == 1 and cache.free_pages == 8 - 3 - 2
    with CountHostReads() as reads:
        cache.free_unused_pages([4, 0])
    assert sum(reads.by_caller.values()) == 0 and cache.free_pages == 8 - 1
    assert cache.block_table[1].tolist() == [-1] * 4


def test_a_drafter_shared_by_decoders_of_different_batch_sizes(target):
    """One ModelDrafter behind decoders of 1 and 3 slots, alternately (as bench/e2e.py shares drafters): each bind
    replaces the drafter's cache and its CUDA-graph registry together (tests/gpu replays them on CUDA), and every
    call gives the tokens of a fresh drafter."""
    draft = LlamaForCausalLM.from_hf(tiny_hf(seed=78))
    prompts = random_prompts(9, [6, 9, 4])
    shared = ModelDrafter(draft)
    one = SpeculativeDecoder(target, shared, 3, adaptive=False, max_batch_size=1)
    three = SpeculativeDecoder(target, shared, 3, adaptive=False, max_batch_size=3)
    def fresh(slots):
        return SpeculativeDecoder(target, ModelDrafter(draft), 3, adaptive=False, max_batch_size=slots)
    kwargs = dict(temperature=0.8, seed=[1, 2, 3])
    expected = {1: fresh(1).generate(prompts, 12, **kwargs).sequences, 3: fresh(3).generate(prompts, 12,
                                                                                            **kwargs).sequences}
    registries = []
    for dec, slots in ((one, 1), (three, 3), (one, 1)):
        assert dec.generate(prompts, 12, **kwargs).sequences == expected[slots]
        registries.append((shared.state.cache, shared.state.graphs))
    assert all(a[0] is not b[0] and a[1] is not b[1] for a, b in zip(registries, registries[1:]))
