"""Outputs (plumbing/outputs.py): checked before any work, never over a file that is not ours, written
so that a failure (a full disk, a file-size limit, Ctrl-C, SIGTERM) leaves the old file and no
debris behind, and says why."""

import errno
import json
import os
import resource
import signal
import subprocess
import sys

import numpy
import pytest

from plumbing import outputs
from plumbing.outputs import check_output_path, json_text, new_directory, write_atomically
from plumbing.script import Terminated, UserError
from conftest import ROOT, TINY_CONFIGS, tiny_model
from plumbing.checkpoint import save_checkpoint


def refused(path, kind, words):
    with pytest.raises(UserError, match=words) as info:
        check_output_path(path, kind)
    assert "\n" not in str(info.value)


def test_output_paths_that_must_be_refused(tmp_path):
    ckpt = tmp_path / "model.pt"
    save_checkpoint(ckpt, tiny_model(TINY_CONFIGS[0]))
    (tmp_path / "notes.json").write_text('{"mine": true}')
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    refused("", "json", "empty path")
    refused(ckpt, "json", "exists and was not written by kvcache-gpt")  # benchmark --json over a checkpoint
    refused(tmp_path / "notes.json", "json", "not written by kvcache-gpt")
    refused(ckpt / "out.json", "json", "is a file, not a folder")
    refused(ckpt / "deeper" / "out.json", "json", "is a file, not a folder")
    refused(tmp_path / ("x" * 300 + ".json"), "json", "a name of 305 characters")
    refused(tmp_path / "full", "json", "is a directory")
    refused(tmp_path / "full", "dir", "not an empty directory")
    refused(ckpt, "dir", "not an empty directory")
    refused(ckpt, "png", "not written by kvcache-gpt as png")
    refused(ckpt, "gguf", "not written by kvcache-gpt as gguf")


def test_output_paths_that_are_fine(tmp_path):
    ours = tmp_path / "ours.json"
    ours.write_text(json_text({"x": 1}, generator="benchmark.py"))
    (tmp_path / "empty.json").write_text("")
    (tmp_path / "plot.png").write_bytes(b"\x89PNG\r\n\x1a\n....tEXtSoftware\0kvcache-gpt benchmark.py")
    (tmp_path / "model.gguf").write_bytes(b"GGUF\x03\0\0\0 general.name kvcache-gpt")
    (tmp_path / "empty_dir").mkdir()
    for path, kind in [(ours, "json"), (tmp_path / "empty.json", "json"), (tmp_path / "new" / "a.json", "json"),
                       (tmp_path / "plot.png", "png"), (tmp_path / "model.gguf", "gguf"),
                       (tmp_path / "empty_dir", "dir"), (tmp_path / "new_dir", "dir"), (os.devnull, "json")]:
        assert check_output_path(path, kind) == type(ours)(path)


def test_write_atomically_replaces_ours(tmp_path):
    path = tmp_path / "sub" / "r.json"
    write_atomically(path, json_text({"a": 1}, generator="test"))
    write_atomically(path, lambda tmp: open(tmp, "w").write(json_text({"a": 2}, generator="test")))
    assert json.loads(path.read_text())["a"] == 2 and os.listdir(path.parent) == ["r.json"]
    mode = path.stat().st_mode & 0o777
    assert mode == 0o666 & ~outputs.umask()  # a normal file, not mkstemp's private 0600
    write_atomically(os.devnull, "streams are written directly")


@pytest.mark.parametrize("where", ["fsync", "writer"])
def test_full_disk_leaves_the_old_file_and_no_debris(tmp_path, monkeypatch, where):
    path = tmp_path / "r.json"
    path.write_text("old")

    def disk_full(*_):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if where == "fsync":
        monkeypatch.setattr(outputs.os, "fsync", disk_full)
        data = "new" * 1000
    else:
        def data(tmp):
            open(tmp, "w").write("half of it")
            disk_full()
    with pytest.raises(UserError, match="No space left on device.*nothing was written") as info:
        write_atomically(path, data)
    assert "\n" not in str(info.value)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["r.json"]


def test_interrupted_write_leaves_no_debris(tmp_path):
    def interrupted(tmp):
        open(tmp, "w").write("half")
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        write_atomically(tmp_path / "r.json", interrupted)
    assert os.listdir(tmp_path) == []


def test_new_directory_appears_complete_or_not_at_all(tmp_path):
    out = tmp_path / "export"
    with pytest.raises(RuntimeError):
        with new_directory(out) as tmp:
            (tmp / "config.json").write_text("{}")
            raise RuntimeError("the export failed half-way")
    assert os.listdir(tmp_path) == []
    with new_directory(out) as tmp:  # the next attempt is not blocked
        (tmp / "config.json").write_text("{}")
    assert os.listdir(out) == ["config.json"] and os.listdir(tmp_path) == ["export"]
    (tmp_path / "empty").mkdir()
    with new_directory(tmp_path / "empty") as tmp:  # an empty folder is replaced
        (tmp / "a").write_text("a")
    assert os.listdir(tmp_path / "empty") == ["a"]


