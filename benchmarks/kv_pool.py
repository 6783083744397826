"""
The serving pool stored as each kv dtype (serve.py --kv-dtype), measured three ways:

    python -m benchmarks.kv_pool                        # every part, the bundled model
    python -m benchmarks.kv_pool --parts capacity --pool-contexts 4
    python -m benchmarks.kv_pool --parts quality --chars 40000

1. capacity   pools of the same bytes (--pool-contexts float32 full contexts), one per
              dtype: the most sequences of --length tokens (a --prompt-len prompt, the rest
              generated) the engine runs at once without a preemption, found by running
              that many (no preemption) and one more (a preemption), all arriving at once
2. quality    held-out bits/char through the server's scoring: serve.py's HTTP server
              (BackgroundServer) scoring each window with echo and logprobs, max_tokens 0,
              as lm-evaluation-harness scores a text; windows of context_len tokens
              overlapping by half, each target scored once (plumbing/scoring.py's windows,
              one token shorter: a prompt may be context_len tokens, and the last target
              of a window must be in it). Every window's keys and values are written to
              the pool in its format and read back from it, so the scores show what the
              quantization does; float32 first, the reference.

3. throughput --requests requests of --prompt-len tokens, each generating --output-len,
              all at once, through the engine in-process with its default decode step
              (benchmarks/serving.py's continuous mode), a pool of serve.py's default size per
              dtype; the model's dtype is run first and again last, to show the noise
4. kernel     the hand-written paged kernel (serving/paged_attention.cpp, serve.py --compile's)
              alone over one layer of a pool of each dtype: --requests sequences of
              --length columns, the median of repeated calls
"""

import json
import math
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from plumbing.script import begin, run

if __name__ == "__main__":  # run as a command; importing this file changes nothing
    begin()  # before torch: Ctrl-C during the slow imports ends quietly (plumbing/script.py)

import torch  # noqa: E402

from kv_cache import CACHED_MODELS  # noqa: E402
from kv_quant import cache_bytes, dtype_name, storage_format  # noqa: E402
from plumbing.cli import ArgumentParser, add_model_args, load_from_args, positive_int  # noqa: E402
from plumbing.scoring import score_windows  # noqa: E402
from plumbing.outputs import check_output_path, publish_result  # noqa: E402
from plumbing.text_input import encode_user_text, read_text  # noqa: E402
from serving.admission import Limits  # noqa: E402
from serving.engine import Engine, SamplingParams  # noqa: E402
from serving.paged_attention import hand_written_kernel  # noqa: E402

POOL_DTYPES = ("bfloat16", "int8", "int4")  # after the model's own
GREEDY = dict(temperature=0, stop_at_eot=False)


# ---------------------------------------------------------------------------- 1. capacity

def blocks_in(pool_bytes, config, tokens_per_block, kv_dtype):
    """The blocks a pool of pool_bytes holds as kv_dtype, the null block counted in the bytes."""
    return pool_bytes // cache_bytes(config, tokens_per_block, 1, kv_dtype) - 1


def runs_without_preemption(model, tokenizer, kv_dtype, num_blocks, n, args):
    """Run n sequences of args.length tokens at once; (preemptions, seconds)."""
    engine = Engine(model, tokenizer, num_blocks=num_blocks, max_batch=max(n, 1),
                    tokens_per_block=args.tokens_per_block, attention="gather", kv_dtype=kv_dtype)
    g = torch.Generator().manual_seed(n)  # distinct prompts: no block shared by a prefix hit
    for _ in range(n):
        prompt = torch.randint(tokenizer.n_vocab, (args.prompt_len,), generator=g).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=args.length - args.prompt_len, **GREEDY))
    t0 = time.perf_counter()
    engine.run_until_done()
    assert len(engine.pool.free) == engine.pool.num_blocks, "blocks not returned"
    return engine.scheduler.preemptions, time.perf_counter() - t0


