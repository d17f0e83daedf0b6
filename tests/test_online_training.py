"""Continual draft training (OnlineDraftTraining) of EAGLE heads and Medusa heads: the decoder's output is unchanged
while the heads learn from the pairs of what is served (chains and trees); the pairs are each request's own; the
update step is the training loss's AdamW step (EAGLE's training-time test, Medusa's shifted cross-entropy), against
float64; the replay buffer stays within its budget over a long run; bad settings and drafters refused. Fixed seeds
throughout."""
import pytest
import torch

from helpers.models import make_drafter, random_prompts, random_vocab, tiny_model
from specdec_ext import NgramDrafter, SpeculativeDecoder
from specdec_ext.drafters.base import RoundFeedback
from specdec_ext.engine import generate_autoregressive
from specdec_ext.online_training import OnlineDraftTraining
from specdec_ext.training import eagle3_loss

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

VOCAB = 16
PROMPTS = random_prompts(3, [6, 1, 14, 3, 9] * 4, vocab=VOCAB)
TREE = dict(num_nodes=8, depth=3, branching=2)


def trained(drafter):
    """What online training changes: an EAGLE drafter's head or a Medusa drafter's heads."""
    return drafter.head if hasattr(drafter, "head") else drafter.heads


@pytest.fixture(scope="module")
def target():
    return tiny_model(vocab=VOCAB, seed=1234, logit_scale=0.3)


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("name", ["eagle3", "medusa"])
def test_output_is_unchanged_while_the_head_learns(target, tmp_path, name, tree):
    """Greedy: the tokens are plain decoding's; the head's weights moved and its loss fell; the buffer holds at most
    its budget; the trained head saves and loads as any head file."""
    drafter = make_drafter(name, target, random_vocab(VOCAB, 12, 1), seed=1)
    head = trained(drafter)
    before = [p.detach().clone() for p in head.trained_state().values()]
    training = OnlineDraftTraining(every=2, lr=1e-3, window=8, windows=4, buffer_tokens=200, max_time_share=1.0)
    dec = SpeculativeDecoder(target, drafter, 3, adaptive=False, max_batch_size=3, online_draft_training=training,
                             tree=tree)
    out = dec.generate(PROMPTS, 24)
    assert out.sequences == generate_autoregressive(target, PROMPTS, 24).sequences
    assert out.stats.num_accepted_tokens > 0 and training.updates >= 10
    assert all(not torch.equal(a, b) for a, b in zip(before, head.trained_state().values()))
    assert sum(training.losses[-5:]) < sum(training.losses[:5])
    assert training.held() <= 200
    head.save(tmp_path / "online.safetensors")  # what it learnt is a head file like any other
    loaded = type(head).load(tmp_path / "online.safetensors", target)
    assert all(torch.equal(a, b) for a, b in zip(loaded.trained_state().values(), head.trained_state().values()))


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("name", ["eagle", "medusa"])
def test_the_pairs_are_the_requests_tokens(target, name, tree):
    """Two requests through one slot, so that the second reuses it: each stream is its own request's pairs."""
    drafter = make_drafter(name, target, random_vocab(VOCAB, 12, 1), seed=1)
    training = OnlineDraftTraining(every=10**6)  # never updates: the streams are all that is checked
    dec = SpeculativeDecoder(target, drafter, 3, adaptive=False, max_batch_size=1, online_draft_training=training,
                             tree=tree)
    out = dec.generate(PROMPTS[:2], 12)
    assert len(training.finished) == 2
    for (features, tokens), prompt, generated in zip(training.finished, PROMPTS, out.sequences):
        history = prompt + generated
        # Pairs j = (feature of token j, token j + 1), in order, up to the last round's (whose features wait for a
        # next round that a finished request does not have: at most k + 1 = 4 tokens, and the last emitted one's).
        assert tokens.tolist() == history[1:1 + len(tokens)] and len(tokens) >= len(history) - 1 - 4
        with torch.no_grad():
            _, hidden = target(torch.tensor([history]), target.new_kv_cache(1, len(history)),
                               output_hidden_states=True)
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


