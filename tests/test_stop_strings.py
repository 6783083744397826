"""Stop strings (plumbing/text_stream.py: StopString, SampleText): the linear-time matcher
finds what a plain search finds, holds back exactly the text that may still become a stop
string, and does not slow down with the stop string's length."""

from hypothesis import given, settings, strategies as st

from plumbing.text_stream import SampleText
from plumbing.text_stream import StopString


class CharTokenizer:
    """Token i is the one-byte character chr(i); EOT is 999."""
    eot_token = 999

    def decode_single_token_bytes(self, token):
        return chr(token).encode("utf-8")


def reference(pieces, stops):
    """The plain definition: cut at the earliest occurrence of any stop in the text so far
    (checked after each piece); otherwise hold back the longest end of the text that is a
    proper start of a stop string."""
    text = ""
    for piece in pieces:
        text += piece
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            return text[:min(hits)], True, len(text[:min(hits)])
    held = max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
    return text, False, len(text) - held


@settings(max_examples=400, deadline=None)
@given(st.lists(st.text("abc", min_size=1, max_size=3), max_size=30),
       st.lists(st.text("abc", min_size=1, max_size=6), max_size=3))
def test_matches_the_plain_definition(pieces, stops):
    sample = SampleText(CharTokenizer(), stops, stop_at_eot=False)
    for piece in pieces:
        for char in piece:
            if not sample.done:
                sample.add(ord(char))
    text, done, ready = reference("".join(pieces), stops)
    # the reference checks after whole pieces; SampleText after each character (a token
    # here), which finds the same earliest match
    assert (sample.text, sample.done, sample.ready()) == (text, done, ready)


@settings(max_examples=200, deadline=None)
@given(st.text("ab", min_size=1, max_size=8), st.text("ab", max_size=40))
def test_stop_string_feed_finds_the_first_match(stop, text):
    matcher = StopString(stop)
    end = matcher.feed(text)
    first = text.find(stop)
    assert end == (first + len(stop) if first >= 0 else None)


def test_a_million_character_stop_string():
    """Holding back used to test every prefix of the stop string at every step, O(L^2):
    400 ms a token for 100,000 characters. The automaton reads each character once."""
    stop = "ab" * 500_000 + "!"
    sample = SampleText(CharTokenizer(), [stop], stop_at_eot=False)
    for i in range(20_000):
        sample.add(ord("ab"[i % 2]))
        assert sample.ready() == 0  # all of it may still be the start of the stop string
    sample.add(ord("x"))
    assert sample.ready() == 20_001 and not sample.done


def test_include_stop_str_in_output_keeps_the_first_stop_found():
    """vLLM's include_stop_str_in_output: the text ends with the stop string that ended it
    (the first found: "cd" ends before "bcde" would)."""
    for include, expected in ((False, "ab"), (True, "abcd")):
        sample = SampleText(CharTokenizer(), ["bcde", "cd"], stop_at_eot=False, include_stop=include)
        for char in "abcdef":
            if not sample.done:
                sample.add(ord(char))
        assert (sample.text, sample.done) == (expected, True)
