"""
tiktoken tokenizers, built and checked in one place: a checkpoint's own (its ranks carried
inside), one of tiktoken's named encodings, or one assembled from parts (plumbing/hf.py's
GPT-2-style BPE from a Hugging Face directory). Nothing is fetched from the network.

After these checks a tokenizer can encode any text and decode every id below its size:
every byte is a token, ranks are unique, ids run 0..n-1 without gaps, an end-of-text token
exists, and a sample of many scripts survives encode -> decode (check_round_trip, which
plumbing/hf_tokenizer.py's tokenizers pass too).
"""

import regex  # tiktoken's own dependency: the regex dialect its patterns are written in
import tiktoken

from plumbing.script import CheckpointError, short_repr

EOT = "<|endoftext|>"
# Text a tokenizer must round-trip (encode_ordinary, then decode) before it is used: every
# script family and whitespace kind a prompt may hold, and the end-of-text marker as
# plain text. A pattern that skips some characters (tiktoken drops what it does not
# match) or a rank table that cannot encode a byte fails here instead of mid-generation.
ROUND_TRIP_SAMPLE = ("ROMEO:\nBut soft, what light through yonder window breaks?  It's 1597!\n"
                     "Café naïve Ælfred Øresund ß İ ﬁ, Привет, Ελλάδα, עברית, العربية, हिन्दी, "
                     "汉字かな한국어, emoji 🎭👑🗡️ 🇬🇧 👨‍👩‍👧\t tabs\r\n\x00\x7f\u200b\ufeff "
                     f"{EOT} <|x|> 'll 've 're 3.14 1,000\n\n\n  ")
PATTERN_TIMEOUT_S = 1.0  # a pattern that needs longer than this for ~300 characters would
                         # backtrack for minutes on a real prompt


def check_pattern(pat_str, source):
    """The pre-tokenisation regex: a string that compiles (with `regex`, the dialect
    tiktoken's patterns are written in) and splits the sample into non-empty pieces that
    cover it. tiktoken's Rust core panics on an empty match and silently drops text that
    no piece covers; both are caught here, before tiktoken sees the pattern."""
    if not isinstance(pat_str, str) or not pat_str:
        raise CheckpointError(f"{source}: the tokenizer's pat_str must be a non-empty regex string, "
                              f"got {short_repr(pat_str)}")
    try:
        pieces = list(regex.finditer(pat_str, ROUND_TRIP_SAMPLE, timeout=PATTERN_TIMEOUT_S))
    except (regex.error, TimeoutError, RecursionError, MemoryError, ValueError, OverflowError) as e:
        raise CheckpointError(f"{source}: the tokenizer's pat_str is not a usable regex "
                              f"({type(e).__name__}: {str(e)[:80]})") from None
    end = 0
    for piece in pieces:
        if piece.start() != end or piece.end() == piece.start():
            problem = "matches empty text" if piece.end() == piece.start() else "skips characters"
            raise CheckpointError(f"{source}: the tokenizer's pat_str {problem} (at "
                                  f"{ROUND_TRIP_SAMPLE[end:end + 10]!r}): text would be lost")
        end = piece.end()
    if end != len(ROUND_TRIP_SAMPLE):
        raise CheckpointError(f"{source}: the tokenizer's pat_str skips characters "
                              f"(at {ROUND_TRIP_SAMPLE[end:end + 10]!r}): text would be lost")


def check_special_tokens(special_tokens, n_ranks, source):
    """Special tokens: {name: id}, ids after the ranks, no two alike, one of them EOT."""
    if not isinstance(special_tokens, dict):
        raise CheckpointError(f"{source}: the tokenizer's special_tokens must be a dict "
                              f"{{name: id}}, got {short_repr(special_tokens)}")
    for name, token_id in special_tokens.items():
        if not isinstance(name, str) or not name or type(token_id) is not int or token_id < 0:
            raise CheckpointError(f"{source}: special token {short_repr(name)}: "
                                  f"{short_repr(token_id)} is not a name and an integer id >= 0")
        if token_id < n_ranks:
            raise CheckpointError(f"{source}: special token {name!r} has id {token_id}, "
                                  f"which is already the rank of an ordinary token (0..{n_ranks - 1})")
    if len(set(special_tokens.values())) != len(special_tokens):
        raise CheckpointError(f"{source}: two special tokens share an id")
    if EOT not in special_tokens:
        # Generation starts an empty prompt from it and stops at it; --score puts it before
        # the text, as the model was trained to see documents begin.
        raise CheckpointError(f"{source}: the tokenizer has no {EOT} token; add one to its "
                              f"special tokens (e.g. {EOT!r}: {n_ranks})")


def check_contiguous(ids, source):
    """Every id below n_vocab must decode: the model may emit any of them, and a tokenizer
    raises on an id that has no token. ids: the tokenizer's ids (ordinary and special)."""
    ids = set(ids)
    gap = next((i for i in range(len(ids)) if i not in ids), None)
    if gap is not None:
        raise CheckpointError(f"{source}: the tokenizer has no token with id {gap} but ids up to "
                              f"{max(ids)}; ids must run 0..n-1 so that every id decodes")


