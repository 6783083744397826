"""
Large Linear weights laid out once for the CPU's matrix-multiply kernel, and a real-size
model's left where they lie for ours (DenseLinear, below).

On the CPU, F.linear calls MKL's sgemm on the weight as it lies (row-major, or the
column-major copy that base_model.store_linears_column_major keeps for batch-1 decoding).
A GEMM does not multiply a matrix where it lies: it first copies ("packs") panels of it
into the blocked order its inner loop reads, and sgemm does that again on every call. With
one row of input (a batch-1 decode step) the product is a single pass over the weight and
packing buys nothing; with more rows (a batch, a prompt's prefill, the serving engine's
step over many sequences) the product is compute-bound and the repacking is a real share
of it.

oneDNN (shipped inside torch) can pack a weight once, into its own blocked layout, and then
multiply by it directly: torch.ops.mkldnn._reorder_linear_weight makes that copy, and
torch.ops.mkldnn._linear_pointwise multiplies by it (inductor uses the same two calls when
it compiles a graph with frozen weights). Against the column-major weight on this project's
2-core AMD EPYC VM (one GPT-2-small Linear at a time, interleaved runs):

    rows   768 -> 3072   3072 -> 768   768 -> 50257 (the lm_head)
       1      0.9x          1.5x           1.0x
      16      2.1x          1.7x           2.8x
      64      1.8x          1.3x           2.3x

so one row stays as fast, and batches, prefills and the engine's steps run 1.3-2.8x faster
per matmul (docs/benchmarks.md has the whole-step figures).

But oneDNN's call costs ~40-70 µs more than MKL's before it multiplies anything, which a
small weight never earns back. The bundled model's Linears (256 wide), the same way:

    rows   256 -> 768   256 -> 256   1024 -> 256   256 -> 4096 (the lm_head)
       1      0.5x         0.3x          0.5x           1.0x
      16      0.7x         0.4x          0.6x           1.4x
      64      0.8x         0.5x          0.8x           1.8x

and GPT-2 small's 768 -> 768 0.6x, 1.1x, 1.0x. So only weights of at least PACK_MIN_WEIGHTS
(2^19) numbers are packed: every Linear of GPT-2 small, only the lm_head of the bundled
model. Whole runs chose the line: the bundled model decodes faster with its 256-wide
Linears left to MKL (eager, 198 against 170 tokens/s), and GPT-2 small's batch of 16 faster
with its 768 -> 768 projections packed (7.4-7.6x batch 1 against 6.8-6.9x).

PackedLinear is an nn.Linear (same weight and bias Parameters, so the state dict and every
isinstance check are unchanged) whose weight, once packed, lives only in the packed copy:
the Parameter keeps its shape and dtype on the meta device, which holds no memory (a 1B
model in fp32 would otherwise keep 4.9 GB twice). The packing happens at the first call
that can use it (float32 on the CPU, no gradient wanted, outside a compiled graph:
packed_copy_applies); the dense weight comes back, exactly (oneDNN's to_dense, in the
memory layout it had), wherever it is needed: the state dict, load_state_dict, .to(),
copying, a call the packed copy cannot serve (training, another dtype), and unpack_linears
before a graph is compiled or exported from the model. A weight written in place after
packing is not seen (the meta Parameter holds nothing): write it through load_state_dict.
A weight tied to an embedding (GPT-2's lm_head) is packed beside its dense table, which
the lookup needs: that one matrix is held twice, because unpacked it made GPT-2 small's
batch of 16 6.5x batch 1 instead of 9.3x (python -m benchmarks.batching --shape gpt2
--sizes 1,16, 2026-12-03). Up to TIED_PACK_MAX_BYTES only: Llama-3.2-1B's tied table is
1.05 GB in float32, a second copy of which would be a fifth of the model again. A model
whose decode step is compiled stops packing (unpack_linears): inductor lays out the
weights it compiles itself, and the graph reads the Parameters.

A real-size model's weights are not packed either: a float32 weight of at least
DENSE_MIN_WEIGHTS (2^22, the 1B shape's 2048 x 2048 and larger) and every bfloat16 one
become a DenseLinear (generation/dense_matmul.py), which multiplies the weight where it
lies: our kernel for a decode step's few rows, oneDNN's GEMM over the dense weight for
more. At the 1B shape's fp32 weights on a 2-core Zen 4 EPYC (python -m
benchmarks.quantized_kernels --shapes llama-3.2-1b --threads 2 --rows 1 16 128), against
the packed product: one row 0.67-0.80x its time (the three largest; 2048 x 2048, which fits
the 32 MB L3 when timed alone, 1.3x), 16 rows 1.3-1.5x, 128 (a prompt) 1.05-1.06x. Whole
runs chose the line: `generate.py --hf DIR --dtype float32` at that shape decoded 9.0 tok/s
instead of 4.8 and prefilled 511 tokens at 70.5 instead of 57.6 (in turns, medians of 3,
docs/benchmarks.md), as nothing is copied: no packing pass at the first call (3.8 s of the
first token's time at this size), a memory-mapped checkpoint's pages left mapped, the tied
table held once. At GPT-2 small's widths the dense GEMM is 1.1-1.9x slower than the packed
one at 4-64 rows, so smaller weights, and a tied table small enough to hold twice, stay
packed.
"""

