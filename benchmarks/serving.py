"""
Serving a workload, three ways, and through HTTP:

    python -m benchmarks.serving --quick                                  # a minute, tiny
    python -m benchmarks.serving --requests 64 --prompt-len 16 --output-len 128 --json out/a.json
    python -m benchmarks.serving --shape gpt2 --rate 4 --plot out/serve.png
    python -m benchmarks.serving --url http://127.0.0.1:8000/v1           # a running server only
    python -m benchmarks.serving --modes continuous --engine-thread background

A seeded workload (--requests, prompt and output lengths drawn from ranges, arriving all
at once or as a Poisson process of --rate requests/s), greedy, run to its max_tokens:

    sequential   the generation loop (generation/loop.py), one request at a time (batch 1)
    static       the generation loop on groups of --max-batch requests in arrival order: a
                 group starts when its last member has arrived and the group before it
                 has finished, so it waits for its longest member
    continuous   the engine (serving/engine.py) in-process: requests join at once
    http         serve.py's arrangement (HTTP on its own thread, the engine on the main one)
                 under a load test: one streaming client per request, in a process of its own

For each: output tokens/s, time to first token and inter-token latency (p50/p95), and the
KV memory it held at its peak, next to what preallocating every running request to the full
context would take. Then what a cached 200-token prefix does to the time to first token,
and what the paged cache's gather costs in a decode step, with the paged kernel alone, layer
after layer, against a plain read of the keys and values it reads. Long prompts arriving
while streams decode, with and without chunked prefill: benchmarks/long_prompts.py.
"""

import argparse
import math
import multiprocessing
import platform
import statistics
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from datetime import date

from plumbing.script import UserError, begin, run

if __name__ == "__main__":  # run as a command; importing this file changes nothing
    begin()  # before torch: Ctrl-C during the slow imports ends quietly (plumbing/script.py)

import torch  # noqa: E402

from base_model import GPTConfig, store_linears_column_major  # noqa: E402
from benchmarks.load_test import LoadTestError, load_test, load_test_summary, summary  # noqa: E402
from benchmarks.timing import repeat, timed  # noqa: E402
from generation.cpu_layout import pack_linears  # noqa: E402
from generation.loop import Generation  # noqa: E402
from kv_cache import CACHED_MODELS, KVCache, KVCacheGPT  # noqa: E402
from kv_quant import KV_DTYPES, dtype_name  # noqa: E402
from plumbing.cli import ArgumentParser, add_model_args, load_from_args, positive_int  # noqa: E402
from plumbing.outputs import MARK, check_output_path, import_pyplot, json_text, write_atomically  # noqa: E402
from serving.admission import Limits  # noqa: E402
from serving.engine import Engine, SamplingParams  # noqa: E402
from serving.paged_attention import attention_for, decode_attention  # noqa: E402
from serving.paged_cache import default_num_blocks  # noqa: E402

SHAPES = {"gpt2": GPTConfig(context_len=1024, vocab_size=50257, n_layer=12, n_head=12, n_embd=768)}
MODES = ("sequential", "static", "continuous", "http")
MIN_RATE = 0.001  # requests/s: slower, a run of 64 requests would take most of a day


# ---------------------------------------------------------------------------- the workload

def workload(args, vocab, context_len):
    """[(arrival seconds, prompt ids, new tokens)] for args.requests requests, seeded."""
    g = torch.Generator().manual_seed(args.seed)

    def draw(low, high):
        return int(torch.randint(low, high + 1, (1,), generator=g))
    gaps = (torch.empty(args.requests).exponential_(generator=g) / args.rate
            if args.rate > 0 else torch.zeros(args.requests))
    arrivals = gaps.cumsum(0).tolist()
    requests = []
    for arrival in arrivals:
        prompt_len = min(draw(*args.prompt_len), context_len)
        prompt = torch.randint(vocab, (prompt_len,), generator=g).tolist()
        requests.append((arrival, prompt, draw(*args.output_len)))
    return requests


