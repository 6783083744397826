"""
llama.cpp's own benchmark tool, llama-bench, on our weights: the prompt-processing (pp) and
token-generation (tg) figures llama.cpp users quote, from the native binary rather than the
Python binding. benchmarks/llama_speed.py puts them beside ours.

It is built from the pinned sources by `python -m benchmarks.llama_cpp_build tools DIR`
(default DIR ~/.cache/kvcache-gpt/llama-cpp); where it is not there, the rows are skipped
in one line. Each format's GGUF is written by export_gguf.py from the same fp32 weights
(llama.cpp quantizes q8_0/q4_0 itself inside the export, as its converter does) into a
temporary folder that goes when the run ends.
"""

import json
import subprocess
import tempfile
from pathlib import Path

import torch

from benchmarks.llama_cpp_build import build_folder, cpu_flags
from benchmarks.peers import gguf_weight_bytes, placeholder_tokenizer

TOOLS_PARENT = Path("~/.cache/kvcache-gpt/llama-cpp")


def llama_bench_path(parent=TOOLS_PARENT):
    """The llama-bench that llama_cpp_build.py builds for this CPU, or None."""
    path = build_folder(parent, "tools", cpu_flags())[0] / "llama-bench"
    return path if path.is_file() else None


def llama_bench_missing():
    """None where llama-bench and the gguf package are there, else one line saying why not."""
    if llama_bench_path() is None:
        return (f"llama-bench skipped: not built (python -m benchmarks.llama_cpp_build tools "
                f"{TOOLS_PARENT})")
    try:
        import gguf  # noqa: F401  (export_gguf.py writes the files with it)
    except ImportError:
        return "llama-bench skipped: the gguf package is not installed; pip install -r requirements-dev.txt"
    return None


def run_llama_bench(path, prompt_lengths, n, reps):
    """llama-bench on one GGUF: {"pp": {length: tok/s}, "tg": tok/s} (its mean over reps),
    torch's thread count."""
    command = [str(llama_bench_path()), "-m", str(path), "-p", ",".join(map(str, prompt_lengths)),
               "-n", str(n), "-t", str(torch.get_num_threads()), "-r", str(reps), "-o", "json"]
    records = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    result = {"pp": {}, "tg": None}
    for record in records:  # one per test: pp<length> (n_gen 0) or tg<n> (n_prompt 0)
        if record["n_gen"] == 0:
            result["pp"][record["n_prompt"]] = record["avg_ts"]
        else:
            result["tg"] = record["avg_ts"]
    return result


def llama_bench_rows(model, label, outtypes, prompt_lengths, n, reps):
    """{"llama.cpp <outtype>": run_llama_bench's figures and the weight bytes a token reads}
    for the fp32 model exported in each outtype."""
    from export_gguf import write_gguf
    rows = {}
    with tempfile.TemporaryDirectory() as folder:
        for outtype in outtypes:
            path = Path(folder) / f"{outtype}.gguf"
            write_gguf(path, model, placeholder_tokenizer(), outtype, label)
            rows[f"llama.cpp {outtype}"] = {**run_llama_bench(path, prompt_lengths, n, reps),
                                            "weight_bytes": gguf_weight_bytes(path)}
            path.unlink()  # one file at a time on the disk (5 GB in f32 at the 1B shape)
    return rows
