"""
The same models as base_model.py and llama.py, with one change to forward(): it takes
and returns the keys and values of past tokens, so generation feeds only the newest token
per step.

Keys and values of past tokens never change (attention is causal), so they are computed
once and kept. forward() changes in three places, marked (1) (2) (3) in the code:
  1. positions: a new token sits at absolute position past_len, not 0 (GPT-2: a row of
     the position table; Llama: the rotary angle of past_len);
  2. the causal mask: new queries sit at global rows past_len .. past_len+T-1;
  3. attention stores the new keys and values and attends over all of them (cache.attend
     calls cache.update: the cache step).
The parameters are untouched, so any base_model.GPT (llama.Llama) checkpoint loads into
KVCacheGPT (KVCacheLlama) unchanged.

Read it in this order: what a cache offers attention (Cache, just below), then
CachedModel.forward (the change, for both families), then how each family places a
position (KVCacheGPT.embed_at: a row of the position table; KVCacheLlama.embed_at: rotary
angles), then the two kinds of cache (ConcatCache, the seed's torch.cat; KVCache, one
preallocated buffer). The loop that generates with them is generation/loop.py. Run
`python kv_cache.py` for the demo (demo/kv_cache_demo.py): parity with a full forward,
speed with and without the cache, its size (`--ckpt checkpoints/shakespeare-llama/ckpt.pt`:
what fewer heads save), a batch, and speculative decoding (the cache rolled back).
"""

import torch
import torch.nn.functional as F

from base_model import GPT, CausalSelfAttention
from generation.loop import generate_tokens
from llama import Llama, LlamaAttention, rotate
from kv_quant import dtype_name, storage_format


# ---------------------------------------------------------------------------- the caches
#
# A cache holds, for every layer, the keys and values of the positions seen so far: rows are
# sequences, columns are cached positions. What attention needs of it (Cache):
#     k, v = cache.update(layer, k_new, v_new)   store the new columns, return all of them
#     cache.length                               columns filled in every row; the cache
#                                                counts the new ones once the last layer
#                                                has stored its own
#     cache.pad                                  None, or per row the padding columns at its
#                                                left (batches of prompts of different lengths)
#     cache.attend(layer, q, k, v, mask)         update(), then attention over what it returns
# A cache stores n_kv_head heads (config.n_kv_head): every head for GPT-2, fewer for a model
# with grouped-query attention, whose query heads share them.
# The serving engine's paged cache (serving/paged_cache.py) is a Cache too; the compiled
# step's and the paged kernel's caches (generation/compiled_step.py, serving/paged_attention.py)
# offer attend() alone, which is all forward_at calls.

class Cache:
    length = 0
    pad = None  # LongTensor (B,): row b's first pad[b] columns hold no token (left padding)

    def update(self, layer, k, v):
        raise NotImplementedError

    def attend(self, layer, q, k, v, mask):
        """Attention of the new queries q (B, nh, T, hd) over the cache and the new keys and
        values (B, n_kv_head, T, hd): (B, nh, T, hd). The cache step, then SDPA over
        everything it returns. (A cache that reads its keys where they lie, without
        assembling them, has an attend of its own: serving/paged_attention.py.)"""
        k, v = self.update(layer, k, v)   # (B, n_kv_head, past_len + T, hd): the past, reused
        # fewer key/value heads than query heads (grouped-query attention): SDPA lets each
        # group of n_head / n_kv_head query heads read one stored head, without copying it
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                              enable_gqa=k.size(1) != q.size(1))


# ---------------------------------------------------------------------------- the model

