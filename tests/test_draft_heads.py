"""EagleDrafter and MedusaDrafter on a tiny random target with randomly initialised heads over a restricted draft
vocabulary: greedy output equals plain decoding, the law of the first tokens is the target's (tokens outside the
draft vocabulary come through the residual), q is zero outside the draft vocabulary, head files round-trip and
refuse another model. Fixed seeds throughout."""
import pytest
import torch

from helpers.chi_square import assert_law
from helpers.laws import LAW_CASES, LAW_VOCAB, law_target, sample_first_tokens
from helpers.models import make_drafter, random_medusa, random_prompts, random_vocab, tiny_hf, tiny_model
from specdec_ext import SpeculativeDecoder
from specdec_ext.drafters import EagleDrafter
from specdec_ext.engine import generate_autoregressive
from specdec_ext.models import LlamaForCausalLM
from specdec_ext.models.draft_heads import EagleHead, MedusaHeads

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=1234)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("name", ["eagle", "eagle3", "medusa"])
def test_greedy_equals_plain_decoding(target, name, paged):
    """7 ragged prompts (one of a single token: no feature before its first round) through 3 slots."""
    prompts = random_prompts(5, [5, 21, 12, 1, 9, 3, 30])
    max_new = [24, 7, 16, 30, 3, 20, 11]
    plain = generate_autoregressive(target, prompts, max_new)
    vocab = random_vocab(target.config.vocab_size, 64, 1)
    dec = SpeculativeDecoder(target, make_drafter(name, target, vocab), 4, adaptive=False, max_batch_size=3,
                             paged=paged)
    out = dec.generate(prompts, max_new)
    assert out.sequences == plain.sequences
    assert out.stats.num_draft_tokens > 50


@pytest.mark.parametrize("name", ["eagle", "eagle3", "medusa"])
def test_long_prompt_admitted_beside_a_request_near_its_end(target, name):
    """A 38-token prompt joins the batch when the other slot's request is ~70 tokens into a cache of 85: a round's
    ragged draft forward must not pad that row past its cache (it once did, for EAGLE)."""
    prompts = random_prompts(6, [40, 3, 38])
    max_new = [40, 30, 4]
    plain = generate_autoregressive(target, prompts, max_new)
    vocab = random_vocab(target.config.vocab_size, 64, 1)
    out = SpeculativeDecoder(target, make_drafter(name, target, vocab), 4, adaptive=False,
                             max_batch_size=2).generate(prompts, max_new)
    assert out.sequences == plain.sequences


def test_q_is_zero_outside_the_draft_vocabulary(target):
    """Sampled drafts come from the draft vocabulary's columns only, and the verifier reads q over those columns."""
    vocab = random_vocab(target.config.vocab_size, 40, 2)
    for name in ("eagle", "eagle3", "medusa"):
        drafter = make_drafter(name, target, vocab)
        seen = []
        propose = drafter.propose
        drafter.propose = lambda r: seen.append(propose(r)) or seen[-1]
        SpeculativeDecoder(target, drafter, 3, adaptive=False).generate(random_prompts(6, [7, 11]), 12,
                                                                         temperature=0.9, seed=[1, 2])
        assert seen
        outside = torch.ones(target.config.vocab_size, dtype=torch.bool)
        outside[vocab] = False
        for p in seen:
            # The rows drawn from are the draft vocabulary's own columns, reported with their map: q is 0 elsewhere.
            assert p.draft_logits.shape[-1] == len(vocab) and torch.equal(p.draft_to_target.long(), vocab)
            torch.testing.assert_close(torch.softmax(p.draft_logits / 0.9, dim=-1).sum(-1),
                                       torch.ones(p.draft_logits.shape[:2]))
            assert not outside[p.draft_token_ids].any()


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LAW_CASES))
@pytest.mark.parametrize("name", ["eagle", "eagle3", "medusa"])
def test_law_of_the_first_tokens_is_the_targets(name, case):
    """As test_speculative_decoding's law test (70,000 or 50,000 seeds by case, chi-square over the 512 sequences
    of 3 tokens, power >= 0.9 against a 1% bias), with a draft vocabulary of 5 of the 8 tokens: the 3 others are
    emitted only through the residual, with their exact probability."""
    target = law_target(2 if name == "eagle3" else 1)
    vocab = torch.tensor([0, 2, 4, 5, 7])
    counts, law, acceptance = sample_first_tokens(target, make_drafter(name, target, vocab, seed=11), case)
    assert 0.05 < acceptance < 0.95, acceptance
    outside = [t for t in range(LAW_VOCAB) if t not in vocab.tolist()]
    assert sum(c for s, c in counts.items() if any(t in outside for t in s)) > 1000  # they do come through
    assert_law(counts, law)


