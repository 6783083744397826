"""
A bf16 model's decode-step matrix products on the CPU (bf16_matmul.cpp), and the Linear
that calls them: Bf16Linear, which every command's model gets for its bf16 Linears
(cpu_layout.pack_linears, called where the CPU layout of the weights is chosen:
plumbing/cli.prepare_for_generation).

Why our own: a decode step multiplies each weight by one row, so its floor is the weight's
bytes over the memory's speed. torch's bf16 F.linear at one row runs at 1.5-2.2x that floor
(one thread, 2-core AMD EPYC with AVX-512 BF16, every 1B-shape Linear; with two threads on
that shared box often 5-30x, waiting on a descheduled thread), and its column-major
weights (a bf16 copy of base_model.store_linears_column_major's fp32 ones) 2.3-2.6x slower
again. oneDNN reaches the floor with its own blocked copy of the weight
(mkldnn._reorder_linear_weight, what cpu_layout.py packs fp32 weights into), but that is a
second copy: where the output layer is tied to the embedding (Llama 3.2, GPT-2), the table
would be held twice, and a memory-mapped checkpoint's weights could no longer stay file
pages. Ours reads the weight where it lies, row-major (N, K), in fp32 sums of bf16
products: with AVX-512 BF16's vdpbf16ps where the CPU has it, else widened to fp32 (AVX-512,
AVX2, plain C++), picked at run time (docs/benchmarks.md measures each).

From MATVEC_ROWS rows on (a prompt's prefill, a large batch) the product is bound by
arithmetic, not bytes, and torch's F.linear (oneDNN's bf16 GEMM) does it faster.

The first call on a machine compiles the library (plumbing/kernel_build.py, ~20 s; later
processes load it); where it cannot be built, `kernels()` is None (with a warning) and
bf16 Linears stay torch's. The operator has a fake (its output's shape), so torch.compile
and AOTInductor trace through it and the compiled step calls it too.
"""

import functools
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from plumbing.kernel_build import build_kernel

KERNEL_SOURCE = Path(__file__).with_name("bf16_matmul.cpp")
# the most rows of x ours multiplies; from there on torch's F.linear is as fast or faster
# (one thread, the 1B shape's Linears, a 2-core AVX-512 BF16 EPYC: ours took 0.45-0.6x
# torch's time at 1 row, 0.8-1.05x at 8, 0.9-1.15x at 16)
MATVEC_ROWS = 8


@functools.cache
def kernels():
    """torch.ops.kvcache_gpt_bf16 (bf16_matmul, bf16_kernel_isas), built or loaded on the
    first call; None, with a warning, where it cannot be built."""
    error = build_kernel(KERNEL_SOURCE, "kvcache_gpt_bf16_matmul")
    if error:
        warnings.warn(f"our bf16 matmul kernel could not be built ({error}); using torch's",
                      stacklevel=2)
        return None

    @torch.library.register_fake("kvcache_gpt_bf16::bf16_matmul")
    def _(x, w, bias, isa):  # shapes only, for torch.compile's tracing
        return x.new_empty(x.shape[0], w.shape[0])
    return torch.ops.kvcache_gpt_bf16


@functools.cache
def best_isa():
    """The fastest instruction set this CPU runs ('avx512bf16', 'avx512', 'avx2' or
    'portable')."""
    return kernels().bf16_kernel_isas()[-1]


def computes_bf16_natively():
    """Whether this CPU multiplies bf16 in hardware (AVX-512 BF16; the Xeons with AMX have it
    too) and our kernel is built: there a bf16 model decodes faster than an fp32 one (half
    the bytes, at their floor) and prefills faster too (oneDNN's bf16 GEMM), so --dtype
    auto keeps a bf16 checkpoint in bf16 (plumbing/checkpoint.auto_dtype). Elsewhere bf16
    is widened to fp32 instruction by instruction, and fp32 stays the safer default."""
    return kernels() is not None and best_isa() == "avx512bf16"


class Bf16Linear(nn.Linear):
    """nn.Linear (the same weight and bias Parameters: the state dict, a tied embedding and
    every isinstance check are unchanged) whose products of up to MATVEC_ROWS rows of bf16
    x run our kernel; anything else (more rows, another dtype, gradients wanted) is
    F.linear's. Made by cpu_layout.pack_linears."""

    def __init__(self, linear):
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a new weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)  # None too, as nn.Linear registers it
        self.isa = best_isa()

    def forward(self, x):
        rows = x.numel() // self.in_features
        if not self.kernel_applies(x, rows):
            return F.linear(x, self.weight, self.bias)
        # the op by its registered name, not through kernels(): torch.compile traces this
        # line, and the library is loaded already (best_isa() in __init__)
        y = torch.ops.kvcache_gpt_bf16.bf16_matmul(x.reshape(rows, self.in_features), self.weight, self.bias,
                                                   self.isa)
        return y.reshape(*x.shape[:-1], self.out_features)  # (..., out)

    def kernel_applies(self, x, rows):
        """A few rows (a decode step's, a small batch's), everything bf16 and on the CPU, the
        weight row-major (the kernel reads it as it lies), and no gradient to the weight
        (training: the kernel has no backward). A graph being compiled is generation's
        decode step (torch.export traces it with gradients on, and nothing flows back)."""
        wants_gradient = torch.is_grad_enabled() and self.weight.requires_grad and not torch.compiler.is_compiling()
        return (rows <= MATVEC_ROWS and x.device.type == "cpu" and x.dtype == self.weight.dtype == torch.bfloat16
                and self.weight.is_contiguous() and (self.bias is None or self.bias.dtype == torch.bfloat16)
                and not wants_gradient)


def kernel_fits(linear):
    """Whether a Linear is one Bf16Linear serves: a plain nn.Linear with a bf16 weight on the
    CPU, where our kernel is built."""
    return (type(linear) is nn.Linear and linear.weight.dtype == torch.bfloat16
            and linear.weight.device.type == "cpu" and kernels() is not None)


def for_our_kernel(linear):
    """linear as a Bf16Linear over its own Parameters, the weight made row-major first where
    it is not (a bf16 copy of a column-major fp32 model: base_model.store_linears_column_major),
    in place: one matrix at a time is copied, and the old layout is freed."""
    if not linear.weight.is_contiguous():
        linear.weight.data = linear.weight.data.contiguous()
    return Bf16Linear(linear)