def wait_until(t0, arrival):
    delay = t0 + arrival - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


# ---------------------------------------------------------------------------- the ways

def timed_stream(model, prompts, new_tokens):
    """Token times of each row of one Generation over prompts, each row stopping at its own
    count (it leaves the batch; the batch runs until its longest is done)."""
    times = [[] for _ in prompts]
    generation = Generation(model, prompts, max(new_tokens), temperature=0)
    for rows, _ in generation:
        now = time.perf_counter()
        for row in rows:
            times[row].append(now)
            if len(times[row]) == new_tokens[row]:
                generation.finish(row)
    return times


def run_static(model, requests, batch, per_token):
    """batch=1 is sequential generation."""
    t0, records = time.perf_counter(), []
    for start in range(0, len(requests), batch):
        group = requests[start:start + batch]
        wait_until(t0, group[-1][0])
        times = timed_stream(model, [p for _, p, _ in group], [n for _, _, n in group])
        records += [(t0 + a, ts) for (a, _, _), ts in zip(group, times)]
    # KVCache preallocates every row of a batch to the full context
    return summary(records, t0, min(batch, len(requests)) * model.config.context_len * per_token)


def new_engine(model, tokenizer, args):
    # the waiting queue holds the whole workload: a run measures serving, not refusals
    limits = Limits(max_waiting=max(Limits().max_waiting, args.requests))
    try:
        engine = Engine(model, tokenizer, num_blocks=args.num_blocks, max_batch=args.max_batch,
                        tokens_per_block=args.tokens_per_block, attention=args.attention, limits=limits,
                        compile=args.compile, kv_dtype=args.kv_dtype)
    except ValueError as e:  # a pool too small for one context, or larger than the memory
        raise UserError(f"--num-blocks, --tokens-per-block, --kv-dtype: {e}") from None
    engine.warm_up()  # compiles the decode step: not part of any measurement
    return engine


def run_on_the_side(work, engine, engine_thread="main"):
    """work() on a new thread while this thread runs the engine (Engine.run says why it
    must be this one); the engine stops when work returns. Returns what work returned.
    engine_thread="background" runs the engine on a thread of its own instead
    (Engine.start), to show what that costs."""
    if engine_thread == "background":
        engine.start()
        try:
            return work()
        finally:
            engine.stop()
    result = []

    def side():
        try:
            result.append(work())
        except BaseException as e:
            result.append(e)
        engine.stop()
    thread = threading.Thread(target=side, name="clients", daemon=True)  # Ctrl-C: no wait
    thread.start()
    engine.run()
    thread.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def run_continuous(engine, requests, engine_thread):
    """The engine in-process, each request added at its arrival time by another thread."""
    done, count = threading.Event(), [0]

    def on_output(request, output):
        if output.finish_reason:
            count[0] += 1
            if count[0] == len(requests):
                done.set()

    def submit_all():
        submitted = []
        for arrival, prompt, n in requests:
            wait_until(t0, arrival)
            submitted.append(engine.add_request(prompt, SamplingParams(
                max_tokens=n, temperature=0, stop_at_eot=False), on_output))
        done.wait()
        return submitted
    t0 = time.perf_counter()
    submitted = run_on_the_side(submit_all, engine, engine_thread)
    records = [(r.arrival_time, r.token_times) for r in submitted]
    return {**summary(records, t0, engine.peak_blocks * engine.pool.block_bytes()),
            "preemptions": engine.scheduler.preemptions}


def run_url(url, requests, timeout=60.0):
    """The load test against a server that is already running (python serve.py, or
    vLLM's server on the same weights), from this process."""
    import aiohttp
    try:
        return load_test_summary(*load_test(url, requests, timeout), kv_bytes=None)
    except aiohttp.ServerTimeoutError:
        raise UserError(f"--url: {url} accepted the connection but did not answer within "
                        f"{timeout:g} s (--timeout); is it an HTTP server, and is it running?") from None
    except aiohttp.ClientError as e:
        raise UserError(f"--url: cannot reach {url} ({e}); start the server first "
                        "(python serve.py)") from None
    except LoadTestError as e:
        raise UserError(f"--url: {e}") from None


