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
The tokenizer is rebuilt offline, as a tiktoken.Encoding, from the directory's own files
(plumbing/hf_bpe.py).
Nothing here imports transformers; safetensors only when a .safetensors file is read.
export_hf.py goes the other way with the same helpers.
"""

from pathlib import Path

import torch

from plumbing.checkpoint import (FLOAT_DTYPE_NAMES, build_model, check_tensors, clean_state_dict, describe,
                                 resolve_dtype, split_checkpoint)
from plumbing.files import check_file_fits, read_checkpoint, read_json
from plumbing.hf_bpe import tokenizer_from_files
from plumbing.hf_llama import LLAMA_MODEL_TYPES, llama_config, llama_tokenizer
from plumbing.model_config import config_from_dict
from plumbing.script import CheckpointError, short_repr
from plumbing.tokenizer import named_encoding

CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Both are GELU's tanh approximation, which is what base_model.MLP computes.
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")
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
    shard must be a file of this directory (an index is data: it may not point elsewhere),
    and a tensor must be in one shard only, the one the index names for it: two copies
    would load from whichever is read last, silently."""
    index = read_json(index_file)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_file}: no weight_map {{tensor name: shard file}}")
    shards = sorted(set(weight_map.values()), key=str)
    bad = next((s for s in shards if not isinstance(s, str) or s in ("", ".", "..") or "/" in s
                or "\\" in s), None)
    if bad is not None or not shards:
        raise CheckpointError(f"{index_file}: shard {short_repr(bad)} is not a file name of this directory")
    state_dict, shard_of = {}, {}
    for shard in shards:
        if not (path / shard).is_file():
            raise CheckpointError(f"{index_file}: names shard {shard}, which is not in {path}")
        for key, tensor in read_weight_file(path / shard).items():
            if key in shard_of:
                raise CheckpointError(f"{path}: {short_repr(key)} is in two shards, {shard_of[key]} "
                                      f"and {shard}; which one is meant?")
            named = weight_map.get(key, shard)  # (a tensor the index does not list is taken as it is)
            if named != shard:
                raise CheckpointError(f"{index_file}: names {short_repr(named)} for {short_repr(key)}, "
                                      f"but {shard} holds it")
            state_dict[key], shard_of[key] = tensor, shard
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
        from safetensors import safe_open  # optional: only this format needs it
    except ImportError:
        raise CheckpointError(f"{file}: reading .safetensors needs the safetensors package "
                              "(pip install safetensors)") from None
    # safetensors checks that every tensor its header declares lies inside the file,
    # so the file's size bounds what reading it allocates
    check_file_fits(file)
    try:
        with safe_open(file, "pt") as f:
            keys = list(f.keys())
        # one opening per tensor: the tensors of one opening share its memory map, which the
        # file's pages stay in until the last of them is gone; each on its own, a tensor
        # converted to another dtype while loading lets go of its pages once converted
        state_dict = {key: read_one_tensor(safe_open, file, key) for key in keys}
    except Exception as e:  # a truncated or foreign file fails in several ways
        raise CheckpointError(f"{file}: not a readable safetensors file ({type(e).__name__})") from None
    check_tensors(state_dict, file)
    return state_dict


def read_one_tensor(safe_open, file, key):
    """One tensor of a .safetensors file, memory-mapped (read from the file when used)."""
    with safe_open(file, "pt") as f:
        return f.get_tensor(key)


def to_our_state_dict(hf_state_dict):
    """HF's key names and layouts -> base_model.GPT's."""
    sd = {k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k: v
          for k, v in hf_state_dict.items()}
    return clean_state_dict(swap_conv1d(sd))


# ---------------------------------------------------------------------------- loading

def load_hf_model(classes, path, device="cpu", dtype=torch.float32, report=print,
                  quantize=None, group_size=None, show_progress=True):
    """Build a model from a Hugging Face directory, with classes[family] (checkpoint.NAIVE_MODELS,
    or kv_cache.CACHED_MODELS): (model, tokenizer). Same contract and the same checks as
    checkpoint.load_model (dtype "auto": config.json's torch_dtype, see checkpoint.auto_dtype);
    one line to `report`."""
    if str(path) == "":
        raise CheckpointError("empty path given for --hf (an unset shell variable?)")
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: {'not a directory' if path.exists() else 'no such directory'}; "
                              "--hf expects a Hugging Face directory of GPT-2, Llama, Mistral, Qwen2 or "
                              "Qwen3 (config.json + weights + tokenizer files)")
    hf, config = read_config(path)
    dtype, dtype_line = resolve_dtype(dtype, config_dtype(hf), device, quantize)
    if config.family == "llama":  # our names are theirs: nothing to convert
        state_dict, tokenizer = clean_state_dict(read_weights(path)), llama_tokenizer(path, hf)
    else:
        state_dict = to_our_state_dict(read_weights(path))
        # without its own tokenizer files a GPT-2 directory uses GPT-2's: tiktoken's 'gpt2'
        tokenizer = tokenizer_from_files(path) or named_encoding("gpt2", path)
    model = build_model(classes, config, state_dict, tokenizer, path, device, dtype, quantize, group_size,
                        show_progress)
    report(f"loaded Hugging Face {hf['model_type']} {path} ({describe(model)}, "
           f"tokenizer {tokenizer.name}, {tokenizer.n_vocab} tokens)")
    if dtype_line:
        report(dtype_line)
    return model, tokenizer


def config_dtype(hf):
    """The dtype config.json says the weights are in (transformers 4 writes torch_dtype,
    5 writes dtype); float32 where it says none this project computes in."""
    name = hf.get("dtype", hf.get("torch_dtype"))
    return getattr(torch, name) if name in FLOAT_DTYPE_NAMES else torch.float32
