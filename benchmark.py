"""
What the KV cache buys, measured: speed with and without it, how cost grows with length,
how close decoding comes to the memory-bandwidth floor, and a peer on identical weights.

    python benchmark.py --quick                # under a minute
    python benchmark.py --json out/bench.json --plot out/bench.png

Batch 1 decoding reads every weight once per token, so its floor is the time to stream
all weights through a matrix-vector product; this measures that floor in the same run.
"""

import copy
import json
import math
import platform
import resource
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from base_model import GPT, GPTConfig, GenerationStats, store_linears_column_major
from checkpoint import ROOT
from cli import ArgumentParser, UserError, add_model_args, load_from_args, positive_int, run
from kv_cache import KVCacheGPT, cache_bytes_formula, synchronize
from kv_quant import KV_DTYPES

SHAPES = {  # random-weight models at a named shape
    "tiny": GPTConfig(block_size=256, vocab_size=4096, n_layer=6, n_head=4, n_embd=128),
    "gpt2": GPTConfig(block_size=1024, vocab_size=50257, n_layer=12, n_head=12, n_embd=768),
}
KINDS = {  # how a generation runs: naive, or KVCacheGPT.stream with a cache kind
    "naive": "GPT.stream: the whole context every step",
    "cat": "KVCacheGPT.stream, torch.cat cache (the seed's)",
    "prealloc": "KVCacheGPT.stream, preallocated KVCache",
}


def random_model(shape, device, seed=0):
    torch.manual_seed(seed)
    return store_linears_column_major(KVCacheGPT(SHAPES[shape]).to(device).eval())


def step_times(model, kind, prompt, n):
    """Seconds from the start to each of n greedy tokens (a list of n cumulative times).
    prompt: a (B, T) tensor, or (not for the naive loop) a list of token-id lists."""
    device = model.lm_head.weight.device
    if kind == "naive":
        tokens = GPT.stream(model, prompt, n, temperature=0)
    else:
        tokens = model.stream(prompt, n, temperature=0, cache_kind=kind)
    synchronize(device)
    t0, times = time.perf_counter(), []
    for _ in tokens:
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def spread(values):
    """Median and min-max of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def repeat(fn, reps):
    fn()  # warm-up: first calls pay for allocations and kernel selection
    return [fn() for _ in range(reps)]


def tokens_per_second(model, kind, prompt, n, reps):
    return spread([n / t[-1] for t in repeat(lambda: step_times(model, kind, prompt, n), reps)])


# ---------------------------------------------------------------------------- sections

def seed_demo(args, model, device, reps):
    """The seed's demo on the checkpoint: 200 tokens with and without the cache."""
    prompt = torch.zeros(1, 16, dtype=torch.long, device=device)
    naive = tokens_per_second(model, "naive", prompt, args.demo_tokens, reps)
    cached = tokens_per_second(model, "prealloc", prompt, args.demo_tokens, reps)
    return {"tokens": args.demo_tokens, "naive_tok_s": naive, "cached_tok_s": cached,
            "speedup": cached["median"] / naive["median"]}


def latency_at(times, position, prompt_len, window=8):
    """Median per-token latency around a position, from cumulative step times."""
    i = max(1, min(position - prompt_len, len(times) - 1))
    lo, hi = max(1, i - window), min(len(times), i + window + 1)
    return statistics.median(times[j] - times[j - 1] for j in range(lo, hi))


@torch.inference_mode()
def naive_latency(model, position, reps):
    """One naive step at a position: a forward pass over the whole context."""
    idx = torch.zeros(1, position, dtype=torch.long, device=model.lm_head.weight.device)

    def once():
        synchronize(idx.device)
        t0 = time.perf_counter()
        model(idx, last_only=True)
        synchronize(idx.device)
        return time.perf_counter() - t0
    return statistics.median(repeat(once, reps))


