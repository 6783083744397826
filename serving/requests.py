"""
What a caller hands the engine and what it gets back:

    SamplingParams   what one sample asks for (max_tokens, temperature, stop, ...)
    Request          a scheduler Sequence plus its SamplingParams, its text so far and
                     the callback that receives each Output
    Output           what one step gave a request: new text, the token, its Logprob, and
                     why it ended, when it did
    Logprob          a token's log-probability and the likeliest tokens at its position
"""

import time
from dataclasses import dataclass

import torch

from plumbing.text_stream import SampleText
from sample import check_sampling_args
from serving.scheduler import Sequence


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
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    logit_bias: tuple = ()  # ((token_id, bias), ...), bias in [-100, 100]
    min_tokens: int = 0
    bad_words: tuple = ()  # strings
    allowed_token_ids: tuple = None
    structured: tuple = None   # (kind, spec): kind in {"json", "json_object", "regex", "choice", "grammar"}; spec: JSON-schema dict / None / regex str / list of str / grammar str
    include_stop_str_in_output: bool = False

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
