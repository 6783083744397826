"""
The cache's memory, term by term: keys and values stored in fewer bytes.

S_cache = 2 x N_layers x N_kv_heads x L x d_head x P_bytes: this file turns P_bytes.
A cache kind per storage dtype, each the preallocated kv_cache.KVCache underneath:
  float32, bfloat16, float16   the cache in that dtype (cast back to the model's on read)
  int8                         8-bit codes, one scale per (token, head): 64 + 2 bytes per head
  int4                         4-bit codes, two per byte, one scale per 32 channels: 32 + 4

Quantization is symmetric: a group of values x gets the scale s = max|x| / qmax (qmax = 127
for int8, 7 for int4), stored as float16, and codes round(x / s) in [-qmax, qmax]; reading
back is codes x s, off by at most s/2 per value. Scales belong to one token (per token and
head, or per 32 channels of it), so a token is quantized once, when it is written, and
never again: the cache can grow one column per step, and rows and columns move as bytes.
(KIVI quantizes keys per channel instead, over groups of tokens: better for models whose
keys have outlier channels, at the price of keeping the newest tokens unquantized until a
group is full. `python kv_quant.py` measures both on real keys; the README discusses it.)

Attention still runs in the model's dtype: update() dequantizes every cached column on
every step (one layer at a time). On a CPU without a fused kernel that reads int8 inside
attention, a quantized cache therefore saves memory, not time.

Importing this module adds the kinds to kv_cache.CACHE_KINDS, so that
KVCacheGPT.stream(..., cache_kind="int4") uses them. kv_cache.py's library code does not
import this file (this file builds on it); only its demo, inside main(), does.

    python kv_quant.py          # bytes, round-trip error on real keys and values, greedy agreement
"""

import functools
import math
import sys
from pathlib import Path

import torch

from cli import DTYPES, ArgumentParser, UserError, add_model_args, load_from_args, positive_int, run
from kv_cache import CACHE_KINDS, KVCache, KVCacheGPT

KV_DTYPES = ("float32", "bfloat16", "float16", "int8", "int4")
QUANT_BITS = {"int8": 8, "int4": 4}
INT4_GROUP = 32               # channels sharing one int4 scale (KIVI's and llama.cpp's Q4_0's 32)
SCALE_DTYPE = torch.float16   # 2 bytes per scale; its rounding (2^-11) is far below a code's step


# ---------------------------------------------------------------------------- bytes

def group_size(head_dim, kv_dtype):
    """Channels per scale: the whole head for int8; 32 for int4, or the largest power of two
    dividing head_dim when 32 does not."""
    return head_dim if kv_dtype == "int8" else math.gcd(head_dim, INT4_GROUP)


def head_bytes(head_dim, kv_dtype):
    """Bytes that one token's key (or value) takes in one head: codes plus scales."""
    if kv_dtype not in QUANT_BITS:
        return head_dim * DTYPES[kv_dtype].itemsize
    n_scales = head_dim // group_size(head_dim, kv_dtype)
    return head_dim * QUANT_BITS[kv_dtype] // 8 + n_scales * SCALE_DTYPE.itemsize


def head_bytes_text(head_dim, kv_dtype):
    """How head_bytes is made up, as the formula prints it."""
    if kv_dtype not in QUANT_BITS:
        return f"{head_dim} head_dim x {DTYPES[kv_dtype].itemsize} B"
    n_scales = head_dim // group_size(head_dim, kv_dtype)
    return (f"({head_dim} head_dim x {QUANT_BITS[kv_dtype] / 8:g} B + {n_scales} x "
            f"{SCALE_DTYPE.itemsize} B scale{'s' if n_scales > 1 else ''})")


def kv_bytes_per_token(n_layer, n_kv_heads, head_dim, kv_dtype):
    """The chapter's formula per token, scales counted: 2 (k and v) x layers x kv heads x
    head_bytes. n_kv_heads is n_head for GPT-2; fewer for multi-query and grouped-query
    attention, where several query heads share one cached key/value head."""
    return 2 * n_layer * n_kv_heads * head_bytes(head_dim, kv_dtype)