class CachedModel:
    """What the two cached models share: forward(), the one change (its parts marked (1) (2)
    (3)), a new cache, and generate() through the loop. A family says only how a position
    enters the model (embed_at) and where its blocks are (blocks)."""

    def forward(self, idx, past_kv=None, last_only=False):
        """idx (B, T) are the new tokens; past_kv is None, the seed's list of per-layer
        (k, v), or a Cache. Returns logits (B, T, V) and the cache, extended by these T
        positions: the same Cache object, or for the seed's list form a ConcatCache, which
        reads as that list (cache[layer] is the layer's (k, v)). last_only=True computes
        logits for the last position only (B, 1, V): all that generation needs, and it
        spares a (T x vocab) matmul when prefilling a prompt.

        The naive forward (GPT.forward, Llama.forward), plus the three things marked (1) (2) (3)."""
        cache = as_cache(past_kv, self.config.n_layer)
        past_len, T = cache.length, idx.size(1)
        # (1) positions offset by the cache: the new tokens sit at past_len .. past_len+T-1
        positions = self.positions(past_len, T, cache.pad, idx.device)
        # (2) the causal mask, sliced at the new queries' global rows past_len .. past_len+T-1
        mask = self.attention_mask(past_len, T, cache.pad, idx.device)
        # (3) the cache update happens inside attention: cache.attend calls cache.update(layer, k, v)
        return self.forward_at(idx, positions, cache, mask, last_only), cache

    def forward_at(self, idx, positions, cache, mask, last_only=False):
        """Logits (B, T, V), or (B, 1, V) with last_only, for the new tokens idx (B, T) at
        `positions`, every layer's attention extending `cache` and seeing the keys `mask`
        lets it see. forward() calls it; so do the compiled step (generation/compiled_step.py:
        a static cache, positions and a mask as tensors of fixed shape) and the serving
        engine's paged step (serving/paged_attention.py: the pool as the cache)."""
        x, block_args = self.embed_at(idx, positions)  # (B, T, C), and Llama's rotary angles
        for layer, block in enumerate(self.blocks):
            x = block(x, **block_args, cache=cache, layer=layer, mask=mask)
        return self.head(x[:, -1:] if last_only else x)

    def positions(self, past_len, T, pad, device):
        """(1) The positions of the new tokens, columns past_len .. past_len+T-1 of the cache:
        (T,), or with left padding (batches of prompts of different lengths) (B, T), each
        row's columns minus its padding, so that every row's first real token is at 0.

        Why not the columns: GPT-2's positions are learned and absolute, so a row that used
        its columns would be read as if its text started pad[b] tokens later, and the model
        would write different text. Rotary positions are relative (q . k sees only the
        distance): a row's distances are the same either way, but its angles, and so its
        rounding, would differ from the ones it gets alone."""
        self.check_context(past_len + T)  # columns: a row's positions are fewer
        columns = torch.arange(past_len, past_len + T, device=device)
        if pad is None:
            return columns
        return (columns - pad[:, None]).clamp(min=0)  # padding columns: any position, nothing reads them

    @staticmethod
    def attention_mask(past_len, T, pad, device):
        """(2) What SDPA needs to know of the causal order: None (every query sees every key)
        or a bool mask, True where a query may see a key.

        Tq = T new queries, at global rows past_len .. past_len+T-1
        Tk = S = past_len + T keys: the cached ones, then the new ones
          no padding, T == 1: the newest token may see every key: no mask to build
          no padding, T > 1:  rows past_len.. of the causal mask (query row i sees keys <= i).
                              SDPA's is_causal=True would assume the rows start at 0
                              (top-left aligned), wrong as soon as something is cached
          left padding:       the same, and no query may see a padding column; a padding
                              query sees only itself (a row with no visible key is NaN in
                              softmax, and 0 * NaN would leak into the real rows)"""
        S = past_len + T
        if pad is None and T == 1:
            return None
        # causal_mask[S - T:S, :S], built directly: key j is visible from row past_len + i if j <= past_len + i
        mask = torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=past_len)
        if pad is None:
            return mask
        real_key = torch.arange(S, device=device) >= pad[:, None]  # (B, S)
        mask = mask & real_key[:, None, :]                          # (B, T, S)
        mask.diagonal(offset=past_len, dim1=1, dim2=2).fill_(True)  # each query sees itself
        return mask[:, None]                                        # (B, 1, T, S): all heads

    def new_cache(self, batch_size, kind=None, pad=None, max_len=None):
        """An empty cache for batch_size rows on the model's device: the preallocated KVCache
        storing keys and values in the model's dtype (kind None) or as `kind`, a name in
        kv_quant.KV_DTYPES; kind "cat" is the seed's torch.cat cache. pad: the rows' left
        padding, for a batch of prompts of different lengths. max_len: the positions the
        preallocated cache holds (default: the whole context)."""
        if kind == "cat":
            return ConcatCache(self.config.n_layer, pad=pad)
        p = self.lm_head.weight
        return KVCache(self.config, batch_size, p.device, p.dtype, max_len=max_len, kv_dtype=kind, pad=pad)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
                 generator=None, vocab_limit=None, **loop_args):
        """The naive model's generate, through the cache: idx (B, T) -> (B, T + max_new_tokens).
        The loop is generation/loop.py's; loop_args are its options (cache_kind, compile,
        stats, context_policy)."""
        new_tokens = generate_tokens(self, idx, max_new_tokens, temperature=temperature,
                                     top_k=top_k, top_p=top_p, generator=generator,
                                     vocab_limit=vocab_limit, **loop_args)
        return torch.cat([idx, new_tokens], dim=1)


class CachedSelfAttention(CausalSelfAttention):
    """base_model's attention (same parameters), reading and extending a cache. Called
    without one (GPT.forward on this model, e.g. for training), it is base_model's."""

    def forward(self, x, cache=None, layer=None, mask=None):
        if cache is None:
            return super().forward(x)
        q, k, v = self.qkv(x)                   # (B, nh, T, hd) each, for the T new tokens
        y = cache.attend(layer, q, k, v, mask)  # (3) cache.update(layer, k, v), then SDPA
        return self.project_out(y)


