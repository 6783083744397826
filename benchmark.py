"""
What the KV cache buys, measured: speed with and without it, how cost grows with length,
how close decoding comes to the memory-bandwidth floor, and a peer on identical weights.

    python benchmark.py --quick                # under a minute
    python benchmark.py --json out/bench.json --plot out/bench.png

Batch 1 decoding reads every weight once per token, so its floor is the time to stream
all weights through a matrix-vector product; this measures that floor in the same run.
"""

import argparse
import copy
import math
import platform
import resource
import statistics
import sys
import time
from datetime import date
from pathlib import Path

# cli first, before torch: Ctrl-C during the slow imports then ends quietly (see cli.py)
from cli import (MARK, ArgumentParser, UserError, add_model_args, check_output_path, json_text,
                 load_from_args, positive_int, run, write_atomically)

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from base_model import GPT, GPTConfig, GenerationStats, store_linears_column_major
from checkpoint import ROOT
from kv_cache import KVCacheGPT, cache_bytes_formula, synchronize
from kv_quant import KV_DTYPES
from peers import llama_cpp_missing, llama_cpp_peer, transformers_peer
from quantize import (INT4_GROUP_SIZE, INT4_GROUP_SIZES, Int4Linear, Int8Linear, QuantizedLinear,
                      quantize_model)
from timing import repeat, spread

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
    lengths = args.lengths  # each fits after the prompt (check_run_is_possible)
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


def peers(args, model, device, reps):
    """The peers on identical weights (peers.py): transformers on the random shapes, and
    llama.cpp on the loaded model and the same shapes. Each says in one line why it did not run."""
    if args.no_peer:
        return {"peer": None, "peer_note": "skipped (--no-peer)",
                "llama_cpp": None, "llama_cpp_note": "skipped (--no-peer)"}
    shapes = {s: random_model(s, device) for s in (["tiny"] if args.quick else ["tiny", "gpt2"])}
    r = {"peer": [transformers_peer(s, m, device, args.demo_tokens, reps) for s, m in shapes.items()],
         "peer_note": None, "llama_cpp": None}
    if None in r["peer"]:
        r["peer"], r["peer_note"] = None, "skipped: transformers is not installed (pip install -r requirements-dev.txt)"
    r["llama_cpp_note"] = llama_cpp_missing() or (
        f"skipped: this llama.cpp build runs on the CPU, the benchmark on {device.type}; use --device cpu"
        if device.type != "cpu" else None)
    if r["llama_cpp_note"] is None:
        checkpoint = args.ckpt or args.hf or "the default checkpoint"
        models = [(checkpoint, model)] + [(f"{s} shape", m) for s, m in shapes.items()]
        r["llama_cpp"] = [llama_cpp_peer(label, m, args.demo_tokens, reps) for label, m in models]
    return r


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




# ---------------------------------------------------------------------------- quantization

WEIGHT_FORMATS = {  # name: (the model's dtype, weight-only quantization); see quantize.py
    "fp32": (torch.float32, None),
    "bf16": (torch.bfloat16, None),
    "int8": (torch.float32, "int8"),
    "int4": (torch.float32, "int4"),
    "int8, bf16 model": (torch.bfloat16, "int8"),
    "int4, bf16 model": (torch.bfloat16, "int4"),
}


def linear_layers(model):
    return [m for m in model.modules() if isinstance(m, (nn.Linear, QuantizedLinear))]


def weight_bytes(layer):
    """Bytes a Linear layer's weight takes, in whatever format it is stored."""
    return layer.weight.nbytes if isinstance(layer, nn.Linear) else layer.weight_nbytes()


def weight_bytes_per_token(model):
    """Bytes of weights one batch-1 decode step reads: each Linear's weight once. wte is
    read through the tied lm_head (its embedding lookup reads one row), wpe one row: both
    left out, as in bandwidth_floor."""
    return sum(weight_bytes(m) for m in linear_layers(model))


