"""
The engine: requests in, tokens out, many requests at once on one model.

    engine = Engine(model, tokenizer)
    request = engine.add_request(prompt_ids, SamplingParams(max_tokens=50), on_output)
    engine.run_until_done() # or engine.run(): the step loop, waiting for more requests
                            # (from other threads) until engine.stop()

Work enters only through submit (add_request is submit of one), which first holds it to
the admission limits (admission.py): what one request may ask, and how much may wait.

Every step has three parts, each another file's:

    1. schedule   which sequences run (scheduler.py), their blocks in the pool (paged_cache.py):
                  a decode pass and a prefill pass of the step's token budget; the
                  requests that speculate get proposals to check (speculation.py)
    2. run        each pass of the model over them and a token for each, drawn with its
                  request's settings, or a request's checked proposals (model_runner.py);
                  a prompt fed in part draws none
    3. hand out   each request gets its new text (an Output, requests.py), token by token;
                  a finished one leaves the batch and gives its blocks back

The HTTP server (server.py) and the serving benchmark (benchmarks/serving.py) are two
callers of this one loop.
"""

import sys
import threading
import time
import traceback
from collections import deque

import torch

from generation.dense_matmul import MATVEC_ROWS
from kv_quant import dtype_name
from serving.admission import Limits
from serving.model_runner import ModelRunner
from serving.paged_cache import BlockPool, check_pool_fits, default_num_blocks
from serving.requests import Output, Request, SamplingParams
from serving.scheduler import FINISHED, MAX_STEP_TOKENS, Scheduler
from serving.speculation import Draft, Lookup, add_proposals


