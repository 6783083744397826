"""
Where a pass's columns live in the pool, and the decode step's copy of it kept from step to
step.

A pass over the paged cache needs, for every sequence, the pool slot of each column it
reads (read_slots, (B, S)), which columns are padding (visible), the position of the token
it feeds and the slot that token's key and value go to (write_slots). Rows are
right-aligned (generation/loop.py's left_pad layout): S columns, the longest context; row
b starts at column pad[b], so column c holds its position c - pad[b]:

    row A (5 tokens)   [ A0 A1 A2 A3 A4 ]        pad 0
    row B (3 tokens)   [ .  .  B0 B1 B2 ]        pad 2: columns 0-1 read the null block

column_slots builds that table from the block tables, all of it (B block tables to
tensors, a dozen operations: ~0.5 ms for 64 sequences of 80 tokens, where the engine's
whole step was 23-33 ms). Yet from one decode step to the next of the same batch nothing
in it changes but one new column: every sequence has one more token, whose slot is in its
last block. DecodeIndex keeps the tables of the last decode step and, when the batch is the
same sequences each one token longer, appends that column:

    step t     [ A0 A1 A2 A3 A4 ]            step t + 1   [ A0 A1 A2 A3 A4 A5 ]
               [ .  .  B0 B1 B2 ]                         [ .  .  B0 B1 B2 B3 ]

Any other batch (a sequence finished, joined after a prefill, or was preempted) is built
again from the block tables, once, and followed from there.

A short prefill can run through the same step: fed_rows lays each fed token out as a row
of its own, reading the columns up to its position.
"""

import torch

from serving.paged_cache import NULL_BLOCK


def slot_of(sequence, position, tokens_per_block):
    """The pool slot holding a sequence's context position (paged_cache.py's picture)."""
    return sequence.blocks[position // tokens_per_block] * tokens_per_block + position % tokens_per_block


def column_slots(batch, S, tokens_per_block, lengths=None):
    """positions (B, S), the position held by each column (negative: padding), and slots
    (B, S), the pool slot it is read from (the null block for padding), for sequences
    right-aligned to S columns. lengths: how many of each sequence's context positions its
    row holds (default: all of them)."""
    if lengths is None:
        lengths = [s.context_len for s in batch]
    pad = S - torch.tensor(lengths)                                            # (B,)
    positions = torch.arange(S) - pad[:, None]                                 # (B, S)
    n = -(-S // tokens_per_block)  # a prompt fed in chunks holds blocks past the pass's columns
    table = torch.tensor([(s.blocks + [NULL_BLOCK] * n)[:n] for s in batch])  # (B, n)
    at = positions.clamp(min=0)
    slots = table.gather(1, at // tokens_per_block) * tokens_per_block + at % tokens_per_block
    return positions, torch.where(positions >= 0, slots, NULL_BLOCK)


def fed_rows(batch, tokens_per_block, device):
    """A pass feeding several tokens of a sequence (a short prompt, a prefix hit's last
    tokens) as a decode step's rows: one row per fed token, each reading the columns up to
    its own position, which is the causal mask, row by row:

        prompt A, 5 tokens, 2 cached:   [ .  .  A0 A1 A2 ]   row 0 feeds A2
                                        [ .  A0 A1 A2 A3 ]   row 1 feeds A3
                                        [ A0 A1 A2 A3 A4 ]   row 2 feeds A4: A's next token

    A row reads keys that rows before it write in the same pass: the step writes every
    row's key and value into the pool before attention reads (paged_attention.PagedKernelCache).
    Returns the decode step's tensors as DecodeIndex.update does (tokens, positions,
    read_slots, write_slots, visible: R rows), and last (B,), each sequence's last row,
    whose logits and token are the sequence's."""
    rows = [(s, p) for s in batch for p in range(s.first_fed(s.num_cached), s.context_len)]
    S = max(s.context_len for s in batch)
    sequences = [s for s, _ in rows]
    positions, slots = column_slots(sequences, S, tokens_per_block, [p + 1 for _, p in rows])
    # a position the pool holds already (a prompt found whole in the prefix cache feeds its
    # last token again, for its logits) is not written: its block may be shared
    cached = torch.tensor([p < s.num_cached for s, p in rows])
    tokens = torch.tensor([[s.tokens[s.start + p]] for s, p in rows])             # (R, 1)
    last = torch.cumsum(torch.tensor([s.num_fed for s in batch]), 0) - 1
    # positions with DecodeIndex.rebuild's strides, for the same reason (the graph's guards)
    index = (tokens, positions[:, -1:].clone(memory_format=torch.contiguous_format), slots,
             torch.where(cached, NULL_BLOCK, slots[:, -1]), positions >= 0)
    return tuple(t.to(device) for t in index), last.to(device)


class DecodeIndex:
    """The index tensors of the engine's compiled decode step, each sequence feeding its
    newest token: tokens, positions (B, 1); read_slots, visible (B, S); write_slots (B,)."""

    def __init__(self, tokens_per_block, device):
        self.tokens_per_block, self.device = tokens_per_block, device
        self.rows = []  # (sequence, its start, its context length) at the last decode step
        self.rebuilds = self.extensions = 0

    def update(self, batch):
        """The tensors for a decode pass over batch (each sequence's newest token fed)."""
        if self.follows(batch):
            self.extend(batch)
        else:
            self.rebuild(batch)
        self.rows = [(s, s.start, s.context_len) for s in batch]
        tokens = torch.tensor([[s.tokens[-1]] for s in batch], device=self.device)
        return tokens, self.positions, self.read_slots, self.write_slots, self.visible

    def follows(self, batch):
        """The same sequences, in the same order, each one token longer (and not moved
        past the context: start unchanged) than at the last decode step."""
        return len(batch) == len(self.rows) and all(
            s is last and s.start == start and s.context_len == length + 1
            for s, (last, start, length) in zip(batch, self.rows))

    def extend(self, batch):
        column = torch.tensor([[slot_of(s, s.context_len - 1, self.tokens_per_block)] for s in batch],
                              device=self.device)                              # (B, 1)
        self.read_slots = torch.cat([self.read_slots, column], dim=1)         # (B, S + 1)
        self.visible = torch.cat([self.visible, torch.ones_like(column, dtype=torch.bool)], dim=1)
        self.positions = self.positions + 1
        # each newest token was sampled by the last step: none is in the pool yet
        self.write_slots = column[:, 0]
        self.extensions += 1

    def rebuild(self, batch):
        S = max(s.context_len for s in batch)
        positions, slots = column_slots(batch, S, self.tokens_per_block)
        self.read_slots = slots.to(self.device)
        self.visible = (positions >= 0).to(self.device)
        # a copy with the strides extend's sums get, (1, 1): compile guards on strides, and
        # .contiguous() would keep the view's (S, 1) for a batch of one (a size-1 dimension
        # counts as contiguous whatever its stride), recompiling the step mid-serve
        last = positions[:, -1:].clone(memory_format=torch.contiguous_format)     # (B, 1)
        self.positions = last.to(self.device)
        # the newest key and value go to their slot, or to the null block when the pool holds
        # them already (a prompt found whole in the prefix cache feeds its last token again,
        # for its logits)
        cached = torch.tensor([s.num_cached >= s.context_len for s in batch], device=self.device)
        self.write_slots = torch.where(cached, NULL_BLOCK, self.read_slots[:, -1])
        self.rebuilds += 1
