"""
The engine: requests in, tokens out, many requests at once on one model.

    engine = Engine(model, tokenizer)
    request = engine.add_request(prompt_ids, SamplingParams(max_tokens=50), on_output)
    engine.run_until_done() # or engine.run(): the step loop, waiting for more requests
                            # (from other threads) until engine.stop()

Work enters only through submit (add_request is submit of one), which first holds it to
the admission limits (admission.py): what one request may ask, and how much may wait.

Every step asks the scheduler (scheduler.py) which sequences run, feeds them through the
unchanged forward of the cached model (KVCacheGPT or KVCacheLlama) with a PagedCache
(paged_cache.py) as their cache, samples one token per sequence with its own settings, and
hands each request its new text. A decode step goes through the compiled step instead
(paged_attention.py), its index tensors kept from step to step (decode_index.py) and the
tokens drawn inside it; with compile, so does a short prefill, each token a row. The HTTP
server (server.py) and the serving benchmark (benchmarks/serving.py) are two callers of
this one loop.
"""

import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass

import torch

from kv_quant import cache_bytes, dtype_name
from sample import check_sampling_args, sample, sample_rows_with_noise
from serving.admission import Limits
from serving.decode_index import DecodeIndex, column_slots, fed_rows
from serving.lone_step import LoneStep
from serving.paged_attention import compiled_decode_step
from serving.paged_cache import NULL_BLOCK, BlockPool, PagedCache
from serving.scheduler import FINISHED, Scheduler, Sequence
from plumbing.text_stream import SampleText


# the most columns a prefill fed as rows of the compiled step may read, all rows together
# (Engine.fits_compiled_step): a prefix hit of 16 tokens over 200 reads 3,300
ROW_COLUMNS = 4096


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks for. The names are vLLM's."""
    max_tokens: int = 16      # 0: the prefill only (to score the prompt, or cache it)
    temperature: float = 1.0
    top_k: int = None
    top_p: float = None
    seed: int = None          # its own torch.Generator: the same seed, the same text
    stop: tuple = ()          # strings that end the text (not included in it)
    stop_token_ids: tuple = ()  # tokens that end it (a chat template's end of turn), always
    stop_at_eot: bool = True  # False: the end-of-text token does not end it (benchmarks)
    logprobs: int = None      # each new token's log-probability and the `logprobs` likeliest
    prompt_logprobs: int = None  # the same for every prompt token but the first

    def check(self):
        check_sampling_args(self.temperature, self.top_k, self.top_p)
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("a stop string must not be empty")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass
class Logprob:
    """A token's log-probability under the model (its raw distribution: before temperature,
    top-k or top-p, as vLLM reports it) and the `top` likeliest tokens, [(token, logprob)]."""
    token: int
    logprob: float
    top: list


@dataclass
class Output:
    """What one step gave a request: the new text (held back while it may still become a
    stop string or half a character), the token, its Logprob (when asked for), and why it
    ended, when it did: "stop" (end of text, a stop token or string), "length"
    (max_tokens), "cancelled", "error"."""
    text: str
    token: int = None
    finish_reason: str = None
    logprob: Logprob = None


class Request(Sequence):
    """A sequence plus what the caller asked for and what it has been given."""

    def __init__(self, prompt, params, on_output, tokenizer, device):
        super().__init__(prompt)
        self.params, self.on_output = params, on_output
        self.text = SampleText(tokenizer, list(params.stop), params.stop_at_eot,
                               params.stop_token_ids)
        self.score_prompt = params.prompt_logprobs is not None
        self.prompt_logprobs = None  # [None, Logprob of token 1, ...] once the prefill ran
        self.shown = 0  # characters of text handed out
        self.generator = (None if params.seed is None else
                          torch.Generator(device=device).manual_seed(params.seed))
        self.finish_reason, self.error = None, None
        self.arrival_time = time.perf_counter()
        self.token_times = []  # when each token was handed out (for the benchmark)

    @property
    def num_generated(self):
        return len(self.tokens) - self.prompt_len

    @property
    def draws_alone(self):
        """Drawn by sample() with its own settings, not in the batch's draw: a seeded request
        (its generator must give the text generate() gives the seed) or one with top-k or
        top-p (they sort the vocabulary, which the batch should not pay for every row)."""
        p = self.params
        return p.temperature > 0 and (self.generator is not None or p.top_k is not None
                                      or (p.top_p is not None and p.top_p < 1))


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


DEFAULT_POOL_BYTES = 1 << 30


