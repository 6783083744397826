"""
The compiled steps kept on disk: a step is built once per model and machine, not at every
start.

Building a compiled step (compiled_step.py's build_program) takes 20-60 s on the bundled
model; loading the package it makes takes a fraction of a second. So each package is kept
in the user's cache folder, named by a key of everything the library depends on, and the
next start with the same key loads it:

    weights   where the library holds its own copy of the weights (a float32 model's,
              compiled_step.reads_own_weights), a hash of every parameter's and buffer's
              bytes, so that other weights never share a package (sha256 over copies at
              ~0.6 GB/s on a 2-core EPYC: 40 ms for the bundled model, about a second for
              GPT-2 small in fp32); where it reads the model's own (quantized, bf16), only
              their names, dtypes, shapes and strides: any checkpoint of that shape shares
              the package, and a 1B model's start skips 3-4 s of hashing
    modules   each module's type and settings (a quantized Linear's class, its group
              size and kernel; the model's config; the step's sampling settings, baked in)
    code      the project's source files of those classes and of the step: an edited
              forward() is another graph
    inputs    the example inputs' shapes, strides and dtypes, and the sizes that vary
    machine   torch's version, the CPU (its instruction-set flags) and the build options

The folder is $KVCACHE_GPT_CACHE_DIR, else $XDG_CACHE_HOME/kvcache-gpt/compiled-steps
(~/.cache/... by default); $KVCACHE_GPT_NO_COMPILE_CACHE (generate.py --no-compile-cache)
builds every step afresh. An entry is the package (KEY.pt2) and a manifest (KEY.json: the
key's fields and the package's sha256), each written under a temporary name and renamed,
so a reader sees a whole entry or none. An entry that does not match its manifest, or
that fails to load, is removed and built again; a folder that is not private (see
private_folder.py) is not used at all. The least recently used entries are removed past
MAX_BYTES.
"""

import dataclasses
import hashlib
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from generation.private_folder import UnsafeFolder, open_own, private_folder, write_new
from plumbing.ticker import Ticker

FOLDER_VARIABLE = "KVCACHE_GPT_CACHE_DIR"
OFF_VARIABLE = "KVCACHE_GPT_NO_COMPILE_CACHE"  # set, and not "" or "0": no cache
MAX_BYTES = 4 * 2**30  # the bundled model's package is ~25 MB, GPT-2 small's ~0.5 GB
PROJECT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------- the key

def step_key(program, example_inputs, dynamic_shapes, build_options, weights_inside=True):
    """The fields a built library depends on (the module docstring's table), as a dict of
    strings: program (an nn.Module holding the model) exported with these example inputs
    and dynamic shapes, built with these inductor options; weights_inside: whether the
    library holds a copy of the weights (else it reads the model's)."""
    modules = [type(m) for m in program.modules()]
    return {
        "weights": weights_hash(program) if weights_inside else weights_layout(program),
        "modules": [f"{name}: {type(m).__qualname__} {settings(m)}" for name, m in program.named_modules()],
        "code": code_hash(modules),
        "inputs": [f"{tuple(t.shape)} {t.stride()} {t.dtype} {t.device}" for t in example_inputs],
        "dynamic": [varying_sizes(d) for d in dynamic_shapes or ()],
        "torch": torch.__version__,
        "cpu": cpu_identity(),
        "build_options": repr(sorted(build_options.items())),
    }


def weights_hash(module):
    """sha256 over every parameter and buffer: its name, dtype, shape and bytes."""
    digest = hashlib.sha256()
    for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
        digest.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
        digest.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def weights_layout(module):
    """sha256 over every parameter's and buffer's name, dtype, shape and strides: all a
    library that reads the model's own tensors knows of them."""
    digest = hashlib.sha256()
    for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
        digest.update(f"{name} {t.dtype} {tuple(t.shape)} {t.stride()}".encode())
    return digest.hexdigest()


def settings(module):
    """A module's own settings: its attributes that are plain values (a group size, a dtype,
    the config, the sampling settings), not tensors or modules, as text. Not tuples: a
    tuple may hold a tensor's layout of the moment (cpu_layout.py's PackedLinear keeps its
    weight's strides in one), which changes nothing the graph computes."""
    plain = (bool, int, float, str, dict, torch.dtype, type(None))
    return {name: repr(value) for name, value in sorted(vars(module).items())
            if not name.startswith("_") and (isinstance(value, plain) or dataclasses.is_dataclass(value))}


def code_hash(classes):
    """sha256 of the source files (the project's, not torch's) that define these classes
    and their bases, and of this package's compiled step and the sampling it traces."""
    files = {Path(sys.modules[c.__module__].__file__).resolve()
             for cls in classes for c in cls.__mro__ if getattr(sys.modules[c.__module__], "__file__", None)}
    files |= {PROJECT / "generation" / "compiled_step.py", PROJECT / "sample.py"}
    digest = hashlib.sha256()
    for path in sorted(f for f in files if f.is_relative_to(PROJECT)):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def varying_sizes(shapes):
    """One input's dynamic shapes ({dim: torch.export.Dim}, or None) as text."""
    return {str(dim): f"{d.__name__} {d.min}..{d.max}" for dim, d in (shapes or {}).items()}


