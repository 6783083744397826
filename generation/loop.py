"""
The cached generation loop: prompts in, one token per row per step out.

    generation = Generation(model, prompts, max_new_tokens, temperature=0.8)
    for rows, tokens in generation:        # tokens (len(rows),): each row's next token
        ...                                # and when a row is done (a stop string, the
        generation.finish(row)             # end of text), it leaves before the next step

Every caller generates through this one loop: generate.py, kv_cache.py's demo (through
the cached models' generate), the benchmarks, the serving benchmark's static batches and
the tests.
Its phases have names, and __iter__ numbers them:
    prefill     the prompts in one pass (left-padded to a common length), each prompt once
                however many samples it has
    decode      each row's newest token in, its next tokens out: one step, chosen once
                (generation/steps.py): plain, compiled (compile=True), or speculative
                (speculate=K and a proposer: the newest token and up to K proposed ones in
                one pass, the model's agreement kept, the rest rolled back:
                generation/speculative.py)
    past the context, one of two policies (context_policy):
    reprefill   rows whose context is full keep their newest half and compute it again at
                positions 0.. (any model)
    evict       "sinks" (StreamingLLM): rows whose context is full forget one token, the
                oldest after the first few (the sinks), and the rest move down a position
                by a rotation of their cached keys: no recomputation (rotary models only)
and between them sample.py picks each row's token from its logits. The batch's rows (the
cache, the token of each of its columns, the padding) have one owner, generation/rows.py,
which makes every move on them.

A step may give a row several tokens (speculation); they are handed out one position at a
time, each yield holding the rows that have a token at that position, so a caller sees
the same protocol either way.

The model is either cached model of kv_cache.py (KVCacheGPT, KVCacheLlama): the loop calls
model(tokens, cache) and model.new_cache(), and for the sinks policy model.move_keys().
"""

import time
from dataclasses import dataclass

import torch

