"""benchmark.py runs end to end (tiny sizes: the real figures come from real runs)."""

import json
import subprocess
import sys
from argparse import Namespace

import torch

from checkpoint import ROOT


def test_quick_benchmark_writes_its_report(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmark.py"), "--quick", "--no-peer", "--lengths", "4,8",
         "--demo-tokens", "8", "--naive-check", "8", "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "## Cost vs generated length" in proc.stdout and "skipped (--no-peer)" in proc.stdout
    report = json.loads(out.read_text())
    curves = report["cost_curves"]["curves"]
    assert set(curves) == {"naive", "cat", "prealloc"}
    assert curves["naive"]["total_s"]["8"]["estimated"] is False  # the real naive run
    floor = report["floor"]
    assert floor["cache_bytes_formula"] == floor["cache_bytes_real"]
    assert floor["matvec_ms"] > 0 and report["seed_demo"]["speedup"] > 0
    # the weight formats table: int8 reads about a quarter of fp32's bytes, int4 an eighth
    # plus its per-group scales; the checkpoint's fp32 row agrees with itself
    checkpoint, shape = report["quantization"]["models"]
    formats = {f["format"]: f for f in shape["formats"]}
    fp32 = formats["fp32"]["weight_bytes"]
    assert fp32 / 4 < formats["int8"]["weight_bytes"] < fp32 / 3.9
    assert fp32 / 8 < formats["int4"]["weight_bytes"] < fp32 / 6
    assert checkpoint["formats"][0]["greedy_prefix_same"] == 8
    kernels = report["quantization"]["kernels"]["variants"]
    assert all(v["ms"] > 0 for v in kernels.values())
    assert "int8, fp32 activations" in kernels and "int4 groups of 128, bf16 activations" in kernels


def test_bad_lengths_exit_2():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmark.py"), "--lengths", "0,5"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1


def test_peers_report_what_ran():
    """The peer section at tiny sizes: a note only for a peer that did not run (each says
    how to install what it needs), rows with their greedy-token comparison for one that did."""
    from benchmark import peers, random_model
    from peers import llama_cpp_missing
    args = Namespace(no_peer=False, quick=True, demo_tokens=8, ckpt="tiny", hf=None)
    r = peers(args, random_model("tiny", torch.device("cpu")), torch.device("cpu"), reps=1)
    try:
        import transformers  # noqa: F401
        assert r["peer_note"] is None and r["peer"][0]["tokens"] == 8
    except ImportError:
        assert r["peer"] is None and "pip install" in r["peer_note"]
    if llama_cpp_missing():
        assert r["llama_cpp"] is None and "requirements-llama.txt" in r["llama_cpp_note"]
    else:
        assert r["llama_cpp_note"] is None
        assert [row["model"] for row in r["llama_cpp"]] == ["tiny", "tiny shape"]
        assert set(r["llama_cpp"][0]["llama_cpp"]) == {"f32", "f16", "q8_0"}
