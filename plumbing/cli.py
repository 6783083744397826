"""
The command line the commands share: the model flags (--ckpt or --hf, --device, --dtype,
--seed, --quantize), the speculative-decoding flags (--speculate with --prompt-lookup or
--draft), argument types, and loading the models those flags name.

Errors a user can fix are UserError (plumbing/script.py): run() prints them as one line.
"""

import argparse
import os
import sys
from pathlib import Path

import torch

from base_model import store_linears_column_major
from generation.cpu_layout import pack_linears
from generation.speculative import DraftModel, PromptLookup
from generation.step_cache import OFF_VARIABLE
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


def positive_int_list(text):
    """Comma-separated positive integers, sorted, each once: "16,1,4" -> [1, 4, 16]."""
    return sorted({positive_int(x) for x in text.split(",")})


def add_benchmark_args(parser, tokens, per="run"):
    """The flags every decode benchmark takes: --tokens (default `tokens`, new tokens per
    `per`), --reps and --json."""
    parser.add_argument("--tokens", type=positive_int, default=tokens,
                        help=f"new tokens per {per} (default: {tokens})")
    parser.add_argument("--reps", type=positive_int, default=3, help="timed runs after a warm-up (default: 3)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")


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
    parser.add_argument("--dtype", default="auto", choices=["auto", *FLOAT_DTYPES],
                        help="weights and activations; auto: the checkpoint's own where this device "
                        "computes it as fast as float32, else float32 (on a CPU a bfloat16 or float16 "
                        "checkpoint runs in float32, in bfloat16 with --quantize); one line on stderr "
                        "says which (default: auto)")
    parser.add_argument("--seed", type=seed_int, default=1337,
                        help=f"random seed, 0..{SEED_RANGE[-1]} (default: 1337)")
    parser.add_argument("--quantize", default="none", choices=["none", *SCHEMES],
                        help="weight-only quantization of every Linear as it is loaded: int8 per "
                        "channel, or int4 per group of --group-size inputs (default: none; see weight_quant.py)")
    parser.add_argument("--group-size", type=int, choices=INT4_GROUP_SIZES, help="input channels "
                        f"sharing a scale with --quantize int4 (default: {INT4_GROUP_SIZE}, or 32 for a model "
                        "whose widths 64 does not divide)")


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
    """The torch dtype --dtype names, or "auto" for the loader to choose (checkpoint.auto_dtype)."""
    if name == "auto":
        return name
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
    model, tokenizer = load_source(classes, args.ckpt, args.hf, device, dtype, quantize_args=args,
                                   show_progress=not getattr(args, "json", False))
    return prepare_for_generation(model, args), tokenizer, device


def load_source(classes, ckpt=None, hf=None, device="cpu", dtype=torch.float32, report=None,
                quantize_args=None, show_progress=True):
    """A model (classes[family]) from a checkpoint file (None: the default chain) or, when hf
    is given, a Hugging Face directory: (model, tokenizer). The one place a command chooses
    between the two loaders; report(line) receives the line saying what was loaded
    (default: stderr). quantize_args: the parsed --quantize and --group-size, applied to
    each Linear as it is loaded. show_progress: a line on a terminal says how far loading is
    (plumbing/progress.py; off for --json)."""
    if report is None:
        def report(line):
            print(line, file=sys.stderr)
    scheme = quantize_args.quantize if quantize_args is not None else "none"
    options = {"show_progress": show_progress}
    if scheme != "none":
        options.update(quantize=scheme, group_size=quantize_args.group_size)
    try:
        if hf is not None:  # "" is refused by the loader, not taken for "no --hf"
            return load_hf_model(classes, hf, device=device, dtype=dtype, report=report, **options)
        return load_model(classes, ckpt, device=device, dtype=dtype, report=report, **options)
    except UserError:
        raise
    except ValueError as e:  # the scheme does not apply to this model's widths
        raise quantize_error(e, quantize_args) from None


def prepare_for_generation(model, args):
    """What every model a script generates from goes through after loading (the naive twin
    of a comparison too, so that both loops run the same weights the same way): --quantize
    (already done by the loaders: then it finds no Linear left to quantize), then the large
    Linears left in float32 on the CPU packed for oneDNN (generation/cpu_layout.py: batches,
    prefills and the serving engine's steps) and the bfloat16 ones (and a tied float32 table
    too large to pack twice) given our decode kernel (generation/dense_matmul.py), then the decode-speed layout for the float32 ones left
    (base_model.store_linears_column_major). Each step re-lays one weight at a time, in place
    of the one it re-lays."""
    return store_linears_column_major(pack_linears(quantize_from_args(model, args)))


def quantize_from_args(model, args):
    """Apply --quantize (and --group-size) to a model already on its device and dtype."""
    if args.quantize != "none":
        try:
            quantize_model(model, args.quantize, args.group_size)
        except ValueError as e:
            raise quantize_error(e, args) from None
    return model


def quantize_error(error, args):
    """The one line for a --quantize the model's widths refuse, with what to try instead."""
    smaller = args.group_size and args.group_size > INT4_GROUP_SIZES[0]
    hint = f"--group-size {INT4_GROUP_SIZES[0]} or --quantize int8" if smaller else "--quantize int8"
    return UserError(f"--quantize {args.quantize}: {error}; try {hint}")


# ---------------------------------------------------------------------------- the compiled step's cache

def add_compile_cache_arg(parser):
    """--no-compile-cache, beside a script's --compile (generation/step_cache.py)."""
    parser.add_argument("--no-compile-cache", action="store_true", help="build every "
                        "compiled step afresh (--compile) and keep or load none (default: it is kept in "
                        "~/.cache/kvcache-gpt/compiled-steps, or $KVCACHE_GPT_CACHE_DIR, and "
                        "loaded by the next start with the same model on this machine)")


