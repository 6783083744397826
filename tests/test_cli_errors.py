"""Every user mistake: exit status 2, one line on stderr naming the problem, no traceback."""

import subprocess
import sys

import pytest
import torch

from checkpoint import ROOT
from conftest import TINY_CONFIGS, tiny_model


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
    ("kv_cache.py", ["--tokens", "0"], "--tokens"),
    ("kv_cache.py", ["--ckpt", "{d}/missing.pt"], "no such file"),
    ("kv_cache.py", ["--device", "tpu"], "--device"),
]
if not torch.cuda.is_available():
    CASES.append(("generate.py", ["--device", "cuda"], "no CUDA GPU"))
if not torch.backends.mps.is_available():
    CASES.append(("kv_cache.py", ["--device", "mps"], "Metal"))


@pytest.mark.parametrize("script, args, mention", CASES,
                         ids=[f"{s}:{' '.join(a)}".replace("{d}", "") for s, a, _ in CASES])
def test_bad_input_exits_2_with_one_line(files, script, args, mention):
    args = [a.replace("{d}", str(files)) for a in args]
    proc = subprocess.run([sys.executable, str(ROOT / script), *args], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert mention in lines[0]
    assert "code ran at load time" not in proc.stdout
