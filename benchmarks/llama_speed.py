"""
Decode speed of a Llama-3.2-1B-shaped model beside llama.cpp on identical weights: ours in
fp32 against llama.cpp f32, ours with --quantize int8 against q8_0 and int4 against q4_0.

    python -m benchmarks.llama_speed              # 4-15 minutes on 2 cores; up to 22.5 GB of memory
    python -m benchmarks.llama_speed --shape tiny # the same table on a tiny shape (seconds)
    python benchmark.py --llama-speed             # the same table as a section of the whole run

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
difference between two is how far each gets from its floor (our int8/int4 Linear casts to
bfloat16 around torch's CPU kernels; llama.cpp's kernels read its blocks directly).
"""

from plumbing.script import begin, run

if __name__ == "__main__":  # run as a command; importing this file changes nothing
    begin()  # before torch: Ctrl-C during the slow imports ends quietly (plumbing/script.py)

import torch  # noqa: E402

from base_model import store_linears_column_major  # noqa: E402
from benchmarks.cache_cost import bandwidth_floor  # noqa: E402
from benchmarks.decode_speed import decode_speed  # noqa: E402
from benchmarks.peers import llama_cpp_missing  # noqa: E402
from benchmarks.report import print_decode_speed  # noqa: E402
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
CONTESTANTS = ("ours fp32 eager", "ours int8", "ours int4")
LLAMA_OUTTYPES = ("f32", "q8_0", "q4_0")


def random_llama(config, device="cpu", seed=0):
    """A KVCacheLlama of random weights (llama.Llama's initialisation), its Linear weights
    column-major as every command keeps them, but not packed for oneDNN as the commands
    also do (generation/cpu_layout.py): that second copy, 4.9 GB at this shape, would not
    fit in 24 GB beside the other contestants (the run peaks at 22.5 GB without it)."""
    torch.manual_seed(seed)
    return store_linears_column_major(KVCacheLlama(config).to(device).eval())


def llama_speed(shape, n, reps, device):
    """decode_speed's table for a random model of SHAPES[shape]: ours in fp32, int8 and int4
    beside llama.cpp f32, q8_0 and q4_0, and the ratio of each pair."""
    model = random_llama(SHAPES[shape], device)
    label = f"{shape} shape"
    llama_note = (llama_cpp_missing() if device.type == "cpu" else
                  f"llama.cpp skipped: this llama.cpp build runs on the CPU, the benchmark on {device.type}")
    result = decode_speed({label: model}, n, reps, {label: bandwidth_floor(model, reps)},
                          compile_note="compiled row left out here (a long compile at this size)",
                          llama_cpp_note=llama_note, contestants=CONTESTANTS,
                          llama_outtypes=LLAMA_OUTTYPES)
    result["pairs"] = result["models"][0]["pairs"]
    return result


def main():
    p = ArgumentParser(description="Decode speed of a Llama-3.2-1B-shaped random model, ours "
                       "beside llama.cpp on identical weights (see the module docstring).")
    p.add_argument("--shape", choices=list(SHAPES), default="llama-3.2-1b",
                   help="the model's shape (default: llama-3.2-1b; tiny: seconds, for a check)")
    add_benchmark_args(p, tokens=32)
    args = p.parse_args()
    if args.json is not None:
        check_output_path(args.json, "json")
    result = llama_speed(args.shape, args.tokens, args.reps, torch.device("cpu"))
    publish_result(result, "benchmarks.llama_speed", print_decode_speed, args.json)


if __name__ == "__main__":
    run(main)
