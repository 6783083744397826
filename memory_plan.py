"""
How much memory a model's weights and its KV cache take, for models from the bundled one
to a Llama-3-8B, before anything is run: the chapter's formula with every term a number
you can turn, and whether weights + cache fit in --memory.

    S_cache = 2 x N_layers x N_kv_heads x min(L, sliding_window) x head_bytes  (x batch)

head_bytes is d_head x P_bytes for a float cache, codes plus scales for int8/int4
(kv_quant.head_bytes); kv_quant.cache_bytes, the formula that sizes the real caches,
computes every figure. N_kv_heads is N_heads
for GPT-2; Llama-3 and Mistral share each cached key/value head among 4 query heads
(grouped-query attention), which is why they cache a quarter as much per token. A sliding
window (Mistral's 4096 tokens) caps the columns: attention never looks further back.

The weights' bytes per format are plumbing.memory.weight_bytes: float32 or bfloat16 for
every parameter, or int8 / int4 as weight_quant.py stores a bfloat16 model's Linears
(codes plus their scales; embeddings and norms stay bfloat16). A test checks them against
the bytes a loaded, quantized model's tensors hold.

    python memory_plan.py
    python memory_plan.py --memory 80GiB --length 32768 --batch 8 --weights-dtype int4
    python memory_plan.py --json
    python memory_plan.py --plot docs/kv_memory.png
    python memory_plan.py --tensor-parallel 2 --pipeline-parallel 2 --memory 16GiB

Past one machine (docs/parallelism.md), every figure is per rank (each GPU or machine,
with --memory its own): tensor parallelism (TP) splits every layer's heads across ranks,
so a rank caches N_kv_heads / TP of them; pipeline parallelism (PP) gives each stage a
slice of the layers, N_layers / PP of them:

    S_cache per rank = 2 x (N_layers / PP) x (N_kv_heads / TP) x L x head_bytes
"""

import dataclasses
import math
import re
import sys
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

from plumbing.script import begin, run

if __name__ == "__main__":  # run as a command; importing this file changes nothing
    begin()  # before torch: Ctrl-C during the slow imports ends quietly (plumbing/script.py)

from base_model import GPTConfig  # noqa: E402
from kv_quant import KV_DTYPES, cache_bytes, head_bytes  # noqa: E402
from llama import LlamaConfig  # noqa: E402
from plumbing.checkpoint import BUNDLED, NAIVE_MODELS, default_checkpoint  # noqa: E402
from plumbing.cli import ArgumentParser, load_source, positive_int  # noqa: E402
from plumbing.memory import format_bytes, parameter_count, weight_bytes  # noqa: E402
from plumbing.outputs import MARK, check_output_path, import_pyplot, json_text, write_atomically  # noqa: E402

WEIGHT_FORMATS = ("float32", "bfloat16", "int8", "int4")  # float16 takes bfloat16's bytes
MAX_MEMORY = 2 ** 200  # past a float's comfortable range; no plan needs more
UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclass(frozen=True)
class Shape:
    """What the cache's size depends on, and the weights' count for comparison; config,
    the model's own, sizes the weights in each format (none for a cache-only shape)."""
    name: str
    n_layer: int
    n_head: int          # query heads
    n_kv_head: int       # cached key/value heads: n_head (MHA), fewer (GQA), 1 (MQA)
    head_dim: int
    params: int
    context_len: int     # the longest sequence the model was made for
    sliding_window: int = None  # sliding-window attention: the cache keeps this many tokens at most
    config: object = None       # base_model.GPTConfig or llama.LlamaConfig


def shape_of(name, config, sliding_window=None):
    """The Shape of a model config: its terms of the formula, and the config for its weights."""
    return Shape(name, config.n_layer, config.n_head, config.n_kv_head, config.head_dim,
                 parameter_count(config), config.context_len, sliding_window, config)


def gpt2_config(n_layer, n_embd, n_head=1, vocab_size=50257, context_len=1024):
    """A GPT-2 (base_model.GPT with biases; lm_head tied to the embedding)."""
    return GPTConfig(context_len=context_len, vocab_size=vocab_size, n_layer=n_layer,
                     n_head=n_head, n_embd=n_embd)


