"""
What the KV cache buys, measured: speed with and without it, how cost grows with length,
how close decoding comes to the memory-bandwidth floor, how fast each form of our decode
runs next to llama.cpp on identical weights, and more peers.

    python benchmark.py --quick                # a few minutes
    python benchmark.py --json out/bench.json --plot out/bench.png
    python benchmark.py --llama-speed          # adds a Llama-3.2-1B shape beside llama.cpp
    python benchmark.py --ckpt checkpoints/shakespeare-llama/ckpt.pt --context-policies

This file is the command line: its flags, the checks before a run, the sections in
order, and the outputs. Each section is a module of benchmarks/ (its __init__ lists them).
"""

import argparse
import platform
import resource
import sys
from datetime import date
from pathlib import Path

from plumbing.script import begin, run

if __name__ == "__main__":  # run as a command; importing this file changes nothing
    begin()  # before torch: Ctrl-C during the slow imports ends quietly (plumbing/script.py)

import torch  # noqa: E402

from benchmarks.batching import batch_throughput  # noqa: E402
from benchmarks.cache_cost import (SHAPES, bandwidth_floor, cost_curves, decode_vs_floor,  # noqa: E402
                                   floor_section, random_model, seed_demo)
from benchmarks.context_policy import HELDOUT, context_policies, print_context_policies  # noqa: E402
from benchmarks.decode_speed import REFERENCE, decode_speed  # noqa: E402
from benchmarks.kv_dtypes import kv_dtype_latency, quantized_peer  # noqa: E402
from benchmarks.llama_speed import llama_speed  # noqa: E402
from benchmarks.peers import llama_cpp_missing, transformers_table  # noqa: E402
from benchmarks.report import plot, print_decode_speed, print_prefill, print_report  # noqa: E402
from benchmarks import speculative  # noqa: E402
from benchmarks.weight_formats import kernel_timings  # noqa: E402
from kv_cache import CACHED_MODELS  # noqa: E402
from plumbing.checkpoint import ROOT  # noqa: E402
from plumbing.cli import ArgumentParser, add_model_args, load_from_args, positive_int, positive_int_list  # noqa: E402
from plumbing.outputs import check_output_path, import_pyplot, json_text, write_atomically  # noqa: E402

NO_PEER = "skipped (--no-peer)"


def check_run_is_possible(args, parser):
    """Refuse flags that make an empty or impossible run in one line, before the run: every
    generated length must fit in the shape's context after the prompt (the default
    lengths are cut to the ones that fit), the decode rate needs two tokens (the first
    one includes the prefill), and a negative naive check means nothing."""
    block = SHAPES[args.shape].context_len
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
    if args.compile and args.no_compile:
        parser.error("--compile and --no-compile: choose one")