import collections

import torch
import torch.nn as nn
import torch.nn.functional as F

from generation import dense_matmul

BATCH_HINT = 16  # rows oneDNN tunes the blocked layout for; any number of rows works with it
PACK_MIN_WEIGHTS = 2**19  # smaller weights multiply faster through MKL (see above)
TIED_PACK_MAX_BYTES = 2**28  # a tied weight past this is not held twice (see above)
DENSE_MIN_WEIGHTS = 2**22  # float32 weights this large multiply where they lie (see above)


class PackedLinear(nn.Linear):
    """nn.Linear multiplying through its weight in oneDNN's blocked layout, the only copy."""

    def __init__(self, linear, keep_dense=False):
        """keep_dense: the weight stays beside its packed copy (a weight another module
        holds too: an embedding tied to the head)."""
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a new weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameters
        self.register_parameter("bias", linear.bias)  # None too, as nn.Linear registers it
        self.packed, self.dense_stride = None, None
        self.keep_dense, self.packing = keep_dense, True

    def forward(self, x):
        if not (self.packing and self.packed_copy_applies(x)):
            if self.packed is not None and not torch.compiler.is_compiling():
                self.unpack()  # training, another dtype: the plain weight is what multiplies
            return F.linear(x, self.weight, self.bias)
        if self.packed is None or not (self.weight.is_meta or self.keep_dense):  # first call, or .data replaced
            self.pack()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def packed_copy_applies(self, x):
        """Not inside a compiled graph (inductor packs the weights itself, and cannot trace
        oneDNN's opaque tensor), not off the CPU or float32, and not when gradients are to
        flow to the weight (training: the packed copy is not the Parameter)."""
        return (not torch.compiler.is_compiling() and x.device.type == "cpu" and x.dtype == torch.float32
                and not (torch.is_grad_enabled() and self.weight.requires_grad))

    def pack(self):
        """The weight's values into oneDNN's layout; the Parameter keeps only its shape
        (unless keep_dense)."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), BATCH_HINT)
        self.dense_stride = self.weight.stride()  # row- or column-major (store_linears_column_major)
        if not self.keep_dense:
            self.weight = as_parameter(torch.empty_like(self.weight, device="meta"), self.weight)

    def dense_weight(self):
        """The packed values as the dense weight they came from, in its memory layout."""
        # a normal tensor even under inference_mode (the loop's): a Parameter made of an
        # inference tensor has no version counter, which the compiled step's key reads
        with torch.inference_mode(False):
            dense = torch.empty_strided(self.weight.shape, self.dense_stride, dtype=self.weight.dtype)
            return dense.copy_(self.packed.to_dense())  # to_dense: (out, in) row-major

    def unpack(self):
        """The Parameter holds the weight again, and the packed copy is dropped."""
        if self.packed is not None and self.weight.is_meta:
            self.weight = as_parameter(self.dense_weight(), self.weight)
        self.packed = None

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.packed is not None and self.weight.is_meta:
            destination[prefix + "weight"] = self.dense_weight()

    def _load_from_state_dict(self, *args, **kwargs):
        self.unpack()  # nn.Module copies into the Parameter; the next call packs it again
        super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn, *args, **kwargs):
        self.unpack()  # .to(), .half(), ...: they convert the dense weight
        return super()._apply(fn, *args, **kwargs)

    def __getstate__(self):
        # copy.deepcopy, pickling: oneDNN's tensor cannot be copied; the copy gets the dense weight
        state = super().__getstate__()
        if self.packed is not None and self.weight.is_meta:
            state["_parameters"] = {**state["_parameters"], "weight": as_parameter(self.dense_weight(), self.weight)}
        return {**state, "packed": None, "dense_stride": None}


def as_parameter(values, like):
    """A new Parameter of these values, wanting gradients as `like` does (a tensor's device
    cannot be changed under an existing Parameter)."""
    return nn.Parameter(values, requires_grad=like.requires_grad)


def pack_linears(model, min_weights=PACK_MIN_WEIGHTS):
    """Give every nn.Linear of a CPU model the multiply its dtype and size want, in place;
    returns the model. One that our kernel serves (stays_dense) becomes a DenseLinear
    (generation/dense_matmul.py: decode steps over the weight where it lies); another
    float32 one with at least min_weights weights a PackedLinear (a weight tied to another
    module keeps its dense copy too). Anything else (smaller, another device or dtype,
    quantized layers, a torch without oneDNN, no built kernel) is left as it is."""
    holders = collections.Counter(id(p) for m in model.modules() for p in m.parameters(recurse=False))
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            tied = isinstance(child, nn.Linear) and holders[id(child.weight)] > 1
            if stays_dense(child, tied):
                setattr(parent, name, dense_matmul.for_our_kernel(child))
            elif packs(child, min_weights, tied):
                setattr(parent, name, PackedLinear(child, keep_dense=tied))
    return model


def stays_dense(linear, tied):
    """Whether a Linear multiplies over its dense weight (see the module docstring), where
    our kernel is built: every bfloat16 one; a float32 one tied past TIED_PACK_MAX_BYTES;
    an untied float32 one of at least DENSE_MIN_WEIGHTS weights (a tied one smaller than
    that limit is packed beside its dense table)."""
    if not dense_matmul.kernel_fits(linear):
        return False
    return (linear.weight.dtype == torch.bfloat16 or too_large_to_hold_twice(linear, tied)
            or (linear.weight.numel() >= DENSE_MIN_WEIGHTS and not tied))


def packs(linear, min_weights, tied):
    """Whether a Linear is one oneDNN's packed layout serves: a plain float32 nn.Linear on the
    CPU with at least min_weights weights, where torch has oneDNN; a tied one (its packed
    copy beside the dense weight the other module reads) only up to TIED_PACK_MAX_BYTES."""
    return (type(linear) is nn.Linear and linear.weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
            and linear.weight.dtype == torch.float32 and linear.weight.numel() >= min_weights
            and not too_large_to_hold_twice(linear, tied))


def too_large_to_hold_twice(linear, tied):
    """A tied weight past TIED_PACK_MAX_BYTES: a packed copy beside the dense one would cost
    too much memory."""
    return tied and linear.weight.nbytes > TIED_PACK_MAX_BYTES


def unpack_linears(model):
    """Every PackedLinear of model holds its dense weight again and packs no more: what a
    model whose step is compiled needs (torch.export and inductor read the Parameters, and
    a weight packed again after each build would be a new weight to the next). Returns the
    model."""
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.unpack()
            module.packing = False
    return model
