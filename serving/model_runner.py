"""
The model runner: one pass of the model over a batch of sequences, and the token each one
draws.

    run(batch)   1. forward: the logits of each sequence's last token, by one of three routes
                 2. draw:    one token per sequence, each with its own settings; a sequence
                             with proposals (speculative decoding, serving/speculation.py)
                             has them checked instead: its accepted ones and one more
                 3. the log-probabilities of the new tokens, for the requests that ask

The routes of forward, the first that takes the batch:

    lone step      one request decoding alone (with compile, or IF_CACHED where its build
                   is cached, or once serve.py's background build has cached it:
                   background_build.py; over a pool in the model's dtype): generation/compiled_step.py's
                   static step on a dense cache of one row (lone_step.py)
    compiled step  a decode pass, and with compile a short prefill fed one row per token
                   (attention "kernel"): paged_attention.py's step, compiled whole, its
                   index tensors kept from step to step (decode_index.py)
    eager forward  anything else (long prefills, a prompt scored, attention "gather"): the
                   unchanged forward of the cached model (KVCacheGPT or KVCacheLlama) with a
                   PagedCache (paged_cache.py) as its cache

The draw is one path: the batch's Gumbel draw (sample.sample_rows_with_noise), which the
compiled step makes inside its graph and the others here; then the requests that draw alone
(a seed, top-k, top-p or min-p: Request.draws_alone) are drawn again by sample.sample, a
request with logits processors (penalties, bias, bans, a grammar) from its own processed
logits (Request.processing).
"""

import torch

from generation.compiled_step import NotCached
from generation.cpu_layout import unpack_linears
from generation.logits_processors import RowsProcessing
from generation.speculative import Proposals, check
from sample import sample, sample_rows_with_noise
from serving.decode_index import DecodeIndex, column_slots, fed_rows
from serving.lone_step import LoneStep
from serving.paged_attention import compiled_decode_step
from serving.paged_cache import NULL_BLOCK, PagedCache
from serving.requests import Logprob

# the most columns a prefill fed as rows of the compiled step may read, all rows together
# (ModelRunner.fits_compiled_step): a prefix hit of 16 tokens over 200 reads 3,300
ROW_COLUMNS = 4096


def log_probabilities(logits, tokens, tops):
    """A Logprob for each row of logits (N, V): of tokens[i], with the tops[i] likeliest
    tokens. log_softmax in float32, whatever the model's dtype, as a direct forward scores."""
    if not tokens:
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)                             # (N, V)
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    values, ids = logp.topk(min(max(tops), logp.size(1)))                        # (N, k)
    values, ids = values.tolist(), ids.tolist()
    return [Logprob(t, c, list(zip(i[:k], v[:k])))
            for t, c, i, v, k in zip(tokens, chosen, ids, values, tops)]


# compile's third value, beside True (build what is missing) and False (eager steps, the
# paged kernel's aside): the lone step where its build is in the cache (generation/step_cache.py),
# so that a start costs no build; the batch's steps as without compile
IF_CACHED = "if cached"


def decodes_alone(batch):
    """One request, feeding one token (its newest; nothing to score): a decode step, or
    a prompt whose every token was found in the prefix cache (its last is fed again
    for its logits). Any other batch of one would be a graph of its own for the
    compiled batch step: built on first use, seconds to minutes of stall."""
    (request, *others) = batch
    return not others and not request.score_prompt and request.num_fed == 1


def lone_step(model, pool, vocab_limit, build_missing):
    """The LoneStep, or None where build_missing is False and its build is not cached."""
    try:
        return LoneStep(model, pool, vocab_limit, build_missing)
    except NotCached:
        return None


