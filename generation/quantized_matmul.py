"""
Our int8 and int4 matrix products for the CPU (quantized_matmul.cpp), the kernels that
weight_quant.py's Linears call where they can be built: each weight block read once, the
activations quantized in blocks of 32 and the products taken in 8-bit integers, in AVX2 or
AVX-512 VNNI as the CPU has (picked at run time), else plain C++.

Why our own: at one row torch's CPU kernels (torch._weight_int8pack_mm,
_weight_int4pack_mm_for_cpu) read the 1B model's int8 and int4 weights at 1-8 GB/s on one
core of an AVX2 EPYC, these at 1.5-8x that in the same runs, up to the memory's own speed
(docs/log/benchmarks-round-8.md). torchao, the library that would be the kept
alternative, ships no CPU kernels in its PyPI wheel (0.18: its compiled parts are CUDA's),
and its CPU int8/int4 weight-only paths call those same torch kernels.

The first call on a machine compiles the library (plumbing/kernel_build.py: a private
folder, one build at a time, ~20 s) and later processes load it. `kernels()` is None where
it cannot be built (no compiler, no ninja; with a warning), and weight_quant.py then uses
torch's kernels. Each operator has a fake (its output's shape) so that torch.compile and
AOTInductor trace through it and call it from the compiled program.

The numbers: x is rounded to int8 per block (|error| <= max|x| in the block / 254), so a
product differs from x @ W.T with W the dequantized weight by about the same relative
amount as torch's kernels, which round x to bfloat16 (8 significant bits): tests say how much.
"""

import functools
import threading
import warnings
from pathlib import Path

import torch

from plumbing.kernel_build import build_kernel

KERNEL_SOURCE = Path(__file__).with_name("quantized_matmul.cpp")
BLOCK = 32  # the activations' block: every input width must be a multiple of it


@functools.cache
def kernels():
    """torch.ops.kvcache_gpt_quant (int8_matmul, int4_matmul, their weights' int8_quantize and
    int4_quantize from a float weight, int8_dequantize and int4_dequantize into fp32 or bf16,
    a new tensor or, the _into forms, one the caller holds; kernel_isas), built or loaded
    on the first call; None, with a warning, where it cannot be built."""
    error = build_kernel(KERNEL_SOURCE, "kvcache_gpt_quantized_matmul")
    if error:
        warnings.warn(f"our quantized matmul kernels could not be built ({error}); using torch's",
                      stacklevel=2)
        return None

    @torch.library.register_fake("kvcache_gpt_quant::int8_matmul")
    def _(x, q, scale, isa):  # shapes only, for torch.compile's tracing
        return x.new_empty(x.shape[0], q.shape[0])

    @torch.library.register_fake("kvcache_gpt_quant::int4_matmul")
    def _(x, packed, scale, zero, group_size, isa):
        return x.new_empty(x.shape[0], packed.shape[0])

    @torch.library.register_fake("kvcache_gpt_quant::int8_dequantize")
    def _(q, scale, dtype):
        return q.new_empty(q.shape, dtype=dtype)

    @torch.library.register_fake("kvcache_gpt_quant::int4_dequantize")
    def _(packed, scale, zero, group_size, dtype):
        return packed.new_empty(packed.shape[0], packed.shape[1] * 2, dtype=dtype)

    @torch.library.register_fake("kvcache_gpt_quant::int8_quantize")
    def _(w):
        return w.new_empty(w.shape, dtype=torch.int8), w.new_empty(w.shape[0], dtype=torch.float32)

    @torch.library.register_fake("kvcache_gpt_quant::int4_quantize")
    def _(w, group_size):
        groups = w.new_empty(w.shape[0], w.shape[1] // group_size, dtype=torch.float32)
        return w.new_empty(w.shape[0], w.shape[1] // 2, dtype=torch.uint8), groups, torch.empty_like(groups)
    return torch.ops.kvcache_gpt_quant


@functools.cache
def best_isa():
    """The fastest instruction set this CPU runs ('avx512vnni', 'avx2' or 'portable')."""
    return kernels().kernel_isas()[-1]


def fits(in_features):
    """Whether our kernels take a Linear this wide (blocks of 32) and were built."""
    return in_features % BLOCK == 0 and kernels() is not None


def pack_int4(q):
    """q (out, in) uint8 levels in [0, 15] -> (out, in / 2) uint8 in the kernel's order: per
    block of 32, byte j holds weight j (low 4 bits) and weight j + 16 (high 4)."""
    blocks = q.reshape(q.shape[0], -1, 2, BLOCK // 2)  # (out, blocks, halves, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).flatten(1)


def unpack_int4(packed):
    """pack_int4's inverse: (out, in / 2) -> (out, in) levels."""
    blocks = packed.reshape(packed.shape[0], -1, 1, BLOCK // 2)  # (out, blocks, 1, 16)
    return torch.cat([blocks & 15, blocks >> 4], dim=2).flatten(1)


class DequantizeScratch(threading.local):
    """The buffer a prompt's products dequantize each weight into (int8_dequantize_into,
    int4_dequantize_into; weight_quant.QuantizedLinear.dequantized_matmul), one per thread (two
    threads' prompts must not write into one), grown to the largest piece asked for and
    kept for the next Linear and the next pass: a new tensor each time costs more than the
    dequantizing (a fresh 32 MB is 8,192 pages the kernel zeroes on first touch); with the
    buffer a 512-token int8 prefill of the 1B shape runs at 776 tok/s on the Xeon, with new
    tensors at 651 (docs/benchmarks.md, the 1B section)."""

    def __init__(self):
        self.buffers = {}  # dtype -> a flat tensor

    def take(self, rows, cols, dtype):
        """A (rows, cols) tensor of dtype over the buffer's first rows * cols elements."""
        buffer = self.buffers.get(dtype)
        if buffer is None or buffer.numel() < rows * cols:
            buffer = self.buffers[dtype] = torch.empty(rows * cols, dtype=dtype)
        return buffer[:rows * cols].view(rows, cols)


scratch = DequantizeScratch()