def build_encoding(name, pat_str, ranks, special_tokens, source):
    """The one place a tiktoken.Encoding is constructed from parts (a checkpoint's spec or
    a Hugging Face directory's files), after every check above, and a round trip."""
    if not isinstance(name, str):
        raise CheckpointError(f"{source}: the tokenizer's name must be a string, got {short_repr(name)}")
    missing_byte = next((b for b in range(256) if bytes([b]) not in ranks), None)
    if missing_byte is not None:
        raise CheckpointError(f"{source}: the tokenizer has no token for byte {missing_byte}, "
                              "so it cannot encode every text")
    check_special_tokens(special_tokens, len(ranks), source)
    check_contiguous([*ranks.values(), *special_tokens.values()], source)
    check_pattern(pat_str, source)
    try:
        encoding = tiktoken.Encoding(name=name, pat_str=pat_str, mergeable_ranks=ranks,
                                     special_tokens=special_tokens)
    except (ValueError, TypeError, OverflowError) as e:  # a regex tiktoken's dialect refuses
        raise CheckpointError(f"{source}: tiktoken cannot build this tokenizer "
                              f"({str(e).splitlines()[0][:100] if str(e) else type(e).__name__})") from None
    check_round_trip(encoding, source)
    return encoding


def check_round_trip(encoding, source, cause="its pattern and ranks do not fit together",
                     allow_dummy_prefix=False):
    """Every sample text must come back from encode_ordinary, then decode: any script, any
    whitespace, emoji, control characters. A SentencePiece tokenizer puts a space before
    a text (its 'dummy prefix'); that space is what the model reads, and with
    allow_dummy_prefix it is allowed for. cause: the likely reason, for the message."""
    prefix = encoding.decode(encoding.encode_ordinary("a"))[:-1] if allow_dummy_prefix else ""
    if (prefix not in ("", " ")
            or encoding.decode(encoding.encode_ordinary(ROUND_TRIP_SAMPLE)) != prefix + ROUND_TRIP_SAMPLE):
        raise CheckpointError(f"{source}: the tokenizer does not give back the text it encodes ({cause})")


def encoding_from_spec(spec, source):
    """A tiktoken.Encoding from a checkpoint's 'tokenizer' entry, never from the network.

    spec: {'mergeable_ranks': [bytes, ...] (list index = rank), 'pat_str', 'special_tokens':
    {name: id}, 'name'} for a tokenizer carried inside, {'encoding': NAME} for one of
    tiktoken's, or None (or {}) for GPT-2's, which nanoGPT-style checkpoints use."""
    if not spec:
        spec = {"encoding": "gpt2"}
    if not isinstance(spec, dict):
        raise CheckpointError(f"{source}: the tokenizer entry is a {type(spec).__name__}, expected a dict")
    if "mergeable_ranks" in spec:
        return encoding_from_ranks(spec, source)
    if "encoding" in spec:
        return named_encoding(spec["encoding"], source)
    raise CheckpointError(f"{source}: the tokenizer entry has neither 'mergeable_ranks' nor "
                          f"'encoding' (keys: {short_repr(list(spec)[:5])})")


def encoding_from_ranks(spec, source):
    tokens = spec["mergeable_ranks"]
    if not isinstance(tokens, list) or not all(isinstance(t, bytes) and t for t in tokens):
        raise CheckpointError(f"{source}: the tokenizer's mergeable_ranks must be a list of "
                              f"non-empty bytes (index = rank), got {short_repr(tokens)}")
    ranks = {token: rank for rank, token in enumerate(tokens)}
    if len(ranks) != len(tokens):
        duplicate = next(t for i, t in enumerate(tokens) if ranks[t] != i)
        raise CheckpointError(f"{source}: the tokenizer lists token {short_repr(duplicate)} twice")
    return build_encoding(spec.get("name", "bundled"), spec.get("pat_str"), ranks,
                          spec.get("special_tokens", {}), source)


def named_encoding(name, source):
    """One of tiktoken's encodings (tiktoken downloads them on first use: offline, from
    TIKTOKEN_CACHE_DIR), held to the same rules as a carried tokenizer."""
    if not isinstance(name, str) or name not in tiktoken.list_encoding_names():
        raise CheckpointError(f"{source}: unknown tiktoken encoding {short_repr(name)} "
                              f"(known: {', '.join(tiktoken.list_encoding_names())})")
    try:
        encoding = tiktoken.get_encoding(name)
    except Exception as e:  # tiktoken downloads on first use; here that fails in many ways
        cause = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise CheckpointError(
            f"{source}: needs tiktoken encoding '{name}', which could not be loaded offline ({cause}); "
            "copy tiktoken's cache for it to a folder and set TIKTOKEN_CACHE_DIR to that folder") from None
    check_special_tokens(encoding._special_tokens, len(encoding._mergeable_ranks), source)
    check_contiguous([*encoding._mergeable_ranks.values(), *encoding._special_tokens.values()], source)
    return encoding
