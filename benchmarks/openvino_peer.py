"""
OpenVINO GenAI beside ours at a real model's shape: the same Hugging Face directory (the one
`python -m benchmarks.real_size` writes), exported by optimum-intel's own exporter in each
weight format and run by OpenVINO GenAI's LLMPipeline on the CPU, decode and prefill timed
as benchmarks/ctranslate2_peer.py times CTranslate2 (the same prompts, the same counts).

OpenVINO is a peer, not a dependency: it lives in a virtual environment of its own, with
torch put back at the project's pin after optimum-intel pulls a newer one (its exporter
loads the model through transformers; torchvision, which needs the newer torch, removed):

    python -m venv /tmp/ov-venv && . /tmp/ov-venv/bin/activate
    pip install torch==2.13.0 openvino-genai==2026.4.1.0 "optimum-intel[openvino]==2.2.0"
    pip uninstall -y torchvision && pip install torch==2.13.0
    python -m benchmarks.openvino_peer ~/.cache/kvcache-gpt/real-size/1b/hf

Formats (`optimum-cli export openvino --weight-format`), each beside our row: fp16 (OpenVINO
computes it in bf16 on a CPU with AMX or AVX-512 BF16: our bf16 row), int8 (8-bit per output
channel, asymmetric: our int8, symmetric) and int4 (asymmetric, groups of 128, the
embedding and output layer in int8 as optimum does by default: our int4, groups of 64).
Each directory is exported once under --cache-dir. Decode: OpenVINO's own time per output
token (perf_metrics' TPOT: the tokens after the first) over 32 greedy tokens after a
16-token random prompt; prefill: the time to the first token of a 512-token prompt; a new
random prompt every run (the pipeline caches prefixes).
The first run of each is a warm-up; the median and min-max of --reps after it.
"""

import random
import subprocess

from benchmarks.ctranslate2_peer import (BYTE_TOKENS, NEW_TOKENS, PREFILL_TOKENS, PROMPT_TOKENS, engine_module,
                                         peer_arguments, start_table, table_row, timed_rates)

FORMATS = {"fp16": "bf16", "int8": "int8", "int4": "int4"}  # --weight-format -> our row
FORMAT_OPTIONS = {"int4": ["--group-size", "128"]}  # asymmetric is optimum's default


def exported(model_dir, cache_dir, weight_format):
    """The OpenVINO directory of model_dir in weight_format, exported once."""
    out = cache_dir / weight_format
    if not (out / "openvino_model.xml").is_file():
        subprocess.run(["optimum-cli", "export", "openvino", "--model", str(model_dir), "--task",
                        "text-generation-with-past", "--weight-format", weight_format,
                        *FORMAT_OPTIONS.get(weight_format, []), str(out)], check=True)
    return out


def generated(pipeline, ids, new_tokens):
    """perf_metrics of one greedy generation of new_tokens after the token ids (no early end)."""
    import numpy as np
    import openvino as ov
    import openvino_genai as genai
    config = genai.GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    tokens = ov.Tensor(np.array([ids], dtype=np.int64))
    inputs = genai.TokenizedInputs(tokens, ov.Tensor(np.ones((1, len(ids)), dtype=np.int64)))
    return pipeline.generate(inputs, config).perf_metrics


def measure(path, threads, reps):
    import openvino_genai as genai
    pipeline = genai.LLMPipeline(str(path), "CPU", INFERENCE_NUM_THREADS=threads)
    rng = random.Random(0)

    def prompt(length):
        # a new one every run: the pipeline caches prefixes, and a prompt seen before would
        # be served from that cache (a 512-token prefill in 88 ms instead of a second)
        return [rng.randrange(BYTE_TOKENS) for _ in range(length)]
    return timed_rates({
        "decode": lambda: 1e3 / generated(pipeline, prompt(PROMPT_TOKENS), NEW_TOKENS).get_tpot().mean,
        "prefill": lambda: PREFILL_TOKENS * 1e3 / generated(pipeline, prompt(PREFILL_TOKENS), 1).get_ttft().mean,
    }, reps)


def main():
    p = peer_arguments("OpenVINO GenAI", "/tmp/ov-models", "INFERENCE_NUM_THREADS")
    p.add_argument("--formats", nargs="+", choices=list(FORMATS), default=list(FORMATS),
                   help="weight formats to export and run (default: all)")
    args = p.parse_args()
    openvino_genai = engine_module("openvino_peer.py", "openvino_genai", "openvino-genai")
    start_table("openvino_peer.py", "OpenVINO GenAI", openvino_genai.__version__, args,
                "weight format (our row)")
    for weight_format in args.formats:
        f = measure(exported(args.model_dir, args.cache_dir, weight_format), args.threads, args.reps)
        print(table_row(f"{weight_format} ({FORMATS[weight_format]})", f), flush=True)


if __name__ == "__main__":
    main()
