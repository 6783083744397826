"""
Checkpoints: the one loader every script shares.

A checkpoint is data, never code: every file is read with torch.load(weights_only=True),
which refuses pickles that would construct arbitrary objects. Accepted layouts:
  - ours and nanoGPT's: {'model': state_dict, 'config' or 'model_args': {...}, ...}
  - a bare state dict, with the config inferred from the tensor shapes.
A checkpoint may carry its tokenizer ('tokenizer': tiktoken ranks, or an encoding name);
one that says nothing is taken to use GPT-2's encoding, as nanoGPT-style checkpoints do.
Its config says the model's family ('family': "gpt", the default, or "llama"); the caller
says which class builds each family (NAIVE_MODELS here, kv_cache.CACHED_MODELS), so that
nothing here imports kv_cache.py, whose demo imports this.
Every file, config, tokenizer and tensor is checked by validation.py before a model is
built from it; build_model is the one place a model is built, for plumbing/hf.py too.
"""

import dataclasses
import pickle
import re
from pathlib import Path

import torch

from base_model import GPT
from llama import Llama
from plumbing.validation import (SHAPE_FIELDS, CheckpointError, check_archive_fits, check_file_fits,
                        check_input_file, check_layer_count, check_tokenizer_fits, check_values,
                        check_weights, check_tensors, config_from_dict, encoding_from_spec,
                        layer_indices, EMBEDDING)

ROOT = Path(__file__).resolve().parent.parent  # the repository
BUNDLED = ROOT / "checkpoints" / "shakespeare" / "ckpt.pt"
BUNDLED_LLAMA = ROOT / "checkpoints" / "shakespeare-llama" / "ckpt.pt"  # the Llama-style one (--ckpt)
# The seed's lookup order when no checkpoint is named: a learner's own, then the bundled one.
DEFAULT_CHAIN = [ROOT / "checkpoints" / "ckpt_sft.pt", ROOT / "checkpoints" / "ckpt_base.pt", BUNDLED]
# causal masks some GPT code saves; the rotary frequencies older Llama files save
BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
NAIVE_MODELS = {"gpt": GPT, "llama": Llama}  # family -> the class that builds it, naive loop


def default_checkpoint():
    for path in DEFAULT_CHAIN:
        if path.exists():
            return path
    raise CheckpointError(
        f"no checkpoint found: looked for {', '.join(str(p) for p in DEFAULT_CHAIN)}; "
        "pass --ckpt PATH or restore the bundled model (git checkout checkpoints/)")


def read_checkpoint(path):
    """torch.load a file as data only; every failure becomes one CheckpointError line."""
    path = check_input_file(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror})") from None
    # torch.save writes a zip archive (PK..); older files are a bare pickle (protocol byte
    # 0x80) followed by the raw tensor data, which is most of such a file
    if magic.startswith(b"PK\x03\x04"):
        check_archive_fits(path)
    elif magic[:1] == b"\x80":
        check_file_fits(path)
    else:
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint (not a torch.save file)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # weights_only refuses anything but tensors and plain containers: this is where a
        # pickle that would run code on load ends up, before any of it runs
        found = re.search(r"Unsupported (global|operand)[^\n]*?(?=\s+was|\n|$)", str(e))
        raise CheckpointError(
            f"{path}: refused, it holds objects other than tensors and plain data "
            f"({found.group(0) if found else 'unsupported pickle content'}); "
            "a checkpoint is data, never code, so only weights_only=True loading is done") from None
    except Exception as e:  # torch.load fails in many ways on a file that is not one
        raise CheckpointError(
            f"{path}: not a readable PyTorch checkpoint (truncated or damaged?): "
            f"{type(e).__name__}") from None


def split_checkpoint(obj, path):
    """(state_dict, config dict or None, tokenizer spec or None) from any accepted layout."""
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: not a checkpoint: expected a dict, found {type(obj).__name__}")
    if "model" in obj and isinstance(obj["model"], dict):
        # nanoGPT keeps the model's arguments in 'model_args' and its training settings in
        # 'config'; ours keeps the model's in 'config'. Only GPTConfig's fields are taken.
        config = obj["model_args"] if "model_args" in obj else obj.get("config")
        state_dict, tokenizer = obj["model"], obj.get("tokenizer")
    elif obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        state_dict, config, tokenizer = obj, None, None
    else:
        raise CheckpointError(f"{path}: not a checkpoint: no 'model' state dict and not a bare state dict")
    check_tensors(state_dict, path)
    return state_dict, config, tokenizer