def cost_curves(args, device, reps):
    """Total time and per-token latency vs generated length, for the three kinds."""
    model = random_model(args.shape, device)
    prompt = torch.zeros(1, args.prompt_tokens, dtype=torch.long, device=device)
    lengths = [n for n in args.lengths if args.prompt_tokens + n <= model.config.block_size]
    longest = max(lengths)
    curves = {}
    for kind in ("cat", "prealloc"):
        runs = repeat(lambda: step_times(model, kind, prompt, longest), reps)
        curves[kind] = {
            "total_s": {n: spread([r[n - 1] for r in runs]) for n in lengths},
            "latency_ms": {n: 1e3 * statistics.median(latency_at(r, args.prompt_tokens + n, args.prompt_tokens)
                                                     for r in runs) for n in lengths},
        }
    # A naive step re-runs the whole context, so its cost grows with the context length t:
    # time single steps at a few lengths, interpolate between them, and add the steps up
    # (a measured naive run to 1000 tokens at GPT-2 size would take most of an hour).
    contexts = [args.prompt_tokens + n for n in lengths]
    latency = [naive_latency(model, t, reps) for t in contexts]

    def naive_total(n):
        steps = np.arange(args.prompt_tokens + 1, args.prompt_tokens + n + 1)
        return float(np.interp(steps, contexts, latency).sum())
    totals = {n: {"median": naive_total(n), "estimated": True} for n in lengths}
    if args.naive_check:  # one real naive run, to show that the estimate is sound
        n = min(args.naive_check, longest)
        totals[n] = {"median": step_times(model, "naive", prompt, n)[-1], "estimated": False,
                     "estimate_was": naive_total(n)}
    curves["naive"] = {"total_s": totals, "latency_ms": {n: 1e3 * t for n, t in zip(lengths, latency)}}
    return {"shape": args.shape, "prompt_tokens": args.prompt_tokens, "lengths": lengths,
            "curves": curves}


@torch.inference_mode()
def bandwidth_floor(model, reps):
    """The fastest a batch-1 step can be: every weight matrix read once by a
    matrix-vector product (torch's own kernels), and by a plain streaming read."""
    # wpe is left out: a step reads one row of it; wte's rows are read by lm_head, tied
    weights = [p for name, p in model.named_parameters() if p.dim() == 2 and "wpe" not in name]
    nbytes = sum(w.nbytes for w in weights)
    vectors = {w.size(1): torch.randn(1, w.size(1), device=w.device, dtype=w.dtype) for w in weights}

    def timed(op):
        def once():
            synchronize(weights[0].device)
            t0 = time.perf_counter()
            for w in weights:
                op(w)
            synchronize(weights[0].device)
            return time.perf_counter() - t0
        return min(repeat(once, reps))  # a floor: the best run is the one that counts

    matvec = timed(lambda w: F.linear(vectors[w.size(1)], w))
    read = timed(lambda w: w.sum())
    # the same product with nn.Linear's default row-major weights, for comparison: our
    # model keeps them column-major (base_model.store_linears_column_major)
    weights = [w.contiguous() for w in weights]
    matvec_row_major = timed(lambda w: F.linear(vectors[w.size(1)], w))
    return {"weight_bytes": nbytes, "matvec_ms": 1e3 * matvec, "matvec_GBps": nbytes / matvec / 1e9,
            "matvec_row_major_ms": 1e3 * matvec_row_major,
            "read_ms": 1e3 * read, "read_GBps": nbytes / read / 1e9}


def decode_vs_floor(args, device, reps):
    model = random_model(args.shape, device)
    floor = bandwidth_floor(model, reps)
    prompt = torch.zeros(1, args.prompt_tokens, dtype=torch.long, device=device)
    runs = repeat(lambda: step_times(model, "prealloc", prompt, args.demo_tokens), reps)
    # per-token decode time: everything after the first token (which includes the prefill)
    ms = statistics.median(1e3 * (r[-1] - r[0]) / (len(r) - 1) for r in runs)
    c = model.config
    result = {"shape": args.shape, **floor, "decode_ms_per_token": ms,
              "decode_over_floor": ms / floor["matvec_ms"],
            "cache_bytes_formula": cache_bytes_formula(c, c.block_size),
              "cache_bytes_real": model.new_cache(1).nbytes()}
    if args.compile:  # measured, not assumed: compilation takes a while and may not pay
        model.forward = torch.compile(model.forward, dynamic=True)
        runs = repeat(lambda: step_times(model, "prealloc", prompt, args.demo_tokens), reps)
        result["compiled_decode_ms_per_token"] = statistics.median(
            1e3 * (r[-1] - r[0]) / (len(r) - 1) for r in runs)
    return result


