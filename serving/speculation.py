"""
Speculative decoding in the engine: a request proposes tokens from its own text, and the
batch's one pass checks them beside the rows that do not speculate.

A decode step reads every weight to make one token per row; on a CPU (or a GPU at small
batches) a few more rows cost little, since reading the weights, not the arithmetic, is
the cost. So a request that speculates (SamplingParams.speculate = K, or serve.py
--speculate K --prompt-lookup N for every request) gets, before a decode pass:

    1. propose  up to K tokens from prompt lookup (generation/speculative.py's
                PromptLookup, one per request): what followed its last up-to-N tokens the
                latest time they occurred, in its prompt or its text so far; or, where the
                engine has a draft model (serve.py --draft), the draft's greedy tokens (Draft)
    2. feed     its tokens get the proposals appended (Sequence.proposed), blocks for
                their positions (Scheduler.reserve_proposals); the pass feeds its newest
                token and the proposals, each a row of its own (decode_index.fed_rows), in
                the same pass as every other row's one token
    3. check    the model runner checks them with speculative.check, the rule generate.py's
                speculative step uses: greedy keeps what the argmax agrees with, sampling
                keeps the model's own distribution exactly
    4. roll     the scheduler drops the proposals from its tokens, and the blocks past the
       back     accepted ones' keys (Scheduler.rollback); the engine hands the accepted
                tokens and the model's next one out one at a time (stop strings, max_tokens,
                streaming: as if each came from a step of its own)

Proposals cost rows, and a large batch has none to spare: a pass gets at most max_batch
rows (the compiled step's draw buffer), the one-token rows first, and proposals fill what
is left, oldest request first. A full batch of 64 speculates not at all (its step costs
what it did without speculation); the last few requests of a workload, or one request
alone, speculate, each at its Lookup's k.
"""

import torch

from generation.loop import reprefill_keep
from generation.speculative import PromptLookup
from sample import sample


class Proposer:
    """What a request's proposer (its `lookup`) shares: k, how many tokens it proposes next
    (1..most), following what the model accepts (transformers' "heuristic" schedule for
    assisted generation): 2 more after a step that took every proposal, 1 fewer after one
    that did not. Text that the proposer guesses keeps k at most; text it does not brings it
    down to one proposal a step, the cheapest guess, so that rows are not spent on what is
    rejected. propose(tokens, k): up to k tokens to follow tokens (the request's own)."""

    def __init__(self, most):
        self.most = self.k = most

    def checked(self, proposed, accepted):
        self.k = min(self.most, self.k + 2) if accepted == proposed else max(1, self.k - 1)


class Lookup(Proposer):
    """A request's prompt lookup: a PromptLookup of one row that follows the request's tokens."""

    def __init__(self, most, max_ngram, prompt):
        super().__init__(most)
        self.lookup = PromptLookup(max_ngram)
        self.lookup.start([prompt])

    def propose(self, tokens, k):
        """Up to k tokens that followed the last n of tokens (the request's, with every
        token it was given since the last call), longest n first; [] when none did."""
        seen = self.lookup.texts[0]
        new = tokens[len(seen):]
        if new:
            self.lookup.accept(torch.tensor([new]), torch.tensor([len(new)]))
        proposals = self.lookup.propose(k)
        return proposals.tokens[0, :int(proposals.counts[0])].tolist()


class Draft(Proposer):
    """A request's draft model (serve.py --draft): a smaller model with the model's
    tokenizer, over a dense cache of its own holding the request's text, proposing its k
    greedy tokens. Its proposals are a function of the text, as prompt lookup's are, so the
    check (speculative.check, each proposal's q a point mass) keeps the model's distribution
    exactly for greedy and sampled requests alike; a sampled request accepts fewer of them
    (the draft's argmax is not the model's draw). After a check the cache keeps what it
    shares with the request's text (the accepted proposals) and feeds the rest. Past the
    draft's context it starts again from the text's newest part (a proposal must be a good
    guess, not exact). The cache is the draft's context of one row: a few MB for the bundled
    draft, freed with the request."""

    def __init__(self, model, most, vocab_limit):
        super().__init__(most)
        self.model, self.vocab_limit = model, vocab_limit
        self.context_len = model.config.context_len
        self.cache, self.start, self.held = None, 0, []  # held: the tokens the cache's columns are

    @torch.no_grad()
    def propose(self, tokens, k):
        k = min(k, self.context_len - 1)
        if k <= 0:
            return []
        if len(tokens) - self.start + k > self.context_len:  # the draft's context is full
            self.start = len(tokens) - min(reprefill_keep(self.context_len), self.context_len - k)
            self.cache = None
        text = tokens[self.start:]
        if self.cache is None:
            self.cache, self.held = self.model.new_cache(1), []
        # the columns the text still has; the newest token is fed again for its logits
        kept = min(shared_prefix(self.held, text), len(text) - 1)
        self.cache.length = kept
        logits = self.forward(text[kept:])
        proposals = []
        for i in range(k):
            proposals.append(int(sample(logits[:, :self.vocab_limit], temperature=0)[0, 0]))
            if i < k - 1:  # the last proposal is fed only once it is accepted
                logits = self.forward(proposals[-1:])
        self.held = text + proposals[:-1]
        return proposals

    def forward(self, tokens):
        """The draft's logits (1, V) after feeding tokens (a list) into its cache."""
        ids = torch.tensor([tokens], device=self.cache.kv.device)
        return self.model(ids, self.cache, last_only=True)[0][:, -1]


def shared_prefix(a, b):
    """How many leading tokens the lists a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def add_proposals(batch, scheduler):
    """Give each speculating request of batch its proposals for this pass (appended to its
    tokens, counted in its `proposed`), within max_batch rows in all; returns how many."""
    room = scheduler.max_batch - len(batch)  # every sequence is a row already
    total = 0
    for request in batch:
        if room <= 0:
            break
        if (request.lookup is None or request.score_prompt or request.unfed
                or request.num_cached != request.context_len - 1):
            continue  # not speculating, or not decoding: its pass feeds more than its newest token
        # none past max_tokens (the checked pass gives one more), none past the context
        k = min(request.lookup.k, room, request.params.max_tokens - request.num_generated - 1,
                scheduler.context_len - request.context_len)
        proposal = request.lookup.propose(request.tokens, k) if k > 0 else []
        if proposal and scheduler.reserve_proposals(request, len(proposal)):
            request.tokens += proposal
            request.proposed = len(proposal)
            room -= len(proposal)
            total += len(proposal)
    return total
