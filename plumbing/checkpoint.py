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
Every file is read through plumbing/files.py, every config built by plumbing/model_config.py
and every tokenizer by plumbing/tokenizer.py, each checked as it is made; the weights are
checked here, in build_model, the one place a model is built (for plumbing/hf.py too).
"""

import contextlib
import dataclasses
import math
from pathlib import Path

import torch
import torch.nn as nn

from base_model import GPT
from generation import dense_matmul
from llama import Llama
from plumbing.files import read_checkpoint
from plumbing.mapped_pages import release_file_pages
from plumbing.memory import check_fits_in_memory, model_memory
from plumbing.model_config import LAYER_KEY, layer_indices, make_config
from plumbing.progress import Progress
from plumbing.script import CheckpointError, short_repr
from plumbing.tokenizer import encoding_from_spec
from weight_quant import linear_quantizer

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


# ---------------------------------------------------------------------------- weights

LAYER_PREFIX = {"gpt": "transformer.h", "llama": "model.layers"}  # where each family's blocks live
# the weight a tied output layer shares
EMBEDDING = {"gpt": "transformer.wte.weight", "llama": "model.embed_tokens.weight"}


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
    Finiteness takes one read per tensor (all_finite). Without this check, NaN weights
    decode as token 0 (a NUL byte) at exit status 0."""
    seen = set()
    for key, value in state_dict.items():
        if id(value) in seen:  # lm_head is wte: read it once
            continue
        seen.add(id(value))
        if not value.is_floating_point() or value.layout != torch.strided:
            raise CheckpointError(f"{source}: {key} holds {value.dtype} values ({value.layout}); "
                                  "weights must be dense floating-point tensors")
        if not all_finite(value):
            bad = int((~torch.isfinite(value)).sum())
            raise CheckpointError(f"{source}: {key} holds {bad:,} NaN or infinite value(s) of "
                                  f"{value.numel():,}: the file is damaged or its training diverged")


def all_finite(value):
    """Whether every value is finite: its least and its greatest are (a NaN anywhere makes
    both NaN), found in one pass in the tensor's own dtype, with no temporary. Measured on
    this project's 2-core Xeon, one of Llama-3.2-1B's bf16 shards (64M values): 10 ms,
    against 14-23 ms for a sum in fp32 chunks and ~75 ms for torch.isfinite(t).all(), which
    writes a bool per value first."""
    if value.numel() == 0:
        return True
    least, greatest = torch.aminmax(value)
    return math.isfinite(least.item()) and math.isfinite(greatest.item())


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


def check_tokenizer_fits(tokenizer, config, source):
    """Every token id must have a row in the embedding table (more rows are fine: padding)."""
    if tokenizer.n_vocab > config.vocab_size:
        raise CheckpointError(
            f"{source}: tokenizer has {tokenizer.n_vocab} tokens but the model only {config.vocab_size}")


# ---------------------------------------------------------------------------- loading

def build_model(classes, config, state_dict, tokenizer, source, device="cpu", dtype=torch.float32,
                quantize=None, group_size=None, show_progress=True):
    """The model of config's family, built by classes[family] (NAIVE_MODELS, or
    kv_cache.CACHED_MODELS) and holding state_dict on `device` in `dtype`, once everything
    about it is checked: the tokenizer fits the vocabulary, (before the model's n layers are
    constructed) the layers are there, then every key and shape, and each weight as it is
    put in. Both loaders come through here, so that no script can skip a check.

    The model is built on the meta device: shapes, no memory and no random initialisation;
    fill_model then gives it the file's tensors. With quantize ("int8" or "int4", and int4's
    group_size), each Linear is quantized (weight_quant.linear_quantizer) as soon as its
    weight is in: the float weights of the whole model never exist at once (ValueError where
    the scheme cannot apply, before any weight is read). state_dict is emptied as it is
    read, so that a converted tensor's file pages are let go. show_progress: a line on a
    terminal's stderr says how far the loading is (plumbing/progress.py)."""
    if config.family not in classes:
        raise CheckpointError(f"{source}: a {config.family}-family model, which this command does "
                              f"not run (it runs {', '.join(classes)})")
    check_tokenizer_fits(tokenizer, config, source)
    dtype_name = str(dtype).removeprefix("torch.")
    check_fits_in_memory(*model_memory(config, quantize or dtype_name, dtype_name), source)
    check_layer_count(state_dict, config, source)
    tie_output_layer(state_dict, config)
    with built_on_meta():
        model = classes[config.family](config)
    check_weights(state_dict, model.state_dict(), source, config)
    replace_linear = None if quantize is None else linear_quantizer(model, quantize, group_size)
    what = f"loading {source}" + (f" (quantizing to {quantize})" if quantize else "")
    with Progress(what, file_bytes(state_dict), show_progress) as progress:
        fill_model(model, state_dict, source, device, dtype, replace_linear, progress)
    return model.eval()