def kv_cache_bytes(n_layer, n_kv_heads, head_dim, kv_dtype, seq_len, batch_size=1, window=None):
    """Bytes of the cache of batch_size sequences of seq_len tokens. With a sliding window
    (Mistral), attention sees only the last `window` tokens, so the cache keeps no more."""
    kept = seq_len if window is None else min(seq_len, window)
    return kv_bytes_per_token(n_layer, n_kv_heads, head_dim, kv_dtype) * kept * batch_size


def cache_formula(config, kv_dtype, seq_len, batch_size=1):
    """(bytes, the formula written out) for a GPT config's cache: what --stats prints."""
    text = (f"2 x {config.n_layer} layers x {config.n_head} heads x L={seq_len} x "
            f"{head_bytes_text(config.head_dim, kv_dtype)} x {batch_size} rows")
    return kv_cache_bytes(config.n_layer, config.n_head, config.head_dim, kv_dtype,
                          seq_len, batch_size), text


def dtype_name(dtype):
    """'float32' for torch.float32: the kv dtype that stores as the model computes."""
    return str(dtype).removeprefix("torch.")


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


# ---------------------------------------------------------------------------- the caches

class CastKVCache(KVCache):
    """The preallocated cache stored in another float dtype than the model computes in (a
    bfloat16 cache for a float32 model). SDPA needs q, k and v in one dtype; attention runs
    in the model's, so update() returns the cache cast back to it: a copy of the whole
    past every step, the price of the smaller cache on a machine without mixed kernels."""

    def __init__(self, config, batch_size, device=None, dtype=torch.float32, max_len=None,
                 storage=torch.bfloat16):
        super().__init__(config, batch_size, device, storage, max_len)
        self.dtype = dtype

    def update(self, layer, k, v):
        k, v = super().update(layer, k, v)  # the write casts the new columns to the storage dtype
        return k.to(self.dtype), v.to(self.dtype)

    def __getitem__(self, layer):
        return tuple(t.to(self.dtype) for t in super().__getitem__(layer))

    def empty_like(self, batch_size):
        return CastKVCache(self.config, batch_size, self.kv.device, self.dtype, self.max_len,
                           self.kv.dtype)


class QuantizedKVCache(KVCache):
    """The preallocated cache with int8 or int4 codes and their float16 scales.

    Like llama.cpp's blocks, every (layer, k or v, row, head, position) is one run of bytes,
    the head's codes then its scales: one uint8 buffer
        kv: (n_layer, 2, B, n_head, max_len, head_bytes)
    so KVCache's moves (select_rows, drop_columns, write_rows) and nbytes() work unchanged,
    and nbytes() is exactly the formula. update() returns keys and values in the model's
    dtype; dequantizing them is this cache's cost per step (see the module docstring)."""

    def __init__(self, config, batch_size, device=None, dtype=torch.float32, max_len=None,
                 kv_dtype="int8"):
        if config.head_dim % 4:  # int4 packs channel pairs; the scales must start on an even byte
            raise UserError(f"--kv-dtype {kv_dtype} needs a head_dim divisible by 4, this "
                            f"model's is {config.head_dim}; use a float --kv-dtype")
        self.config, self.max_len, self.dtype = config, max_len or config.block_size, dtype
        self.kv_dtype, self.bits = kv_dtype, QUANT_BITS[kv_dtype]
        self.group = group_size(config.head_dim, kv_dtype)
        self.code_bytes = config.head_dim * self.bits // 8
        shape = (config.n_layer, 2, batch_size, config.n_head, self.max_len,
                 head_bytes(config.head_dim, kv_dtype))
        self.kv = torch.empty(shape, device=device, dtype=torch.uint8)
        self.length = 0

    def encode(self, x):
        """x (..., head_dim) -> (..., head_bytes) uint8: codes, then the scales' bytes."""
        codes, scales = quantize(x, self.bits, self.group)
        codes = pack_int4(codes) if self.bits == 4 else codes.view(torch.uint8)
        return torch.cat((codes, scales.view(torch.uint8)), dim=-1)

    def decode(self, data):
        """(..., head_bytes) uint8 -> (..., head_dim) in the model's dtype."""
        codes, scales = data[..., :self.code_bytes], data[..., self.code_bytes:].view(SCALE_DTYPE)
        if self.bits == 8:
            return dequantize(codes.view(torch.int8), scales, self.dtype)
        return dequantize(unpack_int4(codes), scales, self.dtype, offset=8)

    def update(self, layer, k, v):
        end = self.length + k.size(2)
        if end > self.max_len:
            raise ValueError(f"KVCache holds {self.max_len} positions; {end} do not fit")
        layer_kv = self.kv[layer]  # (2, B, nh, max_len, head_bytes)
        layer_kv[:, :, :, self.length:end] = self.encode(torch.stack((k, v)))  # the new columns only
        return self.decode(layer_kv[:, :, :, :end]).unbind(0)  # all of them, (B, nh, end, hd) each

    def __getitem__(self, layer):
        return self.decode(self.kv[layer, :, :, :, :self.length]).unbind(0)

    def empty_like(self, batch_size):
        return QuantizedKVCache(self.config, batch_size, self.kv.device, self.dtype,
                                self.max_len, self.kv_dtype)


