"""
A Hugging Face tokenizer.json (Llama, Mistral, Qwen, SmolLM, TinyLlama), read with the
`tokenizers` library and presented as the part of a tiktoken Encoding the rest of our code
uses: encode_ordinary (a user's text: "<|eot_id|>" in it is plain text, as in tiktoken),
encode with allowed_special="all" (a rendered chat template: its markers are the special
tokens they name), special_tokens_set, encode_single_token, decode_single_token_bytes,
decode, n_vocab, eot_token, name; and what a tiktoken Encoding does not have,
bos_token_id and eos_token_ids (plumbing/user_text.py's as_prompt and
plumbing/text_stream.py's eos_token_ids read them for every tokenizer).

Two kinds of BPE are what these models ship, and each token's bytes (what a stream of tokens
prints, one token at a time) come from the decoder tokenizer.json names:
  byte-level (Llama 3, Qwen2, SmolLM): GPT-2's table, every byte written as a visible
      character ('Ġ' for a space): the token's characters mapped back to bytes;
  SentencePiece-style with byte fallback (Llama 2, TinyLlama, Mistral): '▁' for a space,
      and <0xHH> tokens for bytes no other token covers.
Special tokens decode as their text. A decoder of any other kind is refused in one line.
"""

import json
import re

from plumbing.files import PYTHON_OBJECTS_PER_FILE_BYTE, check_file_fits
from plumbing.script import CheckpointError, short_repr
from plumbing.tokenizer import check_contiguous, check_round_trip

BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SENTENCEPIECE_SPACE = "\u2581"  # '▁'


def byte_to_char():
    """GPT-2's byte -> character table for vocab.json and merges.txt. Those files are text,
    so each of the 256 bytes gets a visible character: printable bytes stand for themselves,
    the rest (controls, space, NBSP, soft hyphen) are moved, in order, to chr(256), chr(257)...
    That is why a space appears as 'Ġ' (chr(288)) in GPT-2's vocabulary."""
    table, moved = {}, 0
    for b in range(256):
        if chr(b).isprintable() and chr(b) != " ":
            table[b] = chr(b)
        else:
            table[b] = chr(256 + moved)
            moved += 1
    return table


class HFTokenizer:
    """tiktoken's Encoding interface over a tokenizers.Tokenizer. bos_token_id: the token a
    text starts with when the tokenizer's config says so (None: nothing is added);
    eot_token: what an empty prompt starts from and --score puts before a text (the BOS, or
    an end-of-text token for a model without one); eos_token_ids: every id that ends a text."""

    def __init__(self, tokenizer, name, token_bytes, bos_token_id, eot_token, eos_token_ids):
        self.tokenizer, self.name, self.token_bytes = tokenizer, name, token_bytes
        self.bos_token_id, self.eot_token, self.eos_token_ids = bos_token_id, eot_token, eos_token_ids
        self.n_vocab = len(token_bytes)
        # a second copy that reads special tokens' text as text (the library's switch is a
        # setting of the object, and the server encodes from several threads at once)
        self.ordinary = type(tokenizer).from_str(tokenizer.to_str())
        self.ordinary.encode_special_tokens = True
        self.special_tokens_set = {t.content for t in tokenizer.get_added_tokens_decoder().values()
                                   if t.special}

    def encode_ordinary(self, text):
        """The text's ids, no BOS or EOS added, special tokens' text as plain text."""
        return self.ordinary.encode(text, add_special_tokens=False).ids

    def encode(self, text, allowed_special="all"):
        """The text's ids, no BOS added, the special tokens it spells as themselves (a chat
        template's markers): tiktoken's encode(text, allowed_special="all"), the one way
        our code calls it."""
        if allowed_special != "all":
            raise NotImplementedError("HFTokenizer.encode reads every special token; "
                                      "encode_ordinary reads none")
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_single_token(self, text):
        found = self.tokenizer.token_to_id(text)
        if found is None:
            raise KeyError(text)
        return found

    def decode_single_token_bytes(self, token):
        return self.token_bytes[token]

    def decode(self, tokens):
        return b"".join(self.token_bytes[t] for t in tokens).decode("utf-8", errors="replace")


def token_bytes_table(tokenizer, decoder, source):
    """[bytes of id 0, of id 1, ...]: each token's bytes, as the decoder would write them."""
    specials = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    by_id = {}
    for text, i in vocab.items():
        by_id.setdefault(i, text)
    check_contiguous(by_id, source)
    n_vocab = len(by_id)
    kind = decoder_kind(decoder, source)
    to_byte = {c: b for b, c in byte_to_char().items()}
    table = []
    for i in range(n_vocab):
        text = by_id[i]
        if i in specials:
            table.append(specials[i].encode("utf-8"))
        elif kind == "byte-level":
            if any(c not in to_byte for c in text):
                raise CheckpointError(f"{source}: token {i} ({short_repr(text)}) is not written in "
                                      "the byte-level alphabet its decoder expects")
            table.append(bytes(to_byte[c] for c in text))
        elif BYTE_TOKEN.fullmatch(text):
            table.append(bytes([int(BYTE_TOKEN.fullmatch(text).group(1), 16)]))
        else:
            table.append(text.replace(SENTENCEPIECE_SPACE, " ").encode("utf-8"))
    return table


