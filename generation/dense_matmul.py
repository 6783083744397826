"""
A decode step's matrix products over a dense weight on the CPU (dense_matmul.cpp): every
bf16 Linear of a model, and a real-size fp32 model's large ones (cpu_layout.py says which);
and the Linear that calls them: DenseLinear, which every command's model gets for those
Linears (cpu_layout.pack_linears, called where the CPU layout of the weights is chosen:
plumbing/cli.prepare_for_generation).

Why our own: a decode step multiplies each weight by one row, so its floor is the weight's
bytes over the memory's speed. torch's bf16 F.linear at one row runs at 1.5-2.2x that floor
(one thread, 2-core AMD EPYC with AVX-512 BF16, every 1B-shape Linear; with two threads on
that shared box often 5-30x, waiting on a descheduled thread), and its column-major
weights (a bf16 copy of base_model.store_linears_column_major's fp32 ones) 2.3-2.6x slower
again. oneDNN reaches the floor with its own blocked copy of the weight
(mkldnn._reorder_linear_weight, what cpu_layout.py packs smaller fp32 weights into), but that is a
second copy: where the output layer is tied to the embedding (Llama 3.2, GPT-2), the table
would be held twice, and a memory-mapped checkpoint's weights could no longer stay file
pages. Ours reads the weight where it lies, row-major (N, K), in fp32 sums of bf16
products: with AVX-512 BF16's vdpbf16ps where the CPU has it, else widened to fp32 (AVX-512,
AVX2, plain C++), picked at run time (docs/benchmarks.md measures each).

An fp32 weight goes through the same loop, loaded as it is. At the 1B shape on a 2-core
Zen 4 EPYC, one row, 2 threads (python -m benchmarks.quantized_kernels --shapes
llama-3.2-1b --threads 2), ours read its three largest weights at 37-48 GB/s, oneDNN's
packed copy at 28-32, MKL's F.linear at 19-24.

From MATVEC_ROWS rows on (a prompt's prefill, a large batch) the product is bound by
arithmetic, not bytes, and oneDNN's GEMM does it faster (F.linear's for bf16; for fp32
DenseLinear calls it, since F.linear's is MKL's).

The first call on a machine compiles the library (plumbing/kernel_build.py, ~20 s; later
processes load it); where it cannot be built, `kernels()` is None (with a warning) and
the Linears stay torch's. The operator has a fake (its output's shape), so torch.compile
and AOTInductor trace through it and the compiled step calls it too.
"""

import functools
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from plumbing.kernel_build import build_kernel

KERNEL_SOURCE = Path(__file__).with_name("dense_matmul.cpp")
# the most rows of x ours multiplies; from there on oneDNN's GEMM is as fast or faster
# (one thread, the 1B shape's Linears, a 2-core AVX-512 BF16 EPYC: ours took 0.45-0.6x
# torch's time at 1 row, 0.8-1.05x at 8, 0.9-1.15x at 16)
MATVEC_ROWS = 8
DTYPES = (torch.bfloat16, torch.float32)  # the weights it multiplies


@functools.cache
def kernels():
    """torch.ops.kvcache_gpt_dense (dense_matmul, dense_kernel_isas), built or loaded on the
    first call; None, with a warning, where it cannot be built."""
    error = build_kernel(KERNEL_SOURCE, "kvcache_gpt_dense_matmul")
    if error:
        warnings.warn(f"our dense matmul kernel could not be built ({error}); using torch's",
                      stacklevel=2)
        return None

    @torch.library.register_fake("kvcache_gpt_dense::dense_matmul")
    def _(x, w, bias, isa):  # shapes only, for torch.compile's tracing
        return x.new_empty(x.shape[0], w.shape[0])
    return torch.ops.kvcache_gpt_dense


@functools.cache
def best_isa(weight_dtype=torch.bfloat16):
    """The fastest instruction set this CPU runs for a weight of this dtype ('avx512bf16' for
    bf16 only, 'avx512', 'avx2' or 'portable')."""
    isas = kernels().dense_kernel_isas()
    return isas[-1] if weight_dtype == torch.bfloat16 else [i for i in isas if i != "avx512bf16"][-1]