def batch_throughput(model, name, sizes, new_tokens, reps):
    """Aggregate decode speed when `b` different prompts (lengths 8..64, seeded) decode as
    one batch. A batch-1 step reads every weight to make one token; a batch-b step reads
    them once to make b, so until the matmuls become compute-bound the aggregate speed
    grows almost b-fold. Decode time excludes the first token (it includes the prefill)."""
    g = torch.Generator().manual_seed(0)
    vocab, c = model.config.vocab_size, model.config
    rows = {}
    for b in sizes:
        lengths = torch.randint(8, 65, (b,), generator=g).tolist()
        prompts = [torch.randint(vocab, (n,), generator=g).tolist() for n in lengths]
        n = min(new_tokens, c.block_size - max(lengths))  # no re-prefill inside the measurement

        def step_seconds():
            times = step_times(model, "prealloc", prompts, n)
            return (times[-1] - times[0]) / (n - 1)
        steps = repeat(step_seconds, reps)
        bytes_per_value = model.lm_head.weight.element_size()
        rows[b] = {"new_tokens": n, "step_ms": spread([1e3 * t for t in steps]),
                   "tok_s": spread([b / t for t in steps]),
                   "cache_bytes_formula": cache_bytes_formula(c, max(lengths) + n, b, bytes_per_value),
                   "cache_bytes_allocated": model.new_cache(b).nbytes()}
    for row in rows.values():
        row["vs_batch_1"] = row["tok_s"]["median"] / rows[min(rows)]["tok_s"]["median"]
    return {"model": name, "sizes": rows}


@torch.inference_mode()
def kv_dtype_latency(args, device, reps, steps=8):
    """Per-token decode latency at a long context for each cache dtype (kv_quant.py), and
    how much of it is reading the cache back (dequantizing, or casting to the model's dtype).
    A prompt of args.kv_position tokens is prefilled once per dtype; for a batch of b rows
    its cache is copied to b rows (as num_samples does), then `steps` decode steps are timed."""
    model = random_model(args.shape, device)
    position = min(args.kv_position, model.config.block_size - steps)
    prompt = torch.zeros(1, position, dtype=torch.long, device=device)
    result = {"shape": args.shape, "position": position, "steps": steps, "dtypes": {}}
    for kv in KV_DTYPES:
        prefilled = model.new_cache(1, kv)
        model(prompt, prefilled, last_only=True)
        result["dtypes"][kv] = rows = {}
        for b in args.kv_batch_sizes:
            def step_and_read_ms():
                cache = copy.copy(prefilled)  # select_rows gives the copy its own tensors
                cache.select_rows(torch.zeros(b, dtype=torch.long, device=device))
                token, times = torch.zeros(b, 1, dtype=torch.long, device=device), []
                for _ in range(steps):
                    synchronize(device)
                    t0 = time.perf_counter()
                    model.decode_one(token, cache, GenerationStats())
                    synchronize(device)
                    times.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for layer in range(len(cache)):
                    cache[layer]  # what update() returns: every column, in the model's dtype
                synchronize(device)
                return 1e3 * statistics.median(times), 1e3 * (time.perf_counter() - t0)
            runs = repeat(step_and_read_ms, reps)
            rows[b] = {"step_ms": spread([r[0] for r in runs]), "read_back_ms": spread([r[1] for r in runs]),
                       "cache_bytes": model.new_cache(b, kv).nbytes()}
    return result


