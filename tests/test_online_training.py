"""Continual draft training (OnlineDraftTraining): the decoder's output is unchanged while the head learns from the
pairs it is fed; the update step is the training-time-test loss's AdamW step, against float64; the replay buffer stays
within its budget over a long run; bad settings and drafters refused. Fixed seeds throughout."""
import pytest
import torch

from helpers.models import make_drafter, random_prompts, random_vocab, tiny_model
from specdec_ext import NgramDrafter, SpeculativeDecoder
from specdec_ext.engine import generate_autoregressive
from specdec_ext.models.draft_heads import EagleHead
from specdec_ext.online_training import OnlineDraftTraining
from specdec_ext.training import eagle3_loss

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

VOCAB = 16
PROMPTS = random_prompts(3, [6, 1, 14, 3, 9] * 4, vocab=VOCAB)


@pytest.fixture(scope="module")
def target():
    return tiny_model(vocab=VOCAB, seed=1234, logit_scale=0.3)


def test_output_is_unchanged_while_the_head_learns(target, tmp_path):
    """Greedy: the tokens are plain decoding's; the head's weights moved and its loss fell; the pairs it learns from
    are the request's own (token j + 1 after feature j) and the buffer holds at most its budget."""
    drafter = make_drafter("eagle3", target, random_vocab(VOCAB, 12, 1), seed=1)
    before = [p.detach().clone() for p in drafter.head.fc.parameters()]
    training = OnlineDraftTraining(every=2, lr=1e-3, window=8, windows=4, buffer_tokens=200, max_time_share=1.0)
    dec = SpeculativeDecoder(target, drafter, 3, adaptive=False, max_batch_size=3, online_draft_training=training)
    out = dec.generate(PROMPTS, 24)
    assert out.sequences == generate_autoregressive(target, PROMPTS, 24).sequences
    assert out.stats.num_accepted_tokens > 0 and training.updates >= 10
    assert any(not torch.equal(a, b) for a, b in zip(before, drafter.head.fc.parameters()))
    assert sum(training.losses[-5:]) < sum(training.losses[:5])
    assert training.held() <= 200
    drafter.head.save(tmp_path / "online.safetensors")  # what it learnt is a head file like any other
    loaded = EagleHead.load(tmp_path / "online.safetensors", target)
    assert all(torch.equal(a, b) for a, b in zip(loaded.fc.parameters(), drafter.head.fc.parameters()))


def test_the_pairs_are_the_requests_tokens(target):
    drafter = make_drafter("eagle", target, random_vocab(VOCAB, 12, 1), seed=1)
    training = OnlineDraftTraining(every=10**6)  # never updates: the stream is all that is checked
    dec = SpeculativeDecoder(target, drafter, 3, adaptive=False, max_batch_size=1, online_draft_training=training)
    out = dec.generate(PROMPTS[:1], 12)
    features, tokens = training.finished[-1]
    history = PROMPTS[0] + out.sequences[0]
    # Pairs j = (feature of token j, token j + 1), in order, up to the last round's (whose features wait for a next
    # round that a finished request does not have: at most k + 1 = 4 tokens, and the last emitted one's).
    assert tokens.tolist() == history[1:1 + len(tokens)] and len(tokens) >= len(history) - 1 - 4
    with torch.no_grad():
        _, hidden = target(torch.tensor([history]), target.new_kv_cache(1, len(history)), output_hidden_states=True)
    torch.testing.assert_close(features, hidden[0, :len(tokens)], rtol=1e-4, atol=1e-4)


def test_an_update_is_the_float64_step(target):
    """One step in float32 against the same step of a float64 copy of the head (same windows, same AdamW: a step
    moves a weight by about lr = 1e-4, so 5e-6 is 5% of one)."""
    torch.manual_seed(0)
    heads = []
    for dtype in (torch.float32, torch.float64):
        drafter = make_drafter("eagle3", target, random_vocab(VOCAB, 12, 1), seed=1)
        if dtype == torch.float64:
            drafter.head.double()
        training = OnlineDraftTraining(window=6, windows=3, seed=5, lr=1e-4)
        training.bind(drafter)
        g = torch.Generator().manual_seed(2)
        features = torch.randn(40, drafter.head.feature_width, generator=g, dtype=torch.float64)
        training.pairs(0, features.to(dtype), torch.randint(0, VOCAB, (40,), generator=g).tolist())
        batch = training.sample()
        training.step(*batch)
        heads.append([p.detach().double() for p in training.params])
    for a, b in zip(*heads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=5e-6)


def test_the_loss_is_eagle3_loss_of_the_windows(target):
    drafter = make_drafter("eagle3", target, random_vocab(VOCAB, 12, 1), seed=1)
    training = OnlineDraftTraining(window=5, windows=2, seed=1)
    training.bind(drafter)
    tokens = list(range(1, 13))
    training.pairs(0, torch.randn(12, drafter.head.feature_width, generator=torch.Generator().manual_seed(0)), tokens)
    ids, features, valid, top_ids, top_probs = training.sample()
    # Row p's label (column p + 1) is the token after tokens[p + 1]: the stream's tokens are consecutive.
    assert torch.equal(top_ids[:, 1:, 0], ids[:, 1:] + 1) and bool(valid.all())
    with torch.no_grad():
        loss, _ = eagle3_loss(drafter.head, ids, features, valid, top_ids, top_probs, training.remap, 3)
    assert training.step(ids, features, valid, top_ids, top_probs) == pytest.approx(float(loss), rel=1e-6)


@pytest.mark.parametrize("kwargs,message", [
    (dict(every=0), "every must be an int >= 1"), (dict(window=1), "window must be an int >= 2"),
    (dict(lr=0.0), "lr must be a float > 0"), (dict(max_time_share=0), "max_time_share in (0, 1]"),
])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError) as e:
        OnlineDraftTraining(**kwargs)
    assert message in str(e.value)


def test_only_an_eagle_drafter_trains(target):
    with pytest.raises(ValueError, match="the drafter must be an EagleDrafter"):
        SpeculativeDecoder(target, NgramDrafter(), 3, online_draft_training=OnlineDraftTraining())
