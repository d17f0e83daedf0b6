"""Training draft heads on a tiny random target: EAGLE-3's training-time test computes exactly what drafting computes,
its loss and gradients match float64, the target's features are built resumably and equal its cached forward, the
loss falls, files are written, an interrupted run resumed ends with the uninterrupted run's weights (fixed seed), and
the trained heads draft better than untrained ones on what they were trained on. Fixed seeds throughout."""
import json

import pytest
import torch

from helpers.models import random_prompts, shared_hf, tiny_model
from specdec_ext.draft_data import DraftData
from specdec_ext.drafters import EagleDrafter, MedusaDrafter
from specdec_ext.engine import generate_autoregressive
from specdec_ext.models import LlamaForCausalLM
from specdec_ext.models.draft_heads import EagleHead, MedusaHeads, eagle3_layers
from specdec_ext.training import (
    TargetFeatures,
    chain_acceptance,
    draft_remap,
    draft_vocabulary,
    eagle3_loss,
    eagle_parameters,
    evaluate,
    feature_columns,
    load_prompts,
    train,
    ttt_forward,
    vocabulary_coverage,
)

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
TARGET = {"seed": 21, "logit_scale": 0.5}


def tiny_data(target, prompts, new_tokens=40) -> DraftData:
    """The target's greedy answers to prompts, then one sampled answer each; every fourth prompt's go to validation."""
    greedy = generate_autoregressive(target, prompts, new_tokens).sequences
    sampled = generate_autoregressive(target, prompts, new_tokens, temperature=0.8, seed=list(range(len(prompts))))
    return DraftData.from_sequences([(p + a, len(p), 1, int(i % 4 == 3), answers is greedy)
                                     for answers in (greedy, sampled.sequences)
                                     for i, (p, a) in enumerate(zip(prompts, answers))])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    target = tiny_model(**TARGET)
    prompts = random_prompts(4, [5, 9, 7, 12, 6, 10, 8, 11])
    data = tiny_data(target, prompts)
    layers = feature_columns(target, eagle3_layers(target.config.num_hidden_layers))
    features = TargetFeatures.build(target, data, tmp_path_factory.mktemp("features"), layers, tokens_per_batch=100,
                                    progress=False)
    return target, prompts, data, features


def random_eagle3(target, vocab, seed=3):
    return EagleHead(target, vocab, eagle3_layers(target.config.num_hidden_layers)).init_weights(
        torch.Generator().manual_seed(seed))


def test_ttt_forward_is_drafting(setup):
    """Step s at row p equals drafting's (s+1)-th step after a round whose target-fed pairs end at p - s: the head's
    cached forward over those pairs, then s draft steps feeding its own outputs (EagleDrafter.propose's loop)."""
    target, _, data, _ = setup
    head = random_eagle3(target, random_vocab_of(target, 64))
    seq = data.sequence(0).long()
    length, steps = len(seq), 3
    with torch.no_grad():
        _, feats = target(seq[None], None, output_hidden_states=head.feature_layers)
        got = ttt_forward(head, seq[None], feats, steps)
        for s in range(steps):
            for p in range(s, length - 1):
                cache = head.decoder.new_kv_cache(1, length + steps)
                n = p - s + 1  # target-fed pairs 0 .. p - s
                cache.reserve(n)
                logits, hidden = head(seq[None, 1:n + 1], feats[:, :n], cache)
                cache.advance(n)
                logits, feature = logits[:, -1:], hidden[:, -1:]
                for r in range(1, s + 1):  # draft step r: pair (own output, token p - s + r + 1) at p - s + r
                    cache.reserve(1)
                    logits, feature = head(seq[None, p - s + r + 1:p - s + r + 2], feature, cache)
                    cache.advance(1)
                torch.testing.assert_close(got[s][0, p], logits[0, -1], rtol=1e-5, atol=1e-5)


def random_vocab_of(target, size):
    return torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(size))[:size].sort().values


def test_eagle3_loss_and_gradients_match_float64(setup):
    target, _, data, features = setup
    layers = eagle3_layers(target.config.num_hidden_layers)
    vocab = draft_vocabulary(data, 96, target.config.vocab_size)
    heads = {}
    for dtype in (torch.float32, torch.float64):
        model = target if dtype == torch.float32 else LlamaForCausalLM.from_hf(shared_hf(**TARGET), dtype=dtype)
        head = EagleHead(model, vocab, layers)
        with torch.no_grad():  # the same weights: the float32 head's, in each dtype
            reference = random_eagle3(target, vocab, seed=5)
            for (name, p), q in zip(head.named_parameters(), reference.parameters()):
                p.copy_(q)
        params = [p.requires_grad_(True) for p in eagle_parameters(head)]
        tokens, feats, valid, top_ids, top_probs = features.batch([0, 1, 2], layers, "cpu", dtype)
        loss, per_step = eagle3_loss(head, tokens, feats, valid, top_ids, top_probs,
                                     draft_remap(vocab, target.config.vocab_size, "cpu"), 3)
        grads = torch.autograd.grad(loss, params)
        heads[dtype] = (loss, per_step, grads)
    (loss32, steps32, grads32), (loss64, _, grads64) = heads[torch.float32], heads[torch.float64]
    assert len(steps32) == 3 and all(float(s.detach()) > 0 for s in steps32)
    torch.testing.assert_close(loss32.double(), loss64, rtol=1e-5, atol=1e-6)
    for g32, g64 in zip(grads32, grads64):
        torch.testing.assert_close(g32.double(), g64, rtol=1e-3, atol=1e-5)
    assert any(float(g.abs().max()) > 1e-3 for g in grads64)


