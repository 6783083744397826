"""
Decode and prefill speed of a Llama-3.2-1B-shaped model beside llama.cpp on identical
weights: ours in fp32 against llama.cpp f32, bf16 against bf16, --quantize int8 against
q8_0 and int4 against q4_0; decode through llama.cpp's Python binding (greedy tokens
compared) and, where it is built, its own llama-bench (tg, and pp for the prefill table).

    python -m benchmarks.llama_speed              # 10-40 minutes on 2 cores; up to 22.5 GB of memory
    python -m benchmarks.llama_speed --shape tiny # the same tables on a tiny shape (seconds)
    python -m benchmarks.llama_speed --prefill 128 512 --forms fp32 int8 int4
    python -m benchmarks.llama_speed --compiled   # and the compiled step of bf16, int8, int4
    python benchmark.py --llama-speed             # the decode table as a section of the whole run

The model has random weights in Llama 3.2 1B's shape: 16 blocks 2048 wide, 32 query heads
over 8 key/value heads of 64 (grouped-query attention), SwiGLU 8192 wide, 128,256 tokens with
the output layer tied to the embedding, rope_theta 500,000 with Llama 3's rope scaling; its
context is cut to 2048 positions (the cache is preallocated for the context: 64 KiB a
token in fp32, so 131,072 positions would be 8 GiB of cache for nothing). llama.cpp reads
the same weights from GGUF files that export_gguf.py writes (its 'llama' architecture; the
scaling as its rope_freqs tensor), prompted with the same 16 token ids. The table is decode_speed.py's: tok/s of the
whole generation, each form against the floor its bytes set, greedy agreement with ours fp32.

What limits it: at batch 1 a step reads every weight once (4.9 GB in fp32 with the
tied 1 GB table read by the output layer, 1.4 GB in int8, 0.9 GB in int4 plus the exact
table the lookup keeps), so each contestant is bound by memory bandwidth, and the
difference between two is how far each gets from its floor. A prefill is bound by
arithmetic instead (benchmarks/prefill_speed.py): its rows say the GFLOP/s each form
reached against torch's matrix product in its dtype, measured in the same run.
"""

from plumbing.script import begin, run

if __name__ == "__main__":  # run as a command; importing this file changes nothing
    begin()  # before torch: Ctrl-C during the slow imports ends quietly (plumbing/script.py)

import torch  # noqa: E402

from base_model import store_linears_column_major  # noqa: E402
from benchmarks.cache_cost import bandwidth_floor  # noqa: E402
from benchmarks.decode_speed import decode_speed  # noqa: E402
from benchmarks.llama_bench import llama_bench_missing, llama_bench_rows  # noqa: E402
from benchmarks.prefill_speed import FORMS, matmul_peak, prefill_rows  # noqa: E402
from benchmarks.peers import llama_cpp_missing  # noqa: E402
from benchmarks.report import print_decode_speed, print_prefill  # noqa: E402
from generation.cpu_layout import DENSE_MIN_WEIGHTS, pack_linears  # noqa: E402
from kv_cache import KVCacheLlama  # noqa: E402
from llama import LlamaConfig  # noqa: E402
from plumbing.cli import ArgumentParser, add_benchmark_args  # noqa: E402
from plumbing.outputs import check_output_path, publish_result  # noqa: E402

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
SHAPES = {
    "llama-3.2-1b": LlamaConfig(context_len=2048, vocab_size=128256, n_layer=16, n_head=32, n_kv_head=8,
                                n_embd=2048, intermediate_size=8192, rope_theta=500000.0,
                                rope_scaling=LLAMA3_SCALING, tie_embeddings=True),
    "tiny": LlamaConfig(context_len=256, vocab_size=4096, n_layer=4, n_head=8, n_kv_head=2,
                        n_embd=256, intermediate_size=704, rope_theta=500000.0,
                        rope_scaling=LLAMA3_SCALING, tie_embeddings=True),
}
LLAMA_OUTTYPES = ("f32", "q8_0", "q4_0")  # through the binding (bf16 is llama-bench's)
BENCH_OUTTYPES = {"fp32": "f32", "bf16": "bf16", "bf16-torch": "bf16", "int8": "q8_0",  # ours: llama-bench's
                  "int4": "q4_0"}
PREFILL_LENGTHS = (128, 512, 2048)
# The shape stands for a bf16 checkpoint (the real models of this size are published in
# bf16), which --quantize keeps in bf16 around the quantized products (checkpoint.auto_dtype):
# so do the int8 and int4 rows here, quantized from the bf16 row's weights
QUANTIZED_DTYPE = torch.bfloat16
# the compiled step of each form whose step reads the model's own weights (not fp32's, a
# frozen copy: a second 4.9 GB at this shape); built once per machine (~30-50 s each), cached
COMPILED = {"bf16": "ours bf16 compiled", "int8": "ours int8 compiled", "int4": "ours int4 compiled"}


