"""Stop strings: a request ends when its detokenised output completes one of them, as in vLLM.

A speculative round accepts several tokens at once, but the output must be what plain decoding (one token per step)
would give. StopChecker therefore adds a round's tokens one at a time: after each, the text it completed (decoded
incrementally, whole characters only: specdec_ext.streaming.TextStream) is searched for every stop string, together
with enough of the text before it for a stop that began earlier (in an earlier token or an earlier round). The first
token that completes a stop ends the request: it is kept, the tokens after it in the round are dropped, and the
output text is cut before the stop (or after it with include_stop_str_in_output=True), which may fall inside that
token's text. A stream of the text withholds any tail that may still turn out to be the start of a stop, so it never
emits text that the cut removes.

Host-side; this module imports nothing heavy itself: the tokenizer is the caller's (any object with
.decode(ids, skip_special_tokens=...)).
"""
import operator

from ..streaming import TextStream


def _validate_stop(stop) -> tuple:
    """The stop strings as a tuple; ValueError unless `stop` is a list (or tuple) of non-empty strings or None."""
    if stop is None:
        return ()
    if isinstance(stop, (str, bytes)):
        raise ValueError(f"StopChecker: stop must be a list of non-empty strings, got the string {stop!r} "
                         f"(for one stop string pass [{stop!r}])")
    if not isinstance(stop, (list, tuple)):
        raise ValueError(f"StopChecker: stop must be a list of non-empty strings, got {type(stop).__name__}")
    for s in stop:
        if not isinstance(s, str):
            raise ValueError(f"StopChecker: stop must be a list of non-empty strings, got an entry of type "
                             f"{type(s).__name__}: {s!r}")
        if not s:
            raise ValueError("StopChecker: stop must be a list of non-empty strings, got an empty string "
                             "(it would match before any output)")
    return tuple(stop)


