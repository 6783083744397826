"""
Long prompts arriving while streams decode: what chunked prefill (serving/scheduler.py,
the engine's max_step_tokens) does to the streams' inter-token latency.

    python -m benchmarks.long_prompts                    # SmolLM2-135M's shape, random weights
    python -m benchmarks.long_prompts --streams 32 --prompt-len 2000 --every 3 --budgets 0,256,512,1024

--streams requests decode (short prompts, greedy, outputs long enough to outlast the run);
once every one of them has its first token, --long-prompts prompts of --prompt-len tokens
arrive, one every --every seconds, each asking for --long-output tokens. The window runs
from the first long prompt's arrival to the last one's end; in it:

    ITL p50 / p99   the gaps between the decoding streams' tokens: a long prompt prefilled
                    whole is one gap as long as its prefill, for every stream at once
    tok/s           every token handed out in the window, the streams' and the long prompts'
    TTFT            of the long prompts (chunks make it longer: they share their steps)

Each --budgets value is a fresh engine on the same model and workload (0: no chunks, a
prompt prefilled whole in one step: the engine without chunked prefill), in turns
(benchmarks/timing.py), --reps times: median and min-max of each figure.
"""

import statistics
import threading
import time

from plumbing.script import begin, run

if __name__ == "__main__":  # run as a command; importing this file changes nothing
    begin()  # before torch: Ctrl-C during the slow imports ends quietly (plumbing/script.py)

import torch  # noqa: E402

from base_model import store_linears_column_major  # noqa: E402
from benchmarks.serving import CountingTokenizer, run_on_the_side  # noqa: E402
from benchmarks.timing import alternate, spread  # noqa: E402
from kv_cache import KVCacheLlama  # noqa: E402
from llama import LlamaConfig  # noqa: E402
from plumbing.cli import ArgumentParser, positive_int  # noqa: E402
from plumbing.outputs import check_output_path, json_text, write_atomically  # noqa: E402
from serving.engine import Engine, SamplingParams  # noqa: E402

# SmolLM2-135M's shape (its config.json); the weights are random: speed, not text
SMOLLM2_135M = LlamaConfig(context_len=8192, vocab_size=49152, n_layer=30, n_head=9, n_kv_head=3,
                           n_embd=576, intermediate_size=1536, rope_theta=100000.0, tie_embeddings=True)
STREAM_PROMPT = 16  # tokens of each decoding stream's prompt


def serve(model, args, budget):
    """One run of the workload on a fresh engine of this budget: its figures."""
    tokenizer = CountingTokenizer(model.config.vocab_size)
    engine = Engine(model, tokenizer, max_batch=args.streams + args.long_prompts, max_step_tokens=budget)
    engine.warm_up()  # the decode step compiled: not part of the measurement
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(tokenizer.n_vocab, (n,), generator=g).tolist()
               for n in [STREAM_PROMPT] * args.streams + [args.prompt_len] * args.long_prompts]
    greedy = dict(temperature=0, stop_at_eot=False)
    decoding, done, started = threading.Event(), threading.Event(), [0]

    def on_stream_output(request, output):
        if len(request.token_times) == 1:
            started[0] += 1  # (the engine's thread only)
            if started[0] == args.streams:
                decoding.set()

    def on_long_output(request, output):
        if output.finish_reason and all(r.finish_reason for r in longs):
            done.set()
    longs = []

    def work():
        streams = [engine.add_request(p, SamplingParams(max_tokens=model.config.context_len - STREAM_PROMPT,
                                                        **greedy), on_stream_output)
                   for p in prompts[:args.streams]]
        decoding.wait()  # every stream has its first token
        t0 = time.perf_counter()
        for i, prompt in enumerate(prompts[args.streams:]):
            time.sleep(max(0.0, t0 + i * args.every - time.perf_counter()))
            longs.append(engine.add_request(prompt, SamplingParams(max_tokens=args.long_output, **greedy),
                                            on_long_output))
        done.wait()
        t1 = time.perf_counter()
        for r in streams:
            engine.cancel(r)
        return streams, t0, t1
    streams, t0, t1 = run_on_the_side(work, engine)
    return window_figures(streams, longs, t0, t1)


def window_figures(streams, longs, t0, t1):
    """The window's figures (module docstring) from each request's token times."""
    gaps = [b - a for r in streams for a, b in zip(r.token_times, r.token_times[1:]) if t0 <= a and b <= t1]
    tokens = sum(t0 <= t <= t1 for r in streams + longs for t in r.token_times)
    p = statistics.quantiles(gaps, n=100)
    return {"itl_p50_ms": 1e3 * p[49], "itl_p99_ms": 1e3 * p[98], "tok_s": tokens / (t1 - t0),
            "ttft_ms": 1e3 * statistics.median(r.token_times[0] - r.arrival_time for r in longs)}