def default_num_blocks(config, tokens_per_block, max_batch, kv_dtype):
    """Room for max_batch sequences at the full context, or DEFAULT_POOL_BYTES (1 GiB),
    whichever is less. The pool is a ceiling: what a sequence holds follows its real
    length, so a pool a fraction of max_batch full contexts still runs max_batch
    sequences of ordinary length (and preempts when they grow too long), and blocks
    nobody holds keep their contents for prefix hits."""
    block_bytes = cache_bytes(config, tokens_per_block, 1, kv_dtype)
    per_context = -(-config.context_len // tokens_per_block)
    return max(min(max_batch * per_context, DEFAULT_POOL_BYTES // block_bytes), per_context)


def check_pool_fits(config, num_blocks, tokens_per_block, kv_dtype):
    """Refuse, before allocating it, a pool larger than the memory left (ValueError)."""
    from plumbing.validation import available_memory, format_bytes  # the loaders' memory rule
    needed = cache_bytes(config, (num_blocks + 1) * tokens_per_block, 1, kv_dtype)  # + the null block
    available = available_memory()
    if needed > available:
        raise ValueError(f"a pool of {num_blocks:,} blocks of {tokens_per_block:,} positions would "
                         f"need {format_bytes(needed)} of memory; {format_bytes(available)} is available")


class Engine:
    def __init__(self, model, tokenizer, num_blocks=None, tokens_per_block=16, max_batch=64,
                 max_prefill_tokens=2048, attention="kernel", limits=None, compile=False):
        """num_blocks: the pool's size (default_num_blocks by default); when it runs out,
        the scheduler preempts.
        attention: how decode steps run, "kernel" (paged_attention.py: the step compiled
        whole, the paged kernel inside it; compiled at the first decode steps) or "gather"
        (eager, plain PyTorch: the pool gathered for SDPA; paged_cache.py compares).
        limits: admission.Limits (default: its defaults).
        compile: a request decoding alone goes through the compiled step (lone_step.py),
        built here (seconds to minutes, and a copy of the weights); the decode step of a
        batch is compiled with the weights frozen into it and its matmuls tuned
        (paged_attention.py), and short prefills go through it too, each token a row.
        Both hold the weights as they were: change none while the engine serves."""
        if attention not in ("kernel", "gather"):
            raise ValueError(f"attention must be 'kernel' or 'gather', got {attention!r}")
        self.model, self.tokenizer = model, tokenizer
        self.limits = Limits() if limits is None else limits
        self.compiled_decode = attention == "kernel"
        config, weight = model.config, model.lm_head.weight
        self.device = weight.device
        if num_blocks is None:
            num_blocks = default_num_blocks(config, tokens_per_block, max_batch,
                                            dtype_name(weight.dtype))
        check_pool_fits(config, num_blocks, tokens_per_block, dtype_name(weight.dtype))
        self.pool = BlockPool(config, num_blocks, tokens_per_block, self.device, weight.dtype)
        self.scheduler = Scheduler(self.pool, config.context_len, max_batch, max_prefill_tokens)
        self.lone = LoneStep(model, self.pool, tokenizer.n_vocab) if compile else None
        self.lone_steps = self.compiled_prefills = 0
        self.index = DecodeIndex(tokens_per_block, self.device)
        # Gumbel noise of the batch's draw (sample.sample_rows_with_noise), refilled each step
        # that samples: a buffer, so that a greedy batch touches none of it
        self.noise = torch.ones(max_batch, config.vocab_size, device=self.device)
        self.inbox, self.cancelled = deque(), deque()  # from other threads (deque is thread-safe)
        self.admitting = threading.Lock()  # one submit at a time: the queue's bound holds
        self.wakeup = threading.Condition()
        self.thread, self.stopping = None, False
        self.peak_blocks, self.steps = 0, 0

    # ------------------------------------------------------------------ the caller's side
    # (any thread)

    def submit(self, prompts, samples, on_output=lambda request, output: None):
        """Queue one caller's request: every prompt (token ids) sampled with each
        SamplingParams of samples, all or nothing. Returns the Requests, prompt-major
        (prompt i's sample j is [i * len(samples) + j]); on_output(request, Output) is called
        from the engine's thread for every token, the last one with a finish_reason.

        Raises ValueError for a bad prompt or setting, admission.RequestTooLarge past a
        per-request limit and admission.Overloaded when the waiting queue is full, in each
        case before anything is queued."""
        for params in samples:
            params.check()
        context_len = self.model.config.context_len
        for prompt in prompts:
            if not 1 <= len(prompt) <= context_len:
                raise ValueError(f"a prompt must have 1 to {context_len} tokens "
                                 f"(the model's context), got {len(prompt)}")
        self.limits.check_request(prompts, samples)
        with self.admitting:
            self.limits.check_room(self.num_waiting(), len(prompts) * len(samples))
            requests = [Request(prompt, params, on_output, self.tokenizer, self.device)
                        for prompt in prompts for params in samples]
            self.inbox.extend(requests)
        self.notify()
        return requests

    def add_request(self, prompt, params, on_output=lambda request, output: None):
        """submit() of one prompt and one sample: the Request."""
        return self.submit([prompt], [params], on_output)[0]

    def num_waiting(self):
        """Sequences queued for a place in the batch (new, or preempted)."""
        return len(self.inbox) + len(self.scheduler.waiting)

    def cancel(self, request):
        """Stop a request (its client went away): its blocks are freed at the next step."""
        self.cancelled.append(request)
        self.notify()

    def notify(self):
        with self.wakeup:
            self.wakeup.notify()

    def has_work(self):
        return bool(self.inbox or self.cancelled or self.scheduler.has_work())

    # ------------------------------------------------------------------ one step

    @torch.inference_mode()
    def step(self):
        """Admit or decode once; returns False when there was nothing to do."""
        while self.inbox:
            self.scheduler.add(self.inbox.popleft())
        while self.cancelled:
            self.finish(self.cancelled.popleft(), "cancelled")
        batch = self.scheduler.schedule()
        if not batch:
            return False
        self.peak_blocks = max(self.peak_blocks, self.pool.num_used())
        logits, every_position, tokens = self.forward(batch)
        if every_position is not None:
            self.score_prompts(every_position, batch)
        self.scheduler.computed(batch)
        tokens = self.sample(logits, batch, tokens)
        logprobs = self.token_logprobs(logits, tokens, batch)
        for request, token, logprob in zip(batch, tokens.tolist(), logprobs):
            if request.params.max_tokens == 0:  # the prefill was all it asked for
                request.text.done = True
                self.deliver(request, None, "length")
            else:
                self.emit(request, token, logprob)
        self.steps += 1
        return True

    def forward(self, batch):
        """Feed every sequence its tokens not yet cached, in one pass: the logits (B, V) of
        each sequence's last token; those of every fed position (B, T, V) when a sequence
        of the batch scores its prompt (else None: only the last position's are computed,
        which spares a (T x vocab) matmul); the tokens (B,) drawn inside a compiled step
        (the lone step's greedy pick, for a greedy request), else None.

        Three ways: a request decoding alone, through the lone step (with compile); a decode
        pass, and with compile a short prefill, through the compiled step, one row per token
        (attention "kernel"); anything else (long prefills, a prompt scored, "gather"),
        through the model's eager forward with a PagedCache."""
        if self.lone is not None and self.decodes_alone(batch):
            self.lone_steps += 1
            logits, greedy = self.lone.decode(batch[0])
            return logits, None, greedy if batch[0].params.temperature == 0 else None
        every = any(s.score_prompt for s in batch)
        if self.compiled_decode and not every and self.fits_compiled_step(batch):
            logits, tokens = self.run_compiled(batch)
            return logits, None, tokens
        tokens, cache = self.prepare(batch)
        logits = self.model(tokens, cache, last_only=not every)[0]
        return logits[:, -1], logits if every else None, None

    def fits_compiled_step(self, batch):
        """A decode pass; or, with compile, a pass whose every fed token can be a row of the
        compiled step: at most max_batch of them (the rows the draw's noise buffer has),
        reading at most ROW_COLUMNS columns together. Each row reads its whole context,
        where an eager prefill's attention reads it once for all its tokens: a few rows over
        a short context is what gains (a prefix hit's last tokens, a short prompt). Without
        compile the step's matmuls are MKL's, and a prefix hit's 16 rows ran slower through
        it than eagerly (16.4 against 14.4 ms). And some row reads more than one column (a
        pass over one column only, a one-token prompt's prefill, would be a third graph:
        warm_up)."""
        fed = [s.num_fed for s in batch]
        if max(fed) > 1:  # a prefill
            if self.lone is None:
                return False
            # the fed row at position p reads p + 1 columns
            columns = sum(n * s.context_len - n * (n - 1) // 2 for n, s in zip(fed, batch))
            if sum(fed) > self.noise.size(0) or columns > ROW_COLUMNS:
                return False
        return max(s.context_len for s in batch) > 1

    def run_compiled(self, batch):
        """A pass through the compiled step: the logits (B, V) of each sequence's last token
        and the token (B,) drawn for it. A decode pass's rows are its sequences, their index
        kept from the last step (DecodeIndex); a pass that feeds a sequence several tokens
        (a short prompt, a prefix hit's last tokens) feeds each as a row of its own
        (decode_index.fed_rows) and keeps each sequence's last row.

        What it buys: the pass of a prefix hit's 16 tokens over 192 cached columns took 8.2
        ms on the bundled model, 12.9 eagerly (docs/serving.md, round 6)."""
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
                                             freeze=self.lone is not None)
        return (logits, drawn) if last is None else (logits[last], drawn[last])

    def draw_at_rows(self, temperature, noise, last, num_rows):
        """The batch's draw (a row per sequence) moved to each sequence's last row of a pass
        of num_rows; the other rows' tokens are not kept, so they draw greedily. The noise is
        the same a pass of a row per sequence draws: the same seed, the same tokens."""
        rows_temperature = torch.zeros(num_rows, device=self.device).index_copy_(0, last, temperature)
        rows_noise = self.noise[:num_rows, :noise.size(1)]  # the buffer's rows: the graph's strides
        rows_noise[last] = noise.clone()  # (the rows overlap the batch's: copied first)
        return rows_temperature, rows_noise

    @staticmethod
    def decodes_alone(batch):
        """One request, feeding one token (its newest; nothing to score): a decode step, or
        a prompt whose every token was found in the prefix cache (its last is fed again
        for its logits). Any other batch of one would be a graph of its own for the
        compiled batch step: built on first use, seconds to minutes of stall."""
        (request, *others) = batch
        return not others and not request.score_prompt and request.num_fed == 1

    def score_prompts(self, logits, batch):
        """request.prompt_logprobs for the prompts scored in this pass, from the logits
        (B, T, V) of every fed position. A scored prompt of L tokens was fed whole,
        right-aligned: its position p is column T - L + p, and predicts token p + 1."""
        T = logits.size(1)
        for row, r in enumerate(batch):
            if r.score_prompt:
                L = r.context_len
                rows = logits[row, T - L:T - 1, :self.tokenizer.n_vocab]         # (L - 1, V)
                r.prompt_logprobs = [None] + log_probabilities(
                    rows, r.tokens[1:L], [r.params.prompt_logprobs] * (L - 1))

    def token_logprobs(self, logits, tokens, batch):
        """A Logprob of each row's new token for the rows that asked for one, else None."""
        rows = [i for i, r in enumerate(batch) if r.params.logprobs is not None]
        found = [None] * len(batch)
        if rows:
            wanted = log_probabilities(logits[rows, :self.tokenizer.n_vocab], tokens[rows].tolist(),
                                       [batch[i].params.logprobs for i in rows])
            for i, logprob in zip(rows, wanted):
                found[i] = logprob
        return found

    def prepare(self, batch):
        """The pass's input tokens (B, T) and its PagedCache.

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

    def draw_inputs(self, batch):
        """What the batch's draw takes (sample.sample_rows_with_noise): each row's
        temperature (B,), and Gumbel noise (B, V), fresh when some row samples."""
        temperature = torch.tensor([r.params.temperature for r in batch], dtype=torch.float32,
                                   device=self.device)
        noise = self.noise[:len(batch), :self.tokenizer.n_vocab]  # the tokenizer's tokens
        if any(r.params.temperature > 0 and not r.draws_alone for r in batch):
            # -log(E) with E = -log(U) ~ Exp(1): torch's exponential_ is ~3x slower on this
            # CPU than uniform_ and a log (64 x 4096: 8.3 ms with it, 2.5 ms without)
            noise.uniform_().log_().neg_().log_().neg_()
        return temperature, noise

    def sample(self, logits, batch, drawn=None):
        """One token per row, (B,): the batch's draw (drawn: already made inside a compiled
        step, the batch's or the lone step's greedy pick), except for the requests that draw
        alone (Request.draws_alone), each group of the same settings drawn together by
        sample(), a seeded request from its generator."""
        logits = logits[:, :self.tokenizer.n_vocab]  # padding rows of the embedding table
        tokens = drawn
        if tokens is None:
            temperature, noise = self.draw_inputs(batch)
            tokens = sample_rows_with_noise(logits, noise, temperature)
        groups = {}
        for row, r in enumerate(batch):
            if r.draws_alone:
                p = r.params
                key = (p.temperature, p.top_k, p.top_p, id(r.generator) if r.generator else None)
                groups.setdefault(key, (r.generator, []))[1].append(row)
        for (temperature, top_k, top_p, _), (generator, rows) in groups.items():
            rows = torch.tensor(rows, device=logits.device)
            tokens[rows] = sample(logits[rows], temperature, top_k, top_p, generator)[:, 0]
        return tokens

    def emit(self, request, token, logprob=None):
        """Append the token, hand out the text that is ready, retire the request if done."""
        request.tokens.append(token)
        request.text.add(token)
        reason = ("stop" if request.text.done else
                  "length" if request.num_generated >= request.params.max_tokens else None)
        request.text.done = reason is not None  # at the end, nothing is held back
        self.deliver(request, token, reason, logprob)

    def finish(self, request, reason):
        """Retire a request that did not end by itself (cancelled, or a failed step)."""
        if request.state != FINISHED:
            self.deliver(request, None, reason)

    def deliver(self, request, token, reason, logprob=None):
        end = request.text.ready()
        output = Output(request.text.text[request.shown:end], token, reason, logprob)
        request.shown = end
        request.token_times.append(time.perf_counter())
        if reason is not None:
            request.finish_reason = reason
            self.scheduler.finish(request)
        try:
            request.on_output(request, output)
        except Exception:  # a caller's bug must not stop every other request
            traceback.print_exc()

    # ------------------------------------------------------------------ running it

    def warm_up(self):
        """Run throwaway requests, alone and two together, so that the decode step is
        compiled before real requests come: torch.compile makes a size of 1 a constant, so
        a batch of one sequence is a graph of its own (unless the lone step takes it), and
        the first call with two sequences of more than one column compiles the graph that
        serves every other batch and context (a pass over one column only, a one-token
        prompt's prefill, stays eager: it would be a third graph)."""
        params = SamplingParams(max_tokens=2, temperature=0, stop_at_eot=False)
        for batch in (1, 2):
            for _ in range(batch):
                self.add_request([0, 0], params)
            self.run_until_done()

    def run_until_done(self):
        """Step until every request has finished (tests and benchmarks, no waiting)."""
        while self.has_work():
            self.step()

    def run(self):
        """The step loop: step while there is work, sleep until there is, return when
        stop() is called (from any thread, or from on_output).

        Run it on the thread that loaded the model (serve.py runs it on the main thread
        and the HTTP server on another). torch's parallel ops run on an OpenMP thread
        team that belongs to the thread calling them; a second thread doing the heavy
        work gets a second team, and libgomp, now managing more threads than there are
        cores, stops spinning between parallel regions: every matmul then waits for its
        threads to be woken. On 2 cores the engine made 1.4-2.3x fewer tokens a second
        (python -m benchmarks.serving --engine-thread background; docs/serving.md)."""
        while not self.stopping:
            with self.wakeup:
                while not self.stopping and not self.has_work():
                    self.wakeup.wait()
            try:
                self.step()
            except Exception as e:  # keep serving: fail what was in flight, free everything
                traceback.print_exc()
                message = f"{type(e).__name__}: {e}"
                self.abort_all(message)
                self.pool.forget_prefixes()  # the failed step's blocks may hold garbage
                print(f"engine: step failed, {message}; every request in flight was ended",
                      file=sys.stderr)
        self.stopping = False  # the stop is used up: run() may be called again

    def start(self):
        """run() on a new thread: for tests and notebooks, where the caller's thread is
        busy; slower (see run)."""
        self.thread = threading.Thread(target=self.run, name="engine", daemon=True)
        self.thread.start()

    def stop(self):
        """End run() after its current step (at once if it is waiting for work); a stop
        while run() is not running ends the next run() at once. Waits for start()'s thread;
        from another thread, run() on the main thread may still be finishing its step."""
        self.stopping = True
        self.notify()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()
            self.thread = None

    def abort_all(self, message):
        """End every request in flight or queued with finish_reason "error"; its caller
        gets message (a step failed, or the server is shutting down). Only when no step
        is running: from run()'s own thread, or after run() has returned."""
        while self.inbox:
            self.scheduler.add(self.inbox.popleft())
        for request in [*self.scheduler.running, *self.scheduler.waiting]:
            request.error = message
            self.finish(request, "error")

    def stats(self):
        return {"running": len(self.scheduler.running), "waiting": self.num_waiting(),
                "blocks_total": self.pool.num_blocks, "blocks_free": len(self.pool.free),
                "blocks_peak": self.peak_blocks, "tokens_per_block": self.pool.tokens_per_block,
                "preemptions": self.scheduler.preemptions, "steps": self.steps,
                "lone_steps": self.lone_steps,
                "prefilled_tokens": self.scheduler.prefilled_tokens,
                "cached_tokens": self.scheduler.cached_tokens}