@torch.inference_mode()
def layers_ms(layers, device, dtype, reps):
    """One matrix-vector product through each layer, as a decode step runs them (casts and
    bias included), inputs in the model's dtype: the kernels' share of a step, in ms."""
    vectors = {m.in_features: torch.randn(1, 1, m.in_features, device=device, dtype=dtype)
               for m in layers}

    def once():
        synchronize(device)
        t0 = time.perf_counter()
        for m in layers:
            m(vectors[m.in_features])
        synchronize(device)
        return time.perf_counter() - t0
    return 1e3 * min(repeat(once, reps))


def row_major(linear):
    out = copy.deepcopy(linear)
    out.weight.data = out.weight.data.contiguous()
    return out


def kernel_timings(shape, device, reps):
    """Every Linear of a random-weight model of this shape, one matrix-vector product each,
    in each weight format, kernel activation dtype and int4 group size: what the kernels
    cost apart from the rest of a step. Each variant is built, timed and freed in turn."""
    linears = [m for m in random_model(shape, device).modules() if isinstance(m, nn.Linear)]
    fp32, bf16 = torch.float32, torch.bfloat16
    variants = {  # label: (how to build the layers, the model's dtype around them)
        "fp32, column-major (our layout)": (lambda m: m, fp32),
        "fp32, row-major (nn.Linear's default)": (row_major, fp32),
        "bf16": (lambda m: copy.deepcopy(m).to(bf16), bf16),
        "int8, bf16 activations": (Int8Linear, fp32),
        "int8, fp32 activations": (lambda m: Int8Linear(m, activation_dtype=fp32), fp32),
        **{f"int4 groups of {g}, bf16 activations": (lambda m, g=g: Int4Linear(m, g), fp32)
           for g in INT4_GROUP_SIZES if SHAPES[shape].n_embd % g == 0},
        f"int4 groups of {INT4_GROUP_SIZE}, fp32 activations":
            (lambda m: Int4Linear(m, activation_dtype=fp32), fp32),
    }
    timings = {}
    for label, (build, dtype) in variants.items():
        layers = [build(m) for m in linears]
        timings[label] = {"ms": layers_ms(layers, device, dtype, reps),
                          "weight_bytes": sum(weight_bytes(m) for m in layers)}
    return {"shape": shape, "variants": timings}


def decode_ms_per_token(model, prompt, n, reps):
    """Median per-token decode time: everything after the first token (prefill included there)."""
    runs = repeat(lambda: step_times(model, "prealloc", prompt, n), reps)
    return statistics.median(1e3 * (r[-1] - r[0]) / (len(r) - 1) for r in runs)


def greedy_agreement(tokens, reference):
    """(leading tokens identical, positions equal) of two greedy continuations (1, n)."""
    same = (tokens == reference)[0].long()
    return int(same.cumprod(0).sum()), int(same.sum())


def weight_formats(name, fp32_model, prompt, n, reps, vocab_limit=None, agreement=False):
    """Each of WEIGHT_FORMATS on one model: bytes read per token, the floor for those bytes
    at the plain-read bandwidth measured on this model's own weights, the Linear layers'
    time, and decode speed; with agreement=True, how many of n greedy tokens match fp32."""
    read_GBps = bandwidth_floor(fp32_model, reps)["read_GBps"]
    rows, fp32_tokens = [], None
    for label, (dtype, scheme) in WEIGHT_FORMATS.items():
        model = copy.deepcopy(fp32_model).to(dtype)
        t0 = time.perf_counter()
        if scheme:
            quantize_model(model, scheme)
        row = {"format": label, "quantize_s": time.perf_counter() - t0,
               "weight_bytes": weight_bytes_per_token(model),
               "linears_ms": layers_ms(linear_layers(model), prompt.device, dtype, reps),
               "decode_ms_per_token": decode_ms_per_token(model, prompt, n, reps)}
        row["floor_ms"] = row["weight_bytes"] / read_GBps / 1e6
        row["decode_over_floor"] = row["decode_ms_per_token"] / row["floor_ms"]
        if agreement:
            tokens = model.generate(prompt, n, temperature=0, vocab_limit=vocab_limit)[:, prompt.size(1):]
            fp32_tokens = tokens if fp32_tokens is None else fp32_tokens  # fp32 comes first
            row["greedy_prefix_same"], row["greedy_positions_same"] = greedy_agreement(tokens, fp32_tokens)
        rows.append(row)
        del model
    return {"model": name, "read_GBps": read_GBps, "tokens": n, "formats": rows}


