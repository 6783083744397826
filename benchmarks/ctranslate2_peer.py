"""
CTranslate2 beside ours at a real model's shape: the same Hugging Face directory (the one
`python -m benchmarks.real_size` writes), converted by CTranslate2's own converter and run by
its Generator on the CPU, decode and prefill timed as benchmarks/llama_speed.py times ours.

CTranslate2 is a peer, not a dependency: it lives in a virtual environment of its own, with
torch kept at the project's pin (its converter loads the model through transformers):

    python -m venv /tmp/ct2-venv && . /tmp/ct2-venv/bin/activate
    pip install torch==2.13.0 ctranslate2==4.8.5 transformers safetensors
    python -m benchmarks.ctranslate2_peer ~/.cache/kvcache-gpt/real-size/1b/hf

It imports nothing of this project's (that environment has none of its packages). Each
compute type CTranslate2 offers on this CPU and we have a row for is run: float32 (our fp32)
and int8 (our --quantize int8: per-row int8 weights, as ours); it has no bfloat16 on a CPU.
The directory is converted once per type under --cache-dir (float32 and int8 weights).
Decode: a 16-token random prompt, 32 greedy tokens (min_length 32: no early end), the tokens
after the first timed as llama-bench's tg is; prefill: one pass over a 512-token random
prompt (the time to its first token). The first run of each is a warm-up; the median and
the min-max of --reps after it, 2 threads (intra_threads), as ours.
"""

import argparse
import importlib
import json
import random
import statistics
import sys
import time
from pathlib import Path

COMPUTE_TYPES = {"float32": "fp32", "int8": "int8"}  # CTranslate2's -> our row
PROMPT_TOKENS, NEW_TOKENS, PREFILL_TOKENS = 16, 32, 512
BYTE_TOKENS = 256  # the random prompts draw from the first ids, which every vocabulary has


def converted(model_dir, cache_dir, compute_type):
    """The CTranslate2 model of model_dir with weights of compute_type, converted once."""
    out = cache_dir / compute_type
    if not (out / "model.bin").is_file():
        from ctranslate2.converters import TransformersConverter
        TransformersConverter(str(model_dir)).convert(str(out), quantization=compute_type, force=True)
    return out


def decode_speed(generator, prompt):
    """Tokens/s of the NEW_TOKENS - 1 greedy tokens after the first."""
    times = []
    for _ in generator.generate_tokens(prompt, max_length=NEW_TOKENS, min_length=NEW_TOKENS, sampling_topk=1):
        times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0])


def prefill_speed(generator, prompt):
    """Prompt tokens/s of the pass that makes the first token."""
    start = time.perf_counter()
    next(iter(generator.generate_tokens(prompt, max_length=1, min_length=1, sampling_topk=1)))
    return len(prompt) / (time.perf_counter() - start)


def measure(path, compute_type, threads, reps):
    import ctranslate2
    vocabulary = json.loads((path / "vocabulary.json").read_text(encoding="utf-8"))
    generator = ctranslate2.Generator(str(path), device="cpu", compute_type=compute_type,
                                      inter_threads=1, intra_threads=threads)
    rng = random.Random(0)
    prompt = [vocabulary[rng.randrange(BYTE_TOKENS)] for _ in range(PROMPT_TOKENS)]
    long_prompt = [vocabulary[rng.randrange(BYTE_TOKENS)] for _ in range(PREFILL_TOKENS)]
    return timed_rates({"decode": lambda: decode_speed(generator, prompt),
                        "prefill": lambda: prefill_speed(generator, long_prompt)}, reps)


def timed_rates(runs, reps):
    """{name: median, min and max of reps calls of run()} for {name: run}, after a warm-up call."""
    figures = {}
    for name, run in runs.items():
        rates = [run() for _ in range(reps + 1)][1:]  # the first: a warm-up
        figures[name] = {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}
    return figures


def table_row(label, figures):
    """One row of the peer's table: its label, decode and prefill as median [min-max]."""
    cells = [f"{figures[k]['median']:.1f} [{figures[k]['min']:.1f}-{figures[k]['max']:.1f}]"
             for k in ("decode", "prefill")]
    return f"| {label} | {cells[0]} | {cells[1]} |"


def peer_arguments(engine, cache_dir, threads_option):
    """The command line both peer scripts take: the directory, where its conversions are
    kept, threads and repetitions."""
    p = argparse.ArgumentParser(description=f"{engine}'s decode and prefill speed on a Hugging "
                                "Face directory, for the table beside ours (run in its own venv)")
    p.add_argument("model_dir", type=Path, help="a Llama-family Hugging Face directory "
                   "(python -m benchmarks.real_size writes one)")
    p.add_argument("--cache-dir", type=Path, default=Path(cache_dir),
                   help=f"where the converted models are kept (default: {cache_dir})")
    p.add_argument("--threads", type=int, default=2, help=f"{threads_option} (default: 2)")
    p.add_argument("--reps", type=int, default=3, help="timed runs after a warm-up (default: 3)")
    return p


def engine_module(script, module, package):
    """The peer's module, imported; where this venv lacks it, one line and exit."""
    try:
        return importlib.import_module(module)
    except ImportError:
        sys.exit(f"{script}: {package} is not installed here; the module docstring says how to "
                 "make its environment")


def start_table(script, engine, version, args, first_column):
    """Refuse a directory that is not a Hugging Face one (one line), then print the table's
    head."""
    if not (args.model_dir / "config.json").is_file():
        sys.exit(f"{script}: {args.model_dir} is not a Hugging Face directory (no config.json)")
    print(f"{engine} {version}, {args.threads} threads, {args.model_dir}; "
          f"median [min-max] of {args.reps} after a warm-up")
    print(f"| {first_column} | decode tok/s ({NEW_TOKENS} greedy after {PROMPT_TOKENS}) "
          f"| prefill tok/s ({PREFILL_TOKENS} tokens) |")
    print("|---|---|---|")


def main():
    args = peer_arguments("CTranslate2", "/tmp/ct2-models", "intra_threads").parse_args()
    ctranslate2 = engine_module("ctranslate2_peer.py", "ctranslate2", "ctranslate2")
    start_table("ctranslate2_peer.py", "CTranslate2", ctranslate2.__version__, args,
                "CTranslate2 compute type (our row)")
    for compute_type, ours in COMPUTE_TYPES.items():
        f = measure(converted(args.model_dir, args.cache_dir, compute_type), compute_type, args.threads, args.reps)
        print(table_row(f"{compute_type} ({ours})", f), flush=True)


if __name__ == "__main__":
    main()
