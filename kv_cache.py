"""
The same GPT as base_model.py, with one change to forward(): it takes and returns the
keys and values of past tokens, so generation feeds only the newest token per step.

Keys and values of past tokens never change (attention is causal), so they are computed
once and kept. Two things must then respect the cache:
  1. positions: a new token sits at absolute position past_len, not 0;
  2. the causal mask: new queries sit at global rows past_len .. past_len+T-1.
The parameters are untouched, so any base_model.GPT checkpoint loads here unchanged.

Run `python kv_cache.py` for the demo: parity with a full forward, speed, cache size.
"""

import argparse
import time

import torch
import torch.nn.functional as F

from base_model import GPT
from cli import ArgumentParser, add_model_args, load_from_args, positive_int, run
from sample import check_sampling_args, sample


class KVCache:
    """A preallocated cache: one buffer (n_layer, 2, B, nh, max_len, hd) for every layer's
    k and v, allocated once and written in place. The list-of-(k, v) form that torch.cat
    grows copies the whole past every step (O(t) per step, O(T^2) bytes moved per
    generation); here a step writes only its own position. k and v of a layer sit side by
    side because c_attn produces them side by side: one copy stores both."""

    def __init__(self, config, batch_size, device=None, dtype=torch.float32, max_len=None):
        max_len = max_len or config.block_size
        shape = (config.n_layer, 2, batch_size, config.n_head, max_len, config.head_dim)
        # empty, not zeros: a position is always written before it is read, and zeroing
        # GPT-2's 75 MB cache would cost every generation a pass over it
        self.kv = torch.empty(shape, device=device, dtype=dtype)
        self.length = 0  # positions filled so far, the same in every layer

    def __len__(self):
        return self.kv.size(0)

    def __getitem__(self, layer):
        """(k, v) of one layer, (B, nh, length, hd) each: the list form's entry, as views."""
        k, v = self.kv[layer, :, :, :, :self.length]
        return k, v

    def nbytes(self):
        return self.kv.nbytes

    def repeat_rows(self, n):
        """A cache whose rows are each of these rows n times (one prefill, n samples)."""
        out = KVCache.__new__(KVCache)
        out.kv, out.length = self.kv.repeat_interleave(n, dim=2), self.length
        return out


def cache_length(past_kv):
    """Number of positions already in a cache of either kind (0 for None)."""
    if past_kv is None:
        return 0
    if isinstance(past_kv, KVCache):
        return past_kv.length
    return past_kv[0][0].size(2)  # list of (k, v), each (B, nh, S, hd)


def cache_bytes_formula(config, seq_len, batch_size=1, bytes_per_value=4):
    """The chapter's S_cache = 2 x N_layers x N_heads x L_seq x d_head x P_bytes (x batch)."""
    return (2 * config.n_layer * config.n_head * seq_len * config.head_dim
            * bytes_per_value * batch_size)


def cache_nbytes(past_kv):
    """Bytes actually held by the cache tensors."""
    if isinstance(past_kv, KVCache):
        return past_kv.nbytes()
    return sum(k.nbytes + v.nbytes for k, v in past_kv)