def random_llama(config, device="cpu", seed=0):
    """A KVCacheLlama of random weights (llama.Llama's initialisation) in the CPU layout the
    commands give it (cpu_layout.pack_linears: the large weights multiplied where they lie,
    by our kernel and oneDNN's GEMM), but for the k and v projections (512 x 2048 at the 1B
    shape, 3% of the bytes): the commands pack those for oneDNN, whose Parameter then holds
    nothing, and the other forms are converted from these Parameters; they stay column-major
    (base_model.store_linears_column_major, MKL's), as every command keeps a weight too small
    to pack."""
    torch.manual_seed(seed)
    model = pack_linears(KVCacheLlama(config).to(device).eval(), min_weights=DENSE_MIN_WEIGHTS)  # none packed
    return store_linears_column_major(model)


def llama_speed(shape, n, reps, device, prefill_lengths=PREFILL_LENGTHS, forms=tuple(FORMS), compiled=False):
    """decode_speed's table for a random model of SHAPES[shape]: ours in fp32, bf16, int8 and
    int4 beside llama.cpp f32, q8_0 and q4_0, and the ratio of each pair; then each form's
    prefill at prefill_lengths, and llama-bench's pp and tg where it is built. forms: which
    of ours run (FORMS' names), in both tables; compiled: each of those forms' compiled
    step too (COMPILED), in the decode tables."""
    model = random_llama(SHAPES[shape], device)
    label = f"{shape} shape"
    llama_note = (llama_cpp_missing() if device.type == "cpu" else
                  f"llama.cpp skipped: this llama.cpp build runs on the CPU, the benchmark on {device.type}")
    contestants = [FORMS[f] for f in forms] + [COMPILED[f] for f in forms if compiled and f in COMPILED]
    result = decode_speed({label: model}, n, reps, {label: bandwidth_floor(model, reps)},
                          compile_note=None if compiled else "compiled rows left out (--compiled adds them)",
                          llama_cpp_note=llama_note, contestants=contestants,
                          llama_outtypes=LLAMA_OUTTYPES, quantized_dtype=QUANTIZED_DTYPE)
    result["pairs"] = result["models"][0]["pairs"]
    floor = result["models"][0]["read_GBps"]
    result["prefill"] = prefill_section(model, label, n, reps, prefill_lengths, forms, floor)
    rows = result["models"][0]["rows"]
    decode = {}  # llama-bench's format: [(ours' row, its decode)] in it, eager before compiled
    for form in forms:
        for name in (FORMS[form], COMPILED.get(form)):
            if name in rows:
                decode.setdefault(f"llama.cpp {BENCH_OUTTYPES[form]}", []).append((name, rows[name]["decode_tok_s"]))
    result["prefill"]["ours_decode"] = decode
    return result


def prefill_section(model, label, n, reps, lengths, forms, read_GBps):
    """Ours' prefill rows, the machine's matmul peaks, and llama-bench's pp/tg (or why not)."""
    note = llama_bench_missing()
    outtypes = list(dict.fromkeys(BENCH_OUTTYPES[f] for f in forms))  # bf16 and bf16-torch: bf16 once
    bench = {} if note else llama_bench_rows(model, label, outtypes, lengths, n, reps)
    for row in bench.values():  # its decode against the same floor as ours'
        row["floor_ms"] = row["weight_bytes"] / read_GBps / 1e6
    return {"lengths": list(lengths), "ours": prefill_rows(model, forms, lengths, reps,
                                                           quantized_dtype=QUANTIZED_DTYPE),
            "peak_GFLOPs": {"fp32": matmul_peak(model, torch.float32, reps),
                            "bf16": matmul_peak(model, torch.bfloat16, reps)},
            "llama_bench": bench, "llama_bench_note": note, "pairs": BENCH_OUTTYPES}


def main():
    p = ArgumentParser(description="Decode speed of a Llama-3.2-1B-shaped random model, ours "
                       "beside llama.cpp on identical weights (see the module docstring).")
    p.add_argument("--shape", choices=list(SHAPES), default="llama-3.2-1b",
                   help="the model's shape (default: llama-3.2-1b; tiny: seconds, for a check)")
    add_benchmark_args(p, tokens=32)
    p.add_argument("--prefill", type=int, nargs="+", default=list(PREFILL_LENGTHS), metavar="T",
                   help="prompt lengths of the prefill table (default: 128 512 2048)")
    p.add_argument("--forms", nargs="+", choices=list(FORMS), default=list(FORMS),
                   help="ours' forms in both tables (default: all; bf16 and bf16-torch, the same "
                        "weights multiplied by torch's F.linear, 2.5 GB each at the 1B shape)")
    p.add_argument("--compiled", action="store_true",
                   help="also the compiled decode step (--compile) of bf16, int8 and int4 among "
                        "--forms, on the same weights (a build of 30-50 s each, once per machine)")
    args = p.parse_args()
    if args.json is not None:
        check_output_path(args.json, "json")
    context = SHAPES[args.shape].context_len
    if not all(0 < T <= context for T in args.prefill):
        p.error(f"--prefill lengths must be from 1 to the shape's context, {context}")
    result = llama_speed(args.shape, args.tokens, args.reps, torch.device("cpu"), args.prefill, args.forms,
                         args.compiled)
    publish_result(result, "benchmarks.llama_speed", print_llama_speed, args.json)


def print_llama_speed(result):
    print_decode_speed(result)
    print_prefill(result["prefill"])


if __name__ == "__main__":
    run(main)
