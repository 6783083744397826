"""
Text someone gave us, to token ids: the one way every command and the server encode a
prompt, a file to score or a request's text (encode_text), so that no input can make the
tokenizer fail in a way that is not one line of error; and a prompt as the model expects a
text to begin (prompt_tokens: after the tokenizer's beginning-of-text token when its config
adds one, as Llama's do).

Two inputs break tiktoken's encode_ordinary:
  - a lone surrogate (half of a UTF-16 pair: JSON's "\\ud800", or bytes that are not UTF-8
    reaching Python through the file system's escape) is not a character and has no UTF-8
    bytes; tiktoken raises UnicodeEncodeError. check_text refuses it, saying where it is.
  - a run of about a million whitespace characters: tiktoken splits text with a regular
    expression before its byte-pair merges, and GPT-2's `\\s+(?!\\S)` (whitespace not followed
    by a non-space) steps back over the whole run to find where it ends; the Rust engine
    (fancy-regex) gives up after a million steps and tiktoken panics (PanicException, not
    even an Exception: it would drop the server's connection and end a command in a traceback).

For the second, text with a whitespace run of SAFE_RUN characters or more is split here
into the same pieces tiktoken's regular expression would make, with `regex` (the dialect
tiktoken's patterns are written in; plumbing/tokenizer.py tests every pattern with it),
and each piece goes through tiktoken's byte-pair merges alone, which is exactly what
tiktoken does after its own split: the same ids, at any length. Other text, every prompt a
person writes, goes to tiktoken whole (faster). tests/test_user_text.py checks the two
ways against each other on random text. A Hugging Face tokenizer.json (plumbing/hf_tokenizer.py,
the `tokenizers` library) splits such runs without trouble and is not split here.
"""

import functools
import re

import regex

# Whitespace characters in a row that tiktoken's own split handles with room to spare: it
# fails at about 1,000,000 (fancy-regex's backtracking limit; measured 999,121 OK, 1,000,000 not).
SAFE_RUN = 50_000
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class TextError(ValueError):
    """Text that cannot be encoded; the message says where and why, in one line."""


def check_text(text):
    """Refuse a lone surrogate, naming its place (the first character is 1)."""
    found = LONE_SURROGATE.search(text)
    if found:
        raise TextError(f"character {found.start() + 1:,} is \\u{ord(found.group()):04x}, half of "
                        "a UTF-16 surrogate pair and not a character; send the text as UTF-8")


def encode_text(tokenizer, text, safe_run=SAFE_RUN):
    """Token ids of text (no special tokens: "<|endoftext|>" in it is plain text), equal to
    tokenizer.encode_ordinary(text) wherever that succeeds. A tokenizer that is not
    tiktoken's (it has no pattern to split by) encodes the text itself."""
    check_text(text)
    pattern = getattr(tokenizer, "_pat_str", None)
    if pattern is None or not long_whitespace(safe_run).search(text):
        return tokenizer.encode_ordinary(text)
    ids, known = [], {}  # known: piece -> its ids (a long text repeats its pieces)
    for match in compiled(pattern).finditer(text):
        piece = match.group()
        if piece not in known:
            known[piece] = tokenizer._encode_single_piece(piece)  # the merges, no split
        ids += known[piece]
    return ids


def as_prompt(tokenizer, ids):
    """A text's ids as the model expects a text to begin: after the tokenizer's
    beginning-of-text token when its config adds one (Llama's <s> or <|begin_of_text|>:
    plumbing/hf_tokenizer.py), an empty text as the end-of-text token alone (how GPT-2
    starts a document). A tiktoken Encoding has no bos_token_id."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return [bos, *ids] if bos is not None else ids or [tokenizer.eot_token]


def prompt_tokens(tokenizer, text):
    """Token ids of a prompt: encode_text, then as_prompt."""
    return as_prompt(tokenizer, encode_text(tokenizer, text))


@functools.cache
def long_whitespace(safe_run):
    # Python's \s is a superset of the Unicode White_Space that tiktoken's \s means, so no
    # run that could fail is missed
    return re.compile(rf"\s{{{safe_run}}}")


@functools.lru_cache(maxsize=8)
def compiled(pattern):
    return regex.compile(pattern)


@functools.lru_cache(maxsize=8)
def longest_token_bytes(tokenizer):
    """The most bytes one token stands for (None for a tokenizer that cannot say): a text
    of more characters than context_len times this can never fit in the context."""
    try:
        return max(len(tokenizer.decode_single_token_bytes(t)) for t in range(tokenizer.n_vocab))
    except AttributeError:
        return None
