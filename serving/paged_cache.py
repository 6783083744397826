"""
A paged KV cache: one pool of fixed-size blocks for every sequence the engine runs, a
block table per sequence, and blocks shared between sequences that start the same way.

kv_cache.KVCache preallocates context_len positions for every row, whatever the row will
really use: a 10-token request holds as much memory as a 1000-token one, and a server
that must be ready for the longest request can hold few. Here memory is cut into blocks
of `tokens_per_block` positions (16: nano-vllm's and vLLM's choice is 16 or 256), taken from
a free list as a sequence grows and given back when it ends, so what is held follows the
real lengths. A sequence's keys and values are found through its block table:

    pool (every layer, k and v)                    block tables
    block 0  [ null: padding reads, dropped writes ]
    block 1  [ A0  A1  ...  A15 ]                  A (40 tokens): [1, 2, 5]
    block 2  [ A16 A17 ...  A31 ]                  B (35 tokens): [1, 2, 3]   <- shares A's
    block 3  [ B32 B33 B34  .   .  ]                                             first 32
    block 4  [ free ]                              position p of a sequence lives in slot
    block 5  [ A32 ... A39  .   .  ]               table[p // 16] * 16 + p % 16

Prefix caching: a full block is known by a hash of its tokens *and every token before
it*, so two sequences that begin with the same 32 tokens find the same two blocks and the
second one computes nothing for them. Only prefixes from position 0 can be shared: GPT-2's
positions are learned and absolute, so a key computed for a token at position 40 is not
the key of the same token at position 8; a rotary model's is not either (it is rotated by
its position's angle, and what came before it differs too). Blocks are reference-counted; one that
no sequence uses goes back to the free list *with its contents and hash*, so a later
request can still hit it, and it is overwritten (evicted) only when the free list comes
round to it, least recently freed first.

A pool may store its keys and values in fewer bytes than the model computes in
(serve.py --kv-dtype int8, int4, bfloat16, float16): each slot then holds kv_quant.py's
format of one token, per head, exactly as the preallocated kv_cache.KVCache stores it (an
int8 head: its 64 codes, then its float16 scale), so the pool's bytes are the chapter's
formula (cache_bytes) and the same memory holds several times the blocks. Every write goes
through the format's encode(), every read through its decode(): the gather here, the paged
kernels in paged_attention.py (the hand-written one dequantizes each column as it reads it).
"""

import hashlib
from array import array
from collections import OrderedDict

import torch

from kv_cache import Cache
from kv_quant import cache_bytes, dtype_name, storage_format

NULL_BLOCK = 0  # never given to a sequence: padding columns read it, dropped writes land in it
DEFAULT_POOL_BYTES = 1 << 30


