"""
The cached generation loop: prompts in, one token per row per step out.

    generation = Generation(model, prompts, max_new_tokens, temperature=0.8)
    for rows, tokens in generation:        # tokens (len(rows),): each row's next token
        ...                                # and when a row is done (a stop string, the
        generation.finish(row)             # end of text), it leaves before the next step

Every caller generates through this one loop: generate.py, kv_cache.py's demo (through
KVCacheGPT.generate), the benchmarks, the serving benchmark's static batches and the tests.
Its phases have names:
    prefill     the prompts in one pass (left-padded to a common length), each prompt once
                however many samples it has
    decode_one  one new token per row through the cache
    reprefill   past the context: rows whose context is full keep their newest half and
                compute it again at positions 0..
and between them sample.py picks each row's token from its logits.

The model is any KVCacheGPT (kv_cache.py): the loop calls model(tokens, cache) and
model.new_cache(), nothing else of it.
"""

import time
from dataclasses import dataclass

import torch

from generation import compiled_step
from sample import check_sampling_args, sample


@dataclass
class GenerationStats:
    """What a generation did, for --stats and the benchmarks. The naive loop
    (base_model.GPT.stream) fills the first two; this loop all of them."""
    forward_passes: int = 0
    positions_processed: int = 0   # new tokens fed through the model, summed over passes
    prefill_passes: int = 0        # passes over a prompt (one per generation, however many rows)
    reprefills: int = 0            # times rows were rebuilt past the context (Generation.reprefill)
    prefill_seconds: float = 0.0
    compile_seconds: float = 0.0   # building the compiled decode step, timed apart from decoding
    cache_bytes: int = 0           # the most the cache tensors held at once
    cache_positions: int = 0       # columns in the cache at the end

    def count_pass(self, positions):
        self.forward_passes += 1
        self.positions_processed += positions