def test_only_an_eagle_or_medusa_drafter_trains(target):
    with pytest.raises(ValueError, match="the drafter must be an EagleDrafter or a MedusaDrafter, got NgramDrafter"):
        SpeculativeDecoder(target, NgramDrafter(), 3, online_draft_training=OnlineDraftTraining())


def test_the_medusa_loss_labels_each_head_with_the_token_it_predicts(target):
    """Token j of the stream is j (pair j: feature j, token j + 1), so a window starting at feature s labels its row j
    for head i with token s + j + 2 + i. The step's loss against that cross-entropy written out by hand (weights 0.8^i,
    each head's mean over its labels inside the window and the draft vocabulary)."""
    drafter = make_drafter("medusa", target, random_vocab(VOCAB, 12, 1), seed=1)
    training = OnlineDraftTraining(window=6, windows=2, seed=1)
    training.bind(drafter)
    features = torch.randn(14, target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    training.pairs(0, features, list(range(1, 15)))
    ids, batch_features, valid, top_ids, top_probs = training.sample()
    starts = [int((features == row).all(-1).nonzero()) for row in batch_features[:, 0]]  # each window's s
    vocab = drafter.heads.draft_vocab.tolist()
    with torch.no_grad():
        logp = drafter.heads(batch_features.flatten(0, 1)).unflatten(0, batch_features.shape[:2]).double()
    logp = logp.log_softmax(-1)  # [windows, 7 rows, heads, Vd]
    total = weights = 0.0
    for i in range(drafter.heads.num_heads):
        terms = [-float(logp[w, j, i, vocab.index(s + j + 2 + i)]) for w, s in enumerate(starts) for j in range(7)
                 if j + 2 + i <= 6 and s + j + 2 + i in vocab]  # label inside the window's 7 tokens
        total += 0.8 ** i * sum(terms) / max(len(terms), 1)
        weights += 0.8 ** i
    assert training.step(ids, batch_features, valid, top_ids, top_probs) == pytest.approx(total / weights, rel=1e-5)


def test_a_medusa_update_is_the_float64_step(target):
    heads = []
    for dtype in (torch.float32, torch.float64):
        drafter = make_drafter("medusa", target, random_vocab(VOCAB, 12, 1), seed=1)
        if dtype == torch.float64:
            drafter.heads.double()
            drafter.heads.lm_head, drafter.heads.norm = drafter.heads.lm_head.double(), drafter.heads.norm.double()
        training = OnlineDraftTraining(window=6, windows=3, seed=5, lr=1e-4)
        training.bind(drafter)
        g = torch.Generator().manual_seed(2)
        features = torch.randn(40, target.config.hidden_size, generator=g, dtype=torch.float64)
        training.pairs(0, features.to(dtype), torch.randint(0, VOCAB, (40,), generator=g).tolist())
        training.step(*training.sample())
        heads.append([p.detach().double() for p in training.params])
    for a, b in zip(*heads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=5e-6)


@pytest.mark.parametrize("name", ["eagle", "medusa"])
def test_what_a_drafter_keeps_of_the_feedback_is_a_copy(target, name):
    """On CUDA the feedback's features can be a captured verify step's output, which the next replay rewrites before
    the drafter reads what it kept (rounds in which no row drafts skip propose): after rollback the feedback is
    overwritten, as a replay would, and the drafter still holds the values it was given (EAGLE's pending features;
    Medusa's last feature and the features it queues for online training)."""
    drafter = make_drafter(name, target, random_vocab(VOCAB, 12, 1), seed=1)
    OnlineDraftTraining(every=10**6).bind(drafter)
    drafter.bind(target, 1, 32)
    width = target.config.hidden_size
    drafter.admit([0], [[3, 5, 7]], hidden_states=[torch.randn(3, width, generator=torch.Generator().manual_seed(1))])
    hidden = torch.randn(1, 4, width, generator=torch.Generator().manual_seed(2))
    given = hidden.clone()
    drafter.rollback(RoundFeedback(num_accepted=[2], hidden_states=hidden))
    hidden.fill_(float("nan"))
    if name == "eagle":
        assert torch.equal(torch.cat(drafter.pending[0])[-3:], given[0, :3])
    else:
        assert torch.equal(drafter.features[0], given[0, 2])
        assert torch.equal(torch.cat(drafter.unpaired[0])[-3:], given[0, :3])