def llama_config(n_layer, d_model, n_head, n_kv_head, d_ffn, vocab_size, context_len=4096):
    """A Llama-style model (no biases, RMSNorm, SwiGLU, untied output layer)."""
    return LlamaConfig(context_len=context_len, vocab_size=vocab_size, n_layer=n_layer,
                       n_head=n_head, n_kv_head=n_kv_head, n_embd=d_model, intermediate_size=d_ffn)


def gpt2_params(n_layer, n_embd, vocab_size=50257, context_len=1024):
    """Parameters of a GPT-2, counted as the loaders count them (plumbing/memory.py); the
    head count changes no count."""
    return parameter_count(gpt2_config(n_layer, n_embd, vocab_size=vocab_size, context_len=context_len))


def llama_params(n_layer, d_model, n_head, n_kv_head, d_ffn, vocab_size):
    """Parameters of a Llama-style model, counted as the loaders count them."""
    return parameter_count(llama_config(n_layer, d_model, n_head, n_kv_head, d_ffn, vocab_size))


NAMED = [
    shape_of("GPT-2 small", gpt2_config(12, 768, n_head=12)),
    shape_of("GPT-2 medium", gpt2_config(24, 1024, n_head=16)),
    shape_of("GPT-2 large", gpt2_config(36, 1280, n_head=20)),
    shape_of("GPT-2 xl", gpt2_config(48, 1600, n_head=25)),
    shape_of("Llama-2-7B-like (MHA)", llama_config(32, 4096, 32, 32, 11008, 32000)),
    shape_of("Llama-3-8B-like (GQA 32/8)", llama_config(32, 4096, 32, 8, 14336, 128256, context_len=8192)),
    shape_of("Mistral-7B-like (GQA, window 4096)",
             llama_config(32, 4096, 32, 8, 14336, 32000, context_len=32768), sliding_window=4096),
]


def checkpoint_shape(args):
    """The Shape of the model that --ckpt/--hf (or the default chain) names."""
    model, _ = load_source(NAIVE_MODELS, args.ckpt, args.hf)
    path = Path(args.hf or args.ckpt or default_checkpoint())
    name = "bundled model" if path.resolve() == BUNDLED else path.name
    return shape_of(name, model.config)


def windowed_cache_bytes(shape, kv_dtype, length, batch_size=1):
    """kv_quant.cache_bytes for a shape: with a sliding window (Mistral), attention sees
    only the last sliding_window tokens, so the cache keeps no more."""
    kept = length if shape.sliding_window is None else min(length, shape.sliding_window)
    return cache_bytes(shape, kept, batch_size, kv_dtype)


