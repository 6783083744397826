"""
Progress on long work, on stderr: loading (and quantizing) a multi-GB model is minutes on a
small machine, and a command that says nothing for minutes looks hung. One line, rewritten
in place, says how far it is:

    loading /models/llama-3-8b (quantizing to int4): 7.42 GiB of 15 GiB (49%), 95 s

Only on a terminal: a log file or a pipe would fill with rewritten lines, and a command
asked for --json keeps stderr for what went wrong. The line is cleared when the work ends;
Ctrl-C during the work leaves one line saying how far it got (on any stream: that is news).
Work whose share done cannot be measured (building a compiled step) shows its time
instead: plumbing/ticker.py.
"""

import sys
import time

from plumbing.memory import format_bytes
from plumbing.ticker import is_terminal

REFRESH_SECONDS = 0.5  # a line rewritten more often is only flicker


class Progress:
    """progress.advance(nbytes) as each piece of `total` bytes is done, progress.close() at
    the end (or use it as a context manager). shown=False: a silent one, for --json."""

    def __init__(self, what, total, shown=True, stream=None):
        self.stream = sys.stderr if stream is None else stream
        self.shown = shown and total > 0 and is_terminal(self.stream)
        self.what, self.total, self.done = what, total, 0
        self.start = self.last = time.perf_counter()

    def advance(self, nbytes):
        self.done += nbytes
        now = time.perf_counter()
        if self.shown and now - self.last >= REFRESH_SECONDS:
            self.last = now
            self.stream.write(f"\r{self.what}: {format_bytes(self.done)} of {format_bytes(self.total)} "
                              f"({100 * self.done / self.total:.0f}%), {now - self.start:.0f} s\033[K")
            self.stream.flush()

    def close(self):
        if self.shown and self.last > self.start:  # a line was written: clear it
            self.stream.write("\r\033[K")
            self.stream.flush()

    def interrupted(self):
        self.close()
        print(f"{self.what}: interrupted after {format_bytes(self.done)} of {format_bytes(self.total)}, "
              f"{time.perf_counter() - self.start:.0f} s", file=self.stream, flush=True)

    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        if kind is KeyboardInterrupt:
            self.interrupted()
        else:
            self.close()
