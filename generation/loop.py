"""
The cached generation loop: prompts in, one token per row per step out.

    generation = Generation(model, prompts, max_new_tokens, temperature=0.8)
    for rows, tokens in generation:        # tokens (len(rows),): each row's next token
        ...                                # and when a row is done (a stop string, the
        generation.finish(row)             # end of text), it leaves before the next step

Every caller generates through this one loop: generate.py, kv_cache.py's demo (through
the cached models' generate), the benchmarks, the serving benchmark's static batches and
the tests.
Its phases have names:
    prefill     the prompts in one pass (left-padded to a common length), each prompt once
                however many samples it has
    decode_one  one new token per row through the cache
    past the context, one of two policies (context_policy):
    reprefill   rows whose context is full keep their newest half and compute it again at
                positions 0.. (any model)
    evict       "sinks" (StreamingLLM): rows whose context is full forget one token, the
                oldest after the first few (the sinks), and the rest move down a position
                by a rotation of their cached keys: no recomputation (rotary models only)
    speculate   (with speculate=K and a proposer) instead of decode_one: the newest token
                and up to K proposed ones in one pass, the model's agreement kept, the
                cache rolled back over the rest (generation/speculative.py)
and between them sample.py picks each row's token from its logits.

A step may give a row several tokens (speculation); they are handed out one position at a
time, each yield holding the rows that have a token at that position, so a caller sees
the same protocol either way.

The model is either cached model of kv_cache.py (KVCacheGPT, KVCacheLlama): the loop calls
model(tokens, cache) and model.new_cache(), and for the sinks policy model.move_keys().
"""

import time
from dataclasses import dataclass

import torch

from generation import compiled_step
from kv_quant import FLOAT_DTYPES
from sample import check_sampling_args, sample

CONTEXT_POLICIES = ("reprefill", "sinks")
DEFAULT_SINKS = 4  # StreamingLLM's: four initial tokens are enough to hold attention's excess
CACHE_COLUMNS_STEP = 256  # a cache's length is rounded up to this: nearby lengths share a compiled step
CACHE_GROWTH = 64  # with compile, the cache grows by this many columns at a time (Generation.make_room)


