"""Stop strings (specdec_ext.engine.stops.StopChecker): matched on the detokenised text one token at a time whatever
the rounds, across round boundaries and inside tokens, the stop cut out of (or kept in) the text, the stream never
emitting text that a stop removes nor half a character, min_tokens, several stops, the argument checks. Host-side
only: the shipped tokenizer and a toy byte-level one, no model."""
import doctest
import random

import pytest

from specdec_ext.engine import stops
from specdec_ext.engine.stops import StopChecker

REPLACEMENT = "\ufffd"
EMOJI_TEXT = "I like 😀 emoji and 東京 city. The end.\n\nNext"


@pytest.fixture(scope="module")
def tok():
    from specdec_ext.models import default_model_path, load_tokenizer

    return load_tokenizer(default_model_path())


class ByteTokenizer:
    """A toy byte-level tokenizer: token i (from 1) is the i-th byte string given, token 0 an EOS that decodes to
    nothing with skip_special_tokens. A character split across tokens decodes as U+FFFD, as byte-level BPE does."""

    def __init__(self, *pieces):
        self.vocab = [b"<eos>"] + [p.encode() if isinstance(p, str) else p for p in pieces]
        self.ids = list(range(1, len(self.vocab)))

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.vocab[i] for i in ids if i or not skip_special_tokens).decode("utf-8", "replace")


def run(checker: StopChecker, rounds, check=True):
    """Pushes the rounds until the request stops, reading the stream after each; then finish(). Returns (tokens
    kept, the stream's pieces, the text the stream had emitted after each round)."""
    kept, pieces, emitted = 0, [], []
    for i, ids in enumerate(rounds):
        if checker.finished:
            break
        n = checker.push(ids, check[i] if isinstance(check, list) else check)
        assert n == len(ids) or checker.stopped is not None
        kept += n
        pieces.append(checker.take_stream_text())
        assert REPLACEMENT not in pieces[-1], pieces  # only whole characters while the request runs
        emitted.append("".join(pieces))
    checker.finish()
    pieces.append(checker.take_stream_text())
    assert checker.take_stream_text() == ""
    assert "".join(pieces) == checker.text, pieces
    return kept, pieces, emitted


def split(ids, sizes):
    """ids in rounds of the given sizes (cycled)."""
    out, i, j = [], 0, 0
    while i < len(ids):
        out.append(ids[i:i + sizes[j % len(sizes)]])
        i, j = i + sizes[j % len(sizes)], j + 1
    return out


def random_rounds(ids, rng):
    return split(ids, [rng.randint(1, 5) for _ in range(len(ids))])


def whole(tokenizer, ids) -> str:
    """The text of ids with an incomplete last character left out (the longest prefix of the tokens whose decode
    does not end in U+FFFD), decoded in one piece."""
    for m in range(len(ids), -1, -1):
        text = tokenizer.decode(ids[:m], skip_special_tokens=True)
        if not text.endswith(REPLACEMENT):
            return text
    return ""


def brute_force(tokenizer, ids, stop: str, include: bool, min_tokens: int = 0):
    """(tokens kept, text) of one stop string, from full decodes of every prefix of the tokens: the request stops at
    the first token past min_tokens whose text holds the stop ending past the text of the first min_tokens."""
    floor = len(whole(tokenizer, ids[:min_tokens]))
    for n in range(min_tokens + 1, len(ids) + 1):
        text = whole(tokenizer, ids[:n])
        start = text.find(stop, max(0, floor - len(stop) + 1))
        if start != -1:
            return n, text[:start + len(stop) if include else start]
    return len(ids), tokenizer.decode(ids, skip_special_tokens=True)


# --------------------------------------------------------------------------------------------- shipped tokenizer
def test_stop_across_round_boundary(tok):
    text = "Hello world. The end. More text"
    ids = tok(text)["input_ids"]  # Hello| world|.| The| end|.| More| text
    assert len(ids) == 8
    # "world. The" spans three tokens and the boundary between rounds 1 and 2.
    checker = StopChecker(tok, stop=["world. The"])
    assert checker.push(ids[:3]) == 3 and checker.stopped is None
    assert checker.push(ids[3:]) == 1  # " The" completes it: kept; " end", ".", " More", " text" dropped
    assert (checker.stopped, checker.text) == ("world. The", "Hello ")


