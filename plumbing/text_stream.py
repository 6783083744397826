"""
Tokens to text, one token at a time: what a stream of generated tokens looks like to a
reader. Shared by generate.py (the command) and serving/engine.py (the server's engine), so
both print the same text and stop at the same place: at a stop string, or at any of the
tokenizer's end-of-sequence ids (eos_token_ids, tiktoken's and Hugging Face's alike).

Stop strings are found in text that arrives a piece at a time, in time linear in the text.
Searching the whole tail of the text again at every step costs O(len(stop)) per step, and
asking "does the text end with the first n characters of the stop string?" for every n
costs O(len(stop)^2), which a long --stop string turned into seconds per token. The
Knuth-Morris-Pratt automaton below reads each new character once (amortised O(1)): it
keeps `matched`, the length of the longest start of the stop string that the text ends
with, which is also exactly how much text must be held back from printing, because the
next piece may complete the match.
"""

import codecs
import functools


def eos_token_ids(tokenizer):
    """Every id that ends a text: a Hugging Face model may name several (Llama 3's instruct
    models end a turn with any of three: plumbing/hf_tokenizer.py); a tiktoken Encoding has
    its one end-of-text token. The one place every caller asks."""
    return tuple(getattr(tokenizer, "eos_token_ids", None) or (tokenizer.eot_token,))


class SampleText:
    """The text of one sample, built token by token.

    Tokens are byte sequences, and one UTF-8 character can span two tokens: an incremental
    decoder holds back an incomplete character until its last byte arrives, so nothing
    printed is ever half a character. Text that might be the start of a stop string is
    held back too, until it is clear that it is not one."""

    def __init__(self, tokenizer, stops, stop_at_eot=True, stop_token_ids=(), include_stop=False):
        """stops: strings that end the text (include_stop: the one found stays in it);
        stop_at_eot: the tokenizer's end-of-sequence ids end it; stop_token_ids: more tokens
        that end it, whatever stop_at_eot says (a chat template's end of turn). A token that
        ends the text adds nothing to it."""
        self.tokenizer, self.include_stop = tokenizer, include_stop
        self.end_ids = set(stop_token_ids) | (set(eos_token_ids(tokenizer)) if stop_at_eot else set())
        self.stops = [StopString(s) for s in stops]  # each reads every new character once
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text, self.tokens, self.done = "", 0, False

    def add(self, token):
        if token in self.end_ids:
            self.done = True
            return
        self.tokens += 1
        piece = self.decoder.decode(self.tokenizer.decode_single_token_bytes(token))
        start = len(self.text)
        self.text += piece
        # where each stop string's first match begins, if this piece completed one
        hits = [(start + end - len(s.stop), start + end) for s in self.stops
                if (end := s.feed(piece)) is not None]
        if hits:
            begin, end = min(hits)  # the first stop string found, and where it ends
            self.text = self.text[:end if self.include_stop else begin]
            self.done = True

    def finish(self):
        """No token will follow (the row reached its length): what was held back as the
        possible start of a stop string is text after all, and ready() now shows it."""
        self.done = True

    def ready(self):
        """How many characters can be shown now: all but the end of the text that is the
        start of a stop string."""
        if self.done:
            return len(self.text)
        return len(self.text) - max((s.matched for s in self.stops), default=0)


# ---------------------------------------------------------------------------- stop strings

@functools.lru_cache(maxsize=16)
def longest_borders(stop):
    """border[i]: the length of the longest proper prefix of stop[:i + 1] that is also a
    suffix of it, where a partial match can carry on after a mismatch. O(len(stop)), once
    per string: a request's n samples (and generate.py's rows) share one table, not n."""
    border = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = border[k - 1]
        if stop[i] == stop[k]:
            k += 1
        border[i] = k
    return tuple(border)  # shared by every sample: read-only


class StopString:
    """One stop string, matched against text fed piece by piece."""

    def __init__(self, stop):
        if not stop:
            raise ValueError("a stop string must not be empty")
        self.stop, self.border, self.matched = stop, longest_borders(stop), 0

    def feed(self, piece):
        """Read `piece`; returns the index in it just past the first complete match, or None."""
        for i, char in enumerate(piece):
            while self.matched and char != self.stop[self.matched]:
                self.matched = self.border[self.matched - 1]
            if char == self.stop[self.matched]:
                self.matched += 1
            if self.matched == len(self.stop):
                return i + 1
        return None