def parse_args():
    p = ArgumentParser(description="Measure what the KV cache buys (see the module docstring).")
    add_model_args(p)
    p.add_argument("--quick", action="store_true", help="small shapes, one run each, no compiled "
                   "decode: a few minutes")
    p.add_argument("--shape", choices=list(SHAPES), help="random-weight shape for the curves, "
                   "the floor and the decode-speed table (default: gpt2, or tiny with --quick)")
    p.add_argument("--lengths", type=positive_int_list, help="generated lengths, comma-separated "
                   "(default: 4,32,64,128,256,512,1000; with --quick 4,32,64,128,224)")
    p.add_argument("--prompt-tokens", type=positive_int, default=16, help="default: 16")
    p.add_argument("--demo-tokens", type=positive_int, default=200, help="new tokens in the "
                   "seed's demo, the decode-speed table and the transformers peer (default: 200)")
    p.add_argument("--reps", type=positive_int, help="timed runs after a warm-up (default: 3, quick 1)")
    p.add_argument("--naive-check", type=int, default=None,
                   help="also measure one real naive run of this length (default: 128, quick 32; 0: none)")
    p.add_argument("--batch-sizes", type=positive_int_list, help="numbers of different prompts decoded "
                   "together (default: 1,2,4,8,16,32; with --quick 1,4,16)")
    p.add_argument("--batch-tokens", type=positive_int, default=64,
                   help="new tokens per row in the batch table (default: 64)")
    p.add_argument("--kv-position", type=positive_int, help="context length at which each cache "
                   "dtype's decode step is timed (default: 1000, quick 200; capped by the shape's context)")
    p.add_argument("--kv-batch-sizes", type=positive_int_list, default=[1, 16],
                   help="batch sizes for the cache-dtype table (default: 1,16)")
    p.add_argument("--kv-peer-chars", type=positive_int, default=24000, help="characters of the "
                   "held-out text scored in the quantized-cache peer (default: 24000; quick 3000)")
    p.add_argument("--kv-peer-text", type=Path, default=ROOT / "checkpoints" / "shakespeare" / "heldout.txt",
                   help="text for the quantized-cache peer (default: the bundled held-out plays)")
    p.add_argument("--no-peer", action="store_true", help="skip the peers (transformers, "
                   "llama.cpp's rows in the decode-speed table, the quantized-cache peer)")
    p.add_argument("--no-quantization", action="store_true", help="skip weight-only quantization: "
                   "the kernels table and the int8/int4 rows of the decode-speed table")
    compile_help = "the decode-speed table's compiled row, which compiles C++ for tens of seconds per model"
    p.add_argument("--compile", action="store_true", help=f"with --quick: include {compile_help}")
    p.add_argument("--no-compile", action="store_true", help=f"leave out {compile_help} "
                   "(it is in by default, without --quick)")
    p.add_argument("--llama-speed", action="store_true", help="add the Llama-3.2-1B-shaped model's "
                   "decode speed beside llama.cpp f32, q8_0 and q4_0 (4-15 minutes, up to 22.5 GB; "
                   "python -m benchmarks.llama_speed runs it alone)")
    p.add_argument("--context-policies", action="store_true", help="add both context policies "
                   "(reprefill, sinks) on the held-out text, 4x the checkpoint's context "
                   "(python -m benchmarks.context_policy runs it alone)")
    p.add_argument("--no-speculative", action="store_true", help="skip speculative decoding "
                   "(prompt lookup and the draft model, with their peers: several minutes)")
    speculative.add_arguments(p)
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", metavar="PATH", help="write the cost curves as a PNG (needs matplotlib)")
    args = p.parse_args()
    args.shape = args.shape or ("tiny" if args.quick else "gpt2")
    args.reps = args.reps or (1 if args.quick else 3)
    args.kv_position = args.kv_position or (200 if args.quick else 1000)
    if args.quick:
        args.kv_peer_chars = min(args.kv_peer_chars, 3000)
    if args.naive_check is None:
        args.naive_check = 32 if args.quick else 128
    speculative.fill_defaults(args)
    check_run_is_possible(args, p)
    return args


def fp32_checkpoint(args, model):
    """The checkpoint in fp32 and unquantized, whatever --dtype/--quantize loaded: the
    decode-speed table makes each form from it, and exports it for llama.cpp."""
    if model.lm_head.weight.dtype == torch.float32 and args.quantize == "none":
        return model
    fp32_args = argparse.Namespace(**{**vars(args), "dtype": "float32", "quantize": "none",
                                      "group_size": None})
    return load_from_args(CACHED_MODELS, fp32_args)[0]


def decode_speed_section(args, model, shape_model, floor, device):
    """The decode-speed table on the checkpoint and the shape, with the reasons for any
    contestant left out."""
    if args.no_compile:
        compile_note = "compiled row skipped (--no-compile)"
    elif args.quick and not args.compile:
        compile_note = "compiled row skipped with --quick: compiling C++ takes tens of seconds per model (--compile to include it)"
    else:
        compile_note = None
    if args.no_peer:
        llama_note = f"llama.cpp {NO_PEER}"
    elif device.type != "cpu":
        llama_note = (f"llama.cpp skipped: this llama.cpp build runs on the CPU, the benchmark "
                      f"on {device.type}; use --device cpu")
    else:
        llama_note = llama_cpp_missing()
    checkpoint = fp32_checkpoint(args, model)
    models = {"checkpoint": checkpoint, f"{args.shape} shape": shape_model}
    floors = {"checkpoint": bandwidth_floor(checkpoint, args.reps), f"{args.shape} shape": floor}
    return decode_speed(models, args.demo_tokens, args.reps, floors, compile_note, llama_note,
                        quantize=not args.no_quantization,
                        group_size=args.group_size)


