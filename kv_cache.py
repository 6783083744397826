"""
The same models as base_model.py and llama.py, with one change to forward(): it takes
and returns the keys and values of past tokens, so generation feeds only the newest token
per step.

Keys and values of past tokens never change (attention is causal), so they are computed
once and kept. Two things must then respect the cache:
  1. positions: a new token sits at absolute position past_len, not 0 (GPT-2: a row of
     the position table; Llama: the rotary angle of past_len);
  2. the causal mask: new queries sit at global rows past_len .. past_len+T-1.
The parameters are untouched, so any base_model.GPT (llama.Llama) checkpoint loads into
KVCacheGPT (KVCacheLlama) unchanged.

Read it in this order: the caches (what `cache.update` does), then KVCacheGPT.forward (the
change), then KVCacheLlama.forward (the same change for rotary positions and grouped-query
attention). The loop that generates with them is generation/loop.py. Run
`python kv_cache.py` for the demo: parity with a full forward, speed with and without the
cache, its size (`--ckpt checkpoints/shakespeare-llama/ckpt.pt`: what fewer heads save), a
batch, and speculative decoding (the cache rolled back).
"""

import time

import torch
import torch.nn.functional as F

from base_model import GPT, CausalSelfAttention
from generation.loop import GenerationStats, generate_tokens, synchronize
from llama import Llama, LlamaAttention, rotate
from kv_quant import cache_bytes, cache_formula, dtype_name, storage_format


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
# The serving engine's paged cache (serving/paged_cache.py) and the compiled step's view of
# the buffer (generation/compiled_step.py) are Caches too. ConcatCache and KVCache below
# also say how big they are (nbytes), turn their cached keys for the sinks policy
# (map_keys: model.move_keys), and hand the generation loop the tensors they store
# (tensors, hold): it moves their rows and columns itself (generation/rows.py), for
# batches whose rows finish, speculative decoding and the context policies.

class Cache:
    length = 0
    pad = None  # LongTensor (B,): row b's first pad[b] columns hold no token (left padding)

    def update(self, layer, k, v):
        raise NotImplementedError

    def attend(self, layer, q, k, v, mask):
        """Attention of the new queries q (B, nh, T, hd) over the cache and the new keys and
        values (B, n_kv_head, T, hd): (B, nh, T, hd). The cache step, then SDPA over
        everything it returns. (A cache that can read its keys where they lie, without
        assembling them, overrides this: serving/paged_cache.py.)"""
        k, v = self.update(layer, k, v)   # (B, n_kv_head, past_len + T, hd): the past, reused
        # fewer key/value heads than query heads (grouped-query attention): SDPA lets each
        # group of n_head / n_kv_head query heads read one stored head, without copying it
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                              enable_gqa=k.size(1) != q.size(1))


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
        self.config, self.dtype, self.max_len = config, dtype, max_len or config.context_len
        self.kv_dtype = kv_dtype or dtype_name(dtype)
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


# ---------------------------------------------------------------------------- the model

