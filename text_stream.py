"""
Tokens to text, one token at a time: what a stream of generated tokens looks like to a
reader. Shared by generate.py (the CLI) and serving/engine.py (the server's engine), so
both print the same text and stop at the same place.
"""

import codecs

from stop_strings import StopString


class SampleText:
    """The text of one sample, built token by token.

    Tokens are byte sequences, and one UTF-8 character can span two tokens: an incremental
    decoder holds back an incomplete character until its last byte arrives, so nothing
    printed is ever half a character. Text that might be the start of a stop string is
    held back too, until it is clear that it is not one."""

    def __init__(self, tokenizer, stops, stop_at_eot=True):
        self.tokenizer, self.stop_at_eot = tokenizer, stop_at_eot
        self.stops = [StopString(s) for s in stops]  # each reads every new character once
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text, self.tokens, self.done = "", 0, False

    def add(self, token):
        if token == self.tokenizer.eot_token and self.stop_at_eot:
            self.done = True
            return
        self.tokens += 1
        piece = self.decoder.decode(self.tokenizer.decode_single_token_bytes(token))
        start = len(self.text)
        self.text += piece
        # where each stop string's first match begins, if this piece completed one
        hits = [start + end - len(s.stop) for s in self.stops if (end := s.feed(piece)) is not None]
        if hits:
            self.text = self.text[:min(hits)]
            self.done = True

    def ready(self):
        """How many characters can be shown now: all but the end of the text that is the
        start of a stop string."""
        if self.done:
            return len(self.text)
        return len(self.text) - max((s.matched for s in self.stops), default=0)
