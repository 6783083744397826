"""
A decode step whose shapes never change, so that torch.compile compiles it once.

A batch-1 decode step does little arithmetic: it reads every weight once and makes one
token. On a CPU the rest of its time is overhead, not work: Python and PyTorch's dispatch
run ~15 small operations per layer, each paying microseconds before any number is touched
(on the bundled model that is most of a step). torch.compile traces the step into one graph,
fuses the small operations (LayerNorm, GELU, the residual adds, the mask) into generated
C++ loops and calls the matmul kernels directly, so the Python is gone.

But it can only do that for shapes it has seen. The eager step's shapes change every step
(the cache holds one more column, the mask and positions slice moves), and a graph keyed
on them recompiles each time: that is why compiling KVCacheGPT.forward as it is made
decoding 7x slower. Here every shape is fixed for the whole generation:
  - the cache is the preallocated KVCache, context_len columns, and attention reads all of
    them, with a mask that hides the columns not written yet (and any left padding);
  - the step's position is a tensor, not a Python int: the write index for the new key and
    value (index_put_ at that column) and the row of the position table it looks up.
A step may also feed a fixed number T > 1 of tokens per row (speculative decoding verifies
its proposals in one such step: generation/speculative.py): T is part of the shape, so each
T is a graph of its own, compiled once.
Reading the whole buffer costs a little (the bundled model's full cache is 3 MB against
23 MB of weights; GPT-2's 75 MB against 494 MB): less than what compiling removes.

Only decode is compiled; the prompt's prefill and the reprefill past the context change
shape by nature and stay eager (generation/loop.py). Rows that finish early keep running
(unseen): dropping them would change the batch size and so the graph.
"""

import time

import torch

from kv_quant import dtype_name


class StaticStep:
    """What attention sees as its cache inside the compiled step (a kv_cache.Cache):
    it writes the new column at a position held in a tensor and attends over the whole
    buffer, so no shape depends on how much has been cached."""

    def __init__(self, kv, new_columns):
        self.kv = kv  # (n_layer, 2, B, nh, max_len, hd)
        B, nh, T = kv.size(2), kv.size(3), new_columns.size(0)
        # index tensors broadcasting to (2, B, nh, T): k and v, every row and head, the T
        # new columns (new_columns (T,) LongTensor: length, length + 1, ...)
        self.k_or_v = torch.arange(2, device=kv.device).view(2, 1, 1, 1)
        self.rows = torch.arange(B, device=kv.device).view(1, B, 1, 1)
        self.heads = torch.arange(nh, device=kv.device).view(1, 1, nh, 1)
        self.columns = new_columns.view(1, 1, 1, T)

    def attend(self, layer, q, k, v, mask):
        # k, v: (B, nh, T, hd), written at the new columns of this layer. One index_put_ on
        # the whole buffer, not a write into the view kv[layer]: torch.compile turns a write
        # into a view of its input into a copy of the whole buffer (every layer, every step:
        # 3x slower than eager), while a write into the input itself stays in place.
        layer_index = torch.full((1, 1, 1, 1), layer, device=k.device)
        self.kv.index_put_((layer_index, self.k_or_v, self.rows, self.heads, self.columns),
                           torch.stack([k, v]))  # (2, B, nh, T, hd)
        k_all, v_all = self.kv[layer, 0], self.kv[layer, 1]  # (B, nh, max_len, hd): every column
        # Attention written out instead of SDPA: for a few queries, torch.compile fuses these
        # into its own loops, while SDPA's CPU kernel is a separate call costing more than its
        # arithmetic (a large share of a bundled step). Unwritten columns masked.
        scores = (q @ k_all.transpose(-2, -1)) * q.size(-1) ** -0.5          # (B, nh, T, max_len)
        weights = scores.masked_fill(~mask, float("-inf")).float().softmax(-1).to(q.dtype)
        return weights @ v_all                                                # (B, nh, T, hd)


