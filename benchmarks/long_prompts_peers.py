"""
benchmarks.long_prompts' workload over HTTP, serve.py beside llama.cpp's llama-server on
identical weights: what each server's decoding streams see while long prompts arrive.

    python -m benchmarks.long_prompts_peers --llama-server PATH        # SmolLM2-135M's shape, random
    python -m benchmarks.long_prompts_peers --llama-server PATH --streams 32 --every 3 --reps 3

A random model of SmolLM2-135M's shape in fp32 (long_prompts.py's), written as our
checkpoint and as an f32 GGUF (export_gguf.py). Both servers stay up; after a warm-up run,
in turns, --reps times, each gets the same load (benchmarks/load_test.py, greedy,
ignore_eos), its prompts new at every run (one seen before would be a prefix-cache hit,
not a prefill): --streams streaming clients at once (16-token prompts, --stream-tokens
each), then, from --start seconds on, one prompt of --prompt-len tokens every --every
seconds. The window and its
figures are long_prompts.py's: from the first long prompt's arrival to the last one's
end, the gaps between the streams' tokens (p50, p99), every token handed out in it per
second, the long prompts' time to first token.

How each bounds the stall: ours by chunked prefill (--max-step-tokens, its default), a
step's token budget of the decodes first, then prompt chunks; llama-server by its batch
(-b 2048 / -ub 512 by default: every slot's decode token and the prompts' tokens share
each batch of 2048, run in passes of 512). Both servers: as many slots as requests.
"""

import tempfile
from pathlib import Path
from types import SimpleNamespace

from plumbing.script import UserError, begin, run

if __name__ == "__main__":  # run as a command; importing this file changes nothing
    begin()  # before torch: Ctrl-C during the slow imports ends quietly (plumbing/script.py)

import torch  # noqa: E402

from benchmarks.load_test import load_test  # noqa: E402
from benchmarks.long_prompts import SMOLLM2_135M, STREAM_PROMPT, window_figures  # noqa: E402
from benchmarks.server_peers import free_port, start_llama_server, start_ours, wait_ready  # noqa: E402
from benchmarks.timing import spread  # noqa: E402
from export_gguf import export  # noqa: E402
from kv_cache import KVCacheLlama  # noqa: E402
from llama import LlamaConfig  # noqa: E402
from plumbing.checkpoint import BUNDLED, save_checkpoint  # noqa: E402
from plumbing.cli import ArgumentParser, positive_int  # noqa: E402
from plumbing.outputs import check_output_path, json_text, write_atomically  # noqa: E402

FIGURES = ("itl_p50_ms", "itl_p99_ms", "tok_s", "ttft_ms")
SHAPES = {"smollm2-135m": SMOLLM2_135M,  # tiny: seconds, for a check
          "tiny": LlamaConfig(context_len=1024, vocab_size=4096, n_layer=2, n_head=4, n_kv_head=2,
                              n_embd=128, intermediate_size=256, tie_embeddings=True)}


def workload(args, vocab, seed):
    """(arrival, prompt, new tokens) of every request: the streams, then the long prompts,
    of random ids below vocab drawn from seed."""
    g = torch.Generator().manual_seed(seed)

    def prompt(n):
        return torch.randint(vocab, (n,), generator=g).tolist()
    streams = [(0.0, prompt(STREAM_PROMPT), args.stream_tokens) for _ in range(args.streams)]
    longs = [(args.start + i * args.every, prompt(args.prompt_len), args.long_output)
             for i in range(args.long_prompts)]
    return streams + longs


def one_run(url, requests, args):
    """The load on the server at url: the window's figures (long_prompts.window_figures)."""
    t0, results, _ = load_test(url, requests, args.timeout)
    failed = [r for r in results if isinstance(r, str)]
    if failed:
        raise UserError(f"{len(failed)} requests failed at {url}; the first: {failed[0]}")
    # each request as long_prompts.py sees the engine's: its token times and arrival
    seen = [SimpleNamespace(token_times=times, arrival_time=sent) for sent, times, _ in results]
    streams, longs = seen[:args.streams], seen[args.streams:]
    start, end = t0 + args.start, max(r.token_times[-1] for r in longs)
    if min(r.token_times[-1] for r in streams) < end:
        raise UserError(f"a stream ended before the last long prompt did: raise --stream-tokens "
                        f"(now {args.stream_tokens})")
    return window_figures(streams, longs, start, end)


