"""
Speculative decoding: propose several tokens cheaply, verify them all in one forward of the
model, keep the longest prefix the model agrees with, roll the cache back over the rest.

A decode step reads every weight to make one token; on a CPU (or a GPU at batch 1) a step
over 5 positions costs about what a step over 1 does, because reading the weights, not the
arithmetic, is the cost. So the loop (generation/loop.py, Generation(..., speculate=K,
proposer=...)) feeds the model the row's newest token followed by K proposed tokens, gets
the model's own distribution after each of them in that one pass, and keeps:

    fed:       t   d1  d2  d3  d4         t: the newest token, d: the proposals
    model:     p0  p1  p2  p3  p4         p_i: the model's distribution after d1..d_i
    greedy:    d1 == argmax p0? yes, d2 == argmax p1? yes, d3 == argmax p2? no
    emitted:   d1  d2  argmax(p2)         3 tokens for one pass of the model
    the cache: forgets d3 and d4 (generation/rows.py, Rows.rollback)

Every emitted token is one the model would have chosen itself, so greedy text is the same
as plain decoding's, token for token. Sampling keeps the distribution exactly with the
speculative sampling rule (Leviathan et al. 2023; Chen et al. 2023): accept d_i with
probability min(1, p(d_i) / q(d_i)), q the distribution d_i was drawn from; at the first
rejection draw from the residual max(0, p - q) normalised; after K acceptances draw one
more token from p_K. For any x, P(x) = q(x) min(1, p(x)/q(x)) + P(reject) residual(x) = p(x).

Two proposers, the same small interface (start, propose, accept, select_rows):
    PromptLookup  the last up-to-N tokens matched against the prompt and the text so far:
                  what followed them last time. Free, and good on text that repeats
                  (code, quotes, a greedy loop); q is a point mass on the proposal.
    DraftModel    a smaller model with the same tokenizer, decoding K tokens ahead with
                  its own cache; q is its (filtered) distribution.
verify() is the rule above (check() runs the logits processors first; the loop calls it
through its proposer, the serving engine's model runner directly). docs/speculative.md
has the arithmetic: expected tokens per verification, and when a draft model pays.
"""

from dataclasses import dataclass

import torch

from generation import compiled_step
from generation.loop import left_pad, reprefill_keep
from generation.rows import Rows
from sample import probabilities, sample


@dataclass
class Proposals:
    """What a proposer offers for one step, R rows of k proposals:
    tokens (R, k); past a row's count they are filler, never accepted;
    counts (R,): how many of each row's tokens are proposals (0..k);
    probs (R, k, V): the distribution each proposal was drawn from, or None when they were
    chosen deterministically (prompt lookup, a greedy draft): a point mass on the token."""
    tokens: torch.Tensor
    counts: torch.Tensor
    probs: torch.Tensor = None

    def trim(self, k):
        """Keep the first k proposals of every row (no row has more)."""
        self.tokens = self.tokens[:, :k]
        self.probs = None if self.probs is None else self.probs[:, :k]


