"""
Attention that reads the paged cache where it lies: a paged attention kernel, written in
a dozen lines of PyTorch, and the engine's decode step compiled whole around it.

PagedCache.update gathers every sequence's keys and values into one dense tensor, because
SDPA wants one: a decode step then copies the whole cache (a read and a write) before
attention reads it again. On the bundled model at 64 sequences that copy is most of the
step: its cache is several times the size of its weights. A paged kernel (vLLM's,
FlashInfer's) reads each key through the block table instead. For one query per sequence
the computation is a gather inside two reductions:

    scores[b, s, h] = q[b, h] . k_pool[slots[b, s], h] / sqrt(hd)    (a sum over hd)
    p[b, :, h]      = softmax over s of scores[b, :, h], hidden columns at -inf
    out[b, h]       = sum over s of p[b, s, h] * v_pool[slots[b, s], h]

Run eagerly, k_pool[slots] would build the gathered tensor anyway (slower than the
index_select it replaces). torch.compile fuses the indexing into the loops that consume it:
the C++ it generates loads each key and value straight from its block, once, and never
writes a copy.

The engine's decode step is compiled whole (compiled_decode_step): the model's forward with
the pool as its cache (PagedKernelCache), so that the kernel, the matmuls and the small
operations between them (LayerNorm, GELU, residuals) are one graph of generated loops
instead of a hundred calls from Python a step; the draw of each row's next token is in the
graph too (sample.sample_rows_with_noise, each row with its own temperature), so what comes
back is tokens ready to hand out, not logits to sample in Python. Each of its rows is one
query: a decode step's rows are its sequences, and a short prefill (a prefix hit's last
tokens, a short prompt) can be rows too, one per token, each reading the columns up to its
own (decode_index.fed_rows: the causal mask, row by row). A long prefill's queries are
better read together, each key once for all of them: it keeps the gather and SDPA.

The loops torch.compile makes of decode_attention read the pool at a third of the memory's
speed. paged_attention.cpp is the same kernel written by hand (one pass over a sequence's
columns, the softmax taken on the way), near a plain read of the same bytes; a step compiled
with the weights frozen in (the engine's compile option) runs it (attention_for).

A pool stored in fewer bytes (kv_quant.py's formats: int8 or int4 codes and their scales)
is read the same way: `fmt` is the pool's format, whose encode() the step writes through
and whose decode() decode_attention reads through (torch.compile fuses it into the loops:
no dequantized copy is made); the hand-written kernel dequantizes each stored head once
as it reads it (decode_attention_quantized).
"""

import functools
import warnings
from pathlib import Path

import torch

from generation.compiled_step import BUILD_OPTIONS
from sample import sample_rows_with_noise
from plumbing.kernel_build import build_kernel

KERNEL_SOURCE = Path(__file__).with_name("paged_attention.cpp")


