"""
Hugging Face directories -> our models (`--hf DIR` in every script): GPT-2 here, and the
Llama family (Llama, Mistral, Qwen2, Qwen3) through plumbing/hf_llama.py. The weights are
read here for both: model.safetensors, pytorch_model.bin, or either one sharded (an
*.index.json naming the file of each tensor).

GPT-2:
Our model is GPT-2's architecture under GPT-2's own parameter names, so a GPT-2 checkpoint
needs no conversion of the mathematics, only of how three things are stored:
  1. HF's attention and MLP layers are `Conv1D`, which keeps its weight as (in, out);
     nn.Linear keeps (out, in). Those four weights per block are transposed.
  2. Older files save the causal mask as buffers (attn.bias, attn.masked_bias); ours builds
     its own, so checkpoint.clean_state_dict drops them and restores the tied lm_head.
  3. GPT2LMHeadModel names keys 'transformer.h.0...'; a bare GPT2Model (and OpenAI's
     original files) says 'h.0...': the prefix is added where it is missing.
The tokenizer is rebuilt offline, as a tiktoken.Encoding, from the directory's own files.
Nothing here imports transformers; safetensors only when a .safetensors file is read.
export_hf.py goes the other way with the same helpers.
"""

from pathlib import Path

import torch

from plumbing.checkpoint import build_model, check_tensors, clean_state_dict, describe, split_checkpoint
from plumbing.files import PYTHON_OBJECTS_PER_FILE_BYTE, check_file_fits, read_checkpoint, read_json
from plumbing.hf_llama import LLAMA_MODEL_TYPES, llama_config, llama_tokenizer
from plumbing.hf_tokenizer import byte_to_char
from plumbing.model_config import config_from_dict
from plumbing.script import CheckpointError, short_repr
from plumbing.tokenizer import EOT, build_encoding, named_encoding

CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Both are GELU's tanh approximation, which is what base_model.MLP computes.
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")
# GPT-2's pre-tokenisation regex, as HF's byte-level tokenizer hard-codes it and as tiktoken
# writes it: the same splits. A BPE tokenizer with any other regex is not GPT-2-compatible.
GPT2_PATTERNS = (r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
                 r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
# config.json's names for GPTConfig's fields
HF_NAMES = {"context_len": "n_positions", "vocab_size": "vocab_size", "n_layer": "n_layer",
            "n_head": "n_head", "n_embd": "n_embd"}
CONFIG_JSON_MAX_BYTES = 1 << 20  # GPT-2's is 0.7 KB: a larger file is not a model config


def swap_conv1d(state_dict):
    """Conv1D (in, out) <-> nn.Linear (out, in): a transpose, its own inverse, so import and
    export share it."""
    # (a tensor of another rank is left as it is, for the shape check to name)
    return {k: v.t().contiguous() if k.endswith(CONV1D_WEIGHTS) and v.dim() == 2 else v
            for k, v in state_dict.items()}


# ---------------------------------------------------------------------------- config

def read_config(path):
    """(config.json as a dict, our config: a GPTConfig or a LlamaConfig), refusing settings
    that change the mathematics."""
    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{path}: no config.json, not a Hugging Face model directory")
    hf = read_json(file, CONFIG_JSON_MAX_BYTES)
    if not isinstance(hf, dict):
        raise CheckpointError(f"{file}: holds a {type(hf).__name__}, expected a JSON object")
    if hf.get("model_type") in LLAMA_MODEL_TYPES:
        return hf, llama_config(hf, file)
    if hf.get("model_type") != "gpt2":
        raise CheckpointError(f"{path}: model_type is {short_repr(hf.get('model_type'))}; these can "
                              f"be loaded: gpt2, {', '.join(LLAMA_MODEL_TYPES)}")
    return hf, gpt2_config(hf, path, file)


def gpt2_config(hf, path, file):
    """GPTConfig from GPT-2's config.json."""
    fields = {ours: hf[theirs] for ours, theirs in HF_NAMES.items() if theirs in hf}
    config = config_from_dict({**fields, "dropout": 0.0, "bias": True}, file, names=HF_NAMES)
    # (setting is wrong, why): each of these would make our forward compute something else.
    # reorder_and_upcast_attn is not here: it only computes the same attention in fp32.
    unsupported = [
        (hf.get("activation_function", "gelu_new") not in TANH_GELUS,
         f"activation_function {short_repr(hf.get('activation_function'))}, ours is tanh GELU (gelu_new)"),
        (hf.get("scale_attn_by_inverse_layer_idx", False) is not False,
         "scale_attn_by_inverse_layer_idx is not false, ours scales attention by 1/sqrt(head_dim) only"),
        (hf.get("scale_attn_weights", True) is not True,
         "scale_attn_weights is not true, ours always scales"),
        (hf.get("layer_norm_epsilon", 1e-5) != 1e-5,
         f"layer_norm_epsilon {short_repr(hf.get('layer_norm_epsilon'))}, ours is 1e-5"),
        (hf.get("n_inner") not in (None, 4 * config.n_embd),
         f"n_inner {short_repr(hf.get('n_inner'))}, ours is 4 * n_embd"),
        (hf.get("add_cross_attention", False) is not False,
         "add_cross_attention is set (an encoder-decoder)"),
        (hf.get("tie_word_embeddings", True) is not True,
         "tie_word_embeddings is not true, ours ties lm_head to wte"),
    ]
    for wrong, why in unsupported:
        if wrong:
            raise CheckpointError(f"{path}: unsupported GPT-2 variant: {why}")
    return config


# ---------------------------------------------------------------------------- weights

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # HF's order of preference


def read_weights(path):
    """The raw state dict from model.safetensors (preferred, as HF does) or pytorch_model.bin,
    or from the shards one of them is split into (model.safetensors.index.json)."""
    for name in WEIGHT_FILES:
        if (path / name).is_file():
            return read_weight_file(path / name)
        if (path / f"{name}.index.json").is_file():
            return read_shards(path, path / f"{name}.index.json")
    raise CheckpointError(f"{path}: no model.safetensors or pytorch_model.bin (or their *.index.json)")


def read_shards(path, index_file):
    """Every shard an index names, merged: {"weight_map": {tensor name: shard file}}. A
    shard must be a file of this directory (an index is data: it may not point elsewhere)."""
    index = read_json(index_file)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_file}: no weight_map {{tensor name: shard file}}")
    shards = sorted(set(weight_map.values()), key=str)
    bad = next((s for s in shards if not isinstance(s, str) or s in ("", ".", "..") or "/" in s
                or "\\" in s), None)
    if bad is not None or not shards:
        raise CheckpointError(f"{index_file}: shard {short_repr(bad)} is not a file name of this directory")
    state_dict = {}
    for shard in shards:
        if not (path / shard).is_file():
            raise CheckpointError(f"{index_file}: names shard {shard}, which is not in {path}")
        state_dict.update(read_weight_file(path / shard))
    missing = next((k for k in weight_map if k not in state_dict), None)
    if missing is not None:
        raise CheckpointError(f"{index_file}: names {missing!r}, which is in none of its shards")
    return state_dict