def verify(logits, proposals, temperature=1.0, top_k=None, top_p=None, generator=None, min_p=None):
    """The tokens to emit after one verification pass: (tokens (R, k + 1), counts (R,)), row
    b emitting tokens[b, :counts[b]] (its accepted proposals, then the model's own token).

    logits (R, k + 1, V): the model's logits at the newest token and after each proposal
    (after the rows' logits processors, each position's as if the proposals before it had
    been taken: generation/logits_processors.py). Sampling settings as sample.py takes
    them; p is exactly the distribution sample() would draw from (sample.probabilities,
    the same filtering), so a banned proposal has p = 0 and is never accepted."""
    d, R, k = proposals.tokens, *proposals.tokens.shape
    is_proposal = torch.arange(k, device=d.device) < proposals.counts[:, None]   # (R, k)
    if temperature == 0:
        # greedy: the model's argmax after each prefix (sample()'s own rule, NaN-safe)
        choice = sample(logits.flatten(0, 1), temperature=0).view(R, k + 1)
        agree = (d == choice[:, :k]) & is_proposal
        accepted = agree.int().cumprod(dim=1).sum(dim=1)      # (R,) leading agreements
        return choice, accepted + 1   # accepted proposals equal the model's choices
    p = probabilities(logits, temperature, top_k, top_p, min_p)  # (R, k + 1, V)
    p = p / p.sum(dim=-1, keepdim=True)                       # top-p leaves less than 1
    q = torch.zeros_like(p)                                   # position k: no proposal, q = 0
    if proposals.probs is None:
        q[:, :k].scatter_(-1, d[..., None], 1.0)              # a point mass on each proposal
    else:
        q[:, :k] = proposals.probs
    q[:, :k] *= is_proposal[..., None]                        # filler proposes nothing
    p_d = p[:, :k].gather(-1, d[..., None])[..., 0]           # (R, k) p(d_i)
    q_d = q[:, :k].gather(-1, d[..., None])[..., 0]           # (R, k) q(d_i)
    u = torch.rand(R, k, device=p.device, generator=generator)
    accept = (u * q_d < p_d) & is_proposal                    # u < p/q, without dividing by 0
    accepted = accept.int().cumprod(dim=1).sum(dim=1)         # (R,)
    # at the first rejection, or past the last proposal (where q = 0 and this is p itself)
    at = accepted[:, None, None].expand(R, 1, p.size(-1))
    final = torch.multinomial(residual(p.gather(1, at)[:, 0], q.gather(1, at)[:, 0]), 1,
                              generator=generator)            # (R, 1)
    tokens = torch.cat([d, d[:, :1]], dim=1).scatter(1, accepted[:, None], final)
    return tokens, accepted + 1


def check(logits, proposals, sampling, processing=None):
    """verify() after the rows' logits processors, if any: (tokens (R, k + 1), counts (R,)),
    as verify() returns them. The generation loop's speculative step and the serving
    engine's verification both call it: one rule for both.

    processing (generation/logits_processors.py, RowsProcessing): each position processed
    as if the proposals before it had been taken. Proposals past a position where nothing
    can be taken are not checked; a row that reaches that position gets -1 there (it ends)."""
    if processing is None:
        return verify(logits, proposals, **sampling)
    logits, dead = processing(logits, proposals)
    proposals.counts = torch.minimum(proposals.counts, dead)
    tokens, counts = verify(logits, proposals, **sampling)
    last = (counts - 1)[:, None]                                           # (R, 1)
    ended = last == dead[:, None]
    return tokens.scatter(1, last, torch.where(ended, -1, tokens.gather(1, last))), counts


def residual(p, q):
    """What to draw from after rejecting a proposal drawn from q: max(0, p - q), in
    proportion (multinomial normalises). It holds exactly the probability that acceptance
    did not give each token. (Drawing from p instead, the tempting shortcut, gives tokens
    the proposer likes too often: tests/test_speculative.py shows the test catching it.)"""
    weights = (p - q).clamp(min=0)
    # p - q can round to nothing where p and q are all but equal: then p is the answer
    empty = weights.sum(dim=-1, keepdim=True) <= 0
    return torch.where(empty, p, weights)


# ---------------------------------------------------------------------------- proposers

class Proposer:
    """What the loop asks of a proposer, once per row set:
        start(prompts, ...)    the rows' prompts (token-id lists) before the first token,
                               the sampling settings, vocab_limit (the model samples
                               token ids below it), the device
        accept(tokens, counts) after every step: row b was given tokens[b, :counts[b]]
        propose(k)             Proposals of at most k tokens per row, for the next step
        select_rows(index)     rows leave (finished) or repeat, as the loop's rows do
    Every proposer keeps each row's text so far (prompt and tokens given)."""

    def start(self, prompts, sampling=None, vocab_limit=None, device="cpu", compile=False,
              stats=None):
        self.texts = [list(p) for p in prompts]
        self.sampling, self.vocab_limit, self.device = sampling, vocab_limit, device
        self.compile, self.stats = compile, stats

    def accept(self, tokens, counts):
        for text, row, n in zip(self.texts, tokens.tolist(), counts.tolist()):
            text.extend(row[:n])

    def select_rows(self, index):
        self.texts = [self.texts[i] for i in index.tolist()]

    def propose(self, k):
        raise NotImplementedError

    def verify(self, logits, proposals, processing=None):
        """check() with the loop's sampling settings: (tokens, counts)."""
        return check(logits, proposals, self.sampling, processing)


