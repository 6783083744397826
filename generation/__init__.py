"""
Generation: a model and prompts in, tokens out, one step at a time.

    loop.py           the cached generation loop, Generation: prefill, decode, past the
                      context reprefill or (rotary models) evict, finished rows; every caller
                      generates through it
    rows.py           the rows of a generation: its cache, the token of each column, the
                      padding, and every move on them (select, drop, forget, rollback)
    steps.py          one decode step, step(newest): plain, compiled, or speculative
    compiled_step.py  the decode step with shapes that never change, compiled once (--compile)
    step_cache.py     the compiled steps kept on disk, keyed by the weights, shapes, settings and
                      machine: built once per model and machine (private_folder.py: the
                      folder's checks)
    cpu_layout.py     large float32 Linear weights packed once for oneDNN's matmul (batches,
                      prefills and the serving engine run 1.3-2.8x faster per matmul)
    speculative.py    speculative decoding: proposers (prompt lookup, a draft model) and the
                      rule that verifies their tokens in one pass (--speculate)

generate.py is the command that drives it (text in, text out); kv_cache.py's demo, the
benchmarks and the tests call it directly.
"""