@pytest.mark.parametrize("include", [False, True])
def test_stop_ending_inside_a_token(tok, include):
    ids = tok("Hello world. The end.")["input_ids"]
    checker = StopChecker(tok, stop=["o wor"], include_stop_str_in_output=include)
    kept, pieces, emitted = run(checker, [ids[:1], ids[1:]])
    assert kept == 2  # " world" completes "o wor": the text is cut inside it
    assert checker.stopped == "o wor"
    assert checker.text == ("Hello wor" if include else "Hell")
    # Excluded: the "o" that starts the stop was withheld after round 1, and never emitted.
    assert pieces[0] == ("Hello" if include else "Hell")


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stop", ["😀", " emoji", "😀 em", "京", "東京 c", "end.\n\n", "\n\n", ". The", "y."])
def test_matches_full_decodes_whatever_the_rounds(tok, stop, include):
    """Every split of the tokens into rounds (incl. splits inside the emoji's and the CJK characters' bytes) gives
    what full decodes of every prefix give; the stream is whole characters and never gets ahead of the text."""
    ids = tok(EMOJI_TEXT)["input_ids"]
    assert tok.decode(ids) == EMOJI_TEXT
    expected = brute_force(tok, ids, stop, include)
    assert expected[0] < len(ids)  # every stop here does occur
    rng = random.Random(stop)
    for rounds in [[[i] for i in ids], [ids], split(ids, [2]), split(ids, [3, 1])] + \
            [random_rounds(ids, rng) for _ in range(4)]:
        checker = StopChecker(tok, stop=[stop], include_stop_str_in_output=include)
        kept, pieces, emitted = run(checker, rounds)
        assert (kept, checker.text, checker.stopped) == (*expected, stop), rounds
        assert all(checker.text.startswith(e) for e in emitted), (rounds, emitted)


def test_emoji_split_across_pushes_streams_whole(tok):
    ids = tok("I like 😀 emoji")["input_ids"]  # I| like| <space + 3 bytes of 😀>|<its last byte>| em|oji
    assert tok.decode(ids[2:3]).endswith(REPLACEMENT) and tok.decode(ids[3:4]) == REPLACEMENT
    checker = StopChecker(tok, stop=[" emoji"])  # right after the emoji
    kept, pieces, _ = run(checker, [[i] for i in ids])
    assert pieces[2] == ""  # half the emoji: nothing yet
    assert pieces[3] == " 😀"
    assert (kept, checker.text, "".join(pieces)) == (6, "I like 😀", "I like 😀")
    # The stop is the emoji itself: it completes with its last byte's token, which is kept.
    checker = StopChecker(tok, stop=["😀"])
    assert [checker.push([i]) for i in ids[:4]] == [1, 1, 1, 1] and checker.stopped == "😀"
    assert checker.text == checker.take_stream_text() == "I like "


def test_no_stop_gives_the_full_decode(tok):
    ids = tok(EMOJI_TEXT)["input_ids"]
    for include in (False, True):
        checker = StopChecker(tok, stop=["never", "zzz"], include_stop_str_in_output=include)
        kept, pieces, _ = run(checker, split(ids, [3]))
        assert (kept, checker.stopped, checker.text, "".join(pieces)) == (len(ids), None, EMOJI_TEXT, EMOJI_TEXT)
    # EOS (a special token) adds no text; finish() releases what was withheld.
    checker = StopChecker(tok, stop=["Next!"])
    assert checker.push(ids + [tok.eos_token_id]) == len(ids) + 1
    assert checker.take_stream_text() == EMOJI_TEXT[:-len("Next")]  # "Next" may become "Next!"
    checker.finish()
    assert checker.take_stream_text() == "Next" and checker.text == EMOJI_TEXT


# ------------------------------------------------------------------------------------------------ toy tokenizer
def test_stream_withholds_a_pending_stop_prefix():
    t = ByteTokenizer("ab", "c", "\n", "d", "\n", "e")
    checker = StopChecker(t, stop=["c\n\n", "xyz"])
    assert checker.push(t.ids[:2]) == 2 and checker.take_stream_text() == "ab"  # "c" may start "c\n\n"
    assert checker.push(t.ids[2:3]) == 1 and checker.take_stream_text() == ""   # "c\n" too
    assert checker.push(t.ids[3:4]) == 1 and checker.take_stream_text() == "c\nd"  # it did not
    assert checker.push(t.ids[4:]) == 2 and checker.take_stream_text() == "\ne"
    # Kept in the output, a stop's prefix is emitted at once: whatever it becomes, it stays.
    t = ByteTokenizer("ab", "c", "\n", "\n", "d")
    checker = StopChecker(t, stop=["c\n\n"], include_stop_str_in_output=True)
    kept, pieces, _ = run(checker, [t.ids[:2], t.ids[2:3], t.ids[3:]])
    assert (kept, pieces, checker.text) == (4, ["abc", "\n", "\n", ""], "abc\n\n")
    checker = StopChecker(t, stop=["c\n\n"])
    kept, pieces, _ = run(checker, [t.ids[:2], t.ids[2:3], t.ids[3:]])
    assert (kept, pieces, checker.text) == (4, ["ab", "", "", ""], "ab")


