"""generate.py as a user runs it, on the bundled model: in this process (conftest.run_script),
and once in a process of its own to show that both print the same."""

import json
import subprocess
import sys

import pytest

from plumbing.checkpoint import BUNDLED, ROOT, load_model
from conftest import TINY_CONFIGS, run_script
from plumbing.text_stream import SampleText
from kv_cache import CACHED_MODELS

BLOCK_SIZE = 256  # the bundled model's context


def run_cli(*args, stdin="", script="generate.py", ckpt=True):
    return run_script(script, *(["--ckpt", str(BUNDLED)] if ckpt else []), *args, stdin=stdin)


def generate(*args, **kw):
    proc = run_cli(*args, **kw)
    assert proc.returncode == 0, proc.stderr
    return proc


def generate_json(*args):
    return json.loads(generate(*args, "--json").stdout)


def test_a_process_of_its_own_prints_the_same():
    """The real thing once: a fresh interpreter, the streams of a pipe, sampled text (the
    random state) with characters of several bytes. stderr: the "loaded" line."""
    args = ("--ckpt", str(BUNDLED), "--prompt", "Çà et là 👋 ROMEO:", "--seed", "3", "--max-new-tokens", "60")
    real = subprocess.run([sys.executable, str(ROOT / "generate.py"), *args], capture_output=True,
                          timeout=300, stdin=subprocess.DEVNULL)
    here = run_script("generate.py", *args)
    assert real.returncode == here.returncode == 0
    assert real.stdout.decode("utf-8") == here.stdout and real.stderr.decode("utf-8") == here.stderr
    assert here.stdout.startswith("Çà et là 👋 ROMEO:") and here.stderr.startswith("loaded ")


def test_greedy_cached_equals_no_cache():
    args = ("--prompt", "ROMEO:", "--temperature", "0", "--max-new-tokens", "80", "--ignore-eot")
    cached = generate(*args).stdout
    assert cached.startswith("ROMEO:") and len(cached) > 100
    assert generate(*args, "--no-cache").stdout == cached


def test_same_seed_same_text_cached_or_not():
    args = ("--prompt", "JULIET:", "--seed", "7", "--top-k", "40", "--max-new-tokens", "60")
    first = generate(*args).stdout
    assert generate(*args, "--no-cache").stdout == first  # the same draws, whichever loop
    assert generate("--prompt", "JULIET:", "--seed", "8", "--top-k", "40",
                    "--max-new-tokens", "60").stdout != first


def test_num_samples_prefill_once_and_print_separately():
    out = generate_json("--prompt", "KING:", "--num-samples", "3", "--max-new-tokens", "40",
                        "--seed", "3")
    assert len(out["texts"]) == 3 and len(set(out["texts"])) > 1
    assert out["stats"]["prefill_passes"] == 1
    text = generate("--prompt", "KING:", "--num-samples", "3", "--max-new-tokens", "40",
                    "--seed", "3").stdout
    for i, sample in enumerate(out["texts"]):
        assert f"--- sample {i + 1} of 3 ---\nKING:{sample}\n" in text


def test_stop_string_truncates_and_is_not_printed():
    args = ("--prompt", "ROMEO:", "--temperature", "0", "--max-new-tokens", "120", "--ignore-eot")
    full = generate_json(*args)["texts"][0]
    stop = full[40:44]  # some string the greedy text contains
    cut = full[:full.index(stop)]
    out = generate_json(*args, "--stop", stop, "--stop", "never-in-this-text")
    assert out["texts"] == [cut]
    assert out["stats"]["decode_steps"] < 120  # stopped early, not just truncated at the end
    assert generate(*args, "--stop", stop).stdout == "ROMEO:" + cut + "\n"