class KVCacheGPT(CachedModel, GPT):
    """base_model.GPT with the one change to forward() (CachedModel.forward): a position
    enters as a row of the position table, added to the token's embedding."""
    Attention = CachedSelfAttention

    def embed_at(self, idx, positions):
        """The first block's input for idx (B, T) at positions ((T,) or (B, T)), and what
        every block takes besides (nothing: GPT-2's positions are in the input)."""
        return self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(positions)), {}

    @property
    def blocks(self):
        return self.transformer.h


class CachedLlamaAttention(LlamaAttention):
    """llama's attention (same parameters), reading and extending a cache."""

    def forward(self, x, rope, cache=None, layer=None, mask=None):
        if cache is None:
            return super().forward(x, rope)
        # q (B, nh, T, hd); k, v (B, n_kv_head, T, hd): the keys already rotated to their
        # positions, so the cache stores them rotated and never touches them again
        q, k, v = self.qkv(x, rope)
        y = cache.attend(layer, q, k, v, mask)  # (3) cache.update(layer, k, v), then SDPA (GQA)
        return self.project_out(y)


class KVCacheLlama(CachedModel, Llama):
    """llama.Llama with the same change to forward(): a position enters as the rotary angle
    every block turns its queries and keys by; the cache stores keys after rotation, and
    n_kv_head heads of them."""
    Attention = CachedLlamaAttention

    def embed_at(self, idx, positions):
        """The first block's input for idx (B, T), and what every block takes besides: the
        rotary angles of positions ((T,) or (B, T))."""
        return self.model.embed_tokens(idx), {"rope": self.rotary(positions)}

    @property
    def blocks(self):
        return self.model.layers

    def move_keys(self, cache, start, shift):
        """Move the cached keys of columns start.. of row b `shift[b]` positions earlier
        (shift: LongTensor (B,)). A rotated key's position is an angle, and rotations add
        up: turning it by -shift x inv_freq makes it the key it would have been there. What
        the sinks policy does (generation/loop.py), so that positions stay those of the
        cache's columns; GPT-2's learned positions have no such move."""
        cos, sin = self.rotary(-shift[:, None])       # (B, 1, 1, hd/2): one angle per row
        cache.map_keys(start, lambda k: rotate(k, cos, sin))


# family -> the cached class, for the loaders (plumbing's NAIVE_MODELS are the naive ones)
CACHED_MODELS = {"gpt": KVCacheGPT, "llama": KVCacheLlama}


# ---------------------------------------------------------------------------- two kinds of cache
#
# Both also say how big they are (nbytes), turn their cached keys for the sinks policy
# (map_keys: model.move_keys), and hand the generation loop the tensors they store
# (tensors, hold): it moves their rows and columns itself (generation/rows.py), for batches
# whose rows finish, speculative decoding and the context policies.

class ConcatCache(Cache):
    """The seed's cache: a list of per-layer (k, v), each (B, nh, length, hd), grown by
    torch.cat. Simple, and what forward() takes when a caller passes the seed's list (it
    reads as that list: cache[layer] is the layer's (k, v)); but every step copies the whole
    past (O(t) bytes per step, O(T^2) per generation)."""

    def __init__(self, n_layer, layers=None, pad=None):
        self.n_layer, self.pad = n_layer, pad
        self.layers = list(layers or [])  # a copy: the caller's list stays as it was
        self.length = self.layers[0][0].size(2) if self.layers else 0

    def update(self, layer, k, v):
        if layer < len(self.layers):
            pk, pv = self.layers[layer]     # (B, nh, past_len, hd)
            k = torch.cat([pk, k], dim=2)   # THE cache step: reuse, don't recompute
            v = torch.cat([pv, v], dim=2)
            self.layers[layer] = (k, v)
        else:
            self.layers.append((k, v))
        if layer == self.n_layer - 1:
            self.length = k.size(2)
        return k, v

    def __len__(self):
        return len(self.layers)

    def __getitem__(self, layer):
        return self.layers[layer]

    def nbytes(self):
        return sum(k.nbytes + v.nbytes for k, v in self.layers)

    def tensors(self):
        """The tensors that hold its columns: k and v of every layer, (B, nh, length, hd)
        each (rows on dim -4, columns on dim -2, as KVCache's buffer)."""
        return [t for kv in self.layers for t in kv]

    def hold(self, tensors, length):
        """Hold `tensors` (tensors()'s layout), their first `length` columns: a ConcatCache
        keeps no more columns than it has filled, as torch.cat grows it."""
        kept = [t[..., :length, :] for t in tensors]
        self.layers, self.length = list(zip(kept[0::2], kept[1::2])), length

    def map_keys(self, start, fn):
        """Replace the keys of columns start.. of every layer, k (..., B, nh, length - start,
        hd) (one layer's, or every layer's at once), by fn(k), which keeps the shape (the
        sinks policy turns them to the positions they have moved to: model.move_keys)."""
        self.layers = [(torch.cat([k[:, :, :start], fn(k[:, :, start:])], dim=2), v)
                       for k, v in self.layers]


