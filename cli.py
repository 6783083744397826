"""
What the command-line scripts share: the model flags, device and dtype choice, outputs
that are checked before the work and written atomically, and the rule that a user mistake
ends in one line on stderr and exit status 2, never a traceback.

Scripts import this module before torch (see the first lines below).
"""

import sys


def quiet_interrupt(kind, value, traceback, print_exception=sys.excepthook):
    """Ctrl-C while the imports below (torch: a second or more) still run ends the script
    without a traceback, as run() does once main() has started. (Python then ends the
    process by SIGINT itself, which the shell reports as status 130.)"""
    if not issubclass(kind, KeyboardInterrupt):
        print_exception(kind, value, traceback)


# Scripts import this module first, so that this holds from their first moments on.
sys.excepthook = quiet_interrupt

import argparse  # noqa: E402  (the imports come after the hook, on purpose)
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402


def fill_closed_standard_fds():
    """A script started with stdin, stdout or stderr closed (`<&-`, `>&-`, `2>&-`) has no
    file at descriptor 0, 1 or 2, so the next file it opens (a checkpoint, the --json
    output) would take that number, and what C code writes to "stderr" (torch's warnings)
    would land inside it. /dev/null takes each empty place first, before anything is opened.
    Python sets sys.stderr to None then, and print(..., file=None) prints to stdout: the
    "loaded" line and --stats went into --json's output. They go to /dev/null instead."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # open() returns the lowest free descriptor: fd
    if sys.stderr is None:
        sys.stderr = open(2, "w", closefd=False)


fill_closed_standard_fds()

# numpy before torch: torch imports it from C++ and drops any exception there, a Ctrl-C
# included (which then went unnoticed: the script ran on)
import numpy  # noqa: E402, F401
import torch  # noqa: E402  (after the hook and the descriptors, on purpose)

from base_model import store_linears_column_major  # noqa: E402
from checkpoint import CheckpointError, load_model  # noqa: E402
from quantize import INT4_GROUP_SIZE, INT4_GROUP_SIZES, SCHEMES, quantize_model  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# torch's CPU generator (mt19937) keeps only the low 32 bits of a seed: seeds 5 and 2**32+5
# give the same text, so --seed accepts exactly the values that differ.
SEED_RANGE = range(2 ** 32)


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
    source.add_argument("--hf", metavar="DIR", help="a local Hugging Face GPT-2 directory "
                        "(config.json and model.safetensors or pytorch_model.bin)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                        help="auto picks cuda, then mps, then cpu (default: auto)")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES),
                        help="weights and activations (default: float32)")
    parser.add_argument("--seed", type=seed_int, default=1337,
                        help=f"random seed, 0..{SEED_RANGE[-1]} (default: 1337)")
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
    load, path = load_model, args.ckpt
    if args.hf is not None:  # "" is refused by the loader, not taken for "no --hf"
        from hf_gpt2 import load_hf_model as load  # only --hf users need this bridge
        path = args.hf
    model, tokenizer = load(cls, path, device=device, dtype=dtype,
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


# ---------------------------------------------------------------------------- outputs

MARK = "kvcache-gpt"  # what every file we write carries, so that we know it is ours


def is_our_json(head, path):
    """A JSON object we wrote: its "generator" says kvcache-gpt (see json_text)."""
    if path.stat().st_size > 64 << 20:  # our reports are kilobytes; do not parse a huge file
        return False
    try:
        obj = json.loads(path.read_bytes())
    except (ValueError, RecursionError):
        return False
    return isinstance(obj, dict) and str(obj.get("generator", "")).startswith(MARK)


# How a file we wrote is recognised, per output kind: from its first 64 KiB (and the path).
# A PNG carries MARK in a text chunk (matplotlib's savefig(metadata={"Software": ...}));
# a GGUF must carry it in a string among its first metadata values (export_gguf.py).
OUR_FILES = {
    "json": is_our_json,
    "png": lambda head, path: head.startswith(b"\x89PNG\r\n\x1a\n") and MARK.encode() in head,
    "gguf": lambda head, path: head.startswith(b"GGUF") and MARK.encode() in head,
}


def check_output_path(path, kind):
    """Refuse, before any work is done, an output that cannot or must not be written; return
    it as a Path.

    kind: 'json', 'png' or 'gguf' for a file, which may replace an empty file or one an
    earlier run of ours wrote (OUR_FILES), never anything else (a checkpoint, a user's
    file); 'dir' for a directory to create, which may exist only empty. Refused also: an
    empty path (an unset shell variable), a name longer than the filesystem allows, a
    path under a file, a folder we cannot write to."""
    if str(path) == "":
        raise UserError(f"empty path given for the {kind} output (an unset shell variable?)")
    path = Path(path)
    try:
        return check_output_place(path, kind)
    except OSError as e:
        raise UserError(f"{path}: cannot write there ({e.strerror or type(e).__name__})") from None


def check_output_place(path, kind):
    """check_output_path's checks; OSError from the filesystem is left to it."""
    ancestor = path.absolute().parent
    while not ancestor.exists():  # the nearest existing folder: we would create the rest
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UserError(f"{path}: {ancestor} is a file, not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UserError(f"{path}: no permission to write in {ancestor}")
    name_max = os.pathconf(ancestor, "PC_NAME_MAX")
    too_long = next((part for part in path.parts if len(os.fsencode(part)) > name_max), None)
    if too_long:
        raise UserError(f"{path}: a name of {len(too_long)} characters; this filesystem allows {name_max}")
    if kind == "dir":
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            # never mix with an older export: HF would pick whichever weights file it prefers
            raise UserError(f"{path}: exists and is not an empty directory; choose a new one")
        return path
    if path.is_dir():
        raise UserError(f"{path}: is a directory; give a file name for the {kind} output")
    if path.exists() and not path.is_file():  # /dev/null, /dev/stdout, a FIFO: a stream
        return path
    if path.exists() and path.stat().st_size > 0:
        with open(path, "rb") as f:
            head = f.read(64 << 10)
        if not OUR_FILES[kind](head, path):
            raise UserError(f"{path}: exists and was not written by {MARK} as {kind}; "
                            "remove it or choose another path")
    return path


def import_pyplot():
    """matplotlib's pyplot for --plot (an optional extra), or one UserError line saying how to
    get it. Call it before the run, so that a missing one is found in a second rather than
    after minutes of measuring."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install matplotlib") from None
    return plt


def umask():
    """The process's umask (there is no way to read it without setting it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fsync_path(path):
    """Flush a written file or a folder's entries to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path, data):
    """Write `data` (bytes or str, or a function that writes a file at the path it is
    given) to `path` so that `path` is either its old self or complete, never half
    written: into a temporary file in the same folder, fsync'd, then renamed over `path`
    (a rename within a filesystem is atomic). On any failure (a full disk, Ctrl-C) the
    temporary file is removed and `path` is untouched; an OSError becomes one UserError
    line. Check the path with check_output_path before the work that produces data.
    A path that exists and is not a regular file (/dev/null, a FIFO) is a stream: written
    directly, as there is nothing to replace."""
    path = Path(path)
    if path.exists() and not path.is_file() and not path.is_dir():
        return write_stream(path, data)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name[:64]}.", suffix=".tmp")
    except OSError as e:
        raise UserError(f"{path}: cannot write it ({e.strerror or type(e).__name__})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            if not callable(data):
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
        if callable(data):
            data(tmp)
        fsync_path(tmp)
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp makes it private (0600); be a normal file
        os.replace(tmp, path)
        fsync_path(path.parent)  # the rename itself, durable
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise UserError(f"{path}: cannot write it ({e.strerror or type(e).__name__}); "
                            "nothing was written") from None
        raise


def write_stream(path, data):
    try:
        if callable(data):
            return data(path)
        with open(path, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
    except OSError as e:
        raise UserError(f"{path}: cannot write it ({e.strerror or type(e).__name__})") from None


@contextmanager
def new_directory(path):
    """`with new_directory(out) as tmp:` fill tmp; `out` appears, complete, only when the
    block ends without an error. tmp is a fresh folder beside `out`, renamed to it at the
    end (replacing `out` if that is an empty folder); on any failure it is removed, so an
    interrupted export leaves nothing that blocks the next attempt. OSError -> UserError."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name[:64]}.", suffix=".tmp"))
    except OSError as e:
        raise UserError(f"{path}: cannot create it ({e.strerror or type(e).__name__})") from None
    try:
        yield tmp
        for file in tmp.iterdir():
            fsync_path(file)
        os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes it private (0700)
        os.replace(tmp, path)  # POSIX rename: replaces an empty folder, fails on a full one
        fsync_path(path.parent)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise UserError(f"{path}: cannot write it ({e.strerror or type(e).__name__}); "
                            "nothing was written") from None
        raise


