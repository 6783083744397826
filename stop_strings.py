"""
Finding stop strings in text that arrives a piece at a time, in time linear in the text.

Searching the whole tail of the text again at every step costs O(len(stop)) per step, and
asking "does the text end with the first n characters of the stop string?" for every n
costs O(len(stop)^2), which a long --stop string turned into seconds per token. The
Knuth-Morris-Pratt automaton below reads each new character once (amortised O(1)): it
keeps `matched`, the length of the longest start of the stop string that the text ends
with, which is also exactly how much text must be held back from printing, because the
next piece may complete the match.
"""


def longest_borders(stop):
    """border[i]: the length of the longest proper prefix of stop[:i + 1] that is also a
    suffix of it, where a partial match can carry on after a mismatch. O(len(stop))."""
    border = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = border[k - 1]
        if stop[i] == stop[k]:
            k += 1
        border[i] = k
    return border


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
