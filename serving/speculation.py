"""
Speculative decoding in the engine: a request proposes tokens from its own text, and the
batch's one pass checks them beside the rows that do not speculate.

A decode step reads every weight to make one token per row; on a CPU (or a GPU at small
batches) a few more rows cost little, since reading the weights, not the arithmetic, is
the cost. So a request that speculates (SamplingParams.speculate = K, or serve.py
--speculate K --prompt-lookup N for every request) gets, before a decode pass:

    1. propose  up to K tokens from prompt lookup (generation/speculative.py's
                PromptLookup, one per request): what followed its last up-to-N tokens the
                latest time they occurred, in its prompt or its text so far
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

from generation.speculative import PromptLookup


class Lookup:
    """A request's prompt lookup: a PromptLookup of one row that follows the request's
    tokens, and k, how many tokens it proposes next (1..most).

    k follows what the model accepts (transformers' "heuristic" schedule for assisted
    generation): 2 more after a step that took every proposal, 1 fewer after one that did
    not. Text that repeats keeps k at most; text that does not brings it down to one
    proposal a step, the cheapest guess, so that rows are not spent on what is rejected."""

    def __init__(self, most, max_ngram, prompt):
        self.most = self.k = most
        self.lookup = PromptLookup(max_ngram)
        self.lookup.start([prompt])

    def checked(self, proposed, accepted):
        self.k = min(self.most, self.k + 2) if accepted == proposed else max(1, self.k - 1)

    def propose(self, tokens, k):
        """Up to k tokens that followed the last n of tokens (the request's, with every
        token it was given since the last call), longest n first; [] when none did."""
        seen = self.lookup.texts[0]
        new = tokens[len(seen):]
        if new:
            self.lookup.accept(torch.tensor([new]), torch.tensor([len(new)]))
        proposals = self.lookup.propose(k)
        return proposals.tokens[0, :int(proposals.counts[0])].tolist()


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
