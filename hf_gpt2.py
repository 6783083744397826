"""
Hugging Face GPT-2 -> our GPT: load a local GPT-2 directory (`--hf DIR` in every script).

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

import json
from pathlib import Path

import tiktoken
import torch

from base_model import GPTConfig
from checkpoint import (CheckpointError, check_tokenizer_fits, clean_state_dict, describe,
                        load_weights, read_checkpoint, split_checkpoint, tokenizer_from_spec)

CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Both are GELU's tanh approximation, which is what base_model.MLP computes.
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")
# GPT-2's pre-tokenisation regex, as HF's byte-level tokenizer hard-codes it and as tiktoken
# writes it: the same splits. A BPE tokenizer with any other regex is not GPT-2-compatible.
GPT2_PATTERNS = (r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
                 r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def swap_conv1d(state_dict):
    """Conv1D (in, out) <-> nn.Linear (out, in): a transpose, its own inverse, so import and
    export share it."""
    return {k: v.t().contiguous() if k.endswith(CONV1D_WEIGHTS) else v for k, v in state_dict.items()}


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


# ---------------------------------------------------------------------------- config

def read_json(file):
    try:
        return json.loads(Path(file).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file}: not readable JSON ({type(e).__name__})") from None


def read_config(path):
    """GPTConfig from config.json, refusing settings that change the mathematics."""
    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{path}: no config.json, not a Hugging Face model directory")
    hf = read_json(file)
    if hf.get("model_type") != "gpt2":
        raise CheckpointError(f"{path}: model_type is {hf.get('model_type')!r}, only 'gpt2' can be loaded")
    try:
        n_embd = hf["n_embd"]
        config = GPTConfig(block_size=hf["n_positions"], vocab_size=hf["vocab_size"], n_layer=hf["n_layer"],
                           n_head=hf["n_head"], n_embd=n_embd, dropout=0.0, bias=True)
    except KeyError as e:
        raise CheckpointError(f"{path}: config.json has no {e.args[0]!r}") from None
    except ValueError as e:  # GPTConfig's own check (heads must divide n_embd)
        raise CheckpointError(f"{path}: bad config.json: {e}") from None
    # (setting is wrong, why): each of these would make our forward compute something else.
    # reorder_and_upcast_attn is not here: it only computes the same attention in fp32.
    unsupported = [
        (hf.get("activation_function", "gelu_new") not in TANH_GELUS,
         f"activation_function {hf.get('activation_function')!r}, ours is tanh GELU (gelu_new)"),
        (hf.get("scale_attn_by_inverse_layer_idx", False),
         "scale_attn_by_inverse_layer_idx is true, ours scales attention by 1/sqrt(head_dim) only"),
        (not hf.get("scale_attn_weights", True), "scale_attn_weights is false, ours always scales"),
        (hf.get("layer_norm_epsilon", 1e-5) != 1e-5,
         f"layer_norm_epsilon {hf.get('layer_norm_epsilon')}, ours is 1e-5"),
        (hf.get("n_inner") not in (None, 4 * n_embd), f"n_inner {hf.get('n_inner')}, ours is 4 * n_embd"),
        (hf.get("add_cross_attention", False), "add_cross_attention is true (an encoder-decoder)"),
        (not hf.get("tie_word_embeddings", True), "tie_word_embeddings is false, ours ties lm_head to wte"),
    ]
    for wrong, why in unsupported:
        if wrong:
            raise CheckpointError(f"{path}: unsupported GPT-2 variant: {why}")
    return config


# ---------------------------------------------------------------------------- weights

def read_weights(path):
    """The raw state dict from model.safetensors (preferred, as HF does) or pytorch_model.bin."""
    st_file, bin_file = path / "model.safetensors", path / "pytorch_model.bin"
    if st_file.is_file():
        try:
            from safetensors.torch import load_file  # optional: only this format needs it
        except ImportError:
            raise CheckpointError(f"{st_file}: reading .safetensors needs the safetensors package "
                                  "(pip install safetensors)") from None
        try:
            return load_file(st_file)
        except Exception as e:  # a truncated or foreign file fails in several ways
            raise CheckpointError(
                f"{st_file}: not a readable safetensors file ({type(e).__name__})") from None
    if bin_file.is_file():
        # torch.load(weights_only=True) with one-line errors, as for our own checkpoints
        return split_checkpoint(read_checkpoint(bin_file), bin_file)[0]
    if any(path.glob("*.index.json")):
        raise CheckpointError(f"{path}: sharded weights (*.index.json) are not supported, only one file")
    raise CheckpointError(f"{path}: no model.safetensors or pytorch_model.bin")


def to_our_state_dict(hf_state_dict, path):
    """HF's key names and layouts -> base_model.GPT's."""
    sd = {k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k: v
          for k, v in hf_state_dict.items()}
    wte, head = sd.get("transformer.wte.weight"), sd.get("lm_head.weight")
    if wte is not None and head is not None and not torch.equal(wte, head):
        raise CheckpointError(f"{path}: lm_head.weight differs from wte.weight; ours ties them")
    return clean_state_dict(swap_conv1d(sd))


# ---------------------------------------------------------------------------- tokenizer

def bpe_from_files(path):
    """(vocab {str: id}, merges [(a, b)], special names) from vocab.json + merges.txt, or from
    tokenizer.json (what newer transformers save); None when the directory has neither."""
    if (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
        vocab = read_json(path / "vocab.json")
        lines = (path / "merges.txt").read_text(encoding="utf-8").splitlines()
        merges = [tuple(line.split()) for line in lines if line.strip() and not line.startswith("#version")]
        config_file = path / "tokenizer_config.json"
        config = read_json(config_file) if config_file.is_file() else {}
        return vocab, merges, set(), config.get("add_prefix_space", False)
    if (path / "tokenizer.json").is_file():
        tok = read_json(path / "tokenizer.json")
        model, pre = tok.get("model") or {}, tok.get("pre_tokenizer") or {}
        if model.get("type") != "BPE" or pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
            raise CheckpointError(f"{path}: tokenizer.json is not GPT-2's byte-level BPE")
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
        specials = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
        return {**model["vocab"], **specials}, merges, set(specials), pre.get("add_prefix_space", False)
    return None


def tokenizer_from_files(path):
    """A tiktoken.Encoding equal to the directory's GPT-2-style BPE tokenizer.

    tiktoken stores BPE as token bytes -> rank and merges the adjacent pair whose joined
    bytes rank lowest; HF stores merges in priority order. They agree when ids are ranks:
    the 256 byte tokens, then merge i's result at a higher id than merge i-1's, which is how
    GPT-2's files (and any BPE trained in order) are laid out; other layouts are refused.
    Every other vocab entry (<|endoftext|>) becomes a special token."""
    found = bpe_from_files(path)
    if found is None:
        return None
    vocab, merges, specials, prefix_space = found
    if prefix_space:  # HF would prepend a space before encoding; tiktoken cannot
        raise CheckpointError(f"{path}: the tokenizer sets add_prefix_space, GPT-2's does not")
    to_byte = {c: b for b, c in byte_to_char().items()}
    try:
        ranks = {bytes([b]): vocab[c] for b, c in byte_to_char().items()}
        byte_ids = set(ranks.values())
        merge_ids = []
        for a, b in merges:
            ranks[bytes(to_byte[ch] for ch in a + b)] = vocab[a + b]
            merge_ids.append(vocab[a + b])
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{path}: vocab and merges disagree ({e!r} missing): "
                              "not a GPT-2 byte-level BPE") from None
    if merge_ids != sorted(set(merge_ids)) or merge_ids and merge_ids[0] <= max(byte_ids):
        raise CheckpointError(f"{path}: tokens are not numbered in merge order; tiktoken cannot reproduce it")
    used = set(ranks.values())
    special = {t: i for t, i in vocab.items() if i not in used or t in specials}
    return tiktoken.Encoding(name=f"{path.name}-bpe", pat_str=GPT2_PATTERNS[0],
                             mergeable_ranks=ranks, special_tokens=special)


# ---------------------------------------------------------------------------- loading

def load_hf_model(cls, path, device="cpu", dtype=torch.float32, report=print):
    """Build `cls` (GPT or KVCacheGPT) from a Hugging Face GPT-2 directory: (model, tokenizer).
    Same contract as checkpoint.load_model: fp32 load, then cast; one line to `report`."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: {'not a directory' if path.exists() else 'no such directory'}; "
                              "--hf expects a Hugging Face GPT-2 directory (config.json + weights)")
    config = read_config(path)
    model = cls(config)
    load_weights(model, to_our_state_dict(read_weights(path), path), path)
    # without its own tokenizer files a GPT-2 directory uses GPT-2's: tiktoken's 'gpt2'
    tokenizer = tokenizer_from_files(path) or tokenizer_from_spec({"encoding": "gpt2"}, path)
    check_tokenizer_fits(tokenizer, config, path)
    report(f"loaded Hugging Face GPT-2 {path} ({describe(model)}, "
           f"tokenizer {tokenizer.name}, {tokenizer.n_vocab} tokens)")
    return model.to(device=device, dtype=dtype).eval(), tokenizer