@torch.inference_mode()
def quantized_peer(args, model, tokenizer, device, reps, steps=8):
    """transformers' QuantizedCache (KIVI-style, optimum-quanto backend: 4 bits, groups of
    32, the newest tokens kept in full precision up to residual_length: 128, and 32) against
    our int4 cache, and both float32 caches, on the checkpoint's weights: bits/char on the
    start of the held-out text (score()'s windows, each through the cache) and ms per
    decode step at position args.kv_position (batch 1)."""
    try:
        import optimum.quanto  # noqa: F401  (transformers' quanto backend imports it)
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.cache_utils import DynamicCache, QuantizedCache
    except ImportError as e:
        return {"note": f"skipped: {e.name} is not installed (pip install transformers optimum-quanto)"}
    from export_hf import hf_config, hf_state_dict
    from generate import nats_through_cache, score_windows  # the scorer of generate.py --score
    theirs = GPT2LMHeadModel(GPT2Config(**hf_config(model.config, eot=tokenizer.eot_token)))
    theirs.load_state_dict(hf_state_dict(model), strict=False)  # lm_head: tied to wte
    theirs = theirs.to(device).eval()
    caches = {  # name: (new_cache(rows), forward(tokens, cache) -> logits, extending the cache)
        "ours float32": (lambda rows: model.new_cache(rows, "float32"), lambda t, c: model(t, c)[0]),
        "ours int4": (lambda rows: model.new_cache(rows, "int4"), lambda t, c: model(t, c)[0]),
        "HF DynamicCache": (lambda rows: DynamicCache(config=theirs.config),
                            lambda t, c: theirs(t, past_key_values=c, use_cache=True).logits),
        # its default keeps the newest 128 tokens unquantized: in a window of 256 whose first
        # half is prefilled, no fed token is read back quantized; 32 is KIVI's group
        **{f"HF QuantizedCache quanto int4, residual {r}": (
            lambda rows, r=r: QuantizedCache("quanto", theirs.config, nbits=4, q_group_size=32,
                                             residual_length=r),
            lambda t, c: theirs(t, past_key_values=c, use_cache=True).logits) for r in (128, 32)},
    }
    text = args.kv_peer_text.read_text(encoding="utf-8")[:args.kv_peer_chars]
    ids = torch.tensor([tokenizer.eot_token] + tokenizer.encode_ordinary(text), device=device)
    block = model.config.block_size
    windows = score_windows(ids.numel() - 1, block)
    position = min(args.kv_position, block - steps)
    prompt = torch.zeros(1, position, dtype=torch.long, device=device)

    def step_ms(new_cache, forward):
        cache, token, times = new_cache(1), prompt[:, :1], []
        forward(prompt, cache)
        for _ in range(steps):
            synchronize(device)
            t0 = time.perf_counter()
            forward(token, cache)
            synchronize(device)
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times)
    result = {"chars": len(text), "tokens": ids.numel() - 1, "position": position, "caches": {}}
    for name, (new_cache, forward) in caches.items():
        nats = nats_through_cache(ids, windows, block, new_cache, forward)
        result["caches"][name] = {"bits_per_char": nats / math.log(2) / len(text),
                                  "step_ms": spread(repeat(lambda: step_ms(new_cache, forward), reps))}
    return result