def default_num_blocks(config, tokens_per_block, max_batch, kv_dtype):
    """Room for max_batch sequences at the full context, or DEFAULT_POOL_BYTES (1 GiB),
    whichever is less. The pool is a ceiling: what a sequence holds follows its real
    length, so a pool a fraction of max_batch full contexts still runs max_batch
    sequences of ordinary length (and preempts when they grow too long), and blocks
    nobody holds keep their contents for prefix hits."""
    block_bytes = cache_bytes(config, tokens_per_block, 1, kv_dtype)
    per_context = -(-config.context_len // tokens_per_block)
    return max(min(max_batch * per_context, DEFAULT_POOL_BYTES // block_bytes), per_context)


def check_pool_fits(config, num_blocks, tokens_per_block, kv_dtype):
    """Refuse, before allocating it, a pool larger than the memory left (ValueError)."""
    from plumbing.memory import available_memory, format_bytes  # the loaders' memory rule
    needed = cache_bytes(config, (num_blocks + 1) * tokens_per_block, 1, kv_dtype)  # + the null block
    available = available_memory()
    if needed > available:
        raise ValueError(f"a pool of {num_blocks:,} blocks of {tokens_per_block:,} positions would "
                         f"need {format_bytes(needed)} of memory; {format_bytes(available)} is available")


class BlockPool:
    """The preallocated blocks, the free list, reference counts and the prefix index.

    kv: (n_layer, 2, (num_blocks + 1) * tokens_per_block, n_kv_head, width); block b's
    positions are slots b * tokens_per_block .. (b + 1) * tokens_per_block - 1. Laid out by
    slot, then head, so that gathering a sequence's positions copies whole rows of
    n_kv_head * width values. n_kv_head: the heads the model caches (all of GPT-2's; fewer
    with grouped-query attention). width: hd values in a float pool, head_bytes bytes
    (uint8) in a quantized one (kv_dtype; `format` encodes and decodes, kv_quant.py)."""

    def __init__(self, config, num_blocks, tokens_per_block=16, device=None, dtype=torch.float32,
                 kv_dtype=None):
        if num_blocks * tokens_per_block < config.context_len:
            raise ValueError(f"{num_blocks} blocks of {tokens_per_block} positions cannot hold "
                             f"one full context of {config.context_len}; use more blocks")
        self.tokens_per_block, self.num_blocks = tokens_per_block, num_blocks
        self.kv_dtype = kv_dtype or dtype_name(dtype)
        self.format = storage_format(self.kv_dtype, config.head_dim, dtype)
        slots = (num_blocks + 1) * tokens_per_block  # + the null block
        # zeros, not empty: padding columns are masked, but a masked NaN key or value would
        # still poison softmax(...) @ v, so every slot must hold a finite number from the start
        # (zero bytes are zero codes with a zero scale: 0 once decoded)
        self.kv = torch.zeros(config.n_layer, 2, slots, config.n_kv_head, self.format.width(config.head_dim),
                              device=device, dtype=self.format.storage_dtype)
        self.ref_count = [0] * (num_blocks + 1)
        self.block_hash = [None] * (num_blocks + 1)   # a full block's prefix hash, or None
        self.cached = {}                              # prefix hash -> block holding it
        # blocks no sequence holds, least recently freed first (an OrderedDict: O(1) removal
        # when a cached block is hit again, O(1) pop from the front when one is needed)
        self.free = OrderedDict.fromkeys(range(1, num_blocks + 1))

    # ------------------------------------------------------------------ prefix hashes

    def block_hashes(self, tokens, parent=b""):
        """The hash of every full block of tokens, each covering all tokens before it."""
        n = self.tokens_per_block
        hashes = []
        for start in range(0, len(tokens) - n + 1, n):
            parent = hashlib.blake2b(parent + array("q", tokens[start:start + n]).tobytes(),
                                     digest_size=16).digest()  # 128 bits: no collision in practice
            hashes.append(parent)
        return hashes

    def cached_blocks(self, hashes):
        """The blocks holding the longest cached run of hashes, from the first."""
        blocks = []
        for h in hashes:
            if h not in self.cached:
                break
            blocks.append(self.cached[h])
        return blocks

    # ------------------------------------------------------------------ allocation

    def blocks_for(self, n_tokens):
        return -(-n_tokens // self.tokens_per_block)

    def allocate(self, n_tokens, hashes):
        """(blocks, hashes, cached tokens) for a sequence of n_tokens whose full blocks have
        these prefix hashes (block_hashes): cached blocks for its longest known prefix, fresh
        ones for the rest; None (and nothing taken) when there are not enough free blocks now.

        The fresh full blocks are indexed at once, before they are computed: a sequence
        admitted in the same step with the same prompt (n samples of one prompt) then
        shares them. That is safe because a forward pass writes every row's new keys of a
        layer before any row reads that layer (PagedCache.update)."""
        hits = self.cached_blocks(hashes)
        needed = self.blocks_for(n_tokens)
        from_free = needed - len(hits) + sum(self.ref_count[b] == 0 for b in hits)
        if from_free > len(self.free):
            return None
        for b in hits:
            self.hold(b)
        blocks = hits + [self.take_free() for _ in range(needed - len(hits))]
        for b, h in zip(blocks[len(hits):], hashes[len(hits):]):
            self.index(b, h)
        return blocks, hashes, len(hits) * self.tokens_per_block

    def hold(self, block):
        if self.ref_count[block] == 0:
            del self.free[block]
        self.ref_count[block] += 1

    def take_free(self):
        """A free block for new contents: its old contents are evicted from the index."""
        block, _ = self.free.popitem(last=False)
        old = self.block_hash[block]
        if old is not None and self.cached.get(old) == block:
            del self.cached[old]
        self.block_hash[block] = None
        self.ref_count[block] = 1
        return block

    def index(self, block, h):
        """Record that block holds the full block whose prefix hash is h."""
        self.block_hash[block] = h
        self.cached.setdefault(h, block)  # a duplicate of a cached block stays unindexed

    def release(self, blocks):
        """A sequence lets go of its blocks; unused ones go to the back of the free list,
        the last block first (it is the least likely to be shared)."""
        for block in reversed(blocks):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free[block] = None

    def forget_prefixes(self):
        """Drop the prefix index (after a failed step, whose blocks may hold garbage)."""
        self.cached.clear()
        self.block_hash = [None] * len(self.block_hash)

    # ------------------------------------------------------------------ accounting

    def num_used(self):
        return self.num_blocks - len(self.free)

    def block_bytes(self):
        return self.kv[:, :, :self.tokens_per_block].nbytes

    def nbytes(self):
        return self.kv.nbytes

    def full_contexts(self, context_len):
        """How many sequences of context_len tokens the pool holds at once (the null block
        not counted: nobody's)."""
        return self.num_blocks // self.blocks_for(context_len)


class PagedCache(Cache):
    """One forward pass's view of the pool, in kv_cache's Cache interface, so that the
    cached model's forward (KVCacheGPT's, KVCacheLlama's) runs unchanged on a batch of
    sequences of different lengths.

    The batch is presented the way forward() already understands a batch of different
    prompts: S columns, each row right-aligned (left padding `pad`), the T new columns
    last. The engine computes, once per pass, which pool slot every column comes from
    (read_slots, (B, S)) and where every new column goes (write_slots, (B * T,): the null
    block for padding and for columns already cached). Attention first writes the new keys
    and values there, then gathers the batch's keys and values of the layer through the
    slots into a dense (B, nh, S, hd) tensor, because SDPA wants one: plain PyTorch, but each
    pass copies the whole cache before attention reads it again. Prefills go this way, and
    decode steps with the engine's attention="gather"; its default decode step is
    paged_attention.py's, compiled whole, whose kernel reads each key where it lies, as
    vLLM's paged attention does. benchmarks/serving.py measures both against a dense KVCache."""

    def __init__(self, pool, read_slots, write_slots, pad, length):
        self.pool, self.read_slots, self.write_slots = pool, read_slots, write_slots
        self.pad, self.length = pad, length

    def write(self, layer, k, v):
        """Store the new columns k, v (B, n_kv_head, T, hd) in their slots, in the pool's
        format; the layer's (2, slots, n_kv_head, width)."""
        B, nh, T, hd = k.shape
        kv = self.pool.kv[layer]
        new = torch.stack((k, v)).transpose(2, 3).reshape(2, B * T, nh, hd)
        # dropped writes may collide: all in the null block
        kv.index_copy_(1, self.write_slots, self.pool.format.encode(new))
        return kv

    def update(self, layer, k, v):
        kv = self.write(layer, k, v)
        B, S = self.read_slots.shape
        both = kv.index_select(1, self.read_slots.flatten()).view(2, B, S, *kv.shape[2:])
        both = self.pool.format.decode(both.transpose(2, 3))               # (2, B, n_kv_head, S, hd)
        return both[0], both[1]

    def nbytes(self):
        return self.pool.nbytes()
