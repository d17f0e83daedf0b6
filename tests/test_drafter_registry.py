"""A new drafter is one file: a Drafter subclass and its DrafterEntry, both defined in this test, reach the command line
(`specdec generate --drafter NAME`) and every list of drafters the commands print, beside the drafters that ship."""
import pytest
import torch

import specdec_ext.factory
from helpers.models import VOCAB, tiny_model
from specdec_ext import cli
from specdec_ext.drafters import Drafter, Proposal, registry
from specdec_ext.drafters.base import padded
from specdec_ext.drafters.registry import DrafterEntry, register_drafter

PROPOSED = []  # the draft of every row of every round RepeatDrafter proposed


class RepeatDrafter(Drafter):
    """Proposes the request's last token, repeated (at most `repeats` times a round; None: as many as asked)."""

    def __init__(self, repeats: int | None = None):
        self.repeats = repeats

    def propose(self, r):
        drafts = [[h[-1]] * (k if self.repeats is None else min(k, self.repeats)) if h is not None else []
                  for h, k in zip(r.histories, r.num_tokens)]
        PROPOSED.extend(drafts)
        return Proposal(padded(drafts, 0, torch.int64, self.device), [len(d) for d in drafts])


def repeat_settings(spec: str, value: str | None) -> dict:
    """'repeat' or 'repeat:N'."""
    if value is None:
        return {}
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"--drafter repeat:N takes an int >= 1, got {spec!r}")
    return {"repeats": int(value)}


@pytest.fixture
def repeat_drafter(monkeypatch):
    """RepeatDrafter registered as `repeat`, for one test (the table is restored after it)."""
    monkeypatch.setattr(registry, "DRAFTERS", dict(registry.DRAFTERS))
    PROPOSED.clear()
    return register_drafter(DrafterEntry(
        name="repeat", drafter_class=RepeatDrafter, syntax="repeat[:N]", help="the last token repeated",
        value_help="N: at most N a round", parse=repeat_settings,
        build=lambda target, **settings: RepeatDrafter(**settings)))


class CharTokenizer:
    """One token per character (its code point modulo the tiny model's vocabulary); a token decodes as <id>."""
    eos_token_id = None

    def __call__(self, text):
        return {"input_ids": [ord(c) % VOCAB for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


def test_a_drafter_registered_in_a_test_generates_through_the_command(repeat_drafter, monkeypatch, tmp_path, capsys):
    from specdec_ext.engine import generate_autoregressive

    model, tokenizer = tiny_model(), CharTokenizer()
    monkeypatch.setattr(specdec_ext.factory, "load", lambda path, device, **options: (model, tokenizer))
    prompt = "the the the"
    assert cli.main(["generate", "--model", str(tmp_path), "--drafter", "repeat:2", "--prompt", prompt,
                     "--max-new-tokens", "16", "-k", "3", "--no-adaptive", "--device", "cpu"]) == 0
    out = capsys.readouterr()
    # Greedy: the tokens of plain decoding, whatever the drafter proposed.
    plain = generate_autoregressive(model, [tokenizer(prompt)["input_ids"]], 16).sequences[0]
    assert out.out == tokenizer.decode(plain) + "\n", out
    assert out.err.startswith("[repeat:2 drafter, k <= 3, fixed: 16 tokens in "), out.err
    assert PROPOSED and all(1 <= len(d) <= 2 and len(set(d)) == 1 for d in PROPOSED), PROPOSED


def test_factory_reads_the_registry(repeat_drafter):
    target = tiny_model()
    assert specdec_ext.factory.check_drafter("repeat:3") is repeat_drafter
    assert specdec_ext.factory.make_drafter("repeat:3", target).repeats == 3
    assert specdec_ext.factory.make_drafter("repeat", target).repeats is None
    with pytest.raises(ValueError, match=r"--drafter repeat:N takes an int >= 1, got 'repeat:0'"):
        specdec_ext.factory.check_drafter("repeat:0")


ALL_SPELLED = "eagle[:PATH], lookahead[:W/N/G], medusa[:PATH], model:PATH, ngram, repeat[:N] or self[:LAYERS][/N]"


@pytest.fixture
def no_loading(monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("loaded a model before checking the arguments")

    monkeypatch.setattr(specdec_ext.factory, "load", load)


@pytest.mark.parametrize("argv,message", [
    (["generate", "--prompt", "Hi", "--drafter", "eagel"], f"--drafter must be {ALL_SPELLED}, got 'eagel'"),
    (["generate", "--prompt", "Hi", "--drafter", "repeat:x"], "--drafter repeat:N takes an int >= 1, got 'repeat:x'"),
    (["generate", "--prompt", "Hi", "--drafter", "repeat", "--tree", "8"],
     "--tree: tree rounds need eagle, lookahead, medusa, ngram or self drafting, not the last token repeated"),
    (["generate", "--prompt", "Hi", "--drafter", "repeat", "--draft-keep-quantized"],
     "--draft-keep-quantized: the drafter must be model:PATH (a draft model)"),
    (["demo", "--drafter", "bogus"],
     "argument --drafter: invalid choice: 'bogus' (choose from 'eagle', 'lookahead', 'medusa', 'ngram', 'repeat', "
     "'self')"),
    (["train-draft", "--kind", "repeat", "--data", __file__, "--out", "/tmp/unused"],
     "argument --kind: invalid choice: 'repeat' (choose from 'eagle', 'medusa')"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_messages_list_every_registered_drafter(argv, message, repeat_drafter, no_loading, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.strip().splitlines()[-1] == f"specdec {argv[0]}: error: {message}", err


def test_help_lists_every_registered_drafter(repeat_drafter, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "1000")  # one line per flag: no wrapping inside the text checked
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    out = capsys.readouterr().out
    assert ("--drafter DRAFTER     eagle[:PATH] (a trained EAGLE head; without PATH, the one shipped for the default "
            "model), lookahead[:W/N/G] (Lookahead decoding: a Jacobi window and an n-gram pool; trees of its own), "
            "medusa[:PATH] (trained Medusa heads; without PATH, the ones shipped for the default model), model:PATH "
            "(a draft model), ngram (n-gram prompt lookup), repeat[:N] (the last token repeated; N: at most N a "
            "round) or self[:LAYERS][/N] (self-speculative drafting with the target's own layers; L: the first L; "
            "A,B,C: those; without: searched on the model; /N: drafts over the first N token ids). Default: eagle for "
            "the default model, ngram otherwise") in out, out
    assert "--tree TREE           tree rounds (eagle, medusa, ngram, self; lookahead always runs its own): N" \
        in out, out
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    out = capsys.readouterr().out
    assert ("run one task with this drafter: eagle, medusa, repeat or self on the chat question, lookahead or ngram on "
            "the rewriting task") in out, out


def test_the_shipped_drafters_are_registered():
    assert [e.name for e in registry.drafters()] == ["eagle", "lookahead", "medusa", "model", "ngram", "self"]
    assert [e.name for e in registry.drafters() if e.draws_trees] == ["eagle", "lookahead", "medusa", "ngram", "self"]
    assert [e.name for e in registry.drafters() if e.needs_draft_model] == ["model"]
    assert [e.name for e in registry.drafters() if e.trained_heads] == ["eagle", "medusa"]


def test_a_name_is_registered_once(repeat_drafter):
    with pytest.raises(ValueError, match="a drafter named 'repeat' is registered already"):
        register_drafter(repeat_drafter)
    with pytest.raises(ValueError, match="drafter_class must be a Drafter subclass"):
        register_drafter(DrafterEntry(name="plain", drafter_class=object, syntax="plain", help="", parse=None,
                                      build=None))