def sequences_that_fit(shape, kv_dtype, length, memory, weights):
    """How many sequences of `length` tokens fit in `memory` bytes once `weights` bytes are in."""
    free = memory - weights  # integers: exact at any size
    return max(0, free // windowed_cache_bytes(shape, kv_dtype, length))


# ---------------------------------------------------------------------------- per rank

@dataclass(frozen=True)
class Ranks:
    """How a model is split past one device: tp ranks share each layer, pp stages share the
    layers. Ranks() is one device holding everything."""
    tp: int = 1
    pp: int = 1


def kv_heads_per_rank(n_kv_head, tp):
    """Tensor parallelism splits attention by heads, so each rank caches n_kv_head / tp of
    them. A head cannot be split: with fewer key/value heads than ranks (GQA's 8 heads on 16
    ranks) each rank holds a copy of one, and the copies cost memory (vLLM does this too)."""
    if n_kv_head >= tp:
        if n_kv_head % tp:
            raise ValueError(f"{n_kv_head} key/value heads do not split evenly over {tp} ranks")
        return n_kv_head // tp
    if tp % n_kv_head:
        raise ValueError(f"{tp} ranks cannot share {n_kv_head} key/value heads evenly")
    return 1


def rank_shape(shape, ranks):
    """The Shape one rank of the heaviest pipeline stage sees: its layers and its heads.
    Every formula above then gives that rank's figures unchanged."""
    if shape.n_head % ranks.tp:
        raise ValueError(f"{shape.name}: {shape.n_head} query heads do not split evenly over "
                         f"{ranks.tp} ranks")
    return dataclasses.replace(shape, n_layer=math.ceil(shape.n_layer / ranks.pp),
                               n_head=shape.n_head // ranks.tp,
                               n_kv_head=kv_heads_per_rank(shape.n_kv_head, ranks.tp))


def rank_weight_bytes(shape, weights_dtype, ranks):
    """The weights one rank holds, in the heaviest pipeline stage. Tensor parallelism splits
    every Linear and the vocabulary's tables (embedding, output layer) over tp ranks; the
    norms, a few KB, are copied and not counted. A stage holds its slice of the blocks, the
    first one the embedding and the last one the output layer: an untied pair, two tables
    of one size, puts half of the tables' bytes on an end stage; a tied one needs the table
    at both ends."""
    tables = weight_bytes(dataclasses.replace(shape.config, n_layer=0), weights_dtype)
    per_block = (weight_bytes(shape.config, weights_dtype) - tables) // shape.n_layer
    tied = getattr(shape.config, "tie_embeddings", True)  # GPT-2's config has no field: tied
    if ranks.pp > 1 and not tied:
        tables //= 2
    layers = math.ceil(shape.n_layer / ranks.pp)
    return (layers * per_block + tables) // ranks.tp


def plan(shapes, kv_dtypes, memory, length, batch, weights_dtype, ranks=Ranks()):
    """For each shape and cache dtype: the weights, the cache of `batch` sequences of `length`
    tokens (or the model's context if shorter), their total and whether it fits in `memory`;
    with ranks, each of those per rank."""
    rows = []
    for s in shapes:
        fit_length = min(length, s.context_len)
        weights = rank_weight_bytes(s, weights_dtype, ranks)
        s = rank_shape(s, ranks)
        for kv in kv_dtypes:
            cache = windowed_cache_bytes(s, kv, fit_length, batch)
            rows.append({"model": s.name, "weights_dtype": weights_dtype, "weights_bytes": weights,
                         "kv_dtype": kv, "length": fit_length, "batch": batch, "cache_bytes": cache,
                         "total_bytes": weights + cache, "fits": weights + cache <= memory,
                         "sequences_that_fit": sequences_that_fit(s, kv, fit_length, memory, weights)})
    return rows


# ---------------------------------------------------------------------------- report

def count(n):
    """An exact count, or three significant digits past a quadrillion (a plan for more
    memory than exists needs no more)."""
    return f"{n:,}" if n < 10**15 else f"{n:.3g}"


def tokens_label(n):
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def ranks_label(ranks):
    """'' on one device, else what each figure is of."""
    if ranks == Ranks():
        return ""
    return (f", per rank (tensor parallel {ranks.tp} x pipeline parallel {ranks.pp}: "
            f"{ranks.tp * ranks.pp} ranks, the heaviest stage)")


def print_tables(shapes, kv_dtypes, lengths, memory, length, weights_dtype, plan_rows, ranks=Ranks()):
    print("## Models: the terms of the formula, and the weights (int8 / int4: the Linears' codes "
          "and scales, the rest bfloat16)\n")
    print("| model | layers | heads (query / key-value) | head_dim | window | context | parameters | "
          + " | ".join(f"weights {w}" for w in WEIGHT_FORMATS) + " |")
    print("|---|---|---|---|---|---|---|" + "---|" * len(WEIGHT_FORMATS))
    for s in shapes:
        print(f"| {s.name} | {s.n_layer} | {s.n_head} / {s.n_kv_head} | {s.head_dim} | "
              f"{s.sliding_window or '-'} | {s.context_len:,} | {s.params / 1e6:,.0f}M | "
              + " | ".join(format_bytes(weight_bytes(s.config, w)) for w in WEIGHT_FORMATS) + " |")

    print(f"\n## KV cache of one sequence, and what fits in {format_bytes(memory)} next to "
          f"{weights_dtype} weights{ranks_label(ranks)}\n")
    print("| model | kv dtype | bytes per head (k or v) | per token | "
          + " | ".join(tokens_label(n) for n in lengths)
          + " | tokens where cache = weights | sequences that fit |")
    print("|---|---|---|---|" + "---|" * len(lengths) + "---|---|")
    for s in shapes:
        fit_length = min(length, s.context_len)
        weights = rank_weight_bytes(s, weights_dtype, ranks)
        s = rank_shape(s, ranks)
        for kv in kv_dtypes:
            per_token = cache_bytes(s, 1, 1, kv)
            cells = [format_bytes(windowed_cache_bytes(s, kv, n)) + ("*" if n > s.context_len else "")
                     for n in lengths]
            fit = sequences_that_fit(s, kv, fit_length, memory, weights)
            print(f"| {s.name} | {kv} | {head_bytes(s.head_dim, kv)} B | {format_bytes(per_token)} | "
                  + " | ".join(cells) + f" | {weights / per_token:,.0f} | "
                  f"{count(fit)} of {tokens_label(fit_length)} tokens |")
    print("\n\\* longer than the model's context: what the formula gives, not a length it can run. "
          "Tokens where cache = weights: summed over the batch (the sliding window not counted). "
          f"Sequences that fit: of --length {length} tokens, or the model's context if shorter.")

    batch = plan_rows[0]["batch"]
    print(f"\n## The plan: {weights_dtype} weights and the KV cache of {batch} x --length {length} "
          f"tokens (or the model's context), in {format_bytes(memory)}{ranks_label(ranks)}\n")
    print(f"| model | weights | kv dtype | KV cache | total | fits in {format_bytes(memory)} |")
    print("|---|---|---|---|---|---|")
    for r in plan_rows:
        margin = memory - r["total_bytes"]
        fits = f"yes, {format_bytes(margin)} left" if r["fits"] else f"no, {format_bytes(-margin)} over"
        print(f"| {r['model']} | {format_bytes(r['weights_bytes'])} | {r['kv_dtype']} | "
              f"{format_bytes(r['cache_bytes'])} ({r['batch']} x {tokens_label(r['length'])}) | "
              f"{format_bytes(r['total_bytes'])} | {fits} |")


def plan_json(shapes, memory, plan_rows, ranks=Ranks()):
    """--json: every shape's terms and weights per format, and the plan's rows (per rank
    with tensor or pipeline parallelism)."""
    models = [{"name": s.name, "n_layer": s.n_layer, "n_head": s.n_head, "n_kv_head": s.n_kv_head,
               "head_dim": s.head_dim, "sliding_window": s.sliding_window, "context_len": s.context_len,
               "parameters": s.params,
               "weights_bytes": {w: weight_bytes(s.config, w) for w in WEIGHT_FORMATS}}
              for s in shapes]
    return json_text({"memory_bytes": memory, "tensor_parallel": ranks.tp,
                      "pipeline_parallel": ranks.pp, "models": models, "plan": plan_rows}, indent=1)


def plot(shapes, kv_dtypes, memory, path, plt):
    """Cache bytes of one sequence vs its length, for the first and last of kv_dtypes (the
    table has them all): bold up to each model's context, faint past it."""
    fig, ax = plt.subplots(figsize=(11, 5.5))
    shown = dict(zip(sorted({kv_dtypes[0], kv_dtypes[-1]}, key=kv_dtypes.index), ["-", "--"]))
    lengths = [2 ** k for k in range(7, 18)]  # 128 .. 128k tokens
    for i, s in enumerate(shapes):
        for kv, style in shown.items():
            inside = [n for n in lengths if n <= s.context_len] + [s.context_len]
            outside = [s.context_len] + [n for n in lengths if n > s.context_len]
            ax.plot(inside, [windowed_cache_bytes(s, kv, n) for n in inside], linestyle=style,
                    color=f"C{i}", linewidth=2, label=s.name if style == "-" else None)
            ax.plot(outside, [windowed_cache_bytes(s, kv, n) for n in outside], linestyle=style,
                    color=f"C{i}", linewidth=1, alpha=0.3)
    for kv, style in shown.items():  # one legend entry per line style
        ax.plot([], [], color="black", linestyle=style, label=f"{kv} cache")
    ax.axhline(memory, color="black", linewidth=0.8)
    ax.text(lengths[0], memory * 1.2, f"{format_bytes(memory)}: the whole memory", fontsize=9)
    ax.set(xscale="log", yscale="log", xlabel="tokens in the sequence (faint: past the model's context)",
           ylabel="KV cache bytes, one sequence", title="KV cache vs context length (batch 1)")
    ax.set_xticks(lengths[::2], [tokens_label(n) for n in lengths[::2]])
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    # written as every output is (plumbing/outputs.py), and marked ours so that a later run may replace it
    write_atomically(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110,
                                                   metadata={"Software": f"{MARK} memory_plan.py"}))


