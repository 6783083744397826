"""
The one validation layer: every checkpoint, Hugging Face directory and tokenizer passes
through here before anything is built from it, whichever script (or the server) loads it.

After these checks a loader may trust that
  - a file it is about to read is a regular file whose (uncompressed) contents fit in memory;
  - a model config (GPT-2's or a Llama family's) has every field of the right type and in
    range, and the model it describes fits in this machine's memory (else the line says
    what it would cost);
  - weights have string keys and hold finite floating-point tensors of the expected shapes;
  - a tokenizer is a tiktoken BPE that can encode any text and decode every id below its
    size: every byte is a token, ranks are unique, ids run 0..n-1 without gaps, an
    end-of-text token exists, and a sample of many scripts survives encode -> decode.
Every failure is one CheckpointError line; nothing here builds a model or runs a pickle.
"""

import json
import math
import os
import re
import reprlib
import stat
import zipfile
from pathlib import Path

import regex  # tiktoken's own dependency: the regex dialect its patterns are written in
import tiktoken
import torch

from base_model import GPTConfig
from kv_quant import cache_bytes
from llama import ROPE_TYPES, LlamaConfig
from plumbing.script import UserError


class CheckpointError(UserError):
    """A checkpoint or tokenizer that cannot be used; the message is one line for the user."""


SHORT_REPR = reprlib.Repr()
SHORT_REPR.maxlevel, SHORT_REPR.maxstring, SHORT_REPR.maxother = 2, 40, 40


def short_repr(value):
    """repr() cut to a few dozen characters and levels: a value from a hostile file may be
    huge or nested a million deep, and an error message must stay one short line."""
    return SHORT_REPR.repr(value).replace("\n", " ")


# ---------------------------------------------------------------------------- memory

# Python objects unpickled or parsed from JSON take more room than their bytes in the file.
# The worst case is a container of empty containers: one or two bytes of pickle or JSON
# each, ~64 bytes of Python object (sys.getsizeof of [] or {}) plus an 8-byte pointer.
# Real files are ~10x (a vocab.json entry: a short str, an int, a dict slot).
PYTHON_OBJECTS_PER_FILE_BYTE = 40
# nn.Module bookkeeping of one transformer block, whatever its width: measured 36 KB
# (2,000 one-wide blocks, RSS), rounded up. Without it a "billion layers" of width 1
# would look cheap (25 parameters each) and take hours and terabytes to construct.
BYTES_PER_BLOCK_OBJECTS = 64 * 1024


def available_memory():
    """Bytes this process can still take: the kernel's MemAvailable (free memory plus
    caches it can drop), lowered to the container's limit when a cgroup sets one.
    Limits below use this, not a fixed number, so that they follow the machine."""
    available = math.inf  # an unknown platform: no refusal, the allocator decides
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f
                             if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        try:  # macOS and the BSDs have no /proc: their physical memory, all of it
            available = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            pass
    try:  # cgroup v2 (containers, CI runners): memory.max is "max" or a byte count
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return available


def max_text_bytes():
    """The most bytes of text (a prompt, a file to score) worth reading: each byte may become
    a character, a token id in a Python list (an int object and a pointer, ~36 bytes) and
    a tensor entry (8 bytes), ~48 bytes of memory at most (a byte-level tokenizer)."""
    return int(min(available_memory() / 48, 2 ** 62))


def format_bytes(n):
    if n < 1e9:
        return f"{n / 1e6:,.1f} MB"
    return f"{n / 1e9:,.1f} GB" if n < 1e15 else f"{n / 1e9:.3g} GB"


def check_fits_in_memory(needed, what, source):
    """Refuse up front what would exhaust the machine: what needs `needed` bytes."""
    available = available_memory()
    if needed > available:
        raise CheckpointError(f"{source}: {what} would need {format_bytes(needed)} of memory; "
                              f"{format_bytes(available)} is available")


def parameter_count(c):
    """Parameters of the model a config describes (base_model.GPT or llama.Llama), from the
    config alone (tests check it against num_params())."""
    return gpt_parameter_count(c) if c.family == "gpt" else llama_parameter_count(c)


def llama_parameter_count(c):
    """llama.Llama: per block, q and o (C x n_head*hd each), k and v (C x n_kv_head*hd
    each) and their biases with qkv_bias, the SwiGLU's three C x intermediate matrices, two
    RMSNorm weights of C (and of hd for q and k with qk_norm); the embedding, the output
    layer unless it is tied, the final RMSNorm."""
    C, q, kv = c.n_embd, c.n_head * c.head_dim, c.n_kv_head * c.head_dim
    per_block = (2 * C * q + 2 * C * kv + (q + 2 * kv if c.qkv_bias else 0)
                 + 3 * C * c.intermediate_size + 2 * C + (2 * c.head_dim if c.qk_norm else 0))
    return c.vocab_size * C * (1 if c.tie_embeddings else 2) + c.n_layer * per_block + C


