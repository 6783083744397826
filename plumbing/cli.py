"""
The command line the commands share: the model flags (--ckpt or --hf, --device, --dtype,
--seed, --quantize), argument types, and loading the model those flags name.

Errors a user can fix are UserError (plumbing/script.py): run() prints them as one line.
"""

import argparse
import sys

import torch

from base_model import store_linears_column_major
from kv_quant import FLOAT_DTYPES
from plumbing.checkpoint import load_model
from plumbing.hf import load_hf_model
from plumbing.script import UserError
from weight_quant import INT4_GROUP_SIZE, INT4_GROUP_SIZES, SCHEMES, quantize_model

# torch's CPU generator (mt19937) keeps only the low 32 bits of a seed: seeds 5 and 2**32+5
# give the same text, so --seed accepts exactly the values that differ.
SEED_RANGE = range(2 ** 32)


class ArgumentParser(argparse.ArgumentParser):
    """argparse prints the whole usage block on an error; one line is easier to read."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def seed_int(text):
    value = int(text)
    if value not in SEED_RANGE:
        raise argparse.ArgumentTypeError(f"must be in 0..{SEED_RANGE[-1]} (torch's CPU generator "
                                         f"keeps 32 bits), got {value}")
    return value


def add_model_args(parser):
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--ckpt", help="checkpoint file (default: checkpoints/ckpt_sft.pt, "
                        "then checkpoints/ckpt_base.pt, then the bundled Shakespeare model)")
    source.add_argument("--hf", metavar="DIR", help="a local Hugging Face directory of GPT-2, "
                        "Llama, Mistral, Qwen2 or Qwen3 (config.json, model.safetensors or "
                        "pytorch_model.bin or their shards, the tokenizer's files)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                        help="auto picks cuda, then mps, then cpu (default: auto)")
    parser.add_argument("--dtype", default="float32", choices=list(FLOAT_DTYPES),
                        help="weights and activations (default: float32)")
    parser.add_argument("--seed", type=seed_int, default=1337,
                        help=f"random seed, 0..{SEED_RANGE[-1]} (default: 1337)")
    parser.add_argument("--quantize", default="none", choices=["none", *SCHEMES],
                        help="weight-only quantization of every Linear after loading: int8 per "
                        "channel, or int4 per group of --group-size inputs (default: none; see weight_quant.py)")
    parser.add_argument("--group-size", type=int, choices=INT4_GROUP_SIZES, help="input channels "
                        f"sharing a scale with --quantize int4 (default: {INT4_GROUP_SIZE})")


def pick_device(name):
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA GPU is visible to this PyTorch build; use --device cpu")
    if name == "mps" and not torch.backends.mps.is_available():
        raise UserError("--device mps: Apple's Metal backend is not available here; use --device cpu")
    return torch.device(name)


def pick_dtype(name, device):
    dtype = FLOAT_DTYPES[name]
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError("--dtype bfloat16: this GPU has no bfloat16 support; use --dtype float16")
    return dtype


def load_from_args(classes, args):
    """(model, tokenizer, device) for the --ckpt/--hf/--device/--dtype/--quantize flags;
    seeds torch. classes: family -> the class that builds it (checkpoint.NAIVE_MODELS,
    kv_cache.CACHED_MODELS)."""
    if args.group_size and args.quantize != "int4":
        raise UserError("--group-size applies to --quantize int4 only")
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    torch.manual_seed(args.seed)
    model, tokenizer = load_source(classes, args.ckpt, args.hf, device, dtype)
    return prepare_for_generation(model, args), tokenizer, device


def load_source(classes, ckpt=None, hf=None, device="cpu", dtype=torch.float32, report=None):
    """A model (classes[family]) from a checkpoint file (None: the default chain) or, when hf
    is given, a Hugging Face directory: (model, tokenizer). The one place a command chooses
    between the two loaders; report(line) receives the line saying what was loaded
    (default: stderr)."""
    if report is None:
        def report(line):
            print(line, file=sys.stderr)
    if hf is not None:  # "" is refused by the loader, not taken for "no --hf"
        return load_hf_model(classes, hf, device=device, dtype=dtype, report=report)
    return load_model(classes, ckpt, device=device, dtype=dtype, report=report)


def prepare_for_generation(model, args):
    """What every model a script generates from goes through after loading (the naive twin
    of a comparison too, so that both loops run the same weights the same way): the
    decode-speed weight layout (base_model.store_linears_column_major), then --quantize."""
    return quantize_from_args(store_linears_column_major(model), args)


def quantize_from_args(model, args):
    """Apply --quantize (and --group-size) to a model already on its device and dtype."""
    if args.quantize != "none":
        try:
            quantize_model(model, args.quantize, args.group_size or INT4_GROUP_SIZE)
        except ValueError as e:
            raise UserError(f"--quantize {args.quantize}: {e}; try --quantize int8") from None
    return model
