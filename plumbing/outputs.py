"""
Files the commands write (--json, --plot, exports): checked before the work, written
atomically, and never over a file that is not ours. One place for these rules, so that no
writer can skip them:
  - check_output_path(path, kind) refuses, before any work, a path that cannot or must not
    be written (a directory, a file another program wrote, no permission, a name too long);
  - write_atomically(path, data) and new_directory(path) write into a temporary file or
    folder beside the target and rename it into place: the target is its old self or
    complete, never half written, and an interrupted write (Ctrl-C, SIGTERM or SIGHUP,
    which become an exception while a write is under way, a full disk, a file-size limit)
    leaves nothing behind and says why in one line;
  - json_text(obj) is JSON every parser reads (no NaN), marked as ours.
"""

import errno
import json
import math
import os
import re
import resource
import shutil
import signal
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

from plumbing.script import Terminated, UserError

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


@contextmanager
def signals_raise(signals=(signal.SIGTERM, signal.SIGHUP)):
    """While the block runs, SIGTERM and SIGHUP (the terminal closed) raise Terminated
    instead of ending the process at once, so that the write's cleanup runs (run() then
    ends the process as the signal would have); the previous handlers come back after.
    Only the main thread may set handlers: elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame):
        raise Terminated(signum)
    previous = {s: signal.signal(s, terminate) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)


def write_failure(error, written):
    """Why writing failed, in words, or None when `error` is not about writing. The OS's
    reason when the error carries it; some writers drop it (numpy's tofile says only "N
    requested and M written", safetensors wraps it in its own error), so a file that
    reached the file-size limit (ulimit -f) or a disk with no room left is found here, and
    the number of a Rust library's "(os error 27)" is read back."""
    if isinstance(error, OSError) and error.errno:
        return error.strerror or os.strerror(error.errno)
    rust_io = re.search(r"\(os error (\d+)\)", str(error))  # how Rust shows an OS error
    if rust_io:
        return os.strerror(int(rust_io.group(1)))
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    written = Path(written)
    files = [written] if written.is_file() else [f for f in written.rglob("*") if f.is_file()]
    if limit != resource.RLIM_INFINITY and any(f.stat().st_size >= limit for f in files):
        return f"{os.strerror(errno.EFBIG)}: the file-size limit (ulimit -f) is {limit:,} bytes"
    if shutil.disk_usage(written.parent).free == 0:
        return os.strerror(errno.ENOSPC)
    if isinstance(error, OSError):
        return str(error) or type(error).__name__
    return None


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
    with signals_raise():  # from before the temporary file exists until it is renamed
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
            reason = write_failure(e, tmp) if isinstance(e, Exception) else None
            Path(tmp).unlink(missing_ok=True)
            if reason is not None:
                raise UserError(f"{path}: cannot write it ({reason}); nothing was written") from None
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
    with signals_raise():
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
            reason = write_failure(e, tmp) if isinstance(e, Exception) and tmp.exists() else None
            if reason is None and isinstance(e, OSError):
                reason = write_failure(e, path.parent)
            shutil.rmtree(tmp, ignore_errors=True)
            if reason is not None:
                raise UserError(f"{path}: cannot write it ({reason}); nothing was written") from None
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


def publish_result(result, module, print_table, json_path=None):
    """The end of a benchmark command run as `python -m <module>`: record the command line
    that produced result (result["command"], which the docs quote), print its table, and
    write it as JSON when json_path was asked for."""
    result["command"] = " ".join([f"python -m {module}", *sys.argv[1:]])
    print_table(result)
    if json_path:
        write_atomically(json_path, json_text(result, generator=module, indent=1))
