"""Memory in the reports: generate.py --stats/--json's peak resident memory and time from
the start to the first token, and memory_plan.py's weights per format against the bytes a
loaded (and quantized) model's tensors really hold."""

import json

import pytest
import torch

from conftest import run_script
from kv_cache import CACHED_MODELS
from plumbing.checkpoint import BUNDLED, ROOT
from plumbing.cli import load_source
from plumbing.memory import weight_bytes
from weight_quant import quantize_model

BUNDLED_MODELS = [BUNDLED, ROOT / "checkpoints" / "shakespeare-llama" / "ckpt.pt"]


def test_json_reports_peak_memory_and_time_from_the_start():
    proc = run_script("generate.py", "--ckpt", BUNDLED, "--prompt", "ROMEO:", "--max-new-tokens", "5",
                      "--temperature", "0", "--json")
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)["stats"]
    # this process holds torch and the model at least, and nowhere near 24 GB
    assert 10 * 2**20 < stats["peak_rss_bytes"] < 24 * 10**9
    # the command starts before its generation does: loading the model lies between
    assert stats["start_to_first_token_seconds"] >= stats["time_to_first_token_seconds"] > 0


def test_stats_print_one_line_each():
    proc = run_script("generate.py", "--ckpt", BUNDLED, "--prompt", "ROMEO:", "--max-new-tokens", "5",
                      "--stats", "--no-stream")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert any(line.startswith("  from the start:    ") and " ms " in line for line in lines)
    peak = next(line for line in lines if line.startswith("peak memory:"))
    assert peak.split()[3] in ("MiB", "GiB")  # the project's byte format: "302 MiB resident"


@pytest.mark.parametrize("ckpt", BUNDLED_MODELS, ids=["gpt", "llama"])
@pytest.mark.parametrize("weights_dtype, load_dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                                       ("int8", torch.bfloat16), ("int4", torch.bfloat16)])
def test_planned_weights_are_what_the_tensors_hold(ckpt, weights_dtype, load_dtype):
    """The plan's int8/int4 is a bfloat16 model quantized (weight_quant.py): the codes, their
    scales, the float rest. Exact on the bundled models; within 2% leaves room for the CPU
    int4 kernel's rows padded to a multiple of 16, which the plan does not count."""
    model, _ = load_source(CACHED_MODELS, str(ckpt), None, "cpu", load_dtype, report=lambda _: None)
    if weights_dtype in ("int8", "int4"):
        quantize_model(model, weights_dtype)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()  # a tied table once
                for t in [*model.parameters(), *model.buffers()]}
    assert weight_bytes(model.config, weights_dtype) == pytest.approx(sum(storages.values()), rel=0.02)


def test_memory_plan_json_and_table_agree_with_weight_bytes():
    proc = run_script("memory_plan.py", "--ckpt", BUNDLED, "--json", "--batch", "3", "--length", "100",
                      "--memory", "1GiB", "--weights-dtype", "int4", "--kv-dtypes", "int8")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    model, _ = load_source(CACHED_MODELS, str(BUNDLED), None, report=lambda _: None)
    bundled = out["models"][0]
    assert bundled["weights_bytes"] == {w: weight_bytes(model.config, w)
                                        for w in ("float32", "bfloat16", "int8", "int4")}
    row = out["plan"][0]
    assert row["batch"] == 3 and row["length"] == 100 and row["kv_dtype"] == "int8"
    assert row["total_bytes"] == row["weights_bytes"] + row["cache_bytes"] and row["fits"]
    # a 1 GiB budget does not hold a 7B model's weights in any format
    assert not next(r for r in out["plan"] if r["model"].startswith("Llama-2-7B"))["fits"]
    table = run_script("memory_plan.py", "--ckpt", BUNDLED, "--memory", "1GiB").stdout
    assert "| fits in 1 GiB |" in table and "| no, " in table and "| yes, " in table


@pytest.mark.parametrize("args, mention", [(["--batch", "0"], "--batch"),
                                           (["--weights-dtype", "int3"], "--weights-dtype")])
def test_memory_plan_new_flags_fail_in_one_line(args, mention):
    proc = run_script("memory_plan.py", *args)
    assert proc.returncode == 2 and mention in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
