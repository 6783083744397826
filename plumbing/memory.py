"""
Memory arithmetic: what this machine can still give, what a model or a batch of rows
would take (its weights in each format: weight_bytes), what this process has held at its
peak (peak_rss_bytes), and the one way a byte count is written (format_bytes, binary units).

The loaders refuse up front what would exhaust the machine (check_fits_in_memory), with
the cost in the message; memory_plan.py prints the same parameter count and the same
byte format in its tables.
"""

import math
import os
import sys
from pathlib import Path

from kv_quant import cache_bytes
from plumbing.script import CheckpointError
from weight_quant import INT4_GROUP_SIZE, INT4_GROUP_SIZES

# nn.Module bookkeeping of one transformer block, whatever its width: measured 36 KB
# (2,000 one-wide blocks, RSS), rounded up. Without it a "billion layers" of width 1
# would look cheap (25 parameters each) and take hours and terabytes to construct.
BYTES_PER_BLOCK_OBJECTS = 64 * 1024
BINARY_UNITS = (("EiB", 2**60), ("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30),
                ("MiB", 2**20), ("KiB", 2**10))


def available_memory():
    """Bytes this process can still take: the kernel's MemAvailable (free memory plus
    caches it can drop), lowered to the container's limit when a cgroup sets one.
    Limits below use this, not a fixed number, so that they follow the machine."""
    available = math.inf  # an unknown platform: no refusal, the allocator decides
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f
                             if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        try:  # macOS and the BSDs have no /proc: their physical memory, all of it
            available = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            pass
    try:  # cgroup v2 (containers, CI runners): memory.max is "max" or a byte count
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return available


def max_text_bytes():
    """The most bytes of text (a prompt, a file to score) worth reading: each byte may become
    a character, a token id in a Python list (an int object and a pointer, ~36 bytes) and
    a tensor entry (8 bytes), ~48 bytes of memory at most (a byte-level tokenizer)."""
    return int(min(available_memory() / 48, 2 ** 62))


def format_bytes(nbytes):
    """Bytes in the largest binary unit they fill: 512 B, 1.5 GiB, 1,000 GiB, 1.5e+06 EiB."""
    for unit, size in BINARY_UNITS:
        if nbytes >= size:
            return (f"{nbytes / size:,.0f} {unit}" if 1000 * size <= nbytes < 1024 * size
                    else f"{nbytes / size:.3g} {unit}")
    return f"{nbytes:g} B"


def check_fits_in_memory(needed, what, source):
    """Refuse up front what would exhaust the machine: what needs `needed` bytes."""
    available = available_memory()
    if needed > available:
        raise CheckpointError(f"{source}: {what} would need {format_bytes(needed)} of memory; "
                              f"{format_bytes(available)} is available")


def parameter_count(c):
    """Parameters of the model a config describes (base_model.GPT or llama.Llama), from the
    config alone (tests check it against num_params())."""
    return gpt_parameter_count(c) if c.family == "gpt" else llama_parameter_count(c)


def gpt_parameter_count(c):
    """base_model.GPT: per block, ln_1 and ln_2, c_attn (C x 3C), attn c_proj (C x C),
    c_fc (C x 4C), mlp c_proj (4C x C) = 12 C^2 weights, plus 13 C biases (or the 2 C
    LayerNorm weights without biases); wte and wpe; ln_f. lm_head is wte, tied."""
    C = c.n_embd
    norms_and_biases = 13 * C if c.bias else 2 * C
    linears = sum(out * inp for out, inp in block_linear_shapes(c))  # 12 C^2
    return (c.vocab_size * C + c.context_len * C + c.n_layer * (linears + norms_and_biases)
            + (2 * C if c.bias else C))


def llama_parameter_count(c):
    """llama.Llama: per block, q and o (C x n_head*hd each), k and v (C x n_kv_head*hd
    each) and their biases with qkv_bias, the SwiGLU's three C x intermediate matrices, two
    RMSNorm weights of C (and of hd for q and k with qk_norm); the embedding, the output
    layer unless it is tied, the final RMSNorm."""
    C, q, kv = c.n_embd, c.n_head * c.head_dim, c.n_kv_head * c.head_dim
    linears = sum(out * inp for out, inp in block_linear_shapes(c))
    per_block = (linears + (q + 2 * kv if c.qkv_bias else 0)
                 + 2 * C + (2 * c.head_dim if c.qk_norm else 0))
    return c.vocab_size * C * (1 if c.tie_embeddings else 2) + c.n_layer * per_block + C


def block_linear_shapes(c):
    """(out, in) of each nn.Linear weight in one block of the model config c describes."""
    C = c.n_embd
    if c.family == "gpt":  # c_attn, attn c_proj, c_fc, mlp c_proj
        return [(3 * C, C), (C, C), (4 * C, C), (C, 4 * C)]
    q, kv, hidden = c.n_head * c.head_dim, c.n_kv_head * c.head_dim, c.intermediate_size
    # q, k, v, o; the SwiGLU's gate, up and down
    return [(q, C), (kv, C), (kv, C), (C, q), (hidden, C), (hidden, C), (C, hidden)]


def quantized_linear_shapes(c):
    """{(out, in): how many} of the Linear weights weight_quant.quantize_model replaces:
    every block's, and the output layer when it is tied to the embedding (an untied one
    stays float). Counted, not listed: a config of a billion layers is refused by the
    memory check, which must not build a list of seven billion shapes first."""
    counts = {}
    for shape in block_linear_shapes(c):
        counts[shape] = counts.get(shape, 0) + c.n_layer
    if c.family == "gpt" or c.tie_embeddings:
        counts[(c.vocab_size, c.n_embd)] = counts.get((c.vocab_size, c.n_embd), 0) + 1
    return counts


def int4_group_size_for(c):
    """weight_quant.int4_group_size for a config: INT4_GROUP_SIZE, or the largest smaller
    group the kernel takes that divides every quantized Linear's input width."""
    widths = {inp for _, inp in quantized_linear_shapes(c)}
    fitting = [g for g in INT4_GROUP_SIZES if g <= INT4_GROUP_SIZE and all(w % g == 0 for w in widths)]
    return max(fitting, default=INT4_GROUP_SIZES[0])


FLOAT_WEIGHT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SCALE_BYTES = 2  # bfloat16: the scales' dtype (the CPU kernels' activations, or the model's)


def weight_bytes(c, weights_dtype):
    """Bytes the weights of config c hold in weights_dtype. A float dtype: every parameter
    at its size. int8 / int4: what weight_quant.quantize_model makes of a bfloat16 model:
    each quantized Linear as codes (1 byte, or half a byte, per weight) and bfloat16 scales
    (int8: one per output row; int4: a scale and a zero point per group of inputs); the
    rest (embeddings, norms, biases, an untied output layer) in bfloat16. A tied output
    layer's table stays as the embedding: its codes are a copy, counted on top. The CPU
    int4 kernel pads rows to a multiple of 16 (not counted: a few rows per layer)."""
    if weights_dtype in FLOAT_WEIGHT_BYTES:
        return parameter_count(c) * FLOAT_WEIGHT_BYTES[weights_dtype]
    quantized = quantized_linear_shapes(c)
    float_params = parameter_count(c) - c.n_layer * sum(o * i for o, i in block_linear_shapes(c))
    if weights_dtype == "int8":
        codes = sum(n * (o * i + o * SCALE_BYTES) for (o, i), n in quantized.items())
    else:
        group = int4_group_size_for(c)
        codes = sum(n * (o * i // 2 + o * (i // group) * 2 * SCALE_BYTES) for (o, i), n in quantized.items())
    return float_params * FLOAT_WEIGHT_BYTES["bfloat16"] + codes


def peak_rss_bytes():
    """The most resident memory this process has held so far, in bytes (None where the
    platform does not say: Windows has no resource module). On Linux, VmHWM of
    /proc/self/status: ru_maxrss carries over fork and exec, so a command started by a large
    process (a test run, a server) would report its parent's peak until it outgrew it."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # "VmHWM:   123456 kB"
    except (OSError, ValueError, IndexError):
        pass  # not Linux: the resource module's figure
    try:
        import resource  # POSIX only
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in KiB on Linux and the BSDs, in bytes on macOS
    return peak if sys.platform == "darwin" else peak * 1024


def model_memory(c, weights_format="float32", cache_dtype="float32"):
    """(bytes, what) to build and run a model of config c: its weights in weights_format
    (weight_bytes: a float dtype's name, "int8" or "int4"), the module objects, a
    whole-context prefill's causal mask (context_len^2 bools) and one row's KV cache in
    cache_dtype over the whole context (kv_quant.cache_bytes). Not the mask for the Llama
    family: their contexts run to 128k positions (a 16 GB mask), and a pass builds the mask
    of the tokens it feeds, never the whole context's. A config alone is checked in its
    smallest form (int4, a bfloat16 cache: what no loader can make fit is refused before
    anything is read); the loader checks again in the run's own format (checkpoint.build_model)."""
    weights = weight_bytes(c, weights_format) + c.n_layer * BYTES_PER_BLOCK_OBJECTS
    mask = c.context_len ** 2 if c.family == "gpt" else 0
    context = mask + cache_bytes(c, c.context_len, 1, cache_dtype)
    what = (f"this model ({parameter_count(c):,} parameters: {format_bytes(weights)} in {weights_format}; "
            f"a {c.context_len:,}-position context: {format_bytes(context)} of mask and KV cache)")
    return weights + context, what


def generation_memory(c, rows, kv_dtype):
    """Bytes that `rows` rows decoded together hold: each its KV cache over the whole
    context, its history of token ids and a row of fp32 logits."""
    per_row = cache_bytes(c, c.context_len, 1, kv_dtype) + 8 * c.context_len + 4 * c.vocab_size
    return rows * per_row