def new_kv_cache(kv_dtype, config, batch_size, device=None, dtype=torch.float32, max_len=None):
    """An empty cache storing keys and values as kv_dtype (a name in KV_DTYPES) for a model
    computing in dtype: KVCacheGPT.new_cache(batch_size, kind=kv_dtype) calls this."""
    if kv_dtype in QUANT_BITS:
        return QuantizedKVCache(config, batch_size, device, dtype, max_len, kv_dtype)
    if DTYPES[kv_dtype] == dtype:
        return KVCache(config, batch_size, device, dtype, max_len)
    return CastKVCache(config, batch_size, device, dtype, max_len, DTYPES[kv_dtype])


CACHE_KINDS.update({name: functools.partial(new_kv_cache, name) for name in KV_DTYPES})


# ---------------------------------------------------------------------------- the demo

def relative_error(x, y):
    return ((x - y).norm() / x.norm()).item()


def round_trip(x, bits, group, per_channel):
    """x (..., T, hd) quantized and read back, scales per token (groups of channels) or per
    channel (groups of `group` tokens, as KIVI does for keys)."""
    if per_channel:
        x = x.transpose(-1, -2)  # (..., hd, T): a channel's tokens along the last dim
    y = dequantize(*quantize(x, bits, group), torch.float32)
    return y.transpose(-1, -2) if per_channel else y


@torch.inference_mode()
def real_keys_and_values(model, ids, n_windows):
    """Keys and values (n_layer, n_windows, nh, block_size, hd) of windows spread over ids."""
    block = model.config.block_size
    starts = torch.linspace(0, ids.numel() - block, n_windows).long().tolist()
    cache = model.new_cache(n_windows, "float32")
    model(torch.stack([ids[s:s + block] for s in starts]), cache)
    keys, values = zip(*(cache[layer] for layer in range(len(cache))))
    return torch.stack(keys).float(), torch.stack(values).float()


def greedy_agreement(model, prompts, n, vocab_limit):
    """For each kv dtype: the greedy tokens of every prompt, compared with the float32 cache's."""
    def run_kind(kind):
        return torch.cat(list(model.stream(prompts, n, temperature=0, vocab_limit=vocab_limit,
                                           cache_kind=kind)), dim=1)
    reference = run_kind("float32")
    for kind in KV_DTYPES:
        same = run_kind(kind) == reference                       # (rows, n)
        first_diff = torch.where(same.all(1), n, (~same).int().argmax(1))
        yield kind, same.float().mean().item(), first_diff.tolist()