def clean_state_dict(state_dict):
    """Strip torch.compile's '_orig_mod.' prefix, drop saved mask buffers, restore the tied
    lm_head if only wte was saved."""
    out = {}
    for key, value in state_dict.items():
        key = key.removeprefix("_orig_mod.")
        if not key.endswith(BUFFER_SUFFIXES):
            out[key] = value
    if "lm_head.weight" not in out and "transformer.wte.weight" in out:
        out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def infer_config(state_dict, path):
    """A GPTConfig from tensor shapes. n_head cannot be seen in shapes: GPT-2's 64-wide
    heads are assumed. A Llama-family state dict is refused: its heads, key/value heads and
    rotary base are not in the shapes either, and guessing them would compute nonsense."""
    if "model.embed_tokens.weight" in state_dict:
        raise CheckpointError(f"{path}: a Llama-family state dict without its config (heads, "
                              "key/value heads, rope_theta cannot be seen in the shapes); save it "
                              "with its config (plumbing.checkpoint.save_checkpoint)")
    for key in ("transformer.wte.weight", "transformer.wpe.weight"):
        if key not in state_dict:
            raise CheckpointError(f"{path}: missing key {key}, cannot infer the model's shape")
        if state_dict[key].dim() != 2:
            raise CheckpointError(f"{path}: {key} has shape {tuple(state_dict[key].shape)}, "
                                  "expected (rows, n_embd)")
    vocab_size, n_embd = state_dict["transformer.wte.weight"].shape
    fields = dict(context_len=state_dict["transformer.wpe.weight"].size(0), vocab_size=vocab_size,
                  n_layer=max(layer_indices(state_dict), default=-1) + 1,
                  n_head=max(1, n_embd // 64), n_embd=n_embd, bias="transformer.ln_f.bias" in state_dict)
    return config_from_dict(fields, f"{path} (no config: inferred from the weights, 64-wide heads)")


def make_config(config_dict, state_dict, path):
    """The checkpoint's config, checked field by field; inferred from the weights when the
    checkpoint has none, or only settings that are not the model's (nanoGPT's training
    config without its model_args)."""
    if config_dict is None or (isinstance(config_dict, dict)
                               and not any(name in config_dict for name in SHAPE_FIELDS)):
        return infer_config(state_dict, path)
    return config_from_dict(config_dict, path)


# ---------------------------------------------------------------------------- loading

def build_model(classes, config, state_dict, tokenizer, source):
    """The model of config's family, built by classes[family] (NAIVE_MODELS, or
    kv_cache.CACHED_MODELS) and holding state_dict, once everything about it is checked:
    the tokenizer fits the vocabulary, the weights are finite, and (before the model's n
    layers are constructed) the layers are there; then every key and shape. Both loaders
    come through here, so that no script can skip a check."""
    if config.family not in classes:
        raise CheckpointError(f"{source}: a {config.family}-family model, which this command does "
                              f"not run (it runs {', '.join(classes)})")
    check_tokenizer_fits(tokenizer, config, source)
    check_layer_count(state_dict, config, source)
    check_values(state_dict, source)
    state_dict = tie_output_layer(state_dict, config)
    model = classes[config.family](config)
    check_weights(state_dict, model.state_dict(), source, config)
    model.load_state_dict(state_dict, strict=True)  # copies into the model's fp32 parameters
    return model


def tie_output_layer(state_dict, config):
    """A tied output layer is often saved once, as the embedding (safetensors refuses one
    tensor twice): give lm_head its tensor back. Only when the config ties them: an untied
    model without its lm_head is a missing key."""
    tied = config.family == "gpt" or config.tie_embeddings
    embedding = EMBEDDING[config.family]
    if tied and "lm_head.weight" not in state_dict and embedding in state_dict:
        return {**state_dict, "lm_head.weight": state_dict[embedding]}
    return state_dict


def load_model(classes, path=None, device="cpu", dtype=torch.float32, report=print):
    """Build a model from a checkpoint, with classes[family] (NAIVE_MODELS, or
    kv_cache.CACHED_MODELS); returns (model, tokenizer).

    With no path (None), the default chain is used; an empty string is refused. The weights
    are loaded in fp32 and then cast to dtype. `report` receives the one line that says
    what was loaded."""
    path = default_checkpoint() if path is None else path
    state_dict, config_dict, tokenizer_spec = split_checkpoint(read_checkpoint(path), path)
    state_dict = clean_state_dict(state_dict)
    config = make_config(config_dict, state_dict, path)
    tokenizer = encoding_from_spec(tokenizer_spec, path)
    model = build_model(classes, config, state_dict, tokenizer, path)
    report(f"loaded {path} ({describe(model)}, tokenizer {tokenizer.name}, {tokenizer.n_vocab} tokens)")
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def describe(model):
    c = model.config
    kv_heads = f" ({c.n_kv_head} key/value)" if c.n_kv_head != c.n_head else ""
    return (f"{model.num_params() / 1e6:.2f}M params, {c.n_layer} layers, {c.n_head} heads{kv_heads}, "
            f"{c.n_embd} dims, context {c.context_len}")


def save_checkpoint(path, model, tokenizer_spec=None, dtype=None, **extra):
    """Write {'model', 'config', 'tokenizer', ...extra}: plain data that weights_only loads.
    dtype (e.g. torch.float16) shrinks the file; load_model brings it back to fp32."""
    state_dict = model.state_dict()
    c = model.config
    if c.family == "gpt" or c.tie_embeddings:
        del state_dict["lm_head.weight"]  # tied: saving it twice would double a cast file
    if dtype is not None:
        state_dict = {k: v.to(dtype) for k, v in state_dict.items()}
    config = {"family": c.family, **dataclasses.asdict(c)}
    obj = {"model": state_dict, "config": config, **extra}
    if tokenizer_spec is not None:
        obj["tokenizer"] = tokenizer_spec
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, path)