def measure(args):
    bundled = torch.load(BUNDLED, weights_only=True)  # its tokenizer, written into both files
    vocab = bundled["config"]["vocab_size"]
    slots = args.streams + args.long_prompts
    # a slot's context: the longer of a stream's and a long prompt's, rounded up to 256
    context = -(-max(STREAM_PROMPT + args.stream_tokens, args.prompt_len + args.long_output) // 256) * 256
    with tempfile.TemporaryDirectory(prefix="long-prompts-peers.") as folder:
        torch.manual_seed(0)
        ckpt, gguf = Path(folder) / "model.pt", Path(folder) / "model.gguf"
        save_checkpoint(ckpt, KVCacheLlama(SHAPES[args.shape]), bundled["tokenizer"])
        export(ckpt, gguf, "f32", report=lambda line: None)
        ports = {"ours": free_port(), "llama-server": free_port()}
        with open(Path(folder) / "ours.log", "w") as ours_log, open(Path(folder) / "llama.log", "w") as llama_log:
            servers = {"ours": start_ours(ckpt, ports["ours"], slots, "default", ours_log),
                       "llama-server": start_llama_server(args.llama_server, gguf, ports["llama-server"],
                                                          slots, context, args.threads, llama_log)}
            try:
                urls = {k: f"http://127.0.0.1:{p}/v1" for k, p in ports.items()}
                for k in servers:
                    wait_ready(urls[k], servers[k], k)
                return turns(urls, vocab, args)
            finally:
                for process in servers.values():
                    process.terminate()
                for process in servers.values():
                    process.wait(timeout=30)


def turns(urls, vocab, args):
    """{server: {figure: spread over the reps}}, the servers in turns after a warm-up each.
    Every run draws prompts of its own, the same for both servers: a prompt seen before
    would be a prefix-cache hit (on either side), not a prefill."""
    runs = {k: [] for k in urls}
    warm_up = workload(args, vocab, args.seed - 1)
    for url in urls.values():  # the whole load once: the first long prompts pay for allocation
        one_run(url, warm_up, args)
    for rep in range(args.reps):
        requests = workload(args, vocab, args.seed + rep)
        for k, url in urls.items():
            runs[k].append(one_run(url, requests, args))
            print(f"run {rep + 1}: {k:12s} " + ", ".join(f"{f} {runs[k][-1][f]:.1f}" for f in FIGURES),
                  flush=True)
    return {k: {f: spread([r[f] for r in rs]) for f in FIGURES} for k, rs in runs.items()}


def print_table(results, args):
    print(f"\n# long prompts while streams decode, {args.shape} shape (random weights, fp32 / f32), "
          f"{args.threads} threads, torch {torch.__version__}")
    print(f"{args.streams} streams decoding; {args.long_prompts} prompts of {args.prompt_len} tokens, "
          f"one every {args.every:g} s from {args.start:g} s, {args.long_output} tokens each; "
          f"median (min-max) of {args.reps} runs in turns\n")
    print("| server | stream ITL p50 ms | stream ITL p99 ms | tok/s | long prompt TTFT ms |")
    print("|---|---|---|---|---|")
    for k, m in results.items():
        cells = [f"{m[f]['median']:.{1 if f == 'tok_s' else 0}f} ({m[f]['min']:.0f}-{m[f]['max']:.0f})"
                 for f in FIGURES]
        print(f"| {k} | " + " | ".join(cells) + " |")
    ours, theirs = (results[k] for k in ("ours", "llama-server"))
    print(f"\nours / llama-server: p99 ITL {ours['itl_p99_ms']['median'] / theirs['itl_p99_ms']['median']:.2f}x, "
          f"tok/s {ours['tok_s']['median'] / theirs['tok_s']['median']:.2f}x")


def main():
    p = ArgumentParser(description="serve.py beside llama-server while long prompts arrive among "
                       "decoding streams (see the module docstring).")
    p.add_argument("--llama-server", metavar="PATH", required=True,
                   help="the llama-server binary (python -m benchmarks.server_peers --build DIR)")
    p.add_argument("--shape", choices=list(SHAPES), default="smollm2-135m",
                   help="the model's shape (default: smollm2-135m; tiny: for a check)")
    p.add_argument("--streams", type=positive_int, default=32, help="decoding streams (default: 32)")
    p.add_argument("--stream-tokens", type=positive_int, default=400,
                   help="tokens each stream asks for: enough to outlast the window (default: 400)")
    p.add_argument("--prompt-len", type=positive_int, default=2000, help="tokens of each long prompt (default: 2000)")
    p.add_argument("--long-prompts", type=positive_int, default=3, help="how many arrive (default: 3)")
    p.add_argument("--start", type=float, default=5.0,
                   help="seconds before the first arrives, the streams decoding (default: 5)")
    p.add_argument("--every", type=float, default=3.0, help="seconds between them (default: 3)")
    p.add_argument("--long-output", type=positive_int, default=16, help="tokens each asks for (default: 16)")
    p.add_argument("--reps", type=positive_int, default=3, help="runs per server, in turns (default: 3)")
    p.add_argument("--threads", type=positive_int, default=torch.get_num_threads(),
                   help="llama-server's threads (default: torch's)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds a server may stay silent before a request fails (default: 120)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args()
    if not Path(args.llama_server).is_file():
        raise UserError(f"--llama-server {args.llama_server}: not a file; build one with "
                        "python -m benchmarks.server_peers --build DIR")
    if args.start <= 0 or args.every <= 0:
        p.error("--start and --every must be more than 0 seconds")
    json_path = check_output_path(args.json, "json") if args.json else None
    results = measure(args)
    print_table(results, args)
    if json_path:
        write_atomically(json_path, json_text({"workload": vars(args), "torch": torch.__version__,
                                               "servers": results}))


if __name__ == "__main__":
    run(main)