class KVCache(Cache):
    """A preallocated cache: one buffer (n_layer, 2, B, nh, max_len, width) for every layer's
    k and v, allocated once and written in place, so a step writes only its own columns
    where torch.cat copies the whole past. The default kind.

    kv_dtype says how keys and values are stored (kv_quant.py): as the model computes
    (default: the model's dtype), another float dtype, or int8/int4 codes with their
    scales. update() writes new columns through the format's encode() and reads the cache
    back through its decode(); for the model's own dtype both do nothing, and attention
    reads views of the buffer."""

    def __init__(self, config, batch_size, device=None, dtype=torch.float32, max_len=None,
                 kv_dtype=None, pad=None):
        self.max_len, self.kv_dtype = max_len or config.context_len, kv_dtype or dtype_name(dtype)
        self.format = storage_format(self.kv_dtype, config.head_dim, dtype)
        shape = (config.n_layer, 2, batch_size, config.n_kv_head, self.max_len,
                 self.format.width(config.head_dim))
        # empty, not zeros: a position is always written before it is read, and zeroing
        # GPT-2's 75 MB cache would cost every generation a pass over it
        self.kv = torch.empty(shape, device=device, dtype=self.format.storage_dtype)
        self.length, self.pad = 0, pad

    def update(self, layer, k, v):
        T = k.size(2)  # new positions, written at columns length .. end - 1
        end = self.length + T
        if end > self.max_len:
            raise ValueError(f"KVCache holds {self.max_len} positions; {end} do not fit")
        # the layer's keys and values, (B, nh, max_len, width) each: views of the buffer, taken
        # once and then narrowed (narrow(2, start, n) is [:, :, start:start + n]) rather than
        # indexing the 6-d buffer again for every write and read
        keys, values = self.kv[layer, 0], self.kv[layer, 1]
        keys.narrow(2, self.length, T).copy_(self.format.encode(k))  # in place; the past is not copied
        values.narrow(2, self.length, T).copy_(self.format.encode(v))
        if layer == len(self.kv) - 1:
            self.length = end
        k_all, v_all = keys.narrow(2, 0, end), values.narrow(2, 0, end)  # (B, nh, end, width)
        return self.format.decode(k_all), self.format.decode(v_all)

    def __len__(self):
        return self.kv.size(0)

    def __getitem__(self, layer):
        """(k, v) of one layer, (B, nh, length, hd) each, in the model's dtype: the seed's
        list entry."""
        k, v = self.kv[layer, :, :, :, :self.length]
        return self.format.decode(k), self.format.decode(v)

    def nbytes(self):
        return self.kv.nbytes

    def tensors(self):
        """The tensor that holds its columns: the buffer, (n_layer, 2, B, nh, max_len,
        width) (rows on dim -4, columns on dim -2, as ConcatCache's tensors), its bytes as
        the format stores them."""
        return [self.kv]

    def hold(self, tensors, length):
        """Hold `tensors` (tensors()'s layout: one buffer, of any number of rows and
        columns), its first `length` columns filled."""
        self.kv, = tensors
        self.max_len, self.length = self.kv.size(4), length

    def map_keys(self, start, fn):
        keys = self.kv[:, 0, :, :, start:self.length]  # (n_layer, B, nh, columns, width): every layer at once
        keys.copy_(self.format.encode(fn(self.format.decode(keys))))


def as_cache(past_kv, n_layer):
    """The seed's list of per-layer (k, v) (or None: nothing cached yet) as a ConcatCache;
    any Cache as it is."""
    if isinstance(past_kv, Cache):
        return past_kv
    if past_kv is not None and not isinstance(past_kv, (list, tuple)):
        raise TypeError(
            f"forward(idx, past_kv): past_kv is a cache (a list of per-layer (k, v) or a Cache), "
            f"got {type(past_kv).__name__}; to train with targets call the naive model's "
            "forward, base_model.GPT.forward(model, idx, targets) (llama.Llama.forward for a "
            "Llama): the parameters are the same")
    return ConcatCache(n_layer, past_kv)


if __name__ == "__main__":
    # the demo (parity, speed, size, a batch, speculative decoding) lives in demo/, which is
    # handed the models rather than importing this module back
    from demo.kv_cache_demo import main
    from plumbing.script import run
    run(lambda: main(CACHED_MODELS))