def test_head_files_round_trip_and_refuse_another_model(target, tmp_path):
    vocab = random_vocab(target.config.vocab_size, 32, 3)
    eagle = EagleHead(target, vocab).init_weights(torch.Generator().manual_seed(4))
    medusa = random_medusa(target, vocab, 3, 5)
    eagle.save(tmp_path / "eagle.safetensors")
    medusa.save(tmp_path / "medusa.safetensors")
    eagle2 = EagleHead.load(tmp_path / "eagle.safetensors", target)
    medusa2 = MedusaHeads.load(tmp_path / "medusa.safetensors", target)
    for a, b in ((eagle.trained_state(), eagle2.trained_state()),
                 ({"w": medusa.weight, "b": medusa.bias}, {"w": medusa2.weight, "b": medusa2.bias})):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(eagle2.draft_vocab, vocab) and medusa2.num_heads == 3
    # A file in bfloat16 (as the shipped heads are) loads as the bfloat16-rounded weights, in the target's dtype.
    eagle.save(tmp_path / "eagle_bf16.safetensors", torch.bfloat16)
    small = EagleHead.load(tmp_path / "eagle_bf16.safetensors", target).trained_state()
    assert (tmp_path / "eagle_bf16.safetensors").stat().st_size < 0.6 * (tmp_path / "eagle.safetensors").stat().st_size
    for k, v in eagle.trained_state().items():
        assert small[k].dtype == v.dtype and torch.equal(small[k], v.to(torch.bfloat16).to(v.dtype)), k
    prompts = random_prompts(8, [6, 10])
    want = SpeculativeDecoder(target, EagleDrafter(target, eagle), 3, adaptive=False).generate(prompts, 10,
                                                                                             temperature=0.8)
    got = SpeculativeDecoder(target, EagleDrafter(target, eagle2), 3, adaptive=False).generate(prompts, 10,
                                                                                             temperature=0.8)
    assert got.sequences == want.sequences and got.stats.num_accepted_tokens == want.stats.num_accepted_tokens
    # An EAGLE-3 head: its fusion, norms and feature layers round-trip too; an EAGLE-1 file stays one.
    eagle3 = EagleHead(target, vocab, (0, 1)).init_weights(torch.Generator().manual_seed(6))
    eagle3.save(tmp_path / "eagle3.safetensors")
    eagle3b = EagleHead.load(tmp_path / "eagle3.safetensors", target)
    assert eagle3b.feature_layers == (0, 1) and eagle2.feature_layers is None
    assert {"fuse.weight", "fuse_norms", "norm"} <= eagle3b.trained_state().keys()
    assert all(torch.equal(eagle3.trained_state()[k], v) for k, v in eagle3b.trained_state().items())
    for bad in ((0,), (0, 0), (0, 5), 3, [True, 1]):
        with pytest.raises(ValueError, match="feature_layers"):
            EagleHead(target, vocab, bad)
    wider = LlamaForCausalLM.from_hf(tiny_hf(seed=1, hidden=96))
    other_vocab = LlamaForCausalLM.from_hf(tiny_hf(seed=1, vocab=100))
    for other, what in ((wider, "hidden_size"), (other_vocab, "vocab_size")):
        for cls in (EagleHead, MedusaHeads):
            with pytest.raises(ValueError, match=what):
                cls.load(tmp_path / f"{'eagle' if cls is EagleHead else 'medusa'}.safetensors", other)
        with pytest.raises(ValueError, match=what):
            EagleDrafter(other, eagle)
    with pytest.raises(ValueError, match="medusa"):
        EagleHead.load(tmp_path / "medusa.safetensors", target)
    with pytest.raises(ValueError, match="sorted"):
        EagleHead(target, torch.tensor([5, 3]))
    with pytest.raises(ValueError, match="sorted"):
        MedusaHeads(target, torch.tensor([0, target.config.vocab_size]), 2)
