"""Every user mistake: exit status 2, one line on stderr naming the problem, no traceback.
The scripts run in this process (conftest.run_script), but for the FIFO case (run_case);
tests/test_terminal.py has one-line errors of processes of their own."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from plumbing.checkpoint import BUNDLED, ROOT
from conftest import TINY_CONFIGS, byte_tokenizer_spec, run_script, tiny_model


class Exploit:
    def __reduce__(self):
        return (print, ("code ran at load time",))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (d / "empty.txt").write_text("")
    (d / "notes.txt").write_text("not a checkpoint")
    torch.save({"model": tiny_model(TINY_CONFIGS[0]).state_dict()}, d / "good.pt")
    (d / "cut.pt").write_bytes((d / "good.pt").read_bytes()[:2000])
    torch.save({"model": Exploit()}, d / "evil.pt")
    torch.save({"model": {"transformer.wte.weight": torch.zeros(3, 3)}, "config": {}}, d / "partial.pt")
    state = tiny_model(TINY_CONFIGS[0]).state_dict()
    config = vars(TINY_CONFIGS[0]).copy()
    nan = dict(state, **{"transformer.ln_f.weight": torch.full((32,), float("nan"))})
    swapped = byte_tokenizer_spec()["mergeable_ranks"]
    swapped[97], swapped[98] = swapped[98], swapped[97]  # token 97 is "b", 98 is "a"
    for name, obj in {"tiny": {"model": state, "config": config, "tokenizer": byte_tokenizer_spec()},
                      "nan": {"model": nan, "config": config, "tokenizer": byte_tokenizer_spec()},
                      "heads0": {"model": state, "config": config | {"n_head": 0}},
                      "context1e6": {"model": state, "config": config | {"context_len": 10 ** 6}},
                      "no_eot": {"model": state, "config": config,
                                 "tokenizer": byte_tokenizer_spec() | {"special_tokens": {}}},
                      # drafts for tiny.pt that do not share its tokenizer
                      "more_tokens": {"model": state, "config": config, "tokenizer": byte_tokenizer_spec()
                                      | {"special_tokens": {"<|endoftext|>": 256, "<|pad|>": 257}}},
                      "swapped": {"model": state, "config": config,
                                  "tokenizer": byte_tokenizer_spec() | {"mergeable_ranks": swapped}}}.items():
        torch.save(obj, d / f"{name}.pt")
    os.mkfifo(d / "fifo.pt")  # opening it would wait for a writer forever
    return d


CASES = [  # (script, args, what the error line must mention)
    ("generate.py", ["--temperature", "-1"], "--temperature"),
    ("generate.py", ["--temperature", "hot"], "--temperature"),
    ("generate.py", ["--top-p", "0"], "--top-p"),
    ("generate.py", ["--top-p", "1.5"], "--top-p"),
    ("generate.py", ["--top-k", "0"], "--top-k"),
    ("generate.py", ["--top-k", "1.5"], "--top-k"),
    ("generate.py", ["--num-samples", "0"], "--num-samples"),
    ("generate.py", ["--max-new-tokens", "-5"], "--max-new-tokens"),
    ("generate.py", ["--seed", "abc"], "--seed"),
    ("generate.py", ["--device", "tpu"], "--device"),
    ("generate.py", ["--dtype", "float64"], "--dtype"),
    ("generate.py", ["--stop", ""], "--stop"),
    ("generate.py", ["--frobnicate"], "unrecognized"),
    ("generate.py", ["--prompt", "a", "--prompt-file", "{d}/empty.txt"], "not allowed with"),
    ("generate.py", ["--prompt-file", "{d}/missing.txt"], "cannot read"),
    ("generate.py", ["--prompt-file", "{d}"], "is a directory"),
    ("generate.py", ["--prompt-file", "{d}/empty.txt/x"], "cannot read"),
    ("generate.py", ["--prompt-file", "{d}/latin1.txt"], "not UTF-8"),
    ("generate.py", ["--score", "{d}/empty.txt"], "empty"),
    ("generate.py", ["--score", "{d}/missing.txt"], "cannot read"),
    ("generate.py", ["--ckpt", "{d}/missing.pt"], "no such file"),
    ("generate.py", ["--ckpt", "{d}"], "is a directory"),
    ("generate.py", ["--ckpt", "{d}/notes.txt"], "not a readable PyTorch checkpoint"),
    ("generate.py", ["--ckpt", "{d}/cut.pt"], "not a readable PyTorch checkpoint"),
    ("generate.py", ["--ckpt", "{d}/evil.pt"], "refused"),
    ("generate.py", ["--ckpt", "{d}/partial.pt"], "missing key"),
    ("generate.py", ["--prompt", "a", "--prompt", "b", "--no-cache"], "--no-cache"),
    ("generate.py", ["--prompt", "-", "--prompt", "-"], "standard input"),
    ("generate.py", ["--prompts-file", "{d}/empty.txt"], "no prompts"),
    ("generate.py", ["--prompts-file", "{d}/missing.txt"], "cannot read"),
    ("generate.py", ["--prompt", "a", "--prompts-file", "{d}/empty.txt"], "not allowed with"),
    # speculative decoding (tests/test_speculative.py has the rest)
    ("generate.py", ["--speculate", "4"], "needs a proposer"),
    ("generate.py", ["--speculate", "0", "--prompt-lookup", "2"], "--speculate"),
    ("generate.py", ["--prompt-lookup", "2"], "also give --speculate"),
    ("generate.py", ["--draft", "{d}/tiny.pt"], "also give --speculate"),
    ("generate.py", ["--speculate", "2", "--prompt-lookup", "0"], "--prompt-lookup"),
    ("generate.py", ["--speculate", "2", "--prompt-lookup", "17"], "must be <= 16"),
    ("generate.py", ["--ckpt", "{d}/tiny.pt", "--speculate", "64", "--prompt-lookup", "2"],
     "use at most 63"),
    ("generate.py", ["--speculate", "2", "--prompt-lookup", "2", "--draft", "{d}/tiny.pt"], "not allowed with"),
    ("generate.py", ["--speculate", "2", "--prompt-lookup", "2", "--no-cache"], "--no-cache"),
    ("generate.py", ["--speculate", "2", "--prompt-lookup", "2", "--score", "{d}/empty.txt"],
     "--speculate applies to generating; --score"),
    ("generate.py", ["--draft", "{d}/tiny.pt", "--score", "{d}/empty.txt"], "--draft applies to generating"),
    ("generate.py", ["--speculate", "2", "--draft", "{d}/missing.pt"], "--draft: {d}/missing.pt: no such file"),
    ("generate.py", ["--speculate", "2", "--draft", ""], "--draft: empty path"),
    ("generate.py", ["--speculate", "2", "--draft", "{d}"], "--draft: {d}: no config.json"),
    ("generate.py", ["--speculate", "2", "--draft", "{d}/notes.txt"], "not a readable PyTorch checkpoint"),
    ("generate.py", ["--ckpt", "{d}/tiny.pt", "--speculate", "2", "--draft", str(BUNDLED)],
     "a vocabulary of 4096 tokens, the model's 257"),
    ("generate.py", ["--ckpt", "{d}/tiny.pt", "--speculate", "2", "--draft", "{d}/more_tokens.pt"],
     "a vocabulary of 258 tokens, the model's 257"),
    ("generate.py", ["--ckpt", "{d}/tiny.pt", "--speculate", "2", "--draft", "{d}/swapped.pt"],
     "token 97 is b'b', the model's b'a'"),
    ("kv_cache.py", ["--draft", "{d}/tiny.pt"], "is not the model's"),
    ("kv_cache.py", ["--ckpt", "{d}/tiny.pt", "--speculate", "64"], "use at most 63"),
    ("kv_cache.py", ["--tokens", "0"], "--tokens"),
    ("kv_cache.py", ["--ckpt", "{d}/missing.pt"], "no such file"),
    ("kv_cache.py", ["--device", "tpu"], "--device"),
    # found by the hostile-input pass (issue 15): each was a traceback, a hang, a silent
    # fallback or silently wrong output before
    ("generate.py", ["--ckpt", ""], "empty path"),
    ("generate.py", ["--hf", ""], "empty path"),
    ("generate.py", ["--seed", "-1"], "--seed"),
    ("generate.py", ["--seed", str(2 ** 32)], "--seed"),
    ("generate.py", ["--ckpt", "{d}/nan.pt"], "NaN"),
    ("generate.py", ["--ckpt", "{d}/heads0.pt"], "n_head must be a positive integer"),
    ("generate.py", ["--ckpt", "{d}/context1e6.pt"], "would need"),
    ("generate.py", ["--ckpt", "{d}/no_eot.pt"], "no <|endoftext|> token"),
    ("generate.py", ["--ckpt", "{d}/fifo.pt"], "not a regular file"),
    ("generate.py", ["--ckpt", "{d}/" + "x" * 300], "File name too long"),
    ("generate.py", ["--ckpt", "{d}/two\nlines.pt"], "two\\nlines.pt: no such file"),
    ("generate.py", ["--prompt", b"caf\xe9"], "--prompt: not UTF-8"),
    ("generate.py", ["--stop", b"\xff"], "--stop: not UTF-8"),
    ("generate.py", ["--num-samples", "100000000", "--ckpt", "{d}/tiny.pt"], "would need"),
    ("benchmark.py", ["--quick", "--lengths", "5000"], "does not fit"),
    ("benchmark.py", ["--quick", "--prompt-tokens", "5000"], "--prompt-tokens"),
    ("benchmark.py", ["--quick", "--demo-tokens", "1"], "--demo-tokens"),
    ("benchmark.py", ["--quick", "--naive-check", "-1"], "--naive-check"),
    ("benchmark.py", ["--quick", "--spec-ks", "2,300"], "do not fit"),
    ("benchmark.py", ["--quick", "--spec-lookup-ngram", "17"], "must be <= 16"),
    ("benchmark.py", ["--quick", "--spec-text", "{d}/missing.txt"], "cannot read"),
    ("benchmark.py", ["--quick", "--spec-draft", "{d}/tiny.pt"], "is not the model's"),
    ("benchmark.py", ["--quick", "--json", "{d}/good.pt"], "not written by kvcache-gpt"),
    ("benchmark.py", ["--quick", "--json", ""], "empty path"),
    ("benchmark.py", ["--quick", "--json", "{d}/good.pt/out.json"], "is a file, not a folder"),
    ("export_hf.py", ["{d}/good.pt", ""], "empty path"),
    ("export_hf.py", ["{d}/good.pt", "{d}/good.pt/out"], "is a file, not a folder"),
    ("export_hf.py", ["{d}/nan.pt", "{d}/export"], "NaN"),
    # the second hostile-input pass (issue 23)
    ("generate.py", ["--score", ""], "--score: empty path"),
    ("generate.py", ["--prompt-file", ""], "--prompt-file: empty path"),
    ("generate.py", ["--prompts-file", ""], "--prompts-file: empty path"),
    ("generate.py", ["--score", "{d}/notes.txt", "--compile"], "--compile applies to generating"),
    ("generate.py", ["--score", "{d}/notes.txt", "--num-samples", "2"], "--num-samples applies"),
    ("generate.py", ["--score", "{d}/notes.txt", "--stop", "x"], "--stop applies"),
    ("generate.py", ["--score", "{d}/notes.txt", "--temperature", "0"], "--temperature applies"),
    ("generate.py", ["--score", "{d}/notes.txt", "--context-policy", "sinks"], "--context-policy applies"),
    ("generate.py", ["--sinks", "8"], "--sinks applies to --context-policy sinks"),
    ("generate.py", ["--context-policy", "error"], "invalid choice: 'error'"),
    ("memory_plan.py", ["--plot", ""], "empty path"),
    ("memory_plan.py", ["--plot", "{d}/notes.txt"], "not written by kvcache-gpt"),
    ("memory_plan.py", ["--plot", "{d}"], "is a directory"),
    ("memory_plan.py", ["--plot", "{d}/good.pt/x.png"], "is a file, not a folder"),
    ("memory_plan.py", ["--memory", "0"], "--memory"),
    ("memory_plan.py", ["--kv-dtypes", "int8,int8"], "int8 given twice"),
    ("memory_plan.py", ["--kv-dtypes", ""], "--kv-dtypes"),
    ("serve.py", ["--host", ""], "--host is empty"),
    ("serve.py", ["--max-waiting", "5"], "--max-waiting (5) must be at least"),
    ("serve.py", ["--ckpt", "{d}/tiny.pt", "--num-blocks", "1000000000"], "would need"),
    ("serve.py", ["--ckpt", "{d}/tiny.pt", "--tokens-per-block", "1000000000"], "would need"),
    ("serve.py", ["--ckpt", "{d}/tiny.pt", "--kv-dtype", "int8", "--num-blocks", "4000000000"], "would need"),
    ("serve.py", ["--kv-dtype", "int7"], "invalid choice: 'int7'"),
    ("serve.py", ["--build-only", "--no-compile"], "drop --no-compile and --no-compile-cache"),
    ("serve.py", ["--ckpt", "{d}/tiny.pt", "--build-only", "--kv-dtype", "int8"], "there is no compiled step to build"),
    ("serve.py", ["--speculate", "4"], "--speculate K needs a proposer"),
    ("serve.py", ["--prompt-lookup", "3"], "also give --speculate K"),
    ("serve.py", ["--draft", "{d}/good.pt"], "--draft: also give --speculate K"),
    ("serve.py", ["--ckpt", "{d}/tiny.pt", "--speculate", "2", "--draft", "{d}/swapped.pt"],
     "token 97 is b'b', the model's b'a'"),
    ("serve.py", ["--ckpt", "{d}/tiny.pt", "--speculate", "100000", "--prompt-lookup", "3"], "use at most"),
]
if importlib.util.find_spec("matplotlib") is None:  # found before the run, not after it
    CASES.append(("benchmark.py", ["--quick", "--plot", "{d}/new.png"], "needs matplotlib"))
if not torch.cuda.is_available():
    CASES.append(("generate.py", ["--device", "cuda"], "no CUDA GPU"))
if not torch.backends.mps.is_available():
    CASES.append(("kv_cache.py", ["--device", "mps"], "Metal"))


def case_id(script, args):
    return f"{script}:{' '.join(a if isinstance(a, str) else repr(a) for a in args)}".replace("{d}", "")[:80]


def run_case(script, args):
    """run_script, but the FIFO runs in a process of its own: were it opened, the run would
    wait for a writer forever, and only a process can be stopped by a timeout."""
    if any(isinstance(a, str) and a.endswith("fifo.pt") for a in args):
        return subprocess.run([sys.executable, str(ROOT / script), *args], capture_output=True,
                              text=True, timeout=120, stdin=subprocess.DEVNULL)
    return run_script(script, *args)


@pytest.mark.parametrize("script, args, mention", CASES, ids=[case_id(s, a) for s, a, _ in CASES])
def test_bad_input_exits_2_with_one_line(files, script, args, mention):
    args = [a.replace("{d}", str(files)) if isinstance(a, str) else a for a in args]
    before = {p.name: p.read_bytes() for p in files.iterdir() if p.is_file()}
    proc = run_case(script, args)
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("loaded ")]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert mention.replace("{d}", str(files)) in lines[0]
    assert "code ran at load time" not in proc.stdout
    assert {p.name: p.read_bytes() for p in files.iterdir() if p.is_file()} == before  # nothing lost
    assert not (files / "export").exists()  # no half-written export left behind