class CachedModel:
    """What the two cached models share: (3) the mask of the new queries, a new cache, and
    generate() through the loop. Each model's forward (KVCacheGPT's, KVCacheLlama's) makes
    the three changes; embed_at and blocks are what the compiled decode step
    (generation/compiled_step.py) calls instead, with its positions in a tensor."""

    @staticmethod
    def attention_mask(past_len, T, pad, device):
        """What SDPA needs to know of the causal order: None (every query sees every key)
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
        y = cache.attend(layer, q, k, v, mask)  # cache.update(layer, k, v), then SDPA
        return self.project_out(y)


class KVCacheGPT(CachedModel, GPT):
    Attention = CachedSelfAttention

    def forward(self, idx, past_kv=None, last_only=False):
        """idx (B, T) are the new tokens; past_kv is None, the seed's list of per-layer
        (k, v), or a Cache. Returns logits (B, T, V) and the cache, extended by these T
        positions: the same Cache object, or for the seed's list form a ConcatCache, which
        reads as that list (cache[layer] is the layer's (k, v)). last_only=True computes
        logits for the last position only (B, 1, V): all that generation needs, and it
        spares a (T x vocab) matmul when prefilling a prompt.

        GPT.forward, plus the three things marked (1) (2) (3)."""
        cache = as_cache(past_kv, self.config.n_layer)
        past_len, T = cache.length, idx.size(1)
        # (1) positions offset by the cache: the new tokens sit at past_len .. past_len+T-1
        x = self.embed(idx, past_len, cache.pad)
        # (3) which cached and new keys each new query may see
        mask = self.attention_mask(past_len, T, cache.pad, idx.device)
        for layer, block in enumerate(self.transformer.h):
            # (2) the cache update happens inside attention: CachedSelfAttention.forward
            x = block(x, cache=cache, layer=layer, mask=mask)
        logits = self.head(x[:, -1:] if last_only else x)
        return logits, cache

    def embed(self, idx, start_pos=0, pad=None):
        """Token plus position embeddings for the columns start_pos.. of idx (B, T).

        With left padding (batches of prompts of different lengths), row b's first real
        token sits at column pad[b] but must get position 0: GPT-2's positions are learned
        and absolute, so a row that used the column as its position would be read as if its
        text started pad[b] tokens later, and the model would write different text."""
        if pad is None:
            return super().embed(idx, start_pos)
        self.check_context(start_pos + idx.size(1))  # columns: a row's positions are fewer
        columns = torch.arange(start_pos, start_pos + idx.size(1), device=idx.device)
        # (B, T); padding columns would be negative: any valid row will do, nothing reads them
        positions = (columns - pad[:, None]).clamp(min=0)
        return self.embed_at(idx, positions)[0]

    def embed_at(self, idx, positions):
        """The first block's input for idx (B, T) at positions (B, T), and what every block
        takes besides (nothing: GPT-2's positions are in the input)."""
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
        y = cache.attend(layer, q, k, v, mask)  # cache.update(layer, k, v), then SDPA (GQA)
        return self.project_out(y)


class KVCacheLlama(CachedModel, Llama):
    """llama.Llama with the same three changes: (1) the rotary angles of positions past_len..,
    (2) the cache update inside attention, keys after rotation, n_kv_head heads, (3) the
    same mask."""
    Attention = CachedLlamaAttention

    def forward(self, idx, past_kv=None, last_only=False):
        """KVCacheGPT.forward's contract, for llama.Llama: Llama.forward plus (1) (2) (3)."""
        cache = as_cache(past_kv, self.config.n_layer)
        past_len, T = cache.length, idx.size(1)
        # (1) positions offset by the cache: the new tokens are rotated by the angles of
        #     positions past_len .. past_len+T-1 (each row's own, with left padding)
        rope = self.rotary(self.positions(past_len, T, cache.pad, idx.device))
        # (3) which cached and new keys each new query may see: the same mask as GPT-2's
        mask = self.attention_mask(past_len, T, cache.pad, idx.device)
        x = self.model.embed_tokens(idx)
        for layer, block in enumerate(self.model.layers):
            # (2) the cache update happens inside attention: CachedLlamaAttention.forward
            x = block(x, rope, cache=cache, layer=layer, mask=mask)
        logits = self.head(x[:, -1:] if last_only else x)
        return logits, cache

    def positions(self, start_pos, T, pad, device):
        """The positions of columns start_pos .. start_pos+T-1: (T,), or with left padding
        (B, T), each row's columns minus its padding. Rotary positions are relative (q . k
        sees only the distance), so a batch without padding would do as well with columns;
        with padding a row's distances are the same either way too, but its angles would
        differ from the ones it gets alone, and so would its rounding."""
        self.check_context(start_pos + T)
        columns = torch.arange(start_pos, start_pos + T, device=device)
        if pad is None:
            return columns
        return (columns - pad[:, None]).clamp(min=0)  # padding columns: any angle, nothing reads them

    def embed_at(self, idx, positions):
        """The first block's input for idx (B, T), and what every block takes besides: the
        rotary angles of positions (B, T)."""
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


# ---------------------------------------------------------------------------- the demo

def incremental_logits(model, idx, chunk, kind):
    """Feed idx (B, T) through a cache of `kind` `chunk` tokens per forward (the seed's
    list form for "cat"); returns the logits (B, T, V) and the cache."""
    cache = None if kind == "cat" else model.new_cache(idx.size(0), kind)
    pieces = []
    for start in range(0, idx.size(1), chunk):
        logits, cache = model(idx[:, start:start + chunk], cache)
        pieces.append(logits)
    return torch.cat(pieces, dim=1), cache


def timed_generate(model, idx, n, vocab_limit, **loop_args):
    """(tokens, tokens per second) for a greedy generation of n tokens."""
    synchronize(idx.device)
    t0 = time.perf_counter()
    out = model.generate(idx, n, temperature=0, vocab_limit=vocab_limit, **loop_args)
    synchronize(idx.device)
    return out, n / (time.perf_counter() - t0)


def speculative_step_by_hand(model, tokenizer, ids, k, n):
    """One step of speculative decoding done with the cache directly, printed: at the first
    point of the text ids (a greedy generation: the model's own choices) where a prompt-lookup
    proposal is partly right."""
    from generation.speculative import PromptLookup, verify
    lookup = PromptLookup(n)
    for end in range(2, len(ids) - k):
        lookup.start([ids[:end]])
        proposals = lookup.propose(k)
        proposed = proposals.tokens[0, :proposals.counts[0]].tolist()
        right = next((i for i, (a, b) in enumerate(zip(proposed, ids[end:])) if a != b), len(proposed))
        if 0 < right < len(proposed):
            break
    else:
        print("   (no proposal in this text is partly right: see the totals below)")
        return
    show = lambda tokens: " ".join(repr(tokenizer.decode([t])) for t in tokens)  # noqa: E731
    cache = model.new_cache(1)
    model(torch.tensor([ids[:end - 1]]), cache)  # the text so far, but its newest token
    print(f"   the text so far ends {tokenizer.decode(ids[max(0, end - 8):end])!r}; "
          f"the cache holds {cache.length} columns")
    print(f"   prompt lookup proposes {show(proposed)}")
    fed = torch.tensor([[ids[end - 1]] + proposed])
    logits, cache = model(fed, cache)  # the newest token and the proposals, one pass
    tokens, counts = verify(logits, proposals, temperature=0)
    accepted = int(counts[0]) - 1
    print(f"   one pass over the newest token + {len(proposed)} proposals: the cache holds "
          f"{cache.length}; the model's own choices {show(tokens[0].tolist())}")
    cache.rollback(torch.tensor([end + accepted]))  # the newest token + the accepted ones
    print(f"   it agrees with the first {accepted}, then adds its own "
          f"{show(tokens[0, accepted:accepted + 1].tolist())}: {accepted + 1} tokens for one pass")
    print(f"   rollback: the cache forgets the {len(proposed) - accepted} rejected and holds "
          f"{cache.length} columns, as if they had never been fed")


def speculative_part(model, tokenizer, prompt, n_tokens, k, n, draft, kv):
    """Part 5: a step by hand, then whole generations with each proposer against plain."""
    from generation.speculative import PromptLookup
    n_vocab = tokenizer.n_vocab
    plain, plain_tps = timed_generate(model, prompt, n_tokens, n_vocab, **kv)
    speculative_step_by_hand(model, tokenizer, plain[0].tolist(), k, n)
    proposers = {f"prompt lookup ({n}-grams)": PromptLookup(n)}
    if draft is not None:
        proposers[draft.describe()] = draft
    print(f"   {n_tokens} new tokens, greedy, up to {k} proposals per pass; plain: {plain_tps:.1f} tokens/s")
    for name, proposer in proposers.items():
        stats = GenerationStats()
        options = dict(speculate=k, proposer=proposer, **kv)
        timed_generate(model, prompt, 8, n_vocab, **options)  # warm-up
        out, tps = timed_generate(model, prompt, n_tokens, n_vocab, stats=stats, **options)
        print(f"   {name}: {stats.proposed} proposed, {stats.accepted} accepted "
              f"({stats.accepted / max(1, stats.proposed):.0%}), {stats.forward_passes} forward passes "
              f"for {n_tokens} tokens; {tps:.1f} tokens/s ({tps / plain_tps:.2f}x); same tokens: "
              f"{'yes' if torch.equal(out, plain) else 'no (float ties in argmax)'}")


def main():
    # the command-line layer, for the demo only: importing this module never loads it
    from kv_quant import KV_DTYPES
    from plumbing.checkpoint import NAIVE_MODELS
    from plumbing.cli import (ArgumentParser, add_model_args, add_speculation_args, check_speculate,
                              load_from_args, positive_int, prepare_for_generation, proposer_from_args)
    from plumbing.script import UserError
    from plumbing.user_text import prompt_tokens

    parser = ArgumentParser(description="KV-cache demo: parity with a full forward, "
                            "speed with and without the cache, the cache's size, a batch.")
    add_model_args(parser)
    parser.add_argument("--tokens", type=positive_int, default=200,
                        help="tokens to generate in the speed test (default: 200)")
    parser.add_argument("--compile", action="store_true", help="also time the cached loop "
                        "with its static-shape decode step compiled (generation/compiled_step.py)")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, help="also store the cache as this "
                        "dtype (int8, int4: quantized; kv_quant.py) and use it in parts 2-5")
    add_speculation_args(parser)
    args = parser.parse_args()
    model, tokenizer, device = load_from_args(CACHED_MODELS, args)
    args.speculate = args.speculate or 4  # part 5: prompt lookup always, the draft if given
    check_speculate(args.speculate, model)
    draft = proposer_from_args(CACHED_MODELS, args, model, tokenizer, device) if args.draft is not None else None
    kv = {"cache_kind": args.kv_dtype} if args.kv_dtype else {}  # the loop's, or its default
    try:
        model.new_cache(1, args.kv_dtype)
    except ValueError as e:
        raise UserError(f"--kv-dtype {args.kv_dtype}: {e}") from None
    config = model.config

    # Weight compatibility: the naive model takes the cached model's state dict as it is,
    # and the same weight layout, so that the speed comparison measures only the cache.
    naive = NAIVE_MODELS[config.family](config).to(device=device, dtype=model.lm_head.weight.dtype).eval()
    naive.load_state_dict(model.state_dict(), strict=True)
    prepare_for_generation(naive, args)

    print("\n1. Correctness: incremental feeds vs one full forward (max |full - incremental| logit)")
    T = min(64, config.context_len)
    idx = torch.randint(tokenizer.n_vocab, (1, T), device=device)
    with torch.no_grad():
        full, _ = model(idx)
        kinds = [("cat", "torch.cat list cache"), (None, "preallocated KVCache")]
        if args.kv_dtype:
            kinds.append((args.kv_dtype, f"{args.kv_dtype} KVCache"))
        for kind, name in kinds:
            for chunk in (1, 5):
                logits, cache = incremental_logits(model, idx, chunk, kind)
                diff = (full - logits).abs().max().item()
                if kind == "cat":
                    cat_cache = cache  # measured in part 3
                feed = "token by token " if chunk == 1 else f"chunks of {chunk}    "
                print(f"   {feed} {name:21s}: {diff:.2e}")
    print(f"   ({T} random tokens; not exactly 0 because the same math is batched differently"
          + (f"; {args.kv_dtype} also rounds what it stores" if kv else "") + ")")

    print(f"\n2. Speed: {args.tokens} new tokens, greedy, batch 1, {device.type}"
          + (f", {args.quantize} weights (both loops)" if args.quantize != "none" else "")
          + (f", {args.kv_dtype} cache" if kv else ""))
    prompt = torch.tensor([prompt_tokens(tokenizer, "ROMEO:\n")], device=device)
    n_vocab = tokenizer.n_vocab
    timed_generate(model, prompt, 8, n_vocab, **kv)  # warm-up: first calls pay for allocation
    timed_generate(naive, prompt, 8, n_vocab)
    cached_out, cached_tps = timed_generate(model, prompt, args.tokens, n_vocab, **kv)
    naive_out, naive_tps = timed_generate(naive, prompt, args.tokens, n_vocab)
    naive_name = f"{type(naive).__module__}.{type(naive).__name__}.generate"  # base_model.GPT.generate
    print(f"   without cache ({naive_name}): {naive_tps:8.1f} tokens/s")
    cached_name = f"{type(model).__name__}.generate"                          # KVCacheGPT.generate
    print(f"   with cache    ({cached_name}){' ' * (len(naive_name) - len(cached_name))}: {cached_tps:8.1f} tokens/s")
    why = "float ties in argmax" + (f", or the {args.kv_dtype} cache's rounding" if kv else "")
    print(f"   speedup: {cached_tps / naive_tps:.2f}x; same tokens: "
          f"{'yes' if torch.equal(cached_out, naive_out) else f'no ({why})'}")
    if args.compile:
        stats = GenerationStats()
        timed_generate(model, prompt, 8, n_vocab, compile=True, stats=stats)  # compiles
        compiled_out, compiled_tps = timed_generate(model, prompt, args.tokens, n_vocab, compile=True)
        print(f"   with cache, compiled step               : {compiled_tps:8.1f} tokens/s "
              f"({compiled_tps / cached_tps:.2f}x eager; compiling took {stats.compile_seconds:.1f} s; "
              f"same tokens: {'yes' if torch.equal(compiled_out, cached_out) else 'no'})")
    text = tokenizer.decode(cached_out[0, prompt.size(1):].tolist())
    print("   continuation: " + repr(text[:120]) + ("..." if len(text) > 120 else ""))

    print("\n3. Memory: S_cache = 2 x n_layer x n_kv_head x L x head_dim x bytes (x batch)")
    weights = dtype_name(model.lm_head.weight.dtype)
    print(f"   {config.n_layer} layers, {config.n_kv_head} kv heads, head_dim {config.head_dim}, "
          f"{model.lm_head.weight.element_size()} bytes per value")
    print(f"   torch.cat cache after {T} tokens: formula {cache_bytes(config, T, 1, weights):,} B, "
          f"tensors hold {cat_cache.nbytes():,} B")
    print(f"   preallocated for L = context_len = {config.context_len}: formula "
          f"{cache_bytes(config, config.context_len, 1, weights):,} B, "
          f"tensors hold {model.new_cache(1).nbytes():,} B")
    if config.n_kv_head != config.n_head:  # grouped-query attention: the formula's N_kv_heads
        every_head = cache_bytes(config, config.context_len, 1, weights) * config.n_head // config.n_kv_head
        print(f"   grouped-query attention: {config.n_head} query heads share {config.n_kv_head} "
              f"key/value head{'s' if config.n_kv_head > 1 else ''}; one per query head would "
              f"hold {every_head:,} B, {config.n_head // config.n_kv_head}x as much")
    if kv:  # codes and their scales: kv_quant.py
        formula, text = cache_formula(config, config.context_len, 1, args.kv_dtype)
        print(f"   {args.kv_dtype}: {text} = {formula:,} B, "
              f"tensors hold {model.new_cache(1, args.kv_dtype).nbytes():,} B")

    print("\n4. A batch of different prompts: left-padded, positions from 0 in every row")
    texts = ["ROMEO:", "JULIET:\nO Romeo, Romeo!", "KING HENRY:\nOnce more unto the breach"]
    prompts = [prompt_tokens(tokenizer, t) for t in texts]
    n = min(40, args.tokens)
    batch = generate_tokens(model, prompts, n, temperature=0, vocab_limit=n_vocab, **kv)
    alone = [generate_tokens(model, [p], n, temperature=0, vocab_limit=n_vocab, **kv)[0] for p in prompts]
    for text, row, single in zip(texts, batch, alone):
        print(f"   {len(tokenizer.encode_ordinary(text)):2d}-token prompt {text.splitlines()[0]!r:14s}: "
              f"same {n} tokens as alone: {'yes' if torch.equal(row, single) else 'no'}")

    print("\n5. Speculative decoding: propose tokens, check them in one pass, roll the cache back")
    with torch.no_grad():
        speculative_part(model, tokenizer, prompt, args.tokens, args.speculate,
                         args.prompt_lookup or 3, draft, kv)


if __name__ == "__main__":
    from plumbing.script import run
    run(main)
