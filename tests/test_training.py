"""Training draft heads end to end on a tiny random target: the target's answers and features, the draft
vocabulary, a few epochs (the loss falls), files written, a resumed run continues from its checkpoint, and the
trained heads draft better than untrained ones on what they were trained on."""
import json

import pytest
import torch

from helpers.models import random_prompts, tiny_model
from specdec_ext.drafters import EagleDrafter, MedusaDrafter
from specdec_ext.models.draft_heads import EagleHead, MedusaHeads
from specdec_ext.training import distillation_data, draft_vocabulary, evaluate, load_prompts, train

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def setup():
    target = tiny_model(seed=21, logit_scale=0.5)
    prompts = random_prompts(4, [5, 9, 7, 12, 6, 10, 8, 11])
    data = distillation_data(target, prompts, 40, batch_size=4, progress=False)
    return target, prompts, data


def test_distillation_data_and_vocabulary(setup):
    target, prompts, data = setup
    assert len(data.tokens) == 8 and all(len(t) == len(p) + 40 for t, p in zip(data.tokens, prompts))
    assert [t[:len(p)].tolist() for t, p in zip(data.tokens, prompts)] == prompts
    # The features are the target's: one forward of the whole sequence through a cache gives the same.
    cache = target.new_kv_cache(1, len(data.tokens[0]))
    _, hidden = target(data.tokens[0].unsqueeze(0), cache, output_hidden_states=True)
    torch.testing.assert_close(data.features[0], hidden[0], rtol=1e-4, atol=1e-4)
    vocab = draft_vocabulary(data, 20)
    counts = torch.bincount(torch.cat(data.tokens), minlength=target.config.vocab_size)
    assert len(vocab) == 20 and bool((vocab[1:] > vocab[:-1]).all())
    assert counts[vocab].min() >= counts[~torch.isin(torch.arange(len(counts)), vocab)].max()
    # Asked for more tokens than the data hold: every seen one, then the lowest unseen ids.
    seen = (counts > 0).nonzero().flatten()
    wide = draft_vocabulary(data, len(seen) + 10, target.config.vocab_size)
    unseen = (counts == 0).nonzero().flatten()[:10]
    assert wide.tolist() == sorted(seen.tolist() + unseen.tolist())


def test_sampled_answers(setup):
    target, prompts, data = setup
    both = distillation_data(target, prompts[:3], 40, sampled_answers=1, batch_size=4, progress=False)
    assert len(both.tokens) == 6
    # Each prompt's greedy answer, then one drawn at temperature 0.8: a different text from the same prompt.
    assert [t.tolist() for t in both.tokens[::2]] == [t.tolist() for t in data.tokens[:3]]
    assert all(torch.equal(t[:len(p)], torch.tensor(p)) for t, p in zip(both.tokens[1::2], prompts))
    assert all(not torch.equal(a, b) for a, b in zip(both.tokens[::2], both.tokens[1::2]))


@pytest.mark.parametrize("kind,unroll", [("eagle", 1), ("eagle", 2), ("medusa", 1)],
                         ids=["eagle", "eagle-unroll2", "medusa"])
def test_training_lowers_the_loss_writes_files_resumes_and_helps(setup, kind, unroll, tmp_path):
    target, prompts, data = setup
    vocab = draft_vocabulary(data, 64)
    lr = 3e-3 if kind == "eagle" else 1e-2
    train(kind, target, data, vocab, out_dir=tmp_path, epochs=12, tokens_per_batch=120, lr=lr, unroll=unroll,
          checkpoint_every=5, progress=False)
    log = json.loads((tmp_path / f"{kind}_log.json").read_text())["log"]
    first, last = sum(e["loss"] for e in log[:3]) / 3, sum(e["loss"] for e in log[-3:]) / 3
    assert last < 0.8 * first, (first, last)
    assert (tmp_path / f"{kind}.safetensors").exists() and (tmp_path / f"{kind}_loss.png").stat().st_size > 1000
    # Resuming with more epochs continues from the checkpoint's step.
    train(kind, target, data, vocab, out_dir=tmp_path, epochs=13, tokens_per_batch=120, lr=lr, unroll=unroll,
          progress=False)
    log2 = json.loads((tmp_path / f"{kind}_log.json").read_text())["log"]
    assert log2[:len(log)] == log and len(log2) > len(log)
    cls, drafter = (EagleHead, EagleDrafter) if kind == "eagle" else (MedusaHeads, MedusaDrafter)
    trained = cls.load(tmp_path / f"{kind}.safetensors", target)
    untrained = EagleHead(target, vocab).init_weights(torch.Generator().manual_seed(0)) if kind == "eagle" else \
        MedusaHeads(target, vocab, 4)
    before = evaluate(target, drafter(target, untrained), prompts, k=3, max_new_tokens=30)
    after = evaluate(target, drafter(target, trained), prompts, k=3, max_new_tokens=30)
    assert after.num_accepted_tokens > 2 * before.num_accepted_tokens + 20, (before, after)


def test_the_shipped_prompt_set():
    train_rows, heldout = load_prompts("train"), load_prompts("heldout")
    assert len(train_rows) + len(heldout) >= 200 and len(heldout) >= 20
    assert not {r["prompt"] for r in train_rows} & {r["prompt"] for r in heldout}
    assert {"chat", "code", "maths", "summary", "list"} <= {r["category"] for r in train_rows}