def parse_bytes(text):
    """Bytes in a size such as 24GiB, exactly (a Decimal, not a float: 10**20 TB is
    10**32 bytes, not 10**32 plus float noise); more than 0."""
    match = re.fullmatch(r"\s*([0-9]+\.?[0-9]*|\.[0-9]+)\s*([KMGT]i?B|B)?\s*", text, flags=re.IGNORECASE)
    if not match:
        raise ValueError(f"not a size: {text!r} (examples: 24GiB, 80GB, 512MiB)")
    nbytes = int(Decimal(match.group(1)) * UNITS[(match.group(2) or "B").upper()])
    if not 1 <= nbytes <= MAX_MEMORY:
        raise ValueError(f"must be from 1 byte to {MAX_MEMORY:.3g} bytes, got {text!r}")
    return nbytes


def splits(shape, ranks, parser, named_by_user):
    """Whether the shape splits over the ranks. One that does not is left out with a line
    saying why, or is an error when the user named it (--ckpt, --hf)."""
    try:
        rank_shape(shape, ranks)
        if ranks.pp > shape.n_layer:
            raise ValueError(f"{shape.name}: {ranks.pp} pipeline stages for {shape.n_layer} layers")
    except ValueError as e:
        if named_by_user:
            parser.error(f"{e} (--tensor-parallel {ranks.tp}, --pipeline-parallel {ranks.pp})")
        print(f"left out: {e}", file=sys.stderr)
        return False
    return True


