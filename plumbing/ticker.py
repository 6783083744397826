"""
A seconds count on stderr around one long call whose share done cannot be measured
(building a compiled step: one call into torch, minutes at a real size). Like
plumbing/progress.py's line, only on a terminal, cleared when the call returns; Ctrl-C
leaves one line saying how long it ran. It imports nothing of ours, so the lesson's
compiled step can use it without pulling in the command-line layer.
"""

import sys
import threading
import time


class Ticker:
    """`with Ticker(what):` around one long call: on a terminal the line "what: 12 s" is
    rewritten every second until the call returns, then cleared; Ctrl-C leaves one line."""

    def __init__(self, what, stream=None, every=1.0):
        self.stream = sys.stderr if stream is None else stream
        self.what, self.every = what, every
        self.finished = threading.Event()
        self.thread = threading.Thread(target=self.tick, daemon=True)

    def tick(self):
        while not self.finished.wait(self.every):
            self.stream.write(f"\r{self.what}: {time.perf_counter() - self.start:.0f} s\033[K")
            self.stream.flush()

    def __enter__(self):
        self.start = time.perf_counter()
        if is_terminal(self.stream):
            self.thread.start()
        return self

    def __exit__(self, kind, value, traceback):
        self.finished.set()
        if self.thread.is_alive():
            self.thread.join()
            self.stream.write("\r\033[K")
        if kind is KeyboardInterrupt:
            self.stream.write(f"{self.what}: interrupted after {time.perf_counter() - self.start:.0f} s\n")
        self.stream.flush()


def is_terminal(stream):
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