class StopChecker:
    """Stop strings of one request, checked on its detokenised output as it advances round by round.

    Parameters
    ----------
    tokenizer : object
        Anything with ``decode(ids, skip_special_tokens=...)`` (a transformers tokenizer).
    stop : list of str
        The stop strings (none by default; None is none too). Each must be a non-empty string; a bare string is
        refused rather than read as a list of characters.
    include_stop_str_in_output : bool
        Keep the matched stop string at the end of `text` (default: cut before it).
    skip_special_tokens : bool
        Passed to the tokenizer's decode (EOS and other special tokens add no text).

    Attributes
    ----------
    stopped : str or None
        The stop string that ended the request; None until then.
    text : str
        The output text so far: whole characters only while the request runs, cut at the stop once stopped. After
        finish() it is the tokenizer's decode of every token pushed (an incomplete last character as U+FFFD).
    finished : bool
        True once a stop matched or finish() was called; push() is then refused.

    Notes
    -----
    Semantics (vLLM's, with the tokens of a round taken one at a time):

    - After each token, the text that token completed is searched for each stop string, starting
      ``len(stop_string) - 1`` characters before it, so a stop that spans tokens or rounds is found and text
      already searched is not searched again. Text is attributed to the token that completes it: a multi-byte
      character split across tokens counts when its last byte arrives (as in vLLM, with the first token after
      which the decode does not end in an incomplete character).
    - The earliest token that completes a stop wins, whatever the stops' order. When one token completes several
      stops, the first of `stop` (in list order) that occurs in the searched text wins, as in vLLM; within one stop
      string, its first occurrence.
    - Cut: ``text[:start]`` (stop excluded) or ``text[:start + len(stop_string)]`` (included); the part of the
      completing token's text past the cut is dropped.
    - min_tokens: while the output is shorter than min_tokens, stops are not checked (``push(ids, check=n)``: the
      first n tokens of this push are not checked). Their text is still searched as the context before later
      tokens, so a stop that starts there and ends in a checked token matches.

    Examples
    --------
    >>> class Chars:  # a toy tokenizer: token i decodes to chr(i)
    ...     def decode(self, ids, skip_special_tokens=True):
    ...         return "".join(map(chr, ids))
    >>> checker = StopChecker(Chars(), stop=["\\n\\n"])
    >>> checker.push([ord(c) for c in "Hi!\\n"])  # a round of 4 accepted tokens: all kept
    4
    >>> checker.take_stream_text()  # "\\n" may be the start of the stop: withheld
    'Hi!'
    >>> checker.push([ord(c) for c in "\\nmore"])  # the first token completes the stop: 1 kept, 4 dropped
    1
    >>> checker.stopped, checker.text, checker.take_stream_text()
    ('\\n\\n', 'Hi!', '')
    """

    def __init__(self, tokenizer, stop: list[str] = (), include_stop_str_in_output: bool = False,
                 skip_special_tokens: bool = True):
        self.stop = _validate_stop(stop)
        self.include_stop_str_in_output = bool(include_stop_str_in_output)
        self._stream = TextStream(tokenizer, skip_special_tokens=skip_special_tokens)
        self.stopped: str | None = None
        self.text = ""
        self.finished = False
        self._emitted = 0  # len of the text returned by take_stream_text so far

    @staticmethod
    def _unchecked(check, n: int) -> int:
        """How many leading tokens of a push of n tokens are not checked, from push's `check` argument."""
        if isinstance(check, bool):
            return 0 if check else n
        try:
            skip = operator.index(check)
        except TypeError:
            raise TypeError(f"StopChecker.push: check must be a bool or an int (the leading tokens not to check), "
                            f"got {type(check).__name__}") from None
        return min(max(skip, 0), n)

    def push(self, new_ids: list[int], check: bool | int = True) -> int:
        """Adds a round's accepted tokens one by one and checks the stop strings after each.

        Parameters
        ----------
        new_ids : list of int
            The tokens the round accepted for this request, in order.
        check : bool or int
            True: check after every token; False: check none of them; an int n: do not check after the first n
            tokens of this push (for min_tokens: ``check=max(0, min_tokens - tokens_generated_before)``; a
            negative n counts as 0, an n past the push as False).

        Returns
        -------
        int
            How many of new_ids the request keeps: len(new_ids), unless a stop string ends within them; then up to
            and including the token that completes it (the request is then finished: `stopped` names the stop and
            `text` is cut).

        Examples
        --------
        >>> class Chars:
        ...     def decode(self, ids, skip_special_tokens=True):
        ...         return "".join(map(chr, ids))
        >>> checker = StopChecker(Chars(), stop=["b"])
        >>> checker.push([ord("b"), ord("a"), ord("b"), ord("c")], check=2)  # min_tokens=2: the first "b" is text
        3
        >>> checker.text
        'ba'
        """
        if self.finished:
            raise RuntimeError(f"StopChecker.push: the request has finished ("
                               f"{'stop ' + repr(self.stopped) if self.stopped is not None else 'finish() called'})")
        ids = [operator.index(i) for i in new_ids]
        unchecked = self._unchecked(check, len(ids))
        for n, token in enumerate(ids):
            piece = self._stream.push([token])
            if not piece:  # an incomplete character: its text comes with the token that completes it
                continue
            self.text += piece
            if n < unchecked or not self.stop:
                continue
            match = self._match(len(piece))
            if match is not None:
                self.stopped, cut = match
                self.text = self.text[:cut]
                self.finished = True
                return n + 1
        return len(ids)

    def _match(self, new_chars: int):
        """(stop string, length to cut text to) for the first stop string (in list order) that ends within the last
        new_chars characters of text; None if none does."""
        text = self.text
        for s in self.stop:
            start = text.find(s, max(0, len(text) - new_chars - len(s) + 1))
            if start != -1:
                return s, start + len(s) if self.include_stop_str_in_output else start
        return None

    def _withheld(self) -> int:
        """How many characters at the end of text may still become (the start of) a stop: the longest tail that is
        a proper prefix of a stop string. 0 when the stop is kept in the output: then whatever the tail turns into,
        it stays."""
        if self.include_stop_str_in_output:
            return 0
        text, held = self.text, 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:k]):
                    held = k
                    break
        return held

    def take_stream_text(self) -> str:
        """The text that became safe to emit since the last call.

        Complete characters only (a character split across tokens waits for its last byte), withholding the tail of
        the text that is a prefix of a stop string (it may still become a stop and be cut) unless the stop is kept
        in the output, and never text past a stop. Once the request has finished (stopped, or finish() called) it
        returns the rest of `text`.

        Returns
        -------
        str
            The new text ("" when there is none yet). Joined, the pieces of all calls equal `text` once the request
            has finished.

        Examples
        --------
        >>> class Chars:
        ...     def decode(self, ids, skip_special_tokens=True):
        ...         return "".join(map(chr, ids))
        >>> checker = StopChecker(Chars(), stop=["END"])
        >>> checker.push([ord(c) for c in "THE EN"])
        6
        >>> checker.take_stream_text()  # "EN" may become "END"
        'THE '
        >>> checker.finish()  # ended for another reason (length): "EN" was text after all
        >>> checker.take_stream_text()
        'EN'
        """
        end = len(self.text) if self.finished else len(self.text) - self._withheld()
        if end <= self._emitted:
            return ""
        piece = self.text[self._emitted:end]
        self._emitted = end
        return piece

    def finish(self) -> None:
        """The request ended for another reason (EOS, length): the withheld text becomes emittable, and `text` gains
        what the tokens decode to but was not complete yet (an incomplete last character as U+FFFD, as in the
        tokenizer's decode of all the tokens). A no-op once finished (a stop matched, or finish() already called).

        Examples
        --------
        >>> class Chars:
        ...     def decode(self, ids, skip_special_tokens=True):
        ...         return "".join(map(chr, ids))
        >>> checker = StopChecker(Chars(), stop=["!!"])
        >>> checker.push([ord("o"), ord("k"), ord("!")])
        3
        >>> checker.take_stream_text(), checker.finish(), checker.take_stream_text()
        ('ok', None, '!')
        """
        if self.finished:
            return
        self.text += self._stream.flush()
        self.finished = True