def gpt_parameter_count(c):
    """base_model.GPT: per block, ln_1 and ln_2, c_attn (C x 3C), attn c_proj (C x C),
    c_fc (C x 4C), mlp c_proj (4C x C) = 12 C^2 weights, plus 13 C biases (or the 2 C
    LayerNorm weights without biases); wte and wpe; ln_f. lm_head is wte, tied."""
    C = c.n_embd
    norms_and_biases = 13 * C if c.bias else 2 * C
    return (c.vocab_size * C + c.context_len * C + c.n_layer * (12 * C * C + norms_and_biases)
            + (2 * C if c.bias else C))


def model_memory(c):
    """(bytes, what) to build and run a model of config c: fp32 weights (the load
    precision), the module objects, a whole-context prefill's causal mask (context_len^2
    bools) and one row's fp32 KV cache over the whole context (kv_quant.cache_bytes).
    Not the mask for the Llama family: their contexts run to 128k positions (a 16 GB mask),
    and a pass builds the mask of the tokens it feeds, never the whole context's."""
    weights = 4 * parameter_count(c) + c.n_layer * BYTES_PER_BLOCK_OBJECTS
    mask = c.context_len ** 2 if c.family == "gpt" else 0
    context = mask + cache_bytes(c, c.context_len, 1, "float32")
    what = (f"this model ({parameter_count(c):,} parameters: {format_bytes(weights)}; a "
            f"{c.context_len:,}-position context: {format_bytes(context)} of mask and KV cache)")
    return weights + context, what


def generation_memory(c, rows, kv_dtype):
    """Bytes that `rows` rows decoded together hold: each its KV cache over the whole
    context, its history of token ids and a row of fp32 logits."""
    per_row = cache_bytes(c, c.context_len, 1, kv_dtype) + 8 * c.context_len + 4 * c.vocab_size
    return rows * per_row


# ---------------------------------------------------------------------------- files

def check_input_file(path, what="checkpoint file"):
    """A Path to a regular file, or one line saying why not. An empty string is refused
    rather than read as '.': an unset shell variable must not silently change what runs."""
    if str(path) == "":
        raise CheckpointError(f"empty path given for the {what} (an unset shell variable?)")
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except OSError as e:  # a name too long, a loop of symlinks, a path under a file
        raise CheckpointError(f"{path}: cannot read it ({e.strerror or type(e).__name__})") from None
    if stat.S_ISDIR(mode):
        raise CheckpointError(f"{path}: is a directory, expected a {what}")
    if not stat.S_ISREG(mode):  # a FIFO would block forever, a device never end
        raise CheckpointError(f"{path}: not a regular file, expected a {what}")
    return path


def check_file_fits(path, factor=1):
    """A file read whole (times `factor` for what parsing it makes) must fit in memory."""
    size = path.stat().st_size
    check_fits_in_memory(size * factor, f"reading this {size:,}-byte file", path)


def read_json(file, max_bytes=None):
    """A JSON file's contents, after checking that parsing it fits in memory (and, for a
    config, that it is not far larger than any config is)."""
    size = file.stat().st_size
    if max_bytes is not None and size > max_bytes:
        raise CheckpointError(f"{file}: {size:,} bytes, too large for a {file.name} "
                              f"(at most {max_bytes:,})")
    check_file_fits(file, PYTHON_OBJECTS_PER_FILE_BYTE)
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise CheckpointError(f"{file}: not readable JSON ({type(e).__name__})") from None


# torch.save stores every entry of its archive uncompressed (so that tensors can be read,
# or memory-mapped, in place), and trained weights barely compress (~1.1x). An entry that
# expands more than this from a stored size over a megabyte is not weights: a zip bomb.
MAX_COMPRESSION_RATIO = 10


