"""
Weight-only quantization: keep every Linear weight in 8 or 4 bits and multiply with
kernels that read those bits directly. Embeddings, LayerNorms, biases, the residual
stream and the logits stay in the model's dtype.

Why it pays: at batch 1 a decode step multiplies each weight matrix by one vector, so
every weight is read from memory once and used for a single multiply-add. The step costs
the bytes it reads, not the arithmetic it does. fp32 weights are 4 bytes each; int8
weights 1 byte (plus one scale per row); int4 weights half a byte (plus a scale and a
zero point per group of G): about 4x and 7x fewer bytes per token.

What it trades: each weight is rounded to one of 255 (int8) or 16 (int4) levels, so the
model computes with slightly different weights. The error per weight is at most half a
level (scale / 2), and held-out bits per character show what that costs (docs/generation.md).

The two schemes, for a weight W of shape (out, in), row n = output channel n:
  int8, symmetric, per output channel: scale[n] = max|W[n]| / 127, q = round(W / scale)
        in [-127, 127], W ~ q * scale. One scale per row is free at run time: the kernel
        computes x @ q.T and multiplies each output by its row's scale. Symmetric keeps
        0 exact and needs no zero point; 8 bits leave plenty of levels for one per row.
  int4, asymmetric, in groups of G input channels: 16 levels are few, so each run of G
        weights in a row gets its own range [lo, hi]: scale = (hi - lo) / 15,
        q = round((W - lo) / scale) in [0, 15], W ~ (q - 8) * scale + zero with
        zero = lo + 8 * scale (torch's kernel takes the value at level 8). A zero point
        is free here because the kernel wants one, and it spends all 16 levels on the
        group's actual range instead of half of them on a side that may be empty.
        G = 64 by default: 0.5625 bytes per weight, as llama.cpp's q4_0 (18 bytes per 32
        weights). G = 32 (--group-size 32) holds the bundled model's held-out quality a little
        closer to fp32 (+0.0012 bits/char against +0.0031) but reads 11% more bytes, and on an
        AVX-512 CPU the compiled GPT-2-small step ran 1.2x faster with 64 (docs/generation.md).
        A model whose widths 64 does not divide gets 32 (int4_group_size).

The kernels, three of them (`kernel=`), chosen per Linear where it is made:
  "ours"      on the CPU: generation/quantized_matmul.cpp, built on first use, fed the
              model's fp32 or bf16 as it is (no conversion either side: at the 1B shape
              in bf16, 226 operations a token fewer, 3.4 -> 1.8 ms of a ~54 ms int8 token
              spent around the operator, and a 512-token int8 prefill 504 -> 588 tok/s);
              it quantizes the activations in blocks of 32 and reads each weight once,
              1.5-8x torch's speed at one row on an AVX2 EPYC (docs/log/benchmarks-round-8.md);
              from FLOAT_MATMUL_ROWS rows on, a float matmul of the weight dequantized
              (its int8_dequantize / int4_dequantize operators, one pass over the codes,
              into a buffer kept for the next weight: quantized_matmul.DequantizeScratch):
              in bf16 where the CPU multiplies bf16 in hardware (AVX-512 BF16, AMX: oneDNN's
              bf16 GEMM, ~4.7x its fp32 one on a Zen 4 EPYC), else in fp32.
              int4 weights lie two to a byte in its own order (quantized_matmul.pack_int4).
              Its int8_quantize / int4_quantize operators quantize a weight in one pass
              (the numbers of quantize_int8 / quantize_int4 to the bit, no temporaries: an
              8192 x 2048 bf16 weight in 7 ms against 36 on the Xeon, AVX-512).
  "torch"     on the CPU where ours cannot be built (or a width is not a multiple of 32):
              torch._weight_int8pack_mm and aten._weight_int4pack_mm_for_cpu (with
              aten._convert_weight_to_int4pack_for_cpu for its packed layout), fast only
              with bfloat16 activations: fed fp32 (or fp16) the int8 one is several times
              slower than a plain fp32 product. So the Linear casts its input to bf16.
  "portable"  on any other device (cuda, mps): the weight dequantized and F.linear in the
              model's dtype, in ours' layout: it saves memory, not time. It is deliberately
              simple because no GPU was available to test anything faster.
The scales and zero points are kept in bf16 for both CPU kernels (the same numbers either
way), in the model's dtype for the portable path.

The tied lm_head / wte: at GPT-2 size the lm_head is the biggest matrix (50257 x 768,
30% of the bytes of a step), so it is quantized like any Linear. But the same tensor is
the token embedding, whose lookup reads one row per step: it stays exact, in full
precision, because quantizing it would save no time (one row) and would change every
token's input. The table stays next to its int8/int4 copy; loaded from a file in its own
dtype, it is the file's pages, of which only the rows looked up stay resident
(plumbing/mapped_pages.py: at the Llama-3.2-1B shape 0.5 GB of bf16 that is not memory).
An untied output layer (Llama 2, Mistral, TinyLlama; not Llama 3.2 1B or Qwen's small
models, which tie it) stays in the model's dtype: a few percent of such a model's weights.

A quantized model's state_dict() still reads like the original's: every Linear saves its
dequantized weight under `weight`, so names and shapes are unchanged and a plain GPT can
load it (the tied lm_head's entry is the exact table: a plain GPT loaded from it computes
its head in full precision); loading a full-precision weight into a quantized Linear
quantizes it. Checkpoints
are never written quantized: quantizing on load takes about a second at GPT-2 size, and
the CPU int4 layout is the kernel's own, not something to keep in a file.

    python generate.py --prompt "ROMEO:" --quantize int8
    python generate.py --score checkpoints/shakespeare/heldout.txt --quantize int4
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from generation import dense_matmul, quantized_matmul

SCHEMES = ("int8", "int4")
INT4_GROUP_SIZE = 64  # the default where it divides every width (int4_group_size)
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what torch's CPU int4 kernel accepts
KERNEL_DTYPE = torch.bfloat16  # the activation dtype the CPU kernels are fast with
MIN_SCALE = 1e-12  # an all-equal row or group would have scale 0: keep the division defined
CHUNK_ROWS = 1024  # rows quantized at a time (row_chunks)
# from this many rows of x (a prompt, a big batch) our kernels hand over to a float matmul
# of the weight dequantized a chunk at a time: on an AVX2 CPU the fp32 GEMM does twice the
# multiply-adds a second of ours at 128 rows and more, and dequantizing costs one read of
# the weight, which a product this large hardly notices (docs/benchmarks.md, the 1B section)
FLOAT_MATMUL_ROWS = 32
# the most weights a prompt's product dequantizes at once (into quantized_matmul's
# DequantizeScratch): the largest block weight of the 1B shape (8192 x 2048) in one piece:
# one GEMM, nothing to concatenate (pieces of 128-512 rows, small enough to stay in cache,
# were slower on the Xeon: more, smaller GEMMs); 32 MB in bf16
SCRATCH_WEIGHTS = 8192 * 2048


# ---------------------------------------------------------------------------- the schemes

def row_chunks(weight):
    """Slices of CHUNK_ROWS rows of weight (out, in), a tensor or a Linear. Both schemes quantize row by row, so a
    chunk at a time gives the same numbers as the whole matrix at once, with float
    temporaries (the fp32 copy, |W|, the quotient) the size of one chunk: a 128256 x 2048
    output layer would need ~1 GB for each."""
    rows = weight.out_features if isinstance(weight, nn.Module) else weight.shape[0]
    return [slice(start, start + CHUNK_ROWS) for start in range(0, rows, CHUNK_ROWS)]


def quantize_int8(weight):
    """(q, scale): q (out, in) int8 in [-127, 127], scale (out,) fp32; W ~ q * scale[:, None]
    with |W - q * scale| <= scale / 2 for every weight."""
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(weight.shape[0], device=weight.device)
    for rows in row_chunks(weight):
        w = weight[rows].float()
        scale[rows] = (w.abs().amax(dim=1) / 127).clamp(min=MIN_SCALE)
        q[rows] = torch.round(w / scale[rows, None]).clamp(-127, 127)  # whole numbers: exact in int8
    return q, scale


def dequantize_int8(q, scale):
    return q.float() * scale.float()[:, None]


def quantize_int4(weight, group_size):
    """(q, scale, zero): q (out, in) uint8 in [0, 15], scale and zero (out, in / group_size)
    fp32; in each group W ~ (q - 8) * scale + zero, within scale / 2."""
    out_features, in_features = weight.shape
    q = torch.empty(weight.shape, dtype=torch.uint8, device=weight.device)
    scale = torch.empty(out_features, in_features // group_size, device=weight.device)
    zero = torch.empty_like(scale)
    for rows in row_chunks(weight):
        groups = weight[rows].float().reshape(-1, in_features // group_size, group_size)  # (rows, groups, G)
        lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)  # (rows, groups)
        scale[rows] = ((hi - lo) / 15).clamp(min=MIN_SCALE)
        q[rows] = torch.round((groups - lo[..., None]) / scale[rows, :, None]).clamp(0, 15).flatten(1)
        zero[rows] = lo + 8 * scale[rows]
    return q, scale, zero


def dequantize_int4(q, scale, zero, group_size):
    out_features, in_features = q.shape
    groups = q.float().reshape(out_features, in_features // group_size, group_size) - 8
    return (groups * scale.float()[..., None] + zero.float()[..., None]).reshape(out_features, in_features)


# ---------------------------------------------------------------------------- the modules

class QuantizedLinear(nn.Module):
    """What Int8Linear and Int4Linear share: the bias, the casts around the kernel, and a
    state dict that looks like nn.Linear's. Quantize after moving the model to its device:
    the kernel ("ours", "torch" or "portable", the module docstring) is chosen for the device
    the weight is on and its width (choose_kernel); `kernel` forces one (the tests check each
    on the CPU). activation_dtype overrides what torch's kernels are fed (benchmark.py times
    them fed fp32 to show why the default is bf16)."""

    def __init__(self, linear, kernel=None, activation_dtype=None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias  # the same Parameter, in the model's dtype, added after the kernel
        self.dtype = linear.weight.dtype  # the model's: what the state dict holds
        self.kernel = kernel or choose_kernel(linear.weight.device, self.in_features, activation_dtype)
        if self.kernel == "ours" and not quantized_matmul.fits(self.in_features):
            raise ValueError(f"our quantized kernels need a built library and an input width "
                             f"that is a multiple of {quantized_matmul.BLOCK}, not {self.in_features}")
        # ours' instruction set, asked once here: forward() calls the operator by its name,
        # which torch.compile traces (it cannot trace the library's loading)
        self.isa = quantized_matmul.best_isa() if self.kernel == "ours" else None
        # what the matmul is fed: for ours the model's dtype where it takes it (fp32, bf16),
        # else fp32; bf16 for torch's; the model's own dtype for the portable path
        ours = self.dtype if self.dtype in (torch.float32, torch.bfloat16) else torch.float32
        self.compute_dtype = activation_dtype or {"ours": ours, "torch": KERNEL_DTYPE}.get(self.kernel, self.dtype)
        # the scales: bf16 for ours, what torch's kernels are fed for theirs, else the model's
        self.scale_dtype = {"ours": KERNEL_DTYPE, "torch": self.compute_dtype}.get(self.kernel, self.dtype)
        # what a prompt's rows multiply in (dequantized_matmul), asked once here: forward() may
        # be traced by torch.compile, which cannot trace the question
        self.prompt_dtype = torch.bfloat16 if self.kernel == "ours" and dense_matmul.computes_bf16_natively() \
            else self.compute_dtype

    def forward(self, x):
        shape, dtype = x.shape, x.dtype  # (..., in), the model's
        x = x.reshape(-1, self.in_features)  # (rows, in)
        if self.kernel == "ours" and x.shape[0] >= FLOAT_MATMUL_ROWS:
            y = self.dequantized_matmul(x.to(self.prompt_dtype))  # (rows, out)
        else:
            y = self.matmul(x.to(self.compute_dtype))
        y = y.to(dtype).reshape(*shape[:-1], self.out_features)  # back to the model's dtype
        return y if self.bias is None else y + self.bias

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {self.kernel} kernel in {self.compute_dtype}")

    def dequantized_matmul(self, x):
        """x (rows, in), in prompt_dtype, @ the dequantized weight.T in the same dtype, in
        pieces of at most SCRATCH_WEIGHTS weights (a 128256-token head at once would be a
        0.5-1 GB temporary), each dequantized into this thread's scratch buffer. Where the
        product is traced (torch.compile: a graph's tensors are its own) or a backward
        would need the weight as it was (x wants a gradient), each piece is a new tensor."""
        rows_at_once = max(1, SCRATCH_WEIGHTS // self.in_features)
        pieces = [slice(start, min(start + rows_at_once, self.out_features))
                  for start in range(0, self.out_features, rows_at_once)]
        fresh = torch.compiler.is_compiling() or x.requires_grad
        weight = self.dequantized_weight if fresh else self.dequantized_in_scratch
        outputs = [F.linear(x, weight(rows, x.dtype)) for rows in pieces]  # each (rows, piece)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)  # (rows, out)

    def dequantized_in_scratch(self, rows, dtype):
        """dequantized_weight(rows, dtype), written into the thread's scratch buffer (valid
        until the next call: F.linear reads it at once)."""
        out = quantized_matmul.scratch.take(rows.stop - rows.start, self.in_features, dtype)
        self.dequantize_into(rows, out)
        return out

    def weight_nbytes(self):
        """Bytes a forward pass reads from this layer's weight (not counting the bias)."""
        return sum(b.nbytes for b in self.buffers(recurse=False))

    # A quantized model must still save and load like the model it stands for.
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if "weight" not in self._parameters:  # weight first, then bias: nn.Linear's order
            destination[prefix + "weight"] = self.dequantized_weight().to(self.dtype)
        super()._save_to_state_dict(destination, prefix, keep_vars)  # bias, a tied weight

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict,
                              missing_keys, unexpected_keys, error_msgs):
        key = prefix + "weight"
        if key in state_dict:
            device = next(self.buffers()).device
            self.set_weight(state_dict[key].to(device))  # a full-precision weight: quantize it
        elif strict:
            missing_keys.append(key)
        if "weight" not in self._parameters:  # not a parameter here: nn.Module would call it unexpected
            state_dict = {k: v for k, v in state_dict.items() if k != key}
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)


