"""
The cache's memory, term by term: keys and values stored in fewer bytes.

S_cache = 2 x N_layers x N_kv_heads x L x d_head x P_bytes (cache_bytes, below): this file
turns d_head x P_bytes, what one token's key (or value) takes in one head, into a storage
format. The preallocated kv_cache.KVCache writes every new column through its
format's encode() and reads the columns back through decode(); a format is those two hooks
and the bytes they take:
  float32, bfloat16, float16   that dtype (read back cast to the model's)
  int8                         8-bit codes, one scale per (token, head): 64 + 2 bytes per head
  int4                         4-bit codes, two per byte, one scale per 32 channels: 32 + 4

Quantization is symmetric: a group of values x gets the scale s = max|x| / qmax (qmax = 127
for int8, 7 for int4), stored as float16, and codes round(x / s) in [-qmax, qmax]; reading
back is codes x s, off by at most s/2 per value. Scales belong to one token (per token and
head, or per 32 channels of it), so a token is quantized once, when it is written, and
never again: the cache can grow one column per step, and rows and columns move as bytes.
(KIVI quantizes keys per channel instead, over groups of tokens: better for models whose
keys have outlier channels, at the price of keeping the newest tokens unquantized until a
group is full. `python -m benchmarks.kv_dtypes` measures both on real keys.)

Attention still runs in the model's dtype: decode() turns every cached column back into it
on every step (one layer at a time). On a CPU without a fused kernel that reads int8 inside
attention, a quantized cache therefore saves memory, not time.
"""

import math

import torch

FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_DTYPES = (*FLOAT_DTYPES, "int8", "int4")
QUANT_BITS = {"int8": 8, "int4": 4}
INT4_GROUP_SIZE = 32          # channels sharing one int4 scale (KIVI's and llama.cpp's Q4_0's 32)
SCALE_DTYPE = torch.float16   # 2 bytes per scale; its rounding (2^-11) is far below a code's step


def dtype_name(dtype):
    """'float32' for torch.float32: the kv dtype that stores as the model computes."""
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------- bytes

def group_size(head_dim, kv_dtype):
    """Channels per scale: the whole head for int8; 32 for int4, or the largest power of two
    dividing head_dim when 32 does not."""
    return head_dim if kv_dtype == "int8" else math.gcd(head_dim, INT4_GROUP_SIZE)


def head_bytes(head_dim, kv_dtype):
    """Bytes that one token's key (or value) takes in one head, scales counted: the formula's
    d_head x P_bytes."""
    if kv_dtype not in QUANT_BITS:
        return head_dim * FLOAT_DTYPES[kv_dtype].itemsize
    n_scales = head_dim // group_size(head_dim, kv_dtype)
    return head_dim * QUANT_BITS[kv_dtype] // 8 + n_scales * SCALE_DTYPE.itemsize


def head_bytes_text(head_dim, kv_dtype):
    """How head_bytes is made up, as the formula prints it."""
    if kv_dtype not in QUANT_BITS:
        return f"{head_dim} head_dim x {FLOAT_DTYPES[kv_dtype].itemsize} B"
    n_scales = head_dim // group_size(head_dim, kv_dtype)
    return (f"({head_dim} head_dim x {QUANT_BITS[kv_dtype] / 8:g} B + {n_scales} x "
            f"{SCALE_DTYPE.itemsize} B scale{'s' if n_scales > 1 else ''})")


# ---------------------------------------------------------------------------- quantization

def quantize(x, bits, group):
    """x (..., d) -> codes (..., d) int8 in [-qmax, qmax] and scales (..., d // group) float16.

    Each run of `group` values along the last dim shares one scale. The scale is rounded to
    float16 before the codes are computed, so codes x stored scale is what reading gives;
    a value that the rounding pushes past qmax is clamped, off by qmax x 2^-11 x s < s/2."""
    qmax = 2 ** (bits - 1) - 1
    groups = x.float().unflatten(-1, (-1, group))                  # (..., d / group, group)
    # an all-zero group gets the smallest float16 scale instead of 0 (its codes are 0 anyway);
    # one beyond float16's range (|x| > 65504 x qmax: no real key is) is clipped, not inf
    scales = (groups.abs().amax(-1) / qmax).clamp(2 ** -24, torch.finfo(SCALE_DTYPE).max).to(SCALE_DTYPE)
    codes = (groups / scales.float().unsqueeze(-1)).round_().clamp_(-qmax, qmax)
    return codes.flatten(-2).to(torch.int8), scales


def dequantize(codes, scales, dtype, offset=0):
    """(codes - offset) x scales: codes (..., d) of any integer type, scales (..., d // group)
    -> (..., d) in dtype."""
    values = codes.to(dtype).unflatten(-1, (scales.size(-1), -1))  # (..., n_groups, group)
    if offset:
        values.sub_(offset)
    return values.mul_(scales.to(dtype).unsqueeze(-1)).flatten(-2)