def main():
    parser = ArgumentParser(description="The quantized KV cache: bytes, round-trip error on the "
                            "model's real keys and values, greedy agreement with a float32 cache.")
    add_model_args(parser)
    parser.add_argument("--text", default=str(Path(__file__).parent / "checkpoints" / "shakespeare"
                                              / "heldout.txt"),
                        help="text whose keys and values are measured (default: the held-out plays)")
    parser.add_argument("--tokens", type=positive_int, default=200,
                        help="greedy tokens compared per prompt (default: 200)")
    parser.add_argument("--prompts", type=positive_int, default=8,
                        help="prompts taken from --text for the greedy comparison (default: 8)")
    args = parser.parse_args()
    try:
        text = Path(args.text).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--text {args.text}: cannot read it as UTF-8 text ({e})") from None
    model, tokenizer, device = load_from_args(KVCacheGPT, args)
    c, ids = model.config, torch.tensor(tokenizer.encode_ordinary(text), device=device)
    if ids.numel() < 2 * c.block_size:
        raise UserError(f"--text {args.text}: needs at least {2 * c.block_size} tokens, has {ids.numel()}")

    print(f"\n1. Bytes per token: 2 x {c.n_layer} layers x {c.n_head} heads x head bytes, scales counted")
    print(f"   {'kv dtype':9s} {'one head':>34s} {'per token':>10s} {'x block_size':>14s} {'tensors hold':>14s}")
    for kind in KV_DTYPES:
        formula = kv_cache_bytes(c.n_layer, c.n_head, c.head_dim, kind, c.block_size)
        held = model.new_cache(1, kind).nbytes()
        print(f"   {kind:9s} {head_bytes_text(c.head_dim, kind):>25s} = {head_bytes(c.head_dim, kind):3d} B "
              f"{kv_bytes_per_token(c.n_layer, c.n_head, c.head_dim, kind):8,} B {formula:12,} B {held:12,} B")

    n_windows = min(8, ids.numel() // c.block_size)
    keys, values = real_keys_and_values(model, ids, n_windows)
    print(f"\n2. Real keys and values ({n_windows} windows of {args.text}): round-trip error "
          "||x - read back|| / ||x||")
    for name, x in (("keys", keys), ("values", values)):
        channel_max = x.abs().amax(dim=(1, 3))  # (n_layer, nh, hd): each channel's largest |value|
        ratio = (channel_max.amax(-1) / channel_max.median(-1).values).amax().item()
        print(f"   {name:6s}: the largest channel's max |x| is up to {ratio:.1f}x the median channel's")
    group = math.gcd(INT4_GROUP, c.block_size)  # tokens per per-channel scale
    print(f"   {'scheme':46s} {'keys':>7s} {'values':>7s}")
    for bits in (8, 4):
        schemes = [(f"int{bits} per token, groups of {group_size(c.head_dim, f'int{bits}')} channels",
                    group_size(c.head_dim, f"int{bits}"), False),
                   (f"int{bits} per channel, groups of {group} tokens (KIVI)", group, True)]
        for label, g, per_channel in schemes:
            print(f"   {label:46s} {relative_error(keys, round_trip(keys, bits, g, per_channel)):7.4f} "
                  f"{relative_error(values, round_trip(values, bits, g, per_channel)):7.4f}")

    prompt_len = min(32, c.block_size // 4)
    starts = torch.linspace(0, ids.numel() - prompt_len, args.prompts).long().tolist()
    prompts = [ids[s:s + prompt_len].tolist() for s in starts]
    print(f"\n3. Greedy agreement with the float32 cache: {args.prompts} prompts of {prompt_len} "
          f"tokens from the text, {args.tokens} new tokens each")
    for kind, same, first_diff in greedy_agreement(model, prompts, args.tokens, tokenizer.n_vocab):
        print(f"   {kind:9s}: {100 * same:5.1f}% of tokens the same; first difference at "
              f"{', '.join(map(str, first_diff))} (of {args.tokens})")
    print(f"\nbits/char through each cache: python generate.py --score {args.text} --kv-dtype int4",
          file=sys.stderr)


if __name__ == "__main__":
    run(main)