def decode_step(model, tokens, kv, length, pad):
    """Logits (B, T, V) for tokens (B, T) at columns length.. of the cache buffer kv (length:
    (1,) LongTensor); pad (B,): left-padding columns per row (zeros when there is none).

    KVCacheGPT.forward, with its three cache-dependent parts written with tensors:"""
    max_len = kv.size(4)
    new_columns = length + torch.arange(tokens.size(1), device=kv.device)  # (T,)
    # (1) positions: each row's column minus its padding, looked up by tensor
    positions = new_columns[None, :] - pad[:, None]                       # (B, T)
    x = model.transformer.wte(tokens) + model.transformer.wpe(positions)  # (B, T, C)
    # (3) the mask: for the token at column c, the keys up to c (its own included), none in
    # a row's padding
    columns = torch.arange(max_len, device=kv.device)
    visible = ((columns[None, None, :] <= new_columns[None, :, None])
               & (columns[None, None, :] >= pad[:, None, None]))          # (B, T, max_len)
    mask = visible[:, None]                                               # (B, 1, T, max_len)
    cache = StaticStep(kv, new_columns)
    for layer, block in enumerate(model.transformer.h):
        # (2) the cache update, inside attention, as in the eager model
        x = block(x, cache=cache, layer=layer, mask=mask)
    return model.head(x)


# dynamic=False: every step has the same shapes, and a static graph is the fastest one
# inductor makes; fullgraph=True: a break in the graph would bring Python back (an error
# instead); cpp_wrapper: the code that calls the graph's ~60 kernels in turn is C++ too,
# not Python (a sixth faster on the bundled model here, for a longer first compile).
# The tests swap in backend="eager" to check the graph logic without compiling C++.
COMPILE_OPTIONS = dict(dynamic=False, fullgraph=True, options={"cpp_wrapper": True})


def compiled_decode_step(model):
    """decode_step compiled for this model, built once and kept on the model (torch.compile
    caches the graph for the shapes it has seen: one batch size, one dtype)."""
    if getattr(model, "_compiled_decode_step", None) is None:
        model._compiled_decode_step = torch.compile(decode_step, **COMPILE_OPTIONS)
    return model._compiled_decode_step


def compile_for(model, cache, tokens_per_step=1):
    """Compile the step for this cache's shapes and tokens_per_step tokens per row before
    decoding, on a scratch copy of the buffer (the real one is untouched); returns the seconds
    it took, which the loop reports apart from the decode speed. cache: a kv_cache.KVCache in
    the model's dtype."""
    if getattr(cache, "kv_dtype", None) != dtype_name(model.lm_head.weight.dtype):
        # the step writes raw keys and values of the model's dtype into the buffer
        raise ValueError("the compiled decode step needs the preallocated cache in the "
                         "model's dtype (no other cache_kind)")
    # the step attends over every column, the unwritten ones masked; but a masked NaN still
    # poisons attention (0 x NaN = NaN), and the buffer is torch.empty: any bits at all.
    # Zero what has not been written, once per generation.
    cache.kv[..., cache.length:, :].zero_()
    t0 = time.perf_counter()
    token = torch.zeros(cache.kv.size(2), tokens_per_step, dtype=torch.long, device=cache.kv.device)
    pad = torch.zeros_like(token[:, 0].contiguous())  # laid out as the real one: one graph
    compiled_decode_step(model)(model, token, torch.empty_like(cache.kv),
                                torch.tensor([0], device=token.device), pad)
    if token.device.type == "cuda":
        torch.cuda.synchronize(token.device)
    return time.perf_counter() - t0


def decode(model, tokens, cache):
    """Logits (B, T, V) for tokens (B, T) through the compiled step; the step writes its
    columns into the cache's buffer in place, and the cache counts them."""
    tokens = tokens.contiguous()  # a graph is made for given strides too: a slice would be a new one
    pad = cache.pad.contiguous() if cache.pad is not None else torch.zeros_like(tokens[:, 0])
    length = torch.tensor([cache.length], device=tokens.device)
    logits = compiled_decode_step(model)(model, tokens, cache.kv, length, pad)
    cache.advance(tokens.size(1))
    return logits
