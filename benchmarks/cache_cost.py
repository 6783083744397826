"""
What the KV cache buys: the seed's demo (200 tokens with and without it), how the cost of
a generation grows with its length (naive, torch.cat cache, preallocated cache), and the
memory-bandwidth floor under a batch-1 decode step.
"""

import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from base_model import GPT, GPTConfig, store_linears_column_major
from benchmarks.timing import repeat, spread
from generation.cpu_layout import pack_linears
from generation.loop import Generation, synchronize
from kv_cache import KVCacheGPT
from kv_quant import cache_bytes

SHAPES = {  # random-weight models at a named shape
    "tiny": GPTConfig(context_len=256, vocab_size=4096, n_layer=6, n_head=4, n_embd=128),
    "gpt2": GPTConfig(context_len=1024, vocab_size=50257, n_layer=12, n_head=12, n_embd=768),
}
KINDS = {  # how a generation runs: naive, or the cached loop with a cache kind
    "naive": "GPT.stream: the whole context every step",
    "cat": "the cached loop, torch.cat cache (the seed's)",
    "prealloc": "the cached loop, preallocated KVCache",
}


def random_model(shape, device, seed=0):
    torch.manual_seed(seed)
    return store_linears_column_major(pack_linears(KVCacheGPT(SHAPES[shape]).to(device).eval()))


def step_times(model, kind, prompt, n):
    """Seconds from the start to each of n greedy tokens (a list of n cumulative times).
    prompt: a (B, T) tensor, or (not for the naive loop) a list of token-id lists."""
    device = model.lm_head.weight.device
    if kind == "naive":
        tokens = GPT.stream(model, prompt, n, temperature=0)
    else:  # "prealloc" is the loop's default cache
        tokens = Generation(model, prompt, n, temperature=0, cache_kind=None if kind == "prealloc" else kind)
    synchronize(device)
    t0, times = time.perf_counter(), []
    for _ in tokens:
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def tokens_per_second(model, kind, prompt, n, reps):
    return spread([n / t[-1] for t in repeat(lambda: step_times(model, kind, prompt, n), reps)])


def seed_demo(model, n, reps):
    """The seed's demo on the checkpoint: n tokens with and without the cache."""
    prompt = torch.zeros(1, 16, dtype=torch.long, device=model.lm_head.weight.device)
    naive = tokens_per_second(model, "naive", prompt, n, reps)
    cached = tokens_per_second(model, "prealloc", prompt, n, reps)
    return {"tokens": n, "naive_tok_s": naive, "cached_tok_s": cached,
            "speedup": cached["median"] / naive["median"]}


# ---------------------------------------------------------------------------- cost vs length

def latency_at(times, position, prompt_len, span=8):
    """Median per-token latency around a position, from cumulative step times."""
    i = max(1, min(position - prompt_len, len(times) - 1))
    lo, hi = max(1, i - span), min(len(times), i + span + 1)
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


def cost_curves(model, shape, prompt_tokens, lengths, naive_check, reps):
    """Total time and per-token latency vs generated length, for the three kinds. Every
    length fits after the prompt (benchmark.check_run_is_possible); naive_check: the
    length of one real naive run (0: none)."""
    prompt = torch.zeros(1, prompt_tokens, dtype=torch.long, device=model.lm_head.weight.device)
    longest = max(lengths)
    curves = {}
    for kind in ("cat", "prealloc"):
        runs = repeat(lambda: step_times(model, kind, prompt, longest), reps)
        curves[kind] = {
            "total_s": {n: spread([r[n - 1] for r in runs]) for n in lengths},
            "latency_ms": {n: 1e3 * statistics.median(latency_at(r, prompt_tokens + n, prompt_tokens)
                                                     for r in runs) for n in lengths},
        }
    # A naive step re-runs the whole context, so its cost grows with the context length t:
    # time single steps at a few lengths, interpolate between them, and add the steps up
    # (a measured naive run to 1000 tokens at GPT-2 size would take most of an hour).
    contexts = [prompt_tokens + n for n in lengths]
    latency = [naive_latency(model, t, reps) for t in contexts]

    def naive_total(n):
        steps = np.arange(prompt_tokens + 1, prompt_tokens + n + 1)
        return float(np.interp(steps, contexts, latency).sum())
    totals = {n: {"median": naive_total(n), "estimated": True} for n in lengths}
    if naive_check:  # one real naive run, to show that the estimate is sound
        n = min(naive_check, longest)
        totals[n] = {"median": step_times(model, "naive", prompt, n)[-1], "estimated": False,
                     "estimate_was": naive_total(n)}
    curves["naive"] = {"total_s": totals, "latency_ms": {n: 1e3 * t for n, t in zip(lengths, latency)}}
    return {"shape": shape, "prompt_tokens": prompt_tokens, "lengths": lengths, "curves": curves}


# ---------------------------------------------------------------------------- the floor

@torch.inference_mode()
def bandwidth_floor(model, reps):
    """The fastest a batch-1 step can be: every weight matrix read once by a
    matrix-vector product (torch's own kernels), and by a plain streaming read."""
    # embedding tables are left out (a step reads one row of each: wpe, an untied Llama's
    # token table), but not one tied to lm_head, which reads all of it
    lookups = {id(m.weight) for m in model.modules()
               if isinstance(m, torch.nn.Embedding) and m.weight is not model.lm_head.weight}
    weights = [p for p in model.parameters() if p.dim() == 2 and id(p) not in lookups]
    nbytes = sum(w.nbytes for w in weights)
    vectors = {w.size(1): torch.randn(1, w.size(1), device=w.device, dtype=w.dtype) for w in weights}

    def timed(op, weights=weights):
        def once():
            synchronize(weights[0].device)
            t0 = time.perf_counter()
            for w in weights:
                op(w)
            synchronize(weights[0].device)
            return time.perf_counter() - t0
        return min(repeat(once, reps))  # a floor: the best run is the one that counts

    def matvec_op(w):
        return F.linear(vectors[w.size(1)], w)
    matvec = timed(matvec_op)
    read = timed(lambda w: w.sum())
    # the same product with nn.Linear's default row-major weights, for comparison: our
    # model keeps them column-major (base_model.store_linears_column_major). One copy at a
    # time: all at once would be a second copy of the model (4 GB at the 1B shape)
    matvec_row_major = sum(timed(matvec_op, [w.contiguous()]) for w in weights)
    return {"weight_bytes": nbytes, "matvec_ms": 1e3 * matvec, "matvec_GBps": nbytes / matvec / 1e9,
            "matvec_row_major_ms": 1e3 * matvec_row_major,
            "read_ms": 1e3 * read, "read_GBps": nbytes / read / 1e9}


def floor_section(model, shape, reps):
    """The floor for a model of this shape, and its KV cache for a full context by the
    formula and as allocated. Our decode speed against it comes from the decode-speed
    table (decode_speed.py), which times every contestant on the same model."""
    c = model.config
    return {"shape": shape, **bandwidth_floor(model, reps),
            "cache_bytes_formula": cache_bytes(c, c.context_len),
            "cache_bytes_real": model.new_cache(1).nbytes()}


def decode_vs_floor(floor, decode_ms_per_token):
    """Our decode time per token against the floor's two matrix-vector times."""
    return {"decode_ms_per_token": decode_ms_per_token,
            "decode_over_floor": decode_ms_per_token / floor["matvec_ms"],
            "decode_over_row_major_floor": decode_ms_per_token / floor["matvec_row_major_ms"]}
