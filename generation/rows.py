"""
The rows of one generation, and every move on them.

A batch being generated is a cache (kv_cache.py: rows are sequences, columns positions),
and beside it, column for column, the token each cache column was computed from (the
history: what reprefill computes again). Rows are left-padded, so that every row's newest
token sits in the last column and a step writes all rows at one column. The loop moves
rows and columns for four reasons:

    select_rows(index)    rows that finished leave (and repeat(n): after the prefill, a
                          prompt's samples share it)
    drop_oldest(n)        the n oldest columns go (reprefill; padding every row has)
    forget_column(column) each row forgets one column (the sinks policy)
    rollback(positions)   each row forgets what was fed past a length (speculative decoding)

Each is one method here, and moves the cache's tensors and the history together: they share
the column index, so one gather index serves both. The moves work on the tensors a cache
hands over (cache.tensors(): rows on dim -4, columns on dim -2, as both kv_cache.ConcatCache
and the preallocated KVCache store them) and hand them back (cache.hold): they need none
of kv_cache.py's classes (kv_cache.py imports the loop, so nothing here may import it),
and a quantized cache's bytes move as they are.
"""

import torch


class Rows:
    """A cache of batch_size rows (on `device`), the token of each of its columns (history
    (batch_size, history_len)), each row's left padding (pad (batch_size,), zeros where no
    row is padded) and each row's number in the generation (numbers: the batch's row b is
    row numbers[b]). Tokens are recorded as they are fed (record), columns moved by the
    methods below; the cache's own pad is kept in step for the model (None when no row is
    padded, so the forward needs no mask for one new token)."""

    def __init__(self, cache, batch_size, history_len, device):
        self.cache = cache
        self.history = torch.zeros(batch_size, history_len, dtype=torch.long, device=device)
        self.pad = (cache.pad if cache.pad is not None
                    else torch.zeros(batch_size, dtype=torch.long, device=device))
        self.numbers = list(range(batch_size))

    @property
    def length(self):
        """Columns filled in every row (padding included)."""
        return self.cache.length

    @property
    def columns(self):
        """Columns the cache has room for: a KVCache's buffer; what a ConcatCache holds."""
        return self.cache.tensors()[0].size(-2)

    def record(self, tokens):
        """tokens (B, T) are about to be fed at the next columns: the history keeps them."""
        self.history[:, self.length:self.length + tokens.size(1)] = tokens

    # ------------------------------------------------------------------------ rows

    def select_rows(self, index):
        """Keep the rows index (LongTensor), in that order: index may leave rows out (rows
        that have finished) or repeat them."""
        self.cache.hold([t.index_select(-4, index) for t in self.cache.tensors()], self.length)
        self.history = self.history[index]
        self.numbers = [self.numbers[i] for i in index.tolist()]
        self.set_pad(self.pad[index])

    def repeat(self, n):
        """Every row n times in a row (one prefill shared by n samples), numbered afresh."""
        self.select_rows(torch.arange(len(self.numbers), device=self.pad.device).repeat_interleave(n))
        self.numbers = list(range(len(self.numbers)))

    def write_rows(self, rows, cache, column):
        """Copy the filled columns of `cache` (a cache of the same kind with len(rows)
        rows) into rows `rows`, from `column` on (reprefill's recomputed rows)."""
        for t, new in zip(self.cache.tensors(), cache.tensors()):
            t[..., rows, :, column:column + cache.length, :] = new[..., :cache.length, :]

    # ------------------------------------------------------------------------ columns

    def drop_oldest(self, n, pad=None):
        """Forget the n oldest columns of every row (the caller has made sure they are
        padding, or context a row is about to rebuild). pad: each row's left padding
        afterwards, when the caller will rebuild some rows further right; by default every
        row's padding moves left with its columns."""
        kept = torch.arange(n, self.length, device=self.pad.device)         # (length - n,)
        self.move_columns(kept.expand(len(self.numbers), -1))
        self.set_pad((self.pad - n).clamp(min=0) if pad is None else pad)

    def forget_column(self, column):
        """Forget one column of every row, row b's column[b] (LongTensor (B,)); the columns
        right of it move one left. A row that forgets a padding column has one less of
        padding."""
        kept = torch.arange(self.length - 1, device=column.device)
        self.move_columns(kept + (kept >= column[:, None]))                 # (B, length - 1)
        self.set_pad(self.pad - (column < self.pad).long())

    def rollback(self, positions):
        """Forget every position from positions[b] on in row b (positions: (B,) LongTensor):
        what the cache keeps is as if those tokens had never been fed. Speculative decoding
        feeds proposed tokens and keeps those the model agrees with, a different number in
        every row.

        Rows are right-aligned, and a row's positions are its columns less its padding. So:
        the columns that every row forgets are dropped from the end, and a row that forgets
        more has its kept columns moved right by the difference, its padding growing as
        much, which leaves every kept key at its position:

            before (length 6)      rollback([5, 2])       after (length 5)
            row 0:  a b c d e f    keeps a b c d e        row 0:  a b c d e
            row 1:  . . w x y z    keeps w x: moves 1     row 1:  . . . w x

        Rotary keys (KVCacheLlama) are cached after rotation by their position, and a kept
        key's position does not change, so none is turned again: rollback only forgets.
        """
        held = self.length - self.pad                   # (B,) positions each row holds
        if ((positions < 0) | (positions > held)).any():
            raise ValueError(f"rollback to {positions.tolist()} positions: the rows hold "
                             f"{held.tolist()}")
        forget = held - positions                       # (B,) columns each row forgets
        shift = forget - forget.min()                   # how far each row's kept columns move
        length = self.length - int(forget.min())
        moving = shift.nonzero()[:, 0]  # only these rows are copied; the rest just end earlier
        if moving.numel():
            # column j of a moving row takes column j - shift: those left of its kept
            # columns become padding, and what they hold is never seen
            source = torch.arange(length, device=shift.device) - shift[moving, None]
            self.move_columns(source.clamp(min=0), moving)
        else:
            self.cache.hold(self.cache.tensors(), length)
        self.set_pad(self.pad + shift)

    def move_columns(self, source, rows=slice(None)):
        """Column j of row rows[b] takes what its column source[b, j] held, in the cache and
        in the history alike (source (len(rows), new_length) LongTensor, every index below
        the length); the cache then holds new_length columns. rows: every row by default."""
        length = source.size(1)
        self.history[rows, :length] = self.history[rows].gather(1, source)
        tensors = self.cache.tensors()
        for t in tensors:                                  # (..., B, nh, columns, width)
            moved = t[..., rows, :, :self.length, :]       # (..., len(rows), nh, length, width)
            index = source[:, None, :, None].expand(*moved.shape[:-2], length, moved.size(-1))
            # gather first (a new tensor), then write back: source and target overlap
            t[..., rows, :, :length, :] = moved.gather(-2, index)
        self.cache.hold(tensors, length)

    def set_pad(self, pad):
        """Every row's left padding from now on (pad (B,)); the cache's is None when no
        row has any."""
        self.pad = pad
        self.cache.pad = pad if pad.any() else None

    # ------------------------------------------------------------------------ room

    def grow(self, columns):
        """Room for `columns` columns from now on (more than it has): new tensors, the
        filled columns copied in, the others zeroed (the compiled step reads every column,
        the unwritten ones masked: no NaN bits may be there)."""
        grown = []
        for t in self.cache.tensors():
            new = t.new_zeros((*t.shape[:-2], columns, t.size(-1)))
            new[..., :self.length, :] = t[..., :self.length, :]
            grown.append(new)
        self.cache.hold(grown, self.length)

