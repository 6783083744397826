"""
The sections of benchmark.py, one idea per module (benchmark.py, the command line, runs
them in turn; report.py prints them):

    timing.py          how every figure is taken: a warm-up, repeats, median [min-max], turns
    cache_cost.py      what the cache buys: the seed's demo, cost vs generated length (naive,
                       torch.cat, preallocated), and the memory-bandwidth floor of a decode step
    decode_speed.py    ours eager, compiled, bf16, int8 and int4 beside llama.cpp f32, f16 and
                       q8_0 on identical weights, each against the floor its bytes set
    weight_formats.py  the quantized kernels alone (every Linear once, in each weight format),
                       and the bytes of weights a step reads in each
    batching.py        many different prompts decoded as one batch: aggregate tokens/s
    peers.py           the systems people use, on identical weights: transformers, llama.cpp
    kv_dtypes.py       the cache's dtypes at a long context, and transformers' quantized cache
    llama_speed.py     a Llama-3.2-1B-shaped model beside llama.cpp f32, q8_0, q4_0 (--llama-speed)
    context_policy.py  reprefill against sinks past the context: cost per token, bits/char
                       (--context-policies)
    speculative.py     speculative decoding: prompt lookup and a draft model, beside
                       transformers' and llama.cpp's own
    structured.py      structured outputs: the mask's cost per step against a decode step
                       (bundled, Llama-3.2-1B's vocabulary), and ~200 random constraints
                       sampled: every ended output valid (its own command, not a section)
    report.py          the tables, and the plot
"""