def choose_kernel(device, in_features, activation_dtype=None):
    """The kernel a quantized Linear of this width on this device uses: ours on the CPU where
    it is built and the width fits (activation_dtype, torch's kernels' knob, picks torch's),
    torch's on the CPU otherwise, the portable path elsewhere."""
    if device.type != "cpu":
        return "portable"
    return "ours" if activation_dtype is None and quantized_matmul.fits(in_features) else "torch"


class Int8Linear(QuantizedLinear):
    """nn.Linear with int8 weights, one scale per output channel."""

    def __init__(self, linear, kernel=None, activation_dtype=None):
        super().__init__(linear, kernel, activation_dtype)
        self.set_weight(linear.weight.detach())

    def set_weight(self, weight):
        # ours: its operator, one pass and no temporaries, quantize_int8's numbers to the bit
        q, scale = (torch.ops.kvcache_gpt_quant.int8_quantize(weight.contiguous()) if self.kernel == "ours"
                    else quantize_int8(weight))
        # buffers, not parameters, and not persistent: the state dict holds `weight` instead
        self.register_buffer("weight_int8", q, persistent=False)  # (out, in), row-major
        self.register_buffer("scale", scale.to(self.scale_dtype), persistent=False)  # (out,)

    def matmul(self, x):
        if self.kernel == "ours":
            return torch.ops.kvcache_gpt_quant.int8_matmul(x, self.weight_int8, self.scale, self.isa)
        if self.kernel == "torch":
            return torch._weight_int8pack_mm(x, self.weight_int8, self.scale)  # (x @ q.T) * scale
        return F.linear(x, self.weight_int8.to(x.dtype)) * self.scale  # the same, portably

    def dequantize_into(self, rows, out):
        """Those output rows of the weight, dequantized into out (ours' operator)."""
        torch.ops.kvcache_gpt_quant.int8_dequantize_into(self.weight_int8[rows], self.scale[rows], out)

    def dequantized_weight(self, rows=slice(None), dtype=torch.float32):
        """The weight as the layer uses it, (out, in) in dtype, or those output rows of it
        (ours: its operator, one pass over the codes; the same numbers, to the last bit of
        fp32, as dequantize_int8)."""
        if self.kernel == "ours":
            return torch.ops.kvcache_gpt_quant.int8_dequantize(self.weight_int8[rows], self.scale[rows], dtype)
        return dequantize_int8(self.weight_int8[rows], self.scale[rows]).to(dtype)