def test_ten_times_context_len_tokens(tiny_ckpt):
    # a tiny model (context 64): the bundled model's 2,560 tokens took 22-29 s of the suite
    context = TINY_CONFIGS[0].context_len
    n = 10 * context
    proc = run_script("generate.py", "--ckpt", str(tiny_ckpt), "--prompt", "", "--max-new-tokens", str(n),
                      "--ignore-eot", "--seed", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["stats"]["new_tokens"] == [n]
    # a 1-token prompt fills the context after 63 steps; a reprefill keeps 32 tokens, so the
    # next one comes 33 steps later (the last of the n tokens needs no forward pass)
    first = context - 1
    assert out["stats"]["reprefills"] == (n - 1 - first) // (context // 2 + 1) + 1
    assert out["stats"]["cache_positions"] <= context


def test_streamed_utf8_never_breaks_characters():
    prompt = "Çà et là, naïve café 👋🎭 — "
    for seed in range(3):
        proc = generate("--prompt", prompt, "--seed", str(seed), "--max-new-tokens", "60",
                        "--temperature", "1.0")
        assert proc.stdout.startswith(prompt) and "\ufffd" not in proc.stdout


def test_sample_text_holds_back_partial_characters():
    _, tok = load_model(CACHED_MODELS, BUNDLED, report=lambda _: None)
    text = "naïve 👋🎭 café"
    ids = tok.encode_ordinary(text)
    assert len(ids) > len(text) // 2  # emoji are split across several byte tokens
    sample, seen = SampleText(tok, stops=[]), []
    for i in ids:
        sample.add(i)
        seen.append(sample.text[:sample.ready()])
    assert all("\ufffd" not in s and text.startswith(s) for s in seen) and seen[-1] == text


def test_json_output_has_documented_keys():
    out = generate_json("--prompt", "ROMEO:", "--max-new-tokens", "10")
    assert set(out) == {"prompt", "prompts", "texts", "stats"}
    assert {"prompt_tokens", "new_tokens", "decode_steps", "prefill_seconds",
            "time_to_first_token_seconds", "decode_tokens_per_second", "forward_passes",
            "prefill_passes", "positions_processed", "cache_positions", "cache_bytes_formula",
            "cache_bytes_allocated", "cache_formula", "reprefills"} <= set(out["stats"])


def test_stats_go_to_stderr_and_stdout_stays_text():
    proc = generate("--prompt", "ROMEO:", "--max-new-tokens", "10", "--stats", "--temperature", "0")
    assert "decode:" in proc.stderr and "KV cache:" in proc.stderr and "by the formula" in proc.stderr
    assert "tokens/s" not in proc.stdout


def test_prompt_from_file_stdin_and_empty():
    from_stdin = generate("--prompt", "-", "--temperature", "0", "--max-new-tokens", "10",
                          stdin="ROMEO:").stdout
    assert from_stdin == generate("--prompt", "ROMEO:", "--temperature", "0",
                                  "--max-new-tokens", "10").stdout
    empty = generate_json("--max-new-tokens", "5", "--temperature", "0")
    assert empty["stats"]["prompt_tokens"] == [1]  # the end-of-text token


def test_long_prompt_is_cropped_with_one_note(tmp_path):
    path = tmp_path / "long.txt"
    path.write_text("To be, or not to be, that is the question. " * 200, encoding="utf-8")
    proc = generate("--prompt-file", str(path), "--max-new-tokens", "5", "--json")
    assert proc.stderr.count("note: the prompt has") == 1
    assert json.loads(proc.stdout)["stats"]["prompt_tokens"] == [BLOCK_SIZE]


def test_score_reports_bits_per_char(tmp_path):
    path = tmp_path / "snippet.txt"
    path.write_text("MACBETH:\nIs this a dagger which I see before me,\n"
                    "The handle toward my hand? Come, let me clutch thee.\n", encoding="utf-8")
    out = json.loads(generate("--score", str(path), "--json").stdout)
    assert out["chars"] == len(path.read_text(encoding="utf-8"))
    assert 0 < out["bits_per_char"] < 3.5 and 0 < out["nats_per_token"] < 6


# ---------------------------------------------------------------------------- several prompts

GREEDY = ("--temperature", "0", "--max-new-tokens", "40", "--ignore-eot")


def test_several_prompts_one_batch_each_as_alone():
    prompts = ["ROMEO:", "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?", "KING"]
    out = generate_json(*[a for p in prompts for a in ("--prompt", p)], *GREEDY)
    assert out["prompts"] == prompts and "prompt" not in out
    assert out["stats"]["prefill_passes"] == 1 and out["stats"]["new_tokens"] == [40] * 3
    # each prompt alone gives one text, the batch's row for it
    assert [generate_json("--prompt", p, *GREEDY)["texts"] for p in prompts] == [[t] for t in out["texts"]]
    printed = generate(*[a for p in prompts for a in ("--prompt", p)], *GREEDY).stdout
    assert printed == "".join(f"--- prompt {i + 1} of 3 ---\n{p}{t}\n"
                              for i, (p, t) in enumerate(zip(prompts, out["texts"])))


def test_prompts_file_json_lines_with_samples(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('"ROMEO:"\n\n{"prompt": "JULIET:\\nAy me!", "id": 7}\n', encoding="utf-8")
    out = generate_json("--prompts-file", str(path), "--num-samples", "2", "--seed", "5",
                        "--max-new-tokens", "20")
    assert out["prompts"] == ["ROMEO:", "JULIET:\nAy me!"]  # a multi-line prompt
    assert len(out["texts"]) == 4 and len(out["stats"]["new_tokens"]) == 4
    assert out["stats"]["prompt_tokens"][1] > out["stats"]["prompt_tokens"][0]


def test_rows_stop_on_their_own():
    args = ("--prompt", "ROMEO:", "--prompt", "JULIET:", *GREEDY)
    full = generate_json(*args)["texts"]
    stop = full[0][10:14]  # in the first row's text (and perhaps not in the second's)
    out = generate_json(*args, "--stop", stop)
    assert out["texts"][0] == full[0][:full[0].index(stop)]
    second = full[1][:full[1].index(stop)] if stop in full[1] else full[1]
    assert out["texts"][1] == second  # unchanged by the first row's stopping


@pytest.mark.parametrize("line, mention", [("not json", "line 2: not JSON"),
                                           ("42", "line 2: expected a JSON string"),
                                           ('{"text": "x"}', 'line 2: expected a JSON string'),
                                           ('"\\ud800"', "line 2: character 1 is \\ud800"),
                                           ('{"prompt": "ab\\udc80"}', "line 2: character 3 is"),
                                           # deeper than any recursion limit: torch.compile
                                           # raises this process's to 2,000 (run_script runs
                                           # the command in-process)
                                           ("[" * 100_000 + "]" * 100_000, "line 2: nested too deeply"),
                                           ('"a"\v"b"', "line 2: not JSON")])
def test_bad_prompts_file_line_names_the_line(tmp_path, line, mention):
    path = tmp_path / "bad.jsonl"
    path.write_text('"fine"\n' + line + "\n", encoding="utf-8")
    proc = run_cli("--prompts-file", str(path))
    assert proc.returncode == 2 and mention in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_prompts_file_lines_end_at_newline_only(tmp_path):
    """JSON Lines: a JSON string may hold U+2028 and U+0085 (splitlines() cut there); \\r\\n is fine."""
    path = tmp_path / "prompts.jsonl"
    path.write_text('"a\u2028b"\r\n"c\x85d\\fe"\n', encoding="utf-8")
    out = generate_json("--prompts-file", str(path), "--max-new-tokens", "2")
    assert out["prompts"] == ["a\u2028b", "c\x85d\x0ce"]


def test_a_trillion_samples_are_refused_before_any_work():
    """Refused before anything per row is made (a list of 10**12 rows grew at ~110 MB/s):
    a process of its own, so that a regression ends in the timeout, not in a hung suite."""
    proc = subprocess.run([sys.executable, str(ROOT / "generate.py"), "--ckpt", str(BUNDLED),
                           "--prompt", "a", "--num-samples", str(10**12)],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2 and "decoding 1,000,000,000,000 rows together would need" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_prompt_file_of_a_million_spaces(tmp_path):
    """tiktoken alone panics on a million whitespace characters (plumbing/user_text.py, which
    --score and --prompts-file use too); the prompt keeps its last context_len tokens."""
    path = tmp_path / "spaces.txt"
    path.write_text(" " * 1_000_000 + "ROMEO:", encoding="utf-8")
    proc = generate("--prompt-file", str(path), "--max-new-tokens", "2", "--json")
    assert json.loads(proc.stdout)["stats"]["prompt_tokens"] == [BLOCK_SIZE]
    assert "keeping its last 256" in proc.stderr