@contextlib.contextmanager
def built_on_meta():
    """Modules constructed here are built on the meta device, with their random normal
    initialisation skipped: a meta tensor holds nothing to initialise, and torch's normal_
    on one runs through its Python reference kernels, whose first use imports torch._dynamo:
    ~1 s of a 1B model's start, a third of its time to the first token (docs/plumbing.md).
    (Not thread-safe: nn.init.normal_ itself is swapped while it lasts; loading runs alone.)"""
    normal = nn.init.normal_
    nn.init.normal_ = lambda tensor, *args, **kwargs: tensor
    try:
        with torch.device("meta"):
            yield
    finally:
        nn.init.normal_ = normal


def file_bytes(state_dict):
    """Bytes the state dict's tensors hold, a tensor named twice (a tied lm_head) once (as
    dense tensors: a sparse one, which the checks refuse, has no nbytes)."""
    return sum({id(t): t.numel() * t.element_size() for t in state_dict.values()}.values())


def fill_model(model, state_dict, source, device, dtype, replace_linear=None, progress=None):
    """Give a meta-built model its tensors, one module at a time, each checked (check_values)
    and then moved to device and dtype; replace_linear(linear) -> module, when given, is
    installed in each Linear's place once the Linear is loaded. A tensor already there (a
    memory-mapped file's, in the run's dtype) is assigned as it lies: its pages are the
    weights, no copy. Any other is converted alone, so that at most one tensor exists twice
    while loading. progress: a plumbing.progress.Progress, told the bytes of each module read.

    A file's pages are let go once read for the last time (plumbing/mapped_pages.py): a
    tensor converted to the run's dtype, a weight quantized, and the token embedding, read a
    row per token once loaded, as soon as nothing reads it whole: at once where the output
    layer is a matrix of its own, once that is quantized where it is the tied output layer
    (quantized right after the embedding, so that the table is never resident beside all
    the blocks), never where that is a float one (every step reads it whole)."""
    tied = tied_embedding(model)
    embedding = EMBEDDING[model.config.family].removesuffix(".weight")
    for name in loading_order(model, embedding, tied is not None):
        module = model.get_submodule(name)  # by name: a replaced Linear must not stay referenced
        if module is model.lm_head and tied is not None:
            module.weight = tied.weight  # assigning the embedding made it a new Parameter: tie again
        else:
            nbytes = load_own_tensors(module, name, state_dict, source, device, dtype)
            if progress is not None:
                progress.advance(nbytes)
        if replace_linear is not None and isinstance(module, nn.Linear):
            parent, _, child = name.rpartition(".")
            replacement = replace_linear(module)
            setattr(model.get_submodule(parent), child, replacement)
            if replacement is not module:  # quantized: its float weight is read no more (the
                release_file_pages(module.weight)  # tied head's is the embedding: rows only)
        if name == embedding and tied is None:
            release_file_pages(module.weight)  # read a row per token from here on
    state_dict.clear()  # the tied lm_head's entry, read as the embedding
    check_nothing_on_meta(model)


def loading_order(model, embedding, tied):
    """The model's module names in the order fill_model loads them: the model's own, except
    that a tied output layer comes right after its embedding."""
    names = [name for name, _ in model.named_modules() if name != "lm_head"]
    names.insert(names.index(embedding) + 1 if tied else len(names), "lm_head")
    return names


