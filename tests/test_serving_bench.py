"""benchmarks/serving.py runs end to end on a tiny checkpoint (the real figures come from real
runs): every way serves every request, HTTP included, and nothing leaks."""

import json
import subprocess
import sys

import pytest

from plumbing.checkpoint import ROOT

pytest.importorskip("aiohttp")


def test_quick_serving_benchmark_writes_its_report(tmp_path, tiny_ckpt):
    out = tmp_path / "serve.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.serving", "--ckpt", str(tiny_ckpt), "--device", "cpu",
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
    gather = report["gather"]
    assert gather["kernel_layer_ms"] > 0 and gather["read_layer_bytes_ms"] > 0
    assert "the paged kernel alone, a layer (every layer in turn)" in proc.stdout
    # the kernel reads one layer's keys and values; the gather copies every layer's
    assert gather["gathered_bytes"] == gather["layer_bytes"] * report["n_layer"]


@pytest.mark.parametrize("args", [["--modes", "turbo"], ["--url", "127.0.0.1:8000"]])
def test_bad_flags_exit_2(args):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.serving", *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1


def test_outputs_checked_before_the_run(tmp_path):
    """--json over a file we did not write is refused up front, and the file is untouched."""
    precious = tmp_path / "notes.json"
    precious.write_text('{"mine": 1}')
    proc = subprocess.run([sys.executable, "-m", "benchmarks.serving", "--json", str(precious)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "was not written by kvcache-gpt" in proc.stderr
    assert precious.read_text() == '{"mine": 1}'


@pytest.mark.parametrize("engine_thread", ["main", "background"])
def test_continuous_serves_the_workload_with_the_engine_on_either_thread(engine_thread):
    from base_model import GPTConfig
    from conftest import byte_tokenizer, tiny_model
    from benchmarks.serving import run_continuous
    from serving.engine import Engine

    model = tiny_model(GPTConfig(context_len=32, vocab_size=260, n_layer=1, n_head=2, n_embd=16))
    engine = Engine(model, byte_tokenizer(), tokens_per_block=4, attention="gather")
    requests = [(0.01 * i, [65 + i] * (3 + i), 5 + i) for i in range(4)]  # (arrival, prompt, n)
    result = run_continuous(engine, requests, engine_thread)
    assert result["output_tokens"] == sum(n for _, _, n in requests)
    assert len(engine.pool.free) == engine.pool.num_blocks  # every block back


def test_the_step_timings_gather_a_batch_larger_than_one_prefill_pass(monkeypatch):
    """gather_cost fills the batch before timing one step of it: with more prompt tokens than
    a step's budget (6 x 120 > MAX_STEP_TOKENS) the first prompts must not finish before the
    last are admitted (they did with mixed steps, and the loop never ended)."""
    from argparse import Namespace
    from base_model import GPTConfig
    from conftest import byte_tokenizer, tiny_model
    from benchmarks import serving as bench
    from serving.scheduler import MAX_STEP_TOKENS

    model = tiny_model(GPTConfig(context_len=128, vocab_size=260, n_layer=1, n_head=2, n_embd=16))
    steps = []

    def counted_step(self):  # a bound, so that the old endless loop fails instead of hanging
        steps.append(1)
        assert len(steps) < 50, "the batch never filled"
        return real_step(self)
    real_step = bench.Engine.step
    monkeypatch.setattr(bench.Engine, "step", counted_step)
    args = Namespace(tokens_per_block=16, num_blocks=0, max_batch=6, seed=0, compile=False)
    assert 6 * 120 > MAX_STEP_TOKENS
    result = bench.gather_cost(model, byte_tokenizer(), args, batch=6, context=120, reps=1)
    assert result["batch"] == 6 and result["dense_step_ms"] > 0
    assert len(steps) <= 6  # prefill passes only: one per prompt at most


@pytest.mark.parametrize("args, mention", [
    (["--rate", "-1"], "--rate"), (["--rate", "nan"], "--rate"), (["--rate", "inf"], "--rate"),
    (["--modes", ""], "--modes: choose from"), (["--modes", "http,http"], "http given twice"),
    (["--timeout", "0"], "--timeout"), (["--url", ""], "--url must start with")])
def test_bad_values_exit_2_before_any_work(args, mention):
    from conftest import run_script
    proc = run_script("benchmarks/serving.py", *args)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert mention in proc.stderr and "Traceback" not in proc.stderr


def test_a_server_that_accepts_but_never_answers_is_one_line():
    """--url against a port that takes the connection and says nothing: a timeout, not a hang."""
    import socket
    from benchmarks.serving import run_url
    from plumbing.script import UserError
    with socket.create_server(("127.0.0.1", 0)) as silent:  # listens; never accepts, never answers
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
        with pytest.raises(UserError, match="did not answer within 0.5 s"):
            run_url(url, [(0.0, [65], 2)], timeout=0.5)
