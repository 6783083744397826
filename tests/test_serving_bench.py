"""serving/bench.py runs end to end on a tiny checkpoint (the real figures come from real
runs): every way serves every request, HTTP included, and nothing leaks."""

import json
import subprocess
import sys

import pytest

from checkpoint import ROOT

pytest.importorskip("aiohttp")


def test_quick_serving_benchmark_writes_its_report(tmp_path, tiny_ckpt):
    out = tmp_path / "serve.json"
    proc = subprocess.run(
        [sys.executable, "-m", "serving.bench", "--ckpt", str(tiny_ckpt), "--device", "cpu",
         "--quick", "--requests", "6", "--max-batch", "4", "--rate", "50", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "| continuous |" in proc.stdout and "prefix cache" in proc.stdout
    report = json.loads(out.read_text())
    modes = report["modes"]
    assert set(modes) == {"sequential", "static", "continuous", "http"}
    tokens = {m: modes[m]["output_tokens"] for m in modes}
    assert len(set(tokens.values())) == 1, tokens  # every way made every token
    assert modes["http"]["errors"] == 0 and modes["http"]["leaked_blocks"] == 0
    assert report["gather"]["gather_ms"] > 0


def test_bad_modes_exit_2():
    proc = subprocess.run([sys.executable, "-m", "serving.bench", "--modes", "turbo"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1


def test_outputs_checked_before_the_run(tmp_path):
    """--json over a file we did not write is refused up front, and the file is untouched."""
    precious = tmp_path / "notes.json"
    precious.write_text('{"mine": 1}')
    proc = subprocess.run([sys.executable, "-m", "serving.bench", "--json", str(precious)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "was not written by kvcache-gpt" in proc.stderr
    assert precious.read_text() == '{"mine": 1}'