def decode_attention(q, k_pool, v_pool, slots, visible, fmt=None):
    """q (B, nh, 1, hd): each sequence's new query; k_pool, v_pool (pool slots, n_kv_head,
    width): one layer of the pool; slots (B, S): the pool slot of each column of each sequence;
    visible (B, S): False where a column is padding; fmt: the pool's kv_quant format (None:
    it stores what the model computes, width = hd). Returns (B, nh, 1, hd).

    With grouped-query attention (n_kv_head < nh) the query heads that share a stored head
    are read as a group: q as (B, n_kv_head, group, hd), each stored key used group times
    where it lies."""
    B, nh, _, hd = q.shape
    n_kv_head = k_pool.size(1)
    read = (lambda stored: stored) if fmt is None else fmt.decode
    q_ = q.view(B, n_kv_head, nh // n_kv_head, hd).float()         # (B, kv, group, hd)
    keys = read(k_pool[slots]).float()                              # (B, S, kv, hd), fused
    scores = (q_[:, None] * keys[:, :, :, None]).sum(-1) / hd ** 0.5  # (B, S, kv, group)
    scores = scores.masked_fill(~visible[:, :, None, None], float("-inf"))
    p = scores.softmax(dim=1)                                       # over the columns
    values = read(v_pool[slots]).float()                            # (B, S, kv, hd), fused
    out = (p[..., None] * values[:, :, :, None]).sum(dim=1)         # (B, kv, group, hd)
    return out.reshape(B, nh, 1, hd).to(q.dtype)


@functools.cache
def hand_written_kernel():
    """decode_attention written by hand in C++ (paged_attention.cpp: each column's key and
    value read once for every head, the softmax taken on the way), for a float32 query
    over a float32 pool (torch.ops.kvcache_gpt.decode_attention) or an int8 or int4 one
    (decode_attention_quantized); decode_attention itself where it cannot be built (with a
    warning). The first call on a machine compiles it (plumbing/kernel_build.py: ~15-30 s, kept for
    later processes)."""
    error = build_kernel(KERNEL_SOURCE, "kvcache_gpt_paged_attention")
    if error:
        warnings.warn(f"the hand-written paged attention kernel could not be built ({error}); "
                      "using decode_attention", stacklevel=2)
        return decode_attention

    # their outputs' shape, for torch.compile's tracing
    torch.library.register_fake("kvcache_gpt::decode_attention")(
        lambda q, k_pool, v_pool, slots, visible: torch.empty_like(q))
    torch.library.register_fake("kvcache_gpt::decode_attention_quantized")(
        lambda q, k_pool, v_pool, slots, visible, bits, group: torch.empty_like(q))

    def hand_written(q, k_pool, v_pool, slots, visible, fmt=None):  # decode_attention's inputs
        if fmt is not None and fmt.storage_dtype == torch.uint8:
            return torch.ops.kvcache_gpt.decode_attention_quantized(q, k_pool, v_pool, slots, visible,
                                                                    fmt.bits, fmt.group)
        return torch.ops.kvcache_gpt.decode_attention(q, k_pool, v_pool, slots, visible)
    return hand_written


def attention_for(kv, fmt=None):
    """The paged kernel a compiled step with the weights frozen in runs over this pool (fmt:
    its format, None for the model's dtype): the hand-written one on the CPU for a float32
    model over a float32, int8 or int4 pool (what it is written for), else decode_attention."""
    float_model = fmt is None or fmt.dtype == torch.float32
    if kv.device.type == "cpu" and float_model and kv.dtype in (torch.float32, torch.uint8):
        return hand_written_kernel()
    return decode_attention


class PagedKernelCache:
    """The pool as the cache of the compiled decode step (of kv_cache.Cache it has attend,
    all that forward_at calls): each
    sequence's new key and value go to its slot of the pool, then the paged kernel
    (decode_attention, or its hand-written twin) reads every column through the block
    tables where it lies. (serving/paged_cache.PagedCache, the eager steps' cache, gathers
    the columns for SDPA instead.)"""

    def __init__(self, kv, read_slots, write_slots, visible, attention=decode_attention, fmt=None):
        self.kv, self.read_slots, self.visible = kv, read_slots, visible  # kv: the whole pool
        self.attention, self.fmt = attention, fmt
        # index tensors broadcasting to (2, B): k and v, each sequence's slot
        self.k_or_v = torch.arange(2, device=kv.device).view(2, 1)
        self.write_slots = write_slots.view(1, -1)

    def attend(self, layer, q, k, v, mask):
        # k, v (B, n_kv_head, 1, hd). One index_put_ on the pool itself, not a write into the
        # view kv[layer]: in a compiled graph, a write into a view of an input becomes a copy
        # of the whole input (generation/compiled_step.py's StaticCache says more)
        layer_index = torch.full((1, 1), layer, device=k.device)
        new = torch.stack([k, v])[:, :, :, 0]                               # (2, B, n_kv_head, hd)
        if self.fmt is not None:
            new = self.fmt.encode(new)                                      # (2, B, n_kv_head, width)
        self.kv.index_put_((layer_index, self.k_or_v, self.write_slots), new)
        return self.attention(q, self.kv[layer, 0], self.kv[layer, 1], self.read_slots, self.visible,
                              self.fmt)


def decode_step(model, tokens, positions, kv, read_slots, write_slots, visible, temperature, noise,
                attention=decode_attention, fmt=None):
    """One decode step over the pool: the logits (B, V) and each row's next token (B,),
    drawn by sample.sample_rows_with_noise (temperature (B,), Gumbel noise (B, vocab)) inside
    the step, so that what comes back is ready to hand out. tokens, positions (B, 1): each
    sequence's newest token and its position; kv: the pool's buffer, (n_layer, 2, slots,
    n_kv_head, hd), written in place; read_slots (B, S), write_slots (B,), visible (B, S)
    as decode_attention takes them; attention: the paged kernel (decode_attention or
    hand_written_kernel()); fmt: the pool's format (BlockPool.format; None: the model's
    dtype). The cached forward (kv_cache.CachedModel.forward_at) with the pool as its cache."""
    cache = PagedKernelCache(kv, read_slots, write_slots, visible, attention, fmt)
    # no mask: each row's one query sees the columns `visible` lets it see, in the kernel
    logits = model.forward_at(tokens, positions, cache, mask=None)[:, -1]  # (B, V)
    vocab = noise.size(1)  # the tokenizer's: the embedding table may have padding rows
    return logits, sample_rows_with_noise(logits[:, :vocab], noise, temperature)


def frozen_decode_step(model, tokens, positions, kv, read_slots, write_slots, visible, temperature, noise,
                       attention, fmt):
    """decode_step, as a function of its own: torch.compile keeps the graphs it makes per
    function, and these (the weights frozen in) must not be found for a call without."""
    return decode_step(model, tokens, positions, kv, read_slots, write_slots, visible, temperature, noise,
                       attention, fmt)


_compiled = {}  # freeze -> the step compiled (torch.compile's wrapper, made once per process)
GRAPH_LIMIT = 64  # graphs of the frozen step per process: two or three per model (see below)


def compiled_decode_step(model, tokens, positions, kv, read_slots, write_slots, visible, temperature,
                         noise, freeze=False, fmt=None):
    """decode_step compiled whole by torch.compile (the first calls compile: seconds to a
    minute): the model's matmuls, the small operations between them and the paged
    attention of every layer in one graph, where eager PyTorch runs each as its own call.
    It is told which sizes change from call to call: the batch and the context (B, S) are
    compiled as variables, so one graph serves every step (and one more for a batch of 1:
    compile makes sizes 0 and 1 constants). The rest (heads, head size, the pool) stay
    constants, which lets the C++ unroll the loop over a head's values; dynamic=True would
    make every size a variable.

    freeze=True (the engine's compile option) compiles it as generation/compiled_step.py
    builds its step (BUILD_OPTIONS): with freezing, the weights become constants of the
    graph, laid out once for their kernel, and with max_autotune, each matmul timed at
    build time through oneDNN (its blocked layout; generation/cpu_layout.py does the same
    for eager calls) and through inductor's own C++ template (which wins at the bundled
    model's 256-wide Linears), the faster compiled in. Either beats MKL, which packs the
    weight again on every call (docs/serving.md measures it). The price: the graph keeps the
    weights it was compiled with, so a model's weights must not change while an engine
    serves it, and each model is a graph of its own (compiled again for every model, timing
    its matmuls: a minute or more per engine in a process that makes many, hence not the
    default). A server compiles two, three over bf16 weights (Engine.warm_up); the limit of
    graphs per function is raised for processes that make many engines. The options are
    read when a graph is compiled, inside the call: hence the patch around it
    (torch.compile's options= does not reach freezing). With freeze the
    step's paged kernel is also the hand-written one (attention_for), which reads the pool
    nearer the memory's speed (docs/serving.md). fmt: the pool's format (decode_step)."""
    if freeze not in _compiled:
        _compiled[freeze] = torch.compile(frozen_decode_step if freeze else decode_step, fullgraph=True)
    for tensor in (tokens, positions, read_slots, write_slots, visible, temperature, noise):
        torch._dynamo.maybe_mark_dynamic(tensor, 0)
    for tensor in (read_slots, visible):
        torch._dynamo.maybe_mark_dynamic(tensor, 1)
    options = BUILD_OPTIONS if freeze else {}
    with torch._inductor.config.patch(options), torch._dynamo.config.patch(recompile_limit=GRAPH_LIMIT), \
            warnings.catch_warnings():
        # a deprecation notice from inside torch's autotuning, nothing of ours
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)
        step = _compiled[freeze]
        if freeze:
            return step(model, tokens, positions, kv, read_slots, write_slots, visible, temperature, noise,
                        attention_for(kv, fmt), fmt)
        return step(model, tokens, positions, kv, read_slots, write_slots, visible, temperature, noise,
                    fmt=fmt)