class ModelRunner:
    def __init__(self, model, pool, vocab_limit, max_batch, attention="kernel", compile=False):
        """vocab_limit: the tokenizer's tokens (the embedding table may have padding rows
        past them, which are never drawn). attention and compile: Engine's."""
        self.model, self.pool, self.vocab_limit = model, pool, vocab_limit
        self.device = model.lm_head.weight.device
        self.compiled_decode = attention == "kernel"
        if self.compiled_decode or compile:  # graphs read the dense weights: none stays packed
            unpack_linears(model)
        # the lone step's dense cache is the model's dtype: a pool stored otherwise (kv_dtype)
        # has its lone requests decoded by the batch's step
        lone = compile and pool.kv.dtype == model.lm_head.weight.dtype
        self.lone = lone_step(model, pool, vocab_limit, build_missing=compile is True) if lone else None
        self.frozen = compile is True
        self.lone_build = None  # serving/background_build.py's child, building the lone step
        self.lone_steps = self.compiled_prefills = 0
        self.index = DecodeIndex(pool.tokens_per_block, self.device)
        # Gumbel noise of the batch's draw (sample.sample_rows_with_noise), refilled each step
        # that samples: a buffer, so that a greedy batch touches none of it
        self.noise = torch.ones(max_batch, model.config.vocab_size, device=self.device)

    def run(self, batch):
        """One pass over batch: each sequence's new tokens (a list: the token it draws, or
        after its proposals were checked, the accepted ones and the model's next) and their
        Logprobs (None unless the request asks), but for a prompt fed in part (its `unfed`
        tokens wait for later chunks), which draws nothing: its logits are not the next
        token's, and a seeded request's generator must not move. A request scoring its
        prompt has its prompt_logprobs."""
        logits, drawn, checked = self.forward(batch)
        rows = [i for i, s in enumerate(batch) if not s.unfed]
        if len(rows) < len(batch):  # a prefill pass: none of its rows has proposals
            logits, drawn = logits[rows], None if drawn is None else drawn[rows]
            batch = [batch[i] for i in rows]
            if not batch:
                return [], []
        tokens = self.draw(logits, batch, drawn)
        logprobs = self.token_logprobs(logits, tokens, batch)
        new = [([token], [logprob]) for token, logprob in zip(tokens.tolist(), logprobs)]
        for row, fed_logits in checked.items():
            new[row] = self.check_proposals(fed_logits, batch[row])
        return [tokens for tokens, _ in new], [logprobs for _, logprobs in new]

    # ------------------------------------------------------------------ 1. forward

    def forward(self, batch):
        """Feed every sequence its tokens not yet cached: the logits (B, V) of each
        sequence's last token, the tokens (B,) drawn inside a compiled step (None: draw
        makes them), and {row: logits (1 + proposed, V)} at every fed position of each
        sequence with proposals."""
        if self.lone is None and self.lone_build is not None and decodes_alone(batch):
            self.take_built_lone_step()
        if self.lone is not None and decodes_alone(batch):
            return self.forward_lone(batch[0])
        if self.compiled_decode and self.fits_compiled_step(batch):
            return self.forward_compiled(batch)
        return self.forward_eager(batch)

    def take_built_lone_step(self):
        """The lone step, loaded from the cache once lone_build (a BackgroundBuild) has built
        it there; nothing while it builds, or where it failed."""
        built = self.lone_build.finished()
        if built is not None:
            self.lone_build = None
            if built:
                self.lone = lone_step(self.model, self.pool, self.vocab_limit, build_missing=False)

    def forward_lone(self, request):
        """The lone step; its greedy pick is the token of a greedy request (nothing runs
        after the step), a request that samples is drawn from the logits."""
        self.lone_steps += 1
        logits, greedy = self.lone.decode(request)
        return logits, greedy if request.params.temperature == 0 and not request.draws_alone else None, {}

    def fits_compiled_step(self, batch):
        """Nothing to score (its every position's logits are the eager forward's), and: a
        decode pass; or, with compile, a pass whose every fed token can be a row of the
        compiled step: at most max_batch of them (the rows the draw's noise buffer has),
        reading at most ROW_COLUMNS columns together. Each row reads its whole context,
        where an eager prefill's attention reads it once for all its tokens: a few rows over
        a short context is what gains (a prefix hit's last tokens, a short prompt). Without
        compile the step's matmuls are MKL's, and a prefix hit's 16 rows ran slower through
        it than eagerly (16.4 against 14.4 ms). And some row reads more than one column (a
        pass over one column only, a one-token prompt's prefill, would be a graph more:
        Engine.warm_up)."""
        if any(s.score_prompt for s in batch):
            return False
        fed = [s.num_fed for s in batch]
        if sum(fed) > self.noise.size(0):
            return False
        # proposals are rows as the decode rows are: each reads its whole context
        # (serving/speculation.py keeps a pass within max_batch rows)
        if max(n - s.proposed for n, s in zip(fed, batch)) > 1:  # a prefill
            if not self.frozen:
                return False
            # the fed row at position p reads p + 1 columns
            columns = sum(n * s.context_len - n * (n - 1) // 2 for n, s in zip(fed, batch))
            if columns > ROW_COLUMNS:
                return False
        return max(s.context_len for s in batch) > 1

    def forward_compiled(self, batch):
        """A pass through the compiled step, which draws the batch's tokens too. A decode
        pass's rows are its sequences, their index kept from the last step (DecodeIndex); a
        pass that feeds a sequence several tokens (a short prompt, a prefix hit's last
        tokens) feeds each as a row of its own (decode_index.fed_rows) and keeps each
        sequence's last row. That is what a short prefill gains: a prefix hit's 16 tokens
        over 192 cached columns took 8.2 ms on the bundled model, 12.9 eagerly
        (docs/serving.md)."""
        temperature, noise = self.draw_inputs(batch)
        if all(s.num_fed == 1 for s in batch):
            (tokens, positions, read_slots, write_slots, visible), last = self.index.update(batch), None
        else:
            (tokens, positions, read_slots, write_slots, visible), last = fed_rows(
                batch, self.pool.tokens_per_block, self.device)
            temperature, noise = self.draw_at_rows(temperature, noise, last, len(tokens))
            self.compiled_prefills += 1
        logits, drawn = compiled_decode_step(self.model, tokens, positions, self.pool.kv, read_slots,
                                             write_slots, visible, temperature, noise,
                                             freeze=self.frozen, fmt=self.pool.format)
        if last is None:
            return logits, drawn, {}
        checked = {row: logits[end - s.proposed:end + 1]  # a sequence's rows end at its last
                   for row, (s, end) in enumerate(zip(batch, last.tolist())) if s.proposed}
        return logits[last], drawn[last], checked

    def draw_at_rows(self, temperature, noise, last, num_rows):
        """The batch's draw (a row per sequence) moved to each sequence's last row of a pass
        of num_rows; the other rows' tokens are not kept, so they draw greedily. The noise is
        the same a pass of a row per sequence draws: the same seed, the same tokens."""
        rows_temperature = torch.zeros(num_rows, device=self.device).index_copy_(0, last, temperature)
        rows_noise = self.noise[:num_rows, :noise.size(1)]  # the buffer's rows: the graph's strides
        rows_noise[last] = noise.clone()  # (the rows overlap the batch's: copied first)
        return rows_temperature, rows_noise

    def forward_eager(self, batch):
        """The model's own forward with a PagedCache. Only the last position's logits are
        computed (which spares a (T x vocab) matmul) unless a sequence scores its prompt."""
        tokens, cache = self.prepare(batch)
        scoring = any(s.score_prompt for s in batch)
        every_position = scoring or any(s.proposed for s in batch)
        logits = self.model(tokens, cache, last_only=not every_position)[0]      # (B, T or 1, V)
        if scoring:
            self.score_prompts(logits, batch)
        checked = {row: logits[row, -1 - s.proposed:] for row, s in enumerate(batch) if s.proposed}
        return logits[:, -1], None, checked

    def prepare(self, batch):
        """The eager pass's input tokens (B, T) and its PagedCache.

        Rows are right-aligned (decode_index.column_slots): S columns, the longest context;
        the last T columns are fed, T = the most uncached tokens of any row. A row with
        fewer feeds some cached tokens again (so does a prompt being scored, whose every
        position's logits are needed); their writes go to the null block."""
        feed = [s.num_fed for s in batch]
        T, S = max(feed), max(s.context_len for s in batch)
        positions, slots = column_slots(batch, S, self.pool.tokens_per_block)     # (B, S) each
        pad = (positions < 0).sum(dim=1)                                           # (B,)
        cached = torch.tensor([s.num_cached for s in batch])
        write = torch.where(positions[:, S - T:] >= cached[:, None], slots[:, S - T:], NULL_BLOCK)
        tokens = [[0] * max(0, T - s.context_len) + s.tokens[max(s.start, len(s.tokens) - T):]
                  for s in batch]
        cache = PagedCache(self.pool, slots.to(self.device), write.flatten().to(self.device),
                           pad.to(self.device) if pad.any() else None, length=S - T)
        return torch.tensor(tokens, device=self.device), cache

    def score_prompts(self, logits, batch):
        """request.prompt_logprobs for the prompts scored in this pass, from the logits
        (B, T, V) of every fed position. A scored prompt of L tokens was fed whole,
        right-aligned: its position p is column T - L + p, and predicts token p + 1."""
        T = logits.size(1)
        for row, r in enumerate(batch):
            if r.score_prompt:
                L = r.context_len
                rows = logits[row, T - L:T - 1, :self.vocab_limit]                # (L - 1, V)
                r.prompt_logprobs = [None] + log_probabilities(
                    rows, r.tokens[1:L], [r.params.prompt_logprobs] * (L - 1))

    # ------------------------------------------------------------------ 2. draw

    def draw_inputs(self, batch):
        """What the batch's draw takes (sample.sample_rows_with_noise): each row's
        temperature (B,), and Gumbel noise (B, V), fresh when some row samples."""
        temperature = torch.tensor([r.params.temperature for r in batch], dtype=torch.float32,
                                   device=self.device)
        noise = self.noise[:len(batch), :self.vocab_limit]  # the tokenizer's tokens
        if any(r.params.temperature > 0 and not r.draws_alone for r in batch):
            # -log(E) with E = -log(U) ~ Exp(1): torch's exponential_ is ~3x slower on this
            # CPU than uniform_ and a log (64 x 4096: 8.3 ms with it, 2.5 ms without)
            noise.uniform_().log_().neg_().log_().neg_()
        return temperature, noise

    def draw(self, logits, batch, drawn=None):
        """One token per row, (B,): the batch's draw (drawn: already made inside a compiled
        step, the batch's or the lone step's greedy pick), except for the requests that draw
        alone (Request.draws_alone), each group of the same settings drawn together by
        sample(), a seeded request from its generator."""
        logits = logits[:, :self.vocab_limit]  # padding rows of the embedding table
        tokens = drawn
        if tokens is None:
            temperature, noise = self.draw_inputs(batch)
            tokens = sample_rows_with_noise(logits, noise, temperature)
        groups = {}
        for row, r in enumerate(batch):
            if r.proposed:  # its tokens come from check_proposals
                continue
            if r.processing is not None:
                tokens[row] = self.draw_processed(logits[row:row + 1], r)
            elif r.draws_alone:
                p = r.params
                key = (p.temperature, p.top_k, p.top_p, p.min_p, id(r.generator) if r.generator else None)
                groups.setdefault(key, (r.generator, []))[1].append(row)
        for (temperature, top_k, top_p, min_p, _), (generator, rows) in groups.items():
            rows = torch.tensor(rows, device=logits.device)
            tokens[rows] = sample(logits[rows], temperature, top_k, top_p, generator, min_p)[:, 0]
        return tokens

    def draw_processed(self, logits, request):
        """A request with logits processors: its token from its processed logits (1, V), or
        -1 when they leave it none (Engine.emit ends it)."""
        logits = request.processing(logits)
        if torch.isneginf(logits).all():
            return -1
        p = request.params
        return int(sample(logits, p.temperature, p.top_k, p.top_p, request.generator, p.min_p)[0, 0])

    def check_proposals(self, logits, request):
        """A sequence's proposals checked against its logits (1 + k, V) at every fed position
        (its newest token and each proposal) by speculative.check, generate.py's rule: the
        accepted proposals and the model's next token (-1: its processors leave it none),
        and their Logprobs (None unless asked)."""
        p = request.params
        k = request.proposed
        logits = logits[:, :self.vocab_limit]
        proposals = Proposals(torch.tensor([request.tokens[-k:]], device=self.device),
                              torch.tensor([k], device=self.device))
        sampling = dict(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                        generator=request.generator, min_p=p.min_p)
        processing = None if request.processing is None else RowsProcessing([request.processing])
        tokens, counts = check(logits[None], proposals, sampling, processing)
        tokens = tokens[0, :int(counts[0])]
        logprobs = [None] * len(tokens)
        if p.logprobs is not None:
            taken = int((tokens >= 0).sum())  # (a token < 0: the request ends without one)
            logprobs[:taken] = log_probabilities(logits[:taken], tokens[:taken].tolist(),
                                                 [p.logprobs] * taken)
        return tokens.tolist(), logprobs

    # ------------------------------------------------------------------ 3. log-probabilities

    def token_logprobs(self, logits, tokens, batch):
        """A Logprob of each row's new token for the rows that asked for one, else None."""
        rows = [i for i, r in enumerate(batch)  # (a token < 0: the request ends without one)
                if r.params.logprobs is not None and int(tokens[i]) >= 0 and not r.proposed]
        found = [None] * len(batch)
        if rows:
            wanted = log_probabilities(logits[rows, :self.vocab_limit], tokens[rows].tolist(),
                                       [batch[i].params.logprobs for i in rows])
            for i, logprob in zip(rows, wanted):
                found[i] = logprob
        return found
