"""
Continuous batching: which sequences run in the next forward passes.

A static batch starts together and ends when its longest member ends; a row that is done
early idles, and a request that arrives meanwhile waits for the whole batch. Here the
batch is rebuilt at every step (Orca's iteration-level scheduling; vLLM's and nano-vllm's
scheduler follow it). A step has a token budget (max_step_tokens) and runs two passes:

    step:  decode   one token for every running sequence, in one pass; a sequence
                    entering a new block takes one from the free list; if there is none,
                    the newest sequence is preempted: its blocks are freed and it waits
                    at the front of the queue to be recomputed from its tokens
           prefill  the budget left, in one pass: the next chunk of each prompt fed in
                    part, then waiting requests while the pool has blocks for them (only
                    the tokens no cached block holds); a long prompt is fed a chunk a
                    step, and its first token comes out of the pass that feeds its last
           retire   (the engine) finished sequences give their blocks back at once

    waiting: [E][F]  --admit-->  running: [A][B][C][D]  --finish-->  blocks to the pool
                ^                 (D: a chunk a step)  |
                +----------- preempt (newest) ---------+    also: past the context, reprefill

The two are separate passes: rows are right-aligned to the longest row's new tokens, so
a 500-token chunk in the decode pass would make every row pay for 500 columns; apart, the
decode pass keeps its compiled step. Chunks keep the decoding streams moving: a
2,000-token prompt prefilled whole stalls every one of them for its whole prefill
(docs/serving.md, chunked prefill). max_step_tokens=0: no chunks, and a step is one pass,
admitting (each prompt whole) when anything can be admitted, else decoding.
"""

from collections import deque

from generation.loop import reprefill_keep

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"
# a step's token budget by default: on the long-prompt workload (benchmarks/long_prompts.py,
# docs/serving.md) 512 kept the streams' median gap and cut their p99 to a quarter; 256 cut
# it further but made every step 2.5x as long
MAX_STEP_TOKENS = 512


class Sequence:
    """A sequence's tokens and its place in the pool. tokens[start:] is its context (start
    moves past context_len); its first num_cached context tokens have keys and values in
    `blocks`; the rest (one token while decoding) are fed by the next pass that runs it.
    A prompt fed in chunks holds its tokens past the current chunk in `unfed`, so that
    every pass sees a context that ends where its feeding ends."""

    def __init__(self, prompt):
        self.tokens = list(prompt)
        self.prompt_len = len(self.tokens)
        self.start = 0
        self.blocks, self.hashes = [], []  # hashes: prefix hash of every full block
        self.num_cached = 0
        self.unfed = []                   # context tokens past this chunk (Scheduler.prefill)
        self.state = WAITING
        self.score_prompt = False         # the first pass feeds the whole prompt (its logits)
        # speculative decoding (serving/speculation.py): tokens[-proposed:] are proposals the
        # next pass checks; after it, the keys of the `accepted` ones stay (rollback)
        self.proposed = self.accepted = 0
        self.cached_prompt_tokens = None  # prompt tokens the prefix cache spared, once admitted

    @property
    def context(self):
        return self.tokens[self.start:]

    @property
    def context_len(self):
        return len(self.tokens) - self.start

    def first_fed(self, cached):
        """The context position the next pass starts feeding at, when `cached` context
        tokens have keys and values in blocks: the first uncached one, but at least the last
        token (its logits give the next token); 0 when the prompt is to be scored, whose
        every position's logits are needed (cached keys are still read, not written)."""
        return 0 if self.score_prompt else min(cached, self.context_len - 1)

    @property
    def num_fed(self):
        """How many tokens the next pass feeds (1 while decoding)."""
        return self.context_len - self.first_fed(self.num_cached)

    def hold_back(self, end):
        """Let the next pass feed context positions before `end` only."""
        self.unfed = self.tokens[self.start + end:]
        del self.tokens[self.start + end:]

    def feed_more(self, n):
        """The next chunk: n more of the held-back tokens join the context."""
        self.tokens += self.unfed[:n]
        del self.unfed[:n]


