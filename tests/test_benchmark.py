"""benchmark.py runs end to end (tiny sizes: the real figures come from real runs)."""

import contextlib
import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from plumbing.checkpoint import ROOT
from conftest import TINY_CONFIGS, run_script, tiny_model
from kv_cache import KVCacheGPT


def test_quick_benchmark_writes_its_report(tmp_path):
    """In a process of its own, as a user runs it (the other runs are in this process)."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmark.py"), "--quick", "--no-peer", "--lengths", "4,8",
         "--demo-tokens", "8", "--naive-check", "8", "--spec-prompts", "1", "--spec-tokens", "8",
         "--spec-ks", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "## Cost vs generated length" in proc.stdout and "skipped (--no-peer)" in proc.stdout
    report = json.loads(out.read_text())
    curves = report["cost_curves"]["curves"]
    assert set(curves) == {"naive", "cat", "prealloc"}
    assert curves["naive"]["total_s"]["8"]["estimated"] is False  # the real naive run
    floor = report["floor"]
    assert floor["cache_bytes_formula"] == floor["cache_bytes_real"]
    assert floor["matvec_ms"] > 0 and floor["decode_over_floor"] > 0 and report["seed_demo"]["speedup"] > 0
    # the decode-speed table: int8 reads about a quarter of fp32's bytes, int4 an eighth plus
    # its per-group scales; the checkpoint's fp32 row agrees with itself; --quick leaves
    # the compiled row out and says so, --no-peer llama.cpp's
    speed = report["decode_speed"]
    assert "--quick" in speed["compile_note"] and "--no-peer" in speed["llama_cpp_note"]
    checkpoint, shape = speed["models"]
    assert list(shape["rows"]) == ["ours fp32 eager", "ours bf16", "ours bf16, torch's matmul", "ours int8",
                                  "ours int4"]
    rows = shape["rows"]
    fp32 = rows["ours fp32 eager"]["weight_bytes"]
    assert fp32 / 4 < rows["ours int8"]["weight_bytes"] < fp32 / 3.9
    assert fp32 / 8 < rows["ours int4"]["weight_bytes"] < fp32 / 6
    assert checkpoint["rows"]["ours fp32 eager"]["greedy_leading_same"] == checkpoint["tokens"] == 8
    kernels = report["kernels"]["variants"]
    assert all(v["ms"] > 0 for v in kernels.values())
    assert "int8, torch's, fp32 activations" in kernels and "int4 groups of 128, torch's, bf16 activations" in kernels
    # speculative decoding on the bundled model and its draft (the peers: the test below)
    spec = report["speculative"]
    assert set(spec["prompt_lookup"]["rows"]) == {"ours plain", "ours lookup K=8 N=2"}
    assert set(spec["draft"]["rows"]) == {"ours plain", "ours draft K=2"}
    assert "## Speculative decoding: a draft model" in proc.stdout


def test_bad_lengths_exit_2():
    proc = run_script("benchmark.py", "--lengths", "0,5")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1


def test_transformers_peer_reports_what_ran():
    """The transformers table at tiny sizes: a note saying how to install it when it did
    not run, rows with their greedy-token comparison when it did, and the torch operations
    a token on each side: a count, the same in every run, and fewer for our eager step
    (170 against 284 when written; the bound leaves room for other torch and
    transformers versions)."""
    from benchmarks.cache_cost import random_model
    from benchmarks.peers import transformers_table
    cpu = torch.device("cpu")
    r = transformers_table({"tiny": random_model("tiny", cpu)}, cpu, n=8, reps=1)
    try:
        import transformers  # noqa: F401
        row = r["peer"][0]
        assert r["peer_note"] is None and row["tokens"] == 8 and row["greedy_tokens_match"]
        ops = row["operations_per_token"]
        assert ops["ours"] == int(ops["ours"]) and 0 < ops["ours"] < 0.8 * ops["hf"]
    except ImportError:
        assert r["peer"] is None and "pip install" in r["peer_note"]


@contextlib.contextmanager
def fake_llama_engines(label, model, outtypes):
    assert "f32" in outtypes  # the like-for-like row; the others are faked away
    yield {"f32": ("engine", 1000, 0.0)}


def test_decode_speed_table_structure(monkeypatch):
    """The decode-speed table on a tiny model, the compiled row left out (compiling takes
    minutes) and llama.cpp faked by our own fp32 tokens: every contestant gets a row with
    its bytes, floor, ratio to llama.cpp f32 and greedy agreement. No timing is checked."""
    from benchmarks import decode_speed as ds
    from benchmarks.cache_cost import bandwidth_floor
    torch.manual_seed(0)
    model = KVCacheGPT(TINY_CONFIGS[0]).eval()
    reference = ds.ours_run(model, ds.random_prompt(model.config.vocab_size), 8, False)()[0]
    monkeypatch.setattr(ds, "llama_cpp_engines", fake_llama_engines)
    monkeypatch.setattr(ds, "llama_greedy", lambda llm, ids, n: reference[:n])
    floors = {"tiny": bandwidth_floor(model, reps=1)}
    r = ds.decode_speed({"tiny": model}, 8, 1, floors, compile_note="compiled row skipped")
    assert r["compile_note"] == "compiled row skipped" and r["llama_cpp_note"] is None
    assert r["cpu_capability"] == torch.backends.cpu.get_cpu_capability()  # AVX512, AVX2, ...
    (table,) = r["models"]
    assert table["tokens"] == 8 and table["skipped"] == {}
    assert table["int4_group_size"] == 32  # 32 wide: int4's default 64 does not divide it
    assert list(table["rows"]) == ["ours fp32 eager", "ours bf16", "ours bf16, torch's matmul", "ours int8",
                                  "ours int4", "llama.cpp f32"]
    for name, row in table["rows"].items():
        assert row["tok_s"]["min"] <= row["tok_s"]["median"] <= row["tok_s"]["max"]
        assert row["floor_ms"] == pytest.approx(row["weight_bytes"] / floors["tiny"]["read_GBps"] / 1e6)
        assert row["vs_llama_cpp_f32"] > 0 and 0 <= row["greedy_leading_same"] <= 8
    assert table["rows"]["llama.cpp f32"]["vs_llama_cpp_f32"] == 1
    assert table["rows"]["llama.cpp f32"]["greedy_leading_same"] == 8
    assert table["rows"]["ours bf16"]["weight_bytes"] == table["rows"]["ours fp32 eager"]["weight_bytes"] / 2
    # ours beside llama.cpp in the same format: only the pairs both sides ran
    assert table["pairs"] == {"ours fp32 eager / llama.cpp f32":
                              table["rows"]["ours fp32 eager"]["vs_llama_cpp_f32"]}
    # without llama.cpp, or leaving out quantization: ours alone, no ratio column
    r = ds.decode_speed({"tiny": model}, 8, 1, floors, compile_note="x", llama_cpp_note="absent",
                        quantize=False)
    rows = r["models"][0]["rows"]
    assert list(rows) == ["ours fp32 eager", "ours bf16", "ours bf16, torch's matmul"]
    assert "vs_llama_cpp_f32" not in rows["ours bf16"]


def test_the_decode_speed_table_alone(tmp_path):
    """python -m benchmarks.decode_speed: the bundled model and a shape, as benchmark.py's
    table (llama.cpp's rows when llama-cpp-python is installed)."""
    out = tmp_path / "speed.json"
    proc = run_script("benchmarks/decode_speed.py", "--shape", "tiny", "--tokens", "4", "--reps", "1",
                      "--no-compile", "--group-size", "128", "--json", out)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert [t["model"] for t in r["models"]] == ["bundled", "tiny shape"]
    assert [t["int4_group_size"] for t in r["models"]] == [128, 128]
    assert "int4 in groups of 128" in proc.stdout
    assert r["command"].startswith("python -m benchmarks.decode_speed --shape tiny")
    assert "ours fp32 compiled" not in r["models"][0]["rows"] and "--no-compile" in r["compile_note"]
    assert "## Decode speed" in proc.stdout


def test_batches_report_their_flops_against_the_peak(tmp_path):
    """python -m benchmarks.batching: each batch's matmul FLOP/s is 2 x the Linear weights x
    rows per step over the step's time, and its share of the measured peak."""
    out = tmp_path / "batch.json"
    proc = run_script("benchmarks/batching.py", "--shape", "tiny", "--sizes", "2,1", "--tokens", "4",
                      "--reps", "1", "--json", out)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert list(r["sizes"]) == ["1", "2"] and r["peak_gflop_s"] > 0 and r["peak_size"] == 2048
    from benchmarks.cache_cost import random_model
    from benchmarks.weight_formats import linear_layers
    flops = 2 * sum(m.in_features * m.out_features for m in linear_layers(random_model("tiny", "cpu")))
    for b, row in r["sizes"].items():
        assert row["gflop_s"] == pytest.approx(flops * int(b) / row["step_ms"]["median"] / 1e6)
        assert row["of_peak"] == pytest.approx(row["gflop_s"] / r["peak_gflop_s"])
    proc = run_script("benchmarks/batching.py", "--sizes", "0")
    assert proc.returncode == 2 and "must be >= 1" in proc.stderr


def test_context_policies_on_a_llama(tmp_path):
    """benchmarks/context_policy.py: both policies fed the same text through the loop; the
    sinks policy computes every position once, reprefill some twice; both losses finite and
    close to the one-pass windows' (the same text, the same model)."""
    from benchmarks.context_policy import context_policies
    from conftest import byte_tokenizer
    from test_llama_tools import tiny_llama
    model, tokenizer = tiny_llama(), byte_tokenizer()
    text = "ROMEO: But soft, what light through yonder window breaks? " * 4
    r = context_policies(model, tokenizer, text, multiple=3, reps=1)
    reprefill, sinks = r["policies"]["reprefill"], r["policies"]["sinks"]
    n = r["tokens"]
    assert n == 3 * model.config.context_len
    assert sinks["positions_processed"] == n and sinks["reprefills"] == 0 and sinks["evictions"] > 0
    assert reprefill["positions_processed"] > n and reprefill["reprefills"] > 0
    for p in (reprefill, sinks, {"bits_per_char": r["windows_bits_per_char"]}):
        assert 0 < p["bits_per_char"] < 20
    gpt = context_policies(tiny_model(TINY_CONFIGS[0]), tokenizer, text, 2, reps=1)
    assert "sinks" in gpt["skipped"] and "reprefill" in gpt["policies"]


def test_llama_speed_table_on_a_tiny_shape():
    """benchmarks/llama_speed.py's table on its tiny shape: ours fp32, int8, int4 (and
    llama.cpp's f32, q8_0 and q4_0 when llama-cpp-python is installed), the pairs' ratios;
    the prefill table's rows for each form and length, and llama-bench's where it is built."""
    from benchmarks.llama_speed import llama_speed
    r = llama_speed("tiny", 4, 1, torch.device("cpu"), prefill_lengths=(8, 32), forms=("fp32", "int8", "int4"))
    rows = r["models"][0]["rows"]
    assert {"ours fp32 eager", "ours int8", "ours int4"} <= set(rows)
    prefill = r["prefill"]
    assert set(prefill["ours"]) == {"fp32", "int8", "int4"}
    assert all(set(row["tok_s"]) == {8, 32} and row["GFLOPs"][32] > 0 for row in prefill["ours"].values())
    if prefill["llama_bench_note"] is None:
        assert set(prefill["llama_bench"]) == {"llama.cpp f32", "llama.cpp q8_0", "llama.cpp q4_0"}
        assert all(set(row["pp"]) == {8, 32} and row["tg"] > 0 for row in prefill["llama_bench"].values())
    if r["llama_cpp_note"] is None:
        assert {"llama.cpp f32", "llama.cpp q8_0", "llama.cpp q4_0"} <= set(rows)
        assert set(r["pairs"]) == {"ours fp32 eager / llama.cpp f32", "ours int8 / llama.cpp q8_0",
                                   "ours int4 / llama.cpp q4_0"}
        assert rows["llama.cpp f32"]["greedy_leading_same"] == 4


def test_llama_speed_compiled_rows_run_on_the_eager_forms_weights(builds, monkeypatch):
    """--compiled: each quantized form's compiled step beside its eager row, on the same
    model (its step reads the model's own weights: no second copy), one build for it; in
    llama-bench's decode table, ours eager and compiled beside the same format (conftest's
    `builds`: the exported graph run by Python, no C++)."""
    from benchmarks import decode_speed
    from benchmarks.llama_speed import llama_speed
    made = []  # each form's model made for the decode table
    monkeypatch.setattr(decode_speed, "ours_variant", lambda *a, made_by=decode_speed.ours_variant:
                        made.append(made_by(*a)) or made[-1])
    r = llama_speed("tiny", 4, 1, torch.device("cpu"), prefill_lengths=(8,), forms=("int8",), compiled=True)
    rows = r["models"][0]["rows"]
    assert {"ours int8", "ours int8 compiled"} <= set(rows) and len(builds) == 1
    assert len(made) == 1 and builds[0].model is made[0]  # the compiled step's model: the eager row's
    assert rows["ours int8 compiled"]["weight_bytes"] == rows["ours int8"]["weight_bytes"]
    if r["prefill"]["llama_bench_note"] is None:
        assert [name for name, _ in r["prefill"]["ours_decode"]["llama.cpp q8_0"]] == ["ours int8",
                                                                                       "ours int8 compiled"]


def test_speculative_section_beside_its_peers():
    """The speculative-decoding section on tiny models, with the peers that are installed
    (CI installs them all): every contestant's row; the greedy tokens of each system, with
    and without speculation, equal to ours plain (identical weights: speculation must not
    change greedy text, ours or theirs); the cost model's figures. No speed is checked."""
    from base_model import GPTConfig
    from benchmarks import speculative as spec
    from benchmarks.peers import llama_cpp_missing
    from conftest import tiny_model
    model = tiny_model(TINY_CONFIGS[0], seed=3)
    draft = tiny_model(GPTConfig(context_len=64, vocab_size=260, n_layer=1, n_head=2, n_embd=16), seed=4)
    prompts, n = [[7, 8, 9, 10] * 4, list(range(40, 56))], 12
    expected = {"ours plain", "ours lookup K=4 N=2"}
    try:
        import transformers  # noqa: F401
        expected |= {"transformers plain", "transformers lookup 10"}
    except ImportError:
        pass
    if llama_cpp_missing() is None:
        expected |= {"llama.cpp plain", "llama.cpp lookup 10"}
    lookup = spec.prompt_lookup_section(model, prompts, n, 1, k=4, ngram=2)
    assert set(lookup["rows"]) == expected
    for name, row in lookup["rows"].items():
        assert row["same_tokens"] == row["of_tokens"] == n * len(prompts), name
        assert row["speedup_over_own_plain"] > 0
    assert lookup["rows"]["ours lookup K=4 N=2"]["accepted"] > 0  # the repeating prompt
    drafted = spec.draft_section(model, draft, prompts, n, 1, [1, 3])
    rows = drafted["rows"]
    assert {"ours plain", "ours draft K=1", "ours draft K=3"} <= set(rows)
    if "transformers plain" in expected:
        assert {"transformers assisted K=1", "transformers assisted K=3"} <= set(rows)
    for name, row in rows.items():
        assert row["same_tokens"] == row["of_tokens"], name
    times = drafted["step_ms"]
    assert times["model_ms"] > 0 and times["draft_ms"] > 0 and set(times["verify_ms"]) == {1, 3}
    for k in (1, 3):
        row = rows[f"ours draft K={k}"]
        assert 1 <= row["tokens_per_verification"] <= k + 1 and 0 <= row["acceptance_from_E"] <= 1
        assert row["predicted_speedup"] > 0


@pytest.mark.parametrize("peer, package", [("ctranslate2_peer", "ctranslate2"), ("openvino_peer", "openvino-genai")])
def test_a_peer_in_its_own_environment_says_in_one_line_where_it_is_absent(peer, package):
    """The CTranslate2 and OpenVINO peers run in virtual environments of their own (each
    module's docstring); in the project's, which has neither, each says so in one line and
    exits non-zero, naming the docstring that makes its environment."""
    for absent in ("ctranslate2", "openvino_genai"):
        if importlib.util.find_spec(absent) is not None:
            pytest.skip(f"{absent} is installed here: the peer would run")
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{peer}", str(ROOT)], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [f"{peer}.py: {package} is not installed here; the module "
                                                "docstring says how to make its environment"]