def test_stop_prefix_after_a_split_emoji():
    """An emoji split across pushes never streams as U+FFFD, the stop right after it cuts there, and a token that
    ends one character and starts the next holds both back until the second completes (as in vLLM)."""
    t = ByteTokenizer("I ", b"\xf0\x9f", b"\x98\x80", "!", "?", "x")
    checker = StopChecker(t, stop=["!?"])
    kept, pieces, _ = run(checker, [[i] for i in t.ids])
    assert (kept, checker.text, pieces) == (5, "I 😀", ["I ", "", "😀", "", "", ""])
    t = ByteTokenizer("a", b"\xf0\x9f", b"\x98\x80\xf0\x9f", b"\x98\x81", "b")  # 😀 ends where 😁 starts
    checker = StopChecker(t, stop=["😀"])
    assert [checker.push([i]) for i in t.ids[:4]] == [1, 1, 1, 1]  # found with 😁's last byte
    assert (checker.stopped, checker.text) == ("😀", "a")


def test_min_tokens_skips_the_check():
    t = ByteTokenizer("x", "y", "S", "T", "S", "T", "u")
    ids = t.ids
    # min_tokens=4: the "ST" of tokens 3-4 is text; the second one (tokens 5-6) stops the request.
    assert brute_force(t, ids, "ST", False, min_tokens=4) == (6, "xyST")
    for rounds, check in [([ids], [4]), ([ids[:2], ids[2:]], [2, 2]), ([ids[:3], ids[3:]], [3, 1]),
                          ([ids[:4], ids[4:]], [False, 0]), ([ids[:4], ids[4:]], [False, -3])]:
        checker = StopChecker(t, stop=["ST"])
        kept, _, _ = run(checker, rounds, check)
        assert (kept, checker.text, checker.stopped) == (6, "xyST", "ST"), (rounds, check)
    # Without min_tokens the first "ST" stops it.
    checker = StopChecker(t, stop=["ST"])
    assert run(checker, [ids[:2], ids[2:]], [True, True])[0] == 4 and checker.text == "xy"
    # A stop that starts in the unchecked tokens and ends in a checked one matches (its text is the context).
    checker = StopChecker(t, stop=["yS"])
    assert checker.push(ids, check=2) == 3 and checker.text == "x"
    checker = StopChecker(t, stop=["yS"])
    assert checker.push(ids, check=3) == len(ids) and checker.stopped is None  # past min_tokens, no "yS" ends


def test_several_stops_earliest_token_wins():
    t = ByteTokenizer("a", "bc", "d", "xab", "z")
    # Across tokens: the token that completes a stop first wins, whatever the list's order.
    for stop in (["bcd", "ab"], ["ab", "bcd"]):
        checker = StopChecker(t, stop=stop)
        assert checker.push(t.ids) == 2 and (checker.stopped, checker.text) == ("ab", "")
    for stop in (["d", "xa"], ["xa", "d"]):
        checker = StopChecker(t, stop=stop)
        assert checker.push(t.ids) == 3 and (checker.stopped, checker.text) == ("d", "abc")
    # One token completing several stops: the first of the list that occurs wins (vLLM's rule).
    for stop, text in ((["b", "xa"], "abcdxa"), (["xa", "b"], "abcd"), (["ab", "x"], "abcdx")):
        checker = StopChecker(t, stop=stop)
        assert checker.push(t.ids[:3], check=3) == 3
        assert checker.push(t.ids[3:]) == 1 and (checker.stopped, checker.text) == (stop[0], text)


@pytest.mark.parametrize("bad", [[""], ["ok", ""], "stop", ["ok", 3], [None], {"a": 1}, [b"x"], 5])
def test_invalid_stop_is_refused(bad):
    with pytest.raises(ValueError, match="stop must be a list of non-empty strings"):
        StopChecker(ByteTokenizer("a"), stop=bad)


def test_empty_stop_list_streams_everything_and_finished_requests_refuse_tokens():
    t = ByteTokenizer("a", "b")
    for stop in ([], (), None):
        checker = StopChecker(t, stop=stop)
        assert checker.push(t.ids) == 2 and checker.take_stream_text() == "ab" and checker.stopped is None
    checker.finish()
    checker.finish()  # a no-op
    with pytest.raises(RuntimeError, match="finished"):
        checker.push([1])
    checker = StopChecker(t, stop=["a"])
    assert checker.push(t.ids) == 1
    with pytest.raises(RuntimeError, match="stop 'a'"):
        checker.push([2])
    with pytest.raises(TypeError, match="check"):
        StopChecker(t).push([1], check="yes")


def test_doctests():
    results = doctest.testmod(stops, optionflags=doctest.ELLIPSIS)
    assert results.attempted >= 10 and results.failed == 0