class Scheduler:
    def __init__(self, pool, context_len, max_batch=64, max_prefill_tokens=2048, max_step_tokens=0):
        """max_step_tokens: a step's token budget, the decode pass's first (0: no chunks, a
        step is one pass, the module docstring says)."""
        if max_step_tokens and max_step_tokens <= max_batch:
            raise ValueError(f"max_step_tokens must be 0 (off) or more than max_batch ({max_batch}), "
                             f"so that a prefill chunk fits beside a full decode pass; got {max_step_tokens}")
        self.pool, self.context_len = pool, context_len
        self.max_batch, self.max_prefill_tokens = max_batch, max_prefill_tokens
        self.max_step_tokens = max_step_tokens
        self.waiting = deque()
        self.running = []        # in order of admission: the last is preempted first
        self.preemptions = 0
        self.prefilled_tokens = self.cached_tokens = 0  # context tokens computed / found cached

    def add(self, seq):
        self.waiting.append(seq)

    def has_work(self):
        return bool(self.waiting or self.running)

    def schedule(self):
        """The passes of the next step, each a list of sequences: a decode pass of every
        running sequence, then a prefill pass of what the step's budget leaves
        (max_step_tokens=0: a prefill pass when anything can be admitted, else a decode
        pass). [] when there is nothing to do."""
        for seq in [s for s in self.running if s.context_len > self.context_len]:
            self.reprefill(seq)
        if not self.max_step_tokens:
            batch = self.prefill(self.max_prefill_tokens) or self.decode()
            return [batch] if batch else []
        decoding = self.decode()
        prefill = self.prefill(min(self.max_prefill_tokens, self.max_step_tokens - len(decoding)))
        return [batch for batch in (decoding, prefill) if batch]

    def prefill(self, budget):
        """A prefill pass: the next chunk of each prompt fed in part, then waiting sequences,
        oldest first, while the pool has blocks for them, there is room in the batch, and
        the padded pass (rows x longest chunk) stays within budget (the first row always
        fits). Each admitted sequence holds blocks for its whole context at once, so a
        prompt fed in chunks never waits for the pool halfway."""
        batch, width = [], 0
        for seq in [s for s in self.running if s.unfed]:
            take = self.chunk(len(seq.unfed), len(batch), width, budget)
            if not take:
                return batch
            seq.feed_more(take)
            batch.append(seq)
            width = max(width, take)
            self.prefilled_tokens += take
        tpb = self.pool.tokens_per_block
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            hashes = self.pool.block_hashes(seq.context)  # once: allocate() reuses them
            first = seq.first_fed(len(self.pool.cached_blocks(hashes)) * tpb)
            take = self.chunk(seq.context_len - first, len(batch), width, budget, whole=seq.score_prompt)
            if not take:
                break
            end = first + take  # this pass feeds context positions first .. end - 1
            # only the blocks this pass fills join the prefix index now, the rest once
            # computed: a prompt admitted later must not find a block not yet written
            allocated = self.pool.allocate(seq.context_len, hashes[:end // tpb])
            if allocated is None:
                break
            seq.blocks, seq.hashes, seq.num_cached = allocated
            seq.hold_back(end)
            self.cached_tokens += first
            if seq.cached_prompt_tokens is None:  # its first admission, not a preempted one's
                seq.cached_prompt_tokens = first
            self.prefilled_tokens += take
            width = max(width, take)
            self.waiting.popleft()
            seq.state = RUNNING
            self.running.append(seq)
            batch.append(seq)
        return batch

    def chunk(self, new, rows, width, budget, whole=False):
        """How many of a row's `new` tokens the prefill pass takes, as row rows + 1 of a pass
        whose longest row so far is width: all of them without chunks (and for a prompt
        scored whole: its every position's logits come from one pass), else its share of
        the budget; 0 when the row does not fit."""
        take = new if whole or not self.max_step_tokens else min(new, budget // (rows + 1))
        if rows and (rows + 1) * max(width, take) > budget:
            return 0
        return take

    def decode(self):
        """Every running sequence, each with a slot for its next token; when the pool is
        full, the newest sequences are preempted until the older ones fit."""
        batch = []
        for seq in list(self.running):
            if seq.unfed:  # a prompt fed in part: its next chunk is the prefill pass's
                continue
            while seq.state == RUNNING and not self.reserve_next_slot(seq):
                self.preempt(self.running[-1])
            if seq.state == RUNNING:
                batch.append(seq)
        return batch

    def reserve_next_slot(self, seq):
        """Make sure the block for seq's next position exists, taking a free one if needed;
        False when there is none to take."""
        if seq.num_cached < len(seq.blocks) * self.pool.tokens_per_block:
            return True
        if not self.pool.free:
            return False
        seq.blocks.append(self.pool.take_free())
        return True

    def reserve_proposals(self, seq, k):
        """Make sure blocks exist for seq's newest token and k proposals after it, taking
        free ones; False, and none taken, when there are too few (proposals never preempt)."""
        needed = self.pool.blocks_for(seq.context_len + k) - len(seq.blocks)
        if needed > len(self.pool.free):
            return False
        seq.blocks += [self.pool.take_free() for _ in range(needed)]
        return True

    def preempt(self, seq):
        """Free seq's blocks; it waits at the front of the queue and is recomputed from its
        tokens when there is room again (recomputing is cheaper than swapping to other
        memory here: a prefill pass is fast, and its full blocks may still be cached)."""
        self.drop(seq)
        seq.state = WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def computed(self, batch):
        """A pass has run: every sequence of batch has its whole context cached (a prompt fed
        in part: up to its chunk's end), and blocks that filled up, by a chunk or while
        decoding, join the prefix index, so later requests (a conversation sent again with
        one more turn) can share generated text too."""
        tpb = self.pool.tokens_per_block
        for seq in batch:
            # + the accepted proposals' keys: the engine appends them as tokens next (rollback)
            seq.num_cached, seq.accepted = seq.context_len + seq.accepted, 0
            seq.score_prompt = False  # scored once, by the pass that prefilled it
            while len(seq.hashes) < min(seq.num_cached, seq.context_len) // tpb:
                i = len(seq.hashes)
                first = seq.start + i * tpb
                parent = seq.hashes[-1] if seq.hashes else b""
                h = self.pool.block_hashes(seq.tokens[first:first + tpb], parent)[0]
                self.pool.index(seq.blocks[i], h)
                seq.hashes.append(h)

    def rollback(self, seq, accepted):
        """A pass fed seq's newest token and its `proposed` proposals, and the first
        `accepted` of them were right. The proposals leave its tokens (the engine hands the
        accepted ones out as new tokens, which appends them again; computed() counts their
        keys as cached); the blocks past the keys it keeps go back to the pool whole. None
        of those was in the prefix index: a block joins it once every position in it is
        cached (computed), and the proposals' positions were not."""
        del seq.tokens[len(seq.tokens) - seq.proposed:]
        kept = self.pool.blocks_for(seq.context_len + accepted)
        self.pool.release(seq.blocks[kept:])
        del seq.blocks[kept:]
        seq.proposed, seq.accepted = 0, accepted

    def reprefill(self, seq):
        """Past the context: the generation loop's policy (generation/loop.py, reprefill).
        The sequence keeps its newest context_len // 2 tokens, which are prefilled again at
        positions 0.. (learned positions end at context_len, and cached keys cannot move to
        new positions)."""
        keep = reprefill_keep(self.context_len)
        self.drop(seq)
        seq.start = len(seq.tokens) - keep
        seq.state = WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq):
        """A sequence leaves (done, or cancelled) wherever it is; its blocks go back."""
        if seq.state == WAITING:
            self.waiting.remove(seq)
        elif seq.state == RUNNING:
            self.drop(seq)
        seq.state = FINISHED

    def drop(self, seq):
        self.running.remove(seq)
        self.pool.release(seq.blocks)
        seq.blocks, seq.hashes, seq.num_cached = [], [], 0
        seq.feed_more(len(seq.unfed))  # its whole context again, to be fed afresh
