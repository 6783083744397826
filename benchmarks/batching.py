"""
Many different prompts decoded as one batch: how the aggregate speed grows with the
number of rows while every step still reads the weights once.
"""

import torch

from benchmarks.cache_cost import step_times
from benchmarks.timing import repeat, spread
from kv_quant import cache_bytes, dtype_name


def batch_throughput(model, name, sizes, new_tokens, reps):
    """Aggregate decode speed when `b` different prompts (lengths 8..64, seeded) decode as
    one batch. A batch-1 step reads every weight to make one token; a batch-b step reads
    them once to make b, so until the matmuls become compute-bound the aggregate speed
    grows almost b-fold. Decode time excludes the first token (it includes the prefill)."""
    g = torch.Generator().manual_seed(0)
    vocab, c = model.config.vocab_size, model.config
    rows = {}
    for b in sizes:
        # (at most half the context, for a model whose context is short)
        lengths = torch.randint(8, min(65, c.context_len // 2 + 1), (b,), generator=g).tolist()
        prompts = [torch.randint(vocab, (n,), generator=g).tolist() for n in lengths]
        n = min(new_tokens, c.context_len - max(lengths))  # no reprefill inside the measurement

        def step_seconds():
            times = step_times(model, "prealloc", prompts, n)
            return (times[-1] - times[0]) / (n - 1)
        steps = repeat(step_seconds, reps)
        kv_dtype = dtype_name(model.lm_head.weight.dtype)
        rows[b] = {"new_tokens": n, "step_ms": spread([1e3 * t for t in steps]),
                   "tok_s": spread([b / t for t in steps]),
                   "cache_bytes_formula": cache_bytes(c, max(lengths) + n, b, kv_dtype),
                   "cache_bytes_allocated": model.new_cache(b).nbytes()}
    for row in rows.values():
        row["vs_batch_1"] = row["tok_s"]["median"] / rows[min(rows)]["tok_s"]["median"]
    return {"model": name, "sizes": rows}
