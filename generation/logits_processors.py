"""
Per-row logits processors: what each row asks for (Processors) and what the processors
read as the row grows (RowProcessing): its prompt, its output, its place in a grammar.

    processors = Processors(repetition_penalty=1.3, bad_words=((464, 3290),))
    row = RowProcessing(processors, prompt_ids)
    logits = row(logits)          # (n, V): sample.py's processors, in sample.py's order
    row.accept([token])           # after the token is chosen

The formulas are sample.py's (ban, add_bias, repetition_penalty,
presence_frequency_penalty); this file keeps each row's state and turns it into the
tensors they take. The generation loop (generation/loop.py: RowsProcessing, one per row of
a batch) and the serving engine (serving/requests.py: one per request) both use it. A row
without processors has none: it keeps the batch's compiled draw.

Speculative decoding checks k proposals in one pass: the distribution at position i is the
one the row would have after taking proposals 1..i, so row(logits, ahead=proposals)
processes position i as if they had been taken (counts, bad words and grammar alike),
and leaves the row where it was.
"""

from dataclasses import dataclass

import torch

from sample import add_bias, ban, presence_frequency_penalty, repetition_penalty

MAX_BIAS = 100  # OpenAI's bound on a logit_bias value


@dataclass(frozen=True)
class Processors:
    """What one row asks for; the defaults change nothing. Token ids everywhere (a caller
    with strings turns them into ids first: bad_word_ids). end_ids: the tokens that end a
    text, which min_tokens holds back. constraint: a compiled structured-output constraint
    (generation/structured.py), None for free text."""
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple = ()          # ((token_id, bias), ...)
    min_tokens: int = 0
    bad_words: tuple = ()           # token-id sequences, each banned whole
    allowed_token_ids: tuple = None
    end_ids: tuple = ()
    constraint: object = None

    def check(self, vocab_size):
        """ValueError (one line) for a setting that has no meaning."""
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 is off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        for token, bias in self.logit_bias:
            check_token(token, vocab_size, "logit_bias")
            if not -MAX_BIAS <= bias <= MAX_BIAS:
                raise ValueError(f"logit_bias of token {token}: {bias} is outside "
                                 f"[-{MAX_BIAS}, {MAX_BIAS}]")
        for word in self.bad_words:
            if not word:
                raise ValueError("a bad word must have at least one token")
            for token in word:
                check_token(token, vocab_size, "bad_words")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (leave it out to allow every token)")
            for token in self.allowed_token_ids:
                check_token(token, vocab_size, "allowed_token_ids")

    @property
    def active(self):
        """Whether any processor changes anything (a row without any keeps the fast draw)."""
        return self != Processors(end_ids=self.end_ids)


def check_token(token, vocab_size, field):
    if type(token) is not int or not 0 <= token < vocab_size:
        raise ValueError(f"{field}: token id {token!r} is not in 0..{vocab_size - 1}")


def bad_word_ids(words, tokenizer):
    """vLLM's reading of bad words (strings) as token sequences: each word's tokens as
    written, and with a space before it (the same word mid-sentence, which BPE tokenizers
    spell with other tokens), that one when it differs."""
    sequences = []
    for word in words:
        if not isinstance(word, str) or not word.strip():
            raise ValueError(f"a bad word must be a non-empty string, got {word!r}")
        plain = tokenizer.encode_ordinary(word.lstrip())
        spaced = tokenizer.encode_ordinary(" " + word.lstrip())
        sequences.append(tuple(plain))
        if spaced != plain:
            sequences.append(tuple(spaced))
    return tuple(sequences)


