"""
The lone request's compiled step, built in the background on a server's first start.

A request decoding alone runs fastest through the compiled single-stream step (lone_step.py):
on the bundled model 0.84x llama-server's tokens/s against 0.49x through the engine's batch
step (docs/serving.md). Building that step takes 30-60 s, once per model and machine
(generation/step_cache.py keeps it), so `serve.py` with no --compile flag does not wait
for it: where no build is cached it starts serving at once, through the batch step, and
starts a child process, `serve.py <the same arguments> --compile --build-only`, at a lower
priority (`nice -n 10` where there is one), which loads the model as the server did,
builds the step into the cache and exits. The engine's runner asks the child whether it
has finished at each lone step (a waitpid, no blocking); the first lone request after it
has loads the step from the cache (a fraction of a second, once) and every later one
takes it, as a start with the build cached does. The child's output goes to a log file,
named in the one line said when the build fails and removed when it succeeds; the child
is ended with the server (by SIGINT: its half-built files are removed).
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

NICENESS = "10"  # the build yields the cores to the server it builds for


class BackgroundBuild:
    """The child building the lone step: started here, asked by the runner (finished())."""

    def __init__(self, server_script, arguments, report=print):
        """server_script, arguments: serve.py's path and its own command-line arguments;
        report: where the lines about the build go (one when it ends)."""
        self.report, self.started = report, time.monotonic()
        self.log = tempfile.NamedTemporaryFile("w+b", prefix="kvcache-gpt-lone-step-", suffix=".log",
                                               delete=False)
        nice = [shutil.which("nice"), "-n", NICENESS] if shutil.which("nice") else []
        # a batch of one: the pool is then sized for one context (unless --num-blocks says),
        # the build needs no more, and the child's memory is the server's machine's too
        command = [*nice, sys.executable, str(server_script), *arguments, "--compile", "--build-only",
                   "--max-batch", "1"]
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log)

    def finished(self):
        """None while the child runs; then, once, True where it built the step (the cache
        holds it now) or False (with a line saying why), and None ever after."""
        if self.process is None or self.process.poll() is None:
            return None
        status, self.process = self.process.returncode, None
        self.log.close()
        if status == 0:
            os.unlink(self.log.name)
            self.report(f"a request alone: the compiled single-stream step, built in the background "
                        f"in {time.monotonic() - self.started:.0f} s, from now on")
            return True
        self.report(f"a request alone: the compiled single-stream step could not be built in the "
                    f"background (exit status {status}; its log: {self.log.name}); the batch step stays")
        return False

    def stop(self):
        """End the child (the server is stopping) and remove its log. By SIGINT, as Ctrl-C:
        the child's build then removes its half-built files from the cache folder
        (generation/step_cache.py), which SIGTERM's immediate end would leave there."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None
            self.log.close()
            os.unlink(self.log.name)
