"""--kv-dtype through the scripts on the bundled model (and an --hf export of it), and the
memory planner as a user runs it. The scripts run in this process (conftest.run_script), but
for one run each of kv_cache.py, benchmarks/kv_dtypes.py and memory_plan.py in a process of
its own
(generate.py's is in test_generate_cli.py)."""

import json
import subprocess
import sys

import pytest

from plumbing.checkpoint import BUNDLED, ROOT
from base_model import GPTConfig
from kv_quant import cache_bytes
from test_generate_cli import generate, generate_json, run_cli

GREEDY = ("--prompt", "ROMEO:", "--temperature", "0", "--max-new-tokens", "30", "--ignore-eot")
# the bundled model's shape (test_generate_cli checks the context)
BUNDLED_SHAPE = GPTConfig(context_len=256, vocab_size=4096, n_layer=6, n_head=4, n_embd=256)


def run_in_a_process(script, *args):
    """`python script args` (or `python -m module args` for a module name), as a user runs
    it: a fresh interpreter, its own streams, in the repository."""
    command = [str(ROOT / script)] if script.endswith(".py") else ["-m", script]
    return subprocess.run([sys.executable, *command, *args], capture_output=True, text=True, cwd=ROOT,
                          encoding="utf-8", errors="strict", stdin=subprocess.DEVNULL, timeout=300)


def test_stats_formula_counts_the_scales():
    stats = generate_json(*GREEDY, "--kv-dtype", "int4")["stats"]
    assert stats["cache_formula"] == ("2 x 6 layers x 4 kv heads x L=31 x (64 head_dim x 0.5 B "
                                      "+ 2 x 2 B scales) x 1 rows")
    assert stats["cache_bytes_formula"] == cache_bytes(BUNDLED_SHAPE, 31, 1, "int4") == 31 * 1728
    # preallocated for what the generation can reach, rounded up to 256 positions: here the
    # bundled model's whole context, the formula at L = context_len, to the byte
    assert stats["cache_bytes_allocated"] == cache_bytes(BUNDLED_SHAPE, 256, 1, "int4")
    proc = generate(*GREEDY, "--kv-dtype", "int8", "--stats")
    assert "(64 head_dim x 1 B + 1 x 2 B scale)" in proc.stderr and "811,008 B allocated" in proc.stderr


def test_float32_kv_dtype_is_the_default_cache():
    assert generate(*GREEDY, "--kv-dtype", "float32").stdout == generate(*GREEDY).stdout
    text = generate(*GREEDY, "--kv-dtype", "int4").stdout
    assert text.startswith("ROMEO:") and len(text) > 60


def test_score_through_the_cache(tmp_path):
    path = tmp_path / "snippet.txt"
    path.write_text((BUNDLED.parent / "heldout.txt").read_text(encoding="utf-8")[:2500], encoding="utf-8")
    plain = json.loads(generate("--score", str(path), "--json").stdout)["bits_per_char"]
    scored = {kv: json.loads(generate("--score", str(path), "--json", "--kv-dtype", kv).stdout)
              for kv in ("float32", "int8", "int4")}
    # the same windows, so float32 through the cache is today's number up to float noise;
    # the bounds (measured on the whole held-out text in the README) hold here too
    assert scored["float32"]["bits_per_char"] == pytest.approx(plain, abs=1e-5)
    assert abs(scored["int8"]["bits_per_char"] - plain) < 0.01
    assert abs(scored["int4"]["bits_per_char"] - plain) < 0.05


def test_hf_directory_with_a_quantized_cache(tmp_path):
    from export_hf import export
    export(BUNDLED, tmp_path / "hf", report=lambda _: None)
    out = json.loads(run_cli("--hf", str(tmp_path / "hf"), *GREEDY, "--kv-dtype", "int8", "--json",
                             ckpt=False).stdout)
    assert out["texts"] == generate_json(*GREEDY, "--kv-dtype", "int8")["texts"]


@pytest.mark.parametrize("args, mention", [(["--kv-dtype", "int3"], "--kv-dtype"),
                                           (["--kv-dtype", "int8", "--no-cache"], "--kv-dtype")])
def test_bad_kv_dtype_is_one_line(args, mention):
    proc = run_cli(*args)
    assert proc.returncode == 2 and mention in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_demos_with_a_quantized_cache():
    proc = run_in_a_process("kv_cache.py", "--ckpt", str(BUNDLED), "--kv-dtype", "int4", "--tokens", "8")
    assert proc.returncode == 0, proc.stderr
    assert "int4: 2 x 6 layers x 4 kv heads x L=256" in proc.stdout
    assert "= 442,368 B, tensors hold 442,368 B" in proc.stdout
    proc = run_in_a_process("benchmarks.kv_dtypes", "--ckpt", str(BUNDLED), "--tokens", "4", "--prompts", "2")
    assert proc.returncode == 0, proc.stderr
    for line in ("int8      (64 head_dim x 1 B + 1 x 2 B scale) =  66 B", "per channel, groups of 32 tokens",
                 "int4     :"):
        assert line in proc.stdout


def test_memory_plan_tables():
    proc = run_in_a_process("memory_plan.py")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    # Llama-3-8B-like: 2 x 32 layers x 8 kv heads x 128 x 2 B = 128 KiB per token, 4 GiB at 32k
    row = next(l for l in lines if l.startswith("| Llama-3-8B-like (GQA 32/8) | bfloat16 |"))
    assert "| 256 B | 128 KiB | 128 MiB | 512 MiB | 4 GiB* | 16 GiB* |" in row
    # the sliding window caps Mistral's cache at 4096 tokens
    row = next(l for l in lines if l.startswith("| Mistral-7B-like (GQA, window 4096) | int4 |"))
    assert "| 36 MiB | 144 MiB | 144 MiB | 144 MiB* |" in row
    assert any(l.startswith("| bundled model | 6 | 4 / 4 | 64 |") for l in lines)


@pytest.mark.parametrize("args, mention", [(["--memory", "lots"], "--memory"),
                                           (["--kv-dtypes", "int8,fp8"], "--kv-dtypes")])
def test_memory_plan_bad_flags(args, mention):
    proc = run_cli(*args, script="memory_plan.py", ckpt=False)
    assert proc.returncode == 2 and mention in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_memory_plan_plot(tmp_path):
    path = tmp_path / "plot.png"
    proc = run_cli("--plot", str(path), script="memory_plan.py", ckpt=False)
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # optional: one line, exit 2, before any work
        assert proc.returncode == 2 and "pip install matplotlib" in proc.stderr
        assert not proc.stdout
    else:
        assert proc.returncode == 0 and path.stat().st_size > 10_000