def main():
    args = parse_args()
    # outputs are checked before the run: a bad path must not cost minutes of measuring
    if args.json is not None:  # "" (an unset variable) is refused, not taken for "no --json"
        check_output_path(args.json, "json")
    if args.plot is not None:
        check_output_path(args.plot, "png")
        plt = import_pyplot()

    model, tokenizer, device = load_from_args(CACHED_MODELS, args)
    # the speculative section runs last: its flags and its draft are checked now
    spec_plan = None if args.no_speculative else speculative.plan(args, model, tokenizer)
    reps, shape = args.reps, f"{args.shape} shape"
    shape_model = random_model(args.shape, device)  # random weights, shared by the sections
    r = {"date": str(date.today()), "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
         "torch": torch.__version__, "threads": torch.get_num_threads(), "device": device.type,
         "reps": reps, "checkpoint": args.ckpt or args.hf or "the default checkpoint",
         "command": " ".join(["python", *sys.argv])}
    r["seed_demo"] = seed_demo(model, args.demo_tokens, reps)
    r["cost_curves"] = cost_curves(shape_model, args.shape, args.prompt_tokens, args.lengths,
                                   args.naive_check, reps)
    r["floor"] = floor_section(shape_model, args.shape, reps)
    r["decode_speed"] = decode_speed_section(args, model, shape_model, r["floor"], device)
    eager = r["decode_speed"]["models"][1]["rows"][REFERENCE]
    r["floor"].update(decode_vs_floor(r["floor"], 1e3 / eager["tok_s"]["median"]))
    if not args.no_quantization:
        r["kernels"] = kernel_timings(shape_model, args.shape, reps)
    sizes = args.batch_sizes or ([1, 4, 16] if args.quick else [1, 2, 4, 8, 16, 32])
    r["batch"] = [batch_throughput(model, "checkpoint", sizes, args.batch_tokens, reps),
                  batch_throughput(shape_model, shape, sizes, args.batch_tokens, reps)]
    if args.no_peer:
        r.update(peer=None, peer_note=NO_PEER)
    else:  # the tiny shape always, GPT-2's too without --quick
        names = ["tiny"] if args.quick else ["tiny", "gpt2"]
        peer_models = {s: shape_model if s == args.shape else random_model(s, device) for s in names}
        r.update(transformers_table(peer_models, device, args.demo_tokens, reps))
    r["kv_dtypes"] = kv_dtype_latency(shape_model, args.shape, args.kv_position, args.kv_batch_sizes, reps)
    if args.no_peer:
        r["quantized_peer"] = {"note": NO_PEER}
    else:
        text = args.kv_peer_text.read_text(encoding="utf-8")[:args.kv_peer_chars]
        r["quantized_peer"] = quantized_peer(model, tokenizer, text, args.kv_position, reps)
    if args.context_policies:
        r["context_policies"] = context_policies(model, tokenizer, HELDOUT.read_text(encoding="utf-8"), reps=reps)
    if args.llama_speed:
        r["llama_speed"] = llama_speed("llama-3.2-1b", min(args.demo_tokens, 32), reps, device)
    if not args.no_speculative:  # on the fp32 weights, as the peers get them
        r["speculative"] = speculative.speculative_section(fp32_checkpoint(args, model), spec_plan,
                                                           args, peers=not args.no_peer)
    r["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print_report(r)
    if "context_policies" in r:
        print_context_policies(r["context_policies"], r["checkpoint"])
    if "llama_speed" in r:
        print("\n# Llama-3.2-1B shape (benchmarks/llama_speed.py)")
        print_decode_speed(r["llama_speed"])
        print_prefill(r["llama_speed"]["prefill"])
    if args.json:
        write_atomically(args.json, json_text(r, generator="benchmark.py", indent=1))
    if args.plot:
        plot(r, args.plot, plt)


if __name__ == "__main__":
    run(main)