def synchronize(device):
    """Wait for queued GPU work, so that a timer measures the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


class KVCacheGPT(GPT):

    def __init__(self, config):
        super().__init__(config)
        # mask[i, j]: query at global position i may see key j. persistent=False keeps it
        # out of the state dict, so checkpoints stay identical to base_model.GPT's.
        mask = torch.ones(config.block_size, config.block_size, dtype=torch.bool).tril()
        self.register_buffer("causal_mask", mask, persistent=False)

    def attend(self, attn, x, layer, past_kv, past_len):
        """Self-attention of x (B, T, C) over the cached past plus itself."""
        qkv = attn.qkv(x)  # (3, B, nh, T, hd)
        q, k, v = qkv
        T = q.size(2)
        S = past_len + T  # keys after this step
        if isinstance(past_kv, KVCache):
            layer_kv = past_kv.kv[layer]  # (2, B, nh, max_len, hd)
            layer_kv[:, :, :, past_len:S] = qkv[1:]  # write in place; the past is not copied
            if past_len:
                k, v = layer_kv[:, :, :, :S]
        elif past_kv is not None:
            pk, pv = past_kv[layer]  # (B, nh, past_len, hd)
            k = torch.cat([pk, k], dim=2)  # THE cache step: reuse, don't recompute
            v = torch.cat([pv, v], dim=2)
        if past_len == 0:
            # no cache: query row i is position i, which is what is_causal assumes
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif T == 1:
            # one query at the newest position may see every key: no mask to build
            y = F.scaled_dot_product_attention(q, k, v)
        else:
            # several queries over a cache: is_causal would align them with keys 0..T-1
            # (top-left), so slice the full mask at the queries' global rows
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.causal_mask[S - T:S, :S])
        return attn.project_out(y), (k, v)

    def forward(self, idx, past_kv=None, last_only=False):
        """idx (B, T) are the new tokens; past_kv is None, a list of (k, v) per layer, or a
        KVCache. Returns logits (B, T, V) and the cache extended by these T positions.
        last_only=True computes logits for the last position only (B, 1, V): all that
        generation needs, and it spares a (T x vocab) matmul when prefilling a prompt."""
        past_len = cache_length(past_kv)
        x = self.embed(idx, start_pos=past_len)  # positions past_len .. past_len+T-1
        present = []
        for layer, block in enumerate(self.transformer.h):
            a, layer_kv = self.attend(block.attn, block.ln_1(x), layer, past_kv, past_len)
            x = x + a
            x = x + block.mlp(block.ln_2(x))
            present.append(layer_kv)
        if isinstance(past_kv, KVCache):
            past_kv.length += idx.size(1)
            present = past_kv
        return self.head(x[:, -1:] if last_only else x), present

    def new_cache(self, batch_size, preallocate=True):
        """An empty cache: a KVCache on the model's device and dtype, or None for the
        list form that the first forward() creates."""
        if not preallocate:
            return None
        p = self.lm_head.weight
        return KVCache(self.config, batch_size, device=p.device, dtype=p.dtype)

    @torch.inference_mode()
    def stream(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
               generator=None, stats=None, num_samples=1, vocab_limit=None, preallocate=True):
        """Yield the next token of every row, (B * num_samples, 1), one step at a time.

        The one cached generation loop of the project: the prompt is prefilled in one pass,
        then each step feeds one token. With num_samples > 1 the prompt is prefilled once
        and its cache shared by num_samples rows. Past block_size, learned positions run
        out and a cache cannot slide under them: the oldest half of the window is dropped
        and the rest re-prefilled at positions 0.. (one full pass every block_size/2 tokens).
        `stats`, a dict, is filled with counters and the prefill time. vocab_limit: as in
        GPT.stream."""
        check_sampling_args(temperature, top_k, top_p)
        stats = {} if stats is None else stats
        stats.update(forward_passes=0, positions_processed=0, prefill_passes=0, reprefills=0)
        block_size = self.config.block_size
        keep = block_size // 2  # window kept when the cache is full

        def run(tokens, cache):
            stats["forward_passes"] += 1
            stats["positions_processed"] += tokens.size(1)
            return self(tokens, cache, last_only=True)

        # the tokens now in the cache, kept in a buffer written in place, for re-prefills
        rows = idx.size(0) * num_samples
        window = torch.empty(rows, block_size, dtype=torch.long, device=idx.device)
        prompt = idx[:, -block_size:]
        n = prompt.size(1)
        window[:, :n] = prompt.repeat_interleave(num_samples, dim=0)

        t0 = time.perf_counter()
        logits, cache = run(prompt, self.new_cache(prompt.size(0), preallocate))
        if num_samples > 1:  # one prefill, shared: copy its cache and logits to every sample
            logits = logits.repeat_interleave(num_samples, dim=0)
            cache = (cache.repeat_rows(num_samples) if isinstance(cache, KVCache) else
                     [(k.repeat_interleave(num_samples, 0), v.repeat_interleave(num_samples, 0))
                      for k, v in cache])
        synchronize(idx.device)
        stats.update(prefill_passes=1, prefill_seconds=time.perf_counter() - t0)

        try:
            for step in range(max_new_tokens):
                next_token = sample(logits[:, -1, :vocab_limit], temperature, top_k, top_p, generator)
                yield next_token
                if step == max_new_tokens - 1:
                    break  # the last token needs no forward pass after it
                if n == block_size:  # cache full: keep the newest half, re-prefill it
                    window[:, :keep - 1] = window[:, n - keep + 1:n].clone()
                    window[:, keep - 1:keep] = next_token
                    n = keep
                    if isinstance(cache, KVCache):
                        cache.length = 0  # reuse the buffers: the re-prefill overwrites them
                    else:
                        cache = None
                    logits, cache = run(window[:, :n], cache)
                    stats["reprefills"] += 1
                else:
                    window[:, n:n + 1] = next_token
                    n += 1
                    logits, cache = run(next_token, cache)
        finally:  # also when the caller stops early (a stop string, end of text)
            stats["cache_bytes"] = cache_nbytes(cache)
            stats["cache_positions"] = cache_length(cache)


# ---------------------------------------------------------------------------- the demo

def incremental_logits(model, idx, chunk, preallocate):
    """Feed idx (B, T) through the cache `chunk` tokens per forward; logits (B, T, V)."""
    cache = model.new_cache(idx.size(0), preallocate)
    pieces = []
    for start in range(0, idx.size(1), chunk):
        logits, cache = model(idx[:, start:start + chunk], cache)
        pieces.append(logits)
    return torch.cat(pieces, dim=1), cache


def timed_generate(model, idx, n, vocab_limit):
    """(tokens, tokens per second) for a greedy generation of n tokens."""
    synchronize(idx.device)
    t0 = time.perf_counter()
    out = model.generate(idx, n, temperature=0, vocab_limit=vocab_limit)
    synchronize(idx.device)
    return out, n / (time.perf_counter() - t0)


def main():
    parser = ArgumentParser(description="KV-cache demo: parity with a full forward, "
                            "speed with and without the cache, and the cache's size.")
    add_model_args(parser)
    parser.add_argument("--tokens", type=positive_int, default=200,
                        help="tokens to generate in the speed test (default: 200)")
    args = parser.parse_args()
    model, tokenizer, device = load_from_args(KVCacheGPT, args)
    config = model.config

    # Weight compatibility: the naive model takes the cached model's state dict as it is.
    naive = GPT(config).to(device=device, dtype=model.lm_head.weight.dtype).eval()
    naive.load_state_dict(model.state_dict(), strict=True)

    print("\n1. Correctness: incremental feeds vs one full forward (max |full - incremental| logit)")
    T = min(64, config.block_size)
    idx = torch.randint(tokenizer.n_vocab, (1, T), device=device)
    with torch.no_grad():
        full, _ = model(idx)
        for preallocate in (False, True):
            kind = "preallocated KVCache" if preallocate else "torch.cat list cache"
            for chunk in (1, 5):
                logits, cache = incremental_logits(model, idx, chunk, preallocate)
                diff = (full - logits).abs().max().item()
                if not preallocate:
                    cat_cache = cache  # measured in part 3
                feed = "token by token " if chunk == 1 else f"chunks of {chunk}    "
                print(f"   {feed} {kind:21s}: {diff:.2e}")
    print(f"   ({T} random tokens; not exactly 0 because the same math is batched differently)")

    print(f"\n2. Speed: {args.tokens} new tokens, greedy, batch 1, {device.type}")
    prompt = torch.tensor([tokenizer.encode("ROMEO:\n")], device=device)
    n_vocab = tokenizer.n_vocab
    timed_generate(model, prompt, 8, n_vocab)  # warm-up: first calls pay for allocation
    timed_generate(naive, prompt, 8, n_vocab)
    cached_out, cached_tps = timed_generate(model, prompt, args.tokens, n_vocab)
    naive_out, naive_tps = timed_generate(naive, prompt, args.tokens, n_vocab)
    print(f"   without cache (base_model.GPT.generate): {naive_tps:8.1f} tokens/s")
    print(f"   with cache    (KVCacheGPT.generate)    : {cached_tps:8.1f} tokens/s")
    print(f"   speedup: {cached_tps / naive_tps:.2f}x; same tokens: "
          f"{'yes' if torch.equal(cached_out, naive_out) else 'no (float ties in argmax)'}")
    text = tokenizer.decode(cached_out[0, prompt.size(1):].tolist())
    print("   continuation: " + repr(text[:120]) + ("..." if len(text) > 120 else ""))

    print("\n3. Memory: S_cache = 2 x n_layer x n_head x L x head_dim x bytes (x batch)")
    nbytes = model.lm_head.weight.element_size()
    print(f"   {config.n_layer} layers, {config.n_head} heads, head_dim {config.head_dim}, "
          f"{nbytes} bytes per value")
    formula = cache_bytes_formula(config, T, bytes_per_value=nbytes)
    print(f"   torch.cat cache after {T} tokens: formula {formula:,} B, "
          f"tensors hold {cache_nbytes(cat_cache):,} B")
    formula = cache_bytes_formula(config, config.block_size, bytes_per_value=nbytes)
    print(f"   preallocated for L = block_size = {config.block_size}: formula {formula:,} B, "
          f"tensors hold {model.new_cache(1).nbytes():,} B")


if __name__ == "__main__":
    run(main)
