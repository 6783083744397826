"""
The decode-speed table: ours in each of its forms next to llama.cpp on identical weights,
each against the floor that the bytes it reads set.

A batch-1 decode step reads every weight once to make one token, so its speed is bounded
by memory bandwidth (the floor: bytes of weights per token / the bandwidth of a plain read
of them) and, on a small model, by the overhead of running the step at all. The forms of
ours attack one each: compiling the step (generation/compiled_step.py) removes Python and dispatch
overhead; bf16, int8 and int4 weights (weight_quant.py) cut the bytes. llama.cpp, hand-written
C++ kernels with no Python between steps, is the yardstick, in f32 (like for like), f16,
q8_0 and q4_0 (its own 8- and 4-bit formats, beside our int8 and int4).

How it is fair: every contestant starts from the same fp32 weights (ours on its own copy;
llama.cpp's files exported from them, whatever --dtype/--quantize loaded), gets the same
16-token prompt, makes the same number of new tokens greedily with the same thread count,
and tokens per second count the whole generation, prompt included, for all. They take
turns (one of each, then again) after one warm-up each; the compile happens before the
warm-up and is never timed. Greedy agreement with ours fp32 eager (leading tokens equal)
says whether each one computes the same thing.
"""

import contextlib
import copy
import time

from plumbing.script import begin, run

if __name__ == "__main__":  # run as a command; importing this file changes nothing
    begin()  # before torch: Ctrl-C during the slow imports ends quietly (plumbing/script.py)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from benchmarks.peers import (LLAMA_OUTTYPES, PROMPT_TOKENS, leading_matches, llama_cpp_engines,  # noqa: E402
                              llama_greedy, random_prompt)
from benchmarks.timing import alternate, spread, timed  # noqa: E402
from benchmarks.weight_formats import weight_bytes_per_token  # noqa: E402
from generation.compiled_step import reads_own_weights  # noqa: E402
from generation.cpu_layout import pack_linears  # noqa: E402
from generation.dense_matmul import DenseLinear  # noqa: E402
from generation.loop import GenerationStats, synchronize  # noqa: E402
from weight_quant import INT4_GROUP_SIZES, int4_group_size, quantize_model  # noqa: E402

OURS = {  # name: (the model's dtype, weight-only quantization, compiled decode step, kernels)
    "ours fp32 eager": (torch.float32, None, False, None),
    "ours fp32 compiled": (torch.float32, None, True, None),
    "ours bf16": (torch.bfloat16, None, False, None),     # --dtype bfloat16
    "ours bf16 compiled": (torch.bfloat16, None, True, None),  # --dtype bfloat16 --compile
    # the same weights multiplied by torch's F.linear: what our bf16 kernel replaced
    "ours bf16, torch's matmul": (torch.bfloat16, None, False, "torch"),
    "ours int8": (torch.float32, "int8", False, None),    # --quantize int8
    "ours int8 compiled": (torch.float32, "int8", True, None),  # --quantize int8 --compile
    "ours int4": (torch.float32, "int4", False, None),    # --quantize int4 [--group-size]
    "ours int4 compiled": (torch.float32, "int4", True, None),  # --quantize int4 --compile
}
REFERENCE = "ours fp32 eager"  # greedy agreement is counted against its tokens
BASELINE = "llama.cpp f32"     # the ratio column divides by its tokens/s
# ours beside llama.cpp in the same format: the ratios the issues set targets for
PAIRS = (("ours fp32 compiled", "llama.cpp f32"), ("ours fp32 eager", "llama.cpp f32"),
         ("ours int8 compiled", "llama.cpp q8_0"), ("ours int8", "llama.cpp q8_0"),
         ("ours int4 compiled", "llama.cpp q4_0"), ("ours int4", "llama.cpp q4_0"))


def ours_variant(fp32_model, dtype, scheme, group_size, compile, kernels=None):
    """The fp32 model in one form: itself for fp32 eager (a 1B model's copy would be 5 GB
    more), else a copy (a compiled one keeps its graph on the copy). A quantized copy of
    the same dtype shares the fp32 model's weight matrices (deepcopy's memo): the
    quantization only reads them, and the tied table stays shared, so the copy costs its
    int8/int4 buffers alone (at the 1B shape 1-2 GB instead of 5 more). A copy in another
    dtype gets each weight matrix converted straight into it (the memo again: not a whole
    fp32 copy first), row-major as a checkpoint in that dtype loads; its bf16 Linears then
    get our kernel, as every command's do (cpu_layout.pack_linears), unless kernels is
    "torch" (torch's F.linear: the row before ours)."""
    if (dtype, scheme, compile) == (fp32_model.lm_head.weight.dtype, None, False):
        return fp32_model
    if scheme and dtype == fp32_model.lm_head.weight.dtype:
        shared = {id(p): p for p in fp32_model.parameters() if p.dim() == 2}
        return quantize_model(copy.deepcopy(fp32_model, shared), scheme, group_size)
    converted = {id(p): nn.Parameter(p.detach().to(dtype, memory_format=torch.contiguous_format),
                                     requires_grad=p.requires_grad)
                 for p in fp32_model.parameters() if p.dim() == 2}
    model = copy.deepcopy(fp32_model, converted).to(dtype)  # the rest: norms, buffers
    if scheme:
        return quantize_model(model, scheme, group_size)
    return torchs_linears(model) if kernels == "torch" else pack_linears(model)