def capacity(model, tokenizer, args):
    """For each dtype at the same pool bytes: its blocks, the most sequences that fit by the
    blocks they need, and the engine's run of that many and of one more."""
    config, tpb = model.config, args.tokens_per_block
    model_dtype = dtype_name(model.lm_head.weight.dtype)
    pool_bytes = cache_bytes(config, args.pool_contexts * config.context_len + tpb, 1, model_dtype)
    per_sequence = -(-args.length // tpb)
    rows = []
    for kv_dtype in (model_dtype, *POOL_DTYPES):
        blocks = blocks_in(pool_bytes, config, tpb, kv_dtype)
        fit = blocks // per_sequence
        at_fit, seconds = runs_without_preemption(model, tokenizer, kv_dtype, blocks, fit, args)
        one_more, _ = runs_without_preemption(model, tokenizer, kv_dtype, blocks, fit + 1, args)
        rows.append({"kv_dtype": kv_dtype, "blocks": blocks, "sequences": fit,
                     "preemptions_at_sequences": at_fit, "preemptions_one_more": one_more,
                     "seconds": seconds})
        print(f"  {kv_dtype}: {blocks} blocks, {fit} sequences ({at_fit} preemptions), "
              f"{fit + 1}: {one_more} preemptions", flush=True)
    return {"pool_bytes": pool_bytes, "length": args.length, "prompt_len": args.prompt_len, "rows": rows}


# ---------------------------------------------------------------------------- 2. quality

def post(url, body):
    request = urllib.request.Request(url + "/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as reply:
        return json.loads(reply.read())


def window_nats(url, ids, window):
    """The summed nats of one window's new targets, from the server's echoed logprobs."""
    window_start, end, first = window
    prompt = ids[window_start:end + 1]  # its tokens 1.. are the targets window_start + 1 .. end
    reply = post(url, {"model": "bench", "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0})
    logprobs = reply["choices"][0]["logprobs"]["token_logprobs"]  # [None, lp of token 1, ...]
    return -sum(logprobs[1 + first:])


def bits_per_char(model, tokenizer, kv_dtype, text, ids, args):
    """Held-out bits/char through a server whose pool stores kv_dtype."""
    from serving.server import BackgroundServer
    engine = Engine(model, tokenizer, tokens_per_block=args.tokens_per_block, attention="gather",
                    kv_dtype=kv_dtype)
    windows = score_windows(len(ids) - 1, model.config.context_len - 1)
    engine.start()
    try:
        with BackgroundServer(engine, tokenizer, "bench") as url, ThreadPoolExecutor(4) as clients:
            nats = sum(clients.map(lambda w: window_nats(url, ids, w), windows))
    finally:
        engine.stop()
    return {"kv_dtype": kv_dtype, "tokens": len(ids) - 1, "nats_per_token": nats / (len(ids) - 1),
            "bits_per_char": nats / math.log(2) / len(text)}


def quality(model, tokenizer, args):
    text = read_text(args.text, "--text")[:args.chars]
    ids = [tokenizer.eot_token] + encode_user_text(tokenizer, text, "--text")
    rows = []
    for kv_dtype in (dtype_name(model.lm_head.weight.dtype), *POOL_DTYPES):
        rows.append(bits_per_char(model, tokenizer, kv_dtype, text, ids, args))
        print(f"  {kv_dtype}: {rows[-1]['bits_per_char']:.4f} bits/char", flush=True)
    return {"text": args.text, "chars": len(text), "rows": rows}


# ---------------------------------------------------------------------------- 3. throughput

def throughput(model, tokenizer, args):
    from benchmarks.serving import run_continuous
    g = torch.Generator().manual_seed(0)
    requests = [(0.0, torch.randint(tokenizer.n_vocab, (args.prompt_len,), generator=g).tolist(),
                 args.output_len) for _ in range(args.requests)]
    model_dtype = dtype_name(model.lm_head.weight.dtype)
    rows = []
    for kv_dtype in (model_dtype, "int8", "int4", model_dtype):
        engine = Engine(model, tokenizer, max_batch=args.requests, tokens_per_block=args.tokens_per_block,
                        kv_dtype=kv_dtype, limits=Limits(max_waiting=max(Limits().max_waiting, args.requests)))
        engine.warm_up()  # compiles the decode step for this pool: not measured
        m = run_continuous(engine, requests, "main")
        rows.append({"kv_dtype": kv_dtype, "tok_s": m["tok_s"], "itl_p50_ms": m["itl_p50_ms"],
                     "preemptions": m["preemptions"], "pool_bytes": engine.pool.nbytes()})
        print(f"  {kv_dtype}: {m['tok_s']:.0f} tok/s", flush=True)
    return {"requests": args.requests, "prompt_len": args.prompt_len, "output_len": args.output_len,
            "rows": rows}


# ---------------------------------------------------------------------------- 4. kernel

def kernel_speed(model, tokenizer, args, reps=30):
    """ms per call of the hand-written kernel over one layer, per pool dtype."""
    c, kernel = model.config, hand_written_kernel()
    g = torch.Generator().manual_seed(0)
    slots = args.requests * args.length
    values = torch.randn(2, slots, c.n_kv_head, c.head_dim, generator=g)
    q = torch.randn(args.requests, c.n_head, 1, c.head_dim, generator=g)
    read_slots = torch.randperm(slots, generator=g).view(args.requests, args.length)  # scattered
    visible = torch.ones(args.requests, args.length, dtype=torch.bool)
    rows = []
    for kv_dtype in ("float32", "int8", "int4"):
        fmt = storage_format(kv_dtype, c.head_dim, torch.float32)
        stored = fmt.encode(values)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            kernel(q, stored[0], stored[1], read_slots, visible, fmt)
            times.append(time.perf_counter() - t0)
        rows.append({"kv_dtype": kv_dtype, "ms": 1e3 * statistics.median(times),
                     "bytes_read": stored.nbytes})
        print(f"  {kv_dtype}: {rows[-1]['ms']:.3f} ms", flush=True)
    return {"sequences": args.requests, "columns": args.length, "rows": rows}


# ---------------------------------------------------------------------------- report

def print_report(r):
    if "capacity" in r:
        c = r["capacity"]
        base = c["rows"][0]
        print(f"\n## Sequences of {c['length']} tokens (prompts of {c['prompt_len']}) at once in a pool "
              f"of {c['pool_bytes'] / 2**20:.2f} MiB, without preemption")
        print(f"| pool kv dtype | blocks | sequences | vs {base['kv_dtype']} | vs bfloat16 | "
              "preemptions at that many | with one more |")
        print("|---|---|---|---|---|---|---|")
        bf16 = next(row for row in c["rows"] if row["kv_dtype"] == "bfloat16")
        for row in c["rows"]:
            print(f"| {row['kv_dtype']} | {row['blocks']} | {row['sequences']} | "
                  f"{row['sequences'] / base['sequences']:.2f}x | {row['sequences'] / bf16['sequences']:.2f}x | "
                  f"{row['preemptions_at_sequences']} | {row['preemptions_one_more']} |")
    if "quality" in r:
        q = r["quality"]
        base = q["rows"][0]
        print(f"\n## Bits/char through the server's scoring (echo + logprobs), {q['text']}, "
              f"{q['chars']:,} characters")
        print(f"| pool kv dtype | bits/char | vs {base['kv_dtype']} | nats/token |")
        print("|---|---|---|---|")
        for row in q["rows"]:
            print(f"| {row['kv_dtype']} | {row['bits_per_char']:.4f} | "
                  f"{row['bits_per_char'] - base['bits_per_char']:+.4f} | {row['nats_per_token']:.4f} |")
    if "throughput" in r:
        print_throughput(r["throughput"])
    if "kernel" in r:
        k = r["kernel"]
        print(f"\n## The hand-written paged kernel, one layer, {k['sequences']} sequences x {k['columns']} columns")
        print("| pool kv dtype | keys and values read, MiB | ms, median | vs float32 |")
        print("|---|---|---|---|")
        for row in k["rows"]:
            print(f"| {row['kv_dtype']} | {row['bytes_read'] / 2**20:.2f} | {row['ms']:.3f} | "
                  f"{row['ms'] / k['rows'][0]['ms']:.2f}x |")


def print_throughput(t):
    base = t["rows"][0]
    print(f"\n## {t['requests']} requests x {t['output_len']} new tokens (prompts of {t['prompt_len']}), "
          "all at once, the engine's default decode step")
    print(f"| pool kv dtype | pool MiB | output tok/s | vs {base['kv_dtype']} (first run) | ITL p50 ms | preemptions |")
    print("|---|---|---|---|---|---|")
    for row in t["rows"]:
        print(f"| {row['kv_dtype']} | {row['pool_bytes'] / 2**20:.1f} | {row['tok_s']:.0f} | "
              f"{row['tok_s'] / base['tok_s']:.2f}x | {row['itl_p50_ms']:.1f} | {row['preemptions']} |")


def main():
    p = ArgumentParser(description="The serving pool's kv dtypes: sequences at the same bytes, "
                       "bits/char through the server's scoring (see the module docstring).")
    add_model_args(p)
    p.add_argument("--parts", default=",".join(PARTS), help=f"which, comma-separated (default: {','.join(PARTS)})")
    p.add_argument("--pool-contexts", type=positive_int, default=4,
                   help="the pools' bytes: this many full contexts of the model's dtype (default: 4)")
    p.add_argument("--length", type=positive_int, default=None,
                   help="tokens per sequence, prompt and output (default: the context)")
    p.add_argument("--prompt-len", type=positive_int, default=16, help="default: 16")
    p.add_argument("--requests", type=positive_int, default=64, help="throughput's (default: 64)")
    p.add_argument("--output-len", type=positive_int, default=128, help="throughput's (default: 128)")
    p.add_argument("--tokens-per-block", type=positive_int, default=16, help="default: 16")
    p.add_argument("--text", default="checkpoints/shakespeare/heldout.txt",
                   help="held-out text to score (default: the bundled model's held-out plays)")
    p.add_argument("--chars", type=positive_int, default=None, help="score only its first N characters")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args()
    json_path = args.json and check_output_path(args.json, "json")  # before the run, not after
    model, tokenizer, _ = load_from_args(CACHED_MODELS, args)
    args.length = min(args.length or model.config.context_len, model.config.context_len)
    if args.prompt_len >= args.length:
        p.error(f"--prompt-len ({args.prompt_len}) must be less than --length ({args.length})")
    parts = args.parts.split(",")
    if not set(parts) <= set(PARTS):
        p.error(f"--parts: choose from {', '.join(PARTS)}; got {args.parts!r}")
    r = {"machine": f"{torch.get_num_threads()} threads", "torch": torch.__version__}
    for part, measure in PARTS.items():
        if part in parts:
            print(f"{part}...", flush=True)
            with torch.inference_mode():
                r[part] = measure(model, tokenizer, args)
    publish_result(r, "benchmarks.kv_pool", print_report, json_path)


PARTS = {"capacity": capacity, "quality": quality, "throughput": throughput, "kernel": kernel_speed}

if __name__ == "__main__":
    run(main)
