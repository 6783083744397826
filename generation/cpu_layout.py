"""
Large Linear weights laid out once for the CPU's matrix-multiply kernel.

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

PackedLinear is an nn.Linear (same weight and bias Parameters, so the state dict, a tied
lm_head and every isinstance check are unchanged) that keeps the packed copy beside its
weight. The copy is made at the first call and made again if the weight has changed since
(load_state_dict writes into it in place; .to() replaces it), so loading and quantizing
afterwards work as on any Linear. It is used only where it applies (float32 on the CPU, no
gradient wanted, outside a compiled graph: packed_copy_applies); anywhere else the layer is
F.linear. The cost is memory: a second copy of every packed weight (GPT-2 small: 0.5 GB
more in fp32).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH_HINT = 16  # rows oneDNN tunes the blocked layout for; any number of rows works with it
PACK_MIN_WEIGHTS = 2**19  # smaller weights multiply faster through MKL (see above)


class PackedLinear(nn.Linear):
    """nn.Linear multiplying through a copy of its weight in oneDNN's blocked layout."""

    def __init__(self, linear):
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a new weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameters
        self.register_parameter("bias", linear.bias)  # None too, as nn.Linear registers it
        self.packed, self.packed_from = None, None

    def forward(self, x):
        if not self.packed_copy_applies(x):
            return F.linear(x, self.weight, self.bias)
        if self.packed_from != weight_identity(self.weight):  # first call, or the weight was rewritten
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), BATCH_HINT)
            self.packed_from = weight_identity(self.weight)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def packed_copy_applies(self, x):
        """Not inside a compiled graph (inductor packs the weights itself, and cannot trace
        oneDNN's opaque tensor), not off the CPU or float32, and not when gradients are to
        flow to the weight (training: the packed copy is not the Parameter)."""
        return (not torch.compiler.is_compiling() and x.device.type == "cpu" and x.dtype == torch.float32
                and not (torch.is_grad_enabled() and self.weight.requires_grad))

    def __getstate__(self):
        # copy.deepcopy, pickling: oneDNN's tensor cannot be copied; the copy repacks at its first call
        return {**super().__getstate__(), "packed": None, "packed_from": None}


def weight_identity(weight):
    """What changes when a weight's values may have: its memory (.data replaced, .to()) and
    its version counter (written in place). A tensor made under inference_mode has no
    counter; such a weight is packed once."""
    return weight.data_ptr(), (None if weight.is_inference() else weight._version)


def pack_linears(model, min_weights=PACK_MIN_WEIGHTS):
    """Make every float32 nn.Linear of a CPU model with at least min_weights weights a
    PackedLinear, in place; returns the model. Anything else (smaller, another device or
    dtype, quantized layers, a torch without oneDNN) is left as it is."""
    if not torch.backends.mkldnn.is_available():
        return model
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (type(child) is nn.Linear and child.weight.device.type == "cpu"
                    and child.weight.dtype == torch.float32 and child.weight.numel() >= min_weights):
                setattr(parent, name, PackedLinear(child))
    return model
