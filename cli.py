"""
What the command-line scripts share: the model flags, device and dtype choice, and the
rule that a user mistake ends in one line on stderr and exit status 2, never a traceback.
"""

import argparse
import sys
from pathlib import Path

import torch

from base_model import store_linears_column_major
from checkpoint import CheckpointError, load_model
from quantize import INT4_GROUP_SIZE, INT4_GROUP_SIZES, SCHEMES, quantize_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UserError(ValueError):
    """Bad input from the user; its message is the one line they will see."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse prints the whole usage block on an error; one line is easier to read."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_model_args(parser):
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--ckpt", help="checkpoint file (default: checkpoints/ckpt_sft.pt, "
                        "then checkpoints/ckpt_base.pt, then the bundled Shakespeare model)")
    source.add_argument("--hf", metavar="DIR", help="a local Hugging Face GPT-2 directory "
                        "(config.json and model.safetensors or pytorch_model.bin)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                        help="auto picks cuda, then mps, then cpu (default: auto)")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES),
                        help="weights and activations (default: float32)")
    parser.add_argument("--seed", type=int, default=1337, help="random seed (default: 1337)")
    parser.add_argument("--quantize", default="none", choices=["none", *SCHEMES],
                        help="weight-only quantization of every Linear after loading: int8 per "
                        "channel, or int4 per group of --group-size inputs (default: none; see quantize.py)")
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
    dtype = DTYPES[name]
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError("--dtype bfloat16: this GPU has no bfloat16 support; use --dtype float16")
    return dtype


def load_from_args(cls, args):
    """(model, tokenizer, device) for the --ckpt/--device/--dtype/--quantize flags; seeds torch."""
    if args.group_size and args.quantize != "int4":
        raise UserError("--group-size applies to --quantize int4 only")
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    torch.manual_seed(args.seed)
    load = load_model
    if args.hf:
        from hf_gpt2 import load_hf_model as load  # only --hf users need this bridge
    model, tokenizer = load(cls, args.hf or args.ckpt, device=device, dtype=dtype,
                            report=lambda line: print(line, file=sys.stderr))
    return prepare_for_generation(model, args), tokenizer, device


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


def run(main):
    """Call main(); a user mistake prints one line and exits 2, Ctrl-C exits 130 quietly."""
    try:
        main()
    except (UserError, CheckpointError) as e:
        print(f"{Path(sys.argv[0]).name}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:  # output piped into `head`, which closed early
        sys.stderr.close()
        sys.exit(0)
