"""
Prompt processing (prefill): how many prompt tokens a second each form of ours pushes
through the model in one pass, against the roofline of this CPU's matrix products.

Unlike a decode step, a prefill of T tokens multiplies every weight by T rows at once, so
it is bound by arithmetic, not by the bytes of the weights: each prompt token costs
2 * (the blocks' Linear weights) multiply-adds and adds, plus its attention over the
tokens before it (the output layer runs on the last position only). The ceiling is the
CPU's own matrix-product speed in the form's dtype, measured here on the model's largest
prefill product (T x width) @ (width x SwiGLU width). The quantized forms dequantize each
weight for a prompt (weight_quant.FLOAT_MATMUL_ROWS) and multiply in bf16 where the CPU
has bf16 arithmetic, else in fp32: that dtype's ceiling is theirs.
"""

import time

import torch
import torch.nn as nn

from benchmarks.decode_speed import OURS, ours_variant
from benchmarks.timing import spread
from weight_quant import QuantizedLinear

FORMS = {"fp32": "ours fp32 eager", "bf16": "ours bf16", "bf16-torch": "ours bf16, torch's matmul",
         "int8": "ours int8", "int4": "ours int4"}
WARM_UP_TOKENS = 16  # a short pass first: a model's first forward pays one-time costs


def flops_per_prompt_token(model, prompt_tokens):
    """Multiply-adds x 2 for one token of a T-token prompt: the blocks' Linear weights, and
    attention's scores and weighted sum over (on average) (T + 1) / 2 earlier positions."""
    config = model.config  # model: the fp32 one, its Linears nn.Linear
    linear_weights = sum(m.weight.numel() for m in model.modules()
                         if isinstance(m, nn.Linear) and m is not model.lm_head)
    attention = 2 * config.n_layer * config.n_embd * (prompt_tokens + 1) / 2  # q.k and p.v
    return 2 * (linear_weights + attention)


def matmul_peak(model, dtype, reps, rows=512):
    """GFLOP/s of torch's matrix product in dtype on the model's largest prefill shape."""
    width, hidden = model.config.n_embd, getattr(model.config, "intermediate_size", 4 * model.config.n_embd)
    x, w = torch.randn(rows, width, dtype=dtype), torch.randn(hidden, width, dtype=dtype)
    times = []
    for _ in range(reps + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        x @ w.T
        times.append(time.perf_counter() - t0)
    return 2 * rows * width * hidden / min(times[1:]) / 1e9


def prefill_seconds(model, prompt):
    """One prefill of prompt (1, T): the seconds of its pass (GenerationStats.prefill_seconds)."""
    from generation.loop import GenerationStats
    stats = GenerationStats()
    model.generate(prompt, 1, temperature=0, stats=stats)
    return stats.prefill_seconds


def prefill_rows(fp32_model, forms, lengths, reps, group_size=None, quantized_dtype=None):
    """{form: {"tok_s": {T: spread}, "GFLOPs": {T: median GFLOP/s}}} for each form of FORMS,
    one form built at a time (and freed), each length timed reps times after a warm-up.
    quantized_dtype: the int8 and int4 forms' model dtype instead of OURS' (decode_speed's
    model_table)."""
    vocab = fp32_model.config.vocab_size
    prompts = {T: torch.randint(vocab, (1, T), generator=torch.Generator().manual_seed(T)) for T in lengths}
    rows = {}
    for form in forms:
        dtype, scheme, _, kernels = OURS[FORMS[form]]
        dtype = quantized_dtype if scheme and quantized_dtype else dtype
        model = ours_variant(fp32_model, dtype, scheme, group_size, False, kernels)
        prefill_seconds(model, prompts[lengths[0]][:, :WARM_UP_TOKENS])
        rates = {T: [T / prefill_seconds(model, prompts[T]) for _ in range(reps)] for T in lengths}
        # the dtype its prompt's products run in: a quantized model's in bf16 where the CPU
        # has bf16 arithmetic (weight_quant.QuantizedLinear.prompt_dtype), else in fp32
        multiplies_in = next((m.prompt_dtype for m in model.modules() if isinstance(m, QuantizedLinear)), dtype)
        rows[form] = {"multiplies_in": str(multiplies_in).removeprefix("torch."),
                      "tok_s": {T: spread(r) for T, r in rates.items()},
                      "GFLOPs": {T: spread(r)["median"] * flops_per_prompt_token(fp32_model, T) / 1e9
                                 for T, r in rates.items()}}
        del model
    return rows