def test_target_features_are_the_targets_and_resume(setup, tmp_path):
    target, _, data, features = setup
    layers = features.layers
    # Against the target's forward through a cache (the C++ loop), per sequence: features and the top-k.
    for i in (0, 5, len(data) - 1):
        seq = data.sequence(i).long()[None]
        cache = target.new_kv_cache(1, seq.shape[1])
        cache.reserve(seq.shape[1])
        with torch.no_grad():
            logits, hidden = target(seq, cache, output_hidden_states=layers)
        a, b = int(data.offsets[i]), int(data.offsets[i + 1])
        torch.testing.assert_close(torch.from_numpy(features.features[a:b].astype("float32")), hidden[0],
                                   rtol=4e-3, atol=4e-3)  # float16 storage
        probs = logits[0].softmax(-1)
        stored = torch.from_numpy(features.top_probs[a:b].astype("float32"))
        torch.testing.assert_close(stored, probs.topk(8).values, rtol=2e-3, atol=2e-3)
        # The ids stored are those of the target's 8 most probable tokens (near-ties may come in either order).
        ids = torch.from_numpy(features.top_ids[a:b].astype("int64"))
        torch.testing.assert_close(probs.gather(-1, ids), stored, rtol=2e-3, atol=2e-3)
    # An interrupted build: half the sequences not done and their rows poisoned; resumed, it equals the whole build.
    copy = TargetFeatures.build(target, data, tmp_path, layers, tokens_per_batch=100, progress=False)
    done = __import__("numpy").load(tmp_path / "done.npy", mmap_mode="r+")
    out = __import__("numpy").load(tmp_path / "features.npy", mmap_mode="r+")
    for i in range(0, len(data), 2):
        done[i] = False
        out[int(data.offsets[i]):int(data.offsets[i + 1])] = float("nan")
    done.flush()
    out.flush()
    resumed = TargetFeatures.build(target, data, tmp_path, layers, tokens_per_batch=100, progress=False)
    assert (resumed.features == copy.features).all() and (resumed.features == features.features).all()
    # A folder with more layers serves a head that reads fewer; one of other data is refused.
    assert TargetFeatures.build(target, data, tmp_path, layers[-1:], progress=False).layers == layers
    fewer = DraftData(tokens=data.tokens[:int(data.offsets[3])], offsets=data.offsets[:4],
                      answer_start=data.answer_start[:3], source=data.source[:3], split=data.split[:3],
                      greedy=data.greedy[:3])
    with pytest.raises(ValueError, match="other data or layers"):
        TargetFeatures.build(target, fewer, tmp_path, layers, progress=False)


def test_vocabulary_and_coverage(setup):
    target, _, data, _ = setup
    vocab = draft_vocabulary(data, 20)
    counts = torch.bincount(torch.cat([data.sequence(i) for i in data.indices("train")]).long(),
                            minlength=target.config.vocab_size)
    assert len(vocab) == 20 and bool((vocab[1:] > vocab[:-1]).all())
    assert counts[vocab].min() >= counts[~torch.isin(torch.arange(len(counts)), vocab)].max()
    seen = (counts > 0).nonzero().flatten()
    wide = draft_vocabulary(data, len(seen) + 10, target.config.vocab_size)
    unseen = (counts == 0).nonzero().flatten()[:10]
    assert wide.tolist() == sorted(seen.tolist() + unseen.tolist())
    coverage = vocabulary_coverage(data, [8, 64, target.config.vocab_size], target.config.vocab_size)
    assert 0 < coverage[8] < coverage[64] < coverage[target.config.vocab_size] == 1.0


# name: (kind, EAGLE-3 features, autocast)
KINDS = {"eagle3": ("eagle", True, None), "eagle3-bf16": ("eagle", True, torch.bfloat16),
         "eagle": ("eagle", False, None), "medusa": ("medusa", False, None)}