def cpu_identity():
    """The CPU as the built library sees it: torch's capability (AVX2, AVX512, ...) and, on
    Linux, the instruction-set flags the compiler may use (hashed: a long line)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return f"{torch.backends.cpu.get_cpu_capability()} {hashlib.sha256(flags.encode()).hexdigest()[:16]}"


# ---------------------------------------------------------------------------- the folder

def cache_folder():
    """Where the packages are kept, or None when the cache is off."""
    if os.environ.get(OFF_VARIABLE, "") not in ("", "0"):
        return None
    if os.environ.get(FOLDER_VARIABLE):
        return Path(os.environ[FOLDER_VARIABLE])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvcache-gpt" / "compiled-steps"


def load_or_build(key, build, load, build_missing=True):
    """The library for key (step_key's fields): loaded from the cache when an intact entry
    is there, else built and kept. build(path) writes a package at path; load(path)
    makes it the library. Says on stderr what it does: a build takes a while.
    build_missing=False: None where no intact entry is found (nothing is built)."""
    start = time.perf_counter()
    folder = usable_folder()
    if folder is None and not build_missing:
        return None
    if folder is None:
        with tempfile.TemporaryDirectory(prefix="kvcache-step-") as scratch:
            say("building the compiled step (not cached)...")
            library = load(built(Path(scratch), build))
    else:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        library = load_entry(folder, digest, key, load)
        if library is not None:
            say(f"compiled step loaded from the cache ({time.perf_counter() - start:.1f} s)")
            return library
        if not build_missing:
            return None
        say(f"building the compiled step (once per model and machine; cached in {folder})...")
        library = load(store_entry(folder, digest, key, build))
        evict(folder, MAX_BYTES, keep=digest)
    say(f"compiled step built in {time.perf_counter() - start:.0f} s")
    return library


def holds_entries():
    """Whether the cache folder holds any entry at all: a cheap look before computing a
    key (its weights' hash reads every weight: seconds for a 1B model) only to find none."""
    folder = cache_folder()
    return folder is not None and folder.is_dir() and any(folder.glob("*.json"))


def usable_folder():
    """cache_folder(), made and checked private; None when the cache is off, or (with one
    line saying why) when the folder fails the checks."""
    folder = cache_folder()
    if folder is None:
        return None
    try:
        return private_folder(folder)
    except UnsafeFolder as e:
        say(f"warning: the compiled-step cache is not used: {e}")
        return None


def say(line):
    print(line, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- the entries

def load_entry(folder, digest, key, load):
    """The library of the entry digest, or None when there is none; an entry whose manifest
    is not this key's, whose package is not the one its manifest names, or that fails to
    load, is removed (it is built again)."""
    manifest, package = folder / f"{digest}.json", folder / f"{digest}.pt2"
    if not manifest.exists():
        return None
    try:
        with open_own(manifest) as f:
            recorded = json.load(f)
        if recorded["key"] != key or recorded["sha256"] != file_sha256(package):
            raise ValueError("the entry does not match its manifest")
        library = load(package)
    except Exception:  # noqa: BLE001 (a corrupt package fails inside torch's loader, any way)
        remove_entry(folder, digest)
        return None
    os.utime(manifest)  # recently used: eviction keeps it
    return library


def store_entry(folder, digest, key, build):
    """Build the package into a temporary folder inside folder, then rename it and its
    manifest into place; returns the package's path."""
    scratch = Path(tempfile.mkdtemp(prefix="building-", dir=folder))  # mode 0700
    try:
        package = built(scratch, build)
        manifest = {"key": key, "sha256": file_sha256(package), "bytes": package.stat().st_size}
        write_new(scratch / "manifest.json", json.dumps(manifest, indent=1).encode())
        os.replace(package, folder / f"{digest}.pt2")  # the package first: a manifest
        os.replace(scratch / "manifest.json", folder / f"{digest}.json")  # names a whole one
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return folder / f"{digest}.pt2"


def built(scratch, build):
    """build(path) on a path inside scratch; returns that path. The build is one long call
    into torch: a line on a terminal counts its seconds, and Ctrl-C during it says so (the
    scratch folder goes with it: nothing half-built is kept)."""
    package = scratch / "step.pt2"
    with Ticker("building the compiled step"):
        build(package)
    return package


def file_sha256(path):
    digest = hashlib.sha256()
    with open_own(path) as f:
        while chunk := f.read(2**20):
            digest.update(chunk)
    return digest.hexdigest()


def remove_entry(folder, digest):
    for suffix in (".json", ".pt2"):  # the manifest first: no entry without its package
        (folder / f"{digest}{suffix}").unlink(missing_ok=True)


def evict(folder, max_bytes, keep):
    """Remove the least recently used entries (their manifests' times) until the packages
    take at most max_bytes, never the entry keep; and the scratch folders of builds that
    died midway, a day old."""
    manifests = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    manifests.sort(key=lambda p: p.stem != keep)  # keep first: it is counted, never removed
    kept = 0  # bytes of the packages kept so far, the most recently used first
    for manifest in manifests:
        package = manifest.with_suffix(".pt2")
        size = package.stat().st_size if package.exists() else 0
        if kept + size > max_bytes and manifest.stem != keep:
            remove_entry(folder, manifest.stem)
        else:
            kept += size
    for scratch in folder.glob("building-*"):
        if time.time() - scratch.stat().st_mtime > 86400:
            shutil.rmtree(scratch, ignore_errors=True)