def load_own_tensors(module, name, state_dict, source, device, dtype):
    """Assign a module's own parameters (not its children's) from state_dict, popping them;
    returns the bytes they held in the file."""
    prefix = f"{name}." if name else ""
    own, nbytes = {}, 0
    for key, _ in module.named_parameters(recurse=False):
        tensor = state_dict.pop(prefix + key)
        check_values({prefix + key: tensor}, source)
        nbytes += tensor.nbytes
        own[key] = tensor.to(device=device, dtype=dtype)  # the same tensor where it already is
        if own[key] is not tensor:
            release_file_pages(tensor)  # converted: the file's copy is read no more
    if own:
        module.load_state_dict(own, strict=False, assign=True)
    return nbytes


def tied_embedding(model):
    """The embedding whose weight is the lm_head's, or None: read before loading, which
    gives each module a Parameter of its own."""
    return next((m for m in model.modules() if isinstance(m, nn.Embedding)
                 and m.weight is model.lm_head.weight), None)


def check_nothing_on_meta(model):
    """Every tensor of a meta-built model is real once filled: the file's, or (a Llama's
    rotary frequencies) computed on the CPU by __init__ itself (llama.rope_frequencies)."""
    for module_name, module in model.named_modules():
        tensors = {**dict(module.named_parameters(recurse=False)), **dict(module.named_buffers(recurse=False)),
                   **{k: v for k, v in vars(module).items() if isinstance(v, torch.Tensor)}}
        left = next((k for k, t in tensors.items() if t.is_meta), None)
        if left is not None:
            raise RuntimeError(f"{module_name or 'the model'}.{left} was not loaded: still on the meta device")


def tie_output_layer(state_dict, config):
    """A tied output layer is often saved once, as the embedding (safetensors refuses one
    tensor twice): give lm_head its tensor back, in state_dict itself (no second dict to
    hold the file's tensors). Only when the config ties them: an untied model without its
    lm_head is a missing key."""
    tied = config.family == "gpt" or config.tie_embeddings
    embedding = EMBEDDING[config.family]
    if tied and "lm_head.weight" not in state_dict and embedding in state_dict:
        state_dict["lm_head.weight"] = state_dict[embedding]


# ---------------------------------------------------------------------------- --dtype auto

def auto_dtype(saved, device, quantize=None):
    """(dtype, why): the dtype a checkpoint saved as `saved` runs in on `device` under
    --dtype auto: its own, where this device computes it at least as fast as float32.
    On a CPU with native bf16 arithmetic (AVX-512 BF16, AMX) where our bf16 kernel is built
    (dense_matmul.computes_bf16_natively), a bf16 or fp16 checkpoint computes in bfloat16:
    at Llama-3.2-1B's shape on a Zen 4 EPYC, 15-19 decoded tokens/s through generate.py
    against float32's 10.3, and 3.8x its prefill (docs/benchmarks.md). Elsewhere on
    a CPU it computes in float32: each tensor is converted as it is read, one float32 copy
    (twice the file), the size of the float32 format itself. A GPU keeps bfloat16 and
    float16.
    quantize ("int8", "int4"): on a CPU the quantized Linears compute in bfloat16 whatever
    the model's dtype (weight_quant.KERNEL_DTYPE), so a half-precision checkpoint stays in
    bfloat16 there: what is left in float (the embedding, the norms, an untied output layer)
    keeps the file's size instead of doubling (Llama-3-8B's embedding and head: 2.1 GB
    in bfloat16, 4.2 GB in float32)."""
    if saved == torch.float32:
        return saved, "the checkpoint's own"
    name = str(saved).removeprefix("torch.")
    if device.type == "cpu" and quantize is not None:
        return torch.bfloat16, (f"the checkpoint is {name} and --quantize {quantize}'s kernels "
                                "compute in bfloat16 on a CPU: what stays float stays bfloat16")
    if device.type == "cpu" and dense_matmul.computes_bf16_natively():
        return torch.bfloat16, (f"the checkpoint is {name} and this CPU multiplies bfloat16 in "
                                "hardware (AVX-512 BF16): faster than float32, half the memory")
    if device.type == "cpu":
        return torch.float32, (f"the checkpoint is {name}, and this CPU has no bfloat16 arithmetic "
                               "(AVX-512 BF16): float32 computes faster; converted while loading, "
                               "one float32 copy, twice the file")
    if saved == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float32, "the checkpoint is bfloat16, which this GPU does not compute"
    return saved, "the checkpoint's own"