class Engine:
    def __init__(self, model, tokenizer, num_blocks=None, tokens_per_block=16, max_batch=64,
                 max_prefill_tokens=2048, attention="kernel", limits=None, compile=False, kv_dtype=None,
                 max_step_tokens=MAX_STEP_TOKENS, speculate=0, prompt_lookup=3, draft=None):
        """num_blocks: the pool's size (default_num_blocks by default); when it runs out,
        the scheduler preempts.
        max_step_tokens: a step's token budget (scheduler.py): the decode pass's tokens,
        then prompt chunks; 0: a step is one pass, a prompt prefilled whole.
        attention: how decode steps run (model_runner.py), "kernel" (paged_attention.py: the
        step compiled whole, the paged kernel inside it; compiled at the first decode steps)
        or "gather" (eager, plain PyTorch: the pool gathered for SDPA; paged_cache.py
        compares).
        limits: admission.Limits (default: its defaults).
        compile: a request decoding alone goes through the compiled step (lone_step.py),
        built here (seconds to minutes; a copy of the weights for a float32 model, none for
        a quantized or bf16 one: compiled_step.reads_own_weights); the decode step of a
        batch is compiled with the weights frozen into it and its matmuls tuned
        (paged_attention.py), and short prefills go through it too, each token a row.
        Both hold the weights as they were: change none while the engine serves.
        model_runner.IF_CACHED (serve.py's default): the lone request's compiled step only,
        where its build is in the cache (a start with compile made it); no build here.
        kv_dtype: how the pool stores keys and values (kv_quant.KV_DTYPES; default: the
        model's dtype): "int8" or "int4" hold several times the blocks in the same bytes.
        speculate, prompt_lookup: the speculative decoding of a request whose SamplingParams
        leave them None (speculation.py): up to `speculate` tokens proposed per step (0:
        none) by prompt lookup of n-grams up to `prompt_lookup` long.
        draft: a smaller cached model with the tokenizer's ids (plumbing.cli.load_draft), whose
        greedy tokens a speculating request is proposed instead, unless its SamplingParams
        name a prompt_lookup (speculation.Draft); ValueError where its vocabulary is smaller
        than the tokenizer's."""
        if attention not in ("kernel", "gather"):
            raise ValueError(f"attention must be 'kernel' or 'gather', got {attention!r}")
        SamplingParams(speculate=speculate, prompt_lookup=prompt_lookup).check()
        self.speculation = speculate, prompt_lookup
        if draft is not None and draft.config.vocab_size < tokenizer.n_vocab:  # q must cover p's tokens
            raise ValueError(f"the draft's vocabulary of {draft.config.vocab_size} tokens is smaller "
                             f"than the tokenizer's {tokenizer.n_vocab}")
        self.draft = draft
        self.model, self.tokenizer = model, tokenizer
        self.limits = Limits() if limits is None else limits
        config, weight = model.config, model.lm_head.weight
        self.device = weight.device
        kv_dtype = kv_dtype or dtype_name(weight.dtype)
        if num_blocks is None:
            num_blocks = default_num_blocks(config, tokens_per_block, max_batch, kv_dtype)
        check_pool_fits(config, num_blocks, tokens_per_block, kv_dtype)
        self.pool = BlockPool(config, num_blocks, tokens_per_block, self.device, weight.dtype, kv_dtype)
        self.scheduler = Scheduler(self.pool, config.context_len, max_batch, max_prefill_tokens,
                                   max_step_tokens)
        self.runner = ModelRunner(model, self.pool, tokenizer.n_vocab, max_batch, attention, compile)
        self.inbox, self.cancelled = deque(), deque()  # from other threads (deque is thread-safe)
        self.admitting = threading.Lock()  # one submit at a time: the queue's bound holds
        self.wakeup = threading.Condition()
        self.thread, self.stopping = None, False
        # each called on the engine's thread once a pass's outputs (or the cancellations')
        # are all handed to on_output: a server sends them then (server.HandOut)
        self.after_hand_out = []
        self.peak_blocks, self.steps = 0, 0
        self.proposed_tokens = self.accepted_tokens = 0  # speculative decoding, summed over requests

    # ------------------------------------------------------------------ the caller's side
    # (any thread)

    def submit(self, prompts, samples, on_output=lambda request, output: None, processors=None):
        """Queue one caller's request: every prompt (token ids) sampled with each
        SamplingParams of samples, all or nothing. Returns the Requests, prompt-major
        (prompt i's sample j is [i * len(samples) + j]); on_output(request, Output) is called
        from the engine's thread for every token, the last one with a finish_reason.
        processors: each sample's params.processors(), when the caller made them already
        (the server does, off its event loop: a grammar may take seconds to compile).

        Raises ValueError for a bad prompt or setting, admission.RequestTooLarge past a
        per-request limit and admission.Overloaded when the waiting queue is full, in each
        case before anything is queued."""
        for params in samples:
            params.check()
        if processors is None:  # token ids checked and constraints compiled, once per SamplingParams
            processors = [params.processors(self.tokenizer, self.tokenizer.n_vocab) for params in samples]
        context_len = self.model.config.context_len
        for params in samples:
            if self.speculation_of(params)[0] >= context_len:
                raise ValueError(f"speculate must be below the model's context ({context_len}): a "
                                 f"step feeds the newest token and the proposals")
        for prompt in prompts:
            if not 1 <= len(prompt) <= context_len:
                raise ValueError(f"a prompt must have 1 to {context_len} tokens "
                                 f"(the model's context), got {len(prompt)}")
        self.limits.check_request(prompts, samples)
        with self.admitting:
            self.limits.check_room(self.num_waiting(), len(prompts) * len(samples))
            requests = [Request(prompt, params, on_output, self.tokenizer, self.device, row,
                                self.lookup_for(params, prompt))
                        for prompt in prompts for params, row in zip(samples, processors)]
            self.inbox.extend(requests)
        self.notify()
        return requests

    def speculation_of(self, params):
        """(k, max_ngram): a request's own settings, or the engine's where it has none."""
        k, n = self.speculation
        return (k if params.speculate is None else params.speculate,
                n if params.prompt_lookup is None else params.prompt_lookup)

    def lookup_for(self, params, prompt):
        """A speculating request's proposer: the draft's, or prompt lookup (a request naming
        prompt_lookup, or an engine without a draft); None for one that does not speculate."""
        k, max_ngram = self.speculation_of(params)
        if not k:
            return None
        if self.draft is not None and params.prompt_lookup is None:
            return Draft(self.draft, k, self.tokenizer.n_vocab)
        return Lookup(k, max_ngram, prompt)

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
        """Decode and prefill once; returns False when there was nothing to do."""
        while self.inbox:
            self.scheduler.add(self.inbox.popleft())
        while self.cancelled:
            self.finish(self.cancelled.popleft(), "cancelled")
        self.handed_out()  # the cancellations' last outputs, if any
        passes = self.scheduler.schedule()                     # 1. schedule
        if not passes:
            return False
        for batch in passes:
            self.run_pass(batch)
            self.handed_out()
        self.steps += 1
        return True

    def run_pass(self, batch):
        """One pass of a step: proposals added, the model run, proposals checked and rolled
        back, each request's new tokens handed out."""
        self.proposed_tokens += add_proposals(batch, self.scheduler)
        self.peak_blocks = max(self.peak_blocks, self.pool.num_used())
        tokens, logprobs = self.runner.run(batch)              # 2. run
        drawn = [r for r in batch if not r.unfed]  # a prompt fed in part: no token yet
        for request, new in zip(drawn, tokens):
            if request.proposed:  # all but the last new token are accepted proposals
                self.accepted_tokens += len(new) - 1
                request.lookup.checked(request.proposed, len(new) - 1)
                self.scheduler.rollback(request, len(new) - 1)
        self.scheduler.computed(batch)
        for request, new, new_logprobs in zip(drawn, tokens, logprobs):  # 3. hand out
            if request.params.max_tokens == 0:  # the prefill was all it asked for
                request.text.done = True
                self.deliver(request, None, "length")
                continue
            for token, logprob in zip(new, new_logprobs):
                if request.state == FINISHED:  # a stop string among the accepted tokens
                    break
                self.emit(request, token, logprob)

    def emit(self, request, token, logprob=None):
        """Append the token, hand out the text that is ready, retire the request if done.
        A token < 0: its logits processors left the request no token (a constraint it cannot
        meet): it ends, "length" as for max_tokens, its text a valid prefix."""
        if token < 0:
            request.text.done = True
            return self.deliver(request, None, "length", logprob)
        if request.processing is not None:
            request.processing.accept([token])
        request.tokens.append(token)
        request.text.add(token)
        reason = ("stop" if request.text.done else
                  "length" if request.num_generated >= request.params.max_tokens else None)
        request.text.done = reason is not None  # at the end, nothing is held back
        self.deliver(request, token, reason, logprob)

    def handed_out(self):
        for hook in self.after_hand_out:
            hook()

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
        """Run throwaway requests, alone, two together and a few more than MATVEC_ROWS
        together, so that the decode step is compiled before real requests come:
        torch.compile makes a size of 1 a constant, so a batch of one sequence is a graph of
        its own (unless the lone step takes it); the first call with two sequences of more
        than one column compiles the graph that serves every other batch and context; and
        a model with DenseLinears (bf16 weights) multiplies up to MATVEC_ROWS rows through
        our kernel and more through oneDNN, a branch on the rows that makes a third graph
        (compiled by the first burst of requests otherwise: 7 s of their first tokens on
        the bundled model). A pass over one column only, a one-token prompt's prefill,
        stays eager: it would be a graph more."""
        params = SamplingParams(max_tokens=2, temperature=0, stop_at_eot=False)
        past_few_rows = min(self.scheduler.max_batch, MATVEC_ROWS + 1)
        for batch in sorted({1, 2, past_few_rows}):
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
        self.handed_out()

    def stats(self):
        return {"running": len(self.scheduler.running), "waiting": self.num_waiting(),
                "blocks_total": self.pool.num_blocks, "blocks_free": len(self.pool.free),
                "blocks_peak": self.peak_blocks, "tokens_per_block": self.pool.tokens_per_block,
                "kv_dtype": self.pool.kv_dtype, "pool_bytes": self.pool.nbytes(),
                "full_contexts": self.pool.full_contexts(self.model.config.context_len),
                "preemptions": self.scheduler.preemptions, "steps": self.steps,
                "lone_steps": self.runner.lone_steps,
                "prefilled_tokens": self.scheduler.prefilled_tokens,
                "cached_tokens": self.scheduler.cached_tokens,
                "proposed_tokens": self.proposed_tokens, "accepted_tokens": self.accepted_tokens}