def test_new_directory_on_a_full_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(outputs.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(UserError, match="No space left on device"):
        with new_directory(tmp_path / "export") as tmp:
            (tmp / "model.safetensors").write_bytes(b"x" * 100)
    assert os.listdir(tmp_path) == []


def test_json_text_is_always_valid_json():
    def no_constants(name):
        raise AssertionError(f"{name} is not JSON")
    text = json_text({"rate": float("inf"), "loss": float("nan"), "xs": [1.5, float("-inf")], 3: (2, 1.0)})
    assert json.loads(text, parse_constant=no_constants) == {"rate": None, "loss": None, "xs": [1.5, None], "3": [2, 1.0]}
    assert json.loads(json_text({"a": 1}, generator="benchmark.py"))["generator"] == "kvcache-gpt benchmark.py"


def test_failed_export_leaves_nothing_behind(tmp_path, tiny_ckpt, monkeypatch):
    """A disk that fills while the weights are written: no half-written OUT_DIR that would
    block the next attempt ("exists and is not empty"), and the next attempt succeeds."""
    import export_hf

    def full_disk(state_dict, out_dir, use_safetensors=None):
        (out_dir / "model.safetensors").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    out = tmp_path / "hf"
    with monkeypatch.context() as m:
        m.setattr(export_hf, "write_weights", full_disk)
        with pytest.raises(UserError, match="No space left on device"):
            export_hf.export(tiny_ckpt, out, report=lambda _: None)
    assert sorted(os.listdir(tmp_path)) == ["tiny.pt"]
    export_hf.export(tiny_ckpt, out, report=lambda _: None)
    assert {"config.json", "vocab.json", "merges.txt"} <= set(os.listdir(out))


def test_benchmark_plot_is_marked_ours(tmp_path):
    """benchmark.py's PNG carries the mark that lets the next run replace it."""
    plt = pytest.importorskip("matplotlib.pyplot")
    from benchmarks.cache_cost import KINDS
    from benchmarks.report import plot
    curve = {"total_s": {4: {"median": 1.0}, 8: {"median": 2.0}}, "latency_ms": {4: 1.0, 8: 2.0}}
    report = {"cost_curves": {"shape": "tiny", "lengths": [4, 8], "curves": {k: curve for k in KINDS}},
              "batch": [{"model": "tiny", "sizes": {1: {"tok_s": {"median": 10.0}}, 4: {"tok_s": {"median": 30.0}}}}],
              "machine": "test", "date": "today"}
    path = tmp_path / "plot.png"
    plot(report, check_output_path(path, "png"), plt)
    assert check_output_path(path, "png") == path and os.listdir(tmp_path) == ["plot.png"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_during_a_write_leaves_no_debris(tmp_path, signum):
    """SIGTERM (or SIGHUP) mid-write becomes Terminated, so the temporary file goes; the
    previous handler comes back after, and a write with no signal is untouched by it."""
    def killed_half_way(tmp):
        open(tmp, "w").write("half")
        os.kill(os.getpid(), signum)  # the handler runs before the next line
        open(tmp, "a").write(" and the rest")
    before = signal.getsignal(signum)
    with pytest.raises(Terminated):
        write_atomically(tmp_path / "r.json", killed_half_way)
    with pytest.raises(Terminated):
        with new_directory(tmp_path / "export") as tmp:
            killed_half_way(tmp / "model.safetensors")
    assert os.listdir(tmp_path) == [] and signal.getsignal(signum) is before
    write_atomically(tmp_path / "r.json", "whole")
    assert (tmp_path / "r.json").read_text() == "whole"


def test_a_command_sent_sigterm_mid_write_ends_by_it_and_leaves_nothing(tmp_path):
    """run() ends the process by the signal once the write has cleaned up (status -15)."""
    script = f"""
import os, signal, sys
sys.path.insert(0, {str(ROOT)!r})
from plumbing.outputs import write_atomically
from plumbing.script import run
def main():
    def killed(tmp):
        open(tmp, "w").write("half")
        os.kill(os.getpid(), signal.SIGTERM)
    write_atomically({str(tmp_path / 'out.gguf')!r}, killed)
run(main)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGTERM and proc.stderr == ""
    assert os.listdir(tmp_path) == []


def test_a_file_size_limit_is_named(tmp_path):
    """A writer that drops the OS's reason (numpy's tofile: "N requested and M written")
    past the file-size limit (ulimit -f): the reason is found and said."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, hard))  # this process only; put back below
    try:
        with pytest.raises(UserError, match=r"cannot write it \(File too large: the file-size limit "
                                            r"\(ulimit -f\) is 1,000 bytes\); nothing was written"):
            write_atomically(tmp_path / "w.gguf", lambda tmp: numpy.zeros(10_000).tofile(tmp))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert os.listdir(tmp_path) == []


def test_a_rust_writers_os_error_is_named(tmp_path):
    """safetensors reports "I/O error: File too large (os error 27)" in an error of its own."""
    class SafetensorError(Exception):
        pass
    with pytest.raises(UserError, match=r"cannot write it \(File too large\)"):
        with new_directory(tmp_path / "hf"):
            raise SafetensorError("Error while serializing: I/O error: File too large (os error 27)")
    assert os.listdir(tmp_path) == []