class Int4Linear(QuantizedLinear):
    """nn.Linear with 4-bit weights, a scale and a zero point per group of group_size
    input channels. Two layouts of the same numbers: for torch's kernel its own packing
    (rows padded to a multiple of 16, which it requires); for ours and the portable path
    two weights per byte in blocks of 32 (quantized_matmul.pack_int4), scale and zero
    (out, groups) each."""

    def __init__(self, linear, group_size=INT4_GROUP_SIZE, kernel=None, activation_dtype=None):
        super().__init__(linear, kernel, activation_dtype)
        check_int4_fits(self.in_features, group_size)
        self.group_size = group_size
        self.set_weight(linear.weight.detach())

    def set_weight(self, weight):
        if self.kernel == "ours":  # its operator: one pass, no temporaries, quantize_int4's numbers
            packed, scale, lo = torch.ops.kvcache_gpt_quant.int4_quantize(weight.contiguous(), self.group_size)
            scale, zero = scale.to(self.scale_dtype), (lo + 8 * scale).to(self.scale_dtype)
        else:
            packed, scale, zero = self.quantized_in_chunks(weight)
        self.register_buffer("weight_int4", packed, persistent=False)
        if self.kernel != "torch":
            self.register_buffer("scale", scale, persistent=False)  # (out, groups)
            self.register_buffer("zero", zero, persistent=False)
        else:
            self.register_buffer("scale_and_zero", torch.stack([scale, zero], dim=-1).transpose(0, 1)
                                 .contiguous(), persistent=False)  # (groups, out, 2): the kernel's order

    def quantized_in_chunks(self, weight):
        """(packed, scale, zero) for torch's kernel or the portable path: a chunk of rows at a
        time, quantized and packed into the final buffers (the whole matrix's one-byte codes,
        and torch's kernel's int32 input, 4 bytes a weight, would be 263 MB and 1 GB more for
        a 128256 x 2048 output layer)."""
        portable = self.kernel == "portable"
        pad = 0 if portable else -self.out_features % 16  # torch's kernel: rows padded to 16, sliced off
        rows_total, groups = self.out_features + pad, self.in_features // self.group_size
        packed = torch.empty(rows_total, self.in_features // 2, dtype=torch.uint8, device=weight.device)
        scale = torch.empty(rows_total, groups, dtype=self.scale_dtype, device=weight.device)
        zero = torch.empty_like(scale)
        for rows in row_chunks(weight):
            q, chunk_scale, chunk_zero = quantize_int4(weight[rows], self.group_size)
            if pad and rows.stop >= self.out_features:  # the last chunk takes the padding
                rows = slice(rows.start, rows_total)
                q, chunk_scale, chunk_zero = (F.pad(t, (0, 0, 0, pad)) for t in (q, chunk_scale, chunk_zero))
            # the portable path: ours' layout, two weights a byte in blocks of 32; torch's
            # kernel packs blocks of rows its own way and takes int32
            packed[rows] = (quantized_matmul.pack_int4(q) if portable else
                            torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2))
            scale[rows], zero[rows] = chunk_scale, chunk_zero
        return packed, scale, zero

    def matmul(self, x):
        if self.kernel == "ours":
            return torch.ops.kvcache_gpt_quant.int4_matmul(x, self.weight_int4, self.scale, self.zero,
                                                           self.group_size, self.isa)
        if self.kernel == "torch":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, self.weight_int4, self.group_size, self.scale_and_zero)  # (rows, padded out)
            return y[:, :self.out_features]
        return F.linear(x, self.dequantized_weight().to(x.dtype))

    def group_scales(self):
        """Each group's quantization step, (out, groups) fp32."""
        if self.kernel == "torch":
            return self.scale_and_zero[..., 0].float().t()[:self.out_features]
        return self.scale.float()

    def dequantize_into(self, rows, out):
        """Those output rows of the weight, dequantized into out (ours' operator)."""
        torch.ops.kvcache_gpt_quant.int4_dequantize_into(self.weight_int4[rows], self.scale[rows],
                                                         self.zero[rows], self.group_size, out)

    def dequantized_weight(self, rows=slice(None), dtype=torch.float32):
        """The weight as the layer uses it, (out, in) in dtype, or those output rows of it
        (rows: ours and the portable path's layout only; ours through its operator, as
        Int8Linear's)."""
        if self.kernel == "torch":
            # the packed layout is the kernel's own, so read it back through the kernel: the
            # identity times W.T is W.T, exact in fp32 (one nonzero product per output)
            eye = torch.eye(self.in_features, device=self.weight_int4.device)
            wt = torch.ops.aten._weight_int4pack_mm_for_cpu(
                eye, self.weight_int4, self.group_size, self.scale_and_zero.float())
            return wt[:, :self.out_features].t().to(dtype)
        if self.kernel == "ours":
            return torch.ops.kvcache_gpt_quant.int4_dequantize(self.weight_int4[rows], self.scale[rows],
                                                               self.zero[rows], self.group_size, dtype)
        return dequantize_int4(quantized_matmul.unpack_int4(self.weight_int4[rows]), self.scale[rows],
                               self.zero[rows], self.group_size).to(dtype)