def use_compile_cache_arg(parser, args):
    """--no-compile-cache needs --compile (one line, exit 2), or a script whose default
    (args.compile None) loads cached steps. Given, it sets the variable the library reads,
    so every step this process builds (a draft's, a server's) is built afresh."""
    if args.no_compile_cache and args.compile is False:
        parser.error("--no-compile-cache applies to --compile; add it, or drop --no-compile-cache")
    if args.no_compile_cache:
        os.environ[OFF_VARIABLE] = "1"


# ---------------------------------------------------------------------------- speculation

def add_speculation_args(parser):
    """--speculate K and its proposer (generation/speculative.py; serve.py's engine:
    serving/speculation.py)."""
    parser.add_argument("--speculate", type=positive_int, metavar="K", help="speculative "
                        "decoding: propose K tokens per step and check them in one pass of the "
                        "model (greedy text unchanged, sampling from the same distribution); "
                        "with --prompt-lookup or --draft")
    proposer = parser.add_mutually_exclusive_group()
    proposer.add_argument("--prompt-lookup", type=ngram_size, metavar="N", help="propose what "
                          "followed the last up-to-N tokens (N: 1..16) where they occurred before, "
                          "in the prompt or the text so far")
    proposer.add_argument("--draft", metavar="CKPT_OR_DIR", help="propose with a smaller model "
                          "that has the same tokenizer: a checkpoint file or a Hugging Face "
                          "directory (bundled: checkpoints/shakespeare-draft/ckpt.pt); it loads "
                          "with the same --device, --dtype and --quantize")


def ngram_size(text):
    value = positive_int(text)
    if value > PromptLookup.MAX_NGRAM:
        raise argparse.ArgumentTypeError(f"must be <= {PromptLookup.MAX_NGRAM} (the lookup's index "
                                         f"holds every n-gram up to N of the text), got {value}")
    return value


def check_speculation_args(parser, args):
    """The flags must come together: one line (exit 2) otherwise."""
    has_proposer = args.prompt_lookup is not None or args.draft is not None
    if args.speculate and not has_proposer:
        parser.error("--speculate K needs a proposer: --prompt-lookup N or --draft CKPT_OR_DIR")
    if has_proposer and not args.speculate:
        flag = "--prompt-lookup" if args.prompt_lookup is not None else "--draft"
        parser.error(f"{flag}: also give --speculate K, how many tokens to propose per step")


def proposer_from_args(classes, args, model, tokenizer, device):
    """The proposer the flags name for `model`, or None without --speculate; a draft is
    built by classes[its family] (kv_cache.CACHED_MODELS), whatever the model's family."""
    if not args.speculate:
        return None
    check_speculate(args.speculate, model)
    if args.prompt_lookup is not None:
        return PromptLookup(args.prompt_lookup)
    return DraftModel(load_draft(classes, args.draft, tokenizer, device, args, flag="--draft"))


def check_speculate(k, model):
    """--speculate K against the model's context, before anything is loaded or run."""
    context_len = model.config.context_len
    if k >= context_len:  # the step feeds the newest token and K proposals
        raise UserError(f"--speculate {k}: a step checks K proposals after the newest token, "
                        f"K + 1 positions in a context of {context_len}; use at most {context_len - 1}")


def load_draft(classes, path, tokenizer, device, args, flag="--draft", report=None):
    """A draft model from a checkpoint file or a Hugging Face directory, built by
    classes[its own family] (kv_cache.CACHED_MODELS: a GPT-2 draft for a Llama model is
    fine, and the other way round; only the tokenizer must be the same), loaded the
    way the model was (args: its --dtype, --quantize, --group-size; the decode-speed layout),
    on `device`. Refused in one line naming `flag` when it cannot be loaded or its tokenizer
    is not the model's: its proposals are token ids. report(line) receives the "loaded" line
    (default: stderr, as "loaded draft ...")."""
    if report is None:
        def report(line):
            print(line.replace("loaded ", "loaded draft ", 1), file=sys.stderr)
    source = {"hf": path} if path and Path(path).is_dir() else {"ckpt": path}
    try:
        draft, draft_tokenizer = load_source(classes, **source, device=device, report=report,
                                             dtype=pick_dtype(args.dtype, device), quantize_args=args)
        difference = tokenizer_difference(draft_tokenizer, tokenizer)
        if difference:
            raise UserError(f"{path}: its tokenizer ({draft_tokenizer.name}) is not the model's "
                            f"({tokenizer.name}): {difference}; a draft proposes token ids, so "
                            "it needs the model's tokenizer")
        return prepare_for_generation(draft, args)
    except UserError as e:  # which of the two paths was wrong: say it is the draft
        raise UserError(f"{flag}: {e}") from None


def tokenizer_difference(draft, model):
    """Why two tokenizers do not give every id the same bytes (all a draft needs to share
    with the model), or None when they do."""
    if draft.n_vocab != model.n_vocab:
        return f"a vocabulary of {draft.n_vocab} tokens, the model's {model.n_vocab}"
    if draft.eot_token != model.eot_token:
        return f"end of text is token {draft.eot_token}, the model's {model.eot_token}"
    for i in range(draft.n_vocab):
        theirs, ours = token_bytes(draft, i), token_bytes(model, i)
        if theirs != ours:
            return f"token {i} is {theirs!r}, the model's {ours!r}"
    return None


def token_bytes(tokenizer, i):
    """The bytes of token i, or None where the vocabulary has no token i (ids may have gaps)."""
    try:
        return tokenizer.decode_single_token_bytes(i)
    except KeyError:
        return None