def pack_int4(codes):
    """int4 codes (..., d) in [-7, 7] -> (..., d / 2) bytes: channel i in the low four bits of
    byte i, channel i + d/2 in the high four, both offset by 8 to be unsigned."""
    u = (codes + 8).to(torch.uint8)
    low, high = u.chunk(2, dim=-1)
    return low | (high << 4)


def unpack_int4(packed):
    """pack_int4's bytes -> codes + 8 (..., d), uint8 (dequantize takes the 8 off)."""
    return torch.cat((packed & 15, packed >> 4), dim=-1)


def cache_bytes(config, seq_len, batch_size=1, kv_dtype="float32"):
    """The chapter's S_cache = 2 x N_layers x N_kv_heads x L_seq x d_head x P_bytes (x batch),
    with d_head x P_bytes = head_bytes (a quantized cache's scales counted). config: anything
    with n_layer, n_kv_head and head_dim (a model's config, memory_plan.py's shapes). The one
    formula every caller uses: --stats, the demo, the memory checks, memory_plan.py, the
    serving pool's size."""
    return (2 * config.n_layer * config.n_kv_head * seq_len
            * head_bytes(config.head_dim, kv_dtype) * batch_size)


def cache_formula(config, seq_len, batch_size=1, kv_dtype="float32"):
    """(cache_bytes, the formula written out with this model's numbers), as --stats prints it."""
    text = (f"2 x {config.n_layer} layers x {config.n_kv_head} kv heads x L={seq_len} x "
            f"{head_bytes_text(config.head_dim, kv_dtype)} x {batch_size} rows")
    return cache_bytes(config, seq_len, batch_size, kv_dtype), text


# ---------------------------------------------------------------------------- the formats

class FloatFormat:
    """Keys and values kept as a float dtype (`storage`), read back in the model's (`dtype`).
    When the two are the same, encode and decode do nothing: the cache hands attention views
    of its buffer. Otherwise attention gets a cast copy of the past every step, the price of
    the smaller cache on a machine without mixed-dtype kernels."""

    def __init__(self, storage, dtype):
        self.storage_dtype, self.dtype = storage, dtype

    def width(self, head_dim):
        """Buffer elements per head and token."""
        return head_dim

    # the checks spare the default cache (storage in the model's dtype) an operation per
    # call: .to() would return its input, but only after a trip through torch's dispatcher
    def encode(self, x):
        return x if x.dtype == self.storage_dtype else x.to(self.storage_dtype)

    def decode(self, stored):
        return stored if stored.dtype == self.dtype else stored.to(self.dtype)


class QuantizedFormat:
    """int8 or int4 codes and their float16 scales, stored as bytes. Like llama.cpp's blocks,
    every (layer, k or v, row, head, position) is one run of bytes, the head's codes then its
    scales: a uint8 buffer (..., head_bytes), so the cache's moves on rows and columns work
    on it unchanged and the buffer's size is exactly the formula."""

    storage_dtype = torch.uint8

    def __init__(self, kv_dtype, head_dim, dtype):
        if head_dim % 4:  # int4 packs channel pairs; the scales must start on an even byte
            raise ValueError(f"a {kv_dtype} cache needs a head_dim divisible by 4, this model's "
                             f"is {head_dim}; store the cache as a float dtype")
        self.kv_dtype, self.bits, self.dtype = kv_dtype, QUANT_BITS[kv_dtype], dtype
        self.group = group_size(head_dim, kv_dtype)
        self.code_bytes = head_dim * self.bits // 8

    def width(self, head_dim):
        return head_bytes(head_dim, self.kv_dtype)

    def encode(self, x):
        """x (..., head_dim) -> (..., head_bytes) uint8: codes, then the scales' bytes."""
        codes, scales = quantize(x, self.bits, self.group)
        codes = pack_int4(codes) if self.bits == 4 else codes.view(torch.uint8)
        return torch.cat((codes, scales.view(torch.uint8)), dim=-1)

    def decode(self, stored):
        """(..., head_bytes) uint8 -> (..., head_dim) in the model's dtype."""
        codes, scales = stored[..., :self.code_bytes], stored[..., self.code_bytes:].view(SCALE_DTYPE)
        if self.bits == 8:
            return dequantize(codes.view(torch.int8), scales, self.dtype)
        return dequantize(unpack_int4(codes), scales, self.dtype, offset=8)


def storage_format(kv_dtype, head_dim, dtype):
    """The format that stores keys and values as kv_dtype (a name in KV_DTYPES) for a model
    computing in dtype."""
    if kv_dtype in QUANT_BITS:
        return QuantizedFormat(kv_dtype, head_dim, dtype)
    if kv_dtype not in FLOAT_DTYPES:
        raise ValueError(f"unknown kv dtype {kv_dtype!r}; one of {', '.join(KV_DTYPES)}")
    return FloatFormat(FLOAT_DTYPES[kv_dtype], dtype)