def finite_or_none(obj):
    """obj with every NaN or infinity (a rate over zero seconds, a loss that overflowed)
    replaced by None, through dicts and lists."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj


def json_text(obj, generator=None, **dumps_args):
    """JSON that every parser reads: json.dumps writes NaN and Infinity, which are not JSON,
    so they become null. generator="kvcache-gpt <script>" marks a JSON object as ours, which
    check_output_path(path, "json") looks for before replacing a file."""
    if generator is not None:
        obj = {"generator": f"{MARK} {generator}", **obj}
    return json.dumps(finite_or_none(obj), allow_nan=False, **dumps_args)


# ---------------------------------------------------------------------------- running

def check_standard_streams():
    """Results written to a closed stdout would vanish while the script reports success:
    say so instead (Python sets sys.stdout to None when descriptor 1 was closed). A
    terminal or PYTHONIOENCODING that is not UTF-8 (latin-1, ascii) cannot show every
    character of a generated text: those are written as \\u escapes rather than failing."""
    if sys.stdout is None:
        raise UserError("standard output is closed (>&-); redirect it to a file or to /dev/null")
    if sys.stdout.errors == "strict":
        sys.stdout.reconfigure(errors="backslashreplace")


def run(main):
    """Call main(); a user mistake prints one line and exits 2, Ctrl-C exits 130 quietly."""
    try:
        check_standard_streams()
        main()
    except (UserError, CheckpointError) as e:
        # one line even when the message quotes a path or a value with a newline in it
        message = str(e).replace("\r", "\\r").replace("\n", "\\n")
        print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:  # output piped into `head`, which closed early
        sys.stderr.close()
        sys.exit(0)