def check_archive_fits(path):
    """torch.save writes a zip archive; its central directory, read without extracting
    anything, gives every entry's uncompressed size. A small file whose entries are
    compressed may expand to gigabytes inside torch.load: refuse that before it starts.
    data.pkl becomes Python objects (x PYTHON_OBJECTS_PER_FILE_BYTE); the rest is tensor
    data, byte for byte."""
    check_file_fits(path)
    try:
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint (truncated or damaged?)") from None
    bomb = next((e for e in entries if e.file_size > 1 << 20
                 and e.file_size > MAX_COMPRESSION_RATIO * e.compress_size), None)
    if bomb is not None:
        raise CheckpointError(f"{path}: entry {bomb.filename} would expand from "
                              f"{format_bytes(bomb.compress_size)} to {format_bytes(bomb.file_size)}; "
                              "torch.save does not compress and weights do not compress like that")
    needed = sum(e.file_size * (PYTHON_OBJECTS_PER_FILE_BYTE if e.filename.endswith(".pkl") else 1)
                 for e in entries)
    check_fits_in_memory(needed, f"unpacking this checkpoint ({len(entries):,} entries)", path)


# ---------------------------------------------------------------------------- model config

SHAPE_FIELDS = ("context_len", "vocab_size", "n_layer", "n_head", "n_embd")
# What other files call a field: nanoGPT (and our checkpoints before the rename) call the
# context block_size
FIELD_ALIASES = {"block_size": "context_len"}


FAMILIES = ("gpt", "llama")
LLAMA_INT_FIELDS = ("context_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd",
                    "intermediate_size")