@pytest.mark.parametrize("name", list(KINDS))
def test_training_lowers_the_loss_resumes_exactly_and_helps(setup, name, tmp_path):
    target, prompts, data, features = setup
    kind, eagle3, autocast = KINDS[name]
    layers = eagle3_layers(target.config.num_hidden_layers) if eagle3 else None
    vocab = draft_vocabulary(data, 64)
    settings = dict(epochs=10, tokens_per_batch=120, lr=3e-3 if kind == "eagle" else 1e-2, unroll=3,
                    feature_layers=layers, checkpoint_every=5, autocast=autocast, progress=False)
    whole = train(kind, target, features, vocab, out_dir=tmp_path / "whole", **settings)
    log = json.loads((tmp_path / "whole" / f"{kind}_log.json").read_text())
    first, last = (sum(e["loss"] for e in part) / 3 for part in (log["log"][:3], log["log"][-3:]))
    assert last < 0.8 * first, (first, last)
    assert (tmp_path / "whole" / f"{kind}_loss.png").stat().st_size > 1000 and len(log["epochs"]) == 10
    # Interrupted after 7 steps (between checkpoints), then resumed: the uninterrupted run's weights, bit for bit.
    train(kind, target, features, vocab, out_dir=tmp_path / "split", stop_after=7, **settings)
    with pytest.raises(ValueError, match="resume"):
        train(kind, target, features, vocab, out_dir=tmp_path / "split", **settings)
    resumed = train(kind, target, features, vocab, out_dir=tmp_path / "split", resume=True, **settings)
    for a, b in zip(whole.trained_state().values(), resumed.trained_state().values()):
        assert torch.equal(a, b)
    assert json.loads((tmp_path / "split" / f"{kind}_log.json").read_text())["log"] == log["log"]
    cls, drafter = (EagleHead, EagleDrafter) if kind == "eagle" else (MedusaHeads, MedusaDrafter)
    trained = cls.load(tmp_path / "whole" / f"{kind}.safetensors", target)
    assert trained.feature_layers == layers if kind == "eagle" else trained.num_heads == 4
    untrained = EagleHead(target, vocab, layers).init_weights(torch.Generator().manual_seed(0)) \
        if kind == "eagle" else MedusaHeads(target, vocab, 4)
    seen = [p for i, p in enumerate(prompts) if i % 4 != 3]  # the training split's prompts (tiny_data)
    before = evaluate(target, drafter(target, untrained), seen, k=3, max_new_tokens=30)
    after = evaluate(target, drafter(target, trained), seen, k=3, max_new_tokens=30)
    assert after.num_accepted_tokens > 2 * before.num_accepted_tokens + 20, (before, after)
    if eagle3:  # the log's last epoch: the saved head's validation acceptance
        assert log["epochs"][-1]["validation_chain_acceptance"] == chain_acceptance(
            trained, features, data.indices("validation", greedy_only=True), 3, "cpu")
    if eagle3:  # teacher-forced, the acceptance that decoding the greedy answers' prompts measures
        greedy = data.indices("train", greedy_only=True)
        assert len(greedy) == 6
        for head, stats in ((untrained, before), (trained, after)):
            assert chain_acceptance(head, features, greedy, 3, "cpu") == pytest.approx(
                evaluate(target, drafter(target, head), [prompts[i] for i in greedy], k=3,
                         max_new_tokens=40).mean_acceptance_length, abs=1e-9)


def test_each_epoch_sees_every_training_sequence_once(setup, tmp_path, monkeypatch):
    """Sequences of very different lengths (the batches' count varies with the shuffle): each epoch's batches cover
    the training split exactly once, however many there are."""
    target, _, data, features = setup
    seen, epochs = [], []
    batch = features.batch
    monkeypatch.setattr(features, "batch", lambda idx, *a: seen.append(list(idx)) or batch(idx, *a))
    train("medusa", target, features, draft_vocabulary(data, 32), out_dir=tmp_path, epochs=3, tokens_per_batch=150,
          progress=False, on_epoch=lambda epoch, head, summary: epochs.append(len(seen)))
    starts = [0] + epochs
    for a, b in zip(starts, starts[1:]):
        assert sorted(i for idx in seen[a:b] for i in idx) == data.indices("train")
    counts = [b - a for a, b in zip(starts, starts[1:])]
    assert len(epochs) == 3 and sum(counts) == len(seen)


def test_the_shipped_prompt_set():
    from specdec_ext.draft_data import heldout_chat_prompts

    train_rows, heldout = load_prompts("train"), load_prompts("heldout")
    assert len(train_rows) + len(heldout) >= 200 and len(heldout) >= 20
    assert not {r["prompt"] for r in train_rows} & {r["prompt"] for r in heldout}
    assert {"chat", "code", "maths", "summary", "list"} <= {r["category"] for r in train_rows}
    chat = heldout_chat_prompts()
    assert len(chat) >= 50 and {r["category"] for r in chat} == {"chat"} and {r["split"] for r in chat} == {"heldout"}
    assert len({r["prompt"] for r in chat}) == len(chat)