def torchs_linears(model):
    """Every DenseLinear of model (a real-size fp32 model's, copied) made a plain nn.Linear
    over the same Parameters, in place: F.linear multiplies them. Returns the model."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, DenseLinear):
                plain = nn.Linear.__new__(nn.Linear)
                nn.Module.__init__(plain)  # not nn.Linear's: it would allocate a new weight
                plain.in_features, plain.out_features = child.in_features, child.out_features
                plain.weight = child.weight
                plain.register_parameter("bias", child.bias)
                setattr(parent, name, plain)
    return model


def compile_step(model, prompt):
    """Compile the static-shape decode step for this model and prompt before any timed run
    (compile_for keeps the build on the model; later runs reuse it)."""
    model.generate(prompt, 2, temperature=0, compile=True)


def ours_run(model, prompt, n, compile):
    """A contestant: n greedy tokens -> (their ids, seconds, the decode's seconds: after the
    prefill, what llama-bench's tg measures). stats.compile_seconds (the compile, or after
    the first run only the check that the graph is ready) is left out."""
    device = prompt.device

    def run():
        stats = GenerationStats()
        synchronize(device)
        t0 = time.perf_counter()
        out = model.generate(prompt, n, temperature=0, compile=compile, stats=stats)
        synchronize(device)
        seconds = time.perf_counter() - t0 - stats.compile_seconds
        return out[0, prompt.size(1):].tolist(), seconds, seconds - stats.prefill_seconds
    return run


def llama_run(llm, prompt, n):
    """A contestant: n greedy tokens from llama.cpp -> (their ids, seconds)."""
    ids = prompt[0].tolist()
    return lambda: timed(lambda: llama_greedy(llm, ids, n))


def model_table(label, fp32_model, read_GBps, n, reps, ours, group_size, llama_engines, quantized_dtype=None):
    """Every contestant on one model: ours (names from OURS) and llama.cpp's {outtype:
    (engine, weight bytes, setup seconds)}. read_GBps: the plain-read bandwidth of this
    model's fp32 weights, measured in this run (cache_cost.bandwidth_floor).
    quantized_dtype: the dtype of the int8 and int4 rows' model instead of OURS' (bf16:
    as --quantize loads a bf16 checkpoint, checkpoint.auto_dtype), quantized from the
    bf16 row's weights where that row runs (sharing its tied table)."""
    n = min(n, fp32_model.config.context_len - PROMPT_TOKENS)  # no re-prefill inside the run
    prompt = random_prompt(fp32_model.config.vocab_size, fp32_model.lm_head.weight.device)
    runs, rows, skipped = {}, {}, {}
    # a compiled step that reads its model's own weights (every form's but fp32's:
    # compiled_step.reads_own_weights) runs on the eager form's model, not on a copy
    variants = {}
    for name in ours:
        dtype, scheme, compile, kernels = OURS[name]
        dtype = quantized_dtype if scheme and quantized_dtype else dtype
        t0 = time.perf_counter()
        try:
            model = variants.get((dtype, scheme, kernels))
            if not (compile and model is not None and reads_own_weights(model)):
                source = variants.get((dtype, None, None), fp32_model) if scheme else fp32_model
                model = ours_variant(source, dtype, scheme, group_size, compile, kernels)
            variants.setdefault((dtype, scheme, kernels), model)
            if compile:
                compile_step(model, prompt)
        except Exception as e:  # a shape the scheme refuses; no C++ compiler for the compile
            skipped[name] = f"{type(e).__name__}: {str(e).strip()[:160]}"
            continue
        # setup: the copy, cast and quantization, and the compile
        rows[name] = {"weight_bytes": weight_bytes_per_token(model), "setup_s": time.perf_counter() - t0}
        runs[name] = ours_run(model, prompt, n, compile)
    for outtype, (llm, nbytes, setup_s) in llama_engines.items():
        name = f"llama.cpp {outtype}"
        rows[name] = {"weight_bytes": nbytes, "setup_s": setup_s}  # setup: export and load
        runs[name] = llama_run(llm, prompt, n)
    results = alternate(runs, reps)
    # greedy agreement is counted against ours fp32 eager, where it ran (--forms may leave it out)
    reference = results[REFERENCE][-1][0] if REFERENCE in results else None
    for name, row in rows.items():
        tokens = results[name][-1][0]
        row["tok_s"] = spread([n / seconds for _, seconds, *_ in results[name]])
        if name in ours and n > 1:  # the n - 1 tokens after the prefill's first
            row["decode_tok_s"] = spread([(n - 1) / decode for _, _, decode in results[name]])
        row["floor_ms"] = row["weight_bytes"] / read_GBps / 1e6
        row["over_floor"] = 1e3 / row["tok_s"]["median"] / row["floor_ms"]
        row["greedy_leading_same"] = None if reference is None else leading_matches(tokens, reference)
    if BASELINE in rows:
        for row in rows.values():
            row["vs_llama_cpp_f32"] = row["tok_s"]["median"] / rows[BASELINE]["tok_s"]["median"]
    pairs = {f"{ours} / {theirs}": rows[ours]["tok_s"]["median"] / rows[theirs]["tok_s"]["median"]
             for ours, theirs in PAIRS if ours in rows and theirs in rows}
    return {"model": label, "params_m": fp32_model.num_params() / 1e6, "tokens": n,
            "int4_group_size": group_size or int4_group_size(fp32_model), "read_GBps": read_GBps,
            "rows": rows, "skipped": skipped, "pairs": pairs}