def run_http(engine, requests, engine_thread):
    """serve.py's arrangement (the HTTP server on a thread of its own, the engine on this
    one) under a load test: one streaming client per request, each sending at its arrival
    time, every server-sent event timed when it arrives. The clients run in a process of
    their own, as a load tester would, so that they do not queue for this process's
    interpreter lock; they still share the machine's cores. Counts errors, and checks
    that every block is back in the pool afterwards."""
    from serving.server import BackgroundServer

    spawn = multiprocessing.get_context("spawn")  # a clean process: no torch threads forked
    with BackgroundServer(engine, engine.tokenizer, "bench") as url, \
            ProcessPoolExecutor(1, mp_context=spawn) as clients:
        clients.submit(time.perf_counter).result()  # the process is up before the clock starts
        t0, results, health = run_on_the_side(
            lambda: clients.submit(load_test, url, requests).result(), engine, engine_thread)
    return load_test_summary(t0, results, health, engine.peak_blocks * engine.pool.block_bytes())


class CountingTokenizer:
    """For random-weight shapes, which have no tokenizer: the engine turns every token into
    text, the benchmark only counts them (every token is "x"; there is no end of text)."""

    def __init__(self, n_vocab):
        self.n_vocab, self.eot_token = n_vocab, -1

    def decode_single_token_bytes(self, token):
        return b"x"


# ---------------------------------------------------------------------------- the extras

def prefix_hit_ttft(model, tokenizer, args, prefix_len=200, suffix_len=8, reps=3):
    """Time to first token of a prompt whose prefix_len-token prefix is cached, against
    the same-length prompt with nothing cached (medians of reps)."""
    context_len = model.config.context_len
    prefix_len = min(prefix_len, context_len - suffix_len)
    g = torch.Generator().manual_seed(args.seed + 1)
    vocab = tokenizer.n_vocab
    engine = new_engine(model, tokenizer, args)

    def ttft(prompt):
        t0 = time.perf_counter()
        engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0))
        engine.run_until_done()
        return time.perf_counter() - t0
    miss, hit = [], []
    for _ in range(reps + 1):  # the first round warms up
        prefix = torch.randint(vocab, (prefix_len,), generator=g).tolist()
        a, b = (torch.randint(vocab, (suffix_len,), generator=g).tolist()
                for _ in range(2))
        miss.append(ttft(prefix + a))
        hit.append(ttft(prefix + b))  # shares prefix_len // tokens_per_block full blocks
    miss, hit = statistics.median(miss[1:]), statistics.median(hit[1:])
    return {"prefix_tokens": prefix_len, "suffix_tokens": suffix_len, "miss_ms": 1e3 * miss,
            "hit_ms": 1e3 * hit, "hit_over_miss": hit / miss}


