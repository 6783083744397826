"""
Checkpoints and tokenizers: the one loader every script shares.

A checkpoint is data, never code: every file is read with torch.load(weights_only=True),
which refuses pickles that would construct arbitrary objects. Accepted layouts:
  - ours and nanoGPT's: {'model': state_dict, 'config' or 'model_args': {...}, ...}
  - a bare state dict, with the config inferred from the tensor shapes.
A checkpoint may carry its tokenizer ('tokenizer': tiktoken ranks, or an encoding name);
one that says nothing is taken to use GPT-2's encoding, as nanoGPT-style checkpoints do.
"""

import dataclasses
import pickle
import re
from pathlib import Path

import tiktoken
import torch

from base_model import GPTConfig

ROOT = Path(__file__).resolve().parent
BUNDLED = ROOT / "checkpoints" / "shakespeare" / "ckpt.pt"
# The seed's lookup order when no checkpoint is named: a learner's own, then the bundled one.
DEFAULT_CHAIN = [ROOT / "checkpoints" / "ckpt_sft.pt", ROOT / "checkpoints" / "ckpt_base.pt", BUNDLED]
BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")  # causal masks some GPT code saves


class CheckpointError(ValueError):
    """A checkpoint or tokenizer that cannot be used; the message is one line for the user."""


def default_checkpoint():
    for path in DEFAULT_CHAIN:
        if path.exists():
            return path
    raise CheckpointError(
        f"no checkpoint found: looked for {', '.join(str(p) for p in DEFAULT_CHAIN)}; "
        "pass --ckpt PATH or restore the bundled model (git checkout checkpoints/)")


def read_checkpoint(path):
    """torch.load a file as data only; every failure becomes one CheckpointError line."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file")
    if path.is_dir():
        raise CheckpointError(f"{path}: is a directory, expected a checkpoint file (.pt)")
    with open(path, "rb") as f:
        magic = f.read(4)
    # torch.save writes a zip archive (PK..); older files are a bare pickle (protocol byte 0x80)
    if not (magic.startswith(b"PK\x03\x04") or magic[:1] == b"\x80"):
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
        config = obj.get("model_args") or obj.get("config")
        return obj["model"], config, obj.get("tokenizer")
    if obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj, None, None
    raise CheckpointError(f"{path}: not a checkpoint: no 'model' state dict and not a bare state dict")


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
    heads are assumed."""
    try:
        vocab_size, n_embd = state_dict["transformer.wte.weight"].shape
        block_size = state_dict["transformer.wpe.weight"].size(0)
    except KeyError as e:
        raise CheckpointError(f"{path}: missing key {e.args[0]}, cannot infer the model's shape") from None
    n_layer = len({k.split(".")[2] for k in state_dict if k.startswith("transformer.h.")})
    return GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=n_layer,
                     n_head=max(1, n_embd // 64), n_embd=n_embd,
                     bias="transformer.ln_f.bias" in state_dict)


def make_config(config_dict, state_dict, path):
    if config_dict is None:
        return infer_config(state_dict, path)
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    try:
        return GPTConfig(**{k: v for k, v in config_dict.items() if k in fields})
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: bad model config: {e}") from None


def load_weights(model, state_dict, path):
    """load_state_dict(strict=True), with the first offending key or shape in one line."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state_dict]
    extra = [k for k in state_dict if k not in expected]
    if missing:
        raise CheckpointError(f"{path}: missing key {missing[0]} ({len(missing)} missing in all)")
    if extra:
        raise CheckpointError(f"{path}: unexpected key {extra[0]} ({len(extra)} unexpected in all)")
    for key, tensor in expected.items():
        if state_dict[key].shape != tensor.shape:
            raise CheckpointError(
                f"{path}: {key} has shape {tuple(state_dict[key].shape)}, "
                f"the config expects {tuple(tensor.shape)}")
    model.load_state_dict(state_dict, strict=True)  # copies into the model's fp32 parameters


# ---------------------------------------------------------------------------- tokenizers

def tokenizer_from_spec(spec, path):
    """A tiktoken.Encoding from a checkpoint's 'tokenizer' entry, never from the network.
    spec: {'mergeable_ranks': [bytes, ...], 'pat_str', 'special_tokens', 'name'} for a
    tokenizer carried inside, or {'encoding': NAME} for one of tiktoken's; None means gpt2."""
    spec = spec or {"encoding": "gpt2"}
    if "mergeable_ranks" in spec:
        ranks = {token: rank for rank, token in enumerate(spec["mergeable_ranks"])}
        return tiktoken.Encoding(name=spec.get("name", "bundled"), pat_str=spec["pat_str"],
                                 mergeable_ranks=ranks, special_tokens=spec["special_tokens"])
    name = spec.get("encoding", "gpt2")
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:  # tiktoken downloads on first use; here that fails in many ways
        cause = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise CheckpointError(
            f"{path}: needs tiktoken encoding '{name}', which could not be loaded offline ({cause}); "
            "copy tiktoken's cache for it to a folder and set TIKTOKEN_CACHE_DIR to that folder") from None


# ---------------------------------------------------------------------------- loading

def load_model(cls, path=None, device="cpu", dtype=torch.float32, report=print):
    """Build `cls` (GPT or KVCacheGPT) from a checkpoint; returns (model, tokenizer).

    With no path, the default chain is used. The weights are loaded in fp32 and then cast
    to dtype. `report` receives the one line that says what was loaded."""
    path = Path(path) if path else default_checkpoint()
    state_dict, config_dict, tokenizer_spec = split_checkpoint(read_checkpoint(path), path)
    state_dict = clean_state_dict(state_dict)
    config = make_config(config_dict, state_dict, path)
    model = cls(config)
    load_weights(model, state_dict, path)
    tokenizer = tokenizer_from_spec(tokenizer_spec, path)
    check_tokenizer_fits(tokenizer, config, path)
    report(f"loaded {path} ({describe(model)}, tokenizer {tokenizer.name}, {tokenizer.n_vocab} tokens)")
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def check_tokenizer_fits(tokenizer, config, path):
    """Every token id must have a row in the embedding table (more rows are fine: padding)."""
    if tokenizer.n_vocab > config.vocab_size:
        raise CheckpointError(
            f"{path}: tokenizer has {tokenizer.n_vocab} tokens but the model only {config.vocab_size}")


def describe(model):
    c = model.config
    return (f"{model.num_params() / 1e6:.2f}M params, {c.n_layer} layers, {c.n_head} heads, "
            f"{c.n_embd} dims, context {c.block_size}")


def save_checkpoint(path, model, tokenizer_spec=None, dtype=None, **extra):
    """Write {'model', 'config', 'tokenizer', ...extra}: plain data that weights_only loads.
    dtype (e.g. torch.float16) shrinks the file; load_model brings it back to fp32."""
    state_dict = model.state_dict()
    del state_dict["lm_head.weight"]  # tied to wte: saving it twice would double a cast file
    if dtype is not None:
        state_dict = {k: v.to(dtype) for k, v in state_dict.items()}
    obj = {"model": state_dict, "config": dataclasses.asdict(model.config), **extra}
    if tokenizer_spec is not None:
        obj["tokenizer"] = tokenizer_spec
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, path)