from generation.logits_processors import Processors, RowProcessing, RowsProcessing
from generation.rows import Rows
from generation.steps import CompiledPlainStep, PlainStep, SpeculativeStep
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
    the context: the last context_len tokens are kept). Sampling: temperature, top_k, top_p,
    min_p and a torch.Generator, as sample.py takes them; processors: logits processors
    (generation/logits_processors.py's Processors: penalties, bias, bans, a grammar), one
    for every row or a list of one per row (None: none), the rows with none drawn as
    without; vocab_limit, the tokenizer's size,
    keeps padding rows of a larger embedding table from being sampled. cache_kind: None
    (the preallocated cache in the model's dtype), "cat", or a kv_quant.py dtype name.
    compile: decode through generation/compiled_step.py's static-shape step. stats: a
    GenerationStats to fill (one is made otherwise: .stats). context_policy: what happens
    when a row's context is full, "reprefill" or "sinks" (keeping the first `sinks`
    tokens). speculate=K with a proposer (generation/speculative.py: PromptLookup,
    DraftModel): up to K proposed tokens per row are checked in each pass; the tokens are
    the same in greedy decoding, and drawn from the same distribution when sampling."""

    def __init__(self, model, prompts, max_new_tokens, *, temperature=1.0, top_k=None,
                 top_p=None, min_p=None, generator=None, num_samples=1, vocab_limit=None,
                 cache_kind=None, compile=False, stats=None, context_policy="reprefill",
                 sinks=DEFAULT_SINKS, speculate=0, proposer=None, processors=None):
        check_sampling_args(temperature, top_k, top_p, min_p)
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
        self.sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                             generator=generator)
        self.num_samples, self.vocab_limit = num_samples, vocab_limit
        self.cache_kind, self.compile = cache_kind, compile
        self.speculate, self.proposer = speculate, proposer
        self.stats = GenerationStats() if stats is None else stats
        self.finished = set()
        self.context_len = model.config.context_len
        self.num_rows = (prompts.size(0) if torch.is_tensor(prompts) else len(prompts)) * num_samples
        self.given = [0] * self.num_rows  # tokens handed out, per row
        self.processors = row_processors(processors, self.num_rows,
                                         vocab_limit or model.config.vocab_size)
        self.processing = None  # RowsProcessing once the prefill has run, if a row has any

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
        # 1. prefill: the prompts in one pass, and each row's first token
        logits = self.prefill()
        if self.processors is not None:
            self.processing = RowsProcessing([
                p and RowProcessing(p, prompt) for p, prompt in zip(self.processors, self.row_prompts())])
        tokens = self.choose(logits)[:, None]                                # (R, 1)
        counts = torch.ones_like(tokens[:, 0])  # row b got tokens[b, :counts[b]] this step
        step = self.new_step(tokens.clamp(min=0))
        try:
            while True:
                if self.processing is not None:
                    self.processing.accept(tokens, counts)
                yield from self.hand_out(tokens, counts)
                # 2. the rows that finished leave (with a compiled step they stay, unseen)
                staying = [i for i, row in enumerate(self.rows.numbers) if row not in self.finished]
                if not staying:
                    return  # the last token needs no forward pass after it
                # (a row that could take no token, -1, has finished: 0 is fed in its place)
                newest = tokens.gather(1, (counts - 1)[:, None]).clamp(min=0)   # (R, 1)
                if len(staying) < len(self.rows.numbers) and not step.keeps_every_row:
                    index = torch.tensor(staying, device=newest.device)
                    self.rows.select_rows(index)
                    step.select_rows(index)
                    if self.processing is not None:
                        self.processing.select_rows(index)
                    newest = newest[index]
                # 3. past the context: make room for one more column
                if self.rows.length == self.context_len:
                    (self.reprefill if self.context_policy == "reprefill" else self.evict)()
                # 4. decode: each row's newest token in, its next tokens out
                tokens, counts = step(newest)
        finally:  # also when the caller stops early (a stop string, end of text)
            self.stats.cache_bytes = max(self.stats.cache_bytes, self.rows.cache.nbytes())
            self.stats.cache_positions = self.rows.length

    def choose(self, logits):
        """Each row's next token (R,) from its logits (R, V): sample.py's choice, after the
        rows' logits processors; -1 for a row whose processors leave it no token (it ends).
        (A caller that scores a given text through the loop chooses the text's own next
        tokens: benchmarks/context_policy.py.)"""
        logits = logits[:, :self.vocab_limit]
        if self.processing is None:
            return sample(logits, **self.sampling)[:, 0]
        logits, dead = self.processing(logits)
        return sample(logits, **self.sampling)[:, 0].masked_fill(dead == 0, -1)

    def new_step(self, first):
        """The decode step of this generation (generation/steps.py), chosen once. first:
        each row's first token (R, 1), which a proposer starts from. With processors the
        compiled step hands back logits, and the processed rows are drawn from them here."""
        if self.proposer:
            return SpeculativeStep(self, first)
        return CompiledPlainStep(self, draws=self.processing is None) if self.compile else PlainStep(self)

    def hand_out(self, tokens, counts):
        """Yield the step's tokens one position at a time: (rows, tokens) of the rows that
        have a token there and have not finished (with compile, finished rows stay in the
        batch: their tokens are not handed out). A row that reaches max_new_tokens finishes."""
        numbers = self.rows.numbers
        # one token per row (plain decoding): no need to wait for counts to reach the CPU
        counts = counts.tolist() if tokens.size(1) > 1 else [1] * len(numbers)
        ending = []  # rows given -1 could take nothing there: they end after what came before
        if self.processing is not None:
            for i, row in enumerate(tokens.tolist()):
                if -1 in row[:counts[i]]:
                    counts[i] = row.index(-1)
                    ending.append(numbers[i])
        for position in range(tokens.size(1)):
            keep = [i for i, row in enumerate(numbers)
                    if row not in self.finished and counts[i] > position]
            if not keep:
                break
            rows = [numbers[i] for i in keep]
            yield rows, (tokens[:, position] if len(keep) == len(numbers) else tokens[keep, position])
            for row in rows:
                self.given[row] += 1
                if self.given[row] == self.max_new_tokens:
                    self.finished.add(row)
        self.finished.update(ending)

    def remaining(self):
        """The tokens each row of the batch still needs: 0 for one that has finished."""
        return [0 if row in self.finished else self.max_new_tokens - self.given[row]
                for row in self.rows.numbers]

    def row_prompts(self):
        """Every row's prompt, as token-id lists (prompt-major, num_samples each)."""
        prompts = self.prompts.tolist() if torch.is_tensor(self.prompts) else self.prompts
        return [list(p) for p in prompts for _ in range(self.num_samples)]

    # ------------------------------------------------------------------------ the phases

    def last_logits(self, tokens, cache):
        """Feed tokens (B, T) through cache: the logits (B, V) of their last position."""
        self.stats.count_pass(tokens.size(1))
        return self.model(tokens, cache, last_only=True)[0][:, -1]

    def prefill(self):
        """Each row's logits (R, V) after its prompt. Sets up what the steps read: self.rows
        (R rows, their cache holding the prompts) and self.max_columns (the most columns
        the generation's cache may need)."""
        t0 = time.perf_counter()
        device = self.model.lm_head.weight.device
        tokens, pad = left_pad(self.prompts, self.context_len, device)
        self.max_columns = cache_columns(tokens.size(1) + self.max_new_tokens + self.speculate,
                                         self.context_len, CACHE_COLUMNS_STEP)
        # with compile the cache starts short and grows (make_room); eager reads only what
        # is written, so it gets every column it can need at once
        columns = (cache_columns(tokens.size(1) + self.speculate + 1, self.max_columns, CACHE_GROWTH)
                   if self.compile else self.max_columns)
        cache = self.model.new_cache(tokens.size(0), self.cache_kind, pad, max_len=columns)
        self.rows = Rows(cache, tokens.size(0), self.context_len, device)
        self.rows.record(tokens)
        logits = self.last_logits(tokens, cache)
        if self.num_samples > 1:  # one prefill, shared: copy its rows and logits to every sample
            self.rows.repeat(self.num_samples)
            logits = logits.repeat_interleave(self.num_samples, dim=0)
        synchronize(device)
        self.stats.cache_bytes = cache.nbytes()
        self.stats.prefill_passes += 1
        self.stats.prefill_seconds = time.perf_counter() - t0
        return logits

    def make_room(self, T):
        """With compile, grow the cache before a step of T columns that would not fit. The
        compiled step attends over every column of its buffer (masked past the ones
        written), so a cache the size of the whole generation from the start would be read
        whole at every step; grown CACHE_GROWTH columns at a time, it is read as it fills.
        The library takes any column count up to the generation's (compile_for's
        max_columns): one build."""
        if self.rows.length + T > self.rows.columns:
            self.rows.grow(cache_columns(self.rows.length + T, self.max_columns, CACHE_GROWTH))

    def reprefill(self):
        """The cache is full (context_len columns): make room for one more.

        Learned positions end at context_len, and a cache cannot slide under them (every
        cached key was computed at its absolute position). So a row whose context is full
        keeps its newest keep-1 tokens and computes them again at positions 0..keep-2 (the
        next token then goes to position keep-1). keep is half the context: one pass over
        context_len/2 tokens every context_len/2 tokens, about one extra position of work
        per token, and the row sees at least half a context.

        With left padding, rows fill up at different steps; each row must reprefill
        exactly when it would alone, or its text would change. So only the full rows are
        recomputed, from the rows' history; every row moves left by the same number of
        columns (the shortest padding), which keeps the other rows' keys as they are:
        positions are per row."""
        rows, keep = self.rows, reprefill_keep(self.context_len)
        self.stats.cache_bytes = max(self.stats.cache_bytes, rows.cache.nbytes())  # torch.cat's peak
        context = rows.length - rows.pad                  # (R,) tokens in each row
        full = context == self.context_len
        context = torch.where(full, keep - 1, context)    # what each row keeps
        new_length = int(context.max())
        rows.drop_oldest(rows.length - new_length, pad=new_length - context)  # >= 1: a full row drops half
        full = full.nonzero()[:, 0]
        if keep > 1 and full.numel():  # with keep == 1 a full row keeps no old token
            start = new_length - (keep - 1)
            fresh = self.model.new_cache(full.numel(), self.cache_kind, max_len=rows.columns)
            self.last_logits(rows.history[full, start:new_length], fresh)
            rows.write_rows(full, fresh, start)
        self.stats.reprefills += bool(full.numel())  # else only padding was dropped

    def evict(self):
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
        full = self.rows.pad == 0
        self.rows.forget_column(torch.where(full, self.sinks, 0))  # (R,): the column each row forgets
        self.model.move_keys(self.rows.cache, self.sinks, full.long())  # only full rows' tokens moved
        self.stats.evictions += 1


def row_processors(processors, num_rows, vocab_size):
    """Generation's processors as one per row (None where a row has none), checked; None
    when no row has any."""
    if processors is None:
        return None
    rows = [processors] * num_rows if isinstance(processors, Processors) else list(processors)
    if len(rows) != num_rows:
        raise ValueError(f"processors: {len(rows)} given for {num_rows} rows (one per row, "
                         "prompt-major, or one for all)")
    for p in rows:
        if p is not None:
            p.check(vocab_size)
    rows = [p if p is not None and p.active else None for p in rows]
    return rows if any(rows) else None


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
    finishing early (end of text is a token like any other here) but one whose processors
    leave it no token (-1 after its last). options: Generation's."""
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
    out = torch.full((generation.num_rows, max_new_tokens), -1, dtype=torch.long, device=device)
    if steps:
        out[rows, columns] = torch.cat([tokens for _, tokens in steps])
    return out


def reprefill_keep(context_len):
    """The positions a row whose context is full keeps when it is computed again (the
    reprefill policy, here and in the serving scheduler; a draft model's restart too): the
    newest half of the context, so that one recomputation of context_len/2 tokens buys
    context_len/2 new ones, about one extra position of work per token."""
    return max(1, context_len // 2)


def cache_columns(needed, limit, step):
    """Positions a cache holds when it must hold `needed`: rounded up to a multiple of
    step, at most limit. A generation's whole cache: what it can reach (its prompt, its new
    tokens and a speculative step's proposals past the last) in steps of
    CACHE_COLUMNS_STEP, at most the context (a longer generation moves
    within a full cache: the context policies); a compiled cache as it grows: steps of
    CACHE_GROWTH, at most that. Why not always the whole context: the compiled step attends
    over every column of the buffer, the unwritten ones masked, and at GPT-2 small a
    1024-column cache is 75 MB read per token, more than half the bytes of its int8 weights
    (docs/benchmarks.md)."""
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
