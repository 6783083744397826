"""
What every command does around its work: begin() before the slow imports, run(main) around
main(), and UserError for a mistake the user can fix, which ends in one line on stderr and
exit status 2, never a traceback (CheckpointError is the one a file we cannot use raises;
short_repr keeps a value quoted from such a file to one short line).

Importing this module changes nothing: a command calls begin() itself, first thing,

    from plumbing.script import begin, run
    begin()        # before torch: Ctrl-C during the imports ends quietly
    import torch   # noqa: E402

so that a library that imports plumbing (or the lesson's modules, which import nothing of
plumbing) leaves the interpreter as it found it. No torch here: begin() must run before it.
"""

import os
import reprlib
import signal
import sys
from pathlib import Path


class UserError(ValueError):
    """Bad input from the user; its message is the one line they will see."""


class CheckpointError(UserError):
    """A checkpoint or tokenizer that cannot be used; the message is one line for the user."""


SHORT_REPR = reprlib.Repr()
SHORT_REPR.maxlevel, SHORT_REPR.maxstring, SHORT_REPR.maxother = 2, 40, 40


def short_repr(value):
    """repr() cut to a few dozen characters and levels: a value from a hostile file may be
    huge or nested a million deep, and an error message must stay one short line."""
    return SHORT_REPR.repr(value).replace("\n", " ")


class Terminated(BaseException):
    """A signal that ends the process (SIGTERM, SIGHUP) arrived while an output was being
    written (plumbing/outputs.py raises it then, so that the half-written file is removed),
    or while serve.py was serving (its streams are ended first); run() then ends the
    process by that signal. A BaseException, as KeyboardInterrupt is:
    no `except Exception` may swallow it."""

    def __init__(self, signum):
        super().__init__(f"signal {signum}")
        self.signum = signum


def begin():
    """Make the process ready for a command, before its slow imports (torch: a second or
    more): Ctrl-C during them ends the command without a traceback, and closed standard
    descriptors are filled (fill_closed_standard_fds says why)."""
    sys.excepthook = quiet_interrupt
    fill_closed_standard_fds()
    # numpy before torch: torch imports it from C++ and drops any exception there, a Ctrl-C
    # included (which then went unnoticed: the command ran on)
    import numpy  # noqa: F401


def quiet_interrupt(kind, value, traceback, print_exception=sys.__excepthook__):
    """Ctrl-C while the imports still run ends the command without a traceback, as run()
    does once main() has started. (Python then ends the process by SIGINT itself, which
    the shell reports as status 130.)"""
    if not issubclass(kind, KeyboardInterrupt):
        print_exception(kind, value, traceback)


def fill_closed_standard_fds():
    """A command started with stdin, stdout or stderr closed (`<&-`, `>&-`, `2>&-`) has no
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


def check_standard_streams():
    """Results written to a closed stdout would vanish while the command reports success:
    say so instead (Python sets sys.stdout to None when descriptor 1 was closed). A
    terminal or PYTHONIOENCODING that is not UTF-8 (latin-1, ascii) cannot show every
    character of a generated text: those are written as \\u escapes rather than failing."""
    if sys.stdout is None:
        raise UserError("standard output is closed (>&-); redirect it to a file or to /dev/null")
    if sys.stdout.errors == "strict":
        sys.stdout.reconfigure(errors="backslashreplace")


def run(main):
    """Call main(); a UserError (a bad checkpoint is one too: CheckpointError)
    prints one line and exits 2, Ctrl-C exits 130 quietly, SIGTERM during a write ends the
    process by SIGTERM once the write has cleaned up."""
    try:
        check_standard_streams()
        main()
    except UserError as e:
        # one line even when the message quotes a path or a value with a newline in it
        message = str(e).replace("\r", "\\r").replace("\n", "\\n")
        print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    except Terminated as e:  # the write cleaned up after itself: now end as the signal would
        signal.signal(e.signum, signal.SIG_DFL)
        os.kill(os.getpid(), e.signum)
    except BrokenPipeError:  # output piped into `head`, which closed early
        sys.stderr.close()
        sys.exit(0)
