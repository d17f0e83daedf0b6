"""Incremental detokenisation for streamed generation: text printed as tokens arrive, whole characters only.

Decoding each round's new tokens alone garbles any character whose bytes span two rounds (byte-level BPE splits
CJK characters and emoji into several tokens): each half prints as U+FFFD. TextStream does what transformers'
TextStreamer and vLLM's incremental detokenizer do: it decodes the tokens since a stable prefix offset (a few
tokens of context, so that word-initial spaces come out as in a full decode) and emits only text that does not end
in an incomplete character ("\\ufffd"); flush() emits the rest. The pieces join to tokenizer.decode(all ids).

Imports nothing heavy: the tokenizer is the caller's (any object with .decode(ids, skip_special_tokens=...)).
"""

_REPLACEMENT = "\ufffd"


class TextStream:
    """stream = TextStream(tokenizer); for ids in rounds: print(stream.push(ids), end=""); print(stream.flush())."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids[prefix_offset:read_offset]: context whose text has been emitted already
        self.read_offset = 0    # ids[read_offset:]: tokens whose text has not been emitted yet
        self.text = ""          # everything emitted so far

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, new_ids) -> str:
        """Adds tokens; returns the newly complete text ("" while a character is still incomplete)."""
        self.ids.extend(int(i) for i in new_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""
        piece = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += piece
        return piece

    def flush(self) -> str:
        """The text not emitted yet (an incomplete character at the end comes out as U+FFFD, as in a full decode);
        after it, the pieces emitted join to tokenizer.decode(all ids)."""
        full = self._decode(self.ids)
        if full.startswith(self.text):
            piece = full[len(self.text):]
        else:  # a tokenizer whose windowed decode differs from the full one (clean-up of spaces): the window's rest
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            piece = self._decode(self.ids[self.prefix_offset:])[len(prefix):]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += piece
        return piece
