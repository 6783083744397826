"""
GET /v1/cache: the paged pool (paged_cache.py) as one small JSON body, for the web page
(serving/web/), which draws it as a grid of blocks, and for any script that wants to watch.

Every block of the pool is in one of four states:

    free     no sequence holds it and the prefix index does not know it: never used, or
             its contents were evicted
    cached   no sequence holds it, but it still has a full block's keys and values and its
             prefix hash is in the index: a prompt that starts the same way takes it back
             without computing it (it is overwritten when the free list comes round to it)
    held     one running sequence holds it (reference count 1)
    shared   several running sequences hold it (reference count > 1): prefix caching at work

    {"cells": ".hhhss..cc", "blocks_per_cell": 1,     a letter a cell: "." free, "c" cached,
     "counts": {"free": 1010, "cached": 2, "held": 10, "shared": 2},       "h" held, "s" shared
     "requests": [{"id": "cmpl-...", "choice": 0, "state": "running",
                   "blocks": [1, 2, 3], "tokens": 40, "prompt_tokens": 30, ...}],
     "formula": {"bytes_per_token": ..., ...}, "engine": Engine.stats(), "model": {...}}

Cell i covers blocks 1 + i * blocks_per_cell onwards (block 0 is the null block, never
anyone's); a pool of more than MAX_CELLS blocks is drawn with several blocks a cell, each
cell showing its busiest block (shared > held > cached > free), so the body stays small
however large the pool. `requests` lists at most MAX_LISTED sequences, running ones first,
each with its block table.

The view is read while the engine's thread runs, without stopping it: each copy (the
running list, a block table, the prefix index's blocks) is one C-level operation, which
CPython's GIL does not interleave with the engine's Python, but two copies may straddle a
step, so a view can be a step out of date in places (a block counted as held by a
sequence that has just finished); the next poll corrects it. Its cost is one pass over the
blocks that are held or cached, never one over tokens: 0.2 ms for the bundled model's 1,024
blocks, 75 ms for a pool of 100,000 with 80,000 cached (a 2-core VM running a dozen other
jobs, 2026-12-03). It is a Python loop, holding the GIL (the page polls fast only while it
streams), and runs no torch operation: on the HTTP thread one would start a second OpenMP
team beside the engine's (engine.py, Engine.run).
"""

from collections import Counter

from kv_quant import cache_bytes, head_bytes
from serving.scheduler import RUNNING

MAX_CELLS = 4096    # a 64 x 64 grid at most
MAX_LISTED = 128    # sequences listed, with their block tables
FREE, CACHED, HELD, SHARED = range(4)  # also the order of "busiest", for a cell of many blocks
TO_LETTERS = bytes.maketrans(bytes(range(4)), b".chs")  # a state's byte -> its letter


def pool_formula(model, pool):
    """The cache formula's numbers for this model and pool (kv_quant.cache_bytes):
    bytes per token = 2 (keys and values) x n_layer x n_kv_head x bytes a head, where a
    head is head_dim values of the pool's dtype, or, in an int8/int4 pool, their codes and
    scales (kv_quant.head_bytes)."""
    config = model.config
    return {"n_layer": config.n_layer, "n_kv_head": config.n_kv_head, "head_dim": config.head_dim,
            "dtype": pool.kv_dtype, "bytes_per_head": head_bytes(config.head_dim, pool.kv_dtype),
            "bytes_per_token": cache_bytes(config, 1, 1, pool.kv_dtype),
            "tokens_per_block": pool.tokens_per_block, "bytes_per_block": pool.block_bytes(),
            "num_blocks": pool.num_blocks,
            "pool_bytes": pool.nbytes()}  # with the null block: num_blocks + 1 blocks


def block_states(pool, tables):
    """One byte a block, FREE, CACHED, HELD or SHARED (block 0, the null block, FREE),
    from the prefix index and the block tables of the running sequences."""
    states = bytearray(pool.num_blocks + 1)  # all FREE (0)
    for block in list(pool.cached.values()):  # blocks whose contents a prefix can hit
        states[block] = CACHED                # (those held are overwritten next)
    for block, holders in Counter(block for table in tables for block in table).items():
        states[block] = SHARED if holders > 1 else HELD
    states[0] = FREE
    return states


def cells(states):
    """The blocks after the null one, a letter each (TO_LETTERS), at most MAX_CELLS long:
    (letters, blocks per cell)."""
    blocks = bytes(states[1:])
    per_cell = -(-len(blocks) // MAX_CELLS)
    if per_cell > 1:  # the busiest block of each cell
        blocks = bytes(max(blocks[i:i + per_cell]) for i in range(0, len(blocks), per_cell))
    return blocks.translate(TO_LETTERS).decode(), per_cell


def describe(seq, label):
    """One sequence for the page: label is (reply id, choice index), or None for one that
    no HTTP request started (the engine's warm-up)."""
    reply_id, choice = label or (None, None)
    return {"id": reply_id, "choice": choice, "state": seq.state, "blocks": list(seq.blocks),
            "tokens": seq.context_len, "prompt_tokens": seq.prompt_len,
            "generated": len(seq.tokens) + len(seq.unfed) - seq.prompt_len,
            "cached_prompt_tokens": seq.cached_prompt_tokens}


def cache_view(engine, label, formula, model_info):
    """The JSON body of GET /v1/cache. label(request): (reply id, choice) or None;
    formula: pool_formula's (it does not change); model_info: what the page shows of the model."""
    scheduler = engine.scheduler
    running, waiting = list(scheduler.running), list(scheduler.waiting)
    listed = [describe(seq, label(seq)) for seq in (running + waiting)[:MAX_LISTED]]
    tables = [r["blocks"] for r in listed if r["state"] == RUNNING]
    tables += [list(seq.blocks) for seq in running[MAX_LISTED:]]  # not listed, but drawn
    states = block_states(engine.pool, tables)
    letters, per_cell = cells(states)
    counts = [states.count(state, 1) for state in (FREE, CACHED, HELD, SHARED)]  # from block 1
    return {"cells": letters, "blocks_per_cell": per_cell,
            "counts": dict(zip(("free", "cached", "held", "shared"), counts)),
            "requests": listed, "requests_left_out": max(len(running) + len(waiting) - MAX_LISTED, 0),
            "formula": formula, "engine": engine.stats(), "model": model_info}
