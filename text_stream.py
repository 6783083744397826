"""
Tokens to text, one token at a time: what a stream of generated tokens looks like to a
reader. Shared by generate.py (the CLI) and serving/engine.py (the server's engine), so
both print the same text and stop at the same place.
"""

import codecs


class SampleText:
    """The text of one sample, built token by token.

    Tokens are byte sequences, and one UTF-8 character can span two tokens: an incremental
    decoder holds back an incomplete character until its last byte arrives, so nothing
    printed is ever half a character. Text that might be the start of a stop string is
    held back too, until it is clear that it is not one."""

    def __init__(self, tokenizer, stops, stop_at_eot=True):
        self.tokenizer, self.stops, self.stop_at_eot = tokenizer, stops, stop_at_eot
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text, self.tokens, self.done = "", 0, False

    def add(self, token):
        if token == self.tokenizer.eot_token and self.stop_at_eot:
            self.done = True
            return
        self.tokens += 1
        # a stop string can only be found where the new piece of text touches it
        start = max(0, len(self.text) - max(map(len, self.stops), default=0))
        self.text += self.decoder.decode(self.tokenizer.decode_single_token_bytes(token))
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.done = True

    def ready(self):
        """How many characters can be shown now."""
        if self.done:
            return len(self.text)
        held = max((n for s in self.stops for n in range(1, len(s)) if self.text.endswith(s[:n])),
                   default=0)
        return len(self.text) - held
