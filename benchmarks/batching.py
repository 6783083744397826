"""
Many different prompts decoded as one batch: how the aggregate speed grows with the
number of rows while every step still reads the weights once.

    python -m benchmarks.batching --shape gpt2 --sizes 1,16   # the table alone (benchmark.py has it too)

A batch-1 step is bound by the bytes of its weights; with more rows each weight is used
for more multiply-adds, and the step becomes bound by arithmetic. Each row says how close
to the machine that gets: the matmuls' FLOP/s (2 x the Linear weights x rows per step;
attention's few FLOPs left out) against the rate a large fp32 matmul reaches in the same
run (the machine's practical peak, MKL's).
"""

import time

from plumbing.script import begin, run

if __name__ == "__main__":  # run as a command; importing this file changes nothing
    begin()  # before torch: Ctrl-C during the slow imports ends quietly (plumbing/script.py)

import torch  # noqa: E402

from benchmarks.cache_cost import step_times  # noqa: E402
from benchmarks.timing import repeat, spread  # noqa: E402
from benchmarks.weight_formats import linear_layers  # noqa: E402
from kv_quant import cache_bytes, dtype_name  # noqa: E402

PEAK_SIZE = 2048  # the square matmul whose rate stands for the machine's peak


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
    flops_per_row = 2 * sum(m.in_features * m.out_features for m in linear_layers(model))
    peak = matmul_peak_gflops(model.lm_head.weight.device, reps)
    for b, row in rows.items():
        row["vs_batch_1"] = row["tok_s"]["median"] / rows[min(rows)]["tok_s"]["median"]
        row["gflop_s"] = flops_per_row * b / row["step_ms"]["median"] / 1e6
        row["of_peak"] = row["gflop_s"] / peak
    return {"model": name, "sizes": rows, "peak_gflop_s": peak, "peak_size": PEAK_SIZE}


@torch.inference_mode()
def matmul_peak_gflops(device, reps):
    """GFLOP/s of a PEAK_SIZE-square fp32 matmul (the median of reps after a warm-up): as
    fast as this machine multiplies matrices through torch."""
    a = torch.randn(PEAK_SIZE, PEAK_SIZE, device=device)

    def once():
        t0 = time.perf_counter()
        (a @ a).sum().item()  # .item(): wait for the device
        return time.perf_counter() - t0
    seconds = sorted(repeat(once, max(reps, 3)))
    return 2 * PEAK_SIZE ** 3 / seconds[len(seconds) // 2] / 1e9


def main():
    from benchmarks.cache_cost import SHAPES, random_model
    from benchmarks.report import print_batches
    from plumbing.cli import ArgumentParser, add_benchmark_args, positive_int_list
    from plumbing.outputs import check_output_path, publish_result

    p = ArgumentParser(description="Batches of different prompts decoded together: aggregate "
                       "tok/s, and the matmuls' FLOP/s against the machine's peak (see the "
                       "module docstring).")
    p.add_argument("--shape", choices=list(SHAPES), default="gpt2", help="a random model of this "
                   "shape (default: gpt2, GPT-2 small)")
    p.add_argument("--sizes", type=positive_int_list, default=[1, 16], help="batch sizes (default: 1,16)")
    add_benchmark_args(p, tokens=64, per="row")
    args = p.parse_args()
    if args.json is not None:
        check_output_path(args.json, "json")
    result = batch_throughput(random_model(args.shape, "cpu"), f"{args.shape} shape", args.sizes,
                              args.tokens, args.reps)
    publish_result(result, "benchmarks.batching", lambda r: print_batches([r]), args.json)


if __name__ == "__main__":
    run(main)