@torch.inference_mode()
def gather_cost(model, tokenizer, args, batch, context, reps=5):
    """One decode step of `batch` sequences of `context` tokens, three ways: the paged step
    reading the pool through the gather (every layer's index_select, then SDPA), the same
    compiled whole with the paged kernel inside (paged_attention.py), and the step on a dense
    preallocated KVCache (KVCacheGPT's own batch decode: nothing to find); and the gather
    alone."""
    tpb = args.tokens_per_block
    # the serving engine's pool size, so that the step timed is the graph compiled for
    # it (the pool's size is a constant of the graph), unless it has no room for them all
    serving_pool = args.num_blocks or default_num_blocks(
        model.config, tpb, args.max_batch, dtype_name(model.lm_head.weight.dtype))
    # room for all (no preemption), and no mixed steps: with a decode pass beside each
    # prefill chunk the first sequences would finish their 2 tokens before the last joined
    engine = Engine(model, tokenizer, num_blocks=max(serving_pool, batch * -(-(context + 1) // tpb)),
                    tokens_per_block=tpb, max_batch=batch, max_step_tokens=0)
    g = torch.Generator().manual_seed(args.seed + 2)
    prompts = [torch.randint(tokenizer.n_vocab, (context,), generator=g).tolist()
               for _ in range(batch)]
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=2, temperature=0, stop_at_eot=False))
    while len(engine.scheduler.running) < batch:
        engine.step()  # prefill steps: admission comes first
    seqs = engine.scheduler.decode()
    tokens, cache = engine.runner.prepare(seqs)
    kv, slots = engine.pool.kv, cache.read_slots.flatten()

    def gathered_step():
        engine.model(tokens, engine.runner.prepare(seqs)[1], last_only=True)

    def compiled_step():  # its index built again each call: the same sequences, not longer
        engine.runner.forward_compiled(seqs)

    def gather():
        for layer in range(kv.size(0)):
            kv[layer].index_select(1, slots)
    dense = KVCache(model.config, batch, kv.device, kv.dtype, max_len=context + 1)
    model(torch.tensor(prompts, device=kv.device), dense)
    step = tokens[:, -1:]

    def dense_step():
        dense.length -= 1  # write the same column again
        model(step, dense, last_only=True)

    # the paged kernel alone, compiled by torch.compile (for these shapes only), on every
    # layer in turn as the step runs it, against a plain read of as many bytes (each key and
    # value once), layer after layer: the whole cache is then more than the CPU's caches
    # hold, as in a step (one layer read again and again stays in them, and reads faster)
    c = model.config
    q = torch.randn(batch, c.n_head, 1, c.head_dim, device=kv.device, dtype=kv.dtype)
    kernel = torch.compile(decode_attention, fullgraph=True)
    # with --compile, the engine's step runs the hand-written kernel (paged_attention.cpp)
    hand_written = attention_for(kv) if args.compile else decode_attention
    visible = torch.ones(cache.read_slots.shape, dtype=torch.bool, device=kv.device)

    def every_layer(kernel):
        for layer in range(kv.size(0)):
            kernel(q, kv[layer, 0], kv[layer, 1], cache.read_slots, visible)
    layer_bytes = 2 * cache.read_slots.numel() * kv[0, 0, 0].nbytes
    flats = [torch.randn(layer_bytes // kv.element_size(), device=kv.device, dtype=kv.dtype)
             for _ in range(kv.size(0))]

    def read_every_layer():
        for flat in flats:
            flat.sum()

    def ms(fn):  # the mean of reps, after a warm-up
        return 1e3 * statistics.mean(repeat(lambda: timed(fn)[1], reps))
    result = {"batch": batch, "context": context, "paged_step_ms": ms(gathered_step),
              "compiled_step_ms": ms(compiled_step),
              "gather_ms": ms(gather), "dense_step_ms": ms(dense_step),
              "gathered_bytes": layer_bytes * kv.size(0),  # every layer's
              "kernel_layer_ms": ms(lambda: every_layer(kernel)) / kv.size(0), "layer_bytes": layer_bytes,
              "read_layer_bytes_ms": ms(read_every_layer) / kv.size(0)}
    result["gather_share"] = result["gather_ms"] / result["paged_step_ms"]
    result["kernel_over_read"] = result["kernel_layer_ms"] / result["read_layer_bytes_ms"]
    if hand_written is not decode_attention:
        result["hand_kernel_layer_ms"] = ms(lambda: every_layer(hand_written)) / kv.size(0)
        result["hand_kernel_over_read"] = result["hand_kernel_layer_ms"] / result["read_layer_bytes_ms"]
    return result


# ---------------------------------------------------------------------------- report

def print_report(r):
    w = r["workload"]
    print(f"\n# serving benchmark, {r['date']}, {r['machine']}, torch {r['torch']}, {r['model']}"
          + (f", the server at {r['url']}" if "url" in r else ""))
    arrivals = f"Poisson arrivals at {w['rate']} req/s" if w["rate"] else "all at once"
    ours = "" if "url" in r else (f"; max batch {w['max_batch']}; "
                                  f"the engine on the {w['engine_thread']} thread")
    print(f"{w['requests']} requests, prompts {w['prompt_len']} tokens, outputs {w['output_len']} "
          f"tokens, {arrivals}; greedy{ours}")
    print("\n| way | output tok/s | vs sequential | TTFT p50 / p95 ms | ITL p50 / p95 ms | peak KV MiB | vs all at full context |")
    print("|---|---|---|---|---|---|---|")
    base = r["modes"].get("sequential", {}).get("tok_s")
    for mode, m in r["modes"].items():
        itl = (f"{m['itl_p50_ms']:.1f} / {m['itl_p95_ms']:.1f}" if m["itl_p50_ms"] is not None else "n/a")
        vs = f"{m['tok_s'] / base:.1f}x" if base else "n/a"
        kv = m["peak_kv_bytes"]
        kv = (f"{kv / 2**20:.1f} | {kv / r['full_context_kv_bytes']:.0%}" if kv is not None
              else "n/a | n/a")  # another server's memory is not ours to see
        print(f"| {mode} | {m['tok_s']:.0f} | {vs} | {m['ttft_p50_ms']:.0f} / {m['ttft_p95_ms']:.0f} | "
              f"{itl} | {kv} |")
    for mode in ("http", "server"):
        if mode in r["modes"]:
            h = r["modes"][mode]
            leaked = ("" if h["leaked_blocks"] is None  # not our server: no /health counters
                      else f", {h['leaked_blocks']} blocks not returned")
            print(f"{mode}: {h['errors']} errors{leaked}"
                  + (f" (first error: {h['first_error']})" if h["errors"] else ""))
    if "pool_bytes" in r:
        print(f"(all at full context: {r['running_peak']} requests x {r['context_len']} positions = "
              f"{r['full_context_kv_bytes'] / 2**20:.1f} MiB; the engine's pool: "
              f"{r['pool_bytes'] / 2**20:.1f} MiB, "
              + ", ".join(f"{m} {r['modes'][m]['preemptions']} preemptions"
                          for m in ("continuous", "http") if m in r["modes"]) + ")")
    if "prefix" in r:
        p = r["prefix"]
        print(f"\nprefix cache: time to first token of a {p['prefix_tokens']}+{p['suffix_tokens']}-token "
              f"prompt, miss {p['miss_ms']:.1f} ms, {p['prefix_tokens']}-token prefix cached "
              f"{p['hit_ms']:.1f} ms ({p['hit_over_miss']:.2f}x)")
    if "gather" in r:
        g = r["gather"]
        print(f"\nreading the pages: a decode step of {g['batch']} sequences x {g['context']} tokens: "
              f"gather + SDPA {g['paged_step_ms']:.1f} ms, of which the gather {g['gather_ms']:.1f} ms "
              f"({g['gather_share']:.0%}, {g['gathered_bytes'] / 2**20:.0f} MiB copied); "
              f"compiled step (the paged kernel inside) {g['compiled_step_ms']:.1f} ms; eager dense "
              f"KVCache step {g['dense_step_ms']:.1f} ms")
        print(f"the paged kernel alone, a layer (every layer in turn): {g['kernel_layer_ms']:.2f} ms for "
              f"{g['layer_bytes'] / 2**20:.1f} MiB of keys and values; a plain read of as many bytes "
              f"{g['read_layer_bytes_ms']:.2f} ms ({g['kernel_over_read']:.1f}x the read)")
        if "hand_kernel_layer_ms" in g:
            print(f"the hand-written paged kernel (paged_attention.cpp, --compile's), a layer: "
                  f"{g['hand_kernel_layer_ms']:.2f} ms ({g['hand_kernel_over_read']:.1f}x the read)")


def plot(r, path, plt):
    modes = list(r["modes"])
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (key, label, scale) in zip(axes, [("tok_s", "output tokens/s", 1),
                                              ("ttft_p50_ms", "TTFT p50 (ms)", 1),
                                              ("peak_kv_bytes", "peak KV memory (MiB)", 2**-20)]):
        ax.bar(modes, [(r["modes"][m][key] or 0) * scale for m in modes])
        ax.set(title=label)
    fig.suptitle(f"{r['model']}: {r['workload']['requests']} requests, {r['date']}")
    fig.tight_layout()
    # the Software text chunk marks the PNG as ours (cli.check_output_path)
    write_atomically(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110,
                                                   metadata={"Software": f"{MARK} benchmarks.serving"}))


