"""
Admission control: how much one request may ask of the engine, and how much work may wait.

Without limits one small request can queue unbounded work (a 10 KB body with 2,000 prompts
and n = 128 is 256,000 sequences), and a queue that only grows answers everyone late,
/health included. So, as the servers people run do (TGI's --max-concurrent-requests and
its 429 "Model is overloaded", vLLM's per-request checks):

    per request   sequences (prompts x n), prompt tokens (all its prompts together) and
                  tokens to generate (sequences x max_tokens): past a limit the request is
                  refused at once with a message naming the limit (HTTP 400);
    the queue     sequences waiting for a place in the batch, every request together: a
                  request that would take it past max_waiting is turned away at once
                  (Overloaded: HTTP 429 with Retry-After) rather than queued for minutes.

Engine.submit checks every request here before anything of it is queued, and it is the
only way into the engine (add_request goes through it), so no endpoint, present or future,
queues work around these rules. A server may also call the per-request checks early
(check_sequences before tokenizing, check_prompt_tokens while it tokenizes), to refuse
before doing the work; the engine checks again, so forgetting to costs nothing.
"""

from dataclasses import dataclass

RETRY_AFTER_S = 1  # what a 429 tells the client: the queue moves every step, try again soon
# a prompt plus max_tokens past the model's context: refuse it (as OpenAI and vLLM do), or
# accept it and re-prefill the newest half when the sequence gets there (scheduler.py)
SERVING_CONTEXT_POLICIES = ("error", "reprefill")


class RequestTooLarge(ValueError):
    """A request over a per-request limit: the client's to fix (HTTP 400). param is the
    request field to change."""

    def __init__(self, message, param, code):
        super().__init__(message)
        self.param, self.code = param, code


class Overloaded(Exception):
    """The waiting queue is full: the request is fine, the server is busy (HTTP 429)."""

    retry_after = RETRY_AFTER_S


@dataclass(frozen=True)
class Limits:
    max_sequences: int = 256          # prompts x n in one request
    max_prompt_tokens: int = 65_536   # prompt tokens of one request, its prompts together
    max_new_tokens: int = 1 << 20     # tokens one request may ask for: sequences x max_tokens
    max_waiting: int = 1024           # sequences queued for the batch, all requests together

    def __post_init__(self):
        for name, value in vars(self).items():
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_waiting < self.max_sequences:
            raise ValueError(f"max_waiting ({self.max_waiting}) is below max_sequences "
                             f"({self.max_sequences}): the largest request allowed could never wait")

    def check_sequences(self, num_prompts, n):
        if num_prompts * n > self.max_sequences:
            raise RequestTooLarge(
                f"this request asks for {num_prompts * n:,} sequences ({num_prompts:,} prompts x "
                f"n = {n}); this server takes at most {self.max_sequences:,} per request",
                "n" if n > 1 else "prompt", "too_many_sequences")

    def check_prompt_tokens(self, prompt_tokens):
        if prompt_tokens > self.max_prompt_tokens:
            raise RequestTooLarge(
                f"this request's prompts hold more than {self.max_prompt_tokens:,} tokens "
                f"together, this server's limit per request", "prompt", "too_many_prompt_tokens")

    def check_new_tokens(self, new_tokens, sequences):
        """new_tokens: the request's max_tokens summed over its sequences."""
        if new_tokens > self.max_new_tokens:
            raise RequestTooLarge(
                f"this request may generate {new_tokens:,} tokens (max_tokens over its "
                f"{sequences:,} sequences); this server takes at most {self.max_new_tokens:,} "
                "per request", "max_tokens", "too_many_tokens")

    def check_request(self, prompts, samples):
        """Every per-request limit, for prompts (lists of token ids) each sampled with each
        SamplingParams of samples."""
        self.check_sequences(len(prompts), len(samples))
        self.check_prompt_tokens(sum(map(len, prompts)))
        self.check_new_tokens(len(prompts) * sum(s.max_tokens for s in samples),
                              len(prompts) * len(samples))

    def check_room(self, waiting, arriving):
        """`waiting` sequences are queued; may `arriving` more join them?"""
        if waiting + arriving > self.max_waiting:
            raise Overloaded(f"the server is busy: {waiting:,} sequences are waiting for a place "
                             f"in the batch (its limit is {self.max_waiting:,}); retry in "
                             f"{RETRY_AFTER_S} s")