def synchronize(device):
    """Wait for queued GPU work, so that a timer measures the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


class Generation:
    """One batch of rows being generated: R = len(prompts) * num_samples rows, prompt-major
    (prompt 0's samples, then prompt 1's...).

    prompts: a LongTensor (B, T), or a list of token-id lists of any lengths (longer than
    the context: the last context_len tokens are kept). Sampling: temperature, top_k, top_p
    and a torch.Generator, as sample.py takes them; vocab_limit, the tokenizer's size,
    keeps padding rows of a larger embedding table from being sampled. cache_kind: None
    (the preallocated cache in the model's dtype), "cat", or a kv_quant.py dtype name.
    compile: decode through generation/compiled_step.py's static-shape step. stats: a
    GenerationStats to fill (one is made otherwise: .stats)."""

    def __init__(self, model, prompts, max_new_tokens, *, temperature=1.0, top_k=None,
                 top_p=None, generator=None, num_samples=1, vocab_limit=None, cache_kind=None,
                 compile=False, stats=None):
        check_sampling_args(temperature, top_k, top_p)
        self.model, self.prompts, self.max_new_tokens = model, prompts, max_new_tokens
        self.sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        self.num_samples, self.vocab_limit = num_samples, vocab_limit
        self.cache_kind, self.compile = cache_kind, compile
        self.stats = GenerationStats() if stats is None else stats
        self.finished = set()
        self.context_len = model.config.context_len

    def finish(self, row):
        """Row `row` is done: it gets no more tokens, and leaves the batch before the next
        step (its cache rows are freed). With compile, the static step keeps computing it
        unseen instead, because a new batch size would be a new graph."""
        self.finished.add(row)

    @torch.inference_mode()
    def __iter__(self):
        """Yield (rows, tokens) once per step until max_new_tokens or every row has
        finished: rows, the row numbers still running; tokens (len(rows),), their next
        tokens."""
        logits, cache, history = self.prefill()
        if self.compile:
            self.compiled, self.stats.compile_seconds = compiled_step.compile_for(
                self.model, cache, vocab_limit=self.vocab_limit, **self.sampling)
        tokens = self.sample(logits)
        active = list(range(history.size(0)))  # the row number of each row in the batch
        try:
            for step in range(self.max_new_tokens):
                yield self.unfinished(active, tokens)
                if step == self.max_new_tokens - 1:
                    break  # the last token needs no forward pass after it
                if self.finished:
                    staying = [i for i, row in enumerate(active) if row not in self.finished]
                    if not staying:
                        return
                    if len(staying) < len(active) and not self.compile:  # finished rows leave
                        index = torch.tensor(staying, device=history.device)
                        cache.select_rows(index)
                        history, tokens = history[index], tokens[index]
                        active = [active[i] for i in staying]
                if cache.length == self.context_len:
                    self.reprefill(cache, history)
                history[:, cache.length] = tokens
                tokens = self.decode_one(tokens[:, None], cache)
        finally:  # also when the caller stops early (a stop string, end of text)
            self.stats.cache_bytes = max(self.stats.cache_bytes, cache.nbytes())
            self.stats.cache_positions = cache.length

    def unfinished(self, active, tokens):
        """(rows, tokens) of the rows in the batch that have not finished (with compile,
        finished rows stay in the batch: their tokens are not handed out)."""
        if not self.finished:
            return list(active), tokens
        keep = [i for i, row in enumerate(active) if row not in self.finished]
        return [active[i] for i in keep], tokens[keep]

    # ------------------------------------------------------------------------ the phases

    def run_pass(self, tokens, cache):
        """Logits (B, V) of the last position of tokens (B, T), fed through cache."""
        self.stats.count_pass(tokens.size(1))
        return self.model(tokens, cache, last_only=True)[0][:, -1]

    def prefill(self):
        """Logits (R, V), the cache of R rows, and history (R, context_len): the token of
        every cache column, kept for reprefill, written as the loop goes on."""
        t0 = time.perf_counter()
        device = self.model.lm_head.weight.device
        tokens, pad = left_pad(self.prompts, self.context_len, device)
        cache = self.model.new_cache(tokens.size(0), self.cache_kind, pad)
        logits = self.run_pass(tokens, cache)
        if self.num_samples > 1:  # one prefill, shared: copy its cache and logits to every sample
            rows = torch.arange(tokens.size(0), device=device).repeat_interleave(self.num_samples)
            cache.select_rows(rows)
            logits, tokens = logits[rows], tokens[rows]
        history = torch.zeros(tokens.size(0), self.context_len, dtype=tokens.dtype, device=device)
        history[:, :tokens.size(1)] = tokens
        synchronize(device)
        self.stats.cache_bytes = cache.nbytes()
        self.stats.prefill_passes += 1
        self.stats.prefill_seconds = time.perf_counter() - t0
        return logits, cache, history

    def sample(self, logits):
        """Each row's token (R,) drawn from logits (R, V) (sample.py)."""
        return sample(logits[:, :self.vocab_limit], **self.sampling)[:, 0]

    def decode_one(self, tokens, cache):
        """Each row's next token (R,) after feeding tokens (R, 1), one position per row:
        the model's logits, then sample(); with compile, both inside the compiled step."""
        if not self.compile:
            return self.sample(self.run_pass(tokens, cache))
        self.stats.count_pass(1)
        return self.compiled.decode(tokens, cache)

    def reprefill(self, cache, history):
        """The cache is full (context_len columns): make room for one more.

        Learned positions end at context_len, and a cache cannot slide under them (every
        cached key was computed at its absolute position). So a row whose context is full
        keeps its newest keep-1 tokens and computes them again at positions 0..keep-2 (the
        next token then goes to position keep-1). keep is half the context: one pass over
        context_len/2 tokens every context_len/2 tokens, about one extra position of work
        per token, and the row sees at least half a context.

        With left padding, rows fill up at different steps; each row must reprefill
        exactly when it would alone, or its text would change. So only the full rows are
        recomputed; every row moves left by the same number of columns (the shortest
        padding), which keeps the other rows' keys as they are: positions are per row.
        history (R, context_len) holds the tokens by column, and moves with the cache."""
        keep = max(1, self.context_len // 2)
        self.stats.cache_bytes = max(self.stats.cache_bytes, cache.nbytes())  # torch.cat's peak
        pad = cache.pad if cache.pad is not None else torch.zeros_like(history[:, 0])
        context = cache.length - pad                      # (R,) tokens in each row
        full = context == self.context_len
        context = torch.where(full, keep - 1, context)    # what each row keeps
        new_length = int(context.max())
        shift = cache.length - new_length                 # >= 1: a full row drops half
        history[:, :new_length] = history[:, shift:cache.length].clone()
        cache.drop_oldest(shift, pad=new_length - context)
        if keep > 1:  # with keep == 1 a full row keeps no old token: nothing to recompute
            rows = full.nonzero()[:, 0]
            fresh = cache.empty_like(rows.numel())
            self.run_pass(history[rows, new_length - (keep - 1):new_length], fresh)
            cache.write_rows(rows, fresh, new_length - (keep - 1))
        self.stats.reprefills += 1


def generate_tokens(model, prompts, max_new_tokens, **options):
    """The new tokens of every row, (R, max_new_tokens): Generation run to the end, no row
    finishing early (end of text is a token like any other here). options: Generation's."""
    steps = [tokens for _, tokens in Generation(model, prompts, max_new_tokens, **options)]
    return torch.stack(steps, dim=1)


def left_pad(prompts, context_len, device):
    """Prompts of different lengths as one batch: (tokens (B, T) LongTensor, pad (B,) or
    None). Each prompt keeps its last context_len tokens and is padded on the left to the
    longest, so that every row's newest token sits in the last column: a decode step then
    writes all rows at the same column."""
    if torch.is_tensor(prompts):
        return prompts[:, -context_len:].to(device), None
    rows = [list(p)[-context_len:] for p in prompts]
    if not rows or not all(rows):
        raise ValueError("every prompt needs at least one token")
    width = max(map(len, rows))
    pad = torch.tensor([width - len(r) for r in rows], device=device)
    # the padding token is 0: any id would do, no query ever sees it
    tokens = torch.tensor([[0] * (width - len(r)) + r for r in rows], device=device)
    return tokens, (pad if pad.any() else None)