def quantization(args, model, tokenizer, device, reps):
    """WEIGHT_FORMATS on the checkpoint (from the fp32 weights even when --dtype/--quantize
    loaded it otherwise; greedy agreement from a text prompt) and on args.shape."""
    if (args.dtype, args.quantize) != ("float32", "none"):
        fp32_args = argparse.Namespace(**{**vars(args), "dtype": "float32", "quantize": "none",
                                          "group_size": None})
        model = load_from_args(KVCacheGPT, fp32_args)[0]
    prompt = torch.tensor([tokenizer.encode_ordinary("ROMEO:\n")], device=device)
    checkpoint = weight_formats("checkpoint", model, prompt, args.demo_tokens, reps,
                                vocab_limit=tokenizer.n_vocab, agreement=True)
    prompt = torch.zeros(1, args.prompt_tokens, dtype=torch.long, device=device)
    shape = weight_formats(f"{args.shape} shape, random weights", random_model(args.shape, device),
                           prompt, args.demo_tokens, reps)
    return {"kernels": kernel_timings(args.shape, device, reps), "models": [checkpoint, shape]}


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
    print("\n## Peer: llama.cpp (llama-cpp-python), identical weights (GGUF), timed in turns with ours")
    rows = r["llama_cpp"]
    if not rows:
        print(r["llama_cpp_note"])
        return
    kinds = list(rows[0]["llama_cpp"])
    print(f"| model | ours tok/s | {' | '.join(f'llama.cpp {t} tok/s' for t in kinds)} | "
          f"ours / llama.cpp f32 | greedy tokens as ours ({', '.join(kinds)}) |")
    print("|---" * (len(kinds) + 4) + "|")
    for p in rows:
        llama = p["llama_cpp"].values()
        print(f"| {p['model']} ({p['params_m']:.2f}M) | {fmt_spread(p['ours_tok_s'])} | "
              + " | ".join(fmt_spread(v["tok_s"]) for v in llama)
              + f" | {p['ours_over_llama_cpp_f32']:.2f}x | "
              + ", ".join(f"{v['greedy_tokens_matched']}/{p['tokens']}" for v in llama) + " |")


def print_quantization(results, floor):
    k = results["kernels"]
    print(f"\n## Weight-only quantization (quantize.py): the kernels ({k['shape']} shape, every "
          "Linear once on one vector)")
    print("| weights | MB | ms |\n|---|---|---|")
    for label, v in k["variants"].items():
        print(f"| {label} | {v['weight_bytes'] / 1e6:.1f} | {v['ms']:.1f} |")
    if floor["shape"] == k["shape"]:
        print(f"| plain read of the fp32 bytes (the floor section) | {floor['weight_bytes'] / 1e6:.1f} | "
              f"{floor['read_ms']:.1f} |")
    print("\n## Weight-only quantization: bytes read per token, and what they buy")
    for q in results["models"]:
        print(f"\n{q['model']}: {q['tokens']} new tokens; floor = bytes / {q['read_GBps']:.1f} GB/s "
              "(plain read of its fp32 weights)")
        agreement = "greedy_prefix_same" in q["formats"][0]
        print("| weights | quantize s | MB read per token | floor ms | Linear layers ms | decode ms/token "
              "| tok/s | x floor | vs fp32 |" + (" greedy tokens = fp32 (leading / all) |" if agreement else ""))
        print("|---|---|---|---|---|---|---|---|---|" + ("---|" if agreement else ""))
        fp32_ms = q["formats"][0]["decode_ms_per_token"]
        for f in q["formats"]:
            same = (f" {f['greedy_prefix_same']} / {f['greedy_positions_same']} of {q['tokens']} |"
                    if agreement else "")
            print(f"| {f['format']} | {f['quantize_s']:.2f} | {f['weight_bytes'] / 1e6:.1f} | {f['floor_ms']:.2f} | "
                  f"{f['linears_ms']:.2f} | {f['decode_ms_per_token']:.2f} | "
                  f"{1e3 / f['decode_ms_per_token']:.1f} | {f['decode_over_floor']:.1f}x | "
                  f"{fp32_ms / f['decode_ms_per_token']:.2f}x |{same}")


