"""
The same GPT as base_model.py, with one change to forward(): it takes and returns the
keys and values of past tokens, so generation feeds only the newest token per step.

Keys and values of past tokens never change (attention is causal), so they are computed
once and kept. Two things must then respect the cache:
  1. positions: a new token sits at absolute position past_len, not 0;
  2. the causal mask: new queries sit at global rows past_len .. past_len+T-1.
The parameters are untouched, so any base_model.GPT checkpoint loads here unchanged.

Read it in this order: the caches (what `cache.update` does), KVCacheGPT.forward (the
change), then the generation loop (prefill, decode one token, make room past block_size).
Run `python kv_cache.py` for the demo: parity with a full forward, speed, cache size.
"""

import time

# cli first, before torch: Ctrl-C during the slow imports then ends quietly (see cli.py)
from cli import (ArgumentParser, add_model_args, load_from_args, positive_int,
                 prepare_for_generation, run)

import torch
import torch.nn.functional as F

from base_model import GPT, CausalSelfAttention, GenerationStats
from compiled_decode import compiled_decode_step
from sample import check_sampling_args, sample


# ---------------------------------------------------------------------------- the caches
#
# A cache holds, for every layer, the keys and values of the positions seen so far: rows are
# sequences, columns are cached positions. Every kind offers the same small interface:
#   k, v = cache.update(layer, k_new, v_new)   store the new columns, return all of them
#   cache.length                               columns filled (the same in every row)
#   cache.pad                                  None, or per row the padding columns at its
#                                              left (batches of prompts of different lengths)
#   cache.nbytes()                             bytes its tensors hold
# and three moves on rows and columns that the generation loop needs (select_rows,
# drop_columns, write_rows). Attention calls cache.attend(), which is update() then SDPA.

class Cache:
    length = 0
    pad = None  # LongTensor (B,): row b's first pad[b] columns hold no token (left padding)

    def update(self, layer, k, v):
        raise NotImplementedError

    def attend(self, layer, q, k, v, mask):
        """Attention of the new queries q over the cache and the new keys and values:
        (B, nh, T, hd). The cache step, then SDPA over everything it returns. (A cache
        that can read its keys where they lie, without assembling them, overrides this:
        serving/paged_cache.py.)"""
        k, v = self.update(layer, k, v)   # (B, nh, past_len + T, hd): the past, reused
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def nbytes(self):
        raise NotImplementedError

    def empty_like(self, batch_size):
        """An empty cache of the same kind, shape and dtype for batch_size rows."""
        raise NotImplementedError

    def select_rows(self, index):
        """Keep the rows index (LongTensor), in that order: index may repeat rows (one
        prefill shared by several samples) or leave some out (rows that have finished)."""
        raise NotImplementedError

    def drop_columns(self, n):
        """Forget the n oldest columns of every row (the caller has made sure they are
        padding, or context a row is about to rebuild)."""
        raise NotImplementedError

    def write_rows(self, rows, other, column):
        """Copy the columns of `other` (a cache with len(rows) rows) into rows `rows`,
        starting at `column`."""
        raise NotImplementedError

    def _move_pad(self, index=None, dropped=0):
        """Keep `pad` in step with select_rows and drop_columns."""
        if self.pad is not None:
            pad = self.pad if index is None else self.pad[index]
            self.pad = (pad - dropped).clamp(min=0)


class ConcatCache(Cache):
    """The seed's cache: a list of per-layer (k, v), each (B, nh, length, hd), grown by
    torch.cat. Simple, and what forward() takes and returns when a caller passes a list;
    but every step copies the whole past (O(t) bytes per step, O(T^2) per generation)."""

    def __init__(self, layers=None):
        if layers is not None and not isinstance(layers, (list, tuple)):
            raise TypeError(
                f"KVCacheGPT.forward(idx, past_kv): past_kv is a cache (a list of per-layer (k, v) "
                f"or a Cache), got {type(layers).__name__}; to train with targets call "
                "base_model.GPT.forward(model, idx, targets): the parameters are the same")
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
        return k, v

    def __len__(self):
        return len(self.layers)

    def __getitem__(self, layer):
        return self.layers[layer]

    def nbytes(self):
        return sum(k.nbytes + v.nbytes for k, v in self.layers)

    def empty_like(self, batch_size):
        return ConcatCache()

    def select_rows(self, index):
        self.layers = [(k[index], v[index]) for k, v in self.layers]
        self._move_pad(index)

    def drop_columns(self, n):
        self.layers = [(k[:, :, n:], v[:, :, n:]) for k, v in self.layers]
        self.length -= n
        self._move_pad(dropped=n)

    def write_rows(self, rows, other, column):
        # the tensors were made by cat or by indexing, so no one else holds them
        for (k, v), (ok, ov) in zip(self.layers, other.layers):
            k[rows, :, column:column + other.length] = ok
            v[rows, :, column:column + other.length] = ov