def peer(shape, device, n, reps):
    """Hugging Face transformers' GPT2LMHeadModel.generate() on identical weights."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return None
    from export_hf import hf_config, hf_state_dict
    ours = random_model(shape, device)
    theirs = GPT2LMHeadModel(GPT2Config(**hf_config(ours.config, eot=0)))
    theirs.load_state_dict(hf_state_dict(ours), strict=False)  # lm_head: tied to wte
    theirs = theirs.to(device).eval()
    prompt = torch.randint(ours.config.vocab_size, (1, 16), device=device,
                           generator=torch.Generator(device).manual_seed(0))

    def hf_generate(**kw):
        with torch.inference_mode():
            return theirs.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                   max_new_tokens=n, min_new_tokens=n, pad_token_id=0, **kw)

    def rate(fn):
        def once():
            synchronize(device)
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            return n / (time.perf_counter() - t0)
        return spread(repeat(once, reps))

    ours_tokens = ours.generate(prompt, n, temperature=0)
    result = {"shape": shape, "tokens": n,
              "ours_tok_s": rate(lambda: ours.generate(prompt, n, temperature=0)),
              "hf_tok_s": rate(hf_generate),
              "greedy_tokens_match": torch.equal(ours_tokens, hf_generate())}
    try:  # the static cache is newer, and not every version runs it on every device
        result["hf_static_tok_s"] = rate(lambda: hf_generate(cache_implementation="static"))
        result["static_tokens_match"] = torch.equal(ours_tokens, hf_generate(cache_implementation="static"))
    except Exception as e:
        result["hf_static_error"] = f"{type(e).__name__}: {str(e)[:100]}"
    result["speedup_vs_hf"] = result["ours_tok_s"]["median"] / result["hf_tok_s"]["median"]
    return result


# ---------------------------------------------------------------------------- report

def fmt_spread(s, digits=1):
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def print_report(r):
    print(f"\n# kvcache-gpt benchmark, {r['date']}, {r['machine']}, torch {r['torch']}, "
          f"{r['threads']} threads, {r['device']}, batch 1, greedy; median [min-max] of {r['reps']} runs")
    d = r["seed_demo"]
    print(f"\n## The seed's demo: {d['tokens']} new tokens on {r['checkpoint']}")
    print(f"without cache {fmt_spread(d['naive_tok_s'])} tok/s | with cache "
          f"{fmt_spread(d['cached_tok_s'])} tok/s | speedup {d['speedup']:.1f}x")
    c = r["cost_curves"]
    print(f"\n## Cost vs generated length ({c['shape']} shape, random weights, "
          f"{c['prompt_tokens']}-token prompt)")
    print("| new tokens | naive total s | torch.cat total s | prealloc total s | "
          "naive ms/token | torch.cat ms/token | prealloc ms/token | prealloc vs naive |")
    print("|---|---|---|---|---|---|---|---|")
    cv = c["curves"]
    for n in c["lengths"]:
        nt = cv["naive"]["total_s"][n]
        mark = "" if not nt["estimated"] else " (est.)"
        print(f"| {n} | {nt['median']:.2f}{mark} | {cv['cat']['total_s'][n]['median']:.2f} | "
              f"{cv['prealloc']['total_s'][n]['median']:.2f} | {cv['naive']['latency_ms'][n]:.1f} | "
              f"{cv['cat']['latency_ms'][n]:.1f} | {cv['prealloc']['latency_ms'][n]:.1f} | "
              f"{nt['median'] / cv['prealloc']['total_s'][n]['median']:.1f}x |")
    for n, nt in cv["naive"]["total_s"].items():
        if not nt["estimated"]:
            print(f"(naive at {n} tokens measured: {nt['median']:.2f} s; the estimate gave "
                  f"{nt['estimate_was']:.2f} s)")
    first, last = c["lengths"][0], c["lengths"][-1]
    p = c["prompt_tokens"]
    print(f"per-token latency at position {p + last} vs {p + first}: prealloc "
          f"{cv['prealloc']['latency_ms'][last] / cv['prealloc']['latency_ms'][first]:.2f}x, "
          f"torch.cat {cv['cat']['latency_ms'][last] / cv['cat']['latency_ms'][first]:.2f}x, "
          f"naive {cv['naive']['latency_ms'][last] / cv['naive']['latency_ms'][first]:.2f}x")
    f = r["floor"]
    print(f"\n## The floor ({f['shape']} shape): every weight read once per token")
    print(f"weights {f['weight_bytes'] / 1e6:.0f} MB | matrix-vector {f['matvec_ms']:.1f} ms "
          f"({f['matvec_GBps']:.1f} GB/s; with row-major weights {f['matvec_row_major_ms']:.1f} ms) | "
          f"plain read {f['read_ms']:.1f} ms ({f['read_GBps']:.1f} GB/s)")
    print(f"our decode {f['decode_ms_per_token']:.1f} ms/token = {f['decode_over_floor']:.2f}x "
          f"the matrix-vector floor ({f['decode_ms_per_token'] / f['matvec_row_major_ms']:.2f}x "
          f"the row-major one)")
    if "compiled_decode_ms_per_token" in f:
        print(f"with torch.compile: {f['compiled_decode_ms_per_token']:.1f} ms/token")
    print(f"KV cache for the full context: formula {f['cache_bytes_formula']:,} B, "
          f"allocated {f['cache_bytes_real']:,} B | peak RSS {r['peak_rss_mb']:.0f} MB")
    print("\n## Batches of different prompts (lengths 8-64): aggregate decode speed")
    print("| model | prompts | tok/s, all rows | vs batch 1 | ms per step | KV cache by the formula | allocated |")
    print("|---|---|---|---|---|---|---|")
    for t in r["batch"]:
        for b, row in t["sizes"].items():
            print(f"| {t['model']} | {b} | {fmt_spread(row['tok_s'])} | {row['vs_batch_1']:.1f}x | "
                  f"{fmt_spread(row['step_ms'])} | {row['cache_bytes_formula'] / 2**20:.1f} MiB | "
                  f"{row['cache_bytes_allocated'] / 2**20:.1f} MiB |")
    print_kv_dtypes(r["kv_dtypes"])
    print_quantized_peer(r["quantized_peer"])
    print("\n## Peer: transformers GPT2LMHeadModel.generate(), identical weights")
    if not r["peer"]:
        print(r.get("peer_note", "skipped"))
    for p in r["peer"] or []:
        static = (fmt_spread(p["hf_static_tok_s"]) if "hf_static_tok_s" in p
                  else p.get("hf_static_error", "n/a"))
        print(f"{p['shape']}: ours {fmt_spread(p['ours_tok_s'])} tok/s | HF {fmt_spread(p['hf_tok_s'])} "
              f"tok/s | HF static cache {static} | ours / HF {p['speedup_vs_hf']:.2f}x | "
              f"greedy tokens match: {p['greedy_tokens_match']}")


def print_kv_dtypes(k):
    sizes = list(next(iter(k["dtypes"].values())))
    print(f"\n## Cache dtypes: decode at position {k['position']} ({k['shape']} shape), ms per step "
          "(reading the cache back: dequantize or cast, all layers)")
    print("| kv dtype | " + " | ".join(f"batch {b}: ms/step | read back | cache allocated" for b in sizes) + " |")
    print("|---|" + "---|---|---|" * len(sizes))
    for kv, rows in k["dtypes"].items():
        print(f"| {kv} | " + " | ".join(
            f"{fmt_spread(rows[b]['step_ms'])} | {rows[b]['read_back_ms']['median']:.1f} | "
            f"{rows[b]['cache_bytes'] / 2**20:.1f} MiB" for b in sizes) + " |")


def print_quantized_peer(q):
    print("\n## Quantized caches, ours and transformers' (QuantizedCache, quanto), identical weights")
    if "note" in q:
        print(q["note"])
        return
    print(f"bits/char on the first {q['chars']:,} characters of the held-out text ({q['tokens']:,} "
          f"tokens), ms per decode step at position {q['position']}, batch 1")
    print("| cache | bits/char | ms/step |")
    print("|---|---|---|")
    for name, c in q["caches"].items():
        print(f"| {name} | {c['bits_per_char']:.4f} | {fmt_spread(c['step_ms'])} |")


def plot(r, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install matplotlib") from None
    c = r["cost_curves"]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4))
    for kind, label in KINDS.items():
        cv = c["curves"][kind]
        ax1.plot(c["lengths"], [cv["total_s"][n]["median"] for n in c["lengths"]], "o-", label=label)
        ax2.plot(c["lengths"], [cv["latency_ms"][n] for n in c["lengths"]], "o-", label=label)
    ax1.set(xlabel="new tokens", ylabel="total seconds", title="Total time (naive: quadratic)")
    ax2.set(xlabel="new tokens", ylabel="ms per token", title="Per-token latency", yscale="log")
    ax1.legend(fontsize=8)
    for t in r["batch"]:
        sizes = list(t["sizes"])
        ax3.plot(sizes, [t["sizes"][b]["tok_s"]["median"] for b in sizes], "o-", label=t["model"])
    ax3.set(xlabel="different prompts decoded together", ylabel="tokens/s, all rows",
            title="Batching: aggregate decode speed", xscale="log", yscale="log")
    ax3.set_xticks([b for t in r["batch"][:1] for b in t["sizes"]], minor=False)
    ax3.set_xticklabels([str(b) for t in r["batch"][:1] for b in t["sizes"]])
    ax3.legend(fontsize=8)
    fig.suptitle(f"{c['shape']} shape, {r['machine']}, {r['date']}")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def int_list(text):
    return sorted({positive_int(x) for x in text.split(",")})


def main():
    p = ArgumentParser(description="Measure what the KV cache buys (see the module docstring).")
    add_model_args(p)
    p.add_argument("--quick", action="store_true", help="small shapes, one run each: under a minute")
    p.add_argument("--shape", choices=list(SHAPES), help="random-weight shape for the curves "
                   "and the floor (default: gpt2, or tiny with --quick)")
    p.add_argument("--lengths", type=int_list, help="generated lengths, comma-separated "
                   "(default: 4,32,64,128,256,512,1000; with --quick 4,32,64,128,224)")
    p.add_argument("--prompt-tokens", type=positive_int, default=16, help="default: 16")
    p.add_argument("--demo-tokens", type=positive_int, default=200, help="default: 200")
    p.add_argument("--reps", type=positive_int, help="timed runs after a warm-up (default: 3, quick 1)")
    p.add_argument("--naive-check", type=int, default=None,
                   help="also measure one real naive run of this length (default: 128, quick 32; 0: none)")
    p.add_argument("--batch-sizes", type=int_list, help="numbers of different prompts decoded "
                   "together (default: 1,2,4,8,16,32; with --quick 1,4,16)")
    p.add_argument("--batch-tokens", type=positive_int, default=64,
                   help="new tokens per row in the batch table (default: 64)")
    p.add_argument("--kv-position", type=positive_int, help="context length at which each cache "
                   "dtype's decode step is timed (default: 1000, quick 200; capped by the shape's context)")
    p.add_argument("--kv-batch-sizes", type=int_list, default=[1, 16],
                   help="batch sizes for the cache-dtype table (default: 1,16)")
    p.add_argument("--kv-peer-chars", type=positive_int, default=24000, help="characters of the "
                   "held-out text scored in the quantized-cache peer (default: 24000; quick 3000)")
    p.add_argument("--kv-peer-text", type=Path, default=ROOT / "checkpoints" / "shakespeare" / "heldout.txt",
                   help="text for the quantized-cache peer (default: the bundled held-out plays)")
    p.add_argument("--no-peer", action="store_true", help="skip the transformers comparisons")
    p.add_argument("--compile", action="store_true",
                   help="also time decoding with torch.compile (compiles for minutes on a CPU)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", metavar="PATH", help="write the cost curves as a PNG (needs matplotlib)")
    args = p.parse_args()
    args.shape = args.shape or ("tiny" if args.quick else "gpt2")
    args.lengths = args.lengths or ([4, 32, 64, 128, 224] if args.quick else [4, 32, 64, 128, 256, 512, 1000])
    reps = args.reps or (1 if args.quick else 3)
    args.kv_position = args.kv_position or (200 if args.quick else 1000)
    if args.naive_check is None:
        args.naive_check = 32 if args.quick else 128

    model, tokenizer, device = load_from_args(KVCacheGPT, args)
    r = {"date": str(date.today()), "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
         "torch": torch.__version__, "threads": torch.get_num_threads(), "device": device.type,
         "reps": reps, "checkpoint": args.ckpt or args.hf or "the default checkpoint",
         "command": " ".join(["python", *sys.argv])}
    r["seed_demo"] = seed_demo(args, model, device, reps)
    r["cost_curves"] = cost_curves(args, device, reps)
    r["floor"] = decode_vs_floor(args, device, reps)
    sizes = args.batch_sizes or ([1, 4, 16] if args.quick else [1, 2, 4, 8, 16, 32])
    r["batch"] = [batch_throughput(model, "checkpoint", sizes, args.batch_tokens, reps),
                  batch_throughput(random_model(args.shape, device), f"{args.shape} shape",
                                   sizes, args.batch_tokens, reps)]
    r["kv_dtypes"] = kv_dtype_latency(args, device, reps)
    if args.no_peer:
        r["quantized_peer"] = {"note": "skipped (--no-peer)"}
    else:
        if args.quick:
            args.kv_peer_chars = min(args.kv_peer_chars, 3000)
        r["quantized_peer"] = quantized_peer(args, model, tokenizer, device, reps)
    r["peer"] = None
    if args.no_peer:
        r["peer_note"] = "skipped (--no-peer)"
    else:
        shapes = ["tiny"] if args.quick else ["tiny", "gpt2"]
        results = [peer(s, device, args.demo_tokens, reps) for s in shapes]
        r["peer"] = None if None in results else results
        r["peer_note"] = "skipped: transformers is not installed (pip install -r requirements-dev.txt)"
    r["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print_report(r)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(r, indent=1))
    if args.plot:
        plot(r, args.plot)


if __name__ == "__main__":
    run(main)
