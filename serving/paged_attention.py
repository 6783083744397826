"""
Attention that reads the paged cache where it lies: a paged attention kernel, written in
a dozen lines of PyTorch and made into one by torch.compile.

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

Only decode (one new query per sequence) goes through it; a prefill's queries need the
causal mask, and its matmuls dwarf the copy, so prefills keep the gather and SDPA.
"""

import torch


def decode_attention(q, k_pool, v_pool, slots, visible):
    """q (B, nh, 1, hd): each sequence's new query; k_pool, v_pool (pool slots, n_kv_head,
    hd): one layer of the pool; slots (B, S): the pool slot of each column of each sequence;
    visible (B, S): False where a column is padding. Returns (B, nh, 1, hd).

    With grouped-query attention (n_kv_head < nh) the query heads that share a stored head
    are read as a group: q as (B, n_kv_head, group, hd), each stored key used group times
    where it lies."""
    B, nh, _, hd = q.shape
    n_kv_head = k_pool.size(1)
    q = q.view(B, n_kv_head, nh // n_kv_head, hd).float()          # (B, kv, group, hd)
    keys = k_pool[slots].float()                                    # (B, S, kv, hd), fused
    scores = (q[:, None] * keys[:, :, :, None]).sum(-1) / hd ** 0.5  # (B, S, kv, group)
    scores = scores.masked_fill(~visible[:, :, None, None], float("-inf"))
    p = scores.softmax(dim=1)                                       # over the columns
    values = v_pool[slots].float()                                  # (B, S, kv, hd), fused
    out = (p[..., None] * values[:, :, :, None]).sum(dim=1)         # (B, kv, group, hd)
    return out.reshape(B, nh, 1, hd).to(v_pool.dtype)


_compiled = None  # decode_attention compiled, once per process


def paged_decode_attention(q, k_pool, v_pool, slots, visible):
    """decode_attention compiled (the first calls compile: seconds), told which sizes
    change from call to call: the batch and the context (B, S) are compiled as variables,
    so one graph serves every step (and one more for a batch of 1: compile makes sizes 0
    and 1 constants). The rest (heads, head size, the pool) stay constants, which lets the
    C++ unroll the loop over a head's values; dynamic=True would make every size a
    variable."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(decode_attention, fullgraph=True)
    for tensor in (q, slots, visible):
        torch._dynamo.maybe_mark_dynamic(tensor, 0)
    for tensor in (slots, visible):
        torch._dynamo.maybe_mark_dynamic(tensor, 1)
    return _compiled(q, k_pool, v_pool, slots, visible)
