"""generate.py in hostile terminals: closed standard streams, encodings that are not UTF-8,
Ctrl-C at start-up and mid-run, a reader that goes away. Subprocesses on a tiny model."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from generation.step_cache import FOLDER_VARIABLE
from plumbing.checkpoint import ROOT, save_checkpoint
from conftest import TINY_CONFIGS, byte_tokenizer_spec, tiny_model

PROMPT = "naïve 🎭"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("term") / "tiny.pt"
    save_checkpoint(path, tiny_model(TINY_CONFIGS[0]), byte_tokenizer_spec())
    return path


def generate(ckpt, *args, close=(), env=None, **kw):
    """generate.py with the file descriptors in `close` closed, as `>&-` would."""
    def close_fds():
        for fd in close:
            os.close(fd)
    return subprocess.run([sys.executable, str(ROOT / "generate.py"), "--ckpt", str(ckpt),
                           "--max-new-tokens", "8", "--temperature", "0", *args],
                          capture_output=not ({1, 2} & set(close) or kw), preexec_fn=close_fds,
                          env={**os.environ, **(env or {})}, timeout=120, **kw)


def as_at_a_terminal():
    """Ctrl-C reaches a script started at a terminal. A job started in the background by a
    non-interactive shell (`pytest &`, some CI runners) ignores SIGINT, its children inherit
    that, and Python then installs no KeyboardInterrupt handler: restore the default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_closed_stdout_is_one_line(ckpt):
    proc = generate(ckpt, "--prompt", "a", close=[1], stderr=subprocess.PIPE, text=True)
    assert proc.returncode == 2 and proc.stderr.strip().endswith("standard output is closed (>&-); "
                                                                 "redirect it to a file or to /dev/null")
    assert proc.stderr.count("\n") == 1 and "loaded" not in proc.stderr  # refused before the work


def test_closed_stderr_and_stdin_leave_json_clean(ckpt):
    """With 2>&- <&- the next files opened take descriptors 0 and 2 unless something holds
    them; nothing but the JSON may reach stdout."""
    proc = generate(ckpt, "--prompt", "a", "--json", "--stats", close=[0, 2], stdout=subprocess.PIPE)
    assert proc.returncode == 0
    assert set(json.loads(proc.stdout)) == {"prompts", "prompt", "texts", "stats"}


def test_closed_stdin(ckpt):
    proc = generate(ckpt, "--prompt", "-", close=[0], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.returncode == 2 and proc.stderr.strip().endswith("--prompt -: standard input is closed")
    assert generate(ckpt, "--prompt", "a", close=[0], stdout=subprocess.PIPE).returncode == 0


@pytest.mark.parametrize("encoding", ["latin-1", "ascii"])
def test_stdout_that_is_not_utf8(ckpt, encoding):
    """Characters the encoding lacks are written as escapes; nothing fails mid-text."""
    proc = generate(ckpt, "--prompt", PROMPT, env={"PYTHONIOENCODING": encoding})
    assert proc.returncode == 0 and b"Traceback" not in proc.stderr
    out = proc.stdout.decode(encoding)
    assert out.startswith("na\\xefve \\U0001f3ad" if encoding == "ascii" else "naïve \\U0001f3ad")


def test_c_locale_and_a_pipe(ckpt):
    proc = generate(ckpt, "--prompt", PROMPT, env={"LANG": "C", "LC_ALL": "C", "PYTHONIOENCODING": ""})
    assert proc.returncode == 0 and b"Traceback" not in proc.stderr and proc.stdout


def mapped(pid, library):
    with open(f"/proc/{pid}/maps") as f:
        return library in f.read()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux's /proc")
def test_ctrl_c_while_torch_loads(ckpt):
    """SIGINT once torch's library is being loaded (the script is importing): the process
    ends at once, by the signal (the shell shows 130), with no traceback."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "generate.py"), "--ckpt", str(ckpt)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            preexec_fn=as_at_a_terminal)
    deadline = time.monotonic() + 60
    while not mapped(proc.pid, "libtorch") and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=60)[1].decode()
    assert proc.returncode in (130, -signal.SIGINT) and "Traceback" not in err, err



def test_ctrl_c_while_the_compiled_step_builds(ckpt, tmp_path):
    """SIGINT during the build of --compile's step (one long call into torch): exit 130 with
    one line saying what was interrupted, and nothing half-built left in the cache."""
    cache = tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, str(ROOT / "generate.py"), "--ckpt", str(ckpt), "--compile",
                             "--prompt", "a", "--max-new-tokens", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            env={**os.environ, FOLDER_VARIABLE: str(cache)}, text=True,
                            preexec_fn=as_at_a_terminal)
    lines = []
    while not lines or not lines[-1].startswith("building the compiled step"):
        lines.append(proc.stderr.readline())
        assert lines[-1], lines  # the build began before the process ended
    time.sleep(1)
    proc.send_signal(signal.SIGINT)
    err = proc.stderr.read()
    proc.wait(timeout=60)
    assert proc.returncode == 130, lines + [err]
    assert err.startswith("building the compiled step: interrupted after ") and err.count("\n") == 1, err
    assert list(cache.iterdir()) == []

def test_ctrl_c_in_main_exits_130(ckpt, tmp_path):
    """SIGINT while main() waits for its prompt (a FIFO nobody writes to yet): exit 130."""
    fifo = tmp_path / "prompt"
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, str(ROOT / "generate.py"), "--ckpt", str(ckpt),
                             "--prompt-file", str(fifo)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, preexec_fn=as_at_a_terminal)
    deadline = time.monotonic() + 120
    while True:  # opening the write end succeeds once generate.py has opened the read end
        try:
            writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError:
            assert time.monotonic() < deadline and proc.poll() is None, "generate.py never read its prompt"
            time.sleep(0.01)
    # its open() has returned as ours did; let it reach read(), where it waits. A signal in
    # between (about 1 run in 8 here) is seen by Python only after that read, which never ends
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=60)[1].decode()
    os.close(writer)
    assert proc.returncode == 130 and err == "", err


def test_reader_that_goes_away(ckpt):
    """`generate.py | head -c 5`: the pipe closes early; exit 0, nothing on stderr."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "generate.py"), "--ckpt", str(ckpt), "--prompt", "a",
                             "--max-new-tokens", "3000", "--ignore-eot"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    proc.stdout.read(5)
    proc.stdout.close()
    err = proc.communicate(timeout=120)[1].decode()
    assert proc.returncode == 0 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_tiny_checkpoint_fixture_is_loadable(ckpt):
    assert "model" in torch.load(ckpt, weights_only=True)
