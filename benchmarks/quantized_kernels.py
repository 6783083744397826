"""
The quantized matrix-vector products alone, at the shapes of real models: torch's CPU
kernels (torch._weight_int8pack_mm, aten._weight_int4pack_mm_for_cpu, fed bf16, what
weight_quant.py falls back to) beside ours (generation/quantized_matmul.cpp), and the same
for dense weights (generation/dense_matmul.cpp beside torch's F.linear: oneDNN's for bf16
weights and x, MKL's for fp32, and oneDNN's packed fp32 layout), on 1 and 2 threads, each
against the memory's speed measured in the same run (a plain sum of 1 GiB).

    python -m benchmarks.quantized_kernels                  # the 1B and 8B shapes, ~2 minutes
    python -m benchmarks.quantized_kernels --rows 1 4       # and 4 rows (a small batch)

A product at one row reads each weight once for one multiply-add, so its floor is its bytes
over the bandwidth; the "x floor" columns say how far each kernel is from it.
"""

from plumbing.script import begin, run

if __name__ == "__main__":  # run as a command; importing this file changes nothing
    begin()  # before torch: Ctrl-C during the slow imports ends quietly (plumbing/script.py)

import copy  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from generation import dense_matmul, quantized_matmul  # noqa: E402
from generation.cpu_layout import PackedLinear  # noqa: E402
from generation.dense_matmul import DenseLinear  # noqa: E402
from plumbing.cli import ArgumentParser, positive_int  # noqa: E402
from plumbing.outputs import check_output_path, publish_result  # noqa: E402
from weight_quant import Int4Linear, Int8Linear  # noqa: E402

SHAPES = {  # (out, in) of each distinct Linear: attention's, the MLP's two, the output layer
    "llama-3.2-1b": [(2048, 2048), (512, 2048), (8192, 2048), (2048, 8192), (128256, 2048)],
    "llama-3-8b": [(4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096)],
}
KERNELS = {  # name: how its Linear is made (each casts fp32 x to what its kernel takes)
    "int8 torch": (lambda lin: Int8Linear(lin, kernel="torch")),
    "int8 ours": (lambda lin: Int8Linear(lin, kernel="ours")),
    "int4 torch": (lambda lin: Int4Linear(lin, 64, kernel="torch")),
    "int4 ours": (lambda lin: Int4Linear(lin, 64, kernel="ours")),
    # bf16 weights, not quantized, fed bf16 x as a bf16 model's are: F.linear, and ours
    "bf16 torch": (lambda lin: copy.deepcopy(lin).bfloat16()),
    "bf16 ours": (lambda lin: DenseLinear(copy.deepcopy(lin).bfloat16())),
    # fp32 weights: F.linear (MKL), oneDNN's packed copy (a small model's Linears), and
    # DenseLinear (a real-size model's: ours up to its rows, oneDNN's over the dense weight past them)
    "fp32 torch": (lambda lin: copy.deepcopy(lin)),
    "fp32 packed": (lambda lin: PackedLinear(copy.deepcopy(lin))),
    "fp32 ours": (lambda lin: DenseLinear(copy.deepcopy(lin))),
}
RATIOS = ("int8", "int4", "bf16", "fp32")  # the "torch / ours" columns: torch's time over ours


def best_seconds(fn, reps):
    fn()  # a warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)  # the floor is what counts: the best run had the least interference


def read_GBps(reps, nbytes=2 ** 30):
    data = torch.ones(nbytes // 8, dtype=torch.int64)
    return nbytes / best_seconds(data.sum, reps) / 1e9


@torch.inference_mode()
def shape_rows(out_features, in_features, rows, reps, bandwidth):
    """{kernel: {"ms", "GBps", "x_floor"}} for one weight shape at `rows` rows of x."""
    linear = nn.Linear(in_features, out_features, bias=False)
    x = torch.randn(rows, in_features)
    result = {}
    for name, build in KERNELS.items():
        layer = build(linear)
        x_in = x.to(layer.weight.dtype) if isinstance(layer, nn.Linear) else x  # bf16 for bf16 weights
        seconds = best_seconds(lambda: layer(x_in), reps)
        nbytes = layer.weight.nbytes if isinstance(layer, nn.Linear) else layer.weight_nbytes()
        result[name] = {"ms": 1e3 * seconds, "GBps": nbytes / seconds / 1e9,
                        "x_floor": seconds / (nbytes / bandwidth / 1e9)}
        del layer
    return result


def quantized_kernels(shapes, threads, rows, reps):
    table = []
    for n_threads in threads:
        torch.set_num_threads(n_threads)
        bandwidth = read_GBps(reps)
        for shape in shapes:
            for out_features, in_features in SHAPES[shape]:
                for n_rows in rows:
                    table.append({"shape": shape, "threads": n_threads, "rows": n_rows, "read_GBps": bandwidth,
                                  "weight": f"{out_features}x{in_features}",
                                  "kernels": shape_rows(out_features, in_features, n_rows, reps, bandwidth)})
    return {"isa": quantized_matmul.best_isa(), "bf16_isa": dense_matmul.best_isa(),
            "fp32_isa": dense_matmul.best_isa(torch.float32), "table": table}


def print_table(r):
    print(f"\n## Quantized and dense products alone: ms [GB/s of weights, x the read floor]; ours in "
          f"{r['isa']} (bf16: {r['bf16_isa']}, fp32: {r['fp32_isa']})")
    names = list(KERNELS)
    print("| shape | weight (out x in) | threads | rows | read GB/s | " + " | ".join(names)
          + "".join(f" | {s} torch / ours" for s in RATIOS) + " |")
    print("|---|---|---|---|---|" + "---|" * (len(names) + len(RATIOS)))
    for row in r["table"]:
        k = row["kernels"]
        cells = " | ".join(f"{k[n]['ms']:.2f} [{k[n]['GBps']:.1f}, {k[n]['x_floor']:.1f}x]" for n in names)
        ratios = "".join(f" | {k[f'{s} torch']['ms'] / k[f'{s} ours']['ms']:.2f}x" for s in RATIOS)
        print(f"| {row['shape']} | {row['weight']} | {row['threads']} | {row['rows']} | "
              f"{row['read_GBps']:.1f} | {cells}{ratios} |")


def main():
    p = ArgumentParser(description="Our quantized matrix products beside torch's at real models' "
                       "shapes, against the memory's speed (see the module docstring).")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--threads", type=positive_int, nargs="+", default=[1, 2])
    p.add_argument("--rows", type=positive_int, nargs="+", default=[1], help="rows of x (default: 1)")
    p.add_argument("--reps", type=positive_int, default=5, help="timed runs after a warm-up; the best counts")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args()
    if args.json is not None:
        check_output_path(args.json, "json")
    if quantized_matmul.kernels() is None or dense_matmul.kernels() is None:
        p.error("our kernels could not be built here (see the warning above)")
    publish_result(quantized_kernels(args.shapes, args.threads, args.rows, args.reps),
                   "benchmarks.quantized_kernels", print_table, args.json)


if __name__ == "__main__":
    run(main)
