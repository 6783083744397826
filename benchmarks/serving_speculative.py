"""
Speculative decoding in the serving engine (serving/speculation.py) measured: the engine
with and without it, taking turns, in the same run:

    python -m benchmarks.serving_speculative            # both parts, the bundled model
    python -m benchmarks.serving_speculative --quick    # shorter, one run each

    one request   a repetitive prompt (a held-out passage's first 32 tokens, four times),
                  greedy, alone in the engine: decode tokens/s (the first token, the
                  prefill's, left out), and whether the text is the same token for token.
                  The bundled model does not copy the prompt; its greedy text falls into a
                  loop of its own after a few lines, which prompt lookup then follows
    workload      --requests requests of random prompts (--prompt-len tokens) and
                  --output-len new tokens each, all at once, greedy (benchmarks/serving.py's
                  workload): output tokens/s. Every request speculates, as with serve.py
                  --speculate; a full batch has no rows to spare for proposals, its last
                  requests do

Each engine is made once (its decode step compiled by the warm-up) and run --reps times
after a warm-up run; the figures are the median and the min-max.
"""

import argparse
import time

from plumbing.script import begin, run

if __name__ == "__main__":  # run as a command; importing this file changes nothing
    begin()  # before torch: Ctrl-C during the slow imports ends quietly (plumbing/script.py)

import torch  # noqa: E402

from benchmarks.serving import workload  # noqa: E402
from benchmarks.speculative import HELDOUT, heldout_prompts  # noqa: E402
from benchmarks.timing import alternate, spread  # noqa: E402
from kv_cache import CACHED_MODELS  # noqa: E402
from plumbing.cli import (ArgumentParser, add_model_args, load_draft, load_from_args,  # noqa: E402
                          ngram_size, positive_int)
from serving.admission import Limits  # noqa: E402
from serving.engine import Engine, SamplingParams  # noqa: E402

GREEDY = dict(temperature=0, stop_at_eot=False)


def new_engine(model, tokenizer, args, speculate, draft=None):
    engine = Engine(model, tokenizer, compile=args.compile, speculate=speculate,
                    prompt_lookup=args.prompt_lookup, draft=draft,
                    limits=Limits(max_waiting=max(Limits().max_waiting, args.requests)))
    engine.warm_up()  # compiles the decode step: not part of any measurement
    return engine


def one_request(engine, prompt, n):
    """A function that runs prompt alone for n tokens: (decode tokens/s, its tokens)."""
    def once():
        request = engine.add_request(prompt, SamplingParams(max_tokens=n, **GREEDY))
        engine.run_until_done()
        times = request.token_times
        return (len(times) - 1) / (times[-1] - times[0]), request.tokens[request.prompt_len:]
    return once


def whole_workload(engine, requests):
    """A function that runs every request at once: (output tokens/s, proposed, accepted)."""
    def once():
        proposed, accepted = engine.proposed_tokens, engine.accepted_tokens
        t0 = time.perf_counter()
        for _, prompt, n in requests:
            engine.add_request(prompt, SamplingParams(max_tokens=n, **GREEDY))
        engine.run_until_done()
        tokens = sum(n for _, _, n in requests)
        return (tokens / (time.perf_counter() - t0), engine.proposed_tokens - proposed,
                engine.accepted_tokens - accepted)
    return once


def report(name, results):
    plain, spec = ([r[0] for r in results[k]] for k in ("plain", "speculate"))
    ratios = [s / p for s, p in zip(spec, plain)]
    for label, values in (("without", plain), ("with", spec)):
        s = spread(values)
        print(f"  {name:12} {label:8} {s['median']:8.1f} tok/s  ({s['min']:.1f}-{s['max']:.1f})")
    s = spread(ratios)
    print(f"  {name:12} ratio    {s['median']:8.2f}x       ({s['min']:.2f}-{s['max']:.2f}, same-run pairs)")


def main():
    p = ArgumentParser(description="The serving engine with and without speculative decoding "
                       "(prompt lookup, or --draft): one request on a repetitive prompt, and a workload.")
    add_model_args(p)
    p.add_argument("--speculate", type=positive_int, default=8, help="proposals per step (default: 8)")
    p.add_argument("--prompt-lookup", type=ngram_size, default=3, help="longest n-gram (default: 3)")
    p.add_argument("--draft", metavar="CKPT_OR_DIR", help="propose with this draft model instead of "
                   "prompt lookup (serve.py --draft; bundled: checkpoints/shakespeare-draft/ckpt.pt)")
    p.add_argument("--tokens", type=positive_int, default=128,
                   help="new tokens of the one request (default: 128)")
    p.add_argument("--requests", type=positive_int, default=64, help="the workload's (default: 64)")
    p.add_argument("--prompt-len", type=positive_int, default=16, help="the workload's (default: 16)")
    p.add_argument("--output-len", type=positive_int, default=128, help="the workload's (default: 128)")
    p.add_argument("--reps", type=positive_int, default=5, help="timed runs of each (default: 5)")
    p.add_argument("--compile", action="store_true", help="the engines as serve.py --compile runs "
                   "them: a request decoding alone goes through the compiled step")
    p.add_argument("--quick", action="store_true", help="64 tokens, 16 requests, one run each")
    args = p.parse_args()
    if args.quick:
        args.tokens, args.requests, args.output_len, args.reps = 64, 16, 32, 1
    model, tokenizer, device = load_from_args(CACHED_MODELS, args)
    draft = None if args.draft is None else load_draft(CACHED_MODELS, args.draft, tokenizer, device, args)
    prompt = heldout_prompts(tokenizer, HELDOUT.read_text(encoding="utf-8"), 1, 32)[0] * 4
    engines = {"plain": new_engine(model, tokenizer, args, 0),
               "speculate": new_engine(model, tokenizer, args, args.speculate, draft)}
    proposer = f"draft {args.draft}" if draft is not None else f"prompt lookup {args.prompt_lookup}"
    print(f"{torch.get_num_threads()} threads; speculate {args.speculate}, {proposer}, "
          f"compile {args.compile}; median (min-max) of {args.reps}")

    one = alternate({k: one_request(e, prompt, args.tokens) for k, e in engines.items()}, args.reps)
    proposed, accepted = engines["speculate"].proposed_tokens, engines["speculate"].accepted_tokens
    same = all(a[1] == b[1] for a, b in zip(one["plain"], one["speculate"]))
    print(f"one request, a repetitive prompt of {len(prompt)} tokens, {args.tokens} new "
          f"(greedy text identical: {'yes' if same else 'NO'}; {accepted} of {proposed} "
          f"proposals accepted over {args.reps + 1} runs):")
    report("one request", one)

    w = argparse.Namespace(seed=args.seed, rate=0.0, requests=args.requests,
                           prompt_len=(args.prompt_len,) * 2, output_len=(args.output_len,) * 2)
    requests = workload(w, tokenizer.n_vocab, model.config.context_len)
    many = alternate({k: whole_workload(e, requests) for k, e in engines.items()}, args.reps)
    proposed, accepted = many["speculate"][-1][1:]
    print(f"workload, {args.requests} requests x {args.output_len} tokens, prompts of "
          f"{args.prompt_len} (proposed {proposed}, accepted {accepted} in a run):")
    report("workload", many)


if __name__ == "__main__":
    run(main)