@dataclass
class GenerationStats:
    """What a generation did, for --stats and the benchmarks. The naive loop
    (base_model.GPT.stream) fills the first two; this loop all of them."""
    forward_passes: int = 0
    positions_processed: int = 0   # new tokens fed through the model, summed over passes
    prefill_passes: int = 0        # passes over a prompt (one per generation, however many rows)
    reprefills: int = 0            # times rows were rebuilt past the context (Generation.reprefill)
    evictions: int = 0             # tokens each full row forgot past the context (Generation.evict)
    prefill_seconds: float = 0.0
    compile_seconds: float = 0.0   # building the compiled step, timed apart from decoding
    cache_bytes: int = 0           # the most the cache tensors held at once
    cache_positions: int = 0       # columns in the cache at the end
    # speculative decoding (generation/speculative.py)
    verify_passes: int = 0         # passes that checked proposals (counted in forward_passes too)
    proposed: int = 0              # proposals checked, summed over rows
    accepted: int = 0              # of those, the ones the model agreed with
    draft_passes: int = 0          # forward passes of a draft model (not in forward_passes)

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
    GenerationStats to fill (one is made otherwise: .stats). context_policy: what happens
    when a row's context is full, "reprefill" or "sinks" (keeping the first `sinks`
    tokens). speculate=K with a proposer (generation/speculative.py: PromptLookup,
    DraftModel): up to K proposed tokens per row are checked in each pass; the tokens are
    the same in greedy decoding, and drawn from the same distribution when sampling."""

    def __init__(self, model, prompts, max_new_tokens, *, temperature=1.0, top_k=None,
                 top_p=None, generator=None, num_samples=1, vocab_limit=None, cache_kind=None,
                 compile=False, stats=None, context_policy="reprefill", sinks=DEFAULT_SINKS,
                 speculate=0, proposer=None):
        check_sampling_args(temperature, top_k, top_p)
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        check_context_policy(model, context_policy, sinks, cache_kind)
        if bool(speculate) != (proposer is not None):
            raise ValueError("speculative decoding needs both speculate=K (K >= 1) and a proposer")
        if speculate >= model.config.context_len:  # a step feeds the newest token and K proposals
            raise ValueError(f"speculate={speculate}: K + 1 positions per step must fit in the "
                             f"context of {model.config.context_len}")
        self.context_policy, self.sinks = context_policy, sinks
        self.model, self.prompts, self.max_new_tokens = model, prompts, max_new_tokens
        self.sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        self.num_samples, self.vocab_limit = num_samples, vocab_limit
        self.cache_kind, self.compile = cache_kind, compile
        self.speculate, self.proposer = speculate, proposer
        self.stats = GenerationStats() if stats is None else stats
        self.finished = set()
        self.context_len = model.config.context_len
        self.num_rows = (prompts.size(0) if torch.is_tensor(prompts) else len(prompts)) * num_samples
        self.given = [0] * self.num_rows  # tokens handed out, per row

    def finish(self, row):
        """Row `row` is done: it gets no more tokens, and leaves the batch before the next
        step (its cache rows are freed). With compile, the static step keeps computing it
        unseen instead, because a new batch size would be a new graph."""
        self.finished.add(row)

    @torch.inference_mode()
    def __iter__(self):
        """Yield (rows, tokens) once per position until max_new_tokens or every row has
        finished: rows, the row numbers given a token; tokens (len(rows),), their tokens."""
        if not self.max_new_tokens:  # nothing to generate: no prefill either
            return
        logits, cache, history = self.prefill()
        if self.compile:  # with speculation, the step that checks K proposals is the one
            # compiled, and it returns logits to check them with; otherwise it samples too
            self.compiled, self.stats.compile_seconds = compiled_step.compile_for(
                self.model, cache, tokens_per_step=self.speculate + 1,
                sampling=None if self.proposer else self.sampling, vocab_limit=self.vocab_limit,
                max_columns=self.columns)
        if self.proposer:  # it proposes among the ids the model samples from
            self.proposer.start(self.row_prompts(), self.sampling,
                                self.vocab_limit or self.model.config.vocab_size,
                                history.device, self.compile, self.stats)
        active = list(range(history.size(0)))  # the row number of each row in the batch
        tokens = self.choose(logits)[:, None]                              # (batch, 1)
        counts = torch.ones_like(tokens[:, 0])  # row b got tokens[b, :counts[b]] this step
        try:
            while True:
                if self.proposer:
                    self.proposer.accept(tokens, counts)
                yield from self.hand_out(active, tokens, counts)
                staying = [i for i, row in enumerate(active) if row not in self.finished]
                if not staying:
                    return  # the last token needs no forward pass after it
                newest = tokens.gather(1, (counts - 1)[:, None])           # (batch, 1)
                if len(staying) < len(active) and not self.compile:  # finished rows leave
                    index = torch.tensor(staying, device=history.device)
                    cache.select_rows(index)
                    if self.proposer:
                        self.proposer.select_rows(index)
                    history, newest = history[index], newest[index]
                    active = [active[i] for i in staying]
                if cache.length == self.context_len:  # past the context: make room for one
                    (self.reprefill if self.context_policy == "reprefill" else self.evict)(cache, history)
                if self.proposer:
                    tokens, counts, history = self.speculate_step(newest, cache, history, active)
                else:
                    tokens, counts = self.plain_step(newest, cache, history)
        finally:  # also when the caller stops early (a stop string, end of text)
            self.stats.cache_bytes = max(self.stats.cache_bytes, cache.nbytes())
            self.stats.cache_positions = cache.length

    def choose(self, logits):
        """Each row's next token (R,) from its logits (R, V): sample.py's choice. (A caller
        that scores a given text through the loop chooses the text's own next tokens:
        benchmarks/context_policy.py.)"""
        return sample(logits[:, :self.vocab_limit], **self.sampling)[:, 0]

    def hand_out(self, active, tokens, counts):
        """Yield the step's tokens one position at a time: (rows, tokens) of the rows that
        have a token there and have not finished (with compile, finished rows stay in the
        batch: their tokens are not handed out). A row that reaches max_new_tokens finishes."""
        # one token per row (plain decoding): no need to wait for counts to reach the CPU
        counts = counts.tolist() if tokens.size(1) > 1 else [1] * len(active)
        for position in range(tokens.size(1)):
            keep = [i for i, row in enumerate(active)
                    if row not in self.finished and counts[i] > position]
            if not keep:
                return
            rows = [active[i] for i in keep]
            yield rows, (tokens[:, position] if len(keep) == len(active) else tokens[keep, position])
            for row in rows:
                self.given[row] += 1
                if self.given[row] == self.max_new_tokens:
                    self.finished.add(row)

    def row_prompts(self):
        """Every row's prompt, as token-id lists (prompt-major, num_samples each)."""
        prompts = self.prompts.tolist() if torch.is_tensor(self.prompts) else self.prompts
        return [list(p) for p in prompts for _ in range(self.num_samples)]

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
        self.columns = cache_columns(tokens.size(1) + self.max_new_tokens + self.speculate,
                                     self.context_len, CACHE_COLUMNS_STEP)
        # with compile the cache starts short and grows (make_room); eager reads only what
        # is written, so it gets every column it can need at once
        columns = (cache_columns(tokens.size(1) + self.speculate + 1, self.columns, CACHE_GROWTH)
                   if self.compile else self.columns)
        cache = self.model.new_cache(tokens.size(0), self.cache_kind, pad, max_len=columns)
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

    def make_room(self, cache, T):
        """With compile, grow the cache before a step that would not fit. The compiled step
        attends over every column of its buffer (masked past the ones written), so a cache
        the size of the whole generation from the start would be read whole at every step;
        grown CACHE_GROWTH columns at a time, it is read as it fills. The library takes any
        column count up to the generation's (compile_for's max_columns): one build."""
        if cache.length + T > cache.max_len:
            cache.grow(cache_columns(cache.length + T, self.columns, CACHE_GROWTH))

    def decode_one(self, tokens, cache):
        """Logits (R, V) after feeding tokens (R, 1): one position per row."""
        return self.decode(tokens, cache)[:, -1]

    def plain_step(self, newest, cache, history):
        """Feed each row's newest token (R, 1), sample the next: (tokens (R, 1), counts (R,))."""
        history[:, cache.length] = newest[:, 0]
        if self.compile and not self.proposer:  # the compiled step samples too
            self.make_room(cache, 1)
            self.stats.count_pass(1)
            tokens = self.compiled.decode(newest, cache)[:, None]
        else:
            tokens = self.choose(self.decode_one(newest, cache))[:, None]
        return tokens, torch.ones_like(tokens[:, 0])

    def decode(self, tokens, cache):
        """Logits (R, T, V) at every position of tokens (R, T) fed through the cache: one
        token (decode_one), or the newest token and its proposals (speculate_step). Through
        the compiled step when speculating and T is the width it was compiled for (K + 1);
        eager otherwise (plain decoding's compiled step samples: plain_step)."""
        self.stats.count_pass(tokens.size(1))
        if self.compile:
            self.make_room(cache, tokens.size(1))
        if self.compile and self.proposer and tokens.size(1) == self.speculate + 1:
            return self.compiled.decode(tokens, cache)
        return self.model(tokens, cache)[0]

    def speculate_step(self, newest, cache, history, active):
        """Feed each row's newest token (R, 1) and up to K proposals after it in one pass,
        keep what the model agrees with (speculative.verify), roll the cache back over the
        rest. Returns (tokens (R, k + 1), counts (R,), history): row b's new tokens are
        tokens[b, :counts[b]]; history is moved with the cache.

        k is at most K, and as many as fit before the context ends: a proposal past it would
        be computed without the reprefill that plain decoding does there, and the text would
        change. Rows moved right by rollbacks leave padding columns that every row has;
        those are dropped first when they are what stands in the way."""
        k = self.room_for_proposals(cache, history, active)
        proposals = self.proposer.propose(k) if k else None
        if proposals is not None and not (self.compile and k == self.speculate):
            k = int(proposals.counts.max())  # no column for proposals no row has
            proposals.trim(k)
        if not k:  # nothing to check
            return *self.plain_step(newest, cache, history), history
        fed = torch.cat([newest, proposals.tokens], dim=1)              # (R, 1 + k)
        history[:, cache.length:cache.length + k + 1] = fed
        logits = self.decode(fed, cache)                                # (R, 1 + k, V)
        tokens, counts = self.proposer.verify(logits[..., :self.vocab_limit], proposals)
        # none past max_new_tokens; rows that finished (kept by compile) count for nothing
        remaining = torch.tensor([0 if row in self.finished else self.max_new_tokens - self.given[row]
                                  for row in active], device=counts.device)
        counts = torch.minimum(counts, remaining.clamp(min=1))
        live = remaining > 0
        self.stats.verify_passes += 1
        self.stats.proposed += int(proposals.counts.minimum(remaining - 1)[live].sum())
        self.stats.accepted += int((counts - 1)[live].sum())
        # keep the newest token and the accepted proposals: the last k + 1 - counts columns go
        pad = cache.pad if cache.pad is not None else torch.zeros_like(counts)
        cache.rollback(cache.length - pad - (k + 1 - counts))
        shift = (cache.pad if cache.pad is not None else torch.zeros_like(pad)) - pad
        if shift.any():  # history is by column: it moves right with each row's cache
            columns = torch.arange(cache.length, device=shift.device) - shift[:, None]
            history[:, :cache.length] = history.gather(1, columns.clamp(min=0))
        return tokens, counts, history

    def room_for_proposals(self, cache, history, active):
        """How many proposals the next step may check: K, or fewer where the context ends
        (a step feeds k + 1 columns and the cache has context_len) or where no row needs
        that many more tokens. Past the context the sinks policy frees one column per step
        (evict), so there a step checks none: freeing k + 1 would show the first token fed
        a window that plain decoding never shows it, and the text would change."""
        needed = max(self.max_new_tokens - self.given[row] for row in active
                     if row not in self.finished) - 1
        # compiled: always K, the one shape compiled (filler costs nothing in a static step)
        k = self.speculate if self.compile else min(self.speculate, needed)
        if cache.pad is not None and cache.length + k + 1 > self.context_len:
            common = int(cache.pad.min())  # padding columns every row has: drop them
            if common:
                cache.drop_oldest(common)
                history[:, :cache.length] = history[:, common:common + cache.length].clone()
        return max(0, min(k, self.context_len - 1 - cache.length))

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
        rows = full.nonzero()[:, 0]
        if keep > 1 and rows.numel():  # with keep == 1 a full row keeps no old token
            fresh = cache.empty_like(rows.numel())
            self.run_pass(history[rows, new_length - (keep - 1):new_length], fresh)
            cache.write_rows(rows, fresh, new_length - (keep - 1))
        self.stats.reprefills += bool(rows.numel())  # else only padding was dropped

    def evict(self, cache, history):
        """The cache is full: make room for one more, the sinks policy's way (StreamingLLM).

        A row whose context is full forgets one token: the oldest after its first `sinks`
        tokens, which stay for good. Attention puts its excess weight on the first tokens
        whatever they say (they are the ones every query has seen), so dropping them wrecks
        the text, and keeping a few is enough. The tokens after the forgotten one move down
        one position, so that positions stay those of the cache's columns, below
        context_len: their keys are turned back by one position's angle (model.move_keys),
        nothing is computed again. Learned positions cannot be moved like that: only rotary
        models take this policy.

        With left padding a row that is not full forgets one of its padding columns
        instead, as it would forget nothing alone; its positions do not change."""
        pad = cache.pad if cache.pad is not None else torch.zeros_like(history[:, 0])
        column = torch.where(pad > 0, 0, self.sinks)   # (R,): the column each row forgets
        kept = torch.arange(cache.length - 1, device=history.device)
        kept = kept + (kept >= column[:, None])         # (R, length - 1): history moves with the cache
        history[:, :cache.length - 1] = history[:, :cache.length].gather(1, kept)
        cache.forget_column(column)
        self.model.move_keys(cache, self.sinks, (pad == 0).long())  # only full rows' tokens moved
        self.stats.evictions += 1