class KVCache(Cache):
    """A preallocated cache: one buffer (n_layer, 2, B, nh, max_len, hd) for every layer's
    k and v, allocated once and written in place, so a step writes only its own columns
    where torch.cat copies the whole past. The default kind."""

    def __init__(self, config, batch_size, device=None, dtype=torch.float32, max_len=None):
        self.config, self.max_len = config, max_len or config.block_size
        shape = (config.n_layer, 2, batch_size, config.n_head, self.max_len, config.head_dim)
        # empty, not zeros: a position is always written before it is read, and zeroing
        # GPT-2's 75 MB cache would cost every generation a pass over it
        self.kv = torch.empty(shape, device=device, dtype=dtype)
        self.length = 0

    def update(self, layer, k, v):
        end = self.length + k.size(2)
        if end > self.max_len:
            raise ValueError(f"KVCache holds {self.max_len} positions; {end} do not fit")
        layer_kv = self.kv[layer]  # (2, B, nh, max_len, hd)
        layer_kv[0, :, :, self.length:end] = k  # write in place; the past is not copied
        layer_kv[1, :, :, self.length:end] = v
        return layer_kv[0, :, :, :end], layer_kv[1, :, :, :end]

    def __len__(self):
        return self.kv.size(0)

    def __getitem__(self, layer):
        """(k, v) of one layer, (B, nh, length, hd) each: the list form's entry, as views."""
        k, v = self.kv[layer, :, :, :, :self.length]
        return k, v

    def nbytes(self):
        return self.kv.nbytes

    def empty_like(self, batch_size):
        return KVCache(self.config, batch_size, self.kv.device, self.kv.dtype, self.max_len)

    def select_rows(self, index):
        self.kv = self.kv[:, :, index]
        self._move_pad(index)

    def drop_columns(self, n):
        kept = self.kv[..., n:self.length, :].clone()  # clone: source and target overlap
        self.kv[..., :self.length - n, :] = kept
        self.length -= n
        self._move_pad(dropped=n)

    def write_rows(self, rows, other, column):
        self.kv[:, :, rows, :, column:column + other.length] = other.kv[..., :other.length, :]


CACHE_KINDS = {"cat": ConcatCache, "prealloc": KVCache}


def as_cache(past_kv):
    """The seed's list of per-layer (k, v) (or None: nothing cached yet) as a ConcatCache;
    any Cache as it is."""
    return past_kv if isinstance(past_kv, Cache) else ConcatCache(past_kv)


def cache_bytes_formula(config, seq_len, batch_size=1, bytes_per_value=4):
    """The chapter's S_cache = 2 x N_layers x N_heads x L_seq x d_head x P_bytes (x batch)."""
    return (2 * config.n_layer * config.n_head * seq_len * config.head_dim
            * bytes_per_value * batch_size)


def cache_nbytes(past_kv):
    """Bytes actually held by the cache tensors (a Cache or the seed's list)."""
    return as_cache(past_kv).nbytes()


def synchronize(device):
    """Wait for queued GPU work, so that a timer measures the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


# ---------------------------------------------------------------------------- the model

class CachedSelfAttention(CausalSelfAttention):
    """base_model's attention (same parameters), reading and extending a cache. Called
    without one (GPT.forward on this model, e.g. for training), it is base_model's."""

    def forward(self, x, cache=None, layer=None, mask=None):
        if cache is None:
            return super().forward(x)
        q, k, v = self.qkv(x)                   # (B, nh, T, hd) each, for the T new tokens
        y = cache.attend(layer, q, k, v, mask)  # cache.update(layer, k, v), then SDPA
        return self.project_out(y)


