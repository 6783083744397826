"""
A model's config from data, every field checked before anything is built: the one place a
GPTConfig or a LlamaConfig is made from a file. Our checkpoints and nanoGPT's carry a dict
of fields (make_config), a bare state dict has only its shapes (infer_config), and a
Hugging Face config.json is renamed into the same fields (plumbing/hf.py's gpt2_config,
plumbing/hf_llama.py's llama_config) and checked here too.

After config_from_dict a loader may trust that every field has the right type and is in
range, and that the model described fits in this machine's memory (else the one line
says what it would cost).
"""

import math
import re

from base_model import GPTConfig
from llama import ROPE_TYPES, LlamaConfig
from plumbing.memory import check_fits_in_memory, model_memory

# the least a loader can make of a model (weights, cache): a config that does not fit even
# so is refused here; checkpoint.build_model checks the run's own form again
SMALLEST_FORM = ("int4", "bfloat16")
from plumbing.script import CheckpointError, short_repr

SHAPE_FIELDS = ("context_len", "vocab_size", "n_layer", "n_head", "n_embd")
# What other files call a field: nanoGPT's checkpoints (and older ones of ours) call the
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
    return gpt_config_from_dict(fields, source, names)


def gpt_config_from_dict(fields, source, names):
    """A GPTConfig from its fields (nanoGPT's or ours), every one checked."""
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
    check_fits_in_memory(*model_memory(config, *SMALLEST_FORM), source)
    return config


def is_number(value, low=0.0, high=math.inf):
    """A finite int or float (not a bool) with low < value < high."""
    return type(value) in (int, float) and math.isfinite(value) and low < value < high


def llama_config_from_dict(fields, source, names):
    """A LlamaConfig from its fields, every one checked (what gpt_config_from_dict does for GPT-2)."""
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
    check_fits_in_memory(*model_memory(config, *SMALLEST_FORM), source)
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


# ---------------------------------------------------------------------------- from the weights

LAYER_KEY = re.compile(r"(?:transformer\.h|model\.layers)\.(\d+)\.")


def layer_indices(state_dict):
    """The block numbers that a state dict holds weights for."""
    return {int(m.group(1)) for m in map(LAYER_KEY.match, state_dict) if m}


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