def import_pyplot():
    """matplotlib, an optional extra; asked for before the run, so that a missing one is
    found in a second rather than after minutes of measuring."""


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


    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install matplotlib") from None
    return plt


def plot(r, path, plt):
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
    # the Software text chunk marks the PNG as ours (cli.check_output_path)
    write_atomically(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110,
                                                   metadata={"Software": f"{MARK} benchmark.py"}))


def int_list(text):
    return sorted({positive_int(x) for x in text.split(",")})


def check_run_is_possible(args, parser):
    """Refuse flags that make an empty or impossible run in one line, before the run: every
    generated length must fit in the shape's context after the prompt (the default
    lengths are cut to the ones that fit), the decode rate needs two tokens (the first
    one includes the prefill), and a negative naive check means nothing."""
    block = SHAPES[args.shape].block_size
    if args.prompt_tokens >= block:
        parser.error(f"--prompt-tokens {args.prompt_tokens}: leaves no room to generate in the "
                     f"{args.shape} shape's context of {block}")
    if args.lengths:
        too_long = [n for n in args.lengths if args.prompt_tokens + n > block]
        if too_long:
            parser.error(f"--lengths: {too_long[0]} does not fit: {args.prompt_tokens} prompt tokens + "
                         f"{too_long[0]} > the {args.shape} shape's context of {block}")
    else:
        defaults = [4, 32, 64, 128, 224] if args.quick else [4, 32, 64, 128, 256, 512, 1000]
        args.lengths = [n for n in defaults if args.prompt_tokens + n <= block]
    if args.demo_tokens < 2:
        parser.error("--demo-tokens: must be >= 2 (the decode rate leaves out the first token, "
                     "which includes the prefill)")
    if args.naive_check < 0:
        parser.error(f"--naive-check: must be >= 0 (0: none), got {args.naive_check}")


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
    p.add_argument("--no-peer", action="store_true",
                   help="skip the peers (transformers and llama.cpp on identical weights)")
    p.add_argument("--no-quantization", action="store_true",
                   help="skip the weight formats table (fp32, bf16, int8, int4)")
    p.add_argument("--compile", action="store_true",
                   help="also time decoding with torch.compile (compiles for minutes on a CPU)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", metavar="PATH", help="write the cost curves as a PNG (needs matplotlib)")
    args = p.parse_args()
    args.shape = args.shape or ("tiny" if args.quick else "gpt2")
    reps = args.reps or (1 if args.quick else 3)
    args.kv_position = args.kv_position or (200 if args.quick else 1000)
    if args.naive_check is None:
        args.naive_check = 32 if args.quick else 128
    check_run_is_possible(args, p)

    # outputs are checked before the run: a bad path must not cost minutes of measuring
    if args.json is not None:  # "" (an unset variable) is refused, not taken for "no --json"
        check_output_path(args.json, "json")
    if args.plot is not None:
        check_output_path(args.plot, "png")
        plt = import_pyplot()

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
    r.update(peers(args, model, device, reps))
    if not args.no_quantization:
        r["quantization"] = quantization(args, model, tokenizer, device, reps)
    r["kv_dtypes"] = kv_dtype_latency(args, device, reps)
    if args.no_peer:
        r["quantized_peer"] = {"note": "skipped (--no-peer)"}
    else:
        if args.quick:
            args.kv_peer_chars = min(args.kv_peer_chars, 3000)
        r["quantized_peer"] = quantized_peer(args, model, tokenizer, device, reps)
    r["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print_report(r)
    if "quantization" in r:
        print_quantization(r["quantization"], r["floor"])
    if args.json:
        write_atomically(args.json, json_text(r, generator="benchmark.py", indent=1))
    if args.plot:
        plot(r, args.plot, plt)


if __name__ == "__main__":
    run(main)