def resolve_dtype(dtype, saved, device, quantize=None):
    """(dtype, the line to say or None): dtype itself, or for "auto" auto_dtype's pick, said
    in one line where the checkpoint is not float32 (a float32 one runs as it always did)."""
    if dtype != "auto":
        return dtype, None
    dtype, why = auto_dtype(saved, torch.device(device), quantize)
    if saved == torch.float32:
        return dtype, None
    return dtype, f"dtype {str(dtype).removeprefix('torch.')} ({why}; --dtype chooses another)"


def saved_dtype(obj):
    """The dtype a checkpoint of ours says its model computed in (save_checkpoint records
    it); float32 where it says nothing, as every model was trained in float32."""
    name = obj.get("dtype") if isinstance(obj, dict) else None
    return getattr(torch, name) if name in FLOAT_DTYPE_NAMES else torch.float32


FLOAT_DTYPE_NAMES = ("float32", "bfloat16", "float16")


def load_model(classes, path=None, device="cpu", dtype=torch.float32, report=print,
               quantize=None, group_size=None, show_progress=True):
    """Build a model from a checkpoint, with classes[family] (NAIVE_MODELS, or
    kv_cache.CACHED_MODELS); returns (model, tokenizer).

    With no path (None), the default chain is used; an empty string is refused. The weights
    are read from the memory-mapped file and put in the model in dtype ("auto": the one the
    checkpoint records, see auto_dtype), on device, one tensor at a time (build_model).
    `report` receives the one line that says what was loaded (and, under "auto" for a
    checkpoint not in float32, one that says which dtype and why)."""
    path = default_checkpoint() if path is None else path
    obj = read_checkpoint(path)
    state_dict, config_dict, tokenizer_spec = split_checkpoint(obj, path)
    dtype, dtype_line = resolve_dtype(dtype, saved_dtype(obj), device, quantize)
    del obj  # the state dict alone holds the file's tensors, and lets go of each once it is in
    state_dict = clean_state_dict(state_dict)
    config = make_config(config_dict, state_dict, path)
    tokenizer = encoding_from_spec(tokenizer_spec, path)
    model = build_model(classes, config, state_dict, tokenizer, path, device, dtype, quantize, group_size,
                        show_progress)
    report(f"loaded {path} ({describe(model)}, tokenizer {tokenizer.name}, {tokenizer.n_vocab} tokens)")
    if dtype_line:
        report(dtype_line)
    return model, tokenizer


def describe(model):
    c = model.config
    kv_heads = f" ({c.n_kv_head} key/value)" if c.n_kv_head != c.n_head else ""
    return (f"{model.num_params() / 1e6:.2f}M params, {c.n_layer} layers, {c.n_head} heads{kv_heads}, "
            f"{c.n_embd} dims, context {c.context_len}")


def save_checkpoint(path, model, tokenizer_spec=None, dtype=None, **extra):
    """Write {'model', 'config', 'dtype', 'tokenizer', ...extra}: plain data that weights_only
    loads. dtype (e.g. torch.float16) shrinks the file; 'dtype' records the model's own (what
    it computes in), which --dtype auto loads it back in."""
    state_dict = model.state_dict()
    c = model.config
    if c.family == "gpt" or c.tie_embeddings:
        del state_dict["lm_head.weight"]  # tied: saving it twice would double a cast file
    if dtype is not None:
        state_dict = {k: v.to(dtype) for k, v in state_dict.items()}
    config = {"family": c.family, **dataclasses.asdict(c)}
    computes_in = str(model.lm_head.weight.dtype).removeprefix("torch.")
    obj = {"model": state_dict, "config": config, "dtype": computes_in, **extra}
    if tokenizer_spec is not None:
        obj["tokenizer"] = tokenizer_spec
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, path)