class RowProcessing:
    """One row's processors and what they read: its prompt and output (token ids), and a
    grammar matcher when it has a constraint (which allows every one of end_ids where it
    allows the end of text)."""

    def __init__(self, processors, prompt):
        self.processors, self.prompt, self.output = processors, list(prompt), []
        self.end_ids = list(processors.end_ids)
        constraint = processors.constraint
        self.matcher = constraint.matcher(processors.end_ids) if constraint is not None else None
        self.bias = None  # logit_bias as a (V,) vector, made at the first step: it never changes

    def accept(self, tokens):
        """The row took tokens (a list of ids)."""
        self.output.extend(tokens)
        if self.matcher is not None:
            self.matcher.accept(tokens)

    def __call__(self, logits, ahead=()):
        """logits (n, V) of the row's next n positions, n = len(ahead) + 1, processed:
        position i as if the row had taken ahead[:i] too. A position at which every token
        is banned comes back all -inf (the row can take nothing there: it ends)."""
        p, (n, V) = self.processors, logits.shape
        ahead = list(ahead)[:n - 1]
        logits = ban(logits, self.banned(n, V, ahead, logits.device))
        if p.logit_bias:
            if self.bias is None:
                self.bias = torch.zeros(V, device=logits.device)
                self.bias[[t for t, _ in p.logit_bias]] = torch.tensor([float(b) for _, b in p.logit_bias])
            logits = add_bias(logits, self.bias)
        if p.repetition_penalty != 1:
            seen = self.counts(self.prompt + self.output, ahead, n, V, logits.device) > 0
            logits = repetition_penalty(logits, seen, p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:
            counts = self.counts(self.output, ahead, n, V, logits.device)
            logits = presence_frequency_penalty(logits, counts, p.presence_penalty, p.frequency_penalty)
        return logits

    @staticmethod
    def counts(tokens, ahead, n, V, device):
        """(n, V): how often each token is in tokens + ahead[:i], for each position i."""
        base = torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=V)[:V]
        counts = base.to(device).expand(n, V).clone()
        for i, token in enumerate(ahead):  # position i + 1 on has seen ahead[i]
            counts[i + 1:, token] += 1
        return counts

    def banned(self, n, V, ahead, device):
        """(n, V) bool: what each position may not take."""
        p = self.processors
        banned = torch.zeros(n, V, dtype=torch.bool)
        if self.matcher is not None:
            allowed = self.matcher.allowed_along(ahead)                    # (n, V_tokenizer)
            banned[:, :allowed.size(1)] = ~allowed
            banned[:, allowed.size(1):] = True  # ids past the tokenizer's: no text at all
        if p.allowed_token_ids is not None:
            outside = torch.ones(V, dtype=torch.bool)
            outside[list(p.allowed_token_ids)] = False
            banned |= outside
        if p.min_tokens or p.bad_words:
            # a bad word is matched at the end of the text: its last tokens are all it reads
            longest = max((len(word) for word in p.bad_words), default=0)
            tail = (self.prompt + self.output)[-longest:] if longest else []
            for i in range(n):
                text = tail + ahead[:i]
                if len(self.output) + i < p.min_tokens:
                    banned[i, self.end_ids] = True
                for word in p.bad_words:  # its last token, where the text ends with the rest
                    *start, last = word
                    if not start or text[len(text) - len(start):] == start:
                        banned[i, last] = True
        return banned.to(device)


class RowsProcessing:
    """RowProcessing for each row of a batch (None for a row without processors), with the
    moves the generation loop makes on its rows: accept each step's tokens, select_rows
    when rows leave or repeat (a proposer's interface too)."""

    def __init__(self, rows):
        self.rows = rows

    def accept(self, tokens, counts):
        """Row b took tokens[b, :counts[b]] (a token < 0: it took nothing and ends)."""
        for row, taken, n in zip(self.rows, tokens.tolist(), counts.tolist()):
            if row is not None:
                row.accept([t for t in taken[:n] if t >= 0])

    def select_rows(self, index):
        self.rows = [self.rows[i] for i in index.tolist()]

    def __call__(self, logits, proposals=None):
        """Process every row that has processors: logits (R, V), or (R, k + 1, V) with
        proposals (speculative.Proposals: row b's are ahead of its position i). Returns the
        logits and each row's first position at which nothing can be taken, (R,) (n: none)
        (from there on the logits are zeros, so that the draw runs; its token is discarded,
        and no proposal past it is checked)."""
        flat = logits.dim() == 2
        logits = (logits[:, None] if flat else logits).clone()            # (R, n, V)
        n = logits.size(1)
        dead = torch.full((len(self.rows),), n, dtype=torch.long)
        counts = [0] * len(self.rows) if proposals is None else proposals.counts.tolist()
        for b, row in enumerate(self.rows):
            if row is None:
                continue
            ahead = [] if proposals is None else proposals.tokens[b, :counts[b]].tolist()
            m = len(ahead) + 1
            logits[b, :m] = row(logits[b, :m], ahead)
            nothing = torch.isneginf(logits[b, :m]).all(dim=-1).nonzero()
            if len(nothing):
                dead[b] = int(nothing[0, 0])
                logits[b, dead[b]:] = 0.0
        return (logits[:, 0] if flat else logits), dead.to(logits.device)