class PromptLookup(Proposer):
    """Propose what followed the row's last n tokens the latest time they occurred before,
    in the prompt or the text so far, trying n = max_ngram first, then shorter. Each row
    keeps an index {n-gram: where its latest continuation starts}, updated as tokens
    arrive, so a lookup costs O(max_ngram) whatever the length of the text."""

    # Each token enters the index once per n, as an n-token key: memory per token grows as
    # max_ngram squared (~0.3 kB at 3, 2.2 kB at 16, 21 kB at 64). The peers match 2-4.
    MAX_NGRAM = 16

    def __init__(self, max_ngram):
        if not 1 <= max_ngram <= self.MAX_NGRAM:
            raise ValueError(f"prompt lookup matches n-grams of n = 1..{self.MAX_NGRAM}, got {max_ngram}")
        self.max_ngram = max_ngram

    def start(self, prompts, *args, **kwargs):
        super().start(prompts, *args, **kwargs)
        self.index = [{} for _ in self.texts]
        for text, index in zip(self.texts, self.index):
            self.add_to_index(text, index, 1)

    def add_to_index(self, text, index, first):
        """Index the n-grams that text[first:] follows: each points at its latest continuation."""
        for i in range(first, len(text)):
            for n in range(1, min(self.max_ngram, i) + 1):
                index[tuple(text[i - n:i])] = i

    def accept(self, tokens, counts):
        lengths = [len(text) for text in self.texts]
        super().accept(tokens, counts)
        for text, index, first in zip(self.texts, self.index, lengths):
            self.add_to_index(text, index, max(first, 1))

    def select_rows(self, index):
        super().select_rows(index)
        self.index = [self.index[i] for i in index.tolist()]

    def propose(self, k):
        found = [lookup(text, index, self.max_ngram, k) for text, index in zip(self.texts, self.index)]
        tokens = [p + [0] * (k - len(p)) for p in found]  # filler past a row's count: 0
        return Proposals(torch.tensor(tokens, dtype=torch.long, device=self.device).view(-1, k),
                         torch.tensor([len(p) for p in found], device=self.device))

    def describe(self):
        return f"prompt lookup (up to {self.max_ngram}-grams)"


def lookup(text, index, max_ngram, k):
    """k tokens that followed text's last n tokens (longest n first), or []. The copy may run
    into the text's own end and on into itself, so a repeating pattern continues: in
    'x a b a b', 'b' last followed at index 3 ('a b'), and the proposal is 'a b a b ...'."""
    for n in range(min(max_ngram, len(text)), 0, -1):
        start = index.get(tuple(text[-n:]))
        if start is not None:
            proposal = text[start:start + k]
            while len(proposal) < k:  # past the end: the copy reads what it has just copied
                proposal.append(proposal[len(proposal) - (len(text) - start)])
            return proposal
    return []