def computes_bf16_natively():
    """Whether this CPU multiplies bf16 in hardware (AVX-512 BF16; the Xeons with AMX have it
    too) and our kernel is built: there a bf16 model decodes faster than an fp32 one (half
    the bytes, at their floor) and prefills faster too (oneDNN's bf16 GEMM), so --dtype
    auto keeps a bf16 checkpoint in bf16 (plumbing/checkpoint.auto_dtype). Elsewhere bf16
    is widened to fp32 instruction by instruction, and fp32 stays the safer default."""
    return kernels() is not None and best_isa() == "avx512bf16"


class DenseLinear(nn.Linear):
    """nn.Linear (the same weight and bias Parameters: the state dict, a tied embedding and
    every isinstance check are unchanged) whose products of up to MATVEC_ROWS rows of x in
    the weight's dtype run our kernel, and fp32 products of more rows oneDNN's GEMM over the
    same dense weight; anything else (another dtype, gradients wanted, a graph being
    compiled past our kernel's rows) is F.linear's. Made by cpu_layout.pack_linears."""

    def __init__(self, linear):
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a new weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)  # None too, as nn.Linear registers it
        # each dtype's instruction set, looked up at each call: .to() may change the dtype
        self.isas = {dtype: best_isa(dtype) for dtype in DTYPES}

    def forward(self, x):
        rows = x.numel() // self.in_features
        if self.kernel_applies(x, rows):
            # the op by its registered name, not through kernels(): torch.compile traces this
            # line, and the library is loaded already (best_isa() in __init__)
            y = torch.ops.kvcache_gpt_dense.dense_matmul(x.reshape(rows, self.in_features), self.weight,
                                                         self.bias, self.isas[self.weight.dtype])
            return y.reshape(*x.shape[:-1], self.out_features)  # (..., out)
        if self.onednn_applies(x):
            # F.linear's fp32 product on a CPU is MKL's sgemm, which repacks a row-major
            # weight on every call: at the 1B shape's weights 1.5-2.6x oneDNN's time at 16
            # rows, 1.2-1.7x at 128 (benchmarks.quantized_kernels --rows 16 128)
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def kernel_applies(self, x, rows):
        """A few rows (a decode step's, a small batch's), x and bias in the weight's dtype
        (bf16 or fp32), everything on the CPU, the weight row-major (the kernel reads it as
        it lies), and no gradient to the weight (training: the kernel has no backward). A
        graph being compiled is generation's decode step (torch.export traces it with
        gradients on, and nothing flows back)."""
        dtype = self.weight.dtype
        return (rows <= MATVEC_ROWS and x.device.type == "cpu" and x.dtype == dtype and dtype in DTYPES
                and self.weight.is_contiguous() and (self.bias is None or self.bias.dtype == dtype)
                and not self.wants_gradient())

    def onednn_applies(self, x):
        """Not in a graph being compiled (inductor picks its own GEMM for F.linear, and
        torch.compile refuses to trace torch.backends), fp32 on the CPU where torch has
        oneDNN, and no gradient to the weight."""
        return (not torch.compiler.is_compiling() and x.device.type == "cpu"
                and x.dtype == self.weight.dtype == torch.float32
                and (self.bias is None or self.bias.dtype == torch.float32)
                and torch.backends.mkldnn.is_available() and not self.wants_gradient())

    def wants_gradient(self):
        """Gradients are to flow to the weight (training), outside a graph being compiled."""
        return torch.is_grad_enabled() and self.weight.requires_grad and not torch.compiler.is_compiling()


def kernel_fits(linear):
    """Whether a Linear is one DenseLinear can serve, where our kernel is built: a plain
    nn.Linear on the CPU with a bf16 or fp32 weight, in any layout (for_our_kernel makes it
    row-major; cpu_layout.pack_linears picks which fp32 ones)."""
    return (type(linear) is nn.Linear and linear.weight.device.type == "cpu" and linear.weight.dtype in DTYPES
            and kernels() is not None)


def for_our_kernel(linear):
    """linear as a DenseLinear over its own Parameters, the weight made row-major first where
    it is not (a column-major fp32 model, or a bf16 copy of one: base_model.store_linears_column_major),
    in place: one matrix at a time is copied, and the old layout is freed."""
    if not linear.weight.is_contiguous():
        linear.weight.data = linear.weight.data.contiguous()
    return DenseLinear(linear)