def decode_speed(models, n, reps, floors, compile_note=None, llama_cpp_note=None,
                 quantize=True, group_size=None, contestants=None,
                 llama_outtypes=LLAMA_OUTTYPES, quantized_dtype=None):
    """The table for each of {label: fp32 model}; floors: {label: bandwidth_floor(model)},
    measured in this run. compile_note / llama_cpp_note: why the compiled row / llama.cpp's
    rows are left out (None: they run). quantize=False leaves out int8 and int4.
    contestants: names of OURS to run (default: all those); llama_outtypes: llama.cpp's;
    quantized_dtype: model_table's."""
    ours = [name for name, (_, scheme, compile, _) in OURS.items()
            if not (compile and compile_note) and (quantize or not scheme)
            and (contestants is None or name in contestants)]
    tables = []
    for label, model in models.items():
        engines = (contextlib.nullcontext({}) if llama_cpp_note is not None
                   else llama_cpp_engines(label, model, llama_outtypes))
        with engines as llama:
            tables.append(model_table(label, model, floors[label]["read_GBps"], n, reps, ours,
                                      group_size, llama, quantized_dtype))
    # the instruction set torch's kernels run with here (AVX512, AVX2, ...): the quantized
    # rows hinge on it (the int4 kernel's bf16 arithmetic is native only with AVX-512 BF16)
    return {"prompt_tokens": PROMPT_TOKENS, "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "reps": reps,
            "compile_note": compile_note,
            "llama_cpp_note": llama_cpp_note, "models": tables}


def main():
    from benchmarks.cache_cost import SHAPES, bandwidth_floor, random_model
    from benchmarks.peers import llama_cpp_missing
    from benchmarks.report import print_decode_speed
    from kv_cache import CACHED_MODELS
    from plumbing.checkpoint import BUNDLED, load_model
    from plumbing.cli import ArgumentParser, add_benchmark_args
    from plumbing.outputs import check_output_path, publish_result

    p = ArgumentParser(description="The decode-speed table of benchmark.py alone: ours in each "
                       "form beside llama.cpp f32, f16, q8_0 and q4_0 on identical weights, on the "
                       "bundled model and a random model of --shape (see the module docstring).")
    p.add_argument("--shape", choices=list(SHAPES), default="gpt2",
                   help="the random model's shape (default: gpt2, GPT-2 small; tiny: a quick check)")
    add_benchmark_args(p, tokens=200)
    p.add_argument("--group-size", type=int, choices=INT4_GROUP_SIZES,
                   help="the int4 rows' group size (default: weight_quant's for each model)")
    p.add_argument("--no-compile", action="store_true",
                   help="leave out the compiled rows (each builds C++ for up to minutes)")
    args = p.parse_args()
    if args.json is not None:
        check_output_path(args.json, "json")
    bundled = load_model(CACHED_MODELS, BUNDLED, report=lambda line: None)[0]
    models = {"bundled": bundled, f"{args.shape} shape": random_model(args.shape, "cpu")}
    floors = {label: bandwidth_floor(model, args.reps) for label, model in models.items()}
    result = decode_speed(models, args.tokens, args.reps, floors, group_size=args.group_size,
                          compile_note="compiled rows left out (--no-compile)" if args.no_compile else None,
                          llama_cpp_note=llama_cpp_missing())
    publish_result(result, "benchmarks.decode_speed", print_decode_speed, args.json)


if __name__ == "__main__":
    run(main)