def check_context_policy(model, policy, sinks, cache_kind):
    """ValueError (one line) for a policy this model or cache cannot take."""
    if policy not in CONTEXT_POLICIES:
        raise ValueError(f"unknown context policy {policy!r}; one of {', '.join(CONTEXT_POLICIES)}")
    if policy == "sinks":
        if not hasattr(model, "move_keys"):
            raise ValueError("the sinks policy needs rotary positions (a Llama-family model): "
                             "this model's positions are learned, and a cached key cannot move "
                             "to another one; use reprefill")
        if cache_kind not in (None, "cat", *FLOAT_DTYPES):
            raise ValueError(f"the sinks policy turns every cached key once per step, and a "
                             f"{cache_kind} cache would round it again each time; use a float cache")
        if not 0 <= sinks < model.config.context_len - 1:
            raise ValueError(f"sinks must be in 0..{model.config.context_len - 2} "
                             f"(the context is {model.config.context_len}), got {sinks}")


def generate_tokens(model, prompts, max_new_tokens, **options):
    """The new tokens of every row, (R, max_new_tokens): Generation run to the end, no row
    finishing early (end of text is a token like any other here). options: Generation's."""
    generation = Generation(model, prompts, max_new_tokens, **options)
    steps = list(generation)  # (rows, tokens) pairs: with speculation, rows move at their own pace
    # where each token goes, counted in Python and written once at the end: a step then
    # costs this function no tensor operation (a batch-1 step of a small model is short)
    given = [0] * generation.num_rows
    rows, columns = [], []
    for step_rows, _ in steps:
        for row in step_rows:
            rows.append(row)
            columns.append(given[row])
            given[row] += 1
    device = model.lm_head.weight.device
    out = torch.empty(generation.num_rows, max_new_tokens, dtype=torch.long, device=device)
    if steps:
        out[rows, columns] = torch.cat([tokens for _, tokens in steps])
    return out


def cache_columns(needed, limit, step):
    """Positions a cache holds when it must hold `needed`: rounded up to a multiple of
    step, at most limit. A generation's whole cache: what it can reach (its prompt, its new
    tokens and a speculative step's proposals past the last) in steps of CACHE_COLUMNS_STEP,
    at most the context (a longer generation moves within a full cache: the context
    policies); a compiled cache as it grows: steps of CACHE_GROWTH, at most that. Why not
    always the whole context: the compiled step attends over every column of the buffer,
    the unwritten ones masked, and at GPT-2 small a 1024-column cache is 75 MB read per
    token, more than half the bytes of its int8 weights (docs/benchmarks.md)."""
    return min(limit, -(-needed // step) * step)


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