def print_table(r):
    w = r["workload"]
    print(f"\n# long prompts while streams decode, {r['model']}, {r['threads']} threads, torch {r['torch']}")
    print(f"{w['streams']} streams decoding; {w['long_prompts']} prompts of {w['prompt_len']} tokens, "
          f"one every {w['every']:g} s, {w['long_output']} tokens each; median (min-max) of {w['reps']} runs")
    print("\n| max_step_tokens | stream ITL p50 ms | stream ITL p99 ms | p99 vs 0 | tok/s | tok/s vs 0 | long prompt TTFT ms |")
    print("|---|---|---|---|---|---|---|")
    base = r["budgets"].get("0")

    def cell(m, key, digits=0):
        s = m[key]
        return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"
    for budget, m in r["budgets"].items():
        vs = ((f"{m['itl_p99_ms']['median'] / base['itl_p99_ms']['median']:.2f}x",
               f"{m['tok_s']['median'] / base['tok_s']['median']:.2f}x") if base else ("n/a", "n/a"))
        print(f"| {budget if budget != '0' else '0 (whole prompts)'} | {cell(m, 'itl_p50_ms')} | "
              f"{cell(m, 'itl_p99_ms')} | {vs[0]} | {cell(m, 'tok_s')} | {vs[1]} | {cell(m, 'ttft_ms')} |")


def budget_list(text):
    """--budgets: max_step_tokens values, 0 or positive, each once, in the order given."""
    values = [int(x) for x in text.split(",")]
    if any(v < 0 for v in values) or len(set(values)) < len(values):
        raise ValueError(f"--budgets wants distinct numbers >= 0, got {text}")
    return values


def main():
    p = ArgumentParser(description="Decoding streams' inter-token latency while long prompts "
                       "arrive, with and without chunked prefill (see the module docstring).")
    p.add_argument("--streams", type=positive_int, default=32, help="decoding streams (default: 32)")
    p.add_argument("--prompt-len", type=positive_int, default=2000, help="tokens of each long prompt (default: 2000)")
    p.add_argument("--long-prompts", type=positive_int, default=3, help="how many arrive (default: 3)")
    p.add_argument("--every", type=float, default=3.0, help="seconds between them (default: 3)")
    p.add_argument("--long-output", type=positive_int, default=16, help="tokens each asks for (default: 16)")
    p.add_argument("--budgets", type=budget_list, default=[0, 256, 512, 1024],
                   help="the engine's max_step_tokens, one engine each (default: 0,256,512,1024)")
    p.add_argument("--reps", type=positive_int, default=2, help="runs of each budget, in turns (default: 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args()
    max_batch = args.streams + args.long_prompts
    if any(0 < b <= max_batch for b in args.budgets):
        p.error(f"--budgets: each must be 0 or more than --streams + --long-prompts ({max_batch}): "
                "a full decode pass must leave room for a chunk")
    if not 0 < args.every < 3600:
        p.error(f"--every must be seconds in (0, 3600), got {args.every:g}")
    if STREAM_PROMPT + 1 + args.prompt_len > SMOLLM2_135M.context_len:
        p.error(f"--prompt-len must be at most {SMOLLM2_135M.context_len - STREAM_PROMPT - 1}")
    json_path = args.json is not None and check_output_path(args.json, "json")
    torch.manual_seed(args.seed)
    model = store_linears_column_major(KVCacheLlama(SMOLLM2_135M).eval())
    runs = {b: (lambda b=b: serve(model, args, b)) for b in args.budgets}
    results = alternate(runs, args.reps)  # a warm-up run of each first
    r = {"model": "SmolLM2-135M shape (random weights)", "threads": torch.get_num_threads(),
         "torch": torch.__version__,
         "workload": {k: getattr(args, k) for k in ("streams", "prompt_len", "long_prompts", "every",
                                                     "long_output", "reps", "seed")},
         "budgets": {str(b): {key: spread([run[key] for run in runs_of_b]) for key in runs_of_b[0]}
                     for b, runs_of_b in results.items()}}
    print_table(r)
    if json_path:
        write_atomically(json_path, json_text(r, generator="benchmarks.long_prompts", indent=1))


if __name__ == "__main__":
    run(main)
