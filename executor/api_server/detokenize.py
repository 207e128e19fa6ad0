"""Streaming a request's tokens as text: each step's new tokens turned into the text they add (vLLM's incremental
detokenization: decode a few tokens back so merges and multi-byte characters come out whole), cut at the first stop
string, holding back a stop string's worth of text until it is known not to begin one."""
from __future__ import annotations

REPLACEMENT = "\ufffd"  # an incomplete UTF-8 sequence decodes to it: wait for the next token


class TextStream:
    """The text of one request's output, fed its tokens as they come. Without a tokenizer (a random-weight model),
    each token's text is its id after a space."""

    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str] = ()):
        self.tokenizer, self.stop = tokenizer, list(stop)
        self.ids = list(prompt_ids[-6:])  # a little context: a token's text can depend on the one before it
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.text = ""  # all the output's text so far
        self.sent = 0  # characters of `text` handed out
        self.stopped = False  # a stop string was found: `text` ends before it
        self.hold = max((len(s) for s in self.stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return "".join(f" {t}" for t in ids)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, tokens: list[int], last: bool) -> str:
        """The text these new tokens let out (all of it when `last`); sets `stopped` at a stop string."""
        if self.stopped:
            return ""
        self.ids += tokens
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        if len(after) > len(before) and (last or not after.endswith(REPLACEMENT)):
            self.text += after[len(before):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if self.stop:
            start = max(0, self.sent - self.hold)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text, self.stopped = self.text[:min(hits)], True
        end = len(self.text) if last or self.stopped else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:end], end
        return out