LLAMA_BOOL_FIELDS = ("qkv_bias", "qk_norm", "tie_embeddings")
# what each rope scaling kind reads, besides rope_type: llama.rope_frequencies
ROPE_SCALING_FIELDS = {"linear": ("factor",),
                       "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                  "original_max_position_embeddings")}


def config_from_dict(fields, source, names=None):
    """A GPTConfig (or, when fields["family"] is "llama", a LlamaConfig) from a dict of its
    fields (other keys are ignored: nanoGPT keeps more), every value checked before anything
    is built, and the model it describes checked against the memory this machine has.
    `names` maps a field to what the file calls it (config.json's n_positions is our
    context_len), for the messages."""
    names = names or {}
    if not isinstance(fields, dict):
        raise CheckpointError(f"{source}: the model config is a {type(fields).__name__}, "
                              "expected a dict of GPTConfig fields")
    family = fields.get("family", "gpt")
    if family not in FAMILIES:
        raise CheckpointError(f"{source}: the model config's family is {short_repr(family)}, "
                              f"expected one of {', '.join(FAMILIES)}")
    if family == "llama":
        return llama_config_from_dict(fields, source, names)
    for alias, name in FIELD_ALIASES.items():
        if alias in fields and name not in fields:
            fields, names = {**fields, name: fields[alias]}, {name: alias, **names}
    for name in SHAPE_FIELDS:
        if name not in fields:
            raise CheckpointError(f"{source}: the model config has no {names.get(name, name)!r}")
        value = fields[name]
        # type(), not isinstance(): True is an int, and 2.0 is not; torch sizes are int64
        if type(value) is not int or not 1 <= value < 2 ** 63:
            raise CheckpointError(f"{source}: the model config's {names.get(name, name)} must be a "
                                  f"positive integer (below 2**63), got {short_repr(value)}")
    dropout, bias = fields.get("dropout", 0.0), fields.get("bias", True)
    if type(dropout) not in (int, float) or not 0 <= dropout < 1:
        raise CheckpointError(f"{source}: the model config's dropout must be a number in [0, 1), "
                              f"got {short_repr(dropout)}")
    if type(bias) is not bool:
        raise CheckpointError(f"{source}: the model config's bias must be true or false, "
                              f"got {short_repr(bias)}")
    if fields["n_embd"] % fields["n_head"]:
        raise CheckpointError(f"{source}: the model config's n_embd ({fields['n_embd']}) is not "
                              f"divisible by n_head ({fields['n_head']})")
    config = GPTConfig(**{name: fields[name] for name in SHAPE_FIELDS}, dropout=float(dropout), bias=bias)
    check_fits_in_memory(*model_memory(config), source)
    return config


def is_number(value, low=0.0, high=math.inf):
    """A finite int or float (not a bool) with low < value < high."""
    return type(value) in (int, float) and math.isfinite(value) and low < value < high


def llama_config_from_dict(fields, source, names):
    """A LlamaConfig from its fields, every one checked (what config_from_dict does for GPT-2)."""
    def name(field):
        return names.get(field, field)

    def refuse(field, what):
        raise CheckpointError(f"{source}: the model config's {name(field)} must be {what}, "
                              f"got {short_repr(fields.get(field))}")
    for field in LLAMA_INT_FIELDS:
        if field not in fields:
            raise CheckpointError(f"{source}: the model config has no {name(field)!r}")
        if type(fields[field]) is not int or not 1 <= fields[field] < 2 ** 63:
            refuse(field, "a positive integer (below 2**63)")
    head_dim = fields.get("head_dim")
    if head_dim is not None and (type(head_dim) is not int or not 2 <= head_dim < 2 ** 31 or head_dim % 2):
        refuse("head_dim", "null or an even positive integer")
    if head_dim is None and fields["n_embd"] % fields["n_head"]:
        raise CheckpointError(f"{source}: the model config's {name('n_embd')} ({fields['n_embd']}) "
                              f"is not divisible by {name('n_head')} ({fields['n_head']})")
    if head_dim is None and (fields["n_embd"] // fields["n_head"]) % 2:
        raise CheckpointError(f"{source}: the model's head size ({fields['n_embd'] // fields['n_head']}) "
                              "is odd; rotary positions turn channels in pairs")
    if fields["n_head"] % fields["n_kv_head"]:
        raise CheckpointError(f"{source}: the model config's {name('n_head')} ({fields['n_head']}) "
                              f"is not a multiple of {name('n_kv_head')} ({fields['n_kv_head']})")
    for field in LLAMA_BOOL_FIELDS:
        if type(fields.get(field, False)) is not bool:
            refuse(field, "true or false")
    if not is_number(fields.get("rope_theta", 10000.0), 1.0):
        refuse("rope_theta", "a finite number above 1")
    if not is_number(fields.get("norm_eps", 1e-5), 0.0, 1.0):
        refuse("norm_eps", "a number in (0, 1)")
    scaling = check_rope_scaling(fields.get("rope_scaling"), source, name("rope_scaling"))
    config = LlamaConfig(**{f: fields[f] for f in LLAMA_INT_FIELDS}, head_dim=head_dim,
                         rope_theta=float(fields.get("rope_theta", 10000.0)), rope_scaling=scaling,
                         norm_eps=float(fields.get("norm_eps", 1e-5)),
                         **{f: fields.get(f, False) for f in LLAMA_BOOL_FIELDS})
    check_fits_in_memory(*model_memory(config), source)
    return config


def check_rope_scaling(scaling, source, name):
    """None (plain RoPE) or a dict of a kind llama.rope_frequencies computes, with every
    number it reads; returns it with only those keys (None for the default kind)."""
    if scaling is None:
        return None
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if kind not in ROPE_TYPES:
        raise CheckpointError(f"{source}: the model config's {name} {short_repr(scaling)} is not "
                              f"supported (rope_type one of {', '.join(ROPE_TYPES)})")
    if kind == "default":
        return None
    checked = {"rope_type": kind}
    for field in ROPE_SCALING_FIELDS[kind]:
        value = scaling.get(field)
        if not is_number(value):
            raise CheckpointError(f"{source}: the model config's {name}.{field} must be a positive "
                                  f"number, got {short_repr(value)}")
        checked[field] = value
    if kind == "llama3" and checked["high_freq_factor"] <= checked["low_freq_factor"]:
        raise CheckpointError(f"{source}: the model config's {name}: high_freq_factor must be "
                              "above low_freq_factor")
    return checked


# ---------------------------------------------------------------------------- weights

LAYER_PREFIX = {"gpt": "transformer.h", "llama": "model.layers"}  # where each family's blocks live
LAYER_KEY = re.compile(r"(?:transformer\.h|model\.layers)\.(\d+)\.")
# the weight a tied output layer shares
EMBEDDING = {"gpt": "transformer.wte.weight", "llama": "model.embed_tokens.weight"}


def layer_indices(state_dict):
    """The block numbers that a state dict holds weights for."""
    return {int(m.group(1)) for m in map(LAYER_KEY.match, state_dict) if m}


def check_tensors(state_dict, source):
    """A state dict: string keys, tensor values (a file may hold anything else)."""
    if not state_dict:
        raise CheckpointError(f"{source}: the state dict is empty")
    for key, value in state_dict.items():
        if not isinstance(key, str):
            raise CheckpointError(f"{source}: state dict key {short_repr(key)} is not a string")
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{source}: {key} is a {type(value).__name__}, not a tensor")


def check_layer_count(state_dict, config, source):
    """The blocks the weights hold must be 0..n_layer-1: checked on the key names, before a
    model of n_layer blocks is constructed to compare shapes with."""
    found = layer_indices(state_dict)
    first_missing = next(i for i in range(len(found) + 1) if i not in found)
    if first_missing < config.n_layer:
        raise CheckpointError(f"{source}: missing key {LAYER_PREFIX[config.family]}.{first_missing}.* (the config "
                              f"has {config.n_layer:,} layers, the weights none for layer {first_missing})")
    extra = next((k for k in state_dict
                  if (m := LAYER_KEY.match(k)) and int(m.group(1)) >= config.n_layer), None)
    if extra is not None:
        raise CheckpointError(f"{source}: unexpected key {extra} (the config has {config.n_layer} layers)")


def check_values(state_dict, source):
    """Every tensor dense, floating-point and finite; the first one that is not is named.
    Finiteness takes one read per tensor: a sum (accumulated in fp32) is finite exactly
    when every value is, unless the sum overflows, and only then is each value tested.
    Measured on this project's 2-core VM (one thread, best of 7): 5 ms for the bundled
    model (5.85M fp16 values), 150 ms for GPT-2 small (124M fp32), next to 0.3 s to
    torch.load the first and seconds to build the second. (torch.isfinite(t).all() writes
    a bool per value first: 14-40x slower, measured alike.) Without this check, NaN
    weights decoded as token 0 (a NUL byte) at exit status 0."""
    seen = set()
    for key, value in state_dict.items():
        if id(value) in seen:  # lm_head is wte: read it once
            continue
        seen.add(id(value))
        if not value.is_floating_point() or value.layout != torch.strided:
            raise CheckpointError(f"{source}: {key} holds {value.dtype} values ({value.layout}); "
                                  "weights must be dense floating-point tensors")
        if math.isfinite(value.sum(dtype=torch.float32).item()):
            continue
        bad = int((~torch.isfinite(value)).sum())
        if bad:
            raise CheckpointError(f"{source}: {key} holds {bad:,} NaN or infinite value(s) of "
                                  f"{value.numel():,}: the file is damaged or its training diverged")


def check_weights(state_dict, expected, source, config):
    """state_dict has exactly the keys and shapes of `expected` (the model's state dict).
    A tied lm_head and the embedding are one tensor in the model, so a file that holds two
    different ones is refused rather than letting whichever loads last win."""
    missing = [k for k in expected if k not in state_dict]
    extra = [k for k in state_dict if k not in expected]
    if missing:
        raise CheckpointError(f"{source}: missing key {missing[0]} ({len(missing)} missing in all)")
    if extra:
        raise CheckpointError(f"{source}: unexpected key {extra[0]} ({len(extra)} unexpected in all)")
    for key, tensor in expected.items():
        if state_dict[key].shape != tensor.shape:
            raise CheckpointError(f"{source}: {key} has shape {tuple(state_dict[key].shape)}, "
                                  f"the config expects {tuple(tensor.shape)}")
    if config.family == "llama" and not config.tie_embeddings:
        return
    embedding, head = state_dict[EMBEDDING[config.family]], state_dict["lm_head.weight"]
    if head is not embedding and not torch.equal(embedding, head):
        raise CheckpointError(f"{source}: lm_head.weight differs from {EMBEDDING[config.family]}; "
                              "this model ties them (one tensor for both)")


# ---------------------------------------------------------------------------- tokenizers

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


def check_contiguous(ranks, special_tokens, source):
    """Every id below n_vocab must decode: the model may emit any of them, and tiktoken
    raises on an id that has no token."""
    ids = sorted([*ranks.values(), *special_tokens.values()])
    gap = next((i for i, token_id in enumerate(ids) if token_id != i), None)
    if gap is not None:
        raise CheckpointError(f"{source}: the tokenizer has no token with id {gap} but ids up to "
                              f"{ids[-1]}; ids must run 0..n-1 so that every id decodes")


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
    check_contiguous(ranks, special_tokens, source)
    check_pattern(pat_str, source)
    try:
        encoding = tiktoken.Encoding(name=name, pat_str=pat_str, mergeable_ranks=ranks,
                                     special_tokens=special_tokens)
    except (ValueError, TypeError, OverflowError) as e:  # a regex tiktoken's dialect refuses
        raise CheckpointError(f"{source}: tiktoken cannot build this tokenizer "
                              f"({str(e).splitlines()[0][:100] if str(e) else type(e).__name__})") from None
    check_round_trip(encoding, source)
    return encoding


def check_round_trip(encoding, source):
    if encoding.decode(encoding.encode_ordinary(ROUND_TRIP_SAMPLE)) != ROUND_TRIP_SAMPLE:
        raise CheckpointError(f"{source}: the tokenizer does not give back the text it encodes "
                              "(its pattern and ranks do not fit together)")


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
    check_contiguous(encoding._mergeable_ranks, encoding._special_tokens, source)
    return encoding


def check_tokenizer_fits(tokenizer, config, source):
    """Every token id must have a row in the embedding table (more rows are fine: padding)."""
    if tokenizer.n_vocab > config.vocab_size:
        raise CheckpointError(
            f"{source}: tokenizer has {tokenizer.n_vocab} tokens but the model only {config.vocab_size}")
