"""
A request alone: its decode steps through the compiled step, not the paged engine.

The engine's step is built for many sequences: block tables, slots and masks made in
Python every step, a paged kernel behind torch.compile's guards, attention reading each key
through a table. For one sequence all of it is overhead: a lone user waited almost twice as
long per token as generate.py --compile makes one (docs/serving.md). So when a decode step's
batch is one request, the engine hands it to a LoneStep instead, which runs
generation/compiled_step.py's static step (built ahead of time, once, at start-up) on a
dense cache of one row:

    pool (paged, every request)          dense cache (one row, the lone request's)
    [A0 A1 ... A15][A16 ... A31][A32 .]   [A0 A1 ... A32 | A33 ...]
                                 ^                         |
                                 +---- each new column ----+  (mirrored, one copy a step)

  - entering: the request's cached columns are gathered from the pool into the dense cache
    (one copy), unless the dense cache already holds them (the previous step was this
    request's too). The dense cache is sized to the request, a multiple of CACHE_GROWTH
    columns (generation/loop.py's, whose compiled cache grows the same way), and gathered
    again into a larger one when the request outgrows it: the step's attention reads
    every column of its cache (the unwritten ones masked), and on the bundled model a step
    over 160 columns took 1.32 ms against 1.40 over the context's 256 (docs/serving.md).
    One build serves every size: the library takes the column count as a variable
    (compile_for's max_columns);
  - each step: the compiled step writes the new key and value into the dense cache, and
    the same column is copied to the request's slot in the pool (unless the pool holds it
    already: a prompt found whole in the prefix cache), so the pool always holds
    everything: when a second request arrives, the next step is the engine's own, with
    nothing to hand back; prefix hits on the request's blocks stay right;
  - the step returns the logits and the greedy token: a request that samples is drawn
    from the logits with its own settings, a greedy one takes the token (no operation runs
    after the step: in the server, sampling a lone greedy request's logits took 0.2 ms of a
    ~2.7 ms token), and log-probabilities are reported from the logits as for any other
    request, so one build serves every request.
"""

import torch

from generation.compiled_step import compile_for
from generation.loop import CACHE_GROWTH, cache_columns
from kv_cache import KVCache
from serving.decode_index import slot_of


class LoneStep:
    """The compiled decode step of one sequence over the engine's pool (a float32 model's
    library holds its own copy of the weights, the model's memory once more; a quantized
    or bf16 model's reads the model's own: compiled_step.reads_own_weights)."""

    def __init__(self, model, pool, vocab_limit=None, build_missing=True):
        """vocab_limit: the tokens a greedy pick is among (the tokenizer's; the embedding
        table may have padding rows past them). build_missing=False: raises
        compiled_step.NotCached unless the step's build is in the cache."""
        weight = model.lm_head.weight
        self.config, self.device, self.dtype = model.config, weight.device, weight.dtype
        self.cache = KVCache(model.config, 1, weight.device, weight.dtype)  # the largest, to build
        self.step, self.build_seconds = compile_for(model, self.cache, vocab_limit=vocab_limit,
                                                    greedy_too=True, max_columns=model.config.context_len,
                                                    build_missing=build_missing)
        self.pool = pool
        self.token = torch.zeros(1, 1, dtype=torch.long, device=weight.device)
        self.holds = None  # (request, its start) whose first cache.length columns the cache holds

    def decode(self, request):
        """Feed the request's newest token: its logits (1, V) and greedy token (1,).
        request: a decoding serving.scheduler.Sequence whose context but the newest token
        is in the pool."""
        position = request.context_len - 1  # of the newest token, in the request's context
        if (self.holds != (request, request.start) or self.cache.length != position
                or position == self.cache.max_len):  # a cache it has outgrown
            self.load(request, position)
        self.token.fill_(request.tokens[-1])
        logits, greedy = self.step.decode(self.token, self.cache)               # (1, 1, V), (1,)
        if position >= request.num_cached:  # else the pool has it already, in a block that
            # may be shared with other requests: it is read, never written again
            slot = slot_of(request, position, self.pool.tokens_per_block)
            self.pool.kv[:, :, slot] = self.cache.kv[:, :, 0, :, position]    # (n_layer, 2, nh, hd)
        return logits[:, -1], greedy

    def load(self, request, length):
        """Copy the request's first `length` context columns from the pool, into a cache
        with room for the next column (CACHE_GROWTH columns at a time, at most the context)."""
        columns = cache_columns(length + 1, self.config.context_len, CACHE_GROWTH)
        if self.cache.max_len != columns:
            self.cache = KVCache(self.config, 1, self.device, self.dtype, max_len=columns)
        # the columns past the request's are read (masked): a NaN left in the buffer would
        # still poison attention (0 x NaN = NaN)
        self.cache.kv[..., length:, :].zero_()
        tokens_per_block = self.pool.tokens_per_block
        slots = torch.tensor([slot_of(request, p, tokens_per_block) for p in range(length)],
                             dtype=torch.long, device=self.pool.kv.device)
        columns = self.pool.kv[:, :, slots]                                     # (n_layer, 2, length, nh, hd)
        self.cache.kv[:, :, 0, :, :length] = columns.transpose(2, 3)            # (n_layer, 2, nh, length, hd)
        self.cache.length, self.holds = length, (request, request.start)
