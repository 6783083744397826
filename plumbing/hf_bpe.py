"""
A GPT-2-style tokenizer of a Hugging Face directory (vocab.json + merges.txt, or the
tokenizer.json newer transformers save) as a tiktoken.Encoding, built offline and checked
by plumbing/tokenizer.py like every tiktoken tokenizer. The vocabulary and merges must
fit together and be numbered in merge order; what does not is named in one line.
"""

from plumbing.files import PYTHON_OBJECTS_PER_FILE_BYTE, check_file_fits, read_json
from plumbing.hf_tokenizer import byte_to_char
from plumbing.script import CheckpointError, short_repr
from plumbing.tokenizer import EOT, build_encoding

# GPT-2's pre-tokenisation regex, as HF's byte-level tokenizer hard-codes it and as tiktoken
# writes it: the same splits. A BPE tokenizer with any other regex is not GPT-2-compatible.
GPT2_PATTERNS = (r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
                 r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def read_tokenizer_files(path):
    """(vocab, merges, declared special names, add_prefix_space) as the files hold them
    (checked in encoding_from_bpe), from vocab.json + merges.txt, or from tokenizer.json
    (what newer transformers save); None when the directory has neither."""
    if (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
        vocab = read_json(path / "vocab.json")
        merges_file = path / "merges.txt"
        check_file_fits(merges_file, PYTHON_OBJECTS_PER_FILE_BYTE)
        try:
            lines = merges_file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{merges_file}: not readable UTF-8 text ({type(e).__name__})") from None
        merges = [line.split() for line in lines if line.strip() and not line.startswith("#version")]
        config_file = path / "tokenizer_config.json"
        config = read_json(config_file) if config_file.is_file() else {}
        if not isinstance(config, dict):
            raise CheckpointError(f"{config_file}: holds a {type(config).__name__}, expected a JSON object")
        return vocab, merges, declared_specials(config), config.get("add_prefix_space", False)
    if (path / "tokenizer.json").is_file():
        return parse_tokenizer_json(read_json(path / "tokenizer.json"), path / "tokenizer.json")
    return None


def declared_specials(config):
    """Token names tokenizer_config.json declares special (bos/eos/unk/pad, the additional
    ones, added_tokens_decoder): strings, or {'content': string}."""
    def content(value):
        return value.get("content") if isinstance(value, dict) else value
    named = [config.get(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")]
    extra = config.get("additional_special_tokens")
    decoder = config.get("added_tokens_decoder")
    named += extra if isinstance(extra, list) else []
    named += list(decoder.values()) if isinstance(decoder, dict) else []
    return {name for name in map(content, named) if isinstance(name, str)}


def parse_tokenizer_json(tok, source):
    """(vocab, merges, special names, add_prefix_space) from tokenizer.json's structure."""
    model = tok.get("model") if isinstance(tok, dict) else None
    pre = tok.get("pre_tokenizer") if isinstance(tok, dict) else None
    if (not isinstance(model, dict) or not isinstance(pre, dict) or model.get("type") != "BPE"
            or pre.get("type") != "ByteLevel" or pre.get("use_regex", True) is not True):
        raise CheckpointError(f"{source}: not GPT-2's byte-level BPE (model.type BPE, "
                              "pre_tokenizer.type ByteLevel)")
    added = tok.get("added_tokens", [])
    if not isinstance(added, list) or not all(isinstance(t, dict) and isinstance(t.get("content"), str)
                                              and type(t.get("id")) is int for t in added):
        raise CheckpointError(f"{source}: added_tokens must be a list of {{'content': str, 'id': int}}")
    vocab = model.get("vocab")
    if not isinstance(vocab, dict):
        raise CheckpointError(f"{source}: model.vocab must be a JSON object {{token: id}}")
    merges = model.get("merges")
    if not isinstance(merges, list):
        raise CheckpointError(f"{source}: model.merges must be a list")
    merges = [m.split(" ") if isinstance(m, str) else m for m in merges]
    specials = {t["content"]: t["id"] for t in added}
    return {**vocab, **specials}, merges, set(specials), pre.get("add_prefix_space", False)


def encoding_from_bpe(vocab, merges, specials, name, source):
    """A tiktoken.Encoding equal to a GPT-2-style BPE given as HF stores it, or one line
    saying where the files do not fit together.

    tiktoken stores BPE as token bytes -> rank and merges the adjacent pair whose joined
    bytes rank lowest; HF stores merges in priority order. They agree when ids are ranks:
    the 256 byte tokens, then merge i's result at a higher id than merge i-1's, which is how
    GPT-2's files (and any BPE trained in order) are laid out; other layouts are refused.
    The merges must produce the vocabulary: an entry that is neither a byte, nor a merge's
    result, nor declared special (or <|endoftext|>) means the files do not belong together."""
    if not isinstance(vocab, dict) or not all(isinstance(t, str) and t and type(i) is int and i >= 0
                                              for t, i in vocab.items()):
        raise CheckpointError(f"{source}: the vocabulary must map token strings to ids >= 0, "
                              f"got {short_repr(vocab)}")
    if len(set(vocab.values())) != len(vocab):
        raise CheckpointError(f"{source}: two vocabulary entries share an id")
    to_byte = {c: b for b, c in byte_to_char().items()}
    ranks = {}
    for b, c in byte_to_char().items():
        if c not in vocab:
            raise CheckpointError(f"{source}: the vocabulary has no token for byte {b} ({c!r})")
        ranks[bytes([b])] = vocab[c]
    produced, last_id = set(to_byte), max(ranks.values())  # token strings that are accounted for
    for merge in merges:
        if (not isinstance(merge, (list, tuple)) or len(merge) != 2
                or not all(isinstance(part, str) and part for part in merge)):
            raise CheckpointError(f"{source}: merge {short_repr(merge)} is not two tokens")
        a, b = merge
        missing = next((t for t in (a, b, a + b) if t not in vocab), None)
        if missing is not None:
            raise CheckpointError(f"{source}: merge {a!r} + {b!r} uses or makes {missing!r}, which "
                                  "is not in the vocabulary: the vocabulary and merges disagree")
        if a + b in produced:
            raise CheckpointError(f"{source}: two merges make {a + b!r}; tiktoken cannot reproduce that")
        if vocab[a + b] <= last_id:
            raise CheckpointError(f"{source}: tokens are not numbered in merge order "
                                  f"({a + b!r}); tiktoken cannot reproduce it")
        ranks[bytes(to_byte[ch] for ch in a + b)] = last_id = vocab[a + b]
        produced.add(a + b)
    special = {t: i for t, i in vocab.items() if t not in produced}
    unexplained = next((t for t in special if t not in specials and t != EOT), None)
    if unexplained is not None:
        raise CheckpointError(f"{source}: vocabulary entry {unexplained!r} (id {vocab[unexplained]}) "
                              "is made by no merge and declared special by no file: "
                              "the vocabulary and merges do not belong together")
    return build_encoding(name, GPT2_PATTERNS[0], ranks, special, source)


def tokenizer_from_files(path):
    """The directory's own GPT-2-style BPE tokenizer as a tiktoken.Encoding, or None when
    it has no tokenizer files."""
    found = read_tokenizer_files(path)
    if found is None:
        return None
    vocab, merges, specials, prefix_space = found
    if prefix_space is not False:  # HF would prepend a space before encoding; tiktoken cannot
        raise CheckpointError(f"{path}: the tokenizer sets add_prefix_space, GPT-2's does not")
    return encoding_from_bpe(vocab, merges, specials, f"{path.name}-bpe", path)
