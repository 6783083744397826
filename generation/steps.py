"""
What one decode step does: each row's newest token in, each row's next tokens out.

    tokens, counts = step(newest)    newest (R, 1); row b's new tokens are tokens[b, :counts[b]]

The loop (generation/loop.py) chooses its step once, after the prefill:
    PlainStep          the model's forward over the newest token, then sample.py's pick
    CompiledPlainStep  the same, through generation/compiled_step.py's library, which
                       samples too (compile=True)
    SpeculativeStep    the newest token and up to K proposals in one pass, the model's
                       agreement kept, the rest rolled back (speculate=K, a proposer:
                       generation/speculative.py); with compile its pass of K + 1 tokens is
                       the one compiled
Each step is given its Generation: its model, its rows (generation/rows.py), its stats, its
choice of a token (Generation.choose) and what each row still needs.
"""

import torch

from generation.compiled_step import compile_for


class PlainStep:
    """One token per row: the model's forward over each row's newest token through the
    cache, then the loop's choice from the logits."""

    keeps_every_row = False  # rows that finish leave the batch (select_rows)

    def __init__(self, generation):
        self.generation, self.model = generation, generation.model
        self.rows, self.stats = generation.rows, generation.stats

    def __call__(self, newest):
        tokens = self.generation.choose(self.feed(newest)[:, -1])[:, None]   # (R, 1)
        return tokens, torch.ones_like(tokens[:, 0])

    def feed(self, tokens):
        """Logits (R, T, V) at every position of tokens (R, T), fed through the rows' cache."""
        self.rows.record(tokens)
        self.stats.count_pass(tokens.size(1))
        return self.model(tokens, self.rows.cache)[0]

    def select_rows(self, index):
        """The loop's rows index are kept (Rows.select_rows): a step with rows of its own keeps
        the same ones."""


class CompiledPlainStep(PlainStep):
    """One token per row through the compiled library, which samples inside its graph
    (sample.sample_with_noise) and hands back token ids; or, draws=False (rows with logits
    processors, which read each row's text), hands back logits that the loop's choice
    processes and draws from."""

    keeps_every_row = True  # a new batch size would be a new graph: finished rows run unseen

    def __init__(self, generation, draws=True):
        super().__init__(generation)
        self.draws = draws
        self.compiled, self.stats.compile_seconds = compile_for(
            self.model, self.rows.cache, sampling=generation.sampling if draws else None,
            vocab_limit=generation.vocab_limit, max_columns=generation.max_columns)

    def __call__(self, newest):
        self.rows.record(newest)
        self.generation.make_room(1)
        self.stats.count_pass(1)
        out = self.compiled.decode(newest, self.rows.cache)
        tokens = (out if self.draws else self.generation.choose(out[:, -1]))[:, None]   # (R, 1)
        return tokens, torch.ones_like(tokens[:, 0])


class SpeculativeStep(PlainStep):
    """Each row's newest token (R, 1) and up to K proposals after it in one pass: the
    proposer's verify keeps what the model agrees with, the rows roll back over the rest.
    A step with nothing to check is a plain one. first: each row's first token (R, 1),
    which the proposer is told of with the prompts."""

    def __init__(self, generation, first):
        super().__init__(generation)
        self.proposer, self.speculate = generation.proposer, generation.speculate
        self.compiled = None
        self.keeps_every_row = generation.compile
        if generation.compile:  # the pass over K + 1 tokens, handing back logits to check
            self.compiled, self.stats.compile_seconds = compile_for(
                self.model, self.rows.cache, tokens_per_step=self.speculate + 1,
                vocab_limit=generation.vocab_limit, max_columns=generation.max_columns)
        # it proposes among the ids the model samples from
        self.proposer.start(generation.row_prompts(), generation.sampling,
                            generation.vocab_limit or self.model.config.vocab_size,
                            first.device, generation.compile, self.stats)
        self.proposer.accept(first, torch.ones_like(first[:, 0]))

    def __call__(self, newest):
        """(tokens (R, k + 1), counts (R,)): row b's new tokens are tokens[b, :counts[b]].

        k is at most K, and as many as fit before the context ends: a proposal past it would
        be computed without the reprefill that plain decoding does there, and the text would
        change."""
        k = self.room_for_proposals()
        proposals = self.proposer.propose(k) if k else None
        if proposals is not None and not (self.compiled is not None and k == self.speculate):
            k = int(proposals.counts.max())  # no column for proposals no row has
            proposals.trim(k)
        if k:
            tokens, counts = self.check(newest, proposals, k)
        else:  # nothing to check
            tokens, counts = super().__call__(newest)
        self.proposer.accept(tokens.clamp(min=0), counts)
        return tokens, counts

    def check(self, newest, proposals, k):
        """Feed newest and the k proposals, keep the model's agreement, roll the rest back."""
        logits = self.feed(torch.cat([newest, proposals.tokens], dim=1))      # (R, 1 + k, V)
        logits = logits[..., :self.generation.vocab_limit]
        # with processors, each position as if the proposals before it were taken
        tokens, counts = self.proposer.verify(logits, proposals, self.generation.processing)
        # none past max_new_tokens; rows that finished (kept by compile) count for nothing
        remaining = torch.tensor(self.generation.remaining(), device=counts.device)
        counts = torch.minimum(counts, remaining.clamp(min=1))
        live = remaining > 0
        self.stats.verify_passes += 1
        self.stats.proposed += int(proposals.counts.minimum(remaining - 1)[live].sum())
        self.stats.accepted += int((counts - 1)[live].sum())
        # keep the newest token and the accepted proposals: the last k + 1 - counts columns go
        self.rows.rollback(self.rows.length - self.rows.pad - (k + 1 - counts))
        return tokens, counts

    def feed(self, tokens):
        """PlainStep's, through the compiled pass when there is one and tokens are as wide
        as it was compiled for (K + 1)."""
        if self.compiled is None:
            return super().feed(tokens)
        self.generation.make_room(tokens.size(1))
        if tokens.size(1) != self.speculate + 1:
            return super().feed(tokens)
        self.rows.record(tokens)
        self.stats.count_pass(tokens.size(1))
        return self.compiled.decode(tokens, self.rows.cache)

    def room_for_proposals(self):
        """How many proposals the next step may check: K, or fewer where the context ends
        (a step feeds k + 1 columns and the cache has context_len) or where no row needs
        that many more tokens. Past the context the sinks policy frees one column per step
        (evict), so there a step checks none: freeing k + 1 would show the first token fed
        a window that plain decoding never shows it, and the text would change. Rows moved
        right by rollbacks leave padding columns that every row has; those are dropped
        first when they are what stands in the way."""
        context_len = self.generation.context_len
        needed = max(self.generation.remaining()) - 1
        # compiled: always K, the one shape compiled (filler costs nothing in a static step)
        k = self.speculate if self.compiled is not None else min(self.speculate, needed)
        if self.rows.length + k + 1 > context_len:
            common = int(self.rows.pad.min())  # padding columns every row has: drop them
            if common:
                self.rows.drop_oldest(common)
        return max(0, min(k, context_len - 1 - self.rows.length))

    def select_rows(self, index):
        self.proposer.select_rows(index)