def arrival_rate(text):
    """--rate: requests per second, 0 (all at once) or a finite number from MIN_RATE."""
    value = float(text)
    if not (value == 0 or MIN_RATE <= value < math.inf):
        raise argparse.ArgumentTypeError(f"must be 0 (all at once) or a finite rate of at least "
                                         f"{MIN_RATE} requests/s, got {text}")
    return value


def seconds(text):
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text}")
    return value


def length_range(text):
    low, _, high = text.partition("-")
    low, high = positive_int(low), positive_int(high or low)
    if high < low:
        raise ValueError(f"empty range {text}")
    return low, high


def main():
    p = ArgumentParser(description="Serve a seeded workload sequentially, in static batches, "
                       "with continuous batching and through HTTP (see the module docstring).")
    add_model_args(p)
    p.add_argument("--shape", choices=list(SHAPES), help="a random-weight model of this shape "
                   "instead of the checkpoint (gpt2: GPT-2 small)")
    p.add_argument("--requests", type=positive_int, default=64, help="default: 64")
    p.add_argument("--prompt-len", type=length_range, default=None,
                   help="prompt tokens, LOW-HIGH (default: 8 to context_len/2)")
    p.add_argument("--output-len", type=length_range, default=None,
                   help="new tokens per request, LOW-HIGH or N (default: 8 to context_len/2)")
    p.add_argument("--rate", type=arrival_rate, default=0.0,
                   help="Poisson arrivals, requests per second (default: 0, all at once)")
    p.add_argument("--modes", help=f"default: {','.join(MODES)}")
    p.add_argument("--max-batch", type=positive_int, default=64, help="default: 64")
    p.add_argument("--num-blocks", type=positive_int, default=None, help="the engine's pool "
                   "(default: serve.py's, room for --max-batch full contexts, at most 1 GiB)")
    p.add_argument("--tokens-per-block", type=positive_int, default=16, help="default: 16")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default=None,
                   help="how the engine's pool stores keys and values (serve.py's; default: the model's dtype)")
    p.add_argument("--attention", choices=["kernel", "gather"], default="kernel",
                   help="how the engine's decode steps run: compiled whole, the paged kernel inside (default: kernel), or eager with a gather")
    p.add_argument("--compile", action="store_true",
                   help="the engine as serve.py --compile runs it: a request decoding alone goes "
                   "through the compiled step (built once, before any measurement)")
    p.add_argument("--engine-thread", choices=["main", "background"],
                   help="where the engine's step loop runs: the main thread, which loaded "
                   "the model (serve.py's way), or a thread of its own, to see what that "
                   "costs (default: main)")
    p.add_argument("--url", help="only the load test, against a server already running "
                   "there (e.g. http://127.0.0.1:8000/v1: python serve.py, or vLLM's server); "
                   "give the same --ckpt/--hf, for the prompts' vocabulary and lengths")
    p.add_argument("--timeout", type=seconds, default=60.0, help="seconds a server may take to "
                   "connect or stay silent before a request fails (default: 60)")
    p.add_argument("--quick", action="store_true", help="16 requests, short lengths")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG (needs matplotlib)")
    args = p.parse_args()
    if args.url is not None and (args.modes is not None or args.engine_thread or args.compile):
        p.error("--url runs the load test alone: --modes, --engine-thread and --compile do not apply")
    modes = ["server"] if args.url is not None else (
        ",".join(MODES) if args.modes is None else args.modes).split(",")
    args.engine_thread = args.engine_thread or "main"
    if args.url is None and not set(modes) <= set(MODES):
        p.error(f"--modes: choose from {', '.join(MODES)}, got {args.modes!r}")
    twice = next((m for i, m in enumerate(modes) if m in modes[:i]), None)
    if twice:
        p.error(f"--modes: {twice} given twice")
    if args.url is not None and not args.url.startswith(("http://", "https://")):
        p.error(f"--url must start with http:// or https://, got {args.url!r}")
    # outputs are checked before the run: never over a file we did not write
    json_path = args.json is not None and check_output_path(args.json, "json")
    plt = args.plot is not None and import_pyplot()
    plot_path = args.plot is not None and check_output_path(args.plot, "png")

    if args.shape:
        torch.manual_seed(args.seed)
        device = torch.device("cpu" if args.device == "auto" else args.device)
        model = store_linears_column_major(pack_linears(KVCacheGPT(SHAPES[args.shape]).to(device).eval()))
        name = f"{args.shape} shape (random weights)"
        tokenizer = CountingTokenizer(model.config.vocab_size)
    else:
        model, tokenizer, _ = load_from_args(CACHED_MODELS, args)
        name = args.ckpt or args.hf or "the default checkpoint"
    context_len = model.config.context_len
    if args.quick:
        args.requests = min(args.requests, 16)
        args.prompt_len = args.prompt_len or (4, 32)
        args.output_len = args.output_len or (4, 32)
    args.prompt_len = args.prompt_len or (8, context_len // 2)
    args.output_len = args.output_len or (8, context_len // 2)
    requests = workload(args, tokenizer.n_vocab, context_len)
    if "http" in modes or args.url:
        try:
            import aiohttp  # noqa: F401
        except ImportError:
            raise UserError("the load test needs aiohttp: pip install -r requirements.txt") from None

    per_token = model.new_cache(1).nbytes() // context_len
    running_peak = min(args.max_batch, len(requests))
    r = {"date": str(date.today()), "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
         "torch": torch.__version__, "model": name, "context_len": context_len, "n_layer": model.config.n_layer,
         "workload": {"requests": args.requests, "prompt_len": "-".join(map(str, args.prompt_len)),
                      "output_len": "-".join(map(str, args.output_len)), "rate": args.rate,
                      "max_batch": args.max_batch, "seed": args.seed,
                      "engine_thread": args.engine_thread, "compile": args.compile,
                      "kv_dtype": args.kv_dtype},
         "running_peak": running_peak, "full_context_kv_bytes": running_peak * context_len * per_token,
         "modes": {}}
    if args.url:
        r["url"] = args.url
        r["modes"]["server"] = run_url(args.url.rstrip("/"), requests, args.timeout)
        return report(r, json_path, plot_path, plt)
    r["pool_bytes"] = new_engine(model, tokenizer, args).pool.nbytes()
    timed_stream(model, [requests[0][1]], [2])  # warm-up
    for mode in modes:
        print(f"running {mode}...", flush=True)
        if mode in ("sequential", "static"):
            batch = 1 if mode == "sequential" else args.max_batch
            r["modes"][mode] = run_static(model, requests, batch, per_token)
        else:
            engine = new_engine(model, tokenizer, args)
            run_mode = run_continuous if mode == "continuous" else run_http
            r["modes"][mode] = run_mode(engine, requests, args.engine_thread)
    r["prefix"] = prefix_hit_ttft(model, tokenizer, args)
    lengths = [len(prompt) + n for _, prompt, n in requests]
    r["gather"] = gather_cost(model, tokenizer, args, running_peak,
                              min(context_len - 1, int(statistics.mean(lengths))))
    report(r, json_path, plot_path, plt)


def report(r, json_path, plot_path, plt):
    print_report(r)
    if json_path:
        write_atomically(json_path, json_text(r, generator="benchmarks.serving", indent=1))
    if plot_path:
        plot(r, plot_path, plt)


if __name__ == "__main__":
    run(main)
