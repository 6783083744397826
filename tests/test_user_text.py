"""plumbing/user_text.py, user text to token ids: the split by pieces gives exactly
tiktoken's ids (hypothesis over random text, with the split forced on, under four patterns:
ours and tiktoken's GPT-2, cl100k and o200k), a million whitespace characters encode with
no panic, and a lone surrogate is one line."""

import pytest
import tiktoken
from hypothesis import given, settings, strategies as st
from tiktoken_ext import openai_public

from checkpoints.tokenizer import GPT2_PAT
from plumbing.user_text import TextError, check_text, encode_text

# merges that make whitespace, letters and digits interesting to split: runs of a character
# (2, 4 .. 64 long), a space before a letter, a newline after spaces
MERGED = [c * k for c in (b" ", b"\n", b"\t", b"a", b"1") for k in (2, 4, 8, 16, 32, 64)]
MERGED += [b" a", b" \n", b"\r\n", b"'s", b"ab", b" ab"]


def tiktoken_pattern(constructor):
    """The pat_str of one of tiktoken's own encodings, without downloading its ranks."""
    original = openai_public.load_tiktoken_bpe
    openai_public.load_tiktoken_bpe = lambda *args, **kw: {}
    try:
        return constructor()["pat_str"]
    finally:
        openai_public.load_tiktoken_bpe = original


PATTERNS = {"ours": GPT2_PAT, "gpt2": openai_public.r50k_pat_str,
            "cl100k": tiktoken_pattern(openai_public.cl100k_base),
            "o200k": tiktoken_pattern(openai_public.o200k_base)}


def encoding(pattern, merged=MERGED):
    ranks = {bytes([b]): b for b in range(256)}
    for token in merged:
        ranks[token] = len(ranks)
    return tiktoken.Encoding("test", pat_str=pattern, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": len(ranks)})


ENCODINGS = {name: encoding(p) for name, p in PATTERNS.items()}
# every kind of whitespace (Unicode's, and Python's \x1c-\x1f that are not Unicode's), letters
# of several scripts, digits, marks, punctuation, the contractions' pieces, emoji
TRICKY = list(" \n\r\t\x0b\x0c\x1c\x1f\x85\xa0\u1680\u2028\u2029\u3000\u200b\ufeff"
              "aAzé\u0301ßИ字1٣½'sSltvdm!?.,-_/\\\"$") + ["\U0001f3ad", "<|endoftext|>"]
texts = st.lists(st.sampled_from(TRICKY) | st.characters(exclude_categories=["Cs"]),
                 max_size=40).map("".join)


@settings(max_examples=400, deadline=None)
@given(name=st.sampled_from(list(ENCODINGS)), text=texts)
def test_split_by_pieces_gives_tiktokens_ids(name, text):
    enc = ENCODINGS[name]
    # safe_run=1: any whitespace at all takes the split (by default only runs of 50,000 do)
    assert encode_text(enc, text, safe_run=1) == enc.encode_ordinary(text)


@pytest.mark.parametrize("name", ["ours", "cl100k"])
@pytest.mark.parametrize("text", [" " * 1_000_000 + "ROMEO", "x\n" + "\n \t" * 400_000,
                                  "\u3000" * 1_000_000])
def test_a_million_whitespace_characters_encode_without_a_panic(name, text):
    enc = encoding(PATTERNS[name], merged=[])  # bytes only: merging a million-byte piece takes seconds
    assert enc.decode(encode_text(enc, text)) == text


def test_a_run_tiktoken_can_split_gives_its_ids():
    """Runs long enough to take the split, short enough for tiktoken: the same ids."""
    enc = ENCODINGS["ours"]
    for text in (" " * 60_000 + "a", "b" + "\n" * 70_000 + " c", "\t " * 40_000):
        assert encode_text(enc, text) == enc.encode_ordinary(text)


@pytest.mark.parametrize("text,place", [("\ud800", 1), ("ab\udfffc", 3), ("caf\udce9", 4)])
def test_a_lone_surrogate_is_refused_with_its_place(text, place):
    with pytest.raises(TextError, match=f"character {place} is \\\\u[0-9a-f]{{4}}, half of"):
        encode_text(ENCODINGS["ours"], text)


def test_ordinary_text_is_accepted():
    check_text("ROMEO: 汉字 🎭 \U0001f3ad")