class KVCacheGPT(GPT):
    Attention = CachedSelfAttention

    def forward(self, idx, past_kv=None, last_only=False):
        """idx (B, T) are the new tokens; past_kv is None, the seed's list of per-layer
        (k, v), or a Cache. Returns logits (B, T, V) and the cache extended by these T
        positions (a list when a list or None came in, else the same Cache object).
        last_only=True computes logits for the last position only (B, 1, V): all that
        generation needs, and it spares a (T x vocab) matmul when prefilling a prompt.

        GPT.forward, plus the three things marked (1) (2) (3)."""
        cache = as_cache(past_kv)
        past_len, T = cache.length, idx.size(1)
        # (1) positions offset by the cache: the new tokens sit at past_len .. past_len+T-1
        x = self.embed(idx, past_len, cache.pad)
        # (3) which cached and new keys each new query may see
        mask = self.attention_mask(past_len, T, cache.pad, idx.device)
        for layer, block in enumerate(self.transformer.h):
            # (2) the cache update happens inside attention: CachedSelfAttention.forward
            x = block(x, cache=cache, layer=layer, mask=mask)
        cache.length += T
        logits = self.head(x[:, -1:] if last_only else x)
        return logits, (cache if cache is past_kv else cache.layers)

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
        return self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(positions))

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

    def new_cache(self, batch_size, kind="prealloc"):
        """An empty cache of a kind in CACHE_KINDS on the model's device and dtype."""
        if kind == "cat":
            return ConcatCache()
        p = self.lm_head.weight
        return CACHE_KINDS[kind](self.config, batch_size, device=p.device, dtype=p.dtype)

    # ------------------------------------------------------------------------ generation
    #
    # The one cached generation loop of the project, in named phases:
    #   prefill      the prompts in one pass (left-padded to a common length), each prompt
    #                once however many samples it has
    #   decode_one   one new token per row through the cache
    #   make_room    past block_size: rows whose context is full drop their oldest half and
    #                re-prefill the rest at positions 0..
    #   stream       sample, yield, and call the three above

    def run_pass(self, tokens, cache, stats):
        """Logits (B, V) of the last position of tokens (B, T), fed through cache."""
        stats.count_pass(tokens.size(1))
        return self(tokens, cache, last_only=True)[0][:, -1]

    def prefill(self, prompts, cache_kind, num_samples, stats):
        """Logits (R, V) and the cache of R = len(prompts) * num_samples rows, prompt-major."""
        t0 = time.perf_counter()
        tokens, pad = left_pad(prompts, self.config.block_size, self.lm_head.weight.device)
        cache = self.new_cache(tokens.size(0), cache_kind)
        cache.pad = pad
        logits = self.run_pass(tokens, cache, stats)
        if num_samples > 1:  # one prefill, shared: copy its cache and logits to every sample
            rows = torch.arange(tokens.size(0), device=tokens.device).repeat_interleave(num_samples)
            cache.select_rows(rows)
            logits, tokens = logits[rows], tokens[rows]
        synchronize(tokens.device)
        stats.cache_bytes = cache.nbytes()
        stats.prefill_passes += 1
        stats.prefill_seconds = time.perf_counter() - t0
        return logits, cache, tokens

    def decode_one(self, token, cache, stats, compiled=False):
        """Logits (R, V) after feeding token (R, 1): one position per row. compiled: through
        compiled_decode.py's static-shape step (the cache must be a KVCache)."""
        if not compiled:
            return self.run_pass(token, cache, stats)
        stats.count_pass(1)
        pad = cache.pad if cache.pad is not None else torch.zeros_like(token[:, 0])
        length = torch.tensor([cache.length], device=token.device)
        logits = compiled_decode_step(self)(self, token, cache.kv, length, pad)
        cache.length += 1
        return logits

    def compile_decode(self, cache, stats):
        """Compile the static-shape decode step for this cache's shapes before decoding, on
        a scratch copy of the buffer (so the real one is untouched), and time it: the
        compile is reported as stats.compile_seconds, apart from the decode speed."""
        if type(cache) is not KVCache or cache.kv.dtype != self.lm_head.weight.dtype:
            # its step writes raw keys and values of the model's dtype into the buffer
            raise ValueError("the compiled decode step needs the preallocated cache in the "
                             "model's dtype (cache_kind='prealloc')")
        # the static step attends over every column, the unwritten ones masked; but a
        # masked NaN still poisons attention (0 x NaN = NaN), and the buffer is torch.empty:
        # any bits at all. Zero what has not been written, once per generation.
        cache.kv[..., cache.length:, :].zero_()
        t0 = time.perf_counter()
        token = torch.zeros(cache.kv.size(2), 1, dtype=torch.long, device=cache.kv.device)
        compiled_decode_step(self)(self, token, torch.empty_like(cache.kv),
                                   torch.tensor([0], device=token.device), token[:, 0])
        synchronize(token.device)
        stats.compile_seconds = time.perf_counter() - t0

    def make_room(self, cache, window, stats):
        """The cache is full (block_size columns): make room for one more.

        Learned positions end at block_size, and a cache cannot slide under them (every
        cached key was computed at its absolute position). So a row whose context is full
        keeps its newest keep-1 tokens and re-prefills them at positions 0..keep-2 (the
        next token then goes to position keep-1). keep is half the window: one pass over
        block_size/2 tokens every block_size/2 tokens, about one extra position of work per
        token, and the row sees at least half a window of context.

        With left padding, rows fill up at different steps; each row must re-prefill
        exactly when it would alone, or its text would change. So only the full rows are
        recomputed; every row moves left by the same number of columns (the shortest
        padding), which keeps the other rows' keys as they are: positions are per row.
        window (R, block_size) holds the tokens by column, and is moved with the cache."""
        block_size = self.config.block_size
        keep = max(1, block_size // 2)
        stats.cache_bytes = max(stats.cache_bytes, cache.nbytes())  # the torch.cat cache's peak
        pad = cache.pad if cache.pad is not None else torch.zeros_like(window[:, 0])
        context = cache.length - pad                      # (R,) tokens in each row
        full = context == block_size
        context = torch.where(full, keep - 1, context)    # what each row keeps
        new_length = int(context.max())
        shift = cache.length - new_length                 # >= 1: a full row drops half
        window[:, :new_length] = window[:, shift:cache.length].clone()
        cache.drop_columns(shift)
        pad = new_length - context
        cache.pad = pad if pad.any() else None
        if keep > 1:  # with keep == 1 a full row keeps no old token: nothing to recompute
            rows = full.nonzero()[:, 0]
            fresh = cache.empty_like(rows.numel())
            self.run_pass(window[rows, new_length - (keep - 1):new_length], fresh, stats)
            cache.write_rows(rows, fresh, new_length - (keep - 1))
        stats.reprefills += 1

    @torch.inference_mode()
    def stream(self, prompts, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
               generator=None, stats=None, num_samples=1, vocab_limit=None,
               cache_kind="prealloc", finished=None, compile=False):
        """Yield the next token of every row, (R, 1) with R = len(prompts) * num_samples,
        one step at a time (rows prompt-major: prompt 0's samples, then prompt 1's...).

        prompts: a LongTensor (B, T), or a list of token-id lists of any lengths (longer
        than block_size: the last block_size tokens are kept). `stats`, a GenerationStats,
        counts the work. vocab_limit: as in GPT.stream. cache_kind: a key of CACHE_KINDS.
        finished: a set the caller may add row numbers to while iterating; those rows leave
        the batch at the next step (their cache rows are freed, their entries are -1 from
        then on), and the loop ends when every row has finished. compile: decode through a
        static-shape step compiled once (compiled_decode.py); finished rows then stay in
        the batch and keep getting tokens, for the caller to ignore, because a new batch
        size would be a new graph."""
        check_sampling_args(temperature, top_k, top_p)
        stats = GenerationStats() if stats is None else stats
        finished = set() if finished is None else finished
        logits, cache, window = self.prefill(prompts, cache_kind, num_samples, stats)
        if compile:
            self.compile_decode(cache, stats)
        window = pad_columns(window, self.config.block_size)
        rows = window.size(0)
        active = list(range(rows))  # the caller's row number of each row still in the batch
        try:
            for step in range(max_new_tokens):
                next_token = sample(logits[:, :vocab_limit], temperature, top_k, top_p, generator)
                yield spread_rows(next_token, active, rows)
                if step == max_new_tokens - 1:
                    break  # the last token needs no forward pass after it
                if finished:
                    staying = [i for i, row in enumerate(active) if row not in finished]
                    if not staying:
                        return
                    if len(staying) < len(active) and not compile:  # finished rows leave
                        index = torch.tensor(staying, device=window.device)
                        cache.select_rows(index)
                        window, next_token = window[index], next_token[index]
                        active = [active[i] for i in staying]
                if cache.length == self.config.block_size:
                    self.make_room(cache, window, stats)
                window[:, cache.length] = next_token[:, 0]
                logits = self.decode_one(next_token, cache, stats, compile)
        finally:  # also when the caller stops early (a stop string, end of text)
            stats.cache_bytes = max(stats.cache_bytes, cache.nbytes())
            stats.cache_positions = cache.length


def left_pad(prompts, block_size, device):
    """Prompts of different lengths as one batch: (tokens (B, T) LongTensor, pad (B,) or
    None). Each prompt keeps its last block_size tokens and is padded on the left to the
    longest, so that every row's newest token sits in the last column: a decode step then
    writes all rows at the same column."""
    if torch.is_tensor(prompts):
        return prompts[:, -block_size:].to(device), None
    rows = [list(p)[-block_size:] for p in prompts]
    if not rows or not all(rows):
        raise ValueError("every prompt needs at least one token")
    width = max(map(len, rows))
    pad = torch.tensor([width - len(r) for r in rows], device=device)
    # the padding token is 0: any id would do, no query ever sees it
    tokens = torch.tensor([[0] * (width - len(r)) + r for r in rows], device=device)
    return tokens, (pad if pad.any() else None)


def pad_columns(tokens, width):
    """tokens (R, T) in a (R, width) buffer, written in place as the loop goes on: the token
    of every cache column, which make_room needs to re-prefill."""
    window = torch.zeros(tokens.size(0), width, dtype=tokens.dtype, device=tokens.device)
    window[:, :tokens.size(1)] = tokens
    return window


def spread_rows(tokens, active, rows):
    """tokens (len(active), 1) of the rows still running -> (rows, 1), -1 for the others."""
    if len(active) == rows:
        return tokens
    out = torch.full((rows, 1), -1, dtype=tokens.dtype, device=tokens.device)
    out[active] = tokens
    return out


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


def main():
    # the script may use what is built on this file; importing kv_quant adds its cache kinds
    from kv_quant import KV_DTYPES, cache_formula
    parser = ArgumentParser(description="KV-cache demo: parity with a full forward, "
                            "speed with and without the cache, the cache's size, a batch.")
    add_model_args(parser)
    parser.add_argument("--tokens", type=positive_int, default=200,
                        help="tokens to generate in the speed test (default: 200)")
    parser.add_argument("--compile", action="store_true", help="also time the cached loop "
                        "with its static-shape decode step compiled (compiled_decode.py)")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, help="also store the cache as this "
                        "dtype (int8, int4: quantized; kv_quant.py) and use it in parts 2-4")
    args = parser.parse_args()
    kv = {"cache_kind": args.kv_dtype} if args.kv_dtype else {}  # KVCacheGPT.stream's, or its default
    model, tokenizer, device = load_from_args(KVCacheGPT, args)
    config = model.config

    # Weight compatibility: the naive model takes the cached model's state dict as it is,
    # and the same weight layout, so that the speed comparison measures only the cache.
    naive = GPT(config).to(device=device, dtype=model.lm_head.weight.dtype).eval()
    naive.load_state_dict(model.state_dict(), strict=True)
    prepare_for_generation(naive, args)

    print("\n1. Correctness: incremental feeds vs one full forward (max |full - incremental| logit)")
    T = min(64, config.block_size)
    idx = torch.randint(tokenizer.n_vocab, (1, T), device=device)
    with torch.no_grad():
        full, _ = model(idx)
        kinds = [("cat", "torch.cat list cache"), ("prealloc", "preallocated KVCache")]
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
    prompt = torch.tensor([tokenizer.encode("ROMEO:\n")], device=device)
    n_vocab = tokenizer.n_vocab
    timed_generate(model, prompt, 8, n_vocab, **kv)  # warm-up: first calls pay for allocation
    timed_generate(naive, prompt, 8, n_vocab)
    cached_out, cached_tps = timed_generate(model, prompt, args.tokens, n_vocab, **kv)
    naive_out, naive_tps = timed_generate(naive, prompt, args.tokens, n_vocab)
    print(f"   without cache (base_model.GPT.generate): {naive_tps:8.1f} tokens/s")
    print(f"   with cache    (KVCacheGPT.generate)    : {cached_tps:8.1f} tokens/s")
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
    if kv:  # codes and their scales: kv_quant.py
        formula, text = cache_formula(config, args.kv_dtype, config.block_size)
        print(f"   {args.kv_dtype}: {text} = {formula:,} B, "
              f"tensors hold {model.new_cache(1, args.kv_dtype).nbytes():,} B")

    print("\n4. A batch of different prompts: left-padded, positions from 0 in every row")
    texts = ["ROMEO:", "JULIET:\nO Romeo, Romeo!", "KING HENRY:\nOnce more unto the breach"]
    prompts = [tokenizer.encode_ordinary(t) for t in texts]
    n = min(40, args.tokens)
    batch = torch.cat(list(model.stream(prompts, n, temperature=0, vocab_limit=n_vocab, **kv)), dim=1)
    alone = [model.generate(torch.tensor([p], device=device), n, temperature=0, vocab_limit=n_vocab,
                            **kv)[0, len(p):]
             for p in prompts]
    for text, row, single in zip(texts, batch, alone):
        print(f"   {len(tokenizer.encode_ordinary(text)):2d}-token prompt {text.splitlines()[0]!r:14s}: "
              f"same {n} tokens as alone: {'yes' if torch.equal(row, single) else 'no'}")


if __name__ == "__main__":
    # run the imported module's main, not this __main__ copy's: kv_quant.py (imported by
    # main) registers its cache kinds in the kv_cache module and subclasses its classes
    import kv_cache
    run(kv_cache.main)
