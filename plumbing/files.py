"""
Reading a file we were given, safely: a regular file, whose (uncompressed) contents fit in
memory, parsed as data and never run. Every loader reads through here: our checkpoints,
a Hugging Face directory's JSON and weight files, tokenizer files.

A checkpoint is data, never code: torch.load runs with weights_only=True, which refuses
pickles that would construct arbitrary objects. Every failure is one CheckpointError line.
"""

import json
import pickle
import re
import stat
import zipfile
from pathlib import Path

import torch

from plumbing.memory import check_fits_in_memory, format_bytes
from plumbing.script import CheckpointError

# Python objects unpickled or parsed from JSON take more room than their bytes in the file.
# The worst case is a container of empty containers: one or two bytes of pickle or JSON
# each, ~64 bytes of Python object (sys.getsizeof of [] or {}) plus an 8-byte pointer.
# Real files are ~10x (a vocab.json entry: a short str, an int, a dict slot).
PYTHON_OBJECTS_PER_FILE_BYTE = 40
# torch.save stores every entry of its archive uncompressed (so that tensors can be read,
# or memory-mapped, in place), and trained weights barely compress (~1.1x). An entry that
# expands more than this from a stored size over a megabyte is not weights: a zip bomb.
MAX_COMPRESSION_RATIO = 10


def check_input_file(path, what="checkpoint file"):
    """A Path to a regular file, or one line saying why not. An empty string is refused
    rather than read as '.': an unset shell variable must not silently change what runs."""
    if str(path) == "":
        raise CheckpointError(f"empty path given for the {what} (an unset shell variable?)")
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except OSError as e:  # a name too long, a loop of symlinks, a path under a file
        raise CheckpointError(f"{path}: cannot read it ({e.strerror or type(e).__name__})") from None
    if stat.S_ISDIR(mode):
        raise CheckpointError(f"{path}: is a directory, expected a {what}")
    if not stat.S_ISREG(mode):  # a FIFO would block forever, a device never end
        raise CheckpointError(f"{path}: not a regular file, expected a {what}")
    return path


def check_file_fits(path, factor=1):
    """A file read whole (times `factor` for what parsing it makes) must fit in memory."""
    size = path.stat().st_size
    check_fits_in_memory(size * factor, f"reading this {size:,}-byte file", path)


def read_json(file, max_bytes=None):
    """A JSON file's contents, after checking that parsing it fits in memory (and, for a
    config, that it is not far larger than any config is)."""
    size = file.stat().st_size
    if max_bytes is not None and size > max_bytes:
        raise CheckpointError(f"{file}: {size:,} bytes, too large for a {file.name} "
                              f"(at most {max_bytes:,})")
    check_file_fits(file, PYTHON_OBJECTS_PER_FILE_BYTE)
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise CheckpointError(f"{file}: not readable JSON ({type(e).__name__})") from None


def check_archive_fits(path):
    """torch.save writes a zip archive; its central directory, read without extracting
    anything, gives every entry's uncompressed size. A small file whose entries are
    compressed may expand to gigabytes inside torch.load: refuse that before it starts.
    data.pkl becomes Python objects (x PYTHON_OBJECTS_PER_FILE_BYTE); the rest is tensor
    data, byte for byte."""
    check_file_fits(path)
    try:
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint (truncated or damaged?)") from None
    bomb = next((e for e in entries if e.file_size > 1 << 20
                 and e.file_size > MAX_COMPRESSION_RATIO * e.compress_size), None)
    if bomb is not None:
        raise CheckpointError(f"{path}: entry {bomb.filename} would expand from "
                              f"{format_bytes(bomb.compress_size)} to {format_bytes(bomb.file_size)}; "
                              "torch.save does not compress and weights do not compress like that")
    needed = sum(e.file_size * (PYTHON_OBJECTS_PER_FILE_BYTE if e.filename.endswith(".pkl") else 1)
                 for e in entries)
    check_fits_in_memory(needed, f"unpacking this checkpoint ({len(entries):,} entries)", path)


def read_checkpoint(path):
    """torch.load a file as data only, its tensors memory-mapped; every failure becomes one
    CheckpointError line."""
    path = check_input_file(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror})") from None
    # torch.save writes a zip archive (PK..); older files are a bare pickle (protocol byte
    # 0x80) followed by the raw tensor data, which is most of such a file
    archive = magic.startswith(b"PK\x03\x04")
    if archive:
        check_archive_fits(path)
    elif magic[:1] == b"\x80":
        check_file_fits(path)
    else:
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint (not a torch.save file)")
    try:
        # an archive's tensors are memory-mapped: read from the file when used, never copied
        # whole into memory first (a bare pickle cannot be: its tensors follow the pickle)
        return torch.load(path, map_location="cpu", weights_only=True, mmap=archive)
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