def read_weight_file(file):
    """One .safetensors file, or one torch.save file read as data only."""
    if file.suffix != ".safetensors":
        # torch.load(weights_only=True) with one-line errors, as for our own checkpoints
        return split_checkpoint(read_checkpoint(file), file)[0]
    try:
        from safetensors.torch import load_file  # optional: only this format needs it
    except ImportError:
        raise CheckpointError(f"{file}: reading .safetensors needs the safetensors package "
                              "(pip install safetensors)") from None
    # safetensors checks that every tensor its header declares lies inside the file,
    # so the file's size bounds what load_file allocates
    check_file_fits(file)
    try:
        state_dict = load_file(file)
    except Exception as e:  # a truncated or foreign file fails in several ways
        raise CheckpointError(f"{file}: not a readable safetensors file ({type(e).__name__})") from None
    check_tensors(state_dict, file)
    return state_dict


def to_our_state_dict(hf_state_dict):
    """HF's key names and layouts -> base_model.GPT's."""
    sd = {k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k: v
          for k, v in hf_state_dict.items()}
    return clean_state_dict(swap_conv1d(sd))


# ---------------------------------------------------------------------------- tokenizer

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


# ---------------------------------------------------------------------------- loading

def load_hf_model(classes, path, device="cpu", dtype=torch.float32, report=print):
    """Build a model from a Hugging Face directory, with classes[family] (checkpoint.NAIVE_MODELS,
    or kv_cache.CACHED_MODELS): (model, tokenizer). Same contract and the same checks as
    checkpoint.load_model: fp32 load, then cast; one line to `report`."""
    if str(path) == "":
        raise CheckpointError("empty path given for --hf (an unset shell variable?)")
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: {'not a directory' if path.exists() else 'no such directory'}; "
                              "--hf expects a Hugging Face directory of GPT-2, Llama, Mistral, Qwen2 or "
                              "Qwen3 (config.json + weights + tokenizer files)")
    hf, config = read_config(path)
    if config.family == "llama":  # our names are theirs: nothing to convert
        state_dict, tokenizer = clean_state_dict(read_weights(path)), llama_tokenizer(path, hf)
    else:
        state_dict = to_our_state_dict(read_weights(path))
        # without its own tokenizer files a GPT-2 directory uses GPT-2's: tiktoken's 'gpt2'
        tokenizer = tokenizer_from_files(path) or named_encoding("gpt2", path)
    model = build_model(classes, config, state_dict, tokenizer, path)
    report(f"loaded Hugging Face {hf['model_type']} {path} ({describe(model)}, "
           f"tokenizer {tokenizer.name}, {tokenizer.n_vocab} tokens)")
    return model.to(device=device, dtype=dtype).eval(), tokenizer