def int4_group_size(model):
    """The default group for a model: INT4_GROUP_SIZE, or a smaller group the kernel takes
    where that one does not divide every Linear's input width (a small model, 32 or 96
    wide). Where none divides them, the smallest: Int4Linear's refusal then names it."""
    widths = {m.in_features for m in model.modules() if isinstance(m, nn.Linear)}
    fitting = [g for g in INT4_GROUP_SIZES if g <= INT4_GROUP_SIZE and all(w % g == 0 for w in widths)]
    return max(fitting, default=INT4_GROUP_SIZES[0])


def check_int4_fits(in_features, group_size):
    """ValueError (one line) unless int4 in groups of group_size applies to this width."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if in_features % group_size:
        raise ValueError(f"int4 needs every Linear's input width to be a multiple of the "
                         f"group size {group_size}, and one is {in_features}")


def linear_quantizer(model, scheme, group_size=None, kernel=None):
    """A function linear -> the module to stand in its place: its quantized version, or the
    Linear itself for an untied lm_head (every caller reads the model's device and dtype
    from model.lm_head.weight, which a quantized Linear no longer has). Checked against the
    whole model first, so that a width the scheme refuses fails before any Linear changes;
    it reads only shapes, so a model built on the meta device (plumbing/checkpoint.py,
    which quantizes each Linear as its weight is read) is checked the same way.
    Raises ValueError (a one-line message) where the scheme cannot apply."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}: choose one of {', '.join(SCHEMES)}")
    if scheme == "int4":
        group_size = int4_group_size(model) if group_size is None else group_size
        for width in {m.in_features for m in model.modules() if isinstance(m, nn.Linear)}:
            check_int4_fits(width, group_size)  # (an untied lm_head's width is n_embd, as others')
    # the embedding the output layer is tied to (GPT-2's, and some Llamas'), if it is
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)
                      and m.weight is model.lm_head.weight), None)

    @torch.no_grad()
    def quantized(linear):
        if linear is model.lm_head and embedding is None:
            return linear
        module = (Int8Linear(linear, kernel) if scheme == "int8"
                  else Int4Linear(linear, group_size, kernel))
        if linear is model.lm_head:
            # the tied lm_head: its matmul is quantized, but its weight is also the token
            # embedding, which stays exact; keeping it here keeps model.lm_head.weight and the
            # state dict as they were
            module.weight = linear.weight
        return module
    return quantized


def quantize_model(model, scheme, group_size=None, kernel=None):
    """Replace every nn.Linear of a loaded model (either family, naive or cached) by its
    quantized version (linear_quantizer), in place, and return the model. scheme: 'int8' or
    'int4'; group_size: int4's (default: int4_group_size(model)). Quantize after
    .to(device, dtype). Raises ValueError (a one-line message) where the scheme cannot
    apply, leaving the model as it was."""
    quantized = linear_quantizer(model, scheme, group_size, kernel)
    linears = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, linear in linears:
        setattr(parent, name, quantized(linear))
    return model
