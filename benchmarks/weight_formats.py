"""
Weight-only quantization (weight_quant.py) at the level of its kernels: every Linear of a
model, one matrix-vector product each, in each weight format, activation dtype and int4
group size; and how many bytes of weights a decode step reads in each format (the
decode-speed table's floor, decode_speed.py).
"""

import copy
import time

import torch
import torch.nn as nn

from benchmarks.timing import repeat
from generation import quantized_matmul
from generation.loop import synchronize
from weight_quant import INT4_GROUP_SIZE, INT4_GROUP_SIZES, Int4Linear, Int8Linear, QuantizedLinear


def linear_layers(model):
    return [m for m in model.modules() if isinstance(m, (nn.Linear, QuantizedLinear))]


def weight_bytes(layer):
    """Bytes a Linear layer's weight takes, in whatever format it is stored."""
    return layer.weight.nbytes if isinstance(layer, nn.Linear) else layer.weight_nbytes()


def weight_bytes_per_token(model):
    """Bytes of weights one batch-1 decode step reads: each Linear's weight once. wte is
    read through the tied lm_head (its embedding lookup reads one row), wpe one row: both
    left out, as in cache_cost.bandwidth_floor."""
    return sum(weight_bytes(m) for m in linear_layers(model))


@torch.inference_mode()
def layers_ms(layers, device, dtype, reps):
    """One matrix-vector product through each layer, as a decode step runs them (casts and
    bias included), inputs in the model's dtype: the kernels' share of a step, in ms."""
    vectors = {m.in_features: torch.randn(1, 1, m.in_features, device=device, dtype=dtype)
               for m in layers}

    def once():
        synchronize(device)
        t0 = time.perf_counter()
        for m in layers:
            m(vectors[m.in_features])
        synchronize(device)
        return time.perf_counter() - t0
    return 1e3 * min(repeat(once, reps))


def row_major(linear):
    out = copy.deepcopy(linear)
    out.weight.data = out.weight.data.contiguous()
    return out


def kernel_timings(model, shape, reps):
    """Every Linear of `model` (a random-weight model of this shape), one matrix-vector
    product each, in each weight format, kernel activation dtype and int4 group size: what
    the kernels cost apart from the rest of a step. Each variant is built, timed and freed
    in turn; the model itself is left as it was."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    device = model.lm_head.weight.device
    fp32, bf16 = torch.float32, torch.bfloat16
    variants = {  # label: (how to build the layers, the model's dtype around them)
        "fp32, column-major (our layout)": (lambda m: m, fp32),
        "fp32, row-major (nn.Linear's default)": (row_major, fp32),
        "bf16": (lambda m: copy.deepcopy(m).to(bf16), bf16),
        "int8, torch's, bf16 activations": (lambda m: Int8Linear(m, kernel="torch"), fp32),
        "int8, torch's, fp32 activations": (lambda m: Int8Linear(m, activation_dtype=fp32), fp32),
        **{f"int4 groups of {g}, torch's, bf16 activations": (lambda m, g=g: Int4Linear(m, g, kernel="torch"), fp32)
           for g in INT4_GROUP_SIZES if model.config.n_embd % g == 0},
        f"int4 groups of {INT4_GROUP_SIZE}, torch's, fp32 activations":
            (lambda m: Int4Linear(m, activation_dtype=fp32), fp32),
    }
    if quantized_matmul.kernels() is not None:  # ours, where it could be built
        variants["int8, ours (int8 activations)"] = (lambda m: Int8Linear(m, kernel="ours"), fp32)
        variants[f"int4 groups of {INT4_GROUP_SIZE}, ours (int8 activations)"] = (
            lambda m: Int4Linear(m, kernel="ours"), fp32)
    timings = {}
    for label, (build, dtype) in variants.items():
        layers = [build(m) for m in linears]
        timings[label] = {"ms": layers_ms(layers, device, dtype, reps),
                          "weight_bytes": sum(weight_bytes(m) for m in layers)}
    return {"shape": shape, "variants": timings}