class DraftModel(Proposer):
    """A smaller model with the same tokenizer, decoding k tokens ahead of the model.

    Its own cache holds every token of the row but the newest `unfed` ones (the model's
    last token; after a step without proposals, the ones before it too; at the start, the
    prompt): propose() feeds those, then decodes from there one token per pass, with the
    loop's sampling settings (greedy proposes its argmax). After verification, accept()
    rolls its cache back to the proposals the model accepted, as the loop does with the
    model's. Its context may be shorter than the model's: when it is full, the draft starts
    again from the newest half of each row (proposals must be good guesses, not exact)."""

    def __init__(self, model):
        self.model = model
        self.context_len = model.config.context_len

    def start(self, prompts, sampling, vocab_limit, device, compile=False, stats=None):
        if self.model.config.vocab_size < vocab_limit:  # q must cover every token p does
            raise ValueError(f"the draft's vocabulary of {self.model.config.vocab_size} tokens "
                             f"is smaller than the model's {vocab_limit}")
        super().start(prompts, sampling, vocab_limit, device, compile, stats)
        self.drafted = None
        self.restart(keep=self.context_len)
        if compile:  # a step of one token that returns logits: proposals need q, not a draw
            self.compiled, seconds = compiled_step.compile_for(self.model, self.rows.cache)
            stats.compile_seconds += seconds

    def restart(self, keep):
        """Empty rows, and each row's last `keep` tokens to feed (left-padded)."""
        tokens, pad = left_pad([text[-keep:] for text in self.texts], self.context_len, self.device)
        cache = self.model.new_cache(tokens.size(0), pad=pad)
        if self.compile:  # the compiled step reads every column (masked): no NaN bits in them
            cache.kv.zero_()
        self.rows = Rows(cache, tokens.size(0), self.context_len, self.device)
        self.unfed = tokens

    def forward(self, tokens):
        """Logits (R, V) after feeding tokens (R, T) through the draft's cache."""
        self.stats.draft_passes += 1
        self.rows.record(tokens)
        if self.compile and tokens.size(1) == 1:
            return self.compiled.decode(tokens, self.rows.cache)[:, -1]
        return self.model(tokens, self.rows.cache, last_only=True)[0][:, -1]

    def propose(self, k):
        R, n = len(self.texts), min(k, self.context_len - 1)  # n: the drafts, k - n filler
        if n == 0:  # a draft with a context of one position has nothing to go on
            return Proposals(torch.zeros(R, k, dtype=torch.long, device=self.device),
                             torch.zeros(R, dtype=torch.long, device=self.device))
        if self.rows.length + self.unfed.size(1) + n > self.context_len:
            self.restart(keep=min(reprefill_keep(self.context_len), self.context_len - n))
        self.held = self.rows.length + self.unfed.size(1)  # columns before the drafts
        logits = self.forward(self.unfed)
        tokens = torch.zeros(R, k, dtype=torch.long, device=self.device)
        probs = None
        for i in range(n):
            logits = logits[:, :self.vocab_limit]
            if self.sampling["temperature"] == 0:
                token = sample(logits, temperature=0)[:, 0]
            else:
                if probs is None:
                    probs = torch.zeros(R, k, logits.size(-1), device=self.device)
                q = probabilities(logits, self.sampling["temperature"], self.sampling["top_k"],
                                  self.sampling["top_p"], self.sampling.get("min_p"))
                probs[:, i] = q / q.sum(dim=-1, keepdim=True)
                token = torch.multinomial(probs[:, i], 1, generator=self.sampling["generator"])[:, 0]
            tokens[:, i] = token
            if i < n - 1:  # the last draft is fed only if the model accepts it (accept())
                logits = self.forward(token[:, None])
        self.drafted = tokens[:, :n]
        return Proposals(tokens, torch.full((R,), n, device=self.device), probs)

    def accept(self, tokens, counts):
        super().accept(tokens, counts)
        newest = tokens.gather(1, (counts - 1)[:, None])           # (R, 1): the model's token
        if self.drafted is None:  # a step without proposals: one more token to feed
            self.unfed = torch.cat([self.unfed, newest], dim=1)
            return
        accepted = counts - 1                                       # (R,)
        if (accepted == self.drafted.size(1)).any():  # a row took every draft: feed the last
            self.forward(self.drafted[:, -1:])
        self.rows.rollback(self.held - self.rows.pad + accepted)
        self.unfed, self.drafted = newest, None

    def select_rows(self, index):
        super().select_rows(index)
        self.rows.select_rows(index)
        self.unfed = self.unfed[index]

    def describe(self):
        c = self.model.config
        return f"draft model ({self.model.num_params() / 1e6:.2f}M params, {c.n_layer} layers)"