def decoder_kind(decoder, source):
    """'byte-level' or 'sentencepiece', from tokenizer.json's decoder; one line otherwise."""
    if isinstance(decoder, dict) and decoder.get("type") == "ByteLevel":
        return "byte-level"
    steps = decoder.get("decoders") if isinstance(decoder, dict) and decoder.get("type") == "Sequence" else None
    if isinstance(steps, list) and all(isinstance(d, dict) for d in steps):
        types = [d.get("type") for d in steps]
        spaces = any(d.get("type") == "Metaspace" or (d.get("type") == "Replace"
                     and d.get("pattern", {}).get("String") == SENTENCEPIECE_SPACE) for d in steps)
        if spaces and set(types) <= {"Replace", "ByteFallback", "Fuse", "Strip", "Metaspace"}:
            return "sentencepiece"
        if types and set(types) <= {"ByteLevel"}:
            return "byte-level"
    raise CheckpointError(f"{source}: the tokenizer's decoder {short_repr(decoder)} is neither "
                          "byte-level BPE nor SentencePiece-style BPE; only those two are supported")


def read_tokenizer(path, special_ids, tokenizer_config):
    """The HFTokenizer of a model directory: tokenizer.json, with what tokenizer_config.json
    (a dict) and the model's configs say of the special tokens. special_ids: (bos id or
    None, [eos ids]) from config.json and generation_config.json."""
    file = path / "tokenizer.json"
    if not file.is_file():
        raise CheckpointError(f"{path}: no tokenizer.json (this model family's tokenizer is read "
                              "from it; tokenizer.model alone is not supported)")
    check_file_fits(file, PYTHON_OBJECTS_PER_FILE_BYTE)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise CheckpointError(f"{path}: reading tokenizer.json needs the tokenizers package "
                              "(pip install -r requirements.txt)") from None
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as e:  # the library's own parse errors, one line of them
        raise CheckpointError(f"{file}: not a tokenizer the tokenizers library reads "
                              f"({str(e).splitlines()[0][:100] if str(e) else type(e).__name__})") from None
    if not tokenizer.get_vocab(with_added_tokens=False):  # the library's encode then raises
        raise CheckpointError(f"{file}: the vocabulary (model.vocab) is empty: no text can be encoded")
    decoder = json.loads(tokenizer.to_str()).get("decoder")
    table = token_bytes_table(tokenizer, decoder, file)

    def token_id(value, what):
        """The id of a token named in tokenizer_config.json (a string or {'content': ...})."""
        text = value.get("content") if isinstance(value, dict) else value
        if text is None:
            return None
        found = tokenizer.token_to_id(text) if isinstance(text, str) else None
        if found is None:
            raise CheckpointError(f"{path}: tokenizer_config.json's {what} {short_repr(text)} is "
                                  "not a token of tokenizer.json")
        return found

    config_bos, config_eos = special_ids
    bos = token_id(tokenizer_config.get("bos_token"), "bos_token")
    bos = config_bos if bos is None else bos
    eos_ids = [*config_eos, token_id(tokenizer_config.get("eos_token"), "eos_token")]
    eos_ids = tuple(dict.fromkeys(i for i in eos_ids if i is not None))  # in order, once each
    for i in eos_ids + ((bos,) if bos is not None else ()):
        if not 0 <= i < len(table):
            raise CheckpointError(f"{path}: special token id {i} is outside the tokenizer's "
                                  f"{len(table)} tokens")
    adds_bos = tokenizer_config.get("add_bos_token", adds_leading_token(tokenizer, bos, file))
    if type(adds_bos) is not bool:
        raise CheckpointError(f"{path}: tokenizer_config.json's add_bos_token must be true or false")
    if adds_bos and bos is None:
        raise CheckpointError(f"{path}: tokenizer_config.json sets add_bos_token but names no bos_token")
    endoftext = tokenizer.token_to_id("<|endoftext|>")
    eot = next((i for i in (bos, endoftext, *eos_ids) if i is not None), None)
    if eot is None:
        raise CheckpointError(f"{path}: the tokenizer has no beginning- or end-of-text token "
                              "(bos_token, eos_token): a text cannot be started or ended")
    encoding = HFTokenizer(tokenizer, path.name, table, bos if adds_bos else None, eot, eos_ids)
    check_round_trip(encoding, file, "a normalizer that changes text, or tokens the decoder cannot write",
                     allow_dummy_prefix=True)
    return encoding


def adds_leading_token(tokenizer, bos, source):
    """Whether tokenizer.json's post-processor puts `bos` before every text (Llama 3's
    template does; tokenizer_config.json's add_bos_token, when there is one, decides)."""
    try:
        with_specials = tokenizer.encode("a", add_special_tokens=True).ids
        without = tokenizer.encode("a", add_special_tokens=False).ids
    except Exception as e:  # the library's own errors (an unk_token not in the vocabulary)
        raise CheckpointError(f"{source}: the tokenizer cannot encode text "
                              f"({str(e).splitlines()[0][:100] if str(e) else type(e).__name__})") from None
    return bos is not None and with_specials[:1] == [bos] != without[:1]