def main():
    p = ArgumentParser(description="KV cache memory per token, per sequence and per GPU, for "
                       "named model shapes and every cache dtype (see the module docstring).")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--ckpt", help="also plan for this checkpoint (default: the default chain)")
    source.add_argument("--hf", metavar="DIR", help="also plan for this Hugging Face directory (GPT-2, Llama, Mistral, Qwen2, Qwen3)")
    p.add_argument("--memory", default="24GiB", help="memory for weights and caches (default: 24GiB)")
    p.add_argument("--length", type=positive_int, default=4096,
                   help="sequence length for the fit column (default: 4096)")
    p.add_argument("--batch", type=positive_int, default=1,
                   help="sequences decoded together, in the plan's cache (default: 1)")
    p.add_argument("--weights-dtype", choices=WEIGHT_FORMATS, default="bfloat16",
                   help="weights' format in the fit column and the plan (int8, int4: "
                   "weight_quant.py's, scales counted) (default: bfloat16)")
    p.add_argument("--kv-dtypes", default="float32,bfloat16,int8,int4",
                   help="cache dtypes, comma-separated, from " + ", ".join(KV_DTYPES)
                   + " (default: float32,bfloat16,int8,int4; float16 takes bfloat16's bytes)")
    p.add_argument("--tensor-parallel", type=positive_int, default=1, metavar="TP",
                   help="ranks that split each layer's heads: the cache and weights per rank "
                   "(docs/parallelism.md) (default: 1)")
    p.add_argument("--pipeline-parallel", type=positive_int, default=1, metavar="PP",
                   help="stages that split the layers: per rank, the heaviest stage (default: 1)")
    p.add_argument("--plot", metavar="PATH", help="write cache bytes vs length as a PNG (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    args = p.parse_args()
    try:
        memory = parse_bytes(args.memory)
    except ValueError as e:
        p.error(f"--memory: {e}")
    kv_dtypes = args.kv_dtypes.split(",")
    if not set(kv_dtypes) <= set(KV_DTYPES):
        p.error(f"--kv-dtypes: choose from {', '.join(KV_DTYPES)}, got {args.kv_dtypes!r}")
    twice = next((kv for i, kv in enumerate(kv_dtypes) if kv in kv_dtypes[:i]), None)
    if twice:
        p.error(f"--kv-dtypes: {twice} given twice")
    plt = None
    if args.plot is not None:  # checked before any work: '' too, a file not ours, a folder
        check_output_path(args.plot, "png")
        plt = import_pyplot()
    ranks = Ranks(args.tensor_parallel, args.pipeline_parallel)
    own = checkpoint_shape(args)
    shapes = [s for s in [own] + NAMED if splits(s, ranks, p, s is own and (args.ckpt or args.hf))]
    plan_rows = plan(shapes, kv_dtypes, memory, args.length, args.batch, args.weights_dtype, ranks)
    if args.json:
        print(plan_json(shapes, memory, plan_rows, ranks))
    else:
        print_tables(shapes, kv_dtypes, [1024, 4096, 32768, 131072], memory, args.length,
                     args.weights_dtype, plan_rows, ranks)
    if plt:
        plot(shapes, kv_dtypes, memory, args.plot, plt)


if __name__ == "__main__":
    run(main)
